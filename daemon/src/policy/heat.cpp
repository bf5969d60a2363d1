#include "moecache/daemon/heat.h"

#include "moecache/routing_shift.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

namespace moecache::daemon {

HeatTable::HeatTable(uint32_t n_layers, uint32_t n_experts, double half_life_tokens)
    : n_layers_(n_layers),
      n_experts_(n_experts),
      splits_(n_layers, n_experts),
      half_life_(half_life_tokens),
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
    if (event && splits_.learning() && weight == 1)
        splits_.observe(layer, experts, clock_, [&](uint32_t e) { return decayed(cells_[index(layer, e)]); });
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
    // A routing event (not a prompt batch's ranking or union, which say little of a shift) tells
    // the shift detector how many of its experts were cold; at a shift the old heat is cut.
    if (event && seen > 0 && weight <= 1 && shift_.observe(surprised, seen)) forget(kKeepAtShift);
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
