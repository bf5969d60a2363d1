// The client socket's connections (docs/protocol.md), as transport: who may connect (the peer's
// credentials against [clients]), each connection's packets in and messages out (what a client
// reads more slowly than the daemon decides waits here, in order, up to kMaxUnsentBytes), the
// directives a turn queued for each, connections that never said Hello or never registered a model,
// and the listener paused while the process is out of descriptors. What a message means is the
// ClientSessions'; this owns the connections and nothing of the models.
#pragma once

#include "clients/socket_server.h"
#include "moecache/client/protocol.h"
#include "moecache/client/telemetry_ring.h"
#include "moecache/daemon/config.h"
#include "moecache/process_role.h"

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moecache::daemon {

// One connection, and what its client said and was told. Owned by the ClientHub; the daemon reads
// and writes the protocol state (its models, pool, ring) on the loop's thread.
struct Client {
    uint32_t id = 0;
    UniqueFd conn;
    PeerIdentity peer;
    bool hello = false;
    std::chrono::steady_clock::time_point connected;  // Hello is due within [clients] hello_seconds
    std::string name;
    // What its process was started as (/proc/PID/cmdline at Hello; the default where the pid is
    // not seen): a runtime that reads its model into private memory, ollama's old runner.
    ProcessRole role;
    std::vector<uint32_t> models;  // model ids it registered
    std::unique_ptr<telemetry::TelemetryRing> ring;
    std::set<std::pair<uint32_t, uint32_t>> vram;  // (model id, slot) its VRAM pool holds, as it says
    bool has_pool = false;                         // it sent an ExpertPlacement or PoolStats: a CUDA hook
    // It reported a pool of some bytes (PoolStats): only then do its placements count for the
    // one-place rule; until then they wait.
    bool pool_reported = false;
    std::set<uint32_t> told_not_releasing;             // model ids its pool may not release: logged once each
    std::set<std::pair<uint32_t, uint32_t>> promoted;  // (model id, slot) it was told to keep in VRAM
    // Its pool came to hold nine in ten of what it was directed to (bind_promoted): its first fill,
    // from the files, is over, and the rest of its changes go through RAM's locks.
    bool pool_filled = false;
    bool one_place_told = true;      // the one_place of the last VramPolicy it was sent
    bool recency_told = false;       // ... and its recency (direct_pools: its pool's split)
    uint32_t directed_capacity = 0;  // experts its pool is directed to hold, over its models (direct_pools)
    // By model id: the routing shifts of that model's heat it was last told of (a Shifted directive
    // each; direct_pools). Shifts before it held a pool are not told: its counts began after them.
    std::map<uint32_t, uint64_t> shifts_told;
    std::chrono::steady_clock::time_point pool_since;  // when it first reported its pool
    std::map<uint32_t, protocol::PoolStats> pools;     // by device: the last PoolStats it sent
    protocol::Unmapped unmapped;                       // the last Unmapped it sent
    uint64_t events = 0, bad_events = 0;
    // Directives decided this turn (locks, unlocks, promotions), sent together at its end.
    std::vector<protocol::Directive> outbox;
    // Packets its socket had no room for (it reads more slowly than a turn decides: a pool's first
    // Locks and Promotes are thousands), in order; sent as it reads (EPOLLOUT), at most
    // kMaxUnsentBytes before it counts as a client that stopped reading.
    std::deque<std::vector<uint8_t>> unsent;
    size_t unsent_bytes = 0;
    bool watching_writable = false;
    bool dead = false;  // dropped this turn; reaped at its end

    [[nodiscard]] bool holds(uint32_t model) const {
        for (uint32_t m : models)
            if (m == model) return true;
        return false;
    }
};

class ClientHub {
public:
    // config: the daemon's, read as connections come ([clients]); epoll_fd: the loop's.
    ClientHub(const Config& config, int epoll_fd);
    // Listens on [daemon] socket (none when it is empty).
    Result<void> listen();

    // The listener woke the loop: takes the connections waiting, at most kAcceptsPerTurn.
    void accept();
    // A connection woke the loop (events: epoll's): what it sent goes to `on_packet`, a packet at a
    // time up to kPacketsPerTurn, which returns false when the client broke the protocol (it is
    // dropped then); what waited to be sent goes as it has room.
    using PacketHandler = std::function<bool(Client&, Packet&)>;
    void on_event(int fd, uint32_t events, const PacketHandler& on_packet);

    // A message to a client (request: the one it answers, 0 for none); a client whose socket is
    // gone, or that stopped reading, is dropped.
    void reply(Client& c, uint32_t request, const protocol::Body& body);
    // A Failure: `refuse` is for a protocol violation (false: drop it), `cannot` for a request that
    // cannot be met (true: it stays).
    bool refuse(Client& c, uint32_t request, int errnum, const std::string& text);
    bool cannot(Client& c, uint32_t request, int errnum, const std::string& text);
    // Marked gone (said once with why); reaped at the turn's end.
    void drop(Client& c, const std::string& why);
    // Sends each client the directives its outbox holds, in the order they were decided.
    void flush();
    // The tick: the listener listens again, and connections silent past [clients] hello_seconds or
    // idle past idle_seconds are dropped.
    void tick();
    // Closes the dropped connections; returns the models they had registered (each as often as
    // a client had it), for the daemon to settle.
    std::vector<uint32_t> reap();

    [[nodiscard]] const std::vector<std::unique_ptr<Client>>& all() const { return clients_; }
    [[nodiscard]] Client* find(uint32_t id);
    [[nodiscard]] bool empty() const { return clients_.empty(); }
    // Whether a live client holds model `id` (or any, counting the dead ones too: a model whose
    // last client went this turn is still "held" until reap()).
    [[nodiscard]] bool held(uint32_t model) const;
    [[nodiscard]] const std::string& socket_path() const;
    [[nodiscard]] uint64_t refused() const { return refused_; }
    [[nodiscard]] uint64_t accept_pauses() const { return accept_pauses_; }

    static constexpr int kAcceptsPerTurn = 64;
    static constexpr int kPacketsPerTurn = 64;
    // What may wait for a client that reads more slowly than the daemon decides (a pool's first
    // Locks and Promotes: a directive is a few dozen bytes), before it counts as one that stopped reading.
    static constexpr size_t kMaxUnsentBytes = 1u << 20;

private:
    void on_writable(Client& c);
    void on_readable(Client& c, const PacketHandler& on_packet);
    void watch_writable(Client& c, bool on);
    void pause_listener(const std::string& why);  // out of descriptors: stop waiting on the listener
    void resume_listener();

    const Config& config_;
    int epoll_fd_;
    std::unique_ptr<SocketServer> server_;
    std::vector<std::unique_ptr<Client>> clients_;
    std::unordered_map<int, Client*> by_fd_;
    uint32_t next_id_ = 1;
    uint64_t refused_ = 0;
    uint64_t accept_pauses_ = 0;     // times the listener was paused for want of descriptors
    bool listener_paused_ = false;   // not in the epoll set's interest now
    bool listener_starved_ = false;  // since the last pause, no connection could be accepted
    bool said_pid_hidden_ = false;   // a root client whose pid this PID namespace cannot see, said once
};

}  // namespace moecache::daemon
