// The D-Bus API as the loop holds it (dbus/dbus_service.h): connected at the start when [dbus]
// bus is set, and again every kRetrySeconds while there is none (the bus starts after the daemon,
// or restarts); its descriptor in the loop's epoll set with the events the connection asks for;
// closed when the bus goes away, and the loop goes on without it. What the operator's calls do is
// the daemon's (Control); this owns only the connection.
#pragma once

#include "moecache/daemon/config.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace moecache::daemon {

class Control;
class DbusService;

class BusLink {
public:
    // config: the daemon's, read at each try ([dbus] bus and admin_group); epoll_fd: the loop's.
    BusLink(const Config& config, int epoll_fd);
    ~BusLink();
    BusLink(const BusLink&) = delete;
    BusLink& operator=(const BusLink&) = delete;

    // Connects now if a bus is configured (the start); the service calls `control` only.
    void start(Control& control);
    // The tick: connects again if there is none and kRetrySeconds passed since the last try.
    void retry();
    // Handles the requests that came in (ready: its descriptor woke the loop) or whose time came.
    void process(bool ready);
    // After the turn's decisions: the model objects follow the daemon's models (shape: the next
    // model id and how many there are, which change whenever the set does), and the events the
    // connection waits for follow what it has to send.
    void sync(std::pair<uint32_t, size_t> shape);
    // How long the loop may wait for the bus's own sake (ms; -1: as long as it likes).
    [[nodiscard]] int timeout_ms() const;
    // Signals to the bus's listeners, when connected.
    void pressure_backoff(const std::string& source, uint64_t lock_cap);
    void budget_changed(const std::string& name, uint64_t bytes);
    // The bus it is connected to ("" while none).
    [[nodiscard]] std::string bus() const;

    static constexpr int kRetrySeconds = 10;

private:
    void connect();
    void lose();  // the bus went away
    void update_watch();

    Control* control_ = nullptr;  // from start()
    const Config& config_;
    int epoll_fd_;
    std::unique_ptr<DbusService> service_;
    uint32_t events_ = 0;                               // what epoll waits for on the bus's fd
    std::chrono::steady_clock::time_point last_try_{};  // without a bus: when it last tried one
    bool missing_said_ = false;
    bool module_missing_ = false;                        // libmoecache-dbus.so cannot be loaded: not tried again
    std::pair<uint32_t, size_t> models_{UINT32_MAX, 0};  // the shape the bus's model objects match
};

}  // namespace moecache::daemon
