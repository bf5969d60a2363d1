#include "copy_kernel.h"

#include "capture_gate.h"

#include "moecache/cuda/copy_kernel_ptx.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

namespace moecache::cuda::hook {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kMaxBlocks = 264;  // two waves of an H200's SMs: the fastest measured for a slice

// The several-range form, launched once on scratch memory of the current context: three ranges of
// a patterned source into a zeroed destination, read back. true when exactly those bytes moved.
// Runs with no capture open (it allocates, synchronises and frees).
bool copies_verified(const Driver* drv, CUfunction fn_n) {
    if (drv->memcpy_dtoh == nullptr) return false;
    constexpr size_t kBytes = 64 << 10;
    // As many ranges as a launch takes (each row's parameters are loaded its own way), of sizes
    // and places of every kind.
    constexpr CopyRange kRanges[kCopyKernelNRanges] = {{0, 4096, 1600},     {8192, 0, 4096},     {32768, 16384, 16384},
                                                       {2048, 60000, 16},   {4096, 48000, 2048}, {16384, 40000, 8192},
                                                       {50000, 30000, 160}, {60000, 20000, 5520}};
    std::vector<uint8_t> src(kBytes), zero(kBytes, 0), back(kBytes, 0xFF), want(kBytes, 0);
    for (size_t i = 0; i < kBytes; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7 + (i >> 8));
    CUdeviceptr a = 0, b = 0;
    CUstream stream = nullptr;
    bool ok = drv->mem_alloc(&a, kBytes) == CUDA_SUCCESS && drv->mem_alloc(&b, kBytes) == CUDA_SUCCESS &&
              drv->stream_create(&stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS &&
              drv->memcpy_htod_async(a, src.data(), kBytes, stream) == CUDA_SUCCESS &&
              drv->memcpy_htod_async(b, zero.data(), kBytes, stream) == CUDA_SUCCESS;
    if (ok) {
        CopyRange ranges[std::size(kRanges)];
        for (size_t k = 0; k < std::size(kRanges); ++k) {
            ranges[k] = CopyRange{b + kRanges[k].dst, a + kRanges[k].src, kRanges[k].bytes};
            std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(kRanges[k].src), kRanges[k].bytes,
                        want.begin() + static_cast<std::ptrdiff_t>(kRanges[k].dst));
        }
        ok = launch_copies(drv, fn_n, ranges, std::size(kRanges), stream) == CUDA_SUCCESS &&
             drv->stream_synchronize(stream) == CUDA_SUCCESS &&
             drv->memcpy_dtoh(back.data(), b, kBytes) == CUDA_SUCCESS && back == want;
    }
    if (stream != nullptr) (void)drv->stream_destroy(stream);
    if (b != 0) (void)drv->mem_free(b);
    if (a != 0) (void)drv->mem_free(a);
    return ok;
}

}  // namespace

bool load_copy_kernel(const Driver* drv, CopyKernel* out, bool several) {
    if (drv->module_load_data == nullptr || drv->module_get_function == nullptr || drv->launch_kernel == nullptr) return false;
    CUmodule module = nullptr;
    // Loading a module may synchronise the context: never while a runtime captures a graph.
    CUresult loaded = CUDA_ERROR_UNKNOWN;
    capture_gate().exclusive([&] { loaded = drv->module_load_data(&module, kCopyKernelPtx); });
    if (loaded != CUDA_SUCCESS || module == nullptr) return false;
    CUfunction fn = nullptr;
    if (drv->module_get_function(&fn, module, kCopyKernelName) != CUDA_SUCCESS || fn == nullptr) {
        if (drv->module_unload != nullptr) (void)drv->module_unload(module);
        return false;
    }
    out->module = module;
    out->function = fn;
    CUfunction fn_n = nullptr;
    if (several && drv->module_get_function(&fn_n, module, kCopyKernelNName) == CUDA_SUCCESS && fn_n != nullptr) {
        bool verified = false;
        capture_gate().exclusive([&] { verified = copies_verified(drv, fn_n); });
        if (verified) out->function_n = fn_n;
    }
    return true;
}

CUresult launch_copy(const Driver* drv, CUfunction fn, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    if (((dst | src | bytes) & 15) != 0 || bytes == 0) return CUDA_ERROR_NOT_SUPPORTED;
    unsigned long long words = bytes / 16;
    const auto blocks = static_cast<unsigned>(std::min<unsigned long long>(kMaxBlocks, (words + kThreads - 1) / kThreads));
    void* args[] = {&dst, &src, &words};
    return drv->launch_kernel(fn, blocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr);
}

CUresult launch_copies(const Driver* drv, CUfunction fn_n, const CopyRange* ranges, unsigned n, CUstream stream) {
    if (n == 0 || n > kCopyKernelNRanges) return CUDA_ERROR_NOT_SUPPORTED;
    // Unused rows of the parameter list are empty ranges (the grid has no block for them).
    unsigned long long p[kCopyKernelNRanges][3] = {};
    unsigned long long most = 0;
    for (unsigned i = 0; i < n; ++i) {
        const CopyRange& r = ranges[i];
        if (((r.dst | r.src | r.bytes) & 15) != 0 || r.bytes == 0) return CUDA_ERROR_NOT_SUPPORTED;
        p[i][0] = r.dst;
        p[i][1] = r.src;
        p[i][2] = r.bytes / 16;
        most = std::max(most, p[i][2]);
    }
    void* args[kCopyKernelNRanges * 3];
    for (unsigned i = 0; i < kCopyKernelNRanges; ++i)
        for (unsigned j = 0; j < 3; ++j) args[i * 3 + j] = &p[i][j];
    // The ranges share two waves of the SMs, as many blocks as a copy of one range would take.
    const auto blocks = static_cast<unsigned>(std::max<unsigned long long>(
        1, std::min<unsigned long long>(std::max(1u, kMaxBlocks / n), (most + kThreads - 1) / kThreads)));
    return drv->launch_kernel(fn_n, blocks, n, 1, kThreads, 1, 1, 0, stream, args, nullptr);
}

}  // namespace moecache::cuda::hook
