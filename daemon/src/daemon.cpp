#include "moecache/daemon/daemon.h"
#include "moecache/daemon/descriptors.h"
#include "moecache/daemon/system_memory.h"

#include "bus/bus_link.h"
#include "clients/client_hub.h"
#include "control/operator.h"
#include "event_source.h"
#include "intake/intake.h"
#include "metrics/metrics_server.h"
#include "moecache/daemon/metrics.h"
#include "pagecache/page_cache_watch.h"
#include "sessions/client_sessions.h"
#include "status/status_view.h"

#include "moecache/daemon/decide_step.h"
#include "moecache/daemon/off_loop.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/daemon/pressure.h"
#include "moecache/file_util.h"
#include "moecache/log.h"

#include <fcntl.h>
#include <glob.h>
#include <grp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

namespace moecache::daemon {

Daemon::~Daemon() {
    if (models_)
        for (auto& m : models_->all())
            if (m->res) models_->close(*m, "the daemon stops");
    // Whoever embeds the daemon (tests, tools) gets its signals back.
    if (sigmask_saved_) ::pthread_sigmask(SIG_SETMASK, &saved_sigmask_, nullptr);
}

namespace {
// [dbus] admin_group's id, looked up when the configuration is (never in the loop's hot path: NSS
// may ask a directory service).
std::optional<gid_t> group_id(const std::string& name) {
    if (name.empty()) return std::nullopt;
    if (const group* g = ::getgrnam(name.c_str())) return g->gr_gid;
    return std::nullopt;
}
// [daemon] oom_score_adj, unless the service manager (OOMScoreAdjust=) or a parent set one.
// [clients] max as the descriptors allow: fewer clients, said once, rather than a loop that runs
// out of descriptors for the models, /metrics and the bus.
void fit_clients_to_descriptors(Config& c) {
    const DescriptorBudget b = descriptor_budget(c, nofile_limit());
    if (b.fits()) return;
    MC_LOG(LOG_WARNING, "{}", describe(b));
    c.max_clients = std::max<uint32_t>(b.clients, 1);
}

void protect_from_oom(int adj) {
    if (adj == 0) return;
    const auto now = read_whole_file("/proc/self/oom_score_adj", 64, "oom_score_adj");
    if (!now || std::atoi(now->c_str()) != 0) return;
    UniqueFd f(::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC));
    const std::string text = std::to_string(adj);
    if (!f || ::write(f.get(), text.data(), text.size()) < 0)
        MC_LOG(LOG_INFO, "oom_score_adj stays 0 ([daemon] oom_score_adj = {}): {}", adj, std::strerror(errno));
    else
        MC_LOG(LOG_INFO, "oom_score_adj {}: the model pages it locks count in its RSS, not its own use", adj);
}

}  // namespace

Result<std::unique_ptr<Daemon>> Daemon::create(Config config) {
    std::unique_ptr<Daemon> d(new Daemon());
    d->config_ = std::move(config);
    d->mem_total_ = mem_total_bytes();
    d->admin_gid_ = group_id(d->config_.dbus_admin_group);
    protect_from_oom(d->config_.oom_score_adj);
    MC_TRY_VOID(validate_config(d->config_, d->mem_total_));
    fit_clients_to_descriptors(d->config_);
    if (const auto cg = own_memory_cgroup_limit())
        MC_LOG(LOG_INFO, "memory cgroup {} (v{}) limits the daemon to {} MiB: locks stay below it by the reserve",
               cg->dir, cg->version, cg->limit >> 20);

    d->epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!d->epoll_) return fail_errno("epoll_create1");
    d->bus_ = std::make_unique<BusLink>(d->config_, d->epoll_.get());
    auto watch = [&](EventSource source, int fd, uint32_t events) -> Result<void> {
        epoll_event ev{};
        ev.events = events;
        ev.data.u64 = event_data(source, fd);
        if (::epoll_ctl(d->epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return fail_errno("epoll_ctl add fd {}", fd);
        return {};
    };

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGHUP);
    // Blocked in this thread so that they arrive through the signalfd; threads created later
    // (io_uring workers) inherit the mask.
    ::pthread_sigmask(SIG_BLOCK, &mask, &d->saved_sigmask_);
    d->sigmask_saved_ = true;
    d->signal_fd_.reset(::signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC));
    if (!d->signal_fd_) return fail_errno("signalfd");
    MC_TRY_VOID(watch(EventSource::Signal, d->signal_fd_.get(), EPOLLIN));

    d->timer_fd_.reset(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!d->timer_fd_) return fail_errno("timerfd_create");
    MC_TRY_VOID(d->arm_tick());
    MC_TRY_VOID(watch(EventSource::Timer, d->timer_fd_.get(), EPOLLIN));

    Prefetcher::Options po;
    po.queue_depth = d->config_.queue_depth;
    po.read_size = d->config_.read_size;
    po.numa_node = d->config_.numa_node;
    po.engine = d->config_.prefetch_engine == "threads"    ? Prefetcher::Engine::Threads
                : d->config_.prefetch_engine == "io_uring" ? Prefetcher::Engine::IoUring
                                                            : Prefetcher::Engine::Auto;
    po.threads = d->config_.prefetch_threads;
    d->prefetcher_ = std::make_unique<Prefetcher>(MC_TRY(Prefetcher::create(po)));
    Daemon* self = d.get();
    d->prefetcher_->set_callback(
        [self](uint64_t, uint64_t tag, uint64_t bytes, int err) { self->decide_->on_fetched(tag, bytes, err); });
    MC_TRY_VOID(watch(EventSource::Reads, d->prefetcher_->event_fd(), EPOLLIN));
    d->off_loop_ = std::make_unique<OffLoop>(MC_TRY(OffLoop::create()));
    MC_TRY_VOID(watch(EventSource::OffLoop, d->off_loop_->event_fd(), EPOLLIN));

    if (d->config_.pressure_enabled) {
        auto pm = PressureMonitor::open(d->config_.pressure_stall_us, d->config_.pressure_window_us);
        if (pm) {
            d->pressure_ = std::make_unique<PressureMonitor>(std::move(*pm));
            for (const auto& trig : d->pressure_->triggers()) MC_TRY_VOID(watch(EventSource::Pressure, trig.fd.get(), trig.events));
        } else {
            MC_LOG(LOG_WARNING, "memory pressure back-off is off: {}", pm.error().what());
        }
    }

    d->page_cache_ = MC_TRY(PageCacheWatch::open(d->config_));
    if (d->page_cache_->on()) MC_TRY_VOID(watch(EventSource::PageCache, d->page_cache_->event_fd(), EPOLLIN));

    d->hub_ = std::make_unique<ClientHub>(d->config_, d->epoll_.get());
    d->models_ = std::make_unique<ModelRegistry>(d->config_, *d->off_loop_, *d->prefetcher_, *d->page_cache_,
                                                 d->errors_, static_cast<RegistryEvents&>(*d));
    d->decide_ = std::make_unique<DecideStep>(d->config_, d->mem_total_, d->admin_gid_, *d->models_, *d->hub_,
                                              *d->prefetcher_, d->errors_);
    d->intake_ = std::make_unique<Intake>(d->config_, *d->models_, *d->page_cache_, *d->decide_, d->trace_);
    d->sessions_ = std::make_unique<ClientSessions>(
        d->config_, d->admin_gid_, *d->models_, *d->hub_, *d->decide_,
        [self = d.get()](ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens,
                         bool continued) { self->intake_->routing(m, block, experts, tokens, continued); });
    d->operator_ =
        std::make_unique<Operator>(d->config_, d->mem_total_, *d->models_, *d->hub_, *d->decide_, *d->prefetcher_,
                                   *d->bus_, d->trace_, d->errors_, [self = d.get()] { return self->view(); });
    MC_TRY_VOID(d->hub_->listen());

    if (!d->config_.metrics_listen.empty()) {
        // A busy port is no reason not to manage memory: say so and run without metrics.
        // /health says stalled once the loop has not published for ten ticks (at least 30 s, the
        // unit's watchdog).
        const auto stalled_after = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(std::max(30.0, 10 * d->config_.tick_seconds)));
        auto m = MetricsServer::start(d->config_.metrics_listen, stalled_after);
        if (m) d->metrics_ = std::move(*m);
        else MC_LOG(LOG_WARNING, "no /metrics ([metrics] listen): {}", m.error().what());
    }

    d->models_->add_configured();
    // The configured models are open before the daemon takes requests, as far as their files answer
    // within [prefetch] read_deadline; the rest goes on in the loop. Twice: a glob's matches are
    // entries once their headers have been looked at.
    for (int i = 0; i < 2; ++i) {
        d->models_->refresh();
        d->off_loop_->wait_all();
    }
    // A model opened early in these waits had its experts' reads issued at once, and then waited
    // with the loop for the others' headers (a hung one: the whole deadline): timed from the
    // start, the first tick took them for a hung file and set a healthy model aside.
    d->prefetcher_->restart_deadlines();

    // As for metrics: without a bus the daemon still manages memory; say so and go on (and try
    // again now and then: the bus may start later, or come back).
    d->bus_->start(*d->operator_);
    d->last_save_ = std::chrono::steady_clock::now();
    d->decide_->place();
    return d;
}

void Daemon::open_ended(uint32_t id, bool loaded) {
    if (loaded) decide_->one_place_due(id);  // what its clients' pools hold, again for the new residency
    sessions_->finish_registrations(id);
    if (loaded) decide_->request();
}

StatusView Daemon::view() const {
    return StatusView{config_,      mem_total_, *models_,     *decide_,       *hub_,  *sessions_,
                      *page_cache_, *bus_,      *prefetcher_, metrics_.get(), trace_, errors_};
}
Control& Daemon::control() { return *operator_; }
DaemonStatus Daemon::status(bool experts) const { return operator_->status(experts); }
std::optional<ModelStatus> Daemon::model_status(uint32_t id, bool experts) const {
    return operator_->model_status(id, experts);
}
bool Daemon::idle() const { return view().idle(); }

void Daemon::record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens) {
    if (ModelEntry* m = models_->find(model); m != nullptr && m->res) intake_->routing(*m, block, experts, tokens);
}

uint64_t Daemon::plans() const { return decide_->plans(); }
Result<void> Daemon::save_profiles() { return models_->save_profiles(); }
std::optional<uint32_t> Daemon::model_id(const std::string& path) const { return models_->id_of(path); }

Result<void> Daemon::arm_tick() {
    const double t = config_.tick_seconds;
    itimerspec its{};
    its.it_interval.tv_sec = static_cast<time_t>(t);
    its.it_interval.tv_nsec = static_cast<long>((t - std::floor(t)) * 1e9);
    its.it_value = its.it_interval;
    if (::timerfd_settime(timer_fd_.get(), 0, &its, nullptr) != 0) return fail_errno("timerfd_settime ({} s)", t);
    return {};
}

void Daemon::tick() {
    hub_->tick();
    bus_->retry();
    off_loop_->turn();  // opens past their deadline
    models_->set_aside_hung_reads();
    models_->refresh();
    const auto now = std::chrono::steady_clock::now();
    // Quiet means longer than the trigger's window: a trigger fires at most once per window, so a
    // shorter wait would lift the cap in the middle of a long squeeze.
    const double quiet = std::max(config_.pressure_recover_seconds,
                                  pressure_ ? 1.5 * pressure_->window_us() / 1e6 : 0.0);
    if (decide_->tick(quiet)) MC_LOG(LOG_INFO, "memory pressure has gone: taking memory back");
    if (now - last_save_ > std::chrono::duration<double>(config_.save_interval_seconds)) {
        note(Doing::SavingProfiles, save_profiles());
        last_save_ = now;
    }
    decide_->request();
    trace_.flush();
    if (metrics_) {
        DaemonStatus s = status(/*experts=*/false);  // the counts suffice
        s.process = read_process();                  // for the process_* families alone
        metrics_->publish(render_metrics(s, config_.metrics_paths), health_problems(s), render_status_text(s));
    }
    // The tick is the daemon's heartbeat: systemd restarts a daemon whose ticks stop (WatchdogSec=).
    if (auto r = watchdog_.ping(); !r) MC_LOG(LOG_WARNING, "systemd watchdog: {}", r.error().what());
}

void Daemon::on_pressure(const std::string& source) {
    const uint64_t cap = decide_->on_pressure();
    MC_LOG(LOG_WARNING, "memory pressure ({}): releasing the coldest experts down to {} MiB locked", source, cap >> 20);
    bus_->pressure_backoff(source, cap);
    decide_->request();
}

Result<void> Daemon::reload(Config config) {
    MC_TRY_VOID(validate_config(config, mem_total_));
    fit_clients_to_descriptors(config);
    // Models no longer configured are closed; new ones are opened.
    models_->retain(
        [&](const ModelEntry& m) {
            return m.registered || m.operator_added ||
                   std::any_of(config.models.begin(), config.models.end(),
                               [&](const ModelConfig& mc) { return mc.path == m.config.path; });
        },
        "removed from the configuration");
    // What was set up once at start stays as it was: say so for each such setting that changed.
    auto fixed = [&](const char* key, const auto& before, const auto& after) {
        if (before != after)
            MC_LOG(LOG_WARNING, "reload: {} changed ({} -> {}): it takes effect when moecached restarts", key, before, after);
    };
    fixed("daemon.socket", config_.socket_path, config.socket_path);
    fixed("daemon.state_dir", config_.state_dir, config.state_dir);
    fixed("metrics.listen", config_.metrics_listen, config.metrics_listen);
    fixed("dbus.bus", config_.dbus_bus, config.dbus_bus);
    fixed("prefetch.queue_depth", config_.queue_depth, config.queue_depth);
    fixed("prefetch.read_size", config_.read_size, config.read_size);
    fixed("prefetch.engine", config_.prefetch_engine, config.prefetch_engine);
    fixed("prefetch.threads", config_.prefetch_threads, config.prefetch_threads);
    fixed("telemetry.page_cache", config_.page_cache_telemetry, config.page_cache_telemetry);
    fixed("telemetry.ring_buffer", config_.page_cache_ring_bytes, config.page_cache_ring_bytes);
    const uint64_t old_budget = config_.lock_budget.resolve(mem_total_), old_reserve = config_.reserve.resolve(mem_total_);
    const double old_tick = config_.tick_seconds;
    config_ = std::move(config);
    admin_gid_ = group_id(config_.dbus_admin_group);
    for (auto& m : models_->all())
        if (m->res) {
            m->res->set_keep_ram_copy(config_.keep_ram_copy || !m->one_place);
            decide_->one_place_due(m->id);
        }
    decide_->tell_vram_policy();  // [vram] keep_ram_copy may have changed
    if (config_.tick_seconds != old_tick)
        if (auto r = arm_tick(); !r) MC_LOG(LOG_WARNING, "daemon.tick_seconds: {}", r.error().what());
    if (config_.lock_budget.resolve(mem_total_) != old_budget)
        bus_->budget_changed("lock", config_.lock_budget.resolve(mem_total_));
    if (config_.reserve.resolve(mem_total_) != old_reserve)
        bus_->budget_changed("reserve", config_.reserve.resolve(mem_total_));
    models_->add_configured();
    for (auto& m : models_->all())
        if (m->res) m->res->heat().set_half_life(config_.decay_half_life_tokens);
    models_->refresh();
    decide_->request();
    MC_LOG(LOG_INFO, "configuration reloaded: lock budget now {} MiB", decide_->lock_cap() >> 20);
    return {};
}

Result<void> Daemon::handle_signal() {
    signalfd_siginfo si{};
    while (::read(signal_fd_.get(), &si, sizeof si) == sizeof si) {
        if (si.ssi_signo == SIGHUP) {
            if (config_.sources.empty()) continue;
            if (auto n = systemd::notify("RELOADING=1\n" + systemd::monotonic_usec()); !n)
                MC_LOG(LOG_WARNING, "systemd notification: {}", n.error().what());
            std::string outcome = "configuration reloaded";
            auto c = load_config(config_.sources.front());
            if (!c) {
                MC_LOG(LOG_ERR, "reload refused, the running configuration stays: {}", c.error().what());
                outcome = "reload refused, the running configuration stays (see the journal)";
            } else if (auto r = reload(std::move(*c)); !r) {
                MC_LOG(LOG_ERR, "reload refused: {}", r.error().what());
                outcome = "reload refused, the running configuration stays (see the journal)";
            }
            const std::string ready =
                fmt::format("READY=1\nSTATUS={}: lock cap {} MiB", outcome, decide_->lock_cap() >> 20);
            if (auto n = systemd::notify(ready); !n) MC_LOG(LOG_WARNING, "systemd notification: {}", n.error().what());
        } else {
            MC_LOG(LOG_INFO, "signal {}: stopping", si.ssi_signo);
            stopping_ = true;
        }
    }
    return {};
}

Result<void> Daemon::step(int timeout_ms) {
    struct InStep {
        DecideStep& p;
        explicit InStep(DecideStep& step) : p(step) { p.set_in_turn(true); }
        ~InStep() { p.set_in_turn(false); }
    } in_step(*decide_);
    epoll_event events[16];
    const int n = ::epoll_wait(epoll_.get(), events, 16, timeout_ms);
    if (n < 0) {
        if (errno == EINTR) return {};
        return fail_errno("epoll_wait");
    }
    bool want_place = false, bus_ready = false;
    // Each event says which source it is (its epoll data): one handler per source.
    for (int i = 0; i < n; ++i) {
        const auto source = static_cast<EventSource>(events[i].data.u64 >> 32);
        const auto fd = static_cast<int>(events[i].data.u64 & 0xffffffffu);
        switch (source) {
            case EventSource::Signal:
                MC_TRY_VOID(handle_signal());
                break;
            case EventSource::Timer: {
                uint64_t expirations;
                while (::read(fd, &expirations, sizeof expirations) > 0) {}
                tick();
                break;
            }
            case EventSource::Listener:
                hub_->accept();
                break;
            case EventSource::Client:
                hub_->on_event(fd, events[i].events,
                               [this](Client& c, Packet& p) { return sessions_->on_packet(c, p); });
                break;
            case EventSource::PageCache:
                break;  // read below, on every turn
            case EventSource::Bus:
                bus_ready = true;
                break;
            case EventSource::OffLoop:
                off_loop_->turn();
                break;
            case EventSource::Reads:
                MC_TRY_VOID(prefetcher_->on_ready());
                want_place = true;
                break;
            case EventSource::Pressure:
                if (pressure_)
                    for (const auto& t : pressure_->triggers())
                        if (t.fd.get() == fd) {
                            t.consume();
                            on_pressure(t.path);
                        }
                break;
        }
    }
    // Page-cache events wake the loop only in bulk (see bpf/): the rest are read on every turn,
    // and run() turns at least every kPollIntervalMs.
    intake_->page_cache();
    sessions_->read_rings();
    sessions_->reap();
    if (want_place) decide_->request();
    bus_->process(bus_ready);  // setters request placement
    decide_->decide_and_act();
    hub_->flush();  // directives an operator's request queued outside the placement
    // Every model added takes a new id and every model removed shrinks the list: the two together
    // change whenever the set does, so most turns compare two numbers and touch nothing.
    bus_->sync(models_->shape());
    return {};
}

Result<void> Daemon::run() {
    MC_LOG(LOG_INFO, "moecached running: lock cap {} MiB of {} MiB RAM, {} model(s) configured",
           decide_->lock_cap() >> 20, mem_total_ >> 20, config_.models.size());
    if (auto w = systemd::Watchdog::from_environment(); w) watchdog_ = *w;
    else MC_LOG(LOG_WARNING, "systemd watchdog off: {}", w.error().what());
    const std::string ready =
        fmt::format("READY=1\nSTATUS=running: lock cap {} MiB of {} MiB RAM, {} model(s) configured",
                    decide_->lock_cap() >> 20, mem_total_ >> 20, config_.models.size());
    if (auto n = systemd::notify(ready); !n) MC_LOG(LOG_WARNING, "systemd notification: {}", n.error().what());
    while (!stopping_) {
        // Ticks further apart than half the watchdog's interval cannot keep it fed: the loop does.
        const bool slow_ticks =
            watchdog_.enabled() && config_.tick_seconds * 2e6 > static_cast<double>(watchdog_.interval().count());
        int timeout = loop_timeout();
        if (slow_ticks && (timeout < 0 || watchdog_.due_in_ms() < timeout)) timeout = watchdog_.due_in_ms();
        MC_TRY_VOID(step(timeout));
        if (!slow_ticks) continue;
        if (auto r = watchdog_.ping(); !r) MC_LOG(LOG_WARNING, "systemd watchdog: {}", r.error().what());
    }
    if (auto n = systemd::notify("STOPPING=1"); !n) MC_LOG(LOG_WARNING, "systemd notification: {}", n.error().what());
    if (trace_.on()) note(Doing::StoppingTrace, operator_->stop_trace());
    if (auto r = save_profiles(); !r) MC_LOG(LOG_WARNING, "heat not saved: {}", r.error().what());
    for (auto& m : models_->all())
        if (m->res) models_->close(*m, "the daemon stops");
    return {};
}

// How long a turn may wait for events. Telemetry rings and the page-cache ring wake nobody when
// written (that would cost the writer a system call or an interrupt per event), so the loop comes
// round to read them: every 1 ms while a client's ring fills fast, 20 ms while rings exist,
// 100 ms for page-cache events alone, else only when an event arrives. A runtime's miss is such
// an event: the page-cache ring wakes the loop for it (at most once a millisecond), so the loop
// does not poll in case one comes. Polling every millisecond for 200 ms after each miss, as it
// once did, woke this loop a thousand times a second through a warm run; on a 2-vCPU VM a
// process that only wakes every millisecond cost a runtime on the other vCPU ~12 % of its speed.
int Daemon::loop_timeout() const {
    int t = -1;
    if (sessions_->busy_rings())
        t = 1;
    else if (sessions_->any_rings())
        t = 20;
    else if (page_cache_->on())
        t = bpf::PageCacheTelemetry::kPollIntervalMs;
    if (const int b = bus_->timeout_ms(); b >= 0 && (t < 0 || b < t)) t = b;
    return t;
}

}  // namespace moecache::daemon
