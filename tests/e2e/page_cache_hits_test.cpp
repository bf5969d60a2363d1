// The hit signal end to end: a real llama.cpp (node-llama-cpp, CPU) decodes a generated model
// whose routing skew is known, with libmoecache-rearm.so preloaded; the daemon, running beside it
// with its eBPF programs, counts page faults per expert. The experts the router favours must be
// the ones the daemon sees used: fault counts rank the experts as the generator ranked them.
#include "daemon_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/daemon/daemon.h"
#include "moecache/gguf.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <numeric>

namespace moecache::daemon {
namespace {

// Spearman rank correlation (ties get their mean rank).
double spearman(const std::vector<double>& a, const std::vector<double>& b) {
    auto ranks = [](const std::vector<double>& v) {
        std::vector<size_t> idx(v.size());
        std::iota(idx.begin(), idx.end(), 0);
        std::sort(idx.begin(), idx.end(), [&](size_t i, size_t j) { return v[i] < v[j]; });
        std::vector<double> r(v.size());
        for (size_t i = 0; i < idx.size();) {
            size_t j = i;
            while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
            for (size_t k = i; k <= j; ++k) r[idx[k]] = (static_cast<double>(i + j)) / 2.0;
            i = j + 1;
        }
        return r;
    };
    const auto ra = ranks(a), rb = ranks(b);
    const double n = static_cast<double>(a.size());
    const double ma = std::accumulate(ra.begin(), ra.end(), 0.0) / n, mb = std::accumulate(rb.begin(), rb.end(), 0.0) / n;
    double sab = 0, saa = 0, sbb = 0;
    for (size_t i = 0; i < ra.size(); ++i) {
        sab += (ra[i] - ma) * (rb[i] - mb);
        saa += (ra[i] - ma) * (ra[i] - ma);
        sbb += (rb[i] - mb) * (rb[i] - mb);
    }
    return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0;
}

TEST(PageCacheHits, FaultsOfReArmedExpertsRankThemAsTheRouterDoes) {
    if (::geteuid() != 0) GTEST_SKIP() << "the daemon's BPF programs need root";
    if (!std::filesystem::exists(std::string(MOECACHE_NODE_DIR) + "/node_modules/node-llama-cpp/package.json"))
        GTEST_SKIP() << "node-llama-cpp is not installed in " << MOECACHE_NODE_DIR << ": run scripts/setup/install-deps.sh";
    const auto f = bpf::probe_page_cache_features();
    if (!f.faults) GTEST_SKIP() << "no page-fault tracepoints on this kernel: " << f.missing;
    test::TempDir dir;
    const std::string model = dir.file("ds.gguf");
    const auto mk = test::run({MOECACHE_MKMODEL_BIN, "--output", model, "--preset", "deepseek-v4-flash", "--layers",
                               "8", "--experts-used", "4", "--expert-type", "q8_0"});
    ASSERT_EQ(mk.exit_code, 0) << mk.err;

    Config c = test::daemon_config(model, dir.file("state"), 1u << 20);
    c.admit_after_uses = 1000000;  // watch only: nothing locked, nothing prefetched
    c.page_cache_telemetry = "on";
    c.page_cache_ring_bytes = 16u << 20;
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();

    // Re-armed every 2 ms with no limit on the rate, about once per token on this machine, so
    // that the count of faults approaches the count of tokens that used an expert (the defaults,
    // a round a second at most 400 pages a second, are for production: see
    // bench/rearm-overhead.sh). 2000 tokens: the tail of the ranking needs them.
    test::Background node({"/usr/bin/env", std::string("LD_PRELOAD=") + MOECACHE_REARM_LIB, "MOECACHE_REARM_MS=2",
                           "MOECACHE_REARM_RATE=0", "node", std::string(MOECACHE_NODE_DIR) + "/generate.mjs", "--model", model, "--tokens", "2000",
                           "--threads", "1", "--seed", "3"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
    int rc = -1;
    while (std::chrono::steady_clock::now() < deadline) {
        ASSERT_TRUE((*d)->step(20));
        rc = node.wait(0.01);
        if (rc != -1) break;
    }
    ASSERT_EQ(rc, 0) << node.output();
    EXPECT_NE(node.output().find("moecache-rearm:"), std::string::npos) << node.output();
    for (int i = 0; i < 20; ++i) ASSERT_TRUE((*d)->step(10));
    const auto s = (*d)->status();
    uint64_t dropped = 0;
    for (uint64_t v : s.page_cache.dropped) dropped += v;
    EXPECT_EQ(dropped, 0u);

    // The generator's ranking: moecache.mkmodel.expert_rank, block-major, rank 0 the favourite.
    auto g = read_gguf(model);
    ASSERT_TRUE(g) << g.error().what();
    const auto* kv = g->find("moecache.mkmodel.expert_rank");
    ASSERT_NE(kv, nullptr);
    const auto* arr = std::get_if<GgufArrayRef>(&kv->value);
    ASSERT_NE(arr, nullptr);
    std::vector<uint32_t> rank(arr->count);
    UniqueFd fd(::open(model.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_EQ(::pread(fd.get(), rank.data(), rank.size() * 4, static_cast<off_t>(arr->offset)),
              static_cast<ssize_t>(rank.size() * 4));

    const auto& ms = s.models.at(0);
    std::map<uint32_t, std::vector<const ExpertStatus*>> by_block;
    for (const auto& e : ms.experts) by_block[e.block].push_back(&e);
    const uint32_t n_experts = static_cast<uint32_t>(by_block.begin()->second.size());
    double rho_sum = 0, top_share_sum = 0;
    for (const auto& [block, experts] : by_block) {
        std::vector<double> faults, favour;
        double top = 0, all = 0;
        for (const auto* e : experts) {
            const uint32_t r = rank.at(size_t{block} * n_experts + e->expert);
            faults.push_back(static_cast<double>(e->telemetry.faults));
            favour.push_back(-static_cast<double>(r));
            all += static_cast<double>(e->telemetry.faults);
            if (r < n_experts / 8) top += static_cast<double>(e->telemetry.faults);
        }
        rho_sum += spearman(faults, favour);
        top_share_sum += all > 0 ? top / all : 0;
    }
    const double rho = rho_sum / static_cast<double>(by_block.size());
    const double top_share = top_share_sum / static_cast<double>(by_block.size());
    std::cout << "[ measured ] " << s.page_cache.events << " page-cache events; per layer, Spearman(faults, intended "
              << "favour) " << rho << ", share of faults in the intended top eighth " << top_share << "\n";
    EXPECT_GT(rho, 0.5) << "fault counts do not follow the router's skew";
    EXPECT_GT(top_share, 0.35) << "the favoured eighth of the experts should take well over an eighth of the uses";
}

}  // namespace
}  // namespace moecache::daemon
