// libmoecache-ggml.so: a ggml backend that stock llama.cpp loads (GGML_BACKEND_PATH names it) and
// that `-ot exps=MOECACHE` gives the expert tensors. Its buffers are host memory: with mmap the
// loader wraps the model's mapping (buffer_from_host_ptr), so the bytes stay in the page cache
// where moecached's locks keep them. It computes the graph's MUL_MAT_ID nodes over those tensors:
// the experts a pool on a GPU holds there, the others on the CPU at the same time, the rows joined
// in the order the graph expects (row_split.h). Whatever else the scheduler gives it runs on ggml's
// own CPU backend, as do the CPU's halves: the same kernels as `-ot exps=CPU`, byte for byte.
//
// ggml's backend interface is internal and changes between releases: the library is built against
// one llama.cpp source tree and refuses to load into a ggml of another version.
#include "expert_pool.h"
#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "moecache/backend/cpu_threads.h"
#include "moecache/backend/row_split.h"
#include "say.h"
#include "settings.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <cstring>
#include <mutex>
#include <vector>

#include <sys/resource.h>

#ifndef MOECACHE_GGML_VERSION
#error "MOECACHE_GGML_VERSION: the ggml version of the source tree built against (backend/CMakeLists.txt)"
#endif

namespace moecache::backend {
namespace {

constexpr const char* kName = "MOECACHE";
constexpr size_t kAlignment = 64;

// ---- buffers: host memory, owned or the runtime's (the model's mapping) ----

struct HostBuffer {
    char* base = nullptr;
    size_t size = 0;
    bool owned = false;
    ggml_backend_buffer_t pinned = nullptr;  // owned memory from the pool device's host buffer type
};

HostBuffer* host(ggml_backend_buffer_t b) { return static_cast<HostBuffer*>(b->context); }

void buffer_free(ggml_backend_buffer_t b) {
    auto* h = host(b);
    // Its expert tensors leave the pool first: nothing copies from this memory once it is gone.
    if (h->base != nullptr) ExpertPool::get().forget(h->base, h->size);
    if (h->pinned != nullptr) {
        ggml_backend_buffer_free(h->pinned);
    } else if (h->owned) {
        free(h->base);
    }
    delete h;
}

const Settings& registry_settings();

// Host memory the pool's device copies to and from by DMA (CUDA's pinned host buffers), or null
// where it has none (a CPU stand-in) or pinning is off.
ggml_backend_buffer_t pinned_buffer(size_t size) {
    const Settings& settings = registry_settings();
    if (!settings.pin) return nullptr;
    const auto devs = pool_devices(settings, false);
    ggml_backend_dev_t dev = devs.empty() ? nullptr : devs.front();  // CUDA's pinned memory is every GPU's
    if (dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) return nullptr;
    ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(dev);
    return buft != nullptr ? ggml_backend_buft_alloc_buffer(buft, size) : nullptr;
}
void* buffer_base(ggml_backend_buffer_t b) { return host(b)->base; }
ggml_status buffer_init_tensor(ggml_backend_buffer_t, ggml_tensor* t) {
    if (t->view_src == nullptr) ExpertPool::get().add_tensor(t);
    return GGML_STATUS_SUCCESS;
}
void buffer_memset(ggml_backend_buffer_t, ggml_tensor* t, uint8_t value, size_t offset, size_t size) {
    memset(static_cast<char*>(t->data) + offset, value, size);
}
void buffer_set(ggml_backend_buffer_t, ggml_tensor* t, const void* data, size_t offset, size_t size) {
    memcpy(static_cast<char*>(t->data) + offset, data, size);
}
void buffer_get(ggml_backend_buffer_t, const ggml_tensor* t, void* data, size_t offset, size_t size) {
    memcpy(data, static_cast<const char*>(t->data) + offset, size);
}
bool buffer_cpy(ggml_backend_buffer_t, const ggml_tensor* src, ggml_tensor* dst) {
    if (src->buffer == nullptr || !ggml_backend_buffer_is_host(src->buffer)) return false;
    memcpy(dst->data, src->data, ggml_nbytes(src));
    return true;
}
void buffer_clear(ggml_backend_buffer_t b, uint8_t value) {
    if (host(b)->base != nullptr) memset(host(b)->base, value, host(b)->size);
}

ggml_backend_buffer_i buffer_iface() {
    ggml_backend_buffer_i i{};
    i.free_buffer = buffer_free;
    i.get_base = buffer_base;
    i.init_tensor = buffer_init_tensor;
    i.memset_tensor = buffer_memset;
    i.set_tensor = buffer_set;
    i.get_tensor = buffer_get;
    i.cpy_tensor = buffer_cpy;
    i.clear = buffer_clear;
    return i;
}

const char* buft_name(ggml_backend_buffer_type_t) { return kName; }
ggml_backend_buffer_t buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    auto* h = new HostBuffer;
    h->size = size;
    h->owned = true;
    // Pinned where the pool's device can pin: what crosses the link from and to these buffers (a
    // chain's activations and results, the experts' bytes with --load-mode none) goes by DMA, as
    // llama.cpp's own CPU buffers do beside a GPU.
    if (size > 0 && (h->pinned = pinned_buffer(size)) != nullptr) {
        h->base = static_cast<char*>(ggml_backend_buffer_get_base(h->pinned));
    } else if (size > 0) {
        h->base = static_cast<char*>(aligned_alloc(kAlignment, (size + kAlignment - 1) / kAlignment * kAlignment));
        if (h->base == nullptr) {
            say("out of memory for a buffer of %zu bytes", size);
            delete h;
            return nullptr;
        }
    }
    return ggml_backend_buffer_init(buft, buffer_iface(), h, size);
}
size_t buft_alignment(ggml_backend_buffer_type_t) { return kAlignment; }
bool buft_is_host(ggml_backend_buffer_type_t) { return true; }

// ---- the backend: one per runtime context ----

// How many of a small batch's misses cross the link to be computed on the device: a share that
// keeps the device's half (its hits, and the crossing misses' copies) level with the CPU's (the
// rest of the misses), learnt from how long the device kept the CPU waiting; or a share the user
// fixed (MOECACHE_GGML_CROSS). Each link to memory then carries its part at once: the CPU reads
// the misses it computes from RAM while the link brings others to the device.
// Levelling the halves misses one case: a CPU half has a cost of its own whatever it computes
// (its threads woken, its graph run: about 0.1 ms a chain on the GPU machine for 1.5 experts of
// 0.7 MB, qwen3-next-like), so with small experts every miss crossing can beat any split. So a
// second arm, every miss crossing, is tried on about one compute in 16, and whichever arm's
// chains took less time (a running mean of each) is the one used; the other keeps being tried.
class Crossing {
public:
    explicit Crossing(double fixed, double start = 0.25, bool all_arm = false)
        : fixed_(fixed >= 0), all_arm_(all_arm && fixed < 0), share_(fixed >= 0 ? fixed : start) {}
    size_t count(size_t misses) {
        all_now_ = false;
        if (all_arm_) {
            const bool explore = (cuda::next_draw(rng_) & (kExplore - 1)) == 0;
            all_now_ = all_best() != explore;
            if (all_now_) return misses;
        }
        carry_ += share_ * static_cast<double>(misses);
        const auto k = static_cast<size_t>(carry_);
        carry_ -= static_cast<double>(k);
        return std::min(k, misses);
    }
    // After a compute that had misses: the CPU's half took cpu_ns; the device's cost it did not hide
    // was wait_ns: the wait for it after the CPU's half, and the crossings' copies as far as they
    // held the CPU before it (a pageable copy returns only when done; a pinned one at once).
    // chain_ns: the whole chain, from its misses' reads ahead to the device's results. Returns
    // whether its misses all crossed (the arm count() chose).
    bool learn(uint64_t cpu_ns, uint64_t wait_ns, uint64_t chain_ns) {
        const bool all = std::exchange(all_now_, false);  // count() says again for the next compute
        if (fixed_) return all;
        if (all_arm_) {
            Arm& a = arms_[all ? 1 : 0];
            a.mean +=
                (static_cast<double>(chain_ns) - a.mean) / static_cast<double>(std::min<uint64_t>(++a.n, kWindow));
        }
        if (all) return all;  // the share is learnt from the split's own computes
        if (wait_ns > kSlack + cpu_ns / 8) {
            share_ = std::max(0.0, share_ - kDown);
        } else {
            share_ = std::min(1.0, share_ + kUp);
        }
        return all;
    }
    [[nodiscard]] double share() const { return share_; }
    // Whether every miss crossing has been the faster arm (enough of both seen).
    [[nodiscard]] bool all_best() const {
        return arms_[0].n >= kSeen && arms_[1].n >= kSeen && arms_[1].mean < arms_[0].mean * (1 - kMargin);
    }

private:
    struct Arm {
        double mean = 0;
        uint64_t n = 0;
    };
    static constexpr double kDown = 0.05, kUp = 0.02;
    static constexpr uint64_t kSlack = 20'000;  // a device's wait that is only its copy back and sync
    static constexpr uint64_t kExplore = 16;    // one compute in this many tries the other arm (a power of 2)
    static constexpr uint64_t kWindow = 64;     // each arm's mean: of about its last this many chains
    static constexpr uint64_t kSeen = 16;       // chains of each arm before the other is chosen
    static constexpr double kMargin = 0.03;     // every miss crossing must be this much faster
    bool fixed_, all_arm_;
    double share_, carry_ = 0;
    bool all_now_ = false;
    Arm arms_[2];  // 0: the share, 1: every miss crossing
    uint64_t rng_ = 0x9e3779b97f4a7c15ull;
};

struct Backend {
    Settings settings;
    Crossing crossing{-1, 0.25, true};  // set from settings when the backend is made
    // A large batch's misses: all of them cross at first (as llama.cpp offloads a prompt's CPU
    // experts), fewer where the CPU, computing the rest, keeps the device level.
    Crossing crossing_large{-1, 1.0};
    ggml_backend_t cpu = nullptr;
    void (*cpu_threads)(ggml_backend_t, int) = nullptr;
    // The CPU halves' own threads: without one, ggml's CPU backend built without OpenMP starts and
    // joins a thread per core at every compute (a disposable pool), about as long as a decode
    // chain's CPU half itself. (With OpenMP, as llama.cpp's CUDA builds are, its threads persist.)
    ggml_threadpool_t pool_threads = nullptr;
    int pool_threads_n = 0;
    ggml_threadpool_t (*threadpool_new)(ggml_threadpool_params*) = nullptr;
    void (*threadpool_free)(ggml_threadpool_t) = nullptr;
    void (*set_threadpool)(ggml_backend_t, ggml_threadpool_t) = nullptr;
    int threads = 0;
    int requested_threads = 0, usable_cpus = 1;  // the runtime's count, and the CPUs it was cut to
    struct Acc {  // a pool's device, made at its first pooled compute
        ggml_backend_t backend = nullptr;
        ggml_backend_buffer_t scratch = nullptr;  // on that device: activations, ids, results
    };
    std::vector<Acc> accs;  // by the pool's device index
    ggml_backend_buffer_t out_pinned = nullptr;  // the device half's results land here (pinned)
    std::vector<char> out_plain;                  // where the device has no pinned memory
    bool out_unpinnable = false;
    std::vector<char> ctx_mem;
    std::vector<char> ctx_mem_node;  // the one-node graph compute_unit is given in a split node by node
    std::vector<char> ctx_mem_cpu, cpu_scratch;  // the CPU's rows alone: their graph and tensors
    std::vector<int32_t> cpu_rows, cpu_ids;      // their rows (k, t) of the chain, and experts
    struct CpuResult {  // an output's CPU rows: where they go, and where the CPU computed them
        char* out;
        size_t out_nb1, out_nb2;
        const char* rows;
        size_t rows_nb, row_bytes;
    };
    std::vector<CpuResult> cpu_results;
    bool said_split_error = false;
};

struct Graph {
    ggml_context* ctx = nullptr;
    ggml_cgraph* graph = nullptr;
    Graph(std::vector<char>& mem, int tensors, int nodes) {
        const size_t bytes = ggml_tensor_overhead() * static_cast<size_t>(tensors) +
                             ggml_graph_overhead_custom(static_cast<size_t>(nodes), false);
        if (mem.size() < bytes) mem.resize(bytes);
        ggml_init_params p{bytes, mem.data(), true};
        ctx = ggml_init(p);
        graph = ggml_new_graph_custom(ctx, nodes, false);
    }
    ~Graph() { ggml_free(ctx); }
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;
};

bool is_noop(const ggml_tensor* t) {
    switch (t->op) {
        case GGML_OP_NONE: case GGML_OP_RESHAPE: case GGML_OP_VIEW: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
            return true;
        default:
            return false;
    }
}

ggml_status compute_on_cpu(Backend& be, ggml_tensor* node) {
    Graph g(be.ctx_mem, 0, 1);
    ggml_graph_add_node(g.graph, node);
    return ggml_backend_graph_compute(be.cpu, g.graph);
}

// The backend of the pool's device `index` (made once), or null.
Backend::Acc* acc_ready(Backend& be, size_t index, ggml_backend_dev_t dev) {
    if (be.accs.size() <= index) be.accs.resize(index + 1);
    auto& a = be.accs[index];
    if (a.backend != nullptr) return &a;
    a.backend = ggml_backend_dev_init(dev, nullptr);
    if (a.backend == nullptr) return nullptr;
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU && be.cpu_threads != nullptr && be.threads > 0) {
        be.cpu_threads(a.backend, be.threads);
    }
    return &a;
}

// Places `tensors` one after another in the scratch buffer on a pool's device.
bool place(Backend::Acc& acc, const std::vector<ggml_tensor*>& tensors) {
    auto* buft = ggml_backend_get_default_buffer_type(acc.backend);
    const size_t align = ggml_backend_buft_get_alignment(buft);
    size_t need = 0;
    for (auto* t : tensors) need += (ggml_backend_buft_get_alloc_size(buft, t) + align - 1) / align * align;
    if (acc.scratch == nullptr || ggml_backend_buffer_get_size(acc.scratch) < need) {
        if (acc.scratch != nullptr) ggml_backend_buffer_free(acc.scratch);
        acc.scratch = ggml_backend_buft_alloc_buffer(buft, need + need / 2);
        if (acc.scratch == nullptr) return false;
    }
    auto* at = static_cast<char*>(ggml_backend_buffer_get_base(acc.scratch));
    for (auto* t : tensors) {
        if (ggml_backend_tensor_alloc(acc.scratch, t, at) != GGML_STATUS_SUCCESS) return false;
        at += (ggml_backend_buft_get_alloc_size(buft, t) + align - 1) / align * align;
    }
    return true;
}

using Clock = std::chrono::steady_clock;
uint64_t ns_since(Clock::time_point t0) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

struct Faults {
    uint64_t minor = 0, major = 0;
};
// Only where the stats are said (MOECACHE_GGML_LOG): getrusage sums every thread's counts, work a
// decode chain's CPU half need not pay for otherwise.
Faults process_faults(const Settings& s) {
    if (!s.log && !s.log_often) return {};
    rusage u{};
    if (getrusage(RUSAGE_SELF, &u) != 0) return {};
    return {static_cast<uint64_t>(u.ru_minflt), static_cast<uint64_t>(u.ru_majflt)};
}

// From this many tokens a batch's misses are copied to the device rather than computed on the CPU:
// llama.cpp's own offload threshold (GGML_OP_OFFLOAD_MIN_BATCH's default).
constexpr int64_t kLargeBatch = 32;

// ---- a unit: a layer's expert FFN as one split (MUL_MAT_IDs and the row-wise ops between) ----

// Ops that compute row (k, t) of their output from row (k, t) of their inputs (or a broadcast):
// each half computes its rows of the whole chain, and the halves join once, at its outputs. (Not
// SCALE or CLAMP: the scheduler would hand over the router weights' own, a split of their own.)
bool row_wise(const ggml_tensor* t) {
    switch (t->op) {
        case GGML_OP_GLU: case GGML_OP_UNARY: case GGML_OP_MUL: case GGML_OP_ADD_ID:
            return true;
        default:
            return false;
    }
}

struct Unit {
    std::vector<ggml_tensor*> nodes;  // in order, the views among them
    std::vector<ggml_tensor*> mmids, outputs;
    std::vector<const ExpertTensor*> weights;  // by mmid
    ggml_tensor* ids = nullptr;
    uint32_t group = 0;
};

// The split as one unit, or nullopt: every node a MUL_MAT_ID over an expert tensor of one layer,
// all routed by one ids tensor, or a row-wise op or a view; every output [*, used, tokens] in F32.
std::optional<Unit> find_unit(ggml_cgraph* graph, ExpertPool& pool) {
    Unit u;
    std::unordered_set<const ggml_tensor*> in_unit, consumed;
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; ++i) {
        ggml_tensor* node = ggml_graph_node(graph, i);
        if ((node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0 && !is_noop(node)) return std::nullopt;
        if (node->op == GGML_OP_MUL_MAT_ID) {
            const ExpertTensor* t = pool.find(node->src[0]->data);
            if (t == nullptr || (u.ids != nullptr && node->src[2] != u.ids)) return std::nullopt;
            if (!u.weights.empty() && t->group != u.group) return std::nullopt;
            u.ids = node->src[2];
            u.group = t->group;
            u.mmids.push_back(node);
            u.weights.push_back(t);
        } else if (!row_wise(node) && !is_noop(node)) {
            return std::nullopt;
        }
        u.nodes.push_back(node);
        in_unit.insert(node);
    }
    if (u.mmids.empty()) return std::nullopt;
    // What a node of the unit consumes, seeing through views.
    for (auto* node : u.nodes) {
        if (is_noop(node)) continue;
        for (auto* src : node->src) {
            for (const ggml_tensor* s = src; s != nullptr; s = s->view_src) consumed.insert(s);
        }
    }
    const int64_t used = u.ids->ne[0], tokens = u.ids->ne[1];
    for (auto* node : u.nodes) {
        if (is_noop(node) || consumed.count(node) != 0) continue;
        if (node->type != GGML_TYPE_F32 || node->ne[1] != used || node->ne[2] != tokens || node->ne[3] != 1 ||
            !ggml_is_contiguous(node)) {
            return std::nullopt;
        }
        u.outputs.push_back(node);
    }
    return u;
}

// The CPU's rows of the chain alone: each row (k, t) of its own a token with one expert, so that
// the CPU computes no filler rows (a large batch's CPU half would otherwise compute every row of
// the layer). `gathered` runs once the chain is known to gather (the outputs are not written by
// the CPU from then on: the caller may download the device's results into them); the results stay
// in the backend's scratch for scatter_cpu_rows. nullopt: the chain has a shape this cannot gather
// (the caller computes it with fillers, in place).
std::optional<ggml_status> cpu_rows_alone(Backend& be, const Unit& u, const RowSplit& split,
                                          const std::function<void()>& gathered) {
    const int64_t used = u.ids->ne[0], tokens = u.ids->ne[1];
    auto& rows = be.cpu_rows;
    rows.clear();
    for (int64_t r = 0; r < used * tokens; ++r)
        if (!split.pooled[static_cast<size_t>(r)]) rows.push_back(static_cast<int32_t>(r));
    const auto n = static_cast<int64_t>(rows.size());
    if (n == 0) return GGML_STATUS_SUCCESS;
    be.cpu_ids.resize(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) be.cpu_ids[i] = split.experts[static_cast<size_t>(rows[i])];

    const size_t n_nodes = u.nodes.size();
    Graph g(be.ctx_mem_cpu, static_cast<int>(4 * n_nodes + 8), static_cast<int>(n_nodes));
    std::unordered_set<const ggml_tensor*> in_unit(u.nodes.begin(), u.nodes.end());
    std::unordered_map<const ggml_tensor*, ggml_tensor*> copy;
    std::vector<std::pair<ggml_tensor*, const ggml_tensor*>> made;  // in order; second: gathered from
    ggml_tensor* ids = ggml_new_tensor_2d(g.ctx, GGML_TYPE_I32, 1, n);
    ids->data = be.cpu_ids.data();
    copy.emplace(u.ids, ids);
    const auto rowwise = [&](const ggml_tensor* t) {  // [ne0, used or 1, tokens], rows contiguous
        return t->ne[2] == tokens && (t->ne[1] == used || t->ne[1] == 1) && t->ne[3] == 1 &&
               t->nb[0] == ggml_type_size(t->type) && ggml_blck_size(t->type) == 1;
    };
    bool ok = true;
    std::function<ggml_tensor*(ggml_tensor*)> compact = [&](ggml_tensor* t) -> ggml_tensor* {
        if (auto it = copy.find(t); it != copy.end()) return it->second;
        ggml_tensor* c = nullptr;
        if (in_unit.count(t) != 0 && is_noop(t) && t->view_src != nullptr && in_unit.count(t->view_src) != 0) {
            // A view inside the chain that keeps its parent's rows (a half of a fused up-gate).
            ggml_tensor* parent = compact(t->view_src);
            if (parent == nullptr || t->ne[1] != t->view_src->ne[1] || t->ne[2] != t->view_src->ne[2] ||
                t->nb[1] != t->view_src->nb[1] || t->nb[2] != t->view_src->nb[2] || t->ne[3] != 1 ||
                t->view_offs >= t->view_src->nb[1]) {
                return nullptr;
            }
            c = ggml_view_3d(g.ctx, parent, t->ne[0], 1, n, parent->nb[1], parent->nb[2], t->view_offs);
            made.emplace_back(c, nullptr);
        } else if (in_unit.count(t) != 0 && !is_noop(t)) {
            if (!rowwise(t) || t->ne[1] != used) return nullptr;
            c = ggml_new_tensor_3d(g.ctx, t->type, t->ne[0], 1, n);
            c->op = t->op;
            memcpy(c->op_params, t->op_params, sizeof c->op_params);
            c->flags = t->flags;
            for (int i = 0; i < GGML_MAX_SRC && ok; ++i) {
                ggml_tensor* src = t->src[i];
                if (src == nullptr) continue;
                const bool weight = (t->op == GGML_OP_MUL_MAT_ID && i == 0) || (t->op == GGML_OP_ADD_ID && i == 1);
                c->src[i] = weight ? src : compact(src);
                if (c->src[i] == nullptr) ok = false;
            }
            made.emplace_back(c, nullptr);
        } else {
            // From outside the chain (or a view of such): its rows gathered, one a CPU row.
            if (t->buffer == nullptr || t->data == nullptr || !ggml_backend_buffer_is_host(t->buffer) || !rowwise(t)) {
                return nullptr;
            }
            c = ggml_new_tensor_3d(g.ctx, t->type, t->ne[0], 1, n);
            made.emplace_back(c, t);
        }
        copy.emplace(t, c);
        return c;
    };
    for (auto* node : u.nodes) {
        if (is_noop(node)) continue;
        ggml_tensor* c = compact(node);
        if (c == nullptr || !ok) return std::nullopt;
        ggml_graph_add_node(g.graph, c);
    }
    size_t bytes = 0;
    for (const auto& [c, from] : made)
        if (c->view_src == nullptr) bytes += (ggml_nbytes(c) + kAlignment - 1) / kAlignment * kAlignment;
    if (be.cpu_scratch.size() < bytes + kAlignment) be.cpu_scratch.resize(bytes + kAlignment);
    auto* at = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(be.cpu_scratch.data()) + kAlignment - 1) /
                                       kAlignment * kAlignment);
    for (const auto& [c, from] : made) {
        if (c->view_src != nullptr) {
            c->data = static_cast<char*>(c->view_src->data) + c->view_offs;
            continue;
        }
        c->data = at;
        at += (ggml_nbytes(c) + kAlignment - 1) / kAlignment * kAlignment;
        if (from == nullptr) continue;
        const size_t row = ggml_row_size(from->type, from->ne[0]);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = rows[static_cast<size_t>(i)], k = r % used, t = r / used;
            memcpy(static_cast<char*>(c->data) + i * c->nb[2],
                   static_cast<const char*>(from->data) + (from->ne[1] == 1 ? 0 : k) * from->nb[1] + t * from->nb[2], row);
        }
    }
    be.cpu_results.clear();
    for (auto* o : u.outputs) {
        const ggml_tensor* c = copy.at(o);
        be.cpu_results.push_back(Backend::CpuResult{static_cast<char*>(o->data), o->nb[1], o->nb[2],
                                           static_cast<const char*>(c->data), c->nb[2], ggml_row_size(o->type, o->ne[0])});
    }
    gathered();
    return ggml_backend_graph_compute(be.cpu, g.graph);
}

// The CPU's rows, computed alone, written to their rows of the outputs: after the device's results
// landed there (the CPU's rows of those are fillers).
void scatter_cpu_rows(const Backend& be, int64_t used) {
    for (const auto& o : be.cpu_results) {
        for (size_t i = 0; i < be.cpu_rows.size(); ++i) {
            const int64_t r = be.cpu_rows[i], k = r % used, t = r / used;
            memcpy(o.out + k * o.out_nb1 + t * o.out_nb2, o.rows + i * o.rows_nb, o.row_bytes);
        }
    }
}

// Host memory for the device half's results, pinned where the device can pin.
char* out_space(Backend& be, size_t bytes) {
    if (be.out_pinned != nullptr && ggml_backend_buffer_get_size(be.out_pinned) >= bytes) {
        return static_cast<char*>(ggml_backend_buffer_get_base(be.out_pinned));
    }
    if (be.out_pinned != nullptr) ggml_backend_buffer_free(be.out_pinned);
    be.out_pinned = be.out_unpinnable ? nullptr : pinned_buffer(bytes + bytes / 2);
    if (be.out_pinned != nullptr) return static_cast<char*>(ggml_backend_buffer_get_base(be.out_pinned));
    be.out_unpinnable = true;  // not asked again at every chain
    be.out_plain.resize(bytes);
    return be.out_plain.data();
}

// Whether the device half's results (`outs`) come back into pinned memory, made ready for them.
bool out_pinned(Backend& be, const std::vector<ggml_tensor*>& outs) {
    size_t bytes = 0;
    for (const auto* o : outs) bytes += ggml_nbytes(o);
    (void)out_space(be, bytes);
    return be.out_pinned != nullptr;
}

using Admitted = std::vector<std::pair<uint32_t, std::vector<ExpertPool::Placed>>>;

// Under the pool's lock: the `k` hottest of a small batch's misses (decode's), copied to the device
// on its stream to be computed there: into the pool where the policy admits them (the admission's
// one copy; `admitted` holds them until the compute settles them), else into staging slots. Returns
// the experts that crossed; `staged` learns their slots, by MUL_MAT_ID.
std::unordered_set<int32_t> cross_misses(ggml_backend_t acc, ExpertPool& pool, const Unit& unit, const RowSplit& split,
                                         bool large, size_t k, std::vector<std::unordered_map<int32_t, int32_t>>& staged,
                                         Admitted& admitted) {
    const uint32_t group = unit.group;
    std::vector<int32_t> order = split.cpu_experts;
    if (large) {  // those with the most rows first
        std::unordered_map<int32_t, uint32_t> rows;
        for (size_t r = 0; r < split.experts.size(); ++r)
            if (!split.pooled[r]) ++rows[split.experts[r]];
        std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return rows[x] > rows[y]; });
    } else {  // the hottest first
        std::stable_sort(order.begin(), order.end(),
                         [&](int32_t x, int32_t y) { return pool.heat(group, x) > pool.heat(group, y); });
    }
    std::unordered_map<const PoolArena*, uint32_t> next;
    std::unordered_set<int32_t> crossed;
    for (size_t i = 0; i < order.size() && crossed.size() < k; ++i) {
        const int32_t e = order[i];
        std::vector<ExpertPool::Placed> placed;
        std::vector<int32_t> slots(unit.mmids.size(), -1);
        // A large batch's crossing lands in the pool only where a slot is free (a pool filling
        // up, after a start or a model's load): the copy is made once, where a fill would have
        // made it again from the host (the GPU machine's first prompt of a run: 9 % of its rows
        // pooled, the hook's pool 68 %). A warm pool's slots stay the decode's.
        bool in_pool = pool.admit_here(group, static_cast<uint32_t>(e), &placed, /*evict=*/!large);
        for (size_t m = 0; m < unit.mmids.size() && in_pool; ++m) {
            const ExpertTensor* w = unit.weights[m];
            const auto p = std::find_if(placed.begin(), placed.end(), [&](const auto& x) { return x.tensor == w; });
            slots[m] = p != placed.end() ? static_cast<int32_t>(p->offset / p->arena->slot_bytes) : pool.slot_of(*w, e);
            in_pool = slots[m] >= 0;  // a slice the pool's own thread is still copying: not yet
        }
        if (!in_pool) {
            pool.settle(static_cast<uint32_t>(e), placed, false);
            placed.clear();
            auto taken = next;
            bool room = true;
            for (size_t m = 0; m < unit.mmids.size() && room; ++m) {
                const auto* a = pool.arena_for(*unit.weights[m]);
                room = a != nullptr && taken[a] < a->staging;
                if (room) slots[m] = static_cast<int32_t>(a->slots - a->staging + taken[a]++);
            }
            if (!room) continue;
            next = std::move(taken);
        }
        for (size_t m = 0; m < unit.mmids.size(); ++m) {
            const ExpertTensor& w = *unit.weights[m];
            const auto* a = pool.arena_for(w);
            ggml_backend_tensor_set_async(acc, a->whole, w.data + static_cast<size_t>(e) * w.slice_bytes,
                                          static_cast<size_t>(slots[m]) * a->slot_bytes, w.slice_bytes);
            staged[m][e] = slots[m];
            if (large) pool.count_staged(w.slice_bytes, in_pool);
        }
        crossed.insert(e);
        if (!large) pool.count_crossed(in_pool);
        if (in_pool) admitted.emplace_back(static_cast<uint32_t>(e), std::move(placed));
    }
    return crossed;
}

void note_chain(PoolStats::Phases& timing, bool all, uint64_t ns) {
    ++(all ? timing.all_units : timing.split_units);
    (all ? timing.all_chain_ns : timing.split_chain_ns) += ns;
}

// The unit's pooled rows on the pool's device (a copy of its chain over the pool's slots), the
// rest on the CPU (the chain itself, the MUL_MAT_IDs routed to the CPU's experts), at once.
std::optional<ggml_status> compute_unit(Backend& be, ggml_cgraph* graph) {
    const auto entered = Clock::now();
    auto& pool = ExpertPool::get();
    std::unique_lock lock(pool.mu);
    auto unit = find_unit(graph, pool);
    if (!unit) return std::nullopt;
    ggml_tensor* ids = unit->ids;
    if (pool.device(be.settings) == nullptr || ids->buffer == nullptr || !ggml_backend_buffer_is_host(ids->buffer)) {
        return std::nullopt;
    }
    const uint32_t group = unit->group;
    const size_t device = pool.device_index(group);  // the device whose pool serves this layer
    Backend::Acc* acc = acc_ready(be, device, pool.device_at(device));
    if (acc == nullptr) return std::nullopt;
    auto split = split_rows(static_cast<const char*>(ids->data), ids->nb[0], ids->nb[1], ids->ne[0], ids->ne[1],
                            unit->weights[0]->n_expert, 1, [&](int32_t e) { return pool.pooled(group, e) ? 0 : -1; });
    if (!split) {  // ids the router could not have made: said once, computed on the CPU as given
        if (!be.said_split_error) say("%s: %s (computed on the CPU)", unit->mmids[0]->name, split.error().what().c_str());
        be.said_split_error = true;
        return std::nullopt;
    }

    auto t0 = Clock::now();
    const auto t_chain = t0;  // the chain's time (the crossing's choice of arm), its reads ahead first
    // What of the misses a lazily loaded mapping does not hold is read now, in large requests, before
    // the CPU or a copy faults it in a page at a time; without the pool's lock (a layer's misses can
    // be hundreds of MB from storage), so the pool may change meanwhile: split again after.
    if (pool.read_ahead(group, split->cpu_experts, lock)) {
        split = split_rows(static_cast<const char*>(ids->data), ids->nb[0], ids->nb[1], ids->ne[0], ids->ne[1],
                           unit->weights[0]->n_expert, 1, [&](int32_t e) { return pool.pooled(group, e) ? 0 : -1; });
        if (!split) return std::nullopt;  // as above, for ids that did not change: cannot happen
    }
    const uint64_t read_ns = ns_since(t_chain);

    auto& timing = pool.timing().phases[ids->ne[1] >= kLargeBatch ? 1 : 0];
    ++timing.units;
    timing.prep_ns += ns_since(entered) - read_ns;
    timing.read_ahead_ns += read_ns;
    timing.hit_rows += split->pool_rows;
    const uint32_t hit_rows = split->pool_rows;
    const auto rows_at_end = [&] {
        timing.crossed_rows += split->pool_rows - hit_rows;
        timing.cpu_rows += split->cpu_rows;
        timing.cpu_experts += split->cpu_experts.size();
    };
    // Misses cross the link to the device while the CPU computes the rest (Crossing): for a small
    // batch (decode) the hottest, into the pool where the policy admits them (the admission's one
    // copy), else into staging slots; for a large batch (a prompt, which reads nearly every expert
    // of the layer, as llama.cpp offloads its CPU experts) those with the most rows, into staging
    // slots, and the CPU takes the few-row ones. Misses still count for the pool's admissions.
    std::vector<std::unordered_map<int32_t, int32_t>> staged(unit->mmids.size());
    const std::vector<int32_t> missed = split->cpu_experts;
    const bool large = ids->ne[1] >= kLargeBatch;
    uint64_t cross_ns = 0;  // the crossings' copies, as far as they held the CPU (pageable ones do)
    Admitted admitted;
    struct Unsettled {  // what a failed compute gives back
        ExpertPool& pool;
        Admitted& admitted;
        ~Unsettled() {
            for (const auto& [e, placed] : admitted) pool.settle(e, placed, false);
        }
    } unsettled{pool, admitted};
    if (split->cpu_rows > 0 && large && pool.registering()) pool.wait_registered(lock);
    if (split->cpu_rows > 0 && !pool.registering()) {
        // A small batch's misses do not cross from pageable memory: such a copy is this thread's
        // own memcpy into the driver's bounce buffer, done before the CPU's half starts, reading the
        // same bytes the CPU's threads would compute from, and more slowly (the whole stack on the
        // GPU machine, its experts too large to pin: 3 % of decode's rows crossed, and the device's
        // half took 1.2 ms a chain to issue, 0.05 of it the graph's own build, upload and launch).
        const size_t k = large           ? be.crossing_large.count(split->cpu_experts.size())
                         : pool.pageable() ? 0
                                           : be.crossing.count(split->cpu_experts.size());
        const auto t_cross = Clock::now();
        const auto crossed = cross_misses(acc->backend, pool, *unit, *split, large, k, staged, admitted);
        cross_ns = ns_since(t_cross);
        timing.cross_ns += cross_ns;
        if (!crossed.empty()) {
            split = split_rows(static_cast<const char*>(ids->data), ids->nb[0], ids->nb[1], ids->ne[0], ids->ne[1],
                               unit->weights[0]->n_expert, 1,
                               [&](int32_t e) { return crossed.count(e) != 0 || pool.pooled(group, e) ? 0 : -1; });
            if (!split) return std::nullopt;
        }
    }

    Crossing& crossing = large ? be.crossing_large : be.crossing;
    if (split->pool_rows == 0) {  // every row the CPU's: the chain as it is, on the CPU
        lock.unlock();
        Graph cg(be.ctx_mem_cpu, 0, static_cast<int>(unit->nodes.size()));
        for (auto* node : unit->nodes)
            if (!is_noop(node)) ggml_graph_add_node(cg.graph, node);
        const Faults before = process_faults(be.settings);
        const ggml_status st = ggml_backend_graph_compute(be.cpu, cg.graph);
        const Faults after = process_faults(be.settings);
        lock.lock();
        timing.cpu_minor_faults += after.minor - before.minor;
        timing.cpu_major_faults += after.major - before.major;
        if (st != GGML_STATUS_SUCCESS) return st;
        timing.cpu_ns += ns_since(t0);
        const uint64_t chain_ns = ns_since(t_chain);
        note_chain(timing, crossing.learn(ns_since(t0), 0, chain_ns), chain_ns);
        rows_at_end();
        pool.count_rows(0, split->cpu_rows);
        pool.used(group, {}, split->cpu_experts, static_cast<uint32_t>(ids->ne[1]));
        return GGML_STATUS_SUCCESS;
    }

    // The pool's copy of the chain: its MUL_MAT_IDs read the pool's slots, routed by slot; what
    // comes from outside the unit is uploaded.
    auto t1 = Clock::now();
    const size_t n_nodes = unit->nodes.size();
    Graph pg(be.ctx_mem, static_cast<int>(4 * n_nodes + 8), static_cast<int>(n_nodes));
    std::unordered_map<const ggml_tensor*, ggml_tensor*> copy;
    std::unordered_set<const ggml_tensor*> in_unit(unit->nodes.begin(), unit->nodes.end());
    std::vector<ggml_tensor*> placed, views;
    std::vector<std::pair<ggml_tensor*, const ggml_tensor*>> uploads;
    std::vector<std::vector<int32_t>> slot_ids(unit->mmids.size());
    bool ok = true;
    std::function<ggml_tensor*(ggml_tensor*)> clone = [&](ggml_tensor* t) -> ggml_tensor* {
        if (auto it = copy.find(t); it != copy.end()) return it->second;
        ggml_tensor* c = nullptr;
        if (in_unit.count(t) != 0 && t->view_src != nullptr && is_noop(t)) {
            ggml_tensor* src = clone(t->view_src);
            if (src == nullptr) return nullptr;
            c = ggml_view_4d(pg.ctx, src, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1], t->nb[2], t->nb[3], t->view_offs);
            views.push_back(c);
        } else if (in_unit.count(t) != 0) {
            c = ggml_new_tensor(pg.ctx, t->type, GGML_MAX_DIMS, t->ne);
            c->op = t->op;
            memcpy(c->op_params, t->op_params, sizeof c->op_params);
            c->flags = t->flags;
            const auto k = static_cast<size_t>(std::find(unit->mmids.begin(), unit->mmids.end(), t) - unit->mmids.begin());
            for (int i = 0; i < GGML_MAX_SRC && ok; ++i) {
                if (t->src[i] == nullptr) continue;
                if (k < unit->mmids.size() && i == 0) {
                    c->src[0] = pool.view(*unit->weights[k]);
                } else if (k < unit->mmids.size() && i == 2) {
                    c->src[2] = ggml_new_tensor_2d(pg.ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1]);
                    placed.push_back(c->src[2]);
                    const ExpertTensor& w = *unit->weights[k];
                    const auto slot_for = [&](int32_t e) {
                        const auto st = staged[k].find(e);
                        return st != staged[k].end() ? st->second : pool.slot_of(w, e);
                    };
                    const auto* a = pool.arena_for(w);
                    auto v = pool_slot_ids(*split, slot_for, a != nullptr ? a->slots : 0);
                    if (!v) {
                        if (!be.said_split_error) say("%s: %s (computed on the CPU)", t->name, v.error().what().c_str());
                        be.said_split_error = true;
                        ok = false;
                        continue;
                    }
                    slot_ids[k] = std::move(*v);
                    uploads.emplace_back(c->src[2], nullptr);
                } else {
                    c->src[i] = clone(t->src[i]);
                }
                if (c->src[i] == nullptr) ok = false;
            }
            placed.push_back(c);
        } else {
            if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer) || !ggml_is_contiguous(t)) return nullptr;
            c = ggml_new_tensor(pg.ctx, t->type, GGML_MAX_DIMS, t->ne);
            placed.push_back(c);
            uploads.emplace_back(c, t);
        }
        copy.emplace(t, c);
        return c;
    };
    std::vector<ggml_tensor*> outs;
    for (auto* node : unit->nodes) {
        if (is_noop(node)) continue;
        ggml_tensor* c = clone(node);
        if (c == nullptr || !ok) return std::nullopt;
        ggml_graph_add_node(pg.graph, c);
    }
    for (auto* o : unit->outputs) outs.push_back(copy.at(o));
    if (!place(*acc, placed)) return std::nullopt;
    for (auto* v : views)
        if (ggml_backend_view_init(v) != GGML_STATUS_SUCCESS) return std::nullopt;
    for (int i = 0; i < ggml_graph_n_nodes(pg.graph); ++i)
        if (!ggml_backend_supports_op(acc->backend, ggml_graph_node(pg.graph, i))) return std::nullopt;
    timing.build_ns += ns_since(t1);
    t1 = Clock::now();
    size_t k_ids = 0;
    for (const auto& [dst, src] : uploads) {
        if (src != nullptr) {
            ggml_backend_tensor_set_async(acc->backend, dst, src->data, 0, ggml_nbytes(dst));
        } else {
            while (slot_ids[k_ids].empty()) ++k_ids;
            ggml_backend_tensor_set_async(acc->backend, dst, slot_ids[k_ids].data(), 0, ggml_nbytes(dst));
            ++k_ids;
        }
    }
    timing.upload_ns += ns_since(t1);
    t1 = Clock::now();
    ggml_status st = ggml_backend_graph_compute_async(acc->backend, pg.graph);
    timing.launch_ns += ns_since(t1);
    timing.issue_ns += ns_since(t0);
    t0 = Clock::now();

    // The device's results: straight into the outputs where the CPU does not compute in them (every
    // row the device's, or the CPU's rows computed alone and written over the device's fillers after),
    // else beside them, to be joined.
    bool direct = split->cpu_rows == 0;
    char* out = nullptr;
    const auto download = [&] {
        size_t out_bytes = 0;
        for (auto* o : outs) out_bytes += ggml_nbytes(o);
        if (!direct) out = out_space(be, out_bytes);
        size_t at = 0;
        for (size_t i = 0; i < outs.size(); ++i) {
            ggml_backend_tensor_get_async(acc->backend, outs[i], direct ? unit->outputs[i]->data : out + at, 0,
                                          ggml_nbytes(outs[i]));
            at += ggml_nbytes(outs[i]);
        }
    };
    bool downloading = false;
    bool alone = false;
    // The device's results come back while the CPU computes, into pinned memory: a copy into
    // pageable memory would return only once the device's half is done, and the CPU's half would
    // start after it (its time then the device's, which Crossing would read as a slow CPU and
    // cross more misses). Where nothing can be pinned, they come back after the CPU's half.
    if (st == GGML_STATUS_SUCCESS && (direct || out_pinned(be, outs))) {
        download();
        downloading = true;
    }
    // The CPU's half meanwhile: its rows alone where the chain allows (no filler arithmetic),
    // else the chain itself, its MUL_MAT_IDs routed to the CPU's experts and fillers.
    const Faults faults_before = process_faults(be.settings);
    auto t_graph = Clock::now();
    if (st == GGML_STATUS_SUCCESS && split->cpu_rows > 0) {
        const auto done = cpu_rows_alone(be, *unit, *split, [&] {
            alone = true;
            t_graph = Clock::now();
        });
        ++(done ? pool.timing().cpu_alone : pool.timing().cpu_fillers);
        if (done) {
            st = *done;
        } else {
            std::vector<char> mem;
            Graph cg(mem, 1, static_cast<int>(n_nodes));
            ggml_tensor* cids = ggml_new_tensor_2d(cg.ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1]);
            cids->data = split->cpu_ids.data();
            for (auto* node : unit->nodes)
                if (!is_noop(node)) ggml_graph_add_node(cg.graph, node);
            for (auto* m : unit->mmids) m->src[2] = cids;
            t_graph = Clock::now();
            st = ggml_backend_graph_compute(be.cpu, cg.graph);
            for (auto* m : unit->mmids) m->src[2] = ids;
        }
    }
    const uint64_t cpu_ns = ns_since(t0);
    timing.cpu_ns += cpu_ns;
    if (split->cpu_rows > 0) timing.cpu_graph_ns += ns_since(t_graph);
    const Faults faults_after = process_faults(be.settings);
    timing.cpu_minor_faults += faults_after.minor - faults_before.minor;
    timing.cpu_major_faults += faults_after.major - faults_before.major;
    t0 = Clock::now();
    if (!downloading) download();
    ggml_backend_synchronize(acc->backend);
    const uint64_t waited = ns_since(t0);
    timing.wait_ns += waited;
    t0 = Clock::now();
    if (st != GGML_STATUS_SUCCESS) return st;
    for (const auto& [e, slices] : admitted) pool.settle(e, slices, true);
    admitted.clear();
    if (!missed.empty()) {
        const uint64_t chain_ns = ns_since(t_chain);
        note_chain(timing, crossing.learn(cpu_ns, waited + cross_ns, chain_ns), chain_ns);
    }
    if (!direct) {
        size_t at = 0;
        for (size_t i = 0; i < outs.size(); ++i) {
            ggml_tensor* o = unit->outputs[i];
            join_rows(*split, Rows{static_cast<char*>(o->data), o->nb[1], o->nb[2]},
                      ConstRows{out + at, outs[i]->nb[1], outs[i]->nb[2]}, static_cast<size_t>(o->ne[0]) * sizeof(float));
            at += ggml_nbytes(outs[i]);
        }
    }
    if (alone) scatter_cpu_rows(be, ids->ne[0]);
    rows_at_end();
    pool.count_rows(split->pool_rows, split->cpu_rows);
    pool.count_device_rows(device, split->pool_rows);
    std::vector<int32_t> hits;
    for (const int32_t e : split->pool_experts)
        if (std::find(missed.begin(), missed.end(), e) == missed.end()) hits.push_back(e);
    pool.used(group, hits, missed, static_cast<uint32_t>(ids->ne[1]));
    timing.book_ns += ns_since(t0);
    return GGML_STATUS_SUCCESS;
}

Backend* backend_of(ggml_backend_t b) { return static_cast<Backend*>(b->context); }

const char* backend_name(ggml_backend_t) { return kName; }
void backend_free(ggml_backend_t b) {
    auto* be = backend_of(b);
    for (auto& a : be->accs) {
        if (a.scratch != nullptr) ggml_backend_buffer_free(a.scratch);
        if (a.backend != nullptr) ggml_backend_free(a.backend);
    }
    if (be->out_pinned != nullptr) ggml_backend_buffer_free(be->out_pinned);
    if (be->cpu != nullptr) ggml_backend_free(be->cpu);
    if (be->pool_threads != nullptr) be->threadpool_free(be->pool_threads);
    delete be;
    delete b;
}
ggml_status compute_graph(Backend& be, ggml_cgraph* graph);
// The CPU halves' thread count, as the runtime last set it (for the stats).
std::atomic<int> cpu_threads_seen{0}, cpu_threads_asked{0};
void say_stats(const PoolStats& s);

ggml_status backend_graph_compute(ggml_backend_t b, ggml_cgraph* graph) {
    const auto t0 = Clock::now();
    auto& be = *backend_of(b);
    const ggml_status st = compute_graph(be, graph);
    auto& pool = ExpertPool::get();
    std::lock_guard lock(pool.mu);
    pool.timing().compute_ns += ns_since(t0);
    ++pool.timing().computes;
    static Clock::time_point said = Clock::now();
    if (be.settings.log_often && Clock::now() - said > std::chrono::seconds(10)) {
        said = Clock::now();
        say_stats(pool.stats());
    }
    return st;
}

ggml_status compute_graph(Backend& be, ggml_cgraph* graph) {
    auto& pool = ExpertPool::get();
    const auto count = [&](bool unit) {
        std::lock_guard lock(pool.mu);
        pool.count_split(unit);
    };
    if (const auto st = compute_unit(be, graph)) {
        count(true);
        return *st;
    }
    count(false);
    // Not a layer's chain: node by node, each MUL_MAT_ID over an expert tensor a chain of its own.
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; ++i) {
        ggml_tensor* node = ggml_graph_node(graph, i);
        if (is_noop(node) || (node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) continue;
        std::optional<ggml_status> st;
        if (node->op == GGML_OP_MUL_MAT_ID) {
            Graph one(be.ctx_mem_node, 0, 1);
            ggml_graph_add_node(one.graph, node);
            st = compute_unit(be, one.graph);
            if (!st) {
                std::lock_guard lock(pool.mu);
                if (pool.find(node->src[0]->data) != nullptr) {
                    pool.count_rows(0, static_cast<uint32_t>(node->src[2]->ne[0] * node->src[2]->ne[1]));
                }
            }
        }
        if (!st) st = compute_on_cpu(be, node);
        if (*st != GGML_STATUS_SUCCESS) return *st;
    }
    return GGML_STATUS_SUCCESS;
}

ggml_guid_t backend_guid() {
    static ggml_guid guid = {0x6d, 0x6f, 0x65, 0x63, 0x61, 0x63, 0x68, 0x65, 0x2d, 0x67, 0x67, 0x6d, 0x6c, 0x00, 0x00, 0x01};
    return &guid;
}

void set_n_threads(ggml_backend_t b, int requested) {
    if (b == nullptr || b->iface.get_name != backend_name) return;
    auto& be = *backend_of(b);
    if (requested != be.requested_threads) {  // the runtime sets it before every compute
        be.requested_threads = requested;
        be.usable_cpus = usable_cpus();
    }
    const int n = be.settings.threads > 0 ? be.settings.threads : cpu_half_threads(requested, be.usable_cpus);
    be.threads = n;
    cpu_threads_seen = n;
    cpu_threads_asked = requested;
    if (n > 1 && n != be.pool_threads_n && be.threadpool_new != nullptr && be.threadpool_free != nullptr &&
        be.set_threadpool != nullptr) {
        be.set_threadpool(be.cpu, nullptr);
        if (be.pool_threads != nullptr) be.threadpool_free(be.pool_threads);
        ggml_threadpool_params params = ggml_threadpool_params_default(n);
        be.pool_threads = be.threadpool_new(&params);
        be.pool_threads_n = be.pool_threads != nullptr ? n : 0;
        if (be.pool_threads != nullptr) be.set_threadpool(be.cpu, be.pool_threads);
    }
    if (be.cpu_threads != nullptr) {
        be.cpu_threads(be.cpu, n);
        for (auto& a : be.accs) {
            if (a.backend != nullptr && ggml_backend_dev_type(ggml_backend_get_device(a.backend)) == GGML_BACKEND_DEVICE_TYPE_CPU) {
                be.cpu_threads(a.backend, n);
            }
        }
    }
}

// ---- the device and its registry ----

struct Registry {
    Settings settings;
    ggml_backend_reg reg{};
    ggml_backend_device dev{};
    ggml_backend_buffer_type buft{};
};
Registry* registry = nullptr;
const Settings& registry_settings() { return registry->settings; }

ggml_backend_dev_t cpu_device() { return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU); }

const char* dev_name(ggml_backend_dev_t) { return kName; }
const char* dev_description(ggml_backend_dev_t) {
    return "moecache: experts its pool holds on a GPU, the rest on the CPU, at once";
}
void dev_memory(ggml_backend_dev_t, size_t* free_bytes, size_t* total) {
    *free_bytes = 0;
    *total = 0;
}
enum ggml_backend_dev_type dev_type(ggml_backend_dev_t) { return GGML_BACKEND_DEVICE_TYPE_ACCEL; }
void dev_props(ggml_backend_dev_t dev, ggml_backend_dev_props* props) {
    *props = ggml_backend_dev_props{};
    props->name = dev_name(dev);
    props->description = dev_description(dev);
    props->type = GGML_BACKEND_DEVICE_TYPE_ACCEL;
    props->caps.buffer_from_host_ptr = true;
#ifdef MOECACHE_GGML_HAS_MMAP_SUPPORT
    props->caps.mmap_support = true;
#endif
}
ggml_backend_t dev_init_backend(ggml_backend_dev_t dev, const char*) {
    auto* be = new Backend;
    be->settings = registry->settings;
    be->crossing = Crossing(be->settings.cross, 0.25, true);
    ggml_backend_dev_t cpu = cpu_device();
    be->cpu = cpu != nullptr ? ggml_backend_dev_init(cpu, nullptr) : nullptr;
    if (be->cpu == nullptr) {
        say("ggml has no CPU backend to compute with");
        delete be;
        return nullptr;
    }
    ggml_backend_reg_t cpu_reg = ggml_backend_dev_backend_reg(cpu);
    be->cpu_threads = reinterpret_cast<void (*)(ggml_backend_t, int)>(
        ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_set_n_threads"));
    be->threadpool_new = reinterpret_cast<ggml_threadpool_t (*)(ggml_threadpool_params*)>(
        ggml_backend_reg_get_proc_address(cpu_reg, "ggml_threadpool_new"));
    be->threadpool_free = reinterpret_cast<void (*)(ggml_threadpool_t)>(
        ggml_backend_reg_get_proc_address(cpu_reg, "ggml_threadpool_free"));
    be->set_threadpool = reinterpret_cast<void (*)(ggml_backend_t, ggml_threadpool_t)>(
        ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_cpu_set_threadpool"));
    ggml_backend_i iface{};
    iface.get_name = backend_name;
    iface.free = backend_free;
    iface.graph_compute = backend_graph_compute;
    return new ggml_backend{backend_guid(), iface, dev, be};
}
ggml_backend_buffer_type_t dev_buffer_type(ggml_backend_dev_t) { return &registry->buft; }
ggml_backend_buffer_t dev_buffer_from_host_ptr(ggml_backend_dev_t, void* ptr, size_t size, size_t) {
    auto* h = new HostBuffer;
    h->base = static_cast<char*>(ptr);
    h->size = size;
    return ggml_backend_buffer_init(&registry->buft, buffer_iface(), h, size);
}
// MUL_MAT_ID over the backend's own tensors; and the row-wise ops of an expert FFN, so that the
// scheduler gives the backend a layer's whole chain (up, gate, activation, down, weighting) as one
// split: the halves then join once a layer, not once a MUL_MAT_ID.
bool dev_supports_op(ggml_backend_dev_t, const ggml_tensor* op) {
    ggml_backend_dev_t cpu = cpu_device();
    if (cpu == nullptr) return false;
    if (op->op == GGML_OP_MUL_MAT_ID) {
        const ggml_tensor* w = op->src[0];
        if (w->buffer == nullptr || w->buffer->buft != &registry->buft) return false;
        return ggml_backend_dev_supports_op(cpu, op);
    }
    // Not an op over a weight (a norm's MUL): the loader would put the weight here, the scheduler
    // the op. Only an expert bias (ADD_ID's second source) is a weight of the chain.
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        const ggml_tensor* src = op->src[i];
        if (src != nullptr && src->op == GGML_OP_NONE && src->view_src == nullptr &&
            !(op->op == GGML_OP_ADD_ID && i == 1)) {
            return false;
        }
    }
    return row_wise(op) && ggml_backend_dev_supports_op(cpu, op);
}
bool dev_supports_buft(ggml_backend_dev_t, ggml_backend_buffer_type_t buft) {
    return buft == &registry->buft || ggml_backend_buft_is_host(buft);
}

const char* reg_name(ggml_backend_reg_t) { return kName; }
size_t reg_device_count(ggml_backend_reg_t) { return 1; }
ggml_backend_dev_t reg_device(ggml_backend_reg_t, size_t index) { return index == 0 ? &registry->dev : nullptr; }

// For tests and tools: the pool's figures, once the fills queued so far are done; the first `size`
// bytes of PoolStats (its leading fields keep their places: pool_rows ... forgotten).
void pool_stats(void* out, size_t size) {
    ExpertPool::get().drain();
    std::lock_guard lock(ExpertPool::get().mu);
    const PoolStats s = ExpertPool::get().stats();
    memcpy(out, &s, std::min(size, sizeof s));  // the caller's copy may know fewer fields
}

// For tests and tools: each device's pool (at most `max`); how many pools there are.
size_t device_stats(DeviceStats* out, size_t max) {
    ExpertPool::get().drain();
    std::lock_guard lock(ExpertPool::get().mu);
    return ExpertPool::get().device_stats(out, max);
}

// For tests: fills stay queued while held (what a runtime does meanwhile, e.g. free a model).
void hold_fills(bool hold) { ExpertPool::get().hold_fills(hold); }

void* reg_proc(ggml_backend_reg_t, const char* name) {
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) return reinterpret_cast<void*>(set_n_threads);
    if (strcmp(name, "moecache_ggml_pool_stats") == 0) return reinterpret_cast<void*>(pool_stats);
    if (strcmp(name, "moecache_ggml_hold_fills") == 0) return reinterpret_cast<void*>(hold_fills);
    if (strcmp(name, "moecache_ggml_device_stats") == 0) return reinterpret_cast<void*>(device_stats);
    return nullptr;
}

void say_stats(const PoolStats& s) {
    const double rows = static_cast<double>(s.pool_rows + s.cpu_rows);
    say("%llu expert rows computed: %.1f %% from the pool, %llu fills (%.2f GiB), %llu declined; %llu splits as a "
        "layer's chain, %llu node by node; %llu slices staged for large batches (%.2f GiB, %llu of them into the pool)",
        static_cast<unsigned long long>(s.pool_rows + s.cpu_rows),
        rows > 0 ? 100.0 * static_cast<double>(s.pool_rows) / rows : 0.0, static_cast<unsigned long long>(s.fills),
        static_cast<double>(s.fill_bytes) / (1 << 30), static_cast<unsigned long long>(s.declined),
        static_cast<unsigned long long>(s.units), static_cast<unsigned long long>(s.nodes),
        static_cast<unsigned long long>(s.staged), static_cast<double>(s.staged_bytes) / (1 << 30),
        static_cast<unsigned long long>(s.staged_admitted));
    say("%llu of small batches' misses crossed the link to the device, %llu of them into the pool; CPU halves: %llu "
        "as their rows alone, %llu with fillers",
        static_cast<unsigned long long>(s.crossed), static_cast<unsigned long long>(s.crossed_admitted),
        static_cast<unsigned long long>(s.cpu_alone), static_cast<unsigned long long>(s.cpu_fillers));
    const auto ms = [](uint64_t ns) { return static_cast<double>(ns) / 1e6; };
    say("%llu computes in %.0f ms; pinning took %.0f ms", static_cast<unsigned long long>(s.computes), ms(s.compute_ns),
        ms(s.register_ns));
    if (s.read_ahead > 0) {
        say("%llu slices of misses read ahead of their use (%.2f GiB read): the mapping reads at random (lazy load) "
            "and the page cache lacked pages of them",
            static_cast<unsigned long long>(s.read_ahead), static_cast<double>(s.read_ahead_bytes) / (1 << 30));
    }
    for (int large = 0; large < 2; ++large) {
        const auto& p = s.phases[large];
        if (p.units == 0) continue;
        say("  %llu chains of %s batches: found and split in %.0f ms, the device's half issued in %.0f ms (the "
            "misses read ahead in %.0f ms, crossed in %.0f ms; its graph built in %.0f ms, inputs uploaded in %.0f "
            "ms, launched in %.0f ms), the CPU's half %.0f ms (its graphs computing %.0f ms, on %d threads of the "
            "runtime's %d; %llu minor and %llu major page faults meanwhile), the wait for the device %.0f ms, joins "
            "and bookkeeping %.0f ms",
            static_cast<unsigned long long>(p.units), large ? "large" : "small", ms(p.prep_ns), ms(p.issue_ns),
            ms(p.read_ahead_ns), ms(p.cross_ns), ms(p.build_ns), ms(p.upload_ns), ms(p.launch_ns), ms(p.cpu_ns),
            ms(p.cpu_graph_ns), cpu_threads_seen.load(), cpu_threads_asked.load(),
            static_cast<unsigned long long>(p.cpu_minor_faults), static_cast<unsigned long long>(p.cpu_major_faults),
            ms(p.wait_ns), ms(p.book_ns));
        const double all = static_cast<double>(p.hit_rows + p.crossed_rows + p.cpu_rows);
        if (all > 0) {
            say("    their rows: %.1f %% pooled, %.1f %% crossed over, %.1f %% on the CPU (%.2f experts a chain there)",
                100.0 * static_cast<double>(p.hit_rows) / all, 100.0 * static_cast<double>(p.crossed_rows) / all,
                100.0 * static_cast<double>(p.cpu_rows) / all,
                static_cast<double>(p.cpu_experts) / static_cast<double>(p.units));
        }
        if (p.all_units > 0) {
            say("    chains with misses: %llu with every miss crossing, %.3f ms each; %llu split between the CPU and "
                "the link, %.3f ms each",
                static_cast<unsigned long long>(p.all_units), ms(p.all_chain_ns) / static_cast<double>(p.all_units),
                static_cast<unsigned long long>(p.split_units),
                p.split_units > 0 ? ms(p.split_chain_ns) / static_cast<double>(p.split_units) : 0.0);
        }
    }
}

ggml_backend_reg_t make_registry() {
    if (strcmp(ggml_version(), MOECACHE_GGML_VERSION) != 0) {
        say("built against ggml %s (llama.cpp %s) but this runtime's ggml is %s: not loaded. Build "
            "libmoecache-ggml.so against this runtime's own llama.cpp source (-DMOECACHE_GGML_SOURCE=)",
            MOECACHE_GGML_VERSION, MOECACHE_GGML_COMMIT, ggml_version());
        return nullptr;
    }
    registry = new Registry;
    std::string problem;
    registry->settings = settings_from_env(&problem);
    if (!problem.empty()) say("%s: the pool is off, every expert is computed on the CPU", problem.c_str());
    if (registry->settings.log) atexit([] { say_stats(ExpertPool::get().stats()); });

    ggml_backend_buffer_type_i bi{};
    bi.get_name = buft_name;
    bi.alloc_buffer = buft_alloc;
    bi.get_alignment = buft_alignment;
    bi.is_host = buft_is_host;
    registry->buft = ggml_backend_buffer_type{bi, &registry->dev, nullptr};

    ggml_backend_device_i di{};
    di.get_name = dev_name;
    di.get_description = dev_description;
    di.get_memory = dev_memory;
    di.get_type = dev_type;
    di.get_props = dev_props;
    di.init_backend = dev_init_backend;
    di.get_buffer_type = dev_buffer_type;
    di.buffer_from_host_ptr = dev_buffer_from_host_ptr;
    di.supports_op = dev_supports_op;
    di.supports_buft = dev_supports_buft;
    registry->dev = ggml_backend_device{di, &registry->reg, nullptr};

    ggml_backend_reg_i ri{};
    ri.get_name = reg_name;
    ri.get_device_count = reg_device_count;
    ri.get_device = reg_device;
    ri.get_proc_address = reg_proc;
    registry->reg = ggml_backend_reg{GGML_BACKEND_API_VERSION, ri, nullptr};
    return &registry->reg;
}

}  // namespace
}  // namespace moecache::backend

// What ggml's loader calls (ggml_backend_load): the registry, made once.
extern "C" __attribute__((visibility("default"))) ggml_backend_reg_t ggml_backend_init(void) {
    static std::once_flag once;
    static ggml_backend_reg_t reg = nullptr;
    std::call_once(once, [] { reg = moecache::backend::make_registry(); });
    return reg;
}
