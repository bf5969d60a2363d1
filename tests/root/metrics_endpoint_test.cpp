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

    std::atomic<int> ok{0}, bad{0};
    std::vector<std::thread> scrapers;
    for (int t = 0; t < 40; ++t)
        scrapers.emplace_back([&] {
            for (int i = 0; i < 5; ++i) {
                httplib::Client c("127.0.0.1", port);
                auto r = c.Get("/metrics");
                if (r && r->status == 200 && r->body.find("moecache_clients ") != std::string::npos) ++ok;
                else ++bad;
            }
        });
    for (auto& t : scrapers) t.join();
    EXPECT_EQ(ok.load(), 200);
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
    test::write_file(dir.file("moecached.toml"),
                     "[daemon]\nstate_dir = \"" + dir.file("state") + "\"\nsocket = \"" + dir.file("moecached.sock") +
                         "\"\n[pressure]\nenabled = false\n[telemetry]\npage_cache = \"off\"\n[dbus]\nbus = \"off\"\n"
                         "[metrics]\nlisten = \"127.0.0.1:0\"\n");
    test::Background d({MOECACHE_DAEMON_BIN, "--config", dir.file("moecached.toml")});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    const int port = metrics_port(d);
    ASSERT_GT(port, 0) << d.output();
    auto status_kib = [&](const char* key) -> uint64_t {
        std::istringstream in(test::read_file("/proc/" + std::to_string(d.pid()) + "/status"));
        std::string line;
        while (std::getline(in, line))
            if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::strlen(key)));
        return 0;
    };
    auto fds = [&] {
        size_t n = 0;
        for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(d.pid()) + "/fd")) ++n;
        return n;
    };
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

}  // namespace
}  // namespace moecache
