#include "copy_kernel.h"

#include "capture_gate.h"

#include "moecache/cuda/copy_kernel_ptx.h"

#include <algorithm>
#include <cstdint>

namespace moecache::cuda::hook {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kMaxBlocks = 264;  // two waves of an H200's SMs: the fastest measured for a slice

}  // namespace

bool load_copy_kernel(const Driver* drv, CopyKernel* out) {
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
    if (drv->module_get_function(&fn_n, module, kCopyKernelNName) == CUDA_SUCCESS) out->function_n = fn_n;
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
    // Each range gets as many blocks as a copy of its own would, up to two waves of the SMs in all.
    const auto blocks = static_cast<unsigned>(std::max<unsigned long long>(
        1, std::min<unsigned long long>(kMaxBlocks / n + 1, (most + kThreads - 1) / kThreads)));
    return drv->launch_kernel(fn_n, blocks, n, 1, kThreads, 1, 1, 0, stream, args, nullptr);
}

}  // namespace moecache::cuda::hook
