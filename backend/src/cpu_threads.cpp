#include "moecache/backend/cpu_threads.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace moecache::backend {

int cpu_half_threads(int requested, int cpus) {
    if (requested <= 1 || cpus <= 1) return 1;
    return requested >= cpus ? cpus - 1 : requested;
}

std::optional<int> parse_thread_count(const char* text) {
    if (text == nullptr || *text == '\0' || strcmp(text, "auto") == 0) return 0;
    if (*text < '0' || *text > '9') return std::nullopt;  // strtol would take a sign or spaces
    char* end = nullptr;
    errno = 0;
    const long n = strtol(text, &end, 10);
    if (errno != 0 || *end != '\0' || n < 1 || n > 1024) return std::nullopt;
    return static_cast<int>(n);
}

int usable_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    return std::max(1, CPU_COUNT(&set));
}

}  // namespace moecache::backend
