#include "moecache/daemon/privileges.h"

#include <fmt/format.h>
#include <grp.h>
#include <linux/capability.h>
#include <pwd.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <charconv>
#include <optional>

namespace moecache::daemon {
namespace {

constexpr uint64_t bit(int cap) { return uint64_t{1} << cap; }

struct CapName {
    int cap;
    const char* name;
};
constexpr CapName kNames[] = {
    {CAP_CHOWN, "CHOWN"},           {CAP_DAC_OVERRIDE, "DAC_OVERRIDE"},
    {CAP_DAC_READ_SEARCH, "DAC_READ_SEARCH"}, {CAP_FOWNER, "FOWNER"},
    {CAP_FSETID, "FSETID"},         {CAP_KILL, "KILL"},
    {CAP_SETGID, "SETGID"},         {CAP_SETUID, "SETUID"},
    {CAP_SETPCAP, "SETPCAP"},       {CAP_NET_BIND_SERVICE, "NET_BIND_SERVICE"},
    {CAP_NET_RAW, "NET_RAW"},       {CAP_IPC_LOCK, "IPC_LOCK"},
    {CAP_SYS_CHROOT, "SYS_CHROOT"}, {CAP_SYS_PTRACE, "SYS_PTRACE"},
    {CAP_SYS_ADMIN, "SYS_ADMIN"},   {CAP_SYS_RESOURCE, "SYS_RESOURCE"},
    {CAP_MKNOD, "MKNOD"},           {CAP_AUDIT_WRITE, "AUDIT_WRITE"},
    {CAP_SETFCAP, "SETFCAP"},       {38 /* CAP_PERFMON */, "PERFMON"},
    {39 /* CAP_BPF */, "BPF"},
};

std::optional<uint32_t> number(std::string_view s) {
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || s.empty()) return std::nullopt;
    return v;
}

Result<void> set_capabilities(uint64_t effective, uint64_t permitted) {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
    for (int i = 0; i < 2; ++i) {
        data[i].effective = static_cast<uint32_t>(effective >> (32 * i));
        data[i].permitted = static_cast<uint32_t>(permitted >> (32 * i));
    }
    if (::syscall(SYS_capset, &header, data) != 0) return fail_errno("capset");
    return {};
}

}  // namespace

const uint64_t kDaemonCapabilities =
    bit(CAP_FOWNER) | bit(CAP_IPC_LOCK) | bit(CAP_SYS_RESOURCE) | bit(38 /* CAP_PERFMON */) | bit(39 /* CAP_BPF */);

std::string capability_names(uint64_t mask) {
    std::string out;
    for (const auto& n : kNames)
        if (mask & bit(n.cap)) {
            out += out.empty() ? "" : " ";
            out += n.name;
            mask &= ~bit(n.cap);
        }
    for (int c = 0; c < 64; ++c)
        if (mask & bit(c)) out += fmt::format("{}{}", out.empty() ? "" : " ", c);
    return out.empty() ? "none" : out;
}

Result<CapabilitySets> own_capabilities() {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2]{};
    if (::syscall(SYS_capget, &header, data) != 0) return fail_errno("capget");
    CapabilitySets s;
    for (int i = 0; i < 2; ++i) {
        s.effective |= uint64_t{data[i].effective} << (32 * i);
        s.permitted |= uint64_t{data[i].permitted} << (32 * i);
    }
    return s;
}

Result<RunAs> parse_run_as(const std::string& spec) {
    if (spec.empty() || spec.size() > 256) return failf("--user '{}': give USER or USER:GROUP (names or numbers)", spec.substr(0, 64));
    RunAs who;
    who.name = spec;
    const size_t colon = spec.find(':');
    const std::string user = spec.substr(0, colon);
    const std::string group = colon == std::string::npos ? "" : spec.substr(colon + 1);
    if (user.empty() || (colon != std::string::npos && group.empty()))
        return failf("--user '{}': give USER or USER:GROUP (names or numbers)", spec);
    // The databases first (a name may be all digits), then a number.
    passwd pw{};
    passwd* found = nullptr;
    std::vector<char> buf(16384);
    const bool named = ::getpwnam_r(user.c_str(), &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr;
    if (named) {
        who.uid = pw.pw_uid;
        who.gid = pw.pw_gid;
    } else if (const auto n = number(user); n && *n != static_cast<uint32_t>(-1)) {
        who.uid = *n;
        who.gid = *n;
    } else {
        return failf("--user '{}': no user '{}' in the user database, and it is not a number", spec, user);
    }
    if (!group.empty()) {
        ::group gr{};
        ::group* g = nullptr;
        if (::getgrnam_r(group.c_str(), &gr, buf.data(), buf.size(), &g) == 0 && g != nullptr) {
            who.gid = gr.gr_gid;
        } else if (const auto n = number(group); n && *n != static_cast<uint32_t>(-1)) {
            who.gid = *n;
        } else {
            return failf("--user '{}': no group '{}' in the group database, and it is not a number", spec, group);
        }
    }
    if (named) {  // the user's supplementary groups, as a login (and systemd's User=) would have them
        int n = 64;
        for (int tries = 0; tries < 8; ++tries) {
            who.groups.resize(static_cast<size_t>(n));
            const int want = n;
            if (::getgrouplist(pw.pw_name, who.gid, who.groups.data(), &n) >= 0) {
                who.groups.resize(static_cast<size_t>(n));
                break;
            }
            if (n <= want) n = want * 2;
            if (n > 65536) {
                who.groups.clear();
                break;
            }
        }
    }
    if (who.groups.empty()) who.groups.push_back(who.gid);
    return who;
}

Result<void> switch_user(const RunAs& who, uint64_t keep) {
    const uid_t uid = ::getuid();
    if (uid == who.uid && ::geteuid() == who.uid && ::getgid() == who.gid) return {};
    if (::geteuid() != 0) return failf("--user {}: moecached runs as uid {}, and only root can switch users", who.name, ::geteuid());
    const auto before = own_capabilities();
    if (!before) return tl::unexpected(before.error());
    const uint64_t kept = keep & before->permitted;
    // What the process could use to undo the switch goes from its bounding set too, where it may.
    if (before->effective & bit(CAP_SETPCAP))
        for (int c = 0; c <= CAP_LAST_CAP; ++c)
            if (!(kept & bit(c)) && ::prctl(PR_CAPBSET_READ, c) == 1) (void)::prctl(PR_CAPBSET_DROP, c);
    if (::prctl(PR_SET_KEEPCAPS, 1) != 0) return fail_errno("--user {}: prctl(PR_SET_KEEPCAPS)", who.name);
    if (::setgroups(who.groups.size(), who.groups.data()) != 0) return fail_errno("--user {}: setgroups", who.name);
    if (::setresgid(who.gid, who.gid, who.gid) != 0) return fail_errno("--user {}: setresgid({})", who.name, who.gid);
    if (::setresuid(who.uid, who.uid, who.uid) != 0) return fail_errno("--user {}: setresuid({})", who.name, who.uid);
    (void)::prctl(PR_SET_KEEPCAPS, 0);
    if (auto r = set_capabilities(kept, kept); !r) return tl::unexpected(with_context(r.error(), fmt::format("--user {}", who.name)));
    // A changed uid made the process undumpable, its /proc/self files root's: as a service started
    // as the user (systemd's User=) it owns them again (oom_score_adj, its own status).
    (void)::prctl(PR_SET_DUMPABLE, 1);
    if (who.uid != 0 && (::setuid(0) == 0 || ::seteuid(0) == 0))
        return failf("--user {}: root could be had back after the switch; refusing to run", who.name);
    const auto after = own_capabilities();
    if (!after) return tl::unexpected(after.error());
    if (after->permitted & ~kept)
        return failf("--user {}: capabilities {} are still permitted after the switch", who.name, capability_names(after->permitted & ~kept));
    return {};
}

Result<std::string> become_user(const std::string& spec) {
    const auto who = parse_run_as(spec);
    if (!who) return tl::unexpected(who.error());
    if (auto r = switch_user(*who, kDaemonCapabilities); !r) return tl::unexpected(r.error());
    const auto caps = own_capabilities();
    return fmt::format("running as uid {} gid {} ({}), capabilities: {}", ::getuid(), ::getgid(), spec,
                       caps ? capability_names(caps->effective) : caps.error().what());
}

}  // namespace moecache::daemon
