// moecached's core: one event loop that owns all state. Every event source is a file descriptor
// in one epoll set (signals, the tick timer, prefetch completions, PSI triggers, the BPF ring
// buffer of page-cache events; the client socket joins later), so nothing else touches the state
// and nothing blocks the loop for long: storage is read by io_uring, mlock runs only on pages
// that are already cached, and one turn reads a bounded number of page-cache events.
#pragma once

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/client/protocol.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/control.h"
#include "moecache/daemon/decide.h"
#include "moecache/daemon/error_log.h"
#include "moecache/daemon/fetch.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/model_residency.h"
#include "moecache/daemon/planner.h"
#include "moecache/daemon/router_trace.h"
#include "moecache/daemon/system_memory.h"
#include "moecache/error.h"
#include "moecache/memory_cgroup.h"
#include "moecache/systemd.h"
#include "moecache/unique_fd.h"

#include <signal.h>
#include <sys/types.h>

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace moecache::daemon {

class Prefetcher;
class OffLoop;
class PressureMonitor;
class ClientHub;
class ClientSessions;
class Intake;
class Operator;
struct StatusView;
struct Client;
class MetricsServer;
class BusLink;
class PageCacheWatch;
class ModelRegistry;
class DecideStep;
struct ModelEntry;

class Daemon final : private RegistryEvents {
public:
    static Result<std::unique_ptr<Daemon>> create(Config config);
    ~Daemon();

    // Runs until SIGINT or SIGTERM (or stop()), then saves heat and unlocks everything.
    Result<void> run();
    // One turn of the loop: waits up to timeout_ms for events and handles them (tests drive this).
    // What the turn's events asked of the placement (setters, pressure, the tick, reads done) is
    // planned once, at the end of the turn.
    Result<void> step(int timeout_ms);
    // Housekeeping and placement, as the tick timer does it.
    void tick();
    // How many times the placement has been planned since the daemon started.
    [[nodiscard]] uint64_t plans() const;
    void stop() { stopping_ = true; }

    // Telemetry: a batch of `tokens` tokens routed block `block` of model `model` to `experts`.
    void record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens);
    // Applies a new configuration (SIGHUP): budgets, policy, models added or removed.
    Result<void> reload(Config config);
    // As a PSI trigger firing would.
    void on_pressure(const std::string& source);
    Result<void> save_profiles();

    // The operator's controls and view (control.h, the Operator): all D-Bus reaches of the daemon.
    [[nodiscard]] Control& control();
    [[nodiscard]] bool tracing() const { return trace_.on(); }
    // experts = false leaves ModelStatus::experts empty (the totals are still counted).
    [[nodiscard]] DaemonStatus status(bool experts = true) const;
    [[nodiscard]] std::optional<ModelStatus> model_status(uint32_t id, bool experts = true) const;
    [[nodiscard]] const Config& config() const { return config_; }
    [[nodiscard]] std::optional<uint32_t> model_id(const std::string& path) const;
    [[nodiscard]] bool idle() const;  // nothing fetching, nothing waiting to be locked

private:
    Daemon() = default;
    // RegistryEvents: the registrations waiting for the model are answered; a loaded one's pools
    // and placement are settled again.
    void open_ended(uint32_t id, bool loaded) override;
    Result<void> handle_signal();
    [[nodiscard]] StatusView view() const;  // status as plain values, from each part
    Result<void> arm_tick();  // the tick timer at config_.tick_seconds

    template <class T>
    void note(Doing doing, const Result<T>& r) {
        if (!r) errors_.note(doing, r.error().what());
    }
    [[nodiscard]] int loop_timeout() const;

    // The parts, each owning its state; a part is declared after the parts it holds references
    // to, so that it goes first.
    Config config_;
    uint64_t mem_total_ = 0;
    std::optional<gid_t> admin_gid_;  // [dbus] admin_group, resolved at start and reload
    UniqueFd epoll_, signal_fd_, timer_fd_;
    ErrorLog errors_;    // failures the loop goes on after
    RouterTrace trace_;  // moecachectl trace: router decisions to a file
    std::unique_ptr<Prefetcher> prefetcher_;
    std::unique_ptr<OffLoop> off_loop_;  // models' headers and setup, off the loop's thread
    std::unique_ptr<PressureMonitor> pressure_;
    std::unique_ptr<PageCacheWatch> page_cache_;  // its events, attributed to models' slots
    std::unique_ptr<ClientHub> hub_;              // the client socket's connections
    std::unique_ptr<MetricsServer> metrics_;
    std::unique_ptr<ModelRegistry> models_;     // the models it manages
    std::unique_ptr<DecideStep> decide_;        // the turn's decisions and their actuator
    std::unique_ptr<Intake> intake_;            // page-cache events and routing into facts
    std::unique_ptr<ClientSessions> sessions_;  // what clients say, and what it does
    std::unique_ptr<Operator> operator_;        // the operator's controls (what D-Bus calls)
    std::unique_ptr<BusLink> bus_;              // the D-Bus API's connection (to operator_)
    std::chrono::steady_clock::time_point last_save_{};
    bool stopping_ = false;
    systemd::Watchdog watchdog_;  // systemd's (WatchdogSec=), pinged from tick() and, between slow ticks, run()
    sigset_t saved_sigmask_{};
    bool sigmask_saved_ = false;
};

}  // namespace moecache::daemon
