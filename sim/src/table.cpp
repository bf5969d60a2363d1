#include "moecache/sim/table.h"

#include <fmt/format.h>

#include <algorithm>

namespace moecache::sim {

double TableRow::gap_closed() const {
    const double lru = tier_rate(baseline(Baseline::Lru)), best = tier_rate(baseline(Baseline::Belady));
    if (best - lru < 1e-9) return 1.0;
    return (tier_rate(policy()) - lru) / (best - lru);
}

namespace {

double closed(const TableRow& r, double rate) {
    if (rate < 0) return -1;
    const double lru = r.tier_rate(r.baseline(Baseline::Lru)), best = r.tier_rate(r.baseline(Baseline::Belady));
    if (best - lru < 1e-9) return 1.0;
    return (rate - lru) / (best - lru);
}

}  // namespace

double TableRow::bound_gap_closed() const { return closed(*this, bound); }
double TableRow::learner_gap_closed() const { return closed(*this, learner); }

double TableRow::vs_best_points() const {
    return 100.0 * (tier_rate(policy()) - std::max(tier_rate(baseline(Baseline::Lru)), tier_rate(baseline(Baseline::Lfu))));
}

std::vector<TableRow> table_rows(const std::string& name, const Trace& trace, const TraceModel& model,
                                 const TableOptions& opt, TraceSummary* summary) {
    const AccessStream s = accesses_of(trace, model);
    const uint64_t total = s.total_bytes();
    TraceSummary local;
    TraceSummary& sum = summary ? *summary : local;
    sum.name = name;
    sum.next_layer = predict(trace, model, Predict::NextLayer);
    sum.next_token = predict(trace, model, Predict::NextToken);
    const Predictions& staged = opt.predict == Predict::NextLayer   ? sum.next_layer
                                : opt.predict == Predict::NextToken ? sum.next_token
                                                                    : (local.next_layer = predict(trace, model, Predict::Both));
    std::vector<TableRow> rows;
    for (const char* tier : {"VRAM", "RAM"})
        for (double f : opt.budgets) {
            TableRow row;
            row.trace = name;
            row.tier = tier;
            row.budget = f;
            Setup setup = opt.base;
            const auto share = static_cast<uint64_t>(f * static_cast<double>(total));
            if (row.tier == "VRAM") {
                // The common GPU case: the model fits in host memory, the pool holds a share.
                setup.vram_bytes = std::max<uint64_t>(share, 1);
                setup.ram_bytes = total;
            } else {
                setup.vram_bytes = 0;
                setup.ram_bytes = share;
            }
            row.moecache = simulate_moecache(trace, model, setup);
            row.predicted = simulate_moecache(trace, model, setup, &staged);
            for (Baseline b : {Baseline::Lru, Baseline::Lfu, Baseline::Static, Baseline::Belady})
                row.baselines.push_back(simulate_baseline(trace, model, setup, b));
            rows.push_back(std::move(row));
        }
    return rows;
}

std::vector<std::string> missed_targets(const TableRow& row, const TableOptions& opt) {
    std::vector<std::string> out;
    const auto where = fmt::format("{} {} {:.0f} %", row.trace, row.tier, 100 * row.budget);
    const double mine = 100 * row.tier_rate(row.policy());
    if (row.vs_best_points() < -opt.max_points_below_best)
        out.push_back(fmt::format("{}: moecache {:.1f} % is {:.1f} points below the better of LRU and LFU", where, mine,
                                  -row.vs_best_points()));
    if (row.bound >= 0) {
        const double bound = 100 * row.bound, best = mine - row.vs_best_points(), room = bound - best;
        const bool near = mine >= bound - opt.max_points_below_bound;
        const bool most_of_room = room > opt.room_points && mine - best >= opt.min_room_closed * room;
        if (!near && !most_of_room)
            out.push_back(fmt::format("{}: moecache {:.1f} % is {:.1f} points below the bound {:.1f} %{}", where, mine,
                                      bound - mine, bound,
                                      room > opt.room_points
                                          ? fmt::format(" and goes {:.0f} % of the way to it from the better of LRU and LFU "
                                                        "({:.1f} %), under {:.0f} %",
                                                        100 * (mine - best) / room, best, 100 * opt.min_room_closed)
                                          : std::string()));
    }
    return out;
}

std::string format_table(const std::vector<TableRow>& rows) {
    std::string out =
        "| trace | tier | budget | moecache | +predict | LRU | LFU | static | learner | bound | Belady | gap closed | learner closes | bound closes | vs best | "
        "MB/token moecache, LFU | tok/s moecache | +predict | LRU | LFU | static | Belady |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : rows) {
        auto pct = [&](const SimResult& x) { return fmt::format("{:.1f}", 100 * r.tier_rate(x)); };
        auto tps = [](const SimResult& x) { return fmt::format("{:.1f}", x.tokens_per_second()); };
        auto rate = [](double x) { return x >= 0 ? fmt::format("{:.1f}", 100 * x) : std::string(); };
        auto share = [](double x, double of) { return of >= 0 ? fmt::format("{:.0f} %", 100 * x) : std::string(); };
        out += fmt::format("| {} | {} | {:.0f} % | {} | {} | {} | {} | {} | {} | {} | {} | {:.0f} % | {} | {} | {:+.1f} | {:.1f}, {:.1f} | {} | {} | {} | {} | {} | {} |\n",
                           r.trace, r.tier, 100 * r.budget, pct(r.moecache), pct(r.predicted),
                           pct(r.baseline(Baseline::Lru)), pct(r.baseline(Baseline::Lfu)),
                           pct(r.baseline(Baseline::Static)), rate(r.learner), rate(r.bound), pct(r.baseline(Baseline::Belady)),
                           100 * r.gap_closed(), share(r.learner_gap_closed(), r.learner), share(r.bound_gap_closed(), r.bound),
                           r.vs_best_points(), r.moecache.bytes_per_token() / 1e6,
                           r.baseline(Baseline::Lfu).bytes_per_token() / 1e6, tps(r.moecache), tps(r.predicted),
                           tps(r.baseline(Baseline::Lru)), tps(r.baseline(Baseline::Lfu)),
                           tps(r.baseline(Baseline::Static)), tps(r.baseline(Baseline::Belady)));
    }
    return out;
}

}  // namespace moecache::sim
