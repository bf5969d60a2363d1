// moecache-sim: replays router traces against the daemon's placement policy and the classic
// baselines, per tier, with modelled transfer costs (docs/sim.md).
#include "moecache/daemon/config.h"
#include "moecache/mkmodel/cli.h"
#include "moecache/sim/synthetic.h"
#include "moecache/sim/table.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

using namespace moecache;

constexpr const char* kUsage = R"(usage: moecache-sim TRACE [options]       one trace, one setup, every policy
       moecache-sim --table [options]      every preset (and --trace FILE...) at 10, 25, 50 %
Replays router traces (docs/trace.md) through VRAM, RAM and storage under the daemon's own policy
(its heat, planner and pool directives, and the CUDA hook's pool), with and without prediction,
and under LRU, LFU, a static hot set and Belady on the same trace; prints per tier the hit rate,
the bytes moved per token and the modelled tokens/s (docs/sim.md).
One trace:
  --model ID            the model of the trace to replay (the one with most decisions)
  --vram SIZE           the VRAM pool: bytes ("8GiB") or a share of the model's expert bytes
                        ("25%"); 0 (the default): no device
  --ram SIZE            RAM for the model's experts (default: all of them)
  --predict MODE        next-layer (default), next-token, both, none
The table:
  --preset NAME         a synthetic trace of this preset (repeatable; default: every preset)
  --trace FILE          a recorded trace beside them (repeatable; sim/traces has one of llama.cpp)
  --layers L --experts N --experts-used K --tokens T --seed X   the synthetic traces' shape
                        (16, 64, 8, 4000, 1)
  On a preset's trace the "bound" column is the most hits any placement can expect without
  seeing the future (it knows the distribution each token is drawn from, not the draw), and
  "learner" the most a policy that learns a fixed popularity from the routing can (the most used
  so far, counted anew at a shift it is told of). Exits 1 when a target is missed: every tier
  and budget within 0.5 points of the better of LRU and LFU, and, where the bound is known,
  within 1 point of it or 75 % of the way to it from the better of LRU and LFU where that room
  is over 4 points.
Both:
  --tick S              how often the daemon plans, in trace seconds (1)
  --hysteresis H        how much hotter a newcomer must be than what it displaces ([policy]
                        hysteresis: 0.25)
  --pool-directed F     the share of the VRAM pool the daemon directs and the hook fills ahead (0.9,
                        as [vram] directed; 0: nothing directed, as the daemon does)
  --storage-gbs G --h2d-gbs G --h2d-pinned-gbs G --d2d-gbs G --host-memory-gbs G --device-memory-gbs G
                        link bandwidths in GB/s (1.7, 10, 47, 1900, 20, 4800)
  --pinned              host-to-device copies come from pinned memory
)";

int die(const std::string& m) { return mkmodel::usage_error("moecache-sim", m); }

// "25%" of `total`, or a size.
bool parse_budget(const std::string& v, uint64_t total, uint64_t& out) {
    auto a = daemon::parse_byte_amount(v);
    if (!a) return false;
    out = a->percent ? static_cast<uint64_t>(*a->percent / 100.0 * static_cast<double>(total)) : a->bytes;
    return true;
}

const sim::TraceModel* busiest_model(const sim::Trace& t) {
    const sim::TraceModel* best = nullptr;
    size_t most = 0;
    for (const auto& m : t.models) {
        const auto n = static_cast<size_t>(std::count_if(t.decisions.begin(), t.decisions.end(),
                                                         [&](const sim::TraceDecision& d) { return d.model == m.id; }));
        if (!best || n > most) {
            best = &m;
            most = n;
        }
    }
    return best;
}

void print_summary(const sim::TraceSummary& s) {
    fmt::print("{}: {}\n  prediction: next layer {:.1f} % precise, {:.1f} % recall; next token {:.1f} % precise, {:.1f} % recall\n",
               s.name, s.stats, 100 * s.next_layer.precision(), 100 * s.next_layer.recall(),
               100 * s.next_token.precision(), 100 * s.next_token.recall());
}

}  // namespace

int main(int argc, char** argv) {
    sim::Setup base;
    bool table = false, pinned = false;
    std::vector<std::string> preset_names, traces;
    std::string vram = "0", ram = "100%", predict_mode = "next-layer";
    uint32_t model_id = UINT32_MAX;
    tracegen::Spec shape;
    shape.tokens = 4000;
    bool experts_given = false, used_given = false;
    auto flag = [&](const std::string& a) {
        if (a == "--table") return table = true;
        if (a == "--pinned") return pinned = true;
        if (a.rfind("--", 0) == 0) return false;
        traces.push_back(a);  // a trace
        return true;
    };
    auto option = [&](const std::string& a, const std::string& v) -> Result<bool> {
        bool ok = true;
        auto link = [&](double& field) {
            double gbs = 0;
            ok = mkmodel::parse_double(v, gbs) && gbs > 0 && gbs < 1e6;
            field = gbs * 1e9;
        };
        if (a == "--preset") preset_names.push_back(v);
        else if (a == "--trace") traces.push_back(v);
        else if (a == "--model") ok = mkmodel::parse_number(v, model_id);
        else if (a == "--vram") vram = v;
        else if (a == "--ram") ram = v;
        else if (a == "--predict") predict_mode = v;
        else if (a == "--pool-directed") ok = mkmodel::parse_double(v, base.pool_directed) && base.pool_directed >= 0 && base.pool_directed <= 1;
        else if (a == "--hysteresis")
            ok = mkmodel::parse_double(v, base.planner.hysteresis) && base.planner.hysteresis >= 0 &&
                 base.planner.hysteresis <= 100;
        else if (a == "--tick") ok = mkmodel::parse_double(v, base.tick_seconds) && base.tick_seconds > 0 && base.tick_seconds < 1e6;
        else if (a == "--layers") ok = mkmodel::parse_number(v, shape.n_layers);
        else if (a == "--experts") ok = mkmodel::parse_number(v, shape.n_experts), experts_given = true;
        else if (a == "--experts-used") ok = mkmodel::parse_number(v, shape.n_used), used_given = true;
        else if (a == "--tokens") ok = mkmodel::parse_number(v, shape.tokens);
        else if (a == "--seed") ok = mkmodel::parse_number(v, shape.seed);
        else if (a == "--storage-gbs") link(base.links.storage);
        else if (a == "--h2d-gbs") link(base.links.h2d_pageable);
        else if (a == "--h2d-pinned-gbs") link(base.links.h2d_pinned);
        else if (a == "--d2d-gbs") link(base.links.d2d);
        else if (a == "--host-memory-gbs") link(base.links.host_memory);
        else if (a == "--device-memory-gbs") link(base.links.device_memory);
        else return false;
        if (!ok) return mkmodel::bad_value(a, v);
        return true;
    };
    if (auto done = mkmodel::parse_options(argc, argv, "moecache-sim", kUsage, flag, option)) return *done;
    base.links.pinned = pinned;
    const bool no_predict = predict_mode == "none";
    sim::Predict mode = sim::Predict::NextLayer;
    if (predict_mode == "next-token") mode = sim::Predict::NextToken;
    else if (predict_mode == "both") mode = sim::Predict::Both;
    else if (predict_mode != "next-layer" && !no_predict)
        return die(fmt::format("--predict: '{}' is not next-layer, next-token, both or none", predict_mode));

    if (table) {
        sim::TableOptions opt;
        opt.base = base;
        opt.predict = mode;
        if (preset_names.empty())
            for (const auto& p : tracegen::presets()) preset_names.push_back(p.name);
        std::vector<sim::TableRow> rows;
        for (const auto& name : preset_names) {
            const tracegen::Preset* p = tracegen::find_preset(name);
            if (!p) return die(fmt::format("unknown preset '{}' (see moecache-tracegen --help)", name));
            // A family of other structure has its own expert count (issue 22's), as moecache-tracegen gives it.
            tracegen::Spec own = shape;
            if (p->family.experts != 0 && !experts_given) own.n_experts = p->family.experts;
            if (p->family.used != 0 && !used_given) own.n_used = p->family.used;
            auto spec = tracegen::fit(*p, own);
            if (!spec) return die(spec.error().what());
            auto routing = tracegen::generate(*spec);
            if (!routing) return die(routing.error().what());
            const auto st = tracegen::measure(*routing);
            const sim::Trace trace = sim::trace_of(*routing, name, 1671168, 25000);
            sim::TraceSummary summary;
            auto r = sim::table_rows(name, trace, trace.models[0], opt, &summary);
            // Routing with noise carried over (the real-like presets) hides its state from the
            // routing: no bound, and no learner of a fixed popularity (as for a recorded trace).
            std::vector<double> bound(opt.budgets.size(), -1.0), learner(opt.budgets.size(), -1.0);
            if (spec->reuse == 0) {
                auto b = tracegen::bound_hit_rates(*spec, opt.budgets);
                if (!b) return die(b.error().what());
                bound = *b;
            }
            if (spec->keep == 0 && spec->reuse == 0) {
                auto l = tracegen::learner_hit_rates(*spec, opt.budgets);
                if (!l) return die(l.error().what());
                learner = *l;
            }
            for (auto& row : r)
                for (size_t i = 0; i < opt.budgets.size(); ++i)
                    if (row.budget == opt.budgets[i]) {
                        row.bound = bound[i];
                        row.learner = learner[i];
                    }
            summary.stats = fmt::format(
                "{} tokens x {} layers, top-{} of {}; hottest 12.5 % take {:.1f} %, 25 % take {:.1f} %; reuse {:.1f} %",
                spec->tokens, spec->n_layers, spec->n_used, spec->n_experts, 100 * st.top_eighth, 100 * st.top_quarter,
                100 * st.reuse);
            print_summary(summary);
            rows.insert(rows.end(), r.begin(), r.end());
        }
        for (const auto& path : traces) {
            auto trace = sim::read_trace(path);
            if (!trace) return die(trace.error().what());
            const sim::TraceModel* m = model_id == UINT32_MAX ? busiest_model(*trace) : trace->model(model_id);
            if (!m) return die(fmt::format("{}: no such model", path));
            sim::TraceSummary summary;
            auto r = sim::table_rows(path, *trace, *m, opt, &summary);
            summary.stats = fmt::format("recorded; model {} ({}), {} decisions", m->id, m->key, trace->decisions.size());
            print_summary(summary);
            rows.insert(rows.end(), r.begin(), r.end());
        }
        fmt::print("\nHit rates are of the tier named (VRAM: a pool of that share, RAM holds the whole model; RAM: no device, storage below), "
                   "in % of accesses.\n\n{}\n",
                   sim::format_table(rows));
        std::vector<std::string> missed;
        for (const auto& r : rows)
            for (auto& m : sim::missed_targets(r, opt)) missed.push_back(std::move(m));
        if (missed.empty()) {
            fmt::print("targets: met on every row (within {:.1f} point of the better of LRU and LFU; within {:.1f} point "
                       "of the bound, or {:.0f} % of the way to it where that room is over {:.0f} points)\n",
                       opt.max_points_below_best, opt.max_points_below_bound, 100 * opt.min_room_closed, opt.room_points);
            return 0;
        }
        for (const auto& m : missed) fmt::print("target missed: {}\n", m);
        return 1;
    }

    if (traces.size() != 1) return die("give one trace, or --table (see --help)");
    auto trace = sim::read_trace(traces[0]);
    if (!trace) return die(trace.error().what());
    const sim::TraceModel* m = model_id == UINT32_MAX ? busiest_model(*trace) : trace->model(model_id);
    if (!m) return die(fmt::format("{}: no model {}", traces[0], model_id == UINT32_MAX ? std::string("at all") : std::to_string(model_id)));
    const uint64_t total = sim::accesses_of(*trace, *m).total_bytes();
    sim::Setup setup = base;
    if (!parse_budget(vram, total, setup.vram_bytes)) return die(fmt::format("--vram: '{}' is not a size or a share", vram));
    if (!parse_budget(ram, total, setup.ram_bytes)) return die(fmt::format("--ram: '{}' is not a size or a share", ram));
    std::vector<sim::SimResult> results{sim::simulate_moecache(*trace, *m, setup)};
    if (!no_predict) {
        const auto p = sim::predict(*trace, *m, mode);
        results.push_back(sim::simulate_moecache(*trace, *m, setup, &p));
        fmt::print("prediction ({}): {:.1f} % precise, {:.1f} % recall\n", p.mode, 100 * p.precision(), 100 * p.recall());
    }
    for (auto b : {sim::Baseline::Lru, sim::Baseline::Lfu, sim::Baseline::Static, sim::Baseline::Belady})
        results.push_back(sim::simulate_baseline(*trace, *m, setup, b));
    fmt::print("{}: model {} ({}), {} of expert bytes; VRAM {}, RAM {}\n\n"
               "| policy | VRAM hits | RAM hits | staged | storage | MB/token storage | H2D | D2D | tok/s |\n"
               "|---|---|---|---|---|---|---|---|---|\n",
               traces[0], m->id, m->key, daemon::format_bytes(total), daemon::format_bytes(setup.vram_bytes),
               daemon::format_bytes(setup.ram_bytes));
    for (const auto& r : results) {
        const double tok = std::max<double>(1.0, static_cast<double>(r.tokens));
        const double storage = 1.0 - r.vram_hit_rate() - r.ram_hit_rate() - (r.accesses ? static_cast<double>(r.staged_hits) / static_cast<double>(r.accesses) : 0.0);
        fmt::print("| {} | {:.1f} % | {:.1f} % | {:.1f} % | {:.1f} % | {:.2f} | {:.2f} | {:.2f} | {:.1f} |\n", r.policy,
                   100 * r.vram_hit_rate(), 100 * r.ram_hit_rate(),
                   r.accesses ? 100.0 * static_cast<double>(r.staged_hits) / static_cast<double>(r.accesses) : 0.0,
                   100 * storage, static_cast<double>(r.demand.storage + r.ahead.storage) / tok / 1e6,
                   static_cast<double>(r.demand.h2d + r.ahead.h2d) / tok / 1e6,
                   static_cast<double>(r.demand.d2d + r.ahead.d2d) / tok / 1e6, r.tokens_per_second());
    }
    return 0;
}
