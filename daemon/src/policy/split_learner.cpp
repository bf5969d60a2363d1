#include "moecache/daemon/split_learner.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moecache::daemon {

bool SplitLearner::rank_due(uint32_t layer, uint64_t clock) {
    const size_t cells = size_t{n_layers_} * n_experts_;
    if (rank_.size() != cells) {
        rank_.assign(cells, 0);
        rank_at_.assign(n_layers_, UINT64_MAX);
        routed_layers_ = 0;
    }
    return rank_at_[layer] == UINT64_MAX || clock - rank_at_[layer] >= kRankTokens;
}

void SplitLearner::rank(uint32_t layer, uint64_t clock, const std::vector<double>& heat) {
    if (rank_at_[layer] == UINT64_MAX) ++routed_layers_;
    rank_at_[layer] = clock;
    std::vector<uint32_t> order(n_experts_);
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(),
              [&](uint32_t a, uint32_t b) { return heat[a] > heat[b] || (heat[a] == heat[b] && a < b); });
    uint32_t* r = &rank_[index(layer, 0)];
    for (uint32_t i = 0; i < n_experts_; ++i) r[order[i]] = i;
}

void SplitLearner::score_event(uint32_t layer, std::span<const uint32_t> experts, uint64_t clock) {
    // Nothing is scored on ranks taken before the first kRankTokens tokens: heat has not yet told
    // the experts apart, and the heat part's ghost would hold whatever ranked first at zero
    // (recency then looks better than it is: at a first move after 256 events, prompt batches at
    // 25 % of RAM went to pure LRU for ~100 tokens and lost 0.6 points).
    if (rank_at_[layer] < kRankTokens) return;
    for (auto& sp : splits_)
        if (sp.capacity > 0) score_split(sp, layer, experts, clock);
}

// For split k: F = (1 - kShares[k]) C experts of each layer held by heat, and an LRU of the
// (C - F) x layers experts' room over the accesses to the others. A routed expert is held if its
// heat ranks under F, or if that LRU holds it; then it is the LRU's most lately used.
void SplitLearner::score_split(Split& sp, uint32_t layer, std::span<const uint32_t> experts, uint64_t clock) {
    const uint32_t n = n_experts_;
    const double cap = std::min(sp.capacity, static_cast<double>(n));
    if (sp.lru.empty()) {
        sp.lru.assign(kSplits, Lru{});
        for (auto& l : sp.lru) {
            l.at.resize(rank_.size());
            l.in.assign(rank_.size(), 0);
        }
    }
    const uint32_t* rank = &rank_[index(layer, 0)];
    uint32_t by_heat[kSplits];
    size_t room[kSplits];
    for (unsigned k = 0; k < kSplits; ++k) {
        by_heat[k] = static_cast<uint32_t>(std::lround((1.0 - kShares[k]) * cap));
        // The tier holds `cap` of each layer that routes: a model routing some of its layers (a
        // runtime that offloads the rest) gives the LRU part no room of the others.
        room[k] = static_cast<size_t>(std::max(0.0, (cap - by_heat[k]) * std::max<uint32_t>(routed_layers_, 1)));
    }
    uint32_t held[kSplits] = {}, seen = 0;
    for (uint32_t e : experts) {
        if (e >= n) continue;
        ++seen;
        const auto cell = static_cast<uint32_t>(index(layer, e));
        for (unsigned k = 0; k < kSplits; ++k) {
            if (rank[e] < by_heat[k]) {
                ++held[k];
                continue;
            }
            Lru& l = sp.lru[k];
            if (l.in[cell]) {
                ++held[k];
                l.order.splice(l.order.begin(), l.order, l.at[cell]);
                continue;
            }
            if (room[k] == 0) continue;
            l.order.push_front(cell);
            l.at[cell] = l.order.begin();
            l.in[cell] = 1;
            while (l.order.size() > room[k]) {
                l.in[l.order.back()] = 0;
                l.order.pop_back();
            }
        }
    }
    if (seen == 0) return;
    if (sp.events++ == 0) sp.first_clock = clock;
    const double w = 1.0 / static_cast<double>(std::min<uint64_t>(sp.events, kScoreEvents));
    unsigned best = sp.k;
    for (unsigned k = 0; k < kSplits; ++k) {
        sp.score[k] += (static_cast<double>(held[k]) / seen - sp.score[k]) * w;
        if (sp.score[k] > sp.score[best]) best = k;
    }
    // Recency only where it clearly pays: a split with a share for it must hold recency_margin more
    // than heat alone (on routings without temporal locality the splits differ by noise, and a
    // share cut for nothing costs more than the scores show: what leaves RAM's locks is read
    // again, and a pool's LRU part admits every miss it sees, a copy each).
    if (best != 0 && sp.score[best] < sp.score[0] + sp.recency_margin) best = 0;
    const bool decisive = sp.events >= kDecisiveEvents && sp.score[best] > sp.score[0] + kDecisiveLead;
    const bool first_due = sp.events >= kFirstEvents && clock - sp.first_clock >= kFirstTokens;
    if ((decisive || first_due) && best != sp.k && std::abs(sp.score[best] - sp.score[sp.k]) > kMoveMin) sp.k = best;
}

}  // namespace moecache::daemon
