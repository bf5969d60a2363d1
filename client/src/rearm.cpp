#include "moecache/client/rearm.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace moecache::client {

ExpertRearmer ExpertRearmer::plan(const ExpertMap& map, const std::vector<std::vector<FileMapping>>& mappings) {
    ExpertRearmer r;
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    for (const auto& layer : map.layers) {
        for (uint32_t e = 0; e < map.n_experts; ++e) {
            const auto ranges = map.ranges(layer.index, e);
            if (ranges.empty() || ranges.front().file >= mappings.size()) continue;
            const ByteRange& s = ranges.front();
            for (const auto& m : mappings[s.file]) {
                // Shared mappings only: there MADV_DONTNEED unmaps and nothing else. In a private
                // one a page the runtime once wrote is an anonymous copy that it would discard.
                if (m.perms.size() < 4 || m.perms[3] != 's' || !m.covers(s.offset, s.length)) continue;
                const uintptr_t begin = m.address_of(s.offset), end = begin + s.length;
                // A fault-around window wholly inside the slice, else the middle page.
                const uintptr_t window = (begin + kFaultAroundBytes - 1) & ~(kFaultAroundBytes - 1);
                uintptr_t at = window + kFaultAroundBytes <= end ? window : ((begin + end) / 2) & ~(page - 1);
                if (at < begin) at = (begin + page - 1) & ~(page - 1);  // the slice's first whole page
                if (at + page > end) break;                             // no whole page: nothing to re-arm
                r.pages_.push_back({at, ExpertRef{layer.index, e}});
                const std::pair<uintptr_t, uintptr_t> span{m.start, m.end};
                if (std::find(r.mappings_.begin(), r.mappings_.end(), span) == r.mappings_.end())
                    r.mappings_.push_back(span);
                break;
            }
        }
    }
    return r;
}

size_t ExpertRearmer::rearm() {
    if (refused_) return 0;
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    if (!prepared_) {
        prepared_ = true;
        // Best effort: a kernel without THP refuses, and then there is no PMD mapping to fear.
        for (const auto& [start, end] : mappings_) ::madvise(reinterpret_cast<void*>(start), end - start, MADV_NOHUGEPAGE);
    }
    size_t n = 0;
    for (const auto& p : pages_) {
        if (::madvise(reinterpret_cast<void*>(p.address), page, MADV_DONTNEED) == 0) {
            ++n;
        } else {
            refused_ = true;
            refusal_errno_ = errno;
            break;
        }
    }
    return n;
}

}  // namespace moecache::client
