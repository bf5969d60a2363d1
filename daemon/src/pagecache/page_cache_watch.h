// The page cache's events for the models' files (bpf/): the telemetry opened as [telemetry]
// page_cache says, each open model's files watched, and each event attributed to a slot of its
// model: what the page cache did to the slot (SlotTelemetry), and which experts a runtime used or
// read from storage in this batch. The daemon makes facts of those (heat, reads after misses);
// this owns the telemetry and the map from its file ids to models.
#pragma once

#include "moecache/bpf/page_cache_telemetry.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/status.h"
#include "moecache/error.h"

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moecache::daemon {

class ModelResidency;
struct FileIdentity;

class PageCacheWatch {
public:
    // Off when [telemetry] page_cache = "off", or "auto" and the kernel cannot (said, and why in
    // the status); an error only when it is "on" and cannot be.
    static Result<std::unique_ptr<PageCacheWatch>> open(const Config& config);

    [[nodiscard]] bool on() const { return telemetry_ != nullptr; }
    [[nodiscard]] int event_fd() const { return telemetry_ ? telemetry_->event_fd() : -1; }

    // Watches a model's files (model: its id): the ids its events will carry, for unwatch().
    std::vector<uint32_t> watch(uint32_t model, const ModelResidency& res, const std::string& path);
    // Stops attributing the ids' events; a file that `shared` says another open model has stays
    // watched in the kernel. Returns what the kernel refused, if anything.
    Result<void> unwatch(const std::vector<uint32_t>& ids, const ModelResidency& res,
                         const std::function<bool(const FileIdentity&)>& shared);

    // (model id, slot) pairs.
    using Slots = std::vector<std::pair<uint32_t, uint32_t>>;
    struct Batch {
        Slots used;    // experts a runtime faulted in or read, once each
        Slots missed;  // experts a runtime read from storage, as often as it did
    };
    using Resolve = std::function<ModelResidency*(uint32_t model)>;
    // Reads the events waiting, at most kBatchEvents (a flood cannot hold the loop: the ring's
    // descriptor stays readable for the next turn); resolve: a model's residency by id (null once
    // closed: its events are counted unattributed).
    Batch consume(const Resolve& resolve);
    static constexpr size_t kBatchEvents = size_t{1} << 16;

    void fill(PageCacheStatus& s) const;

private:
    PageCacheWatch() = default;
    void on_event(const bpf::PageCacheEvent& e);

    std::unique_ptr<bpf::PageCacheTelemetry> telemetry_;
    std::string off_reason_;
    uint32_t self_tgid_ = 0;  // this daemon: its reads are prefetches, not a runtime's misses
    struct Watched {
        uint32_t model = 0;
        uint32_t file = 0;  // index in the model's files
    };
    std::unordered_map<uint32_t, Watched> watched_;  // by the file id the events carry
    uint32_t next_file_id_ = 1;
    uint64_t events_ = 0, unattributed_ = 0;
    double cpu_seconds_ = 0;            // the loop's time in consume()
    const Resolve* resolve_ = nullptr;  // during consume()
    Batch batch_;                       // during consume()
};

}  // namespace moecache::daemon
