// Shift detection for the heat (docs/policy.md): a routing that changes (a topic, a
// language, another client) routes to experts that were cold far more often than the same routing
// did before. HeatTable feeds it, per router event, how many of the routed experts were below their
// layer's mean heat; a jump says the old hot set is stale, and the heat forgets it.
#pragma once

#include <cstdint>

namespace moecache::daemon {

class ShiftDetector {
public:
    // One router event: `surprised` of its `seen` routed experts were below their layer's mean heat
    // (seen > 0). True when the routing has shifted: the caller cuts the old heat to kKeepAtShift
    // (moecache/routing_shift.h).
    bool observe(uint32_t surprised, uint32_t seen);
    // Times a shift was seen.
    [[nodiscard]] uint64_t shifts() const { return shifts_; }

private:
    // The surprise's recent level: a running mean over this many events (the shift is seen about
    // 8 tokens after it on the topic-shift preset, 16 layers). 256 saw it about 16 tokens after:
    // 0.1 point less on each topic-shift row of moecache-sim --table (RAM 50 %: 85.4 against
    // 85.5); neither sees a shift on any other preset (seeds 1-3) or recorded trace.
    static constexpr double kRecentEvents = 128;
    // Its long-run level, against which the recent one is compared.
    static constexpr double kLongRunEvents = 16384;
    // A jump: the recent level past kJumpRatio times the long-run one plus kJumpPoints. No shift is
    // seen on any other preset or recorded trace at these.
    static constexpr double kJumpRatio = 1.5, kJumpPoints = 0.05;
    // No shift is looked for before this many events (the long-run level is not yet one), nor within
    // this many after the last.
    static constexpr uint64_t kFirstEvents = 4096, kQuietEvents = 4096;

    double recent_ = 0, long_run_ = 0;
    uint64_t events_ = 0, quiet_until_ = 0, shifts_ = 0;
};

}  // namespace moecache::daemon
