// Dropping a range from the page cache on the real kernel, whose read-ahead builds large folios
// (ext4 and xfs, Linux 6.x): posix_fadvise alone leaves a folio that crosses either edge of the
// range, and with it part of the range; drop_file_pages takes such a folio whole, unless some
// process maps it.
#include "temp_dir.h"

#include "moecache/page_cache.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

namespace moecache {
namespace {

constexpr uint64_t kPage = 4096, kFile = 16 << 20;

class PageCacheDrop : public ::testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: frame numbers and page flags are root's";
        if (static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) != kPage) GTEST_SKIP() << "written for 4 KiB pages";
        path_ = dir_.file("data");
        {
            UniqueFd w(::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
            ASSERT_TRUE(w);
            std::vector<uint8_t> chunk(1 << 20);
            for (size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<uint8_t>(i * 131);
            for (uint64_t o = 0; o < kFile; o += chunk.size()) ASSERT_EQ(::write(w.get(), chunk.data(), chunk.size()), ssize_t(chunk.size()));
            ASSERT_EQ(::fsync(w.get()), 0);
        }
        fd_.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
        ASSERT_TRUE(fd_);
        ASSERT_EQ(::posix_fadvise(fd_.get(), 0, 0, POSIX_FADV_DONTNEED), 0);
        void* m = ::mmap(nullptr, kFile, PROT_READ, MAP_SHARED, fd_.get(), 0);
        ASSERT_NE(m, MAP_FAILED);
        map_ = static_cast<uint8_t*>(m);
        ASSERT_EQ(::madvise(map_, kFile, MADV_RANDOM), 0);
        // Read as a runtime reads a model it streams: sequentially, with read-ahead, on a
        // descriptor of its own.
        UniqueFd r(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
        std::vector<uint8_t> buf(128 << 10);
        for (uint64_t o = 0; o < kFile; o += buf.size()) ASSERT_EQ(::pread(r.get(), buf.data(), buf.size(), static_cast<off_t>(o)), ssize_t(buf.size()));
    }
    void TearDown() override {
        if (map_ != nullptr) ::munmap(map_, kFile);
    }
    uint64_t cached(uint64_t first, uint64_t n) {
        std::vector<unsigned char> v(n);
        if (::mincore(map_ + first * kPage, n * kPage, v.data()) != 0) return ~0ull;
        uint64_t c = 0;
        for (auto b : v) c += b & 1;
        return c;
    }
    // A range whose first and last page lie inside large folios, not at their edges.
    bool straddling_range(uint64_t& first, uint64_t& n) {
        for (uint64_t p = 256; p + 1024 < kFile / kPage; p += 64) {
            const auto a = folio_of(map_, kFile, p + 3);
            if (!a || a->pages < 8 || a->first == p + 3) continue;
            const auto b = folio_of(map_, kFile, p + 3 + 300);
            if (!b || b->pages < 8 || b->first + b->pages == p + 3 + 301) continue;
            first = p + 3;
            n = 301;
            return true;
        }
        return false;
    }

    test::TempDir dir_;
    std::string path_;
    UniqueFd fd_;
    uint8_t* map_ = nullptr;
};

TEST_F(PageCacheDrop, FoliosAcrossTheEdgesLeaveWithTheRange) {
    uint64_t first = 0, n = 0;
    if (!straddling_range(first, n)) GTEST_SKIP() << "this kernel's read-ahead built no large folios here (file system without them)";
    const auto head = *folio_of(map_, kFile, first);
    // fadvise alone: the folios across the edges stay, and the pages of the range in them.
    ASSERT_EQ(::posix_fadvise(fd_.get(), static_cast<off_t>(first * kPage), static_cast<off_t>(n * kPage), POSIX_FADV_DONTNEED), 0);
    EXPECT_GT(cached(first, n), 0u) << "fadvise dropped folios across the range's edges: nothing left to show";
    EXPECT_EQ(drop_file_pages(fd_.get(), map_, kFile, first, n), 2u);
    EXPECT_EQ(cached(first, n), 0u);
    // The neighbour's pages in the head folio went with it; pages beyond the folios did not.
    EXPECT_EQ(cached(head.first, first - head.first), 0u);
    EXPECT_EQ(cached(head.first - 1, 1), 1u);
    // The bytes read back are the file's (nothing was written).
    EXPECT_EQ(map_[first * kPage + 5], static_cast<uint8_t>(((first * kPage + 5) % (1 << 20)) * 131));
}

TEST_F(PageCacheDrop, AFolioSomeoneMapsStays) {
    uint64_t first = 0, n = 0;
    if (!straddling_range(first, n)) GTEST_SKIP() << "this kernel's read-ahead built no large folios here (file system without them)";
    const auto head = *folio_of(map_, kFile, first);
    // Another mapping (a runtime's) uses the neighbour's page in the head folio.
    void* other = ::mmap(nullptr, kFile, PROT_READ, MAP_SHARED, fd_.get(), 0);
    ASSERT_NE(other, MAP_FAILED);
    volatile uint8_t touch = static_cast<uint8_t*>(other)[head.first * kPage];
    (void)touch;
    drop_file_pages(fd_.get(), map_, kFile, first, n);
    EXPECT_EQ(cached(first, head.first + head.pages - first), head.first + head.pages - first) << "the mapped folio stays whole";
    EXPECT_LT(cached(first, n), n) << "the rest of the range left";
    ::munmap(other, kFile);
}

}  // namespace
}  // namespace moecache
