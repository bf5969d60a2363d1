#include "moecache/backend/row_split.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

namespace moecache::backend {

Result<RowSplit> split_rows(const char* ids, size_t nb0, size_t nb1, int64_t n_used, int64_t n_tokens,
                            int64_t n_expert, int64_t n_slots, const std::function<int32_t(int32_t)>& slot_of) {
    if (n_used <= 0 || n_tokens < 0 || n_expert <= 0) {
        return failf("MUL_MAT_ID with {} experts a token of {} and {} tokens: nothing to split", n_used, n_expert,
                     n_tokens);
    }
    RowSplit s;
    s.n_used = n_used;
    s.n_tokens = n_tokens;
    const auto rows = static_cast<size_t>(n_used * n_tokens);
    s.experts.assign(rows, -1);
    s.cpu_ids.assign(rows, -1);
    s.pooled.assign(rows, 0);
    std::unordered_set<int32_t> seen_pool, seen_cpu;
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t k = 0; k < n_used; ++k) {
            int32_t e;
            std::memcpy(&e, ids + k * nb0 + t * nb1, sizeof e);
            if (e < 0 || e >= n_expert) {
                return failf("MUL_MAT_ID row (expert {} of token {}) names expert {} of a tensor of {}", k, t, e,
                             n_expert);
            }
            const auto r = static_cast<size_t>(t * n_used + k);
            s.experts[r] = e;
            const int32_t slot = slot_of(e);
            if (slot >= n_slots) return failf("expert {} is said to be in slot {} of a pool of {}", e, slot, n_slots);
            if (slot >= 0) {
                s.pooled[r] = 1;
                ++s.pool_rows;
                if (seen_pool.insert(e).second) s.pool_experts.push_back(e);
            } else {
                s.cpu_ids[r] = e;
                ++s.cpu_rows;
                if (seen_cpu.insert(e).second) s.cpu_experts.push_back(e);
            }
        }
    }
    // The CPU's fillers (the header's rule; the pool's are pool_slot_ids'); a half with no rows of
    // its own is not computed at all, its ids are left as they are.
    const int32_t cpu_filler = s.cpu_rows ? s.cpu_experts.front() : -1;
    for (size_t r = 0; r < rows; ++r)
        if (s.pooled[r]) s.cpu_ids[r] = cpu_filler;
    return s;
}

Result<std::vector<int32_t>> pool_slot_ids(const RowSplit& split, const std::function<int32_t(int32_t)>& slot_of,
                                           int64_t n_slots) {
    const int64_t used = split.n_used;
    if (n_slots < used) return failf("a pool of {} slots cannot give {} distinct ones a token", n_slots, used);
    std::vector<int32_t> v(split.experts.size(), -1);
    std::vector<int32_t> read;  // the batch's pooled slots, in first-use order
    std::unordered_set<int32_t> seen;
    for (size_t r = 0; r < v.size(); ++r) {
        if (!split.pooled[r]) continue;
        const int32_t slot = slot_of(split.experts[r]);
        if (slot < 0 || slot >= n_slots) {
            return failf("pooled expert {} (row {} of token {}) is in slot {} of a pool of {}", split.experts[r],
                         static_cast<int64_t>(r) % used, static_cast<int64_t>(r) / used, slot, n_slots);
        }
        v[r] = slot;
        if (seen.insert(slot).second) read.push_back(slot);
    }
    std::vector<int32_t> taken;  // the token's slots so far
    for (int64_t t = 0; t < split.n_tokens; ++t) {
        const auto row0 = static_cast<size_t>(t * used);
        taken.clear();
        for (int64_t k = 0; k < used; ++k)
            if (split.pooled[row0 + k]) taken.push_back(v[row0 + k]);
        const auto free_slot = [&](int32_t c) { return std::find(taken.begin(), taken.end(), c) == taken.end(); };
        size_t next_read = 0;
        int32_t next_any = 0;
        for (int64_t k = 0; k < used; ++k) {
            if (split.pooled[row0 + k]) continue;
            int32_t c = -1;
            while (next_read < read.size() && c < 0) {
                if (free_slot(read[next_read])) c = read[next_read];
                ++next_read;
            }
            while (c < 0) {  // n_slots >= used: one is free
                if (free_slot(next_any)) c = next_any;
                ++next_any;
            }
            v[row0 + k] = c;
            taken.push_back(c);
        }
    }
    return v;
}

void join_rows(const RowSplit& split, Rows dst, ConstRows pool_out, size_t row_bytes) {
    for (int64_t t = 0; t < split.n_tokens; ++t) {
        for (int64_t k = 0; k < split.n_used; ++k) {
            if (!split.pooled[static_cast<size_t>(t * split.n_used + k)]) continue;
            std::memcpy(dst.base + k * dst.nb1 + t * dst.nb2, pool_out.base + k * pool_out.nb1 + t * pool_out.nb2,
                        row_bytes);
        }
    }
}

}  // namespace moecache::backend
