#include "capture_gate.h"
#include "moecache/memory_cgroup.h"
#include "staging.h"

#include "driver.h"
#include "engine.h"
#include "log.h"
#include "registrations.h"
#include "moecache/client.h"
#include "moecache/unique_fd.h"

#include <string>
#include <cstdio>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <tuple>

#if defined(__x86_64__)
#include <immintrin.h>
#define MOECACHE_PAUSE() _mm_pause()
#else
#define MOECACHE_PAUSE() ((void)0)
#endif

namespace moecache::cuda::hook {
namespace {

constexpr size_t kPartBytes = 128 << 10;  // what one thread takes at a time
// Decoding copies a layer's experts, computes it (a few hundred microseconds), copies the next
// layer's: threads that spin that long are awake for the next layer's copies.
constexpr auto kSpin = std::chrono::microseconds(400);
constexpr auto kMaxBufferWait = std::chrono::milliseconds(20);

}  // namespace

namespace {
std::atomic<uint64_t> g_read_from_files{0};
}  // namespace

void read_host_bytes(uint8_t* dst, const HostBytes& from, size_t n) {
    size_t done = 0;
    while (from.fd >= 0 && done < n) {
        const ssize_t r = pread(from.fd, dst + done, n - done, static_cast<off_t>(from.file_offset + done));
        if (r > 0) done += static_cast<size_t>(r);
        else if (r < 0 && errno == EINTR) continue;
        else break;  // an error, or the end of the file: the mapping has the rest
    }
    if (done > 0) g_read_from_files.fetch_add(done, std::memory_order_relaxed);
    if (done < n) memcpy(dst + done, from.src + done, n - done);
}

uint64_t host_bytes_read_from_files() { return g_read_from_files.load(std::memory_order_relaxed); }

bool resident(const uint8_t* p, size_t n) {
    static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(p) + n;
    unsigned char in[1024];
    while (a < end) {
        const size_t pages = std::min<size_t>(sizeof in, (end - a + page - 1) / page);
        if (mincore(reinterpret_cast<void*>(a), pages * page, in) != 0) return true;  // cannot tell: as before
        for (size_t i = 0; i < pages; ++i)
            if ((in[i] & 1) == 0) return false;
        a += pages * page;
    }
    return true;
}

// --- CopyCrew -----------------------------------------------------------------------------------

CopyCrew::~CopyCrew() {
    stopping_.store(true);
    generation_.fetch_add(1);
    generation_.notify_all();
    for (auto& t : threads_) t.detach();  // they may be in the middle of nothing: let them go with the process
}

void CopyCrew::start(unsigned helpers) {
    for (unsigned i = 0; i < helpers; ++i) threads_.emplace_back([this] { work(); });
}

// The part counter carries the job's generation in its high half: a thread that wakes late for a
// finished job cannot take a part of the next one with the old job in mind.
bool CopyCrew::take_part(uint32_t generation) {
    uint64_t v = next_.load(std::memory_order_acquire);
    for (;;) {
        if (static_cast<uint32_t>(v >> 32) != generation || static_cast<uint32_t>(v) >= parts_) return false;
        if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) break;
    }
    const size_t off = size_t{static_cast<uint32_t>(v)} * part_;
    read_host_bytes(dst_ + off, src_.at(off), std::min(part_, n_ - off));
    done_parts_.fetch_add(1, std::memory_order_acq_rel);
    return true;
}

void CopyCrew::work() {
    pthread_setname_np(pthread_self(), "moecache-copy");
    uint32_t seen = generation_.load();
    while (!stopping_.load(std::memory_order_relaxed)) {
        const auto until = std::chrono::steady_clock::now() + kSpin;
        uint32_t g = generation_.load(std::memory_order_acquire);
        while (g == seen && std::chrono::steady_clock::now() < until) {
            MOECACHE_PAUSE();
            g = generation_.load(std::memory_order_acquire);
        }
        if (g == seen) {
            generation_.wait(seen);
            continue;
        }
        seen = g;
        while (take_part(g)) {
        }
    }
}

void CopyCrew::copy(void* dst, const HostBytes& src, size_t n) {
    std::unique_lock lock(busy_, std::try_to_lock);
    if (!lock.owns_lock() || threads_.empty() || n < 2 * kPartBytes) {
        read_host_bytes(static_cast<uint8_t*>(dst), src, n);
        return;
    }
    dst_ = static_cast<uint8_t*>(dst);
    src_ = src;
    n_ = n;
    // Parts small enough for every thread to get some, large enough to be worth a thread.
    part_ = std::max<size_t>(kPartBytes, (n / (threads_.size() + 1) + 4095) & ~size_t{4095});
    parts_ = static_cast<uint32_t>((n + part_ - 1) / part_);
    done_parts_.store(0, std::memory_order_relaxed);
    const uint32_t g = generation_.load(std::memory_order_relaxed) + 1;
    next_.store(uint64_t{g} << 32, std::memory_order_release);
    generation_.store(g, std::memory_order_release);
    generation_.notify_all();
    while (take_part(g)) {
    }
    while (done_parts_.load(std::memory_order_acquire) < parts_) MOECACHE_PAUSE();
}

// --- StagingRing --------------------------------------------------------------------------------

std::unique_ptr<StagingRing> StagingRing::create(const Driver* drv, CopyCrew* crew, size_t buffer_bytes, int buffers) {
    std::unique_ptr<StagingRing> r(new StagingRing(drv, crew, buffer_bytes));
    for (int i = 0; i < buffers; ++i) {
        Buffer b;
        void* p = nullptr;
        if (drv->mem_host_alloc(&p, buffer_bytes, CU_MEMHOSTALLOC_PORTABLE) != CUDA_SUCCESS) return nullptr;
        b.host = static_cast<uint8_t*>(p);
        r->buffers_.push_back(b);  // owned from here: freed by the destructor if what follows fails
        if (drv->event_create(&r->buffers_.back().read, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return nullptr;
    }
    return r;
}

StagingRing::~StagingRing() {
    for (auto& b : buffers_) {
        if (b.queued && b.read != nullptr) (void)drv_->event_synchronize(b.read);
        if (b.host != nullptr) (void)drv_->mem_free_host(b.host);
    }
}

bool StagingRing::wait_free(Buffer& b) {
    if (!b.queued) return true;
    const auto until = std::chrono::steady_clock::now() + kMaxBufferWait;
    for (;;) {
        const CUresult q = drv_->event_query(b.read);
        if (q == CUDA_SUCCESS) {
            b.queued = false;
            return true;
        }
        if (q != CUDA_ERROR_NOT_READY || std::chrono::steady_clock::now() >= until) return false;
        MOECACHE_PAUSE();
    }
}

StagingRing::Buffer* StagingRing::claim() {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < buffers_.size(); ++i) {
        const size_t at = (next_ + i) % buffers_.size();
        if (buffers_[at].claimed) continue;
        buffers_[at].claimed = true;
        next_ = (at + 1) % buffers_.size();
        return &buffers_[at];
    }
    return nullptr;
}

void StagingRing::give_back(Buffer& b) {
    std::lock_guard lock(mu_);
    b.claimed = false;
}

CUresult StagingRing::copy(CUdeviceptr dst, const HostBytes& src, size_t n, CUstream stream, uint64_t* staged) {
    for (size_t off = 0; off < n;) {
        const size_t len = std::min(buffer_bytes_, n - off);
        Buffer* b = claim();
        CUresult r = CUDA_SUCCESS;
        if (b != nullptr && wait_free(*b)) {
            crew_->copy(b->host, src.at(off), len);
            r = drv_->memcpy_htod_async(dst + off, b->host, len, stream);
            if (r == CUDA_SUCCESS) r = drv_->event_record(b->read, stream);
            if (r == CUDA_SUCCESS) {
                b->queued = true;
                *staged += len;
            }
            give_back(*b);
        } else {
            if (b != nullptr) give_back(*b);
            r = htod_in_pieces(drv_, dst + off, src.src + off, len, stream);
        }
        if (r != CUDA_SUCCESS) return r;
        off += len;
    }
    return CUDA_SUCCESS;
}

// --- Engine: how misses reach a device ----------------------------------------------------------

namespace {

constexpr size_t kStagingBuffer = 8 << 20;
constexpr int kStagingBuffers = 6;
constexpr size_t kProbeBytes = 64 << 20;
// Registering ahead works this long per turn of the background loop, between its other duties.
constexpr auto kAheadTurn = std::chrono::milliseconds(10);

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// For MOECACHE_CUDA_PIN=all: every mapped expert byte registered for DMA, once, for every device
// (PORTABLE): a second device finds it registered already (CUDA error 712), which is no failure.
void Engine::pin_models() {
    const Driver* drv = driver();
    if (drv == nullptr || pinned_all_) return;
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    bool all = !mapped_.empty();
    std::vector<Registrations::Request> requests;
    std::vector<const Model*> of;
    for (const auto& r : mapped_) {
        const Model* m = models_[r.model];
        uint64_t lo = UINT64_MAX, hi = 0;
        for (const auto& l : m->map.layers)
            for (const auto& t : l.tensors)
                if (t.file == r.file) {
                    lo = std::min(lo, t.offset);
                    hi = std::max(hi, t.offset + t.bytes_per_expert * m->map.n_experts);
                }
        const uint64_t map_lo = r.mapping.file_offset, map_hi = r.mapping.file_offset + (r.mapping.end - r.mapping.start);
        lo = std::max(lo, map_lo);
        hi = std::min(hi, map_hi);
        if (lo >= hi) continue;
        uintptr_t a = r.mapping.address_of(lo) & ~(page - 1);
        uintptr_t b = (r.mapping.address_of(hi) + page - 1) & ~(page - 1);
        b = std::min<uintptr_t>(b, r.mapping.end);
        requests.push_back({reinterpret_cast<void*>(a), b - a});
        of.push_back(m);
    }
    const auto t0 = std::chrono::steady_clock::now();
    registrations().add(drv, requests, CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_PORTABLE);
    for (size_t i = 0; i < requests.size(); ++i) {
        const auto& q = requests[i];
        if (q.result == CUDA_SUCCESS) {
            pinned_.emplace_back(q.p, q.bytes);
            pinned_bytes_.fetch_add(q.bytes);
            if (cfg_.log)
                say("registered %.2f GiB of %s for DMA in %.1f s", static_cast<double>(q.bytes) / 1073741824.0,
                    of[i]->path.c_str(), seconds_since(t0));
        } else if (q.result != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
            all = false;
            if (q.result != CUDA_ERROR_NOT_READY) register_failed_.store(true);
            say("%s: registering the expert bytes for DMA failed (CUDA error %d); misses go through pinned staging",
                of[i]->path.c_str(), static_cast<int>(q.result));
        }
    }
    pinned_all_ = all;
    ++fill_gen_;  // a fill waiting for registered pages can go now
}

// The registered tier (auto, register). With a daemon, or when the budget cannot hold every expert
// slice of the models mapped: each slice the copy path or the daemon's locks asked for, registered
// for DMA on its own (slice_pages: its page-aligned inside), once, within the budget. Otherwise the
// tier is every expert tensor: runs of neighbouring expert tensors (a layer's gate, up and down)
// registered whole in the background, a few milliseconds of it per turn of the loop, the runs of
// slices that missed first: the first tokens' misses are staged, the rest find their bytes
// registered. Pages registered stay resident while registered.
//
// The driver refuses a copy that starts in registered memory and ends outside it: every copy that
// passes through the hook is cut at the registrations' edges (registrations.h), and a registration
// waits for the copies that planned without it. So that an expert copy is one piece where it can
// be, a registration never starts at a slice's first byte (slice_pages leaves out the first page of
// a slice that starts on one), and a run's registration ends a page past its last tensor (the
// padding runtimes copy after a tensor's last expert).
// Returns true while there is more to register ahead.
bool Engine::register_wanted() {
    flush_unregisters();  // a slice let go and wanted again is unregistered first
    std::vector<std::pair<uint32_t, uint32_t>> wanted;
    {
        std::lock_guard lock(wanted_mu_);
        wanted.swap(wanted_);
    }
    const Driver* drv = driver();
    int device = -1;
    for (int d = 0; d < kMaxDevices && device < 0; ++d)
        if (pools_[d].load() != nullptr) device = d;
    if (drv == nullptr || device < 0) return false;
    const uint64_t budget = pin_budget();
    // A daemon connected whose policy has not come yet may have its locks followed: wait for it.
    moecache_client_stats cs{};
    if (client_ != nullptr) moecache_client_stats_get(client_, &cs);
    const bool ahead = ahead_.load() && !follow_locks_.load() && (cs.connected == 0 || daemon_decided_);
    if (ahead_.load() && !follow_locks_.load() && !ahead) {  // until it says: the runs or its locks
        std::lock_guard lock(wanted_mu_);
        wanted_.insert(wanted_.end(), wanted.begin(), wanted.end());
        return false;
    }
    if (wanted.empty() && !(ahead && ahead_model_ < models_.size())) return false;
    DeviceContext ctx(drv, device);
    if (!ctx.ok()) return false;
    if (ahead) {
        // The runs of the slices that missed, then every other in order.
        const auto until = std::chrono::steady_clock::now() + kAheadTurn;
        for (const auto& [mi, slice] : wanted) {
            Model& m = *models_[mi];
            build_runs(m);
            if (slice / m.map.n_experts < m.run_of_tensor.size()) register_run(m, m.run_of_tensor[slice / m.map.n_experts], budget);
        }
        // Runs whose pages are not all in the page cache wait (registering them would read them a
        // page at a time, in the driver, holding up the runtime's own calls: a cold model with lazy
        // load took 130 s to load so): the pass starts again once a second while some wait.
        const auto now = std::chrono::steady_clock::now();
        if (ahead_model_ >= models_.size() && ahead_waiting_ && now >= ahead_retry_) {
            ahead_model_ = 0;
            ahead_run_ = 0;
            ahead_waiting_ = false;
        }
        while (ahead_model_ < models_.size() && std::chrono::steady_clock::now() < until) {
            Model& m = *models_[ahead_model_];
            build_runs(m);
            if (ahead_run_ >= m.runs.size()) {
                ++ahead_model_;
                ahead_run_ = 0;
                continue;
            }
            register_run(m, ahead_run_++, budget);
        }
        if (ahead_model_ >= models_.size()) {
            bool waiting = false;
            for (const Model* m : models_)
                for (const auto& r : m->runs) waiting = waiting || !r.done;
            if (waiting && !ahead_waiting_) ahead_retry_ = now + std::chrono::seconds(1);
            ahead_waiting_ = waiting;
            if (!waiting && !ahead_told_ && cfg_.log) {
                ahead_told_ = true;
                say("%.2f GiB of expert tensors registered for DMA", static_cast<double>(pinned_bytes_.load()) / 1073741824.0);
            }
        }
        return ahead_model_ < models_.size();
    }
    // The slices asked for, registered together (one wait for the copies under way).
    struct Asked {
        Model* m;
        uint32_t slice;
        size_t request;  // SIZE_MAX: not asked of the driver
    };
    std::vector<Asked> asked;
    std::vector<Registrations::Request> requests;
    uint64_t adding = 0;
    for (const auto& [mi, slice] : wanted) {
        Model& m = *models_[mi];
        if (m.registered[slice].load() != Model::kAsked) continue;  // let go meanwhile
        const auto [a, b] = slice_pages(m, slice);
        // With a daemon the slices asked for are the pages it keeps locked: resident already, and
        // bounded by its own lock budget (its memory cgroup's room), not by the hook's.
        size_t request = SIZE_MAX;
        if (b > a && (follow_locks_.load() || pinned_bytes_.load() + adding + (b - a) <= budget)) {
            request = requests.size();
            requests.push_back({reinterpret_cast<void*>(a), b - a});
            adding += b - a;
        }
        asked.push_back({&m, slice, request});
    }
    registrations().add(drv, requests, CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_PORTABLE);
    for (const auto& [mp, slice, request] : asked) {
        Model& m = *mp;
        auto& flag = m.registered[slice];
        uint8_t next = Model::kNever;
        bool registered = false;
        if (request != SIZE_MAX && requests[request].result == CUDA_SUCCESS) {
            pinned_bytes_.fetch_add(requests[request].bytes);
            next = Model::kInside;
            registered = true;
            ++fill_gen_;  // a pool may fill from it now
        } else if (request != SIZE_MAX && requests[request].result == CUDA_ERROR_NOT_READY) {
            next = Model::kNone;  // copies under way held it back: asked again when next wanted
        } else if (request != SIZE_MAX && requests[request].result != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
            register_failed_.store(true);
        } else if (follow_locks_.load()) {
            next = Model::kNone;  // over the budget now; a later lock may fit
        }
        // An Unlock, or the expert entering the pool, may have let the slice go while it was being
        // registered (unregister_slice saw kAsked and had nothing to undo): then this undoes it. No
        // copy read the pages directly yet: copies do so only once the flag says kInside.
        uint8_t was = Model::kAsked;
        if (!flag.compare_exchange_strong(was, next, std::memory_order_acq_rel) && registered &&
            registrations().remove(drv, requests[request].p) == CUDA_SUCCESS)
            pinned_bytes_.fetch_sub(requests[request].bytes);
    }
    return false;
}

// What the registered tier may hold: MOECACHE_CUDA_PIN_BUDGET, else half of what this process may
// hold (pinned pages must be resident, and a runtime in a memory cgroup may hold less than the
// machine has).
uint64_t Engine::pin_budget() const {
    if (cfg_.pin_budget != 0) return cfg_.pin_budget;
    uint64_t may_hold = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    if (const auto cg = own_memory_cgroup_limit()) may_hold = std::min(may_hold, cg->limit);
    return may_hold / 2;
}

// Whether the budget holds every expert of the models mapped (ahead_), decided each time the models
// change, before anything else looks at it: a daemon's policy that comes first must not find it
// undecided (with a warm daemon it did, and its locks were followed on a model RAM held whole).
void Engine::decide_ahead() {
    if (ahead_models_ == models_.size()) return;
    ahead_models_ = models_.size();
    uint64_t all = 0;
    for (const Model* m : models_)
        for (const auto& l : m->map.layers)
            for (const auto& t : l.tensors) all += t.bytes_per_expert * m->map.n_experts;
    const uint64_t budget = pin_budget();
    ahead_.store(!models_.empty() && all <= budget);
    ahead_model_ = 0;
    ahead_run_ = 0;
    if (cfg_.log && ahead_.load())
        say("registering the %.2f GiB of expert tensors for DMA, in the background (budget %.2f GiB)",
            static_cast<double>(all) / 1073741824.0, static_cast<double>(budget) / 1073741824.0);
}

// A model's expert tensors in runs of neighbours: tensors (model-local: slice / n_experts) in file
// order whose bytes are no more than a page apart, in one file.
void Engine::build_runs(Model& m) {
    if (m.runs_built) return;
    m.runs_built = true;
    const uint32_t n = std::max<uint32_t>(m.map.n_experts, 1);
    std::vector<uint32_t> order(m.n_slices / n);
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    auto tensor_of = [&](uint32_t i) -> const ExpertTensor& {
        const uint32_t slice = i * n;
        const auto ls = static_cast<size_t>(std::upper_bound(m.slice_base.begin(), m.slice_base.end(), slice) - m.slice_base.begin() - 1);
        return m.map.layers[ls].tensors[(slice - m.slice_base[ls]) / n];
    };
    std::sort(order.begin(), order.end(), [&](uint32_t x, uint32_t y) {
        const auto &a = tensor_of(x), &b = tensor_of(y);
        return a.file != b.file ? a.file < b.file : a.offset < b.offset;
    });
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    m.run_of_tensor.assign(order.size(), 0);
    uint32_t file = UINT32_MAX;
    for (uint32_t i : order) {
        const auto& t = tensor_of(i);
        const uint64_t end = t.offset + t.bytes_per_expert * n;
        if (m.runs.empty() || t.file != file || t.offset > m.runs.back().end + page) m.runs.push_back(TensorRun{{}, t.offset, end});
        file = t.file;
        auto& r = m.runs.back();
        r.tensors.push_back(i);
        r.end = std::max(r.end, end);
        m.run_of_tensor[i] = static_cast<uint32_t>(m.runs.size() - 1);
    }
}

// One run of expert tensors, registered whole once: from the first page boundary past its first
// byte to a page past its end (see register_wanted). Slices wholly inside are copied straight from
// it; a first slice that starts before it has its inside copied so (kInside).
void Engine::register_run(Model& m, size_t run, uint64_t budget) {
    if (run >= m.runs.size() || m.runs[run].done) return;
    auto& r = m.runs[run];
    r.done = true;
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint32_t n = m.map.n_experts;
    const auto [first_start, unused] = slice_span(m, r.tensors.front() * n);  // the run's first tensor in file order
    uintptr_t a = 0, b = 0;
    for (const auto& mr : mapped_) {
        if (mr.model != m.id || first_start == 0 || first_start < mr.mapping.start || first_start >= mr.mapping.end) continue;
        if (!mr.mapping.covers(r.start, r.end - r.start)) break;  // the run runs past the mapping
        a = (first_start + page) & ~(page - 1);
        b = std::min<uintptr_t>(((mr.mapping.address_of(r.end) + page - 1) & ~(page - 1)) + page, mr.mapping.end);
        break;
    }
    if (a != 0 && b > a && !resident(reinterpret_cast<const uint8_t*>(a), b - a)) {
        // Not all cached (a model lazily loaded beside moecached, whose reads and locks decide what
        // RAM holds): registering would read the rest a page at a time inside the driver, holding
        // up the runtime's own calls (a cold model took 130 s to load so). A later pass tries again;
        // meanwhile its misses not in the page cache are read from the file (copy_from_host).
        r.done = false;
        return;
    }
    bool ok = false;
    if (a != 0 && b > a && pinned_bytes_.load() + (b - a) <= budget) {
        std::vector<Registrations::Request> one{{reinterpret_cast<void*>(a), b - a}};
        registrations().add(driver(), one, CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_PORTABLE);
        if (one[0].result == CUDA_ERROR_NOT_READY) {
            r.done = false;  // copies under way held it back: the next turn tries again
            return;
        }
        ok = one[0].result == CUDA_SUCCESS;
        if (!ok && one[0].result != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) register_failed_.store(true);
        if (ok) {
            pinned_bytes_.fetch_add(b - a);
            ahead_ranges_.emplace_back(reinterpret_cast<void*>(a), b - a);
            ++fill_gen_;  // a fill waiting for these pages can go now
        }
    }
    for (uint32_t tensor : r.tensors)
        for (uint32_t e = 0; e < n; ++e) {
            const uint32_t slice = tensor * n + e;
            if (m.registered[slice].load() == Model::kInside) continue;  // registered on its own (a lock)
            const auto [start, end] = slice_span(m, slice);
            const auto [lo, hi] = slice_pages(m, slice);
            uint8_t state = Model::kNever;
            if (ok && start >= a && end <= b) state = Model::kWhole;
            else if (ok && lo >= a && hi <= b && hi > lo) state = Model::kInside;
            m.registered[slice].store(state, std::memory_order_release);
        }
}

// Where the slice's bytes lie in this process ({0, 0}: not mapped).
std::pair<uintptr_t, uintptr_t> Engine::slice_span(const Model& m, uint32_t slice) const {
    const auto ls = static_cast<size_t>(std::upper_bound(m.slice_base.begin(), m.slice_base.end(), slice) - m.slice_base.begin() - 1);
    const uint32_t within = slice - m.slice_base[ls];
    const auto& t = m.map.layers[ls].tensors[within / m.map.n_experts];
    const uint64_t off = t.offset + uint64_t{within % m.map.n_experts} * t.bytes_per_expert;
    for (const auto& r : mapped_) {
        if (r.model != m.id || r.file != t.file || off < r.mapping.file_offset ||
            off + t.bytes_per_expert > r.mapping.file_offset + (r.mapping.end - r.mapping.start))
            continue;
        return {r.mapping.address_of(off), r.mapping.address_of(off + t.bytes_per_expert)};
    }
    return {0, 0};
}

// The daemon came: what was registered ahead is let go (its locks choose from now on).
void Engine::unregister_ahead() {
    if (ahead_ranges_.empty()) return;
    const Driver* drv = driver();
    for (Model* m : models_) {
        for (auto& r : m->runs) r.done = false;
        for (uint32_t slice = 0; slice < m->n_slices; ++slice) {
            uint8_t whole = Model::kWhole;
            if (!m->registered[slice].compare_exchange_strong(whole, Model::kNone)) {
                uint8_t never = Model::kNever;
                (void)m->registered[slice].compare_exchange_strong(never, Model::kNone);
            }
        }
    }
    int device = -1;
    for (int d = 0; d < kMaxDevices && device < 0; ++d)
        if (pools_[d].load() != nullptr) device = d;
    DeviceContext ctx(drv, std::max(device, 0));
    capture_gate().exclusive([&] {
        sync_pool_devices();
        for (const auto& [p, bytes] : ahead_ranges_)
            if (registrations().remove(drv, p) == CUDA_SUCCESS) pinned_bytes_.fetch_sub(bytes);
    });
    ahead_ranges_.clear();
    ahead_model_ = 0;
    ahead_run_ = 0;
}

// A slice that starts on a page boundary keeps its first page out: a registration never starts
// where a copy may start.
std::pair<uintptr_t, uintptr_t> Engine::slice_pages(const Model& m, uint32_t slice) const {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const auto [start, end] = slice_span(m, slice);
    if (start == 0) return {0, 0};
    return {(start + page) & ~(page - 1), end & ~(page - 1)};
}

// The daemon let the expert go from RAM: its pages are no longer held for DMA. What the device may
// still read from them is finished first.
void Engine::unregister_slice(Model& m, uint32_t slice) {
    auto& flag = m.registered[slice];
    uint8_t state = flag.load();
    do {
        if (state == Model::kWhole) return;  // its tensor's registration goes as a whole (unregister_ahead)
    } while (!flag.compare_exchange_weak(state, Model::kNone));
    if (state != Model::kInside) return;
    const auto [a, b] = slice_pages(m, slice);
    if (b > a) unregistering_.emplace_back(a, b - a);
}

// The slices let go since the last flush: every device that may copy from them finishes what it
// queued (one synchronisation for all of them, never while a runtime captures a graph), then their
// pages are unregistered.
void Engine::flush_unregisters() {
    if (unregistering_.empty()) return;
    const Driver* drv = driver();
    if (drv == nullptr) return;
    int device = -1;
    for (int d = 0; d < kMaxDevices && device < 0; ++d)
        if (pools_[d].load() != nullptr) device = d;
    DeviceContext ctx(drv, std::max(device, 0));
    capture_gate().exclusive([&] {
        sync_pool_devices();
        for (const auto& [a, bytes] : unregistering_)
            if (registrations().remove(drv, reinterpret_cast<void*>(a)) == CUDA_SUCCESS) pinned_bytes_.fetch_sub(bytes);
    });
    unregistering_.clear();
}

// Every device with a pool has finished what was queued on it (the capture gate held).
void Engine::sync_pool_devices() {
    const Driver* drv = driver();
    for (int d = 0; d < kMaxDevices; ++d)
        if (pools_[d].load() != nullptr) {
            DeviceContext on(drv, d);
            (void)drv->ctx_synchronize();
        }
}

// How copies that miss the pool reach the device: from the registered model (PIN=all), through
// pinned staging, or as the runtime asked. For auto the hook measures both on the model's own
// bytes and keeps staging only where it is faster by a clear margin.
// The device's link from pinned host memory, and one thread's memcpy from it, in GB/s (0: could
// not measure): a few copies of kLinkProbeBytes, the best of them. Misses cross the link on every
// decoding layer's path, where the CPU's own math would read host memory instead.
std::pair<double, double> Engine::measure_link(const Driver* drv) {
    constexpr size_t kLinkProbeBytes = 16 << 20;
    void* host = nullptr;
    CUdeviceptr dev = 0;
    CUstream s = nullptr;
    double best = 0, memory = 0;
    if (drv->mem_host_alloc(&host, kLinkProbeBytes, CU_MEMHOSTALLOC_PORTABLE) == CUDA_SUCCESS &&
        drv->mem_alloc(&dev, kLinkProbeBytes) == CUDA_SUCCESS && drv->stream_create(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
        memset(host, 1, kLinkProbeBytes);
        std::vector<uint8_t> into(kLinkProbeBytes);
        for (int round = 0; round < 4; ++round) {
            auto t0 = std::chrono::steady_clock::now();
            if (drv->memcpy_htod_async(dev, host, kLinkProbeBytes, s) != CUDA_SUCCESS || drv->stream_synchronize(s) != CUDA_SUCCESS)
                break;
            if (round > 0) best = std::max(best, static_cast<double>(kLinkProbeBytes) / seconds_since(t0) / 1e9);
            t0 = std::chrono::steady_clock::now();
            memcpy(into.data(), host, kLinkProbeBytes);
            asm volatile("" : : "r"(into.data()) : "memory");  // the copy is used
            if (round > 0) memory = std::max(memory, static_cast<double>(kLinkProbeBytes) / seconds_since(t0) / 1e9);
        }
    }
    if (s != nullptr) (void)drv->stream_destroy(s);
    // A free while the runtime captures a graph would spoil the capture.
    capture_gate().exclusive([&] {
        if (dev != 0) (void)drv->mem_free(dev);
        if (host != nullptr) (void)drv->mem_free_host(host);
    });
    return {best, memory};
}

void Engine::set_up_copies(DevicePool& dp) {
    const Driver* drv = driver();
    struct Done {
        DevicePool& dp;
        ~Done() { dp.copies_set_up.store(true, std::memory_order_release); }
    } done{dp};
    if (drv == nullptr || cfg_.pin == PinMode::Off) return;
    DeviceContext ctx(drv, dp.device);  // registration and pinned buffers need a current context
    if (!ctx.ok()) return;
    std::tie(dp.link_gbps, dp.memcpy_gbps) = measure_link(drv);
    if (cfg_.log)
        say("device %d: %.1f GB/s from pinned host memory (one thread's memcpy %.1f GB/s)", dp.device, dp.link_gbps,
            dp.memcpy_gbps);
    if (cfg_.pin == PinMode::All) {
        pin_models();
        if (pinned_all_) return;
    }
    if (crew_.helpers() == 0) {
        // The runtime's own threads wait while the GPU computes: every core but one copies.
        const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
        crew_.start(cfg_.staging_threads != 0 ? cfg_.staging_threads - 1 : std::min(15u, cores - 1));
    }
    auto ring = StagingRing::create(drv, &crew_, kStagingBuffer, kStagingBuffers);
    if (ring == nullptr) {
        say("device %d: no pinned staging buffers (%zu MiB): misses are copied as the runtime asks", dp.device,
            kStagingBuffer * kStagingBuffers >> 20);
        return;
    }
    bool use = cfg_.pin == PinMode::Staging || cfg_.pin == PinMode::All || cfg_.pin == PinMode::Register;  // auto: measured
    if (cfg_.pin == PinMode::Auto) {
        // The largest expert tensor, read as a runtime's miss would read it, through a mapping of
        // the hook's own (the runtime's would keep the pages mapped: one place drops them).
        const ExpertTensor* largest = nullptr;
        const Model* owner = nullptr;
        for (const Model* m : models_)
            for (const auto& l : m->map.layers)
                for (const auto& t : l.tensors)
                    if (largest == nullptr || t.bytes_per_expert * m->map.n_experts >
                                                  largest->bytes_per_expert * owner->map.n_experts) {
                        largest = &t;
                        owner = m;
                    }
        const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
        const uint64_t lo = largest != nullptr ? largest->offset & ~(page - 1) : 0;
        const size_t n = largest != nullptr ? std::min<uint64_t>(largest->bytes_per_expert * owner->map.n_experts, kProbeBytes) : 0;
        void* view = MAP_FAILED;
        UniqueFd fd;
        if (n >= kStagingBuffer) {
            fd = UniqueFd(::open(owner->map.files[largest->file].path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
            if (fd) view = mmap(nullptr, n + (largest->offset - lo), PROT_READ, MAP_SHARED, fd.get(), static_cast<off_t>(lo));
            // As lazy load maps a model: no read-around. Read-around would also fill the page cache
            // with large folios across expert edges, which cannot leave RAM one expert at a time
            // (fadvise drops only folios wholly inside the range it is given).
            if (view != MAP_FAILED) (void)madvise(view, n + (largest->offset - lo), MADV_RANDOM);
        }
        const uint8_t* src = view == MAP_FAILED ? nullptr : static_cast<const uint8_t*>(view) + (largest->offset - lo);
        CUdeviceptr scratch = 0;
        CUstream s = nullptr;
        if (src == nullptr || drv->mem_alloc(&scratch, n) != CUDA_SUCCESS ||
            drv->stream_create(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
            use = true;  // nothing to measure on: staging, which is never much slower
        } else {
            double direct = 1e9, staged = 1e9;
            uint64_t ignored = 0;
            for (int round = 0; round < 3; ++round) {
                auto t0 = std::chrono::steady_clock::now();
                if (drv->memcpy_htod_async(scratch, src, n, s) == CUDA_SUCCESS && drv->stream_synchronize(s) == CUDA_SUCCESS)
                    direct = std::min(direct, seconds_since(t0));
                t0 = std::chrono::steady_clock::now();
                if (ring->copy(scratch, HostBytes{src, fd.get(), largest->offset}, n, s, &ignored) == CUDA_SUCCESS && drv->stream_synchronize(s) == CUDA_SUCCESS)
                    staged = std::min(staged, seconds_since(t0));
            }
            use = staged * 1.15 < direct;
            if (cfg_.log || !use)
                say("device %d: misses %s: pinned staging %.1f GB/s (%u threads), as the runtime asks %.1f GB/s", dp.device,
                    use ? "go through pinned staging" : "in the page cache are copied as the runtime asks", static_cast<double>(n) / staged / 1e9,
                    crew_.helpers() + 1, static_cast<double>(n) / direct / 1e9);
        }
        if (view != MAP_FAILED) munmap(view, n + (largest->offset - lo));
        if (s != nullptr) (void)drv->stream_destroy(s);
        if (scratch != 0) (void)drv->mem_free(scratch);
    }
    // Kept either way: misses whose pages are not in the page cache are read from the file through
    // it (copy_from_host), which beats faulting them in through the mapping wherever staging loses.
    dp.staging = std::move(ring);
    dp.staged.store(use, std::memory_order_release);
}

}  // namespace moecache::cuda::hook
