// Heat: how much each expert of a model is used, decayed over the model's token clock, so that
// what was hot long ago fades. Fed by telemetry (router decisions from clients, page-cache events
// from eBPF); read by the planner; saved as a profile keyed by (architecture, layer, expert).
// Three concerns, one each: the decayed counts (here), shift detection (ShiftDetector: a jump in
// how often cold experts are routed forgets the old hot set) and the recency split (SplitLearner:
// how much of a tier's room an LRU should hold). docs/policy.md says how they interact.
#pragma once

#include "moecache/daemon/shift_detector.h"
#include "moecache/daemon/split_learner.h"
#include "moecache/error.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moecache::daemon {

class HeatTable {
public:
    HeatTable() = default;
    HeatTable(uint32_t n_layers, uint32_t n_experts, double half_life_tokens);

    // One use of each of `experts` in MoE layer `layer` (0-based among the MoE layers) at the
    // current clock. The clock is the model's token count: advance it once per batch.
    void record(uint32_t layer, std::span<const uint32_t> experts, uint32_t weight = 1);
    // A batch's ranking (moecache/batch_report.h, its decisions of 0 tokens): one use more of each
    // of `experts`, part of the event recorded before it, at kRankingWeight of a routing's heat.
    // Neither the split learner nor shift detection counts it as a routing.
    void record_more(uint32_t layer, std::span<const uint32_t> experts) { add(layer, experts, kRankingWeight, false); }
    // More experts of the event recorded before it (a decision larger than one telemetry record
    // whose first part was read in an earlier turn): a routing's heat, no event of its own.
    void record_continued(uint32_t layer, std::span<const uint32_t> experts) { add(layer, experts, 1, false); }
    // The heat a batch's ranking adds at each of its levels, against a routing's 1. A prompt batch
    // ranks the layer's experts (an expert 8 times an even share of its tokens gets all six
    // levels); at 1 a level, a batch added up to 7 to its experts, and decode's routings, 1 a
    // token, were buried by a few prompts: the router trace recorded on the GPU machine (prompts
    // and decodes mixed) replayed 2.6 points below LFU at 50 % of RAM with 1, 0.3 with 1/4.
    static constexpr double kRankingWeight = 0.25;
    void advance_clock(uint64_t tokens) { clock_ += tokens; }

    [[nodiscard]] double heat(uint32_t layer, uint32_t expert) const;
    [[nodiscard]] uint32_t uses(uint32_t layer, uint32_t expert) const { return cells_[index(layer, expert)].uses; }
    [[nodiscard]] uint64_t clock() const { return clock_; }
    [[nodiscard]] uint32_t n_layers() const { return n_layers_; }
    [[nodiscard]] uint32_t n_experts() const { return n_experts_; }
    void set_half_life(double tokens) { half_life_ = tokens; }
    // Times the routing was seen to shift (the old heat was cut: see record()).
    [[nodiscard]] uint64_t shifts() const { return shift_.shifts(); }

    // Recency against frequency, learnt online for each tier the heat ranks (SplitLearner).
    using SplitFor = SplitLearner::Tier;
    void set_split_capacity(double experts_per_layer, SplitFor tier = SplitFor::Ram) {
        splits_.set_capacity(experts_per_layer, tier);
    }
    [[nodiscard]] double split_capacity(SplitFor tier = SplitFor::Ram) const { return splits_.capacity(tier); }
    // The share of the room for recency: 0 (all by heat, the default) to 1, one of kSplitShares.
    [[nodiscard]] double recency_share(SplitFor tier = SplitFor::Ram) const { return splits_.recency_share(tier); }
    static constexpr unsigned kSplits = SplitLearner::kSplits;
    static constexpr const auto& kSplitShares = SplitLearner::kShares;
    [[nodiscard]] double split_score(unsigned k, SplitFor tier = SplitFor::Ram) const { return splits_.score(k, tier); }

    // Profiles: JSON text {"key", "n_layers", "n_experts", "clock", "experts": [[layer, expert,
    // heat, uses], ...]} with heat decayed to the clock. Loading checks the shape.
    [[nodiscard]] std::string to_profile(const std::string& key) const;
    Result<void> load_profile(const std::string& text, const std::string& key, const std::string& where);

private:
    struct Cell {
        double heat = 0;
        uint64_t at = 0;  // clock when heat was last brought up to date
        uint32_t uses = 0;
    };
    [[nodiscard]] size_t index(uint32_t layer, uint32_t expert) const { return size_t{layer} * n_experts_ + expert; }
    [[nodiscard]] double decayed(const Cell& c) const;
    void add(uint32_t layer, std::span<const uint32_t> experts, double weight, bool event);
    void forget(double keep);  // every cell's heat times `keep`

    uint32_t n_layers_ = 0, n_experts_ = 0;
    ShiftDetector shift_;
    std::vector<double> layer_total_;  // decayed sum of the layer's heat, as of layer_at_
    std::vector<uint64_t> layer_at_;
    SplitLearner splits_;
    double half_life_ = 4096;
    uint64_t clock_ = 0;
    std::vector<Cell> cells_;
};

}  // namespace moecache::daemon
