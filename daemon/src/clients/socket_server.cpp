#include "socket_server.h"

#include "moecache/log.h"
#include "moecache/systemd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>

namespace moecache::daemon {

SocketServer::~SocketServer() {
    // Only the file this server bound: a successor may have replaced it already, and a socket
    // systemd passed stays for the next start.
    if (fd_ && !path_.empty() && !activated_) {
        struct stat st {};
        if (::lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path_.c_str());
    }
}

namespace {

// The path a Unix socket is bound to; "" for anything else (another family, unnamed, abstract).
std::string bound_path(int fd) {
    sockaddr_un a{};
    socklen_t len = sizeof a;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0 || a.sun_family != AF_UNIX) return {};
    const size_t max = len > offsetof(sockaddr_un, sun_path) ? len - offsetof(sockaddr_un, sun_path) : 0;
    return std::string(a.sun_path, ::strnlen(a.sun_path, max));
}

// The same file, however the two paths are spelt (/var/run is /run on most systems).
bool same_file(const std::string& a, const std::string& b) {
    if (a == b) return true;
    struct stat sa {}, sb {};
    return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

int socket_option(int fd, int option) {
    int v = -1;
    socklen_t len = sizeof v;
    return ::getsockopt(fd, SOL_SOCKET, option, &v, &len) == 0 ? v : -1;
}

}  // namespace

Result<std::optional<SocketServer>> SocketServer::adopt(const std::string& path) {
    auto passed = MC_TRY(systemd::listen_fds());
    std::optional<SocketServer> found;
    for (auto& p : passed) {
        const std::string bound = bound_path(p.fd.get());
        if (bound.empty() || bound[0] != '/' || !same_file(bound, path)) {
            MC_LOG(LOG_WARNING, "descriptor {} ('{}') passed by systemd is not the client socket {}{}: closed",
                   p.fd.get(), p.name, path, bound.empty() ? "" : fmt::format(" but {}", bound));
            continue;
        }
        if (socket_option(p.fd.get(), SO_TYPE) != SOCK_SEQPACKET)
            return failf("{}: systemd passed it as a socket of another type; clients speak SOCK_SEQPACKET there "
                         "(ListenSequentialPacket= in moecached.socket)",
                         path);
        if (socket_option(p.fd.get(), SO_ACCEPTCONN) != 1)
            return failf("{}: the socket systemd passed is not listening (moecached.socket needs Accept=no)", path);
        const int flags = ::fcntl(p.fd.get(), F_GETFL);
        if (flags < 0 || ::fcntl(p.fd.get(), F_SETFL, flags | O_NONBLOCK) != 0)
            return fail_errno("{}: O_NONBLOCK on the socket systemd passed", path);
        SocketServer s;
        s.fd_ = std::move(p.fd);
        s.path_ = path;
        s.activated_ = true;
        found = std::move(s);
    }
    return found;
}

Result<SocketServer> SocketServer::listen(const std::string& path) {
    sockaddr_un addr{};
    if (path.empty() || path.size() >= sizeof addr.sun_path)
        return failf("socket path '{}' is empty or longer than the {} bytes a Unix socket path may have", path,
                     sizeof addr.sun_path - 1);
    if (auto passed = MC_TRY(adopt(path))) {
        MC_LOG(LOG_INFO, "client socket {}: passed by systemd (socket activation)", path);
        return std::move(*passed);
    }
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
    // The socket file is made 0666 by bind itself (the umask of the moment), not chmod-ed by path
    // afterwards: between the two the path could have been swapped for something else (a link to
    // a file the daemon may write), which chmod would then have opened to everyone. Access is the
    // daemon's to check ([clients] allow_uids / allow_gids), and nobody connects before listen().
    const mode_t umask_was = ::umask(0111);
    const int bound = ::bind(s.fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    const int bind_errno = errno;
    ::umask(umask_was);
    if (bound != 0) {
        errno = bind_errno;
        return fail_errno("bind {}", path);
    }
    s.path_ = path;
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
    // The caller's groups as the kernel recorded them at connect, not read later from /proc.
    for (size_t n = 16; n <= 65536; n *= 4) {
        p.groups.resize(n);
        len = static_cast<socklen_t>(n * sizeof(gid_t));
        if (::getsockopt(conn, SOL_SOCKET, SO_PEERGROUPS, p.groups.data(), &len) == 0) {
            p.groups.resize(len / sizeof(gid_t));
            break;
        }
        p.groups.clear();
        if (errno != ERANGE) break;
    }
#ifdef SO_PEERPIDFD
    int pidfd = -1;
    len = sizeof pidfd;
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0) p.pidfd.reset(pidfd);
#endif
    if (!p.pidfd && p.pid > 0) p.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, p.pid, 0)));
    p.fairness_key = fmt::format("uid {}", p.uid);
    if (p.uid == 0 && p.pid > 0) {
        // The unified hierarchy's line ("0::/PATH"); read while the pidfd pins the pid. A process
        // gone already keeps root's shared key.
        char buf[4096];
        const UniqueFd f(::open(fmt::format("/proc/{}/cgroup", p.pid).c_str(), O_RDONLY | O_CLOEXEC));
        const ssize_t n = f ? ::read(f.get(), buf, sizeof buf - 1) : -1;
        if (n > 0) {
            const std::string_view text(buf, static_cast<size_t>(n));
            const size_t at = text.rfind("0::", text.size());
            if (at != std::string_view::npos && (at == 0 || text[at - 1] == '\n')) {
                const size_t end = text.find('\n', at);
                p.fairness_key = fmt::format("cgroup {}", text.substr(at + 3, end == std::string_view::npos ? end : end - at - 3));
            }
        }
    }
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

Result<bool> try_send(int conn, const std::vector<uint8_t>& bytes) {
    const ssize_t n = ::send(conn, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n < 0) return fail_errno("send");
    if (static_cast<size_t>(n) != bytes.size()) return failf("send: {} of {} bytes", n, bytes.size());
    return true;
}

Result<void> send_nowait(int conn, const std::vector<uint8_t>& bytes) {
    const ssize_t n = ::send(conn, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) return fail_errno("send");
    if (static_cast<size_t>(n) != bytes.size()) return failf("send: {} of {} bytes", n, bytes.size());
    return {};
}

}  // namespace moecache::daemon
