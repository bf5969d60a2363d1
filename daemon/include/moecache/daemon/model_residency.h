// One registered model in the daemon: its mapping, its locker, its heat, and the residency state
// of every slot. A slot is one expert (MoE layer index * n_experts + expert) or the dense part
// (kDenseSlot): everything that is not a routed expert.
#pragma once

#include "moecache/daemon/config.h"
#include "moecache/daemon/fetch.h"
#include "moecache/daemon/heat.h"
#include "moecache/daemon/mapped_model.h"
#include "moecache/daemon/page_locker.h"
#include "moecache/daemon/planner.h"
#include "moecache/daemon/tier.h"
#include "moecache/page_cache.h"

#include <algorithm>
#include <map>
#include <memory>
#include <span>
#include <vector>

namespace moecache::daemon {

class ModelResidency;

// A slot's residency. It changes only through ModelResidency (see "The state machine" and "Reads
// in flight" there): the daemon reads it.
struct SlotState {
    [[nodiscard]] Tier tier() const { return tier_; }
    [[nodiscard]] uint64_t locked_bytes() const { return locked_bytes_; }    // what locking it added to VmLck
    [[nodiscard]] uint64_t cached_bytes() const { return cached_bytes_; }    // in the page cache at the last look
    [[nodiscard]] uint32_t reads_pending() const { return reads_pending_; }  // reads for its lock not done yet

private:
    friend class ModelResidency;
    Tier tier_ = Tier::Storage;
    uint64_t locked_bytes_ = 0;
    uint64_t cached_bytes_ = 0;
    uint32_t reads_pending_ = 0;
};

// What the page cache did to a slot's bytes, as eBPF reported it (bpf/).
struct SlotTelemetry {
    uint64_t read_bytes = 0;      // read from storage by other processes: misses of a runtime
    uint64_t prefetch_bytes = 0;  // read from storage by the daemon's own prefetch
    uint64_t evicted_bytes = 0;   // left the page cache
    uint64_t faults = 0;          // page faults of other processes on it (a use: see the client's re-arm)
};

class ModelResidency {
public:
    static Result<std::unique_ptr<ModelResidency>> open(const std::string& path, const ModelConfig& cfg,
                                                        double half_life_tokens, const std::vector<int>* handed = nullptr);

    [[nodiscard]] const MappedModel& model() const { return *model_; }
    [[nodiscard]] HeatTable& heat() { return *heat_; }
    [[nodiscard]] const HeatTable& heat() const { return *heat_; }
    // Family members share one table (the heat of each (layer, expert) is the family's): the
    // caller checks that the shapes agree.
    [[nodiscard]] const std::shared_ptr<HeatTable>& shared_heat() const { return heat_; }
    void share_heat(std::shared_ptr<HeatTable> heat) { heat_ = std::move(heat); }
    [[nodiscard]] const ModelConfig& config() const { return config_; }
    [[nodiscard]] uint32_t n_experts() const { return model_->map().n_experts; }
    [[nodiscard]] uint32_t n_slots() const { return static_cast<uint32_t>(slots_.size()); }
    [[nodiscard]] const SlotState& state(uint32_t slot) const { return slot == kDenseSlot ? dense_ : slots_[slot]; }
    [[nodiscard]] std::vector<ByteRange> ranges(uint32_t slot) const;
    // Bytes locking a slot would cost at most (whole pages of its ranges).
    [[nodiscard]] uint64_t slot_bytes(uint32_t slot) const {
        return slot == kDenseSlot ? dense_bytes_ : slot_bytes_[slot];
    }
    // Bytes of a slot's ranges, exactly: what "fully cached" means.
    [[nodiscard]] uint64_t slot_length(uint32_t slot) const {
        return slot == kDenseSlot ? dense_length_ : slot_length_[slot];
    }
    [[nodiscard]] uint64_t locked_bytes() const { return locker_->locked_bytes(); }
    // The MoE layer index of block N (blk.N), if block N is an MoE layer.
    [[nodiscard]] std::optional<uint32_t> layer_of_block(uint32_t block) const;

    [[nodiscard]] SlotTelemetry& telemetry(uint32_t slot) { return slot == kDenseSlot ? dense_telemetry_ : telemetry_[slot]; }
    [[nodiscard]] const SlotTelemetry& telemetry(uint32_t slot) const {
        return slot == kDenseSlot ? dense_telemetry_ : telemetry_[slot];
    }
    // Calls fn(slot, bytes) for each slot with bytes in [begin, end) of model file `file` (the
    // dense slot for what is not a routed expert), clipped to the file.
    template <class Fn>
    void for_each_slot(uint32_t file, uint64_t begin, uint64_t end, Fn&& fn) const {
        const auto& map = model_->map();
        if (file >= map.files.size()) return;
        end = std::min(end, map.files[file].size);
        if (begin >= end) return;
        const uint64_t rest = map.for_each_overlap(file, begin, end, [&](ExpertRef r, uint64_t bytes) {
            if (r.layer < layer_index_.size() && layer_index_[r.layer] != UINT32_MAX)
                fn(layer_index_[r.layer] * map.n_experts + r.expert, bytes);
        });
        if (rest > 0) fn(kDenseSlot, rest);
    }

    // The state machine of a slot's tier, its transitions here and nowhere else:
    //   Storage  --begin_fetch-->  Fetching  --lock-->  Locked  --release-->  Storage
    //   Fetching --abandon-->      Storage   (a pool took it meanwhile, no room this turn, the lock
    //                                         failed, an operator evicted it)
    //   Storage  --lock-->         Locked    (its bytes were cached already)
    // begin_fetch from anything but Storage, and abandon of a locked slot, change nothing and
    // return false: a locked slot leaves only through release.
    bool begin_fetch(uint32_t slot);
    bool abandon(uint32_t slot);
    // Its pages were taken back by reclaim between its read and its lock: back to storage, with what
    // is still cached of it (the plan reads it again).
    void evicted_before_lock(uint32_t slot, uint64_t resident_bytes);
    // Locks every range of a slot (all or nothing).
    Result<uint64_t> lock(uint32_t slot);
    Result<uint64_t> release(uint32_t slot, bool drop);
    // Reads in flight, counted here and nowhere else. A slot read for a lock: begin_fetch, then
    // read_queued for each of its reads and read_done as each completes (a cancelled read too);
    // when the last one is done and it is still Fetching, it is ready: read, waiting for its lock
    // turn (the decide step's ModelFacts::waiting, and what it leaves waiting, set_ready). abandon
    // takes a slot out of the ready ones. A slot read into the page cache only (a miss, a
    // prediction, a warm start, an operator's prefetch): cache_read_queued and cache_read_done,
    // with the reason of its latest request.
    void read_queued(uint32_t slot) { ++state_mut(slot).reads_pending_; }
    bool read_done(uint32_t slot);  // true: the slot became ready
    [[nodiscard]] const std::vector<uint32_t>& ready() const { return ready_; }
    void set_ready(std::vector<uint32_t> slots) { ready_ = std::move(slots); }
    struct CacheRead {
        uint32_t reads = 0;
        FetchReason reason = FetchReason::Operator;
    };
    [[nodiscard]] const std::map<uint32_t, CacheRead>& cache_reads() const { return cache_reads_; }
    // Bytes still to be read for it: slots being read for a lock and reads into the page cache.
    [[nodiscard]] uint64_t reads_pending_bytes() const;
    void cache_read_queued(uint32_t slot, FetchReason reason, uint32_t reads);
    void cache_read_done(uint32_t slot);
    bool forget_cache_read(uint32_t slot);  // its reads were cancelled: true if it had any
    // Page-cache residency of every slot, by cachestat (mincore where the kernel lacks it).
    Result<void> refresh_cached();
    // ... of one slot, now.
    [[nodiscard]] Result<uint64_t> resident_bytes(uint32_t slot);

    // The one-place rule, as the daemon settled it from its clients' pools: how many pools hold
    // each expert, and whether RAM may give it up (every client of the model holds it in VRAM and
    // one of them may release it). While released, the policy does not lock it in RAM, unless the
    // model keeps both copies or it is pinned.
    void set_vram(uint32_t slot, uint32_t holders, bool ram_released);
    [[nodiscard]] uint32_t vram_holders(uint32_t slot) const { return slot < vram_.size() ? vram_[slot] : 0; }
    [[nodiscard]] bool ram_released(uint32_t slot) const { return slot < vram_only_.size() && vram_only_[slot]; }
    // False for an expert whose RAM copy was released to VRAM (one place), unless pinned or the model keeps both.
    [[nodiscard]] bool wanted_in_ram(uint32_t slot) const {
        return keep_ram_copy_ || slot == kDenseSlot || !ram_released(slot) || (slot < pinned_.size() && pinned_[slot]);
    }
    // Promoted to every VRAM pool that serves the model, and read from the file into them by the
    // hooks (daemon::bind_promoted): not read into RAM for a lock. One locked already stays locked
    // until a pool takes it. Empty: nothing is. True when it changed anything.
    bool set_vram_bound(std::vector<uint8_t> bound);
    [[nodiscard]] bool vram_bound(uint32_t slot) const { return slot < vram_bound_.size() && vram_bound_[slot]; }
    // Whether the policy may read it from storage (or lock its cached pages) for RAM: wanted there,
    // and not bound for VRAM while it is neither locked nor being read.
    [[nodiscard]] bool read_for_ram(uint32_t slot) const {
        return wanted_in_ram(slot) &&
               (keep_ram_copy_ || !vram_bound(slot) || (slot < pinned_.size() && pinned_[slot]) ||
                state(slot).tier() != Tier::Storage);
    }
    void set_keep_ram_copy(bool keep) { keep_ram_copy_ = keep; }
    // Pinned experts are always wanted in RAM (within budgets): by configuration, or set at run time.
    [[nodiscard]] bool pinned(uint32_t slot) const { return slot < pinned_.size() && pinned_[slot]; }
    void set_pinned(uint32_t slot, bool pin) {
        if (slot < pinned_.size()) pinned_[slot] = pin ? 1 : 0;
    }
    // Asks the page cache to drop a slot's pages (the whole pages of its ranges: an edge page may
    // hold a neighbour's bytes). Locked pages, and pages another process maps, stay.
    void drop_cached(uint32_t slot);
    // The same for many slots at once, their ranges merged where they touch: a large folio that
    // spans several experts is dropped only by one request that covers all of it.
    void drop_cached(std::span<const uint32_t> slots);

    [[nodiscard]] ModelView view(uint64_t budget) const;
    // Bytes the daemon asked the kernel to drop that were cached (at the last refresh) then.
    [[nodiscard]] uint64_t dropped_bytes() const { return dropped_bytes_; }

private:
    [[nodiscard]] SlotState& state_mut(uint32_t slot) { return slot == kDenseSlot ? dense_ : slots_[slot]; }
    void drop_ranges(const std::vector<ByteRange>& ranges);
    ModelConfig config_;
    std::unique_ptr<MappedModel> model_;
    std::unique_ptr<PageLocker> locker_;
    std::shared_ptr<HeatTable> heat_;
    std::vector<SlotState> slots_;
    SlotState dense_;
    std::vector<SlotTelemetry> telemetry_;
    SlotTelemetry dense_telemetry_;
    std::vector<uint32_t> layer_index_;  // block -> MoE layer index, UINT32_MAX for other blocks
    std::vector<uint8_t> pinned_;
    std::vector<uint32_t> vram_;       // per slot: hooks holding it in VRAM
    std::vector<uint8_t> vram_only_;   // per slot: its RAM copy released to VRAM (one place)
    std::vector<uint8_t> vram_bound_;  // per slot: set_vram_bound
    bool keep_ram_copy_ = false;
    uint64_t dropped_bytes_ = 0;
    std::vector<uint64_t> slot_bytes_, slot_length_;
    uint64_t dense_bytes_ = 0, dense_length_ = 0;
    std::vector<PageCacheProbe> probes_;
    std::vector<uint32_t> ready_;                // read for a lock, waiting for it (Reads in flight)
    std::map<uint32_t, CacheRead> cache_reads_;  // by slot: read into the page cache only
};

}  // namespace moecache::daemon
