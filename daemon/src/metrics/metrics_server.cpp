#include "metrics_server.h"

#include "moecache/daemon/config.h"
#include "moecache/log.h"

#include <httplib.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

namespace moecache::daemon {
namespace {

// The server's connections, bounded: a few workers and a short queue (each queued connection holds
// a descriptor the daemon needs for its clients). A connection past the queue is served on the
// accepting thread, which so stops taking more until it is done (at most the read timeout).
class BoundedQueue final : public httplib::TaskQueue {
public:
    BoundedQueue(size_t workers, size_t max_queued) : max_queued_(max_queued) {
        for (size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
    }
    void enqueue(std::function<void()> fn) override {
        {
            std::lock_guard lock(mu_);
            if (jobs_.size() < max_queued_) {
                jobs_.push_back(std::move(fn));
                cv_.notify_one();
                return;
            }
        }
        fn();
    }
    void shutdown() override {
        {
            std::lock_guard lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
        threads_.clear();
    }

private:
    void work() {
        for (;;) {
            std::function<void()> fn;
            {
                std::unique_lock lock(mu_);
                cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
                if (jobs_.empty()) return;
                fn = std::move(jobs_.front());
                jobs_.pop_front();
            }
            fn();
        }
    }
    const size_t max_queued_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> jobs_;
    std::vector<std::thread> threads_;
    bool stop_ = false;
};

}  // namespace

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& listen) {
    auto [host, port] = MC_TRY(parse_listen_address(listen));
    std::unique_ptr<MetricsServer> m(new MetricsServer());
    m->server_ = std::make_unique<httplib::Server>();
    // GET only: a body is never wanted (refused with 413 before it is read), a slow client is cut
    // off, and the connections and threads are bounded (two workers, 32 queued).
    m->server_->set_payload_max_length(4096);
    m->server_->set_read_timeout(2, 0);
    m->server_->set_write_timeout(2, 0);
    m->server_->set_keep_alive_max_count(4);
    m->server_->set_keep_alive_timeout(2);
    m->server_->new_task_queue = [] { return new BoundedQueue(2, 32); };
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
