#include "moecache/routeprobe/sentinel_plan.h"

#include <algorithm>
#include <limits>

namespace moecache::routeprobe {
namespace {

struct Slice {
    uintptr_t begin, end;
    uint32_t set, expert;
};

}  // namespace

Result<SentinelPlan> plan_sentinels(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings,
                                    uint64_t page_size, uint64_t window) {
    if (page_size == 0 || window < page_size || window % page_size != 0)
        return failf("page size {} and fault-around window {} do not fit together", page_size, window);
    if (map.layers.empty()) return failf("model {} has no routed experts", map.files.empty() ? "" : map.files[0].path);
    SentinelPlan plan;
    plan.page_size = page_size;
    plan.window = window;
    plan.min_slice_bytes = std::numeric_limits<uint64_t>::max();
    std::vector<Slice> slices;
    for (uint32_t li = 0; li < map.layers.size(); ++li) {
        const auto& layer = map.layers[li];
        for (uint32_t ti = 0; ti < layer.tensors.size(); ++ti) {
            const auto& t = layer.tensors[ti];
            const uint64_t whole = t.bytes_per_expert * map.n_experts;
            const FileMapping* m = nullptr;
            if (t.file < mappings.size())
                for (const auto& c : mappings[t.file])
                    if (c.covers(t.offset, whole) && c.perms.size() >= 2 && c.perms[0] == 'r' && c.perms[1] != 'w') m = &c;
            if (!m)
                return failf("tensor '{}' ({} bytes at offset {} of {}) is not in one read-only mapping of "
                             "that file in this process: the runtime did not mmap the model (--no-mmap?) "
                             "or mapped only part of it", t.name, whole, t.offset, map.files[t.file].path);
            plan.min_slice_bytes = std::min(plan.min_slice_bytes, t.bytes_per_expert);
            const auto set = static_cast<uint32_t>(plan.sets.size());
            plan.sets.push_back({li, ti, std::vector<uintptr_t>(map.n_experts)});
            const uintptr_t base = m->address_of(t.offset);
            for (uint32_t e = 0; e < map.n_experts; ++e)
                slices.push_back({base + e * t.bytes_per_expert, base + (e + 1) * t.bytes_per_expert, set, e});
        }
    }
    std::sort(slices.begin(), slices.end(), [](const Slice& a, const Slice& b) { return a.begin < b.begin; });

    // The page at the centre of each slice, moved up where it would share a window with the
    // previous sentinel. Centres of slices of at least window + page bytes never need moving.
    const uintptr_t page = page_size;
    uintptr_t next_free = 0;  // first address of the window after the previous sentinel's
    for (const auto& s : slices) {
        const uintptr_t lo = (s.begin + page - 1) / page * page;
        const uintptr_t hi_end = s.end / page * page;  // one past the last whole page
        const auto& set = plan.sets[s.set];
        const auto& t = map.layers[set.layer_slot].tensors[set.tensor];
        if (hi_end < lo + page)
            return failf("tensor '{}': an expert's slice is {} bytes, less than a whole page: no page "
                         "belongs to one expert alone", t.name, t.bytes_per_expert);
        const uintptr_t centre = std::clamp<uintptr_t>((s.begin + (s.end - s.begin) / 2) / page * page, lo, hi_end - page);
        const uintptr_t p = std::max(centre, next_free);
        if (p + page > hi_end)
            return failf("tensor '{}': expert slices of {} bytes are too small to give every expert a "
                         "sentinel page in a {}-byte fault-around window of its own; use a model whose "
                         "slices are at least {} bytes (mkmodel: larger --ff or --embd)",
                         t.name, t.bytes_per_expert, window, window + page);
        plan.sets[s.set].pages[s.expert] = p;
        next_free = (p / window + 1) * window;
    }
    return plan;
}

}  // namespace moecache::routeprobe
