// Page-cache residency: cachestat and mincore agree, partial pages count by overlap (a range
// none or all of whose pages are cached is one look; some, three), a dropped file shows nothing
// resident and a read range shows up.
#include "temp_dir.h"

#include "moecache/page_cache.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

namespace moecache {
namespace {

constexpr uint64_t kPage = 4096;

std::string make_file(const test::TempDir& dir, uint64_t bytes) {
    const std::string path = dir.file("data.bin");
    test::write_file(path, std::string(bytes, 'x'));
    test::drop_page_cache(path);
    return path;
}

void read_range(const std::string& path, uint64_t off, uint64_t len) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY));
    ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM);  // no read-ahead beyond the range
    std::string buf(len, '\0');
    ASSERT_EQ(::pread(fd.get(), buf.data(), len, static_cast<off_t>(off)), static_cast<ssize_t>(len));
}

class PageCache : public testing::TestWithParam<PageCacheProbe::Method> {};

TEST_P(PageCache, CountsWhatWasReadAndNothingElse) {
    test::TempDir dir;
    const auto path = make_file(dir, 256 * kPage);
    auto probe = PageCacheProbe::open(path);
    ASSERT_TRUE(probe) << probe.error().what();
    if (GetParam() == PageCacheProbe::Method::Mincore) probe->force_mincore();
    else if (probe->method() != PageCacheProbe::Method::Cachestat)
        GTEST_SKIP() << "cachestat(2) is not available on this kernel (needs 6.5)";

    EXPECT_EQ(*probe->resident_bytes(0, 256 * kPage), 0u) << "the file should start cold";
    read_range(path, 100 * kPage, 8 * kPage);
    EXPECT_EQ(*probe->resident_bytes(100 * kPage, 8 * kPage), 8 * kPage);
    EXPECT_EQ(*probe->resident_bytes(0, 100 * kPage), 0u);
    EXPECT_EQ(*probe->resident_bytes(0, 256 * kPage), 8 * kPage);
    // Partial pages count by their overlap with the range.
    EXPECT_EQ(*probe->resident_bytes(100 * kPage - 10, 20), 10u);
    EXPECT_EQ(*probe->resident_bytes(108 * kPage - 10, 30), 10u);
    EXPECT_EQ(*probe->resident_bytes(101 * kPage + 5, 7), 7u);
    // Ranges over several pages, whose edges are not page edges: every page cached, none, some.
    EXPECT_EQ(*probe->resident_bytes(100 * kPage + 10, 7 * kPage), 7 * kPage);
    EXPECT_EQ(*probe->resident_bytes(20 * kPage + 10, 7 * kPage), 0u);
    EXPECT_EQ(*probe->resident_bytes(98 * kPage + 10, 4 * kPage), 2 * kPage + 10);
    EXPECT_EQ(*probe->resident_bytes(106 * kPage + 10, 4 * kPage), 2 * kPage - 10);
}

TEST_P(PageCache, RangePastTheEndIsAnError) {
    test::TempDir dir;
    const auto path = make_file(dir, 4 * kPage);
    auto probe = PageCacheProbe::open(path);
    ASSERT_TRUE(probe);
    if (GetParam() == PageCacheProbe::Method::Mincore) probe->force_mincore();
    auto r = probe->resident_bytes(3 * kPage, 2 * kPage);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("past the end"), std::string::npos);
    EXPECT_NE(r.error().message.find(path), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Methods, PageCache,
                         testing::Values(PageCacheProbe::Method::Cachestat, PageCacheProbe::Method::Mincore),
                         [](const auto& p) { return std::string(to_string(p.param)); });

}  // namespace
}  // namespace moecache
