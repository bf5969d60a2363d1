// OffLoop: work that may block on a file (a GGUF header read, a model's setup) done on threads of
// its own, so that the daemon's loop never waits on a file system: a hung NFS or SMB server, or a
// FUSE file system a user mounted with allow_other, answers a read never or after minutes.
//
// Each job runs on a thread of its own and returns what the loop then does with its result (a
// continuation). The loop learns of finished jobs through event_fd() and runs their continuations
// in turn(). A job not finished by its deadline is given up: turn() runs its `late` instead, and
// what the job returns when (if) it ends is dropped on its own thread. Threads of jobs given up
// stay blocked where they are (nothing can interrupt a read a file system does not answer); they
// count against the limit on threads, so at most kMaxThreads of them exist at once, and run()
// refuses more while that many hang.
//
// Threading: run(), turn(), wait() and the destructor come from the loop's thread. The destructor
// does not wait for any job: a thread still running is left to end (or to the process's exit) and
// drops its result; nothing it holds refers to the OffLoop.
#pragma once

#include "moecache/error.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace moecache::daemon {

class OffLoop {
public:
    using Continuation = std::function<void()>;
    using Work = std::function<Continuation()>;
    static constexpr uint32_t kMaxThreads = 16;

    static Result<OffLoop> create();
    OffLoop(OffLoop&&) noexcept;
    OffLoop& operator=(OffLoop&&) noexcept;
    ~OffLoop();

    // Starts `work` on a thread of its own (`what` names it in errors). Its continuation runs in a
    // later turn(); if it has not finished within `deadline`, `late` runs instead (from turn()).
    // Fails (EAGAIN) while kMaxThreads jobs run, those given up included.
    Result<uint64_t> run(std::string what, std::chrono::milliseconds deadline, Work work, Continuation late);
    // Runs the continuations of jobs that finished and the `late` of jobs past their deadline.
    void turn();
    // Waits (blocking the caller) until job `id` is finished or past its deadline, then turn()s.
    // For the daemon's start, which opens its configured models before it takes requests.
    void wait(uint64_t id);
    // Waits for every job started so far, as wait() does each.
    void wait_all();

    [[nodiscard]] int event_fd() const;
    // Milliseconds until the earliest deadline of a job that runs (-1: none), for the loop's wait.
    [[nodiscard]] int due_in_ms() const;
    [[nodiscard]] uint32_t running() const;  // jobs on threads now, those given up included
    [[nodiscard]] uint32_t given_up() const;  // of them, past their deadline
    [[nodiscard]] uint64_t late_total() const;  // jobs given up since the start

private:
    struct State;
    explicit OffLoop(std::shared_ptr<State> s);
    std::shared_ptr<State> state_;
};

}  // namespace moecache::daemon
