// Replays llama.cpp's expert copies on a GPU, as its scheduler issues them when expert tensors stay
// in the host mapping (-ot exps=CPU) and every token's expert math runs on the GPU
// (GGML_OP_OFFLOAD_MIN_BATCH=1): per token and MoE layer, the host waits for the router's ids, then
// copies the picked experts of each expert tensor host-to-device with cudaMemcpyAsync, consecutive
// ids grouped, 512 bytes of padding after each group, then the layer's expert math reads them.
//
// Routing follows a preset's published skew (moecache-mkmodel's router model: bias -S ln(rank+1)^P
// plus N(0,1) noise, top-k). The expert math is stood in for by a device-to-device read of the
// experts used (decode GEMVs are bound by reading their weights once).
//
//   moecache-expert-copy-bench --model M.gguf [--mode replay|vram|overhead] [--tokens N] [--warmup N]
//                              [--preset NAME] [--seed N]
// replay: the copies above (run it with and without the hook); vram: every expert resident on the
// device, no copies (the ceiling); overhead: host time per cudaMemcpyAsync of 256 bytes that no hook
// serves. Prints one JSON object.
#include "moecache/cuda_hook.h"
#include "moecache/mkmodel/router_skew.h"
#include "moecache/model.h"

#include "cuda_bench.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace moecache;

namespace {

struct Router {
    std::vector<std::vector<double>> bias;  // [layer][expert]
    uint32_t k;
    std::mt19937_64 rng;
    std::normal_distribution<double> noise{0.0, 1.0};
    std::vector<uint32_t> route(uint32_t layer) {
        const auto& b = bias[layer];
        std::vector<std::pair<double, uint32_t>> logits(b.size());
        for (uint32_t e = 0; e < b.size(); ++e) logits[e] = {b[e] + noise(rng), e};
        std::nth_element(logits.begin(), logits.begin() + (k - 1), logits.end(),
                         [](const auto& x, const auto& y) { return x.first > y.first; });
        std::vector<uint32_t> ids(k);
        for (uint32_t i = 0; i < k; ++i) ids[i] = logits[i].second;
        std::sort(ids.begin(), ids.end());
        return ids;
    }
};

}  // namespace

int main(int argc, char** argv) {
    std::string model, mode = "replay", preset = "deepseek-v4-flash";
    int tokens = 64, warmup = 16;
    uint64_t seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string a = argv[i], v = argv[i + 1];
        if (a == "--model") model = v;
        else if (a == "--mode") mode = v;
        else if (a == "--tokens") tokens = std::stoi(v);
        else if (a == "--warmup") warmup = std::stoi(v);
        else if (a == "--preset") preset = v;
        else if (a == "--seed") seed = std::stoull(v);
        else {
            fprintf(stderr, "unknown option %s\n", a.c_str());
            return 2;
        }
    }
    if (model.empty()) {
        fprintf(stderr, "usage: %s --model M.gguf [--mode replay|vram|overhead] [--tokens N] [--warmup N] [--preset NAME]\n",
                argv[0]);
        return 2;
    }
    auto parts = open_gguf_model(model);
    if (!parts) {
        fprintf(stderr, "%s\n", parts.error().message.c_str());
        return 1;
    }
    auto built = ExpertMap::build(*parts);
    if (!built || built->layers.empty()) {
        fprintf(stderr, "%s: no expert map\n", model.c_str());
        return 1;
    }
    const ExpertMap& map = *built;
    const uint32_t n = map.n_experts, k = map.n_experts_used;
    const int fd = open(model.c_str(), O_RDONLY | O_CLOEXEC);
    const size_t size = static_cast<size_t>(lseek(fd, 0, SEEK_END));
    // As llama.cpp maps a model: shared, read-only.
    auto* base = static_cast<const uint8_t*>(mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
    if (base == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    cudaStream_t stream;
    CHECK(cudaSetDevice(0));
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    if (mode == "overhead") {
        void* host = nullptr;
        void* dev = nullptr;
        CHECK(cudaMallocHost(&host, 1 << 20));
        CHECK(cudaMalloc(&dev, 1 << 20));
        const int calls = 200000;
        std::vector<double> per_call;
        for (int rep = 0; rep < 7; ++rep) {
            CHECK(cudaStreamSynchronize(stream));
            const double t0 = now();
            for (int i = 0; i < calls; ++i)
                CHECK(cudaMemcpyAsync(static_cast<char*>(dev) + (i % 4096) * 256, static_cast<char*>(host) + (i % 4096) * 256,
                                      256, cudaMemcpyHostToDevice, stream));
            const double issue = now() - t0;
            CHECK(cudaStreamSynchronize(stream));
            per_call.push_back(issue / calls * 1e6);
        }
        std::sort(per_call.begin(), per_call.end());
        printf("{\"mode\":\"overhead\",\"calls\":%d,\"issue_us_per_call_median\":%.4f,\"min\":%.4f,\"max\":%.4f}\n", calls,
               per_call[per_call.size() / 2], per_call.front(), per_call.back());
        return 0;
    }

    // The router: per layer a random popularity ranking, biases fitted to the preset.
    const auto* p = mkmodel::find_preset(preset);
    if (p == nullptr) {
        fprintf(stderr, "unknown preset %s\n", preset.c_str());
        return 2;
    }
    const auto skew = mkmodel::fit_skew(*p, n, k);
    Router router{{}, k, std::mt19937_64(seed)};
    std::mt19937_64 perm_rng(seed * 7919 + 1);
    for (size_t l = 0; l < map.layers.size(); ++l) {
        std::vector<uint32_t> rank(n);
        std::iota(rank.begin(), rank.end(), 0u);
        std::shuffle(rank.begin(), rank.end(), perm_rng);
        std::vector<double> b(n);
        for (uint32_t e = 0; e < n; ++e) b[e] = -skew.scale * std::pow(std::log(rank[e] + 1.0), skew.shape);
        router.bias.push_back(std::move(b));
    }

    // Device buffers: one per expert tensor of a layer, reused by every layer (the scheduler's copy
    // of the input), or in vram mode every expert tensor resident.
    size_t max_tensors = 0, max_tensor_bytes = 0;
    uint64_t expert_bytes = 0;
    for (const auto& l : map.layers) {
        max_tensors = std::max(max_tensors, l.tensors.size());
        for (const auto& t : l.tensors) {
            max_tensor_bytes = std::max<size_t>(max_tensor_bytes, t.bytes_per_expert * n + 512);
            expert_bytes += t.bytes_per_expert * n;
        }
    }
    const bool resident = mode == "vram";
    std::vector<std::vector<char*>> dbuf(map.layers.size(), std::vector<char*>(max_tensors, nullptr));
    if (resident) {
        for (size_t l = 0; l < map.layers.size(); ++l)
            for (size_t t = 0; t < map.layers[l].tensors.size(); ++t) {
                const auto& tn = map.layers[l].tensors[t];
                CHECK(cudaMalloc(reinterpret_cast<void**>(&dbuf[l][t]), tn.bytes_per_expert * n));
                CHECK(cudaMemcpy(dbuf[l][t], base + tn.offset, tn.bytes_per_expert * n, cudaMemcpyHostToDevice));
            }
    } else {
        std::vector<char*> shared(max_tensors);
        for (auto& s : shared) CHECK(cudaMalloc(reinterpret_cast<void**>(&s), max_tensor_bytes));
        for (auto& l : dbuf) l = shared;
    }
    char* scratch = nullptr;
    CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch), max_tensor_bytes));

    uint64_t copied = 0, calls = 0;
    auto token = [&] {
        for (size_t l = 0; l < map.layers.size(); ++l) {
            CHECK(cudaStreamSynchronize(stream));  // the router's ids come back to the host
            const auto ids = router.route(static_cast<uint32_t>(l));
            std::vector<std::pair<uint32_t, uint32_t>> groups;
            for (uint32_t id : ids) {
                if (!groups.empty() && groups.back().second + 1 == id) groups.back().second = id;
                else groups.emplace_back(id, id);
            }
            for (size_t t = 0; t < map.layers[l].tensors.size(); ++t) {
                const auto& tn = map.layers[l].tensors[t];
                const uint64_t slice = tn.bytes_per_expert;
                for (auto [first, last] : groups) {
                    const uint64_t off = first * slice, bytes = (last - first + 1) * slice;
                    if (!resident) {
                        const uint64_t pad = last < n - 1 ? std::min<uint64_t>(slice, 512) : 0;
                        CHECK(cudaMemcpyAsync(dbuf[l][t] + off, base + tn.offset + off, bytes + pad,
                                              cudaMemcpyHostToDevice, stream));
                        copied += bytes + pad;
                        ++calls;
                    }
                    // The expert math: read the experts once.
                    CHECK(cudaMemcpyAsync(scratch + off, dbuf[l][t] + off, bytes, cudaMemcpyDeviceToDevice, stream));
                }
            }
        }
    };
    for (int i = 0; i < warmup; ++i) token();
    CHECK(cudaStreamSynchronize(stream));
    using SyncFn = int (*)(int);
    if (auto sync = reinterpret_cast<SyncFn>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"))) sync(60000);
    // The warm-up again, now that the hook has its pool (it had none during the first turns).
    for (int i = 0; i < warmup; ++i) token();
    CHECK(cudaStreamSynchronize(stream));
    copied = calls = 0;
    moecache_cuda_stats before{}, after{};
    using StatsFn = void (*)(moecache_cuda_stats*);
    auto stats = reinterpret_cast<StatsFn>(dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get"));
    if (stats) stats(&before);
    const double t0 = now();
    for (int i = 0; i < tokens; ++i) token();
    CHECK(cudaStreamSynchronize(stream));
    const double secs = now() - t0;
    if (stats) stats(&after);
    printf("{\"mode\":\"%s\",\"preset\":\"%s\",\"layers\":%zu,\"experts\":%u,\"used\":%u,\"expert_gib\":%.2f,"
           "\"tokens\":%d,\"seconds\":%.3f,\"tok_s\":%.2f,\"h2d_gib_per_token\":%.4f,\"copies_per_token\":%.1f",
           mode.c_str(), preset.c_str(), map.layers.size(), n, k, expert_bytes / 1073741824.0, tokens, secs, tokens / secs,
           copied / 1073741824.0 / tokens, static_cast<double>(calls) / tokens);
    if (stats) {
        const double hits = static_cast<double>(after.slice_hits - before.slice_hits);
        const double all = hits + static_cast<double>(after.slice_misses - before.slice_misses);
        printf(",\"hook\":{\"pool_gib\":%.2f,\"pool_share\":%.3f,\"hit_rate\":%.4f,\"from_pool_gib_per_token\":%.4f,"
               "\"from_host_gib_per_token\":%.4f,\"admitted\":%llu,\"evicted\":%llu,\"pinned_gib\":%.2f,\"served\":%llu}",
               after.pool_bytes / 1073741824.0, static_cast<double>(after.pool_bytes) / static_cast<double>(expert_bytes),
               all > 0 ? hits / all : 0.0, (after.bytes_from_pool - before.bytes_from_pool) / 1073741824.0 / tokens,
               (after.bytes_from_host - before.bytes_from_host) / 1073741824.0 / tokens,
               static_cast<unsigned long long>(after.admitted - before.admitted),
               static_cast<unsigned long long>(after.evicted - before.evicted), after.pinned_bytes / 1073741824.0,
               static_cast<unsigned long long>(after.served - before.served));
    }
    printf("}\n");
    return 0;
}
