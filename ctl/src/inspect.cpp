#include "moecache/ctl/inspect.h"

#include "moecache/page_cache.h"
#include "moecache/text.h"

#include <fmt/format.h>

namespace moecache::ctl {

std::string format_bytes(uint64_t bytes) { return human_bytes(bytes); }

Result<InspectReport> inspect_model(const std::string& path) {
    InspectReport r;
    r.map = MC_TRY(load_expert_map(path));
    std::vector<PageCacheProbe> probes;
    for (const auto& f : r.map.files) probes.push_back(MC_TRY(PageCacheProbe::open(f.path)));
    r.residency_method = probes.empty() ? "none" : to_string(probes.front().method());
    for (const auto& layer : r.map.layers) {
        uint64_t resident = 0;
        for (const auto& t : layer.tensors)
            resident += MC_TRY(probes[t.file].resident_bytes(t.offset, t.bytes_per_expert * r.map.n_experts));
        r.layer_resident_bytes.push_back(resident);
    }
    return r;
}

nlohmann::json inspect_json(const InspectReport& r) {
    const auto& m = r.map;
    nlohmann::json j;
    j["schema_version"] = 1;
    j["architecture"] = m.architecture;
    j["name"] = m.name;
    j["files"] = nlohmann::json::array();
    for (const auto& f : m.files) j["files"].push_back(f.path);
    j["file_bytes"] = nlohmann::json::array();
    for (const auto& f : m.files) j["file_bytes"].push_back(f.size);
    j["n_blocks"] = m.n_blocks;
    j["n_layers"] = m.layers.size();
    j["n_leading_dense"] = m.n_leading_dense;
    j["n_experts"] = m.n_experts;
    j["n_experts_used"] = m.n_experts_used;
    j["n_experts_shared"] = m.n_experts_shared;
    j["expert_bytes_total"] = m.expert_bytes_total;
    j["shared_expert_bytes_total"] = m.shared_expert_bytes_total;
    j["dense_bytes_total"] = m.dense_bytes_total;
    j["header_bytes_total"] = m.header_bytes_total;
    // Tensors of ggml types this build does not know: counted in dense_bytes_total.
    j["unknown_type_tensors"] = nlohmann::json::array();
    for (const auto& u : m.unknown_type_tensors)
        j["unknown_type_tensors"].push_back({{"name", u.name},
                                             {"file", m.files[u.file].path},
                                             {"type_id", u.type_id},
                                             {"bytes", u.bytes},
                                             {"routed_expert", u.expert}});
    j["residency_method"] = r.residency_method;
    uint64_t resident_total = 0;
    j["layers"] = nlohmann::json::array();
    for (size_t i = 0; i < m.layers.size(); ++i) {
        const auto& l = m.layers[i];
        nlohmann::json lj;
        lj["index"] = l.index;
        lj["bytes_per_expert"] = l.bytes_per_expert;
        lj["expert_bytes"] = l.expert_bytes(m.n_experts);
        lj["shared_expert_bytes"] = l.shared_expert_bytes;
        lj["resident_bytes"] = r.layer_resident_bytes[i];
        resident_total += r.layer_resident_bytes[i];
        lj["tensors"] = nlohmann::json::array();
        for (const auto& t : l.tensors)
            lj["tensors"].push_back({{"name", t.name},
                                     {"file", m.files[t.file].path},
                                     {"file_index", t.file},
                                     {"type", std::string(t.type.name)},
                                     {"offset", t.offset},
                                     {"bytes_per_expert", t.bytes_per_expert}});
        j["layers"].push_back(std::move(lj));
    }
    j["expert_resident_bytes_total"] = resident_total;
    return j;
}

std::string inspect_table(const InspectReport& r) {
    const auto& m = r.map;
    std::string out;
    auto line = [&](std::string_view label, const std::string& value) {
        out += fmt::format("{:<18}{}\n", label, value);
    };
    uint64_t file_total = 0;
    for (const auto& f : m.files) file_total += f.size;
    line("architecture", m.name.empty() ? m.architecture : fmt::format("{} ({})", m.architecture, m.name));
    line("files", fmt::format("{}, {} in all", m.files.size(), format_bytes(file_total)));
    for (const auto& f : m.files) line("", f.path);
    if (m.layers.empty()) {
        line("experts", "none: this is not a Mixture-of-Experts model");
        return out;
    }
    line("MoE layers", fmt::format("{} of {} blocks ({} leading dense)", m.layers.size(), m.n_blocks,
                                   m.n_leading_dense));
    line("experts", fmt::format("{} per layer, {} used per token{}", m.n_experts, m.n_experts_used,
                                m.n_experts_shared ? fmt::format(", {} shared", m.n_experts_shared) : ""));
    const uint64_t per = m.layers.front().bytes_per_expert;
    const bool uniform = std::all_of(m.layers.begin(), m.layers.end(),
                                     [&](const MoeLayer& l) { return l.bytes_per_expert == per; });
    line("bytes per expert", uniform ? format_bytes(per) : "varies by layer (see below)");
    auto pct = [&](uint64_t b) { return file_total ? 100.0 * static_cast<double>(b) / static_cast<double>(file_total) : 0.0; };
    line("routed experts", fmt::format("{} ({:.1f} % of the files)", format_bytes(m.expert_bytes_total), pct(m.expert_bytes_total)));
    line("shared experts", fmt::format("{} ({:.1f} %)", format_bytes(m.shared_expert_bytes_total), pct(m.shared_expert_bytes_total)));
    line("everything else", fmt::format("{} ({:.1f} %: dense tensors {}, headers {})",
                                        format_bytes(m.dense_bytes_total + m.header_bytes_total),
                                        pct(m.dense_bytes_total + m.header_bytes_total),
                                        format_bytes(m.dense_bytes_total), format_bytes(m.header_bytes_total)));
    if (!m.unknown_type_tensors.empty()) {
        uint64_t bytes = 0;
        size_t experts = 0;
        for (const auto& u : m.unknown_type_tensors) {
            bytes += u.bytes;
            experts += u.expert ? 1 : 0;
        }
        line("unknown types", fmt::format("{} tensors, {} ({} of routed experts, counted as dense): ggml types this "
                                          "build does not know, such as {} of '{}'",
                                          m.unknown_type_tensors.size(), format_bytes(bytes), experts,
                                          m.unknown_type_tensors.front().type_id, m.unknown_type_tensors.front().name));
    }
    out += fmt::format("\n{:>6}  {:>12}  {:>12}  {:>12}  {:>7}   page cache by {}\n", "layer", "per expert",
                       "experts", "resident", "cached", r.residency_method);
    uint64_t resident_total = 0;
    for (size_t i = 0; i < m.layers.size(); ++i) {
        const auto& l = m.layers[i];
        const uint64_t total = l.expert_bytes(m.n_experts);
        resident_total += r.layer_resident_bytes[i];
        out += fmt::format("{:>6}  {:>12}  {:>12}  {:>12}  {:>6.1f}%\n", l.index, format_bytes(l.bytes_per_expert),
                           format_bytes(total), format_bytes(r.layer_resident_bytes[i]),
                           total ? 100.0 * static_cast<double>(r.layer_resident_bytes[i]) / static_cast<double>(total) : 0.0);
    }
    out += fmt::format("{:>6}  {:>12}  {:>12}  {:>12}  {:>6.1f}%\n", "all", "", format_bytes(m.expert_bytes_total),
                       format_bytes(resident_total),
                       m.expert_bytes_total ? 100.0 * static_cast<double>(resident_total) / static_cast<double>(m.expert_bytes_total) : 0.0);
    return out;
}

}  // namespace moecache::ctl
