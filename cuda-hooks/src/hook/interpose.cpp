// The interposed entry points. Every function of hook_list.h is exported under its own name (so
// a runtime that links libcudart or libcuda dynamically binds to it), handed out by cuGetProcAddress
// (so a runtime with cudart linked statically, which asks the driver for its entry points, gets it
// too) and by dlsym on libcuda's handle (how cudart finds cuGetProcAddress in the first place).
//
// Rules for every handler: no exception crosses it; CUDA's own error codes come back; anything not
// recognised, any nested call (the runtime calling the driver inside a hooked call), and anything
// during stream capture goes to the real function untouched.
#include "capture_gate.h"
#include "cuda_api.h"
#include "driver.h"
#include "engine.h"
#include "hook_list.h"
#include "registrations.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstring>

#define MOECACHE_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
__attribute__((visibility("hidden"))) void* (*moecache_real_dlsym)(void*, const char*) = nullptr;
__attribute__((visibility("hidden"))) void moecache_resolve_dlsym();
__attribute__((visibility("hidden"))) void* moecache_dlsym_hook(void* handle, const char* symbol);
}

namespace moecache::cuda::hook {

void* real_dlsym(void* handle, const char* symbol) {
    if (moecache_real_dlsym == nullptr) moecache_resolve_dlsym();
    return moecache_real_dlsym(handle, symbol);
}

namespace {

thread_local __attribute__((tls_model("initial-exec"))) int t_depth = 0;

// Marks a hooked call on this thread; only the outermost one acts.
struct Nest {
    Nest() { ++t_depth; }
    ~Nest() { --t_depth; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;
    [[nodiscard]] static bool outer() { return t_depth == 1; }
};

#define X(name, params, args) std::atomic<cudaError_t(CUDARTAPI*) params> real_##name{nullptr};
MOECACHE_CUDART_HOOKS(X)
#undef X
#define X(name, proc, since, ptds, params, args) std::atomic<CUresult(CUDAAPI*) params> real_##name{nullptr};
MOECACHE_CU_HOOKS(X)
#undef X
std::atomic<CUresult(CUDAAPI*)(const char*, void**, int, cuuint64_t)> real_get_proc_v1{nullptr};
std::atomic<CUresult(CUDAAPI*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*)> real_get_proc_v2{
    nullptr};
std::atomic<cudaError_t(CUDARTAPI*)()> real_get_last_error{nullptr};

// A loaded libcudart that the global scope does not show (a plugin dlopen'ed it RTLD_LOCAL).
int find_cudart(dl_phdr_info* info, size_t, void* out) {
    if (info->dlpi_name != nullptr && strstr(info->dlpi_name, "libcudart.so") != nullptr) {
        *static_cast<void**>(out) = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
        return *static_cast<void**>(out) != nullptr;
    }
    return 0;
}

void* lookup_runtime(const char* name) {
    if (void* p = real_dlsym(RTLD_NEXT, name)) return p;
    void* lib = nullptr;
    dl_iterate_phdr(find_cudart, &lib);
    return lib != nullptr ? real_dlsym(lib, name) : nullptr;
}

void* lookup_driver(const char* name) {
    if (void* p = real_dlsym(RTLD_NEXT, name)) return p;
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    return lib != nullptr ? real_dlsym(lib, name) : nullptr;
}

template <class F>
F resolve(std::atomic<F>& slot, const char* name, bool runtime) {
    F f = slot.load(std::memory_order_acquire);
    if (f == nullptr) {
        f = reinterpret_cast<F>(runtime ? lookup_runtime(name) : lookup_driver(name));
        F expected = nullptr;
        if (f != nullptr && !slot.compare_exchange_strong(expected, f)) f = expected;
    }
    return f;
}

template <class F>
void remember(std::atomic<F>& slot, void* real) {
    F expected = nullptr;
    slot.compare_exchange_strong(expected, reinterpret_cast<F>(real));
}

#define REAL_RT(name) resolve(real_##name, #name, true)
#define REAL_CU(name) resolve(real_##name, #name, false)
#define MISSING_RT cudaErrorSharedObjectSymbolNotFound
#define MISSING_CU CUDA_ERROR_NOT_FOUND

// The engine's part of a hooked call, which never lets an exception (out of memory in a first
// call's set-up, say) reach the runtime: on one, the call passes through.
bool serve(const HostToDeviceCopy& c, CUresult* r) noexcept {
    try {
        Engine* e = Engine::get();
        if (e == nullptr) return false;
        e->count_copy();
        return e->serve(c, r);
    } catch (...) {
        return false;
    }
}

// A small device-to-host copy: perhaps a runtime reading its router's choices back (engine.h).
void readback(void* dst, size_t n) noexcept {
    if (Engine* e = Engine::peek()) e->note_readback(dst, n);
}

bool yield_memory(size_t bytes) noexcept {
    try {
        Engine* e = Engine::peek();
        return e != nullptr && e->yield_memory(bytes);
    } catch (...) {
        return false;
    }
}

void stream_destroyed(CUstream s) noexcept {
    try {
        if (Engine* e = Engine::peek()) e->on_stream_destroy(s);
    } catch (...) {
    }
}

// A free-memory query's answer as the runtime sees it (Engine::reported_free). The engine is
// made here if no hooked call made it yet: a runtime sizes itself from free memory before it copies.
size_t reported_free(size_t driver_free) noexcept {
    try {
        Engine* e = Engine::get();
        return e != nullptr ? e->reported_free(driver_free) : driver_free;
    } catch (...) {
        return driver_free;
    }
}

// Every host-to-device copy: served through the pool where it is an expert copy, else issued as
// the runtime asked, in pieces cut at the edges of what the hook registered for DMA
// (registrations.h): the driver refuses a copy that starts in registered memory and ends outside
// it, and the hook's registrations share pages with tensors the runtime copies (while it loads,
// the tensors next to a run of expert tensors). The copy holds the registrations' grace from before
// it reads them until the driver has its pieces, so that no registration lands in between.
// `real(dst, src, n)` is the runtime's function for a part of the copy.
template <class Call>
cudaError_t runtime_copy(Call real, void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s, bool async,
                         bool per_thread) {
    Nest nest;
    if (!Nest::outer()) return real(dst, src, n);
    if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDefault) {
        const cudaError_t r = real(dst, src, n);
        if (r == cudaSuccess && kind == cudaMemcpyDeviceToHost) readback(dst, n);
        return r;
    }
    CopyGrace::Reader copying(registrations().grace());
    const HostToDeviceCopy c{reinterpret_cast<CUdeviceptr>(dst), src, n, reinterpret_cast<CUstream>(s), async,
                             per_thread, kind == cudaMemcpyHostToDevice};
    CUresult served = CUDA_SUCCESS;
    if (serve(c, &served) && served == CUDA_SUCCESS) return cudaSuccess;
    cudaError_t r = cudaSuccess;
    (void)registrations().in_pieces(src, n, [&](size_t off, size_t bytes) {
        r = real(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, bytes);
        return r == cudaSuccess ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
    });
    return r;
}

template <class Call>
CUresult driver_copy(Call real, CUdeviceptr dst, const void* src, size_t n, CUstream s, bool async, bool per_thread,
                     bool dst_is_device) {
    Nest nest;
    if (!Nest::outer()) return real(dst, src, n);
    CopyGrace::Reader copying(registrations().grace());
    const HostToDeviceCopy c{dst, src, n, s, async, per_thread, dst_is_device};
    CUresult r = CUDA_SUCCESS;
    if (serve(c, &r)) return r;
    return registrations().in_pieces(src, n, [&](size_t off, size_t bytes) {
        return real(dst + off, static_cast<const char*>(src) + off, bytes);
    });
}

// A 2D copy whose source rows cross an edge of a registration goes row by row, each cut as above;
// any other passes through as it is (llama.cpp sends no experts this way).
template <class Row>
bool rows_in_pieces(const void* src, size_t spitch, size_t w, size_t h, Row&& row) {
    if (src == nullptr || h == 0 || w == 0 || !registrations().would_cut(src, spitch * (h - 1) + w)) return false;
    for (size_t y = 0; y < h; ++y) {
        const char* line = static_cast<const char*>(src) + y * spitch;
        if (registrations().in_pieces(line, w, [&](size_t off, size_t bytes) { return row(y, off, bytes); }) != CUDA_SUCCESS)
            break;
    }
    return true;
}

// --- handlers ---------------------------------------------------------------------------------

#define RT_COPY(name, async, ptds, ...)                                                                     \
    auto real = REAL_RT(name);                                                                              \
    if (real == nullptr) return MISSING_RT;                                                                 \
    return runtime_copy([&](void* d, const void* sp, size_t k) { return real(d, sp, k, kind __VA_ARGS__); }, dst, src, n, \
                        kind, s, async, ptds)

cudaError_t on_cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    cudaStream_t s = nullptr;
    RT_COPY(cudaMemcpy, false, false);
}
cudaError_t on_cudaMemcpy_ptds(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
    cudaStream_t s = nullptr;
    RT_COPY(cudaMemcpy_ptds, false, true);
}
cudaError_t on_cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
    RT_COPY(cudaMemcpyAsync, true, false, , s);
}
cudaError_t on_cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
    RT_COPY(cudaMemcpyAsync_ptsz, true, true, , s);
}

#define PASS_RT(name, call_args)                 \
    Nest nest;                                   \
    auto real = REAL_RT(name);                   \
    return real == nullptr ? MISSING_RT : real call_args

// 2D copies from the host: as they are, or row by row where a registration's edge crosses them.
#define RT_COPY_2D(name, ...)                                                                                    \
    Nest nest;                                                                                                   \
    auto real = REAL_RT(name);                                                                                   \
    if (real == nullptr) return MISSING_RT;                                                                      \
    if (Nest::outer() && (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDefault)) {                        \
        CopyGrace::Reader copying(registrations().grace());                                                      \
        cudaError_t r = cudaSuccess;                                                                             \
        if (rows_in_pieces(src, spitch, w, h, [&](size_t y, size_t off, size_t bytes) {                          \
                r = real(static_cast<char*>(dst) + y * dpitch + off, dpitch,                                     \
                         static_cast<const char*>(src) + y * spitch + off, spitch, bytes, 1, kind __VA_ARGS__);  \
                return r == cudaSuccess ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;                                     \
            }))                                                                                                  \
            return r;                                                                                            \
        return real(dst, dpitch, src, spitch, w, h, kind __VA_ARGS__);                                           \
    }                                                                                                            \
    return real(dst, dpitch, src, spitch, w, h, kind __VA_ARGS__)

cudaError_t on_cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h,
                            cudaMemcpyKind kind) {
    RT_COPY_2D(cudaMemcpy2D);
}
cudaError_t on_cudaMemcpy2D_ptds(void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h,
                                 cudaMemcpyKind kind) {
    RT_COPY_2D(cudaMemcpy2D_ptds);
}
cudaError_t on_cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h,
                                 cudaMemcpyKind kind, cudaStream_t s) {
    RT_COPY_2D(cudaMemcpy2DAsync, , s);
}
cudaError_t on_cudaMemcpy2DAsync_ptsz(void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h,
                                      cudaMemcpyKind kind, cudaStream_t s) {
    RT_COPY_2D(cudaMemcpy2DAsync_ptsz, , s);
}

// The pool yields: an allocation that fails for want of memory gets the pool's memory and a retry.
cudaError_t on_cudaMalloc(void** p, size_t n) {
    Nest nest;
    auto real = REAL_RT(cudaMalloc);
    if (real == nullptr) return MISSING_RT;
    cudaError_t r = real(p, n);
    if (r == cudaErrorMemoryAllocation && Nest::outer() && yield_memory(n)) {
        if (auto gle = resolve(real_get_last_error, "cudaGetLastError", true)) (void)gle();
        r = real(p, n);
    }
    return r;
}
cudaError_t on_cudaFree(void* p) { PASS_RT(cudaFree, (p)); }
// ... and is not counted as used: what the pool holds is free to the runtime.
cudaError_t on_cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    Nest nest;
    auto real = REAL_RT(cudaMemGetInfo);
    if (real == nullptr) return MISSING_RT;
    const cudaError_t r = real(free_bytes, total_bytes);
    if (r == cudaSuccess && Nest::outer() && free_bytes != nullptr) *free_bytes = reported_free(*free_bytes);
    return r;
}

// A stream the pool's slots remember is about to go: its work stays ordered for whoever comes next.
cudaError_t on_cudaStreamDestroy(cudaStream_t s) {
    Nest nest;
    auto real = REAL_RT(cudaStreamDestroy);
    if (real == nullptr) return MISSING_RT;
    if (Nest::outer()) stream_destroyed(reinterpret_cast<CUstream>(s));
    return real(s);
}

#define CU_COPY(name, async, ptds, dst_is_device, src_expr, ...)                                            \
    auto real = REAL_CU(name);                                                                              \
    if (real == nullptr) return MISSING_CU;                                                                 \
    return driver_copy([&](CUdeviceptr d, const void* sp, size_t k) { return real(d, sp, k __VA_ARGS__); }, dst, src_expr, n, \
                       stream, async, ptds, dst_is_device)

CUresult on_cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    CUstream stream = nullptr;
    CU_COPY(cuMemcpyHtoD_v2, false, false, true, src);
}
CUresult on_cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void* src, size_t n) {
    CUstream stream = nullptr;
    CU_COPY(cuMemcpyHtoD_v2_ptds, false, true, true, src);
}
CUresult on_cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
    CU_COPY(cuMemcpyHtoDAsync_v2, true, false, true, src, , stream);
}
CUresult on_cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
    CU_COPY(cuMemcpyHtoDAsync_v2_ptsz, true, true, true, src, , stream);
}
#define CU_READBACK(name, call_args)                              \
    Nest nest;                                                    \
    auto real = REAL_CU(name);                                    \
    if (real == nullptr) return MISSING_CU;                       \
    const CUresult r = real call_args;                            \
    if (r == CUDA_SUCCESS && Nest::outer()) readback(dst, n);     \
    return r
CUresult on_cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) { CU_READBACK(cuMemcpyDtoH_v2, (dst, src, n)); }
CUresult on_cuMemcpyDtoH_v2_ptds(void* dst, CUdeviceptr src, size_t n) { CU_READBACK(cuMemcpyDtoH_v2_ptds, (dst, src, n)); }
CUresult on_cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    CU_READBACK(cuMemcpyDtoHAsync_v2, (dst, src, n, s));
}
CUresult on_cuMemcpyDtoHAsync_v2_ptsz(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    CU_READBACK(cuMemcpyDtoHAsync_v2_ptsz, (dst, src, n, s));
}
// Unified copies: the source may be host memory (a copy to the device the hook sees as any other).
#define CU_UNIFIED(name, async, ptds, ...)                                                                  \
    auto real = REAL_CU(name);                                                                              \
    if (real == nullptr) return MISSING_CU;                                                                 \
    return driver_copy(                                                                                     \
        [&](CUdeviceptr d, const void* sp, size_t k) { return real(d, reinterpret_cast<CUdeviceptr>(sp), k __VA_ARGS__); }, \
        dst, reinterpret_cast<const void*>(src), n, stream, async, ptds, false)
CUresult on_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    CUstream stream = nullptr;
    CU_UNIFIED(cuMemcpy, false, false);
}
CUresult on_cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    CUstream stream = nullptr;
    CU_UNIFIED(cuMemcpy_ptds, false, true);
}
CUresult on_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    CU_UNIFIED(cuMemcpyAsync, true, false, , stream);
}
CUresult on_cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    CU_UNIFIED(cuMemcpyAsync_ptsz, true, true, , stream);
}

#define PASS_CU(name, call_args)                 \
    Nest nest;                                   \
    auto real = REAL_CU(name);                   \
    return real == nullptr ? MISSING_CU : real call_args

// A 2D copy from host memory whose rows cross a registration's edge: row by row, each cut.
template <class Call>
CUresult driver_copy_2d(Call real, const CUDA_MEMCPY2D* c) {
    Nest nest;
    if (!Nest::outer() || c == nullptr) return real(c);
    const void* src = c->srcMemoryType == CU_MEMORYTYPE_HOST      ? c->srcHost
                      : c->srcMemoryType == CU_MEMORYTYPE_UNIFIED ? reinterpret_cast<const void*>(c->srcDevice)
                                                                  : nullptr;
    if (src == nullptr) return real(c);
    CopyGrace::Reader copying(registrations().grace());
    const char* first = static_cast<const char*>(src) + c->srcY * c->srcPitch + c->srcXInBytes;
    CUresult r = CUDA_SUCCESS;
    if (rows_in_pieces(first, c->srcPitch, c->WidthInBytes, c->Height, [&](size_t y, size_t off, size_t bytes) {
            CUDA_MEMCPY2D part = *c;
            part.srcY += y;
            part.dstY += y;
            part.srcXInBytes += off;
            part.dstXInBytes += off;
            part.WidthInBytes = bytes;
            part.Height = 1;
            r = real(&part);
            return r;
        }))
        return r;
    return real(c);
}
#define CU_COPY_2D(name, ...)                   \
    auto real = REAL_CU(name);                   \
    if (real == nullptr) return MISSING_CU;      \
    return driver_copy_2d([&](const CUDA_MEMCPY2D* p) { return real(p __VA_ARGS__); }, c)
CUresult on_cuMemcpy2D_v2(const CUDA_MEMCPY2D* c) { CU_COPY_2D(cuMemcpy2D_v2); }
CUresult on_cuMemcpy2D_v2_ptds(const CUDA_MEMCPY2D* c) { CU_COPY_2D(cuMemcpy2D_v2_ptds); }
CUresult on_cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* c, CUstream s) { CU_COPY_2D(cuMemcpy2DAsync_v2, , s); }
CUresult on_cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D* c, CUstream s) { CU_COPY_2D(cuMemcpy2DAsync_v2_ptsz, , s); }

CUresult on_cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    Nest nest;
    auto real = REAL_CU(cuMemAlloc_v2);
    if (real == nullptr) return MISSING_CU;
    CUresult r = real(p, n);
    if (r == CUDA_ERROR_OUT_OF_MEMORY && Nest::outer() && yield_memory(n)) r = real(p, n);
    return r;
}
CUresult on_cuMemFree_v2(CUdeviceptr p) { PASS_CU(cuMemFree_v2, (p)); }
// Captures: the hook's background thread never synchronises while one is open (capture_gate.h).
template <class Call>
CUresult begin_capture(Call real) {
    capture_gate().begin();
    const CUresult r = real();
    if (r != CUDA_SUCCESS) capture_gate().end();
    return r;
}
template <class Call>
CUresult end_capture(Call real) {
    const CUresult r = real();
    capture_gate().end();
    return r;
}
#define CU_CAPTURE(how, name, call_args)             \
    Nest nest;                                       \
    auto real = REAL_CU(name);                       \
    if (real == nullptr) return MISSING_CU;          \
    return how([&] { return real call_args; })
CUresult on_cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) {
    CU_CAPTURE(begin_capture, cuStreamBeginCapture_v2, (s, mode));
}
CUresult on_cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) {
    CU_CAPTURE(begin_capture, cuStreamBeginCapture_v2_ptsz, (s, mode));
}
CUresult on_cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode* deps, const CUgraphEdgeData* edges,
                                        size_t n, CUstreamCaptureMode mode) {
    CU_CAPTURE(begin_capture, cuStreamBeginCaptureToGraph, (s, g, deps, edges, n, mode));
}
CUresult on_cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode* deps,
                                             const CUgraphEdgeData* edges, size_t n, CUstreamCaptureMode mode) {
    CU_CAPTURE(begin_capture, cuStreamBeginCaptureToGraph_ptsz, (s, g, deps, edges, n, mode));
}
CUresult on_cuStreamEndCapture(CUstream s, CUgraph* g) { CU_CAPTURE(end_capture, cuStreamEndCapture, (s, g)); }
CUresult on_cuStreamEndCapture_ptsz(CUstream s, CUgraph* g) { CU_CAPTURE(end_capture, cuStreamEndCapture_ptsz, (s, g)); }

CUresult on_cuStreamDestroy_v2(CUstream s) {
    Nest nest;
    auto real = REAL_CU(cuStreamDestroy_v2);
    if (real == nullptr) return MISSING_CU;
    if (Nest::outer()) stream_destroyed(s);
    return real(s);
}
CUresult on_cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
    Nest nest;
    auto real = REAL_CU(cuMemGetInfo_v2);
    if (real == nullptr) return MISSING_CU;
    const CUresult r = real(free_bytes, total_bytes);
    if (r == CUDA_SUCCESS && Nest::outer() && free_bytes != nullptr) *free_bytes = reported_free(*free_bytes);
    return r;
}

}  // namespace
}  // namespace moecache::cuda::hook

// --- the exported entry points -------------------------------------------------------------------

#define X(name, params, args) \
    MOECACHE_EXPORT cudaError_t CUDARTAPI name params { return moecache::cuda::hook::on_##name args; }
MOECACHE_CUDART_HOOKS(X)
#undef X
#define X(name, proc, since, ptds, params, args) \
    MOECACHE_EXPORT CUresult CUDAAPI name params { return moecache::cuda::hook::on_##name args; }
MOECACHE_CU_HOOKS(X)
#undef X

namespace moecache::cuda::hook {
namespace {

// The newest CUDA whose driver ABI for the hooked functions this code knows. A runtime that asks
// for a newer one may be given a new signature: it gets the driver's own function.
constexpr int kNewestKnownCuda = 13999;

// Our own entry point for what the driver hands out as `symbol`, or `real` itself.
void* redirect_proc(const char* symbol, void* real, int version, cuuint64_t flags) {
    if (version > kNewestKnownCuda) return real;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        if (version >= 12000) {
            remember(real_get_proc_v2, real);
            return reinterpret_cast<void*>(&::cuGetProcAddress_v2);
        }
        remember(real_get_proc_v1, real);
        return reinterpret_cast<void*>(&::cuGetProcAddress);
    }
    const bool ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
#define X(name, proc, since, per_thread, params, args)                                 \
    if (version >= (since) && (per_thread) == ptds && strcmp(symbol, proc) == 0) {        \
        if (real != reinterpret_cast<void*>(&::name)) remember(real_##name, real);      \
        return reinterpret_cast<void*>(&::name);                                     \
    }
    MOECACHE_CU_HOOKS(X)
#undef X
    return real;
}

// The same for a symbol looked up by its exported name.
void* redirect_export(const char* symbol, void* real) {
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        if (real != reinterpret_cast<void*>(&::cuGetProcAddress)) remember(real_get_proc_v1, real);
        return reinterpret_cast<void*>(&::cuGetProcAddress);
    }
    if (strcmp(symbol, "cuGetProcAddress_v2") == 0) {
        if (real != reinterpret_cast<void*>(&::cuGetProcAddress_v2)) remember(real_get_proc_v2, real);
        return reinterpret_cast<void*>(&::cuGetProcAddress_v2);
    }
#define X(name, proc, since, per_thread, params, args)                         \
    if (strcmp(symbol, #name) == 0) {                                        \
        if (real != reinterpret_cast<void*>(&::name)) remember(real_##name, real); \
        return reinterpret_cast<void*>(&::name);                             \
    }
    MOECACHE_CU_HOOKS(X)
#undef X
    return real;
}

}  // namespace
}  // namespace moecache::cuda::hook

MOECACHE_EXPORT CUresult CUDAAPI cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags) {
    using namespace moecache::cuda::hook;
    auto real = resolve(real_get_proc_v1, "cuGetProcAddress", false);
    if (real == nullptr) return CUDA_ERROR_NOT_FOUND;
    const CUresult r = real(symbol, pfn, version, flags);
    if (r == CUDA_SUCCESS && symbol != nullptr && pfn != nullptr && *pfn != nullptr)
        *pfn = redirect_proc(symbol, *pfn, version, flags);
    return r;
}

MOECACHE_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                                     CUdriverProcAddressQueryResult* status) {
    using namespace moecache::cuda::hook;
    auto real = resolve(real_get_proc_v2, "cuGetProcAddress_v2", false);
    if (real == nullptr) return CUDA_ERROR_NOT_FOUND;
    const CUresult r = real(symbol, pfn, version, flags, status);
    if (r == CUDA_SUCCESS && symbol != nullptr && pfn != nullptr && *pfn != nullptr)
        *pfn = redirect_proc(symbol, *pfn, version, flags);
    return r;
}

MOECACHE_EXPORT void moecache_cuda_stats_get(moecache_cuda_stats* out) {
    if (out == nullptr) return;
    *out = {};
    try {
        if (auto* e = moecache::cuda::hook::Engine::peek()) e->stats(out);
    } catch (...) {
    }
}

MOECACHE_EXPORT uint64_t moecache_cuda_pool_bytes(int device) {
    try {
        auto* e = moecache::cuda::hook::Engine::peek();
        return e == nullptr ? 0 : e->pool_bytes(device);
    } catch (...) {
        return 0;
    }
}

MOECACHE_EXPORT int moecache_cuda_sync(int timeout_ms) {
    try {
        auto* e = moecache::cuda::hook::Engine::get();
        return e == nullptr ? 0 : e->sync(timeout_ms);
    } catch (...) {
        return 0;
    }
}

// --- dlsym ----------------------------------------------------------------------------------------
// glibc's dlsym resolves RTLD_NEXT relative to its caller's return address, so the hook must reach
// it by a jump that leaves the caller's return address in place: a few instructions of assembly.
// Everything else goes through moecache_dlsym_hook, which hands out the hook for libcuda's symbols.

extern "C" void moecache_resolve_dlsym() {
    void* p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (p == nullptr) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    moecache_real_dlsym = reinterpret_cast<void* (*)(void*, const char*)>(p);
}

extern "C" void* moecache_dlsym_hook(void* handle, const char* symbol) {
    void* r = moecache::cuda::hook::real_dlsym(handle, symbol);
    if (r == nullptr || symbol == nullptr || strncmp(symbol, "cu", 2) != 0 || strncmp(symbol, "cuda", 4) == 0) return r;
    return moecache::cuda::hook::redirect_export(symbol, r);
}

#if defined(__x86_64__)
asm(R"(
    .text
    .globl dlsym
    .type dlsym, @function
    .p2align 4
dlsym:
    .cfi_startproc
    cmpq $-1, %rdi
    jne moecache_dlsym_hook
    movq moecache_real_dlsym(%rip), %rax
    testq %rax, %rax
    jz 1f
    jmp *%rax
1:
    pushq %rdi
    .cfi_adjust_cfa_offset 8
    pushq %rsi
    .cfi_adjust_cfa_offset 8
    subq $8, %rsp
    .cfi_adjust_cfa_offset 8
    call moecache_resolve_dlsym
    addq $8, %rsp
    .cfi_adjust_cfa_offset -8
    popq %rsi
    .cfi_adjust_cfa_offset -8
    popq %rdi
    .cfi_adjust_cfa_offset -8
    jmp *moecache_real_dlsym(%rip)
    .cfi_endproc
    .size dlsym, .-dlsym
)");
#else
// Elsewhere RTLD_NEXT lookups are resolved relative to the hook, not to their caller.
MOECACHE_EXPORT void* dlsym(void* handle, const char* symbol) { return moecache_dlsym_hook(handle, symbol); }
#endif

__attribute__((destructor)) static void moecache_cuda_unload() {
    if (auto* e = moecache::cuda::hook::Engine::peek()) e->shutdown();
}
