// `moecachectl inspect`: what a GGUF model holds, where its experts lie, how much of each MoE
// layer is in the page cache now. The JSON form is a stable interface (docs/inspect-json.md).
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace moecache::ctl {

struct InspectReport {
    ExpertMap map;
    std::vector<uint64_t> layer_resident_bytes;  // parallel to map.layers
    std::string residency_method;                // "cachestat" or "mincore"
};

Result<InspectReport> inspect_model(const std::string& path);
nlohmann::json inspect_json(const InspectReport& r);
std::string inspect_table(const InspectReport& r);

// Human sizes: 1536 -> "1.5 KiB".
std::string format_bytes(uint64_t bytes);

}  // namespace moecache::ctl
