// The placement policy, first version: which experts (and dense parts) should be locked in RAM,
// given their heat, the pins, and the budgets. Pure: it reads a view of the state and returns a
// plan; the daemon carries it out. Order of claim on the budget:
//   1. pinned experts and the dense part of the operator's models that lock it (used by every token);
//   2. the elite: the hottest `elite_share` of each layer (among admitted experts);
//   3. everything admitted (used at least `admit_after_uses` times), hottest first, where a
//      locked expert counts `1 + hysteresis` times its heat so placements do not churn;
//   4. the dense part of models users registered, where an operator's model is in use (else 1);
//   5. the elite and then the rest of models on standby (no runtime uses them now), likewise.
// Budgets (the global cap, each model's, each family's and each owner's) are filled greedily in
// that order. An expert a VRAM
// pool holds is not wanted in RAM (one place), unless pinned.
#pragma once

#include "moecache/daemon/heat.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace moecache::daemon {

inline constexpr uint32_t kDenseSlot = std::numeric_limits<uint32_t>::max();

struct PlannerSettings {
    uint32_t admit_after_uses = 2;
    double elite_share = 0.125;
    double hysteresis = 0.25;
    // What an expert a pool is directed to hold counts on top of its `1 + hysteresis` times its
    // heat (pool_wanted), in heat (routed uses, decayed). 0, or kOnePlaceMoveMargin under one place.
    double move_margin = 0;
};

// Under one place an expert the pool gives up has no copy left in RAM: each change of the direction
// is a read from storage (7 MiB at ~1 GB/s: as long as ~50 copies from pinned RAM over PCIe), so a
// newcomer must also be hotter by a few uses, not only by a share. A share alone lets noise decide
// where heat is low: after a prompt-model swap the decode model starts from the prompt's heat (a few
// batch events an expert), and the first hundred tokens of decode, 2-8 uses an expert, re-ranked
// the pool's edge at every placement: 9 GB read from storage in 128 tokens, tokens 25-50 at half the
// speed of the later ones (GPU machine, 2026-12-02).
// With the ranking's batches weighted by how many tokens chose each expert (moecache/batch_report.h)
// a prompt's heat is of the scale of decode's, and 4 uses still moved the edge: 52 MiB read a token.
// A move costs a read of the expert let go (7 MiB) and its next use from storage, against ~0.3 ms a
// use saved by VRAM over registered RAM: it pays after tens of uses.
inline constexpr double kOnePlaceMoveMargin = 16.0;
// Under one place the daemon directs the whole pool (not [vram] directed) but this share of it: the
// hook then admits only what was promoted, so a part left to it would stay empty; the slack because
// the mean expert size the room is counted in may not fit the pool's slots exactly, and a fill that
// finds no free slot would let a promoted expert go to storage. A pool of fewer than 34 experts has
// none.
inline constexpr double kOnePlaceSlack = 0.03;

struct ModelView {
    const HeatTable* heat = nullptr;   // n_layers x n_experts
    std::vector<uint8_t> locked;       // per slot (layer * n_experts + expert): 1 if locked
    std::vector<uint8_t> pinned;       // per slot
    std::vector<uint8_t> in_vram;      // per slot, or empty: 1 if a VRAM pool holds it (not wanted in RAM)
    std::vector<uint64_t> slot_bytes;  // per slot: bytes locking it costs
    bool dense_wanted = false;
    bool dense_locked = false;
    uint64_t dense_bytes = 0;
    uint64_t budget = std::numeric_limits<uint64_t>::max();  // this model's cap
    // Models with the same family number share a cap: the smallest family_budget among them.
    uint32_t family = std::numeric_limits<uint32_t>::max();  // max: in no family
    uint64_t family_budget = std::numeric_limits<uint64_t>::max();
    // No runtime uses it now (no client registered it, no page of it used lately): its experts
    // rank after every expert of a model in use, so that a family member at rest (the prompt
    // model while the decode model runs) takes only what those leave. Its pins and dense part
    // keep their place.
    bool standby = false;
    // A model a user registered (not the operator's): where an operator's model is in use, its
    // dense part ranks after every expert, not before them (a user's sparse GGUF with a large dense
    // tensor took the cap and released the operator's experts); and all its parts count against
    // its owner's budget in the plan, with the other models of that owner (the same owner number).
    bool users = false;
    uint32_t owner = std::numeric_limits<uint32_t>::max();  // max: no owner's budget applies
    uint64_t owner_budget = std::numeric_limits<uint64_t>::max();
};

struct SlotRef {
    uint32_t model;
    uint32_t slot;  // kDenseSlot for the dense part
    bool operator==(const SlotRef&) const = default;
};

struct Plan {
    std::vector<SlotRef> lock;     // hottest first
    std::vector<SlotRef> release;  // coldest first
    uint64_t planned_bytes = 0;    // bytes of the whole desired set
};

Plan plan_placement(std::span<const ModelView> models, uint64_t global_cap, const PlannerSettings& s);

// What belongs in a VRAM pool: the elite of each layer (the hottest `elite_share`, among admitted
// experts), as slots in ascending order. The daemon promotes these in every client's pool; the
// pool's own policy fills the rest. `held` as pool_wanted's: what the pool holds now keeps its
// place against a newcomer by the same hysteresis and margin.
std::vector<uint32_t> pool_elite(const HeatTable& heat, const PlannerSettings& s, std::span<const uint8_t> held = {});

// What a client's pool is directed to hold: the elite of each layer, then the hottest admitted
// experts of any layer, `capacity` experts in all (the hottest of the elite where it is larger),
// hottest first. The hook
// fills its pool with them ahead of the runtime's copies (from what the daemon locks: a model's
// heat, saved or shared by its family, starts its pool warm) and ranks them above what it admits
// by itself; the rest of the pool follows the hook's own counts.
// `held`: per slot, 1 where the pool is directed to hold it now: it counts `1 + hysteresis` times
// its heat plus `move_margin`, so that the direction does not swing between experts of nearly equal
// heat (each swing is a fill, and under one place a read from storage).
std::vector<uint32_t> pool_wanted(const HeatTable& heat, const PlannerSettings& s, uint32_t capacity,
                                  std::span<const uint8_t> held = {});

// The share of a pool the daemon directs and the recency share it leaves the hook's LRU part, from
// [vram] directed and the pool's learnt split (HeatTable::recency_share(SplitFor::Pool)): under one
// place, all of it less kOnePlaceSlack, and none.
struct PoolDirection {
    double directed = 0, recency = 0, slack = 0;
};
[[nodiscard]] inline PoolDirection pool_direction(bool one_place, double configured, double learnt_recency) {
    if (configured <= 0) return {configured, 0.0, 0.0};
    if (one_place) return {1.0, 0.0, kOnePlaceSlack};
    return {configured, learnt_recency, 0.0};
}

// How many experts of a pool of `pool_experts` the daemon directs: its `directed` share, less the
// recency share and the slack.
[[nodiscard]] inline uint32_t pool_directed_experts(double pool_experts, double directed, double recency_share,
                                                    double slack = 0) {
    const double share = std::max(0.0, std::min(directed, 1.0 - recency_share));
    const auto n = static_cast<uint32_t>(share * pool_experts);
    const auto spare = static_cast<uint32_t>(slack * pool_experts);
    return n > spare ? n - spare : 0;
}

// One model's direction of one client's pool, as the daemon's direct_pools and moecache-sim make it:
// the pool's recency split learnt at the largest pool of the model (`pool_experts`, experts of the
// model's mean size), the share directed (pool_direction), and the slots wanted (pool_wanted, under
// one place with kOnePlaceMoveMargin), `held` what the pool was directed to hold before.
struct PoolDirected {
    std::vector<uint32_t> wanted;  // hottest first
    uint32_t capacity = 0;         // experts directed
    bool recency = false;          // the pool keeps its undirected part as an LRU (VramPolicy)
};
PoolDirected direct_pool(HeatTable& heat, PlannerSettings settings, bool one_place, double configured_directed,
                         double pool_experts, std::span<const uint8_t> held);

// RAM alone (no pool serves the model): the room the RAM recency split is learnt at, in experts a
// layer, for a lock cap of `lock_cap` bytes over a model of `expert_bytes` in `n_slots` experts of
// `n_layers` layers; and the model's cap once that split gives the page cache's LRU `share` of the
// lock cap (0: the cap as it is). The daemon's decide step and moecache-sim alike.
[[nodiscard]] double ram_split_room(uint64_t lock_cap, uint64_t expert_bytes, uint32_t n_slots, uint32_t n_layers);
[[nodiscard]] uint64_t recency_cut_cap(uint64_t cap, uint64_t lock_cap, double share);

}  // namespace moecache::daemon
