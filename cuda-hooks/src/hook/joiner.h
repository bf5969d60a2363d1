// How a stream that is about to use pool slots is ordered after the streams that used them last
// (VramPool's StreamOrder over the device's stream table): the copy path's and the pool fill's.
// Under the pool's device lock.
#pragma once

#include "driver.h"
#include "engine.h"

namespace moecache::cuda::hook {

// Orders the copy's stream after another stream's work on pool slots, at most once per stream and
// copy: the other stream's event is recorded if it queued slot work since its last record, and
// waited for unless it has completed already.
class Engine::Joiner final : public StreamOrder {
public:
    // `caller`: the device whose context is current (a peer's, when it reads this pool).
    Joiner(DevicePool& dp, const Driver* drv, CUstream mine, int caller) : dp_(dp), drv_(drv), mine_(mine), caller_(caller) {}
    bool join(StreamId from) override {
        for (int i = 0; i < n_; ++i)
            if (joined_[i] == from) return true;
        if (from == 0 || from > dp_.streams.size()) return fail(0);
        auto& st = dp_.streams[from - 1];
        if (!st.idle) {
            if (st.dirty) {
                if (st.retired) return fail(1);
                if (st.eager) return fail(2);
                if (st.event == nullptr && !create_event(st)) return fail(3);
                if (drv_->event_record(st.event, st.handle) != CUDA_SUCCESS) return fail(4);
                st.dirty = false;
            }
            if (st.event == nullptr) return fail(5);
            const CUresult q = drv_->event_query(st.event);
            if (q == CUDA_SUCCESS) st.idle = true;
            else if (q != CUDA_ERROR_NOT_READY) return fail(6);
            else if (drv_->stream_wait_event(mine_, st.event, 0) != CUDA_SUCCESS) return fail(7);
        }
        if (n_ < kRemembered) joined_[n_++] = from;
        ++joins;
        return true;
    }
    uint64_t joins = 0;

private:
    bool fail(int why) {
        dp_.counters.join_failures[why].fetch_add(1, std::memory_order_relaxed);
        return false;
    }
    // In the context of the stream's own device, whichever device's thread asks.
    bool create_event(StreamState& st) {
        if (caller_ == dp_.device) return drv_->event_create(&st.event, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS;
        DeviceContext ctx(drv_, dp_.device);
        return ctx.ok() && drv_->event_create(&st.event, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS;
    }
    static constexpr int kRemembered = 8;
    DevicePool& dp_;
    const Driver* drv_;
    CUstream mine_;
    int caller_;
    StreamId joined_[kRemembered] = {};
    int n_ = 0;
};

}  // namespace moecache::cuda::hook
