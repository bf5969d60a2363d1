// Routing statistics of the synthetic router, by simulation of the same logit model that the
// generated weights realise: bias_e = -S * ln(rank_e + 1)^P, noise ~ N(0, 1) per (token, expert).
#pragma once

#include "moecache/mkmodel/synth_model.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moecache::mkmodel {

// Share of routings that go to the hottest fraction of experts, e.g. {0.125, 0.58}.
struct CoveragePoint {
    double expert_fraction;
    double routing_share;
};

// Expected share of routings per expert, by rank (sums to 1), from a simulation of `tokens` tokens.
std::vector<double> simulate_popularity(uint32_t n_experts, uint32_t n_used, RouterSkew skew,
                                        uint32_t tokens = 20000, uint64_t seed = 7);

// Cumulative share of the hottest k experts, for k = 1..n, from per-expert counts (any order).
std::vector<double> coverage_curve(std::vector<double> counts);

// Share of the hottest `fraction` of experts, read off a coverage curve (rounding the count up).
double coverage_at(const std::vector<double>& curve, double fraction);

struct Preset {
    std::string name;
    std::string description;
    std::vector<CoveragePoint> targets;  // empty: uniform routing
    ContextRouting context;              // reuse between tokens and layers, made by the model
    uint32_t experts = 0, used = 0;      // the shape it describes (0: as asked)
};
const std::vector<Preset>& presets();
const Preset* find_preset(const std::string& name);

// The shape a preset means where it has no expert count of its own and the options do not say:
// moecache-mkmodel's and moecache-tracegen's alike (one meaning per preset name).
struct PresetShape {
    uint32_t layers, experts, used;
};
inline constexpr PresetShape kPresetShape{16, 64, 8};

// Fits S and P so that the simulated coverage matches the preset's targets for this expert count.
RouterSkew fit_skew(const Preset& preset, uint32_t n_experts, uint32_t n_used);

}  // namespace moecache::mkmodel
