#include "moecache/sim/baselines.h"

#include <limits>
#include <list>
#include <set>
#include <unordered_map>
#include <vector>

namespace moecache::sim {

const char* name_of(Baseline b) {
    switch (b) {
        case Baseline::Lru: return "LRU";
        case Baseline::Lfu: return "LFU";
        case Baseline::Belady: return "Belady";
    }
    return "?";
}

Result<ReplayResult> replay(const Trace& trace, uint32_t model_id, uint64_t budget, Baseline policy) {
    const TraceModel* model = trace.model(model_id);
    if (!model) return failf("replay: the trace has no model {}", model_id);
    const uint64_t n_experts = model->n_experts;
    // The access stream: item = layer * n_experts + expert.
    std::vector<uint64_t> items;
    for (const auto& d : trace.decisions)
        if (d.model == model_id)
            for (uint32_t e : d.experts) items.push_back(uint64_t{d.layer} * n_experts + e);
    auto size_of = [&](uint64_t item) { return model->bytes_per_expert[item / n_experts]; };
    constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
    std::vector<uint64_t> next_use(items.size(), kNever);
    if (policy == Baseline::Belady) {
        std::unordered_map<uint64_t, uint64_t> seen;
        for (size_t i = items.size(); i-- > 0;) {
            const auto it = seen.find(items[i]);
            next_use[i] = it == seen.end() ? kNever : it->second;
            seen[items[i]] = i;
        }
    }
    ReplayResult r;
    uint64_t used = 0;
    // Victim order: the first element of `order` goes first. Keys per policy:
    //   LRU (last use), LFU (count, last use), Belady (-next use, i.e. furthest first).
    struct Key {
        uint64_t a, b;
        uint64_t item;
        bool operator<(const Key& o) const { return a != o.a ? a < o.a : b != o.b ? b < o.b : item < o.item; }
    };
    std::set<Key> order;
    std::unordered_map<uint64_t, Key> cached;
    std::unordered_map<uint64_t, uint64_t> count;
    auto key_for = [&](uint64_t item, uint64_t now) -> Key {
        switch (policy) {
            case Baseline::Lru: return {now, 0, item};
            case Baseline::Lfu: return {count[item], now, item};
            case Baseline::Belady: return {kNever - next_use[now], 0, item};
        }
        return {};
    };
    for (uint64_t now = 0; now < items.size(); ++now) {
        const uint64_t item = items[now];
        ++r.accesses;
        ++count[item];
        if (auto it = cached.find(item); it != cached.end()) {
            ++r.hits;
            order.erase(it->second);
            it->second = key_for(item, now);
            order.insert(it->second);
            continue;
        }
        const uint64_t size = size_of(item);
        r.bytes_in += size;
        if (size > budget) continue;  // served from below, never held
        const Key mine = key_for(item, now);
        if (policy == Baseline::Belady) {
            // Take it in only if something held is used later than it (or there is room).
            uint64_t room = budget - used;
            for (auto v = order.begin(); room < size && v != order.end() && v->a < mine.a; ++v) room += size_of(v->item);
            if (room < size) continue;
        }
        while (used + size > budget && !order.empty()) {
            const Key victim = *order.begin();
            order.erase(order.begin());
            cached.erase(victim.item);
            used -= size_of(victim.item);
        }
        cached[item] = mine;
        order.insert(mine);
        used += size;
    }
    return r;
}

}  // namespace moecache::sim
