// The daemon's decide step and its actuator, for every decision of a loop turn: the facts intake
// recorded (misses, trusted predictions, pools whose holdings changed, a placement asked for) are
// gathered once, after every source was read; the pure rules (decide.h, planner.h, budgets.h)
// decide; the actuator (apply) is the only writer of residency for what they decided, and the
// directives for the clients queue in their outboxes, flushed once at the turn's end. Also here:
// the caps (budgets, the memory cgroup, pressure) and the clients' one-place and pool direction,
// which the placement decides with the locks. Runs on the loop's thread.
#pragma once

#include "moecache/client/protocol.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/decide.h"
#include "moecache/daemon/error_log.h"
#include "moecache/daemon/fetch.h"
#include "moecache/daemon/system_memory.h"
#include "moecache/memory_cgroup.h"

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace moecache::daemon {

class ClientHub;
class ModelRegistry;
class Prefetcher;
struct Client;
struct ModelEntry;

class DecideStep {
public:
    // admin_gid: the daemon's, as resolved from [dbus] admin_group (start and reload).
    DecideStep(const Config& config, uint64_t mem_total, const std::optional<gid_t>& admin_gid, ModelRegistry& models,
               ClientHub& hub, Prefetcher& prefetcher, ErrorLog& errors);

    // --- Facts of the turn (intake) ---
    // Placement is due: planned at the end of the loop turn, or now outside one (a test or tool
    // driving the daemon directly).
    void request();
    // The loop is in a turn (Daemon::step): requests wait for decide_and_act().
    void set_in_turn(bool in) { in_turn_ = in; }
    // Experts a runtime read from storage, (model, slot) as often as it did.
    void missed(std::span<const std::pair<uint32_t, uint32_t>> slots);
    // What a trusted prediction expects the next token to use.
    void predicted(uint32_t model, uint32_t slot) { predicted_.emplace_back(model, slot); }
    // A model whose clients' pools, registrations or residency changed: its one place is settled again.
    void one_place_due(uint32_t model) { one_place_due_.insert(model); }
    template <class It>
    void one_place_due(It first, It last) {
        one_place_due_.insert(first, last);
    }
    // A routing report advanced a model's clock by `tokens` (its first MoE layer's): placement is
    // due after enough tokens, at most every so often (placement_due, decide.h).
    void routed(uint32_t tokens, std::chrono::steady_clock::time_point now);
    // A read the prefetcher finished (its tag: fetch_tag).
    void on_fetched(uint64_t tag, uint64_t bytes, int err);
    // A PSI trigger fired: the cap comes down to what pressure_keep leaves; returns the new cap
    // (the caller asks for the placement that carries it out).
    uint64_t on_pressure();
    // The tick: the memory cgroup and the page cache's residency read again, what one place
    // released dropped again (fault-around maps it back), and the pressure cap lifted after
    // `quiet` seconds without pressure (true when it was).
    bool tick(double quiet);
    // A warm start's progress, logged at each quarter of what it had to read (ModelEntry::warm_start).
    void warm_progress();
    // Facts that wait for the turn's decisions.
    [[nodiscard]] bool facts_pending() const {
        return !missed_.empty() || !predicted_.empty() || !one_place_due_.empty();
    }

    // --- The turn ---
    // Reads after misses and predictions, one place for what pools took, the placement when asked.
    void decide_and_act();
    // The placement now: facts read once (no decision reads /proc), decide_turn(), apply().
    void place();
    [[nodiscard]] uint64_t plans() const { return plans_; }

    // --- Reads into the page cache (an operator's prefetch, a miss, a warm start, a prediction) ---
    // Queued, not locked: the bytes queued. A miss queued behind other work is queued again first.
    uint64_t cache_fetch(ModelEntry& m, uint32_t slot, FetchReason reason, uint32_t order = 0);

    // --- One place and the pools ---
    // One place where RAM cannot keep the experts of the models in use locked anyway (each model
    // against its own budget too): decided at each placement and when a client registers a model.
    void decide_one_place(uint64_t cap, const std::set<uint32_t>& registered);
    // VramPolicy again to each client whose one place changed; to one client as it was last told.
    void tell_vram_policy();
    void send_vram_policy(Client& c);
    // A Directive to every client that registered model m, about one of its expert slots.
    void tell_clients(const ModelEntry& m, uint32_t slot, protocol::Action action);

    // --- Caps and memory ---
    [[nodiscard]] uint64_t lock_cap() const;
    [[nodiscard]] MemoryFacts memory_facts() const;  // as read at the last placement
    // A model's own cap: its budget and its user's (registered models).
    [[nodiscard]] uint64_t model_cap(const ModelEntry& m) const;
    [[nodiscard]] uint64_t total_locked() const;
    void read_memory();  // MemAvailable now, for the next cap
    [[nodiscard]] const std::optional<MemoryCgroupLimit>& cgroup() const { return cgroup_; }
    [[nodiscard]] bool under_pressure() const { return pressure_cap_ != UINT64_MAX; }

    struct Counters {
        uint64_t miss_fetches = 0, miss_fetch_bytes = 0, warm_fetch_bytes = 0, predict_fetch_bytes = 0;
        uint64_t vram_releases = 0;  // experts unlocked because a VRAM pool took them
        // Slots a lock found evicted from the page cache since their read: given back to the plan
        // rather than faulted in from storage inside the loop.
        uint64_t evicted_before_lock = 0;
        uint64_t pressure_events = 0;
    };
    [[nodiscard]] const Counters& counters() const { return counters_; }

private:
    void fetch_missed();
    void fetch_predicted();
    // One place: settles, for each model a client's pool, registration or departure touched this
    // turn, which experts RAM gives up to VRAM (unlocked and dropped) and which it takes back.
    void settle_one_place();
    void direct_pools();
    void bind_promoted();  // after direct_pools: what the hooks read into VRAM, not RAM
    [[nodiscard]] FetchCandidate fetch_candidate(uint32_t model, uint32_t slot, const std::set<uint32_t>& hooked) const;
    void cache_fetched(uint32_t model, uint32_t slot);
    // The actuator (actuate.cpp): carries out a turn's decisions, the only writer of residency
    // state for them; `loaded` maps the decision's model indices to entries.
    void apply(const TurnActions& a, const std::vector<ModelEntry*>& loaded);
    // Lock a slot the decide step admitted; a file changed under it closes the model.
    void lock_admitted(ModelEntry& m, uint32_t slot);
    template <class T>
    void note(Doing doing, const Result<T>& r) {
        if (!r) errors_.note(doing, r.error().what());
    }

    const Config& config_;
    const uint64_t mem_total_;
    const std::optional<gid_t>& admin_gid_;
    ModelRegistry& models_;
    ClientHub& hub_;
    Prefetcher& prefetcher_;
    ErrorLog& errors_;

    bool in_turn_ = false, requested_ = false;
    uint64_t plans_ = 0;
    // Since the last placement: tokens the router reports advanced a model's clock by, and when it was.
    uint64_t tokens_since_place_ = 0;
    std::chrono::steady_clock::time_point last_place_{};
    SystemMemory memory_now_;                  // read at the start of each plan
    std::optional<MemoryCgroupLimit> cgroup_;  // read at start, each tick and on pressure
    uint64_t pressure_cap_ = UINT64_MAX;
    std::chrono::steady_clock::time_point last_pressure_{};
    std::vector<std::pair<uint32_t, uint32_t>> missed_;     // (model, slot) a runtime read from storage
    std::vector<std::pair<uint32_t, uint32_t>> predicted_;  // (model, slot) trusted predictions this turn
    std::set<uint32_t> one_place_due_;                      // model ids whose one place is settled again
    Counters counters_;
    std::chrono::steady_clock::time_point last_slow_turn_log_{};
};

}  // namespace moecache::daemon
