// moecached's core: one event loop that owns all state. Every event source is a file descriptor
// in one epoll set (signals, the tick timer, prefetch completions, PSI triggers, the BPF ring
// buffer of page-cache events; the client socket joins later), so nothing else touches the state
// and nothing blocks the loop for long: storage is read by io_uring, mlock runs only on pages
// that are already cached, and one turn reads a bounded number of page-cache events.
#pragma once

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/client/protocol.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/control.h"
#include "moecache/daemon/decide.h"
#include "moecache/daemon/error_log.h"
#include "moecache/daemon/fetch.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/model_residency.h"
#include "moecache/daemon/planner.h"
#include "moecache/daemon/router_trace.h"
#include "moecache/daemon/system_memory.h"
#include "moecache/error.h"
#include "moecache/memory_cgroup.h"
#include "moecache/systemd.h"
#include "moecache/unique_fd.h"

#include <signal.h>
#include <sys/types.h>

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace moecache::daemon {

class Prefetcher;
class OffLoop;
class PressureMonitor;
class ClientHub;
struct Client;
class MetricsServer;
class BusLink;
class PageCacheWatch;
class ModelRegistry;
struct ModelEntry;

class Daemon final : public Control, private RegistryEvents {
public:
    static Result<std::unique_ptr<Daemon>> create(Config config);
    ~Daemon();

    // Runs until SIGINT or SIGTERM (or stop()), then saves heat and unlocks everything.
    Result<void> run();
    // One turn of the loop: waits up to timeout_ms for events and handles them (tests drive this).
    // What the turn's events asked of the placement (setters, pressure, the tick, reads done) is
    // planned once, at the end of the turn.
    Result<void> step(int timeout_ms);
    // Housekeeping and placement, as the tick timer does it.
    void tick();
    // How many times the placement has been planned since the daemon started.
    [[nodiscard]] uint64_t plans() const { return plans_; }
    void stop() { stopping_ = true; }

    // Telemetry: a batch of `tokens` tokens routed block `block` of model `model` to `experts`.
    void record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens);
    // Applies a new configuration (SIGHUP): budgets, policy, models added or removed.
    Result<void> reload(Config config);
    // As a PSI trigger firing would.
    void on_pressure(const std::string& source);
    Result<void> save_profiles();

    // The operator's controls (D-Bus, tests). Arguments are untrusted: each is checked and a
    // refusal says what is wrong (errnum EINVAL: a bad argument; ENOENT: no such model; EBUSY: not
    // now). Changes last until restart or reload. `specs` select experts in the pin syntax ("12",
    // "12:3", "12:0-7", blocks as in the file); an empty list selects every expert.
    Result<uint32_t> add_model(const std::string& path) override;
    Result<void> remove_model(uint32_t id) override;
    // name: "lock" or "reserve".
    Result<void> set_budget(const std::string& name, const std::string& amount) override;
    // "" removes the model's own budget.
    Result<void> set_model_budget(uint32_t id, const std::string& amount) override;
    Result<uint32_t> set_pinned(uint32_t id, std::span<const std::string> specs, bool pinned) override;
    // Reads experts into the page cache (not locked; the policy decides that): returns bytes queued.
    Result<uint64_t> prefetch(uint32_t id, std::span<const std::string> specs) override;
    // Unlocks experts and drops their pages: returns the bytes that were locked or cached.
    Result<uint64_t> evict(uint32_t id, std::span<const std::string> specs) override;
    [[nodiscard]] Result<std::string> export_profile(uint32_t id) const override;
    Result<void> import_profile(uint32_t id, const std::string& text) override;
    // Router decisions, as they arrive, written to `file` (a regular file open for writing) as
    // JSON lines (docs/trace.md) until stop_trace(), which returns how many were written.
    Result<void> start_trace(UniqueFd file) override;
    Result<uint64_t> stop_trace() override;
    [[nodiscard]] bool tracing() const { return trace_.on(); }

    // experts = false leaves ModelStatus::experts empty (the totals are still counted).
    [[nodiscard]] DaemonStatus status(bool experts = true) const override;
    [[nodiscard]] std::optional<ModelStatus> model_status(uint32_t id, bool experts = true) const override;
    [[nodiscard]] std::vector<uint32_t> model_ids() const override;
    [[nodiscard]] const Config& config() const override { return config_; }
    [[nodiscard]] std::optional<uint32_t> model_id(const std::string& path) const;
    [[nodiscard]] bool idle() const;  // nothing fetching, nothing waiting to be locked

private:
    Daemon() = default;
    // RegistryEvents: the registrations waiting for the model are answered; a loaded one's pools
    // and placement are settled again.
    void open_ended(uint32_t id, bool loaded) override;
    void place();
    // Placement is due: planned at the end of the loop turn, or now when called outside one (a
    // test or tool driving the daemon directly).
    void request_place();
    void on_fetched(uint64_t tag, uint64_t bytes, int err);
    // The actuator (actuate.cpp): carries out a turn's decisions, the only writer of residency
    // state for them; `loaded` maps the decision's model indices to entries.
    void apply(const TurnActions& a, const std::vector<ModelEntry*>& loaded);
    // Lock a slot the decide step admitted; a file changed under it closes the model.
    void lock_admitted(ModelEntry& m, uint32_t slot);
    // [policy] predict: scores the last prediction for this layer, learns, and predicts the next
    // token's experts there (recorded for the turn's decisions once the predictor is trusted).
    void predict(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts);
    // The turn's decisions after intake: reads after misses and predictions, one place, placement.
    void decide_and_act();
    void fetch_predicted();
    // One place: settles, for each model a client's pool, registration or departure touched this
    // turn, which experts RAM gives up to VRAM (unlocked and dropped) and which it takes back.
    void settle_one_place();
    void bind_promoted();  // after direct_pools: what the hooks read into VRAM, not RAM
    void tell_vram_policy();  // clients.cpp: VramPolicy again to each client whose one place changed
    void decide_one_place(uint64_t cap, const std::set<uint32_t>& registered);  // decide.cpp
    [[nodiscard]] uint64_t lock_cap() const;
    [[nodiscard]] MemoryFacts memory_facts() const;  // as read at the last placement
    // A model's own cap: its budget and its user's (registered models).
    [[nodiscard]] uint64_t model_cap(const ModelEntry& m) const;
    [[nodiscard]] uint64_t total_locked() const;
    Result<void> handle_signal();
    // Intake (intake.cpp): the page cache's batch of events becomes uses (heat) and misses.
    void consume_page_cache();
    // What clients say (clients/clients.cpp); their connections are the ClientHub's.
    void send_vram_policy(Client& c);
    // Handles one packet; false when the client must be dropped (after a Failure was sent).
    bool on_client_packet(Client& c, struct Packet& p);
    bool register_model(Client& c, uint32_t request, std::vector<UniqueFd>& fds);
    // The rest of a registration, once its model is open (or could not be): the answer.
    struct PendingRegistration {
        uint32_t client = 0, request = 0, model = 0;
        bool existed = false;  // the model's entry was there before this registration
        std::vector<FileIdentity> ids;
    };
    bool finish_registration(Client& c, const PendingRegistration& p);
    void finish_registrations(uint32_t model);
    bool on_placement(Client& c, const protocol::ExpertPlacement& x);
    bool on_pool_stats(Client& c, const protocol::PoolStats& x);
    bool on_unmapped(Client& c, const protocol::Unmapped& x);
    // Whether this client's VRAM pool may take model m's experts out of RAM: an eviction, which
    // D-Bus allows only to root and the admin group; on a model users registered themselves, any
    // of its clients may.
    [[nodiscard]] bool is_admin(const Client& c) const;  // root or the [dbus] admin_group
    [[nodiscard]] bool may_release_ram(const Client& c, const ModelEntry& m) const;
    // Whether this client's routing may steer model m's caps (the recency cut of its locks): root,
    // the admin group, or the uid that registered it (a model its user brought).
    [[nodiscard]] bool steers(const Client& c, const ModelEntry& m) const;
    // Whether m's routing, as reported lately, may cut its lock cap (ModelEntry::routed_by).
    [[nodiscard]] bool recency_trusted(const ModelEntry& m) const;
    void direct_pools();
    void reap_clients();
    void consume_client_telemetry();
    void record_routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens,
                        bool continued = false);
    // A Directive to every client that registered model m, about one of its expert slots.
    void tell_clients(const ModelEntry& m, uint32_t slot, protocol::Action action);
    // The operator's controls (control.cpp).
    Result<std::vector<uint32_t>> select_slots(const ModelEntry& m, std::span<const std::string> specs) const;
    void cache_fetched(uint32_t model, uint32_t slot);
    // Reads a slot into the page cache, not locked (ModelResidency::cache_reads): bytes queued.
    // urgent (a miss): a slot already queued behind other work is queued again ahead of it.
    // Reads a slot into the page cache without locking it; returns the bytes queued.
    uint64_t cache_fetch(ModelEntry& m, uint32_t slot, FetchReason reason, uint32_t order = 0);
    void fetch_missed();
    [[nodiscard]] FetchCandidate fetch_candidate(uint32_t model, uint32_t slot, const std::set<uint32_t>& hooked) const;
    [[nodiscard]] ModelStatus model_status(const ModelEntry& m, bool experts) const;
    [[nodiscard]] bool pools_settled(const ModelEntry& m) const;
    Result<void> arm_tick();  // the tick timer at config_.tick_seconds

    Config config_;
    uint64_t mem_total_ = 0;
    UniqueFd epoll_, signal_fd_, timer_fd_;
    std::unique_ptr<Prefetcher> prefetcher_;
    std::unique_ptr<OffLoop> off_loop_;  // models' headers and setup, off the loop's thread
    std::vector<PendingRegistration> registering_;  // registrations waiting for their model's open
    std::unique_ptr<PressureMonitor> pressure_;
    std::unique_ptr<ClientHub> hub_;  // the client socket's connections
    std::unique_ptr<MetricsServer> metrics_;
    std::unique_ptr<BusLink> bus_;  // the D-Bus API's connection
    RouterTrace trace_;             // moecachectl trace: router decisions to a file
    uint64_t vram_releases_ = 0;  // experts unlocked because a VRAM pool took them
    std::map<uint32_t, PoolDeviceStatus> pool_totals_;  // by device: counters accumulated from PoolStats
    uint64_t unmapped_bytes_ = 0;                        // accumulated from Unmapped
    bool in_step_ = false, place_requested_ = false;
    SystemMemory memory_now_;  // read at the start of each plan
    uint64_t plans_ = 0;
    // Since the last placement: tokens the router reports advanced a model's clock by, and when it
    // was (placement_due, decide.h).
    uint64_t tokens_since_place_ = 0;
    std::chrono::steady_clock::time_point last_place_{};
    ErrorLog errors_;  // failures the loop goes on after
    template <class T>
    void note(const char* doing, const Result<T>& r) {
        if (!r) note_error(doing, r.error().what());
    }
    void note_error(const char* doing, const std::string& what) { errors_.note(doing, what); }
    bool any_rings_ = false, busy_rings_ = false;  // as the last turn found the clients' rings
    size_t ring_turn_ = 0;  // whose ring is read first, rotating (consume_client_telemetry)
    std::vector<uint32_t> joined_;  // consume_client_telemetry's decision of several records
    [[nodiscard]] int loop_timeout() const;
    std::unique_ptr<PageCacheWatch> page_cache_;                    // its events, attributed to models' slots
    std::vector<std::pair<uint32_t, uint32_t>> missed_this_batch_;  // (model, slot) a runtime read from storage
    std::vector<std::pair<uint32_t, uint32_t>> predicted_;  // (model, slot) trusted predictions this turn
    std::set<uint32_t> one_place_due_;  // model ids whose one-place state settle_one_place() recomputes
    std::optional<gid_t> admin_gid_;    // [dbus] admin_group, resolved at start and reload
    uint64_t miss_fetches_ = 0, miss_fetch_bytes_ = 0, warm_fetch_bytes_ = 0, predict_fetch_bytes_ = 0;
    // Slots a lock found evicted from the page cache since their read (lock_admitted): given back
    // to the plan rather than faulted in from storage inside the loop.
    uint64_t evicted_before_lock_ = 0;
    std::chrono::steady_clock::time_point last_slow_turn_log_{};
    std::optional<MemoryCgroupLimit> cgroup_;  // read at start and each tick
    std::unique_ptr<ModelRegistry> models_;    // the models it manages
    uint64_t pressure_cap_ = UINT64_MAX;
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
