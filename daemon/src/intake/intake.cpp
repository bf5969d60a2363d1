#include "intake/intake.h"

#include "moecache/daemon/decide.h"
#include "moecache/daemon/decide_step.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/router_trace.h"
#include "pagecache/page_cache_watch.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>

namespace moecache::daemon {

Intake::Intake(const Config& config, ModelRegistry& models, PageCacheWatch& page_cache, DecideStep& decide,
               RouterTrace& trace)
    : config_(config), models_(models), page_cache_(page_cache), decide_(decide), trace_(trace) {}

void Intake::page_cache() {
    const PageCacheWatch::Resolve resolve = [this](uint32_t id) -> ModelResidency* {
        ModelEntry* m = models_.find(id);
        return m ? m->res.get() : nullptr;
    };
    auto batch = page_cache_.consume(resolve);
    decide_.missed(batch.missed);
    if (batch.used.empty()) return;
    // The slots read from storage, for the page cache's view of where touched experts were: made at
    // the first model without routing reports (a CPU runtime), not for every batch.
    std::optional<std::set<std::pair<uint32_t, uint32_t>>> read;
    const auto now = std::chrono::steady_clock::now();
    for (auto& m : models_.all()) {
        if (!m->res) continue;
        const uint32_t n = m->res->n_experts();
        const bool routed = m->last_routed && now - *m->last_routed < kPageCacheUsesAfterRouting;
        for (const auto& [id, slot] : batch.used) {
            if (id != m->id || slot >= m->res->n_slots()) continue;
            m->last_used = now;
            if (routed) continue;  // the routing reports are its heat (ModelEntry::last_routed)
            if (!read) read.emplace(batch.missed.begin(), batch.missed.end());
            ++m->outcome.touched[read->count({id, slot}) ? Reach::Storage : Reach::Ram];
            const uint32_t expert = slot % n;
            m->res->heat().record(slot / n, std::span<const uint32_t>(&expert, 1));
        }
    }
}

void Intake::routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens,
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
            decide_.routed(tokens, m.last_used);
            (tokens == 1 ? m.outcome.decode_tokens : m.outcome.prompt_tokens) += tokens;
        }
        // A report of 0 tokens is more of the batch before it: its ranking (moecache/batch_report.h),
        // or the rest of a decision too large for one ring record whose start an earlier turn read
        // (ClientSessions::read_rings joins the others): heat, not another routing.
        if (tokens == 0) {
            if (continued)
                m.res->heat().record_continued(*layer, experts);
            else
                m.res->heat().record_more(*layer, experts);
            return;
        }
        m.res->heat().record(*layer, experts);
        if (tokens == 1) count_reach(m, *layer, experts);
        // A prompt batch's report is not one token's routing: the predictor learns only tokens.
        if (config_.predict && tokens == 1) predict(m, *layer, experts);
    }
}

void Intake::count_reach(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts) {
    const auto& r = *m.res;
    const uint32_t ne = r.n_experts();
    for (uint32_t e : experts) {
        if (e >= ne) continue;
        const uint32_t slot = layer * ne + e;
        if (slot >= r.n_slots()) continue;
        const auto& st = r.state(slot);
        ++m.outcome.routed[reach(st.tier(), r.vram_holders(slot), st.cached_bytes(), r.slot_bytes(slot))];
    }
}

void Intake::predict(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts) {
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
    if (!p.trust.trusted()) return;
    for (uint32_t e : next) decide_.predicted(m.id, layer * ne + e);
}

}  // namespace moecache::daemon
