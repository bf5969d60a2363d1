#include "moecache/http.h"

#include "moecache/unique_fd.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cstring>

namespace moecache {

Result<std::pair<std::string, int>> parse_listen_address(std::string_view text) {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || colon + 1 == text.size())
        return failf("'{}' is not HOST:PORT (for example \"127.0.0.1:8474\")", text);
    std::string host(text.substr(0, colon));
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    int port = -1;
    const auto* first = text.data() + colon + 1;
    const auto* last = text.data() + text.size();
    auto [p, ec] = std::from_chars(first, last, port);
    if (ec != std::errc() || p != last || port < 0 || port > 65535)
        return failf("'{}': the port must be a number from 0 to 65535", text);
    unsigned char buf[16];
    if (inet_pton(AF_INET, host.c_str(), buf) != 1 && inet_pton(AF_INET6, host.c_str(), buf) != 1)
        return failf("'{}': the host must be an IP address (127.0.0.1, ::1, 0.0.0.0), not a name", text);
    return std::make_pair(host, port);
}

Result<HttpReply> http_get(std::string_view address, std::string_view path, std::chrono::milliseconds timeout,
                           size_t max_body) {
    auto [host, port] = MC_TRY(parse_listen_address(address));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const auto left_ms = [&] {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        return static_cast<int>(std::max<int64_t>(0, left.count()));
    };
    sockaddr_storage sa{};
    socklen_t len = 0;
    const bool v6 = host.find(':') != std::string::npos;
    if (v6) {
        auto* a = reinterpret_cast<sockaddr_in6*>(&sa);
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(static_cast<uint16_t>(port));
        inet_pton(AF_INET6, host.c_str(), &a->sin6_addr);
        len = sizeof *a;
    } else {
        auto* a = reinterpret_cast<sockaddr_in*>(&sa);
        a->sin_family = AF_INET;
        a->sin_port = htons(static_cast<uint16_t>(port));
        inet_pton(AF_INET, host.c_str(), &a->sin_addr);
        len = sizeof *a;
    }
    UniqueFd fd(::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd) return fail_errno("http://{}: socket", address);
    const auto wait = [&](short events, const char* what) -> Result<void> {
        pollfd p{fd.get(), events, 0};
        for (;;) {
            const int n = ::poll(&p, 1, left_ms());
            if (n > 0) return {};
            if (n == 0) return failf("http://{}: no answer within {} ms ({})", address, timeout.count(), what);
            if (errno != EINTR) return fail_errno("http://{}: poll", address);
        }
    };
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), len) != 0) {
        if (errno != EINPROGRESS) return fail_errno("http://{}: connect", address);
        if (auto w = wait(POLLOUT, "connecting"); !w) return tl::unexpected(w.error());
        int err = 0;
        socklen_t el = sizeof err;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
        if (err != 0) return fail(err, fmt::format("http://{}: connect", address));
    }
    const std::string request = fmt::format("GET {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", path, address);
    for (size_t sent = 0; sent < request.size();) {
        if (auto w = wait(POLLOUT, "sending"); !w) return tl::unexpected(w.error());
        const ssize_t n = ::send(fd.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN && errno != EINTR) return fail_errno("http://{}: send", address);
        if (n > 0) sent += static_cast<size_t>(n);
    }
    std::string in;
    char buf[16384];
    for (;;) {
        if (auto w = wait(POLLIN, "reading"); !w) return tl::unexpected(w.error());
        const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
        if (n == 0) break;
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) continue;
            return fail_errno("http://{}: recv", address);
        }
        in.append(buf, static_cast<size_t>(n));
        if (in.size() > max_body + 16384)
            return failf("http://{}{}: the reply is over {} bytes", address, path, max_body);
    }
    // "HTTP/1.1 200 OK\r\n...\r\n\r\nBODY" (the daemon's server sends Content-Length and closes).
    HttpReply r;
    const size_t head_end = in.find("\r\n\r\n");
    if (in.rfind("HTTP/1.", 0) != 0 || head_end == std::string::npos || in.size() < 12)
        return failf("http://{}{}: not an HTTP reply", address, path);
    const auto [p, ec] = std::from_chars(in.data() + 9, in.data() + 12, r.status);
    if (ec != std::errc()) return failf("http://{}{}: not an HTTP status line", address, path);
    r.body = in.substr(head_end + 4);
    return r;
}

}  // namespace moecache
