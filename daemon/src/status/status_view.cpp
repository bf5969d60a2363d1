#include "status/status_view.h"

#include "moecache/daemon/decide_step.h"
#include "moecache/daemon/helping.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/router_trace.h"
#include "moecache/daemon/system_memory.h"

#include "bus/bus_link.h"
#include "clients/access.h"
#include "clients/client_hub.h"
#include "metrics/metrics_server.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/log.h"
#include "pagecache/page_cache_watch.h"
#include "sessions/client_sessions.h"

#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace moecache::daemon {

bool StatusView::idle() const {
    // Facts the next turn decides on, reads into the page cache under way.
    if (decide.facts_pending()) return false;
    if (models.looking()) return false;  // a glob's new match: its header is being read (OffLoop)
    for (const auto& m : models.all()) {
        if (m->opening) return false;  // its header is being read (OffLoop)
        if (!m->res) continue;
        if (!m->res->ready().empty() || !m->res->cache_reads().empty()) return false;
        for (uint32_t s = 0; s < m->res->n_slots(); ++s)
            if (m->res->state(s).tier() == Tier::Fetching) return false;
        if (m->res->state(kDenseSlot).tier() == Tier::Fetching) return false;
    }
    return true;
}

DaemonStatus StatusView::daemon(bool experts) const {
    DaemonStatus s;
    s.mem_total = mem_total;
    s.lock_cap = decide.lock_cap();
    s.lock_budget = config.lock_budget.resolve(mem_total);
    s.reserve = config.reserve.resolve(mem_total);
    const auto& cg = decide.cgroup();
    s.cgroup_limit = cg ? cg->limit : 0;
    const DecideStep::Counters& pc = decide.counters();
    s.miss_fetches = pc.miss_fetches;
    s.miss_fetch_bytes = pc.miss_fetch_bytes;
    s.warm_fetch_bytes = pc.warm_fetch_bytes;
    s.predict_fetch_bytes = pc.predict_fetch_bytes;
    for (const auto& m : models.all())
        if (m->prediction) {
            s.predicted_experts += m->prediction->trust.predicted();
            s.predicted_used += m->prediction->trust.correct();
        }
    s.bus = bus.bus();
    s.tracing = trace.on();
    s.trace_records = trace.records();
    s.locked_bytes = decide.total_locked();
    s.vmlck_bytes = read_locked_bytes();
    s.pressure_events = pc.pressure_events;
    s.under_pressure = decide.under_pressure();
    const auto p = prefetcher.progress();
    s.prefetch_done_bytes = p.done_bytes;
    s.prefetch_queued_bytes = p.queued_bytes;
    s.prefetch_engine = prefetcher.setup().engine == Prefetcher::Engine::Threads ? "threads" : "io_uring";
    page_cache.fill(s.page_cache);
    s.socket_path = hub.socket_path();
    if (metrics) {
        const bool v6 = metrics->host().find(':') != std::string::npos;
        s.metrics_address = v6 ? fmt::format("[{}]:{}", metrics->host(), metrics->port())
                               : fmt::format("{}:{}", metrics->host(), metrics->port());
    }
    s.clients_refused = hub.refused();
    s.accept_pauses = hub.accept_pauses();
    s.models_set_aside = models.set_aside_count();
    for (const auto& [device, totals] : sessions.pool_totals()) {
        PoolDeviceStatus pool = totals;
        for (const auto& c : hub.all()) {
            if (c->dead) continue;
            if (const auto it = c->pools.find(device); it != c->pools.end()) {
                pool.pool_bytes += it->second.pool_bytes;
                ++pool.clients;
            }
        }
        s.vram_pools.push_back(pool);
    }
    s.vram_releases = pc.vram_releases;
    s.unmapped_copy_bytes = sessions.unmapped_bytes();
    s.errors = errors.totals();
    for (const auto& c : hub.all())
        if (!c->dead && c->unmapped.no_model && c->unmapped.bytes > 0) ++s.clients_without_model;
    for (const auto& c : hub.all()) {
        if (c->dead) continue;
        ClientStatus cs;
        cs.id = c->id;
        cs.pid = static_cast<uint32_t>(c->peer.pid);
        cs.uid = c->peer.uid;
        cs.gid = c->peer.gid;
        cs.name = c->name;
        cs.command_line_problem = command_line_problem(c->role);
        cs.models = c->models;
        cs.telemetry = c->ring != nullptr;
        cs.events = c->events;
        cs.bad_events = c->bad_events;
        if (c->ring) cs.overflow = c->ring->counters().overflow;
        for (const auto& [device, pool] : c->pools)
            if (pool.miss_path != protocol::MissPath::Unknown) cs.miss_paths.emplace_back(device, pool.miss_path);
        s.clients.push_back(std::move(cs));
    }
    for (const auto& m : models.all()) s.models.push_back(model(*m, experts));
    s.helping = helping_report(s);
    return s;
}

// Every live client's pool that serves the model holds nine in ten of the model's experts it was
// directed to keep (a client that has a pool but has not said how large is not settled yet).
bool StatusView::pools_settled(const ModelEntry& m) const {
    for (const auto& c : hub.all()) {
        if (c->dead || !c->has_pool || std::find(c->models.begin(), c->models.end(), m.id) == c->models.end()) continue;
        if (!c->pool_reported) return false;
        uint64_t promoted = 0, held = 0;
        for (auto it = c->promoted.lower_bound({m.id, 0}); it != c->promoted.end() && it->first == m.id; ++it) {
            ++promoted;
            held += c->vram.count(*it);
        }
        if (10 * held < 9 * promoted) return false;
    }
    return true;
}

ModelStatus StatusView::model(const ModelEntry& me, bool experts) const {
    const ModelEntry* m = &me;
    ModelStatus ms;
    ms.id = m->id;
    ms.path = m->path;
    ms.name = m->name.empty() ? base_name(m->path) : m->name;
    ms.error = m->error;
    ms.loaded = m->res != nullptr;
    ms.registered = m->registered;
    ms.owner_uid = m->owner_uid;
    ms.budget_bytes = m->config.budget ? m->config.budget->resolve(mem_total) : 0;
    ms.opening = m->opening;
    ms.outcome = m->outcome;
    ms.routing_reported = m->last_routed.has_value();
    if (m->res) {
        const auto& r = *m->res;
        ms.prefetching_experts = static_cast<uint32_t>(r.cache_reads().size());
        ms.key = r.model().profile_key();
        ms.family = models.family_of(*m);
        ms.locked_bytes = r.locked_bytes();
        ms.recency_share = r.heat().recency_share();
        ms.recency_applied = recency_trusted(*m);
        ms.dropped_bytes = r.dropped_bytes();
        ms.dense_tier = r.state(kDenseSlot).tier();
        ms.dense_bytes = r.slot_bytes(kDenseSlot);
        ms.dense_telemetry = r.telemetry(kDenseSlot);
        const auto& map = r.model().map();
        ms.n_experts_total = r.n_slots();
        if (experts) ms.experts.reserve(r.n_slots());
        uint64_t reads_pending = 0;  // what ModelResidency::reads_pending_bytes() counts, in this walk
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
            e.cached_bytes = st.cached_bytes();
            e.locked_bytes = st.locked_bytes();
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
            ms.experts_fetching += e.tier == Tier::Fetching;
            ms.expert_bytes += e.bytes;
            ms.expert_cached_bytes += e.cached_bytes;
            ms.expert_locked_bytes += e.locked_bytes;
            ms.read_bytes += e.telemetry.read_bytes;
            ms.evicted_bytes += e.telemetry.evicted_bytes;
            const bool cache_read = r.cache_reads().count(slot) != 0;
            if (cache_read) ms.prefetch_pending_bytes += r.slot_length(slot);
            if (cache_read || e.tier == Tier::Fetching) reads_pending += r.slot_length(slot);
            if (experts) ms.experts.push_back(e);
        }
        ms.settled = r.cache_reads().empty() && ms.experts_fetching == 0 && pools_settled(*m);
        if (m->warm_start.total > 0) {
            ms.warm_total_bytes = m->warm_start.total;
            ms.warm_done_bytes = m->warm_start.total > reads_pending ? m->warm_start.total - reads_pending : 0;
        }
    }
    return ms;
}

}  // namespace moecache::daemon
