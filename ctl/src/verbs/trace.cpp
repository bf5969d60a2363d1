// moecachectl trace
#include "../verbs.h"

namespace moecache::ctl {

int cmd_trace(const Options& o, const std::vector<std::string>& args) {
    return guarded("trace", [&] {
        const auto a = parse_args(args, {}, {}, "trace");
        const bool start = !a.positional.empty() && a.positional[0] == "start";
        const bool stop = !a.positional.empty() && a.positional[0] == "stop";
        if ((!start && !stop) || (start && a.positional.size() != 2) || (stop && a.positional.size() != 1))
            throw Failure{kExitUsage, "usage: moecachectl trace start FILE | trace stop"};
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        if (start) {
            // Opened here, as the caller: the daemon writes to what the caller may write, nothing else.
            // Not truncated here: the daemon empties it once it has accepted the trace.
            const std::string& path = a.positional[1];
            // Read and write: the daemon checks what an existing file holds before it overwrites it.
            const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
            if (fd < 0) throw Failure{kExitFailed, fmt::format("cannot create {}: {}", path, std::strerror(errno))};
            sdbus::UnixFd file(fd, sdbus::adopt_fd);
            mgr.StartTrace(file);
            if (o.json) print_json({{"tracing", true}, {"file", path}});
            else fmt::print("recording router decisions to {}; 'moecachectl trace stop' ends it\n", path);
            return kExitOk;
        }
        const uint64_t n = mgr.StopTrace();
        if (o.json) print_json({{"tracing", false}, {"records", n}});
        else fmt::print("trace stopped: {} router decisions recorded\n", n);
        return kExitOk;
    });
}

}  // namespace moecache::ctl
