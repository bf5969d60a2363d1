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
    // O_NONBLOCK: a FIFO in the file's place cannot block the caller (it is refused as no file).
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd) return fail_errno("{}: cannot open", path);
    return of(std::move(fd), path);
}

Result<PageCacheProbe> PageCacheProbe::of(int fd, const std::string& name) {
    UniqueFd own(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!own) return fail_errno("{}: dup of descriptor {}", name, fd);
    return of(std::move(own), name);
}

Result<PageCacheProbe> PageCacheProbe::of(UniqueFd fd, const std::string& path) {
    PageCacheProbe p;
    p.path_ = path;
    p.fd_ = std::move(fd);
    struct stat st {};
    if (::fstat(p.fd_.get(), &st) != 0) return fail_errno("{}: fstat", path);
    if (!S_ISREG(st.st_mode)) return failf("{}: not a regular file", path);
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
    // One look at every page first: a range none or all of whose pages are cached (a cold expert,
    // a locked one: most of them, each tick) needs no other. This runs for every expert of every
    // model each tick, where each look is a system call.
    const uint64_t pages = last - first + 1;
    const uint64_t all = MC_TRY(cached_pages(first, pages));
    if (all == 0) return uint64_t{0};
    if (all == pages) return length;
    // Edge pages count by the part of them inside the range; whole pages in between by page.
    const uint64_t head = MC_TRY(cached_pages(first, 1)), tail = MC_TRY(cached_pages(last, 1));
    const uint64_t mid = all >= head + tail ? all - head - tail : 0;  // a page evicted between the looks
    return (head ? (first + 1) * ps - offset : 0) + (tail ? end - last * ps : 0) + mid * ps;
}

namespace {

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

// Opened once: /proc/self/pagemap gives frame numbers to root only, /proc/kpageflags is root's.
struct PageFlagFiles {
    UniqueFd pagemap{::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC)};
    UniqueFd kpageflags{::open("/proc/kpageflags", O_RDONLY | O_CLOEXEC)};
};
const PageFlagFiles& page_flag_files() {
    static const PageFlagFiles f;
    return f;
}

constexpr int kHead = 15, kTail = 16;  // KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL
constexpr uint64_t kMaxFolioPages = 1024;  // 4 MiB of 4 KiB pages: beyond any page-cache folio
constexpr uint64_t kFaultAround = kFaultAroundBytes / 4096;  // in pages (a 16-entry window at most)

bool page_cached(const uint8_t* addr) {
    unsigned char v = 0;
    return ::mincore(const_cast<uint8_t*>(addr), page_size(), &v) == 0 && (v & 1) != 0;
}

}  // namespace

std::optional<FolioSpan> folio_of(const uint8_t* map, uint64_t map_len, uint64_t page) {
    const auto& files = page_flag_files();
    const uint64_t ps = page_size();
    if (!files.pagemap || !files.kpageflags || map == nullptr || (page + 1) * ps > map_len) return std::nullopt;
    auto* base = const_cast<uint8_t*>(map);
    if (!page_cached(base + page * ps)) return std::nullopt;
    // A fault maps the cached pages around it too (fault-around, 64 KiB by default, whatever the
    // mapping's advice); what this look maps it unmaps after, and nothing else.
    const uint64_t lo_page = page & ~(kFaultAround - 1);
    const uint64_t n_window = std::min(kFaultAround, map_len / ps - lo_page);
    auto present = [&](uint64_t* out) {
        const auto want = static_cast<ssize_t>(n_window * sizeof(uint64_t));
        return ::pread(files.pagemap.get(), out, static_cast<size_t>(want),
                       static_cast<off_t>(reinterpret_cast<uintptr_t>(base + lo_page * ps) / ps * sizeof(uint64_t))) == want;
    };
    uint64_t before[kFaultAround] = {}, after[kFaultAround] = {};
    if (!present(before)) return std::nullopt;
    // Mapping a cached page reads nothing; a page dropped meanwhile is read back alone (the
    // callers' mappings are MADV_RANDOM), which is still correct, only wasted.
    if (::madvise(base + page * ps, ps, MADV_POPULATE_READ) != 0) return std::nullopt;
    const bool got = present(after);
    for (uint64_t i = 0; i < n_window; ++i)
        if ((before[i] >> 63) == 0 && (after[i] >> 63) != 0) (void)::madvise(base + (lo_page + i) * ps, ps, MADV_DONTNEED);
    const uint64_t entry = after[page - lo_page];
    const uint64_t pfn = entry & ((uint64_t{1} << 55) - 1);
    if (!got || (entry >> 63) == 0 || pfn == 0) return std::nullopt;  // not present, or no frame numbers for us
    // The flags of the frames around it: the head is at most kMaxFolioPages - 1 frames before.
    const uint64_t lo = pfn >= kMaxFolioPages - 1 ? pfn - (kMaxFolioPages - 1) : 0;
    std::vector<uint64_t> flags(pfn - lo + kMaxFolioPages);
    const auto want = static_cast<ssize_t>(flags.size() * sizeof(uint64_t));
    const ssize_t n = ::pread(files.kpageflags.get(), flags.data(), static_cast<size_t>(want),
                              static_cast<off_t>(lo * sizeof(uint64_t)));
    if (n < static_cast<ssize_t>((pfn - lo + 1) * sizeof(uint64_t))) return std::nullopt;
    flags.resize(static_cast<size_t>(n) / sizeof(uint64_t));
    auto bit = [&](uint64_t f, int b) { return ((flags[f - lo] >> b) & 1) != 0; };
    if (!bit(pfn, kHead) && !bit(pfn, kTail)) return FolioSpan{page, 1};
    uint64_t head = pfn;
    while (bit(head, kTail)) {
        if (head == lo) return std::nullopt;  // larger than any folio: the flags moved under us
        --head;
    }
    if (!bit(head, kHead) || pfn - head > page) return std::nullopt;
    uint64_t end = pfn + 1;
    while (end - lo < flags.size() && bit(end, kTail)) ++end;
    return FolioSpan{page - (pfn - head), end - head};
}

uint32_t drop_file_pages(int fd, const uint8_t* map, uint64_t map_len, uint64_t first_page, uint64_t n_pages) {
    if (n_pages == 0) return 0;
    const uint64_t ps = page_size();
    auto fadvise = [&](uint64_t first, uint64_t n) {
        (void)::posix_fadvise(fd, static_cast<off_t>(first * ps), static_cast<off_t>(n * ps), POSIX_FADV_DONTNEED);
    };
    if (map != nullptr) (void)::madvise(const_cast<uint8_t*>(map) + first_page * ps, n_pages * ps, MADV_DONTNEED);
    fadvise(first_page, n_pages);
    uint32_t widened = 0;
    const uint64_t edges[2] = {first_page, first_page + n_pages - 1};
    for (int i = 0; i < (n_pages > 1 ? 2 : 1); ++i) {
        if (map == nullptr || (edges[i] + 1) * ps > map_len || !page_cached(map + edges[i] * ps)) continue;
        const auto f = folio_of(map, map_len, edges[i]);
        if (!f || f->pages <= 1) continue;
        // Our own entries for the folio's other pages too (refused where we lock them: then the
        // folio stays, as it should).
        const uint64_t pages = std::min(f->pages, map_len / ps - f->first);
        (void)::madvise(const_cast<uint8_t*>(map) + f->first * ps, pages * ps, MADV_DONTNEED);
        fadvise(f->first, f->pages);
        ++widened;
    }
    return widened;
}

}  // namespace moecache
