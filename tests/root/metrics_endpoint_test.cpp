// GET /metrics of the real moecached: a model registered by a client under a file name with a
// quote, a newline and a byte that is not UTF-8; telemetry flowing from that client; 40 parallel
// scrapers all answered; promtool accepts a live scrape.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/unique_fd.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <regex>
#include <thread>

namespace moecache {
namespace {

// A daemon with /metrics on a free loopback port and nothing else to do (its configuration in dir).
std::vector<std::string> metrics_only_daemon(const test::TempDir& dir) {
    test::write_file(dir.file("moecached.toml"),
                     "[daemon]\nstate_dir = \"" + dir.file("state") + "\"\nsocket = \"" + dir.file("moecached.sock") +
                         "\"\n[pressure]\nenabled = false\n[telemetry]\npage_cache = \"off\"\n[dbus]\nbus = \"off\"\n"
                         "[metrics]\nlisten = \"127.0.0.1:0\"\n");
    return {MOECACHE_DAEMON_BIN, "--config", dir.file("moecached.toml")};
}

// A "KEY: N kB" line of /proc/PID/status, in KiB (0 when absent).
uint64_t proc_status_kib(pid_t pid, const char* key) {
    std::istringstream in(test::read_file("/proc/" + std::to_string(pid) + "/status"));
    std::string line;
    while (std::getline(in, line))
        if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::strlen(key)));
    return 0;
}

// The port a daemon started with [metrics] listen = "127.0.0.1:0" says it took; 0 when it said none.
int metrics_port(const test::Background& d) {
    std::smatch m;
    const std::string out = d.output();
    return std::regex_search(out, m, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics")) ? std::stoi(m[1]) : 0;
}

TEST(MetricsEndpoint, LiveScrapesOfAHostileModelNameWhileTelemetryFlows) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: moecached mlocks";
    test::TempDir dir;
    const std::string model = dir.file("we\"ird\nna\xffme.gguf");
    test::write_model(test::small_spec(), model);
    test::write_file(dir.file("moecached.toml"),
                     "[daemon]\nstate_dir = \"" + dir.file("state") + "\"\nsocket = \"" + dir.file("moecached.sock") +
                         "\"\ntick_seconds = 0.1\n[budget]\nlock = \"64MiB\"\nreserve = \"1GiB\"\n[pressure]\nenabled = "
                         "false\n[telemetry]\npage_cache = \"off\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n");
    test::Background d({MOECACHE_DAEMON_BIN, "--config", dir.file("moecached.toml")});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    const int port = metrics_port(d);
    ASSERT_GT(port, 0) << d.output();

    test::Background client({MOECACHE_CLIENT_DEMO_BIN, model, "--socket", dir.file("moecached.sock"), "--seconds", "6",
                             "--rate", "0", "--name", "load", "--wait-ready", "10"});
    // The file label, escaped (the model label is the file's general.name).
    const std::string label = "/we\\\"ird\\nna\xef\xbf\xbdme.gguf\"";
    std::string body;
    for (int i = 0; i < 100 && body.find(label) == std::string::npos; ++i) {
        httplib::Client c("127.0.0.1", port);
        if (auto r = c.Get("/metrics"); r && r->status == 200) body = r->body;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_NE(body.find(label), std::string::npos) << "the registered model never showed up:\n" << body;

    // 40 scrapers at once from one address: past MetricsServer::kMaxPerAddress a scrape is told 503
    // (try again) at once; every one gets its full answer in the end, none a broken one.
    std::atomic<int> ok{0}, bad{0}, busy{0};
    std::vector<std::thread> scrapers;
    for (int t = 0; t < 40; ++t)
        scrapers.emplace_back([&] {
            for (int i = 0; i < 5; ++i)
                for (int attempt = 0; attempt < 200; ++attempt) {
                    httplib::Client c("127.0.0.1", port);
                    auto r = c.Get("/metrics");
                    if (r && r->status == 503) {
                        ++busy;
                        std::this_thread::sleep_for(std::chrono::milliseconds(10));
                        continue;
                    }
                    if (r && r->status == 200 && r->body.find("moecache_clients ") != std::string::npos) ++ok;
                    else ++bad;
                    break;
                }
        });
    for (auto& t : scrapers) t.join();
    EXPECT_EQ(ok.load(), 200) << busy.load() << " told to try again";
    EXPECT_EQ(bad.load(), 0);

    test::write_file(dir.file("scrape.txt"), body);
    const auto check = test::run({"/bin/sh", "-c", "promtool check metrics < '" + dir.file("scrape.txt") + "'"});
    EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
    EXPECT_EQ(client.wait(30), 0) << client.output();
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0);
}

// Hostile HTTP clients: bodies of 64 MiB and hundreds of connections that send nothing. The
// daemon neither grows (a body is refused before it is read) nor runs out of descriptors (the
// server's connections are bounded), and it answers again once they are gone.
TEST(MetricsEndpoint, LargeBodiesAndIdleConnectionsAreBounded) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: moecached mlocks";
    test::TempDir dir;
    test::Background d(metrics_only_daemon(dir));
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    const int port = metrics_port(d);
    ASSERT_GT(port, 0) << d.output();
    auto status_kib = [&](const char* key) { return proc_status_kib(d.pid(), key); };
    auto fds = [&] {
        size_t n = 0;
        for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(d.pid()) + "/fd")) ++n;
        return n;
    };
    signal(SIGPIPE, SIG_IGN);  // the server closes on a body it will not read
    const uint64_t rss_before = status_kib("VmRSS:");
    const std::string body(64u << 20, 'x');
    for (int i = 0; i < 8; ++i) {
        httplib::Client c("127.0.0.1", port);
        c.set_read_timeout(5, 0);
        const auto r = c.Post("/metrics", body, "application/octet-stream");
        if (r) {
            EXPECT_EQ(r->status, 413);
        }
    }
    EXPECT_LT(status_kib("VmRSS:"), rss_before + 64 * 1024) << "the daemon grew by a body's size";
    // 300 connections that send nothing.
    const size_t fds_before = fds();
    std::vector<UniqueFd> idle;
    for (int i = 0; i < 300; ++i) {
        // Not waiting on a full backlog: the server takes them as fast as it will.
        const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(static_cast<uint16_t>(port));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 || errno == EINPROGRESS) idle.emplace_back(s);
        else ::close(s);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const size_t fds_during = fds();
    EXPECT_LT(fds_during, fds_before + 64) << "each idle connection holds a descriptor of the daemon's";
    idle.clear();
    // Gone: it answers again.
    bool answered = false;
    for (int i = 0; i < 40 && !answered; ++i) {
        httplib::Client c("127.0.0.1", port);
        const auto r = c.Get("/metrics");
        answered = r && r->status == 200;
        if (!answered) std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    EXPECT_TRUE(answered);
}

// A connection to the metrics port from `source` (a 127.0.0.0/8 address of its own, so that
// connections from different "peers" are counted apart), non-blocking; -1 when it cannot.
int connect_from(const char* source, int port) {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in from{}, to{};
    from.sin_family = to.sin_family = AF_INET;
    inet_pton(AF_INET, source, &from.sin_addr);
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(s, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
        ::connect(s, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
        ::close(s);
        return -1;
    }
    return s;
}

// Sends `request`, reads the answer until the server closes (at most `seconds`); "" on a failure.
std::string exchange(int s, const std::string& request, double seconds) {
    if (::send(s, request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size())) return "";
    timeval tv{static_cast<time_t>(seconds), static_cast<suseconds_t>((seconds - static_cast<time_t>(seconds)) * 1e6)};
    ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::string out;
    char buf[65536];
    for (ssize_t n; (n = ::recv(s, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
    return out;
}

// What a pod that reaches the port can do (issue 38, rows 6 and 7): a body of any method, announced
// by length or sent in chunks, is refused unread; 40 connections that trickle a byte every 1.5 s
// (slowloris) are cut off at the request deadline and hold at most a few descriptors from their
// address, while another address's /health and /metrics are answered at once throughout.
TEST(MetricsEndpoint, BodiesOfAnyKindAndSlowPeersAreCutOffAndHealthAnswers) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: moecached mlocks";
    signal(SIGPIPE, SIG_IGN);
    test::TempDir dir;
    test::Background d(metrics_only_daemon(dir));
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    const int port = metrics_port(d);
    ASSERT_GT(port, 0) << d.output();
    auto rss_kib = [&] { return proc_status_kib(d.pid(), "VmRSS:"); };
    const auto rss_before = rss_kib();
    // A GET with a body, a chunked POST, a HEAD announcing a gigabyte: 413, nothing read.
    const std::string chunk = "100000\r\n" + std::string(1 << 20, 'x') + "\r\n";
    for (const std::string head : {"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n",
                                   "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                                   "HEAD /health HTTP/1.1\r\nHost: x\r\ncontent-length: 5\r\n\r\n"}) {
        const int s = connect_from("127.0.0.3", port);
        ASSERT_GE(s, 0);
        std::string sent = head;
        for (int i = 0; i < 64 && head.find("chunked") != std::string::npos; ++i) sent += chunk;  // 64 MiB of chunks
        std::thread writer([&] { (void)::send(s, sent.data(), sent.size(), MSG_NOSIGNAL); });
        std::string got;
        char buf[4096];
        timeval tv{5, 0};
        ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        for (ssize_t n; (n = ::recv(s, buf, sizeof buf, 0)) > 0;) got.append(buf, static_cast<size_t>(n));
        ::shutdown(s, SHUT_RDWR);
        writer.join();
        ::close(s);
        EXPECT_EQ(got.rfind("HTTP/1.1 413 ", 0), 0u) << head << "\n" << got;
    }
    EXPECT_LT(rss_kib(), rss_before + 32 * 1024) << "a body was read";
    // Slowloris from 127.0.0.2: 40 connections, a byte of a request every 1.5 s.
    std::vector<int> slow;
    for (int i = 0; i < 40; ++i)
        if (const int s = connect_from("127.0.0.2", port); s >= 0) slow.push_back(s);
    std::atomic<bool> stop{false};
    std::thread trickle([&] {
        const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        for (size_t at = 0; !stop && at < request.size(); ++at) {
            for (int s : slow) (void)::send(s, &request[at], 1, MSG_NOSIGNAL | MSG_DONTWAIT);
            for (int i = 0; i < 15 && !stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    });
    const auto t0 = std::chrono::steady_clock::now();
    double slowest = 0;
    while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(8)) {
        for (const char* path : {"/health", "/metrics"}) {
            const int s = connect_from("127.0.0.4", port);
            ASSERT_GE(s, 0);
            const auto a = std::chrono::steady_clock::now();
            const std::string got = exchange(s, std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n", 5);
            slowest = std::max(slowest, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
            ::close(s);
            EXPECT_EQ(got.rfind("HTTP/1.1 200 OK", 0), 0u) << path << ": " << got.substr(0, 200);
            if (std::string(path) == "/health") {
                EXPECT_NE(got.find("\r\n\r\nok\n"), std::string::npos) << got;
            }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    EXPECT_LT(slowest, 1.0) << "seconds for an answer while the slow peers were connected";
    // The deadline (5 s) has passed for all of them: each was closed by the server.
    int closed = 0;
    for (int s : slow) {
        char buf[4096];
        ssize_t n;
        while ((n = ::recv(s, buf, sizeof buf, MSG_DONTWAIT)) > 0) {  // a 503 for those past the bound
        }
        if (n == 0) ++closed;
    }
    EXPECT_EQ(closed, static_cast<int>(slow.size())) << "connections past the request deadline are cut off";
    stop = true;
    trickle.join();
    for (int s : slow) ::close(s);
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0);
}

}  // namespace
}  // namespace moecache
