// moecachectl prefetch
#include "../verbs.h"
#include "moecache/dbus/keys.h"

namespace moecache::ctl {

namespace {

void draw_progress(uint64_t done, uint64_t total, double seconds) {
    const int width = 30;
    const double f = total ? std::min(1.0, static_cast<double>(done) / static_cast<double>(total)) : 1.0;
    const int fill = static_cast<int>(f * width);
    const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
    fmt::print(stderr, "\r[{}{}] {:3.0f}%  {} of {}  {}/s   ", std::string(static_cast<size_t>(fill), '#'),
               std::string(static_cast<size_t>(width - fill), '.'), f * 100, format_bytes(done), format_bytes(total),
               format_bytes(static_cast<uint64_t>(rate)));
    std::fflush(stderr);
}

}  // namespace

int cmd_prefetch(const Options& o, const std::vector<std::string>& args) {
    return guarded("prefetch", [&] {
        const auto a = parse_args(args, {"--no-wait"}, {"--timeout"}, "prefetch");
        if (a.positional.empty()) throw Failure{kExitUsage, "usage: moecachectl prefetch MODEL [EXPERTS...] [--no-wait]"};
        const double timeout = seconds_arg(a, "--timeout", 3600);
        auto conn = connect(o);
        ManagerProxy mgr(*conn);
        const auto ref = resolve_model(mgr, a.positional[0]);
        ModelProxy model(*conn, ref.object);
        const std::vector<std::string> specs(a.positional.begin() + 1, a.positional.end());
        const auto start = std::chrono::steady_clock::now();
        const uint64_t queued = model.Prefetch(specs);
        const bool wait = !a.opts.count("--no-wait");
        const bool bar = wait && o.progress && !o.json && ::isatty(STDERR_FILENO);
        uint64_t pending = queued;
        double seconds = 0;
        while (wait && pending > 0) {
            const auto s = model.GetStatus();
            pending = field<uint32_t>(s, dbus_keys::kPrefetchingExperts) == 0 ? 0 : std::min(queued, field<uint64_t>(s, dbus_keys::kPrefetchPendingBytes));
            seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (bar) draw_progress(queued - pending, queued, seconds);
            if (pending == 0) break;
            if (seconds > timeout) {
                if (bar) fmt::print(stderr, "\n");
                throw Failure{kExitFailed, fmt::format("still reading after {:.0f} s: {} of {} to go (it goes on in the daemon)",
                                                       seconds, format_bytes(pending), format_bytes(queued))};
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        if (bar) fmt::print(stderr, "\n");
        if (o.json) {
            print_json({{"model", ref.id}, {"queued_bytes", queued}, {"waited", wait}, {"seconds", seconds}});
        } else if (queued == 0) {
            fmt::print("nothing to read: those experts are in RAM already\n");
        } else if (wait) {
            fmt::print("{} read into the page cache in {:.1f} s ({}/s)\n", format_bytes(queued), seconds,
                       format_bytes(seconds > 0 ? static_cast<uint64_t>(static_cast<double>(queued) / seconds) : 0));
        } else {
            fmt::print("{} queued for reading\n", format_bytes(queued));
        }
        return kExitOk;
    });
}

}  // namespace moecache::ctl
