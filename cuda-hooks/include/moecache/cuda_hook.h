/* libmoecache-cuda.so: what the preloaded CUDA hook exports besides the CUDA functions it
 * interposes. For tests, benchmarks and tools that want to see what it did; a runtime never needs
 * to call any of it. Look the functions up with dlsym(RTLD_DEFAULT, ...): absent means no hook.
 *
 * Environment (read once, at the first CUDA call):
 *   MOECACHE_CUDA=off        pass everything through untouched
 *   MOECACHE_CUDA_POOL=SIZE  VRAM pool per device: "25%" of the bytes of the expert tensors that
 *                            device copies (with several GPUs, each serves its own), "8G"/"512M"/
 *                            bytes, "0" for telemetry only, or "auto" (the default: as much as
 *                            those experts need, within free memory less a reserve); one device's
 *                            own as "DEVICE:SIZE", e.g. "0:12G,1:6G" or "25%,1:4G"
 *   MOECACHE_CUDA_PIN=MODE   how copies that miss the pool reach the GPU: "auto" (the default) and
 *                            "register": a registered tier (page-locked for DMA, copied straight
 *                            from the pages): with a daemon that asks for one place (or a
 *                            model the budget cannot hold), what it keeps locked (its budget
 *                            bounds it); else, within MOECACHE_CUDA_PIN_BUDGET=SIZE
 *                            (default half of what the process's memory cgroups allow, or of
 *                            RAM), every expert tensor, registered in the background, when the
 *                            budget holds them all, else nothing (auto) or the slices that miss
 *                            (register). The rest goes through
 *                            pinned staging buffers that several threads fill (auto: where a
 *                            measurement at start shows that faster than the driver's own copy).
 *                            "staging" (staging only), "off" (as the runtime asks; refused, and
 *                            auto used, where GGML_OP_OFFLOAD_MIN_BATCH is below 32: decode's
 *                            misses from pageable memory ran at a quarter to a half of the speed
 *                            without moecache), "all" (every
 *                            expert byte of mapped models registered at once: for machines whose
 *                            RAM holds the model; no one place)
 *   MOECACHE_CUDA_CLAIM=off  a pool given in bytes takes what the runtime leaves (default: it is
 *                            claimed from the start: free-memory queries report that much less
 *                            until the pool holds it, so that a runtime that sizes its own use
 *                            from free VRAM leaves the room. llama.cpp's --fit with --cpu-moe,
 *                            -ot or -ngl given only shortens the context to leave it (it places
 *                            no layers then); without those it moves layers off the GPU)
 *   MOECACHE_CUDA_PEER=off   a device's copies read only its own pool (default: other devices'
 *                            pools too, peer to peer, with peer access enabled between them)
 *   MOECACHE_CUDA_COPY_KERNEL=off  pool hits copied with the driver's device-to-device copies
 *                            (default: a copy kernel of the hook's own, cheaper to queue)
 *   MOECACHE_CUDA_AHEAD=off  each pool hit copied when the runtime asks for it (default: a decode
 *                            step's hits of a tensor queued together at its first copy, from the
 *                            router ids the runtime read back, where its copies are seen to follow
 *                            the host tensor's layout)
 *   MOECACHE_CUDA_STAGING_THREADS=N  threads that copy misses into pinned buffers (the caller
 *                            included; default: every core but one, at most 16)
 *   MOECACHE_CUDA_ONE_PLACE=off  keep this process's mapping of experts the pool holds even
 *                            when the daemon asks for one place (its [vram] keep_ram_copy unset);
 *                            without a daemon the mapping is never touched
 *   MOECACHE_CUDA_PROFILE=DIR  where each model's hot profile (its routing counts) is kept
 *                            across runs: a folder, or "off" (default: $XDG_CACHE_HOME/moecache/
 *                            hook, else ~/.cache/moecache/hook); the next run fills its pool from
 *                            it while no daemon directs the pool
 *   MOECACHE_CUDA_LOG=1      a summary on stderr at exit, with where the hook's time for expert
 *                            copies went (finding each, the pools, host pieces, admissions, launches)
 *   MOECACHE_SOCKET=PATH     the daemon's client socket; MOECACHE_CUDA_CLIENT=off: no daemon
 *   MOECACHE_KEEP_MAPPING=1  read before main: a "--load-mode none" or "dio" on the runtime's
 *                            command line (ollama passes one on CPU-only hosts, under host memory
 *                            pressure and on integrated GPUs) becomes "mmap", and it says so
 * Read from the command line before main: a device probe (llama-server --list-devices or without
 * a model, ollama gpu-discover) and `ollama serve` are left alone: no pool, no claim, no daemon. */
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
    uint64_t directives;         /* VRAM directives from the daemon (promote, unpromote, demote, shifted) */
    uint64_t bytes_staged;    /* of bytes_from_host, through pinned staging buffers */
    uint64_t stream_joins;    /* pool slots taken over by another stream (a new context, say) */
    uint64_t devices;         /* devices with a pool */
    uint64_t staged_devices;  /* of them, copying misses through pinned staging */
    uint64_t unmapped_copies; /* large host-to-device copies from memory that maps no model */
    uint64_t unmapped_bytes;
    uint64_t serve_ns;        /* host time spent deciding and queueing expert copies */
    uint64_t pieces;          /* copies queued for them (device-to-device and from the host) */
    uint64_t peer_hits;       /* of slice_hits, copied from another device's pool */
    uint64_t bytes_from_peers; /* of bytes_from_pool, from another device's pool */
    uint64_t bytes_read_from_files; /* staged bytes read from the model files (pread), not through their mappings */
    uint64_t filled_ahead;    /* slices put in a pool ahead of use, as the daemon directed (Promote) */
    uint64_t miss_path;       /* how misses reach the first device with a pool: MOECACHE_MISS_PATH_*
                                 of moecache/client.h (0: not known yet) */
    uint64_t copied_ahead;    /* slices queued at the first copy of their tensor's run (copies ahead) */
    uint64_t ahead_unclaimed; /* slices queued ahead that the runtime then did not ask for */
} moecache_cuda_stats;

void moecache_cuda_stats_get(moecache_cuda_stats* out);
/* The VRAM pool the hook holds on `device` now, in bytes (0: none). */
uint64_t moecache_cuda_pool_bytes(int device);
/* Rescans this process's mappings now and waits up to timeout_ms for the scan and for the pools of
 * devices already seen. Returns the number of mapped models found. */
int moecache_cuda_sync(int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif
