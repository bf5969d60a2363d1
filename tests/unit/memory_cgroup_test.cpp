// Which memory cgroup limit binds the daemon: parsed from /proc/self/cgroup and the limit files of
// a cgroup tree, here a fake one in a temporary directory (the real hierarchy is the root tests').
#include "moecache/memory_cgroup.h"
#include "temp_dir.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace moecache::daemon {
namespace {

using test::TempDir;
using test::write_file;

class MemoryCgroupTest : public ::testing::Test {
protected:
    void cgroup(const std::string& dir, const std::string& file, const std::string& value) {
        std::filesystem::create_directories(root_.file(dir));
        write_file(root_.file(dir + "/" + file), value);
    }
    std::optional<MemoryCgroupLimit> read(const std::string& proc_text) {
        write_file(proc_.file("cgroup"), proc_text);
        return own_memory_cgroup_limit(proc_.file("cgroup"), root_.path());
    }
    TempDir root_, proc_;
};

TEST_F(MemoryCgroupTest, V2TheSmallestLimitUpTheTreeBinds) {
    cgroup("", "cgroup.controllers", "cpu memory io\n");
    cgroup("system.slice", "memory.max", "4294967296\n");
    cgroup("system.slice", "memory.current", "1000\n");
    cgroup("system.slice/moecache.slice", "memory.max", "max\n");
    cgroup("system.slice/moecache.slice/moecached.service", "memory.max", "8589934592\n");
    cgroup("system.slice/moecache.slice/moecached.service", "memory.current", "7\n");
    const auto l = read("0::/system.slice/moecache.slice/moecached.service\n");
    ASSERT_TRUE(l);
    EXPECT_EQ(l->limit, 4ull << 30) << "the slice's limit is smaller than the service's";
    EXPECT_EQ(l->usage, 1000u);
    EXPECT_EQ(l->version, 2);
    EXPECT_EQ(l->dir, root_.file("system.slice"));
    EXPECT_EQ(l->reclaimable, 0u) << "no memory.stat";
}

TEST_F(MemoryCgroupTest, ReclaimableAndUnevictablePagesComeFromTheBindingCgroupsStat) {
    cgroup("", "cgroup.controllers", "memory\n");
    cgroup("a", "memory.max", "1000000\n");
    cgroup("a", "memory.stat", "anon 400\nfile 900\nactive_file 300\ninactive_file 200\nunevictable 350\n");
    auto l = read("0::/a\n");
    ASSERT_TRUE(l);
    EXPECT_EQ(l->reclaimable, 500u);
    EXPECT_EQ(l->unevictable, 350u);
    cgroup("memory/b", "memory.limit_in_bytes", "2000000\n");
    cgroup("memory/b", "memory.stat",
           "cache 9\nactive_file 1\ninactive_file 1\nunevictable 1\ntotal_active_file 70\ntotal_inactive_file 30\n"
           "total_unevictable 40\n");
    l = read("4:memory:/b\n");
    ASSERT_TRUE(l);
    EXPECT_EQ(l->reclaimable, 100u) << "v1 counts the cgroup's children in total_*";
    EXPECT_EQ(l->unevictable, 40u);
}

TEST_F(MemoryCgroupTest, V2WithoutAnyLimitIsNone) {
    cgroup("", "cgroup.controllers", "memory\n");
    cgroup("a", "memory.max", "max\n");
    cgroup("a/b", "memory.max", "max\n");
    EXPECT_FALSE(read("0::/a/b\n"));
    EXPECT_FALSE(read("0::/\n")) << "the root cgroup has no memory.max";
}

TEST_F(MemoryCgroupTest, HybridV2UnderUnified) {
    cgroup("unified", "cgroup.controllers", "\n");
    cgroup("unified/user.slice", "memory.max", "123\n");
    const auto l = read("1:name=systemd:/user.slice\n0::/user.slice\n");
    ASSERT_TRUE(l);
    EXPECT_EQ(l->limit, 123u);
}

TEST_F(MemoryCgroupTest, V1MemoryControllerWinsAndUnlimitedIsNone) {
    cgroup("memory", "memory.limit_in_bytes", "9223372036854771712\n");  // the root: unlimited
    cgroup("memory/squeeze", "memory.limit_in_bytes", "2097152000\n");
    cgroup("memory/squeeze", "memory.usage_in_bytes", "5000\n");
    cgroup("memory/squeeze/inner", "memory.limit_in_bytes", "9223372036854771712\n");
    const auto l = read("12:pids:/x\n4:memory:/squeeze/inner\n0::/user.slice\n");
    ASSERT_TRUE(l);
    EXPECT_EQ(l->limit, 2097152000u);
    EXPECT_EQ(l->usage, 5000u);
    EXPECT_EQ(l->version, 1);
    EXPECT_FALSE(read("4:cpuset,memory:/\n")) << "the v1 root is unlimited";
}

TEST_F(MemoryCgroupTest, GarbageIsNoLimitNotACrash) {
    cgroup("", "cgroup.controllers", "memory\n");
    cgroup("a", "memory.max", "12abc\n");
    EXPECT_FALSE(read("0::/a\n"));
    EXPECT_FALSE(read("nonsense\n:::\n0:\n"));
    EXPECT_FALSE(read(""));
    EXPECT_FALSE(own_memory_cgroup_limit(proc_.file("missing"), root_.path()));
    cgroup("b", "memory.max", "-5\n");
    EXPECT_FALSE(read("0::/b\n"));
    EXPECT_FALSE(read("0::/../../etc\n")) << "no limit files there";
}

}  // namespace
}  // namespace moecache::daemon
