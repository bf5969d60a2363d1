#include "moecache/sim/replay.h"

#include "moecache/cuda/vram_pool.h"
#include "moecache/daemon/decide.h"
#include "moecache/daemon/heat.h"
#include "moecache/daemon/predictor.h"
#include "moecache/routing_shift.h"

#include <algorithm>
#include <map>
#include <set>
#include <span>

namespace moecache::sim {
namespace {

enum class Where { Vram, Ram, Staged, Storage };

// A daemon's loop turns between two ticks, at most (its turns are milliseconds apart).
constexpr int kMaxTurnsPerTick = 4096;

// Accounts accesses and moves for one policy.
class Ledger {
public:
    Ledger(const Setup& s, std::string policy) : s_(s) { r_.policy = std::move(policy); }

    void access(Where w, uint64_t bytes) {
        ++r_.accesses;
        read_ += bytes;
        switch (w) {
            case Where::Vram:
                ++r_.vram_hits;
                r_.demand.d2d += bytes;
                break;
            case Where::Ram:
                ++r_.ram_hits;
                if (s_.device()) r_.demand.h2d += bytes;
                break;
            case Where::Staged: ++r_.staged_hits; break;
            case Where::Storage:
                r_.demand.storage += bytes;
                if (s_.device()) r_.demand.h2d += bytes;
                break;
        }
    }
    // Moved ahead of use: from storage to RAM, or to the device from `from`.
    void ahead_to_ram(uint64_t bytes) { r_.ahead.storage += bytes; }
    void ahead_to_device(Where from, uint64_t bytes) {
        if (from == Where::Storage) r_.ahead.storage += bytes;
        r_.ahead.h2d += bytes;
    }
    void tokens(uint64_t n) { r_.tokens += n; }

    // Whether the link speculation uses (storage without a device, host -> device with one) is
    // busier than the critical path so far: speculation would only add to the backlog.
    [[nodiscard]] bool link_behind() const {
        const double busy = s_.device() ? static_cast<double>(r_.demand.h2d + r_.ahead.h2d) / h2d()
                                   : static_cast<double>(r_.demand.storage + r_.ahead.storage) / s_.links.storage;
        return busy > critical_seconds();
    }

    SimResult finish() {
        const Links& k = s_.links;
        r_.critical_seconds = critical_seconds();
        r_.busiest_link_seconds = std::max({seconds(r_.demand.storage + r_.ahead.storage, k.storage),
                                            seconds(r_.demand.h2d + r_.ahead.h2d, h2d()),
                                            seconds(r_.demand.d2d + r_.ahead.d2d, k.d2d), compute_seconds()});
        return r_;
    }

private:
    static double seconds(uint64_t bytes, double bandwidth) { return static_cast<double>(bytes) / bandwidth; }
    [[nodiscard]] double h2d() const { return s_.links.pinned ? s_.links.h2d_pinned : s_.links.h2d_pageable; }
    [[nodiscard]] double compute_seconds() const {
        return seconds(read_, s_.device() ? s_.links.device_memory : s_.links.host_memory);
    }
    [[nodiscard]] double critical_seconds() const {
        return compute_seconds() + seconds(r_.demand.storage, s_.links.storage) + seconds(r_.demand.h2d, h2d()) +
               seconds(r_.demand.d2d, s_.links.d2d);
    }

    const Setup& s_;
    SimResult r_;
    uint64_t read_ = 0;
};

// The kernel's page cache over the RAM the planner has not locked: LRU.
class PageCache {
public:
    explicit PageCache(size_t n_slots) : stamp_(n_slots, 0) {}
    [[nodiscard]] bool has(uint32_t slot) const { return stamp_[slot] != 0; }
    void touch(uint32_t slot, uint64_t bytes) {
        if (has(slot)) {
            order_.erase({stamp_[slot], slot});
        } else {
            bytes_ += bytes;
        }
        stamp_[slot] = ++clock_;
        order_.insert({stamp_[slot], slot});
    }
    // Put in as the first to go (pages the daemon unlocked: still mapped, not recently used).
    void insert_cold(uint32_t slot, uint64_t bytes) {
        if (has(slot)) return;
        bytes_ += bytes;
        stamp_[slot] = order_.empty() ? 1 : std::max<uint64_t>(order_.begin()->first, 2) - 1;
        order_.insert({stamp_[slot], slot});
    }
    void remove(uint32_t slot, uint64_t bytes) {
        if (!has(slot)) return;
        order_.erase({stamp_[slot], slot});
        stamp_[slot] = 0;
        bytes_ -= bytes;
    }
    template <typename BytesOf>
    void shrink_to(uint64_t cap, BytesOf bytes_of) {
        while (bytes_ > cap && !order_.empty()) {
            const uint32_t slot = order_.begin()->second;
            remove(slot, bytes_of(slot));
        }
    }

private:
    std::vector<uint64_t> stamp_;  // 0: not cached
    std::set<std::pair<uint64_t, uint32_t>> order_;
    uint64_t clock_ = 1, bytes_ = 0;
};

}  // namespace

Predictions predict(const Trace& trace, const TraceModel& model, Predict mode, uint32_t k) {
    Predictions p;
    p.mode = mode == Predict::NextLayer ? "next-layer" : mode == Predict::NextToken ? "next-token" : "both";
    const auto n_layers = static_cast<uint32_t>(model.blocks.size());
    daemon::RoutePredictor predictor(n_layers, model.n_experts);
    std::vector<size_t> index;  // the model's decisions
    for (size_t i = 0; i < trace.decisions.size(); ++i)
        if (trace.decisions[i].model == model.id) index.push_back(i);
    p.staged.resize(index.size());
    std::vector<char> has_prediction(index.size(), 0);
    // Next token: the next decision of the same layer.
    std::vector<size_t> next_same_layer(index.size(), SIZE_MAX);
    {
        std::vector<size_t> last(n_layers, SIZE_MAX);
        for (size_t j = index.size(); j-- > 0;) {
            const uint32_t l = trace.decisions[index[j]].layer;
            next_same_layer[j] = last[l];
            last[l] = j;
        }
    }
    std::vector<uint32_t> guess;
    for (size_t j = 0; j < index.size(); ++j) {
        const auto& d = trace.decisions[index[j]];
        // A prompt batch's report (the experts more of its tokens chose than an even share) is not
        // one token's routing: the predictor neither learns from it nor predicts from it (as the
        // daemon's, intake/intake.cpp).
        if (d.tokens != 1) continue;
        const uint32_t kk = k ? k : static_cast<uint32_t>(d.experts.size());
        auto stage = [&](size_t target) {
            auto& dst = p.staged[target];
            for (uint32_t e : guess)
                if (std::find(dst.begin(), dst.end(), e) == dst.end()) dst.push_back(e);
            has_prediction[target] = 1;
        };
        if ((mode == Predict::NextLayer || mode == Predict::Both) && j + 1 < index.size() &&
            trace.decisions[index[j + 1]].layer == d.layer + 1) {
            predictor.predict_next_layer(d.layer, d.experts, kk, guess);
            stage(j + 1);
        }
        if ((mode == Predict::NextToken || mode == Predict::Both) && next_same_layer[j] != SIZE_MAX) {
            predictor.predict_next_token(d.layer, d.experts, kk, guess);
            stage(next_same_layer[j]);
        }
        predictor.observe(d.layer, d.experts);
    }
    // Scored in order; staging follows the precision measured so far, as the daemon's does.
    daemon::PredictionTrust trust;
    for (size_t j = 0; j < index.size(); ++j) {
        if (!has_prediction[j]) continue;
        const bool trusted = trust.trusted();
        const auto& actual = trace.decisions[index[j]].experts;
        uint64_t correct = 0;
        for (uint32_t e : p.staged[j]) correct += std::find(actual.begin(), actual.end(), e) != actual.end();
        trust.score(p.staged[j].size(), correct);
        p.predicted += p.staged[j].size();
        p.correct += correct;
        p.actual += actual.size();
        if (!trusted) p.staged[j].clear();
        p.most_staged = std::max<uint64_t>(p.most_staged, p.staged[j].size());
    }
    return p;
}

SimResult simulate_baseline(const Trace& trace, const TraceModel& model, const Setup& setup, Baseline policy) {
    const AccessStream s = accesses_of(trace, model);
    Ledger ledger(setup, name_of(policy));
    const auto upper = hits_of(s, setup.vram_bytes + setup.ram_bytes, policy);
    std::vector<uint8_t> top;
    if (setup.device()) top = hits_of(s, setup.vram_bytes, policy);
    size_t i = 0;
    for (const auto& d : trace.decisions) {
        if (d.model != model.id) continue;
        if (d.layer == 0) ledger.tokens(d.tokens);
        for (size_t k = 0; k < d.experts.size(); ++k, ++i) {
            const Where w = !top.empty() && top[i] ? Where::Vram : upper[i] ? Where::Ram : Where::Storage;
            ledger.access(w, s.bytes_of(s.items[i]));
        }
    }
    return ledger.finish();
}

SimResult simulate_moecache(const Trace& trace, const TraceModel& model, const Setup& given,
                            const Predictions* staged) {
    const uint32_t ne = model.n_experts;
    const auto n_layers = static_cast<uint32_t>(model.blocks.size());
    // What prediction stages sits in the tier the computation reads from, so its room is taken
    // from that tier's budget: as many of the largest experts as one decision stages at most.
    // The room is at most kStagingShare of the tier: the best predictions that fit, none where not
    // one does.
    Setup setup = given;
    size_t stage_cap = 0;
    if (staged && staged->most_staged > 0) {
        const uint64_t largest = *std::max_element(model.bytes_per_expert.begin(), model.bytes_per_expert.end());
        uint64_t& tier = setup.device() ? setup.vram_bytes : setup.ram_bytes;
        stage_cap = std::min<uint64_t>(staged->most_staged,
                                       largest ? static_cast<uint64_t>(static_cast<double>(tier) * kStagingShare) / largest : 0);
        tier -= std::min(tier - (setup.device() ? 1 : 0), stage_cap * largest);
    }
    const uint32_t n_slots = n_layers * ne;
    auto bytes_of = [&](uint32_t slot) { return model.bytes_per_expert[slot / ne]; };
    Ledger ledger(setup, staged ? "moecache+" + staged->mode : "moecache");

    // The daemon's side.
    daemon::HeatTable heat(n_layers, ne, setup.half_life_tokens);
    daemon::ModelView view;
    view.heat = &heat;
    view.locked.assign(n_slots, 0);
    view.pinned.assign(n_slots, 0);
    view.slot_bytes.resize(n_slots);
    for (uint32_t s = 0; s < n_slots; ++s) view.slot_bytes[s] = bytes_of(s);
    view.budget = setup.ram_bytes;
    // RAM alone: the split of it between the locks (by heat) and the page cache's LRU is learnt
    // (heat.h, set_split_capacity), as the daemon does.
    if (!setup.device()) {
        uint64_t all = 0;
        for (uint32_t s = 0; s < n_slots; ++s) all += bytes_of(s);
        heat.set_split_capacity(daemon::ram_split_room(setup.ram_bytes, all, n_slots, n_layers));
    }
    uint64_t locked_bytes = 0;
    PageCache cache(n_slots);
    std::vector<uint8_t> promoted(n_slots, 0);

    // The hook's side: one pool, its VRAM split among the expert sizes by their share of the bytes.
    cuda::VramPool pool;
    cuda::ExpertHeat hook_heat;
    constexpr cuda::StreamId kStream = 1;
    if (setup.device()) {
        std::map<uint64_t, uint64_t> class_bytes;
        uint64_t total = 0;
        for (uint32_t l = 0; l < n_layers; ++l) {
            class_bytes[model.bytes_per_expert[l]] += model.bytes_per_expert[l] * ne;
            total += model.bytes_per_expert[l] * ne;
        }
        uint64_t base = uint64_t{1} << 40;
        for (const auto& [slot_bytes, bytes] : class_bytes) {
            if (slot_bytes == 0) continue;
            const auto share = static_cast<uint64_t>(static_cast<long double>(setup.vram_bytes) * bytes / total);
            const auto count = static_cast<uint32_t>(std::min<uint64_t>(share / slot_bytes, bytes / slot_bytes));
            pool.add_arena(slot_bytes, base, count);
            base += slot_bytes * count + (uint64_t{1} << 30);
        }
        pool.add_model(0, n_slots, n_slots);
        hook_heat.add_model(0, n_slots);
        // As the hook sets them: the pool's room in experts, and a token's touches of the model
        // (experts used x layers).
        uint32_t used = 0;
        for (const auto& d : trace.decisions)
            if (d.model == model.id && d.tokens == 1) used = std::max(used, static_cast<uint32_t>(d.experts.size()));
        hook_heat.set_recent_window(0, used * n_layers);

        view.in_vram.assign(n_slots, 0);
    }
    auto in_vram = [&](uint32_t slot) { return setup.device() && view.in_vram[slot] != 0; };
    // One place as the daemon decides it (budgets.h): only where the RAM cannot keep every expert
    // locked anyway. Where it can (the common GPU case of the table's VRAM rows, RAM = the model),
    // an expert keeps its RAM copy in the pool and the hook's own admissions may displace.
    bool one_place = true;
    {
        uint64_t all = 0;
        for (uint32_t s = 0; s < n_slots; ++s) all += bytes_of(s);
        one_place = daemon::one_place_needed(all, setup.ram_bytes, std::nullopt);
    }
    auto released = [&](uint32_t slot) { return one_place && in_vram(slot); };  // not wanted in RAM
    auto in_ram = [&](uint32_t slot) { return view.locked[slot] != 0 || cache.has(slot); };
    auto fit_cache = [&] { cache.shrink_to(setup.ram_bytes - std::min(locked_bytes, setup.ram_bytes), bytes_of); };
    // An expert entered the pool (`evicted` left it). One place: the daemon unlocks RAM's copy and
    // drops it, but pages the runtime maps stay in the page cache until the kernel needs them:
    // first to go.
    auto enter_vram = [&](uint32_t s, const cuda::SliceRef& evicted) {
        view.in_vram[s] = 1;
        if (evicted.model != cuda::kNoSlot) view.in_vram[evicted.slice] = 0;
        if (!one_place) return;
        const bool was_in_ram = in_ram(s);
        if (view.locked[s]) {
            view.locked[s] = 0;
            locked_bytes -= bytes_of(s);
        }
        cache.remove(s, bytes_of(s));
        if (was_in_ram) cache.insert_cold(s, bytes_of(s));
    };
    double pool_experts = 0;  // experts the pool holds
    if (setup.device()) {
        uint64_t all = 0;
        for (uint32_t s = 0; s < n_slots; ++s) all += bytes_of(s);
        const double mean = static_cast<double>(all) / std::max<uint32_t>(n_slots, 1);
        pool_experts = static_cast<double>(setup.vram_bytes) / std::max(mean, 1.0);
        hook_heat.set_capacity(static_cast<uint32_t>(pool_experts));
        if (setup.pool_directed > 0)
            heat.set_split_capacity(pool_experts / std::max<uint32_t>(n_layers, 1), daemon::HeatTable::SplitFor::Pool);
    }

    // The daemon's decide step as its loop runs it (decide.h): the turn's facts (what is locked,
    // what the page cache holds, what a pool holds), decide_turn(), and its actions carried out.
    // Storage is far faster than a tick, so a turn's reads have landed by the next turn, which locks
    // them as a daemon's finished reads ask it to; at most lock_bytes_per_turn are locked a turn,
    // and turns follow until nothing waits.
    std::vector<uint8_t> reading(n_slots, 0);
    uint64_t shifts_told = 0;
    auto plan = [&] {
        std::vector<uint32_t> waiting;
        for (int turn = 0; turn < kMaxTurnsPerTick; ++turn) {
            daemon::TurnFacts f;
            f.memory.total = setup.ram_bytes;
            f.memory.available = setup.ram_bytes - std::min(locked_bytes, setup.ram_bytes);
            f.lock_cap = daemon::recency_cut_cap(setup.ram_bytes, setup.ram_bytes, heat.recency_share());
            f.planner = setup.planner;
            daemon::ModelFacts& mf = f.models.emplace_back();
            mf.view = view;
            if (!one_place) mf.view.in_vram.clear();
            mf.slots.resize(n_slots);
            for (uint32_t s = 0; s < n_slots; ++s)
                mf.slots[s] = daemon::SlotFacts{view.locked[s] ? daemon::Tier::Locked
                                                : reading[s]   ? daemon::Tier::Fetching
                                                               : daemon::Tier::Storage,
                                                cache.has(s) || reading[s] ? bytes_of(s) : 0, bytes_of(s), bytes_of(s),
                                                !released(s)};
            mf.holder.locked = locked_bytes;
            mf.holder.cap = view.budget;
            mf.waiting = std::move(waiting);
            const daemon::TurnActions a = daemon::decide_turn(f);
            for (const auto& r : a.release) {
                if (r.slot == daemon::kDenseSlot || !view.locked[r.slot]) continue;
                view.locked[r.slot] = 0;
                locked_bytes -= bytes_of(r.slot);
                if (!released(r.slot)) cache.insert_cold(r.slot, bytes_of(r.slot));
            }
            waiting = a.waiting.empty() ? std::vector<uint32_t>{} : a.waiting[0];
            for (const auto& r : a.read) {
                if (r.slot == daemon::kDenseSlot || reading[r.slot]) continue;
                reading[r.slot] = 1;
                ledger.ahead_to_ram(bytes_of(r.slot));
                waiting.push_back(r.slot);
            }
            // A cached slot that waited a turn is in `waiting` and again in the plan's locks, so a
            // turn may name it twice; the daemon's lock of a locked slot is a no-op
            // (ModelResidency::lock), and so is this one, or locked_bytes counts it twice.
            for (const auto& r : a.lock) {
                if (r.slot == daemon::kDenseSlot || view.locked[r.slot]) continue;
                reading[r.slot] = 0;
                cache.remove(r.slot, bytes_of(r.slot));
                view.locked[r.slot] = 1;
                locked_bytes += bytes_of(r.slot);
            }
            for (const auto& x : a.refused) {  // read, not locked: the page cache keeps it, first to go
                if (x.at.slot == daemon::kDenseSlot || !reading[x.at.slot]) continue;
                reading[x.at.slot] = 0;
                if (!released(x.at.slot)) cache.insert_cold(x.at.slot, bytes_of(x.at.slot));
            }
            for (const auto& r : a.given_up)
                if (r.slot != daemon::kDenseSlot) reading[r.slot] = 0;
            if (waiting.empty()) break;
        }
        fit_cache();
        if (setup.device()) {
            // A shift the daemon's heat saw since: the hook is told (a Shifted directive, sent with
            // the turn's pool direction) and cuts its own counts of the model as the heat was cut.
            if (heat.shifts() != shifts_told) {
                shifts_told = heat.shifts();
                hook_heat.forget(0, kKeepAtShift);
            }
            std::vector<uint8_t> want(n_slots, 0);
            // The daemon directs the pool's frequency part; the hook keeps the rest as an LRU
            // once the split gives recency a share.
            const daemon::PoolDirected directed =
                daemon::direct_pool(heat, setup.planner, one_place, setup.pool_directed, pool_experts, promoted);
            hook_heat.set_recency(directed.recency);
            const std::vector<uint32_t>& wanted = directed.wanted;
            for (uint32_t s : wanted) want[s] = 1;
            for (uint32_t s = 0; s < n_slots; ++s)
                if (want[s] != promoted[s]) {
                    hook_heat.set_promoted(0, s, want[s] != 0);
                    promoted[s] = want[s];
                }
            // The hook fills its pool with what it was directed to hold and RAM has (the daemon's
            // locks), ahead of use, hottest first.
            if (setup.pool_directed > 0)
                for (uint32_t s : wanted) {
                    if (view.in_vram[s] || !view.locked[s]) continue;
                    cuda::SliceRef evicted;
                    if (pool.admit({0, s, s}, bytes_of(s), kStream, hook_heat, cuda::same_stream_only(), &evicted) == 0 ||
                        pool.commit({0, s, s}) == 0)
                        continue;
                    ledger.ahead_to_device(Where::Ram, bytes_of(s));
                    enter_vram(s, evicted);
                }
        }
    };

    const auto tick_us = static_cast<uint64_t>(std::max(setup.tick_seconds, 1e-6) * 1e6);
    uint64_t next_tick = tick_us;
    size_t j = 0;
    std::vector<uint32_t> slots;
    // And between ticks as the router's reports advance the clock (placement_due, decide.h).
    uint64_t tokens_since_plan = 0, last_plan_us = 0;
    for (const auto& d : trace.decisions) {
        if (d.model != model.id) continue;
        while (d.t_us >= next_tick) {
            plan();
            tokens_since_plan = 0;
            last_plan_us = next_tick;
            next_tick += tick_us;
        }
        if (d.layer == 0) {
            heat.advance_clock(d.tokens);
            ledger.tokens(d.tokens);
            tokens_since_plan += d.tokens;
            if (daemon::placement_due(tokens_since_plan, std::chrono::microseconds(d.t_us - std::min(d.t_us, last_plan_us)))) {
                plan();
                tokens_since_plan = 0;
                last_plan_us = d.t_us;
            }
        }
        const std::vector<uint32_t>* ahead = staged && j < staged->staged.size() ? &staged->staged[j] : nullptr;
        ++j;
        if (ahead && (stage_cap == 0 || ledger.link_behind())) ahead = nullptr;
        std::span<const uint32_t> ahead_set;
        if (ahead) ahead_set = std::span<const uint32_t>(*ahead).first(std::min(stage_cap, ahead->size()));
        // Prediction stages what the tier the computation reads from lacks, moved ahead of use.
        // Speculation never queues behind itself: a prediction is staged only while the link it
        // needs has fallen no further behind than the tokens themselves (the daemon drops
        // speculative reads while its queue is full).
        for (uint32_t e : ahead_set) {
            const uint32_t s = d.layer * ne + e;
            if (setup.device() ? !in_vram(s) : !in_ram(s)) {
                if (setup.device())
                    ledger.ahead_to_device(in_ram(s) ? Where::Ram : Where::Storage, bytes_of(s));
                else
                    ledger.ahead_to_ram(bytes_of(s));
            }
        }
        slots.clear();
        for (uint32_t e : d.experts) slots.push_back(d.layer * ne + e);
        for (size_t k = 0; k < slots.size(); ++k) {
            const uint32_t s = slots[k];
            Where w = Where::Storage;
            const bool was_staged = std::find(ahead_set.begin(), ahead_set.end(), d.experts[k]) != ahead_set.end();
            if (setup.device() && pool.lookup({0, s, s}, kStream) != 0) {
                w = Where::Vram;
            } else if (was_staged && (setup.device() || !in_ram(s))) {
                w = Where::Staged;  // copied ahead to where the computation reads it
            } else if (in_ram(s)) {
                w = Where::Ram;
            }
            ledger.access(w, bytes_of(s));
        }
        if (setup.device()) {
            for (uint32_t s : slots) hook_heat.touch(0, s);
            for (uint32_t s : slots) {
                if (view.in_vram[s]) continue;
                cuda::SliceRef evicted;
                // As the hook: under one place, once the daemon directs the pool, only what it
                // promoted is admitted (and displaces); without it, any miss may.
                const bool directed = one_place && setup.pool_directed > 0;
                if (directed && promoted[s] == 0) continue;
                const bool evict = !directed || promoted[s] != 0;
                if (pool.admit({0, s, s}, bytes_of(s), kStream, hook_heat, cuda::same_stream_only(), &evicted, evict) == 0 ||
                    pool.commit({0, s, s}) == 0)
                    continue;
                enter_vram(s, evicted);
            }
        }
        for (uint32_t s : slots)
            if (!in_vram(s) && !view.locked[s]) cache.touch(s, bytes_of(s));
        fit_cache();
        heat.record(d.layer, d.experts);
        for (const auto& more : d.more) heat.record_more(d.layer, more);
    }
    return ledger.finish();
}

}  // namespace moecache::sim
