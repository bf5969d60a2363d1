// How one MUL_MAT_ID's routed rows divide between the experts a device pool holds and the rest.
//
// A row is one (k, t) of the router's ids [n_used][n_tokens]: token t's k-th expert. The pool's
// half computes the rows whose expert is pooled, with ids that name pool slots; the CPU's half the
// others, with ids that name experts of the weight tensor in the mapping. ggml's MUL_MAT_ID
// computes every row it is given, so each half names, for the rows that are not its own, a filler.
// The CPU's filler is an expert it reads anyway (ggml-cpu takes an expert any number of times in a
// token). The pool's fillers cannot be: CUDA's MUL_MAT_ID for more than a few tokens sorts the
// rows by expert and takes each expert at most once a token (a router never repeats one), and a
// repeated one leaves rows unmapped (an illegal memory access on the H100). So a token's pool
// fillers are slots that token does not use, distinct from each other: slots the batch's other
// tokens read first, then others. The join keeps each row from its own half. No ggml here: CI tests
// every rule as it is.
#pragma once

#include "moecache/error.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace moecache::backend {

struct RowSplit {
    int64_t n_used = 0, n_tokens = 0;
    std::vector<int32_t> experts;   // [n_tokens][n_used], dense: the ids as given
    std::vector<int32_t> cpu_ids;   // [n_tokens][n_used], dense: experts
    std::vector<uint8_t> pooled;    // [n_tokens][n_used]: whether the row is the pool's
    uint32_t pool_rows = 0, cpu_rows = 0;
    // The distinct experts of each half, in first-use order (what each half reads).
    std::vector<int32_t> pool_experts, cpu_experts;
};

// `ids` as ggml lays out an I32 tensor [n_used, n_tokens]: element (k, t) at ids + k*nb0 + t*nb1
// (llama.cpp's ids are a view of its argsort: nb1 is the full row). slot_of(expert): its pool slot,
// or -1. An id outside [0, n_expert) or a slot outside [0, n_slots) is an error naming the row.
Result<RowSplit> split_rows(const char* ids, size_t nb0, size_t nb1, int64_t n_used, int64_t n_tokens,
                            int64_t n_expert, int64_t n_slots, const std::function<int32_t(int32_t)>& slot_of);

// The pool half's ids for one weight tensor, dense [n_tokens][n_used]: a pooled row's slot_of(its
// expert), every other row a filler by the rule above; no slot twice in a token. An error where
// a pooled expert has no slot in [0, n_slots) or the pool has fewer slots than a token has rows.
Result<std::vector<int32_t>> pool_slot_ids(const RowSplit& split, const std::function<int32_t(int32_t)>& slot_of,
                                           int64_t n_slots);

// A tensor's rows as a strided view: row (k, t) at base + k*nb1 + t*nb2, `row_bytes` long.
struct Rows {
    char* base = nullptr;
    size_t nb1 = 0, nb2 = 0;
};
struct ConstRows {
    const char* base = nullptr;
    size_t nb1 = 0, nb2 = 0;
};

// Copies the pool's rows of `pool_out` over `dst` (which holds the CPU half's output).
void join_rows(const RowSplit& split, Rows dst, ConstRows pool_out, size_t row_bytes);

}  // namespace moecache::backend
