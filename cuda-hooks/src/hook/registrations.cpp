#include "registrations.h"

#include "driver.h"

#include <cstdint>

namespace moecache::cuda::hook {

Registrations& registrations() {
    static Registrations* r = new Registrations;  // never destroyed: hooked calls may come at exit
    return *r;
}

CUresult htod_in_pieces(const Driver* drv, CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
    return registrations().in_pieces(src, n, [&](size_t off, size_t bytes) {
        return drv->memcpy_htod_async(dst + off, static_cast<const uint8_t*>(src) + off, bytes, stream);
    });
}

bool Registrations::would_cut(const void* src, size_t n) const {
    const HostRanges* set = published_.load(std::memory_order_seq_cst);
    return set != nullptr && crosses_an_edge(*set, reinterpret_cast<uintptr_t>(src), n);
}

// The old snapshot is kept until a grace period has passed (a reader may still be cutting by it).
void Registrations::publish(const HostRanges& set) {
    auto next = std::make_unique<const HostRanges>(set);
    published_.store(next.get(), std::memory_order_seq_cst);
    if (live_) retired_.push_back(std::move(live_));
    live_ = std::move(next);
}

void Registrations::add(const Driver* drv, std::vector<Request>& requests, unsigned flags) {
    if (requests.empty()) return;
    const HostRanges before = current_;
    for (const auto& q : requests)
        add_range(current_, {reinterpret_cast<uintptr_t>(q.p), reinterpret_cast<uintptr_t>(q.p) + q.bytes});
    publish(current_);
    // Every copy that read the ranges before they held these has reached the driver: from here on
    // each copy is cut at their edges, so registering them cannot make one start inside and end
    // outside. Not in time (a copy stuck behind a long kernel): nothing is registered this turn.
    if (!grace_.wait_for_readers(kPatience)) {
        current_ = before;
        publish(current_);
        for (auto& q : requests) q.result = CUDA_ERROR_NOT_READY;
        return;
    }
    retired_.clear();  // every reader of them has left
    bool failed = false;
    for (auto& q : requests) {
        q.result = drv->mem_host_register(q.p, q.bytes, flags);
        if (q.result != CUDA_SUCCESS) {
            (void)remove_range(current_, reinterpret_cast<uintptr_t>(q.p));
            failed = true;
        }
    }
    if (failed) publish(current_);
}

CUresult Registrations::remove(const Driver* drv, void* p) {
    // Unregistered first: until the range leaves the published set, copies are still cut at its
    // edges, which the driver takes either way; the other order would let a copy planned without
    // it straddle memory still registered.
    const CUresult r = drv->mem_host_unregister(p);
    if (remove_range(current_, reinterpret_cast<uintptr_t>(p))) publish(current_);
    // Snapshots of removals pile up until the next grace period: make one now and then.
    if (retired_.size() > 64 && grace_.wait_for_readers(std::chrono::milliseconds(100))) retired_.clear();
    return r;
}

}  // namespace moecache::cuda::hook
