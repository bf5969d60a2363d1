// moecachectl status
#include "../verbs.h"

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
        const auto locked = field<uint64_t>(s, "locked_bytes"), cap = field<uint64_t>(s, "lock_cap_bytes");
        fmt::print("moecached {} (pid {}) on the {} bus\n", field<std::string>(s, "version"), field<uint32_t>(s, "pid"),
                   field<std::string>(s, "bus"));
        fmt::print("  locked       {} of {} allowed now ({}); budget {}, reserve {}, RAM {}\n", format_bytes(locked),
                   format_bytes(cap), percent(locked, cap), format_bytes(field<uint64_t>(s, "lock_budget_bytes")),
                   format_bytes(field<uint64_t>(s, "reserve_bytes")), format_bytes(field<uint64_t>(s, "mem_total_bytes")));
        fmt::print("  pressure     {}, {} back-off(s) so far\n",
                   field<bool>(s, "under_pressure") ? "backing off now" : "none now", field<uint64_t>(s, "pressure_events"));
        fmt::print("  prefetch     {} read, {} queued; {} experts read whole after a miss ({}), {} at warm starts\n",
                   format_bytes(field<uint64_t>(s, "prefetch_done_bytes")),
                   format_bytes(field<uint64_t>(s, "prefetch_queued_bytes")), field<uint64_t>(s, "miss_fetches"),
                   format_bytes(field<uint64_t>(s, "miss_fetch_bytes")), format_bytes(field<uint64_t>(s, "warm_fetch_bytes")));
        if (const auto cg = field<uint64_t>(s, "cgroup_limit_bytes"); cg > 0)
            fmt::print("  cgroup       its memory cgroup allows {}: locks stay below that less the reserve\n", format_bytes(cg));
        fmt::print("  models       {} (moecachectl models)\n", field<uint32_t>(s, "models"));
        fmt::print("  clients      {} connected at {}\n", field<uint32_t>(s, "clients"), field<std::string>(s, "socket"));
        if (field<bool>(s, "page_cache_telemetry"))
            fmt::print("  page cache   watched by eBPF{}, {} events\n", field<bool>(s, "page_cache_faults") ? " (with faults)" : "",
                       field<uint64_t>(s, "page_cache_events"));
        else
            fmt::print("  page cache   not watched: {}\n", field<std::string>(s, "page_cache_off_reason"));
        const auto metrics = field<std::string>(s, "metrics");
        fmt::print("  metrics      {}\n", metrics.empty() ? "off" : "http://" + metrics + "/metrics");
        if (field<bool>(s, "tracing")) fmt::print("  trace        recording: {} router decisions\n", field<uint64_t>(s, "trace_records"));
        return kExitOk;
    });
}

}  // namespace moecache::ctl
