// The parts of the daemon's state that its source files share (daemon.cpp, clients/clients.cpp).
// Owned and touched by the loop's thread only.
#pragma once

#include "clients/client_hub.h"
#include "event_source.h"
#include "moecache/client/telemetry_ring.h"
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/fetch.h"
#include "moecache/daemon/predictor.h"

#include <deque>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace moecache::daemon {

// A prefetch request's tag: model id, slot (kDenseSlot included), and whether it is read to stay
// cached only (every reason but the plan's) rather than to be locked.
inline uint64_t fetch_tag(uint32_t model, uint32_t slot, bool cache_only = false) {
    return (uint64_t{model} << 32) | slot | (cache_only ? uint64_t{1} << 63 : 0);
}
inline uint64_t fetch_tag(uint32_t model, uint32_t slot, FetchReason r) { return fetch_tag(model, slot, cache_only(r)); }
inline uint32_t fetch_tag_model(uint64_t tag) { return static_cast<uint32_t>((tag >> 32) & 0x7fffffffu); }

struct Daemon::ModelEntry {
    uint32_t id = 0;
    ModelConfig config;
    std::string path;
    // What users call it, fixed at its first load: ollama's tag for one of its blobs, else the file
    // name (general.name for a file named by its hash). The metrics' model label: stable across loads.
    std::string name;
    std::unique_ptr<ModelResidency> res;
    std::string error;  // the last reason it could not be loaded, logged once
    bool opening = false;  // its header is being read and its setup made, off the loop (OffLoop)
    // Its file did not answer a read within [prefetch] read_deadline (a hung network or FUSE file
    // system): not opened again before this (registry.cpp, set_aside()).
    std::chrono::steady_clock::time_point set_aside_until{};
    std::vector<uint32_t> file_ids;  // page-cache telemetry ids of its files, while watched
    bool registered = false;  // added by a client at run time (not configured): closed with its last client
    uint32_t owner_uid = 0;   // of the client that registered it (registered models only)
    bool operator_added = false;  // registered over D-Bus: stays until unregistered or restart
    // When a runtime last used it (a page fault or read in it, a routing report): a model that no
    // client registered is on standby (planner.h) once nothing used it for kStandbyAfter, or at once
    // while a live client uses another model of its family (the prompt-model swap).
    std::chrono::steady_clock::time_point last_used{};
    // When a client last reported its router's routing (telemetry). While they arrive they are
    // its heat: a page fault or read of one of its experts is then a copy the routing already
    // counted (the CUDA hook copying a pool's miss from RAM), and as one more use it would favour
    // what the pool misses, and as a one-expert routing event tell the pool's split learner that
    // recency pays (each miss follows its own routing). Page-cache uses count again
    // kPageCacheUsesAfterRouting after the last report (a CPU runtime without the hook has no other signal).
    std::optional<std::chrono::steady_clock::time_point> last_routed;
    // Who reported its routing, and when: by uid, and the last report of a client that steers it
    // (Daemon::steers). While clients report it, the routing's temporal locality cuts its lock cap
    // (decide.cpp) only if one that steers it reports, or several users do: one user's fabricated
    // routing, however well formed, cannot release an operator's locks.
    std::map<uint32_t, std::chrono::steady_clock::time_point> routed_by;
    std::optional<std::chrono::steady_clock::time_point> steered_routing;
    // When the last client holding it went (unset while one holds it, or none ever did): of two
    // members of a family that no client holds, the one left last waits for the other (decide.cpp).
    std::optional<std::chrono::steady_clock::time_point> runtime_left;
    bool warm_pending = false;  // a profile was loaded: read its hot experts beyond the locks at the next placement
    // One place for its experts in VRAM pools: while the lock cap cannot hold its experts (and
    // those of the other models in use) anyway (one_place_needed; decide.cpp).
    bool one_place = true;
    bool one_place_decided = false;  // one_place was decided once (before: the default, true)
    // [policy] predict: the model's route predictor, how right it has been, and per layer what it
    // expects the next token to use there.
    struct Prediction {
        RoutePredictor predictor;
        PredictionTrust trust;
        std::vector<std::vector<uint32_t>> next;  // [layer]
    };
    std::unique_ptr<Prediction> prediction;
};

}  // namespace moecache::daemon
