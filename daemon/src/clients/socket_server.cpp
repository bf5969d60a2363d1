#include "socket_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace moecache::daemon {

SocketServer::~SocketServer() {
    // Only the file this server bound: a successor may have replaced it already.
    if (fd_ && !path_.empty()) {
        struct stat st {};
        if (::lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path_.c_str());
    }
}

Result<SocketServer> SocketServer::listen(const std::string& path) {
    sockaddr_un addr{};
    if (path.empty() || path.size() >= sizeof addr.sun_path)
        return failf("socket path '{}' is empty or longer than the {} bytes a Unix socket path may have", path,
                     sizeof addr.sun_path - 1);
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    addr.sun_family = AF_UNIX;
    const std::string dir = std::filesystem::path(path).parent_path().string();
    if (!dir.empty()) {
        std::error_code ec;
        std::filesystem::create_directories(dir, ec);
        if (ec) return fail(ec.value(), fmt::format("socket directory {}: {}", dir, ec.message()));
    }
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            return failf("{} exists and is not a socket: not replaced (set [daemon] socket elsewhere or remove it)",
                         path);
        // A live daemon answers; a stale file from one that died does not.
        UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
        if (probe && ::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0)
            return failf("{}: another moecached is listening there", path);
        ::unlink(path.c_str());
    }
    SocketServer s;
    s.fd_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!s.fd_) return fail_errno("socket(AF_UNIX, SOCK_SEQPACKET)");
    if (::bind(s.fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return fail_errno("bind {}", path);
    s.path_ = path;
    if (::chmod(path.c_str(), 0666) != 0) return fail_errno("chmod 0666 {}", path);
    if (::listen(s.fd_.get(), 512) != 0) return fail_errno("listen on {}", path);
    return s;
}

Result<UniqueFd> SocketServer::accept() {
    UniqueFd c(::accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!c) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED || errno == EINTR) return UniqueFd();
        return fail_errno("accept on {}", path_);
    }
    return c;
}

Result<PeerIdentity> peer_identity(int conn) {
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return fail_errno("SO_PEERCRED");
    PeerIdentity p;
    p.pid = cred.pid;
    p.uid = cred.uid;
    p.gid = cred.gid;
#ifdef SO_PEERPIDFD
    int pidfd = -1;
    len = sizeof pidfd;
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0) p.pidfd.reset(pidfd);
#endif
    if (!p.pidfd && p.pid > 0) p.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, p.pid, 0)));
    return p;
}

Result<Received> receive(int conn, size_t max_bytes, size_t max_fds) {
    Received r;
    r.packet.bytes.resize(max_bytes);
    std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
    iovec iov{r.packet.bytes.data(), r.packet.bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    const ssize_t n = ::recvmsg(conn, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return r;
        if (errno == ECONNRESET) {
            r.closed = true;
            return r;
        }
        return fail_errno("recvmsg");
    }
    // Descriptors first, so that they are owned (and closed) whatever the bytes turn out to be.
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
            int fd;
            std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            r.packet.fds.emplace_back(fd);
        }
    }
    if (n == 0 && r.packet.fds.empty()) {
        r.closed = true;  // SEQPACKET: a zero-length read is the peer's shutdown
        return r;
    }
    r.got = true;
    r.packet.bytes.resize(static_cast<size_t>(n));
    r.packet.oversized = (msg.msg_flags & MSG_TRUNC) != 0;
    r.packet.fds_truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
    return r;
}

Result<void> send_nowait(int conn, const std::vector<uint8_t>& bytes) {
    const ssize_t n = ::send(conn, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) return fail_errno("send");
    if (static_cast<size_t>(n) != bytes.size()) return failf("send: {} of {} bytes", n, bytes.size());
    return {};
}

}  // namespace moecache::daemon
