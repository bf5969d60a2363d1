// Lazy load, part of libmoecache-rearm.so. MOECACHE_LOAD=lazy turns it on, native off; auto (the
// default) turns it on when moecached's client socket is there ($MOECACHE_SOCKET, else
// /run/moecache/moecached.sock): with the daemon running, the daemon decides what is read.
// llama.cpp maps a model with MAP_POPULATE and asks POSIX_MADV_WILLNEED for all of it, so the
// whole file is read at load, and every later fault on it reads ahead. When the model is larger
// than the memory the runtime may use, that load alone evicts what moecached prefetched and
// locked for it, and each read-ahead drags cold neighbours in over hot experts. With lazy load,
// for shared mappings of GGUF files only (by their magic, whatever their names): MAP_POPULATE is left out, WILLNEED is not passed on,
// and the mapping is marked MADV_RANDOM (no read-ahead on its faults): the daemon decides what is
// read ahead of use. Where the runtime asked for MAP_POPULATE, what is in the page cache already
// (what a warm daemon read) is mapped at once (mincore, then MADV_POPULATE_READ over each run of
// resident pages), so that decoding does not pay a page fault per 64 KiB of it; nothing else is
// read. What the runtime reads through the mapping is the same bytes either way.
//
// These are the process's mmap, mmap64, madvise and posix_madvise. They call the kernel directly
// (no dlsym: the dynamic loader's own allocations come here before anything is set up) and look
// at a mapping's file only when lazy load is on and the mapping is a shared one of a descriptor.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

enum class Mode { Unknown, Native, Lazy };
std::atomic<Mode> g_mode{Mode::Unknown};

bool daemon_socket_present() {
    const char* s = std::getenv("MOECACHE_SOCKET");
    const char* path = s != nullptr && *s != '\0' ? s : "/run/moecache/moecached.sock";
    struct stat st {};
    return ::syscall(SYS_newfstatat, AT_FDCWD, path, &st, 0) == 0 && S_ISSOCK(st.st_mode);
}

Mode mode() {
    Mode m = g_mode.load(std::memory_order_relaxed);
    if (m != Mode::Unknown) return m;
    const char* e = std::getenv("MOECACHE_LOAD");
    if (e != nullptr && std::strcmp(e, "lazy") == 0) {
        m = Mode::Lazy;
    } else if (e != nullptr && std::strcmp(e, "native") == 0) {
        m = Mode::Native;
    } else {
        if (e != nullptr && *e != '\0' && std::strcmp(e, "auto") != 0) {
            static const char kMsg[] = "moecache: MOECACHE_LOAD is 'auto', 'lazy' or 'native': auto\n";
            (void)!::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
        }
        m = daemon_socket_present() ? Mode::Lazy : Mode::Native;
    }
    g_mode.store(m, std::memory_order_relaxed);
    return m;
}

// The model mappings seen, for madvise: append-only, lock-free (a stale entry after munmap only
// means WILLNEED is not passed on for whatever is mapped there later).
constexpr int kMaxRanges = 256;
std::atomic<uintptr_t> g_begin[kMaxRanges], g_end[kMaxRanges];
std::atomic<int> g_ranges{0};

bool in_model(const void* addr, size_t len) {
    const auto a = reinterpret_cast<uintptr_t>(addr);
    const int n = std::min(g_ranges.load(std::memory_order_acquire), kMaxRanges);
    for (int i = 0; i < n; ++i) {
        const uintptr_t b = g_begin[i].load(std::memory_order_relaxed), e = g_end[i].load(std::memory_order_relaxed);
        if (a >= b && a < e && len <= e - a) return true;
    }
    return false;
}

// A model is known by its first bytes, not its name: Hugging Face's cache and ollama keep models as
// blobs without a .gguf suffix. Regular files only.
bool is_gguf(int fd) {
    struct stat st {};
    char magic[4];
    return ::syscall(SYS_fstat, fd, &st) == 0 && S_ISREG(st.st_mode) &&
           ::syscall(SYS_pread64, fd, magic, 4, 0) == 4 && std::memcmp(magic, "GGUF", 4) == 0;
}

void* sys_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    // syscall() returns -1 with errno set on failure; no mapping starts at -1.
    return reinterpret_cast<void*>(::syscall(SYS_mmap, addr, len, prot, flags, fd, off));
}

int sys_madvise(void* addr, size_t len, int advice) { return static_cast<int>(::syscall(SYS_madvise, addr, len, advice)); }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

// Maps the pages of [addr, addr + len) that are in the page cache now, reading nothing else (a
// page evicted between the look and the mapping is read alone: the mapping is MADV_RANDOM).
// Stops quietly where the kernel lacks MADV_POPULATE_READ (before 5.14).
void populate_cached(void* addr, size_t len) {
    constexpr size_t kPage = 4096, kChunk = 4096;  // pages per mincore call: a 4 KiB vector on the stack
    unsigned char vec[kChunk];
    auto* base = static_cast<unsigned char*>(addr);
    const size_t pages = len / kPage;
    for (size_t first = 0; first < pages; first += kChunk) {
        const size_t n = pages - first < kChunk ? pages - first : kChunk;
        if (::syscall(SYS_mincore, base + first * kPage, n * kPage, vec) != 0) return;
        for (size_t i = 0; i < n;) {
            if ((vec[i] & 1) == 0) {
                ++i;
                continue;
            }
            size_t j = i;
            while (j < n && (vec[j] & 1) != 0) ++j;
            if (sys_madvise(base + (first + i) * kPage, (j - i) * kPage, MADV_POPULATE_READ) != 0 && errno == EINVAL) return;
            i = j;
        }
    }
}

void* lazy_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    if (fd < 0 || (flags & MAP_SHARED) == 0 || (prot & PROT_WRITE) != 0 || mode() != Mode::Lazy || !is_gguf(fd))
        return sys_mmap(addr, len, prot, flags, fd, off);
    void* r = sys_mmap(addr, len, prot, flags & ~MAP_POPULATE, fd, off);
    if (r == MAP_FAILED) return r;
    (void)sys_madvise(r, len, MADV_RANDOM);
    if ((flags & MAP_POPULATE) != 0) {
        const int saved = errno;
        populate_cached(r, len);
        errno = saved;
    }
    const int i = g_ranges.fetch_add(1, std::memory_order_acq_rel);
    if (i < kMaxRanges) {
        g_begin[i].store(reinterpret_cast<uintptr_t>(r), std::memory_order_relaxed);
        g_end[i].store(reinterpret_cast<uintptr_t>(r) + len, std::memory_order_relaxed);
    }
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
        static const char kMsg[] = "moecache: lazy load: models are mapped without reading them (no MAP_POPULATE, WILLNEED, read-ahead): what is cached is mapped\n";
        (void)!::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
    }
    return r;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    return lazy_mmap(addr, len, prot, flags, fd, off);
}

__attribute__((visibility("default"))) void* mmap64(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    return lazy_mmap(addr, len, prot, flags, fd, off);
}

__attribute__((visibility("default"))) int madvise(void* addr, size_t len, int advice) {
    if (advice == MADV_WILLNEED && mode() == Mode::Lazy && in_model(addr, len)) return 0;
    return sys_madvise(addr, len, advice);
}

// As glibc's: POSIX_MADV_DONTNEED is not passed on (MADV_DONTNEED would discard), errors are returned.
__attribute__((visibility("default"))) int posix_madvise(void* addr, size_t len, int advice) {
    if (advice == POSIX_MADV_DONTNEED) return 0;
    if (advice == POSIX_MADV_WILLNEED && mode() == Mode::Lazy && in_model(addr, len)) return 0;
    const int saved = errno;
    const int r = sys_madvise(addr, len, advice);
    const int err = r == 0 ? 0 : errno;
    errno = saved;
    return err;
}

}  // extern "C"
