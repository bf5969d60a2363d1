// The service side of systemd's protocols, without libsystemd: state notifications (READY=1,
// RELOADING=1, STOPPING=1, STATUS=, WATCHDOG=1; see sd_notify(3)), the service watchdog
// (sd_watchdog_enabled(3)) and sockets passed by socket activation (sd_listen_fds(3)). Outside
// systemd each of them finds nothing to do and says so; none of them is an error there.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moecache::systemd {

// Sends `state` (assignments such as "READY=1", one per line) as one datagram to $NOTIFY_SOCKET,
// a path or an abstract address ("@name"). false: not started by systemd (NOTIFY_SOCKET unset).
Result<bool> notify(std::string_view state);

// "MONOTONIC_USEC=<now on CLOCK_MONOTONIC>", which systemd wants beside RELOADING=1.
std::string monotonic_usec();

// How often systemd wants a WATCHDOG=1 (WATCHDOG_USEC), or nullopt when it wants none from this
// process: the watchdog is off, or WATCHDOG_PID names another process. Malformed values are errors.
Result<std::optional<std::chrono::microseconds>> watchdog_interval();

// Pings systemd's watchdog from an event loop, at most four times per interval (each ping wakes
// PID 1), so that a loop that turns often does not flood it and one stalled for more than three
// quarters of the interval is caught.
class Watchdog {
public:
    Watchdog() = default;  // off
    explicit Watchdog(std::chrono::microseconds interval) : interval_(interval) {}
    // As the environment says (watchdog_interval()); off when it says nothing.
    static Result<Watchdog> from_environment();

    [[nodiscard]] bool enabled() const { return interval_.count() > 0; }
    [[nodiscard]] std::chrono::microseconds interval() const { return interval_; }
    // Sends WATCHDOG=1 if a quarter of the interval has passed since the last ping. true: sent.
    Result<bool> ping();
    // Milliseconds until the next ping is due, for an event loop's timeout; -1 when off.
    [[nodiscard]] int due_in_ms() const;

private:
    std::chrono::microseconds interval_{0};
    std::chrono::steady_clock::time_point last_{};
};

struct ListenFd {
    UniqueFd fd;
    std::string name;  // from LISTEN_FDNAMES (FileDescriptorName= in the unit), "unknown" without
};

// The descriptors systemd passed to this process (LISTEN_FDS of them from fd 3, when LISTEN_PID
// is this process), now owned here and close-on-exec; empty when none were passed. Unsets
// LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES, so they are taken once and no child takes them for
// its own: call it at start-up, before threads that read the environment run (unsetenv and getenv
// do not mix across threads).
Result<std::vector<ListenFd>> listen_fds();

}  // namespace moecache::systemd
