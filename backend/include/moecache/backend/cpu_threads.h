// How many threads the backend's CPU half computes with. The runtime asks for its own count, often
// one per CPU (llama.cpp's default: every core it finds). ggml's CPU graphs meet at a barrier after
// every node, so a compute on as many threads as there are CPUs waits, at each barrier, for any
// thread the scheduler took off its CPU for another: here the pool's own copies (a pageable copy
// is the CPU's memcpy into the driver's staging; a synchronous one spins), the reads ahead and the
// daemon link, all busy while a decode's misses are computed. A chain's CPU half of a few
// milliseconds then took 20-30 ms (GPU machine, 16 CPUs, 16 threads). One CPU is left to them.
#pragma once

#include <optional>

namespace moecache::backend {

// The CPU half's threads for a runtime's `requested` count on `cpus` usable CPUs (this process's
// affinity): the request, less one where it would use every CPU; at least one.
int cpu_half_threads(int requested, int cpus);

// MOECACHE_GGML_THREADS: "auto" (or empty) is 0, a count from 1 to 1024 is itself; anything else
// (a sign, a suffix, 0, a count past 1024) is nullopt.
std::optional<int> parse_thread_count(const char* text);

// The usable CPUs of this process (its affinity mask), at least one.
int usable_cpus();

}  // namespace moecache::backend
