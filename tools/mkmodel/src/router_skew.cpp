#include "moecache/mkmodel/router_skew.h"

#include "rng.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace moecache::mkmodel {
namespace {

std::vector<double> biases(uint32_t n, RouterSkew s) {
    std::vector<double> b(n);
    for (uint32_t r = 0; r < n; ++r) b[r] = -s.scale * std::pow(std::log(static_cast<double>(r) + 1.0), s.shape);
    return b;
}

// Routing counts per rank over a fixed noise matrix, so that fits compare like with like.
std::vector<double> route(const std::vector<float>& noise, uint32_t n, uint32_t k, RouterSkew s) {
    const auto b = biases(n, s);
    const size_t tokens = noise.size() / n;
    std::vector<double> counts(n, 0.0);
    std::vector<std::pair<double, uint32_t>> logits(n);
    for (size_t t = 0; t < tokens; ++t) {
        for (uint32_t e = 0; e < n; ++e) logits[e] = {b[e] + static_cast<double>(noise[t * n + e]), e};
        std::nth_element(logits.begin(), logits.begin() + (k - 1), logits.end(),
                         [](const auto& x, const auto& y) { return x.first > y.first; });
        for (uint32_t i = 0; i < k; ++i) counts[logits[i].second] += 1.0;
    }
    return counts;
}

std::vector<float> noise_matrix(uint32_t n, uint32_t tokens, uint64_t seed) {
    Rng rng(seed);
    std::vector<float> z(static_cast<size_t>(n) * tokens);
    for (auto& v : z) v = static_cast<float>(rng.normal());
    return z;
}

}  // namespace

std::vector<double> coverage_curve(std::vector<double> counts) {
    std::sort(counts.begin(), counts.end(), std::greater<>());
    const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
    std::vector<double> curve(counts.size());
    double acc = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
        acc += counts[i];
        curve[i] = total > 0 ? acc / total : 0.0;
    }
    return curve;
}

double coverage_at(const std::vector<double>& curve, double fraction) {
    if (curve.empty()) return 0.0;
    const auto k = static_cast<size_t>(std::ceil(fraction * static_cast<double>(curve.size()) - 1e-9));
    return curve[std::clamp<size_t>(k, 1, curve.size()) - 1];
}

std::vector<double> simulate_popularity(uint32_t n_experts, uint32_t n_used, RouterSkew skew,
                                        uint32_t tokens, uint64_t seed) {
    auto counts = route(noise_matrix(n_experts, tokens, seed), n_experts, n_used, skew);
    const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
    for (auto& c : counts) c /= total;
    return counts;
}

const std::vector<Preset>& presets() {
    static const std::vector<Preset> kPresets = {
        {"uniform", "every expert equally likely", {}, {}, 0, 0},
        {"deepseek-v4-flash",
         "published DeepSeek-V4-Flash routing: the hottest 12.5 % of a layer's experts take ~58 % "
         "of routings, the hottest 25 % ~71 %",
         {{0.125, 0.58}, {0.25, 0.71}}, {}, 0, 0},
        {"low-skew",
         "close to uniform, as reported for OLMoE: the hottest 12.5 % take ~18 %, the hottest "
         "25 % ~33 %",
         {{0.125, 0.18}, {0.25, 0.33}}, {}, 0, 0},
        // Routing as real models' router logs show it (docs/routing.md): weak static skew, reuse
        // between neighbouring tokens and layers that the model itself makes (ContextRouting).
        {"mixtral-like",
         "Mixtral-8x7B's decode (8 experts, top-2): the hottest 1/8 take ~20 %, 2/8 ~36 %; ~36 % of a "
         "token's experts used by the previous token (25 % by chance); ~44 % predictable from the layer before",
         {{0.125, 0.20}, {0.25, 0.36}}, {0.6, 16, 0.3}, 8, 2},
        {"qwen3-next-like",
         "a 512-expert model (Qwen3-Next-like, top-10): weak static skew (a static top-32 learnt on half a "
         "run takes ~10 % of the other half), strong reuse (a per-layer LRU of 64 hits ~67 %)",
         {{0.125, 0.19}, {0.25, 0.33}}, {3.0, 16, 0.3}, 512, 10},
        {"deepseek-like",
         "a 256-expert model (DeepSeek-like, top-8): DeepSeek-V4-Flash's skew (the hottest 12.5 % take "
         "~58 %), reuse between tokens, layers that predict each other",
         {{0.125, 0.58}, {0.25, 0.71}}, {1.5, 16, 0.8}, 256, 8},
    };
    return kPresets;
}

const Preset* find_preset(const std::string& name) {
    for (const auto& p : presets())
        if (p.name == name) return &p;
    return nullptr;
}

RouterSkew fit_skew(const Preset& preset, uint32_t n_experts, uint32_t n_used) {
    if (preset.targets.empty() || n_used >= n_experts) return {};
    const auto noise = noise_matrix(n_experts, 3000, 11);
    const auto& first = preset.targets.front();
    RouterSkew best{};
    double best_err = std::numeric_limits<double>::infinity();
    for (double shape = 0.5; shape <= 2.01; shape += 0.1) {
        // Coverage of the first target grows with S: bisect for it, then score the rest.
        double lo = 0.0, hi = 30.0;
        for (int it = 0; it < 30; ++it) {
            const double mid = 0.5 * (lo + hi);
            const auto curve = coverage_curve(route(noise, n_experts, n_used, {mid, shape}));
            (coverage_at(curve, first.expert_fraction) < first.routing_share ? lo : hi) = mid;
        }
        const RouterSkew s{0.5 * (lo + hi), shape};
        const auto curve = coverage_curve(route(noise, n_experts, n_used, s));
        double err = 0;
        for (const auto& t : preset.targets) {
            const double d = coverage_at(curve, t.expert_fraction) - t.routing_share;
            err += d * d;
        }
        if (err < best_err) {
            best_err = err;
            best = s;
        }
    }
    return best;
}

}  // namespace moecache::mkmodel
