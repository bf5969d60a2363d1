#include "moecache/bpf/page_cache_telemetry.h"

#include "moecache/bpf/page_cache_event.h"
#include "page_cache.skel.h"

#include <bpf/btf.h>
#include <bpf/libbpf.h>
#include <linux/bpf.h>
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>

namespace moecache::bpf {
namespace {

static_assert(sizeof(mc_page_cache_event) == 24, "the event layout is shared with the BPF program");
static_assert(sizeof(mc_file_key) == 16);

// libbpf reports through one process-wide callback. Its warnings are kept (the last few lines) so
// that a failed open can say what the verifier or the loader said; debug chatter is dropped.
std::mutex g_libbpf_mutex;
std::string g_libbpf_log;

__attribute__((format(printf, 2, 0))) int on_libbpf_print(enum libbpf_print_level level, const char* format,
                                                          va_list args) {
    if (level == LIBBPF_DEBUG) return 0;
    char line[512];
    const int n = std::vsnprintf(line, sizeof line, format, args);
    std::lock_guard lock(g_libbpf_mutex);
    g_libbpf_log += line;
    if (g_libbpf_log.size() > 4096) g_libbpf_log.erase(0, g_libbpf_log.size() - 4096);
    return n;
}

std::string take_libbpf_log() {
    std::lock_guard lock(g_libbpf_mutex);
    std::string s;
    s.swap(g_libbpf_log);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

template <typename... Args>
tl::unexpected<Error> fail_code(int err, fmt::format_string<Args...> f, Args&&... args) {
    return fail(err, fmt::format(f, std::forward<Args>(args)...));
}

struct SkelDeleter {
    void operator()(page_cache_bpf* s) const { page_cache_bpf__destroy(s); }
};

std::string hint_for(int err) {
    if (err == EPERM || err == EACCES)
        return " (loading BPF programs needs root, or CAP_BPF with CAP_PERFMON; under systemd, keep them in "
               "AmbientCapabilities/CapabilityBoundingSet)";
    if (err == ENOENT || err == ESRCH) return " (the kernel lacks a tracepoint or BTF this needs)";
    if (err == E2BIG || err == ENOMEM) return " (the ring buffer or a map is larger than the kernel allows)";
    return "";
}

}  // namespace

const char* to_string(PageCacheEventKind k) {
    switch (k) {
        case PageCacheEventKind::Added: return "added";
        case PageCacheEventKind::Deleted: return "deleted";
        case PageCacheEventKind::Fault: return "fault";
        case PageCacheEventKind::Mapped: return "mapped";
    }
    return "unknown";
}

uint64_t PageCacheCounters::total_sent() const {
    uint64_t t = 0;
    for (uint64_t v : sent) t += v;
    return t;
}

uint64_t PageCacheCounters::total_dropped() const {
    uint64_t t = 0;
    for (uint64_t v : dropped) t += v;
    return t;
}

uint32_t kernel_dev(dev_t user_dev) {
    return (static_cast<uint32_t>(major(user_dev)) << 20) | static_cast<uint32_t>(minor(user_dev));
}

PageCacheFeatures probe_page_cache_features() {
    PageCacheFeatures f;
    if (::access("/sys/kernel/btf/vmlinux", R_OK) != 0) {
        f.missing = "the kernel has no BTF (/sys/kernel/btf/vmlinux; CONFIG_DEBUG_INFO_BTF)";
        return f;
    }
    struct btf* vmlinux = btf__load_vmlinux_btf();
    if (!vmlinux) {
        f.missing = fmt::format("the kernel's BTF could not be read: {}", std::strerror(errno));
        return f;
    }
    f.btf = true;
    auto has = [&](const char* tp) { return btf__find_by_name_kind(vmlinux, tp, BTF_KIND_TYPEDEF) > 0; };
    f.add_delete = has("btf_trace_mm_filemap_add_to_page_cache") && has("btf_trace_mm_filemap_delete_from_page_cache");
    f.faults = has("btf_trace_mm_filemap_fault") && has("btf_trace_mm_filemap_map_pages");
    btf__free(vmlinux);
    if (!f.add_delete)
        f.missing = "the kernel has no mm_filemap_add_to_page_cache / mm_filemap_delete_from_page_cache "
                    "tracepoints taking a folio (Linux 5.18 or later has them)";
    else if (!f.faults)
        f.missing = "the kernel has no mm_filemap_fault / mm_filemap_map_pages tracepoints (Linux 6.11 or "
                    "later): page faults are not reported";
    return f;
}

// The ring buffer, read directly: the consumer position page mapped writable, the producer page
// and the data (mapped twice in a row by the kernel, so a record never wraps) read-only. Reading
// it here, not through libbpf's ring_buffer, lets one call stop after max_events records, so that
// a flood cannot hold the caller's event loop.
struct PageCacheTelemetry::State {
    std::unique_ptr<page_cache_bpf, SkelDeleter> skel;
    Sink sink;
    int ring_fd = -1;
    uint32_t ring_bytes = 0;
    size_t page = 0;
    void* consumer = MAP_FAILED;  // one page: unsigned long consumer_pos
    void* producer = MAP_FAILED;  // one page (producer_pos) + 2 * ring_bytes of data
    bool faults = false;

    ~State() {
        if (consumer != MAP_FAILED) ::munmap(consumer, page);
        if (producer != MAP_FAILED) ::munmap(producer, page + 2 * size_t{ring_bytes});
    }
};

PageCacheTelemetry::PageCacheTelemetry(std::unique_ptr<State> s) : s_(std::move(s)) {}
PageCacheTelemetry::PageCacheTelemetry(PageCacheTelemetry&&) noexcept = default;
PageCacheTelemetry& PageCacheTelemetry::operator=(PageCacheTelemetry&&) noexcept = default;
PageCacheTelemetry::~PageCacheTelemetry() = default;

Result<PageCacheTelemetry> PageCacheTelemetry::open(const Options& options, Sink sink) {
    static std::once_flag once;
    std::call_once(once, [] { libbpf_set_print(on_libbpf_print); });
    const long page = ::sysconf(_SC_PAGESIZE);
    if (options.ring_bytes < page || (options.ring_bytes & (options.ring_bytes - 1)) != 0)
        return failf("page-cache telemetry: a ring buffer of {} bytes: it must be a power of two and at least "
                     "one page ({} bytes)",
                     options.ring_bytes, page);
    const PageCacheFeatures features = probe_page_cache_features();
    if (!features.btf || !features.add_delete) return failf("page-cache telemetry: {}", features.missing);

    auto s = std::make_unique<State>();
    s->sink = std::move(sink);
    s->page = static_cast<size_t>(page);
    s->ring_bytes = options.ring_bytes;
    (void)take_libbpf_log();
    s->skel.reset(page_cache_bpf__open());
    if (!s->skel) {
        const int err = errno;
        return fail_code(err, "page-cache telemetry: opening the BPF object: {}", take_libbpf_log());
    }
    auto& skel = *s->skel;
    skel.rodata->ignore_tgid = static_cast<__u32>(options.ignore_tgid);
    skel.rodata->wakeup_bytes = options.wakeup_bytes != 0 ? options.wakeup_bytes : options.ring_bytes / 4;
    skel.rodata->miss_wakeup_ns = uint64_t{options.miss_wakeup_us} * 1000;
    if (int r = bpf_map__set_max_entries(skel.maps.events, options.ring_bytes); r != 0)
        return fail_code(-r, "page-cache telemetry: ring buffer size");
    if (int r = bpf_map__set_max_entries(skel.maps.watched, options.max_files); r != 0)
        return fail_code(-r, "page-cache telemetry: watch map size");
    s->faults = options.faults && features.faults;
    if (!s->faults) {
        bpf_program__set_autoload(skel.progs.mc_fault, false);
        bpf_program__set_autoload(skel.progs.mc_map_pages, false);
    }
    if (int r = page_cache_bpf__load(&skel); r != 0) {
        const int err = -r;
        return fail_code(err, "page-cache telemetry: loading the BPF programs{}: {}", hint_for(err),
                          take_libbpf_log());
    }
    if (int r = page_cache_bpf__attach(&skel); r != 0) {
        const int err = -r;
        return fail_code(err, "page-cache telemetry: attaching to the filemap tracepoints{}: {}", hint_for(err),
                          take_libbpf_log());
    }
    s->ring_fd = bpf_map__fd(skel.maps.events);
    s->consumer = ::mmap(nullptr, s->page, PROT_READ | PROT_WRITE, MAP_SHARED, s->ring_fd, 0);
    if (s->consumer == MAP_FAILED) return fail_errno("page-cache telemetry: mapping the ring's consumer page");
    s->producer = ::mmap(nullptr, s->page + 2 * size_t{s->ring_bytes}, PROT_READ, MAP_SHARED, s->ring_fd,
                         static_cast<off_t>(s->page));
    if (s->producer == MAP_FAILED) return fail_errno("page-cache telemetry: mapping the ring's data");
    return PageCacheTelemetry(std::move(s));
}

Result<void> PageCacheTelemetry::watch(dev_t dev, ino_t ino, uint32_t file_id) {
    mc_file_key key{};
    key.ino = ino;
    key.dev = kernel_dev(dev);
    mc_file_watch value{};
    value.file_id = file_id;
    if (int r = bpf_map__update_elem(s_->skel->maps.watched, &key, sizeof key, &value, sizeof value, BPF_ANY); r != 0)
        return fail_code(-r, "page-cache telemetry: watching inode {} on device {}:{}{}", ino, major(dev), minor(dev),
                          -r == E2BIG ? " (the watch map is full)" : "");
    return {};
}

Result<void> PageCacheTelemetry::unwatch(dev_t dev, ino_t ino) {
    mc_file_key key{};
    key.ino = ino;
    key.dev = kernel_dev(dev);
    if (int r = bpf_map__delete_elem(s_->skel->maps.watched, &key, sizeof key, 0); r != 0 && -r != ENOENT)
        return fail_code(-r, "page-cache telemetry: unwatching inode {} on device {}:{}", ino, major(dev),
                          minor(dev));
    return {};
}

int PageCacheTelemetry::event_fd() const { return s_->ring_fd; }

size_t PageCacheTelemetry::consume(size_t max_events) {
    constexpr uint32_t kBusy = 1u << 31, kDiscard = 1u << 30, kHeader = 8;
    auto* cons_pos = static_cast<unsigned long*>(s_->consumer);
    const auto* prod_pos = static_cast<const unsigned long*>(s_->producer);
    const auto* data = static_cast<const uint8_t*>(s_->producer) + s_->page;
    const unsigned long mask = s_->ring_bytes - 1;
    unsigned long cons = __atomic_load_n(cons_pos, __ATOMIC_ACQUIRE);
    size_t n = 0;
    while (n < max_events) {
        const unsigned long prod = __atomic_load_n(prod_pos, __ATOMIC_ACQUIRE);
        if (cons >= prod) break;
        const auto* header = reinterpret_cast<const uint32_t*>(data + (cons & mask));
        const uint32_t len = __atomic_load_n(header, __ATOMIC_ACQUIRE);
        if (len & kBusy) break;  // reserved, not yet submitted
        const uint32_t size = len & ~(kBusy | kDiscard);
        if (!(len & kDiscard) && size >= sizeof(mc_page_cache_event)) {
            mc_page_cache_event raw;
            std::memcpy(&raw, data + (cons & mask) + kHeader, sizeof raw);
            if (raw.kind < kPageCacheEventKinds) {
                PageCacheEvent e;
                e.kind = static_cast<PageCacheEventKind>(raw.kind);
                e.file_id = raw.file_id;
                e.tgid = raw.tgid;
                e.first_page = raw.index;
                e.pages = raw.nr_pages;
                s_->sink(e);
                ++n;
            }
        }
        cons += (size + kHeader + 7) & ~7ul;
        __atomic_store_n(cons_pos, cons, __ATOMIC_RELEASE);
    }
    return n;
}

PageCacheCounters PageCacheTelemetry::counters() const {
    PageCacheCounters c;
    const auto* bss = s_->skel->bss;
    for (size_t k = 0; k < kPageCacheEventKinds; ++k) {
        c.sent[k] = __atomic_load_n(&bss->sent[k], __ATOMIC_RELAXED);
        c.dropped[k] = __atomic_load_n(&bss->dropped[k], __ATOMIC_RELAXED);
    }
    return c;
}

bool PageCacheTelemetry::faults_attached() const { return s_->faults; }
uint32_t PageCacheTelemetry::ring_bytes() const { return s_->ring_bytes; }

}  // namespace moecache::bpf
