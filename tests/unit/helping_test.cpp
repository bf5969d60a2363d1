// "Is it helping": the verdict per model and the daemon's reasons (daemon/src/status/helping.cpp),
// the tier a routed expert is counted in, the process figures, and /status over HTTP.
#include "moecache/daemon/helping.h"
#include "metrics/metrics_server.h"
#include "moecache/daemon/metrics.h"
#include "moecache/http.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <string>

namespace moecache::daemon {
namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

ModelStatus loaded(const char* name) {
    ModelStatus m;
    m.name = name;
    m.path = std::string("/models/") + name + ".gguf";
    m.loaded = true;
    m.expert_bytes = 40ull << 30;
    return m;
}

TEST(Helping, ARoutedExpertIsCountedWhereTheRuntimeReachesIt) {
    EXPECT_EQ(reach(Tier::Storage, 1, 0, 100), Reach::Vram) << "a pool holds it";
    EXPECT_EQ(reach(Tier::Locked, 2, 100, 100), Reach::Vram) << "a pool's copy comes first";
    EXPECT_EQ(reach(Tier::Locked, 0, 0, 100), Reach::Ram);
    EXPECT_EQ(reach(Tier::Storage, 0, 90, 100), Reach::Ram) << "cached nine tenths";
    EXPECT_EQ(reach(Tier::Storage, 0, 89, 100), Reach::Storage);
    EXPECT_EQ(reach(Tier::Fetching, 0, 0, 100), Reach::Storage) << "being read is not there yet";
    EXPECT_EQ(reach(Tier::Storage, 0, 0, 0), Reach::Storage);
}

TEST(Helping, EachModelGetsAVerdictInWordsAndFigures) {
    DaemonStatus s;
    s.lock_cap = 8ull << 30;
    s.page_cache.enabled = true;

    ModelStatus broken;
    broken.path = "/models/broken.gguf";
    broken.error = "not a GGUF file";
    auto v = model_verdict(s, broken);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::CannotHelp);
    EXPECT_EQ(v.line, "broken.gguf: cannot help: not loaded: not a GGUF file");

    auto idle = loaded("idle");
    v = model_verdict(s, idle);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::Idle);
    EXPECT_TRUE(has(v.line, "no runtime has used it")) << v.line;

    auto blind = loaded("blind");
    blind.read_bytes = 3ull << 30;
    v = model_verdict(s, blind);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::Blind);
    EXPECT_TRUE(has(v.line, "no runtime reports its routing")) << v.line;
    EXPECT_TRUE(has(v.line, "3.0 GiB of it from storage")) << v.line;
    EXPECT_TRUE(has(v.line, "libmoecache-rearm.so")) << "says what to do: " << v.line;

    // A CPU runtime with the re-arm preload reports no routing: its faults and reads are the figures.
    auto cpu = loaded("cpu");
    cpu.read_bytes = 1ull << 30;
    cpu.outcome.touched[static_cast<size_t>(Reach::Ram)] = 90;
    cpu.outcome.touched[static_cast<size_t>(Reach::Storage)] = 10;
    v = model_verdict(s, cpu);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::Helping) << v.line;
    EXPECT_TRUE(has(v.line, "seen through the page cache")) << v.line;
    EXPECT_TRUE(has(v.line, "90.0 % were in RAM, 10.0 % read from storage")) << v.line;
    cpu.outcome.touched[static_cast<size_t>(Reach::Storage)] = 100;
    EXPECT_EQ(model_verdict(s, cpu).kind, ModelVerdict::Kind::CannotHelp) << model_verdict(s, cpu).line;

    auto prompts = loaded("prompts");
    prompts.routing_reported = true;
    prompts.outcome.prompt_tokens = 512;
    v = model_verdict(s, prompts);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::Idle);
    EXPECT_TRUE(has(v.line, "prompts only so far (512 tokens)")) << v.line;

    auto helping = loaded("helping");
    helping.routing_reported = true;
    helping.outcome.decode_tokens = 100;
    helping.outcome.prompt_tokens = 412;
    helping.outcome.routed[static_cast<size_t>(Reach::Vram)] = 600;
    helping.outcome.routed[static_cast<size_t>(Reach::Ram)] = 300;
    helping.outcome.routed[static_cast<size_t>(Reach::Storage)] = 100;
    helping.read_bytes = 512ull << 20;
    v = model_verdict(s, helping);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::Helping);
    EXPECT_EQ(v.line,
              "helping: helping: decode (100 tokens): of the experts routed 60.0 % were in VRAM, 30.0 % in RAM, "
              "10.0 % on storage; runtimes read 1.0 MiB a token from storage (512.0 MiB in all)");

    auto starved = helping;
    starved.name = "starved";
    starved.outcome.routed[static_cast<size_t>(Reach::Storage)] = 1000;
    v = model_verdict(s, starved);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::CannotHelp);
    EXPECT_TRUE(has(v.line, "most experts came from storage")) << v.line;
    EXPECT_TRUE(has(v.line, "may lock 8.0 GiB now against its 40.0 GiB of experts")) << v.line;
    EXPECT_TRUE(has(v.line, "raise [budget] lock")) << v.line;
    s.under_pressure = true;
    EXPECT_TRUE(has(model_verdict(s, starved).line, "memory pressure holds the locks down"));
}

// A model's name and a client's come from files and peers: what they hold is shown, never sent raw.
TEST(Helping, HostileNamesAreShownPrintable) {
    DaemonStatus s;
    auto m = loaded("x");
    m.name = "evil\xff\nname";
    s.models.push_back(m);
    ClientStatus c;
    c.name = "client\xfe";
    c.command_line_problem = "ollama's own runner";
    s.clients.push_back(c);
    for (const auto& line : helping_report(s)) {
        EXPECT_EQ(line.find('\n'), std::string::npos) << line;
        EXPECT_EQ(line.find('\xff'), std::string::npos) << line;
        EXPECT_EQ(line.find('\xfe'), std::string::npos) << line;
    }
}

TEST(Helping, TheReportAddsThePoolsSavingsAndWhatHoldsForTheDaemon) {
    DaemonStatus s;
    EXPECT_TRUE(helping_report(s).empty()) << "nothing to say";
    s.models.push_back(loaded("a"));
    PoolDeviceStatus p;
    p.device = 1;
    p.hits = 75;
    p.misses = 25;
    p.hit_bytes = 3ull << 30;
    p.miss_bytes = 1ull << 30;
    p.pool_bytes = 6ull << 30;
    s.vram_pools.push_back(p);
    PoolDeviceStatus unused;
    unused.device = 2;
    s.vram_pools.push_back(unused);
    ClientStatus c;
    c.name = "llama-server";
    c.pid = 42;
    c.miss_paths = {{0, protocol::MissPath::Registered}, {1, protocol::MissPath::PageableChosen}};
    s.clients.push_back(c);
    ClientStatus runner;
    runner.name = "moecache-cuda pid 77";
    runner.pid = 77;
    runner.command_line_problem = "this runtime was started with --load-mode none, ...";
    s.clients.push_back(runner);
    s.clients_without_model = 1;
    s.under_pressure = true;
    const auto r = helping_report(s);
    ASSERT_EQ(r.size(), 6u) << fmt::format("{}", fmt::join(r, "\n"));
    EXPECT_EQ(r[0], "a: idle: no runtime has used it since the daemon opened it");
    EXPECT_EQ(r[1],
              "GPU 1: the VRAM pools (6.0 GiB held now) served 75.0 % of the expert copies, 3.0 GiB that did not "
              "cross from host memory; 1.0 GiB did");
    EXPECT_TRUE(has(r[2], "llama-server (pid 42) GPU 1: slower than it could be")) << "only the slow path: " << r[2];
    EXPECT_EQ(r[3], "moecache-cuda pid 77 (pid 77): this runtime was started with --load-mode none, ...");
    EXPECT_TRUE(has(r[4], "1 runtime(s) copy model-sized buffers")) << r[4];
    EXPECT_TRUE(has(r[5], "memory pressure")) << r[5];
}

TEST(Helping, ProcessFiguresComeFromProcStatWhateverTheCommandIsCalled) {
    // Fields 3..24 after a command with spaces and parentheses: utime 250, stime 150 ticks, starttime
    // 1000 ticks after boot, vsize 123456789, rss 300 pages.
    const std::string stat =
        "4242 (moe (d) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 150 0 0 20 0 3 0 1000 123456789 300 "
        "18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
    const std::string proc_stat = "cpu  1 2 3 4\nbtime 1765000000\nprocesses 5\n";
    const auto p = parse_process_stat(stat, proc_stat, 100, 4096);
    ASSERT_TRUE(p);
    EXPECT_DOUBLE_EQ(p->cpu_seconds, 4.0);
    EXPECT_DOUBLE_EQ(p->start_time_seconds, 1765000010.0);
    EXPECT_EQ(p->virtual_bytes, 123456789u);
    EXPECT_EQ(p->resident_bytes, 300u * 4096);
    EXPECT_FALSE(parse_process_stat("4242 (cut) S 1 2", proc_stat, 100, 4096)) << "too few fields";
    EXPECT_FALSE(parse_process_stat("no parenthesis", proc_stat, 100, 4096));
    const auto self = read_process();
    EXPECT_GT(self.resident_bytes, 0u);
    EXPECT_GT(self.open_fds, 2u) << "stdin, stdout, stderr at least";
    EXPECT_GE(self.max_fds, self.open_fds);
    EXPECT_GT(self.start_time_seconds, 1.6e9);
}

TEST(Helping, MetricsHaveEveryTierAndTheProcessFromTheStart) {
    DaemonStatus s;
    s.models.push_back(loaded("a"));
    s.process.open_fds = 9;
    const std::string text = render_metrics(s);
    for (const char* tier : {"vram", "ram", "ssd"})
        EXPECT_TRUE(has(
            text,
            fmt::format("moecache_model_routed_experts_total{{model=\"a\",file=\"/models/a.gguf\",tier=\"{}\"}} 0\n",
                        tier)))
            << tier;
    EXPECT_TRUE(has(text, "moecache_model_tokens_total{model=\"a\",file=\"/models/a.gguf\",phase=\"decode\"} 0\n"));
    EXPECT_TRUE(has(text, "moecache_model_tokens_total{model=\"a\",file=\"/models/a.gguf\",phase=\"prompt\"} 0\n"));
    EXPECT_TRUE(has(text, "\nprocess_open_fds 9\n"));
    for (const char* f : {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
                          "process_max_fds", "process_start_time_seconds"})
        EXPECT_TRUE(has(text, fmt::format("# TYPE {} ", f))) << f;
}

TEST(Helping, StatusAnswersOverHttpAsMoecachectlPrintsIt) {
    DaemonStatus s;
    auto m = loaded("a");
    s.models.push_back(m);
    s.helping = helping_report(s);
    const std::string body = render_status_text(s);
    EXPECT_TRUE(has(body, "is it helping?\n  a: idle: no runtime has used it")) << body;

    auto server = MetricsServer::start("127.0.0.1:0", std::chrono::seconds(60));
    ASSERT_TRUE(server) << server.error().what();
    const std::string address = fmt::format("127.0.0.1:{}", (*server)->port());
    (*server)->publish("moecache_x 1\n");
    auto r = http_get(address, "/status", std::chrono::seconds(5));
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_EQ(r->status, 404) << "nothing published for /status yet";
    (*server)->publish("moecache_x 1\n", {}, body);
    r = http_get(address, "/status", std::chrono::seconds(5));
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, body);
    r = http_get(address, "/metrics", std::chrono::seconds(5));
    ASSERT_TRUE(r) << r.error().what();
    EXPECT_EQ(r->body, "moecache_x 1\n");

    // An address nothing listens on, and ones that are not addresses: errors that name them.
    server->reset();
    r = http_get(address, "/status", std::chrono::seconds(2));
    ASSERT_FALSE(r);
    EXPECT_TRUE(has(r.error().what(), "http://" + address)) << r.error().what();
    for (const char* bad : {"localhost:8474", "127.0.0.1", "127.0.0.1:70000", "[::1:80"}) {
        r = http_get(bad, "/status", std::chrono::seconds(1));
        ASSERT_FALSE(r) << bad;
        EXPECT_TRUE(has(r.error().what(), bad)) << r.error().what();
    }
}

}  // namespace
}  // namespace moecache::daemon
