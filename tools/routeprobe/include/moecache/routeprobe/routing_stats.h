// Statistics of measured routing: coverage of the hottest experts and rank agreement with the
// ranking the generator intended.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace moecache::routeprobe {

// Spearman's rank correlation, ties given their average rank. None when either side is constant.
std::optional<double> spearman(const std::vector<double>& x, const std::vector<double>& y);

// Share of all routings taken by the hottest `fraction` of experts (the count rounded up), with
// the same definition as moecache-mkmodel's prediction.
double coverage(const std::vector<uint64_t>& counts, double fraction);

}  // namespace moecache::routeprobe
