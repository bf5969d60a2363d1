// The daemon's count of failures it goes on after, and how often it says them.
#include "moecache/daemon/error_log.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace moecache::daemon {
namespace {

TEST(ErrorLog, EachKindIsCountedAndSaidAtMostOnceAMinute) {
    ErrorLog log;
    const auto t0 = ErrorLog::Clock::now();
    EXPECT_TRUE(log.note(Doing::LockingExpert, "EAGAIN", t0)) << "the first is said";
    EXPECT_FALSE(log.note(Doing::LockingExpert, "EAGAIN", t0 + std::chrono::seconds(10)))
        << "within the minute: counted";
    EXPECT_TRUE(log.note(Doing::ReadingExpert, "EIO", t0 + std::chrono::seconds(10)))
        << "another kind has its own minute";
    EXPECT_TRUE(log.note(Doing::LockingExpert, "EAGAIN", t0 + ErrorLog::kLogEvery + std::chrono::seconds(1)))
        << "said again after the minute, with how many came between";
    const auto totals = log.totals();
    EXPECT_EQ(totals.at("locking an expert"), 3u);
    EXPECT_EQ(totals.at("reading an expert into the page cache"), 1u);
}

// Every kind has its series from the start, at 0: an alert on a rate needs the series before the
// first failure, and a dashboard shows "none" rather than "no data".
TEST(ErrorLog, EveryKindIsCountedFromTheStartUnderItsOwnName) {
    const ErrorLog log;
    const auto totals = log.totals();
    ASSERT_EQ(totals.size(), kEveryDoing.size());
    std::set<std::string> names;
    for (const Doing d : kEveryDoing) {
        names.insert(to_string(d));
        ASSERT_EQ(totals.count(to_string(d)), 1u) << to_string(d);
        EXPECT_EQ(totals.at(to_string(d)), 0u);
    }
    EXPECT_EQ(names.size(), kEveryDoing.size()) << "two kinds share a name";
    EXPECT_EQ(names.count("unknown"), 0u);
}

}  // namespace
}  // namespace moecache::daemon
