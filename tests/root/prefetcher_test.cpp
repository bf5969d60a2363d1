// The prefetcher against the real kernel: files are dropped from the page cache, ranges are
// prefetched through io_uring, and residency is checked with cachestat/mincore. Readahead is kept
// out of the picture with POSIX_FADV_RANDOM on the descriptors, so "resident" must be exactly the
// pages of the ranges asked for.
#include "model_fixture.h"
#include "seccomp.h"
#include "slow_fs.h"
#include "temp_dir.h"

#include "moecache/daemon/prefetcher.h"
#include "moecache/model.h"
#include "moecache/page_cache.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <liburing.h>
#include <numaif.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ostream>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace moecache::daemon {
namespace {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kMiB = 1u << 20;

struct Done {
    uint64_t id, tag, bytes;
    int err;
};

// Records every callback, in order.
struct Recorder {
    std::vector<Done> done;
    void attach(Prefetcher& p) {
        p.set_callback([this](uint64_t id, uint64_t tag, uint64_t bytes, int err) {
            done.push_back({id, tag, bytes, err});
        });
    }
    [[nodiscard]] const Done* find(uint64_t id) const {
        for (const auto& d : done)
            if (d.id == id) return &d;
        return nullptr;
    }
    [[nodiscard]] std::vector<uint64_t> order() const {
        std::vector<uint64_t> ids;
        for (const auto& d : done) ids.push_back(d.id);
        return ids;
    }
};

// A file of `bytes` written through write(2) (real blocks, not holes), then dropped.
std::string make_cold_file(const test::TempDir& dir, const std::string& name, uint64_t bytes) {
    const std::string path = dir.file(name);
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
    std::string chunk(kMiB, '\0');
    for (uint64_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<char>(i * 131 + 7);
    for (uint64_t off = 0; off < bytes; off += chunk.size()) {
        const uint64_t n = std::min<uint64_t>(chunk.size(), bytes - off);
        EXPECT_EQ(::write(fd.get(), chunk.data(), n), static_cast<ssize_t>(n));
    }
    fd.reset();
    test::drop_page_cache(path);
    return path;
}

// An fd whose reads bring in exactly the pages asked for.
UniqueFd open_random(const std::string& path) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_TRUE(fd) << path;
    EXPECT_EQ(::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM), 0);
    return fd;
}

uint64_t resident(const std::string& path, uint64_t offset, uint64_t length) {
    auto probe = PageCacheProbe::open(path);
    EXPECT_TRUE(probe) << probe.error().what();
    if (!probe) return 0;
    auto r = probe->resident_bytes(offset, length);
    EXPECT_TRUE(r) << r.error().what();
    return r ? *r : 0;
}

// Bytes of the whole pages that cover a set of ranges of a file of `size` bytes.
uint64_t page_cover(const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t size) {
    std::set<uint64_t> pages;
    for (const auto& [off, len] : ranges)
        for (uint64_t p = off / kPage; p * kPage < off + len; ++p) pages.insert(p);
    uint64_t bytes = 0;
    for (const uint64_t p : pages) bytes += std::min(kPage, size - p * kPage);
    return bytes;
}

bool kernel_at_least(int major, int minor) {
    utsname u{};
    if (::uname(&u) != 0) return false;
    int ma = 0, mi = 0;
    if (std::sscanf(u.release, "%d.%d", &ma, &mi) != 2) return false;
    return ma > major || (ma == major && mi >= minor);
}

class PrefetcherTest : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root (the root test label): run as root";
        auto p = Prefetcher::create({.engine = engine_, .queue_depth = 1});
        if (!p) GTEST_SKIP() << "io_uring is not usable here: " << p.error().what();
        // The residency checks need a file system whose pages can be dropped (not tmpfs).
        const auto probe_file = make_cold_file(dir, "probe.bin", 4 * kPage);
        { std::string buf(4 * kPage, '\0'); UniqueFd fd(::open(probe_file.c_str(), O_RDONLY));
          ASSERT_EQ(::pread(fd.get(), buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size())); }
        test::drop_page_cache(probe_file);
        if (resident(probe_file, 0, 4 * kPage) != 0)
            GTEST_SKIP() << "POSIX_FADV_DONTNEED does not drop pages under " << dir.path()
                         << " (tmpfs?); set TMPDIR to a disk file system";
    }

    // With this fixture's engine (io_uring unless a test says otherwise).
    Prefetcher make(Prefetcher::Options o, Recorder& rec) const {
        o.engine = engine_;
        auto p = Prefetcher::create(o);
        EXPECT_TRUE(p) << p.error().what();
        rec.attach(*p);
        return std::move(*p);
    }

    test::TempDir dir;
    Prefetcher::Engine engine_ = Prefetcher::Engine::IoUring;
};

// What holds for whichever engine reads: io_uring, or the threads that pread where it is denied.
class PrefetcherEngines : public PrefetcherTest, public testing::WithParamInterface<Prefetcher::Engine> {
protected:
    void SetUp() override {
        engine_ = GetParam();
        PrefetcherTest::SetUp();
    }
};
std::string engine_name(const testing::TestParamInfo<Prefetcher::Engine>& e) {
    return e.param == Prefetcher::Engine::Threads ? "Threads" : "IoUring";
}

// The core promise, under every ring and buffer set-up the fallbacks can land in.
struct Variant {
    bool defer_taskrun, register_buffers;
    bool threads = false;  // the pread engine (the ring's flags do not apply)
};
void PrintTo(const Variant& v, std::ostream* os) {
    if (v.threads) {
        *os << "pread threads";
        return;
    }
    *os << (v.defer_taskrun ? "DEFER_TASKRUN" : "COOP_TASKRUN") << ", "
        << (v.register_buffers ? "fixed buffers" : "plain buffers");
}
class PrefetcherVariants : public PrefetcherTest, public testing::WithParamInterface<Variant> {};

TEST_P(PrefetcherVariants, ExactlyTheRequestedRangesBecomeResident) {
    const auto path = make_cold_file(dir, "data.bin", 64 * kMiB);
    ASSERT_EQ(resident(path, 0, 64 * kMiB), 0u) << "the file should start cold";
    Recorder rec;
    if (GetParam().threads) engine_ = Prefetcher::Engine::Threads;
    auto p = make({.queue_depth = 8, .read_size = 256 * 1024, .register_buffers = GetParam().register_buffers,
                   .defer_taskrun = GetParam().defer_taskrun},
                  rec);
    EXPECT_EQ(p.setup().engine, engine_);
    EXPECT_EQ(p.setup().registered_buffers, GetParam().register_buffers && !GetParam().threads);  // root: no memlock limit
    EXPECT_EQ((p.setup().ring_flags & IORING_SETUP_DEFER_TASKRUN) != 0,
              GetParam().defer_taskrun && !GetParam().threads && kernel_at_least(6, 1));
    auto fd = open_random(path);
    // Unaligned starts and ends, one range inside a page, one spanning many reads.
    const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
        {100, 5000}, {3 * kMiB + 17, 2 * kMiB + 3}, {20 * kMiB, 7 * kMiB}, {40 * kMiB + 10, 20}};
    std::vector<uint64_t> ids;
    for (const auto& [off, len] : ranges) ids.push_back(p.enqueue({fd.get(), off, len, 0, off}));
    ASSERT_TRUE(p.run_until_idle());

    ASSERT_EQ(rec.done.size(), ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
        const Done* d = rec.find(ids[i]);
        ASSERT_NE(d, nullptr);
        EXPECT_EQ(d->err, 0);
        EXPECT_EQ(d->bytes, ranges[i].second);
        EXPECT_EQ(d->tag, ranges[i].first);
        // All of it, but for what proactive reclaim may take back at once: these machines run DAMON
        // pageout on physical memory, whose coarse regions can include pages just read.
        EXPECT_GE(resident(path, ranges[i].first, ranges[i].second), ranges[i].second * 97 / 100) << "range " << i;
    }
    // Nothing outside the ranges (no read-ahead), and again all but what reclaim took.
    const uint64_t cover = page_cover(ranges, 64 * kMiB), all = resident(path, 0, 64 * kMiB);
    EXPECT_LE(all, cover) << "pages outside the ranges";
    EXPECT_GE(all, cover * 97 / 100);
}

INSTANTIATE_TEST_SUITE_P(Setups, PrefetcherVariants,
                         testing::Values(Variant{true, true}, Variant{true, false}, Variant{false, true},
                                         Variant{false, false}, Variant{false, false, true}),
                         [](const testing::TestParamInfo<Variant>& v) {
                             if (v.param.threads) return std::string("Threads");
                             return std::string(v.param.defer_taskrun ? "Defer" : "Coop") +
                                    (v.param.register_buffers ? "Fixed" : "Plain");
                         });

// The daemon's way: the eventfd in an epoll set, on_ready() when it is readable. With
// DEFER_TASKRUN the kernel only signals that work is waiting; with COOP_TASKRUN, that CQEs are there.
// The pread engine's threads signal the same eventfd.
enum class Loop { Coop, Defer, Threads };
class EpollLoop : public PrefetcherTest, public testing::WithParamInterface<Loop> {
protected:
    void SetUp() override {
        if (GetParam() == Loop::Threads) engine_ = Prefetcher::Engine::Threads;
        PrefetcherTest::SetUp();
    }
    static bool defer() { return GetParam() == Loop::Defer; }
};

TEST_P(EpollLoop, ExpertsOfASplitModel) {
    auto spec = test::small_spec();
    const auto files = test::write_model(spec, dir.file("m.gguf"), 2);
    ASSERT_EQ(files.size(), 2u);
    auto map = load_expert_map(files[0]);
    ASSERT_TRUE(map) << map.error().what();
    for (const auto& f : files) test::drop_page_cache(f);  // after reading the headers
    std::vector<UniqueFd> fds;
    for (const auto& f : map->files) fds.push_back(open_random(f.path));

    // Two experts of every layer (the layers live in both files), each its own tag.
    Recorder rec;
    auto p = make({.queue_depth = 16, .read_size = 64 * 1024, .defer_taskrun = defer()}, rec);
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> want(map->files.size());
    uint64_t total = 0;
    for (const auto& layer : map->layers) {
        for (const uint32_t e : {1u, 9u}) {
            for (const ByteRange& r : map->ranges(layer.index, e)) {
                p.enqueue({fds[r.file].get(), r.offset, r.length, 0, uint64_t{layer.index} << 32 | e});
                want[r.file].push_back({r.offset, r.length});
                total += r.length;
            }
        }
    }
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    epoll_event ev{.events = EPOLLIN, .data = {.u64 = 0}};
    ASSERT_EQ(::epoll_ctl(ep.get(), EPOLL_CTL_ADD, p.event_fd(), &ev), 0);
    ASSERT_TRUE(p.submit());
    int wakeups = 0;
    while (!p.idle()) {
        // Without DEFER_TASKRUN the completions' task work interrupts epoll_wait (EINTR), as a
        // signal would; any event loop retries.
        int n = 0;
        do n = ::epoll_wait(ep.get(), &ev, 1, 10000);
        while (n < 0 && errno == EINTR);
        ASSERT_EQ(n, 1) << "the eventfd never became readable with reads in flight";
        ASSERT_TRUE(p.on_ready());
        ++wakeups;
    }
    EXPECT_GT(wakeups, 0);
    EXPECT_EQ(p.progress().done_bytes, total);
    EXPECT_EQ(p.progress().requests_done, rec.done.size());
    for (size_t f = 0; f < map->files.size(); ++f) {
        const auto& path = map->files[f].path;
        for (const auto& [off, len] : want[f]) EXPECT_EQ(resident(path, off, len), len) << path << " @" << off;
        EXPECT_EQ(resident(path, 0, map->files[f].size), page_cover(want[f], map->files[f].size))
            << path << ": pages outside the experts asked for";
    }
}

// Since 6.13 one io_uring_enter runs at most 20 deferred completions a pass; on_ready() goes on
// while IORING_SQ_TASKRUN says some are left, so one call takes a whole burst.
TEST_P(EpollLoop, OneWakeupTakesAWholeBurst) {
    const auto path = make_cold_file(dir, "data.bin", 8 * kMiB);
    auto fd = open_random(path);
    Recorder rec;
    auto p = make({.queue_depth = 256, .read_size = 4096, .defer_taskrun = defer()}, rec);
    // Every other page: 256 separate reads, all in flight at once.
    for (uint64_t i = 0; i < 256; ++i) p.enqueue({fd.get(), 2 * i * kPage, kPage, 0, i});
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    epoll_event ev{.events = EPOLLIN, .data = {.u64 = 0}};
    ASSERT_EQ(::epoll_ctl(ep.get(), EPOLL_CTL_ADD, p.event_fd(), &ev), 0);
    ASSERT_TRUE(p.submit());
    // Every read done before the loop wakes: each page in the page cache (a busy machine's disk can
    // take more than a second for 256 random reads), or 20 s at most (proactive reclaim may take a
    // page back at once), and a little more for the completions to be posted.
    auto all_read = [&] {
        for (uint64_t i = 0; i < 256; ++i)
            if (resident(path, 2 * i * kPage, kPage) != kPage) return false;
        return true;
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!all_read() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    int n = 0;
    do n = ::epoll_wait(ep.get(), &ev, 1, 5000);
    while (n < 0 && errno == EINTR);
    ASSERT_EQ(n, 1) << "no wakeup for 256 completed reads";
    ASSERT_TRUE(p.on_ready());
    EXPECT_TRUE(p.idle()) << p.progress().inflight_bytes / kPage << " reads left for later wakeups";
    EXPECT_EQ(rec.done.size(), 256u);
    EXPECT_EQ(p.progress().done_bytes, 256 * kPage);
}

INSTANTIATE_TEST_SUITE_P(Taskrun, EpollLoop, testing::Values(Loop::Coop, Loop::Defer, Loop::Threads),
                         [](const testing::TestParamInfo<Loop>& v) {
                             return v.param == Loop::Defer ? "Defer" : v.param == Loop::Threads ? "Threads" : "Coop";
                         });

TEST_P(PrefetcherEngines, PriorityOrderWithOneReadInFlight) {
    const auto path = make_cold_file(dir, "data.bin", 16 * kMiB);
    auto fd = open_random(path);
    Recorder rec;
    auto p = make({.queue_depth = 1, .read_size = 1 * kMiB}, rec);
    auto req = [&](uint64_t mib, int32_t prio) { return p.enqueue({fd.get(), mib * kMiB, kMiB, prio, mib}); };
    const uint64_t a = req(0, 5), b = req(1, 1), c = req(2, 3), d = req(3, 1), e = req(4, 0);
    ASSERT_TRUE(p.run_until_idle());
    EXPECT_EQ(rec.order(), (std::vector<uint64_t>{e, b, d, c, a})) << "lower priority first, FIFO within one";

    // A request that arrives while others wait overtakes those of lower priority.
    rec.done.clear();
    const uint64_t l1 = req(5, 7), l2 = req(6, 7), l3 = req(7, 7);
    ASSERT_TRUE(p.submit());  // l1 is in flight now
    const uint64_t h = req(8, -1);
    ASSERT_TRUE(p.run_until_idle());
    EXPECT_EQ(rec.order(), (std::vector<uint64_t>{l1, h, l2, l3}));
}

TEST_P(PrefetcherEngines, CancelDropsQueuedAndInFlightReads) {
    const auto path = make_cold_file(dir, "data.bin", 32 * kMiB);
    auto fd = open_random(path);
    Recorder rec;
    auto p = make({.queue_depth = 1, .read_size = 64 * 1024}, rec);
    const uint64_t a = p.enqueue({fd.get(), 0, 8 * kMiB, 0, 1});
    const uint64_t b = p.enqueue({fd.get(), 8 * kMiB, 8 * kMiB, 0, 2});
    const uint64_t c = p.enqueue({fd.get(), 16 * kMiB, 8 * kMiB, 0, 3});
    ASSERT_TRUE(p.submit());  // a's first read is in flight
    EXPECT_EQ(p.cancel(1), 1u);
    EXPECT_EQ(p.cancel(3), 1u);  // c never started
    EXPECT_EQ(p.cancel(3), 0u) << "already cancelled";
    EXPECT_EQ(p.cancel(42), 0u) << "no such tag";
    EXPECT_TRUE(rec.done.empty()) << "callbacks never run inside cancel()";
    ASSERT_TRUE(p.run_until_idle());

    ASSERT_EQ(rec.done.size(), 3u);
    EXPECT_EQ(rec.find(a)->err, ECANCELED);
    EXPECT_EQ(rec.find(a)->bytes, 0u) << "the in-flight read's result is ignored";
    EXPECT_EQ(rec.find(c)->err, ECANCELED);
    EXPECT_EQ(rec.find(c)->bytes, 0u);
    EXPECT_EQ(rec.find(b)->err, 0);
    EXPECT_EQ(rec.find(b)->bytes, 8 * kMiB);
    EXPECT_LE(resident(path, 0, 8 * kMiB), 64u * 1024) << "at most the read that was in flight";
    EXPECT_EQ(resident(path, 8 * kMiB, 8 * kMiB), 8 * kMiB);
    EXPECT_EQ(resident(path, 16 * kMiB, 8 * kMiB), 0u);
    const auto pr = p.progress();
    EXPECT_EQ(pr.requests_cancelled, 2u);
    EXPECT_EQ(pr.requests_done, 1u);
    EXPECT_EQ(pr.done_bytes, 8 * kMiB);
    EXPECT_EQ(pr.queued_bytes + pr.inflight_bytes, 0u);
}

TEST_P(PrefetcherEngines, TruncatedFileEndsTheRequestShortWithoutError) {
    const auto path = make_cold_file(dir, "data.bin", 16 * kMiB);
    auto fd = open_random(path);
    Recorder rec;
    auto p = make({.queue_depth = 2, .read_size = 1 * kMiB}, rec);
    const uint64_t whole = p.enqueue({fd.get(), 0, 16 * kMiB, 0, 1});
    const uint64_t beyond = p.enqueue({fd.get(), 10 * kMiB, kMiB, 0, 2});
    ASSERT_TRUE(p.submit());  // [0, 1) and [1, 2) MiB in flight, below the new end
    const uint64_t new_size = 5 * kMiB + 100;
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(new_size)), 0);
    ASSERT_TRUE(p.run_until_idle());

    ASSERT_EQ(rec.done.size(), 2u);
    EXPECT_EQ(rec.find(whole)->err, 0);
    EXPECT_EQ(rec.find(whole)->bytes, new_size) << "the bytes that were there";
    EXPECT_EQ(rec.find(beyond)->err, 0);
    EXPECT_EQ(rec.find(beyond)->bytes, 0u);
    const auto pr = p.progress();
    EXPECT_EQ(pr.requests_done, 2u);
    EXPECT_EQ(pr.requests_failed, 0u);
    EXPECT_GE(pr.short_reads, 1u) << "[5 MiB, 6 MiB) returns 100 bytes, then the rest hits EOF";
    EXPECT_EQ(pr.done_bytes, new_size);
    EXPECT_EQ(pr.queued_bytes + pr.inflight_bytes, 0u);
    EXPECT_EQ(resident(path, 0, new_size), new_size);
}

TEST_P(PrefetcherEngines, ProgressAddsUp) {
    const auto a = make_cold_file(dir, "a.bin", 8 * kMiB);
    const auto b = make_cold_file(dir, "b.bin", 8 * kMiB);
    auto fa = open_random(a), fb = open_random(b);
    Recorder rec;
    auto p = make({.queue_depth = 4, .read_size = 1 * kMiB}, rec);
    // Split points after the first read are page aligned: 100 + 3 MiB is 4 reads, not 3.
    const std::vector<PrefetchRequest> reqs = {
        {fa.get(), 100, 3 * kMiB, 2, 1}, {fb.get(), 0, 4 * kMiB, 1, 2}, {fa.get(), 5 * kMiB, 5000, 0, 3}};
    const uint64_t total = 3 * kMiB + 4 * kMiB + 5000;
    for (const auto& r : reqs) p.enqueue(r);
    EXPECT_EQ(p.progress().queued_bytes, total);
    EXPECT_FALSE(p.idle());
    ASSERT_TRUE(p.submit());
    auto pr = p.progress();
    EXPECT_EQ(pr.queued_bytes + pr.inflight_bytes + pr.done_bytes, total);
    EXPECT_GT(pr.inflight_bytes, 0u);
    EXPECT_LE(pr.inflight_bytes, 4 * kMiB) << "never more than queue_depth reads";
    ASSERT_TRUE(p.run_until_idle());
    EXPECT_TRUE(p.idle());

    pr = p.progress();
    uint64_t reported = 0;
    for (const auto& d : rec.done) reported += d.bytes;
    EXPECT_EQ(pr.queued_bytes, 0u);
    EXPECT_EQ(pr.inflight_bytes, 0u);
    EXPECT_EQ(pr.done_bytes, total);
    EXPECT_EQ(reported, total);
    EXPECT_EQ(pr.requests_done, 3u);
    EXPECT_EQ(pr.requests_failed + pr.requests_cancelled, 0u);
    EXPECT_EQ(pr.reads_submitted, 4u + 4u + 1u + pr.short_reads + pr.retries);
}

TEST_P(PrefetcherEngines, BadRequestsFailThroughTheirCallbacks) {
    const auto path = make_cold_file(dir, "data.bin", 1 * kMiB);
    auto fd = open_random(path);
    UniqueFd dirfd(::open(dir.path().c_str(), O_RDONLY | O_DIRECTORY));
    int closed_number = 4000;  // an fd number nothing has open
    while (::fcntl(closed_number, F_GETFD) != -1) ++closed_number;
    Recorder rec;
    auto p = make({.queue_depth = 4}, rec);
    const uint64_t negative = p.enqueue({-1, 0, kPage, 0, 1});
    const uint64_t not_open = p.enqueue({closed_number, 0, kPage, 0, 2});
    const uint64_t directory = p.enqueue({dirfd.get(), 0, kPage, 0, 3});
    const uint64_t overflow = p.enqueue({fd.get(), ~uint64_t{0} - 10, 100, 0, 4});
    const uint64_t empty = p.enqueue({fd.get(), 0, 0, 0, 5});
    const uint64_t good = p.enqueue({fd.get(), 0, kMiB, 0, 6});
    EXPECT_TRUE(rec.done.empty()) << "callbacks never run inside enqueue()";
    ASSERT_TRUE(p.run_until_idle());
    ASSERT_EQ(rec.done.size(), 6u);
    EXPECT_EQ(rec.find(negative)->err, EBADF);
    EXPECT_EQ(rec.find(not_open)->err, EBADF);
    EXPECT_EQ(rec.find(directory)->err, EISDIR);
    EXPECT_EQ(rec.find(overflow)->err, EINVAL);
    EXPECT_EQ(rec.find(empty)->err, 0);
    EXPECT_EQ(rec.find(good)->err, 0);
    EXPECT_EQ(rec.find(good)->bytes, kMiB);
    EXPECT_EQ(p.progress().requests_failed, 4u);
    EXPECT_EQ(p.progress().requests_done, 2u);
}

TEST_P(PrefetcherEngines, CallbacksMayEnqueueAndCancel) {
    const auto path = make_cold_file(dir, "data.bin", 8 * kMiB);
    auto fd = open_random(path);
    auto p = *Prefetcher::create({.engine = engine_, .queue_depth = 2, .read_size = 256 * 1024});
    std::vector<uint64_t> tags;
    p.set_callback([&](uint64_t, uint64_t tag, uint64_t, int) {
        tags.push_back(tag);
        if (tag < 4) p.enqueue({fd.get(), (tag + 1) * kMiB, kMiB, 0, tag + 1});
        if (tag == 2) p.enqueue({fd.get(), 7 * kMiB, kMiB, 0, 99}), p.cancel(99);
    });
    p.enqueue({fd.get(), 0, kMiB, 0, 0});
    ASSERT_TRUE(p.run_until_idle());
    std::sort(tags.begin(), tags.end());
    EXPECT_EQ(tags, (std::vector<uint64_t>{0, 1, 2, 3, 4, 99}));
    EXPECT_EQ(resident(path, 0, 5 * kMiB), 5 * kMiB);
    EXPECT_EQ(resident(path, 7 * kMiB, kMiB), 0u);
}

TEST_P(PrefetcherEngines, DestroyedAndMovedWithReadsInFlight) {
    const auto path = make_cold_file(dir, "data.bin", 64 * kMiB);
    auto fd = open_random(path);
    Recorder rec;
    {
        auto p = make({.queue_depth = 32, .read_size = 1 * kMiB, .register_buffers = false}, rec);
        p.enqueue({fd.get(), 0, 64 * kMiB, 0, 1});
        ASSERT_TRUE(p.submit());
        Prefetcher moved = std::move(p);  // the ring and its reads go along
        ASSERT_TRUE(moved.on_ready());
        // Destroyed with up to 32 reads into plain buffers in flight: it must wait for them.
    }
    EXPECT_TRUE(rec.done.empty()) << "no callbacks from a destructor";
}

// A file system that stops answering (a hung NFS server, a FUSE server that stopped: slow_fs.h):
// its reads show as overdue, abandon() gives them up (ETIMEDOUT) and frees their place in the
// queue, so a read of another file that waited behind them is made; and the prefetcher is
// destroyed within its 2 s bound with those reads still held by the file system.
TEST_P(PrefetcherEngines, AReadThatHangsIsGivenUpAndOthersAreRead) {
    if (const auto why = test::SlowFs::unavailable(dir.path()); !why.empty())
        GTEST_SKIP() << "cannot mount a FUSE file system here: " << why;
    const auto source = make_cold_file(dir, "source.bin", 8 * kMiB);
    const auto local = make_cold_file(dir, "local.bin", 4 * kMiB);
    std::filesystem::create_directories(dir.file("mnt"));
    std::string why;
    auto fs = test::SlowFs::mount(dir.file("mnt"), "slow.bin", source, 1 * kMiB, why);
    ASSERT_TRUE(fs) << why;
    UniqueFd slow(::open(fs->path().c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(slow) << fs->path();
    auto fd = open_random(local);
    Recorder rec;
    std::optional<Prefetcher> p(make({.queue_depth = 2, .read_size = 1 * kMiB}, rec));
    const uint64_t hung = p->enqueue({slow.get(), 2 * kMiB, 2 * kMiB, 0, 1});
    const uint64_t other = p->enqueue({fd.get(), 0, 4 * kMiB, 1, 2});
    ASSERT_TRUE(p->submit());
    auto pump = [&](int ms) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        while (std::chrono::steady_clock::now() < until) {
            pollfd pf{p->event_fd(), POLLIN, 0};
            (void)::poll(&pf, 1, 20);
            ASSERT_TRUE(p->on_ready());
        }
    };
    pump(500);
    EXPECT_EQ(rec.find(other), nullptr) << "both slots are held by the hung reads";
    EXPECT_GT(fs->held(), 0u);
    EXPECT_TRUE(p->overdue(std::chrono::seconds(10)).empty());
    EXPECT_EQ(p->overdue(std::chrono::milliseconds(200)), std::vector<uint64_t>{1});
    EXPECT_EQ(p->abandon(1), 1u);
    for (int i = 0; i < 100 && rec.find(other) == nullptr; ++i) pump(50);
    ASSERT_NE(rec.find(hung), nullptr);
    EXPECT_EQ(rec.find(hung)->err, ETIMEDOUT);
    ASSERT_NE(rec.find(other), nullptr) << "the other file's read never got a slot";
    EXPECT_EQ(rec.find(other)->err, 0);
    EXPECT_EQ(rec.find(other)->bytes, 4 * kMiB);
    EXPECT_TRUE(p->overdue(std::chrono::milliseconds(0)).empty()) << "given-up reads are not overdue again";
    const auto pr = p->progress();
    EXPECT_EQ(pr.queued_bytes + pr.inflight_bytes, 0u);
    p->enqueue({slow.get(), 4 * kMiB, 1 * kMiB, 0, 3});  // one more that hangs, then the stop
    ASSERT_TRUE(p->submit());
    const auto t0 = std::chrono::steady_clock::now();
    p.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4))
        << "the destructor waited for reads that never come";
    fs->release();
}

// A loop held elsewhere (the daemon's wait for a model's open, up to the read deadline) reaps no
// completion meanwhile, and under DEFER_TASKRUN does not even drive a buffered read on: a read of
// a healthy file then looks overdue, and the daemon set its model aside. Timed again from when the
// loop listens, it is not overdue, and completes.
TEST_P(PrefetcherEngines, AReadTheLoopWasHeldFromIsTimedAgain) {
    const auto path = make_cold_file(dir, "data.bin", 4 * kMiB);
    auto fd = open_random(path);
    Recorder rec;
    auto p = make({.queue_depth = 4, .read_size = 1 * kMiB}, rec);
    const uint64_t id = p.enqueue({fd.get(), 0, 4 * kMiB, 0, 7});
    ASSERT_TRUE(p.submit());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // held: no on_ready()
    EXPECT_EQ(p.overdue(std::chrono::milliseconds(200)), std::vector<uint64_t>{7});
    p.restart_deadlines();
    EXPECT_TRUE(p.overdue(std::chrono::milliseconds(200)).empty()) << "the time the loop was held counted";
    for (int i = 0; i < 250 && rec.find(id) == nullptr; ++i) {
        pollfd pf{p.event_fd(), POLLIN, 0};
        (void)::poll(&pf, 1, 20);
        ASSERT_TRUE(p.on_ready());
    }
    ASSERT_NE(rec.find(id), nullptr) << "the read never completed";
    EXPECT_EQ(rec.find(id)->err, 0);
    EXPECT_EQ(rec.find(id)->bytes, 4 * kMiB);
}

INSTANTIATE_TEST_SUITE_P(Both, PrefetcherEngines, testing::Values(Prefetcher::Engine::IoUring, Prefetcher::Engine::Threads),
                         engine_name);

// Where a seccomp filter denies io_uring (Docker's and containerd's default profiles), the
// default engine falls back to threads and says why; one that asks for io_uring fails with EPERM.
// In a child: a filter cannot be taken off again.
TEST_F(PrefetcherTest, WhereIoUringIsDeniedTheDefaultReadsWithThreads) {
    const auto path = make_cold_file(dir, "data.bin", 8 * kMiB);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        auto check = [](bool ok, int code) {
            if (!ok) ::_exit(code);
        };
        check(test::deny_io_uring().empty(), 10);
        auto forced = Prefetcher::create({.engine = Prefetcher::Engine::IoUring});
        check(!forced && forced.error().errnum == EPERM, 11);
        auto p = Prefetcher::create({.queue_depth = 4, .read_size = 1 * kMiB});
        check(p.has_value(), 12);
        check(p->setup().engine == Prefetcher::Engine::Threads && p->setup().threads == 4, 13);
        check(p->setup().io_uring_denied.find("io_uring_setup") != std::string::npos, 14);
        auto fd = open_random(path);
        p->enqueue({fd.get(), kMiB, 3 * kMiB, 0, 1});
        check(p->run_until_idle().has_value(), 15);
        check(p->progress().done_bytes == 3 * kMiB && p->progress().requests_done == 1, 16);
        ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status)) << "the child died of a signal";
    EXPECT_EQ(WEXITSTATUS(status), 0) << "failed check number " << WEXITSTATUS(status) << " (see the test's source)";
    // What was read is in the page cache, but for what proactive reclaim (DAMON's pageout: kdamond
    // runs on these machines) took meanwhile; the child counted every byte read (check 16).
    EXPECT_GE(resident(path, kMiB, 3 * kMiB), 3 * kMiB - 256 * 1024);
    EXPECT_EQ(resident(path, 0, kMiB), 0u);
}

TEST_F(PrefetcherTest, OptionsAreChecked) {
    EXPECT_FALSE(Prefetcher::create({.queue_depth = 0}));
    EXPECT_FALSE(Prefetcher::create({.queue_depth = 5000}));
    EXPECT_FALSE(Prefetcher::create({.read_size = 1000}));
    EXPECT_FALSE(Prefetcher::create({.read_size = 4096 + 512}));
    EXPECT_FALSE(Prefetcher::create({.read_size = 128u << 20}));
    EXPECT_FALSE(Prefetcher::create({.numa_node = -2}));
    auto ok = Prefetcher::create({.queue_depth = 3, .read_size = 4096});
    ASSERT_TRUE(ok) << ok.error().what();
    EXPECT_GE(ok->setup().sq_entries, 6u);
    EXPECT_GE(ok->setup().cq_entries, 12u);
    if (kernel_at_least(6, 1)) {
        EXPECT_NE(ok->setup().ring_flags & IORING_SETUP_DEFER_TASKRUN, 0u);
        EXPECT_NE(ok->setup().ring_flags & IORING_SETUP_SINGLE_ISSUER, 0u);
    }
}

// In a thread of its own: the memory policy it sets belongs to the calling thread and must not
// leak into the other tests.
TEST_F(PrefetcherTest, NumaNodeZeroWorksAndAnAbsentNodeIsAnError) {
    const auto path = make_cold_file(dir, "data.bin", 4 * kMiB);
    std::thread([&] {
        auto absent = Prefetcher::create({.numa_node = 999});
        ASSERT_FALSE(absent);
        EXPECT_EQ(absent.error().errnum, EINVAL);
        EXPECT_NE(absent.error().message.find("999"), std::string::npos) << absent.error().message;

        auto p = Prefetcher::create({.queue_depth = 4, .numa_node = 0});
        ASSERT_TRUE(p) << p.error().what();
        EXPECT_EQ(p->setup().numa_node, 0);
        int mode = -1;
        unsigned long mask[16] = {};
        ASSERT_EQ(::get_mempolicy(&mode, mask, sizeof mask * 8, nullptr, 0), 0);
        EXPECT_EQ(mode, MPOL_PREFERRED);
        EXPECT_EQ(mask[0] & 1ul, 1ul);
        auto fd = open_random(path);
        uint64_t got = 0;
        p->set_callback([&](uint64_t, uint64_t, uint64_t bytes, int) { got = bytes; });
        p->enqueue({fd.get(), 0, 4 * kMiB, 0, 0});
        ASSERT_TRUE(p->run_until_idle());
        EXPECT_EQ(got, 4 * kMiB);
        EXPECT_EQ(resident(path, 0, 4 * kMiB), 4 * kMiB);
    }).join();
}

}  // namespace
}  // namespace moecache::daemon
