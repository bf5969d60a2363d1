// OffLoop (daemon/include/moecache/daemon/off_loop.h): work done on threads, its continuation run
// by the loop; work past its deadline given up (its `late` run instead, its result dropped), the
// threads it holds counted against the limit; the destructor waits for nothing.
#include "moecache/daemon/off_loop.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

namespace moecache::daemon {
namespace {

using namespace std::chrono_literals;

// A gate the jobs wait at, as a read waits on a file system that does not answer.
struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    void wait() {
        std::unique_lock l(mu);
        cv.wait(l, [&] { return open; });
    }
    void release() {
        {
            std::lock_guard l(mu);
            open = true;
        }
        cv.notify_all();
    }
};

void turn_until(OffLoop& o, const std::function<bool()>& done, std::chrono::milliseconds most = 5s) {
    const auto until = std::chrono::steady_clock::now() + most;
    while (!done() && std::chrono::steady_clock::now() < until) {
        pollfd p{o.event_fd(), POLLIN, 0};
        (void)::poll(&p, 1, 10);
        o.turn();
    }
}

TEST(OffLoop, TheContinuationRunsOnTheLoopsThread) {
    auto o = OffLoop::create();
    ASSERT_TRUE(o) << o.error().what();
    const auto loop = std::this_thread::get_id();
    std::thread::id worked, continued;
    bool late = false;
    auto id = o->run("a job", 5s, [&]() -> OffLoop::Continuation {
        worked = std::this_thread::get_id();
        return [&] { continued = std::this_thread::get_id(); };
    }, [&] { late = true; });
    ASSERT_TRUE(id) << id.error().what();
    turn_until(*o, [&] { return continued != std::thread::id{}; });
    EXPECT_NE(worked, loop);
    EXPECT_EQ(continued, loop);
    EXPECT_FALSE(late);
    EXPECT_EQ(o->running(), 0u);
}

TEST(OffLoop, WorkPastItsDeadlineIsGivenUpAndItsResultDropped) {
    auto o = OffLoop::create();
    ASSERT_TRUE(o);
    auto gate = std::make_shared<Gate>();
    int late = 0, continued = 0;
    auto id = o->run("a hung read", 100ms, [gate, &continued]() -> OffLoop::Continuation {
        gate->wait();
        return [&continued] { ++continued; };
    }, [&] { ++late; });
    ASSERT_TRUE(id);
    const auto t0 = std::chrono::steady_clock::now();
    o->wait(*id);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << "wait() waits no longer than the deadline";
    EXPECT_EQ(late, 1);
    EXPECT_EQ(o->given_up(), 1u);
    EXPECT_EQ(o->late_total(), 1u);
    gate->release();
    turn_until(*o, [&] { return o->running() == 0; });
    o->turn();
    EXPECT_EQ(continued, 0) << "a job given up never continues";
    EXPECT_EQ(late, 1);
    EXPECT_EQ(o->given_up(), 0u);
}

TEST(OffLoop, HungThreadsCountAgainstTheLimit) {
    auto o = OffLoop::create();
    ASSERT_TRUE(o);
    auto gate = std::make_shared<Gate>();
    for (uint32_t i = 0; i < OffLoop::kMaxThreads; ++i)
        ASSERT_TRUE(o->run("hangs", 10ms, [gate]() -> OffLoop::Continuation { gate->wait(); return {}; }, {}));
    std::this_thread::sleep_for(20ms);
    o->turn();
    EXPECT_EQ(o->given_up(), OffLoop::kMaxThreads);
    auto more = o->run("one more", 1s, [] { return OffLoop::Continuation{}; }, {});
    ASSERT_FALSE(more);
    EXPECT_EQ(more.error().errnum, EAGAIN);
    EXPECT_NE(more.error().what().find("past their deadline"), std::string::npos) << more.error().what();
    gate->release();
    turn_until(*o, [&] { return o->running() == 0; });
    EXPECT_TRUE(o->run("now it fits", 1s, [] { return OffLoop::Continuation{}; }, {}));
}

TEST(OffLoop, TheDestructorWaitsForNoJob) {
    auto gate = std::make_shared<Gate>();
    std::atomic<bool> continued{false};
    {
        auto o = OffLoop::create();
        ASSERT_TRUE(o);
        ASSERT_TRUE(o->run("hangs", 10s, [gate, &continued]() -> OffLoop::Continuation {
            gate->wait();
            return [&continued] { continued = true; };
        }, {}));
        const auto t0 = std::chrono::steady_clock::now();
        o = tl::unexpected(Error{0, ""});  // destroyed here, its job still running
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
    }
    gate->release();
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(continued) << "the job's result went nowhere";
}

}  // namespace
}  // namespace moecache::daemon
