// The loader of moecache's page-cache programs (src/page_cache.bpf.c): opens them, sets the
// read-only tunables, loads and attaches them, keeps the set of watched files in the kernel, and
// reads their ring buffer from the caller's event loop (event_fd() in an epoll set, then consume()).
// Owns every kernel handle it makes; moving it is fine, copying is not.
#pragma once

#include "moecache/error.h"

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace moecache::bpf {

enum class PageCacheEventKind : uint8_t {
    Added = 0,    // pages entered the page cache: read from storage
    Deleted = 1,  // pages left it: evicted, dropped, truncated
    Fault = 2,    // a page fault that reached the file
    Mapped = 3,   // a page fault served from the page cache (with the window mapped around it)
};
constexpr size_t kPageCacheEventKinds = 4;
const char* to_string(PageCacheEventKind k);

struct PageCacheEvent {
    PageCacheEventKind kind = PageCacheEventKind::Added;
    uint32_t file_id = 0;  // as given to watch()
    uint32_t tgid = 0;     // the process it happened in
    uint64_t first_page = 0;
    uint32_t pages = 0;
};

// What the running kernel offers, probed from its BTF without loading anything.
struct PageCacheFeatures {
    bool btf = false;          // /sys/kernel/btf/vmlinux
    bool add_delete = false;   // mm_filemap_add_to_page_cache, mm_filemap_delete_from_page_cache
    bool faults = false;       // mm_filemap_fault, mm_filemap_map_pages (Linux >= 6.11)
    std::string missing;       // what is missing, in words, when something is
};
PageCacheFeatures probe_page_cache_features();

struct PageCacheCounters {
    uint64_t sent[kPageCacheEventKinds] = {};     // records the kernel put in the ring
    uint64_t dropped[kPageCacheEventKinds] = {};  // records the ring had no room for
    [[nodiscard]] uint64_t total_sent() const;
    [[nodiscard]] uint64_t total_dropped() const;
};

class PageCacheTelemetry {
public:
    struct Options {
        uint32_t ring_bytes = 4u << 20;  // a power of two, at least one page
        uint32_t max_files = 4096;       // watched files at once
        pid_t ignore_tgid = 0;           // its faults are not reported (the daemon itself)
        bool faults = true;              // attach the fault programs where the kernel has them
        // event_fd() becomes readable once this many bytes wait (0: a quarter of the ring); below
        // that the caller consumes on its own clock (poll_interval_ms below is a good one).
        uint32_t wakeup_bytes = 0;
        // A page added by another process than ignore_tgid (a miss: a runtime reading from
        // storage) makes event_fd() readable at once, at most once per this many microseconds
        // (0: misses wait for wakeup_bytes like everything else).
        uint32_t miss_wakeup_us = 0;
    };
    // How often a caller should consume() even when event_fd() has not become readable.
    static constexpr int kPollIntervalMs = 100;
    using Sink = std::function<void(const PageCacheEvent&)>;

    // Fails with a message that says what is missing (privileges, BTF, a tracepoint) and errno.
    static Result<PageCacheTelemetry> open(const Options& options, Sink sink);

    PageCacheTelemetry(PageCacheTelemetry&&) noexcept;
    PageCacheTelemetry& operator=(PageCacheTelemetry&&) noexcept;
    ~PageCacheTelemetry();

    // Report events of the file with this identity (st_dev, st_ino as stat() gives them) as file_id.
    Result<void> watch(dev_t dev, ino_t ino, uint32_t file_id);
    Result<void> unwatch(dev_t dev, ino_t ino);

    // Readable (EPOLLIN) once the ring holds Options::wakeup_bytes, or on a miss
    // (Options::miss_wakeup_us): consume() also every kPollIntervalMs.
    [[nodiscard]] int event_fd() const;
    // Hands up to max_events records to the sink; returns how many. Never waits.
    size_t consume(size_t max_events = SIZE_MAX);
    [[nodiscard]] PageCacheCounters counters() const;
    [[nodiscard]] bool faults_attached() const;
    [[nodiscard]] uint32_t ring_bytes() const;

private:
    struct State;
    explicit PageCacheTelemetry(std::unique_ptr<State> s);
    std::unique_ptr<State> s_;
};

// The kernel's encoding of a device number (what super_block::s_dev holds): (major << 20) | minor.
uint32_t kernel_dev(dev_t user_dev);

}  // namespace moecache::bpf
