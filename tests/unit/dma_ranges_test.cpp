// Where the hook cuts a host-to-device copy so that the driver takes it whatever the hook has
// registered, and the grace period that keeps a registration from landing between a copy's plan
// and its call to the driver.
#include "moecache/cuda/dma_ranges.h"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace moecache::cuda {
namespace {

std::vector<std::pair<size_t, size_t>> pieces(const HostRanges& set, uintptr_t src, size_t n) {
    std::vector<std::pair<size_t, size_t>> out;
    EXPECT_TRUE(for_each_piece(set, src, n, [&](size_t off, size_t bytes) {
        out.emplace_back(off, bytes);
        return true;
    }));
    return out;
}

using Pieces = std::vector<std::pair<size_t, size_t>>;

TEST(DmaRanges, ACopyClearOfEveryRangeIsOnePiece) {
    HostRanges set;
    add_range(set, {0x10000, 0x20000});
    EXPECT_EQ(pieces({}, 0x1000, 100), (Pieces{{0, 100}}));
    EXPECT_EQ(pieces(set, 0x1000, 0x1000), (Pieces{{0, 0x1000}}));
    EXPECT_EQ(pieces(set, 0x20000, 0x5000), (Pieces{{0, 0x5000}})) << "starting at a range's end is outside it";
    EXPECT_EQ(pieces(set, 0xf000, 0x1000), (Pieces{{0, 0x1000}})) << "ending at a range's start";
    EXPECT_EQ(pieces(set, 0x10000, 0x10000), (Pieces{{0, 0x10000}})) << "exactly the range";
    EXPECT_FALSE(crosses_an_edge(set, 0x10000, 0x10000));
}

// The tensor after a run of expert tensors: it starts in the run's last registered page and runs on
// past it, the copy llama.cpp's loader made when it aborted.
TEST(DmaRanges, ACopyThatStartsInsideAndEndsOutsideIsCutAtTheEdge) {
    HostRanges set;
    add_range(set, {0x10000, 0x20000});
    EXPECT_EQ(pieces(set, 0x1f000, 0x3000), (Pieces{{0, 0x1000}, {0x1000, 0x2000}}));
    EXPECT_TRUE(crosses_an_edge(set, 0x1f000, 0x3000));
    EXPECT_EQ(pieces(set, 0xf000, 0x2000), (Pieces{{0, 0x1000}, {0x1000, 0x1000}})) << "and one that ends inside";
}

TEST(DmaRanges, ACopyOverSeveralRangesIsCutAtEveryEdge) {
    HostRanges set;
    add_range(set, {0x30000, 0x40000});
    add_range(set, {0x10000, 0x20000});
    add_range(set, {0x20000, 0x28000});  // adjacent to the first
    ASSERT_EQ(set.size(), 3u);
    EXPECT_EQ(set[1], (HostRange{0x20000, 0x28000})) << "kept in order";
    EXPECT_EQ(pieces(set, 0x8000, 0x40000),
              (Pieces{{0, 0x8000}, {0x8000, 0x10000}, {0x18000, 0x8000}, {0x20000, 0x8000}, {0x28000, 0x10000},
                      {0x38000, 0x8000}}));
    EXPECT_TRUE(remove_range(set, 0x20000));
    EXPECT_FALSE(remove_range(set, 0x20000));
    EXPECT_EQ(set.size(), 2u);
}

TEST(DmaRanges, TheFirstPieceThatFailsStopsTheCopy) {
    HostRanges set;
    add_range(set, {0x10000, 0x20000});
    int calls = 0;
    EXPECT_FALSE(for_each_piece(set, 0x8000, 0x20000, [&](size_t, size_t) { return ++calls < 2; }));
    EXPECT_EQ(calls, 2);
}

// Whatever the ranges and the copy: the pieces tile the copy in order, and each lies wholly inside
// one range or wholly outside every range (what the driver takes, registered or not).
TEST(DmaRanges, EveryPieceIsWhollyInsideOneRangeOrOutsideAll) {
    std::mt19937_64 rng(11);
    for (int round = 0; round < 2000; ++round) {
        HostRanges set;
        uintptr_t at = 0x1000 * (1 + rng() % 4);
        const int n = static_cast<int>(rng() % 6);
        for (int i = 0; i < n; ++i) {
            const uintptr_t len = 0x1000 * (1 + rng() % 8);
            add_range(set, {at, at + len});
            at += len + 0x1000 * (rng() % 3);  // adjacent or apart
        }
        const uintptr_t src = rng() % (at + 0x4000);
        const size_t bytes = 1 + rng() % 0x20000;
        size_t next = 0;
        ASSERT_TRUE(for_each_piece(set, src, bytes, [&](size_t off, size_t k) {
            EXPECT_EQ(off, next);
            EXPECT_GT(k, 0u);
            next = off + k;
            const uintptr_t a = src + off, b = a + k;
            for (const auto& r : set) {
                const bool overlaps = a < r.end && r.start < b;
                const bool inside = r.start <= a && b <= r.end;
                EXPECT_TRUE(!overlaps || inside) << "piece [" << a << ", " << b << ") across [" << r.start << ", " << r.end << ")";
            }
            return true;
        }));
        ASSERT_EQ(next, bytes);
    }
}

// A registration waits for a copy that entered before it, and only for such copies.
TEST(CopyGrace, TheWriterWaitsForCopiesThatEnteredBefore) {
    CopyGrace g;
    std::atomic<bool> release{false}, entered{false};
    std::thread copy([&] {
        CopyGrace::Reader r(g);
        entered = true;
        while (!release) std::this_thread::yield();
    });
    while (!entered) std::this_thread::yield();
    EXPECT_FALSE(g.wait_for_readers(std::chrono::milliseconds(30))) << "a copy under way holds it";
    std::thread later([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        release = true;
    });
    EXPECT_TRUE(g.wait_for_readers(std::chrono::seconds(10)));
    copy.join();
    later.join();
    EXPECT_EQ(g.readers(), 0);
}

// A steady stream of copies cannot hold a registration back: each copy is short, and the counters
// flip so that those that enter after the writer began are not waited for.
TEST(CopyGrace, AStreamOfCopiesDoesNotStarveTheWriter) {
    CopyGrace g;
    std::atomic<bool> stop{false};
    std::vector<std::thread> copies;
    for (int t = 0; t < 3; ++t)
        copies.emplace_back([&] {
            while (!stop) {
                CopyGrace::Reader r(g);
                std::this_thread::sleep_for(std::chrono::microseconds(200));
            }
        });
    for (int i = 0; i < 50; ++i) EXPECT_TRUE(g.wait_for_readers(std::chrono::seconds(10)));
    stop = true;
    for (auto& t : copies) t.join();
}

}  // namespace
}  // namespace moecache::cuda
