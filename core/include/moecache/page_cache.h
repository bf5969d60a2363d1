// How much of a file range is in the page cache right now: cachestat(2) where the kernel has it
// (6.5+), else mincore(2) on a read-only shared mapping that is never touched.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <cstdint>
#include <string>

namespace moecache {

class PageCacheProbe {
public:
    enum class Method { Cachestat, Mincore };

    static Result<PageCacheProbe> open(const std::string& path);
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
    Result<uint64_t> cached_pages(uint64_t first_page, uint64_t n_pages);

    std::string path_;
    UniqueFd fd_;
    uint64_t size_ = 0;
    Method method_ = Method::Cachestat;
    void* map_ = nullptr;  // for mincore, mapped on first use
};

const char* to_string(PageCacheProbe::Method m);

}  // namespace moecache
