// The CUDA hook's settings, read from the environment (moecache/cuda_hook.h lists them). Pure
// parsing, no CUDA: CI tests every rule. A bad value is reported (what, which variable, what is
// expected) and the default is used: a runtime never stops for a typo in a variable.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace moecache::cuda {

inline constexpr int kMaxHookDevices = 64;

// How large one device's VRAM pool is.
struct PoolSize {
    enum class Kind { Auto, Percent, Bytes };
    Kind kind = Kind::Auto;
    double value = 0;  // percent (0..100) of the expert bytes the device serves, or bytes
    bool operator==(const PoolSize&) const = default;
};

// MOECACHE_CUDA_POOL: comma-separated items, each a size for every device or "DEVICE:size" for
// one: "25%", "8G", "0:12G,1:6G", "20%,1:4GiB", "auto". Sizes take K, M, G, T (binary) with an
// optional "iB" or "B".
struct PoolSizes {
    PoolSize all;
    std::array<std::optional<PoolSize>, kMaxHookDevices> device{};
    [[nodiscard]] const PoolSize& of(int d) const {
        return d >= 0 && d < kMaxHookDevices && device[static_cast<size_t>(d)] ? *device[static_cast<size_t>(d)] : all;
    }
};

// How copies that miss the pool reach the device. off: as the runtime asked (pageable: the
// driver stages them, one thread). staging: the hook's own threads copy them into pinned buffers
// that the device reads at DMA speed. all: every expert byte registered for DMA at once
// (page-locked; for machines whose RAM holds the model). register: a registered tier within a
// budget (MOECACHE_CUDA_PIN_BUDGET, default half of memory), its copies straight from the pages at
// DMA speed, the rest staged: every expert tensor, registered ahead in the background, when the
// budget holds them all and no daemon asks for one place; with a daemon that does (or a budget
// that cannot hold them), what it keeps locked (its Lock and Unlock directives); otherwise the
// slices that miss. auto, the default: the same, except that
// without a daemon and with a model the budget cannot hold it registers nothing, and the rest is
// staged only where a measurement at start shows staging faster than the runtime's own copy.
enum class PinMode { Off, Auto, Staging, All, Register };
// llama.cpp's offload threshold by default (GGML_OP_OFFLOAD_MIN_BATCH): batches smaller than this
// compute host-resident experts on the CPU. Below it (1 for decode) off is refused: see hook_config.cpp.
inline constexpr int kDefaultOffloadMinBatch = 32;

struct HookConfig {
    PoolSizes pool;
    PinMode pin = PinMode::Auto;
    // The registered tier is on (auto and register).
    [[nodiscard]] bool registers() const { return pin == PinMode::Auto || pin == PinMode::Register; }
    unsigned staging_threads = 0;  // threads that copy misses into pinned buffers; 0: every core but one
    uint64_t pin_budget = 0;  // bytes the registered tier may hold; 0: half of the machine's memory
    bool log = false;
    bool client = true;
    bool peers = true;      // a device's copies read other devices' pools (peer access); MOECACHE_CUDA_PEER=off
    bool copy_kernel = true;  // pool hits copied by the hook's kernel; MOECACHE_CUDA_COPY_KERNEL=off: the driver's copies
    // A decode step's pool hits of one expert tensor queued together at its first copy, from the
    // router's ids the runtime read back (serve.cpp, "copies ahead"); MOECACHE_CUDA_AHEAD=off: each
    // when the runtime asks for it.
    bool ahead = true;
    bool one_place = true;  // drop this process's page-table mappings of experts its pool holds
    // A pool's first fill reads what the daemon directs from the model files, not only from its
    // locks (MOECACHE_CUDA_FILL_FROM_FILES=1, with the daemon's [vram] fill_from_files).
    bool fill_from_files = false;
    // Where the hook keeps each model's hot profile (hot_profile.h): MOECACHE_CUDA_PROFILE (a folder,
    // or off), by default $XDG_CACHE_HOME/moecache/hook or ~/.cache/moecache/hook; "" for none.
    std::string profile_dir;
    // A pool given in bytes (MOECACHE_CUDA_POOL=12G, 0:12G) is claimed from the start: the runtime's
    // free-memory queries (cudaMemGetInfo, cuMemGetInfo) report that much less on that device until
    // the pool holds it, so that a runtime that sizes its own use from free memory (llama.cpp's
    // --fit, ollama) leaves the room. MOECACHE_CUDA_CLAIM=off: the pool takes what is left.
    bool claim = true;
    // The bytes claimed on `device` (0: none).
    [[nodiscard]] uint64_t claim_bytes(int device) const {
        const PoolSize& s = pool.of(device);
        return claim && s.kind == PoolSize::Kind::Bytes ? static_cast<uint64_t>(s.value) : 0;
    }
};

// Parses one MOECACHE_CUDA_POOL value; nullopt and a reason in *error when it is not one.
std::optional<PoolSizes> parse_pool_sizes(const std::string& text, std::string* error);
// A size with an optional binary unit suffix ("8G", "512MiB", "1.5T", "4096").
std::optional<double> parse_size(const std::string& text);
// A share as "25%" or "12.5%" (0..100), the number alone; nullopt for anything else.
std::optional<double> parse_percent(const std::string& text);
// One pool size: "auto", a share of the expert bytes ("25%") or a size ("8G").
std::optional<PoolSize> parse_pool_size(const std::string& text);
// The settings from variables read through `get` (getenv in the hook; null: unset); each problem
// goes to `warn` as one line.
HookConfig hook_config_from(const std::function<const char*(const char*)>& get,
                            const std::function<void(const std::string&)>& warn);

}  // namespace moecache::cuda
