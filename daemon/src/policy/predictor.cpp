#include "moecache/daemon/predictor.h"

#include <algorithm>
#include <cmath>

namespace moecache::daemon {

RoutePredictor::RoutePredictor(uint32_t n_layers, uint32_t n_experts)
    : n_layers_(n_layers), n_experts_(n_experts), pairs_(n_experts <= kMaxPairExperts && n_layers > 1),
      used_(size_t{n_layers} * n_experts, 0), again_(size_t{n_layers} * n_experts, 0),
      co_(pairs_ ? size_t{n_layers - 1} * n_experts * n_experts : 0, 0), tokens_(n_layers, 0), last_(n_layers),
      last_token_(n_layers, UINT64_MAX), score_(n_experts) {}

void RoutePredictor::observe(uint32_t layer, std::span<const uint32_t> experts) {
    if (layer >= n_layers_) return;
    if (prev_layer_ != UINT32_MAX && layer <= prev_layer_) ++token_;
    // Co-occurrence with the same token's previous layer.
    if (pairs_ && layer > 0 && last_token_[layer - 1] == token_ && prev_layer_ == layer - 1)
        for (uint32_t a : last_[layer - 1])
            for (uint32_t b : experts)
                if (b < n_experts_) ++co_[(size_t{layer - 1} * n_experts_ + a) * n_experts_ + b];
    // Reuse: what the previous token used here and this one uses again.
    auto& last = last_[layer];
    if (last_token_[layer] + 1 == token_)
        for (uint32_t b : experts)
            if (std::find(last.begin(), last.end(), b) != last.end()) ++again_[at(layer, b)];
    last.clear();
    for (uint32_t b : experts)
        if (b < n_experts_) {
            ++used_[at(layer, b)];
            last.push_back(b);
        }
    ++tokens_[layer];
    last_token_[layer] = token_;
    prev_layer_ = layer;
}

void RoutePredictor::top_k(uint32_t k, std::vector<uint32_t>& out) const {
    out.clear();
    k = std::min(k, n_experts_);
    if (k == 0) return;
    std::partial_sort(score_.begin(), score_.begin() + k, score_.end(), [](const auto& x, const auto& y) {
        return x.first != y.first ? x.first > y.first : x.second < y.second;
    });
    for (uint32_t i = 0; i < k; ++i) out.push_back(score_[i].second);
}

void RoutePredictor::predict_next_layer(uint32_t layer, std::span<const uint32_t> experts, uint32_t k,
                                        std::vector<uint32_t>& out) const {
    out.clear();
    if (layer + 1 >= n_layers_) return;
    const uint32_t next = layer + 1;
    const double n = static_cast<double>(tokens_[next]) + 1.0;
    for (uint32_t b = 0; b < n_experts_; ++b) score_[b] = {std::log((used_[at(next, b)] + 0.5) / n), b};
    if (pairs_)
        for (uint32_t a : experts) {
            if (a >= n_experts_) continue;
            const double ua = static_cast<double>(used_[at(layer, a)]) + 1.0;
            const uint32_t* co = &co_[(size_t{layer} * n_experts_ + a) * n_experts_];
            for (uint32_t b = 0; b < n_experts_; ++b) {
                const double pb = (used_[at(next, b)] + 0.5) / n;
                score_[b].first += std::log((co[b] + pb) / ua / pb);
            }
        }
    top_k(k, out);
}

void RoutePredictor::predict_next_token(uint32_t layer, std::span<const uint32_t> experts, uint32_t k,
                                        std::vector<uint32_t>& out) const {
    out.clear();
    if (layer >= n_layers_) return;
    const double n = static_cast<double>(tokens_[layer]) + 1.0;
    for (uint32_t b = 0; b < n_experts_; ++b) score_[b] = {std::log((used_[at(layer, b)] + 0.5) / n), b};
    for (uint32_t b : experts) {
        if (b >= n_experts_) continue;
        const double pb = (used_[at(layer, b)] + 0.5) / n;
        const double again = (again_[at(layer, b)] + pb) / (used_[at(layer, b)] + 1.0);
        score_[b].first += std::log(again / pb);
    }
    top_k(k, out);
}

}  // namespace moecache::daemon
