// Intake: the page cache's events (faults, reads, evictions of model pages) and the routing the
// clients report become facts about experts (uses, misses) for the next decisions. Nothing here
// locks or unlocks.
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/system_memory.h"

#include "intake/page_cache_watch.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/log.h"

#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace moecache::daemon {

void Daemon::consume_page_cache() {
    const PageCacheWatch::Resolve resolve = [this](uint32_t id) -> ModelResidency* {
        ModelEntry* m = models_->find(id);
        return m ? m->res.get() : nullptr;
    };
    auto batch = page_cache_->consume(resolve);
    missed_this_batch_.insert(missed_this_batch_.end(), batch.missed.begin(), batch.missed.end());
    if (batch.used.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    for (auto& m : models_->all()) {
        if (!m->res) continue;
        const uint32_t n = m->res->n_experts();
        const bool routed = m->last_routed && now - *m->last_routed < kPageCacheUsesAfterRouting;
        for (const auto& [id, slot] : batch.used) {
            if (id != m->id || slot >= m->res->n_slots()) continue;
            m->last_used = now;
            if (routed) continue;  // the routing reports are its heat (ModelEntry::last_routed)
            const uint32_t expert = slot % n;
            m->res->heat().record(slot / n, std::span<const uint32_t>(&expert, 1));
        }
    }
}

void Daemon::record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens) {
    for (auto& m : models_->all())
        if (m->id == model && m->res) record_routing(*m, block, experts, tokens);
}

void Daemon::record_routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens,
                            bool continued) {
    if (trace_.on() && m.res) {
        trace_.model(m.id, m.res->model().map(), m.path);
        trace_.decision(m.id, block, experts, tokens);
    }
    m.last_used = std::chrono::steady_clock::now();
    m.last_routed = m.last_used;
    if (const auto layer = m.res->layer_of_block(block)) {
        // The clock advances once per batch: on the first MoE layer's report.
        if (*layer == 0) {
            m.res->heat().advance_clock(tokens);
            tokens_since_place_ += tokens;
            if (placement_due(tokens_since_place_, m.last_used - last_place_)) request_place();
        }
        // A report of 0 tokens is more of the batch before it: its ranking (moecache/batch_report.h),
        // or the rest of a decision too large for one ring record whose start an earlier turn read
        // (consume_client_telemetry joins the others): heat, not another routing.
        if (tokens == 0) {
            if (continued)
                m.res->heat().record_continued(*layer, experts);
            else
                m.res->heat().record_more(*layer, experts);
            return;
        }
        m.res->heat().record(*layer, experts);
        // A prompt batch's report is not one token's routing: the predictor learns only tokens.
        if (config_.predict && tokens == 1) predict(m, *layer, experts);
    }
}

}  // namespace moecache::daemon
