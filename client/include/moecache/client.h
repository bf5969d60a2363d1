/* libmoecache-client: what an inference process uses to talk to moecached. C ABI; see
 * moecache/client.hpp for a C++ wrapper and docs/protocol.md for what travels.
 *
 * A client connects in the background (retrying with back-off), registers the model files it has
 * open, and reports which experts its router picked; the daemon sends directives back. Reporting
 * never blocks and costs no system call: events go through a shared-memory ring, and when the
 * ring is full or no daemon is there they are counted and dropped. Without a daemon every call is
 * a cheap no-op and the client says so once on stderr. After a daemon restart it reconnects and
 * registers its models again by itself; the model handles stay valid. */
#ifndef MOECACHE_CLIENT_H
#define MOECACHE_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOECACHE_API __attribute__((visibility("default")))

typedef struct moecache_client moecache_client;

enum moecache_action {
    MOECACHE_PROMOTE = 1,   /* keep it in the VRAM pool */
    MOECACHE_DEMOTE = 2,    /* take it out of the VRAM pool */
    MOECACHE_LOCK = 3,      /* the daemon locked it in RAM */
    MOECACHE_UNLOCK = 4,    /* the daemon let it go from RAM */
    MOECACHE_UNPROMOTE = 5, /* the pool's own policy decides again */
    MOECACHE_SHIFTED = 6    /* the model's routing shifted: cut the pool's use counts of it (block, expert 0) */
};

typedef struct moecache_directive {
    uint32_t model; /* a handle from moecache_client_register_model */
    uint32_t block;
    uint32_t expert;
    uint32_t action; /* enum moecache_action */
} moecache_directive;

typedef struct moecache_client_stats {
    uint64_t reported;       /* events handed to moecache_client_report */
    uint64_t sent;           /* put in a ring the daemon reads */
    uint64_t dropped;        /* no daemon connected, or the model not registered with it yet */
    uint64_t overflow;       /* the ring was full */
    uint64_t connects;       /* successful connections (1 + reconnects) */
    int connected;
} moecache_client_stats;

/* socket_path: NULL for $MOECACHE_SOCKET or /run/moecache/moecached.sock. name: for the daemon's
 * logs. Never fails for want of a daemon; NULL only when out of memory or threads. */
MOECACHE_API moecache_client* moecache_client_open(const char* socket_path, const char* name);
/* Opens every part of the model at `path` (any part of a split set) read-only and registers it,
 * now if connected and after every (re)connection. Returns 0 and a handle, or -errno. */
MOECACHE_API int moecache_client_register_model(moecache_client* c, const char* path, uint32_t* handle);
/* Where this process maps file `file` (0: part 1) of model `handle`: [address, address + length)
 * holds the file's bytes from file_offset. Sent now if connected and after every (re)connection.
 * Returns 0 or -errno. */
MOECACHE_API int moecache_client_describe_mapping(moecache_client* c, uint32_t handle, uint32_t file,
                                                  const void* address, uint64_t length, uint64_t file_offset);
/* `tokens` tokens routed MoE block `block` of model `handle` to `experts` (n of them). From one
 * thread at a time per client. Never blocks; returns 1 if the event went to the daemon, 0 if it was
 * counted as dropped or overflow, -EINVAL for an unknown handle. */
MOECACHE_API int moecache_client_report(moecache_client* c, uint32_t handle, uint32_t block, const uint32_t* experts, uint32_t n,
                           uint32_t tokens);
/* Where expert `expert` of MoE block `block` of model `handle` now lives for this process: device
 * >= 0: every slice of it is in that device's VRAM pool; -1: in no pool any more. The daemon keeps
 * one copy (it unlocks and drops the expert's RAM pages while it is in VRAM). Sent in the
 * background; the experts in VRAM are sent again after every reconnection. Returns 0 or -errno. */
MOECACHE_API int moecache_client_report_placement(moecache_client* c, uint32_t handle, uint32_t block, uint32_t expert,
                                                  int32_t device);
/* What the connected daemon asks of this process's VRAM pool on `device`: returns 1 and sets
 * *pool_bytes (UINT64_MAX: no limit of its own) and *one_place (1: experts in the pool leave RAM;
 * 0: keep both copies); 0 when no daemon is connected or it said nothing yet. */
MOECACHE_API int moecache_client_vram_policy(const moecache_client* c, uint32_t device, uint64_t* pool_bytes,
                                             int* one_place);
/* Whether the connected daemon asks this process's VRAM pool on `device` to keep the part it does
 * not direct by recency (an LRU: the routing reuses what it just used) rather than by use counts:
 * 1 yes, 0 no (or no daemon, or nothing said). */
MOECACHE_API int moecache_client_pool_recency(const moecache_client* c, uint32_t device);
/* How this process's VRAM pool on `device` (< 64) has served expert copies since it started:
 * cumulative counts, for the daemon's metrics. Sent in the background (the latest per device,
 * again after every reconnection). Returns 0 or -errno. */
typedef struct moecache_pool_stats {
    uint64_t hits, misses;           /* slices copied from the pool / from the host */
    uint64_t hit_bytes, miss_bytes;
    uint64_t pool_bytes;             /* allocated now */
} moecache_pool_stats;
MOECACHE_API int moecache_client_report_pool(moecache_client* c, uint32_t device, const moecache_pool_stats* stats);
/* How copies that `device`'s pool misses reach it (one of MOECACHE_MISS_PATH_*), sent with its
 * statistics: the daemon's status says when that makes decode slower than without moecache.
 * Returns 0 or -errno. */
enum {
    MOECACHE_MISS_PATH_REGISTERED = 1,          /* straight from page-locked pages of the model */
    MOECACHE_MISS_PATH_DAEMON_LOCKS = 2,        /* what moecached locks so, the rest from storage */
    MOECACHE_MISS_PATH_STAGED_CHOSEN = 3,       /* MOECACHE_CUDA_PIN=staging */
    MOECACHE_MISS_PATH_PAGEABLE_CHOSEN = 4,     /* MOECACHE_CUDA_PIN=off */
    MOECACHE_MISS_PATH_STAGED_OVER_BUDGET = 5,  /* models larger than the pin budget, no daemon */
    MOECACHE_MISS_PATH_STAGED_REGISTER_FAILED = 6,
    MOECACHE_MISS_PATH_SLOW_LINK = 7
};
MOECACHE_API int moecache_client_report_miss_path(moecache_client* c, uint32_t device, int path);
/* Host-to-device copies of 1 MiB or more that came from memory mapping no model this process
 * knows (cumulative counts), and whether it maps any model at all (no_model 1): a runtime that
 * loaded its model without mmap, which moecache cannot help. Sent in the background (the latest,
 * again after every reconnection), for the daemon's metrics. Returns 0 or -errno. */
MOECACHE_API int moecache_client_report_unmapped(moecache_client* c, uint64_t copies, uint64_t bytes, int no_model);
/* Up to max directives received since the last call; never blocks. Returns how many. */
MOECACHE_API size_t moecache_client_poll(moecache_client* c, moecache_directive* out, size_t max);
MOECACHE_API void moecache_client_stats_get(const moecache_client* c, moecache_client_stats* out);
/* Waits up to timeout_ms for a connection with every registered model registered (1), or not (0). */
MOECACHE_API int moecache_client_wait_ready(moecache_client* c, int timeout_ms);
MOECACHE_API void moecache_client_close(moecache_client* c);

#ifdef __cplusplus
}
#endif

#endif
