#include "moecache/memory_cgroup.h"

#include <unistd.h>

#include <charconv>
#include <fstream>
#include <sstream>
#include <vector>

namespace moecache {
namespace {

// A limit file's value: "max" (v2) and anything at or past 2^62 (v1's "unlimited" is
// PAGE_COUNTER_MAX pages, 0x7ffffffffffff000 on x86-64) mean none.
std::optional<uint64_t> read_limit(const std::string& path) {
    std::ifstream f(path);
    std::string s;
    if (!(f >> s) || s == "max") return std::nullopt;
    uint64_t v = 0;
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc{} || p != s.data() + s.size() || v >= (uint64_t{1} << 62)) return std::nullopt;
    return v;
}

uint64_t read_u64(const std::string& path) {
    std::ifstream f(path);
    uint64_t v = 0;
    f >> v;
    return v;
}

// The page counts of memory.stat that say what reclaim could take: v2's keys, or v1's total_*
// (its own keys count that cgroup alone, without its children).
void read_stat(MemoryCgroupLimit& l) {
    std::ifstream f(l.dir + "/memory.stat");
    const std::string prefix = l.version == 1 ? "total_" : "";
    std::string key;
    uint64_t v = 0;
    while (f >> key >> v) {
        if (key == prefix + "active_file" || key == prefix + "inactive_file") l.reclaimable += v;
        else if (key == prefix + "unevictable") l.unevictable = v;
    }
}

// The smallest limit from `dir` up to (and including) `top`.
std::optional<MemoryCgroupLimit> walk(std::string dir, const std::string& top, const char* limit_file,
                                      const char* usage_file, int version) {
    std::optional<MemoryCgroupLimit> best;
    while (dir.size() >= top.size()) {
        if (const auto l = read_limit(dir + "/" + limit_file); l && (!best || *l < best->limit))
            best = MemoryCgroupLimit{dir, *l, read_u64(dir + "/" + usage_file), 0, 0, version};
        if (dir == top) break;
        const auto slash = dir.rfind('/');
        if (slash == std::string::npos || slash < top.size()) dir = top;
        else dir.resize(slash);
    }
    if (best) read_stat(*best);
    return best;
}

}  // namespace

std::optional<MemoryCgroupLimit> own_memory_cgroup_limit(const std::string& proc_cgroup, const std::string& root) {
    std::ifstream f(proc_cgroup);
    std::string line;
    std::string v2_path, v1_path;
    bool v1 = false;
    while (std::getline(f, line)) {
        // "ID:CONTROLLERS:PATH"; v2 is "0::PATH".
        const auto a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
        if (b == std::string::npos) continue;
        const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
        if (line.compare(0, a, "0") == 0 && controllers.empty()) {
            v2_path = path;
            continue;
        }
        std::stringstream cs(controllers);
        for (std::string c; std::getline(cs, c, ',');)
            if (c == "memory") {
                v1 = true;
                v1_path = path;
            }
    }
    auto clean = [](std::string p) {
        while (p.size() > 1 && p.back() == '/') p.pop_back();
        return p == "/" ? std::string{} : p;
    };
    if (v1) {
        const std::string top = root + "/memory";
        return walk(top + clean(v1_path), top, "memory.limit_in_bytes", "memory.usage_in_bytes", 1);
    }
    if (v2_path.empty()) return std::nullopt;
    // Pure v2 mounts the hierarchy at the root, hybrid machines at root/unified.
    for (const std::string& top : {root, root + "/unified"})
        if (::access((top + "/cgroup.controllers").c_str(), F_OK) == 0)
            return walk(top + clean(v2_path), top, "memory.max", "memory.current", 2);
    return std::nullopt;
}

}  // namespace moecache
