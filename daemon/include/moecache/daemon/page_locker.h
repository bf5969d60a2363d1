// Locks byte ranges of a model in the page cache with mlock(2) on the daemon's own read-only
// shared mapping: every process that maps the file sees the locked pages. Ranges are whole expert
// slices or dense ranges; they never overlap, but two neighbours can share the page at their
// boundary, so the first and last page of every range are reference-counted and releasing one
// range never unlocks a neighbour's page. Interior pages belong to one range only.
//
// Accounting is in whole pages, as the kernel counts VmLck.
#pragma once

#include "moecache/daemon/mapped_model.h"
#include "moecache/error.h"

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace moecache::daemon {

class PageLocker {
public:
    explicit PageLocker(const MappedModel& model);

    // Bytes that lock(r) would newly lock: what a budget must allow first.
    [[nodiscard]] uint64_t cost(const ByteRange& r) const;
    // Locks r; on failure nothing of r stays locked. Returns the bytes newly locked.
    Result<uint64_t> lock(const ByteRange& r);
    // Unlocks r. With drop, pages no longer locked leave the page cache too, unless some other
    // process maps them. Returns the bytes unlocked.
    Result<uint64_t> unlock(const ByteRange& r, bool drop);
    [[nodiscard]] uint64_t locked_bytes() const { return locked_pages_ * page_size(); }

    static uint64_t page_size();

private:
    struct PageSpan {
        uint64_t first, last;  // inclusive page indexes
    };
    [[nodiscard]] PageSpan span(const ByteRange& r) const;
    Result<void> mlock_pages(uint32_t file, uint64_t first, uint64_t count);
    void munlock_pages(uint32_t file, uint64_t first, uint64_t count, bool drop);
    Result<bool> ref(uint32_t file, uint64_t page);  // true when the page became locked
    void unref(uint32_t file, uint64_t page, bool drop);

    const MappedModel& model_;
    std::vector<std::unordered_map<uint64_t, uint32_t>> edge_refs_;  // per file: page -> ranges
    uint64_t locked_pages_ = 0;
};

}  // namespace moecache::daemon
