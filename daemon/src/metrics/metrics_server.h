// GET /metrics, /health and /status (is it helping, as text: moecachectl status without D-Bus) over HTTP, on a thread
// of their own. The event loop renders the text and hands it over with publish(); the HTTP thread only copies the
// latest text out (one shared pointer under a mutex), so a request never touches the daemon's state.
//
// Everything a peer sends is bounded, whoever it is (the port may face a whole cluster): one
// thread and epoll over non-blocking sockets; a request head of at most kMaxHeadBytes and no body
// (a request that announces one, by Content-Length or Transfer-Encoding, is answered 413 and closed
// without a byte of it read); a deadline of kRequestDeadline from a connection's first byte to its
// last (a peer that trickles its request, or reads its answer slowly, is cut off then); at most
// kMaxConnections open and kMaxPerAddress from one address (more are closed as they are accepted).
// So a slow or hostile peer holds at most a few descriptors for a few seconds, and /health, which
// a liveness probe asks, answers beside it.
#pragma once

#include "moecache/error.h"
#include "moecache/unique_fd.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moecache::daemon {

class MetricsServer {
public:
    static constexpr size_t kMaxHeadBytes = 8192;
    static constexpr auto kRequestDeadline = std::chrono::seconds(5);
    static constexpr int kMaxConnections = 64;
    static constexpr int kMaxPerAddress = 8;

    // Listens on "HOST:PORT" (an IP address, IPv6 in brackets; port 0: any free one). /health
    // answers 503 once publish() has not been called for `stalled_after` (the loop stopped turning);
    // else 200, "ok", or a "degraded: WHY" line for each problem the last publish() named.
    static Result<std::unique_ptr<MetricsServer>> start(const std::string& listen,
                                                        std::chrono::steady_clock::duration stalled_after);
    ~MetricsServer();
    MetricsServer(const MetricsServer&) = delete;
    MetricsServer& operator=(const MetricsServer&) = delete;

    // `status`: /status's body (render_status_text); "" leaves it unanswered (404).
    void publish(std::string text, const std::vector<std::string>& problems = {}, std::string status = "");
    [[nodiscard]] int port() const { return port_; }
    [[nodiscard]] const std::string& host() const { return host_; }

private:
    MetricsServer() = default;
    void serve();
    [[nodiscard]] std::string answer(const std::string& method, const std::string& target) const;

    UniqueFd listener_, epoll_, stop_;
    std::thread thread_;
    mutable std::mutex mu_;
    std::shared_ptr<const std::string> text_;
    std::shared_ptr<const std::string> health_;  // /health's body while the loop turns
    std::shared_ptr<const std::string> status_;  // /status's
    std::chrono::steady_clock::time_point published_;
    std::chrono::steady_clock::duration stalled_after_{};
    std::string host_;
    int port_ = 0;
};

}  // namespace moecache::daemon
