/* libmoecache-cuda.so: what the preloaded CUDA hook exports besides the CUDA functions it
 * interposes. For tests, benchmarks and tools that want to see what it did; a runtime never needs
 * to call any of it. Look the functions up with dlsym(RTLD_DEFAULT, ...): absent means no hook.
 *
 * Environment (read once, at the first CUDA call):
 *   MOECACHE_CUDA=off        pass everything through untouched
 *   MOECACHE_CUDA_POOL=SIZE  VRAM pool per device: "25%" of the expert bytes of the models this
 *                            process maps, "8G"/"512M"/bytes, "0" for telemetry only, or "auto"
 *                            (the default: as much as the experts need, within free memory less
 *                            a reserve)
 *   MOECACHE_CUDA_PIN=all    register the expert bytes of mapped models for DMA (read-only page-
 *                            locked host memory; copies that miss the pool then run at pinned speed)
 *   MOECACHE_CUDA_ONE_PLACE=off  keep this process's mapping of experts the pool holds even
 *                            when the daemon asks for one place (its [vram] keep_ram_copy unset);
 *                            without a daemon the mapping is never touched
 *   MOECACHE_CUDA_LOG=1      a summary on stderr at exit
 *   MOECACHE_SOCKET=PATH     the daemon's client socket; MOECACHE_CUDA_CLIENT=off: no daemon */
#ifndef MOECACHE_CUDA_HOOK_H
#define MOECACHE_CUDA_HOOK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moecache_cuda_stats {
    uint64_t copies;          /* host-to-device copies seen */
    uint64_t expert_copies;   /* of them, whole expert slices out of a mapped model */
    uint64_t served;          /* expert copies the pool took part in */
    uint64_t slice_hits;      /* slices copied device-to-device from the pool */
    uint64_t slice_misses;    /* slices copied from the host (on a device with a pool) */
    uint64_t bytes_from_pool;
    uint64_t bytes_from_host; /* by expert copies on a device with a pool */
    uint64_t admitted, evicted, declined;
    uint64_t captured;        /* expert copies passed through during stream capture */
    uint64_t fallbacks;       /* served copies redone by the runtime after a driver error */
    uint64_t pool_bytes;      /* allocated, all devices */
    uint64_t models;          /* mapped models found */
    uint64_t pinned_bytes;    /* registered for DMA */
    uint64_t reported;        /* router events handed to the client runtime */
    uint64_t experts_in_vram; /* experts with every slice in a pool */
    uint64_t yielded_bytes;   /* pool memory given back to the runtime's allocations */
    uint64_t dropped_host_bytes; /* of experts in a pool, unmapped here (the one-place rule) */
    uint64_t directives;      /* VRAM directives from the daemon (promote, unpromote, demote) */
} moecache_cuda_stats;

void moecache_cuda_stats_get(moecache_cuda_stats* out);
/* Rescans this process's mappings now and waits up to timeout_ms for the scan and for the pools of
 * devices already seen. Returns the number of mapped models found. */
int moecache_cuda_sync(int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif
