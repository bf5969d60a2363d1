// Filling a device's pool ahead of the runtime's copies with what the daemon directed it to hold
// (its Promote directives, hottest first: daemon::pool_wanted), from the pages the daemon keeps
// locked in RAM and the hook has registered for DMA. A runtime that starts after a restart of its
// model, or after a prompt model of the same family, then finds its hot experts in VRAM from its
// first tokens instead of admitting them one miss at a time; and each expert that enters the pool
// leaves RAM (one place), where the daemon locks the next ones.
//
// On the background thread. The bytes go host -> a scratch buffer of the device's -> the slot, on a
// stream of the hook's own: the slot is admitted under the device's lock (ordered after whichever
// stream used it last), the host's bytes are queued without the lock, and the slot is committed and
// its device-to-device copy queued under the lock again, as the copy path admits what missed. A
// slot the pool gave up meanwhile (it shrank or yielded) is never written: only the scratch buffer,
// which is the hook's alone, is written before the commit.
#include "driver.h"
#include "capture_gate.h"
#include "engine.h"
#include "joiner.h"
#include "log.h"

#include <algorithm>

namespace moecache::cuda::hook {
namespace {

constexpr uint64_t kFillScratch = 64ull << 20;  // per device: the most a turn fills
constexpr uint32_t kMostRefused = 64;           // admissions the pool refused before a turn gives up

}  // namespace

// The last run's hot set (not what a daemon promoted) may be read from the model file while the
// pool is new: once, at the start, as a daemon's warm start reads it.
bool Engine::prior_from_file(const DevicePool& dp, const Model& m, uint32_t expert) const {
    return m.promoted[expert] == 0 && now_ns() - dp.made_ns < kFirstFillNs;
}

void Engine::note_promoted(Model& m, uint32_t expert, bool promoted) {
    if (expert >= m.promoted.size() || (m.promoted[expert] != 0) == promoted) return;
    ++fill_gen_;
    m.promoted[expert] = promoted ? 1 : 0;
    if (promoted) m.n_promoted.fetch_add(1, std::memory_order_relaxed);
    else m.n_promoted.fetch_sub(1, std::memory_order_relaxed);
    if (promoted) fill_queue_.emplace_back(m.id, expert);
    else fill_queue_dirty_ = true;
}

// Where a promoted expert's bytes come from: the daemon's locked pages, once registered (a turn
// after its Lock: straight from them at DMA speed), or, where the daemon does not read it into RAM
// (it leaves what it promoted to the pool), the model file through the staging buffers, read with
// pread in large requests by several threads (the miss path's way), never a page fault at a time
// through the mapping, during the pool's first fill (`from_file`: until it holds nine in ten of
// what it is directed to, as the daemon binds them: daemon::bind_promoted; after that a moving
// ranking would read the pool over and over from storage, and the daemon's locks come first).
// A locked expert not registered yet waits for its registration. Not from the
// file while the runtime runs a prompt: its batches copy every expert from the host anyway (what is
// promoted is admitted as it passes), and reads of the pool's experts beside the prompt's own, from
// a ranking that each batch moves, would only compete with them for the disk.
bool Engine::fillable(const Model& m, uint32_t expert, bool from_file) const {
    const auto ls = static_cast<int32_t>(expert / m.map.n_experts);
    const uint32_t local = expert % m.map.n_experts;
    const auto& layer = m.map.layers[static_cast<size_t>(ls)];
    bool registered = true;  // every slice straight from registered pages: no disk, nothing waits
    for (uint32_t t = 0; t < m.slices_per_expert[static_cast<size_t>(ls)] && registered; ++t) {
        const uint8_t st = m.registered[m.slice(ls, t, local)].load(std::memory_order_acquire);
        registered = st == Model::kInside || st == Model::kWhole;
    }
    if (registered || pinned_all_) return true;
    if (m.daemon_locked[expert] != 0) return !cfg_.registers();
    if (!from_file || now_ns() - last_batch_ns_.load(std::memory_order_relaxed) < kPromptQuietNs) return false;
    for (const auto& t : layer.tensors)
        if (t.file >= m.fds.size() || m.fds[t.file] < 0) return false;
    return true;
}

// Each device's turn runs with no stream capture open (capture_gate.h): the fill's stream is ordered
// after the runtime's streams that used a slot last (an event recorded on them, waited for on the
// fill's stream), and an event recorded on a stream being captured would draw the fill's stream, and
// its copies, into the runtime's graph.
bool Engine::wants_filled(const Model& m, uint32_t expert, const DevicePool& dp) const {
    if (m.promoted[expert] != 0) return true;
    // The last run's hot set (hot_profile.h), until a daemon directs: what it promotes, and one
    // place (where what a pool takes leaves RAM), are its to choose.
    return expert < m.prior_wanted.size() && m.prior_wanted[expert] != 0 && m.n_promoted.load(std::memory_order_relaxed) == 0 &&
           !dp.one_place.load(std::memory_order_relaxed);
}

bool Engine::fill_pools() {
    if (fill_queue_.empty()) return false;
    if (fill_queue_dirty_) {  // what was unpromoted leaves the queue, the rest keeps its order
        fill_queue_.erase(std::remove_if(fill_queue_.begin(), fill_queue_.end(),
                                         [&](const auto& q) {
                                             const Model& m = *models_[q.first];
                                             return m.promoted[q.second] == 0 &&
                                                    (q.second >= m.prior_wanted.size() || m.prior_wanted[q.second] == 0);
                                         }),
                          fill_queue_.end());
        fill_queue_dirty_ = false;
    }
    const Driver* drv = driver();
    if (drv == nullptr) return false;
    bool more = false;
    for (int d = 0; d < kMaxDevices; ++d) {
        DevicePool* dp = pools_[d].load();
        if (dp == nullptr || dp->bytes.load() == 0 || dp->bg.fill_idle == fill_gen_) continue;
        if (cfg_.fill_from_files && !dp->bg.first_fill_done) {
            // Done (moecache/first_fill.h) once the direction is of the pool's size (half of it at
            // least: not the few experts the first routing named) and nine in ten of it are pooled.
            size_t promoted = 0, held = 0, experts = 0;
            uint64_t room = 0;
            for (const Model* m : models_) {
                for (uint32_t e = 0; e < m->n_experts; ++e)
                    if (m->promoted[e] != 0) {
                        ++promoted;
                        held += m->pooled_on[e] >> d & 1;
                    }
                for (const auto& l : m->map.layers)
                    for (const auto& t : l.tensors) room += (t.bytes_per_expert + kSlotTail) * m->map.n_experts;
                experts += m->n_experts;
            }
            const double capacity = room > 0 ? static_cast<double>(dp->bytes.load()) * static_cast<double>(experts) / static_cast<double>(room) : 0;
            const bool full = static_cast<double>(promoted) >= 0.5 * capacity && first_fill_held(held, promoted);
            if (full || now_ns() - dp->made_ns > kFirstFillNs) dp->bg.first_fill_done = true;
        }
        const bool from_file = cfg_.fill_from_files && !dp->bg.first_fill_done;
        // The gate holds the runtime's captures back: taken only when there is something to fill.
        const bool work = std::any_of(fill_queue_.begin(), fill_queue_.end(), [&](const auto& q) {
            const Model& m = *models_[q.first];
            return wants_filled(m, q.second, *dp) && (m.pooled_on[q.second] >> d & 1) == 0 &&
                   fillable(m, q.second, from_file || prior_from_file(*dp, m, q.second));
        });
        if (work) capture_gate().exclusive([&] { more = fill_device(*dp, from_file) || more; });
    }
    return more;
}

bool Engine::fill_device(DevicePool& pool, bool from_file) {
    const Driver* drv = driver();
    DevicePool* dp = &pool;
    const int d = dp->device;
    bool more = false;
    {
        DeviceContext ctx(drv, d);
        if (!ctx.ok()) return false;
        if (dp->bg.fill_stream == nullptr) {
            if (drv->stream_create(&dp->bg.fill_stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
                dp->bg.fill_stream = nullptr;
                return false;
            }
            if (drv->mem_alloc(&dp->bg.fill_scratch, kFillScratch) != CUDA_SUCCESS) {
                dp->bg.fill_scratch = 0;
                return false;
            }
        }
        if (dp->bg.fill_scratch == 0) return false;
        struct Piece {
            Model* m;
            int32_t ls;
            uint32_t tensor, expert;  // expert: within the layer
            SliceRef ref;
            uint64_t bytes, tail, at;  // the slice's bytes, the next slice's head after it, where in scratch
        };
        std::vector<Piece> pieces;
        StreamId sid = 0;
        uint32_t refused = 0;
        {
            std::lock_guard lock(dp->mu);
            sid = dp->stream_id(dp->bg.fill_stream);
            Joiner order(*dp, drv, dp->bg.fill_stream, d);
            uint64_t used = 0;
            for (const auto& [mi, e] : fill_queue_) {
                Model& m = *models_[mi];
                if (!wants_filled(m, e, *dp) || m.pooled_on[e] >> d & 1 ||
                    !fillable(m, e, from_file || prior_from_file(*dp, m, e)))
                    continue;
                const auto ls = static_cast<int32_t>(e / m.map.n_experts);
                const uint32_t local = e % m.map.n_experts;
                const auto& layer = m.map.layers[static_cast<size_t>(ls)];
                uint64_t need = 0;
                for (uint32_t t = 0; t < m.slices_per_expert[static_cast<size_t>(ls)]; ++t)
                    need += layer.tensors[t].bytes_per_expert + kSlotTail;
                if (used + need > kFillScratch) {
                    more = true;
                    break;
                }
                for (uint32_t t = 0; t < m.slices_per_expert[static_cast<size_t>(ls)]; ++t) {
                    const uint32_t tensor_id = m.slice(ls, t, 0) / m.map.n_experts;
                    if (mi >= dp->seen.size() || tensor_id >= dp->seen[mi].size() || !dp->seen[mi][tensor_id]) continue;
                    const uint64_t bytes = layer.tensors[t].bytes_per_expert;
                    const SliceRef ref{m.id, m.slice(ls, t, local), e};
                    // Pooled already: a device that copies only some of an expert's tensors (the
                    // second of two GPUs) never holds the expert whole, and its slices stay here.
                    if (dp->pool.holds(ref.model, ref.slice)) continue;
                    SliceRef evicted;
                    if (dp->pool.admit(ref, bytes, sid, dp->heat, order, &evicted, true) == 0) {
                        ++refused;
                        continue;
                    }
                    if (evicted.model != kNoSlot && evicted.model < models_.size())
                        note_expert(*dp, *models_[evicted.model], evicted.expert);
                    const uint64_t tail = local + 1 < m.map.n_experts ? std::min<uint64_t>(dp->pool.tail_room(bytes), bytes) : 0;
                    pieces.push_back({&m, ls, t, local, ref, bytes, tail, used});
                    used += (bytes + tail + 255) & ~uint64_t{255};
                }
                if (refused >= kMostRefused) break;
            }
            joins_.fetch_add(order.joins, std::memory_order_relaxed);
        }
        if (pieces.empty()) {
            // Nothing to do until something changes (a prompt that holds the file's fills back ends
            // by itself: not idle then).
            if (!more && refused == 0 && now_ns() - last_batch_ns_.load(std::memory_order_relaxed) >= kPromptQuietNs)
                dp->bg.fill_idle = fill_gen_;
            return more;
        }
        // The host's bytes into the scratch buffer: straight from the registered pages, the edges
        // (a page each side) the usual way.
        CUresult rc = CUDA_SUCCESS;
        for (auto& p : pieces) {
            const auto [a, b] = slice_span(*p.m, p.ref.slice);
            const auto& t = p.m->map.layers[static_cast<size_t>(p.ls)].tensors[p.tensor];
            if (a == 0) {
                rc = CUDA_ERROR_INVALID_VALUE;  // not mapped now: nothing is committed
                break;
            }
            const HostBytes from{reinterpret_cast<const uint8_t*>(a), t.file < p.m->fds.size() ? p.m->fds[t.file] : -1,
                                 t.offset + uint64_t{p.expert} * t.bytes_per_expert};
            rc = copy_slices_from_host(*dp, *p.m, p.ls, p.tensor, p.expert, p.bytes, dp->bg.fill_scratch + p.at, from,
                                       0, p.bytes + p.tail, dp->bg.fill_stream);
            if (rc != CUDA_SUCCESS) break;
        }
        std::lock_guard lock(dp->mu);
        uint64_t filled = 0;
        for (auto& p : pieces) {
            const uint64_t slot = rc == CUDA_SUCCESS ? dp->pool.commit(p.ref, static_cast<uint32_t>(p.tail)) : 0;
            if (slot == 0) {
                dp->pool.drop(p.m->id, p.ref.slice);
            } else if (copy_in_device(*dp, slot, dp->bg.fill_scratch + p.at, p.bytes + p.tail, dp->bg.fill_stream) !=
                       CUDA_SUCCESS) {
                dp->pool.drop(p.m->id, p.ref.slice);
            } else {
                ++filled;
            }
        }
        for (auto& p : pieces) note_expert(*dp, *p.m, p.ref.expert);
        settle(*dp, drv, sid);
        filled_.fetch_add(filled, std::memory_order_relaxed);
        dp->counters.filled.fetch_add(filled, std::memory_order_relaxed);
        if (filled > 0) more = true;
    }
    return more;
}

}  // namespace moecache::cuda::hook
