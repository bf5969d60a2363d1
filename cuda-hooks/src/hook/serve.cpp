// The copy path: a host-to-device copy out of a mapped model, split into pieces that come from the
// device's VRAM pool (device-to-device), from another device's pool (peer to peer) and from the
// host (straight from registered pages, or through pinned staging where that is faster), with the
// slices no pool held admitted into this device's pool from where they landed.
//
// Short steps, each under one device's lock and none of which waits for a device: this device's
// slots taken (ordering this stream after whichever stream used them last) and their pieces queued;
// then each peer's the same way; then the slots for what missed everywhere admitted; then, without
// a lock, the host's pieces; then, under the lock again, the copies into the slots admitted. A slot
// admitted is nobody else's until its fill is queued.
#include "copy_kernel.h"
#include "driver.h"
#include "engine.h"
#include "joiner.h"
#include "moecache/cuda/copy_plan.h"
#include "registrations.h"

#include <unistd.h>

#include <algorithm>

namespace moecache::cuda::hook {
namespace {

// On the runtime thread's stack (about 28 KiB): a copy of more experts passes through as it is.
constexpr uint32_t kMaxSlices = 512 + 1;  // experts of a copy, and the head of the next one
constexpr size_t kMaxPieces = kMaxSlices + 1;  // pool pieces are one a slice, host runs merge between them
constexpr size_t kMaxAdmits = 512;
constexpr uint64_t kLargeCopy = 1 << 20;      // a copy this large from unmapped memory may be a model
constexpr size_t kMinStaged = 256 << 10;      // smaller host pieces go the driver's way

CUstream effective_stream(const HostToDeviceCopy& c) {
    return c.per_thread && c.stream == nullptr ? CU_STREAM_PER_THREAD : c.stream;
}

// The run of copies of one expert tensor that this thread is making (a runtime copies a decode
// step's experts of one tensor one group after another, nothing else between them on its stream),
// for copies ahead.
struct CopyRun {
    CUstream stream = nullptr;
    int device = -1;
    uint32_t model = UINT32_MAX, tensor = UINT32_MAX;  // tensor: its index within the layer
    int32_t ls = -1;
    uint64_t readback = 0;  // the thread's read-backs before it: a new one is another step's run
    CUdeviceptr base = 0;   // where the run's first copy puts expert 0, laid out as the host tensor
    uint32_t calls = 0;
    bool mirrored = true;  // every copy of the run so far put its slices where `base` says
    // Slices queued ahead and not asked for yet: the expert, the slot read, and the bytes after
    // the slice that came with it (the next slice's head, the runtime's padding).
    struct Ahead {
        uint32_t expert;
        uint64_t slot;
        uint64_t padding;
    };
    std::vector<Ahead> ahead;
};
thread_local CopyRun t_run;

}  // namespace

// After a copy queued work on pool slots: the stream is dirty (another stream must order after it),
// or, for a per-thread default stream, recorded now by its own thread.
void Engine::settle(DevicePool& dp, const Driver* drv, StreamId sid) {
    dp.mark_dirty(sid);
    auto& st = dp.streams[sid - 1];
    if (!st.eager) return;
    if (st.event == nullptr && drv->event_create(&st.event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return;
    if (drv->event_record(st.event, st.handle) == CUDA_SUCCESS) st.dirty = false;
}

CUresult Engine::copy_in_device(const DevicePool& dp, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) {
    const Driver* drv = driver();
    if (dp.copy_fn != nullptr) {
        const CUresult r = launch_copy(drv, dp.copy_fn, dst, src, bytes, stream);
        if (r == CUDA_SUCCESS) {
            kernel_copies_.fetch_add(1, std::memory_order_relaxed);
            return r;
        }
        // Unaligned, or a context the kernel was not loaded into: the driver's copy.
    }
    return drv->memcpy_dtod_async(dst, src, bytes, stream);
}

// The same for a copy the runtime asked for (a hit, an admission's fill), its launch timed for the
// log (the background thread's fills ahead are not the runtime's time).
CUresult Engine::copy_for_runtime(const DevicePool& dp, CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                                  CUstream stream) {
    if (!cfg_.log) return copy_in_device(dp, dst, src, bytes, stream);
    const uint64_t t0 = now_ns();
    const CUresult r = copy_in_device(dp, dst, src, bytes, stream);
    add_phase(kLaunch, now_ns() - t0);
    return r;
}

// Through the staging buffers where they are faster (measured when the pool was made) or where the
// bytes are not all in the page cache (read from the file, not faulted in through the mapping).
CUresult Engine::copy_from_host(DevicePool& dp, CUdeviceptr dst, const HostBytes& src, size_t bytes, CUstream stream) {
    const Driver* drv = driver();
    if (bytes >= kMinStaged && dp.staging != nullptr &&
        (dp.staged.load(std::memory_order_acquire) || !resident(src.src, bytes))) {
        uint64_t staged = 0;
        const CUresult r = dp.staging->copy(dst, src, bytes, stream, &staged);
        bytes_staged_.fetch_add(staged, std::memory_order_relaxed);
        return r;
    }
    return htod_in_pieces(drv, dst, src.src, bytes, stream);
}

// The host's bytes [offset, offset + bytes) of a copy whose slices start at `first_expert`. With
// the registered tier (auto, register) a registered slice's page-aligned inside goes straight from the registered pages
// (the device reads it at DMA speed, nothing waits for a memcpy), its edges and every other slice
// the usual way. Without a daemon a slice not registered yet is asked for (the background thread
// registers it); with one, the daemon's locks choose.
CUresult Engine::copy_slices_from_host(DevicePool& dp, Model& m, int32_t ls, uint32_t tensor, uint32_t first_expert,
                                       uint64_t slice_bytes, CUdeviceptr dst, const HostBytes& from, uint64_t offset,
                                       uint64_t bytes, CUstream stream) {
    const uint8_t* src = from.src;
    if (!cfg_.registers()) return copy_from_host(dp, dst + offset, from.at(offset), bytes, stream);
    // What misses ask for: with a daemon, nothing (its locks choose); registering ahead, the runs
    // of what missed first; PIN=register, each slice that missed. auto when the budget cannot hold
    // the model and no daemon is there registers nothing: slices pinned in the order they first
    // missed are no hot set, and they would squeeze the page cache that the rest is read through.
    const bool asks = !follow_locks_.load(std::memory_order_relaxed) &&
                      (cfg_.pin == PinMode::Register || ahead_.load(std::memory_order_relaxed));
    const Driver* drv = driver();
    const uint64_t page = 4096;
    // Bytes [run, direct_lo) go the usual way, [direct_lo, direct_hi) straight from registered
    // pages; each is queued when the next piece does not continue it.
    uint64_t run = offset, direct_lo = offset, direct_hi = offset;
    CUresult r = CUDA_SUCCESS;
    auto direct = [&](uint64_t lo, uint64_t hi) {
        if (hi <= lo) return;
        if (lo == direct_hi && direct_hi > direct_lo) {  // continues the registered run
            direct_hi = hi;
            run = hi;
            return;
        }
        if (r == CUDA_SUCCESS && direct_hi > direct_lo) r = htod_in_pieces(drv, dst + direct_lo, src + direct_lo, direct_hi - direct_lo, stream);
        if (r == CUDA_SUCCESS && lo > run) r = copy_from_host(dp, dst + run, from.at(run), lo - run, stream);
        direct_lo = lo;
        direct_hi = hi;
        run = hi;
    };
    for (uint64_t at = offset; at < offset + bytes && r == CUDA_SUCCESS;) {
        const uint64_t k = at / slice_bytes;
        const uint64_t s0 = k * slice_bytes, s1 = s0 + slice_bytes;
        const uint32_t e = first_expert + static_cast<uint32_t>(k);
        if (e >= m.map.n_experts) break;  // past the tensor: the usual way
        auto& flag = m.registered[m.slice(ls, tensor, e)];
        const uint8_t state = flag.load(std::memory_order_acquire);
        if (s1 > offset + bytes) {  // the padding, the next slice's head: with the run when registered
            if (state == Model::kWhole) direct(s0, offset + bytes);
            break;
        }
        if (state == Model::kWhole) {
            direct(s0, s1);
        } else if (state == Model::kInside) {
            const auto a = reinterpret_cast<uintptr_t>(src + s0), b = reinterpret_cast<uintptr_t>(src + s1);
            // As slice_pages: a slice that starts on a page boundary keeps its first page out.
            direct(((a + page) & ~(page - 1)) - reinterpret_cast<uintptr_t>(src), (b & ~(page - 1)) - reinterpret_cast<uintptr_t>(src));
        } else if (state == Model::kNone && asks) {
            uint8_t expected = Model::kNone;
            if (flag.compare_exchange_strong(expected, Model::kAsked)) {
                std::lock_guard lock(wanted_mu_);
                wanted_.emplace_back(m.id, m.slice(ls, tensor, e));
            }
        }
        at = s1;
    }
    if (r == CUDA_SUCCESS && direct_hi > direct_lo) r = htod_in_pieces(drv, dst + direct_lo, src + direct_lo, direct_hi - direct_lo, stream);
    if (r == CUDA_SUCCESS && offset + bytes > run) r = copy_from_host(dp, dst + run, from.at(run), offset + bytes - run, stream);
    return r;
}

// A device the runtime copies a model's bytes to gets a pool (by the background thread).
void Engine::want_pool(int device) {
    if ((devices_wanted_.fetch_or(uint64_t{1} << device) >> device & 1) == 0) {
        const uint64_t one = 1;
        (void)!write(wake_fd_, &one, sizeof one);
    }
}

// The same from a copy of a model's bytes that are not experts (its attention and dense weights,
// while it loads): a process with one device makes the pool for every expert then, and the daemon
// directs and fills it before the first prompt copies an expert.
void Engine::want_pool_here() {
    const Driver* drv = driver();
    CUdevice device = 0;
    if (drv == nullptr || drv->ctx_get_device(&device) != CUDA_SUCCESS || device < 0 || device >= kMaxDevices) return;
    if (pools_[device].load(std::memory_order_acquire) == nullptr) want_pool(device);
}

bool Engine::serve(const HostToDeviceCopy& c, CUresult* result) {
    const uint64_t t0 = now_ns();
    const bool served = serve_copy(c, result);
    serve_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    return served;
}

// One expert copy being served: what serve_copy's steps share.
struct Engine::Serving {
    struct Admit {
        SliceRef ref;
        uint64_t offset;
    };
    const HostToDeviceCopy& c;
    const Snapshot* snap = nullptr;
    ExpertCopy cls{};
    Model* m = nullptr;
    int32_t ls = -1;       // the layer's slot in the model
    bool routing = false;  // a routing decision, not a weight upload
    bool batch = false;    // a batch of many tokens (a prompt): fills free slots, displaces nothing
    const Driver* drv = nullptr;
    CUstream stream = nullptr;
    CUdevice device = 0;
    DevicePool* dp = nullptr;
    uint32_t nexp = 0, n_slices = 0, tensor_id = 0;
    bool pad_next = false;
    bool run_first = false;  // the first copy of a run of one tensor's copies (copies ahead)
    bool ahead = false;      // ... whose hits and the rest of the run's go in launches of several
    bool launched = false;   // a launch of several read pool slots: the stream is to be settled
    // Ranges queued for the next such launch, the expert each is ahead for (UINT32_MAX: this
    // copy's own) and the padding after it.
    CopyRange ranges[kCopyKernelNRanges];
    uint32_t range_expert[kCopyKernelNRanges];
    uint64_t range_padding[kCopyKernelNRanges];
    unsigned n_ranges = 0;
    StreamId sid = 0;
    uint64_t from_slot[kMaxSlices];  // nonzero: queued from a pool slot (this device's or a peer's)
    // kMaxAdmits of them, made by serve_copy once the copy is one to serve (constructing them costs
    // a copy the hook passes through three times the rest of its work).
    Admit* admits = nullptr;
    uint32_t n_admits = 0, hit_slices = 0, peer_slices = 0, missed = 0;
    CUresult rc = CUDA_SUCCESS;
    uint64_t from_pool = 0, from_peers = 0, from_host = 0, n_calls = 0, joins = 0;

    explicit Serving(const HostToDeviceCopy& copy) : c(copy) {}
    // Slice i of the copy (i == n_experts: the padding, when it is the head of the next slice).
    [[nodiscard]] SliceRef ref_of(uint32_t i) const {
        const uint32_t e = cls.first_expert + i;
        return SliceRef{m->id, m->slice(ls, cls.tensor, e), m->expert(ls, e)};
    }
    [[nodiscard]] uint64_t piece_bytes(uint32_t i) const { return i < cls.n_experts ? cls.slice_bytes : cls.padding; }
};

// An expert copy the runtime makes to a device (llama.cpp's -ot exps=CPU offload), served in steps
// (each always inlined into serve_copy, their one caller: as calls they cost a served copy ~5 % more
// of the hook's own time, bench/hook-overhead.sh):
// what it is and whether it may be served here (prepare); 1. the slices this device's pool holds;
// 2. those another device's pool holds; 3. slots taken for the misses the pool admits; 4. the rest
// from the host; 5. the admitted slices committed to their slots; then the counts.
bool Engine::serve_copy(const HostToDeviceCopy& c, CUresult* result) {
    const bool timed = cfg_.log;  // where the time goes (shutdown's line): a clock read a step
    uint64_t t = timed ? now_ns() : 0;
    const auto lap = [&](Phase p) {
        if (!timed) return;
        const uint64_t now = now_ns();
        add_phase(p, now - t);
        t = now;
    };
    Serving s(c);
    const bool prepared = prepare_serving(s);
    lap(kPrepare);
    if (!prepared) return false;
    Serving::Admit admits[kMaxAdmits];
    s.admits = admits;
    serve_from_pool(s);
    if (s.missed > 0 && s.rc == CUDA_SUCCESS) serve_from_peers(s);
    joins_.fetch_add(s.joins, std::memory_order_relaxed);
    lap(kPool);
    if (s.missed > 0 && s.rc == CUDA_SUCCESS) take_admission_slots(s);
    lap(kAdmit);
    if (s.hit_slices + s.peer_slices == 0 && s.from_pool + s.from_peers == 0 && s.n_admits == 0 &&
        !s.dp->staged.load(std::memory_order_relaxed) && !cfg_.registers()) {
        // Nothing to do but the runtime's own copy.
        misses_.fetch_add(s.cls.n_experts, std::memory_order_relaxed);
        bytes_host_.fetch_add(c.bytes, std::memory_order_relaxed);
        s.dp->counters.misses.fetch_add(s.cls.n_experts, std::memory_order_relaxed);
        s.dp->counters.miss_bytes.fetch_add(c.bytes, std::memory_order_relaxed);
        if (s.routing && !s.batch) s.dp->counters.decode_misses.fetch_add(s.cls.n_experts, std::memory_order_relaxed);
        return false;
    }
    serve_from_host(s);
    lap(kHost);
    if (s.n_admits > 0) commit_admissions(s);
    lap(kAdmit);
    if (s.rc != CUDA_SUCCESS) {
        fallbacks_.fetch_add(1, std::memory_order_relaxed);
        return false;  // the runtime's own copy, issued after ours, writes every byte again
    }
    count_served(s);
    *result = c.async ? CUDA_SUCCESS : s.drv->stream_synchronize(s.stream);
    return true;
}

// What the copy is (an expert tensor's slices of a mapped model), and whether this device's pool
// may serve it now: not while the stream is captured into a graph, not before the pool exists.
[[gnu::always_inline]] inline bool Engine::prepare_serving(Serving& s) {
    const HostToDeviceCopy& c = s.c;
    s.snap = snapshot_.load(std::memory_order_acquire);
    if (s.snap == nullptr) {
        request_scan();
        return false;
    }
    const auto cls = s.snap->classifier.classify(c.src, c.bytes);
    if (!cls) {
        if (!s.snap->classifier.covers(c.src)) {
            request_scan();
            if (c.bytes >= kLargeCopy && c.dst_checked) {
                unmapped_copies_.fetch_add(1, std::memory_order_relaxed);
                unmapped_bytes_.fetch_add(c.bytes, std::memory_order_relaxed);
            }
        } else {
            want_pool_here();  // the runtime loads a model's other weights onto this device
        }
        return false;
    }
    s.cls = *cls;
    expert_copies_.fetch_add(1, std::memory_order_relaxed);
    Model& m = *s.snap->models[cls->model];
    s.m = &m;
    s.ls = cls->block < m.layer_slot.size() ? m.layer_slot[cls->block] : -1;
    if (s.ls < 0) return false;
    // A copy of every expert of a tensor is a weight upload, not a routing decision (unless the
    // runtime's read-back of its router's ids says it is one: a batch that used every expert).
    s.routing = cls->n_experts < m.map.n_experts;
    if (cls->tensor == 0) report_copy(m, *cls, s.routing);
    s.drv = driver();
    if (s.drv == nullptr) return false;
    s.stream = effective_stream(c);
    CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
    if (s.drv->stream_is_capturing(s.stream, &capture) != CUDA_SUCCESS || capture != CU_STREAM_CAPTURE_STATUS_NONE) {
        captured_.fetch_add(1, std::memory_order_relaxed);
        return false;
    }
    if (s.drv->ctx_get_device(&s.device) != CUDA_SUCCESS || s.device < 0 || s.device >= kMaxDevices) return false;
    if (!c.dst_checked) {
        CUmemorytype type{};
        int ordinal = -1;
        CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
        void* values[2] = {&type, &ordinal};
        if (s.drv->pointer_get_attributes(2, attrs, values, c.dst) != CUDA_SUCCESS || type != CU_MEMORYTYPE_DEVICE ||
            ordinal != s.device)
            return false;
    }
    s.dp = pools_[s.device].load(std::memory_order_acquire);
    if (s.dp == nullptr) {
        want_pool(s.device);
        return false;
    }
    s.nexp = m.map.n_experts;
    s.pad_next = cls->padding > 0 && cls->padding_in_tensor(m.map);
    s.n_slices = cls->n_experts + (s.pad_next ? 1 : 0);
    if (s.n_slices > kMaxSlices) return false;
    s.tensor_id = m.slice(s.ls, cls->tensor, 0) / s.nexp;  // model-local
    return true;
}

// 1. This device's pool, under its lock: the slices it holds are queued from their slots now
//    (a slot is this stream's only while the lock is held, until the stream is marked dirty).
[[gnu::always_inline]] inline void Engine::serve_from_pool(Serving& s) {
    DevicePool* dp = s.dp;
    Model& m = *s.m;
    const ExpertCopy& cls = s.cls;
    std::lock_guard lock(dp->mu);
    const StreamId sid = dp->stream_id(s.stream);
    Joiner order(*dp, s.drv, s.stream, s.device);
    // A run of copies of one layer's expert tensors (nothing else between them) is that layer's
    // routing of one batch, each tensor's copies the same experts.
    // Once one tensor's carry more than half the layer's experts (and more than one token
    // routes to), it is a batch of many tokens, a prompt: its slices fill free slots but
    // displace nothing and add no heat, so that a prompt, whose batches touch nearly every
    // expert, leaves the decoding hot set alone. A few sequences decoded together stay well
    // under that. Every tensor counts: a device may copy only some of a layer's (llama.cpp on
    // two GPUs runs the last layers' down projections on the second, the rest on the first).
    // A batch runs through every layer: the previous layer's step says what the first copies
    // of this one are, before they are many.
    auto& step = dp->step;
    if (step.model != m.id || step.layer != s.ls) step = LayerStep{m.id, s.ls, cls.tensor, 0, 0, step.most};
    if (step.tensor != cls.tensor) step.experts = 0;
    step.tensor = cls.tensor;
    step.experts += cls.n_experts;
    step.most = std::max(step.most, step.experts);
    const uint32_t wide = std::max<uint32_t>(m.map.n_experts_used, s.nexp / 2);
    // The runtime's read-back of the router's ids, where it checked out against this layer's
    // copy, says it first: a prompt's first group of its first layer can be a few experts.
    s.batch = !s.routing || readback_is_batch(m, cls.block) || cls.n_experts > wide ||
              std::max(step.most, step.before) > wide;
    if (s.batch) last_batch_ns_.store(now_ns(), std::memory_order_relaxed);
    if (m.id < dp->seen.size() && s.tensor_id < dp->seen[m.id].size() && !dp->seen[m.id][s.tensor_id]) {
        dp->seen[m.id][s.tensor_id] = 1;
        dp->seen_bytes.fetch_add(m.map.layers[static_cast<size_t>(s.ls)].tensors[cls.tensor].bytes_per_expert * s.nexp);
        const uint64_t one = 1;
        (void)!write(wake_fd_, &one, sizeof one);
    }
    if (s.routing && !s.batch) {
        for (uint32_t i = 0; i < cls.n_experts; ++i) dp->heat.touch(m.id, m.expert(s.ls, cls.first_expert + i));
        if (cls.tensor == 0) m.routed.fetch_add(cls.n_experts, std::memory_order_relaxed);
    }
    follow_run(s);
    s.ahead = s.run_first && ahead_ready(s);
    bool tail_served = false;  // the padding came with the last slice, from its slot's tail
    for (uint32_t i = 0; i < s.n_slices; ++i) {
        if (tail_served) {  // i == n_experts
            s.from_slot[i] = s.from_slot[i - 1] + cls.slice_bytes;
            s.from_pool += s.piece_bytes(i);
            continue;
        }
        bool with_padding = false;
        if (i < cls.n_experts && claim_ahead(s, i, &with_padding)) {  // queued at the run's first copy
            s.from_pool += s.piece_bytes(i);
            ++s.hit_slices;
            tail_served = s.pad_next && i + 1 == cls.n_experts && with_padding;
            continue;
        }
        uint32_t tail = 0;
        s.from_slot[i] = cls.first_expert + i < s.nexp ? dp->pool.lookup(s.ref_of(i), sid, order, &tail) : 0;
        if (s.from_slot[i] == 0) {
            s.missed += i < cls.n_experts ? 1 : 0;
            continue;
        }
        uint64_t bytes = s.piece_bytes(i);
        if (s.pad_next && i + 1 == cls.n_experts && tail >= cls.padding) {
            bytes += cls.padding;
            tail_served = true;
        }
        if (s.rc == CUDA_SUCCESS) {
            const CUdeviceptr dst = s.c.dst + uint64_t{i} * cls.slice_bytes;
            if (!s.ahead || !queue_range(s, CopyRange{dst, s.from_slot[i], bytes}, UINT32_MAX, 0))
                s.rc = copy_for_runtime(*dp, dst, s.from_slot[i], bytes, s.stream);
        }
        s.from_pool += s.piece_bytes(i);
        ++s.n_calls;
        s.hit_slices += i < cls.n_experts ? 1 : 0;
    }
    if (s.ahead) copy_ahead(s, sid, order);
    if (s.hit_slices > 0 || s.from_pool > 0 || s.launched) settle(*dp, s.drv, sid);
    s.joins += order.joins;
}

// Copies ahead. llama.cpp reads a decode step's router ids back, then copies the experts they
// name tensor by tensor, one call a group of neighbouring experts, each into the place the host
// tensor's layout gives it in a device copy of the whole tensor; a hit costs its thread a launch
// of its own (~3.3 us on an H200: 24 a layer). At a run's first copy the ids say which experts
// the rest of the run will ask for: this device's pool's hits among them are queued now, in
// launches of up to eight slices, and the runtime's later copies of them are done already (the
// same bytes, where it would have put them, on its own stream before anything it queues after).
// Only where the runtime is seen to lay its copies out that way (kMirroredRunsToTrust runs, each
// copy of a run at the place its first gives; one run otherwise, or a slice queued ahead that is
// not asked for, and never again), inside the allocation the run's first copy writes to.
void Engine::follow_run(Serving& s) {
    CopyRun& r = t_run;
    const CUdeviceptr base = s.c.dst - uint64_t{s.cls.first_expert} * s.cls.slice_bytes;
    const uint64_t readback = readback_seq();
    if (r.stream == s.stream && r.device == s.device && r.model == s.m->id && r.ls == s.ls &&
        r.tensor == s.cls.tensor && r.readback == readback) {
        ++r.calls;
        r.mirrored = r.mirrored && base == r.base;
        return;
    }
    // The run that ends: a slice queued ahead and not asked for, or a run laid out otherwise, turns
    // copies ahead off for its model; one laid out as the host tensor counts toward trusting it.
    ahead_unclaimed_.fetch_add(r.ahead.size(), std::memory_order_relaxed);
    if (Model* was = r.model < s.snap->models.size() ? s.snap->models[r.model] : nullptr) {
        if (!r.ahead.empty() || (r.calls >= 2 && !r.mirrored)) was->ahead_off.store(true, std::memory_order_relaxed);
        if (r.calls >= 2 && r.mirrored) was->mirrored_runs.fetch_add(1, std::memory_order_relaxed);
    }
    r.readback = readback;
    r.stream = s.stream;
    r.device = s.device;
    r.model = s.m->id;
    r.ls = s.ls;
    r.tensor = s.cls.tensor;
    r.base = base;
    r.calls = 1;
    r.mirrored = true;
    r.ahead.clear();
    s.run_first = true;
}

// Slice i of this copy was queued ahead: nothing to copy (with_padding: the bytes after it too).
bool Engine::claim_ahead(Serving& s, uint32_t i, bool* with_padding) {
    CopyRun& r = t_run;
    if (r.ahead.empty() || !r.mirrored) return false;
    const uint32_t e = s.cls.first_expert + i;
    for (size_t k = 0; k < r.ahead.size(); ++k)
        if (r.ahead[k].expert == e) {
            s.from_slot[i] = r.ahead[k].slot;
            *with_padding = r.ahead[k].padding >= s.cls.padding;
            r.ahead[k] = r.ahead.back();
            r.ahead.pop_back();
            return true;
        }
    return false;
}

// Whether this run's first copy can go ahead: the runtime's layout trusted, a decode step whose
// ids checked out and name this copy's group first, the run's tensor inside one allocation.
bool Engine::ahead_ready(Serving& s) {
    const ExpertCopy& cls = s.cls;
    if (!cfg_.ahead || !s.routing || s.batch || s.dp->copy_n_fn == nullptr || s.drv->mem_get_address_range == nullptr ||
        s.m->ahead_off.load(std::memory_order_relaxed) ||
        s.m->mirrored_runs.load(std::memory_order_relaxed) < kMirroredRunsToTrust)
        return false;
    const std::vector<uint32_t>* count = decode_readback(*s.m, cls.block);
    if (count == nullptr || !first_group_of(*count, cls.first_expert, cls.n_experts)) return false;
    CUdeviceptr alloc = 0;
    size_t size = 0;
    const CUdeviceptr base = t_run.base;
    return s.drv->mem_get_address_range(&alloc, &size, s.c.dst) == CUDA_SUCCESS && base >= alloc &&
           base + uint64_t{s.nexp} * cls.slice_bytes <= alloc + size;
}

// Queues a range for the next launch of several (launched when full); false where the kernel
// cannot copy it (not of 16-byte multiples) and it was not queued.
bool Engine::queue_range(Serving& s, const CopyRange& range, uint32_t expert, uint64_t padding) {
    if (((range.dst | range.src | range.bytes) & 15) != 0 || range.bytes == 0) return false;
    s.ranges[s.n_ranges] = range;
    s.range_expert[s.n_ranges] = expert;
    s.range_padding[s.n_ranges] = padding;
    if (++s.n_ranges == kCopyKernelNRanges) launch_ranges(s);
    return true;
}

// One launch for the ranges queued. Those ahead are the run's to claim once it is queued; where it
// is refused this copy's own are the runtime's to copy again (a fallback), and those ahead are not.
void Engine::launch_ranges(Serving& s) {
    if (s.n_ranges == 0) return;
    const uint64_t t0 = cfg_.log ? now_ns() : 0;
    const CUresult r = launch_copies(s.drv, s.dp->copy_n_fn, s.ranges, s.n_ranges, s.stream);
    if (cfg_.log) add_phase(kLaunch, now_ns() - t0);
    if (r == CUDA_SUCCESS) {
        s.launched = true;
        kernel_copies_.fetch_add(1, std::memory_order_relaxed);
        for (unsigned k = 0; k < s.n_ranges; ++k)
            if (s.range_expert[k] != UINT32_MAX) {
                t_run.ahead.push_back(CopyRun::Ahead{s.range_expert[k], s.ranges[k].src, s.range_padding[k]});
                copied_ahead_.fetch_add(1, std::memory_order_relaxed);
            }
    } else {
        // Refused (a context the kernel was not loaded into, say): this copy's own pieces each the
        // usual way, and no more launches of several for this model.
        s.m->ahead_off.store(true, std::memory_order_relaxed);
        for (unsigned k = 0; k < s.n_ranges && s.rc == CUDA_SUCCESS; ++k)
            if (s.range_expert[k] == UINT32_MAX)
                s.rc = copy_for_runtime(*s.dp, s.ranges[k].dst, s.ranges[k].src, s.ranges[k].bytes, s.stream);
    }
    s.n_ranges = 0;
}

// This device's hits among the rest of the run's ids, queued with this copy's own.
void Engine::copy_ahead(Serving& s, StreamId sid, Joiner& order) {
    const ExpertCopy& cls = s.cls;
    const std::vector<uint32_t>& count = *decode_readback(*s.m, cls.block);
    const CUdeviceptr base = t_run.base;
    for (uint32_t e = cls.first_expert + cls.n_experts + 1; e < s.nexp && s.rc == CUDA_SUCCESS; ++e) {
        if (count[e] == 0) continue;
        uint32_t tail = 0;
        const uint64_t slot = s.dp->pool.lookup(
            SliceRef{s.m->id, s.m->slice(s.ls, cls.tensor, e), s.m->expert(s.ls, e)}, sid, order, &tail);
        if (slot == 0) continue;
        // The runtime's padding after the slice (the next one's head) where the slot keeps it.
        const uint64_t padding = cls.padding > 0 && e + 1 < s.nexp && tail >= cls.padding ? cls.padding : 0;
        (void)queue_range(s, CopyRange{base + uint64_t{e} * cls.slice_bytes, slot, cls.slice_bytes + padding}, e,
                          padding);
    }
    launch_ranges(s);
}

// 2. Other devices' pools, one lock at a time: what this device missed may be pooled there.
[[gnu::always_inline]] inline void Engine::serve_from_peers(Serving& s) {
    const ExpertCopy& cls = s.cls;
    CUcontext mine = nullptr;
    const uint64_t peers = s.dp->peers.load(std::memory_order_relaxed);
    if (peers == 0 || s.drv->ctx_get_current(&mine) != CUDA_SUCCESS || mine == nullptr) return;
    for (int p = 0; p < kMaxDevices && s.missed > 0 && s.rc == CUDA_SUCCESS; ++p) {
        DevicePool* peer = (peers >> p & 1) != 0 ? pools_[p].load(std::memory_order_acquire) : nullptr;
        if (peer == nullptr) continue;
        std::lock_guard lock(peer->mu);
        // A pool holds only slices of tensors its device copies: none of this one, no lookups.
        if (s.m->id >= peer->seen.size() || s.tensor_id >= peer->seen[s.m->id].size() ||
            !peer->seen[s.m->id][s.tensor_id])
            continue;
        const StreamId sid = peer->stream_id(s.stream, s.device);
        Joiner order(*peer, s.drv, s.stream, s.device);
        uint32_t here = 0;
        for (uint32_t i = 0; i < s.n_slices && s.rc == CUDA_SUCCESS; ++i) {
            if (s.from_slot[i] != 0 || cls.first_expert + i >= s.nexp) continue;
            const SliceRef ref = s.ref_of(i);
            peer->counters.peer_lookups.fetch_add(1, std::memory_order_relaxed);
            const uint64_t a = peer->pool.lookup(ref, sid, order);
            if (a == 0) continue;
            s.rc = s.drv->memcpy_peer_async(s.c.dst + uint64_t{i} * cls.slice_bytes, mine, a, peer->ctx,
                                            s.piece_bytes(i), s.stream);
            s.from_slot[i] = a;
            s.from_peers += s.piece_bytes(i);
            ++s.n_calls;
            ++here;
            if (i < cls.n_experts) {
                --s.missed;
                ++s.peer_slices;
                if (s.routing && !s.batch) peer->heat.touch(s.m->id, ref.expert);
            }
        }
        if (here > 0) settle(*peer, s.drv, sid);
        s.joins += order.joins;
    }
}

// 3. What no pool holds comes from the host, and is admitted into this device's pool from where it
//    lands: slots taken under the lock (here), the host's bytes copied without it (serve_from_host),
//    the slots filled under it again (commit_admissions).
[[gnu::always_inline]] inline void Engine::take_admission_slots(Serving& s) {
    DevicePool* dp = s.dp;
    const ExpertCopy& cls = s.cls;
    std::lock_guard lock(dp->mu);
    s.sid = dp->stream_id(s.stream);
    Joiner order(*dp, s.drv, s.stream, s.device);
    // Under one place a slice the pool lets go is read from storage again when next wanted: only
    // what the daemon promoted (its ranking holds still) displaces anything. Once the daemon
    // directs the model's pool, only what it promoted is admitted at all, in decode as in a
    // prompt's batch (which carries nearly every expert and displaces nothing): the rest are
    // RAM's (the daemon locks them), and a free slot one of them took would leave RAM for the
    // pool and be taken back by the next promoted expert, sending it to storage (the prompt-model
    // swap on the GPU machine: 2 031 slices admitted in 128 tokens of decode, 7 GB read back).
    // Before the daemon directs, misses take free slots.
    const bool one_place = dp->one_place.load(std::memory_order_relaxed);
    const bool directed = one_place && s.m->n_promoted.load(std::memory_order_relaxed) > 0;
    for (uint32_t i = 0; i < cls.n_experts && s.n_admits < kMaxAdmits; ++i) {
        if (s.from_slot[i] != 0 || cls.first_expert + i >= s.nexp) continue;
        const SliceRef ref = s.ref_of(i);
        SliceRef evicted;
        const bool promoted = dp->heat.heat(ref.model, ref.expert) >= ExpertHeat::kPromoted;
        if (directed && !promoted) continue;
        const bool evict = !s.batch && (!one_place || promoted);
        if (dp->pool.admit(ref, cls.slice_bytes, s.sid, dp->heat, order, &evicted, evict) == 0) continue;
        s.admits[s.n_admits++] = {ref, uint64_t{i} * cls.slice_bytes};
        if (evicted.model != kNoSlot && evicted.model < s.snap->models.size())
            note_expert(*dp, *s.snap->models[evicted.model], evicted.expert);
    }
    joins_.fetch_add(order.joins, std::memory_order_relaxed);
}

// 4. The pieces no pool served, from the host (registered pages, staging, or pageable memory).
[[gnu::always_inline]] inline void Engine::serve_from_host(Serving& s) {
    const ExpertCopy& cls = s.cls;
    Model& m = *s.m;
    CopyPiece pieces[kMaxPieces];
    const size_t n_pieces = plan_copy(
        cls.n_experts, cls.slice_bytes, cls.padding, s.pad_next,
        [&](uint32_t i) { return i < s.n_slices ? s.from_slot[i] : 0; }, pieces, kMaxPieces);
    if (n_pieces == 0 && s.rc == CUDA_SUCCESS)
        s.rc = CUDA_ERROR_INVALID_VALUE;  // cannot happen: at most 2 pieces a slice
    const auto* src = static_cast<const uint8_t*>(s.c.src);
    for (size_t p = 0; p < n_pieces && s.rc == CUDA_SUCCESS; ++p)
        if (pieces[p].pool_address == 0) {
            s.rc =
                copy_slices_from_host(*s.dp, m, s.ls, cls.tensor, cls.first_expert, cls.slice_bytes, s.c.dst,
                                      HostBytes{src, cls.file < m.fds.size() ? m.fds[cls.file] : -1, cls.file_offset},
                                      pieces[p].offset, pieces[p].bytes, s.stream);
            s.from_host += pieces[p].bytes;
            ++s.n_calls;
        }
}

// 5. The admitted slices into their slots, from where the copy put them on the device.
[[gnu::always_inline]] inline void Engine::commit_admissions(Serving& s) {
    DevicePool* dp = s.dp;
    const ExpertCopy& cls = s.cls;
    std::lock_guard lock(dp->mu);
    const uint32_t tail_room = dp->pool.tail_room(cls.slice_bytes);
    for (uint32_t i = 0; i < s.n_admits; ++i) {
        if (s.rc != CUDA_SUCCESS) {
            dp->pool.drop(s.m->id, s.admits[i].ref.slice);
            continue;
        }
        // What follows the slice in this copy is the next slice's head: the slot keeps it too.
        const uint64_t after = s.admits[i].offset + cls.slice_bytes;
        const uint64_t follows = after < uint64_t{cls.n_experts} * cls.slice_bytes ? cls.slice_bytes
                                 : s.pad_next                                      ? cls.padding
                                                                                   : 0;
        const auto tail = static_cast<uint32_t>(std::min<uint64_t>(follows, tail_room));
        const uint64_t slot = dp->pool.commit(s.admits[i].ref, tail);
        if (slot == 0) continue;  // taken away meanwhile (the pool shrank or yielded)
        s.rc = copy_for_runtime(*dp, slot, s.c.dst + s.admits[i].offset, cls.slice_bytes + tail, s.stream);
        ++s.n_calls;
        if (s.rc != CUDA_SUCCESS) dp->pool.drop(s.m->id, s.admits[i].ref.slice);
    }
    for (uint32_t i = 0; i < s.n_admits; ++i) note_expert(*dp, *s.m, s.admits[i].ref.expert);
    settle(*dp, s.drv, s.sid);
}

// The counts of a served copy: the hook's, and its device pool's.
[[gnu::always_inline]] inline void Engine::count_served(Serving& s) {
    DevicePool* dp = s.dp;
    const uint32_t n = s.cls.n_experts;
    const uint32_t hits = s.hit_slices + s.peer_slices;
    served_.fetch_add(1, std::memory_order_relaxed);
    pieces_.fetch_add(s.n_calls, std::memory_order_relaxed);
    hits_.fetch_add(hits, std::memory_order_relaxed);
    misses_.fetch_add(n - hits, std::memory_order_relaxed);
    peer_hits_.fetch_add(s.peer_slices, std::memory_order_relaxed);
    bytes_pool_.fetch_add(s.from_pool + s.from_peers, std::memory_order_relaxed);
    bytes_peer_.fetch_add(s.from_peers, std::memory_order_relaxed);
    bytes_host_.fetch_add(s.from_host, std::memory_order_relaxed);
    dp->counters.hits.fetch_add(hits, std::memory_order_relaxed);
    dp->counters.misses.fetch_add(n - hits, std::memory_order_relaxed);
    if (s.routing && !s.batch) {
        dp->counters.decode_hits.fetch_add(hits, std::memory_order_relaxed);
        dp->counters.decode_misses.fetch_add(n - hits, std::memory_order_relaxed);
        dp->counters.decode_admits.fetch_add(s.n_admits, std::memory_order_relaxed);
    }
    dp->counters.hit_bytes.fetch_add(s.from_pool + s.from_peers, std::memory_order_relaxed);
    dp->counters.miss_bytes.fetch_add(s.from_host, std::memory_order_relaxed);
}

}  // namespace moecache::cuda::hook
