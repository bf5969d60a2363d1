#include "moecache/daemon/helping.h"

#include "moecache/file_util.h"
#include "moecache/text.h"

#include <fmt/format.h>

namespace moecache::daemon {
namespace {

// A line as shown: valid UTF-8 (printable_utf8) and no control characters (a model's name or a
// client's may hold a newline, which would split a reason in two on /status and in moecachectl).
std::string one_line(std::string_view text) {
    std::string out;
    for (char c : printable_utf8(text)) {
        const auto u = static_cast<unsigned char>(c);
        if (u < 0x20 || u == 0x7f)
            out += fmt::format("\\x{:02x}", u);
        else
            out += c;
    }
    return out;
}

std::string share(uint64_t part, uint64_t whole) {
    return whole == 0 ? "-" : fmt::format("{:.1f} %", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

// A routed expert read from storage in more than this share of decode routings: moecache keeps too
// little of the model close to help much (a budget, or a model larger than what it may hold).
constexpr double kMostlyFromStorage = 0.5;

}  // namespace

const char* to_string(ModelVerdict::Kind k) {
    switch (k) {
        case ModelVerdict::Kind::Helping:
            return "helping";
        case ModelVerdict::Kind::Idle:
            return "idle";
        case ModelVerdict::Kind::Blind:
            return "blind";
        case ModelVerdict::Kind::CannotHelp:
            return "cannot help";
    }
    return "?";
}

ModelVerdict model_verdict(const DaemonStatus& s, const ModelStatus& m) {
    const std::string& name = m.name.empty() ? base_name(m.path) : m.name;
    ModelVerdict v;
    const auto say = [&](ModelVerdict::Kind kind, const std::string& what) {
        v.kind = kind;
        v.line = one_line(fmt::format("{}: {}: {}", name, to_string(kind), what));
        return v;
    };
    if (!m.loaded)
        return m.opening ? say(ModelVerdict::Kind::Idle, "its header is being read")
                         : say(ModelVerdict::Kind::CannotHelp,
                               fmt::format("not loaded: {}", m.error.empty() ? "(no reason logged)" : m.error));
    const uint64_t read = m.read_bytes, tokens = m.outcome.decode_tokens + m.outcome.prompt_tokens;
    // Helping, or not where most experts came from storage: what the daemon may lock against them.
    const auto judged = [&](const std::string& figures, uint64_t from_storage, uint64_t all) {
        if (static_cast<double>(from_storage) <= kMostlyFromStorage * static_cast<double>(all))
            return say(ModelVerdict::Kind::Helping, figures);
        const uint64_t budget = m.budget_bytes ? std::min(m.budget_bytes, s.lock_cap) : s.lock_cap;
        return say(
            ModelVerdict::Kind::CannotHelp,
            fmt::format("{}: most experts came from storage; the daemon may lock {} now against its {} of experts{}",
                        figures, human_bytes(budget), human_bytes(m.expert_bytes),
                        s.under_pressure ? ", and memory pressure holds the locks down"
                                         : " (raise [budget] lock, or give it more RAM)"));
    };
    if (!m.routing_reported) {
        const uint64_t touched = m.outcome.touched.total();
        if (touched > 0)
            return judged(fmt::format("seen through the page cache (no runtime reports its routing; a CPU runtime's "
                                      "re-armed faults): of the experts runtimes touched {} were in RAM, {} read from "
                                      "storage; runtimes read {} from storage in all",
                                      share(m.outcome.touched[Reach::Ram], touched),
                                      share(m.outcome.touched[Reach::Storage], touched), human_bytes(read)),
                          m.outcome.touched[Reach::Storage], touched);
        if (read == 0 && m.expert_telemetry.faults == 0)
            return say(ModelVerdict::Kind::Idle, "no runtime has used it since the daemon opened it");
        return say(
            ModelVerdict::Kind::Blind,
            fmt::format("no runtime reports its routing, so the daemon sees only the page cache{} (runtimes read "
                        "{} of it from storage so far): preload libmoecache-cuda.so (GPU, -ot exps=CPU), "
                        "load libmoecache-ggml.so, or preload libmoecache-rearm.so (CPU) into the runtime",
                        s.page_cache.enabled ? "" : ", and its telemetry is off", human_bytes(read)));
    }
    const uint64_t all = m.outcome.routed.total();
    if (m.outcome.decode_tokens == 0 || all == 0)
        return say(ModelVerdict::Kind::Idle,
                   fmt::format("prompts only so far ({} tokens); runtimes read {} from storage",
                               m.outcome.prompt_tokens, human_bytes(read)));
    return judged(fmt::format("decode ({} tokens): of the experts routed {} were in VRAM, {} in RAM, {} on storage; "
                              "runtimes read {} a token from storage ({} in all)",
                              m.outcome.decode_tokens, share(m.outcome.routed[Reach::Vram], all),
                              share(m.outcome.routed[Reach::Ram], all), share(m.outcome.routed[Reach::Storage], all),
                              human_bytes(tokens ? read / tokens : 0), human_bytes(read)),
                  m.outcome.routed[Reach::Storage], all);
}

std::vector<std::string> helping_report(const DaemonStatus& s) {
    std::vector<std::string> out;
    for (const auto& m : s.models) out.push_back(model_verdict(s, m).line);
    for (const auto& p : s.vram_pools) {
        const uint64_t copies = p.hits + p.misses;
        if (copies == 0) continue;
        out.push_back(
            fmt::format("GPU {}: the VRAM pools ({} held now) served {} of the expert copies, {} that did not cross "
                        "from host memory; {} did",
                        p.device, human_bytes(p.pool_bytes), share(p.hits, copies), human_bytes(p.hit_bytes),
                        human_bytes(p.miss_bytes)));
    }
    for (const auto& c : s.clients)
        for (const auto& [device, path] : c.miss_paths)
            if (!protocol::is_fast(path))
                out.push_back(
                    one_line(fmt::format("{} (pid {}) GPU {}: slower than it could be: {}. {}.", c.name, c.pid, device,
                                         protocol::reason_of(path), protocol::advice_for(path))));
    for (const auto& c : s.clients)
        if (!c.command_line_problem.empty())
            out.push_back(one_line(fmt::format("{} (pid {}): {}", c.name, c.pid, c.command_line_problem)));
    if (s.clients_without_model > 0)
        out.push_back(
            fmt::format("{} runtime(s) copy model-sized buffers to the GPU from memory that maps no model "
                        "(--load-mode none, --no-mmap, or ollama's own choice): moecache cannot see their "
                        "experts; load with mmap (LLAMA_ARG_LOAD_MODE=mmap)",
                        s.clients_without_model));
    if (s.under_pressure) out.emplace_back("memory pressure: the daemon holds its locks down until it passes");
    return out;
}

}  // namespace moecache::daemon
