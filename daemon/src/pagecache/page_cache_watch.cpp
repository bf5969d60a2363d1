#include "pagecache/page_cache_watch.h"

#include "moecache/daemon/model_residency.h"
#include "moecache/log.h"

#include <unistd.h>

#include <algorithm>
#include <ctime>

namespace moecache::daemon {

Result<std::unique_ptr<PageCacheWatch>> PageCacheWatch::open(const Config& config) {
    std::unique_ptr<PageCacheWatch> w(new PageCacheWatch());
    w->self_tgid_ = static_cast<uint32_t>(::getpid());
    if (config.page_cache_telemetry == "off") {
        w->off_reason_ = "telemetry.page_cache = \"off\" in the configuration";
        return w;
    }
    bpf::PageCacheTelemetry::Options to;
    to.ring_bytes = config.page_cache_ring_bytes;
    to.ignore_tgid = static_cast<pid_t>(w->self_tgid_);
    // A runtime's read from storage wakes the loop (at most once a millisecond): on_miss reads
    // the rest of the expert then, and with it off the heat is no older.
    to.miss_wakeup_us = 1000;
    PageCacheWatch* self = w.get();
    auto pc = bpf::PageCacheTelemetry::open(to, [self](const bpf::PageCacheEvent& e) { self->on_event(e); });
    if (!pc) {
        if (config.page_cache_telemetry == "on")
            return tl::unexpected(with_context(pc.error(), "telemetry.page_cache = \"on\""));
        w->off_reason_ = pc.error().what();
        MC_LOG(LOG_WARNING, "page-cache telemetry is off, the daemon runs on the telemetry it has: {}", w->off_reason_);
        return w;
    }
    w->telemetry_ = std::make_unique<bpf::PageCacheTelemetry>(std::move(*pc));
    if (!w->telemetry_->faults_attached()) {
        w->off_reason_ = bpf::probe_page_cache_features().missing;
        MC_LOG(LOG_NOTICE, "page-cache telemetry: reads and evictions only: {}", w->off_reason_);
    } else {
        MC_LOG(LOG_INFO, "page-cache telemetry on: reads, evictions and faults of model files ({} KiB ring)",
               config.page_cache_ring_bytes >> 10);
    }
    return w;
}

std::vector<uint32_t> PageCacheWatch::watch(uint32_t model, const ModelResidency& res, const std::string& path) {
    std::vector<uint32_t> ids;
    if (!telemetry_) return ids;
    const auto& files = res.model().files();
    for (uint32_t i = 0; i < files.size(); ++i) {
        const uint32_t id = next_file_id_++;
        if (auto r = telemetry_->watch(files[i].identity.dev, files[i].identity.ino, id); !r) {
            MC_LOG(LOG_WARNING, "model {}: {}", path, r.error().what());
            continue;
        }
        watched_[id] = Watched{model, i};
        ids.push_back(id);
    }
    return ids;
}

Result<void> PageCacheWatch::unwatch(const std::vector<uint32_t>& ids, const ModelResidency& res,
                                     const std::function<bool(const FileIdentity&)>& shared) {
    if (!telemetry_) return {};
    Result<void> out;
    const auto& files = res.model().files();
    for (uint32_t id : ids) {
        const auto it = watched_.find(id);
        if (it == watched_.end()) continue;
        // Another entry may watch the same inode now (a model configured twice): leave it then.
        const auto& f = files[it->second.file];
        watched_.erase(it);
        if (shared(f.identity)) continue;
        if (auto r = telemetry_->unwatch(f.identity.dev, f.identity.ino); !r && out) out = r;
    }
    return out;
}

void PageCacheWatch::on_event(const bpf::PageCacheEvent& e) {
    ++events_;
    const auto it = watched_.find(e.file_id);
    ModelResidency* res = it != watched_.end() && resolve_ ? (*resolve_)(it->second.model) : nullptr;
    if (!res) {
        ++unattributed_;  // sent before its model was closed
        return;
    }
    const uint32_t model = it->second.model;
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
        res->for_each_slot(it->second.file, begin, end, [&](uint32_t slot, uint64_t bytes) {
            if (bytes > best_bytes) {
                best = slot;
                best_bytes = bytes;
            }
        });
        if (best_bytes == 0) return;
        ++res->telemetry(best).faults;
        if (best != kDenseSlot) batch_.used.emplace_back(model, best);
        return;
    }
    res->for_each_slot(it->second.file, begin, end, [&](uint32_t slot, uint64_t bytes) {
        SlotTelemetry& t = res->telemetry(slot);
        if (e.kind == K::Deleted) {
            t.evicted_bytes += bytes;
        } else if (own) {
            t.prefetch_bytes += bytes;
        } else {
            t.read_bytes += bytes;
            if (slot != kDenseSlot) {
                batch_.used.emplace_back(model, slot);
                batch_.missed.emplace_back(model, slot);
            }
        }
    });
}

PageCacheWatch::Batch PageCacheWatch::consume(const Resolve& resolve) {
    if (!telemetry_) return {};
    auto thread_cpu = [] {
        timespec ts{};
        ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
    };
    const double cpu0 = thread_cpu();
    resolve_ = &resolve;
    telemetry_->consume(kBatchEvents);
    resolve_ = nullptr;
    Batch out = std::move(batch_);
    batch_ = {};
    // One use per expert per batch: a read of one expert arrives as several folios.
    std::sort(out.used.begin(), out.used.end());
    out.used.erase(std::unique(out.used.begin(), out.used.end()), out.used.end());
    cpu_seconds_ += thread_cpu() - cpu0;
    return out;
}

void PageCacheWatch::fill(PageCacheStatus& s) const {
    s.enabled = telemetry_ != nullptr;
    s.off_reason = off_reason_;
    s.events = events_;
    s.unattributed = unattributed_;
    s.consume_cpu_seconds = cpu_seconds_;
    if (!telemetry_) return;
    s.faults = telemetry_->faults_attached();
    s.ring_bytes = telemetry_->ring_bytes();
    const auto c = telemetry_->counters();
    std::copy(std::begin(c.sent), std::end(c.sent), s.sent);
    std::copy(std::begin(c.dropped), std::end(c.dropped), s.dropped);
}

}  // namespace moecache::daemon
