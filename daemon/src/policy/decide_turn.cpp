// The decide step of a loop turn, pure (decide.h): the facts in, the turn's actions out. The
// daemon (src/decide/decide_step.cpp) and moecache-sim (sim/src/replay.cpp) both run it.
#include "moecache/daemon/decide.h"

#include <algorithm>
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
            if (planned[slot] || s.tier != Tier::Storage || !s.wanted_in_ram || !s.read_for_ram) continue;
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

namespace {

std::vector<const FetchCandidate*> each_once(std::span<const FetchCandidate> in) {
    std::vector<const FetchCandidate*> out;
    out.reserve(in.size());
    for (const auto& c : in) out.push_back(&c);
    const auto key = [](const FetchCandidate* c) { return std::pair{c->at.model, c->at.slot}; };
    std::stable_sort(out.begin(), out.end(), [&](auto* a, auto* b) { return key(a) < key(b); });
    out.erase(std::unique(out.begin(), out.end(), [&](auto* a, auto* b) { return key(a) == key(b); }), out.end());
    return out;
}

}  // namespace

std::vector<SlotRef> reads_after_misses(std::span<const FetchCandidate> missed) {
    std::vector<SlotRef> out;
    for (const FetchCandidate* c : each_once(missed))
        if (c->known && c->wanted_in_ram && !c->hooked && c->tier == Tier::Storage) out.push_back(c->at);
    return out;
}

std::vector<SlotRef> reads_after_predictions(std::span<const FetchCandidate> predicted, bool reads_queued) {
    std::vector<SlotRef> out;
    if (reads_queued) return out;
    for (const FetchCandidate* c : each_once(predicted))
        if (c->known && c->tier == Tier::Storage && c->cached < c->length && c->read_for_ram) out.push_back(c->at);
    return out;
}

std::vector<ModelRest> models_at_rest(std::span<const ModelUse> models, std::chrono::steady_clock::time_point now) {
    std::set<std::string> families_in_use;
    for (const auto& m : models)
        if (m.in_use) families_in_use.insert(m.family);
    const auto goes_before = [&](size_t next, size_t went) {
        const ModelUse& n = models[next];
        const ModelUse& w = models[went];
        return next != went && w.runtime_left && !n.in_use && !w.in_use && n.family == w.family && n.runtime_left &&
               *n.runtime_left < *w.runtime_left;
    };
    std::vector<ModelRest> out(models.size());
    for (size_t i = 0; i < models.size(); ++i) {
        const ModelUse& m = models[i];
        bool yields = false, awaited = false;
        for (size_t o = 0; o < models.size(); ++o) {
            yields = yields || goes_before(o, i);
            awaited = awaited || goes_before(i, o);
        }
        out[i].left = !m.keep && !m.in_use && families_in_use.count(m.family) != 0;
        out[i].standby =
            out[i].left || (!m.keep && !m.in_use && (yields || (now - m.last_used > kStandbyAfter && !awaited)));
    }
    return out;
}

std::vector<uint8_t> released_from_ram(std::span<const uint32_t> holders, std::span<const uint8_t> evictors,
                                       uint32_t clients, bool one_place, bool keep_ram_copy) {
    std::vector<uint8_t> out(holders.size(), 0);
    if (!one_place || keep_ram_copy || clients == 0) return out;
    for (size_t s = 0; s < holders.size(); ++s)
        out[s] = holders[s] == clients && s < evictors.size() && evictors[s] != 0 ? 1 : 0;
    return out;
}

std::vector<uint8_t> bound_for_vram(std::span<const ClientPool> clients, uint32_t n_slots, bool one_place,
                                    bool keep_ram_copy, bool fill_from_files) {
    if (clients.empty() || !one_place || keep_ram_copy || !fill_from_files) return {};
    for (const auto& c : clients)
        if (!c.pooled || !c.may_release) return {};
    std::vector<uint32_t> ok(n_slots, 0), filling(n_slots, 0);
    for (const auto& c : clients)
        for (uint32_t s = 0; s < n_slots; ++s) {
            const bool holds = s < c.holds.size() && c.holds[s] != 0;
            const bool to_fill = !holds && c.filling && s < c.promoted.size() && c.promoted[s] != 0;
            ok[s] += holds || to_fill ? 1 : 0;
            filling[s] += to_fill ? 1 : 0;
        }
    std::vector<uint8_t> bound(n_slots, 0);
    for (uint32_t s = 0; s < n_slots; ++s) bound[s] = ok[s] == clients.size() && filling[s] > 0 ? 1 : 0;
    return bound;
}

}  // namespace moecache::daemon
