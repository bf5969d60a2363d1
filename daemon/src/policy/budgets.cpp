#include "moecache/daemon/budgets.h"

#include <algorithm>

namespace moecache::daemon {

uint64_t cgroup_others_need(const MemoryFacts& m) {
    if (!m.cgroup_limit) return 0;
    const uint64_t usage = m.cgroup_usage.value_or(0);
    const uint64_t ours = std::min(m.cgroup_unevictable, m.locked);
    const uint64_t away = m.cgroup_reclaimable + ours;
    return usage > away ? usage - away : 0;
}

uint64_t lock_cap(const MemoryFacts& m, uint64_t lock_budget, uint64_t reserve, uint64_t pressure_cap) {
    const uint64_t ram_cap = m.total > reserve ? m.total - reserve : 0;
    const uint64_t limit = m.cgroup_limit.value_or(kNoCap);
    const uint64_t kept = reserve + cgroup_others_need(m);
    const uint64_t cgroup_cap = limit > kept ? limit - kept : 0;
    return std::min({lock_budget, ram_cap, cgroup_cap, pressure_cap});
}

bool one_place_needed(uint64_t need, uint64_t cap, std::optional<bool> was) {
    if (need > cap) return true;
    if (!was.value_or(false)) return false;
    return static_cast<double>(cap) < 1.1 * static_cast<double>(need);
}

uint64_t pressure_keep(uint64_t locked, double release_share) {
    return static_cast<uint64_t>(static_cast<double>(locked) * (1.0 - release_share));
}

const char* to_string(LockRefusal r) {
    switch (r) {
        case LockRefusal::None: return "none";
        case LockRefusal::Global: return "lock cap";
        case LockRefusal::Model: return "model budget";
        case LockRefusal::Family: return "family budget";
        case LockRefusal::User: return "user budget";
        case LockRefusal::Memory: return "available memory";
    }
    return "?";
}

LockLedger::LockLedger(uint64_t global_cap, uint64_t lockable, std::vector<LockHolder> holders)
    : cap_(global_cap), lockable_(lockable), holders_(std::move(holders)) {
    for (const auto& h : holders_) total_ += h.locked;
}

uint64_t LockLedger::family_cap(size_t holder) const {
    uint64_t cap = kNoCap;
    for (const auto& o : holders_)
        if (o.family == holders_[holder].family) cap = std::min(cap, o.family_budget);
    return cap;
}

uint64_t LockLedger::family_locked(size_t holder) const {
    uint64_t t = 0;
    for (const auto& o : holders_)
        if (o.family == holders_[holder].family) t += o.locked;
    return t;
}

uint64_t LockLedger::user_locked(size_t holder) const {
    uint64_t t = 0;
    for (const auto& o : holders_)
        if (o.uid && o.uid == holders_[holder].uid) t += o.locked;
    return t;
}

LockRefusal LockLedger::admits(size_t holder, uint64_t bytes) const {
    const LockHolder& h = holders_[holder];
    if (total_ + bytes > cap_) return LockRefusal::Global;
    if (h.locked + bytes > h.cap) return LockRefusal::Model;
    if (family_locked(holder) + bytes > family_cap(holder)) return LockRefusal::Family;
    if (h.uid && user_locked(holder) + bytes > h.user_budget) return LockRefusal::User;
    if (bytes > lockable_) return LockRefusal::Memory;
    return LockRefusal::None;
}

void LockLedger::took(size_t holder, uint64_t bytes) {
    holders_[holder].locked += bytes;
    total_ += bytes;
    lockable_ -= std::min(lockable_, bytes);
}

uint64_t warm_room(const MemoryFacts& m, uint64_t to_lock, uint64_t reserve, uint64_t warm_limit) {
    uint64_t room = m.available;
    if (m.cgroup_limit) {
        const uint64_t usage = m.cgroup_usage.value_or(0);
        room = std::min(room, *m.cgroup_limit > usage ? *m.cgroup_limit - usage : 0);
    }
    const uint64_t keep_free = to_lock + reserve;
    room = room > keep_free ? room - keep_free : 0;
    return std::min(room, warm_limit);
}

std::vector<WarmCandidate> warm_picks(std::vector<WarmCandidate> candidates, uint64_t room) {
    std::stable_sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) { return a.heat > b.heat; });
    uint64_t chosen_bytes = 0;
    size_t chosen = 0;
    for (; chosen < candidates.size(); ++chosen) {
        if (chosen_bytes + candidates[chosen].need > room) break;
        chosen_bytes += candidates[chosen].need;
    }
    candidates.resize(chosen);
    std::reverse(candidates.begin(), candidates.end());
    return candidates;
}

}  // namespace moecache::daemon
