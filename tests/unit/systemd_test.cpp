// systemd's service protocols as moecached speaks them (moecache/systemd.h): notifications reach a
// real datagram socket, bound to a path or an abstract address, byte for byte; the watchdog's
// interval and its rate limit; descriptors passed the way systemd passes them (from fd 3, with
// LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES), taken over close-on-exec, the variables unset.
#include "temp_dir.h"

#include "moecache/systemd.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

namespace moecache::systemd {
namespace {

constexpr const char* kVariables[] = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
                                      "LISTEN_PID",    "LISTEN_FDS",    "LISTEN_FDNAMES"};

// A datagram socket, as systemd's notification socket is, bound to `name` (a path, or an abstract
// address when it starts with '@').
UniqueFd bind_datagram(const std::string& name) {
    UniqueFd s(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, name.data(), name.size());
    if (name[0] == '@') a.sun_path[0] = '\0';
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + (name[0] == '@' ? 0 : 1));
    EXPECT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&a), len), 0) << name << ": " << std::strerror(errno);
    return s;
}

// The next datagram, or "" when none comes within the time.
std::string receive(int s, int timeout_ms = 2000) {
    pollfd p{s, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return {};
    char buf[4096];
    const ssize_t n = ::recv(s, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

class Systemd : public testing::Test {
protected:
    void SetUp() override {
        for (const char* v : kVariables) ::unsetenv(v);
    }
    void TearDown() override {
        for (const char* v : kVariables) ::unsetenv(v);
    }
    test::TempDir dir_;
};

TEST_F(Systemd, NotifyOutsideSystemdSaysSoAndSendsNothing) {
    auto r = notify("READY=1");
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_FALSE(*r);
}

TEST_F(Systemd, NotifySendsOneDatagramToAPathSocket) {
    const std::string path = dir_.file("notify");
    UniqueFd s = bind_datagram(path);
    ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
    const std::string state = "READY=1\nSTATUS=running: lock cap 64 MiB";
    auto r = notify(state);
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_TRUE(*r);
    EXPECT_EQ(receive(s.get()), state);
    ASSERT_TRUE(notify("STOPPING=1"));
    EXPECT_EQ(receive(s.get()), "STOPPING=1");
}

TEST_F(Systemd, NotifyReachesAnAbstractAddress) {
    const std::string name = "@moecache-test-notify-" + std::to_string(::getpid());
    UniqueFd s = bind_datagram(name);
    ::setenv("NOTIFY_SOCKET", name.c_str(), 1);
    auto r = notify("WATCHDOG=1");
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_TRUE(*r);
    EXPECT_EQ(receive(s.get()), "WATCHDOG=1");
}

TEST_F(Systemd, NotifyErrorsNameTheSocketAndWhy) {
    const std::string missing = dir_.file("no-such-socket");
    ::setenv("NOTIFY_SOCKET", missing.c_str(), 1);
    auto r = notify("READY=1");
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().errnum, ENOENT);
    EXPECT_NE(r.error().what().find(missing), std::string::npos) << r.error().what();
    EXPECT_NE(r.error().what().find("READY=1"), std::string::npos) << r.error().what();

    ::setenv("NOTIFY_SOCKET", "relative/notify", 1);
    r = notify("READY=1");
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().what().find("relative/notify"), std::string::npos) << r.error().what();
    ::setenv("NOTIFY_SOCKET", ("/" + std::string(200, 'x')).c_str(), 1);
    EXPECT_FALSE(notify("READY=1"));
}

TEST_F(Systemd, MonotonicUsecIsNowOnTheMonotonicClock) {
    timespec before{}, after{};
    ::clock_gettime(CLOCK_MONOTONIC, &before);
    const std::string s = monotonic_usec();
    ::clock_gettime(CLOCK_MONOTONIC, &after);
    ASSERT_EQ(s.rfind("MONOTONIC_USEC=", 0), 0u) << s;
    const uint64_t us = std::stoull(s.substr(15));
    EXPECT_GE(us, static_cast<uint64_t>(before.tv_sec) * 1000000 + static_cast<uint64_t>(before.tv_nsec) / 1000);
    EXPECT_LE(us, static_cast<uint64_t>(after.tv_sec) * 1000000 + static_cast<uint64_t>(after.tv_nsec) / 1000);
}

TEST_F(Systemd, WatchdogIntervalFromTheEnvironment) {
    auto w = watchdog_interval();
    ASSERT_TRUE(w);
    EXPECT_FALSE(w->has_value());  // no watchdog

    ::setenv("WATCHDOG_USEC", "30000000", 1);
    w = watchdog_interval();
    ASSERT_TRUE(w && w->has_value());
    EXPECT_EQ(**w, std::chrono::seconds(30));

    ::setenv("WATCHDOG_PID", std::to_string(::getpid()).c_str(), 1);
    w = watchdog_interval();
    ASSERT_TRUE(w && w->has_value());
    EXPECT_EQ(**w, std::chrono::seconds(30));

    ::setenv("WATCHDOG_PID", std::to_string(::getpid() + 1).c_str(), 1);  // meant for another process
    w = watchdog_interval();
    ASSERT_TRUE(w);
    EXPECT_FALSE(w->has_value());

    ::unsetenv("WATCHDOG_PID");
    for (const char* bad : {"", "0", "30s", "-1", "99999999999999999999"}) {
        ::setenv("WATCHDOG_USEC", bad, 1);
        w = watchdog_interval();
        ASSERT_FALSE(w) << "'" << bad << "'";
        EXPECT_NE(w.error().what().find("WATCHDOG_USEC"), std::string::npos) << w.error().what();
    }
    ::setenv("WATCHDOG_USEC", "1000000", 1);
    ::setenv("WATCHDOG_PID", "me", 1);
    EXPECT_FALSE(watchdog_interval());
}

TEST_F(Systemd, WatchdogPingsAtMostFourTimesPerInterval) {
    const std::string path = dir_.file("notify");
    UniqueFd s = bind_datagram(path);
    ::setenv("NOTIFY_SOCKET", path.c_str(), 1);

    Watchdog off;
    EXPECT_FALSE(off.enabled());
    EXPECT_EQ(off.due_in_ms(), -1);
    ASSERT_TRUE(off.ping());
    EXPECT_FALSE(*off.ping());

    ::setenv("WATCHDOG_USEC", "400000", 1);
    auto w = Watchdog::from_environment();
    ASSERT_TRUE(w) << w.error().what();
    ASSERT_TRUE(w->enabled());
    EXPECT_EQ(w->interval(), std::chrono::milliseconds(400));
    EXPECT_EQ(w->due_in_ms(), 0);  // never pinged: due now
    auto r = w->ping();
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_TRUE(*r);
    EXPECT_EQ(receive(s.get()), "WATCHDOG=1");
    EXPECT_FALSE(*w->ping());  // too soon: nothing sent
    EXPECT_EQ(receive(s.get(), 50), "");
    const int due = w->due_in_ms();
    EXPECT_GT(due, 0);
    EXPECT_LE(due, 100);
    std::this_thread::sleep_for(std::chrono::milliseconds(due + 5));
    EXPECT_EQ(w->due_in_ms(), 0);
    EXPECT_TRUE(*w->ping());
    EXPECT_EQ(receive(s.get()), "WATCHDOG=1");

    ::setenv("WATCHDOG_USEC", "nonsense", 1);
    EXPECT_FALSE(Watchdog::from_environment());
}

// Runs `body` in a child process whose descriptors from 3 on are `fds` (as systemd leaves them
// for the service it starts); the child's exit status says whether body's checks held, and what it
// writes to its stderr says which did not.
void in_child(const std::vector<int>& fds, const std::function<std::string()>& body) {
    int report[2];
    ASSERT_EQ(::pipe2(report, O_CLOEXEC), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
        // Up out of the way first, then down to 3, 4, ...: an fd may already sit where another goes.
        const int out = ::fcntl(report[1], F_DUPFD_CLOEXEC, 100);
        std::vector<int> high;
        for (int fd : fds) high.push_back(::fcntl(fd, F_DUPFD_CLOEXEC, 100));
        for (size_t i = 0; i < high.size(); ++i) ::dup2(high[i], 3 + static_cast<int>(i));  // clears CLOEXEC
        const std::string failure = body();
        if (!failure.empty()) (void)!::write(out, failure.data(), failure.size());
        ::_exit(failure.empty() ? 0 : 1);
    }
    ::close(report[1]);
    std::string failure;
    char buf[512];
    for (ssize_t n; (n = ::read(report[0], buf, sizeof buf)) > 0;) failure.append(buf, static_cast<size_t>(n));
    ::close(report[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << failure;
}

void set_listen_environment(pid_t pid, const char* count, const char* names) {
    ::setenv("LISTEN_PID", std::to_string(pid).c_str(), 1);
    ::setenv("LISTEN_FDS", count, 1);
    if (names) ::setenv("LISTEN_FDNAMES", names, 1);
}

std::string environment_left() {
    std::string left;
    for (const char* v : {"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"})
        if (std::getenv(v)) left += std::string(v) + " still set; ";
    return left;
}

TEST_F(Systemd, ListenFdsTakesThePassedDescriptorsOnce) {
    const std::string path = dir_.file("listening");
    UniqueFd listening(::socket(AF_UNIX, SOCK_SEQPACKET, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    ASSERT_EQ(::bind(listening.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::listen(listening.get(), 8), 0);
    int pipe_fds[2];
    ASSERT_EQ(::pipe(pipe_fds), 0);
    UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);

    in_child({listening.get(), pipe_read.get()}, [] {
        set_listen_environment(::getpid(), "2", "client:other");
        auto r = listen_fds();
        if (!r) return "listen_fds: " + r.error().what();
        std::string f = environment_left();
        if (r->size() != 2) return f + "got " + std::to_string(r->size()) + " descriptors, want 2";
        if ((*r)[0].fd.get() != 3 || (*r)[1].fd.get() != 4) f += "not fds 3 and 4; ";
        if ((*r)[0].name != "client" || (*r)[1].name != "other")
            f += "names '" + (*r)[0].name + "', '" + (*r)[1].name + "'; ";
        for (const auto& p : *r)
            if (!(::fcntl(p.fd.get(), F_GETFD) & FD_CLOEXEC)) f += "fd " + std::to_string(p.fd.get()) + " not CLOEXEC; ";
        int accepting = 0;
        socklen_t len = sizeof accepting;
        ::getsockopt((*r)[0].fd.get(), SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len);
        if (accepting != 1) f += "fd 3 is not the listening socket; ";
        auto again = listen_fds();  // taken once: the variables are gone
        if (!again || !again->empty()) f += "a second call found descriptors again; ";
        return f;
    });
}

TEST_F(Systemd, ListenFdsIgnoresDescriptorsMeantForAnotherProcess) {
    int pipe_fds[2];
    ASSERT_EQ(::pipe(pipe_fds), 0);
    UniqueFd r0(pipe_fds[0]), w0(pipe_fds[1]);
    in_child({r0.get()}, [] {
        set_listen_environment(::getppid(), "1", "client");  // the parent's, not ours
        auto r = listen_fds();
        if (!r) return "listen_fds: " + r.error().what();
        std::string f = environment_left();
        if (!r->empty()) f += "took descriptors meant for another process; ";
        if (::fcntl(3, F_GETFD) < 0) f += "closed fd 3, which was not its to take; ";
        return f;
    });
    in_child({}, [] {  // not activated at all
        auto r = listen_fds();
        if (!r) return "listen_fds: " + r.error().what();
        return r->empty() ? std::string() : std::string("found descriptors without LISTEN_PID");
    });
}

TEST_F(Systemd, ListenFdsWithoutNamesOrWithBadCounts) {
    int pipe_fds[2];
    ASSERT_EQ(::pipe(pipe_fds), 0);
    UniqueFd r0(pipe_fds[0]), w0(pipe_fds[1]);
    in_child({r0.get(), w0.get()}, [] {
        set_listen_environment(::getpid(), "2", "only-one-name");  // names that do not add up
        auto r = listen_fds();
        if (!r) return "listen_fds: " + r.error().what();
        if (r->size() != 2 || (*r)[0].name != "unknown" || (*r)[1].name != "unknown")
            return std::string("mismatched names were not ignored");
        return environment_left();
    });
    in_child({}, [] {
        set_listen_environment(::getpid(), "two", nullptr);
        auto r = listen_fds();
        std::string f = environment_left();
        if (r) return f + "LISTEN_FDS=two accepted";
        if (r.error().what().find("LISTEN_FDS") == std::string::npos) f += "error does not name LISTEN_FDS: " + r.error().what();
        return f;
    });
    in_child({}, [] {  // more than were passed: fd 3 is not open
        ::close(3);
        set_listen_environment(::getpid(), "1", nullptr);
        auto r = listen_fds();
        if (r) return std::string("a descriptor that is not open was taken");
        return r.error().errnum == EBADF ? std::string() : "errno " + std::to_string(r.error().errnum);
    });
}

}  // namespace
}  // namespace moecache::systemd
