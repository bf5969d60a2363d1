// The prefetcher's second engine, for where io_uring is denied: Docker's and containerd's default
// seccomp profiles refuse io_uring_setup (EPERM), as does kernel.io_uring_disabled = 2. A few
// threads do plain pread(2)s into the slots' buffers; the scheduler above (prefetcher.cpp) is the
// same for both engines. Completions come back the way the ring's do: (user data, result) pairs
// and a count on an eventfd, so the daemon's loop waits on one descriptor whichever engine reads.
//
// Threading: submit(), cancel() and take() come from the owner's thread; the workers only pread,
// post and signal. The destructor stops the workers after their current read (queued reads are
// dropped): nothing writes into a buffer once it has returned.
#pragma once

#include "moecache/error.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace moecache::daemon::io {

class ReadPool {
public:
    struct Completion {
        uint64_t user_data = 0;
        int res = 0;  // bytes read, 0 at end of file, or -errno (-ECANCELED: taken back by cancel)
    };

    // `threads` workers (1..64) signalling `event_fd` (borrowed: it outlives the pool). The
    // workers are started here, so they inherit the calling thread's memory policy and signal mask.
    static Result<std::unique_ptr<ReadPool>> create(uint32_t threads, int event_fd);
    ~ReadPool();
    ReadPool(const ReadPool&) = delete;
    ReadPool& operator=(const ReadPool&) = delete;

    // Reads through a duplicate of `fd` (closed when the read is done): the caller may close its own.
    void submit(int fd, void* buf, uint32_t length, uint64_t offset, uint64_t user_data);
    // A read not started yet completes at once with -ECANCELED; one being read completes as usual.
    void cancel(uint64_t user_data);
    // Every completion posted since the last call, oldest first.
    std::vector<Completion> take();
    [[nodiscard]] uint32_t threads() const { return static_cast<uint32_t>(workers_.size()); }

private:
    struct Job {
        int fd;
        void* buf;
        uint32_t length;
        uint64_t offset;
        uint64_t user_data;
    };
    explicit ReadPool(int event_fd) : event_fd_(event_fd) {}
    void work();
    void post(const Completion& c);  // with mu_ held

    int event_fd_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> jobs_;
    std::vector<Completion> done_;
    bool stop_ = false;
    std::vector<std::thread> workers_;
};

}  // namespace moecache::daemon::io
