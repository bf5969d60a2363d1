#include "metrics_server.h"

#include "moecache/daemon/config.h"
#include "moecache/log.h"

#include <httplib.h>


namespace moecache::daemon {

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& listen) {
    auto [host, port] = MC_TRY(parse_listen_address(listen));
    std::unique_ptr<MetricsServer> m(new MetricsServer());
    m->server_ = std::make_unique<httplib::Server>();
    m->host_ = host;
    m->text_ = std::make_shared<const std::string>("");
    auto* self = m.get();
    m->server_->Get("/metrics", [self](const httplib::Request&, httplib::Response& res) {
        std::shared_ptr<const std::string> text;
        {
            std::lock_guard lock(self->mu_);
            text = self->text_;
        }
        res.set_content(*text, "text/plain; version=0.0.4; charset=utf-8");
    });
    m->server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
        res.set_content("moecached: metrics at /metrics\n", "text/plain");
    });
    if (port == 0) {
        const int bound = m->server_->bind_to_any_port(host);
        if (bound <= 0) return fail_errno("the metrics endpoint cannot listen on {} (any port)", host);
        m->port_ = bound;
    } else {
        if (!m->server_->bind_to_port(host, port)) return fail_errno("the metrics endpoint cannot listen on {}", listen);
        m->port_ = port;
    }
    m->thread_ = std::thread([self] { self->server_->listen_after_bind(); });
    MC_LOG(LOG_INFO, "metrics at http://{}{}{}:{}/metrics", host.find(':') != std::string::npos ? "[" : "", host,
           host.find(':') != std::string::npos ? "]" : "", m->port_);
    return m;
}

MetricsServer::~MetricsServer() {
    if (server_) server_->stop();
    if (thread_.joinable()) thread_.join();
}

void MetricsServer::publish(std::string text) {
    auto p = std::make_shared<const std::string>(std::move(text));
    std::lock_guard lock(mu_);
    text_ = std::move(p);
}

}  // namespace moecache::daemon
