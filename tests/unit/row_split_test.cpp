// How a MUL_MAT_ID's rows split between a device pool and the CPU, and join back.
#include "moecache/backend/row_split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace moecache::backend {
namespace {

// ids [used 3][tokens 2] as a view of a wider tensor (rows of 8), as llama.cpp's argsort view is.
std::vector<int32_t> ids8(const std::vector<std::vector<int32_t>>& by_token) {
    std::vector<int32_t> v(8 * by_token.size(), 99);
    for (size_t t = 0; t < by_token.size(); ++t)
        for (size_t k = 0; k < by_token[t].size(); ++k) v[t * 8 + k] = by_token[t][k];
    return v;
}

const auto kSlotOfEven = [](int32_t e) { return e % 2 == 0 ? e / 2 : -1; };  // even experts pooled

TEST(RowSplit, EachRowGoesToItsHalfAndTheOtherHalfReadsOnlyItsOwnExperts) {
    const auto ids = ids8({{0, 3, 4}, {5, 2, 3}});
    const auto s = split_rows(reinterpret_cast<const char*>(ids.data()), 4, 32, 3, 2, 8, 4, kSlotOfEven);
    ASSERT_TRUE(s) << s.error().what();
    EXPECT_EQ(s->pool_rows, 3u);
    EXPECT_EQ(s->cpu_rows, 3u);
    EXPECT_EQ(s->pooled, (std::vector<uint8_t>{1, 0, 1, 0, 1, 0}));
    EXPECT_EQ(s->pool_experts, (std::vector<int32_t>{0, 4, 2}));
    EXPECT_EQ(s->cpu_experts, (std::vector<int32_t>{3, 5}));
    // The pool's ids name slots; a token's fillers slots the batch reads that the token does not
    // (slot 1 for token 0; slots 0 and 2 for token 1).
    const auto pool = pool_slot_ids(*s, kSlotOfEven, 4);
    ASSERT_TRUE(pool) << pool.error().what();
    EXPECT_EQ(*pool, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
    // The CPU's ids name experts; its fillers an expert it reads anyway (3, its first).
    EXPECT_EQ(s->cpu_ids, (std::vector<int32_t>{3, 3, 3, 5, 3, 3}));
}

// CUDA's MUL_MAT_ID (mmq, more than a few tokens) takes an expert at most once a token: a repeated
// slot left rows unmapped and aborted llama.cpp on the H100 with an illegal memory access.
TEST(RowSplit, NoTokenNamesAPoolSlotTwiceAndFillersAreSlotsTheBatchReads) {
    uint32_t seed = 12345;
    const auto next = [&] { return seed = seed * 1664525u + 1013904223u, seed >> 8; };
    for (int round = 0; round < 500; ++round) {
        const int64_t used = 1 + static_cast<int64_t>(next() % 8), tokens = 1 + static_cast<int64_t>(next() % 40);
        const int64_t n_expert = used + static_cast<int64_t>(next() % 60), n_slots = used + static_cast<int64_t>(next() % 20);
        const uint32_t pooled_in = 1 + next() % 4;  // about 1 in pooled_in experts pooled
        std::vector<int32_t> slot(static_cast<size_t>(n_expert), -1);
        int32_t free_slot = 0;
        for (auto& sl : slot)
            if (free_slot < n_slots && next() % pooled_in == 0) sl = free_slot++;
        std::vector<int32_t> ids;
        for (int64_t t = 0; t < tokens; ++t) {  // distinct experts a token, as a router gives them
            std::vector<int32_t> all(static_cast<size_t>(n_expert));
            std::iota(all.begin(), all.end(), 0);
            for (int64_t k = 0; k < used; ++k) {
                std::swap(all[static_cast<size_t>(k)], all[static_cast<size_t>(k) + next() % (all.size() - static_cast<size_t>(k))]);
                ids.push_back(all[static_cast<size_t>(k)]);
            }
        }
        const auto slot_of = [&](int32_t e) { return slot[static_cast<size_t>(e)]; };
        const auto s = split_rows(reinterpret_cast<const char*>(ids.data()), 4, static_cast<size_t>(4 * used), used,
                                  tokens, n_expert, n_slots, slot_of);
        ASSERT_TRUE(s) << s.error().what();
        const auto v = pool_slot_ids(*s, slot_of, n_slots);
        ASSERT_TRUE(v) << v.error().what();
        std::vector<int32_t> read;
        for (size_t r = 0; r < ids.size(); ++r)
            if (s->pooled[r]) read.push_back(slot_of(ids[r]));
        for (int64_t t = 0; t < tokens; ++t) {
            std::vector<int32_t> row(v->begin() + t * used, v->begin() + (t + 1) * used);
            for (int64_t k = 0; k < used; ++k) {
                const auto r = static_cast<size_t>(t * used + k);
                ASSERT_GE((*v)[r], 0);
                ASSERT_LT((*v)[r], n_slots);
                if (s->pooled[r]) {
                    ASSERT_EQ((*v)[r], slot_of(ids[r])) << "round " << round;
                }
            }
            std::sort(row.begin(), row.end());
            ASSERT_EQ(std::adjacent_find(row.begin(), row.end()), row.end()) << "round " << round << " token " << t;
            // A slot the batch does not read only once every slot it reads is the token's.
            const bool outside = std::any_of(row.begin(), row.end(), [&](int32_t x) {
                return std::find(read.begin(), read.end(), x) == read.end();
            });
            if (outside) {
                for (const int32_t x : read) ASSERT_TRUE(std::binary_search(row.begin(), row.end(), x)) << "round " << round;
            }
        }
    }
}

TEST(RowSplit, APoolWithFewerSlotsThanATokensRowsIsAnError) {
    const auto ids = ids8({{0, 3, 4}});
    const auto s = split_rows(reinterpret_cast<const char*>(ids.data()), 4, 32, 3, 1, 8, 2, [](int32_t e) {
        return e == 0 ? 0 : -1;
    });
    ASSERT_TRUE(s) << s.error().what();
    const auto v = pool_slot_ids(*s, [](int32_t e) { return e == 0 ? 0 : -1; }, 2);
    ASSERT_FALSE(v);
    EXPECT_NE(v.error().message.find("a pool of 2 slots"), std::string::npos) << v.error().message;
}

TEST(RowSplit, AHalfWithoutRowsIsLeftOut) {
    const auto ids = ids8({{0, 2}, {4, 6}});
    const auto all_pooled = split_rows(reinterpret_cast<const char*>(ids.data()), 4, 32, 2, 2, 8, 4, kSlotOfEven);
    ASSERT_TRUE(all_pooled);
    EXPECT_EQ(all_pooled->cpu_rows, 0u);
    EXPECT_TRUE(all_pooled->cpu_experts.empty());
    const auto none = split_rows(reinterpret_cast<const char*>(ids.data()), 4, 32, 2, 2, 8, 4,
                                 [](int32_t) { return -1; });
    ASSERT_TRUE(none);
    EXPECT_EQ(none->pool_rows, 0u);
    EXPECT_EQ(none->cpu_ids, (std::vector<int32_t>{0, 2, 4, 6}));
}

TEST(RowSplit, AnIdOrSlotOutOfRangeIsAnErrorNamingTheRow) {
    const auto bad = ids8({{0, 1}, {9, 2}});
    const auto s = split_rows(reinterpret_cast<const char*>(bad.data()), 4, 32, 2, 2, 8, 4, kSlotOfEven);
    ASSERT_FALSE(s);
    EXPECT_NE(s.error().message.find("expert 0 of token 1"), std::string::npos) << s.error().message;
    EXPECT_NE(s.error().message.find("names expert 9"), std::string::npos) << s.error().message;
    const auto neg = ids8({{-1, 1}});
    EXPECT_FALSE(split_rows(reinterpret_cast<const char*>(neg.data()), 4, 32, 2, 1, 8, 4, kSlotOfEven));
    const auto ok = ids8({{2, 1}});
    const auto slot = split_rows(reinterpret_cast<const char*>(ok.data()), 4, 32, 2, 1, 8, 1, kSlotOfEven);
    ASSERT_FALSE(slot);  // expert 2 in slot 1 of a pool of 1
    EXPECT_NE(slot.error().message.find("slot 1 of a pool of 1"), std::string::npos) << slot.error().message;
    EXPECT_FALSE(split_rows(reinterpret_cast<const char*>(ok.data()), 4, 32, 0, 1, 8, 4, kSlotOfEven));
}

TEST(RowSplit, JoinCopiesThePoolsRowsOverTheCpusOutput) {
    const auto ids = ids8({{0, 3}, {5, 2}});
    const auto s = split_rows(reinterpret_cast<const char*>(ids.data()), 4, 32, 2, 2, 8, 4, kSlotOfEven);
    ASSERT_TRUE(s);
    // Rows of 3 floats; dst [3][2 used][2 tokens] holds the CPU's output (1s), the pool's (2s) is
    // laid out with a padded stride.
    std::vector<float> dst(12, 1.0f), pool(2 * 2 * 4, 2.0f);
    join_rows(*s, Rows{reinterpret_cast<char*>(dst.data()), 12, 24},
              ConstRows{reinterpret_cast<const char*>(pool.data()), 16, 32}, 12);
    EXPECT_EQ(dst, (std::vector<float>{2, 2, 2, 1, 1, 1, 1, 1, 1, 2, 2, 2}));
}

}  // namespace
}  // namespace moecache::backend
