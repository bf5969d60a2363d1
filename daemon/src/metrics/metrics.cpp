#include "moecache/daemon/metrics.h"
#include "moecache/build_info.h"
#include "moecache/file_util.h"
#include "moecache/text.h"

#include <fmt/format.h>

#include <array>
#include <map>

namespace moecache::daemon {
namespace {

class Writer {
public:
    void family(std::string_view name, std::string_view type, std::string_view help) {
        out_ += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    }
    void sample(std::string_view name, std::string_view labels, double v) {
        out_ += labels.empty() ? fmt::format("{} {}\n", name, v) : fmt::format("{}{{{}}} {}\n", name, labels, v);
    }
    void sample(std::string_view name, std::string_view labels, uint64_t v) {
        out_ += labels.empty() ? fmt::format("{} {}\n", name, v) : fmt::format("{}{{{}}} {}\n", name, labels, v);
    }
    // A family of one sample without labels.
    void scalar(std::string_view name, std::string_view type, std::string_view help, uint64_t v) {
        family(name, type, help);
        sample(name, "", v);
    }
    std::string take() { return std::move(out_); }

private:
    std::string out_;
};

// The model as users name it, and its file: a series per model that a re-registration (a new id)
// does not split. Without `paths`, the file name and 32 bits of a hash of the path.
std::string model_labels(const ModelStatus& m, bool paths) {
    std::string file = m.path;
    if (!paths) file = fmt::format("{}#{:08x}", base_name(m.path), static_cast<uint32_t>(name_hash(m.path)));
    return fmt::format("model=\"{}\",file=\"{}\"", escape_label_value(m.name.empty() ? base_name(m.path) : m.name),
                       escape_label_value(file));
}

}  // namespace

std::string escape_label_value(std::string_view v) {
    std::string out;
    out.reserve(v.size());
    while (!v.empty()) {
        const size_t n = utf8_length(v);
        if (n == 0) {
            out += "\xef\xbf\xbd";  // U+FFFD
            v.remove_prefix(1);
            continue;
        }
        if (n == 1) {
            switch (v[0]) {
                case '\\': out += "\\\\"; break;
                case '"': out += "\\\""; break;
                case '\n': out += "\\n"; break;
                default: out += v[0];
            }
        } else {
            out.append(v.substr(0, n));
        }
        v.remove_prefix(n);
    }
    return out;
}

std::vector<std::string> health_problems(const DaemonStatus& s) {
    std::vector<std::string> out;
    for (const auto& m : s.models)
        if (!m.loaded && !m.opening && !m.error.empty())
            out.push_back(fmt::format("model {} is not loaded: {}", m.name.empty() ? m.path : m.name, m.error));
    if (s.under_pressure) out.emplace_back("memory pressure: the lock cap is held down until it passes");
    if (s.clients_without_model > 0)
        out.push_back(
            fmt::format("{} runtime(s) copy model-sized buffers from memory that maps no model: moecache "
                        "cannot see their experts (moecachectl status)",
                        s.clients_without_model));
    return out;
}

std::string render_status_text(const DaemonStatus& s) {
    std::string out = fmt::format("moecached {} (commit {})\n", build_version(), build_commit());
    out += fmt::format("  locked       {} of {} allowed now; budget {}, reserve {}, RAM {}\n",
                       human_bytes(s.locked_bytes), human_bytes(s.lock_cap), human_bytes(s.lock_budget),
                       human_bytes(s.reserve), human_bytes(s.mem_total));
    out += fmt::format("  models       {}, clients {}, page cache {}\n", s.models.size(), s.clients.size(),
                       s.page_cache.enabled ? "watched by eBPF" : "not watched: " + s.page_cache.off_reason);
    out += "is it helping?\n";
    if (s.helping.empty()) out += "  nothing to say yet: no model and no runtime\n";
    for (const auto& line : s.helping) out += "  " + line + "\n";
    return out;
}

std::string render_metrics(const DaemonStatus& s, bool paths) {
    const auto labels_of = [paths](const ModelStatus& m) { return model_labels(m, paths); };
    Writer w;
    w.family("moecache_build_info", "gauge", "Always 1: the version of moecached and the commit it was built from.");
    w.sample("moecache_build_info",
             fmt::format("version=\"{}\",commit=\"{}\"", escape_label_value(build_version()),
                         escape_label_value(build_commit())),
             uint64_t{1});
    w.scalar("moecache_memory_bytes", "gauge",
             "RAM of the machine (MemTotal).", s.mem_total);
    w.scalar("moecache_lock_budget_bytes", "gauge",
             "The lock budget as configured (or set over D-Bus): all locked bytes together.", s.lock_budget);
    w.scalar("moecache_reserve_bytes", "gauge",
             "RAM the daemon never locks into.", s.reserve);
    w.scalar("moecache_lock_cap_bytes", "gauge",
             "What the daemon may lock now: the lock budget within RAM (and its memory cgroup limit) less the reserve, and any pressure cap.", s.lock_cap);
    w.family("moecache_locked_bytes", "gauge", "Bytes of model files the daemon holds locked in RAM, per model.");
    for (const auto& m : s.models) w.sample("moecache_locked_bytes", labels_of(m), m.locked_bytes);
    w.family("moecache_recency_share", "gauge",
             "The share of the model's lock cap left to the page cache's LRU: learnt from its routing's temporal locality (0: locks by heat alone).");
    for (const auto& m : s.models) w.sample("moecache_recency_share", labels_of(m), m.recency_share);
    w.scalar("moecache_process_locked_bytes", "gauge",
             "What the kernel counts as locked by the daemon (VmLck).", s.vmlck_bytes);
    w.scalar("moecache_under_pressure", "gauge",
             "1 while the daemon holds back because of memory pressure.", uint64_t{s.under_pressure ? 1u : 0u});
    w.scalar("moecache_pressure_backoffs_total", "counter",
             "Memory pressure events (PSI) the daemon backed off for.", s.pressure_events);
    w.scalar("moecache_prefetched_bytes_total", "counter",
             "Bytes read ahead of use by the daemon's prefetcher.", s.prefetch_done_bytes);
    w.scalar("moecache_prefetch_queued_bytes", "gauge",
             "Bytes waiting in the prefetcher's queue.", s.prefetch_queued_bytes);
    w.family("moecache_prefetch_engine", "gauge",
             "1 for what reads: io_uring, or threads (pread) where io_uring is denied (a container's seccomp profile).");
    w.sample("moecache_prefetch_engine", fmt::format("engine=\"{}\"", s.prefetch_engine), uint64_t{1});
    w.scalar("moecache_cgroup_limit_bytes", "gauge",
             "The memory cgroup limit that binds the daemon (memory.max or memory.limit_in_bytes up its tree); 0: none.", s.cgroup_limit);
    w.scalar("moecache_miss_fetches_total", "counter",
             "Experts read whole into the page cache after a runtime read part of them from storage.", s.miss_fetches);
    w.scalar("moecache_miss_fetch_bytes_total", "counter",
             "Bytes those reads queued.", s.miss_fetch_bytes);
    w.scalar("moecache_predicted_experts_total", "counter",
             "Experts the route predictor expected the next token to use ([policy] predict).", s.predicted_experts);
    w.scalar("moecache_predicted_experts_used_total", "counter",
             "... of which the next token used: their ratio is the prediction's precision.", s.predicted_used);
    w.scalar("moecache_predicted_fetch_bytes_total", "counter",
             "Bytes read into the page cache, not locked, for what the next token was predicted to use.",
             s.predict_fetch_bytes);
    w.scalar("moecache_warm_fetch_bytes_total", "counter",
             "Bytes read beyond the locks at warm starts (a heat profile loaded or imported), not locked.", s.warm_fetch_bytes);

    w.family("moecache_model_loaded", "gauge", "1 when the model is open and managed, 0 when it cannot be (see the log).");
    for (const auto& m : s.models) w.sample("moecache_model_loaded", labels_of(m), uint64_t{m.loaded ? 1u : 0u});
    w.family("moecache_model_settled", "gauge",
             "1 when nothing of the model is being read and its VRAM pools hold what they were directed to (moecachectl wait).");
    for (const auto& m : s.models) w.sample("moecache_model_settled", labels_of(m), uint64_t{m.settled ? 1u : 0u});
    w.family("moecache_experts", "gauge",
             "Routed experts per tier: ssd (storage only), fetching, ram (locked), vram (in a pool), vram+ram (in a pool "
             "and locked in RAM too).");
    for (const auto& m : s.models) {
        std::map<std::string, uint64_t> tiers;
        for (auto p : {Placement::Storage, Placement::Fetching, Placement::Ram, Placement::Vram, Placement::VramAndRam})
            tiers[to_string(p)] = 0;
        for (size_t p = 0; p < m.placements.size(); ++p) tiers[to_string(static_cast<Placement>(p))] += m.placements[p];
        for (const auto& [tier, n] : tiers)
            w.sample("moecache_experts", fmt::format("{},tier=\"{}\"", labels_of(m), tier), n);
    }
    // Is it helping: every tier has a series from the start.
    w.family("moecache_model_tokens_total", "counter",
             "Tokens its runtimes reported routing for, by phase: decode (one token a report) or prompt (batches).");
    for (const auto& m : s.models) {
        w.sample("moecache_model_tokens_total", fmt::format("{},phase=\"decode\"", labels_of(m)),
                 m.outcome.decode_tokens);
        w.sample("moecache_model_tokens_total", fmt::format("{},phase=\"prompt\"", labels_of(m)),
                 m.outcome.prompt_tokens);
    }
    w.family(
        "moecache_model_routed_experts_total", "counter",
        "Experts its runtimes routed in decode, by where each was when the report came: vram (a pool), ram (locked "
        "or cached), ssd (read from storage). Their shares answer whether moecache helps (moecachectl status).");
    for (const auto& m : s.models)
        for (auto r : {Reach::Vram, Reach::Ram, Reach::Storage})
            w.sample("moecache_model_routed_experts_total", fmt::format("{},tier=\"{}\"", labels_of(m), to_string(r)),
                     m.outcome.routed[r]);
    w.family("moecache_expert_bytes", "gauge", "Bytes of routed experts, per model.");
    for (const auto& m : s.models) w.sample("moecache_expert_bytes", labels_of(m), m.expert_bytes);
    w.family("moecache_expert_cached_bytes", "gauge", "Bytes of routed experts in the page cache at the last look.");
    for (const auto& m : s.models) w.sample("moecache_expert_cached_bytes", labels_of(m), m.expert_cached_bytes);

    struct Sum {
        uint64_t read = 0, prefetch = 0, evicted = 0, faults = 0;
    };
    const auto sum = [](const ModelStatus& m) {
        Sum t;
        auto add = [&](const SlotTelemetry& x) {
            t.read += x.read_bytes;
            t.prefetch += x.prefetch_bytes;
            t.evicted += x.evicted_bytes;
            t.faults += x.faults;
        };
        add(m.expert_telemetry);
        add(m.dense_telemetry);
        return t;
    };
    w.family("moecache_storage_read_bytes_total", "counter",
             "Bytes of the model read from storage by other processes (page-cache misses of a runtime), from eBPF.");
    for (const auto& m : s.models) w.sample("moecache_storage_read_bytes_total", labels_of(m), sum(m).read);
    w.family("moecache_evicted_bytes_total", "counter", "Bytes of the model that left the page cache, from eBPF.");
    for (const auto& m : s.models) w.sample("moecache_evicted_bytes_total", labels_of(m), sum(m).evicted);
    w.family("moecache_page_faults_total", "counter", "Page faults of other processes on the model, from eBPF.");
    for (const auto& m : s.models) w.sample("moecache_page_faults_total", labels_of(m), sum(m).faults);
    w.family("moecache_dropped_bytes_total", "counter",
             "Cached bytes of the model the daemon asked the kernel to drop (evictions, one place, releases under pressure).");
    for (const auto& m : s.models) w.sample("moecache_dropped_bytes_total", labels_of(m), m.dropped_bytes);
    // The VRAM pools, per device: (family, type, help, field).
    const struct {
        const char* name;
        const char* type;
        const char* help;
        uint64_t PoolDeviceStatus::*value;
    } kPoolFamilies[] = {
        {"moecache_vram_pool_hits_total", "counter", "Expert slices the CUDA hooks' VRAM pools served, per device.",
         &PoolDeviceStatus::hits},
        {"moecache_vram_pool_misses_total", "counter", "Expert slices copied from the host on a device with a pool.",
         &PoolDeviceStatus::misses},
        {"moecache_vram_pool_hit_bytes_total", "counter", "Bytes copied device-to-device from the VRAM pools, per device.",
         &PoolDeviceStatus::hit_bytes},
        {"moecache_vram_pool_miss_bytes_total", "counter", "Expert bytes copied from the host on a device with a pool.",
         &PoolDeviceStatus::miss_bytes},
        {"moecache_vram_pool_bytes", "gauge", "VRAM the connected CUDA hooks hold as expert pools, per device.",
         &PoolDeviceStatus::pool_bytes},
    };
    for (const auto& f : kPoolFamilies) {
        w.family(f.name, f.type, f.help);
        for (const auto& p : s.vram_pools) w.sample(f.name, fmt::format("device=\"{}\"", p.device), p.*f.value);
    }
    w.scalar("moecache_vram_releases_total", "counter",
             "Experts unlocked and dropped from RAM because a VRAM pool took them.", s.vram_releases);
    w.scalar("moecache_hook_unmapped_copy_bytes_total", "counter",
             "Bytes CUDA hooks saw copied to the GPU in large copies from memory that maps no model: a runtime that "
             "loaded its model without mmap (llama.cpp --load-mode none/dio/mlock, --no-mmap), whose experts moecache cannot see.",
             s.unmapped_copy_bytes);
    w.scalar("moecache_hook_clients_without_model_mapping", "gauge",
             "Connected CUDA hooks whose runtime copies large buffers to the GPU but maps no model.", s.clients_without_model);
    // Every path has a series from the start: a dashboard can alert on the slow ones being above 0.
    w.family("moecache_hook_miss_path_devices", "gauge",
             "Devices of connected CUDA hooks by how pool misses reach them; all but registered and daemon-locks "
             "make decode with every expert on the GPU slower than computing experts on the CPU (moecachectl status says why).");
    for (uint8_t p = 1; p <= protocol::kLastMissPath; ++p) {
        const auto path = static_cast<protocol::MissPath>(p);
        uint64_t n = 0;
        for (const auto& c : s.clients)
            for (const auto& [device, at] : c.miss_paths) n += at == path ? 1 : 0;
        w.sample("moecache_hook_miss_path_devices", fmt::format("path=\"{}\"", protocol::to_string(path)), n);
    }

    // The process_* families every Prometheus client library exports.
    w.family("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.");
    w.sample("process_cpu_seconds_total", "", s.process.cpu_seconds);
    w.scalar("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", s.process.resident_bytes);
    w.scalar("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", s.process.virtual_bytes);
    w.scalar("process_open_fds", "gauge", "Number of open file descriptors.", s.process.open_fds);
    w.scalar("process_max_fds", "gauge", "Maximum number of open file descriptors.", s.process.max_fds);
    w.family("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.");
    w.sample("process_start_time_seconds", "", s.process.start_time_seconds);

    w.family("moecache_daemon_errors_total", "counter",
             "Failures the daemon went on after, by what it was doing (the log has the first of each and then one a minute).");
    for (const auto& [doing, n] : s.errors) w.sample("moecache_daemon_errors_total", fmt::format("doing=\"{}\"", escape_label_value(doing)), n);

    static constexpr std::array<const char*, 4> kKinds = {"added", "deleted", "fault", "mapped"};
    w.family("moecache_page_cache_events_total", "counter", "Page-cache events the kernel sent, per kind.");
    for (size_t k = 0; k < kKinds.size(); ++k)
        w.sample("moecache_page_cache_events_total", fmt::format("kind=\"{}\"", kKinds[k]), s.page_cache.sent[k]);
    w.family("moecache_page_cache_events_dropped_total", "counter", "Page-cache events lost because the ring was full, per kind.");
    for (size_t k = 0; k < kKinds.size(); ++k)
        w.sample("moecache_page_cache_events_dropped_total", fmt::format("kind=\"{}\"", kKinds[k]), s.page_cache.dropped[k]);
    w.scalar("moecache_page_cache_telemetry", "gauge",
             "1 while the eBPF page-cache telemetry runs.", uint64_t{s.page_cache.enabled ? 1u : 0u});

    uint64_t events = 0, bad = 0, overflow = 0;
    for (const auto& c : s.clients) {
        events += c.events;
        bad += c.bad_events;
        overflow += c.overflow;
    }
    w.scalar("moecache_clients", "gauge",
             "Clients connected to the socket.", static_cast<uint64_t>(s.clients.size()));
    w.scalar("moecache_clients_refused_total", "counter",
             "Connections turned away (not allowed, too many, no Hello in time).", s.clients_refused);
    w.scalar("moecache_client_accept_pauses_total", "counter",
             "Times the client socket stopped accepting for want of file descriptors.", s.accept_pauses);
    w.scalar("moecache_models_set_aside_total", "counter",
             "Times a model was set aside because its file did not answer a read within [prefetch] read_deadline.",
             s.models_set_aside);
    w.scalar("moecache_router_events_total", "counter",
             "Router decisions received from the clients now connected.", events);
    w.scalar("moecache_router_events_refused_total", "counter",
             "Router records naming a model, block or expert the client may not.", bad);
    w.scalar("moecache_router_events_dropped_total", "counter",
             "Router records the clients' rings had no room for.", overflow);
    return w.take();
}

}  // namespace moecache::daemon
