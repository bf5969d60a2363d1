#include "settings.h"

#include "moecache/backend/cpu_threads.h"
#include "moecache/cuda/hook_config.h"
#include "moecache/cuda/hot_profile.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace moecache::backend {

Settings settings_from_env(std::string* problem) {
    Settings s;
    if (const char* l = getenv("MOECACHE_GGML_LOG"); l != nullptr && *l && strcmp(l, "0") != 0) {
        s.log = true;
        s.log_often = strcmp(l, "2") == 0;
    }
    if (const char* c = getenv("MOECACHE_GGML_CLIENT"); c != nullptr && (!strcmp(c, "off") || !strcmp(c, "0"))) {
        s.client = false;
    }
    if (const char* c = getenv("MOECACHE_GGML_PIN"); c != nullptr && (!strcmp(c, "off") || !strcmp(c, "0"))) {
        s.pin = false;
    }
    s.profile_dir = cuda::hot_profile_dir(getenv("MOECACHE_GGML_PROFILE"), getenv("XDG_CACHE_HOME"), getenv("HOME"));
    const auto off = [&](std::string why) {
        *problem = std::move(why);
        s.device = "none";
        return s;
    };
    if (const char* d = getenv("MOECACHE_GGML_DEVICE"); d != nullptr && *d) {
        if (strlen(d) > 64) return off(fmt::format("MOECACHE_GGML_DEVICE: a device name of {} characters", strlen(d)));
        s.device = d;
    }
    if (const char* p = getenv("MOECACHE_GGML_POOL"); p != nullptr && *p) {
        const auto size = cuda::parse_pool_size(p);
        if (!size) return off(fmt::format("MOECACHE_GGML_POOL={}: not a size (12G, 512M) or a share of the experts (60%)", p));
        s.pool = *size;
    }
    if (const char* c = getenv("MOECACHE_GGML_CROSS"); c != nullptr && *c && strcmp(c, "auto") != 0) {
        const auto share = cuda::parse_percent(c);
        if (!share) return off(fmt::format("MOECACHE_GGML_CROSS={}: not auto or a share of the misses (30%)", c));
        s.cross = *share / 100;
    }
    if (const char* t = getenv("MOECACHE_GGML_THREADS"); t != nullptr) {
        const auto n = parse_thread_count(t);
        if (!n) return off(fmt::format("MOECACHE_GGML_THREADS={}: not auto or a thread count from 1 to 1024", t));
        s.threads = *n;
    }
    return s;
}

uint64_t pool_room(uint64_t free_bytes) {
    const uint64_t reserve = (1ull << 30) + free_bytes / 20;
    return free_bytes > reserve ? free_bytes - reserve : 0;
}

uint64_t pool_bytes(const Settings& s, uint64_t free_bytes, uint64_t expert_bytes) {
    uint64_t want = expert_bytes;
    if (s.pool.kind == cuda::PoolSize::Kind::Bytes) want = static_cast<uint64_t>(s.pool.value);
    if (s.pool.kind == cuda::PoolSize::Kind::Percent) {
        want = static_cast<uint64_t>(static_cast<double>(expert_bytes) * s.pool.value / 100.0);
    }
    return std::min({want, pool_room(free_bytes), expert_bytes});
}

}  // namespace moecache::backend
