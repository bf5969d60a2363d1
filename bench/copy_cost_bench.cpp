// What one expert copy costs on this GPU, the host's time to queue it and the device's to run it:
// device-to-device out of pool slots (as a pool hit is served), host-to-device from registered and
// pageable memory (a miss), by size and by the slots' spacing; and a decode layer's pattern (hits
// and misses queued on one stream, then a synchronisation, as llama.cpp reads the router's choice
// back before the next layer).
//
//   moecache-copy-cost-bench [SLICE_BYTES] [ROUNDS]
// Prints one line per case: microseconds per copy to queue (host) and to complete (wall, after a
// synchronisation), the median of ROUNDS (5) rounds.
#include "cuda_bench.h"
#include "moecache/cuda/copy_kernel_ptx.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kSlots = 256;

template <class Fn>
Fn entry(const char* name) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
    if (fn == nullptr) {
        fprintf(stderr, "no driver entry point %s\n", name);
        exit(1);
    }
    return reinterpret_cast<Fn>(fn);
}

struct Result {
    double queue_us, wall_us;
};

// `copy(i)` queues the i-th copy; `batch` copies are queued, then the stream is synchronised.
template <class Copy>
Result measure(cudaStream_t s, int n, int batch, int rounds, Copy copy) {
    std::vector<double> queue, wall;
    for (int r = 0; r < rounds; ++r) {
        CHECK(cudaStreamSynchronize(s));
        double queued = 0;
        const double t0 = now();
        for (int i = 0; i < n;) {
            const double q0 = now();
            for (int k = 0; k < batch && i < n; ++k, ++i) copy(i);
            queued += now() - q0;
            CHECK(cudaStreamSynchronize(s));
        }
        wall.push_back((now() - t0) * 1e6 / n);
        queue.push_back(queued * 1e6 / n);
    }
    std::sort(queue.begin(), queue.end());
    std::sort(wall.begin(), wall.end());
    return {queue[queue.size() / 2], wall[wall.size() / 2]};
}

void print(const std::string& what, Result r) { printf("%-58s queue %7.2f us  wall %7.2f us\n", what.c_str(), r.queue_us, r.wall_us); }

}  // namespace

int main(int argc, char** argv) {
    const uint64_t slice = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1671168;  // q8_0, 2048 x 768
    const int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (slice < 4096 || rounds < 1) {
        fprintf(stderr, "usage: %s [SLICE_BYTES >= 4096] [ROUNDS >= 1]\n", argv[0]);
        return 2;
    }
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const uint64_t tail = 512, stride = slice + tail;
    void* pool = nullptr;
    void* dst = nullptr;
    CHECK(cudaMalloc(&pool, stride * kSlots + 4096));
    CHECK(cudaMalloc(&dst, slice * 8 + 4096));
    std::vector<uint8_t> pageable(slice * kSlots / 4 + 4096, 1);
    void* pinned = nullptr;
    CHECK(cudaHostAlloc(&pinned, slice * kSlots / 4 + 4096, cudaHostAllocDefault));
    memset(pinned, 2, slice * kSlots / 4 + 4096);
    auto* p = static_cast<uint8_t*>(pool);
    auto* d = static_cast<uint8_t*>(dst);
    auto* h = static_cast<uint8_t*>(pinned);
    const int n = 2048, host_slices = kSlots / 4;
    auto dd = [&](uint64_t spacing, uint64_t bytes) {
        return [=](int i) { CHECK(cudaMemcpyAsync(d + (i % 8) * slice, p + (i % kSlots) * spacing, bytes, cudaMemcpyDeviceToDevice, s)); };
    };
    auto hd = [&](const uint8_t* src, uint64_t bytes) {
        return [=](int i) { CHECK(cudaMemcpyAsync(d + (i % 8) * slice, src + (i % host_slices) * slice, bytes, cudaMemcpyHostToDevice, s)); };
    };
    printf("slice %llu bytes; %d copies a round; median of %d rounds\n", static_cast<unsigned long long>(slice), n, rounds);
    for (int batch : {24, n}) {
        const std::string b = batch == n ? " (no sync)" : " (sync every 24)";
        print("d2d slice, slots spaced by the slice" + b, measure(s, n, batch, rounds, dd(slice, slice)));
        print("d2d slice, slots spaced by slice+512" + b, measure(s, n, batch, rounds, dd(stride, slice)));
        print("d2d slice+512, slots spaced by slice+512" + b, measure(s, n, batch, rounds, dd(stride, slice + tail)));
        print("d2d 512 bytes" + b, measure(s, n, batch, rounds, dd(stride, tail)));
        print("h2d slice, pinned" + b, measure(s, n, batch, rounds, hd(h, slice)));
        print("h2d slice+512, pinned" + b, measure(s, n, batch, rounds, hd(h, slice + tail)));
        print("h2d 512 bytes, pageable" + b, measure(s, n, batch, rounds, hd(pageable.data(), tail)));
    }
    // Other ways to queue a device-to-device copy of a slot.
    for (unsigned flags : {0u, 1u}) {
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = flags;  // 1: cudaMemcpyFlagPreferOverlapWithCompute (a copy engine)
        for (size_t count : {size_t{1}, size_t{2}}) {
            auto batch = [&, attr, count](int i) mutable {
                void* dsts[2] = {d + (i % 8) * slice, d + (i % 8) * slice + slice};
                const void* srcs[2] = {p + (i % kSlots) * stride, p + ((i + 1) % kSlots) * stride};
                size_t sizes[2] = {slice, tail};
                size_t idx = 0;
                CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &idx, 1, s));
            };
            print("d2d batch of " + std::to_string(count) + (count == 2 ? " (slice, 512)" : " (slice)") +
                      (flags ? ", prefer overlap" : ""),
                  measure(s, n, 24, rounds, batch));
        }
    }
    print("d2d slice+4096, slots spaced by slice+4096", measure(s, n / 2, 24, rounds, [&](int i) {
              CHECK(cudaMemcpyAsync(d + (i % 4) * slice, p + (i % (kSlots / 2)) * (slice + 4096), slice + 4096,
                                    cudaMemcpyDeviceToDevice, s));
          }));
    print("d2d slice+512 as a peer copy", measure(s, n, 24, rounds, [&](int i) {
              CHECK(cudaMemcpyPeerAsync(d + (i % 8) * slice, 0, p + (i % kSlots) * stride, 0, slice + tail, s));
          }));
    print("d2d slice+512 as a 2D copy of one row", measure(s, n, 24, rounds, [&](int i) {
              CHECK(cudaMemcpy2DAsync(d + (i % 8) * slice, slice + tail, p + (i % kSlots) * stride, slice + tail, slice + tail, 1,
                                      cudaMemcpyDeviceToDevice, s));
          }));
    // The hook's copy kernel (copy_kernel_ptx.h), launched through the driver.
    {
        auto load = entry<CUresult (*)(CUmodule*, const void*)>("cuModuleLoadData");
        auto get = entry<CUresult (*)(CUfunction*, CUmodule, const char*)>("cuModuleGetFunction");
        auto launch = entry<CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                         CUstream, void**, void**)>("cuLaunchKernel");
        CHECK(cudaFree(nullptr));
        CUmodule mod = nullptr;
        CUfunction fn = nullptr;
        const double t0 = now();
        if (load(&mod, moecache::cuda::kCopyKernelPtx) != CUDA_SUCCESS || get(&fn, mod, moecache::cuda::kCopyKernelName) != CUDA_SUCCESS) {
            fprintf(stderr, "the copy kernel did not load\n");
            return 1;
        }
        printf("copy kernel loaded (JIT) in %.1f ms\n", (now() - t0) * 1e3);
        for (unsigned grid : {64u, 132u, 264u}) {
            print("kernel copy slice+512, grid " + std::to_string(grid) + "x256", measure(s, n, 24, rounds, [&](int i) {
                      CUdeviceptr dd_ = reinterpret_cast<CUdeviceptr>(d + (i % 8) * slice);
                      CUdeviceptr ss_ = reinterpret_cast<CUdeviceptr>(p + (i % kSlots) * stride);
                      unsigned long long words = (slice + tail) / 16;
                      void* args[] = {&dd_, &ss_, &words};
                      if (launch(fn, grid, 1, 1, 256, 1, 1, 0, reinterpret_cast<CUstream>(s), args, nullptr) != CUDA_SUCCESS) {
                          fprintf(stderr, "launch failed\n");
                          exit(1);
                      }
                  }));
        }
        // Its bytes are the slot's.
        std::vector<uint8_t> a(slice + tail), b(slice + tail);
        CHECK(cudaMemcpy(p + 5 * stride, h, slice + tail, cudaMemcpyHostToDevice));
        CUdeviceptr dd_ = reinterpret_cast<CUdeviceptr>(d), ss_ = reinterpret_cast<CUdeviceptr>(p + 5 * stride);
        unsigned long long words = (slice + tail) / 16;
        void* args[] = {&dd_, &ss_, &words};
        if (launch(fn, 132, 1, 1, 256, 1, 1, 0, reinterpret_cast<CUstream>(s), args, nullptr) != CUDA_SUCCESS) return 1;
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpy(b.data(), d, slice + tail, cudaMemcpyDeviceToHost));
        printf("kernel copy byte-identical: %s\n", memcmp(b.data(), h, slice + tail) == 0 ? "yes" : "NO");
        auto layer = [&](int misses) {
            return [&, misses](int i) {
                if (i % 24 < misses) {
                    CHECK(cudaMemcpyAsync(d + (i % 8) * slice, h + (i % host_slices) * slice, slice + tail, cudaMemcpyHostToDevice, s));
                    return;
                }
                CUdeviceptr dd2 = reinterpret_cast<CUdeviceptr>(d + (i % 8) * slice);
                CUdeviceptr ss2 = reinterpret_cast<CUdeviceptr>(p + (i % kSlots) * stride);
                unsigned long long w2 = (slice + tail) / 16;
                void* a2[] = {&dd2, &ss2, &w2};
                if (launch(fn, 132, 1, 1, 256, 1, 1, 0, reinterpret_cast<CUstream>(s), a2, nullptr) != CUDA_SUCCESS) exit(1);
            };
        };
        for (int misses : {0, 8})
            print("layer of 24, " + std::to_string(misses) + " misses, hits by kernel (per copy)", measure(s, n - n % 24, 24, rounds, layer(misses)));
        // With a second GPU: each miss split in two, one half over this GPU's link, the other
        // over the second GPU's into a relay buffer there and on over NVLink (peer access), the
        // two links at once.
        int count = 0;
        CHECK(cudaGetDeviceCount(&count));
        if (count >= 2) {
            int can = 0;
            CHECK(cudaDeviceCanAccessPeer(&can, 0, 1));
            if (can) {
                (void)cudaDeviceEnablePeerAccess(1, 0);
                CHECK(cudaSetDevice(1));
                (void)cudaDeviceEnablePeerAccess(0, 0);
                constexpr int kRing = 8;
                void* ring = nullptr;
                cudaStream_t relay;
                cudaEvent_t ready[kRing], done[kRing];
                CHECK(cudaMalloc(&ring, slice * kRing));
                CHECK(cudaStreamCreateWithFlags(&relay, cudaStreamNonBlocking));
                for (auto& e : ready) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                CHECK(cudaSetDevice(0));
                for (auto& e : done) {
                    CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                    CHECK(cudaEventRecord(e, s));
                }
                auto* rb = static_cast<uint8_t*>(ring);
                for (double share : {0.5, 0.4}) {
                    int next = 0;
                    const uint64_t own = (static_cast<uint64_t>(slice * (1 - share)) + 4095) & ~uint64_t{4095};
                    const uint64_t far = slice + tail - own;
                    auto relayed = [&, own, far](int i) {
                        if (i % 24 >= 8) {  // a hit, by the kernel
                            CUdeviceptr dd2 = reinterpret_cast<CUdeviceptr>(d + (i % 8) * slice);
                            CUdeviceptr ss2 = reinterpret_cast<CUdeviceptr>(p + (i % kSlots) * stride);
                            unsigned long long w2 = (slice + tail) / 16;
                            void* a2[] = {&dd2, &ss2, &w2};
                            if (launch(fn, 132, 1, 1, 256, 1, 1, 0, reinterpret_cast<CUstream>(s), a2, nullptr) != CUDA_SUCCESS) exit(1);
                            return;
                        }
                        const uint8_t* src = h + (i % host_slices) * slice;
                        uint8_t* to = d + (i % 8) * slice;
                        const int r = next++ % kRing;
                        CHECK(cudaSetDevice(1));
                        CHECK(cudaStreamWaitEvent(relay, done[r], 0));
                        CHECK(cudaMemcpyAsync(rb + r * slice, src + own, far, cudaMemcpyHostToDevice, relay));
                        CHECK(cudaEventRecord(ready[r], relay));
                        CHECK(cudaSetDevice(0));
                        CHECK(cudaMemcpyAsync(to, src, own, cudaMemcpyHostToDevice, s));
                        CHECK(cudaStreamWaitEvent(s, ready[r], 0));
                        CUdeviceptr dd2 = reinterpret_cast<CUdeviceptr>(to + own), ss2 = reinterpret_cast<CUdeviceptr>(rb + r * slice);
                        unsigned long long w2 = far / 16;
                        void* a2[] = {&dd2, &ss2, &w2};
                        if (launch(fn, 132, 1, 1, 256, 1, 1, 0, reinterpret_cast<CUstream>(s), a2, nullptr) != CUDA_SUCCESS) exit(1);
                        CHECK(cudaEventRecord(done[r], s));
                    };
                    print("layer of 24, 8 misses relayed " + std::to_string(static_cast<int>(share * 100)) + "% via GPU 1",
                          measure(s, n - n % 24, 24, rounds, relayed));
                    // The bytes of a relayed miss are the host's.
                    CHECK(cudaMemsetAsync(d, 0, slice + tail, s));
                    next = 0;
                    relayed(0);
                    CHECK(cudaStreamSynchronize(s));
                    std::vector<uint8_t> back(slice + tail);
                    CHECK(cudaMemcpy(back.data(), d, slice + tail, cudaMemcpyDeviceToHost));
                    printf("relayed miss byte-identical: %s\n", memcmp(back.data(), h, slice + tail) == 0 ? "yes" : "NO");
                }
            }
        }
    }
    // A decode layer: 24 copies, `misses` of them from pinned memory, the rest from pool slots.
    for (int misses : {0, 8, 24}) {
        auto layer = [&](int i) {
            if (i % 24 < misses) CHECK(cudaMemcpyAsync(d + (i % 8) * slice, h + (i % host_slices) * slice, slice + tail, cudaMemcpyHostToDevice, s));
            else CHECK(cudaMemcpyAsync(d + (i % 8) * slice, p + (i % kSlots) * stride, slice + tail, cudaMemcpyDeviceToDevice, s));
        };
        print("layer of 24 copies, " + std::to_string(misses) + " misses (per copy)", measure(s, n - n % 24, 24, rounds, layer));
    }
    return 0;
}
