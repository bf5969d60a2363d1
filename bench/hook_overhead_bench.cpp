// What one intercepted call costs the host, measured over tests' fake libcuda.so.1 (whose "copies"
// are plain memcpy), so that only the hook's own work differs: the same copy through the hook's
// cuMemcpyHtoDAsync and through the fake's bare function. Run it with the hook preloaded and the
// fake driver first on the library path (bench/hook-overhead.sh does).
//
//   moecache-hook-overhead-bench MODEL.gguf
// Prints one JSON object: microseconds per call (median of 7 rounds) for a copy from memory that is
// no model's, an expert copy the pool does not serve (MOECACHE_CUDA_POOL=0: classified and
// reported), and an expert copy served from the pool (a pool hit: classified, planned, and copied
// device-to-device plus the padding from the host); each with its bare anchor.
#include "moecache/cuda_hook.h"
#include "moecache/model.h"

#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#undef cuGetProcAddress

namespace {

using Htod = CUresult (*)(CUdeviceptr, const void*, size_t, CUstream);

double median_us(Htod fn, CUdeviceptr dst, const uint8_t* src, size_t bytes, size_t stride, int calls) {
    std::vector<double> rounds;
    for (int r = 0; r < 7; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i)
            if (fn(dst, src + (i % 4) * stride, bytes, nullptr) != CUDA_SUCCESS) return -1;
        rounds.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls);
    }
    std::sort(rounds.begin(), rounds.end());
    return rounds[3];
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf (with libmoecache-cuda.so preloaded over the fake driver)\n", argv[0]);
        return 2;
    }
    void* lib = dlopen("libcuda.so.1", RTLD_NOW);
    auto bare = lib ? reinterpret_cast<Htod>(dlsym(lib, "fake_bare_htod_async")) : nullptr;
    auto get_proc = lib ? reinterpret_cast<CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*)>(
                              dlsym(lib, "cuGetProcAddress_v2"))
                        : nullptr;
    if (bare == nullptr || get_proc == nullptr || dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get") == nullptr) {
        fprintf(stderr, "needs tests' fake libcuda.so.1 on the library path and libmoecache-cuda.so preloaded\n");
        return 2;
    }
    void* p = nullptr;
    CUresult (*init)(unsigned) = nullptr;
    CUresult (*alloc)(CUdeviceptr*, size_t) = nullptr;
    get_proc("cuInit", &p, 12000, 0, nullptr);
    init = reinterpret_cast<decltype(init)>(p);
    get_proc("cuMemAlloc", &p, 12000, 0, nullptr);
    alloc = reinterpret_cast<decltype(alloc)>(p);
    get_proc("cuMemcpyHtoDAsync", &p, 12000, 0, nullptr);
    auto hooked = reinterpret_cast<Htod>(p);
    get_proc("cuDevicePrimaryCtxRetain", &p, 12000, 0, nullptr);
    auto retain = reinterpret_cast<CUresult (*)(CUcontext*, CUdevice)>(p);
    get_proc("cuCtxSetCurrent", &p, 12000, 0, nullptr);
    auto set_current = reinterpret_cast<CUresult (*)(CUcontext)>(p);
    CUcontext ctx = nullptr;
    // Copies need a current context, as on a real driver.
    if (init(0) != CUDA_SUCCESS || retain(&ctx, 0) != CUDA_SUCCESS || set_current(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "the driver gave no context\n");
        return 1;
    }

    auto parts = moecache::open_gguf_model(argv[1]);
    if (!parts) return 1;
    auto map = moecache::ExpertMap::build(*parts);
    if (!map || map->layers.empty()) return 1;
    const int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
    const size_t size = static_cast<size_t>(lseek(fd, 0, SEEK_END));
    auto* base = static_cast<const uint8_t*>(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
    const auto& t = map->layers[0].tensors[0];
    const uint64_t slice = t.bytes_per_expert;
    CUdeviceptr dst = 0;
    if (alloc(&dst, slice * map->n_experts + 512) != CUDA_SUCCESS) {
        fprintf(stderr, "cuMemAlloc failed\n");
        return 1;
    }
    std::vector<uint8_t> other(4 * slice + 512, 7);

    // Experts 0..3 of the first tensor, one at a time with llama.cpp's padding: the pool takes them
    // on their first copies.
    const uint8_t* experts = base + t.offset;
    const int calls = 100000;
    (void)hooked(dst, experts, slice + 512, nullptr);
    using Sync = int (*)(int);
    reinterpret_cast<Sync>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"))(10000);
    for (int e = 0; e < 4; ++e) (void)hooked(dst, experts + e * slice, slice + 512, nullptr);

    const double other_bare = median_us(bare, dst, other.data(), 64, 64, calls);
    const double other_hook = median_us(hooked, dst, other.data(), 64, 64, calls);
    const double expert_bare = median_us(bare, dst, experts, slice + 512, slice, calls);
    const double expert_hook = median_us(hooked, dst, experts, slice + 512, slice, calls);
    if (other_bare < 0 || other_hook < 0 || expert_bare < 0 || expert_hook < 0) {
        fprintf(stderr, "a copy failed\n");
        return 1;
    }
    moecache_cuda_stats s{};
    reinterpret_cast<void (*)(moecache_cuda_stats*)>(dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get"))(&s);
    printf("{\"slice_bytes\":%llu,\"other_bare_us\":%.4f,\"other_hook_us\":%.4f,\"other_added_us\":%.4f,"
           "\"expert_bare_us\":%.4f,\"expert_hook_us\":%.4f,\"expert_added_us\":%.4f,\"served\":%llu,\"slice_hits\":%llu}\n",
           static_cast<unsigned long long>(slice), other_bare, other_hook, other_hook - other_bare, expert_bare, expert_hook,
           expert_hook - expert_bare, static_cast<unsigned long long>(s.served), static_cast<unsigned long long>(s.slice_hits));
    return 0;
}
