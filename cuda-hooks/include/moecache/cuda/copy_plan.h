// How a classified expert copy is served: split into pieces that come from the VRAM pool
// (device-to-device) and pieces that come from the host as the runtime asked (host-to-device),
// adjacent host pieces merged so that misses cost no more copies than the runtime's own. Pure
// arithmetic: the pool's answer per slice comes from the caller.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moecache::cuda {

struct CopyPiece {
    uint64_t offset = 0;        // into the copy (source and destination alike)
    uint64_t bytes = 0;
    uint64_t pool_address = 0;  // device address of the bytes in the pool; 0: copy from the host
};

// A copy of `n` whole slices of `slice_bytes` followed by `padding` bytes. pool(i) returns the
// device address of slice i in the pool, or 0; pool(n) is asked only when `padding_is_next_slice`
// (the padding is the head of the next slice of the same tensor). Writes at most `max` pieces in
// order and returns how many, or 0 when they would not fit.
template <class PoolFn>
size_t plan_copy(uint32_t n, uint64_t slice_bytes, uint64_t padding, bool padding_is_next_slice, PoolFn&& pool,
                 CopyPiece* out, size_t max) {
    size_t k = 0;
    auto put = [&](uint64_t offset, uint64_t bytes, uint64_t address) {
        if (bytes == 0) return true;
        if (address == 0 && k > 0 && out[k - 1].pool_address == 0 && out[k - 1].offset + out[k - 1].bytes == offset) {
            out[k - 1].bytes += bytes;
            return true;
        }
        if (k == max) return false;
        out[k++] = CopyPiece{offset, bytes, address};
        return true;
    };
    for (uint32_t i = 0; i < n; ++i)
        if (!put(uint64_t{i} * slice_bytes, slice_bytes, pool(i))) return 0;
    if (padding > 0) {
        const uint64_t address = padding_is_next_slice && padding <= slice_bytes ? pool(n) : 0;
        if (!put(uint64_t{n} * slice_bytes, padding, address)) return 0;
    }
    return k;
}

}  // namespace moecache::cuda
