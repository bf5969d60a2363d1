// The routing skew a generated model asks for is the skew a real llama.cpp routes with: measured
// inside node-llama-cpp by libmoecache-routeprobe.so (per-decode sentinel pages, see
// tools/routeprobe/include/moecache/routeprobe/route_probe.h), per layer and expert.
#include "moecache/sim/synthetic.h"
#include "moecache/sim/trace.h"
#include "moecache/tracegen/tracegen.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace moecache {
namespace {

bool runtime_installed() {
    return std::filesystem::exists(std::string(MOECACHE_NODE_DIR) + "/node_modules/node-llama-cpp/package.json");
}

// Generates a q8_0 model of the preset (default shape: 8 layers x 64 experts, 4 used; expert
// slices of 68 KiB) and runs `tokens` decode steps with the probe preloaded. Fills the report.
void measure(const test::TempDir& dir, const std::string& preset, int tokens, nlohmann::json& report) {
    const std::string model = dir.file(preset + ".gguf");
    const std::string out = dir.file(preset + ".routing.json");
    const auto mk = test::run({MOECACHE_MKMODEL_BIN, "--output", model, "--preset", preset, "--layers", "8",
                               "--experts-used", "4", "--expert-type", "q8_0"});
    ASSERT_EQ(mk.exit_code, 0) << mk.err;
    const auto r = test::run({"node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", model, "--tokens",
                              std::to_string(tokens), "--threads", "1", "--seed", "1"},
                             {std::string("LD_PRELOAD=") + MOECACHE_ROUTEPROBE_LIB, "MOECACHE_ROUTEPROBE_MODEL=" + model,
                              "MOECACHE_ROUTEPROBE_OUT=" + out},
                             180);
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    ASSERT_TRUE(std::filesystem::exists(out)) << "the probe wrote no report; its stderr:\n" << r.err;
    report = nlohmann::json::parse(test::read_file(out));
    // Enough single-token steps for the statistics below (sampling may end early on </s>).
    ASSERT_GE(report["single_token_steps"].get<int>(), tokens / 2) << r.out;
    const double n_used = report["n_experts_used"].get<double>();
    const double seen = report["mean_experts_per_layer_per_step"].get<double>();
    // The probe's self-check: above n_used, pages of unread experts were mapped by the faults of
    // read ones (fault-around, large folios); below, the weights were not read from the mapping.
    EXPECT_GE(seen, n_used) << report.dump(1);
    EXPECT_LE(seen, n_used + 0.5) << report.dump(1);
    // gate, up and down of a routed expert are all read.
    EXPECT_EQ(report["tensor_disagreements"].get<uint64_t>(), 0u);
    std::cout << "[ measured ] " << preset << ": " << report["single_token_steps"] << " steps, "
              << seen << " experts per layer per step, coverage " << report["coverage"].dump()
              << ", split-half " << report["coverage_split_half"].dump() << ", spearman "
              << report["spearman_mean"].dump() << ", intended " << report["intended"]["predicted_coverage"].dump()
              << "\n";
}

TEST(RoutingCoverage, DeepseekPresetRoutesAsPublished) {
    if (!runtime_installed())
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                     << ": run scripts/setup/install-deps.sh";
    test::TempDir dir;
    nlohmann::json report;
    // 1000 steps, not fewer: the tail of the ranking (ranks 30-63 differ by 0.3 logit in all) needs
    // them for its order to show; with 300 the Spearman of even an ideal router averages ~0.87.
    ASSERT_NO_FATAL_FAILURE(measure(dir, "deepseek-v4-flash", 1000, report));
    // DESIGN.md: the hottest 12.5 % of a layer's experts take ~58 % of routings, 25 % ~71 %.
    EXPECT_NEAR(report["coverage"]["0.125"].get<double>(), 0.58, 0.10);
    EXPECT_NEAR(report["coverage"]["0.25"].get<double>(), 0.71, 0.10);
    ASSERT_FALSE(report["spearman_mean"].is_null()) << "the model carries no moecache.mkmodel.expert_rank";
    EXPECT_GT(report["spearman_mean"].get<double>(), 0.8) << report.dump(1);
}

TEST(RoutingCoverage, UniformPresetIsNotSkewed) {
    if (!runtime_installed())
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                     << ": run scripts/setup/install-deps.sh";
    test::TempDir dir;
    nlohmann::json report;
    ASSERT_NO_FATAL_FAILURE(measure(dir, "uniform", 600, report));
    EXPECT_LT(report["coverage"]["0.125"].get<double>(), 0.25) << report.dump(1);
}

// A preset of routing as real models' router logs show it (docs/routing.md), run by llama.cpp with
// the probe recording every decode step as a trace: its statistics as moecache-tracegen --stats
// prints them.
tracegen::Stats measure_trace(const test::TempDir& dir, const std::string& preset, const std::string& layers, int tokens,
                              const tracegen::MeasureOptions& options) {
    const std::string model = dir.file(preset + ".gguf"), trace = dir.file(preset + ".jsonl");
    const auto mk = test::run({MOECACHE_MKMODEL_BIN, "--output", model, "--preset", preset, "--layers", layers});
    EXPECT_EQ(mk.exit_code, 0) << mk.err;
    const auto r = test::run({"node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", model, "--tokens",
                              std::to_string(tokens), "--threads", "1", "--seed", "1"},
                             {std::string("LD_PRELOAD=") + MOECACHE_ROUTEPROBE_LIB, "MOECACHE_ROUTEPROBE_MODEL=" + model,
                              "MOECACHE_ROUTEPROBE_OUT=" + dir.file(preset + ".json"), "MOECACHE_ROUTEPROBE_TRACE=" + trace},
                             300);
    EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
    auto t = sim::read_trace(trace);
    if (!t) {
        ADD_FAILURE() << t.error().what() << "\n" << r.err;
        return {};
    }
    if (t->models.empty()) {
        ADD_FAILURE() << "no model line in " << trace;
        return {};
    }
    auto routing = sim::routing_of(*t, t->models[0]);
    if (!routing) {
        ADD_FAILURE() << routing.error().what();
        return {};
    }
    EXPECT_GE(routing->tokens, static_cast<uint64_t>(tokens) * 9 / 10);
    const auto st = tracegen::measure(*routing, options);
    std::cout << "[ measured ] " << preset << ": top 1/8 " << st.top_eighth << ", 2/8 " << st.top_quarter << ", reuse "
              << st.reuse << " (chance " << st.reuse_chance << "), next layer " << st.next_layer << ", static top-"
              << st.static_top << " " << st.static_cover << " (chance " << st.static_chance << "), LRU";
    for (size_t i = 0; i < st.lru_slots.size(); ++i) std::cout << " " << st.lru_slots[i] << ": " << st.lru_hits[i];
    std::cout << "\n";
    return st;
}

// Within 20 % (relative) of the published figure.
void expect_near_figure(double measured, double figure, const char* what) {
    EXPECT_NEAR(measured, figure, 0.2 * figure) << what;
}

TEST(RoutingStatistics, MixtralLikePresetRoutesAsMixtralsRouterLog) {
    if (!runtime_installed())
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                     << ": run scripts/setup/install-deps.sh";
    test::TempDir dir;
    const auto st = measure_trace(dir, "mixtral-like", "8", 1000, {});
    // docs/routing.md: Mixtral-8x7B's decode.
    expect_near_figure(st.top_eighth, 0.20, "the hottest 1/8's share");
    expect_near_figure(st.top_quarter, 0.36, "the hottest 2/8's share");
    expect_near_figure(st.reuse, 0.36, "experts the previous token used");
    expect_near_figure(st.reuse_chance, 0.25, "the same by chance");
    expect_near_figure(st.next_layer, 0.44, "predictable from the layer before");
}

TEST(RoutingStatistics, Qwen3NextLikePresetHasWeakStaticSkewAndStrongReuse) {
    if (!runtime_installed())
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR
                     << ": run scripts/setup/install-deps.sh";
    test::TempDir dir;
    // Two layers: the context every router reads is layer 0's, so each layer routes alike.
    const auto st = measure_trace(dir, "qwen3-next-like", "2", 1000, tracegen::MeasureOptions{32, {64}});
    // docs/routing.md: llama.cpp PR 27861's 512-expert model.
    expect_near_figure(st.static_cover, 0.10, "a static top-32 learnt on the first half, on the second");
    expect_near_figure(st.static_chance, 0.0625, "the same by chance");
    ASSERT_EQ(st.lru_hits.size(), 1u);
    expect_near_figure(st.lru_hits[0], 0.67, "a per-layer LRU of 64");
}

}  // namespace
}  // namespace moecache
