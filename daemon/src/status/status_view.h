// The daemon's status as plain values (status.h): what D-Bus, moecachectl and /metrics read,
// gathered from each part of the daemon, read only. A view is made for one call and holds
// references to the parts, never their state.
#pragma once

#include "moecache/daemon/config.h"
#include "moecache/daemon/error_log.h"
#include "moecache/daemon/status.h"

#include <cstdint>

namespace moecache::daemon {

class BusLink;
class ClientHub;
class ClientSessions;
class DecideStep;
class MetricsServer;
class ModelRegistry;
class PageCacheWatch;
class Prefetcher;
class RouterTrace;
struct ModelEntry;

struct StatusView {
    const Config& config;
    uint64_t mem_total;
    const ModelRegistry& models;
    const DecideStep& decide;
    const ClientHub& hub;
    const ClientSessions& sessions;
    const PageCacheWatch& page_cache;
    const BusLink& bus;
    const Prefetcher& prefetcher;
    const MetricsServer* metrics;  // none when [metrics] listen is off or its port was busy
    const RouterTrace& trace;
    const ErrorLog& errors;

    // experts = false leaves ModelStatus::experts empty (the totals are still counted).
    [[nodiscard]] DaemonStatus daemon(bool experts) const;
    [[nodiscard]] ModelStatus model(const ModelEntry& m, bool experts) const;
    // Nothing fetching, nothing waiting to be locked, no fact waiting for a decision.
    [[nodiscard]] bool idle() const;
    // Every live client's pool that serves the model holds nine in ten of the model's experts it
    // was directed to keep (a client that has a pool but has not said how large is not settled yet).
    [[nodiscard]] bool pools_settled(const ModelEntry& m) const;
};

}  // namespace moecache::daemon
