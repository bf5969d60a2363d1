// Where the daemon holds a slot (an expert or a model's dense part): only in storage (the page
// cache may hold some of it), being read for a lock, or locked in RAM. The transitions are
// ModelResidency's (model_residency.h); decide.h reads tiers as facts.
#pragma once

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

}  // namespace moecache::daemon
