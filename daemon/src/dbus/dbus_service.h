// moecached on D-Bus: the name org.moecache1, the manager at /org/moecache1 and one object per
// model at /org/moecache1/model/ID (dbus/org.moecache1.xml, docs/dbus.md). The connection's fd
// sits in the daemon's epoll set and every request is handled on the loop's thread, so handlers
// call the daemon directly, through its Control interface (control.h) only. Reading is open; changes need root or the admin group, checked here
// (from the caller's credentials, as the bus reports them) as well as by the bus policy.
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <memory>
#include <string>

namespace moecache::daemon {

class Control;

class DbusService {
public:
    // bus: "system", "session" or an address ("unix:path=..."). admin_group: "" for root only; a
    // group that does not exist is reported and means root only.
    static Result<std::unique_ptr<DbusService>> open(Control& daemon, const std::string& bus,
                                                     const std::string& admin_group);
    ~DbusService();
    DbusService(const DbusService&) = delete;
    DbusService& operator=(const DbusService&) = delete;

    [[nodiscard]] int fd() const;
    // What to wait for on fd() now (EPOLLIN, and EPOLLOUT while output is queued), and how long
    // at most (ms; -1: no timeout of its own). None of these throws: a connection that broke
    // (the bus went away) makes lost() true, and the daemon then closes this service.
    [[nodiscard]] uint32_t epoll_events() const;
    [[nodiscard]] int timeout_ms() const;
    [[nodiscard]] bool lost() const { return lost_; }
    // Handles everything that can be handled now. Never throws.
    void process();
    // One object per model the daemon knows: adds the new, removes the gone.
    void sync_models();
    void pressure_backoff(const std::string& source, uint64_t lock_cap);
    void budget_changed(const std::string& name, uint64_t bytes);
    [[nodiscard]] const std::string& bus() const;

private:
    struct Impl;
    explicit DbusService(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
    mutable bool lost_ = false;
    int fd_ = -1;  // as it was when the connection was made
};

}  // namespace moecache::daemon
