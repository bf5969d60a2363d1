// The budget invariant and the PSI back-off under real memory pressure. A balloon (child
// processes in a memory cgroup of their own, with a hard limit) re-reads a file larger than that
// limit: every pass refaults pages the cgroup just evicted, and the kernel counts the reclaim and
// the refault reads as memory stalls, which the machine-wide PSI "some" line sees. The balloon's
// cgroup can reclaim only its own pages, so the machine is never in danger and nothing is killed.
#include "daemon_fixture.h"
#include "memory_cgroup.h"
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/daemon/daemon.h"
#include "moecache/error.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <thread>
#include <vector>

namespace moecache::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMiB = 1ull << 20;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string read_text(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Microseconds that some task stalled on memory, machine-wide, since boot.
uint64_t psi_some_total_us() {
    const std::string text = read_text("/proc/pressure/memory");
    const auto at = text.find("total=");
    return at == std::string::npos ? 0 : std::strtoull(text.c_str() + at + 6, nullptr, 10);
}

// Reader processes that wait at a gate, then re-read `path` in a loop until killed. Forked before
// the daemon exists (no locked mappings or io_uring to copy); they die with this process too.
class Balloon {
public:
    Balloon(const std::string& path, int readers) : buffer_(kMiB) {
        int gate[2];
        if (::pipe2(gate, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
        gate_ = gate[1];
        const pid_t parent = ::getpid();
        for (int i = 0; i < readers; ++i) {
            const pid_t pid = ::fork();
            if (pid < 0) break;
            if (pid == 0) read_forever(parent, gate[0], gate[1], path.c_str(), buffer_.data(), buffer_.size());
            pids_.push_back(pid);
        }
        ::close(gate[0]);
    }
    ~Balloon() { stop(); }
    Balloon(const Balloon&) = delete;
    Balloon& operator=(const Balloon&) = delete;

    [[nodiscard]] const std::vector<pid_t>& pids() const { return pids_; }
    void start() {
        if (gate_ >= 0) ::close(gate_);
        gate_ = -1;
    }
    void stop() {
        for (pid_t p : pids_) ::kill(p, SIGKILL);
        for (pid_t p : pids_) ::waitpid(p, nullptr, 0);
        pids_.clear();
        if (gate_ >= 0) ::close(gate_);
        gate_ = -1;
    }

private:
    // Only async-signal-safe calls from here on: this is the child of a forked process.
    [[noreturn]] static void read_forever(pid_t parent, int gate_in, int gate_out, const char* path, char* buf, size_t n) {
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != parent) ::_exit(1);
        ::close(gate_out);
        char c;
        while (::read(gate_in, &c, 1) < 0 && errno == EINTR) {}  // EOF: the gate opened
        const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) ::_exit(2);
        for (;;) {
            off_t off = 0;
            ssize_t got;
            while ((got = ::pread(fd, buf, n, off)) > 0) off += got;
            if (got < 0 && errno != EINTR) ::_exit(3);
        }
    }

    std::vector<char> buffer_;
    std::vector<pid_t> pids_;
    int gate_ = -1;
};

class PressureTest : public testing::Test {
protected:
    // The model: 6 layers x 32 experts of 1.6 MiB (320 MiB of experts).
    static mkmodel::ModelSpec spec() {
        auto s = test::small_spec();
        s.n_layers = 6;
        s.n_experts = 32;
        s.n_embd = 1024;
        s.n_ff_exp = 512;
        return s;
    }
    // A distinct number of uses for every expert, so the heat order is known: interleaved over the
    // layers, so that "coldest first" is a global order, not a per-layer one.
    static uint32_t uses(uint32_t layer, uint32_t e, uint32_t n_layers) { return 1 + e * n_layers + layer; }

    static constexpr uint64_t kBalloonLimit = 64 * kMiB;
    static constexpr uint64_t kScratchBytes = 96 * kMiB;  // under 2x the limit: the refaults count as thrashing
    static constexpr int kReaders = 2;
    static constexpr uint32_t kLockedExperts = 160;  // of 192

    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: mlock, PSI triggers and cgroups";
        // The daemon arms the same trigger; without one there is no back-off to test. Without
        // CAP_SYS_RESOURCE (a container, a hardened unit) the kernel takes only windows that are
        // multiples of 2 s, and looks at them every 2 s: then the quiet time must be longer too.
        if (!psi_trigger_works(10000, 500000)) {
            const int e = errno;
            if (e == ENOENT || e == EOPNOTSUPP)
                GTEST_SKIP() << "no PSI (/proc/pressure/memory: " << std::strerror(e) << "); boot with psi=1";
            if (!psi_trigger_works(40000, 2000000))
                GTEST_SKIP() << "cannot arm a PSI trigger on /proc/pressure/memory: " << std::strerror(errno);
            stall_us_ = 40000;
            window_us_ = 2000000;
            recover_s_ = 5;
        }
        // The balloon's file must live on storage: tmpfs pages are not page cache to churn.
        std::string scratch_dir = dir_.path();
        if (on_tmpfs(scratch_dir)) scratch_dir = "/var/tmp";
        if (on_tmpfs(scratch_dir))
            GTEST_SKIP() << dir_.path() << " and /var/tmp are on tmpfs: the balloon needs a file on storage; set TMPDIR";
        auto cg = test::MemoryCgroup::create("moecache-pressure-test-", kBalloonLimit);
        if (!cg) GTEST_SKIP() << "no memory cgroup for the balloon: " << cg.error().what();
        cgroup_ = std::move(*cg);

        model_ = dir_.file("model.gguf");
        test::write_model(spec(), model_);
        test::drop_page_cache(model_);
        scratch_ = scratch_dir + "/moecache-pressure-scratch-" + std::to_string(::getpid());
        write_scratch(scratch_, kScratchBytes);
        test::drop_page_cache(scratch_);  // or the readers would hit pages charged to this test's cgroup
    }

    ~PressureTest() override {
        if (!scratch_.empty()) ::unlink(scratch_.c_str());
    }

    static bool on_tmpfs(const std::string& dir) {
        struct statfs sf {};
        return ::statfs(dir.c_str(), &sf) == 0 && sf.f_type == TMPFS_MAGIC;
    }

    static bool psi_trigger_works(uint32_t stall_us, uint32_t window_us) {
        const int fd = ::open("/proc/pressure/memory", O_RDWR | O_CLOEXEC);
        if (fd < 0) return false;
        const std::string trig = fmt::format("some {} {}", stall_us, window_us);
        const bool armed = ::write(fd, trig.c_str(), trig.size() + 1) >= 0;
        const int e = errno;
        ::close(fd);
        errno = e;
        return armed;
    }

    static void write_scratch(const std::string& path, uint64_t bytes) {
        const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ASSERT_GE(fd, 0) << path;
        std::vector<char> block(kMiB, 'x');
        for (uint64_t done = 0; done < bytes; done += block.size())
            ASSERT_EQ(::write(fd, block.data(), block.size()), static_cast<ssize_t>(block.size())) << path;
        ::close(fd);
    }

    Config config(uint64_t budget) const {
        Config c = test::daemon_config(model_, dir_.file("state"), budget);
        c.pressure_enabled = true;
        c.pressure_stall_us = stall_us_;
        c.pressure_window_us = window_us_;
        c.pressure_release_share = 0.10;
        c.pressure_recover_seconds = recover_s_;
        return c;
    }

    // The budget invariant, at this moment: never more locked than the cap, and the daemon's
    // count is what the kernel charges this process.
    void check_budget(const DaemonStatus& s, const char* phase) {
        ++checks_;
        ASSERT_LE(s.locked_bytes, s.lock_cap) << phase << ", check " << checks_;
        ASSERT_EQ(s.vmlck_bytes - vmlck_before_, s.locked_bytes) << phase << ", check " << checks_;
    }

    // Locked experts, hottest first, must be a prefix of the heat order: what goes, goes coldest first.
    static std::string coldest_first_violation(const DaemonStatus& s, uint32_t n_layers) {
        std::vector<std::pair<uint32_t, bool>> order;  // (uses, locked)
        for (const auto& x : s.models.at(0).experts)
            order.emplace_back(uses(x.block, x.expert, n_layers), x.tier == Tier::Locked);
        std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        for (size_t i = 1; i < order.size(); ++i)
            if (order[i].second && !order[i - 1].second)
                return fmt::format("the expert with {} uses is locked but the one with {} uses is not",
                                   order[i].first, order[i - 1].first);
        return {};
    }

    static uint32_t locked_count(const DaemonStatus& s) {
        uint32_t n = 0;
        for (const auto& x : s.models.at(0).experts) n += x.tier == Tier::Locked;
        return n;
    }

    static Tier tier(const DaemonStatus& s, uint32_t block, uint32_t e) {
        for (const auto& x : s.models.at(0).experts)
            if (x.block == block && x.expert == e) return x.tier;
        throw std::runtime_error("no such expert");
    }

    test::TempDir dir_;
    std::unique_ptr<test::MemoryCgroup> cgroup_;
    std::string model_, scratch_;
    uint64_t vmlck_before_ = 0;
    uint64_t checks_ = 0;
    uint32_t stall_us_ = 10000, window_us_ = 500000;  // 2 % of the window
    double recover_s_ = 2;
};

TEST_F(PressureTest, BudgetHoldsUnderABalloonAndPsiBackOffReleasesThenRecovers) {
    const auto sp = spec();
    const uint32_t nl = sp.n_layers, ne = sp.n_experts;
    const uint64_t per_expert = mkmodel::bytes_per_expert(sp);
    Balloon balloon(scratch_, kReaders);
    ASSERT_EQ(balloon.pids().size(), static_cast<size_t>(kReaders)) << "fork failed";
    for (pid_t p : balloon.pids()) {
        auto r = cgroup_->add(p);
        ASSERT_TRUE(r) << r.error().what();
    }

    vmlck_before_ = vmlck_bytes();
    auto created = Daemon::create(config(kLockedExperts * per_expert + per_expert / 2));
    ASSERT_TRUE(created) << created.error().what();
    Daemon& d = **created;
    const uint32_t id = *d.model_id(model_);
    // Round r routes every expert with more than r uses, one batch per round.
    std::vector<uint32_t> experts;
    for (uint32_t round = 0; round < nl * ne; ++round)
        for (uint32_t l = 0; l < nl; ++l) {
            experts.clear();
            for (uint32_t e = 0; e < ne; ++e)
                if (uses(l, e, nl) > round) experts.push_back(e);
            if (!experts.empty()) d.record_routing(id, l, experts, 1);
        }
    const uint32_t hot_block = nl - 1, hot_expert = ne - 1;  // the most uses

    // Settle: everything wanted read and locked, and no pressure from elsewhere in force.
    DaemonStatus s;
    {
        const auto end = Clock::now() + std::chrono::seconds(20);
        d.tick();
        for (;;) {
            ASSERT_TRUE(d.step(50));
            s = d.status();
            ASSERT_NO_FATAL_FAILURE(check_budget(s, "settling"));
            if (d.idle() && !s.under_pressure) {
                d.tick();
                if (d.idle()) break;
            }
            ASSERT_TRUE(Clock::now() < end) << "the daemon did not settle: " << locked_count(s) << " experts locked";
        }
        s = d.status();
    }
    ASSERT_TRUE(s.models.at(0).loaded) << s.models.at(0).error;
    const uint64_t baseline = s.locked_bytes;
    const uint32_t locked_before = locked_count(s);
    // The budget has room for 160 experts' bytes; locking rounds each slice out to whole pages.
    EXPECT_GE(locked_before, kLockedExperts - 10);
    EXPECT_LE(locked_before, kLockedExperts);
    EXPECT_EQ(coldest_first_violation(s, nl), "");
    ASSERT_GT(baseline, 0u);
    const uint64_t events_before = s.pressure_events;

    // Squeeze: drive the loop while the balloon runs, until the back-off has acted a few times.
    const uint64_t psi_before = psi_some_total_us();
    const auto squeeze = Clock::now();
    balloon.start();
    double first_event_s = -1;
    uint64_t min_locked = baseline, seen_events = 0, prev_locked = baseline;
    Clock::time_point last_event{};
    for (;;) {
        ASSERT_TRUE(d.step(50));
        s = d.status();
        ASSERT_NO_FATAL_FAILURE(check_budget(s, "under pressure"));
        const uint64_t events = s.pressure_events - events_before;
        if (events > seen_events) {
            // Each event lowers the cap to 90 % of what was locked, and the releases happen at once.
            if (first_event_s < 0) first_event_s = seconds_since(squeeze);
            last_event = Clock::now();
            seen_events = events;
            EXPECT_TRUE(s.under_pressure);
            EXPECT_LE(s.locked_bytes * 10, prev_locked * 9) << "event " << events << ": locked " << s.locked_bytes
                                                              << " bytes, before it " << prev_locked;
        }
        prev_locked = s.locked_bytes;
        min_locked = std::min(min_locked, s.locked_bytes);
        ASSERT_EQ(tier(s, hot_block, hot_expert), Tier::Locked) << "the hottest expert was released";
        ASSERT_EQ(coldest_first_violation(s, nl), "") << "after " << events << " pressure events";
        if (events >= 3) break;
        if (seconds_since(squeeze) > 15) break;
    }
    const double squeeze_s = seconds_since(squeeze);
    const uint64_t psi_stall_us = psi_some_total_us() - psi_before;
    const uint64_t events = s.pressure_events - events_before;
    ASSERT_GT(events, 0u) << "no PSI event in " << squeeze_s << " s although the machine counted "
                          << psi_stall_us / 1000 << " ms of memory stall (trigger: " << stall_us_ << " us in "
                          << window_us_ << " us)";
    EXPECT_LT(min_locked, baseline) << "pressure released nothing";
    EXPECT_LE(min_locked, baseline - per_expert * (locked_before / 10)) << "one event releases ~10 % of what is locked";
    const uint32_t locked_under_pressure = locked_count(s);

    // Let go: the balloon dies, its cgroup goes; after the quiet time the daemon takes memory back.
    balloon.stop();
    cgroup_->remove();
    const auto released = Clock::now();
    double recovered_s = -1, quiet_s = -1;
    for (;;) {
        ASSERT_TRUE(d.step(50));
        s = d.status();
        ASSERT_NO_FATAL_FAILURE(check_budget(s, "recovering"));
        if (s.pressure_events - events_before > seen_events) {  // the tail of the squeeze
            seen_events = s.pressure_events - events_before;
            last_event = Clock::now();
        }
        if (s.under_pressure) {
            ASSERT_LE(s.locked_bytes, prev_locked) << "memory taken back while the cap is in force";
            prev_locked = s.locked_bytes;
        } else if (quiet_s < 0) {
            quiet_s = seconds_since(last_event);
        }
        if (!s.under_pressure && d.idle() && s.locked_bytes >= baseline) {
            recovered_s = seconds_since(released);
            break;
        }
        if (seconds_since(released) > recover_s_ + 10) break;
    }
    EXPECT_FALSE(s.under_pressure) << "the cap was not lifted " << seconds_since(released)
                                   << " s after the balloon stopped";
    EXPECT_GE(s.locked_bytes, baseline - baseline / 10) << "the experts were not locked again";
    EXPECT_EQ(tier(s, hot_block, hot_expert), Tier::Locked);
    if (quiet_s >= 0) {
        EXPECT_GE(quiet_s, recover_s_ - 0.1) << "the cap was lifted before pressure_recover_seconds of quiet";
    }

    using ull = unsigned long long;
    std::printf("[ pressure ] trigger 'some %u %u', quiet time %.0f s; balloon: %d readers of a %llu MiB file in a "
                "%llu MiB %s cgroup; first PSI event after %.2f s, %llu events in %.2f s (%llu ms of machine-wide "
                "stall); locked %llu -> %llu MiB (%u -> %u experts); cap lifted %.2f s after the last event; %llu MiB "
                "locked again %.2f s after the balloon stopped; %llu budget checks\n",
                stall_us_, window_us_, recover_s_, kReaders, ull{kScratchBytes / kMiB}, ull{kBalloonLimit / kMiB},
                cgroup_->v2() ? "v2" : "v1", first_event_s, ull{events}, squeeze_s, ull{psi_stall_us / 1000},
                ull{baseline / kMiB}, ull{min_locked / kMiB}, locked_before, locked_under_pressure, quiet_s,
                ull{s.locked_bytes / kMiB}, recovered_s, ull{checks_});
}

}  // namespace
}  // namespace moecache::daemon
