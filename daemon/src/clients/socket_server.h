// The daemon's end of the client socket, as I/O only: a listening SOCK_SEQPACKET socket, accepted
// connections with the peer's identity (SO_PEERCRED, and a pidfd where the kernel gives one, so
// that a recycled PID cannot pose as the client), and packets with their descriptors. Every
// descriptor that arrives is owned at once (UniqueFd), so that none can leak whatever happens next.
// No daemon state here: Daemon decides what a packet means.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecache::daemon {

struct PeerIdentity {
    pid_t pid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
    std::vector<gid_t> groups;  // supplementary, as the kernel saw them at connect (SO_PEERGROUPS)
    UniqueFd pidfd;  // -1 where pidfd_open is missing or the process has gone
    // What its connections are counted under for [clients] max_per_uid: "uid N", or for root
    // "cgroup PATH" (its unified-hierarchy cgroup at connect: a service, a pod's container).
    std::string fairness_key;
};

struct Packet {
    std::vector<uint8_t> bytes;
    std::vector<UniqueFd> fds;
    bool oversized = false;       // MSG_TRUNC: longer than the largest message
    bool fds_truncated = false;   // MSG_CTRUNC: more descriptors than any message takes
};

class SocketServer {
public:
    // Binds `path` (its directory is made 0755 if missing; a stale socket file is replaced, a live
    // one or any other file is an error naming it) with mode 0666: who may talk is decided per
    // connection from the peer's credentials, not by the file's mode.
    // Under socket activation (moecached.socket) the listening socket systemd passed for `path` is
    // taken over instead, with the connections already waiting on it; it stays where it is when the
    // server goes (systemd owns the file). Passed descriptors that are not for `path` are closed.
    static Result<SocketServer> listen(const std::string& path);
    SocketServer(SocketServer&&) noexcept = default;
    SocketServer& operator=(SocketServer&&) noexcept = default;
    ~SocketServer();

    [[nodiscard]] int fd() const { return fd_.get(); }
    [[nodiscard]] const std::string& path() const { return path_; }
    [[nodiscard]] bool activated() const { return activated_; }  // passed by systemd, not bound here

    // A pending connection, or an empty fd when none waits (EAGAIN). Non-blocking, close-on-exec.
    Result<UniqueFd> accept();

private:
    SocketServer() = default;
    static Result<std::optional<SocketServer>> adopt(const std::string& path);
    UniqueFd fd_;
    std::string path_;
    bool activated_ = false;
};

Result<PeerIdentity> peer_identity(int conn);

// Reads one packet without waiting. An empty result with `closed` set means the peer hung up;
// with neither a packet nor closed, nothing was there (EAGAIN).
struct Received {
    bool closed = false;
    bool got = false;
    Packet packet;
};
Result<Received> receive(int conn, size_t max_bytes, size_t max_fds);

// Sends one packet without waiting; EAGAIN (the peer stopped reading) is an error the caller
// handles by dropping the client.
Result<void> send_nowait(int conn, const std::vector<uint8_t>& bytes);
// One packet if the socket takes it now: true sent, false it would block (its buffer is full).
Result<bool> try_send(int conn, const std::vector<uint8_t>& bytes);

}  // namespace moecache::daemon
