// The CUDA hook's settings from its variables: pool sizes for every device and per device, the
// pinning modes, and a clear line (and the default) for anything else.
#include "moecache/cuda/hook_config.h"

#include <gtest/gtest.h>

#include <map>

namespace moecache::cuda {
namespace {

using Kind = PoolSize::Kind;

TEST(HookConfig, PoolSizesForEveryDeviceAndPerDevice) {
    std::string why;
    auto p = parse_pool_sizes("25%", &why);
    ASSERT_TRUE(p) << why;
    EXPECT_EQ(p->of(0), (PoolSize{Kind::Percent, 25}));
    EXPECT_EQ(p->of(63), (PoolSize{Kind::Percent, 25}));
    p = parse_pool_sizes("0:12G,1:6GiB", &why);
    ASSERT_TRUE(p) << why;
    EXPECT_EQ(p->of(0), (PoolSize{Kind::Bytes, 12.0 * (1 << 30)}));
    EXPECT_EQ(p->of(1), (PoolSize{Kind::Bytes, 6.0 * (1 << 30)}));
    EXPECT_EQ(p->of(2), PoolSize{}) << "a device not named: auto";
    p = parse_pool_sizes("20%,1:4096", &why);
    ASSERT_TRUE(p) << why;
    EXPECT_EQ(p->of(0), (PoolSize{Kind::Percent, 20}));
    EXPECT_EQ(p->of(1), (PoolSize{Kind::Bytes, 4096}));
    p = parse_pool_sizes("auto,3:0", &why);
    ASSERT_TRUE(p) << why;
    EXPECT_EQ(p->of(3), (PoolSize{Kind::Bytes, 0})) << "0: telemetry only";
    for (const char* bad : {"", "0:", "a:1G", "101%", "0:1G,0:2G", "1G,2G", "64:1G", "-1G", "1G,", "12 G", "x%"}) {
        why.clear();
        EXPECT_FALSE(parse_pool_sizes(bad, &why)) << bad;
        EXPECT_FALSE(why.empty()) << bad;
    }
}

// The settings from `env`, each line said about them in `said`.
struct Settings {
    std::map<std::string, std::string> env;
    std::vector<std::string> said;
    HookConfig operator()() {
        said.clear();
        return hook_config_from([&](const char* k) { return env.count(k) ? env[k].c_str() : nullptr; },
                                [&](const std::string& line) { said.push_back(line); });
    }
};

// PIN=off copies misses from pageable memory: with decode's experts on the GPU
// (GGML_OP_OFFLOAD_MIN_BATCH below llama.cpp's 32) that ran at 0.25-0.49x of -ot exps=CPU on the GPU
// machine, so there it is refused with its reason and auto is used; where decode stays on the CPU
// (only prompt batches copy experts) it is taken.
TEST(HookConfig, PinOffIsRefusedWhereDecodeCopiesExpertsToTheGpu) {
    Settings read;
    auto& env = read.env;
    auto& said = read.said;
    env = {{"MOECACHE_CUDA_PIN", "off"}, {"GGML_OP_OFFLOAD_MIN_BATCH", "1"}};
    EXPECT_EQ(read().pin, PinMode::Auto);
    ASSERT_EQ(said.size(), 1u);
    EXPECT_NE(said[0].find("MOECACHE_CUDA_PIN=off refused: with GGML_OP_OFFLOAD_MIN_BATCH=1"), std::string::npos) << said[0];
    EXPECT_NE(said[0].find("slower than without moecache"), std::string::npos) << said[0];
    env = {{"MOECACHE_CUDA_PIN", "off"}};
    EXPECT_EQ(read().pin, PinMode::Off) << "decode on the CPU: only prompts copy experts";
    EXPECT_TRUE(said.empty());
    env = {{"MOECACHE_CUDA_PIN", "off"}, {"GGML_OP_OFFLOAD_MIN_BATCH", "32"}};
    EXPECT_EQ(read().pin, PinMode::Off);
    env = {{"MOECACHE_CUDA_PIN", "staging"}, {"GGML_OP_OFFLOAD_MIN_BATCH", "1"}};
    EXPECT_EQ(read().pin, PinMode::Staging) << "staging is taken, and said to be slow once the pool is made";
}

TEST(HookConfig, VariablesWithDefaultsAndALineForWhatIsWrong) {
    Settings read;
    auto& env = read.env;
    auto& said = read.said;
    auto c = read();
    EXPECT_EQ(c.pin, PinMode::Auto) << "the registered tier, and staging where it pays, by default";
    EXPECT_TRUE(c.registers());
    EXPECT_TRUE(c.peers);
    EXPECT_EQ(c.pool.of(0), PoolSize{});
    EXPECT_TRUE(c.client);
    EXPECT_TRUE(c.one_place);
    EXPECT_FALSE(c.log);
    env = {{"MOECACHE_CUDA_PIN", "all"}, {"MOECACHE_CUDA_POOL", "1:2G"}, {"MOECACHE_CUDA_CLIENT", "off"},
           {"MOECACHE_CUDA_ONE_PLACE", "0"}, {"MOECACHE_CUDA_LOG", "1"}};
    c = read();
    EXPECT_EQ(c.pin, PinMode::All);
    EXPECT_EQ(c.pool.of(1), (PoolSize{Kind::Bytes, 2.0 * (1 << 30)}));
    EXPECT_FALSE(c.client);
    EXPECT_FALSE(c.one_place);
    EXPECT_TRUE(c.log);
    EXPECT_TRUE(said.empty());
    EXPECT_FALSE(c.registers()) << "all registers everything at once, not a tier";
    env = {{"MOECACHE_CUDA_PIN", "register"}, {"MOECACHE_CUDA_PIN_BUDGET", "8G"}, {"MOECACHE_CUDA_PEER", "off"}};
    c = read();
    EXPECT_TRUE(c.registers());
    EXPECT_EQ(c.pin_budget, 8ull << 30);
    EXPECT_FALSE(c.peers);
    EXPECT_TRUE(c.copy_kernel) << "on unless turned off";
    EXPECT_TRUE(c.ahead) << "on unless turned off";
    EXPECT_TRUE(c.claim) << "on unless turned off";
    EXPECT_EQ(c.claim_bytes(0), 0u) << "a share of the experts is not claimed: its size is not known ahead";
    env = {{"MOECACHE_CUDA_POOL", "25%,1:2G"}};
    EXPECT_EQ(read().claim_bytes(1), 2ull << 30);
    EXPECT_EQ(read().claim_bytes(0), 0u);
    env = {{"MOECACHE_CUDA_POOL", "2G"}, {"MOECACHE_CUDA_CLAIM", "off"}};
    EXPECT_EQ(read().claim_bytes(0), 0u);
    env = {{"MOECACHE_CUDA_COPY_KERNEL", "off"}};
    EXPECT_FALSE(read().copy_kernel);
    env = {{"MOECACHE_CUDA_AHEAD", "off"}};
    EXPECT_FALSE(read().ahead);
    EXPECT_TRUE(read().copy_kernel);
    env = {{"MOECACHE_CUDA_PIN", "staging"}, {"MOECACHE_CUDA_STAGING_THREADS", "4"}};
    EXPECT_EQ(read().pin, PinMode::Staging);
    EXPECT_FALSE(read().registers());
    EXPECT_EQ(read().staging_threads, 4u);
    env = {{"MOECACHE_CUDA_STAGING_THREADS", "0"}};
    EXPECT_EQ(read().staging_threads, 0u);
    EXPECT_EQ(said.size(), 1u) << "0 threads is no number of threads";
    env = {{"MOECACHE_CUDA_PIN", "off"}};
    EXPECT_EQ(read().pin, PinMode::Off);
    env = {{"MOECACHE_CUDA_PIN", "sometimes"}, {"MOECACHE_CUDA_POOL", "0:1G,0:2G"}};
    c = read();
    EXPECT_EQ(c.pin, PinMode::Auto);
    EXPECT_EQ(c.pool.of(0), PoolSize{});
    ASSERT_EQ(said.size(), 2u);
    EXPECT_NE(said[0].find("MOECACHE_CUDA_POOL=0:1G,0:2G"), std::string::npos) << said[0];
    EXPECT_NE(said[0].find("device 0 is given twice"), std::string::npos) << said[0];
    EXPECT_NE(said[1].find("MOECACHE_CUDA_PIN=sometimes"), std::string::npos) << said[1];
}

}  // namespace
}  // namespace moecache::cuda
