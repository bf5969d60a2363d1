// How a miss should reach the GPU when the model is larger than RAM: the measurement behind
// MOECACHE_CUDA_PIN=auto (bench/pin-modes.sh). Decode-shaped copies (groups of 1 to 8 consecutive
// expert slices of random expert tensors, as llama.cpp's scheduler issues them) host-to-device,
// and what each way of making their source DMA-able costs:
//   pageable   the copies as the runtime asks (run it under the hook with MOECACHE_CUDA_PIN=staging
//              and MOECACHE_CUDA_POOL=0: the hook's pinned staging)
//   experts    the page-aligned inside of each slice of a set of experts registered for DMA on its
//              own, as a tier that follows the daemon's lock and unlock directives would: the
//              registration and unregistration time per expert, and copies split at the
//              registrations' edges (pageable heads and tails, pinned middles)
//   all        every expert byte registered at once (MOECACHE_CUDA_PIN=all: only where RAM holds
//              the model)
//   moecache-pin-bench --model M.gguf --mode pageable|experts|all [--copies N] [--experts N]
// Prints one JSON object.
#include "moecache/model.h"

#include "cuda_bench.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace moecache;

namespace {

struct Copy {
    uint64_t offset, bytes;  // in the file
    uint32_t layer, tensor, first, n;
};

}  // namespace

int main(int argc, char** argv) {
    std::string model, mode = "pageable";
    int copies = 3000;
    uint32_t registered_experts = 512;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
        if (a == "--model") model = next();
        else if (a == "--mode") mode = next();
        else if (a == "--copies") copies = std::atoi(next().c_str());
        else if (a == "--experts") registered_experts = static_cast<uint32_t>(std::atoi(next().c_str()));
        else {
            fprintf(stderr, "usage: moecache-pin-bench --model M.gguf --mode pageable|experts|all [--copies N] [--experts N]\n");
            return 2;
        }
    }
    auto map = load_expert_map(model);
    if (!map) {
        fprintf(stderr, "%s\n", map.error().what().c_str());
        return 1;
    }
    if (map->files.size() != 1) {
        fprintf(stderr, "one file, please\n");
        return 1;
    }
    const int fd = open(model.c_str(), O_RDONLY | O_CLOEXEC);
    const size_t size = static_cast<size_t>(lseek(fd, 0, SEEK_END));
    auto* base = static_cast<uint8_t*>(mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0));
    if (base == MAP_FAILED) return 1;
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint32_t n_exp = map->n_experts;
    std::mt19937_64 rng(1);

    // Which experts are "locked" (registered in mode experts): the copies come from them alone, so
    // that every mode copies the same bytes.
    std::vector<std::pair<uint32_t, uint32_t>> chosen;  // (layer slot, first expert of a run of 8)
    const uint32_t runs = std::max<uint32_t>(1, registered_experts / 8);
    for (uint32_t i = 0; i < runs; ++i)
        chosen.emplace_back(static_cast<uint32_t>(rng() % map->layers.size()), static_cast<uint32_t>(rng() % (n_exp / 8)) * 8);
    std::sort(chosen.begin(), chosen.end());
    chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    std::vector<Copy> work;
    for (int c = 0; c < copies; ++c) {
        const auto [ls, first] = chosen[rng() % chosen.size()];
        const uint32_t t = static_cast<uint32_t>(rng() % map->layers[ls].tensors.size());
        const uint32_t n = 1 + static_cast<uint32_t>(rng() % 8), start = first + static_cast<uint32_t>(rng() % (9 - n)) % 8;
        const uint32_t nn = std::min(n, first + 8 - start);
        const auto& tensor = map->layers[ls].tensors[t];
        work.push_back({tensor.offset + start * tensor.bytes_per_expert, nn * tensor.bytes_per_expert, ls, t, start, nn});
    }
    uint64_t total = 0;
    for (const auto& w : work) total += w.bytes;

    CHECK(cudaSetDevice(0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    uint64_t biggest = 0;
    for (const auto& w : work) biggest = std::max(biggest, w.bytes);
    void* dst = nullptr;
    CHECK(cudaMalloc(&dst, biggest + page));

    double reg_s = 0, unreg_s = 0;
    uint64_t reg_bytes = 0, reg_calls = 0;
    std::vector<std::pair<uint64_t, uint64_t>> regions;  // registered [begin, end) file offsets, sorted
    auto reg = [&](uint64_t lo, uint64_t hi) {
        const double t0 = now();
        const cudaError_t e = cudaHostRegister(base + lo, hi - lo, cudaHostRegisterReadOnly | cudaHostRegisterPortable);
        reg_s += now() - t0;
        if (e != cudaSuccess) {
            fprintf(stderr, "cudaHostRegister(%llu bytes): %s\n", static_cast<unsigned long long>(hi - lo), cudaGetErrorString(e));
            exit(1);
        }
        reg_bytes += hi - lo;
        ++reg_calls;
        regions.emplace_back(lo, hi);
    };
    if (mode == "all") {
        uint64_t lo = UINT64_MAX, hi = 0;
        for (const auto& l : map->layers)
            for (const auto& t : l.tensors) {
                lo = std::min(lo, t.offset);
                hi = std::max(hi, t.offset + t.bytes_per_expert * n_exp);
            }
        reg(lo & ~(page - 1), std::min<uint64_t>((hi + page - 1) & ~(page - 1), size));
    } else if (mode == "experts") {
        for (const auto& [ls, first] : chosen)
            for (uint32_t e = first; e < first + 8; ++e)
                for (const auto& r : map->ranges(map->layers[ls].index, e)) {
                    const uint64_t lo = (r.offset + page - 1) & ~(page - 1), hi = (r.offset + r.length) & ~(page - 1);
                    if (hi > lo) reg(lo, hi);
                }
        std::sort(regions.begin(), regions.end());
    } else if (mode != "pageable") {
        fprintf(stderr, "unknown mode %s\n", mode.c_str());
        return 2;
    }
    // The pieces of each copy: split at registrations' edges in mode experts.
    std::vector<std::pair<uint64_t, uint64_t>> pieces;  // file offset, bytes
    uint64_t pinned_bytes = 0;
    for (const auto& w : work) {
        if (mode != "experts") {
            pieces.emplace_back(w.offset, w.bytes);
            continue;
        }
        uint64_t at = w.offset;
        const uint64_t end = w.offset + w.bytes;
        auto it = std::upper_bound(regions.begin(), regions.end(), std::make_pair(at, UINT64_MAX));
        if (it != regions.begin()) --it;
        for (; at < end;) {
            while (it != regions.end() && it->second <= at) ++it;
            if (it == regions.end() || it->first >= end) {
                pieces.emplace_back(at, end - at);
                break;
            }
            if (it->first > at) {
                pieces.emplace_back(at, it->first - at);
                at = it->first;
            }
            const uint64_t hi = std::min(end, it->second);
            pieces.emplace_back(at, hi - at);
            pinned_bytes += hi - at;
            at = hi;
        }
    }
    auto run = [&] {
        uint64_t pos = 0, copy_start = 0;
        size_t wi = 0;
        (void)copy_start;
        for (const auto& [off, bytes] : pieces) {
            // Pieces of one copy land side by side from the copy's start; the destination only needs room.
            if (wi < work.size() && off == work[wi].offset) {
                pos = 0;
                ++wi;
            }
            CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + pos, base + off, bytes, cudaMemcpyHostToDevice, s));
            pos += bytes;
        }
        CHECK(cudaStreamSynchronize(s));
    };
    run();  // warm: the pages in this process
    // Under the hook: its pool and staging buffers are made in the background; wait for them.
    if (auto sync = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"))) {
        (void)sync(10000);
        run();
        (void)sync(10000);
    }
    double best = 1e9;
    for (int r = 0; r < 3; ++r) {
        const double t0 = now();
        run();
        best = std::min(best, now() - t0);
    }
    if (mode == "experts") {
        for (const auto& [lo, hi] : regions) {
            const double t0 = now();
            CHECK(cudaHostUnregister(base + lo));
            unreg_s += now() - t0;
        }
    }
    printf("{\"mode\":\"%s\",\"copies\":%zu,\"pieces\":%zu,\"gib\":%.3f,\"gb_s\":%.2f,\"us_per_copy\":%.1f,"
           "\"pinned_share\":%.3f,\"registrations\":%llu,\"registered_gib\":%.3f,\"register_s\":%.3f,"
           "\"register_us_per_call\":%.1f,\"register_s_per_gib\":%.3f,\"unregister_us_per_call\":%.1f}\n",
           mode.c_str(), work.size(), pieces.size(), static_cast<double>(total) / 1073741824.0,
           static_cast<double>(total) / best / 1e9, best / static_cast<double>(work.size()) * 1e6,
           static_cast<double>(pinned_bytes) / static_cast<double>(total), static_cast<unsigned long long>(reg_calls),
           static_cast<double>(reg_bytes) / 1073741824.0, reg_s, reg_calls ? reg_s / static_cast<double>(reg_calls) * 1e6 : 0.0,
           reg_bytes ? reg_s / (static_cast<double>(reg_bytes) / 1073741824.0) : 0.0,
           reg_calls ? unreg_s / static_cast<double>(reg_calls) * 1e6 : 0.0);
    return 0;
}
