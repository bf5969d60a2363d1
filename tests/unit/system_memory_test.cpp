// The /proc readers the daemon plans from, on texts of the kernel's format (no root, no /proc).
#include "moecache/daemon/system_memory.h"
#include "temp_dir.h"

#include <gtest/gtest.h>

namespace moecache::daemon {
namespace {

constexpr const char* kMeminfo =
    "MemTotal:       24593728 kB\n"
    "MemFree:         1200000 kB\n"
    "MemAvailable:   20000000 kB\n"
    "Buffers:           12345 kB\n";

TEST(SystemMemory, ReadsTotalAndAvailableFromMeminfo) {
    test::TempDir dir;
    test::write_file(dir.file("meminfo"), kMeminfo);
    const auto m = read_system_memory(dir.file("meminfo"));
    ASSERT_TRUE(m);
    EXPECT_EQ(m->total, 24593728ull * 1024);
    EXPECT_EQ(m->available, 20000000ull * 1024);
    EXPECT_FALSE(read_system_memory(dir.file("absent"))) << "no file, no numbers";
    test::write_file(dir.file("old"), "MemTotal: 1000 kB\nMemFree: 10 kB\n");
    const auto old = read_system_memory(dir.file("old"));
    ASSERT_TRUE(old) << "a kernel without MemAvailable";
    EXPECT_EQ(old->available, 0u);
    test::write_file(dir.file("bad"), "MemFree: 10 kB\n");
    EXPECT_FALSE(read_system_memory(dir.file("bad"))) << "no MemTotal";
}

TEST(SystemMemory, FieldsAreParsedStrictly) {
    EXPECT_EQ(proc_kib_field("VmLck:\t  4 kB\n", "VmLck:"), 4096u);
    EXPECT_EQ(proc_kib_field("VmLckX: 1 kB\nVmLck: 2 kB", "VmLck:"), 2048u) << "the key with its colon, at the line's start";
    EXPECT_FALSE(proc_kib_field("VmLck: many kB\n", "VmLck:"));
    EXPECT_FALSE(proc_kib_field("VmLck: -3 kB\n", "VmLck:"));
    EXPECT_FALSE(proc_kib_field("VmLck: 99999999999999999999 kB\n", "VmLck:")) << "does not fit in 64 bits";
    EXPECT_FALSE(proc_kib_field("VmLck: 18014398509481984 kB\n", "VmLck:")) << "fits, but not once times 1024";
    EXPECT_FALSE(proc_kib_field("", "VmLck:"));
    test::TempDir dir;
    test::write_file(dir.file("status"), "Name:\tmoecached\nVmLck:\t  512 kB\n");
    EXPECT_EQ(read_locked_bytes(dir.file("status")), 512u * 1024);
    EXPECT_EQ(read_locked_bytes(dir.file("absent")), 0u);
}

}  // namespace
}  // namespace moecache::daemon
