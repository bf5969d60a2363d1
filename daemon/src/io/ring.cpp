#include "ring.h"

#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>

#include <cerrno>
#include <climits>
#include <string>
#include <utility>

namespace moecache::daemon::io {

namespace {

// The optional setup flags, in the order they are given up on EINVAL: the newest kernel feature
// first (DEFER_TASKRUN 6.1 also needs SINGLE_ISSUER 6.0, COOP_TASKRUN 5.19, SUBMIT_ALL 5.18).
constexpr uint32_t kOptionalFlags[] = {
    IORING_SETUP_DEFER_TASKRUN,  // completions' task work runs only when we ask: no interruptions
    IORING_SETUP_SINGLE_ISSUER,  // one thread submits: the kernel can skip locking
    IORING_SETUP_COOP_TASKRUN,   // no IPI to run task work; it waits for our next system call
    IORING_SETUP_SUBMIT_ALL,     // one bad SQE does not stop the rest of the batch
};

}  // namespace

Result<std::unique_ptr<Ring>> Ring::create(const Params& params) {
    uint32_t flags = IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER;
    if (params.defer_taskrun) flags |= IORING_SETUP_DEFER_TASKRUN;

    std::unique_ptr<Ring> ring(new Ring());
    size_t next_drop = 0;
    for (;;) {
        io_uring_params p{};
        p.flags = flags | IORING_SETUP_CQSIZE;
        p.cq_entries = params.cq_entries;
        const int r = io_uring_queue_init_params(params.sq_entries, &ring->ring_, &p);
        if (r == 0) {
            ring->live_ = true;
            break;
        }
        if (r != -EINVAL) {
            return fail(-r, fmt::format("io_uring_setup ({} entries, flags {:#x}) failed{}", params.sq_entries,
                                        p.flags,
                                        r == -EPERM ? " (denied: a seccomp profile, or /proc/sys/kernel/io_uring_disabled)" : ""));
        }
        while (next_drop < std::size(kOptionalFlags) && (flags & kOptionalFlags[next_drop]) == 0) ++next_drop;
        if (next_drop == std::size(kOptionalFlags)) {
            return fail(EINVAL, fmt::format("io_uring_setup ({} entries) refuses even the plainest flags {:#x}",
                                            params.sq_entries, p.flags));
        }
        flags &= ~kOptionalFlags[next_drop++];
    }
    // Saves an fd lookup per io_uring_enter; a kernel without it (< 5.18) just does the lookup.
    (void)io_uring_register_ring_fd(&ring->ring_);
    return ring;
}

Ring::~Ring() {
    if (live_) io_uring_queue_exit(&ring_);
}

Result<void> Ring::register_eventfd(int fd) {
    const int r = io_uring_register_eventfd(&ring_, fd);
    if (r < 0) return fail(-r, "io_uring_register_eventfd");
    return {};
}

Result<void> Ring::register_buffers(const std::vector<iovec>& buffers) {
    const int r = io_uring_register_buffers(&ring_, buffers.data(), static_cast<unsigned>(buffers.size()));
    if (r < 0) return fail(-r, fmt::format("io_uring_register_buffers ({} buffers)", buffers.size()));
    return {};
}

Result<BufferPool> BufferPool::allocate(uint32_t count, uint32_t size) {
    const uint64_t bytes = uint64_t{count} * size;
    // MAP_POPULATE: fault the pages in now, under the memory policy just set, not on first read.
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) return fail_errno("mmap of {} read buffers of {} bytes", count, size);
    BufferPool pool;
    pool.base_ = p;
    pool.count_ = count;
    pool.size_ = size;
    return pool;
}

BufferPool::BufferPool(BufferPool&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), count_(o.count_), size_(o.size_) {}

BufferPool& BufferPool::operator=(BufferPool&& o) noexcept {
    if (this != &o) {
        this->~BufferPool();
        base_ = std::exchange(o.base_, nullptr);
        count_ = o.count_;
        size_ = o.size_;
    }
    return *this;
}

BufferPool::~BufferPool() {
    if (base_ != nullptr) ::munmap(base_, uint64_t{count_} * size_);
}

std::vector<iovec> BufferPool::iovecs() const {
    std::vector<iovec> v(count_);
    for (uint32_t i = 0; i < count_; ++i) v[i] = iovec{buffer(i), size_};
    return v;
}

namespace {

std::string allowed_nodes() {
    std::string s;
    for (int n = 0; n <= numa_max_node(); ++n) {
        if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(n)) == 0) continue;
        s += fmt::format("{}{}", s.empty() ? "" : ",", n);
    }
    return s.empty() ? "none" : s;
}

}  // namespace

Result<void> prefer_numa_node(int node) {
    if (node < 0) return failf("NUMA node {} is not a node (use -1 for no preference)", node);
    if (numa_available() < 0) {
        // A kernel without NUMA has one node, 0, and nothing to prefer.
        if (node == 0) return {};
        return fail(EINVAL, fmt::format("NUMA node {} does not exist: this kernel has no NUMA support, "
                                        "so only node 0 (or -1) is valid", node));
    }
    if (node > numa_max_node() || numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node)) == 0) {
        return fail(EINVAL, fmt::format("NUMA node {} does not exist or is not allowed to this process "
                                        "(nodes here: {}); set numa_node to one of them or -1",
                                        node, allowed_nodes()));
    }
    constexpr unsigned kBits = sizeof(unsigned long) * CHAR_BIT;
    std::vector<unsigned long> mask(static_cast<unsigned>(node) / kBits + 1, 0);
    mask[static_cast<unsigned>(node) / kBits] |= 1ul << (static_cast<unsigned>(node) % kBits);
    // maxnode counts one past the last bit the kernel reads.
    if (set_mempolicy(MPOL_PREFERRED, mask.data(), mask.size() * kBits + 1) != 0) {
        return fail_errno("set_mempolicy(MPOL_PREFERRED, node {})", node);
    }
    return {};
}

}  // namespace moecache::daemon::io
