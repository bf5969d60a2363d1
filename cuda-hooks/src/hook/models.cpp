// Which models this process maps: /proc/self/maps read on the background thread, each mapped file
// that starts with "GGUF" opened and checked to be the inode mapped, its expert map built (a split
// set is found from any part by its metadata), and a snapshot of the mappings published for the
// copy path. And what the hook says when a runtime copies model-sized buffers but maps no model.
#include "driver.h"
#include "engine.h"
#include "log.h"
#include "moecache/client.h"
#include "moecache/cuda/hot_profile.h"
#include "moecache/unique_fd.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>

namespace moecache::cuda::hook {
namespace {

bool ends_with(const std::string& s, const char* tail) {
    const size_t n = strlen(tail);
    return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

// A GGUF file this process has open but does not map, if any: what a runtime that read its model
// (llama.cpp --load-mode none/dio/mlock, --no-mmap) may still hold.
std::string open_unmapped_gguf() {
    DIR* d = opendir("/proc/self/fd");
    if (d == nullptr) return {};
    std::string found;
    while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        const std::string link = std::string("/proc/self/fd/") + e->d_name;
        const ssize_t n = readlink(link.c_str(), path, sizeof path - 1);
        if (n <= 0 || path[0] != '/') continue;
        path[n] = '\0';
        UniqueFd fd(::open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW));
        struct stat st {};
        char magic[4];
        if (fd && fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode) && pread(fd.get(), magic, 4, 0) == 4 &&
            memcmp(magic, "GGUF", 4) == 0) {
            found = path;
            break;
        }
    }
    closedir(d);
    return found;
}

}  // namespace

Engine::Model* Engine::open_model(const MapsEntry& e) {
    // Only regular files that say GGUF in their first bytes are parsed; each is opened by its path
    // and checked to be the inode the mapping shows.
    UniqueFd fd(::open(e.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd) return nullptr;
    struct stat st {};
    char magic[4];
    if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || major(st.st_dev) != e.file.dev_major ||
        minor(st.st_dev) != e.file.dev_minor || static_cast<uint64_t>(st.st_ino) != e.file.inode ||
        pread(fd.get(), magic, 4, 0) != 4 || memcmp(magic, "GGUF", 4) != 0)
        return nullptr;
    auto parts = open_gguf_model(e.path);
    if (!parts) {
        say("%s: not used: %s", e.path.c_str(), parts.error().message.c_str());
        return nullptr;
    }
    auto map = ExpertMap::build(*parts);
    if (!map) {
        say("%s: not used: %s", e.path.c_str(), map.error().message.c_str());
        return nullptr;
    }
    if (map->layers.empty() || map->n_experts == 0) return nullptr;
    auto* m = new Model;
    m->id = static_cast<uint32_t>(models_.size());
    m->path = e.path;
    m->map = std::move(*map);
    for (const auto& f : m->map.files) {
        auto id = identify_file(f.path);
        m->files.push_back(id ? *id : InodeId{});
        // Kept open for good (models live until exit): misses are read through it (staging.h), and
        // read no more than they ask for (no read-ahead into neighbouring, often cold, experts).
        int rfd = id ? ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK) : -1;
        struct stat fst {};
        if (rfd >= 0 && (fstat(rfd, &fst) != 0 || !S_ISREG(fst.st_mode) || static_cast<uint64_t>(fst.st_ino) != id->inode ||
                         major(fst.st_dev) != id->dev_major || minor(fst.st_dev) != id->dev_minor)) {
            ::close(rfd);
            rfd = -1;
        }
        if (rfd >= 0) (void)posix_fadvise(rfd, 0, 0, POSIX_FADV_RANDOM);
        m->fds.push_back(rfd);
    }
    uint32_t max_block = 0;
    for (const auto& l : m->map.layers) max_block = std::max(max_block, l.index);
    m->layer_slot.assign(max_block + 1, -1);
    uint32_t base = 0;
    for (size_t i = 0; i < m->map.layers.size(); ++i) {
        const auto& l = m->map.layers[i];
        m->layer_slot[l.index] = static_cast<int32_t>(i);
        m->slice_base.push_back(base);
        m->slices_per_expert.push_back(static_cast<uint32_t>(l.tensors.size()));
        base += static_cast<uint32_t>(l.tensors.size()) * m->map.n_experts;
    }
    m->n_slices = base;
    m->registered.reset(new std::atomic<uint8_t>[base]);
    for (uint32_t i = 0; i < base; ++i) m->registered[i].store(Model::kNone, std::memory_order_relaxed);
    m->n_experts = static_cast<uint32_t>(m->map.layers.size()) * m->map.n_experts;
    m->daemon_locked.assign(m->n_experts, 0);
    m->pooled_on.assign(m->n_experts, 0);
    m->promoted.assign(m->n_experts, 0);
    read_profile(*m);
    for (auto& p : pools_)
        if (auto* dp = p.load()) {
            std::lock_guard lock(dp->mu);
            add_model_to(*dp, *m);
        }
    models_.push_back(m);
    n_models_.store(models_.size());
    queue_prior(*m);
    if (client_ != nullptr) {
        uint32_t h = 0;
        if (moecache_client_register_model(client_, m->path.c_str(), &h) == 0) m->client_handle.store(h);
    }
    return m;
}

void Engine::read_profile(Model& m) {
    if (cfg_.profile_dir.empty()) return;
    auto name = hot_profile_name(m.map.files.empty() ? m.path : m.map.files.front().path);
    if (!name) {
        if (cfg_.log) say("%s: no hot profile: %s", m.path.c_str(), name.error().what().c_str());
        return;
    }
    m.profile_path = cfg_.profile_dir + "/" + *name;
    auto p = load_hot_profile(m.profile_path, static_cast<uint32_t>(m.map.layers.size()), m.map.n_experts);
    if (!p) {
        if (p.error().errnum != ENOENT)
            say("%s: the hot profile is not used (it is written again at exit): %s", m.path.c_str(), p.error().what().c_str());
        return;
    }
    m.prior = profile_heat(*p, kProfilePriorTop);
    m.profile_routings = p->routings;
    if (cfg_.log)
        say("%s: the pool starts from the hot set of earlier runs (%s, %" PRIu64 " routings)", m.path.c_str(),
            m.profile_path.c_str(), p->routings);
}

// The profile's experts, hottest first, for the pools to fill from (fill.cpp) while no daemon
// directs them: a prompt, whose batches displace nothing, then finds them there too.
void Engine::queue_prior(Model& m) {
    if (m.prior.size() != m.n_experts) return;
    m.prior_wanted.assign(m.n_experts, 0);
    std::vector<uint32_t> order;
    for (uint32_t e = 0; e < m.n_experts; ++e)
        if (m.prior[e] > 0) order.push_back(e);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return m.prior[a] > m.prior[b]; });
    for (uint32_t e : order) {
        m.prior_wanted[e] = 1;
        fill_queue_.emplace_back(m.id, e);
    }
    ++fill_gen_;
}

// Saved where this run routed at least kProfileTokens tokens' worth since the last save: the counts
// the pools kept (the profile's heat they started from, decayed, and what this run added).
void Engine::save_profiles(bool final) {
    std::lock_guard plock(profile_mu_);
    const Snapshot* snap = snapshot_.load(std::memory_order_acquire);
    if (snap == nullptr || cfg_.profile_dir.empty()) return;
    for (Model* m : snap->models) {
        if (m->profile_path.empty()) continue;
        const uint64_t routed = m->routed.load(std::memory_order_relaxed);
        const uint64_t enough = kProfileTokens * m->map.layers.size() * std::max<uint32_t>(m->map.n_experts_used, 1);
        if (routed - m->routed_saved < enough) continue;
        HotProfile p;
        p.n_layers = static_cast<uint32_t>(m->map.layers.size());
        p.n_experts = m->map.n_experts;
        p.counts.assign(m->n_experts, 0);
        p.routings = m->profile_routings + routed;
        for (auto& slot : pools_)
            if (DevicePool* dp = slot.load()) {
                std::lock_guard lock(dp->mu);
                for (uint32_t e = 0; e < m->n_experts; ++e) p.counts[e] += dp->heat.count(m->id, e);
            }
        if (auto r = save_hot_profile(m->profile_path, p); !r) {
            if (cfg_.log) say("%s: the hot profile was not saved: %s", m->path.c_str(), r.error().what().c_str());
            m->profile_path.clear();  // once: the folder is not ours to write
            continue;
        }
        m->routed_saved = routed;
        if (cfg_.log && final)
            say("%s: hot profile saved (%s, %" PRIu64 " routings)", m->path.c_str(), m->profile_path.c_str(), p.routings);
    }
}

void Engine::scan() {
    auto text = read_proc_text("/proc/self/maps");
    if (!text) return;
    std::vector<MappedRange> mapped;
    for (auto& e : parse_maps(*text)) {
        if (e.mapping.perms.size() < 4 || e.mapping.perms[0] != 'r' || e.mapping.perms[2] == 'x') continue;
        if (std::find(not_models_.begin(), not_models_.end(), e.file) != not_models_.end()) continue;
        Model* owner = nullptr;
        uint32_t file = 0;
        for (auto* m : models_) {
            auto it = std::find(m->files.begin(), m->files.end(), e.file);
            if (it != m->files.end()) {
                owner = m;
                file = static_cast<uint32_t>(it - m->files.begin());
                break;
            }
        }
        if (owner == nullptr) {
            if (e.path.empty() || e.path[0] != '/' || ends_with(e.path, " (deleted)") ||
                (owner = open_model(e)) == nullptr) {
                not_models_.push_back(e.file);
                continue;
            }
            auto it = std::find(owner->files.begin(), owner->files.end(), e.file);
            if (it == owner->files.end()) continue;
            file = static_cast<uint32_t>(it - owner->files.begin());
        }
        mapped.push_back({owner->id, file, e.mapping});
    }
    auto same = [](const MappedRange& a, const MappedRange& b) {
        return a.model == b.model && a.file == b.file && a.mapping.start == b.mapping.start &&
               a.mapping.end == b.mapping.end && a.mapping.file_offset == b.mapping.file_offset;
    };
    if (snapshot_.load() != nullptr && mapped.size() == mapped_.size() &&
        std::equal(mapped.begin(), mapped.end(), mapped_.begin(), same))
        return;
    auto* snap = new Snapshot;
    snap->models = models_;
    for (const auto& r : mapped) {
        Model* m = models_[r.model];
        snap->classifier.add_mapping(r.model, &m->map, r.file, r.mapping.start, r.mapping.end - r.mapping.start,
                                     r.mapping.file_offset);
        if (client_ != nullptr && m->client_handle.load() != UINT32_MAX)
            (void)moecache_client_describe_mapping(client_, m->client_handle.load(), r.file,
                                                   reinterpret_cast<const void*>(r.mapping.start),
                                                   r.mapping.end - r.mapping.start, r.mapping.file_offset);
    }
    mapped_ = std::move(mapped);
    snapshot_.store(snap, std::memory_order_release);  // the old one stays: a hooked call may be reading it
}

// A runtime that loaded its model without mmap copies experts from its own memory: the hook can
// neither see nor serve them. Said once, when a gigabyte of large copies came from memory that
// maps no model while no model is mapped at all, with the cause and the fix; the daemon counts it.
void Engine::tell_unmapped() {
    constexpr uint64_t kEnough = 1ull << 30;
    const uint64_t bytes = unmapped_bytes_.load();
    if (client_ != nullptr && bytes > 0)
        (void)moecache_client_report_unmapped(client_, unmapped_copies_.load(), bytes, mapped_.empty() ? 1 : 0);
    if (told_unmapped_ || bytes < kEnough || !mapped_.empty()) return;
    told_unmapped_ = true;
    const std::string open = open_unmapped_gguf();
    say("this process copies large buffers to the GPU (%.1f GiB so far) but maps no GGUF model%s%s: it loaded the "
        "model without mmap (llama.cpp --load-mode none, dio or mlock, or --no-mmap), so moecache sees no expert "
        "and serves none. Load with mmap, llama.cpp's default (--load-mode mmap, no --no-mmap), to use it; "
        "llama.cpp's advice to turn mmap off with CPU experts does not apply under moecache",
        static_cast<double>(bytes) / 1073741824.0, open.empty() ? "" : " (it has ", open.empty() ? "" : (open + " open)").c_str());
}

}  // namespace moecache::cuda::hook
