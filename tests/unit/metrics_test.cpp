// The Prometheus text the daemon serves: names, types, escaping of hostile label values, and what
// promtool (Debian's prometheus package) says of it.
#include "moecache/daemon/metrics.h"
#include "metrics/metrics_server.h"
#include "moecache/build_info.h"
#include "moecache/file_util.h"
#include "run.h"
#include "temp_dir.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <regex>
#include <string>

namespace moecache::daemon {
namespace {

TEST(Metrics, LabelValuesAreEscapedAndValidUtf8) {
    EXPECT_EQ(escape_label_value("plain.gguf"), "plain.gguf");
    EXPECT_EQ(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    EXPECT_EQ(escape_label_value("caf\xc3\xa9"), "caf\xc3\xa9") << "valid UTF-8 stays";
    EXPECT_EQ(escape_label_value("x\xffy"), "x\xef\xbf\xbdy") << "a stray byte becomes U+FFFD";
    EXPECT_EQ(escape_label_value("\xc0\xaf"), "\xef\xbf\xbd\xef\xbf\xbd") << "an overlong encoding is not UTF-8";
    EXPECT_EQ(escape_label_value("\xed\xa0\x80"), "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd") << "nor a surrogate";
    EXPECT_EQ(escape_label_value("\xe2\x82"), "\xef\xbf\xbd\xef\xbf\xbd") << "nor a cut sequence";
}

DaemonStatus sample() {
    DaemonStatus s;
    s.mem_total = 24ull << 30;
    s.lock_cap = 12ull << 30;
    s.page_cache.enabled = true;
    s.page_cache.sent[0] = 10;
    s.page_cache.dropped[2] = 1;
    ModelStatus m;
    m.id = 3;
    m.path = "/models/we\"ird\nname\xff.gguf";
    m.loaded = true;
    m.locked_bytes = 4096;
    m.recency_share = 0.25;
    ExpertStatus e;
    e.tier = Tier::Locked;
    e.telemetry.read_bytes = 100;
    m.experts.push_back(e);
    e.tier = Tier::Storage;
    e.vram_holders = 1;
    m.experts.push_back(e);
    e.tier = Tier::Locked;  // in a pool and locked as well ([vram] keep_ram_copy)
    m.experts.push_back(e);
    for (const auto& x : m.experts) {  // as status() counts them
        ++m.placements[static_cast<size_t>(placement(x.tier, x.vram_holders))];
        m.expert_telemetry.read_bytes += x.telemetry.read_bytes;
    }
    s.models.push_back(m);
    ModelStatus plain;
    plain.id = 4;
    plain.path = "/models/weird\nname\xfe.gguf";  // the same label once escaped: the id tells them apart
    s.models.push_back(plain);
    ClientStatus c;
    c.events = 7;
    c.miss_paths = {{0, protocol::MissPath::Registered}, {1, protocol::MissPath::PageableChosen}};
    s.clients.push_back(c);
    PoolDeviceStatus p;
    p.device = 1;
    p.hits = 90;
    p.misses = 10;
    p.hit_bytes = 9000;
    p.miss_bytes = 1000;
    p.pool_bytes = 1ull << 30;
    s.vram_pools.push_back(p);
    s.lock_budget = 16ull << 30;
    s.reserve = 2ull << 30;
    s.unmapped_copy_bytes = 3ull << 30;
    s.clients_without_model = 1;
    s.errors["saving heat profiles"] = 2;
    return s;
}

// The model label is what users call it (ModelStatus::name: an ollama tag, general.name); the file
// label tells two files of one name apart. No label changes when a client registers it again.
// What is running, for a dashboard and a bug report: the version and the commit built from, always
// 1; and the same line as --version.
// The changelog's newest version is the one the programs say.
TEST(Metrics, TheChangelogsNewestVersionIsTheBuilds) {
    const std::string log = test::read_file(std::string(MOECACHE_SOURCE_DIR) + "/CHANGELOG.md");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, std::regex("\n## ([0-9]+\\.[0-9]+\\.[0-9]+)"))) << "no version heading";
    EXPECT_EQ(m[1].str(), build_version());
}

TEST(Metrics, BuildInfoNamesTheVersionAndTheCommit) {
    const std::string text = daemon::render_metrics(daemon::DaemonStatus{}, false);
    const std::string want =
        fmt::format("moecache_build_info{{version=\"{}\",commit=\"{}\"}} 1\n", build_version(), build_commit());
    EXPECT_NE(text.find(want), std::string::npos) << text.substr(0, 400);
    EXPECT_NE(std::string(build_commit()), "") << "a commit, or \"unknown\" for a tree without git";
    const auto r = test::run({MOECACHE_CTL_BIN, "--version"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, "moecachectl " + version_line() + "\n");
    EXPECT_NE(r.out.find(std::string("(commit ") + build_commit() + ")"), std::string::npos);
}

// /health names what keeps the daemon from helping, a line each, and says ok when nothing does; a
// feature off by configuration (the bus, the page-cache telemetry) is no problem.
TEST(Metrics, HealthNamesWhatKeepsTheDaemonFromHelping) {
    DaemonStatus s;
    s.bus = "";
    s.page_cache.enabled = false;
    ModelStatus fine;
    fine.name = "fine";
    fine.loaded = true;
    s.models.push_back(fine);
    EXPECT_TRUE(health_problems(s).empty());
    ModelStatus broken;
    broken.name = "qwen3";
    broken.error = "not a GGUF file";
    s.models.push_back(broken);
    ModelStatus opening = broken;
    opening.opening = true;
    s.models.push_back(opening);
    s.under_pressure = true;
    s.clients_without_model = 2;
    const auto p = health_problems(s);
    ASSERT_EQ(p.size(), 3u);
    EXPECT_EQ(p[0], "model qwen3 is not loaded: not a GGUF file") << "one being opened is not yet a problem";
    EXPECT_NE(p[1].find("memory pressure"), std::string::npos);
    EXPECT_NE(p[2].find("2 runtime(s) copy model-sized buffers from memory that maps no model"), std::string::npos);

    auto server = MetricsServer::start("127.0.0.1:0", std::chrono::seconds(60));
    ASSERT_TRUE(server) << server.error().what();
    const auto get_health = [&] {
        const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in to{};
        to.sin_family = AF_INET;
        to.sin_port = htons(static_cast<uint16_t>((*server)->port()));
        to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to), 0);
        const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
        EXPECT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
        std::string got;
        char buf[4096];
        timeval tv{5, 0};
        ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        // Until the header and as many body bytes as it announces have come (or the peer closes).
        const auto complete = [&] {
            const size_t end = got.find("\r\n\r\n");
            if (end == std::string::npos) return false;
            const size_t cl = got.find("Content-Length: ");
            if (cl == std::string::npos || cl > end) return true;
            return got.size() >= end + 4 + std::stoul(got.substr(cl + 16));
        };
        for (ssize_t n; !complete() && (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
            got.append(buf, static_cast<size_t>(n));
        ::close(fd);
        return got;
    };
    (*server)->publish("moecache_x 1\n", p);
    std::string got = get_health();
    EXPECT_EQ(got.rfind("HTTP/1.1 200 OK", 0), 0u) << got;
    EXPECT_NE(got.find("\r\n\r\ndegraded: model qwen3 is not loaded: not a GGUF file\ndegraded: memory pressure"),
              std::string::npos)
        << got;
    (*server)->publish("moecache_x 1\n");
    got = get_health();
    EXPECT_NE(got.find("\r\n\r\nok\n"), std::string::npos) << got;
}

TEST(Metrics, AModelIsLabelledByItsNameAndFile) {
    auto s = sample();
    s.models[0].name = "qwen3:30b-a3b";
    s.models[0].path = "/var/lib/ollama/models/blobs/sha256-0123";
    const std::string text = render_metrics(s);
    EXPECT_NE(text.find("moecache_locked_bytes{model=\"qwen3:30b-a3b\",file=\"/var/lib/ollama/models/blobs/sha256-0123\"} 4096\n"),
              std::string::npos)
        << text;
    s.models[0].id = 42;
    EXPECT_EQ(render_metrics(s), text) << "the id is not a label";
}

TEST(Metrics, FamiliesHaveTypesAndModelsTheirLabels) {
    const std::string text = render_metrics(sample());
    EXPECT_NE(text.find("# TYPE moecache_locked_bytes gauge\n"), std::string::npos);
    EXPECT_NE(text.find("# TYPE moecache_storage_read_bytes_total counter\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_recency_share{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",file=\"/models/we\\\"ird\\nname\xef\xbf\xbd.gguf\"} 0.25\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("moecache_locked_bytes{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",file=\"/models/we\\\"ird\\nname\xef\xbf\xbd.gguf\"} 4096\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("moecache_experts{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",file=\"/models/we\\\"ird\\nname\xef\xbf\xbd.gguf\",tier=\"vram\"} 1\n"),
              std::string::npos);
    EXPECT_NE(text.find("moecache_experts{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",file=\"/models/we\\\"ird\\nname\xef\xbf\xbd.gguf\",tier=\"ram\"} 1\n"),
              std::string::npos);
    EXPECT_NE(text.find("moecache_experts{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",file=\"/models/we\\\"ird\\nname\xef\xbf\xbd.gguf\",tier=\"vram+ram\"} 1\n"),
              std::string::npos)
        << "an expert in a pool and locked is counted once, as both";
    EXPECT_NE(text.find("moecache_page_cache_events_dropped_total{kind=\"fault\"} 1\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_router_events_total 7\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_vram_pool_hits_total{device=\"1\"} 90\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_vram_pool_misses_total{device=\"1\"} 10\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_vram_pool_bytes{device=\"1\"} 1073741824\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_lock_budget_bytes 17179869184\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_lock_cap_bytes 12884901888\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_reserve_bytes 2147483648\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_hook_unmapped_copy_bytes_total 3221225472\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_hook_clients_without_model_mapping 1\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_hook_miss_path_devices{path=\"registered\"} 1\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_hook_miss_path_devices{path=\"pageable-chosen\"} 1\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_hook_miss_path_devices{path=\"slow-link\"} 0\n"), std::string::npos) << "every path from the start";
    EXPECT_NE(text.find("moecache_daemon_errors_total{doing=\"saving heat profiles\"} 2\n"), std::string::npos);
    for (size_t at = 0; (at = text.find('\n', at)) != std::string::npos; ++at)
        ASSERT_TRUE(at + 1 == text.size() || text[at + 1] == '#' || text.compare(at + 1, 9, "moecache_") == 0 ||
                    text.compare(at + 1, 8, "process_") == 0)
            << "a raw newline inside a sample at byte " << at;
}

// [metrics] paths = false (a port a cluster reaches): no model's path in the text, its file label
// the file name and a hash of the path, so that two files of one name stay two series.
TEST(Metrics, WithoutPathsTheFileLabelIsItsNameAndAHash) {
    DaemonStatus s = sample();
    ASSERT_FALSE(s.models.empty());
    s.models.resize(1);
    s.models[0].path = "/srv/models/ds.gguf";
    ModelStatus twin = s.models[0];
    twin.path = "/elsewhere/" + base_name(s.models[0].path);
    s.models.push_back(twin);
    const std::string dir = s.models[0].path.substr(0, s.models[0].path.rfind('/'));
    const std::string text = render_metrics(s, /*paths=*/false);
    EXPECT_EQ(text.find(dir + "/"), std::string::npos) << "a path in the text";
    EXPECT_EQ(text.find("/elsewhere/"), std::string::npos);
    const std::regex label("file=\"" + base_name(s.models[0].path) + "#([0-9a-f]{8})\"");
    std::set<std::string> hashes;
    for (std::sregex_iterator it(text.begin(), text.end(), label), end; it != end; ++it) hashes.insert((*it)[1]);
    EXPECT_EQ(hashes.size(), 2u) << "two files of one name, two series";
    EXPECT_NE(render_metrics(s).find(s.models[0].path), std::string::npos) << "paths by default";
}

TEST(Metrics, PromtoolAcceptsThem) {
    if (std::system("command -v promtool >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "promtool is not installed (Debian's prometheus package; scripts/setup/install-deps.sh installs it)";
    test::TempDir dir;
    test::write_file(dir.file("m.txt"), render_metrics(sample()));
    const auto r = test::run({"/bin/sh", "-c", "promtool check metrics < " + dir.file("m.txt")});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

// Every panel of config/grafana-dashboard.json: its PromQL parses (promtool checks it as a recording
// rule) and every moecache_ metric it names is one the daemon serves.
TEST(Metrics, TheDashboardAsksOnlyForWhatIsServedInValidPromQL) {
    const auto dash = nlohmann::json::parse(test::read_file(std::string(MOECACHE_SOURCE_DIR) + "/config/grafana-dashboard.json"));
    const std::string served = render_metrics(sample());
    std::vector<std::string> exprs;
    for (const auto& p : dash.at("panels"))
        for (const auto& t : p.value("targets", nlohmann::json::array())) exprs.push_back(t.at("expr").get<std::string>());
    ASSERT_GT(exprs.size(), 10u);
    // Rates over Grafana's $__rate_interval (at least four scrapes whatever the zoom), no fixed window.
    for (const auto& e : exprs)
        EXPECT_FALSE(std::regex_search(e, std::regex("rate\\([^)]*\\[[0-9]+[smh]\\]"))) << "a fixed rate window: " << e;
    // The row that says whether moecache helps comes first, with the diagnostics that say it does not.
    const auto& first = dash.at("panels").at(0);
    EXPECT_EQ(first.value("type", ""), "row");
    EXPECT_EQ(first.value("title", ""), "Is it helping?");
    std::string row;
    for (const auto& p : dash.at("panels")) {
        if (&p != &first && p.value("type", "") == "row") break;
        for (const auto& t : p.value("targets", nlohmann::json::array())) row += t.at("expr").get<std::string>() + "\n";
    }
    for (const char* f :
         {"moecache_model_routed_experts_total", "moecache_model_tokens_total", "moecache_storage_read_bytes_total",
          "moecache_hook_clients_without_model_mapping", "moecache_hook_unmapped_copy_bytes_total",
          "moecache_hook_miss_path_devices", "moecache_miss_fetches_total", "moecache_daemon_errors_total"})
        EXPECT_NE(row.find(f), std::string::npos) << f << " is not in the \"Is it helping?\" row";
    const std::regex name("moecache_[a-z_]+");
    for (const auto& e : exprs)
        for (auto it = std::sregex_iterator(e.begin(), e.end(), name); it != std::sregex_iterator(); ++it)
            EXPECT_NE(served.find("# TYPE " + it->str() + " "), std::string::npos) << it->str() << " in " << e;
    if (std::system("command -v promtool >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "promtool is not installed (Debian's prometheus package; scripts/setup/install-deps.sh installs it)";
    // Dashboard variables become a plain regex for the parser.
    std::string rules = "groups:\n- name: dashboard\n  rules:\n";
    for (size_t i = 0; i < exprs.size(); ++i) {
        const std::string ranged =
            std::regex_replace(exprs[i], std::regex("\\$__(rate_interval|interval|range)"), "5m");
        const std::string e = std::regex_replace(ranged, std::regex("\\$[a-z_]+"), ".*");
        rules += fmt::format("  - record: dashboard:expr{}\n    expr: {}\n", i, nlohmann::json(e).dump());
    }
    test::TempDir dir;
    test::write_file(dir.file("rules.yml"), rules);
    const auto r = test::run({"promtool", "check", "rules", dir.file("rules.yml")});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err << rules;
}

// One word for where an expert is, for /metrics and D-Bus alike (they used to disagree about an
// expert in a pool that the daemon also keeps locked).
TEST(Placement, EveryCombinationHasOneWord) {
    EXPECT_STREQ(to_string(placement(Tier::Storage, 0)), "ssd");
    EXPECT_STREQ(to_string(placement(Tier::Fetching, 0)), "fetching");
    EXPECT_STREQ(to_string(placement(Tier::Locked, 0)), "ram");
    EXPECT_STREQ(to_string(placement(Tier::Storage, 1)), "vram");
    EXPECT_STREQ(to_string(placement(Tier::Fetching, 2)), "vram") << "read for RAM while a pool holds it: the pool serves it";
    EXPECT_STREQ(to_string(placement(Tier::Locked, 1)), "vram+ram");
}

}  // namespace
}  // namespace moecache::daemon
