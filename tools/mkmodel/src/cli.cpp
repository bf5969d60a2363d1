#include "moecache/mkmodel/cli.h"
#include "moecache/build_info.h"

#include "moecache/mkmodel/gguf_writer.h"
#include "moecache/mkmodel/router_skew.h"
#include "moecache/mkmodel/synth_model.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <charconv>
#include <cstring>
#include <string>

namespace moecache::mkmodel {
namespace {

constexpr const char* kUsage = R"(usage: moecache-mkmodel --output FILE.gguf [options]

Writes a synthetic Mixture-of-Experts model (architecture qwen3moe) that llama.cpp loads and
runs, streaming: any size costs a few MiB of memory.

Shape:
  --layers N          MoE layers (8)              --experts N        experts per layer (64)
  --experts-used N    experts per token (4)       --embd N           hidden width (256)
  --ff N              one expert's FFN width (256) --heads N / --heads-kv N / --head-dim N (4/2/64)
  --vocab N           vocabulary size (8192)      --ctx N            training context (4096)
Types:
  --expert-type T     f32 f16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_K q3_K q4_K q5_K q6_K (q8_0)
  --dense-type T      attention weights, same choices (q8_0)
Routing:
  --preset NAME       uniform | deepseek-v4-flash | low-skew: fits the router skew to the
                      preset's published coverage for this expert count; mixtral-like |
                      qwen3-next-like | deepseek-like: routing as real models' router logs show
                      it (docs/routing.md), with reuse. A preset brings the shape it has in
                      moecache-tracegen where the options above do not say: 16 layers, its own
                      experts and top-k (the first three: 64, top-8)
  --skew S            router bias -S*ln(rank)^P; 0 routes uniformly (0)
  --skew-shape P      (1)
  --context-weight W  reuse between neighbouring tokens, made by the model: layer 0's attention
                      mixes the last N tokens into what every router reads, W times the
                      token's own spread (0: off)
  --context-window N  (16)
  --router-follow F   in [0, 1): each layer's router rows share F of their variance with the
                      previous layer's (same popularity rank), so layers predict each other (0)
Files:
  --splits N          write NAME-0000i-of-0000N.gguf parts, as llama.cpp splits models (1)
  --alignment N       data alignment, a power of two (32)
  --drop-cache        drop written pages from the page cache (a cold model, less memory)
  --dry-run           write nothing: say how many bytes the tensors would take
  --seed N            (1)                          --name TEXT        general.name
  --json              print what was written as JSON on stdout
)";

}  // namespace

bool parse_double(const std::string& s, double& out) {
    try {
        size_t n = 0;
        out = std::stod(s, &n);
        return n == s.size();
    } catch (...) {
        return false;
    }
}

std::optional<int> parse_options(int argc, char** argv, std::string_view program, std::string_view usage,
                                 const std::function<bool(const std::string&)>& flag, const OptionHandler& option) {
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "-h" || a == "--help") {
            fmt::print("{}", usage);
            return 0;
        }
        if (a == "--version") {
            fmt::print("{} {}\n", program, moecache::version_line());
            return 0;
        }
        if (flag(a)) continue;
        if (i + 1 >= argc) return usage_error(program, fmt::format("{} needs a value (or is unknown; see --help)", a));
        const std::string v = argv[++i];
        auto took = option(a, v);
        if (!took) return usage_error(program, took.error().what());
        if (!*took) return usage_error(program, fmt::format("unknown option '{}' (see --help)", a));
    }
    return std::nullopt;
}

tl::unexpected<Error> bad_value(const std::string& name, const std::string& value) {
    return failf("{}: '{}' is not a valid value", name, value);
}

int usage_error(std::string_view program, const std::string& message) {
    fmt::print(stderr, "{}: {}\n", program, message);
    return 2;
}

int run_cli(int argc, char** argv) {
    ModelSpec spec;
    WriteOptions opt;
    std::string output;
    bool dry_run = false;
    bool json = false, skew_given = false, context_given = false, experts_given = false, used_given = false,
         layers_given = false;
    auto die = [](const std::string& m) { return usage_error("moecache-mkmodel", m); };
    auto flag = [&](const std::string& a) {
        if (a == "--json") return json = true;
        if (a == "--drop-cache") return opt.drop_cache = true;
        if (a == "--dry-run") return dry_run = true;
        return false;
    };
    auto option = [&](const std::string& a, const std::string& v) -> Result<bool> {
        auto u32 = [&](uint32_t& out) { return parse_number(v, out); };
        bool ok = true;
        if (a == "--output" || a == "-o") output = v;
        else if (a == "--layers") {
            ok = u32(spec.n_layers);
            layers_given = true;
        } else if (a == "--experts") {
            ok = u32(spec.n_experts);
            experts_given = true;
        } else if (a == "--experts-used") {
            ok = u32(spec.n_experts_used);
            used_given = true;
        } else if (a == "--embd")
            ok = u32(spec.n_embd);
        else if (a == "--ff") ok = u32(spec.n_ff_exp);
        else if (a == "--heads") ok = u32(spec.n_head);
        else if (a == "--heads-kv") ok = u32(spec.n_head_kv);
        else if (a == "--head-dim") ok = u32(spec.head_dim);
        else if (a == "--vocab") ok = u32(spec.n_vocab);
        else if (a == "--ctx") ok = u32(spec.n_ctx_train);
        else if (a == "--splits") ok = u32(opt.splits);
        else if (a == "--alignment") ok = u32(opt.alignment) && opt.alignment && !(opt.alignment & (opt.alignment - 1));
        else if (a == "--seed") ok = parse_number(v, spec.seed);
        else if (a == "--name") spec.name = v;
        else if (a == "--skew") { ok = parse_double(v, spec.skew.scale) && spec.skew.scale >= 0; skew_given = true; }
        else if (a == "--skew-shape") ok = parse_double(v, spec.skew.shape) && spec.skew.shape > 0;
        else if (a == "--context-weight") { ok = parse_double(v, spec.context.weight); context_given = true; }
        else if (a == "--context-window") { ok = parse_double(v, spec.context.window); context_given = true; }
        else if (a == "--router-follow") { ok = parse_double(v, spec.context.follow); context_given = true; }
        else if (a == "--preset") {
            if (!find_preset(v)) {
                std::string names;
                for (const auto& p : presets()) names += " " + p.name;
                return failf("unknown preset '{}'; known:{}", v, names);
            }
            spec.preset = v;
        } else if (a == "--expert-type" || a == "--dense-type") {
            const auto t = ggml_type_by_name(v);
            if (!t) return failf("{}: unknown ggml type '{}'", a, v);
            (a == "--expert-type" ? spec.expert_type : spec.dense_type) = *t;
        } else return false;
        if (!ok) return bad_value(a, v);
        return true;
    };
    if (auto done = parse_options(argc, argv, "moecache-mkmodel", kUsage, flag, option)) return *done;
    if (output.empty()) return die("--output FILE.gguf is required");
    if (!spec.preset.empty() && skew_given) return die("--preset and --skew exclude each other");
    if (!spec.preset.empty()) {  // the preset's shape and reuse where the options do not say
        // A preset means one shape in moecache-mkmodel and moecache-tracegen alike: its own expert
        // count, else tracegen's 16 layers x 64 experts, top-8 (kPresetShape).
        const Preset& p = *find_preset(spec.preset);
        if (!layers_given) spec.n_layers = kPresetShape.layers;
        if (!experts_given) spec.n_experts = p.experts != 0 ? p.experts : kPresetShape.experts;
        if (!used_given) spec.n_experts_used = p.used != 0 ? p.used : kPresetShape.used;
        if (!context_given) spec.context = p.context;
    }
    if (auto r = validate(spec); !r) return die(r.error().what());
    if (!spec.preset.empty()) spec.skew = fit_skew(*find_preset(spec.preset), spec.n_experts, spec.n_experts_used);

    const auto start = std::chrono::steady_clock::now();
    GgufWriter w;
    if (auto r = build_model(spec, w); !r) return die(r.error().what());
    if (dry_run) {  // what it would write: the tensors' bytes (the headers add a few KiB)
        const uint64_t bytes = w.tensor_bytes(opt.alignment);
        if (json)
            fmt::print("{}\n",
                       nlohmann::json{{"dry_run", true},
                                      {"bytes", bytes},
                                      {"n_layers", spec.n_layers},
                                      {"n_experts", spec.n_experts},
                                      {"n_experts_used", spec.n_experts_used},
                                      {"expert_bytes_total", bytes_per_expert(spec) * spec.n_experts * spec.n_layers}}
                           .dump(2));
        else
            fmt::print("would write {} bytes ({:.2f} GiB) of tensors; nothing written\n", bytes,
                       static_cast<double>(bytes) / (1ull << 30));
        return 0;
    }
    auto files = w.write(output, opt);
    if (!files) return die(files.error().what());
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    uint64_t total = 0;
    for (const auto& f : *files) total += f.bytes;
    const auto pop = simulate_popularity(spec.n_experts, spec.n_experts_used, spec.skew);
    const auto curve = coverage_curve(pop);
    if (json) {
        nlohmann::json j;
        j["files"] = nlohmann::json::array();
        for (const auto& f : *files) j["files"].push_back({{"path", f.path}, {"bytes", f.bytes}});
        j["bytes"] = total;
        j["seconds"] = secs;
        j["architecture"] = "qwen3moe";
        j["n_layers"] = spec.n_layers;
        j["n_experts"] = spec.n_experts;
        j["n_experts_used"] = spec.n_experts_used;
        j["n_embd"] = spec.n_embd;
        j["n_ff_exp"] = spec.n_ff_exp;
        j["n_vocab"] = spec.n_vocab;
        j["expert_type"] = std::string(spec.expert_type.name);
        j["dense_type"] = std::string(spec.dense_type.name);
        j["splits"] = opt.splits;
        j["bytes_per_expert"] = bytes_per_expert(spec);
        j["expert_bytes_total"] = bytes_per_expert(spec) * spec.n_experts * spec.n_layers;
        j["seed"] = spec.seed;
        j["preset"] = spec.preset;
        j["skew"] = {{"scale", spec.skew.scale}, {"shape", spec.skew.shape}};
        j["context"] = {{"weight", spec.context.weight}, {"window", spec.context.window}, {"follow", spec.context.follow}};
        j["predicted_coverage"] = {{"0.125", coverage_at(curve, 0.125)},
                                   {"0.25", coverage_at(curve, 0.25)},
                                   {"0.5", coverage_at(curve, 0.5)}};
        fmt::print("{}\n", j.dump(2));
    } else {
        for (const auto& f : *files) fmt::print("wrote {} ({} bytes)\n", f.path, f.bytes);
        fmt::print("{} MoE layers x {} experts ({} used), {} bytes per expert, {} in {:.2f} s ({:.0f} MB/s)\n",
                   spec.n_layers, spec.n_experts, spec.n_experts_used, bytes_per_expert(spec),
                   spec.expert_type.name, secs, static_cast<double>(total) / 1e6 / secs);
        fmt::print("router skew S={:.3f} P={:.2f}{}: hottest 12.5 % of experts take {:.1f} %, 25 % take "
                   "{:.1f} % of routings (simulated)\n", spec.skew.scale, spec.skew.shape,
                   spec.preset.empty() ? "" : " (preset " + spec.preset + ")",
                   100 * coverage_at(curve, 0.125), 100 * coverage_at(curve, 0.25));
    }
    return 0;
}

}  // namespace moecache::mkmodel
