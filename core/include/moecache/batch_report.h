// What a batch of more than a few tokens reports of its routing in one MoE layer, from how many of
// its tokens chose each expert (the CUDA hook reads llama.cpp's router ids back; moecache-tracegen
// counts its synthetic routing): the same decisions from both, so that what the sim replays is
// what the daemon hears.
//
// First, one decision with the batch's token count: the experts more of its tokens chose than an
// even share (the union would be nearly every expert of the layer: heat flat). Then decisions of
// 0 tokens ("more of the batch before": heat, not another routing), one for each level of
// kBatchLevels, each the experts that at least an even share times 2^level of its tokens chose.
// An expert's heat from a batch is so about the log of its count, from 1/8 of an even share to 8
// times it: the batch ranks the layer's experts, below its even share too (a pool's edge in decode
// lies there: the prompt-model swap's decode model is placed from its prompt model's batches), and
// however large, a batch adds at most 1 + 6 uses to an expert, and the daemon weighs each level at
// a quarter of a routing (HeatTable::kRankingWeight: at most 2.5 a batch against 1 a decoded
// token), so that prompts cannot bury the decode's heat by volume.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace moecache {

inline constexpr std::array<int, 6> kBatchLevels = {-3, -2, -1, 1, 2, 3};

// count[e]: how many of the batch's `tokens` tokens chose expert e, each token `used` experts.
// Calls emit(experts, tokens) for each decision, in order; a level no expert reaches is skipped,
// the first decision never is.
template <class Emit>
void batch_report(std::span<const uint32_t> count, uint64_t tokens, uint32_t used, std::vector<uint32_t>& scratch,
                  Emit&& emit) {
    const uint64_t ne = count.size();
    const uint64_t even = tokens * used;  // an even share, times ne
    scratch.clear();
    for (uint32_t e = 0; e < ne; ++e)
        if (uint64_t{count[e]} * ne > even) scratch.push_back(e);
    emit(scratch, static_cast<uint32_t>(tokens));
    for (int level : kBatchLevels) {
        scratch.clear();
        for (uint32_t e = 0; e < ne; ++e) {
            const uint64_t c = uint64_t{count[e]} * ne;
            if (count[e] != 0 && (level < 0 ? c << -level >= even : c >= even << level)) scratch.push_back(e);
        }
        if (!scratch.empty()) emit(scratch, uint32_t{0});
    }
}

}  // namespace moecache
