// One sentinel page per (layer, expert tensor, expert): a page that lies wholly inside that
// expert's slice of the tensor, as mapped in this process. Zapping the sentinel's page-table entry
// before a decode and finding it present afterwards says the expert was read during the decode.
//
// A fault on one page maps the cached pages around it too (fault-around: the aligned window of
// fault_around_bytes, 64 KiB by default, in virtual addresses), so no two sentinels may share a
// window: otherwise reading one expert would mark its neighbour as read.
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"
#include "moecache/routeprobe/process_maps.h"

#include <cstdint>
#include <vector>

namespace moecache::routeprobe {

struct SentinelSet {
    uint32_t layer_slot = 0;  // index into ExpertMap::layers
    uint32_t tensor = 0;      // index into MoeLayer::tensors
    std::vector<uintptr_t> pages;  // [expert]: page address, ascending
};

struct SentinelPlan {
    uint64_t page_size = 0;
    uint64_t window = 0;  // the fault-around window the plan keeps sentinels apart by
    uint64_t min_slice_bytes = 0;
    std::vector<SentinelSet> sets;  // one per (layer, expert tensor)
};

// mappings[f]: where file f of the map is mapped. Only read-only mappings are used, so that
// MADV_DONTNEED on a sentinel can never discard data (the page stays in the page cache).
Result<SentinelPlan> plan_sentinels(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings,
                                    uint64_t page_size, uint64_t window);

}  // namespace moecache::routeprobe
