// moecachectl status
#include "../verbs.h"
#include "moecache/dbus/keys.h"

namespace moecache::ctl {

int cmd_status(const Options& o, const std::vector<std::string>& args) {
    return guarded("status", [&] {
        want_positionals(parse_args(args, {}, {}, "status"), 0, 0, "status", "");
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto s = mgr.GetStatus();
        if (o.json) {
            print_json(to_json(s));
            return kExitOk;
        }
        const auto locked = field<uint64_t>(s, dbus_keys::kLockedBytes), cap = field<uint64_t>(s, dbus_keys::kLockCapBytes);
        fmt::print("moecached {} (pid {}) on the {} bus\n", field<std::string>(s, dbus_keys::kVersion), field<uint32_t>(s, dbus_keys::kPid),
                   field<std::string>(s, dbus_keys::kBus));
        fmt::print("  locked       {} of {} allowed now ({}); budget {}, reserve {}, RAM {}\n", format_bytes(locked),
                   format_bytes(cap), percent(locked, cap), format_bytes(field<uint64_t>(s, dbus_keys::kLockBudgetBytes)),
                   format_bytes(field<uint64_t>(s, dbus_keys::kReserveBytes)), format_bytes(field<uint64_t>(s, dbus_keys::kMemTotalBytes)));
        fmt::print("  pressure     {}, {} back-off(s) so far\n",
                   field<bool>(s, dbus_keys::kUnderPressure) ? "backing off now" : "none now", field<uint64_t>(s, dbus_keys::kPressureEvents));
        fmt::print("  prefetch     {} read, {} queued; {} experts read whole after a miss ({}), {} at warm starts\n",
                   format_bytes(field<uint64_t>(s, dbus_keys::kPrefetchDoneBytes)),
                   format_bytes(field<uint64_t>(s, dbus_keys::kPrefetchQueuedBytes)), field<uint64_t>(s, dbus_keys::kMissFetches),
                   format_bytes(field<uint64_t>(s, dbus_keys::kMissFetchBytes)), format_bytes(field<uint64_t>(s, dbus_keys::kWarmFetchBytes)));
        if (const auto cg = field<uint64_t>(s, dbus_keys::kCgroupLimitBytes); cg > 0)
            fmt::print("  cgroup       its memory cgroup allows {}: locks stay below that less the reserve\n", format_bytes(cg));
        fmt::print("  models       {} (moecachectl models)\n", field<uint32_t>(s, dbus_keys::kModels));
        fmt::print("  clients      {} connected at {}\n", field<uint32_t>(s, dbus_keys::kClients), field<std::string>(s, dbus_keys::kSocket));
        if (field<bool>(s, dbus_keys::kPageCacheTelemetry))
            fmt::print("  page cache   watched by eBPF{}, {} events\n", field<bool>(s, dbus_keys::kPageCacheFaults) ? " (with faults)" : "",
                       field<uint64_t>(s, dbus_keys::kPageCacheEvents));
        else
            fmt::print("  page cache   not watched: {}\n", field<std::string>(s, dbus_keys::kPageCacheOffReason));
        const auto metrics = field<std::string>(s, dbus_keys::kMetrics);
        fmt::print("  metrics      {}\n", metrics.empty() ? "off" : "http://" + metrics + "/metrics");
        if (field<bool>(s, dbus_keys::kTracing)) fmt::print("  trace        recording: {} router decisions\n", field<uint64_t>(s, dbus_keys::kTraceRecords));
        // Absent from daemons before it.
        if (const auto it = s.find(dbus_keys::kHookNotices); it != s.end())
            for (const auto& line : it->second.get<std::vector<std::string>>()) fmt::print("  slower       {}\n", line);
        return kExitOk;
    });
}

}  // namespace moecache::ctl
