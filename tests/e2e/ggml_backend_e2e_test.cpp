// libmoecache-ggml.so in a real llama.cpp (node-llama-cpp's release, which it was built against):
// loaded from GGML_BACKEND_PATH and given the expert tensors by the loader (an accelerator's host
// buffer type over the model's mapping comes first for the CPU's weights). The text it generates
// with a pool (a CPU device standing in for the GPU: the prompt's misses staged there, decode split
// between the pool and the CPU) is the text it generates with every expert on the CPU, byte for
// byte. (Not llama.cpp's own CPU text: without the backend, llama.cpp repacks CPU experts into its
// interleaved layout, whose kernels sum in another order; with -ot exps=CPU, as GPU users run it,
// it does not, and the backend's CPU half is ggml-cpu's MUL_MAT_ID: tests/ggml/backend_test.cpp.)
#include "daemon_fixture.h"
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/daemon/daemon.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>

namespace moecache {
namespace {

struct Generated {
    std::string text, err;
};

// Every test runs node-llama-cpp's llama.cpp: skipped, saying so, where it is not installed.
class GgmlBackendRuntime : public ::testing::Test {
protected:
    void SetUp() override {
        if (!std::filesystem::exists(std::string(MOECACHE_NODE_DIR) + "/node_modules/node-llama-cpp/package.json"))
            GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                         << ": run scripts/setup/install-deps.sh";
    }
};

// The tests' small model (4 layers of 16 experts, 2 a token), experts in q4_K.
std::string small_model(test::TempDir& dir) {
    auto spec = test::small_spec();
    spec.expert_type = *ggml_type_info(ggml::Q4_K);
    return test::write_model(spec, dir.file("model.gguf"), 1)[0];
}

// A prompt of 60-odd tokens: llama.cpp evaluates it as one batch, past the backend's large-batch mark.
constexpr const char* kPrompt =
    "the river ran past the old mill and the children watched the water turn the wheel while the miller "
    "counted sacks of grain and sang about the rain that would come in spring to fill the ponds again";

// No hot profile unless a test asks for one: none read from, or left in, the user's cache.
Generated generate(const std::string& model, std::vector<std::string> env) {
    if (std::none_of(env.begin(), env.end(), [](const std::string& e) { return e.rfind("MOECACHE_GGML_PROFILE=", 0) == 0; }))
        env.emplace_back("MOECACHE_GGML_PROFILE=off");
    const auto r = test::run({"node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", model, "--tokens",
                              "40", "--threads", "1", "--seed", "5", "--prompt", kPrompt},
                             env, 240);
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    if (r.exit_code != 0 || r.out.find('{') == std::string::npos) return {"", r.err};
    const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    return {j["text"].get<std::string>(), r.err};
}

TEST_F(GgmlBackendRuntime, LlamaCppGeneratesTheSameTextWithAPoolAsWithEveryExpertOnTheCpu) {
    test::TempDir dir;
    const auto model = small_model(dir);
    const std::string lib = std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO;

    const auto cpu = generate(model, {lib, "MOECACHE_GGML_DEVICE=none", "MOECACHE_GGML_LOG=1"});
    ASSERT_FALSE(cpu.text.empty());
    EXPECT_NE(cpu.err.find("expert rows computed"), std::string::npos) << "the backend was not loaded: " << cpu.err;

    const auto split = generate(model, {lib, "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=50%", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(split.text, cpu.text) << split.err;
    // Every expert tensor reached the backend (3 a layer), and rows came from the pool and the CPU.
    EXPECT_NE(split.err.find("(" + std::to_string(3 * test::small_spec().n_layers) + " tensors)"), std::string::npos)
        << split.err;
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
    // The prompt, one large batch, ran on the device whole: its misses were staged there.
    ASSERT_TRUE(std::regex_search(split.err, m, std::regex(R"((\d+) slices staged for large batches)"))) << split.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << split.err;
    // Decode's misses: some crossed to the device (the CPU stand-in hardly keeps the CPU waiting,
    // so the share grows). (How many went into the pool depends on the pool's own thread's pace.)
    const std::regex crossed(R"((\d+) of small batches' misses crossed the link to the device)");
    ASSERT_TRUE(std::regex_search(split.err, m, crossed)) << split.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << split.err;
    // The CPU computed its rows alone (no filler rows) in every chain of this model's shape.
    ASSERT_TRUE(std::regex_search(split.err, m, std::regex(R"(CPU halves: (\d+) as their rows alone, (\d+) with fillers)")))
        << split.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << split.err;
    EXPECT_EQ(std::stoul(m[2]), 0u) << split.err;
    // Both ways of computing a small batch's misses were tried and timed: every miss crossing (about
    // one chain in 16 while the split is faster) and the split between the CPU and the link.
    ASSERT_TRUE(std::regex_search(
        split.err, m, std::regex(R"(chains with misses: (\d+) with every miss crossing, [\d.]+ ms each; (\d+) split)")))
        << split.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << split.err;
    EXPECT_GT(std::stoul(m[2]), 0u) << split.err;

    // None crossing: every miss on the CPU, the same text; the CPU half on the threads asked for.
    const auto kept = generate(model, {lib, "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=50%",
                                       "MOECACHE_GGML_CROSS=0%", "MOECACHE_GGML_THREADS=1", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(kept.text, cpu.text) << kept.err;
    ASSERT_TRUE(std::regex_search(kept.err, m, crossed)) << kept.err;
    EXPECT_EQ(std::stoul(m[1]), 0u) << kept.err;
    EXPECT_TRUE(std::regex_search(kept.err, std::regex(R"(on 1 threads of the runtime's \d+)"))) << kept.err;
}

// A lazily loaded model (the re-arm preload's MOECACHE_LOAD=lazy: the mapping reads at random, a
// fault is one 4 KiB read): the misses the CPU computes are read ahead from the file, without the
// pool's lock, and the text is the CPU's.
TEST_F(GgmlBackendRuntime, ALazilyLoadedModelsMissesAreReadAheadAndTheTextIsTheSame) {
    test::TempDir dir;
    const auto model = small_model(dir);
    const std::string lib = std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO;
    const auto cpu = generate(model, {lib, "MOECACHE_GGML_DEVICE=none"});
    ASSERT_FALSE(cpu.text.empty());

    test::drop_page_cache(model);
    const auto lazy = generate(
        model, {lib, std::string("LD_PRELOAD=") + MOECACHE_REARM_LIB, "MOECACHE_REARM_EXE=node", "MOECACHE_LOAD=lazy",
                "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=50%", "MOECACHE_GGML_PIN=off", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(lazy.text, cpu.text) << lazy.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        lazy.err, m, std::regex(R"((\d+) slices of misses read ahead of their use \(([\d.]+) GiB read\))")))
        << "no miss was read ahead: was the mapping read at random (lazy)?\n"
        << lazy.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << lazy.err;
}

// A restart keeps the hot set: the first run saves its heat as a hot profile (the hook's format,
// named by the model's content) when llama.cpp frees the model; the next run's pool starts from it,
// its hottest experts queued to fill the pool before any miss; the text is the same. A profile that
// is not one is said and written anew, never a failure.
TEST_F(GgmlBackendRuntime, TheNextRunsPoolStartsFromTheLastRunsHotSet) {
    test::TempDir dir;
    const auto model = small_model(dir);
    const std::string profiles = dir.file("profiles");
    const std::vector<std::string> env = {std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO,
                                          "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=50%", "MOECACHE_GGML_LOG=1",
                                          "MOECACHE_GGML_PROFILE=" + profiles};
    const auto first = generate(model, env);
    ASSERT_FALSE(first.text.empty());
    EXPECT_NE(first.err.find("hot profile saved (" + profiles + "/"), std::string::npos) << first.err;
    EXPECT_EQ(first.err.find("starts from the hot set"), std::string::npos) << first.err;
    std::vector<std::filesystem::path> files;
    for (const auto& f : std::filesystem::directory_iterator(profiles)) files.push_back(f.path());
    ASSERT_EQ(files.size(), 1u);

    const auto second = generate(model, env);
    EXPECT_EQ(second.text, first.text) << second.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(second.err, m, std::regex(R"(starts from the hot set of earlier runs \(.*, (\d+) routings\): (\d+) experts queued)")))
        << second.err;
    EXPECT_GT(std::stoul(m[1]), 0u) << second.err;
    EXPECT_GT(std::stoul(m[2]), 0u) << second.err;

    {  // a damaged profile: said, not used, written anew
        std::ofstream out(files[0], std::ios::trunc);
        out << "moecache-hot-profile 1 layers 9999999 experts 3 routings x\n";
    }
    const auto third = generate(model, env);
    EXPECT_EQ(third.text, first.text) << third.err;
    EXPECT_NE(third.err.find("the hot profile is not used"), std::string::npos) << third.err;
    EXPECT_NE(third.err.find("hot profile saved"), std::string::npos) << third.err;
}

TEST_F(GgmlBackendRuntime, ARuntimeOfAnotherGgmlOrABadSettingRunsOnAndIsToldWhy) {
    test::TempDir dir;
    const auto model = small_model(dir);
    const auto reference = generate(model, {std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO,
                                            "MOECACHE_GGML_DEVICE=none"});
    ASSERT_FALSE(reference.text.empty());

    // Built against another ggml: not loaded (ggml's loader goes on without it), and says both.
    const auto other = generate(model, {std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_MISMATCH_SO});
    EXPECT_FALSE(other.text.empty());
    EXPECT_NE(other.err.find("built against ggml 0.0.0-test"), std::string::npos) << other.err;
    EXPECT_NE(other.err.find("this runtime's ggml is 0."), std::string::npos) << other.err;
    EXPECT_EQ(other.err.find("expert rows computed"), std::string::npos) << other.err;

    // A setting it cannot read: the pool is off, every expert on the CPU, the setting named.
    const auto bad = generate(model, {std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO,
                                      "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=lots", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(bad.text, reference.text) << bad.err;
    EXPECT_NE(bad.err.find("MOECACHE_GGML_POOL=lots: not a size"), std::string::npos) << bad.err;
    EXPECT_NE(bad.err.find("0.0 % from the pool"), std::string::npos) << bad.err;
    const auto bad_cross = generate(model, {std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO,
                                            "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_CROSS=nan%", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(bad_cross.text, reference.text) << bad_cross.err;
    EXPECT_NE(bad_cross.err.find("MOECACHE_GGML_CROSS=nan%: not auto or a share"), std::string::npos) << bad_cross.err;
    const auto bad_threads = generate(model, {std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO,
                                              "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_THREADS=-2", "MOECACHE_GGML_LOG=1"});
    EXPECT_EQ(bad_threads.text, reference.text) << bad_threads.err;
    EXPECT_NE(bad_threads.err.find("MOECACHE_GGML_THREADS=-2: not auto or a thread count"), std::string::npos)
        << bad_threads.err;
}

// The backend speaks to moecached as the hook does: the daemon hears which experts each layer's
// router picked, and which experts the pool holds (one place: it keeps those out of RAM).
TEST_F(GgmlBackendRuntime, ReportsRoutingAndWhatThePoolHoldsToMoecached) {
    if (::geteuid() != 0) GTEST_SKIP() << "moecached locks memory: root";
    test::TempDir dir;
    const auto model = small_model(dir);
    auto c = test::daemon_config(model, dir.file("state"), 64u << 20);
    auto d = daemon::Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();

    test::Background node({"/usr/bin/env", std::string("GGML_BACKEND_PATH=") + MOECACHE_GGML_BACKEND_SO,
                           "MOECACHE_GGML_DEVICE=CPU", "MOECACHE_GGML_POOL=50%", "MOECACHE_GGML_PROFILE=off",
                           "MOECACHE_SOCKET=" + c.socket_path,
                           "node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", model, "--tokens", "2000",
                           "--threads", "1", "--seed", "5"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
    int rc = -1;
    uint64_t uses = 0, held = 0;
    while (std::chrono::steady_clock::now() < deadline) {
        ASSERT_TRUE((*d)->step(20));
        const auto s = (*d)->status();
        uses = held = 0;
        for (const auto& e : s.models.at(0).experts) {
            uses += e.uses;
            held += e.vram_holders > 0 ? 1 : 0;
        }
        rc = node.wait(0.01);
        if (rc != -1 || (uses > 0 && held > 0)) break;
    }
    if (rc == -1) rc = node.wait(120);
    ASSERT_EQ(rc, 0) << node.output();
    EXPECT_GT(uses, 0u) << "no routing reached the daemon: " << node.output();
    EXPECT_GT(held, 0u) << "no expert the pool holds was reported: " << node.output();
}

}  // namespace
}  // namespace moecache
