#include "moecache/daemon/pressure.h"

#include "moecache/log.h"

#include <fcntl.h>
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

}  // namespace

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
    m.triggers_.push_back({"/proc/pressure/memory", std::move(*fd)});
    if (const auto dir = own_cgroup_v2_dir(); !dir.empty() && dir != "/sys/fs/cgroup/" && dir != "/sys/fs/cgroup/unified/") {
        auto cg = arm(dir + "/memory.pressure", stall_us, window_us);
        if (cg) m.triggers_.push_back({dir + "/memory.pressure", std::move(*cg)});
        else MC_LOG(LOG_INFO, "no PSI trigger on the daemon's cgroup: {}", cg.error().what());
    }
    return m;
}

}  // namespace moecache::daemon
