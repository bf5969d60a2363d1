// The heat table's shift detection: when the routing changes (a topic, a language, a new client),
// the experts of the new distribution rank above the old hot set within a few hundred tokens, not
// the half-life's thousands; a routing that only fluctuates around one distribution forgets nothing.
// Its split between recency and frequency: routing with temporal locality (a layer keeping its
// previous token's experts) gives the page cache's LRU a share; a stationary routing none.
#include "moecache/daemon/heat.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace moecache::daemon {
namespace {

constexpr uint32_t kLayers = 4, kExperts = 64, kUsed = 8;

// One token: every layer routes to kUsed distinct experts drawn from a Zipf-like popularity over
// `order` (order[0] the most popular).
void token(HeatTable& h, std::mt19937& rng, const std::vector<uint32_t>& order) {
    std::vector<double> w(kExperts);
    for (uint32_t r = 0; r < kExperts; ++r) w[r] = 1.0 / std::pow(r + 1.0, 1.2);
    for (uint32_t l = 0; l < kLayers; ++l) {
        std::vector<uint32_t> picked;
        std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
        while (picked.size() < kUsed) {
            const uint32_t e = order[pick(rng)];
            if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
        }
        h.record(l, picked);
    }
    h.advance_clock(1);
}

// How many of `hot` (the new distribution's top 8) are among the table's top 8 of layer 0.
int top_overlap(const HeatTable& h, const std::vector<uint32_t>& hot) {
    std::vector<std::pair<double, uint32_t>> r;
    for (uint32_t e = 0; e < kExperts; ++e) r.emplace_back(h.heat(0, e), e);
    std::sort(r.begin(), r.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    int n = 0;
    for (int i = 0; i < 8; ++i) n += std::count(hot.begin(), hot.begin() + 8, r[i].second) > 0 ? 1 : 0;
    return n;
}

TEST(HeatShift, ANewDistributionTakesTheTopWithinAFewHundredTokens) {
    HeatTable h(kLayers, kExperts, 4096);
    std::mt19937 rng(5);
    std::vector<uint32_t> before(kExperts), after(kExperts);
    for (uint32_t e = 0; e < kExperts; ++e) before[e] = after[e] = e;
    std::shuffle(after.begin(), after.end(), rng);
    for (int t = 0; t < 3000; ++t) token(h, rng, before);
    EXPECT_GE(top_overlap(h, before), 6);
    for (int t = 0; t < 400; ++t) token(h, rng, after);
    // Without forgetting, 3000 tokens of the old distribution against 400 of the new (half-life
    // 4096) keep most of the old top: the new one has only begun to show.
    EXPECT_GE(top_overlap(h, after), 6) << "the old hot set is still on top 400 tokens after the shift";
    EXPECT_GE(h.shifts(), 1u);
}

TEST(HeatShift, ASteadyDistributionIsNotForgotten) {
    HeatTable h(kLayers, kExperts, 4096);
    std::mt19937 rng(9);
    std::vector<uint32_t> order(kExperts);
    for (uint32_t e = 0; e < kExperts; ++e) order[e] = e;
    for (int t = 0; t < 1000; ++t) token(h, rng, order);
    const double hottest = h.heat(0, 0);
    for (int t = 0; t < 6000; ++t) token(h, rng, order);
    // Decay alone over 6000 more tokens, the same distribution: the top expert's heat converges to
    // its rate times 4096 / ln 2 and does not fall by a forgetting's 4x on the way.
    double low = hottest;
    EXPECT_GT(h.heat(0, 0), 0.8 * hottest);
    for (int t = 0; t < 2000; ++t) {
        token(h, rng, order);
        low = std::min(low, h.heat(0, 0));
    }
    EXPECT_GT(low, 0.6 * hottest) << "a steady routing was taken for a shift";
    EXPECT_EQ(h.shifts(), 0u);
}

// A batch's ranking (moecache/batch_report.h: its reports of 0 tokens) is heat, not routing: the
// experts it names rank by it, but a steady routing with such rankings of cold experts between its
// tokens is not taken for a shift, as the same experts routed would be.
TEST(HeatShift, ABatchsRankingAddsHeatButIsNotARouting) {
    std::vector<uint32_t> order(kExperts), cold;
    for (uint32_t e = 0; e < kExperts; ++e) order[e] = e;
    for (uint32_t e = kExperts / 2; e < kExperts; e += 4) cold.push_back(e);  // 8 of the colder half
    auto run = [&](bool as_routing) {
        HeatTable h(kLayers, kExperts, 4096);
        std::mt19937 rng(9);
        for (int t = 0; t < 6000; ++t) {
            token(h, rng, order);
            if (t >= 5000)
                for (uint32_t l = 0; l < kLayers; ++l) {
                    if (as_routing) h.record(l, cold);
                    else h.record_more(l, cold);
                }
        }
        return h;
    };
    const HeatTable more = run(false);
    EXPECT_EQ(more.shifts(), 0u) << "a batch's ranking was counted as routing to cold experts";
    EXPECT_GT(more.heat(0, cold[0]), more.heat(0, cold[0] + 1) + 100) << "the ranking added no heat";
    EXPECT_GE(run(true).shifts(), 1u) << "the same experts routed: a shift (the test's premise)";
}

// Bursty routing: with probability `keep` a layer keeps its previous token's experts but one (a
// fresh Zipf draw in its place), else it routes afresh.
void bursty_token(HeatTable& h, std::mt19937& rng, std::vector<std::vector<uint32_t>>& prev, double keep) {
    std::vector<double> w(kExperts);
    for (uint32_t r = 0; r < kExperts; ++r) w[r] = 1.0 / std::pow(r + 1.0, 1.2);
    std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
    std::bernoulli_distribution kept(keep);
    for (uint32_t l = 0; l < kLayers; ++l) {
        std::vector<uint32_t> picked;
        if (!prev[l].empty() && kept(rng)) picked.assign(prev[l].begin(), prev[l].end() - 1);
        while (picked.size() < kUsed) {
            const uint32_t e = pick(rng);
            if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
        }
        std::shuffle(picked.begin(), picked.end(), rng);
        h.record(l, picked);
        prev[l] = picked;
    }
    h.advance_clock(1);
}

TEST(HeatSplit, ABurstyRoutingGivesThePageCachesLruAShare) {
    HeatTable h(kLayers, kExperts, 4096);
    h.set_split_capacity(16);  // a quarter of each layer's experts
    std::mt19937 rng(3);
    std::vector<std::vector<uint32_t>> prev(kLayers);
    for (int t = 0; t < 3000; ++t) bursty_token(h, rng, prev, 0.6);
    EXPECT_GT(h.recency_share(), 0.0) << "heat alone " << h.split_score(0) << ", an eighth to recency " << h.split_score(4)
                                      << ", a quarter " << h.split_score(6);
    ASSERT_EQ(HeatTable::kSplitShares[6], 0.25);
    EXPECT_GT(h.split_score(6), h.split_score(0) + 0.05) << "a quarter of the room as an LRU holds more of this routing";
}

TEST(HeatSplit, AStationaryRoutingKeepsEveryLockToHeat) {
    HeatTable h(kLayers, kExperts, 4096);
    h.set_split_capacity(16);
    std::mt19937 rng(4);
    std::vector<uint32_t> order(kExperts);
    for (uint32_t e = 0; e < kExperts; ++e) order[e] = e;
    for (int t = 0; t < 3000; ++t) token(h, rng, order);
    EXPECT_EQ(h.recency_share(), 0.0) << "heat alone " << h.split_score(0) << ", an eighth to recency " << h.split_score(4);
}

// The same learner at a VRAM pool's size, beside RAM's: each tier its own split from the same
// events, learnt only where the tier's room is set (the pool's here, RAM's not).
TEST(HeatSplit, APoolLearnsItsOwnSplitBesideRams) {
    HeatTable h(kLayers, kExperts, 4096);
    h.set_split_capacity(16, HeatTable::SplitFor::Pool);
    std::mt19937 rng(3);
    std::vector<std::vector<uint32_t>> prev(kLayers);
    for (int t = 0; t < 3000; ++t) bursty_token(h, rng, prev, 0.6);
    EXPECT_GT(h.recency_share(HeatTable::SplitFor::Pool), 0.0)
        << "heat alone " << h.split_score(0, HeatTable::SplitFor::Pool) << ", a quarter to recency "
        << h.split_score(6, HeatTable::SplitFor::Pool);
    EXPECT_EQ(h.recency_share(), 0.0) << "RAM has no room set: nothing learnt for it";
    EXPECT_EQ(h.split_score(0), 0.0);
    EXPECT_EQ(h.split_capacity(HeatTable::SplitFor::Pool), 16.0);
}

// The split taken is the best scored (within the move's threshold), and the shares are fine
// where recency's is small: on this bursty routing the best split gives recency 3/16 of a room of
// 24, which the eighths could not say. A pool and RAM of the same room take the same
// split from the same events (the hook's recency part is an LRU: vram_pool.cpp).
TEST(HeatSplit, TheBestScoredSplitIsTakenAndBothTiersAgree) {
    HeatTable h(kLayers, kExperts, 4096);
    h.set_split_capacity(24, HeatTable::SplitFor::Pool);
    h.set_split_capacity(24, HeatTable::SplitFor::Ram);
    std::mt19937 rng(3);
    std::vector<std::vector<uint32_t>> prev(kLayers);
    for (int t = 0; t < 3000; ++t) bursty_token(h, rng, prev, 0.6);
    std::string scores;
    double best = 0;
    unsigned best_k = 0;
    for (unsigned k = 0; k < HeatTable::kSplits; ++k) {
        scores += fmt::format(" {:.3f}", h.split_score(k));
        if (h.split_score(k) > best) best = h.split_score(k), best_k = k;
    }
    const double ram = h.recency_share(), pool = h.recency_share(HeatTable::SplitFor::Pool);
    EXPECT_GT(ram, 0.0) << "the routing's recency pays (the test's premise):" << scores;
    EXPECT_EQ(pool, ram) << scores;
    unsigned taken = 0;
    while (HeatTable::kSplitShares[taken] != ram) ++taken;
    EXPECT_GE(h.split_score(taken), best - 0.002) << "took share " << ram << ":" << scores;
    const double eighths = HeatTable::kSplitShares[best_k] * 8;
    EXPECT_NE(eighths, std::floor(eighths)) << "the best split here is one the eighths lack:" << scores;
}

// The first tokens are not scored: the heat ranks are taken every 32 tokens, and before the first
// ranks with heat behind them the heat part would hold whatever ranked first at zero.
TEST(HeatSplit, NothingIsScoredBeforeTheRanksMeanSomething) {
    HeatTable h(kLayers, kExperts, 4096);
    h.set_split_capacity(16);
    std::mt19937 rng(3);
    std::vector<std::vector<uint32_t>> prev(kLayers);
    for (int t = 0; t < 32; ++t) bursty_token(h, rng, prev, 0.6);
    for (unsigned k = 0; k < HeatTable::kSplits; ++k) EXPECT_EQ(h.split_score(k), 0.0) << "split " << k;
    for (int t = 0; t < 40; ++t) bursty_token(h, rng, prev, 0.6);
    EXPECT_GT(h.split_score(0), 0.0);
}

TEST(HeatSplit, NothingIsLearntWithoutARoom) {
    HeatTable h(kLayers, kExperts, 4096);
    std::mt19937 rng(3);
    std::vector<std::vector<uint32_t>> prev(kLayers);
    for (int t = 0; t < 1000; ++t) bursty_token(h, rng, prev, 0.9);
    EXPECT_EQ(h.recency_share(), 0.0);
    EXPECT_EQ(h.split_score(0), 0.0);
}

}  // namespace
}  // namespace moecache::daemon
