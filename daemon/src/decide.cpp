// The decide step of the loop: once per loop turn (request_place() marks the turn; the loop calls
// place() once) the facts are gathered and decide_turn() (decide.h, pure: src/policy/
// decide_turn.cpp) says what to lock, release and read under the budgets; here too the reads after
// misses and predictions.
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/decide.h"
#include "moecache/daemon/system_memory.h"

#include "clients/client_hub.h"
#include "dbus/dbus_service.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/log.h"

#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace moecache::daemon {

uint64_t Daemon::lock_cap() const {
    return daemon::lock_cap(memory_facts(), config_.lock_budget.resolve(mem_total_), config_.reserve.resolve(mem_total_),
                            pressure_cap_);
}

MemoryFacts Daemon::memory_facts() const {
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
void Daemon::place() {
    place_requested_ = false;
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
    for (const auto& c : hub_->all())
        if (!c->dead) {
            registered.insert(c->models.begin(), c->models.end());
            if (c->has_pool) pooled.insert(c->models.begin(), c->models.end());
        }
    decide_one_place(f.lock_cap, registered);
    // Which open models rest (models_at_rest: the prompt-model swap, standby).
    std::vector<ModelUse> uses;
    for (const auto& m : models_->all())
        if (m->res)
            uses.push_back(
                {models_->family_of(*m), registered.count(m->id) != 0, m->config.keep, m->runtime_left, m->last_used});
    const std::vector<ModelRest> rest = models_at_rest(uses, now);
    size_t open = 0;
    for (auto& m : models_->all()) {
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
void Daemon::decide_one_place(uint64_t cap, const std::set<uint32_t>& registered) {
    uint64_t in_use = 0;
    for (const auto& m : models_->all())
        if (m->res && registered.count(m->id) != 0) in_use += m->res->model().map().expert_bytes_total;
    bool told = false;
    for (auto& m : models_->all()) {
        if (!m->res || registered.count(m->id) == 0) continue;
        const uint64_t mine = m->res->model().map().expert_bytes_total;
        const std::optional<bool> was = m->one_place_decided ? std::optional<bool>(m->one_place) : std::nullopt;
        const bool needed = one_place_needed(in_use, cap, was) || one_place_needed(mine, model_cap(*m), was);
        m->one_place_decided = true;
        if (needed == m->one_place) continue;
        MC_LOG(LOG_INFO, "model {}: experts in VRAM pools {} ({} of experts in use, lock cap {})", m->path,
               needed ? "leave RAM (one place)" : "keep their RAM copy: the lock cap holds every expert", format_bytes(in_use),
               format_bytes(cap));
        m->one_place = needed;
        m->res->set_keep_ram_copy(config_.keep_ram_copy || !needed);
        one_place_due_.insert(m->id);
        told = true;
    }
    if (told) tell_vram_policy();
}

uint64_t Daemon::model_cap(const ModelEntry& m) const {
    uint64_t cap = m.config.budget ? m.config.budget->resolve(mem_total_) : UINT64_MAX;
    if (m.registered)
        if (const auto it = config_.uid_budgets.find(m.owner_uid); it != config_.uid_budgets.end())
            cap = std::min(cap, it->second.resolve(mem_total_));
    return cap;
}

uint64_t Daemon::total_locked() const {
    uint64_t t = 0;
    for (const auto& m : models_->all())
        if (m->res) t += m->res->locked_bytes();
    return t;
}

// The turn's facts of a slot a read may be for (reads_after_misses, reads_after_predictions).
FetchCandidate Daemon::fetch_candidate(uint32_t model, uint32_t slot, const std::set<uint32_t>& hooked) const {
    FetchCandidate c;
    c.at = {model, slot};
    const ModelEntry* m = models_->find(model);
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
void Daemon::fetch_missed() {
    if (missed_this_batch_.empty()) return;
    if (config_.on_miss) {
        std::set<uint32_t> hooked;
        for (const auto& c : hub_->all())
            if (!c->dead && c->has_pool) hooked.insert(c->models.begin(), c->models.end());
        std::vector<FetchCandidate> missed;
        missed.reserve(missed_this_batch_.size());
        for (const auto& [id, slot] : missed_this_batch_) missed.push_back(fetch_candidate(id, slot, hooked));
        for (const SlotRef& at : reads_after_misses(missed)) {
            const uint64_t q = cache_fetch(*models_->find(at.model), at.slot, FetchReason::Miss);
            if (q == 0) continue;
            ++miss_fetches_;
            miss_fetch_bytes_ += q;
        }
        if (auto r = prefetcher_->submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    }
    missed_this_batch_.clear();
}

void Daemon::on_fetched(uint64_t tag, uint64_t, int err) {
    const auto id = fetch_tag_model(tag);
    const auto slot = static_cast<uint32_t>(tag & 0xffffffffu);
    if ((tag >> 63) != 0) {
        // A read that fails leaves part of the expert on storage: said (once a minute with a count),
        // as an operator's prefetch that comes back short would otherwise be a mystery.
        if (err != 0 && err != ECANCELED)
            if (const ModelEntry* m = models_->find(id))
                note_error("reading an expert into the page cache", fmt::format("model {}: {}", m->path, std::strerror(err)));
        cache_fetched(id, slot);
        return;
    }
    for (auto& m : models_->all()) {
        if (m->id != id || !m->res) continue;
        if (err != 0 && err != ECANCELED) MC_LOG(LOG_WARNING, "model {}: prefetch failed: {}", m->path, std::strerror(err));
        if (m->res->read_done(slot)) {
            // Locked at the end of this turn, not the next tick: locking keeps pace with the reads
            // (on the GPU machine a warm start locked 230 MB/s off a 1.7 GB/s disk, tick-bound, and
            // a runtime's first requests read from storage what the daemon had not locked yet).
            request_place();
        }
    }
}

void Daemon::predict(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts) {
    auto& r = *m.res;
    const uint32_t ne = r.n_experts();
    if (!m.prediction) {
        const uint32_t nl = r.n_slots() / std::max<uint32_t>(ne, 1);
        m.prediction = std::make_unique<ModelEntry::Prediction>(
            ModelEntry::Prediction{RoutePredictor(nl, ne), {}, std::vector<std::vector<uint32_t>>(nl)});
    }
    auto& p = *m.prediction;
    if (layer >= p.next.size()) return;
    auto& next = p.next[layer];
    if (!next.empty()) {
        uint64_t right = 0;
        for (uint32_t e : next) right += std::find(experts.begin(), experts.end(), e) != experts.end();
        p.trust.score(next.size(), right);
    }
    p.predictor.observe(layer, experts);
    p.predictor.predict_next_token(layer, experts, static_cast<uint32_t>(experts.size()), next);
    if (!p.trust.trusted()) return;
    for (uint32_t e : next) predicted_.emplace_back(m.id, layer * ne + e);
}

// What the trusted predictions of this turn expect the next token to use, read into the page
// cache: behind a runtime's misses, ahead of the plan's locks (the next token is tens of ms away).
// Speculation never queues behind itself: nothing is added while reads wait to be issued.
void Daemon::fetch_predicted() {
    if (predicted_.empty()) return;
    // While reads wait nothing is read for a prediction: their facts are not gathered either.
    const bool reads_queued = prefetcher_->progress().queued_bytes > 0;
    std::vector<FetchCandidate> predicted;
    if (!reads_queued) {
        predicted.reserve(predicted_.size());
        for (const auto& [id, slot] : predicted_) predicted.push_back(fetch_candidate(id, slot, {}));
    }
    predicted_.clear();
    uint64_t queued = 0;
    for (const SlotRef& at : reads_after_predictions(predicted, reads_queued))
        queued += cache_fetch(*models_->find(at.model), at.slot, FetchReason::Prediction);
    if (queued == 0) return;
    predict_fetch_bytes_ += queued;
    if (auto s = prefetcher_->submit(); !s) MC_LOG(LOG_WARNING, "prefetch: {}", s.error().what());
}

// The turn's decisions, once, after every source was read: reads after misses, predicted reads,
// one place for what pools took, and the placement when something asked for it.
void Daemon::decide_and_act() {
    fetch_missed();
    fetch_predicted();
    settle_one_place();
    if (place_requested_) place();
}

void Daemon::request_place() {
    place_requested_ = true;
    if (!in_step_) place();
}

}  // namespace moecache::daemon
