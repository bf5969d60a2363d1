// Failures the daemon's loop goes on after (a lock refused, a read that failed, a file it could not
// look at): counted by what it was doing (moecache_daemon_errors_total, `moecachectl status`), logged
// the first time and then at most once a minute for each kind, with how many came in between, so
// that a failure that repeats every turn neither floods the journal nor goes unseen.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace moecache::daemon {

class ErrorLog {
public:
    using Clock = std::chrono::steady_clock;
    static constexpr std::chrono::minutes kLogEvery{1};

    // One failure while `doing`; logs it unless one of the same kind was logged within kLogEvery.
    // Returns whether it was logged.
    bool note(const std::string& doing, const std::string& what, Clock::time_point now = Clock::now());
    // Failures counted by what the daemon was doing.
    [[nodiscard]] std::map<std::string, uint64_t> totals() const;

private:
    struct Kind {
        uint64_t total = 0, unlogged = 0;
        Clock::time_point logged{};
    };
    std::map<std::string, Kind> kinds_;
};

}  // namespace moecache::daemon
