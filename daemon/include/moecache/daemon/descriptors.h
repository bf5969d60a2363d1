// How many descriptors moecached needs for what its configuration allows, against RLIMIT_NOFILE,
// and how many clients fit: systemd gives a service a soft limit of 1024, and a daemon that runs
// out of descriptors cannot accept, open a model or answer /metrics. Pure: the limits come in as
// numbers, so each rule is unit-tested.
#pragma once

#include "moecache/daemon/config.h"

#include <cstdint>
#include <string>

namespace moecache::daemon {

struct DescriptorBudget {
    uint64_t fixed = 0;       // the loop, BPF, io_uring, PSI, D-Bus, configured models, a trace
    uint64_t metrics = 0;     // the HTTP server: its listener, workers and queued connections
    uint64_t per_client = 0;  // a connection, its pidfd, its ring
    uint64_t limit = 0;       // RLIMIT_NOFILE (soft) the daemon runs with
    uint32_t clients = 0;     // [clients] max, or fewer where the limit holds fewer
    [[nodiscard]] uint64_t needed(uint32_t n_clients) const { return fixed + metrics + per_client * n_clients; }
    [[nodiscard]] bool fits() const;  // the configured max fits
    uint32_t configured = 0;
};

// The budget for `c` under a soft limit of `limit` descriptors.
DescriptorBudget descriptor_budget(const Config& c, uint64_t limit);

// RLIMIT_NOFILE's soft limit now (getrlimit).
uint64_t nofile_limit();

// One line for --check and the start: what fits, or what does not and what to do.
std::string describe(const DescriptorBudget& b);

}  // namespace moecache::daemon
