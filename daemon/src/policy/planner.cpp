#include "moecache/daemon/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace moecache::daemon {
namespace {

// The planner's classes, taken in this order (docs/policy.md); within one, hotter first.
enum Class : int {
    kMust = 0,          // pinned experts, the dense part
    kElite = 1,         // the hottest elite_share of each layer
    kRegular = 2,       // the rest, by heat, across layers
    kAfterExperts = 3,  // a user's dense part while an operator's model is in use; a slot a pool holds
    kStandbyElite = 4,  // a model on standby: after every model in use
    kStandbyRegular = 5,
};

struct Candidate {
    SlotRef ref;
    int klass;     // Class
    double score;  // within a class, higher first
    uint64_t bytes;
    bool locked;
    bool unwanted = false;  // held in VRAM: released if locked, never locked
};

// `operators`: an operator's model is in use, whose experts a user's dense part must not outrank.
void add_model(uint32_t mi, const ModelView& m, const PlannerSettings& s, bool operators, std::vector<Candidate>& out) {
    if (m.dense_wanted && m.dense_bytes > 0)
        out.push_back({{mi, kDenseSlot},
                       m.users && operators ? kAfterExperts : kMust,
                       std::numeric_limits<double>::infinity(),
                       m.dense_bytes,
                       m.dense_locked});
    if (!m.heat) return;
    const uint32_t nl = m.heat->n_layers(), ne = m.heat->n_experts();
    const auto elite_n = static_cast<uint32_t>(std::ceil(s.elite_share * ne));
    std::vector<std::pair<double, uint32_t>> layer;
    for (uint32_t l = 0; l < nl; ++l) {
        layer.clear();
        for (uint32_t e = 0; e < ne; ++e) {
            const uint32_t slot = l * ne + e;
            const bool locked = m.locked[slot] != 0;
            if (m.pinned[slot]) {
                out.push_back({{mi, slot}, kMust, std::numeric_limits<double>::infinity(), m.slot_bytes[slot], locked});
                continue;
            }
            if (!m.in_vram.empty() && m.in_vram[slot]) {
                if (locked) out.push_back({{mi, slot}, kAfterExperts, 0.0, m.slot_bytes[slot], true, true});
                continue;
            }
            if (m.heat->uses(l, e) < s.admit_after_uses) {
                // Not admitted, but locked (a profile from an older run, a pin that was removed):
                // it competes like the rest so that it is released in its turn, not at once.
                if (locked)
                    out.push_back({{mi, slot},
                                   m.standby ? kStandbyRegular : kRegular,
                                   m.heat->heat(l, e) * (1 + s.hysteresis),
                                   m.slot_bytes[slot],
                                   true});
                continue;
            }
            layer.emplace_back(m.heat->heat(l, e), e);
        }
        const auto n_elite = std::min<size_t>(elite_n, layer.size());
        std::partial_sort(layer.begin(), layer.begin() + static_cast<ptrdiff_t>(n_elite), layer.end(),
                          [](const auto& a, const auto& b) { return a.first > b.first; });
        for (size_t i = 0; i < layer.size(); ++i) {
            const uint32_t slot = l * ne + layer[i].second;
            const bool locked = m.locked[slot] != 0;
            const double score = layer[i].first * (locked ? 1 + s.hysteresis : 1.0);
            const int klass =
                i < n_elite ? (m.standby ? kStandbyElite : kElite) : (m.standby ? kStandbyRegular : kRegular);
            out.push_back({{mi, slot}, klass, score, m.slot_bytes[slot], locked});
        }
    }
}

}  // namespace

Plan plan_placement(std::span<const ModelView> models, uint64_t global_cap, const PlannerSettings& s) {
    std::vector<Candidate> cands;
    const bool operators = std::any_of(models.begin(), models.end(), [](const ModelView& m) { return !m.users && !m.standby; });
    for (uint32_t mi = 0; mi < models.size(); ++mi) add_model(mi, models[mi], s, operators, cands);
    std::stable_sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
        return a.klass != b.klass ? a.klass < b.klass : a.score > b.score;
    });

    Plan p;
    std::vector<uint64_t> model_used(models.size(), 0);
    // Per family number: its cap (the smallest of its members') and what the plan gives it.
    std::map<uint32_t, std::pair<uint64_t, uint64_t>> family;
    for (const auto& m : models)
        if (m.family != std::numeric_limits<uint32_t>::max()) {
            auto [it, fresh] = family.try_emplace(m.family, m.family_budget, 0);
            if (!fresh) it->second.first = std::min(it->second.first, m.family_budget);
        }
    // The same per owner number: its budget and what the plan gives it.
    std::map<uint32_t, std::pair<uint64_t, uint64_t>> owner;
    for (const auto& m : models)
        if (m.owner != std::numeric_limits<uint32_t>::max()) {
            auto [it, fresh] = owner.try_emplace(m.owner, m.owner_budget, 0);
            if (!fresh) it->second.first = std::min(it->second.first, m.owner_budget);
        }
    std::vector<const Candidate*> not_kept;
    for (const auto& c : cands) {
        if (c.unwanted) {
            not_kept.push_back(&c);
            continue;
        }
        const auto& m = models[c.ref.model];
        auto* fam = m.family == std::numeric_limits<uint32_t>::max() ? nullptr : &family.at(m.family);
        auto* own = m.owner == std::numeric_limits<uint32_t>::max() ? nullptr : &owner.at(m.owner);
        const bool fits = p.planned_bytes + c.bytes <= global_cap && model_used[c.ref.model] + c.bytes <= m.budget &&
                          (!fam || fam->second + c.bytes <= fam->first) && (!own || own->second + c.bytes <= own->first);
        if (fits) {
            p.planned_bytes += c.bytes;
            model_used[c.ref.model] += c.bytes;
            if (fam) fam->second += c.bytes;
            if (own) own->second += c.bytes;
            if (!c.locked) p.lock.push_back(c.ref);
        } else if (c.locked) {
            not_kept.push_back(&c);
        }
    }
    // Everything locked that is not in the plan goes, coldest first.
    std::sort(not_kept.begin(), not_kept.end(), [](const Candidate* a, const Candidate* b) {
        return a->klass != b->klass ? a->klass > b->klass : a->score < b->score;
    });
    for (const auto* c : not_kept) p.release.push_back(c->ref);
    // Every locked expert is a candidate above; a locked dense part that is no longer wanted is not.
    for (uint32_t mi = 0; mi < models.size(); ++mi)
        if (models[mi].dense_locked && !models[mi].dense_wanted) p.release.insert(p.release.begin(), {mi, kDenseSlot});
    return p;
}

std::vector<uint32_t> pool_elite(const HeatTable& heat, const PlannerSettings& s, std::span<const uint8_t> held) {
    std::vector<uint32_t> out;
    const uint32_t ne = heat.n_experts();
    const auto elite = static_cast<size_t>(std::ceil(s.elite_share * ne));
    if (elite == 0) return out;
    std::vector<std::pair<double, uint32_t>> layer;
    for (uint32_t l = 0; l < heat.n_layers(); ++l) {
        layer.clear();
        for (uint32_t e = 0; e < ne; ++e)
            if (heat.uses(l, e) >= s.admit_after_uses) {
                const uint32_t slot = l * ne + e;
                const bool holds = slot < held.size() && held[slot] != 0;
                layer.emplace_back(holds ? heat.heat(l, e) * (1 + s.hysteresis) + s.move_margin : heat.heat(l, e), e);
            }
        const size_t k = std::min(elite, layer.size());
        std::partial_sort(layer.begin(), layer.begin() + static_cast<std::ptrdiff_t>(k), layer.end(),
                          [](const auto& a, const auto& b) { return a.first > b.first; });
        const size_t first = out.size();
        for (size_t i = 0; i < k; ++i) out.push_back(l * ne + layer[i].second);
        std::sort(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
    }
    return out;
}

std::vector<uint32_t> pool_wanted(const HeatTable& heat, const PlannerSettings& s, uint32_t capacity,
                                  std::span<const uint8_t> held) {
    const uint32_t ne = heat.n_experts();
    std::vector<uint32_t> elite = pool_elite(heat, s, held);
    std::vector<uint8_t> in(size_t{heat.n_layers()} * ne, 0);
    for (uint32_t slot : elite) in[slot] = 1;
    std::vector<std::pair<double, uint32_t>> rest;
    for (uint32_t l = 0; l < heat.n_layers(); ++l)
        for (uint32_t e = 0; e < ne; ++e)
            if (!in[l * ne + e] && heat.uses(l, e) >= s.admit_after_uses) {
                const uint32_t slot = l * ne + e;
                const bool holds = slot < held.size() && held[slot] != 0;
                rest.emplace_back(holds ? heat.heat(l, e) * (1 + s.hysteresis) + s.move_margin : heat.heat(l, e), slot);
            }
    const size_t more = capacity > elite.size() ? std::min<size_t>(capacity - elite.size(), rest.size()) : 0;
    std::partial_sort(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(more), rest.end(),
                      [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
    std::vector<std::pair<double, uint32_t>> out;
    out.reserve(elite.size() + more);
    for (uint32_t slot : elite) out.emplace_back(heat.heat(slot / ne, slot % ne), slot);
    out.insert(out.end(), rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(more));
    std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    // Never more than the pool holds: an elite larger than the directed part (a small pool, or a
    // recency split that leaves the hook most of it) would take the room of the hook's own part.
    if (out.size() > capacity) out.resize(capacity);
    std::vector<uint32_t> slots;
    slots.reserve(out.size());
    for (const auto& [h, slot] : out) slots.push_back(slot);
    return slots;
}

PoolDirected direct_pool(HeatTable& heat, PlannerSettings settings, bool one_place, double configured_directed,
                         double pool_experts, std::span<const uint8_t> held) {
    const uint32_t n_layers = std::max<uint32_t>(heat.n_layers(), 1);
    // The split is learnt at the largest pool of the model's clients.
    if (pool_experts / n_layers > heat.split_capacity(HeatTable::SplitFor::Pool))
        heat.set_split_capacity(pool_experts / n_layers, HeatTable::SplitFor::Pool);
    // Under one place the hook's own part would churn storage (each expert its LRU lets go has no RAM
    // copy left, and it admits only what is promoted): no recency share, and the whole pool is
    // directed.
    const PoolDirection dir =
        pool_direction(one_place, configured_directed, heat.recency_share(HeatTable::SplitFor::Pool));
    PoolDirected out;
    out.recency = dir.recency > 0;
    out.capacity = pool_directed_experts(pool_experts, dir.directed, dir.recency, dir.slack);
    settings.move_margin = one_place ? kOnePlaceMoveMargin : 0;
    out.wanted = pool_wanted(heat, settings, out.capacity, held);
    return out;
}

double ram_split_room(uint64_t lock_cap, uint64_t expert_bytes, uint32_t n_slots, uint32_t n_layers) {
    if (n_slots == 0 || n_layers == 0 || expert_bytes == 0) return 0;
    const double per_expert = static_cast<double>(expert_bytes) / n_slots;
    return static_cast<double>(std::min(lock_cap, expert_bytes)) / per_expert / n_layers;
}

uint64_t recency_cut_cap(uint64_t cap, uint64_t lock_cap, double share) {
    if (share <= 0) return cap;
    return std::min(cap, static_cast<uint64_t>(static_cast<double>(lock_cap) * (1.0 - share)));
}

}  // namespace moecache::daemon
