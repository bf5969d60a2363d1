// Failures the daemon's loop goes on after (a lock refused, a read that failed, a file it could not
// look at): counted by what it was doing (moecache_daemon_errors_total, `moecachectl status`), logged
// the first time and then at most once a minute for each kind, with how many came in between, so
// that a failure that repeats every turn neither floods the journal nor goes unseen.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace moecache::daemon {

// What the daemon was doing when a failure came: every kind is counted from the start (0 until its
// first), so that a dashboard's rate and an alert on it have a series before anything fails.
enum class Doing : uint8_t {
    ReadingResidency,      // the page cache's residency of a model (cachestat, mincore)
    ReadingExpert,         // an expert read into the page cache (a prefetch, a miss, a warm start)
    LockingExpert,         // mlock of an expert the plan admitted
    LookingAtGlobMatch,    // the header of a file a [[model]] glob matched
    UnlockingClosedModel,  // munlock of a model that closed
    UnwatchingFile,        // a closed model's file in the page-cache telemetry
    SavingProfiles,        // the heat profiles, on the tick and at exit
    StoppingTrace,         // the routing trace, at exit
};
// Every kind, in order: the enum's values 0 .. StoppingTrace.
inline constexpr auto kEveryDoing = [] {
    std::array<Doing, static_cast<size_t>(Doing::StoppingTrace) + 1> all{};
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<Doing>(i);
    return all;
}();
// As the log and the metric's label say it: "reading the page cache's residency" ...
[[nodiscard]] const char* to_string(Doing d);

class ErrorLog {
public:
    using Clock = std::chrono::steady_clock;
    static constexpr std::chrono::minutes kLogEvery{1};

    // One failure while `doing`; logs it unless one of the same kind was logged within kLogEvery.
    // Returns whether it was logged.
    bool note(Doing doing, const std::string& what, Clock::time_point now = Clock::now());
    // Failures counted by what the daemon was doing, every kind present (by to_string(Doing)).
    [[nodiscard]] std::map<std::string, uint64_t> totals() const;

private:
    struct Kind {
        uint64_t total = 0, unlogged = 0;
        Clock::time_point logged{};
    };
    std::array<Kind, kEveryDoing.size()> kinds_{};
};

}  // namespace moecache::daemon
