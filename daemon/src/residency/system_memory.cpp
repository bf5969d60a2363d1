#include "moecache/daemon/system_memory.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <charconv>
#include <fstream>
#include <sstream>
#include <vector>

namespace moecache::daemon {
namespace {

std::optional<std::string> slurp(const std::string& path) {
    std::ifstream f(path);
    if (!f) return std::nullopt;
    std::ostringstream s;
    s << f.rdbuf();
    return s.str();
}

}  // namespace

std::optional<uint64_t> proc_kib_field(std::string_view text, std::string_view key) {
    for (size_t at = 0; at < text.size();) {
        const size_t end = std::min(text.find('\n', at), text.size());
        const std::string_view line = text.substr(at, end - at);
        at = end + 1;
        if (line.substr(0, key.size()) != key) continue;
        std::string_view rest = line.substr(key.size());
        while (!rest.empty() && (rest.front() == ' ' || rest.front() == '\t')) rest.remove_prefix(1);
        uint64_t kib = 0;
        const auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), kib);
        if (ec != std::errc() || p == rest.data() || kib > UINT64_MAX / 1024) return std::nullopt;
        return kib * 1024;
    }
    return std::nullopt;
}

std::optional<SystemMemory> read_system_memory(const std::string& meminfo) {
    const auto text = slurp(meminfo);
    if (!text) return std::nullopt;
    const auto total = proc_kib_field(*text, "MemTotal:");
    if (!total) return std::nullopt;
    return SystemMemory{*total, proc_kib_field(*text, "MemAvailable:").value_or(0)};
}

uint64_t read_locked_bytes(const std::string& status) {
    const auto text = slurp(status);
    return text ? proc_kib_field(*text, "VmLck:").value_or(0) : 0;
}

uint64_t mem_total_bytes() {
    const auto m = read_system_memory();
    return m ? m->total : 0;
}

uint64_t vmlck_bytes() { return read_locked_bytes(); }

uint64_t mem_available_bytes() {
    const auto m = read_system_memory();
    return m ? m->available : 0;
}

std::optional<ProcessFigures> parse_process_stat(std::string_view stat, std::string_view proc_stat,
                                                 long ticks_per_second, long page_size) {
    const size_t close = stat.rfind(')');
    if (close == std::string_view::npos || ticks_per_second <= 0 || page_size <= 0) return std::nullopt;
    // Fields from the 3rd (state) on, split on spaces.
    std::vector<std::string_view> f;
    for (size_t at = close + 1; at < stat.size();) {
        while (at < stat.size() && (stat[at] == ' ' || stat[at] == '\n')) ++at;
        const size_t end = std::min(stat.find_first_of(" \n", at), stat.size());
        if (end > at) f.push_back(stat.substr(at, end - at));
        at = end;
    }
    // proc(5): utime 14, stime 15, starttime 22, vsize 23, rss 24 (1-based); f[0] is field 3.
    if (f.size() < 22) return std::nullopt;
    const auto num = [](std::string_view v, uint64_t& out) {
        const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
        return ec == std::errc() && p == v.data() + v.size();
    };
    uint64_t utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
    if (!num(f[11], utime) || !num(f[12], stime) || !num(f[19], start) || !num(f[20], vsize) || !num(f[21], rss))
        return std::nullopt;
    ProcessFigures p;
    const auto ticks = static_cast<double>(ticks_per_second);
    p.cpu_seconds = static_cast<double>(utime + stime) / ticks;
    p.virtual_bytes = vsize;
    p.resident_bytes = rss * static_cast<uint64_t>(page_size);
    uint64_t btime = 0;
    for (size_t at = 0; at < proc_stat.size();) {
        const size_t end = std::min(proc_stat.find('\n', at), proc_stat.size());
        const std::string_view line = proc_stat.substr(at, end - at);
        at = end + 1;
        if (line.substr(0, 6) == "btime " && num(line.substr(6), btime)) break;
    }
    p.start_time_seconds = static_cast<double>(btime) + static_cast<double>(start) / ticks;
    return p;
}

ProcessFigures read_process() {
    const auto stat = slurp("/proc/self/stat");
    const auto proc_stat = slurp("/proc/stat");
    ProcessFigures p;
    if (stat && proc_stat)
        if (auto parsed = parse_process_stat(*stat, *proc_stat, ::sysconf(_SC_CLK_TCK), ::sysconf(_SC_PAGESIZE)))
            p = *parsed;
    if (DIR* d = ::opendir("/proc/self/fd")) {
        while (const dirent* e = ::readdir(d))
            if (e->d_name[0] != '.') ++p.open_fds;
        ::closedir(d);
        if (p.open_fds > 0) --p.open_fds;  // the directory's own descriptor
    }
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0) p.max_fds = rl.rlim_cur;
    return p;
}

}  // namespace moecache::daemon
