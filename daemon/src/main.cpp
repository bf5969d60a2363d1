// moecached: loads the configuration, then hands over to the event loop.
#include "moecache/build_info.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/descriptors.h"
#include "moecache/daemon/privileges.h"
#include "moecache/log.h"

#include <fmt/format.h>

#include <sys/resource.h>

#include <cstring>
#include <string>

namespace {

constexpr const char* kUsage =
    R"(usage: moecached [--config FILE] [--user USER[:GROUP]] [--check] [--verbose] [--version]

Keeps the hot experts of Mixture-of-Experts models resident: locks them in the page cache within
budgets, prefetches them with io_uring, backs off under memory pressure, and saves their heat so
that a restart starts warm. Runs in the foreground; SIGHUP reloads the configuration.

  --config FILE   the configuration (default /etc/moecache/moecached.toml; drop-ins are read
                  from moecached.toml.d/ beside it)
  --user U[:G]    started as root (a container), switch to this user and group first, keeping
                  only the capabilities the daemon uses (IPC_LOCK, BPF, PERFMON, SYS_RESOURCE,
                  FOWNER) of those it was given; names or numbers (65532:65532)
  --check         load and validate the configuration, print what it says, and exit
  --verbose       debug logging
  --version       print the version and exit
)";

}  // namespace

int main(int argc, char** argv) {
    std::string config_path = "/etc/moecache/moecached.toml";
    bool check = false;
    std::string user;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--config" && i + 1 < argc) config_path = argv[++i];
        else if (a == "--user" && i + 1 < argc) user = argv[++i];
        else if (a == "--check") check = true;
        else if (a == "--verbose") moecache::log::set_max_priority(LOG_DEBUG);
        else if (a == "--version") {
            fmt::print("moecached {}\n", moecache::version_line());
            return 0;
        } else if (a == "-h" || a == "--help") {
            fmt::print("{}", kUsage);
            return 0;
        } else {
            fmt::print(stderr, "moecached: unknown argument '{}'\n{}", a, kUsage);
            return 2;
        }
    }
    // The switch comes first: the configuration is read as the user that will read it again on
    // SIGHUP, and no thread is started yet (capabilities are set per thread).
    if (!user.empty() && !check) {
        auto became = moecache::daemon::become_user(user);
        if (!became) {
            MC_LOG(LOG_ERR, "{}", became.error().what());
            return 1;
        }
        MC_LOG(LOG_INFO, "{}", *became);
    }
    auto config = moecache::daemon::load_config(config_path);
    if (!config) {
        MC_LOG(LOG_ERR, "{}", config.error().what());
        return 1;
    }
    if (auto v = moecache::daemon::validate_config(*config, moecache::daemon::mem_total_bytes()); !v) {
        MC_LOG(LOG_ERR, "{}", v.error().what());
        return 1;
    }
    // Descriptors: the soft limit as high as the hard one goes (systemd gives services 1024 soft for
    // select(), which moecached does not use); what the configuration needs is checked against it.
    if (rlimit nofile{}; ::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        (void)::setrlimit(RLIMIT_NOFILE, &nofile);  // failing, the daemon fits its clients to the old one
    }
    if (check) {
        const auto fds = moecache::daemon::descriptor_budget(*config, moecache::daemon::nofile_limit());
        fmt::print("{}{}\n", fds.fits() ? "" : "warning: ", moecache::daemon::describe(fds));
        fmt::print("{}: valid ({} file(s) read, {} model entr{})\n", config_path, config->sources.size(),
                   config->models.size(), config->models.size() == 1 ? "y" : "ies");
        return 0;
    }
    if (config->log_level == "debug") moecache::log::set_max_priority(LOG_DEBUG);
    // Locking is bounded by the daemon's own budgets, not by RLIMIT_MEMLOCK: CAP_IPC_LOCK lifts the
    // limit, and without it the limit is raised as far as it goes.
    const auto caps = moecache::daemon::own_capabilities();
    if (!caps || !(caps->effective & (uint64_t{1} << 14 /* CAP_IPC_LOCK */))) {
        rlimit unlimited{RLIM_INFINITY, RLIM_INFINITY};
        if (::setrlimit(RLIMIT_MEMLOCK, &unlimited) != 0)
            MC_LOG(LOG_WARNING, "no CAP_IPC_LOCK and RLIMIT_MEMLOCK stays limited ({}): locking fails past "
                                "it; give moecached CAP_IPC_LOCK (LimitMEMLOCK=infinity in its unit)",
                   std::strerror(errno));
    }
    auto daemon = moecache::daemon::Daemon::create(std::move(*config));
    if (!daemon) {
        MC_LOG(LOG_ERR, "{}", daemon.error().what());
        return 1;
    }
    if (auto r = (*daemon)->run(); !r) {
        MC_LOG(LOG_ERR, "{}", r.error().what());
        return 1;
    }
    return 0;
}
