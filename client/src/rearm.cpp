#include "moecache/client/rearm.h"

#include <limits.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
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

RearmPace RearmPace::of(size_t pages, uint64_t period_ms, uint64_t rate) {
    RearmPace p;
    p.round_ms = std::max<uint64_t>(period_ms, 1);
    if (rate > 0 && pages > 0) p.round_ms = std::max<uint64_t>(p.round_ms, (pages * 1000 + rate - 1) / rate);
    const uint64_t ticks = std::max<uint64_t>(1, std::min<uint64_t>(p.round_ms / kTickMs, std::max<size_t>(pages, 1)));
    p.tick_ms = p.round_ms / ticks;
    p.per_tick = (pages + ticks - 1) / ticks;
    return p;
}

size_t ExpertRearmer::rearm(size_t first, size_t count) {
    if (refused_ || first >= pages_.size()) return 0;
    count = std::min(count, pages_.size() - first);
    const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    if (!prepared_) {
        prepared_ = true;
        // Best effort: a kernel without THP refuses, and then there is no PMD mapping to fear.
        for (const auto& [start, end] : mappings_) ::madvise(reinterpret_cast<void*>(start), end - start, MADV_NOHUGEPAGE);
        pidfd_ = UniqueFd(static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0)));
        iov_.reserve(pages_.size());
        for (const auto& p : pages_) iov_.push_back({reinterpret_cast<void*>(p.address), page});
    }
    // All the pages in one process_madvise() call per 1024 (Linux >= 6.13 takes MADV_DONTNEED on the
    // caller itself, and flushes the TLB once per call since 6.16): one flush, so one round of
    // inter-processor interrupts to the runtime's threads, instead of one per page. Elsewhere
    // (EINVAL, ENOSYS, EPERM) one madvise() per page.
    if (batch_ && pidfd_) {
        size_t n = 0;
        bool ok = true;
        for (size_t at = first; at < first + count; at += IOV_MAX) {
            const size_t n_iov = std::min<size_t>(IOV_MAX, first + count - at);
            const long r = ::syscall(SYS_process_madvise, pidfd_.get(), iov_.data() + at, n_iov, MADV_DONTNEED, 0u);
            if (r < 0) {
                ok = false;
                break;
            }
            n += static_cast<size_t>(r) / page;
        }
        if (ok) return n;
        batch_ = false;
    }
    size_t n = 0;
    for (size_t i = first; i < first + count; ++i) {
        if (::madvise(reinterpret_cast<void*>(pages_[i].address), page, MADV_DONTNEED) == 0) {
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
