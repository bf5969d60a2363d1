// The moecached program itself: bad configurations refused with a message and exit code 1,
// --check, a foreground run that takes SIGHUP (reload) and SIGTERM (saves heat, exits 0).
#include "gguf_builder.h"
#include "memory_cgroup.h"
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/client.h"
#include "moecache/daemon/privileges.h"
#include "moecache/ggml_type.h"
#include "moecache/http.h"
#include "moecache/mkmodel/gguf_writer.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

namespace moecache {
namespace {

// What the daemon's /metrics (its port from its output) says is locked, once it is more than nothing
// (20 s at most); its last body in *body. 0: nothing locked, or no metrics port in the output.
uint64_t locked_bytes(const std::string& daemon_output, std::string* body) {
    std::smatch found;
    if (!std::regex_search(daemon_output, found, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) return 0;
    const int port = std::stoi(found[1]);
    const std::regex locked("moecache_locked_bytes\\{[^}]*\\} ([0-9]+)");
    uint64_t bytes = 0;
    for (int i = 0; i < 200 && bytes == 0; ++i) {
        httplib::Client c("127.0.0.1", port);
        if (auto r = c.Get("/metrics"); r && r->status == 200) {
            *body = r->body;
            std::smatch m;
            if (std::regex_search(*body, m, locked)) bytes = std::stoull(m[1]);
        }
        if (bytes == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return bytes;
}

// "127.0.0.1:PORT" where the daemon's output says its metrics answer ("" when it does not say).
std::string metrics_address(const std::string& daemon_output) {
    std::smatch found;
    if (!std::regex_search(daemon_output, found, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics")))
        return "";
    return "127.0.0.1:" + found[1].str();
}

class Moecached : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: mlock and PSI triggers";
        model_ = dir_.file("model.gguf");
        test::write_model(test::small_spec(), model_);
    }
    std::string config(const std::string& lock = "64MiB") {
        return "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\ntick_seconds = 0.1\nsocket = \"" +
               dir_.file("sock") + "\"\n"
               "[budget]\nlock = \"" + lock + "\"\nreserve = \"1GiB\"\n"
               "[[model]]\npath = \"" + model_ + "\"\npin = [\"0:0-3\"]\n";
    }
    // moecached without a bus ([dbus] bus = "off"), its metrics on a free port, running; null (and a
    // test failure) when it does not start.
    std::unique_ptr<test::Background> start_without_bus() {
        const std::string cfg = dir_.file("moecached.toml");
        test::write_file(cfg, config() +
                                  "[dbus]\nbus = \"off\"\n[telemetry]\npage_cache = \"off\"\n"
                                  "[pressure]\nenabled = false\n[metrics]\nlisten = \"127.0.0.1:0\"\n");
        auto d = std::make_unique<test::Background>(std::vector<std::string>{MOECACHE_DAEMON_BIN, "--config", cfg});
        if (!d->wait_for("moecached running", 20)) {
            ADD_FAILURE() << d->output();
            return nullptr;
        }
        return d;
    }
    test::TempDir dir_;
    std::string model_;
};

// Whatever a client sends, the daemon stays within a bound its unit can hold (MemoryMax): in a
// memory cgroup of 384 MiB, a local user registers a hash-named model whose general.name is 40 MiB,
// one whose header is an array of 2^24 empty strings (128 MiB of a sparse file), and one that
// claims 4.2 million experts (before, 16 MiB of such a file OOM-killed the daemon in a 1.5 GiB
// cgroup). The daemon refuses or takes each, keeps answering, and nothing in its cgroup is killed.
TEST_F(Moecached, AClientCannotPushTheDaemonPastItsMemoryBound) {
    auto made = test::MemoryCgroup::create("moecache-hostile-client-test-", 384ull << 20);
    if (!made) GTEST_SKIP() << "no memory cgroup here: " << made.error().what();
    auto& cg = *made;
    test::write_file(dir_.file("d.toml"), config() + "[metrics]\nlisten = \"127.0.0.1:0\"\n[telemetry]\npage_cache = \"off\"\n");
    test::Background d(cg->inside({MOECACHE_DAEMON_BIN, "--config", dir_.file("d.toml")}));
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    std::smatch port;
    const std::string out = d.output();
    ASSERT_TRUE(std::regex_search(out, port, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) << out;
    // A hash-named model with a 40 MiB general.name.
    auto spec = test::small_spec();
    spec.name = std::string(40u << 20, 'N');
    const std::string named = dir_.file("sha256-" + std::string(64, 'a'));
    test::write_model(spec, named);
    // A header of 2^24 empty strings: the array last, the rest of a sparse file its zeros.
    test::GgufDesc strings;
    strings.add_str("general.architecture", "qwen3moe");
    strings.add_kv("tokenizer.ggml.tokens", static_cast<uint32_t>(GgufValueType::Array),
                   test::GgufDesc::array(static_cast<uint32_t>(GgufValueType::String), uint64_t{1} << 24));
    const std::string sparse = dir_.file("strings.gguf");
    test::write_file(sparse, strings.bytes());
    ASSERT_EQ(truncate(sparse.c_str(), 8ll << 30), 0);
    // 4.2 million one-byte experts.
    mkmodel::GgufWriter w;
    w.add("general.architecture", std::string("qwen3moe"));
    w.add("qwen3moe.block_count", 1u);
    w.add("qwen3moe.expert_count", 4200000u);
    w.add("qwen3moe.expert_used_count", 1u);
    mkmodel::TensorSpec t{"blk.0.ffn_up_exps.weight", *ggml_type_info(ggml::I8), {1, 1, 4200000}, {}};
    t.fill = [](uint64_t, uint64_t n, uint8_t* o) { std::fill(o, o + n, 0); };
    w.add_tensor(std::move(t));
    const std::string many = dir_.file("many.gguf");
    ASSERT_TRUE(w.write(many, {}));
    moecache_client* c = moecache_client_open(dir_.file("sock").c_str(), "hostile");
    ASSERT_NE(c, nullptr);
    uint32_t h = 0;
    for (const auto& path : {named, sparse, many}) (void)moecache_client_register_model(c, path.c_str(), &h);
    (void)moecache_client_wait_ready(c, 20000);
    std::this_thread::sleep_for(std::chrono::seconds(2));  // the refusals and their reconnections
    std::string metrics;
    for (int i = 0; i < 100; ++i) {
        httplib::Client http("127.0.0.1", std::stoi(port[1]));
        http.set_read_timeout(2, 0);
        if (auto r = http.Get("/metrics"); r && r->status == 200 && r->body.find("sha256") != std::string::npos) {
            metrics = r->body;
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    EXPECT_FALSE(metrics.empty()) << "the daemon stopped answering, or never showed the model\n" << d.output();
    EXPECT_EQ(cg->oom_kills(), 0u) << "killed in its cgroup\n" << d.output();
    EXPECT_LT(metrics.size(), 1u << 20) << "a name of 40 MiB in the metrics";
    moecache_client_close(c);
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

TEST_F(Moecached, RefusesABadConfigurationWithAMessage) {
    test::write_file(dir_.file("bad.toml"), "[budget]\nlock = \"12 parsecs\"\n");
    const auto r = test::run({MOECACHE_DAEMON_BIN, "--config", dir_.file("bad.toml")});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find(dir_.file("bad.toml")), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("budget.lock"), std::string::npos) << r.err;
    const auto missing = test::run({MOECACHE_DAEMON_BIN, "--config", dir_.file("none.toml")});
    EXPECT_EQ(missing.exit_code, 1);
    EXPECT_NE(missing.err.find("none.toml"), std::string::npos) << missing.err;
    EXPECT_EQ(test::run({MOECACHE_DAEMON_BIN, "--bogus"}).exit_code, 2);
}

TEST_F(Moecached, CheckValidatesAndExits) {
    test::write_file(dir_.file("good.toml"), config());
    const auto r = test::run({MOECACHE_DAEMON_BIN, "--config", dir_.file("good.toml"), "--check"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("valid"), std::string::npos) << r.out;
}

// [clients] max against RLIMIT_NOFILE (issue 20 row 4's root): a hard limit of 512 holds about a
// hundred clients, not 65536; --check says so and the daemon serves what fits, said once.
TEST_F(Moecached, ClientsAreFittedToTheDescriptorLimit) {
    test::write_file(dir_.file("many.toml"), config() + "[clients]\nmax = 65536\n");
    const auto r = test::run({"prlimit", "--nofile=512:512", MOECACHE_DAEMON_BIN, "--config", dir_.file("many.toml"), "--check"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("warning: descriptors: [clients] max = 65536"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("RLIMIT_NOFILE is 512"), std::string::npos) << r.out;
    // A soft limit below the hard one is raised: 256 soft, 4096 hard holds the default max.
    test::write_file(dir_.file("good.toml"), config());
    const auto raised = test::run({"prlimit", "--nofile=256:4096", MOECACHE_DAEMON_BIN, "--config", dir_.file("good.toml"), "--check"});
    EXPECT_NE(raised.out.find("descriptors: [clients] max = 256 needs about"), std::string::npos) << raised.out;
    EXPECT_NE(raised.out.find("RLIMIT_NOFILE 4096"), std::string::npos) << raised.out;
    test::Background d({"prlimit", "--nofile=512:512", MOECACHE_DAEMON_BIN, "--config", dir_.file("many.toml")});
    EXPECT_TRUE(d.wait_for("client(s) at once", 20)) << d.output();
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

TEST_F(Moecached, RunsReloadsOnSighupAndStopsOnSigterm) {
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, config());
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    ASSERT_TRUE(d.wait_for("model " + model_ + " loaded", 20)) << d.output();
    test::write_file(cfg, config("32MiB"));
    d.signal(SIGHUP);
    EXPECT_TRUE(d.wait_for("lock budget now 32 MiB", 20)) << d.output();
    // What is set up once at start (the socket, the prefetch queue) is not taken up, and it says so.
    std::string moved = config("32MiB");
    moved.replace(moved.find(dir_.file("sock")), dir_.file("sock").size(), dir_.file("other.sock"));
    test::write_file(cfg, moved + "[prefetch]\nqueue_depth = 8\n");
    d.signal(SIGHUP);
    EXPECT_TRUE(d.wait_for("reload: daemon.socket changed", 20)) << d.output();
    EXPECT_TRUE(d.wait_for("reload: prefetch.queue_depth changed (32 -> 8): it takes effect when moecached restarts", 20))
        << d.output();
    // A broken edit is refused and the daemon goes on.
    test::write_file(cfg, "[budget]\nlock = 7\nnope = 1\n");
    d.signal(SIGHUP);
    EXPECT_TRUE(d.wait_for("reload refused", 20)) << d.output();
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
    EXPECT_TRUE(std::filesystem::exists(dir_.file("state/profiles/qwen3moe-4x16-moecache-synthetic.json")))
        << d.output();
}

// In a container under Docker's or containerd's default seccomp profile io_uring_setup fails with
// EPERM: the daemon says so once, reads with threads, and does its job (the pinned experts are
// read and locked), which /metrics shows, with no D-Bus (there is none in a container).
TEST_F(Moecached, WhereIoUringIsDeniedItReadsWithThreadsAndLocks) {
    const std::string cfg = dir_.file("moecached.toml");
    // No pressure back-off: PSI is the whole machine's, and a busy one would hold the locks back.
    test::write_file(cfg, config() + "[dbus]\nbus = \"off\"\n[telemetry]\npage_cache = \"off\"\n"
                                     "[metrics]\nlisten = \"127.0.0.1:0\"\n[pressure]\nenabled = false\n");
    test::drop_page_cache(model_);
    test::Background d({MOECACHE_DENY_IO_URING_BIN, MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    EXPECT_TRUE(d.wait_for("io_uring is denied here", 1)) << d.output();
    EXPECT_NE(d.output().find("Operation not permitted"), std::string::npos) << d.output();
    // Experts 0-3 of block 0 are pinned: read by the threads, then locked.
    std::string body;
    EXPECT_GT(locked_bytes(d.output(), &body), 0u) << body << d.output();
    EXPECT_NE(body.find("moecache_prefetch_engine{engine=\"threads\"} 1"), std::string::npos) << body;
    std::smatch read;
    ASSERT_TRUE(std::regex_search(body, read, std::regex("moecache_prefetched_bytes_total ([0-9]+)"))) << body;
    EXPECT_GT(std::stoull(read[1]), 0u) << "the locks were not read by the prefetcher's threads";
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

// Status line "Key:\t..." of a process, the text after the tab.
std::string proc_status(int pid, const std::string& key) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(f, line))
        if (line.rfind(key + ":", 0) == 0) return line.substr(key.size() + 2);
    return "";
}

// The D-Bus API is a module of its own (libmoecache-dbus.so, with sdbus-c++ and libsystemd): a
// daemon told to use a bus whose module cannot be loaded says so once, with what to do, and runs
// without it; it does not try again every few seconds.
TEST_F(Moecached, WithoutItsDbusModuleItRunsAndSaysSo) {
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, config() + "[dbus]\nbus = \"unix:path=" + dir_.file("bus") + "\"\n[telemetry]\npage_cache = \"off\"\n"
                                     "[pressure]\nenabled = false\n[metrics]\nlisten = \"127.0.0.1:0\"\n");
    const std::string missing = dir_.file("no/libmoecache-dbus.so");
    test::Background d({"/usr/bin/env", "MOECACHE_DBUS_MODULE=" + missing, MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    EXPECT_TRUE(d.wait_for("no D-Bus API ([dbus] bus = \"unix:path=" + dir_.file("bus") + "\"): no libmoecache-dbus.so (looked at " +
                               missing + ")", 1))
        << d.output();
    ASSERT_TRUE(d.wait_for("model " + model_ + " loaded", 20)) << d.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // several ticks
    const std::string out = d.output();
    EXPECT_EQ(out.find("no D-Bus API"), out.rfind("no D-Bus API")) << "said more than once: " << out;
    EXPECT_EQ(out.find("trying again"), std::string::npos) << out;
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

// Without D-Bus (a container, the bundle: [dbus] bus = "off"), moecachectl status reads the daemon's
// /status over HTTP: named by --http, or by MOECACHE_METRICS when the bus cannot be reached at all;
// "is it helping" names the model.
TEST_F(Moecached, WithoutABusStatusComesOverHttp) {
    auto daemon = start_without_bus();
    ASSERT_TRUE(daemon);
    test::Background& d = *daemon;
    ASSERT_TRUE(d.wait_for("model " + model_ + " loaded", 20)) << d.output();
    const std::string address = metrics_address(d.output());
    ASSERT_FALSE(address.empty()) << d.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a few ticks publish /status
    const auto direct = test::run({MOECACHE_CTL_BIN, "status", "--http", address});
    EXPECT_EQ(direct.exit_code, 0) << direct.err;
    EXPECT_NE(direct.out.find("is it helping?\n  model.gguf: idle: no runtime has used it"), std::string::npos)
        << direct.out;
    const auto fallback = test::run({MOECACHE_CTL_BIN, "--bus", "unix:path=" + dir_.file("no-bus"), "status"},
                                    {"MOECACHE_METRICS=" + address});
    EXPECT_EQ(fallback.exit_code, 0) << fallback.err;
    EXPECT_NE(fallback.out.find("moecached's http://" + address + "/status instead"), std::string::npos)
        << fallback.out;
    EXPECT_NE(fallback.out.find("is it helping?"), std::string::npos) << fallback.out;
    const auto json = test::run({MOECACHE_CTL_BIN, "--json", "status", "--http", address});
    EXPECT_EQ(json.exit_code, 2) << "--json needs the bus: " << json.err;
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

// A runtime whose command line reads its model into private memory (ollama's --load-mode none):
// the daemon reads each client's command line at Hello and says so under "is it helping?". The
// client is this test's own program, started again as `llama-server -m ... --load-mode none`.
TEST_F(Moecached, AClientStartedWithoutAMappingIsNamedUnderIsItHelping) {
    if (const char* sock = std::getenv("MOECACHE_TEST_CLIENT_SOCKET")) {  // the client
        moecache_client* c = moecache_client_open(sock, "llama-server");
        ASSERT_NE(c, nullptr);
        std::this_thread::sleep_for(std::chrono::seconds(6));
        moecache_client_close(c);
        GTEST_SKIP() << "the client's half";
    }
    auto daemon = start_without_bus();
    ASSERT_TRUE(daemon);
    test::Background& d = *daemon;
    const std::string address = metrics_address(d.output());
    ASSERT_FALSE(address.empty()) << d.output();
    char self[4096] = {};
    ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
    test::Background client({"env", "MOECACHE_TEST_CLIENT_SOCKET=" + dir_.file("sock"), "bash", "-c",
                             "exec -a llama-server \"$0\" -m /models/m.gguf --load-mode none "
                             "--gtest_filter=Moecached.AClientStartedWithoutAMappingIsNamedUnderIsItHelping",
                             self});
    std::string body;
    for (int i = 0; i < 50 && body.find("--load-mode none") == std::string::npos; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (auto r = http_get(address, "/status", std::chrono::seconds(2)); r) body = r->body;
    }
    EXPECT_NE(body.find("llama-server (pid "), std::string::npos) << body;
    EXPECT_NE(body.find("this runtime was started with --load-mode none"), std::string::npos) << body;
    EXPECT_TRUE(d.wait_for("this runtime was started with --load-mode none", 5)) << "and in the log: " << d.output();
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

// Why the DaemonSet keeps the host's PID namespace: from another one (a pod's own) a client in
// a third (an inference pod) has pid 0 to the daemon (SO_PEERCRED), so root clients, which are
// counted per cgroup (read from /proc/PID/cgroup), fall back to one count for all of them. The
// daemon says so, once, naming the fix.
TEST_F(Moecached, SaysWhenARootClientsPidCannotBeSeen) {
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, config() + "[dbus]\nbus = \"off\"\n[telemetry]\npage_cache = \"off\"\n[pressure]\nenabled = false\n"
                                     "[metrics]\nlisten = \"127.0.0.1:0\"\n");
    test::Background d({"/usr/bin/unshare", "--pid", "--fork", "--kill-child", MOECACHE_DAEMON_BIN, "--config", cfg});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    for (int i = 0; i < 2; ++i) {
        const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        ASSERT_GE(fd, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", dir_.file("sock").c_str());
        ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
        EXPECT_TRUE(d.wait_for("a root client's pid is not visible in moecached's PID namespace", 10)) << d.output();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a second warning would be out by now
        ::close(fd);
    }
    const std::string out = d.output();
    EXPECT_EQ(out.find("pid is not visible"), out.rfind("pid is not visible")) << "said more than once: " << out;
}

// As a container starts it (Kubernetes gives a non-root container no capabilities): root with a
// few more capabilities than it uses, told to be its own user. It switches before anything else:
// every id is the user's, of its capabilities only those it uses remain (none to switch back),
// and it does its job as that user (the pinned experts locked, the profile saved where the user
// may write). Not root, it refuses to switch, saying why.
// ollama's blobs under a home of 0750 (as ollama's installer makes it on many systems): a glob
// over them matches nothing for the daemon's own user, silently before; now it says which folder is
// closed and the one ACL that opens it, once.
TEST_F(Moecached, AGlobOverAFolderItCannotEnterSaysWhichAndHowToOpenIt) {
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    const std::string home = dir_.file("ollama");
    ASSERT_EQ(::mkdir(home.c_str(), 0750), 0);  // root's, closed to uid 65534
    const std::string blobs = home + "/models/blobs";
    std::filesystem::create_directories(blobs);
    ::chmod((home + "/models").c_str(), 0755);
    ::chmod(blobs.c_str(), 0755);
    test::write_model(test::small_spec(), blobs + "/sha256-0123");
    const std::string own = dir_.file("own");
    ASSERT_EQ(::mkdir(own.c_str(), 0700), 0);
    ASSERT_EQ(::chown(own.c_str(), 65534, 65534), 0);
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, "[daemon]\nstate_dir = \"" + own + "/state\"\ntick_seconds = 0.1\nsocket = \"" + own +
                              "/sock\"\n[budget]\nlock = \"64MiB\"\nreserve = \"1GiB\"\n[dbus]\nbus = \"off\"\n"
                              "[pressure]\nenabled = false\n[metrics]\nlisten = \"\"\n"
                              "[[model]]\npath = \"" +
                              blobs + "/sha256-*\"\nkeep = true\n");
    ASSERT_EQ(::chmod(cfg.c_str(), 0644), 0);
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg, "--user", "65534:65534"});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    EXPECT_TRUE(d.wait_for("matches nothing: moecached (user nobody) cannot enter " + home +
                               ". Give it that: `setfacl -m u:nobody:rx " + home + "`",
                           10))
        << d.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // several refreshes
    const std::string out = d.output();
    EXPECT_EQ(out.find("cannot enter"), out.rfind("cannot enter")) << "said more than once: " << out;
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
}

TEST_F(Moecached, SwitchesToItsUserKeepingOnlyTheCapabilitiesItUses) {
    const uint32_t nobody = 65534;
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    ASSERT_EQ(::chmod(model_.c_str(), 0644), 0);
    const std::string own = dir_.file("own");
    ASSERT_EQ(::mkdir(own.c_str(), 0700), 0);
    ASSERT_EQ(::chown(own.c_str(), nobody, nobody), 0);
    const std::string cfg = dir_.file("moecached.toml");
    test::write_file(cfg, "[daemon]\nstate_dir = \"" + own + "/state\"\ntick_seconds = 0.1\nsocket = \"" + own +
                              "/sock\"\n[budget]\nlock = \"64MiB\"\nreserve = \"1GiB\"\n[dbus]\nbus = \"off\"\n"
                              "[pressure]\nenabled = false\n[metrics]\nlisten = \"127.0.0.1:0\"\n"
                              "[[model]]\npath = \"" + model_ + "\"\npin = [\"0:0-3\"]\n");
    ASSERT_EQ(::chmod(cfg.c_str(), 0644), 0);
    const auto mine = daemon::own_capabilities();
    ASSERT_TRUE(mine) << mine.error().what();
    test::Background d({MOECACHE_DAEMON_BIN, "--config", cfg, "--user", "65534:65534"});
    ASSERT_TRUE(d.wait_for("moecached running", 20)) << d.output();
    EXPECT_TRUE(d.wait_for("running as uid 65534 gid 65534", 1)) << d.output();
    EXPECT_EQ(proc_status(d.pid(), "Uid"), "65534\t65534\t65534\t65534");
    EXPECT_EQ(proc_status(d.pid(), "Gid"), "65534\t65534\t65534\t65534");
    const uint64_t kept = daemon::kDaemonCapabilities & mine->permitted;
    EXPECT_EQ(std::stoull(proc_status(d.pid(), "CapEff"), nullptr, 16), kept) << daemon::capability_names(kept);
    EXPECT_EQ(std::stoull(proc_status(d.pid(), "CapPrm"), nullptr, 16), kept);
    if (mine->effective & (uint64_t{1} << 8)) {  // CAP_SETPCAP: the bounding set is cut too
        EXPECT_EQ(std::stoull(proc_status(d.pid(), "CapBnd"), nullptr, 16), kept);
    }
    EXPECT_EQ(std::stoull(proc_status(d.pid(), "CapAmb"), nullptr, 16), 0u);
    std::string body;
    EXPECT_GT(locked_bytes(d.output(), &body), 0u) << body << d.output();
    struct stat sock{};
    ASSERT_EQ(::stat((own + "/sock").c_str(), &sock), 0);
    EXPECT_EQ(sock.st_uid, nobody);
    d.signal(SIGTERM);
    EXPECT_EQ(d.wait(20), 0) << d.output();
    struct stat profile{};
    ASSERT_EQ(::stat((own + "/state/profiles/qwen3moe-4x16-moecache-synthetic.json").c_str(), &profile), 0) << d.output();
    EXPECT_EQ(profile.st_uid, nobody);

    // Not root: no switch.
    const auto r = test::run({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", MOECACHE_DAEMON_BIN,
                              "--config", cfg, "--user", "0:0"});
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    EXPECT_NE((r.out + r.err).find("only root can switch users"), std::string::npos) << r.out << r.err;
    // A user that is neither a name nor a number.
    const auto bad = test::run({MOECACHE_DAEMON_BIN, "--config", cfg, "--user", "no such user"});
    EXPECT_EQ(bad.exit_code, 1);
    EXPECT_NE((bad.out + bad.err).find("no user 'no such user' in the user database"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace moecache
