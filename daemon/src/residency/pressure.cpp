#include "moecache/daemon/pressure.h"

#include <fcntl.h>
#include <unistd.h>

#include <fstream>

namespace moecache::daemon {
namespace {

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
        if (line.rfind("0::", 0) == 0) {
            const std::string dir = "/sys/fs/cgroup" + line.substr(3);
            if (::access((dir + "/memory.pressure").c_str(), F_OK) == 0) return dir;
        }
    return {};
}

Result<PressureMonitor> PressureMonitor::open(uint32_t stall_us, uint32_t window_us) {
    PressureMonitor m;
    m.triggers_.push_back({"/proc/pressure/memory", MC_TRY(arm("/proc/pressure/memory", stall_us, window_us))});
    if (const auto dir = own_cgroup_v2_dir(); !dir.empty() && dir != "/sys/fs/cgroup/") {
        auto fd = arm(dir + "/memory.pressure", stall_us, window_us);
        if (fd) m.triggers_.push_back({dir + "/memory.pressure", std::move(*fd)});
    }
    return m;
}

}  // namespace moecache::daemon
