#include "capture_gate.h"

namespace moecache::cuda::hook {

void CaptureGate::begin() {
    std::unique_lock lock(mu_);
    if (syncing_) ++waits_;
    cv_.wait(lock, [&] { return !syncing_; });
    ++open_;
}

void CaptureGate::end() {
    std::lock_guard lock(mu_);
    if (open_ > 0) --open_;
    cv_.notify_all();
}

uint64_t CaptureGate::waits() const {
    std::lock_guard lock(mu_);
    return waits_;
}

uint64_t CaptureGate::stale() const {
    std::lock_guard lock(mu_);
    return stale_;
}

CaptureGate& capture_gate() {
    static CaptureGate* gate = new CaptureGate();  // never destroyed: entry points may run at exit
    return *gate;
}

}  // namespace moecache::cuda::hook
