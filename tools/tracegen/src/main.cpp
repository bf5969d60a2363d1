// moecache-tracegen: synthetic router traces (docs/trace.md) for replaying placement policies.
#include "moecache/mkmodel/cli.h"
#include "moecache/sim/synthetic.h"
#include "moecache/sim/trace.h"
#include "moecache/tracegen/tracegen.h"

#include <fmt/format.h>

#include <string>

namespace {

constexpr const char* kUsage = R"(usage: moecache-tracegen -o FILE [options]
       moecache-tracegen --stats TRACE [--key KEY] [--static-top N] [--lru N,N...]
Writes a synthetic router trace (docs/trace.md): per token, the experts of every MoE layer, from
mkmodel's router (popularity skew) with temporal locality and layer-to-layer correlation.
  -o, --output FILE     the trace (JSON lines)
  --preset NAME         deepseek-v4-flash | low-skew | uniform: fits the skew and the layer
                        correlation to the preset's published statistics for these counts;
                        zipf-256 | topic-shift | bursty | prompts: routing of other structure
                        (their own expert count unless --experts says otherwise);
                        mixtral-like | qwen3-next-like | deepseek-like: as real models' router
                        logs show (docs/routing.md), their own shape and reuse unless given
  --skew S, --skew-shape P   the router skew by hand (excludes --preset)
  --follow B            layer-to-layer correlation: a logit boost in [0, 100] for the experts paired
                        with this token's experts of the previous layer (by hand; else the preset's)
  --reuse R             token-to-token noise correlation in [0, 1) (temporal locality; 0)
  --zipf A              Zipf-like popularity of exponent A instead of the router's skew
  --keep P              bursty: with probability P a layer keeps its previous token's experts but one
  --shift T             the popularity drawn anew at token T (a topic change)
  --prompt N:EVERY      a prompt batch of N tokens every EVERY decoded tokens (as the CUDA hook
                        reports it: per layer the experts more of its tokens chose than an even
                        share, with its token count, then its ranking as decisions of 0 tokens)
  --layers L            MoE layers (16)
  --experts N           experts per layer (64)
  --experts-used K      experts per token (8)
  --tokens T            tokens (2000)
  --seed X              (1)
  --expert-bytes B      bytes of one expert, written in the model line (1671168)
  --token-us U          microseconds between tokens, for timestamps (25000)
  --key KEY             the model's key in the trace (synthetic)
It prints the trace's statistics: the share of routings to the hottest 12.5 % and 25 % of a
layer's experts, the share of a token's experts the previous token used too (and by chance), how
well the next layer's experts are predicted from this layer's, how much of the second half a static
hot set learnt on the first half takes, and the hits of per-layer LRU caches.
  --stats TRACE         the same statistics of a recorded trace (moecachectl trace, the CUDA hook's
                        MOECACHE_TRACE, the backend's): its decode steps, of the model KEY (the
                        first model if not given); nothing is written
  --static-top N        the static hot set's experts per layer (experts / 16)
  --lru N,N...          LRU slots per layer (2 x experts used, and experts / 8)
)";

// Prints st, one statistic a line, as the issue's tables give them.
void print_stats(const moecache::tracegen::Stats& st, uint32_t n_experts) {
    fmt::print("  hottest 12.5 % of a layer's experts take {:.1f} % of routings, 25 % take {:.1f} %\n"
               "  {:.1f} % of a token's experts were used by the previous token ({:.1f} % by chance)\n"
               "  next layer {:.1f} % predictable from this layer's experts\n"
               "  a static top-{} a layer learnt on the first half takes {:.1f} % of the second ({:.1f} % by chance)\n",
               100 * st.top_eighth, 100 * st.top_quarter, 100 * st.reuse, 100 * st.reuse_chance, 100 * st.next_layer,
               st.static_top, 100 * st.static_cover, 100 * st.static_chance);
    for (size_t i = 0; i < st.lru_slots.size(); ++i)
        fmt::print("  an LRU of {} experts a layer ({:.1f} %) hits {:.1f} %\n", st.lru_slots[i],
                   100.0 * st.lru_slots[i] / n_experts, 100 * st.lru_hits[i]);
}

// --stats: a recorded trace's statistics.
int recorded_stats(const std::string& path, const std::string& key, const moecache::tracegen::MeasureOptions& options) {
    using namespace moecache;
    auto die = [](const std::string& m) { return mkmodel::usage_error("moecache-tracegen", m); };
    auto trace = sim::read_trace(path);
    if (!trace) return die(trace.error().what());
    const sim::TraceModel* model = nullptr;
    for (const auto& m : trace->models)
        if (key.empty() || m.key == key) {
            model = &m;
            break;
        }
    if (model == nullptr)
        return die(key.empty() ? fmt::format("{}: no model line", path) : fmt::format("{}: no model of key {}", path, key));
    auto routing = sim::routing_of(*trace, *model);
    if (!routing) return die(fmt::format("{}: {}", path, routing.error().what()));
    fmt::print("{} (model {}): {} decode tokens x {} layers, top-{} of {} experts\n", path, model->key, routing->tokens,
               routing->n_layers, routing->n_used, routing->n_experts);
    print_stats(tracegen::measure(*routing, options), routing->n_experts);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    using namespace moecache::tracegen;
    namespace mkmodel = moecache::mkmodel;
    Spec spec;
    std::string output, preset, key = "synthetic", stats_of;
    MeasureOptions measure_options;
    uint64_t expert_bytes = 1671168, token_us = 25000;
    bool skew_given = false, follow_given = false, experts_given = false, used_given = false, reuse_given = false;
    auto die = [](const std::string& m) { return mkmodel::usage_error("moecache-tracegen", m); };
    auto option = [&](const std::string& a, const std::string& v) -> moecache::Result<bool> {
        bool ok = true;
        if (a == "-o" || a == "--output") output = v;
        else if (a == "--preset") preset = v;
        else if (a == "--skew") { ok = mkmodel::parse_double(v, spec.skew.scale); skew_given = true; }
        else if (a == "--skew-shape") ok = mkmodel::parse_double(v, spec.skew.shape);
        else if (a == "--follow") { ok = mkmodel::parse_double(v, spec.follow); follow_given = true; }
        else if (a == "--reuse") { ok = mkmodel::parse_double(v, spec.reuse); reuse_given = true; }
        else if (a == "--layers") ok = mkmodel::parse_number(v, spec.n_layers);
        else if (a == "--experts") { ok = mkmodel::parse_number(v, spec.n_experts); experts_given = true; }
        else if (a == "--zipf") ok = mkmodel::parse_double(v, spec.zipf);
        else if (a == "--keep") ok = mkmodel::parse_double(v, spec.keep);
        else if (a == "--shift") ok = mkmodel::parse_number(v, spec.shift_at);
        else if (a == "--prompt") {
            const auto colon = v.find(':');
            ok = colon != std::string::npos && mkmodel::parse_number(v.substr(0, colon), spec.prompt_tokens) &&
                 mkmodel::parse_number(v.substr(colon + 1), spec.prompt_every);
        }
        else if (a == "--experts-used") { ok = mkmodel::parse_number(v, spec.n_used); used_given = true; }
        else if (a == "--tokens") ok = mkmodel::parse_number(v, spec.tokens);
        else if (a == "--seed") ok = mkmodel::parse_number(v, spec.seed);
        else if (a == "--expert-bytes") ok = mkmodel::parse_number(v, expert_bytes);
        else if (a == "--token-us") ok = mkmodel::parse_number(v, token_us);
        else if (a == "--key") key = v;
        else if (a == "--stats") stats_of = v;
        else if (a == "--static-top") ok = mkmodel::parse_number(v, measure_options.static_top);
        else if (a == "--lru") {
            measure_options.lru_slots.clear();
            size_t at = 0;
            while (ok && at <= v.size()) {
                const size_t comma = std::min(v.find(',', at), v.size());
                uint32_t n = 0;
                ok = mkmodel::parse_number(v.substr(at, comma - at), n) && n > 0;
                measure_options.lru_slots.push_back(n);
                at = comma + 1;
            }
        }
        else return false;
        if (!ok) return mkmodel::bad_value(a, v);
        return true;
    };
    if (auto done = mkmodel::parse_options(argc, argv, "moecache-tracegen", kUsage, [](const std::string&) { return false; },
                                           option))
        return *done;
    if (!stats_of.empty()) return recorded_stats(stats_of, key == "synthetic" ? std::string() : key, measure_options);
    if (output.empty()) return die("-o FILE is required (see --help)");
    if (!preset.empty()) {
        if (skew_given) return die("--preset and --skew exclude each other");
        const Preset* p = find_preset(preset);
        if (!p) {
            std::string names;
            for (const auto& q : presets()) names += " " + q.name;
            return die(fmt::format("unknown preset '{}'; known:{}", preset, names));
        }
        const double follow = spec.follow;
        if (p->family.experts != 0 && !experts_given) spec.n_experts = p->family.experts;
        if (p->family.used != 0 && !used_given) spec.n_used = p->family.used;
        const double reuse = spec.reuse;
        auto fitted = fit(*p, spec);
        if (!fitted) return die(fitted.error().what());
        spec = *fitted;
        if (follow_given) spec.follow = follow;
        if (reuse_given) spec.reuse = reuse;
    }
    auto routing = generate(spec);
    if (!routing) return die(routing.error().what());
    if (auto w = write_trace(*routing, output, key, expert_bytes, token_us); !w) return die(w.error().what());
    fmt::print("{}: {} tokens x {} layers, top-{} of {} experts; skew S={:.3f} P={:.2f}, follow {:.3f}, reuse {:.3f}\n",
               output, spec.tokens, spec.n_layers, spec.n_used, spec.n_experts, spec.skew.scale, spec.skew.shape,
               spec.follow, spec.reuse);
    print_stats(measure(*routing, measure_options), spec.n_experts);
    return 0;
}
