// A device's VRAM pool: its size (the experts of the layers this device copies, within the
// settings, the daemon's budget and free memory less a reserve), its arenas, the streams that
// queue work on its slots, and giving memory back to the runtime.
#include "capture_gate.h"
#include "copy_kernel.h"
#include "driver.h"
#include "engine.h"
#include "log.h"
#include "moecache/client.h"

#include <unistd.h>

#include <algorithm>

namespace moecache::cuda::hook {
namespace {
// The context synchronised, never while a runtime captures a graph (capture_gate.h).
bool sync_context_gated(const Driver* drv) {
    CUresult r = CUDA_ERROR_UNKNOWN;
    capture_gate().exclusive([&] { r = drv->ctx_synchronize(); });
    return r == CUDA_SUCCESS;
}
}  // namespace
namespace {

constexpr uint64_t kArenaBytes = 1ull << 30;

}  // namespace

namespace {

// How a pool names a stream in its table: the per-thread default stream is one stream per thread
// under one handle (each thread's is a stream of its own here), and a stream of another device
// (a peer reading this pool) is told apart from this device's by that device's number.
CUstream stream_key(CUstream s, int from) {
    static thread_local const auto tid = static_cast<uintptr_t>(gettid());
    auto key = s == CU_STREAM_PER_THREAD ? ~(tid << 4) : reinterpret_cast<uintptr_t>(s);
    if (from >= 0) key ^= static_cast<uintptr_t>(from + 1) << 56;
    return reinterpret_cast<CUstream>(key);
}

}  // namespace

// Only its own thread can record on a per-thread default stream, and only the reading device's
// context makes events for a peer's stream: both are recorded eagerly, after their own slot work.
StreamId Engine::DevicePool::stream_id(CUstream s, int from) {
    auto [it, inserted] = stream_ids.try_emplace(stream_key(s, from), 0);
    if (inserted) {
        streams.push_back(StreamState{s});
        streams.back().eager = s == CU_STREAM_PER_THREAD || from >= 0;
        it->second = streams.size();
    }
    return it->second;
}

void Engine::DevicePool::mark_dirty(StreamId id) {
    auto& st = streams[id - 1];
    st.dirty = true;
    st.idle = false;
}

// The runtime is about to destroy `stream`: what it queued on pool slots is recorded in its event
// now (a later stream orders after that), and its handle, which a new stream may get, names
// another stream from here on.
void Engine::on_stream_destroy(CUstream stream) {
    const Driver* drv = driver();
    if (drv == nullptr) return;
    for (auto& slot : pools_) {
        DevicePool* dp = slot.load(std::memory_order_acquire);
        if (dp == nullptr) continue;
        std::lock_guard lock(dp->mu);
        // This device's stream, or another device's that read this pool (eager: recorded already).
        for (int from = -1; from < kMaxDevices; ++from) {
            if (from == dp->device) continue;
            auto it = dp->stream_ids.find(stream_key(stream, from));
            if (it == dp->stream_ids.end()) continue;
            auto& st = dp->streams[it->second - 1];
            if (st.dirty) {
                DeviceContext ctx(drv, dp->device);
                if (st.event == nullptr) (void)drv->event_create(&st.event, CU_EVENT_DISABLE_TIMING);
                const CUresult r = st.event != nullptr ? drv->event_record(st.event, stream) : CUDA_ERROR_INVALID_HANDLE;
                if (r == CUDA_SUCCESS) {
                    st.dirty = false;
                } else if (drv->stream_synchronize(stream) == CUDA_SUCCESS || sync_context_gated(drv)) {
                    // Seen on a second GPU: the record refused while the runtime tore its context
                    // down. Waiting once here beats slots that no later stream could take over.
                    st.dirty = false;
                    st.idle = true;
                    if (cfg_.log && !told_destroy_.exchange(true))
                        say("device %d: recording a stream being destroyed failed (CUDA error %d); waited for it instead",
                            dp->device, static_cast<int>(r));
                }
            }
            st.retired = true;
            st.handle = nullptr;
            dp->stream_ids.erase(it);
        }
    }
}

// The process has one device and a daemon that directs its pool: the pool is sized for every
// expert now (sole), not as the copies show them. Only for a daemon that can direct it: a pool no
// expert copy ever comes to (a runtime that keeps its experts in VRAM itself) would hold VRAM for
// nothing until it yields. Background thread.
void Engine::size_for_every_expert(DevicePool& dp) {
    if (dp.sole || !dp.one_device || client_ == nullptr) return;
    int one_place = 0;
    if (moecache_client_vram_policy(client_, static_cast<uint32_t>(dp.device), nullptr, &one_place) != 1) return;
    std::lock_guard lock(dp.mu);
    dp.sole = true;
    for (const Model* m : models_) see_every_tensor(dp, *m);
}

// Every expert tensor of the model counted as copied to this device (under dp.mu), as the copy
// path counts one it sees for the first time.
void Engine::see_every_tensor(DevicePool& dp, const Model& m) {
    if (m.id >= dp.seen.size()) return;
    for (size_t ls = 0; ls < m.map.layers.size(); ++ls)
        for (size_t ti = 0; ti < m.map.layers[ls].tensors.size(); ++ti) {
            const uint32_t id = m.slice(static_cast<int32_t>(ls), static_cast<uint32_t>(ti), 0) / m.map.n_experts;
            if (id >= dp.seen[m.id].size() || dp.seen[m.id][id]) continue;
            dp.seen[m.id][id] = 1;
            dp.seen_bytes.fetch_add(m.map.layers[ls].tensors[ti].bytes_per_expert * m.map.n_experts);
        }
}

void Engine::add_model_to(DevicePool& dp, const Model& m) {
    dp.pool.add_model(m.id, m.n_slices, m.n_experts);
    dp.heat.add_model(m.id, m.n_experts);
    dp.heat.set_recent_window(m.id, m.map.n_experts_used * static_cast<uint32_t>(m.map.layers.size()));
    if (m.prior.size() == m.n_experts)  // the last run's hot set ranks first until this run's routing moves it
        for (uint32_t e = 0; e < m.n_experts; ++e)
            if (m.prior[e] > 0) dp.heat.set(m.id, e, m.prior[e]);
    if (dp.full.size() <= m.id) dp.full.resize(m.id + 1);
    dp.full[m.id].assign(m.n_experts, 0);
    if (dp.seen.size() <= m.id) dp.seen.resize(m.id + 1);
    dp.seen[m.id].assign(m.n_slices / std::max<uint32_t>(m.map.n_experts, 1), 0);
    if (dp.sole) see_every_tensor(dp, m);
}

bool Engine::allocate_pool(int device) {
    if (driver() == nullptr || models_.empty()) return false;
    auto* dp = new DevicePool;
    dp->device = device;
    dp->made_ns = now_ns();
    int devices = 0;
    dp->one_device = driver()->device_get_count != nullptr && driver()->device_get_count(&devices) == CUDA_SUCCESS && devices == 1;
    if (driver()->primary_ctx_retain(&dp->ctx, device) != CUDA_SUCCESS) dp->ctx = nullptr;
    {
        std::lock_guard lock(dp->mu);
        for (const auto* m : models_) add_model_to(*dp, *m);
    }
    set_up_copies(*dp);
    if (cfg_.copy_kernel) {
        DeviceContext ctx(driver(), device);
        CopyKernel k;
        if (ctx.ok() && load_copy_kernel(driver(), &k, cfg_.ahead)) {
            dp->copy_fn = k.function;
            dp->copy_n_fn = k.function_n;
            if (cfg_.ahead && k.function_n == nullptr && cfg_.log)
                say("device %d: the copy kernel's several-range form did not load or copied wrong on scratch memory; "
                    "no copies ahead (each pool hit its own launch)",
                    device);
            dp->copy_module = k.module;
        } else if (cfg_.log) {
            say("device %d: the copy kernel did not load; pool hits are the driver's copies", device);
        }
    }
    pools_[device].store(dp, std::memory_order_release);
    resize_pool(*dp);
    connect_peers(*dp);
    return true;
}

// A device's copies may read another device's pool (a slot there is one copy over NVLink or PCIe
// away, where the host's bytes are one PCIe copy at best): with peer access enabled both ways, so
// that the copy engines move the bytes directly. The runtime may have enabled it already, which is
// no failure. Several GPUs then hold one pool between them: llama.cpp runs the expert products of
// host-resident weights on its first GPU for every layer, and that GPU finds the experts the
// others pooled.
void Engine::connect_peers(DevicePool& dp) {
    const Driver* drv = driver();
    if (!cfg_.peers || drv->device_can_access_peer == nullptr || drv->ctx_enable_peer_access == nullptr ||
        drv->memcpy_peer_async == nullptr || dp.ctx == nullptr)
        return;
    auto enable = [&](int from, CUcontext peer_ctx) {
        DeviceContext ctx(drv, from);
        if (!ctx.ok()) return false;
        const CUresult r = drv->ctx_enable_peer_access(peer_ctx, 0);
        return r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED;
    };
    for (auto& slot : pools_) {
        DevicePool* other = slot.load(std::memory_order_acquire);
        if (other == nullptr || other == &dp || other->ctx == nullptr) continue;
        int there = 0, back = 0;
        if (drv->device_can_access_peer(&there, dp.device, other->device) != CUDA_SUCCESS || there == 0 ||
            drv->device_can_access_peer(&back, other->device, dp.device) != CUDA_SUCCESS || back == 0) {
            if (cfg_.log) say("devices %d and %d: no peer access; each reads its own pool only", dp.device, other->device);
            continue;
        }
        if (!enable(dp.device, other->ctx) || !enable(other->device, dp.ctx)) {
            say("devices %d and %d: enabling peer access failed; each reads its own pool only", dp.device, other->device);
            continue;
        }
        dp.peers.fetch_or(uint64_t{1} << other->device);
        other->peers.fetch_or(uint64_t{1} << dp.device);
        if (cfg_.log) say("devices %d and %d read each other's pools", dp.device, other->device);
    }
}

uint64_t Engine::pool_target(const DevicePool& dp, uint64_t experts) const {
    const PoolSize& size = cfg_.pool.of(dp.device);
    uint64_t budget = experts;
    if (size.kind == PoolSize::Kind::Percent)
        budget = static_cast<uint64_t>(static_cast<double>(experts) * size.value / 100.0);
    if (size.kind == PoolSize::Kind::Bytes) budget = std::min(experts, static_cast<uint64_t>(size.value));
    if (dp.bg.daemon_budget != 0) budget = std::min(budget, dp.bg.daemon_budget - 1);
    return budget;
}

void Engine::note_all(DevicePool& dp) {
    for (const Model* m : models_)
        for (uint32_t e = 0; e < m->n_experts; ++e) note_expert(dp, *m, e);
}

// Frees arenas the pool gave up, once the device has finished what it queued on them.
void Engine::free_arenas(DevicePool& dp, const std::vector<uint64_t>& bases) {
    if (bases.empty()) return;
    const Driver* drv = driver();
    capture_gate().exclusive([&] {
        (void)drv->ctx_synchronize();
        for (auto b : bases) (void)drv->mem_free(b);
    });
    std::lock_guard lock(dp.mu);
    for (auto b : bases) dp.arenas.erase(std::remove(dp.arenas.begin(), dp.arenas.end(), b), dp.arenas.end());
    dp.bytes.store(dp.pool.stats().bytes);
}

// Grows or shrinks a device's pool to its target. Slots of each size get the share of the target
// that their expert tensors have of the expert bytes of the layers this device copies.
void Engine::resize_pool(DevicePool& dp) {
    const Driver* drv = driver();
    if (drv == nullptr) return;
    ++fill_gen_;  // room, or tensors, a fill may now use
    DeviceContext ctx(drv, dp.device);
    if (!ctx.ok()) return;
    // Slot bytes, and the room experts of that size take (each slice with its slot's tail room).
    std::vector<std::pair<uint64_t, uint64_t>> classes;
    uint64_t expert_bytes = 0, expert_room = 0, experts = 0;  // experts: of the layers it copies
    {
        std::lock_guard lock(dp.mu);
        for (const auto* m : models_)
            for (size_t ls = 0; ls < m->map.layers.size(); ++ls) {
                bool counted = false;
                for (size_t ti = 0; ti < m->map.layers[ls].tensors.size(); ++ti) {
                    const uint32_t id = m->slice(static_cast<int32_t>(ls), static_cast<uint32_t>(ti), 0) / m->map.n_experts;
                    if (m->id >= dp.seen.size() || id >= dp.seen[m->id].size() || !dp.seen[m->id][id]) continue;
                    if (!counted) experts += m->map.n_experts;
                    counted = true;
                    const auto& t = m->map.layers[ls].tensors[ti];
                    const uint64_t b = (t.bytes_per_expert + kSlotTail) * m->map.n_experts;
                    expert_bytes += t.bytes_per_expert * m->map.n_experts;
                    expert_room += b;
                    auto it = std::find_if(classes.begin(), classes.end(),
                                           [&](auto& c) { return c.first == t.bytes_per_expert; });
                    if (it == classes.end()) classes.emplace_back(t.bytes_per_expert, b);
                    else it->second += b;
                }
            }
    }
    dp.sized_for.store(expert_bytes);
    const uint64_t target = pool_target(dp, expert_room);
    dp.target.store(std::max<uint64_t>(target, 1));
    // Whole arenas go; what that gives back beyond the target is allocated again below.
    if (dp.bytes > target) {
        std::vector<uint64_t> bases;
        {
            std::lock_guard lock(dp.mu);
            bases = dp.pool.release(dp.bytes - target, dp.heat);
            note_all(dp);
        }
        free_arenas(dp, bases);
    }
    size_t free_bytes = 0, total_bytes = 0;
    (void)drv->mem_get_info(&free_bytes, &total_bytes);
    const uint64_t before = dp.bytes;
    if (dp.bytes < target) {
        // A claimed pool's room was kept from the runtime's own sizing (llama.cpp's --fit leaves it
        // free, with a margin of its own): only a small reserve here. Otherwise room for what the
        // runtime allocates later (its allocations win all the same: the pool yields).
        const uint64_t reserve = cfg_.claim_bytes(dp.device) != 0 ? (256ull << 20)
                                                                   : std::max<uint64_t>(1ull << 30, total_bytes / 20);
        uint64_t room = free_bytes > reserve ? free_bytes - reserve : 0;
        for (const auto& [slot, covered] : classes) {
            const auto want = static_cast<uint64_t>(static_cast<double>(target) * static_cast<double>(covered) /
                                                    static_cast<double>(std::max<uint64_t>(expert_room, 1)));
            uint64_t have = 0;
            {
                std::lock_guard lock(dp.mu);
                have = dp.pool.class_bytes(slot);
            }
            const uint64_t stride = slot + kSlotTail;
            uint64_t slots = want > have ? (want - have) / stride : 0;
            const uint64_t per_arena = std::max<uint64_t>(1, kArenaBytes / stride);
            while (slots > 0) {
                const uint64_t n = std::min({slots, per_arena, room / stride});
                CUdeviceptr p = 0;
                if (n == 0 || drv->mem_alloc(&p, n * stride) != CUDA_SUCCESS) break;
                std::lock_guard lock(dp.mu);
                dp.arenas.push_back(p);
                dp.pool.add_arena(slot, p, static_cast<uint32_t>(n), kSlotTail);
                dp.bytes += n * stride;
                room -= n * stride;
                slots -= n;
            }
        }
    }
    {
        // The pool's room in experts, for the heat's ranking of its recency part (vram_pool.h).
        std::lock_guard lock(dp.mu);
        dp.heat.set_capacity(static_cast<uint32_t>(std::min<uint64_t>(
            experts, expert_room > 0 ? dp.bytes * experts / expert_room : 0)));
    }
    if (cfg_.log && dp.bytes != before)
        say("device %d: pool of %.2f GiB for %.2f GiB of experts in the layers it copies (%.0f%%), %.2f GiB free before",
            dp.device, static_cast<double>(dp.bytes) / 1073741824.0, static_cast<double>(expert_bytes) / 1073741824.0,
            100.0 * static_cast<double>(dp.bytes) / static_cast<double>(std::max<uint64_t>(expert_bytes, 1)),
            static_cast<double>(free_bytes) / 1073741824.0);
}

void Engine::note_expert(DevicePool& dp, const Model& m, uint32_t expert) {
    if (m.id >= dp.full.size() || expert >= dp.full[m.id].size()) return;
    const uint32_t ls = expert / m.map.n_experts;
    const bool now = dp.pool.pooled_slices(m.id, expert) == m.slices_per_expert[ls];
    auto& f = dp.full[m.id][expert];
    if ((f != 0) == now) return;
    f = now ? 1 : 0;
    if (now) in_vram_.fetch_add(1, std::memory_order_relaxed);
    else in_vram_.fetch_sub(1, std::memory_order_relaxed);
    if (dp.placements.size() >= kPlacementQueue) {
        placements_lost_.fetch_add(1, std::memory_order_relaxed);
        return;
    }
    dp.placements.push_back(PlacementEvent{m.id, expert, now});
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
}

bool Engine::yield_memory(size_t bytes) {
    const Driver* drv = driver();
    CUdevice device = 0;
    if (drv == nullptr || drv->ctx_get_device(&device) != CUDA_SUCCESS || device < 0 || device >= kMaxDevices) return false;
    DevicePool* dp = pools_[device].load();
    if (dp == nullptr) return false;
    std::vector<uint64_t> bases;
    {
        std::lock_guard lock(dp->mu);
        bases = dp->pool.release(bytes + (64ull << 20), dp->heat);
        for (const Model* m : snapshot_.load()->models)
            for (uint32_t e = 0; e < m->n_experts; ++e) note_expert(*dp, *m, e);
    }
    if (bases.empty()) return false;
    const uint64_t had = dp->bytes.load();
    free_arenas(*dp, bases);
    yielded_.fetch_add(had - dp->bytes.load());
    return true;
}

uint64_t Engine::pool_bytes(int device) {
    if (device < 0 || device >= kMaxDevices) return 0;
    DevicePool* dp = pools_[device].load();
    return dp == nullptr ? 0 : dp->bytes.load();
}

size_t Engine::reported_free(size_t driver_free) {
    const Driver* drv = driver();
    CUdevice device = 0;
    if (drv == nullptr || drv->ctx_get_device(&device) != CUDA_SUCCESS || device < 0 || device >= kMaxDevices)
        return driver_free;
    const DevicePool* dp = pools_[device].load();
    const uint64_t held = dp == nullptr ? 0 : dp->bytes.load();
    uint64_t claim = cfg_.claim_bytes(device);
    if (claim != 0 && dp != nullptr && dp->target.load() != 0) claim = std::min(claim, dp->target.load());  // what it needs
    const uint64_t free = driver_free + held;
    return free > claim ? free - claim : 0;
}

}  // namespace moecache::cuda::hook
