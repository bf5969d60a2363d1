// The replay baselines: LRU, LFU and Belady on sequences whose answers are known by hand, and on a
// synthetic DeepSeek-skew trace, where hindsight beats both and frequency beats recency.
#include "temp_dir.h"

#include "moecache/sim/baselines.h"
#include "moecache/tracegen/tracegen.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace moecache::sim {
namespace {

// One layer of `n` experts of 100 bytes; one decision per access.
Trace sequence(const std::vector<uint32_t>& experts, uint32_t n = 8) {
    Trace t;
    t.models.push_back({0, "k", "", n, {0}, {100}});
    for (size_t i = 0; i < experts.size(); ++i) t.decisions.push_back({i, 0, 0, 1, {experts[i]}, {}});
    return t;
}

uint64_t hits(const Trace& t, uint64_t budget, Baseline b) {
    auto r = replay(t, 0, budget, b);
    EXPECT_TRUE(r) << r.error().what();
    return r ? r->hits : 0;
}

TEST(Baselines, KnownSequences) {
    // A cycle one larger than the tier: recency always evicts what comes next.
    const auto cycle = sequence({0, 1, 2, 0, 1, 2, 0, 1, 2});
    EXPECT_EQ(hits(cycle, 200, Baseline::Lru), 0u);
    // Hindsight keeps 0 and 1 and lets 2 pass by: hits on 0 and 1 of the 2nd and 3rd rounds,
    // then one of them gives way to 2 only when it is needed no more.
    EXPECT_EQ(hits(cycle, 200, Baseline::Belady), 4u);
    // A hot expert among scans: frequency keeps it, recency loses it.
    const auto hot = sequence({0, 0, 0, 1, 2, 0, 3, 4, 0, 5, 6, 0});
    EXPECT_EQ(hits(hot, 200, Baseline::Lfu), 5u);
    EXPECT_EQ(hits(hot, 200, Baseline::Lru), 2u);  // the first three only: two others always push 0 out
    EXPECT_GE(hits(hot, 200, Baseline::Belady), hits(hot, 200, Baseline::Lfu));
    // Nothing fits: every access a miss; everything fits: only first uses miss.
    EXPECT_EQ(hits(cycle, 50, Baseline::Belady), 0u);
    EXPECT_EQ(hits(cycle, 300, Baseline::Lru), 6u);
    auto r = replay(cycle, 0, 300, Baseline::Lfu);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->accesses, 9u);
    EXPECT_EQ(r->bytes_in, 300u);
    EXPECT_FALSE(replay(cycle, 7, 300, Baseline::Lru));  // no such model
}

TEST(Baselines, OnTheDeepSeekPresetHindsightBeatsFrequencyBeatsRecency) {
    tracegen::Spec shape;
    shape.n_layers = 4;
    shape.tokens = 2000;
    auto spec = tracegen::fit(*tracegen::find_preset("deepseek-v4-flash"), shape);
    ASSERT_TRUE(spec) << spec.error().what();
    auto routing = tracegen::generate(*spec);
    ASSERT_TRUE(routing);
    test::TempDir dir;
    ASSERT_TRUE(tracegen::write_trace(*routing, dir.file("t.jsonl"), "k", 1000, 1));
    auto trace = read_trace(dir.file("t.jsonl"));
    ASSERT_TRUE(trace) << trace.error().what();
    const uint64_t quarter = uint64_t{4} * 64 * 1000 / 4;  // 25 % of expert bytes
    const double lru = replay(*trace, 0, quarter, Baseline::Lru)->hit_rate();
    const double lfu = replay(*trace, 0, quarter, Baseline::Lfu)->hit_rate();
    const double belady = replay(*trace, 0, quarter, Baseline::Belady)->hit_rate();
    EXPECT_GT(lfu, lru + 0.02) << lru << " " << lfu;
    EXPECT_GT(belady, lfu + 0.02) << lfu << " " << belady;
    EXPECT_LT(belady, 1.0);
    std::printf("25 %% of expert bytes, 4 layers x 64, top-8, 2000 tokens: LRU %.3f LFU %.3f Belady %.3f\n", lru, lfu, belady);
}

}  // namespace
}  // namespace moecache::sim
