// The C++ face of libmoecache-client (moecache/client.h): the same calls, owned by an object.
#pragma once

#include "moecache/client.h"

#include <cerrno>
#include <string>
#include <utility>
#include <vector>

namespace moecache {

class Client {
public:
    // socket_path empty: $MOECACHE_SOCKET or /run/moecache/moecached.sock.
    explicit Client(const std::string& name, const std::string& socket_path = {})
        : c_(moecache_client_open(socket_path.empty() ? nullptr : socket_path.c_str(), name.c_str())) {}
    Client(Client&& o) noexcept : c_(std::exchange(o.c_, nullptr)) {}
    Client& operator=(Client&& o) noexcept {
        std::swap(c_, o.c_);
        return *this;
    }
    Client(const Client&) = delete;
    Client& operator=(const Client&) = delete;
    ~Client() { moecache_client_close(c_); }

    [[nodiscard]] explicit operator bool() const { return c_ != nullptr; }
    // A handle, or -errno.
    [[nodiscard]] long long register_model(const std::string& path) {
        uint32_t h = 0;
        const int r = c_ ? moecache_client_register_model(c_, path.c_str(), &h) : -ENOMEM;
        return r == 0 ? static_cast<long long>(h) : r;
    }
    int describe_mapping(uint32_t handle, uint32_t file, const void* address, uint64_t length, uint64_t file_offset) {
        return c_ ? moecache_client_describe_mapping(c_, handle, file, address, length, file_offset) : -ENOMEM;
    }
    // Never blocks: true if the event went to the daemon.
    bool report(uint32_t handle, uint32_t block, const std::vector<uint32_t>& experts, uint32_t tokens = 1) {
        return c_ && moecache_client_report(c_, handle, block, experts.data(), static_cast<uint32_t>(experts.size()),
                                            tokens) == 1;
    }
    std::vector<moecache_directive> poll(size_t max = 256) {
        std::vector<moecache_directive> out(max);
        out.resize(c_ ? moecache_client_poll(c_, out.data(), max) : 0);
        return out;
    }
    [[nodiscard]] moecache_client_stats stats() const {
        moecache_client_stats s{};
        moecache_client_stats_get(c_, &s);
        return s;
    }
    bool wait_ready(int timeout_ms) { return c_ && moecache_client_wait_ready(c_, timeout_ms) == 1; }
    [[nodiscard]] moecache_client* get() const { return c_; }

private:
    moecache_client* c_;
};

}  // namespace moecache
