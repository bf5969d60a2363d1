// The backend's link to moecached: the client runtime (libmoecache-client, the hook's own link),
// so that the daemon sees the backend as it sees the hook. It registers each model file the expert
// tensors are mapped from, reports which experts each layer's router picked, says which experts the
// pool holds (the daemon then keeps one copy: it lets their RAM pages go), and hands the daemon's
// directives back (promote, demote). Without a daemon every call is a cheap no-op.
// Not thread-safe: its owner (the pool) calls it under its lock.
#pragma once

#include "moecache/client.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace moecache::backend {

class DaemonLink {
public:
    // Off when MOECACHE_GGML_CLIENT=off.
    explicit DaemonLink(bool on);
    ~DaemonLink();
    DaemonLink(const DaemonLink&) = delete;
    DaemonLink& operator=(const DaemonLink&) = delete;

    // The model file that maps `data` (from /proc/self/maps), registered once; its handle, or
    // UINT32_MAX (no daemon link, not a file mapping, a file the client cannot register).
    uint32_t model_of(const void* data);
    void report(uint32_t model, uint32_t block, const std::vector<int32_t>& experts, uint32_t tokens);
    void placement(uint32_t model, uint32_t block, uint32_t expert, bool pooled);
    // The pool on device 0: rows computed from it (hits) and on the CPU (misses), its bytes. The
    // daemon counts the pool's placements once it knows the pool.
    void pool(uint64_t hits, uint64_t misses, uint64_t pool_bytes);
    // The daemon's directives since the last call.
    std::vector<moecache_directive> directives();

private:
    moecache_client* client_ = nullptr;
    std::unordered_map<std::string, uint32_t> handles_;  // by path
    struct Range {
        uintptr_t start, end;
        uint32_t handle;
    };
    std::vector<Range> known_;  // mappings already registered: no maps read for their other tensors
};

}  // namespace moecache::backend
