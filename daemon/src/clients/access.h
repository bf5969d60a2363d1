// Who may do what through the client socket, from a client's credentials: the operator (root or
// [dbus] admin_group) may release RAM for its pool and steer any model's caps; a user may for a
// model its own clients registered. Pure functions of the client, the model and the admin group.
#pragma once

#include "clients/client_hub.h"
#include "moecache/daemon/model_registry.h"

#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace moecache::daemon {

// Root or the [dbus] admin group.
[[nodiscard]] inline bool is_admin(const Client& c, const std::optional<gid_t>& admin_gid) {
    return c.peer.uid == 0 ||
           (admin_gid && (c.peer.gid == *admin_gid ||
                          std::find(c.peer.groups.begin(), c.peer.groups.end(), *admin_gid) != c.peer.groups.end()));
}

// Whether this client's VRAM pool may take model m's experts out of RAM: an eviction, which D-Bus
// allows only to root and the admin group; on a model users registered themselves, any of its
// clients may.
[[nodiscard]] inline bool may_release_ram(const Client& c, const ModelEntry& m, const std::optional<gid_t>& admin_gid) {
    return is_admin(c, admin_gid) || (m.registered && !m.operator_added);  // a model its users brought: theirs to place
}

// Whether this client's routing may steer model m's caps (the recency cut of its locks): root, the
// admin group, or the uid that registered it (a model its user brought).
[[nodiscard]] inline bool steers(const Client& c, const ModelEntry& m, const std::optional<gid_t>& admin_gid) {
    return is_admin(c, admin_gid) || (m.registered && !m.operator_added && c.peer.uid == m.owner_uid);
}

// Whether m's routing, as reported lately, may cut its lock cap (ModelEntry::routed_by): reports
// of one that steers it, or of several users; none (the heat is the page cache's uses, which the
// kernel reports, not a client).
[[nodiscard]] inline bool recency_trusted(
    const ModelEntry& m, std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
    // Reports within the last minute: a runtime reports every token while it runs.
    constexpr auto kLately = std::chrono::seconds(60);
    if (m.steered_routing && now - *m.steered_routing < kLately) return true;
    const auto users =
        std::count_if(m.routed_by.begin(), m.routed_by.end(), [&](const auto& v) { return now - v.second < kLately; });
    return users != 1;
}

}  // namespace moecache::daemon
