// The wire protocol: every message round-trips; every malformed packet is refused with a message
// that names what is wrong and where, whatever the bytes.
#include "moecache/client/protocol.h"
#include "moecache/client/telemetry_ring.h"

#include <gtest/gtest.h>

#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#include <random>
#include <thread>

namespace moecache::protocol {
namespace {

std::vector<Message> samples() {
    return {
        {1, Hello{1, 1, "llama-server"}},
        {2, RegisterModel{3}},
        {3, DescribeMapping{7, 2, 0x7f0000000000, 1u << 30, 4096}},
        {4, TelemetrySetup{1u << 20}},
        {5, Goodbye{}},
        {1, HelloReply{1, 42}},
        {2, Ok{}},
        {3, Failure{EACCES, "the descriptor is not readable"}},
        {4, ModelRegistered{9, 61, 256, 5}},
        {0, Directive{Action::Unlock, 9, 12, 255}},
        {0, Directive{Action::Shifted, 9, 0, 0}},
        {0, ExpertPlacement{9, 12, 255, 0}},
        {0, ExpertPlacement{9, 12, 255, kHostTier}},
        {0, PoolStats{0, 90, 10, 9000, 1000, 1ull << 30}},
        {0, PoolStats{kMaxPoolDevices - 1, ~0ull, 0, ~0ull, 0, 0}},
        {0, PoolStats{1, 5, 6, 7, 8, 9, MissPath::PageableChosen}},
        {0, PoolStats{1, 5, 6, 7, 8, 9, MissPath::SlowLink}},
        {0, Unmapped{12, 3ull << 30, true}},
        {0, Unmapped{0, 0, false}},
        {0, VramPolicy{kAllDevices, 8ull << 30, true}},
        {0, VramPolicy{3, kNoPoolLimit, false}},
        {0, VramPolicy{0, 1ull << 30, true, true}},
    };
}

TEST(Protocol, EveryMessageRoundTrips) {
    for (const auto& m : samples()) {
        const auto bytes = encode(m);
        ASSERT_LE(bytes.size(), kMaxMessageBytes);
        auto back = decode(bytes, descriptors_of(m.body));
        ASSERT_TRUE(back) << to_string(type_of(m.body)) << ": " << back.error().what();
        EXPECT_EQ(*back, m) << to_string(type_of(m.body));
    }
}

// The pool's recency is a trailing byte: a daemon that predates it sends none (read as false), and
// a byte other than 0 or 1 is refused, named.
TEST(Protocol, APoolPolicyWithoutItsRecencyByteReadsAsNone) {
    auto bytes = encode({0, VramPolicy{2, 1ull << 30, false, true}});
    bytes.pop_back();
    const uint32_t length = static_cast<uint32_t>(bytes.size());
    for (int i = 0; i < 4; ++i) bytes[8 + i] = static_cast<uint8_t>(length >> (8 * i));
    auto back = decode(bytes, 0);
    ASSERT_TRUE(back) << back.error().what();
    EXPECT_EQ(*back, (Message{0, VramPolicy{2, 1ull << 30, false, false}}));
    EXPECT_EQ(encode({0, VramPolicy{2, 1ull << 30, false, false}}), bytes) << "off: no byte (one encoding per message)";
    for (uint8_t b : {uint8_t{0}, uint8_t{7}}) {
        auto bad = encode({0, VramPolicy{2, 1ull << 30, false, true}});
        bad.back() = b;
        auto r = decode(bad, 0);
        ASSERT_FALSE(r) << int{b};
        EXPECT_NE(r.error().what().find("VramPolicy recency is " + std::to_string(b)), std::string::npos) << r.error().what();
    }
}

// How a pool's misses reach its device is a trailing byte too: a client that predates it sends none
// (unknown), and 0 or a path past the last is refused, named.
TEST(Protocol, PoolStatsWithoutTheirMissPathReadAsUnknown) {
    const auto without = encode({0, PoolStats{2, 1, 2, 3, 4, 5}});
    auto bytes = encode({0, PoolStats{2, 1, 2, 3, 4, 5, MissPath::Registered}});
    ASSERT_EQ(bytes.size(), without.size() + 1) << "one byte, only when known";
    auto back = decode(without, 0);
    ASSERT_TRUE(back) << back.error().what();
    EXPECT_EQ(std::get<PoolStats>(back->body).miss_path, MissPath::Unknown);
    for (uint8_t b : {uint8_t{0}, uint8_t{kLastMissPath + 1}}) {
        bytes.back() = b;
        auto r = decode(bytes, 0);
        ASSERT_FALSE(r) << int{b};
        EXPECT_NE(r.error().what().find("PoolStats miss_path is " + std::to_string(b)), std::string::npos) << r.error().what();
    }
    // Each path says what it is, and every slow one what to do.
    for (uint8_t p = 1; p <= kLastMissPath; ++p) {
        const auto path = static_cast<MissPath>(p);
        EXPECT_STRNE(to_string(path), "unknown");
        EXPECT_GT(strlen(reason_of(path)), 20u);
        EXPECT_EQ(strlen(advice_for(path)) > 0, !is_fast(path)) << to_string(path);
    }
}

void expect_refused(const std::vector<uint8_t>& bytes, size_t fds, std::initializer_list<std::string> parts) {
    auto r = decode(bytes, fds);
    ASSERT_FALSE(r) << "accepted";
    for (const auto& p : parts) EXPECT_NE(r.error().what().find(p), std::string::npos) << r.error().what();
}

TEST(Protocol, TruncatedOversizedAndForeignPacketsAreRefused) {
    const auto hello = encode({1, Hello{1, 1, "x"}});
    expect_refused({}, 0, {"shorter than the 16-byte header"});
    expect_refused({hello.begin(), hello.begin() + 10}, 0, {"shorter than the 16-byte header"});
    expect_refused({hello.begin(), hello.end() - 1}, 0, {"at byte 8", "the header says"});
    auto big = hello;
    big.resize(kMaxMessageBytes + 1);
    expect_refused(big, 0, {"longer than the 4096 bytes"});
    auto foreign = hello;
    foreign[0] = 'G';
    expect_refused(foreign, 0, {"at byte 0", "not a moecache message"});
    auto version = hello;
    version[6] = 2;
    expect_refused(version, 0, {"at byte 6", "protocol version 2"});
    auto type = hello;
    type[4] = 77;
    expect_refused(type, 0, {"at byte 4", "type 77"});
}

TEST(Protocol, BodiesAreCheckedFieldByField) {
    // A string longer than its field allows, and one with a control character.
    auto hello = encode({1, Hello{1, 1, "abc"}});
    hello[20] = 200;  // name length 200 > 64
    expect_refused(hello, 0, {"Hello.name", "more than the 64"});
    auto ctrl = encode({1, Hello{1, 1, "abc"}});
    ctrl[23] = '\n';
    expect_refused(ctrl, 0, {"Hello.name", "not printable"});
    expect_refused(encode({1, Hello{3, 2, ""}}), 0, {"empty range"});
    // Trailing bytes after a complete body.
    auto trailing = encode({1, Ok{}});
    trailing.push_back(0);
    trailing[8] = static_cast<uint8_t>(trailing.size());
    expect_refused(trailing, 0, {"follow the end of a Ok message"});
    expect_refused(encode({1, RegisterModel{0}}), 0, {"RegisterModel names 0 files"});
    expect_refused(encode({1, RegisterModel{65}}), 65, {"1 to 64"});
    expect_refused(encode({1, TelemetrySetup{100}}), 1, {"ring of 100 bytes"});
    expect_refused(encode({1, DescribeMapping{1, 0, ~0ull - 5, 100, 0}}), 0, {"wraps around"});
    expect_refused(encode({1, DescribeMapping{1, 0, 4096, 0, 0}}), 0, {"empty"});
    auto action = encode({0, Directive{Action::Lock, 1, 2, 3}});
    action[16] = 9;
    expect_refused(action, 0, {"Directive action 9"});
    action[16] = 7;  // one past Shifted
    expect_refused(action, 0, {"Directive action 7", "6 (shifted)"});
    action[16] = 0;
    expect_refused(action, 0, {"Directive action 0"});
    // Devices bound the daemon's metrics labels.
    expect_refused(encode({0, PoolStats{kMaxPoolDevices, 1, 1, 1, 1, 1}}), 0, {"PoolStats device 64", "below 64"});
    auto unmapped = encode({0, Unmapped{1, 1, true}});
    unmapped.back() = 2;
    expect_refused(unmapped, 0, {"Unmapped no_model is 2", "byte 32"});
}

TEST(Protocol, DescriptorCountsMustMatchTheMessage) {
    expect_refused(encode({1, Hello{}}), 1, {"Hello message came with 1 descriptor(s); it takes 0"});
    expect_refused(encode({1, RegisterModel{3}}), 2, {"came with 2", "it takes 3"});
    expect_refused(encode({1, RegisterModel{1}}), 253, {"came with 253"});
    expect_refused(encode({1, TelemetrySetup{8192}}), 0, {"came with 0", "it takes 1"});
}

// Random bytes, and random mutations of valid messages: never a crash, never an accepted packet
// that re-encodes differently.
TEST(Protocol, RandomPacketsNeverCrashTheDecoder) {
    std::mt19937_64 rng(7);
    const auto base = samples();
    for (int i = 0; i < 20000; ++i) {
        std::vector<uint8_t> b;
        if (i % 2) {
            b = encode(base[rng() % base.size()]);
            for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) b[rng() % b.size()] = static_cast<uint8_t>(rng());
        } else {
            b.resize(rng() % 64);
            for (auto& x : b) x = static_cast<uint8_t>(rng());
        }
        const size_t fds = rng() % 3;
        auto r = decode(b, fds);
        if (r) {
            EXPECT_EQ(encode(*r), b);
        }
    }
}

}  // namespace
}  // namespace moecache::protocol

namespace moecache::telemetry {
namespace {

TEST(TelemetryRing, EventsArriveInOrderAndAFullRingCountsOverflow) {
    auto producer = TelemetryRing::create(kRingHeaderBytes + 16 * kRecordBytes);
    ASSERT_TRUE(producer) << producer.error().what();
    ASSERT_EQ(producer->capacity(), 16u);
    auto consumer = TelemetryRing::attach(producer->fd(), kRingHeaderBytes + 16 * kRecordBytes);
    ASSERT_TRUE(consumer) << consumer.error().what();
    for (uint32_t i = 0; i < 20; ++i) {
        RoutingEvent e;
        e.model = 3;
        e.block = static_cast<uint16_t>(i);
        e.n_experts = 2;
        e.experts[0] = static_cast<uint16_t>(i);
        e.experts[1] = static_cast<uint16_t>(i + 1);
        e.tokens = 1;
        e.continued = i % 3 == 1;
        EXPECT_EQ(producer->push(e), i < 16);
    }
    EXPECT_EQ(producer->counters().overflow, 4u);
    std::vector<uint16_t> blocks;
    std::vector<bool> continued;
    auto n = consumer->consume([&](const RoutingEvent& e) {
        blocks.push_back(e.block);
        continued.push_back(e.continued);
    });
    ASSERT_TRUE(n) << n.error().what();
    EXPECT_EQ(*n, 16u);
    for (uint16_t i = 0; i < 16; ++i) {
        EXPECT_EQ(blocks[i], i);
        EXPECT_EQ(continued[i], i % 3 == 1) << "record " << i << "'s continued flag";
    }
    RoutingEvent e;
    EXPECT_TRUE(producer->push(e)) << "room again once consumed";
}

TEST(TelemetryRing, AProducerAndAConsumerOnTwoThreadsLoseNothingButOverflow) {
    auto producer = TelemetryRing::create(1u << 16);
    ASSERT_TRUE(producer);
    auto consumer = TelemetryRing::attach(producer->fd(), 1u << 16);
    ASSERT_TRUE(consumer);
    constexpr uint64_t kEvents = 2'000'000;
    uint64_t received = 0, last = 0;
    bool ordered = true;
    std::thread t([&] {
        for (uint64_t i = 1; i <= kEvents; ++i) {
            RoutingEvent e;
            e.time_ns = i;
            producer->push(e);
        }
    });
    auto drain = [&] {
        auto r = consumer->consume([&](const RoutingEvent& e) {
            ordered = ordered && e.time_ns > last;
            last = e.time_ns;
            ++received;
        });
        ASSERT_TRUE(r) << r.error().what();
    };
    while (producer->counters().pushed + producer->counters().overflow < kEvents) drain();
    t.join();
    drain();
    EXPECT_TRUE(ordered);
    EXPECT_EQ(received + producer->counters().overflow, kEvents);
}

TEST(TelemetryRing, AHostileRingIsRefused) {
    // Not sealed: a client could shrink it under the daemon.
    const int fd = ::memfd_create("plain", MFD_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, 8192), 0);
    auto r = TelemetryRing::attach(fd, 8192);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().what().find("F_SEAL_SHRINK"), std::string::npos) << r.error().what();
    ::close(fd);
    auto p = TelemetryRing::create(8192);
    ASSERT_TRUE(p);
    EXPECT_FALSE(TelemetryRing::attach(p->fd(), 16384)) << "a size other than the memfd's";
    // Positions scribbled over: the consumer stops with an error.
    auto c = TelemetryRing::attach(p->fd(), 8192);
    ASSERT_TRUE(c);
    auto* base = static_cast<uint8_t*>(::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd(), 0));
    ASSERT_NE(base, MAP_FAILED);
    *reinterpret_cast<uint64_t*>(base + 64) = 1u << 30;  // head far beyond tail + capacity
    auto n = c->consume([](const RoutingEvent&) {});
    ASSERT_FALSE(n);
    EXPECT_NE(n.error().what().find("impossible"), std::string::npos) << n.error().what();
    ::munmap(base, 8192);
}

}  // namespace
}  // namespace moecache::telemetry

// The C++ wrapper of the client with no daemon anywhere: every call is a cheap no-op that says so.
#include "moecache/client.hpp"
#include "model_fixture.h"
#include "temp_dir.h"

namespace moecache {
namespace {

TEST(ClientWithoutDaemon, CallsAreNoOpsCountedAsDropped) {
    test::TempDir dir;
    const std::string model = dir.file("m.gguf");
    test::write_model(test::small_spec(), model);
    Client c("unit", dir.file("no-daemon.sock"));
    ASSERT_TRUE(c);
    const long long h = c.register_model(model);
    ASSERT_GE(h, 0);
    EXPECT_LT(c.register_model(dir.file("missing.gguf")), 0);
    EXPECT_FALSE(c.wait_ready(50));
    for (int i = 0; i < 1000; ++i) EXPECT_FALSE(c.report(static_cast<uint32_t>(h), 0, {1, 2}));
    EXPECT_EQ(moecache_client_report(c.get(), 99, 0, nullptr, 0, 1), -EINVAL);
    const auto s = c.stats();
    EXPECT_EQ(s.reported, 1000u);
    EXPECT_EQ(s.dropped, 1000u);
    EXPECT_EQ(s.sent, 0u);
    EXPECT_EQ(s.connected, 0);
    EXPECT_TRUE(c.poll().empty());
}

}  // namespace
}  // namespace moecache
