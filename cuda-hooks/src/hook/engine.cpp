#include "engine.h"

#include "driver.h"
#include "moecache/client.h"
#include "moecache/cuda/copy_plan.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace moecache::cuda::hook {
namespace {

constexpr size_t kMaxPieces = 2 * 256 + 2;
constexpr uint64_t kArenaBytes = 1ull << 30;
constexpr auto kRescanInterval = std::chrono::seconds(1);

std::atomic<bool> g_forked{false};
std::atomic<Engine*> g_engine{nullptr};

void say(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void say(const char* fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "moecache-cuda: %s\n", line);
}

bool parse_size(const char* s, double* bytes) {
    char* end = nullptr;
    const double v = strtod(s, &end);
    if (end == s || v < 0) return false;
    double mult = 1;
    switch (*end) {
        case 'k': case 'K': mult = 1024.0; ++end; break;
        case 'm': case 'M': mult = 1024.0 * 1024; ++end; break;
        case 'g': case 'G': mult = 1024.0 * 1024 * 1024; ++end; break;
        case 't': case 'T': mult = 1024.0 * 1024 * 1024 * 1024; ++end; break;
        default: break;
    }
    if (*end == 'i' && end[1] == 'B') end += 2;
    else if (*end == 'B') ++end;
    if (*end != '\0') return false;
    *bytes = v * mult;
    return true;
}

bool env_off(const char* name) {
    const char* v = getenv(name);
    return v != nullptr && (!strcmp(v, "off") || !strcmp(v, "0") || !strcmp(v, "no") || !strcmp(v, "false"));
}

CUstream effective_stream(const HostToDeviceCopy& c) {
    return c.per_thread && c.stream == nullptr ? CU_STREAM_PER_THREAD : c.stream;
}

bool ends_with(const std::string& s, const char* tail) {
    const size_t n = strlen(tail);
    return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

}  // namespace

EngineConfig config_from_environment() {
    EngineConfig c;
    if (const char* p = getenv("MOECACHE_CUDA_POOL"); p != nullptr && *p != '\0' && strcmp(p, "auto") != 0) {
        const size_t n = strlen(p);
        double v = 0;
        if (p[n - 1] == '%') {
            std::string num(p, n - 1);
            if (parse_size(num.c_str(), &v) && v <= 100) {
                c.pool = EngineConfig::PoolSize::Percent;
                c.pool_value = v;
            } else {
                say("MOECACHE_CUDA_POOL=%s: a percentage is 0%% to 100%%; using auto", p);
            }
        } else if (parse_size(p, &v)) {
            c.pool = EngineConfig::PoolSize::Bytes;
            c.pool_value = v;
        } else {
            say("MOECACHE_CUDA_POOL=%s: expected auto, a percentage (25%%) or a size (8G, 512M); using auto", p);
        }
    }
    if (const char* p = getenv("MOECACHE_CUDA_PIN"); p != nullptr && *p != '\0') {
        if (!strcmp(p, "all")) c.pin = true;
        else if (strcmp(p, "off") != 0) say("MOECACHE_CUDA_PIN=%s: expected off or all; using off", p);
    }
    const char* log = getenv("MOECACHE_CUDA_LOG");
    c.log = log != nullptr && *log != '\0' && strcmp(log, "0") != 0;
    c.client = !env_off("MOECACHE_CUDA_CLIENT");
    c.one_place = !env_off("MOECACHE_CUDA_ONE_PLACE");
    return c;
}

Engine* Engine::get() {
    static Engine* engine = [] () -> Engine* {
        if (env_off("MOECACHE_CUDA")) return nullptr;
        pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); });
        auto* e = new Engine(config_from_environment());
        e->start();
        g_engine.store(e);
        return e;
    }();
    return g_forked.load(std::memory_order_relaxed) ? nullptr : engine;
}

Engine* Engine::peek() { return g_forked.load() ? nullptr : g_engine.load(); }

Engine::Engine(EngineConfig cfg) : cfg_(cfg) {}

void Engine::start() {
    wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    std::thread([this] {
        try {
            run();
        } catch (const std::exception& e) {
            say("background thread stopped (%s): the pools stay as they are, nothing new is found", e.what());
        } catch (...) {
            say("background thread stopped: the pools stay as they are, nothing new is found");
        }
    }).detach();
}

void Engine::request_scan() {
    if (!scan_requested_.exchange(true, std::memory_order_acq_rel)) {
        const uint64_t one = 1;
        (void)!write(wake_fd_, &one, sizeof one);
    }
}

void Engine::run() {
    pthread_setname_np(pthread_self(), "moecache-cuda");
    if (cfg_.client) {
        char name[64];
        snprintf(name, sizeof name, "moecache-cuda pid %d", static_cast<int>(getpid()));
        client_ = moecache_client_open(nullptr, name);
    }
    auto last_scan = std::chrono::steady_clock::now() - kRescanInterval;
    auto last_rezap = std::chrono::steady_clock::now();
    while (!stopping_.load()) {
        pollfd p{wake_fd_, POLLIN, 0};
        (void)poll(&p, 1, 50);
        uint64_t v;
        (void)!read(wake_fd_, &v, sizeof v);
        if (stopping_.load()) break;
        const auto now = std::chrono::steady_clock::now();
        // A request stays set for the interval after a scan, so that copies from unknown
        // addresses (activations) cost no wake-up each.
        if (scan_requested_.load() && now - last_scan >= kRescanInterval) {
            scan();
            last_scan = std::chrono::steady_clock::now();
            scans_.fetch_add(1);
            scan_requested_.store(false);
        }
        const uint64_t wanted = devices_wanted_.load() & ~devices_done_;
        for (int d = 0; d < kMaxDevices; ++d) {
            if ((wanted >> d & 1) == 0) continue;
            if (!allocate_pool(d)) continue;  // no model mapped yet: again on the next turn
            if (cfg_.pin) pin_models(d);
            devices_done_.fetch_or(uint64_t{1} << d);
        }
        // The daemon's budget, when it sets or changes one.
        for (int d = 0; d < kMaxDevices && client_ != nullptr; ++d) {
            DevicePool* dp = pools_[d].load();
            uint64_t b = 0;
            int one_place = 0;
            if (dp == nullptr || moecache_client_vram_policy(client_, static_cast<uint32_t>(d), &b, &one_place) == 0)
                continue;
            const uint64_t applied = b == UINT64_MAX ? 0 : b + 1;
            if (daemon_budget_[d] == applied) continue;
            daemon_budget_[d] = applied;
            resize_pool(*dp);
        }
        poll_directives();
        drain_placements();
        // One place, again now and then: a read of a neighbour maps an expert's pages back in
        // (fault-around) whenever it faults.
        if (std::chrono::steady_clock::now() - last_rezap > std::chrono::seconds(2)) {
            rezap_pooled();
            report_pools();
            last_rezap = std::chrono::steady_clock::now();
        }
        sync_cv_.notify_all();
    }
}

Engine::Model* Engine::open_model(const MapsEntry& e) {
    // Only files that say GGUF in their first bytes are parsed; each is opened by its path and
    // checked to be the inode the mapping shows.
    UniqueFd fd(::open(e.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return nullptr;
    struct stat st {};
    char magic[4];
    if (fstat(fd.get(), &st) != 0 || major(st.st_dev) != e.file.dev_major || minor(st.st_dev) != e.file.dev_minor ||
        static_cast<uint64_t>(st.st_ino) != e.file.inode || pread(fd.get(), magic, 4, 0) != 4 || memcmp(magic, "GGUF", 4) != 0)
        return nullptr;
    auto parts = open_gguf_model(e.path);
    if (!parts) {
        say("%s: not used: %s", e.path.c_str(), parts.error().message.c_str());
        return nullptr;
    }
    auto map = ExpertMap::build(*parts);
    if (!map) {
        say("%s: not used: %s", e.path.c_str(), map.error().message.c_str());
        return nullptr;
    }
    if (map->layers.empty() || map->n_experts == 0) return nullptr;
    auto* m = new Model;
    m->id = static_cast<uint32_t>(models_.size());
    m->path = e.path;
    m->map = std::move(*map);
    for (const auto& f : m->map.files) {
        auto id = identify_file(f.path);
        m->files.push_back(id ? *id : InodeId{});
    }
    uint32_t max_block = 0;
    for (const auto& l : m->map.layers) max_block = std::max(max_block, l.index);
    m->layer_slot.assign(max_block + 1, -1);
    uint32_t base = 0;
    for (size_t i = 0; i < m->map.layers.size(); ++i) {
        const auto& l = m->map.layers[i];
        m->layer_slot[l.index] = static_cast<int32_t>(i);
        m->slice_base.push_back(base);
        m->slices_per_expert.push_back(static_cast<uint32_t>(l.tensors.size()));
        base += static_cast<uint32_t>(l.tensors.size()) * m->map.n_experts;
    }
    m->n_slices = base;
    m->n_experts = static_cast<uint32_t>(m->map.layers.size()) * m->map.n_experts;
    {
        std::lock_guard lock(mu_);
        heat_.add_model(m->id, m->n_experts);
        for (auto& p : pools_)
            if (auto* dp = p.load()) {
                dp->pool.add_model(m->id, m->n_slices, m->n_experts);
                if (dp->full.size() <= m->id) dp->full.resize(m->id + 1);
                dp->full[m->id].assign(m->n_experts, 0);
            }
    }
    models_.push_back(m);
    n_models_.store(models_.size());
    if (client_ != nullptr) {
        uint32_t h = 0;
        if (moecache_client_register_model(client_, m->path.c_str(), &h) == 0) m->client_handle.store(h);
    }
    return m;
}

void Engine::scan() {
    auto text = read_proc_text("/proc/self/maps");
    if (!text) return;
    std::vector<MappedRange> mapped;
    for (auto& e : parse_maps(*text)) {
        if (e.mapping.perms.size() < 4 || e.mapping.perms[0] != 'r' || e.mapping.perms[2] == 'x') continue;
        if (std::find(not_models_.begin(), not_models_.end(), e.file) != not_models_.end()) continue;
        Model* owner = nullptr;
        uint32_t file = 0;
        for (auto* m : models_) {
            auto it = std::find(m->files.begin(), m->files.end(), e.file);
            if (it != m->files.end()) {
                owner = m;
                file = static_cast<uint32_t>(it - m->files.begin());
                break;
            }
        }
        if (owner == nullptr) {
            if (e.path.empty() || e.path[0] != '/' || ends_with(e.path, " (deleted)") ||
                (owner = open_model(e)) == nullptr) {
                not_models_.push_back(e.file);
                continue;
            }
            auto it = std::find(owner->files.begin(), owner->files.end(), e.file);
            if (it == owner->files.end()) continue;
            file = static_cast<uint32_t>(it - owner->files.begin());
        }
        mapped.push_back({owner->id, file, e.mapping});
    }
    auto same = [](const MappedRange& a, const MappedRange& b) {
        return a.model == b.model && a.file == b.file && a.mapping.start == b.mapping.start &&
               a.mapping.end == b.mapping.end && a.mapping.file_offset == b.mapping.file_offset;
    };
    if (snapshot_.load() != nullptr && mapped.size() == mapped_.size() &&
        std::equal(mapped.begin(), mapped.end(), mapped_.begin(), same))
        return;
    auto* snap = new Snapshot;
    snap->models = models_;
    for (const auto& r : mapped) {
        Model* m = models_[r.model];
        snap->classifier.add_mapping(r.model, &m->map, r.file, r.mapping.start, r.mapping.end - r.mapping.start,
                                     r.mapping.file_offset);
        if (client_ != nullptr && m->client_handle.load() != UINT32_MAX)
            (void)moecache_client_describe_mapping(client_, m->client_handle.load(), r.file,
                                                   reinterpret_cast<const void*>(r.mapping.start),
                                                   r.mapping.end - r.mapping.start, r.mapping.file_offset);
    }
    mapped_ = std::move(mapped);
    snapshot_.store(snap, std::memory_order_release);  // the old one stays: a hooked call may be reading it
}

uint64_t Engine::pool_target(uint64_t expert_bytes, int device) const {
    uint64_t budget = expert_bytes;
    if (cfg_.pool == EngineConfig::PoolSize::Percent)
        budget = static_cast<uint64_t>(static_cast<double>(expert_bytes) * cfg_.pool_value / 100.0);
    if (cfg_.pool == EngineConfig::PoolSize::Bytes) budget = static_cast<uint64_t>(cfg_.pool_value);
    if (daemon_budget_[device] != 0) budget = std::min(budget, daemon_budget_[device] - 1);
    return budget;
}

bool Engine::allocate_pool(int device) {
    if (driver() == nullptr || models_.empty()) return false;
    auto* dp = new DevicePool;
    dp->device = device;
    {
        std::lock_guard lock(mu_);
        for (const auto* m : models_) {
            dp->pool.add_model(m->id, m->n_slices, m->n_experts);
            if (dp->full.size() <= m->id) dp->full.resize(m->id + 1);
            dp->full[m->id].assign(m->n_experts, 0);
        }
    }
    resize_pool(*dp);
    pools_[device].store(dp, std::memory_order_release);
    return true;
}

// Grows or shrinks a device's pool to its target: the configured size (or the experts' bytes),
// within the daemon's budget and the device's free memory less a reserve. Slots of each size get
// the share of the budget that their expert tensors have of all expert bytes.
void Engine::resize_pool(DevicePool& dp) {
    const Driver* drv = driver();
    if (drv == nullptr) return;
    CUcontext ctx = nullptr;
    if (drv->primary_ctx_retain(&ctx, dp.device) != CUDA_SUCCESS || drv->ctx_push_current(ctx) != CUDA_SUCCESS) return;
    std::vector<std::pair<uint64_t, uint64_t>> classes;  // slot bytes, expert bytes of that size
    uint64_t expert_bytes = 0;
    for (const auto* m : models_)
        for (const auto& l : m->map.layers)
            for (const auto& t : l.tensors) {
                const uint64_t b = t.bytes_per_expert * m->map.n_experts;
                expert_bytes += b;
                auto it = std::find_if(classes.begin(), classes.end(), [&](auto& c) { return c.first == t.bytes_per_expert; });
                if (it == classes.end()) classes.emplace_back(t.bytes_per_expert, b);
                else it->second += b;
            }
    const uint64_t target = pool_target(expert_bytes, dp.device);
    size_t free_bytes = 0, total_bytes = 0;
    (void)drv->mem_get_info(&free_bytes, &total_bytes);
    // Whole arenas go; what that gives back beyond the target is allocated again below.
    if (dp.bytes > target) {
        std::vector<uint64_t> bases;
        {
            std::lock_guard lock(mu_);
            bases = dp.pool.release(dp.bytes - target, heat_);
            for (const auto* m : models_)
                for (uint32_t e = 0; e < m->n_experts; ++e) note_expert(dp, *m, e);
        }
        if (!bases.empty()) (void)drv->ctx_synchronize();  // reads from those slots may be queued
        for (auto b : bases) (void)drv->mem_free(b);
        std::lock_guard lock(mu_);
        for (auto b : bases) dp.arenas.erase(std::remove(dp.arenas.begin(), dp.arenas.end(), b), dp.arenas.end());
        dp.bytes.store(dp.pool.stats().bytes);
    }
    (void)drv->mem_get_info(&free_bytes, &total_bytes);
    if (dp.bytes < target) {
        const uint64_t reserve = std::max<uint64_t>(1ull << 30, total_bytes / 20);
        uint64_t room = free_bytes > reserve ? free_bytes - reserve : 0;
        for (const auto& [slot, covered] : classes) {
            const auto want = static_cast<uint64_t>(static_cast<double>(target) * static_cast<double>(covered) /
                                                    static_cast<double>(std::max<uint64_t>(expert_bytes, 1)));
            uint64_t have = 0;
            {
                std::lock_guard lock(mu_);
                have = dp.pool.class_bytes(slot);
            }
            uint64_t slots = want > have ? (want - have) / slot : 0;
            const uint64_t per_arena = std::max<uint64_t>(1, kArenaBytes / slot);
            while (slots > 0) {
                const uint64_t n = std::min({slots, per_arena, room / slot});
                CUdeviceptr p = 0;
                if (n == 0 || drv->mem_alloc(&p, n * slot) != CUDA_SUCCESS) break;
                std::lock_guard lock(mu_);
                dp.arenas.push_back(p);
                dp.pool.add_arena(slot, p, static_cast<uint32_t>(n));
                dp.bytes += n * slot;
                room -= n * slot;
                slots -= n;
            }
        }
    }
    CUcontext popped = nullptr;
    (void)drv->ctx_pop_current(&popped);
    if (cfg_.log)
        say("device %d: pool of %.2f GiB for %.2f GiB of experts (%.0f%%), %.2f GiB free before", dp.device,
            static_cast<double>(dp.bytes) / 1073741824.0, static_cast<double>(expert_bytes) / 1073741824.0,
            100.0 * static_cast<double>(dp.bytes) / static_cast<double>(std::max<uint64_t>(expert_bytes, 1)),
            static_cast<double>(free_bytes) / 1073741824.0);
}

void Engine::note_expert(DevicePool& dp, const Model& m, uint32_t expert) {
    if (m.id >= dp.full.size() || expert >= dp.full[m.id].size()) return;
    const uint32_t ls = expert / m.map.n_experts;
    const bool now = dp.pool.pooled_slices(m.id, expert) == m.slices_per_expert[ls];
    auto& f = dp.full[m.id][expert];
    if ((f != 0) == now) return;
    f = now ? 1 : 0;
    if (now) in_vram_.fetch_add(1, std::memory_order_relaxed);
    else in_vram_.fetch_sub(1, std::memory_order_relaxed);
    if (n_placements_ == kPlacementQueue) {
        placements_lost_.fetch_add(1, std::memory_order_relaxed);
        return;
    }
    placements_[n_placements_++] = PlacementEvent{m.id, expert, dp.device, now};
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
}

// One place: the bytes of an expert the pool holds need not stay in RAM. Its pages are paged out of
// this process (the mapping is shared and read-only, so they read back the same if ever touched
// again) and the daemon, told of it, unlocks and drops what is left. The page cache works in
// folios: a large folio that also holds a neighbour some other process maps stays whole.
void Engine::drop_host_copy(const Model& m, uint32_t block, uint32_t expert) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (const auto& r : m.map.ranges(block, expert)) {
        for (const auto& mr : mapped_) {
            if (mr.model != m.id || mr.file != r.file || mr.mapping.perms.size() < 4 || mr.mapping.perms[3] != 's' ||
                mr.mapping.perms[1] == 'w')
                continue;
            const uint64_t lo = std::max(r.offset, mr.mapping.file_offset);
            const uint64_t hi = std::min(r.offset + r.length, mr.mapping.file_offset + (mr.mapping.end - mr.mapping.start));
            if (lo >= hi) continue;
            // Whole pages only: the pages at the ends may hold a neighbour's bytes.
            const uintptr_t a = (mr.mapping.address_of(lo) + page - 1) & ~(page - 1);
            const uintptr_t b = mr.mapping.address_of(hi) & ~(page - 1);
            if (b <= a) continue;
            // MADV_PAGEOUT reclaims the pages only this process maps, splitting a large folio that
            // straddles the expert's edge where it can (Linux >= 5.4); MADV_DONTNEED then unmaps
            // the rest (the daemon maps them too, while it holds them locked), for the daemon to drop.
            (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_PAGEOUT);
            if (madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) == 0)
                dropped_host_bytes_.fetch_add(b - a, std::memory_order_relaxed);
        }
    }
}

// Each pool's counters to the daemon (its metrics), when they moved or the pool's size did.
void Engine::report_pools() {
    if (client_ == nullptr) return;
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        if (dp == nullptr) continue;
        moecache_pool_stats s{dp->hits.load(), dp->misses.load(), dp->hit_bytes.load(), dp->miss_bytes.load(),
                              dp->bytes.load()};
        if (s.hits == dp->reported_hits && s.misses == dp->reported_misses && s.pool_bytes == dp->reported_bytes) continue;
        if (moecache_client_report_pool(client_, static_cast<uint32_t>(d), &s) == 0) {
            dp->reported_hits = s.hits;
            dp->reported_misses = s.misses;
            dp->reported_bytes = s.pool_bytes;
        }
    }
}

void Engine::rezap_pooled() {
    if (!cfg_.one_place || cfg_.pin || client_ == nullptr) return;
    std::vector<std::pair<uint32_t, uint32_t>> pooled;  // (model, model-local expert)
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        int one_place = 0;
        if (dp == nullptr || moecache_client_vram_policy(client_, static_cast<uint32_t>(d), nullptr, &one_place) != 1 ||
            one_place != 1)
            continue;
        std::lock_guard lock(mu_);
        for (uint32_t m = 0; m < dp->full.size(); ++m)
            for (uint32_t e = 0; e < dp->full[m].size(); ++e)
                if (dp->full[m][e]) pooled.emplace_back(m, e);
    }
    for (const auto& [mi, e] : pooled) {
        const Model& m = *models_[mi];
        drop_host_copy(m, m.map.layers[e / m.map.n_experts].index, e % m.map.n_experts);
    }
}

void Engine::drain_placements() {
    std::array<PlacementEvent, 256> batch;
    for (;;) {
        size_t n = 0;
        {
            std::lock_guard lock(mu_);
            n = std::min(n_placements_, batch.size());
            std::copy(placements_.begin(), placements_.begin() + static_cast<std::ptrdiff_t>(n), batch.begin());
            std::copy(placements_.begin() + static_cast<std::ptrdiff_t>(n),
                      placements_.begin() + static_cast<std::ptrdiff_t>(n_placements_), placements_.begin());
            n_placements_ -= n;
        }
        if (n == 0) return;
        for (size_t i = 0; i < n; ++i) {
            const auto& ev = batch[i];
            const Model& m = *models_[ev.model];
            const uint32_t block = m.map.layers[ev.expert / m.map.n_experts].index;
            const uint32_t e = ev.expert % m.map.n_experts;
            // Only with a daemon that asked for one place: it also decides when the expert comes back.
            int one_place = 0;
            if (ev.in_vram && cfg_.one_place && !cfg_.pin && client_ != nullptr &&
                moecache_client_vram_policy(client_, static_cast<uint32_t>(ev.device), nullptr, &one_place) == 1 &&
                one_place == 1)
                drop_host_copy(m, block, e);
            if (client_ != nullptr && m.client_handle.load() != UINT32_MAX)
                (void)moecache_client_report_placement(client_, m.client_handle.load(), block, e,
                                                       ev.in_vram ? ev.device : -1);
        }
    }
}

void Engine::pin_models(int device) {
    const Driver* drv = driver();
    if (drv == nullptr) return;
    CUcontext ctx = nullptr;
    if (drv->primary_ctx_retain(&ctx, device) != CUDA_SUCCESS || drv->ctx_push_current(ctx) != CUDA_SUCCESS) return;
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (const auto& r : mapped_) {
        const Model* m = models_[r.model];
        uint64_t lo = UINT64_MAX, hi = 0;
        for (const auto& l : m->map.layers)
            for (const auto& t : l.tensors)
                if (t.file == r.file) {
                    lo = std::min(lo, t.offset);
                    hi = std::max(hi, t.offset + t.bytes_per_expert * m->map.n_experts);
                }
        const uint64_t map_lo = r.mapping.file_offset, map_hi = r.mapping.file_offset + (r.mapping.end - r.mapping.start);
        lo = std::max(lo, map_lo);
        hi = std::min(hi, map_hi);
        if (lo >= hi) continue;
        uintptr_t a = r.mapping.address_of(lo) & ~(page - 1);
        uintptr_t b = (r.mapping.address_of(hi) + page - 1) & ~(page - 1);
        b = std::min<uintptr_t>(b, r.mapping.end);
        const auto t0 = std::chrono::steady_clock::now();
        const CUresult rc = drv->mem_host_register(reinterpret_cast<void*>(a), b - a,
                                                   CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_PORTABLE);
        if (rc == CUDA_SUCCESS) {
            pinned_.emplace_back(reinterpret_cast<void*>(a), b - a);
            pinned_bytes_.fetch_add(b - a);
            if (cfg_.log)
                say("registered %.2f GiB of %s for DMA in %.1f s", (b - a) / 1073741824.0, m->path.c_str(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        } else {
            say("%s: registering the expert bytes for DMA failed (CUDA error %d); copies stay pageable",
                m->path.c_str(), static_cast<int>(rc));
        }
    }
    CUcontext popped = nullptr;
    (void)drv->ctx_pop_current(&popped);
}

void Engine::poll_directives() {
    if (client_ == nullptr) return;
    moecache_directive d[64];
    const size_t n = moecache_client_poll(client_, d, 64);
    if (n == 0) return;
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < n; ++i) {
        Model* m = nullptr;
        for (auto* x : models_)
            if (x->client_handle.load() == d[i].model) m = x;
        if (m == nullptr || d[i].block >= m->layer_slot.size() || m->layer_slot[d[i].block] < 0 ||
            d[i].expert >= m->map.n_experts)
            continue;
        const uint32_t e = m->expert(m->layer_slot[d[i].block], d[i].expert);
        if (d[i].action == MOECACHE_LOCK || d[i].action == MOECACHE_UNLOCK) continue;  // about RAM
        directives_.fetch_add(1, std::memory_order_relaxed);
        if (d[i].action == MOECACHE_PROMOTE) {
            heat_.set_promoted(m->id, e, true);
        } else if (d[i].action == MOECACHE_UNPROMOTE) {
            heat_.set_promoted(m->id, e, false);
        } else if (d[i].action == MOECACHE_DEMOTE) {
            heat_.set_promoted(m->id, e, false);
            heat_.set(m->id, e, 0);
            for (auto& p : pools_)
                if (auto* dp = p.load()) {
                    dp->pool.drop_expert(m->id, e);
                    note_expert(*dp, *m, e);
                }
        }
    }
}

void Engine::report(Model& m, uint32_t block, uint32_t first, uint32_t n) {
    if (client_ == nullptr) return;
    const uint32_t h = m.client_handle.load(std::memory_order_relaxed);
    if (h == UINT32_MAX) return;
    uint32_t ids[22];
    for (uint32_t done = 0; done < n;) {
        const uint32_t k = std::min<uint32_t>(n - done, 22);
        for (uint32_t i = 0; i < k; ++i) ids[i] = first + done + i;
        std::lock_guard lock(report_mu_);
        if (moecache_client_report(client_, h, block, ids, k, 1) == 1) reported_.fetch_add(1, std::memory_order_relaxed);
        done += k;
    }
}

bool Engine::serve(const HostToDeviceCopy& c, CUresult* result) {
    const Snapshot* snap = snapshot_.load(std::memory_order_acquire);
    if (snap == nullptr) {
        request_scan();
        return false;
    }
    const auto cls = snap->classifier.classify(c.src, c.bytes);
    if (!cls) {
        if (!snap->classifier.covers(c.src)) request_scan();
        return false;
    }
    expert_copies_.fetch_add(1, std::memory_order_relaxed);
    Model& m = *snap->models[cls->model];
    const int32_t ls = cls->block < m.layer_slot.size() ? m.layer_slot[cls->block] : -1;
    if (ls < 0) return false;
    // A copy of every expert of a tensor is a weight upload, not a routing decision.
    const bool routing = cls->n_experts < m.map.n_experts;
    if (routing && cls->tensor == 0) report(m, cls->block, cls->first_expert, cls->n_experts);
    const Driver* drv = driver();
    if (drv == nullptr) return false;
    const CUstream stream = effective_stream(c);
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    if (drv->stream_is_capturing(stream, &capture) != CUDA_SUCCESS || capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        captured_.fetch_add(1, std::memory_order_relaxed);
        return false;
    }
    CUdevice device = 0;
    if (drv->ctx_get_device(&device) != CUDA_SUCCESS || device < 0 || device >= kMaxDevices) return false;
    if (!c.dst_checked) {
        CUmemorytype type{};
        int ordinal = -1;
        CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
        void* values[2] = {&type, &ordinal};
        if (drv->pointer_get_attributes(2, attrs, values, c.dst) != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE ||
            ordinal != device)
            return false;
    }
    DevicePool* dp = pools_[device].load(std::memory_order_acquire);
    if (dp == nullptr) {
        if ((devices_wanted_.fetch_or(uint64_t{1} << device) >> device & 1) == 0) {
            const uint64_t one = 1;
            (void)!write(wake_fd_, &one, sizeof one);
        }
        return false;
    }
    const auto sid = reinterpret_cast<StreamId>(stream);
    const uint32_t nexp = m.map.n_experts;
    const bool pad_next = cls->padding > 0 && cls->padding_in_tensor(m.map);

    std::lock_guard lock(mu_);
    if (routing && cls->tensor == 0)
        for (uint32_t i = 0; i < cls->n_experts; ++i) heat_.touch(m.id, m.expert(ls, cls->first_expert + i));
    CopyPiece pieces[kMaxPieces];
    uint32_t hit_slices = 0;
    const size_t n_pieces = plan_copy(
        cls->n_experts, cls->slice_bytes, cls->padding, pad_next,
        [&](uint32_t i) -> uint64_t {
            const uint32_t e = cls->first_expert + i;
            if (e >= nexp) return 0;
            const uint64_t a = dp->pool.lookup({m.id, m.slice(ls, cls->tensor, e), m.expert(ls, e)}, sid);
            if (a != 0 && i < cls->n_experts) ++hit_slices;
            return a;
        },
        pieces, kMaxPieces);
    if (n_pieces == 0) return false;
    // Admissions: slices that came from the host, copied on into the pool from where they landed.
    struct Admit {
        uint32_t slice;
        uint64_t offset, address;
    };
    Admit admits[256];
    uint32_t n_admits = 0;
    if (routing) {
        for (size_t p = 0; p < n_pieces; ++p) {
            if (pieces[p].pool_address != 0) continue;
            for (uint64_t off = pieces[p].offset; off + cls->slice_bytes <= pieces[p].offset + pieces[p].bytes &&
                                                  off < uint64_t{cls->n_experts} * cls->slice_bytes && n_admits < 256;
                 off += cls->slice_bytes) {
                const uint32_t e = cls->first_expert + static_cast<uint32_t>(off / cls->slice_bytes);
                const SliceRef ref{m.id, m.slice(ls, cls->tensor, e), m.expert(ls, e)};
                SliceRef evicted;
                if (const uint64_t a = dp->pool.admit(ref, cls->slice_bytes, sid, heat_, &evicted); a != 0) {
                    admits[n_admits++] = {ref.slice, off, a};
                    if (evicted.model != kNoSlot && evicted.model < snap->models.size())
                        note_expert(*dp, *snap->models[evicted.model], evicted.expert);
                }
            }
        }
    }
    if (hit_slices == 0 && n_admits == 0) {
        misses_.fetch_add(cls->n_experts, std::memory_order_relaxed);
        bytes_host_.fetch_add(c.bytes, std::memory_order_relaxed);
        dp->misses.fetch_add(cls->n_experts, std::memory_order_relaxed);
        dp->miss_bytes.fetch_add(c.bytes, std::memory_order_relaxed);
        return false;
    }

    const auto* src = static_cast<const uint8_t*>(c.src);
    CUresult rc = CUDA_SUCCESS;
    uint64_t from_pool = 0, from_host = 0;
    for (size_t p = 0; p < n_pieces && rc == CUDA_SUCCESS; ++p) {
        const auto& pc = pieces[p];
        if (pc.pool_address != 0) {
            rc = drv->memcpy_dtod_async(c.dst + pc.offset, pc.pool_address, pc.bytes, stream);
            from_pool += pc.bytes;
        } else {
            rc = drv->memcpy_htod_async(c.dst + pc.offset, src + pc.offset, pc.bytes, stream);
            from_host += pc.bytes;
        }
    }
    for (uint32_t i = 0; i < n_admits && rc == CUDA_SUCCESS; ++i)
        rc = drv->memcpy_dtod_async(admits[i].address, c.dst + admits[i].offset, cls->slice_bytes, stream);
    if (rc != CUDA_SUCCESS) {
        for (uint32_t i = 0; i < n_admits; ++i) dp->pool.drop(m.id, admits[i].slice);
        fallbacks_.fetch_add(1, std::memory_order_relaxed);
        return false;  // the runtime's own copy, issued after ours, writes every byte again
    }
    for (uint32_t i = 0; i < n_admits; ++i)
        note_expert(*dp, m, m.expert(ls, cls->first_expert + static_cast<uint32_t>(admits[i].offset / cls->slice_bytes)));
    served_.fetch_add(1, std::memory_order_relaxed);
    hits_.fetch_add(hit_slices, std::memory_order_relaxed);
    misses_.fetch_add(cls->n_experts - hit_slices, std::memory_order_relaxed);
    bytes_pool_.fetch_add(from_pool, std::memory_order_relaxed);
    bytes_host_.fetch_add(from_host, std::memory_order_relaxed);
    dp->hits.fetch_add(hit_slices, std::memory_order_relaxed);
    dp->misses.fetch_add(cls->n_experts - hit_slices, std::memory_order_relaxed);
    dp->hit_bytes.fetch_add(from_pool, std::memory_order_relaxed);
    dp->miss_bytes.fetch_add(from_host, std::memory_order_relaxed);
    *result = c.async ? CUDA_SUCCESS : drv->stream_synchronize(stream);
    return true;
}

bool Engine::yield_memory(size_t bytes) {
    const Driver* drv = driver();
    CUdevice device = 0;
    if (drv == nullptr || drv->ctx_get_device(&device) != CUDA_SUCCESS || device < 0 || device >= kMaxDevices) return false;
    DevicePool* dp = pools_[device].load();
    if (dp == nullptr) return false;
    std::vector<uint64_t> bases;
    {
        std::lock_guard lock(mu_);
        bases = dp->pool.release(bytes + (64ull << 20), heat_);
        for (const Model* m : snapshot_.load()->models)
            for (uint32_t e = 0; e < m->n_experts; ++e) note_expert(*dp, *m, e);
    }
    if (bases.empty()) return false;
    // Reads from those slots may still be queued.
    (void)drv->ctx_synchronize();
    for (auto b : bases) (void)drv->mem_free(b);
    std::lock_guard lock(mu_);
    for (auto b : bases) dp->arenas.erase(std::remove(dp->arenas.begin(), dp->arenas.end(), b), dp->arenas.end());
    const uint64_t left = dp->pool.stats().bytes;
    yielded_.fetch_add(dp->bytes.load() - left);
    dp->bytes.store(left);
    return true;
}

size_t Engine::pool_bytes_current_device() {
    const Driver* drv = driver();
    CUdevice device = 0;
    if (drv == nullptr || drv->ctx_get_device(&device) != CUDA_SUCCESS || device < 0 || device >= kMaxDevices) return 0;
    DevicePool* dp = pools_[device].load();
    return dp == nullptr ? 0 : dp->bytes.load();
}

void Engine::stats(moecache_cuda_stats* out) {
    *out = {};
    out->copies = copies_.load();
    out->expert_copies = expert_copies_.load();
    out->served = served_.load();
    out->slice_hits = hits_.load();
    out->slice_misses = misses_.load();
    out->bytes_from_pool = bytes_pool_.load();
    out->bytes_from_host = bytes_host_.load();
    out->captured = captured_.load();
    out->fallbacks = fallbacks_.load();
    out->models = n_models_.load();
    out->pinned_bytes = pinned_bytes_.load();
    out->reported = reported_.load();
    out->experts_in_vram = in_vram_.load();
    out->yielded_bytes = yielded_.load();
    out->dropped_host_bytes = dropped_host_bytes_.load();
    out->directives = directives_.load();
    std::lock_guard lock(mu_);
    for (auto& p : pools_)
        if (auto* dp = p.load()) {
            const auto s = dp->pool.stats();
            out->pool_bytes += s.bytes;
            out->admitted += s.admitted;
            out->evicted += s.evicted;
            out->declined += s.declined;
        }
}

int Engine::sync(int timeout_ms) {
    const uint32_t before = scans_.load();
    // The calling thread's device gets its pool now rather than at its next expert copy.
    CUdevice device = 0;
    if (const Driver* drv = driver(); drv != nullptr && drv->ctx_get_device(&device) == CUDA_SUCCESS && device >= 0 &&
                                      device < kMaxDevices)
        devices_wanted_.fetch_or(uint64_t{1} << device);
    scan_requested_.store(true);
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
    std::unique_lock lock(sync_mu_);
    sync_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] {
        return scans_.load() != before && (devices_wanted_.load() & ~devices_done_) == 0;
    });
    return static_cast<int>(n_models_.load());
}

void Engine::shutdown() {
    if (cfg_.log) {
        moecache_cuda_stats s;
        stats(&s);
        say("%" PRIu64 " host-to-device copies, %" PRIu64 " of experts, %" PRIu64 " served by the pool; slices %" PRIu64
            " hit / %" PRIu64 " missed; %.2f GiB from the pool, %.2f GiB from the host; pool %.2f GiB, %" PRIu64
            " admitted, %" PRIu64 " evicted; %" PRIu64 " router events reported",
            s.copies, s.expert_copies, s.served, s.slice_hits, s.slice_misses, s.bytes_from_pool / 1073741824.0,
            s.bytes_from_host / 1073741824.0, s.pool_bytes / 1073741824.0, s.admitted, s.evicted, s.reported);
    }
    stopping_.store(true);
}

}  // namespace moecache::cuda::hook
