#include "moecache/daemon/page_locker.h"

#include "moecache/page_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace moecache::daemon {

uint64_t PageLocker::page_size() {
    static const uint64_t ps = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    return ps;
}

PageLocker::PageLocker(const MappedModel& model) : model_(model), edge_refs_(model.files().size()) {}

PageLocker::PageSpan PageLocker::span(const ByteRange& r) const {
    return {r.offset / page_size(), (r.offset + r.length - 1) / page_size()};
}

uint64_t PageLocker::cost(const ByteRange& r) const {
    if (r.length == 0) return 0;
    const auto s = span(r);
    const auto& refs = edge_refs_.at(r.file);
    uint64_t pages = s.last - s.first + 1;
    if (refs.count(s.first)) --pages;
    if (s.last != s.first && refs.count(s.last)) --pages;
    return pages * page_size();
}

Result<void> PageLocker::mlock_pages(uint32_t file, uint64_t first, uint64_t count) {
    const auto& f = model_.files()[file];
    if ((first + count) * page_size() > ((f.mapping.length() + page_size() - 1) / page_size()) * page_size())
        return failf("{}: pages {}..{} lie past the end of the mapping", f.path, first, first + count);
    if (::mlock(f.mapping.data() + first * page_size(), count * page_size()) != 0)
        return fail_errno("{}: mlock of bytes {}..{}", f.path, first * page_size(), (first + count) * page_size());
    locked_pages_ += count;
    return {};
}

void PageLocker::munlock_pages(uint32_t file, uint64_t first, uint64_t count, bool drop) {
    const auto& f = model_.files()[file];
    ::munlock(f.mapping.data() + first * page_size(), count * page_size());
    locked_pages_ -= count;
    // Our own mapping would keep the pages: drop_file_pages zaps our page-table entries, then asks
    // the page cache to drop them, whole folios across the edges included. Pages that another
    // process maps stay; that is the rule we want.
    if (drop) drop_file_pages(f.fd.get(), f.mapping.data(), f.mapping.length(), first, count);
}

Result<bool> PageLocker::ref(uint32_t file, uint64_t page) {
    auto& refs = edge_refs_[file];
    auto [it, inserted] = refs.try_emplace(page, 0);
    if (it->second++ > 0) return false;
    if (auto r = mlock_pages(file, page, 1); !r) {
        refs.erase(it);
        return tl::unexpected(r.error());
    }
    return true;
}

void PageLocker::unref(uint32_t file, uint64_t page, bool drop) {
    auto& refs = edge_refs_[file];
    auto it = refs.find(page);
    if (it == refs.end()) return;
    if (--it->second > 0) return;
    refs.erase(it);
    munlock_pages(file, page, 1, drop);
}

Result<uint64_t> PageLocker::lock(const ByteRange& r) {
    if (r.length == 0) return uint64_t{0};
    const uint64_t before = locked_pages_;
    const auto s = span(r);
    MC_TRY(ref(r.file, s.first));
    if (s.last != s.first) {
        if (auto last = ref(r.file, s.last); !last) {
            unref(r.file, s.first, false);
            return tl::unexpected(last.error());
        }
        if (s.last > s.first + 1) {
            if (auto mid = mlock_pages(r.file, s.first + 1, s.last - s.first - 1); !mid) {
                unref(r.file, s.first, false);
                unref(r.file, s.last, false);
                return tl::unexpected(mid.error());
            }
        }
    }
    return (locked_pages_ - before) * page_size();
}

Result<uint64_t> PageLocker::unlock(const ByteRange& r, bool drop) {
    if (r.length == 0) return uint64_t{0};
    const uint64_t before = locked_pages_;
    const auto s = span(r);
    if (s.last > s.first + 1) munlock_pages(r.file, s.first + 1, s.last - s.first - 1, drop);
    unref(r.file, s.first, drop);
    if (s.last != s.first) unref(r.file, s.last, drop);
    return (before - locked_pages_) * page_size();
}

}  // namespace moecache::daemon
