// The hook's own memory of a model's hot experts, for a runtime that runs without moecached: saved
// when the process ends (and now and then while it runs), read when the next process maps the same
// model, so that its VRAM pool starts from the experts the last run's decode used most instead of
// learning them again one miss at a time. (With a daemon, its heat profile directs the pool.)
//
// One small text file per model, in a folder of the user's (MOECACHE_CUDA_PROFILE, by default
// $XDG_CACHE_HOME/moecache/hook or ~/.cache/moecache/hook), named by the model's content (its size
// and the first MiB, where GGUF keeps its metadata and tensor table): a copy of the model elsewhere,
// or an ollama blob, finds it; another quantization does not.
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moecache::cuda {

struct HotProfile {
    uint32_t n_layers = 0, n_experts = 0;  // the model's expert layers and experts per layer
    std::vector<uint32_t> counts;          // [layer * n_experts + expert]: how often decode routed to it, decayed
    uint64_t routings = 0;                 // the routings the counts came from (over every run)
};

inline constexpr uint32_t kMaxProfileLayers = 1024, kMaxProfileExperts = 8192;
// The heat a profile's hottest expert starts a run at (profile_heat's `top`): a few hundred tokens
// of the run's own routing move the ranking where it routes otherwise.
inline constexpr uint32_t kProfilePriorTop = 64;
// A profile is saved again once a run has routed this many tokens' worth since the last save.
inline constexpr uint64_t kProfileTokens = 32;
inline constexpr uint64_t kMaxProfileBytes = 8ull << 20;

// The file name of a model's profile: what identifies its content. Reads the first MiB of the file.
Result<std::string> hot_profile_name(const std::string& model_path);
// The folder profiles live in from the hook's settings: `setting` is MOECACHE_CUDA_PROFILE (null or
// empty: the default), "" when profiles are off or there is no home to keep them in.
std::string hot_profile_dir(const char* setting, const char* xdg_cache_home, const char* home);

std::string format_hot_profile(const HotProfile& p);
// Refuses anything that is not a profile of exactly this shape, naming what and where (line).
Result<HotProfile> parse_hot_profile(const std::string& text, uint32_t n_layers, uint32_t n_experts);
Result<HotProfile> load_hot_profile(const std::string& path, uint32_t n_layers, uint32_t n_experts);
// Written whole and renamed into place (readers never see a part), the folder made 0700 if missing.
Result<void> save_hot_profile(const std::string& path, const HotProfile& p);

// The counts as a pool's heat: the ranking kept, the hottest at `top` (so that what this run routes
// moves it within a few hundred tokens), every expert that was routed at all at least 1.
std::vector<uint32_t> profile_heat(const HotProfile& p, uint32_t top);

}  // namespace moecache::cuda
