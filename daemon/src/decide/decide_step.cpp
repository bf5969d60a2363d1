// The decide step of the loop (placement.h): once per loop turn (request() marks the turn; the
// loop calls decide_and_act() once) the facts are gathered and decide_turn() (decide.h, pure:
// src/policy/decide_turn.cpp) says what to lock, release and read under the budgets; here too the
// reads after misses and predictions, one place for what the pools hold, and the pools' direction.
#include "moecache/daemon/decide_step.h"

#include "clients/access.h"
#include "clients/client_hub.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/first_fill.h"
#include "moecache/log.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

namespace moecache::daemon {

using protocol::Action;
using protocol::Directive;
using protocol::kAllDevices;
using protocol::kNoPoolLimit;
using protocol::VramPolicy;

DecideStep::DecideStep(const Config& config, uint64_t mem_total, const std::optional<gid_t>& admin_gid,
                       ModelRegistry& models, ClientHub& hub, Prefetcher& prefetcher, ErrorLog& errors)
    : config_(config),
      mem_total_(mem_total),
      admin_gid_(admin_gid),
      models_(models),
      hub_(hub),
      prefetcher_(prefetcher),
      errors_(errors),
      cgroup_(own_memory_cgroup_limit()) {
    if (const auto m = read_system_memory()) memory_now_ = *m;
}

void DecideStep::missed(std::span<const std::pair<uint32_t, uint32_t>> slots) {
    missed_.insert(missed_.end(), slots.begin(), slots.end());
}

void DecideStep::routed(uint32_t tokens, std::chrono::steady_clock::time_point now) {
    tokens_since_place_ += tokens;
    if (placement_due(tokens_since_place_, now - last_place_)) request();
}

uint64_t DecideStep::on_pressure() {
    ++counters_.pressure_events;
    last_pressure_ = std::chrono::steady_clock::now();
    cgroup_ = own_memory_cgroup_limit();  // what a co-tenant in its cgroup needs now sizes the cap
    pressure_cap_ = std::min(pressure_cap_, pressure_keep(total_locked(), config_.pressure_release_share));
    return pressure_cap_;
}

bool DecideStep::tick(double quiet) {
    warm_progress();
    cgroup_ = own_memory_cgroup_limit();
    for (auto& m : models_.all())
        if (m->res) {
            note(Doing::ReadingResidency, m->res->refresh_cached());
            // One place, again each tick: a runtime's read of a neighbour can map an expert's pages
            // back (fault-around) before they were dropped.
            for (uint32_t s = 0; s < m->res->n_slots(); ++s)
                if (!m->res->wanted_in_ram(s) && m->res->state(s).cached_bytes() > 0 &&
                    m->res->state(s).tier() == Tier::Storage)
                    m->res->drop_cached(s);
        }
    if (pressure_cap_ == UINT64_MAX ||
        std::chrono::steady_clock::now() - last_pressure_ <= std::chrono::duration<double>(quiet))
        return false;
    pressure_cap_ = UINT64_MAX;
    return true;
}

void DecideStep::warm_progress() {
    for (auto& m : models_.all()) {
        auto& w = m->warm_start;
        if (!m->res || w.total == 0) continue;
        const uint64_t pending = m->res->reads_pending_bytes();
        const uint64_t done = w.total > pending ? w.total - pending : 0;
        const int quarter = pending == 0 ? 4 : static_cast<int>(4 * done / w.total);
        if (quarter <= w.said) continue;
        w.said = quarter;
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - w.since).count();
        MC_LOG(LOG_INFO, "model {}: warm start {} % ({} of {} MiB read, {:.1f} s){}", m->path, quarter * 25, done >> 20,
               w.total >> 20, secs, quarter == 4 ? ": done" : "");
        if (quarter == 4) w.total = 0;
    }
}

void DecideStep::read_memory() {
    if (const auto m = read_system_memory()) memory_now_ = *m;
}

uint64_t DecideStep::lock_cap() const {
    return daemon::lock_cap(memory_facts(), config_.lock_budget.resolve(mem_total_),
                            config_.reserve.resolve(mem_total_), pressure_cap_);
}

MemoryFacts DecideStep::memory_facts() const {
    MemoryFacts m{mem_total_, memory_now_.available, std::nullopt, std::nullopt};
    if (cgroup_) {
        m.cgroup_limit = cgroup_->limit;
        m.cgroup_usage = cgroup_->usage;
        m.cgroup_reclaimable = cgroup_->reclaimable;
        m.cgroup_unevictable = cgroup_->unevictable;
        m.locked = total_locked();
    }
    return m;
}

// A loop turn's placement: the facts, read once (no decision reads /proc), decide_turn(), and
// the actuator carries out what it decided.
void DecideStep::place() {
    requested_ = false;
    ++plans_;
    tokens_since_place_ = 0;
    last_place_ = std::chrono::steady_clock::now();
    // What the pools are directed to hold first: the experts bound for VRAM are then not read for
    // RAM by this very turn's plan (bind_promoted).
    direct_pools();
    if (const auto m = read_system_memory()) memory_now_ = *m;
    TurnFacts f;
    f.memory = memory_facts();
    f.lock_cap = lock_cap();
    f.reserve = config_.reserve.resolve(mem_total_);
    f.warm_limit = config_.warm_limit ? config_.warm_limit->resolve(mem_total_) : kNoCap;
    f.planner = PlannerSettings{config_.admit_after_uses, config_.elite_share, config_.hysteresis};
    std::vector<ModelEntry*> loaded;
    std::map<std::string, uint32_t> families;
    const auto now = std::chrono::steady_clock::now();
    std::set<uint32_t> registered;  // models a live client registered
    std::set<uint32_t> pooled;      // ... and of those, models a CUDA hook's VRAM pool serves
    for (const auto& c : hub_.all())
        if (!c->dead) {
            registered.insert(c->models.begin(), c->models.end());
            if (c->has_pool) pooled.insert(c->models.begin(), c->models.end());
        }
    decide_one_place(f.lock_cap, registered);
    // Which open models rest (models_at_rest: the prompt-model swap, standby).
    std::vector<ModelUse> uses;
    for (const auto& m : models_.all())
        if (m->res)
            uses.push_back(
                {models_.family_of(*m), registered.count(m->id) != 0, m->config.keep, m->runtime_left, m->last_used});
    const std::vector<ModelRest> rest = models_at_rest(uses, now);
    size_t open = 0;
    for (auto& m : models_.all()) {
        if (!m->res) continue;
        const ModelResidency& r = *m->res;
        ModelFacts mf;
        const std::string& family = uses[open].family;  // family_of, as taken above
        // A model that left holds nothing: its locks and reads would take the RAM the model in use
        // needs, under a squeeze all of it.
        const ModelRest at_rest = rest[open++];
        uint64_t cap = at_rest.left ? 0 : model_cap(*m);
        // RAM alone (no VRAM pool serves the model): the share of the lock cap that the routing's
        // temporal locality makes worth more to the page cache's LRU than to locks by heat, learnt
        // by the heat table from the tier's room in experts a layer (heat.h, set_split_capacity).
        const auto& map = r.model().map();
        if (pooled.count(m->id) == 0 && r.n_slots() > 0 && map.expert_bytes_total > 0) {
            // The room in experts a layer: the cap over the mean expert (the map's totals, not a
            // sum over the slots each turn).
            m->res->heat().set_split_capacity(ram_split_room(f.lock_cap, map.expert_bytes_total, r.n_slots(),
                                                             static_cast<uint32_t>(map.layers.size())));
            // Only from routing that may steer it (recency_trusted): the learner itself goes on.
            cap = recency_cut_cap(cap, f.lock_cap, recency_trusted(*m) ? m->res->heat().recency_share() : 0.0);
        } else {
            m->res->heat().set_split_capacity(0);
        }
        mf.view = r.view(cap);
        mf.view.family = families.try_emplace(family, static_cast<uint32_t>(families.size())).first->second;
        if (m->config.family_budget) mf.view.family_budget = m->config.family_budget->resolve(mem_total_);
        mf.view.standby = at_rest.standby;
        auto facts = [&](uint32_t slot) {
            const SlotState& st = r.state(slot);
            return SlotFacts{st.tier(),          st.cached_bytes(),     r.slot_length(slot),
                             r.slot_bytes(slot), r.wanted_in_ram(slot), r.read_for_ram(slot)};
        };
        mf.slots.reserve(r.n_slots());
        for (uint32_t s = 0; s < r.n_slots(); ++s) mf.slots.push_back(facts(s));
        mf.dense = facts(kDenseSlot);
        mf.holder.locked = r.locked_bytes();
        mf.holder.cap = cap;
        mf.holder.family = family;
        mf.holder.family_budget = mf.view.family_budget;
        if (m->registered) {
            mf.holder.uid = m->owner_uid;
            if (const auto it = config_.uid_budgets.find(m->owner_uid); it != config_.uid_budgets.end())
                mf.holder.user_budget = it->second.resolve(mem_total_);
        }
        // A model users registered (no [[model]], no D-Bus RegisterModel): its dense part after the
        // operator's experts, and its owner's budget in the plan, not only when locking.
        if (m->registered && !m->operator_added) {
            mf.view.users = true;
            if (mf.holder.user_budget != kNoCap) {
                mf.view.owner = m->owner_uid;
                mf.view.owner_budget = mf.holder.user_budget;
            }
        }
        mf.waiting = m->res->ready();
        mf.warm_pending = m->warm_pending;
        f.models.push_back(std::move(mf));
        loaded.push_back(m.get());
    }
    apply(decide_turn(f), loaded);
}

// One place where the RAM cannot keep the experts of the models in use locked anyway (each model
// against its own budget too): budgets.h, one_place_needed. Decided at each placement and when a
// client registers a model (before its hook's pool forms), and told to the clients that changed.
void DecideStep::decide_one_place(uint64_t cap, const std::set<uint32_t>& registered) {
    uint64_t in_use = 0;
    for (const auto& m : models_.all())
        if (m->res && registered.count(m->id) != 0) in_use += m->res->model().map().expert_bytes_total;
    bool told = false;
    for (auto& m : models_.all()) {
        if (!m->res || registered.count(m->id) == 0) continue;
        const uint64_t mine = m->res->model().map().expert_bytes_total;
        const std::optional<bool> was = m->one_place_decided ? std::optional<bool>(m->one_place) : std::nullopt;
        const bool needed = one_place_needed(in_use, cap, was) || one_place_needed(mine, model_cap(*m), was);
        m->one_place_decided = true;
        if (needed == m->one_place) continue;
        MC_LOG(LOG_INFO, "model {}: experts in VRAM pools {} ({} of experts in use, lock cap {})", m->path,
               needed ? "leave RAM (one place)" : "keep their RAM copy: the lock cap holds every expert",
               format_bytes(in_use), format_bytes(cap));
        m->one_place = needed;
        m->res->set_keep_ram_copy(config_.keep_ram_copy || !needed);
        one_place_due_.insert(m->id);
        told = true;
    }
    if (told) tell_vram_policy();
}

uint64_t DecideStep::model_cap(const ModelEntry& m) const {
    uint64_t cap = m.config.budget ? m.config.budget->resolve(mem_total_) : UINT64_MAX;
    if (m.registered)
        if (const auto it = config_.uid_budgets.find(m.owner_uid); it != config_.uid_budgets.end())
            cap = std::min(cap, it->second.resolve(mem_total_));
    return cap;
}

uint64_t DecideStep::total_locked() const {
    uint64_t t = 0;
    for (const auto& m : models_.all())
        if (m->res) t += m->res->locked_bytes();
    return t;
}

// The turn's facts of a slot a read may be for (reads_after_misses, reads_after_predictions).
FetchCandidate DecideStep::fetch_candidate(uint32_t model, uint32_t slot, const std::set<uint32_t>& hooked) const {
    FetchCandidate c;
    c.at = {model, slot};
    const ModelEntry* m = models_.find(model);
    if (m == nullptr || !m->res || slot >= m->res->n_slots()) return c;
    const ModelResidency& r = *m->res;
    const SlotState& st = r.state(slot);
    c.known = true;
    c.tier = st.tier();
    c.cached = st.cached_bytes();
    c.length = r.slot_length(slot);
    c.wanted_in_ram = r.wanted_in_ram(slot);
    c.read_for_ram = r.read_for_ram(slot);
    c.hooked = hooked.count(model) != 0;
    return c;
}

// A runtime read part of these experts from storage: read the rest of each at once, ahead of
// everything else queued, so that its next faults in them hit the page cache instead of waiting
// for storage one page at a time (a runtime that maps with MADV_RANDOM, as lazy load does, reads
// nothing around a fault).
// Not for a model a CUDA hook uses (a client with a VRAM pool): the hook reads a miss from the file
// itself, whole slices at a time, so a read of the rest here would read it twice, ahead of the
// reads that lock the hot set.
void DecideStep::fetch_missed() {
    if (missed_.empty()) return;
    if (config_.on_miss) {
        std::set<uint32_t> hooked;
        for (const auto& c : hub_.all())
            if (!c->dead && c->has_pool) hooked.insert(c->models.begin(), c->models.end());
        std::vector<FetchCandidate> missed;
        missed.reserve(missed_.size());
        for (const auto& [id, slot] : missed_) missed.push_back(fetch_candidate(id, slot, hooked));
        for (const SlotRef& at : reads_after_misses(missed)) {
            const uint64_t q = cache_fetch(*models_.find(at.model), at.slot, FetchReason::Miss);
            if (q == 0) continue;
            ++counters_.miss_fetches;
            counters_.miss_fetch_bytes += q;
        }
        if (auto r = prefetcher_.submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    }
    missed_.clear();
}

void DecideStep::on_fetched(uint64_t tag, uint64_t, int err) {
    const auto id = fetch_tag_model(tag);
    const auto slot = static_cast<uint32_t>(tag & 0xffffffffu);
    if ((tag >> 63) != 0) {
        // A read that fails leaves part of the expert on storage: said (once a minute with a count),
        // as an operator's prefetch that comes back short would otherwise be a mystery.
        if (err != 0 && err != ECANCELED)
            if (const ModelEntry* m = models_.find(id))
                errors_.note(Doing::ReadingExpert, fmt::format("model {}: {}", m->path, std::strerror(err)));
        cache_fetched(id, slot);
        return;
    }
    for (auto& m : models_.all()) {
        if (m->id != id || !m->res) continue;
        if (err != 0 && err != ECANCELED)
            MC_LOG(LOG_WARNING, "model {}: prefetch failed: {}", m->path, std::strerror(err));
        if (m->res->read_done(slot)) {
            // Locked at the end of this turn, not the next tick: locking keeps pace with the reads
            // (on the GPU machine a warm start locked 230 MB/s off a 1.7 GB/s disk, tick-bound, and
            // a runtime's first requests read from storage what the daemon had not locked yet).
            request();
        }
    }
}

// What the trusted predictions of this turn expect the next token to use, read into the page
// cache: behind a runtime's misses, ahead of the plan's locks (the next token is tens of ms away).
// Speculation never queues behind itself: nothing is added while reads wait to be issued.
void DecideStep::fetch_predicted() {
    if (predicted_.empty()) return;
    // While reads wait nothing is read for a prediction: their facts are not gathered either.
    const bool reads_queued = prefetcher_.progress().queued_bytes > 0;
    std::vector<FetchCandidate> predicted;
    if (!reads_queued) {
        predicted.reserve(predicted_.size());
        for (const auto& [id, slot] : predicted_) predicted.push_back(fetch_candidate(id, slot, {}));
    }
    predicted_.clear();
    uint64_t queued = 0;
    for (const SlotRef& at : reads_after_predictions(predicted, reads_queued))
        queued += cache_fetch(*models_.find(at.model), at.slot, FetchReason::Prediction);
    if (queued == 0) return;
    counters_.predict_fetch_bytes += queued;
    if (auto s = prefetcher_.submit(); !s) MC_LOG(LOG_WARNING, "prefetch: {}", s.error().what());
}

// The turn's decisions, once, after every source was read: reads after misses, predicted reads,
// one place for what pools took, and the placement when something asked for it.
void DecideStep::decide_and_act() {
    fetch_missed();
    fetch_predicted();
    settle_one_place();
    if (requested_) place();
}

void DecideStep::request() {
    requested_ = true;
    if (!in_turn_) place();
}

uint64_t DecideStep::cache_fetch(ModelEntry& m, uint32_t slot, FetchReason reason, uint32_t order) {
    const int32_t priority = fetch_priority(reason, order);
    if (const auto it = m.res->cache_reads().find(slot); it != m.res->cache_reads().end()) {
        if (reason != FetchReason::Miss || it->second.reason == FetchReason::Miss) return 0;
        // Queued behind other work (a warm start, an operator's prefetch) while a runtime waits for
        // it: cancelled (each of its live reads still reports once) and queued again, first.
        prefetcher_.cancel(fetch_tag(m.id, slot, true));
    }
    const auto& r = *m.res;
    uint64_t queued = 0;
    uint32_t reads = 0;
    for (const auto& range : r.ranges(slot)) {
        const auto& f = r.model().files()[range.file];
        prefetcher_.enqueue({f.fd.get(), range.offset, range.length, priority, fetch_tag(m.id, slot, reason)});
        queued += range.length;
        ++reads;
    }
    m.res->cache_read_queued(slot, reason, reads);
    return queued;
}

// Completion of a read that stays cached only (on_fetched sees the tag bit).
void DecideStep::cache_fetched(uint32_t model, uint32_t slot) {
    ModelEntry* m = models_.find(model);
    if (m && m->res) m->res->cache_read_done(slot);
}

// The turn's one-place decisions, from what every live client says its pool holds: an expert
// leaves RAM (unlocked, its pages dropped) when each client of the model holds it in VRAM, at
// least one of them may evict, and [vram] keep_ram_copy is off; it is wanted in RAM again as soon
// as that stops holding (a client leaves or registers, a pool gives it up).
void DecideStep::settle_one_place() {
    std::set<uint32_t> due;
    due.swap(one_place_due_);
    for (uint32_t id : due) {
        ModelEntry* m = models_.find(id);
        if (m == nullptr || !m->res) continue;
        ModelResidency& r = *m->res;
        const uint32_t n = r.n_slots();
        std::vector<uint32_t> holders(n, 0);
        std::vector<uint8_t> evictor(n, 0);
        uint32_t clients = 0;
        for (const auto& c : hub_.all()) {
            if (c->dead || std::find(c->models.begin(), c->models.end(), id) == c->models.end()) continue;
            ++clients;
            if (!c->pool_reported) continue;  // its placements wait for its pool
            const bool may = may_release_ram(*c, *m, admin_gid_);
            bool holds_any = false;
            for (auto it = c->vram.lower_bound({id, 0}); it != c->vram.end() && it->first == id; ++it) {
                if (it->second >= n) continue;
                ++holders[it->second];
                evictor[it->second] |= may ? 1 : 0;
                holds_any = true;
            }
            if (holds_any && !may && c->told_not_releasing.insert(id).second)
                MC_LOG(LOG_NOTICE,
                       "client {} (uid {}): its VRAM pool does not take {} out of RAM: that is an eviction, for root "
                       "and group {} only (or a model its users registered)",
                       c->id, c->peer.uid, m->path, config_.dbus_admin_group);
        }
        bool relock = false;
        std::vector<uint32_t> released;
        const std::vector<uint8_t> leaves =
            released_from_ram(holders, evictor, clients, m->one_place, config_.keep_ram_copy);
        for (uint32_t slot = 0; slot < n; ++slot) {
            const bool was = r.ram_released(slot);
            const bool now = leaves[slot] != 0;
            r.set_vram(slot, holders[slot], now);
            if (now && !was) released.push_back(slot);
            if (was && !now) {
                relock = true;
                MC_LOG(LOG_DEBUG, "{}: expert {} is wanted in RAM again", m->path, slot);
            }
        }
        for (uint32_t slot : released) {
            if (r.pinned(slot)) continue;
            if (r.state(slot).tier() == Tier::Locked) {
                if (auto x = r.release(slot, /*drop=*/true); !x) {
                    MC_LOG(LOG_WARNING, "{}: releasing expert {} (now in VRAM): {}", m->path, slot, x.error().what());
                } else {
                    ++counters_.vram_releases;
                    MC_LOG(LOG_DEBUG, "{}: expert {} leaves RAM: every client holds it in VRAM", m->path, slot);
                    // Like every unlock: a hook whose registered tier follows the locks may have
                    // registered it on a Lock that crossed its own placement.
                    tell_clients(*m, slot, protocol::Action::Unlock);
                }
            }
            r.drop_cached(slot);
        }
        if (relock) request();
    }
}

// The pool budgets and whether experts in its pools leave RAM, as the client was last told.
void DecideStep::send_vram_policy(Client& c) {
    hub_.reply(c, 0,
               VramPolicy{kAllDevices, config_.vram_pool.value_or(kNoPoolLimit), c.one_place_told, c.recency_told});
    for (const auto& [device, bytes] : config_.vram_pool_device)
        hub_.reply(c, 0, VramPolicy{device, bytes, c.one_place_told, c.recency_told});
}

// One place for a client: unless [vram] keep_ram_copy, while any of its models needs it
// (ModelEntry::one_place); a client with no model yet hears the default. Sent again when it changes.
void DecideStep::tell_vram_policy() {
    for (auto& cp : hub_.all()) {
        Client& c = *cp;
        if (c.dead || !c.hello) continue;
        bool found = false, wants = false;
        for (const auto& m : models_.all())
            if (std::find(c.models.begin(), c.models.end(), m->id) != c.models.end()) {
                found = true;
                wants = wants || m->one_place;
            }
        const bool one_place = !config_.keep_ram_copy && (!found || wants);
        if (one_place == c.one_place_told) continue;
        c.one_place_told = one_place;
        send_vram_policy(c);
    }
}

void DecideStep::tell_clients(const ModelEntry& m, uint32_t slot, Action action) {
    if (hub_.empty() || slot == kDenseSlot || !m.res) return;
    const auto& map = m.res->model().map();
    const uint32_t layer = slot / map.n_experts;
    if (layer >= map.layers.size()) return;
    const Directive d{action, m.id, map.layers[layer].index, slot % map.n_experts};
    for (auto& c : hub_.all())
        if (!c->dead && std::find(c->models.begin(), c->models.end(), m.id) != c->models.end()) c->outbox.push_back(d);
}

// The daemon's view of what belongs in VRAM, for each client with a pool: by heat (all clients'
// telemetry, and the profile saved before a restart or shared by the model's family), among
// admitted experts, the elite of each layer and the hottest of any layer up to [vram] directed of
// the pool it reported (pool_wanted). Promote what joins it, hottest first (the hook fills its
// pool in that order), Unpromote what leaves; the hook's own policy fills the rest of its pool.
// The pool's recency split (HeatTable::SplitFor::Pool, learnt at the pool's size) takes its share
// out of the directed part, and the client is told to keep the rest as an LRU (VramPolicy recency).
void DecideStep::direct_pools() {
    for (auto& cp : hub_.all()) {
        Client& c = *cp;
        if (c.dead || !c.has_pool) continue;
        std::set<std::pair<uint32_t, uint32_t>> want;
        std::vector<std::pair<uint32_t, uint32_t>> order;  // hottest first
        PlannerSettings settings{config_.admit_after_uses, config_.elite_share, config_.hysteresis};
        uint64_t pool_bytes = 0;
        for (const auto& [device, stats] : c.pools) pool_bytes += stats.pool_bytes;
        size_t n_models = 0;
        bool recency = false;
        c.directed_capacity = 0;
        for (auto& m : models_.all())
            if (m->res && std::find(c.models.begin(), c.models.end(), m->id) != c.models.end()) ++n_models;
        for (auto& m : models_.all()) {
            if (!m->res || std::find(c.models.begin(), c.models.end(), m->id) == c.models.end()) continue;
            // The pool's share for this model, in experts of its mean size (split evenly between the
            // client's models).
            const uint64_t expert_bytes =
                m->res->n_slots() > 0 ? m->res->model().map().expert_bytes_total / m->res->n_slots() : 0;
            const double room = static_cast<double>(pool_bytes) / static_cast<double>(std::max<size_t>(n_models, 1));
            const double pool_experts =
                expert_bytes > 0 ? std::min<double>(room / static_cast<double>(expert_bytes), m->res->n_slots()) : 0;
            std::vector<uint8_t> held(m->res->n_slots(), 0);
            for (const auto& [mid, slot] : c.promoted)
                if (mid == m->id && slot < held.size()) held[slot] = 1;
            // A shift its heat saw since: the pool's own part ranks by the client's counts, learnt
            // on the old routing (they halve over ~1000 tokens); the client cuts them as the heat was.
            // A count that went down is a heat begun anew (the model reopened under its id): nothing
            // shifted, and the count is followed from there.
            const uint64_t shifts = m->res->heat().shifts();
            if (auto [told, fresh] = c.shifts_told.try_emplace(m->id, shifts); !fresh && told->second != shifts) {
                const bool shifted = shifts > told->second;
                told->second = shifts;
                if (shifted) {
                    c.outbox.push_back(Directive{Action::Shifted, m->id, 0, 0});
                    MC_LOG(LOG_INFO, "{}: its routing shifted: client {} cuts its pool's use counts", m->path, c.id);
                }
            }
            const PoolDirected d =
                direct_pool(m->res->heat(), settings, m->one_place, config_.pool_directed, pool_experts, held);
            recency = recency || d.recency;
            c.directed_capacity += d.capacity;
            for (uint32_t slot : d.wanted)
                if (want.emplace(m->id, slot).second) order.emplace_back(m->id, slot);
        }
        auto send = [&](std::pair<uint32_t, uint32_t> key, Action a) {
            for (auto& m : models_.all())
                if (m->id == key.first && m->res) {
                    const auto& map = m->res->model().map();
                    const uint32_t l = key.second / map.n_experts;
                    c.outbox.push_back(Directive{a, m->id, map.layers[l].index, key.second % map.n_experts});
                }
        };
        for (const auto& key : order)
            if (c.promoted.insert(key).second) send(key, Action::Promote);
        for (auto it = c.promoted.begin(); it != c.promoted.end();) {
            if (want.count(*it) == 0) {
                send(*it, Action::Unpromote);
                it = c.promoted.erase(it);
            } else {
                ++it;
            }
        }
        if (recency != c.recency_told && c.hello) {
            c.recency_told = recency;
            MC_LOG(LOG_INFO, "client {}: the part of its pool not directed {}", c.id,
                   recency ? "keeps what was used last (the routing reuses it)" : "follows its use counts again");
            send_vram_policy(c);
        }
    }
    bind_promoted();
}

// One read, one place, from the start: while every client of a model fills its pool for the first
// time (a runtime that starts warm: a profile, its family's heat), an expert every one of them was
// directed to hold (under one place) is read by those hooks from the file into VRAM (into free
// slots); the daemon does not read it into RAM for a lock first. One it locked already stays
// locked until a pool takes it (the hook fills from the registered pages). Once a pool holds nine
// in ten of what it was directed to, its changes (the ranking moving) go through RAM's locks again,
// as a pool's later fills displace what it holds: a read from the file for each of those would
// churn storage. A client without a pool, or one whose pool may not take experts out of RAM, needs
// them in RAM: then nothing is bound.
void DecideStep::bind_promoted() {
    for (auto& cp : hub_.all()) {
        Client& c = *cp;
        if (c.dead || c.pool_filled || !c.pool_reported) continue;
        size_t held = 0;
        for (const auto& key : c.promoted) held += c.vram.count(key);
        // Filled (moecache/first_fill.h): the direction is nine in ten of the pool's size (not the
        // few experts the first routing named) and the pool holds nine in ten of it.
        const bool full =
            10 * c.promoted.size() >= 9 * uint64_t{c.directed_capacity} && first_fill_held(held, c.promoted.size());
        if (full || std::chrono::steady_clock::now() - c.pool_since > kFirstFillBound) c.pool_filled = true;
    }
    for (auto& m : models_.all()) {
        if (!m->res) continue;
        const uint32_t n = m->res->n_slots();
        std::vector<ClientPool> pools;
        for (const auto& c : hub_.all()) {
            if (c->dead || std::find(c->models.begin(), c->models.end(), m->id) == c->models.end()) continue;
            ClientPool& p = pools.emplace_back();
            p.pooled = c->has_pool && c->pool_reported;
            p.may_release = may_release_ram(*c, *m, admin_gid_);
            p.filling = !c->pool_filled;
            p.holds.assign(n, 0);
            p.promoted.assign(n, 0);
            for (auto it = c->vram.lower_bound({m->id, 0}); it != c->vram.end() && it->first == m->id; ++it)
                if (it->second < n) p.holds[it->second] = 1;
            for (auto it = c->promoted.lower_bound({m->id, 0}); it != c->promoted.end() && it->first == m->id; ++it)
                if (it->second < n) p.promoted[it->second] = 1;
        }
        std::vector<uint8_t> bound =
            bound_for_vram(pools, n, m->one_place, config_.keep_ram_copy, config_.fill_from_files);
        // A read for a lock still queued (planned before the pools were known: a runtime's hook
        // registers its model a moment before its pool) is cancelled: the hook reads it.
        for (uint32_t s = 0; s < bound.size(); ++s) {
            if (!bound[s] || m->res->vram_bound(s) || m->res->state(s).tier() != Tier::Fetching || m->res->pinned(s))
                continue;
            prefetcher_.cancel(fetch_tag(m->id, s));
            m->res->abandon(s);
        }
        (void)m->res->set_vram_bound(std::move(bound));
    }
}

}  // namespace moecache::daemon
