// A fake libcuda.so.1 for CI, which has no GPU: "device memory" is host memory. It implements the
// driver functions the hook and its tests use, with the real ABI (signatures from cuda.h), and
// hands them out through cuGetProcAddress as the real driver does, per-thread-stream variants
// included. Knobs (exported variables a test sets through dlsym) drive the hook through what a GPU
// would do to it:
//   fake_cuda_devices      how many devices (1); each has a primary context, the current one is
//                          per thread (cuCtxSetCurrent, push/pop) and allocations belong to it
//   fake_cuda_async        0: every stream runs its work at once. 1: streams queue their work and
//                          run it as late as the API allows: only a synchronisation, or another
//                          stream's wait on an event recorded in it, runs a queue, and a context
//                          synchronisation runs the newest stream first. Work on two streams that
//                          nothing ordered then runs in the order that breaks a missing wait, and
//                          a copy from pinned host memory reads it when it runs (pageable memory is
//                          read when the copy is queued, as the driver stages it).
//                          An event query completes the work up to its record every other time.
//   fake_cuda_capturing    every stream reports an active capture
//   fake_cuda_copy_delay_us  a host-to-device copy waits this long before the driver looks at its
//                          source (a real one spends microseconds there, a pageable one longer):
//                          what the hook registers meanwhile decides whether the copy is refused
//   fake_cuda_link_gbps    host-to-device copies of 1 MiB or more take at least their bytes at
//                          this rate (0: as fast as memcpy): a slow link to the GPU
// Captures (cuStreamBeginCapture_v2 .. cuStreamEndCapture) are modelled as the driver keeps them:
// while one is open, a context synchronisation, a cuMemFree or a module load invalidates it, and
// its cuStreamEndCapture says so (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED); fake_cuda_counts counts
// the captures so spoiled (invalidated).
//   fake_cuda_memory_limit bytes per device
//   fake_cuda_kernels      0: cuModuleLoadData refuses every image. Else a module loads into the
//                          current context when its PTX has the hook's copy kernel
//                          (moecache_copy16), and launching it there queues its copy (16-byte
//                          words); from another context the launch fails, as a real one would
//   fake_cuda_kernel_n_broken  1: its several-range form leaves out the last range of a launch
//                          of eight (a row of the parameters loaded wrong)
//   fake_cuda_peer         0: devices cannot access each other (cuDeviceCanAccessPeer says no);
//                          else they can once cuCtxEnablePeerAccess enabled it, and peer copies
//                          (cuMemcpyPeerAsync) check that each side lies on its context's device
// A host-to-device copy that starts in registered memory and ends outside it is refused, as the
// real driver refuses it. Stream handles are reused as soon as a stream is destroyed, as a real
// driver may. Allocations,
// registrations, streams and events need a current context on the calling thread, as there.
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#undef cuGetProcAddress

extern "C" {

struct fake_cuda_counters {
    unsigned long long htod_calls, htod_bytes, dtod_calls, dtod_bytes, allocs, frees, syncs, event_waits, registered;
    unsigned long long peer_calls, peer_bytes;
    unsigned long long kernel_launches, kernel_bytes;
    unsigned long long captures, invalidated;
};
__attribute__((visibility("default"))) fake_cuda_counters fake_cuda_counts;
__attribute__((visibility("default"))) int fake_cuda_kernels = 1;
// 1: the several-range copy kernel (moecache_copy16_n) leaves out the eighth range of a launch of
// eight, as a kernel whose last row's parameters were loaded wrong would: the hook's check of it at
// load must catch it (a check of fewer ranges would not).
__attribute__((visibility("default"))) int fake_cuda_kernel_n_broken = 0;
__attribute__((visibility("default"))) int fake_cuda_capturing = 0;
__attribute__((visibility("default"))) int fake_cuda_async = 0;
__attribute__((visibility("default"))) int fake_cuda_devices = 1;
__attribute__((visibility("default"))) unsigned long long fake_cuda_memory_limit = 8ull << 30;
__attribute__((visibility("default"))) int fake_cuda_peer = 1;
__attribute__((visibility("default"))) int fake_cuda_copy_delay_us = 0;
__attribute__((visibility("default"))) double fake_cuda_link_gbps = 0;
}

namespace {

constexpr int kMaxDevices = 8;

struct Event;
struct Op {
    enum Kind { Copy, Record, Wait } kind = Copy;
    CUdeviceptr dst = 0;
    const void* src = nullptr;              // read when the op runs (device or pinned memory)
    std::shared_ptr<std::vector<uint8_t>> staged;  // or these bytes, read when it was queued
    size_t n = 0;
    bool htod = false;
    Event* event = nullptr;
    uint64_t generation = 0;  // Record: the generation it completes; Wait: the one it waits for
};
struct Stream {
    int device = 0;
    unsigned order = 0;  // creation order, for the adversarial drain
    bool alive = true;
    std::deque<Op> queue;
};
struct Event {
    int device = 0;
    Stream* stream = nullptr;  // where the last record was queued
    uint64_t recorded = 0;     // generations queued
    uint64_t done = 0;         // generations completed
};

std::recursive_mutex mu;
struct Allocation {
    size_t bytes;
    int device;
};
std::map<CUdeviceptr, Allocation> allocations;
std::map<uintptr_t, size_t> pinned;  // host ranges registered or allocated for DMA
size_t allocated[kMaxDevices] = {};
int ctx_token[kMaxDevices];
thread_local std::vector<int> ctx_stack;  // current context: the back (device index)
std::vector<Stream*> streams;             // every stream ever made, by handle - 16
std::vector<size_t> free_handles;
unsigned stream_order = 0;
Stream* legacy[kMaxDevices] = {};

int current_device() { return ctx_stack.empty() ? 0 : ctx_stack.back(); }
// As the real driver: what makes or registers memory or events needs a current context.
bool no_context() { return ctx_stack.empty(); }

// Open captures by stream, and whether something spoiled each.
std::map<CUstream, bool> capturing;
void spoil_captures() {
    for (auto& [stream, spoiled] : capturing) {
        if (!spoiled) ++fake_cuda_counts.invalidated;
        spoiled = true;
    }
}

const Allocation* allocation_of(CUdeviceptr p, size_t n = 1) {
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return nullptr;
    --it;
    return p >= it->first && p + n <= it->first + it->second.bytes ? &it->second : nullptr;
}
bool is_device(CUdeviceptr p, size_t n = 1) { return allocation_of(p, n) != nullptr; }
bool is_pinned(const void* p, size_t n) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = pinned.upper_bound(a);
    if (it == pinned.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second;
}

// The per-device stream that handle 0 (and the legacy/per-thread handles) means.
Stream* stream_of(CUstream s) {
    const auto h = reinterpret_cast<uintptr_t>(s);
    if (h >= 16 && h - 16 < streams.size() && streams[h - 16]->alive) return streams[h - 16];
    const int d = current_device();
    if (legacy[d] == nullptr) legacy[d] = new Stream{d, stream_order++, true, {}};
    return legacy[d];
}

void run(Stream* s, const Op* upto = nullptr);
void run_op(const Op& op) {
    switch (op.kind) {
        case Op::Copy:
            memmove(reinterpret_cast<void*>(op.dst), op.staged ? op.staged->data() : op.src, op.n);
            break;
        case Op::Record:
            op.event->done = std::max(op.event->done, op.generation);
            break;
        case Op::Wait:
            // Runs the recording stream up to the record this wait is for: the real dependency.
            while (op.event->done < op.generation && op.event->stream != nullptr) {
                Stream* other = op.event->stream;
                const Op* rec = nullptr;
                for (const auto& o : other->queue)
                    if (o.kind == Op::Record && o.event == op.event && o.generation >= op.generation) {
                        rec = &o;
                        break;
                    }
                if (rec == nullptr) break;
                run(other, rec);
            }
            break;
    }
}
// Runs a stream's queue in order, up to and including `upto` (all of it when null).
void run(Stream* s, const Op* upto) {
    while (!s->queue.empty()) {
        const Op op = s->queue.front();
        const bool last = &s->queue.front() == upto;
        s->queue.pop_front();
        run_op(op);
        if (last) break;
    }
}
void run_device(int device) {
    // Newest stream first: work that nothing ordered runs in the order that shows a missing wait.
    std::vector<Stream*> order;
    for (auto* s : streams)
        if (s->device == device) order.push_back(s);
    if (legacy[device] != nullptr) order.push_back(legacy[device]);
    std::sort(order.begin(), order.end(), [](Stream* a, Stream* b) { return a->order > b->order; });
    for (auto* s : order) run(s);
}
void run_all() {
    for (int d = 0; d < kMaxDevices; ++d) run_device(d);
}

CUresult enqueue(CUstream st, Op op) {
    Stream* s = stream_of(st);
    if (!fake_cuda_async) {
        run_op(op);
        return CUDA_SUCCESS;
    }
    s->queue.push_back(std::move(op));
    return CUDA_SUCCESS;
}

CUresult htod(CUdeviceptr dst, const void* src, size_t n, CUstream stream, bool sync) {
    if (fake_cuda_copy_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(fake_cuda_copy_delay_us));
    if (fake_cuda_link_gbps > 0 && n >= (1u << 20))
        std::this_thread::sleep_for(std::chrono::nanoseconds(static_cast<int64_t>(static_cast<double>(n) / fake_cuda_link_gbps)));
    std::lock_guard lock(mu);
    if (n == 0) return CUDA_SUCCESS;
    if (!is_device(dst, n)) return CUDA_ERROR_INVALID_VALUE;
    // As the real driver: a copy that starts in registered memory must end in it.
    if (is_pinned(src, 1) && !is_pinned(src, n)) return CUDA_ERROR_INVALID_VALUE;
    ++fake_cuda_counts.htod_calls;
    fake_cuda_counts.htod_bytes += n;
    Op op{Op::Copy, dst, src, nullptr, n, true};
    if (fake_cuda_async && !is_pinned(src, n))
        op.staged = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(src), static_cast<const uint8_t*>(src) + n);
    if (sync) {
        run_all();
        run_op(op);
        return CUDA_SUCCESS;
    }
    return enqueue(stream, std::move(op));
}

CUresult dtod(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream stream) {
    std::lock_guard lock(mu);
    if (n == 0) return CUDA_SUCCESS;
    if (!is_device(d, n) || !is_device(s, n)) return CUDA_ERROR_INVALID_VALUE;
    ++fake_cuda_counts.dtod_calls;
    fake_cuda_counts.dtod_bytes += n;
    return enqueue(stream, Op{Op::Copy, d, reinterpret_cast<const void*>(s), nullptr, n});
}

CUresult unified(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream stream, bool sync) {
    std::unique_lock lock(mu);
    if (is_device(d) && !is_device(s)) return htod(d, reinterpret_cast<const void*>(s), n, stream, sync);
    if (is_device(d) && is_device(s)) {
        const CUresult r = dtod(d, s, n, stream);
        if (sync) run_all();
        return r;
    }
    run_all();
    memmove(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), n);
    return CUDA_SUCCESS;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default"))) CUresult CUDAAPI

API cuInit(unsigned int) { return CUDA_SUCCESS; }
API cuDriverGetVersion(int* v) { *v = CUDA_VERSION; return CUDA_SUCCESS; }
API cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal < 0 || ordinal >= std::min(fake_cuda_devices, kMaxDevices)) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
API cuDeviceGetCount(int* n) { *n = std::min(fake_cuda_devices, kMaxDevices); return CUDA_SUCCESS; }
API cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    if (d < 0 || d >= std::min(fake_cuda_devices, kMaxDevices)) return CUDA_ERROR_INVALID_DEVICE;
    *c = reinterpret_cast<CUcontext>(&ctx_token[d]);
    return CUDA_SUCCESS;
}
API cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
static int device_of_ctx(CUcontext c) {
    for (int d = 0; d < kMaxDevices; ++d)
        if (c == reinterpret_cast<CUcontext>(&ctx_token[d])) return d;
    return -1;
}
API cuCtxSetCurrent(CUcontext c) {
    const int d = device_of_ctx(c);
    if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx_stack.empty()) ctx_stack.push_back(d);
    else ctx_stack.back() = d;
    return CUDA_SUCCESS;
}
API cuCtxGetCurrent(CUcontext* c) { *c = reinterpret_cast<CUcontext>(&ctx_token[current_device()]); return CUDA_SUCCESS; }
API cuCtxGetDevice(CUdevice* d) { *d = current_device(); return CUDA_SUCCESS; }
API cuCtxPushCurrent_v2(CUcontext c) {
    const int d = device_of_ctx(c);
    if (d < 0) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_stack.push_back(d);
    return CUDA_SUCCESS;
}
API cuCtxPopCurrent_v2(CUcontext* c) {
    if (c) *c = reinterpret_cast<CUcontext>(&ctx_token[current_device()]);
    if (!ctx_stack.empty()) ctx_stack.pop_back();
    return CUDA_SUCCESS;
}
API cuCtxSynchronize() {
    std::lock_guard lock(mu);
    spoil_captures();
    ++fake_cuda_counts.syncs;
    run_device(current_device());
    return CUDA_SUCCESS;
}
API cuStreamCreate(CUstream* s, unsigned int) {
    std::lock_guard lock(mu);
    if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
    size_t index = 0;
    if (!free_handles.empty()) {
        index = free_handles.back();
        free_handles.pop_back();
        // The old stream's queue lives on (its work still runs); the handle is new.
        auto* old = streams[index];
        streams[index] = new Stream{current_device(), stream_order++, true, {}};
        old->alive = false;
        streams.push_back(old);  // kept, under a handle nobody has
    } else {
        index = streams.size();
        streams.push_back(new Stream{current_device(), stream_order++, true, {}});
    }
    *s = reinterpret_cast<CUstream>(index + 16);
    return CUDA_SUCCESS;
}
API cuStreamDestroy_v2(CUstream s) {
    std::lock_guard lock(mu);
    const auto h = reinterpret_cast<uintptr_t>(s);
    if (h < 16 || h - 16 >= streams.size() || !streams[h - 16]->alive) return CUDA_ERROR_INVALID_HANDLE;
    free_handles.push_back(h - 16);
    return CUDA_SUCCESS;
}
API cuStreamSynchronize(CUstream s) {
    std::lock_guard lock(mu);
    ++fake_cuda_counts.syncs;
    run(stream_of(s));
    return CUDA_SUCCESS;
}
API cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* st) {
    std::lock_guard lock(mu);
    *st = fake_cuda_capturing || capturing.count(s) ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
API cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode) {
    std::lock_guard lock(mu);
    if (s == nullptr) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (!capturing.emplace(s, false).second) return CUDA_ERROR_ILLEGAL_STATE;
    ++fake_cuda_counts.captures;
    return CUDA_SUCCESS;
}
API cuStreamEndCapture(CUstream s, CUgraph* g) {
    std::lock_guard lock(mu);
    const auto it = capturing.find(s);
    if (it == capturing.end()) return CUDA_ERROR_ILLEGAL_STATE;
    const bool spoiled = it->second;
    capturing.erase(it);
    if (g) *g = spoiled ? nullptr : reinterpret_cast<CUgraph>(&fake_cuda_counts);
    return spoiled ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}
API cuEventCreate(CUevent* e, unsigned int) {
    std::lock_guard lock(mu);
    if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
    *e = reinterpret_cast<CUevent>(new Event{current_device()});
    return CUDA_SUCCESS;
}
API cuEventDestroy_v2(CUevent e) {
    std::lock_guard lock(mu);
    (void)e;  // queued ops may still name it: kept
    return CUDA_SUCCESS;
}
API cuEventRecord(CUevent e, CUstream s) {
    std::lock_guard lock(mu);
    auto* ev = reinterpret_cast<Event*>(e);
    Stream* st = stream_of(s);
    if (st->device != ev->device) return CUDA_ERROR_INVALID_HANDLE;
    ev->stream = st;
    return enqueue(s, Op{Op::Record, 0, nullptr, nullptr, 0, false, ev, ++ev->recorded});
}
// Every other query finds the device done up to the record (as time passes on a GPU); the others
// find it busy: both of a caller's paths run.
API cuEventQuery(CUevent e) {
    std::lock_guard lock(mu);
    static unsigned queries = 0;
    auto* ev = reinterpret_cast<Event*>(e);
    if (ev->done < ev->recorded && ++queries % 2 == 0) run_op(Op{Op::Wait, 0, nullptr, nullptr, 0, false, ev, ev->recorded});
    return ev->done >= ev->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API cuEventSynchronize(CUevent e) {
    std::lock_guard lock(mu);
    auto* ev = reinterpret_cast<Event*>(e);
    Op wait{Op::Wait, 0, nullptr, nullptr, 0, false, ev, ev->recorded};
    run_op(wait);
    return CUDA_SUCCESS;
}
API cuStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
    std::lock_guard lock(mu);
    auto* ev = reinterpret_cast<Event*>(e);
    ++fake_cuda_counts.event_waits;
    return enqueue(s, Op{Op::Wait, 0, nullptr, nullptr, 0, false, ev, ev->recorded});
}
API cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    std::lock_guard lock(mu);
    if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
    const int d = current_device();
    if (allocated[d] + n > fake_cuda_memory_limit) return CUDA_ERROR_OUT_OF_MEMORY;
    void* m = malloc(n ? n : 1);
    if (m == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = reinterpret_cast<CUdeviceptr>(m);
    allocations[*p] = {n, d};
    allocated[d] += n;
    ++fake_cuda_counts.allocs;
    return CUDA_SUCCESS;
}
API cuMemFree_v2(CUdeviceptr p) {
    std::lock_guard lock(mu);
    spoil_captures();
    auto it = allocations.find(p);
    if (it == allocations.end()) return CUDA_ERROR_INVALID_VALUE;
    run_all();  // as cudaFree: nothing queued may still touch it
    allocated[it->second.device] -= it->second.bytes;
    allocations.erase(it);
    free(reinterpret_cast<void*>(p));
    ++fake_cuda_counts.frees;
    return CUDA_SUCCESS;
}
API cuMemGetInfo_v2(size_t* f, size_t* t) {
    std::lock_guard lock(mu);
    *t = fake_cuda_memory_limit;
    *f = fake_cuda_memory_limit - allocated[current_device()];
    return CUDA_SUCCESS;
}
API cuMemHostAlloc(void** p, size_t n, unsigned int) {
    std::lock_guard lock(mu);
    if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
    *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (*p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    pinned[reinterpret_cast<uintptr_t>(*p)] = n;
    return CUDA_SUCCESS;
}
API cuMemFreeHost(void* p) {
    std::lock_guard lock(mu);
    if (pinned.erase(reinterpret_cast<uintptr_t>(p)) == 0) return CUDA_ERROR_INVALID_VALUE;
    run_all();
    free(p);
    return CUDA_SUCCESS;
}
// As the real driver: a range that overlaps one registered already is refused with 712 (and
// PORTABLE memory is registered for every device at once).
API cuMemHostRegister_v2(void* p, size_t n, unsigned int) {
    std::lock_guard lock(mu);
    if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = pinned.upper_bound(a + n - 1);
    if (it != pinned.begin() && std::prev(it)->first + std::prev(it)->second > a)
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    pinned[a] = n;
    ++fake_cuda_counts.registered;
    return CUDA_SUCCESS;
}
API cuMemHostUnregister(void* p) {
    std::lock_guard lock(mu);
    run_all();
    return pinned.erase(reinterpret_cast<uintptr_t>(p)) != 0 ? CUDA_SUCCESS : CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}
API cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
    const int n = std::min(fake_cuda_devices, kMaxDevices);
    if (d < 0 || d >= n || peer < 0 || peer >= n) return CUDA_ERROR_INVALID_DEVICE;
    *can = fake_cuda_peer != 0 && d != peer ? 1 : 0;
    return CUDA_SUCCESS;
}
bool peer_enabled[kMaxDevices][kMaxDevices];
API cuCtxEnablePeerAccess(CUcontext peer, unsigned int flags) {
    std::lock_guard lock(mu);
    const int p = device_of_ctx(peer), d = current_device();
    if (no_context() || p < 0 || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (!fake_cuda_peer || p == d) return CUDA_ERROR_PEER_ACCESS_UNSUPPORTED;
    if (peer_enabled[d][p]) return CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    peer_enabled[d][p] = true;
    return CUDA_SUCCESS;
}
// As the driver: valid whether or not peer access is enabled (without it a GPU stages the bytes
// through the host); here each side must lie on its context's device.
API cuMemcpyPeerAsync(CUdeviceptr d, CUcontext dctx, CUdeviceptr s, CUcontext sctx, size_t n, CUstream st) {
    std::lock_guard lock(mu);
    if (n == 0) return CUDA_SUCCESS;
    const Allocation* da = allocation_of(d, n);
    const Allocation* sa = allocation_of(s, n);
    if (da == nullptr || sa == nullptr || da->device != device_of_ctx(dctx) || sa->device != device_of_ctx(sctx))
        return CUDA_ERROR_INVALID_VALUE;
    ++fake_cuda_counts.peer_calls;
    fake_cuda_counts.peer_bytes += n;
    return enqueue(st, Op{Op::Copy, d, reinterpret_cast<const void*>(s), nullptr, n});
}
API cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { return htod(d, s, n, nullptr, true); }
API cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void* s, size_t n) { return htod(d, s, n, nullptr, true); }
API cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, CUstream st) { return htod(d, s, n, st, false); }
API cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void* s, size_t n, CUstream st) { return htod(d, s, n, st, false); }
API cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return dtod(d, s, n, st); }

// Modules: one kernel, the hook's copy kernel, in the context that loaded it.
namespace {
struct Module {
    int device = 0;
    bool loaded = true;
    // Its functions' handles: the hook's copy kernel and its several-range form.
    char copy = 0, copy_n = 0;
};
std::vector<std::unique_ptr<Module>> modules;
}  // namespace
API cuModuleLoadData(CUmodule* m, const void* image) {
    std::lock_guard lock(mu);
    spoil_captures();
    if (m == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (no_context()) return CUDA_ERROR_INVALID_CONTEXT;
    if (!fake_cuda_kernels || strstr(static_cast<const char*>(image), ".entry moecache_copy16(") == nullptr)
        return CUDA_ERROR_INVALID_IMAGE;
    modules.push_back(std::make_unique<Module>(Module{current_device()}));
    *m = reinterpret_cast<CUmodule>(modules.back().get());
    return CUDA_SUCCESS;
}
API cuModuleUnload(CUmodule m) {
    std::lock_guard lock(mu);
    for (auto& x : modules)
        if (reinterpret_cast<CUmodule>(x.get()) == m && x->loaded) {
            x->loaded = false;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}
API cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    std::lock_guard lock(mu);
    if (f == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
    for (auto& x : modules)
        if (reinterpret_cast<CUmodule>(x.get()) == m && x->loaded) {
            if (strcmp(name, "moecache_copy16") == 0)
                *f = reinterpret_cast<CUfunction>(&x->copy);
            else if (strcmp(name, "moecache_copy16_n") == 0)
                *f = reinterpret_cast<CUfunction>(&x->copy_n);
            else
                return CUDA_ERROR_NOT_FOUND;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_HANDLE;
}
API cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned,
                   CUstream st, void** params, void** extra) {
    std::lock_guard lock(mu);
    Module* mod = nullptr;
    bool several = false;  // copy16_n: a range a row of the grid
    for (auto& x : modules)
        if (x->loaded &&
            (reinterpret_cast<CUfunction>(&x->copy) == f || reinterpret_cast<CUfunction>(&x->copy_n) == f)) {
            mod = x.get();
            several = reinterpret_cast<CUfunction>(&x->copy_n) == f;
        }
    if (mod == nullptr) return CUDA_ERROR_INVALID_HANDLE;
    if (no_context() || mod->device != current_device()) return CUDA_ERROR_INVALID_CONTEXT;
    if (params == nullptr || extra != nullptr || gx == 0 || gy == 0 || gy > (several ? 8u : 1u) || gz != 1 || bx == 0 ||
        by != 1 || bz != 1)
        return CUDA_ERROR_INVALID_VALUE;
    std::vector<Op> ops;
    const unsigned rows = several && fake_cuda_kernel_n_broken && gy == 8 ? gy - 1 : gy;
    for (unsigned y = 0; y < rows; ++y) {
        CUdeviceptr d = 0, src = 0;
        unsigned long long words = 0;
        memcpy(&d, params[y * 3], sizeof d);
        memcpy(&src, params[y * 3 + 1], sizeof src);
        memcpy(&words, params[y * 3 + 2], sizeof words);
        const size_t n = words * 16;
        if (((d | src) & 15) != 0) return CUDA_ERROR_MISALIGNED_ADDRESS;
        if (n == 0) continue;
        const Allocation* da = allocation_of(d, n);
        const Allocation* sa = allocation_of(src, n);
        if (da == nullptr || sa == nullptr || da->device != mod->device || sa->device != mod->device)
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        ops.push_back(Op{Op::Copy, d, reinterpret_cast<const void*>(src), nullptr, n});
    }
    ++fake_cuda_counts.kernel_launches;
    // A real launch's rows run at once, in no order: where two ranges overlap (a slice's padding
    // is the next slice's head) the result must not depend on it. The fake runs them last first.
    std::reverse(ops.begin(), ops.end());
    for (const Op& op : ops) {
        fake_cuda_counts.kernel_bytes += op.n;
        if (const CUresult r = enqueue(st, op); r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}
API cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
    std::lock_guard lock(mu);
    const Allocation* a = allocation_of(p);
    if (a == nullptr) return CUDA_ERROR_NOT_FOUND;
    const auto it = std::prev(allocations.upper_bound(p));
    if (base != nullptr) *base = it->first;
    if (size != nullptr) *size = a->bytes;
    return CUDA_SUCCESS;
}
API cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) {
    std::lock_guard lock(mu);
    if (!is_device(s, n)) return CUDA_ERROR_INVALID_VALUE;
    run_all();
    memcpy(d, reinterpret_cast<const void*>(s), n);
    return CUDA_SUCCESS;
}
API cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return unified(d, s, n, nullptr, true); }
API cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { return unified(d, s, n, nullptr, true); }
API cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return unified(d, s, n, st, false); }
API cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return unified(d, s, n, st, false); }
API cuPointerGetAttributes(unsigned int n, CUpointer_attribute* attrs, void** data, CUdeviceptr p) {
    std::lock_guard lock(mu);
    const Allocation* a = allocation_of(p);
    for (unsigned i = 0; i < n; ++i) {
        if (attrs[i] == CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
            *static_cast<CUmemorytype*>(data[i]) = a != nullptr ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        else if (attrs[i] == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
            *static_cast<int*>(data[i]) = a != nullptr ? a->device : -1;
        else
            return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

// Whether `p` lies in memory registered or allocated for DMA (for tests that check what is pinned).
extern "C" __attribute__((visibility("default"))) int fake_cuda_is_pinned(const void* p) {
    std::lock_guard lock(mu);
    return is_pinned(p, 1) ? 1 : 0;
}

// The same copy under a name no hook interposes, for benchmarks that compare a hooked call with the
// bare one.
extern "C" __attribute__((visibility("default"))) CUresult fake_bare_htod_async(CUdeviceptr d, const void* s, size_t n,
                                                                                 CUstream st) {
    return htod(d, s, n, st, false);
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
    E(cuInit),
    E(cuDriverGetVersion),
    E(cuDeviceGet),
    E(cuDeviceGetCount),
    E(cuDevicePrimaryCtxRetain),
    V("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2),
    E(cuCtxSetCurrent),
    E(cuCtxGetCurrent),
    E(cuCtxGetDevice),
    V("cuCtxPushCurrent", cuCtxPushCurrent_v2),
    V("cuCtxPopCurrent", cuCtxPopCurrent_v2),
    E(cuCtxSynchronize),
    E(cuStreamCreate),
    V("cuStreamDestroy", cuStreamDestroy_v2),
    E(cuStreamSynchronize),
    E(cuStreamIsCapturing),
    E(cuEventCreate),
    V("cuEventDestroy", cuEventDestroy_v2),
    E(cuEventRecord),
    E(cuEventQuery),
    E(cuEventSynchronize),
    E(cuStreamWaitEvent),
    V("cuMemAlloc", cuMemAlloc_v2),
    V("cuMemFree", cuMemFree_v2),
    V("cuMemGetInfo", cuMemGetInfo_v2),
    E(cuMemHostAlloc),
    E(cuMemFreeHost),
    V("cuMemcpyHtoD", cuMemcpyHtoD_v2),
    P("cuMemcpyHtoD", cuMemcpyHtoD_v2_ptds),
    V("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2),
    P("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2_ptsz),
    V("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2),
    V("cuMemcpyDtoH", cuMemcpyDtoH_v2),
    E(cuMemcpy),
    P("cuMemcpy", cuMemcpy_ptds),
    E(cuMemcpyAsync),
    P("cuMemcpyAsync", cuMemcpyAsync_ptsz),
    V("cuMemHostRegister", cuMemHostRegister_v2),
    E(cuMemHostUnregister),
    E(cuPointerGetAttributes),
    E(cuDeviceCanAccessPeer),
    E(cuCtxEnablePeerAccess),
    E(cuMemcpyPeerAsync),
    E(cuModuleLoadData),
    E(cuModuleUnload),
    E(cuModuleGetFunction),
    E(cuLaunchKernel),
    V("cuStreamBeginCapture", cuStreamBeginCapture_v2),
    V("cuMemGetAddressRange", cuMemGetAddressRange_v2),
    E(cuStreamEndCapture),
};

CUresult CUDAAPI get_proc(const char* symbol, void** pfn, int version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult* status) {
    (void)version;
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
