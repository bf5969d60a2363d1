#include "moecache/routeprobe/sentinel_plan.h"

#include <algorithm>
#include <limits>

namespace moecache::routeprobe {

Result<SentinelPlan> plan_sentinels(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings,
                                    uint64_t page_size) {
    if (page_size == 0 || (page_size & (page_size - 1)) != 0) return failf("page size {} is not a power of two", page_size);
    if (map.layers.empty()) return failf("the model has no routed experts");
    const uintptr_t page = page_size;
    auto down = [&](uintptr_t a) { return a / page * page; };
    auto up = [&](uintptr_t a) { return (a + page - 1) / page * page; };
    SentinelPlan plan;
    plan.page_size = page_size;
    plan.min_slice_bytes = std::numeric_limits<uint64_t>::max();
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
                             "that file in this process: the runtime copied it elsewhere and unmapped its "
                             "range (llama.cpp repacks q4_0, iq4_nl, q4_K and other expert types into "
                             "anonymous memory for its x86 CPU kernels unless --no-repack is given: measure "
                             "a q8_0 or f16 model) or did not mmap the model at all (--no-mmap)",
                             t.name, whole, t.offset,
                             t.file < map.files.size() ? map.files[t.file].path : "(no such file)");
            plan.min_slice_bytes = std::min(plan.min_slice_bytes, t.bytes_per_expert);
            SentinelSet set{li, ti, std::vector<uintptr_t>(map.n_experts), std::vector<AddressRange>(map.n_experts)};
            const uintptr_t base = m->address_of(t.offset);
            for (uint32_t e = 0; e < map.n_experts; ++e) {
                const uintptr_t begin = base + e * t.bytes_per_expert, end = begin + t.bytes_per_expert;
                if (down(end) < up(begin) + page)
                    return failf("tensor '{}': an expert's slice is {} bytes, less than a whole page, so "
                                 "no page belongs to one expert alone", t.name, t.bytes_per_expert);
                set.pages[e] = std::clamp<uintptr_t>(down(begin + (end - begin) / 2), up(begin), down(end) - page);
                // A page shared with the previous slice starts this piece; one shared with the
                // next starts the next piece; the tensor's first and last pieces hold whole pages only.
                set.pieces[e] = {e == 0 ? up(begin) : down(begin), down(end)};
                plan.pieces.push_back(set.pieces[e]);
            }
            plan.sets.push_back(std::move(set));
            plan.n_sentinels += map.n_experts;
        }
    }
    std::sort(plan.pieces.begin(), plan.pieces.end(), [](const AddressRange& a, const AddressRange& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < plan.pieces.size(); ++i)
        if (plan.pieces[i].begin < plan.pieces[i - 1].end)
            return failf("expert slices overlap at {:#x}: the expert map is inconsistent", plan.pieces[i].begin);
    return plan;
}

}  // namespace moecache::routeprobe
