// The hit signal for experts a CPU computes from a runtime's mapping of the model. A page that is
// resident produces no page-cache event when it is used, so telemetry of misses alone forgets the
// hottest experts. The re-armer unmaps one page of each expert in this process now and then
// (MADV_DONTNEED on a clean page of a read-only shared file mapping: the page stays in the page
// cache, the bytes the runtime reads never change); the expert's next use faults on it, a minor
// fault that the daemon's eBPF programs see (mm_filemap_map_pages) and count as a use.
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"
#include "moecache/process_maps.h"
#include "moecache/unique_fd.h"

#include <sys/uio.h>

#include <cstdint>
#include <vector>

namespace moecache::client {

// How a round of re-arming is spread over time. Each re-armed page costs the runtime one minor
// fault when its expert is next used: ~1-2 us on bare metal, but ~14 us measured (with its
// fault-around) on a shadow-paging VM, where 1792 pages a second took 5-10 % of a CPU runtime's
// decode speed. So besides the period of a round there is a rate: at most `rate` pages a second
// (0: no limit), which stretches the round of a model with many experts. A round goes out in
// slices, one every tick_ms, so that the faults are spread over the tokens instead of arriving
// together.
struct RearmPace {
    static constexpr uint64_t kTickMs = 250;  // the shortest tick where a round is sliced
    uint64_t round_ms = 0;                    // every planned page once per round
    uint64_t tick_ms = 0;                     // the sleep between slices
    size_t per_tick = 0;                      // pages per slice (the last one of a round may be short)

    static RearmPace of(size_t pages, uint64_t period_ms, uint64_t rate);
};

class ExpertRearmer {
public:
    // The kernel maps this much around a faulting page (fault_around_bytes, 64 KiB by default):
    // the page re-armed for an expert is chosen so that the window lies inside the expert's slice
    // where the slice is large enough, so that the fault is the expert's alone.
    static constexpr uint64_t kFaultAroundBytes = 64u << 10;

    // `mappings[f]`: where this process maps file f of the model (empty: not mapped). Experts
    // whose first slice is not wholly inside a shared mapping are left out (see rearm.cpp).
    static ExpertRearmer plan(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings);

    // Unmaps the planned pages number [first, first + count) of planned() (clamped to the plan).
    // Returns how many were unmapped; a refusal (EINVAL: the runtime locked its mapping, --mlock)
    // stops further attempts. The first call also asks for 4 KiB page-table entries in the
    // mappings (MADV_NOHUGEPAGE): a large folio mapped by one PMD would be unmapped whole by
    // re-arming any page of it, and the first expert the runtime touched there would take the
    // only fault for all the others.
    size_t rearm(size_t first, size_t count);
    size_t rearm() { return rearm(0, pages_.size()); }

    [[nodiscard]] size_t pages() const { return pages_.size(); }
    [[nodiscard]] bool refused() const { return refused_; }
    [[nodiscard]] int refusal_errno() const { return refusal_errno_; }
    // The address re-armed for expert number i of the plan, with its (block, expert).
    struct Page {
        uintptr_t address = 0;
        ExpertRef expert;
    };
    [[nodiscard]] const std::vector<Page>& planned() const { return pages_; }

private:
    std::vector<Page> pages_;
    std::vector<std::pair<uintptr_t, uintptr_t>> mappings_;  // [start, end) of the mappings used
    bool prepared_ = false;
    bool batch_ = true;     // process_madvise() works here, as far as we know
    UniqueFd pidfd_;        // of this process, for process_madvise()
    std::vector<iovec> iov_;
    bool refused_ = false;
    int refusal_errno_ = 0;
};

}  // namespace moecache::client
