// What the hooked calls do beyond passing through: find the model files this process maps, decode
// host-to-device copies out of them into router telemetry, and serve expert slices from a VRAM pool
// per device.
//
// Threads: the runtime's threads call serve() and the allocation hooks; they read the published
// snapshot of mappings without a lock and take `mu_` for the pool and the heat. One background
// thread owns everything slow: /proc/self/maps scans and GGUF parsing, the connection to the daemon
// (through the client runtime), pool allocation and DMA registration. Nothing is ever freed while a
// hooked call could still read it: snapshots and models live until exit.
#pragma once

#include "cuda_api.h"
#include "moecache/cuda/copy_classifier.h"
#include "moecache/cuda/vram_pool.h"
#include "moecache/cuda_hook.h"
#include "moecache/model.h"
#include "moecache/process_maps.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

struct moecache_client;

namespace moecache::cuda::hook {

struct HostToDeviceCopy {
    CUdeviceptr dst = 0;
    const void* src = nullptr;
    size_t bytes = 0;
    CUstream stream = nullptr;  // as the caller gave it
    bool async = true;
    bool per_thread = false;    // a _ptsz/_ptds entry point: stream 0 is the per-thread stream
    bool dst_checked = true;    // false when the caller did not say the destination is device memory
};

struct EngineConfig {
    enum class PoolSize { Auto, Percent, Bytes };
    PoolSize pool = PoolSize::Auto;
    double pool_value = 0;  // percent or bytes
    bool pin = false;
    bool log = false;
    bool client = true;
    bool one_place = true;  // drop this process's page-table mappings of experts its pool holds
};
// From the environment (cuda_hook.h lists it); unknown values are reported on stderr and ignored.
EngineConfig config_from_environment();

class Engine {
public:
    // Null when the hook is off (MOECACHE_CUDA=off) or in a child after fork.
    static Engine* get();
    // The engine if a hooked call has created it, without creating it.
    static Engine* peek();

    // Serves a host-to-device copy through the pool; true when it did (the result in *result),
    // false when the caller must pass it through as it is.
    bool serve(const HostToDeviceCopy& c, CUresult* result);
    // After an allocation failed for want of memory: frees pool memory on the current device.
    bool yield_memory(size_t bytes);
    // Pool bytes on the current device (the runtime is told they are free: the pool yields them).
    size_t pool_bytes_current_device();
    void count_copy() { copies_.fetch_add(1, std::memory_order_relaxed); }
    void stats(moecache_cuda_stats* out);
    int sync(int timeout_ms);
    void shutdown();

private:
    struct Model {
        uint32_t id = 0;
        std::string path;
        ExpertMap map;
        std::vector<InodeId> files;
        std::vector<int32_t> layer_slot;   // by block index: index into map.layers, or -1
        std::vector<uint32_t> slice_base;  // by layer slot
        std::vector<uint32_t> slices_per_expert;  // by layer slot
        uint32_t n_slices = 0, n_experts = 0;
        std::atomic<uint32_t> client_handle{UINT32_MAX};
        [[nodiscard]] uint32_t slice(int32_t ls, uint32_t tensor, uint32_t e) const {
            return slice_base[ls] + tensor * map.n_experts + e;
        }
        [[nodiscard]] uint32_t expert(int32_t ls, uint32_t e) const { return static_cast<uint32_t>(ls) * map.n_experts + e; }
    };
    struct Snapshot {
        CopyClassifier classifier;
        std::vector<Model*> models;
    };
    struct MappedRange {
        uint32_t model, file;
        FileMapping mapping;
    };
    struct DevicePool {
        int device = 0;
        VramPool pool;
        std::vector<CUdeviceptr> arenas;  // under mu_
        std::atomic<uint64_t> bytes{0};   // written under mu_, read anywhere
        std::vector<std::vector<uint8_t>> full;  // [model][expert]: every slice pooled (under mu_)
        // How it served expert copies (slices; bytes), for the daemon's metrics.
        std::atomic<uint64_t> hits{0}, misses{0}, hit_bytes{0}, miss_bytes{0};
        uint64_t reported_hits = UINT64_MAX, reported_misses = 0, reported_bytes = 0;  // background thread
    };
    struct PlacementEvent {
        uint32_t model = 0, expert = 0;  // model-local expert index
        int device = 0;
        bool in_vram = false;
    };
    static constexpr size_t kPlacementQueue = 8192;
    static constexpr int kMaxDevices = 64;

    explicit Engine(EngineConfig cfg);
    void start();
    void run();
    void request_scan();
    void scan();
    Model* open_model(const MapsEntry& e);
    bool allocate_pool(int device);  // false: nothing to size it by yet
    void resize_pool(DevicePool& dp);
    [[nodiscard]] uint64_t pool_target(uint64_t expert_bytes, int device) const;
    void note_expert(DevicePool& dp, const Model& m, uint32_t expert);  // under mu_
    void drain_placements();
    void rezap_pooled();
    void drop_host_copy(const Model& m, uint32_t block, uint32_t expert);
    void pin_models(int device);
    void poll_directives();
    void report(Model& m, uint32_t block, uint32_t first, uint32_t n);
    void report_pools();

    EngineConfig cfg_;
    int wake_fd_ = -1;
    std::atomic<const Snapshot*> snapshot_{nullptr};
    std::atomic<bool> scan_requested_{true};
    std::atomic<uint32_t> scans_{0};
    std::atomic<uint64_t> devices_wanted_{0}, devices_done_{0};
    std::array<std::atomic<DevicePool*>, kMaxDevices> pools_{};
    std::atomic<bool> stopping_{false};

    // Background thread only.
    std::vector<Model*> models_;
    std::vector<InodeId> not_models_;
    std::vector<MappedRange> mapped_;
    std::vector<std::pair<void*, size_t>> pinned_;
    moecache_client* client_ = nullptr;
    std::array<uint64_t, kMaxDevices> daemon_budget_{};  // applied; 0: none

    // Runtime threads, under mu_.
    std::mutex mu_;
    ExpertHeat heat_;
    std::array<PlacementEvent, kPlacementQueue> placements_{};
    size_t n_placements_ = 0;
    std::mutex report_mu_;
    std::mutex sync_mu_;
    std::condition_variable sync_cv_;

    std::atomic<uint64_t> copies_{0}, expert_copies_{0}, served_{0}, hits_{0}, misses_{0}, bytes_pool_{0},
        bytes_host_{0}, captured_{0}, fallbacks_{0}, pinned_bytes_{0}, reported_{0}, in_vram_{0}, yielded_{0},
        n_models_{0}, dropped_host_bytes_{0}, placements_lost_{0}, directives_{0};
};

}  // namespace moecache::cuda::hook
