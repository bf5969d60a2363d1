// The generator: valid specs only, deterministic output, llama.cpp's split layout, streaming
// memory, and a router skew that meets the presets' published coverage.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/gguf.h"
#include "moecache/mkmodel/router_skew.h"
#include "moecache/model.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

namespace moecache {
namespace {

using mkmodel::ModelSpec;

TEST(MkModel, RejectsImpossibleShapes) {
    ModelSpec s = test::small_spec();
    s.n_experts_used = s.n_experts + 1;
    EXPECT_NE(mkmodel::validate(s).error().message.find("--experts-used"), std::string::npos);

    s = test::small_spec();
    s.expert_type = *ggml_type_info(ggml::Q4_K);
    s.n_ff_exp = 128;  // Q4_K blocks hold 256 elements
    EXPECT_NE(mkmodel::validate(s).error().message.find("multiple of 256"), std::string::npos);

    s = test::small_spec();
    s.expert_type = *ggml_type_info(ggml::IQ2_XXS);
    EXPECT_NE(mkmodel::validate(s).error().message.find("IQ2_XXS"), std::string::npos);

    s = test::small_spec();
    s.n_head = 3;
    s.n_head_kv = 2;
    EXPECT_FALSE(mkmodel::validate(s));
}

TEST(MkModel, SameSeedSameBytesOtherSeedOtherBytes) {
    test::TempDir dir;
    ModelSpec s = test::small_spec();
    s.n_layers = 2;
    test::write_model(s, dir.file("a.gguf"));
    test::write_model(s, dir.file("b.gguf"));
    s.seed = 2;
    test::write_model(s, dir.file("c.gguf"));
    const auto a = test::read_file(dir.file("a.gguf"));
    EXPECT_EQ(a, test::read_file(dir.file("b.gguf")));
    EXPECT_NE(a, test::read_file(dir.file("c.gguf")));
}

TEST(MkModel, WritesTheQwen3MoeTensorSet) {
    test::TempDir dir;
    ModelSpec s = test::small_spec();
    s.expert_type = *ggml_type_info(ggml::Q4_K);
    test::write_model(s, dir.file("m.gguf"));
    auto f = read_gguf(dir.file("m.gguf"));
    ASSERT_TRUE(f) << f.error().what();
    EXPECT_EQ(*f->get_string("general.architecture"), "qwen3moe");
    EXPECT_EQ(*f->get_uint("qwen3moe.expert_count"), s.n_experts);
    EXPECT_EQ(*f->get_uint("qwen3moe.expert_used_count"), s.n_experts_used);
    EXPECT_EQ(f->tensors.size(), 3 + 12 * s.n_layers);
    const auto* up = f->find_tensor("blk.3.ffn_up_exps.weight");
    ASSERT_NE(up, nullptr);
    EXPECT_EQ(up->type.id, ggml::Q4_K);
    EXPECT_EQ(up->ne[0], s.n_embd);
    EXPECT_EQ(up->ne[1], s.n_ff_exp);
    EXPECT_EQ(up->ne[2], s.n_experts);
    const auto* tokens = f->find("tokenizer.ggml.tokens");
    ASSERT_NE(tokens, nullptr);
    EXPECT_EQ(std::get<GgufArrayRef>(tokens->value).count, s.n_vocab);
    const auto* tok = f->find_tensor("token_embd.weight");
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->ne[1], s.n_vocab);
}

TEST(MkModel, ExpertRanksArePermutations) {
    ModelSpec s = test::small_spec();
    const auto ranks = mkmodel::expert_ranks(s);
    ASSERT_EQ(ranks.size(), size_t{s.n_layers} * s.n_experts);
    for (uint32_t l = 0; l < s.n_layers; ++l) {
        std::set<uint32_t> seen(ranks.begin() + l * s.n_experts, ranks.begin() + (l + 1) * s.n_experts);
        EXPECT_EQ(seen.size(), s.n_experts);
        EXPECT_EQ(*seen.rbegin(), s.n_experts - 1);
    }
    // Layers are ranked independently.
    EXPECT_FALSE(std::equal(ranks.begin(), ranks.begin() + s.n_experts, ranks.begin() + s.n_experts));
}

TEST(MkModel, SplitsFollowLlamaCppNaming) {
    test::TempDir dir;
    const auto files = test::write_model(test::small_spec(), dir.file("split.gguf"), 3);
    ASSERT_EQ(files.size(), 3u);
    EXPECT_EQ(files[0], dir.file("split-00001-of-00003.gguf"));
    EXPECT_EQ(files[2], dir.file("split-00003-of-00003.gguf"));
    size_t tensors = 0;
    for (uint32_t i = 0; i < 3; ++i) {
        auto f = read_gguf(files[i]);
        ASSERT_TRUE(f) << f.error().what();
        EXPECT_EQ(*f->get_uint("split.no"), i);
        EXPECT_EQ(*f->get_uint("split.count"), 3u);
        EXPECT_GT(f->tensors.size(), 0u);
        tensors += f->tensors.size();
        // Only the first part carries the model's metadata, as llama.cpp's gguf-split writes it.
        EXPECT_EQ(f->find("general.architecture") != nullptr, i == 0);
    }
    auto parts = open_gguf_model(files[1]);
    ASSERT_TRUE(parts) << parts.error().what();
    EXPECT_EQ(parts->size(), 3u);
    EXPECT_EQ(*parts->front().get_uint("split.tensors.count"), tensors);
}

TEST(MkModel, PresetsMeetTheirPublishedCoverage) {
    const auto* p = mkmodel::find_preset("deepseek-v4-flash");
    ASSERT_NE(p, nullptr);
    for (auto [experts, used] : {std::pair{64u, 4u}, std::pair{128u, 8u}, std::pair{32u, 2u}}) {
        const auto skew = mkmodel::fit_skew(*p, experts, used);
        // Judged on fresh noise, not the noise it was fitted on.
        const auto curve = mkmodel::coverage_curve(mkmodel::simulate_popularity(experts, used, skew, 20000, 99));
        SCOPED_TRACE(testing::Message() << experts << " experts, " << used << " used");
        EXPECT_NEAR(mkmodel::coverage_at(curve, 0.125), 0.58, 0.03);
        EXPECT_NEAR(mkmodel::coverage_at(curve, 0.25), 0.71, 0.03);
    }
    const auto uniform = mkmodel::coverage_curve(
        mkmodel::simulate_popularity(64, 4, mkmodel::fit_skew(*mkmodel::find_preset("uniform"), 64, 4)));
    EXPECT_NEAR(mkmodel::coverage_at(uniform, 0.25), 0.25, 0.02);
}

TEST(MkModel, RealRoutingPresetsBringTheirShapeAndReuseUnlessTheOptionsSay) {
    test::TempDir dir;
    const auto r = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("q.gguf"), "--preset", "qwen3-next-like", "--layers", "1",
                              "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["n_experts"].get<uint32_t>(), 512u);
    EXPECT_EQ(j["n_experts_used"].get<uint32_t>(), 10u);
    EXPECT_GT(j["context"]["weight"].get<double>(), 0.0);
    // The options win over the preset's shape and reuse.
    const auto o = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("m.gguf"), "--preset", "mixtral-like", "--layers", "1",
                              "--experts", "16", "--context-weight", "0", "--json"});
    ASSERT_EQ(o.exit_code, 0) << o.err;
    const auto k = nlohmann::json::parse(o.out);
    EXPECT_EQ(k["n_experts"].get<uint32_t>(), 16u);
    EXPECT_EQ(k["n_experts_used"].get<uint32_t>(), 2u);
    EXPECT_EQ(k["context"]["weight"].get<double>(), 0.0);
    // Out-of-range settings are refused by name.
    for (const auto& [flag, value] : {std::pair{"--context-window", "0"}, std::pair{"--router-follow", "1"},
                                      std::pair{"--context-weight", "-1"}}) {
        const auto bad = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("bad.gguf"), "--layers", "1", flag, value});
        EXPECT_NE(bad.exit_code, 0) << flag;
        EXPECT_NE(bad.err.find(flag), std::string::npos) << bad.err;
    }
}

TEST(MkModel, ContextAndFollowAreOffByDefaultAndChangeTheModelWhenOn) {
    // The reuse and the layers' pairing are off by default (the routers' rows, attention and
    // metadata as before them, so older benchmarks' models and their layout stay as they were):
    // the same seed writes the same bytes as a model that names them off, and other bytes with
    // them on.
    test::TempDir dir;
    const auto a = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("a.gguf"), "--layers", "2", "--seed", "7"});
    const auto b = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("b.gguf"), "--layers", "2", "--seed", "7",
                              "--context-weight", "0", "--router-follow", "0"});
    ASSERT_EQ(a.exit_code, 0) << a.err;
    ASSERT_EQ(b.exit_code, 0) << b.err;
    EXPECT_EQ(test::read_file(dir.file("a.gguf")), test::read_file(dir.file("b.gguf")));
    const auto c = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("c.gguf"), "--layers", "2", "--seed", "7",
                              "--router-follow", "0.5"});
    ASSERT_EQ(c.exit_code, 0) << c.err;
    EXPECT_NE(test::read_file(dir.file("a.gguf")), test::read_file(dir.file("c.gguf")));
}

TEST(MkModel, StreamsLargeModelsInBoundedMemory) {
    test::TempDir dir;
    // 24 layers x 64 experts x 816 KiB: 1.2 GiB of experts, written by the real command.
    const auto r = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file("big.gguf"), "--layers", "24",
                              "--embd", "512", "--ff", "512", "--drop-cache", "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    EXPECT_GT(j["bytes"].get<uint64_t>(), 1ull << 30);
    // Peak RSS is the write buffer and the vocabulary, not the model.
    EXPECT_LT(r.max_rss_kib, 96 * 1024) << "peak RSS " << r.max_rss_kib << " KiB";
}

}  // namespace
}  // namespace moecache
