// The kernel handles under the prefetcher, each with one owner: the io_uring instance (set up with
// the best flags this kernel takes), the read buffers, and the NUMA preference of the thread.
#pragma once

#include "moecache/error.h"

#include <liburing.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace moecache::daemon::io {

// One io_uring instance. Not movable: liburing's struct io_uring is used in place, so it lives
// behind a unique_ptr.
class Ring {
public:
    struct Params {
        uint32_t sq_entries = 0;
        uint32_t cq_entries = 0;
        bool defer_taskrun = true;
    };
    // Asks for SUBMIT_ALL | COOP_TASKRUN | SINGLE_ISSUER | DEFER_TASKRUN and drops one flag at a
    // time, newest kernel feature first, while the kernel answers EINVAL.
    static Result<std::unique_ptr<Ring>> create(const Params& params);
    ~Ring();
    Ring(const Ring&) = delete;
    Ring& operator=(const Ring&) = delete;

    io_uring* get() { return &ring_; }
    [[nodiscard]] uint32_t flags() const { return ring_.flags; }
    [[nodiscard]] uint32_t sq_entries() const { return ring_.sq.ring_entries; }
    [[nodiscard]] uint32_t cq_entries() const { return ring_.cq.ring_entries; }
    [[nodiscard]] bool defers_taskrun() const { return (ring_.flags & IORING_SETUP_DEFER_TASKRUN) != 0; }

    // Both are undone by the kernel when the ring is torn down.
    Result<void> register_eventfd(int fd);
    Result<void> register_buffers(const std::vector<iovec>& buffers);

private:
    Ring() = default;
    io_uring ring_{};
    bool live_ = false;  // io_uring_queue_init_params succeeded
};

// Anonymous memory cut into `count` buffers of `size` bytes, mapped at once so that the pages come
// from the memory policy in force (see prefer_numa_node).
class BufferPool {
public:
    BufferPool() = default;
    static Result<BufferPool> allocate(uint32_t count, uint32_t size);
    BufferPool(BufferPool&& o) noexcept;
    BufferPool& operator=(BufferPool&& o) noexcept;
    BufferPool(const BufferPool&) = delete;
    BufferPool& operator=(const BufferPool&) = delete;
    ~BufferPool();

    [[nodiscard]] void* buffer(uint32_t i) const { return static_cast<char*>(base_) + uint64_t{i} * size_; }
    [[nodiscard]] std::vector<iovec> iovecs() const;
    // Gives the memory up without unmapping it: for when reads into it may still be in flight.
    void leak() { base_ = nullptr; }

private:
    void* base_ = nullptr;
    uint32_t count_ = 0;
    uint32_t size_ = 0;
};

// Sets MPOL_PREFERRED for `node` on the calling thread. Fails when the node does not exist or is
// not allowed to this task (cpuset), with a message that lists the nodes there are.
Result<void> prefer_numa_node(int node);

}  // namespace moecache::daemon::io
