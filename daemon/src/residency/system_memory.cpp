#include "moecache/daemon/system_memory.h"

#include <charconv>
#include <fstream>
#include <sstream>

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

}  // namespace moecache::daemon
