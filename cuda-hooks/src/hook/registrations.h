// The host memory the hook registers for DMA (page-locked, read-only), kept so that no copy in the
// process is refused for it. The driver refuses a host-to-device copy that starts in registered
// memory and ends outside it; the hook registers pages of the model mapping that the runtime copies
// from too (the edges of a run of expert tensors are the next tensors' first bytes), so every copy
// that passes through the hook is issued in pieces cut at the registrations' edges
// (moecache/cuda/dma_ranges.h), and a range is handed to the driver only after every copy that may
// have planned without it has reached the driver.
//
// Threads: any thread copies (inside a hooked call, holding a CopyGrace::Reader of grace());
// one thread, the hook's background thread, registers and unregisters.
#pragma once

#include "cuda_api.h"
#include "moecache/cuda/dma_ranges.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace moecache::cuda::hook {

struct Driver;

class Registrations {
public:
    // What a hooked copy holds from before it reads the ranges until the driver has its pieces.
    CopyGrace& grace() { return grace_; }

    // A host-to-device copy of [src, src + n) as pieces the driver accepts whatever is registered:
    // issue(offset, bytes) for each, in order; the first error stops it and is returned. Call it
    // holding a reader of grace() (the background thread, the only writer, needs none).
    template <class Issue>
    CUresult in_pieces(const void* src, size_t n, Issue&& issue) const {
        const HostRanges* set = published_.load(std::memory_order_seq_cst);
        if (set == nullptr || set->empty()) return issue(size_t{0}, n);
        CUresult r = CUDA_SUCCESS;
        (void)for_each_piece(*set, reinterpret_cast<uintptr_t>(src), n, [&](size_t off, size_t bytes) {
            r = issue(off, bytes);
            return r == CUDA_SUCCESS;
        });
        return r;
    }
    // Whether a copy of [src, src + n) would be cut (for copies the hook cannot issue in pieces).
    [[nodiscard]] bool would_cut(const void* src, size_t n) const;

    // Background thread only. Registers each [p, p + bytes) (page-aligned, none overlapping one
    // registered) with `flags`; its result in `result` (CUDA_ERROR_NOT_READY: not now, a copy did not
    // reach the driver in time: ask again later).
    struct Request {
        void* p = nullptr;
        size_t bytes = 0;
        CUresult result = CUDA_ERROR_NOT_READY;
    };
    void add(const Driver* drv, std::vector<Request>& requests, unsigned flags);
    // Unregisters the registration starting at p (the caller made sure no queued copy still reads it).
    CUresult remove(const Driver* drv, void* p);
    // How long a registration waits for copies under way before it gives up for this turn.
    static constexpr auto kPatience = std::chrono::seconds(5);

private:
    void publish(const HostRanges& set);

    CopyGrace grace_;
    std::atomic<const HostRanges*> published_{nullptr};
    // Background thread only: what is registered or about to be, and snapshots readers may still hold.
    HostRanges current_;
    std::vector<std::unique_ptr<const HostRanges>> retired_;
    std::unique_ptr<const HostRanges> live_;
};

// The process's registrations (the hooked entry points and the background thread share them).
Registrations& registrations();

// A host-to-device copy the hook queues itself (a miss, a staging buffer's fallback), in pieces as
// registrations().in_pieces cuts them.
CUresult htod_in_pieces(const Driver* drv, CUdeviceptr dst, const void* src, size_t n, CUstream stream);

}  // namespace moecache::cuda::hook
