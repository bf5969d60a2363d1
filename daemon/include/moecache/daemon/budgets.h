// Budget arithmetic, pure: how many bytes the daemon may lock (the cap), whether one more lock
// fits under every cap that holds it (global, model, family, user, the memory there is this turn),
// and how much a warm start may read beyond the locks. The loop builds the inputs from its state
// and /proc once per turn; nothing here reads the system, so each rule is tested without root
// (tests/unit/budgets_test.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace moecache::daemon {

inline constexpr uint64_t kNoCap = std::numeric_limits<uint64_t>::max();

// The machine's memory as the turn sees it.
struct MemoryFacts {
    uint64_t total = 0;      // MemTotal
    uint64_t available = 0;  // MemAvailable now
    // The daemon's memory cgroup, where one binds: its limit and what it is charged now, of which
    // file pages reclaim can take and unevictable pages (memory.stat).
    std::optional<uint64_t> cgroup_limit, cgroup_usage;
    uint64_t cgroup_reclaimable = 0, cgroup_unevictable = 0;
    uint64_t locked = 0;  // what the daemon holds locked now
};

// What the other processes of the daemon's cgroup hold that reclaim cannot take: its charge less
// reclaimable file pages and less the unevictable pages that are the daemon's locks (at most what
// it locked; other processes' mlocks count as theirs). 0 where no cgroup limit binds.
uint64_t cgroup_others_need(const MemoryFacts& m);

// The most the daemon may lock: the configured lock budget, RAM less the reserve, the cgroup's
// limit less the reserve and less what its other processes need (a co-tenant that grows takes
// locks back, before the cgroup's OOM killer has to), and the cap a pressure back-off set
// (kNoCap: none).
uint64_t lock_cap(const MemoryFacts& m, uint64_t lock_budget, uint64_t reserve, uint64_t pressure_cap = kNoCap);

// One place (an expert a VRAM pool holds leaves RAM) is for RAM that cannot keep every expert of
// the models locked anyway: where it can, dropping a pooled expert's RAM copy frees nothing the
// models need, and costs the pool its freedom to follow the routing (an expert it lets go would be
// read from storage again). `need`: the experts' bytes the RAM would keep; `cap`: what may be
// locked. On once they do not fit; off again only once the cap holds 1.1 times them, so that a cap
// that moves at the edge (pressure, a cgroup's other processes) does not flip it to and fro
// (`was`: what it was; none at the first decision).
bool one_place_needed(uint64_t need, uint64_t cap, std::optional<bool> was);

// What memory pressure leaves locked: the locked bytes less the configured share to release.
uint64_t pressure_keep(uint64_t locked, double release_share);

// Which cap refused a lock.
enum class LockRefusal { None, Global, Model, Family, User, Memory };
const char* to_string(LockRefusal r);

// One model's claim on the budgets.
struct LockHolder {
    uint64_t locked = 0;            // bytes it holds locked now
    uint64_t cap = kNoCap;          // its own budget
    std::string family;             // models of one family share the smallest family budget among them
    uint64_t family_budget = kNoCap;
    std::optional<uint32_t> uid;    // registered by a client of this user (user budgets hold)
    uint64_t user_budget = kNoCap;  // that user's budget
};

// The locks of one turn: every cap and what holds each now; admits locks one by one, each counted
// against every cap that holds it once it is taken.
class LockLedger {
public:
    // `lockable`: what the machine has for locks this turn (MemAvailable less the reserve):
    // locking cached pages takes them out of MemAvailable, so never lock below the reserve.
    LockLedger(uint64_t global_cap, uint64_t lockable, std::vector<LockHolder> holders);
    // Whether `bytes` more of model `holder` fit under every cap; None: they do.
    [[nodiscard]] LockRefusal admits(size_t holder, uint64_t bytes) const;
    // `bytes` were locked for `holder` (counted against every cap; `lockable` shrinks).
    void took(size_t holder, uint64_t bytes);
    [[nodiscard]] uint64_t total_locked() const { return total_; }
    [[nodiscard]] uint64_t lockable() const { return lockable_; }
    [[nodiscard]] uint64_t family_cap(size_t holder) const;

private:
    [[nodiscard]] uint64_t family_locked(size_t holder) const;
    [[nodiscard]] uint64_t user_locked(size_t holder) const;
    uint64_t cap_, lockable_, total_ = 0;
    std::vector<LockHolder> holders_;
};

// What a warm start may read beyond the lock plan: what the machine has free now (and the room
// under the cgroup's limit), less what the plan still has to read for its locks and the reserve
// (what a runtime starting beside the daemon will allocate), at most `warm_limit`.
uint64_t warm_room(const MemoryFacts& m, uint64_t to_lock, uint64_t reserve, uint64_t warm_limit = kNoCap);

// A slot a warm start could read: its heat and the bytes it still needs from storage.
struct WarmCandidate {
    uint32_t slot = 0;
    double heat = 0;
    uint64_t need = 0;
};
// The hottest candidates that fit in `room` (in order of heat, stopping at the first that does
// not fit), returned coldest first: the order to read them in, so that the page cache's LRU takes
// back the coldest first when a runtime needs the memory.
std::vector<WarmCandidate> warm_picks(std::vector<WarmCandidate> candidates, uint64_t room);

}  // namespace moecache::daemon
