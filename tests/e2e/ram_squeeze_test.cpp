// The RAM squeeze, scaled down for CI (bench/ram-squeeze.sh is the full one): a real llama.cpp
// (node-llama-cpp, CPU, one thread) decodes a generated MoE model inside a memory cgroup that
// holds its own memory and about half the model. Plain mmap against moecached (in the same cgroup)
// with lazy load and the hit signal: moecache must read fewer bytes from storage per token, and
// nothing may be OOM-killed. Bytes read are the model's block device's own count
// (/sys/dev/block/MAJ:MIN/stat), from the start of the model's load to the end of decoding; the
// test runs alone (RUN_SERIAL) so that nothing else reads that disk meanwhile.
#include "memory_cgroup.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

namespace moecache {
namespace {

namespace fs = std::filesystem;

// Sectors read by block device `dev` (0 when the kernel keeps no count for it).
uint64_t sectors_read(dev_t dev) {
    std::ifstream f(fmt::format("/sys/dev/block/{}:{}/stat", major(dev), minor(dev)));
    uint64_t reads = 0, merges = 0, sectors = 0;
    f >> reads >> merges >> sectors;
    return sectors;
}

struct Decode {
    nlohmann::json out;
    uint64_t bytes_read = 0;
    uint64_t oom_kills = 0;
    [[nodiscard]] double tokens() const { return out.value("tokens", 0.0); }
    [[nodiscard]] double per_token() const { return tokens() > 0 ? static_cast<double>(bytes_read) / tokens() : 0; }
};

TEST(RamSqueeze, MoecacheReadsLessPerTokenThanPlainMmap) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: a memory cgroup, the daemon's locks and BPF programs";
    const std::string node_dir = MOECACHE_NODE_DIR;
    if (!fs::exists(node_dir + "/node_modules/node-llama-cpp/package.json"))
        GTEST_SKIP() << "node-llama-cpp is not installed in " << node_dir << ": run scripts/setup/install-deps.sh";
    // On disk, not in memory: a model on tmpfs is never read from storage.
    const char* env_dir = std::getenv("MOECACHE_SQUEEZE_DIR");
    const std::string base = env_dir ? env_dir : "/var/tmp";
    struct statfs sf {};
    ASSERT_EQ(::statfs(base.c_str(), &sf), 0) << base;
    if (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC) GTEST_SKIP() << base << " is in memory (tmpfs)";
    struct stat st {};
    ASSERT_EQ(::stat(base.c_str(), &st), 0);
    if (major(st.st_dev) == 0 || sectors_read(st.st_dev) == 0)
        GTEST_SKIP() << base << " is on no block device whose reads the kernel counts (an overlay?): "
                     << "set MOECACHE_SQUEEZE_DIR to a disk's directory";
    auto made = test::MemoryCgroup::create("moecache-squeeze-test.", test::MemoryCgroup::kNoLimit);
    if (!made) GTEST_SKIP() << "no memory cgroup: " << made.error().what();
    const auto& cg = *made;

    ::setenv("TMPDIR", base.c_str(), 1);
    test::TempDir dir;
    const std::string model = dir.file("squeeze.gguf");
    // ~120 MiB: 12 MoE layers x 32 experts of 320 KiB, 4 used per token, a DeepSeek-like skew.
    const auto mk = test::run({MOECACHE_MKMODEL_BIN, "--output", model, "--layers", "12", "--experts", "32",
                               "--experts-used", "4", "--embd", "512", "--ff", "192", "--skew", "2", "--seed", "11"});
    ASSERT_EQ(mk.exit_code, 0) << mk.err;
    const uint64_t model_bytes = fs::file_size(model);

    auto decode = [&](const std::vector<std::string>& env, int tokens, bool in_cgroup) {
        std::vector<std::string> argv = {"/usr/bin/env"};
        argv.insert(argv.end(), env.begin(), env.end());
        argv.insert(argv.end(), {"node", node_dir + "/generate.mjs", "--model", model, "--tokens", std::to_string(tokens),
                                 "--threads", "1", "--max-seconds", "60", "--seed", "5"});
        Decode d;
        const uint64_t s0 = sectors_read(st.st_dev), k0 = cg->oom_kills();
        const auto r = test::run(in_cgroup ? cg->inside(argv) : argv, {}, 240);
        d.bytes_read = (sectors_read(st.st_dev) - s0) * 512;
        d.oom_kills = cg->oom_kills() - k0;
        EXPECT_EQ(r.exit_code, 0) << r.err;
        d.out = nlohmann::json::parse(r.out, nullptr, false);
        EXPECT_FALSE(d.out.is_discarded()) << r.out << r.err;
        if (d.out.is_discarded()) d.out = nlohmann::json::object();
        return d;
    };

    // The runtime's own memory, unsqueezed: the limit holds it and about half the model.
    const Decode free = decode({}, 32, false);
    const auto anon = free.out.value("rss_anon_bytes", uint64_t{0});
    ASSERT_GT(anon, 0u) << free.out.dump();
    const uint64_t limit = anon + (48ull << 20) + model_bytes / 2;
    ASSERT_TRUE(cg->set_limit(limit));
    std::cout << "[ measured ] model " << (model_bytes >> 20) << " MiB, runtime anon " << (anon >> 20)
              << " MiB, cgroup limit " << (limit >> 20) << " MiB\n";

    constexpr int kTokens = 64;
    test::drop_page_cache(model);
    const Decode plain = decode({}, kTokens, true);

    // moecached in the same cgroup, cold (no heat yet): its lock budget a sixth of the model.
    const std::string state = dir.file("state");
    fs::create_directories(state);
    std::ofstream(dir.file("moecached.toml")) << fmt::format(
        "[daemon]\nstate_dir = \"{}\"\nsocket = \"{}\"\ntick_seconds = 0.2\n[budget]\nlock = {}\nreserve = 0\n"
        "[pressure]\nenabled = false\n[metrics]\nlisten = \"\"\n[dbus]\nbus = \"off\"\n[[model]]\npath = \"{}\"\n",
        state, dir.file("moecached.sock"), model_bytes / 6, model);
    test::drop_page_cache(model);
    Decode squeezed;
    {
        test::Background daemon(cg->inside({MOECACHE_DAEMON_BIN, "--config", dir.file("moecached.toml")}));
        ASSERT_TRUE(daemon.wait_for("moecached running", 30)) << daemon.output();
        if (daemon.output().find("page-cache telemetry on") == std::string::npos)
            std::cout << "[ note ] the daemon runs without page-cache telemetry here: no reads on a miss\n";
        squeezed = decode({std::string("LD_PRELOAD=") + MOECACHE_REARM_LIB, "MOECACHE_REARM_EXE=node", "MOECACHE_LOAD=lazy"},
                          kTokens, true);
        daemon.signal(SIGTERM);
        EXPECT_EQ(daemon.wait(30), 0) << daemon.output();
    }

    std::cout << "[ measured ] plain mmap: " << plain.tokens() << " tokens at "
              << plain.out.value("decode_tokens_per_second", 0.0) << " tok/s, " << plain.per_token() / 1048576
              << " MiB read per token, " << plain.oom_kills << " OOM kills\n"
              << "[ measured ] moecache:   " << squeezed.tokens() << " tokens at "
              << squeezed.out.value("decode_tokens_per_second", 0.0) << " tok/s, " << squeezed.per_token() / 1048576
              << " MiB read per token, " << squeezed.oom_kills << " OOM kills\n";
    ASSERT_GT(plain.tokens(), 1) << plain.out.dump();
    ASSERT_GT(squeezed.tokens(), 1) << squeezed.out.dump();
    EXPECT_LT(squeezed.per_token(), plain.per_token()) << "moecache must read less from storage per token";
    EXPECT_EQ(squeezed.oom_kills, 0u) << "moecache: nothing may be OOM-killed";
}

}  // namespace
}  // namespace moecache
