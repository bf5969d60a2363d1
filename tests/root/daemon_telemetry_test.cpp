// Page-cache telemetry inside the daemon, on the real kernel: storage reads, evictions and page
// faults of other processes attributed to exactly the experts whose bytes they touched (several
// layers, split models, two models at once), drops counted, nothing from unrelated files; and the
// daemon without the privilege to load BPF says so once and runs.
#include "daemon_fixture.h"
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/daemon/daemon.h"
#include "moecache/model.h"
#include "moecache/page_cache.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <thread>

namespace moecache::daemon {
namespace {

constexpr uint64_t kPage = 4096;

// Runs fn in a child process (another tgid than the daemon's, as a runtime would be).
void in_child(const std::function<void()>& fn) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        fn();
        ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// Reads exactly the pages of the ranges (no read-ahead), as another process.
void read_ranges(const ExpertMap& map, const std::vector<ByteRange>& ranges) {
    in_child([&] {
        for (const auto& r : ranges) {
            const int fd = ::open(map.files[r.file].path.c_str(), O_RDONLY | O_CLOEXEC);
            if (fd < 0) ::_exit(3);
            ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
            std::vector<char> buf(r.length);
            if (::pread(fd, buf.data(), r.length, static_cast<off_t>(r.offset)) != static_cast<ssize_t>(r.length))
                ::_exit(4);
            ::close(fd);
        }
    });
}

using Key = std::pair<uint32_t, uint32_t>;  // (block, expert)

class DaemonTelemetryTest : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "loading BPF programs needs root";
        const auto f = bpf::probe_page_cache_features();
        if (!f.btf || !f.add_delete) GTEST_SKIP() << "this kernel cannot run the page-cache programs: " << f.missing;
        struct statfs sf {};
        ASSERT_EQ(::statfs(dir_.path().c_str(), &sf), 0);
        if (sf.f_type == TMPFS_MAGIC)
            GTEST_SKIP() << dir_.path() << " is on tmpfs, whose pages never come from storage: set TMPDIR to a disk";
        // Page-aligned tensors: each expert owns whole pages (slices of 17 pages, q8_0).
        a_ = test::write_model(test::small_spec(), dir_.file("a.gguf"), 1, 4096).front();
        auto spec = test::small_spec();
        spec.name = "other";
        b_ = test::write_model(spec, dir_.file("b.gguf"), 3, 4096).front();
        for (const auto& p : {dir_.file("a.gguf"), b_}) {
            auto m = load_expert_map(p);
            ASSERT_TRUE(m) << m.error().what();
            for (const auto& f2 : m->files) test::drop_page_cache(f2.path);
            maps_.push_back(std::move(*m));
        }
    }

    std::unique_ptr<Daemon> start(uint32_t ring_bytes = 4u << 20, bool on_miss = false) {
        // Nothing is locked or prefetched: the only reads are the test's (and, with on_miss, the
        // daemon's reads of what the test missed).
        Config c = test::daemon_config(a_, dir_.file("state"), 1u << 20);
        c.on_miss = on_miss;
        c.admit_after_uses = 1000000;
        c.models.push_back(c.models.front());
        c.models.back().path = b_;
        c.page_cache_telemetry = "on";
        c.page_cache_ring_bytes = ring_bytes;
        auto d = Daemon::create(c);
        if (!d) ADD_FAILURE() << d.error().what();
        return d ? std::move(*d) : nullptr;
    }

    // Turns of the loop until every event the kernel sent has been consumed.
    static DaemonStatus drain(Daemon& d) {
        for (int i = 0; i < 200; ++i) {
            EXPECT_TRUE(d.step(10));
            const auto s = d.status();
            uint64_t sent = 0;
            for (uint64_t v : s.page_cache.sent) sent += v;
            if (s.page_cache.events == sent) return s;
        }
        ADD_FAILURE() << "events were sent but not consumed";
        return d.status();
    }

    static std::map<Key, SlotTelemetry> by_expert(const ModelStatus& m) {
        std::map<Key, SlotTelemetry> out;
        for (const auto& e : m.experts) out[{e.block, e.expert}] = e.telemetry;
        return out;
    }

    std::vector<ByteRange> ranges(size_t model, std::initializer_list<Key> experts) const {
        std::vector<ByteRange> out;
        for (const auto& [block, e] : experts)
            for (const auto& r : maps_[model].ranges(block, e)) out.push_back(r);
        return out;
    }

    test::TempDir dir_;
    std::string a_, b_;
    std::vector<ExpertMap> maps_;
};

TEST_F(DaemonTelemetryTest, StorageReadsAreAttributedToExactlyTheExpertsRead) {
    auto d = start();
    ASSERT_TRUE(d);
    ASSERT_TRUE(d->status().page_cache.enabled);
    const std::set<Key> read_a = {{0, 3}, {2, 11}, {3, 0}};
    const std::set<Key> read_b = {{1, 15}, {3, 7}, {0, 0}};  // in three different parts of the split set
    read_ranges(maps_[0], ranges(0, {{0, 3}, {2, 11}, {3, 0}}));
    read_ranges(maps_[1], ranges(1, {{1, 15}, {3, 7}, {0, 0}}));
    const auto s = drain(*d);
    ASSERT_EQ(s.models.size(), 2u);
    for (size_t mi = 0; mi < 2; ++mi) {
        const auto& want = mi == 0 ? read_a : read_b;
        const auto& ms = s.models[mi];
        ASSERT_TRUE(ms.loaded) << ms.error;
        for (const auto& e : ms.experts) {
            const bool expected = want.count({e.block, e.expert}) != 0;
            EXPECT_EQ(e.telemetry.read_bytes, expected ? e.bytes : 0)
                << "model " << mi << " block " << e.block << " expert " << e.expert;
            EXPECT_EQ(e.telemetry.prefetch_bytes, 0u);
            EXPECT_EQ(e.telemetry.faults, 0u);
            EXPECT_EQ(e.uses, expected ? 1u : 0u) << "a storage read by a runtime is a use, once per batch";
        }
        EXPECT_EQ(ms.dense_telemetry.read_bytes, 0u);
    }
    EXPECT_EQ(s.page_cache.unattributed, 0u);
    uint64_t dropped = 0;
    for (uint64_t v : s.page_cache.dropped) dropped += v;
    EXPECT_EQ(dropped, 0u);
}

// While a client reports a model's routing, those reports are its heat: a storage read of its
// experts (the CUDA hook copying a pool's miss) is attributed but is no use of its own, which would
// count the routing twice and favour what the pool misses; a model nobody reports for counts it.
TEST_F(DaemonTelemetryTest, WhileRoutingReportsArriveAReadIsNoSecondUse) {
    auto d = start();
    ASSERT_TRUE(d);
    ASSERT_TRUE(d->status().page_cache.enabled);
    auto before = d->status();
    ASSERT_EQ(before.models.size(), 2u);
    const uint32_t a = before.models[0].id;
    const std::vector<uint32_t> routed{3};
    d->record_routing(a, 0, routed, 1);  // block 0: expert 3 routed once
    read_ranges(maps_[0], ranges(0, {{0, 3}, {2, 11}}));
    read_ranges(maps_[1], ranges(1, {{1, 15}}));
    const auto s = drain(*d);
    for (const auto& e : s.models[0].experts) {
        if (e.block == 0 && e.expert == 3) {
            EXPECT_EQ(e.uses, 1u) << "the routing's use, once";
        }
        if (e.block == 2 && e.expert == 11) {
            EXPECT_EQ(e.uses, 0u) << "a read while routing reports arrive";
            EXPECT_EQ(e.telemetry.read_bytes, e.bytes) << "the read is still attributed";
        }
    }
    for (const auto& e : s.models[1].experts) {
        if (e.block == 1 && e.expert == 15) {
            EXPECT_EQ(e.uses, 1u) << "no reports for this model: a read is a use";
        }
    }
}

// One page of an expert read from storage by another process: the daemon reads the rest of that
// expert (all its slices), and nothing of its neighbours.
TEST_F(DaemonTelemetryTest, AMissIsReadWhole) {
    for (const bool on : {true, false}) {
        SCOPED_TRACE(on ? "on_miss" : "on_miss off");
        for (const auto& f : maps_[0].files) test::drop_page_cache(f.path);
        auto d = start(4u << 20, on);
        ASSERT_TRUE(d);
        const auto first = maps_[0].ranges(2, 9).front();
        read_ranges(maps_[0], {{first.file, first.offset, kPage}});
        for (int i = 0; i < 200; ++i) {
            ASSERT_TRUE(d->step(10));
            if (d->status().miss_fetches > 0 && d->idle()) break;
            if (!on && i > 50) break;
        }
        (void)drain(*d);
        auto probe = PageCacheProbe::open(a_);
        ASSERT_TRUE(probe);
        uint64_t cached = 0, length = 0;
        for (const auto& r : maps_[0].ranges(2, 9)) {
            cached += probe->resident_bytes(r.offset, r.length).value_or(0);
            length += r.length;
        }
        // Proactive reclaim (DAMON's pageout runs on these machines) may take a few pages that
        // nobody maps before they are counted: the read itself is checked exactly below.
        EXPECT_LE(cached, on ? length : kPage) << "expert 2:9";
        EXPECT_GE(cached, on ? length / 100 * 97 : 0) << "expert 2:9";
        for (uint32_t e : {8u, 10u})
            for (const auto& r : maps_[0].ranges(2, e)) EXPECT_EQ(probe->resident_bytes(r.offset, r.length).value_or(1), 0u) << e;
        const auto s = d->status();
        EXPECT_EQ(s.miss_fetches, on ? 1u : 0u);
        EXPECT_EQ(s.miss_fetch_bytes, on ? length : 0u);
        const SlotTelemetry t = by_expert(s.models[0])[Key{2, 9}];
        EXPECT_EQ(t.read_bytes, kPage) << "the runtime's miss";
        EXPECT_EQ(t.prefetch_bytes, on ? length - kPage : 0) << "the daemon's read of the rest";
    }
}

// A burst of misses (one page of each of many experts) is read whole, and planned at most once a
// loop turn: misses are facts the turn decides on, not reads queued from the event handler.
TEST_F(DaemonTelemetryTest, ABurstOfMissesIsPlannedAtMostOncePerLoopTurn) {
    for (const auto& f : maps_[0].files) test::drop_page_cache(f.path);
    auto d = start(4u << 20, /*on_miss=*/true);
    ASSERT_TRUE(d);
    std::vector<ByteRange> pages;
    uint32_t experts = 0;
    for (uint32_t e = 0; e < maps_[0].n_experts; e += 2, ++experts) {
        const auto first = maps_[0].ranges(1, e).front();
        pages.push_back({first.file, first.offset, kPage});
    }
    const uint64_t before = d->plans();
    read_ranges(maps_[0], pages);
    uint64_t turns = 0;
    for (; turns < 400; ++turns) {
        ASSERT_TRUE(d->step(10));
        if (d->status().miss_fetches >= experts && d->idle()) break;
    }
    const auto s = d->status();
    EXPECT_EQ(s.miss_fetches, experts) << "each missed expert read once";
    const uint64_t plans = d->plans() - before;
    EXPECT_LE(plans, turns + 1) << "at most one plan a turn";
}

TEST_F(DaemonTelemetryTest, EvictionsAreAttributedAndUnrelatedFilesShowNothing) {
    auto d = start();
    ASSERT_TRUE(d);
    in_child([&] {  // the whole of model a, cached, a page at a time (small folios, no read-ahead)
        const int fd = ::open(a_.c_str(), O_RDONLY);
        const auto size = static_cast<size_t>(maps_[0].files[0].size);
        auto* m = static_cast<volatile const char*>(::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
        ::madvise(const_cast<char*>(m), size, MADV_RANDOM);
        for (size_t at = 0; at < size; at += kPage) (void)m[at];
        ::close(fd);
    });
    auto s = drain(*d);
    for (const auto& e : s.models[0].experts) ASSERT_EQ(e.telemetry.read_bytes, e.bytes);
    for (const auto& e : s.models[0].experts) ASSERT_EQ(e.telemetry.evicted_bytes, 0u);

    // What leaves the page cache is whole folios inside the dropped ranges (the kernel keeps a
    // large folio that sticks out of the range): the truth is what cachestat sees leave.
    auto cached = [&] {
        std::map<Key, uint64_t> out;
        auto probe = PageCacheProbe::open(a_);
        for (const auto& l : maps_[0].layers)
            for (uint32_t e = 0; e < maps_[0].n_experts; ++e)
                for (const auto& r : maps_[0].ranges(l.index, e))
                    out[{l.index, e}] += probe->resident_bytes(r.offset, r.length).value_or(0);
        return out;
    };
    const auto before_drop = cached();
    for (const auto& r : ranges(0, {{1, 5}, {3, 15}})) {
        UniqueFd fd(::open(a_.c_str(), O_RDONLY | O_CLOEXEC));
        ASSERT_EQ(::posix_fadvise(fd.get(), static_cast<off_t>(r.offset), static_cast<off_t>(r.length), POSIX_FADV_DONTNEED), 0);
    }
    const auto after_drop = cached();
    s = drain(*d);
    for (const auto& e : s.models[0].experts) {
        const Key k{e.block, e.expert};
        const bool dropped = k == Key{1, 5} || k == Key{3, 15};
        EXPECT_EQ(e.telemetry.evicted_bytes, before_drop.at(k) - after_drop.at(k)) << "block " << e.block << " expert " << e.expert;
        if (dropped) {
            EXPECT_GT(e.telemetry.evicted_bytes, 0u);
        } else {
            EXPECT_EQ(e.telemetry.evicted_bytes, 0u) << "block " << e.block << " expert " << e.expert;
        }
    }

    // An unrelated file, read cold and dropped: no event at all.
    const std::string other = dir_.file("unrelated.bin");
    test::write_file(other, std::string(4 << 20, 'x'));
    test::drop_page_cache(other);
    const uint64_t before = s.page_cache.events;
    in_child([&] {
        const int fd = ::open(other.c_str(), O_RDONLY);
        std::vector<char> buf(1 << 20);
        while (::read(fd, buf.data(), buf.size()) > 0) {}
        ::close(fd);
    });
    test::drop_page_cache(other);
    const auto sent_before = s.page_cache;
    s = drain(*d);
    // The unrelated file's 1024 pages were added and deleted: none of that may show. The model's own
    // pages may still leave the cache meanwhile (reclaim on a busy machine): a few deletes are its.
    const uint64_t added = s.page_cache.sent[0] - sent_before.sent[0], deleted = s.page_cache.sent[1] - sent_before.sent[1];
    EXPECT_EQ(added, 0u) << "added " << added << " deleted " << deleted;
    EXPECT_LT(deleted, 1024u) << "the unrelated file's pages were reported";
    EXPECT_EQ(s.page_cache.sent[2] - sent_before.sent[2], 0u) << "faults";
    EXPECT_EQ(s.page_cache.sent[3] - sent_before.sent[3], 0u) << "mapped";
    EXPECT_LE(s.page_cache.events - before, deleted);
}

TEST_F(DaemonTelemetryTest, PageFaultsOfARuntimeMarkTheExpertUsed) {
    auto d = start();
    ASSERT_TRUE(d);
    if (!d->status().page_cache.faults) GTEST_SKIP() << "no fault tracepoints here: " << d->status().page_cache.off_reason;
    const auto r = maps_[0].ranges(2, 9).front();
    in_child([&] {
        const int fd = ::open(a_.c_str(), O_RDONLY);
        const auto size = static_cast<size_t>(maps_[0].files[0].size);
        auto* m = static_cast<volatile const char*>(::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
        if (m == MAP_FAILED) ::_exit(5);
        (void)m[r.offset + r.length / 2];  // one page in the middle of the expert's first slice
        ::munmap(const_cast<char*>(m), size);
        ::close(fd);
    });
    const auto s = drain(*d);
    const auto t = by_expert(s.models[0]);
    EXPECT_GT(t.at({2, 9}).faults, 0u);
    EXPECT_GT(t.at({2, 9}).read_bytes, 0u) << "the fault read the page from storage";
    // A fault reports its fault-around window (16 pages): at most the neighbours of the same
    // tensor share it, nothing further away.
    for (const auto& [k, v] : t) {
        if (k.first != 2 || k.second + 1 < 9 || k.second > 10) {
            EXPECT_EQ(v.faults, 0u) << k.first << ":" << k.second;
        }
    }
    for (const auto& e : s.models[0].experts) {
        if (e.block == 2 && e.expert == 9) {
            EXPECT_GE(e.uses, 1u);
        }
    }
}

TEST_F(DaemonTelemetryTest, AFloodBeyondTheRingRaisesTheDropCounter) {
    auto d = start(4096);
    ASSERT_TRUE(d);
    // The loop is not turned while the flood runs: the experts read and dropped 20 times, thousands
    // of events (one per folio) into a ring of 128 slots. The experts alone, not the file from its
    // start: the header and dense tensors come first in the file and, in single-page folios (when
    // the kernel finds no large ones), filled the whole ring before an expert was read.
    std::vector<ByteRange> experts;
    for (const auto& l : maps_[0].layers)
        for (uint32_t e = 0; e < maps_[0].n_experts; ++e)
            for (const auto& r : maps_[0].ranges(l.index, e)) experts.push_back(r);
    in_child([&] {
        const int fd = ::open(a_.c_str(), O_RDONLY);
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
        char buf[kPage];
        for (int i = 0; i < 20; ++i) {
            for (const auto& r : experts)
                for (uint64_t off = r.offset; off < r.offset + r.length; off += kPage)
                    (void)!::pread(fd, buf, sizeof buf, static_cast<off_t>(off));
            if (i + 1 < 20) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        }
        ::close(fd);
    });
    const auto s = drain(*d);
    EXPECT_GT(s.page_cache.dropped[0], 0u) << "sent " << s.page_cache.sent[0] << " events " << s.page_cache.events;
    EXPECT_EQ(s.page_cache.events, s.page_cache.sent[0] + s.page_cache.sent[1] + s.page_cache.sent[2] + s.page_cache.sent[3]);
    uint64_t read = 0;
    for (const auto& e : s.models[0].experts) read += e.telemetry.read_bytes;
    EXPECT_LT(read, 20 * s.models[0].expert_bytes) << "some reads were dropped, so not all were attributed";
    EXPECT_GT(read, 0u);
}

// Without CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN (dropped from the bounding set): "auto" says why
// once and runs; "on" refuses to start and says what is missing.
TEST_F(DaemonTelemetryTest, WithoutThePrivilegeTheDaemonSaysSoOnceAndRuns) {
    if (::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "setpriv (util-linux) is missing";
    auto conf = [&](const std::string& mode) {
        return "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\ntick_seconds = 0.1\nsocket = \"" +
               dir_.file("sock") + "\"\n"
               "[budget]\nlock = \"16MiB\"\nreserve = \"1GiB\"\n[pressure]\nenabled = false\n"
               "[telemetry]\npage_cache = \"" + mode + "\"\n[[model]]\npath = \"" + a_ + "\"\n";
    };
    const std::vector<std::string> drop = {"/usr/bin/setpriv", "--bounding-set", "-bpf,-perfmon,-sys_admin", "--"};
    test::write_file(dir_.file("auto.toml"), conf("auto"));
    std::vector<std::string> argv = drop;
    argv.insert(argv.end(), {MOECACHE_DAEMON_BIN, "--config", dir_.file("auto.toml")});
    {
        test::Background bg(argv);
        ASSERT_TRUE(bg.wait_for("moecached running", 20)) << bg.output();
        ASSERT_TRUE(bg.wait_for("model " + a_ + " loaded", 20)) << bg.output();
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        bg.signal(SIGTERM);
        EXPECT_EQ(bg.wait(20), 0) << bg.output();
        const std::string& out = bg.output();
        const std::string line = "page-cache telemetry is off";
        const auto first = out.find(line);
        ASSERT_NE(first, std::string::npos) << out;
        EXPECT_EQ(out.find(line, first + 1), std::string::npos) << "said more than once:\n" << out;
        EXPECT_NE(out.find("CAP_BPF"), std::string::npos) << "the message says what is missing:\n" << out;
    }
    test::write_file(dir_.file("on.toml"), conf("on"));
    argv = drop;
    argv.insert(argv.end(), {MOECACHE_DAEMON_BIN, "--config", dir_.file("on.toml")});
    const auto r = test::run(argv);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find("telemetry.page_cache"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace moecache::daemon
