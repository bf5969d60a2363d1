#include "expert_pool.h"

#include "moecache/backend/read_ahead.h"
#include "moecache/cuda/hot_profile.h"
#include "moecache/memory_cgroup.h"
#include "moecache/process_maps.h"
#include "moecache/routing_shift.h"

#include "say.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
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

std::vector<ggml_backend_dev_t> pool_devices(const Settings& settings, bool tell) {
    std::vector<ggml_backend_dev_t> devs;
    if (settings.device == "none") return devs;
    if (settings.device == "auto") {
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU) devs.push_back(dev);
        }
        if (devs.empty() && tell) say("no GPU among ggml's devices: every expert is computed on the CPU");
        return devs;
    }
    // Names, comma-separated (CUDA0,CUDA1); a name twice is another pool on that device (a CPU
    // standing in for two GPUs, tests).
    size_t at = 0;
    while (at <= settings.device.size()) {
        const size_t comma = std::min(settings.device.find(',', at), settings.device.size());
        const std::string name = settings.device.substr(at, comma - at);
        at = comma + 1;
        if (name.empty()) continue;
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
        if (dev != nullptr) {
            devs.push_back(dev);
        } else if (tell) {
            say("MOECACHE_GGML_DEVICE=%s: ggml has no device %s: no pool there", settings.device.c_str(), name.c_str());
        }
    }
    if (devs.empty() && tell) say("MOECACHE_GGML_DEVICE=%s: no pool: every expert is computed on the CPU", settings.device.c_str());
    return devs;
}

ExpertPool& ExpertPool::get() {
    static ExpertPool* pool = new ExpertPool;  // lives until exit: a runtime's backends outlive statics
    return *pool;
}

void ExpertPool::add_tensor(const ggml_tensor* t) {
    if (t->op != GGML_OP_NONE || t->ne[2] < 2 || t->ne[3] != 1 || t->data == nullptr) return;
    if (strstr(t->name, "exps") == nullptr) return;  // llama.cpp's expert tensors: blk.N.ffn_*_exps
    if (t->nb[2] != static_cast<size_t>(t->ne[1]) * t->nb[1]) return;  // not one slice after another
    std::lock_guard lock(mu);
    if (tensors_.count(t->data) != 0) return;
    if (!devs_.empty()) return;  // the arenas are made: a later model computes on the CPU (for now)
    // Its group: the tensors of its layer ("blk.N."), of as many experts; else a group of its own.
    std::string key = t->name;
    if (key.rfind("blk.", 0) == 0 && key.find('.', 4) != std::string::npos) {
        key = key.substr(0, key.find('.', 4) + 1) + "/" + std::to_string(t->ne[2]);
    } else {
        key = std::string(t->name) + "#" + std::to_string(tensors_.size());
    }
    auto [it, added] = group_of_.emplace(key, static_cast<uint32_t>(groups_.size()));
    if (added) groups_.emplace_back();
    ExpertTensor e;
    e.data = static_cast<const char*>(t->data);
    e.type = t->type;
    e.ne0 = t->ne[0];
    e.ne1 = t->ne[1];
    e.n_expert = t->ne[2];
    e.slice_bytes = t->nb[2];
    e.group = it->second;
    e.index = static_cast<uint32_t>(groups_[e.group].size());
    if (strncmp(t->name, "blk.", 4) == 0) e.block = static_cast<uint32_t>(strtoul(t->name + 4, nullptr, 10));
    e.name = t->name;
    // Whether its mapping reads at random: smaps once per mapping (a model's tensors share one).
    const auto at = reinterpret_cast<uintptr_t>(t->data);
    if (!reads_ || at < reads_->start || at >= reads_->end) {
        reads_ = own_mapping_reads(t->data);
        reads_file_.reset();
        if (reads_ && reads_->random) reads_file_ = mapped_file(*reads_);
    }
    e.random_reads = reads_ && reads_->random;
    if (e.random_reads && reads_file_) {
        e.file = reads_file_;
        e.file_offset = reads_->offset + (at - reads_->start);
    }
    heat_.add_model(e.group, static_cast<uint32_t>(e.n_expert));
    const auto* stored = &tensors_.emplace(t->data, std::move(e)).first->second;
    groups_[stored->group].push_back(stored);
}

// The file a random-read mapping maps: the descriptor the pool has for it already (a model split
// in files maps each, and its tensors alternate between mappings), else newly opened.
std::shared_ptr<const UniqueFd> ExpertPool::mapped_file(const MappingReads& reads) {
    UniqueFd fd = open_mapped_file(reads);
    if (!fd) return nullptr;
    struct stat st {};
    if (fstat(fd.get(), &st) != 0) return nullptr;
    for (const auto& f : files_) {
        struct stat other {};
        if (fstat(f->get(), &other) == 0 && other.st_dev == st.st_dev && other.st_ino == st.st_ino) return f;
    }
    files_.push_back(std::make_shared<const UniqueFd>(std::move(fd)));
    return files_.back();
}

bool ExpertPool::read_ahead(uint32_t group, const std::vector<int32_t>& experts, std::unique_lock<std::mutex>& lock) {
    if (group >= groups_.size()) return false;
    std::vector<ReadRange> ranges;
    std::vector<std::shared_ptr<const UniqueFd>> kept;  // open while the lock is released
    for (const ExpertTensor* t : groups_[group]) {
        if (!t->random_reads) continue;
        if (t->file && std::find(kept.begin(), kept.end(), t->file) == kept.end()) kept.push_back(t->file);
        for (const int32_t e : experts) {
            if (e < 0 || e >= t->n_expert) continue;
            const size_t at = static_cast<size_t>(e) * t->slice_bytes;
            ranges.push_back(ReadRange{t->data + at, t->slice_bytes, t->fd(), t->file_offset + at});
        }
    }
    if (ranges.empty()) return false;
    lock.unlock();
    const auto read = read_ahead_all(ranges);
    lock.lock();
    for (const uint64_t bytes : read) {
        if (bytes == 0) continue;
        ++stats_.read_ahead;
        stats_.read_ahead_bytes += bytes;
    }
    return true;
}

void ExpertPool::forget(const char* base, size_t size) {
    std::unique_lock lock(mu);
    const auto inside = [&](const ExpertTensor* t) { return t->data >= base && t->data < base + size; };
    std::vector<uint32_t> gone;
    for (uint32_t g = 0; g < groups_.size(); ++g)
        if (std::any_of(groups_[g].begin(), groups_[g].end(), inside)) gone.push_back(g);
    if (gone.empty()) return;
    for (const uint32_t g : gone) {  // a freed model's heat is saved while its groups still say whose it is
        if (g < profile_of_.size() && profile_of_[g] >= 0) save_profile(profiles_[static_cast<size_t>(profile_of_[g])], true);
    }
    const auto in_gone = [&](const ExpertTensor* t) { return std::find(gone.begin(), gone.end(), t->group) != gone.end(); };
    const size_t queued = fills_.size();
    fills_.erase(std::remove_if(fills_.begin(), fills_.end(), [&](const Fill& f) { return in_gone(f.tensor); }),
                 fills_.end());
    stats_.forgotten += queued - fills_.size();
    drained_cv_.wait(lock, [&] { return !copying_ || !in_gone(copying_->tensor); });
    for (const uint32_t g : gone) {
        for (const auto* t : groups_[g]) {
            for (uint32_t e = 0; e < static_cast<uint32_t>(t->n_expert) && !devs_.empty(); ++e) {
                slots(g).drop(g, t->index * static_cast<uint32_t>(t->n_expert) + e);
            }
        }
        for (const auto* t : groups_[g]) tensors_.erase(t->data);
        groups_[g].clear();
    }
    // The files no tensor reads ahead from any more are closed (a server that loads model after
    // model; a read under way keeps its own reference), and the next tensor looks its mapping up
    // anew: another model may be mapped where this one was.
    std::erase_if(files_, [&](const auto& f) {
        return std::none_of(tensors_.begin(), tensors_.end(), [&](const auto& kv) { return kv.second.file == f; });
    });
    reads_.reset();
    reads_file_.reset();
    if (fills_.empty() && !copying_) drained_cv_.notify_all();
}

const ExpertTensor* ExpertPool::find(const void* data) const {
    const auto it = tensors_.find(data);
    return it == tensors_.end() ? nullptr : &it->second;
}

ggml_backend_dev_t ExpertPool::device(const Settings& settings) {
    if (tried_) return devs_.empty() ? nullptr : devs_.front().dev;
    tried_ = true;
    log_ = settings.log;
    link_ = std::make_unique<DaemonLink>(settings.client);
    group_model_.assign(groups_.size(), UINT32_MAX - 1);  // UINT32_MAX - 1: not asked yet
    const auto devs = pool_devices(settings, true);
    if (devs.empty()) return nullptr;
    bool any = false;
    for (size_t i = 0; i < devs.size(); ++i) {
        devs_.emplace_back();
        devs_.back().dev = devs[i];
    }
    deal_groups(devs);
    for (size_t i = 0; i < devs_.size(); ++i) any = make_arenas(devs_[i], i, settings) || any;
    if (!any) {
        devs_.clear();
        device_of_.clear();
        return nullptr;
    }
    if (!settings.profile_dir.empty()) read_profiles(settings.profile_dir);
    const bool pin = settings.pin;
    registering_ = pin;
    cuda_ = strncmp(ggml_backend_dev_name(devs_.front().dev), "CUDA", 4) == 0;
    filler_ = std::thread([this, pin] {
        if (pin) register_for_dma();
        {
            std::lock_guard lock(mu);
            registering_ = false;
        }
        drained_cv_.notify_all();
        fill_loop();
    });
    atexit(stop_filler);  // before the device's runtime is torn down (atexit runs in reverse)
    return devs_.front().dev;
}

// The layers dealt among the devices: each to the device whose pool would then serve the fewest
// expert bytes for its room (free memory), so that two GPUs alike take turns and a larger one
// takes more. A layer's experts all live on one device: its chain is computed there, one upload
// and one download, and no expert is held twice.
void ExpertPool::deal_groups(const std::vector<ggml_backend_dev_t>& devs) {
    std::vector<double> room(devs.size()), dealt(devs.size(), 0.0);
    for (size_t i = 0; i < devs.size(); ++i) {
        size_t free_bytes = 0, total = 0;
        ggml_backend_dev_memory(devs[i], &free_bytes, &total);
        room[i] = std::max(1.0, static_cast<double>(free_bytes));
    }
    // A device named twice (a stand-in) shares its room.
    for (size_t i = 0; i < devs.size(); ++i) {
        const auto same = static_cast<double>(std::count(devs.begin(), devs.end(), devs[i]));
        room[i] /= same;
    }
    device_of_.assign(groups_.size(), 0);
    for (uint32_t g = 0; g < groups_.size(); ++g) {
        uint64_t bytes = 0;
        for (const auto* t : groups_[g]) bytes += t->slice_bytes * static_cast<uint64_t>(t->n_expert);
        size_t best = 0;
        for (size_t i = 1; i < devs.size(); ++i) {
            if ((dealt[i] + static_cast<double>(bytes)) / room[i] < (dealt[best] + static_cast<double>(bytes)) / room[best]) {
                best = i;
            }
        }
        dealt[best] += static_cast<double>(bytes);
        device_of_[g] = static_cast<uint32_t>(best);
        for (const auto* t : groups_[g]) {
            const auto n = static_cast<uint32_t>(t->n_expert);
            devs_[best].slots.add_model(g, (t->index + 1) * n, n);
        }
    }
}

size_t ExpertPool::device_stats(DeviceStats* out, size_t max) {
    for (size_t i = 0; i < devs_.size() && i < max; ++i) {
        DeviceStats d;
        d.rows = devs_[i].rows;
        for (uint32_t g = 0; g < groups_.size(); ++g) {
            if (!live(g) || device_of_[g] != i) continue;
            ++d.groups;
            for (int32_t e = 0; e < groups_[g].front()->n_expert; ++e) d.pooled_experts += pooled(g, e) ? 1 : 0;
        }
        out[i] = d;
    }
    return devs_.size();
}

bool ExpertPool::make_arenas(Device& d, size_t index, const Settings& settings) {
    ggml_backend_dev_t dev = d.dev;
    // Slices by size: an arena per size, its share of the pool that size's share of the experts.
    // Each has room besides to stage one layer's experts of that size (a large batch misses most of
    // them), as llama.cpp's compute buffer holds the layer's weights it offloads beside a static
    // split's VRAM share; where the device has no room for that, staging comes out of the pool.
    std::map<uint64_t, uint64_t> bytes_by_size, stage_by_size;
    uint64_t expert_bytes = 0;
    size_t n_tensors = 0;
    for (uint32_t g = 0; g < groups_.size(); ++g) {  // the layers this device serves
        if (device_of_[g] != index) continue;
        std::map<uint64_t, uint64_t> in_group;
        for (const auto* t : groups_[g]) {
            bytes_by_size[t->slice_bytes] += t->slice_bytes * static_cast<uint64_t>(t->n_expert);
            expert_bytes += t->slice_bytes * static_cast<uint64_t>(t->n_expert);
            in_group[t->slice_bytes] += static_cast<uint64_t>(t->n_expert);
            ++n_tensors;
        }
        for (const auto& [size, n] : in_group) stage_by_size[size] = std::max(stage_by_size[size], n);
    }
    if (expert_bytes == 0) {
        if (tensors_.empty()) say("no expert tensors in the backend's buffers (-ot exps=MOECACHE?): nothing to pool");
        return false;
    }
    size_t free_bytes = 0, total = 0;
    ggml_backend_dev_memory(dev, &free_bytes, &total);
    const uint64_t want = pool_bytes(settings, free_bytes, expert_bytes);
    uint64_t staging_bytes = 0;
    for (const auto& [size, n] : stage_by_size) staging_bytes += size * n;
    const bool staging_besides = want + staging_bytes <= pool_room(free_bytes);
    auto* buft = ggml_backend_dev_buffer_type(dev);
    const size_t max_size = ggml_backend_buft_get_max_size(buft);
    ggml_init_params params{ggml_tensor_overhead() * (bytes_by_size.size() * (kMaxViews + 1) + 1), nullptr, true};
    d.ctx = ggml_init(params);
    uint64_t made = 0, staged = 0;
    for (const auto& [slot_bytes, bytes] : bytes_by_size) {
        const auto share = static_cast<uint64_t>(static_cast<double>(want) * static_cast<double>(bytes) /
                                                 static_cast<double>(expert_bytes));
        const uint64_t besides = staging_besides ? stage_by_size[slot_bytes] : 0;
        uint64_t count = std::min<uint64_t>(share / slot_bytes + besides, max_size / slot_bytes);
        if (count <= besides) continue;
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
        // Staging out of the pool only where the pool keeps most of the arena (else large batches
        // split as small ones).
        a.staging = count > besides && (besides > 0 || stage_by_size[slot_bytes] * 2 <= count)
                        ? static_cast<uint32_t>(stage_by_size[slot_bytes])
                        : 0;
        a.whole = ggml_new_tensor_1d(d.ctx, GGML_TYPE_I8, static_cast<int64_t>(count * slot_bytes));
        if (ggml_backend_tensor_alloc(buf, a.whole, a.base) != GGML_STATUS_SUCCESS) {
            ggml_backend_buffer_free(buf);
            continue;
        }
        d.slots.add_arena(slot_bytes, reinterpret_cast<uint64_t>(a.base), a.slots - a.staging);
        made += (count - a.staging) * slot_bytes;
        staged += a.staging * slot_bytes;
        d.pool_bytes += (count - a.staging) * slot_bytes;
        pool_bytes_ += (count - a.staging) * slot_bytes;
        d.arenas.push_back(a);
    }
    if (d.arenas.empty()) {
        say("no room for a pool on %s (%.1f GiB free): every expert is computed on the CPU",
            ggml_backend_dev_name(dev), static_cast<double>(free_bytes) / (1 << 30));
        return false;
    }
    say("a pool of %.2f GiB on %s for %.2f GiB of experts (%zu tensors), and %.2f GiB of slots for the misses "
        "of large batches: pooled experts are computed there, the rest on the CPU",
        static_cast<double>(made) / (1 << 30), ggml_backend_dev_name(dev),
        static_cast<double>(expert_bytes) / (1 << 30), n_tensors, static_cast<double>(staged) / (1 << 30));
    return true;
}

const PoolArena* ExpertPool::arena_for(const ExpertTensor& t) const {
    if (devs_.empty()) return nullptr;
    for (const auto& a : devs_[device_index(t.group)].arenas)
        if (a.slot_bytes == t.slice_bytes) return &a;
    return nullptr;
}

ggml_tensor* ExpertPool::view(const ExpertTensor& t) {
    auto* a = const_cast<PoolArena*>(arena_for(t));
    if (a == nullptr) return nullptr;
    for (const auto& v : a->views)
        if (v.type == t.type && v.ne0 == t.ne0 && v.ne1 == t.ne1) return v.tensor;
    if (a->views.size() >= kMaxViews) return nullptr;
    ggml_tensor* w = ggml_new_tensor_3d(devs_[device_index(t.group)].ctx, t.type, t.ne0, t.ne1, a->slots);
    if (ggml_nbytes(w) != a->slots * a->slot_bytes ||
        ggml_backend_tensor_alloc(a->buffer, w, a->base) != GGML_STATUS_SUCCESS) {
        w = nullptr;
    }
    a->views.push_back(PoolArena::View{t.type, t.ne0, t.ne1, w});
    return w;
}

int32_t ExpertPool::slot_of(const ExpertTensor& t, int32_t expert) {
    const auto* a = arena_for(t);
    if (a == nullptr) return -1;
    const auto e = static_cast<uint32_t>(expert);
    const uint64_t addr = slots(t.group).lookup(cuda::SliceRef{t.group, t.index * static_cast<uint32_t>(t.n_expert) + e, e}, kStream);
    if (addr == 0) return -1;
    return static_cast<int32_t>((addr - reinterpret_cast<uint64_t>(a->base)) / a->slot_bytes);
}

bool ExpertPool::pooled(uint32_t group, int32_t expert) {
    if (!live(group)) return false;
    for (const auto* t : groups_[group])
        if (slot_of(*t, expert) < 0) return false;
    return true;
}

uint32_t ExpertPool::model_of(uint32_t group) {
    if (link_ == nullptr || !live(group)) return UINT32_MAX;
    if (group_model_[group] == UINT32_MAX - 1) group_model_[group] = link_->model_of(groups_[group].front()->data);
    return group_model_[group];
}

void ExpertPool::used(uint32_t group, const std::vector<int32_t>& pooled_experts, const std::vector<int32_t>& missed,
                      uint32_t tokens) {
    if (!live(group)) return;  // its model was unloaded meanwhile
    if (link_ != nullptr) {
        std::vector<int32_t> all(pooled_experts);
        all.insert(all.end(), missed.begin(), missed.end());
        link_->report(model_of(group), groups_[group].front()->block, all, tokens);
        if (!devs_.empty() && since_report_++ % 64 == 0) link_->pool(stats_.pool_rows, stats_.cpu_rows, pool_bytes_);
        for (const auto& d : link_->directives()) follow(d);
    }
    if (group < profile_of_.size() && profile_of_[group] >= 0) {
        auto& prof = profiles_[static_cast<size_t>(profile_of_[group])];
        prof.routed += pooled_experts.size() + missed.size();
        prof.tokens += tokens;
    }
    for (const int32_t e : pooled_experts) heat_.touch(group, static_cast<uint32_t>(e));
    for (const int32_t e : missed) {
        heat_.touch(group, static_cast<uint32_t>(e));
        if (fills_.size() + groups_[group].size() > kMaxQueued || !admit(group, static_cast<uint32_t>(e))) {
            ++stats_.declined;
        }
    }
}

// The daemon's word on an expert: promoted ones rank above every other and are admitted now;
// demoted ones leave the pool. On the model's routing shifting (no expert named): every layer's
// counts learnt before it are cut, as the daemon cut its heat.
void ExpertPool::follow(const moecache_directive& d) {
    if (d.action == MOECACHE_SHIFTED) {
        for (uint32_t g = 0; g < groups_.size(); ++g)
            if (live(g) && group_model_[g] == d.model) heat_.forget(g, kKeepAtShift);
        return;
    }
    for (uint32_t g = 0; g < groups_.size(); ++g) {
        if (!live(g) || group_model_[g] != d.model || groups_[g].front()->block != d.block) continue;
        if (d.expert >= static_cast<uint32_t>(groups_[g].front()->n_expert)) return;
        switch (d.action) {
            case MOECACHE_PROMOTE:
                heat_.set_promoted(g, d.expert, true);
                if (!devs_.empty() && !pooled(g, static_cast<int32_t>(d.expert))) (void)admit(g, d.expert);
                break;
            case MOECACHE_DEMOTE:
                heat_.set_promoted(g, d.expert, false);
                if (!devs_.empty() && slots(g).drop_expert(g, d.expert) > 0) link_->placement(d.model, d.block, d.expert, false);
                break;
            case MOECACHE_UNPROMOTE:
                heat_.set_promoted(g, d.expert, false);
                break;
            default:
                break;
        }
        return;
    }
}

// A slot for each slice of the expert, or none: what is admitted of it is given back when a slice
// finds no room. An expert another slice displaced is dropped whole.
bool ExpertPool::admit_slots(uint32_t group, uint32_t expert, std::vector<Placed>* placed, bool evict) {
    const auto& tensors = groups_[group];
    if (devs_.empty()) return false;
    cuda::VramPool& vram = slots(group);  // the pool of the device that serves the layer
    std::vector<std::pair<const ExpertTensor*, uint64_t>> got;
    for (const auto* t : tensors) {
        const auto n = static_cast<uint32_t>(t->n_expert);
        const cuda::SliceRef s{group, t->index * n + expert, expert};
        if (vram.holds(group, s.slice)) continue;  // pooled already (or being filled)
        cuda::SliceRef evicted{cuda::kNoSlot, 0, 0};
        const uint64_t addr = arena_for(*t) != nullptr
                                  ? vram.admit(s, t->slice_bytes, kStream, heat_, cuda::same_stream_only(), &evicted, evict)
                                  : 0;
        if (evicted.model != cuda::kNoSlot && !(evicted.model == group && evicted.expert == expert)) {
            vram.drop_expert(evicted.model, evicted.expert);
            if (link_ != nullptr && live(evicted.model)) {
                link_->placement(model_of(evicted.model), groups_[evicted.model].front()->block, evicted.expert, false);
            }
        }
        if (addr == 0) {
            for (const auto& [gt, a] : got) vram.drop(group, gt->index * static_cast<uint32_t>(gt->n_expert) + expert);
            return false;
        }
        got.emplace_back(t, addr);
    }
    for (const auto& [t, addr] : got) {
        const auto* a = arena_for(*t);
        placed->push_back(Placed{t, a, static_cast<size_t>(addr - reinterpret_cast<uint64_t>(a->base))});
    }
    return true;
}

// Under mu, when the pool is made: each mapped model's profile seeds the heat, and its experts,
// hottest first, are queued to fill the pool's free slots (a prompt then finds them there too).
void ExpertPool::read_profiles(const std::string& dir) {
    const auto text = read_proc_text("/proc/self/maps");
    if (!text) return;
    const auto maps = parse_maps(*text);
    std::map<std::string, std::vector<uint32_t>> by_file;
    for (uint32_t g = 0; g < groups_.size(); ++g) {
        if (!live(g)) continue;
        if (const MapsEntry* m = entry_at(maps, reinterpret_cast<uintptr_t>(groups_[g].front()->data))) {
            by_file[m->path].push_back(g);
        }
    }
    profile_of_.assign(groups_.size(), -1);
    for (auto& [file, gs] : by_file) {
        std::stable_sort(gs.begin(), gs.end(),
                         [&](uint32_t a, uint32_t b) { return groups_[a].front()->block < groups_[b].front()->block; });
        const auto n = static_cast<uint32_t>(groups_[gs.front()].front()->n_expert);
        if (std::any_of(gs.begin(), gs.end(), [&](uint32_t g) { return groups_[g].front()->n_expert != n; })) continue;
        auto name = cuda::hot_profile_name(file);
        if (!name) continue;
        Profile prof{dir + "/" + *name, gs, n};
        auto hp = cuda::load_hot_profile(prof.path, static_cast<uint32_t>(gs.size()), n);
        if (!hp && hp.error().errnum != ENOENT) {
            say("%s: the hot profile is not used (it is written again at exit): %s", file.c_str(), hp.error().what().c_str());
        }
        size_t queued = 0;
        if (hp) {
            prof.routings = hp->routings;
            const auto prior = cuda::profile_heat(*hp, cuda::kProfilePriorTop);
            std::vector<std::pair<uint32_t, uint32_t>> order;  // (layer, expert)
            for (uint32_t l = 0; l < gs.size(); ++l) {
                for (uint32_t e = 0; e < n; ++e) {
                    const uint32_t h = prior[size_t{l} * n + e];
                    if (h == 0) continue;
                    heat_.set(gs[l], e, h);
                    order.emplace_back(l, e);
                }
            }
            std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
                return prior[size_t{a.first} * n + a.second] > prior[size_t{b.first} * n + b.second];
            });
            for (const auto& [l, e] : order) {
                std::vector<Placed> placed;
                if (!admit_slots(gs[l], e, &placed, false)) break;  // the pool is full
                for (const auto& p : placed) fills_.push_back(Fill{p.tensor, e, p.arena, p.offset});
                ++queued;
            }
            if (queued > 0) fill_cv_.notify_one();
            if (log_) {
                say("%s: the pool starts from the hot set of earlier runs (%s, %llu routings): %zu experts queued",
                    file.c_str(), prof.path.c_str(), static_cast<unsigned long long>(hp->routings), queued);
            }
        }
        for (const uint32_t g : gs) profile_of_[g] = static_cast<int32_t>(profiles_.size());
        profiles_.push_back(std::move(prof));
    }
}

// Saved where this run routed cuda::kProfileTokens tokens' worth since the last save: the heat the
// pool kept (the profile's it started from, decayed, and what this run added). Under mu.
void ExpertPool::save_profile(Profile& p, bool final) {
    if (p.path.empty() || p.tokens - p.saved < cuda::kProfileTokens * p.groups.size()) {
        if (final) p.path.clear();
        return;
    }
    cuda::HotProfile hp;
    hp.n_layers = static_cast<uint32_t>(p.groups.size());
    hp.n_experts = p.n_experts;
    hp.routings = p.routings + p.routed;
    hp.counts.assign(size_t{hp.n_layers} * hp.n_experts, 0);
    for (uint32_t l = 0; l < hp.n_layers; ++l) {
        if (!live(p.groups[l])) return;
        for (uint32_t e = 0; e < hp.n_experts; ++e) hp.counts[size_t{l} * hp.n_experts + e] = heat_.count(p.groups[l], e);
    }
    if (auto r = cuda::save_hot_profile(p.path, hp); !r) {
        if (log_) say("the hot profile was not saved: %s", r.error().what().c_str());
        p.path.clear();  // once: the folder is not ours to write
        return;
    }
    p.saved = p.tokens;
    if (log_) say("hot profile saved (%s, %llu routings)", p.path.c_str(), static_cast<unsigned long long>(hp.routings));
    if (final) p.path.clear();
}

bool ExpertPool::admit(uint32_t group, uint32_t expert) {
    std::vector<Placed> placed;
    if (!admit_slots(group, expert, &placed)) return false;
    for (const auto& p : placed) fills_.push_back(Fill{p.tensor, expert, p.arena, p.offset});
    if (!placed.empty()) fill_cv_.notify_one();
    return true;
}

bool ExpertPool::admit_here(uint32_t group, uint32_t expert, std::vector<Placed>* placed, bool evict) {
    if (devs_.empty() || group >= groups_.size() || !admit_slots(group, expert, placed, evict)) return false;
    // A slot the pool's own thread is still copying a dropped slice into: not this one.
    const bool busy = std::any_of(placed->begin(), placed->end(), [&](const Placed& p) {
        return copying_ && reinterpret_cast<uint64_t>(p.arena->base) + p.offset == copying_->slot();
    });
    if (busy) {
        settle(expert, *placed, false);
        placed->clear();
    }
    return !busy;
}

void ExpertPool::settle(uint32_t expert, const std::vector<Placed>& placed, bool done) {
    for (const auto& p : placed) {
        const ExpertTensor& t = *p.tensor;
        const uint32_t slice = t.index * static_cast<uint32_t>(t.n_expert) + expert;
        if (!done) {
            slots(t.group).drop(t.group, slice);
        } else if (slots(t.group).commit(cuda::SliceRef{t.group, slice, expert}) != 0) {
            committed(t, expert);
        }
    }
}

// Under mu: a slice's copy is in and its slot serves.
void ExpertPool::committed(const ExpertTensor& t, uint32_t expert) {
    ++stats_.fills;
    stats_.fill_bytes += t.slice_bytes;
    // The expert's last slice in: it is in VRAM now, and the daemon may let its RAM go.
    if (link_ != nullptr && pooled(t.group, static_cast<int32_t>(expert))) {
        link_->placement(model_of(t.group), t.block, expert, true);
    }
}

// Pins the expert tensors' host bytes for the device's DMA engines (what large batches stage and
// fills copy come at link speed, not through the driver's pageable bounce), where they fit in half of
// the RAM the process may hold (the machine's, or its memory cgroup's limit): the CUDA runtime the process loaded (libggml-cuda's), registering read-only, portable. Else,
// or on another device, copies are pageable.
void ExpertPool::register_for_dma() {
    const auto t0 = std::chrono::steady_clock::now();
    if (devs_.empty() || !cuda_) return;
    void* cudart = nullptr;
    for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
        if ((cudart = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) != nullptr) break;
    }
    if (cudart == nullptr) {
        say("no shared CUDA runtime in the process: large batches stage experts through pageable copies");
        return;
    }
    using Register = int (*)(void*, size_t, unsigned);
    auto reg = reinterpret_cast<Register>(dlsym(cudart, "cudaHostRegister"));
    // Ranges: the tensors in address order, merged where they share a page.
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    {
        std::lock_guard lock(mu);
        for (const auto& [data, t] : tensors_) {
            const auto begin = reinterpret_cast<uintptr_t>(t.data);
            ranges.emplace_back(begin, begin + t.slice_bytes * static_cast<uint64_t>(t.n_expert));
        }
    }
    const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    // The RAM this process may hold: a memory cgroup's limit binds before the machine's RAM (pinning
    // a model larger than the cgroup would fault it all in and set the OOM killer on the runtime).
    auto ram = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * page;
    if (const auto cg = own_memory_cgroup_limit()) ram = std::min(ram, cg->limit);
    uint64_t total = 0;
    for (const auto& [b, e] : ranges) total += e - b;
    if (reg == nullptr || total > ram / 2) {
        say("%.1f GiB of experts, %.1f GiB of RAM (or memory cgroup limit): not pinned; large batches stage experts through pageable copies",
            static_cast<double>(total) / (1 << 30), static_cast<double>(ram) / (1 << 30));
        return;
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (auto [b, e] : ranges) {
        b = b / page * page;
        e = (e + page - 1) / page * page;
        if (!merged.empty() && b <= merged.back().second) {
            merged.back().second = std::max(merged.back().second, e);
        } else {
            merged.emplace_back(b, e);
        }
    }
    constexpr unsigned kPortable = 0x01, kReadOnly = 0x08;  // cudaHostRegisterPortable, ...ReadOnly
    uint64_t pinned = 0;
    for (const auto& [b, e] : merged) {
        if (reg(reinterpret_cast<void*>(b), e - b, kPortable | kReadOnly) == 0) pinned += e - b;
    }
    std::lock_guard lock(mu);
    stats_.registered = pinned == total || pinned > 0;
    stats_.register_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t0).count());
    if (log_) {
        say("%.2f GiB of expert bytes pinned for DMA in %.1f s", static_cast<double>(pinned) / (1 << 30),
            static_cast<double>(stats_.register_ns) / 1e9);
    }
}

void ExpertPool::fill_loop() {
    std::unique_lock lock(mu);
    for (;;) {
        fill_cv_.wait(lock, [&] { return stop_ || (!hold_ && !fills_.empty()); });
        if (stop_) return;
        const Fill f = fills_.front();
        fills_.pop_front();
        // A fill whose slice lost that slot meanwhile (evicted, perhaps admitted anew elsewhere, its
        // slot another's by now): copying it would overwrite what the slot holds now.
        cuda::VramPool& vram = slots(f.tensor->group);
        if (vram.filling_address(f.slice()) == f.slot()) {
            copying_ = f;
            lock.unlock();
            // The slot is nobody's until committed: no compute reads it, and no crossing copies into
            // it while copying_ names it (admit_here).
            const ExpertTensor& t = *f.tensor;
            const size_t at = static_cast<size_t>(f.expert) * t.slice_bytes;
            if (t.random_reads) (void)backend::read_ahead(t.data + at, t.slice_bytes, t.fd(), t.file_offset + at);
            ggml_backend_tensor_set(f.arena->whole, t.data + at, f.offset, t.slice_bytes);
            lock.lock();
            copying_.reset();
            if (vram.filling_address(f.slice()) == f.slot() && vram.commit(f.slice()) != 0) committed(t, f.expert);
        }
        // drain() and forget() may be waiting for this copy, or for the queue to empty.
        drained_cv_.notify_all();
    }
}

uint64_t ExpertPool::Fill::slot() const { return reinterpret_cast<uint64_t>(arena->base) + offset; }

cuda::SliceRef ExpertPool::Fill::slice() const {
    return cuda::SliceRef{tensor->group, tensor->index * static_cast<uint32_t>(tensor->n_expert) + expert, expert};
}

void ExpertPool::hold_fills(bool hold) {
    {
        std::lock_guard lock(mu);
        hold_ = hold;
    }
    fill_cv_.notify_all();
}

void ExpertPool::wait_registered(std::unique_lock<std::mutex>& lock) {
    drained_cv_.wait(lock, [&] { return !registering_; });
}

void ExpertPool::drain() {
    std::unique_lock lock(mu);
    drained_cv_.wait(lock, [&] { return stop_ || !filler_.joinable() || (fills_.empty() && !copying_); });
}

void ExpertPool::stop_filler() {
    auto& p = get();
    {
        std::lock_guard lock(p.mu);
        for (auto& prof : p.profiles_) p.save_profile(prof, true);
        p.stop_ = true;
    }
    p.fill_cv_.notify_all();
    p.drained_cv_.notify_all();
    if (p.filler_.joinable()) p.filler_.join();
}

}  // namespace moecache::backend
