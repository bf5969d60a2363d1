#include "moecache/backend/cpu_threads.h"

#include <sched.h>

#include <algorithm>

namespace moecache::backend {

int cpu_half_threads(int requested, int cpus) {
    if (requested <= 1 || cpus <= 1) return 1;
    return requested >= cpus ? cpus - 1 : requested;
}

int usable_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    return std::max(1, CPU_COUNT(&set));
}

}  // namespace moecache::backend
