// The daemon's count of failures it goes on after, and how often it says them.
#include "moecache/daemon/error_log.h"

#include <gtest/gtest.h>

namespace moecache::daemon {
namespace {

TEST(ErrorLog, EachKindIsCountedAndSaidAtMostOnceAMinute) {
    ErrorLog log;
    const auto t0 = ErrorLog::Clock::now();
    EXPECT_TRUE(log.note("locking an expert", "EAGAIN", t0)) << "the first is said";
    EXPECT_FALSE(log.note("locking an expert", "EAGAIN", t0 + std::chrono::seconds(10)))
        << "within the minute: counted";
    EXPECT_TRUE(log.note("reading an expert", "EIO", t0 + std::chrono::seconds(10)))
        << "another kind has its own minute";
    EXPECT_TRUE(log.note("locking an expert", "EAGAIN", t0 + ErrorLog::kLogEvery + std::chrono::seconds(1)))
        << "said again after the minute, with how many came between";
    const auto totals = log.totals();
    ASSERT_EQ(totals.size(), 2u);
    EXPECT_EQ(totals.at("locking an expert"), 3u);
    EXPECT_EQ(totals.at("reading an expert"), 1u);
}

}  // namespace
}  // namespace moecache::daemon
