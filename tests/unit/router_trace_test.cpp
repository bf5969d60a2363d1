// The routing trace as a component: what it writes, and a write that fails.
#include "moecache/daemon/router_trace.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace moecache::daemon {
namespace {

struct TempFile {
    std::string path;
    UniqueFd fd;
    TempFile() {
        char name[] = "/tmp/moecache-trace-XXXXXX";
        fd = UniqueFd(mkstemp(name));
        path = name;
    }
    ~TempFile() { unlink(path.c_str()); }
    [[nodiscard]] std::string text() const {
        std::string s;
        char buf[4096];
        const int r = open(path.c_str(), O_RDONLY | O_CLOEXEC);
        for (ssize_t n; (n = read(r, buf, sizeof buf)) > 0;) s.append(buf, static_cast<size_t>(n));
        close(r);
        return s;
    }
};

std::vector<std::string> lines(const std::string& s) {
    std::vector<std::string> out;
    size_t at = 0;
    for (size_t nl; (nl = s.find('\n', at)) != std::string::npos; at = nl + 1) out.push_back(s.substr(at, nl - at));
    return out;
}

ExpertMap small_map() {
    ExpertMap m;
    m.architecture = "qwen3moe";
    m.n_blocks = 2;
    m.n_experts = 8;
    m.n_experts_used = 2;
    return m;
}

// A trace starts over the file's old bytes, describes each model once before its decisions, and
// stop() flushes and counts the decisions.
TEST(RouterTrace, WritesAHeaderEachModelOnceAndItsDecisions) {
    TempFile f;
    ASSERT_GE(f.fd.get(), 0);
    ASSERT_EQ(write(f.fd.get(), "old bytes that are not kept\n", 28), 28);
    RouterTrace t;
    EXPECT_FALSE(t.on());
    EXPECT_FALSE(t.stop()) << "nothing to stop";
    const int raw = dup(f.fd.get());
    ASSERT_TRUE(t.start(UniqueFd(raw), 1.0));
    EXPECT_TRUE(t.on());
    EXPECT_FALSE(t.start(UniqueFd(dup(f.fd.get())), 1.0)) << "one trace at a time";
    const ExpertMap map = small_map();
    const std::vector<uint32_t> experts{3, 5};
    t.model(7, map, "/m.gguf");
    t.decision(7, 0, experts, 1);
    t.model(7, map, "/m.gguf");  // described already
    t.decision(7, 1, experts, 1);
    EXPECT_EQ(t.records(), 2u);
    const auto n = t.stop();
    ASSERT_TRUE(n);
    EXPECT_EQ(*n, 2u);
    EXPECT_FALSE(t.on());
    const auto l = lines(f.text());
    ASSERT_EQ(l.size(), 4u) << f.text();
    EXPECT_EQ(l[0].rfind("{\"moecache_trace\"", 0), 0u) << l[0];
    EXPECT_NE(l[1].find("/m.gguf"), std::string::npos) << l[1];
    EXPECT_EQ(f.text().find("old bytes"), std::string::npos);
}

// A write that fails closes the trace, and stop() says how far it got (EIO).
TEST(RouterTrace, AWriteThatFailsStopsItAndStopSaysSo) {
    TempFile f;
    RouterTrace t;
    ASSERT_TRUE(t.start(UniqueFd(dup(f.fd.get())), 1.0));
    const ExpertMap map = small_map();
    t.model(1, map, "/m.gguf");
    // No byte more may be written to the file: the next flush fails (EFBIG, its signal ignored).
    rlimit old{};
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
    const auto old_handler = signal(SIGXFSZ, SIG_IGN);
    rlimit none = old;
    none.rlim_cur = 0;
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &none), 0);
    const std::vector<uint32_t> experts{1};
    for (int i = 0; i < 10; ++i) t.decision(1, 0, experts, 1);
    t.flush();
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, old_handler);
    EXPECT_FALSE(t.on()) << "closed at the failed write";
    const auto n = t.stop();
    ASSERT_FALSE(n);
    EXPECT_EQ(n.error().errnum, EIO);
    EXPECT_NE(n.error().what().find("after 10 router decisions"), std::string::npos) << n.error().what();
    EXPECT_FALSE(t.stop()) << "said once";
}

}  // namespace
}  // namespace moecache::daemon
