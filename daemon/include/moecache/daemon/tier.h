// Where the daemon holds a slot (an expert or a model's dense part): only in storage (the page
// cache may hold some of it), being read for a lock, or locked in RAM. The transitions are
// ModelResidency's (model_residency.h); decide.h reads tiers as facts.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moecache::daemon {

enum class Tier : uint8_t { Storage, Fetching, Locked };
const char* to_string(Tier t);

// Where an expert is, in the one vocabulary every reader uses (/metrics, D-Bus, moecachectl): in
// storage only ("ssd": the page cache may hold some of it), being read in ("fetching"), locked in
// RAM ("ram"), in a CUDA hook's VRAM pool ("vram"), or in a pool and locked in RAM as well
// ("vram+ram": [vram] keep_ram_copy, or pinned).
enum class Placement : uint8_t { Storage, Fetching, Ram, Vram, VramAndRam };
[[nodiscard]] Placement placement(Tier tier, uint32_t vram_holders);
const char* to_string(Placement p);

// Where a routed expert was when its runtime's routing report came, as the runtime reaches it: in
// a VRAM pool, in RAM (locked, or cached nine tenths or more at the daemon's last look), or neither
// (the runtime reads it from storage). The tiers "is it helping" counts (`moecachectl status`).
enum class Reach : uint8_t { Vram, Ram, Storage };
[[nodiscard]] Reach reach(Tier tier, uint32_t vram_holders, uint64_t cached_bytes, uint64_t bytes);
const char* to_string(Reach r);

// What a model's runtime routed, counted as reports arrive (Intake): its tokens, and each decode
// token's experts by where they were. Counts since the daemon opened the model.
// Counts by Reach (indexed by the Reach or its value), and their total.
struct ByReach {
    uint64_t n[3] = {};
    uint64_t& operator[](Reach r) { return n[static_cast<size_t>(r)]; }
    uint64_t operator[](Reach r) const { return n[static_cast<size_t>(r)]; }
    uint64_t& operator[](size_t i) { return n[i]; }
    uint64_t operator[](size_t i) const { return n[i]; }
    [[nodiscard]] uint64_t total() const { return n[0] + n[1] + n[2]; }
};

struct RoutingOutcome {
    uint64_t decode_tokens = 0, prompt_tokens = 0;
    ByReach routed;  // decode routings
    // Where no runtime reports routing (a CPU runtime with the re-arm preload), the page cache's
    // view: experts runtimes touched (a fault or a read, once a batch; Ram: the pages were there,
    // Storage: read from storage).
    ByReach touched;
};

}  // namespace moecache::daemon
