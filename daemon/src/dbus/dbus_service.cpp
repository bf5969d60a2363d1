#include "dbus/dbus_service.h"

#include "moecache/daemon/control.h"
#include "moecache/dbus/adaptor.h"
#include "moecache/dbus/keys.h"
#include "moecache/log.h"
#include "moecache/text.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <map>

namespace moecache::daemon {
namespace {

constexpr const char* kBusName = "org.moecache1";
constexpr const char* kManagerPath = "/org/moecache1";
constexpr const char* kVersion = MOECACHE_VERSION_STRING;

std::string model_path(uint32_t id) { return fmt::format("{}/model/{}", kManagerPath, id); }

// A refusal of the daemon's, as a D-Bus error: its name says the kind, its text what and where.
[[noreturn]] void throw_error(const Error& e) {
    const char* name = "org.moecache1.Error.Failed";
    std::string text = e.what();
    switch (e.errnum) {
        case EINVAL: name = "org.moecache1.Error.InvalidArgument"; text = e.message; break;
        case ENOENT: name = "org.moecache1.Error.NotFound"; text = e.message; break;
        case EEXIST: name = "org.moecache1.Error.Exists"; text = e.message; break;
        case EBUSY: name = "org.moecache1.Error.Busy"; text = e.message; break;
        case EPERM:
        case EACCES: name = "org.moecache1.Error.AccessDenied"; break;
        default: break;
    }
    throw sdbus::Error(name, printable_utf8(text));  // D-Bus strings are UTF-8; paths are bytes
}

template <class T>
T value_or_throw(Result<T> r) {
    if (!r) throw_error(r.error());
    if constexpr (!std::is_void_v<T>) return std::move(*r);
}

// Handlers run inside sd-bus's C callbacks: only sdbus::Error may leave them (it becomes the
// reply); anything else becomes org.moecache1.Error.Failed rather than unwinding through C.
template <class Fn>
auto guarded(Fn&& fn) -> decltype(fn()) {
    try {
        return fn();
    } catch (const sdbus::Error&) {
        throw;
    } catch (const std::exception& e) {
        throw sdbus::Error("org.moecache1.Error.Failed", printable_utf8(e.what()));
    }
}

uint32_t model_id_of(const sdbus::ObjectPath& path) {
    const std::string prefix = fmt::format("{}/model/", kManagerPath);
    const std::string& p = path;
    if (p.rfind(prefix, 0) != 0 || p.size() == prefix.size() || p.size() > prefix.size() + 10 ||
        !std::all_of(p.begin() + static_cast<long>(prefix.size()), p.end(), [](char c) { return c >= '0' && c <= '9'; }))
        throw sdbus::Error("org.moecache1.Error.InvalidArgument",
                           fmt::format("'{}' is not a model object (/org/moecache1/model/ID)", p.substr(0, 128)));
    const uint64_t id = std::stoull(p.substr(prefix.size()));
    if (id > UINT32_MAX) throw sdbus::Error("org.moecache1.Error.NotFound", fmt::format("no model {}", p));
    return static_cast<uint32_t>(id);
}

std::map<std::string, sdbus::Variant> model_dict(const ModelStatus& m) {
    std::map<std::string, sdbus::Variant> d;
    d[dbus_keys::kId] = m.id;
    d[dbus_keys::kPath] = printable_utf8(m.path);
    d[dbus_keys::kName] = printable_utf8(m.name);
    d[dbus_keys::kKey] = m.key;
    d[dbus_keys::kFamily] = m.family;
    d[dbus_keys::kLoaded] = m.loaded;
    d[dbus_keys::kError] = printable_utf8(m.error);
    d[dbus_keys::kRegisteredByClient] = m.registered;
    d[dbus_keys::kOwnerUid] = m.owner_uid;
    d[dbus_keys::kBudgetBytes] = m.budget_bytes;
    d[dbus_keys::kLockedBytes] = m.locked_bytes;
    d[dbus_keys::kExpertBytes] = m.expert_bytes;
    d[dbus_keys::kExpertCachedBytes] = m.expert_cached_bytes;
    d[dbus_keys::kExpertLockedBytes] = m.expert_locked_bytes;
    d[dbus_keys::kExperts] = m.n_experts_total;
    d[dbus_keys::kExpertsLocked] = m.experts_locked;
    d[dbus_keys::kExpertsPinned] = m.experts_pinned;
    d[dbus_keys::kExpertsInVram] = m.experts_in_vram;
    d[dbus_keys::kDenseBytes] = m.dense_bytes;
    d[dbus_keys::kDenseTier] = std::string(to_string(m.dense_tier));
    d[dbus_keys::kStorageReadBytes] = m.read_bytes;
    d[dbus_keys::kEvictedBytes] = m.evicted_bytes;
    d[dbus_keys::kPrefetchingExperts] = m.prefetching_experts;
    d[dbus_keys::kPrefetchPendingBytes] = m.prefetch_pending_bytes;
    d[dbus_keys::kExpertsFetching] = m.experts_fetching;
    d[dbus_keys::kSettled] = m.settled;
    d[dbus_keys::kDecodeTokens] = m.outcome.decode_tokens;
    d[dbus_keys::kPromptTokens] = m.outcome.prompt_tokens;
    d[dbus_keys::kRoutedInVram] = m.outcome.routed[Reach::Vram];
    d[dbus_keys::kRoutedInRam] = m.outcome.routed[Reach::Ram];
    d[dbus_keys::kRoutedFromStorage] = m.outcome.routed[Reach::Storage];
    d[dbus_keys::kRoutingReported] = m.routing_reported;
    d[dbus_keys::kWarmTotalBytes] = m.warm_total_bytes;
    d[dbus_keys::kWarmDoneBytes] = m.warm_done_bytes;
    return d;
}

}  // namespace

// The service over sdbus-c++.
class SdbusService final : public DbusService {
public:
    static Result<std::unique_ptr<SdbusService>> open(Control& daemon, const std::string& bus, const std::string& admin_group);
    ~SdbusService() override;
    SdbusService(const SdbusService&) = delete;
    SdbusService& operator=(const SdbusService&) = delete;

    [[nodiscard]] int fd() const override;
    [[nodiscard]] uint32_t epoll_events() const override;
    [[nodiscard]] int timeout_ms() const override;
    [[nodiscard]] bool lost() const override { return lost_; }
    void process() override;
    void sync_models() override;
    void pressure_backoff(const std::string& source, uint64_t lock_cap) override;
    void budget_changed(const std::string& name, uint64_t bytes) override;
    [[nodiscard]] const std::string& bus() const override;

private:
    struct Impl;
    explicit SdbusService(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
    mutable bool lost_ = false;
    int fd_ = -1;  // as it was when the connection was made
};

struct SdbusService::Impl {
    Control& daemon;
    std::string bus;
    std::optional<gid_t> admin_gid;
    std::string admin_group;
    std::unique_ptr<sdbus::IConnection> conn;
    struct Manager;
    struct Model;
    std::unique_ptr<Manager> manager;
    std::map<uint32_t, std::unique_ptr<Model>> models;

    explicit Impl(Control& d) : daemon(d) {}
    // A method that changes state: the caller must be allowed (require_admin), then as guarded().
    template <class Fn>
    auto changing(sdbus::IObject& object, const char* what, Fn&& fn) const -> decltype(fn()) {
        return guarded([&] {
            require_admin(object, what);
            return fn();
        });
    }
    void sync();  // one model object per model

    std::unique_ptr<sdbus::IProxy> bus_proxy;  // org.freedesktop.DBus, for callers' credentials

    // Changes are for root and the admin group; the bus policy says so too, this holds if a
    // policy is missing or too open. The caller's uid and groups come from the bus itself
    // (GetConnectionCredentials: the kernel's SO_PEERCRED and SO_PEERGROUPS of its connection), not
    // from /proc, which the service cannot see (ProtectProc=invisible) and a caller could race.
    void require_admin(sdbus::IObject& object, const char* what) const {
        const sdbus::Message* msg = object.getCurrentlyProcessedMessage();
        if (!msg) throw sdbus::Error("org.moecache1.Error.AccessDenied", "no caller to check");
        std::optional<uint32_t> uid;
        std::vector<uint32_t> gids;
        try {
            std::map<std::string, sdbus::Variant> creds;
            bus_proxy->callMethod("GetConnectionCredentials").onInterface("org.freedesktop.DBus").withArguments(msg->getSender()).storeResultsTo(creds);
            if (const auto it = creds.find("UnixUserID"); it != creds.end()) uid = it->second.get<uint32_t>();
            if (const auto it = creds.find("UnixGroupIDs"); it != creds.end()) gids = it->second.get<std::vector<uint32_t>>();
        } catch (const sdbus::Error& e) {
            throw sdbus::Error("org.moecache1.Error.AccessDenied",
                               fmt::format("{}: the caller's credentials cannot be read: {}", what, e.getMessage()));
        }
        if (!uid) throw sdbus::Error("org.moecache1.Error.AccessDenied", fmt::format("{}: the bus did not say who called", what));
        if (*uid == 0) return;
        if (admin_gid && std::find(gids.begin(), gids.end(), *admin_gid) != gids.end()) return;
        throw sdbus::Error("org.moecache1.Error.AccessDenied",
                           admin_gid ? fmt::format("{} needs root or group {} (uid {} is neither)", what, admin_group, *uid)
                                     : fmt::format("{} needs root (uid {} is not)", what, *uid));
    }
};

struct SdbusService::Impl::Manager : sdbus::AdaptorInterfaces<org::moecache1::Manager_adaptor> {
    Impl& impl;
    Manager(Impl& i) : AdaptorInterfaces(*i.conn, kManagerPath), impl(i) { registerAdaptor(); }
    virtual ~Manager() { unregisterAdaptor(); }

    std::map<std::string, sdbus::Variant> GetStatus() override {
        return guarded([&] {
            const DaemonStatus s = impl.daemon.status(/*experts=*/false);
            std::map<std::string, sdbus::Variant> d;
            d[dbus_keys::kVersion] = std::string(kVersion);
            d[dbus_keys::kPid] = static_cast<uint32_t>(::getpid());
            d[dbus_keys::kMemTotalBytes] = s.mem_total;
            d[dbus_keys::kLockBudgetBytes] = s.lock_budget;
            d[dbus_keys::kReserveBytes] = s.reserve;
            d[dbus_keys::kLockCapBytes] = s.lock_cap;
            d[dbus_keys::kLockedBytes] = s.locked_bytes;
            d[dbus_keys::kVmlckBytes] = s.vmlck_bytes;
            d[dbus_keys::kUnderPressure] = s.under_pressure;
            d[dbus_keys::kPressureEvents] = s.pressure_events;
            d[dbus_keys::kPrefetchDoneBytes] = s.prefetch_done_bytes;
            d[dbus_keys::kPrefetchQueuedBytes] = s.prefetch_queued_bytes;
            d[dbus_keys::kCgroupLimitBytes] = s.cgroup_limit;
            d[dbus_keys::kMissFetches] = s.miss_fetches;
            d[dbus_keys::kMissFetchBytes] = s.miss_fetch_bytes;
            d[dbus_keys::kWarmFetchBytes] = s.warm_fetch_bytes;
            d[dbus_keys::kPredictedExperts] = s.predicted_experts;
            d[dbus_keys::kPredictedUsed] = s.predicted_used;
            d[dbus_keys::kPredictFetchBytes] = s.predict_fetch_bytes;
            d[dbus_keys::kModels] = static_cast<uint32_t>(s.models.size());
            d[dbus_keys::kClients] = static_cast<uint32_t>(s.clients.size());
            d[dbus_keys::kClientsRefused] = s.clients_refused;
            d[dbus_keys::kSocket] = s.socket_path;
            d[dbus_keys::kMetrics] = s.metrics_address;
            d[dbus_keys::kBus] = s.bus;
            d[dbus_keys::kPageCacheTelemetry] = s.page_cache.enabled;
            d[dbus_keys::kPageCacheFaults] = s.page_cache.faults;
            d[dbus_keys::kPageCacheOffReason] = s.page_cache.off_reason;
            d[dbus_keys::kPageCacheEvents] = s.page_cache.events;
            d[dbus_keys::kVramReleases] = s.vram_releases;
            d[dbus_keys::kTracing] = s.tracing;
            d[dbus_keys::kTraceRecords] = s.trace_records;
            std::vector<std::string> notices;
            for (const auto& c : s.clients)
                for (const auto& [device, path] : c.miss_paths)
                    if (!protocol::is_fast(path))
                        notices.push_back(printable_utf8(fmt::format("{} (pid {}) GPU {}: {}. {}.", c.name, c.pid, device,
                                                                     protocol::reason_of(path), protocol::advice_for(path))));
            d[dbus_keys::kHookNotices] = notices;
            std::vector<std::string> helping;
            for (const auto& line : s.helping) helping.push_back(printable_utf8(line));
            d[dbus_keys::kHelping] = helping;
            return d;
        });
    }

    std::vector<sdbus::Struct<sdbus::ObjectPath, uint32_t, std::string, bool, std::string, uint64_t, uint64_t, uint64_t, uint32_t>>
    ListModels() override {
        return guarded([&] {
            std::vector<sdbus::Struct<sdbus::ObjectPath, uint32_t, std::string, bool, std::string, uint64_t, uint64_t, uint64_t, uint32_t>> out;
            for (const auto& m : impl.daemon.status(false).models)
                out.emplace_back(sdbus::ObjectPath(model_path(m.id)), m.id, printable_utf8(m.path), m.loaded, printable_utf8(m.error), m.expert_bytes,
                                 m.expert_cached_bytes, m.expert_locked_bytes, m.experts_in_vram);
            return out;
        });
    }

    sdbus::ObjectPath RegisterModel(const std::string& path) override {
        return impl.changing(getObject(), "RegisterModel", [&] {
            const uint32_t id = value_or_throw(impl.daemon.add_model(path));
            impl.sync();
            return sdbus::ObjectPath(model_path(id));
        });
    }

    void UnregisterModel(const sdbus::ObjectPath& model) override {
        impl.changing(getObject(), "UnregisterModel", [&] {
            value_or_throw(impl.daemon.remove_model(model_id_of(model)));
            impl.sync();
        });
    }

    std::vector<sdbus::Struct<std::string, uint64_t, std::string>> GetBudgets() override {
        return guarded([&] {
            const auto& c = impl.daemon.config();
            const DaemonStatus s = impl.daemon.status(false);
            auto written = [](const ByteAmount& a) {
                return a.percent ? fmt::format("{}%", *a.percent) : format_bytes(a.bytes);
            };
            std::vector<sdbus::Struct<std::string, uint64_t, std::string>> out;
            out.emplace_back(std::string("lock"), s.lock_budget, written(c.lock_budget));
            out.emplace_back(std::string("reserve"), s.reserve, written(c.reserve));
            out.emplace_back(std::string("cap"), s.lock_cap, std::string(s.under_pressure ? "lowered by memory pressure" : ""));
            return out;
        });
    }

    void SetBudget(const std::string& name, const std::string& amount) override {
        impl.changing(getObject(), "SetBudget", [&] {
            value_or_throw(impl.daemon.set_budget(name, amount));
        });
    }

    void StartTrace(const sdbus::UnixFd& file) override {
        impl.changing(getObject(), "StartTrace", [&] {
            if (!file.isValid()) throw sdbus::Error("org.moecache1.Error.InvalidArgument", "no file descriptor");
            UniqueFd fd(::fcntl(file.get(), F_DUPFD_CLOEXEC, 3));
            if (!fd) throw sdbus::Error("org.moecache1.Error.Failed", "the trace file descriptor cannot be kept");
            value_or_throw(impl.daemon.start_trace(std::move(fd)));
        });
    }

    uint64_t StopTrace() override {
        return impl.changing(getObject(), "StopTrace", [&] {
            return value_or_throw(impl.daemon.stop_trace());
        });
    }
};

struct SdbusService::Impl::Model : sdbus::AdaptorInterfaces<org::moecache1::Model_adaptor> {
    Impl& impl;
    uint32_t id;
    Model(Impl& i, uint32_t model) : AdaptorInterfaces(*i.conn, model_path(model)), impl(i), id(model) { registerAdaptor(); }
    virtual ~Model() { unregisterAdaptor(); }

    ModelStatus status(bool experts) {
        auto s = impl.daemon.model_status(id, experts);
        if (!s) throw sdbus::Error("org.moecache1.Error.NotFound", fmt::format("model {} is gone", id));
        return std::move(*s);
    }

    std::map<std::string, sdbus::Variant> GetStatus() override {
        return guarded([&] { return model_dict(status(false)); });
    }

    std::vector<sdbus::Struct<uint32_t, uint32_t, std::string, double, uint32_t, uint64_t, uint64_t, uint64_t, bool, uint32_t>>
    Experts(const uint32_t& top) override {
        return guarded([&] {
            auto s = status(true);
            auto& ex = s.experts;
            auto hotter = [](const ExpertStatus& a, const ExpertStatus& b) {
                return a.heat != b.heat ? a.heat > b.heat : std::tie(a.block, a.expert) < std::tie(b.block, b.expert);
            };
            const size_t n = top == 0 ? ex.size() : std::min<size_t>(top, ex.size());
            std::partial_sort(ex.begin(), ex.begin() + static_cast<long>(n), ex.end(), hotter);
            std::vector<sdbus::Struct<uint32_t, uint32_t, std::string, double, uint32_t, uint64_t, uint64_t, uint64_t, bool, uint32_t>> out;
            out.reserve(n);
            for (size_t i = 0; i < n; ++i) {
                const auto& e = ex[i];
                const std::string tier = to_string(placement(e.tier, e.vram_holders));
                out.emplace_back(e.block, e.expert, tier, e.heat, e.uses, e.bytes, e.cached_bytes, e.locked_bytes, e.pinned,
                                 e.vram_holders);
            }
            return out;
        });
    }

    uint32_t Pin(const std::vector<std::string>& experts) override {
        return impl.changing(getObject(), "Pin", [&] {
            return value_or_throw(impl.daemon.set_pinned(id, experts, true));
        });
    }

    uint32_t Unpin(const std::vector<std::string>& experts) override {
        return impl.changing(getObject(), "Unpin", [&] {
            return value_or_throw(impl.daemon.set_pinned(id, experts, false));
        });
    }

    uint64_t Prefetch(const std::vector<std::string>& experts) override {
        return impl.changing(getObject(), "Prefetch", [&] {
            return value_or_throw(impl.daemon.prefetch(id, experts));
        });
    }

    uint64_t Evict(const std::vector<std::string>& experts) override {
        return impl.changing(getObject(), "Evict", [&] {
            return value_or_throw(impl.daemon.evict(id, experts));
        });
    }

    std::string ExportProfile() override {
        return guarded([&] { return value_or_throw(impl.daemon.export_profile(id)); });
    }

    void ImportProfile(const std::string& profile) override {
        impl.changing(getObject(), "ImportProfile", [&] {
            value_or_throw(impl.daemon.import_profile(id, profile));
        });
    }

    void SetBudget(const std::string& amount) override {
        impl.changing(getObject(), "SetBudget", [&] {
            value_or_throw(impl.daemon.set_model_budget(id, amount));
        });
    }

    uint32_t Id() override { return id; }
    std::string Path() override { return guarded([&] { return printable_utf8(status(false).path); }); }
    std::string Key() override { return guarded([&] { return status(false).key; }); }
    bool Loaded() override { return guarded([&] { return status(false).loaded; }); }
    std::string Error() override { return guarded([&] { return printable_utf8(status(false).error); }); }
};

void SdbusService::Impl::sync() {
    const auto ids = daemon.model_ids();
    for (auto it = models.begin(); it != models.end();) {
        if (std::find(ids.begin(), ids.end(), it->first) == ids.end()) it = models.erase(it);
        else ++it;
    }
    for (uint32_t id : ids)
        if (!models.count(id)) models.emplace(id, std::make_unique<Model>(*this, id));
}

SdbusService::SdbusService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SdbusService::~SdbusService() {
    if (!impl_) return;
    try {
        impl_->models.clear();
        impl_->manager.reset();
        impl_->bus_proxy.reset();
        if (impl_->conn && !lost_) impl_->conn->releaseName(kBusName);  // a lost bus has forgotten it
    } catch (const std::exception& e) {
        MC_LOG(LOG_WARNING, "D-Bus: on leaving the bus: {}", e.what());
    }
}

Result<std::unique_ptr<SdbusService>> SdbusService::open(Control& daemon, const std::string& bus,
                                                         const std::string& admin_group) {
    auto impl = std::make_unique<Impl>(daemon);
    impl->bus = bus;
    impl->admin_group = admin_group;
    if (!admin_group.empty()) {
        if (const group* g = ::getgrnam(admin_group.c_str())) impl->admin_gid = g->gr_gid;
        else MC_LOG(LOG_NOTICE, "D-Bus: group '{}' ([dbus] admin_group) does not exist: changes are for root only", admin_group);
    }
    try {
        if (bus == "system") impl->conn = sdbus::createSystemBusConnection();
        else if (bus == "session") impl->conn = sdbus::createSessionBusConnection();
        else impl->conn = sdbus::createSessionBusConnectionWithAddress(bus);
        impl->conn->requestName(kBusName);
        impl->bus_proxy = sdbus::createProxy(*impl->conn, "org.freedesktop.DBus", "/org/freedesktop/DBus");
        impl->manager = std::make_unique<Impl::Manager>(*impl);
    } catch (const sdbus::Error& e) {
        return failf("the {} bus ([dbus] bus = \"{}\"): {}: {}", bus == "system" || bus == "session" ? bus : "configured",
                     bus, e.getName(), e.getMessage());
    }
    std::unique_ptr<SdbusService> s(new SdbusService(std::move(impl)));
    try {
        s->fd_ = s->impl_->conn->getEventLoopPollData().fd;
    } catch (const sdbus::Error& e) {
        return failf("the {} bus: {}: {}", bus, e.getName(), e.getMessage());
    }
    s->sync_models();
    s->process();
    return s;
}

int SdbusService::fd() const { return fd_; }

uint32_t SdbusService::epoll_events() const {
    if (lost_) return 0;
    try {
        const auto pd = impl_->conn->getEventLoopPollData();
        uint32_t ev = 0;
        if (pd.events & POLLIN) ev |= EPOLLIN;
        if (pd.events & POLLOUT) ev |= EPOLLOUT;
        return ev;
    } catch (const std::exception&) {
        lost_ = true;
        return 0;
    }
}

int SdbusService::timeout_ms() const {
    if (lost_) return -1;
    sdbus::IConnection::PollData pd{};
    try {
        pd = impl_->conn->getEventLoopPollData();
    } catch (const std::exception&) {
        lost_ = true;
        return -1;
    }
    if (pd.timeout_usec == UINT64_MAX) return -1;
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    const uint64_t now_us = static_cast<uint64_t>(now.tv_sec) * 1'000'000 + static_cast<uint64_t>(now.tv_nsec) / 1000;
    if (pd.timeout_usec <= now_us) return 0;
    return static_cast<int>(std::min<uint64_t>((pd.timeout_usec - now_us + 999) / 1000, 60'000));
}

void SdbusService::process() {
    if (lost_) return;
    // A bounded number per turn, so that a flood of calls cannot starve the rest of the loop.
    for (int i = 0; i < 256; ++i) {
        try {
            if (!impl_->conn->processPendingRequest()) break;
        } catch (const std::exception& e) {
            (void)epoll_events();  // a broken connection says so here
            if (!lost_) MC_LOG(LOG_WARNING, "D-Bus: {}", e.what());
            return;
        }
    }
    (void)epoll_events();
}

void SdbusService::sync_models() {
    try {
        impl_->sync();
    } catch (const std::exception& e) {
        MC_LOG(LOG_WARNING, "D-Bus: model objects: {}", e.what());
    }
}

void SdbusService::pressure_backoff(const std::string& source, uint64_t lock_cap) {
    try {
        impl_->manager->emitPressureBackoff(source, lock_cap);
    } catch (const std::exception& e) {
        MC_LOG(LOG_WARNING, "D-Bus: signal PressureBackoff: {}", e.what());
    }
}

void SdbusService::budget_changed(const std::string& name, uint64_t bytes) {
    try {
        impl_->manager->emitBudgetChanged(name, bytes);
    } catch (const std::exception& e) {
        MC_LOG(LOG_WARNING, "D-Bus: signal BudgetChanged: {}", e.what());
    }
}

const std::string& SdbusService::bus() const { return impl_->bus; }

}  // namespace moecache::daemon

// The module's entry point (dbus_service.h): nothing may unwind out of it.
extern "C" __attribute__((visibility("default"))) int moecache_dbus_open_v1(const moecache::daemon::DbusModuleArgs* args,
                                                                          std::unique_ptr<moecache::daemon::DbusService>* out,
                                                                          moecache::Error* error) {
    using namespace moecache::daemon;
    try {
        if (std::string_view(args->abi) != kDbusModuleAbi) {
            *error = moecache::Error{ELIBACC, fmt::format("libmoecache-dbus.so is of another build ({}; moecached: {})",
                                                          kDbusModuleAbi, args->abi)};
            return -1;
        }
        moecache::log::set_max_priority(args->log_priority);
        auto s = SdbusService::open(*args->daemon, *args->bus, *args->admin_group);
        if (!s) {
            *error = s.error();
            return -1;
        }
        *out = std::move(*s);
        return 0;
    } catch (const std::exception& e) {
        *error = moecache::Error{0, fmt::format("D-Bus: {}", e.what())};
        return -1;
    }
}
