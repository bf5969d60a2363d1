#include "daemon_link.h"

#include "moecache/process_maps.h"

namespace moecache::backend {

DaemonLink::DaemonLink(bool on) {
    if (on) client_ = moecache_client_open(nullptr, "libmoecache-ggml");
}

DaemonLink::~DaemonLink() {
    if (client_ != nullptr) moecache_client_close(client_);
}

uint32_t DaemonLink::model_of(const void* data) {
    if (client_ == nullptr) return UINT32_MAX;
    const auto at = reinterpret_cast<uintptr_t>(data);
    for (const auto& r : known_)
        if (at >= r.start && at < r.end) return r.handle;
    const auto text = read_proc_text("/proc/self/maps");
    if (!text) return UINT32_MAX;
    const auto maps = parse_maps(*text);
    const MapsEntry* e = entry_at(maps, at);
    if (e == nullptr) return UINT32_MAX;  // not mapped from a file: the runtime read the model into its own memory
    auto it = handles_.find(e->path);
    if (it == handles_.end()) {
        uint32_t handle = UINT32_MAX;
        if (moecache_client_register_model(client_, e->path.c_str(), &handle) != 0) handle = UINT32_MAX;
        it = handles_.emplace(e->path, handle).first;
    }
    known_.push_back(Range{e->mapping.start, e->mapping.end, it->second});
    return it->second;
}

void DaemonLink::report(uint32_t model, uint32_t block, const std::vector<int32_t>& experts, uint32_t tokens) {
    if (client_ == nullptr || model == UINT32_MAX || experts.empty()) return;
    std::vector<uint32_t> e(experts.begin(), experts.end());
    (void)moecache_client_report(client_, model, block, e.data(), static_cast<uint32_t>(e.size()), tokens);
}

void DaemonLink::placement(uint32_t model, uint32_t block, uint32_t expert, bool pooled) {
    if (client_ == nullptr || model == UINT32_MAX) return;
    (void)moecache_client_report_placement(client_, model, block, expert, pooled ? 0 : -1);
}

void DaemonLink::pool(uint64_t hits, uint64_t misses, uint64_t pool_bytes) {
    if (client_ == nullptr) return;
    moecache_pool_stats s{};
    s.hits = hits;
    s.misses = misses;
    s.pool_bytes = pool_bytes;
    (void)moecache_client_report_pool(client_, 0, &s);
}

std::vector<moecache_directive> DaemonLink::directives() {
    std::vector<moecache_directive> out;
    if (client_ == nullptr) return out;
    moecache_directive d[64];
    for (size_t n; (n = moecache_client_poll(client_, d, 64)) > 0;) out.insert(out.end(), d, d + n);
    return out;
}

}  // namespace moecache::backend
