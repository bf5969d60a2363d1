#include "moecache/daemon/model_residency.h"

#include "moecache/log.h"

#include <algorithm>

#include <fcntl.h>
#include <sys/mman.h>

namespace moecache::daemon {

namespace {
uint64_t length(const std::vector<ByteRange>& rs) {
    uint64_t bytes = 0;
    for (const auto& r : rs) bytes += r.length;
    return bytes;
}
uint64_t page_bytes(const std::vector<ByteRange>& rs) {
    const uint64_t ps = PageLocker::page_size();
    uint64_t bytes = 0;
    for (const auto& r : rs)
        if (r.length) bytes += ((r.offset + r.length - 1) / ps - r.offset / ps + 1) * ps;
    return bytes;
}
}  // namespace

Result<std::unique_ptr<ModelResidency>> ModelResidency::open(const std::string& path, const ModelConfig& cfg,
                                                             double half_life_tokens, const std::vector<int>* handed) {
    auto r = std::make_unique<ModelResidency>();
    r->config_ = cfg;
    r->model_ = MC_TRY(MappedModel::open(path, handed));
    r->locker_ = std::make_unique<PageLocker>(*r->model_);
    const auto& map = r->model_->map();
    const auto n_layers = static_cast<uint32_t>(map.layers.size());
    r->heat_ = std::make_shared<HeatTable>(n_layers, map.n_experts, half_life_tokens);
    r->slots_.resize(size_t{n_layers} * map.n_experts);
    r->telemetry_.resize(r->slots_.size());
    for (uint32_t i = 0; i < n_layers; ++i) {
        if (map.layers[i].index >= r->layer_index_.size()) r->layer_index_.resize(map.layers[i].index + 1, UINT32_MAX);
        r->layer_index_[map.layers[i].index] = i;
    }
    r->pinned_.assign(r->slots_.size(), 0);
    for (const auto& pin : cfg.pins) {
        const auto layer = r->layer_of_block(pin.layer);
        if (!layer) {
            MC_LOG(LOG_WARNING, "{}: {} pins block {}, which holds no routed experts; ignored", path, cfg.where,
                   pin.layer);
            continue;
        }
        for (uint64_t e = pin.first; e <= std::min<uint64_t>(pin.last, map.n_experts - 1); ++e)
            r->pinned_[size_t{*layer} * map.n_experts + e] = 1;
    }
    for (const auto& f : r->model_->files()) r->probes_.push_back(MC_TRY(PageCacheProbe::of(f.fd.get(), f.path)));
    r->slot_bytes_.resize(r->slots_.size());
    r->slot_length_.resize(r->slots_.size());
    for (uint32_t s = 0; s < r->slots_.size(); ++s) {
        const auto rs = r->ranges(s);
        r->slot_bytes_[s] = page_bytes(rs);
        r->slot_length_[s] = length(rs);
    }
    r->dense_bytes_ = page_bytes(r->ranges(kDenseSlot));
    r->dense_length_ = length(r->ranges(kDenseSlot));
    return r;
}

std::optional<uint32_t> ModelResidency::layer_of_block(uint32_t block) const {
    if (block >= layer_index_.size() || layer_index_[block] == UINT32_MAX) return std::nullopt;
    return layer_index_[block];
}

std::vector<ByteRange> ModelResidency::ranges(uint32_t slot) const {
    if (slot == kDenseSlot) return model_->dense_ranges();
    const auto& map = model_->map();
    return map.ranges(map.layers[slot / map.n_experts].index, slot % map.n_experts);
}


bool ModelResidency::begin_fetch(uint32_t slot) {
    SlotState& st = state_mut(slot);
    if (st.tier_ != Tier::Storage) return false;
    st.tier_ = Tier::Fetching;
    return true;
}

bool ModelResidency::abandon(uint32_t slot) {
    SlotState& st = state_mut(slot);
    if (st.tier_ == Tier::Locked) return false;
    st.tier_ = Tier::Storage;
    std::erase(ready_, slot);
    return true;
}

void ModelResidency::evicted_before_lock(uint32_t slot, uint64_t resident_bytes) {
    if (!abandon(slot)) return;
    state_mut(slot).cached_bytes_ = resident_bytes;
}

bool ModelResidency::read_done(uint32_t slot) {
    SlotState& st = state_mut(slot);
    if (st.reads_pending_ == 0) return false;  // none in flight: not its last read a second time
    if (--st.reads_pending_ != 0 || st.tier_ != Tier::Fetching) return false;
    ready_.push_back(slot);
    return true;
}

void ModelResidency::cache_read_queued(uint32_t slot, FetchReason reason, uint32_t reads) {
    if (reads == 0) return;
    auto& f = cache_reads_[slot];
    f.reads += reads;
    if (f.reads == reads || reason == FetchReason::Miss) f.reason = reason;  // new, or a miss's again
}

void ModelResidency::cache_read_done(uint32_t slot) {
    const auto it = cache_reads_.find(slot);
    if (it != cache_reads_.end() && --it->second.reads == 0) cache_reads_.erase(it);
}

bool ModelResidency::forget_cache_read(uint32_t slot) { return cache_reads_.erase(slot) > 0; }

Result<uint64_t> ModelResidency::lock(uint32_t slot) {
    SlotState& st = state_mut(slot);
    if (st.tier() == Tier::Locked) return uint64_t{0};
    const auto rs = ranges(slot);
    uint64_t added = 0;
    for (size_t i = 0; i < rs.size(); ++i) {
        auto r = locker_->lock(rs[i]);
        if (!r) {
            for (size_t j = 0; j < i; ++j) (void)locker_->unlock(rs[j], false);
            return tl::unexpected(r.error());
        }
        added += *r;
    }
    st.tier_ = Tier::Locked;
    st.locked_bytes_ = added;
    return added;
}

Result<uint64_t> ModelResidency::release(uint32_t slot, bool drop) {
    SlotState& st = state_mut(slot);
    if (st.tier() != Tier::Locked) return uint64_t{0};
    uint64_t freed = 0;
    for (const auto& r : ranges(slot)) freed += MC_TRY(locker_->unlock(r, drop));
    if (drop) {
        dropped_bytes_ += std::max(st.cached_bytes_, freed);
        st.cached_bytes_ = 0;
    }
    st.tier_ = Tier::Storage;
    st.locked_bytes_ = 0;
    return freed;
}

Result<uint64_t> ModelResidency::resident_bytes(uint32_t slot) {
    uint64_t b = 0;
    for (const auto& r : ranges(slot)) b += MC_TRY(probes_[r.file].resident_bytes(r.offset, r.length));
    return b;
}

Result<void> ModelResidency::refresh_cached() {
    for (uint32_t s = 0; s < slots_.size(); ++s) slots_[s].cached_bytes_ = MC_TRY(resident_bytes(s));
    dense_.cached_bytes_ = MC_TRY(resident_bytes(kDenseSlot));
    return {};
}

void ModelResidency::set_vram(uint32_t slot, uint32_t holders, bool ram_released) {
    if (slot >= slots_.size()) return;
    if (vram_.empty()) {
        if (holders == 0 && !ram_released) return;
        vram_.assign(slots_.size(), 0);
        vram_only_.assign(slots_.size(), 0);
    }
    vram_[slot] = holders;
    vram_only_[slot] = ram_released ? 1 : 0;
}

bool ModelResidency::set_vram_bound(std::vector<uint8_t> bound) {
    if (!bound.empty() && bound.size() != slots_.size()) bound.clear();
    if (bound == vram_bound_ ||
        (bound.empty() && std::none_of(vram_bound_.begin(), vram_bound_.end(), [](uint8_t b) { return b != 0; })))
        return false;
    vram_bound_ = std::move(bound);
    return true;
}

void ModelResidency::drop_cached(uint32_t slot) {
    dropped_bytes_ += state(slot).cached_bytes();
    state_mut(slot).cached_bytes_ = 0;
    drop_ranges(ranges(slot));
}

void ModelResidency::drop_cached(std::span<const uint32_t> slots) {
    std::vector<ByteRange> all;
    for (uint32_t s : slots) {
        dropped_bytes_ += state(s).cached_bytes();
        state_mut(s).cached_bytes_ = 0;
        for (const auto& r : ranges(s)) all.push_back(r);
    }
    std::sort(all.begin(), all.end(), [](const ByteRange& a, const ByteRange& b) {
        return std::tie(a.file, a.offset) < std::tie(b.file, b.offset);
    });
    std::vector<ByteRange> merged;
    for (const auto& r : all) {
        if (!merged.empty() && merged.back().file == r.file && merged.back().offset + merged.back().length >= r.offset)
            merged.back().length = std::max(merged.back().offset + merged.back().length, r.offset + r.length) - merged.back().offset;
        else
            merged.push_back(r);
    }
    drop_ranges(merged);
}

void ModelResidency::drop_ranges(const std::vector<ByteRange>& rs) {
    const uint64_t ps = PageLocker::page_size();
    for (const auto& r : rs) {
        const uint64_t first = (r.offset + ps - 1) / ps, last = (r.offset + r.length) / ps;  // [first, last)
        if (last <= first) continue;
        const auto& f = model_->files()[r.file];
        // Our own mapping may still map them (a lock released without dropping): zapped first.
        drop_file_pages(f.fd.get(), f.mapping.data(), f.mapping.length(), first, last - first);
    }
}

ModelView ModelResidency::view(uint64_t budget) const {
    ModelView v;
    v.heat = heat_.get();
    v.locked.resize(slots_.size());
    v.slot_bytes = slot_bytes_;
    for (uint32_t s = 0; s < slots_.size(); ++s) {
        v.locked[s] = slots_[s].tier() == Tier::Locked;
    }
    v.pinned = pinned_;
    if (!keep_ram_copy_ && (!vram_only_.empty() || !vram_bound_.empty())) {
        v.in_vram.resize(slots_.size());
        for (uint32_t s = 0; s < slots_.size(); ++s)
            v.in_vram[s] = (s < vram_only_.size() && vram_only_[s]) || !read_for_ram(s);
    }
    v.dense_wanted = config_.lock_dense;
    v.dense_locked = dense_.tier() == Tier::Locked;
    v.dense_bytes = dense_bytes_;
    v.budget = budget;
    return v;
}

uint64_t ModelResidency::reads_pending_bytes() const {
    uint64_t b = 0;
    for (uint32_t s = 0; s < n_slots(); ++s)
        if (state(s).tier() == Tier::Fetching || cache_reads_.count(s)) b += slot_length(s);
    return b;
}

}  // namespace moecache::daemon
