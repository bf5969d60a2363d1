#include "moecache/daemon/heat.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moecache::daemon {

HeatTable::HeatTable(uint32_t n_layers, uint32_t n_experts, double half_life_tokens)
    : n_layers_(n_layers), n_experts_(n_experts), half_life_(half_life_tokens),
      cells_(size_t{n_layers} * n_experts) {}

double HeatTable::decayed(const Cell& c) const {
    if (c.heat == 0 || clock_ == c.at) return c.heat;
    return c.heat * std::exp2(-static_cast<double>(clock_ - c.at) / half_life_);
}

void HeatTable::record(uint32_t layer, std::span<const uint32_t> experts, uint32_t weight) {
    add(layer, experts, weight, true);
}

void HeatTable::add(uint32_t layer, std::span<const uint32_t> experts, double weight, bool event) {
    if (layer >= n_layers_) return;
    if (layer_total_.size() != n_layers_) {
        layer_total_.assign(n_layers_, 0);
        layer_at_.assign(n_layers_, 0);
    }
    double& total = layer_total_[layer];
    if (layer_at_[layer] != clock_) total *= std::exp2(-static_cast<double>(clock_ - layer_at_[layer]) / half_life_);
    layer_at_[layer] = clock_;
    const double mean = total / n_experts_;
    if (event && (splits_[0].capacity > 0 || splits_[1].capacity > 0) && weight == 1) score_splits(layer, experts);
    uint32_t surprised = 0, seen = 0;
    for (uint32_t e : experts) {
        if (e >= n_experts_) continue;
        Cell& c = cells_[index(layer, e)];
        const double before = decayed(c);
        surprised += before < mean ? 1 : 0;
        ++seen;
        c.heat = before + weight;
        c.at = clock_;
        ++c.uses;
        total += weight;
    }
    // Shift detection. A routing that changes (a topic, a language, another client) routes to
    // experts that were cold far more often than the same routing did before: the share of routed
    // experts below their layer's mean heat, over the last ~256 events, against its long-run level
    // (~16 k events). Past 1.5x that plus 5 points, the old heat is cut to a hundredth, at most
    // once per 4096 events, so that the new hot set ranks first within tens of tokens instead of
    // the half-life's thousands (moecache-sim's topic-shift preset, 12 layers x 3000 tokens, at
    // 25 % of RAM: 64.9 % without, 69.6 % with a cut to a tenth, 71.2 % to a hundredth, where
    // counting from zero at the very token of the shift holds 71.6 %; the shift is seen 16 tokens
    // after it; no shift seen on any other preset or recorded trace). A prompt batch's union says
    // little of a shift.
    if (!event || seen == 0 || weight > 1) return;
    const double x = static_cast<double>(surprised) / seen;
    ++events_;
    // Running means until each window has filled, so that neither starts from zero.
    const auto n = static_cast<double>(events_);
    surprise_fast_ += (x - surprise_fast_) / std::min(n, 256.0);
    surprise_slow_ += (x - surprise_slow_) / std::min(n, 16384.0);
    if (events_ > 4096 && events_ > quiet_until_ && surprise_fast_ > 1.5 * surprise_slow_ + 0.05) {
        forget(0.01);
        ++shifts_;
        quiet_until_ = events_ + 4096;
        surprise_fast_ = surprise_slow_;
    }
}

// For split k (of kSplits): F = (1 - kSplitShares[k]) C experts of each layer held by heat, and an
// LRU of the (C - F) x layers experts' room over the accesses to the others. A routed expert is
// held if its heat ranks under F, or if that LRU holds it; then it is the LRU's most lately used.
// (In a pool the hook may rank that part otherwise: cuda-hooks ExpertHeat learns it.)
void HeatTable::score_splits(uint32_t layer, std::span<const uint32_t> experts) {
    const uint32_t n = n_experts_;
    // The heat ranks as the tier's locks last followed them: a placement runs about once a second
    // (20-50 tokens of decode), so the ranks are taken anew every kSplitRankTokens tokens, not at
    // each event (the expert just routed would rank first at once, which no lock does).
    if (split_rank_.size() != cells_.size()) {
        split_rank_.assign(cells_.size(), 0);
        split_rank_at_.assign(n_layers_, UINT64_MAX);
        routed_layers_ = 0;
    }
    uint32_t* rank = &split_rank_[index(layer, 0)];
    if (split_rank_at_[layer] == UINT64_MAX || clock_ - split_rank_at_[layer] >= kSplitRankTokens) {
        if (split_rank_at_[layer] == UINT64_MAX) ++routed_layers_;
        split_rank_at_[layer] = clock_;
        std::vector<uint32_t> order(n);
        std::vector<double> h(n);
        for (uint32_t i = 0; i < n; ++i) h[i] = decayed(cells_[index(layer, i)]);
        std::iota(order.begin(), order.end(), 0u);
        std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return h[a] > h[b] || (h[a] == h[b] && a < b); });
        for (uint32_t r = 0; r < n; ++r) rank[order[r]] = r;
    }
    // Nothing is scored on ranks taken before the first kSplitRankTokens tokens: heat has not yet
    // told the experts apart, and the heat part's ghost would hold whatever ranked first at zero
    // (recency then looks better than it is: at a first move after 256 events, prompt batches at
    // 25 % of RAM went to pure LRU for ~100 tokens and lost 0.6 points).
    if (split_rank_at_[layer] < kSplitRankTokens) return;
    for (auto& sp : splits_)
        if (sp.capacity > 0) score_split(sp, layer, experts);
}

void HeatTable::score_split(Split& sp, uint32_t layer, std::span<const uint32_t> experts) {
    const uint32_t n = n_experts_;
    const double cap = std::min(sp.capacity, static_cast<double>(n));
    if (sp.lru.empty()) {
        sp.lru.assign(kSplits, Lru{});
        for (auto& l : sp.lru) {
            l.at.resize(cells_.size());
            l.in.assign(cells_.size(), 0);
        }
    }
    const uint32_t* rank = &split_rank_[index(layer, 0)];
    uint32_t by_heat[kSplits];
    size_t room[kSplits];
    for (unsigned k = 0; k < kSplits; ++k) {
        by_heat[k] = static_cast<uint32_t>(std::lround((1.0 - kSplitShares[k]) * cap));
        // The tier holds `cap` of each layer that routes: a model routing some of its layers (a
        // runtime that offloads the rest) gives the LRU part no room of the others.
        room[k] = static_cast<size_t>(std::max(0.0, (cap - by_heat[k]) * std::max<uint32_t>(routed_layers_, 1)));
    }
    uint32_t held[kSplits] = {}, seen = 0;
    for (uint32_t e : experts) {
        if (e >= n) continue;
        ++seen;
        const auto cell = static_cast<uint32_t>(index(layer, e));
        for (unsigned k = 0; k < kSplits; ++k) {
            if (rank[e] < by_heat[k]) {
                ++held[k];
                continue;
            }
            Lru& l = sp.lru[k];
            if (l.in[cell]) {
                ++held[k];
                l.order.splice(l.order.begin(), l.order, l.at[cell]);
                continue;
            }
            if (room[k] == 0) continue;
            l.order.push_front(cell);
            l.at[cell] = l.order.begin();
            l.in[cell] = 1;
            while (l.order.size() > room[k]) {
                l.in[l.order.back()] = 0;
                l.order.pop_back();
            }
        }
    }
    if (seen == 0) return;
    if (sp.events++ == 0) sp.first_clock = clock_;
    const double w = 1.0 / static_cast<double>(std::min<uint64_t>(sp.events, 4096));
    unsigned best = sp.k;
    for (unsigned k = 0; k < kSplits; ++k) {
        sp.score[k] += (static_cast<double>(held[k]) / seen - sp.score[k]) * w;
        if (sp.score[k] > sp.score[best]) best = k;
    }
    // Recency only where it clearly pays: a split with a share for it must hold recency_margin more
    // than heat alone (on routings without temporal locality the splits differ by noise, and a
    // share cut for nothing costs more than the scores show: what leaves RAM's locks is read
    // again, and a pool's LRU part admits every miss it sees, a copy each).
    if (best != 0 && sp.score[best] < sp.score[0] + sp.recency_margin) best = 0;
    const bool decisive = sp.events >= kSplitDecisiveEvents && sp.score[best] > sp.score[0] + kSplitDecisiveLead;
    const bool first_due = sp.events >= kSplitFirstEvents && clock_ - sp.first_clock >= kSplitFirstTokens;
    if ((decisive || first_due) && best != sp.k && std::abs(sp.score[best] - sp.score[sp.k]) > 0.002) {
        sp.k = best;
    }
}

void HeatTable::forget(double keep) {
    for (auto& c : cells_) c.heat *= keep;
    for (auto& t : layer_total_) t *= keep;
}

double HeatTable::heat(uint32_t layer, uint32_t expert) const { return decayed(cells_[index(layer, expert)]); }

std::string HeatTable::to_profile(const std::string& key) const {
    nlohmann::json j;
    j["key"] = key;
    j["n_layers"] = n_layers_;
    j["n_experts"] = n_experts_;
    j["clock"] = clock_;
    auto& ex = j["experts"] = nlohmann::json::array();
    for (uint32_t l = 0; l < n_layers_; ++l)
        for (uint32_t e = 0; e < n_experts_; ++e) {
            const Cell& c = cells_[index(l, e)];
            if (c.uses == 0) continue;
            ex.push_back({l, e, decayed(c), c.uses});
        }
    return j.dump();
}

Result<void> HeatTable::load_profile(const std::string& text, const std::string& key, const std::string& where) {
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) return failf("{}: not a heat profile (not JSON)", where);
    auto get_u = [&](const char* k) -> Result<uint64_t> {
        if (!j.contains(k) || !j[k].is_number_unsigned()) return failf("{}: key '{}' missing or not a count", where, k);
        return j[k].get<uint64_t>();
    };
    if (!j.contains("key") || !j["key"].is_string() || j["key"].get<std::string>() != key)
        // Its own key is not quoted: a profile's text is anyone's who can write the folder.
        return failf("{}: the profile is for another model (expected key '{}')", where, key);
    if (MC_TRY(get_u("n_layers")) != n_layers_ || MC_TRY(get_u("n_experts")) != n_experts_)
        return failf("{}: the profile's shape does not match the model ({} layers x {} experts)", where, n_layers_,
                     n_experts_);
    if (!j.contains("experts") || !j["experts"].is_array()) return failf("{}: key 'experts' missing", where);
    std::vector<Cell> cells(cells_.size());
    for (const auto& row : j["experts"]) {
        if (!row.is_array() || row.size() != 4 || !row[0].is_number_unsigned() || !row[1].is_number_unsigned() ||
            !row[2].is_number() || !row[3].is_number_unsigned())
            return failf("{}: an 'experts' entry is not [layer, expert, heat, uses]", where);
        const auto l = row[0].get<uint64_t>(), e = row[1].get<uint64_t>();
        const double h = row[2].get<double>();
        if (l >= n_layers_ || e >= n_experts_ || !std::isfinite(h) || h < 0)
            return failf("{}: entry [{}, {}] is out of range or has a bad heat", where, l, e);
        cells[index(static_cast<uint32_t>(l), static_cast<uint32_t>(e))] =
            Cell{h, 0, static_cast<uint32_t>(std::min<uint64_t>(row[3].get<uint64_t>(), UINT32_MAX))};
    }
    cells_ = std::move(cells);
    clock_ = 0;
    layer_total_.assign(n_layers_, 0);
    layer_at_.assign(n_layers_, 0);
    for (uint32_t l = 0; l < n_layers_; ++l)
        for (uint32_t e = 0; e < n_experts_; ++e) layer_total_[l] += cells_[index(l, e)].heat;
    return {};
}

}  // namespace moecache::daemon
