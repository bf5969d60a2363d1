// What a user sets for the ggml backend, from the environment (the runtime's command line is the
// runtime's): which device computes the pooled experts, and how large the pool is.
//   MOECACHE_GGML_DEVICE  auto (every GPU that ggml has, a pool on each), none (every expert on the
//                         CPU), or ggml device names, comma-separated (CUDA0; CUDA0,CUDA1; CPU: the
//                         CPU stands in for a GPU, tests; CPU,CPU for two)
//   MOECACHE_GGML_POOL    bytes (12G: on each device), or a share of the expert tensors' bytes (60%,
//                         as MOECACHE_CUDA_POOL means it: of the layers each device serves); auto:
//                         all of them. Never more than a device has free when the pool is made,
//                         less a reserve for the runtime
//   MOECACHE_GGML_LOG     1: a line per pool change and the pool's figures at exit; 2: the figures
//                         every 10 s as well (a run that is killed still says where its time went)
//   MOECACHE_GGML_CLIENT  off: no link to moecached (no routing reports, no one place)
//   MOECACHE_GGML_CROSS   auto, or a share (30%) of a small batch's misses that cross the link to be
//                         computed on the device (the rest on the CPU, at the same time); auto keeps
//                         the two halves level
//   MOECACHE_GGML_PIN     off: the expert bytes are not pinned for the device's DMA (copies to the
//                         pool then go through the driver's pageable bounce)
//   MOECACHE_GGML_THREADS auto, or how many threads compute the CPU's half (1-1024); auto: the
//                         runtime's count, less one where that is every CPU (cpu_threads.h)
#pragma once

#include "moecache/cuda/hook_config.h"
#include "moecache/error.h"

#include <cstdint>
#include <string>

namespace moecache::backend {

struct Settings {
    std::string device = "auto";
    cuda::PoolSize pool;  // MOECACHE_GGML_POOL, as MOECACHE_CUDA_POOL reads a size
    bool log = false;
    bool log_often = false;  // MOECACHE_GGML_LOG=2
    bool client = true;
    bool pin = true;
    double cross = -1;  // MOECACHE_GGML_CROSS as a fraction; below 0: auto
    int threads = 0;     // MOECACHE_GGML_THREADS; 0: auto
    // MOECACHE_GGML_PROFILE: the folder of the models' hot profiles (the hook's, by default), "": off.
    std::string profile_dir;
};

// From the environment. A bad value is said in `problem` (naming the variable and the value) and
// turns the pool off: every expert is then computed on the CPU.
Settings settings_from_env(std::string* problem);

// The pool's bytes on a device with `free_bytes` free, for expert tensors of `expert_bytes` in all:
// what was asked for, within what is free less a reserve for the runtime's later allocations (a new
// context's buffers): 1 GiB and 5 % of what was free.
uint64_t pool_bytes(const Settings& s, uint64_t free_bytes, uint64_t expert_bytes);
// What a device with `free_bytes` free can give the pool and its staging slots (a reserve kept for
// the runtime's own buffers).
uint64_t pool_room(uint64_t free_bytes);

}  // namespace moecache::backend
