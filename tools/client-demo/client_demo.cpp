// moecache-client-demo: an example client of moecached, and the load generator of its tests. It
// maps a model as a runtime would, registers it through libmoecache-client, reports a stream of
// router decisions with a chosen skew, prints the directives it gets, and at the end one JSON line
// of what it reported, sent, dropped and overflowed.
//
//   moecache-client-demo MODEL.gguf [--socket PATH] [--seconds S] [--rate EVENTS_PER_S (0: as fast
//                        as the ring takes)] [--skew S (0 uniform)] [--experts-per-token K]
//                        [--name NAME] [--wait-ready SECONDS]
#include "moecache/build_info.h"
#include "moecache/client.h"
#include "moecache/model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
    std::string model, socket_path, name = "moecache-client-demo";
    double seconds = 5, rate = 1000, skew = 1.0, wait_ready = 0;
    uint32_t k = 0;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "moecache-client-demo: %s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        // Numbers parsed whole: "--seconds 5s" is an error, not 5 (and never an exception).
        auto number = [&](double& out) {
            const std::string v = next();
            char* end = nullptr;
            errno = 0;
            out = std::strtod(v.c_str(), &end);
            if (v.empty() || *end != '\0' || errno != 0 || !(out >= 0)) {
                std::fprintf(stderr, "moecache-client-demo: %s: '%s' is not a number >= 0\n", a.c_str(), v.c_str());
                std::exit(2);
            }
        };
        constexpr const char* kUsage =
            "usage: moecache-client-demo MODEL.gguf [--socket PATH] [--seconds S] [--rate R] "
            "[--skew S] [--experts-per-token K] [--name NAME] [--wait-ready S]\n";
        double v = 0;
        if (a == "--socket") socket_path = next();
        else if (a == "--seconds") number(seconds);
        else if (a == "--rate") number(rate);
        else if (a == "--skew") number(skew);
        else if (a == "--experts-per-token") {
            number(v);
            if (v != static_cast<double>(static_cast<uint32_t>(v))) {
                std::fprintf(stderr, "moecache-client-demo: --experts-per-token takes a whole number\n");
                return 2;
            }
            k = static_cast<uint32_t>(v);
        } else if (a == "--name") name = next();
        else if (a == "--wait-ready") number(wait_ready);
        else if (a == "--version") {
            std::printf("moecache-client-demo %s\n", moecache::version_line().c_str());
            return 0;
        } else if (a == "-h" || a == "--help") {
            std::printf("%s", kUsage);
            return 0;
        } else if (a[0] != '-' && model.empty()) model = a;
        else {
            std::fprintf(stderr, "%s", kUsage);
            return 2;
        }
    }
    if (model.empty()) {
        std::fprintf(stderr, "moecache-client-demo: no model given\n");
        return 2;
    }
    auto map = moecache::load_expert_map(model);
    if (!map) {
        std::fprintf(stderr, "moecache-client-demo: %s\n", map.error().what().c_str());
        return 1;
    }
    if (map->layers.empty()) {
        std::fprintf(stderr, "moecache-client-demo: %s has no routed experts\n", model.c_str());
        return 1;
    }
    // Mapped as a runtime maps it (read-only, shared).
    std::vector<void*> mapped;
    for (const auto& f : map->files) {
        const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
        void* p = fd < 0 ? MAP_FAILED : ::mmap(nullptr, f.size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            std::fprintf(stderr, "moecache-client-demo: cannot map %s\n", f.path.c_str());
            return 1;
        }
        mapped.push_back(p);
        ::close(fd);
    }
    if (k == 0) k = map->n_experts_used;
    k = std::min(k, map->n_experts);

    moecache_client* c = moecache_client_open(socket_path.empty() ? nullptr : socket_path.c_str(), name.c_str());
    if (!c) return 1;
    uint32_t handle = 0;
    if (int r = moecache_client_register_model(c, model.c_str(), &handle); r != 0) {
        std::fprintf(stderr, "moecache-client-demo: register %s: %s\n", model.c_str(), std::strerror(-r));
        return 1;
    }
    for (uint32_t f = 0; f < map->files.size(); ++f)
        moecache_client_describe_mapping(c, handle, f, mapped[f], map->files[f].size, 0);
    if (wait_ready > 0 && !moecache_client_wait_ready(c, static_cast<int>(wait_ready * 1000)))
        std::fprintf(stderr, "moecache-client-demo: not connected after %.1f s; reporting anyway\n", wait_ready);

    // Expert e of every layer is picked with weight 1 / (e + 1)^skew.
    std::vector<double> w(map->n_experts);
    for (uint32_t e = 0; e < map->n_experts; ++e) w[e] = 1.0 / std::pow(e + 1.0, skew);
    std::discrete_distribution<uint32_t> pick(w.begin(), w.end());
    std::mt19937_64 rng(static_cast<uint64_t>(::getpid()));
    std::vector<uint32_t> experts(k);

    const auto start = std::chrono::steady_clock::now();
    const auto end = start + std::chrono::duration<double>(seconds);
    uint64_t events = 0;
    moecache_directive d[64];
    while (std::chrono::steady_clock::now() < end) {
        for (const auto& layer : map->layers) {
            // k distinct experts, as a router picks them (a record that names one twice is refused).
            for (uint32_t i = 0; i < k; ++i)
                do experts[i] = pick(rng);
                while (std::find(experts.begin(), experts.begin() + i, experts[i]) != experts.begin() + i);
            moecache_client_report(c, handle, layer.index, experts.data(), k, 1);
            ++events;
        }
        if (rate > 0) {
            const auto due = start + std::chrono::duration<double>(static_cast<double>(events) / rate);
            std::this_thread::sleep_until(due);
        }
        if (events % 4096 < map->layers.size())
            for (size_t n = moecache_client_poll(c, d, 64), i = 0; i < n; ++i)
                std::printf("directive action=%u block=%u expert=%u\n", d[i].action, d[i].block, d[i].expert);
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    moecache_client_stats s{};
    moecache_client_stats_get(c, &s);
    std::printf("{\"name\":\"%s\",\"seconds\":%.3f,\"reported\":%llu,\"sent\":%llu,\"dropped\":%llu,\"overflow\":%llu,"
                "\"connects\":%llu,\"connected\":%d,\"events_per_second\":%.0f}\n",
                name.c_str(), took, static_cast<unsigned long long>(s.reported), static_cast<unsigned long long>(s.sent),
                static_cast<unsigned long long>(s.dropped), static_cast<unsigned long long>(s.overflow),
                static_cast<unsigned long long>(s.connects), s.connected, static_cast<double>(s.reported) / took);
    std::fflush(stdout);
    moecache_client_close(c);
    return 0;
}
