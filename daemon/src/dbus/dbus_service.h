// moecached on D-Bus: the name org.moecache1, the manager at /org/moecache1 and one object per
// model at /org/moecache1/model/ID (dbus/org.moecache1.xml, docs/dbus.md). The connection's fd
// sits in the daemon's epoll set and every request is handled on the loop's thread, so handlers
// call the daemon directly, through its Control interface (control.h) only. Reading is open;
// changes need root or the admin group, checked here (from the caller's credentials, as the bus
// reports them) as well as by the bus policy.
//
// The service lives in a module of its own, libmoecache-dbus.so (dbus_service.cpp, with sdbus-c++
// and the libsystemd it needs), loaded when a bus is configured: a daemon without D-Bus (a
// container) needs neither library. dbus_module.cpp finds and loads it.
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
    // group that does not exist is reported and means root only. Errors with errnum ELIBACC: the
    // module cannot be loaded (missing, or a library it needs is), which trying again will not mend.
    static Result<std::unique_ptr<DbusService>> open(Control& daemon, const std::string& bus,
                                                     const std::string& admin_group);
    virtual ~DbusService() = default;

    [[nodiscard]] virtual int fd() const = 0;
    // What to wait for on fd() now (EPOLLIN, and EPOLLOUT while output is queued), and how long
    // at most (ms; -1: no timeout of its own). None of these throws: a connection that broke
    // (the bus went away) makes lost() true, and the daemon then closes this service.
    [[nodiscard]] virtual uint32_t epoll_events() const = 0;
    [[nodiscard]] virtual int timeout_ms() const = 0;
    [[nodiscard]] virtual bool lost() const = 0;
    // Handles everything that can be handled now. Never throws.
    virtual void process() = 0;
    // One object per model the daemon knows: adds the new, removes the gone.
    virtual void sync_models() = 0;
    virtual void pressure_backoff(const std::string& source, uint64_t lock_cap) = 0;
    virtual void budget_changed(const std::string& name, uint64_t bytes) = 0;
    [[nodiscard]] virtual const std::string& bus() const = 0;
};

// The module's one entry point, moecache_dbus_open_v1: what the loader hands it, and its answer
// (0, *out set; or -1, *error set). abi must be the loader's kDbusModuleAbi: the module and the
// daemon pass C++ objects, so they must come from one build.
struct DbusModuleArgs {
    const char* abi;
    Control* daemon;
    const std::string* bus;
    const std::string* admin_group;
    int log_priority;  // the daemon's (--verbose): the module keeps its own copy of the log settings
};
using DbusModuleOpen = int (*)(const DbusModuleArgs* args, std::unique_ptr<DbusService>* out, Error* error);
inline constexpr const char* kDbusModuleEntry = "moecache_dbus_open_v1";
inline constexpr const char* kDbusModuleAbi = MOECACHE_VERSION_STRING " " __VERSION__;

}  // namespace moecache::daemon
