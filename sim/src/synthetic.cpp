#include "moecache/sim/synthetic.h"

#include <numeric>

namespace moecache::sim {

Trace trace_of(const tracegen::Routing& r, const std::string& key, uint64_t expert_bytes, uint64_t token_us) {
    Trace t;
    t.tick_seconds = 1;
    TraceModel m;
    m.key = key;
    m.n_experts = r.n_experts;
    m.blocks.resize(r.n_layers);
    std::iota(m.blocks.begin(), m.blocks.end(), 0u);
    m.bytes_per_expert.assign(r.n_layers, expert_bytes);
    t.models.push_back(std::move(m));
    t.decisions.reserve(r.tokens * r.n_layers);
    // As moecache-tracegen writes it: a prompt batch as the hook reports it (tracegen::for_each_report).
    tracegen::for_each_report(r, [&](uint64_t at, uint32_t layer, uint32_t tokens, const std::vector<uint32_t>& experts) {
        t.add({at * token_us, 0, layer, tokens, experts, {}});
    });
    return t;
}

Result<tracegen::Routing> routing_of(const Trace& trace, const TraceModel& model) {
    std::vector<tracegen::RecordedStep> steps;
    for (const auto& d : trace.decisions)
        if (d.model == model.id) steps.push_back({d.layer, d.tokens, d.experts});
    return tracegen::routing_from_steps(static_cast<uint32_t>(model.blocks.size()), model.n_experts, steps);
}

}  // namespace moecache::sim
