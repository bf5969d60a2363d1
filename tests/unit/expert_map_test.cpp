// The expert map: every expert's byte ranges, address -> expert lookup, shared experts and dense
// tensors accounted apart, metadata cross-checked against tensor shapes.
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/gguf.h"
#include "moecache/model.h"
#include "moecache/text.h"
#include "moecache/unique_fd.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <map>
#include <random>

namespace moecache {
namespace {

using mkmodel::GgufWriter;
using mkmodel::TensorSpec;

mkmodel::RowFiller zeros(uint64_t row_bytes) {
    return [row_bytes](uint64_t, uint64_t n, uint8_t* out) { std::fill(out, out + n * row_bytes, 0); };
}

void add(GgufWriter& w, std::string name, uint32_t type, std::vector<int64_t> ne) {
    TensorSpec t{std::move(name), *ggml_type_info(type), std::move(ne), {}};
    t.fill = zeros(t.row_bytes());
    w.add_tensor(std::move(t));
}

// A DeepSeek-shaped file: one leading dense block, then MoE blocks with a shared expert, a
// routing bias, and bias companions of the expert tensors.
Result<ExpertMap> deepseek_like(const std::string& path, uint32_t declared_experts = 8,
                                uint32_t leading_dense = 1, uint32_t used = 2, const std::string& name = "") {
    GgufWriter w;
    w.add("general.architecture", std::string("deepseek2"));
    if (!name.empty()) w.add("general.name", name);
    w.add("deepseek2.block_count", 3u);
    w.add("deepseek2.expert_count", declared_experts);
    w.add("deepseek2.expert_used_count", used);
    w.add("deepseek2.expert_shared_count", 1u);
    w.add("deepseek2.leading_dense_block_count", leading_dense);
    add(w, "token_embd.weight", ggml::F16, {64, 100});
    add(w, "blk.0.ffn_gate.weight", ggml::Q8_0, {64, 128});
    for (int b = 1; b < 3; ++b) {
        const std::string p = "blk." + std::to_string(b) + ".";
        add(w, p + "ffn_gate_inp.weight", ggml::F32, {64, 8});
        add(w, p + "exp_probs_b.bias", ggml::F32, {8});
        add(w, p + "ffn_gate_exps.weight", ggml::Q4_K, {256, 32, 8});
        add(w, p + "ffn_gate_exps.bias", ggml::F32, {32, 8});
        add(w, p + "ffn_up_exps.weight", ggml::Q4_K, {256, 32, 8});
        add(w, p + "ffn_down_exps.weight", ggml::Q8_0, {32, 256, 8});
        add(w, p + "ffn_gate_shexp.weight", ggml::Q8_0, {64, 64});
        add(w, p + "ffn_down_shexp.weight", ggml::Q8_0, {64, 64});
    }
    mkmodel::WriteOptions opt;
    opt.alignment = 64;
    if (auto r = w.write(path, opt); !r) return tl::unexpected(r.error());
    return load_expert_map(path);
}

TEST(ExpertMap, DeepSeekShapeAccountsEveryPart) {
    test::TempDir dir;
    auto m = deepseek_like(dir.file("ds.gguf"));
    ASSERT_TRUE(m) << m.error().what();
    EXPECT_EQ(m->architecture, "deepseek2");
    EXPECT_EQ(m->n_leading_dense, 1u);
    EXPECT_EQ(m->n_experts_shared, 1u);
    ASSERT_EQ(m->layers.size(), 2u);
    EXPECT_EQ(m->layers[0].index, 1u);
    const uint64_t gate = 256 / 256 * 144 * 32, bias = 32 * 4, down = 32 / 32 * 34 * 256;
    for (const auto& l : m->layers) {
        EXPECT_EQ(l.tensors.size(), 4u);  // gate, gate bias, up, down
        EXPECT_EQ(l.bytes_per_expert, gate + bias + gate + down);
        EXPECT_EQ(l.shared_expert_bytes, 2u * 64 * 34 / 32 * 64);
    }
    EXPECT_EQ(m->expert_bytes_total, 2 * 8 * (gate + bias + gate + down));
    EXPECT_EQ(m->shared_expert_bytes_total, 2 * 2u * 64 * 34 / 32 * 64);
    const uint64_t dense = 64 * 100 * 2 + 128 * 34 / 32 * 64 + 2 * (64 * 8 * 4 + 8 * 4);
    EXPECT_EQ(m->dense_bytes_total, dense);
    uint64_t file_bytes = 0;
    for (const auto& f : m->files) file_bytes += f.size;
    EXPECT_EQ(m->expert_bytes_total + m->shared_expert_bytes_total + m->dense_bytes_total + m->header_bytes_total,
              file_bytes);
}

// An expert tensor of a type this build does not know (a newer ggml's): the model opens, the
// tensor is reported, its bytes count with the dense part, and its layer's other tensors stay
// routed experts.
TEST(ExpertMap, AnExpertTensorOfANewerTypeIsReportedAndCountedAsDense) {
    test::TempDir dir;
    const std::string path = dir.file("ds.gguf");
    const auto before = deepseek_like(path);
    ASSERT_TRUE(before) << before.error().what();
    auto file = read_gguf(path);
    ASSERT_TRUE(file) << file.error().what();
    const GgufTensor* down = file->find_tensor("blk.1.ffn_down_exps.weight");
    ASSERT_NE(down, nullptr);
    // The type field: after the name (u64 length + bytes), n_dims (u32) and the dims (i64 each).
    const uint64_t type_at = down->info_offset + 8 + down->name.size() + 4 + 8 * down->n_dims;
    {
        UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
        ASSERT_TRUE(fd);
        const uint32_t newer = 1000;
        ASSERT_EQ(::pwrite(fd.get(), &newer, sizeof newer, static_cast<off_t>(type_at)), 4);
    }
    const auto m = load_expert_map(path);
    ASSERT_TRUE(m) << m.error().what();
    ASSERT_EQ(m->unknown_type_tensors.size(), 1u);
    const auto& u = m->unknown_type_tensors.front();
    EXPECT_EQ(u.name, "blk.1.ffn_down_exps.weight");
    EXPECT_EQ(u.type_id, 1000u);
    EXPECT_TRUE(u.expert);
    EXPECT_EQ(u.bytes, down->nbytes) << "its size is a multiple of the alignment here: the span is exact";
    ASSERT_EQ(m->layers.size(), 2u);
    EXPECT_EQ(m->layers[0].tensors.size(), 3u);
    EXPECT_EQ(m->layers[1].tensors.size(), 4u);
    EXPECT_EQ(m->expert_bytes_total, before->expert_bytes_total - down->nbytes);
    EXPECT_EQ(m->dense_bytes_total, before->dense_bytes_total + down->nbytes);
    EXPECT_FALSE(m->lookup(0, down->file_offset)) << "no expert is found in its bytes";
}

// A model's name is what every metric sample, log line, D-Bus reply and profile key carries: a
// general.name of megabytes (anyone may register a file of their own) is shown bounded, two long
// names that differ only past the bound stay apart, and a short one is as it is.
TEST(ExpertMap, ALongGeneralNameIsShownBoundedAndKeptApart) {
    test::TempDir dir;
    const std::string huge(8u << 20, 'n');
    auto a = deepseek_like(dir.file("a.gguf"), 8, 1, 2, huge + "a");
    auto b = deepseek_like(dir.file("b.gguf"), 8, 1, 2, huge + "b");
    auto c = deepseek_like(dir.file("c.gguf"), 8, 1, 2, "DeepSeek V4 Flash");
    ASSERT_TRUE(a && b && c);
    EXPECT_LE(a->name.size(), kMaxShownName);
    EXPECT_LE(a->profile_key().size(), kMaxShownName + 64);
    EXPECT_NE(a->name, b->name);
    EXPECT_NE(a->profile_key(), b->profile_key());
    EXPECT_EQ(c->name, "DeepSeek V4 Flash");
    EXPECT_EQ(shown_name("caf\xc3\xa9"), "caf\xc3\xa9");
    const std::string cut = shown_name(std::string(300, 'x') + "\xc3\xa9");
    EXPECT_EQ(cut.size(), kMaxShownName);
    EXPECT_EQ(cut[cut.size() - 17], '~');
}

// Counts past any model's are refused before anything is sized by them (a 4 MiB GGUF of 4.2
// million one-byte experts held the daemon's loop 13 s at registration, +430 MiB).
TEST(ExpertMap, LayersAndExpertsPastAnyModelAreRefused) {
    test::TempDir dir;
    auto with = [&](uint32_t blocks, uint32_t experts) {
        GgufWriter w;
        w.add("general.architecture", std::string("qwen3moe"));
        w.add("qwen3moe.block_count", blocks);
        w.add("qwen3moe.expert_count", experts);
        w.add("qwen3moe.expert_used_count", 1u);
        add(w, "blk.0.ffn_up_exps.weight", ggml::F32, {1, 1, static_cast<int64_t>(experts)});
        const std::string path = dir.file("m" + std::to_string(blocks) + "x" + std::to_string(experts) + ".gguf");
        EXPECT_TRUE(w.write(path, {}));
        return load_expert_map(path);
    };
    auto refused = [](const Result<ExpertMap>& m, const std::string& what) {
        ASSERT_FALSE(m) << "accepted";
        EXPECT_NE(m.error().what().find(what), std::string::npos) << m.error().what();
    };
    refused(with(2048, 8), "qwen3moe.block_count is 2048, more than any model's (1024)");
    refused(with(4, 70000), "qwen3moe.expert_count is 70000, more than any model's (8192)");
    refused(with(1000, 1000), "1000 x 1000 experts, more than any model's (262144)");
    EXPECT_TRUE(with(61, 384)) << "Kimi K2's shape";
}

TEST(ExpertMap, RangesAndLookupAreInverse) {
    test::TempDir dir;
    auto files = test::write_model(test::small_spec(), dir.file("m.gguf"), 2);
    auto m = load_expert_map(files[0]);
    ASSERT_TRUE(m) << m.error().what();
    ASSERT_EQ(m->layers.size(), 4u);
    std::mt19937_64 rng(5);
    for (const auto& l : m->layers) {
        for (uint32_t e = 0; e < m->n_experts; ++e) {
            const auto ranges = m->ranges(l.index, e);
            ASSERT_EQ(ranges.size(), 3u);
            for (const auto& r : ranges) {
                EXPECT_EQ(r.length, l.bytes_per_expert / 3);
                for (uint64_t at : {r.offset, r.offset + r.length - 1, r.offset + rng() % r.length}) {
                    const auto ref = m->lookup(r.file, at);
                    ASSERT_TRUE(ref.has_value()) << "file " << r.file << " byte " << at;
                    EXPECT_EQ(ref->layer, l.index);
                    EXPECT_EQ(ref->expert, e);
                }
            }
        }
    }
    EXPECT_FALSE(m->lookup(0, 0).has_value());  // the header
    EXPECT_FALSE(m->lookup(7, 0).has_value());  // no such file
    EXPECT_TRUE(m->ranges(99, 0).empty());
    EXPECT_TRUE(m->ranges(0, m->n_experts).empty());
}

// for_each_overlap against lookup() of every byte of random ranges (pages and large folios).
TEST(ExpertMap, OverlapsOfARangeAgreeWithLookupOfEachByte) {
    test::TempDir dir;
    auto files = test::write_model(test::small_spec(), dir.file("m.gguf"), 2);
    auto m = load_expert_map(files[0]);
    ASSERT_TRUE(m) << m.error().what();
    std::mt19937_64 rng(11);
    for (uint32_t file = 0; file < m->files.size(); ++file) {
        const uint64_t size = m->files[file].size;
        for (int i = 0; i < 200; ++i) {
            const uint64_t begin = rng() % size;
            const uint64_t len = 1 + rng() % (i % 2 ? 4096 : 300000);
            const uint64_t end = std::min(size, begin + len);
            std::map<std::pair<uint32_t, uint32_t>, uint64_t> want, got;
            uint64_t want_rest = 0;
            for (uint64_t at = begin; at < end; ++at) {
                if (const auto ref = m->lookup(file, at)) ++want[{ref->layer, ref->expert}];
                else ++want_rest;
            }
            const uint64_t rest = m->for_each_overlap(file, begin, end, [&](ExpertRef r, uint64_t bytes) {
                got[{r.layer, r.expert}] += bytes;
            });
            ASSERT_EQ(got, want) << "file " << file << " [" << begin << ", " << end << ")";
            ASSERT_EQ(rest, want_rest);
        }
    }
    EXPECT_EQ(m->for_each_overlap(0, 100, 100, [](ExpertRef, uint64_t) { FAIL(); }), 0u);
    EXPECT_EQ(m->for_each_overlap(9, 0, 4096, [](ExpertRef, uint64_t) { FAIL(); }), 4096u);  // no such file
}

TEST(ExpertMap, ExpertCountMustMatchTheTensorShapes) {
    test::TempDir dir;
    auto m = deepseek_like(dir.file("bad.gguf"), /*declared_experts=*/16);
    ASSERT_FALSE(m);
    EXPECT_NE(m.error().message.find("blk.1.ffn_gate_exps"), std::string::npos) << m.error().message;
    EXPECT_NE(m.error().message.find("deepseek2.expert_count"), std::string::npos) << m.error().message;
}

TEST(ExpertMap, ExpertsInALeadingDenseBlockAreAnError) {
    test::TempDir dir;
    auto m = deepseek_like(dir.file("bad.gguf"), 8, /*leading_dense=*/2);
    ASSERT_FALSE(m);
    EXPECT_NE(m.error().message.find("leading_dense_block_count"), std::string::npos) << m.error().message;
}

TEST(ExpertMap, MoreExpertsUsedThanExist) {
    test::TempDir dir;
    auto m = deepseek_like(dir.file("bad.gguf"), 8, 1, /*used=*/9);
    ASSERT_FALSE(m);
    EXPECT_NE(m.error().message.find("expert_used_count"), std::string::npos) << m.error().message;
}

TEST(ExpertMap, DenseModelHasNoLayers) {
    test::TempDir dir;
    GgufWriter w;
    w.add("general.architecture", std::string("llama"));
    w.add("llama.block_count", 1u);
    add(w, "blk.0.ffn_up.weight", ggml::F16, {64, 64});
    ASSERT_TRUE(w.write(dir.file("dense.gguf"), {}));
    auto m = load_expert_map(dir.file("dense.gguf"));
    ASSERT_TRUE(m) << m.error().what();
    EXPECT_TRUE(m->layers.empty());
    EXPECT_EQ(m->dense_bytes_total, 64u * 64 * 2);
}

}  // namespace
}  // namespace moecache
