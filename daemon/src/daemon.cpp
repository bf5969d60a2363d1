#include "moecache/daemon/daemon.h"
#include "moecache/daemon/system_memory.h"

#include "daemon_state.h"
#include "dbus/dbus_service.h"
#include "metrics/metrics_server.h"
#include "moecache/daemon/metrics.h"

#include "moecache/daemon/prefetcher.h"
#include "moecache/daemon/pressure.h"
#include "moecache/file_util.h"
#include "moecache/log.h"

#include <glob.h>
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
namespace {

constexpr uint64_t kLockBytesPerTurn = 512ull << 20;  // bounds how long one turn spends in mlock

// The files a configured path names: a glob expands to its matches; the parts of one split set
// count once (by part 1). A plain path that does not exist is still returned, to be retried.
std::vector<std::string> expand(const std::string& pattern) {
    if (pattern.find_first_of("*?[") == std::string::npos) return {pattern};
    glob_t g{};
    std::vector<std::string> out;
    if (::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g) == 0) {
        std::set<std::string> seen;
        for (size_t i = 0; i < g.gl_pathc; ++i) {
            std::string p = g.gl_pathv[i];
            if (auto s = parse_split_name(p)) p = split_path(s->prefix, 0, s->count);
            if (seen.insert(p).second) out.push_back(p);
        }
    }
    ::globfree(&g);
    std::sort(out.begin(), out.end());
    return out;
}

}  // namespace

uint64_t mem_total_bytes() {
    const auto m = read_system_memory();
    return m ? m->total : 0;
}
uint64_t vmlck_bytes() { return read_locked_bytes(); }
uint64_t mem_available_bytes() {
    const auto m = read_system_memory();
    return m ? m->available : 0;
}


Daemon::~Daemon() {
    for (auto& m : models_)
        if (m->res) close_model(*m, "the daemon stops");
    // Whoever embeds the daemon (tests, tools) gets its signals back.
    if (sigmask_saved_) ::pthread_sigmask(SIG_SETMASK, &saved_sigmask_, nullptr);
}

Result<std::unique_ptr<Daemon>> Daemon::create(Config config) {
    std::unique_ptr<Daemon> d(new Daemon());
    d->config_ = std::move(config);
    d->mem_total_ = mem_total_bytes();
    MC_TRY_VOID(validate_config(d->config_, d->mem_total_));
    d->cgroup_ = own_memory_cgroup_limit();
    if (d->cgroup_)
        MC_LOG(LOG_INFO, "memory cgroup {} (v{}) limits the daemon to {} MiB: locks stay below it by the reserve",
               d->cgroup_->dir, d->cgroup_->version, d->cgroup_->limit >> 20);

    d->epoll_.reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!d->epoll_) return fail_errno("epoll_create1");
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
    d->prefetcher_ = std::make_unique<Prefetcher>(MC_TRY(Prefetcher::create(po)));
    Daemon* self = d.get();
    d->prefetcher_->set_callback([self](uint64_t, uint64_t tag, uint64_t bytes, int err) { self->on_fetched(tag, bytes, err); });
    MC_TRY_VOID(watch(EventSource::Reads, d->prefetcher_->event_fd(), EPOLLIN));

    if (d->config_.pressure_enabled) {
        auto pm = PressureMonitor::open(d->config_.pressure_stall_us, d->config_.pressure_window_us);
        if (pm) {
            d->pressure_ = std::make_unique<PressureMonitor>(std::move(*pm));
            for (const auto& trig : d->pressure_->triggers()) MC_TRY_VOID(watch(EventSource::Pressure, trig.fd.get(), EPOLLPRI));
        } else {
            MC_LOG(LOG_WARNING, "memory pressure back-off is off: {}", pm.error().what());
        }
    }

    d->self_tgid_ = static_cast<uint32_t>(::getpid());
    if (d->config_.page_cache_telemetry != "off") {
        bpf::PageCacheTelemetry::Options to;
        to.ring_bytes = d->config_.page_cache_ring_bytes;
        to.ignore_tgid = static_cast<pid_t>(d->self_tgid_);
        // A runtime's read from storage wakes the loop (at most once a millisecond): on_miss reads
        // the rest of the expert then, and with it off the heat is no older.
        to.miss_wakeup_us = 1000;
        auto pc = bpf::PageCacheTelemetry::open(to, [self](const bpf::PageCacheEvent& e) { self->on_page_cache_event(e); });
        if (pc) {
            d->page_cache_ = std::make_unique<bpf::PageCacheTelemetry>(std::move(*pc));
            MC_TRY_VOID(watch(EventSource::PageCache, d->page_cache_->event_fd(), EPOLLIN));
            if (!d->page_cache_->faults_attached()) {
                d->page_cache_off_reason_ = bpf::probe_page_cache_features().missing;
                MC_LOG(LOG_NOTICE, "page-cache telemetry: reads and evictions only: {}", d->page_cache_off_reason_);
            } else {
                MC_LOG(LOG_INFO, "page-cache telemetry on: reads, evictions and faults of model files ({} KiB ring)",
                       d->config_.page_cache_ring_bytes >> 10);
            }
        } else if (d->config_.page_cache_telemetry == "on") {
            return tl::unexpected(with_context(pc.error(), "telemetry.page_cache = \"on\""));
        } else {
            d->page_cache_off_reason_ = pc.error().what();
            MC_LOG(LOG_WARNING, "page-cache telemetry is off, the daemon runs on the telemetry it has: {}",
                   d->page_cache_off_reason_);
        }
    } else {
        d->page_cache_off_reason_ = "telemetry.page_cache = \"off\" in the configuration";
    }

    if (!d->config_.socket_path.empty()) {
        auto server = SocketServer::listen(d->config_.socket_path);
        if (!server) return tl::unexpected(with_context(server.error(), "the client socket ([daemon] socket)"));
        d->server_ = std::make_unique<SocketServer>(std::move(*server));
        MC_TRY_VOID(watch(EventSource::Listener, d->server_->fd(), EPOLLIN));
    }

    if (!d->config_.metrics_listen.empty()) {
        // A busy port is no reason not to manage memory: say so and run without metrics.
        auto m = MetricsServer::start(d->config_.metrics_listen);
        if (m) d->metrics_ = std::move(*m);
        else MC_LOG(LOG_WARNING, "no /metrics ([metrics] listen): {}", m.error().what());
    }

    d->add_plain_models();
    d->refresh_models();

    if (d->config_.dbus_bus != "off") {
        // As for metrics: without a bus the daemon still manages memory; say so and go on.
        auto b = DbusService::open(*d, d->config_.dbus_bus, d->config_.dbus_admin_group);
        if (b) {
            d->dbus_ = std::move(*b);
            d->bus_events_ = d->dbus_->epoll_events();
            MC_TRY_VOID(watch(EventSource::Bus, d->dbus_->fd(), d->bus_events_));
            MC_LOG(LOG_INFO, "D-Bus: org.moecache1 on the {} bus", d->dbus_->bus());
        } else {
            MC_LOG(LOG_WARNING, "no D-Bus API ([dbus] bus): {}", b.error().what());
        }
    }
    d->last_save_ = std::chrono::steady_clock::now();
    d->place();
    return d;
}

Result<void> Daemon::arm_tick() {
    const double t = config_.tick_seconds;
    itimerspec its{};
    its.it_interval.tv_sec = static_cast<time_t>(t);
    its.it_interval.tv_nsec = static_cast<long>((t - std::floor(t)) * 1e9);
    its.it_value = its.it_interval;
    if (::timerfd_settime(timer_fd_.get(), 0, &its, nullptr) != 0) return fail_errno("timerfd_settime ({} s)", t);
    return {};
}

uint64_t Daemon::lock_cap() const {
    const uint64_t budget = config_.lock_budget.resolve(mem_total_);
    const uint64_t reserve = config_.reserve.resolve(mem_total_);
    const uint64_t ram_cap = mem_total_ > reserve ? mem_total_ - reserve : 0;
    // Inside a memory cgroup the limit is the RAM there is: locking past it would leave the
    // processes charged with it (a runtime beside the daemon) nothing but the OOM killer.
    const uint64_t limit = cgroup_ ? cgroup_->limit : UINT64_MAX;
    const uint64_t cgroup_cap = limit > reserve ? limit - reserve : 0;
    return std::min({budget, ram_cap, cgroup_cap, pressure_cap_});
}

uint64_t Daemon::model_cap(const ModelEntry& m) const {
    uint64_t cap = m.config.budget ? m.config.budget->resolve(mem_total_) : UINT64_MAX;
    if (const auto* u = uid_budget(m)) cap = std::min(cap, u->resolve(mem_total_));
    return cap;
}

const ByteAmount* Daemon::uid_budget(const ModelEntry& m) const {
    if (!m.registered) return nullptr;
    const auto it = config_.uid_budgets.find(m.owner_uid);
    return it == config_.uid_budgets.end() ? nullptr : &it->second;
}

uint64_t Daemon::uid_locked(uint32_t uid) const {
    uint64_t t = 0;
    for (const auto& m : models_)
        if (m->res && m->registered && m->owner_uid == uid) t += m->res->locked_bytes();
    return t;
}

std::string Daemon::family_of(const ModelEntry& m) const {
    if (!m.config.family.empty()) return m.config.family;
    return m.res ? m.res->model().profile_key() : std::string();
}

uint64_t Daemon::family_cap(const ModelEntry& m) const {
    uint64_t cap = UINT64_MAX;
    const std::string f = family_of(m);
    for (const auto& o : models_)
        if (o->res && o->config.family_budget && family_of(*o) == f) cap = std::min(cap, o->config.family_budget->resolve(mem_total_));
    return cap;
}

uint64_t Daemon::family_locked(const ModelEntry& m) const {
    uint64_t t = 0;
    const std::string f = family_of(m);
    for (const auto& o : models_)
        if (o->res && family_of(*o) == f) t += o->res->locked_bytes();
    return t;
}

uint64_t Daemon::total_locked() const {
    uint64_t t = 0;
    for (const auto& m : models_)
        if (m->res) t += m->res->locked_bytes();
    return t;
}

std::string Daemon::profile_path(const std::string& key) const {
    return config_.state_dir + "/profiles/" + key + ".json";
}

void Daemon::add_entry(const ModelConfig& mc, const std::string& path) {
    const bool known = std::any_of(models_.begin(), models_.end(), [&](const auto& m) { return m->path == path; });
    if (known) return;
    auto e = std::make_unique<ModelEntry>();
    e->id = next_model_id_++;
    e->config = mc;
    e->path = path;
    models_.push_back(std::move(e));
}

void Daemon::add_plain_models() {
    // Plain paths get their entry now (and are retried while missing); globs in refresh_models().
    for (const auto& mc : config_.models)
        if (mc.path.find_first_of("*?[") == std::string::npos) add_entry(mc, mc.path);
}

void Daemon::refresh_models() {
    // Globs may match new files. A model whose file changed or went away is closed and retried.
    for (const auto& mc : config_.models)
        if (mc.path.find_first_of("*?[") != std::string::npos)
            for (const auto& p : expand(mc.path)) add_entry(mc, p);
    for (auto& m : models_) {
        if (m->res) {
            auto same = m->res->model().unchanged();
            if (!same || !*same) close_model(*m, same ? "the file changed on disk or went away" : same.error().what());
        }
        if (!m->res) open_model(*m);
    }
}

void Daemon::open_model(ModelEntry& m) {
    auto res = ModelResidency::open(m.path, m.config, config_.decay_half_life_tokens);
    if (!res) {
        const std::string why = res.error().what();
        if (why != m.error) MC_LOG(LOG_WARNING, "model {} is not loaded (retrying): {}", m.path, why);
        m.error = why;
        return;
    }
    m.res = std::move(*res);
    m.res->set_keep_ram_copy(config_.keep_ram_copy);
    m.error.clear();
    watch_files(m);
    const auto& map = m.res->model().map();
    MC_LOG(LOG_INFO, "model {} loaded: {} MoE layers x {} experts, {} files", m.path, map.layers.size(), map.n_experts,
           map.files.size());
    // A family member already loaded: share its heat (which has its profile already).
    const std::string family = family_of(m);
    for (const auto& o : models_) {
        if (o.get() == &m || !o->res || family_of(*o) != family) continue;
        const auto& h = o->res->heat();
        if (h.n_layers() != m.res->heat().n_layers() || h.n_experts() != m.res->heat().n_experts()) {
            MC_LOG(LOG_WARNING, "model {}: family {}: its shape differs from {}'s: heat not shared", m.path, family, o->path);
            continue;
        }
        m.res->share_heat(o->res->shared_heat());
        MC_LOG(LOG_INFO, "model {}: family {}: shares heat with {}", m.path, family, o->path);
        m.warm_pending = config_.warm_start && h.clock() > 0;
        note("reading the page cache's residency", m.res->refresh_cached());
        return;
    }
    const std::string pp = profile_path(m.res->model().profile_key());
    if (::access(pp.c_str(), F_OK) == 0) {
        auto text = read_whole_file(pp, 256u << 20, "heat profile");
        auto ok = text ? m.res->heat().load_profile(*text, m.res->model().profile_key(), pp)
                       : Result<void>(tl::unexpected(text.error()));
        if (ok) MC_LOG(LOG_INFO, "model {}: heat profile {} loaded: starting warm", m.path, pp);
        else MC_LOG(LOG_WARNING, "model {}: heat profile ignored: {}", m.path, ok.error().what());
        m.warm_pending = ok && config_.warm_start;
    }
    note("reading the page cache's residency", m.res->refresh_cached());
}

void Daemon::close_model(ModelEntry& m, const std::string& why) {
    if (!m.res) return;
    for (const auto& [s, f] : m.prefetching) prefetcher_->cancel(fetch_tag(m.id, s, true));
    m.prefetching.clear();
    MC_LOG(LOG_WARNING, "model {} closed: {}", m.path, why);
    const std::string key = m.res->model().profile_key();
    if (auto r = write_file_atomic(profile_path(key), m.res->heat().to_profile(key)); !r)
        MC_LOG(LOG_WARNING, "model {}: heat not saved: {}", m.path, r.error().what());
    for (uint32_t s = 0; s < m.res->n_slots(); ++s) {
        if (m.res->state(s).tier() == Tier::Fetching) prefetcher_->cancel(fetch_tag(m.id, s));
        note("unlocking a closed model", m.res->release(s, false));
    }
    if (m.res->state(kDenseSlot).tier() == Tier::Fetching) prefetcher_->cancel(fetch_tag(m.id, kDenseSlot));
    note("unlocking a closed model", m.res->release(kDenseSlot, false));
    unwatch_files(m);
    m.res.reset();
    m.waiting.clear();
}

void Daemon::watch_files(ModelEntry& m) {
    if (!page_cache_) return;
    const auto& files = m.res->model().files();
    for (uint32_t i = 0; i < files.size(); ++i) {
        const uint32_t id = next_file_id_++;
        if (auto r = page_cache_->watch(files[i].identity.dev, files[i].identity.ino, id); !r) {
            MC_LOG(LOG_WARNING, "model {}: {}", m.path, r.error().what());
            continue;
        }
        watched_[id] = WatchedFile{&m, i};
        m.file_ids.push_back(id);
    }
}

void Daemon::unwatch_files(ModelEntry& m) {
    if (!page_cache_ || !m.res) return;
    const auto& files = m.res->model().files();
    for (uint32_t id : m.file_ids) {
        const auto it = watched_.find(id);
        if (it == watched_.end()) continue;
        // Another entry may watch the same inode now (a model configured twice): leave it then.
        const auto& f = files[it->second.file];
        watched_.erase(it);
        const bool shared = std::any_of(models_.begin(), models_.end(), [&](const auto& o) {
            if (o.get() == &m || !o->res) return false;
            return std::any_of(o->res->model().files().begin(), o->res->model().files().end(),
                               [&](const ModelFile& of) { return of.identity.dev == f.identity.dev && of.identity.ino == f.identity.ino; });
        });
        if (!shared) note("unwatching a model file's page cache", page_cache_->unwatch(f.identity.dev, f.identity.ino));
    }
    m.file_ids.clear();
}

void Daemon::on_page_cache_event(const bpf::PageCacheEvent& e) {
    ++page_cache_events_;
    const auto it = watched_.find(e.file_id);
    ModelEntry* m = it != watched_.end() && it->second.model->res ? it->second.model : nullptr;
    if (!m) {
        ++page_cache_unattributed_;  // sent before its model was closed
        return;
    }
    constexpr uint64_t kPage = 4096;
    const uint64_t begin = e.first_page * kPage;
    const uint64_t end = begin + uint64_t{e.pages} * kPage;
    const bool own = e.tgid == self_tgid_;
    using K = bpf::PageCacheEventKind;
    if (e.kind == K::Fault || e.kind == K::Mapped) {
        // One fault is one use of one expert: the one that owns most of the reported range. A
        // Mapped event reports the fault-around window (16 pages), not the faulting page; the
        // re-armer puts its page in the middle of an expert's slice, so that expert owns most of
        // the window whenever the slice is at least as large as the window.
        uint32_t best = kDenseSlot;
        uint64_t best_bytes = 0;
        m->res->for_each_slot(it->second.file, begin, end, [&](uint32_t slot, uint64_t bytes) {
            if (bytes > best_bytes) {
                best = slot;
                best_bytes = bytes;
            }
        });
        if (best_bytes == 0) return;
        ++m->res->telemetry(best).faults;
        if (best != kDenseSlot) used_this_batch_.emplace_back(m->id, best);
        return;
    }
    m->res->for_each_slot(it->second.file, begin, end, [&](uint32_t slot, uint64_t bytes) {
        SlotTelemetry& t = m->res->telemetry(slot);
        if (e.kind == K::Deleted) {
            t.evicted_bytes += bytes;
        } else if (own) {
            t.prefetch_bytes += bytes;
        } else {
            t.read_bytes += bytes;
            if (slot != kDenseSlot) {
                used_this_batch_.emplace_back(m->id, slot);
                missed_this_batch_.emplace_back(m->id, slot);
            }
        }
    });
}

void Daemon::consume_page_cache() {
    if (!page_cache_) return;
    auto thread_cpu = [] {
        timespec ts{};
        ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
    };
    const double cpu0 = thread_cpu();
    consume_page_cache_batch();
    page_cache_cpu_ += thread_cpu() - cpu0;
}

void Daemon::consume_page_cache_batch() {
    // Bounded, so that a flood cannot hold the loop: the ring's fd stays readable for the next turn.
    page_cache_->consume(1u << 16);
    fetch_missed();
    if (used_this_batch_.empty()) return;
    // One use per expert per batch: a read of one expert arrives as several folios.
    std::sort(used_this_batch_.begin(), used_this_batch_.end());
    used_this_batch_.erase(std::unique(used_this_batch_.begin(), used_this_batch_.end()), used_this_batch_.end());
    for (auto& m : models_) {
        if (!m->res) continue;
        const uint32_t n = m->res->n_experts();
        for (const auto& [id, slot] : used_this_batch_) {
            if (id != m->id || slot >= m->res->n_slots()) continue;
            const uint32_t expert = slot % n;
            m->res->heat().record(slot / n, std::span<const uint32_t>(&expert, 1));
        }
    }
    used_this_batch_.clear();
}

// A runtime read part of these experts from storage: read the rest of each at once, ahead of
// everything else queued, so that its next faults in them hit the page cache instead of waiting
// for storage one page at a time (a runtime that maps with MADV_RANDOM, as lazy load does, reads
// nothing around a fault).
void Daemon::fetch_missed() {
    if (missed_this_batch_.empty()) return;
    if (config_.on_miss) {
        std::sort(missed_this_batch_.begin(), missed_this_batch_.end());
        missed_this_batch_.erase(std::unique(missed_this_batch_.begin(), missed_this_batch_.end()), missed_this_batch_.end());
        for (const auto& [id, slot] : missed_this_batch_) {
            ModelEntry* m = find_model(id);
            if (!m || !m->res || slot >= m->res->n_slots() || !m->res->wanted_in_ram(slot)) continue;
            // Being read for a lock already: that read is as good.
            if (m->res->state(slot).tier() != Tier::Storage) continue;
            const uint64_t q = cache_fetch(*m, slot, FetchReason::Miss);
            if (q == 0) continue;
            ++miss_fetches_;
            miss_fetch_bytes_ += q;
        }
        if (auto r = prefetcher_->submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    }
    missed_this_batch_.clear();
}

// What a warm start reads beyond the lock plan: experts the profile saw used (admitted), the
// hottest that fit, not locked, as far as the memory there is now goes (the machine's
// MemAvailable, and the room left under the daemon's memory cgroup limit) less the reserve (what
// a runtime starting beside it will allocate) and less what the lock plan still has to read.
// They are read coldest first: the page cache's LRU then takes back the coldest of them first
// when the runtime needs the memory.
void Daemon::warm_model(ModelEntry& m, const Plan& plan, uint32_t model_index) {
    m.warm_pending = false;
    auto& r = *m.res;
    uint64_t room = memory_now_.available;
    if (cgroup_) room = std::min(room, cgroup_->limit > cgroup_->usage ? cgroup_->limit - cgroup_->usage : 0);
    std::vector<uint8_t> planned(r.n_slots(), 0);
    uint64_t to_lock = 0;
    for (const auto& p : plan.lock) {
        if (p.model != model_index) continue;
        if (p.slot != kDenseSlot) planned[p.slot] = 1;
        const SlotState& st = r.state(p.slot);
        const uint64_t len = r.slot_length(p.slot);
        to_lock += len > st.cached_bytes ? len - st.cached_bytes : 0;
    }
    const uint64_t keep_free = to_lock + config_.reserve.resolve(mem_total_);
    room = room > keep_free ? room - keep_free : 0;
    if (config_.warm_limit) room = std::min(room, config_.warm_limit->resolve(mem_total_));
    const uint32_t ne = r.n_experts();
    std::vector<std::pair<double, uint32_t>> order;
    for (uint32_t s = 0; s < r.n_slots(); ++s) {
        if (planned[s] || r.state(s).tier() != Tier::Storage || !r.wanted_in_ram(s)) continue;
        if (r.heat().uses(s / ne, s % ne) < config_.admit_after_uses) continue;
        order.emplace_back(r.heat().heat(s / ne, s % ne), s);
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    uint64_t chosen_bytes = 0;
    size_t chosen = 0;
    for (; chosen < order.size(); ++chosen) {
        const uint32_t s = order[chosen].second;
        const uint64_t len = r.slot_length(s), cached = r.state(s).cached_bytes;
        const uint64_t need = len > cached ? len - cached : 0;
        if (chosen_bytes + need > room) break;
        chosen_bytes += need;
    }
    uint64_t queued = 0;
    uint32_t n = 0;
    for (size_t i = chosen; i-- > 0;) {
        const uint32_t s = order[i].second;
        if (r.state(s).cached_bytes < r.slot_length(s)) queued += cache_fetch(m, s, FetchReason::WarmStart, n++);
    }
    warm_fetch_bytes_ += queued;
    if (queued > 0)
        MC_LOG(LOG_INFO, "model {}: warm start: reading {} MiB of {} experts beyond the locks ({} MiB free for it)",
               m.path, queued >> 20, chosen, room >> 20);
}

void Daemon::place() {
    place_requested_ = false;
    ++plans_;
    // What the kernel says of memory, read once for the whole plan: no decision below reads /proc.
    if (const auto m = read_system_memory()) memory_now_ = *m;
    std::vector<ModelView> views;
    std::vector<ModelEntry*> loaded;
    std::map<std::string, uint32_t> families;
    for (auto& m : models_)
        if (m->res) {
            views.push_back(m->res->view(model_cap(*m)));
            views.back().family = families.try_emplace(family_of(*m), static_cast<uint32_t>(families.size())).first->second;
            if (m->config.family_budget) views.back().family_budget = m->config.family_budget->resolve(mem_total_);
            loaded.push_back(m.get());
        }
    const PlannerSettings s{config_.admit_after_uses, config_.elite_share, config_.hysteresis};
    const Plan plan = plan_placement(views, lock_cap(), s);
    for (const auto& r : plan.release) {
        auto& m = *loaded[r.model];
        // Dropped as well as unlocked: pages no process maps leave the page cache, so that what
        // the policy lets go frees memory; pages a runtime maps stay where they are.
        if (auto rel = m.res->release(r.slot, /*drop=*/true); !rel)
            MC_LOG(LOG_WARNING, "model {}: release: {}", m.path, rel.error().what());
        else
            tell_clients(m, r.slot, protocol::Action::Unlock);
    }
    uint32_t order = 0;
    for (const auto& r : plan.lock) {
        auto& m = *loaded[r.model];
        SlotState& st = m.res->state(r.slot);
        if (st.tier() != Tier::Storage) continue;
        if (st.cached_bytes >= m.res->slot_length(r.slot)) {
            m.waiting.push_back(r.slot);  // already cached: lock without reading
            continue;
        }
        m.res->begin_fetch(r.slot);
        for (const auto& range : m.res->ranges(r.slot)) {
            const auto& f = m.res->model().files()[range.file];
            prefetcher_->enqueue({f.fd.get(), range.offset, range.length, fetch_priority(FetchReason::Plan, order),
                                  fetch_tag(m.id, r.slot, FetchReason::Plan)});
            ++st.fetches_pending;
        }
        ++order;
    }
    for (uint32_t i = 0; i < loaded.size(); ++i)
        if (loaded[i]->warm_pending) warm_model(*loaded[i], plan, i);
    if (auto r = prefetcher_->submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    // The reserve holds against what the machine has now, not only against RAM: locking cached
    // pages takes them out of MemAvailable, so never lock below reserve.
    const uint64_t reserve = config_.reserve.resolve(mem_total_);
    const uint64_t available = memory_now_.available;
    lockable_this_turn_ = available > reserve ? available - reserve : 0;
    uint64_t budget = kLockBytesPerTurn;
    for (auto* m : loaded) {
        std::vector<uint32_t> waiting;
        waiting.swap(m->waiting);
        for (uint32_t slot : waiting) {
            if (budget == 0) {
                m->waiting.push_back(slot);
                continue;
            }
            const uint64_t bytes = m->res->slot_bytes(slot);
            try_lock(*m, slot);
            budget -= std::min(budget, bytes);
        }
    }
    direct_pools();
}

void Daemon::try_lock(ModelEntry& m, uint32_t slot) {
    SlotState& st = m.res->state(slot);
    if (st.tier() == Tier::Locked) return;
    if (!m.res->wanted_in_ram(slot)) {  // a VRAM pool took it while it was being read
        m.res->abandon(slot);
        m.res->drop_cached(slot);
        return;
    }
    const uint64_t need = m.res->slot_bytes(slot);
    const ByteAmount* ub = uid_budget(m);
    if (total_locked() + need > lock_cap() || m.res->locked_bytes() + need > model_cap(m) ||
        family_locked(m) + need > family_cap(m) ||
        (ub && uid_locked(m.owner_uid) + need > ub->resolve(mem_total_)) ||
        need > lockable_this_turn_) {
        m.res->abandon(slot);  // the plan will ask again if it still wants it
        return;
    }
    auto r = m.res->lock(slot);
    if (r) {
        lockable_this_turn_ -= std::min(lockable_this_turn_, *r);
        tell_clients(m, slot, protocol::Action::Lock);
    }
    if (!r) {
        m.res->abandon(slot);
        MC_LOG(LOG_WARNING, "model {}: lock: {}", m.path, r.error().what());
        // A file truncated or replaced under us fails here first: look at it again now.
        if (auto same = m.res->model().unchanged(); !same || !*same) close_model(m, "the file changed on disk");
    }
}

void Daemon::on_fetched(uint64_t tag, uint64_t, int err) {
    const auto id = static_cast<uint32_t>((tag >> 32) & 0x7fffffffu);
    const auto slot = static_cast<uint32_t>(tag & 0xffffffffu);
    if ((tag >> 63) != 0) {
        cache_fetched(id, slot);
        return;
    }
    for (auto& m : models_) {
        if (m->id != id || !m->res) continue;
        SlotState& st = m->res->state(slot);
        if (st.fetches_pending > 0) --st.fetches_pending;
        if (err != 0 && err != ECANCELED) MC_LOG(LOG_WARNING, "model {}: prefetch failed: {}", m->path, std::strerror(err));
        if (st.fetches_pending == 0 && st.tier() == Tier::Fetching) m->waiting.push_back(slot);
    }
}

void Daemon::note_error(const char* doing, const std::string& what) {
    auto& e = errors_[doing];
    ++e.total;
    const auto now = std::chrono::steady_clock::now();
    if (e.total > 1 && now - e.logged < std::chrono::minutes(1)) {
        ++e.unlogged;
        return;
    }
    if (e.unlogged > 0) MC_LOG(LOG_WARNING, "{} failed: {} (and {} more times since the last report)", doing, what, e.unlogged);
    else MC_LOG(LOG_WARNING, "{} failed: {}", doing, what);
    e.logged = now;
    e.unlogged = 0;
}

void Daemon::tick() {
    cgroup_ = own_memory_cgroup_limit();
    refresh_models();
    for (auto& m : models_)
        if (m->res) {
            note("reading the page cache's residency", m->res->refresh_cached());
            // One place, again each tick: a runtime's read of a neighbour can map an expert's pages
            // back (fault-around) before they were dropped.
            for (uint32_t s = 0; s < m->res->n_slots(); ++s)
                if (!m->res->wanted_in_ram(s) && m->res->state(s).cached_bytes > 0 && m->res->state(s).tier() == Tier::Storage)
                    m->res->drop_cached(s);
        }
    const auto now = std::chrono::steady_clock::now();
    // Quiet means longer than the trigger's window: a trigger fires at most once per window, so a
    // shorter wait would lift the cap in the middle of a long squeeze.
    const double quiet = std::max(config_.pressure_recover_seconds,
                                  pressure_ ? 1.5 * pressure_->window_us() / 1e6 : 0.0);
    if (pressure_cap_ != UINT64_MAX && now - last_pressure_ > std::chrono::duration<double>(quiet)) {
        MC_LOG(LOG_INFO, "memory pressure has gone: taking memory back");
        pressure_cap_ = UINT64_MAX;
    }
    if (now - last_save_ > std::chrono::duration<double>(config_.save_interval_seconds)) {
        note("saving heat profiles", save_profiles());
        last_save_ = now;
    }
    request_place();
    flush_trace();
    if (metrics_) metrics_->publish(render_metrics(status(/*experts=*/false)));  // the counts suffice
    // The tick is the daemon's heartbeat: systemd restarts a daemon whose ticks stop (WatchdogSec=).
    if (auto r = watchdog_.ping(); !r) MC_LOG(LOG_WARNING, "systemd watchdog: {}", r.error().what());
}

void Daemon::on_pressure(const std::string& source) {
    ++pressure_events_;
    last_pressure_ = std::chrono::steady_clock::now();
    const uint64_t locked = total_locked();
    const auto keep = static_cast<uint64_t>(static_cast<double>(locked) * (1.0 - config_.pressure_release_share));
    pressure_cap_ = std::min(pressure_cap_, keep);
    MC_LOG(LOG_WARNING, "memory pressure ({}): releasing the coldest experts down to {} MiB locked", source,
           pressure_cap_ >> 20);
    if (dbus_) dbus_->pressure_backoff(source, pressure_cap_);
    request_place();
}

void Daemon::record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens) {
    for (auto& m : models_)
        if (m->id == model && m->res) record_routing(*m, block, experts, tokens);
}

void Daemon::record_routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens) {
    trace_routing(m, block, experts, tokens);
    if (const auto layer = m.res->layer_of_block(block)) {
        // The clock advances once per batch: on the first MoE layer's report.
        if (*layer == 0) m.res->heat().advance_clock(tokens);
        m.res->heat().record(*layer, experts);
        if (config_.predict) prefetch_predicted(m, *layer, experts);
    }
}

void Daemon::prefetch_predicted(ModelEntry& m, uint32_t layer, std::span<const uint32_t> experts) {
    auto& r = *m.res;
    const uint32_t ne = r.n_experts();
    if (!m.prediction) {
        const uint32_t nl = r.n_slots() / std::max<uint32_t>(ne, 1);
        m.prediction = std::make_unique<ModelEntry::Prediction>(
            ModelEntry::Prediction{RoutePredictor(nl, ne), {}, std::vector<std::vector<uint32_t>>(nl)});
    }
    auto& p = *m.prediction;
    if (layer >= p.next.size()) return;
    auto& next = p.next[layer];
    if (!next.empty()) {
        uint64_t right = 0;
        for (uint32_t e : next) right += std::find(experts.begin(), experts.end(), e) != experts.end();
        p.trust.score(next.size(), right);
    }
    p.predictor.observe(layer, experts);
    p.predictor.predict_next_token(layer, experts, static_cast<uint32_t>(experts.size()), next);
    // Speculation never queues behind itself: nothing is added while reads wait to be issued.
    if (!p.trust.trusted() || prefetcher_->progress().queued_bytes > 0) return;
    uint64_t queued = 0;
    for (uint32_t e : next) {
        const uint32_t slot = layer * ne + e;
        const SlotState& st = r.state(slot);
        if (st.tier() != Tier::Storage || st.cached_bytes >= r.slot_length(slot) || !r.wanted_in_ram(slot)) continue;
        // Behind a runtime's misses, ahead of the plan's locks: the next token is tens of ms away.
        queued += cache_fetch(m, slot, FetchReason::Prediction);
    }
    if (queued == 0) return;
    predict_fetch_bytes_ += queued;
    if (auto s = prefetcher_->submit(); !s) MC_LOG(LOG_WARNING, "prefetch: {}", s.error().what());
}

Result<void> Daemon::save_profiles() {
    for (auto& m : models_) {
        if (!m->res) continue;
        const std::string key = m->res->model().profile_key();
        MC_TRY_VOID(write_file_atomic(profile_path(key), m->res->heat().to_profile(key)));
    }
    return {};
}

Result<void> Daemon::reload(Config config) {
    MC_TRY_VOID(validate_config(config, mem_total_));
    // Models no longer configured are closed; new ones are opened.
    std::vector<std::unique_ptr<ModelEntry>> kept;
    for (auto& m : models_) {
        const bool still = m->registered || m->operator_added || std::any_of(config.models.begin(), config.models.end(),
                                                          [&](const ModelConfig& mc) { return mc.path == m->config.path; });
        if (still) kept.push_back(std::move(m));
        else close_model(*m, "removed from the configuration");
    }
    models_ = std::move(kept);
    const uint64_t old_budget = config_.lock_budget.resolve(mem_total_), old_reserve = config_.reserve.resolve(mem_total_);
    const double old_tick = config_.tick_seconds;
    config_ = std::move(config);
    if (config_.tick_seconds != old_tick)
        if (auto r = arm_tick(); !r) MC_LOG(LOG_WARNING, "daemon.tick_seconds: {}", r.error().what());
    if (config_.lock_budget.resolve(mem_total_) != old_budget) announce_budget("lock", config_.lock_budget.resolve(mem_total_));
    if (config_.reserve.resolve(mem_total_) != old_reserve) announce_budget("reserve", config_.reserve.resolve(mem_total_));
    add_plain_models();
    for (auto& m : models_)
        if (m->res) m->res->heat().set_half_life(config_.decay_half_life_tokens);
    refresh_models();
    request_place();
    MC_LOG(LOG_INFO, "configuration reloaded: lock budget now {} MiB", lock_cap() >> 20);
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
            const std::string ready = fmt::format("READY=1\nSTATUS={}: lock cap {} MiB", outcome, lock_cap() >> 20);
            if (auto n = systemd::notify(ready); !n) MC_LOG(LOG_WARNING, "systemd notification: {}", n.error().what());
        } else {
            MC_LOG(LOG_INFO, "signal {}: stopping", si.ssi_signo);
            stopping_ = true;
        }
    }
    return {};
}

void Daemon::request_place() {
    place_requested_ = true;
    if (!in_step_) place();
}

Result<void> Daemon::step(int timeout_ms) {
    struct InStep {
        bool& flag;
        explicit InStep(bool& f) : flag(f) { flag = true; }
        ~InStep() { flag = false; }
    } in_step(in_step_);
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
                accept_clients();
                break;
            case EventSource::Client:
                // Looked up by descriptor: a client dropped earlier in this batch is gone.
                if (auto it = client_by_fd_.find(fd); it != client_by_fd_.end()) on_client_readable(*it->second);
                break;
            case EventSource::PageCache:
                break;  // read below, on every turn
            case EventSource::Bus:
                bus_ready = true;
                break;
            case EventSource::Reads:
                MC_TRY_VOID(prefetcher_->on_ready());
                want_place = true;
                break;
            case EventSource::Pressure:
                if (pressure_)
                    for (const auto& t : pressure_->triggers())
                        if (t.fd.get() == fd) on_pressure(t.path);
                break;
        }
    }
    // Page-cache events wake the loop only in bulk (see bpf/): the rest are read on every turn,
    // and run() turns at least every kPollIntervalMs.
    if (page_cache_) consume_page_cache();
    consume_client_telemetry();
    reap_clients();
    if (want_place) place_requested_ = true;
    if (dbus_) {
        if (bus_ready || dbus_->timeout_ms() == 0) dbus_->process();  // setters request placement
    }
    if (place_requested_) place();
    if (dbus_) sync_bus();
    return {};
}

Result<void> Daemon::run() {
    MC_LOG(LOG_INFO, "moecached running: lock cap {} MiB of {} MiB RAM, {} model(s) configured", lock_cap() >> 20,
           mem_total_ >> 20, config_.models.size());
    if (auto w = systemd::Watchdog::from_environment(); w) watchdog_ = *w;
    else MC_LOG(LOG_WARNING, "systemd watchdog off: {}", w.error().what());
    const std::string ready =
        fmt::format("READY=1\nSTATUS=running: lock cap {} MiB of {} MiB RAM, {} model(s) configured", lock_cap() >> 20,
                    mem_total_ >> 20, config_.models.size());
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
    if (tracing()) note("stopping the routing trace", stop_trace());
    if (auto r = save_profiles(); !r) MC_LOG(LOG_WARNING, "heat not saved: {}", r.error().what());
    for (auto& m : models_)
        if (m->res) close_model(*m, "the daemon stops");
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
    if (busy_rings_) t = 1;
    else if (any_rings_) t = 20;
    else if (page_cache_) t = bpf::PageCacheTelemetry::kPollIntervalMs;
    if (dbus_) {
        const int b = dbus_->timeout_ms();
        if (b >= 0 && (t < 0 || b < t)) t = b;
    }
    return t;
}

void Daemon::sync_bus() {
    if (!dbus_) return;
    // Every model added takes a new id and every model removed shrinks the list: the two together
    // change whenever the set does, so most turns compare two numbers and touch nothing.
    const std::pair<uint32_t, size_t> shape{next_model_id_, models_.size()};
    if (shape != bus_models_) {
        dbus_->sync_models();
        bus_models_ = shape;
    }
    update_bus_watch();
}

void Daemon::update_bus_watch() {
    const uint32_t want = dbus_->epoll_events();
    if (want == bus_events_) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = event_data(EventSource::Bus, dbus_->fd());
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, dbus_->fd(), &ev) == 0) bus_events_ = want;
    else MC_LOG(LOG_WARNING, "D-Bus: epoll_ctl: {}", std::strerror(errno));
}

void Daemon::announce_budget(const std::string& name, uint64_t bytes) {
    if (dbus_) dbus_->budget_changed(name, bytes);
}

std::vector<uint32_t> Daemon::model_ids() const {
    std::vector<uint32_t> ids;
    for (const auto& m : models_) ids.push_back(m->id);
    return ids;
}

bool Daemon::idle() const {
    for (const auto& m : models_) {
        if (!m->res) continue;
        if (!m->waiting.empty()) return false;
        for (uint32_t s = 0; s < m->res->n_slots(); ++s)
            if (m->res->state(s).tier() == Tier::Fetching) return false;
        if (m->res->state(kDenseSlot).tier() == Tier::Fetching) return false;
    }
    return true;
}

std::optional<uint32_t> Daemon::model_id(const std::string& path) const {
    for (const auto& m : models_)
        if (m->path == path || m->config.path == path) return m->id;
    return std::nullopt;
}

DaemonStatus Daemon::status(bool experts) const {
    DaemonStatus s;
    s.mem_total = mem_total_;
    s.lock_cap = lock_cap();
    s.lock_budget = config_.lock_budget.resolve(mem_total_);
    s.reserve = config_.reserve.resolve(mem_total_);
    s.cgroup_limit = cgroup_ ? cgroup_->limit : 0;
    s.miss_fetches = miss_fetches_;
    s.miss_fetch_bytes = miss_fetch_bytes_;
    s.warm_fetch_bytes = warm_fetch_bytes_;
    s.predict_fetch_bytes = predict_fetch_bytes_;
    for (const auto& m : models_)
        if (m->prediction) {
            s.predicted_experts += m->prediction->trust.predicted();
            s.predicted_used += m->prediction->trust.correct();
        }
    s.bus = dbus_ ? dbus_->bus() : "";
    s.tracing = tracing();
    s.trace_records = trace_records_;
    s.locked_bytes = total_locked();
    s.vmlck_bytes = read_locked_bytes();
    s.pressure_events = pressure_events_;
    s.under_pressure = pressure_cap_ != UINT64_MAX;
    const auto p = prefetcher_->progress();
    s.prefetch_done_bytes = p.done_bytes;
    s.prefetch_queued_bytes = p.queued_bytes;
    s.page_cache.enabled = page_cache_ != nullptr;
    s.page_cache.off_reason = page_cache_off_reason_;
    s.page_cache.events = page_cache_events_;
    s.page_cache.unattributed = page_cache_unattributed_;
    s.page_cache.consume_cpu_seconds = page_cache_cpu_;
    s.socket_path = server_ ? server_->path() : "";
    if (metrics_) {
        const bool v6 = metrics_->host().find(':') != std::string::npos;
        s.metrics_address = v6 ? fmt::format("[{}]:{}", metrics_->host(), metrics_->port())
                               : fmt::format("{}:{}", metrics_->host(), metrics_->port());
    }
    s.clients_refused = clients_refused_;
    for (const auto& [device, totals] : pool_totals_) {
        PoolDeviceStatus pool = totals;
        for (const auto& c : clients_) {
            if (c->dead) continue;
            if (const auto it = c->pools.find(device); it != c->pools.end()) {
                pool.pool_bytes += it->second.pool_bytes;
                ++pool.clients;
            }
        }
        s.vram_pools.push_back(pool);
    }
    s.vram_releases = vram_releases_;
    s.unmapped_copy_bytes = unmapped_bytes_;
    for (const auto& [doing, e] : errors_) s.errors[doing] = e.total;
    for (const auto& c : clients_)
        if (!c->dead && c->unmapped.no_model && c->unmapped.bytes > 0) ++s.clients_without_model;
    for (const auto& c : clients_) {
        if (c->dead) continue;
        ClientStatus cs;
        cs.id = c->id;
        cs.pid = static_cast<uint32_t>(c->peer.pid);
        cs.uid = c->peer.uid;
        cs.gid = c->peer.gid;
        cs.name = c->name;
        cs.models = c->models;
        cs.telemetry = c->ring != nullptr;
        cs.events = c->events;
        cs.bad_events = c->bad_events;
        if (c->ring) cs.overflow = c->ring->counters().overflow;
        s.clients.push_back(std::move(cs));
    }
    if (page_cache_) {
        s.page_cache.faults = page_cache_->faults_attached();
        s.page_cache.ring_bytes = page_cache_->ring_bytes();
        const auto c = page_cache_->counters();
        std::copy(std::begin(c.sent), std::end(c.sent), s.page_cache.sent);
        std::copy(std::begin(c.dropped), std::end(c.dropped), s.page_cache.dropped);
    }
    for (const auto& m : models_) s.models.push_back(model_status(*m, experts));
    return s;
}

std::optional<ModelStatus> Daemon::model_status(uint32_t id, bool experts) const {
    const ModelEntry* m = find_model(id);
    if (!m) return std::nullopt;
    return model_status(*m, experts);
}

ModelStatus Daemon::model_status(const ModelEntry& me, bool experts) const {
    const ModelEntry* m = &me;
    ModelStatus ms;
    ms.id = m->id;
    ms.path = m->path;
    ms.error = m->error;
    ms.loaded = m->res != nullptr;
    ms.registered = m->registered;
    ms.owner_uid = m->owner_uid;
    ms.budget_bytes = m->config.budget ? m->config.budget->resolve(mem_total_) : 0;
    ms.prefetching_experts = static_cast<uint32_t>(m->prefetching.size());
    if (m->res) {
        const auto& r = *m->res;
        ms.key = r.model().profile_key();
        ms.family = family_of(*m);
        ms.locked_bytes = r.locked_bytes();
        ms.dropped_bytes = r.dropped_bytes();
        ms.dense_tier = r.state(kDenseSlot).tier();
        ms.dense_bytes = r.slot_bytes(kDenseSlot);
        ms.dense_telemetry = r.telemetry(kDenseSlot);
        const auto& map = r.model().map();
        ms.n_experts_total = r.n_slots();
        if (experts) ms.experts.reserve(r.n_slots());
        for (uint32_t slot = 0; slot < r.n_slots(); ++slot) {
            ExpertStatus e;
            const uint32_t layer = slot / map.n_experts;
            e.block = map.layers[layer].index;
            e.expert = slot % map.n_experts;
            const auto& st = r.state(slot);
            e.tier = st.tier();
            e.heat = r.heat().heat(layer, e.expert);
            e.uses = r.heat().uses(layer, e.expert);
            e.pinned = r.pinned(slot);
            e.bytes = map.layers[layer].bytes_per_expert;
            e.cached_bytes = st.cached_bytes;
            e.locked_bytes = st.locked_bytes;
            e.telemetry = r.telemetry(slot);
            e.vram_holders = r.vram_holders(slot);
            ++ms.placements[static_cast<size_t>(placement(e.tier, e.vram_holders))];
            ms.expert_telemetry.read_bytes += e.telemetry.read_bytes;
            ms.expert_telemetry.prefetch_bytes += e.telemetry.prefetch_bytes;
            ms.expert_telemetry.evicted_bytes += e.telemetry.evicted_bytes;
            ms.expert_telemetry.faults += e.telemetry.faults;
            ms.experts_in_vram += e.vram_holders > 0;
            ms.experts_locked += e.tier == Tier::Locked;
            ms.experts_pinned += e.pinned;
            ms.expert_bytes += e.bytes;
            ms.expert_cached_bytes += e.cached_bytes;
            ms.expert_locked_bytes += e.locked_bytes;
            ms.read_bytes += e.telemetry.read_bytes;
            ms.evicted_bytes += e.telemetry.evicted_bytes;
            if (m->prefetching.count(slot)) ms.prefetch_pending_bytes += r.slot_length(slot);
            if (experts) ms.experts.push_back(e);
        }
    }
    return ms;
}

}  // namespace moecache::daemon
