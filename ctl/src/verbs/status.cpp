// moecachectl status
#include "../verbs.h"
#include "moecache/dbus/keys.h"
#include "moecache/http.h"

#include <cstdlib>

namespace moecache::ctl {
namespace {

// Where /status answers when no address is given: MOECACHE_METRICS, else [metrics] listen's default.
std::string default_http_address() {
    const char* env = std::getenv("MOECACHE_METRICS");
    return env && *env ? env : "127.0.0.1:8474";
}

// moecachectl status over HTTP: moecached's /status, as the daemon writes it (no D-Bus needed).
int status_over_http(const std::string& address, bool json) {
    if (json) throw Failure{kExitUsage, "--json needs the bus; over HTTP, /metrics is the machine-readable form"};
    auto reply = http_get(address, "/status", std::chrono::seconds(5));
    if (!reply) throw Failure{kExitUnreachable, reply.error().what()};
    if (reply->status != 200)
        throw Failure{kExitFailed, fmt::format("http://{}/status answered {} (a moecached older than /status?)",
                                               address, reply->status)};
    fmt::print("{}", reply->body);
    return kExitOk;
}

void print_status(const std::map<std::string, sdbus::Variant>& s) {
    const auto locked = field<uint64_t>(s, dbus_keys::kLockedBytes), cap = field<uint64_t>(s, dbus_keys::kLockCapBytes);
    fmt::print("moecached {} (pid {}) on the {} bus\n", field<std::string>(s, dbus_keys::kVersion),
               field<uint32_t>(s, dbus_keys::kPid), field<std::string>(s, dbus_keys::kBus));
    fmt::print("  locked       {} of {} allowed now ({}); budget {}, reserve {}, RAM {}\n", format_bytes(locked),
               format_bytes(cap), percent(locked, cap), format_bytes(field<uint64_t>(s, dbus_keys::kLockBudgetBytes)),
               format_bytes(field<uint64_t>(s, dbus_keys::kReserveBytes)),
               format_bytes(field<uint64_t>(s, dbus_keys::kMemTotalBytes)));
    fmt::print("  pressure     {}, {} back-off(s) so far\n",
               field<bool>(s, dbus_keys::kUnderPressure) ? "backing off now" : "none now",
               field<uint64_t>(s, dbus_keys::kPressureEvents));
    fmt::print("  prefetch     {} read, {} queued; {} experts read whole after a miss ({}), {} at warm starts\n",
               format_bytes(field<uint64_t>(s, dbus_keys::kPrefetchDoneBytes)),
               format_bytes(field<uint64_t>(s, dbus_keys::kPrefetchQueuedBytes)),
               field<uint64_t>(s, dbus_keys::kMissFetches),
               format_bytes(field<uint64_t>(s, dbus_keys::kMissFetchBytes)),
               format_bytes(field<uint64_t>(s, dbus_keys::kWarmFetchBytes)));
    if (const auto cg = field<uint64_t>(s, dbus_keys::kCgroupLimitBytes); cg > 0)
        fmt::print("  cgroup       its memory cgroup allows {}: locks stay below that less the reserve\n",
                   format_bytes(cg));
    fmt::print("  models       {} (moecachectl models)\n", field<uint32_t>(s, dbus_keys::kModels));
    fmt::print("  clients      {} connected at {}\n", field<uint32_t>(s, dbus_keys::kClients),
               field<std::string>(s, dbus_keys::kSocket));
    if (field<bool>(s, dbus_keys::kPageCacheTelemetry))
        fmt::print("  page cache   watched by eBPF{}, {} events\n",
                   field<bool>(s, dbus_keys::kPageCacheFaults) ? " (with faults)" : "",
                   field<uint64_t>(s, dbus_keys::kPageCacheEvents));
    else
        fmt::print("  page cache   not watched: {}\n", field<std::string>(s, dbus_keys::kPageCacheOffReason));
    const auto metrics = field<std::string>(s, dbus_keys::kMetrics);
    fmt::print("  metrics      {}\n", metrics.empty() ? "off" : "http://" + metrics + "/metrics");
    if (field<bool>(s, dbus_keys::kTracing))
        fmt::print("  trace        recording: {} router decisions\n", field<uint64_t>(s, dbus_keys::kTraceRecords));
    // Absent from daemons before it: then the hook's notices alone.
    if (const auto it = s.find(dbus_keys::kHelping); it != s.end()) {
        const auto lines = it->second.get<std::vector<std::string>>();
        fmt::print("is it helping?\n");
        if (lines.empty()) fmt::print("  nothing to say yet: no model and no runtime\n");
        for (const auto& line : lines) fmt::print("  {}\n", line);
    } else if (const auto notices = s.find(dbus_keys::kHookNotices); notices != s.end()) {
        for (const auto& line : notices->second.get<std::vector<std::string>>())
            fmt::print("  slower       {}\n", line);
    }
}

}  // namespace

int cmd_status(const Options& o, const std::vector<std::string>& args) {
    return guarded("status", [&] {
        const auto a = parse_args(args, {}, {"--http"}, "status");
        want_positionals(a, 0, 0, "status", "[--http HOST:PORT]");
        if (a.opts.count("--http")) return status_over_http(a.opts.at("--http"), o.json);
        std::map<std::string, sdbus::Variant> s;
        std::string unreachable;  // why there is no bus (a bus without moecached on it is another matter: exit 3)
        std::unique_ptr<sdbus::IConnection> conn;
        try {
            conn = connect(o);
        } catch (const Failure& f) {
            if (f.code != kExitUnreachable || o.json) throw;
            unreachable = f.message;
        }
        if (conn) {
            ManagerProxy mgr(*conn);
            s = mgr.GetStatus();
        }
        if (!unreachable.empty()) {
            // No bus (a container, the bundle, a Kubernetes node): moecached's /status, where it answers.
            const std::string address = default_http_address();
            auto reply = http_get(address, "/status", std::chrono::seconds(2));
            if (!reply || reply->status != 200)
                throw Failure{kExitUnreachable,
                              fmt::format("{}; nor does http://{}/status answer (--http HOST:PORT names "
                                          "its [metrics] listen)",
                                          unreachable, address)};
            fmt::print("({}: moecached's http://{}/status instead)\n{}", unreachable, address, reply->body);
            return kExitOk;
        }
        if (o.json) {
            print_json(to_json(s));
            return kExitOk;
        }
        print_status(s);
        return kExitOk;
    });
}

}  // namespace moecache::ctl
