// The prefetch queue's order by the reason for a read.
#include "moecache/daemon/fetch.h"

#include <gtest/gtest.h>

namespace moecache::daemon {
namespace {

TEST(FetchReason, EachReasonHasItsBandInOrder) {
    // Sooner first, and the last of one band before the first of the next.
    EXPECT_LT(fetch_priority(FetchReason::Miss, 1000), fetch_priority(FetchReason::Prediction, 0));
    EXPECT_LT(fetch_priority(FetchReason::Prediction, 1000), fetch_priority(FetchReason::Plan, 0));
    EXPECT_LT(fetch_priority(FetchReason::Plan, UINT32_MAX), fetch_priority(FetchReason::WarmStart, 0));
    EXPECT_LT(fetch_priority(FetchReason::WarmStart, UINT32_MAX), fetch_priority(FetchReason::Operator, 0));
    // Inside a band the caller's order holds; misses and predictions keep their arrival order.
    EXPECT_LT(fetch_priority(FetchReason::Plan, 3), fetch_priority(FetchReason::Plan, 4));
    EXPECT_LT(fetch_priority(FetchReason::Operator, 3), fetch_priority(FetchReason::Operator, 4));
    EXPECT_EQ(fetch_priority(FetchReason::Miss, 1), fetch_priority(FetchReason::Miss, 9));
    EXPECT_EQ(fetch_priority(FetchReason::Prediction, 1), fetch_priority(FetchReason::Prediction, 9));
    EXPECT_GT(fetch_priority(FetchReason::Operator, UINT32_MAX), 0) << "no overflow at the end of the last band";
}

TEST(FetchReason, OnlyThePlanReadsToLock) {
    EXPECT_FALSE(cache_only(FetchReason::Plan));
    for (auto r : {FetchReason::Miss, FetchReason::Prediction, FetchReason::WarmStart, FetchReason::Operator})
        EXPECT_TRUE(cache_only(r));
}

}  // namespace
}  // namespace moecache::daemon
