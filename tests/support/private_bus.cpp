#include "private_bus.h"

#include "temp_dir.h"

#include <sys/stat.h>

#include <regex>

namespace moecache::test {

PrivateBus::PrivateBus(const std::string& dir, const std::string& policy_file) {
    ::chmod(dir.c_str(), 0755);
    const std::string socket = dir + "/bus";
    const std::string config = dir + "/bus.conf";
    // The default context of Debian's system.conf: nothing may own names or call methods unless a
    // policy file allows it.
    write_file(config, R"(<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <auth>EXTERNAL</auth>
  <listen>unix:path=)" + socket + R"(</listen>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
  </policy>
  <include>)" + policy_file + R"(</include>
</busconfig>
)");
    daemon_ = std::make_unique<Background>(std::vector<std::string>{"dbus-daemon", "--config-file=" + config, "--nofork", "--print-address"});
    if (daemon_->wait_for("unix:path=" + socket, 10)) address_ = "unix:path=" + socket;
}

void write_policy_for_group(const std::string& path, const std::string& group) {
    const std::string shipped = read_file(std::string(MOECACHE_SOURCE_DIR) + "/dbus/org.moecache1.conf");
    write_file(path, std::regex_replace(shipped, std::regex("group=\"moecache\""), "group=\"" + group + "\""));
}

}  // namespace moecache::test
