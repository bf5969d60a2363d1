// moecache-page-cache-bench: what the eBPF page-cache telemetry costs a reader, and how many
// events the daemon consumes on one core. bench/page-cache-telemetry.sh runs it and prints medians.
//
//   moecache-page-cache-bench MODEL.gguf --mode read|flood [--attached] [--ring BYTES]
//
// A child process reads the model from a cold page cache, as a runtime would:
//   read   sequentially, 1 MiB read(2) calls (large folios: few events)
//   flood  every page through a MADV_RANDOM mapping (one folio per page: an added page and a
//          fault event per page, the most events a reader can make)
// With --attached the daemon runs in this process with its BPF programs attached and the model
// registered (nothing locked or prefetched), turning its loop until the child is done and every
// event is consumed; without, nothing is loaded.
// Prints one line: mbps=R seconds=S events=N dropped=D daemon_cpu=C (seconds of this process's CPU
// while the child ran and the events were drained: the whole daemon, its tick included)
// consume_cpu=E (of which reading and attributing page-cache events).
#include "moecache/daemon/daemon.h"
#include "moecache/log.h"
#include "moecache/model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <syslog.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void usage(const char* why) {
    std::fprintf(stderr, "moecache-page-cache-bench: %s\nusage: moecache-page-cache-bench MODEL.gguf --mode read|flood "
                         "[--attached] [--ring BYTES]\n", why);
    std::exit(2);
}

double cpu_seconds() {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// The child's work; returns the seconds it took, or < 0.
double read_model(const std::vector<moecache::ModelFileInfo>& files, bool flood) {
    const auto start = Clock::now();
    for (const auto& f : files) {
        const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return -1;
        if (flood) {
            auto* m = static_cast<volatile const char*>(::mmap(nullptr, f.size, PROT_READ, MAP_SHARED, fd, 0));
            if (m == MAP_FAILED) return -1;
            ::madvise(const_cast<char*>(m), f.size, MADV_RANDOM);
            unsigned sum = 0;
            for (uint64_t at = 0; at < f.size; at += 4096) sum += static_cast<unsigned char>(m[at]);
            ::munmap(const_cast<char*>(m), f.size);
            if (sum == 0xdeadbeef) std::fputc(' ', stderr);
        } else {
            std::vector<char> buf(1u << 20);
            while (::read(fd, buf.data(), buf.size()) > 0) {}
        }
        ::close(fd);
    }
    return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
    std::string model, mode = "read";
    bool attached = false;
    uint32_t ring = 16u << 20;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        if (k == "--mode" && i + 1 < argc) mode = argv[++i];
        else if (k == "--attached") attached = true;
        else if (k == "--ring" && i + 1 < argc) ring = static_cast<uint32_t>(std::stoul(argv[++i]));
        else if (!k.empty() && k[0] != '-' && model.empty()) model = k;
        else usage(("unknown argument " + k).c_str());
    }
    if (model.empty()) usage("no model given");
    if (mode != "read" && mode != "flood") usage("--mode: read or flood");
    auto map = moecache::load_expert_map(model);
    if (!map) {
        std::fprintf(stderr, "%s\n", map.error().what().c_str());
        return 1;
    }
    uint64_t bytes = 0;
    for (const auto& f : map->files) {
        bytes += f.size;
        const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0 || ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) {
            std::fprintf(stderr, "cannot drop %s from the page cache\n", f.path.c_str());
            return 1;
        }
        ::close(fd);
    }

    std::unique_ptr<moecache::daemon::Daemon> d;
    if (attached) {
        moecache::daemon::Config c;
        c.state_dir = "/tmp/moecache-page-cache-bench-state";
        c.socket_path = "";  // no clients here
        c.lock_budget = {1u << 20, std::nullopt};
        c.reserve = {0, std::nullopt};
        c.admit_after_uses = 1u << 30;  // register and watch only
        c.elite_share = 0;
        c.pressure_enabled = false;
        c.page_cache_telemetry = "on";
        c.page_cache_ring_bytes = ring;
        moecache::daemon::ModelConfig mc;
        mc.path = model;
        mc.lock_dense = false;
        mc.where = "bench";
        c.models.push_back(mc);
        moecache::log::set_max_priority(LOG_WARNING);
        auto dd = moecache::daemon::Daemon::create(c);
        if (!dd) {
            std::fprintf(stderr, "%s\n", dd.error().what().c_str());
            return 1;
        }
        d = std::move(*dd);
    }

    int fds[2];
    if (::pipe(fds) != 0) return 1;
    const double cpu0 = cpu_seconds();
    const pid_t pid = ::fork();
    if (pid == 0) {
        const double s = read_model(map->files, mode == "flood");
        (void)!::write(fds[1], &s, sizeof s);
        ::_exit(s < 0 ? 1 : 0);
    }
    ::close(fds[1]);
    int status = 0;
    // The same wait either way (a 5 ms clock): a parent that sleeps in waitpid lets its CPU go
    // idle, and on a virtual machine an idle CPU wakes the reader's I/O completions late.
    for (;;) {
        if (d) (void)d->step(5);
        else ::usleep(5000);
        const pid_t r = ::waitpid(pid, &status, WNOHANG);
        if (r == pid) break;
    }
    double seconds = -1;
    if (::read(fds[0], &seconds, sizeof seconds) != sizeof seconds || seconds <= 0) {
        std::fprintf(stderr, "the reader failed\n");
        return 1;
    }
    uint64_t events = 0, dropped = 0;
    double consume_cpu = 0;
    if (d) {
        for (int i = 0; i < 10000; ++i) {
            const auto s = d->status();
            uint64_t sent = 0;
            for (uint64_t v : s.page_cache.sent) sent += v;
            events = s.page_cache.events;
            dropped = 0;
            for (uint64_t v : s.page_cache.dropped) dropped += v;
            consume_cpu = s.page_cache.consume_cpu_seconds;
            if (events >= sent) break;
            (void)d->step(5);
        }
    }
    const double cpu = cpu_seconds() - cpu0;
    std::printf("mbps=%.1f seconds=%.4f events=%llu dropped=%llu daemon_cpu=%.4f consume_cpu=%.4f bytes=%llu\n",
                static_cast<double>(bytes) / seconds / 1e6, seconds, static_cast<unsigned long long>(events),
                static_cast<unsigned long long>(dropped), cpu, consume_cpu, static_cast<unsigned long long>(bytes));
    return 0;
}
