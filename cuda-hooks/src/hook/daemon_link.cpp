// What the hook and moecached say to each other, through the client runtime: router decisions
// (one event per layer and batch), each pool's counters, the experts whose every slice is in a
// pool (and, for one place, this process's pages of them dropped), the daemon's VRAM budget per
// device and its promote/demote directives.
#include "driver.h"
#include "engine.h"
#include "log.h"
#include "moecache/client.h"
#include "moecache/client/protocol.h"
#include "moecache/page_cache.h"
#include "moecache/routing_shift.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace moecache::cuda::hook {

void Engine::report(Model& m, uint32_t block, uint32_t first, uint32_t n) {
    constexpr uint32_t kMost = 1024;  // experts of one copy, at most (a layer of 1024 experts)
    uint32_t ids[kMost];
    n = std::min(n, kMost);
    for (uint32_t i = 0; i < n; ++i) ids[i] = first + i;
    report_experts(m, block, ids, n, 1);
}

void Engine::report_experts(Model& m, uint32_t block, const uint32_t* experts, uint32_t n, uint32_t tokens) {
    if (client_ == nullptr) return;
    const uint32_t h = m.client_handle.load(std::memory_order_relaxed);
    if (h == UINT32_MAX) return;
    // The client's ring has one writer at a time; a report never waits for another.
    std::unique_lock lock(report_mu_, std::try_to_lock);
    if (!lock.owns_lock()) return;
    if (moecache_client_report(client_, h, block, experts, n, tokens) == 1) reported_.fetch_add(1, std::memory_order_relaxed);
}

// Only once every model is registered: the daemon decides one place for the models a client
// registers and says so before it answers the registration (what it said at the handshake is a
// default). A placement drained before that is dropped again by rezap_pooled.
bool Engine::daemon_wants_one_place(int device) const {
    int one_place = 0;
    return cfg_.one_place && !pinned_all_ && client_ != nullptr &&
           moecache_client_vram_policy(client_, static_cast<uint32_t>(device), nullptr, &one_place) == 1 && one_place == 1 &&
           moecache_client_wait_ready(client_, 0) == 1;
}

// Whether the daemon asks any device's pool for one place (device 0 before any pool is made).
bool Engine::daemon_asks_one_place() const {
    for (int d = 0; d < kMaxDevices; ++d)
        if ((d == 0 || pools_[d].load() != nullptr) && daemon_wants_one_place(d)) return true;
    return false;
}

// The daemon's budget for each device's pool, when it sets or changes one. And the registered
// tier (auto, register) with a daemon: where it asks for one place (the models do not fit the RAM
// it may lock), or where the hook's budget cannot hold every expert, what is registered is what it
// keeps locked (its Lock and Unlock directives), and what was registered before is let go. Where
// RAM holds every expert and no place is one, the tier is what it is without a daemon: every run of
// expert tensors, registered whole (a miss is one copy at DMA speed; an expert's own registration
// leaves its edge pages out, which then go as the runtime asks).
void Engine::apply_daemon_budgets() {
    if (client_ == nullptr) return;
    if (cfg_.registers()) {
        moecache_client_stats cs{};
        moecache_client_stats_get(client_, &cs);
        if (cs.connects != daemon_connects_) {  // a daemon (again): what one locked before says nothing now
            daemon_connects_ = cs.connects;
            daemon_decided_ = false;
            for (Model* m : models_) std::fill(m->daemon_locked.begin(), m->daemon_locked.end(), 0);
        }
        // Decided once the daemon has said its policy and the models are known (decide_ahead).
        if (moecache_client_vram_policy(client_, 0, nullptr, nullptr) == 1 && moecache_client_wait_ready(client_, 0) == 1 &&
            !models_.empty() && ahead_models_ == models_.size()) {
            daemon_decided_ = true;
            if (!ahead_.load() || daemon_asks_one_place()) follow_daemon_locks();
        } else if (cs.connected == 0) {
            follow_locks_.store(false);
        }
    }
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        uint64_t b = 0;
        int one_place = 0;
        if (dp != nullptr) {
            dp->one_place.store(daemon_wants_one_place(d), std::memory_order_relaxed);
            // The part of the pool the daemon does not direct: an LRU where its split says so.
            const bool recency = moecache_client_pool_recency(client_, static_cast<uint32_t>(d)) == 1;
            std::lock_guard lock(dp->mu);
            dp->heat.set_recency(recency);
        }
        if (dp == nullptr || moecache_client_vram_policy(client_, static_cast<uint32_t>(d), &b, &one_place) == 0) continue;
        const uint64_t applied = b == UINT64_MAX ? 0 : b + 1;
        if (dp->bg.daemon_budget == applied) continue;
        dp->bg.daemon_budget = applied;
        resize_pool(*dp);
    }
}

// A daemon came (its first VramPolicy, or its first Lock: whichever the hook sees first, since the
// client may read both between two of the hook's turns): what was registered before it is let go,
// and what it locks is what it says from now on. Once per daemon: a Lock it sent is never wiped by
// the transition that its VramPolicy, read later, would otherwise start.
void Engine::follow_daemon_locks() {
    if (follow_locks_.exchange(true)) return;
    unregister_ahead();
    for (Model* m : models_)
        for (uint32_t slice = 0; slice < m->n_slices; ++slice) {
            uint8_t asked = Model::kAsked;
            if (!m->registered[slice].compare_exchange_strong(asked, Model::kNone)) unregister_slice(*m, slice);
        }
    // What it locked before the hook followed it (its Locks are kept as they come).
    for (Model* m : models_)
        for (uint32_t e = 0; e < m->daemon_locked.size(); ++e)
            if (m->daemon_locked[e] != 0)
                follow_registration(*m, static_cast<int32_t>(e / m->map.n_experts), e % m->map.n_experts);
}

// One place: the bytes of an expert the pool holds need not stay in RAM. Its pages are paged out of
// this process (the mapping is shared and read-only, so they read back the same if ever touched
// again) and the daemon, told of it, unlocks and drops what is left. The page cache works in
// folios: a large folio that also holds a neighbour some other process maps stays whole.
void Engine::drop_host_copy(const Model& m, uint32_t block, uint32_t expert) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (const auto& r : m.map.ranges(block, expert)) {
        for (const auto& mr : mapped_) {
            if (mr.model != m.id || mr.file != r.file || mr.mapping.perms.size() < 4 || mr.mapping.perms[3] != 's' ||
                mr.mapping.perms[1] == 'w')
                continue;
            const uint64_t lo = std::max(r.offset, mr.mapping.file_offset);
            const uint64_t hi = std::min(r.offset + r.length, mr.mapping.file_offset + (mr.mapping.end - mr.mapping.start));
            if (lo >= hi) continue;
            // Whole pages only: the pages at the ends may hold a neighbour's bytes.
            const uintptr_t a = (mr.mapping.address_of(lo) + page - 1) & ~(page - 1);
            const uintptr_t b = mr.mapping.address_of(hi) & ~(page - 1);
            if (b <= a) continue;
            // MADV_PAGEOUT reclaims the pages only this process maps, splitting a large folio that
            // straddles the expert's edge where it can (Linux >= 5.4); MADV_DONTNEED then unmaps
            // the rest (the daemon maps them too, while it holds them locked), for the daemon to drop.
            (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_PAGEOUT);
            if (madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED) == 0)
                dropped_host_bytes_.fetch_add(b - a, std::memory_order_relaxed);
            // A fault maps the cached pages around it too (fault-around: 64 KiB windows), so the
            // neighbours' pages in the windows at the edges may be mapped only because the expert
            // was read; a page-cache folio across the edge would stay for them. Unmapped too: the
            // mapping is shared and read-only, a neighbour in use faults them back from the cache.
            const uintptr_t around_lo = std::max<uintptr_t>(a & ~(kFaultAroundBytes - 1), mr.mapping.start);
            const uintptr_t around_hi = std::min<uintptr_t>((b + kFaultAroundBytes - 1) & ~(kFaultAroundBytes - 1), mr.mapping.end);
            if (around_lo < a) (void)madvise(reinterpret_cast<void*>(around_lo), a - around_lo, MADV_DONTNEED);
            if (around_hi > b) (void)madvise(reinterpret_cast<void*>(b), around_hi - b, MADV_DONTNEED);
        }
    }
}

// How copies a device's pool misses reach it now (protocol::MissPath, moecache/client.h's numbers).
int Engine::miss_path(const DevicePool& dp) const {
    switch (cfg_.pin) {
        case PinMode::Off: return MOECACHE_MISS_PATH_PAGEABLE_CHOSEN;
        case PinMode::Staging: return MOECACHE_MISS_PATH_STAGED_CHOSEN;
        case PinMode::All: break;
        case PinMode::Auto:
        case PinMode::Register:
            if (follow_locks_.load()) return MOECACHE_MISS_PATH_DAEMON_LOCKS;
            if (!ahead_.load()) return MOECACHE_MISS_PATH_STAGED_OVER_BUDGET;
            break;
    }
    if (register_failed_.load()) return MOECACHE_MISS_PATH_STAGED_REGISTER_FAILED;
    if (dp.link_gbps > 0 && dp.link_gbps < kSlowLinkGBps && dp.link_gbps < kSlowLinkShare * dp.memcpy_gbps)
        return MOECACHE_MISS_PATH_SLOW_LINK;
    return MOECACHE_MISS_PATH_REGISTERED;
}

// Once a device's path is known, and whenever it changes: told to the daemon (its status and
// metrics), and on stderr once where decode with every expert on the GPU is slower for it than
// without moecache, with why and what to do.
void Engine::tell_miss_paths() {
    // With a model that fits the budget, the registered tier waits for a connected daemon's word.
    moecache_client_stats cs{};
    if (client_ != nullptr) moecache_client_stats_get(client_, &cs);
    if (cfg_.registers() && ahead_.load() && !follow_locks_.load() && cs.connected != 0 && !daemon_decided_) return;
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        if (dp == nullptr || !dp->copies_set_up.load(std::memory_order_acquire)) continue;
        const int path = miss_path(*dp);
        const int before = dp->told_path.load();
        if (path == before) continue;
        const auto p = static_cast<protocol::MissPath>(path);
        const bool was_slow = before != 0 && !protocol::is_fast(static_cast<protocol::MissPath>(before));
        dp->told_path.store(path);
        if (!protocol::is_fast(p)) say("device %d: %s. %s.", d, protocol::reason_of(p), protocol::advice_for(p));
        else if (was_slow || cfg_.log) say("device %d: %s", d, protocol::reason_of(p));
        if (client_ != nullptr) (void)moecache_client_report_miss_path(client_, static_cast<uint32_t>(d), path);
    }
}

// Each pool's counters to the daemon (its metrics), when they moved or the pool's size did.
void Engine::report_pools() {
    if (client_ == nullptr) return;
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        if (dp == nullptr) continue;
        moecache_pool_stats s{dp->counters.hits.load(), dp->counters.misses.load(), dp->counters.hit_bytes.load(),
                              dp->counters.miss_bytes.load(), dp->bytes.load()};
        if (s.hits == dp->bg.reported_hits && s.misses == dp->bg.reported_misses &&
            s.pool_bytes == dp->bg.reported_bytes)
            continue;
        if (moecache_client_report_pool(client_, static_cast<uint32_t>(d), &s) == 0) {
            dp->bg.reported_hits = s.hits;
            dp->bg.reported_misses = s.misses;
            dp->bg.reported_bytes = s.pool_bytes;
        }
    }
}

void Engine::rezap_pooled() {
    if (client_ == nullptr) return;
    std::vector<std::pair<uint32_t, uint32_t>> pooled;  // (model, model-local expert)
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        if (dp == nullptr || !daemon_wants_one_place(d)) continue;
        std::lock_guard lock(dp->mu);
        for (uint32_t m = 0; m < dp->full.size(); ++m)
            for (uint32_t e = 0; e < dp->full[m].size(); ++e)
                if (dp->full[m][e]) pooled.emplace_back(m, e);
    }
    for (const auto& [mi, e] : pooled) {
        const Model& m = *models_[mi];
        drop_host_copy(m, m.map.layers[e / m.map.n_experts].index, e % m.map.n_experts);
    }
}

void Engine::drain_placements() {
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        if (dp == nullptr) continue;
        std::vector<PlacementEvent> batch;
        {
            std::lock_guard lock(dp->mu);
            batch.swap(dp->placements);
        }
        const bool one_place = daemon_wants_one_place(d);
        for (const auto& ev : batch) {
            Model& m = *models_[ev.model];
            const uint32_t block = m.map.layers[ev.expert / m.map.n_experts].index;
            const uint32_t e = ev.expert % m.map.n_experts;
            // Only with a daemon that asked for one place: it also decides when the expert comes back.
            if (ev.in_vram && one_place) drop_host_copy(m, block, e);
            // An expert in the pool is copied from the pool: its pages need no registration (with a
            // daemon, whose locks the tier follows, or when the tier cannot hold every expert).
            // With a daemon, one that leaves the pool and is still locked is registered again.
            if (ev.expert < m.pooled_on.size()) {
                if (ev.in_vram) m.pooled_on[ev.expert] |= uint64_t{1} << d;
                else m.pooled_on[ev.expert] &= ~(uint64_t{1} << d);
            }
            ++fill_gen_;
            const auto ls = static_cast<int32_t>(ev.expert / m.map.n_experts);
            if (cfg_.registers() && follow_locks_.load()) {
                follow_registration(m, ls, e);
            } else if (ev.in_vram && cfg_.registers() && !ahead_.load()) {
                for (uint32_t t = 0; t < m.slices_per_expert[static_cast<size_t>(ls)]; ++t) unregister_slice(m, m.slice(ls, t, e));
            }
            if (client_ != nullptr && m.client_handle.load() != UINT32_MAX)
                (void)moecache_client_report_placement(client_, m.client_handle.load(), block, e, ev.in_vram ? d : -1);
        }
    }
}

// With a daemon: an expert's pages are registered for DMA while the daemon keeps it locked and no
// pool holds it (a pool copies it from VRAM), and let go otherwise. A Lock can cross the expert's
// entry into a pool, and an expert can leave a pool while still locked: both land here.
void Engine::follow_registration(Model& m, int32_t ls, uint32_t expert) {
    const uint32_t e = m.expert(ls, expert);
    const bool want = e < m.daemon_locked.size() && m.daemon_locked[e] != 0 && m.pooled_on[e] == 0;
    for (uint32_t t = 0; t < m.slices_per_expert[static_cast<size_t>(ls)]; ++t) {
        const uint32_t slice = m.slice(ls, t, expert);
        if (!want) {
            unregister_slice(m, slice);
            continue;
        }
        uint8_t expected = Model::kNone;
        if (m.registered[slice].compare_exchange_strong(expected, Model::kAsked)) {
            std::lock_guard lock(wanted_mu_);
            wanted_.emplace_back(m.id, slice);
        }
    }
}

void Engine::poll_directives() {
    if (client_ == nullptr) return;
    moecache_directive d[64];
    const size_t n = moecache_client_poll(client_, d, 64);
    for (size_t i = 0; i < n; ++i) {
        Model* m = nullptr;
        for (auto* x : models_)
            if (x->client_handle.load() == d[i].model) m = x;
        if (m != nullptr && d[i].action == MOECACHE_SHIFTED) {
            // The daemon saw the model's routing shift: the counts its pool's own part ranks by were
            // learnt on the old routing.
            directives_.fetch_add(1, std::memory_order_relaxed);
            for (auto& p : pools_)
                if (DevicePool* dp = p.load()) {
                    std::lock_guard lock(dp->mu);
                    dp->heat.forget(m->id, kKeepAtShift);
                }
            continue;
        }
        if (m == nullptr || d[i].block >= m->layer_slot.size() || m->layer_slot[d[i].block] < 0 ||
            d[i].expert >= m->map.n_experts)
            continue;
        const int32_t ls = m->layer_slot[d[i].block];
        const uint32_t e = m->expert(ls, d[i].expert);
        if (d[i].action == MOECACHE_LOCK || d[i].action == MOECACHE_UNLOCK) {
            // Where the registered tier follows the daemon, it is what it keeps locked (and no pool holds).
            m->daemon_locked[e] = d[i].action == MOECACHE_LOCK ? 1 : 0;
            ++fill_gen_;
            if (cfg_.registers() && follow_locks_.load()) follow_registration(*m, ls, d[i].expert);
            continue;
        }
        directives_.fetch_add(1, std::memory_order_relaxed);
        note_promoted(*m, e, d[i].action == MOECACHE_PROMOTE);
        for (auto& p : pools_) {
            DevicePool* dp = p.load();
            if (dp == nullptr) continue;
            std::lock_guard lock(dp->mu);
            if (d[i].action == MOECACHE_PROMOTE) {
                dp->heat.set_promoted(m->id, e, true);
            } else if (d[i].action == MOECACHE_UNPROMOTE) {
                dp->heat.set_promoted(m->id, e, false);
            } else if (d[i].action == MOECACHE_DEMOTE) {
                dp->heat.set_promoted(m->id, e, false);
                dp->heat.set(m->id, e, 0);
                dp->pool.drop_expert(m->id, e);
                note_expert(*dp, *m, e);
            }
        }
    }
}

}  // namespace moecache::cuda::hook
