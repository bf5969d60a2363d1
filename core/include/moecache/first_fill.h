// A VRAM pool's first fill ("one read, one place": docs/policy.md): while every pool of a model
// fills for the first time, what it was directed to hold is read from the model file into VRAM, not
// through a lock in RAM. The daemon (Daemon::bind_promoted) and the hook (Engine's fill) end it by
// the same rule: once nine in ten of what the pool was directed to hold are pooled (the direction
// itself of the pool's size, each side by its own count of that), or after kFirstFillBound
// whatever it holds (a pool that shrank, sizes the mean expert misjudged).
#pragma once

#include <chrono>
#include <cstdint>

namespace moecache {

inline constexpr std::chrono::seconds kFirstFillBound{120};

// Nine in ten of the `promoted` experts a pool was directed to hold are `held` by it.
[[nodiscard]] constexpr bool first_fill_held(uint64_t held, uint64_t promoted) {
    return promoted > 0 && 10 * held >= 9 * promoted;
}

}  // namespace moecache
