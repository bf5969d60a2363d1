// moecache-prefetch-bench: one cold-cache run of the prefetcher over every routed expert of a
// model, in a random expert order, as the daemon would warm a model at start. bench/prefetch.sh
// runs it beside fio and vmtouch and prints medians.
//
//   moecache-prefetch-bench MODEL.gguf [--qd N] [--read-size BYTES] [--fadvise random|normal|none]
//                           [--plain-buffers] [--no-defer] [--order random|file|offset] [--seed N] [--blocking]
// It drives the prefetcher as the daemon does, from an epoll loop on its eventfd (--blocking:
// run_until_idle() instead).
//   moecache-prefetch-bench MODEL.gguf --info     (prints slice=, experts=, expert_bytes=, file_bytes=)
//
// Prints one line: moecache bytes=B seconds=S mbps=M user=U sys=S resident=R reads=N
#include "moecache/daemon/prefetcher.h"
#include "moecache/model.h"
#include "moecache/page_cache.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

using moecache::ExpertMap;
using moecache::UniqueFd;
using moecache::daemon::Prefetcher;

struct Args {
    std::string model;
    uint32_t qd = 32;
    uint32_t read_size = 1u << 20;
    std::string fadvise = "random";
    bool register_buffers = true;
    bool defer_taskrun = true;
    std::string order = "random";
    uint64_t seed = 1;
    bool info = false;
    bool blocking = false;
};

[[noreturn]] void usage(const char* why) {
    std::fprintf(stderr,
                 "moecache-prefetch-bench: %s\nusage: moecache-prefetch-bench MODEL.gguf [--qd N] [--read-size BYTES]\n"
                 "  [--fadvise random|normal|none] [--plain-buffers] [--no-defer] [--order random|file|offset] [--seed N]\n"
                 "  [--blocking] [--info]\n",
                 why);
    std::exit(2);
}

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage(("missing value after " + k).c_str());
            return argv[++i];
        };
        if (k == "--qd") a.qd = static_cast<uint32_t>(std::stoul(value()));
        else if (k == "--read-size") a.read_size = static_cast<uint32_t>(std::stoul(value()));
        else if (k == "--fadvise") a.fadvise = value();
        else if (k == "--plain-buffers") a.register_buffers = false;
        else if (k == "--no-defer") a.defer_taskrun = false;
        else if (k == "--order") a.order = value();
        else if (k == "--seed") a.seed = std::stoull(value());
        else if (k == "--info") a.info = true;
        else if (k == "--blocking") a.blocking = true;
        else if (!k.empty() && k[0] != '-' && a.model.empty()) a.model = k;
        else usage(("unknown argument " + k).c_str());
    }
    if (a.model.empty()) usage("no model given");
    if (a.fadvise != "random" && a.fadvise != "normal" && a.fadvise != "none") usage("--fadvise: random, normal or none");
    if (a.order != "random" && a.order != "file" && a.order != "offset") usage("--order: random, file or offset");
    return a;
}

double cpu_seconds(const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6; }

// Every expert's ranges, expert after expert, in the order asked for.
std::vector<moecache::ByteRange> expert_ranges(const ExpertMap& map, const Args& a) {
    std::vector<moecache::ExpertRef> experts;
    for (const auto& layer : map.layers)
        for (uint32_t e = 0; e < map.n_experts; ++e) experts.push_back({layer.index, e});
    if (a.order == "random") std::shuffle(experts.begin(), experts.end(), std::mt19937_64(a.seed));
    std::vector<moecache::ByteRange> ranges;
    for (const auto& x : experts)
        for (const auto& r : map.ranges(x.layer, x.expert)) ranges.push_back(r);
    if (a.order == "offset") {
        std::sort(ranges.begin(), ranges.end(),
                  [](const auto& x, const auto& y) { return std::tie(x.file, x.offset) < std::tie(y.file, y.offset); });
    }
    return ranges;
}

int drop_and_check(const ExpertMap& map) {
    for (const auto& f : map.files) {
        UniqueFd fd(::open(f.path.c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd || ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED) != 0) {
            std::fprintf(stderr, "cannot drop %s from the page cache: %s\n", f.path.c_str(), std::strerror(errno));
            return 1;
        }
        auto probe = moecache::PageCacheProbe::open(f.path);
        const auto left = probe ? probe->resident_bytes(0, f.size) : moecache::Result<uint64_t>(0);
        if (left && *left > (1u << 20)) {
            std::fprintf(stderr, "%s: %llu bytes still cached after POSIX_FADV_DONTNEED (mapped or dirty?)\n",
                         f.path.c_str(), static_cast<unsigned long long>(*left));
            return 1;
        }
    }
    return 0;
}

uint64_t resident_expert_bytes(const ExpertMap& map, const std::vector<moecache::ByteRange>& ranges) {
    std::vector<moecache::PageCacheProbe> probes;
    for (const auto& f : map.files) probes.push_back(std::move(*moecache::PageCacheProbe::open(f.path)));
    uint64_t n = 0;
    for (const auto& r : ranges) n += probes[r.file].resident_bytes(r.offset, r.length).value_or(0);
    return n;
}

// The daemon's way: sleep in epoll_wait until the eventfd says completions are ready.
moecache::Result<void> event_loop(Prefetcher& p) {
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    epoll_event ev{.events = EPOLLIN, .data = {.u64 = 0}};
    if (!ep || ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, p.event_fd(), &ev) != 0) return moecache::fail_errno("epoll");
    MC_TRY_VOID(p.submit());
    while (!p.idle()) {
        const int n = ::epoll_wait(ep.get(), &ev, 1, 30000);
        if (n < 0 && errno == EINTR) continue;  // task work without DEFER_TASKRUN interrupts
        if (n <= 0) return moecache::fail_errno("epoll_wait: no completion in 30 s");
        MC_TRY_VOID(p.on_ready());
    }
    return {};
}

int run(const Args& a) {
    auto map = moecache::load_expert_map(a.model);
    if (!map) {
        std::fprintf(stderr, "%s\n", map.error().what().c_str());
        return 1;
    }
    const auto ranges = expert_ranges(*map, a);
    uint64_t total = 0;
    for (const auto& r : ranges) total += r.length;
    if (a.info) {
        uint64_t file_bytes = 0;
        for (const auto& f : map->files) file_bytes += f.size;
        std::printf("slice=%llu experts=%zu expert_bytes=%llu file_bytes=%llu\n",
                    static_cast<unsigned long long>(map->layers.at(0).tensors.at(0).bytes_per_expert),
                    map->layers.size() * map->n_experts, static_cast<unsigned long long>(total),
                    static_cast<unsigned long long>(file_bytes));
        return 0;
    }

    std::vector<UniqueFd> fds;
    for (const auto& f : map->files) {
        fds.emplace_back(::open(f.path.c_str(), O_RDONLY | O_CLOEXEC));
        if (!fds.back()) {
            std::fprintf(stderr, "open %s: %s\n", f.path.c_str(), std::strerror(errno));
            return 1;
        }
        if (a.fadvise != "none")
            ::posix_fadvise(fds.back().get(), 0, 0, a.fadvise == "random" ? POSIX_FADV_RANDOM : POSIX_FADV_NORMAL);
    }
    auto p = Prefetcher::create({.queue_depth = a.qd, .read_size = a.read_size,
                                 .register_buffers = a.register_buffers, .defer_taskrun = a.defer_taskrun});
    if (!p) {
        std::fprintf(stderr, "%s\n", p.error().what().c_str());
        return 1;
    }
    int failures = 0;
    p->set_callback([&](uint64_t, uint64_t, uint64_t, int err) { failures += err != 0; });
    if (drop_and_check(*map) != 0) return 1;

    rusage before{}, after{};
    ::getrusage(RUSAGE_SELF, &before);
    const auto start = std::chrono::steady_clock::now();
    for (const auto& r : ranges) p->enqueue({fds[r.file].get(), r.offset, r.length, 0, r.offset});
    if (auto done = a.blocking ? p->run_until_idle() : event_loop(*p); !done) {
        std::fprintf(stderr, "%s\n", done.error().what().c_str());
        return 1;
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ::getrusage(RUSAGE_SELF, &after);

    const auto pr = p->progress();
    const uint64_t resident = resident_expert_bytes(*map, ranges);
    std::printf("moecache bytes=%llu seconds=%.4f mbps=%.1f user=%.3f sys=%.3f resident=%llu reads=%llu "
                "fixed=%d flags=%#x\n",
                static_cast<unsigned long long>(pr.done_bytes), seconds, static_cast<double>(pr.done_bytes) / seconds / 1e6,
                cpu_seconds(after.ru_utime) - cpu_seconds(before.ru_utime),
                cpu_seconds(after.ru_stime) - cpu_seconds(before.ru_stime), static_cast<unsigned long long>(resident),
                static_cast<unsigned long long>(pr.reads_submitted), p->setup().registered_buffers ? 1 : 0,
                p->setup().ring_flags);
    if (failures != 0 || pr.done_bytes != total) {
        std::fprintf(stderr, "%d requests failed; %llu of %llu bytes read\n", failures,
                     static_cast<unsigned long long>(pr.done_bytes), static_cast<unsigned long long>(total));
        return 1;
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) { return run(parse(argc, argv)); }
