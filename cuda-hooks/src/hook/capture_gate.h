// Stream capture and the hook's own synchronisations. A runtime records CUDA graphs by capturing a
// stream (llama.cpp does for every decoding step, in relaxed mode); a context synchronisation, a
// cuMemFree or a module load while any stream of the context is capturing invalidates that capture
// ("operation failed due to a previous error during capture") and the runtime aborts. The hook's
// background thread needs such synchronisations (before it unregisters pages a queued copy may
// still read, before it frees a pool's arena): it takes the gate, which waits until no capture is
// open and keeps new ones from opening (their cuStreamBeginCapture waits) while it works.
// Captures are short (a graph's launches), so both sides wait little.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace moecache::cuda::hook {

class CaptureGate {
public:
    // A runtime's cuStreamBeginCapture, before the driver's: waits while the hook synchronises.
    void begin();
    // A capture ended (cuStreamEndCapture), or its begin failed.
    void end();
    // Runs `fn` with no capture open anywhere in the process and none opening. A capture left open
    // for longer than kPatience (a runtime that gave one up without ending it) is waited for no
    // longer: `fn` runs then all the same, and stale() counts it.
    template <class Fn>
    void exclusive(Fn&& fn) {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return !syncing_; });
        if (!cv_.wait_for(lock, kPatience, [&] { return open_ == 0; })) ++stale_;
        syncing_ = true;
        lock.unlock();
        struct Done {
            CaptureGate& g;
            ~Done() {
                std::lock_guard l(g.mu_);
                g.syncing_ = false;
                g.cv_.notify_all();
            }
        } done{*this};
        fn();
    }
    [[nodiscard]] uint64_t waits() const;  // times a begin waited for the hook
    [[nodiscard]] uint64_t stale() const;  // times the hook stopped waiting for an open capture
    static constexpr std::chrono::seconds kPatience{2};

private:
    mutable std::mutex mu_;
    std::condition_variable cv_;
    uint32_t open_ = 0;
    bool syncing_ = false;
    uint64_t waits_ = 0, stale_ = 0;
};

// The process's gate (the hook's entry points and its background thread share it).
CaptureGate& capture_gate();

}  // namespace moecache::cuda::hook
