// The lines of a router trace (docs/trace.md), written the same way by every writer: the daemon
// (moecachectl trace), the client runtime (MOECACHE_TRACE) and moecache-tracegen.
#pragma once

#include "moecache/model.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moecache::trace {

// {"moecache_trace":1,"tick_seconds":T}
std::string header_line(double tick_seconds);

struct ModelLine {
    uint32_t id = 0;
    std::string key;
    std::string path;
    uint32_t n_experts = 0;
    std::vector<uint32_t> blocks;            // MoE blocks in layer order
    std::vector<uint64_t> bytes_per_expert;  // per layer
};
// The description of a model, from its expert map (key: its profile key).
ModelLine model_of(uint32_t id, const ExpertMap& map, const std::string& path);
// {"model":ID,"key":...,"path":...,"n_experts":N,"blocks":[...],"bytes_per_expert":[...]}; bytes
// of the key and path that are not UTF-8 become U+FFFD.
std::string model_line(const ModelLine& m);

// {"t":T,"m":M,"b":B,"n":N,"e":[...]}, appended to `out`.
void append_decision(std::string& out, uint64_t t_us, uint32_t model, uint32_t block, uint32_t tokens,
                     std::span<const uint32_t> experts);

}  // namespace moecache::trace
