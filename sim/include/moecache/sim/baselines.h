// Classic placement baselines replayed on a trace: one tier of `budget_bytes`, filled on demand,
// each expert (layer, expert) of one model an item of its layer's size. Every expert a decision
// names is one access; a miss moves the expert's bytes in. The yardsticks issue 9 measures the
// daemon's policy against:
//   LRU     evicts the least recently used;
//   LFU     evicts the least used so far (counts kept for every expert, cached or not; ties: the
//           least recently used);
//   Static  holds a fixed set: the most used experts of a profile (the counts of the trace's first
//           `profile_accesses`, as a profile of an earlier run of the same work would give),
//           hottest first while they fit; never moves;
//   Belady  evicts the expert used again furthest in the future, and does not take in one whose
//           next use is further than all it holds (hindsight: optimal for equal sizes).
// All four are stack policies (what a smaller tier holds, a larger one holds too), so a hierarchy
// of tiers is replayed as one tier per cumulative budget (sim/replay.h).
#pragma once

#include "moecache/sim/trace.h"

#include <cstdint>
#include <vector>

namespace moecache::sim {

enum class Baseline { Lru, Lfu, Static, Belady };
const char* name_of(Baseline b);

// One model's accesses in trace order: item = layer * n_experts + expert.
struct AccessStream {
    uint32_t n_experts = 0;
    std::vector<uint32_t> items;
    std::vector<uint64_t> layer_bytes;  // one expert's bytes, per layer
    [[nodiscard]] uint64_t bytes_of(uint32_t item) const { return layer_bytes[item / n_experts]; }
    [[nodiscard]] uint64_t total_bytes() const;  // of every expert of the model
};
AccessStream accesses_of(const Trace& trace, const TraceModel& model);

// Per access: 1 where it hits a tier of `budget` bytes under `policy`. `profile_accesses` is the
// prefix Static learns its set from (0: the first half).
std::vector<uint8_t> hits_of(const AccessStream& s, uint64_t budget, Baseline policy, uint64_t profile_accesses = 0);

struct ReplayResult {
    uint64_t accesses = 0;
    uint64_t hits = 0;
    uint64_t bytes_in = 0;  // moved into the tier on misses
    [[nodiscard]] double hit_rate() const { return accesses ? static_cast<double>(hits) / static_cast<double>(accesses) : 0.0; }
};

// Fails where the trace has no such model.
Result<ReplayResult> replay(const Trace& trace, uint32_t model, uint64_t budget_bytes, Baseline policy);

}  // namespace moecache::sim
