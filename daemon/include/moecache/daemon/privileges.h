// Running as the daemon's own user where nothing starts it so (a container: Kubernetes gives a
// non-root container no capabilities, it has no ambient set). Started as root, moecached --user
// switches to the user and group given, keeping of its capabilities only those it uses (the
// systemd unit's, plus IPC_LOCK where a container gives it: kDaemonCapabilities) and dropping every
// other one, the means to switch back (SETUID, SETGID) first.
#pragma once

#include "moecache/error.h"

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace moecache::daemon {

// CAP_FOWNER, CAP_IPC_LOCK, CAP_SYS_RESOURCE, CAP_PERFMON, CAP_BPF (bit masks of linux/capability.h).
extern const uint64_t kDaemonCapabilities;

struct RunAs {
    uid_t uid = 0;
    gid_t gid = 0;
    std::vector<gid_t> groups;  // supplementary: the user's own where it is named in the user database
    std::string name;           // as given, for messages
};

// "USER[:GROUP]", each a name from the user and group databases or a number ("65532:65532" where
// there is no /etc/passwd). A user without a group takes the user's primary group (a number alone:
// the same number). Errors name what is wrong with the text.
Result<RunAs> parse_run_as(const std::string& spec);

// Switches the process (every thread it has: call it before any is started) to `who`, keeping of
// the permitted capabilities those in `keep` as permitted and effective. A process that is `who`
// already changes nothing; one that is not root cannot switch (an error saying so). After the
// switch it checks that root cannot be had back.
Result<void> switch_user(const RunAs& who, uint64_t keep);

// parse_run_as and switch_user with kDaemonCapabilities, for --user: what to log on success
// ("running as uid U gid G (SPEC), capabilities: ...").
Result<std::string> become_user(const std::string& spec);

// The capabilities of a mask by name ("BPF PERFMON"), for messages; "none" for 0.
std::string capability_names(uint64_t mask);

// The effective and permitted sets of this process, from capget.
struct CapabilitySets {
    uint64_t effective = 0;
    uint64_t permitted = 0;
};
Result<CapabilitySets> own_capabilities();

}  // namespace moecache::daemon
