// The VRAM expert pool of one device, and the local placement policy that fills it when the daemon
// is away: which expert slices sit in which slot, what a miss may evict. Pure bookkeeping over
// device addresses the caller allocated: no CUDA here, so CI tests every rule without a GPU.
//
// Ordering, the rule that keeps copies byte-identical: every slot remembers the stream that last
// queued work on it (a fill or a read). A copy on another stream uses the slot only after its
// stream has been ordered after that work (StreamOrder::join, an event wait on a GPU); the slot is
// then its stream's. So no read overtakes the fill it needs and no fill overtakes a read queued
// elsewhere, whichever stream comes next: a runtime's new context (new streams) finds the pool as
// the old one left it. A slot being filled is nobody else's until the fill is queued (commit).
#pragma once

#include <cstdint>
#include <vector>

namespace moecache::cuda {

// The next of a cheap pseudo-random sequence (xorshift64; `state` nonzero): the draws of the pool's
// sampled evictions, of the heat's ghosts, and of the backend's arm to try.
uint64_t next_draw(uint64_t& state);

inline constexpr uint32_t kNoSlot = UINT32_MAX;

// Decayed use counts per expert: what the local policy knows. Counts halve after 64 uses per
// expert in total, so an expert that went cold loses its place within about a thousand tokens.
// (64, not 16: replayed traces showed counts that halve sooner too noisy to rank experts of a
// near-uniform router, 1 point below LFU at half the experts pooled; docs/sim.md.)
// An expert the daemon promoted ranks above every expert it did not, and by its count among those
// it did.
class ExpertHeat {
public:
    static constexpr uint32_t kPromoted = 1u << 30;
    void add_model(uint32_t model, uint32_t n_experts);
    void touch(uint32_t model, uint32_t expert, uint32_t amount = 1);
    void set(uint32_t model, uint32_t expert, uint32_t value);
    void set_promoted(uint32_t model, uint32_t expert, bool promoted);
    [[nodiscard]] uint32_t heat(uint32_t model, uint32_t expert) const;  // with the promotion
    [[nodiscard]] uint32_t count(uint32_t model, uint32_t expert) const;  // the decayed count alone
    [[nodiscard]] uint32_t hottest() const;
    // The model's routing shifted (the daemon saw it and said so: a Shifted directive): its counts
    // learnt before are cut to `keep` of what they were (kKeepAtShift, moecache/routing_shift.h,
    // as the daemon cuts its heat).
    void forget(uint32_t model, double keep);
    // Recency for what was not promoted: where the daemon directs the pool by frequency (the
    // share its split learnt: daemon/heat.h, pool_wanted), the rest of the pool is the recency
    // part, and an expert not promoted ranks by when it was last touched (an LRU of that part)
    // instead of by its count.
    void set_recency(bool on) { recency_ = on; }
    [[nodiscard]] bool recency() const { return recency_; }

    // How the recency part ranks, learnt here from the routing. An LRU keeps what was used lately,
    // however lately; where a token reuses only what the token before it used (bursty routing),
    // that LRU also keeps older experts where the hottest would do better. The other ranking puts
    // what a token's touches ago was touched (the last token's experts of every layer: `window`,
    // experts used x layers, set_recent_window) first, the most lately touched highest, and the
    // rest by their count. Both are replayed as ghosts of the part's room (capacity less what is
    // promoted) over the touches of experts not promoted, and the second is taken where it holds
    // a point more (moecache-sim --table, VRAM: bursty 10 % 73.4 -> 74.9, qwen3-next-like as an
    // LRU; the second alone lost 7.6 points there: its reuse lasts many tokens).
    void set_capacity(uint32_t experts) { capacity_ = experts; }
    void set_recent_window(uint32_t model, uint32_t touches);
    [[nodiscard]] bool window_ranking() const { return window_on_; }
    [[nodiscard]] double ghost_score(unsigned ranking) const { return ranking < 2 ? ghosts_[ranking].score : 0; }

private:
    std::vector<std::vector<uint32_t>> heat_;  // [model][expert], below kPromoted
    std::vector<std::vector<uint32_t>> last_;  // [model][expert]: stamp_ at its last touch
    std::vector<std::vector<uint8_t>> promoted_;
    std::vector<uint32_t> window_;  // [model]: set_recent_window
    uint32_t capacity_ = 0, promoted_count_ = 0;
    struct Ghost {  // the recency part's room, replayed with one ranking
        std::vector<std::pair<uint32_t, uint32_t>> members;  // (model, expert)
        std::vector<std::vector<uint32_t>> at;               // [model][expert]: index + 1 in members, 0: out
        double score = 0;
    };
    Ghost ghosts_[2];  // 0: an LRU; 1: the last token's first, then counts
    uint64_t ghost_events_ = 0, ghost_rng_ = 0x9e3779b97f4a7c15ull;
    bool window_on_ = false;
    [[nodiscard]] bool recent(uint32_t model, uint32_t expert) const;
    [[nodiscard]] uint32_t recency_rank(uint32_t model, uint32_t expert, bool window) const;
    void ghost_evict(Ghost& g, bool window);
    void ghost_touch(uint32_t model, uint32_t expert);
    uint64_t experts_ = 0, touches_ = 0;
    uint32_t stamp_ = 0;  // below kPromoted: halved with every last_ when it would reach it
    bool recency_ = false;
};

// A slice of an expert tensor: model-local slice index, and the model-local expert it belongs to.
struct SliceRef {
    uint32_t model = 0;
    uint32_t slice = 0;
    uint32_t expert = 0;
};

// A stream as the pool's user names it: never reused for another stream (0: none).
using StreamId = uint64_t;

// Orders the calling copy's stream after another stream's work queued so far. false: it could not,
// and the slot is left as it is (a miss).
class StreamOrder {
public:
    virtual bool join(StreamId from) = 0;

protected:
    ~StreamOrder() = default;
};
// Orders nothing: only slots last used on the caller's own stream are used (the replay, tests).
StreamOrder& same_stream_only();

struct VramPoolStats {
    uint64_t slots = 0, used = 0, bytes = 0;
    uint64_t admitted = 0, evicted = 0, declined = 0;
    uint64_t joined = 0;        // slots taken over from another stream
    uint64_t cross_stream = 0;  // slots another stream held that could not be taken over
};

class VramPool {
public:
    // `count` slots of `slot_bytes` each, plus `tail_room` bytes after each for the head of the
    // slice that follows it in its tensor, at base, base + slot_bytes + tail_room, ... (one device
    // allocation). A runtime that copies a slice with the next one's head (llama.cpp's padding)
    // then gets both from one slot in one copy.
    void add_arena(uint64_t slot_bytes, uint64_t base, uint32_t count, uint32_t tail_room = 0);
    void add_model(uint32_t model, uint32_t n_slices, uint32_t n_experts);

    // The device address of the slice when it is pooled and readable on `stream` (taken over from
    // another stream through `order` where needed), else 0. `tail`, when given, learns how many
    // bytes after the slice the slot holds (the next slice's head; see commit).
    [[nodiscard]] uint64_t lookup(const SliceRef& s, StreamId stream, StreamOrder& order = same_stream_only(),
                                  uint32_t* tail = nullptr);
    // A slot for a slice that missed, whose bytes the caller copies in on `stream` after the
    // runtime's own copy, then says so with commit(); until then the slot is nobody's. 0 when the
    // policy declines: no slot of that size, or (evict false, or every sampled victim as hot as the
    // slice) no free one. `evicted`, when given, learns which slice made room (model kNoSlot: none).
    [[nodiscard]] uint64_t admit(const SliceRef& s, uint64_t slice_bytes, StreamId stream, const ExpertHeat& heat,
                                 StreamOrder& order = same_stream_only(), SliceRef* evicted = nullptr,
                                 bool evict = true);
    // The fill of an admitted slice is queued: the slot serves lookups from now on. Returns its
    // address, or 0 when the slot was taken away meanwhile (released, dropped): then copy nothing.
    // `tail`: bytes after the slice the fill also writes (at most the class's tail room).
    uint64_t commit(const SliceRef& s, uint32_t tail = 0);
    // The address of the slot admitted for the slice and not yet committed, or 0: whether a copy
    // queued for it earlier still has its slot (the slice may have been dropped and admitted anew,
    // elsewhere, meanwhile).
    [[nodiscard]] uint64_t filling_address(const SliceRef& s) const;
    // Bytes after each slot of this size for the next slice's head (add_arena's tail_room).
    [[nodiscard]] uint32_t tail_room(uint64_t slot_bytes) const;
    // Empties the slice's slot (an admission whose copy failed, or a demotion).
    void drop(uint32_t model, uint32_t slice);
    // Empties every slot of the expert; returns how many.
    uint32_t drop_expert(uint32_t model, uint32_t expert);
    // How many of the expert's slices are pooled.
    [[nodiscard]] uint32_t pooled_slices(uint32_t model, uint32_t expert) const;
    // Whether the slice has a slot (filled or being filled).
    [[nodiscard]] bool holds(uint32_t model, uint32_t slice) const {
        return model < slot_of_.size() && slice < slot_of_[model].size() && slot_of_[model][slice] != kNoSlot;
    }
    // Gives up whole arenas until at least `bytes` are free, coldest first; returns their base
    // addresses, to be freed once the device has finished what it queued.
    std::vector<uint64_t> release(uint64_t bytes, const ExpertHeat& heat);
    [[nodiscard]] bool has_class(uint64_t slot_bytes) const;
    // Bytes of live slots of this size, their tail rooms included.
    [[nodiscard]] uint64_t class_bytes(uint64_t slot_bytes) const;
    [[nodiscard]] VramPoolStats stats() const;

private:
    struct Slot {
        uint64_t address = 0;
        uint32_t arena = 0;
        uint32_t model = kNoSlot, slice = 0, expert = 0;  // model == kNoSlot: empty
        uint32_t tail = 0;  // bytes after the slice it holds
        StreamId stream = 0;  // the last stream that queued work on it; 0: never used
        bool live = true;
        bool filling = false;  // admitted, its fill not queued yet
    };
    struct SizeClass {
        uint64_t slot_bytes = 0;
        uint32_t tail_room = 0;
        std::vector<uint32_t> slots;  // live slots of this size
        std::vector<uint32_t> free;
    };
    struct Arena {
        uint64_t base = 0, bytes = 0;
        uint32_t size_class = 0, first_slot = 0, count = 0;
        bool live = true;
    };
    void empty_slot(uint32_t slot);
    // Makes the slot `stream`'s, ordering after its last stream where that is another.
    bool take(uint32_t slot, StreamId stream, StreamOrder& order);
    SizeClass* class_for(uint64_t slot_bytes);
    uint64_t next_random();

    std::vector<Slot> slots_;
    std::vector<SizeClass> classes_;
    std::vector<Arena> arenas_;
    std::vector<std::vector<uint32_t>> slot_of_;  // [model][slice]
    std::vector<std::vector<uint16_t>> pooled_;   // [model][expert]: slices pooled
    uint64_t rng_ = 0x9e3779b97f4a7c15ull;
    VramPoolStats stats_;
};

}  // namespace moecache::cuda
