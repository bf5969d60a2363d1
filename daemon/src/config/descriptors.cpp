#include "moecache/daemon/descriptors.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>

namespace moecache::daemon {
namespace {

// Descriptors held whatever the clients do: stdio, epoll, signalfd, timerfd, the listener, the BPF
// objects, maps, links and ring, io_uring, PSI triggers, the bus, inotify, a trace file, and two
// per configured model entry (its file and the page-cache probe's copy), with room to spare.
constexpr uint64_t kFixed = 96;
constexpr uint64_t kPerModel = 2;
// The HTTP server: its listener, two workers' connections and 32 queued (metrics_server.cpp).
constexpr uint64_t kMetrics = 1 + 2 + 32 + 1;
// A connection, the client's pidfd and its telemetry ring (a model clients register is opened once
// for all of them: the fixed room holds a few dozen).
constexpr uint64_t kPerClient = 3;

}  // namespace

uint64_t nofile_limit() {
    rlimit r{};
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return UINT64_MAX;
    return r.rlim_cur;
}

bool DescriptorBudget::fits() const { return clients >= configured; }

DescriptorBudget descriptor_budget(const Config& c, uint64_t limit) {
    DescriptorBudget b;
    b.fixed = kFixed + kPerModel * c.models.size();
    b.metrics = c.metrics_listen.empty() ? 0 : kMetrics;
    b.per_client = kPerClient;
    b.limit = limit;
    b.configured = c.max_clients;
    const uint64_t room = limit > b.fixed + b.metrics ? limit - b.fixed - b.metrics : 0;
    b.clients = static_cast<uint32_t>(std::min<uint64_t>(c.max_clients, room / b.per_client));
    return b;
}

std::string describe(const DescriptorBudget& b) {
    if (b.fits())
        return fmt::format("descriptors: [clients] max = {} needs about {} of RLIMIT_NOFILE {}", b.configured,
                           b.needed(b.configured), b.limit);
    return fmt::format("descriptors: [clients] max = {} needs about {} but RLIMIT_NOFILE is {}: at most {} client(s) at "
                       "once; lower [clients] max or raise the limit (LimitNOFILE= in the unit, ulimit -n)",
                       b.configured, b.needed(b.configured), b.limit, b.clients);
}

}  // namespace moecache::daemon
