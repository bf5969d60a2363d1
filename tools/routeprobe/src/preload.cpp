// libmoecache-routeprobe.so: loaded with LD_PRELOAD into a process that runs llama.cpp, it
// interposes llama_decode and measures which experts every decode reads (see route_probe.h).
//   MOECACHE_ROUTEPROBE_MODEL  the model file the runtime loads (any part of a split set)
//   MOECACHE_ROUTEPROBE_OUT    where the JSON report goes, written when the process exits
//   MOECACHE_ROUTEPROBE_TRACE  optional: where the router trace of every decode goes (docs/trace.md,
//                              for moecache-sim), written when the process exits
// Whatever fails, the host process is not harmed: one line on stderr, then decodes pass through.
#include "moecache/log.h"
#include "moecache/routeprobe/route_probe.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>

namespace {

// llama.cpp's public struct llama_batch, passed by value (include/llama.h).
struct LlamaBatch {
    int32_t n_tokens;
    int32_t* token;
    float* embd;
    int32_t* pos;
    int32_t* n_seq_id;
    int32_t** seq_id;
    int8_t* logits;
};

using DecodeFn = int32_t (*)(void*, LlamaBatch);
using SynchronizeFn = void (*)(void*);

enum class Mode { Fresh, Measuring, PassThrough };

// Lives until the process ends (never destroyed, so the exit handler can still use it).
struct State {
    std::mutex mutex;
    Mode mode = Mode::Fresh;
    DecodeFn decode = nullptr;
    SynchronizeFn synchronize = nullptr;
    std::unique_ptr<moecache::routeprobe::RouteProbe> probe;
    std::string out_path, trace_path;
    std::string stopped;  // why measuring stopped early, if it did
    pid_t pid = 0;
};

State& state() {
    static State* s = new State();
    return *s;
}

// What was measured until then is still reported at exit.
void give_up(State& s, const std::string& why) {
    MC_LOG(LOG_WARNING, "moecache-routeprobe: {}; measuring {}, decodes pass through", why,
           s.probe ? "no more" : "nothing");
    s.mode = Mode::PassThrough;
    s.stopped = why;
}

// The libllama this process's llama_decode calls would reach without us. RTLD_NEXT finds it when
// libllama is in the global scope; node and other hosts dlopen it RTLD_LOCAL, so fall back to
// asking every loaded object except this one.
struct Found {
    void* decode = nullptr;
    void* synchronize = nullptr;
};

int visit_object(dl_phdr_info* info, size_t, void* data) {
    auto* f = static_cast<Found*>(data);
    if (f->decode || !info->dlpi_name || !*info->dlpi_name) return 0;
    Dl_info self{};
    if (::dladdr(reinterpret_cast<void*>(&state), &self) && self.dli_fbase &&
        reinterpret_cast<uintptr_t>(self.dli_fbase) == info->dlpi_addr)
        return 0;
    void* h = ::dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    void* d = ::dlsym(h, "llama_decode");
    Dl_info where{};
    // Only the object that defines it, not one that merely depends on it.
    if (d && ::dladdr(d, &where) && reinterpret_cast<uintptr_t>(where.dli_fbase) == info->dlpi_addr) {
        f->decode = d;
        f->synchronize = ::dlsym(h, "llama_synchronize");
    }
    ::dlclose(h);
    return 0;
}

bool resolve_real(State& s) {
    Found f{::dlsym(RTLD_NEXT, "llama_decode"), ::dlsym(RTLD_NEXT, "llama_synchronize")};
    if (!f.decode) {
        f = {};
        ::dl_iterate_phdr(visit_object, &f);
    }
    s.decode = reinterpret_cast<DecodeFn>(f.decode);
    s.synchronize = reinterpret_cast<SynchronizeFn>(f.synchronize);
    return s.decode != nullptr;
}

void write_report() {
    State& s = state();
    std::lock_guard lock(s.mutex);
    if (!s.probe || ::getpid() != s.pid) return;
    try {
        auto j = s.probe->report();
        j["stopped_early"] = s.stopped.empty() ? nlohmann::json(nullptr) : nlohmann::json(s.stopped);
        const std::string tmp = s.out_path + ".tmp";
        {
            std::ofstream out(tmp, std::ios::trunc);
            out << j.dump(1) << '\n';
            if (!out.flush()) throw std::runtime_error("cannot write " + tmp);
        }
        if (std::rename(tmp.c_str(), s.out_path.c_str()) != 0)
            throw std::runtime_error("cannot rename " + tmp + " to " + s.out_path + ": " + std::strerror(errno));
        if (!s.trace_path.empty()) {
            std::ofstream t(s.trace_path, std::ios::trunc);
            t << s.probe->trace();
            if (!t.flush()) MC_LOG(LOG_WARNING, "moecache-routeprobe: cannot write the trace {}", s.trace_path);
        }
        MC_LOG(LOG_INFO, "moecache-routeprobe: {} single-token steps, {:.2f} experts per layer per step "
               "(expert_used_count {}); wrote {}", s.probe->single_token_steps(),
               s.probe->mean_experts_per_layer_per_step(), j["n_experts_used"].get<uint32_t>(), s.out_path);
    } catch (const std::exception& e) {
        MC_LOG(LOG_WARNING, "moecache-routeprobe: no report: {}", e.what());
    }
}

void start(State& s) {
    const char* model = std::getenv("MOECACHE_ROUTEPROBE_MODEL");
    const char* out = std::getenv("MOECACHE_ROUTEPROBE_OUT");
    if (!model || !*model || !out || !*out)
        return give_up(s, "set MOECACHE_ROUTEPROBE_MODEL (the model file) and MOECACHE_ROUTEPROBE_OUT (the report)");
    // Fail now rather than at exit, after the whole run.
    const std::string tmp = std::string(out) + ".tmp";
    if (const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644); fd >= 0) {
        ::close(fd);
        ::unlink(tmp.c_str());
    } else if (errno != EEXIST) {
        return give_up(s, fmt::format("cannot write the report {}: creating {}: {}", out, tmp, std::strerror(errno)));
    }
    moecache::routeprobe::ProbeConfig c;
    c.model_path = model;
    const long page = ::sysconf(_SC_PAGESIZE);
    c.page_size = page > 0 ? static_cast<uint64_t>(page) : 4096;
    auto probe = moecache::routeprobe::RouteProbe::create(c);
    if (!probe) return give_up(s, probe.error().what());
    s.probe = std::move(*probe);
    s.out_path = out;
    if (const char* t = std::getenv("MOECACHE_ROUTEPROBE_TRACE"); t && *t) s.trace_path = t;
    s.pid = ::getpid();
    s.mode = Mode::Measuring;
    std::atexit(write_report);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int32_t llama_decode(void* ctx, LlamaBatch batch) {
    State& s = state();
    std::unique_lock lock(s.mutex);
    if (!s.decode && !resolve_real(s)) {
        MC_LOG(LOG_ERR, "moecache-routeprobe: llama_decode is not defined by any loaded library");
        return -1;  // llama.cpp's "invalid input"; there is nothing to forward to
    }
    if (s.mode == Mode::PassThrough) {
        lock.unlock();
        return s.decode(ctx, batch);
    }
    try {
        if (s.mode == Mode::Fresh) start(s);
        if (s.mode == Mode::Measuring)
            if (auto r = s.probe->begin_decode(); !r) give_up(s, r.error().what());
    } catch (const std::exception& e) {
        give_up(s, e.what());
    }
    if (s.mode != Mode::Measuring) {
        lock.unlock();
        return s.decode(ctx, batch);
    }
    // Held across the decode: another context's decode in between would blur the attribution.
    const int32_t rc = s.decode(ctx, batch);
    try {
        if (s.synchronize) s.synchronize(ctx);
        if (rc == 0)
            if (auto r = s.probe->finish_decode(batch.n_tokens); !r) give_up(s, r.error().what());
    } catch (const std::exception& e) {
        give_up(s, e.what());
    }
    return rc;
}
