// Route prediction: from what the router just did, which experts come next. Learnt online from the
// decisions it is shown, so it never knows more than a running daemon would.
//   next layer  the experts of layer l + 1 most likely given this token's experts of layer l:
//               log popularity plus, for each expert a of l, the log lift log(p(b | a) / p(b)) of
//               each candidate b (co-occurrence, smoothed towards p(b));
//   next token  the experts of layer l the next token most likely uses: log popularity plus, for
//               the experts this token used at l, the log lift of being used again (recency).
// Summing raw co-occurrence counts instead would only find the popular experts again.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace moecache::daemon {

// Whether predictions are worth acting on: each is scored against what came, and they are trusted
// once kAfter were scored and at least kPrecision of what they named was used. Where routing is
// not predictable nothing is staged and nothing is wasted.
class PredictionTrust {
public:
    static constexpr uint64_t kAfter = 64;
    static constexpr double kPrecision = 0.3;
    void score(uint64_t predicted, uint64_t correct) {
        ++scored_;
        predicted_ += predicted;
        correct_ += correct;
    }
    [[nodiscard]] bool trusted() const { return scored_ >= kAfter && precision() >= kPrecision; }
    [[nodiscard]] double precision() const {
        return predicted_ ? static_cast<double>(correct_) / static_cast<double>(predicted_) : 0.0;
    }
    [[nodiscard]] uint64_t predicted() const { return predicted_; }
    [[nodiscard]] uint64_t correct() const { return correct_; }

private:
    uint64_t scored_ = 0, predicted_ = 0, correct_ = 0;
};

class RoutePredictor {
public:
    // Co-occurrence is learnt for up to this many experts per layer (E x E counts per layer pair);
    // above it, next-layer prediction falls back to popularity.
    static constexpr uint32_t kMaxPairExperts = 1024;

    RoutePredictor(uint32_t n_layers, uint32_t n_experts);

    // One token's experts at `layer`. A token's layers come in order; a layer at or below the
    // previous one starts the next token.
    void observe(uint32_t layer, std::span<const uint32_t> experts);

    // The `k` most likely experts, best first, into `out`.
    void predict_next_layer(uint32_t layer, std::span<const uint32_t> experts, uint32_t k,
                            std::vector<uint32_t>& out) const;
    void predict_next_token(uint32_t layer, std::span<const uint32_t> experts, uint32_t k,
                            std::vector<uint32_t>& out) const;

    [[nodiscard]] uint32_t n_layers() const { return n_layers_; }
    [[nodiscard]] uint32_t n_experts() const { return n_experts_; }

private:
    [[nodiscard]] size_t at(uint32_t layer, uint32_t e) const { return size_t{layer} * n_experts_ + e; }
    void top_k(uint32_t k, std::vector<uint32_t>& out) const;

    uint32_t n_layers_, n_experts_;
    bool pairs_;
    std::vector<uint32_t> used_;    // [layer][e]: tokens that used e at layer
    std::vector<uint32_t> again_;   // [layer][e]: ... and the next token used it there too
    std::vector<uint32_t> co_;      // [layer][a][b]: tokens that used a at layer and b at layer + 1
    std::vector<uint64_t> tokens_;  // [layer]: tokens seen at layer
    std::vector<std::vector<uint32_t>> last_;  // [layer]: the latest token's experts there
    std::vector<uint64_t> last_token_;         // [layer]: which token that was (UINT64_MAX: none)
    uint64_t token_ = 0;
    uint32_t prev_layer_ = UINT32_MAX;
    mutable std::vector<std::pair<double, uint32_t>> score_;
};

}  // namespace moecache::daemon
