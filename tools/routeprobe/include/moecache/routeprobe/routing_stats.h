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

// The same share with the hottest experts chosen on one sample (`rank_by`) and their share read
// off another (`share_of`). Choosing and measuring on one finite sample overstates the share
// (chance favours the experts it picks); on two halves of a run it does not.
double held_out_coverage(const std::vector<uint64_t>& rank_by, const std::vector<uint64_t>& share_of, double fraction);

}  // namespace moecache::routeprobe
