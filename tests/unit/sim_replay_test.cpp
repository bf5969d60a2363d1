// moecache-sim's replay: the daemon's own policy (heat, planner, pool directives) and the CUDA
// hook's pool, run on a short synthetic trace and checked against LRU and LFU replayed on the same
// trace and budgets; the route predictor and the static baseline on patterns whose answers are
// known by hand; the cost model's accounting.
#include "temp_dir.h"

#include "moecache/daemon/decide.h"
#include "moecache/daemon/predictor.h"
#include "moecache/sim/replay.h"
#include "moecache/sim/synthetic.h"
#include "moecache/sim/table.h"

#include <gtest/gtest.h>

namespace moecache::sim {
namespace {

constexpr uint64_t kExpert = 1 << 20;

// The short traces' shape (8 layers x 64 experts, top-8, seed 7), fitted to `preset`.
tracegen::Spec preset_spec(const std::string& preset, uint64_t tokens) {
    tracegen::Spec shape;
    shape.n_layers = 8;
    shape.n_experts = 64;
    shape.n_used = 8;
    shape.tokens = tokens;
    shape.seed = 7;
    auto spec = tracegen::fit(*tracegen::find_preset(preset), shape);
    EXPECT_TRUE(spec) << spec.error().what();
    return spec ? *spec : shape;
}

Trace preset_trace(const std::string& preset, uint64_t tokens) {
    auto routing = tracegen::generate(preset_spec(preset, tokens));
    EXPECT_TRUE(routing) << routing.error().what();
    return trace_of(*routing, preset, kExpert, 25000);
}

// The CI check of issue 9: on a short trace, in both tiers at a quarter of the expert bytes, the
// policy is within a point of the better of LRU and LFU, and on the DeepSeek preset it closes
// most of the gap between LRU and hindsight.
TEST(SimReplay, ThePolicyKeepsUpWithLruAndLfuOnAShortTrace) {
    for (const char* preset : {"deepseek-v4-flash", "low-skew"}) {
        const Trace trace = preset_trace(preset, 1500);
        TableOptions opt;
        opt.budgets = {0.25};
        opt.max_points_below_best = 1.0;  // issue 9's targets
        const auto rows = table_rows(preset, trace, trace.models[0], opt);
        ASSERT_EQ(rows.size(), 2u);
        for (const auto& row : rows) {
            SCOPED_TRACE(fmt::format("{} {} 25 %", preset, row.tier));
            const double lru = row.tier_rate(row.baseline(Baseline::Lru));
            const double lfu = row.tier_rate(row.baseline(Baseline::Lfu));
            const double belady = row.tier_rate(row.baseline(Baseline::Belady));
            const double mine = row.tier_rate(row.policy());
            EXPECT_GT(row.tier_rate(row.moecache), 0.1) << "the policy held nothing";
            EXPECT_GE(mine, std::max(lru, lfu) - 0.01);
            EXPECT_LE(lfu, belady + 1e-9) << "hindsight is the bound for demand caching";
            EXPECT_FALSE(row.vs_best_points() < -opt.max_points_below_best);
            if (std::string(preset) == "deepseek-v4-flash") {
                EXPECT_GE(row.gap_closed(), 0.6);
                EXPECT_GT(lfu, lru + 0.05) << "on a skewed router frequency beats recency";
            }
        }
    }
}

// The table's targets (issue 40): within half a point of the better of LRU and LFU on every row;
// where the bound is known, within a point of it, or 75 % of the way to it from the better of LRU
// and LFU where that room is over 4 points.
TEST(SimReplay, TheTargetsAreIssue40s) {
    auto ram_row = [](uint64_t mine, uint64_t lru, uint64_t lfu, double bound) {
        TableRow r;
        r.trace = "some-trace";
        r.tier = "RAM";
        r.budget = 0.25;
        auto res = [](uint64_t hits) {
            SimResult x;
            x.accesses = 1000;
            x.ram_hits = hits;
            return x;
        };
        r.moecache = res(mine);
        r.predicted = res(mine / 2);  // the targets are the policy's as it ships, without prediction
        r.baselines = {res(lru), res(lfu), res(lfu), res(1000)};
        r.bound = bound;
        return r;
    };
    const TableOptions opt;
    EXPECT_TRUE(missed_targets(ram_row(800, 700, 780, -1), opt).empty()) << "above both, no bound known";
    EXPECT_EQ(missed_targets(ram_row(774, 700, 780, -1), opt).size(), 1u) << "0.6 points below LFU";
    EXPECT_TRUE(missed_targets(ram_row(791, 700, 780, 0.80), opt).empty()) << "0.9 points under the bound";
    EXPECT_EQ(missed_targets(ram_row(788, 700, 780, 0.80), opt).size(), 1u) << "1.2 points under a 2-point room";
    EXPECT_TRUE(missed_targets(ram_row(820, 700, 780, 0.83), opt).empty()) << "80 % of a 5-point room";
    EXPECT_EQ(missed_targets(ram_row(815, 700, 780, 0.83), opt).size(), 1u) << "70 % of a 5-point room";
    const auto both = missed_targets(ram_row(770, 700, 780, 0.83), opt);
    ASSERT_EQ(both.size(), 2u) << "below LFU and far from the bound";
    EXPECT_NE(both[1].find("6.0 points below the bound 83.0 %"), std::string::npos) << both[1];
}

// On each preset, at 25 and 50 % of the tier, the policy holds at least the better of LRU and LFU
// (within 0.5 point).
void expect_level_with_the_better_baseline(std::initializer_list<const char*> presets, const std::string& tier) {
    for (const char* preset : presets) {
        const Trace trace = preset_trace(preset, 2000);
        TableOptions opt;
        opt.budgets = {0.25, 0.5};
        for (const auto& row : table_rows(preset, trace, trace.models[0], opt)) {
            if (row.tier != tier) continue;
            SCOPED_TRACE(fmt::format("{} {} {:.0f} %", preset, tier, row.budget * 100));
            const double lru = row.tier_rate(row.baseline(Baseline::Lru));
            const double lfu = row.tier_rate(row.baseline(Baseline::Lfu));
            EXPECT_GE(row.tier_rate(row.moecache), std::max(lru, lfu) - 0.005) << "LRU " << lru << ", LFU " << lfu;
        }
    }
}

// Issue 22's recency: with RAM alone, routing with temporal locality (bursty: a layer keeps its
// previous token's experts) is held at least as well as LRU holds it, by the split the heat table
// learns between locks and the page cache's LRU; routing without it (uniform, Zipf-like) keeps up
// with LFU as before (a split taken for noise loses there).
TEST(SimReplay, RamFollowsRecencyWhereTheRoutingHasIt) {
    expect_level_with_the_better_baseline({"bursty", "uniform", "zipf-256"}, "RAM");
}

// And a VRAM pool: the daemon learns the pool's own split (at its size) and directs only the
// frequency part; the hook keeps the rest as an LRU. Bursty routing is then held as LRU holds it
// (it was 8 points below with the pool directed by heat alone), Zipf-like as LFU holds it.
TEST(SimReplay, APoolFollowsRecencyWhereTheRoutingHasIt) {
    expect_level_with_the_better_baseline({"bursty", "zipf-256"}, "VRAM");
}

// The same routing gives the same hit rates whatever an expert's bytes: the budgets are shares of
// the expert bytes, and a tick's turns run until nothing waits however few experts a turn locks.
// Before, a cached expert that waited a turn was named twice in the next turn's locks and counted
// twice, so the RAM the replay believed locked outgrew what it held: here, with a turn's locks 64
// experts (8 MiB each), 64.7 % at 25 % of RAM against 68.7 % with 1 MiB; on issue 22's Zipf family
// of 256 experts at 6 MiB, 2-3 points lost and 445 s for one RAM row of 3000 tokens.
TEST(SimReplay, HitRatesDoNotDependOnTheExpertBytes) {
    auto routing = tracegen::generate(preset_spec("zipf-256", 600));
    ASSERT_TRUE(routing) << routing.error().what();
    const Trace small = trace_of(*routing, "zipf-256", kExpert, 25000);  // 512 a turn
    TableOptions opt;  // 10, 25 and 50 %, both tiers
    const auto a = table_rows("small", small, small.models[0], opt);
    for (uint64_t per_turn : {64, 8}) {
        const Trace large = trace_of(*routing, "zipf-256", daemon::kLockBytesPerTurn / per_turn, 25000);
        const auto b = table_rows("large", large, large.models[0], opt);
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) {
            SCOPED_TRACE(fmt::format("{} a turn, {} {:.0f} %", per_turn, a[i].tier, a[i].budget * 100));
            EXPECT_GT(a[i].tier_rate(a[i].moecache), 0.1) << "the policy held nothing";
            EXPECT_NEAR(a[i].tier_rate(a[i].moecache), b[i].tier_rate(b[i].moecache), 0.005) << "moecache";
            EXPECT_NEAR(a[i].tier_rate(a[i].predicted), b[i].tier_rate(b[i].predicted), 0.005) << "moecache+predict";
            for (Baseline p : {Baseline::Lru, Baseline::Lfu, Baseline::Static, Baseline::Belady})
                EXPECT_NEAR(a[i].tier_rate(a[i].baseline(p)), b[i].tier_rate(b[i].baseline(p)), 0.005) << name_of(p);
        }
    }
}

// Bursty routing is held close to the most any placement that does not see the future can expect
// (tracegen::bound_hit_rates), in both tiers: more than LRU by most of the room the bound leaves
// above it, at 25 % (at 10 % of 64 experts a tier holds fewer than a token's 8 a layer). Before the
// splits were fine where recency's share is small, and while the pool drew its victims from all
// its slots, the pool held bursty routing level with LRU and RAM a third of the way to the bound.
TEST(SimReplay, BurstyRoutingIsHeldCloseToTheBound) {
    constexpr double kBurstyShare = 0.4;  // of the room from LRU to the bound (0.49 in both tiers here)
    const tracegen::Spec spec = preset_spec("bursty", 2000);
    const Trace trace = preset_trace("bursty", 2000);
    TableOptions opt;
    opt.budgets = {0.25};
    auto bound = tracegen::bound_hit_rates(spec, opt.budgets);
    ASSERT_TRUE(bound) << bound.error().what();
    for (const auto& row : table_rows("bursty", trace, trace.models[0], opt)) {
        SCOPED_TRACE(row.tier);
        const double lru = row.tier_rate(row.baseline(Baseline::Lru)), mine = row.tier_rate(row.policy());
        EXPECT_GT((*bound)[0], lru + 0.01) << "the bound leaves room above LRU here (the test's premise)";
        EXPECT_LE(mine, (*bound)[0] + 0.005) << "above the bound: the bound is wrong";
        EXPECT_GE(mine, lru + kBurstyShare * ((*bound)[0] - lru)) << "LRU " << lru << ", bound " << (*bound)[0];
    }
}

// The recorded llama.cpp trace in sim/traces reads back and the policy keeps up with LRU and LFU
// on it too.
TEST(SimReplay, ARecordedLlamaCppTraceReplays) {
    const std::string path = std::string(MOECACHE_SOURCE_DIR) + "/sim/traces/llama-cpu-deepseek-8x64.jsonl";
    auto trace = read_trace(path);
    ASSERT_TRUE(trace) << trace.error().what();
    ASSERT_EQ(trace->models.size(), 1u);
    EXPECT_EQ(trace->decisions.size(), 16000u);
    TableOptions opt;
    opt.budgets = {0.25};
    for (const auto& row : table_rows("recorded", *trace, trace->models[0], opt)) {
        SCOPED_TRACE(row.tier);
        EXPECT_GE(row.vs_best_points(), -1.0);
        EXPECT_GT(row.tier_rate(row.baseline(Baseline::Lfu)), row.tier_rate(row.baseline(Baseline::Lru)) + 0.05)
            << "a skewed router: frequency beats recency on the real run too";
    }
}

// The trace recorded on the GPU machine (stock CUDA llama-server through the hook, prompts and
// decodes mixed) reads back with its prompt batches' rankings folded into them, and the policy
// holds far more than LRU on it and stays near LFU: 1.1 (VRAM) and 1.7 (RAM) points below it at
// 25 % when this trace was added, short of issue 22's half a point (its replay is in the note).
TEST(SimReplay, ARecordedGpuServerTraceReplays) {
    const std::string path = std::string(MOECACHE_SOURCE_DIR) + "/sim/traces/llama-server-h200-q5k-32x128.jsonl";
    auto trace = read_trace(path);
    ASSERT_TRUE(trace) << trace.error().what();
    ASSERT_EQ(trace->models.size(), 1u);
    size_t batches = 0, ranked = 0, zero = 0;
    for (const auto& d : trace->decisions) {
        batches += d.tokens > 16 ? 1 : 0;
        ranked += d.tokens > 16 && !d.more.empty() ? 1 : 0;
        zero += d.tokens == 0 ? 1 : 0;
    }
    EXPECT_GT(batches, 32u) << "the prompts' batches, a decision a layer";
    EXPECT_EQ(ranked, batches) << "each batch with its ranking";
    EXPECT_EQ(zero, 0u) << "a ranking left as a decision of its own";
    TableOptions opt;
    opt.budgets = {0.25, 0.5};
    for (const auto& row : table_rows("recorded", *trace, trace->models[0], opt)) {
        SCOPED_TRACE(fmt::format("{} {:.0f} %", row.tier, row.budget * 100));
        // Issue 22's first target; with a batch's ranking at a routing's full heat the policy was
        // 2.6 points below LFU at 50 % of RAM (the prompts buried decode's heat).
        EXPECT_GE(row.vs_best_points(), -0.5);
        EXPECT_GT(row.tier_rate(row.moecache), row.tier_rate(row.baseline(Baseline::Lru)) + 0.05);
    }
}

TEST(SimReplay, PredictionIsPreciseOnlyWhereRoutingIsPredictable) {
    const Trace skewed = preset_trace("deepseek-v4-flash", 1000), flat = preset_trace("uniform", 1000);
    const auto a = predict(skewed, skewed.models[0], Predict::NextLayer);
    const auto b = predict(flat, flat.models[0], Predict::NextLayer);
    EXPECT_GT(a.precision(), 0.6);
    EXPECT_LT(b.precision(), 0.2);
    EXPECT_GT(a.most_staged, 0u);
    EXPECT_EQ(b.most_staged, 0u) << "an unpredictable router stages nothing";
}

// Two layers of 4 experts; layer 1 always uses expert (x + 1) % 4 after x in layer 0.
TEST(RoutePredictor, LearnsAPairingAndRecency) {
    daemon::RoutePredictor p(2, 4);
    std::vector<uint32_t> out;
    for (int t = 0; t < 40; ++t) {
        const uint32_t x = static_cast<uint32_t>(t % 4), y = (x + 1) % 4;
        p.observe(0, std::span<const uint32_t>(&x, 1));
        p.observe(1, std::span<const uint32_t>(&y, 1));
    }
    for (uint32_t x = 0; x < 4; ++x) {
        p.predict_next_layer(0, std::span<const uint32_t>(&x, 1), 1, out);
        ASSERT_EQ(out.size(), 1u);
        EXPECT_EQ(out[0], (x + 1) % 4);
    }
    p.predict_next_layer(1, {}, 1, out);
    EXPECT_TRUE(out.empty()) << "no layer after the last";
    // Recency: a router that repeats itself.
    daemon::RoutePredictor q(1, 8);
    for (int t = 0; t < 30; ++t) {
        const uint32_t e = t < 15 ? 2 : 5;
        q.observe(0, std::span<const uint32_t>(&e, 1));
    }
    const uint32_t five = 5;
    q.predict_next_token(0, std::span<const uint32_t>(&five, 1), 1, out);
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0], 5u);
    // Hostile input: out-of-range layers and experts are ignored, not indexed.
    const uint32_t bad = 99;
    q.observe(7, std::span<const uint32_t>(&bad, 1));
    q.observe(0, std::span<const uint32_t>(&bad, 1));
    q.predict_next_token(0, std::span<const uint32_t>(&bad, 1), 3, out);
    EXPECT_EQ(out.size(), 3u);
}

// The static set is the profile's hottest, and the cost model charges each tier's path.
TEST(SimReplay, StaticHoldsTheProfilesHottestAndCostsFollowTheTiers) {
    Trace t;
    t.models.push_back({0, "k", "", 4, {0}, {kExpert}});
    // Profile half: expert 0 x3, 1 x1; second half: 1 x4.
    const std::vector<uint32_t> seq{0, 0, 0, 1, 1, 1, 1, 1};
    for (size_t i = 0; i < seq.size(); ++i) t.decisions.push_back({i * 25000, 0, 0, 1, {seq[i]}, {}});
    const AccessStream s = accesses_of(t, t.models[0]);
    const auto hit = hits_of(s, kExpert, Baseline::Static);
    EXPECT_EQ(std::count(hit.begin(), hit.end(), 1), 3) << "expert 0 held, 1 never";

    sim::Setup cpu;
    cpu.ram_bytes = kExpert;  // one expert of RAM, no device
    const auto lru = simulate_baseline(t, t.models[0], cpu, Baseline::Lru);
    EXPECT_EQ(lru.tokens, 8u);
    EXPECT_EQ(lru.ram_hits, 6u);  // misses: the first 0 and the first 1
    EXPECT_EQ(lru.demand.storage, 2 * kExpert);
    EXPECT_EQ(lru.demand.h2d, 0u) << "no device, no host-to-device copies";
    sim::Setup gpu;
    gpu.vram_bytes = kExpert;
    gpu.ram_bytes = 3 * kExpert;
    const auto g = simulate_baseline(t, t.models[0], gpu, Baseline::Lru);
    EXPECT_EQ(g.vram_hits, 6u);
    EXPECT_EQ(g.demand.d2d, 6 * kExpert);
    EXPECT_EQ(g.demand.h2d, 2 * kExpert);
    EXPECT_GT(g.tokens_per_second(), lru.tokens_per_second()) << "a device pool beats storage";
}

}  // namespace
}  // namespace moecache::sim
