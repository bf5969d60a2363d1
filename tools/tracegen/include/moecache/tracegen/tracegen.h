// Synthetic router traces: which experts each token is routed to in each MoE layer, for replaying
// placement policies (docs/trace.md). The router is mkmodel's (router_skew.h): the logit of expert
// e is -S * ln(rank_e + 1)^P plus N(0, 1) noise, and each token takes the top k. Two controls:
//   reuse   temporal locality: each layer's noise of an expert carries over from one token to the
//           next with this correlation, so a token tends to reuse the previous token's experts;
//   follow  layer-to-layer correlation: in layer l+1, the experts paired with this token's experts
//           of layer l (the same popularity rank, so every layer keeps its popularity) get this
//           much added to their logits, so the next layer's experts can be predicted from this
//           layer's.
// And the families routing of other structure needs (issue 22's), each off by default:
//   zipf    popularity Zipf-like: P(rank r) ~ (r + 1)^-alpha, each token's k experts drawn without
//           replacement (Gumbel noise on -alpha ln(r + 1) instead of the router's normal noise);
//   shift   at this token the popularity is drawn anew in every layer (a topic change);
//   keep    bursty reuse: with this probability a layer keeps its previous token's experts but one,
//           which is drawn anew (the rest of the time the token is routed afresh);
//   prompt  a prompt batch of `prompt_tokens` tokens every `prompt_every` decoded tokens: one step
//           of many tokens, written as one decision per layer with its token count and the union
//           of its experts (what a runtime's large-batch copies carry).
// Presets fit the controls to published statistics; measure() reads the same statistics off any
// routing, generated or recorded.
#pragma once

#include <algorithm>

#include "moecache/batch_report.h"
#include "moecache/error.h"
#include "moecache/mkmodel/router_skew.h"
#include "moecache/mkmodel/synth_model.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moecache::tracegen {

struct Spec {
    // mkmodel's preset shape: a preset name means one model shape in both tools.
    uint32_t n_layers = mkmodel::kPresetShape.layers;
    uint32_t n_experts = mkmodel::kPresetShape.experts;
    uint32_t n_used = mkmodel::kPresetShape.used;
    uint64_t tokens = 2000;
    mkmodel::RouterSkew skew;  // S = 0: every expert equally likely
    double reuse = 0;          // [0, 1)
    double follow = 0;         // [0, 100], in logit units
    uint64_t seed = 1;
    double zipf = 0;           // alpha > 0: Zipf-like popularity (overrides skew)
    uint64_t shift_at = 0;     // > 0: the popularity is drawn anew at this token
    double keep = 0;           // [0, 1): bursty reuse
    uint32_t prompt_tokens = 0, prompt_every = 0;  // prompt batches between decodes
};

// The experts of every token in every layer, each list sorted.
struct Routing {
    uint32_t n_layers = 0;
    uint32_t n_experts = 0;
    uint32_t n_used = 0;
    uint64_t tokens = 0;
    std::vector<uint16_t> experts;  // [token][layer][i]
    // Tokens per step, in order: 1 a decoded token, more a prompt batch. Empty: every step one token.
    std::vector<uint32_t> steps;

    [[nodiscard]] std::span<const uint16_t> at(uint64_t token, uint32_t layer) const {
        return {experts.data() + (token * n_layers + layer) * n_used, n_used};
    }
};

// Fails, naming the field, on a shape it cannot generate.
Result<Routing> generate(const Spec& spec);

struct Stats {
    double top_eighth = 0;   // share of routings to the hottest 12.5 % of a layer's experts (mean over layers)
    double top_quarter = 0;  // ... to the hottest 25 %
    double reuse = 0;        // share of a token's experts in a layer that the previous token used there too
    // Precision of predicting layer l+1's experts from layer l's: the k experts of l+1 most
    // likely given this token's experts of l (popularity times the lift of each co-occurrence,
    // learnt on the first half of the trace), scored on the second half.
    double next_layer = 0;
    // What reuse would be by chance: each token drawn independently from the layer's popularity
    // (the sum over experts of the squared share of tokens that use it, over k).
    double reuse_chance = 0;
    // A static hot set learnt on the first half: each layer's `static_top` most used experts there,
    // and the share of the second half's routings they take (chance: static_top / experts).
    uint32_t static_top = 0;
    double static_cover = 0, static_chance = 0;
    // Per-layer LRU caches of lru_slots[i] experts each, from empty: the share of routings that hit.
    std::vector<uint32_t> lru_slots;
    std::vector<double> lru_hits;
};
struct MeasureOptions {
    uint32_t static_top = 0;           // 0: experts / 16 (at least k)
    std::vector<uint32_t> lru_slots;   // empty: 2 k per layer (twice the active experts) and experts / 8
};
[[nodiscard]] Stats measure(const Routing& routing, const MeasureOptions& options = {});

// A recorded trace's decode steps as a Routing: one decision a layer and token (`tokens` 1; batches
// and their rankings are left out), token t of layer l the t-th such decision of l, as many tokens
// as every layer has; the width k the most common list length (other lengths left out). Fails on
// no layer, an expert past `n_experts` or a layer past `n_layers`.
struct RecordedStep {
    uint32_t layer = 0;
    uint32_t tokens = 0;
    std::span<const uint32_t> experts;
};
Result<Routing> routing_from_steps(uint32_t n_layers, uint32_t n_experts, std::span<const RecordedStep> steps);

struct Preset {
    std::string name;
    std::string description;
    std::string skew_preset;  // mkmodel's preset of the same routing skew ("": Zipf, family.zipf)
    double next_layer = -1;   // target next-layer predictability; < 0: none (follow = 0)
    struct Family {
        uint32_t experts = 0;         // the family's own expert count (0: as asked)
        double zipf = 0;
        double shift_fraction = 0;    // the popularity drawn anew this far into the trace
        double keep = 0;
        uint32_t prompt_tokens = 0, prompt_every = 0;
        uint32_t used = 0;   // the family's own experts per token (0: as asked)
        double reuse = 0;    // token-to-token noise correlation (the real-like presets' reuse)
    } family;
};
const std::vector<Preset>& presets();
const Preset* find_preset(const std::string& name);

// The most hits a placement holding `shares` of all the experts (every layer's together; one
// rate per share) can expect on generate(spec)'s routing without seeing the future: before each
// step (a token, or a prompt batch as the hook reports it, step_reports), the experts of the most
// expected accesses in that step under the distribution the generator draws it from (the
// popularity in force, shift included, and the previous token's experts: what drives the draw,
// not the draw), scored against the step as generated. It rearranges for free between steps and
// fetches nothing on a miss, so no policy that does not see the future expects more hits; it
// places a whole token at once, so predicting a layer from the one before within a token (the
// +predict column of moecache-sim) is beyond it. The expectations are sampled: `samples` draws of
// a step where they depend on the previous token (bursty), 64 times as many once an epoch
// otherwise, so the bound holds up to that sampling's noise. Routing with noise reuse has hidden
// state: an error.
Result<std::vector<double>> bound_hit_rates(const Spec& spec, std::span<const double> shares, uint32_t samples = 64);

// The same placement by what a policy can learn of a fixed popularity: before each step, the
// experts of the most uses so far (the accesses as the hook reports them), counted from zero at the
// shift (which it is told). Where tokens are drawn independently from a popularity that is a
// shuffle of known weights (every family but bursty; within a token the layers may follow each
// other), more uses means more likely, so no policy that does not see the future and learns the
// popularity from the routing expects more, short of using the layers' pairing to learn faster.
// Bursty routing: an error.
Result<std::vector<double>> learner_hit_rates(const Spec& spec, std::span<const double> shares);

// `shape` with its skew and follow fitted to the preset for its expert counts.
Result<Spec> fit(const Preset& preset, Spec shape);

// What the CUDA hook reports of one step of `n` tokens from `first` in `layer` (a decision of the
// trace, with `n` its token count): one token's experts, each token's for a batch of at most
// kPerTokenReports tokens, and for a prompt batch moecache/batch_report.h's decisions (the experts
// more of its tokens chose than an even share with its token count, then its ranking as decisions
// of 0 tokens), as cuda-hooks/src/hook/routes.cpp from the read-back ids. Calls emit(experts,
// tokens) once per decision.
inline constexpr uint32_t kPerTokenReports = 16;
template <class Emit>
void step_reports(const Routing& r, uint64_t first, uint64_t n, uint32_t layer, std::vector<uint32_t>& scratch, Emit&& emit) {
    const uint64_t end = std::min<uint64_t>(first + n, r.tokens);
    if (n <= kPerTokenReports) {
        for (uint64_t t = first; t < end; ++t) {
            const auto e = r.at(t, layer);
            scratch.assign(e.begin(), e.end());
            emit(scratch, uint32_t{1});
        }
        return;
    }
    std::vector<uint32_t> count(r.n_experts, 0);
    for (uint64_t t = first; t < end; ++t)
        for (uint16_t e : r.at(t, layer)) ++count[e];
    batch_report(count, end - first, r.n_used, scratch, emit);
}

// Every decision of the routing, in order, as the hook reports it (step_reports over its steps and
// layers): emit(first_token, layer, tokens, experts).
template <class Emit>
void for_each_report(const Routing& r, Emit&& emit) {
    std::vector<uint32_t> scratch;
    uint64_t t = 0, step = 0;
    while (t < r.tokens) {
        const uint64_t n = step < r.steps.size() ? r.steps[step] : 1;
        ++step;
        for (uint32_t l = 0; l < r.n_layers; ++l) {
            uint64_t at = t;
            step_reports(r, t, n, l, scratch, [&](const std::vector<uint32_t>& e, uint32_t tokens) {
                emit(at, l, tokens, e);
                at += tokens;
            });
        }
        t += n;
    }
}

// The trace format of docs/trace.md: the header, one model (key `key`, `expert_bytes` per expert in
// every layer), and one decision per step and layer (step_reports: a prompt batch as the hook
// reports it), tokens `token_us` microseconds apart.
Result<void> write_trace(const Routing& routing, const std::string& path, const std::string& key,
                         uint64_t expert_bytes, uint64_t token_us);

}  // namespace moecache::tracegen
