// The state machine of an expert's tier (ModelResidency): its transitions, and the ones it refuses.
#include "model_fixture.h"
#include "moecache/daemon/model_residency.h"
#include "temp_dir.h"

#include <gtest/gtest.h>

namespace moecache::daemon {
namespace {

class ResidencyState : public testing::Test {
protected:
    void SetUp() override {
        const std::string path = dir_.file("model.gguf");
        test::write_model(test::small_spec(), path);
        ModelConfig mc;
        mc.path = path;
        auto r = ModelResidency::open(path, mc, 1000);
        ASSERT_TRUE(r) << r.error().what();
        res_ = std::move(*r);
    }
    Tier tier(uint32_t slot) const { return res_->state(slot).tier(); }

    test::TempDir dir_;
    std::unique_ptr<ModelResidency> res_;
};

TEST_F(ResidencyState, AReadIsBegunFromStorageOnlyAndAbandonedBackToIt) {
    EXPECT_EQ(tier(3), Tier::Storage);
    EXPECT_TRUE(res_->begin_fetch(3));
    EXPECT_EQ(tier(3), Tier::Fetching);
    EXPECT_FALSE(res_->begin_fetch(3)) << "a second read of a slot being read";
    EXPECT_EQ(tier(3), Tier::Fetching);
    EXPECT_TRUE(res_->abandon(3));
    EXPECT_EQ(tier(3), Tier::Storage);
    EXPECT_TRUE(res_->abandon(3)) << "abandoning nothing leaves it in storage";
    EXPECT_EQ(tier(3), Tier::Storage);
}

TEST_F(ResidencyState, ASlotIsReadyWhenItsLastReadIsDoneAndLeavesReadyWhenAbandoned) {
    ASSERT_TRUE(res_->begin_fetch(4));
    res_->read_queued(4);
    res_->read_queued(4);
    EXPECT_EQ(res_->state(4).reads_pending(), 2u);
    EXPECT_FALSE(res_->read_done(4)) << "one of its two reads is still in flight";
    EXPECT_TRUE(res_->ready().empty());
    EXPECT_TRUE(res_->read_done(4));
    EXPECT_EQ(res_->ready(), std::vector<uint32_t>{4});
    EXPECT_FALSE(res_->read_done(4)) << "a completion with none pending is not a second readiness";
    EXPECT_EQ(res_->ready().size(), 1u);
    EXPECT_TRUE(res_->abandon(4));
    EXPECT_TRUE(res_->ready().empty()) << "an abandoned slot is not locked from the ready list";
    // A read that completes after its slot was abandoned (a cancelled read reports too).
    ASSERT_TRUE(res_->begin_fetch(7));
    res_->read_queued(7);
    EXPECT_TRUE(res_->abandon(7));
    EXPECT_FALSE(res_->read_done(7));
    EXPECT_TRUE(res_->ready().empty());
    EXPECT_EQ(res_->state(7).reads_pending(), 0u);
}

TEST_F(ResidencyState, ACacheReadIsCountedUntilItsLastReadAndAMissKeepsItsReason) {
    res_->cache_read_queued(2, FetchReason::WarmStart, 2);
    ASSERT_EQ(res_->cache_reads().count(2), 1u);
    EXPECT_EQ(res_->cache_reads().at(2).reason, FetchReason::WarmStart);
    res_->cache_read_queued(2, FetchReason::Operator, 1);
    EXPECT_EQ(res_->cache_reads().at(2).reason, FetchReason::WarmStart) << "queued again behind: its first reason";
    res_->cache_read_queued(2, FetchReason::Miss, 2);
    EXPECT_EQ(res_->cache_reads().at(2).reason, FetchReason::Miss) << "a miss's request is a miss's read";
    EXPECT_EQ(res_->cache_reads().at(2).reads, 5u);
    for (int i = 0; i < 4; ++i) res_->cache_read_done(2);
    EXPECT_EQ(res_->cache_reads().count(2), 1u);
    res_->cache_read_done(2);
    EXPECT_EQ(res_->cache_reads().count(2), 0u);
    res_->cache_read_done(2);  // a late completion of nothing
    res_->cache_read_queued(9, FetchReason::Prediction, 0);
    EXPECT_EQ(res_->cache_reads().count(9), 0u) << "no reads, nothing in flight";
    res_->cache_read_queued(9, FetchReason::Prediction, 1);
    EXPECT_TRUE(res_->forget_cache_read(9));
    EXPECT_FALSE(res_->forget_cache_read(9));
    EXPECT_TRUE(res_->cache_reads().empty());
}

TEST_F(ResidencyState, ALockedSlotLeavesOnlyThroughRelease) {
    // One expert of 204 KiB: within the default RLIMIT_MEMLOCK, so no root needed.
    ASSERT_TRUE(res_->begin_fetch(5));
    auto locked = res_->lock(5);
    if (!locked) GTEST_SKIP() << "cannot mlock here: " << locked.error().what();
    EXPECT_EQ(tier(5), Tier::Locked);
    EXPECT_GT(res_->state(5).locked_bytes(), 0u);
    EXPECT_FALSE(res_->begin_fetch(5));
    EXPECT_FALSE(res_->abandon(5)) << "an abandon would leave its pages locked and uncounted";
    EXPECT_EQ(tier(5), Tier::Locked);
    auto freed = res_->release(5, false);
    ASSERT_TRUE(freed) << freed.error().what();
    EXPECT_EQ(tier(5), Tier::Storage);
    EXPECT_EQ(res_->state(5).locked_bytes(), 0u);
    // From storage straight to locked (its bytes were cached already), and back.
    ASSERT_TRUE(res_->lock(6));
    EXPECT_EQ(tier(6), Tier::Locked);
    ASSERT_TRUE(res_->release(6, true));
    EXPECT_EQ(tier(6), Tier::Storage);
}

}  // namespace
}  // namespace moecache::daemon
