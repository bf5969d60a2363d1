// The placement policy: pins and the dense part first, then the elite of each layer, then the
// hottest admitted experts; budgets respected; hysteresis against churn; coldest released first.
#include "moecache/daemon/heat.h"
#include "moecache/daemon/planner.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace moecache::daemon {
namespace {

constexpr uint64_t kExpert = 1000;

struct World {
    HeatTable heat;
    ModelView view;
    explicit World(uint32_t layers = 1, uint32_t experts = 8) : heat(layers, experts, 1e9) {
        view.heat = &heat;
        const size_t n = size_t{layers} * experts;
        view.locked.assign(n, 0);
        view.pinned.assign(n, 0);
        view.slot_bytes.assign(n, kExpert);
    }
    // Expert e of layer l used `times` times.
    void use(uint32_t l, uint32_t e, int times) {
        const uint32_t one[] = {e};
        for (int i = 0; i < times; ++i) heat.record(l, one);
    }
};

std::vector<uint32_t> slots(const std::vector<SlotRef>& refs) {
    std::vector<uint32_t> out;
    for (const auto& r : refs) out.push_back(r.slot);
    return out;
}

TEST(Planner, HottestAdmittedExpertsFillTheBudget) {
    World w;
    w.use(0, 5, 10);
    w.use(0, 2, 7);
    w.use(0, 7, 3);
    w.use(0, 1, 1);  // below admit_after_uses = 2
    PlannerSettings s;
    s.elite_share = 0;
    const ModelView views[] = {w.view};
    const auto p = plan_placement(views, 2 * kExpert, s);
    EXPECT_EQ(slots(p.lock), (std::vector<uint32_t>{5, 2}));
    EXPECT_TRUE(p.release.empty());
    EXPECT_EQ(p.planned_bytes, 2 * kExpert);
    const auto all = plan_placement(views, 100 * kExpert, s);
    EXPECT_EQ(slots(all.lock), (std::vector<uint32_t>{5, 2, 7})) << "expert 1 is not admitted yet";
}

TEST(Planner, AnExpertInVramIsNotWantedInRamUnlessPinned) {
    World w;
    w.use(0, 5, 10);
    w.use(0, 2, 7);
    w.use(0, 3, 5);
    w.view.locked[2] = 1;
    w.view.in_vram.assign(8, 0);
    w.view.in_vram[5] = 1;  // hottest, but a VRAM pool holds it
    w.view.in_vram[2] = 1;  // locked before the pool took it: released
    w.view.in_vram[3] = 1;
    w.view.pinned[3] = 1;   // pinned: kept in RAM all the same
    PlannerSettings s;
    s.elite_share = 0;
    const ModelView views[] = {w.view};
    const auto p = plan_placement(views, 100 * kExpert, s);
    EXPECT_EQ(slots(p.lock), (std::vector<uint32_t>{3}));
    EXPECT_EQ(slots(p.release), (std::vector<uint32_t>{2}));
}

TEST(Planner, PinsAndDenseComeFirst) {
    World w;
    w.use(0, 5, 10);
    w.view.pinned[3] = 1;
    w.view.dense_wanted = true;
    w.view.dense_bytes = kExpert;
    const ModelView views[] = {w.view};
    const auto p = plan_placement(views, 2 * kExpert, {});
    ASSERT_EQ(p.lock.size(), 2u);
    EXPECT_EQ(p.lock[0].slot, kDenseSlot);
    EXPECT_EQ(p.lock[1].slot, 3u);
}

TEST(Planner, HysteresisKeepsALockedExpertAgainstASlightlyHotterOne) {
    World w;
    w.use(0, 1, 10);
    w.use(0, 2, 11);
    w.view.locked[1] = 1;
    PlannerSettings s;
    s.elite_share = 0;
    s.hysteresis = 0.25;
    const ModelView views[] = {w.view};
    auto p = plan_placement(views, kExpert, s);
    EXPECT_TRUE(p.lock.empty());
    EXPECT_TRUE(p.release.empty());
    // Much hotter wins: 1 is released, 2 locked.
    w.use(0, 2, 5);
    const ModelView views2[] = {w.view};
    p = plan_placement(views2, kExpert, s);
    EXPECT_EQ(slots(p.lock), std::vector<uint32_t>{2});
    EXPECT_EQ(slots(p.release), std::vector<uint32_t>{1});
}

TEST(Planner, EliteOfEachLayerBeatsHotterExpertsOfOtherLayers) {
    World w(2, 8);
    for (uint32_t e = 0; e < 4; ++e) w.use(0, e, 100 + static_cast<int>(e));
    w.use(1, 6, 3);  // layer 1's hottest, much colder than layer 0's
    PlannerSettings s;
    s.elite_share = 0.125;  // one expert per layer
    const ModelView views[] = {w.view};
    const auto p = plan_placement(views, 2 * kExpert, s);
    const auto got = slots(p.lock);
    EXPECT_NE(std::find(got.begin(), got.end(), 8u + 6u), got.end()) << "layer 1's elite";
    EXPECT_NE(std::find(got.begin(), got.end(), 3u), got.end()) << "layer 0's elite";
}

TEST(Planner, ShrinkingBudgetReleasesColdestFirstAndRespectsModelBudgets) {
    World w;
    for (uint32_t e = 0; e < 6; ++e) {
        w.use(0, e, 2 + static_cast<int>(e));
        w.view.locked[e] = 1;
    }
    PlannerSettings s;
    s.elite_share = 0;
    s.hysteresis = 0;
    const ModelView views[] = {w.view};
    auto p = plan_placement(views, 3 * kExpert, s);
    EXPECT_EQ(slots(p.release), (std::vector<uint32_t>{0, 1, 2}));
    w.view.budget = 1 * kExpert;
    const ModelView views2[] = {w.view};
    p = plan_placement(views2, 100 * kExpert, s);
    EXPECT_EQ(p.planned_bytes, kExpert);
    EXPECT_EQ(p.release.size(), 5u);
    EXPECT_EQ(p.release.front().slot, 0u);
}

TEST(Planner, TwoModelsShareTheGlobalBudgetByHeat) {
    World a, b;
    a.use(0, 1, 50);
    b.use(0, 2, 40);
    a.use(0, 3, 5);
    PlannerSettings s;
    s.elite_share = 0;
    const ModelView views[] = {a.view, b.view};
    const auto p = plan_placement(views, 2 * kExpert, s);
    ASSERT_EQ(p.lock.size(), 2u);
    EXPECT_EQ(p.lock[0], (SlotRef{0, 1}));
    EXPECT_EQ(p.lock[1], (SlotRef{1, 2}));
}

// Two quantizations of one model share a heat table and a family budget; a third model outside
// the family is held to the global cap only.
TEST(Planner, AFamilySharesHeatAndItsSmallestBudget) {
    World a, other;
    a.use(0, 1, 50);
    a.use(0, 2, 40);
    other.use(0, 3, 30);
    ModelView b = a.view;  // the same table: the other member of the family
    a.view.family = b.family = 0;
    a.view.family_budget = 3 * kExpert;
    b.family_budget = 2 * kExpert;  // the smallest wins
    PlannerSettings s;
    s.elite_share = 0;
    const ModelView views[] = {a.view, b, other.view};
    const auto p = plan_placement(views, 100 * kExpert, s);
    // The family's two hottest slots (expert 1 of each member) fill its 2-expert cap; expert 2 of
    // either member would exceed it; the model outside the family is unaffected.
    ASSERT_EQ(p.lock.size(), 3u);
    EXPECT_EQ(p.lock[0], (SlotRef{0, 1}));
    EXPECT_EQ(p.lock[1], (SlotRef{1, 1}));
    EXPECT_EQ(p.lock[2], (SlotRef{2, 3}));
    EXPECT_EQ(p.planned_bytes, 3 * kExpert);
    // Without a family, each member's budget alone.
    ModelView loose[] = {a.view, b, other.view};
    for (auto& v : loose) v.family = UINT32_MAX;
    EXPECT_EQ(plan_placement(loose, 100 * kExpert, s).lock.size(), 5u);
}

// A family member no runtime uses (the prompt model while the decode model runs) shares the heat
// but takes only what the model in use leaves: on the GPU machine the idle prompt model took most
// of a squeezed cgroup's locks from the decode model. Locks it holds go first when room is short.
TEST(Planner, AModelOnStandbyTakesOnlyWhatTheModelsInUseLeave) {
    World a(1, 8);
    for (uint32_t e = 0; e < 6; ++e) a.use(0, e, 10 + static_cast<int>(e));
    ModelView decode = a.view, prompt = a.view;  // one heat table: a family
    prompt.standby = true;
    PlannerSettings s;
    const ModelView views[] = {prompt, decode};
    auto p = plan_placement(views, 4 * kExpert, s);
    ASSERT_EQ(p.lock.size(), 4u);
    for (const auto& r : p.lock) EXPECT_EQ(r.model, 1u) << "a standby model's expert took a lock";
    // Room beyond the model in use: the standby model gets it, hottest first.
    p = plan_placement(views, 8 * kExpert, s);
    ASSERT_EQ(p.lock.size(), 8u);
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(p.lock[i].model, 1u);
    EXPECT_EQ(p.lock[6], (SlotRef{0, 5}));
    EXPECT_EQ(p.lock[7], (SlotRef{0, 4}));
    // The standby model holds locks and the model in use wants the room: the standby's go.
    ModelView held[] = {prompt, decode};
    for (uint32_t e = 0; e < 6; ++e) held[0].locked[e] = 1;
    p = plan_placement(held, 6 * kExpert, s);
    EXPECT_EQ(p.lock.size(), 6u);
    EXPECT_EQ(p.release.size(), 6u);
    for (const auto& r : p.release) EXPECT_EQ(r.model, 0u);
    // Both on standby (nothing runs yet): the order among them is heat's, as without the flag.
    ModelView idle[] = {prompt, decode};
    idle[1].standby = true;
    ModelView plain[] = {a.view, a.view};
    EXPECT_EQ(plan_placement(idle, 5 * kExpert, s).lock, plan_placement(plain, 5 * kExpert, s).lock);
}

// A user's model (any local user may register a file of their own): its dense part never outranks
// the operator's experts (a sparse GGUF with a large dense tensor, a "must", took the whole cap and
// released the operator's experts), and all its parts count against its owner's budget in the plan,
// with the owner's other models, not only when locking (where the plan had released the operator's
// experts for it all the same).
TEST(Planner, AUsersDensePartComesAfterTheOperatorsExpertsAndWithinItsOwnersBudget) {
    World op;
    op.use(0, 1, 10);
    op.use(0, 2, 8);
    World user_a, user_b;
    user_a.view.users = user_b.view.users = true;
    user_a.view.dense_wanted = user_b.view.dense_wanted = true;
    user_a.view.dense_bytes = user_b.view.dense_bytes = 4 * kExpert;
    user_b.use(0, 3, 20);
    PlannerSettings s;
    s.elite_share = 0;
    {
        const ModelView views[] = {op.view, user_a.view};
        const auto p = plan_placement(views, 4 * kExpert, s);
        ASSERT_EQ(p.lock.size(), 2u) << "the operator's two experts, not the user's dense part";
        EXPECT_EQ(p.lock[0], (SlotRef{0, 1}));
        EXPECT_EQ(p.lock[1], (SlotRef{0, 2}));
    }
    // Two models of one owner whose budget holds one dense part and an expert: the plan gives them
    // that much together, whatever room the cap has.
    user_a.view.owner = user_b.view.owner = 1000;
    user_a.view.owner_budget = user_b.view.owner_budget = 5 * kExpert;
    const ModelView views[] = {op.view, user_a.view, user_b.view};
    const auto p = plan_placement(views, 100 * kExpert, s);
    uint64_t owners = 0;
    for (const auto& r : p.lock)
        if (r.model != 0) owners += r.slot == kDenseSlot ? 4 * kExpert : kExpert;
    EXPECT_LE(owners, 5 * kExpert) << "the owner's budget, in the plan";
    EXPECT_EQ(std::count_if(p.lock.begin(), p.lock.end(), [](const SlotRef& r) { return r.model == 0; }), 2)
        << "the operator's experts are all planned";
}

TEST(Heat, DecaysByHalfLife) {
    HeatTable h(1, 4, 100);
    const uint32_t e[] = {1};
    h.record(0, e);
    h.advance_clock(100);
    EXPECT_NEAR(h.heat(0, 1), 0.5, 1e-9);
    h.record(0, e);
    EXPECT_NEAR(h.heat(0, 1), 1.5, 1e-9);
    h.advance_clock(200);
    EXPECT_NEAR(h.heat(0, 1), 1.5 / 4, 1e-9);
    EXPECT_EQ(h.uses(0, 1), 2u);
    EXPECT_EQ(h.heat(0, 0), 0.0);
}

TEST(Heat, ProfilesRoundTripAndRefuseOtherModels) {
    HeatTable h(2, 4, 1000);
    const uint32_t e[] = {1, 3};
    h.record(1, e);
    h.record(1, e);
    const std::string text = h.to_profile("qwen3moe-2x4-x");
    HeatTable back(2, 4, 1000);
    ASSERT_TRUE(back.load_profile(text, "qwen3moe-2x4-x", "p.json"));
    EXPECT_NEAR(back.heat(1, 3), 2.0, 1e-9);
    EXPECT_EQ(back.uses(1, 1), 2u);
    EXPECT_EQ(back.heat(0, 1), 0.0);

    auto other = back.load_profile(text, "llama-2x4-y", "p.json");
    ASSERT_FALSE(other);
    EXPECT_NE(other.error().message.find("another model"), std::string::npos);
    HeatTable shape(3, 4, 1000);
    auto bad_shape = shape.load_profile(text, "qwen3moe-2x4-x", "p.json");
    ASSERT_FALSE(bad_shape);
    EXPECT_NE(bad_shape.error().message.find("shape"), std::string::npos);
    for (const char* junk : {"", "[]", "{\"key\":\"qwen3moe-2x4-x\"}", "{\"key\":\"qwen3moe-2x4-x\",\"n_layers\":2,"
                             "\"n_experts\":4,\"experts\":[[9,9,1.0,1]]}"}) {
        HeatTable t(2, 4, 1000);
        EXPECT_FALSE(t.load_profile(junk, "qwen3moe-2x4-x", "p.json")) << junk;
    }
}

// What a pool is directed to hold: the elite of each layer whatever the capacity, then the hottest
// admitted experts of any layer up to the capacity, hottest first; never one used too rarely.
TEST(Planner, APoolIsDirectedToTheHottestExpertsOfAnyLayerHottestFirst) {
    World w(2, 8);
    w.use(0, 1, 9);
    w.use(0, 2, 7);
    w.use(1, 3, 8);
    w.use(1, 4, 2);
    w.use(1, 6, 1);  // used once: not admitted (admit_after_uses 2)
    PlannerSettings s;
    s.admit_after_uses = 2;
    s.elite_share = 0;
    EXPECT_EQ(pool_wanted(w.heat, s, 3), (std::vector<uint32_t>{1, 8 + 3, 2}));
    EXPECT_EQ(pool_wanted(w.heat, s, 100), (std::vector<uint32_t>{1, 8 + 3, 2, 8 + 4})) << "only admitted experts";
    EXPECT_TRUE(pool_wanted(w.heat, s, 0).empty());
    // Never more than the capacity, the elite (one a layer) included: the hottest of it. The rest
    // of a pool is the hook's own part (its LRU where the recency split gave it a share).
    s.elite_share = 0.125;
    EXPECT_EQ(pool_wanted(w.heat, s, 1), (std::vector<uint32_t>{1}));
    EXPECT_EQ(pool_wanted(w.heat, s, 3), (std::vector<uint32_t>{1, 8 + 3, 2}));
}

// Under one place a held expert keeps its place against a newcomer hotter by a share but not by a
// few uses (noise at low heat: each move is a read from storage), and loses it to one clearly hotter.
TEST(Planner, UnderOnePlaceANewcomerMustBeHotterByAFewUses) {
    World w(1, 8);
    w.use(0, 1, 2);  // held, 2 uses
    w.use(0, 2, 4);  // a newcomer with 4: twice as hot, 2 uses more
    PlannerSettings s;
    s.elite_share = 0;
    const std::vector<uint8_t> held = {0, 1, 0, 0, 0, 0, 0, 0};
    EXPECT_EQ(pool_wanted(w.heat, s, 1, held), (std::vector<uint32_t>{2})) << "without a margin the share decides";
    s.move_margin = kOnePlaceMoveMargin;
    EXPECT_EQ(pool_wanted(w.heat, s, 1, held), (std::vector<uint32_t>{1})) << "2 uses more is noise under one place";
    w.use(0, 2, 10);  // 14 uses against 2: still within the margin
    EXPECT_EQ(pool_wanted(w.heat, s, 1, held), (std::vector<uint32_t>{1}));
    w.use(0, 2, 10);  // 24 against 2
    EXPECT_EQ(pool_wanted(w.heat, s, 1, held), (std::vector<uint32_t>{2}));
    // The elite too: held, it keeps its place by the same margin.
    s.elite_share = 0.125;
    EXPECT_EQ(pool_elite(w.heat, s, held), (std::vector<uint32_t>{2}));
    w.use(0, 1, 8);  // 10 against 24
    EXPECT_EQ(pool_elite(w.heat, s, held), (std::vector<uint32_t>{1})) << "a held elite expert lost its place to noise";
    EXPECT_EQ(pool_elite(w.heat, s), (std::vector<uint32_t>{2}));
}

// Under one place the whole pool is directed (the hook admits only what was promoted) but a slack
// of 3 %, and the hook keeps no LRU part of its own.
TEST(Planner, UnderOnePlaceThePoolIsDirectedWholeButItsSlack) {
    const PoolDirection one = pool_direction(true, 0.9, 0.5);
    EXPECT_EQ(pool_directed_experts(1000, one.directed, one.recency, one.slack), 970u);
    EXPECT_EQ(pool_directed_experts(4, one.directed, one.recency, one.slack), 4u);
    const PoolDirection two = pool_direction(false, 0.9, 0.5);
    EXPECT_EQ(pool_directed_experts(1000, two.directed, two.recency, two.slack), 500u);
    EXPECT_EQ(pool_direction(true, 0, 0.5).directed, 0.0) << "[vram] directed = 0 directs nothing under one place too";
}

TEST(Planner, TheRecencyShareComesOutOfTheDirectedPart) {
    EXPECT_EQ(pool_directed_experts(100, 0.9, 0), 90u);
    EXPECT_EQ(pool_directed_experts(100, 0.9, 0.5), 50u);
    EXPECT_EQ(pool_directed_experts(100, 0.4, 0.25), 40u) << "the configured share caps it";
    EXPECT_EQ(pool_directed_experts(100, 0.9, 1.0), 0u) << "all recency: nothing directed";
}

// RAM alone: the recency split is learnt at the room the lock cap gives, in experts a layer (never
// more than the model), and its share comes off the model's cap; no share, the cap as it is.
TEST(Planner, TheRamRecencySplitCutsTheCapByItsShare) {
    const uint64_t expert = 8ull << 20;
    EXPECT_DOUBLE_EQ(ram_split_room(256 * expert, 1024 * expert, 1024, 8), 32.0);  // a quarter of 128 a layer
    EXPECT_DOUBLE_EQ(ram_split_room(4096 * expert, 1024 * expert, 1024, 8), 128.0) << "at most the whole model";
    EXPECT_EQ(ram_split_room(256 * expert, 0, 0, 8), 0.0);
    EXPECT_EQ(recency_cut_cap(1000, 800, 0.0), 1000u);
    EXPECT_EQ(recency_cut_cap(1000, 800, 0.25), 600u) << "a quarter of the lock cap left to the page cache";
    EXPECT_EQ(recency_cut_cap(500, 800, 0.25), 500u) << "never above the model's own cap";
}

// One model's direction as the daemon and the sim make it: the pool's split learnt at its size,
// the directed part (here all of it under one place but the slack), the hottest first.
TEST(Planner, DirectPoolLearnsTheSplitAtThePoolsSizeAndDirectsTheHottest) {
    HeatTable heat(2, 8, 4096);
    for (int i = 0; i < 4; ++i) {
        const std::vector<uint32_t> hot{1, 2, 3};
        heat.record(0, hot);
        heat.record(1, hot);
        heat.advance_clock(1);
    }
    PlannerSettings s;
    s.admit_after_uses = 1;
    s.elite_share = 0.125;
    const PoolDirected d = direct_pool(heat, s, /*one_place=*/false, /*configured=*/0.5, /*pool_experts=*/8, {});
    EXPECT_EQ(heat.split_capacity(HeatTable::SplitFor::Pool), 4.0) << "8 experts over 2 layers";
    EXPECT_EQ(d.capacity, 4u) << "half of the pool directed";
    EXPECT_EQ(d.wanted.size(), 4u);
    EXPECT_FALSE(d.recency) << "nothing learnt yet";
    const PoolDirected one = direct_pool(heat, s, /*one_place=*/true, 0.5, 8, {});
    EXPECT_EQ(one.capacity, 8u) << "one place: the whole pool (a pool of 8 has no slack)";
    EXPECT_EQ(one.wanted.size(), 6u) << "every admitted expert";
    const PoolDirected none = direct_pool(heat, s, false, 0.0, 8, {});
    EXPECT_TRUE(none.wanted.empty()) << "[vram] directed = 0 directs nothing";
}

}  // namespace
}  // namespace moecache::daemon
