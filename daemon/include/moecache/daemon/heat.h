// Heat: how much each expert of a model is used, decayed over the model's token clock, so that
// what was hot long ago fades. Fed by telemetry (router decisions from clients, page-cache events
// from eBPF); read by the planner; saved as a profile keyed by (architecture, layer, expert).
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <list>
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
    [[nodiscard]] uint64_t shifts() const { return shifts_; }

    // Recency against frequency, learnt online, for each tier the heat ranks (SplitFor): a tier of
    // `experts_per_layer` experts a layer (0: not learnt) is held as the hottest of each layer by
    // heat plus, in the rest of its room, the most lately used of the others, all layers together
    // (in RAM the page cache's LRU below the daemon's locks; in a VRAM pool the part the daemon
    // does not direct, which the hook keeps as an LRU: cuda-hooks ExpertHeat::set_recency). Each
    // router event is scored against every split of the room (kSplitShares), as if the tier had
    // held it so: the heat ranks as a placement last saw them, and for each split an LRU of its
    // room replayed over the accesses its heat part would not have held (ARC's ghosts, one list
    // per split rather than two sized by one). The split that held the most over the last ~4096
    // events is taken, one that gives recency a share only if it holds more than heat alone by a
    // margin (kRamRecencyMargin, kPoolRecencyMargin). No feedback: what the tier held does not
    // change the scores; a runtime's page-cache uses stand in for its routing only while none is
    // reported (daemon_state.h, last_routed: they are the copies of what the pool missed then).
    enum class SplitFor : unsigned { Ram = 0, Pool = 1 };
    void set_split_capacity(double experts_per_layer, SplitFor tier = SplitFor::Ram) {
        splits_[static_cast<unsigned>(tier)].capacity = experts_per_layer;
    }
    [[nodiscard]] double split_capacity(SplitFor tier = SplitFor::Ram) const {
        return splits_[static_cast<unsigned>(tier)].capacity;
    }
    // The share of the room for recency: 0 (all by heat, the default) to 1, one of kSplitShares.
    [[nodiscard]] double recency_share(SplitFor tier = SplitFor::Ram) const {
        return kSplitShares[splits_[static_cast<unsigned>(tier)].k];
    }
    // The splits scored: finer where recency's share is small, because the room an LRU needs is
    // what one token routes outside the heat part, a few experts a layer (bursty routing at 25 %
    // of RAM: 86.1 % held with 3 of 32 a layer to recency against 85.5 % with 8, the eighths' best).
    static constexpr unsigned kSplits = 11;
    static constexpr double kSplitShares[kSplits] = {0,         1.0 / 32, 1.0 / 16, 3.0 / 32, 1.0 / 8, 3.0 / 16,
                                                     1.0 / 4,   3.0 / 8,  1.0 / 2,  3.0 / 4,  1.0};
    // What a share for recency must hold more than heat alone to be taken, of the routed experts:
    // in RAM a point; in a pool three, because its LRU part copies every miss it admits (the hook's
    // fills), which the scores do not count.
    static constexpr double kRamRecencyMargin = 0.01, kPoolRecencyMargin = 0.03;
    [[nodiscard]] double split_score(unsigned k, SplitFor tier = SplitFor::Ram) const {
        return k < kSplits ? splits_[static_cast<unsigned>(tier)].score[k] : 0;
    }

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
    void score_splits(uint32_t layer, std::span<const uint32_t> experts);
    struct Split;
    void score_split(Split& sp, uint32_t layer, std::span<const uint32_t> experts);

    uint32_t n_layers_ = 0, n_experts_ = 0;
    // Shift detection: how often a routed expert was among the colder half of its layer (below the
    // layer's mean heat), recently and over the long run; a jump forgets the old hot set.
    double surprise_fast_ = 0, surprise_slow_ = 0;
    uint64_t events_ = 0, quiet_until_ = 0, shifts_ = 0;
    std::vector<double> layer_total_;  // decayed sum of the layer's heat, as of layer_at_
    std::vector<uint64_t> layer_at_;
    // The recency splits (set_split_capacity): each split's share of routed experts it would have
    // held, a running mean over ~4096 events.
    static constexpr uint64_t kSplitRankTokens = 32;
    // The first move: after this many events and tokens scored (the ranks first taken with heat
    // behind them: score_splits), a 32-layer model's 64 tokens either way. 256 events held bursty
    // routing of 12 layers 0.8 points better, but the ghost's heat part is per layer (C of each
    // layer, where the tier holds C x layers of any): where only some layers route (the root
    // tests' runtimes route one layer) it took recency at once and cut the locks and the pool's
    // direction to a quarter.
    static constexpr uint64_t kSplitFirstEvents = 2048;
    static constexpr uint64_t kSplitFirstTokens = 64;
    // Unless the lead is decisive: a split that holds this much more than heat alone, after
    // this many events scored, moves at once. Routing whose hot set moves every few tokens (the
    // qwen3-next-like model's, docs/routing.md) gives recency a 55-point lead by its 100th token,
    // and waiting for the 2048th event (~290 tokens of 8 layers) held the locks to an LFU-like set
    // for a fifth of the run: 9.6 points below LRU at 10 % of RAM.
    static constexpr uint64_t kSplitDecisiveEvents = 64;
    static constexpr double kSplitDecisiveLead = 0.2;
    std::vector<uint32_t> split_rank_;     // per cell: its heat rank in its layer, as last taken
    std::vector<uint64_t> split_rank_at_;  // per layer: the clock then
    uint32_t routed_layers_ = 0;          // layers routed at least once: the ghosts' LRU room is theirs
    struct Lru {  // cells, most lately used first
        std::list<uint32_t> order;
        std::vector<std::list<uint32_t>::iterator> at;
        std::vector<uint8_t> in;
    };
    struct Split {
        double capacity = 0;          // experts per layer; 0: not learnt
        std::vector<Lru> lru;         // per split
        double score[kSplits] = {};
        uint64_t events = 0;
        uint64_t first_clock = 0;  // the clock at the first event scored
        unsigned k = 0;
        double recency_margin = kRamRecencyMargin;
    };
    static Split with_margin(double m) {
        Split s;
        s.recency_margin = m;
        return s;
    }
    Split splits_[2] = {with_margin(kRamRecencyMargin), with_margin(kPoolRecencyMargin)};  // by SplitFor
    double half_life_ = 4096;
    uint64_t clock_ = 0;
    std::vector<Cell> cells_;
};

}  // namespace moecache::daemon
