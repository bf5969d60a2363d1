#include "moecache/cuda/vram_pool.h"

#include <algorithm>
#include <cstddef>
#include <numeric>

namespace moecache::cuda {

uint64_t next_draw(uint64_t& state) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

void ExpertHeat::add_model(uint32_t model, uint32_t n_experts) {
    if (heat_.size() <= model) heat_.resize(model + 1);
    if (promoted_.size() <= model) promoted_.resize(model + 1);
    experts_ += n_experts - heat_[model].size();
    heat_[model].resize(n_experts, 0);
    promoted_[model].resize(n_experts, 0);
    if (last_.size() <= model) last_.resize(model + 1);
    last_[model].resize(n_experts, 0);
    if (window_.size() <= model) window_.resize(model + 1, 0);
    for (auto& g : ghosts_) {
        if (g.at.size() <= model) g.at.resize(model + 1);
        g.at[model].resize(n_experts, 0);
    }
}

void ExpertHeat::set_recent_window(uint32_t model, uint32_t touches) {
    if (model < window_.size()) window_[model] = std::min(touches, kPromoted / 4);
}

bool ExpertHeat::recent(uint32_t model, uint32_t expert) const {
    const uint32_t w = window_[model], last = last_[model][expert];
    return w > 0 && last != 0 && stamp_ - last <= w;
}

// An expert not promoted, in the recency part: by its last touch (an LRU); or, with the window,
// the last token's experts just under the promoted, the most lately touched highest, and the rest
// by count, under every one of those.
uint32_t ExpertHeat::recency_rank(uint32_t model, uint32_t expert, bool window) const {
    if (!window) return last_[model][expert];
    if (recent(model, expert)) return kPromoted - 1 - (stamp_ - last_[model][expert]);
    return std::min(heat_[model][expert], kPromoted - 2 - window_[model]);
}

// The member of a ghost its ranking puts last among kDrawn drawn (as the pool draws), let go.
void ExpertHeat::ghost_evict(Ghost& g, bool window) {
    constexpr int kDrawn = 32;
    size_t victim = 0;
    uint32_t worst = UINT32_MAX;
    for (int k = 0; k < kDrawn; ++k) {
        const size_t i = next_draw(ghost_rng_) % g.members.size();
        const auto [m, e] = g.members[i];
        if (const uint32_t r = recency_rank(m, e, window); r < worst) {
            worst = r;
            victim = i;
        }
    }
    const auto [vm, ve] = g.members[victim];
    g.at[vm][ve] = 0;
    if (victim + 1 != g.members.size()) {
        g.members[victim] = g.members.back();
        g.at[g.members[victim].first][g.members[victim].second] = static_cast<uint32_t>(victim + 1);
    }
    g.members.pop_back();
}

// One touch of an expert not promoted, before it is stamped: a hit in each ghost that holds it,
// else it enters, in place of the one that ghost's ranking puts last.
void ExpertHeat::ghost_touch(uint32_t model, uint32_t expert) {
    const uint32_t room = capacity_ > promoted_count_ ? capacity_ - promoted_count_ : 0;
    if (room == 0) return;
    constexpr uint64_t kWindow = 4096;  // the scores' running mean, in touches
    ++ghost_events_;
    const double w = 1.0 / static_cast<double>(std::min(ghost_events_, kWindow));
    for (unsigned r = 0; r < 2; ++r) {
        Ghost& g = ghosts_[r];
        const bool hit = g.at[model][expert] != 0;
        g.score += ((hit ? 1.0 : 0.0) - g.score) * w;
        if (hit) continue;
        while (g.members.size() >= room) ghost_evict(g, r == 1);
        g.members.emplace_back(model, expert);
        g.at[model][expert] = static_cast<uint32_t>(g.members.size());
    }
    // After a run of touches; then only on a clear lead either way.
    constexpr double kLead = 0.01;
    if (ghost_events_ >= 2048) {
        if (!window_on_ && ghosts_[1].score > ghosts_[0].score + kLead) window_on_ = true;
        else if (window_on_ && ghosts_[0].score > ghosts_[1].score + kLead) window_on_ = false;
    }
}

void ExpertHeat::touch(uint32_t model, uint32_t expert, uint32_t amount) {
    if (model >= heat_.size() || expert >= heat_[model].size()) return;
    if (recency_ && !promoted_[model][expert] && window_[model] > 0) ghost_touch(model, expert);
    auto& h = heat_[model][expert];
    h = h >= kPromoted - 1 - amount ? kPromoted - 1 : h + amount;
    touches_ += amount;
    if (++stamp_ >= kPromoted - 1) {  // order kept, room made
        for (auto& m : last_)
            for (auto& v : m) v /= 2;
        stamp_ /= 2;
    }
    last_[model][expert] = stamp_;
    if (touches_ >= 64 * std::max<uint64_t>(experts_, 1)) {
        for (auto& m : heat_)
            for (auto& v : m) v /= 2;
        touches_ = 0;
    }
}

void ExpertHeat::set(uint32_t model, uint32_t expert, uint32_t value) {
    if (model < heat_.size() && expert < heat_[model].size()) heat_[model][expert] = std::min(value, kPromoted - 1);
}

void ExpertHeat::set_promoted(uint32_t model, uint32_t expert, bool promoted) {
    if (model >= promoted_.size() || expert >= promoted_[model].size()) return;
    auto& p = promoted_[model][expert];
    if ((p != 0) != promoted) promoted ? ++promoted_count_ : --promoted_count_;
    p = promoted ? 1 : 0;
}

void ExpertHeat::forget(uint32_t model, double keep) {
    if (model >= heat_.size()) return;
    keep = std::clamp(keep, 0.0, 1.0);
    for (auto& v : heat_[model]) v = static_cast<uint32_t>(static_cast<double>(v) * keep);
}

uint32_t ExpertHeat::heat(uint32_t model, uint32_t expert) const {
    if (model >= heat_.size() || expert >= heat_[model].size()) return 0;
    if (promoted_[model][expert]) return heat_[model][expert] + kPromoted;
    return recency_ ? recency_rank(model, expert, window_on_) : heat_[model][expert];
}

uint32_t ExpertHeat::count(uint32_t model, uint32_t expert) const {
    return model < heat_.size() && expert < heat_[model].size() ? heat_[model][expert] : 0;
}

uint32_t ExpertHeat::hottest() const {
    uint32_t h = 0;
    for (uint32_t m = 0; m < heat_.size(); ++m)
        for (uint32_t e = 0; e < heat_[m].size(); ++e) h = std::max(h, heat(m, e));
    return h;
}

void VramPool::add_arena(uint64_t slot_bytes, uint64_t base, uint32_t count, uint32_t tail_room) {
    if (slot_bytes == 0 || count == 0) return;
    auto* c = class_for(slot_bytes);
    if (c == nullptr) {
        classes_.push_back(SizeClass{slot_bytes, tail_room, {}, {}});
        c = &classes_.back();
    }
    // One tail room per size class: the first arena's (slots of one class are interchangeable).
    tail_room = c->tail_room;
    const uint64_t stride = slot_bytes + tail_room;
    const auto cls = static_cast<uint32_t>(c - classes_.data());
    const auto arena = static_cast<uint32_t>(arenas_.size());
    arenas_.push_back(Arena{base, stride * count, cls, static_cast<uint32_t>(slots_.size()), count, true});
    for (uint32_t i = 0; i < count; ++i) {
        const auto id = static_cast<uint32_t>(slots_.size());
        slots_.push_back(Slot{base + uint64_t{i} * stride, arena});
        c->slots.push_back(id);
        c->free.push_back(id);
    }
    // Hand out low addresses first (a fresh pool then reads like one array).
    std::reverse(c->free.begin(), c->free.end());
    stats_.slots += count;
    stats_.bytes += stride * count;
}

void VramPool::add_model(uint32_t model, uint32_t n_slices, uint32_t n_experts) {
    if (slot_of_.size() <= model) {
        slot_of_.resize(model + 1);
        pooled_.resize(model + 1);
    }
    slot_of_[model].resize(n_slices, kNoSlot);
    pooled_[model].resize(n_experts, 0);
}

StreamOrder& same_stream_only() {
    struct None final : StreamOrder {
        bool join(StreamId) override { return false; }
    };
    static None none;
    return none;
}

bool VramPool::take(uint32_t id, StreamId stream, StreamOrder& order) {
    auto& sl = slots_[id];
    if (sl.stream == stream || sl.stream == 0) {
        sl.stream = stream;
        return true;
    }
    if (!order.join(sl.stream)) {
        ++stats_.cross_stream;
        return false;
    }
    ++stats_.joined;
    sl.stream = stream;
    return true;
}

uint64_t VramPool::lookup(const SliceRef& s, StreamId stream, StreamOrder& order, uint32_t* tail) {
    if (tail != nullptr) *tail = 0;
    if (s.model >= slot_of_.size() || s.slice >= slot_of_[s.model].size()) return 0;
    const uint32_t id = slot_of_[s.model][s.slice];
    if (id == kNoSlot || slots_[id].filling || !take(id, stream, order)) return 0;
    if (tail != nullptr) *tail = slots_[id].tail;
    return slots_[id].address;
}

uint32_t VramPool::tail_room(uint64_t slot_bytes) const {
    for (const auto& c : classes_)
        if (c.slot_bytes == slot_bytes) return c.tail_room;
    return 0;
}

VramPool::SizeClass* VramPool::class_for(uint64_t slot_bytes) {
    for (auto& c : classes_)
        if (c.slot_bytes == slot_bytes) return &c;
    return nullptr;
}

bool VramPool::has_class(uint64_t slot_bytes) const {
    return std::any_of(classes_.begin(), classes_.end(), [&](const SizeClass& c) { return c.slot_bytes == slot_bytes; });
}

uint64_t VramPool::class_bytes(uint64_t slot_bytes) const {
    for (const auto& c : classes_)
        if (c.slot_bytes == slot_bytes) return (c.slot_bytes + c.tail_room) * c.slots.size();
    return 0;
}

uint64_t VramPool::next_random() { return next_draw(rng_); }

void VramPool::empty_slot(uint32_t id) {
    auto& sl = slots_[id];
    sl.filling = false;
    sl.tail = 0;
    if (sl.model == kNoSlot) return;
    slot_of_[sl.model][sl.slice] = kNoSlot;
    auto& n = pooled_[sl.model][sl.expert];
    if (n > 0) --n;
    sl.model = kNoSlot;
    --stats_.used;
}

uint64_t VramPool::admit(const SliceRef& s, uint64_t slice_bytes, StreamId stream, const ExpertHeat& heat,
                         StreamOrder& order, SliceRef* evicted, bool evict) {
    if (evicted != nullptr) evicted->model = kNoSlot;
    if (s.model >= slot_of_.size() || s.slice >= slot_of_[s.model].size() || s.expert >= pooled_[s.model].size())
        return 0;
    if (slot_of_[s.model][s.slice] != kNoSlot) return 0;  // pooled, only busy or not ours to take
    auto* c = class_for(slice_bytes);
    if (c == nullptr || c->slots.empty()) return 0;
    uint32_t id = kNoSlot;
    // A free slot: one never used or last used on this stream first, else one another stream used,
    // once ordered after it.
    size_t pick = c->free.size();
    for (size_t k = 0; k < c->free.size() && k < 16; ++k) {
        const size_t at = c->free.size() - 1 - k;
        const auto& sl = slots_[c->free[at]];
        if (sl.stream == 0 || sl.stream == stream) {
            pick = at;
            break;
        }
        if (pick == c->free.size()) pick = at;
    }
    if (pick < c->free.size() && take(c->free[pick], stream, order)) {
        id = c->free[pick];
        c->free.erase(c->free.begin() + static_cast<std::ptrdiff_t>(pick));
    }
    if (id == kNoSlot) {
        if (!evict) {
            ++stats_.declined;
            return 0;
        }
        // Sampled LFU: the coldest of a few random slots, if colder than the newcomer. Strictly
        // colder, so that equals do not displace each other (no churn). A newcomer the daemon did
        // not promote can only take the place of another it did not promote: the sample is drawn
        // among those (up to kDraws tries; a part of 1/32 of the pool is missed 3 times in 10 000),
        // so that a small recency part of a pool the daemon directs is an LRU and not a lottery
        // (bursty routing at 25 % of VRAM, an eighth of the pool to recency: 8 slots drawn from the
        // whole pool held 80.7 % of the routings, 8 of the part not promoted 85.8 %). 32 drawn, not
        // 8: an LRU part of half the pool then evicts nearer its oldest (bursty routing at 10 % of
        // VRAM: 73.4 % held against 72.2; 32 reads of slots an admission, ~0.2 us).
        constexpr int kSample = 32, kDraws = 1024;
        const uint32_t mine = heat.heat(s.model, s.expert);
        uint32_t best = kNoSlot, best_heat = mine;
        for (int k = 0, drawn = 0; k < kSample && drawn < kDraws; ++drawn) {
            const uint32_t cand = c->slots[next_random() % c->slots.size()];
            const auto& sl = slots_[cand];
            if (sl.model == kNoSlot || sl.filling) continue;
            const uint32_t h = heat.heat(sl.model, sl.expert);
            if (mine < ExpertHeat::kPromoted && h >= ExpertHeat::kPromoted) continue;
            ++k;
            if (h < best_heat) {
                best = cand;
                best_heat = h;
            }
        }
        if (best == kNoSlot || !take(best, stream, order)) {
            ++stats_.declined;
            return 0;
        }
        if (evicted != nullptr) *evicted = SliceRef{slots_[best].model, slots_[best].slice, slots_[best].expert};
        empty_slot(best);
        ++stats_.evicted;
        id = best;
    }
    auto& sl = slots_[id];
    sl.model = s.model;
    sl.slice = s.slice;
    sl.expert = s.expert;
    sl.stream = stream;
    sl.filling = true;
    slot_of_[s.model][s.slice] = id;
    ++pooled_[s.model][s.expert];
    ++stats_.used;
    ++stats_.admitted;
    return sl.address;
}

uint64_t VramPool::commit(const SliceRef& s, uint32_t tail) {
    if (s.model >= slot_of_.size() || s.slice >= slot_of_[s.model].size()) return 0;
    const uint32_t id = slot_of_[s.model][s.slice];
    if (id == kNoSlot || !slots_[id].filling) return 0;
    auto& sl = slots_[id];
    sl.filling = false;
    sl.tail = std::min(tail, classes_[arenas_[sl.arena].size_class].tail_room);
    return sl.address;
}

uint64_t VramPool::filling_address(const SliceRef& s) const {
    if (s.model >= slot_of_.size() || s.slice >= slot_of_[s.model].size()) return 0;
    const uint32_t id = slot_of_[s.model][s.slice];
    return id != kNoSlot && slots_[id].filling ? slots_[id].address : 0;
}

void VramPool::drop(uint32_t model, uint32_t slice) {
    if (model >= slot_of_.size() || slice >= slot_of_[model].size()) return;
    const uint32_t id = slot_of_[model][slice];
    if (id == kNoSlot) return;
    empty_slot(id);
    classes_[arenas_[slots_[id].arena].size_class].free.push_back(id);
}

uint32_t VramPool::drop_expert(uint32_t model, uint32_t expert) {
    uint32_t n = 0;
    for (uint32_t id = 0; id < slots_.size(); ++id) {
        const auto& sl = slots_[id];
        if (sl.live && sl.model == model && sl.expert == expert) {
            drop(model, sl.slice);
            ++n;
        }
    }
    return n;
}

uint32_t VramPool::pooled_slices(uint32_t model, uint32_t expert) const {
    return model < pooled_.size() && expert < pooled_[model].size() ? pooled_[model][expert] : 0;
}

std::vector<uint64_t> VramPool::release(uint64_t bytes, const ExpertHeat& heat) {
    std::vector<uint64_t> out;
    std::vector<uint32_t> order;
    std::vector<uint64_t> warmth(arenas_.size(), 0);
    for (uint32_t a = 0; a < arenas_.size(); ++a) {
        if (!arenas_[a].live) continue;
        order.push_back(a);
        for (uint32_t i = 0; i < arenas_[a].count; ++i) {
            const auto& sl = slots_[arenas_[a].first_slot + i];
            if (sl.model != kNoSlot) warmth[a] += heat.heat(sl.model, sl.expert);
        }
    }
    std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) { return warmth[x] < warmth[y]; });
    uint64_t freed = 0;
    for (uint32_t a : order) {
        if (freed >= bytes) break;
        auto& ar = arenas_[a];
        for (uint32_t i = 0; i < ar.count; ++i) {
            empty_slot(ar.first_slot + i);
            slots_[ar.first_slot + i].live = false;
        }
        auto& c = classes_[ar.size_class];
        auto dead = [&](uint32_t id) { return !slots_[id].live; };
        c.slots.erase(std::remove_if(c.slots.begin(), c.slots.end(), dead), c.slots.end());
        c.free.erase(std::remove_if(c.free.begin(), c.free.end(), dead), c.free.end());
        ar.live = false;
        stats_.slots -= ar.count;
        stats_.bytes -= ar.bytes;
        freed += ar.bytes;
        out.push_back(ar.base);
    }
    return out;
}

VramPoolStats VramPool::stats() const { return stats_; }

}  // namespace moecache::cuda
