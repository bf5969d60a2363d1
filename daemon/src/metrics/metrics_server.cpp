#include "metrics_server.h"

#include "moecache/daemon/config.h"
#include "moecache/http.h"
#include "moecache/log.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

namespace moecache::daemon {
namespace {

using Clock = std::chrono::steady_clock;

struct Connection {
    UniqueFd fd;
    std::string peer;  // the address's bytes: what kMaxPerAddress counts by
    std::string in;    // the request head so far
    std::string out;   // the answer, once there is one
    size_t sent = 0;
    Clock::time_point deadline;
};

bool iequals(std::string_view a, std::string_view b) {
    return a.size() == b.size() &&
           std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return std::tolower(x) == std::tolower(y); });
}

std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

std::string response(int code, const char* reason, std::string_view type, std::string_view body, bool head,
                     std::string_view extra = {}) {
    std::string r = "HTTP/1.1 " + std::to_string(code) + " " + reason + "\r\nContent-Type: " + std::string(type) +
                    "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + std::string(extra) +
                    "Connection: close\r\n\r\n";
    if (!head) r += body;
    return r;
}

// What the request head asks, or the refusal it gets; nullopt while the head is not complete.
struct Request {
    std::string method, target;
    int refuse = 0;  // an HTTP status to answer with at once
};
std::optional<Request> parse_head(const std::string& in) {
    const size_t end = in.find("\r\n\r\n");
    if (end == std::string::npos) {
        if (in.size() > MetricsServer::kMaxHeadBytes) return Request{"", "", 431};
        return std::nullopt;
    }
    std::string_view head(in.data(), end);
    const size_t eol = head.find("\r\n");
    const std::string_view line = head.substr(0, eol);
    Request r;
    const size_t a = line.find(' '), b = line.find(' ', a == std::string_view::npos ? a : a + 1);
    if (a == std::string_view::npos || b == std::string_view::npos || line.substr(b + 1).rfind("HTTP/1.", 0) != 0)
        return Request{"", "", 400};
    r.method = std::string(line.substr(0, a));
    r.target = std::string(line.substr(a + 1, b - a - 1));
    // No body is ever wanted: one announced is refused unread.
    for (size_t at = eol; at != std::string_view::npos && at < head.size();) {
        const size_t next = head.find("\r\n", at + 2);
        const std::string_view h = head.substr(at + 2, next == std::string_view::npos ? std::string_view::npos : next - at - 2);
        at = next;
        const size_t colon = h.find(':');
        if (colon == std::string_view::npos) continue;
        const std::string_view name = trim(h.substr(0, colon)), value = trim(h.substr(colon + 1));
        if (iequals(name, "transfer-encoding") || (iequals(name, "content-length") && value != "0")) r.refuse = 413;
    }
    return r;
}

}  // namespace

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& listen, Clock::duration stalled_after) {
    auto [host, port] = MC_TRY(parse_listen_address(listen));
    std::unique_ptr<MetricsServer> m(new MetricsServer());
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (host.find(':') != std::string::npos) {
        auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons(static_cast<uint16_t>(port));
        if (inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) != 1) return failf("[metrics] listen: {} is not an IPv6 address", host);
        len = sizeof *a6;
    } else {
        auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
        a4->sin_family = AF_INET;
        a4->sin_port = htons(static_cast<uint16_t>(port));
        if (inet_pton(AF_INET, host.c_str(), &a4->sin_addr) != 1) return failf("[metrics] listen: {} is not an IPv4 address", host);
        len = sizeof *a4;
    }
    m->listener_ = UniqueFd(::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!m->listener_) return fail_errno("the metrics endpoint: socket");
    const int one = 1;
    (void)::setsockopt(m->listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(m->listener_.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0)
        return fail_errno("the metrics endpoint cannot listen on {}", listen);
    if (::listen(m->listener_.get(), kMaxConnections) != 0) return fail_errno("the metrics endpoint: listen on {}", listen);
    sockaddr_storage bound{};
    socklen_t blen = sizeof bound;
    (void)::getsockname(m->listener_.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
    m->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    m->host_ = host;
    m->epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
    m->stop_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!m->epoll_ || !m->stop_) return fail_errno("the metrics endpoint: epoll");
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = UINT64_MAX;
    if (::epoll_ctl(m->epoll_.get(), EPOLL_CTL_ADD, m->listener_.get(), &ev) != 0) return fail_errno("the metrics endpoint: epoll");
    ev.data.u64 = UINT64_MAX - 1;
    if (::epoll_ctl(m->epoll_.get(), EPOLL_CTL_ADD, m->stop_.get(), &ev) != 0) return fail_errno("the metrics endpoint: epoll");
    m->text_ = std::make_shared<const std::string>("");
    m->published_ = Clock::now();
    m->stalled_after_ = stalled_after;
    m->thread_ = std::thread([self = m.get()] { self->serve(); });
    MC_LOG(LOG_INFO, "metrics at http://{}{}{}:{}/metrics", host.find(':') != std::string::npos ? "[" : "", host,
           host.find(':') != std::string::npos ? "]" : "", m->port_);
    return m;
}

MetricsServer::~MetricsServer() {
    if (stop_) {
        const uint64_t one = 1;
        (void)!::write(stop_.get(), &one, sizeof one);
    }
    if (thread_.joinable()) thread_.join();
}

void MetricsServer::publish(std::string text, const std::vector<std::string>& problems, std::string status) {
    auto p = std::make_shared<const std::string>(std::move(text));
    auto st = status.empty() ? nullptr : std::make_shared<const std::string>(std::move(status));
    std::string body;
    for (const auto& why : problems) body += "degraded: " + why + "\n";
    auto h = std::make_shared<const std::string>(body.empty() ? "ok\n" : body);
    std::lock_guard lock(mu_);
    text_ = std::move(p);
    health_ = std::move(h);
    status_ = std::move(st);
    published_ = Clock::now();
}

std::string MetricsServer::answer(const std::string& method, const std::string& target) const {
    const bool head = method == "HEAD";
    if (method != "GET" && !head)
        return response(405, "Method Not Allowed", "text/plain", "GET or HEAD only\n", false, "Allow: GET, HEAD\r\n");
    const std::string path = target.substr(0, target.find('?'));
    std::shared_ptr<const std::string> text, health, status;
    Clock::time_point published;
    {
        std::lock_guard lock(mu_);
        text = text_;
        health = health_;
        status = status_;
        published = published_;
    }
    if (path == "/metrics") return response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", *text, head);
    if (path == "/health") {
        const auto quiet = Clock::now() - published;
        if (quiet > stalled_after_)
            return response(503, "Service Unavailable", "text/plain",
                            "stalled: the daemon's loop has not turned for " +
                                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(quiet).count()) + " s\n",
                            head);
        return response(200, "OK", "text/plain", health ? *health : std::string("ok\n"), head);
    }
    if (path == "/status" && status) return response(200, "OK", "text/plain; charset=utf-8", *status, head);
    if (path == "/")
        return response(200, "OK", "text/plain",
                        "moecached: metrics at /metrics, liveness at /health, whether it helps at /status\n", head);
    return response(404, "Not Found", "text/plain", "no such page: /metrics, /health or /status\n", head);
}

void MetricsServer::serve() {
    std::map<uint64_t, Connection> conns;
    std::map<std::string, int> per_address;
    uint64_t next_id = 0;
    auto drop = [&](uint64_t id) {
        auto it = conns.find(id);
        if (it == conns.end()) return;
        if (--per_address[it->second.peer] <= 0) per_address.erase(it->second.peer);
        conns.erase(it);  // closes it (and takes it out of the epoll set)
    };
    epoll_event events[64];
    for (;;) {
        int timeout_ms = 250;
        const auto now = Clock::now();
        for (const auto& [id, c] : conns)
            timeout_ms = std::min<int>(timeout_ms, static_cast<int>(std::max<int64_t>(
                                                       0, std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - now).count() + 1)));
        const int n = ::epoll_wait(epoll_.get(), events, 64, timeout_ms);
        for (int i = 0; i < n; ++i) {
            const uint64_t id = events[i].data.u64;
            if (id == UINT64_MAX - 1) return;  // stopping
            if (id == UINT64_MAX) {
                for (;;) {
                    sockaddr_storage peer{};
                    socklen_t plen = sizeof peer;
                    UniqueFd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&peer), &plen, SOCK_NONBLOCK | SOCK_CLOEXEC));
                    if (!fd) break;
                    std::string key = peer.ss_family == AF_INET6
                                          ? std::string(reinterpret_cast<const char*>(&reinterpret_cast<sockaddr_in6*>(&peer)->sin6_addr), 16)
                                          : std::string(reinterpret_cast<const char*>(&reinterpret_cast<sockaddr_in*>(&peer)->sin_addr), 4);
                    // Over a bound: told 503 and closed as it is accepted (the backlog holds nothing for it).
                    if (static_cast<int>(conns.size()) >= kMaxConnections || per_address[key] >= kMaxPerAddress) {
                        if (per_address[key] == 0) per_address.erase(key);
                        static const std::string busy = response(503, "Service Unavailable", "text/plain",
                                                                 "too many connections: try again\n", false, "Retry-After: 1\r\n");
                        (void)!::send(fd.get(), busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
                        (void)::shutdown(fd.get(), SHUT_WR);
                        continue;
                    }
                    epoll_event ev{};
                    ev.events = EPOLLIN | EPOLLRDHUP;
                    ev.data.u64 = next_id;
                    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd.get(), &ev) != 0) continue;
                    ++per_address[key];
                    conns.emplace(next_id++, Connection{std::move(fd), std::move(key), {}, {}, 0, Clock::now() + kRequestDeadline});
                }
                continue;
            }
            auto it = conns.find(id);
            if (it == conns.end()) continue;
            Connection& c = it->second;
            if (c.out.empty() && (events[i].events & EPOLLIN)) {
                char buf[4096];
                const ssize_t got = ::recv(c.fd.get(), buf, std::min(sizeof buf, kMaxHeadBytes + 1 - c.in.size()), 0);
                if (got <= 0) {
                    if (got == 0 || (errno != EAGAIN && errno != EINTR)) drop(id);
                    continue;
                }
                c.in.append(buf, static_cast<size_t>(got));
                const auto req = parse_head(c.in);
                if (!req) continue;
                switch (req->refuse) {
                    case 0: c.out = answer(req->method, req->target); break;
                    case 413: c.out = response(413, "Payload Too Large", "text/plain", "no request body is taken here\n", false); break;
                    case 431: c.out = response(431, "Request Header Fields Too Large", "text/plain", "request head too large\n", false); break;
                    default: c.out = response(400, "Bad Request", "text/plain", "not an HTTP/1 request\n", false); break;
                }
                c.in.clear();
                epoll_event ev{};
                ev.events = EPOLLOUT | EPOLLRDHUP;
                ev.data.u64 = id;
                (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
                continue;
            }
            if (!c.out.empty() && (events[i].events & EPOLLOUT)) {
                const ssize_t put = ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (put > 0) c.sent += static_cast<size_t>(put);
                if ((put < 0 && errno != EAGAIN && errno != EINTR) || c.sent == c.out.size()) {
                    (void)::shutdown(c.fd.get(), SHUT_WR);
                    drop(id);
                }
                continue;
            }
            if (events[i].events & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) drop(id);
        }
        // A connection past its deadline (a request trickled in, an answer read slowly) is cut off.
        const auto later = Clock::now();
        std::vector<uint64_t> late;
        for (const auto& [cid, c] : conns)
            if (c.deadline <= later) late.push_back(cid);
        for (uint64_t cid : late) drop(cid);
    }
}

}  // namespace moecache::daemon
