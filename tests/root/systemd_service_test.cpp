// The real moecached under systemd's protocols. Socket activation: the client socket passed by
// systemd-socket-activate, and by hand beside a descriptor that is not for it; a client that
// connected before the daemon ran is served, the socket file is neither replaced nor removed, a
// socket of the wrong type is refused with a message. Notifications on NOTIFY_SOCKET: READY=1
// once the loop runs, WATCHDOG=1 at the watchdog's pace (between slow ticks too), RELOADING=1
// then READY=1 around SIGHUP, STOPPING=1.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/client/protocol.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

namespace moecache {
namespace {

using Clock = std::chrono::steady_clock;

sockaddr_un unix_address(const std::string& path) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    return a;
}

// A listening socket bound to `path`, as systemd makes one for ListenSequentialPacket= (type
// SOCK_SEQPACKET) or ListenStream=; inheritable, above the descriptors a shell redirects.
UniqueFd listening_socket(const std::string& path, int type = SOCK_SEQPACKET) {
    UniqueFd s(::socket(AF_UNIX, type, 0));
    const sockaddr_un a = unix_address(path);
    EXPECT_EQ(::bind(s.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
    EXPECT_EQ(::chmod(path.c_str(), 0666), 0);
    EXPECT_EQ(::listen(s.get(), 16), 0);
    return UniqueFd(::fcntl(s.get(), F_DUPFD, 10));
}

// Connects and says Hello, which waits in the socket until someone accepts and reads it.
UniqueFd connect_and_hello(const std::string& path) {
    UniqueFd c(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    const sockaddr_un a = unix_address(path);
    EXPECT_EQ(::connect(c.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << path << ": " << std::strerror(errno);
    auto sent = protocol::send_packet(c.get(), protocol::encode({1, protocol::Hello{1, 1, "activation-test"}}), {});
    EXPECT_TRUE(sent) << sent.error().what();
    return c;
}

// Whether a HelloReply arrives on `c` within the time.
bool hello_answered(int c, double seconds) {
    pollfd p{c, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(seconds * 1000)) != 1) return false;
    uint8_t buf[4096];
    const ssize_t n = ::recv(c, buf, sizeof buf, 0);
    if (n <= 0) return false;
    auto m = protocol::decode(std::span<const uint8_t>(buf, static_cast<size_t>(n)), 0);
    return m && std::holds_alternative<protocol::HelloReply>(m->body);
}

ino_t inode_of(const std::string& path) {
    struct stat st {};
    return ::lstat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

// systemd's end of NOTIFY_SOCKET: a datagram socket the daemon sends its state to.
class NotifySocket {
public:
    explicit NotifySocket(std::string path) : path_(std::move(path)) {
        s_.reset(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
        const sockaddr_un a = unix_address(path_);
        EXPECT_EQ(::bind(s_.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
    }
    [[nodiscard]] const std::string& path() const { return path_; }
    // The next message, or "" when none comes within the time.
    std::string next(double seconds) {
        pollfd p{s_.get(), POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(seconds * 1000)) != 1) return {};
        char buf[4096];
        const ssize_t n = ::recv(s_.get(), buf, sizeof buf, 0);
        return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    }
    // The next message that is not a watchdog ping.
    std::string next_state(double seconds) {
        const auto end = Clock::now() + std::chrono::duration<double>(seconds);
        for (;;) {
            const double left = std::chrono::duration<double>(end - Clock::now()).count();
            if (left <= 0) return {};
            std::string m = next(left);
            if (m != "WATCHDOG=1") return m;
        }
    }

private:
    std::string path_;
    UniqueFd s_;
};

class SystemdService : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: the daemon mlocks";
        model_ = dir_.file("model.gguf");
        test::write_model(test::small_spec(), model_);
        std::filesystem::create_directories(dir_.file("run"));
        socket_ = dir_.file("run/moecached.sock");
    }
    std::string write_config(double tick_seconds = 0.1, const std::string& lock = "16MiB") {
        const std::string cfg = dir_.file("moecached.toml");
        test::write_file(cfg, "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\nsocket = \"" + socket_ +
                                  "\"\ntick_seconds = " + std::to_string(tick_seconds) +
                                  "\n[budget]\nlock = \"" + lock + "\"\nreserve = \"1GiB\"\n"
                                  "[telemetry]\npage_cache = \"off\"\n[metrics]\nlisten = \"\"\n"
                                  // Not about pressure: other tests squeezing memory beside this one
                                  // would lower the lock cap the notifications report.
                                  "[pressure]\nenabled = false\n"
                                  "[[model]]\npath = \"" + model_ + "\"\n");
        return cfg;
    }
    // The daemon started as systemd starts a socket-activated service: `fds` become descriptors
    // 3, 4, ... of the exec'd process, LISTEN_PID is its pid (bash execs into the daemon; dash
    // takes no descriptor numbers above 9).
    static std::vector<std::string> activated(const std::vector<int>& fds, const std::string& names,
                                              const std::vector<std::string>& argv) {
        std::string moves, closes;
        for (size_t i = 0; i < fds.size(); ++i) {
            moves += " " + std::to_string(3 + i) + "<&" + std::to_string(fds[i]);
            closes += " " + std::to_string(fds[i]) + "<&-";
        }
        std::vector<std::string> out = {"/bin/bash", "-c",
                                        "exec" + moves + closes + "; LISTEN_PID=$$ LISTEN_FDS=" +
                                            std::to_string(fds.size()) + " LISTEN_FDNAMES=" + names +
                                            " exec \"$0\" \"$@\""};
        out.insert(out.end(), argv.begin(), argv.end());
        return out;
    }
    test::TempDir dir_;
    std::string model_, socket_;
};

TEST_F(SystemdService, ServesAClientWaitingOnTheSocketSystemdSocketActivatePassed) {
    const char* tool = "/usr/bin/systemd-socket-activate";
    if (::access(tool, X_OK) != 0) GTEST_SKIP() << tool << " is missing (Debian package systemd)";
    const std::string cfg = write_config();
    // The tool listens, and execs the daemon with the socket when the first client knocks.
    test::Background d({tool, "--seqpacket", "--listen=" + socket_, "--fdname=client", MOECACHE_DAEMON_BIN,
                        "--config", cfg});
    ASSERT_TRUE(d.wait_for("Listening on", 10)) << d.output();
    const ino_t inode = inode_of(socket_);
    ASSERT_NE(inode, 0u);
    UniqueFd c = connect_and_hello(socket_);
    EXPECT_TRUE(hello_answered(c.get(), 20)) << d.output();
    EXPECT_TRUE(d.wait_for("passed by systemd (socket activation)", 10)) << d.output();
    EXPECT_EQ(inode_of(socket_), inode) << "the daemon bound a socket of its own";
    // Another client, accepted by the running daemon.
    UniqueFd c2 = connect_and_hello(socket_);
    EXPECT_TRUE(hello_answered(c2.get(), 10)) << d.output();
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
    EXPECT_EQ(inode_of(socket_), inode) << "the daemon removed the socket systemd owns";
}

TEST_F(SystemdService, TakesItsSocketFromAmongOtherDescriptorsAndClosesThem) {
    const std::string cfg = write_config();
    UniqueFd sock = listening_socket(socket_);
    int p[2];
    ASSERT_EQ(::pipe(p), 0);
    UniqueFd other(::fcntl(p[0], F_DUPFD, 10));
    ::close(p[0]);
    UniqueFd other_w(p[1]);
    const ino_t inode = inode_of(socket_);
    UniqueFd early = connect_and_hello(socket_);  // before the daemon exists

    test::Background d(activated({other.get(), sock.get()}, "other:client", {MOECACHE_DAEMON_BIN, "--config", cfg}));
    EXPECT_TRUE(hello_answered(early.get(), 20)) << d.output();
    EXPECT_TRUE(d.wait_for("passed by systemd (socket activation)", 10)) << d.output();
    EXPECT_NE(d.output().find("descriptor 3 ('other') passed by systemd is not the client socket"), std::string::npos)
        << d.output();
    sock.reset();  // the daemon holds the only listening descriptor now
    UniqueFd late = connect_and_hello(socket_);
    EXPECT_TRUE(hello_answered(late.get(), 10)) << d.output();
    EXPECT_EQ(inode_of(socket_), inode);
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
    EXPECT_EQ(inode_of(socket_), inode) << "the daemon removed the socket systemd owns";
}

TEST_F(SystemdService, RefusesAStreamSocketForItsPathWithAMessage) {
    const std::string cfg = write_config();
    UniqueFd sock = listening_socket(socket_, SOCK_STREAM);  // ListenStream= instead of ListenSequentialPacket=
    test::Background d(activated({sock.get()}, "client", {MOECACHE_DAEMON_BIN, "--config", cfg}));
    EXPECT_EQ(d.wait(20), 1) << d.output();
    EXPECT_NE(d.output().find("ListenSequentialPacket="), std::string::npos) << d.output();
    EXPECT_NE(d.output().find(socket_), std::string::npos) << d.output();
}

TEST_F(SystemdService, NotifiesReadyWatchdogReloadAndStop) {
    const std::string cfg = write_config(0.1);
    NotifySocket n(dir_.file("notify"));
    test::Background d({"env", "NOTIFY_SOCKET=" + n.path(), "WATCHDOG_USEC=2000000", MOECACHE_DAEMON_BIN, "--config",
                        cfg});
    const std::string ready = n.next_state(20);
    EXPECT_EQ(ready.rfind("READY=1\nSTATUS=running: lock cap 16 MiB", 0), 0u) << ready << "\n" << d.output();

    // Pings from the ticks (every 0.1 s), at most one per quarter interval (0.5 s).
    int pings = 0;
    const auto until = Clock::now() + std::chrono::milliseconds(1300);
    while (Clock::now() < until)
        if (n.next(0.1) == "WATCHDOG=1") ++pings;
    EXPECT_GE(pings, 2) << d.output();
    EXPECT_LE(pings, 4) << d.output();

    test::write_file(cfg, test::read_file(cfg) + "[policy]\nhysteresis = 0.5\n");
    d.signal(SIGHUP);
    const std::string reloading = n.next_state(20);
    EXPECT_EQ(reloading.rfind("RELOADING=1\nMONOTONIC_USEC=", 0), 0u) << reloading;
    EXPECT_EQ(n.next_state(20), "READY=1\nSTATUS=configuration reloaded: lock cap 16 MiB") << d.output();

    test::write_file(cfg, "[budget]\nlock = \"a lot\"\n");
    d.signal(SIGHUP);
    EXPECT_EQ(n.next_state(20).rfind("RELOADING=1\n", 0), 0u);
    const std::string refused = n.next_state(20);
    EXPECT_EQ(refused.rfind("READY=1\nSTATUS=reload refused", 0), 0u) << refused;

    d.signal(SIGTERM);
    EXPECT_EQ(n.next_state(20), "STOPPING=1") << d.output();
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

TEST_F(SystemdService, FeedsTheWatchdogBetweenTicksSlowerThanIt) {
    const std::string cfg = write_config(30);  // a tick every 30 s, a watchdog of 1 s
    NotifySocket n(dir_.file("notify"));
    test::Background d({"env", "NOTIFY_SOCKET=" + n.path(), "WATCHDOG_USEC=1000000", MOECACHE_DAEMON_BIN, "--config",
                        cfg});
    ASSERT_EQ(n.next_state(20).rfind("READY=1\n", 0), 0u) << d.output();
    std::vector<Clock::time_point> pings;
    const auto until = Clock::now() + std::chrono::seconds(2);
    while (Clock::now() < until)
        if (n.next(0.1) == "WATCHDOG=1") pings.push_back(Clock::now());
    ASSERT_GE(pings.size(), 4u) << d.output();
    for (size_t i = 1; i < pings.size(); ++i)
        EXPECT_LT(pings[i] - pings[i - 1], std::chrono::milliseconds(500)) << "ping " << i << " came late";
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

}  // namespace
}  // namespace moecache
