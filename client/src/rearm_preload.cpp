// libmoecache-rearm.so: the re-armer (rearm.h) for any runtime that maps GGUF models, loaded with
// LD_PRELOAD; nothing in the runtime changes. A background thread finds the runtime's shared
// mappings of GGUF files (by their magic, whatever their names) in /proc/self/maps (every 20 ms
// until one appears, then every 10 s for new models and changed mappings), reads each model's expert map, and re-arms one page per
// expert every MOECACHE_REARM_MS milliseconds (default 1000; 0 turns it off), at most
// MOECACHE_REARM_RATE pages a second (default 400; 0: no limit), in slices (RearmPace, rearm.h;
// what it costs: bench/rearm-overhead.sh). It says what it does once,
// on stderr, prefixed "moecache-rearm:", and never stops the runtime: on any error it goes quiet.
#include "moecache/client/rearm.h"
#include "moecache/model.h"
#include "moecache/process_maps.h"
#include "moecache/process_role.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using moecache::ExpertMap;
using moecache::FileMapping;
using moecache::client::ExpertRearmer;

struct Model {
    ExpertMap map;
    std::string maps_snapshot;  // the mapping lines it was planned from
    ExpertRearmer rearmer;
    moecache::client::RearmPace pace;
    size_t cursor = 0;  // the next planned page to re-arm
    std::chrono::steady_clock::time_point due;
};

// Whether the file at `path` is a GGUF file (its magic; regular files only, never blocking).
bool is_gguf(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return false;
    struct stat st {};
    char magic[4];
    const bool yes = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::pread(fd, magic, 4, 0) == 4 &&
                     std::memcmp(magic, "GGUF", 4) == 0;
    ::close(fd);
    return yes;
}

// The paths of GGUF files this process maps shared (by their magic: Hugging Face's cache and
// ollama keep models as blobs without a .gguf suffix). `not_gguf` remembers the others.
std::set<std::string> mapped_models(const std::string& maps, std::set<std::string>& not_gguf) {
    std::set<std::string> out;
    size_t at = 0;
    while (at < maps.size()) {
        size_t nl = maps.find('\n', at);
        if (nl == std::string::npos) nl = maps.size();
        const std::string line = maps.substr(at, nl - at);
        at = nl + 1;
        const size_t slash = line.find('/');
        if (slash == std::string::npos) continue;
        const std::string path = line.substr(slash);
        const size_t sp = line.find(' ');
        if (sp == std::string::npos || sp + 4 >= line.size() || line[sp + 4] != 's') continue;
        if (out.count(path) || not_gguf.count(path)) continue;
        if (path.size() > 10 && path.compare(path.size() - 10, 10, " (deleted)") == 0) continue;
        if (is_gguf(path)) out.insert(path);
        else not_gguf.insert(path);
    }
    return out;
}

void run(unsigned period_ms, unsigned rate) {
    std::map<std::string, std::unique_ptr<Model>> models;  // by the path of the part mapped first
    std::set<std::string> failed, not_gguf;
    auto next_scan = std::chrono::steady_clock::now();
    for (;;) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_scan) {
            // Often while nothing is mapped (a runtime maps its model soon after start), then
            // every 10 s for new models and changed mappings: reading a runtime's maps (thousands
            // of lines for a JavaScript host) every second cost it measurably.
            next_scan = now + (models.empty() ? std::chrono::milliseconds(20) : std::chrono::milliseconds(10000));
            auto text = moecache::read_proc_text("/proc/self/maps");
            if (!text) return;
            for (const auto& path : mapped_models(*text, not_gguf)) {
                if (failed.count(path)) continue;
                bool known = false;
                for (const auto& [p, m] : models)
                    for (const auto& f : m->map.files) known = known || f.path == path;
                if (known) continue;
                auto map = moecache::load_expert_map(path);
                if (!map) {
                    std::fprintf(stderr, "moecache-rearm: %s: not re-armed: %s\n", path.c_str(), map.error().what().c_str());
                    failed.insert(path);
                    continue;
                }
                auto m = std::make_unique<Model>();
                m->map = std::move(*map);
                models[path] = std::move(m);
            }
            // (Re)plan any model whose mappings changed.
            for (auto& [path, m] : models) {
                std::vector<std::vector<FileMapping>> mappings(m->map.files.size());
                std::string snapshot;
                for (size_t f = 0; f < m->map.files.size(); ++f) {
                    auto id = moecache::identify_file(m->map.files[f].path);
                    if (!id) continue;
                    mappings[f] = moecache::merge_adjacent(moecache::find_mappings(*text, *id));
                    for (const auto& fm : mappings[f]) snapshot += std::to_string(fm.start) + "-" + std::to_string(fm.end) + ";";
                }
                if (snapshot == m->maps_snapshot) continue;
                m->maps_snapshot = snapshot;
                m->rearmer = ExpertRearmer::plan(m->map, mappings);
                m->pace = moecache::client::RearmPace::of(m->rearmer.pages(), period_ms, rate);
                m->cursor = 0;
                m->due = now;
                std::fprintf(stderr, "moecache-rearm: %s: re-arming %zu experts every %llu ms (%zu every %llu ms)\n",
                             path.c_str(), m->rearmer.pages(), static_cast<unsigned long long>(m->pace.round_ms),
                             m->pace.per_tick, static_cast<unsigned long long>(m->pace.tick_ms));
            }
        }
        auto wake = next_scan;
        for (auto& [path, m] : models) {
            if (m->rearmer.pages() == 0 || m->rearmer.refused()) continue;
            if (now >= m->due) {
                m->rearmer.rearm(m->cursor, m->pace.per_tick);
                m->cursor += m->pace.per_tick;
                if (m->cursor >= m->rearmer.pages()) m->cursor = 0;
                // From the last due time, not from now: a late slice does not slow the round.
                m->due = std::max(m->due + std::chrono::milliseconds(m->pace.tick_ms), now);
                if (m->rearmer.refused())
                    std::fprintf(stderr, "moecache-rearm: %s: the kernel refused (%s; a locked mapping?): stopped\n",
                                 path.c_str(), std::strerror(m->rearmer.refusal_errno()));
            }
            wake = std::min(wake, m->due);
        }
        std::this_thread::sleep_until(wake);
    }
}

// A whole number from the environment into `out` (left as it is where unset); false, said on
// stderr, where it is set to anything but a number in [0, max].
bool env_number(const char* name, unsigned long max, const char* what, unsigned& out) {
    const char* e = std::getenv(name);
    if (e == nullptr) return true;
    char* end = nullptr;
    errno = 0;
    const unsigned long v = std::strtoul(e, &end, 10);
    if (end == e || *end != '\0' || errno != 0 || v > max || e[0] == '-') {
        // Once for a process and the processes it starts (a runtime may start many a second):
        // the mark goes down to them in the environment.
        if (std::getenv("MOECACHE_REARM_WARNED") == nullptr) {
            std::fprintf(stderr, "moecache-rearm: %s=%s is not a number of %s (0..%lu): off\n", name, e, what, max);
            ::setenv("MOECACHE_REARM_WARNED", "1", 1);
        }
        return false;
    }
    out = static_cast<unsigned>(v);
    return true;
}

// Main's arguments, as glibc gives them to a library's constructors: MOECACHE_KEEP_MAPPING=1 keeps a
// runtime's model mapped where its command line asks for --load-mode none or dio (ollama's choice on
// CPU-only hosts and under host memory pressure); without it, one line says why moecache cannot help.
__attribute__((constructor)) void look_at_command_line(int argc, char** argv, char** /*envp*/) {
    if (argc <= 0 || argv == nullptr) return;
    const char* keep = std::getenv("MOECACHE_KEEP_MAPPING");
    if (moecache::keep_mapping_asked(keep)) {
        if (const std::string was = moecache::keep_mapping(argc, argv, keep); !was.empty())
            std::fprintf(stderr, "moecache-rearm: --load-mode %s became --load-mode mmap (MOECACHE_KEEP_MAPPING)\n",
                         was.c_str());
        return;
    }
    const auto role = moecache::process_role(std::vector<std::string>(argv, argv + argc),
                                             std::getenv("LLAMA_ARG_LOAD_MODE"), std::getenv("LLAMA_ARG_MODEL"));
    if (role.kind == moecache::ProcessRole::Kind::Runtime && role.private_copy())
        std::fprintf(stderr, "moecache-rearm: %s\n", moecache::private_copy_advice(role).c_str());
}

__attribute__((constructor)) void start() {
    unsigned period = 1000, rate = 400;
    // Only where it is asked for: a preload also reaches every child the runtime starts.
    if (const char* only = std::getenv("MOECACHE_REARM_EXE")) {
        char exe[4096];
        const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0) return;
        exe[n] = '\0';
        if (std::strstr(exe, only) == nullptr) return;
    }
    if (!env_number("MOECACHE_REARM_MS", 3'600'000, "milliseconds", period)) return;
    if (!env_number("MOECACHE_REARM_RATE", 1'000'000, "pages a second", rate)) return;
    if (period == 0) return;
    std::thread([period, rate] { run(period, rate); }).detach();
}

}  // namespace
