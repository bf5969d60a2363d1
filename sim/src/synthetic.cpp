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
    // As moecache-tracegen writes it: a prompt batch as the hook reports it (tracegen::step_reports).
    std::vector<uint32_t> scratch;
    uint64_t tok = 0, step = 0;
    while (tok < r.tokens) {
        const uint64_t n = step < r.steps.size() ? r.steps[step] : 1;
        ++step;
        for (uint32_t l = 0; l < r.n_layers; ++l) {
            uint64_t at = tok;
            tracegen::step_reports(r, tok, n, l, scratch, [&](const std::vector<uint32_t>& e, uint32_t tokens) {
                t.decisions.push_back({at * token_us, 0, l, tokens, e});
                at += tokens;
            });
        }
        tok += n;
    }
    return t;
}

}  // namespace moecache::sim
