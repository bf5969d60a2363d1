// Intake: the page cache's events (faults, reads, evictions of model pages) and the routing the
// clients report become facts about experts for the next decisions: uses and heat, the models'
// clocks, misses and trusted predictions handed to the decide step, the routing trace. Nothing
// here locks or unlocks.
#pragma once

#include "moecache/daemon/config.h"

#include <cstdint>
#include <span>

namespace moecache::daemon {

class DecideStep;
class ModelRegistry;
class PageCacheWatch;
class RouterTrace;
struct ModelEntry;

class Intake {
public:
    Intake(const Config& config, ModelRegistry& models, PageCacheWatch& page_cache, DecideStep& decide,
           RouterTrace& trace);

    // The page cache's batch of events: uses (heat, unless the model's routing is reported) and
    // misses (for the decide step's reads).
    void page_cache();
    // A batch of `tokens` tokens routed block `block` of model m to `experts` (tokens 0: more of
    // the batch before it; continued: the rest of a decision an earlier turn began reading).
    void routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens,
                 bool continued = false);

private:
    // A decode token's experts counted by where each was (RoutingOutcome: "is it helping").
    void count_reach(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts);
    // [policy] predict: scores the last prediction for this layer, learns, and predicts the next
    // token's experts there (handed to the decide step once the predictor is trusted).
    void predict(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts);

    const Config& config_;
    ModelRegistry& models_;
    PageCacheWatch& page_cache_;
    DecideStep& decide_;
    RouterTrace& trace_;
};

}  // namespace moecache::daemon
