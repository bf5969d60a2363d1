// The D-Bus API and moecachectl against a real moecached on a real dbus-daemon (a private bus set up
// like the system bus, with the shipped policy dbus/org.moecache1.conf): reading is open to an
// unprivileged user, changes are denied to it (by the bus, and by the daemon when a policy is too
// open) and allowed to root and the admin group; moecachectl drives every verb; hostile arguments
// get clear errors and the daemon keeps running.
#include "model_fixture.h"
#include "private_bus.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/client.h"
#include "moecache/daemon/daemon.h"
#include "moecache/dbus/proxy.h"
#include "moecache/sim/trace.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <grp.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

namespace moecache {
namespace {

using json = nlohmann::json;
constexpr const char* kNobody = "65534";

class DbusApi : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: the daemon locks memory and the tests switch users";
        if (::access("/usr/bin/dbus-daemon", X_OK) != 0) GTEST_SKIP() << "needs dbus-daemon (Debian package dbus-daemon)";
        if (::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs setpriv (util-linux) to call as another user";
        ::chmod(dir_.path().c_str(), 0755);
        model_ = dir_.file("model.gguf");
        test::write_model(test::small_spec(), model_, 1, 4096);
        ::chmod(model_.c_str(), 0644);
    }
    void TearDown() override {
        if (daemon_) {
            daemon_->signal(SIGTERM);
            EXPECT_EQ(daemon_->wait(20), 0) << daemon_->output();
        }
    }

    // Starts the bus with `policy` (default: the shipped one) and the daemon on it.
    void start(const std::string& policy = std::string(MOECACHE_SOURCE_DIR) + "/dbus/org.moecache1.conf",
               const std::string& admin_group = "moecache") {
        bus_ = std::make_unique<test::PrivateBus>(dir_.path(), policy);
        ASSERT_TRUE(bus_->ok()) << bus_->output();
        std::filesystem::create_directories(dir_.file("state"));
        test::write_file(dir_.file("d.toml"), "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\nsocket = \"" +
                                                  dir_.file("d.sock") + "\"\ntick_seconds = 0.2\n"
                                                  "[budget]\nlock = \"256MiB\"\nreserve = \"1GiB\"\n"
                                                  "[metrics]\nlisten = \"\"\n"
                                                  "[dbus]\nbus = \"" + bus_->address() + "\"\nadmin_group = \"" + admin_group +
                                                  "\"\n[[model]]\npath = \"" + model_ + "\"\n");
        daemon_ = std::make_unique<test::Background>(std::vector<std::string>{MOECACHE_DAEMON_BIN, "--config", dir_.file("d.toml")});
        ASSERT_TRUE(daemon_->wait_for("D-Bus: org.moecache1 on", 20)) << daemon_->output();
        ASSERT_TRUE(daemon_->wait_for("moecached running", 20)) << daemon_->output();
    }

    // moecachectl as root, or as `uid` (with `groups`, "" for none) through setpriv.
    test::RunResult ctl(std::vector<std::string> args, const std::string& uid = "", const std::string& groups = "") {
        std::vector<std::string> argv;
        if (!uid.empty()) {
            argv = {"setpriv", "--reuid=" + uid, "--regid=" + uid};
            if (groups.empty()) argv.push_back("--clear-groups");
            else argv.push_back("--groups=" + groups);
        }
        argv.push_back(MOECACHE_CTL_BIN);
        argv.push_back("--bus");
        argv.push_back(bus_->address());
        argv.insert(argv.end(), args.begin(), args.end());
        return test::run(argv, {}, 60);
    }
    json ctl_json(std::vector<std::string> args, const std::string& uid = "") {
        args.insert(args.begin(), "--json");
        const auto r = ctl(args, uid);
        EXPECT_EQ(r.exit_code, 0) << r.err;
        try {
            return json::parse(r.out);
        } catch (const std::exception& e) {
            ADD_FAILURE() << "not JSON: " << r.out;
            return {};
        }
    }
    bool daemon_alive() { return ctl({"status"}).exit_code == 0; }

    test::TempDir dir_;
    std::string model_;
    std::unique_ptr<test::PrivateBus> bus_;
    std::unique_ptr<test::Background> daemon_;
};

// Every change verb, with arguments that would succeed for root.
std::vector<std::vector<std::string>> change_verbs(const std::string& model, const std::string& dir) {
    return {{"budget", "lock", "128MiB"},
            {"budget", "reserve", "2GiB"},
            {"budget", "0", "64MiB"},
            {"pin", "0", "0:1"},
            {"unpin", "0", "0:1"},
            {"prefetch", "0", "0:2"},
            {"evict", "0", "0:3"},
            {"profile", "import", "0", dir + "/profile.json"},
            {"trace", "start", dir + "/public/trace.jsonl"},
            {"trace", "stop"},
            {"register", model},
            {"unregister", "0"}};
}

TEST_F(DbusApi, ReadingIsOpenToAnUnprivilegedUser) {
    start();
    const auto status = ctl_json({"status"}, kNobody);
    EXPECT_EQ(status["lock_budget_bytes"], 256u << 20);
    EXPECT_EQ(status["models"], 1u);
    const auto models = ctl_json({"models"}, kNobody);
    ASSERT_EQ(models.size(), 1u);
    EXPECT_EQ(models[0]["path"], model_);
    EXPECT_TRUE(models[0]["loaded"].get<bool>());
    const auto experts = ctl_json({"experts", "0", "--top", "5"}, kNobody);
    EXPECT_EQ(experts.size(), 5u);
    const auto budgets = ctl_json({"budget"}, kNobody);
    EXPECT_EQ(budgets[0]["name"], "lock");
    const auto exported = ctl({"profile", "export", "0"}, kNobody);
    EXPECT_EQ(exported.exit_code, 0) << exported.err;
    EXPECT_NE(exported.out.find("\"key\""), std::string::npos) << exported.out;
    // Tables for people, too.
    const auto table = ctl({"models"}, kNobody);
    EXPECT_EQ(table.exit_code, 0) << table.err;
    EXPECT_NE(table.out.find(model_), std::string::npos);
}

// A client's model named by bytes that are not UTF-8 (a Latin-1 file name): D-Bus strings must
// be UTF-8, so the daemon shows such a path escaped (\xNN) and every reader goes on working.
TEST_F(DbusApi, AModelPathThatIsNotUtf8IsShownEscapedAndBreaksNothing) {
    start();
    const std::string bad = dir_.file("caf\xe9.gguf");
    auto spec = test::small_spec();
    spec.name = "latin1";
    test::write_model(spec, bad);
    moecache_client* c = moecache_client_open(dir_.file("d.sock").c_str(), "utf8-test");
    ASSERT_NE(c, nullptr);
    uint32_t handle = 0;
    ASSERT_EQ(moecache_client_register_model(c, bad.c_str(), &handle), 0);
    ASSERT_EQ(moecache_client_wait_ready(c, 10000), 1);
    const auto models = ctl_json({"models"}, kNobody);
    ASSERT_EQ(models.size(), 2u);
    EXPECT_EQ(models[1]["path"], dir_.file("caf\\xe9.gguf"));
    const uint32_t id = models[1]["id"].get<uint32_t>();
    for (const std::vector<std::string>& verb : std::vector<std::vector<std::string>>{
             {"status"}, {"budget"}, {"experts", std::to_string(id), "--top", "3"}, {"models"}})
        EXPECT_EQ(ctl(verb, kNobody).exit_code, 0) << verb.front();
    moecache_client_close(c);
}

// A CUDA hook whose misses cannot come from registered pages (here MOECACHE_CUDA_PIN=off, as the
// hook reports it) makes decode with every expert on the GPU slower than without moecache:
// moecachectl status says so, naming the runtime, the device, why and what to do, and the metrics
// count it by path. A hook on the registered path is not named.
TEST_F(DbusApi, StatusSaysWhichHooksMakeDecodeSlowerAndWhy) {
    start();
    moecache_client* slow = moecache_client_open(dir_.file("d.sock").c_str(), "llama-server-a");
    moecache_client* fast = moecache_client_open(dir_.file("d.sock").c_str(), "llama-server-b");
    ASSERT_NE(slow, nullptr);
    ASSERT_NE(fast, nullptr);
    uint32_t h = 0;
    for (auto* c : {slow, fast}) {
        ASSERT_EQ(moecache_client_register_model(c, model_.c_str(), &h), 0);
        ASSERT_EQ(moecache_client_wait_ready(c, 10000), 1);
    }
    const moecache_pool_stats pool{1, 2, 3, 4, 64u << 20};
    ASSERT_EQ(moecache_client_report_miss_path(slow, 1, MOECACHE_MISS_PATH_PAGEABLE_CHOSEN), 0);
    ASSERT_EQ(moecache_client_report_pool(slow, 1, &pool), 0);
    ASSERT_EQ(moecache_client_report_pool(fast, 0, &pool), 0);
    ASSERT_EQ(moecache_client_report_miss_path(fast, 0, MOECACHE_MISS_PATH_REGISTERED), 0);
    EXPECT_EQ(moecache_client_report_miss_path(fast, 0, 99), -EINVAL);
    std::string out;
    for (int i = 0; i < 100; ++i) {
        out = ctl({"status"}, kNobody).out;
        if (out.find("slower") != std::string::npos) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // Under "is it helping?", a line of its own.
    EXPECT_NE(out.find("is it helping?\n"), std::string::npos) << out;
    EXPECT_NE(out.find("\n  llama-server-a (pid "), std::string::npos) << out;
    EXPECT_NE(out.find("GPU 1: slower than it could be: MOECACHE_CUDA_PIN=off: misses are copied from pageable memory"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("unset MOECACHE_CUDA_PIN (auto)"), std::string::npos) << out;
    EXPECT_EQ(out.find("llama-server-b"), std::string::npos) << "the registered path is no notice: " << out;
    const auto j = ctl_json({"status"}, kNobody);
    ASSERT_TRUE(j["hook_notices"].is_array()) << j.dump();
    EXPECT_EQ(j["hook_notices"].size(), 1u) << j.dump();
    moecache_client_close(slow);
    moecache_client_close(fast);
}

TEST_F(DbusApi, ChangesAreDeniedToAnUnprivilegedUserAndAllowedToRoot) {
    start();
    test::write_file(dir_.file("profile.json"), ctl({"profile", "export", "0"}).out);
    std::filesystem::create_directories(dir_.file("public"));
    ::chmod(dir_.file("public").c_str(), 01777);
    for (const auto& args : change_verbs(model_, dir_.path())) {
        const auto r = ctl(args, kNobody);
        EXPECT_EQ(r.exit_code, 4) << args[0] << " " << (args.size() > 1 ? args[1] : "") << ": " << r.err;
        EXPECT_NE(r.err.find("not allowed"), std::string::npos) << r.err;
    }
    // Nothing changed.
    const auto status = ctl_json({"status"});
    EXPECT_EQ(status["lock_budget_bytes"], 256u << 20);
    EXPECT_FALSE(status["tracing"].get<bool>());
    EXPECT_EQ(ctl_json({"models"}).size(), 1u);
    // Root may.
    for (const auto& args : change_verbs(model_, dir_.path())) {
        if (args[0] == "register" || args[0] == "unregister") continue;  // the configured model: below
        const auto r = ctl(args);
        EXPECT_EQ(r.exit_code, 0) << args[0] << ": " << r.err;
    }
    EXPECT_EQ(ctl_json({"status"})["lock_budget_bytes"], 128u << 20);
}

// The daemon checks the caller itself: with a policy that lets everyone call everything, an
// unprivileged change is still refused, by the daemon, and a member of the admin group may.
TEST_F(DbusApi, TheDaemonChecksCallersWhenThePolicyIsTooOpenAndAdmitsTheAdminGroup) {
    const group* users = ::getgrnam("users");
    if (!users) GTEST_SKIP() << "needs a group 'users' to stand in for the admin group";
    test::write_file(dir_.file("open.conf"), R"(<busconfig>
  <policy context="default"><allow own="org.moecache1"/><allow send_destination="org.moecache1"/></policy>
</busconfig>)");
    start(dir_.file("open.conf"), "users");
    const auto denied = ctl({"budget", "lock", "128MiB"}, kNobody);
    EXPECT_EQ(denied.exit_code, 4) << denied.err;
    EXPECT_NE(denied.err.find("needs root or group users"), std::string::npos) << denied.err;
    const auto member = ctl({"budget", "lock", "96MiB"}, kNobody, std::to_string(users->gr_gid));
    EXPECT_EQ(member.exit_code, 0) << member.err;
    EXPECT_EQ(ctl_json({"status"})["lock_budget_bytes"], 96u << 20);
}

// The shipped policy names the group moecache; a member may change state through the bus too.
TEST_F(DbusApi, TheAdminGroupMayChangeStateThroughTheShippedPolicy) {
    const group* users = ::getgrnam("users");
    if (!users) GTEST_SKIP() << "needs a group 'users' to stand in for the group moecache";
    test::write_policy_for_group(dir_.file("policy.conf"), "users");
    start(dir_.file("policy.conf"), "users");
    const auto gid = std::to_string(users->gr_gid);
    EXPECT_EQ(ctl({"pin", "0", "1:0-1"}, kNobody, gid).exit_code, 0);
    EXPECT_EQ(ctl({"pin", "0", "1:2"}, kNobody).exit_code, 4);
    const auto experts = ctl_json({"experts", "0", "--top", "0"});
    int pinned = 0;
    for (const auto& e : experts) pinned += e["pinned"].get<bool>();
    EXPECT_EQ(pinned, 2);
}

TEST_F(DbusApi, MoecachectlDrivesEveryVerb) {
    start();
    // status, models, experts: above. inspect reads the file itself.
    EXPECT_EQ(ctl({"inspect", model_}).exit_code, 0);

    // budget: global and per model, shown back.
    EXPECT_EQ(ctl({"budget", "reserve", "1536MiB"}).exit_code, 0);
    EXPECT_EQ(ctl({"budget", "model.gguf", "32MiB"}).exit_code, 0);
    auto budgets = ctl_json({"budget"});
    bool model_budget = false;
    for (const auto& b : budgets) {
        if (b["name"] == "reserve") {
            EXPECT_EQ(b["bytes"], 1536u << 20);
        }
        if (b["name"] == "model:0") model_budget = b["bytes"] == (32u << 20);
    }
    EXPECT_TRUE(model_budget) << budgets.dump();
    EXPECT_EQ(ctl({"budget", "0", "none"}).exit_code, 0);

    // pin: the experts are pinned and locked; unpin lets go of the mark.
    EXPECT_EQ(ctl_json({"pin", "0", "2:0-3"})["pinned"], 4u);
    bool locked = false;
    for (int i = 0; i < 100 && !locked; ++i) {
        int n = 0;
        for (const auto& e : ctl_json({"experts", "0", "--top", "0"}))
            n += e["pinned"].get<bool>() && e["tier"] == "ram";
        locked = n == 4;
        if (!locked) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(locked);
    // evict refuses what is pinned; unpin, then evict works.
    EXPECT_EQ(ctl({"evict", "0", "2:1"}).exit_code, 1);
    EXPECT_EQ(ctl_json({"unpin", "0", "2:0-3"})["unpinned"], 4u);

    // evict everything, then prefetch it back: bytes are read and the model is cached again.
    test::drop_page_cache(model_);
    EXPECT_EQ(ctl({"evict", "0", "--all"}).exit_code, 0);
    const auto pf = ctl_json({"prefetch", "0"});
    EXPECT_GT(pf["queued_bytes"].get<uint64_t>(), 0u) << pf.dump();
    // The reads land at once, but the cached bytes are what the daemon's residency read last (a
    // busy 2-core machine stretches its turns). All of it, but for what proactive reclaim takes back
    // at once: these machines run DAMON pageout on physical memory, and pages read that nobody maps
    // are its first pick (CI saw 20 KiB of the 13 MiB go within 20 s, once).
    bool cached = false;
    std::string models;
    for (int i = 0; i < 200 && !cached; ++i) {
        const auto m = ctl_json({"models"});
        models = m.dump();
        cached = m[0]["expert_cached_bytes"].get<uint64_t>() >= m[0]["expert_bytes"].get<uint64_t>() * 97 / 100;
        if (!cached) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(cached) << models << "\n" << daemon_->output();
    // wait: with its reads done and no pool, the model is settled.
    const auto waited = ctl_json({"wait", "0", "--timeout", "30", "--settle", "0.5"});
    EXPECT_EQ(waited["model"], 0u) << waited.dump();
    EXPECT_LT(waited["settled_after_seconds"].get<double>(), 30.0) << waited.dump();
    EXPECT_EQ(ctl({"wait", "0", "--timeout", "soon"}).exit_code, 2);
    EXPECT_EQ(ctl({"prefetch", "0", "--timeout", "5s"}).exit_code, 2) << "seconds, whole, as wait takes them";

    // trace: router decisions a client reports land in the file.
    const std::string trace = dir_.file("trace.jsonl");
    EXPECT_EQ(ctl({"trace", "start", trace}).exit_code, 0);
    EXPECT_EQ(ctl({"trace", "start", trace}).exit_code, 1);  // one at a time
    moecache_client* c = moecache_client_open(dir_.file("d.sock").c_str(), "dbus-test");
    ASSERT_NE(c, nullptr);
    uint32_t handle = 0;
    ASSERT_EQ(moecache_client_register_model(c, model_.c_str(), &handle), 0);
    ASSERT_EQ(moecache_client_wait_ready(c, 10000), 1);
    const uint32_t experts[] = {3, 7};
    for (int i = 0; i < 20; ++i) moecache_client_report(c, handle, 1, experts, 2, 1);
    uint64_t records = 0;
    for (int i = 0; i < 50 && records < 20; ++i) {
        records = ctl_json({"status"})["trace_records"].get<uint64_t>();
        if (records < 20) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    moecache_client_close(c);
    const auto stopped = ctl_json({"trace", "stop"});
    EXPECT_GE(stopped["records"].get<uint64_t>(), 20u);
    const std::string text = test::read_file(trace);
    EXPECT_NE(text.find("\"moecache_trace\":1"), std::string::npos) << text.substr(0, 400);
    EXPECT_NE(text.find("\"b\":1,\"n\":1,\"e\":[3,7]"), std::string::npos) << text.substr(0, 400);
    // What the daemon records, the replay's reader takes back.
    const auto read = sim::read_trace(trace);
    ASSERT_TRUE(read) << read.error().what();
    EXPECT_GE(read->decisions.size(), 20u);
    ASSERT_FALSE(read->models.empty());
    EXPECT_EQ(read->decisions.front().experts, (std::vector<uint32_t>{3, 7}));
    EXPECT_EQ(ctl({"trace", "stop"}).exit_code, 5);

    // profile: export, change, import, and the heat follows.
    const auto exported = ctl({"profile", "export", "0", dir_.file("p.json")});
    ASSERT_EQ(exported.exit_code, 0) << exported.err;
    auto profile = json::parse(test::read_file(dir_.file("p.json")));
    profile["experts"] = json::array({json::array({2, 9, 1000.0, 77})});
    test::write_file(dir_.file("p2.json"), profile.dump());
    ASSERT_EQ(ctl({"profile", "import", "0", dir_.file("p2.json")}).exit_code, 0);
    const auto top = ctl_json({"experts", "0", "--top", "1"});
    ASSERT_EQ(top.size(), 1u);
    EXPECT_EQ(top[0]["block"], 2u);
    EXPECT_EQ(top[0]["expert"], 9u);
    EXPECT_EQ(top[0]["uses"], 77u);

    // register / unregister a second model.
    const std::string second = dir_.file("second.gguf");
    test::write_model(test::small_spec(), second);
    const auto reg = ctl_json({"register", second});
    EXPECT_EQ(ctl_json({"models"}).size(), 2u);
    EXPECT_EQ(ctl({"register", second}).exit_code, 1);  // already managed
    EXPECT_EQ(ctl({"unregister", "second.gguf"}).exit_code, 0);
    EXPECT_EQ(ctl_json({"models"}).size(), 1u);
    EXPECT_EQ(ctl({"unregister", "0"}).exit_code, 1);  // configured: the configuration owns it

    // completion and help.
    const auto comp = ctl({"completion", "bash"});
    EXPECT_EQ(comp.exit_code, 0);
    for (const char* verb : {"status", "models", "inspect", "experts", "budget", "pin", "unpin", "prefetch", "wait", "evict",
                             "profile", "trace", "register", "unregister"}) {
        EXPECT_NE(comp.out.find(verb), std::string::npos) << verb;
        EXPECT_EQ(ctl({"help", verb}).exit_code, 0) << verb;
    }
}

TEST_F(DbusApi, ExitCodesSayWhatWentWrong) {
    start();
    EXPECT_EQ(ctl({"experts", "no-such-model"}).exit_code, 5);
    EXPECT_EQ(ctl({"experts"}).exit_code, 2);
    EXPECT_EQ(ctl({"experts", "0", "--top", "many"}).exit_code, 2);
    EXPECT_EQ(ctl({"bogus"}).exit_code, 2);
    EXPECT_EQ(ctl({"pin", "0", "banana"}).exit_code, 2);
    EXPECT_EQ(ctl({"budget", "lock", "12 parsecs"}).exit_code, 2);
    EXPECT_EQ(ctl({"evict", "0"}).exit_code, 2);  // neither experts nor --all
    // A "profile" larger than a D-Bus call carries, or one that never ends: a usage error that says
    // so, not "moecached is not on the bus".
    for (const std::string& big : {dir_.file("big.json"), std::string("/dev/zero")}) {
        if (big != "/dev/zero") test::write_file(big, std::string((32u << 20) + 1, ' '));
        const auto r = ctl({"profile", "import", "0", big});
        EXPECT_EQ(r.exit_code, 2) << r.err;
        EXPECT_NE(r.err.find("larger than 32 MiB"), std::string::npos) << r.err;
    }
    // No bus, and no moecached's /status where MOECACHE_METRICS says (port 1: nothing listens).
    const auto unreachable = test::run({MOECACHE_CTL_BIN, "--bus", "unix:path=" + dir_.file("no-bus"), "status"},
                                       {"MOECACHE_METRICS=127.0.0.1:1"});
    EXPECT_EQ(unreachable.exit_code, 3) << unreachable.err;
    EXPECT_NE(unreachable.err.find("nor does http://127.0.0.1:1/status answer"), std::string::npos) << unreachable.err;
    // A bus without the daemon on it.
    daemon_->signal(SIGTERM);
    EXPECT_EQ(daemon_->wait(20), 0);
    daemon_.reset();
    const auto gone = ctl({"status"});
    EXPECT_EQ(gone.exit_code, 3) << gone.err;
    EXPECT_NE(gone.err.find("is it running"), std::string::npos) << gone.err;
}

// A name owner that never answers (a stuck daemon, or a bus policy that drops the replies):
// moecachectl gives up after its own call timeout, not sd-bus's 25 s, and says what it waited for.
TEST_F(DbusApi, ADaemonThatDoesNotAnswerIsGivenUpOnWithAReason) {
    bus_ = std::make_unique<test::PrivateBus>(dir_.path(), std::string(MOECACHE_SOURCE_DIR) + "/dbus/org.moecache1.conf");
    ASSERT_TRUE(bus_->ok()) << bus_->output();
    auto silent = sdbus::createSessionBusConnectionWithAddress(bus_->address());
    silent->requestName("org.moecache1");  // and never processes a message
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = ctl({"status"});
    const auto waited = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(r.exit_code, 3) << r.err;
    EXPECT_NE(r.err.find("did not answer within 10 s"), std::string::npos) << r.err;
    EXPECT_GE(waited, std::chrono::seconds(9));
    EXPECT_LT(waited, std::chrono::seconds(20));
}

// Raw calls with hostile arguments (what a careless or malicious client could send): each gets an
// org.moecache1.Error naming what is wrong, and the daemon goes on.
TEST_F(DbusApi, HostileArgumentsGetClearErrors) {
    start();
    auto conn = sdbus::createSessionBusConnectionWithAddress(bus_->address());
    auto mgr = sdbus::createProxy(*conn, "org.moecache1", "/org/moecache1");
    auto model = sdbus::createProxy(*conn, "org.moecache1", "/org/moecache1/model/0");
    auto expect_error = [&](const std::function<void()>& call, const std::string& name, const std::string& text) {
        try {
            call();
            ADD_FAILURE() << "no error; expected " << name;
        } catch (const sdbus::Error& e) {
            EXPECT_EQ(e.getName(), name) << e.getMessage();
            EXPECT_NE(e.getMessage().find(text), std::string::npos) << e.getMessage();
        }
    };
    const char* M = "org.moecache1.Manager";
    const char* O = "org.moecache1.Model";
    const std::string invalid = "org.moecache1.Error.InvalidArgument";
    expect_error([&] { mgr->callMethod("RegisterModel").onInterface(M).withArguments(std::string("relative.gguf")); }, invalid, "absolute path");
    expect_error([&] { mgr->callMethod("RegisterModel").onInterface(M).withArguments(std::string("/dev/zero")); }, invalid, "/dev/zero");
    expect_error([&] { mgr->callMethod("RegisterModel").onInterface(M).withArguments(std::string("/etc/passwd")); }, invalid, "/etc/passwd");
    expect_error([&] { mgr->callMethod("RegisterModel").onInterface(M).withArguments(std::string(10000, '/')); }, invalid, "4096");
    expect_error([&] { mgr->callMethod("RegisterModel").onInterface(M).withArguments(dir_.file("*.gguf")); }, invalid, "glob");
    // One file, one entry, whatever it is called: the configured model by other spellings and names.
    const std::string exists = "org.moecache1.Error.Exists";
    const std::string dir = std::filesystem::path(model_).parent_path().string(), base = std::filesystem::path(model_).filename().string();
    ASSERT_EQ(::symlink(model_.c_str(), dir_.file("alias.gguf").c_str()), 0);
    ASSERT_EQ(::link(model_.c_str(), dir_.file("hardlink.gguf").c_str()), 0);
    for (const std::string& name : {dir + "//" + base, dir + "/./" + base, dir + "/../" + std::filesystem::path(dir).filename().string() + "/" + base,
                                    dir_.file("alias.gguf"), dir_.file("hardlink.gguf")})
        expect_error([&] { mgr->callMethod("RegisterModel").onInterface(M).withArguments(name); }, exists, "already managed");
    expect_error([&] { mgr->callMethod("UnregisterModel").onInterface(M).withArguments(sdbus::ObjectPath("/org/moecache1/model/x")); }, invalid, "not a model object");
    expect_error([&] { mgr->callMethod("UnregisterModel").onInterface(M).withArguments(sdbus::ObjectPath("/org/moecache1/model/4294967295")); }, "org.moecache1.Error.NotFound", "4294967295");
    expect_error([&] { mgr->callMethod("SetBudget").onInterface(M).withArguments(std::string("swap"), std::string("1G")); }, invalid, "'lock' and 'reserve'");
    expect_error([&] { mgr->callMethod("SetBudget").onInterface(M).withArguments(std::string("lock"), std::string("-5G")); }, invalid, "budget lock");
    expect_error([&] { mgr->callMethod("SetBudget").onInterface(M).withArguments(std::string("reserve"), std::string("100%")); }, invalid, "reserve");
    int pipefd[2];
    ASSERT_EQ(::pipe(pipefd), 0);
    expect_error([&] { mgr->callMethod("StartTrace").onInterface(M).withArguments(sdbus::UnixFd(pipefd[1])); }, invalid, "regular file");
    ::close(pipefd[0]);
    ::close(pipefd[1]);
    const int ro = ::open(model_.c_str(), O_RDONLY | O_CLOEXEC);
    expect_error([&] { mgr->callMethod("StartTrace").onInterface(M).withArguments(sdbus::UnixFd(ro)); }, invalid, "not open for writing");
    ::close(ro);
    // A trace never overwrites a model it manages, nor a file that holds something else: both stay
    // as they were, byte for byte.
    const auto model_size = std::filesystem::file_size(model_);
    const int rw = ::open(model_.c_str(), O_RDWR | O_CLOEXEC);
    expect_error([&] { mgr->callMethod("StartTrace").onInterface(M).withArguments(sdbus::UnixFd(rw)); }, "org.moecache1.Error.AccessDenied", "a model moecached manages");
    ::close(rw);
    EXPECT_EQ(std::filesystem::file_size(model_), model_size);
    const std::string notes = dir_.file("notes.txt");
    test::write_file(notes, "my notes, not a trace\n");
    const int other = ::open(notes.c_str(), O_RDWR | O_CLOEXEC);
    expect_error([&] { mgr->callMethod("StartTrace").onInterface(M).withArguments(sdbus::UnixFd(other)); }, "org.moecache1.Error.Exists", "not a moecache trace");
    ::close(other);
    EXPECT_EQ(test::read_file(notes), "my notes, not a trace\n");
    for (const char* spec : {"banana", "1:", ":3", "1:5-2", "99", "1:16", "4294967296", "1:0-99999999999", "-1", "1:4294967295", "1:0-4294967295"})
        expect_error([&] { model->callMethod("Pin").onInterface(O).withArguments(std::vector<std::string>{spec}); }, invalid, "expert selection");
    expect_error([&] { model->callMethod("Pin").onInterface(O).withArguments(std::vector<std::string>{}); }, invalid, "pin what");
    expect_error([&] { model->callMethod("Evict").onInterface(O).withArguments(std::vector<std::string>(70000, "1")); }, invalid, "at most");
    expect_error([&] { model->callMethod("ImportProfile").onInterface(O).withArguments(std::string("{not json")); }, invalid, "not JSON");
    expect_error([&] { model->callMethod("ImportProfile").onInterface(O).withArguments(std::string(R"({"key":"other","n_layers":4,"n_experts":16,"experts":[]})")); }, invalid, "another model");
    expect_error([&] { model->callMethod("SetBudget").onInterface(O).withArguments(std::string("lots")); }, invalid, "budget of model");
    expect_error([&] { model->callMethod("SetBudget").onInterface(O).withArguments(std::string("1000TiB")); }, invalid, "global lock budget");
    // A refused global budget names the argument, not a line of the file it would replace.
    expect_error([&] { mgr->callMethod("SetBudget").onInterface(M).withArguments(std::string("reserve"), std::string("100%")); }, invalid, "SetBudget(\"reserve\", \"100%\")");
    auto gone = sdbus::createProxy(*conn, "org.moecache1", "/org/moecache1/model/77");
    try {
        gone->callMethod("GetStatus").onInterface(O);
        ADD_FAILURE() << "a model that does not exist answered";
    } catch (const sdbus::Error& e) {
        EXPECT_EQ(e.getName(), "org.freedesktop.DBus.Error.UnknownObject") << e.getMessage();
    }
    // Still there, nothing changed.
    EXPECT_TRUE(daemon_alive());
    EXPECT_EQ(ctl_json({"status"})["lock_budget_bytes"], 256u << 20);
    EXPECT_EQ(ctl_json({"models"}).size(), 1u);
}

struct Watcher final : sdbus::ProxyInterfaces<org::moecache1::Manager_proxy> {
    explicit Watcher(sdbus::IConnection& c) : ProxyInterfaces(c, "org.moecache1", "/org/moecache1") { registerProxy(); }
    virtual ~Watcher() { unregisterProxy(); }
    void onPressureBackoff(const std::string& source, const uint64_t&) override {
        if (source == "a test") pressure = true;
    }
    void onBudgetChanged(const std::string& name, const uint64_t& bytes) override {
        if (name == "lock") got = bytes;
    }
    std::atomic<uint64_t> got{0};
    std::atomic<bool> pressure{false};
};

TEST_F(DbusApi, SignalsAnnounceBudgetChanges) {
    start();
    auto conn = sdbus::createSessionBusConnectionWithAddress(bus_->address());
    Watcher w(*conn);
    conn->enterEventLoopAsync();
    ASSERT_EQ(ctl({"budget", "lock", "200MiB"}).exit_code, 0);
    for (int i = 0; i < 100 && w.got == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    conn->leaveEventLoop();
    EXPECT_EQ(w.got.load(), 200u << 20);
}

// A daemon in this process, on a private bus of the test's own (no socket, no /metrics, no
// telemetry, no PSI): tests drive its loop with step().
Result<std::unique_ptr<daemon::Daemon>> in_process_daemon(std::unique_ptr<test::PrivateBus>& bus, const test::TempDir& dir) {
    bus = std::make_unique<test::PrivateBus>(dir.path(), std::string(MOECACHE_SOURCE_DIR) + "/dbus/org.moecache1.conf");
    if (!bus->ok()) return fail(EIO, "private bus: " + bus->output());
    daemon::Config c;
    c.state_dir = dir.file("state");
    c.socket_path = "";
    c.metrics_listen = "";
    c.page_cache_telemetry = "off";
    c.pressure_enabled = false;
    c.dbus_bus = bus->address();
    return daemon::Daemon::create(c);
}

// A daemon in this process, on the private bus: a pressure back-off is signalled.
TEST_F(DbusApi, PressureBackoffIsSignalled) {
    auto d = in_process_daemon(bus_, dir_);
    ASSERT_TRUE(d) << d.error().what();
    ASSERT_EQ((*d)->status().bus, bus_->address());
    auto conn = sdbus::createSessionBusConnectionWithAddress(bus_->address());
    Watcher w(*conn);
    conn->enterEventLoopAsync();
    (*d)->on_pressure("a test");
    for (int i = 0; i < 100 && !w.pressure; ++i) ASSERT_TRUE((*d)->step(20));
    conn->leaveEventLoop();
    EXPECT_TRUE(w.pressure.load());
}

// The bus going away (its daemon stopped, or restarted) is a warning, not a crash: the daemon goes
// on without its D-Bus API and takes the bus back when it is there again. (Stopped mid-run on the
// GPU machine, the daemon threw out of its loop: "Failed to get bus poll data".)
TEST_F(DbusApi, TheBusGoingAwayIsAWarningAndItComesBack) {
    auto d = in_process_daemon(bus_, dir_);
    ASSERT_TRUE(d) << d.error().what();
    const std::string address = bus_->address();
    ASSERT_EQ((*d)->status().bus, address);
    bus_.reset();  // the bus daemon stops
    for (int i = 0; i < 50 && !(*d)->status().bus.empty(); ++i) ASSERT_TRUE((*d)->step(20));
    EXPECT_TRUE((*d)->status().bus.empty()) << "still on a bus that went away";
    for (int i = 0; i < 20; ++i) {
        ASSERT_TRUE((*d)->step(5));
        (*d)->tick();
    }
    // It comes back at the same address: the daemon connects again within its retry interval.
    bus_ = std::make_unique<test::PrivateBus>(dir_.path(), std::string(MOECACHE_SOURCE_DIR) + "/dbus/org.moecache1.conf");
    ASSERT_TRUE(bus_->ok()) << bus_->output();
    ASSERT_EQ(bus_->address(), address);
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while ((*d)->status().bus.empty() && std::chrono::steady_clock::now() < end) {
        (*d)->tick();
        ASSERT_TRUE((*d)->step(100));
    }
    ASSERT_EQ((*d)->status().bus, address) << "did not take the bus back";
    // moecachectl is answered again (the loop turns while it waits: the daemon is this process).
    test::Background ctl({MOECACHE_CTL_BIN, "--bus", address, "status"});
    int code = -1;
    for (int i = 0; i < 500 && code == -1; ++i) {
        ASSERT_TRUE((*d)->step(10));
        code = ctl.wait(0.01);
    }
    EXPECT_EQ(code, 0) << ctl.output();
    EXPECT_NE(ctl.output().find("lock"), std::string::npos) << ctl.output();
}

// A burst of setters over D-Bus is planned once per loop turn, not once per call: setters record
// what they change and the turn's end plans it.
TEST_F(DbusApi, ABurstOfSettersIsPlannedOncePerLoopTurn) {
    auto d = in_process_daemon(bus_, dir_);
    ASSERT_TRUE(d) << d.error().what();
    auto conn = sdbus::createSessionBusConnectionWithAddress(bus_->address());
    auto mgr = sdbus::createProxy(*conn, "org.moecache1", "/org/moecache1");
    std::atomic<int> replies{0}, errors{0};
    conn->enterEventLoopAsync();
    constexpr int kCalls = 20;
    const uint64_t before = (*d)->plans();
    for (int i = 0; i < kCalls; ++i)
        mgr->callMethodAsync("SetBudget")
            .onInterface("org.moecache1.Manager")
            .withArguments(std::string("lock"), std::to_string(100 + i) + "MiB")
            .uponReplyInvoke([&](const sdbus::Error* e) {
                if (e != nullptr) ++errors;
                ++replies;
            });
    uint64_t turns = 0;
    for (; turns < 500 && replies < kCalls; ++turns) ASSERT_TRUE((*d)->step(10));
    conn->leaveEventLoop();
    ASSERT_EQ(replies.load(), kCalls);
    EXPECT_EQ(errors.load(), 0);
    const uint64_t plans = (*d)->plans() - before;
    EXPECT_GE(plans, 1u);
    EXPECT_LE(plans, turns) << "at most one plan a turn";
    EXPECT_LT(plans, static_cast<uint64_t>(kCalls)) << "each setter planned on its own";
    EXPECT_EQ((*d)->config().lock_budget.resolve(1ull << 40), uint64_t{100 + kCalls - 1} << 20) << "the last setter wins";
}

}  // namespace
}  // namespace moecache
