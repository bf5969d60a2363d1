// The Prometheus text the daemon serves: names, types, escaping of hostile label values, and what
// promtool (Debian's prometheus package) says of it.
#include "moecache/daemon/metrics.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>

#include <cstdlib>
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
    ExpertStatus e;
    e.tier = Tier::Locked;
    e.telemetry.read_bytes = 100;
    m.experts.push_back(e);
    e.tier = Tier::Storage;
    e.vram_holders = 1;
    m.experts.push_back(e);
    s.models.push_back(m);
    ModelStatus plain;
    plain.id = 4;
    plain.path = "/models/weird\nname\xfe.gguf";  // the same label once escaped: the id tells them apart
    s.models.push_back(plain);
    ClientStatus c;
    c.events = 7;
    s.clients.push_back(c);
    return s;
}

TEST(Metrics, FamiliesHaveTypesAndModelsTheirLabels) {
    const std::string text = render_metrics(sample());
    EXPECT_NE(text.find("# TYPE moecache_locked_bytes gauge\n"), std::string::npos);
    EXPECT_NE(text.find("# TYPE moecache_storage_read_bytes_total counter\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_locked_bytes{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",id=\"3\"} 4096\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("moecache_experts{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",id=\"3\",tier=\"vram\"} 1\n"),
              std::string::npos);
    EXPECT_NE(text.find("moecache_experts{model=\"we\\\"ird\\nname\xef\xbf\xbd.gguf\",id=\"3\",tier=\"ram\"} 1\n"),
              std::string::npos);
    EXPECT_NE(text.find("moecache_page_cache_events_dropped_total{kind=\"fault\"} 1\n"), std::string::npos);
    EXPECT_NE(text.find("moecache_router_events_total 7\n"), std::string::npos);
    for (size_t at = 0; (at = text.find('\n', at)) != std::string::npos; ++at)
        ASSERT_TRUE(at + 1 == text.size() || text[at + 1] == '#' || text.compare(at + 1, 9, "moecache_") == 0)
            << "a raw newline inside a sample at byte " << at;
}

TEST(Metrics, PromtoolAcceptsThem) {
    if (std::system("command -v promtool >/dev/null 2>&1") != 0)
        GTEST_SKIP() << "promtool is not installed (Debian's prometheus package; tools/setup/install-deps.sh installs it)";
    test::TempDir dir;
    test::write_file(dir.file("m.txt"), render_metrics(sample()));
    const auto r = test::run({"/bin/sh", "-c", "promtool check metrics < " + dir.file("m.txt")});
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
}

}  // namespace
}  // namespace moecache::daemon
