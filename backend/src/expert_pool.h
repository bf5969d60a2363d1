// The experts the devices hold for the backend: on each device an arena per slice size (one buffer
// of the device's own ggml backend, a slot per expert slice) and its slots' bookkeeping (the hook's
// VramPool), the local heat (the hook's ExpertHeat: one policy for both routes), and the expert
// tensors the runtime put in the backend's buffers. With several devices each serves layers of its
// own (disjoint pools: no expert held twice). One per process: every context's backend shares it,
// under its lock.
#pragma once

#include "daemon_link.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "moecache/backend/read_ahead.h"
#include "moecache/cuda/vram_pool.h"
#include "settings.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace moecache::backend {

struct ExpertTensor {
    const char* data = nullptr;  // in the mapping (or the runtime's host buffer)
    ggml_type type = GGML_TYPE_F32;
    int64_t ne0 = 0, ne1 = 0, n_expert = 0;
    size_t slice_bytes = 0;  // one expert: nb[2]
    // The layer's tensors are one group (the pool's model): an expert is pooled when each of its
    // group's slices is, and is admitted and evicted whole. Slice index: index * n_expert + expert.
    uint32_t group = 0, index = 0;
    uint32_t block = 0;  // the layer: N of blk.N (what the daemon's expert map numbers)
    // Its mapping reads at random (a lazily loaded model): what is read of it from the mapping is
    // read ahead first (read_ahead.h), not faulted in a page at a time: from the file (`file`,
    // shared with the pool's list, so that a read under way keeps it open) where it can be opened.
    bool random_reads = false;
    std::shared_ptr<const UniqueFd> file;
    uint64_t file_offset = 0;  // of data
    [[nodiscard]] int fd() const { return file ? file->get() : -1; }
    std::string name;
};

struct PoolArena {
    ggml_backend_buffer_t buffer = nullptr;
    ggml_tensor* whole = nullptr;  // every slot, as bytes: what fills write through
    char* base = nullptr;          // the buffer's base (a device address)
    uint64_t slot_bytes = 0;
    uint32_t slots = 0;    // all of them: the pool's, then the staging ones
    uint32_t staging = 0;  // the last `staging` slots: a large batch's misses, copied in for it
    // The arena seen as one expert tensor [ne0, ne1, slots] of a type: what a compute reads.
    struct View {
        ggml_type type;
        int64_t ne0, ne1;
        ggml_tensor* tensor;
    };
    std::vector<View> views;
};

struct PoolStats {  // the leading fields up to `staged` keep their places (moecache_ggml_pool_stats, the tests)
    uint64_t pool_rows = 0, cpu_rows = 0, fills = 0, fill_bytes = 0, declined = 0;
    uint64_t forgotten = 0;  // queued fills dropped: the runtime freed their model's memory (forget)
    uint64_t units = 0, nodes = 0;  // splits computed as a layer's chain, and node by node
    uint64_t staged = 0, staged_bytes = 0;  // slices a large batch copied to the device for itself
    uint64_t staged_admitted = 0;           // of them, copied into a free slot of the pool (kept there)
    uint64_t cpu_alone = 0, cpu_fillers = 0;  // CPU halves computed as their rows alone, or with fillers
    uint64_t crossed = 0, crossed_admitted = 0;  // small batches' misses copied over for the compute (into the pool)
    uint64_t read_ahead = 0, read_ahead_bytes = 0;  // slices the page cache lacked pages of, the bytes read for them
    bool registered = false;                // the expert tensors are pinned for DMA
    // Where the computes' time went (MOECACHE_GGML_LOG's figures), in nanoseconds: all of the
    // backend's computes and the pinning; and for a layer's chain, by batch (0: small ones, decode;
    // 1: large ones, prompts), its finding and split (with the first's arenas), its issue on the device (staging, uploads, launch), its CPU half, the
    // wait for the device's half after it, and the bookkeeping (join, heat, reports).
    uint64_t compute_ns = 0, register_ns = 0, computes = 0;
    struct Phases {
        uint64_t units = 0, prep_ns = 0, issue_ns = 0, build_ns = 0, upload_ns = 0, launch_ns = 0, cpu_ns = 0, cpu_graph_ns = 0, wait_ns = 0, book_ns = 0;
        // The process's page faults while CPU halves ran (every thread's: the CPU's threads are
        // the runtime's pool): whether a slow half waited for the page cache or the disk.
        uint64_t cpu_minor_faults = 0, cpu_major_faults = 0;
        uint64_t read_ahead_ns = 0, cross_ns = 0;  // of issue_ns: the misses' reads ahead, their crossings
        // The chains' rows: pooled when they came, crossed over for the compute, computed on the
        // CPU; and the distinct experts the CPU computed (its weight bytes).
        uint64_t hit_rows = 0, crossed_rows = 0, cpu_rows = 0, cpu_experts = 0;
        // Chains with misses by how they were computed: every miss crossing, or split between the
        // CPU and the link (Crossing's two arms), and their time from the misses' reads to the results.
        uint64_t all_units = 0, all_chain_ns = 0, split_units = 0, split_chain_ns = 0;
    } phases[2];
};

// The devices that `settings` names for the pools (MOECACHE_GGML_DEVICE: auto is every GPU ggml
// has), none where there are none; `tell`: say why not (a name ggml does not know, once each).
std::vector<ggml_backend_dev_t> pool_devices(const Settings& settings, bool tell);

// A device's pool, as moecache_ggml_device_stats gives it (tests, tools).
struct DeviceStats {
    uint64_t rows = 0;            // rows its pool computed
    uint32_t groups = 0;          // layers it serves
    uint32_t pooled_experts = 0;  // experts its pool holds now
};

class ExpertPool {
public:
    static ExpertPool& get();

    // An expert tensor (3-D, op NONE) the runtime placed in one of the backend's buffers.
    void add_tensor(const ggml_tensor* t);
    // The runtime frees the buffer [base, base + size) (a model it unloads, its mapping about to go):
    // every group with a tensor there leaves the pool (queued fills dropped, slots given back), and
    // a copy from there that the pool's thread is making is waited for. Nothing reads that memory
    // afterwards, and a later model at the same addresses is not taken for it.
    void forget(const char* base, size_t size);
    // The expert tensor whose data starts at `data`, or null.
    [[nodiscard]] const ExpertTensor* find(const void* data) const;

    // Makes the arenas on the devices that `settings` names (once; the first compute does it, after
    // the runtime allocated its own buffers), the layers dealt among them by their room. Null when
    // there is no such device or no room: every expert is then computed on the CPU, and the reason
    // said once. Else the first device.
    ggml_backend_dev_t device(const Settings& settings);
    // Under mu, once device() made them: the device that serves the group's layer (its index, and it).
    [[nodiscard]] size_t device_index(uint32_t group) const {
        return group < device_of_.size() ? device_of_[group] : 0;
    }
    [[nodiscard]] ggml_backend_dev_t device_at(size_t index) const { return devs_[index].dev; }
    // Under mu: each device's pool (at most `max`); how many there are.
    size_t device_stats(DeviceStats* out, size_t max);
    void count_device_rows(size_t index, uint32_t rows) { devs_[index].rows += rows; }

    // Under mu: the slot that holds the expert's slice, or -1; the arena of its size on the device
    // that serves its layer.
    int32_t slot_of(const ExpertTensor& t, int32_t expert);
    // Under mu: whether every slice of the expert in its group is in a slot (and filled).
    bool pooled(uint32_t group, int32_t expert);
    [[nodiscard]] const PoolArena* arena_for(const ExpertTensor& t) const;
    // Under mu: the arena of the tensor's slice size as a tensor of its type and shape, whose
    // expert i is slot i (made once; null when the device cannot place it).
    ggml_tensor* view(const ExpertTensor& t);
    // Under mu: what the computes used. Misses that the local policy admits are copied in by the
    // pool's own thread, off the computes' path: a slot serves once its copy is done.
    // `tokens`: the batch's. Reported to moecached with the experts, whose directives are followed.
    void used(uint32_t group, const std::vector<int32_t>& pooled, const std::vector<int32_t>& missed, uint32_t tokens);

    // A slot, and where in its arena, for one slice of an expert being admitted.
    struct Placed {
        const ExpertTensor* tensor;
        const PoolArena* arena;
        size_t offset;
    };
    // Under mu: admits the expert (a slot for each of its slices, as used() would) for a copy the
    // caller queues on its own stream, then commit()s once the copy is done; false: declined.
    // evict false: only into free slots.
    bool admit_here(uint32_t group, uint32_t expert, std::vector<Placed>* placed, bool evict = true);
    // Under mu: the slices admit_here placed are in (done true: they serve from now on), or their
    // copy failed (their slots are given back).
    void settle(uint32_t expert, const std::vector<Placed>& placed, bool done);
    // Under mu: the experts' slices in the group that are about to be read from the host (computed
    // on the CPU, copied to a device) and that a lazily loaded mapping would fault in a page at a
    // time: read ahead now, in large requests (read_ahead.h), with `lock` (of mu) released while
    // reading. True when it was released (the pool may have changed meanwhile).
    bool read_ahead(uint32_t group, const std::vector<int32_t>& experts, std::unique_lock<std::mutex>& lock);
    std::shared_ptr<const UniqueFd> mapped_file(const MappingReads& reads);  // under mu
    // Under mu: how hot the expert is to the local policy (what admissions compare).
    [[nodiscard]] uint32_t heat(uint32_t group, int32_t expert) const {
        return heat_.heat(group, static_cast<uint32_t>(expert));
    }

    [[nodiscard]] PoolStats stats() const { return stats_; }
    void count_split(bool unit) { ++(unit ? stats_.units : stats_.nodes); }
    PoolStats& timing() { return stats_; }  // under mu
    void count_rows(uint32_t pool, uint32_t cpu) {
        stats_.pool_rows += pool;
        stats_.cpu_rows += cpu;
    }
    std::mutex mu;

    // Waits for the fills queued so far (tests; before exit).
    void drain();
    // The pool's thread pins the experts' host memory (register_for_dma) before its first fill; a
    // copy from a range while the driver registers it is a race (the CUDA call may fail), so no
    // compute copies from the mapping until it is done: decode keeps its misses on the CPU
    // meanwhile (registering()), a large batch waits for it (wait_registered, under mu).
    [[nodiscard]] bool registering() const { return registering_; }
    // Copies from the experts' memory to the pool's device go through the driver's bounce buffer:
    // a CUDA device, the expert tensors not (or not yet) pinned. Under mu.
    [[nodiscard]] bool pageable() const { return cuda_ && !stats_.registered; }
    void wait_registered(std::unique_lock<std::mutex>& lock);
    // Tests: while held, the pool's thread starts no fill (they stay queued).
    void hold_fills(bool hold);
    void count_crossed(bool into_pool) {
        ++stats_.crossed;
        stats_.crossed_admitted += into_pool ? 1 : 0;
    }
    void count_staged(uint64_t bytes, bool into_pool) {
        ++stats_.staged;
        stats_.staged_bytes += bytes;
        stats_.staged_admitted += into_pool ? 1 : 0;
    }

private:
    struct Fill {
        const ExpertTensor* tensor;
        uint32_t expert;
        const PoolArena* arena;
        size_t offset;
        [[nodiscard]] uint64_t slot() const;  // the slot's device address
        [[nodiscard]] cuda::SliceRef slice() const;
    };
    // A device's pool: its arenas (and the context of their tensors) and its slots.
    struct Device {
        ggml_backend_dev_t dev = nullptr;
        std::vector<PoolArena> arenas;
        ggml_context* ctx = nullptr;
        cuda::VramPool slots;
        uint64_t pool_bytes = 0;
        uint64_t rows = 0;
    };
    void deal_groups(const std::vector<ggml_backend_dev_t>& devs);
    bool make_arenas(Device& d, size_t index, const Settings& settings);
    [[nodiscard]] cuda::VramPool& slots(uint32_t group) { return devs_[device_index(group)].slots; }
    void register_for_dma();
    void fill_loop();
    static void stop_filler();
    // Hot profiles (moecache/cuda/hot_profile.h, the hook's format and folder): a mapped model's
    // heat from earlier runs, read when its pool is made, saved when it is freed and at exit.
    struct Profile {
        std::string path;             // the profile's file; "" once saved for good (or unwritable)
        std::vector<uint32_t> groups;  // its layers' groups, by block
        uint32_t n_experts = 0;
        uint64_t routings = 0, routed = 0;  // earlier runs'; this run's
        uint64_t tokens = 0, saved = 0;     // this run's tokens a layer saw (summed over layers); at the last save
    };
    void read_profiles(const std::string& dir);
    void save_profile(Profile& p, bool final);

    // A group whose tensors are still the runtime's (forget() empties it).
    [[nodiscard]] bool live(uint32_t group) const { return group < groups_.size() && !groups_[group].empty(); }
    bool admit(uint32_t group, uint32_t expert);
    bool admit_slots(uint32_t group, uint32_t expert, std::vector<Placed>* placed, bool evict = true);
    void committed(const ExpertTensor& t, uint32_t expert);
    uint32_t model_of(uint32_t group);
    void follow(const moecache_directive& d);

    std::unordered_map<const void*, ExpertTensor> tensors_;
    std::vector<std::vector<const ExpertTensor*>> groups_;  // by group: its tensors, by index
    std::optional<MappingReads> reads_;  // the mapping add_tensor looked up last (smaps)
    std::shared_ptr<const UniqueFd> reads_file_;  // its file, opened (one of files_), or none
    // The files of random-read mappings, for their reads ahead: one descriptor a file.
    std::vector<std::shared_ptr<const UniqueFd>> files_;
    std::unordered_map<std::string, uint32_t> group_of_;     // "blk.N." -> group
    std::unique_ptr<DaemonLink> link_;
    std::vector<uint32_t> group_model_;  // by group: the daemon link's model handle (UINT32_MAX: none)
    uint64_t pool_bytes_ = 0;  // every device's
    uint32_t since_report_ = 0;
    std::deque<Device> devs_;            // made once (device()); a deque: a VramPool does not move
    std::vector<uint32_t> device_of_;    // by group: the index of the device that serves it
    cuda::ExpertHeat heat_;
    bool tried_ = false;
    bool log_ = false;
    PoolStats stats_;
    std::deque<Fill> fills_;  // under mu
    std::optional<Fill> copying_;  // the fill the pool's thread copies now, popped and not committed (under mu)
    std::condition_variable fill_cv_, drained_cv_;
    std::thread filler_;
    bool stop_ = false;
    bool hold_ = false;
    bool registering_ = false;  // under mu
    bool cuda_ = false;         // the pools are on CUDA devices (set with them)
    std::vector<Profile> profiles_;
    std::vector<int32_t> profile_of_;  // by group: its index in profiles_, or -1
};

}  // namespace moecache::backend
