// libmoecache-cuda.so under the CUDA runtime API, as llama.cpp calls it: cudaMemcpyAsync of grouped
// experts out of a shared read-only mapping of the model, on several streams (an explicit one, the
// legacy default stream, the per-thread stream) and with cudaMemcpy. Built twice: against the shared
// libcudart (the hook interposes cudaMemcpyAsync) and against cudart_static (the hook is reached
// through dlsym and cuGetProcAddress). Label gpu: it needs a real GPU and skips without one.
#include "model_fixture.h"
#include "preload_main.h"
#include "moecache/cuda_hook.h"
#include "moecache/model.h"
#include "temp_dir.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

namespace moecache::test {
namespace {

class HookRuntime : public ::testing::Test {
protected:
    void SetUp() override {
        stats_get_ = reinterpret_cast<decltype(stats_get_)>(dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get"));
        sync_ = reinterpret_cast<decltype(sync_)>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"));
        ASSERT_NE(stats_get_, nullptr) << "libmoecache-cuda.so is not preloaded";
        int devices = 0;
        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device here";
        ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
        auto spec = small_spec();
        spec.n_layers = 4;
        spec.n_experts = 64;
        spec.n_experts_used = 8;
        spec.n_ff_exp = 512;
        spec.n_embd = 512;
        files_ = write_model(spec, dir_.path() + "/rt.gguf");
        auto parts = open_gguf_model(files_[0]);
        ASSERT_TRUE(parts);
        auto map = ExpertMap::build(*parts);
        ASSERT_TRUE(map);
        map_ = std::move(*map);
        const int fd = open(files_[0].c_str(), O_RDONLY | O_CLOEXEC);
        size_ = static_cast<size_t>(lseek(fd, 0, SEEK_END));
        base_ = static_cast<const uint8_t*>(mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0));
        close(fd);
        ASSERT_NE(base_, MAP_FAILED);
    }
    void TearDown() override {
        if (base_ != nullptr && base_ != MAP_FAILED) munmap(const_cast<uint8_t*>(base_), size_);
    }
    moecache_cuda_stats stats() {
        moecache_cuda_stats s{};
        stats_get_(&s);
        return s;
    }

    TempDir dir_;
    void (*stats_get_)(moecache_cuda_stats*) = nullptr;
    int (*sync_)(int) = nullptr;
    std::vector<std::string> files_;
    ExpertMap map_;
    const uint8_t* base_ = nullptr;
    size_t size_ = 0;
};

TEST_F(HookRuntime, ThousandsOfExpertCopiesAreByteIdentical) {
    const uint32_t n = map_.n_experts;
    const size_t layers = map_.layers.size();
    std::vector<char*> dst(layers * 3, nullptr);
    for (size_t l = 0; l < layers; ++l)
        for (size_t t = 0; t < map_.layers[l].tensors.size(); ++t)
            ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dst[l * 3 + t]), map_.layers[l].tensors[t].bytes_per_expert * n + 512), cudaSuccess);
    cudaStream_t streams[3] = {nullptr, cudaStreamPerThread, nullptr};
    ASSERT_EQ(cudaStreamCreateWithFlags(&streams[0], cudaStreamNonBlocking), cudaSuccess);
    std::mt19937 rng(7);
    std::geometric_distribution<uint32_t> pick(0.06);
    std::vector<uint8_t> back, garbage;
    uint64_t copies = 0;
    auto round = [&](int it) {
        const uint32_t l = rng() % layers;
        std::vector<uint32_t> ids;
        while (ids.size() < map_.n_experts_used) ids.push_back(std::min(pick(rng), n - 1));
        if (it % 13 == 0) ids.push_back(n - 1);
        std::sort(ids.begin(), ids.end());
        ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
        std::vector<std::pair<uint32_t, uint32_t>> groups;
        for (uint32_t id : ids) {
            if (!groups.empty() && groups.back().second + 1 == id) groups.back().second = id;
            else groups.emplace_back(id, id);
        }
        cudaStream_t s = streams[it % 10 < 7 ? 0 : (it % 10 < 9 ? 1 : 2)];
        const bool sync_copy = it % 17 == 0;
        for (size_t t = 0; t < map_.layers[l].tensors.size(); ++t) {
            const auto& tn = map_.layers[l].tensors[t];
            const uint64_t slice = tn.bytes_per_expert, total = slice * n + 512;
            char* d = dst[l * 3 + t];
            garbage.assign(total, static_cast<uint8_t>(it));
            ASSERT_EQ(cudaMemcpyAsync(d, garbage.data(), total, cudaMemcpyHostToDevice, s), cudaSuccess);
            for (auto [first, last] : groups) {
                const uint64_t off = first * slice;
                const uint64_t bytes = (last - first + 1) * slice + (last < n - 1 ? 512 : 0);
                if (sync_copy) ASSERT_EQ(cudaMemcpy(d + off, base_ + tn.offset + off, bytes, cudaMemcpyHostToDevice), cudaSuccess);
                else ASSERT_EQ(cudaMemcpyAsync(d + off, base_ + tn.offset + off, bytes, cudaMemcpyDefault, s), cudaSuccess);
                ++copies;
            }
            back.resize(total);
            ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
            ASSERT_EQ(cudaMemcpy(back.data(), d, total, cudaMemcpyDeviceToHost), cudaSuccess);
            for (auto [first, last] : groups) {
                const uint64_t off = first * slice;
                const uint64_t bytes = (last - first + 1) * slice + (last < n - 1 ? 512 : 0);
                ASSERT_EQ(memcmp(back.data() + off, base_ + tn.offset + off, bytes), 0)
                    << "round " << it << " layer slot " << l << " tensor " << t << " experts " << first << ".." << last;
            }
        }
    };
    round(0);
    ASSERT_GE(sync_(20000), 1) << "the hook did not find the mapped model";
    for (int it = 1; it < 1500 && !HasFailure(); ++it) round(it);
    const auto s = stats();
    printf("expert copies %llu (test made %llu), served %llu, slices hit %llu / missed %llu, admitted %llu, evicted %llu, "
           "fallbacks %llu, pool %.1f MiB\n",
           static_cast<unsigned long long>(s.expert_copies), static_cast<unsigned long long>(copies),
           static_cast<unsigned long long>(s.served), static_cast<unsigned long long>(s.slice_hits),
           static_cast<unsigned long long>(s.slice_misses), static_cast<unsigned long long>(s.admitted),
           static_cast<unsigned long long>(s.evicted), static_cast<unsigned long long>(s.fallbacks),
           s.pool_bytes / 1048576.0);
    EXPECT_GT(s.slice_hits, 0u) << "nothing came from the pool";
    EXPECT_GT(s.expert_copies, copies / 2) << "the hook saw few of the expert copies";
    EXPECT_EQ(s.fallbacks, 0u);
    for (auto* d : dst) cudaFree(d);
}

}  // namespace
}  // namespace moecache::test

int main(int argc, char** argv) {
    return moecache::test::preloaded_test_main(argc, argv, {{"MOECACHE_CUDA_CLIENT", "off"}, {"MOECACHE_CUDA_POOL", "20%"}});
}
