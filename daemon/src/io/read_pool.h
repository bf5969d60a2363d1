// The prefetcher's second engine, for where io_uring is denied: Docker's and containerd's default
// seccomp profiles refuse io_uring_setup (EPERM), as does kernel.io_uring_disabled = 2. A few
// threads do plain pread(2)s into the slots' buffers; the scheduler above (prefetcher.cpp) is the
// same for both engines. Completions come back the way the ring's do: (user data, result) pairs
// and a count on an eventfd, so the daemon's loop waits on one descriptor whichever engine reads.
//
// Threading: submit(), cancel(), take(), add_worker() and stop() come from the owner's thread; the
// workers only pread, post and signal. A worker blocked in a read a file system never answers
// (a hung NFS server, a FUSE server that stopped) is not waited for: add_worker() replaces it,
// and stop() leaves it behind after its timeout. What workers share lives as long as the last of
// them (a duplicate of the eventfd included), so one that comes back late touches nothing freed;
// its read's buffer is the owner's to leave allocated (stop() says when).
#pragma once

#include "moecache/error.h"

#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace moecache::daemon::io {

class ReadPool {
public:
    struct Completion {
        uint64_t user_data = 0;
        int res = 0;  // bytes read, 0 at end of file, or -errno (-ECANCELED: taken back by cancel)
    };
    static constexpr uint32_t kMaxThreads = 64;

    // `threads` workers (1..64) signalling `event_fd` (duplicated here). The workers are started
    // here, so they inherit the calling thread's memory policy and signal mask.
    static Result<std::unique_ptr<ReadPool>> create(uint32_t threads, int event_fd);
    ~ReadPool();  // stop(2 s), unless stop() was called
    ReadPool(const ReadPool&) = delete;
    ReadPool& operator=(const ReadPool&) = delete;

    // Reads through a duplicate of `fd` (closed when the read is done): the caller may close its own.
    void submit(int fd, void* buf, uint32_t length, uint64_t offset, uint64_t user_data);
    // A read not started yet completes at once with -ECANCELED; one being read completes as usual.
    void cancel(uint64_t user_data);
    // Every completion posted since the last call, oldest first.
    std::vector<Completion> take();
    // One more worker, for one that a read holds (at most kMaxThreads in all).
    void add_worker();
    // Stops the workers after their current read (queued reads are dropped) and waits for them up
    // to `most`. False: some are still in a read, left behind; their buffers must stay allocated.
    bool stop(std::chrono::milliseconds most);
    [[nodiscard]] uint32_t threads() const;

private:
    struct Shared;
    explicit ReadPool(std::shared_ptr<Shared> s) : s_(std::move(s)) {}
    Result<void> start_worker();
    std::shared_ptr<Shared> s_;
    bool stopped_ = false;  // stop() was called: the destructor waits no more
};

}  // namespace moecache::daemon::io
