// The second step: what no single key can say on its own. Budgets are checked against each other
// and against this machine's memory, the PSI trigger against itself, the NUMA node against the
// nodes the kernel lists. Model files are not opened here: a model that is missing at start-up
// may appear later, and the daemon reports and retries it at run time.
#include "moecache/daemon/config.h"

#include <dirent.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <memory>

namespace moecache::daemon {
namespace {

// "FILE:LINE:COL: KEY" of the value in force; a key no file set is named as the default.
std::string key_at(const Config& c, const std::string& key) {
    if (const auto it = c.origins.find(key); it != c.origins.end())
        return fmt::format("{}: {}", it->second, key);
    return fmt::format("{}: {} (default)",
                       c.sources.empty() ? "<built-in defaults>" : c.sources.front(), key);
}

std::string describe(const ByteAmount& a, uint64_t mem_total) {
    if (!a.percent) return format_bytes(a.bytes);
    return fmt::format("{}% of MemTotal {} = {}", *a.percent, format_bytes(mem_total),
                       format_bytes(a.resolve(mem_total)));
}

Result<void> check_budgets(const Config& c, uint64_t mem_total) {
    const uint64_t reserve = c.reserve.resolve(mem_total);
    if (reserve >= mem_total)
        return failf(
            "{}: {} is not less than this machine's memory (MemTotal {}): nothing could be "
            "locked; lower the reserve",
            key_at(c, "budget.reserve"), describe(c.reserve, mem_total), format_bytes(mem_total));
    const uint64_t lock = c.lock_budget.resolve(mem_total);
    if (lock == 0)
        return failf(
            "{}: the lock budget resolves to 0 bytes{}: nothing would be locked; set a size "
            "such as \"48GiB\" or a share such as \"50%\"",
            key_at(c, "budget.lock"),
            c.lock_budget.percent ? fmt::format(" ({})", describe(c.lock_budget, mem_total)) : "");
    for (const auto& m : c.models) {
        if (!m.budget) continue;
        const uint64_t model_budget = m.budget->resolve(mem_total);
        if (model_budget > lock)
            return failf(
                "{}.budget: the model budget {} is larger than the global lock budget "
                "{} ({}); lower the model budget or raise budget.lock",
                m.where, describe(*m.budget, mem_total), describe(c.lock_budget, mem_total),
                key_at(c, "budget.lock"));
    }
    return {};
}

// The kernel rejects a PSI trigger whose stall is longer than its window.
Result<void> check_pressure(const Config& c) {
    if (c.pressure_stall_us > c.pressure_window_us)
        return failf(
            "{}: a stall of {} us is longer than the window it is measured in: "
            "pressure.window_us = {} us ({}); stall_us must be at most window_us",
            key_at(c, "pressure.stall_us"), c.pressure_stall_us, c.pressure_window_us,
            key_at(c, "pressure.window_us"));
    return {};
}

// The nodes the kernel lists in `dir` (node0, node1, ...), for a message that names the choices.
std::vector<int> present_nodes(const std::string& dir) {
    std::vector<int> nodes;
    std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), &::closedir);
    if (!d) return nodes;
    while (const dirent* e = ::readdir(d.get())) {
        const std::string_view name = e->d_name;
        int n = 0;
        if (name.size() <= 4 || name.substr(0, 4) != "node") continue;
        const auto [end, ec] = std::from_chars(name.data() + 4, name.data() + name.size(), n);
        if (ec == std::errc() && end == name.data() + name.size()) nodes.push_back(n);
    }
    std::sort(nodes.begin(), nodes.end());
    return nodes;
}

Result<void> check_numa_node(const Config& c, const std::string& node_dir) {
    if (c.numa_node < 0) return {};
    struct stat st {};
    if (::stat(fmt::format("{}/node{}", node_dir, c.numa_node).c_str(), &st) == 0) return {};
    const auto nodes = present_nodes(node_dir);
    if (nodes.empty())
        return failf("{}: NUMA node {} does not exist on this machine ({} lists no nodes); use -1",
                     key_at(c, "prefetch.numa_node"), c.numa_node, node_dir);
    return failf(
        "{}: NUMA node {} does not exist on this machine, which has nodes {}; use one of "
        "them or -1",
        key_at(c, "prefetch.numa_node"), c.numa_node, fmt::join(nodes, ", "));
}

}  // namespace

Result<void> validate_config(const Config& c, uint64_t mem_total,
                             const std::string& numa_node_dir) {
    try {
        MC_TRY_VOID(check_budgets(c, mem_total));
        MC_TRY_VOID(check_pressure(c));
        MC_TRY_VOID(check_numa_node(c, numa_node_dir));
        return {};
    } catch (const std::exception& e) {
        return failf("cannot validate the config: {}", e.what());
    }
}

}  // namespace moecache::daemon
