// Who may release RAM for a pool or steer a model's caps through the client socket
// (daemon/src/clients/access.h): the operator (root, the admin group) always; a user for a model
// its own clients registered; the routing's recency only from reports that may steer.
#include "clients/access.h"

#include <gtest/gtest.h>

namespace moecache::daemon {
namespace {

using Clock = std::chrono::steady_clock;

Client client(uid_t uid, gid_t gid, std::vector<gid_t> groups = {}) {
    Client c;
    c.peer.uid = uid;
    c.peer.gid = gid;
    c.peer.groups = std::move(groups);
    return c;
}

ModelEntry model(bool registered, bool operator_added, uint32_t owner) {
    ModelEntry m;
    m.registered = registered;
    m.operator_added = operator_added;
    m.owner_uid = owner;
    return m;
}

TEST(Access, TheOperatorIsRootOrTheAdminGroupByPrimaryOrSupplementaryGroup) {
    const std::optional<gid_t> admins = 990;
    EXPECT_TRUE(is_admin(client(0, 0), std::nullopt));
    EXPECT_FALSE(is_admin(client(1000, 990), std::nullopt)) << "no admin group configured: root only";
    EXPECT_TRUE(is_admin(client(1000, 990), admins));
    EXPECT_TRUE(is_admin(client(1000, 100, {27, 990}), admins));
    EXPECT_FALSE(is_admin(client(1000, 100, {27}), admins));
}

TEST(Access, APoolReleasesRamForTheOperatorOrOnAModelItsUsersBrought) {
    const Client user = client(1000, 100);
    EXPECT_FALSE(may_release_ram(user, model(false, false, 0), std::nullopt)) << "a configured model";
    EXPECT_FALSE(may_release_ram(user, model(true, true, 0), std::nullopt)) << "registered over D-Bus";
    EXPECT_TRUE(may_release_ram(user, model(true, false, 1001), std::nullopt)) << "users' own: theirs to place";
    EXPECT_TRUE(may_release_ram(client(0, 0), model(false, false, 0), std::nullopt));
}

TEST(Access, OnlyTheOperatorOrTheUserWhoBroughtAModelSteersIt) {
    EXPECT_TRUE(steers(client(1000, 100), model(true, false, 1000), std::nullopt));
    EXPECT_FALSE(steers(client(1001, 100), model(true, false, 1000), std::nullopt)) << "another user's model";
    EXPECT_FALSE(steers(client(1000, 100), model(false, false, 1000), std::nullopt)) << "a configured model";
    EXPECT_TRUE(steers(client(1001, 990), model(false, false, 0), std::optional<gid_t>(990)));
}

TEST(Access, RecencyIsTrustedFromAReportThatSteersOrSeveralUsersNeverOneUserAlone) {
    const auto now = Clock::now();
    ModelEntry m = model(false, false, 0);
    EXPECT_TRUE(recency_trusted(m, now)) << "no client reports: the heat is the kernel's page-cache uses";
    m.routed_by[1000] = now - std::chrono::seconds(5);
    EXPECT_FALSE(recency_trusted(m, now)) << "one user's routing alone cannot cut an operator's locks";
    m.routed_by[1001] = now - std::chrono::seconds(5);
    EXPECT_TRUE(recency_trusted(m, now)) << "several users";
    m.routed_by[1001] = now - std::chrono::seconds(120);
    EXPECT_FALSE(recency_trusted(m, now)) << "a report older than a minute does not count";
    m.steered_routing = now - std::chrono::seconds(5);
    EXPECT_TRUE(recency_trusted(m, now)) << "one that steers it reports";
    m.steered_routing = now - std::chrono::seconds(120);
    EXPECT_FALSE(recency_trusted(m, now));
}

}  // namespace
}  // namespace moecache::daemon
