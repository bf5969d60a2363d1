// Where the daemon holds a slot (an expert or a model's dense part): only in storage (the page
// cache may hold some of it), being read for a lock, or locked in RAM. The transitions are
// ModelResidency's (model_residency.h); decide.h reads tiers as facts.
#pragma once

#include <cstdint>

namespace moecache::daemon {

enum class Tier : uint8_t { Storage, Fetching, Locked };
const char* to_string(Tier t);

}  // namespace moecache::daemon
