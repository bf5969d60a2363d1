// The actuator: carries out what a loop turn's decide step chose (decide.h), and is the only code
// that changes residency state for it: unlocks and drops, reads queued for locks and warm starts,
// locks, and slots given back to storage. Clients hear of each lock and unlock, and of what their
// pools should keep, in one flush at the end. A model closed
// meanwhile (its file changed under a lock) gets nothing more this turn.
#include "moecache/daemon/decide.h"
#include "moecache/daemon/decide_step.h"

#include "clients/client_hub.h"
#include "moecache/daemon/model_registry.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/log.h"

#include <sys/sysmacros.h>

#include <algorithm>

namespace moecache::daemon {

void DecideStep::apply(const TurnActions& a, const std::vector<ModelEntry*>& loaded) {
    const auto started = std::chrono::steady_clock::now();
    const uint64_t given_back_before = counters_.evicted_before_lock;
    auto live = [&](uint32_t i) -> ModelEntry* { return i < loaded.size() && loaded[i]->res ? loaded[i] : nullptr; };
    for (const auto& r : a.release) {
        ModelEntry* m = live(r.model);
        if (m == nullptr) continue;
        // Dropped as well as unlocked: pages no process maps leave the page cache, so that what
        // the policy lets go frees memory; pages a runtime maps stay where they are.
        if (auto rel = m->res->release(r.slot, /*drop=*/true); !rel)
            MC_LOG(LOG_WARNING, "model {}: release: {}", m->path, rel.error().what());
        else
            tell_clients(*m, r.slot, protocol::Action::Unlock);
    }
    uint32_t order = 0;
    for (const auto& r : a.read) {
        ModelEntry* m = live(r.model);
        if (m == nullptr) continue;
        m->res->begin_fetch(r.slot);
        for (const auto& range : m->res->ranges(r.slot)) {
            const auto& f = m->res->model().files()[range.file];
            prefetcher_.enqueue({f.fd.get(), range.offset, range.length, fetch_priority(FetchReason::Plan, order),
                                 fetch_tag(m->id, r.slot, FetchReason::Plan)});
            m->res->read_queued(r.slot);
        }
        ++order;
    }
    for (const auto& w : a.warm) {
        ModelEntry* m = live(w.model);
        if (m == nullptr) continue;
        m->warm_pending = false;
        uint64_t queued = 0;
        uint32_t n = 0;
        for (uint32_t s : w.slots) queued += cache_fetch(*m, s, FetchReason::WarmStart, n++);
        counters_.warm_fetch_bytes += queued;
        if (queued > 0)
            MC_LOG(LOG_INFO, "model {}: warm start: reading {} MiB of {} experts beyond the locks ({} MiB free for it)",
                   m->path, queued >> 20, w.chosen, w.room >> 20);
        // Its progress, from what is to be read now (the locks' reads included), logged by quarters.
        m->warm_start = {m->res->reads_pending_bytes(), 0, std::chrono::steady_clock::now()};
    }
    if (auto r = prefetcher_.submit(); !r) MC_LOG(LOG_WARNING, "prefetch: {}", r.error().what());
    for (uint32_t i = 0; i < loaded.size(); ++i)
        if (ModelEntry* m = live(i)) m->res->set_ready(i < a.waiting.size() ? a.waiting[i] : std::vector<uint32_t>{});
    for (const auto& r : a.refused)
        if (ModelEntry* m = live(r.at.model)) m->res->abandon(r.at.slot);  // the plan asks again if it still wants it
    for (const auto& r : a.given_up)
        if (ModelEntry* m = live(r.model)) {
            m->res->abandon(r.slot);
            m->res->drop_cached(r.slot);
        }
    for (const auto& r : a.lock)
        if (ModelEntry* m = live(r.model)) lock_admitted(*m, r.slot);
    hub_.flush();
    // A turn that held the loop for long: every client waits on it (a reply, a Hello), and one that
    // waits 5 s drops its connection. Said at most every 10 s.
    const auto took = std::chrono::steady_clock::now() - started;
    if (took > std::chrono::milliseconds(500) && started - last_slow_turn_log_ > std::chrono::seconds(10)) {
        last_slow_turn_log_ = started;
        MC_LOG(LOG_WARNING,
               "a placement took {} ms: {} released, {} queued for reading, {} locked, {} given back to storage "
               "(evicted before their lock)",
               std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), a.release.size(), a.read.size(),
               a.lock.size(), counters_.evicted_before_lock - given_back_before);
    }
}

void DecideStep::lock_admitted(ModelEntry& m, uint32_t slot) {
    // Read (or found cached) for this lock, its pages can be taken back by reclaim before the lock
    // comes (a memory cgroup at its limit): mlock would read them again from storage, a page at a
    // time, inside the loop (seconds for a few experts on a busy disk, while every client waits for
    // a reply). Such a slot goes back to storage with what is cached of it: the plan reads it again.
    // On a file system without a block device (NFS, SMB, FUSE) a page read inside mlock may never
    // come back and hold the loop: there every page must be cached (read by the prefetcher, whose
    // reads have deadlines).
    const auto& files = m.res->model().files();
    const bool remote =
        std::any_of(files.begin(), files.end(), [](const ModelFile& f) { return ::major(f.identity.dev) == 0; });
    // A slot with this share of it missing from the page cache is still locked (mlock reads the
    // rest): a page or two reclaimed at an expert's edges is not worth its read again.
    constexpr uint64_t kEvictedShareDivisor = 32;
    const uint64_t slack = remote ? 0 : m.res->slot_length(slot) / kEvictedShareDivisor;
    if (const auto resident = m.res->resident_bytes(slot); resident && *resident + slack < m.res->slot_length(slot)) {
        m.res->evicted_before_lock(slot, *resident);
        ++counters_.evicted_before_lock;
        return;
    }
    if (auto r = m.res->lock(slot); r) {
        tell_clients(m, slot, protocol::Action::Lock);
        return;
    } else {
        m.res->abandon(slot);
        // Logged the first time and then once a minute with a count (a limit that refuses every
        // lock, RLIMIT_MEMLOCK without CAP_IPC_LOCK, would otherwise log each slot of each turn).
        errors_.note(Doing::LockingExpert, fmt::format("model {}: {}", m.path, r.error().what()));
    }
    // A file truncated or replaced under us fails here first: look at it again now (off the loop
    // on a network or FUSE file system, whose stat may wait for good).
    if (remote) {
        models_.look_at_remote_files();
        return;
    }
    if (auto same = m.res->model().unchanged(); !same || !*same) models_.close(m, "the file changed on disk");
}

}  // namespace moecache::daemon
