#include "moecache/cuda/dma_ranges.h"

#include <algorithm>
#include <thread>

namespace moecache::cuda {

void add_range(HostRanges& set, HostRange r) {
    const auto at = std::lower_bound(set.begin(), set.end(), r.start,
                                     [](const HostRange& x, uintptr_t start) { return x.start < start; });
    set.insert(at, r);
}

bool remove_range(HostRanges& set, uintptr_t start) {
    const auto at = std::lower_bound(set.begin(), set.end(), start,
                                     [](const HostRange& x, uintptr_t s) { return x.start < s; });
    if (at == set.end() || at->start != start) return false;
    set.erase(at);
    return true;
}

bool crosses_an_edge(const HostRanges& set, uintptr_t src, size_t n) {
    size_t pieces = 0;
    (void)for_each_piece(set, src, n, [&](size_t, size_t) { return ++pieces < 2; });
    return pieces > 1;
}

unsigned CopyGrace::enter() {
    const auto slot = static_cast<unsigned>(epoch_.load(std::memory_order_seq_cst) & 1);
    in_[slot].fetch_add(1, std::memory_order_seq_cst);
    return slot;
}

void CopyGrace::leave(unsigned slot) { in_[slot].fetch_sub(1, std::memory_order_release); }

bool CopyGrace::drain(unsigned slot, std::chrono::steady_clock::time_point until) {
    // Copies reach the driver in microseconds; one from pageable memory, or a synchronous one
    // behind a long kernel, takes longer: spin a little, then sleep.
    for (int spins = 0; in_[slot].load(std::memory_order_seq_cst) != 0; ++spins) {
        if (std::chrono::steady_clock::now() >= until) return false;
        if (spins < 64) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
}

// Two flips: a reader that read the epoch before the first flip but counted itself only after the
// writer looked at its counter read the ranges after they were published; every reader that
// counted itself before the publication is in one of the two counters, each of which drains once.
bool CopyGrace::wait_for_readers(std::chrono::steady_clock::duration patience) {
    const auto until = std::chrono::steady_clock::now() + patience;
    for (int flip = 0; flip < 2; ++flip) {
        const uint64_t e = epoch_.fetch_add(1, std::memory_order_seq_cst);
        if (!drain(static_cast<unsigned>(e & 1), until)) return false;
    }
    return true;
}

int64_t CopyGrace::readers() const { return in_[0].load() + in_[1].load(); }

}  // namespace moecache::cuda
