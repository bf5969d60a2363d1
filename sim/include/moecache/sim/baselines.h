// Classic placement baselines replayed on a trace: one tier of `budget_bytes`, filled on demand,
// each expert (layer, expert) of one model an item of its layer's size. Every expert a decision
// names is one access; a miss moves the expert's bytes in. The yardsticks issue 9 measures the
// daemon's policy against:
//   LRU     evicts the least recently used;
//   LFU     evicts the least used so far (counts kept for every expert, cached or not; ties: the
//           least recently used);
//   Belady  evicts the expert used again furthest in the future, and does not take in one whose
//           next use is further than all it holds (hindsight: optimal for equal sizes).
#pragma once

#include "moecache/sim/trace.h"

#include <cstdint>

namespace moecache::sim {

enum class Baseline { Lru, Lfu, Belady };
const char* name_of(Baseline b);

struct ReplayResult {
    uint64_t accesses = 0;
    uint64_t hits = 0;
    uint64_t bytes_in = 0;  // moved into the tier on misses
    [[nodiscard]] double hit_rate() const { return accesses ? static_cast<double>(hits) / static_cast<double>(accesses) : 0.0; }
};

// Fails where the trace has no such model.
Result<ReplayResult> replay(const Trace& trace, uint32_t model, uint64_t budget_bytes, Baseline policy);

}  // namespace moecache::sim
