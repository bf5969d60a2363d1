#include "moecache/sim/trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>

namespace moecache::sim {
namespace {

using nlohmann::json;

constexpr uint32_t kMaxExperts = 1u << 20;
constexpr size_t kMaxLayers = 1u << 16;
constexpr uint64_t kMaxSlots = uint64_t{1} << 22;         // experts in all layers: replay keeps state per expert
constexpr uint64_t kMaxExpertBytes = uint64_t{1} << 40;  // one expert; sums of them stay far from overflow

// An unsigned number no larger than `max`, or a message.
template <typename T>
bool get_uint(const json& j, const char* key, T& out, std::string& why, uint64_t max = std::numeric_limits<T>::max()) {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_number_unsigned() || it->get<uint64_t>() > max) {
        why = fmt::format("\"{}\" must be a whole number 0..{}", key, max);
        return false;
    }
    out = static_cast<T>(it->get<uint64_t>());
    return true;
}

Result<TraceModel> parse_model(const json& j) {
    TraceModel m;
    std::string why;
    if (!get_uint(j, "model", m.id, why) || !get_uint(j, "n_experts", m.n_experts, why, kMaxExperts)) return failf("{}", why);
    if (m.n_experts == 0) return failf("\"n_experts\" must be at least 1");
    if (j.contains("key") && j["key"].is_string()) m.key = j["key"].get<std::string>();
    if (j.contains("path") && j["path"].is_string()) m.path = j["path"].get<std::string>();
    const auto blocks = j.find("blocks"), bytes = j.find("bytes_per_expert");
    if (blocks == j.end() || !blocks->is_array() || blocks->empty() || blocks->size() > kMaxLayers)
        return failf("\"blocks\" must be a list of 1..{} block numbers", kMaxLayers);
    if (bytes == j.end() || !bytes->is_array() || bytes->size() != blocks->size())
        return failf("\"bytes_per_expert\" must be a list as long as \"blocks\"");
    for (const auto& b : *blocks) {
        if (!b.is_number_unsigned() || b.get<uint64_t>() > std::numeric_limits<uint32_t>::max())
            return failf("\"blocks\" must hold block numbers");
        m.blocks.push_back(b.get<uint32_t>());
    }
    if (uint64_t{m.n_experts} * blocks->size() > kMaxSlots)
        return failf("{} blocks x {} experts is more than the {} experts a model may have", blocks->size(), m.n_experts,
                     kMaxSlots);
    for (const auto& b : *bytes) {
        if (!b.is_number_unsigned() || b.get<uint64_t>() > kMaxExpertBytes)
            return failf("\"bytes_per_expert\" must hold byte counts up to {}", kMaxExpertBytes);
        m.bytes_per_expert.push_back(b.get<uint64_t>());
    }
    return m;
}

}  // namespace

const TraceModel* Trace::model(uint32_t id) const {
    for (const auto& m : models)
        if (m.id == id) return &m;
    return nullptr;
}

void Trace::add(TraceDecision d) {
    if (d.tokens == 0) {
        // The model's decision before it (other models' may come between: a few steps back at most).
        const size_t stop = decisions.size() > 64 ? decisions.size() - 64 : 0;
        for (size_t i = decisions.size(); i-- > stop;) {
            TraceDecision& b = decisions[i];
            if (b.model != d.model) continue;
            if (b.layer == d.layer && b.tokens > 1) {
                b.more.push_back(std::move(d.experts));
                return;
            }
            break;
        }
    }
    decisions.push_back(std::move(d));
}

Result<Trace> read_trace(const std::string& path) {
    std::ifstream f(path);
    if (!f) return fail_errno("trace {}: cannot open", path);
    Trace trace;
    std::string line;
    uint64_t n = 0;
    auto bad = [&](const std::string& what) { return failf("trace {}:{}: {}", path, n, what); };
    while (std::getline(f, line)) {
        ++n;
        if (line.empty()) continue;
        json j;
        try {
            j = json::parse(line);
        } catch (const json::exception& e) {
            return bad(fmt::format("not JSON ({})", e.what()));
        }
        if (!j.is_object()) return bad("not a JSON object");
        if (n == 1) {
            const auto v = j.find("moecache_trace");
            if (v == j.end() || !v->is_number_unsigned() || v->get<uint64_t>() != 1)
                return bad("not a moecache trace (the first line must be {\"moecache_trace\":1,...})");
            if (const auto t = j.find("tick_seconds"); t != j.end() && t->is_number()) trace.tick_seconds = t->get<double>();
            continue;
        }
        if (j.contains("model") && j.contains("n_experts")) {
            auto m = parse_model(j);
            if (!m) return bad("model: " + m.error().message);
            if (const TraceModel* old = trace.model(m->id)) {
                if (old->n_experts != m->n_experts || old->blocks != m->blocks)
                    return bad(fmt::format("model {} described again with another shape", m->id));
                continue;
            }
            trace.models.push_back(std::move(*m));
            continue;
        }
        TraceDecision d;
        std::string why;
        uint32_t block = 0;
        if (!get_uint(j, "t", d.t_us, why) || !get_uint(j, "m", d.model, why) || !get_uint(j, "b", block, why) ||
            !get_uint(j, "n", d.tokens, why))
            return bad("decision: " + why);
        const TraceModel* m = trace.model(d.model);
        if (!m) return bad(fmt::format("decision for model {}, which no line before described", d.model));
        const auto layer = std::find(m->blocks.begin(), m->blocks.end(), block);
        if (layer == m->blocks.end()) return bad(fmt::format("decision for block {}, not a MoE block of model {}", block, d.model));
        d.layer = static_cast<uint32_t>(layer - m->blocks.begin());
        const auto e = j.find("e");
        if (e == j.end() || !e->is_array() || e->size() > m->n_experts)
            return bad(fmt::format("decision: \"e\" must be a list of at most {} experts", m->n_experts));
        for (const auto& x : *e) {
            if (!x.is_number_unsigned() || x.get<uint64_t>() >= m->n_experts)
                return bad(fmt::format("decision: expert {} is not one of model {}'s {}", x.dump(), d.model, m->n_experts));
            d.experts.push_back(x.get<uint32_t>());
        }
        trace.add(std::move(d));
    }
    if (n == 0) return failf("trace {}: empty", path);
    if (f.bad()) return fail_errno("trace {}: reading line {}", path, n + 1);
    return trace;
}

}  // namespace moecache::sim
