// Intake: the page cache's events (faults, reads, evictions of model pages) and the routing the
// clients report become facts about experts (uses, misses) for the next decisions. Nothing here
// locks or unlocks.
#include "moecache/daemon/daemon.h"
#include "moecache/daemon/system_memory.h"

#include "daemon_state.h"
#include "dbus/dbus_service.h"
#include "moecache/daemon/prefetcher.h"
#include "moecache/file_util.h"
#include "moecache/log.h"

#include <glob.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

namespace moecache::daemon {

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
    if (used_this_batch_.empty()) return;
    // One use per expert per batch: a read of one expert arrives as several folios.
    std::sort(used_this_batch_.begin(), used_this_batch_.end());
    used_this_batch_.erase(std::unique(used_this_batch_.begin(), used_this_batch_.end()), used_this_batch_.end());
    const auto now = std::chrono::steady_clock::now();
    for (auto& m : models_) {
        if (!m->res) continue;
        const uint32_t n = m->res->n_experts();
        const bool routed = m->last_routed && now - *m->last_routed < kPageCacheUsesAfterRouting;
        for (const auto& [id, slot] : used_this_batch_) {
            if (id != m->id || slot >= m->res->n_slots()) continue;
            m->last_used = now;
            if (routed) continue;  // the routing reports are its heat (daemon_state.h, last_routed)
            const uint32_t expert = slot % n;
            m->res->heat().record(slot / n, std::span<const uint32_t>(&expert, 1));
        }
    }
    used_this_batch_.clear();
}

void Daemon::record_routing(uint32_t model, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens) {
    for (auto& m : models_)
        if (m->id == model && m->res) record_routing(*m, block, experts, tokens);
}

void Daemon::record_routing(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens,
                            bool continued) {
    if (trace_.on() && m.res) {
        trace_.model(m.id, m.res->model().map(), m.path);
        trace_.decision(m.id, block, experts, tokens);
    }
    m.last_used = std::chrono::steady_clock::now();
    m.last_routed = m.last_used;
    if (const auto layer = m.res->layer_of_block(block)) {
        // The clock advances once per batch: on the first MoE layer's report.
        if (*layer == 0) {
            m.res->heat().advance_clock(tokens);
            tokens_since_place_ += tokens;
            if (placement_due(tokens_since_place_, m.last_used - last_place_)) request_place();
        }
        // A report of 0 tokens is more of the batch before it: its ranking (moecache/batch_report.h),
        // or the rest of a decision too large for one ring record whose start an earlier turn read
        // (consume_client_telemetry joins the others): heat, not another routing.
        if (tokens == 0) {
            if (continued)
                m.res->heat().record_continued(*layer, experts);
            else
                m.res->heat().record_more(*layer, experts);
            return;
        }
        m.res->heat().record(*layer, experts);
        // A prompt batch's report is not one token's routing: the predictor learns only tokens.
        if (config_.predict && tokens == 1) predict(m, *layer, experts);
    }
}

}  // namespace moecache::daemon
