#include "moecache/daemon/tier.h"

namespace moecache::daemon {

const char* to_string(Tier t) {
    switch (t) {
        case Tier::Storage: return "ssd";
        case Tier::Fetching: return "fetching";
        case Tier::Locked: return "ram";
    }
    return "?";
}

Placement placement(Tier tier, uint32_t vram_holders) {
    if (vram_holders > 0) return tier == Tier::Locked ? Placement::VramAndRam : Placement::Vram;
    switch (tier) {
        case Tier::Storage: return Placement::Storage;
        case Tier::Fetching: return Placement::Fetching;
        case Tier::Locked: return Placement::Ram;
    }
    return Placement::Storage;
}

const char* to_string(Placement p) {
    switch (p) {
        case Placement::Storage: return "ssd";
        case Placement::Fetching: return "fetching";
        case Placement::Ram: return "ram";
        case Placement::Vram: return "vram";
        case Placement::VramAndRam: return "vram+ram";
    }
    return "?";
}

Reach reach(Tier tier, uint32_t vram_holders, uint64_t cached_bytes, uint64_t bytes) {
    if (vram_holders > 0) return Reach::Vram;
    if (tier == Tier::Locked || (bytes > 0 && 10 * cached_bytes >= 9 * bytes)) return Reach::Ram;
    return Reach::Storage;
}

const char* to_string(Reach r) {
    switch (r) {
        case Reach::Vram:
            return "vram";
        case Reach::Ram:
            return "ram";
        case Reach::Storage:
            return "ssd";
    }
    return "?";
}

}  // namespace moecache::daemon
