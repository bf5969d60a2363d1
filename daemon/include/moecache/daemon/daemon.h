// moecached's core: one event loop that owns all state. Every event source is a file descriptor
// in one epoll set (signals, the tick timer, prefetch completions, PSI triggers, the BPF ring
// buffer of page-cache events; the client socket joins later), so nothing else touches the state
// and nothing blocks the loop for long: storage is read by io_uring, mlock runs only on pages
// that are already cached, and one turn reads a bounded number of page-cache events.
#pragma once

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/client/protocol.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/model_residency.h"
#include "moecache/daemon/planner.h"
#include "moecache/error.h"
#include "moecache/systemd.h"
#include "moecache/unique_fd.h"

#include <signal.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace moecache::daemon {

class Prefetcher;
class PressureMonitor;
class SocketServer;
class MetricsServer;

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
    std::string key;      // heat profile key
    std::string error;    // why it is not loaded, if it is not
    bool loaded = false;
    bool registered = false;  // by a client, not configured
    uint32_t owner_uid = 0;   // of that client
    uint64_t locked_bytes = 0;
    uint64_t expert_bytes = 0, expert_cached_bytes = 0, expert_locked_bytes = 0;
    uint32_t experts_in_vram = 0;  // held by at least one VRAM pool
    Tier dense_tier = Tier::Storage;
    uint64_t dense_bytes = 0;
    SlotTelemetry dense_telemetry;
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
};

struct DaemonStatus {
    uint64_t mem_total = 0;
    uint64_t lock_cap = 0;      // the budget in force now: min(lock budget, RAM - reserve, pressure cap)
    uint64_t locked_bytes = 0;  // what the daemon locked, by its own count
    uint64_t vmlck_bytes = 0;   // what the kernel says (VmLck of this process)
    uint64_t pressure_events = 0;
    bool under_pressure = false;
    uint64_t prefetch_done_bytes = 0, prefetch_queued_bytes = 0;
    PageCacheStatus page_cache;
    std::string socket_path;       // where clients connect ("" when not listening)
    std::string metrics_address;   // where GET /metrics answers, "HOST:PORT" ("" when it does not)
    uint64_t clients_refused = 0;  // connections turned away (not allowed, too many)
    uint64_t vram_releases = 0;    // experts unlocked and dropped because a VRAM pool took them
    std::vector<ClientStatus> clients;
    std::vector<ModelStatus> models;
};

class Daemon {
public:
    static Result<std::unique_ptr<Daemon>> create(Config config);
    ~Daemon();

    // Runs until SIGINT or SIGTERM (or stop()), then saves heat and unlocks everything.
    Result<void> run();
    // One turn of the loop: waits up to timeout_ms for events and handles them (tests drive this).
    Result<void> step(int timeout_ms);
    // Housekeeping and placement, as the tick timer does it.
    void tick();
    void stop() { stopping_ = true; }

    // Telemetry: a batch of `tokens` tokens routed block `block` of model `model` to `experts`.
    void record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens);
    // Applies a new configuration (SIGHUP): budgets, policy, models added or removed.
    Result<void> reload(Config config);
    // As a PSI trigger firing would.
    void on_pressure(const std::string& source);
    Result<void> save_profiles();

    [[nodiscard]] DaemonStatus status() const;
    [[nodiscard]] std::optional<uint32_t> model_id(const std::string& path) const;
    [[nodiscard]] bool idle() const;  // nothing fetching, nothing waiting to be locked

private:
    struct ModelEntry;
    Daemon() = default;
    void add_entry(const ModelConfig& mc, const std::string& path);
    void add_plain_models();
    void refresh_models();
    void open_model(ModelEntry& m);
    void close_model(ModelEntry& m, const std::string& why);
    void place();
    void on_fetched(uint64_t tag, uint64_t bytes, int err);
    void try_lock(ModelEntry& m, uint32_t slot);
    [[nodiscard]] uint64_t lock_cap() const;
    [[nodiscard]] uint64_t model_cap(const ModelEntry& m) const;
    [[nodiscard]] const ByteAmount* uid_budget(const ModelEntry& m) const;
    [[nodiscard]] uint64_t uid_locked(uint32_t uid) const;
    [[nodiscard]] uint64_t total_locked() const;
    [[nodiscard]] std::string profile_path(const std::string& key) const;
    Result<void> handle_signal();
    void watch_files(ModelEntry& m);
    void unwatch_files(ModelEntry& m);
    void on_page_cache_event(const bpf::PageCacheEvent& e);
    void consume_page_cache();
    void consume_page_cache_batch();
    // The client socket (clients/clients.cpp).
    struct Client;
    void accept_clients();
    void on_client_readable(Client& c);
    // Handles one packet; false when the client must be dropped (after a Failure was sent).
    bool on_client_packet(Client& c, struct Packet& p);
    bool register_model(Client& c, uint32_t request, std::vector<UniqueFd>& fds);
    bool on_placement(Client& c, const protocol::ExpertPlacement& x);
    void direct_pools();
    void reply(Client& c, uint32_t request, const protocol::Body& body);
    bool refuse(Client& c, uint32_t request, int errnum, const std::string& text);
    // A request that cannot be met: a Failure, and the client stays connected (true).
    bool cannot(Client& c, uint32_t request, int errnum, const std::string& text);
    void drop_client(Client& c, const std::string& why);
    void reap_clients();
    void consume_client_telemetry();
    void record_routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens);
    // A Directive to every client that registered model m, about one of its expert slots.
    void tell_clients(const ModelEntry& m, uint32_t slot, protocol::Action action);

    Config config_;
    uint64_t mem_total_ = 0;
    UniqueFd epoll_, signal_fd_, timer_fd_;
    std::unique_ptr<Prefetcher> prefetcher_;
    std::unique_ptr<PressureMonitor> pressure_;
    std::unique_ptr<SocketServer> server_;
    std::unique_ptr<MetricsServer> metrics_;
    std::vector<std::unique_ptr<Client>> clients_;
    std::unordered_map<int, Client*> client_by_fd_;
    uint32_t next_client_id_ = 1;
    uint64_t clients_refused_ = 0;
    uint64_t vram_releases_ = 0;  // experts unlocked because a VRAM pool took them
    bool any_rings_ = false, busy_rings_ = false;  // as the last turn found the clients' rings
    [[nodiscard]] int loop_timeout() const;
    std::unique_ptr<bpf::PageCacheTelemetry> page_cache_;
    std::string page_cache_off_reason_;
    struct WatchedFile {
        ModelEntry* model = nullptr;  // erased from watched_ before its model closes
        uint32_t file = 0;
    };
    std::unordered_map<uint32_t, WatchedFile> watched_;  // by the file id the BPF events carry
    uint32_t next_file_id_ = 1;
    uint64_t page_cache_events_ = 0, page_cache_unattributed_ = 0;
    double page_cache_cpu_ = 0;
    std::vector<std::pair<uint32_t, uint32_t>> used_this_batch_;  // (model, slot) seen used by page-cache events
    uint32_t self_tgid_ = 0;
    std::vector<std::unique_ptr<ModelEntry>> models_;
    uint32_t next_model_id_ = 0;
    uint64_t pressure_cap_ = UINT64_MAX;
    uint64_t lockable_this_turn_ = 0;  // MemAvailable - reserve, counted down as a turn locks
    uint64_t pressure_events_ = 0;
    std::chrono::steady_clock::time_point last_pressure_{}, last_save_{};
    bool stopping_ = false;
    systemd::Watchdog watchdog_;  // systemd's (WatchdogSec=), pinged from tick() and, between slow ticks, run()
    sigset_t saved_sigmask_{};
    bool sigmask_saved_ = false;
};

// Total and available RAM (MemTotal, MemAvailable) and this process's VmLck, from /proc.
uint64_t mem_total_bytes();
uint64_t vmlck_bytes();
uint64_t mem_available_bytes();

}  // namespace moecache::daemon
