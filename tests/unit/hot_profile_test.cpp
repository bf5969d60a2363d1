// The hook's hot profile file: what it keeps, what it refuses (a hostile or stale file is refused
// with where it is wrong, never half-read), where it lives and what names it.
#include "moecache/cuda/hot_profile.h"
#include "temp_dir.h"

#include <sys/stat.h>
#include <gtest/gtest.h>

#include <fstream>

namespace moecache::cuda {
namespace {

HotProfile shaped(uint32_t layers, uint32_t experts) {
    HotProfile p;
    p.n_layers = layers;
    p.n_experts = experts;
    p.routings = 12345;
    for (uint32_t i = 0; i < layers * experts; ++i) p.counts.push_back(i * 7 % 13);
    return p;
}

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

TEST(HotProfile, WhatIsSavedIsReadBack) {
    test::TempDir dir;
    const std::string path = dir.path() + "/a/b/x.hot";
    const auto p = shaped(3, 5);
    ASSERT_TRUE(save_hot_profile(path, p));
    auto q = load_hot_profile(path, 3, 5);
    ASSERT_TRUE(q) << q.error().what();
    EXPECT_EQ(q->counts, p.counts);
    EXPECT_EQ(q->routings, 12345u);
    struct stat st {};
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    ASSERT_EQ(stat((dir.path() + "/a/b").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
}

TEST(HotProfile, AProfileOfAnotherShapeIsRefused) {
    const std::string text = format_hot_profile(shaped(3, 5));
    auto q = parse_hot_profile(text, 3, 6);
    ASSERT_FALSE(q);
    EXPECT_NE(q.error().message.find("3 layers x 5 experts"), std::string::npos) << q.error().message;
    EXPECT_FALSE(parse_hot_profile(text, 4, 5));
}

TEST(HotProfile, DamagedFilesAreRefusedSayingWhere) {
    const std::string good = format_hot_profile(shaped(2, 3));
    struct Case {
        std::string text, where;
    };
    const Case cases[] = {
        {"", "line 1"},
        {"GGUF....", "line 1"},
        {"moecache-hot-profile 1 layers 2 experts 3\n1 2 3\n4 5 6\n", "routings"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings x\n1 2 3\n4 5 6\n", "routings is not a number"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1 more\n1 2 3\n4 5 6\n", "unexpected"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1\n1 2 3\n", "line 3: missing"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1\n1 2 3\n4 5\n", "line 3: expected 3 counts"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1\n1 2 3\n4 5 6 7\n", "line 3: expected 3 counts"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1\n1 -2 3\n4 5 6\n", "line 2: expert 1"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1\n1 99999999999 3\n4 5 6\n", "line 2: expert 1"},
        {"moecache-hot-profile 1 layers 2 experts 3 routings 1\n1 2 3\n4 5 6\n\n", "more lines"},
        {good + "7 8 9\n", "more lines"},
        {"moecache-hot-profile 1 layers 0 experts 0 routings 1\n", "not a model's shape"},
    };
    for (const auto& c : cases) {
        const uint32_t layers = c.where == "not a model's shape" ? 0 : 2, experts = layers == 0 ? 0 : 3;
        auto q = parse_hot_profile(c.text, layers, experts);
        ASSERT_FALSE(q) << c.text;
        EXPECT_NE(q.error().message.find(c.where), std::string::npos) << c.text << " -> " << q.error().message;
    }
    EXPECT_TRUE(parse_hot_profile(good, 2, 3));
    EXPECT_FALSE(parse_hot_profile(std::string(kMaxProfileBytes + 1, '1'), 2, 3));
}

TEST(HotProfile, ACopyOfAModelElsewhereFindsItsProfileAndAnotherModelDoesNot) {
    test::TempDir dir;
    std::string content(3 << 20, 'a');
    content[100] = 'b';
    write(dir.path() + "/one.gguf", content);
    write(dir.path() + "/copy.gguf", content);
    std::string other = content;
    other[200] = 'c';  // another header
    write(dir.path() + "/other.gguf", other);
    write(dir.path() + "/longer.gguf", content + "x");  // the same head, another size
    auto a = hot_profile_name(dir.path() + "/one.gguf");
    auto b = hot_profile_name(dir.path() + "/copy.gguf");
    auto c = hot_profile_name(dir.path() + "/other.gguf");
    auto d = hot_profile_name(dir.path() + "/longer.gguf");
    ASSERT_TRUE(a && b && c && d);
    EXPECT_EQ(*a, *b);
    EXPECT_NE(*a, *c);
    EXPECT_NE(*a, *d);
    EXPECT_EQ(a->size(), 16u + 4u);
    EXPECT_FALSE(hot_profile_name(dir.path()));  // a folder
    auto missing = hot_profile_name(dir.path() + "/none.gguf");
    ASSERT_FALSE(missing);
    EXPECT_EQ(missing.error().errnum, ENOENT);
}

TEST(HotProfile, TheFolderFollowsTheSettingThenTheCacheHome) {
    EXPECT_EQ(hot_profile_dir("/srv/p", "/x", "/home/u"), "/srv/p");
    EXPECT_EQ(hot_profile_dir("off", "/x", "/home/u"), "");
    EXPECT_EQ(hot_profile_dir("0", "/x", "/home/u"), "");
    EXPECT_EQ(hot_profile_dir(nullptr, "/x", "/home/u"), "/x/moecache/hook");
    EXPECT_EQ(hot_profile_dir("", "relative", "/home/u"), "/home/u/.cache/moecache/hook");
    EXPECT_EQ(hot_profile_dir(nullptr, nullptr, "/"), "");  // no home to keep it in
    EXPECT_EQ(hot_profile_dir(nullptr, nullptr, nullptr), "");
}

TEST(HotProfile, AsHeatTheRankingIsKeptAndTheHottestIsTop) {
    HotProfile p;
    p.n_layers = 1;
    p.n_experts = 5;
    p.counts = {0, 1, 500, 1000, 250};
    const auto h = profile_heat(p, 64);
    EXPECT_EQ(h, (std::vector<uint32_t>{0, 1, 32, 64, 16}));
    p.counts.assign(5, 0);
    EXPECT_EQ(profile_heat(p, 64), std::vector<uint32_t>(5, 0));
}

}  // namespace
}  // namespace moecache::cuda
