// The memory cgroup this process is charged to, as the kernel limits it: on cgroup v2 the
// `memory.max` of its cgroup and every ancestor, on v1 (hybrid machines) `memory.limit_in_bytes`
// of its memory-controller cgroup and every ancestor. The smallest limit on the way up is the one
// that binds: a service in a slice with MemoryMax= is held by the slice's limit.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace moecache {

struct MemoryCgroupLimit {
    std::string dir;     // the cgroup directory whose limit binds
    uint64_t limit = 0;  // bytes
    uint64_t usage = 0;  // what that cgroup is charged now (page cache included)
    // From its memory.stat (hierarchical): file pages reclaim can take (active_file +
    // inactive_file), and pages it cannot (unevictable: mlocked, the daemon's locks among them).
    uint64_t reclaimable = 0, unevictable = 0;
    int version = 2;     // 1 or 2
};

// std::nullopt where no cgroup on the way up sets a limit (or cgroups cannot be read). Seams for
// tests: the /proc/self/cgroup text and the root the hierarchies are mounted under.
std::optional<MemoryCgroupLimit> own_memory_cgroup_limit(const std::string& proc_cgroup = "/proc/self/cgroup",
                                                         const std::string& root = "/sys/fs/cgroup");

}  // namespace moecache
