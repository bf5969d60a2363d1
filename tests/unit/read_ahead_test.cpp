// Reading a lazily loaded mapping's experts ahead of their use: which mappings read at random, and
// that a range the page cache does not hold is read in without being touched.
#include "moecache/backend/read_ahead.h"

#include "temp_dir.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace moecache::backend {
namespace {

TEST(ReadAhead, FindsTheMappingThatHoldsAnAddressAndWhetherItReadsAtRandom) {
    const std::string smaps =
        "7f0000000000-7f0000100000 r--s 00a00000 fe:01 1234 /models/my model.gguf\n"
        "Size:               1024 kB\n"
        "VmFlags: rd sh mr mw me ms rr sd\n"
        "7f0000200000-7f0000300000 r--p 00000000 fe:01 99 /usr/lib/libc.so.6\n"
        "Size:               1024 kB\n"
        "VmFlags: rd mr mw me sd\n"
        "7ffff000-7ffff100 rw-p 00000000 00:00 0\n"
        "Size:                  4 kB\n";
    const auto m = mapping_reads(smaps, 0x7f0000080000);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->start, 0x7f0000000000u);
    EXPECT_EQ(m->end, 0x7f0000100000u);
    EXPECT_TRUE(m->random);
    EXPECT_EQ(m->offset, 0xa00000u) << "the file offset the mapping starts at (hex in smaps)";
    EXPECT_EQ(m->inode, 1234u);
    EXPECT_EQ(m->path, "/models/my model.gguf") << "a path with a space is the rest of the line";
    const auto lib = mapping_reads(smaps, 0x7f0000200000);
    ASSERT_TRUE(lib);
    EXPECT_FALSE(lib->random) << "rd mr mw me sd has no rr";
    const auto anon = mapping_reads(smaps, 0x7ffff010);
    ASSERT_TRUE(anon) << "a mapping without a VmFlags line is still found";
    EXPECT_FALSE(anon->random);
    EXPECT_EQ(anon->inode, 0u);
    EXPECT_TRUE(anon->path.empty());
    EXPECT_FALSE(open_mapped_file(*anon)) << "anonymous memory has no file to read ahead from";
    EXPECT_FALSE(mapping_reads(smaps, 0x7f0000100000)) << "one past a mapping's end is not in it";
    EXPECT_FALSE(mapping_reads("garbage\n-\n12-zz rw\nVmFlags: rr\n", 0x12));
}

bool any_cached(const void* p, size_t n) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in(n / page);
    if (mincore(const_cast<void*>(p), n, in.data()) != 0) return true;
    for (const unsigned char c : in)
        if ((c & 1) != 0) return true;
    return false;
}

bool all_cached(const void* p, size_t n) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in(n / page);
    if (mincore(const_cast<void*>(p), n, in.data()) != 0) return false;
    for (const unsigned char c : in)
        if ((c & 1) == 0) return false;
    return true;
}

TEST(ReadAhead, ReadsARangeTheCacheDoesNotHoldWithoutTouchingIt) {
    test::TempDir dir;
    const std::string path = dir.file("experts.bin");
    constexpr size_t kBytes = 8u << 20;
    test::write_file(path, std::string(kBytes, 'x'));
    test::drop_page_cache(path);
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    void* map = mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    ASSERT_NE(map, MAP_FAILED);
    ASSERT_EQ(madvise(map, kBytes, MADV_RANDOM), 0);  // as lazy load maps a model
    auto* base = static_cast<char*>(map);

    const auto reads = own_mapping_reads(base + kBytes / 2);
    ASSERT_TRUE(reads);
    EXPECT_TRUE(reads->random);
    EXPECT_LE(reads->start, reinterpret_cast<uintptr_t>(base));
    EXPECT_GE(reads->end, reinterpret_cast<uintptr_t>(base + kBytes));

    // The file behind the mapping, opened by its smaps path; a path whose inode is another file's is not.
    const UniqueFd file = open_mapped_file(*reads);
    if (!file) GTEST_SKIP() << "the file smaps names has another inode through stat (overlayfs without xino?)";
    MappingReads moved = *reads;
    moved.inode += 1;
    EXPECT_FALSE(open_mapped_file(moved)) << "the path names another file now";

    // The second quarter: read in from the file (pread), with nothing touching it; the rest stays out.
    char* part = base + kBytes / 4;
    if (any_cached(part, kBytes / 4)) GTEST_SKIP() << "the page cache kept part of the file after it was dropped";
    const uint64_t file_at = reads->offset + (reinterpret_cast<uintptr_t>(part) - reads->start);
    EXPECT_EQ(read_ahead(part, kBytes / 4, file.get(), file_at), kBytes / 4);
    EXPECT_TRUE(all_cached(part, kBytes / 4)) << "a pread is done when read_ahead returns";
    EXPECT_FALSE(all_cached(base + kBytes * 3 / 4, kBytes / 4)) << "more than the range was read";
    EXPECT_EQ(read_ahead(part, kBytes / 4, file.get(), file_at), 0u) << "a cached range is not read again";
    EXPECT_EQ(read_ahead(part, 0, file.get(), file_at), 0u);

    // Only what is not cached is read: a piece dropped from the middle of the range is what is read.
    const int own = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(own, 0);
    ASSERT_EQ(posix_fadvise(own, static_cast<off_t>(kBytes / 4 + kBytes / 16), 256 << 10, POSIX_FADV_DONTNEED), 0);
    close(own);
    if (any_cached(part + kBytes / 16, 256 << 10)) GTEST_SKIP() << "the page cache kept a piece it was told to drop";
    EXPECT_EQ(read_ahead(part, kBytes / 4, file.get(), file_at), 256u << 10);
    EXPECT_TRUE(all_cached(part, kBytes / 4));

    // Without a descriptor the kernel is asked (MADV_WILLNEED): asynchronous, so waited for here.
    char* last = base + kBytes * 3 / 4;
    EXPECT_EQ(read_ahead(last, kBytes / 4), kBytes / 4);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!all_cached(last, kBytes / 4) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_TRUE(all_cached(last, kBytes / 4)) << "the range was not read within 10 s";
    EXPECT_FALSE(all_cached(base, kBytes / 4)) << "more than the ranges asked for was read";

    // A mapping without MADV_RANDOM is not taken for a lazily loaded one.
    void* plain = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(plain, MAP_FAILED);
    const auto plain_reads = own_mapping_reads(plain);
    ASSERT_TRUE(plain_reads);
    EXPECT_FALSE(plain_reads->random);
    munmap(plain, 1 << 20);
    munmap(map, kBytes);
}

TEST(ReadAhead, ALayersMissesAreReadTogetherEachRangeItsOwnCount) {
    test::TempDir dir;
    const std::string path = dir.file("layer.bin");
    constexpr size_t kSlice = 3u << 20, kSlices = 8;  // 24 MiB: shared among threads
    {
        std::string bytes(kSlice * kSlices, '\0');
        for (size_t i = 0; i < bytes.size(); i += 4096) bytes[i] = static_cast<char>(i >> 12);
        test::write_file(path, bytes);
    }
    test::drop_page_cache(path);
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    void* map = mmap(nullptr, kSlice * kSlices, PROT_READ, MAP_SHARED, fd, 0);
    ASSERT_NE(map, MAP_FAILED);
    ASSERT_EQ(madvise(map, kSlice * kSlices, MADV_RANDOM), 0);
    auto* base = static_cast<char*>(map);
    if (any_cached(base, kSlice * kSlices)) GTEST_SKIP() << "the page cache kept part of the file after it was dropped";
    const auto reads = own_mapping_reads(base);
    ASSERT_TRUE(reads);
    const UniqueFd file = open_mapped_file(*reads);  // as the pool opens it: reads no more than asked
    if (!file) GTEST_SKIP() << "the file smaps names has another inode through stat (overlayfs without xino?)";
    // Slices 1, 3, 4 and 6 missed; 4 is asked for twice (read for its first range only).
    std::vector<ReadRange> ranges;
    for (const size_t e : {1, 3, 4, 6, 4})
        ranges.push_back(ReadRange{base + e * kSlice, kSlice, file.get(), e * kSlice});
    ranges.push_back(ReadRange{base, 0, file.get(), 0});  // an empty range reads nothing
    EXPECT_EQ(read_ahead_all({}, 4), std::vector<uint64_t>{});
    const auto read = read_ahead_all(ranges, 4);
    ASSERT_EQ(read.size(), ranges.size());
    EXPECT_EQ(read[0], kSlice);
    EXPECT_EQ(read[1], kSlice);
    EXPECT_EQ(read[3], kSlice);
    EXPECT_EQ(read[2], kSlice);
    EXPECT_EQ(read[4], 0u) << "a slice asked for twice is read for its first range";
    EXPECT_EQ(read[5], 0u);
    for (const size_t e : {1, 3, 4, 6}) EXPECT_TRUE(all_cached(base + e * kSlice, kSlice)) << "slice " << e;
    for (const size_t e : {0, 7})
        EXPECT_FALSE(all_cached(base + e * kSlice, kSlice)) << "slice " << e << " was not asked for";
    EXPECT_EQ(read_ahead_all(ranges, 4), std::vector<uint64_t>(ranges.size(), 0)) << "cached now: nothing read";
    // No helper asked for (0 threads), 9 MiB to read: the caller reads it alone.
    std::vector<ReadRange> rest;
    for (const size_t e : {0, 2, 5}) rest.push_back(ReadRange{base + e * kSlice, kSlice, file.get(), e * kSlice});
    EXPECT_EQ(read_ahead_all(rest, 0), std::vector<uint64_t>(rest.size(), kSlice));
    munmap(map, kSlice * kSlices);
    close(fd);
}

}  // namespace
}  // namespace moecache::backend
