// libmoecache-client (moecache/client.h). One background thread per client owns the connection:
// it connects with back-off, says Hello, registers the models, hands the daemon a fresh telemetry
// ring, and then reads directives until the connection ends, when it starts over. The caller's
// threads only touch atomics and the ring (report) or a mutex-guarded queue (poll, register).
#include "moecache/client.h"

#include "moecache/client/protocol.h"
#include "moecache/client/telemetry_ring.h"
#include "trace_writer.h"
#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <optional>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

namespace {

using namespace moecache;
using namespace moecache::protocol;

constexpr size_t kMaxModels = 64;
constexpr uint32_t kNoId = UINT32_MAX;
constexpr uint32_t kRingBytes = 1u << 20;
// How long the client's thread waits for a reply before it gives the connection up and connects
// again. A daemon that went away is seen at once (the socket hangs up); this is for one whose loop
// is slow (a long placement under memory pressure): a new connection then costs the runtime its
// registration, its pool's direction and its ring, so the thread waits rather than starting over
// (5 s was seen too short on the GPU machine). The runtime's threads never wait on it.
constexpr int kReplyTimeoutMs = 30000;

struct Mapping {
    uint32_t file;
    uint64_t address, length, file_offset;
};

struct Model {
    std::string path;
    std::vector<UniqueFd> fds;
    std::atomic<uint32_t> daemon_id{kNoId};
    std::vector<Mapping> mappings;  // guarded by moecache_client::mu
    size_t mappings_sent = 0;       // this connection; the worker's own
};

uint64_t now_ns() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

struct moecache_client {
    std::string socket_path, name;
    UniqueFd wake;  // eventfd: stop, or a model to register
    std::thread worker;
    std::atomic<bool> stop{false};

    std::mutex mu;  // models_count growth, directives, ready
    std::condition_variable cv;
    std::array<std::atomic<Model*>, kMaxModels> models{};
    std::vector<std::unique_ptr<Model>> owned;
    std::atomic<uint32_t> models_count{0};
    std::deque<moecache_directive> directives;
    bool ready = false;
    // Experts in a VRAM pool (handle, block, expert) -> device: re-sent after every connection.
    std::map<std::tuple<uint32_t, uint32_t, uint32_t>, uint32_t> placements;
    std::deque<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> placements_unsent;
    // The latest pool statistics per device, and which are not sent yet (under mu).
    std::array<std::optional<PoolStats>, kMaxPoolDevices> pool_stats{};
    std::array<bool, kMaxPoolDevices> pool_stats_unsent{};
    std::array<MissPath, kMaxPoolDevices> miss_paths{};  // how each device's misses reach it (under mu)
    std::optional<Unmapped> unmapped;  // the latest (under mu)
    bool unmapped_unsent = false;
    static constexpr uint32_t kMaxBudgetDevices = 64;
    std::array<std::atomic<uint64_t>, kMaxBudgetDevices> budgets{};  // pool bytes + 1; 0: none set
    std::array<std::atomic<int>, kMaxBudgetDevices> one_place{};     // 1 yes, 2 no, 0: not said
    std::array<std::atomic<int>, kMaxBudgetDevices> recency{};       // 1 yes, 0: no or not said

    std::atomic<telemetry::TelemetryRing*> ring{nullptr};
    std::vector<std::unique_ptr<telemetry::TelemetryRing>> rings;  // every ring made, alive until close
    std::atomic_flag push_lock = ATOMIC_FLAG_INIT;

    std::atomic<uint64_t> reported{0}, sent{0}, dropped{0}, overflow{0}, connects{0};
    std::unique_ptr<moecache::client::TraceWriter> trace;  // MOECACHE_TRACE
    std::atomic<bool> connected{false};
    bool said_absent = false;
    uint32_t next_request = 1;

    void run();
    bool session(int fd);
    // Whether the peer listening at the socket may be given this process's model descriptors and
    // telemetry: root, the daemon's user (MOECACHE_DAEMON_USER, default moecached) or this process's
    // own user. Anyone who could write the socket's directory could otherwise stand in for the
    // daemon and be handed every model file this runtime opens.
    bool trusted_peer(int fd);
    bool said_untrusted = false;
    bool request(int fd, const Message& m, const std::vector<int>& fds, Message& reply);
    bool read_one(int fd, int timeout_ms, Message& out, bool& hung_up);
    void take_directive(const Directive& d);
    void take_push(const Message& m);
    bool send_placements(int fd);
    bool send_pool_stats(int fd);
    bool register_model(int fd, Model& m);
    bool send_mappings(int fd, Model& m);
};

bool moecache_client::read_one(int fd, int timeout_ms, Message& out, bool& hung_up) {
    pollfd p[2] = {{fd, POLLIN, 0}, {wake.get(), POLLIN, 0}};
    if (::poll(p, 2, timeout_ms) <= 0) return false;
    if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR))) return false;
    std::vector<uint8_t> buf(kMaxMessageBytes);
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
    if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EINTR)) hung_up = true;
        return false;
    }
    buf.resize(static_cast<size_t>(n));
    auto m = decode(buf, 0);
    if (!m) {
        std::fprintf(stderr, "moecache: a message from the daemon does not decode: %s\n", m.error().what().c_str());
        hung_up = true;
        return false;
    }
    out = std::move(*m);
    return true;
}

void moecache_client::take_directive(const Directive& d) {
    std::lock_guard lock(mu);
    for (uint32_t h = 0; h < models_count.load(); ++h) {
        Model* m = models[h].load();
        if (m && m->daemon_id.load() == d.model) {
            if (directives.size() < 65536)
                directives.push_back({h, d.block, d.expert, static_cast<uint32_t>(d.action)});
            return;
        }
    }
}

// What the daemon sends unasked: directives and pool budgets.
void moecache_client::take_push(const Message& m) {
    if (const auto* d = std::get_if<Directive>(&m.body)) take_directive(*d);
    if (const auto* b = std::get_if<VramPolicy>(&m.body)) {
        // Stored as bytes + 1, so that a pool of 0 bytes differs from nothing said.
        const uint64_t v = b->pool_bytes == kNoPoolLimit ? UINT64_MAX : b->pool_bytes + 1;
        for (uint32_t d = 0; d < kMaxBudgetDevices; ++d)
            if (b->device == kAllDevices || b->device == d) {
                budgets[d].store(v);
                one_place[d].store(b->one_place ? 1 : 2);
                recency[d].store(b->recency ? 1 : 0);
            }
    }
}

// Placements not yet sent, for models the daemon knows; one-way messages.
bool moecache_client::send_placements(int fd) {
    for (;;) {
        std::tuple<uint32_t, uint32_t, uint32_t, uint32_t> p;
        {
            std::lock_guard lock(mu);
            if (placements_unsent.empty()) return true;
            p = placements_unsent.front();
        }
        const auto [handle, block, expert, device] = p;
        const uint32_t id = models[handle].load()->daemon_id.load();
        if (id != kNoId && !send_packet(fd, encode({0, ExpertPlacement{id, block, expert, device}})))
            return false;
        std::lock_guard lock(mu);
        placements_unsent.pop_front();
    }
}

bool moecache_client::send_pool_stats(int fd) {
    std::optional<Unmapped> u;
    {
        std::lock_guard lock(mu);
        if (unmapped_unsent) u = unmapped;
    }
    if (u) {
        if (!send_packet(fd, encode({0, *u}))) return false;
        std::lock_guard lock(mu);
        if (unmapped == u) unmapped_unsent = false;
    }
    for (uint32_t d = 0; d < kMaxPoolDevices; ++d) {
        PoolStats s;
        {
            std::lock_guard lock(mu);
            if (!pool_stats_unsent[d] || !pool_stats[d]) continue;
            s = *pool_stats[d];
        }
        if (!send_packet(fd, encode({0, s}))) return false;
        std::lock_guard lock(mu);
        if (pool_stats[d] == s) pool_stats_unsent[d] = false;
    }
    return true;
}

// Sends a request and waits for its reply; directives that arrive meanwhile are queued.
bool moecache_client::request(int fd, const Message& m, const std::vector<int>& fds, Message& reply) {
    if (!send_packet(fd, encode(m), fds)) return false;
    const auto deadline = now_ns() + uint64_t{kReplyTimeoutMs} * 1000000ull;
    while (now_ns() < deadline && !stop.load()) {
        bool hung_up = false;
        Message r;
        if (!read_one(fd, 100, r, hung_up)) {
            if (hung_up) return false;
            continue;
        }
        if (std::holds_alternative<Directive>(r.body) || std::holds_alternative<VramPolicy>(r.body)) {
            take_push(r);
            continue;
        }
        if (r.request == m.request) {
            reply = std::move(r);
            return true;
        }
    }
    return false;
}

bool moecache_client::register_model(int fd, Model& m) {
    std::vector<int> raw;
    for (const auto& f : m.fds) raw.push_back(f.get());
    Message reply;
    m.mappings_sent = 0;
    if (!request(fd, {next_request++, RegisterModel{static_cast<uint32_t>(raw.size())}}, raw, reply)) return false;
    if (const auto* r = std::get_if<ModelRegistered>(&reply.body)) {
        m.daemon_id.store(r->model, std::memory_order_release);
        return send_mappings(fd, m);
    }
    if (const auto* f = std::get_if<Failure>(&reply.body))
        std::fprintf(stderr, "moecache: %s not registered: %s\n", m.path.c_str(), f->text.c_str());
    return true;  // refused, but the connection is fine
}

// The mappings described since the last call, for a model the daemon knows.
bool moecache_client::send_mappings(int fd, Model& m) {
    const uint32_t id = m.daemon_id.load();
    if (id == kNoId) return true;
    for (;;) {
        Mapping mp{};
        {
            std::lock_guard lock(mu);
            if (m.mappings_sent >= m.mappings.size()) return true;
            mp = m.mappings[m.mappings_sent];
        }
        Message reply;
        if (!request(fd, {next_request++, DescribeMapping{id, mp.file, mp.address, mp.length, mp.file_offset}}, {}, reply))
            return false;
        if (const auto* f = std::get_if<Failure>(&reply.body))
            std::fprintf(stderr, "moecache: a mapping of %s refused: %s\n", m.path.c_str(), f->text.c_str());
        ++m.mappings_sent;
    }
}

bool moecache_client::session(int fd) {
    Message reply;
    if (!request(fd, {next_request++, Hello{kVersion, kVersion, name}}, {}, reply)) return false;
    if (const auto* f = std::get_if<Failure>(&reply.body)) {
        std::fprintf(stderr, "moecache: the daemon refused this client: %s\n", f->text.c_str());
        return false;
    }
    if (!std::holds_alternative<HelloReply>(reply.body)) return false;
    uint32_t registered = 0;
    auto register_new = [&]() -> bool {
        while (registered < models_count.load()) {
            if (!register_model(fd, *models[registered].load())) return false;
            ++registered;
        }
        return true;
    };
    if (!register_new()) return false;
    {
        std::lock_guard lock(mu);
        placements_unsent.clear();
        for (uint32_t d = 0; d < kMaxPoolDevices; ++d) pool_stats_unsent[d] = pool_stats[d].has_value();
        unmapped_unsent = unmapped.has_value();
        for (const auto& [k, device] : placements)
            placements_unsent.emplace_back(std::get<0>(k), std::get<1>(k), std::get<2>(k), device);
    }
    auto ring_made = telemetry::TelemetryRing::create(kRingBytes);
    if (!ring_made) {
        std::fprintf(stderr, "moecache: no telemetry ring: %s\n", ring_made.error().what().c_str());
        return false;
    }
    auto r = std::make_unique<telemetry::TelemetryRing>(std::move(*ring_made));
    if (!request(fd, {next_request++, TelemetrySetup{kRingBytes}}, {r->fd()}, reply) ||
        !std::holds_alternative<Ok>(reply.body))
        return false;
    telemetry::TelemetryRing* live = r.get();
    {
        std::lock_guard lock(mu);
        rings.push_back(std::move(r));
    }
    ring.store(live, std::memory_order_release);
    connected.store(true);
    connects.fetch_add(1);
    said_absent = false;
    {
        std::lock_guard lock(mu);
        ready = registered == models_count.load();
    }
    cv.notify_all();
    for (;;) {
        if (stop.load()) return true;
        bool hung_up = false;
        Message m;
        if (read_one(fd, 200, m, hung_up)) take_push(m);
        if (hung_up) return false;
        uint64_t v;
        while (::read(wake.get(), &v, sizeof v) > 0) {}
        if (registered < models_count.load()) {
            if (!register_new()) return false;
            std::lock_guard lock(mu);
            ready = true;
            cv.notify_all();
        }
        for (uint32_t h = 0; h < registered; ++h)
            if (!send_mappings(fd, *models[h].load())) return false;
        // The pool before what it holds: the daemon counts a client's placements once it reported a pool.
        if (!send_pool_stats(fd)) return false;
        if (!send_placements(fd)) return false;
    }
}

bool moecache_client::trusted_peer(int fd) {
    ucred peer{};
    socklen_t len = sizeof peer;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) return false;
    if (peer.uid == 0 || peer.uid == ::geteuid()) return true;
    const char* user = std::getenv("MOECACHE_DAEMON_USER");
    if (user == nullptr || *user == '\0') user = "moecached";
    // A number is a uid (a container whose image has no such user); else a name, looked up with
    // getpwnam_r and a buffer of its own (this runs in the worker of a preloaded library).
    char* end = nullptr;
    const unsigned long as_uid = std::strtoul(user, &end, 10);
    const bool numeric = end != user && *end == '\0';
    passwd pw{}, *found = nullptr;
    std::vector<char> buf(4096);
    const bool known = numeric || (::getpwnam_r(user, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr);
    if (known && peer.uid == (numeric ? static_cast<uid_t>(as_uid) : pw.pw_uid)) return true;
    if (!said_untrusted) {
        std::fprintf(stderr,
                     "moecache: the socket %s is held by pid %d of uid %u, not root, user %s%s or this process's "
                     "user: nothing is sent to it (no model descriptors, no telemetry); set MOECACHE_DAEMON_USER "
                     "if moecached runs as another user\n",
                     socket_path.c_str(), static_cast<int>(peer.pid), static_cast<unsigned>(peer.uid), user,
                     known ? "" : " (no such user here)");
        said_untrusted = true;
    }
    return false;
}

void moecache_client::run() {
    int backoff_ms = 100;
    while (!stop.load()) {
        UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
        sockaddr_un a{};
        a.sun_family = AF_UNIX;
        std::memcpy(a.sun_path, socket_path.c_str(), std::min(socket_path.size() + 1, sizeof a.sun_path - 1));
        const bool reached = s && ::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
        const int why = errno;
        if (reached && trusted_peer(s.get())) {
            backoff_ms = 100;
            (void)session(s.get());
            ring.store(nullptr, std::memory_order_release);
            connected.store(false);
            for (uint32_t h = 0; h < models_count.load(); ++h) models[h].load()->daemon_id.store(kNoId);
            {
                std::lock_guard lock(mu);
                ready = false;
            }
            if (stop.load()) break;
        } else if (!reached && !said_absent) {
            std::fprintf(stderr, "moecache: no daemon at %s (%s): running without it, connecting when it appears\n",
                         socket_path.c_str(), std::strerror(why));
            said_absent = true;
        }  // reached but not trusted: nothing was sent; tried again as if no daemon were there
        pollfd p{wake.get(), POLLIN, 0};
        ::poll(&p, 1, backoff_ms);
        backoff_ms = std::min(backoff_ms * 2, 2000);
    }
}

extern "C" {

moecache_client* moecache_client_open(const char* socket_path, const char* name) {
    auto c = std::make_unique<moecache_client>();
    const char* env = std::getenv("MOECACHE_SOCKET");
    c->socket_path = socket_path ? socket_path : env && *env ? env : "/run/moecache/moecached.sock";
    c->name = name ? std::string(name).substr(0, kMaxName) : "";
    for (char& ch : c->name)
        if (ch < 0x20 || ch > 0x7e) ch = '?';
    c->wake.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!c->wake) return nullptr;
    if (const char* t = std::getenv("MOECACHE_TRACE"); t && *t) c->trace = moecache::client::TraceWriter::open(t);
    try {
        c->worker = std::thread([p = c.get()] { p->run(); });
    } catch (...) {
        return nullptr;
    }
    return c.release();
}

int moecache_client_register_model(moecache_client* c, const char* path, uint32_t* handle) {
    if (!c || !path || !handle) return -EINVAL;
    auto parts = open_gguf_model(path);
    if (!parts) return -(parts.error().errnum ? parts.error().errnum : EINVAL);
    auto m = std::make_unique<Model>();
    m->path = path;
    for (const auto& p : *parts) {
        UniqueFd fd(::open(p.path.c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd) return -errno;
        m->fds.push_back(std::move(fd));
    }
    std::lock_guard lock(c->mu);
    const uint32_t h = c->models_count.load();
    if (h >= kMaxModels) return -ENOSPC;
    if (c->trace) {
        if (auto map = ExpertMap::build(*parts))
            c->trace->add_model(h, *map, path);
        else
            std::fprintf(stderr, "moecache: MOECACHE_TRACE: %s is left out: %s\n", path, map.error().what().c_str());
    }
    c->models[h].store(m.get());
    c->owned.push_back(std::move(m));
    c->models_count.store(h + 1);
    c->ready = false;
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    *handle = h;
    return 0;
}

int moecache_client_describe_mapping(moecache_client* c, uint32_t handle, uint32_t file, const void* address,
                                     uint64_t length, uint64_t file_offset) {
    if (!c || handle >= c->models_count.load() || length == 0) return -EINVAL;
    const auto a = reinterpret_cast<uint64_t>(address);
    if (a + length < a || file_offset + length < file_offset) return -EINVAL;
    {
        std::lock_guard lock(c->mu);
        Model* m = c->models[handle].load();
        if (file >= m->fds.size()) return -EINVAL;
        m->mappings.push_back({file, a, length, file_offset});
    }
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    return 0;
}

int moecache_client_report(moecache_client* c, uint32_t handle, uint32_t block, const uint32_t* experts, uint32_t n,
                           uint32_t tokens) {
    if (!c || handle >= c->models_count.load(std::memory_order_acquire) || (n > 0 && !experts)) return -EINVAL;
    c->reported.fetch_add(1, std::memory_order_relaxed);
    if (c->trace) c->trace->decision(handle, block, tokens, experts, n);
    const uint32_t id = c->models[handle].load(std::memory_order_acquire)->daemon_id.load(std::memory_order_acquire);
    telemetry::TelemetryRing* r = c->ring.load(std::memory_order_acquire);
    if (!r || id == kNoId || block > 0xffff) {
        c->dropped.fetch_add(1, std::memory_order_relaxed);
        return 0;
    }
    telemetry::RoutingEvent e;
    e.time_ns = now_ns();
    e.model = id;
    e.block = static_cast<uint16_t>(block);
    e.tokens = tokens;
    bool all = true;
    while (c->push_lock.test_and_set(std::memory_order_acquire)) {}
    uint32_t at = 0;
    do {
        const uint32_t k = std::min<uint32_t>(n - at, telemetry::kMaxExpertsPerRecord);
        e.n_experts = static_cast<uint8_t>(k);
        e.tokens = at == 0 ? tokens : 0;  // a batch larger than a record: its tokens are counted once
        e.continued = at != 0;
        for (uint32_t i = 0; i < k; ++i) e.experts[i] = static_cast<uint16_t>(std::min<uint32_t>(experts[at + i], 0xffff));
        all = r->push(e) && all;
        at += k;
    } while (at < n);
    c->push_lock.clear(std::memory_order_release);
    (all ? c->sent : c->overflow).fetch_add(1, std::memory_order_relaxed);
    return all ? 1 : 0;
}

int moecache_client_report_placement(moecache_client* c, uint32_t handle, uint32_t block, uint32_t expert,
                                     int32_t device) {
    if (!c || handle >= c->models_count.load() || device < -1) return -EINVAL;
    const uint32_t dev = device < 0 ? kHostTier : static_cast<uint32_t>(device);
    {
        std::lock_guard lock(c->mu);
        const auto key = std::make_tuple(handle, block, expert);
        if (dev == kHostTier) {
            if (c->placements.erase(key) == 0) return 0;  // was in no pool: nothing to say
        } else {
            c->placements[key] = dev;
        }
        if (c->placements_unsent.size() >= 1u << 20) return -ENOBUFS;
        c->placements_unsent.emplace_back(handle, block, expert, dev);
    }
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    return 0;
}

int moecache_client_report_pool(moecache_client* c, uint32_t device, const moecache_pool_stats* stats) {
    if (!c || !stats || device >= kMaxPoolDevices) return -EINVAL;
    {
        std::lock_guard lock(c->mu);
        c->pool_stats[device] = PoolStats{device,          stats->hits,       stats->misses,        stats->hit_bytes,
                                          stats->miss_bytes, stats->pool_bytes, c->miss_paths[device]};
        c->pool_stats_unsent[device] = true;
    }
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    return 0;
}

int moecache_client_report_miss_path(moecache_client* c, uint32_t device, int path) {
    if (!c || device >= kMaxPoolDevices || path < 0 || path > kLastMissPath) return -EINVAL;
    {
        std::lock_guard lock(c->mu);
        if (c->miss_paths[device] == static_cast<MissPath>(path)) return 0;
        c->miss_paths[device] = static_cast<MissPath>(path);
        if (!c->pool_stats[device]) return 0;  // goes with the device's first statistics
        c->pool_stats[device]->miss_path = c->miss_paths[device];
        c->pool_stats_unsent[device] = true;
    }
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    return 0;
}

int moecache_client_report_unmapped(moecache_client* c, uint64_t copies, uint64_t bytes, int no_model) {
    if (!c) return -EINVAL;
    {
        std::lock_guard lock(c->mu);
        const Unmapped u{copies, bytes, no_model != 0};
        if (c->unmapped == u) return 0;
        c->unmapped = u;
        c->unmapped_unsent = true;
    }
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    return 0;
}

int moecache_client_vram_policy(const moecache_client* c, uint32_t device, uint64_t* pool_bytes, int* one_place) {
    if (!c || device >= moecache_client::kMaxBudgetDevices || !c->connected.load()) return 0;
    const uint64_t v = c->budgets[device].load();
    const int o = c->one_place[device].load();
    if (v == 0 || o == 0) return 0;
    if (pool_bytes) *pool_bytes = v == UINT64_MAX ? UINT64_MAX : v - 1;
    if (one_place) *one_place = o == 1 ? 1 : 0;
    return 1;
}

int moecache_client_pool_recency(const moecache_client* c, uint32_t device) {
    if (!c || device >= moecache_client::kMaxBudgetDevices || !c->connected.load()) return 0;
    return c->recency[device].load() == 1 ? 1 : 0;
}

size_t moecache_client_poll(moecache_client* c, moecache_directive* out, size_t max) {
    if (!c || !out) return 0;
    std::lock_guard lock(c->mu);
    size_t n = 0;
    while (n < max && !c->directives.empty()) {
        out[n++] = c->directives.front();
        c->directives.pop_front();
    }
    return n;
}

void moecache_client_stats_get(const moecache_client* c, moecache_client_stats* out) {
    if (!c || !out) return;
    out->reported = c->reported.load();
    out->sent = c->sent.load();
    out->dropped = c->dropped.load();
    out->overflow = c->overflow.load();
    out->connects = c->connects.load();
    out->connected = c->connected.load() ? 1 : 0;
}

int moecache_client_wait_ready(moecache_client* c, int timeout_ms) {
    if (!c) return 0;
    std::unique_lock lock(c->mu);
    return c->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return c->ready && c->connected.load(); })
               ? 1
               : 0;
}

void moecache_client_close(moecache_client* c) {
    if (!c) return;
    c->stop.store(true);
    const uint64_t one = 1;
    (void)!::write(c->wake.get(), &one, sizeof one);
    if (c->worker.joinable()) c->worker.join();
    delete c;
}

}  // extern "C"
