// The page-cache programs on the real kernel, through their loader: reads of a watched file from
// a cold cache show up as added pages, fadvise(DONTNEED) as deleted pages, page faults as faults;
// an unwatched file shows nothing; a ring too small for a flood counts drops and never blocks.
#include "temp_dir.h"

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/page_cache.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <thread>
#include <set>
#include <string>
#include <vector>

namespace moecache::bpf {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kMiB = 1u << 20;

std::string make_file(const test::TempDir& dir, const std::string& name, uint64_t bytes) {
    const std::string path = dir.file(name);
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
    std::string chunk(kMiB, '\0');
    for (uint64_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 131 + 7);
    for (uint64_t off = 0; off < bytes; off += chunk.size())
        EXPECT_EQ(::write(fd.get(), chunk.data(), std::min<uint64_t>(chunk.size(), bytes - off)),
                  static_cast<ssize_t>(std::min<uint64_t>(chunk.size(), bytes - off)));
    fd.reset();
    test::drop_page_cache(path);
    return path;
}

void read_all(const std::string& path, bool random = false, uint64_t chunk = kMiB) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd);
    if (random) ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM);
    std::vector<char> buf(chunk);
    while (::read(fd.get(), buf.data(), buf.size()) > 0) {}
}

struct Collected {
    std::vector<PageCacheEvent> events;
    // Pages of file `id` covered by events of `kind`.
    [[nodiscard]] std::set<uint64_t> pages(uint32_t id, PageCacheEventKind kind) const {
        std::set<uint64_t> out;
        for (const auto& e : events)
            if (e.file_id == id && e.kind == kind)
                for (uint64_t p = e.first_page; p < e.first_page + e.pages; ++p) out.insert(p);
        return out;
    }
    [[nodiscard]] size_t count_other(uint32_t id) const {
        return static_cast<size_t>(std::count_if(events.begin(), events.end(), [&](const auto& e) { return e.file_id != id; }));
    }
};

class PageCacheTelemetryTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "loading BPF programs needs root";
        const auto f = probe_page_cache_features();
        if (!f.btf || !f.add_delete) GTEST_SKIP() << "this kernel cannot run them: " << f.missing;
        struct statfs sf {};
        ASSERT_EQ(::statfs(dir_.path().c_str(), &sf), 0);
        if (sf.f_type == TMPFS_MAGIC)
            GTEST_SKIP() << dir_.path() << " is on tmpfs, whose pages never come from storage: set TMPDIR to a disk";
    }

    PageCacheTelemetry open(uint32_t ring_bytes = 4u << 20) {
        PageCacheTelemetry::Options o;
        o.ring_bytes = ring_bytes;
        auto t = PageCacheTelemetry::open(o, [this](const PageCacheEvent& e) { got_.events.push_back(e); });
        if (!t) ADD_FAILURE() << t.error().what();
        return std::move(*t);
    }

    void watch(PageCacheTelemetry& t, const std::string& path, uint32_t id) {
        struct stat st {};
        ASSERT_EQ(::stat(path.c_str(), &st), 0);
        auto r = t.watch(st.st_dev, st.st_ino, id);
        ASSERT_TRUE(r) << r.error().what();
    }

    test::TempDir dir_;
    Collected got_;
};

TEST_F(PageCacheTelemetryTest, ReadsFromStorageOfAWatchedFileAreReportedAndNothingElse) {
    const std::string a = make_file(dir_, "a.bin", 8 * kMiB);
    const std::string b = make_file(dir_, "b.bin", 8 * kMiB);
    auto t = open();
    watch(t, a, 7);
    read_all(a);
    read_all(b);
    t.consume();
    const auto added = got_.pages(7, PageCacheEventKind::Added);
    EXPECT_EQ(added.size(), 8 * kMiB / kPage) << "every page of the watched file was read from storage once";
    EXPECT_EQ(*added.begin(), 0u);
    EXPECT_EQ(*added.rbegin(), 8 * kMiB / kPage - 1);
    EXPECT_EQ(got_.count_other(7), 0u) << "the unwatched file produced events";
    for (const auto& e : got_.events) EXPECT_EQ(e.tgid, static_cast<uint32_t>(::getpid()));

    // Read again while cached: nothing is added but what reclaim took meanwhile (DAMON's
    // proactive pageout runs on these machines), which was reported deleted first.
    const auto deleted_before = got_.pages(7, PageCacheEventKind::Deleted);
    got_.events.clear();
    read_all(a);
    t.consume();
    const auto deleted = got_.pages(7, PageCacheEventKind::Deleted);
    for (uint64_t p : got_.pages(7, PageCacheEventKind::Added))
        EXPECT_TRUE(deleted.count(p) || deleted_before.count(p)) << "page " << p << " read again while cached";
}

TEST_F(PageCacheTelemetryTest, DroppedRangesAreReportedAsDeletedPages) {
    const std::string a = make_file(dir_, "a.bin", 4 * kMiB);
    auto t = open();
    watch(t, a, 3);
    // Read while watched: a page that proactive reclaim (DAMON's pageout, kdamond, runs on these
    // machines) takes before the drop is then reported deleted by it instead, never lost unseen.
    read_all(a);
    UniqueFd fd(::open(a.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_EQ(::posix_fadvise(fd.get(), 1 * kMiB, 1 * kMiB, POSIX_FADV_DONTNEED), 0);
    t.consume();
    const auto deleted = got_.pages(3, PageCacheEventKind::Deleted);
    std::set<uint64_t> in_range, outside;
    for (uint64_t p : deleted) (p >= kMiB / kPage && p < 2 * kMiB / kPage ? in_range : outside).insert(p);
    EXPECT_EQ(in_range.size(), kMiB / kPage) << "every page of the dropped range reported";
    // Reclaim may take other pages of the file meanwhile: each reported one is gone indeed.
    auto probe = PageCacheProbe::of(fd.get(), a);
    ASSERT_TRUE(probe) << probe.error().what();
    for (uint64_t p : outside)
        EXPECT_EQ(probe->resident_bytes(p * kPage, kPage).value_or(1), 0u) << "page " << p << " reported deleted but still cached";
    EXPECT_LT(outside.size(), kMiB / kPage / 4) << "more went than reclaim takes in a moment";
}

TEST_F(PageCacheTelemetryTest, UnwatchedFilesStopReporting) {
    const std::string a = make_file(dir_, "a.bin", 2 * kMiB);
    auto t = open();
    watch(t, a, 1);
    struct stat st {};
    ASSERT_EQ(::stat(a.c_str(), &st), 0);
    ASSERT_TRUE(t.unwatch(st.st_dev, st.st_ino));
    read_all(a);
    t.consume();
    EXPECT_TRUE(got_.events.empty());
}

TEST_F(PageCacheTelemetryTest, PageFaultsOnAMappingAreReported) {
    auto t = open();
    if (!t.faults_attached()) GTEST_SKIP() << "this kernel has no filemap fault tracepoints (Linux 6.11 or later)";
    const std::string a = make_file(dir_, "a.bin", 4 * kMiB);
    read_all(a);  // cached: faults are then minor and served by fault-around (Mapped)
    watch(t, a, 9);
    UniqueFd fd(::open(a.c_str(), O_RDONLY | O_CLOEXEC));
    void* m = ::mmap(nullptr, 4 * kMiB, PROT_READ, MAP_SHARED, fd.get(), 0);
    ASSERT_NE(m, MAP_FAILED);
    volatile const char* p = static_cast<const char*>(m);
    (void)p[2 * kMiB + 5 * kPage];
    t.consume();
    std::set<uint64_t> seen = got_.pages(9, PageCacheEventKind::Mapped);
    for (uint64_t pg : got_.pages(9, PageCacheEventKind::Fault)) seen.insert(pg);
    EXPECT_EQ(seen.count(2 * kMiB / kPage + 5), 1u) << "the faulting page is in a reported range";
    EXPECT_LE(seen.size(), 512u) << "a fault reports its window, not the file";

    // The same page again, unmapped by MADV_DONTNEED (the client's re-arm): it faults again.
    got_.events.clear();
    ASSERT_EQ(::madvise(static_cast<char*>(m) + 2 * kMiB + 5 * kPage, kPage, MADV_DONTNEED), 0);
    (void)p[2 * kMiB + 5 * kPage];
    t.consume();
    seen = got_.pages(9, PageCacheEventKind::Mapped);
    for (uint64_t pg : got_.pages(9, PageCacheEventKind::Fault)) seen.insert(pg);
    EXPECT_EQ(seen.count(2 * kMiB / kPage + 5), 1u) << "a re-armed page faults again";
    ::munmap(m, 4 * kMiB);
}

TEST_F(PageCacheTelemetryTest, AFloodBeyondTheRingIsCountedAsDropsAndNeverBlocks) {
    const std::string a = make_file(dir_, "a.bin", 32 * kMiB);
    auto t = open(4096);  // room for some 128 records
    watch(t, a, 5);
    const auto start = std::chrono::steady_clock::now();
    read_all(a, /*random=*/true, kPage);  // one page per read: one event per page
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto c = t.counters();
    const size_t consumed = t.consume();
    EXPECT_GT(c.dropped[0], 0u) << "the ring overflowed without counting drops";
    EXPECT_EQ(consumed, c.total_sent()) << "every record the kernel sent is read back";
    EXPECT_EQ(c.sent[0] + c.dropped[0], 32 * kMiB / kPage) << "each page was either sent or counted as dropped";
    EXPECT_LT(seconds, 60.0);
    // And the ring works again once drained.
    got_.events.clear();
    test::drop_page_cache(a);
    read_all(a, /*random=*/true, 64 * kPage);
    EXPECT_GT(t.consume(), 0u);
}

// Runs `act` while another thread waits on `fd` (poll, up to 400 ms); returns whether that wait
// was woken within 200 ms of the act. A ring with data in it polls readable to a fresh caller at
// once, whether or not its writer woke anybody: only a waiter that is already asleep tells a
// wakeup from none (it sleeps out its timeout).
bool woken_by(int fd, const std::function<void()>& act) {
    std::atomic<bool> waiting{false};
    auto waiter = std::async(std::launch::async, [&] {
        pollfd p{fd, POLLIN, 0};
        waiting = true;
        (void)::poll(&p, 1, 400);
        return std::chrono::steady_clock::now();
    });
    while (!waiting) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // asleep in poll by now
    const auto at = std::chrono::steady_clock::now();
    act();
    return waiter.get() - at < std::chrono::milliseconds(200);
}

// Reads one page of `path` in a child process: a runtime's miss, as the daemon sees it.
void read_one_page_elsewhere(const std::string& path, uint64_t page) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        char b[kPage];
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
        ::_exit(fd >= 0 && ::pread(fd, b, sizeof b, static_cast<off_t>(page * kPage)) == sizeof b ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST_F(PageCacheTelemetryTest, AMissByAnotherProcessWakesTheReaderAtOnceAndOnlyThat) {
    const std::string a = make_file(dir_, "a.bin", 4 * kMiB);
    for (const uint32_t gap_us : {1000u, 0u}) {
        SCOPED_TRACE(gap_us);
        test::drop_page_cache(a);
        PageCacheTelemetry::Options o;
        o.ignore_tgid = ::getpid();  // this process plays the daemon
        o.miss_wakeup_us = gap_us;
        got_.events.clear();
        auto t = PageCacheTelemetry::open(o, [this](const PageCacheEvent& e) { got_.events.push_back(e); });
        ASSERT_TRUE(t) << t.error().what();
        watch(*t, a, 5);
        // The daemon's own read (a prefetch) is reported but wakes nobody: one record is far
        // below a quarter of the ring.
        EXPECT_FALSE(woken_by(t->event_fd(), [&] {
            UniqueFd fd(::open(a.c_str(), O_RDONLY | O_CLOEXEC));
            ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM);
            char b[kPage];
            EXPECT_EQ(::pread(fd.get(), b, sizeof b, 0), static_cast<ssize_t>(sizeof b));
        }));
        t->consume();
        EXPECT_EQ(got_.pages(5, PageCacheEventKind::Added).count(0), 1u);
        // Another process's read wakes the reader where misses wake; either way it is reported.
        got_.events.clear();
        EXPECT_EQ(woken_by(t->event_fd(), [&] { read_one_page_elsewhere(a, 100); }), gap_us != 0);
        t->consume();
        EXPECT_EQ(got_.pages(5, PageCacheEventKind::Added).count(100), 1u);
    }
}

TEST_F(PageCacheTelemetryTest, ABadRingSizeIsRefusedWithAReason) {
    auto t = PageCacheTelemetry::open({.ring_bytes = 12345}, [](const PageCacheEvent&) {});
    ASSERT_FALSE(t);
    EXPECT_NE(t.error().what().find("power of two"), std::string::npos) << t.error().what();
}

}  // namespace
}  // namespace moecache::bpf
