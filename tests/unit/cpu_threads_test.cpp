// The backend's CPU half leaves a CPU to the pool's copies where the runtime asks for all of them.
#include "moecache/backend/cpu_threads.h"

#include <gtest/gtest.h>

namespace moecache::backend {
namespace {

TEST(CpuHalfThreads, LeavesOneCpuWhereTheRuntimeAsksForEveryOne) {
    EXPECT_EQ(cpu_half_threads(16, 16), 15) << "llama.cpp's default on a 16-CPU machine";
    EXPECT_EQ(cpu_half_threads(32, 16), 15) << "more threads than CPUs: one CPU still left";
    EXPECT_EQ(cpu_half_threads(8, 16), 8) << "a count below the CPUs is the user's: kept";
    EXPECT_EQ(cpu_half_threads(15, 16), 15);
    EXPECT_EQ(cpu_half_threads(2, 2), 1);
    EXPECT_EQ(cpu_half_threads(1, 16), 1);
    EXPECT_EQ(cpu_half_threads(4, 1), 1);
    EXPECT_EQ(cpu_half_threads(0, 16), 1) << "never below one";
    EXPECT_GE(usable_cpus(), 1);
}

TEST(CpuHalfThreads, ASetCountIsReadStrictly) {
    EXPECT_EQ(parse_thread_count("auto"), 0);
    EXPECT_EQ(parse_thread_count(""), 0);
    EXPECT_EQ(parse_thread_count("8"), 8);
    EXPECT_EQ(parse_thread_count("1024"), 1024);
    for (const char* bad : {"0", "1025", "-4", "+4", " 4", "4 ", "4t", "x", "99999999999999999999"}) {
        EXPECT_FALSE(parse_thread_count(bad).has_value()) << bad;
    }
}

}  // namespace
}  // namespace moecache::backend
