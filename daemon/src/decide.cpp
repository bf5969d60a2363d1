// The decide step: once per loop turn (request_place() marks the turn; the loop calls place()
// once), the plan of what to lock and release under the budgets, the reads it needs, warm starts,
// reads after misses and predictions, and the locks the budgets admit this turn.
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/decide.h"
#include "moecache/daemon/system_memory.h"

#include "daemon_state.h"
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

TurnActions decide_turn(const TurnFacts& f) {
    TurnActions a;
    const auto n = static_cast<uint32_t>(f.models.size());
    std::vector<ModelView> views;
    views.reserve(n);
    for (const auto& m : f.models) views.push_back(m.view);
    a.plan = plan_placement(views, f.lock_cap, f.planner);
    a.release = a.plan.release;
    // What may be locked this turn: what was read and waits, then what the plan wants that the page
    // cache holds already (locked without reading). The rest of the plan is read first.
    std::vector<std::vector<uint32_t>> ready(n);
    for (uint32_t i = 0; i < n; ++i) ready[i] = f.models[i].waiting;
    for (const auto& r : a.plan.lock) {
        const SlotFacts& s = f.models[r.model].slot(r.slot);
        if (s.tier != Tier::Storage) continue;
        if (s.cached >= s.length) ready[r.model].push_back(r.slot);
        else a.read.push_back(r);
    }
    // Warm starts: the experts the profile saw used, hottest first, beyond the plan's locks.
    for (uint32_t i = 0; i < n; ++i) {
        const ModelFacts& m = f.models[i];
        if (!m.warm_pending) continue;
        std::vector<uint8_t> planned(m.slots.size(), 0);
        uint64_t to_lock = 0;
        for (const auto& p : a.plan.lock) {
            if (p.model != i) continue;
            if (p.slot != kDenseSlot) planned[p.slot] = 1;
            const SlotFacts& s = m.slot(p.slot);
            to_lock += s.length > s.cached ? s.length - s.cached : 0;
        }
        TurnActions::WarmReads w;
        w.model = i;
        w.room = warm_room(f.memory, to_lock, f.reserve, f.warm_limit);
        std::vector<WarmCandidate> candidates;
        const HeatTable& heat = *m.view.heat;
        const uint32_t ne = heat.n_experts();
        for (uint32_t slot = 0; slot < m.slots.size(); ++slot) {
            const SlotFacts& s = m.slots[slot];
            if (planned[slot] || s.tier != Tier::Storage || !s.wanted_in_ram) continue;
            if (heat.uses(slot / ne, slot % ne) < f.planner.admit_after_uses) continue;
            candidates.push_back({slot, heat.heat(slot / ne, slot % ne), s.length > s.cached ? s.length - s.cached : 0});
        }
        const auto picks = warm_picks(std::move(candidates), w.room);
        w.chosen = static_cast<uint32_t>(picks.size());
        for (const auto& c : picks)
            if (m.slots[c.slot].cached < m.slots[c.slot].length) w.slots.push_back(c.slot);
        a.warm.push_back(std::move(w));
    }
    // Locks, under every cap as it stands once the releases are done, and the memory there is now
    // less the reserve: locking cached pages takes them out of MemAvailable, so never below it.
    std::vector<LockHolder> holders;
    holders.reserve(n);
    for (const auto& m : f.models) holders.push_back(m.holder);
    for (const auto& r : a.release) {
        const uint64_t b = f.models[r.model].slot(r.slot).lock_bytes;
        holders[r.model].locked -= std::min(holders[r.model].locked, b);
    }
    const uint64_t lockable = f.memory.available > f.reserve ? f.memory.available - f.reserve : 0;
    LockLedger ledger(f.lock_cap, lockable, std::move(holders));
    uint64_t budget = f.lock_bytes_per_turn;
    a.waiting.resize(n);
    for (uint32_t i = 0; i < n; ++i)
        for (uint32_t slot : ready[i]) {
            if (budget == 0) {
                a.waiting[i].push_back(slot);
                continue;
            }
            const SlotFacts& s = f.models[i].slot(slot);
            budget -= std::min(budget, s.lock_bytes);
            if (s.tier == Tier::Locked) continue;
            if (!s.wanted_in_ram) {  // a VRAM pool took it while it was being read
                a.given_up.push_back({i, slot});
                continue;
            }
            if (const LockRefusal why = ledger.admits(i, s.lock_bytes); why != LockRefusal::None) {
                a.refused.push_back({{i, slot}, why});
                continue;
            }
            ledger.took(i, s.lock_bytes);
            a.lock.push_back({i, slot});
        }
    return a;
}

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
    if (const auto m = read_system_memory()) memory_now_ = *m;
    TurnFacts f;
    f.memory = memory_facts();
    f.lock_cap = lock_cap();
    f.reserve = config_.reserve.resolve(mem_total_);
    f.warm_limit = config_.warm_limit ? config_.warm_limit->resolve(mem_total_) : kNoCap;
    f.planner = PlannerSettings{config_.admit_after_uses, config_.elite_share, config_.hysteresis};
    std::vector<ModelEntry*> loaded;
    std::map<std::string, uint32_t> families;
    for (auto& m : models_) {
        if (!m->res) continue;
        const ModelResidency& r = *m->res;
        ModelFacts mf;
        const std::string family = family_of(*m);
        mf.view = r.view(model_cap(*m));
        mf.view.family = families.try_emplace(family, static_cast<uint32_t>(families.size())).first->second;
        if (m->config.family_budget) mf.view.family_budget = m->config.family_budget->resolve(mem_total_);
        auto facts = [&](uint32_t slot) {
            const SlotState& st = r.state(slot);
            return SlotFacts{st.tier(), st.cached_bytes, r.slot_length(slot), r.slot_bytes(slot), r.wanted_in_ram(slot)};
        };
        mf.slots.reserve(r.n_slots());
        for (uint32_t s = 0; s < r.n_slots(); ++s) mf.slots.push_back(facts(s));
        mf.dense = facts(kDenseSlot);
        mf.holder.locked = r.locked_bytes();
        mf.holder.cap = model_cap(*m);
        mf.holder.family = family;
        mf.holder.family_budget = mf.view.family_budget;
        if (m->registered) {
            mf.holder.uid = m->owner_uid;
            if (const auto it = config_.uid_budgets.find(m->owner_uid); it != config_.uid_budgets.end())
                mf.holder.user_budget = it->second.resolve(mem_total_);
        }
        mf.waiting = m->waiting;
        mf.warm_pending = m->warm_pending;
        f.models.push_back(std::move(mf));
        loaded.push_back(m.get());
    }
    apply(decide_turn(f), loaded);
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
    for (const auto& m : models_)
        if (m->res) t += m->res->locked_bytes();
    return t;
}

// A runtime read part of these experts from storage: read the rest of each at once, ahead of
// everything else queued, so that its next faults in them hit the page cache instead of waiting
// for storage one page at a time (a runtime that maps with MADV_RANDOM, as lazy load does, reads
// nothing around a fault).
void Daemon::fetch_missed() {
    if (missed_this_batch_.empty()) return;
    if (config_.on_miss) {
        std::sort(missed_this_batch_.begin(), missed_this_batch_.end());
        missed_this_batch_.erase(std::unique(missed_this_batch_.begin(), missed_this_batch_.end()), missed_this_batch_.end());
        for (const auto& [id, slot] : missed_this_batch_) {
            ModelEntry* m = find_model(id);
            if (!m || !m->res || slot >= m->res->n_slots() || !m->res->wanted_in_ram(slot)) continue;
            // Being read for a lock already: that read is as good.
            if (m->res->state(slot).tier() != Tier::Storage) continue;
            const uint64_t q = cache_fetch(*m, slot, FetchReason::Miss);
            if (q == 0) continue;
            ++miss_fetches_;
            miss_fetch_bytes_ += q;
        }
        if (auto r = prefetcher_->submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    }
    missed_this_batch_.clear();
}

void Daemon::on_fetched(uint64_t tag, uint64_t, int err) {
    const auto id = static_cast<uint32_t>((tag >> 32) & 0x7fffffffu);
    const auto slot = static_cast<uint32_t>(tag & 0xffffffffu);
    if ((tag >> 63) != 0) {
        cache_fetched(id, slot);
        return;
    }
    for (auto& m : models_) {
        if (m->id != id || !m->res) continue;
        SlotState& st = m->res->state(slot);
        if (st.fetches_pending > 0) --st.fetches_pending;
        if (err != 0 && err != ECANCELED) MC_LOG(LOG_WARNING, "model {}: prefetch failed: {}", m->path, std::strerror(err));
        if (st.fetches_pending == 0 && st.tier() == Tier::Fetching) m->waiting.push_back(slot);
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
    std::vector<std::pair<uint32_t, uint32_t>> predicted;
    predicted.swap(predicted_);
    if (prefetcher_->progress().queued_bytes > 0) return;
    std::sort(predicted.begin(), predicted.end());
    predicted.erase(std::unique(predicted.begin(), predicted.end()), predicted.end());
    uint64_t queued = 0;
    for (const auto& [id, slot] : predicted) {
        ModelEntry* m = find_model(id);
        if (m == nullptr || !m->res || slot >= m->res->n_slots()) continue;
        const ModelResidency& r = *m->res;
        const SlotState& st = r.state(slot);
        if (st.tier() != Tier::Storage || st.cached_bytes >= r.slot_length(slot) || !r.wanted_in_ram(slot)) continue;
        queued += cache_fetch(*m, slot, FetchReason::Prediction);
    }
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
