#include "moecache/page_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#ifndef __NR_cachestat
#define __NR_cachestat 451  // the same number on every architecture
#endif

namespace moecache {
namespace {

struct CachestatRange {
    uint64_t off, len;
};
struct Cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

uint64_t page_size() {
    static const uint64_t ps = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    return ps;
}

}  // namespace

const char* to_string(PageCacheProbe::Method m) {
    return m == PageCacheProbe::Method::Cachestat ? "cachestat" : "mincore";
}

Result<PageCacheProbe> PageCacheProbe::open(const std::string& path) {
    PageCacheProbe p;
    p.path_ = path;
    p.fd_.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!p.fd_) return fail_errno("{}: cannot open", path);
    struct stat st {};
    if (::fstat(p.fd_.get(), &st) != 0) return fail_errno("{}: fstat", path);
    p.size_ = static_cast<uint64_t>(st.st_size);
    CachestatRange r{0, page_size()};
    Cachestat cs{};
    if (::syscall(__NR_cachestat, p.fd_.get(), &r, &cs, 0) != 0) p.method_ = Method::Mincore;
    return p;
}

PageCacheProbe::PageCacheProbe(PageCacheProbe&& o) noexcept
    : path_(std::move(o.path_)), fd_(std::move(o.fd_)), size_(o.size_), method_(o.method_),
      map_(std::exchange(o.map_, nullptr)) {}

PageCacheProbe& PageCacheProbe::operator=(PageCacheProbe&& o) noexcept {
    if (this != &o) {
        if (map_) ::munmap(map_, size_);
        path_ = std::move(o.path_);
        fd_ = std::move(o.fd_);
        size_ = o.size_;
        method_ = o.method_;
        map_ = std::exchange(o.map_, nullptr);
    }
    return *this;
}

PageCacheProbe::~PageCacheProbe() {
    if (map_) ::munmap(map_, size_);
}

Result<uint64_t> PageCacheProbe::cached_pages(uint64_t first_page, uint64_t n_pages) {
    if (n_pages == 0) return uint64_t{0};
    const uint64_t ps = page_size();
    if (method_ == Method::Cachestat) {
        // len 0 would mean "to the end of the file": n_pages > 0 rules it out.
        CachestatRange r{first_page * ps, n_pages * ps};
        Cachestat cs{};
        if (::syscall(__NR_cachestat, fd_.get(), &r, &cs, 0) != 0)
            return fail_errno("{}: cachestat of bytes {}..{}", path_, r.off, r.off + r.len);
        return cs.nr_cache;
    }
    if (!map_) {
        void* m = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_.get(), 0);
        if (m == MAP_FAILED) return fail_errno("{}: mmap for mincore", path_);
        map_ = m;
    }
    constexpr uint64_t kChunk = 1 << 16;
    std::vector<unsigned char> vec(std::min(n_pages, kChunk));
    uint64_t cached = 0;
    for (uint64_t done = 0; done < n_pages;) {
        const uint64_t n = std::min(n_pages - done, kChunk);
        auto* addr = static_cast<char*>(map_) + (first_page + done) * ps;
        if (::mincore(addr, n * ps, vec.data()) != 0)
            return fail_errno("{}: mincore of pages {}..{}", path_, first_page + done, first_page + done + n);
        for (uint64_t i = 0; i < n; ++i) cached += vec[i] & 1;
        done += n;
    }
    return cached;
}

Result<uint64_t> PageCacheProbe::resident_bytes(uint64_t offset, uint64_t length) {
    if (offset > size_ || length > size_ - offset)
        return failf("{}: range {}..{} lies past the end of the file ({} bytes)", path_, offset,
                     offset + length, size_);
    if (length == 0) return uint64_t{0};
    const uint64_t ps = page_size();
    const uint64_t end = offset + length;
    const uint64_t first = offset / ps, last = (end - 1) / ps;
    if (first == last) return MC_TRY(cached_pages(first, 1)) ? length : 0;
    uint64_t bytes = 0;
    // Edge pages count by the part of them inside the range; whole pages in between by page.
    if (MC_TRY(cached_pages(first, 1))) bytes += (first + 1) * ps - offset;
    if (MC_TRY(cached_pages(last, 1))) bytes += end - last * ps;
    if (last > first + 1) {
        const uint64_t mid = MC_TRY(cached_pages(first + 1, last - first - 1));
        bytes += mid * ps;
    }
    return bytes;
}

}  // namespace moecache
