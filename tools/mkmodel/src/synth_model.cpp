#include "moecache/mkmodel/synth_model.h"

#include "moecache/file_util.h"
#include "moecache/mkmodel/router_skew.h"
#include "moecache/unique_fd.h"
#include "rng.h"

#include <fcntl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <unordered_set>

namespace moecache::mkmodel {
namespace {

uint16_t to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffffu;
    if (exp <= 0) {  // subnormal or zero
        if (exp < -10) return static_cast<uint16_t>(sign);
        mant |= 0x800000u;
        const uint32_t shift = static_cast<uint32_t>(14 - exp);
        uint32_t h = mant >> shift;
        if ((mant >> (shift - 1)) & 1u) ++h;
        return static_cast<uint16_t>(sign | h);
    }
    if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // inf: callers stay far below
    uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
    if (mant & 0x1000u) ++h;  // round half up
    return static_cast<uint16_t>(h);
}

void put_half(uint8_t* p, float f) {
    const uint16_t h = to_half(f);
    std::memcpy(p, &h, 2);
}

void random_bytes(Rng& rng, uint8_t* p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint64_t v = rng.next();
        std::memcpy(p + i, &v, 8);
    }
    if (i < n) {
        const uint64_t v = rng.next();
        std::memcpy(p + i, &v, n - i);
    }
}

// Where a block keeps its fp16 scale (and min), and how large the scale must be for weights of
// standard deviation sigma when the quant bytes are uniform random.
struct BlockScale {
    int d_at;
    int min_at;         // -1: none
    double d_per_sigma;  // d = sigma * d_per_sigma
    double min_per_d;   // min (or dmin) = d * min_per_d
};

std::optional<BlockScale> block_scale(uint32_t type) {
    switch (type) {
        case ggml::Q4_0: return BlockScale{0, -1, 1 / 4.6, 0};
        case ggml::Q4_1: return BlockScale{0, 2, 1 / 4.6, -7.5};
        case ggml::Q5_0: return BlockScale{0, -1, 1 / 9.2, 0};
        case ggml::Q5_1: return BlockScale{0, 2, 1 / 9.2, -15.5};
        case ggml::Q8_0: return BlockScale{0, -1, 1 / 73.3, 0};
        case ggml::Q2_K: return BlockScale{80, 82, 1 / 8.0, 1.5};
        case ggml::Q3_K: return BlockScale{108, -1, 1 / 46.0, 0};
        case ggml::Q4_K: return BlockScale{0, 2, 1 / 143.0, 7.5};
        case ggml::Q5_K: return BlockScale{0, 2, 1 / 285.0, 15.5};
        case ggml::Q6_K: return BlockScale{208, -1, 1 / 1350.0, 0};
        default: return std::nullopt;
    }
}

bool supported_type(uint32_t t) {
    return t == ggml::F32 || t == ggml::F16 || block_scale(t).has_value();
}

// Rows of independent weights of standard deviation sigma.
RowFiller random_rows(GgmlTypeInfo type, uint64_t row_elems, double sigma, uint64_t seed) {
    const uint64_t row_bytes = row_elems / type.block_elements * type.block_bytes;
    return [=](uint64_t first, uint64_t n, uint8_t* out) {
        const auto bs = block_scale(type.id);
        for (uint64_t r = 0; r < n; ++r) {
            Rng rng(seed_of(seed, first + r));
            uint8_t* row = out + r * row_bytes;
            if (type.id == ggml::F32 || type.id == ggml::F16) {
                const double a = sigma * std::sqrt(3.0);
                for (uint64_t i = 0; i < row_elems; ++i) {
                    const auto v = static_cast<float>((2 * rng.uniform() - 1) * a);
                    if (type.id == ggml::F32) std::memcpy(row + 4 * i, &v, 4);
                    else put_half(row + 2 * i, v);
                }
                continue;
            }
            random_bytes(rng, row, row_bytes);
            const double d = sigma * bs->d_per_sigma;
            for (uint64_t b = 0; b < row_bytes; b += type.block_bytes) {
                put_half(row + b + bs->d_at, static_cast<float>(d));
                if (bs->min_at >= 0) put_half(row + b + bs->min_at, static_cast<float>(d * bs->min_per_d));
            }
        }
    };
}

RowFiller constant_rows(uint64_t row_elems, float value) {
    return [=](uint64_t, uint64_t n, uint8_t* out) {
        auto* f = reinterpret_cast<float*>(out);
        std::fill(f, f + n * row_elems, value);
    };
}

// The SentencePiece-style vocabulary llama.cpp's "llama" tokenizer reads: specials, the 256 byte
// fallbacks, single characters, then made-up words.
struct Vocab {
    std::vector<std::string> tokens;
    std::vector<float> scores;
    std::vector<int32_t> types;
};

Vocab make_vocab(uint32_t n, uint64_t seed) {
    Vocab v;
    std::unordered_set<std::string> seen;
    auto add = [&](std::string t, int32_t type) {
        if (v.tokens.size() >= n || !seen.insert(t).second) return;
        v.scores.push_back(-static_cast<float>(v.tokens.size()));
        v.tokens.push_back(std::move(t));
        v.types.push_back(type);
    };
    add("<unk>", 2);
    add("<s>", 3);
    add("</s>", 3);
    for (int b = 0; b < 256; ++b) add(fmt::format("<0x{:02X}>", b), 6);
    const std::string space = "\xe2\x96\x81";  // U+2581, SentencePiece's word start
    add(space, 1);
    for (char c = 'a'; c <= 'z'; ++c) add(std::string(1, c), 1);
    for (char c = 'a'; c <= 'z'; ++c) add(space + c, 1);
    for (std::string p : {std::string("."), std::string(","), std::string("!"), std::string("?"), space + "."}) add(p, 1);
    static const char* kOnsets[] = {"b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r",
                                    "s", "t", "v", "w", "z", "ch", "sh", "th", "st", "br", "tr", "pl"};
    static const char* kVowels[] = {"a", "e", "i", "o", "u", "ai", "ou", "ea"};
    Rng rng(seed_of(seed, 0x766f636162ull));
    while (v.tokens.size() < n) {
        std::string w = space;
        const int syll = 1 + static_cast<int>(rng.next() % 3);
        for (int s = 0; s < syll; ++s) {
            w += kOnsets[rng.next() % std::size(kOnsets)];
            w += kVowels[rng.next() % std::size(kVowels)];
        }
        if (rng.next() % 3 == 0) w += kOnsets[rng.next() % std::size(kOnsets)];
        add(w, 1);
    }
    return v;
}

constexpr double kWeightSigma = 0.02;
constexpr double kRopeBase = 1000000.0;  // rope.freq_base
// The context attention's softmax sharpness: tokens outside its window weigh about e^-10 each
// against those inside, so a thousand of them weigh less than one inside.
constexpr double kContextSharpness = 10.0;

// The RoPE pairs the context attention's query and key use (NEOX: pair i rotates dims i and
// i + head_dim / 2 by position x theta_i, theta_i = base^(-2i / head_dim)): those of theta in
// [1 / (8 window), 1 / window]. Their cosines are all near 1 within about `window` tokens and
// spread out beyond, so the softmax weighs the last `window` tokens about alike and the rest
// near exp(-sharpness): a window that moves with the token, no token (itself included) ruling it.
// At least two pairs, the nearest to that band.
std::vector<uint32_t> context_pairs(uint32_t head_dim, double window) {
    const uint32_t pairs = head_dim / 2;
    std::vector<std::pair<double, uint32_t>> by_distance;
    std::vector<uint32_t> in;
    for (uint32_t i = 0; i < pairs; ++i) {
        const double theta = std::pow(kRopeBase, -2.0 * i / head_dim);
        if (theta <= 1.0 / window && theta >= 1.0 / (8 * window)) in.push_back(i);
        by_distance.emplace_back(std::abs(std::log(theta * window * std::sqrt(8.0))), i);
    }
    if (in.size() >= 2) return in;
    std::sort(by_distance.begin(), by_distance.end());
    return {std::min(by_distance[0].second, by_distance[1].second), std::max(by_distance[0].second, by_distance[1].second)};
}

// The context attention's weights by distance d = 0 .. n-1: exp(s (K(d) - 1)), K(d) the mean
// over its pairs of cos(d theta_i).
std::vector<double> context_kernel(double s, uint32_t head_dim, const std::vector<uint32_t>& pairs, uint32_t n) {
    std::vector<double> w(n);
    for (uint32_t d = 0; d < n; ++d) {
        double k = 0;
        for (const uint32_t i : pairs) k += std::cos(static_cast<double>(d) * std::pow(kRopeBase, -2.0 * i / head_dim));
        w[d] = std::exp(s * (k / static_cast<double>(pairs.size()) - 1.0));
    }
    return w;
}

// Rows of f16 from a function of (row, column).
RowFiller half_rows(uint64_t row_elems, std::function<float(uint64_t, uint64_t)> value) {
    return [=](uint64_t first, uint64_t n, uint8_t* out) {
        for (uint64_t r = 0; r < n; ++r)
            for (uint64_t i = 0; i < row_elems; ++i) put_half(out + (r * row_elems + i) * 2, value(first + r, i));
    };
}

}  // namespace

Result<void> validate(const ModelSpec& s) {
    auto positive = [](const char* what, uint64_t v) -> Result<void> {
        if (v == 0) return failf("{} must be at least 1", what);
        return {};
    };
    MC_TRY_VOID(positive("--layers", s.n_layers));
    MC_TRY_VOID(positive("--experts", s.n_experts));
    MC_TRY_VOID(positive("--experts-used", s.n_experts_used));
    MC_TRY_VOID(positive("--embd", s.n_embd));
    MC_TRY_VOID(positive("--ff", s.n_ff_exp));
    MC_TRY_VOID(positive("--heads", s.n_head));
    MC_TRY_VOID(positive("--heads-kv", s.n_head_kv));
    if (s.n_experts_used > s.n_experts)
        return failf("--experts-used {} is more than --experts {}", s.n_experts_used, s.n_experts);
    if (s.n_experts > 4096) return failf("--experts {} is more than 4096", s.n_experts);
    if (s.n_layers > 1024) return failf("--layers {} is more than 1024", s.n_layers);
    if (s.n_head % s.n_head_kv != 0)
        return failf("--heads {} is not a multiple of --heads-kv {}", s.n_head, s.n_head_kv);
    if (s.head_dim % 2 != 0 || s.head_dim == 0) return failf("--head-dim {} must be even", s.head_dim);
    if (s.n_vocab < 400) return failf("--vocab {} is too small: the tokenizer alone needs 400", s.n_vocab);
    if (!(s.context.weight >= 0 && s.context.weight <= 100))
        return failf("--context-weight {} is not in [0, 100]", s.context.weight);
    if (!(s.context.window >= 1 && s.context.window <= 4096))
        return failf("--context-window {} is not in [1, 4096] tokens", s.context.window);
    if (!(s.context.follow >= 0 && s.context.follow < 1)) return failf("--router-follow {} is not in [0, 1)", s.context.follow);
    for (const auto& [what, t] : {std::pair{"--expert-type", s.expert_type}, std::pair{"--dense-type", s.dense_type}})
        if (!supported_type(t.id))
            return failf("{} {}: not one this generator writes (f32, f16, q4_0, q4_1, q5_0, q5_1, "
                         "q8_0, q2_K, q3_K, q4_K, q5_K, q6_K)", what, t.name);
    auto multiple = [](const char* what, uint64_t v, GgmlTypeInfo t) -> Result<void> {
        if (v % t.block_elements != 0)
            return failf("{} {} must be a multiple of {} for type {}", what, v, t.block_elements, t.name);
        return {};
    };
    MC_TRY_VOID(multiple("--embd", s.n_embd, s.expert_type));
    MC_TRY_VOID(multiple("--ff", s.n_ff_exp, s.expert_type));
    MC_TRY_VOID(multiple("--embd", s.n_embd, s.dense_type));
    MC_TRY_VOID(multiple("--heads x --head-dim", uint64_t{s.n_head} * s.head_dim, s.dense_type));
    return {};
}

uint64_t bytes_per_expert(const ModelSpec& s) {
    const auto& t = s.expert_type;
    const uint64_t gate_up = uint64_t{s.n_embd} / t.block_elements * t.block_bytes * s.n_ff_exp;
    const uint64_t down = uint64_t{s.n_ff_exp} / t.block_elements * t.block_bytes * s.n_embd;
    return 2 * gate_up + down;
}

std::vector<uint32_t> expert_ranks(const ModelSpec& s) {
    std::vector<uint32_t> ranks(static_cast<size_t>(s.n_layers) * s.n_experts);
    for (uint32_t l = 0; l < s.n_layers; ++l) {
        std::vector<uint32_t> perm(s.n_experts);
        std::iota(perm.begin(), perm.end(), 0u);
        Rng rng(seed_of(s.seed, 0x72616e6bull, l));
        for (uint32_t i = s.n_experts; i > 1; --i) std::swap(perm[i - 1], perm[rng.next() % i]);
        // perm[rank] = expert
        for (uint32_t r = 0; r < s.n_experts; ++r) ranks[size_t{l} * s.n_experts + perm[r]] = r;
    }
    return ranks;
}

Result<void> build_model(const ModelSpec& s, GgufWriter& w) {
    MC_TRY_VOID(validate(s));
    const std::string a = "qwen3moe";
    const auto f32 = *ggml_type_info(ggml::F32);
    const auto f16 = *ggml_type_info(ggml::F16);
    const Vocab vocab = make_vocab(s.n_vocab, s.seed);

    w.add("general.architecture", a);
    w.add("general.name", s.name);
    w.add("general.type", std::string("model"));
    w.add(a + ".block_count", s.n_layers);
    w.add(a + ".context_length", s.n_ctx_train);
    w.add(a + ".embedding_length", s.n_embd);
    w.add(a + ".feed_forward_length", s.n_ff_exp);
    w.add(a + ".expert_feed_forward_length", s.n_ff_exp);
    w.add(a + ".attention.head_count", s.n_head);
    w.add(a + ".attention.head_count_kv", s.n_head_kv);
    w.add(a + ".attention.key_length", s.head_dim);
    w.add(a + ".attention.value_length", s.head_dim);
    w.add(a + ".rope.freq_base", static_cast<float>(kRopeBase));
    w.add(a + ".attention.layer_norm_rms_epsilon", 1e-6f);
    w.add(a + ".expert_count", s.n_experts);
    w.add(a + ".expert_used_count", s.n_experts_used);
    w.add("tokenizer.ggml.model", std::string("llama"));
    w.add("tokenizer.ggml.tokens", StringArray{vocab.tokens});
    w.add("tokenizer.ggml.scores", F32Array{vocab.scores});
    w.add("tokenizer.ggml.token_type", I32Array{vocab.types});
    w.add("tokenizer.ggml.unknown_token_id", 0u);
    w.add("tokenizer.ggml.bos_token_id", 1u);
    w.add("tokenizer.ggml.eos_token_id", 2u);
    w.add("tokenizer.ggml.add_bos_token", true);
    w.add("tokenizer.ggml.add_eos_token", false);
    // What made this model, so tools can compare measured routing with the intended one.
    w.add("moecache.mkmodel.seed", s.seed);
    w.add("moecache.mkmodel.preset", s.preset);
    w.add("moecache.mkmodel.router_skew_scale", static_cast<float>(s.skew.scale));
    w.add("moecache.mkmodel.router_skew_shape", static_cast<float>(s.skew.shape));
    // Only where they are on: a model without them keeps the layout (and offsets) of before.
    if (s.context.weight > 0) {
        w.add("moecache.mkmodel.context_weight", static_cast<float>(s.context.weight));
        w.add("moecache.mkmodel.context_window", static_cast<float>(s.context.window));
    }
    if (s.context.follow > 0) w.add("moecache.mkmodel.router_follow", static_cast<float>(s.context.follow));
    w.add("moecache.mkmodel.expert_rank", U32Array{expert_ranks(s)});

    uint64_t tid = 0;
    auto tensor = [&](std::string name, GgmlTypeInfo type, std::vector<int64_t> ne, RowFiller fill) {
        w.add_tensor({std::move(name), type, std::move(ne), std::move(fill)});
        ++tid;
    };
    auto random_tensor = [&](std::string name, GgmlTypeInfo type, std::vector<int64_t> ne, double sigma) {
        RowFiller fill = random_rows(type, static_cast<uint64_t>(ne[0]), sigma, seed_of(s.seed, tid));
        tensor(std::move(name), type, std::move(ne), std::move(fill));
    };
    const int64_t n_embd = s.n_embd, n_vocab = s.n_vocab, n_exp = s.n_experts, n_ff = s.n_ff_exp;
    const int64_t n_q = int64_t{s.n_head} * s.head_dim, n_kv = int64_t{s.n_head_kv} * s.head_dim;

    // Token embeddings: a common component A on axis 0, N(0, 1) elsewhere.
    const double A = std::sqrt(static_cast<double>(n_embd - 1));
    const uint64_t embd_seed = seed_of(s.seed, 0x656d6264ull);
    tensor("token_embd.weight", f16, {n_embd, n_vocab}, [=](uint64_t first, uint64_t n, uint8_t* out) {
        for (uint64_t r = 0; r < n; ++r) {
            Rng rng(seed_of(embd_seed, first + r));
            uint8_t* row = out + r * static_cast<uint64_t>(n_embd) * 2;
            put_half(row, static_cast<float>(A));
            for (int64_t i = 1; i < n_embd; ++i) put_half(row + 2 * i, static_cast<float>(rng.normal()));
        }
    });
    tensor("output_norm.weight", f32, {n_embd}, constant_rows(static_cast<uint64_t>(n_embd), 1.0f));
    // The output head ignores axis 0, so no token is favoured by the common component; logits
    // have a spread of about 1.5 so that sampling at temperature 1 visits much of the vocabulary.
    const uint64_t out_seed = seed_of(s.seed, 0x6f7574ull);
    const double out_sigma = 1.5 / std::sqrt(static_cast<double>(n_embd - 1));
    tensor("output.weight", f16, {n_embd, n_vocab}, [=](uint64_t first, uint64_t n, uint8_t* out) {
        for (uint64_t r = 0; r < n; ++r) {
            Rng rng(seed_of(out_seed, first + r));
            uint8_t* row = out + r * static_cast<uint64_t>(n_embd) * 2;
            put_half(row, 0.0f);
            for (int64_t i = 1; i < n_embd; ++i) put_half(row + 2 * i, static_cast<float>(rng.normal() * out_sigma));
        }
    });

    const auto ranks = expert_ranks(s);
    std::vector<uint32_t> by_rank(ranks.size());  // [layer * n_experts + rank] = expert: the follow's pairing
    for (uint32_t l = 0; l < s.n_layers; ++l)
        for (uint32_t e = 0; e < s.n_experts; ++e) by_rank[size_t{l} * s.n_experts + ranks[size_t{l} * s.n_experts + e]] = e;
    for (uint32_t l = 0; l < s.n_layers; ++l) {
        const std::string p = fmt::format("blk.{}.", l);
        // Attention does not see axis 0: otherwise attn_v carries the common component into every
        // token's hidden state as a fixed vector, a fixed per-expert offset at the next routers
        // that blurs the intended ranking (seen as skew in the uniform preset).
        const bool context = s.context.weight > 0 && l == 0;
        tensor(p + "attn_norm.weight", f32, {n_embd}, [=](uint64_t, uint64_t, uint8_t* out) {
            auto* f = reinterpret_cast<float*>(out);
            std::fill(f, f + n_embd, 1.0f);
            f[0] = context ? 1.0f : 0.0f;
        });
        if (context) {
            // The query and key read axis 0 alone (the first half of each RoPE pair), the values
            // every axis but 0 (unit spread), and the output adds the mix back off axis 0 with
            // `weight` times the token's own spread at a typical position (256).
            const uint32_t hd = s.head_dim;
            const double sharp = kContextSharpness;
            const auto pairs = context_pairs(hd, s.context.window);
            const auto kernel = context_kernel(sharp, hd, pairs, 256);
            double sum = 0, sq = 0;
            for (const double x : kernel) {
                sum += x;
                sq += x * x;
            }
            const double eta = sq / (sum * sum);
            const double v_sigma = std::sqrt(2.0 / static_cast<double>(n_embd - 1));
            const double o_sigma = s.context.weight / std::sqrt(static_cast<double>(n_q) * eta);
            std::vector<char> used_dim(hd, 0);
            for (const uint32_t i : pairs) used_dim[i] = 1;
            const auto axis0 = [hd, used_dim](uint64_t r, uint64_t i) { return i == 0 && used_dim[r % hd] ? 1.0f : 0.0f; };
            tensor(p + "attn_q.weight", f16, {n_embd, n_q}, half_rows(static_cast<uint64_t>(n_embd), axis0));
            tensor(p + "attn_k.weight", f16, {n_embd, n_kv}, half_rows(static_cast<uint64_t>(n_embd), axis0));
            const uint64_t v_seed = seed_of(s.seed, 0x76616c7565ull, l), o_seed = seed_of(s.seed, 0x6f7574707574ull, l);
            tensor(p + "attn_v.weight", f16, {n_embd, n_kv}, half_rows(static_cast<uint64_t>(n_embd), [=](uint64_t r, uint64_t i) {
                if (i == 0) return 0.0f;
                Rng rng(seed_of(v_seed, r * static_cast<uint64_t>(n_embd) + i));
                return static_cast<float>(rng.normal() * v_sigma);
            }));
            tensor(p + "attn_output.weight", f16, {n_q, n_embd}, half_rows(static_cast<uint64_t>(n_q), [=](uint64_t r, uint64_t i) {
                if (r == 0) return 0.0f;
                Rng rng(seed_of(o_seed, r * static_cast<uint64_t>(n_q) + i));
                return static_cast<float>(rng.normal() * o_sigma);
            }));
            // Norm weights c on both: the score at distance 0 is c^2 sqrt(head_dim) = sharp.
            const auto c = static_cast<float>(std::sqrt(sharp / std::sqrt(static_cast<double>(hd))));
            tensor(p + "attn_q_norm.weight", f32, {s.head_dim}, constant_rows(s.head_dim, c));
            tensor(p + "attn_k_norm.weight", f32, {s.head_dim}, constant_rows(s.head_dim, c));
        } else {
            random_tensor(p + "attn_q.weight", s.dense_type, {n_embd, n_q}, kWeightSigma);
            random_tensor(p + "attn_k.weight", s.dense_type, {n_embd, n_kv}, kWeightSigma);
            random_tensor(p + "attn_v.weight", s.dense_type, {n_embd, n_kv}, kWeightSigma);
            random_tensor(p + "attn_output.weight", s.dense_type, {n_q, n_embd}, kWeightSigma);
            tensor(p + "attn_q_norm.weight", f32, {s.head_dim}, constant_rows(s.head_dim, 1.0f));
            tensor(p + "attn_k_norm.weight", f32, {s.head_dim}, constant_rows(s.head_dim, 1.0f));
        }
        tensor(p + "ffn_norm.weight", f32, {n_embd}, constant_rows(static_cast<uint64_t>(n_embd), 1.0f));
        // Router row e: bias_e / A on axis 0 (the embedding carries A there), noise of variance
        // 1 / (n_embd - 1) per other axis, so g_e . r ~ N(0, 1) for embeddings r ~ N(0, I).
        // The context adds its spread to the token's in every router's noise: the bias grows with it,
        // so that the popularity stays the skew's.
        const double noise = std::sqrt(1.0 + s.context.weight * s.context.weight);
        std::vector<float> bias(static_cast<size_t>(n_exp));
        for (int64_t e = 0; e < n_exp; ++e) {
            const double rank = ranks[size_t{l} * s.n_experts + static_cast<size_t>(e)];
            bias[static_cast<size_t>(e)] = static_cast<float>(
                -s.skew.scale * noise * std::pow(std::log(rank + 1.0), s.skew.shape) / A);
        }
        const double g = 1.0 / std::sqrt(static_cast<double>(n_embd - 1));
        // Row e of layer l: its own noise, or with follow f, sqrt(1 - f) of its own and sqrt(f) of
        // row pi(e) of layer l-1 (the expert of the same popularity rank there), recursively.
        const double follow = s.context.follow;
        const uint64_t base_seed = s.seed;
        const uint32_t n_experts = s.n_experts, layer = l;
        tensor(p + "ffn_gate_inp.weight", f32, {n_embd, n_exp}, [=](uint64_t first, uint64_t n, uint8_t* out) {
            std::vector<double> acc(static_cast<size_t>(n_embd));
            for (uint64_t r = 0; r < n; ++r) {
                auto* row = reinterpret_cast<float*>(out) + r * static_cast<uint64_t>(n_embd);
                std::fill(acc.begin(), acc.end(), 0.0);
                uint32_t e = static_cast<uint32_t>(first + r);
                double share = 1.0;
                for (uint32_t ll = layer;; --ll) {
                    const double own = ll == 0 || follow == 0 ? share : share * std::sqrt(1 - follow);
                    Rng rng(seed_of(seed_of(base_seed, 0x726f757465ull, ll), e));
                    for (int64_t i = 1; i < n_embd; ++i) acc[static_cast<size_t>(i)] += own * rng.normal();
                    if (ll == 0 || follow == 0) break;
                    share *= std::sqrt(follow);
                    e = by_rank[size_t{ll - 1} * n_experts + ranks[size_t{ll} * n_experts + e]];
                }
                row[0] = bias[first + r];
                for (int64_t i = 1; i < n_embd; ++i) row[i] = static_cast<float>(acc[static_cast<size_t>(i)] * g);
            }
        });
        random_tensor(p + "ffn_gate_exps.weight", s.expert_type, {n_embd, n_ff, n_exp}, kWeightSigma);
        random_tensor(p + "ffn_up_exps.weight", s.expert_type, {n_embd, n_ff, n_exp}, kWeightSigma);
        random_tensor(p + "ffn_down_exps.weight", s.expert_type, {n_ff, n_embd, n_exp}, kWeightSigma);
    }
    return {};
}

Result<std::optional<std::vector<uint32_t>>> read_expert_ranks(const GgufFile& head, const ExpertMap& map) {
    const auto* kv = head.find(kExpertRankKey);
    if (!kv) return std::optional<std::vector<uint32_t>>{};
    const auto* arr = std::get_if<GgufArrayRef>(&kv->value);
    const uint64_t want = uint64_t{map.n_blocks} * map.n_experts;
    if (!arr || arr->element_type != GgufValueType::U32 || arr->count != want)
        return failf("{}: '{}' (at offset {}) is not a u32 array of block_count x expert_count = {} values",
                     head.path, kExpertRankKey, kv->offset, want);
    if (arr->offset > head.file_size || want * 4 > head.file_size - arr->offset)
        return failf("{}: '{}': its {} values run past the end of the file", head.path, kExpertRankKey, want);
    std::vector<uint32_t> rank(want);
    UniqueFd fd(::open(head.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) return fail_errno("open {}", head.path);
    MC_TRY_VOID(pread_exact(fd.get(), rank.data(), want * 4, arr->offset,
                            fmt::format("{} key '{}'", head.path, kExpertRankKey)));
    for (auto v : rank)
        if (v >= map.n_experts)
            return failf("{}: '{}' holds rank {}, past expert_count {}", head.path, kExpertRankKey, v, map.n_experts);
    return std::optional<std::vector<uint32_t>>(std::move(rank));
}

}  // namespace moecache::mkmodel
