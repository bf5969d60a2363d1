// Memory pressure, from PSI triggers: /proc/pressure/memory for the machine and, on cgroup v2,
// memory.pressure of the daemon's own cgroup. Each trigger is a file descriptor that becomes
// readable with EPOLLPRI when "some" tasks stalled on memory for stall_us within window_us. On a
// cgroup v1 memory controller (hybrid machines), whose cgroups have no PSI, the daemon's memory
// cgroup's memory.pressure_level at "medium" (an eventfd, readable with EPOLLIN) stands in.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <string>
#include <vector>

namespace moecache::daemon {

struct PressureTrigger {
    std::string path;
    UniqueFd fd;
    uint32_t events = 0;  // what epoll waits for on fd: EPOLLPRI (PSI) or EPOLLIN (an eventfd)
    UniqueFd level;       // v1: the memory.pressure_level the eventfd is registered on
    // Called when fd is ready: an eventfd's count is read, so that it does not stay readable.
    void consume() const;
};

class PressureMonitor {
public:
    // Arms every trigger it can; the machine-wide one must work, the cgroup one is optional.
    // A window the kernel refuses for lack of CAP_SYS_RESOURCE is rounded up to 2 s multiples.
    static Result<PressureMonitor> open(uint32_t stall_us, uint32_t window_us);
    [[nodiscard]] const std::vector<PressureTrigger>& triggers() const { return triggers_; }
    // The window in force: the configured one, or rounded up to what the kernel accepted.
    [[nodiscard]] uint32_t window_us() const { return window_us_; }

private:
    std::vector<PressureTrigger> triggers_;
    uint32_t window_us_ = 0;
};

// The cgroup v2 directory of this process ("/sys/fs/cgroup/<path>"), if it has a v2 memory
// controller; empty on cgroup v1 machines.
std::string own_cgroup_v2_dir();

}  // namespace moecache::daemon
