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

}  // namespace moecache::daemon
