// The decide step and its budget arithmetic without root: fixed snapshots in, actions out
// (moecache/daemon/budgets.h, decide.h). The daemon's root tests cover the kernel-facing parts.
#include "moecache/daemon/decide.h"
#include "moecache/daemon/budgets.h"
#include "moecache/first_fill.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace moecache::daemon {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

// --- budgets ----------------------------------------------------------------------------------

TEST(Budgets, TheLockCapIsTheSmallestOfBudgetRamCgroupAndPressure) {
    MemoryFacts m{64 * kGiB, 40 * kGiB, std::nullopt, std::nullopt};
    EXPECT_EQ(lock_cap(m, 32 * kGiB, 4 * kGiB), 32 * kGiB) << "the budget";
    EXPECT_EQ(lock_cap(m, 100 * kGiB, 4 * kGiB), 60 * kGiB) << "RAM less the reserve";
    m.cgroup_limit = 16 * kGiB;
    EXPECT_EQ(lock_cap(m, 100 * kGiB, 4 * kGiB), 12 * kGiB) << "the cgroup's limit less the reserve";
    EXPECT_EQ(lock_cap(m, 100 * kGiB, 4 * kGiB, 5 * kGiB), 5 * kGiB) << "a pressure back-off";
    m.cgroup_limit = 2 * kGiB;
    EXPECT_EQ(lock_cap(m, 100 * kGiB, 4 * kGiB), 0u) << "a limit under the reserve locks nothing";
}

// Issue 20 row 10: a co-tenant in the daemon's cgroup that grows takes locks back before the
// cgroup's OOM killer must act; its reclaimable page cache and the daemon's own locks do not count.
TEST(Budgets, WhatACoTenantInTheCgroupNeedsComesOffTheCap) {
    MemoryFacts m{64 * kGiB, 40 * kGiB, 16 * kGiB, 15 * kGiB};
    m.cgroup_reclaimable = 3 * kGiB;
    m.cgroup_unevictable = 8 * kGiB;  // the daemon's 7 GiB of locks and 1 GiB another process mlocked
    m.locked = 7 * kGiB;
    EXPECT_EQ(cgroup_others_need(m), 5 * kGiB) << "15 charged - 3 reclaimable - 7 the daemon's";
    EXPECT_EQ(lock_cap(m, 100 * kGiB, 1 * kGiB), 10 * kGiB) << "16 - 1 reserve - 5 the co-tenant needs";
    m.cgroup_usage = 16 * kGiB;  // the co-tenant grew by 1 GiB
    EXPECT_EQ(lock_cap(m, 100 * kGiB, 1 * kGiB), 9 * kGiB);
    m.cgroup_unevictable = 20 * kGiB;  // the daemon's locks are all it can claim as its own
    EXPECT_EQ(cgroup_others_need(m), 6 * kGiB);
    m.cgroup_usage = 1 * kGiB;  // counters read at different moments never underflow
    EXPECT_EQ(cgroup_others_need(m), 0u);
    m.cgroup_limit.reset();
    EXPECT_EQ(cgroup_others_need(m), 0u) << "no cgroup limit binds";
}

TEST(Budgets, PressureKeepsWhatTheReleaseShareLeaves) {
    EXPECT_EQ(pressure_keep(10 * kGiB, 0.25), 7.5 * kGiB);
    EXPECT_EQ(pressure_keep(10 * kGiB, 1.0), 0u);
    EXPECT_EQ(pressure_keep(0, 0.25), 0u);
}

TEST(Budgets, ALockFitsUnderEveryCapThatHoldsItOrNamesTheOneThatRefuses) {
    std::vector<LockHolder> h(4);
    h[0] = {100 * kMiB, 150 * kMiB, "a", kNoCap, std::nullopt, kNoCap};       // its own cap: 150
    h[1] = {100 * kMiB, kNoCap, "fam", 250 * kMiB, std::nullopt, kNoCap};     // a family of two, 250
    h[2] = {100 * kMiB, kNoCap, "fam", kNoCap, 1000u, 180 * kMiB};            // user 1000's budget: 180
    h[3] = {50 * kMiB, kNoCap, "d", kNoCap, 1000u, kNoCap};                   // also user 1000's
    LockLedger ledger(500 * kMiB, 400 * kMiB, h);
    EXPECT_EQ(ledger.total_locked(), 350 * kMiB);
    EXPECT_EQ(ledger.admits(0, 50 * kMiB), LockRefusal::None);
    EXPECT_EQ(ledger.admits(0, 51 * kMiB), LockRefusal::Model);
    EXPECT_EQ(ledger.family_cap(2), 250 * kMiB) << "the smallest budget among the family's members";
    EXPECT_EQ(ledger.admits(1, 50 * kMiB), LockRefusal::None);
    EXPECT_EQ(ledger.admits(1, 51 * kMiB), LockRefusal::Family) << "200 locked in the family";
    EXPECT_EQ(ledger.admits(2, 31 * kMiB), LockRefusal::User) << "150 locked by user 1000 over two models";
    EXPECT_EQ(ledger.admits(3, 151 * kMiB), LockRefusal::Global) << "500 in all";
    ledger.took(3, 30 * kMiB);
    EXPECT_EQ(ledger.admits(2, 1 * kMiB), LockRefusal::User) << "what one model of the user took counts for the other";
    EXPECT_EQ(ledger.admits(0, 50 * kMiB), LockRefusal::None);
    ledger.took(0, 50 * kMiB);
    EXPECT_EQ(ledger.total_locked(), 430 * kMiB);
    EXPECT_EQ(ledger.lockable(), 320 * kMiB);
    EXPECT_EQ(ledger.admits(1, 40 * kMiB), LockRefusal::None);
    LockLedger tight(kNoCap, 10 * kMiB, {LockHolder{}});
    EXPECT_EQ(tight.admits(0, 11 * kMiB), LockRefusal::Memory) << "no lock below the reserve";
    EXPECT_STREQ(to_string(LockRefusal::Family), "family budget");
}

TEST(Budgets, AWarmStartGetsWhatIsFreeLessThePlansReadsAndTheReserve) {
    MemoryFacts m{64 * kGiB, 20 * kGiB, std::nullopt, std::nullopt};
    EXPECT_EQ(warm_room(m, 4 * kGiB, 2 * kGiB), 14 * kGiB);
    EXPECT_EQ(warm_room(m, 4 * kGiB, 2 * kGiB, 3 * kGiB), 3 * kGiB) << "warm_limit";
    m.cgroup_limit = 10 * kGiB;
    m.cgroup_usage = 7 * kGiB;
    EXPECT_EQ(warm_room(m, 1 * kGiB, 1 * kGiB), 1 * kGiB) << "the room under the cgroup's limit binds";
    m.cgroup_usage = 11 * kGiB;
    EXPECT_EQ(warm_room(m, 0, 0), 0u);
}

TEST(Budgets, AWarmStartTakesTheHottestThatFitAndReadsThemColdestFirst) {
    std::vector<WarmCandidate> c = {{1, 5.0, 10}, {2, 9.0, 10}, {3, 7.0, 10}, {4, 1.0, 1}};
    auto picks = warm_picks(c, 25);
    ASSERT_EQ(picks.size(), 2u) << "9 and 7 fit; 5 does not, and the choice stops there";
    EXPECT_EQ(picks[0].slot, 3u) << "coldest first";
    EXPECT_EQ(picks[1].slot, 2u);
    EXPECT_TRUE(warm_picks(c, 5).empty());
    EXPECT_EQ(warm_picks(c, 100).size(), 4u);
}

// --- the decide step --------------------------------------------------------------------------

// A model of `layers` x `experts` slots of 1 MiB each, its heat from `uses` per slot.
struct FakeModel {
    FakeModel(uint32_t layers, uint32_t experts) : heat(layers, experts, 1e9), n(layers * experts) {
        facts.view.heat = &heat;
        facts.view.locked.assign(n, 0);
        facts.view.pinned.assign(n, 0);
        facts.view.slot_bytes.assign(n, kMiB);
        facts.slots.assign(n, SlotFacts{Tier::Storage, 0, kMiB, kMiB, true});
        facts.dense = SlotFacts{Tier::Storage, 0, 0, 0, true};
    }
    void use(uint32_t slot, uint32_t times) {
        const uint32_t e = slot % heat.n_experts();
        for (uint32_t i = 0; i < times; ++i) heat.record(slot / heat.n_experts(), std::span<const uint32_t>(&e, 1));
    }
    void locked(uint32_t slot) {
        facts.view.locked[slot] = 1;
        facts.slots[slot].tier = Tier::Locked;
        facts.slots[slot].cached = kMiB;
        facts.holder.locked += kMiB;
    }
    HeatTable heat;
    uint32_t n;
    ModelFacts facts;
};

TurnFacts turn(uint64_t cap, std::vector<ModelFacts> models, uint64_t available = 64 * kGiB) {
    TurnFacts f;
    f.memory = MemoryFacts{128 * kGiB, available, std::nullopt, std::nullopt};
    f.lock_cap = cap;
    f.reserve = 1 * kGiB;
    f.planner = PlannerSettings{1, 0.125, 0.25};
    f.models = std::move(models);
    return f;
}

bool has(const std::vector<SlotRef>& v, uint32_t model, uint32_t slot) {
    return std::find(v.begin(), v.end(), SlotRef{model, slot}) != v.end();
}

TEST(Decide, ThePlanIsReadFirstAndWhatIsCachedIsLockedAtOnce) {
    FakeModel m(1, 8);
    m.use(0, 9);
    m.use(1, 8);
    m.use(2, 7);
    m.facts.slots[1].cached = kMiB;  // in the page cache already
    const auto a = decide_turn(turn(4 * kMiB, {m.facts}));
    EXPECT_TRUE(has(a.read, 0, 0));
    EXPECT_TRUE(has(a.read, 0, 2));
    EXPECT_FALSE(has(a.read, 0, 1)) << "cached: nothing to read";
    EXPECT_TRUE(has(a.lock, 0, 1)) << "locked in this turn without a read";
    EXPECT_EQ(a.read.front(), (SlotRef{0, 0})) << "hottest first";
}

TEST(Decide, WhatWasReadIsLockedUnderTheCapsAndTheRestGoesBack) {
    FakeModel m(1, 8);
    for (uint32_t s = 0; s < 4; ++s) {
        m.use(s, 10 - s);
        m.facts.slots[s].tier = Tier::Fetching;
        m.facts.slots[s].cached = kMiB;
        m.facts.waiting.push_back(s);
    }
    m.facts.holder.cap = 3 * kMiB;  // its own budget: three
    const auto a = decide_turn(turn(8 * kMiB, {m.facts}));
    ASSERT_EQ(a.lock.size(), 3u);
    ASSERT_EQ(a.refused.size(), 1u);
    EXPECT_EQ(a.refused[0].at, (SlotRef{0, 3}));
    EXPECT_EQ(a.refused[0].why, LockRefusal::Model);
    EXPECT_TRUE(a.waiting[0].empty());
}

TEST(Decide, AFamilyCapHoldsAcrossItsModels) {
    FakeModel x(1, 4), y(1, 4);
    for (auto* m : {&x, &y}) {
        m->facts.holder.family = "fam";
        m->facts.holder.family_budget = 3 * kMiB;
        for (uint32_t s = 0; s < 2; ++s) {
            m->facts.slots[s].tier = Tier::Fetching;
            m->facts.slots[s].cached = kMiB;
            m->facts.waiting.push_back(s);
        }
    }
    const auto a = decide_turn(turn(100 * kMiB, {x.facts, y.facts}));
    EXPECT_EQ(a.lock.size(), 3u);
    ASSERT_EQ(a.refused.size(), 1u);
    EXPECT_EQ(a.refused[0].why, LockRefusal::Family);
    EXPECT_EQ(a.refused[0].at.model, 1u);
}

TEST(Decide, AUsersBudgetHoldsAcrossTheModelsTheyRegistered) {
    FakeModel x(1, 4), y(1, 4);
    for (auto* m : {&x, &y}) {
        m->facts.holder.uid = 1000;
        m->facts.holder.user_budget = 2 * kMiB;
        m->facts.holder.family = m == &x ? "x" : "y";
    }
    x.locked(0);
    y.facts.slots[0].tier = Tier::Fetching;
    y.facts.slots[0].cached = kMiB;
    y.facts.waiting = {0};
    y.facts.slots[1] = y.facts.slots[0];
    y.facts.waiting.push_back(1);
    const auto a = decide_turn(turn(100 * kMiB, {x.facts, y.facts}));
    ASSERT_EQ(a.lock.size(), 1u);
    EXPECT_EQ(a.lock[0], (SlotRef{1, 0}));
    ASSERT_EQ(a.refused.size(), 1u);
    EXPECT_EQ(a.refused[0].why, LockRefusal::User);
}

TEST(Decide, NoLockBelowTheReserveAndAtMostABoundedAmountATurn) {
    FakeModel m(1, 8);
    for (uint32_t s = 0; s < 8; ++s) {
        m.use(s, 1);
        m.facts.slots[s].tier = Tier::Fetching;
        m.facts.slots[s].cached = kMiB;
        m.facts.waiting.push_back(s);
    }
    // 1 GiB reserve, 1 GiB + 2 MiB available: two locks fit.
    auto a = decide_turn(turn(100 * kMiB, {m.facts}, 1 * kGiB + 2 * kMiB));
    EXPECT_EQ(a.lock.size(), 2u);
    EXPECT_EQ(a.refused.size(), 6u);
    EXPECT_EQ(a.refused.back().why, LockRefusal::Memory);
    // A turn locks at most lock_bytes_per_turn; the rest waits for the next, in order.
    auto f = turn(100 * kMiB, {m.facts});
    f.lock_bytes_per_turn = 3 * kMiB;
    a = decide_turn(f);
    EXPECT_EQ(a.lock.size(), 3u);
    EXPECT_EQ(a.waiting[0], (std::vector<uint32_t>{3, 4, 5, 6, 7}));
}

TEST(Decide, ASlotAVramPoolTookWhileItWasReadIsGivenUpNotLocked) {
    FakeModel m(1, 4);
    m.facts.slots[2].tier = Tier::Fetching;
    m.facts.slots[2].cached = kMiB;
    m.facts.slots[2].wanted_in_ram = false;  // one place: the pool holds it now
    m.facts.waiting = {2};
    const auto a = decide_turn(turn(100 * kMiB, {m.facts}));
    EXPECT_TRUE(a.lock.empty());
    EXPECT_TRUE(has(a.given_up, 0, 2));
}

TEST(Decide, AnExpertInAVramPoolIsReleasedFromRam) {
    FakeModel m(1, 4);
    m.use(0, 5);
    m.use(1, 4);
    m.locked(0);
    m.locked(1);
    m.facts.view.in_vram.assign(4, 0);
    m.facts.view.in_vram[0] = 1;  // the pool holds expert 0: one place
    m.facts.slots[0].wanted_in_ram = false;
    const auto a = decide_turn(turn(100 * kMiB, {m.facts}));
    EXPECT_TRUE(has(a.release, 0, 0));
    EXPECT_FALSE(has(a.release, 0, 1));
}

TEST(Decide, PressureBackOffReleasesTheColdestFirst) {
    FakeModel m(1, 8);
    for (uint32_t s = 0; s < 4; ++s) {
        m.use(s, 10 - s);
        m.locked(s);
    }
    // Pressure left 2 MiB of the 4 locked: the cap the loop passes is the back-off's.
    auto f = turn(lock_cap(MemoryFacts{128 * kGiB, 64 * kGiB, std::nullopt, std::nullopt}, kNoCap, kGiB,
                           pressure_keep(4 * kMiB, 0.5)),
                  {m.facts});
    const auto a = decide_turn(f);
    ASSERT_EQ(a.release.size(), 2u);
    EXPECT_TRUE(has(a.release, 0, 3));
    EXPECT_TRUE(has(a.release, 0, 2));
    EXPECT_TRUE(a.read.empty());
}

TEST(Decide, AWarmStartReadsTheProfilesHotExpertsBeyondThePlanIntoTheRoomThereIs) {
    FakeModel m(1, 16);
    for (uint32_t s = 0; s < 16; ++s) m.use(s, 20 - s);
    m.facts.warm_pending = true;
    // Lock cap 2 MiB: the plan reads 0 and 1; 4 GiB + 1 GiB reserve + the plan's 2 MiB leaves
    // room for everything else.
    auto a = decide_turn(turn(2 * kMiB, {m.facts}, 5 * kGiB));
    ASSERT_EQ(a.warm.size(), 1u);
    EXPECT_EQ(a.warm[0].chosen, 14u);
    ASSERT_EQ(a.warm[0].slots.size(), 14u);
    EXPECT_EQ(a.warm[0].slots.front(), 15u) << "coldest first";
    EXPECT_EQ(a.warm[0].slots.back(), 2u);
    EXPECT_FALSE(std::count(a.warm[0].slots.begin(), a.warm[0].slots.end(), 0u)) << "the plan reads it for a lock";
    // With little room only the hottest that fit.
    a = decide_turn(turn(2 * kMiB, {m.facts}, 1 * kGiB + 2 * kMiB + 3 * kMiB));
    ASSERT_EQ(a.warm.size(), 1u);
    EXPECT_EQ(a.warm[0].slots, (std::vector<uint32_t>{4, 3, 2}));
    // Used once, with admit_after_uses 2: not the profile's.
    FakeModel once(1, 4);
    once.use(3, 1);
    once.facts.warm_pending = true;
    auto f = turn(0, {once.facts});
    f.planner.admit_after_uses = 2;
    a = decide_turn(f);
    ASSERT_EQ(a.warm.size(), 1u);
    EXPECT_TRUE(a.warm[0].slots.empty());
}

// One place is for RAM that cannot lock every expert anyway, with hysteresis at the edge.
// Between ticks, a placement follows the router's reports: after kPlaceEveryTokens tokens, not
// sooner than kPlaceAtMostEvery after the last one; a prompt batch (many tokens) at once.
TEST(PlacementDue, AfterEnoughTokensAndNotTooSoon) {
    using std::chrono::milliseconds;
    EXPECT_FALSE(placement_due(kPlaceEveryTokens - 1, milliseconds(5000)));
    EXPECT_TRUE(placement_due(kPlaceEveryTokens, kPlaceAtMostEvery));
    EXPECT_FALSE(placement_due(512, kPlaceAtMostEvery - milliseconds(1))) << "a burst of batches places at most so often";
    EXPECT_TRUE(placement_due(512, milliseconds(250)));
}

TEST(OnePlace, OnlyWhereTheExpertsDoNotFitTheLockCap) {
    EXPECT_TRUE(one_place_needed(30 * kGiB, 17 * kGiB, std::nullopt)) << "the GPU machine's squeeze";
    EXPECT_FALSE(one_place_needed(30 * kGiB, 100 * kGiB, std::nullopt)) << "RAM holds the model";
    EXPECT_FALSE(one_place_needed(30 * kGiB, 30 * kGiB, std::nullopt)) << "exactly: it fits";
    // On: stays on until the cap holds 1.1 times the experts.
    EXPECT_TRUE(one_place_needed(30 * kGiB, 32 * kGiB, true));
    EXPECT_FALSE(one_place_needed(30 * kGiB, 34 * kGiB, true));
    // Off: on again as soon as they do not fit.
    EXPECT_FALSE(one_place_needed(30 * kGiB, 30 * kGiB, false));
    EXPECT_TRUE(one_place_needed(30 * kGiB, 30 * kGiB - 1, false));
}

// Reads after a runtime's misses: each slot once, only what RAM wants and no read or lock has yet,
// never for a model a hook serves (it reads its own misses), never for a slot the turn cannot see.
TEST(FetchReads, AMissIsReadOnceWhereRamWantsItAndNoHookReadsIt) {
    const auto slot = [](uint32_t model, uint32_t s) {
        FetchCandidate c;
        c.at = {model, s};
        c.known = true;
        c.length = 8 << 20;
        return c;
    };
    std::vector<FetchCandidate> missed{slot(1, 7), slot(0, 3), slot(1, 7), slot(0, 2)};
    missed.push_back(slot(0, 4));
    missed.back().tier = Tier::Fetching;  // being read for a lock: that read is as good
    missed.push_back(slot(0, 5));
    missed.back().wanted_in_ram = false;  // a pool holds it (one place)
    missed.push_back(slot(2, 1));
    missed.back().hooked = true;
    missed.push_back(slot(3, 0));
    missed.back().known = false;  // a model closed since, or a slot out of range
    EXPECT_EQ(reads_after_misses(missed), (std::vector<SlotRef>{{0, 2}, {0, 3}, {1, 7}}));
}

// Reads after predictions: none while other reads wait (speculation never queues behind real
// work); else what is in storage, not wholly cached and read for RAM, each once.
TEST(FetchReads, APredictionIsReadOnlyWhenNothingElseWaits) {
    const auto slot = [](uint32_t s) {
        FetchCandidate c;
        c.at = {0, s};
        c.known = true;
        c.length = 8 << 20;
        return c;
    };
    std::vector<FetchCandidate> predicted{slot(9), slot(4), slot(9)};
    predicted.push_back(slot(5));
    predicted.back().cached = 8 << 20;  // wholly cached already
    predicted.push_back(slot(6));
    predicted.back().read_for_ram = false;  // bound for VRAM
    predicted.push_back(slot(7));
    predicted.back().tier = Tier::Locked;
    EXPECT_EQ(reads_after_predictions(predicted, false), (std::vector<SlotRef>{{0, 4}, {0, 9}}));
    EXPECT_TRUE(reads_after_predictions(predicted, true).empty());
}

// The prompt-model swap: a member of a family no runtime holds while another is in use holds
// nothing; after both runtimes went, the one that went first waits for the other (standby) and
// that one is not put on standby for being idle; a model unused for kStandbyAfter rests, unless kept.
TEST(ModelsAtRest, AFamilysModelWaitsForTheMemberInUseAndIdleOnesRest) {
    using namespace std::chrono_literals;
    const auto now = std::chrono::steady_clock::now();
    const ModelUse decode{"fam", true, false, std::nullopt, now};
    const ModelUse prompt{"fam", false, false, now - 5s, now - 5s};
    const ModelUse other{"solo", false, false, std::nullopt, now - kStandbyAfter - 1s};
    const ModelUse kept{"kept", false, true, std::nullopt, now - kStandbyAfter - 1s};
    auto rest = models_at_rest(std::vector<ModelUse>{decode, prompt, other, kept}, now);
    ASSERT_EQ(rest.size(), 4u);
    EXPECT_FALSE(rest[0].left || rest[0].standby) << "the model in use";
    EXPECT_TRUE(rest[1].left && rest[1].standby) << "its family is in use by another member";
    EXPECT_TRUE(rest[2].standby && !rest[2].left) << "idle past kStandbyAfter";
    EXPECT_FALSE(rest[3].standby) << "keep";

    // Both runtimes went, the prompt model's first: the runtime moves between them, so the one
    // that went last (used a moment ago) yields to it, and it is awaited: not put on standby
    // although idle past kStandbyAfter.
    const ModelUse decode_gone{"fam", false, false, now - 2s, now - 2s};
    const ModelUse prompt_gone{"fam", false, false, now - 90s, now - kStandbyAfter - 1s};
    rest = models_at_rest(std::vector<ModelUse>{decode_gone, prompt_gone}, now);
    EXPECT_TRUE(rest[0].standby) << "went last: yields to the member that comes next";
    EXPECT_FALSE(rest[1].standby) << "awaited: the runtime moves to it next";
    EXPECT_FALSE(rest[0].left || rest[1].left) << "no member in use";

    // A member no runtime ever used is not awaited (nothing says it comes next), nor yielded to.
    const ModelUse never{"fam", false, false, std::nullopt, now - kStandbyAfter - 1s};
    rest = models_at_rest(std::vector<ModelUse>{never, decode_gone}, now);
    EXPECT_TRUE(rest[0].standby) << "idle, and not awaited";
    EXPECT_FALSE(rest[1].standby) << "nothing to yield to";
}

// One place, expert by expert: out of RAM only what every live client holds in VRAM, and only
// where one of them may evict; nothing without one place, with keep_ram_copy, or without clients.
TEST(OnePlace, AnExpertLeavesRamOnlyWhenEveryClientHoldsItAndOneMayEvict) {
    const std::vector<uint32_t> holders{2, 1, 2, 0};
    const std::vector<uint8_t> evictors{1, 1, 0, 0};
    EXPECT_EQ(released_from_ram(holders, evictors, 2, true, false), (std::vector<uint8_t>{1, 0, 0, 0}));
    EXPECT_EQ(released_from_ram(holders, evictors, 1, true, false), (std::vector<uint8_t>{0, 1, 0, 0}))
        << "one client: what it holds and may evict";
    EXPECT_EQ(released_from_ram(holders, evictors, 2, false, false), (std::vector<uint8_t>(4, 0))) << "not one place";
    EXPECT_EQ(released_from_ram(holders, evictors, 2, true, true), (std::vector<uint8_t>(4, 0))) << "keep_ram_copy";
    EXPECT_EQ(released_from_ram(std::vector<uint32_t>(4, 0), evictors, 0, true, false), (std::vector<uint8_t>(4, 0)))
        << "no live client";
}

// One read, one place, from the start: an expert every client holds or, filling for the first
// time, was directed to hold, one at least yet to fill it, is bound for VRAM; nowhere a client
// has no reported pool or may not evict, and never without one place and fill_from_files.
TEST(OnePlace, WhatEveryFillingPoolWasDirectedToHoldIsBoundForVram) {
    ClientPool a;
    a.pooled = a.may_release = a.filling = true;
    a.holds = {1, 0, 0, 0, 0};
    a.promoted = {1, 1, 1, 0, 0};
    ClientPool b = a;
    b.holds = {1, 1, 0, 0, 1};
    b.promoted = {0, 0, 1, 1, 0};
    const std::vector<ClientPool> both{a, b};
    // 0: both hold it (nothing to fill); 1: a fills, b holds; 2: both fill; 3: a neither; 4: a neither.
    EXPECT_EQ(bound_for_vram(both, 5, true, false, true), (std::vector<uint8_t>{0, 1, 1, 0, 0}));
    ClientPool done = b;
    done.filling = false;  // its first fill is over: its promotions no longer bind
    EXPECT_EQ(bound_for_vram(std::vector<ClientPool>{a, done}, 5, true, false, true),
              (std::vector<uint8_t>{0, 1, 0, 0, 0}));
    ClientPool user = b;
    user.may_release = false;
    EXPECT_TRUE(bound_for_vram(std::vector<ClientPool>{a, user}, 5, true, false, true).empty()) << "may not evict";
    ClientPool early = b;
    early.pooled = false;
    EXPECT_TRUE(bound_for_vram(std::vector<ClientPool>{a, early}, 5, true, false, true).empty()) << "no pool reported";
    EXPECT_TRUE(bound_for_vram(both, 5, false, false, true).empty()) << "not one place";
    EXPECT_TRUE(bound_for_vram(both, 5, true, true, true).empty()) << "keep_ram_copy";
    EXPECT_TRUE(bound_for_vram(both, 5, true, false, false).empty()) << "fill_from_files off";
    EXPECT_TRUE(bound_for_vram({}, 5, true, false, true).empty()) << "no clients";
}

// A pool's first fill ends at nine in ten of what it was directed to hold (the daemon and the hook
// alike: moecache/first_fill.h).
TEST(FirstFill, NineInTenOfTheDirectedPoolHeldEndsIt) {
    EXPECT_TRUE(first_fill_held(9, 10));
    EXPECT_TRUE(first_fill_held(10, 10));
    EXPECT_FALSE(first_fill_held(8, 10));
    EXPECT_FALSE(first_fill_held(0, 0)) << "nothing directed yet: not filled";
    EXPECT_EQ(kFirstFillBound, std::chrono::seconds(120));
}

}  // namespace
}  // namespace moecache::daemon
