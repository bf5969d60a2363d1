// The decide step of a loop turn, pure: from a snapshot of the facts (memory, budgets, each
// model's residency and heat, the slots read and waiting for a lock), what to do this turn:
//   - release what the plan no longer wants (unlock and drop, clients told);
//   - read what it wants locked (hottest first), or lock it at once when the page cache holds it;
//   - a warm start's reads beyond the locks, into the room memory leaves;
//   - which of the slots read may be locked now: every cap that holds them (budgets.h), at most
//     kLockBytesPerTurn a turn (mlock takes the loop's time); the rest wait for the next turn;
//     refused ones go back to storage (the plan asks again); one a VRAM pool took while it was
//     being read is dropped (one place).
// The loop builds the facts (DecideStep::place, src/decide/decide_step.cpp), decide_turn() decides
// (src/policy/decide_turn.cpp), and the actuator (src/decide/actuate.cpp) is the only code that changes
// residency to carry the actions out. moecache-sim replays traces through the same function.
// Tested without root in tests/unit/decide_test.cpp.
#pragma once

#include "moecache/daemon/budgets.h"
#include "moecache/daemon/planner.h"
#include "moecache/daemon/tier.h"

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moecache::daemon {

inline constexpr uint64_t kLockBytesPerTurn = 512ull << 20;  // bounds how long one turn spends in mlock
// A model no client registered and nothing used for this long is on standby (planner.h).
inline constexpr std::chrono::seconds kStandbyAfter{60};
// How long after a client's last routing report a model's page-cache uses count as heat again
// (ModelEntry::last_routed, model_registry.h): the reports are its heat while they arrive.
inline constexpr std::chrono::seconds kPageCacheUsesAfterRouting{10};

// A placement also follows the routing, not only the tick: once a model's router reports have
// advanced its clock by kPlaceEveryTokens since the last placement, and kPlaceAtMostEvery has
// passed, the loop places again. Once a second is ~40 decoded tokens at the speeds a pool gives,
// long enough for an expert that turned hot to miss tens of times before a lock or a direction
// follows it (moecache-sim, issue 22's Zipf family of 256 experts at 25 % of RAM: 78.2 % with the
// tick alone, 81.0 % with this, LFU 81.4 %). A prompt batch (many tokens at once) places at once.
inline constexpr uint64_t kPlaceEveryTokens = 8;
inline constexpr std::chrono::milliseconds kPlaceAtMostEvery{200};
[[nodiscard]] inline bool placement_due(uint64_t tokens_since, std::chrono::nanoseconds since) {
    return tokens_since >= kPlaceEveryTokens && since >= kPlaceAtMostEvery;
}

// One slot (an expert, or the dense part) as the turn sees it.
struct SlotFacts {
    Tier tier = Tier::Storage;
    uint64_t cached = 0;      // bytes of it in the page cache
    uint64_t length = 0;      // bytes of it in the file(s)
    uint64_t lock_bytes = 0;  // bytes locking it costs (page-rounded)
    bool wanted_in_ram = true;  // false: a VRAM pool holds it (one place)
    bool read_for_ram = true;   // false: not read for RAM either (bound for VRAM: ModelResidency::read_for_ram)
};

struct ModelFacts {
    ModelView view;                // the planner's input (ModelView::heat must point at live heat)
    std::vector<SlotFacts> slots;  // per expert slot
    SlotFacts dense;
    LockHolder holder;             // its claim on the budgets
    std::vector<uint32_t> waiting;  // slots read (or cached) and waiting for a lock
    bool warm_pending = false;      // a warm start is due
    [[nodiscard]] const SlotFacts& slot(uint32_t s) const { return s == kDenseSlot ? dense : slots[s]; }
};

struct TurnFacts {
    MemoryFacts memory;
    uint64_t lock_cap = 0;    // lock_cap(): the global cap
    uint64_t reserve = 0;     // resolved
    uint64_t warm_limit = kNoCap;
    PlannerSettings planner;
    uint64_t lock_bytes_per_turn = kLockBytesPerTurn;
    std::vector<ModelFacts> models;
};

struct TurnActions {
    Plan plan;                        // the planner's whole answer (planned bytes for status)
    std::vector<SlotRef> release;     // unlock and drop, coldest first; clients told
    std::vector<SlotRef> read;        // begin fetching for a lock, in this order (hottest first)
    struct WarmReads {
        uint32_t model = 0;
        std::vector<uint32_t> slots;  // coldest first: the order to read them in
        uint32_t chosen = 0;          // the experts chosen (some may be cached already)
        uint64_t room = 0;            // the room it had
    };
    std::vector<WarmReads> warm;
    std::vector<SlotRef> lock;        // admitted under every cap, in order
    struct Refused {
        SlotRef at;
        LockRefusal why;
    };
    std::vector<Refused> refused;     // back to storage: the plan asks again if it still wants it
    std::vector<SlotRef> given_up;    // a VRAM pool took it while it was read: back to storage, dropped
    std::vector<std::vector<uint32_t>> waiting;  // per model: what waits for the next turn
};

TurnActions decide_turn(const TurnFacts& f);

// One place, expert by expert: an expert leaves RAM (unlocked, dropped) once every live client of
// its model holds it in VRAM and at least one of those may take it out of RAM (an eviction: root,
// the admin group, or a model its users registered), under one place and without [vram]
// keep_ram_copy. `holders` and `evictors` per slot, of `clients` live clients (those whose pool has
// not reported yet count as holding nothing).
[[nodiscard]] std::vector<uint8_t> released_from_ram(std::span<const uint32_t> holders,
                                                     std::span<const uint8_t> evictors, uint32_t clients,
                                                     bool one_place, bool keep_ram_copy);

// One read, one place, from the start (moecache/first_fill.h): while every client of a model fills
// its pool for the first time, an expert each of them holds or was directed to hold, and one at
// least is yet to fill, is bound for VRAM: read by those hooks from the file, not read into RAM for
// a lock first. Only where every client of the model has a pool that reported and may take experts
// out of RAM, under one place, without keep_ram_copy and with [vram] fill_from_files. A client's
// pool as the rule sees it, per slot of the model:
struct ClientPool {
    bool pooled = false;                   // it has a pool that has reported
    bool may_release = false;              // may take the model's experts out of RAM
    bool filling = false;                  // its first fill is not done
    std::vector<uint8_t> holds, promoted;  // per slot
};
// Per slot 1 where bound for VRAM; empty where the rule does not apply.
[[nodiscard]] std::vector<uint8_t> bound_for_vram(std::span<const ClientPool> clients, uint32_t n_slots, bool one_place,
                                                  bool keep_ram_copy, bool fill_from_files);

// Which models rest (the prompt-model swap, standby): from each open model's use, whether it holds
// nothing (`left`: no live client holds it while one of its family is in use: the runtime moved to
// another quantization, whose experts the RAM is for now) and whether it is on standby (its experts
// rank after every model in use: planner.h). A model whose runtime left while another member of
// its family waits for one, left before it, waits for that member (yields), and that member is not
// put on standby for being idle (awaited): the runtime moves between them, and the RAM is read full
// of the member that comes next rather than kept for the one that went. Not for a member no runtime
// ever used: nothing says it comes next (a family configured by a glob, one quantization served and
// restarted: on the GPU machine each stop of the decode model's server threw its 13 GiB of locks
// away to read the never-used prompt model).
struct ModelUse {
    std::string family;
    bool in_use = false;                                                // a live client registered it
    bool keep = false;                                                  // [[model]] keep: never at rest
    std::optional<std::chrono::steady_clock::time_point> runtime_left;  // when its last runtime went
    std::chrono::steady_clock::time_point last_used{};
};
struct ModelRest {
    bool left = false;
    bool standby = false;
};
[[nodiscard]] std::vector<ModelRest> models_at_rest(std::span<const ModelUse> models,
                                                    std::chrono::steady_clock::time_point now);

// Reads into the page cache that no lock asks for: after a runtime's misses ([prefetch] on_miss,
// the rest of an expert it began to read from storage) and after the predictor's trusted
// predictions ([policy] predict). A slot such a read may be for, as the turn sees it.
struct FetchCandidate {
    SlotRef at;
    bool known = false;  // its model is open and the slot is one of its experts
    Tier tier = Tier::Storage;
    uint64_t cached = 0, length = 0;
    bool wanted_in_ram = true;  // false: a VRAM pool holds it (one place)
    bool read_for_ram = true;   // false: bound for VRAM (ModelResidency::read_for_ram)
    bool hooked = false;        // a client with a VRAM pool serves the model: its hook reads its own misses
};
// After misses: each slot once, in (model, slot) order, those RAM wants, in storage (one being read
// for a lock is read already), of models no hook serves.
[[nodiscard]] std::vector<SlotRef> reads_after_misses(std::span<const FetchCandidate> missed);
// After predictions: none while other reads are queued (a prediction never waits behind real
// work); else each slot once, in (model, slot) order, those in storage, not wholly cached, read for
// RAM.
[[nodiscard]] std::vector<SlotRef> reads_after_predictions(std::span<const FetchCandidate> predicted,
                                                           bool reads_queued);

}  // namespace moecache::daemon
