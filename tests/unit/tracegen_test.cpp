// Synthetic router traces: well-formed, reproducible, each control moving the statistic it is
// for, the presets landing on their published figures, and the file in docs/trace.md's format.
#include "run.h"
#include "temp_dir.h"

#include "moecache/tracegen/tracegen.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <set>

namespace moecache::tracegen {
namespace {

Spec small(uint64_t tokens = 1500) {
    Spec s;
    s.n_layers = 6;
    s.n_experts = 64;
    s.n_used = 8;
    s.tokens = tokens;
    return s;
}

TEST(TraceGen, EveryTokenGetsKDistinctSortedExpertsAndASeedRepeatsIt) {
    Spec s = small(300);
    s.skew = {2.0, 0.5};
    s.reuse = 0.5;
    s.follow = 2.0;
    auto a = generate(s), b = generate(s);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->experts, b->experts);
    ASSERT_EQ(a->experts.size(), 300u * 6 * 8);
    for (uint64_t t = 0; t < a->tokens; ++t)
        for (uint32_t l = 0; l < a->n_layers; ++l) {
            const auto e = a->at(t, l);
            EXPECT_TRUE(std::is_sorted(e.begin(), e.end()));
            EXPECT_EQ(std::set<uint16_t>(e.begin(), e.end()).size(), 8u);
            EXPECT_LT(e.back(), 64u);
        }
    s.seed = 2;
    EXPECT_NE(generate(s)->experts, a->experts);
}

TEST(TraceGen, ShapesItCannotGenerateAreRefusedByName) {
    auto why = [](Spec s) {
        auto r = generate(s);
        return r ? std::string("generated") : r.error().what();
    };
    Spec s = small();
    s.n_used = 64;
    EXPECT_NE(why(s).find("experts used"), std::string::npos) << why(s);
    s = small();
    s.n_experts = 70000;
    EXPECT_NE(why(s).find("experts must be"), std::string::npos) << why(s);
    s = small();
    s.reuse = 1.0;
    EXPECT_NE(why(s).find("reuse"), std::string::npos) << why(s);
    s = small();
    s.follow = -1;
    EXPECT_NE(why(s).find("follow"), std::string::npos) << why(s);
    s = small();
    s.n_layers = 0;
    EXPECT_NE(why(s).find("layers"), std::string::npos) << why(s);
    s = small();
    s.skew.scale = std::nan("");
    EXPECT_NE(why(s).find("skew"), std::string::npos) << why(s);
}

TEST(TraceGen, UniformRoutingMeasuresAsUniform) {
    auto r = generate(small(3000));
    ASSERT_TRUE(r);
    const Stats st = measure(*r);
    EXPECT_NEAR(st.top_eighth, 0.125, 0.02);
    EXPECT_NEAR(st.top_quarter, 0.25, 0.03);
    EXPECT_NEAR(st.reuse, 8.0 / 64, 0.02);       // the chance that an expert is picked again
    EXPECT_NEAR(st.next_layer, 8.0 / 64, 0.03);  // nothing to learn: chance
}

TEST(TraceGen, ReuseAndFollowMoveTheirOwnStatistics) {
    Spec s = small();
    s.skew = {2.0, 0.5};
    const Stats base = measure(*generate(s));
    s.reuse = 0.9;
    const Stats reused = measure(*generate(s));
    EXPECT_GT(reused.reuse, base.reuse + 0.15) << base.reuse << " -> " << reused.reuse;
    EXPECT_NEAR(reused.next_layer, base.next_layer, 0.06);
    s.reuse = 0;
    s.follow = 20;
    const Stats followed = measure(*generate(s));
    EXPECT_GT(followed.next_layer, base.next_layer + 0.2) << base.next_layer << " -> " << followed.next_layer;
    // Following a pairing of equal ranks keeps each layer's popularity.
    EXPECT_NEAR(followed.top_eighth, base.top_eighth, 0.05);
}

TEST(TraceGen, PresetsLandOnTheirPublishedStatistics) {
    Spec shape = small(3000);
    shape.n_layers = 8;
    auto ds = fit(*find_preset("deepseek-v4-flash"), shape);
    ASSERT_TRUE(ds) << ds.error().what();
    const Stats d = measure(*generate(*ds));
    EXPECT_NEAR(d.top_eighth, 0.58, 0.04);
    EXPECT_NEAR(d.next_layer, 0.70, 0.04);
    auto low = fit(*find_preset("low-skew"), shape);
    ASSERT_TRUE(low) << low.error().what();
    const Stats l = measure(*generate(*low));
    EXPECT_NEAR(l.top_eighth, 0.18, 0.03);
    EXPECT_NEAR(l.top_quarter, 0.33, 0.03);
    EXPECT_LT(l.next_layer, 0.3);
    EXPECT_EQ(find_preset("no-such"), nullptr);
}

TEST(TraceGen, TheFileIsOneModelAndOneDecisionPerTokenAndLayer) {
    test::TempDir dir;
    Spec s = small(50);
    s.skew = {1.0, 1.0};
    auto r = generate(s);
    ASSERT_TRUE(r);
    const std::string path = dir.file("t.jsonl");
    ASSERT_TRUE(write_trace(*r, path, "synthetic-key", 4096, 25000));
    std::ifstream f(path);
    std::string line;
    ASSERT_TRUE(std::getline(f, line));
    EXPECT_EQ(nlohmann::json::parse(line).at("moecache_trace"), 1);
    ASSERT_TRUE(std::getline(f, line));
    const auto model = nlohmann::json::parse(line);
    EXPECT_EQ(model.at("key"), "synthetic-key");
    EXPECT_EQ(model.at("n_experts"), 64);
    EXPECT_EQ(model.at("blocks").size(), 6u);
    EXPECT_EQ(model.at("bytes_per_expert").at(5), 4096);
    uint64_t n = 0;
    while (std::getline(f, line)) {
        const auto d = nlohmann::json::parse(line);
        const uint64_t t = n / 6;
        const uint32_t l = n % 6;
        EXPECT_EQ(d.at("t"), t * 25000);
        EXPECT_EQ(d.at("b"), l);
        EXPECT_EQ(d.at("n"), 1);
        const auto want = r->at(t, l);
        EXPECT_EQ(d.at("e").get<std::vector<uint16_t>>(), std::vector<uint16_t>(want.begin(), want.end()));
        ++n;
    }
    EXPECT_EQ(n, 50u * 6);
    EXPECT_FALSE(write_trace(*r, dir.file("no-such-dir/t.jsonl"), "k", 1, 1));
}

// The families of routing whose structure popularity alone does not describe (issue 22), each
// moving what it is for.
TEST(TraceGen, ZipfBurstsShiftsAndPromptBatchesEachShowInTheirStatistic) {
    // Zipf (alpha 1.2, 256 experts): the hottest eighth takes far more than an even share.
    Spec z = small(1500);
    z.n_experts = 256;
    z.zipf = 1.2;
    auto zr = generate(z);
    ASSERT_TRUE(zr) << zr.error().what();
    EXPECT_GT(measure(*zr).top_eighth, 0.5);
    // Bursty: a layer keeps most of its previous token's experts about `keep` of the time.
    Spec b = small(1500);
    b.skew = {1.0, 1.0};
    const double plain = measure(*generate(b)).reuse;
    b.keep = 0.6;
    const double bursty = measure(*generate(b)).reuse;
    EXPECT_GT(bursty, plain + 0.15) << plain << " -> " << bursty;
    EXPECT_GT(bursty, 0.6 * 7 / 8) << "kept 7 of 8 experts 60 % of the time";
    // A topic change: the hottest experts of the first half are not those of the second.
    Spec t = small(2000);
    t.skew = {3.0, 1.0};
    t.shift_at = 1000;
    auto tr = generate(t);
    ASSERT_TRUE(tr);
    auto hottest = [&](uint64_t from, uint64_t to) {
        std::vector<uint32_t> c(64, 0);
        for (uint64_t i = from; i < to; ++i)
            for (uint16_t e : tr->at(i, 0)) ++c[e];
        return static_cast<uint32_t>(std::max_element(c.begin(), c.end()) - c.begin());
    };
    EXPECT_NE(hottest(0, 1000), hottest(1000, 2000));
    // Prompt batches: a step of 512 tokens every 400 decoded ones, written as one decision per
    // layer with its count and, as the CUDA hook reports it, the experts more of its tokens chose
    // than an even share: more than one token's 8 and, skewed, far fewer than the batch's union.
    Spec p = small(2000);
    p.skew = {1.0, 1.0};
    p.prompt_tokens = 512;
    p.prompt_every = 400;
    auto pr = generate(p);
    ASSERT_TRUE(pr);
    test::TempDir dir;
    ASSERT_TRUE(write_trace(*pr, dir.file("p.jsonl"), "k", 4096, 1000));
    std::ifstream f(dir.file("p.jsonl"));
    std::string line;
    uint64_t tokens = 0, batches = 0, rankings = 0;
    nlohmann::json last;  // the decision before, and the batch's ranking so far
    std::vector<std::vector<uint32_t>> levels;
    while (std::getline(f, line)) {
        const auto d = nlohmann::json::parse(line);
        if (!d.contains("n")) continue;
        if (d.at("b") == 0) tokens += d.at("n").get<uint64_t>();
        if (d.at("n") == 512) {
            ++batches;
            levels.clear();
            EXPECT_GT(d.at("e").size(), 8u) << "more than one token's experts";
            EXPECT_LT(d.at("e").size(), 40u) << "the experts above an even share, not the union (most of the 64)";
        }
        if (d.at("n") == 0) {
            // A batch's ranking: right after it, in its layer, each level a subset of the one before.
            ++rankings;
            ASSERT_FALSE(last.is_null());
            EXPECT_EQ(d.at("b"), last.at("b"));
            EXPECT_TRUE(last.at("n") == 512 || last.at("n") == 0) << line;
            const auto e = d.at("e").get<std::vector<uint32_t>>();
            if (!levels.empty()) {
                EXPECT_TRUE(std::includes(levels.back().begin(), levels.back().end(), e.begin(), e.end())) << line;
            }
            levels.push_back(e);
        }
        last = d;
    }
    EXPECT_EQ(tokens, 2000u);
    EXPECT_GE(rankings, 2u * 6 * 4) << "each batch's ranking, a few levels in each layer";
    // 400 decoded, 512 in a batch, 400, 512, and the last 176 decoded.
    EXPECT_EQ(batches, 2u * 6) << "two batches, one decision in each of six layers";
    // Out of range is refused by name.
    Spec bad = small();
    bad.keep = 1.0;
    EXPECT_FALSE(generate(bad));
    bad = small();
    bad.prompt_tokens = 4;
    EXPECT_FALSE(generate(bad));
}

}  // namespace
}  // namespace moecache::tracegen

namespace moecache::tracegen {
namespace {

// The bound on a placement that does not see the future (bound_hit_rates): exact where the answer
// is known by hand, above what a policy that only looks back holds, and refused where it does not
// hold.
TEST(TraceBound, UniformRoutingHoldsItsShareAndTheEdgesAreExact) {
    Spec u = small(800);
    const std::vector<double> shares{0.0, 0.25, 0.5, 1.0};
    auto b = bound_hit_rates(u, shares);
    ASSERT_TRUE(b) << b.error().what();
    ASSERT_EQ(b->size(), 4u);
    EXPECT_EQ((*b)[0], 0.0);
    EXPECT_EQ((*b)[3], 1.0);
    // Every expert equally likely: any placement of a quarter of them holds a quarter of the routings.
    EXPECT_NEAR((*b)[1], 0.25, 0.02);
    EXPECT_NEAR((*b)[2], 0.50, 0.02);
}

// Holding the previous token's experts and then the most frequent ones is a placement that looks
// only back; on bursty routing it holds most of what the bound holds, and never more (up to the
// draws' noise); and the bound is far above an even share there.
TEST(TraceBound, BurstyRoutingIsBoundAboveTheBestPlacementThatLooksBack) {
    Spec s = small(2000);
    s.n_experts = 128;
    s.skew = {1.9, 0.5};
    s.keep = 0.6;
    const double share = 0.25;
    auto r = generate(s);
    ASSERT_TRUE(r);
    const auto room = static_cast<size_t>(share * s.n_experts);  // per layer, 32 >= the 8 a token uses
    uint64_t hits = 0, all = 0;
    std::vector<std::vector<uint32_t>> count(s.n_layers, std::vector<uint32_t>(s.n_experts, 0));
    for (uint64_t t = 0; t < r->tokens; ++t)
        for (uint32_t l = 0; l < s.n_layers; ++l) {
            std::vector<uint8_t> held(s.n_experts, 0);
            size_t n = 0;
            if (t > 0)
                for (uint16_t e : r->at(t - 1, l)) held[e] = 1, ++n;
            std::vector<uint32_t> order(s.n_experts);
            std::iota(order.begin(), order.end(), 0u);
            std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return count[l][a] > count[l][b]; });
            for (uint32_t e : order)
                if (n < room && !held[e]) held[e] = 1, ++n;
            for (uint16_t e : r->at(t, l)) {
                hits += held[e];
                ++all;
                ++count[l][e];
            }
        }
    const double looks_back = static_cast<double>(hits) / static_cast<double>(all);
    auto b = bound_hit_rates(s, std::vector<double>{share});
    ASSERT_TRUE(b) << b.error().what();
    EXPECT_GE((*b)[0], looks_back - 0.005) << "a placement that only looks back held more than the bound";
    EXPECT_LE((*b)[0], looks_back + 0.03) << "the bound is loose: " << (*b)[0] << " against " << looks_back;
    EXPECT_GT((*b)[0], 0.6 * 7 / 8 + 0.1) << "the kept experts alone are 0.525";
}

// A topic change: the bound knows the popularity in force, so it holds as much after the shift as
// before, and more than LFU over the whole trace does.
TEST(TraceBound, AShiftCostsTheBoundNothingAndPromptBatchesAreScoredAsReported) {
    Spec s = small(1600);
    s.skew = {3.0, 1.0};
    auto whole = bound_hit_rates(s, std::vector<double>{0.25});
    s.shift_at = 800;
    auto shifted = bound_hit_rates(s, std::vector<double>{0.25});
    ASSERT_TRUE(whole && shifted);
    EXPECT_NEAR((*shifted)[0], (*whole)[0], 0.03);
    s.prompt_tokens = 256;
    s.prompt_every = 200;
    auto prompts = bound_hit_rates(s, std::vector<double>{0.1, 0.25});
    ASSERT_TRUE(prompts) << prompts.error().what();
    EXPECT_GT((*prompts)[1], (*prompts)[0]);
    EXPECT_LE((*prompts)[1], 1.0);
}

// The learner (learner_hit_rates): below the bound, which knows the popularity it must learn; on a
// topic change it counts anew from the shift, and holds more than the same counts kept across it;
// bursty routing is not a fixed popularity: refused.
TEST(TraceBound, TheLearnerIsBelowTheBoundAndCountsAnewAtAShift) {
    Spec s = small(1600);
    s.skew = {3.0, 1.0};
    s.shift_at = 800;
    const std::vector<double> share{0.25};
    auto bound = bound_hit_rates(s, share);
    auto learner = learner_hit_rates(s, share);
    ASSERT_TRUE(bound && learner) << (bound ? learner.error().what() : bound.error().what());
    EXPECT_LE((*learner)[0], (*bound)[0] + 0.005);
    EXPECT_GT((*learner)[0], (*bound)[0] - 0.05) << "a few hundred tokens learn most of a skewed popularity";
    // The same counts, never reset: the old hot set holds its place long after the shift.
    auto r = generate(s);
    ASSERT_TRUE(r);
    const size_t items = size_t{s.n_layers} * s.n_experts, room = static_cast<size_t>(0.25 * static_cast<double>(items));
    std::vector<uint64_t> used(items, 0);
    std::vector<uint32_t> order(items);
    uint64_t hits = 0, all = 0;
    for (uint64_t t = 0; t < r->tokens; ++t) {
        std::iota(order.begin(), order.end(), 0u);
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return used[a] > used[b]; });
        std::vector<uint8_t> held(items, 0);
        for (size_t i = 0; i < room; ++i) held[order[i]] = 1;
        for (uint32_t l = 0; l < s.n_layers; ++l)
            for (uint16_t e : r->at(t, l)) {
                hits += held[l * s.n_experts + e];
                ++all;
            }
        for (uint32_t l = 0; l < s.n_layers; ++l)
            for (uint16_t e : r->at(t, l)) ++used[l * s.n_experts + e];
    }
    EXPECT_GT((*learner)[0], static_cast<double>(hits) / static_cast<double>(all) + 0.03);
    s.keep = 0.5;
    auto bursty = learner_hit_rates(s, share);
    ASSERT_FALSE(bursty);
    EXPECT_NE(std::string(bursty.error().what()).find("bursty"), std::string::npos) << bursty.error().what();
}

TEST(TraceBound, RoutingWithHiddenStateAndBadSharesAreRefusedByName) {
    Spec s = small(100);
    s.reuse = 0.5;
    auto b = bound_hit_rates(s, std::vector<double>{0.25});
    ASSERT_FALSE(b);
    EXPECT_NE(std::string(b.error().what()).find("reuse"), std::string::npos) << b.error().what();
    s.reuse = 0;
    auto bad = bound_hit_rates(s, std::vector<double>{1.5});
    ASSERT_FALSE(bad);
    EXPECT_NE(std::string(bad.error().what()).find("share"), std::string::npos) << bad.error().what();
    s.tokens = 0;
    EXPECT_FALSE(bound_hit_rates(s, std::vector<double>{0.25})) << "the generator's own checks";
}

// A routing of one expert a token in each of `layers` layers, token t of layer l `seq[t]`.
Routing one_wide(uint32_t layers, uint32_t experts, const std::vector<uint16_t>& seq) {
    Routing r;
    r.n_layers = layers;
    r.n_experts = experts;
    r.n_used = 1;
    r.tokens = seq.size();
    for (const uint16_t e : seq)
        for (uint32_t l = 0; l < layers; ++l) r.experts.push_back(e);
    return r;
}

TEST(TraceStats, ReuseByChanceStaticCoverAndLruAreWhatTheirDefinitionsGive) {
    // Uniform routing: reuse by chance k / experts; a static set learnt on one half covers its
    // share of the experts of the other.
    Spec s = small(4000);
    const Stats u = measure(*generate(s), MeasureOptions{16, {16}});
    EXPECT_NEAR(u.reuse_chance, 8.0 / 64, 0.01);
    EXPECT_NEAR(u.reuse, u.reuse_chance, 0.02);
    EXPECT_EQ(u.static_top, 16u);
    EXPECT_DOUBLE_EQ(u.static_chance, 0.25);
    EXPECT_NEAR(u.static_cover, 0.25, 0.03);
    // Skewed routing: the learnt set covers far more than chance, and reuse by chance rises with it.
    s.skew = {2.0, 0.5};
    const Stats k = measure(*generate(s), MeasureOptions{16, {16}});
    EXPECT_GT(k.static_cover, k.static_chance + 0.2);
    EXPECT_GT(k.reuse_chance, u.reuse_chance + 0.05);
    // LRU by hand: cycling over three experts thrashes two slots and never misses in three after
    // the first three; the defaults are twice the active experts and an eighth of the experts.
    const Routing cycle = one_wide(2, 8, {0, 1, 2, 0, 1, 2, 0, 1, 2});
    const Stats c = measure(cycle, MeasureOptions{0, {2, 3}});
    ASSERT_EQ(c.lru_hits.size(), 2u);
    EXPECT_DOUBLE_EQ(c.lru_hits[0], 0.0);
    EXPECT_DOUBLE_EQ(c.lru_hits[1], 6.0 / 9);
    EXPECT_DOUBLE_EQ(c.reuse, 0.0);
    EXPECT_EQ(measure(*generate(small(50))).lru_slots, (std::vector<uint32_t>{16, 8}));  // 2 x 8, 64 / 8
    Spec wide = small(50);
    wide.n_experts = 128;
    EXPECT_EQ(measure(*generate(wide)).lru_slots, (std::vector<uint32_t>{16}));  // 2 x 8 and 128 / 8: once
    // A static set learnt on a first half that the second half never uses covers none of it.
    const Stats moved = measure(one_wide(1, 8, {0, 0, 1, 1, 5, 6, 5, 6}), MeasureOptions{2, {}});
    EXPECT_DOUBLE_EQ(moved.static_cover, 0.0);
}

TEST(TraceStats, ARecordedTracesDecodeStepsBecomeARoutingAndBadStepsAreNamed) {
    const std::vector<uint32_t> a{3, 1}, b{2, 0}, c{1, 2}, batch{0, 1, 2, 3}, odd{5};
    // Layer 0 then 1 for each token; a prompt batch and a step of another width are left out.
    const std::vector<RecordedStep> steps{{0, 7, batch}, {0, 1, a}, {1, 1, b}, {0, 1, odd}, {0, 1, c}, {1, 1, a}, {0, 1, b}};
    auto r = routing_from_steps(2, 6, steps);
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_EQ(r->n_used, 2u);
    EXPECT_EQ(r->tokens, 2u) << "layer 1 has two decode steps: as many tokens as every layer has";
    EXPECT_EQ(std::vector<uint16_t>(r->at(0, 0).begin(), r->at(0, 0).end()), (std::vector<uint16_t>{1, 3}));
    EXPECT_EQ(std::vector<uint16_t>(r->at(0, 1).begin(), r->at(0, 1).end()), (std::vector<uint16_t>{0, 2}));
    EXPECT_EQ(std::vector<uint16_t>(r->at(1, 0).begin(), r->at(1, 0).end()), (std::vector<uint16_t>{1, 2}));
    const std::vector<uint32_t> far{9, 1};
    const std::vector<RecordedStep> bad{{0, 1, far}};
    auto e = routing_from_steps(2, 6, bad);
    ASSERT_FALSE(e);
    EXPECT_NE(std::string(e.error().what()).find("expert 9"), std::string::npos) << e.error().what();
    const std::vector<RecordedStep> deep{{4, 1, a}};
    auto l = routing_from_steps(2, 6, deep);
    ASSERT_FALSE(l);
    EXPECT_NE(std::string(l.error().what()).find("layer 4"), std::string::npos) << l.error().what();
    EXPECT_FALSE(routing_from_steps(2, 6, std::span<const RecordedStep>{})) << "nothing to measure";
}

TEST(TraceGen, RealLikePresetsLandWithinAFifthOfTheirFigures) {
    // docs/routing.md's figures, as moecache-tracegen --preset P --layers 8 --tokens 1500 gives them.
    const auto spec_of = [](const char* name) {
        const Preset* p = find_preset(name);
        EXPECT_NE(p, nullptr) << name;
        Spec s;
        s.n_layers = 8;
        s.tokens = 1500;
        s.n_experts = p->family.experts;
        s.n_used = p->family.used;
        auto fitted = fit(*p, s);
        EXPECT_TRUE(fitted) << fitted.error().what();
        return *fitted;
    };
    const auto near = [](double measured, double figure, const char* what) {
        EXPECT_NEAR(measured, figure, 0.2 * figure) << what;
    };
    const Stats m = measure(*generate(spec_of("mixtral-like")));
    near(m.top_eighth, 0.20, "mixtral-like: the hottest 1/8");
    near(m.top_quarter, 0.36, "mixtral-like: the hottest 2/8");
    near(m.reuse, 0.36, "mixtral-like: reuse from the previous token");
    near(m.reuse_chance, 0.25, "mixtral-like: the same by chance");
    near(m.next_layer, 0.44, "mixtral-like: next layer");
    const Spec q = spec_of("qwen3-next-like");
    EXPECT_EQ(q.n_experts, 512u);
    EXPECT_EQ(q.n_used, 10u);
    const Stats w = measure(*generate(q), MeasureOptions{32, {64}});
    near(w.static_cover, 0.10, "qwen3-next-like: a static top-32 on the second half");
    near(w.lru_hits.at(0), 0.67, "qwen3-next-like: a per-layer LRU of 64");
    const Stats d = measure(*generate(spec_of("deepseek-like")));
    near(d.top_eighth, 0.58, "deepseek-like: the hottest 12.5 %");
    near(d.top_quarter, 0.71, "deepseek-like: the hottest 25 %");
    // Their noise carries over: no bound to hold the policy to.
    EXPECT_FALSE(bound_hit_rates(q, std::vector<double>{0.25}));
}

}  // namespace
}  // namespace moecache::tracegen

namespace moecache::tracegen {
namespace {

// One meaning per preset name: a model moecache-mkmodel writes with a preset and no shape options
// has the shape moecache-tracegen's preset of that name generates (a user compares the two).
TEST(PresetShape, EachPresetNameMeansOneShapeInBothTools) {
    test::TempDir dir;
    size_t shared = 0;
    for (const auto& mk : mkmodel::presets()) {
        const Preset* tg = find_preset(mk.name);
        if (tg == nullptr) continue;
        ++shared;
        // moecache-tracegen --preset NAME: the family's own counts where it has them (as its CLI does).
        Spec want;
        if (tg->family.experts != 0) want.n_experts = tg->family.experts;
        if (tg->family.used != 0) want.n_used = tg->family.used;
        const Spec* spec = &want;  // fit() keeps the shape it is given
        const auto r = test::run({MOECACHE_MKMODEL_BIN, "-o", dir.file(mk.name + ".gguf"), "--preset", mk.name,
                                  "--embd", "64", "--ff", "32", "--vocab", "512", "--dry-run", "--json"});
        ASSERT_EQ(r.exit_code, 0) << r.err;
        const auto j = nlohmann::json::parse(r.out);
        EXPECT_EQ(j.at("n_layers").get<uint32_t>(), spec->n_layers) << mk.name;
        EXPECT_EQ(j.at("n_experts").get<uint32_t>(), spec->n_experts) << mk.name;
        EXPECT_EQ(j.at("n_experts_used").get<uint32_t>(), spec->n_used) << mk.name;
    }
    EXPECT_GE(shared, 6u) << "deepseek-v4-flash, low-skew, uniform and the three real-like presets";
}

}  // namespace
}  // namespace moecache::tracegen
