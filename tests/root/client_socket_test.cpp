// The client socket on real processes and descriptors: models registered by the descriptors a
// client hands over (configured and unconfigured, split sets), routing telemetry through a shared
// ring, and hostile input — wrong descriptors of every kind, wrong descriptor counts, oversized and
// truncated packets, wrong versions, clients that die or stop reading, a burst of 10 000
// connections: each gets its own clear error, no descriptor leaks in the daemon, others go on.
#include "daemon_fixture.h"
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/client.h"
#include "moecache/client/protocol.h"
#include "moecache/client/telemetry_ring.h"
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/heat.h"
#include "moecache/model.h"
#include "moecache/mkmodel/synth_model.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <atomic>
#include <thread>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <set>

namespace moecache::daemon {
namespace {

using namespace moecache::protocol;

size_t open_fds() {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n;
}

class ClientSocketTest : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: the daemon mlocks and loads BPF programs";
        model_ = dir_.file("model.gguf");
        test::write_model(test::small_spec(), model_);
    }

    void start(Config c) {
        auto d = Daemon::create(std::move(c));
        ASSERT_TRUE(d) << d.error().what();
        d_ = std::move(*d);
    }
    void start() {
        Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
        c.page_cache_telemetry = "off";
        start(c);
    }

    [[nodiscard]] UniqueFd connect() const {
        UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        const std::string path = d_->status().socket_path;
        std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
        EXPECT_EQ(::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
        return s;
    }

    static void send_raw(int s, const std::vector<uint8_t>& bytes, const std::vector<int>& fds = {}) {
        auto r = send_packet(s, bytes, fds);
        ASSERT_TRUE(r) << r.error().what();
    }

    // Turns the daemon's loop until the client has a packet (or the peer closed: nullopt).
    // The next message, less the VramPolicy the daemon sends unasked when what a model needs of
    // one place changes (kept in policies_), unless `policies`.
    std::optional<Message> reply(int s, double seconds = 10, bool policies = false) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        while (std::chrono::steady_clock::now() < end) {
            EXPECT_TRUE(d_->step(5));
            pollfd p{s, POLLIN, 0};
            if (::poll(&p, 1, 0) != 1) continue;
            auto m = take(s);  // readable and nothing: the peer closed
            if (!policies && m && m->request == 0 && std::holds_alternative<VramPolicy>(m->body)) {
                policies_.push_back(std::get<VramPolicy>(m->body));
                continue;
            }
            return m;
        }
        ADD_FAILURE() << "no reply within " << seconds << " s";
        return std::nullopt;
    }

    // A packet the client has now, decoded (nullopt: none waiting, or the peer closed).
    static std::optional<Message> take(int s) {
        std::vector<uint8_t> buf(kMaxMessageBytes);
        const ssize_t n = ::recv(s, buf.data(), buf.size(), MSG_DONTWAIT);
        if (n <= 0) return std::nullopt;
        buf.resize(static_cast<size_t>(n));
        auto m = decode(buf, 0);
        EXPECT_TRUE(m) << m.error().what();
        return m ? std::optional<Message>(*m) : std::nullopt;
    }

    // The peer closed the connection (after whatever it sent).
    bool closed(int s, double seconds = 10) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        while (std::chrono::steady_clock::now() < end) {
            EXPECT_TRUE(d_->step(5));
            uint8_t b[kMaxMessageBytes];
            const ssize_t n = ::recv(s, b, sizeof b, MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
        }
        return false;
    }

    static std::string failure_text(const std::optional<Message>& m) {
        if (!m) return "(no reply)";
        if (const auto* f = std::get_if<Failure>(&m->body)) return f->text;
        return std::string("(not a Failure: ") + to_string(type_of(m->body)) + ")";
    }

    // Registers the test's model on `s` and a telemetry ring of 64 KiB: its id in `model`, the ring
    // in `ring` (use under ASSERT_NO_FATAL_FAILURE).
    void register_with_ring(int s, uint32_t& model, std::optional<telemetry::TelemetryRing>& ring,
                            uint32_t ring_bytes = 1u << 16) {
        UniqueFd f(::open(model_.c_str(), O_RDONLY | O_CLOEXEC));
        send_raw(s, encode({2, RegisterModel{1}}), {f.get()});
        auto r = reply(s);
        ASSERT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
        model = std::get<ModelRegistered>(r->body).model;
        auto made = telemetry::TelemetryRing::create(ring_bytes);
        ASSERT_TRUE(made) << made.error().what();
        ring.emplace(std::move(*made));
        send_raw(s, encode({3, TelemetrySetup{ring_bytes}}), {ring->fd()});
        r = reply(s);
        ASSERT_TRUE(r && std::holds_alternative<Ok>(r->body)) << failure_text(r);
    }

    UniqueFd hello(const std::string& name = "test") {
        UniqueFd s = connect();
        send_raw(s.get(), encode({1, Hello{1, 1, name}}));
        auto r = reply(s.get());
        EXPECT_TRUE(r && std::holds_alternative<HelloReply>(r->body)) << failure_text(r);
        // Then, unasked, what the daemon wants of a VRAM pool (here: no limit, one place).
        auto v = reply(s.get(), 10, /*policies=*/true);
        const auto* policy = v ? std::get_if<VramPolicy>(&v->body) : nullptr;
        EXPECT_TRUE(policy != nullptr) << failure_text(v);
        if (policy) {
            EXPECT_EQ(v->request, 0u);
            EXPECT_EQ(policy->pool_bytes, kNoPoolLimit);
            EXPECT_TRUE(policy->one_place);
        }
        return s;
    }

    // In a child process: a client of the daemon at `sock` that registered `model` and is ready;
    // the child exits (4, 5) where that fails. Returns the model's handle in `h`.
    static moecache_client* registered_client(const std::string& sock, const std::string& model, const char* name,
                                              uint32_t& h) {
        moecache_client* cl = moecache_client_open(sock.c_str(), name);
        if (!cl || moecache_client_register_model(cl, model.c_str(), &h) != 0) ::_exit(4);
        if (!moecache_client_wait_ready(cl, 10000)) ::_exit(5);
        return cl;
    }

    // ... that reported a VRAM pool of `pool_bytes` on device 0 (exits 6 where that fails).
    static moecache_client* pooled_client(const std::string& sock, const std::string& model, const char* name, uint32_t& h,
                                          uint64_t pool_bytes) {
        moecache_client* cl = registered_client(sock, model, name, h);
        const moecache_pool_stats stats{0, 0, 0, 0, pool_bytes};
        if (moecache_client_report_pool(cl, 0, &stats) != 0) ::_exit(6);
        return cl;
    }
    // Runs `body` in a child process as uid and gid `uid`, which then says so on a pipe and waits to
    // be killed; `ready` gets the pipe's (non-blocking) read end.
    static pid_t spawn_as(uint32_t uid, const std::function<void()>& body, int& ready) {
        int p[2];
        if (::pipe2(p, O_CLOEXEC) != 0) return -1;
        const pid_t pid = ::fork();
        if (pid == 0) {
            if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(3);
            body();
            (void)!::write(p[1], "x", 1);
            ::pause();
            ::_exit(0);
        }
        ::close(p[1]);
        (void)::fcntl(p[0], F_SETFL, O_NONBLOCK);
        ready = p[0];
        return pid;
    }
    // The model's mean routed expert, in bytes (a pool's size in experts); 0 where it cannot be read.
    uint64_t mean_expert_bytes() const {
        auto parts = open_gguf_model(model_);
        EXPECT_TRUE(parts);
        if (!parts) return 0;
        auto map = ExpertMap::build(*parts);
        EXPECT_TRUE(map);
        if (!map || map->layers.empty() || map->n_experts == 0) return 0;
        return map->expert_bytes_total / (uint64_t{map->layers.size()} * map->n_experts);
    }
    // Turns the daemon (it runs in this process) until the child of spawn_as is ready, or 20 s pass.
    bool until_ready(int ready) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        char x = 0;
        bool done = false;
        while (!done && std::chrono::steady_clock::now() < deadline) {
            EXPECT_TRUE(d_->step(10));
            done = ::read(ready, &x, 1) == 1;
        }
        ::close(ready);
        return done;
    }

    // until_ready, then the child killed and reaped: `ready` whether it said so, and its exit code
    // (-1 where it was killed, as it is once ready).
    int reap_when_ready(pid_t pid, int ready_fd, bool& ready) {
        ready = until_ready(ready_fd);
        ::kill(pid, SIGKILL);
        int status = 0;
        ::waitpid(pid, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }

    test::TempDir dir_;
    std::string model_;
    std::unique_ptr<Daemon> d_;
    std::vector<VramPolicy> policies_;  // sent unasked after Hello's
};

TEST_F(ClientSocketTest, AConfiguredModelIsRegisteredByItsDescriptor) {
    start();
    UniqueFd s = hello("llama-server");
    UniqueFd f(::open(model_.c_str(), O_RDONLY | O_CLOEXEC));
    send_raw(s.get(), encode({2, RegisterModel{1}}), {f.get()});
    auto r = reply(s.get());
    ASSERT_TRUE(r);
    ASSERT_TRUE(std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
    const auto reg = std::get<ModelRegistered>(r->body);
    EXPECT_EQ(r->request, 2u);
    EXPECT_EQ(reg.model, *d_->model_id(model_));
    EXPECT_EQ(reg.layers, 4u);
    EXPECT_EQ(reg.experts, 16u);
    EXPECT_EQ(reg.files, 1u);
    const auto st = d_->status();
    ASSERT_EQ(st.clients.size(), 1u);
    EXPECT_EQ(st.clients[0].name, "llama-server");
    EXPECT_EQ(st.clients[0].pid, static_cast<uint32_t>(::getpid()));
    EXPECT_EQ(st.clients[0].models, std::vector<uint32_t>{reg.model});
}

TEST_F(ClientSocketTest, MappingsAreCheckedAgainstTheModelsOfThatClient) {
    start();
    UniqueFd s = hello();
    const auto ask = [&](const DescribeMapping& d) {
        send_raw(s.get(), encode({5, d}));
        return reply(s.get());
    };
    EXPECT_NE(failure_text(ask({0, 0, 0x7f0000000000, 4096, 0})).find("not one this client registered"), std::string::npos);
    UniqueFd f(::open(model_.c_str(), O_RDONLY | O_CLOEXEC));
    send_raw(s.get(), encode({2, RegisterModel{1}}), {f.get()});
    auto r = reply(s.get());
    ASSERT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
    const uint32_t id = std::get<ModelRegistered>(r->body).model;
    const uint64_t size = std::filesystem::file_size(model_);
    EXPECT_NE(failure_text(ask({id, 1, 0x7f0000000000, 4096, 0})).find("there is no file 1"), std::string::npos);
    EXPECT_NE(failure_text(ask({id, 0, 0x7f0000000000, size, 4096})).find("runs past the end"), std::string::npos);
    r = ask({id, 0, 0x7f0000000000, size, 0});
    EXPECT_TRUE(r && std::holds_alternative<Ok>(r->body)) << failure_text(r);
    // A mapping is whole pages: the last one may run past the end of the file (llama.cpp's is).
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    r = ask({id, 0, 0x7f0000000000, (size + page - 1) / page * page, 0});
    EXPECT_TRUE(r && std::holds_alternative<Ok>(r->body)) << failure_text(r);
    EXPECT_NE(failure_text(ask({id, 0, 0x7f0000000000, (size + page - 1) / page * page + page, 0})).find("runs past the end"),
              std::string::npos);

    // Placements name an expert of one of its models; a bad one is answered and the client stays.
    const auto place = [&](const ExpertPlacement& p) {
        send_raw(s.get(), encode({0, p}));
        return reply(s.get());
    };
    EXPECT_NE(failure_text(place({999, 0, 0, 0})).find("not one this client registered"), std::string::npos);
    EXPECT_NE(failure_text(place({id, 999, 0, 0})).find("no routed expert 0 in block 999"), std::string::npos);
    EXPECT_NE(failure_text(place({id, 0, 9999, 0})).find("no routed expert 9999"), std::string::npos);
    send_raw(s.get(), encode({0, ExpertPlacement{id, 0, 1, 0}}));  // a good one has no reply
    r = ask({id, 0, 0x7f0000000000, size, 0});
    EXPECT_TRUE(r && std::holds_alternative<Ok>(r->body)) << failure_text(r);
    EXPECT_EQ(d_->status().models.front().experts_in_vram, 0u) << "counted before the client reported a pool";
    send_raw(s.get(), encode({0, PoolStats{0, 0, 0, 0, 0, 1u << 20}}));
    r = ask({id, 0, 0x7f0000000000, size, 0});
    EXPECT_TRUE(r && std::holds_alternative<Ok>(r->body)) << failure_text(r);
    EXPECT_EQ(d_->status().models.front().experts_in_vram, 1u) << "not counted once the pool was reported";
}

TEST_F(ClientSocketTest, AnUnconfiguredSplitModelLivesAsLongAsItsClient) {
    start();
    auto parts = test::write_model(test::small_spec(), dir_.file("split.gguf"), 3);
    std::vector<UniqueFd> fds;
    std::vector<int> raw;
    for (const auto& p : parts) {
        fds.emplace_back(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
        raw.push_back(fds.back().get());
    }
    {
        UniqueFd s = hello();
        send_raw(s.get(), encode({7, RegisterModel{3}}), raw);
        auto r = reply(s.get());
        ASSERT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
        EXPECT_EQ(std::get<ModelRegistered>(r->body).files, 3u);
        EXPECT_EQ(d_->status().models.size(), 2u);
        // The parts in the wrong order are not the same model.
        std::swap(raw[0], raw[1]);
        send_raw(s.get(), encode({8, RegisterModel{3}}), raw);
        r = reply(s.get());
        ASSERT_TRUE(r);
        EXPECT_TRUE(std::holds_alternative<Failure>(r->body));
    }
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(d_->status().models.size(), 1u) << "the registered model went with its client";
}

// A user swaps the name of the model they register with a FIFO and with a symlink to a file only
// root may read, again and again, while registering it: the daemon opens what the descriptor is,
// never the name, so it never blocks in open() and never reads (or quotes) the other file.
TEST_F(ClientSocketTest, NamesSwappedUnderARegistrationAreNeverOpened) {
    start();
    const std::string mine = dir_.file("mine.gguf"), fifo = dir_.file("fifo.gguf"), link = dir_.file("link.gguf"),
                      secret = dir_.file("secret");
    test::write_model(test::small_spec(), mine);
    test::write_file(secret, "SECRETSECRETSECRET");
    ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
    ASSERT_EQ(::symlink(secret.c_str(), link.c_str()), 0);
    UniqueFd model(::open(mine.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(model);
    std::atomic<bool> stop{false};
    std::thread swapper([&] {
        for (uint64_t i = 0; !stop.load(); ++i)
            (void)::syscall(SYS_renameat2, AT_FDCWD, mine.c_str(), AT_FDCWD, (i % 2 ? fifo : link).c_str(), 2 /* RENAME_EXCHANGE */);
    });
    ::alarm(300);  // a loop blocked in open() would never come back: die instead of hanging the run
    int registered = 0;
    for (int i = 0; i < 100; ++i) {
        UniqueFd s = hello();
        send_raw(s.get(), encode({2, RegisterModel{1}}), {model.get()});
        auto r = reply(s.get(), 5);
        ASSERT_TRUE(r) << "registration " << i << " got no reply";
        if (std::holds_alternative<ModelRegistered>(r->body)) ++registered;
        else EXPECT_EQ(failure_text(r).find("SECRET"), std::string::npos) << failure_text(r);
    }
    stop = true;
    swapper.join();
    ::alarm(0);
    // The names are where the swaps left them; registered by its descriptor, the model is the
    // model wherever its name is now.
    UniqueFd s = hello();
    send_raw(s.get(), encode({3, RegisterModel{1}}), {model.get()});
    auto r = reply(s.get());
    ASSERT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
    RecordProperty("registered_while_swapping", registered);
}

TEST_F(ClientSocketTest, DescriptorsThatAreNotReadableModelFilesAreRefusedOneByOne) {
    start();
    const size_t fds_before = open_fds();
    {
        UniqueFd s = hello();
        int pipefd[2];
        ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
        UniqueFd pr(pipefd[0]), pw(pipefd[1]);
        UniqueFd dir(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
        UniqueFd opath(::open(model_.c_str(), O_PATH | O_CLOEXEC));
        UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        UniqueFd wronly(::open(model_.c_str(), O_WRONLY | O_CLOEXEC));
        UniqueFd memfd(::memfd_create("not-a-model", MFD_CLOEXEC));
        ASSERT_EQ(::write(memfd.get(), "GGUF", 4), 4);
        const std::pair<int, std::string> cases[] = {
            {pr.get(), "a pipe"},       {dir.get(), "a directory"}, {opath.get(), "O_PATH"},
            {sock.get(), "a socket"},   {wronly.get(), "not open for reading"}, {memfd.get(), "no path the daemon can open that leads to it"},
        };
        for (const auto& [fd, want] : cases) {
            send_raw(s.get(), encode({3, RegisterModel{1}}), {fd});
            auto r = reply(s.get());
            EXPECT_NE(failure_text(r).find(want), std::string::npos) << want << ": " << failure_text(r);
        }
        // Still connected, and a good request still works.
        UniqueFd f(::open(model_.c_str(), O_RDONLY | O_CLOEXEC));
        send_raw(s.get(), encode({4, RegisterModel{1}}), {f.get()});
        auto r = reply(s.get());
        EXPECT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
    }
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(open_fds(), fds_before) << "descriptors leaked";
}

TEST_F(ClientSocketTest, WrongDescriptorCountsAndBrokenPacketsCloseThatClientOnly) {
    start();
    UniqueFd bystander = hello("bystander");
    UniqueFd f(::open(model_.c_str(), O_RDONLY | O_CLOEXEC));
    const size_t fds_before = open_fds();
    struct Case {
        std::vector<uint8_t> bytes;
        size_t fds;
        std::string want;
    };
    auto hello_v = [](uint16_t lo, uint16_t hi) { return encode({1, Hello{lo, hi, "x"}}); };
    std::vector<uint8_t> oversized(kMaxMessageBytes + 100, 0);
    const Case cases[] = {
        {encode({2, RegisterModel{1}}), 0, "came with 0 descriptor(s); it takes 1"},
        {encode({2, RegisterModel{1}}), 253, "more descriptors than any message takes"},
        {hello_v(1, 1), 1, "Hello message came with 1"},
        {oversized, 0, "longer than the 4096 bytes"},
        {std::vector<uint8_t>(10, 0x4d), 0, "shorter than the 16-byte header"},
        {hello_v(2, 3), 0, "speaks protocol version 1; the client asks for 2 to 3"},
        {encode({2, Ok{}}), 0, "Ok before Hello"},
    };
    for (const auto& c : cases) {
        UniqueFd s = connect();
        std::vector<int> fds(c.fds, f.get());
        send_raw(s.get(), c.bytes, fds);
        auto r = reply(s.get());
        EXPECT_NE(failure_text(r).find(c.want), std::string::npos) << c.want << ": " << failure_text(r);
        EXPECT_TRUE(closed(s.get())) << c.want;
    }
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(open_fds(), fds_before) << "descriptors leaked";
    // The bystander never noticed.
    send_raw(bystander.get(), encode({9, Goodbye{}}));
    auto r = reply(bystander.get());
    EXPECT_TRUE(r && std::holds_alternative<Ok>(r->body)) << failure_text(r);
}

TEST_F(ClientSocketTest, ClientsThatDieOrStopReadingAreDroppedAndABurstOfConnectionsLeaksNothing) {
    start();
    const size_t fds_before = open_fds();
    // A child that says Hello and is killed.
    const pid_t child = ::fork();
    if (child == 0) {
        UniqueFd s = connect();
        send_raw(s.get(), encode({1, Hello{1, 1, "doomed"}}));
        ::pause();
        ::_exit(0);
    }
    for (int i = 0; i < 200 && d_->status().clients.empty(); ++i) ASSERT_TRUE(d_->step(5));
    ASSERT_EQ(d_->status().clients.size(), 1u);
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    for (int i = 0; i < 200 && !d_->status().clients.empty(); ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_TRUE(d_->status().clients.empty());

    // A client that sends requests and never reads the replies: dropped once what waits for it in
    // the daemon (its socket full) is more than a slow reader could ever need.
    UniqueFd deaf = hello("deaf");
    for (int i = 0; i < 40000; ++i) {
        const auto b = encode({static_cast<uint32_t>(i), DescribeMapping{999, 0, 4096, 4096, 0}});
        if (::send(deaf.get(), b.data(), b.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) break;
        if (i % 50 == 0) {
            ASSERT_TRUE(d_->step(0));
        }
    }
    for (int i = 0; i < 400; ++i) ASSERT_TRUE(d_->step(1));
    bool deaf_gone = true;
    for (const auto& c : d_->status().clients) deaf_gone = deaf_gone && c.name != "deaf";
    EXPECT_TRUE(deaf_gone);
    deaf.reset();

    // 10 000 connections in a burst from another process, each closed at once.
    const pid_t burst = ::fork();
    if (burst == 0) {
        for (int i = 0; i < 10000; ++i) {
            UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
            sockaddr_un a{};
            a.sun_family = AF_UNIX;
            const std::string path = dir_.file("state") + "/moecached.sock";
            std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
            (void)::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
        }
        ::_exit(0);
    }
    int status = 0;
    while (::waitpid(burst, &status, WNOHANG) == 0) ASSERT_TRUE(d_->step(1));
    for (int i = 0; i < 100; ++i) ASSERT_TRUE(d_->step(1));
    EXPECT_TRUE(d_->status().clients.empty());
    EXPECT_EQ(open_fds(), fds_before) << "descriptors leaked";
    UniqueFd after = hello("after the burst");
    EXPECT_EQ(d_->status().clients.size(), 1u);
}

// A client that reads more slowly than the daemon answers (a CUDA hook polls its directives: a
// pool's first Locks and Promotes are thousands at once) loses nothing: what its socket has no
// room for waits in the daemon and goes out, in order, as it reads. (It was dropped on EAGAIN.)
TEST_F(ClientSocketTest, ASlowReaderGetsEveryMessageInOrder) {
    start();
    UniqueFd s = hello("slow");
    constexpr uint32_t kRequests = 6000;  // the replies fill its socket many times over
    uint32_t sent = 0;
    while (sent < kRequests) {
        const auto b = encode({100 + sent, DescribeMapping{999, 0, 4096, 4096, 0}});
        if (::send(s.get(), b.data(), b.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
            ASSERT_EQ(errno, EAGAIN) << std::strerror(errno);
            ASSERT_TRUE(d_->step(1));
            continue;
        }
        if (++sent % 64 == 0) {
            ASSERT_TRUE(d_->step(0));
        }
    }
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(d_->step(1));
    ASSERT_EQ(d_->status().clients.size(), 1u) << "the slow reader was dropped";
    // Now it reads, a little at a time, while the daemon goes on.
    uint32_t next = 100, got = 0;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (got < kRequests && std::chrono::steady_clock::now() < end) {
        ASSERT_TRUE(d_->step(0));
        for (int k = 0; k < 32; ++k) {
            const auto m = take(s.get());
            if (!m) break;
            ASSERT_TRUE(std::holds_alternative<Failure>(m->body));
            ASSERT_EQ(m->request, next) << "a reply out of order or lost";
            ++next;
            ++got;
        }
    }
    EXPECT_EQ(got, kRequests);
    EXPECT_EQ(d_->status().clients.size(), 1u);
}

// Rings are read fairly and within a budget a turn, all clients together: 16 full rings of 8 MiB
// (each could take 2^16 records a turn: 16 held the loop ~1 s a turn) give each client an even
// share each turn, none left out, and are all read over the turns that follow.
TEST_F(ClientSocketTest, FullRingsAreReadFairlyWithinABudgetATurn) {
    start();
    constexpr int kClients = 16;
    std::vector<UniqueFd> conns;
    std::vector<std::optional<telemetry::TelemetryRing>> rings(kClients);
    uint32_t model = 0;
    for (int i = 0; i < kClients; ++i) {
        conns.push_back(hello("ring-" + std::to_string(i)));
        ASSERT_NO_FATAL_FAILURE(register_with_ring(conns.back().get(), model, rings[i], 8u << 20));
    }
    uint64_t pushed = 0;
    for (auto& ring : rings) {
        telemetry::RoutingEvent e;
        e.model = model;
        e.tokens = 1;
        e.n_experts = 2;
        e.experts[0] = 3;
        e.experts[1] = 5;
        for (uint32_t i = 0; ring->push(e); ++i) e.block = static_cast<uint16_t>(i % 4);
        pushed += ring->counters().pushed;
    }
    ASSERT_GE(pushed, 16u * 65536u) << "the rings hold sixteen turns' budgets";
    auto events = [&] {
        std::map<std::string, uint64_t> by;
        for (const auto& c : d_->status().clients) by[c.name] = c.events;
        return by;
    };
    ASSERT_TRUE(d_->step(0));
    const auto first = events();
    uint64_t total = 0, least = UINT64_MAX, most = 0;
    for (const auto& [name, n] : first) {
        total += n;
        least = std::min(least, n);
        most = std::max(most, n);
    }
    EXPECT_LE(total, 65536u + 16u) << "one turn's budget, all clients together";
    EXPECT_GT(least, 0u) << "no client left out";
    EXPECT_LE(most, 2 * least) << "an even share";
    for (int i = 0; i < 2000; ++i) {
        total = 0;
        for (const auto& [name, n] : events()) total += n;
        if (total >= pushed) break;
        ASSERT_TRUE(d_->step(0));
    }
    EXPECT_EQ(total, pushed) << "every record read over the turns that follow";
}

// Issue 38, row 1: any local user who can read an operator's model (0644) could register it and
// report routing whose temporal locality the split learner read as "recency pays", cutting the
// model's lock cap to nothing. Well-formed records cannot be told from a runtime's, so what one
// user alone reports about a model it may not steer (an operator's, another user's) moves no cap:
// the learnt share applies again once root, the admin group or the model's owner reports, or
// several users do.
TEST_F(ClientSocketTest, OneUsersRoutingCannotCutTheLocksOfAModelItMayNotSteer) {
    Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
    c.page_cache_telemetry = "off";
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);  // so that other uids reach the socket and the model
    ASSERT_EQ(::chmod(model_.c_str(), 0644), 0);
    start(c);
    const std::string sock = d_->status().socket_path;
    const std::string model = model_;
    auto reporter = [&](uint32_t uid) {
        int ready = -1;
        const pid_t pid = spawn_as(uid, [sock, model] {
            uint32_t h = 0;
            moecache_client* cl = registered_client(sock, model, "reporter", h);
            const uint32_t experts[2] = {3, 5};  // the same two every token: perfect reuse
            for (int t = 0; t < 64; ++t)
                for (uint32_t b = 0; b < 4; ++b) (void)moecache_client_report(cl, h, b, experts, 2, 1);
        }, ready);
        EXPECT_GT(pid, 0);
        EXPECT_TRUE(until_ready(ready));
        for (int i = 0; i < 20; ++i) EXPECT_TRUE(d_->step(5));  // its ring read
        return pid;
    };
    auto applied = [&] {
        const auto st = d_->status();
        EXPECT_EQ(st.models.size(), 1u);
        return !st.models.empty() && st.models[0].recency_applied;
    };
    EXPECT_TRUE(applied()) << "no client reports: the page cache's uses, which the kernel reports";
    const pid_t one = reporter(65534);
    EXPECT_FALSE(applied()) << "one user that may not steer the operator's model cut its cap";
    const pid_t two = reporter(65533);
    EXPECT_TRUE(applied()) << "two users report the same model";
    for (pid_t p : {one, two}) {
        ::kill(p, SIGKILL);
        ::waitpid(p, nullptr, 0);
    }
    d_.reset();
    start(c);  // a new daemon: nobody has reported yet
    const pid_t root = reporter(0);
    EXPECT_TRUE(applied()) << "root steers every model";
    ::kill(root, SIGKILL);
    ::waitpid(root, nullptr, 0);
}

TEST_F(ClientSocketTest, RoutingTelemetryThroughTheRingFeedsHeat) {
    start();
    UniqueFd s = hello();
    uint32_t model = 0;
    std::optional<telemetry::TelemetryRing> ring;
    ASSERT_NO_FATAL_FAILURE(register_with_ring(s.get(), model, ring));
    // 300 tokens routed to experts 3 and 5 of every block; and hostile records: another model, a
    // block with no experts, an expert past the end.
    for (int t = 0; t < 300; ++t)
        for (uint16_t b = 0; b < 4; ++b) {
            telemetry::RoutingEvent e;
            e.model = model;
            e.block = b;
            e.tokens = 1;
            e.n_experts = 2;
            e.experts[0] = 3;
            e.experts[1] = 5;
            ASSERT_TRUE(ring->push(e));
            if (ring->counters().pushed % 512 == 0) {
                ASSERT_TRUE(d_->step(0));
            }
        }
    telemetry::RoutingEvent bad;
    bad.model = model + 77;
    ring->push(bad);
    bad.model = model;
    bad.block = 60;
    ring->push(bad);
    bad.block = 0;
    bad.n_experts = 1;
    bad.experts[0] = 16;
    ring->push(bad);
    // One expert named twice: a router picks an expert once (22 times over, read as perfect reuse,
    // it turned the recency split up and released every lock).
    bad.n_experts = 3;
    bad.experts[0] = 3;
    bad.experts[1] = 5;
    bad.experts[2] = 3;
    ring->push(bad);
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(2));
    const auto st = d_->status();
    ASSERT_EQ(st.clients.size(), 1u);
    EXPECT_EQ(st.clients[0].events, 1200u);
    EXPECT_EQ(st.clients[0].bad_events, 4u);
    EXPECT_EQ(st.clients[0].overflow, 0u);
    for (const auto& e : st.models[0].experts) EXPECT_EQ(e.uses, (e.expert == 3 || e.expert == 5) ? 300u : 0u);

    // The hot experts are locked, and the client is told so: a Lock directive for each of them.
    for (int i = 0; i < 100; ++i) {
        d_->tick();
        ASSERT_TRUE(d_->step(5));
        if (d_->idle()) break;
    }
    std::set<std::pair<uint32_t, uint32_t>> locked;
    for (;;) {
        pollfd p{s.get(), POLLIN, 0};
        if (::poll(&p, 1, 50) != 1) break;
        const auto m = take(s.get());
        if (!m) break;
        if (const auto* dir = std::get_if<Directive>(&m->body)) {
            EXPECT_EQ(dir->model, model);
            if (dir->action == Action::Lock) locked.insert({dir->block, dir->expert});
        }
    }
    std::set<std::pair<uint32_t, uint32_t>> want;
    for (uint32_t b = 0; b < 4; ++b) want.insert({b, 3}), want.insert({b, 5});
    EXPECT_EQ(locked, want);
}

// A decision larger than one record comes as several, the later ones continued: one routing, every
// expert at a routing's heat. A record of 0 tokens that is not continued is the batch's ranking:
// heat at HeatTable::kRankingWeight, no routing.
TEST_F(ClientSocketTest, ADecisionOfSeveralRecordsIsOneRoutingAndARankingWeighsLess) {
    start();
    UniqueFd s = hello();
    uint32_t model = 0;
    std::optional<telemetry::TelemetryRing> ring;
    ASSERT_NO_FATAL_FAILURE(register_with_ring(s.get(), model, ring));
    auto push = [&](uint32_t tokens, bool continued, uint16_t from, uint16_t to) {
        telemetry::RoutingEvent e;
        e.model = model;
        e.block = 0;
        e.tokens = tokens;
        e.continued = continued;
        for (uint16_t x = from; x < to; ++x) e.experts[e.n_experts++] = x;
        ASSERT_TRUE(ring->push(e));
    };
    push(64, false, 0, 8);  // a batch of 64 tokens: experts 0-7 ...
    push(0, true, 8, 16);   // ... and 8-15, the rest of the same decision
    push(0, false, 0, 4);   // its ranking: 0-3 chosen more
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(d_->step(2));
    const auto st = d_->status();
    ASSERT_EQ(st.clients.size(), 1u);
    EXPECT_EQ(st.clients[0].events, 3u);
    EXPECT_EQ(st.clients[0].bad_events, 0u);
    double routed = 0;
    for (const auto& e : st.models[0].experts)
        if (e.block == 0 && e.expert == 4) routed = e.heat;
    ASSERT_GT(routed, 0) << "the decision's first record added no heat";
    for (const auto& e : st.models[0].experts) {
        if (e.block != 0) continue;
        SCOPED_TRACE(e.expert);
        EXPECT_EQ(e.uses, e.expert < 4 ? 2u : 1u);
        EXPECT_NEAR(e.heat, e.expert < 4 ? routed * (1 + HeatTable::kRankingWeight) : routed, 1e-9 * routed)
            << "a continued record is the decision's, at a routing's heat; a ranking adds kRankingWeight";
    }
}

TEST_F(ClientSocketTest, OnlyAllowedUsersMayConnect) {
    Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
    c.page_cache_telemetry = "off";
    c.client_allow_uids = {4242};
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);  // so that uid 65534 can reach the socket
    start(c);
    // Root is always let in.
    UniqueFd root = hello("root");
    // uid 65534 is not.
    int pipefd[2];
    ASSERT_EQ(::pipe(pipefd), 0);
    const std::string path = d_->status().socket_path;
    const pid_t child = ::fork();
    if (child == 0) {
        ::close(pipefd[0]);
        if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
        UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
        if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ::_exit(4);
        uint8_t buf[kMaxMessageBytes];
        const ssize_t n = ::recv(s.get(), buf, sizeof buf, 0);
        (void)!::write(pipefd[1], buf, n > 0 ? static_cast<size_t>(n) : 0);
        ::_exit(0);
    }
    ::close(pipefd[1]);
    int status = 0;
    while (::waitpid(child, &status, WNOHANG) == 0) ASSERT_TRUE(d_->step(5));
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << WEXITSTATUS(status);
    std::vector<uint8_t> buf(kMaxMessageBytes);
    const ssize_t n = ::read(pipefd[0], buf.data(), buf.size());
    ::close(pipefd[0]);
    ASSERT_GT(n, 0);
    buf.resize(static_cast<size_t>(n));
    auto m = decode(buf, 0);
    ASSERT_TRUE(m) << m.error().what();
    EXPECT_NE(failure_text(*m).find("uid 65534"), std::string::npos) << failure_text(*m);
    EXPECT_EQ(d_->status().clients_refused, 1u);
}

// Two uids, each with its own model and its own budget: each is held to its budget, not to the
// other's and not to the global one (within two experts: whole experts are locked).
// Connections that never say Hello cannot hold the slots for good, and one uid cannot take them
// all: a user opens more connections than [clients] max_per_uid allows and says nothing.
TEST_F(ClientSocketTest, SilentConnectionsAreClosedAndOneUidCannotTakeEverySlot) {
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
    c.page_cache_telemetry = "off";
    c.max_clients_per_uid = 3;
    c.hello_seconds = 0.5;
    start(c);
    const std::string sock = d_->status().socket_path;
    int ready = -1;
    const pid_t pid = spawn_as(4003, [&] {
        for (int i = 0; i < 8; ++i) {
            const int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
            sockaddr_un a{};
            a.sun_family = AF_UNIX;
            std::memcpy(a.sun_path, sock.c_str(), sock.size() + 1);
            if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ::_exit(4);
        }
    }, ready);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(until_ready(ready));
    auto of_uid = [&] {
        const auto st = d_->status();
        return std::count_if(st.clients.begin(), st.clients.end(), [](const auto& cl) { return cl.uid == 4003; });
    };
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(of_uid(), 3) << "[clients] max_per_uid";
    EXPECT_GE(d_->status().clients_refused, 5u);
    // Another uid (root, in a cgroup of its own) still gets in.
    UniqueFd mine = hello("root-client");
    // Past the Hello deadline the silent ones are closed; the one that said Hello stays.
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    d_->tick();
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(of_uid(), 0);
    EXPECT_EQ(d_->status().clients.size(), 1u);
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
}

// Every pod of a node may run as root: root's connections are held to [clients] max_per_uid too,
// counted per cgroup (a service, a pod's container), so that one pod cannot take every slot; and
// a connection that said Hello but registers no model within [clients] idle_seconds is closed
// (a connection that said Hello stayed forever: one pod took all 256 slots).
TEST_F(ClientSocketTest, RootIsHeldToItsShareByCgroupAndIdleConnectionsExpire) {
    Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
    c.page_cache_telemetry = "off";
    c.max_clients_per_uid = 3;
    c.idle_seconds = 0.5;
    start(c);
    UniqueFd a = hello("idle-a"), b = hello("idle-b"), busy = hello("with-a-model");
    uint32_t model = 0;
    std::optional<telemetry::TelemetryRing> ring;
    ASSERT_NO_FATAL_FAILURE(register_with_ring(busy.get(), model, ring));
    UniqueFd fourth = connect();
    auto r = reply(fourth.get());
    ASSERT_TRUE(r && std::holds_alternative<Failure>(r->body)) << failure_text(r);
    EXPECT_NE(failure_text(r).find("cgroup "), std::string::npos) << failure_text(r);
    EXPECT_NE(failure_text(r).find("max_per_uid"), std::string::npos) << failure_text(r);
    // Past idle_seconds the two without a model are closed; the one with a model stays.
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    d_->tick();
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(d_->step(5));
    const auto st = d_->status();
    ASSERT_EQ(st.clients.size(), 1u);
    EXPECT_EQ(st.clients[0].name, "with-a-model");
}

// The socket file is made 0666 by bind, whatever the daemon's umask, and never chmod-ed by path
// afterwards (the path could be swapped in between for a link to a file the daemon may write).
TEST_F(ClientSocketTest, TheSocketIsMadeOpenByBindNotChmodByPath) {
    const mode_t was = ::umask(077);
    start();
    ::umask(was);
    struct stat st {};
    ASSERT_EQ(::lstat(d_->status().socket_path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0666u);
    EXPECT_EQ(::umask(was), was) << "the daemon gives the umask back";
}

// A Hello sent in time but left unread while the loop was busy past the deadline is the loop's
// lateness, not the client's silence: it is answered, not dropped.
TEST_F(ClientSocketTest, AHelloTheLoopWasLateToReadIsAnswered) {
    Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
    c.page_cache_telemetry = "off";
    c.hello_seconds = 0.5;
    start(c);
    UniqueFd s = connect();
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));  // accepted
    ASSERT_EQ(d_->status().clients.size(), 1u);
    send_raw(s.get(), encode({1, Hello{1, 1, "late-loop"}}));
    std::this_thread::sleep_for(std::chrono::milliseconds(700));  // the loop does not turn: a long placement
    d_->tick();
    auto r = reply(s.get());
    EXPECT_TRUE(r && std::holds_alternative<HelloReply>(r->body)) << failure_text(r);
    EXPECT_EQ(d_->status().clients_refused, 0u);
}

// With its descriptor table full (slow /metrics clients, idle connections), the daemon stops
// waiting on the client socket instead of spinning on a connection it cannot accept: one log line
// and a counter per pause, and it accepts again once descriptors come free.
TEST_F(ClientSocketTest, OutOfDescriptorsTheListenerPausesInsteadOfSpinning) {
    start();
    std::vector<UniqueFd> waiting;
    for (int i = 0; i < 8; ++i) waiting.push_back(connect());  // queued: nothing accepted them yet
    rlimit saved{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
    // Room for two more descriptors in this process (the daemon is in it).
    const int probe = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ASSERT_GE(probe, 0);
    int highest = probe;
    for (int fd = probe; fd < probe + 4096; ++fd)
        if (::fcntl(fd, F_GETFD) >= 0) highest = fd;
    ::close(probe);
    rlimit low = saved;
    low.rlim_cur = static_cast<rlim_t>(highest + 1);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
    std::vector<UniqueFd> filler;  // the gaps below, then two given back
    for (UniqueFd f(::open("/dev/null", O_RDONLY | O_CLOEXEC)); f; f.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC)))
        filler.push_back(std::move(f));
    ASSERT_EQ(errno, EMFILE);
    for (int i = 0; i < 2 && !filler.empty(); ++i) filler.pop_back();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) (void)d_->step(50);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const uint64_t pauses = d_->status().accept_pauses;
    filler.clear();
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
    EXPECT_EQ(pauses, 1u) << "one pause, however often ticks try again";
    EXPECT_GT(took, 0.1) << "10 turns of up to 50 ms each returned at once: the loop spun";
    // Descriptors free again: the queued connections are taken at the next tick.
    d_->tick();
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(d_->status().clients.size(), waiting.size());
    UniqueFd s = hello();
}

// A user's own file with the same profile key as a model the operator configured (the key is
// architecture, shape and general.name, all public): it does not join that model's family, its
// heat steers nothing of it, and its profile is saved under the user's name, not over the other.
TEST_F(ClientSocketTest, AUsersModelWithAnOperatorModelsKeyStaysInItsOwnFamily) {
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    ASSERT_EQ(::chmod(model_.c_str(), 0600), 0);  // the operator's model: root's to read
    const std::string mine = dir_.file("mine.gguf");
    test::write_model(test::small_spec(), mine);  // the same spec: the same profile key
    ASSERT_EQ(::chown(mine.c_str(), 4006, 4006), 0);
    Config c = test::daemon_config(model_, dir_.file("state"), 64u << 20);
    c.page_cache_telemetry = "off";
    start(c);
    const std::string sock = d_->status().socket_path;
    int ready = -1;
    const pid_t pid = spawn_as(4006, [&] {
        uint32_t h = 0;
        moecache_client* cl = registered_client(sock, mine, "family-test", h);
        const uint32_t hot[] = {11, 12, 13};
        for (int i = 0; i < 200; ++i) moecache_client_report(cl, h, 0, hot, 3, 1);
    }, ready);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(until_ready(ready)) << "the user's client did not register and report";
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(d_->step(10));
    d_->tick();
    const auto st = d_->status();
    ASSERT_EQ(st.models.size(), 2u);
    const auto& operators = st.models[0].path == model_ ? st.models[0] : st.models[1];
    const auto& users = st.models[0].path == model_ ? st.models[1] : st.models[0];
    EXPECT_NE(operators.family, users.family);
    EXPECT_NE(users.family.find("@uid4006"), std::string::npos) << users.family;
    for (const auto& e : operators.experts)
        EXPECT_NE(e.tier, Tier::Locked) << "the user's heat locked expert " << e.expert << " of the operator's model";
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(10));
    EXPECT_TRUE(std::filesystem::exists(dir_.file("state/profiles/" + users.family + ".json")))
        << "the user's profile is saved under the user's name";
}

// The prompt-model swap: two quantizations of one model, one family (the fixture's model decodes,
// a Q4_K sibling takes prompts), with room for the decode model's four hot experts and not for one
// of the prompt model's beside them. A runtime uses the prompt model and routes to the hot experts
// (the family's heat locks the prompt model's), then goes.
class FamilySwapTest : public ClientSocketTest {
protected:
    void SetUp() override {
        ClientSocketTest::SetUp();
        if (IsSkipped()) return;
        auto spec = test::small_spec();
        const uint64_t per_q8 = mkmodel::bytes_per_expert(spec);
        spec.expert_type = *ggml_type_info(ggml::Q4_K);
        prompt_model_ = dir_.file("prompt-q4_K.gguf");
        test::write_model(spec, prompt_model_);
        // With keep: room for both models' hot experts, so that only keep decides.
        Config c = test::daemon_config(model_, dir_.file("state"), keep_prompt_ ? 8 * per_q8 : 4 * per_q8 + per_q8 / 4);
        c.models.push_back(c.models[0]);
        c.models[1].path = prompt_model_;
        c.models[1].keep = keep_prompt_;
        c.page_cache_telemetry = "off";
        start(c);
        sock_ = d_->status().socket_path;
    }

    ModelStatus model_status(const std::string& path) const {
        const auto st = d_->status();
        for (const auto& m : st.models)
            if (m.path == path) return m;
        ADD_FAILURE() << path << " is not loaded";
        return st.models.front();
    }
    int locked_hot(const std::string& path) const {
        int n = 0;
        for (const auto& e : model_status(path).experts)
            if (e.block == 0 && e.tier == Tier::Locked && std::find(std::begin(kHot), std::end(kHot), e.expert) != std::end(kHot)) ++n;
        return n;
    }
    void turns(int n) {
        for (int i = 0; i < n; ++i) {
            ASSERT_TRUE(d_->step(10));
            if (i % 10 == 0) d_->tick();
        }
    }
    // A runtime that registers `path` and routes to the hot experts `reports` times; ready when
    // this returns (-1: it did not start).
    pid_t start_runtime(const std::string& path, const char* name, int reports) {
        int ready = -1;
        const pid_t pid = spawn_as(0, [&] {
            uint32_t h = 0;
            moecache_client* cl = registered_client(sock_, path, name, h);
            for (int i = 0; i < reports; ++i) moecache_client_report(cl, h, 0, kHot, 4, 1);
        }, ready);
        if (pid <= 0 || !until_ready(ready)) return -1;
        return pid;
    }
    static void stop_runtime(pid_t pid) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
    }
    // A runtime of the prompt model that routes to the hot experts and is gone when this returns.
    void run_prompt_model() {
        const pid_t prompt = start_runtime(prompt_model_, "prompt-runtime", 200);
        ASSERT_GT(prompt, 0);
        turns(60);
        EXPECT_EQ(locked_hot(prompt_model_), 4) << "the model in use holds its hot experts";
        stop_runtime(prompt);
    }

    static constexpr uint32_t kHot[] = {1, 5, 9, 13};
    std::string prompt_model_, sock_;
    bool keep_prompt_ = false;  // [[model]] keep = true for the prompt model
};

class FamilyKeepTest : public FamilySwapTest {
protected:
    FamilyKeepTest() { keep_prompt_ = true; }
};

// keep = true (ollama unloads an idle model and loads it again on the next request): the model a
// runtime left keeps its locks, at full rank, while another member of its family is in use.
TEST_F(FamilyKeepTest, AModelToKeepHoldsItsLocksWhenItsRuntimeLeaves) {
    run_prompt_model();
    const pid_t decode = start_runtime(model_, "decode-runtime", 0);
    ASSERT_GT(decode, 0);
    turns(100);
    EXPECT_EQ(locked_hot(model_), 4) << "the model in use is served first";
    EXPECT_EQ(locked_hot(prompt_model_), 4) << "the model to keep keeps its hot experts";
    stop_runtime(decode);
}

// Once the runtime has moved to the decode model (the prompt model's client gone, the decode
// model's registered), the prompt model waits at once (it was used a moment ago: idleness alone
// would keep it for a minute) and its locks go to the decode model's same hot experts.
TEST_F(FamilySwapTest, TheModelARuntimeLeftForAnotherOfItsFamilyGivesItsLocksAtOnce) {
    run_prompt_model();
    const pid_t decode = start_runtime(model_, "decode-runtime", 0);  // it has routed nothing yet
    ASSERT_GT(decode, 0);
    turns(100);
    EXPECT_EQ(locked_hot(model_), 4) << "the family's heat locks the decode model's hot experts";
    EXPECT_EQ(model_status(prompt_model_).locked_bytes, 0u) << "the prompt model waits";
    stop_runtime(decode);
}

// Between the two runtimes of a swap (the prompt model's server gone, the decode model's still
// loading: on the GPU machine 15 s, time to read most of the hot set), the RAM already goes to the
// member that comes next, not to the one the runtime left: the member that left before it. A member
// no runtime ever used is not that: a model served alone and restarted keeps its locks.
TEST_F(FamilySwapTest, TheModelARuntimeLeftWaitsForTheOtherMemberOfItsFamily) {
    run_prompt_model();
    turns(100);
    EXPECT_EQ(locked_hot(prompt_model_), 4) << "the decode model never ran: the model the runtime left keeps its locks";
    // The decode model's runtime comes and goes: the prompt model is next.
    const pid_t decode = start_runtime(model_, "decode-runtime", 50);
    ASSERT_GT(decode, 0);
    turns(20);
    stop_runtime(decode);
    turns(100);
    EXPECT_EQ(locked_hot(prompt_model_), 4) << "the prompt model is next";
    EXPECT_LT(locked_hot(model_), 4) << "the decode model waits: it keeps only the room the prompt model leaves";
    // And the prompt model's runtime again: now the decode model is next, before its runtime comes.
    run_prompt_model();
    turns(100);
    EXPECT_EQ(locked_hot(model_), 4) << "the decode model's hot experts are locked before its runtime comes";
    EXPECT_EQ(model_status(prompt_model_).locked_bytes, 0u) << "the model the runtime left waits";
}

// Every model a user registers costs the daemon memory, descriptors and, each tick, a look at the
// page cache for each of its experts: one uid registering thousands of sparse files, or a few that
// claim a quarter of a million tiny experts each, grew the daemon without end and held its loop
// seconds a tick. What the clients of one uid (root's: of one cgroup) hold of models users
// registered is bounded in models and in experts; a model [[model]] names is not counted, one the
// uid holds already adds nothing, and what its clients let go frees its share.
TEST_F(ClientSocketTest, WhatOneUidMayRegisterIsBoundedInModelsAndExperts) {
    Config c = test::daemon_config(model_, dir_.file("state"), 16u << 20);
    c.page_cache_telemetry = "off";
    c.max_models_per_uid = 2;
    c.max_experts_per_uid = 150;  // 4 x 16 and 4 x 16, not 4 x 16 and 8 x 16
    start(c);
    const std::string a = dir_.file("a.gguf"), b = dir_.file("b.gguf"), other = dir_.file("c.gguf");
    for (const auto& p : {a, b, other}) test::write_model(test::small_spec(), p);
    auto spec = test::small_spec();
    spec.n_layers = 8;
    const std::string big = dir_.file("big.gguf");
    test::write_model(spec, big);
    // The answer to request `rq` (the Locks and policies sent unasked skipped).
    auto answer = [&](int s, uint32_t rq, const std::string& path) {
        UniqueFd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
        send_raw(s, encode({rq, RegisterModel{1}}), {f.get()});
        for (int i = 0; i < 100; ++i) {
            auto r = reply(s);
            if (!r || r->request == rq) return r;
        }
        return std::optional<Message>{};
    };
    auto refused = [&](const std::optional<Message>& r, const std::string& key) {
        const auto* f = r ? std::get_if<Failure>(&r->body) : nullptr;
        EXPECT_TRUE(f != nullptr) << failure_text(r);
        if (f == nullptr) return;
        EXPECT_EQ(f->errnum, EDQUOT);
        EXPECT_NE(f->text.find(key), std::string::npos) << f->text;
    };
    auto open_models = [&] {
        std::set<std::string> paths;
        for (const auto& m : d_->status().models) paths.insert(m.path);
        return paths;
    };
    UniqueFd s1 = hello("one");
    auto r = answer(s1.get(), 10, a);
    ASSERT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
    refused(answer(s1.get(), 11, big), "max_experts_per_uid");
    EXPECT_EQ(open_models().count(big), 0u) << "a model refused for its experts is closed again";
    r = answer(s1.get(), 12, b);
    ASSERT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
    // Another connection of the same uid shares the count.
    UniqueFd s2 = hello("two");
    refused(answer(s2.get(), 20, other), "max_models_per_uid");
    EXPECT_EQ(open_models().count(other), 0u);
    r = answer(s2.get(), 21, a);
    EXPECT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << "held already: " << failure_text(r);
    r = answer(s2.get(), 22, model_);
    EXPECT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << "configured: " << failure_text(r);
    // The first connection goes with b: there is room for another again.
    s1.reset();
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(5));
    EXPECT_EQ(open_models().count(b), 0u);
    r = answer(s2.get(), 23, other);
    EXPECT_TRUE(r && std::holds_alternative<ModelRegistered>(r->body)) << failure_text(r);
}

TEST_F(ClientSocketTest, EachUidIsHeldToItsOwnBudget) {
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    const std::string a = dir_.file("a.gguf"), b = dir_.file("b.gguf");
    auto spec = test::small_spec();  // 4 layers x 16 experts of 204 KiB
    spec.name = "model-a";
    test::write_model(spec, a);
    spec.name = "model-b";
    test::write_model(spec, b);
    Config c = test::daemon_config(model_, dir_.file("state"), 64u << 20);
    c.page_cache_telemetry = "off";
    c.uid_budgets[4001] = ByteAmount{3u << 20, std::nullopt};
    c.uid_budgets[4002] = ByteAmount{8u << 20, std::nullopt};
    start(c);
    const std::string sock = d_->status().socket_path;
    auto spawn = [&](uint32_t uid, const std::string& path) {
        const pid_t pid = ::fork();
        if (pid == 0) {
            if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(3);
            uint32_t h = 0;
            moecache_client* cl = registered_client(sock, path, "budget-test", h);
            uint32_t all[16];
            for (uint32_t e = 0; e < 16; ++e) all[e] = e;
            for (int round = 0; round < 50; ++round) {
                for (uint32_t block = 0; block < 4; ++block) moecache_client_report(cl, h, block, all, 16, 1);
                ::usleep(5000);
            }
            ::pause();
            ::_exit(0);
        }
        return pid;
    };
    const pid_t pa = spawn(4001, a), pb = spawn(4002, b);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    uint64_t la = 0, lb = 0;
    while (std::chrono::steady_clock::now() < end) {
        ASSERT_TRUE(d_->step(10));
        const auto st = d_->status();
        for (const auto& m : st.models) {
            if (m.path == a) la = m.locked_bytes;
            if (m.path == b) lb = m.locked_bytes;
        }
        if (la > (3u << 20) - (512u << 10) && lb > (8u << 20) - (512u << 10) && d_->idle()) break;
    }
    const auto st = d_->status();
    ::kill(pa, SIGKILL);
    ::kill(pb, SIGKILL);
    ::waitpid(pa, nullptr, 0);
    ::waitpid(pb, nullptr, 0);
    bool seen_a = false, seen_b = false;
    for (const auto& m : st.models) {
        if (m.path == a) {
            seen_a = true;
            EXPECT_TRUE(m.registered);
            EXPECT_EQ(m.owner_uid, 4001u);
            EXPECT_LE(m.locked_bytes, 3u << 20) << "uid 4001 beyond its budget";
            EXPECT_GT(m.locked_bytes, (3u << 20) - (512u << 10)) << "uid 4001 not given its budget";
        }
        if (m.path == b) {
            seen_b = true;
            EXPECT_EQ(m.owner_uid, 4002u);
            EXPECT_LE(m.locked_bytes, 8u << 20) << "uid 4002 beyond its budget";
            EXPECT_GT(m.locked_bytes, (8u << 20) - (512u << 10)) << "uid 4002 not given its budget";
        }
    }
    EXPECT_TRUE(seen_a && seen_b) << "both clients registered their models";
    EXPECT_LE(st.vmlck_bytes, st.locked_bytes + (64u << 10));
}

// Issue 20 row 6: an ExpertPlacement is an eviction from RAM, which D-Bus allows only to root and
// the admin group. A user who can read an operator's model registers it, reports a pool and puts
// every expert in it: the model stays locked. Once every client of the model holds the experts in
// VRAM and one of them may evict (root), they leave RAM; a client that comes without a pool
// brings them back.
TEST_F(ClientSocketTest, APoolTakesExpertsOutOfRamOnlyWhenEveryClientHoldsThemAndOneMayEvict) {
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    ASSERT_EQ(::chmod(model_.c_str(), 0644), 0);  // the operator's model, readable by everyone
    // A lock budget of half the experts: one place is for RAM that cannot lock them all.
    auto parts = open_gguf_model(model_);
    ASSERT_TRUE(parts);
    auto map = ExpertMap::build(*parts);
    ASSERT_TRUE(map);
    const uint64_t all = map->expert_bytes_total;
    ASSERT_GT(all, 0u);
    Config c = test::daemon_config(model_, dir_.file("state"), all / 2);
    c.page_cache_telemetry = "off";
    start(c);
    const std::string sock = d_->status().socket_path, model = model_;
    const auto facts = [&] { return d_->status(false).models.front(); };
    ASSERT_EQ(facts().expert_bytes, all);
    const auto settle = [&](const std::function<bool()>& done) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (std::chrono::steady_clock::now() < end) {
            EXPECT_TRUE(d_->step(10));
            d_->tick();
            if (done() && d_->idle()) return true;
        }
        return false;
    };
    // A client that registers the model and, if `pool`, reports a pool holding every expert; with
    // `route`, it reports every expert as routed (heat: the daemon locks them all).
    const auto client = [&](uint32_t uid, bool route, bool pool, int& ready) {
        return spawn_as(uid, [=] {
            uint32_t h = 0;
            moecache_client* cl = registered_client(sock, model, "placement-test", h);
            uint32_t experts[16];
            for (uint32_t e = 0; e < 16; ++e) experts[e] = e;
            if (route)
                for (uint32_t block = 0; block < 4; ++block) moecache_client_report(cl, h, block, experts, 16, 1);
            if (pool) {
                const moecache_pool_stats stats{0, 0, 0, 0, 1u << 30};
                if (moecache_client_report_pool(cl, 0, &stats) != 0) ::_exit(6);
                for (uint32_t block = 0; block < 4; ++block)
                    for (uint32_t e = 0; e < 16; ++e)
                        if (moecache_client_report_placement(cl, h, block, e, 0) != 0) ::_exit(7);
            }
            ::usleep(300000);  // its client thread sends what was reported
        }, ready);
    };
    const auto stop = [](pid_t pid) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
    };
    int ready = -1;
    const pid_t heat = client(0, /*route=*/true, /*pool=*/false, ready);
    ASSERT_TRUE(until_ready(ready));
    stop(heat);
    // Half of them, to the budget.
    ASSERT_TRUE(settle([&] { return facts().expert_locked_bytes >= all / 3; })) << "the experts were not locked";
    const uint64_t locked = facts().expert_locked_bytes;

    const pid_t user = client(4007, false, /*pool=*/true, ready);
    ASSERT_TRUE(until_ready(ready)) << "the user's client did not register and report";
    EXPECT_TRUE(settle([&] { return facts().experts_in_vram == 64; })) << "the user's placements were not recorded";
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(d_->step(10));
    EXPECT_EQ(facts().expert_locked_bytes, locked) << "an unprivileged pool evicted the operator's model";

    const pid_t root = client(0, false, /*pool=*/true, ready);
    ASSERT_TRUE(until_ready(ready));
    EXPECT_TRUE(settle([&] { return facts().expert_locked_bytes == 0; }))
        << "every client holds the experts in VRAM and root may evict, yet " << facts().expert_locked_bytes
        << " bytes stay locked";

    const pid_t cpu = client(0, false, /*pool=*/false, ready);  // a runtime that needs them in RAM
    ASSERT_TRUE(until_ready(ready));
    EXPECT_TRUE(settle([&] { return facts().expert_locked_bytes == locked; }))
        << "a client without a pool needs the experts in RAM, yet only " << facts().expert_locked_bytes << " of " << locked
        << " bytes are locked";
    stop(cpu);
    EXPECT_TRUE(settle([&] { return facts().expert_locked_bytes == 0; })) << "they did not leave RAM again";
    stop(root);
    stop(user);
}

// A pool's recency split, end to end: a runtime whose router keeps what it just used (nine tokens
// in ten reuse the previous token's experts, the rest drawn evenly: no expert hotter than another)
// reports a pool of a quarter of the experts; the daemon learns the split at the pool's size and
// tells the client to keep what it does not direct as an LRU (VramPolicy recency).
TEST_F(ClientSocketTest, ARoutingThatReusesWhatItUsedGivesThePoolARecencyShare) {
    const uint64_t expert = mean_expert_bytes();
    ASSERT_GT(expert, 0u);
    start();
    const std::string sock = d_->status().socket_path, model = model_;
    int ready = -1;
    const pid_t pid = spawn_as(0, [=] {
        uint32_t h = 0;
        moecache_client* cl = pooled_client(sock, model, "bursty", h, 16 * expert);  // 4 experts of each of 4 layers
        if (moecache_client_pool_recency(cl, 0) != 0) ::_exit(7);  // nothing learnt yet
        ::usleep(500000);  // the daemon places: the pool's size reaches its split
        std::mt19937 rng(5);
        std::uniform_int_distribution<uint32_t> any(0, 15);
        std::bernoulli_distribution keep(0.9);
        uint32_t prev[4][2] = {};
        for (int t = 0; t < 1500; ++t) {
            for (uint32_t block = 0; block < 4; ++block) {
                uint32_t* e = prev[block];
                if (t == 0 || !keep(rng)) {
                    e[0] = any(rng);
                    do e[1] = any(rng); while (e[1] == e[0]);
                }
                (void)moecache_client_report(cl, h, block, e, 2, 1);
            }
            if (t % 8 == 7) ::usleep(2000);  // within what the ring holds
        }
        for (int i = 0; i < 200 && moecache_client_pool_recency(cl, 0) != 1; ++i) ::usleep(50000);
        if (moecache_client_pool_recency(cl, 0) != 1) ::_exit(8);
    }, ready);
    ASSERT_GT(pid, 0);
    bool told = false;
    const int code = reap_when_ready(pid, ready, told);
    EXPECT_TRUE(told) << "the client was not told to keep its pool's rest by recency (child " << code << ")";
}

// A routing that moves to experts it did not use: once the daemon's heat sees the shift, each client
// with a pool of the model is told (a Shifted directive), so that its pool's own counts are cut as
// the heat was; never while the routing stays.
TEST_F(ClientSocketTest, ARoutingThatShiftsTellsThePoolToCutItsCounts) {
    const uint64_t expert = mean_expert_bytes();
    ASSERT_GT(expert, 0u);
    start();
    const std::string sock = d_->status().socket_path, model = model_;
    int ready = -1;
    const pid_t pid = spawn_as(
        0,
        [=] {
            uint32_t h = 0;
            moecache_client* cl = pooled_client(sock, model, "shifting", h, 16 * expert);
            ::usleep(300000);  // the daemon places: the pool is directed from here on
            std::mt19937 rng(11);
            std::uniform_int_distribution<uint32_t> four(0, 3);
            moecache_directive d[64];
            auto shifted = [&] {
                bool seen = false;
                for (size_t n; (n = moecache_client_poll(cl, d, 64)) > 0;)
                    seen = seen || std::any_of(d, d + n, [](const moecache_directive& x) {
                               return x.action == MOECACHE_SHIFTED;
                           });
                return seen;
            };
            // The same four experts of each layer for 1200 tokens (the detector looks after 4096
            // routings), then four others.
            for (int t = 0; t < 1400; ++t) {
                const uint32_t base = t < 1200 ? 0 : 8;
                for (uint32_t block = 0; block < 4; ++block) {
                    uint32_t e[2] = {base + four(rng), 0};
                    do e[1] = base + four(rng);
                    while (e[1] == e[0]);
                    (void)moecache_client_report(cl, h, block, e, 2, 1);
                }
                if (t % 8 == 7) {
                    ::usleep(2000);  // within what the ring holds
                    if (t < 1200 && shifted()) ::_exit(7);
                }
            }
            for (int i = 0; i < 200; ++i) {
                if (shifted()) return;
                ::usleep(50000);
            }
            ::_exit(8);
        },
        ready);
    ASSERT_GT(pid, 0);
    bool told = false;
    const int code = reap_when_ready(pid, ready, told);
    EXPECT_TRUE(told) << "child " << code
                      << " (7: told of a shift while the routing stayed; 8: never told after it shifted)";
}

// `settled` (moecachectl wait): a model whose pool was directed to hold experts it does not hold is
// not settled, however done its reads are; once that pool's client goes, it is.
TEST_F(ClientSocketTest, AModelIsNotSettledUntilItsPoolHoldsWhatItWasDirected) {
    const uint64_t expert = mean_expert_bytes();
    ASSERT_GT(expert, 0u);
    start();
    const std::string sock = d_->status().socket_path, model = model_;
    int ready = -1;
    const pid_t pid = spawn_as(0, [=] {
        uint32_t h = 0;
        moecache_client* cl = pooled_client(sock, model, "unfilled", h, 8 * expert);
        const uint32_t hot[] = {3, 7};
        for (int t = 0; t < 300; ++t)
            for (uint32_t block = 0; block < 4; ++block) (void)moecache_client_report(cl, h, block, hot, 2, 1);
        // Directed, never reporting that it holds any of it.
        moecache_directive d[64];
        for (int i = 0; i < 400; ++i) {
            const size_t n = moecache_client_poll(cl, d, 64);
            if (std::any_of(d, d + n, [](const moecache_directive& x) { return x.action == MOECACHE_PROMOTE; })) return;
            ::usleep(25000);
        }
        ::_exit(7);
    }, ready);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(until_ready(ready)) << "the client's pool was never directed";
    // Its reads done (the model is small: every lock lands within a few turns), yet not settled.
    ModelStatus m;
    for (int i = 0; i < 300; ++i) {
        EXPECT_TRUE(d_->step(10));
        m = d_->status().models.front();
        if (m.experts_fetching == 0 && m.prefetching_experts == 0 && i >= 100) break;
    }
    EXPECT_EQ(m.experts_fetching, 0u);
    EXPECT_EQ(m.prefetching_experts, 0u);
    EXPECT_FALSE(m.settled) << "settled while its pool holds none of what it was directed (" << m.experts_in_vram << " in VRAM)";
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    bool settled = false;
    for (int i = 0; i < 500 && !settled; ++i) {
        EXPECT_TRUE(d_->step(10));
        settled = d_->status().models.front().settled;
    }
    EXPECT_TRUE(settled) << "not settled once the pool's client had gone";
}

}  // namespace
}  // namespace moecache::daemon
