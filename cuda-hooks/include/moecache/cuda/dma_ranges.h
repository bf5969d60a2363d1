// Host memory the hook registers for DMA, and the one rule of the driver that makes registering
// memory the runtime also copies from dangerous: a host-to-device copy that starts in registered
// memory and ends outside it is refused (CUDA_ERROR_INVALID_VALUE). A registration of a run of
// expert tensors shares its edge pages with the tensors beside it (the next layer's attention
// weights, the router), which the runtime copies to the GPU while it loads: had a registration
// landed first, that copy failed, and llama.cpp aborted.
//
// So every host-to-device copy that passes through the hook is cut at the edges of the ranges
// registered (or about to be), and a range is registered only after every copy that may have
// planned without it has reached the driver (CopyGrace). Pure: no CUDA, tested in CI.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moecache::cuda {

// [start, end) of host addresses.
struct HostRange {
    uintptr_t start = 0, end = 0;
    bool operator==(const HostRange&) const = default;
};

// Disjoint ranges sorted by start.
using HostRanges = std::vector<HostRange>;

// `r` added (it overlaps none there: the driver refuses overlapping registrations) / the range
// starting at `start` removed; false when there is none such.
void add_range(HostRanges& set, HostRange r);
bool remove_range(HostRanges& set, uintptr_t start);

// The pieces a host-to-device copy of [src, src + n) is issued in so that none starts inside a
// range of `set` and ends outside it: cut at every edge of a range strictly inside the copy. Each
// piece then lies wholly inside one range or wholly outside all of them, which the driver takes
// whether or not the range is registered yet. Calls piece(offset, bytes) in order and stops at the
// first call that returns false; returns false then.
template <class Piece>
bool for_each_piece(const HostRanges& set, uintptr_t src, size_t n, Piece&& piece) {
    const uintptr_t end = src + n;
    uintptr_t at = src;
    // The first range that ends after src.
    size_t lo = 0, hi = set.size();
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (set[mid].end <= src) lo = mid + 1;
        else hi = mid;
    }
    for (size_t i = lo; i < set.size() && set[i].start < end; ++i) {
        for (const uintptr_t edge : {set[i].start, set[i].end}) {
            if (edge <= at || edge >= end) continue;
            if (!piece(static_cast<size_t>(at - src), static_cast<size_t>(edge - at))) return false;
            at = edge;
        }
    }
    return n == 0 || piece(static_cast<size_t>(at - src), static_cast<size_t>(end - at));
}

// Whether a copy of [src, src + n) needs cutting: it crosses an edge of some range.
bool crosses_an_edge(const HostRanges& set, uintptr_t src, size_t n);

// Readers are copies on their way to the driver; the writer is the thread that registers memory.
// A copy enters before it reads the published ranges and leaves once the driver has its pieces;
// the writer publishes a new range, then waits (wait_for_readers) until every copy that entered
// before that has left, and only then registers it. A copy that entered later read the new range
// and was cut at its edges. Two counters, flipped by the writer, so that a steady stream of copies
// cannot hold it back (sleepable RCU's scheme). Enter and leave are one atomic add each.
class CopyGrace {
public:
    class Reader {
    public:
        explicit Reader(CopyGrace& g) : g_(g), slot_(g.enter()) {}
        ~Reader() { g_.leave(slot_); }
        Reader(const Reader&) = delete;
        Reader& operator=(const Reader&) = delete;

    private:
        CopyGrace& g_;
        unsigned slot_;
    };
    // Waits until every reader that entered before the call has left, at most `patience`; false if
    // one had not (the writer then must not register what it published: a copy may still plan
    // without it).
    bool wait_for_readers(std::chrono::steady_clock::duration patience);
    // Readers in flight (both counters), for tests.
    [[nodiscard]] int64_t readers() const;

private:
    unsigned enter();
    void leave(unsigned slot);
    bool drain(unsigned slot, std::chrono::steady_clock::time_point until);

    std::atomic<uint64_t> epoch_{0};
    std::atomic<int64_t> in_[2] = {0, 0};
};

}  // namespace moecache::cuda
