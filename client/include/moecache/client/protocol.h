// The wire protocol between moecached and its clients (docs/protocol.md): one message per
// SOCK_SEQPACKET packet, little-endian, a fixed header and a body whose layout the type fixes.
// Descriptors travel beside a message as SCM_RIGHTS. Both ends decode with decode(), which trusts
// nothing: every length, count, string and descriptor count is checked against the message type
// and the packet's real size, and a failure says what and at which byte.
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

namespace moecache::protocol {

inline constexpr uint32_t kMagic = 0x3150434d;  // "MCP1" as little-endian bytes
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kMaxMessageBytes = 4096;
inline constexpr size_t kHeaderBytes = 16;       // magic u32, type u16, version u16, length u32, request u32
inline constexpr size_t kMaxName = 64;           // a client's name
inline constexpr size_t kMaxErrorText = 1024;
inline constexpr uint32_t kMaxModelFiles = 64;   // descriptors of one model (a split set)
inline constexpr uint32_t kMinRingBytes = 4096, kMaxRingBytes = 64u << 20;

enum class Type : uint16_t {
    // client -> daemon
    Hello = 1,
    RegisterModel = 2,
    DescribeMapping = 3,
    TelemetrySetup = 4,
    Goodbye = 5,
    ExpertPlacement = 6,
    PoolStats = 7,
    Unmapped = 8,
    // daemon -> client
    HelloReply = 128,
    Ok = 129,
    Failure = 130,
    ModelRegistered = 131,
    Directive = 132,
    VramPolicy = 133,
};
const char* to_string(Type t);

struct Hello {
    uint16_t min_version = kVersion, max_version = kVersion;
    std::string name;  // what the client calls itself, for logs: printable ASCII, <= kMaxName
    bool operator==(const Hello&) const = default;
};
// The model's files follow as descriptors, part 1 first: as many as `files`.
struct RegisterModel {
    uint32_t files = 0;
    bool operator==(const RegisterModel&) const = default;
};
// Where the client maps file `file` of model `model`: [address, address + length) holds the file's
// bytes from `file_offset`.
struct DescribeMapping {
    uint32_t model = 0, file = 0;
    uint64_t address = 0, length = 0, file_offset = 0;
    bool operator==(const DescribeMapping&) const = default;
};
// One descriptor follows: a memfd of ring_bytes holding the client's telemetry ring.
struct TelemetrySetup {
    uint32_t ring_bytes = 0;
    bool operator==(const TelemetrySetup&) const = default;
};
struct Goodbye {
    bool operator==(const Goodbye&) const = default;
};
// Where an expert of a registered model now lives for this client: every slice of it in the VRAM
// pool of `device`, or (device kHostTier) no longer in any pool. The daemon keeps one copy: it
// unlocks and drops the RAM pages of an expert in VRAM, unless configured to keep both.
inline constexpr uint32_t kHostTier = UINT32_MAX;
struct ExpertPlacement {
    uint32_t model = 0, block = 0, expert = 0;
    uint32_t device = kHostTier;
    bool operator==(const ExpertPlacement&) const = default;
};
// How the copies a VRAM pool misses reach its device. With every expert's math on the GPU
// (GGML_OP_OFFLOAD_MIN_BATCH=1) each token's misses cross the link on the critical path: only the
// registered paths (DMA straight from page-locked pages) decode at least as fast as computing the
// experts on the CPU (llama.cpp's default); on every other one the hook says so, and why.
enum class MissPath : uint8_t {
    Unknown = 0,               // not said (a client from before this)
    Registered = 1,            // every expert registered for DMA: at the link's speed
    DaemonLocks = 2,           // what the daemon keeps locked at the link's speed, the rest from storage
    StagedChosen = 3,          // MOECACHE_CUDA_PIN=staging: copied into pinned buffers on the way
    PageableChosen = 4,        // MOECACHE_CUDA_PIN=off: from pageable memory, as the runtime asks
    StagedOverBudget = 5,      // the models are larger than the pin budget and no daemon chooses
    StagedRegisterFailed = 6,  // the driver would not register the model's pages
    SlowLink = 7,              // registered, but the link to the device is slower than host memory
};
inline constexpr uint8_t kLastMissPath = 7;
// Whether decode on this path is expected at least as fast as with the experts on the CPU.
[[nodiscard]] bool is_fast(MissPath p);
// Its name in metrics ("registered", "pageable-chosen", ...), what it means and what to do, in
// words: the hook's line at start and moecachectl status say the same.
[[nodiscard]] const char* to_string(MissPath p);
[[nodiscard]] const char* reason_of(MissPath p);
[[nodiscard]] const char* advice_for(MissPath p);

// How a client's VRAM pool on `device` has served expert copies since the client started
// (cumulative: the daemon takes differences): slices copied from the pool and from the host, and
// the pool's size now; how its misses reach the device. One-way, resent as it changes.
inline constexpr uint32_t kMaxPoolDevices = 64;
struct PoolStats {
    uint32_t device = 0;  // < kMaxPoolDevices
    uint64_t hits = 0, misses = 0;            // slices
    uint64_t hit_bytes = 0, miss_bytes = 0;   // bytes copied from the pool / from the host
    uint64_t pool_bytes = 0;                  // allocated now
    // A trailing byte, present only when known (not Unknown): older daemons refuse a message with
    // it (nothing may follow a message's fields) and the client reconnects; both are upgraded together.
    MissPath miss_path = MissPath::Unknown;
    bool operator==(const PoolStats&) const = default;
};
// Host-to-device copies of a megabyte or more from memory that maps no model the client knows
// (cumulative, since the client started), and whether it maps any model at all: a runtime that
// loaded its model without mmap, whose experts moecache cannot see. One-way, resent as it grows.
struct Unmapped {
    uint64_t copies = 0, bytes = 0;
    bool no_model = false;
    bool operator==(const Unmapped&) const = default;
};
struct HelloReply {
    uint16_t version = kVersion;
    uint32_t client_id = 0;
    bool operator==(const HelloReply&) const = default;
};
struct Ok {
    bool operator==(const Ok&) const = default;
};
struct Failure {
    int32_t errnum = 0;  // an errno value, 0 when none applies
    std::string text;    // printable ASCII, <= kMaxErrorText
    bool operator==(const Failure&) const = default;
};
struct ModelRegistered {
    uint32_t model = 0, layers = 0, experts = 0, files = 0;
    bool operator==(const ModelRegistered&) const = default;
};
// Lock/Unlock: the daemon locked or let go of an expert in RAM. Promote: keep the expert in the VRAM
// pool (admit it at its next miss, over anything not promoted); Unpromote: the pool's own policy
// decides again; Demote: take it out of the pool now. Shifted: the model's routing shifted (the
// daemon's heat saw it and cut what it learnt before): the pool cuts its own use counts of the model
// as well (block and expert 0).
enum class Action : uint8_t { Promote = 1, Demote = 2, Lock = 3, Unlock = 4, Unpromote = 5, Shifted = 6 };
struct Directive {
    Action action = Action::Lock;
    uint32_t model = 0, block = 0, expert = 0;
    bool operator==(const Directive&) const = default;
};

// What the daemon asks of a client's VRAM pool on `device` (kAllDevices: on each one): at most
// pool_bytes (kNoPoolLimit: the client decides), and whether an expert in the pool should leave RAM
// (one place) or keep its RAM copy too.
inline constexpr uint32_t kAllDevices = UINT32_MAX;
inline constexpr uint64_t kNoPoolLimit = UINT64_MAX;
struct VramPolicy {
    uint32_t device = kAllDevices;
    uint64_t pool_bytes = kNoPoolLimit;
    bool one_place = true;
    // The part of the pool the daemon does not direct ranks by recency (an LRU), not by the
    // hook's counts: the daemon's split learnt that the routing reuses what it just used. A
    // trailing byte 1, sent only when on (absent: off, as from daemons before it). A client older
    // than it refuses such a message (nothing may follow a message's fields), hangs up and
    // reconnects: daemon and clients are upgraded together.
    bool recency = false;
    bool operator==(const VramPolicy&) const = default;
};

using Body = std::variant<Hello, RegisterModel, DescribeMapping, TelemetrySetup, Goodbye, ExpertPlacement, PoolStats, Unmapped,
                          HelloReply, Ok, Failure, ModelRegistered, Directive, VramPolicy>;

struct Message {
    uint32_t request = 0;  // chosen by the client; a reply carries the request it answers
    Body body;
    bool operator==(const Message&) const = default;
};

[[nodiscard]] Type type_of(const Body& b);
// How many descriptors a message of this body travels with.
[[nodiscard]] uint32_t descriptors_of(const Body& b);

std::vector<uint8_t> encode(const Message& m);
// Sends one packet on a SOCK_SEQPACKET socket with `fds` as SCM_RIGHTS (none: a plain send).
// Blocks as the socket does; never raises SIGPIPE.
Result<void> send_packet(int socket, std::span<const uint8_t> bytes, std::span<const int> fds = {});
// `bytes` is one whole packet as received; `descriptors` how many came with it (SCM_RIGHTS).
Result<Message> decode(std::span<const uint8_t> bytes, size_t descriptors);

}  // namespace moecache::protocol
