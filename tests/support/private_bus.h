// A real dbus-daemon on a private socket, configured like the system bus (deny by default) with a
// policy file included: the shipped one (dbus/org.moecache1.conf) or a variant a test writes.
#pragma once

#include "run.h"

#include <memory>
#include <string>

namespace moecache::test {

class PrivateBus {
public:
    // dir: where the socket and the configuration go; it is made traversable for other users so
    // that tests can call as an unprivileged uid.
    PrivateBus(const std::string& dir, const std::string& policy_file);
    [[nodiscard]] bool ok() const { return !address_.empty(); }
    // "unix:path=...": what [dbus] bus, moecachectl --bus and sdbus take.
    [[nodiscard]] const std::string& address() const { return address_; }
    [[nodiscard]] std::string output() const { return daemon_ ? daemon_->output() : ""; }

private:
    std::unique_ptr<Background> daemon_;
    std::string address_;
};

// The shipped policy with every group="moecache" replaced by group=`group` (for tests of the
// admin-group path with a group that exists here), written to `path`.
void write_policy_for_group(const std::string& path, const std::string& group);

}  // namespace moecache::test
