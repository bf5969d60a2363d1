#include "moecache/routeprobe/routing_stats.h"

#include "moecache/mkmodel/router_skew.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace moecache::routeprobe {
namespace {

std::vector<double> average_ranks(const std::vector<double>& v) {
    std::vector<size_t> order(v.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
    std::vector<double> rank(v.size());
    for (size_t i = 0; i < order.size();) {
        size_t j = i;
        while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) ++j;
        const double r = (static_cast<double>(i) + static_cast<double>(j)) / 2.0;
        for (size_t k = i; k <= j; ++k) rank[order[k]] = r;
        i = j + 1;
    }
    return rank;
}

}  // namespace

std::optional<double> spearman(const std::vector<double>& x, const std::vector<double>& y) {
    if (x.size() != y.size() || x.size() < 2) return std::nullopt;
    const auto rx = average_ranks(x), ry = average_ranks(y);
    const double n = static_cast<double>(x.size());
    const double mx = std::accumulate(rx.begin(), rx.end(), 0.0) / n;
    const double my = std::accumulate(ry.begin(), ry.end(), 0.0) / n;
    double sxy = 0, sxx = 0, syy = 0;
    for (size_t i = 0; i < rx.size(); ++i) {
        sxy += (rx[i] - mx) * (ry[i] - my);
        sxx += (rx[i] - mx) * (rx[i] - mx);
        syy += (ry[i] - my) * (ry[i] - my);
    }
    if (sxx <= 0 || syy <= 0) return std::nullopt;
    return sxy / std::sqrt(sxx * syy);
}

double coverage(const std::vector<uint64_t>& counts, double fraction) {
    std::vector<double> c(counts.begin(), counts.end());
    return mkmodel::coverage_at(mkmodel::coverage_curve(std::move(c)), fraction);
}

double held_out_coverage(const std::vector<uint64_t>& rank_by, const std::vector<uint64_t>& share_of, double fraction) {
    const size_t n = std::min(rank_by.size(), share_of.size());
    if (n == 0) return 0.0;
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rank_by[a] > rank_by[b]; });
    const auto k = std::clamp<size_t>(static_cast<size_t>(std::ceil(fraction * static_cast<double>(n) - 1e-9)), 1, n);
    uint64_t top = 0, total = 0;
    for (size_t i = 0; i < n; ++i) {
        total += share_of[order[i]];
        if (i < k) top += share_of[order[i]];
    }
    return total ? static_cast<double>(top) / static_cast<double>(total) : 0.0;
}

}  // namespace moecache::routeprobe
