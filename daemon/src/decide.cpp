// The decide step: once per loop turn (request_place() marks the turn; the loop calls place()
// once), the plan of what to lock and release under the budgets, the reads it needs, warm starts,
// reads after misses and predictions, and the locks the budgets admit this turn.
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/system_memory.h"

#include "daemon_state.h"
#include "dbus/dbus_service.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/log.h"

#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace moecache::daemon {

namespace {

constexpr uint64_t kLockBytesPerTurn = 512ull << 20;  // bounds how long one turn spends in mlock

}  // namespace

uint64_t Daemon::lock_cap() const {
    const uint64_t budget = config_.lock_budget.resolve(mem_total_);
    const uint64_t reserve = config_.reserve.resolve(mem_total_);
    const uint64_t ram_cap = mem_total_ > reserve ? mem_total_ - reserve : 0;
    // Inside a memory cgroup the limit is the RAM there is: locking past it would leave the
    // processes charged with it (a runtime beside the daemon) nothing but the OOM killer.
    const uint64_t limit = cgroup_ ? cgroup_->limit : UINT64_MAX;
    const uint64_t cgroup_cap = limit > reserve ? limit - reserve : 0;
    return std::min({budget, ram_cap, cgroup_cap, pressure_cap_});
}

uint64_t Daemon::model_cap(const ModelEntry& m) const {
    uint64_t cap = m.config.budget ? m.config.budget->resolve(mem_total_) : UINT64_MAX;
    if (const auto* u = uid_budget(m)) cap = std::min(cap, u->resolve(mem_total_));
    return cap;
}

const ByteAmount* Daemon::uid_budget(const ModelEntry& m) const {
    if (!m.registered) return nullptr;
    const auto it = config_.uid_budgets.find(m.owner_uid);
    return it == config_.uid_budgets.end() ? nullptr : &it->second;
}

uint64_t Daemon::uid_locked(uint32_t uid) const {
    uint64_t t = 0;
    for (const auto& m : models_)
        if (m->res && m->registered && m->owner_uid == uid) t += m->res->locked_bytes();
    return t;
}

uint64_t Daemon::family_cap(const ModelEntry& m) const {
    uint64_t cap = UINT64_MAX;
    const std::string f = family_of(m);
    for (const auto& o : models_)
        if (o->res && o->config.family_budget && family_of(*o) == f) cap = std::min(cap, o->config.family_budget->resolve(mem_total_));
    return cap;
}

uint64_t Daemon::family_locked(const ModelEntry& m) const {
    uint64_t t = 0;
    const std::string f = family_of(m);
    for (const auto& o : models_)
        if (o->res && family_of(*o) == f) t += o->res->locked_bytes();
    return t;
}

uint64_t Daemon::total_locked() const {
    uint64_t t = 0;
    for (const auto& m : models_)
        if (m->res) t += m->res->locked_bytes();
    return t;
}

// A runtime read part of these experts from storage: read the rest of each at once, ahead of
// everything else queued, so that its next faults in them hit the page cache instead of waiting
// for storage one page at a time (a runtime that maps with MADV_RANDOM, as lazy load does, reads
// nothing around a fault).
void Daemon::fetch_missed() {
    if (missed_this_batch_.empty()) return;
    if (config_.on_miss) {
        std::sort(missed_this_batch_.begin(), missed_this_batch_.end());
        missed_this_batch_.erase(std::unique(missed_this_batch_.begin(), missed_this_batch_.end()), missed_this_batch_.end());
        for (const auto& [id, slot] : missed_this_batch_) {
            ModelEntry* m = find_model(id);
            if (!m || !m->res || slot >= m->res->n_slots() || !m->res->wanted_in_ram(slot)) continue;
            // Being read for a lock already: that read is as good.
            if (m->res->state(slot).tier() != Tier::Storage) continue;
            const uint64_t q = cache_fetch(*m, slot, FetchReason::Miss);
            if (q == 0) continue;
            ++miss_fetches_;
            miss_fetch_bytes_ += q;
        }
        if (auto r = prefetcher_->submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    }
    missed_this_batch_.clear();
}

// What a warm start reads beyond the lock plan: experts the profile saw used (admitted), the
// hottest that fit, not locked, as far as the memory there is now goes (the machine's
// MemAvailable, and the room left under the daemon's memory cgroup limit) less the reserve (what
// a runtime starting beside it will allocate) and less what the lock plan still has to read.
// They are read coldest first: the page cache's LRU then takes back the coldest of them first
// when the runtime needs the memory.
void Daemon::warm_model(ModelEntry& m, const Plan& plan, uint32_t model_index) {
    m.warm_pending = false;
    auto& r = *m.res;
    uint64_t room = memory_now_.available;
    if (cgroup_) room = std::min(room, cgroup_->limit > cgroup_->usage ? cgroup_->limit - cgroup_->usage : 0);
    std::vector<uint8_t> planned(r.n_slots(), 0);
    uint64_t to_lock = 0;
    for (const auto& p : plan.lock) {
        if (p.model != model_index) continue;
        if (p.slot != kDenseSlot) planned[p.slot] = 1;
        const SlotState& st = r.state(p.slot);
        const uint64_t len = r.slot_length(p.slot);
        to_lock += len > st.cached_bytes ? len - st.cached_bytes : 0;
    }
    const uint64_t keep_free = to_lock + config_.reserve.resolve(mem_total_);
    room = room > keep_free ? room - keep_free : 0;
    if (config_.warm_limit) room = std::min(room, config_.warm_limit->resolve(mem_total_));
    const uint32_t ne = r.n_experts();
    std::vector<std::pair<double, uint32_t>> order;
    for (uint32_t s = 0; s < r.n_slots(); ++s) {
        if (planned[s] || r.state(s).tier() != Tier::Storage || !r.wanted_in_ram(s)) continue;
        if (r.heat().uses(s / ne, s % ne) < config_.admit_after_uses) continue;
        order.emplace_back(r.heat().heat(s / ne, s % ne), s);
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    uint64_t chosen_bytes = 0;
    size_t chosen = 0;
    for (; chosen < order.size(); ++chosen) {
        const uint32_t s = order[chosen].second;
        const uint64_t len = r.slot_length(s), cached = r.state(s).cached_bytes;
        const uint64_t need = len > cached ? len - cached : 0;
        if (chosen_bytes + need > room) break;
        chosen_bytes += need;
    }
    uint64_t queued = 0;
    uint32_t n = 0;
    for (size_t i = chosen; i-- > 0;) {
        const uint32_t s = order[i].second;
        if (r.state(s).cached_bytes < r.slot_length(s)) queued += cache_fetch(m, s, FetchReason::WarmStart, n++);
    }
    warm_fetch_bytes_ += queued;
    if (queued > 0)
        MC_LOG(LOG_INFO, "model {}: warm start: reading {} MiB of {} experts beyond the locks ({} MiB free for it)",
               m.path, queued >> 20, chosen, room >> 20);
}

void Daemon::place() {
    place_requested_ = false;
    ++plans_;
    // What the kernel says of memory, read once for the whole plan: no decision below reads /proc.
    if (const auto m = read_system_memory()) memory_now_ = *m;
    std::vector<ModelView> views;
    std::vector<ModelEntry*> loaded;
    std::map<std::string, uint32_t> families;
    for (auto& m : models_)
        if (m->res) {
            views.push_back(m->res->view(model_cap(*m)));
            views.back().family = families.try_emplace(family_of(*m), static_cast<uint32_t>(families.size())).first->second;
            if (m->config.family_budget) views.back().family_budget = m->config.family_budget->resolve(mem_total_);
            loaded.push_back(m.get());
        }
    const PlannerSettings s{config_.admit_after_uses, config_.elite_share, config_.hysteresis};
    const Plan plan = plan_placement(views, lock_cap(), s);
    for (const auto& r : plan.release) {
        auto& m = *loaded[r.model];
        // Dropped as well as unlocked: pages no process maps leave the page cache, so that what
        // the policy lets go frees memory; pages a runtime maps stay where they are.
        if (auto rel = m.res->release(r.slot, /*drop=*/true); !rel)
            MC_LOG(LOG_WARNING, "model {}: release: {}", m.path, rel.error().what());
        else
            tell_clients(m, r.slot, protocol::Action::Unlock);
    }
    uint32_t order = 0;
    for (const auto& r : plan.lock) {
        auto& m = *loaded[r.model];
        SlotState& st = m.res->state(r.slot);
        if (st.tier() != Tier::Storage) continue;
        if (st.cached_bytes >= m.res->slot_length(r.slot)) {
            m.waiting.push_back(r.slot);  // already cached: lock without reading
            continue;
        }
        m.res->begin_fetch(r.slot);
        for (const auto& range : m.res->ranges(r.slot)) {
            const auto& f = m.res->model().files()[range.file];
            prefetcher_->enqueue({f.fd.get(), range.offset, range.length, fetch_priority(FetchReason::Plan, order),
                                  fetch_tag(m.id, r.slot, FetchReason::Plan)});
            ++st.fetches_pending;
        }
        ++order;
    }
    for (uint32_t i = 0; i < loaded.size(); ++i)
        if (loaded[i]->warm_pending) warm_model(*loaded[i], plan, i);
    if (auto r = prefetcher_->submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    // The reserve holds against what the machine has now, not only against RAM: locking cached
    // pages takes them out of MemAvailable, so never lock below reserve.
    const uint64_t reserve = config_.reserve.resolve(mem_total_);
    const uint64_t available = memory_now_.available;
    lockable_this_turn_ = available > reserve ? available - reserve : 0;
    uint64_t budget = kLockBytesPerTurn;
    for (auto* m : loaded) {
        std::vector<uint32_t> waiting;
        waiting.swap(m->waiting);
        for (uint32_t slot : waiting) {
            if (budget == 0) {
                m->waiting.push_back(slot);
                continue;
            }
            const uint64_t bytes = m->res->slot_bytes(slot);
            try_lock(*m, slot);
            budget -= std::min(budget, bytes);
        }
    }
    direct_pools();
}

void Daemon::try_lock(ModelEntry& m, uint32_t slot) {
    SlotState& st = m.res->state(slot);
    if (st.tier() == Tier::Locked) return;
    if (!m.res->wanted_in_ram(slot)) {  // a VRAM pool took it while it was being read
        m.res->abandon(slot);
        m.res->drop_cached(slot);
        return;
    }
    const uint64_t need = m.res->slot_bytes(slot);
    const ByteAmount* ub = uid_budget(m);
    if (total_locked() + need > lock_cap() || m.res->locked_bytes() + need > model_cap(m) ||
        family_locked(m) + need > family_cap(m) ||
        (ub && uid_locked(m.owner_uid) + need > ub->resolve(mem_total_)) ||
        need > lockable_this_turn_) {
        m.res->abandon(slot);  // the plan will ask again if it still wants it
        return;
    }
    auto r = m.res->lock(slot);
    if (r) {
        lockable_this_turn_ -= std::min(lockable_this_turn_, *r);
        tell_clients(m, slot, protocol::Action::Lock);
    }
    if (!r) {
        m.res->abandon(slot);
        MC_LOG(LOG_WARNING, "model {}: lock: {}", m.path, r.error().what());
        // A file truncated or replaced under us fails here first: look at it again now.
        if (auto same = m.res->model().unchanged(); !same || !*same) close_model(m, "the file changed on disk");
    }
}

void Daemon::on_fetched(uint64_t tag, uint64_t, int err) {
    const auto id = static_cast<uint32_t>((tag >> 32) & 0x7fffffffu);
    const auto slot = static_cast<uint32_t>(tag & 0xffffffffu);
    if ((tag >> 63) != 0) {
        cache_fetched(id, slot);
        return;
    }
    for (auto& m : models_) {
        if (m->id != id || !m->res) continue;
        SlotState& st = m->res->state(slot);
        if (st.fetches_pending > 0) --st.fetches_pending;
        if (err != 0 && err != ECANCELED) MC_LOG(LOG_WARNING, "model {}: prefetch failed: {}", m->path, std::strerror(err));
        if (st.fetches_pending == 0 && st.tier() == Tier::Fetching) m->waiting.push_back(slot);
    }
}

void Daemon::prefetch_predicted(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts) {
    auto& r = *m.res;
    const uint32_t ne = r.n_experts();
    if (!m.prediction) {
        const uint32_t nl = r.n_slots() / std::max<uint32_t>(ne, 1);
        m.prediction = std::make_unique<ModelEntry::Prediction>(
            ModelEntry::Prediction{RoutePredictor(nl, ne), {}, std::vector<std::vector<uint32_t>>(nl)});
    }
    auto& p = *m.prediction;
    if (layer >= p.next.size()) return;
    auto& next = p.next[layer];
    if (!next.empty()) {
        uint64_t right = 0;
        for (uint32_t e : next) right += std::find(experts.begin(), experts.end(), e) != experts.end();
        p.trust.score(next.size(), right);
    }
    p.predictor.observe(layer, experts);
    p.predictor.predict_next_token(layer, experts, static_cast<uint32_t>(experts.size()), next);
    // Speculation never queues behind itself: nothing is added while reads wait to be issued.
    if (!p.trust.trusted() || prefetcher_->progress().queued_bytes > 0) return;
    uint64_t queued = 0;
    for (uint32_t e : next) {
        const uint32_t slot = layer * ne + e;
        const SlotState& st = r.state(slot);
        if (st.tier() != Tier::Storage || st.cached_bytes >= r.slot_length(slot) || !r.wanted_in_ram(slot)) continue;
        // Behind a runtime's misses, ahead of the plan's locks: the next token is tens of ms away.
        queued += cache_fetch(m, slot, FetchReason::Prediction);
    }
    if (queued == 0) return;
    predict_fetch_bytes_ += queued;
    if (auto s = prefetcher_->submit(); !s) MC_LOG(LOG_WARNING, "prefetch: {}", s.error().what());
}

void Daemon::request_place() {
    place_requested_ = true;
    if (!in_step_) place();
}

}  // namespace moecache::daemon
