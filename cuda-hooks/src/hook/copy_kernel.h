// Pool hits copied by a kernel of the hook's own instead of the driver's device-to-device copy.
// On an H200 the driver takes ~4 us of the calling thread to queue a device-to-device copy of a
// slice whose size is a multiple of 4 KiB and ~7 us for one that is not (a slice and llama.cpp's
// 512 bytes of padding), against ~3.3 us to launch a kernel that copies 16-byte words
// (bench/copy_cost_bench.cpp). A decoding runtime makes hundreds of such copies a token, each on
// its critical path: the thread that queues them is the one that launches the model's kernels.
#pragma once

#include "driver.h"
#include "moecache/cuda/copy_kernel_ptx.h"

#include <cstdint>

namespace moecache::cuda::hook {

// The kernel of one context: loaded from PTX (the driver compiles it for the device once).
struct CopyKernel {
    CUmodule module = nullptr;
    CUfunction function = nullptr;
    CUfunction function_n = nullptr;  // several ranges a launch (null: a driver that lacks it)
};

// Loads the kernel into the current context. false when the driver cannot (no module functions,
// a PTX JIT that refuses it); copies then stay the driver's. With `several`, the several-range
// form too, kept only where a launch of it on scratch memory copied exactly its ranges
// (function_n null otherwise).
bool load_copy_kernel(const Driver* drv, CopyKernel* out, bool several);

// Queues a copy of `bytes` from `src` to `dst` (device memory of the current context) on `stream`
// with the kernel; CUDA_ERROR_NOT_SUPPORTED when the addresses or the size are not multiples of
// 16 bytes (the caller copies the driver's way).
CUresult launch_copy(const Driver* drv, CUfunction fn, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);

// One range of a launch of several.
struct CopyRange {
    CUdeviceptr dst = 0, src = 0;
    uint64_t bytes = 0;
};
// Queues up to kCopyKernelNRanges copies with one launch of the kernel's several-range form
// (`fn_n`); the same refusal as launch_copy where any range is not of 16-byte multiples.
CUresult launch_copies(const Driver* drv, CUfunction fn_n, const CopyRange* ranges, unsigned n, CUstream stream);

}  // namespace moecache::cuda::hook
