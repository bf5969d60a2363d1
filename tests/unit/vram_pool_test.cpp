// The VRAM pool's bookkeeping and local policy, and the copy planner: no GPU needed.
#include "moecache/cuda/vram_pool.h"
#include "moecache/cuda/copy_plan.h"
#include "moecache/routing_shift.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace moecache::cuda {
namespace {

constexpr uint64_t kSlice = 1000;

struct Pool : ::testing::Test {
    void SetUp() override {
        heat.add_model(0, 64);
        pool.add_model(0, 3 * 64, 64);
        pool.add_arena(kSlice, 0x100000, 4);
    }
    SliceRef ref(uint32_t expert, uint32_t tensor = 0) { return {0, tensor * 64 + expert, expert}; }
    // An admission whose fill was queued at once (what the hook does within one copy).
    uint64_t admit(const SliceRef& r, uint64_t bytes, StreamId stream, StreamOrder& order = same_stream_only()) {
        const uint64_t a = pool.admit(r, bytes, stream, heat, order);
        return a != 0 ? pool.commit(r) : 0;
    }
    ExpertHeat heat;
    VramPool pool;
};

// Records the streams a copy was ordered after; refuses when told to.
struct Joins final : StreamOrder {
    bool join(StreamId from) override {
        joined.push_back(from);
        return allow;
    }
    std::vector<StreamId> joined;
    bool allow = true;
};

TEST_F(Pool, AdmitsIntoFreeSlotsThenHits) {
    const uint64_t a = admit(ref(1), kSlice, 7);
    EXPECT_EQ(a, 0x100000u);
    EXPECT_EQ(pool.lookup(ref(1), 7), a);
    EXPECT_EQ(pool.lookup(ref(2), 7), 0u);
    EXPECT_EQ(pool.pooled_slices(0, 1), 1u);
    EXPECT_EQ(admit(ref(1), kSlice, 7), 0u) << "a pooled slice is not admitted twice";
    EXPECT_EQ(admit(ref(9), kSlice + 8, 7), 0u) << "no slot of that size";
}

TEST_F(Pool, AnotherStreamHitsOnceOrderedAfterTheOneThatFilledIt) {
    const uint64_t a = admit(ref(1), kSlice, 7);
    ASSERT_NE(a, 0u);
    EXPECT_EQ(pool.lookup(ref(1), 8), 0u) << "without ordering, another stream may not read it";
    EXPECT_EQ(pool.stats().cross_stream, 1u);
    Joins order;
    EXPECT_EQ(pool.lookup(ref(1), 8, order), a);
    EXPECT_EQ(order.joined, std::vector<StreamId>{7});
    // The slot is stream 8's now: 8 reads it without ordering, 7 must order after 8.
    EXPECT_EQ(pool.lookup(ref(1), 8), a);
    EXPECT_EQ(pool.lookup(ref(1), 7), 0u);
    EXPECT_EQ(pool.lookup(ref(1), 7, order), a);
    EXPECT_EQ(order.joined, (std::vector<StreamId>{7, 8}));
    EXPECT_EQ(pool.stats().joined, 2u);
    order.allow = false;
    EXPECT_EQ(pool.lookup(ref(1), 9, order), 0u) << "an ordering that failed leaves the slot alone";
    EXPECT_EQ(pool.lookup(ref(1), 7), a);
}

TEST_F(Pool, ASlotBeingFilledIsNobodysUntilCommitted) {
    Joins order;
    const uint64_t a = pool.admit(ref(1), kSlice, 7, heat, order);
    ASSERT_NE(a, 0u);
    EXPECT_EQ(pool.lookup(ref(1), 7, order), 0u) << "not readable before its fill is queued";
    EXPECT_EQ(pool.lookup(ref(1), 8, order), 0u);
    EXPECT_EQ(pool.admit(ref(1), kSlice, 8, heat, order), 0u) << "not admitted twice";
    // Not a victim either, however cold.
    for (uint32_t e = 2; e < 5; ++e) ASSERT_NE(admit(ref(e), kSlice, 7), 0u);
    heat.touch(0, 40, 50);
    for (int i = 0; i < 50; ++i) (void)admit(ref(40), kSlice, 7);
    EXPECT_EQ(pool.commit(ref(1)), a) << "the slot being filled was taken away";
    EXPECT_EQ(pool.lookup(ref(1), 7), a);
    EXPECT_EQ(pool.commit(ref(1)), 0u) << "committed once";
}

TEST_F(Pool, AFillReleasedMeanwhileIsNotCommitted) {
    ASSERT_NE(pool.admit(ref(1), kSlice, 7, heat), 0u);
    ASSERT_EQ(pool.release(1, heat).size(), 1u);
    EXPECT_EQ(pool.commit(ref(1)), 0u) << "its memory may be freed: nothing may be copied there";
    EXPECT_EQ(pool.stats().used, 0u);
}

// A copy queued for a slice's slot must not land once the slice lost that slot: dropped, and the
// slot given to another slice or the slice admitted anew elsewhere (the backend's pool thread
// checks this before it copies and before it commits).
TEST_F(Pool, AFillingAddressNamesTheSlotOnlyWhileTheSliceHoldsItUncommitted) {
    const uint64_t a = pool.admit(ref(1), kSlice, 7, heat);
    ASSERT_NE(a, 0u);
    EXPECT_EQ(pool.filling_address(ref(1)), a);
    EXPECT_EQ(pool.filling_address(ref(2)), 0u) << "never admitted";
    pool.drop(0, ref(1).slice);
    EXPECT_EQ(pool.filling_address(ref(1)), 0u) << "dropped: its old copy must not land";
    // The freed slot goes to another slice; the first is admitted anew, into another slot.
    const uint64_t b = pool.admit(ref(2), kSlice, 7, heat);
    const uint64_t c = pool.admit(ref(1), kSlice, 7, heat);
    EXPECT_EQ(b, a) << "the freed slot is taken first";
    ASSERT_NE(c, 0u);
    EXPECT_NE(c, a);
    EXPECT_EQ(pool.filling_address(ref(2)), a) << "the slot is the other slice's now";
    EXPECT_EQ(pool.filling_address(ref(1)), c) << "an old copy of slice 1 aimed at the other slot";
    ASSERT_EQ(pool.commit(ref(1)), c);
    EXPECT_EQ(pool.filling_address(ref(1)), 0u) << "committed: no copy is pending for it";
}

TEST_F(Pool, WithoutEvictionOnlyFreeSlotsAreTaken) {
    for (uint32_t e = 0; e < 4; ++e) ASSERT_NE(admit(ref(e), kSlice, 7), 0u);
    heat.touch(0, 10, 100);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(pool.admit(ref(10), kSlice, 7, heat, same_stream_only(), nullptr, false), 0u);
    EXPECT_EQ(pool.stats().evicted, 0u);
    pool.drop(0, ref(2).slice);
    EXPECT_NE(pool.admit(ref(10), kSlice, 7, heat, same_stream_only(), nullptr, false), 0u);
}

TEST_F(Pool, EvictsOnlyColderExpertsOnTheSameStream) {
    for (uint32_t e = 0; e < 4; ++e) ASSERT_NE(admit(ref(e), kSlice, 7), 0u);
    // Equally cold newcomer: declined (no churn between equals).
    EXPECT_EQ(admit(ref(10), kSlice, 7), 0u);
    EXPECT_GT(pool.stats().declined, 0u);
    // A hotter newcomer, but every slot was last used on stream 7: not from stream 8 unless it
    // can be ordered after 7.
    for (int i = 0; i < 5; ++i) heat.touch(0, 10);
    EXPECT_EQ(admit(ref(10), kSlice, 8), 0u);
    // From stream 7 it displaces one of the cold ones (sampling may need a few tries).
    uint64_t a = 0;
    for (int i = 0; i < 50 && a == 0; ++i) a = admit(ref(10), kSlice, 7);
    ASSERT_NE(a, 0u);
    EXPECT_EQ(pool.stats().evicted, 1u);
    EXPECT_EQ(pool.stats().used, 4u);
    uint32_t still = 0;
    for (uint32_t e = 0; e < 4; ++e) still += pool.lookup(ref(e), 7) != 0;
    EXPECT_EQ(still, 3u);
}

TEST_F(Pool, KeepsTheHotterOfTwo) {
    for (uint32_t e = 0; e < 4; ++e) {
        ASSERT_NE(admit(ref(e), kSlice, 7), 0u);
        for (int i = 0; i < 10; ++i) heat.touch(0, e);
    }
    heat.touch(0, 20, 3);  // warmer than nothing, colder than every pooled one
    for (int i = 0; i < 50; ++i) EXPECT_EQ(admit(ref(20), kSlice, 7), 0u);
    EXPECT_EQ(pool.stats().evicted, 0u);
}

TEST_F(Pool, DropAndDemoteFreeSlots) {
    ASSERT_NE(admit(ref(1, 0), kSlice, 7), 0u);
    ASSERT_NE(admit(ref(1, 1), kSlice, 7), 0u);
    ASSERT_NE(admit(ref(2, 0), kSlice, 7), 0u);
    EXPECT_EQ(pool.pooled_slices(0, 1), 2u);
    EXPECT_EQ(pool.drop_expert(0, 1), 2u);
    EXPECT_EQ(pool.pooled_slices(0, 1), 0u);
    EXPECT_EQ(pool.lookup(ref(1, 1), 7), 0u);
    pool.drop(0, ref(2).slice);
    EXPECT_EQ(pool.stats().used, 0u);
    // A freed slot last used on stream 7 is not handed to stream 8 (a read may still be queued on 7),
    // but a never-used one is, and the others once 8 is ordered after 7.
    for (uint32_t e = 30; e < 34; ++e) (void)admit(ref(e), kSlice, 8);
    EXPECT_EQ(pool.stats().used, 1u) << "only the one never-used slot may go to another stream";
    Joins order;
    for (uint32_t e = 30; e < 34; ++e) (void)admit(ref(e), kSlice, 8, order);
    EXPECT_EQ(pool.stats().used, 4u);
    EXPECT_EQ(order.joined, (std::vector<StreamId>{7, 7, 7}));
}

TEST_F(Pool, ReleasesColdestArenasFirst) {
    pool.add_arena(kSlice, 0x200000, 4);
    for (uint32_t e = 0; e < 8; ++e) ASSERT_NE(admit(ref(e), kSlice, 7), 0u);
    for (uint32_t e = 4; e < 8; ++e) heat.touch(0, e, 5);  // the second arena holds the hot ones
    const auto freed = pool.release(1, heat);
    ASSERT_EQ(freed.size(), 1u);
    EXPECT_EQ(freed[0], 0x100000u);
    EXPECT_EQ(pool.stats().slots, 4u);
    EXPECT_EQ(pool.stats().used, 4u);
    for (uint32_t e = 0; e < 4; ++e) EXPECT_EQ(pool.lookup(ref(e), 7), 0u);
    for (uint32_t e = 4; e < 8; ++e) EXPECT_NE(pool.lookup(ref(e), 7), 0u);
}

TEST_F(Pool, APromotedExpertTakesTheSlotOfAHotterOneAndKeepsIt) {
    for (uint32_t e = 0; e < 4; ++e) {
        ASSERT_NE(admit(ref(e), kSlice, 7), 0u);
        heat.touch(0, e, 50);
    }
    heat.set_promoted(0, 20, true);  // the daemon wants 20 in VRAM; used once here
    heat.touch(0, 20);
    uint64_t a = 0;
    for (int i = 0; i < 50 && a == 0; ++i) a = admit(ref(20), kSlice, 7);
    ASSERT_NE(a, 0u) << "promoted ranks above any unpromoted expert";
    // Now the hottest unpromoted expert cannot displace it.
    heat.touch(0, 30, 500);
    for (int i = 0; i < 200; ++i) (void)admit(ref(30), kSlice, 7);
    EXPECT_NE(pool.lookup(ref(20), 7), 0u);
    // Unpromoted, it is one of the crowd again, and the coldest: hot newcomers displace it.
    heat.set_promoted(0, 20, false);
    EXPECT_EQ(heat.heat(0, 20), 1u);
    for (uint32_t e = 31; e < 35; ++e) {
        heat.touch(0, e, 500);
        for (int i = 0; i < 50; ++i) (void)admit(ref(e), kSlice, 7);
    }
    EXPECT_EQ(pool.lookup(ref(20), 7), 0u);
}

// A slot keeps the next slice's head after its own (llama.cpp's padding): the lookup says how much
// of it the fill wrote; slots are spaced by slice and tail room; an emptied slot holds no tail.
TEST(PoolTail, ASlotKeepsWhatItsFillWroteAfterTheSlice) {
    ExpertHeat heat;
    heat.add_model(0, 8);
    VramPool pool;
    pool.add_model(0, 8, 8);
    pool.add_arena(kSlice, 0x100000, 2, 512);
    EXPECT_EQ(pool.tail_room(kSlice), 512u);
    EXPECT_EQ(pool.tail_room(kSlice + 1), 0u);
    EXPECT_EQ(pool.stats().bytes, 2 * (kSlice + 512));
    const SliceRef a{0, 1, 1}, b{0, 2, 2}, c{0, 3, 3};
    const uint64_t sa = pool.admit(a, kSlice, 1, heat);
    const uint64_t sb = pool.admit(b, kSlice, 1, heat);
    ASSERT_NE(sa, 0u);
    ASSERT_NE(sb, 0u);
    EXPECT_EQ(sa > sb ? sa - sb : sb - sa, kSlice + 512) << "slots spaced by the slice and its tail room";
    EXPECT_EQ(pool.commit(a, 4096), sa);
    EXPECT_EQ(pool.commit(b), sb);
    uint32_t tail = 7;
    EXPECT_EQ(pool.lookup(a, 1, same_stream_only(), &tail), sa);
    EXPECT_EQ(tail, 512u) << "at most the tail room";
    EXPECT_EQ(pool.lookup(b, 1, same_stream_only(), &tail), sb);
    EXPECT_EQ(tail, 0u) << "the fill wrote nothing after the slice";
    EXPECT_EQ(pool.lookup(c, 1, same_stream_only(), &tail), 0u);
    EXPECT_EQ(tail, 0u);
    pool.drop(0, a.slice);
    ASSERT_EQ(pool.admit(c, kSlice, 1, heat), sa);
    EXPECT_EQ(pool.commit(c), sa);
    EXPECT_EQ(pool.lookup(c, 1, same_stream_only(), &tail), sa);
    EXPECT_EQ(tail, 0u) << "the slot's new slice has no tail of the old one's";
}

TEST(ExpertHeat, HalvesAfterSixtyFourUsesPerExpert) {
    ExpertHeat h;
    h.add_model(0, 4);
    for (int i = 0; i < 255; ++i) h.touch(0, 0);
    EXPECT_EQ(h.heat(0, 0), 255u);
    h.touch(0, 1);  // the 256th use: everything halves
    EXPECT_EQ(h.heat(0, 0), 127u);
    EXPECT_EQ(h.heat(0, 1), 0u);
    EXPECT_EQ(h.hottest(), 127u);
    EXPECT_EQ(h.heat(3, 3), 0u) << "unknown model";
}

// A shift the daemon saw (a Shifted directive): the model's counts learnt before it are cut to a
// hundredth, so that a few uses of the new routing outrank them; another model's stay, and a
// promotion still ranks above everything.
TEST(ExpertHeat, AShiftCutsThatModelsCountsToAHundredth) {
    ExpertHeat h;
    h.add_model(0, 4);
    h.add_model(1, 4);
    for (int i = 0; i < 200; ++i) h.touch(0, 0);
    for (int i = 0; i < 200; ++i) h.touch(1, 0);
    h.set_promoted(0, 3, true);
    h.forget(0, kKeepAtShift);
    EXPECT_EQ(h.count(0, 0), 2u);
    EXPECT_EQ(h.count(1, 0), 200u) << "another model's routing did not shift";
    for (int i = 0; i < 3; ++i) h.touch(0, 1);
    EXPECT_GT(h.heat(0, 1), h.heat(0, 0)) << "three uses of the new routing outrank two hundred of the old";
    EXPECT_GT(h.heat(0, 3), h.heat(0, 1)) << "a promotion still ranks first";
    h.forget(7, 0.0);  // a model never added: nothing happens
    EXPECT_EQ(h.count(1, 0), 200u);
}

// Where the daemon's split gives recency a share, what it did not promote ranks by its last touch:
// a pool of four with two promoted keeps the two experts used last beside them, however often
// the others were used before.
TEST_F(Pool, WithRecencyTheUndirectedPartKeepsWhatWasUsedLast) {
    heat.set_promoted(0, 1, true);
    heat.set_promoted(0, 2, true);
    ASSERT_NE(admit(ref(1), kSlice, 7), 0u);
    ASSERT_NE(admit(ref(2), kSlice, 7), 0u);
    heat.touch(0, 10, 500);  // often, long ago
    heat.touch(0, 11, 500);
    ASSERT_NE(admit(ref(10), kSlice, 7), 0u);
    ASSERT_NE(admit(ref(11), kSlice, 7), 0u);
    heat.touch(0, 20);
    heat.touch(0, 21);
    EXPECT_EQ(admit(ref(20), kSlice, 7), 0u) << "by counts: one use does not displace 500";
    heat.set_recency(true);
    EXPECT_GT(heat.heat(0, 20), heat.heat(0, 10));
    for (int i = 0; i < 64 && pool.lookup(ref(20), 7) == 0; ++i) (void)admit(ref(20), kSlice, 7);
    heat.touch(0, 21);
    for (int i = 0; i < 64 && pool.lookup(ref(21), 7) == 0; ++i) (void)admit(ref(21), kSlice, 7);
    EXPECT_NE(pool.lookup(ref(20), 7), 0u);
    EXPECT_NE(pool.lookup(ref(21), 7), 0u);
    EXPECT_EQ(pool.lookup(ref(10), 7), 0u);
    EXPECT_EQ(pool.lookup(ref(11), 7), 0u);
    EXPECT_NE(pool.lookup(ref(1), 7), 0u) << "what the daemon promoted stays";
    EXPECT_NE(pool.lookup(ref(2), 7), 0u);
}

// A pool the daemon directs almost whole: 60 of 64 slots promoted, 4 the recency part. A miss of an
// expert not promoted is admitted every time, in place of the least recently used of those 4 nearly
// every time: the sample is drawn among the slots it may take, not the whole pool (8 slots drawn
// from all 64 hold none of the 4 a third of the time, and then nothing is admitted; when they do,
// the one taken is about any of the 4).
TEST(PoolSample, ASmallRecencyPartIsAnLruNotALottery) {
    ExpertHeat heat;
    VramPool pool;
    heat.add_model(0, 512);
    pool.add_model(0, 512, 512);
    pool.add_arena(kSlice, 0x100000, 64);
    heat.set_recency(true);
    auto fill = [&](uint32_t e) {
        heat.touch(0, e);
        const uint64_t a = pool.admit({0, e, e}, kSlice, 7, heat, same_stream_only());
        return a != 0 && pool.commit({0, e, e}) != 0;
    };
    for (uint32_t e = 0; e < 60; ++e) {
        heat.set_promoted(0, e, true);
        ASSERT_TRUE(fill(e));
    }
    std::vector<uint32_t> recent{100, 101, 102, 103};  // pooled, not promoted; 100 the least recently used
    for (uint32_t e : recent) ASSERT_TRUE(fill(e));
    int took_oldest = 0;
    const int misses = 200;
    for (uint32_t e = 200; e < 200 + misses; ++e) {
        const auto oldest = std::min_element(recent.begin(), recent.end(), [&](uint32_t a, uint32_t b) {
            return heat.heat(0, a) < heat.heat(0, b);
        });
        ASSERT_TRUE(fill(e)) << "expert " << e << " was not admitted";
        took_oldest += pool.lookup({0, *oldest, *oldest}, 7) == 0;
        for (auto& r : recent)
            if (pool.lookup({0, r, r}, 7) == 0) r = e;
    }
    EXPECT_GE(took_oldest, misses * 85 / 100) << "the least recently used was taken " << took_oldest << " times of " << misses;
    for (uint32_t e = 0; e < 60; ++e) EXPECT_NE(pool.lookup({0, e, e}, 7), 0u) << "promoted " << e << " was taken";
}

TEST(ExpertHeat, WithRecencyTheLastTouchedRanksFirstAndAPromotionAboveAll) {
    ExpertHeat h;
    h.add_model(0, 3);
    h.touch(0, 0, 100);
    h.touch(0, 1);
    EXPECT_GT(h.heat(0, 0), h.heat(0, 1)) << "by counts";
    h.set_recency(true);
    EXPECT_LT(h.heat(0, 0), h.heat(0, 1)) << "by the last touch";
    h.set_promoted(0, 2, true);
    EXPECT_GE(h.heat(0, 2), ExpertHeat::kPromoted) << "a promotion ranks above any stamp";
    h.set_recency(false);
    EXPECT_EQ(h.heat(0, 0), 100u);
}

// The recency part's ranking is learnt from the routing: where a token reuses only what the token
// before it used (bursty), the last token's experts first and the rest by count; where reuse lasts
// many tokens (a hot set that drifts), an LRU. Both replayed as ghosts of the part's room.
namespace recency_ranking {
constexpr uint32_t kLayers = 4, kExperts = 64, kUsed = 4;

// Feeds `tokens` tokens of `next(layer, previous experts)` to a heat with a recency part of
// `room` experts; returns the heat.
template <typename Next>
ExpertHeat fed(uint32_t room, uint32_t tokens, Next next) {
    ExpertHeat h;
    h.add_model(0, kLayers * kExperts);
    h.set_recency(true);
    h.set_capacity(room);
    h.set_recent_window(0, kUsed * kLayers);
    std::vector<std::vector<uint32_t>> prev(kLayers);
    for (uint32_t t = 0; t < tokens; ++t)
        for (uint32_t l = 0; l < kLayers; ++l) {
            prev[l] = next(l, prev[l]);
            for (uint32_t e : prev[l]) h.touch(0, l * kExperts + e);
        }
    return h;
}

// Four distinct experts, drawn by `draw` (an expert in [0, kExperts)), those in `keep` first.
template <typename Draw>
std::vector<uint32_t> fill(std::vector<uint32_t> keep, Draw draw) {
    while (keep.size() < kUsed) {
        const uint32_t e = draw();
        if (std::find(keep.begin(), keep.end(), e) == keep.end()) keep.push_back(e);
    }
    return keep;
}
}  // namespace recency_ranking

TEST(ExpertHeat, TheRecencyPartRanksTheLastTokensFirstWhereReuseLastsOneToken) {
    using namespace recency_ranking;
    std::mt19937 rng(7);
    // A skewed popularity (expert e drawn ~ 1/(e+1)); 60 % of tokens keep the last token's experts
    // but one, the others draw afresh.
    std::vector<double> weights(kExperts);
    for (uint32_t e = 0; e < kExperts; ++e) weights[e] = 1.0 / (e + 1);
    std::discrete_distribution<uint32_t> popular(weights.begin(), weights.end());
    ExpertHeat h = fed(kLayers * kExperts / 8, 4000, [&](uint32_t, const std::vector<uint32_t>& before) {
        std::vector<uint32_t> keep;
        if (!before.empty() && std::uniform_real_distribution<>(0, 1)(rng) < 0.6) keep.assign(before.begin(), before.end() - 1);
        return fill(keep, [&] { return popular(rng); });
    });
    EXPECT_TRUE(h.window_ranking()) << "LRU " << h.ghost_score(0) << ", the last token's first " << h.ghost_score(1);
    EXPECT_GT(h.ghost_score(1), h.ghost_score(0) + 0.01);
    // In that ranking: an expert of the last token ranks above any other, the others by count.
    h.touch(0, 5, 1000);  // hot, and touched now: recent
    h.touch(0, 7);
    EXPECT_GT(h.heat(0, 7), h.heat(0, 5)) << "the later touch first among the last token's";
    for (uint32_t t = 0; t < 2 * kUsed * kLayers; ++t) h.touch(0, 3 * kExperts + kExperts - 1);  // a token's touches and more
    EXPECT_LT(h.heat(0, 7), h.heat(0, 3 * kExperts + kExperts - 1)) << "no longer the last token's";
    EXPECT_GT(h.heat(0, 5), h.heat(0, 7)) << "out of the window, by count";
    h.set_promoted(0, 7, true);
    EXPECT_GE(h.heat(0, 7), ExpertHeat::kPromoted);
}

TEST(ExpertHeat, TheRecencyPartStaysAnLruWhereReuseLastsManyTokens) {
    using namespace recency_ranking;
    std::mt19937 rng(11);
    // A hot set of 12 experts a layer that moves on by one every other token, each expert alike:
    // what was used a few tokens ago is likely again, however often it was used before.
    uint32_t t = 0;
    ExpertHeat h = fed(kLayers * kExperts / 8, 4000, [&](uint32_t l, const std::vector<uint32_t>&) {
        if (l == 0) ++t;
        const uint32_t start = t / 2;
        return fill({}, [&] { return (start + std::uniform_int_distribution<uint32_t>(0, 11)(rng)) % kExperts; });
    });
    EXPECT_FALSE(h.window_ranking()) << "LRU " << h.ghost_score(0) << ", the last token's first " << h.ghost_score(1);
    EXPECT_GT(h.ghost_score(0), h.ghost_score(1));
    h.touch(0, 1, 1000);
    h.touch(0, 2);
    EXPECT_GT(h.heat(0, 2), h.heat(0, 1)) << "an LRU: the later touch first, whatever the counts";
}

TEST(CopyPlan, MergesHostRunsAndServesHits) {
    CopyPiece out[16];
    // Slices 0..4, pooled: 1 and 3. Padding 100 bytes, head of slice 5, which is pooled too.
    auto pool = [](uint32_t i) -> uint64_t { return i == 1 || i == 3 || i == 5 ? 0x9000 + i * 0x1000 : 0; };
    const size_t n = plan_copy(5, kSlice, 100, true, pool, out, 16);
    ASSERT_EQ(n, 6u);
    EXPECT_EQ(out[0].offset, 0u);
    EXPECT_EQ(out[0].bytes, kSlice);
    EXPECT_EQ(out[0].pool_address, 0u);
    EXPECT_EQ(out[1].pool_address, 0xa000u);
    EXPECT_EQ(out[3].pool_address, 0xc000u);
    EXPECT_EQ(out[4].offset, 4 * kSlice);
    EXPECT_EQ(out[5].offset, 5 * kSlice);
    EXPECT_EQ(out[5].bytes, 100u);
    EXPECT_EQ(out[5].pool_address, 0xe000u);
    uint64_t covered = 0;
    for (size_t i = 0; i < n; ++i) covered += out[i].bytes;
    EXPECT_EQ(covered, 5 * kSlice + 100);
}

TEST(CopyPlan, PaddingPastTheTensorComesFromTheHost) {
    CopyPiece out[4];
    auto all = [](uint32_t) -> uint64_t { return 0x5000; };
    ASSERT_EQ(plan_copy(1, kSlice, 100, false, all, out, 4), 2u);
    EXPECT_EQ(out[1].pool_address, 0u);
    EXPECT_EQ(out[1].bytes, 100u);
    auto none = [](uint32_t) -> uint64_t { return 0; };
    ASSERT_EQ(plan_copy(3, kSlice, 100, true, none, out, 4), 1u) << "misses merge into one host copy";
    EXPECT_EQ(out[0].bytes, 3 * kSlice + 100);
    EXPECT_EQ(plan_copy(3, kSlice, 0, false, [](uint32_t i) -> uint64_t { return i % 2 ? 0x1000 : 0; }, out, 2), 0u)
        << "more pieces than room: nothing";
}

}  // namespace
}  // namespace moecache::cuda
