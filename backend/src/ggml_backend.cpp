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
#include "moecache/backend/row_split.h"
#include "say.h"
#include "settings.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

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
};

HostBuffer* host(ggml_backend_buffer_t b) { return static_cast<HostBuffer*>(b->context); }

void buffer_free(ggml_backend_buffer_t b) {
    auto* h = host(b);
    if (h->owned) free(h->base);
    delete h;
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
    if (size > 0) {
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

struct Backend {
    Settings settings;
    ggml_backend_t cpu = nullptr;
    void (*cpu_threads)(ggml_backend_t, int) = nullptr;
    int threads = 0;
    ggml_backend_t acc = nullptr;  // the pool's device, made at the first pooled compute
    ggml_backend_buffer_t scratch = nullptr;  // on the pool's device: activations, ids, results
    std::vector<char> pool_out;
    std::vector<char> ctx_mem;
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

bool acc_ready(Backend& be, ggml_backend_dev_t dev) {
    if (be.acc != nullptr) return true;
    be.acc = ggml_backend_dev_init(dev, nullptr);
    if (be.acc == nullptr) return false;
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU && be.cpu_threads != nullptr && be.threads > 0) {
        be.cpu_threads(be.acc, be.threads);
    }
    return true;
}

// Places `tensors` one after another in the backend's scratch buffer on the pool's device.
bool place(Backend& be, std::initializer_list<ggml_tensor*> tensors) {
    auto* buft = ggml_backend_get_default_buffer_type(be.acc);
    const size_t align = ggml_backend_buft_get_alignment(buft);
    size_t need = 0;
    for (auto* t : tensors) need += (ggml_backend_buft_get_alloc_size(buft, t) + align - 1) / align * align;
    if (be.scratch == nullptr || ggml_backend_buffer_get_size(be.scratch) < need) {
        if (be.scratch != nullptr) ggml_backend_buffer_free(be.scratch);
        be.scratch = ggml_backend_buft_alloc_buffer(buft, need + need / 2);
        if (be.scratch == nullptr) return false;
    }
    auto* at = static_cast<char*>(ggml_backend_buffer_get_base(be.scratch));
    for (auto* t : tensors) {
        if (ggml_backend_tensor_alloc(be.scratch, t, at) != GGML_STATUS_SUCCESS) return false;
        at += (ggml_backend_buft_get_alloc_size(buft, t) + align - 1) / align * align;
    }
    return true;
}

// A MUL_MAT_ID over an expert tensor: the pooled rows on the pool's device, the rest on the CPU.
ggml_status compute_experts(Backend& be, ggml_tensor* node) {
    ggml_tensor* w = node->src[0];
    ggml_tensor* b = node->src[1];
    ggml_tensor* ids = node->src[2];
    auto& pool = ExpertPool::get();
    std::unique_lock lock(pool.mu);
    const ExpertTensor* t = pool.find(w->data);
    ggml_backend_dev_t dev = t != nullptr ? pool.device(be.settings) : nullptr;
    const PoolArena* arena = dev != nullptr ? pool.arena_for(t->slice_bytes) : nullptr;
    if (arena == nullptr || !ggml_is_contiguous(b) || ids->buffer == nullptr || !ggml_backend_buffer_is_host(ids->buffer) ||
        !acc_ready(be, dev)) {
        lock.unlock();
        return compute_on_cpu(be, node);
    }
    auto split = split_rows(static_cast<const char*>(ids->data), ids->nb[0], ids->nb[1], ids->ne[0], ids->ne[1],
                            w->ne[2], arena->slots, [&](int32_t e) { return pool.slot_of(*t, e); });
    if (!split) {
        if (!be.said_split_error) say("%s: %s (computed on the CPU)", node->name, split.error().what().c_str());
        be.said_split_error = true;
        lock.unlock();
        return compute_on_cpu(be, node);
    }
    if (split->pool_rows == 0) {
        const ggml_status st = compute_on_cpu(be, node);
        pool.count_rows(0, split->cpu_rows);
        pool.used(*t, {}, split->cpu_experts);
        return st;
    }

    // The pool's half, queued on its device.
    ggml_tensor* pw = pool.view(*t);
    Graph pg(be.ctx_mem, 4, 1);
    ggml_tensor* pb = ggml_new_tensor(pg.ctx, b->type, GGML_MAX_DIMS, b->ne);
    ggml_tensor* pids = ggml_new_tensor_2d(pg.ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1]);
    ggml_tensor* pout = pw != nullptr ? ggml_mul_mat_id(pg.ctx, pw, pb, pids) : nullptr;
    if (pw == nullptr || !place(be, {pb, pids, pout}) ||
        !ggml_backend_supports_op(be.acc, pout)) {
        lock.unlock();
        return compute_on_cpu(be, node);
    }
    pout->flags |= GGML_TENSOR_FLAG_COMPUTE;  // ggml computes only the nodes marked so
    ggml_graph_add_node(pg.graph, pout);
    ggml_backend_tensor_set_async(be.acc, pb, b->data, 0, ggml_nbytes(pb));
    ggml_backend_tensor_set_async(be.acc, pids, split->pool_ids.data(), 0, ggml_nbytes(pids));
    ggml_status st = ggml_backend_graph_compute_async(be.acc, pg.graph);

    // The CPU's half meanwhile, straight into the node's output.
    if (st == GGML_STATUS_SUCCESS && split->cpu_rows > 0) {
        std::vector<char> mem;
        Graph cg(mem, 4, 1);
        ggml_tensor* cids = ggml_new_tensor_2d(cg.ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1]);
        cids->data = split->cpu_ids.data();
        ggml_tensor* cout = ggml_mul_mat_id(cg.ctx, w, b, cids);
        cout->data = node->data;
        cout->buffer = node->buffer;
        cout->flags |= GGML_TENSOR_FLAG_COMPUTE;
        ggml_graph_add_node(cg.graph, cout);
        st = ggml_backend_graph_compute(be.cpu, cg.graph);
    }
    be.pool_out.resize(ggml_nbytes(pout));
    ggml_backend_tensor_get_async(be.acc, pout, be.pool_out.data(), 0, ggml_nbytes(pout));
    ggml_backend_synchronize(be.acc);
    if (st != GGML_STATUS_SUCCESS) return st;
    join_rows(*split, Rows{static_cast<char*>(node->data), node->nb[1], node->nb[2]},
              ConstRows{be.pool_out.data(), pout->nb[1], pout->nb[2]}, static_cast<size_t>(node->ne[0]) * sizeof(float));
    pool.count_rows(split->pool_rows, split->cpu_rows);
    pool.used(*t, split->pool_experts, split->cpu_experts);
    return GGML_STATUS_SUCCESS;
}

Backend* backend_of(ggml_backend_t b) { return static_cast<Backend*>(b->context); }

const char* backend_name(ggml_backend_t) { return kName; }
void backend_free(ggml_backend_t b) {
    auto* be = backend_of(b);
    if (be->scratch != nullptr) ggml_backend_buffer_free(be->scratch);
    if (be->acc != nullptr) ggml_backend_free(be->acc);
    if (be->cpu != nullptr) ggml_backend_free(be->cpu);
    delete be;
    delete b;
}
ggml_status backend_graph_compute(ggml_backend_t b, ggml_cgraph* graph) {
    auto& be = *backend_of(b);
    const int n = ggml_graph_n_nodes(graph);
    for (int i = 0; i < n; ++i) {
        ggml_tensor* node = ggml_graph_node(graph, i);
        if (is_noop(node) || (node->flags & GGML_TENSOR_FLAG_COMPUTE) == 0) continue;
        const ggml_status st = node->op == GGML_OP_MUL_MAT_ID ? compute_experts(be, node) : compute_on_cpu(be, node);
        if (st != GGML_STATUS_SUCCESS) return st;
    }
    return GGML_STATUS_SUCCESS;
}

ggml_guid_t backend_guid() {
    static ggml_guid guid = {0x6d, 0x6f, 0x65, 0x63, 0x61, 0x63, 0x68, 0x65, 0x2d, 0x67, 0x67, 0x6d, 0x6c, 0x00, 0x00, 0x01};
    return &guid;
}

void set_n_threads(ggml_backend_t b, int n) {
    if (b == nullptr || b->iface.get_name != backend_name) return;
    auto& be = *backend_of(b);
    be.threads = n;
    if (be.cpu_threads != nullptr) {
        be.cpu_threads(be.cpu, n);
        if (be.acc != nullptr && ggml_backend_dev_type(ggml_backend_get_device(be.acc)) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            be.cpu_threads(be.acc, n);
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
    ggml_backend_dev_t cpu = cpu_device();
    be->cpu = cpu != nullptr ? ggml_backend_dev_init(cpu, nullptr) : nullptr;
    if (be->cpu == nullptr) {
        say("ggml has no CPU backend to compute with");
        delete be;
        return nullptr;
    }
    be->cpu_threads = reinterpret_cast<void (*)(ggml_backend_t, int)>(
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu), "ggml_backend_set_n_threads"));
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
bool dev_supports_op(ggml_backend_dev_t, const ggml_tensor* op) {
    if (op->op != GGML_OP_MUL_MAT_ID) return false;
    const ggml_tensor* w = op->src[0];
    if (w->buffer == nullptr || w->buffer->buft != &registry->buft) return false;
    ggml_backend_dev_t cpu = cpu_device();
    return cpu != nullptr && ggml_backend_dev_supports_op(cpu, op);
}
bool dev_supports_buft(ggml_backend_dev_t, ggml_backend_buffer_type_t buft) {
    return buft == &registry->buft || ggml_backend_buft_is_host(buft);
}

const char* reg_name(ggml_backend_reg_t) { return kName; }
size_t reg_device_count(ggml_backend_reg_t) { return 1; }
ggml_backend_dev_t reg_device(ggml_backend_reg_t, size_t index) { return index == 0 ? &registry->dev : nullptr; }

// For tests and tools: the pool's figures, once the fills queued so far are done.
void pool_stats(PoolStats* out) {
    ExpertPool::get().drain();
    std::lock_guard lock(ExpertPool::get().mu);
    *out = ExpertPool::get().stats();
}

void* reg_proc(ggml_backend_reg_t, const char* name) {
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) return reinterpret_cast<void*>(set_n_threads);
    if (strcmp(name, "moecache_ggml_pool_stats") == 0) return reinterpret_cast<void*>(pool_stats);
    return nullptr;
}

void say_stats() {
    const auto s = ExpertPool::get().stats();
    const double rows = static_cast<double>(s.pool_rows + s.cpu_rows);
    say("%llu expert rows computed: %.1f %% from the pool, %llu fills (%.2f GiB), %llu declined",
        static_cast<unsigned long long>(s.pool_rows + s.cpu_rows), rows > 0 ? 100.0 * static_cast<double>(s.pool_rows) / rows : 0.0,
        static_cast<unsigned long long>(s.fills), static_cast<double>(s.fill_bytes) / (1 << 30),
        static_cast<unsigned long long>(s.declined));
}

ggml_backend_reg_t make_registry() {
    if (strcmp(ggml_version(), MOECACHE_GGML_VERSION) != 0) {
        say("built against ggml %s (llama.cpp %s) but this runtime's ggml is %s: not loaded. Build "
            "libmoecache-ggml.so against this runtime's own llama.cpp source (-DMOECACHE_GGML_SOURCE=)",
            MOECACHE_GGML_VERSION, MOECACHE_GGML_COMMIT, ggml_version());
        return nullptr;
    }
    registry = new Registry;
    if (auto s = settings_from_env()) {
        registry->settings = *s;
    } else {
        say("%s: the pool is off, every expert is computed on the CPU", s.error().what().c_str());
        registry->settings.device = "none";
    }
    if (registry->settings.log) atexit(say_stats);

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
