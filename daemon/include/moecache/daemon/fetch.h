// Why the daemon reads an expert from storage, and how soon: one typed reason per read instead of
// priorities and flags chosen at each call site.
#pragma once

#include <cstdint>
#include <limits>

namespace moecache::daemon {

// Sooner first: a runtime waiting on a miss, what the next token was predicted to use, what the
// plan locks, the next tier of a warm start (a loaded profile), an operator's prefetch.
enum class FetchReason : uint8_t { Miss, Prediction, Plan, WarmStart, Operator };

// Read to be locked (the plan), or only into the page cache (everything else).
[[nodiscard]] constexpr bool cache_only(FetchReason r) { return r != FetchReason::Plan; }

// The prefetch queue's priority (lower is sooner): each reason has its band, `order` keeps the
// caller's order inside it (misses and predictions are served in arrival order: one priority).
[[nodiscard]] constexpr int32_t fetch_priority(FetchReason r, uint32_t order = 0) {
    constexpr uint32_t kBand = 1u << 19;
    const auto within = static_cast<int32_t>(order < kBand - 1 ? order : kBand - 1);
    switch (r) {
        case FetchReason::Miss: return std::numeric_limits<int32_t>::min();
        case FetchReason::Prediction: return -(1 << 20);
        case FetchReason::Plan: return within;
        case FetchReason::WarmStart: return (1 << 19) + within;
        case FetchReason::Operator: return (1 << 20) + within;
    }
    return within;
}

// A prefetch request's tag: model id, slot (kDenseSlot included), and whether it is read to stay
// cached only (every reason but the plan's) rather than to be locked.
inline uint64_t fetch_tag(uint32_t model, uint32_t slot, bool cache_only = false) {
    return (uint64_t{model} << 32) | slot | (cache_only ? uint64_t{1} << 63 : 0);
}
inline uint64_t fetch_tag(uint32_t model, uint32_t slot, FetchReason r) {
    return fetch_tag(model, slot, cache_only(r));
}
inline uint32_t fetch_tag_model(uint64_t tag) { return static_cast<uint32_t>((tag >> 32) & 0x7fffffffu); }

}  // namespace moecache::daemon
