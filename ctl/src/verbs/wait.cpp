// moecachectl wait
#include "../verbs.h"
#include "moecache/dbus/keys.h"

namespace moecache::ctl {

// Polls the model's status until the daemon says it is settled (docs/dbus.md, `settled`) for
// --settle seconds on end: a warm start's or a swap's reads done and the pools filled. A runtime's
// readiness check (a script before its first request, a Kubernetes readiness probe).
int cmd_wait(const Options& o, const std::vector<std::string>& args) {
    return guarded("wait", [&] {
        const auto a = parse_args(args, {}, {"--timeout", "--settle"}, "wait");
        if (a.positional.size() != 1) throw Failure{kExitUsage, "usage: moecachectl wait MODEL [--timeout S] [--settle S]"};
        const double timeout = seconds_arg(a, "--timeout", 300);
        const double settle = seconds_arg(a, "--settle", 2);
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        ModelProxy model(*conn, ref.object);
        const auto start = std::chrono::steady_clock::now();
        const auto since = [&](std::chrono::steady_clock::time_point t) {
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
        };
        auto settled_at = start;  // when it last became settled (valid while `settled`)
        bool settled = false;
        // A warm start's progress (warm_total_bytes, warm_done_bytes): a line redrawn on a terminal,
        // else a line at each quarter.
        const bool tty = o.progress && ::isatty(STDERR_FILENO);
        int shown = -1;
        const auto show_warm = [&](const std::map<std::string, sdbus::Variant>& st) {
            const auto total = field<uint64_t>(st, dbus_keys::kWarmTotalBytes),
                       done = field<uint64_t>(st, dbus_keys::kWarmDoneBytes);
            if (total == 0) return;
            const int pct = static_cast<int>(100 * std::min(done, total) / total);
            if (tty) {
                if (pct != shown)
                    fmt::print(stderr, "\r  warm start: {:3d} % ({} of {})", pct, format_bytes(done),
                               format_bytes(total));
            } else if (pct / 25 > shown / 25 || shown < 0) {
                fmt::print(stderr, "  warm start: {} % ({} of {})\n", pct, format_bytes(done), format_bytes(total));
            }
            shown = pct;
        };
        std::map<std::string, sdbus::Variant> s;
        for (;;) {
            s = model.GetStatus();
            if (!s.count(dbus_keys::kSettled)) throw Failure{kExitFailed, "the daemon does not say whether a model is settled: it is older than this moecachectl"};
            if (!field<bool>(s, dbus_keys::kLoaded))
                throw Failure{kExitFailed, fmt::format("model {} is not loaded: {}", ref.id, field<std::string>(s, dbus_keys::kError))};
            show_warm(s);
            if (field<bool>(s, dbus_keys::kSettled)) {
                if (!settled) settled_at = std::chrono::steady_clock::now();
                settled = true;
                if (since(settled_at) >= settle) break;
            } else {
                settled = false;
            }
            if (since(start) > timeout)
                throw Failure{kExitFailed,
                              fmt::format("model {} not settled after {:.0f} s: {} experts being read, {} locked, {} in VRAM", ref.id,
                                          since(start), field<uint32_t>(s, dbus_keys::kExpertsFetching) + field<uint32_t>(s, dbus_keys::kPrefetchingExperts),
                                          field<uint32_t>(s, dbus_keys::kExpertsLocked), field<uint32_t>(s, dbus_keys::kExpertsInVram))};
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
        }
        if (tty && shown >= 0) fmt::print(stderr, "\n");
        const double waited = std::chrono::duration<double>(settled_at - start).count();
        const auto locked = field<uint32_t>(s, dbus_keys::kExpertsLocked);
        const auto vram = field<uint32_t>(s, dbus_keys::kExpertsInVram);
        const auto experts = field<uint32_t>(s, dbus_keys::kExperts);
        if (o.json) {
            print_json({{"model", ref.id}, {"settled_after_seconds", waited}, {"experts", experts}, {"experts_locked", locked},
                        {"experts_in_vram", vram}});
        } else {
            fmt::print("model {} settled after {:.1f} s: {} of {} experts locked in RAM, {} in VRAM\n", ref.id, waited, locked,
                       experts, vram);
        }
        return kExitOk;
    });
}

}  // namespace moecache::ctl
