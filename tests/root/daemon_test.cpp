// moecached's core on the real kernel: mlock within budgets (VmLck agrees), residency truth,
// heat saved and restored so a restart starts warm, and model files that are truncated,
// replaced, or vanish and come back. Runs the daemon in-process and drives its loop.
#include "daemon_fixture.h"
#include "gguf_builder.h"
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/daemon/daemon.h"
#include "moecache/daemon/helping.h"
#include "moecache/daemon/page_locker.h"
#include "moecache/page_cache.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <array>
#include <filesystem>
#include <fstream>
#include <thread>

namespace moecache::daemon {
namespace {

uint64_t resident(const std::string& path, const ByteRange& r) {
    auto p = PageCacheProbe::open(path);
    return p ? p->resident_bytes(r.offset, r.length).value_or(0) : 0;
}

class DaemonTest : public testing::Test {
protected:
    void SetUp() override {
        if (::geteuid() != 0) GTEST_SKIP() << "needs root: mlock beyond RLIMIT_MEMLOCK and PSI triggers";
        model_ = dir_.file("model.gguf");
        auto spec = test::small_spec();  // 4 layers x 16 experts of 204 KiB
        test::write_model(spec, model_);
        test::drop_page_cache(model_);
    }

    Config config(uint64_t budget = 64ull << 20) { return test::daemon_config(model_, dir_.file("state"), budget); }

    // Drives the loop until nothing is fetching or waiting, or the deadline passes.
    // Turns the loop until no model's header is being read (opens run off the loop).
    static void opened(Daemon& d) {
        for (int i = 0; i < 2000; ++i) {
            const auto s = d.status();
            if (std::none_of(s.models.begin(), s.models.end(), [](const auto& m) { return m.opening; })) return;
            ASSERT_TRUE(d.step(5));
        }
        ADD_FAILURE() << "a model's open did not end";
    }
    static void settle(Daemon& d, double seconds = 20) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        d.tick();
        while (std::chrono::steady_clock::now() < end) {
            ASSERT_TRUE(d.step(50));
            if (d.idle()) {
                d.tick();
                if (d.idle()) return;
            }
        }
        FAIL() << "the daemon did not settle in " << seconds << " s";
    }

    // A daemon that saw experts 0:1, 0:9 and 3:4 routed, and saved its heat profile.
    void route_and_save() {
        auto d = Daemon::create(config());
        ASSERT_TRUE(d) << d.error().what();
        const uint32_t id = *(*d)->model_id(model_);
        route(**d, id, 0, {1, 9}, 5);
        route(**d, id, 3, {4}, 5);
        settle(**d);
        ASSERT_TRUE((*d)->save_profiles());
    }

    static void route(Daemon& d, uint32_t model, uint32_t block, std::vector<uint32_t> experts, int times = 3) {
        for (int i = 0; i < times; ++i) d.record_routing(model, block, experts, 1);
    }

    // A daemon that saves its heat profiles every tick, with some heat, whose first save worked.
    void start_saving_every_tick(std::unique_ptr<Daemon>& out) {
        auto c = config();
        c.save_interval_seconds = 0;
        auto d = Daemon::create(c);
        ASSERT_TRUE(d) << d.error().what();
        route(**d, *(*d)->model_id(model_), 0, {1, 2}, 3);
        (*d)->tick();
        ASSERT_EQ((*d)->status().errors.at("saving heat profiles"), 0u) << "saving works to begin with";
        out = std::move(*d);
    }

    static const ExpertStatus& expert(const DaemonStatus& s, uint32_t block, uint32_t e) {
        for (const auto& x : s.models.at(0).experts)
            if (x.block == block && x.expert == e) return x;
        throw std::runtime_error("no such expert");
    }

    test::TempDir dir_;
    std::string model_;
};

TEST_F(DaemonTest, LocksTheHotExpertsAndTheKernelAgrees) {
    const uint64_t vmlck_before = vmlck_bytes();
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t id = *(*d)->model_id(model_);
    route(**d, id, 0, {3, 5});
    route(**d, id, 2, {7});
    settle(**d);
    const auto s = (*d)->status();
    ASSERT_EQ(s.models.size(), 1u);
    ASSERT_TRUE(s.models[0].loaded) << s.models[0].error;
    for (auto [b, e] : {std::pair{0u, 3u}, {0u, 5u}, {2u, 7u}}) {
        const auto& x = expert(s, b, e);
        EXPECT_EQ(x.tier, Tier::Locked) << b << ":" << e;
        EXPECT_GE(x.cached_bytes, x.bytes) << "locked means resident";
    }
    // Residency as the kernel reports it, independently of the daemon's own bookkeeping.
    const auto map = load_expert_map(model_);
    for (const auto& r : map->ranges(0, 5)) EXPECT_EQ(resident(model_, r), r.length);
    for (const auto& r : map->ranges(1, 3)) EXPECT_EQ(resident(model_, r), 0u);
    EXPECT_EQ(expert(s, 1, 3).tier, Tier::Storage);
    EXPECT_EQ(expert(s, 1, 3).cached_bytes, 0u) << "nothing but the hot set was read";
    // What the daemon says it locked is what the kernel counts for it.
    EXPECT_GT(s.locked_bytes, 3 * expert(s, 0, 3).bytes - 1);
    EXPECT_EQ(s.vmlck_bytes - vmlck_before, s.locked_bytes);
    EXPECT_LE(s.locked_bytes, s.lock_cap);
}

// Is it helping: each decode routing is counted where its expert was when the report came (locked:
// RAM; neither locked nor cached: storage), prompt batches as tokens only, and the model's verdict
// says it in figures: mostly from storage first, helping once the locked experts are the ones used.
TEST_F(DaemonTest, DecodeRoutingsAreCountedWhereTheirExpertsWere) {
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t id = *(*d)->model_id(model_);
    opened(**d);
    auto s = (*d)->status();
    ASSERT_EQ(s.models.size(), 1u);
    EXPECT_EQ(model_verdict(s, s.models[0]).kind, ModelVerdict::Kind::Idle) << model_verdict(s, s.models[0]).line;
    route(**d, id, 0, {3, 5});  // 3 tokens, nothing locked or cached yet
    route(**d, id, 2, {7});
    settle(**d);
    s = (*d)->status();
    const auto before = s.models[0].outcome;
    EXPECT_EQ(before.decode_tokens, 3u) << "a token is counted at the first MoE layer's report";
    EXPECT_EQ(before.routed[static_cast<size_t>(Reach::Storage)], 9u);
    EXPECT_TRUE(s.models[0].routing_reported);
    ASSERT_EQ(expert(s, 0, 3).tier, Tier::Locked);
    const auto v = model_verdict(s, s.models[0]);
    EXPECT_EQ(v.kind, ModelVerdict::Kind::CannotHelp) << v.line;
    EXPECT_NE(v.line.find("100.0 % on storage"), std::string::npos) << v.line;
    ASSERT_FALSE(s.helping.empty());
    EXPECT_EQ(s.helping[0], v.line) << "the status carries the report";

    route(**d, id, 0, {3, 5}, 1);                                     // both locked
    route(**d, id, 1, {3}, 1);                                        // neither locked nor cached
    (*d)->record_routing(id, 0, std::vector<uint32_t>{1, 2, 3}, 64);  // a prompt batch
    auto after = (*d)->status().models[0].outcome;
    EXPECT_EQ(after.decode_tokens, before.decode_tokens + 1);
    EXPECT_EQ(after.prompt_tokens, before.prompt_tokens + 64);
    EXPECT_EQ(after.routed[static_cast<size_t>(Reach::Ram)] - before.routed[static_cast<size_t>(Reach::Ram)], 2u);
    EXPECT_EQ(after.routed[static_cast<size_t>(Reach::Storage)] - before.routed[static_cast<size_t>(Reach::Storage)],
              1u);
    EXPECT_EQ(after.routed[static_cast<size_t>(Reach::Vram)], 0u) << "no pool";

    route(**d, id, 0, {3, 5}, 20);
    s = (*d)->status();
    EXPECT_EQ(model_verdict(s, s.models[0]).kind, ModelVerdict::Kind::Helping) << model_verdict(s, s.models[0]).line;
}

TEST_F(DaemonTest, NeverLocksMoreThanTheBudget) {
    auto spec = test::small_spec();
    const uint64_t per_expert = mkmodel::bytes_per_expert(spec);
    const uint64_t budget = 5 * per_expert + per_expert / 2;  // room for five experts
    const uint64_t vmlck_before = vmlck_bytes();
    auto d = Daemon::create(config(budget));
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t id = *(*d)->model_id(model_);
    for (uint32_t e = 0; e < 16; ++e) route(**d, id, 1, {e}, 2 + static_cast<int>(e));
    settle(**d);
    auto s = (*d)->status();
    EXPECT_LE(s.locked_bytes, budget);
    EXPECT_LE(s.vmlck_bytes - vmlck_before, budget);
    uint32_t locked = 0;
    for (const auto& x : s.models[0].experts) locked += x.tier == Tier::Locked;
    EXPECT_EQ(locked, 5u);
    // The five hottest: experts 11..15 of block 1.
    for (uint32_t e = 11; e < 16; ++e) EXPECT_EQ(expert(s, 1, e).tier, Tier::Locked) << e;
    // Pressure releases the coldest locked experts first and keeps the budget.
    (*d)->on_pressure("test");
    s = (*d)->status();
    EXPECT_TRUE(s.under_pressure);
    EXPECT_EQ(expert(s, 1, 11).tier, Tier::Storage) << "the coldest goes first";
    EXPECT_EQ(expert(s, 1, 15).tier, Tier::Locked);
    EXPECT_EQ(s.vmlck_bytes - vmlck_before, s.locked_bytes);
}

// A failure the loop goes on after is counted by what the daemon was doing (and logged), not
// dropped: here the heat profiles cannot be saved, their folder having become a file.
TEST_F(DaemonTest, AFailedProfileSaveInATickIsCounted) {
    std::unique_ptr<Daemon> d;
    ASSERT_NO_FATAL_FAILURE(start_saving_every_tick(d));
    std::filesystem::remove_all(dir_.file("state"));
    test::write_file(dir_.file("state"), "not a folder");
    d->tick();
    d->tick();
    const auto s = d->status();
    ASSERT_EQ(s.errors.count("saving heat profiles"), 1u);
    EXPECT_EQ(s.errors.at("saving heat profiles"), 2u);
}

// A full disk: the save fails, is counted, and leaves no partial file beside the last good one.
TEST_F(DaemonTest, AProfileSaveOnAFullDiskLeavesNothingBehind) {
    const std::string state = dir_.file("state");
    std::filesystem::create_directories(state);
    ASSERT_EQ(::mount("tmpfs", state.c_str(), "tmpfs", 0, "size=64k"), 0) << std::strerror(errno);
    struct Unmount {
        std::string at;
        ~Unmount() { ::umount2(at.c_str(), MNT_DETACH); }
    } unmount{state};
    std::unique_ptr<Daemon> d;
    ASSERT_NO_FATAL_FAILURE(start_saving_every_tick(d));
    std::vector<std::string> profiles;
    for (const auto& e : std::filesystem::recursive_directory_iterator(state))
        if (e.is_regular_file()) profiles.push_back(e.path().string());
    ASSERT_FALSE(profiles.empty());
    const std::string good = test::read_file(profiles.front());
    // Fill the disk, then make the profile longer than what is left.
    {
        std::ofstream fill(state + "/fill");
        std::string block(4096, 'x');
        while (fill.write(block.data(), static_cast<std::streamsize>(block.size()))) {}
    }
    for (uint32_t b = 0; b < 4; ++b) route(*d, *d->model_id(model_), b, {3, 4, 5, 6, 7, 8, 9, 10}, 5);
    d->tick();
    const auto s = d->status();
    ASSERT_EQ(s.errors.count("saving heat profiles"), 1u) << "a save on a full disk is a counted failure";
    for (const auto& e : std::filesystem::recursive_directory_iterator(state))
        EXPECT_NE(e.path().extension(), ".tmp") << e.path() << " was left behind";
    EXPECT_EQ(test::read_file(profiles.front()), good) << "the last good profile stays";
}

// The counts /metrics renders (status without the per-expert list) agree with the list.
TEST_F(DaemonTest, TheCountsAgreeWithTheExperts) {
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    route(**d, *(*d)->model_id(model_), 0, {1, 9}, 5);
    settle(**d);
    const auto full = (*d)->status(true).models.at(0);
    const auto counts = (*d)->status(false).models.at(0);
    EXPECT_TRUE(counts.experts.empty());
    std::array<uint32_t, 5> expected{};
    uint64_t read = 0;
    for (const auto& e : full.experts) {
        ++expected[static_cast<size_t>(placement(e.tier, e.vram_holders))];
        read += e.telemetry.read_bytes;
    }
    EXPECT_EQ(counts.placements, expected);
    EXPECT_GT(expected[static_cast<size_t>(Placement::Ram)], 0u) << "the routed experts are locked";
    EXPECT_EQ(counts.expert_telemetry.read_bytes, read);
}

TEST_F(DaemonTest, RestartWithSavedHeatIsWarmBeforeAnyTelemetry) {
    ASSERT_NO_FATAL_FAILURE(route_and_save());
    test::drop_page_cache(model_);
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    settle(**d);  // no telemetry at all
    const auto s = (*d)->status();
    for (auto [b, e] : {std::pair{0u, 1u}, {0u, 9u}, {3u, 4u}}) {
        EXPECT_EQ(expert(s, b, e).tier, Tier::Locked) << b << ":" << e;
        EXPECT_GE(expert(s, b, e).cached_bytes, expert(s, b, e).bytes);
    }
    EXPECT_EQ(expert(s, 1, 1).cached_bytes, 0u);
}

// A new machine of a fleet (its state_dir empty) starts warm from the fleet's shared profiles
// (fleet_profiles: a ConfigMap on Kubernetes), read only: what it learns is saved in its own.
TEST_F(DaemonTest, ANewMachineStartsWarmFromTheFleetsProfile) {
    ASSERT_NO_FATAL_FAILURE(route_and_save());
    // The fleet's folder gets that machine's profile; the new machine has a state_dir of its own.
    const std::string fleet = dir_.file("fleet");
    std::filesystem::create_directories(fleet);
    for (const auto& f : std::filesystem::directory_iterator(dir_.file("state") + "/profiles"))
        std::filesystem::copy_file(f.path(), fleet + "/" + f.path().filename().string());
    ASSERT_EQ(::chmod(fleet.c_str(), 0555), 0);
    test::drop_page_cache(model_);
    Config c = test::daemon_config(model_, dir_.file("new-state"), 64ull << 20);
    c.fleet_profiles = fleet;
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    settle(**d);  // no telemetry at all
    const auto s = (*d)->status();
    for (auto [b, e] : {std::pair{0u, 1u}, {0u, 9u}, {3u, 4u}}) EXPECT_EQ(expert(s, b, e).tier, Tier::Locked) << b << ":" << e;
    EXPECT_EQ(expert(s, 1, 1).tier, Tier::Storage);
    ASSERT_TRUE((*d)->save_profiles());
    EXPECT_FALSE(std::filesystem::is_empty(dir_.file("new-state") + "/profiles")) << "its own profile, in its own state_dir";
}

// The fleet's folder is whoever-can-write-it's: a profile is read only where it lies in the folder
// (a ConfigMap's links inside it are followed, one out of it is not), only up to what a profile of
// the model's shape can be (a 190 MiB one held the start 30 s and 2.6 GiB), and a wrong profile's
// own key is never echoed into the log.
TEST_F(DaemonTest, FleetProfilesAreReadOnlyFromTheFolderAndBounded) {
    ASSERT_NO_FATAL_FAILURE(route_and_save());
    std::string profile;
    for (const auto& f : std::filesystem::directory_iterator(dir_.file("state") + "/profiles")) profile = f.path().filename();
    ASSERT_FALSE(profile.empty());
    const std::string saved = test::read_file(dir_.file("state") + "/profiles/" + profile);
    auto starts_warm = [&](const std::string& fleet) {
        test::drop_page_cache(model_);
        std::filesystem::remove_all(dir_.file("new-state"));
        Config c = test::daemon_config(model_, dir_.file("new-state"), 64ull << 20);
        c.fleet_profiles = fleet;
        auto d = Daemon::create(c);
        EXPECT_TRUE(d) << d.error().what();
        if (!d) return false;
        settle(**d);
        return expert((*d)->status(), 0, 1).tier == Tier::Locked;
    };
    // A ConfigMap's layout: KEY -> ..data/KEY, ..data -> a dated folder, all inside.
    const std::string cm = dir_.file("cm");
    std::filesystem::create_directories(cm + "/..2026_12_04");
    test::write_file(cm + "/..2026_12_04/" + profile, saved);
    std::filesystem::create_directory_symlink("..2026_12_04", cm + "/..data");
    std::filesystem::create_symlink("..data/" + profile, cm + "/" + profile);
    EXPECT_TRUE(starts_warm(cm)) << "a ConfigMap's links stay inside the folder";
    // A link out of the folder: not read.
    const std::string out = dir_.file("out");
    std::filesystem::create_directories(out);
    test::write_file(dir_.file("elsewhere.json"), saved);
    std::filesystem::create_symlink(dir_.file("elsewhere.json"), out + "/" + profile);
    EXPECT_FALSE(starts_warm(out)) << "a link out of the folder was followed";
    // Larger than a profile of this shape can be: refused unread.
    const std::string big = dir_.file("big");
    std::filesystem::create_directories(big);
    test::write_file(big + "/" + profile, saved.substr(0, saved.size() - 1) + std::string(32u << 20, ' ') + "}");
    EXPECT_FALSE(starts_warm(big)) << "an oversized profile was read";
    // Another model's profile under this name: its key is not quoted.
    const std::string wrong = dir_.file("wrong");
    std::filesystem::create_directories(wrong);
    const std::string marker = "ATTACKER-TEXT-IN-A-KEY";
    std::string other = saved;
    const size_t k = other.find("\"key\"");
    ASSERT_NE(k, std::string::npos);
    other.insert(other.find('"', other.find(':', k)) + 1, marker);
    test::write_file(wrong + "/" + profile, other);
    testing::internal::CaptureStderr();
    EXPECT_FALSE(starts_warm(wrong));
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("the profile is for another model"), std::string::npos) << log;
    EXPECT_EQ(log.find(marker), std::string::npos) << "the profile's own key was echoed:\n" << log;
}

// A warm start also reads, without locking, the experts the profile saw used beyond the lock
// budget; nothing the profile did not admit, nothing locked beyond the budget.
TEST_F(DaemonTest, AWarmStartReadsTheProfilesNextTierWithoutLockingIt) {
    const uint64_t per_expert = mkmodel::bytes_per_expert(test::small_spec());
    Config c = config();
    c.admit_after_uses = 2;
    {
        auto d = Daemon::create(c);
        ASSERT_TRUE(d) << d.error().what();
        const uint32_t id = *(*d)->model_id(model_);
        route(**d, id, 0, {1}, 7);
        route(**d, id, 0, {9}, 6);
        route(**d, id, 3, {4}, 5);
        route(**d, id, 1, {2}, 3);
        route(**d, id, 2, {6}, 1);  // not admitted
        settle(**d);
        ASSERT_TRUE((*d)->save_profiles());
    }
    c.lock_budget = ByteAmount{2 * per_expert + per_expert / 2, std::nullopt};  // room for two
    for (const bool warm : {true, false}) {
        SCOPED_TRACE(warm ? "warm_start auto" : "warm_start off");
        test::drop_page_cache(model_);
        c.warm_start = warm;
        testing::internal::CaptureStderr();
        auto d = Daemon::create(c);
        ASSERT_TRUE(d) << d.error().what();
        settle(**d);
        (void)(*d)->tick();
        const std::string log = testing::internal::GetCapturedStderr();
        const auto s = (*d)->status();
        // Its progress, by quarters, to the end (moecachectl wait shows the same from the status).
        EXPECT_EQ(log.find("warm start 100 % ("), warm ? log.find("warm start 100 % (") : std::string::npos) << log;
        if (warm) {
            EXPECT_NE(log.find(" MiB read, "), std::string::npos) << log;
            EXPECT_NE(log.find("s): done"), std::string::npos) << log;
        }
        EXPECT_EQ(s.models.at(0).warm_total_bytes, 0u) << "done: no warm start under way";
        EXPECT_EQ(expert(s, 0, 1).tier, Tier::Locked);
        EXPECT_EQ(expert(s, 0, 9).tier, Tier::Locked);
        for (auto [b, e] : {std::pair{3u, 4u}, {1u, 2u}}) {
            const auto& x = expert(s, b, e);
            EXPECT_EQ(x.tier, Tier::Storage) << b << ":" << e << " is beyond the budget: never locked";
            EXPECT_EQ(x.cached_bytes, warm ? x.bytes : 0) << b << ":" << e;
        }
        EXPECT_EQ(expert(s, 2, 6).cached_bytes, 0u) << "used once: not admitted, not read";
        EXPECT_LT(expert(s, 1, 3).cached_bytes, 4096u) << "never used: at most the edge page it shares with 1:2";
        EXPECT_EQ(s.warm_fetch_bytes, warm ? expert(s, 3, 4).bytes + expert(s, 1, 2).bytes : 0);
        EXPECT_LE(s.locked_bytes, s.lock_cap);
    }
}

TEST_F(DaemonTest, TruncatedModelIsReportedAndReexamined) {
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t id = *(*d)->model_id(model_);
    route(**d, id, 0, {2});
    settle(**d);
    ASSERT_EQ(expert((*d)->status(), 0, 2).tier, Tier::Locked);
    const auto size = std::filesystem::file_size(model_);
    const std::string saved = dir_.file("saved.gguf");
    std::filesystem::copy_file(model_, saved);
    ASSERT_EQ(::truncate(model_.c_str(), static_cast<off_t>(size / 2)), 0);
    (*d)->tick();
    opened(**d);
    auto s = (*d)->status();
    EXPECT_FALSE(s.models[0].loaded);
    EXPECT_FALSE(s.models[0].error.empty());
    EXPECT_EQ(s.locked_bytes, 0u);
    // Put the whole file back (as a new file moved over it): the daemon takes it up again.
    std::filesystem::rename(saved, model_);
    settle(**d);
    s = (*d)->status();
    EXPECT_TRUE(s.models[0].loaded) << s.models[0].error;
    EXPECT_EQ(expert(s, 0, 2).tier, Tier::Locked) << "its heat survived the reload";
}

// A model truncated while the daemon reads and locks it (a user's own file; an operator copying a
// new model over a configured one): the first lock that fails closes the model, and nothing of
// that turn touches it again. Cut at every point of the reads and locks a turn does.
TEST_F(DaemonTest, AModelTruncatedWhileItIsReadAndLockedIsClosedMidTurn) {
    const auto size = std::filesystem::file_size(model_);
    const std::string whole = dir_.file("whole.gguf");
    std::filesystem::copy_file(model_, whole);
    for (int cut_after = 0; cut_after < 12; ++cut_after) {
        SCOPED_TRACE("truncated after " + std::to_string(cut_after) + " loop turns");
        std::filesystem::copy_file(whole, model_, std::filesystem::copy_options::overwrite_existing);
        test::drop_page_cache(model_);
        auto d = Daemon::create(config());
        ASSERT_TRUE(d) << d.error().what();
        const uint32_t id = *(*d)->model_id(model_);
        for (uint32_t block = 0; block < 3; ++block) route(**d, id, block, {0, 1, 2, 3, 4, 5, 6, 7});
        (*d)->tick();
        for (int i = 0; i < cut_after; ++i) ASSERT_TRUE((*d)->step(cut_after % 2 ? 0 : 5));
        ASSERT_EQ(::truncate(model_.c_str(), static_cast<off_t>(size / 3)), 0);
        for (int i = 0; i < 40; ++i) {
            ASSERT_TRUE((*d)->step(5));
            if (i % 10 == 0) (*d)->tick();
        }
        const auto s = (*d)->status();
        ASSERT_EQ(s.models.size(), 1u);
        EXPECT_FALSE(s.models[0].loaded) << "a model cut to a third cannot stay open";
        EXPECT_EQ(s.locked_bytes, 0u);
    }
}

TEST_F(DaemonTest, ModelThatVanishesAndComesBack) {
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    const std::string away = dir_.file("away.gguf");
    std::filesystem::rename(model_, away);
    (*d)->tick();
    opened(**d);
    auto s = (*d)->status();
    EXPECT_FALSE(s.models[0].loaded);
    EXPECT_NE(s.models[0].error.find("No such file"), std::string::npos) << s.models[0].error;
    std::filesystem::rename(away, model_);
    (*d)->tick();
    opened(**d);
    s = (*d)->status();
    EXPECT_TRUE(s.models[0].loaded) << s.models[0].error;
}

TEST_F(DaemonTest, ReloadWithASmallerBudgetReleasesAndABadOneIsRefused) {
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t id = *(*d)->model_id(model_);
    route(**d, id, 1, {6});
    settle(**d);
    ASSERT_EQ(expert((*d)->status(), 1, 6).tier, Tier::Locked);
    auto bad = config();
    bad.reserve = ByteAmount{mem_total_bytes(), std::nullopt};  // nothing left to lock
    EXPECT_FALSE((*d)->reload(bad));
    EXPECT_EQ(expert((*d)->status(), 1, 6).tier, Tier::Locked) << "a refused reload changes nothing";
    ASSERT_TRUE((*d)->reload(config(4096)));
    const auto s = (*d)->status();
    EXPECT_EQ(expert(s, 1, 6).tier, Tier::Storage);
    EXPECT_EQ(s.locked_bytes, 0u);
}

TEST_F(DaemonTest, ReleaseDropsPagesNobodyMapsAndKeepsMappedOnes) {
    auto d = Daemon::create(config());
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t id = *(*d)->model_id(model_);
    route(**d, id, 2, {4, 8});
    settle(**d);
    const auto map = load_expert_map(model_);
    const auto mapped = map->ranges(2, 4).at(0), unmapped = map->ranges(2, 8).at(0);
    ASSERT_EQ(resident(model_, mapped), mapped.length);
    ASSERT_EQ(resident(model_, unmapped), unmapped.length);
    // Another process (here: this one, through its own mapping) uses expert 4.
    const int fd = ::open(model_.c_str(), O_RDONLY);
    const uint64_t size = std::filesystem::file_size(model_);
    auto* base = static_cast<volatile uint8_t*>(::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0));
    ASSERT_NE(base, MAP_FAILED);
    uint64_t sum = 0;
    for (uint64_t off = mapped.offset; off < mapped.offset + mapped.length; off += 4096) sum += base[off];
    ASSERT_TRUE((*d)->reload(config(4096)));  // releases both
    EXPECT_EQ((*d)->status().locked_bytes, 0u);
    // Interior pages only: the edge pages are shared with neighbours that may still be cached.
    const ByteRange mapped_inner{0, (mapped.offset + 4095) / 4096 * 4096, (mapped.length / 4096 - 2) * 4096};
    const ByteRange unmapped_inner{0, (unmapped.offset + 4095) / 4096 * 4096, (unmapped.length / 4096 - 2) * 4096};
    EXPECT_EQ(resident(model_, mapped_inner), mapped_inner.length) << "mapped by a process: kept";
    EXPECT_EQ(resident(model_, unmapped_inner), 0u) << "mapped by nobody: dropped";
    ::munmap(const_cast<uint8_t*>(base), size);
    ::close(fd);
    EXPECT_GT(sum + 1, 0u);
}

// A glob over a directory like ollama's blobs (sha256-... files: models, manifests' layers, dense
// models, vision projectors) takes the MoE GGUF models only, and says why it skips the rest once.
TEST_F(DaemonTest, AGlobTakesOnlyMoeGgufModels) {
    const std::string blobs = dir_.file("blobs");
    std::filesystem::create_directories(blobs);
    const std::string hex(64, 'a');
    std::filesystem::copy_file(model_, blobs + "/sha256-" + hex);
    // Its manifest, as ollama writes it: the metrics name the model by its tag.
    std::filesystem::create_directories(dir_.file("manifests/registry.ollama.ai/library/qwen3moe"));
    test::write_file(dir_.file("manifests/registry.ollama.ai/library/qwen3moe/test"),
                     R"({"layers":[{"mediaType":"application/vnd.ollama.image.model","digest":"sha256:)" + hex + R"("}]})");
    test::write_file(blobs + "/sha256-template", "{{ .System }} {{ .Prompt }}");
    test::GgufDesc dense;
    dense.add_str("general.architecture", "llama").add_u32("llama.block_count", 1);
    dense.add_tensor("blk.0.ffn_up.weight", {64, 64});
    test::write_file(blobs + "/sha256-dense", dense.bytes());
    std::filesystem::create_directories(blobs + "/sha256-a-directory");
    auto c = config();
    c.models[0].path = blobs + "/sha256-*";
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    settle(**d);
    auto s = (*d)->status();
    ASSERT_EQ(s.models.size(), 1u);
    EXPECT_EQ(s.models[0].path, blobs + "/sha256-" + hex);
    EXPECT_TRUE(s.models[0].loaded);
    EXPECT_EQ(s.models[0].name, "qwen3moe:test");
    // A file that becomes a model later (a download finishing) is taken then; the download in
    // progress beside it is not.
    std::filesystem::copy_file(model_, blobs + "/sha256-" + std::string(64, 'b') + "-partial");
    std::filesystem::copy_file(model_, blobs + "/sha256-" + std::string(64, 'b'));
    test::write_file(blobs + "/sha256-template", "changed: looked at again, still not a model");
    settle(**d);
    s = (*d)->status();
    ASSERT_EQ(s.models.size(), 2u);
    EXPECT_EQ(s.models[1].path, blobs + "/sha256-" + std::string(64, 'b'));
    EXPECT_EQ(s.models[1].name, "moecache-synthetic") << "no manifest names it: its general.name";
    EXPECT_EQ((*d)->status().models.size(), 2u) << "the download in progress is no model";
}

TEST_F(DaemonTest, PinsAndGlobs) {
    auto c = config();
    c.models[0].path = dir_.file("mod*.gguf");
    c.models[0].pins = {ExpertPin{3, 0, 1}, ExpertPin{1, 5, 5}};
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    settle(**d);  // no telemetry: the pins alone
    const auto s = (*d)->status();
    ASSERT_EQ(s.models.size(), 1u);
    EXPECT_EQ(s.models[0].path, model_) << "the glob resolved to the model";
    for (auto [b, e] : {std::pair{3u, 0u}, {3u, 1u}, {1u, 5u}}) {
        EXPECT_TRUE(expert(s, b, e).pinned);
        EXPECT_EQ(expert(s, b, e).tier, Tier::Locked) << b << ":" << e;
    }
    uint32_t locked = 0;
    for (const auto& x : s.models[0].experts) locked += x.tier == Tier::Locked;
    EXPECT_EQ(locked, 3u);
}

TEST_F(DaemonTest, AnotherQuantizationOfTheSameModelStartsWarm) {
    {
        auto d = Daemon::create(config());
        ASSERT_TRUE(d) << d.error().what();
        route(**d, *(*d)->model_id(model_), 1, {2, 11}, 4);
        settle(**d);
    }  // saves the heat profile on the way out
    // The same model (architecture, shape, name) in another expert type: other file offsets.
    auto spec = test::small_spec();
    spec.expert_type = *ggml_type_info(ggml::Q4_K);
    const std::string q4 = dir_.file("model-q4_K.gguf");
    test::write_model(spec, q4);
    test::drop_page_cache(q4);
    auto c = config();
    c.models[0].path = q4;
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    settle(**d);
    const auto s = (*d)->status();
    EXPECT_EQ(expert(s, 1, 2).tier, Tier::Locked);
    EXPECT_EQ(expert(s, 1, 11).tier, Tier::Locked);
    EXPECT_EQ(expert(s, 1, 3).tier, Tier::Storage);
    const auto map = load_expert_map(q4);
    for (const auto& r : map->ranges(1, 11)) EXPECT_EQ(resident(q4, r), r.length);
}

// A family: two quantizations of one model loaded together (one for prompt processing, one for
// decoding). What one routes warms the other, at once, with no profile in between; a family
// budget holds for both together; a model given another family keeps its own heat.
TEST_F(DaemonTest, QuantizationsLoadedTogetherShareHeatAndAFamilyBudget) {
    auto spec = test::small_spec();
    const uint64_t per_expert = mkmodel::bytes_per_expert(spec);
    spec.expert_type = *ggml_type_info(ggml::Q4_K);
    const std::string q4 = dir_.file("model-q4_K.gguf");
    test::write_model(spec, q4);
    test::drop_page_cache(q4);
    auto c = config();
    c.models.push_back(c.models[0]);
    c.models[1].path = q4;
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    const uint32_t q8_id = *(*d)->model_id(model_), q4_id = *(*d)->model_id(q4);
    route(**d, q4_id, 1, {2, 11}, 4);  // only the q4_K model routes
    settle(**d);
    auto s = (*d)->status();
    ASSERT_EQ(s.models.size(), 2u);
    EXPECT_EQ(s.models[0].family, s.models[1].family);
    auto tier = [&](uint32_t id, uint32_t block, uint32_t e) {
        for (const auto& m : s.models)
            if (m.id == id)
                for (const auto& x : m.experts)
                    if (x.block == block && x.expert == e) return x.tier;
        return Tier::Storage;
    };
    for (uint32_t id : {q8_id, q4_id}) {
        EXPECT_EQ(tier(id, 1, 2), Tier::Locked) << "model " << id;
        EXPECT_EQ(tier(id, 1, 11), Tier::Locked) << "model " << id;
        EXPECT_EQ(tier(id, 1, 3), Tier::Storage) << "model " << id;
    }
    d->reset();

    // A family budget of three q8_0 experts: the family holds no more than that, both together.
    c.models[0].family_budget = c.models[1].family_budget = ByteAmount{3 * per_expert, std::nullopt};
    d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    route(**d, *(*d)->model_id(q4), 1, {1, 2, 3, 4, 5, 6}, 4);
    settle(**d);
    s = (*d)->status();
    EXPECT_LE(s.models[0].locked_bytes + s.models[1].locked_bytes, 3 * per_expert);
    EXPECT_GT(s.models[0].locked_bytes + s.models[1].locked_bytes, 0u);
    d->reset();

    // Told they are not one family, the q8_0 model does not see what the q4_K model routes.
    c.models[0].family_budget.reset();
    c.models[1].family_budget.reset();
    c.models[0].family = "alone";
    std::filesystem::remove_all(dir_.file("state"));  // no profile from the runs above
    d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    route(**d, *(*d)->model_id(q4), 1, {2, 11}, 4);
    settle(**d);
    s = (*d)->status();
    EXPECT_NE(s.models[0].family, s.models[1].family);
    EXPECT_EQ(tier(*(*d)->model_id(model_), 1, 2), Tier::Storage);
    EXPECT_EQ(tier(*(*d)->model_id(q4), 1, 2), Tier::Locked);
}

// [policy] predict: once the route predictor has been right, the daemon reads what the next token
// is expected to use into the page cache (not locked); off, it reads nothing of the kind.
TEST_F(DaemonTest, PredictedExpertsAreReadAheadOnlyWhenAskedAndOnceTrusted) {
    const auto map = load_expert_map(model_);
    ASSERT_TRUE(map);
    for (const bool predict : {false, true}) {
        SCOPED_TRACE(predict ? "predict" : "no predict");
        test::drop_page_cache(model_);
        auto c = config(1);  // a lock budget of one byte: nothing is locked, the plan reads nothing
        c.predict = predict;
        auto d = Daemon::create(c);
        ASSERT_TRUE(d) << d.error().what();
        const uint32_t id = *(*d)->model_id(model_);
        // A router that repeats itself: block 1 uses experts 2 and 11 for every token.
        for (int t = 0; t < 80; ++t) (*d)->record_routing(id, 1, std::vector<uint32_t>{2, 11}, 1);
        settle(**d);
        const auto s = (*d)->status();
        EXPECT_EQ(s.locked_bytes, 0u);
        const auto r2 = map->ranges(1, 2), r6 = map->ranges(1, 6);  // 6: no neighbour of a used one
        if (predict) {
            EXPECT_GE(s.predicted_experts, 64u);
            EXPECT_EQ(s.predicted_used, s.predicted_experts) << "a router that repeats itself is predicted exactly";
            EXPECT_GT(s.predict_fetch_bytes, 0u);
            for (const auto& r : r2) EXPECT_EQ(resident(model_, r), r.length) << "expert 2, predicted, is read";
        } else {
            EXPECT_EQ(s.predicted_experts, 0u);
            EXPECT_EQ(s.predict_fetch_bytes, 0u);
            for (const auto& r : r2) EXPECT_EQ(resident(model_, r), 0u) << "nothing reads expert 2";
        }
        for (const auto& r : r6) EXPECT_EQ(resident(model_, r), 0u) << "expert 6 is never predicted";
    }
}

TEST_F(DaemonTest, TheReserveHoldsAgainstWhatIsAvailableNow) {
    // Take 4 GiB so that a reserve can sit between what is available and RAM with wide margins
    // (other processes move MemAvailable by far less than the 2 GiB used here).
    constexpr uint64_t kHog = 4ull << 30, kMargin = 2ull << 30;
    if (mem_available_bytes() < kHog + (2ull << 30)) GTEST_SKIP() << "less than 6 GiB available";
    auto* hog = static_cast<uint8_t*>(::mmap(nullptr, kHog, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    ASSERT_NE(hog, MAP_FAILED);
    for (uint64_t off = 0; off < kHog; off += 4096) hog[off] = 1;
    auto c = config();
    c.reserve = ByteAmount{mem_available_bytes() + kMargin, std::nullopt};
    ASSERT_LT(c.reserve.bytes, mem_total_bytes());
    auto d = Daemon::create(c);
    ASSERT_TRUE(d) << d.error().what();
    route(**d, *(*d)->model_id(model_), 0, {1, 2, 3});
    settle(**d);
    EXPECT_EQ((*d)->status().locked_bytes, 0u) << "the budget allows it, the reserve does not";
    ::munmap(hog, kHog);  // 4 GiB back: now the reserve leaves room
    settle(**d);
    EXPECT_EQ(expert((*d)->status(), 0, 2).tier, Tier::Locked);
}

}  // namespace
}  // namespace moecache::daemon
