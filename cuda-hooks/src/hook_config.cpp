#include "moecache/cuda/hook_config.h"

#include "moecache/cuda/hot_profile.h"
#include "moecache/device_list.h"

#include <cstdlib>
#include <cstring>

namespace moecache::cuda {
namespace {

bool off_value(const char* v) {
    return !strcmp(v, "off") || !strcmp(v, "0") || !strcmp(v, "no") || !strcmp(v, "false");
}

}  // namespace

std::optional<double> parse_percent(const std::string& s) {
    if (s.size() < 2 || s.back() != '%' || s.find_first_not_of("0123456789.") != s.size() - 1) return std::nullopt;
    const auto v = parse_size(s.substr(0, s.size() - 1));
    if (!v || *v > 100) return std::nullopt;
    return *v;
}

std::optional<PoolSize> parse_pool_size(const std::string& s) {
    if (s == "auto") return PoolSize{};
    if (!s.empty() && s.back() == '%') {
        const auto v = parse_percent(s);
        if (!v) return std::nullopt;
        return PoolSize{PoolSize::Kind::Percent, *v};
    }
    const auto v = parse_size(s);
    if (!v) return std::nullopt;
    return PoolSize{PoolSize::Kind::Bytes, *v};
}

std::optional<double> parse_size(const std::string& text) {
    const char* s = text.c_str();
    char* end = nullptr;
    const double v = strtod(s, &end);
    if (end == s || !(v >= 0) || v > 1e18 || *s == '-' || *s == '+' || *s == ' ') return std::nullopt;
    double mult = 1;
    switch (*end) {
        case 'k': case 'K': mult = 1024.0; ++end; break;
        case 'm': case 'M': mult = 1024.0 * 1024; ++end; break;
        case 'g': case 'G': mult = 1024.0 * 1024 * 1024; ++end; break;
        case 't': case 'T': mult = 1024.0 * 1024 * 1024 * 1024; ++end; break;
        default: break;
    }
    if (end[0] == 'i' && end[1] == 'B') end += 2;
    else if (*end == 'B') ++end;
    if (*end != '\0') return std::nullopt;
    return v * mult;
}

std::optional<PoolSizes> parse_pool_sizes(const std::string& text, std::string* error) {
    auto items = parse_device_list(text, kMaxHookDevices);
    if (!items) {
        if (error != nullptr) *error = items.error().what();
        return std::nullopt;
    }
    PoolSizes out;
    for (const auto& item : *items) {
        const auto size = parse_pool_size(item.value);
        if (!size) {
            if (error != nullptr) *error = "'" + item.text + "': expected auto, a percentage (25%) or a size (8G, 512MiB)";
            return std::nullopt;
        }
        if (item.device) out.device[*item.device] = *size;
        else out.all = *size;
    }
    return out;
}

HookConfig hook_config_from(const std::function<const char*(const char*)>& get,
                            const std::function<void(const std::string&)>& warn) {
    HookConfig c;
    if (const char* p = get("MOECACHE_CUDA_POOL"); p != nullptr && *p != '\0') {
        std::string why;
        if (auto sizes = parse_pool_sizes(p, &why)) c.pool = *sizes;
        else warn(std::string("MOECACHE_CUDA_POOL=") + p + ": " + why + "; using auto");
    }
    if (const char* p = get("MOECACHE_CUDA_PIN"); p != nullptr && *p != '\0') {
        if (!strcmp(p, "all")) c.pin = PinMode::All;
        else if (!strcmp(p, "staging")) c.pin = PinMode::Staging;
        else if (!strcmp(p, "auto")) c.pin = PinMode::Auto;
        else if (!strcmp(p, "register")) c.pin = PinMode::Register;
        else if (off_value(p)) c.pin = PinMode::Off;
        else warn(std::string("MOECACHE_CUDA_PIN=") + p + ": expected auto, staging, register, all or off; using auto");
        // With decode's expert math moved to the GPU, misses from pageable memory are on every
        // token's path: 0.25-0.49x of -ot exps=CPU on an H200 (pools of 25 and 60 %). Refused there.
        const char* batch = get("GGML_OP_OFFLOAD_MIN_BATCH");
        if (c.pin == PinMode::Off && batch != nullptr && *batch != '\0' && atoi(batch) < kDefaultOffloadMinBatch) {
            warn(std::string("MOECACHE_CUDA_PIN=off refused: with GGML_OP_OFFLOAD_MIN_BATCH=") + batch +
                 " every token's experts cross to the GPU, and copied from pageable memory they make decode slower than "
                 "without moecache (a quarter to a half of its speed); using auto. For no page-locked model memory use "
                 "staging (slower than auto too), or unset GGML_OP_OFFLOAD_MIN_BATCH");
            c.pin = PinMode::Auto;
        }
    }
    if (const char* p = get("MOECACHE_CUDA_STAGING_THREADS"); p != nullptr && *p != '\0') {
        char* end = nullptr;
        const long n = strtol(p, &end, 10);
        if (*end != '\0' || n < 1 || n > 256 || *p == '+' || *p == '-')
            warn(std::string("MOECACHE_CUDA_STAGING_THREADS=") + p + ": expected a number of threads, 1 to 256; using every core but one");
        else
            c.staging_threads = static_cast<unsigned>(n);
    }
    if (const char* p = get("MOECACHE_CUDA_PIN_BUDGET"); p != nullptr && *p != '\0') {
        if (const auto v = parse_size(p)) c.pin_budget = static_cast<uint64_t>(*v);
        else warn(std::string("MOECACHE_CUDA_PIN_BUDGET=") + p + ": expected a size (8G, 512MiB); using half of memory");
    }
    const char* log = get("MOECACHE_CUDA_LOG");
    c.log = log != nullptr && *log != '\0' && strcmp(log, "0") != 0;
    const char* client = get("MOECACHE_CUDA_CLIENT");
    c.client = client == nullptr || !off_value(client);
    const char* peer = get("MOECACHE_CUDA_PEER");
    c.peers = peer == nullptr || !off_value(peer);
    const char* claim = get("MOECACHE_CUDA_CLAIM");
    c.claim = claim == nullptr || !off_value(claim);
    const char* kernel = get("MOECACHE_CUDA_COPY_KERNEL");
    c.copy_kernel = kernel == nullptr || !off_value(kernel);
    const char* ahead = get("MOECACHE_CUDA_AHEAD");
    c.ahead = ahead == nullptr || !off_value(ahead);
    const char* one = get("MOECACHE_CUDA_ONE_PLACE");
    c.one_place = one == nullptr || !off_value(one);
    const char* from_files = get("MOECACHE_CUDA_FILL_FROM_FILES");
    c.fill_from_files = from_files != nullptr && *from_files != '\0' && !off_value(from_files);
    c.profile_dir = hot_profile_dir(get("MOECACHE_CUDA_PROFILE"), get("XDG_CACHE_HOME"), get("HOME"));
    return c;
}

}  // namespace moecache::cuda
