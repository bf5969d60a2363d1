// Synthetic Mixture-of-Experts models that a real llama.cpp loads and runs (architecture
// qwen3moe), with routing of a chosen skew.
//
// How the skew is made: every token embedding has a common component along axis 0 and random
// components elsewhere; router row e has weight b_e on axis 0 and random weights elsewhere. So
// logit_e = (b_e * x0 + g_e . r) / rms(x): a fixed per-expert bias plus per-token noise that is
// close to N(0, 1) across experts, and the RMS norm scales both alike, leaving top-k untouched.
// The bias is -S * ln(rank)^P for a random ranking of each layer's experts; S = 0 routes
// uniformly. Routing then depends almost only on the current token, so decoding samples with a
// temperature over a large vocabulary to see many patterns.
#pragma once

#include "moecache/error.h"
#include "moecache/ggml_type.h"
#include "moecache/gguf.h"
#include "moecache/model.h"
#include "moecache/mkmodel/gguf_writer.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecache::mkmodel {

struct RouterSkew {
    double scale = 0.0;  // S
    double shape = 1.0;  // P
};

// Routing that real models show beside popularity (docs/routing.md): reuse between neighbouring
// tokens and layers that predict each other. Made by the model itself, not replayed: layer 0's
// attention reads a constant query and key (the embeddings' common axis) on RoPE pairs whose
// cosines stay near 1 for about `window` tokens, so position alone weighs the past: the last
// `window` tokens about alike, the rest near nothing. Its output, a mix of those tokens' values,
// drifts as the window moves; it joins the residual with `weight` times the token's own spread,
// and every router reads it. `follow` correlates router row e of layer l+1 with row pi(e) of
// layer l (pi: the expert of the same popularity rank), so layer l's experts predict l+1's.
struct ContextRouting {
    double weight = 0;   // 0: off (attention as before: no axis 0, random weights)
    double window = 16;  // tokens, [1, 4096]
    double follow = 0;   // [0, 1)
};

struct ModelSpec {
    std::string name = "moecache-synthetic";
    uint32_t n_layers = 8;
    uint32_t n_experts = 64;
    uint32_t n_experts_used = 4;
    uint32_t n_embd = 256;
    uint32_t n_ff_exp = 256;  // width of one expert's FFN
    uint32_t n_head = 4;
    uint32_t n_head_kv = 2;
    uint32_t head_dim = 64;
    uint32_t n_vocab = 8192;
    uint32_t n_ctx_train = 4096;
    GgmlTypeInfo expert_type = *ggml_type_info(ggml::Q8_0);
    GgmlTypeInfo dense_type = *ggml_type_info(ggml::Q8_0);
    uint64_t seed = 1;
    RouterSkew skew;
    ContextRouting context;
    std::string preset;  // for the record: the preset that chose the skew, if any
};

// Checks a spec against what llama.cpp and the block sizes of the chosen types need.
Result<void> validate(const ModelSpec& spec);

// Bytes of one expert (gate + up + down slices) and of the whole model's routed experts.
uint64_t bytes_per_expert(const ModelSpec& spec);

// The popularity rank (0 = hottest) of every expert of every layer: [layer * n_experts + e].
std::vector<uint32_t> expert_ranks(const ModelSpec& spec);

// Where a generated file records those ranks: a u32 array, [block * n_experts + e].
inline constexpr const char* kExpertRankKey = "moecache.mkmodel.expert_rank";
// The ranks a generated model records, read back from its first part and checked against its map
// (block_count x expert_count values inside the file, each below expert_count); std::nullopt for a
// model without the key (not made by moecache-mkmodel).
Result<std::optional<std::vector<uint32_t>>> read_expert_ranks(const GgufFile& head, const ExpertMap& map);

// Fills a writer with the whole model. Nothing is generated until the writer writes.
Result<void> build_model(const ModelSpec& spec, GgufWriter& w);

}  // namespace moecache::mkmodel
