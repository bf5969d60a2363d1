// The CUDA driver API as a runtime with cudart linked statically reaches it (dlopen libcuda.so.1,
// dlsym cuGetProcAddress_v2, entry points through it), for the hook's tests: over the real driver
// or tests' fake libcuda.so.1 (support/fake_cuda), with the fake's knobs where it is the fake. And
// llama.cpp's copy of a layer's routed experts: grouped by consecutive ids, read back and compared
// with the model file.
#pragma once

#include "moecache/cuda_hook.h"
#include "moecache/model.h"

#include <cuda.h>

#include <cstdint>
#include <string>
#include <vector>

#undef cuGetProcAddress

namespace moecache::test {

void* dlsym_knob(void* lib, const char* name);

struct CudaDriver {
    using GetProc = CUresult(CUDAAPI*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
    // Loads libcuda.so.1; "" when it is there and cuInit works, else why not (a reason to skip).
    std::string load();
    [[nodiscard]] bool fake() const { return fake_; }
    // The fake's exported knob `name` (nullptr on the real driver).
    template <class T>
    T* knob(const char* name) const;
    // Makes device `d`'s primary context current on this thread.
    bool use_device(int d);

    void* lib = nullptr;
    GetProc get_proc = nullptr;
    CUresult(CUDAAPI* init)(unsigned) = nullptr;
    CUresult(CUDAAPI* device_get)(CUdevice*, int) = nullptr;
    CUresult(CUDAAPI* device_count)(int*) = nullptr;
    CUresult(CUDAAPI* primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
    CUresult(CUDAAPI* ctx_set_current)(CUcontext) = nullptr;
    CUresult(CUDAAPI* stream_create)(CUstream*, unsigned) = nullptr;
    CUresult(CUDAAPI* stream_destroy)(CUstream) = nullptr;
    CUresult(CUDAAPI* stream_synchronize)(CUstream) = nullptr;
    CUresult(CUDAAPI* ctx_synchronize)() = nullptr;
    CUresult(CUDAAPI* mem_alloc)(CUdeviceptr*, size_t) = nullptr;
    CUresult(CUDAAPI* mem_free)(CUdeviceptr) = nullptr;
    CUresult(CUDAAPI* mem_get_info)(size_t*, size_t*) = nullptr;
    CUresult(CUDAAPI* htod)(CUdeviceptr, const void*, size_t) = nullptr;
    CUresult(CUDAAPI* htod_async)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
    CUresult(CUDAAPI* htod_async_ptsz)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
    CUresult(CUDAAPI* memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
    CUresult(CUDAAPI* memcpy_sync)(CUdeviceptr, CUdeviceptr, size_t) = nullptr;
    CUresult(CUDAAPI* dtoh)(void*, CUdeviceptr, size_t) = nullptr;
    CUresult(CUDAAPI* begin_capture)(CUstream, CUstreamCaptureMode) = nullptr;
    CUresult(CUDAAPI* end_capture)(CUstream, CUgraph*) = nullptr;

private:
    bool get(void*& fn, const char* name, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT);
    bool fake_ = false;
};

template <class T>
T* CudaDriver::knob(const char* name) const {
    return fake_ ? static_cast<T*>(dlsym_knob(lib, name)) : nullptr;
}

// What the hook exports for tests (dlsym on the process: absent means no hook).
struct HookProbe {
    bool load();  // false: the hook is not preloaded
    [[nodiscard]] moecache_cuda_stats stats() const;
    void (*stats_get)(moecache_cuda_stats*) = nullptr;
    int (*sync)(int) = nullptr;
    uint64_t (*pool_bytes)(int) = nullptr;
};

// The model file mapped as a runtime maps it, with its expert map.
struct MappedModel {
    std::string open(const std::string& path);  // "" or why not
    ~MappedModel();
    ExpertMap map;
    const uint8_t* base = nullptr;
    size_t size = 0;
};

// How a copy is issued: the driver's async copy on a stream, its per-thread-stream variant, the
// synchronous copy, or the unified cuMemcpyAsync.
enum class CopyKind { Async = 0, PerThread = 1, Sync = 2, Unified = 3 };

// Copies the chosen experts of tensor `t` of layer slot `l` to `dst` as llama.cpp groups them
// (consecutive ids in one copy, up to 512 bytes of padding after the last one), over a poisoned
// destination, then synchronises, reads it back and compares it with the file; bytes no copy wrote
// must be untouched. Returns the number of grouped copies, or -1 after a gtest failure.
int copy_and_check(CudaDriver& cu, const MappedModel& m, CUdeviceptr dst, uint32_t l, uint32_t t,
                   std::vector<uint32_t> ids, CUstream stream, CopyKind how = CopyKind::Async);
// The same copies without the check (for many copies quickly); false on a driver error.
bool copy_experts(CudaDriver& cu, const MappedModel& m, CUdeviceptr dst, uint32_t l, uint32_t t,
                  std::vector<uint32_t> ids, CUstream stream);

}  // namespace moecache::test
