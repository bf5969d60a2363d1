// One sentinel page per (layer, expert tensor, expert): the page at the centre of that expert's
// slice of the tensor, as mapped in this process. Zapping the sentinel's page-table entry before a
// decode and finding it present afterwards says the expert was read during the decode.
//
// A fault maps more than the faulting page: fault-around maps the cached pages of an aligned
// window (fault_around_bytes, 64 KiB by default), and recent kernels map a whole large folio of the
// page cache at once, or a 2 MiB folio with one PMD (seen on Linux 6.18 with ext4, which caches a
// model read sequentially in folios of up to 2 MiB that hold many experts: touching one sentinel
// mapped 23 others). All of these stop at the edge of the VMA. So the plan also cuts the mapping
// into VMAs: one per expert slice (its whole pages; a page shared by two slices goes with the
// later one), and what lies between expert tensors (dense weights, read on every token) keeps the
// mapping's own flags. Neighbouring slices get two different VMA flags that the runtime does not
// rely on, so that they do not merge again. A fault then maps pages of one expert's slice only,
// whatever the folio size or fault-around window.
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"
#include "moecache/process_maps.h"

#include <cstdint>
#include <vector>

namespace moecache::routeprobe {

struct AddressRange {
    uintptr_t begin = 0;
    uintptr_t end = 0;
};

struct SentinelSet {
    uint32_t layer_slot = 0;  // index into ExpertMap::layers
    uint32_t tensor = 0;      // index into MoeLayer::tensors
    std::vector<uintptr_t> pages;      // [expert]: sentinel page address, ascending
    std::vector<AddressRange> pieces;  // [expert]: the VMA the expert's slice gets
};

struct SentinelPlan {
    uint64_t page_size = 0;
    uint64_t min_slice_bytes = 0;
    uint64_t n_sentinels = 0;
    std::vector<SentinelSet> sets;  // one per (layer, expert tensor)
    // Every piece, in address order; flag[i % 2] goes on pieces[i].
    std::vector<AddressRange> pieces;
};

// mappings[f]: where file f of the map is mapped. Only read-only mappings are used, so that
// MADV_DONTNEED on a sentinel can never discard data (the page stays in the page cache).
Result<SentinelPlan> plan_sentinels(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings,
                                    uint64_t page_size);

}  // namespace moecache::routeprobe
