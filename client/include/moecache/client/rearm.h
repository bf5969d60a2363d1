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

class ExpertRearmer {
public:
    // The kernel maps this much around a faulting page (fault_around_bytes, 64 KiB by default):
    // the page re-armed for an expert is chosen so that the window lies inside the expert's slice
    // where the slice is large enough, so that the fault is the expert's alone.
    static constexpr uint64_t kFaultAroundBytes = 64u << 10;

    // `mappings[f]`: where this process maps file f of the model (empty: not mapped). Experts
    // whose first slice is not wholly inside a shared mapping are left out (see rearm.cpp).
    static ExpertRearmer plan(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings);

    // Unmaps the planned pages (one madvise each). Returns how many were unmapped; a refusal
    // (EINVAL: the runtime locked its mapping, --mlock) stops further attempts.
    // The first call also asks for 4 KiB page-table entries in the mappings (MADV_NOHUGEPAGE):
    // a large folio mapped by one PMD would be unmapped whole by re-arming any page of it, and
    // the first expert the runtime touched there would take the only fault for all the others.
    size_t rearm();

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
