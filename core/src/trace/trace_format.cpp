#include "moecache/trace_format.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <iterator>

namespace moecache::trace {

std::string header_line(double tick_seconds) {
    return nlohmann::json{{"moecache_trace", 1}, {"tick_seconds", tick_seconds}}.dump() + "\n";
}

ModelLine model_of(uint32_t id, const ExpertMap& map, const std::string& path) {
    ModelLine m{id, map.profile_key(), path, map.n_experts, {}, {}};
    for (const auto& l : map.layers) {
        m.blocks.push_back(l.index);
        m.bytes_per_expert.push_back(l.bytes_per_expert);
    }
    return m;
}

std::string model_line(const ModelLine& m) {
    const nlohmann::json j{{"model", m.id},
                           {"key", m.key},
                           {"path", m.path},
                           {"n_experts", m.n_experts},
                           {"blocks", m.blocks},
                           {"bytes_per_expert", m.bytes_per_expert}};
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

void append_decision(std::string& out, uint64_t t_us, uint32_t model, uint32_t block, uint32_t tokens,
                     std::span<const uint32_t> experts) {
    fmt::format_to(std::back_inserter(out), "{{\"t\":{},\"m\":{},\"b\":{},\"n\":{},\"e\":[{}]}}\n", t_us, model, block,
                   tokens, fmt::join(experts, ","));
}

}  // namespace moecache::trace
