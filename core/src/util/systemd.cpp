#include "moecache/systemd.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdlib>
#include <cstring>

namespace moecache::systemd {
namespace {

constexpr int kListenFdsStart = 3;  // SD_LISTEN_FDS_START

// A decimal number that fills the whole string.
std::optional<uint64_t> parse_u64(std::string_view s) {
    uint64_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
    return v;
}

// A variable that names a process: is it this one? Absent is no.
Result<bool> names_this_process(const char* var) {
    const char* v = std::getenv(var);
    if (v == nullptr) return false;
    const auto pid = parse_u64(v);
    if (!pid || *pid == 0) return failf("{}='{}' is not a process id", var, v);
    return *pid == static_cast<uint64_t>(::getpid());
}

}  // namespace

Result<bool> notify(std::string_view state) {
    const char* socket_path = std::getenv("NOTIFY_SOCKET");
    if (socket_path == nullptr || *socket_path == '\0') return false;
    const std::string_view path = socket_path;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if ((path[0] != '/' && path[0] != '@') || path.size() >= sizeof addr.sun_path)
        return failf("NOTIFY_SOCKET='{}' is neither an absolute path nor an abstract address ('@name') that fits "
                     "a Unix socket address",
                     path);
    std::memcpy(addr.sun_path, path.data(), path.size());
    socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size());
    if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract: the name is every byte given, no NUL
    else ++len;                                   // a path: its NUL too, as systemd's own code sends

    UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!fd) return fail_errno("socket(AF_UNIX, SOCK_DGRAM) for NOTIFY_SOCKET");
    // The manager learns who sent it from the kernel (SO_PASSCRED on its end): no credentials here.
    for (;;) {
        const ssize_t n = ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
                                   reinterpret_cast<const sockaddr*>(&addr), len);
        if (n >= 0) {
            if (static_cast<size_t>(n) != state.size())
                return failf("NOTIFY_SOCKET {}: sent {} of {} bytes", path, n, state.size());
            return true;
        }
        if (errno != EINTR) return fail_errno("NOTIFY_SOCKET {}: sending '{}'", path, state.substr(0, 64));
    }
}

std::string monotonic_usec() {
    timespec ts{};
    ::clock_gettime(CLOCK_MONOTONIC, &ts);
    const uint64_t us = static_cast<uint64_t>(ts.tv_sec) * 1000000u + static_cast<uint64_t>(ts.tv_nsec) / 1000u;
    return fmt::format("MONOTONIC_USEC={}", us);
}

Result<std::optional<std::chrono::microseconds>> watchdog_interval() {
    const char* usec = std::getenv("WATCHDOG_USEC");
    if (usec == nullptr) return std::nullopt;
    const auto v = parse_u64(usec);
    if (!v || *v == 0 || *v > uint64_t{INT64_MAX})
        return failf("WATCHDOG_USEC='{}' is not a positive number of microseconds", usec);
    if (std::getenv("WATCHDOG_PID") != nullptr && !MC_TRY(names_this_process("WATCHDOG_PID"))) return std::nullopt;
    return std::chrono::microseconds(static_cast<int64_t>(*v));
}

Result<Watchdog> Watchdog::from_environment() {
    const auto interval = MC_TRY(watchdog_interval());
    return interval ? Watchdog(*interval) : Watchdog();
}

Result<bool> Watchdog::ping() {
    if (!enabled()) return false;
    const auto now = std::chrono::steady_clock::now();
    if (last_.time_since_epoch().count() != 0 && now - last_ < interval_ / 4) return false;
    const bool sent = MC_TRY(notify("WATCHDOG=1"));
    last_ = now;
    return sent;
}

int Watchdog::due_in_ms() const {
    if (!enabled()) return -1;
    if (last_.time_since_epoch().count() == 0) return 0;
    const auto left = last_ + interval_ / 4 - std::chrono::steady_clock::now();
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, INT32_MAX));
}

Result<std::vector<ListenFd>> listen_fds() {
    struct Unset {  // whatever follows, the variables go: they described this process's start only
        ~Unset() {
            ::unsetenv("LISTEN_PID");
            ::unsetenv("LISTEN_FDS");
            ::unsetenv("LISTEN_FDNAMES");
        }
    } unset;
    std::vector<ListenFd> out;
    if (!MC_TRY(names_this_process("LISTEN_PID"))) return out;
    const char* count_text = std::getenv("LISTEN_FDS");
    if (count_text == nullptr) return out;
    const auto count = parse_u64(count_text);
    if (!count || *count > 4096) return failf("LISTEN_FDS='{}' is not a number of descriptors", count_text);

    std::vector<std::string> names;
    if (const char* n = std::getenv("LISTEN_FDNAMES")) {
        std::string_view rest = n;
        for (;;) {
            const size_t colon = rest.find(':');
            names.emplace_back(rest.substr(0, colon));
            if (colon == std::string_view::npos) break;
            rest.remove_prefix(colon + 1);
        }
    }
    for (int i = 0; i < static_cast<int>(*count); ++i) {
        const int fd = kListenFdsStart + i;
        const int flags = ::fcntl(fd, F_GETFD);
        if (flags < 0) return fail_errno("LISTEN_FDS={}: descriptor {} is not open", *count, fd);
        if (::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) != 0) return fail_errno("close-on-exec on descriptor {}", fd);
        const bool named = names.size() == *count && !names[static_cast<size_t>(i)].empty();
        out.push_back({UniqueFd(fd), named ? names[static_cast<size_t>(i)] : "unknown"});
    }
    return out;
}

}  // namespace moecache::systemd
