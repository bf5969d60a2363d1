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
    return true;
}

CUresult launch_copy(const Driver* drv, CUfunction fn, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    if (((dst | src | bytes) & 15) != 0 || bytes == 0) return CUDA_ERROR_NOT_SUPPORTED;
    unsigned long long words = bytes / 16;
    const auto blocks = static_cast<unsigned>(std::min<unsigned long long>(kMaxBlocks, (words + kThreads - 1) / kThreads));
    void* args[] = {&dst, &src, &words};
    return drv->launch_kernel(fn, blocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr);
}

}  // namespace moecache::cuda::hook
