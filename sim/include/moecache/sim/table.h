// The issue-9 table: for each trace (every preset's synthetic trace, and any recorded ones), the
// daemon's policy, with and without prediction, against LRU, LFU, a static hot set and Belady, in
// each tier at each budget, on the same trace in the same run; and whether the targets hold.
#pragma once

#include "moecache/sim/replay.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moecache::sim {

struct TableRow {
    std::string trace;
    std::string tier;  // "VRAM" (a device; RAM holds the whole model) or "RAM" (no device; storage below)
    double budget = 0;  // of the model's expert bytes
    SimResult moecache, predicted;
    std::vector<SimResult> baselines;  // LRU, LFU, static, Belady
    // On a synthetic trace, the most hits any placement of this budget can expect without seeing
    // the future (tracegen::bound_hit_rates: it knows the distribution each step is drawn from);
    // < 0: not known (a recorded trace).
    double bound = -1;
    // And the most a policy that learns the popularity from the routing can expect (the experts of
    // the most uses so far, counted anew at a shift it is told of: tracegen::learner_hit_rates);
    // < 0: not known (a recorded trace, or bursty routing, which is not a fixed popularity).
    double learner = -1;
    // Hits of the tier, counting what prediction staged there in time (its room is the tier's).
    [[nodiscard]] double tier_rate(const SimResult& r) const {
        return (tier == "VRAM" ? r.vram_hit_rate() : r.ram_hit_rate()) + r.staged_rate();
    }
    [[nodiscard]] const SimResult& baseline(Baseline b) const { return baselines[static_cast<size_t>(b)]; }
    // The policy the targets are for: moecache as it ships, without prediction (the daemon's is off
    // by default and the hook stages nothing: on the router trace recorded on the GPU machine
    // next-layer staging cost 0.4-1.0 points, and the daemon's next-token reads changed nothing
    // there; docs/sim.md). The +predict column is shown beside it.
    [[nodiscard]] const SimResult& policy() const { return moecache; }
    // (policy - LRU) / (Belady - LRU) in this tier; 1 where Belady does no better than LRU.
    [[nodiscard]] double gap_closed() const;
    // The share of that gap the bound (the learner) closes; < 0: none.
    [[nodiscard]] double bound_gap_closed() const;
    [[nodiscard]] double learner_gap_closed() const;
    // The policy's tier hit rate minus the better of LRU's and LFU's, in points.
    [[nodiscard]] double vs_best_points() const;
};

struct TraceSummary {
    std::string name;
    std::string stats;  // one line: skew, reuse, predictability
    Predictions next_layer, next_token;
};

struct TableOptions {
    std::vector<double> budgets{0.10, 0.25, 0.50};
    Setup base;  // links, tick, planner; the budgets come from `budgets`
    Predict predict = Predict::NextLayer;
    // The targets (issue 40): within max_points_below_best of the better of LRU and LFU on every
    // row; and where the trace's bound is known (a synthetic trace of a fixed popularity), within
    // max_points_below_bound of it, or at least min_room_closed of the way from the better of LRU
    // and LFU to the bound where that room is more than room_points. (Issue 22's target, 60 % of
    // the LRU-to-Belady gap, asked more than the bound itself closes on 32 of its 50 misses.)
    double max_points_below_best = 0.5;
    double max_points_below_bound = 1.0;
    double min_room_closed = 0.75;
    double room_points = 4.0;
};

// Every row for one trace's model.
std::vector<TableRow> table_rows(const std::string& name, const Trace& trace, const TraceModel& model,
                                 const TableOptions& opt, TraceSummary* summary = nullptr);

// The targets that a row misses, one line each (empty: all met).
std::vector<std::string> missed_targets(const TableRow& row, const TableOptions& opt);

// The rows as a Markdown table (hit rates, gap, bytes per token, modelled tokens/s).
std::string format_table(const std::vector<TableRow>& rows);

}  // namespace moecache::sim
