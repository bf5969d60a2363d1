#include "moecache/tracegen/tracegen.h"

#include "moecache/mkmodel/router_skew.h"
#include "moecache/trace_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <random>

namespace moecache::tracegen {
namespace {

// N(0, 1) by Box-Muller over a 64-bit Mersenne twister: the same numbers for the same seed here.
class Normal {
public:
    explicit Normal(uint64_t seed) : rng_(seed) {}
    double operator()() {
        if (have_spare_) {
            have_spare_ = false;
            return spare_;
        }
        double u = 0;
        while (u <= 0) u = unit();
        const double v = unit(), r = std::sqrt(-2.0 * std::log(u)), a = 2.0 * M_PI * v;
        spare_ = r * std::sin(a);
        have_spare_ = true;
        return r * std::cos(a);
    }
    std::mt19937_64& engine() { return rng_; }

private:
    double unit() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }
    std::mt19937_64 rng_;
    double spare_ = 0;
    bool have_spare_ = false;
};

// Each layer's popularity: the router's bias of every expert, and which expert of the next layer
// has each expert's rank (the pairing `follow` boosts).
struct Popularity {
    std::vector<std::vector<uint32_t>> by_rank, pair;
    std::vector<double> bias;
};

// Gumbel(0, 1) for Zipf: top-k of log-weights plus this noise is a draw of k without replacement,
// each in proportion to its weight.
double gumbel(Normal& normal) {
    double u = 0;
    while (u <= 0 || u >= 1) u = static_cast<double>(normal.engine()() >> 11) * 0x1.0p-53;
    return -std::log(-std::log(u));
}

// The generator: each layer's popularity and its pairing with the next layer's, the noise, and the
// draw of one layer's experts. generate() walks it over the tokens; the bound (bound_hit_rates)
// draws from the same distribution with a generator of its own.
class Walk {
public:
    explicit Walk(const Spec& s) : s_(s), normal_(s.seed), noise_(size_t{s.n_layers} * s.n_experts) {
        pop_.by_rank.assign(s.n_layers, std::vector<uint32_t>(s.n_experts));
        pop_.pair.assign(s.n_layers, std::vector<uint32_t>(s.n_experts));
        pop_.bias.resize(size_t{s.n_layers} * s.n_experts);
        draw_popularity();
        for (auto& v : noise_) v = s.zipf > 0 ? gumbel(normal_) : normal_();
    }

    // Token t's experts of every layer into `out`, each sorted; the popularity in force for it is
    // appended to `epochs` where it is new (at token 0 and at the shift).
    void token(uint64_t t, Routing& out, std::vector<Popularity>* epochs) {
        if (s_.shift_at > 0 && t == s_.shift_at) draw_popularity();
        if (epochs && (t == 0 || t == s_.shift_at)) epochs->push_back(pop_);
        for (uint32_t l = 0; l < s_.n_layers; ++l) {
            double* z = &noise_[size_t{l} * s_.n_experts];
            if (t > 0) next_noise(s_, normal_, z);
            draw_layer(s_, pop_, l, normal_, z, t > 0 ? out.at(t - 1, l) : std::span<const uint16_t>{},
                       l > 0 ? out.at(t, l - 1) : std::span<const uint16_t>{},
                       {&out.experts[(t * s_.n_layers + l) * s_.n_used], s_.n_used}, logits_);
        }
    }

    // Each layer's noise: an AR(1) process over tokens (fresh draws where reuse is 0).
    static void next_noise(const Spec& s, Normal& normal, double* z) {
        const double keep = std::sqrt(1.0 - s.reuse * s.reuse);
        for (uint32_t e = 0; e < s.n_experts; ++e) z[e] = s.zipf > 0 ? gumbel(normal) : s.reuse * z[e] + keep * normal();
    }

    // One layer's k experts, sorted, given its noise `z`, the previous token's experts of this layer
    // (`before`, empty at the first token) and this token's of the layer before (`above`, empty in
    // the first layer).
    static void draw_layer(const Spec& s, const Popularity& pop, uint32_t l, Normal& normal, const double* z,
                           std::span<const uint16_t> before, std::span<const uint16_t> above, std::span<uint16_t> dst,
                           std::vector<std::pair<double, uint32_t>>& logits) {
        const uint32_t E = s.n_experts, K = s.n_used;
        logits.resize(E);
        std::uniform_real_distribution<double> coin(0.0, 1.0);
        if (!before.empty() && s.keep > 0 && coin(normal.engine()) < s.keep) {
            // Bursty: the previous token's experts but one, which the router draws anew.
            std::copy(before.begin(), before.end(), dst.begin());
            const auto drop = static_cast<uint32_t>(normal.engine()() % K);
            for (uint32_t e = 0; e < E; ++e) logits[e] = {pop.bias[size_t{l} * E + e] + z[e], e};
            for (uint32_t i = 0; i < K; ++i) logits[dst[i]].first = -std::numeric_limits<double>::infinity();
            const auto best = std::max_element(logits.begin(), logits.end(),
                                               [](const auto& a, const auto& b) { return a.first < b.first; });
            dst[drop] = static_cast<uint16_t>(best->second);
            std::sort(dst.begin(), dst.end());
            return;
        }
        for (uint32_t e = 0; e < E; ++e) logits[e] = {pop.bias[size_t{l} * E + e] + z[e], e};
        for (uint16_t a : above) logits[pop.pair[l - 1][a]].first += s.follow;
        std::nth_element(logits.begin(), logits.begin() + (K - 1), logits.end(),
                         [](const auto& a, const auto& b) { return a.first > b.first; });
        for (uint32_t i = 0; i < K; ++i) dst[i] = static_cast<uint16_t>(logits[i].second);
        std::sort(dst.begin(), dst.end());
    }

private:
    // Per layer: which expert holds each popularity rank (a shuffle, so hot experts are not the
    // low ids). pair[l][e]: the expert of layer l + 1 with e's rank, so that following the pairing
    // keeps every layer's popularity.
    void draw_popularity() {
        const uint32_t L = s_.n_layers, E = s_.n_experts;
        for (uint32_t l = 0; l < L; ++l) {
            std::iota(pop_.by_rank[l].begin(), pop_.by_rank[l].end(), 0u);
            std::shuffle(pop_.by_rank[l].begin(), pop_.by_rank[l].end(), normal_.engine());
            for (uint32_t r = 0; r < E; ++r) {
                const double lr = std::log(static_cast<double>(r) + 1.0);
                pop_.bias[size_t{l} * E + pop_.by_rank[l][r]] =
                    s_.zipf > 0 ? -s_.zipf * lr : -s_.skew.scale * std::pow(lr, s_.skew.shape);
            }
        }
        for (uint32_t l = 0; l + 1 < L; ++l)
            for (uint32_t r = 0; r < E; ++r) pop_.pair[l][pop_.by_rank[l][r]] = pop_.by_rank[l + 1][r];
    }

    const Spec& s_;
    Normal normal_;
    Popularity pop_;
    std::vector<double> noise_;
    std::vector<std::pair<double, uint32_t>> logits_;
};

Result<void> check(const Spec& s) {
    if (s.n_layers == 0) return failf("trace: layers must be at least 1");
    if (s.n_experts < 2 || s.n_experts > 65535) return failf("trace: experts must be 2..65535, not {}", s.n_experts);
    if (s.n_used == 0 || s.n_used >= s.n_experts)
        return failf("trace: experts used must be 1..{} (fewer than the experts), not {}", s.n_experts - 1, s.n_used);
    if (s.tokens == 0 || s.tokens > (uint64_t{1} << 26)) return failf("trace: tokens must be 1..{}", uint64_t{1} << 26);
    if (uint64_t{s.n_layers} * s.n_used * s.tokens > (uint64_t{1} << 31))
        return failf("trace: {} tokens x {} layers x {} experts used is too large to hold", s.tokens, s.n_layers, s.n_used);
    if (!(s.reuse >= 0 && s.reuse < 1)) return failf("trace: reuse must be in [0, 1), not {}", s.reuse);
    if (!(s.follow >= 0 && s.follow <= 100)) return failf("trace: follow must be in [0, 100], not {}", s.follow);
    if (!(s.skew.scale >= 0 && std::isfinite(s.skew.scale)) || !(s.skew.shape > 0 && std::isfinite(s.skew.shape)))
        return failf("trace: skew S must be >= 0 and P > 0");
    if (!(s.zipf >= 0 && s.zipf <= 10)) return failf("trace: zipf alpha must be in [0, 10], not {}", s.zipf);
    if (!(s.keep >= 0 && s.keep < 1)) return failf("trace: keep must be in [0, 1), not {}", s.keep);
    if (s.shift_at >= s.tokens && s.shift_at != 0) return failf("trace: shift must come before the last token ({})", s.tokens);
    if ((s.prompt_tokens == 0) != (s.prompt_every == 0))
        return failf("trace: a prompt needs both its tokens and how many decoded tokens apart (--prompt N:EVERY)");
    if (s.prompt_tokens > (1u << 16)) return failf("trace: a prompt batch of at most 65536 tokens, not {}", s.prompt_tokens);
    return {};
}


Result<Routing> generate_with(const Spec& s, std::vector<Popularity>* epochs) {
    MC_TRY_VOID(check(s));
    Routing out;
    out.n_layers = s.n_layers;
    out.n_experts = s.n_experts;
    out.n_used = s.n_used;
    out.tokens = s.tokens;
    out.experts.resize(s.tokens * s.n_layers * s.n_used);
    Walk walk(s);
    for (uint64_t t = 0; t < s.tokens; ++t) walk.token(t, out, epochs);
    // Prompt batches: every prompt_every decoded tokens, the next prompt_tokens tokens are one step.
    if (s.prompt_tokens > 0) {
        uint64_t t = 0;
        while (t < s.tokens) {
            for (uint32_t i = 0; i < s.prompt_every && t < s.tokens; ++i, ++t) out.steps.push_back(1);
            if (t >= s.tokens) break;
            const auto n = static_cast<uint32_t>(std::min<uint64_t>(s.prompt_tokens, s.tokens - t));
            out.steps.push_back(n);
            t += n;
        }
    }
    return out;
}

}  // namespace

Result<Routing> generate(const Spec& s) { return generate_with(s, nullptr); }

namespace {

Result<std::vector<double>> placement_hit_rates(const Spec& s, std::span<const double> shares, uint32_t samples,
                                                bool learner) {
    if (learner && s.keep > 0)
        return failf("trace learner: bursty routing (keep {}) is not a fixed popularity; no learner bound", s.keep);
    if (s.reuse > 0)
        return failf("trace bound: routing with noise reuse ({}) hides its state from the routing; no bound", s.reuse);
    if (samples == 0) return failf("trace bound: at least one sample a step");
    std::vector<Popularity> epochs;
    const Routing r = MC_TRY(generate_with(s, &epochs));
    const uint32_t L = r.n_layers, E = r.n_experts, K = r.n_used;
    const size_t items = size_t{L} * E;
    std::vector<size_t> room;
    for (double f : shares) {
        if (!(f >= 0 && f <= 1)) return failf("trace bound: a share of the experts in [0, 1], not {}", f);
        room.push_back(static_cast<size_t>(std::llround(f * static_cast<double>(items))));
    }
    // Without bursty reuse a token's distribution is its epoch's (tokens are independent): it is
    // estimated once an epoch and step size, from 64 times the samples.
    const bool independent = s.keep == 0;
    Normal mc(s.seed ^ 0x9e3779b97f4a7c15ull);
    std::vector<double> expect(items), noise(E);
    std::vector<uint16_t> prev(size_t{L} * K), cur(size_t{L} * K);
    std::vector<uint32_t> count(E), report;
    std::vector<std::pair<double, uint32_t>> logits;
    std::vector<uint32_t> order(items), rank(items);
    // rank[item]: its place among all items by `score`, highest first (ties by index).
    auto rank_by = [&](const auto& score) {
        std::iota(order.begin(), order.end(), 0u);
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return score[a] > score[b]; });
        for (size_t i = 0; i < items; ++i) rank[order[i]] = static_cast<uint32_t>(i);
    };
    std::map<std::pair<size_t, uint64_t>, std::vector<uint32_t>> ranks;  // (epoch, step tokens) -> rank
    std::vector<uint64_t> hits(room.size(), 0);
    uint64_t accesses = 0;
    // The accesses of a step as the hook reports them (step_reports): a token's experts, or a batch's
    // experts more of its tokens chose than an even share.
    auto batch_set = [&](uint32_t l, uint64_t n, auto&& token_layer) {
        std::fill(count.begin(), count.end(), 0);
        for (uint64_t i = 0; i < n; ++i)
            for (uint16_t e : token_layer(i, l)) ++count[e];
        report.clear();
        for (uint32_t e = 0; e < E; ++e)
            if (uint64_t{count[e]} * E > n * K) report.push_back(e);
    };
    auto rank_step = [&](uint64_t t, uint64_t n, const Popularity& pop) {
        std::fill(expect.begin(), expect.end(), 0.0);
        const uint64_t draws = independent ? std::max<uint64_t>(samples, uint64_t{samples} * 64 / n) : samples;
        std::vector<uint16_t> batch(n > 1 ? n * L * K : 0);
        for (uint64_t d = 0; d < draws; ++d) {
            for (uint64_t i = 0; i < n; ++i) {
                for (uint32_t l = 0; l < L; ++l) {
                    Walk::next_noise(s, mc, noise.data());
                    std::span<const uint16_t> before;
                    if (i > 0) before = {&prev[size_t{l} * K], K};
                    else if (t > 0) before = r.at(t - 1, l);
                    Walk::draw_layer(s, pop, l, mc, noise.data(), before,
                                     l > 0 ? std::span<const uint16_t>{&cur[size_t{l - 1} * K], K} : std::span<const uint16_t>{},
                                     {&cur[size_t{l} * K], K}, logits);
                }
                if (n == 1)
                    for (uint32_t l = 0; l < L; ++l)
                        for (uint32_t k = 0; k < K; ++k) expect[size_t{l} * E + cur[size_t{l} * K + k]] += 1;
                else
                    std::copy(cur.begin(), cur.end(), batch.begin() + static_cast<ptrdiff_t>(i * L * K));
                std::swap(prev, cur);
            }
            if (n > 1)
                for (uint32_t l = 0; l < L; ++l) {
                    batch_set(l, n, [&](uint64_t i, uint32_t ll) {
                        return std::span<const uint16_t>{&batch[(i * L + ll) * K], K};
                    });
                    for (uint32_t e : report) expect[size_t{l} * E + e] += 1;
                }
        }
        rank_by(expect);
    };
    // Bursty without follow, a token: with probability keep the previous token's experts but one,
    // each kept with (K - 1) / K, and the replacement the first of an ordering of the logits not
    // among them; else a fresh draw. Both from kOrders sampled orderings of each layer's logits an
    // epoch (their first K + 1: the replacement is among them), exact but for that sampling.
    constexpr uint32_t kOrders = 4096;
    std::vector<std::vector<uint16_t>> orders;  // per epoch: [layer][sample][K + 1]
    std::vector<std::vector<double>> fresh;     // per epoch: [layer * E + e], P(in a fresh draw)
    std::vector<uint32_t> replaced(E);
    std::vector<uint8_t> before(E);
    auto rank_kept = [&](uint64_t t, size_t epoch) {
        if (orders.size() <= epoch) {
            orders.resize(epoch + 1);
            fresh.resize(epoch + 1);
            auto& o = orders[epoch];
            auto& f = fresh[epoch];
            o.resize(size_t{L} * kOrders * (K + 1));
            f.assign(items, 0.0);
            logits.resize(E);
            for (uint32_t l = 0; l < L; ++l)
                for (uint32_t m = 0; m < kOrders; ++m) {
                    Walk::next_noise(s, mc, noise.data());
                    for (uint32_t e = 0; e < E; ++e) logits[e] = {epochs[epoch].bias[size_t{l} * E + e] + noise[e], e};
                    std::partial_sort(logits.begin(), logits.begin() + K + 1, logits.end(),
                                      [](const auto& a, const auto& b) { return a.first > b.first; });
                    for (uint32_t i = 0; i <= K; ++i) {
                        o[(size_t{l} * kOrders + m) * (K + 1) + i] = static_cast<uint16_t>(logits[i].second);
                        if (i < K) f[size_t{l} * E + logits[i].second] += 1.0 / kOrders;
                    }
                }
        }
        const auto& o = orders[epoch];
        const auto& f = fresh[epoch];
        for (uint32_t l = 0; l < L; ++l) {
            double* x = &expect[size_t{l} * E];
            if (t == 0) {
                std::copy(f.begin() + static_cast<ptrdiff_t>(size_t{l} * E), f.begin() + static_cast<ptrdiff_t>(size_t{l + 1} * E), x);
                continue;
            }
            std::fill(before.begin(), before.end(), 0);
            for (uint16_t e : r.at(t - 1, l)) before[e] = 1;
            std::fill(replaced.begin(), replaced.end(), 0);
            for (uint32_t m = 0; m < kOrders; ++m) {
                const uint16_t* pre = &o[(size_t{l} * kOrders + m) * (K + 1)];
                for (uint32_t i = 0; i <= K; ++i)
                    if (!before[pre[i]]) {
                        ++replaced[pre[i]];
                        break;
                    }
            }
            for (uint32_t e = 0; e < E; ++e)
                x[e] = (1 - s.keep) * f[size_t{l} * E + e] +
                       s.keep * (before[e] ? static_cast<double>(K - 1) / K : static_cast<double>(replaced[e]) / kOrders);
        }
        rank_by(expect);
    };
    // The learner: the experts of the most uses since the epoch began (ties by index), ranked anew
    // before each step.
    std::vector<uint64_t> used(items, 0);
    size_t used_epoch = 0;
    auto rank_learnt = [&](size_t epoch) {
        if (epoch != used_epoch) {
            std::fill(used.begin(), used.end(), 0);
            used_epoch = epoch;
        }
        rank_by(used);
    };
    std::vector<uint32_t> step_items;
    auto score = [&](uint32_t l, uint16_t e) {
        ++accesses;
        for (size_t j = 0; j < room.size(); ++j) hits[j] += rank[size_t{l} * E + e] < room[j];
        if (learner) step_items.push_back(l * E + e);
    };
    uint64_t t = 0, step = 0;
    while (t < r.tokens) {
        uint64_t n = step < r.steps.size() ? r.steps[step] : 1;
        ++step;
        n = std::min<uint64_t>(n, r.tokens - t);
        // A small batch is reported token by token (step_reports): each token a step of its own.
        for (uint64_t first = t; first < t + n; first += n > kPerTokenReports ? n : 1) {
            const uint64_t m = n > kPerTokenReports ? n : 1;
            const size_t epoch = s.shift_at > 0 && first >= s.shift_at ? 1 : 0;
            if (learner) {
                rank_learnt(epoch);
            } else if (independent) {
                auto [at, is_new] = ranks.try_emplace({epoch, m});
                if (is_new) {
                    rank_step(first, m, epochs[epoch]);
                    at->second = rank;
                }
                rank = at->second;
            } else if (m == 1 && s.follow == 0) {
                rank_kept(first, epoch);
            } else {
                rank_step(first, m, epochs[epoch]);
            }
            for (uint32_t l = 0; l < L; ++l) {
                if (m == 1) {
                    for (uint16_t e : r.at(first, l)) score(l, e);
                    continue;
                }
                batch_set(l, m, [&](uint64_t i, uint32_t ll) { return r.at(first + i, ll); });
                for (uint32_t e : report) score(l, static_cast<uint16_t>(e));
            }
            for (uint32_t item : step_items) ++used[item];
            step_items.clear();
        }
        t += n;
    }
    std::vector<double> out;
    for (uint64_t h : hits) out.push_back(accesses ? static_cast<double>(h) / static_cast<double>(accesses) : 0.0);
    return out;
}

}  // namespace

Result<std::vector<double>> bound_hit_rates(const Spec& s, std::span<const double> shares, uint32_t samples) {
    return placement_hit_rates(s, shares, samples, false);
}

Result<std::vector<double>> learner_hit_rates(const Spec& s, std::span<const double> shares) {
    return placement_hit_rates(s, shares, 1, true);
}

Stats measure(const Routing& r, const MeasureOptions& options) {
    Stats st;
    const uint32_t L = r.n_layers, E = r.n_experts, K = r.n_used;
    if (L == 0 || E == 0 || K == 0 || r.tokens == 0) return st;
    for (uint32_t l = 0; l < L; ++l) {
        std::vector<double> counts(E, 0.0);
        for (uint64_t t = 0; t < r.tokens; ++t)
            for (uint16_t e : r.at(t, l)) counts[e] += 1.0;
        double sq = 0;
        for (const double c : counts) sq += (c / static_cast<double>(r.tokens)) * (c / static_cast<double>(r.tokens));
        st.reuse_chance += sq / K / L;
        const auto curve = mkmodel::coverage_curve(counts);
        st.top_eighth += mkmodel::coverage_at(curve, 0.125) / L;
        st.top_quarter += mkmodel::coverage_at(curve, 0.25) / L;
    }
    st.static_top = std::min(E, options.static_top != 0 ? options.static_top : std::max(K, E / 16));
    st.static_chance = static_cast<double>(st.static_top) / E;
    if (r.tokens >= 2) {
        const uint64_t half = r.tokens / 2;
        uint64_t hit = 0, all = 0;
        std::vector<std::pair<uint64_t, uint32_t>> used(E);
        std::vector<char> hot(E);
        for (uint32_t l = 0; l < L; ++l) {
            for (uint32_t e = 0; e < E; ++e) used[e] = {0, e};
            for (uint64_t t = 0; t < half; ++t)
                for (uint16_t e : r.at(t, l)) ++used[e].first;
            std::sort(used.begin(), used.end(), [](const auto& x, const auto& y) {
                return x.first != y.first ? x.first > y.first : x.second < y.second;
            });
            std::fill(hot.begin(), hot.end(), 0);
            for (uint32_t i = 0; i < st.static_top; ++i) hot[used[i].second] = 1;
            for (uint64_t t = half; t < r.tokens; ++t)
                for (uint16_t e : r.at(t, l)) {
                    hit += hot[e];
                    ++all;
                }
        }
        st.static_cover = all ? static_cast<double>(hit) / static_cast<double>(all) : 0.0;
    }
    st.lru_slots = options.lru_slots;
    if (st.lru_slots.empty()) {
        st.lru_slots = {std::min(E, 2 * K)};
        if (std::max(K, E / 8) != st.lru_slots[0]) st.lru_slots.push_back(std::max(K, E / 8));
    }
    for (const uint32_t slots : st.lru_slots) {
        uint64_t hit = 0;
        std::vector<uint64_t> last(E);  // the step an expert was last used at, + 1; 0: not held
        for (uint32_t l = 0; l < L; ++l) {
            std::fill(last.begin(), last.end(), 0);
            uint32_t held = 0;
            for (uint64_t t = 0; t < r.tokens; ++t) {
                for (uint16_t e : r.at(t, l)) {
                    if (last[e] != 0) {
                        ++hit;
                    } else if (held < slots) {
                        ++held;
                    } else {  // the least recently used goes (ties: the lowest id)
                        uint32_t victim = E;
                        for (uint32_t x = 0; x < E; ++x)
                            if (last[x] != 0 && (victim == E || last[x] < last[victim])) victim = x;
                        last[victim] = 0;
                    }
                    last[e] = t + 1;
                }
            }
        }
        st.lru_hits.push_back(static_cast<double>(hit) / (static_cast<double>(r.tokens) * L * K));
    }
    if (r.tokens > 1) {
        uint64_t kept = 0;
        std::vector<char> prev(E);
        for (uint32_t l = 0; l < L; ++l)
            for (uint64_t t = 1; t < r.tokens; ++t) {
                std::fill(prev.begin(), prev.end(), 0);
                for (uint16_t e : r.at(t - 1, l)) prev[e] = 1;
                for (uint16_t e : r.at(t, l)) kept += prev[e];
            }
        st.reuse = static_cast<double>(kept) / (static_cast<double>(r.tokens - 1) * L * K);
    }
    if (L > 1 && r.tokens >= 4) {
        // Learnt on the first half: how often each expert of l+1 is used (p), and with each of l.
        const uint64_t half = r.tokens / 2;
        std::vector<double> co(static_cast<size_t>(L - 1) * E * E, 0.0), used(static_cast<size_t>(L) * E, 0.0);
        for (uint64_t t = 0; t < half; ++t)
            for (uint32_t l = 0; l < L; ++l)
                for (uint16_t a : r.at(t, l)) {
                    used[size_t{l} * E + a] += 1.0;
                    if (l + 1 < L)
                        for (uint16_t b : r.at(t, l + 1)) co[(size_t{l} * E + a) * E + b] += 1.0;
                }
        // The prediction: the k experts of l+1 with the highest log p(b) + sum over this token's
        // experts a of l of log(p(b | a) / p(b)), p(b | a) smoothed towards p(b). Summing raw
        // co-occurrence counts instead would only find the popular experts again.
        const double n = static_cast<double>(half);
        std::vector<double> log_p(static_cast<size_t>(L) * E);
        for (size_t i = 0; i < log_p.size(); ++i) log_p[i] = std::log((used[i] + 0.5) / (n + 1.0));
        for (uint32_t l = 0; l + 1 < L; ++l)  // co becomes log(p(b | a) / p(b))
            for (uint32_t a = 0; a < E; ++a)
                for (uint32_t b = 0; b < E; ++b) {
                    double& c = co[(size_t{l} * E + a) * E + b];
                    const double pb = std::exp(log_p[size_t{l + 1} * E + b]);
                    c = std::log((c + pb) / (used[size_t{l} * E + a] + 1.0) / pb);
                }
        uint64_t hit = 0, guessed = 0;
        std::vector<std::pair<double, uint32_t>> score(E);
        std::vector<char> actual(E);
        for (uint64_t t = half; t < r.tokens; ++t)
            for (uint32_t l = 0; l + 1 < L; ++l) {
                for (uint32_t b = 0; b < E; ++b) score[b] = {log_p[size_t{l + 1} * E + b], b};
                for (uint16_t a : r.at(t, l)) {
                    const double* lift = &co[(size_t{l} * E + a) * E];
                    for (uint32_t b = 0; b < E; ++b) score[b].first += lift[b];
                }
                std::nth_element(score.begin(), score.begin() + (K - 1), score.end(), [](const auto& x, const auto& y) {
                    return x.first != y.first ? x.first > y.first : x.second < y.second;
                });
                std::fill(actual.begin(), actual.end(), 0);
                for (uint16_t b : r.at(t, l + 1)) actual[b] = 1;
                for (uint32_t i = 0; i < K; ++i) hit += actual[score[i].second];
                guessed += K;
            }
        st.next_layer = guessed ? static_cast<double>(hit) / static_cast<double>(guessed) : 0.0;
    }
    return st;
}

Result<Routing> routing_from_steps(uint32_t n_layers, uint32_t n_experts, std::span<const RecordedStep> steps) {
    if (n_layers == 0 || n_experts == 0) return failf("trace: {} layers of {} experts: nothing to measure", n_layers, n_experts);
    if (n_experts > 65536) return failf("trace: {} experts: more than a routing holds (65536)", n_experts);
    std::vector<uint64_t> widths;
    for (const auto& s : steps) {
        if (s.layer >= n_layers) return failf("trace: a decision of layer {}, past the model's {} layers", s.layer, n_layers);
        for (const uint32_t e : s.experts)
            if (e >= n_experts) return failf("trace: expert {} in layer {}, past the model's {} experts", e, s.layer, n_experts);
        if (s.tokens != 1 || s.experts.empty()) continue;
        if (widths.size() <= s.experts.size()) widths.resize(s.experts.size() + 1, 0);
        ++widths[s.experts.size()];
    }
    if (widths.empty()) return failf("trace: no decode step (a decision of one token) to measure");
    const auto k = static_cast<uint32_t>(std::max_element(widths.begin(), widths.end()) - widths.begin());
    std::vector<std::vector<uint16_t>> by_layer(n_layers);
    for (const auto& s : steps) {
        if (s.tokens != 1 || s.experts.size() != k) continue;
        std::vector<uint16_t> sorted(s.experts.begin(), s.experts.end());
        std::sort(sorted.begin(), sorted.end());
        by_layer[s.layer].insert(by_layer[s.layer].end(), sorted.begin(), sorted.end());
    }
    uint64_t tokens = UINT64_MAX;
    for (const auto& l : by_layer) tokens = std::min<uint64_t>(tokens, l.size() / k);
    if (tokens == 0) return failf("trace: a layer without a decode step of {} experts", k);
    Routing r;
    r.n_layers = n_layers;
    r.n_experts = n_experts;
    r.n_used = k;
    r.tokens = tokens;
    r.experts.resize(tokens * n_layers * k);
    for (uint64_t t = 0; t < tokens; ++t)
        for (uint32_t l = 0; l < n_layers; ++l)
            std::copy_n(by_layer[l].begin() + static_cast<std::ptrdiff_t>(t * k), k,
                        r.experts.begin() + static_cast<std::ptrdiff_t>((t * n_layers + l) * k));
    return r;
}

const std::vector<Preset>& presets() {
    static const std::vector<Preset> kPresets = {
        {"deepseek-v4-flash",
         "published DeepSeek-V4-Flash routing: the hottest 12.5 % of a layer's experts take ~58 % of "
         "routings, the hottest 25 % ~71 %; the next layer's experts ~70 % predictable from this layer's",
         "deepseek-v4-flash", 0.70, {}},
        {"low-skew", "close to uniform, as reported for OLMoE: the hottest 12.5 % take ~18 %, 25 % ~33 %",
         "low-skew", -1, {}},
        {"uniform", "every expert equally likely, no correlation", "uniform", -1, {}},
        // Routing of other structure (issue 22): popularity alone does not describe it.
        {"zipf-256", "256 experts of a fixed Zipf-like popularity (alpha 1.2), drawn without replacement", "", -1,
         {256, 1.2, 0, 0, 0, 0}},
        {"topic-shift", "128 experts, DeepSeek-like skew, the popularity drawn anew at mid-trace (a topic change)",
         "deepseek-v4-flash", -1, {128, 0, 0.5, 0, 0, 0}},
        {"bursty", "128 experts, DeepSeek-like skew; 60 % of the time a layer keeps its previous token's experts but one",
         "deepseek-v4-flash", -1, {128, 0, 0, 0.6, 0, 0}},
        {"prompts", "128 experts, DeepSeek-like skew, a 512-token prompt batch every 400 decoded tokens",
         "deepseek-v4-flash", -1, {128, 0, 0, 0, 512, 400}},
        // As real models' router logs show (docs/routing.md), matching mkmodel's presets of the same
        // names as measured from llama.cpp: their skew, and reuse as noise carried over.
        {"mixtral-like", "Mixtral-8x7B's decode: 8 experts, top-2, weak skew, ~36 % of a token's experts "
         "reused from the previous token, ~44 % predictable from the layer before", "mixtral-like", 0.44,
         {8, 0, 0, 0, 0, 0, 2, 0.3}},
        {"qwen3-next-like", "512 experts, top-10: weak static skew (a static top-32 learnt on half a run takes "
         "~10 % of the rest), strong reuse (a per-layer LRU of 64 hits ~67 %)", "qwen3-next-like", -1,
         {512, 0, 0, 0, 0, 0, 10, 0.85}},
        {"deepseek-like", "256 experts, top-8, DeepSeek-V4-Flash's skew, reuse between tokens", "deepseek-like", -1,
         {256, 0, 0, 0, 0, 0, 8, 0.6}},
    };
    return kPresets;
}

const Preset* find_preset(const std::string& name) {
    for (const auto& p : presets())
        if (p.name == name) return &p;
    return nullptr;
}

Result<Spec> fit(const Preset& preset, Spec shape) {
    shape.zipf = preset.family.zipf;
    if (preset.family.reuse > 0) shape.reuse = preset.family.reuse;
    shape.keep = preset.family.keep;
    shape.prompt_tokens = preset.family.prompt_tokens;
    shape.prompt_every = preset.family.prompt_every;
    shape.shift_at = static_cast<uint64_t>(preset.family.shift_fraction * static_cast<double>(shape.tokens));
    if (preset.skew_preset.empty()) {  // Zipf: nothing to fit
        shape.follow = 0;
        return shape;
    }
    const mkmodel::Preset* skew = mkmodel::find_preset(preset.skew_preset);
    if (!skew) return failf("trace preset {}: no router skew preset {}", preset.name, preset.skew_preset);
    if (shape.n_used == 0 || shape.n_used >= shape.n_experts)
        return failf("trace: experts used must be 1..{} (fewer than the experts), not {}", shape.n_experts - 1, shape.n_used);
    shape.skew = mkmodel::fit_skew(*skew, shape.n_experts, shape.n_used);
    shape.follow = 0;
    if (preset.next_layer < 0 || skew->targets.empty()) return shape;
    // Following the pairing concentrates routing on the experts paired with hot ones, so the two
    // are fitted together: the boost for the predictability, then S for the hottest 12.5 %'s share
    // (P as fitted alone), three times over, each by bisection on a fixed sample of this shape.
    Spec probe = shape;
    probe.n_layers = std::min<uint32_t>(std::max<uint32_t>(shape.n_layers, 2), 8);
    probe.tokens = std::max<uint64_t>(1500, uint64_t{probe.n_experts} * 12);
    probe.seed = 99;
    auto stats = [&]() -> Result<Stats> {
        auto r = generate(probe);
        if (!r) return tl::unexpected(r.error());
        return measure(*r);
    };
    auto bisect = [&](double& knob, double lo, double hi, auto&& below) -> Result<void> {
        for (int it = 0; it < 14; ++it) {
            knob = 0.5 * (lo + hi);
            auto st = stats();
            if (!st) return tl::unexpected(st.error());
            (below(*st) ? lo : hi) = knob;
        }
        knob = 0.5 * (lo + hi);
        return {};
    };
    const mkmodel::CoveragePoint target = skew->targets.front();
    for (int round = 0; round < 3; ++round) {
        probe.follow = 0;
        auto at0 = stats();
        if (!at0) return tl::unexpected(at0.error());
        if (at0->next_layer < preset.next_layer)
            MC_TRY_VOID(bisect(probe.follow, 0.0, 8.0, [&](const Stats& st) { return st.next_layer < preset.next_layer; }));
        MC_TRY_VOID(bisect(probe.skew.scale, 0.0, 2 * shape.skew.scale + 1.0, [&](const Stats& st) {
            return (target.expert_fraction == 0.125 ? st.top_eighth : st.top_quarter) < target.routing_share;
        }));
    }
    shape.follow = probe.follow;
    shape.skew = probe.skew;
    return shape;
}

Result<void> write_trace(const Routing& r, const std::string& path, const std::string& key, uint64_t expert_bytes,
                         uint64_t token_us) {
    std::ofstream f(path, std::ios::trunc);
    if (!f) return fail_errno("writing the trace {}", path);
    trace::ModelLine model{0, key, "", r.n_experts, std::vector<uint32_t>(r.n_layers),
                           std::vector<uint64_t>(r.n_layers, expert_bytes)};
    std::iota(model.blocks.begin(), model.blocks.end(), 0u);
    f << trace::header_line(1) << trace::model_line(model);
    std::string line;
    for_each_report(r, [&](uint64_t at, uint32_t layer, uint32_t tokens, const std::vector<uint32_t>& experts) {
        line.clear();
        trace::append_decision(line, at * token_us, 0, layer, tokens, experts);
        f << line;
    });
    f.flush();
    if (!f) return fail_errno("writing the trace {}", path);
    return {};
}

}  // namespace moecache::tracegen
