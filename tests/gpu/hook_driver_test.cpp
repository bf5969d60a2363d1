// libmoecache-cuda.so under the driver API, reached the way a statically linked cudart reaches it:
// dlopen("libcuda.so.1"), dlsym cuGetProcAddress_v2, entry points through it. ctest runs this twice:
// against tests' fake libcuda (label unit: CI has no GPU) and against the real driver (label gpu).
// The destination of every expert copy is read back and compared with the model's bytes.
#include "hook/cuda_driver.h"
#include "model_fixture.h"
#include "preload_main.h"
#include "temp_dir.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

namespace moecache::test {
namespace {

std::string object_of(void* fn) {
    Dl_info info{};
    return dladdr(fn, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "?";
}

class HookDriver : public ::testing::Test {
protected:
    void SetUp() override {
        ASSERT_TRUE(hook_.load()) << "libmoecache-cuda.so is not preloaded (ctest sets LD_PRELOAD)";
        if (auto why = cu_.load(); !why.empty()) GTEST_SKIP() << why;
        // Streams that run their work as late as allowed: a missing wait shows as wrong bytes.
        if (auto* async = cu_.knob<int>("fake_cuda_async")) *async = 1;
        auto spec = small_spec();
        spec.n_layers = 4;
        spec.n_experts = 32;
        spec.n_experts_used = 4;
        spec.n_ff_exp = 256;
        spec.n_embd = 256;
        files_ = write_model(spec, dir_.path() + "/hook.gguf");
        ASSERT_EQ(model_.open(files_[0]), "");
    }
    moecache_cuda_stats stats() { return hook_.stats(); }
    int copy_and_check(CUdeviceptr dst, uint32_t l, uint32_t t, std::vector<uint32_t> ids, CUstream stream, int how) {
        return test::copy_and_check(cu_, model_, dst, l, t, std::move(ids), stream, static_cast<CopyKind>(how));
    }

    TempDir dir_;
    CudaDriver cu_;
    HookProbe hook_;
    std::vector<std::string> files_;
    MappedModel model_;
    const ExpertMap& map_ = model_.map;
};

TEST_F(HookDriver, EntryPointsComeFromTheHook) {
    EXPECT_NE(object_of(reinterpret_cast<void*>(cu_.get_proc)).find("libmoecache-cuda"), std::string::npos)
        << "dlsym(libcuda, cuGetProcAddress_v2) gave " << object_of(reinterpret_cast<void*>(cu_.get_proc));
    for (void* fn : {reinterpret_cast<void*>(cu_.htod_async), reinterpret_cast<void*>(cu_.htod_async_ptsz),
                     reinterpret_cast<void*>(cu_.htod), reinterpret_cast<void*>(cu_.memcpy_async),
                     reinterpret_cast<void*>(cu_.mem_alloc), reinterpret_cast<void*>(cu_.dtoh),
                     reinterpret_cast<void*>(cu_.begin_capture), reinterpret_cast<void*>(cu_.end_capture)})
        EXPECT_NE(object_of(fn).find("libmoecache-cuda"), std::string::npos) << object_of(fn);
    EXPECT_NE(cu_.htod_async, cu_.htod_async_ptsz) << "the per-thread-stream variant is a hook of its own";
    // Functions the hook does not interpose come from the driver itself. (A device-to-host copy is
    // interposed now: it may be the runtime reading its router's ids back; so are captures.)
    EXPECT_EQ(object_of(reinterpret_cast<void*>(cu_.stream_synchronize)).find("libmoecache-cuda"), std::string::npos);
}

TEST_F(HookDriver, ExpertCopiesAreByteIdentical) {
    const uint32_t n = map_.n_experts;
    std::vector<CUdeviceptr> dst(map_.layers.size() * 3, 0);
    size_t total = 0;
    for (uint32_t l = 0; l < map_.layers.size(); ++l)
        for (uint32_t t = 0; t < map_.layers[l].tensors.size(); ++t) {
            const size_t bytes = map_.layers[l].tensors[t].bytes_per_expert * n + 512;
            ASSERT_EQ(cu_.mem_alloc(&dst[l * 3 + t], bytes), CUDA_SUCCESS);
            total += bytes;
        }
    CUstream streams[2];
    ASSERT_EQ(cu_.stream_create(&streams[0], 0), CUDA_SUCCESS);
    ASSERT_EQ(cu_.stream_create(&streams[1], 0), CUDA_SUCCESS);
    // The first expert copies make the hook find the model and ask for a pool.
    ASSERT_GE(copy_and_check(dst[0], 0, 0, {1, 2}, streams[0], 0), 1);
    ASSERT_GE(hook_.sync(10000), 1) << "the hook did not find the mapped model";
    ASSERT_GE(copy_and_check(dst[0], 0, 0, {1, 2}, streams[0], 0), 1);
    ASSERT_GE(hook_.sync(10000), 1);
    ASSERT_GT(stats().pool_bytes, 0u) << "no pool was allocated";

    std::mt19937 rng(42);
    // Skewed: low ids are hot, so that the pool has hits and evictions both.
    std::geometric_distribution<uint32_t> pick(0.12);
    int copies = 0;
    for (int it = 0; it < 600 && !HasFailure(); ++it) {
        const uint32_t l = rng() % map_.layers.size();
        std::vector<uint32_t> ids;
        while (ids.size() < map_.n_experts_used) ids.push_back(std::min(pick(rng), n - 1));
        if (rng() % 10 == 0) ids.push_back(n - 1);  // the last expert: a copy without padding
        const int how = static_cast<int>(rng() % 8) < 5 ? 0 : static_cast<int>(rng() % 4);
        for (uint32_t t = 0; t < map_.layers[l].tensors.size(); ++t) {
            const int k = copy_and_check(dst[l * 3 + t], l, t, ids, streams[it % 8 == 7 ? 1 : 0], how);
            ASSERT_GE(k, 0);
            copies += k;
        }
    }
    const auto s = stats();
    RecordProperty("copies", copies);
    EXPECT_GE(s.expert_copies, static_cast<uint64_t>(copies));
    EXPECT_GT(s.served, 0u);
    EXPECT_GT(s.slice_hits, 0u) << "nothing came from the pool";
    EXPECT_GT(s.admitted, 0u);
    EXPECT_EQ(s.fallbacks, 0u);
    std::printf("expert copies %llu, served %llu, slices hit %llu / missed %llu, admitted %llu, evicted %llu\n",
                static_cast<unsigned long long>(s.expert_copies), static_cast<unsigned long long>(s.served),
                static_cast<unsigned long long>(s.slice_hits), static_cast<unsigned long long>(s.slice_misses),
                static_cast<unsigned long long>(s.admitted), static_cast<unsigned long long>(s.evicted));
    for (auto d : dst) cu_.mem_free(d);
}

TEST_F(HookDriver, CopiesFromElsewherePassThrough) {
    CUdeviceptr d = 0;
    ASSERT_EQ(cu_.mem_alloc(&d, 1 << 20), CUDA_SUCCESS);
    std::vector<uint8_t> host(1 << 20);
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 7);
    const auto before = stats();
    ASSERT_EQ(cu_.htod_async(d, host.data(), host.size(), nullptr), CUDA_SUCCESS);
    ASSERT_EQ(cu_.ctx_synchronize(), CUDA_SUCCESS);
    const auto after = stats();
    EXPECT_EQ(after.copies, before.copies + 1);
    EXPECT_EQ(after.expert_copies, before.expert_copies);
    std::vector<uint8_t> back(host.size());
    ASSERT_EQ(cu_.dtoh(back.data(), d, back.size()), CUDA_SUCCESS);
    EXPECT_EQ(back, host);
    // A host-to-host copy out of the model (cuMemcpy with a host destination) is no device copy.
    std::vector<uint8_t> h2h(4096);
    ASSERT_EQ(cu_.memcpy_sync(reinterpret_cast<CUdeviceptr>(h2h.data()),
                              reinterpret_cast<CUdeviceptr>(model_.base + map_.layers[0].tensors[0].offset), h2h.size()),
              CUDA_SUCCESS);
    EXPECT_EQ(memcmp(h2h.data(), model_.base + map_.layers[0].tensors[0].offset, h2h.size()), 0);
    cu_.mem_free(d);
}

TEST_F(HookDriver, StreamCapturePassesThrough) {
    auto* capturing = cu_.knob<int>("fake_cuda_capturing");
    if (capturing == nullptr) GTEST_SKIP() << "needs the fake driver's capture switch (the real one is covered by llama.cpp's graphs)";
    CUdeviceptr d = 0;
    const auto& t = map_.layers[0].tensors[0];
    ASSERT_EQ(cu_.mem_alloc(&d, t.bytes_per_expert * map_.n_experts + 512), CUDA_SUCCESS);
    ASSERT_GE(copy_and_check(d, 0, 0, {3}, nullptr, 0), 1);
    ASSERT_GE(hook_.sync(10000), 1);
    *capturing = 1;
    const auto before = stats();
    ASSERT_GE(copy_and_check(d, 0, 0, {3, 4}, nullptr, 0), 1);
    *capturing = 0;
    const auto after = stats();
    EXPECT_GT(after.captured, before.captured);
    EXPECT_EQ(after.served, before.served);
    cu_.mem_free(d);
}

TEST_F(HookDriver, PoolYieldsToAnAllocationThatWouldFail) {
    auto* limit = cu_.knob<unsigned long long>("fake_cuda_memory_limit");
    if (limit == nullptr) GTEST_SKIP() << "needs the fake driver's memory limit (filling a real GPU takes too long for a test)";
    CUdeviceptr d = 0;
    const auto& t = map_.layers[0].tensors[0];
    ASSERT_EQ(cu_.mem_alloc(&d, t.bytes_per_expert * map_.n_experts + 512), CUDA_SUCCESS);
    ASSERT_GE(copy_and_check(d, 0, 0, {5}, nullptr, 0), 1);
    ASSERT_GE(hook_.sync(10000), 1);  // the pool, then sized for the layer its next copy shows
    ASSERT_GE(copy_and_check(d, 0, 0, {5}, nullptr, 0), 1);
    ASSERT_GE(hook_.sync(10000), 1);
    ASSERT_GT(stats().pool_bytes, 0u);
    size_t free_bytes = 0, total = 0;
    ASSERT_EQ(cu_.mem_get_info(&free_bytes, &total), CUDA_SUCCESS);
    // The pool counts as free; an allocation of all of it must succeed by taking the pool's memory.
    const unsigned long long saved = *limit;
    *limit = total - free_bytes + stats().pool_bytes + (1u << 20);
    ASSERT_EQ(cu_.mem_get_info(&free_bytes, &total), CUDA_SUCCESS);
    CUdeviceptr big = 0;
    EXPECT_EQ(cu_.mem_alloc(&big, free_bytes - (1u << 19)), CUDA_SUCCESS);
    EXPECT_GT(stats().yielded_bytes, 0u);
    if (big != 0) cu_.mem_free(big);
    *limit = saved;
    // Copies still come out right with less (or no) pool.
    EXPECT_GE(copy_and_check(d, 0, 0, {5, 6, 9}, nullptr, 0), 1);
    cu_.mem_free(d);
}

}  // namespace
}  // namespace moecache::test

int main(int argc, char** argv) {
    return moecache::test::preloaded_test_main(argc, argv, {{"MOECACHE_CUDA_CLIENT", "off"}});
}
