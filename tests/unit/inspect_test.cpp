// `moecachectl inspect --json` agrees with the generator's parameters, for several shapes, types
// and split models; run as a user would run it.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/gguf.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

namespace moecache {
namespace {

struct Shape {
    const char* label;
    uint32_t layers, experts, used, embd, ff, splits, type;
};

std::ostream& operator<<(std::ostream& os, const Shape& c) { return os << c.label; }

class InspectJson : public testing::TestWithParam<Shape> {};

nlohmann::json inspect(const std::string& model) {
    const auto r = test::run({MOECACHE_CTL_BIN, "inspect", model, "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return nlohmann::json::parse(r.out);
}

void read_all(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    std::vector<char> buf(1 << 20);
    while (::read(fd, buf.data(), buf.size()) > 0) {}
    ::close(fd);
}

TEST_P(InspectJson, AgreesWithTheGenerator) {
    const Shape& sh = GetParam();
    test::TempDir dir;
    mkmodel::ModelSpec s = test::small_spec();
    s.n_layers = sh.layers;
    s.n_experts = sh.experts;
    s.n_experts_used = sh.used;
    s.n_embd = sh.embd;
    s.n_ff_exp = sh.ff;
    s.expert_type = *ggml_type_info(sh.type);
    const auto files = test::write_model(s, dir.file("model.gguf"), sh.splits);
    // Any part opens the whole model.
    const auto j = inspect(files.back());

    EXPECT_EQ(j["architecture"], "qwen3moe");
    ASSERT_EQ(j["files"].size(), files.size());
    for (size_t i = 0; i < files.size(); ++i) EXPECT_EQ(j["files"][i], files[i]);
    EXPECT_EQ(j["n_layers"], sh.layers);
    EXPECT_EQ(j["n_experts"], sh.experts);
    EXPECT_EQ(j["n_experts_used"], sh.used);
    const uint64_t per_expert = mkmodel::bytes_per_expert(s);
    EXPECT_EQ(j["expert_bytes_total"], per_expert * sh.experts * sh.layers);

    // Every tensor's expert-0 offset and slice size, against the files' own directories.
    std::vector<GgufFile> parts;
    for (const auto& f : files) parts.push_back(*read_gguf(f));
    uint64_t all_tensor_bytes = 0;
    for (const auto& p : parts)
        for (const auto& t : p.tensors) all_tensor_bytes += t.nbytes;
    EXPECT_EQ(j["dense_bytes_total"].get<uint64_t>(), all_tensor_bytes - per_expert * sh.experts * sh.layers);

    ASSERT_EQ(j["layers"].size(), sh.layers);
    for (uint32_t l = 0; l < sh.layers; ++l) {
        const auto& lj = j["layers"][l];
        EXPECT_EQ(lj["index"], l);
        EXPECT_EQ(lj["expert_bytes"], per_expert * sh.experts);
        ASSERT_EQ(lj["tensors"].size(), 3u);
        for (const auto& tj : lj["tensors"]) {
            const std::string name = tj["name"];
            const std::string file = tj["file"];
            const GgufTensor* t = nullptr;
            for (size_t i = 0; i < parts.size(); ++i)
                if (files[i] == file) t = parts[i].find_tensor(name);
            ASSERT_NE(t, nullptr) << name << " not in " << file;
            EXPECT_EQ(tj["offset"].get<uint64_t>(), t->file_offset) << name;
            EXPECT_EQ(tj["bytes_per_expert"].get<uint64_t>(), t->nbytes / sh.experts) << name;
            EXPECT_EQ(t->type.id, sh.type);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, InspectJson,
    testing::Values(Shape{"q8_0", 4, 16, 2, 256, 256, 1, ggml::Q8_0},
                    Shape{"q4_0_split3", 6, 32, 4, 256, 128, 3, ggml::Q4_0},
                    Shape{"q4_K_split2", 3, 8, 8, 256, 512, 2, ggml::Q4_K},
                    Shape{"f16_one_expert_used", 2, 4, 1, 64, 64, 1, ggml::F16},
                    Shape{"q6_K_many_experts", 2, 128, 8, 256, 256, 1, ggml::Q6_K}),
    [](const auto& p) { return std::string(p.param.label); });

TEST(Inspect, ReportsPageCacheResidencyPerLayer) {
    test::TempDir dir;
    const auto files = test::write_model(test::small_spec(), dir.file("m.gguf"));
    test::drop_page_cache(files[0]);
    auto cold = inspect(files[0]);
    for (const auto& l : cold["layers"]) EXPECT_EQ(l["resident_bytes"], 0u);
    read_all(files[0]);
    auto warm = inspect(files[0]);
    for (const auto& l : warm["layers"]) EXPECT_EQ(l["resident_bytes"], l["expert_bytes"]);
}

TEST(Inspect, TableForPeople) {
    test::TempDir dir;
    const auto files = test::write_model(test::small_spec(), dir.file("m.gguf"));
    const auto r = test::run({MOECACHE_CTL_BIN, "inspect", files[0]});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (const char* want : {"qwen3moe", "16 per layer, 2 used per token", "bytes per expert", "routed experts",
                             "page cache by"})
        EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
}

// A file from a newer ggml (an expert tensor of a type this build does not know): inspect opens
// it and names the tensor, in the table and in the JSON.
TEST(Inspect, TensorsOfANewerGgmlTypeAreNamed) {
    test::TempDir dir;
    const auto files = test::write_model(test::small_spec(), dir.file("m.gguf"));
    auto file = read_gguf(files[0]);
    ASSERT_TRUE(file) << file.error().what();
    const GgufTensor* t = nullptr;
    for (const auto& x : file->tensors)
        if (x.name.find("_exps") != std::string::npos) t = &x;
    ASSERT_NE(t, nullptr);
    const uint64_t type_at = t->info_offset + 8 + t->name.size() + 4 + 8 * t->n_dims;
    const int fd = ::open(files[0].c_str(), O_WRONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    const uint32_t newer = 77;
    ASSERT_EQ(::pwrite(fd, &newer, sizeof newer, static_cast<off_t>(type_at)), 4);
    ::close(fd);
    const auto j = inspect(files[0]);
    ASSERT_EQ(j["unknown_type_tensors"].size(), 1u) << j.dump();
    EXPECT_EQ(j["unknown_type_tensors"][0]["name"], t->name);
    EXPECT_EQ(j["unknown_type_tensors"][0]["type_id"], 77u);
    EXPECT_EQ(j["unknown_type_tensors"][0]["routed_expert"], true);
    const auto r = test::run({MOECACHE_CTL_BIN, "inspect", files[0]});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("ggml types this build does not know, such as 77 of '" + t->name + "'"), std::string::npos)
        << r.out;
}

TEST(Inspect, ErrorsAndExitCodes) {
    test::TempDir dir;
    test::write_file(dir.file("not.gguf"), "this is not a model");
    auto r = test::run({MOECACHE_CTL_BIN, "inspect", dir.file("not.gguf")});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find(dir.file("not.gguf")), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("magic"), std::string::npos) << r.err;

    r = test::run({MOECACHE_CTL_BIN, "inspect", dir.file("missing.gguf")});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find("No such file"), std::string::npos) << r.err;

    EXPECT_EQ(test::run({MOECACHE_CTL_BIN, "inspect"}).exit_code, 2);
    EXPECT_EQ(test::run({MOECACHE_CTL_BIN, "inspect", "a", "--bogus"}).exit_code, 2);
    EXPECT_EQ(test::run({MOECACHE_CTL_BIN, "frobnicate"}).exit_code, 2);
    const auto help = test::run({MOECACHE_CTL_BIN, "help"});
    EXPECT_EQ(help.exit_code, 0);
    EXPECT_NE(help.out.find("inspect"), std::string::npos);
    const auto inspect_help = test::run({MOECACHE_CTL_BIN, "help", "inspect"});
    EXPECT_EQ(inspect_help.exit_code, 0);
    EXPECT_NE(inspect_help.out.find("usage: moecachectl inspect MODEL"), std::string::npos) << inspect_help.out;
}

}  // namespace
}  // namespace moecache
