// A model on a file system that stops answering (a hung NFS or SMB server, a FUSE file system a
// user mounted with allow_other: tests/support/slow_fs.h) takes nothing from the others: its
// header is read off the loop within [prefetch] read_deadline, its reads in flight are given up
// and the model set aside, another model's experts are read and locked meanwhile, /metrics
// answers throughout, and SIGTERM stops the daemon within seconds. Before, header reads on the
// loop held it 45 s (past the unit's watchdog), hanging reads took every prefetch slot, and the
// daemon never stopped.
#include "model_fixture.h"
#include "run.h"
#include "slow_fs.h"
#include "temp_dir.h"

#include "moecache/client/protocol.h"
#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <regex>
#include <thread>

namespace moecache {
namespace {

using Clock = std::chrono::steady_clock;

class SlowFiles : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: mounts a FUSE file system, mlock";
        if (const auto why = test::SlowFs::unavailable(dir_.path()); !why.empty())
            GTEST_SKIP() << "cannot mount a FUSE file system here: " << why;
        fast_ = dir_.file("fast.gguf");
        test::write_model(test::small_spec(), fast_);
        source_ = dir_.file("slow-source.gguf");
        auto spec = test::small_spec();
        spec.seed = 7;  // another file, other bytes
        test::write_model(spec, source_);
        std::filesystem::create_directories(dir_.file("mnt"));
    }
    // The first byte of any routed expert of the slow model: reads from there on may hang.
    uint64_t first_expert_byte() const {
        auto map = load_expert_map(source_);
        EXPECT_TRUE(map) << map.error().what();
        uint64_t first = UINT64_MAX;
        for (const auto& l : map->layers)
            for (uint32_t e = 0; e < map->n_experts; ++e)
                for (const auto& r : map->ranges(l.index, e)) first = std::min(first, r.offset);
        return first & ~uint64_t{4095};
    }
    bool mount(uint64_t hang_from, uint64_t attr_seconds = 3600) {
        std::string why;
        fs_ = test::SlowFs::mount(dir_.file("mnt"), "slow.gguf", source_, hang_from, why, attr_seconds);
        if (!fs_) ADD_FAILURE() << why;
        return fs_ != nullptr;
    }
    std::string config() const {
        return "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\ntick_seconds = 0.1\nsocket = \"" + dir_.file("sock") +
               "\"\n[budget]\nlock = \"64MiB\"\nreserve = \"1GiB\"\n[prefetch]\nread_deadline = 2\n"
               "[dbus]\nbus = \"off\"\n[telemetry]\npage_cache = \"off\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n"
               "[pressure]\nenabled = false\n"
               "[[model]]\npath = \"" + fs_->path() + "\"\npin = [\"0:0-15\"]\n"
               "[[model]]\npath = \"" + fast_ + "\"\npin = [\"0:0-3\"]\n";
    }
    static int port_of(const std::string& out) {
        std::smatch m;
        if (!std::regex_search(out, m, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) return -1;
        return std::stoi(m[1]);
    }
    // One GET of /metrics: its body, and how long it took.
    static std::pair<std::string, double> metrics(int port) {
        const auto t0 = Clock::now();
        httplib::Client c("127.0.0.1", port);
        c.set_read_timeout(10, 0);
        auto r = c.Get("/metrics");
        const std::string body = r && r->status == 200 ? r->body
                                 : r                   ? "HTTP " + std::to_string(r->status)
                                                       : "no answer: " + httplib::to_string(r.error());
        return {body, std::chrono::duration<double>(Clock::now() - t0).count()};
    }
    static uint64_t value(const std::string& body, const std::string& pattern) {
        std::smatch m;
        if (!std::regex_search(body, m, std::regex(pattern))) return 0;
        return std::stoull(m[1]);
    }
    // The fast model's pinned experts locked while the slow model hangs; /metrics prompt all along.
    void expect_the_rest_goes_on(int port) {
        uint64_t locked = 0;
        double slowest = 0;
        std::string body;
        for (int i = 0; i < 100 && locked == 0; ++i) {
            auto [b, took] = metrics(port);
            body = b;
            slowest = std::max(slowest, took);
            locked = value(body, "moecache_locked_bytes\\{[^}]*fast[^}]*\\} ([0-9]+)");
            if (locked == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        EXPECT_GT(locked, 0u) << "the other model's pinned experts were not locked\n" << body;
        EXPECT_LT(slowest, 2.0) << "a /metrics answer took " << slowest << " s";
    }
    // Seconds a Hello on the client socket waits for its answer: the loop's own latency (/metrics
    // is served beside it). 99 where none comes within 10 s.
    double hello_seconds() const {
        const auto t0 = Clock::now();
        const UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        const std::string path = dir_.file("sock");
        std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
        if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return 99;
        if (!protocol::send_packet(s.get(), protocol::encode({1, protocol::Hello{1, 1, "probe"}}))) return 99;
        pollfd p{s.get(), POLLIN, 0};
        if (::poll(&p, 1, 10000) != 1) return 99;
        return std::chrono::duration<double>(Clock::now() - t0).count();
    }
    void expect_a_prompt_stop(test::Background& d) {
        const auto t0 = Clock::now();
        d.signal(SIGTERM);
        EXPECT_EQ(d.wait(20), 0) << d.output();
        const double took = std::chrono::duration<double>(Clock::now() - t0).count();
        EXPECT_LT(took, 6.0) << "SIGTERM took " << took << " s to stop the daemon\n" << d.output();
        if (getenv("MOECACHE_TEST_VERBOSE")) std::cerr << d.output();
    }

    test::TempDir dir_;
    std::string fast_, source_;
    std::unique_ptr<test::SlowFs> fs_;
};

// The header reads, the experts' reads hang: the model loads, its reads pass the deadline, it is
// set aside (counted), and the other model's pinned experts are read and locked.
TEST_F(SlowFiles, AModelWhoseReadsHangIsSetAsideAndTheOthersAreRead) {
    ASSERT_TRUE(mount(first_expert_byte()));
    test::drop_page_cache(fast_);
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, config());
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    EXPECT_NE(d.output().find("model " + fs_->path() + " loaded"), std::string::npos) << d.output();
    const int port = port_of(d.output());
    ASSERT_GT(port, 0) << d.output();
    EXPECT_TRUE(d.wait_for("a read of its file did not complete within 2 s", 15)) << d.output();
    EXPECT_GT(fs_->held(), 0u) << "no read reached the hanging part of the file";
    expect_the_rest_goes_on(port);
    uint64_t set_aside = 0;
    for (int i = 0; i < 50 && set_aside == 0; ++i) {  // published at the next tick
        set_aside = value(metrics(port).first, "moecache_models_set_aside_total ([0-9]+)");
        if (set_aside == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_GE(set_aside, 1u) << d.output();
    expect_a_prompt_stop(d);
}

// Every read hangs, the header's too: the start waits for it no longer than the deadline, the
// model is set aside, and the rest of the daemon runs as if it were not configured.
TEST_F(SlowFiles, AHeaderThatHangsHoldsNeitherTheStartNorTheLoop) {
    ASSERT_TRUE(mount(0));
    test::drop_page_cache(fast_);
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, config());
    const auto t0 = Clock::now();
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    const double start = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_LT(start, 8.0) << "the start took " << start << " s";
    EXPECT_TRUE(d.wait_for("its header did not read within 2 s", 10)) << d.output();
    const int port = port_of(d.output());
    ASSERT_GT(port, 0) << d.output();
    expect_the_rest_goes_on(port);
    expect_a_prompt_stop(d);
}

// A file system whose lookups and attribute requests stop answering once the model is open (a hung
// NFS server: attributes are cached for seconds, and every stat after asks the server; a FUSE file
// system a user mounted with allow_other, for a model the user registers): each tick looks at every
// model's file by its name and its descriptor to see whether it changed, and that look waits for
// the server. It is made off the loop: Hellos are answered, the model is set aside, SIGTERM ends
// the loop. Before, the first tick after the server stopped held the loop for good.
TEST_F(SlowFiles, AFileWhoseStatHangsIsSetAsideWithoutHoldingTheLoop) {
    ASSERT_TRUE(mount(UINT64_MAX, /*attr_seconds=*/0));
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, config());
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    ASSERT_TRUE(d.wait_for("model " + fs_->path() + " loaded", 10)) << d.output();
    EXPECT_LT(hello_seconds(), 2.0) << d.output();
    fs_->hang_metadata();
    double slowest = 0;
    for (const auto end = Clock::now() + std::chrono::seconds(5); Clock::now() < end;) {
        slowest = std::max(slowest, hello_seconds());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_GT(fs_->held_metadata(), 0u) << "nothing looked at the file";
    EXPECT_LT(slowest, 2.0) << "a Hello waited " << slowest << " s for its answer\n" << d.output();
    EXPECT_TRUE(d.wait_for("a look at its files (a stat) did not answer within 2 s", 1)) << d.output();
    // SIGTERM ends the loop at once. The thread left in the lookup cannot end before the server
    // answers (the kernel waits out a FUSE request its server has read, fatal signals or not),
    // so the process is reaped once the file system answers.
    d.signal(SIGTERM);
    EXPECT_TRUE(d.wait_for("fast.gguf closed: the daemon stops", 6)) << d.output();
    fs_->release();
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

// The same file system, for a model a user registers: the daemon looks at the descriptors it is
// handed (fstat) and at the path the kernel gives for the first (stat). Neither waits on the
// server on the loop: Hellos of others are answered meanwhile, and the registration once the
// model's open (which looks at the path off the loop) passes its deadline. Before, the
// registration held the loop for good.
TEST_F(SlowFiles, ARegistrationOfAFileWhoseStatHangsHoldsNotTheLoop) {
    ASSERT_TRUE(mount(UINT64_MAX, /*attr_seconds=*/0));
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\ntick_seconds = 0.1\nsocket = \"" +
                              dir_.file("sock") +
                              "\"\n[budget]\nlock = \"64MiB\"\nreserve = \"1GiB\"\n[prefetch]\nread_deadline = 2\n"
                              "[dbus]\nbus = \"off\"\n[telemetry]\npage_cache = \"off\"\n[metrics]\nlisten = "
                              "\"127.0.0.1:0\"\n[pressure]\nenabled = false\n[[model]]\npath = \"" +
                              fast_ + "\"\n");
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    const UniqueFd slow(::open(fs_->path().c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(slow) << std::strerror(errno);
    const UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    const std::string path = dir_.file("sock");
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    ASSERT_EQ(::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_TRUE(protocol::send_packet(s.get(), protocol::encode({1, protocol::Hello{1, 1, "user"}})));
    fs_->hang_metadata();
    const int fd = slow.get();
    ASSERT_TRUE(protocol::send_packet(s.get(), protocol::encode({2, protocol::RegisterModel{1}}), {&fd, 1}));
    double slowest = 0;
    for (const auto end = Clock::now() + std::chrono::seconds(5); Clock::now() < end;) {
        slowest = std::max(slowest, hello_seconds());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_LT(slowest, 2.0) << "a Hello waited " << slowest << " s for its answer\n" << d.output();
    // The registration's answer, in at most the deadline and a tick or two.
    bool answered = false;
    for (int i = 0; i < 20 && !answered; ++i) {
        pollfd p{s.get(), POLLIN, 0};
        if (::poll(&p, 1, 500) != 1) continue;
        std::vector<uint8_t> buf(protocol::kMaxMessageBytes);
        const ssize_t n = ::recv(s.get(), buf.data(), buf.size(), 0);
        ASSERT_GT(n, 0) << "the connection closed";
        buf.resize(static_cast<size_t>(n));
        auto m = protocol::decode(buf, 0);
        ASSERT_TRUE(m) << m.error().what();
        if (m->request != 2) continue;
        answered = true;
        const auto* f = std::get_if<protocol::Failure>(&m->body);
        ASSERT_NE(f, nullptr) << "registered";
        EXPECT_EQ(f->errnum, ETIMEDOUT) << f->text;
        EXPECT_NE(f->text.find("did not read within 2 s"), std::string::npos) << f->text;
    }
    EXPECT_TRUE(answered) << "the registration was not answered\n" << d.output();
    d.signal(SIGTERM);
    EXPECT_TRUE(d.wait_for("fast.gguf closed: the daemon stops", 6)) << d.output();
    fs_->release();
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

}  // namespace
}  // namespace moecache
