// GET /metrics over HTTP (cpp-httplib), on its own threads. The event loop renders the text and
// hands it over with publish(); the HTTP threads only copy the latest text out (one shared
// pointer under a mutex), so a scrape never touches the daemon's state.
#pragma once

#include "moecache/error.h"

#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace moecache::daemon {

class MetricsServer {
public:
    // Listens on "HOST:PORT" (an IP address, IPv6 in brackets; port 0: any free one).
    static Result<std::unique_ptr<MetricsServer>> start(const std::string& listen);
    ~MetricsServer();
    MetricsServer(const MetricsServer&) = delete;
    MetricsServer& operator=(const MetricsServer&) = delete;

    void publish(std::string text);
    [[nodiscard]] int port() const { return port_; }
    [[nodiscard]] const std::string& host() const { return host_; }

private:
    MetricsServer() = default;
    std::unique_ptr<httplib::Server> server_;
    std::thread thread_;
    std::mutex mu_;
    std::shared_ptr<const std::string> text_;
    std::string host_;
    int port_ = 0;
};

}  // namespace moecache::daemon
