// What clients say and what it does (docs/protocol.md): Hello, a model's registration (the model
// opened off the loop when it is new, the answer once it is open), mappings, telemetry rings, a
// hook's placements, pool counters and unmapped copies, Goodbye; the routing rings read each turn,
// shared out fairly between clients; and the models of the clients that went. Everything a client
// sends is untrusted: a Failure names what is wrong; a protocol violation (a packet that does not
// decode, a request before Hello) also closes the connection, a request that cannot be met does
// not. The connections themselves are the ClientHub's.
#pragma once

#include "clients/socket_server.h"
#include "moecache/daemon/config.h"
#include "moecache/daemon/mapped_model.h"
#include "moecache/daemon/status.h"

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace moecache::daemon {

class ClientHub;
class DecideStep;
class ModelRegistry;
struct Client;
struct ModelEntry;

class ClientSessions {
public:
    // A routing a client reported (continued: more of a decision an earlier turn began reading).
    using RoutingSink = std::function<void(ModelEntry& m, uint32_t block, std::span<const uint32_t> experts,
                                           uint32_t tokens, bool continued)>;
    ClientSessions(const Config& config, const std::optional<gid_t>& admin_gid, ModelRegistry& models, ClientHub& hub,
                   DecideStep& decide, RoutingSink routing);

    // Handles one packet; false when the client must be dropped (after a Failure was sent).
    bool on_packet(Client& c, Packet& p);
    // A model's open ended: the registrations that waited for it are answered, in the order they came.
    void finish_registrations(uint32_t model);
    // The turn's routing records from every client's ring (at most kEventsPerTurn together).
    void read_rings();
    // The connections that went this turn: their models' one place settled again, and a model a
    // client registered (and no configuration names) goes with the last client holding it.
    void reap();
    // As the last turn found the rings: any at all, and one filling fast (the loop comes back soon).
    [[nodiscard]] bool any_rings() const { return any_rings_; }
    [[nodiscard]] bool busy_rings() const { return busy_rings_; }
    // By device: the hooks' pool counters, accumulated over clients that came and went.
    [[nodiscard]] const std::map<uint32_t, PoolDeviceStatus>& pool_totals() const { return pool_totals_; }
    [[nodiscard]] uint64_t unmapped_bytes() const { return unmapped_bytes_; }  // accumulated from Unmapped

    // Routing records read in a turn, all clients together, shared out evenly (each at least
    // kMinEventsPerClient): a ring left fuller fills, and its client counts what it could not
    // write. Each client could take 2^16 a turn: 16 full rings held the loop ~1 s a turn (64 of
    // them ~4 s), and with it D-Bus answers and every client's directives.
    static constexpr size_t kEventsPerTurn = size_t{1} << 16;
    static constexpr size_t kMinEventsPerClient = 1024;

private:
    // A registration waiting for its model's open.
    struct PendingRegistration {
        uint32_t client = 0, request = 0, model = 0;
        bool existed = false;  // the model's entry was there before this registration
        std::vector<FileIdentity> ids;
    };
    bool register_model(Client& c, uint32_t request, std::vector<UniqueFd>& fds);
    // The rest of a registration, once its model is open (or could not be): the answer.
    bool finish_registration(Client& c, const PendingRegistration& p);
    // Why one more model (`m`; null: one not open yet) is past what the clients of c's uid may
    // hold of models users registered ([clients] max_models_per_uid, max_experts_per_uid), or "".
    // `pending`: the registrations still opening count too (before an open); after one, only
    // what its clients hold.
    std::string past_share(const Client& c, const ModelEntry* m, bool pending);
    bool on_placement(Client& c, const protocol::ExpertPlacement& x);
    bool on_pool_stats(Client& c, const protocol::PoolStats& x);
    bool on_unmapped(Client& c, const protocol::Unmapped& x);

    const Config& config_;
    const std::optional<gid_t>& admin_gid_;
    ModelRegistry& models_;
    ClientHub& hub_;
    DecideStep& decide_;
    RoutingSink routing_;
    std::vector<PendingRegistration> registering_;
    std::map<uint32_t, PoolDeviceStatus> pool_totals_;
    uint64_t unmapped_bytes_ = 0;
    bool any_rings_ = false, busy_rings_ = false;
    size_t ring_turn_ = 0;          // whose ring is read first, rotating
    std::vector<uint32_t> joined_;  // a decision of several records, joined
};

}  // namespace moecache::daemon
