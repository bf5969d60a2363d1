// The little HTTP moecache speaks outside its daemon: the "HOST:PORT" addresses moecached's metrics
// listen on ([metrics] listen), and one GET to such an address (moecachectl status where there is
// no D-Bus: a container, the bundle, a Kubernetes node).
#pragma once

#include "moecache/error.h"

#include <chrono>
#include <string>
#include <string_view>
#include <utility>

namespace moecache {

// "HOST:PORT" with an IP address (IPv6 in brackets) and a port 0-65535 -> (host, port).
Result<std::pair<std::string, int>> parse_listen_address(std::string_view text);

struct HttpReply {
    int status = 0;
    std::string body;
};

// GET `path` from "HOST:PORT" over HTTP/1.1 (Connection: close), the whole exchange within
// `timeout`; a reply over `max_body` bytes is an error. Errors name the address and what failed.
Result<HttpReply> http_get(std::string_view address, std::string_view path, std::chrono::milliseconds timeout,
                           size_t max_body = 1 << 20);

}  // namespace moecache
