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

}  // namespace
}  // namespace moecache::backend
