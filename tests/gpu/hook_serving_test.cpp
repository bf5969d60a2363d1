// The CUDA hook under real serving, driven as llama.cpp drives it: decoding on one stream, then a
// new context (new streams: llama-bench runs its prompt and generation tests in separate ones),
// prompt batches that copy nearly every expert, several GPUs that each copy their own layers, and
// the ways misses reach the device. Over tests' fake libcuda.so.1 (label unit) its streams run
// their work as late as the API allows, so a missing wait shows as wrong bytes; against the real
// driver (label gpu) on the GPU machine. Each test sets the hook's variables first: ctest runs each
// in a process of its own.
#include "hook/cuda_driver.h"
#include "moecache/cuda/hot_profile.h"
#include "moecache/gguf.h"
#include "model_fixture.h"
#include "preload_main.h"
#include "temp_dir.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <tuple>
#include <regex>
#include <thread>

namespace moecache::test {
namespace {

// The fake driver's counters (support/fake_cuda).
struct FakeCounts {
    unsigned long long htod_calls, htod_bytes, dtod_calls, dtod_bytes, allocs, frees, syncs, event_waits, registered;
    unsigned long long peer_calls, peer_bytes;
    unsigned long long kernel_launches, kernel_bytes;
    unsigned long long captures, invalidated;
};

class HookServing : public ::testing::Test {
protected:
    // The hook's variables for this test, and how many devices the fake driver shows.
    virtual std::vector<std::pair<const char*, const char*>> env() const { return {}; }
    virtual int devices() const { return 1; }
    virtual bool map_model() const { return true; }
    // After the model is written, before this process maps it (and the hook can find it).
    virtual void before_map() {}

    void SetUp() override {
        ASSERT_TRUE(hook_.load()) << "libmoecache-cuda.so is not preloaded (ctest sets LD_PRELOAD)";
        if (hook_.stats().copies != 0)
            GTEST_SKIP() << "the hook reads its variables once per process: run this test alone (ctest does)";
        setenv("MOECACHE_CUDA_PIN", "off", 1);
        for (const auto& [k, v] : env()) setenv(k, v, 1);
        if (auto why = cu_.load(); !why.empty()) GTEST_SKIP() << why;
        if (auto* async = cu_.knob<int>("fake_cuda_async")) *async = 1;
        if (auto* n = cu_.knob<int>("fake_cuda_devices")) *n = devices();
        int have = 0;
        ASSERT_EQ(cu_.device_count(&have), CUDA_SUCCESS);
        if (have < devices()) GTEST_SKIP() << "needs " << devices() << " GPUs, this machine has " << have;
        if (!map_model()) return;
        auto spec = small_spec();
        spec.n_layers = 4;
        spec.n_experts = 32;
        spec.n_experts_used = 4;
        spec.n_ff_exp = 256;
        spec.n_embd = 512;
        files_ = write_model(spec, dir_.path() + "/serve.gguf");
        before_map();
        ASSERT_EQ(model_.open(files_[0]), "");
        slice_ = model_.map.layers[0].tensors[0].bytes_per_expert;
        for (uint32_t l = 0; l < 4; ++l) {
            ASSERT_TRUE(cu_.use_device(device_of(l)));
            for (uint32_t t = 0; t < 3; ++t) ASSERT_EQ(cu_.mem_alloc(&dst_[l][t], slice_ * 32 + 512), CUDA_SUCCESS);
        }
        ASSERT_TRUE(cu_.use_device(0));
    }
    // With two devices, split by layer as llama.cpp splits: layers 0-1 on device 0, 2-3 on 1.
    [[nodiscard]] int device_of(uint32_t layer) const { return devices() > 1 && layer >= 2 ? 1 : 0; }
    // Expert ids one token routes each layer to: skewed, so that the pool has hits and evictions.
    std::vector<uint32_t> token_ids() {
        std::vector<uint32_t> ids;
        while (ids.size() < 4) {
            const uint32_t e = std::min<uint32_t>(pick_(rng_), 31);
            if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
        }
        return ids;
    }
    // One decoded token: every layer's routed experts, every expert tensor, on `streams[device]`.
    // With `check`, each copy's destination is read back and compared with the file.
    void token(const std::vector<CUstream>& streams, bool check = false) {
        for (uint32_t l = 0; l < 4 && !HasFailure(); ++l) {
            const int d = device_of(l);
            ASSERT_TRUE(cu_.use_device(d));
            const auto ids = token_ids();
            for (uint32_t t = 0; t < 3; ++t) {
                if (check) ASSERT_GE(copy_and_check(cu_, model_, dst_[l][t], l, t, ids, streams[static_cast<size_t>(d)]), 1);
                else ASSERT_TRUE(copy_experts(cu_, model_, dst_[l][t], l, t, ids, streams[static_cast<size_t>(d)]));
            }
        }
        ASSERT_TRUE(cu_.use_device(0));
    }
    std::vector<CUstream> new_streams() {
        std::vector<CUstream> s(static_cast<size_t>(devices()));
        for (int d = 0; d < devices(); ++d) {
            EXPECT_TRUE(cu_.use_device(d));
            EXPECT_EQ(cu_.stream_create(&s[static_cast<size_t>(d)], 0), CUDA_SUCCESS);
        }
        EXPECT_TRUE(cu_.use_device(0));
        return s;
    }
    void destroy(const std::vector<CUstream>& streams) {
        for (int d = 0; d < devices(); ++d) {
            ASSERT_TRUE(cu_.use_device(d));
            ASSERT_EQ(cu_.stream_destroy(streams[static_cast<size_t>(d)]), CUDA_SUCCESS);
        }
        ASSERT_TRUE(cu_.use_device(0));
    }
    // The hook finds the model (first token), makes a pool for each device that copied experts
    // (second), sized for the layers each device copied (third).
    void warm_up(const std::vector<CUstream>& streams) {
        token(streams);
        ASSERT_GE(hook_.sync(10000), 1) << "the hook did not find the mapped model";
        for (int i = 0; i < 2; ++i) {
            token(streams);
            ASSERT_GE(hook_.sync(10000), 1);
        }
    }
    // Expert bytes of the layers device `d` copies, with the 512 bytes of tail room a pool keeps
    // after each slice (the next slice's head).
    uint64_t expert_bytes_of(int d) const {
        uint64_t b = 0;
        for (uint32_t l = 0; l < 4; ++l)
            if (device_of(l) == d)
                b += (model_.map.layers[l].bytes_per_expert + 512ull * model_.map.layers[l].tensors.size()) * model_.map.n_experts;
        return b;
    }
    double hit_rate(const moecache_cuda_stats& a, const moecache_cuda_stats& b) const {
        const double hits = static_cast<double>(b.slice_hits - a.slice_hits);
        const double all = hits + static_cast<double>(b.slice_misses - a.slice_misses);
        return all > 0 ? hits / all : 0;
    }
    void sync_all() {
        for (int d = 0; d < devices(); ++d) {
            ASSERT_TRUE(cu_.use_device(d));
            ASSERT_EQ(cu_.ctx_synchronize(), CUDA_SUCCESS);
        }
        ASSERT_TRUE(cu_.use_device(0));
    }

    TempDir dir_;
    CudaDriver cu_;
    HookProbe hook_;
    std::vector<std::string> files_;
    MappedModel model_;
    uint64_t slice_ = 0;
    CUdeviceptr dst_[4][3] = {};
    std::mt19937 rng_{7};
    std::geometric_distribution<uint32_t> pick_{0.15};
};

class NewContexts : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override { return {{"MOECACHE_CUDA_POOL", "40%"}}; }
};

TEST_F(NewContexts, ANewContextFindsThePoolItsPredecessorFilled) {
    auto a = new_streams();
    warm_up(a);
    for (int i = 0; i < 150; ++i) token(a, i % 25 == 0);
    const auto warm = hook_.stats();
    for (int i = 0; i < 30; ++i) token(a);
    const auto before = hook_.stats();
    const double rate_a = hit_rate(warm, before);
    ASSERT_GT(rate_a, 0.3) << "the pool did not warm up on the first context";
    // llama-bench frees its prompt test's context and makes a new one: new streams (the driver may
    // hand out the same handles again).
    destroy(a);
    auto b = new_streams();
    token(b, true);
    for (int i = 0; i < 29; ++i) token(b, i % 10 == 0);
    const auto after = hook_.stats();
    const double rate_b = hit_rate(before, after);
    EXPECT_GT(rate_b, 0.8 * rate_a) << "the new context's hit rate " << rate_b << " against " << rate_a << " before";
    EXPECT_GT(after.stream_joins, before.stream_joins) << "the new stream took over the old one's slots";
    EXPECT_EQ(after.fallbacks, 0u);
    destroy(b);
}

TEST_F(NewContexts, TwoLiveContextsShareThePoolByteForByte) {
    auto a = new_streams(), b = new_streams();
    warm_up(a);
    const auto before = hook_.stats();
    // Tokens alternate between two contexts that both stay alive (two requests served at once).
    for (int i = 0; i < 120 && !HasFailure(); ++i) token(i % 2 ? b : a, i % 4 < 2);
    const auto after = hook_.stats();
    EXPECT_GT(hit_rate(before, after), 0.3);
    EXPECT_GT(after.stream_joins, before.stream_joins + 20) << "slots pass between the streams";
    if (cu_.fake()) {
        EXPECT_GT(cu_.knob<FakeCounts>("fake_cuda_counts")->event_waits, 0u) << "a stream waited for the other";
    }
    destroy(a);
    destroy(b);
}

class Prompts : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override { return {{"MOECACHE_CUDA_POOL", "25%"}}; }
};

TEST_F(Prompts, APromptBatchDisplacesNothingOfTheDecodingHotSet) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 200; ++i) token(s);
    const auto decoded = hook_.stats();
    ASSERT_GT(decoded.evicted, 0u) << "the decoding hot set should have been chosen by eviction";
    // Three prompt batches of 64 tokens: every layer copies nearly every expert (the few no token
    // routed to break it into groups: the first group of the first layer is three experts), then
    // one copies whole tensors, each after the runtime read its router's ids back, as llama.cpp does.
    CUdeviceptr ids_dev = 0;
    ASSERT_EQ(cu_.mem_alloc(&ids_dev, 1u << 12), CUDA_SUCCESS);
    for (int batch = 0; batch < 3 && !HasFailure(); ++batch)
        for (uint32_t l = 0; l < 4; ++l) {
            std::vector<uint32_t> ids;
            for (uint32_t e = 0; e < 32; ++e)
                if (batch == 2 || e % 11 != static_cast<uint32_t>(batch) + 3) ids.push_back(e);
            std::vector<int32_t> routed(64 * model_.map.n_experts_used);
            for (size_t i = 0; i < routed.size(); ++i) routed[i] = static_cast<int32_t>(ids[i % ids.size()]);
            ASSERT_EQ(cu_.htod(ids_dev, routed.data(), routed.size() * 4), CUDA_SUCCESS);
            std::vector<int32_t> back(routed.size());
            ASSERT_EQ(cu_.dtoh(back.data(), ids_dev, back.size() * 4), CUDA_SUCCESS);
            for (uint32_t t = 0; t < 3; ++t) ASSERT_GE(copy_and_check(cu_, model_, dst_[l][t], l, t, ids, s[0]), 1);
        }
    const auto prompted = hook_.stats();
    EXPECT_EQ(prompted.evicted, decoded.evicted) << "a prompt batch displaced pooled experts (pool bytes " << prompted.pool_bytes
                                                  << ", " << decoded.pool_bytes << " before; yielded " << prompted.yielded_bytes << ", "
                                                  << decoded.yielded_bytes << " before)";
    EXPECT_GT(prompted.slice_hits, decoded.slice_hits) << "the prompt's copies are served from the pool too";
    for (int i = 0; i < 40; ++i) token(s, i % 10 == 0);
    const auto after = hook_.stats();
    EXPECT_GT(hit_rate(prompted, after), 0.3) << "copies " << after.copies - prompted.copies << ", of experts "
                                               << after.expert_copies - prompted.expert_copies << ", served "
                                               << after.served - prompted.served << ", captured " << after.captured - prompted.captured
                                               << ", pool bytes " << after.pool_bytes << " (" << prompted.pool_bytes << " before), models "
                                               << after.models << ", yielded " << after.yielded_bytes;
    destroy(s);
}

// A runtime records CUDA graphs (llama.cpp captures every decoding step, in relaxed mode), and a
// context synchronisation, a cuMemFree or a module load while a capture is open spoils it: the
// runtime aborts ("operation failed due to a previous error during capture": llama-server at its
// first decode, with the hook letting registered slices go). The hook's own synchronisations wait
// until no capture is open, and a capture that begins meanwhile waits for them.
class Captures : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        // Slices register as they miss (the budget holds less than the model: none ahead) and
        // are let go as their experts enter the pool.
        return {{"MOECACHE_CUDA_POOL", "25%"}, {"MOECACHE_CUDA_PIN", "register"}, {"MOECACHE_CUDA_PIN_BUDGET", "1M"}};
    }
};

TEST_F(Captures, NoCaptureIsSpoiledByTheHooksSynchronisations) {
    auto* counts = cu_.knob<FakeCounts>("fake_cuda_counts");
    if (counts == nullptr) GTEST_SKIP() << "counts captures the fake driver spoiled: CI's fake only";
    auto s = new_streams();
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> ended{0}, spoiled{0}, refused{0};
    // Another thread captures graphs on a stream of its own, back to back, as a decoding runtime does.
    std::thread capturer([&] {
        if (!cu_.use_device(0)) return;
        CUstream cs = nullptr;
        if (cu_.stream_create(&cs, 0) != CUDA_SUCCESS) return;
        while (!stop.load()) {
            if (cu_.begin_capture(cs, CU_STREAM_CAPTURE_MODE_RELAXED) != CUDA_SUCCESS) {
                refused.fetch_add(1);
                continue;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(300));
            CUgraph g = nullptr;
            const CUresult r = cu_.end_capture(cs, &g);
            (r == CUDA_SUCCESS ? ended : r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED ? spoiled : refused).fetch_add(1);
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        (void)cu_.stream_destroy(cs);
    });
    const uint64_t syncs_before = counts->syncs;
    warm_up(s);
    for (int i = 0; i < 300 && !HasFailure(); ++i) {
        token(s);
        if (i % 50 == 0) {
            ASSERT_GE(hook_.sync(10000), 1);
        }
    }
    ASSERT_GE(hook_.sync(10000), 1);
    stop.store(true);
    capturer.join();
    const auto st = hook_.stats();
    EXPECT_GT(st.pinned_bytes, 0u) << "nothing was registered: the test did not run the case";
    EXPECT_GT(counts->syncs, syncs_before) << "the hook never synchronised: the test did not run the case";
    EXPECT_GT(ended.load(), 100u) << "captures did not run alongside";
    EXPECT_EQ(spoiled.load(), 0u) << "a synchronisation of the hook spoiled a runtime's capture";
    EXPECT_EQ(refused.load(), 0u);
    destroy(s);
}

// Routing from the runtime's read-back: llama.cpp reads its router's ids to the host and then
// copies the experts they name. A prompt batch's copies carry nearly every expert (the union says
// little); its read-back says how many tokens chose each, and the hook reports the experts more
// of them chose than an even share, once, with the batch's token count, then its ranking as
// reports of 0 tokens (moecache/batch_report.h). A decoded token is one
// event of its experts, not one per group of neighbours. A read-back that does not check out
// against the copy that follows is not used.
class Routes : public HookServing {
protected:
    std::vector<std::pair<const char*, const char*>> env() const override {
        // The client on (these tests turn it off), writing what it reports as a trace, with no daemon.
        trace_ = dir_.path() + "/routes.jsonl";
        socket_ = dir_.path() + "/no-daemon.sock";
        return {{"MOECACHE_CUDA_POOL", "25%"}, {"MOECACHE_CUDA_CLIENT", "on"}, {"MOECACHE_SOCKET", socket_.c_str()},
                {"MOECACHE_TRACE", trace_.c_str()}};
    }
    // The runtime's read-back of `ids` (n_used a token), then its grouped copies of their union.
    void batch(uint32_t l, const std::vector<int32_t>& ids, const std::vector<uint32_t>& copied, CUstream s) {
        ASSERT_EQ(cu_.htod(ids_dev_, ids.data(), ids.size() * 4), CUDA_SUCCESS);
        std::vector<int32_t> back(ids.size());
        ASSERT_EQ(cu_.dtoh(back.data(), ids_dev_, back.size() * 4), CUDA_SUCCESS);
        for (uint32_t t = 0; t < 3; ++t) ASSERT_TRUE(copy_experts(cu_, model_, dst_[l][t], l, t, copied, s));
    }
    // The decisions written so far: (block, tokens, experts).
    std::vector<std::tuple<uint32_t, uint32_t, std::vector<uint32_t>>> decisions() const {
        std::vector<std::tuple<uint32_t, uint32_t, std::vector<uint32_t>>> out;
        std::ifstream f(trace_);
        std::string line;
        const std::regex d(R"("b":(\d+),"n":(\d+),"e":\[([0-9,]*)\])");
        std::smatch m;
        while (std::getline(f, line)) {
            if (!std::regex_search(line, m, d)) continue;
            std::vector<uint32_t> e;
            std::stringstream ss(m[3].str());
            for (std::string x; std::getline(ss, x, ',');) e.push_back(static_cast<uint32_t>(std::stoul(x)));
            out.emplace_back(std::stoul(m[1].str()), std::stoul(m[2].str()), e);
        }
        return out;
    }
    mutable std::string trace_, socket_;
    CUdeviceptr ids_dev_ = 0;
};

TEST_F(Routes, APromptBatchIsReportedFromTheIdsTheRuntimeReadBack) {
    auto s = new_streams();
    warm_up(s);
    ASSERT_EQ(cu_.mem_alloc(&ids_dev_, 1u << 16), CUDA_SUCCESS);
    const uint32_t k = model_.map.n_experts_used, ne = model_.map.n_experts;  // 4 of 32
    // A prompt batch of 64 tokens in layer 0: experts 0-7 are chosen by most tokens, the rest
    // now and then, every expert by one at least.
    std::vector<int32_t> ids;
    std::vector<uint32_t> count(ne, 0);
    for (uint32_t t = 0; t < 64; ++t)
        for (uint32_t j = 0; j < k; ++j) {
            const uint32_t e = j < 3 ? (t + j * 3) % 8 : 8 + (t * 7 + j) % 24;
            ids.push_back(static_cast<int32_t>(e));
            ++count[e];
        }
    std::vector<uint32_t> all(ne), hot;
    for (uint32_t e = 0; e < ne; ++e) {
        all[e] = e;
        if (count[e] * ne > 64 * k) hot.push_back(e);
    }
    ASSERT_FALSE(hot.empty());
    ASSERT_LT(hot.size(), ne / 2);
    batch(0, ids, all, s[0]);
    // A decoded token in layer 1: one event of its four experts (apart in the file: four groups).
    batch(1, {1, 5, 9, 30}, {1, 5, 9, 30}, s[0]);
    // A read-back that the copy does not bear out (a stale one, or not ids at all) in layer 2.
    batch(2, {0, 1, 2, 3}, {20, 22, 24, 26}, s[0]);
    ASSERT_GE(hook_.sync(10000), 1);
    const uint32_t b0 = model_.map.layers[0].index, b1 = model_.map.layers[1].index, b2 = model_.map.layers[2].index;
    auto has = [&](uint32_t b, uint32_t n, const std::vector<uint32_t>& e) {
        for (const auto& [db, dn, de] : decisions())
            if (db == b && dn == n && de == e) return true;
        return false;
    };
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!has(b2, 1, {26}) && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::stringstream text;
    text << std::ifstream(trace_).rdbuf();
    ASSERT_FALSE(decisions().empty()) << "no decision in the trace:\n" << text.str();
    EXPECT_TRUE(has(b0, 64, hot)) << "the prompt batch's hot experts, once, with its 64 tokens\n" << text.str().substr(0, 4000);
    EXPECT_FALSE(has(b0, 1, all)) << "the prompt batch was reported as its union";
    // Then its ranking, as reports of 0 tokens: for each level (1/8 of an even share to 8 times it)
    // the experts at least that many of its tokens chose; a level none reaches is not reported.
    size_t levels = 0;
    for (int level = -3; level <= 3; ++level) {
        if (level == 0) continue;
        std::vector<uint32_t> at;
        for (uint32_t e = 0; e < ne; ++e) {
            const double share = static_cast<double>(count[e]) * ne / (64.0 * k);
            if (count[e] != 0 && share >= std::ldexp(1.0, level)) at.push_back(e);
        }
        if (at.empty()) continue;
        ++levels;
        EXPECT_TRUE(has(b0, 0, at)) << "the batch's level " << level << " (" << at.size() << " experts)\n"
                                    << text.str().substr(0, 4000);
    }
    EXPECT_GE(levels, 4u) << "the test's batch ranks too few levels to check";
    EXPECT_TRUE(has(b1, 1, {1, 5, 9, 30})) << "the decoded token as one event";
    EXPECT_FALSE(has(b1, 1, {5})) << "the decoded token as a group at a time";
    for (uint32_t e : {20u, 22u, 24u, 26u}) EXPECT_TRUE(has(b2, 1, {e})) << "a read-back the copy did not bear out was used";
    destroy(s);
}

class WholePool : public HookServing {
protected:
    std::vector<std::pair<const char*, const char*>> env() const override { return {{"MOECACHE_CUDA_POOL", "100%"}}; }
    // Every expert of every tensor, whole, each read back: a pool of 100 % takes them all into free slots.
    void pool_every_slice(const std::vector<CUstream>& s) {
        std::vector<uint32_t> all(32);
        for (uint32_t e = 0; e < 32; ++e) all[e] = e;
        for (uint32_t l = 0; l < 4; ++l)
            for (uint32_t t = 0; t < 3; ++t) ASSERT_GE(copy_and_check(cu_, model_, dst_[l][t], l, t, all, s[0]), 1);
    }
    // The experts `ids` of every tensor, each copy read back: how many grouped copies that made.
    int copy_everywhere(const std::vector<uint32_t>& ids, const std::vector<CUstream>& s) {
        int groups = 0;
        for (uint32_t l = 0; l < 4; ++l)
            for (uint32_t t = 0; t < 3; ++t) groups += copy_and_check(cu_, model_, dst_[l][t], l, t, ids, s[0]);
        return groups;
    }
};

// llama.cpp copies each group of experts with 512 bytes of padding, the next expert's head. A slot
// keeps that head after its slice, so a hit is one device-to-device copy, padding included, and
// nothing comes from the host: a hit costs the runtime's thread one call, not two.
TEST_F(WholePool, AHitWithItsPaddingIsOneCopyFromOneSlot) {
    auto s = new_streams();
    warm_up(s);
    pool_every_slice(s);
    const auto pooled = hook_.stats();
    ASSERT_EQ(pooled.admitted, 4u * 3u * 32u)
        << "a pool of 100 % holds every slice (evicted " << pooled.evicted << ", declined " << pooled.declined
        << ", fallbacks " << pooled.fallbacks << ", stream joins " << pooled.stream_joins << ", filled ahead "
        << pooled.filled_ahead << ", yielded " << pooled.yielded_bytes << ", slice misses " << pooled.slice_misses << ")";
    if (!cu_.fake()) GTEST_SKIP() << "counts driver calls: the fake driver's counters";
    const auto calls = *cu_.knob<FakeCounts>("fake_cuda_counts");
    const int groups = copy_everywhere({3, 9, 17, 30}, s);
    ASSERT_EQ(groups, 4 * 12);
    const auto after = *cu_.knob<FakeCounts>("fake_cuda_counts");
    // By the hook's copy kernel, one launch a hit (the driver's own device-to-device copies cost
    // the runtime's thread more); none of the driver's.
    EXPECT_EQ(after.kernel_launches - calls.kernel_launches, static_cast<unsigned long long>(groups)) << "one copy a hit";
    EXPECT_EQ(after.dtod_calls, calls.dtod_calls);
    // copy_and_check writes its poison with one host copy per tensor; nothing else comes from the host.
    EXPECT_EQ(after.htod_calls - calls.htod_calls, 4ull * 3ull);
    EXPECT_EQ(hook_.stats().slice_misses, pooled.slice_misses);
    destroy(s);
}

// Without the copy kernel (a driver that will not load it), a pooled slice is one copy of the driver's.
class WholePoolNoKernel : public WholePool {
protected:
    void SetUp() override {
        WholePool::SetUp();
        if (auto* k = cu_.knob<int>("fake_cuda_kernels")) *k = 0;
    }
};

TEST_F(WholePoolNoKernel, AHitSliceIsOneDriverCopyWhenTheKernelCannotLoad) {
    if (!cu_.fake()) GTEST_SKIP() << "needs a driver that refuses the kernel: the fake driver";
    auto s = new_streams();
    warm_up(s);
    pool_every_slice(s);
    const auto calls = *cu_.knob<FakeCounts>("fake_cuda_counts");
    ASSERT_EQ(copy_everywhere({2, 3, 17, 30}, s), 3 * 12);
    const auto after = *cu_.knob<FakeCounts>("fake_cuda_counts");
    EXPECT_EQ(after.kernel_launches, 0u);
    // One a slice (2 and 3 are one group of two slots), the last with its padding.
    EXPECT_EQ(after.dtod_calls - calls.dtod_calls, 4ull * 12ull);
    destroy(s);
}

// llama.cpp reads a decode step's router ids back, then copies the experts they name, tensor by
// tensor, one call a group, each to the place the host tensor's layout gives it. Once the hook has
// seen copies laid out so, a run's first copy queues the rest of the run's hits from the ids in
// one launch, and the runtime's later copies of them cost no launch: the same bytes land where
// they would have, and nothing else changes.
class Ahead : public WholePool {
protected:
    void SetUp() override {
        WholePool::SetUp();
        if (!HasFatalFailure() && !IsSkipped()) {
            ASSERT_EQ(cu_.mem_alloc(&ids_dev_, 4096), CUDA_SUCCESS);
        }
    }
    // The runtime's read-back of one token's ids for a layer, into memory it keeps (as llama.cpp
    // keeps its ids buffer: the hook reads it when the copies come).
    void read_back(const std::vector<uint32_t>& ids) {
        std::vector<int32_t> v(ids.begin(), ids.end());
        ids_back_.resize(ids.size());
        ASSERT_EQ(cu_.htod(ids_dev_, v.data(), v.size() * 4), CUDA_SUCCESS);
        ASSERT_EQ(cu_.dtoh(ids_back_.data(), ids_dev_, ids_back_.size() * 4), CUDA_SUCCESS);
    }
    // Decoded tokens, each layer's ids read back and then copied (each copy checked byte for byte).
    void decode(int tokens, const std::vector<CUstream>& s, const std::vector<uint32_t>& ids = {3, 9, 17, 30}) {
        for (int i = 0; i < tokens && !HasFailure(); ++i)
            for (uint32_t l = 0; l < 4; ++l) {
                read_back(ids);
                for (uint32_t t = 0; t < 3; ++t) ASSERT_EQ(copy_and_check(cu_, model_, dst_[l][t], l, t, ids, s[0]), 4);
            }
    }
    CUdeviceptr ids_dev_ = 0;
    std::vector<int32_t> ids_back_ = std::vector<int32_t>(64);
};

TEST_F(Ahead, ADecodeStepsHitsOfATensorAreOneLaunchAtItsFirstCopy) {
    if (!cu_.fake()) GTEST_SKIP() << "counts driver calls: the fake driver's counters";
    auto s = new_streams();
    warm_up(s);
    pool_every_slice(s);
    decode(3, s);  // the hook learns the runtime's layout (16 runs of several copies)
    const auto before = hook_.stats();
    ASSERT_GT(before.copied_ahead, 0u) << "nothing was copied ahead after 3 tokens";
    const auto calls = *cu_.knob<FakeCounts>("fake_cuda_counts");
    decode(10, s);
    const auto after = hook_.stats();
    const auto counted = *cu_.knob<FakeCounts>("fake_cuda_counts");
    // Each of a token's 12 runs (4 layers x 3 tensors, 4 groups each): one launch at its first
    // copy, for that copy's slice and the other three.
    EXPECT_EQ(counted.kernel_launches - calls.kernel_launches, 10ull * 12ull)
        << "four launches a run without copies ahead";
    EXPECT_EQ(after.copied_ahead - before.copied_ahead, 10u * 12u * 3u);
    EXPECT_EQ(after.slice_hits - before.slice_hits, 10u * 12u * 4u) << "every slice is still a hit";
    EXPECT_EQ(after.slice_misses, before.slice_misses);
    EXPECT_EQ(after.ahead_unclaimed, 0u);
    EXPECT_EQ(counted.htod_calls - calls.htod_calls, 10ull * 12ull + 10ull * 4ull)
        << "the checks' poison, one a tensor, and the ids, one a layer; nothing from the host";
    destroy(s);
}

// A pool that holds some of the experts: a step's groups of neighbouring experts (two tokens' ids
// read back together) mix hits and misses, some slices are claimed inside a group copied in part
// from the host, admissions evict what was queued ahead: every destination stays the file's bytes.
class AheadPartial : public Ahead {
protected:
    std::vector<std::pair<const char*, const char*>> env() const override { return {{"MOECACHE_CUDA_POOL", "40%"}}; }
};

TEST_F(AheadPartial, HitsAndMissesOfGroupsStayByteIdentical) {
    auto s = new_streams();
    warm_up(s);
    std::mt19937 rng(11);
    std::geometric_distribution<uint32_t> pick(0.12);
    const auto two_tokens = [&] {
        std::vector<uint32_t> ids;
        for (int t = 0; t < 2; ++t) {
            std::vector<uint32_t> one;
            while (one.size() < 4) {
                // Neighbours often: an expert and the one after it.
                const uint32_t e = std::min<uint32_t>(pick(rng), 30) + (rng() % 3 == 0 ? 1 : 0);
                if (std::find(one.begin(), one.end(), e) == one.end()) one.push_back(e);
            }
            ids.insert(ids.end(), one.begin(), one.end());
        }
        return ids;
    };
    for (int token = 0; token < 40 && !HasFailure(); ++token)
        for (uint32_t l = 0; l < 4 && !HasFailure(); ++l) {
            const auto ids = two_tokens();
            read_back(ids);
            for (uint32_t t = 0; t < 3; ++t) ASSERT_GE(copy_and_check(cu_, model_, dst_[l][t], l, t, ids, s[0]), 1);
        }
    const auto st = hook_.stats();
    EXPECT_GT(st.copied_ahead, 0u) << "nothing was copied ahead";
    EXPECT_GT(st.slice_misses, 0u) << "the pool held every expert: no mix to test";
    EXPECT_GT(st.admitted, 0u);
    EXPECT_EQ(st.ahead_unclaimed, 0u);
    EXPECT_EQ(st.fallbacks, 0u);
    destroy(s);
}

// A device whose compiler got the several-range kernel wrong (the fake driver's leaves a launch's
// last range out): the hook's check at load finds it, and every hit is a launch of its own.
class AheadBrokenKernel : public Ahead {
protected:
    void SetUp() override {
        Ahead::SetUp();
        if (auto* k = cu_.knob<int>("fake_cuda_kernel_n_broken")) *k = 1;
    }
};

TEST_F(AheadBrokenKernel, AKernelThatFailsItsCheckCopiesNothingAhead) {
    if (!cu_.fake()) GTEST_SKIP() << "needs a driver whose kernel is wrong: the fake driver";
    auto s = new_streams();
    warm_up(s);
    pool_every_slice(s);
    decode(3, s);
    const auto calls = *cu_.knob<FakeCounts>("fake_cuda_counts");
    decode(2, s);
    const auto counted = *cu_.knob<FakeCounts>("fake_cuda_counts");
    EXPECT_EQ(hook_.stats().copied_ahead, 0u);
    EXPECT_EQ(counted.kernel_launches - calls.kernel_launches, 2ull * 12ull * 4ull) << "one launch a hit";
    destroy(s);
}

// A runtime that puts the experts it copies one after another (not where the tensor's layout
// has them) is never copied for ahead: the hook would write where that runtime keeps other data.
TEST_F(Ahead, ARuntimeThatPacksItsCopiesGetsNoneAhead) {
    auto s = new_streams();
    warm_up(s);
    pool_every_slice(s);
    const std::vector<uint32_t> ids = {3, 9, 17, 30};
    for (int token = 0; token < 6; ++token)
        for (uint32_t l = 0; l < 4; ++l) {
            read_back(ids);
            for (uint32_t t = 0; t < 3; ++t) {
                const auto& tensor = model_.map.layers[l].tensors[t];
                const uint64_t slice = tensor.bytes_per_expert;
                for (size_t i = 0; i < ids.size(); ++i)
                    ASSERT_EQ(cu_.htod_async(dst_[l][t] + i * slice, model_.base + tensor.offset + ids[i] * slice,
                                             slice + 512, s[0]),
                              CUDA_SUCCESS);
                ASSERT_EQ(cu_.ctx_synchronize(), CUDA_SUCCESS);
                std::vector<uint8_t> back(slice * ids.size());
                ASSERT_EQ(cu_.dtoh(back.data(), dst_[l][t], back.size()), CUDA_SUCCESS);
                for (size_t i = 0; i < ids.size(); ++i)
                    ASSERT_EQ(memcmp(back.data() + i * slice, model_.base + tensor.offset + ids[i] * slice, slice), 0)
                        << "layer " << l << " tensor " << t << " expert " << ids[i];
            }
        }
    const auto st = hook_.stats();
    EXPECT_EQ(st.copied_ahead, 0u);
    EXPECT_GT(st.slice_hits, 6u * 12u * 4u - 1u) << "served from the pool all the same";
    destroy(s);
}

// A runtime that copies fewer experts than its ids name (after the hook learnt its layout) leaves
// slices queued ahead unclaimed: the hook stops copying ahead for good.
TEST_F(Ahead, ASliceQueuedAheadAndNotAskedForTurnsCopiesAheadOff) {
    auto s = new_streams();
    warm_up(s);
    pool_every_slice(s);
    decode(3, s);
    ASSERT_GT(hook_.stats().copied_ahead, 0u);
    for (uint32_t l = 0; l < 4; ++l) {
        read_back({3, 9, 17, 30});
        for (uint32_t t = 0; t < 3; ++t) ASSERT_TRUE(copy_experts(cu_, model_, dst_[l][t], l, t, {3, 9}, s[0]));
    }
    const auto off = hook_.stats();
    EXPECT_GT(off.ahead_unclaimed, 0u);
    decode(3, s);  // still byte for byte, and nothing more ahead
    EXPECT_EQ(hook_.stats().copied_ahead, off.copied_ahead);
    destroy(s);
}

class TwoDevices : public HookServing {
    int devices() const override { return 2; }
    std::vector<std::pair<const char*, const char*>> env() const override { return {{"MOECACHE_CUDA_POOL", "50%"}}; }
};

TEST_F(TwoDevices, EachDeviceSizesItsPoolForTheLayersItCopies) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 60; ++i) token(s, i % 20 == 0);
    ASSERT_GE(hook_.sync(10000), 1);
    for (int d = 0; d < 2; ++d) {
        const double share = static_cast<double>(hook_.pool_bytes(d)) / static_cast<double>(expert_bytes_of(d));
        EXPECT_GT(share, 0.45) << "device " << d;
        EXPECT_LE(share, 0.5) << "device " << d << ": a pool for the experts of layers it never copies";
    }
    const auto st = hook_.stats();
    EXPECT_EQ(st.devices, 2u);
    EXPECT_GT(st.slice_hits, 0u);
    EXPECT_EQ(st.fallbacks, 0u);
    destroy(s);
}

// With one device and no daemon, the pool waits for the experts: a copy of the model's other
// weights (while it loads) makes the device's pool, but sizes it for nothing (with a daemon it is
// sized for every expert then: HookDaemon.ThePoolIsSizedForEveryExpertWhenTheModelLoads), and the
// expert copies size it as they come.
class OneDevice : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "50%"}, {"MOECACHE_SOCKET", "/nonexistent/moecached.sock"}};
    }
};

TEST_F(OneDevice, WithoutADaemonThePoolWaitsForTheExperts) {
    uint64_t first_expert = UINT64_MAX;
    for (const auto& l : model_.map.layers)
        for (const auto& t : l.tensors) first_expert = std::min(first_expert, t.offset);
    ASSERT_GT(first_expert, 8192u) << "the generated model has other weights before its experts";
    CUdeviceptr other = 0;
    ASSERT_EQ(cu_.mem_alloc(&other, 4096), CUDA_SUCCESS);
    const uint8_t* weights = model_.base + (first_expert - 4096) / 4096 * 4096;
    for (int i = 0; i < 5; ++i) {
        ASSERT_EQ(cu_.htod(other, weights, 4096), CUDA_SUCCESS);
        ASSERT_GE(hook_.sync(2000), 1) << "the hook did not find the mapped model";
    }
    EXPECT_EQ(hook_.pool_bytes(0), 0u) << "no pool sized ahead without a daemon to direct it";
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 20; ++i) token(s, i % 5 == 0);
    sync_all();
    const double share = static_cast<double>(hook_.pool_bytes(0)) / static_cast<double>(expert_bytes_of(0));
    EXPECT_GT(share, 0.45);
    EXPECT_LE(share, 0.5);
    EXPECT_GT(hook_.stats().slice_hits, 0u);
    EXPECT_EQ(hook_.stats().fallbacks, 0u);
    destroy(s);
}

class DeviceSizes : public TwoDevices {
    std::vector<std::pair<const char*, const char*>> env() const override {
        // 12 slots on device 0: a slice and the 512 bytes of the next one's head each.
        static const std::string sizes = "25%,0:" + std::to_string(12 * (139264 + 512));
        return {{"MOECACHE_CUDA_POOL", sizes.c_str()}};
    }
};

TEST_F(DeviceSizes, EachDeviceGetsItsOwnSize) {
    ASSERT_EQ(slice_, 139264u) << "the sizes above assume this slice";
    auto s = new_streams();
    warm_up(s);
    ASSERT_GE(hook_.sync(10000), 1);
    EXPECT_EQ(hook_.pool_bytes(0), 12 * (slice_ + 512));
    const double share = static_cast<double>(hook_.pool_bytes(1)) / static_cast<double>(expert_bytes_of(1));
    EXPECT_GT(share, 0.2);
    EXPECT_LE(share, 0.25);
    destroy(s);
}

// A runtime that sizes its own use from free memory, as llama.cpp's --fit and ollama do: it asks
// what is free and allocates all of it but a margin, before any expert copy. A pool given in bytes
// is claimed from the start (free-memory queries report that much less), so the runtime leaves
// the room and the pool gets it; unclaimed, the pool finds only the runtime's margin.
class Claimed : public HookServing {
protected:
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "16M"}, {"MOECACHE_CUDA_CLAIM", claim()}};
    }
    virtual const char* claim() const { return "on"; }
    // The runtime's sizing: everything it is told is free, less a margin of 300 MiB.
    uint64_t fill_like_fit() {
        auto* limit = cu_.knob<unsigned long long>("fake_cuda_memory_limit");
        if (limit == nullptr) return 0;
        *limit = 1ull << 30;
        size_t free = 0, total = 0;
        EXPECT_EQ(cu_.mem_get_info(&free, &total), CUDA_SUCCESS);
        EXPECT_GT(free, 300ull << 20);
        EXPECT_EQ(cu_.mem_alloc(&fit_, free - (300ull << 20)), CUDA_SUCCESS);
        return free;
    }
    CUdeviceptr fit_ = 0;
};
class Unclaimed : public Claimed {
    const char* claim() const override { return "off"; }
};

TEST_F(Claimed, ARuntimeThatFillsFreeMemoryLeavesTheClaimedPool) {
    if (cu_.knob<unsigned long long>("fake_cuda_memory_limit") == nullptr) GTEST_SKIP() << "needs the fake driver's memory limit";
    const uint64_t told = fill_like_fit();
    auto s = new_streams();
    warm_up(s);
    ASSERT_GE(hook_.sync(10000), 1);
    EXPECT_GE(hook_.pool_bytes(0), 15ull << 20) << "the runtime was told " << told << " bytes were free";
    // The pool's bytes count as free to the runtime again (it yields them), less what it claims.
    size_t free = 0, total = 0;
    ASSERT_EQ(cu_.mem_get_info(&free, &total), CUDA_SUCCESS);
    EXPECT_LE(free, 300ull << 20);
    EXPECT_GT(free, 250ull << 20);
    destroy(s);
}

TEST_F(Unclaimed, ARuntimeThatFillsFreeMemoryLeavesNoRoomForAnUnclaimedPool) {
    if (cu_.knob<unsigned long long>("fake_cuda_memory_limit") == nullptr) GTEST_SKIP() << "needs the fake driver's memory limit";
    fill_like_fit();
    auto s = new_streams();
    warm_up(s);
    ASSERT_GE(hook_.sync(10000), 1);
    EXPECT_EQ(hook_.pool_bytes(0), 0u) << "300 MiB free is under the reserve of an unclaimed pool";
    destroy(s);
}

// A preload reaches every process of ollama's service, its GPU discovery too (`llama-server
// --list-devices`, a model-less llama-server, `ollama gpu-discover`): the hook leaves those alone.
// Started as `llama-server --list-devices`, this test's own program claims nothing of a pool of
// 16 MiB (the driver's free memory as it is) and copies pass through unserved; as itself, a runtime,
// it claims the pool.
class LeftAlone : public Claimed {};

TEST_F(LeftAlone, ADeviceProbeClaimsNothingAndARuntimeDoes) {
    auto* limit = cu_.knob<unsigned long long>("fake_cuda_memory_limit");
    if (limit == nullptr) GTEST_SKIP() << "needs the fake driver's memory limit";
    *limit = 1ull << 30;
    size_t free = 0, total = 0;
    ASSERT_EQ(cu_.mem_get_info(&free, &total), CUDA_SUCCESS);
    const uint64_t unclaimed = (1ull << 30) - 12 * (slice_ * 32 + 512);  // less the set-up's 12 buffers
    if (getenv("MOECACHE_TEST_AS_PROBE") != nullptr) {
        EXPECT_EQ(free, unclaimed) << "a probe claims nothing";
        auto s = new_streams();
        token(s, /*check=*/true);
        token(s, /*check=*/true);
        EXPECT_EQ(hook_.pool_bytes(0), 0u) << "and holds no pool";
        destroy(s);
        return;
    }
    EXPECT_EQ(free, unclaimed - (16ull << 20)) << "a runtime's pool is claimed";
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        setenv("MOECACHE_TEST_AS_PROBE", "1", 1);
        execl("/proc/self/exe", "llama-server", "--list-devices",
              "--gtest_filter=LeftAlone.ADeviceProbeClaimsNothingAndARuntimeDoes", static_cast<char*>(nullptr));
        _exit(127);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the probe's own test failed (status " << status << ")";
}

class PinAll : public TwoDevices {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "25%"}, {"MOECACHE_CUDA_PIN", "all"}};
    }
};

TEST_F(PinAll, ExpertBytesAreRegisteredOnceForEveryDevice) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 20; ++i) token(s, i % 5 == 0);
    const auto st = hook_.stats();
    EXPECT_GE(st.pinned_bytes, model_.map.expert_bytes_total) << "every expert byte registered";
    EXPECT_EQ(st.devices, 2u);
    EXPECT_EQ(st.staged_devices, 0u) << "registered memory needs no staging";
    if (cu_.fake()) {
        EXPECT_EQ(cu_.knob<FakeCounts>("fake_cuda_counts")->registered, 1u) << "one registration serves both devices";
    }
    destroy(s);
}

class Staging : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "staging"}};
    }
};

TEST_F(Staging, StagedMissesAreByteIdentical) {
    auto s = new_streams();
    auto t2 = new_streams();
    warm_up(s);
    ASSERT_EQ(hook_.stats().staged_devices, 1u);
    // Many copies queued before anything is read back: a staging buffer reused before the device
    // read it would leave another copy's bytes behind. Wide groups (whole tensors too) so that the
    // pieces from the host are large enough to stage, on two streams.
    std::vector<std::vector<uint8_t>> copied(12, std::vector<uint8_t>(32, 0));
    for (int round = 0; round < 40; ++round)
        for (uint32_t l = 0; l < 4; ++l) {
            std::vector<uint32_t> ids;
            const uint32_t first = (static_cast<uint32_t>(round) * 7 + l * 5) % 24;
            const uint32_t n = round % 5 == 0 ? 32 : 3 + static_cast<uint32_t>(round) % 6;
            for (uint32_t e = first; e < std::min<uint32_t>(first + n, 32); ++e) ids.push_back(e);
            if (n == 32) ids = [] { std::vector<uint32_t> all(32); for (uint32_t e = 0; e < 32; ++e) all[e] = e; return all; }();
            for (uint32_t t = 0; t < 3; ++t) {
                ASSERT_TRUE(copy_experts(cu_, model_, dst_[l][t], l, t, ids, (round % 3 ? s : t2)[0]));
                for (uint32_t e : ids) copied[l * 3 + t][e] = 1;
            }
        }
    sync_all();
    for (uint32_t l = 0; l < 4; ++l)
        for (uint32_t t = 0; t < 3; ++t) {
            const auto& tensor = model_.map.layers[l].tensors[t];
            std::vector<uint8_t> back(slice_ * 32);
            ASSERT_EQ(cu_.dtoh(back.data(), dst_[l][t], back.size()), CUDA_SUCCESS);
            for (uint32_t e = 0; e < 32; ++e) {
                if (!copied[l * 3 + t][e]) continue;
                ASSERT_EQ(memcmp(back.data() + e * slice_, model_.base + tensor.offset + e * slice_, slice_), 0)
                    << "layer " << l << " tensor " << t << " expert " << e;
            }
        }
    const auto st = hook_.stats();
    EXPECT_GT(st.bytes_staged, 8ull * (8 << 20)) << "the staging buffers were used, and reused";
    EXPECT_EQ(st.fallbacks, 0u);
    destroy(s);
    destroy(t2);
}

class Register : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        // A budget below the model's expert bytes (53.5 MB): only what misses is registered.
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "register"}, {"MOECACHE_CUDA_PIN_BUDGET", "40M"}};
    }
};

// The registered tier when the budget cannot hold the model: a slice that misses is registered for
// DMA on its own (its page-aligned inside), and its later copies come straight from those pages,
// split at the registration's edges.
TEST_F(Register, SlicesThatMissAreRegisteredAndCopiedStraightFromThem) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 40; ++i) token(s, i % 8 == 0);
    (void)hook_.sync(5000);
    const auto before = hook_.stats();
    EXPECT_GT(before.pinned_bytes, 0u) << "no slice was registered";
    for (int i = 0; i < 20 && !HasFailure(); ++i) token(s, true);  // every copy read back
    const auto after = hook_.stats();
    EXPECT_GT(after.slice_misses, before.slice_misses);
    EXPECT_LT(after.pinned_bytes, model_.map.expert_bytes_total) << "only slices that missed";
    if (cu_.fake()) {
        EXPECT_GT(cu_.knob<FakeCounts>("fake_cuda_counts")->registered, 10u);
    }
    EXPECT_EQ(after.fallbacks, 0u);
    destroy(s);
}

class RegisterAhead : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "auto"}};
    }
};

// The default (auto) when the budget holds every expert slice: runs of neighbouring expert tensors
// are registered whole in the background (those of slices that missed first), so that decoding
// soon copies every miss at DMA speed, straight from the pages and in one piece.
TEST_F(RegisterAhead, TheWholeModelIsRegisteredAheadWhenTheBudgetHoldsIt) {
    auto s = new_streams();
    warm_up(s);
    moecache_cuda_stats st{};
    // The registration ahead runs on the hook's background thread: on a loaded 2-core machine
    // (ctest -j2 beside the root tests) it took more than 20 s once, where it takes ~3 s alone.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(90);
    do {
        token(s);
        (void)hook_.sync(1000);
        st = hook_.stats();
    } while (st.pinned_bytes < model_.map.expert_bytes_total * 9 / 10 && std::chrono::steady_clock::now() < until);
    EXPECT_GE(st.pinned_bytes, model_.map.expert_bytes_total * 9 / 10)
        << "the slices' page-aligned insides are registered ahead";
    EXPECT_LE(st.pinned_bytes, model_.map.expert_bytes_total + 12 * 8192) << "a page or two more a run of tensors";
    for (int i = 0; i < 20 && !HasFailure(); ++i) token(s, true);
    const auto after = hook_.stats();
    EXPECT_GT(after.slice_misses, st.slice_misses);
    if (cu_.fake()) {
        EXPECT_LE(cu_.knob<FakeCounts>("fake_cuda_counts")->registered, 4u * 3u) << "one registration a run of tensors";
    }
    EXPECT_EQ(after.fallbacks, 0u);
    destroy(s);
}

// The default with the model in RAM, as a runtime loads it: llama.cpp with -ngl 99 copies every
// tensor that is not an expert to the GPU from the mapping, while the hook (its pool made at the
// first of those copies) registers the runs of expert tensors ahead. A run's registration ends a page
// past its last expert (the padding runtimes copy): the next tensors (the next layer's attention)
// start in registered memory and end outside it, which the driver refuses (CUDA_ERROR_INVALID_VALUE)
// and llama.cpp aborted on: "CUDA error: invalid argument" in ggml_backend_cuda_buffer_set_tensor,
// 8 runs in 10 on the GPU machine. Every copy the runtime makes succeeds and writes the file's
// bytes, before, during and after the registrations, with the fake driver taking its time between a
// copy's call and its look at the source (so that a registration landing between the hook's cut
// and the driver's check is seen).
class LoadRace : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "auto"}};
    }
};

TEST_F(LoadRace, TheRuntimesCopiesOfTensorsBesideRegisteredExpertsNeverFail) {
    auto head = read_gguf(files_[0]);
    ASSERT_TRUE(head.has_value());
    std::vector<const GgufTensor*> dense;  // what -ngl 99 -ot exps=CPU copies to the GPU at load
    uint64_t largest = 0;
    for (const auto& t : head->tensors)
        if (t.name.find("_exps") == std::string::npos) {
            dense.push_back(&t);
            largest = std::max(largest, t.nbytes);
        }
    ASSERT_GT(dense.size(), 8u);
    if (auto* delay = cu_.knob<int>("fake_cuda_copy_delay_us")) *delay = 200;
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> copies{0}, failed{0}, wrong{0};
    CUresult first_error = CUDA_SUCCESS;
    std::thread loader([&] {
        ASSERT_TRUE(cu_.use_device(0));
        CUstream st = nullptr;
        CUdeviceptr buf = 0;
        ASSERT_EQ(cu_.stream_create(&st, 0), CUDA_SUCCESS);
        ASSERT_EQ(cu_.mem_alloc(&buf, largest), CUDA_SUCCESS);
        std::vector<uint8_t> back(largest);
        for (uint64_t round = 0; !stop.load(); ++round)
            for (const GgufTensor* t : dense) {
                const CUresult r = cu_.htod_async(buf, model_.base + t->file_offset, t->nbytes, st);
                copies.fetch_add(1);
                if (r != CUDA_SUCCESS) {
                    if (failed.fetch_add(1) == 0) first_error = r;
                    continue;
                }
                if (round % 4 == 0) {
                    ASSERT_EQ(cu_.stream_synchronize(st), CUDA_SUCCESS);
                    ASSERT_EQ(cu_.dtoh(back.data(), buf, t->nbytes), CUDA_SUCCESS);
                    if (memcmp(back.data(), model_.base + t->file_offset, t->nbytes) != 0) wrong.fetch_add(1);
                }
            }
        (void)cu_.stream_synchronize(st);
        (void)cu_.mem_free(buf);
        (void)cu_.stream_destroy(st);
    });
    auto s = new_streams();
    warm_up(s);
    moecache_cuda_stats st{};
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    do {
        token(s);
        (void)hook_.sync(200);
        st = hook_.stats();
    } while (st.pinned_bytes < model_.map.expert_bytes_total * 9 / 10 && std::chrono::steady_clock::now() < until);
    const uint64_t at_registered = copies.load();
    while (copies.load() < at_registered + 4 * dense.size() && std::chrono::steady_clock::now() < until + std::chrono::seconds(10))
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    stop = true;
    loader.join();
    EXPECT_GE(st.pinned_bytes, model_.map.expert_bytes_total * 9 / 10) << "the runs were registered ahead";
    EXPECT_GT(at_registered, 4 * dense.size()) << "the loader's copies ran while the runs were registered";
    EXPECT_EQ(failed.load(), 0u) << "of " << copies.load() << " copies; the first error: CUDA error " << first_error;
    EXPECT_EQ(wrong.load(), 0u);
    for (int i = 0; i < 10 && !HasFailure(); ++i) token(s, true);
    EXPECT_EQ(hook_.stats().fallbacks, 0u);
    destroy(s);
}

class AutoOverBudget : public HookServing {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "auto"}, {"MOECACHE_CUDA_PIN_BUDGET", "16M"}};
    }
};

// auto when the budget cannot hold the model and no daemon is there: nothing is registered (slices
// pinned in the order they first missed are no hot set); misses are staged or copied as asked.
TEST_F(AutoOverBudget, NothingIsRegisteredWithoutADaemonToChoose) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 30 && !HasFailure(); ++i) token(s, i % 5 == 0);
    (void)hook_.sync(2000);
    const auto st = hook_.stats();
    EXPECT_EQ(st.pinned_bytes, 0u);
    EXPECT_GT(st.slice_misses, 0u);
    if (cu_.fake()) {
        EXPECT_EQ(cu_.knob<FakeCounts>("fake_cuda_counts")->registered, 0u);
    }
    EXPECT_EQ(st.fallbacks, 0u);
    destroy(s);
}

// How misses reach the device decides whether decode with every expert's math on the GPU
// (GGML_OP_OFFLOAD_MIN_BATCH=1) beats computing experts on the CPU: only from registered pages. On
// every other path the hook says so once, on stderr, with why and what to do, and tells the daemon
// (moecachectl status, the metrics). One fixture a path, each test in a process of its own.
class MissPathTold : public HookServing {
protected:
    // Decodes a while with stderr in a file; returns what the hook wrote there.
    std::string decode_and_capture(const std::function<void()>& before = {}) {
        const std::string log = dir_.path() + "/stderr";
        fflush(stderr);
        const int saved = dup(2);
        const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        dup2(fd, 2);
        close(fd);
        if (before) before();
        auto s = new_streams();
        warm_up(s);
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (hook_.stats().miss_path == 0 && std::chrono::steady_clock::now() < until) {
            token(s);
            (void)hook_.sync(100);
        }
        for (int i = 0; i < 5; ++i) token(s);
        (void)hook_.sync(200);
        destroy(s);
        fflush(stderr);
        dup2(saved, 2);
        close(saved);
        std::ifstream in(log);
        return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    }
    static size_t count(const std::string& text, const std::string& what) {
        size_t n = 0;
        for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
        return n;
    }
};

class MissPathOff : public MissPathTold {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "off"}};
    }
};
TEST_F(MissPathOff, PageableMissesAreSaidOnceWithWhatToDo) {
    const std::string err = decode_and_capture();
    EXPECT_EQ(hook_.stats().miss_path, 4u) << "MOECACHE_MISS_PATH_PAGEABLE_CHOSEN";
    EXPECT_EQ(count(err, "MOECACHE_CUDA_PIN=off: misses are copied from pageable memory"), 1u) << err;
    EXPECT_NE(err.find("slower than without moecache: unset MOECACHE_CUDA_PIN"), std::string::npos) << err;
}

class MissPathStaging : public MissPathTold {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "staging"}};
    }
};
TEST_F(MissPathStaging, StagedMissesAreSaidOnce) {
    const std::string err = decode_and_capture();
    EXPECT_EQ(hook_.stats().miss_path, 3u) << "MOECACHE_MISS_PATH_STAGED_CHOSEN";
    EXPECT_EQ(count(err, "MOECACHE_CUDA_PIN=staging"), 1u) << err;
}

class MissPathOverBudget : public MissPathTold {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "auto"}, {"MOECACHE_CUDA_PIN_BUDGET", "16M"}};
    }
};
TEST_F(MissPathOverBudget, AModelLargerThanThePinBudgetWithoutADaemonIsSaid) {
    const std::string err = decode_and_capture();
    EXPECT_EQ(hook_.stats().miss_path, 5u) << "MOECACHE_MISS_PATH_STAGED_OVER_BUDGET";
    EXPECT_EQ(count(err, "larger than the pin budget"), 1u) << err;
    EXPECT_NE(err.find("run moecached"), std::string::npos) << err;
}

class MissPathRegistered : public MissPathTold {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "auto"}};
    }
};
TEST_F(MissPathRegistered, TheRegisteredTierSaysNothing) {
    const std::string err = decode_and_capture();
    EXPECT_EQ(hook_.stats().miss_path, 1u) << "MOECACHE_MISS_PATH_REGISTERED";
    EXPECT_EQ(err.find("slower than without moecache"), std::string::npos) << err;
}

class MissPathSlowLink : public MissPathTold {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "10%"}, {"MOECACHE_CUDA_PIN", "auto"}};
    }
};
TEST_F(MissPathSlowLink, ALinkSlowerThanHostMemoryIsSaid) {
    auto* gbps = cu_.knob<double>("fake_cuda_link_gbps");
    if (gbps == nullptr) GTEST_SKIP() << "needs a link of a chosen speed: the fake driver's fake_cuda_link_gbps";
    const std::string err = decode_and_capture([&] { *gbps = 1.0; });
    EXPECT_EQ(hook_.stats().miss_path, 7u) << "MOECACHE_MISS_PATH_SLOW_LINK";
    EXPECT_EQ(count(err, "the link to the GPU is slower than reading host memory"), 1u) << err;
}

// A miss whose pages are not in the page cache (a model larger than RAM, lazily loaded) is read from
// the file by the staging threads, in large requests, instead of faulted in through the mapping a
// page at a time; the bytes are the file's all the same.
class ColdMisses : public AutoOverBudget {};

TEST_F(ColdMisses, MissesNotInThePageCacheAreReadFromTheFile) {
    auto s = new_streams();
    warm_up(s);
    sync_all();
    // The model leaves the page cache: this process's pages unmapped, then dropped.
    ASSERT_EQ(madvise(const_cast<uint8_t*>(model_.base), model_.size, MADV_DONTNEED), 0);
    {
        const int fd = ::open(files_[0].c_str(), O_RDONLY | O_CLOEXEC);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
        ::close(fd);
    }
    std::vector<unsigned char> in((model_.size + 4095) / 4096);
    ASSERT_EQ(mincore(const_cast<uint8_t*>(model_.base), model_.size, in.data()), 0);
    if (std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; }) > static_cast<long>(in.size() / 2))
        GTEST_SKIP() << "the page cache kept the model (a file system that cannot drop it, such as tmpfs)";
    const auto before = hook_.stats();
    // Whole tensors, as a prompt batch copies them: every slice the small pool lacks comes from the host.
    std::vector<uint32_t> all(32);
    for (uint32_t e = 0; e < 32; ++e) all[e] = e;
    for (uint32_t l = 0; l < 4 && !HasFailure(); ++l)
        for (uint32_t t = 0; t < 3; ++t) ASSERT_GE(copy_and_check(cu_, model_, dst_[l][t], l, t, all, s[0]), 1);
    const auto after = hook_.stats();
    EXPECT_GT(after.slice_misses - before.slice_misses, 4u * 3u * 16u);
    // Nearly every missed byte was read from the file (the copies' small pieces, under 256 KiB, go
    // the driver's way).
    EXPECT_GT(after.bytes_read_from_files - before.bytes_read_from_files, (after.bytes_from_host - before.bytes_from_host) / 2)
        << "staged " << (after.bytes_staged - before.bytes_staged) << " of " << (after.bytes_from_host - before.bytes_from_host);
    EXPECT_EQ(after.fallbacks, 0u);
    destroy(s);
}

// llama.cpp runs the expert products of host-resident weights on its first GPU for every layer:
// device 0 copies the experts of layers whose other work runs on device 1. With peer access it
// reads them from device 1's pool, byte for byte, while device 1 goes on using (and evicting from)
// that pool on its own stream.
class Peers : public TwoDevices {
protected:
    void first_device_copies(const std::vector<CUstream>& s, int tokens) {
        ASSERT_TRUE(cu_.use_device(0));
        for (int i = 0; i < tokens && !HasFailure(); ++i) {
            for (uint32_t l = 2; l < 4; ++l) {
                const auto ids = token_ids();
                for (uint32_t t = 0; t < 3; ++t)
                    ASSERT_GE(copy_and_check(cu_, model_, on_first_[l - 2][t], l, t, ids, s[0]), 1);
            }
            token(s, i % 3 == 0);  // device 1's own copies, admissions and evictions, in between
            ASSERT_TRUE(cu_.use_device(0));
        }
    }
    void allocate_on_first() {
        ASSERT_TRUE(cu_.use_device(0));
        for (auto& layer : on_first_)
            for (auto& d : layer) ASSERT_EQ(cu_.mem_alloc(&d, slice_ * 32 + 512), CUDA_SUCCESS);
    }
    CUdeviceptr on_first_[2][3] = {};
};

TEST_F(Peers, TheFirstDeviceReadsWhatTheOtherPooled) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 60; ++i) token(s);
    allocate_on_first();
    const auto before = hook_.stats();
    first_device_copies(s, 40);
    const auto after = hook_.stats();
    EXPECT_GT(after.peer_hits, before.peer_hits + 40) << "device 0 read device 1's pool";
    EXPECT_GT(after.bytes_from_peers, before.bytes_from_peers);
    EXPECT_GT(hit_rate(before, after), 0.3);
    if (cu_.fake()) {
        EXPECT_GT(cu_.knob<FakeCounts>("fake_cuda_counts")->peer_calls, 40u);
    }
    EXPECT_EQ(after.fallbacks, 0u);
    sync_all();
    destroy(s);
}

// The ordering rule across devices: device 0's read of a slot device 1 is still filling waits for
// the fill, and device 1's refill of a slot device 0 is still reading waits for the read, whichever
// device's queue runs first. Device 0 pools nothing of its own here, and device 1's pool churns
// (a small pool, experts drawn evenly), so that reads of slots just filled are frequent. (Refills of
// slots just read are rarer, their experts being the hottest: the eviction side is the same join.)
class PeerOrder : public Peers {
    std::vector<std::pair<const char*, const char*>> env() const override { return {{"MOECACHE_CUDA_POOL", "0:0,1:20%"}}; }

protected:
    std::vector<uint32_t> even_ids() {
        std::uniform_int_distribution<uint32_t> any(0, 31);
        std::vector<uint32_t> ids;
        while (ids.size() < 4)
            if (const uint32_t e = any(rng_); std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
        return ids;
    }
};

TEST_F(PeerOrder, ReadsAcrossDevicesAreOrderedWithTheOwnersFillsAndEvictions) {
    auto s = new_streams();
    warm_up(s);
    allocate_on_first();
    const uint64_t bytes = slice_ * 32 + 512;
    const std::vector<uint8_t> garbage(bytes, 0xA5);
    std::vector<uint8_t> back(bytes);
    const auto before = hook_.stats();
    // One copy per device and step, so that nothing else runs a queue in between: device 1 copies
    // (filling slots), device 0 copies the same experts (reading them), device 1 copies others
    // (refilling slots device 0 read); then one device's queue runs first, the other's next time.
    for (int i = 0; i < 240 && !HasFailure(); ++i) {
        const uint32_t t = static_cast<uint32_t>(i / 2) % 3;
        const CUdeviceptr mine = on_first_[0][t];
        ASSERT_TRUE(cu_.use_device(0));
        ASSERT_EQ(cu_.htod(mine, garbage.data(), bytes), CUDA_SUCCESS);  // runs every queue
        const auto ids = even_ids();
        ASSERT_TRUE(cu_.use_device(1));
        ASSERT_TRUE(copy_experts(cu_, model_, dst_[2][t], 2, t, ids, s[1]));
        ASSERT_TRUE(cu_.use_device(0));
        ASSERT_TRUE(copy_experts(cu_, model_, mine, 2, t, ids, s[0]));
        ASSERT_TRUE(cu_.use_device(1));
        ASSERT_TRUE(copy_experts(cu_, model_, dst_[2][t], 2, t, even_ids(), s[1]));
        for (int k = 0; k < 2; ++k) {
            ASSERT_TRUE(cu_.use_device((i + k) % 2));
            ASSERT_EQ(cu_.ctx_synchronize(), CUDA_SUCCESS);
        }
        ASSERT_TRUE(cu_.use_device(0));
        ASSERT_EQ(cu_.dtoh(back.data(), mine, bytes), CUDA_SUCCESS);
        const auto& tensor = model_.map.layers[2].tensors[t];
        for (uint32_t e : ids)
            ASSERT_EQ(memcmp(back.data() + e * slice_, model_.base + tensor.offset + e * slice_, slice_), 0)
                << "round " << i << " tensor " << t << " expert " << e;
    }
    const auto after = hook_.stats();
    EXPECT_GT(after.peer_hits, before.peer_hits + 40);
    EXPECT_GT(after.evicted, before.evicted + 20) << "device 1 refilled slots";
    EXPECT_EQ(after.fallbacks, 0u);
    destroy(s);
}

// llama.cpp on two GPUs runs the down projections of the second GPU's layers there and every other
// expert product on the first: each device sizes its pool for the expert tensors it copies, and
// ranks them by its own copies.
TEST_F(Peers, EachDeviceSizesItsPoolForTheTensorsItCopies) {
    auto s = new_streams();
    allocate_on_first();
    auto split_token = [&] {
        for (uint32_t l = 0; l < 4 && !HasFailure(); ++l) {
            const auto ids = token_ids();
            for (uint32_t t = 0; t < 3; ++t) {
                const bool second = l >= 2 && t == 2;
                ASSERT_TRUE(cu_.use_device(second ? 1 : 0));
                const CUdeviceptr dst = second ? dst_[l][t] : l >= 2 ? on_first_[l - 2][t] : dst_[l][t];
                ASSERT_TRUE(copy_experts(cu_, model_, dst, l, t, ids, s[second ? 1 : 0]));
            }
        }
        ASSERT_TRUE(cu_.use_device(0));
    };
    for (int i = 0; i < 3; ++i) {
        split_token();
        ASSERT_GE(hook_.sync(10000), 1);
    }
    for (int i = 0; i < 150; ++i) split_token();
    ASSERT_GE(hook_.sync(10000), 1);
    const uint64_t tensor_bytes = (slice_ + 512) * 32;  // each slot with its tail room
    const double first = static_cast<double>(hook_.pool_bytes(0)) / static_cast<double>(10 * tensor_bytes);
    const double second = static_cast<double>(hook_.pool_bytes(1)) / static_cast<double>(2 * tensor_bytes);
    EXPECT_GT(first, 0.45);
    EXPECT_LE(first, 0.5) << "device 0 copies 10 of the 12 expert tensors";
    EXPECT_GT(second, 0.45);
    EXPECT_LE(second, 0.5) << "device 1 copies 2 of them";
    const auto before = hook_.stats();
    for (int i = 0; i < 40; ++i) split_token();
    EXPECT_GT(hit_rate(before, hook_.stats()), 0.4);
    EXPECT_EQ(hook_.stats().fallbacks, 0u);
    sync_all();
    destroy(s);
}

class NoPeers : public Peers {
    std::vector<std::pair<const char*, const char*>> env() const override {
        return {{"MOECACHE_CUDA_POOL", "50%"}, {"MOECACHE_CUDA_PEER", "off"}};
    }
};

TEST_F(NoPeers, EachDeviceReadsItsOwnPoolOnly) {
    auto s = new_streams();
    warm_up(s);
    for (int i = 0; i < 30; ++i) token(s);
    allocate_on_first();
    first_device_copies(s, 20);
    const auto st = hook_.stats();
    EXPECT_EQ(st.peer_hits, 0u);
    if (cu_.fake()) {
        EXPECT_EQ(cu_.knob<FakeCounts>("fake_cuda_counts")->peer_calls, 0u);
    }
    EXPECT_EQ(st.fallbacks, 0u);
    destroy(s);
}

class Unmapped : public HookServing {
    bool map_model() const override { return false; }
};

TEST_F(Unmapped, LargeCopiesFromMemoryThatMapsNoModelAreNamed) {
    // What a runtime that read its model into its own memory does (llama.cpp --load-mode none).
    constexpr size_t kChunk = 16 << 20;
    std::vector<uint8_t> host(kChunk, 0x5a);
    CUdeviceptr d = 0;
    ASSERT_EQ(cu_.mem_alloc(&d, kChunk), CUDA_SUCCESS);
    char log[] = "/tmp/moecache-unmapped-XXXXXX";
    const int fd = mkstemp(log);
    ASSERT_GE(fd, 0);
    const int saved = dup(STDERR_FILENO);
    ASSERT_GE(dup2(fd, STDERR_FILENO), 0);
    (void)hook_.sync(3000);  // the hook has looked at this process's mappings: none is a model
    for (int i = 0; i < 65; ++i) ASSERT_EQ(cu_.htod_async(d, host.data(), kChunk, nullptr), CUDA_SUCCESS);
    std::string said;
    for (int i = 0; i < 50 && said.find("without mmap") == std::string::npos; ++i) {
        (void)hook_.sync(200);
        std::ifstream in(log);
        std::stringstream ss;
        ss << in.rdbuf();
        said = ss.str();
    }
    dup2(saved, STDERR_FILENO);
    close(saved);
    close(fd);
    unlink(log);
    const auto st = hook_.stats();
    EXPECT_EQ(st.unmapped_copies, 65u);
    EXPECT_EQ(st.unmapped_bytes, 65ull * kChunk);
    EXPECT_NE(said.find("maps no GGUF model"), std::string::npos) << said;
    EXPECT_NE(said.find("--load-mode"), std::string::npos) << said;
    EXPECT_NE(said.find("--no-mmap"), std::string::npos) << said;
    EXPECT_EQ(std::count(said.begin(), said.end(), '\n'), 1) << "said once: " << said;
    cu_.mem_free(d);
}

class ModelsByContent : public HookServing {
    bool map_model() const override { return false; }
};

// A split set kept as blobs (an ollama store, a Hugging Face cache's blobs/), every part mapped as
// llama.cpp maps it: the hook knows it as one model from any part's copies.
TEST_F(ModelsByContent, ABlobNamedSplitSetIsOneModel) {
    auto spec = small_spec();
    spec.n_layers = 6;
    std::filesystem::create_directories(dir_.path() + "/gen");
    std::filesystem::create_directories(dir_.path() + "/blobs");
    auto parts = write_model(spec, dir_.path() + "/gen/model.gguf", 3);
    ASSERT_EQ(parts.size(), 3u);
    std::vector<std::string> blobs;
    for (int i = 0; i < 3; ++i) {
        blobs.push_back(dir_.path() + "/blobs/sha256-" + std::string(8, static_cast<char>('f' - i)));
        std::filesystem::rename(parts[static_cast<size_t>(i)], blobs.back());
    }
    std::vector<MappedModel> mapped(3);
    for (int i = 0; i < 3; ++i) ASSERT_EQ(mapped[static_cast<size_t>(i)].open(blobs[static_cast<size_t>(i)]), "");
    // Layers whose experts lie in the second and third parts.
    const ExpertMap& map = mapped[0].map;
    ASSERT_EQ(map.files.size(), 3u);
    CUdeviceptr d = 0;
    ASSERT_EQ(cu_.mem_alloc(&d, map.layers[0].tensors[0].bytes_per_expert * map.n_experts + 512), CUDA_SUCCESS);
    int copies = 0;
    for (int round = 0; round < 3; ++round) {
        for (uint32_t l = 0; l < map.layers.size(); ++l) {
            const auto& t = map.layers[l].tensors[0];
            if (t.file == 0) continue;
            const uint8_t* base = mapped[t.file].base;
            ASSERT_EQ(cu_.htod_async(d, base + t.offset, t.bytes_per_expert, nullptr), CUDA_SUCCESS);
            ++copies;
        }
        (void)hook_.sync(5000);
    }
    ASSERT_GT(copies, 0) << "the generator put every layer in the first part";
    const auto st = hook_.stats();
    EXPECT_EQ(st.models, 1u) << "three blobs, one model";
    EXPECT_GT(st.expert_copies, 0u) << "copies out of the second and third blobs are expert copies";
    cu_.mem_free(d);
}

// The hook's own hot profile (no daemon): a run that decoded leaves the experts it routed to most
// in MOECACHE_CUDA_PROFILE at exit; the next run of the same model (found by its content, here a
// copy written elsewhere) fills its pool with them before they are asked for.
class HotProfiles : public HookServing {
protected:
    std::vector<std::pair<const char*, const char*>> env() const override {
        // The folder of the test that started this process (a death test's child runs the test again).
        const char* given = getenv("MOECACHE_TEST_PROFILE_DIR");
        profiles_ = given != nullptr ? given : dir_.path() + "/profiles";
        return {{"MOECACHE_CUDA_PROFILE", profiles_.c_str()}, {"MOECACHE_CUDA_POOL", "50%"}, {"MOECACHE_CUDA_LOG", "1"}};
    }
    std::string profile_path() const {
        auto name = cuda::hot_profile_name(files_[0]);
        EXPECT_TRUE(name) << name.error().what();
        return profiles_ + "/" + (name ? *name : std::string("?"));
    }
    // One token routed to `ids` in every layer.
    void token_to(const std::vector<CUstream>& streams, const std::vector<uint32_t>& ids) {
        for (uint32_t l = 0; l < 4 && !HasFailure(); ++l)
            for (uint32_t t = 0; t < 3; ++t)
                ASSERT_TRUE(copy_experts(cu_, model_, dst_[l][t], l, t, ids, streams[0]));
    }
    mutable std::string profiles_;
};

class HotProfileRead : public HotProfiles {
protected:
    // The last run's profile: experts 24-27 of every layer, which this test's warm-up rarely routes
    // to (a geometric pick from 0), hottest; a few others warm.
    void before_map() override {
        cuda::HotProfile p;
        p.n_layers = 4;
        p.n_experts = 32;
        p.routings = 4096;
        p.counts.assign(4 * 32, 0);
        for (uint32_t l = 0; l < 4; ++l) {
            for (uint32_t e = 24; e < 28; ++e) p.counts[l * 32 + e] = 900 + e;
            p.counts[l * 32 + 1] = 30;
        }
        auto saved = cuda::save_hot_profile(profile_path(), p);
        ASSERT_TRUE(saved) << saved.error().what();
    }
};

TEST_F(HotProfileRead, TheNextRunsPoolHoldsTheLastRunsHotExpertsBeforeTheyAreAskedFor) {
    auto s = new_streams();
    warm_up(s);
    // The pool fills from the profile in the background: 4 experts x 4 layers x 3 tensors.
    for (int i = 0; i < 100 && hook_.stats().filled_ahead < 48; ++i) (void)hook_.sync(100);
    ASSERT_GE(hook_.stats().filled_ahead, 48u) << "the profile's experts were not filled ahead";
    sync_all();
    const auto before = hook_.stats();
    for (uint32_t t = 0; t < 3; ++t) ASSERT_GE(copy_and_check(cu_, model_, dst_[0][t], 0, t, {24, 25, 26, 27}, s[0]), 1);
    token_to(s, {24, 25, 26, 27});
    const auto after = hook_.stats();
    EXPECT_EQ(after.slice_misses - before.slice_misses, 0u) << "the first use of the profile's experts missed";
    EXPECT_EQ(after.slice_hits - before.slice_hits, 3u * 4 + 4u * 3 * 4);
    destroy(s);
}

TEST_F(HotProfiles, ARunThatDecodedLeavesTheExpertsItUsedMostForTheNext) {
    ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
    setenv("MOECACHE_TEST_PROFILE_DIR", profiles_.c_str(), 1);
    // The run: decodes mostly experts 5, 9, 13, 17, and exits as a runtime does (the hook saves then).
    EXPECT_EXIT(
        {
            auto s = new_streams();
            warm_up(s);
            for (int i = 0; i < 80; ++i) token_to(s, i % 4 == 3 ? std::vector<uint32_t>{0, 1, 2, 3} : std::vector<uint32_t>{5, 9, 13, 17});
            sync_all();
            std::error_code ec;
            std::filesystem::remove_all(dir_.path(), ec);  // its own model (this child's fixture is not torn down)
            std::exit(HasFailure() ? 3 : 0);
        },
        ::testing::ExitedWithCode(0), "hot profile saved");
    unsetenv("MOECACHE_TEST_PROFILE_DIR");
    auto p = cuda::load_hot_profile(profile_path(), 4, 32);
    ASSERT_TRUE(p) << p.error().what();
    EXPECT_GE(p->routings, 80u * 4 * 4);
    for (uint32_t l = 0; l < 4; ++l) {
        std::vector<uint32_t> order(32);
        for (uint32_t e = 0; e < 32; ++e) order[e] = e;
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return p->counts[l * 32 + a] > p->counts[l * 32 + b]; });
        std::vector<uint32_t> top(order.begin(), order.begin() + 4);
        std::sort(top.begin(), top.end());
        EXPECT_EQ(top, (std::vector<uint32_t>{5, 9, 13, 17})) << "layer " << l;
    }
    struct stat st {};
    ASSERT_EQ(stat(profiles_.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u) << "the profiles' folder is the user's alone";
}

}  // namespace
}  // namespace moecache::test

int main(int argc, char** argv) {
    return moecache::test::preloaded_test_main(argc, argv, {{"MOECACHE_CUDA_CLIENT", "off"}});
}
