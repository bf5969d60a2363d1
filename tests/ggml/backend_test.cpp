// libmoecache-ggml.so loaded into a real ggml (the llama.cpp release node-llama-cpp ships, built
// from the same source the library was built against), its MUL_MAT_ID against ggml-cpu's byte for
// byte: every expert on the CPU first, then with a pool that a CPU device stands in for (the GPU's
// half, over ggml's own CPU kernels), its rows joined with the CPU's. Built twice: with one device,
// and with two (MOECACHE_TEST_GGML_DEVICES "CPU,CPU": two pools, as on a machine with two GPUs).
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

struct PoolStats {  // the leading fields of the library's (backend/src/expert_pool.h)
    uint64_t pool_rows = 0, cpu_rows = 0, fills = 0, fill_bytes = 0, declined = 0;
    uint64_t forgotten = 0;
    uint64_t units = 0, nodes = 0, staged = 0, staged_bytes = 0, staged_admitted = 0;
};

#ifndef MOECACHE_TEST_GGML_DEVICES
#define MOECACHE_TEST_GGML_DEVICES "CPU"
#endif

struct DeviceStats {  // the library's moecache_ggml_device_stats (backend/src/expert_pool.h)
    uint64_t rows = 0;            // rows its pool computed
    uint32_t groups = 0;          // layers it serves
    uint32_t pooled_experts = 0;  // experts its pool holds now
};

struct Ggml {
    ggml_backend_t cpu = nullptr;
    ggml_backend_reg_t reg = nullptr;
    ggml_backend_dev_t dev = nullptr;
    ggml_backend_t mc = nullptr;
    void (*stats)(void*, size_t) = nullptr;  // the first bytes of the library's PoolStats
    void (*hold_fills)(bool) = nullptr;
    size_t (*devices)(DeviceStats*, size_t) = nullptr;  // each pool's figures; how many pools
};

Ggml& ggml() {
    static Ggml g = [] {
        Ggml r;
        // The pool on a CPU device (the stand-in for a GPU), half the experts' bytes.
        setenv("MOECACHE_GGML_DEVICE", MOECACHE_TEST_GGML_DEVICES, 1);
        setenv("MOECACHE_GGML_POOL", "50%", 1);
        ggml_backend_load_all_from_path(MOECACHE_GGML_LIBDIR);
        r.cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        r.reg = ggml_backend_load(MOECACHE_GGML_BACKEND_SO);
        if (r.reg != nullptr) {
            r.dev = ggml_backend_reg_dev_get(r.reg, 0);
            r.mc = ggml_backend_dev_init(r.dev, nullptr);
            r.stats = reinterpret_cast<void (*)(void*, size_t)>(ggml_backend_reg_get_proc_address(r.reg, "moecache_ggml_pool_stats"));
            r.hold_fills = reinterpret_cast<void (*)(bool)>(ggml_backend_reg_get_proc_address(r.reg, "moecache_ggml_hold_fills"));
            r.devices = reinterpret_cast<size_t (*)(DeviceStats*, size_t)>(
                ggml_backend_reg_get_proc_address(r.reg, "moecache_ggml_device_stats"));
        }
        return r;
    }();
    return g;
}

TEST(GgmlBackend, LoadsIntoTheRuntimesGgmlAsAnAcceleratorWithAHostBufferType) {
    auto& g = ggml();
    ASSERT_NE(g.cpu, nullptr) << "no CPU backend in " MOECACHE_GGML_LIBDIR;
    ASSERT_NE(g.reg, nullptr) << "ggml_backend_load(" MOECACHE_GGML_BACKEND_SO ") failed";
    EXPECT_STREQ(ggml_backend_reg_name(g.reg), "MOECACHE");
    ASSERT_NE(g.dev, nullptr);
    EXPECT_EQ(ggml_backend_dev_type(g.dev), GGML_BACKEND_DEVICE_TYPE_ACCEL);
    auto* buft = ggml_backend_dev_buffer_type(g.dev);
    EXPECT_STREQ(ggml_backend_buft_name(buft), "MOECACHE");  // what -ot exps=MOECACHE names
    EXPECT_TRUE(ggml_backend_buft_is_host(buft));
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(g.dev, &props);
    EXPECT_TRUE(props.caps.buffer_from_host_ptr);  // the loader keeps the model's mapping
    EXPECT_NE(g.mc, nullptr);
    EXPECT_NE(g.stats, nullptr);
}

// Every type the project's models use, one expert tensor each ([k, rows, experts], as llama.cpp's
// ffn_*_exps), placed as a load places them: in a MOECACHE buffer over a "mapping", and in a CPU
// buffer for ggml-cpu's own result. All placed before the first compute, as a model's are.
constexpr ggml_type kTypes[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_Q4_0, GGML_TYPE_Q4_1,
                                GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0, GGML_TYPE_Q2_K,
                                GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
constexpr int64_t kK = 512, kRows = 48, kExperts = 16;

struct Model {
    std::vector<std::vector<char>> mapping;  // by type: the bytes the MOECACHE buffers wrap
    std::vector<ggml_tensor*> mc, cpu;       // by type
    ggml_context* ctx = nullptr;
};

Model& model() {
    static Model m = [] {
        Model r;
        auto& g = ggml();
        ggml_init_params p{ggml_tensor_overhead() * 64, nullptr, true};
        r.ctx = ggml_init(p);
        std::mt19937 rng(7);
        std::normal_distribution<float> dist(0.0f, 1.0f);
        for (const ggml_type t : kTypes) {
            std::vector<float> f(static_cast<size_t>(kK * kRows * kExperts));
            for (auto& x : f) x = dist(rng) * 0.1f;
            std::vector<char> q(ggml_row_size(t, kK) * kRows * kExperts);
            ggml_quantize_chunk(t, f.data(), q.data(), 0, kRows * kExperts, kK, nullptr);
            const std::string name = std::string("blk.") + std::to_string(r.mc.size()) + ".ffn_up_exps.weight";
            ggml_tensor* mc = ggml_new_tensor_3d(r.ctx, t, kK, kRows, kExperts);
            ggml_set_name(mc, name.c_str());
            ggml_tensor* cpu = ggml_dup_tensor(r.ctx, mc);
            r.mapping.push_back(q);
            auto& bytes = r.mapping.back();
            ggml_backend_buffer_t buf = ggml_backend_dev_buffer_from_host_ptr(g.dev, bytes.data(), bytes.size(), bytes.size());
            EXPECT_EQ(ggml_backend_tensor_alloc(buf, mc, bytes.data()), GGML_STATUS_SUCCESS);
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            ggml_backend_buffer_t cbuf = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), bytes.size());
            EXPECT_EQ(ggml_backend_tensor_alloc(cbuf, cpu, ggml_backend_buffer_get_base(cbuf)), GGML_STATUS_SUCCESS);
            ggml_backend_tensor_set(cpu, bytes.data(), 0, bytes.size());
            r.mc.push_back(mc);
            r.cpu.push_back(cpu);
        }
        return r;
    }();
    return m;
}

// One MUL_MAT_ID as llama.cpp builds an expert FFN's: activations [k, 1 (gate, up) or used (down),
// tokens], ids [used, tokens] a view of a wider tensor (llama.cpp's are a view of its argsort).
std::vector<float> mul_mat_id(ggml_backend_t backend, ggml_tensor* w, const std::vector<float>& act,
                              const std::vector<int32_t>& ids_full, int64_t used, int64_t tokens, bool broadcast) {
    ggml_init_params p{ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context* ctx = ggml_init(p);
    ggml_tensor* b = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, kK, broadcast ? 1 : used, tokens);
    ggml_tensor* all_ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, kExperts, tokens);
    ggml_tensor* ids = ggml_view_2d(ctx, all_ids, used, tokens, all_ids->nb[1], 0);
    ggml_tensor* out = ggml_mul_mat_id(ctx, w, b, ids);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    ggml_backend_tensor_set(b, act.data(), 0, ggml_nbytes(b));
    ggml_backend_tensor_set(all_ids, ids_full.data(), 0, ggml_nbytes(all_ids));
    ggml_cgraph* graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    EXPECT_EQ(ggml_backend_graph_compute(backend, graph), GGML_STATUS_SUCCESS);
    std::vector<float> r(static_cast<size_t>(ggml_nelements(out)));
    ggml_backend_tensor_get(out, r.data(), 0, ggml_nbytes(out));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return r;
}

TEST(GgmlBackend, EveryTypesMulMatIdIsGgmlCpusByteForByteOnTheCpuAndSplitWithAPool) {
    auto& g = ggml();
    ASSERT_NE(g.mc, nullptr);
    auto& m = model();
    std::mt19937 rng(11);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    PoolStats before{};
    g.stats(&before, sizeof before);
    // Rounds: the first finds the pool empty (every row on the CPU); the misses it admits make
    // later rounds split. Routing skewed to the low experts, as routers are, so the pool (half
    // the bytes) holds some experts of every round and not others.
    for (int round = 0; round < 8; ++round) {
        PoolStats between{};
        g.stats(&between, sizeof between);  // waits for the fills the last round queued: each round sees them
        for (size_t i = 0; i < std::size(kTypes); ++i) {
            const bool broadcast = (round + i) % 2 == 0;
            // Decode's one token, small batches, and a large one (a prompt's: its misses staged).
            const int64_t used = 4, tokens = std::array<int64_t, 4>{1, 8, 15, 40}[static_cast<size_t>(round % 4)];
            std::vector<float> act(static_cast<size_t>(kK * (broadcast ? 1 : used) * tokens));
            for (auto& x : act) x = dist(rng);
            std::vector<int32_t> ids(static_cast<size_t>(kExperts * tokens));
            for (int64_t t = 0; t < tokens; ++t) {
                std::vector<int32_t> order(kExperts);
                for (int32_t e = 0; e < kExperts; ++e) order[static_cast<size_t>(e)] = e;
                std::shuffle(order.begin(), order.begin() + 8, rng);  // the first 4 of the hottest 8
                std::shuffle(order.begin() + 8, order.end(), rng);
                if (rng() % 4 == 0) std::swap(order[0], order[8 + rng() % 8]);  // now and then a cold one
                for (int32_t e = 0; e < kExperts; ++e) ids[static_cast<size_t>(t * kExperts + e)] = order[static_cast<size_t>(e)];
            }
            const auto want = mul_mat_id(g.cpu, m.cpu[i], act, ids, used, tokens, broadcast);
            const auto got = mul_mat_id(g.mc, m.mc[i], act, ids, used, tokens, broadcast);
            ASSERT_EQ(want.size(), got.size());
            ASSERT_EQ(0, memcmp(want.data(), got.data(), want.size() * sizeof(float)))
                << ggml_type_name(kTypes[i]) << ", round " << round << ", " << tokens << " tokens"
                << (broadcast ? ", activations broadcast" : "");
        }
    }
    PoolStats after{};
    g.stats(&after, sizeof after);
    EXPECT_GT(after.fills, before.fills) << "no expert was admitted to the pool";
    EXPECT_GT(after.pool_rows, before.pool_rows) << "no row was computed from the pool";
    EXPECT_GT(after.cpu_rows, before.cpu_rows) << "no row was computed on the CPU beside the pool";
    EXPECT_GT(after.staged, before.staged) << "no large batch's miss was staged on the device";
}

// Several devices: each pool holds the experts of layers of its own (no expert in two pools: a
// replicated cache made two GPUs slower than one), every layer is some device's, and each device
// computes its layers' pooled rows. With one device, that one serves every layer.
TEST(GgmlBackend, EachDevicesPoolHoldsTheExpertsOfItsOwnLayers) {
    auto& g = ggml();
    ASSERT_NE(g.mc, nullptr);
    ASSERT_NE(g.devices, nullptr);
    auto& m = model();
    std::mt19937 rng(3);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const int64_t used = 4, tokens = 4;
    for (int round = 0; round < 6; ++round) {
        PoolStats between{};
        g.stats(&between, sizeof between);  // the last round's fills are in
        std::vector<float> act(static_cast<size_t>(kK * tokens));
        for (auto& x : act) x = dist(rng);
        std::vector<int32_t> ids(static_cast<size_t>(kExperts * tokens));
        for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i + static_cast<size_t>(round)) % 6);
        for (size_t i = 0; i < std::size(kTypes); ++i) {
            const auto want = mul_mat_id(g.cpu, m.cpu[i], act, ids, used, tokens, true);
            const auto got = mul_mat_id(g.mc, m.mc[i], act, ids, used, tokens, true);
            ASSERT_EQ(0, memcmp(want.data(), got.data(), want.size() * sizeof(float))) << ggml_type_name(kTypes[i]);
        }
    }
    PoolStats s{};
    g.stats(&s, sizeof s);
    const std::string names = MOECACHE_TEST_GGML_DEVICES;
    const size_t expected = static_cast<size_t>(std::count(names.begin(), names.end(), ',')) + 1;
    std::array<DeviceStats, 8> d{};
    const size_t n = g.devices(d.data(), d.size());
    ASSERT_EQ(n, expected) << "pools made for MOECACHE_GGML_DEVICE=" << names;
    uint32_t groups = 0;
    uint64_t rows = 0;
    for (size_t i = 0; i < n; ++i) {
        EXPECT_GT(d[i].groups, 0u) << "device " << i << " serves no layer";
        EXPECT_GT(d[i].rows, 0u) << "device " << i << " computed no row from its pool";
        EXPECT_GT(d[i].pooled_experts, 0u) << "device " << i << "'s pool holds nothing";
        groups += d[i].groups;
        rows += d[i].rows;
    }
    EXPECT_EQ(groups, std::size(kTypes)) << "every layer is one device's";
    EXPECT_EQ(rows, s.pool_rows) << "the devices' rows are the pool's";
}

// A runtime that frees a model while the pool's thread still has fills queued from its memory
// (llama-bench at exit, llama-server swapping models: the mapping is unmapped next): the pool
// forgets the model's experts first. Its queued fills are dropped, never copied from that memory.
// A prompt on a pool with free slots (a run's start): the misses that cross to the device for the
// batch land in those slots and stay, copied once, rather than in staging and then again from the
// host by a fill; the next prompt finds them pooled. The results are ggml-cpu's byte for byte.
TEST(GgmlBackend, ALargeBatchsCrossingMissesStayInThePoolsFreeSlots) {
    auto& g = ggml();
    ASSERT_NE(g.mc, nullptr);
    auto& m = model();
    std::mt19937 rng(13);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const size_t q8 =
        static_cast<size_t>(std::find(std::begin(kTypes), std::end(kTypes), GGML_TYPE_Q8_0) - std::begin(kTypes));
    const int64_t used = 4, tokens = 40;  // a large batch (the backend's threshold is 32)
    PoolStats before{};
    g.stats(&before, sizeof before);
    for (int round = 0; round < 2; ++round) {
        std::vector<float> act(static_cast<size_t>(kK * tokens));
        for (auto& x : act) x = dist(rng);
        std::vector<int32_t> ids(static_cast<size_t>(kExperts * tokens));
        for (int64_t t = 0; t < tokens; ++t) {
            std::vector<int32_t> order(kExperts);
            for (int32_t e = 0; e < kExperts; ++e) order[static_cast<size_t>(e)] = e;
            std::shuffle(order.begin(), order.begin() + 6, rng);  // the batch uses the first 6 experts
            for (int32_t e = 0; e < kExperts; ++e)
                ids[static_cast<size_t>(t * kExperts + e)] = order[static_cast<size_t>(e)];
        }
        const auto want = mul_mat_id(g.cpu, m.cpu[q8], act, ids, used, tokens, true);
        const auto got = mul_mat_id(g.mc, m.mc[q8], act, ids, used, tokens, true);
        ASSERT_EQ(want.size(), got.size());
        ASSERT_EQ(0, memcmp(want.data(), got.data(), want.size() * sizeof(float))) << "round " << round;
        PoolStats now{};
        g.stats(&now, sizeof now);
        if (round == 0) {
            EXPECT_GT(now.staged_admitted, before.staged_admitted) << "no crossing miss stayed in a free slot";
            EXPECT_LE(now.staged_admitted, now.staged);
            before = now;
        } else {
            EXPECT_GT(now.pool_rows, before.pool_rows) << "the second prompt found none of the first's experts pooled";
        }
    }
}

TEST(GgmlBackend, AModelFreedWithFillsQueuedLeavesThePoolFirst) {
    auto& g = ggml();
    ASSERT_NE(g.mc, nullptr);
    ASSERT_NE(g.hold_fills, nullptr);
    auto& m = model();
    PoolStats before{};
    g.stats(&before, sizeof before);
    g.hold_fills(true);
    std::mt19937 rng(5);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    const int64_t used = 4, tokens = 8;
    std::vector<float> act(static_cast<size_t>(kK * tokens));
    for (auto& x : act) x = dist(rng);
    std::vector<int32_t> ids(static_cast<size_t>(kExperts * tokens));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % kExperts);
    for (size_t i = 0; i < std::size(kTypes); ++i) (void)mul_mat_id(g.mc, m.mc[i], act, ids, used, tokens, true);
    // Every model's buffer freed while its fills wait.
    for (auto* t : m.mc) ggml_backend_buffer_free(t->buffer);
    g.hold_fills(false);
    PoolStats after{};
    g.stats(&after, sizeof after);
    EXPECT_GT(after.forgotten, before.forgotten) << "no queued fill was dropped";
}

}  // namespace
