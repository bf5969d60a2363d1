// The telemetry ring: router decisions from one client to the daemon through shared memory, one
// producer (the client's inference thread) and one consumer (the daemon's loop), no system call
// per event. The client makes it (a sealed memfd: the daemon can trust its size, so a client
// cannot make it fault by shrinking it) and passes the descriptor with TelemetrySetup. When the
// ring is full, push() counts the event as overflow and returns at once: the inference thread is
// never blocked. The consumer treats everything in the ring as hostile: positions that cannot be,
// record fields out of range.
//
// Layout (docs/protocol.md): a 64-byte header, the producer's cache line (head, overflow), the
// consumer's (tail), then a power-of-two number of 64-byte records.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <cstdint>
#include <span>

namespace moecache::telemetry {

inline constexpr uint32_t kRingMagic = 0x3152434d;  // "MCR1"
inline constexpr uint32_t kRingVersion = 1;
inline constexpr size_t kRecordBytes = 64;
inline constexpr size_t kRingHeaderBytes = 192;
inline constexpr uint32_t kMaxExpertsPerRecord = 22;

// A record's flags (docs/protocol.md); other bits are ignored.
inline constexpr uint8_t kRecordContinued = 1;  // more experts of the decision in the record before

// One router decision: `tokens` tokens of a batch routed MoE block `block` of `model` (the id
// the daemon gave) to `experts`. A decision larger than a record holds goes as several records in
// a row, the later ones `continued` with 0 tokens: the reader joins them into one decision. A
// record of 0 tokens that is not continued is a decision of its own, part of the batch before it
// (moecache/batch_report.h: its ranking).
struct RoutingEvent {
    uint64_t time_ns = 0;  // CLOCK_MONOTONIC
    uint32_t model = 0;
    uint16_t block = 0;
    uint8_t n_experts = 0;
    bool continued = false;
    uint32_t tokens = 0;
    uint16_t experts[kMaxExpertsPerRecord] = {};
};

struct RingCounters {
    uint64_t pushed = 0, overflow = 0, consumed = 0;
};

class TelemetryRing {
public:
    // The client side: a new ring of (at most) ring_bytes, in a sealed memfd.
    static Result<TelemetryRing> create(uint32_t ring_bytes);
    // The daemon side: maps a client's descriptor after checking its size, seals and header.
    static Result<TelemetryRing> attach(int fd, uint32_t ring_bytes);

    TelemetryRing(TelemetryRing&&) noexcept;
    TelemetryRing& operator=(TelemetryRing&&) noexcept;
    ~TelemetryRing();

    // Producer. Never blocks; false (and overflow counted) when the ring is full.
    bool push(const RoutingEvent& e);
    // Consumer: hands up to max records to fn(const RoutingEvent&); fails if the ring's positions
    // are impossible (the client scribbled on them): the caller should stop reading this ring.
    template <class Fn>
    Result<size_t> consume(Fn&& fn, size_t max = SIZE_MAX);

    [[nodiscard]] int fd() const { return fd_.get(); }
    [[nodiscard]] uint32_t capacity() const { return capacity_; }
    [[nodiscard]] RingCounters counters() const;

private:
    TelemetryRing() = default;
    Result<size_t> consume_raw(void (*fn)(void*, const RoutingEvent&), void* ctx, size_t max);

    UniqueFd fd_;
    uint8_t* base_ = nullptr;
    size_t bytes_ = 0;
    uint32_t capacity_ = 0;  // records; the consumer's own copy, never re-read from the ring
    uint64_t consumed_ = 0;
};

template <class Fn>
Result<size_t> TelemetryRing::consume(Fn&& fn, size_t max) {
    return consume_raw([](void* ctx, const RoutingEvent& e) { (*static_cast<std::remove_reference_t<Fn>*>(ctx))(e); },
                       &fn, max);
}

}  // namespace moecache::telemetry
