// Prefetcher: reads byte ranges of model files through io_uring so that their pages land in the
// page cache, ahead of the locker mlocking them. The data read is thrown away. Where io_uring is
// denied (a container's default seccomp profile, kernel.io_uring_disabled), a few threads read with
// pread(2) instead, under the same scheduler, callbacks and eventfd (Options::engine).
//
// Threading: a Prefetcher belongs to one thread, the one that called create() (the daemon's event
// loop). The ring is set up SINGLE_ISSUER and, where the kernel has it, DEFER_TASKRUN: every call,
// the destructor included, must come from that thread.
//
// Blocking: nothing here waits for I/O except run_until_idle() and the destructor (which waits
// for the reads still in flight, at most 2 s: a read a file system never answers is left behind). submit() does each read's page
// allocation and bio submission inline, in the calling thread (microseconds per read; on a cold
// file the file system may first read its extent blocks). Without DEFER_TASKRUN (kernels before
// 6.1, or Options::defer_taskrun = false) completions run as task work that interrupts the
// thread's blocking system calls: epoll_wait returns EINTR, and the loop must retry it.
//
// Driving it from an epoll loop:
//   auto p = MC_TRY(Prefetcher::create({.queue_depth = 32}));
//   p.set_callback([](uint64_t id, uint64_t tag, uint64_t bytes, int err) { ... });
//   epoll_ctl(ep, EPOLL_CTL_ADD, p.event_fd(), EPOLLIN);
//   p.enqueue({fd, offset, length, priority, tag});      // any number, from anywhere in the loop
//   p.submit();                                          // once per loop turn: starts the reads
//   ... event_fd() readable -> p.on_ready();             // reaps, calls callbacks, refills
// enqueue() and cancel() only record what is wanted; reads start and callbacks run only inside
// submit(), on_ready() and run_until_idle(), so a callback never runs inside enqueue() or cancel()
// and may itself call them.
//
// NUMA (Options::numa_node >= 0): create() sets the calling thread's memory policy to
// MPOL_PREFERRED for that node, before the ring and the read buffers exist, and leaves it set.
// Guaranteed: the node exists and the policy was accepted (else create() fails). Page-cache pages
// that this thread's reads allocate (buffered io_uring reads allocate in the submitting task, and
// io-wq workers, started lazily, inherit its policy) come from that node while it has free memory.
// Not guaranteed: "preferred" falls back to other nodes when the node is short of memory; pages
// that were already cached, or that another process's reads or the kernel's own readahead bring
// in, stay where they are (nothing is migrated); every other allocation of the calling thread
// also prefers the node from then on.
#pragma once

#include "moecache/error.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moecache::daemon {

struct PrefetchRequest {
    int fd = -1;          // borrowed: must stay open until this request's callback has run
    uint64_t offset = 0;  // byte range of the file; need not be page aligned
    uint64_t length = 0;
    int32_t priority = 0;  // lower is sooner; FIFO among equal priorities
    uint64_t tag = 0;      // the caller's key (e.g. model, layer, expert); cancel() works by tag
};

// Bytes and requests as the prefetcher sees them now. Every enqueued byte is in exactly one of
// queued (not yet issued), inflight (issued, not completed) or, once read, done; bytes that will
// never be read (EOF, error, cancel) leave queued/inflight without entering done. Once idle,
// done_bytes is the sum of the bytes reported to the callbacks.
struct PrefetchProgress {
    uint64_t queued_bytes = 0;
    uint64_t inflight_bytes = 0;
    uint64_t done_bytes = 0;
    uint64_t requests_done = 0;       // finished without error (an early EOF included)
    uint64_t requests_failed = 0;     // finished with an errno
    uint64_t requests_cancelled = 0;  // finished by cancel()
    // How the work went, for metrics and tests.
    uint64_t reads_submitted = 0;  // read SQEs, resubmissions included
    uint64_t short_reads = 0;      // reads that returned less than asked and were resubmitted
    uint64_t retries = 0;          // reads resubmitted after -EAGAIN / -EINTR
};

class Prefetcher {
public:
    enum class Engine : uint8_t {
        Auto,     // io_uring, or threads when io_uring is denied (EPERM, EACCES, ENOSYS)
        IoUring,  // io_uring or fail
        Threads,  // pread(2) in threads
    };
    struct Options {
        Engine engine = Engine::Auto;
        uint32_t threads = 0;           // the Threads engine's readers, <= queue_depth; 0: min(queue_depth, 16)
        uint32_t queue_depth = 32;      // reads in flight across all files, 1..4096
        uint32_t read_size = 1u << 20;  // largest single read: a multiple of 4096, 4 KiB..64 MiB
        int numa_node = -1;             // >= 0: prefer this node for the pages read (see above)
        bool register_buffers = true;   // try fixed buffers (falls back to plain reads)
        bool defer_taskrun = true;      // try IORING_SETUP_DEFER_TASKRUN (falls back without)
    };

    // What create() got from this kernel, for logs and tests.
    struct Setup {
        Engine engine = Engine::IoUring;  // the one reading: IoUring or Threads
        uint32_t threads = 0;             // Threads: how many
        std::string io_uring_denied;      // why io_uring was not used, when Auto fell back
        uint32_t ring_flags = 0;  // the IORING_SETUP_* flags the kernel accepted
        uint32_t sq_entries = 0;
        uint32_t cq_entries = 0;
        bool registered_buffers = false;
        int numa_node = -1;
    };

    // Called once per request when all its reads are done. bytes: bytes read (short when the file
    // ends before the range does). err: 0, ECANCELED after cancel(), or the errno of the failed
    // read (EBADF, EIO, EINVAL for a range that overflows, ...). Must not throw.
    using Callback = std::function<void(uint64_t id, uint64_t tag, uint64_t bytes, int err)>;

    static Result<Prefetcher> create(const Options& options);
    Prefetcher(Prefetcher&&) noexcept;
    Prefetcher& operator=(Prefetcher&&) noexcept;
    Prefetcher(const Prefetcher&) = delete;
    Prefetcher& operator=(const Prefetcher&) = delete;
    ~Prefetcher();

    void set_callback(Callback callback);

    // Queues a range, split into reads of at most read_size (split points page aligned). Returns
    // the request id (never 0). A bad request (fd < 0, a range past 2^63) fails through its callback.
    uint64_t enqueue(const PrefetchRequest& request);
    // Drops the queued reads of every live request with this tag and asks the kernel to cancel the
    // ones in flight; their results are ignored. Each such request then reports ECANCELED with the
    // bytes it had read. Returns how many requests were cancelled.
    size_t cancel(uint64_t tag);
    // The tags of requests with a read issued longer than `deadline` ago and not completed: a file
    // system that does not answer (a hung NFS server, a FUSE server that stopped).
    [[nodiscard]] std::vector<uint64_t> overdue(std::chrono::nanoseconds deadline) const;
    // Reads in flight are timed from now on, as if issued now: for after the loop was held (a wait
    // for a model's open, OffLoop::wait), when it could neither reap their completions nor, under
    // DEFER_TASKRUN, drive them (a buffered read waiting for its pages goes on as the loop's task
    // work). Time the loop was away is not the file system's: counted, it set healthy models aside.
    void restart_deadlines();
    // Gives up the requests of this tag: each reports ETIMEDOUT with the bytes it had read, and its
    // reads in flight stop counting against queue_depth (up to queue_depth such reads at once: the
    // slots are twice queue_depth), so that other files are read meanwhile. The kernel is asked to
    // drop them; a slot comes back when it answers. Returns how many requests were given up.
    size_t abandon(uint64_t tag);

    // Runs callbacks of finished requests, fills free slots of the queue in priority order and
    // submits them in one system call (none when there is nothing to submit).
    Result<void> submit();
    // For when event_fd() is readable: reaps every ready completion, then submit(). Never blocks.
    Result<void> on_ready();
    // For tools and tests: submits and waits until nothing is queued or in flight.
    Result<void> run_until_idle();

    // Readable when completions are ready (an eventfd registered with the ring). Owned here.
    [[nodiscard]] int event_fd() const;
    // Nothing queued, in flight or waiting for its callback.
    [[nodiscard]] bool idle() const;
    [[nodiscard]] PrefetchProgress progress() const;
    [[nodiscard]] const Setup& setup() const;

private:
    struct State;
    explicit Prefetcher(std::unique_ptr<State> state);
    std::unique_ptr<State> state_;
};

}  // namespace moecache::daemon
