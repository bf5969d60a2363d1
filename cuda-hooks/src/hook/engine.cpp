#include "engine.h"

#include "capture_gate.h"

#include "driver.h"
#include "log.h"
#include "moecache/client.h"
#include "moecache/process_role.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace moecache::cuda::hook {
namespace {

constexpr auto kRescanInterval = std::chrono::seconds(1);
// A runtime killed rather than ended keeps the hot profile of its last minute.
constexpr auto kProfileInterval = std::chrono::seconds(60);

std::atomic<bool> g_forked{false};
std::atomic<Engine*> g_engine{nullptr};

bool env_off(const char* name) {
    const char* v = getenv(name);
    return v != nullptr && (!strcmp(v, "off") || !strcmp(v, "0") || !strcmp(v, "no") || !strcmp(v, "false"));
}

// What this process was started as (process_role.h), read from its command line before main: a
// probe or ollama's server is left alone (no pool, no claim, no daemon link). Made at first use: a
// library constructor may run before this file's static objects are constructed.
ProcessRole& role() {
    static ProcessRole r;
    return r;
}

bool env_on(const char* name) {
    const char* v = getenv(name);
    return v != nullptr && (!strcmp(v, "on") || !strcmp(v, "1") || !strcmp(v, "yes") || !strcmp(v, "true"));
}

// glibc calls a library's constructors with main's arguments: the place to keep a runtime's mapping
// (MOECACHE_KEEP_MAPPING) before it parses them, and to learn what the process is.
__attribute__((constructor)) void read_command_line(int argc, char** argv, char** /*envp*/) {
    if (argc <= 0 || argv == nullptr) return;
    const std::string kept = keep_mapping(argc, argv, getenv("MOECACHE_KEEP_MAPPING"));
    role() = process_role(std::vector<std::string>(argv, argv + argc), getenv("LLAMA_ARG_LOAD_MODE"),
                          getenv("LLAMA_ARG_MODEL"));
    if (!kept.empty())
        fprintf(
            stderr,
            "moecache-cuda: --load-mode %s became --load-mode mmap (MOECACHE_KEEP_MAPPING): the model stays mapped\n",
            kept.c_str());
}

}  // namespace

void say(const char* fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "moecache-cuda: %s\n", line);
}

Engine* Engine::get() {
    static Engine* engine = [] () -> Engine* {
        if (env_off("MOECACHE_CUDA")) return nullptr;
        switch (role().kind) {
            case ProcessRole::Kind::Probe:
            case ProcessRole::Kind::OllamaServer:
                if (env_on("MOECACHE_CUDA_LOG"))
                    say("left alone: %s", role().why.empty() ? "ollama's server" : role().why.c_str());
                return nullptr;
            case ProcessRole::Kind::OldOllamaRunner:
                say("%s", role().why.c_str());
                break;
            case ProcessRole::Kind::Runtime:
                break;
        }
        if (role().private_copy()) say("%s", private_copy_advice(role()).c_str());
        pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); });
        auto* e = new Engine(hook_config_from([](const char* name) { return getenv(name); },
                                              [](const std::string& line) { say("%s", line.c_str()); }));
        e->start();
        g_engine.store(e);
        return e;
    }();
    return g_forked.load(std::memory_order_relaxed) ? nullptr : engine;
}

Engine* Engine::peek() { return g_forked.load() ? nullptr : g_engine.load(); }

Engine::Engine(HookConfig cfg) : cfg_(cfg) {}

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
    bool more = false;  // work left that does not wait for a wake-up
    while (!stopping_.load()) {
        pollfd p{wake_fd_, POLLIN, 0};
        (void)poll(&p, 1, more ? 0 : 50);
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
            tell_unmapped();
        }
        const uint64_t wanted = devices_wanted_.load() & ~devices_done_;
        for (int d = 0; d < kMaxDevices; ++d) {
            if ((wanted >> d & 1) == 0) continue;
            if (!allocate_pool(d)) continue;  // no model mapped yet: again on the next turn
            devices_done_.fetch_or(uint64_t{1} << d);
            report_pools();  // the daemon counts this pool's placements once it knows the pool
        }
        // A device that copies experts of layers it had not copied before needs a larger pool.
        bool resized = false;
        for (auto& slot : pools_)
            if (DevicePool* dp = slot.load(); dp != nullptr) size_for_every_expert(*dp);
        for (auto& slot : pools_)
            if (DevicePool* dp = slot.load(); dp != nullptr && dp->seen_bytes.load() != dp->sized_for) {
                resize_pool(*dp);
                resized = true;
            }
        if (resized) report_pools();  // a pool that grew from nothing: its placements count from now
        if (cfg_.registers()) decide_ahead();
        more = cfg_.registers() && register_wanted();
        apply_daemon_budgets();
        tell_miss_paths();
        poll_directives();
        drain_placements();
        more = fill_pools() || more;
        flush_unregisters();
        // One place, again now and then: a read of a neighbour maps an expert's pages back in
        // (fault-around) whenever it faults.
        if (std::chrono::steady_clock::now() - last_rezap > std::chrono::seconds(2)) {
            rezap_pooled();
            report_pools();
            last_rezap = std::chrono::steady_clock::now();
        }
        if (std::chrono::steady_clock::now() - profile_saved_ > kProfileInterval) {
            save_profiles(false);
            profile_saved_ = std::chrono::steady_clock::now();
        }
        sync_cv_.notify_all();
    }
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
    out->bytes_staged = bytes_staged_.load();
    out->captured = captured_.load();
    out->fallbacks = fallbacks_.load();
    out->models = n_models_.load();
    out->pinned_bytes = pinned_bytes_.load();
    out->reported = reported_.load();
    out->experts_in_vram = in_vram_.load();
    out->yielded_bytes = yielded_.load();
    out->dropped_host_bytes = dropped_host_bytes_.load();
    out->directives = directives_.load();
    out->stream_joins = joins_.load();
    out->unmapped_copies = unmapped_copies_.load();
    out->unmapped_bytes = unmapped_bytes_.load();
    out->serve_ns = serve_ns_.load();
    out->pieces = pieces_.load();
    out->peer_hits = peer_hits_.load();
    out->bytes_from_peers = bytes_peer_.load();
    out->bytes_read_from_files = host_bytes_read_from_files();
    out->filled_ahead = filled_.load();
    out->copied_ahead = copied_ahead_.load();
    out->ahead_unclaimed = ahead_unclaimed_.load();
    for (auto& p : pools_)
        if (auto* dp = p.load()) {
            std::lock_guard lock(dp->mu);
            const auto s = dp->pool.stats();
            out->pool_bytes += s.bytes;
            out->admitted += s.admitted;
            out->evicted += s.evicted;
            out->declined += s.declined;
            ++out->devices;
            if (dp->staged.load()) ++out->staged_devices;
            if (out->miss_path == 0) out->miss_path = static_cast<uint64_t>(dp->told_path.load());
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
        if (scans_.load() == before || (devices_wanted_.load() & ~devices_done_) != 0) return false;
        for (auto& p : pools_)
            if (const DevicePool* dp = p.load(); dp != nullptr && dp->seen_bytes.load() != dp->sized_for.load()) return false;
        return true;
    });
    return static_cast<int>(n_models_.load());
}

void Engine::shutdown() {
    save_profiles(true);
    if (cfg_.log) {
        moecache_cuda_stats s;
        stats(&s);
        say("%" PRIu64 " host-to-device copies, %" PRIu64 " of experts, %" PRIu64 " served; slices %" PRIu64
            " hit / %" PRIu64 " missed; %.2f GiB from the pool, %.2f GiB from the host (%.2f GiB staged, %.2f GiB of it read from the files); pool %.2f GiB"
            " on %" PRIu64 " device(s), %" PRIu64 " admitted, %" PRIu64 " evicted; %" PRIu64 " stream joins; %" PRIu64
            " router events reported; %" PRIu64 " slices (%.2f GiB) from another device's pool; %.1f ms in the hook for expert copies (%.1f us each), %" PRIu64 " copies queued for them (%" PRIu64 " by the copy kernel)",
            s.copies, s.expert_copies, s.served, s.slice_hits, s.slice_misses, s.bytes_from_pool / 1073741824.0,
            s.bytes_from_host / 1073741824.0, s.bytes_staged / 1073741824.0, s.bytes_read_from_files / 1073741824.0, s.pool_bytes / 1073741824.0, s.devices,
            s.admitted, s.evicted, s.stream_joins, s.reported, s.peer_hits, s.bytes_from_peers / 1073741824.0,
            static_cast<double>(s.serve_ns) / 1e6,
            static_cast<double>(s.serve_ns) / 1e3 / static_cast<double>(std::max<uint64_t>(s.expert_copies, 1)), s.pieces,
            kernel_copies_.load());
        const auto ms = [&](Phase p) { return static_cast<double>(phase_ns_[p].load()) / 1e6; };
        say("of the hook's time for expert copies: %.1f ms finding what each copy is (the driver's answers on its "
            "stream and device among it), %.1f ms this device's and its peers' pools (lookups, copies queued), %.1f ms "
            "the host's pieces, %.1f ms admissions; of these, %.1f ms launching device-to-device copies",
            ms(kPrepare), ms(kPool), ms(kHost), ms(kAdmit), ms(kLaunch));
        if (cfg_.ahead) {
            uint64_t mirrored = 0;
            bool off = false;  // for some model
            if (const Snapshot* snap = snapshot_.load(std::memory_order_acquire))
                for (const Model* m : snap->models) {
                    mirrored += m->mirrored_runs.load(std::memory_order_relaxed);
                    off = off || m->ahead_off.load(std::memory_order_relaxed);
                }
            say("copies ahead: %" PRIu64 " slices queued at the first copy of their tensor's run, %" PRIu64
                " of them not asked for; %" PRIu64 " runs laid out as the host tensor%s",
                s.copied_ahead, s.ahead_unclaimed, mirrored,
                off ? " (off: a run laid out otherwise, or a slice not asked for)" : "");
        }
    }
    if (cfg_.log)
        for (auto& p : pools_)
            if (DevicePool* dp = p.load()) {
                uint32_t tensors = 0;
                VramPoolStats ps;
                std::string which;  // the first model's layer slots of which this device copies a tensor
                {
                    std::lock_guard lock(dp->mu);
                    for (const auto& m : dp->seen)
                        for (uint8_t s : m) tensors += s;
                    if (!dp->seen.empty() && !models_.empty())
                        for (size_t l = 0; l < models_[0]->map.layers.size(); ++l) {
                            std::string t;
                            for (uint32_t k = 0; k < models_[0]->slices_per_expert[l]; ++k) {
                                const uint32_t id = models_[0]->slice(static_cast<int32_t>(l), k, 0) / models_[0]->map.n_experts;
                                if (id < dp->seen[0].size() && dp->seen[0][id]) t += static_cast<char>('a' + k);
                            }
                            if (!t.empty()) which += (which.empty() ? "" : " ") + std::to_string(l) + t;
                        }
                    ps = dp->pool.stats();
                }
                std::string why;
                for (size_t k = 0; k < dp->counters.join_failures.size(); ++k)
                    if (const uint64_t n = dp->counters.join_failures[k].load())
                        why += " " + std::to_string(k) + ":" + std::to_string(n);
                if (!why.empty()) say("device %d: streams not ordered (reason:count)%s", dp->device, why.c_str());
                const uint64_t h = dp->counters.hits.load(), m = dp->counters.misses.load();
                const uint64_t dh = dp->counters.decode_hits.load(), dm = dp->counters.decode_misses.load();
                auto pct = [](uint64_t a, uint64_t b) { return 100.0 * static_cast<double>(a) / static_cast<double>(std::max<uint64_t>(a + b, 1)); };
                say("device %d: copies %u expert tensors (layer and tensor: %s); slices %" PRIu64 " hit / %" PRIu64
                    " missed (%.1f%%),"
                    " in decode steps %" PRIu64 " / %" PRIu64 " (%.1f%%, %" PRIu64
                    " admitted); pool %.2f GiB;"
                    " slots taken over from another stream %" PRIu64 ", not %" PRIu64 "; peer lookups %" PRIu64
                    "; slices filled ahead %" PRIu64,
                    dp->device, tensors, which.c_str(), h, m, pct(h, m), dh, dm, pct(dh, dm),
                    dp->counters.decode_admits.load(), static_cast<double>(dp->bytes.load()) / 1073741824.0, ps.joined,
                    ps.cross_stream, dp->counters.peer_lookups.load(), dp->counters.filled.load());
            }
    if (cfg_.log && (readback_reports_.load() || readbacks_refused_.load()))
        say("routing from the runtime's read-back ids: %" PRIu64 " layer batches, %" PRIu64 " read-backs that did not match the copy",
            readback_reports_.load(), readbacks_refused_.load());
    if (cfg_.log && (capture_gate().waits() || capture_gate().stale()))
        say("graph captures that waited for the hook: %" PRIu64 ", open captures the hook stopped waiting for: %" PRIu64,
            capture_gate().waits(), capture_gate().stale());
    stopping_.store(true);
}

}  // namespace moecache::cuda::hook
