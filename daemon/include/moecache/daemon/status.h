// The daemon's status as plain values: what D-Bus, moecachectl and /metrics read (built by
// src/status/status_view.cpp, rendered by metrics.cpp and dbus_service.cpp).
#pragma once

#include "moecache/client/protocol.h"
#include "moecache/daemon/model_residency.h"
#include "moecache/daemon/system_memory.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moecache::daemon {

struct ExpertStatus {
    uint32_t block = 0, expert = 0;
    Tier tier = Tier::Storage;
    double heat = 0;
    uint32_t uses = 0;
    bool pinned = false;
    uint64_t bytes = 0, cached_bytes = 0, locked_bytes = 0;
    SlotTelemetry telemetry;
    uint32_t vram_holders = 0;  // CUDA hooks whose VRAM pool holds all of it
};

struct ModelStatus {
    uint32_t id = 0;
    std::string path;     // as configured or resolved from a glob
    std::string name;     // ollama's tag, the file name or general.name (ModelEntry::name)
    std::string key;      // heat profile key
    std::string family;   // the models it shares heat (and a family budget) with have the same
    std::string error;    // why it is not loaded, if it is not
    bool loaded = false;
    bool opening = false;     // its header is being read, off the daemon's loop
    bool registered = false;  // by a client, not configured
    uint32_t owner_uid = 0;   // of that client
    uint64_t locked_bytes = 0;
    double recency_share = 0;  // of its lock cap left to the page cache's LRU (heat.h), learnt
    // Whether that share cuts its lock cap now: not while one user alone reports its routing and
    // may not steer it (an operator's model, another user's: recency_trusted, clients/access.h).
    bool recency_applied = true;
    uint64_t expert_bytes = 0, expert_cached_bytes = 0, expert_locked_bytes = 0;
    uint32_t experts_in_vram = 0;  // held by at least one VRAM pool
    uint32_t n_experts_total = 0, experts_locked = 0, experts_pinned = 0;
    uint64_t budget_bytes = 0;     // its own lock budget (0: none, the global one only)
    uint64_t read_bytes = 0, evicted_bytes = 0;  // of its experts, by page-cache telemetry
    uint64_t dropped_bytes = 0;    // the daemon asked the kernel to drop (evict, one place, releases)
    uint32_t prefetching_experts = 0;   // an operator's prefetch still reading them
    uint64_t prefetch_pending_bytes = 0;
    uint32_t experts_fetching = 0;      // being read for a lock
    // Its placement is done for now: nothing of it is being read (for a lock, a warm start, a
    // prefetch, a miss) and every VRAM pool that serves it holds nine in ten of what the daemon
    // directed it to keep. What `moecachectl wait` waits for (a runtime's readiness: a warm start,
    // the prompt-model swap).
    bool settled = false;
    // Is it helping: what its runtime routed, by where the experts were (Intake); whether a runtime
    // reports its routing at all (the CUDA hook, the ggml backend, a client of the library).
    RoutingOutcome outcome;
    bool routing_reported = false;
    // A warm start under way: what it had to read, and how much of it is read (0, 0: none).
    uint64_t warm_total_bytes = 0, warm_done_bytes = 0;
    Tier dense_tier = Tier::Storage;
    uint64_t dense_bytes = 0;
    SlotTelemetry dense_telemetry;
    // Counted over every expert whether or not `experts` is filled in (metrics need no more).
    std::array<uint32_t, 5> placements{};  // experts per Placement, indexed by its value
    SlotTelemetry expert_telemetry;        // summed over its experts
    std::vector<ExpertStatus> experts;  // MoE layer-major
};

// eBPF page-cache telemetry (bpf/): whether it runs, and what it has delivered.
struct PageCacheStatus {
    bool enabled = false;
    bool faults = false;           // page faults reported too (Linux >= 6.11)
    std::string off_reason;        // why not, when it is not enabled (or faults are not reported)
    uint64_t events = 0;           // consumed by the daemon
    uint64_t unattributed = 0;     // of files no longer watched (closed models)
    double consume_cpu_seconds = 0;  // the daemon's CPU time reading and attributing them
    uint64_t sent[4] = {}, dropped[4] = {};  // by the kernel, per kind: added, deleted, fault, mapped
    uint32_t ring_bytes = 0;
};

struct ClientStatus {
    uint32_t id = 0;
    uint32_t pid = 0, uid = 0, gid = 0;
    std::string name;
    std::vector<uint32_t> models;  // ids of the models it registered
    bool telemetry = false;        // a ring is attached
    uint64_t events = 0;           // routing records consumed from its ring
    uint64_t bad_events = 0;       // records naming a model, block or expert it may not
    uint64_t overflow = 0;         // records its ring had no room for (the client's count)
    // How its VRAM pools' misses reach their devices, as it says (PoolStats): (device, path).
    std::vector<std::pair<uint32_t, protocol::MissPath>> miss_paths;
    // Why moecache cannot help it, from its command line: a model read into private memory
    // (--load-mode none or dio: ollama's choice), ollama's old runner; "" when nothing is wrong.
    std::string command_line_problem;
};

// The VRAM pools of the CUDA hooks on one device, as they report it (PoolStats): counters since the
// daemon started (clients that left included), the size of the pools connected now.
struct PoolDeviceStatus {
    uint32_t device = 0;
    uint64_t hits = 0, misses = 0, hit_bytes = 0, miss_bytes = 0;
    uint64_t pool_bytes = 0;
    uint32_t clients = 0;
};

struct DaemonStatus {
    uint64_t mem_total = 0;
    uint64_t lock_cap = 0;      // the budget in force now: min(lock budget, RAM - reserve, pressure cap)
    uint64_t lock_budget = 0, reserve = 0;  // as configured (or set since), resolved against RAM
    uint64_t cgroup_limit = 0;  // the memory cgroup limit that binds the daemon (0: none), read each tick
    uint64_t miss_fetches = 0, miss_fetch_bytes = 0;  // experts read whole after a runtime's miss
    uint64_t warm_fetch_bytes = 0;  // read beyond the locks at warm starts
    uint64_t predicted_experts = 0, predicted_used = 0;  // next-token predictions scored, and right
    uint64_t predict_fetch_bytes = 0;  // read into the page cache for them
    uint64_t locked_bytes = 0;  // what the daemon locked, by its own count
    uint64_t vmlck_bytes = 0;   // what the kernel says (VmLck of this process)
    uint64_t pressure_events = 0;
    bool under_pressure = false;
    uint64_t prefetch_done_bytes = 0, prefetch_queued_bytes = 0;
    std::string prefetch_engine;  // "io_uring", or "threads" (pread) where io_uring is denied
    PageCacheStatus page_cache;
    std::string socket_path;       // where clients connect ("" when not listening)
    std::string metrics_address;   // where GET /metrics answers, "HOST:PORT" ("" when it does not)
    uint64_t clients_refused = 0;  // connections turned away (not allowed, too many, no Hello in time)
    uint64_t accept_pauses = 0;    // times the client socket stopped accepting for want of descriptors
    uint64_t models_set_aside = 0;  // times a model's file did not answer a read in time (set aside)
    uint64_t vram_releases = 0;    // experts unlocked and dropped because a VRAM pool took them
    std::vector<PoolDeviceStatus> vram_pools;  // by device
    // Large host-to-device copies CUDA hooks saw from memory that maps no model (a runtime that
    // loaded its model without mmap), since the daemon started; clients connected now that map none.
    uint64_t unmapped_copy_bytes = 0;
    uint32_t clients_without_model = 0;
    std::string bus;               // the D-Bus name's bus ("" when not on one)
    bool tracing = false;
    uint64_t trace_records = 0;
    // Failures the loop went on after, by what it was doing (moecache_daemon_errors_total).
    std::map<std::string, uint64_t> errors;
    std::vector<ClientStatus> clients;
    std::vector<ModelStatus> models;
    // Is it helping: a line per model and per reason (helping.h), made with the rest.
    std::vector<std::string> helping;
    ProcessFigures process;  // the daemon's own process (the process_* metrics)
};

}  // namespace moecache::daemon
