// libmoecache-ggml.so in a real llama.cpp (node-llama-cpp's release, which it was built against):
// loaded from GGML_BACKEND_PATH, given the expert tensors by the loader (an accelerator's host
// buffer type over the model's mapping comes first for the CPU's weights), and the text it
// generates is the text llama.cpp generates without it: every expert on the CPU, and split between
// a pool (a CPU device standing in for the GPU) and the CPU.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <regex>

namespace moecache {
namespace {

struct Generated {
    std::string text, err;
};

Generated generate(const std::string& model, const std::vector<std::string>& env) {
    const auto r = test::run({"node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", model, "--tokens",
                              "40", "--threads", "1", "--seed", "5"},
                             env, 240);
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    if (r.exit_code != 0 || r.out.find('{') == std::string::npos) return {"", r.err};
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    return {j["text"].get<std::string>(), r.err};
}

TEST(GgmlBackendRuntime, LlamaCppGeneratesTheSameTextWithTheExpertsInTheBackend) {
    if (!std::filesystem::exists(std::string(MOECACHE_NODE_DIR) + "/node_modules/node-llama-cpp/package.json"))
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                     << ": run scripts/setup/install-deps.sh";
    test::TempDir dir;
    auto spec = test::small_spec();
    spec.expert_type = *ggml_type_info(ggml::Q4_K);
    const auto model = test::write_model(spec, dir.file("model.gguf"), 1)[0];
    const std::string lib = std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO;

    const auto plain = generate(model, {});
    ASSERT_FALSE(plain.text.empty());
    const auto cpu = generate(model, {lib, "MOECACHE_GGML_DEVICE=none", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(cpu.text, plain.text) << cpu.err;
    EXPECT_NE(cpu.err.find("expert rows computed"), std::string::npos) << "the backend was not loaded: " << cpu.err;

    const auto split = generate(model, {lib, "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=50%", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(split.text, plain.text) << split.err;
    // Every expert tensor reached the backend (3 a layer), and rows came from the pool and the CPU.
    EXPECT_NE(split.err.find("(" + std::to_string(3 * spec.n_layers) + " tensors)"), std::string::npos) << split.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(split.err, m, std::regex(R"((\d+) expert rows computed: ([\d.]+) % from the pool)")))
        << split.err;
    EXPECT_GT(std::stod(m[2]), 5.0) << split.err;
    EXPECT_LT(std::stod(m[2]), 100.0) << split.err;
    // llama.cpp's scheduler gave it each layer's chain (up, gate, activation, down, weighting) as
    // one split, and nothing else: the halves join once a layer.
    ASSERT_TRUE(std::regex_search(split.err, m, std::regex(R"((\d+) splits as a layer's chain, (\d+) node by node)")))
        << split.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << split.err;
    EXPECT_EQ(std::stoul(m[2]), 0u) << split.err;
}

}  // namespace
}  // namespace moecache
