// A fake libcuda.so.1 for CI, which has no GPU: "device memory" is host memory, every stream runs
// its work at once, and a few knobs (an allocation limit, stream capture) let tests drive the hook
// through the paths a GPU would. It implements the driver functions the hook and its tests use,
// with the real ABI (signatures from cuda.h), and hands them out through cuGetProcAddress as the
// real driver does, per-thread-stream variants included.
#include <cuda.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#undef cuGetProcAddress

extern "C" {

struct fake_cuda_counters {
    unsigned long long htod_calls, htod_bytes, dtod_calls, dtod_bytes, allocs, frees, syncs;
};
__attribute__((visibility("default"))) fake_cuda_counters fake_cuda_counts;
__attribute__((visibility("default"))) int fake_cuda_capturing = 0;
__attribute__((visibility("default"))) unsigned long long fake_cuda_memory_limit = 8ull << 30;

}

namespace {

std::mutex mu;
std::map<CUdeviceptr, size_t> allocations;
size_t allocated = 0;
int ctx_token = 0;

bool is_device(CUdeviceptr p) {
    std::lock_guard lock(mu);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p < it->first + it->second;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default"))) CUresult CUDAAPI

API cuInit(unsigned int) { return CUDA_SUCCESS; }
API cuDriverGetVersion(int* v) { *v = CUDA_VERSION; return CUDA_SUCCESS; }
API cuDeviceGet(CUdevice* d, int ordinal) { if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE; *d = 0; return CUDA_SUCCESS; }
API cuDeviceGetCount(int* n) { *n = 1; return CUDA_SUCCESS; }
API cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) { *c = reinterpret_cast<CUcontext>(&ctx_token); return CUDA_SUCCESS; }
API cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
API cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
API cuCtxGetCurrent(CUcontext* c) { *c = reinterpret_cast<CUcontext>(&ctx_token); return CUDA_SUCCESS; }
API cuCtxGetDevice(CUdevice* d) { *d = 0; return CUDA_SUCCESS; }
API cuCtxPushCurrent_v2(CUcontext) { return CUDA_SUCCESS; }
API cuCtxPopCurrent_v2(CUcontext* c) { if (c) *c = reinterpret_cast<CUcontext>(&ctx_token); return CUDA_SUCCESS; }
API cuCtxSynchronize() { ++fake_cuda_counts.syncs; return CUDA_SUCCESS; }
API cuStreamCreate(CUstream* s, unsigned int) { *s = reinterpret_cast<CUstream>(new int(0)); return CUDA_SUCCESS; }
API cuStreamDestroy_v2(CUstream s) { delete reinterpret_cast<int*>(s); return CUDA_SUCCESS; }
API cuStreamSynchronize(CUstream) { ++fake_cuda_counts.syncs; return CUDA_SUCCESS; }
API cuStreamIsCapturing(CUstream, CUstreamCaptureStatus* st) {
    *st = fake_cuda_capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
API cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    std::lock_guard lock(mu);
    if (allocated + n > fake_cuda_memory_limit) return CUDA_ERROR_OUT_OF_MEMORY;
    void* m = malloc(n ? n : 1);
    if (m == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = reinterpret_cast<CUdeviceptr>(m);
    allocations[*p] = n;
    allocated += n;
    ++fake_cuda_counts.allocs;
    return CUDA_SUCCESS;
}
API cuMemFree_v2(CUdeviceptr p) {
    std::lock_guard lock(mu);
    auto it = allocations.find(p);
    if (it == allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    allocated -= it->second;
    allocations.erase(it);
    free(reinterpret_cast<void*>(p));
    ++fake_cuda_counts.frees;
    return CUDA_SUCCESS;
}
API cuMemGetInfo_v2(size_t* f, size_t* t) {
    std::lock_guard lock(mu);
    *t = fake_cuda_memory_limit;
    *f = fake_cuda_memory_limit - allocated;
    return CUDA_SUCCESS;
}
static CUresult htod(CUdeviceptr dst, const void* src, size_t n) {
    if (!is_device(dst) || !is_device(dst + n - 1)) return CUDA_ERROR_INVALID_VALUE;
    memcpy(reinterpret_cast<void*>(dst), src, n);
    ++fake_cuda_counts.htod_calls;
    fake_cuda_counts.htod_bytes += n;
    return CUDA_SUCCESS;
}
API cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { return htod(d, s, n); }
API cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void* s, size_t n) { return htod(d, s, n); }
API cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, CUstream) { return htod(d, s, n); }
API cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void* s, size_t n, CUstream) { return htod(d, s, n); }
API cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) {
    if (!is_device(d) || !is_device(s)) return CUDA_ERROR_INVALID_VALUE;
    memmove(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), n);
    ++fake_cuda_counts.dtod_calls;
    fake_cuda_counts.dtod_bytes += n;
    return CUDA_SUCCESS;
}
API cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) {
    if (!is_device(s)) return CUDA_ERROR_INVALID_VALUE;
    memcpy(d, reinterpret_cast<const void*>(s), n);
    return CUDA_SUCCESS;
}
static CUresult unified(CUdeviceptr d, CUdeviceptr s, size_t n) {
    if (is_device(d) && !is_device(s)) return htod(d, reinterpret_cast<const void*>(s), n);
    memmove(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), n);
    return CUDA_SUCCESS;
}
API cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return unified(d, s, n); }
API cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { return unified(d, s, n); }
API cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) { return unified(d, s, n); }
API cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) { return unified(d, s, n); }
API cuMemHostRegister_v2(void*, size_t, unsigned int) { return CUDA_SUCCESS; }
API cuMemHostUnregister(void*) { return CUDA_SUCCESS; }
API cuPointerGetAttributes(unsigned int n, CUpointer_attribute* attrs, void** data, CUdeviceptr p) {
    const bool dev = is_device(p);
    for (unsigned i = 0; i < n; ++i) {
        if (attrs[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
            *static_cast<CUmemorytype*>(data[i]) = dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        else if (attrs[i] == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
            *static_cast<int*>(data[i]) = dev ? 0 : -1;
        else
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

// The same functions under names no hook interposes, for benchmarks that compare a hooked call
// with the bare one.
extern "C" __attribute__((visibility("default"))) CUresult fake_bare_htod_async(CUdeviceptr d, const void* s, size_t n,
                                                                                 CUstream) {
    return htod(d, s, n);
}

namespace {

struct Entry {
    const char* name;
    bool ptds;
    void* fn;
};
#define E(n) {#n, false, reinterpret_cast<void*>(&n)}
#define V(n, f) {n, false, reinterpret_cast<void*>(&f)}
#define P(n, f) {n, true, reinterpret_cast<void*>(&f)}
CUresult CUDAAPI get_proc(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
CUresult CUDAAPI get_proc_v1(const char* s, void** p, int v, cuuint64_t f) { return get_proc(s, p, v, f, nullptr); }
const Entry table[] = {
    E(cuInit), E(cuDriverGetVersion), E(cuDeviceGet), E(cuDeviceGetCount), E(cuDevicePrimaryCtxRetain),
    V("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2), E(cuCtxSetCurrent), E(cuCtxGetCurrent),
    E(cuCtxGetDevice), V("cuCtxPushCurrent", cuCtxPushCurrent_v2), V("cuCtxPopCurrent", cuCtxPopCurrent_v2),
    E(cuCtxSynchronize), E(cuStreamCreate), V("cuStreamDestroy", cuStreamDestroy_v2), E(cuStreamSynchronize),
    E(cuStreamIsCapturing), V("cuMemAlloc", cuMemAlloc_v2), V("cuMemFree", cuMemFree_v2),
    V("cuMemGetInfo", cuMemGetInfo_v2), V("cuMemcpyHtoD", cuMemcpyHtoD_v2), P("cuMemcpyHtoD", cuMemcpyHtoD_v2_ptds),
    V("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2), P("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2_ptsz),
    V("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2), V("cuMemcpyDtoH", cuMemcpyDtoH_v2), E(cuMemcpy),
    P("cuMemcpy", cuMemcpy_ptds), E(cuMemcpyAsync), P("cuMemcpyAsync", cuMemcpyAsync_ptsz),
    V("cuMemHostRegister", cuMemHostRegister_v2), E(cuMemHostUnregister), E(cuPointerGetAttributes),
};

CUresult CUDAAPI get_proc(const char* symbol, void** pfn, int version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult* status) {
    if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        *pfn = version >= 12000 ? reinterpret_cast<void*>(&get_proc) : reinterpret_cast<void*>(&get_proc_v1);
        if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    const bool ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const Entry* any = nullptr;
    for (const auto& e : table) {
        if (strcmp(e.name, symbol) != 0) continue;
        if (e.ptds == ptds) {
            any = &e;
            break;
        }
        if (!e.ptds) any = &e;  // no per-thread variant: the plain one
    }
    if (any == nullptr) {
        *pfn = nullptr;
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = any->fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

}  // namespace

API cuGetProcAddress(const char* s, void** p, int v, cuuint64_t f) { return get_proc(s, p, v, f, nullptr); }
API cuGetProcAddress_v2(const char* s, void** p, int v, cuuint64_t f, CUdriverProcAddressQueryResult* st) {
    return get_proc(s, p, v, f, st);
}
