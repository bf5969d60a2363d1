// How a MUL_MAT_ID's rows split between a device pool and the CPU, and join back.
#include "moecache/backend/row_split.h"

#include <gtest/gtest.h>

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
    // The pool's ids name slots; its fillers a slot it reads anyway (expert 0's, slot 0).
    EXPECT_EQ(s->pool_ids, (std::vector<int32_t>{0, 0, 2, 0, 1, 0}));
    // The CPU's ids name experts; its fillers an expert it reads anyway (3, its first).
    EXPECT_EQ(s->cpu_ids, (std::vector<int32_t>{3, 3, 3, 5, 3, 3}));
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
