// The reference GGUF runtime (llama.cpp inside node-llama-cpp) loads generated models and
// generates text: single files, split sets, and the expert types the generator writes.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace moecache {
namespace {

bool runtime_installed() {
    return std::filesystem::exists(std::string(MOECACHE_NODE_DIR) + "/node_modules/node-llama-cpp/package.json");
}

struct Case {
    const char* label;
    uint32_t type;
    uint32_t splits;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.label; }

class LlamaRuntime : public testing::TestWithParam<Case> {};

TEST_P(LlamaRuntime, GeneratesFromAGeneratedModel) {
    if (!runtime_installed())
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                     << ": run scripts/setup/install-deps.sh";
    test::TempDir dir;
    auto spec = test::small_spec();
    spec.expert_type = *ggml_type_info(GetParam().type);
    const auto files = test::write_model(spec, dir.file("model.gguf"), GetParam().splits);
    const auto r = test::run({"node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", files[0],
                              "--tokens", "48", "--threads", "1"},
                             {}, 240);
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["tokens"], 48) << r.out;
    const std::string text = j["text"];
    EXPECT_GT(text.size(), 48u) << text;
    EXPECT_GT(j["decode_tokens_per_second"].get<double>(), 1.0);
}

INSTANTIATE_TEST_SUITE_P(Models, LlamaRuntime,
                         testing::Values(Case{"q8_0", ggml::Q8_0, 1}, Case{"q4_0_split3", ggml::Q4_0, 3},
                                         Case{"q4_K", ggml::Q4_K, 1}),
                         [](const auto& p) { return std::string(p.param.label); });

}  // namespace
}  // namespace moecache
