#include "private_bus.h"

#include "temp_dir.h"

#include <sys/stat.h>

#include <regex>

namespace moecache::test {

PrivateBus::PrivateBus(const std::string& dir, const std::string& policy_file) {
    ::chmod(dir.c_str(), 0755);
    const std::string socket = dir + "/bus";
    const std::string config = dir + "/bus.conf";
    std::string text = read_file(std::string(MOECACHE_SOURCE_DIR) + "/dbus/private-bus.conf.in");
    text = std::regex_replace(text, std::regex("@SOCKET@"), socket);
    text = std::regex_replace(text, std::regex("@POLICY@"), policy_file);
    write_file(config, text);
    daemon_ = std::make_unique<Background>(std::vector<std::string>{"dbus-daemon", "--config-file=" + config, "--nofork", "--print-address"});
    if (daemon_->wait_for("unix:path=" + socket, 10)) address_ = "unix:path=" + socket;
}

void write_policy_for_group(const std::string& path, const std::string& group) {
    const std::string shipped = read_file(std::string(MOECACHE_SOURCE_DIR) + "/dbus/org.moecache1.conf");
    write_file(path, std::regex_replace(shipped, std::regex("group=\"moecache\""), "group=\"" + group + "\""));
}

}  // namespace moecache::test
