// Reading a lazily loaded mapping's misses ahead in a memory cgroup at its limit, as the whole
// stack runs the runtime: what read_ahead returns is in the page cache when it returns. (Asking
// the kernel with MADV_WILLNEED instead is measured and printed, not asserted: in a cgroup at its
// limit its reads are mostly dropped, which is why read_ahead reads with pread.)
#include "memory_cgroup.h"
#include "moecache/backend/read_ahead.h"
#include "temp_dir.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace moecache {
namespace {

constexpr size_t kMiB = 1u << 20;
constexpr size_t kFile = 192 * kMiB;
constexpr uint64_t kLimit = 64 * kMiB;
constexpr size_t kFill = 96 * kMiB;  // read first: the cgroup is at its limit after it
constexpr size_t kPart = 32 * kMiB;  // then this, at kFile - 2 * kPart (pread) and kFile - kPart (WILLNEED)

size_t cached_pages(const char* p, size_t n) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in(n / page);
    if (mincore(const_cast<char*>(p), n, in.data()) != 0) return 0;
    size_t c = 0;
    for (const unsigned char v : in) c += v & 1;
    return c;
}

// In the child, inside the cgroup: 0 when the pread path left the whole part cached.
int child(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 10;
    void* map = mmap(nullptr, kFile, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return 11;
    auto* base = static_cast<char*>(map);
    if (madvise(base, kFile, MADV_RANDOM) != 0) return 12;  // as lazy load maps a model
    std::vector<char> buf(kMiB);
    for (size_t at = 0; at < kFill; at += buf.size())
        if (pread(fd, buf.data(), buf.size(), static_cast<off_t>(at)) <= 0) return 13;
    const auto reads = backend::own_mapping_reads(base);
    if (!reads || !reads->random) return 14;
    const UniqueFd file = backend::open_mapped_file(*reads);
    if (!file) return 15;
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t pages = kPart / page;

    char* part = base + kFile - 2 * kPart;
    const uint64_t part_at = reads->offset + (kFile - 2 * kPart);
    const uint64_t read = backend::read_ahead(part, kPart, file.get(), part_at);
    const size_t by_pread = cached_pages(part, kPart);
    // Read again: only what was evicted meanwhile (runs merge up to 16 cached pages between misses).
    const size_t missing = pages - cached_pages(part, kPart);
    const uint64_t again = backend::read_ahead(part, kPart, file.get(), part_at);
    char* other = base + kFile - kPart;
    (void)backend::read_ahead(other, kPart);  // no descriptor: MADV_WILLNEED, printed only
    usleep(200 * 1000);
    const size_t by_willneed = cached_pages(other, kPart);
    fprintf(stderr,
            "in a %llu MiB cgroup at its limit: pread read %llu MiB, %zu of %zu pages cached after it; "
            "MADV_WILLNEED: %zu of %zu cached 0.2 s after it\n",
            static_cast<unsigned long long>(kLimit / kMiB), static_cast<unsigned long long>(read / kMiB), by_pread,
            pages, by_willneed, pages);
    if (read < kPart / 2) return 16;             // it was not cached: most of it is read
    if (by_pread * 100 < pages * 95) return 17;  // and is cached when read_ahead returns
    if (again > missing * 17 * page) return 18;  // a cached range is not read again
    return 0;
}

TEST(ReadAheadUnderPressure, WhatItReadsIsCachedWhenItReturnsInACgroupAtItsLimit) {
    if (geteuid() != 0) GTEST_SKIP() << "needs root: a memory cgroup";
    test::TempDir dir;
    struct statfs fs {};
    ASSERT_EQ(statfs(dir.path().c_str(), &fs), 0);
    if (fs.f_type == TMPFS_MAGIC) GTEST_SKIP() << dir.path() << " is tmpfs: its pages are no page cache to read in";
    const std::string path = dir.file("experts.bin");
    {
        std::string chunk(kMiB, '\0');
        for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 2654435761u >> 13);
        FILE* f = fopen(path.c_str(), "wb");
        ASSERT_NE(f, nullptr);
        for (size_t at = 0; at < kFile; at += kMiB) ASSERT_EQ(fwrite(chunk.data(), 1, kMiB, f), kMiB);
        ASSERT_EQ(fclose(f), 0);
    }
    test::drop_page_cache(path);
    auto made = test::MemoryCgroup::create("moecache-read-ahead-test-", kLimit);
    if (!made) GTEST_SKIP() << "no memory cgroup: " << made.error().what();
    const auto& cgroup = *made;

    int go[2];
    ASSERT_EQ(pipe(go), 0);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        close(go[1]);
        char c = 0;
        if (read(go[0], &c, 1) != 1) _exit(9);
        _exit(child(path));
    }
    close(go[0]);
    const auto added = cgroup->add(pid);
    const char c = added ? 1 : 0;
    (void)!write(go[1], &c, 1);
    close(go[1]);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(added) << added.error().what();
    ASSERT_TRUE(WIFEXITED(status)) << "the child died: " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0)
        << "16: read_ahead read under half of an uncached range; 17: under 95 % of it cached when read_ahead "
           "returned; 18: a cached range read again (the rest: set-up)";
    EXPECT_EQ(cgroup->oom_kills(), 0u);
}

}  // namespace
}  // namespace moecache
