// libmoecache-cuda.so under the driver API, reached the way a statically linked cudart reaches it:
// dlopen("libcuda.so.1"), dlsym cuGetProcAddress_v2, entry points through it. ctest runs this twice:
// against tests' fake libcuda (label unit: CI has no GPU) and against the real driver (label gpu).
// The destination of every expert copy is read back and compared with the model's bytes.
#include "model_fixture.h"
#include "preload_main.h"
#include "moecache/cuda_hook.h"
#include "moecache/model.h"
#include "temp_dir.h"

#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#undef cuGetProcAddress

namespace moecache::test {
namespace {

using GetProc = CUresult(CUDAAPI*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

struct Cu {
    CUresult(CUDAAPI* init)(unsigned);
    CUresult(CUDAAPI* device_get)(CUdevice*, int);
    CUresult(CUDAAPI* primary_ctx_retain)(CUcontext*, CUdevice);
    CUresult(CUDAAPI* ctx_set_current)(CUcontext);
    CUresult(CUDAAPI* stream_create)(CUstream*, unsigned);
    CUresult(CUDAAPI* stream_synchronize)(CUstream);
    CUresult(CUDAAPI* ctx_synchronize)();
    CUresult(CUDAAPI* mem_alloc)(CUdeviceptr*, size_t);
    CUresult(CUDAAPI* mem_free)(CUdeviceptr);
    CUresult(CUDAAPI* mem_get_info)(size_t*, size_t*);
    CUresult(CUDAAPI* htod)(CUdeviceptr, const void*, size_t);
    CUresult(CUDAAPI* htod_async)(CUdeviceptr, const void*, size_t, CUstream);
    CUresult(CUDAAPI* htod_async_ptsz)(CUdeviceptr, const void*, size_t, CUstream);
    CUresult(CUDAAPI* memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult(CUDAAPI* memcpy_sync)(CUdeviceptr, CUdeviceptr, size_t);
    CUresult(CUDAAPI* dtoh)(void*, CUdeviceptr, size_t);
};

std::string object_of(void* fn) {
    Dl_info info{};
    return dladdr(fn, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "?";
}

class HookDriver : public ::testing::Test {
protected:
    void SetUp() override {
        stats_get_ = reinterpret_cast<decltype(stats_get_)>(dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get"));
        sync_ = reinterpret_cast<decltype(sync_)>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"));
        ASSERT_NE(stats_get_, nullptr) << "libmoecache-cuda.so is not preloaded (ctest sets LD_PRELOAD)";
        lib_ = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib_ == nullptr) GTEST_SKIP() << "no libcuda.so.1 here: " << dlerror();
        fake_ = dlsym(lib_, "fake_cuda_counts") != nullptr;
        get_proc_ = reinterpret_cast<GetProc>(dlsym(lib_, "cuGetProcAddress_v2"));
        ASSERT_NE(get_proc_, nullptr);
        get(cu_.init, "cuInit");
        if (cu_.init(0) != CUDA_SUCCESS) GTEST_SKIP() << "cuInit failed: no usable CUDA device here";
        get(cu_.device_get, "cuDeviceGet");
        get(cu_.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
        get(cu_.ctx_set_current, "cuCtxSetCurrent");
        get(cu_.stream_create, "cuStreamCreate");
        get(cu_.stream_synchronize, "cuStreamSynchronize");
        get(cu_.ctx_synchronize, "cuCtxSynchronize");
        get(cu_.mem_alloc, "cuMemAlloc");
        get(cu_.mem_free, "cuMemFree");
        get(cu_.mem_get_info, "cuMemGetInfo");
        get(cu_.htod, "cuMemcpyHtoD");
        get(cu_.htod_async, "cuMemcpyHtoDAsync");
        get(cu_.htod_async_ptsz, "cuMemcpyHtoDAsync", CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
        get(cu_.memcpy_async, "cuMemcpyAsync");
        get(cu_.memcpy_sync, "cuMemcpy");
        get(cu_.dtoh, "cuMemcpyDtoH");
        CUdevice dev = 0;
        CUcontext ctx = nullptr;
        ASSERT_EQ(cu_.device_get(&dev, 0), CUDA_SUCCESS);
        ASSERT_EQ(cu_.primary_ctx_retain(&ctx, dev), CUDA_SUCCESS);
        ASSERT_EQ(cu_.ctx_set_current(ctx), CUDA_SUCCESS);

        auto spec = small_spec();
        spec.n_layers = 4;
        spec.n_experts = 32;
        spec.n_experts_used = 4;
        spec.n_ff_exp = 256;
        spec.n_embd = 256;
        files_ = write_model(spec, dir_.path() + "/hook.gguf");
        auto parts = open_gguf_model(files_[0]);
        ASSERT_TRUE(parts) << parts.error().message;
        auto map = ExpertMap::build(*parts);
        ASSERT_TRUE(map) << map.error().message;
        map_ = std::move(*map);
        const int fd = open(files_[0].c_str(), O_RDONLY | O_CLOEXEC);
        ASSERT_GE(fd, 0);
        size_ = static_cast<size_t>(lseek(fd, 0, SEEK_END));
        base_ = static_cast<const uint8_t*>(mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0));
        close(fd);
        ASSERT_NE(base_, MAP_FAILED);
    }
    void TearDown() override {
        if (base_ != nullptr && base_ != MAP_FAILED) munmap(const_cast<uint8_t*>(base_), size_);
    }

    // At CUDA 12.0's ABI: CUDA 13 gave cuCtxSynchronize a context argument (cuCtxSynchronize_v2).
    template <class F>
    void get(F& fn, const char* name, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT) {
        void* p = nullptr;
        ASSERT_EQ(get_proc_(name, &p, 12000, flags, nullptr), CUDA_SUCCESS) << name;
        fn = reinterpret_cast<F>(p);
    }
    moecache_cuda_stats stats() {
        moecache_cuda_stats s{};
        stats_get_(&s);
        return s;
    }
    // Copies the chosen experts of tensor `t` of layer slot `l` as llama.cpp groups them, then reads
    // the destination back and compares it with the file. Returns the number of grouped copies.
    int copy_and_check(CUdeviceptr dst, uint32_t l, uint32_t t, std::vector<uint32_t> ids, CUstream stream, int how) {
        const auto& tensor = map_.layers[l].tensors[t];
        const uint64_t slice = tensor.bytes_per_expert;
        const uint32_t n = map_.n_experts;
        std::sort(ids.begin(), ids.end());
        ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
        std::vector<std::pair<uint32_t, uint32_t>> groups;
        for (uint32_t id : ids) {
            if (!groups.empty() && groups.back().second + 1 == id) groups.back().second = id;
            else groups.emplace_back(id, id);
        }
        std::vector<uint8_t> garbage(slice * n + 512, 0xA5), back(slice * n + 512);
        EXPECT_EQ(cu_.htod(dst, garbage.data(), garbage.size()), CUDA_SUCCESS);
        for (auto [first, last] : groups) {
            const uint64_t off = first * slice;
            const uint64_t bytes = (last - first + 1) * slice + (last < n - 1 ? std::min<uint64_t>(slice, 512) : 0);
            const void* src = base_ + tensor.offset + off;
            CUresult r = CUDA_SUCCESS;
            switch (how) {
                case 0: r = cu_.htod_async(dst + off, src, bytes, stream); break;
                case 1: r = cu_.htod_async_ptsz(dst + off, src, bytes, nullptr); break;
                case 2: r = cu_.htod(dst + off, src, bytes); break;
                default: r = cu_.memcpy_async(dst + off, reinterpret_cast<CUdeviceptr>(src), bytes, stream); break;
            }
            EXPECT_EQ(r, CUDA_SUCCESS);
        }
        EXPECT_EQ(cu_.ctx_synchronize(), CUDA_SUCCESS);
        EXPECT_EQ(cu_.dtoh(back.data(), dst, back.size()), CUDA_SUCCESS);
        for (auto [first, last] : groups) {
            const uint64_t off = first * slice;
            const uint64_t bytes = (last - first + 1) * slice + (last < n - 1 ? std::min<uint64_t>(slice, 512) : 0);
            if (memcmp(back.data() + off, base_ + tensor.offset + off, bytes) != 0) {
                ADD_FAILURE() << "layer slot " << l << " tensor " << t << " experts " << first << ".." << last
                              << " (copy kind " << how << "): destination differs from the file";
                return -1;
            }
        }
        // Bytes no copy wrote are untouched.
        uint64_t pos = 0;
        for (auto [first, last] : groups) {
            const uint64_t off = first * slice;
            for (uint64_t i = pos; i < off; i += 4096)
                if (back[i] != 0xA5) {
                    ADD_FAILURE() << "a byte outside every copy changed at " << i;
                    return -1;
                }
            pos = (last + 1) * slice + (last < n - 1 ? std::min<uint64_t>(slice, 512) : 0);
        }
        return static_cast<int>(groups.size());
    }

    TempDir dir_;
    void* lib_ = nullptr;
    bool fake_ = false;
    GetProc get_proc_ = nullptr;
    Cu cu_{};
    void (*stats_get_)(moecache_cuda_stats*) = nullptr;
    int (*sync_)(int) = nullptr;
    std::vector<std::string> files_;
    ExpertMap map_;
    const uint8_t* base_ = nullptr;
    size_t size_ = 0;
};

TEST_F(HookDriver, EntryPointsComeFromTheHook) {
    EXPECT_NE(object_of(reinterpret_cast<void*>(get_proc_)).find("libmoecache-cuda"), std::string::npos)
        << "dlsym(libcuda, cuGetProcAddress_v2) gave " << object_of(reinterpret_cast<void*>(get_proc_));
    for (void* fn : {reinterpret_cast<void*>(cu_.htod_async), reinterpret_cast<void*>(cu_.htod_async_ptsz),
                     reinterpret_cast<void*>(cu_.htod), reinterpret_cast<void*>(cu_.memcpy_async),
                     reinterpret_cast<void*>(cu_.mem_alloc)})
        EXPECT_NE(object_of(fn).find("libmoecache-cuda"), std::string::npos) << object_of(fn);
    EXPECT_NE(cu_.htod_async, cu_.htod_async_ptsz) << "the per-thread-stream variant is a hook of its own";
    // Functions the hook does not interpose come from the driver itself.
    EXPECT_EQ(object_of(reinterpret_cast<void*>(cu_.dtoh)).find("libmoecache-cuda"), std::string::npos);
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
    ASSERT_GE(sync_(10000), 1) << "the hook did not find the mapped model";
    ASSERT_GE(copy_and_check(dst[0], 0, 0, {1, 2}, streams[0], 0), 1);
    ASSERT_GE(sync_(10000), 1);
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
                              reinterpret_cast<CUdeviceptr>(base_ + map_.layers[0].tensors[0].offset), h2h.size()),
              CUDA_SUCCESS);
    EXPECT_EQ(memcmp(h2h.data(), base_ + map_.layers[0].tensors[0].offset, h2h.size()), 0);
    cu_.mem_free(d);
}

TEST_F(HookDriver, StreamCapturePassesThrough) {
    auto* capturing = static_cast<int*>(dlsym(lib_, "fake_cuda_capturing"));
    if (capturing == nullptr) GTEST_SKIP() << "needs the fake driver's capture switch (the real one is covered by llama.cpp's graphs)";
    CUdeviceptr d = 0;
    const auto& t = map_.layers[0].tensors[0];
    ASSERT_EQ(cu_.mem_alloc(&d, t.bytes_per_expert * map_.n_experts + 512), CUDA_SUCCESS);
    ASSERT_GE(copy_and_check(d, 0, 0, {3}, nullptr, 0), 1);
    ASSERT_GE(sync_(10000), 1);
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
    auto* limit = static_cast<unsigned long long*>(dlsym(lib_, "fake_cuda_memory_limit"));
    if (limit == nullptr) GTEST_SKIP() << "needs the fake driver's memory limit (filling a real GPU takes too long for a test)";
    CUdeviceptr d = 0;
    const auto& t = map_.layers[0].tensors[0];
    ASSERT_EQ(cu_.mem_alloc(&d, t.bytes_per_expert * map_.n_experts + 512), CUDA_SUCCESS);
    ASSERT_GE(copy_and_check(d, 0, 0, {5}, nullptr, 0), 1);
    ASSERT_GE(sync_(10000), 1);  // the pool, then sized for the layer its next copy shows
    ASSERT_GE(copy_and_check(d, 0, 0, {5}, nullptr, 0), 1);
    ASSERT_GE(sync_(10000), 1);
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
