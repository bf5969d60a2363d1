#include "moecache/sim/baselines.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

namespace moecache::sim {

const char* name_of(Baseline b) {
    switch (b) {
        case Baseline::Lru: return "LRU";
        case Baseline::Lfu: return "LFU";
        case Baseline::Static: return "static";
        case Baseline::Belady: return "Belady";
    }
    return "?";
}

uint64_t AccessStream::total_bytes() const {
    return std::accumulate(layer_bytes.begin(), layer_bytes.end(), uint64_t{0}) * n_experts;
}

AccessStream accesses_of(const Trace& trace, const TraceModel& model) {
    AccessStream s;
    s.n_experts = model.n_experts;
    s.layer_bytes = model.bytes_per_expert;
    for (const auto& d : trace.decisions)
        if (d.model == model.id)
            for (uint32_t e : d.experts) s.items.push_back(d.layer * model.n_experts + e);
    return s;
}

namespace {

std::vector<uint8_t> static_hits(const AccessStream& s, uint64_t budget, uint64_t profile) {
    const size_t n_items = s.layer_bytes.size() * s.n_experts;
    std::vector<uint64_t> count(n_items, 0);
    const uint64_t learn = profile ? std::min<uint64_t>(profile, s.items.size()) : s.items.size() / 2;
    for (uint64_t i = 0; i < learn; ++i) ++count[s.items[i]];
    std::vector<uint32_t> order(n_items);
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return count[a] > count[b]; });
    std::vector<uint8_t> held(n_items, 0);
    uint64_t used = 0;
    for (uint32_t item : order) {
        if (count[item] == 0) break;
        if (used + s.bytes_of(item) > budget) continue;
        used += s.bytes_of(item);
        held[item] = 1;
    }
    std::vector<uint8_t> hit(s.items.size());
    for (size_t i = 0; i < s.items.size(); ++i) hit[i] = held[s.items[i]];
    return hit;
}

}  // namespace

std::vector<uint8_t> hits_of(const AccessStream& s, uint64_t budget, Baseline policy, uint64_t profile_accesses) {
    if (policy == Baseline::Static) return static_hits(s, budget, profile_accesses);
    const auto& items = s.items;
    const size_t n_items = s.layer_bytes.size() * s.n_experts;
    constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
    std::vector<uint64_t> next_use;
    if (policy == Baseline::Belady) {
        next_use.assign(items.size(), kNever);
        std::vector<uint64_t> seen(n_items, kNever);
        for (size_t i = items.size(); i-- > 0;) {
            next_use[i] = seen[items[i]];
            seen[items[i]] = i;
        }
    }
    // Victim order: the first element of `order` goes first. Keys per policy:
    //   LRU (last use), LFU (count, last use), Belady (-next use, i.e. furthest first).
    struct Key {
        uint64_t a, b;
        uint32_t item;
        bool operator<(const Key& o) const { return a != o.a ? a < o.a : b != o.b ? b < o.b : item < o.item; }
    };
    std::set<Key> order;
    std::vector<Key> key_of(n_items);
    std::vector<uint8_t> cached(n_items, 0);
    std::vector<uint64_t> count(n_items, 0);
    auto key_for = [&](uint32_t item, uint64_t now) -> Key {
        switch (policy) {
            case Baseline::Lru: return {now, 0, item};
            case Baseline::Lfu: return {count[item], now, item};
            case Baseline::Belady: return {kNever - next_use[now], 0, item};
            case Baseline::Static: break;
        }
        return {};
    };
    std::vector<uint8_t> hit(items.size(), 0);
    uint64_t used = 0;
    for (uint64_t now = 0; now < items.size(); ++now) {
        const uint32_t item = items[now];
        ++count[item];
        if (cached[item]) {
            hit[now] = 1;
            order.erase(key_of[item]);
            key_of[item] = key_for(item, now);
            order.insert(key_of[item]);
            continue;
        }
        const uint64_t size = s.bytes_of(item);
        if (size > budget) continue;  // served from below, never held
        const Key mine = key_for(item, now);
        if (policy == Baseline::Belady) {
            // Take it in only if something held is used later than it (or there is room).
            uint64_t room = budget - used;
            for (auto v = order.begin(); room < size && v != order.end() && v->a < mine.a; ++v) room += s.bytes_of(v->item);
            if (room < size) continue;
        }
        while (used + size > budget && !order.empty()) {
            const Key victim = *order.begin();
            order.erase(order.begin());
            cached[victim.item] = 0;
            used -= s.bytes_of(victim.item);
        }
        cached[item] = 1;
        key_of[item] = mine;
        order.insert(mine);
        used += size;
    }
    return hit;
}

Result<ReplayResult> replay(const Trace& trace, uint32_t model_id, uint64_t budget, Baseline policy) {
    const TraceModel* model = trace.model(model_id);
    if (!model) return failf("replay: the trace has no model {}", model_id);
    const AccessStream s = accesses_of(trace, *model);
    const auto hit = hits_of(s, budget, policy);
    ReplayResult r;
    r.accesses = s.items.size();
    for (size_t i = 0; i < hit.size(); ++i) {
        r.hits += hit[i];
        if (!hit[i]) r.bytes_in += s.bytes_of(s.items[i]);
    }
    return r;
}

}  // namespace moecache::sim
