// moecache-hotset: the byte ranges of a model's hot set, for a shell script to lock with
// `vmtouch -l -p START-END FILE` (one range per vmtouch process) as a baseline against the daemon.
//
//   moecache-hotset MODEL.gguf --top K [--profile HEAT.json] [--no-dense]
//
// The hot set is the dense part (every byte of every file that is no routed-expert slice; left out
// with --no-dense) and the K hottest routed experts of every MoE layer. Hottest: the rank the
// generator wrote (moecache.mkmodel.expert_rank), or with --profile the heat of a profile the
// daemon saved. Prints `FILE START END` per merged range (END exclusive), sorted by file then
// offset; a one-line summary on stderr. Exit 2: bad usage (K = 0, K past expert_count); 1: bad input.
#include "moecache/error.h"
#include "moecache/file_util.h"
#include "moecache/gguf.h"
#include "moecache/mkmodel/synth_model.h"
#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace moecache;

constexpr const char* kRankKey = mkmodel::kExpertRankKey;
constexpr uint64_t kMaxProfileBytes = 64u << 20;

struct Options {
    std::string model;
    uint32_t top = 0;
    std::optional<std::string> profile;
    bool dense = true;
};

[[noreturn]] void usage(const std::string& why) {
    fmt::print(stderr, "moecache-hotset: {}\nusage: moecache-hotset MODEL.gguf --top K [--profile HEAT.json] "
                       "[--no-dense]\n", why);
    std::exit(2);
}

Options parse_args(int argc, char** argv) {
    Options o;
    bool have_top = false;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        if (k == "--help" || k == "-h") {
            fmt::print("usage: moecache-hotset MODEL.gguf --top K [--profile HEAT.json] [--no-dense]\n"
                       "Prints FILE START END (END exclusive) for each merged range of the dense part and the K\n"
                       "hottest routed experts of every MoE layer; a summary on stderr.\n");
            std::exit(0);
        } else if (k == "--top") {
            if (i + 1 >= argc) usage("--top needs a number");
            const std::string v = argv[++i];
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), o.top);
            if (ec == std::errc::result_out_of_range)
                usage(fmt::format("--top '{}': far more than any model's experts", v));
            if (ec != std::errc() || end != v.data() + v.size() || v.empty())
                usage(fmt::format("--top '{}': not a whole number of experts", v));
            if (o.top == 0) usage("--top 0: the hot set needs at least one expert per layer (use --top 1 or more)");
            have_top = true;
        } else if (k == "--profile") {
            if (i + 1 >= argc) usage("--profile needs a file");
            o.profile = argv[++i];
        } else if (k == "--no-dense") {
            o.dense = false;
        } else if (!k.empty() && k[0] != '-' && o.model.empty()) {
            o.model = k;
        } else {
            usage(fmt::format("unexpected argument '{}'", k));
        }
    }
    if (o.model.empty()) usage("no model given");
    if (!have_top) usage("--top K is required");
    return o;
}

// The order of a layer's experts, hottest first; one vector per MoE layer, by ordinal.
using Ranking = std::vector<std::vector<uint32_t>>;

// The generator's ranking: u32 array, block-major, [block * n_experts + e] = rank of e, 0 the hottest.
Result<Ranking> rank_from_gguf(const GgufFile& head, const ExpertMap& map) {
    const auto rank = MC_TRY(mkmodel::read_expert_ranks(head, map));
    if (!rank)
        return failf("{}: no key '{}' (not a moecache-mkmodel model): rank the experts with --profile HEAT.json",
                     head.path, kRankKey);

    Ranking out;
    for (const auto& l : map.layers) {
        if (l.index >= map.n_blocks)
            return failf("{}: block {} holds experts but block_count is {}: key '{}' cannot cover it", head.path,
                         l.index, map.n_blocks, kRankKey);
        const uint32_t* row = rank->data() + size_t{l.index} * map.n_experts;
        // Each rank once per block: a repeated rank leaves "the K hottest" undefined.
        std::vector<uint32_t> by_rank(map.n_experts, UINT32_MAX);
        for (uint32_t e = 0; e < map.n_experts; ++e) {
            if (by_rank[row[e]] != UINT32_MAX)
                return failf("{}: key '{}', block {}: expert {} has rank {}, given twice; each block needs the ranks "
                             "0..{} once each", head.path, kRankKey, l.index, e, row[e], map.n_experts - 1);
            by_rank[row[e]] = e;
        }
        out.push_back(std::move(by_rank));
    }
    return out;
}

// A heat profile (daemon/src/policy/heat.cpp): {"key", "n_layers", "n_experts", "clock",
// "experts": [[moe_layer_ordinal, expert, heat, uses], ...]}; experts it does not list have heat 0.
Result<Ranking> rank_from_profile(const std::string& path, const ExpertMap& map, uint32_t top) {
    const auto text = MC_TRY(read_whole_file(path, kMaxProfileBytes, "heat profile"));
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return failf("{}: not a heat profile: not valid JSON (or a number out of range)", path);
    if (!j.is_object()) return failf("{}: not a heat profile: a JSON {}, not an object", path, j.type_name());
    auto count = [&](const char* k) -> Result<uint64_t> {
        if (!j.contains(k) || !j[k].is_number_unsigned())
            return failf("{}: key '{}' missing or not a whole number", path, k);
        return j[k].get<uint64_t>();
    };
    const uint64_t n_layers = MC_TRY(count("n_layers")), n_experts = MC_TRY(count("n_experts"));
    if (n_layers != map.layers.size() || n_experts != map.n_experts)
        return failf("{}: the profile is for {} MoE layers x {} experts, the model has {} x {}", path, n_layers,
                     n_experts, map.layers.size(), map.n_experts);
    const std::string want_key = map.profile_key();
    if (!j.contains("key") || !j["key"].is_string())
        fmt::print(stderr, "moecache-hotset: warning: {}: no 'key': cannot check it belongs to this model\n", path);
    else if (j["key"].get<std::string>() != want_key)
        fmt::print(stderr, "moecache-hotset: warning: {}: key '{}', but this model's is '{}': a profile of another "
                           "model of the same shape?\n", path, j["key"].get<std::string>(), want_key);
    if (!j.contains("experts") || !j["experts"].is_array())
        return failf("{}: key 'experts' missing or not an array", path);

    std::vector<double> heat(n_layers * n_experts, 0.0);
    std::vector<bool> seen(heat.size(), false);
    const auto& rows = j["experts"];
    for (size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        if (!r.is_array() || r.size() != 4 || !r[0].is_number_unsigned() || !r[1].is_number_unsigned() ||
            !r[2].is_number() || !r[3].is_number_unsigned())
            return failf("{}: experts[{}] is not [layer, expert, heat, uses] (whole numbers, heat a number)", path, i);
        const uint64_t l = r[0].get<uint64_t>(), e = r[1].get<uint64_t>();
        const double h = r[2].get<double>();
        if (l >= n_layers || e >= n_experts)
            return failf("{}: experts[{}] = [{}, {}, ...] is past {} layers x {} experts", path, i, l, e, n_layers,
                         n_experts);
        if (!std::isfinite(h) || h < 0)
            return failf("{}: experts[{}]: heat {} is not a finite number >= 0", path, i, h);
        const size_t at = l * n_experts + e;
        if (seen[at]) return failf("{}: experts[{}]: layer {} expert {} is listed twice", path, i, l, e);
        seen[at] = true;
        heat[at] = h;
    }

    Ranking out(n_layers);
    uint64_t cold_picks = 0;
    for (uint32_t l = 0; l < n_layers; ++l) {
        auto& order = out[l];
        order.resize(n_experts);
        std::iota(order.begin(), order.end(), 0u);
        const double* row = heat.data() + size_t{l} * n_experts;
        // Ties (unused experts above all) by expert number, so that the output is reproducible.
        std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return row[a] > row[b]; });
        for (uint32_t k = 0; k < std::min<uint64_t>(top, n_experts); ++k) cold_picks += row[order[k]] == 0;
    }
    if (cold_picks > 0)
        fmt::print(stderr, "moecache-hotset: warning: {}: {} of the {} chosen experts have no heat (never used in the "
                           "profile): those are picked by expert number\n", path, cold_picks, uint64_t{top} * n_layers);
    return out;
}

std::vector<ByteRange> merge(std::vector<ByteRange> v) {
    std::sort(v.begin(), v.end(), [](const ByteRange& a, const ByteRange& b) {
        return a.file != b.file ? a.file < b.file : a.offset < b.offset;
    });
    std::vector<ByteRange> out;
    for (const auto& r : v) {
        if (r.length == 0) continue;
        if (!out.empty() && out.back().file == r.file && r.offset <= out.back().offset + out.back().length) {
            auto& b = out.back();
            b.length = std::max(b.offset + b.length, r.offset + r.length) - b.offset;
        } else {
            out.push_back(r);
        }
    }
    return out;
}

int run(const Options& o) {
    auto fail_input = [](const Error& e) {
        fmt::print(stderr, "moecache-hotset: {}\n", e.what());
        return 1;
    };
    auto parts = open_gguf_model(o.model);
    if (!parts) return fail_input(parts.error());
    auto map = ExpertMap::build(*parts);
    if (!map) return fail_input(map.error());
    if (map->layers.empty()) return fail_input(Error{0, fmt::format("{}: the model has no routed experts", o.model)});
    if (o.top > map->n_experts)
        usage(fmt::format("--top {}: the model has {} experts per layer", o.top, map->n_experts));

    auto ranking = o.profile ? rank_from_profile(*o.profile, *map, o.top) : rank_from_gguf(parts->front(), *map);
    if (!ranking) return fail_input(ranking.error());

    std::vector<ByteRange> ranges;
    if (o.dense) ranges = map->dense_ranges();
    for (size_t i = 0; i < map->layers.size(); ++i)
        for (uint32_t k = 0; k < o.top; ++k)
            for (const auto& r : map->ranges(map->layers[i].index, (*ranking)[i][k])) {
                // The GGUF reader bounds every tensor by its file; checked again as the output is a lock list.
                if (r.offset > map->files[r.file].size || r.length > map->files[r.file].size - r.offset)
                    return fail_input(Error{0, fmt::format("{}: expert slice [{}, {}) runs past the file ({} bytes)",
                                                           map->files[r.file].path, r.offset, r.offset + r.length,
                                                           map->files[r.file].size)});
                ranges.push_back(r);
            }
    ranges = merge(std::move(ranges));

    uint64_t total = 0;
    for (const auto& r : ranges) {
        fmt::print("{} {} {}\n", map->files[r.file].path, r.offset, r.offset + r.length);
        total += r.length;
    }
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
        fmt::print(stderr, "moecache-hotset: writing the ranges to stdout failed\n");
        return 1;
    }
    fmt::print(stderr, "moecache-hotset: {} bytes ({:.1f} MiB) in {} ranges over {} files: top {} of {} experts in "
                       "{} MoE layers, ranked by {}, dense part {}\n",
               total, static_cast<double>(total) / (1 << 20), ranges.size(), map->files.size(), o.top,
               map->n_experts, map->layers.size(), o.profile ? *o.profile : std::string(kRankKey),
               o.dense ? "included" : "left out");
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    // No exception is expected; a last guard so that no input ends in an abort.
    try {
        return run(parse_args(argc, argv));
    } catch (const std::exception& e) {
        fmt::print(stderr, "moecache-hotset: {}\n", e.what());
        return 1;
    }
}
