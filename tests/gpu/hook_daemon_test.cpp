// The one-place rule end to end, with the real moecached (a separate process) and the CUDA hook in
// this process over tests' fake libcuda.so.1 (label root: the daemon mlocks). The daemon grants a
// VRAM pool of one expert. The hot expert the pool holds leaves RAM: the hook unmaps it here, the
// daemon does not lock it and drops its pages. Another hot expert, copied from the host each time,
// is locked in RAM. When the second grows hotter and takes the pool, the first comes back to RAM
// (read on use and locked) and the second leaves it.
#include "model_fixture.h"
#include "preload_main.h"
#include "moecache/client.h"
#include "moecache/cuda_hook.h"
#include "moecache/model.h"
#include "moecache/page_cache.h"
#include "run.h"
#include "temp_dir.h"

#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <regex>
#include <thread>

#undef cuGetProcAddress

namespace moecache::test {
namespace {

using GetProc = CUresult(CUDAAPI*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

// What may stay cached of an expert that left RAM: pages in folios shared with a neighbour.
constexpr double kLeft = 0.25;

class HookDaemon : public ::testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: moecached mlocks";
        stats_get_ = reinterpret_cast<decltype(stats_get_)>(dlsym(RTLD_DEFAULT, "moecache_cuda_stats_get"));
        ASSERT_NE(stats_get_, nullptr) << "libmoecache-cuda.so is not preloaded";
        void* lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib == nullptr || dlsym(lib, "fake_cuda_counts") == nullptr)
            GTEST_SKIP() << "runs over tests' fake libcuda.so.1 (the GPU tests cover the real driver)";
        auto get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
        auto get = [&](auto& fn, const char* name) {
            void* p = nullptr;
            ASSERT_EQ(get_proc(name, &p, 12000, 0, nullptr), CUDA_SUCCESS) << name;
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
        };
        get(init_, "cuInit");
        get(alloc_, "cuMemAlloc");
        get(htod_async_, "cuMemcpyHtoDAsync");
        get(dtoh_, "cuMemcpyDtoH");
        get(ctx_sync_, "cuCtxSynchronize");
        CUresult(CUDAAPI * retain)(CUcontext*, CUdevice) = nullptr;
        CUresult(CUDAAPI * set_current)(CUcontext) = nullptr;
        get(retain, "cuDevicePrimaryCtxRetain");
        get(set_current, "cuCtxSetCurrent");
        ASSERT_EQ(init_(0), CUDA_SUCCESS);
        CUcontext ctx = nullptr;
        ASSERT_EQ(retain(&ctx, 0), CUDA_SUCCESS);
        ASSERT_EQ(set_current(ctx), CUDA_SUCCESS);

        auto spec = small_spec();
        spec.n_experts = 16;
        spec.n_ff_exp = 256;
        spec.n_embd = 256;
        model_ = dir_.file("model.gguf");
        write_model(spec, model_, 1, 4096);
        auto parts = open_gguf_model(model_);
        ASSERT_TRUE(parts);
        auto map = ExpertMap::build(*parts);
        ASSERT_TRUE(map);
        map_ = std::move(*map);
        slice_ = map_.layers[0].tensors[0].bytes_per_expert;
        for (const auto& t : map_.layers[0].tensors) ASSERT_EQ(t.bytes_per_expert, slice_) << "one slot size";
        // A pool of exactly one expert of layer 0 (its three slices, each slot with the 512 bytes
        // of the next slice's head the hook keeps after it).
        write_file(dir_.file("moecached.toml"),
                   "[daemon]\nstate_dir = \"" + dir_.file("state") + "\"\nsocket = \"" + dir_.file("moecached.sock") +
                       "\"\ntick_seconds = 0.05\nlog_level = \"debug\"\n[budget]\nlock = \"" + lock_budget() + "\"\nreserve = \"1GiB\"\n[pressure]\nenabled = false\n"
                       "[telemetry]\npage_cache = \"off\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n[dbus]\nbus = \"off\"\n[policy]\nadmit_after_uses = 1\nelite_share = " + elite_share() +
                       "\n[vram]\npool = " +
                       std::to_string(pool_experts() * 3 * (slice_ + 512)) + "\nkeep_ram_copy = " + (keep_both() ? "true" : "false") +
                       "\ndirected = " + directed() + "\nfill_from_files = " + (fill_from_files() ? "true" : "false") + "\n");
        // The daemon runs without the hook or the fake driver.
        const std::string preload = getenv("LD_PRELOAD"), libpath = getenv("LD_LIBRARY_PATH");
        unsetenv("LD_PRELOAD");
        unsetenv("LD_LIBRARY_PATH");
        daemon_ = std::make_unique<Background>(std::vector<std::string>{MOECACHE_DAEMON_BIN, "--config", dir_.file("moecached.toml")});
        setenv("LD_PRELOAD", preload.c_str(), 1);
        setenv("LD_LIBRARY_PATH", libpath.c_str(), 1);
        ASSERT_TRUE(daemon_->wait_for("moecached running", 20)) << daemon_->output();
        setenv("MOECACHE_SOCKET", dir_.file("moecached.sock").c_str(), 1);

        // The page cache keeps a file in folios, and a folio that also holds a neighbour someone maps
        // cannot leave: start cold and read page by page, so that each expert's pages are its own.
        const int fd = open(model_.c_str(), O_RDONLY | O_CLOEXEC);
        size_ = static_cast<size_t>(lseek(fd, 0, SEEK_END));
        ASSERT_EQ(fdatasync(fd), 0);
        base_ = static_cast<uint8_t*>(mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0));
        ASSERT_NE(base_, MAP_FAILED);
        // The writes left large folios; a busy machine can hold one back from a drop (another
        // CPU's batch, writeback just ending): drop until none is left.
        const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
        std::vector<unsigned char> vec((size_ + ps - 1) / ps);
        uint64_t left = 0;
        for (int i = 0; i < 100; ++i) {
            ASSERT_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
            ASSERT_EQ(mincore(base_, size_, vec.data()), 0);
            left = 0;
            for (auto b : vec) left += b & 1;
            if (left == 0) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        ASSERT_EQ(left, 0u) << "pages of the model still cached after dropping it";
        close(fd);
        ASSERT_EQ(madvise(base_, size_, MADV_RANDOM), 0);
        for (size_t t = 0; t < 3; ++t) ASSERT_EQ(alloc_(&dst_[t], slice_ * map_.n_experts + 512), CUDA_SUCCESS);
    }
    [[nodiscard]] virtual bool keep_both() const { return false; }
    // Below the model's 13 MB of experts: one place is for RAM that cannot lock every expert.
    [[nodiscard]] virtual std::string lock_budget() const { return "8MiB"; }
    [[nodiscard]] virtual uint64_t pool_experts() const { return 1; }
    // The daemon directs the pool: under one place the hook displaces only what it promoted.
    [[nodiscard]] virtual std::string directed() const { return "1"; }
    [[nodiscard]] virtual std::string elite_share() const { return "0"; }
    [[nodiscard]] virtual bool fill_from_files() const { return false; }
    void TearDown() override {
        if (base_ != nullptr && base_ != MAP_FAILED) munmap(base_, size_);
        if (daemon_) {
            daemon_->signal(SIGTERM);
            daemon_->wait(20);
        }
    }
    // Copies expert e of layer 0 (its three slices, with llama.cpp's padding) `times` times.
    void use(uint32_t e, int times) {
        for (int i = 0; i < times; ++i)
            for (size_t t = 0; t < 3; ++t) {
                const uint64_t off = e * slice_;
                ASSERT_EQ(htod_async_(dst_[t] + off, base_ + map_.layers[0].tensors[t].offset + off, slice_ + 512, nullptr),
                          CUDA_SUCCESS);
            }
    }
    // Share of the expert's whole pages in the page cache (mincore reports the page cache, mapped or not).
    double cached(uint32_t e) {
        const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
        uint64_t in = 0, all = 0;
        for (const auto& r : map_.ranges(map_.layers[0].index, e)) {
            const uint64_t first = (r.offset + ps - 1) / ps, last = (r.offset + r.length) / ps;
            std::vector<unsigned char> v(last - first);
            if (last <= first || mincore(base_ + first * ps, (last - first) * ps, v.data()) != 0) continue;
            for (auto b : v) in += b & 1;
            all += v.size();
        }
        return all ? static_cast<double>(in) / static_cast<double>(all) : -1;
    }
    // How many of the expert's whole pages this process maps right now.
    int mapped_here(uint32_t e) {
        const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
        const int pm = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        int n = 0;
        for (const auto& r : map_.ranges(map_.layers[0].index, e))
            for (uint64_t pg = (r.offset + ps - 1) / ps; pg < (r.offset + r.length) / ps; ++pg) {
                uint64_t v = 0;
                if (pread(pm, &v, 8, static_cast<off_t>((reinterpret_cast<uintptr_t>(base_) / ps + pg) * 8)) == 8)
                    n += static_cast<int>((v >> 63) & 1);
            }
        close(pm);
        return n;
    }
    // The expert's pages in the page cache, one character each: '#' cached, '.' not.
    std::string pages(uint32_t e) {
        const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
        std::string out;
        for (const auto& r : map_.ranges(map_.layers[0].index, e)) {
            const uint64_t first = (r.offset + ps - 1) / ps, last = (r.offset + r.length) / ps;
            std::vector<unsigned char> v(last - first);
            if (last > first && mincore(base_ + first * ps, (last - first) * ps, v.data()) == 0)
                for (auto b : v) out += (b & 1) ? '#' : '.';
            out += ' ';
        }
        return out;
    }
    // The page-cache folios of the expert's first and last whole page of each slice ("first+pages").
    std::string folios(uint32_t e) {
        const uint64_t ps = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
        std::string out;
        for (const auto& r : map_.ranges(map_.layers[0].index, e))
            for (uint64_t pg : {(r.offset + ps - 1) / ps, (r.offset + r.length) / ps - 1}) {
                const auto f = folio_of(base_, size_, pg);
                out += f ? std::to_string(f->pages) + "@" + std::to_string(static_cast<int64_t>(f->first) - static_cast<int64_t>(pg)) + " " : "- ";
            }
        return out;
    }
    // A (hot) takes the one-expert pool, B is copied from the host: both stay in RAM, A as well,
    // for as long as decoding goes on, and the hook pages out none of its mapping.
    void expect_both_copies_stay() {
        constexpr uint32_t kA = 3, kB = 9;
        use(kA, 1);
        ASSERT_GE(sync(10000), 1);
        ASSERT_TRUE(until([&] { return stats().experts_in_vram == 1 && stats().pool_bytes == 3 * (slice_ + 512); }, kA, 4, kB, 2))
            << log();
        ASSERT_TRUE(until([&] { return cached(kA) == 1.0 && cached(kB) == 1.0; }, kA, 4, kB, 2)) << log();
        for (int i = 0; i < 10; ++i) until([] { return true; }, kA, 4, kB, 2);
        EXPECT_EQ(cached(kA), 1.0);
        EXPECT_EQ(stats().dropped_host_bytes, 0u) << log();
        EXPECT_GT(stats().slice_hits, 0u);
    }
    std::string log() {
        daemon_->wait_for("\x01", 0.2);  // reads what it wrote so far
        return daemon_->output();
    }
    moecache_cuda_stats stats() {
        moecache_cuda_stats s{};
        stats_get_(&s);
        return s;
    }
    // The hook's moecache_cuda_sync: rescans and waits for its pools; the number of models found.
    static int sync(int timeout_ms) {
        static const auto fn = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "moecache_cuda_sync"));
        return fn != nullptr ? fn(timeout_ms) : 0;
    }
    // Keeps using the experts (as decoding would) until `done` holds or 15 s pass.
    bool until(const std::function<bool()>& done, uint32_t hot, int hot_times, uint32_t warm, int warm_times) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
        while (std::chrono::steady_clock::now() < end) {
            use(hot, hot_times);
            use(warm, warm_times);
            if (done()) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return false;
    }

    TempDir dir_;
    std::unique_ptr<Background> daemon_;
    std::string model_;
    ExpertMap map_;
    uint64_t slice_ = 0;
    uint8_t* base_ = nullptr;
    size_t size_ = 0;
    CUdeviceptr dst_[3] = {};
    void (*stats_get_)(moecache_cuda_stats*) = nullptr;
    CUresult(CUDAAPI* init_)(unsigned) = nullptr;
    CUresult(CUDAAPI* alloc_)(CUdeviceptr*, size_t) = nullptr;
    CUresult(CUDAAPI* htod_async_)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
    CUresult(CUDAAPI* dtoh_)(void*, CUdeviceptr, size_t) = nullptr;
    CUresult(CUDAAPI* ctx_sync_)() = nullptr;
};

TEST_F(HookDaemon, AnExpertInVramLeavesRamAndComesBackWhenDemoted) {
    constexpr uint32_t kA = 3, kB = 9;
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    // A is hotter than B: the pool (one expert) holds A; B is copied from the host and locked.
    ASSERT_TRUE(until([&] { return stats().experts_in_vram == 1 && stats().pool_bytes == 3 * (slice_ + 512); }, kA, 4, kB, 2))
        << "pool " << stats().pool_bytes << " bytes, " << stats().experts_in_vram << " experts in VRAM\n"
        << log();
    // The page cache holds a file in folios; a page that shares one with a neighbour some process
    // maps cannot leave alone. So: most of the expert leaves RAM (without one place all of it stays:
    // see HookDaemonKeepBoth), the expert from the host stays whole.
    ASSERT_TRUE(until([&] { return cached(kA) <= kLeft && cached(kB) == 1.0; }, kA, 4, kB, 2))
        << "A (in VRAM) cached " << cached(kA) << " (mapped here: " << mapped_here(kA) << " pages), B (from the host) cached "
        << cached(kB) << ", unmapped here "
        << stats().dropped_host_bytes << " bytes\n"
        << log();
    EXPECT_GT(stats().dropped_host_bytes, 0u);
    // B grows hotter and takes the pool: A leaves VRAM, is read on use and locked again; B leaves RAM.
    ASSERT_TRUE(until([&] { return cached(kA) == 1.0 && cached(kB) <= kLeft; }, kB, 12, kA, 1))
        << "A cached " << cached(kA) << ", B cached " << cached(kB) << " (mapped here: " << mapped_here(kB)
        << " pages; " << pages(kB) << "), in VRAM " << stats().experts_in_vram << "\n"
        << log();
    // The pool's counters reach the daemon's metrics, per device.
    std::smatch port;
    const std::string out = log();
    ASSERT_TRUE(std::regex_search(out, port, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) << out;
    const auto hook = stats();
    std::string metrics;
    const std::regex hits("moecache_vram_pool_hits_total\\{device=\"0\"\\} (\\d+)");
    std::smatch m;
    for (int i = 0; i < 60; ++i) {
        httplib::Client c("127.0.0.1", std::stoi(port[1]));
        auto r = c.Get("/metrics");
        if (r && r->status == 200) metrics = r->body;
        // The hook reports every 2 s (and when its pool grows): wait for a report after `hook`.
        if (std::regex_search(metrics, m, hits) && std::stoull(m[1]) >= std::max<uint64_t>(hook.slice_hits / 2, 1)) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(std::regex_search(metrics, m, hits)) << metrics;
    EXPECT_GT(std::stoull(m[1]), 0u);
    EXPECT_LE(std::stoull(m[1]), stats().slice_hits) << "the daemon counts no more than the hook served";
    EXPECT_GE(std::stoull(m[1]), hook.slice_hits / 2) << "reported every 2 s";
    EXPECT_NE(metrics.find("moecache_vram_pool_bytes{device=\"0\"} " + std::to_string(3 * (slice_ + 512)) + "\n"), std::string::npos) << metrics;
}

// One device and a daemon: the pool is made and sized for every expert at the runtime's first copy
// of the model's other weights (while it loads), before any expert copy, so that the daemon can
// direct it and the hook fill it ahead of the first prompt.
TEST_F(HookDaemon, ThePoolIsSizedForEveryExpertWhenTheModelLoads) {
    uint64_t first_expert = UINT64_MAX;
    for (const auto& l : map_.layers)
        for (const auto& t : l.tensors) first_expert = std::min(first_expert, t.offset);
    ASSERT_GT(first_expert, 8192u) << "the generated model has other weights before its experts";
    CUdeviceptr other = 0;
    ASSERT_EQ(alloc_(&other, 4096), CUDA_SUCCESS);
    const uint8_t* weights = base_ + (first_expert - 4096) / 4096 * 4096;
    const uint64_t pool = 3 * (slice_ + 512);  // [vram] pool: one expert
    for (int i = 0; i < 100 && stats().pool_bytes != pool; ++i) {
        ASSERT_EQ(htod_async_(other, weights, 4096, nullptr), CUDA_SUCCESS);
        (void)sync(200);
    }
    EXPECT_EQ(stats().pool_bytes, pool) << log();
    EXPECT_EQ(stats().expert_copies, 0u);
}

// With [vram] keep_ram_copy the expert in VRAM keeps its RAM copy: the hook leaves its mapping alone
// and the daemon locks it like any hot expert.
class HookDaemonKeepBoth : public HookDaemon {
    [[nodiscard]] bool keep_both() const override { return true; }
};

TEST_F(HookDaemonKeepBoth, AnExpertInVramKeepsItsRamCopy) {
    expect_both_copies_stay();
}

// One place is for RAM that cannot keep every expert locked anyway: with a lock budget that holds
// the whole model, the daemon tells the hook so (its VramPolicy), and the expert in VRAM keeps its
// RAM copy as with [vram] keep_ram_copy, while the pool admits by its own counts.
class HookDaemonRoomy : public HookDaemon {
    [[nodiscard]] std::string lock_budget() const override { return "64MiB"; }
};

TEST_F(HookDaemonRoomy, WhereTheLockCapHoldsTheModelAnExpertInVramKeepsItsRamCopy) {
    expect_both_copies_stay();
    if (HasFatalFailure()) return;
    EXPECT_NE(log().find("keep their RAM copy: the lock cap holds every expert"), std::string::npos) << log();
}

// A routing that shifts: the daemon's heat sees it (here another runtime's routing of the model
// moves to other experts) and tells every pool of the model; the hook cuts its own use counts, so
// that an expert used a few times now takes the slot of one used a hundred times before the shift.
// Without the cut the old counts hold the slot for the ~1000 tokens they take to halve.
class HookDaemonShift : public HookDaemon {
    [[nodiscard]] bool keep_both() const override { return true; }
    [[nodiscard]] std::string directed() const override { return "0"; }  // the hook's own counts rank
};

TEST_F(HookDaemonShift, AShiftTheDaemonSeesCutsThePoolsCounts) {
    constexpr uint32_t kA = 3, kB = 9;
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    // The daemon's budget applied: a pool of one expert, which A holds, used a hundred times.
    ASSERT_TRUE(
        until([&] { return stats().experts_in_vram == 1 && stats().pool_bytes == 3 * (slice_ + 512); }, kA, 1, kA, 0))
        << log();
    use(kA, 100);
    auto b_is_a_hit = [&] {
        const uint64_t before = stats().slice_hits;
        use(kB, 1);
        return stats().slice_hits >= before + 3;
    };
    use(kB, 3);
    ASSERT_FALSE(b_is_a_hit()) << "three uses displaced one hundred before any shift";
    const uint64_t directives = stats().directives;

    moecache_client* other = moecache_client_open(dir_.file("moecached.sock").c_str(), "other-runtime");
    ASSERT_NE(other, nullptr);
    uint32_t h = 0;
    ASSERT_EQ(moecache_client_register_model(other, model_.c_str(), &h), 0);
    ASSERT_EQ(moecache_client_wait_ready(other, 10000), 1);
    // Past the detector's first 4096 routings on one routing, then another (paced within the ring).
    const uint32_t block = map_.layers[0].index;
    for (int t = 0; t < 4800; ++t) {
        const uint32_t e[2] = {t < 4200 ? 0u + t % 2 : 12u + t % 2, t < 4200 ? 5u : 14u};
        (void)moecache_client_report(other, h, block, e, 2, 1);
        if (t % 32 == 31) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (stats().directives == directives && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_GT(stats().directives, directives) << "no shift told\n" << log();
    EXPECT_NE(log().find("its routing shifted"), std::string::npos) << log();
    use(kB, 20);  // above a hundredth of A's count however long its setup took
    EXPECT_TRUE(b_is_a_hit()) << "the pool still ranks by the counts learnt before the shift";
    moecache_client_close(other);
}

// ... and misses come at DMA speed in one piece each: the hook registers every run of expert
// tensors whole, as it does without a daemon when its budget holds the model, rather than each
// expert the daemon locks on its own (whose edge pages then went as the runtime asked: three
// copies a miss, and a fresh registration at every lock). On the GPU machine the model in RAM with
// a daemon-directed pool decoded at 0.95-1.10x -ot exps=CPU, the hook alone at 1.32x.
TEST_F(HookDaemonRoomy, WhereTheLockCapHoldsTheModelEveryRunOfExpertsIsRegisteredWhole) {
    struct Counts {
        unsigned long long htod_calls, htod_bytes, dtod_calls, dtod_bytes, allocs, frees, syncs, event_waits, registered;
    };
    const auto* counts = static_cast<const Counts*>(dlsym(dlopen("libcuda.so.1", RTLD_NOW), "fake_cuda_counts"));
    ASSERT_NE(counts, nullptr);
    // The model in RAM, as llama.cpp's load reads it (runs are registered once their pages are cached).
    std::vector<uint8_t> buf(1 << 20);
    const int fd = open(model_.c_str(), O_RDONLY | O_CLOEXEC);
    while (read(fd, buf.data(), buf.size()) > 0) {
    }
    close(fd);
    constexpr uint32_t kA = 3, kB = 9;
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    ASSERT_TRUE(until([&] { return stats().pinned_bytes >= map_.expert_bytes_total * 99 / 100; }, kA, 4, kB, 2))
        << "registered " << stats().pinned_bytes << " of " << map_.expert_bytes_total << " expert bytes\n" << log();
    EXPECT_LE(counts->registered, map_.layers.size()) << "one registration a run of a layer's expert tensors";
    for (int i = 0; i < 10; ++i) until([] { return true; }, kA, 4, kB, 2);
    EXPECT_LE(counts->registered, map_.layers.size()) << "the daemon's locks register nothing more";
    EXPECT_EQ(stats().fallbacks, 0u);
}

// The daemon's view wins: another client's router says C and D are the hot experts of layer 0, so
// the daemon (elite: 2 of 16 per layer) promotes them to the hook, whose pool (one expert) then
// holds C although this process uses A more.
class HookDaemonElite : public HookDaemon {
    [[nodiscard]] std::string elite_share() const override { return "0.125"; }
};

TEST_F(HookDaemonElite, ThePoolKeepsWhatTheDaemonPromotes) {
    // C and D are not neighbours: a page-cache folio across C's edge that D (locked) shares
    // would stay, rightly (read-ahead on this kernel builds 64 KiB folios, and slices are 68 KiB).
    constexpr uint32_t kA = 3, kC = 12, kD = 14;
    moecache_client* other = moecache_client_open(dir_.file("moecached.sock").c_str(), "other-runtime");
    ASSERT_NE(other, nullptr);
    uint32_t h = 0;
    ASSERT_EQ(moecache_client_register_model(other, model_.c_str(), &h), 0);
    ASSERT_EQ(moecache_client_wait_ready(other, 10000), 1);
    // The other runtime has a pool of its own that holds C: no client needs C in RAM (one place).
    const moecache_pool_stats pool{0, 0, 0, 0, 64u << 20};
    ASSERT_EQ(moecache_client_report_pool(other, 0, &pool), 0);
    ASSERT_EQ(moecache_client_report_placement(other, h, map_.layers[0].index, kC, 0), 0);
    auto report = [&] {
        const uint32_t hot[] = {kC, kD};
        for (int i = 0; i < 200; ++i) (void)moecache_client_report(other, h, map_.layers[0].index, hot, 2, 1);
    };
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    // Here A is used 4 times for each use of C; elsewhere C and D are used far more.
    ASSERT_TRUE(until(
        [&] {
            report();
            return stats().directives >= 2 && stats().experts_in_vram == 1 && cached(kC) <= kLeft && cached(kA) == 1.0;
        },
        kA, 4, kC, 1))
        << "directives " << stats().directives << ", in VRAM " << stats().experts_in_vram << ", A cached " << cached(kA)
        << ", C cached " << cached(kC) << " (mapped here: " << mapped_here(kC) << " pages; " << pages(kC) << "; folios " << folios(kC) << ")\n"
        << log();
    moecache_client_close(other);
}

// A runtime that starts where the daemon already knows the hot experts (a restart with the profile,
// a prompt model of the same family before it, another runtime here): the daemon directs the
// hook's pool to hold them ([vram] directed), and the hook fills its pool with them from the pages
// the daemon locks, before this process copies any of them. Their first copies are pool hits, byte
// for byte the file's.
class HookDaemonWarm : public HookDaemon {
    [[nodiscard]] uint64_t pool_experts() const override { return 4; }
    [[nodiscard]] std::string directed() const override { return "1"; }
};

TEST_F(HookDaemonWarm, ThePoolIsFilledAheadWithWhatTheDaemonDirects) {
    constexpr uint32_t kA = 3;
    const uint32_t hot[] = {5, 8, 11, 14};  // no two neighbours (folios across edges)
    moecache_client* other = moecache_client_open(dir_.file("moecached.sock").c_str(), "other-runtime");
    ASSERT_NE(other, nullptr);
    uint32_t h = 0;
    ASSERT_EQ(moecache_client_register_model(other, model_.c_str(), &h), 0);
    ASSERT_EQ(moecache_client_wait_ready(other, 10000), 1);
    // Another runtime's router says which experts are hot, and the daemon locks them, before this
    // process's hook is there: it learns of those locks when it registers the model.
    auto report = [&] {
        for (int i = 0; i < 50; ++i) (void)moecache_client_report(other, h, map_.layers[0].index, hot, 4, 1);
    };
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (!std::all_of(std::begin(hot), std::end(hot), [&](uint32_t e) { return cached(e) == 1.0; }) &&
           std::chrono::steady_clock::now() < end) {
        report();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_TRUE(std::all_of(std::begin(hot), std::end(hot), [&](uint32_t e) { return cached(e) == 1.0; })) << log();
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    // This process copies only A meanwhile.
    ASSERT_TRUE(until(
        [&] {
            report();
            return stats().filled_ahead >= 4 * 3 && stats().experts_in_vram == 4;
        },
        kA, 1, kA, 0))
        << "filled ahead " << stats().filled_ahead << " slices, in VRAM " << stats().experts_in_vram << ", directives "
        << stats().directives << ", pinned " << stats().pinned_bytes << "\n"
        << log();
    // Their first copies here: from the pool, byte for byte.
    const auto before = stats();
    for (uint32_t e : hot) use(e, 1);
    ASSERT_EQ(ctx_sync_(), CUDA_SUCCESS);
    const auto after = stats();
    EXPECT_EQ(after.slice_hits - before.slice_hits, 4u * 3u) << "every slice of the hot experts from the pool";
    EXPECT_EQ(after.slice_misses, before.slice_misses);
    for (size_t t = 0; t < 3; ++t) {
        std::vector<uint8_t> back(slice_ * map_.n_experts);
        ASSERT_EQ(dtoh_(back.data(), dst_[t], back.size()), CUDA_SUCCESS);
        for (uint32_t e : hot)
            EXPECT_EQ(memcmp(back.data() + e * slice_, base_ + map_.layers[0].tensors[t].offset + e * slice_, slice_), 0)
                << "tensor " << t << " expert " << e;
    }
    moecache_client_close(other);
}

// With [vram] fill_from_files and MOECACHE_CUDA_FILL_FROM_FILES=1, every runtime of the model has
// a pool (the prompt-model swap's decode server, alone on its model; here another runtime whose
// pool holds the hot experts already): what the daemon promotes is read once, from the file into VRAM by the hook, never into
// RAM by the daemon first (no lock, so no release to VRAM afterwards), and its first copies here are
// pool hits, byte for byte the file's.
class HookDaemonFromFiles : public HookDaemonWarm {
protected:
    void SetUp() override {
        setenv("MOECACHE_CUDA_FILL_FROM_FILES", "1", 1);  // read at the hook's first copy, after this
        HookDaemonWarm::SetUp();
    }
    [[nodiscard]] bool fill_from_files() const override { return true; }
};

TEST_F(HookDaemonFromFiles, WhatEveryPoolIsDirectedToHoldIsFilledFromTheFileNotReadIntoRam) {
    constexpr uint32_t kA = 3;
    const uint32_t hot[] = {5, 8, 11, 14};
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    ASSERT_TRUE(until([&] { return stats().pool_bytes == 4 * 3 * (slice_ + 512); }, kA, 1, kA, 0)) << log();
    // Another runtime with a pool of its own says which experts are hot; this process copies only A.
    moecache_client* other = moecache_client_open(dir_.file("moecached.sock").c_str(), "other-runtime");
    ASSERT_NE(other, nullptr);
    uint32_t h = 0;
    ASSERT_EQ(moecache_client_register_model(other, model_.c_str(), &h), 0);
    ASSERT_EQ(moecache_client_wait_ready(other, 10000), 1);
    const moecache_pool_stats pool{0, 0, 0, 0, 64u << 20};
    ASSERT_EQ(moecache_client_report_pool(other, 0, &pool), 0);
    for (uint32_t e : hot) ASSERT_EQ(moecache_client_report_placement(other, h, map_.layers[0].index, e, 0), 0);
    // The router's reports come through a ring the daemon may read before the socket: they start
    // once the daemon counts both pools (before that, one runtime without a pool needs them in RAM).
    std::smatch port;
    const std::string out = log();
    ASSERT_TRUE(std::regex_search(out, port, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) << out;
    httplib::Client c("127.0.0.1", std::stoi(port[1]));
    const std::string both = "moecache_vram_pool_bytes{device=\"0\"} " + std::to_string((64u << 20) + stats().pool_bytes) + "\n";
    std::string metrics;
    for (int i = 0; i < 100 && metrics.find(both) == std::string::npos; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (auto r = c.Get("/metrics"); r && r->status == 200) metrics = r->body;
    }
    ASSERT_NE(metrics.find(both), std::string::npos) << metrics;
    auto report = [&] {
        for (int i = 0; i < 50; ++i) (void)moecache_client_report(other, h, map_.layers[0].index, hot, 4, 1);
    };
    ASSERT_TRUE(until(
        [&] {
            report();
            return stats().filled_ahead >= 4 * 3 && stats().experts_in_vram == 4;
        },
        kA, 1, kA, 0))
        << "filled ahead " << stats().filled_ahead << " slices, in VRAM " << stats().experts_in_vram << ", directives "
        << stats().directives << "\n"
        << log();
    // One place: in VRAM, not in RAM (what the fill's reads left in the page cache is dropped).
    ASSERT_TRUE(until([&] { return std::all_of(std::begin(hot), std::end(hot), [&](uint32_t e) { return cached(e) <= kLeft; }); },
                      kA, 1, kA, 0))
        << log();
    // None of them was locked and then released to VRAM (read into RAM first); A may have been.
    const std::string said = log();
    for (uint32_t e : hot)
        EXPECT_EQ(said.find("expert " + std::to_string(e) + " leaves RAM"), std::string::npos)
            << "expert " << e << " was read into RAM and locked before the pool took it\n"
            << said;
    const auto before = stats();
    for (uint32_t e : hot) use(e, 1);
    ASSERT_EQ(ctx_sync_(), CUDA_SUCCESS);
    const auto after = stats();
    EXPECT_EQ(after.slice_hits - before.slice_hits, 4u * 3u) << "every slice of the hot experts from the pool";
    for (size_t t = 0; t < 3; ++t) {
        std::vector<uint8_t> back(slice_ * map_.n_experts);
        ASSERT_EQ(dtoh_(back.data(), dst_[t], back.size()), CUDA_SUCCESS);
        for (uint32_t e : hot)
            EXPECT_EQ(memcmp(back.data() + e * slice_, base_ + map_.layers[0].tensors[t].offset + e * slice_, slice_), 0)
                << "tensor " << t << " expert " << e;
    }
    moecache_client_close(other);
}

// A runtime that copies large buffers from memory that maps no model (it loaded its model without
// mmap): the hook tells the daemon, which counts the bytes on /metrics.
TEST_F(HookDaemon, LargeCopiesFromUnmappedMemoryReachTheMetrics) {
    use(3, 1);
    ASSERT_GE(sync(10000), 1);
    constexpr size_t kChunk = 16 << 20;
    std::vector<uint8_t> host(kChunk, 0x5a);
    CUdeviceptr d = 0;
    ASSERT_EQ(alloc_(&d, kChunk), CUDA_SUCCESS);
    for (int i = 0; i < 8; ++i) ASSERT_EQ(htod_async_(d, host.data(), kChunk, nullptr), CUDA_SUCCESS);
    std::smatch port;
    const std::string out = log();
    ASSERT_TRUE(std::regex_search(out, port, std::regex("metrics at http://127\\.0\\.0\\.1:(\\d+)/metrics"))) << out;
    const std::regex bytes("moecache_hook_unmapped_copy_bytes_total (\\d+)");
    std::string metrics;
    std::smatch m;
    for (int i = 0; i < 100; ++i) {
        (void)sync(200);
        httplib::Client c("127.0.0.1", std::stoi(port[1]));
        auto r = c.Get("/metrics");
        if (r && r->status == 200) metrics = r->body;
        if (std::regex_search(metrics, m, bytes) && std::stoull(m[1]) >= 8 * kChunk) break;
    }
    ASSERT_TRUE(std::regex_search(metrics, m, bytes)) << metrics;
    EXPECT_EQ(std::stoull(m[1]), stats().unmapped_bytes);
    EXPECT_GE(std::stoull(m[1]), 8 * kChunk);
    EXPECT_NE(metrics.find("moecache_hook_clients_without_model_mapping 0\n"), std::string::npos)
        << "this process maps a model: it is no client without one";
}

// PIN=register with a daemon: the registered tier is what the daemon keeps locked. The expert the
// daemon locks (B, copied from the host) is registered for DMA; when B takes the pool and leaves
// RAM, its registration goes, and A, locked again, is registered instead.
class HookDaemonRegister : public HookDaemon {
protected:
    void SetUp() override {
        setenv("MOECACHE_CUDA_PIN", "register", 1);  // read at the hook's first copy, after this
        HookDaemon::SetUp();
    }
    // Whether the middle page of every slice of the expert is registered for DMA (the fake driver says).
    bool pinned(uint32_t e) {
        auto is_pinned = reinterpret_cast<int (*)(const void*)>(dlsym(dlopen("libcuda.so.1", RTLD_NOW), "fake_cuda_is_pinned"));
        bool all = is_pinned != nullptr;
        for (const auto& r : map_.ranges(map_.layers[0].index, e)) all = all && is_pinned(base_ + r.offset + r.length / 2) == 1;
        return all;
    }
    // Bytes of the expert's slices that whole pages hold, less the first page of a slice that starts
    // on one (what registering the expert pins: no registration starts where a copy may).
    uint64_t inner_bytes(uint32_t e) {
        uint64_t n = 0;
        for (const auto& r : map_.ranges(map_.layers[0].index, e))
            n += ((r.offset + r.length) & ~uint64_t{4095}) - ((r.offset + 4096) & ~uint64_t{4095});
        return n;
    }
};

TEST_F(HookDaemonRegister, TheRegisteredTierFollowsTheDaemonsLocks) {
    constexpr uint32_t kA = 3, kB = 9;
    use(kA, 1);
    ASSERT_GE(sync(10000), 1);
    // A in the pool, B from the host and locked by the daemon: B registered, A not.
    ASSERT_TRUE(until([&] { return stats().experts_in_vram == 1 && cached(kB) == 1.0 && stats().pinned_bytes == inner_bytes(kB) &&
                                   pinned(kB) && !pinned(kA); },
                      kA, 4, kB, 2))
        << "pinned " << stats().pinned_bytes << " bytes (A " << pinned(kA) << ", B " << pinned(kB) << "), B's pages "
        << inner_bytes(kB) << ", " << stats().experts_in_vram << " in VRAM, B cached " << cached(kB) << "\n" << log();
    // B grows hotter and takes the pool: the daemon unlocks B and locks A again.
    ASSERT_TRUE(until([&] { return cached(kB) <= kLeft && stats().pinned_bytes == inner_bytes(kA) && pinned(kA) && !pinned(kB); },
                      kB, 12, kA, 1))
        << "pinned " << stats().pinned_bytes << " bytes (A " << pinned(kA) << ", B " << pinned(kB) << "), A's pages "
        << inner_bytes(kA) << ", " << stats().experts_in_vram << " in VRAM, A cached " << cached(kA) << ", B cached "
        << cached(kB) << "\n" << log();
}

}  // namespace
}  // namespace moecache::test

int main(int argc, char** argv) { return moecache::test::preloaded_test_main(argc, argv); }
