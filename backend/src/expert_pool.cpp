#include "expert_pool.h"

#include "say.h"

#include <algorithm>
#include <cstring>
#include <map>

namespace moecache::backend {
namespace {

constexpr cuda::StreamId kStream = 1;  // every pool copy and compute completes before its call returns
// Bytes after each arena's last slot, zeroed: a device's kernels may read a quantized tensor's last
// row past its end, up to a padded width (ggml-cuda's MATRIX_ROW_PADDING: 512 weights).
constexpr uint64_t kTailBytes = 64 * 1024;
constexpr size_t kMaxViews = 64;
// Fills queued at most: a prompt misses nearly every expert, and what it would queue is stale by
// the time it is copied; a full queue declines.
constexpr size_t kMaxQueued = 32;

}  // namespace

ExpertPool& ExpertPool::get() {
    static ExpertPool* pool = new ExpertPool;  // lives until exit: a runtime's backends outlive statics
    return *pool;
}

void ExpertPool::add_tensor(const ggml_tensor* t) {
    if (t->op != GGML_OP_NONE || t->ne[2] < 2 || t->ne[3] != 1 || t->data == nullptr) return;
    if (strstr(t->name, "exps") == nullptr) return;  // llama.cpp's expert tensors: blk.N.ffn_*_exps
    std::lock_guard lock(mu);
    if (tensors_.count(t->data) != 0) return;
    if (dev_ != nullptr) return;  // the arenas are made: a later model computes on the CPU (for now)
    ExpertTensor e;
    e.data = static_cast<const char*>(t->data);
    e.type = t->type;
    e.ne0 = t->ne[0];
    e.ne1 = t->ne[1];
    e.n_expert = t->ne[2];
    e.slice_bytes = t->nb[2];
    e.id = static_cast<uint32_t>(tensors_.size());
    e.name = t->name;
    if (e.slice_bytes != static_cast<size_t>(e.ne1) * t->nb[1]) return;  // not one slice after another
    const auto n = static_cast<uint32_t>(e.n_expert);
    slots_.add_model(e.id, n, n);
    heat_.add_model(e.id, n);
    tensors_.emplace(t->data, std::move(e));
}

const ExpertTensor* ExpertPool::find(const void* data) const {
    const auto it = tensors_.find(data);
    return it == tensors_.end() ? nullptr : &it->second;
}

ggml_backend_dev_t ExpertPool::device(const Settings& settings) {
    if (tried_) return dev_;
    tried_ = true;
    log_ = settings.log;
    if (settings.device == "none") return nullptr;
    ggml_backend_dev_t dev = nullptr;
    if (settings.device == "auto") {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        if (dev == nullptr) {
            say("no GPU among ggml's devices: every expert is computed on the CPU");
            return nullptr;
        }
    } else {
        dev = ggml_backend_dev_by_name(settings.device.c_str());
        if (dev == nullptr) {
            say("MOECACHE_GGML_DEVICE=%s: ggml has no such device: every expert is computed on the CPU",
                settings.device.c_str());
            return nullptr;
        }
    }
    if (!make_arenas(dev, settings)) return nullptr;
    dev_ = dev;
    filler_ = std::thread([this] { fill_loop(); });
    atexit(stop_filler);  // before the device's runtime is torn down (atexit runs in reverse)
    return dev_;
}

bool ExpertPool::make_arenas(ggml_backend_dev_t dev, const Settings& settings) {
    // Slices by size: an arena per size, its share of the pool that size's share of the experts.
    std::map<uint64_t, uint64_t> bytes_by_size;
    uint64_t expert_bytes = 0;
    for (const auto& [data, t] : tensors_) {
        bytes_by_size[t.slice_bytes] += t.slice_bytes * static_cast<uint64_t>(t.n_expert);
        expert_bytes += t.slice_bytes * static_cast<uint64_t>(t.n_expert);
    }
    if (expert_bytes == 0) {
        say("no expert tensors in the backend's buffers (-ot exps=MOECACHE?): nothing to pool");
        return false;
    }
    size_t free_bytes = 0, total = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total);
    const uint64_t want = pool_bytes(settings, free_bytes, expert_bytes);
    auto* buft = ggml_backend_dev_buffer_type(dev);
    const size_t max_size = ggml_backend_buft_get_max_size(buft);
    ggml_init_params params{ggml_tensor_overhead() * (bytes_by_size.size() * (kMaxViews + 1) + 1), nullptr, true};
    ctx_ = ggml_init(params);
    uint64_t made = 0;
    for (const auto& [slot_bytes, bytes] : bytes_by_size) {
        const auto share = static_cast<uint64_t>(static_cast<double>(want) * static_cast<double>(bytes) /
                                                 static_cast<double>(expert_bytes));
        uint64_t count = std::min<uint64_t>(share / slot_bytes, max_size / slot_bytes);
        if (count == 0) continue;
        ggml_backend_buffer_t buf = nullptr;
        for (; count > 0 && buf == nullptr; count = count * 3 / 4) {
            buf = ggml_backend_buft_alloc_buffer(buft, count * slot_bytes + kTailBytes);
            if (buf != nullptr) break;
        }
        if (buf == nullptr) continue;
        ggml_backend_buffer_clear(buf, 0);
        PoolArena a;
        a.buffer = buf;
        a.base = static_cast<char*>(ggml_backend_buffer_get_base(buf));
        a.slot_bytes = slot_bytes;
        a.slots = static_cast<uint32_t>(count);
        a.whole = ggml_new_tensor_1d(ctx_, GGML_TYPE_I8, static_cast<int64_t>(count * slot_bytes));
        if (ggml_backend_tensor_alloc(buf, a.whole, a.base) != GGML_STATUS_SUCCESS) {
            ggml_backend_buffer_free(buf);
            continue;
        }
        slots_.add_arena(slot_bytes, reinterpret_cast<uint64_t>(a.base), a.slots);
        made += count * slot_bytes;
        arenas_.push_back(a);
    }
    if (arenas_.empty()) {
        say("no room for a pool on %s (%.1f GiB free): every expert is computed on the CPU",
            ggml_backend_dev_name(dev), static_cast<double>(free_bytes) / (1 << 30));
        return false;
    }
    say("a pool of %.2f GiB on %s for %.2f GiB of experts (%zu tensors): pooled experts are computed there, "
        "the rest on the CPU",
        static_cast<double>(made) / (1 << 30), ggml_backend_dev_name(dev),
        static_cast<double>(expert_bytes) / (1 << 30), tensors_.size());
    return true;
}

const PoolArena* ExpertPool::arena_for(uint64_t slice_bytes) const {
    for (const auto& a : arenas_)
        if (a.slot_bytes == slice_bytes) return &a;
    return nullptr;
}

ggml_tensor* ExpertPool::view(const ExpertTensor& t) {
    auto* a = const_cast<PoolArena*>(arena_for(t.slice_bytes));
    if (a == nullptr) return nullptr;
    for (const auto& v : a->views)
        if (v.type == t.type && v.ne0 == t.ne0 && v.ne1 == t.ne1) return v.tensor;
    if (a->views.size() >= kMaxViews) return nullptr;
    ggml_tensor* w = ggml_new_tensor_3d(ctx_, t.type, t.ne0, t.ne1, a->slots);
    if (ggml_nbytes(w) != a->slots * a->slot_bytes ||
        ggml_backend_tensor_alloc(a->buffer, w, a->base) != GGML_STATUS_SUCCESS) {
        w = nullptr;
    }
    a->views.push_back(PoolArena::View{t.type, t.ne0, t.ne1, w});
    return w;
}

int32_t ExpertPool::slot_of(const ExpertTensor& t, int32_t expert) {
    const auto* a = arena_for(t.slice_bytes);
    if (a == nullptr) return -1;
    const auto e = static_cast<uint32_t>(expert);
    const uint64_t addr = slots_.lookup(cuda::SliceRef{t.id, e, e}, kStream);
    if (addr == 0) return -1;
    return static_cast<int32_t>((addr - reinterpret_cast<uint64_t>(a->base)) / a->slot_bytes);
}

void ExpertPool::used(const ExpertTensor& t, const std::vector<int32_t>& pooled, const std::vector<int32_t>& missed) {
    for (const int32_t e : pooled) heat_.touch(t.id, static_cast<uint32_t>(e));
    const auto* a = arena_for(t.slice_bytes);
    for (const int32_t e32 : missed) {
        const auto e = static_cast<uint32_t>(e32);
        heat_.touch(t.id, e);
        if (a == nullptr) continue;
        if (fills_.size() >= kMaxQueued) {
            ++stats_.declined;
            continue;
        }
        const uint64_t addr = slots_.admit(cuda::SliceRef{t.id, e, e}, t.slice_bytes, kStream, heat_);
        if (addr == 0) {
            ++stats_.declined;
            continue;
        }
        fills_.push_back(Fill{&t, e, a, static_cast<size_t>(addr - reinterpret_cast<uint64_t>(a->base))});
        fill_cv_.notify_one();
    }
}

void ExpertPool::fill_loop() {
    std::unique_lock lock(mu);
    for (;;) {
        fill_cv_.wait(lock, [&] { return stop_ || !fills_.empty(); });
        if (stop_) return;
        const Fill f = fills_.front();
        fills_.pop_front();
        ++filling_;
        lock.unlock();
        // The slot is nobody's until committed: no compute reads it meanwhile.
        const ExpertTensor& t = *f.tensor;
        ggml_backend_tensor_set(f.arena->whole, t.data + static_cast<size_t>(f.expert) * t.slice_bytes, f.offset,
                                t.slice_bytes);
        lock.lock();
        --filling_;
        if (slots_.commit(cuda::SliceRef{t.id, f.expert, f.expert}) != 0) {
            ++stats_.fills;
            stats_.fill_bytes += t.slice_bytes;
        }
        if (fills_.empty() && filling_ == 0) drained_cv_.notify_all();
    }
}

void ExpertPool::drain() {
    std::unique_lock lock(mu);
    drained_cv_.wait(lock, [&] { return stop_ || !filler_.joinable() || (fills_.empty() && filling_ == 0); });
}

void ExpertPool::stop_filler() {
    auto& p = get();
    {
        std::lock_guard lock(p.mu);
        p.stop_ = true;
    }
    p.fill_cv_.notify_all();
    p.drained_cv_.notify_all();
    if (p.filler_.joinable()) p.filler_.join();
}

}  // namespace moecache::backend
