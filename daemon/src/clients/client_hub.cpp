#include "clients/client_hub.h"

#include "event_source.h"
#include "moecache/log.h"

#include <poll.h>
#include <sys/epoll.h>

#include <algorithm>
#include <cstring>

namespace moecache::daemon {

using namespace moecache::protocol;

ClientHub::ClientHub(const Config& config, int epoll_fd) : config_(config), epoll_fd_(epoll_fd) {}

Result<void> ClientHub::listen() {
    if (config_.socket_path.empty()) return {};
    auto server = SocketServer::listen(config_.socket_path);
    if (!server) return tl::unexpected(with_context(server.error(), "the client socket ([daemon] socket)"));
    server_ = std::make_unique<SocketServer>(std::move(*server));
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = event_data(EventSource::Listener, server_->fd());
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, server_->fd(), &ev) != 0)
        return fail_errno("epoll_ctl (the client socket)");
    return {};
}

const std::string& ClientHub::socket_path() const {
    static const std::string none;
    return server_ ? server_->path() : none;
}

void ClientHub::accept() {
    if (!server_) return;
    for (int i = 0; i < kAcceptsPerTurn; ++i) {
        auto conn = server_->accept();
        if (!conn) {
            const int e = conn.error().errnum;
            if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
                // The connection stays queued and the listener readable: waiting on it again would
                // spin. Paused until a client leaves or the next tick, with one line for the pause.
                pause_listener(conn.error().what());
                return;
            }
            MC_LOG(LOG_WARNING, "client socket: {}", conn.error().what());
            return;
        }
        if (!*conn) return;
        if (listener_starved_) {
            listener_starved_ = false;
            MC_LOG(LOG_INFO, "client socket: accepting connections again");
        }
        auto c = std::make_unique<Client>();
        c->conn = std::move(*conn);
        auto peer = peer_identity(c->conn.get());
        if (!peer) {
            ++refused_;
            continue;
        }
        c->peer = std::move(*peer);
        if (c->peer.uid == 0 && c->peer.pid == 0 && !said_pid_hidden_) {
            // A peer the kernel cannot name here: its PID namespace is not this one's or below it
            // (a pod, where moecached runs without the host's PID namespace).
            said_pid_hidden_ = true;
            MC_LOG(LOG_WARNING,
                   "a root client's pid is not visible in moecached's PID namespace: root clients share "
                   "one [clients] max_per_uid count instead of one per cgroup; run moecached in the host's "
                   "PID namespace (hostPID on Kubernetes)");
        }
        c->id = next_id_++;
        c->connected = std::chrono::steady_clock::now();
        const auto& uids = config_.client_allow_uids;
        const auto& gids = config_.client_allow_gids;
        const bool allowed = c->peer.uid == 0 || (uids.empty() && gids.empty()) ||
                             std::find(uids.begin(), uids.end(), c->peer.uid) != uids.end() ||
                             std::find(gids.begin(), gids.end(), c->peer.gid) != gids.end();
        std::string why;
        if (!allowed)
            why = fmt::format("uid {} (gid {}) may not use moecached: [clients] allow_uids / allow_gids", c->peer.uid,
                              c->peer.gid);
        else if (clients_.size() >= config_.max_clients)
            why = fmt::format("moecached serves {} clients already ([clients] max)", clients_.size());
        else if (std::count_if(clients_.begin(), clients_.end(), [&](const auto& o) {
                     return !o->dead && o->peer.fairness_key == c->peer.fairness_key;
                 }) >= static_cast<std::ptrdiff_t>(config_.max_clients_per_uid))
            why = fmt::format("{} holds {} connections already ([clients] max_per_uid; root's are counted per cgroup)",
                              c->peer.fairness_key, config_.max_clients_per_uid);
        if (!why.empty()) {
            ++refused_;
            (void)send_nowait(c->conn.get(), encode({0, Failure{EACCES, why}}));
            continue;
        }
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = event_data(EventSource::Client, c->conn.get());
        if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->conn.get(), &ev) != 0) {
            ++refused_;
            continue;
        }
        by_fd_[c->conn.get()] = c.get();
        clients_.push_back(std::move(c));
    }
}

void ClientHub::on_event(int fd, uint32_t events, const PacketHandler& on_packet) {
    // Looked up by descriptor: a client dropped earlier in this batch is gone.
    const auto it = by_fd_.find(fd);
    if (it == by_fd_.end()) return;
    if ((events & EPOLLOUT) != 0) on_writable(*it->second);
    if ((events & ~static_cast<uint32_t>(EPOLLOUT)) != 0) on_readable(*it->second, on_packet);
}

void ClientHub::reply(Client& c, uint32_t request, const Body& body) {
    if (c.dead) return;
    auto bytes = encode({request, body});
    if (c.unsent.empty()) {
        const auto sent = try_send(c.conn.get(), bytes);
        if (!sent) {
            drop(c, fmt::format("cannot answer it ({})", sent.error().what()));
            return;
        }
        if (*sent) return;
    }
    // Its socket is full: what it has not read yet waits here, in order, until it reads.
    if (c.unsent_bytes + bytes.size() > kMaxUnsentBytes) {
        drop(c, fmt::format("it stopped reading: {} bytes of messages wait for it", c.unsent_bytes));
        return;
    }
    c.unsent_bytes += bytes.size();
    c.unsent.push_back(std::move(bytes));
    watch_writable(c, true);
}

void ClientHub::on_writable(Client& c) {
    while (!c.dead && !c.unsent.empty()) {
        const auto sent = try_send(c.conn.get(), c.unsent.front());
        if (!sent) {
            drop(c, fmt::format("cannot answer it ({})", sent.error().what()));
            return;
        }
        if (!*sent) return;
        c.unsent_bytes -= c.unsent.front().size();
        c.unsent.pop_front();
    }
    if (!c.dead) watch_writable(c, false);
}

void ClientHub::watch_writable(Client& c, bool on) {
    if (c.watching_writable == on) return;
    epoll_event ev{};
    ev.events = EPOLLIN | (on ? EPOLLOUT : 0u);
    ev.data.u64 = event_data(EventSource::Client, c.conn.get());
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.conn.get(), &ev) != 0) {
        drop(c, fmt::format("cannot wait for its socket: {}", std::strerror(errno)));
        return;
    }
    c.watching_writable = on;
}

bool ClientHub::refuse(Client& c, uint32_t request, int errnum, const std::string& text) {
    reply(c, request, Failure{errnum, text});
    return false;
}

bool ClientHub::cannot(Client& c, uint32_t request, int errnum, const std::string& text) {
    reply(c, request, Failure{errnum, text});
    return true;
}

void ClientHub::drop(Client& c, const std::string& why) {
    if (c.dead) return;
    c.dead = true;
    MC_LOG(LOG_INFO, "client {} (pid {}, uid {}{}{}) gone: {}", c.id, c.peer.pid, c.peer.uid,
           c.name.empty() ? "" : ", ", c.name, why);
}

void ClientHub::on_readable(Client& c, const PacketHandler& on_packet) {
    for (int i = 0; i < kPacketsPerTurn && !c.dead; ++i) {
        auto got = receive(c.conn.get(), kMaxMessageBytes, kMaxModelFiles);
        if (!got) {
            drop(c, got.error().what());
            return;
        }
        if (got->closed) {
            drop(c, "it closed the connection");
            return;
        }
        if (!got->got) return;
        if (!on_packet(c, got->packet)) drop(c, "it broke the protocol");
    }
}

void ClientHub::flush() {
    for (auto& c : clients_) {
        std::vector<Directive> out;
        out.swap(c->outbox);
        for (const auto& d : out) reply(*c, 0, d);
    }
}

Client* ClientHub::find(uint32_t id) {
    for (auto& c : clients_)
        if (c->id == id && !c->dead) return c.get();
    return nullptr;
}

bool ClientHub::held(uint32_t model) const {
    return std::any_of(clients_.begin(), clients_.end(), [&](const auto& c) { return c->holds(model); });
}

void ClientHub::pause_listener(const std::string& why) {
    if (listener_paused_ || !server_) return;
    epoll_event ev{};
    ev.events = 0;
    ev.data.u64 = event_data(EventSource::Listener, server_->fd());
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, server_->fd(), &ev) != 0) return;
    listener_paused_ = true;
    if (listener_starved_) return;  // tried again (a tick, a client left) and still out: said already
    listener_starved_ = true;
    ++accept_pauses_;
    MC_LOG(LOG_WARNING, "client socket: {}: not accepting connections until a client leaves or the next tick", why);
}

void ClientHub::resume_listener() {
    if (!listener_paused_ || !server_) return;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = event_data(EventSource::Listener, server_->fd());
    if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, server_->fd(), &ev) == 0) listener_paused_ = false;
}

// A connection that has not said Hello in time holds a slot (and a descriptor) for nothing. One
// whose Hello waits unread was in time: the loop is late (a long turn), not the client (on the GPU
// machine a runtime's reconnections were dropped so, one after another, for 40 s).
void ClientHub::tick() {
    resume_listener();
    const auto now = std::chrono::steady_clock::now();
    for (auto& c : clients_) {
        if (c->dead) continue;
        const bool silent = !c->hello && now - c->connected > std::chrono::duration<double>(config_.hello_seconds);
        // One that said Hello but registered no model holds a slot for nothing too (a runtime's
        // GPU probe that inherited the hook, a client left behind): its library connects again.
        const bool idle = c->hello && c->models.empty() && config_.idle_seconds > 0 &&
                          now - c->connected > std::chrono::duration<double>(config_.idle_seconds);
        if (!silent && !idle) continue;
        pollfd p{c->conn.get(), POLLIN, 0};
        if (::poll(&p, 1, 0) == 1 && (p.revents & POLLIN) != 0) continue;
        ++refused_;
        drop(*c, silent
                     ? fmt::format("no Hello within {} s ([clients] hello_seconds)", config_.hello_seconds)
                     : fmt::format("no model registered within {} s ([clients] idle_seconds)", config_.idle_seconds));
    }
}

std::vector<uint32_t> ClientHub::reap() {
    std::vector<uint32_t> models;
    bool any = false;
    for (auto& c : clients_) any = any || c->dead;
    if (!any) return models;
    for (auto& c : clients_) {
        if (!c->dead) continue;
        const uint64_t overflow = c->ring ? c->ring->counters().overflow : 0;
        MC_LOG(LOG_INFO, "client {} ({}) telemetry: {} events, {} refused, {} overflowed in its ring", c->id,
               c->name.empty() ? "unnamed" : c->name, c->events, c->bad_events, overflow);
        by_fd_.erase(c->conn.get());
        // The fd is closed with the client, which takes it out of the epoll set.
        models.insert(models.end(), c->models.begin(), c->models.end());
    }
    clients_.erase(std::remove_if(clients_.begin(), clients_.end(), [](const auto& c) { return c->dead; }),
                   clients_.end());
    resume_listener();  // a descriptor came free
    return models;
}

}  // namespace moecache::daemon
