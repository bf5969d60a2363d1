// libmoecache-client against the real moecached, as separate processes: 16 clients reporting as
// fast as their rings take (every event sent arrives; what did not fit is counted as overflow),
// and a daemon killed with SIGKILL mid-stream: the clients keep running, reconnect when it is
// back, and register their models again by themselves.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/socket.h>
#include <poll.h>
#include <unistd.h>

#include <thread>
#include <chrono>
#include <cstring>
#include <vector>
#include <iostream>
#include <memory>
#include <regex>

namespace moecache {
namespace {

class ClientRuntime : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: moecached mlocks";
        model_ = dir_.file("model.gguf");
        test::write_model(test::small_spec(), model_);
        test::write_file(dir_.file("moecached.toml"),
                         "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\nsocket = \"" + socket() +
                             "\"\n[budget]\nlock = \"64MiB\"\nreserve = \"1GiB\"\n[pressure]\nenabled = false\n"
                             "[telemetry]\npage_cache = \"off\"\n");
    }
    [[nodiscard]] std::string socket() const { return dir_.file("moecached.sock"); }
    std::unique_ptr<test::Background> daemon() {
        auto d = std::make_unique<test::Background>(
            std::vector<std::string>{MOECACHE_DAEMON_BIN, "--config", dir_.file("moecached.toml")});
        EXPECT_TRUE(d->wait_for("moecached running", 20)) << d->output();
        return d;
    }
    std::unique_ptr<test::Background> client(const std::string& name, double seconds, const std::string& rate = "0",
                                             const std::string& wait_ready = "10") {
        return std::make_unique<test::Background>(std::vector<std::string>{
            MOECACHE_CLIENT_DEMO_BIN, model_, "--socket", socket(), "--seconds", std::to_string(seconds), "--rate", rate,
            "--name", name, "--wait-ready", wait_ready});
    }
    static nlohmann::json stats(const test::Background& c) {
        const std::string& out = c.output();
        const auto at = out.rfind("{\"name\"");
        if (at == std::string::npos) return {};
        return nlohmann::json::parse(out.substr(at, out.find('\n', at) - at), nullptr, false);
    }
    // Events the daemon says it received from the client called `name`.
    static long long received(const std::string& log, const std::string& name) {
        std::smatch m;
        const std::regex re("client \\d+ \\(" + name + "\\) telemetry: (\\d+) events, (\\d+) refused");
        return std::regex_search(log, m, re) ? std::stoll(m[1]) : -1;
    }
    test::TempDir dir_;
    std::string model_;
};

TEST_F(ClientRuntime, SixteenClientsAtFullRateLoseOnlyWhatTheirRingsCountAsOverflow) {
    auto d = daemon();
    std::vector<std::unique_ptr<test::Background>> clients;
    for (int i = 0; i < 16; ++i) clients.push_back(client("c" + std::to_string(i), 3));
    double total = 0;
    for (int i = 0; i < 16; ++i) {
        ASSERT_EQ(clients[i]->wait(60), 0) << clients[i]->output();
        const auto s = stats(*clients[i]);
        ASSERT_TRUE(s.is_object()) << clients[i]->output();
        EXPECT_EQ(s["connects"].get<int>(), 1);
        EXPECT_EQ(s["reported"].get<long long>(),
                  s["sent"].get<long long>() + s["overflow"].get<long long>() + s["dropped"].get<long long>());
        total += s["sent"].get<double>() / s["seconds"].get<double>();
    }
    // The daemon reads each ring to the end when its client goes.
    for (int i = 0; i < 16; ++i) ASSERT_TRUE(d->wait_for("(c" + std::to_string(i) + ") telemetry:", 20)) << d->output();
    for (int i = 0; i < 16; ++i) {
        const auto s = stats(*clients[i]);
        EXPECT_EQ(received(d->output(), "c" + std::to_string(i)), s["sent"].get<long long>())
            << "client c" << i << ": received = sent (reported - overflow - dropped)";
    }
    std::cout << "[ measured ] 16 clients: " << static_cast<long long>(total) << " events/s received in total, "
              << static_cast<long long>(total / 16) << " per client\n";
    d->signal(SIGTERM);
    EXPECT_EQ(d->wait(20), 0);
}

TEST_F(ClientRuntime, ADaemonKilledMidStreamIsReconnectedAndTheModelRegisteredAgain) {
    auto d = daemon();
    auto c = client("survivor", 6, "20000");
    ASSERT_TRUE(d->wait_for("model " + model_ + " loaded", 20)) << d->output();
    ::usleep(500000);
    d->signal(SIGKILL);
    d->wait(10);
    ::usleep(800000);  // the client runs on without a daemon
    auto d2 = daemon();
    ASSERT_TRUE(d2->wait_for("model " + model_ + " loaded", 20)) << "the client registered its model again:\n"
                                                                   << d2->output();
    ASSERT_EQ(c->wait(60), 0) << c->output();
    const auto s = stats(*c);
    ASSERT_TRUE(s.is_object()) << c->output();
    EXPECT_EQ(s["connects"].get<int>(), 2) << c->output();
    EXPECT_EQ(s["connected"].get<int>(), 1);
    EXPECT_GT(s["dropped"].get<long long>(), 0) << "events while no daemon ran are counted as dropped";
    ASSERT_TRUE(d2->wait_for("(survivor) telemetry:", 20)) << d2->output();
    EXPECT_GT(received(d2->output(), "survivor"), 0) << d2->output();
    d2->signal(SIGTERM);
    EXPECT_EQ(d2->wait(20), 0);
}

TEST_F(ClientRuntime, WithoutADaemonTheClientRunsAndSaysSoOnce) {
    auto c = client("alone", 1, "10000", "0");
    ASSERT_EQ(c->wait(30), 0) << c->output();
    const auto s = stats(*c);
    ASSERT_TRUE(s.is_object()) << c->output();
    EXPECT_EQ(s["connects"].get<int>(), 0);
    EXPECT_EQ(s["sent"].get<long long>(), 0);
    EXPECT_EQ(s["dropped"].get<long long>(), s["reported"].get<long long>());
    const std::string& out = c->output();
    const auto first = out.find("no daemon at");
    ASSERT_NE(first, std::string::npos) << out;
    EXPECT_EQ(out.find("no daemon at", first + 1), std::string::npos) << "said more than once:\n" << out;
}

// Whoever can write the socket's directory could listen there in the daemon's place and be handed
// the runtime's model files (SCM_RIGHTS) and telemetry. The client checks the peer (SO_PEERCRED):
// root, the daemon's user (MOECACHE_DAEMON_USER, default moecached) or its own user; to anyone else
// it sends nothing, says so once, and keeps trying as if no daemon were there.
TEST_F(ClientRuntime, NothingIsSentToASocketHeldByAnotherUser) {
    constexpr uid_t kNobody = 65534;
    test::TempDir dir;
    ASSERT_EQ(chmod(dir.path().c_str(), 0777), 0);
    const std::string sock = dir.file("impostor.sock");
    int report[2];
    ASSERT_EQ(pipe(report), 0);
    const pid_t impostor = fork();
    ASSERT_GE(impostor, 0);
    if (impostor == 0) {  // listens as nobody; reports connections and bytes received, every 100 ms
        if (setgid(kNobody) != 0 || setuid(kNobody) != 0) _exit(2);
        const int l = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        strncpy(a.sun_path, sock.c_str(), sizeof a.sun_path - 1);
        if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 8) != 0) _exit(3);
        uint64_t counts[2] = {0, 0};  // connections, bytes
        std::vector<int> conns;
        for (int tick = 0; tick < 100; ++tick) {
            pollfd p{l, POLLIN, 0};
            while (poll(&p, 1, 0) > 0) {
                conns.push_back(accept(l, nullptr, nullptr));
                ++counts[0];
            }
            for (int c : conns) {
                char buf[4096];
                ssize_t n;
                while ((n = recv(c, buf, sizeof buf, MSG_DONTWAIT)) > 0) counts[1] += static_cast<uint64_t>(n);
            }
            if (write(report[1], counts, sizeof counts) != sizeof counts) _exit(4);
            usleep(100000);
        }
        _exit(0);
    }
    close(report[1]);
    auto seen = [&] {
        uint64_t counts[2] = {0, 0};
        pollfd p{report[0], POLLIN, 0};
        while (poll(&p, 1, 0) > 0 && read(report[0], counts, sizeof counts) == sizeof counts) {
        }
        return std::pair<uint64_t, uint64_t>{counts[0], counts[1]};
    };
    unsetenv("MOECACHE_DAEMON_USER");
    test::Background c({MOECACHE_CLIENT_DEMO_BIN, model_, "--socket", sock, "--seconds", "3", "--rate", "1000", "--name",
                        "victim", "--wait-ready", "2"});
    std::pair<uint64_t, uint64_t> got{0, 0};
    for (int i = 0; i < 30 && got.first == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        got = seen();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const auto after = seen();
    got = {std::max(got.first, after.first), std::max(got.second, after.second)};
    EXPECT_GT(got.first, 0u) << "the client reached the impostor's socket";
    EXPECT_EQ(got.second, 0u) << "not a byte to a peer of another user";
    EXPECT_EQ(c.wait(30), 0) << c.output();
    EXPECT_NE(c.output().find("is held by pid"), std::string::npos) << c.output();
    EXPECT_NE(c.output().find("of uid 65534, not root, user moecached"), std::string::npos) << c.output();
    kill(impostor, SIGTERM);
    waitpid(impostor, nullptr, 0);
    close(report[0]);
}

}  // namespace
}  // namespace moecache
