// Every function the hook interposes, in one place. interpose.cpp expands these lists into the
// exported definitions, the pointers to the real functions, and the tables that dlsym and
// cuGetProcAddress consult; a handler `on_<name>` with the same parameters does the work.
#pragma once

// Runtime API: X(name, parameters, arguments). All return cudaError_t.
#define MOECACHE_CUDART_HOOKS(X)                                                                              \
    X(cudaMemcpy, (void* dst, const void* src, size_t n, cudaMemcpyKind kind), (dst, src, n, kind))            \
    X(cudaMemcpy_ptds, (void* dst, const void* src, size_t n, cudaMemcpyKind kind), (dst, src, n, kind))       \
    X(cudaMemcpyAsync, (void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s),            \
      (dst, src, n, kind, s))                                                                                  \
    X(cudaMemcpyAsync_ptsz, (void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s),       \
      (dst, src, n, kind, s))                                                                                  \
    X(cudaMemcpy2D,                                                                                            \
      (void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h, cudaMemcpyKind kind),     \
      (dst, dpitch, src, spitch, w, h, kind))                                                                  \
    X(cudaMemcpy2D_ptds,                                                                                       \
      (void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h, cudaMemcpyKind kind),     \
      (dst, dpitch, src, spitch, w, h, kind))                                                                  \
    X(cudaMemcpy2DAsync,                                                                                       \
      (void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h, cudaMemcpyKind kind,      \
       cudaStream_t s),                                                                                        \
      (dst, dpitch, src, spitch, w, h, kind, s))                                                               \
    X(cudaMemcpy2DAsync_ptsz,                                                                                  \
      (void* dst, size_t dpitch, const void* src, size_t spitch, size_t w, size_t h, cudaMemcpyKind kind,      \
       cudaStream_t s),                                                                                        \
      (dst, dpitch, src, spitch, w, h, kind, s))                                                               \
    X(cudaMalloc, (void** p, size_t n), (p, n))                                                                \
    X(cudaFree, (void* p), (p))                                                                                \
    X(cudaMemGetInfo, (size_t* free_bytes, size_t* total_bytes), (free_bytes, total_bytes))                    \
    X(cudaStreamDestroy, (cudaStream_t s), (s))

// Driver API: X(exported name, name given to cuGetProcAddress, first CUDA version of this ABI,
// per-thread default stream variant, parameters, arguments). All return CUresult.
#define MOECACHE_CU_HOOKS(X)                                                                                   \
    X(cuMemcpyHtoD_v2, "cuMemcpyHtoD", 3020, false, (CUdeviceptr dst, const void* src, size_t n), (dst, src, n)) \
    X(cuMemcpyHtoD_v2_ptds, "cuMemcpyHtoD", 3020, true, (CUdeviceptr dst, const void* src, size_t n),          \
      (dst, src, n))                                                                                           \
    X(cuMemcpyHtoDAsync_v2, "cuMemcpyHtoDAsync", 3020, false,                                                  \
      (CUdeviceptr dst, const void* src, size_t n, CUstream s), (dst, src, n, s))                              \
    X(cuMemcpyHtoDAsync_v2_ptsz, "cuMemcpyHtoDAsync", 3020, true,                                              \
      (CUdeviceptr dst, const void* src, size_t n, CUstream s), (dst, src, n, s))                              \
    X(cuMemcpyDtoH_v2, "cuMemcpyDtoH", 3020, false, (void* dst, CUdeviceptr src, size_t n), (dst, src, n))      \
    X(cuMemcpyDtoH_v2_ptds, "cuMemcpyDtoH", 3020, true, (void* dst, CUdeviceptr src, size_t n), (dst, src, n))  \
    X(cuMemcpyDtoHAsync_v2, "cuMemcpyDtoHAsync", 3020, false, (void* dst, CUdeviceptr src, size_t n, CUstream s), \
      (dst, src, n, s))                                                                                        \
    X(cuMemcpyDtoHAsync_v2_ptsz, "cuMemcpyDtoHAsync", 3020, true,                                              \
      (void* dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s))                                    \
    X(cuMemcpy, "cuMemcpy", 4000, false, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))          \
    X(cuMemcpy_ptds, "cuMemcpy", 4000, true, (CUdeviceptr dst, CUdeviceptr src, size_t n), (dst, src, n))     \
    X(cuMemcpyAsync, "cuMemcpyAsync", 4000, false, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s),  \
      (dst, src, n, s))                                                                                        \
    X(cuMemcpyAsync_ptsz, "cuMemcpyAsync", 4000, true,                                                         \
      (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s), (dst, src, n, s))                              \
    X(cuMemcpy2D_v2, "cuMemcpy2D", 3020, false, (const CUDA_MEMCPY2D* c), (c))                                 \
    X(cuMemcpy2D_v2_ptds, "cuMemcpy2D", 3020, true, (const CUDA_MEMCPY2D* c), (c))                             \
    X(cuMemcpy2DAsync_v2, "cuMemcpy2DAsync", 3020, false, (const CUDA_MEMCPY2D* c, CUstream s), (c, s))        \
    X(cuMemcpy2DAsync_v2_ptsz, "cuMemcpy2DAsync", 3020, true, (const CUDA_MEMCPY2D* c, CUstream s), (c, s))    \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, false, (CUdeviceptr* p, size_t n), (p, n))                            \
    X(cuMemFree_v2, "cuMemFree", 3020, false, (CUdeviceptr p), (p))                                            \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, false, (size_t* free_bytes, size_t* total_bytes),                 \
      (free_bytes, total_bytes))                                                                               \
    X(cuStreamDestroy_v2, "cuStreamDestroy", 4000, false, (CUstream s), (s))                                  \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, false, (CUstream s, CUstreamCaptureMode mode),    \
      (s, mode))                                                                                               \
    X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, true, (CUstream s, CUstreamCaptureMode mode), \
      (s, mode))                                                                                               \
    X(cuStreamBeginCaptureToGraph, "cuStreamBeginCaptureToGraph", 12030, false,                               \
      (CUstream s, CUgraph g, const CUgraphNode* deps, const CUgraphEdgeData* edges, size_t n,                \
       CUstreamCaptureMode mode), (s, g, deps, edges, n, mode))                                                \
    X(cuStreamBeginCaptureToGraph_ptsz, "cuStreamBeginCaptureToGraph", 12030, true,                           \
      (CUstream s, CUgraph g, const CUgraphNode* deps, const CUgraphEdgeData* edges, size_t n,                \
       CUstreamCaptureMode mode), (s, g, deps, edges, n, mode))                                                \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000, false, (CUstream s, CUgraph* g), (s, g))               \
    X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 10000, true, (CUstream s, CUgraph* g), (s, g))
