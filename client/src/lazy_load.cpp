// Lazy load, part of libmoecache-rearm.so (MOECACHE_LOAD=lazy; default native: nothing changes).
// llama.cpp maps a model with MAP_POPULATE and asks POSIX_MADV_WILLNEED for all of it, so the
// whole file is read at load, and every later fault on it reads ahead. When the model is larger
// than the memory the runtime may use, that load alone evicts what moecached prefetched and
// locked for it, and each read-ahead drags cold neighbours in over hot experts. With lazy load,
// for shared mappings of *.gguf files only: MAP_POPULATE is left out, WILLNEED is not passed on,
// and the mapping is marked MADV_RANDOM (no read-ahead on its faults): the daemon decides what is
// read ahead of use. What the runtime reads through the mapping is the same bytes either way.
//
// These are the process's mmap, mmap64, madvise and posix_madvise. They call the kernel directly
// (no dlsym: the dynamic loader's own allocations come here before anything is set up) and look
// at a mapping's file only when lazy load is on and the mapping is a shared one of a descriptor.
#include <fcntl.h>
#include <sys/mman.h>
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

Mode mode() {
    Mode m = g_mode.load(std::memory_order_relaxed);
    if (m != Mode::Unknown) return m;
    const char* e = std::getenv("MOECACHE_LOAD");
    m = e != nullptr && std::strcmp(e, "lazy") == 0 ? Mode::Lazy : Mode::Native;
    if (e != nullptr && m == Mode::Native && std::strcmp(e, "native") != 0 && *e != '\0') {
        static const char kMsg[] = "moecache: MOECACHE_LOAD is 'lazy' or 'native': native\n";
        (void)!::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
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

bool is_gguf(int fd) {
    char link[64], path[4096];
    std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    const ssize_t n = ::readlink(link, path, sizeof path - 1);
    return n > 5 && std::memcmp(path + n - 5, ".gguf", 5) == 0;
}

void* sys_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    // syscall() returns -1 with errno set on failure; no mapping starts at -1.
    return reinterpret_cast<void*>(::syscall(SYS_mmap, addr, len, prot, flags, fd, off));
}

int sys_madvise(void* addr, size_t len, int advice) { return static_cast<int>(::syscall(SYS_madvise, addr, len, advice)); }

void* lazy_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
    if (fd < 0 || (flags & MAP_SHARED) == 0 || (prot & PROT_WRITE) != 0 || mode() != Mode::Lazy || !is_gguf(fd))
        return sys_mmap(addr, len, prot, flags, fd, off);
    void* r = sys_mmap(addr, len, prot, flags & ~MAP_POPULATE, fd, off);
    if (r == MAP_FAILED) return r;
    (void)sys_madvise(r, len, MADV_RANDOM);
    const int i = g_ranges.fetch_add(1, std::memory_order_acq_rel);
    if (i < kMaxRanges) {
        g_begin[i].store(reinterpret_cast<uintptr_t>(r), std::memory_order_relaxed);
        g_end[i].store(reinterpret_cast<uintptr_t>(r) + len, std::memory_order_relaxed);
    }
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
        static const char kMsg[] = "moecache: lazy load: models are mapped without MAP_POPULATE, WILLNEED and read-ahead\n";
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
