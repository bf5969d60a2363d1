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
    for (uint64_t tok = 0; tok < r.tokens; ++tok)
        for (uint32_t l = 0; l < r.n_layers; ++l) {
            const auto e = r.at(tok, l);
            t.decisions.push_back({tok * token_us, 0, l, 1, std::vector<uint32_t>(e.begin(), e.end())});
        }
    return t;
}

}  // namespace moecache::sim
