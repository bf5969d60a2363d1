// moecached's core: one event loop that owns all state. Every event source is a file descriptor
// in one epoll set (signals, the tick timer, prefetch completions, PSI triggers; the socket and
// the BPF ring buffer join later), so nothing else touches the state and nothing blocks the loop
// for long: storage is read by io_uring, and mlock runs only on pages that are already cached.
#pragma once

#include "moecache/daemon/config.h"
#include "moecache/daemon/model_residency.h"
#include "moecache/daemon/planner.h"
#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <signal.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace moecache::daemon {

class Prefetcher;
class PressureMonitor;

struct ExpertStatus {
    uint32_t block = 0, expert = 0;
    Tier tier = Tier::Storage;
    double heat = 0;
    uint32_t uses = 0;
    bool pinned = false;
    uint64_t bytes = 0, cached_bytes = 0, locked_bytes = 0;
};

struct ModelStatus {
    uint32_t id = 0;
    std::string path;     // as configured or resolved from a glob
    std::string key;      // heat profile key
    std::string error;    // why it is not loaded, if it is not
    bool loaded = false;
    uint64_t locked_bytes = 0;
    uint64_t expert_bytes = 0, expert_cached_bytes = 0, expert_locked_bytes = 0;
    Tier dense_tier = Tier::Storage;
    uint64_t dense_bytes = 0;
    std::vector<ExpertStatus> experts;  // MoE layer-major
};

struct DaemonStatus {
    uint64_t mem_total = 0;
    uint64_t lock_cap = 0;      // the budget in force now: min(lock budget, RAM - reserve, pressure cap)
    uint64_t locked_bytes = 0;  // what the daemon locked, by its own count
    uint64_t vmlck_bytes = 0;   // what the kernel says (VmLck of this process)
    uint64_t pressure_events = 0;
    bool under_pressure = false;
    uint64_t prefetch_done_bytes = 0, prefetch_queued_bytes = 0;
    std::vector<ModelStatus> models;
};

class Daemon {
public:
    static Result<std::unique_ptr<Daemon>> create(Config config);
    ~Daemon();

    // Runs until SIGINT or SIGTERM (or stop()), then saves heat and unlocks everything.
    Result<void> run();
    // One turn of the loop: waits up to timeout_ms for events and handles them (tests drive this).
    Result<void> step(int timeout_ms);
    // Housekeeping and placement, as the tick timer does it.
    void tick();
    void stop() { stopping_ = true; }

    // Telemetry: a batch of `tokens` tokens routed block `block` of model `model` to `experts`.
    void record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens);
    // Applies a new configuration (SIGHUP): budgets, policy, models added or removed.
    Result<void> reload(Config config);
    // As a PSI trigger firing would.
    void on_pressure(const std::string& source);
    Result<void> save_profiles();

    [[nodiscard]] DaemonStatus status() const;
    [[nodiscard]] std::optional<uint32_t> model_id(const std::string& path) const;
    [[nodiscard]] bool idle() const;  // nothing fetching, nothing waiting to be locked

private:
    struct ModelEntry;
    Daemon() = default;
    void add_entry(const ModelConfig& mc, const std::string& path);
    void add_plain_models();
    void refresh_models();
    void open_model(ModelEntry& m);
    void close_model(ModelEntry& m, const std::string& why);
    void place();
    void on_fetched(uint64_t tag, uint64_t bytes, int err);
    void try_lock(ModelEntry& m, uint32_t slot);
    [[nodiscard]] uint64_t lock_cap() const;
    [[nodiscard]] uint64_t model_cap(const ModelEntry& m) const;
    [[nodiscard]] uint64_t total_locked() const;
    [[nodiscard]] std::string profile_path(const std::string& key) const;
    Result<void> handle_signal();

    Config config_;
    uint64_t mem_total_ = 0;
    UniqueFd epoll_, signal_fd_, timer_fd_;
    std::unique_ptr<Prefetcher> prefetcher_;
    std::unique_ptr<PressureMonitor> pressure_;
    std::vector<std::unique_ptr<ModelEntry>> models_;
    uint32_t next_model_id_ = 0;
    uint64_t pressure_cap_ = UINT64_MAX;
    uint64_t lockable_this_turn_ = 0;  // MemAvailable - reserve, counted down as a turn locks
    uint64_t pressure_events_ = 0;
    std::chrono::steady_clock::time_point last_pressure_{}, last_save_{};
    bool stopping_ = false;
    sigset_t saved_sigmask_{};
    bool sigmask_saved_ = false;
};

// Total and available RAM (MemTotal, MemAvailable) and this process's VmLck, from /proc.
uint64_t mem_total_bytes();
uint64_t vmlck_bytes();
uint64_t mem_available_bytes();

}  // namespace moecache::daemon
