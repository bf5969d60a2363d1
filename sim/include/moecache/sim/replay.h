// moecache-sim's replay: one model of a trace through a hierarchy of tiers — VRAM (a device's
// expert pool), RAM (host memory), storage — under a placement policy, with the bytes each access
// and each move puts on each link, and the tokens/s that gives.
//
// The policy "moecache" is the real code, not a copy: the daemon's heat table, its loop turn's
// decide step (decide_turn: the planner, the budgets, reads and then locks of at most 512 MiB a
// turn) and pool directives (daemon/src/policy) decide what RAM holds and what the pool keeps
// promoted, every `tick_seconds` of trace time as the daemon does; the CUDA hook's VRAM pool and its local heat
// (cuda-hooks/src/vram_pool.cpp) admit and evict on every access. What the planner does not lock
// the kernel's page cache holds, modelled as LRU over the rest of the RAM budget. One place: an
// expert the pool admits is unlocked (the daemon's keep_ram_copy = false); its pages, which the
// runtime maps, stay cached as the first the kernel reclaims.
//
// The baselines (LRU, LFU, static, Belady: sim/baselines.h) are stack policies, so a hierarchy is
// the same policy at each cumulative budget: VRAM holds what a tier of the VRAM budget would,
// RAM the rest of what a tier of both budgets would.
//
// Costs. Every used expert is read once by the computation, from device memory (with a device) or
// host memory (without). Where it is not in the tier the computation reads from, it is moved there
// on the token's critical path: storage -> host (storage link), host -> device (H2D, pageable
// unless `pinned`), pool -> the runtime's buffer (D2D). What a policy moves ahead — the planner's
// locks, prefetched predictions — shares the links but not the critical path. Modelled time is the
// larger of the critical path and the busiest link.
#pragma once

#include "moecache/daemon/planner.h"
#include "moecache/sim/baselines.h"
#include "moecache/sim/trace.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moecache::sim {

struct Links {  // bytes per second
    double storage = 1.7e9;
    double h2d_pageable = 10e9;
    double h2d_pinned = 47e9;
    double d2d = 1.9e12;
    double host_memory = 20e9;     // what a CPU computation reads weights at
    double device_memory = 4.8e12;  // ... and a GPU one
    bool pinned = false;           // host -> device copies come from pinned memory
};

struct Setup {
    uint64_t vram_bytes = 0;  // 0: no device; the computation runs where RAM holds the experts
    uint64_t ram_bytes = 0;
    Links links;
    double tick_seconds = 1.0;  // how often the daemon plans, in trace time
    daemon::PlannerSettings planner;
    double half_life_tokens = 4096;
    // The share of the VRAM pool the daemon directs (daemon::direct_pool: its hottest experts, filled
    // from RAM ahead of use, as the hook does; the daemon's [vram] directed); 0: nothing directed,
    // the pool admits on use.
    double pool_directed = 0.9;
    [[nodiscard]] bool device() const { return vram_bytes > 0; }
};

struct Moved {
    uint64_t storage = 0, h2d = 0, d2d = 0;
    Moved& operator+=(const Moved& o) {
        storage += o.storage;
        h2d += o.h2d;
        d2d += o.d2d;
        return *this;
    }
    [[nodiscard]] uint64_t total() const { return storage + h2d + d2d; }
};

// Per decision of the model (trace order): the experts staged ahead for it by prediction.
struct Predictions {
    std::string mode;  // "next-layer", "next-token", "both"
    std::vector<std::vector<uint32_t>> staged;
    uint64_t predicted = 0, correct = 0, actual = 0;  // over every decision that had a prediction
    uint64_t most_staged = 0;                         // experts staged for one decision, at most
    [[nodiscard]] double precision() const { return predicted ? static_cast<double>(correct) / static_cast<double>(predicted) : 0.0; }
    [[nodiscard]] double recall() const { return actual ? static_cast<double>(correct) / static_cast<double>(actual) : 0.0; }
};
enum class Predict { NextLayer, NextToken, Both };
// Runs the daemon's RoutePredictor over the model's decisions in order (it learns as it goes) and
// stages, for each decision, `k` experts per prediction (0: the model's experts per decision).
// Precision and recall count every prediction; staging follows daemon::PredictionTrust (30 % of
// what it named used, after 64 predictions): where routing is not predictable, nothing is staged.
// What prediction stages sits in the tier the computation reads from; it may take this share of
// that tier's budget, for as many of the best predictions as fit (none where not one does).
inline constexpr double kStagingShare = 1.0 / 32;
Predictions predict(const Trace& trace, const TraceModel& model, Predict mode, uint32_t k = 0);

struct SimResult {
    std::string policy;
    uint64_t accesses = 0, tokens = 0;
    uint64_t vram_hits = 0, ram_hits = 0, staged_hits = 0;  // staged: in no tier, but prefetched in time
    Moved demand, ahead;
    double critical_seconds = 0, busiest_link_seconds = 0;
    [[nodiscard]] double seconds() const { return std::max(critical_seconds, busiest_link_seconds); }
    [[nodiscard]] double tokens_per_second() const { return seconds() > 0 ? static_cast<double>(tokens) / seconds() : 0.0; }
    [[nodiscard]] double vram_hit_rate() const { return rate(vram_hits); }
    [[nodiscard]] double ram_hit_rate() const { return rate(ram_hits); }
    [[nodiscard]] double staged_rate() const { return rate(staged_hits); }
    [[nodiscard]] double bytes_per_token() const {
        return tokens ? static_cast<double>(demand.total() + ahead.total()) / static_cast<double>(tokens) : 0.0;
    }

private:
    [[nodiscard]] double rate(uint64_t n) const { return accesses ? static_cast<double>(n) / static_cast<double>(accesses) : 0.0; }
};

SimResult simulate_baseline(const Trace& trace, const TraceModel& model, const Setup& setup, Baseline policy);
// `staged`, when given, is what prediction prefetches for each decision.
SimResult simulate_moecache(const Trace& trace, const TraceModel& model, const Setup& setup,
                            const Predictions* staged = nullptr);

}  // namespace moecache::sim
