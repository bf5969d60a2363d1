#include "moecache/daemon/pressure.h"

#include "moecache/log.h"

#include "moecache/memory_cgroup.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <fstream>

namespace moecache::daemon {
namespace {

constexpr uint32_t kUnprivilegedWindowUs = 2000000;  // without CAP_SYS_RESOURCE: multiples of 2 s

Result<UniqueFd> arm(const std::string& path, uint32_t stall_us, uint32_t window_us) {
    UniqueFd fd(::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
    if (!fd) return fail_errno("{}: cannot open for a PSI trigger", path);
    const std::string trig = fmt::format("some {} {}", stall_us, window_us);
    if (::write(fd.get(), trig.c_str(), trig.size() + 1) < 0)
        return fail_errno("{}: writing the trigger '{}'", path, trig);
    return fd;
}

// cgroup v1: an eventfd that the kernel signals when the memory cgroup `dir` reclaims at the
// "medium" level (cgroup.event_control; the registration lasts as long as the eventfd).
Result<PressureTrigger> arm_v1_level(const std::string& dir) {
    PressureTrigger t;
    t.path = dir + "/memory.pressure_level";
    t.events = EPOLLIN;
    t.level.reset(::open(t.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!t.level) return fail_errno("{}: cannot open", t.path);
    t.fd.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!t.fd) return fail_errno("eventfd");
    UniqueFd control(::open((dir + "/cgroup.event_control").c_str(), O_WRONLY | O_CLOEXEC));
    if (!control) return fail_errno("{}/cgroup.event_control: cannot open", dir);
    const std::string line = fmt::format("{} {} medium", t.fd.get(), t.level.get());
    if (::write(control.get(), line.c_str(), line.size()) < 0)
        return fail_errno("{}/cgroup.event_control: registering '{}'", dir, line);
    return t;
}

}  // namespace

void PressureTrigger::consume() const {
    if (events != EPOLLIN) return;
    uint64_t n = 0;
    (void)!::read(fd.get(), &n, sizeof n);
}

std::string own_cgroup_v2_dir() {
    std::ifstream f("/proc/self/cgroup");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind("0::", 0) == 0)
            // Pure v2 mounts the hierarchy at /sys/fs/cgroup, hybrid machines at .../unified.
            for (const char* root : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
                const std::string dir = root + line.substr(3);
                if (::access((dir + "/memory.pressure").c_str(), F_OK) == 0) return dir;
            }
    return {};
}

Result<PressureMonitor> PressureMonitor::open(uint32_t stall_us, uint32_t window_us) {
    PressureMonitor m;
    auto fd = arm("/proc/pressure/memory", stall_us, window_us);
    if (!fd && fd.error().errnum == EINVAL && window_us % kUnprivilegedWindowUs != 0) {
        // Without CAP_SYS_RESOURCE the kernel takes only windows of whole multiples of 2 s: keep
        // the same share of stall over the nearest such window.
        const uint32_t w = (window_us + kUnprivilegedWindowUs - 1) / kUnprivilegedWindowUs * kUnprivilegedWindowUs;
        const auto s = static_cast<uint32_t>(static_cast<uint64_t>(stall_us) * w / window_us);
        MC_LOG(LOG_WARNING, "PSI trigger 'some {} {}' refused (no CAP_SYS_RESOURCE?): using 'some {} {}'", stall_us,
               window_us, s, w);
        stall_us = s;
        window_us = w;
        fd = arm("/proc/pressure/memory", stall_us, window_us);
    }
    if (!fd) return tl::unexpected(fd.error());
    m.window_us_ = window_us;
    m.triggers_.push_back({"/proc/pressure/memory", std::move(*fd), EPOLLPRI, {}});
    if (const auto dir = own_cgroup_v2_dir(); !dir.empty() && dir != "/sys/fs/cgroup/" && dir != "/sys/fs/cgroup/unified/") {
        auto cg = arm(dir + "/memory.pressure", stall_us, window_us);
        if (cg) m.triggers_.push_back({dir + "/memory.pressure", std::move(*cg), EPOLLPRI, {}});
        else MC_LOG(LOG_INFO, "no PSI trigger on the daemon's cgroup: {}", cg.error().what());
    }
    if (const auto cg = own_memory_cgroup_limit(); cg && cg->version == 1) {
        auto level = arm_v1_level(cg->dir);
        if (level) m.triggers_.push_back(std::move(*level));
        else MC_LOG(LOG_INFO, "no pressure notification from the daemon's memory cgroup (v1): {}", level.error().what());
    }
    return m;
}

}  // namespace moecache::daemon
