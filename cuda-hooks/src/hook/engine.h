// What the hooked calls do beyond passing through: find the model files this process maps, decode
// host-to-device copies out of them into router telemetry, serve expert slices from a VRAM pool
// per device, and stage the rest through pinned buffers.
//
// Files by domain: engine.cpp (the background thread's loop, settings, stats), models.cpp (maps
// scans, GGUF models, what the hook cannot see), serve.cpp (the copy path), pools.cpp (a device's
// pool: its size, its streams, yielding), staging.cpp (pinned staging), daemon_link.cpp (router
// reports, placements, directives, one place).
//
// Threads: the runtime's threads call serve(), the allocation hooks and on_stream_destroy(); they
// read the published snapshot of mappings without a lock and take one device's lock
// (DevicePool::mu) for that device's pool, heat and streams, never a lock of another device and no
// CUDA call that waits under it. One background thread owns everything slow: /proc/self/maps scans
// and GGUF parsing, the connection to the daemon (through the client runtime), pool allocation and
// sizing, DMA registration, measuring the staging path. Nothing is freed while a hooked call could
// still read it: snapshots, models and device pools live until exit.
#pragma once

#include "copy_kernel.h"
#include "cuda_api.h"
#include "moecache/cuda/copy_classifier.h"
#include "moecache/cuda/hook_config.h"
#include "moecache/cuda/vram_pool.h"
#include "moecache/cuda_hook.h"
#include "moecache/first_fill.h"
#include "moecache/model.h"
#include "moecache/process_maps.h"
#include "staging.h"

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

struct moecache_client;

namespace moecache::cuda::hook {

struct Driver;

struct HostToDeviceCopy {
    CUdeviceptr dst = 0;
    const void* src = nullptr;
    size_t bytes = 0;
    CUstream stream = nullptr;  // as the caller gave it
    bool async = true;
    bool per_thread = false;    // a _ptsz/_ptds entry point: stream 0 is the per-thread stream
    bool dst_checked = true;    // false when the caller did not say the destination is device memory
};

class Engine {
public:
    // Null when the hook is off (MOECACHE_CUDA=off) or in a child after fork.
    static Engine* get();
    // The engine if a hooked call has created it, without creating it.
    static Engine* peek();

    // Serves a host-to-device copy through the pool and the staging buffers; true when it did (the
    // result in *result), false when the caller must pass it through as it is.
    bool serve(const HostToDeviceCopy& c, CUresult* result);
    // A small device-to-host copy the runtime made on this thread (routes.cpp): perhaps its
    // router's choices read back, as llama.cpp reads them before it copies the experts they name.
    void note_readback(const void* dst, size_t bytes);
    // Before the runtime destroys a stream: what it queued on pool slots stays ordered.
    void on_stream_destroy(CUstream stream);
    // After an allocation failed for want of memory: frees pool memory on the current device.
    bool yield_memory(size_t bytes);
    // What a free-memory query on the current device reports, from what the driver said: the
    // pool's bytes are free to the runtime (it yields them), the room a claimed pool will take
    // is not (HookConfig::claim).
    size_t reported_free(size_t driver_free);
    uint64_t pool_bytes(int device);
    void count_copy() { copies_.fetch_add(1, std::memory_order_relaxed); }
    void stats(moecache_cuda_stats* out);
    int sync(int timeout_ms);
    void shutdown();

private:
    // Expert tensors (model-local: slice / n_experts) that lie within a page of each other in one
    // file, in file order, and their file bytes [start, end): registered as one.
    struct TensorRun {
        std::vector<uint32_t> tensors;
        uint64_t start = 0, end = 0;
        bool done = false;
    };
    struct Model {
        uint32_t id = 0;
        std::string path;
        ExpertMap map;
        std::vector<InodeId> files;
        std::vector<int> fds;  // by file: the hook's own descriptor of it (misses read through it), or -1
        std::vector<int32_t> layer_slot;   // by block index: index into map.layers, or -1
        std::vector<uint32_t> slice_base;  // by layer slot
        std::vector<uint32_t> slices_per_expert;  // by layer slot
        uint32_t n_slices = 0, n_experts = 0;
        std::atomic<uint32_t> client_handle{UINT32_MAX};
        // The registered tier, per slice: not registered, asked for, its page-aligned inside
        // registered on its own, never (failed, over the budget), all of it inside a registration
        // of its whole tensor.
        static constexpr uint8_t kNone = 0, kAsked = 1, kInside = 2, kNever = 3, kWhole = 4;
        std::unique_ptr<std::atomic<uint8_t>[]> registered;
        // By expert (background thread only): whether the daemon keeps it locked (its last Lock or
        // Unlock), and the devices whose pools hold it. With a daemon the registered tier is
        // exactly what is locked and in no pool (follow_registration).
        std::vector<uint8_t> daemon_locked;
        std::vector<uint64_t> pooled_on;
        std::vector<uint8_t> promoted;  // by expert (background thread only): the daemon's Promote
        // The hot profile the last run left (hot_profile.h), as heat by expert (empty: none), and
        // the experts of it queued to fill the pools while no daemon directs them (background thread).
        std::string profile_path;  // where this run's is saved ("": profiles off, or not named)
        uint64_t profile_routings = 0;  // the routings the profile read came from
        std::vector<uint32_t> prior;
        std::vector<uint8_t> prior_wanted;
        std::atomic<uint64_t> routed{0};  // decode routings this run (experts, not slices)
        // Copies ahead (serve.cpp), per model: runs of its copies laid out as the host tensor, and
        // whether one was not (or a slice queued ahead was not asked for): then never again.
        std::atomic<uint32_t> mirrored_runs{0};
        std::atomic<bool> ahead_off{false};
        uint64_t routed_saved = 0;        // of them, those in the profile last saved (under profile_mu_)
        // How many experts are promoted now (read by the copy path: the daemon directs this
        // model's pools, and a prompt's batches admit only what it promoted).
        std::atomic<uint32_t> n_promoted{0};
        // Registering ahead (background thread only): runs of neighbouring expert tensors.
        std::vector<TensorRun> runs;
        std::vector<uint32_t> run_of_tensor;  // by tensor (slice / n_experts)
        bool runs_built = false;
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
    struct PlacementEvent {
        uint32_t model = 0, expert = 0;  // model-local expert index
        bool in_vram = false;
    };
    // A stream that queued work on pool slots, as the pool names it (StreamId = index + 1).
    struct StreamState {
        CUstream handle = nullptr;
        CUevent event = nullptr;  // recorded on it when another stream must wait for it
        bool dirty = false;       // queued slot work since the last record
        bool idle = false;        // the last record completed and nothing was queued since
        bool retired = false;     // destroyed by the runtime
        bool eager = false;       // recorded after its own slot work (another thread cannot)
    };
    // A run of copies of one layer's expert tensors: that layer's routing of one batch.
    struct LayerStep {
        uint32_t model = UINT32_MAX;
        int32_t layer = -1;
        uint32_t tensor = UINT32_MAX;  // of the last copy
        uint32_t experts = 0;          // its slices copied so far in this step
        uint32_t most = 0;             // the most of any tensor's in this step
        uint32_t before = 0;           // `most` of the step before (the previous layer's)
    };
    struct DevicePool {
        int device = 0;
        CUcontext ctx = nullptr;  // the device's primary context (retained)
        // Devices whose pools this device's copies may read (peer access enabled both ways).
        std::atomic<uint64_t> peers{0};
        std::mutex mu;  // everything below that is not atomic
        VramPool pool;
        ExpertHeat heat;
        std::vector<CUdeviceptr> arenas;
        std::vector<std::vector<uint8_t>> full;  // [model][expert]: every slice pooled
        std::vector<std::vector<uint8_t>> seen;  // [model][tensor (slice / n_experts)]: this device copies it
        // The process has this one device and a daemon directs its pool: it copies every expert
        // tensor, and the pool is sized for all of them when it is made (at the runtime's first copy
        // of a model's bytes, while it loads) rather than layer by layer as the first prompt's
        // copies arrive.
        bool sole = false;
        bool one_device = false;  // the process sees this device alone (sole once a daemon directs)
        std::vector<PlacementEvent> placements;  // for the background thread
        std::unordered_map<CUstream, StreamId> stream_ids;  // live streams
        std::vector<StreamState> streams;
        LayerStep step;
        std::atomic<uint64_t> seen_bytes{0};  // expert bytes of the layers seen
        std::atomic<uint64_t> bytes{0};       // allocated; written under mu, read anywhere
        std::atomic<bool> staged{false};      // misses go through `staging`
        // The daemon asked for one place here (the background thread keeps it current): an expert
        // the pool takes leaves RAM, and one it lets go is read from storage again. The copy path
        // then evicts only for what the daemon promoted: its own admissions fill free slots.
        std::atomic<bool> one_place{false};
        // The hook's copy kernel in the device's primary context (copy_kernel.h); null: the
        // driver's device-to-device copies. Set by the background thread before the pool is published.
        CUfunction copy_fn = nullptr;
        CUfunction copy_n_fn = nullptr;  // its several-range form: copies ahead (null: none)
        CUmodule copy_module = nullptr;
        std::unique_ptr<StagingRing> staging; // set by the background thread before `staged`
        // Host-to-device speed from pinned memory, measured when the pool was made (0: not measured).
        double link_gbps = 0;
        double memcpy_gbps = 0;  // one thread's memcpy from that memory, measured beside it
        std::atomic<bool> copies_set_up{false};  // set_up_copies ran: the miss path can be told
        std::atomic<int> told_path{0};       // the MissPath last told (0: none yet); written by the background thread
        std::atomic<uint64_t> sized_for{0};  // seen_bytes when last sized (by the background thread)
        std::atomic<uint64_t> target{0};     // what it was last sized to hold (0: not sized yet)
        uint64_t made_ns = 0;                // when it was made: the first fill ends kFirstFillNs after
        // Counters, any thread (relaxed atomics): how it served expert copies (slices; bytes), for
        // the daemon's metrics and the exit summary.
        struct Counters {
            std::atomic<uint64_t> hits{0}, misses{0}, hit_bytes{0}, miss_bytes{0};
            // Of those, the copies of decode steps (routing copies outside a prompt batch).
            std::atomic<uint64_t> decode_hits{0}, decode_misses{0}, decode_admits{0};
            std::atomic<uint64_t> peer_lookups{0};  // slices another device looked up here
            std::atomic<uint64_t> filled{0};        // slices filled ahead (fill.cpp)
            // Why a stream could not be ordered after another's slot work: unknown stream, retired
            // with work unrecorded, eager with work unrecorded, no event, record failed, no event
            // after all, query failed, wait failed.
            std::array<std::atomic<uint64_t>, 8> join_failures{};
        } counters;
        // The background thread's own (no lock: no other thread touches them).
        struct Background {
            // Filling ahead (fill.cpp): the hook's stream and scratch buffer on this device.
            CUstream fill_stream = nullptr;
            CUdeviceptr fill_scratch = 0;
            uint64_t fill_idle = UINT64_MAX;  // fill_gen_ when it last found nothing to fill
            bool first_fill_done = false;     // it held nine in ten of what it was directed to, once
            uint64_t reported_hits = UINT64_MAX, reported_misses = 0, reported_bytes = 0;  // to the daemon
            uint64_t daemon_budget = 0;  // applied; 0: none, else bytes + 1
        } bg;

        // Under mu. `from` is the device whose context queues on the stream, when it is not this
        // one (a peer reading this pool): such a stream is recorded after each use (eager).
        StreamId stream_id(CUstream s, int from = -1);
        void mark_dirty(StreamId id);    // under mu
    };
    class Joiner;
    // A device-to-device copy within dp's device: the copy kernel where it can, else the driver's.
    CUresult copy_in_device(const DevicePool& dp, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
    CUresult copy_for_runtime(const DevicePool& dp, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
    static constexpr size_t kPlacementQueue = 8192;
    // Room after each pool slot for the next slice's head: llama.cpp copies a slice with 512 bytes
    // of padding that are the next one's head, which a hit then serves from one slot in one copy.
    static constexpr uint32_t kSlotTail = 512;
    static constexpr int kMaxDevices = kMaxHookDevices;

    explicit Engine(HookConfig cfg);
    void start();
    void run();
    void request_scan();
    // models.cpp
    void scan();
    Model* open_model(const MapsEntry& e);
    void tell_unmapped();
    // pools.cpp
    bool allocate_pool(int device);  // false: nothing to size it by yet
    void size_for_every_expert(DevicePool& dp);
    void see_every_tensor(DevicePool& dp, const Model& m);  // under dp.mu
    void want_pool(int device);      // serve.cpp: asks the background thread for device's pool
    void want_pool_here();           // ... for the calling thread's device
    bool fillable(const Model& m, uint32_t expert, bool from_file) const;  // fill.cpp
    static uint64_t now_ns() {
        return static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
    }
    // When the copy path last saw a prompt's batch; fills from the file wait this long after one.
    std::atomic<uint64_t> last_batch_ns_{0};
    static constexpr uint64_t kPromptQuietNs = 2'000'000'000;
    static constexpr uint64_t kFirstFillNs =
        std::chrono::nanoseconds(kFirstFillBound).count();  // moecache/first_fill.h
    void resize_pool(DevicePool& dp);
    // The pool's size for a device whose experts take `experts` bytes in slots (tail rooms included).
    [[nodiscard]] uint64_t pool_target(const DevicePool& dp, uint64_t experts) const;
    void add_model_to(DevicePool& dp, const Model& m);  // under dp.mu
    void note_expert(DevicePool& dp, const Model& m, uint32_t expert);  // under dp.mu
    void note_all(DevicePool& dp);  // under dp.mu
    void free_arenas(DevicePool& dp, const std::vector<uint64_t>& bases);
    // staging.cpp
    void set_up_copies(DevicePool& dp);
    static std::pair<double, double> measure_link(const Driver* drv);
    void pin_models();
    bool register_wanted();  // the registered tier: what the copy path or the daemon's locks asked for, and ahead
    [[nodiscard]] uint64_t pin_budget() const;
    void decide_ahead();
    void build_runs(Model& m);
    void register_run(Model& m, size_t run, uint64_t budget);
    void unregister_ahead();
    // Where a slice lies in this process's mapping of it, and its page-aligned inside ({0, 0}: not mapped).
    std::pair<uintptr_t, uintptr_t> slice_span(const Model& m, uint32_t slice) const;
    std::pair<uintptr_t, uintptr_t> slice_pages(const Model& m, uint32_t slice) const;
    void unregister_slice(Model& m, uint32_t slice);  // queued: flush_unregisters() lets them go
    void flush_unregisters();
    void sync_pool_devices();
    void follow_registration(Model& m, int32_t ls, uint32_t e);
    // serve.cpp: the host's pieces of slices [first, first + n) of a copy (PIN=register splits them
    // at registered slices' page-aligned edges); `bytes` may run past the last slice (padding).
    CUresult copy_slices_from_host(DevicePool& dp, Model& m, int32_t ls, uint32_t tensor, uint32_t first_expert,
                                   uint64_t slice_bytes, CUdeviceptr dst, const HostBytes& from, uint64_t offset,
                                   uint64_t bytes, CUstream stream);
    // daemon_link.cpp
    void apply_daemon_budgets();
    void follow_daemon_locks();  // the daemon's locks are the registered tier from now on
    [[nodiscard]] int miss_path(const DevicePool& dp) const;
    void tell_miss_paths();
    // A link to the GPU (measured from pinned memory) below this, and clearly slower than one
    // thread's memcpy from the same memory (kSlowLinkShare of it), carries a token's misses more
    // slowly than the CPU would read them for its own math: PCIe 3.0 x8 and slower, a Thunderbolt
    // enclosure. (An H200's PCIe 5.0 x16 link moves ~50 GB/s; one thread's memcpy ~10-20.)
    static constexpr double kSlowLinkGBps = 8.0;
    static constexpr double kSlowLinkShare = 0.7;
    [[nodiscard]] bool daemon_asks_one_place() const;
    void drain_placements();
    void rezap_pooled();
    void drop_host_copy(const Model& m, uint32_t block, uint32_t expert);
    void poll_directives();
    // fill.cpp: the pools filled ahead with what the daemon promoted; true while there is more.
    void note_promoted(Model& m, uint32_t expert, bool promoted);
    bool fill_pools();
    bool fill_device(DevicePool& dp, bool from_file);
    // The pool is to hold it: the daemon promoted it, or (no daemon directing) the profile names it.
    [[nodiscard]] bool wants_filled(const Model& m, uint32_t expert, const DevicePool& dp) const;
    [[nodiscard]] bool prior_from_file(const DevicePool& dp, const Model& m, uint32_t expert) const;
    // models.cpp: the last run's hot profile of a model just opened; its experts queued to fill.
    void read_profile(Model& m);
    void queue_prior(Model& m);
    // Each model's hot profile saved where this run routed enough to say something (`final`: at exit).
    void save_profiles(bool final);
    void report(Model& m, uint32_t block, uint32_t first, uint32_t n);
    // routes.cpp: the routing one copy of a layer's first expert tensor tells, from the runtime's
    // read-back ids where they check out against the copy, else from the copy's experts where it
    // is a routing copy (`routing`: not every expert of the tensor).
    void report_copy(Model& m, const ExpertCopy& cls, bool routing);
    // This thread's read-back of the router's ids, checked against this layer's copy, was a batch
    // of more tokens than are reported one by one: a prompt, whatever its first group's size.
    [[nodiscard]] static bool readback_is_batch(const Model& m, uint32_t block);
    void report_experts(Model& m, uint32_t block, const uint32_t* experts, uint32_t n, uint32_t tokens);
    void report_pools();
    [[nodiscard]] bool daemon_wants_one_place(int device) const;
    // pools.cpp: peer access between a new pool's device and the others'.
    void connect_peers(DevicePool& dp);
    // serve.cpp
    // An expert copy served in steps (serve.cpp, serve_copy's comment), over the state they share.
    struct Serving;
    bool serve_copy(const HostToDeviceCopy& c, CUresult* result);
    bool prepare_serving(Serving& s);
    void serve_from_pool(Serving& s);
    void serve_from_peers(Serving& s);
    void take_admission_slots(Serving& s);
    void serve_from_host(Serving& s);
    void commit_admissions(Serving& s);
    void count_served(Serving& s);
    // Copies ahead (serve.cpp): the run of copies of one expert tensor this call belongs to, and
    // this device's hits of the rest of that run queued at its first copy.
    void follow_run(Serving& s);
    [[nodiscard]] bool claim_ahead(Serving& s, uint32_t i, bool* with_padding);
    [[nodiscard]] bool ahead_ready(Serving& s);
    bool queue_range(Serving& s, const CopyRange& range, uint32_t expert, uint64_t padding);
    void launch_ranges(Serving& s);
    void copy_ahead(Serving& s, StreamId sid, Joiner& order);
    void settle(DevicePool& dp, const Driver* drv, StreamId sid);  // under dp.mu
    CUresult copy_from_host(DevicePool& dp, CUdeviceptr dst, const HostBytes& src, size_t bytes, CUstream stream);

    HookConfig cfg_;
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
    bool pinned_all_ = false;  // every mapped expert byte registered for DMA
    bool told_unmapped_ = false;
    // Registering ahead (the budget holds every expert slice, no daemon): where it has got to.
    std::atomic<bool> ahead_{false};  // the budget holds every expert of the models mapped
    size_t ahead_models_ = SIZE_MAX, ahead_model_ = 0;
    size_t ahead_run_ = 0;
    std::vector<std::pair<void*, size_t>> ahead_ranges_;  // registered whole tensors
    bool ahead_waiting_ = false;  // runs not registered for want of cached pages: the pass starts again
    bool ahead_told_ = false;
    std::chrono::steady_clock::time_point ahead_retry_{};
    std::atomic<uint64_t> readback_reports_{0}, readbacks_refused_{0};  // routes.cpp
    // This thread's last read-back of the router's ids where it checked out for (m, block) and was
    // a decode step (few tokens): how many of its tokens chose each expert; null otherwise.
    [[nodiscard]] static const std::vector<uint32_t>* decode_readback(const Model& m, uint32_t block);
    [[nodiscard]] static uint64_t readback_seq();  // this thread's read-backs so far
    // Whether experts [first, first + n) are the first group the ids name (by expert: how many
    // tokens chose it): none chosen before them, each of them chosen, and the group ends there.
    [[nodiscard]] static bool first_group_of(const std::vector<uint32_t>& count, uint32_t first, uint32_t n);
    // Copies ahead (serve.cpp): slices queued ahead, and of them those not asked for (whether a
    // model's runs mirror the host tensor is its own: Model::mirrored_runs, Model::ahead_off).
    std::atomic<uint64_t> copied_ahead_{0}, ahead_unclaimed_{0};
    static constexpr uint32_t kMirroredRunsToTrust = 16;
    std::vector<std::pair<uintptr_t, size_t>> unregistering_;  // background thread: slices let go, not yet unregistered
    moecache_client* client_ = nullptr;
    CopyCrew crew_;

    std::mutex profile_mu_;  // saving profiles: the background thread now and then, the exit once
    std::chrono::steady_clock::time_point profile_saved_ = std::chrono::steady_clock::now();
    std::mutex report_mu_;
    std::mutex wanted_mu_;
    std::vector<std::pair<uint32_t, uint32_t>> wanted_;  // (model, slice) to register
    std::atomic<bool> follow_locks_{false};
    std::atomic<bool> register_failed_{false};  // the driver refused to register a model's pages
    // Background thread only: the client's connections so far (a new one is a new daemon), and
    // whether the connected daemon's policy has come (until then nothing is registered ahead).
    uint64_t daemon_connects_ = 0;
    bool daemon_decided_ = false;
    // Background thread only: the experts the daemon promoted, in the order it did (hottest first).
    std::vector<std::pair<uint32_t, uint32_t>> fill_queue_;  // (model, expert)
    bool fill_queue_dirty_ = false;                           // holds some no longer promoted
    // Moves when what a fill could do changes: a Promote or Unpromote, a Lock or Unlock, an expert
    // leaving a pool, a pool resized.
    uint64_t fill_gen_ = 0;
    std::atomic<bool> told_destroy_{false};  // PIN=register: a daemon's locks, not misses, choose
    std::mutex sync_mu_;
    std::condition_variable sync_cv_;

    std::atomic<uint64_t> copies_{0}, expert_copies_{0}, served_{0}, hits_{0}, misses_{0}, bytes_pool_{0},
        bytes_host_{0}, bytes_staged_{0}, captured_{0}, fallbacks_{0}, pinned_bytes_{0}, reported_{0}, in_vram_{0},
        yielded_{0}, n_models_{0}, dropped_host_bytes_{0}, placements_lost_{0}, directives_{0}, joins_{0},
        unmapped_copies_{0}, unmapped_bytes_{0}, serve_ns_{0}, pieces_{0}, peer_hits_{0}, bytes_peer_{0}, kernel_copies_{0},
        filled_{0};
    // Where serve_ns_ goes, with MOECACHE_CUDA_LOG only (a clock read a step of each copy): what the
    // copy is and the driver's answers on its stream and device (prepare); this device's pool, its
    // lookups and copies queued (pool); the host's pieces (host); admissions, slots taken and
    // filled (admit); of pool and admit, the device-to-device copies' launches (launch).
    enum Phase : size_t { kPrepare, kPool, kHost, kAdmit, kLaunch, kPhases };
    std::array<std::atomic<uint64_t>, kPhases> phase_ns_{};
    void add_phase(Phase p, uint64_t ns) { phase_ns_[p].fetch_add(ns, std::memory_order_relaxed); }
};

}  // namespace moecache::cuda::hook
