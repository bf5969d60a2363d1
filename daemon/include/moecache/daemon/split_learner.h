// Recency against frequency, learnt online (docs/policy.md), for each tier the
// heat ranks: a tier of `capacity` experts a layer (0: not learnt) is held as the hottest of each
// layer by heat plus, in the rest of its room, the most lately used of the others, all layers
// together (in RAM the page cache's LRU below the daemon's locks; in a VRAM pool the part the
// daemon does not direct, which the hook keeps as an LRU: cuda-hooks ExpertHeat::set_recency).
// Each router event is scored against every split of the room (kShares), as if the tier had held
// it so: the heat ranks as a placement last saw them, and for each split an LRU of its room
// replayed over the accesses its heat part would not have held (ARC's ghosts, one list per split
// rather than two sized by one). The split that held the most over the last ~kScoreEvents events
// is taken, one that gives recency a share only if it holds more than heat alone by a margin
// (kRamRecencyMargin, kPoolRecencyMargin). No feedback: what the tier held does not change the
// scores; a runtime's page-cache uses stand in for its routing only while none is reported
// (ModelEntry::last_routed, model_registry.h: they are the copies of what the pool missed then).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <vector>

namespace moecache::daemon {

class SplitLearner {
public:
    enum class Tier : unsigned { Ram = 0, Pool = 1 };
    // The splits scored: finer where recency's share is small, because the room an LRU needs is
    // what one token routes outside the heat part, a few experts a layer (bursty routing at 25 %
    // of RAM: 86.1 % held with 3 of 32 a layer to recency against 85.5 % with 8, the eighths' best).
    static constexpr unsigned kSplits = 11;
    static constexpr double kShares[kSplits] = {0,       1.0 / 32, 1.0 / 16, 3.0 / 32, 1.0 / 8, 3.0 / 16,
                                                1.0 / 4, 3.0 / 8,  1.0 / 2,  3.0 / 4,  1.0};
    // What a share for recency must hold more than heat alone to be taken, of the routed experts:
    // in RAM a point; in a pool three, because its LRU part copies every miss it admits (the hook's
    // fills), which the scores do not count.
    static constexpr double kRamRecencyMargin = 0.01, kPoolRecencyMargin = 0.03;

    SplitLearner() = default;
    SplitLearner(uint32_t n_layers, uint32_t n_experts) : n_layers_(n_layers), n_experts_(n_experts) {}

    void set_capacity(double experts_per_layer, Tier tier) {
        splits_[static_cast<unsigned>(tier)].capacity = experts_per_layer;
    }
    [[nodiscard]] double capacity(Tier tier) const { return splits_[static_cast<unsigned>(tier)].capacity; }
    [[nodiscard]] bool learning() const { return splits_[0].capacity > 0 || splits_[1].capacity > 0; }
    // The share of the room for recency: 0 (all by heat, the default) to 1, one of kShares.
    [[nodiscard]] double recency_share(Tier tier) const { return kShares[splits_[static_cast<unsigned>(tier)].k]; }
    [[nodiscard]] double score(unsigned k, Tier tier) const {
        return k < kSplits ? splits_[static_cast<unsigned>(tier)].score[k] : 0;
    }

    // One router event of `layer` at token `clock`. heat_of(e): expert e's heat in that layer now,
    // asked only when the layer's ranks are taken anew (every kRankTokens tokens).
    template <class HeatOf>
    void observe(uint32_t layer, std::span<const uint32_t> experts, uint64_t clock, HeatOf&& heat_of) {
        if (rank_due(layer, clock)) {
            std::vector<double> h(n_experts_);
            for (uint32_t e = 0; e < n_experts_; ++e) h[e] = heat_of(e);
            rank(layer, clock, h);
        }
        score_event(layer, experts, clock);
    }

private:
    // The heat ranks as the tier's locks last followed them: a placement runs about once a second
    // (20-50 tokens of decode), so the ranks are taken anew every kRankTokens tokens, not at each
    // event (the expert just routed would rank first at once, which no lock does).
    static constexpr uint64_t kRankTokens = 32;
    // The scores: running means over this many events.
    static constexpr uint64_t kScoreEvents = 4096;
    // The first move: after this many events and tokens scored (the ranks first taken with heat
    // behind them: score_event), a 32-layer model's 64 tokens either way. 256 events held bursty
    // routing of 12 layers 0.8 points better, but the ghost's heat part is per layer (C of each
    // layer, where the tier holds C x layers of any): where only some layers route (the root
    // tests' runtimes route one layer) it took recency at once and cut the locks and the pool's
    // direction to a quarter.
    static constexpr uint64_t kFirstEvents = 2048;
    static constexpr uint64_t kFirstTokens = 64;
    // Unless the lead is decisive: a split that holds this much more than heat alone, after
    // this many events scored, moves at once. Routing whose hot set moves every few tokens (the
    // qwen3-next-like model's, docs/routing.md) gives recency a 55-point lead by its 100th token,
    // and waiting for the 2048th event (~290 tokens of 8 layers) held the locks to an LFU-like set
    // for a fifth of the run: 9.6 points below LRU at 10 % of RAM.
    static constexpr uint64_t kDecisiveEvents = 64;
    static constexpr double kDecisiveLead = 0.2;
    // A move must change the held share by more than this (scores within it are noise).
    static constexpr double kMoveMin = 0.002;

    struct Lru {  // cells, most lately used first
        std::list<uint32_t> order;
        std::vector<std::list<uint32_t>::iterator> at;
        std::vector<uint8_t> in;
    };
    struct Split {
        double capacity = 0;   // experts per layer; 0: not learnt
        std::vector<Lru> lru;  // per split
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
    [[nodiscard]] size_t index(uint32_t layer, uint32_t expert) const { return size_t{layer} * n_experts_ + expert; }
    bool rank_due(uint32_t layer, uint64_t clock);
    void rank(uint32_t layer, uint64_t clock, const std::vector<double>& heat);
    void score_event(uint32_t layer, std::span<const uint32_t> experts, uint64_t clock);
    void score_split(Split& sp, uint32_t layer, std::span<const uint32_t> experts, uint64_t clock);

    uint32_t n_layers_ = 0, n_experts_ = 0;
    std::vector<uint32_t> rank_;     // per cell: its heat rank in its layer, as last taken
    std::vector<uint64_t> rank_at_;  // per layer: the clock then
    uint32_t routed_layers_ = 0;     // layers routed at least once: the ghosts' LRU room is theirs
    Split splits_[2] = {with_margin(kRamRecencyMargin), with_margin(kPoolRecencyMargin)};  // by Tier
};

}  // namespace moecache::daemon
