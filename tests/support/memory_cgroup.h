// A memory cgroup with a hard limit, made for one test and removed with it: on cgroup v2 a child
// of the hierarchy's root (the one cgroup where the memory controller can be enabled for children
// while processes live in it), on hybrid machines a child of the v1 memory hierarchy.
#pragma once

#include "moecache/error.h"

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moecache::test {

class MemoryCgroup {
public:
    static constexpr uint64_t kNoLimit = UINT64_MAX;
    // `prefix` names the test: a cgroup of that prefix left by a crashed run (its pid gone) is
    // removed first. Swap is off in it (v2), so that its limit holds.
    static Result<std::unique_ptr<MemoryCgroup>> create(const std::string& prefix, uint64_t limit);
    ~MemoryCgroup();
    MemoryCgroup(const MemoryCgroup&) = delete;
    MemoryCgroup& operator=(const MemoryCgroup&) = delete;

    Result<void> add(pid_t pid) const;
    Result<void> set_limit(uint64_t bytes) const;
    // argv run inside the cgroup (a shell that writes its pid first, then execs argv).
    [[nodiscard]] std::vector<std::string> inside(std::vector<std::string> argv) const;
    [[nodiscard]] uint64_t oom_kills() const;
    [[nodiscard]] uint64_t usage() const;
    // A count of its memory.stat, its children included (v1: the total_ key): "unevictable" ...
    [[nodiscard]] uint64_t stat(const std::string& key) const;
    // Kills what is left in it, then removes it (also at destruction).
    void remove();

    [[nodiscard]] bool v2() const { return v2_; }
    [[nodiscard]] const std::string& dir() const { return dir_; }

private:
    MemoryCgroup() = default;
    std::string parent_, dir_;
    bool v2_ = false, enabled_memory_ = false;
};

}  // namespace moecache::test
