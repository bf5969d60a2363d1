// How much of a file range is in the page cache right now: cachestat(2) where the kernel has it
// (6.5+), else mincore(2) on a read-only shared mapping that is never touched.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <cstdint>
#include <optional>
#include <string>

namespace moecache {

class PageCacheProbe {
public:
    enum class Method { Cachestat, Mincore };

    static Result<PageCacheProbe> open(const std::string& path);
    // Of a file already open (the descriptor is duplicated): nothing is opened by name.
    static Result<PageCacheProbe> of(int fd, const std::string& name);
    PageCacheProbe(PageCacheProbe&&) noexcept;
    PageCacheProbe& operator=(PageCacheProbe&&) noexcept;
    ~PageCacheProbe();

    // Bytes of [offset, offset + length) whose pages are cached; partial pages count by overlap.
    Result<uint64_t> resident_bytes(uint64_t offset, uint64_t length);
    [[nodiscard]] Method method() const { return method_; }
    [[nodiscard]] uint64_t file_size() const { return size_; }

    // Forces mincore, so tests can compare both methods on the same file.
    void force_mincore() { method_ = Method::Mincore; }

private:
    PageCacheProbe() = default;
    static Result<PageCacheProbe> of(UniqueFd fd, const std::string& path);
    Result<uint64_t> cached_pages(uint64_t first_page, uint64_t n_pages);

    std::string path_;
    UniqueFd fd_;
    uint64_t size_ = 0;
    Method method_ = Method::Cachestat;
    void* map_ = nullptr;  // for mincore, mapped on first use
};

const char* to_string(PageCacheProbe::Method m);

// What a page fault maps around itself of what is cached (fault-around, the kernel's default
// fault_around_bytes), whatever the mapping's advice.
constexpr uint64_t kFaultAroundBytes = 64 << 10;

// Drops pages [first_page, first_page + n_pages) of a file from the page cache as far as the kernel
// lets: pages some process maps or locks stay. `map` is the caller's read-only shared mapping of
// the whole file (`map_len` bytes); its own page-table entries for the range go first.
// posix_fadvise drops only folios wholly inside the range it is given, and read-ahead builds folios
// of up to 2 MiB across the edges of whatever the range holds: where the kernel says which folio
// an edge page is in (/proc/kpageflags, root), that folio is dropped whole, its pages outside the
// range with it (unless mapped: a locked or used neighbour keeps it). Returns the folios widened.
uint32_t drop_file_pages(int fd, const uint8_t* map, uint64_t map_len, uint64_t first_page, uint64_t n_pages);

// The page-cache folio holding page `page` of the file `map` maps (shared, read-only), as file page
// indexes [first, first + pages), read from /proc/self/pagemap and /proc/kpageflags; the page is
// mapped here for the look (it must be cached: nothing is read from storage) and unmapped after.
// Empty where the kernel does not say (not root, no page-flag files) or the page is not cached.
struct FolioSpan {
    uint64_t first = 0, pages = 0;
};
std::optional<FolioSpan> folio_of(const uint8_t* map, uint64_t map_len, uint64_t page);

}  // namespace moecache
