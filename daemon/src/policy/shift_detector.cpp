#include "moecache/daemon/shift_detector.h"

#include <algorithm>

namespace moecache::daemon {

bool ShiftDetector::observe(uint32_t surprised, uint32_t seen) {
    const double x = static_cast<double>(surprised) / seen;
    ++events_;
    // Running means until each window has filled, so that neither starts from zero.
    const auto n = static_cast<double>(events_);
    recent_ += (x - recent_) / std::min(n, kRecentEvents);
    long_run_ += (x - long_run_) / std::min(n, kLongRunEvents);
    if (events_ <= kFirstEvents || events_ <= quiet_until_ || recent_ <= kJumpRatio * long_run_ + kJumpPoints)
        return false;
    ++shifts_;
    quiet_until_ = events_ + kQuietEvents;
    recent_ = long_run_;
    return true;
}

}  // namespace moecache::daemon
