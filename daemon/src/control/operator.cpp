// The operator's controls: what D-Bus (dbus/dbus_service.cpp) and tests call. Every argument is
// untrusted; a refusal names what is wrong. Runs on the loop's thread, like everything else.
#include "control/operator.h"
#include "bus/bus_link.h"
#include "clients/client_hub.h"
#include "moecache/daemon/decide_step.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/daemon/router_trace.h"
#include "moecache/file_util.h"
#include "moecache/log.h"
#include "moecache/trace_format.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

namespace moecache::daemon {
namespace {

constexpr size_t kMaxPathBytes = 4096;
constexpr size_t kMaxSpecs = 65536;

tl::unexpected<Error> invalid(std::string message) { return fail(EINVAL, std::move(message)); }

}  // namespace

Operator::Operator(Config& config, uint64_t mem_total, ModelRegistry& models, const ClientHub& hub, DecideStep& decide,
                   Prefetcher& prefetcher, BusLink& bus, RouterTrace& trace, ErrorLog& errors,
                   std::function<StatusView()> view)
    : config_(config),
      mem_total_(mem_total),
      models_(models),
      hub_(hub),
      decide_(decide),
      prefetcher_(prefetcher),
      bus_(bus),
      trace_(trace),
      errors_(errors),
      view_(std::move(view)) {}

DaemonStatus Operator::status(bool experts) const { return view_().daemon(experts); }

std::optional<ModelStatus> Operator::model_status(uint32_t id, bool experts) const {
    const ModelEntry* m = models_.find(id);
    if (m == nullptr) return std::nullopt;
    return view_().model(*m, experts);
}

std::vector<uint32_t> Operator::model_ids() const { return models_.ids(); }

Result<std::vector<uint32_t>> Operator::select_slots(const ModelEntry& m, std::span<const std::string> specs) const {
    if (!m.res) return fail(EBUSY, fmt::format("model {} is not loaded: {}", m.path, m.error));
    const auto& r = *m.res;
    std::vector<uint32_t> out;
    if (specs.empty()) {
        for (uint32_t s = 0; s < r.n_slots(); ++s) out.push_back(s);
        return out;
    }
    if (specs.size() > kMaxSpecs)
        return invalid(fmt::format("{} expert selections; at most {}", specs.size(), kMaxSpecs));
    std::vector<uint8_t> chosen(r.n_slots(), 0);
    for (const auto& text : specs) {
        if (text.size() > 64) return invalid(fmt::format("expert selection '{}...' is too long", text.substr(0, 16)));
        auto pin = parse_expert_pin(text);
        if (!pin) return invalid(fmt::format("expert selection: {}", pin.error().message));
        const auto layer = r.layer_of_block(pin->layer);
        if (!layer)
            return invalid(
                fmt::format("expert selection '{}': block {} of {} holds no routed experts", text, pin->layer, m.path));
        // Only "BLOCK" alone means every expert: a written expert or range past the last is an error,
        // whatever the number (4294967295 included).
        if (!pin->whole_layer && pin->last >= r.n_experts())
            return invalid(
                fmt::format("expert selection '{}': block {} has experts 0-{}", text, pin->layer, r.n_experts() - 1));
        const uint32_t last = std::min(pin->last, r.n_experts() - 1);
        for (uint32_t e = pin->first; e <= last; ++e) chosen[size_t{*layer} * r.n_experts() + e] = 1;
    }
    for (uint32_t s = 0; s < r.n_slots(); ++s)
        if (chosen[s]) out.push_back(s);
    return out;
}

Result<uint32_t> Operator::add_model(const std::string& given) {
    if (given.empty() || given.size() > kMaxPathBytes || given.find('\0') != std::string::npos || given[0] != '/')
        return invalid("a model is named by an absolute path (at most 4096 bytes)");
    if (given.find_first_of("*?[") != std::string::npos)
        return invalid(
            fmt::format("'{}': globs belong in the configuration ([[model]] path); register one file", given));
    // One name for one path ("//", "./", "x/../" go), and below one entry for one file, whatever
    // its names (a symlink, a hard link): a file managed twice would have its locks counted twice.
    const std::string path = std::filesystem::path(given).lexically_normal().string();
    for (const auto& m : models_.all())
        if (m->path == path) return fail(EEXIST, fmt::format("model {} is already managed (id {})", path, m->id));
    if (auto id = identity_of_path(path))
        for (const auto& m : models_.all())
            if (m->res)
                for (const auto& f : m->res->model().files())
                    if (f.identity.dev == id->dev && f.identity.ino == id->ino)
                        return fail(EEXIST, fmt::format("model {} is already managed as {} (id {}): the same file",
                                                        path, m->path, m->id));
    ModelConfig mc;
    mc.path = path;
    mc.where = "D-Bus RegisterModel";
    ModelEntry& m = models_.add(mc, path);
    m.operator_added = true;
    // Opened before the answer, within [prefetch] read_deadline (its header read off the loop).
    models_.open(m, nullptr, /*wait=*/true);
    const uint32_t id = m.id;
    if (!m.res) {
        std::string why = m.opening ? "its header is still being read" : m.error;
        models_.remove(id, "");
        return invalid(fmt::format("model {} cannot be managed: {}", path, why));
    }
    // A split model's other parts name the same set: the path as opened is its first part's.
    MC_LOG(LOG_INFO, "model {} registered by the operator (id {})", path, id);
    decide_.request();
    return id;
}

Result<void> Operator::remove_model(uint32_t id) {
    ModelEntry* found = models_.find(id);
    if (found == nullptr) return fail(ENOENT, fmt::format("no model with id {}", id));
    ModelEntry& m = *found;
    if (m.registered)
        return fail(EBUSY,
                    fmt::format("model {} was registered by a client (uid {}): it goes when its last client does",
                                m.path, m.owner_uid));
    const bool configured = std::any_of(config_.models.begin(), config_.models.end(),
                                        [&](const ModelConfig& mc) { return mc.path == m.config.path; });
    if (configured && !m.operator_added)
        return fail(EBUSY, fmt::format("model {} is configured ({}): remove it from the configuration and reload",
                                       m.path, m.config.where));
    const auto users = std::count_if(hub_.all().begin(), hub_.all().end(), [&](const auto& c) {
        return !c->dead && std::find(c->models.begin(), c->models.end(), id) != c->models.end();
    });
    if (users > 0)
        return fail(EBUSY,
                    fmt::format("model {} is in use by {} connected runtime(s): unregister it when they are done",
                                m.path, users));
    models_.remove(id, "unregistered by the operator");
    decide_.request();
    return {};
}

Result<void> Operator::set_budget(const std::string& name, const std::string& amount) {
    if (name != "lock" && name != "reserve")
        return invalid(fmt::format("budget '{}': the budgets are 'lock' and 'reserve'", name.substr(0, 64)));
    auto a = parse_byte_amount(amount);
    if (!a) return invalid(fmt::format("budget {} = '{}': {}", name, amount.substr(0, 64), a.error().message));
    Config next = config_;
    (name == "lock" ? next.lock_budget : next.reserve) = *a;
    // Checked against the rest as it stands, with this value named as the argument it is (not the
    // line of the file it replaces).
    next.origins["budget." + name] = fmt::format("SetBudget(\"{}\", \"{}\")", name, amount.substr(0, 64));
    if (auto v = validate_config(next, mem_total_); !v) return invalid(v.error().message);
    config_ = std::move(next);
    MC_LOG(LOG_INFO, "budget {} set to {} by the operator: lock cap now {} MiB", name,
           format_bytes(a->resolve(mem_total_)), decide_.lock_cap() >> 20);
    bus_.budget_changed(name, a->resolve(mem_total_));
    decide_.request();
    return {};
}

Result<void> Operator::set_model_budget(uint32_t id, const std::string& amount) {
    ModelEntry* m = models_.find(id);
    if (!m) return fail(ENOENT, fmt::format("no model with id {}", id));
    std::optional<ByteAmount> budget;
    if (!amount.empty()) {
        auto a = parse_byte_amount(amount);
        if (!a)
            return invalid(
                fmt::format("budget of model {} = '{}': {}", m->path, amount.substr(0, 64), a.error().message));
        budget = *a;
        // The configuration's rule, the same over D-Bus: a model's budget is within the global one.
        const uint64_t global = config_.lock_budget.resolve(mem_total_);
        if (budget->resolve(mem_total_) > global)
            return invalid(fmt::format(
                "budget of model {} = '{}': {} is larger than the global lock budget {}; lower it "
                "or raise budget.lock",
                m->path, amount.substr(0, 64), format_bytes(budget->resolve(mem_total_)), format_bytes(global)));
    }
    m->config.budget = budget;
    MC_LOG(LOG_INFO, "model {}: budget {} by the operator", m->path,
           budget ? format_bytes(budget->resolve(mem_total_)) : std::string("removed"));
    bus_.budget_changed(fmt::format("model:{}", id), budget ? budget->resolve(mem_total_) : UINT64_MAX);
    decide_.request();
    return {};
}

Result<uint32_t> Operator::set_pinned(uint32_t id, std::span<const std::string> specs, bool pinned) {
    ModelEntry* m = models_.find(id);
    if (!m) return fail(ENOENT, fmt::format("no model with id {}", id));
    if (specs.empty())
        return invalid(pinned ? "pin what? name experts (\"12\", \"12:3\", \"12:0-7\")" : "unpin what? name experts");
    const auto slots = MC_TRY(select_slots(*m, specs));
    uint32_t changed = 0;
    for (uint32_t s : slots) {
        changed += m->res->pinned(s) != pinned;
        m->res->set_pinned(s, pinned);
    }
    MC_LOG(LOG_INFO, "model {}: {} expert(s) {} by the operator", m->path, changed, pinned ? "pinned" : "unpinned");
    decide_.request();
    return changed;
}

Result<uint64_t> Operator::prefetch(uint32_t id, std::span<const std::string> specs) {
    ModelEntry* m = models_.find(id);
    if (!m) return fail(ENOENT, fmt::format("no model with id {}", id));
    auto slots = MC_TRY(select_slots(*m, specs));
    auto& r = *m->res;
    note(Doing::ReadingResidency, r.refresh_cached());
    // Hottest first, so that what is read first is what helps first.
    const uint32_t ne = r.n_experts();
    std::stable_sort(slots.begin(), slots.end(), [&](uint32_t a, uint32_t b) {
        return r.heat().heat(a / ne, a % ne) > r.heat().heat(b / ne, b % ne);
    });
    uint64_t queued = 0;
    uint32_t order = 0;
    for (uint32_t s : slots) {
        const SlotState& st = r.state(s);
        if (st.tier() != Tier::Storage || st.cached_bytes() >= r.slot_length(s) || r.cache_reads().count(s)) continue;
        queued += decide_.cache_fetch(*m, s, FetchReason::Operator, order++);
    }
    if (auto sub = prefetcher_.submit(); !sub) return tl::unexpected(sub.error());
    MC_LOG(LOG_INFO, "model {}: prefetch of {} by the operator", m->path, format_bytes(queued));
    return queued;
}

Result<uint64_t> Operator::evict(uint32_t id, std::span<const std::string> specs) {
    ModelEntry* m = models_.find(id);
    if (!m) return fail(ENOENT, fmt::format("no model with id {}", id));
    const auto slots = MC_TRY(select_slots(*m, specs));
    auto& r = *m->res;
    if (!specs.empty())
        for (uint32_t s : slots)
            if (r.pinned(s))
                return fail(EBUSY, fmt::format("block {} expert {} is pinned: unpin it first",
                                               r.model().map().layers[s / r.n_experts()].index, s % r.n_experts()));
    note(Doing::ReadingResidency, r.refresh_cached());
    uint64_t released = 0;
    std::vector<uint32_t> dropped;
    for (uint32_t s : slots) {
        if (r.pinned(s)) continue;  // "everything" means everything not pinned
        dropped.push_back(s);
        const SlotState& st = r.state(s);
        released += std::max(st.locked_bytes(), st.cached_bytes());
        if (st.tier() == Tier::Fetching) prefetcher_.cancel(fetch_tag(m->id, s));
        if (r.forget_cache_read(s)) prefetcher_.cancel(fetch_tag(m->id, s, true));
        const bool was_locked = st.tier() == Tier::Locked;
        if (auto rel = r.release(s, /*drop=*/false); !rel) return tl::unexpected(with_context(rel.error(), m->path));
        r.abandon(s);  // a read for a lock, cancelled above
        if (was_locked) decide_.tell_clients(*m, s, protocol::Action::Unlock);
    }
    r.drop_cached(dropped);
    note(Doing::ReadingResidency, r.refresh_cached());
    MC_LOG(LOG_INFO, "model {}: {} evicted by the operator", m->path, format_bytes(released));
    return released;
}

Result<std::string> Operator::export_profile(uint32_t id) const {
    const ModelEntry* m = models_.find(id);
    if (!m) return fail(ENOENT, fmt::format("no model with id {}", id));
    if (!m->res) return fail(EBUSY, fmt::format("model {} is not loaded: {}", m->path, m->error));
    return m->res->heat().to_profile(m->res->model().profile_key());
}

Result<void> Operator::import_profile(uint32_t id, const std::string& text) {
    ModelEntry* m = models_.find(id);
    if (!m) return fail(ENOENT, fmt::format("no model with id {}", id));
    if (!m->res) return fail(EBUSY, fmt::format("model {} is not loaded: {}", m->path, m->error));
    if (text.size() > (64u << 20)) return invalid("a heat profile of more than 64 MiB");
    const std::string key = m->res->model().profile_key();
    if (auto r = m->res->heat().load_profile(text, key, "the imported profile"); !r) return invalid(r.error().message);
    MC_LOG(LOG_INFO, "model {}: heat profile imported by the operator", m->path);
    m->warm_pending = config_.warm_start;
    decide_.request();
    return {};
}

// ---- trace ----------------------------------------------------------------------------------

Result<void> Operator::start_trace(UniqueFd file) {
    if (trace_.on()) return fail(EBUSY, "a trace is being recorded already: stop it first");
    struct stat st {};
    if (::fstat(file.get(), &st) != 0) return fail_errno("trace file");
    if (!S_ISREG(st.st_mode)) return invalid("a trace is written to a regular file (not a pipe, socket or device)");
    const int fl = ::fcntl(file.get(), F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) == O_RDONLY) return invalid("the trace file is not open for writing");
    // A trace overwrites only a trace: never a model this daemon has open (whatever its name), nor
    // a file that holds something else.
    for (const auto& m : models_.all())
        if (m->res)
            for (const auto& f : m->res->model().files())
                if (f.identity.dev == st.st_dev && f.identity.ino == st.st_ino)
                    return fail(EPERM, fmt::format("the trace file is {}, a model moecached manages", f.path));
    if (st.st_size > 0) {
        char head[32] = {};
        const ssize_t n = ::pread(file.get(), head, sizeof head - 1, 0);
        if (n < 0 && errno == EBADF)
            return invalid("the trace file is not open for reading too: it cannot be checked for what it holds");
        if (n < 0) return fail_errno("trace file");
        if (std::string_view(head, static_cast<size_t>(n)).rfind("{\"moecache_trace\"", 0) != 0)
            return fail(EEXIST, fmt::format("the trace file holds {} bytes that are not a moecache trace: remove it or "
                                            "name a new file",
                                            st.st_size));
    }
    if (auto r = trace_.start(std::move(file), config_.tick_seconds); !r) return r;
    for (const auto& m : models_.all())
        if (m->res) trace_.model(m->id, m->res->model().map(), m->path);
    trace_.flush();
    MC_LOG(LOG_INFO, "trace started");
    return {};
}

Result<uint64_t> Operator::stop_trace() {
    const uint64_t n = MC_TRY(trace_.stop());
    MC_LOG(LOG_INFO, "trace stopped: {} router decisions", n);
    return n;
}

}  // namespace moecache::daemon
