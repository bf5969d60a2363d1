// The prefetcher's scheduler: requests wait in per-priority FIFOs, are cut into reads, and each
// read occupies one of queue_depth slots (its own buffer) from submission to completion. The
// kernel tells us which slot completed through the SQE user data: slot index and generation.
#include "moecache/daemon/prefetcher.h"

#include "moecache/log.h"
#include "moecache/unique_fd.h"
#include "read_pool.h"
#include "ring.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moecache::daemon {

namespace {

constexpr uint64_t kPage = 4096;
constexpr uint32_t kMaxQueueDepth = 4096;
constexpr uint32_t kMaxReadSize = 64u << 20;
constexpr uint32_t kMaxRetries = 16;  // -EAGAIN / -EINTR in a row on one read before it fails

// A read's user data: the slot in the low bits, the slot's generation above them, so that a
// completion or cancel meant for an earlier read of a reused slot is never taken for the current one.
constexpr unsigned kSlotBits = 16;
constexpr uint64_t kSlotMask = (uint64_t{1} << kSlotBits) - 1;
constexpr uint64_t kCancelUserData = ~uint64_t{0};  // our ASYNC_CANCEL SQEs: their results don't matter
static_assert(kMaxQueueDepth <= kSlotMask);

uint64_t read_user_data(uint32_t slot, uint64_t generation) { return (generation << kSlotBits) | slot; }

// io_uring denied, not broken: a seccomp filter (Docker's and containerd's default profiles answer
// EPERM), kernel.io_uring_disabled, a kernel built without it (ENOSYS).
bool denied(const Error& e) { return e.errnum == EPERM || e.errnum == EACCES || e.errnum == ENOSYS; }

Result<void> validate(const Prefetcher::Options& o) {
    if (o.queue_depth == 0 || o.queue_depth > kMaxQueueDepth)
        return fail(EINVAL, fmt::format("prefetch queue_depth {} is out of range 1..{}", o.queue_depth, kMaxQueueDepth));
    if (o.read_size < kPage || o.read_size > kMaxReadSize || o.read_size % kPage != 0)
        return fail(EINVAL, fmt::format("prefetch read_size {} must be a multiple of 4096 between 4 KiB and 64 MiB",
                                        o.read_size));
    if (o.numa_node < -1) return fail(EINVAL, fmt::format("prefetch numa_node {}: use -1 or a node number", o.numa_node));
    return {};
}

}  // namespace

struct Prefetcher::State {
    struct Request {
        uint64_t tag = 0;
        int fd = -1;
        uint64_t next = 0;  // [next, end) is not issued yet
        uint64_t end = 0;
        uint64_t bytes_read = 0;
        uint32_t inflight = 0;  // reads issued whose completion has not been reaped
        int err = 0;
        bool cancelled = false;
        bool timed_out = false;  // given up by abandon(): reports ETIMEDOUT
    };
    struct Slot {
        uint64_t request = 0;  // 0: free
        uint64_t generation = 0;
        uint64_t offset = 0;  // of the whole read; a short read continues at offset + done
        uint32_t length = 0;
        uint32_t done = 0;
        uint32_t retries = 0;
        bool cancel_sent = false;
        bool stuck = false;  // given up by abandon(): its completion only frees the slot
        int64_t issued_ns = 0;  // when its current read was issued (steady clock)
    };
    struct Finished {
        uint64_t id, tag, bytes;
        int err;
    };

    Options options;
    Setup setup;
    Callback callback;
    // Destroyed in reverse: the ring first (the kernel drops its references to the eventfd and the
    // registered buffers), then the eventfd, then the buffers.
    io::BufferPool buffers;
    UniqueFd eventfd;
    std::unique_ptr<io::Ring> ring;      // the engine: io_uring,
    std::unique_ptr<io::ReadPool> pool;  // or threads that pread where io_uring is denied

    std::unordered_map<uint64_t, Request> requests;           // live requests by id
    std::map<int32_t, std::deque<uint64_t>> waiting;          // ids by priority, FIFO; stale ids are skipped
    std::unordered_map<uint64_t, std::vector<uint64_t>> by_tag;  // live ids by tag, for cancel()
    std::vector<Slot> slots;
    std::vector<uint32_t> free_slots;
    uint32_t busy_slots = 0;
    uint32_t stuck_slots = 0;  // of the busy ones, reads given up that the kernel still holds
    uint32_t cancels_in_kernel = 0;  // ASYNC_CANCEL SQEs whose completion is not reaped yet
    std::vector<Finished> finished;  // waiting for their callback
    uint64_t next_id = 1;
    PrefetchProgress progress;

    State() = default;
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() { drain_before_exit(); }

    uint64_t enqueue(const PrefetchRequest& q);
    size_t cancel(uint64_t tag);
    std::vector<uint64_t> overdue(std::chrono::nanoseconds deadline) const;
    void restart_deadlines();
    size_t abandon(uint64_t tag);
    Result<void> submit();
    Result<void> on_ready();
    Result<void> run_until_idle();
    [[nodiscard]] bool idle() const { return requests.empty() && finished.empty() && busy_slots == 0; }

private:
    void fill_slots();
    void prep_read(uint32_t slot);
    void prep_cancel(uint32_t slot);
    io_uring_sqe* next_sqe();
    Result<void> flush();
    void reap();
    void complete(uint64_t user_data, int res);
    void release(uint32_t slot, Request& r);
    void stop_issuing(Request& r);
    void finish_if_done(uint64_t id);
    void finish_now(uint64_t id, uint64_t tag, int err);
    void deliver();
    void drain_eventfd() const;
    [[nodiscard]] bool kernel_holds_work() const;
    Result<void> run_task_work();
    void drain_before_exit();
};

uint64_t Prefetcher::State::enqueue(const PrefetchRequest& q) {
    const uint64_t id = next_id++;
    constexpr uint64_t kMaxOffset = uint64_t{std::numeric_limits<int64_t>::max()};
    if (q.fd < 0) {
        finish_now(id, q.tag, EBADF);
    } else if (q.length > kMaxOffset || q.offset > kMaxOffset - q.length) {
        finish_now(id, q.tag, EINVAL);  // the kernel takes loff_t offsets
    } else if (q.length == 0) {
        finish_now(id, q.tag, 0);
    } else {
        requests.emplace(id, Request{.tag = q.tag, .fd = q.fd, .next = q.offset, .end = q.offset + q.length});
        waiting[q.priority].push_back(id);
        by_tag[q.tag].push_back(id);
        progress.queued_bytes += q.length;
    }
    return id;
}

size_t Prefetcher::State::cancel(uint64_t tag) {
    const auto t = by_tag.find(tag);
    if (t == by_tag.end()) return 0;
    const std::vector<uint64_t> ids = t->second;  // a copy: finishing edits by_tag
    size_t n = 0;
    for (const uint64_t id : ids) {
        Request& r = requests.at(id);
        if (r.cancelled) continue;
        r.cancelled = true;
        stop_issuing(r);
        ++n;
        finish_if_done(id);
    }
    // The reads still in flight: ask the kernel to drop them (it can while one waits in io-wq;
    // a read already waiting on the device just completes), and ignore what they return.
    for (uint32_t i = 0; i < slots.size(); ++i) {
        Slot& s = slots[i];
        if (s.request == 0 || s.cancel_sent || s.stuck) continue;
        const auto it = requests.find(s.request);
        if (it != requests.end() && it->second.cancelled) prep_cancel(i);
    }
    return n;
}

std::vector<uint64_t> Prefetcher::State::overdue(std::chrono::nanoseconds deadline) const {
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count();
    std::vector<uint64_t> tags;
    for (const Slot& s : slots) {
        if (s.request == 0 || s.stuck || now - s.issued_ns < deadline.count()) continue;
        const auto it = requests.find(s.request);
        if (it != requests.end() && std::find(tags.begin(), tags.end(), it->second.tag) == tags.end())
            tags.push_back(it->second.tag);
    }
    return tags;
}

void Prefetcher::State::restart_deadlines() {
    const int64_t now =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    for (Slot& s : slots)
        if (s.request != 0 && !s.stuck) s.issued_ns = std::max(s.issued_ns, now);
}

size_t Prefetcher::State::abandon(uint64_t tag) {
    const auto t = by_tag.find(tag);
    if (t == by_tag.end()) return 0;
    const std::vector<uint64_t> ids = t->second;
    for (const uint64_t id : ids) {
        Request& r = requests.at(id);
        r.cancelled = r.timed_out = true;
        stop_issuing(r);
    }
    // Its reads in flight stop counting against queue_depth (as many as there are spare slots);
    // the kernel is asked to drop them, and their slots come back whenever it answers.
    for (uint32_t i = 0; i < slots.size(); ++i) {
        Slot& s = slots[i];
        if (s.request == 0 || s.stuck || std::find(ids.begin(), ids.end(), s.request) == ids.end()) continue;
        if (!s.cancel_sent) prep_cancel(i);
        if (stuck_slots >= options.queue_depth) continue;
        Request& r = requests.at(s.request);
        progress.inflight_bytes -= s.length - s.done;
        --r.inflight;
        s.stuck = true;
        ++stuck_slots;
        if (pool) pool->add_worker();  // the one that reads it may never come back
    }
    for (const uint64_t id : ids) finish_if_done(id);
    (void)flush();
    return ids.size();
}

Result<void> Prefetcher::State::submit() {
    deliver();
    fill_slots();
    return flush();
}

Result<void> Prefetcher::State::on_ready() {
    // Clear the eventfd before looking, so that whatever arrives after this point signals it
    // again: the other order could lose a wakeup.
    drain_eventfd();
    if (ring && ring->defers_taskrun() && kernel_holds_work()) MC_TRY_VOID(run_task_work());
    reap();
    return submit();
}

// Under DEFER_TASKRUN completions wait as task work until we enter the kernel for them, and since
// 6.13 io_uring_get_events() runs at most 20 items a pass, leaving the rest unannounced (the
// eventfd only rings when the list was empty). Asking for a whole CQ of completions with a zero
// timeout runs every waiting item and returns at once, with -ETIME.
Result<void> Prefetcher::State::run_task_work() {
    __kernel_timespec zero{};
    io_uring_cqe* cqe = nullptr;
    const int r = io_uring_wait_cqes(ring->get(), &cqe, ring->cq_entries(), &zero, nullptr);
    if (r < 0 && r != -ETIME && r != -EINTR && r != -EAGAIN && r != -EBUSY)
        return fail(-r, "io_uring_wait_cqes (running completions' task work)");
    return {};
}

Result<void> Prefetcher::State::run_until_idle() {
    for (;;) {
        MC_TRY_VOID(submit());
        if (busy_slots == 0) {
            if (idle()) break;
            continue;  // callbacks queued or finished more work: go round again
        }
        if (pool) {
            pollfd p{.fd = eventfd.get(), .events = POLLIN, .revents = 0};
            if (::poll(&p, 1, -1) < 0 && errno != EINTR) return fail_errno("poll on the prefetcher's eventfd");
            drain_eventfd();  // before taking: what is posted after this rings again
            reap();
            continue;
        }
        const int r = io_uring_submit_and_wait(ring->get(), 1);
        if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) return fail(-r, "io_uring_submit_and_wait");
        reap();
    }
    drain_eventfd();  // what it counted has been handled here
    return {};
}

void Prefetcher::State::fill_slots() {
    // Slots are twice queue_depth: reads given up (abandon()) hold theirs until the kernel lets go,
    // and do not count against queue_depth meanwhile.
    while (!free_slots.empty() && !waiting.empty() && busy_slots - stuck_slots < options.queue_depth) {
        const auto level = waiting.begin();
        const uint64_t id = level->second.front();
        const auto it = requests.find(id);
        if (it == requests.end() || it->second.next >= it->second.end) {
            level->second.pop_front();  // finished, cancelled or fully issued
            if (level->second.empty()) waiting.erase(level);
            continue;
        }
        Request& r = it->second;
        // After the first read every split point is page aligned, so no page is read twice.
        const uint64_t length = std::min(r.end - r.next, options.read_size - r.next % kPage);
        const uint32_t i = free_slots.back();
        free_slots.pop_back();
        ++busy_slots;
        Slot& s = slots[i];
        s = Slot{.request = id, .generation = s.generation + 1, .offset = r.next,
                 .length = static_cast<uint32_t>(length)};
        r.next += length;
        ++r.inflight;
        progress.queued_bytes -= length;
        progress.inflight_bytes += length;
        prep_read(i);
    }
}

void Prefetcher::State::prep_read(uint32_t i) {
    const Slot& s = slots[i];
    const Request& r = requests.at(s.request);
    // The data is thrown away, so a short read's remainder may land at the start of the buffer.
    // Slots share the queue_depth buffers (slot i and i + queue_depth): the data is thrown away, so
    // two reads landing in one buffer harm nothing.
    const uint32_t b = i % options.queue_depth;
    void* buf = buffers.buffer(b);
    const uint32_t len = s.length - s.done;
    const uint64_t off = s.offset + s.done;
    ++progress.reads_submitted;
    slots[i].issued_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch()).count();
    if (pool) {
        pool->submit(r.fd, buf, len, off, read_user_data(i, s.generation));
        return;
    }
    io_uring_sqe* sqe = next_sqe();
    if (setup.registered_buffers)
        io_uring_prep_read_fixed(sqe, r.fd, buf, len, off, static_cast<int>(b));
    else
        io_uring_prep_read(sqe, r.fd, buf, len, off);
    io_uring_sqe_set_data64(sqe, read_user_data(i, s.generation));
}

void Prefetcher::State::prep_cancel(uint32_t i) {
    if (pool) {
        slots[i].cancel_sent = true;
        pool->cancel(read_user_data(i, slots[i].generation));
        return;
    }
    // Best effort: a cancel never takes the SQ entries that reads may need; without one, the
    // read's result is ignored all the same.
    if (io_uring_sq_space_left(ring->get()) <= options.queue_depth) return;
    io_uring_sqe* sqe = next_sqe();
    io_uring_prep_cancel64(sqe, read_user_data(i, slots[i].generation), 0);
    io_uring_sqe_set_data64(sqe, kCancelUserData);
    slots[i].cancel_sent = true;
    ++cancels_in_kernel;
}

io_uring_sqe* Prefetcher::State::next_sqe() {
    // Cannot come back empty: the SQ has 2 x queue_depth entries, each busy slot has at most one
    // read in it, and cancels only take entries beyond queue_depth (see prep_cancel).
    io_uring_sqe* sqe = io_uring_get_sqe(ring->get());
    if (sqe == nullptr) {
        (void)io_uring_submit(ring->get());
        sqe = io_uring_get_sqe(ring->get());
    }
    if (sqe == nullptr) {
        MC_LOG(LOG_CRIT, "prefetcher: submission queue full with {} slots busy: a bug", busy_slots);
        std::abort();
    }
    return sqe;
}

Result<void> Prefetcher::State::flush() {
    if (pool) return {};  // a pool's reads start as they are submitted
    while (io_uring_sq_ready(ring->get()) > 0) {
        const int r = io_uring_submit(ring->get());
        if (r > 0 || r == -EINTR) continue;
        if (r == 0) break;
        // Out of kernel resources (or a CQ backlog): the SQEs stay queued and go with the next
        // submit, which a completion will bring, as long as something is in the kernel.
        if ((r == -EAGAIN || r == -EBUSY) && kernel_holds_work()) break;
        return fail(-r, fmt::format("io_uring_submit ({} SQEs)", io_uring_sq_ready(ring->get())));
    }
    return {};
}

bool Prefetcher::State::kernel_holds_work() const {
    if (pool) return busy_slots > 0;
    io_uring* rg = ring->get();
    return busy_slots + cancels_in_kernel > io_uring_sq_ready(rg);
}

void Prefetcher::State::reap() {
    if (pool) {
        for (const auto& c : pool->take()) complete(c.user_data, c.res);
        return;
    }
    // Everything ready first, then one advance of the CQ head.
    unsigned head = 0;
    unsigned n = 0;
    io_uring_cqe* cqe = nullptr;
    io_uring_for_each_cqe(ring->get(), head, cqe) {
        complete(cqe->user_data, cqe->res);
        ++n;
    }
    io_uring_cq_advance(ring->get(), n);
}

void Prefetcher::State::complete(uint64_t user_data, int res) {
    if (user_data == kCancelUserData) {
        --cancels_in_kernel;
        return;
    }
    const auto i = static_cast<uint32_t>(user_data & kSlotMask);
    if (i >= slots.size() || slots[i].request == 0 || slots[i].generation != user_data >> kSlotBits) return;
    Slot& s = slots[i];
    if (s.stuck) {  // given up long ago: its request has finished already
        s = Slot{.generation = s.generation};
        --stuck_slots;
        --busy_slots;
        free_slots.push_back(i);
        return;
    }
    const uint64_t id = s.request;
    Request& r = requests.at(id);
    const uint32_t asked = s.length - s.done;

    if (r.cancelled) {
        progress.inflight_bytes -= asked;
    } else if (res > 0) {
        const uint32_t got = std::min(static_cast<uint32_t>(res), asked);
        s.done += got;
        s.retries = 0;
        r.bytes_read += got;
        progress.done_bytes += got;
        progress.inflight_bytes -= got;
        if (s.done < s.length) {
            if (r.err == 0) {
                ++progress.short_reads;
                prep_read(i);  // the rest of it, in the same slot
                return;
            }
            progress.inflight_bytes -= s.length - s.done;
        }
    } else if (res == 0) {
        // At or past EOF (the file may have been truncated under us): the request ends here,
        // without an error, with what it read.
        progress.inflight_bytes -= asked;
        stop_issuing(r);
    } else if ((res == -EAGAIN || res == -EINTR) && s.retries < kMaxRetries) {
        ++s.retries;
        ++progress.retries;
        prep_read(i);
        return;
    } else {
        progress.inflight_bytes -= asked;
        if (r.err == 0) r.err = -res;
        stop_issuing(r);
    }
    release(i, r);
    finish_if_done(id);
}

void Prefetcher::State::release(uint32_t i, Request& r) {
    slots[i].request = 0;
    slots[i].cancel_sent = false;
    free_slots.push_back(i);
    --busy_slots;
    --r.inflight;
}

void Prefetcher::State::stop_issuing(Request& r) {
    progress.queued_bytes -= r.end - r.next;
    r.end = r.next;
}

void Prefetcher::State::finish_if_done(uint64_t id) {
    const auto it = requests.find(id);
    const Request& r = it->second;
    if (r.inflight != 0 || r.next < r.end) return;
    const int err = r.timed_out ? ETIMEDOUT : r.cancelled ? ECANCELED : r.err;
    if (r.cancelled)
        ++progress.requests_cancelled;
    else if (err != 0)
        ++progress.requests_failed;
    else
        ++progress.requests_done;
    finished.push_back(Finished{id, r.tag, r.bytes_read, err});
    auto& ids = by_tag[r.tag];
    ids.erase(std::find(ids.begin(), ids.end(), id));
    if (ids.empty()) by_tag.erase(r.tag);
    requests.erase(it);
}

// A request that ends before any read: counted and reported like any other.
void Prefetcher::State::finish_now(uint64_t id, uint64_t tag, int err) {
    if (err != 0)
        ++progress.requests_failed;
    else
        ++progress.requests_done;
    finished.push_back(Finished{id, tag, 0, err});
}

void Prefetcher::State::deliver() {
    while (!finished.empty()) {
        std::vector<Finished> batch;
        batch.swap(finished);  // callbacks may enqueue, cancel and finish more
        if (!callback) continue;
        for (const Finished& f : batch) callback(f.id, f.tag, f.bytes, f.err);
    }
}

void Prefetcher::State::drain_eventfd() const {
    uint64_t count = 0;
    // Non-blocking: EAGAIN when nothing was signalled.
    while (::read(eventfd.get(), &count, sizeof count) < 0 && errno == EINTR) {
    }
}

// The kernel may still write into the buffers of reads in flight, so they must complete before
// the buffers go. Nobody is called back: the owner is going away.
void Prefetcher::State::drain_before_exit() {
    // At most this long: a read a file system never answers (a hung NFS server, a FUSE server
    // that stopped) must not keep the daemon from stopping. Its buffer is then left to it.
    constexpr auto kMostWait = std::chrono::seconds(2);
    if (pool) {
        if (!pool->stop(kMostWait)) {
            MC_LOG(LOG_WARNING, "prefetcher: reads that do not complete are left behind at exit");
            buffers.leak();
        }
        pool.reset();
        return;
    }
    if (!ring) return;
    for (auto& [id, r] : requests) {
        r.cancelled = true;
        stop_issuing(r);
    }
    for (uint32_t i = 0; i < slots.size(); ++i) {
        if (slots[i].request != 0 && !slots[i].cancel_sent) prep_cancel(i);
    }
    const auto until = std::chrono::steady_clock::now() + kMostWait;
    while (busy_slots > 0) {
        const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(until - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
            MC_LOG(LOG_WARNING, "prefetcher: {} reads did not complete within {} s of the stop: left behind", busy_slots,
                   kMostWait.count());
            buffers.leak();
            return;
        }
        __kernel_timespec ts{.tv_sec = left.count() / 1'000'000'000, .tv_nsec = left.count() % 1'000'000'000};
        io_uring_cqe* cqe = nullptr;
        (void)io_uring_submit(ring->get());
        const int r = io_uring_wait_cqe_timeout(ring->get(), &cqe, &ts);
        if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
            // E.g. -EEXIST: destroyed from another thread than the one that made it (DEFER_TASKRUN).
            MC_LOG(LOG_ERR, "prefetcher: cannot wait for {} reads in flight ({}); leaking their buffers",
                   busy_slots, Error{-r, ""}.what());
            buffers.leak();
            return;
        }
        reap();
    }
}

Result<Prefetcher> Prefetcher::create(const Options& options) {
    MC_TRY_VOID(validate(options));
    if (options.numa_node >= 0) MC_TRY_VOID(io::prefer_numa_node(options.numa_node));

    auto s = std::make_unique<State>();
    s->options = options;
    // After the memory policy: the buffers come from the preferred node too.
    s->buffers = MC_TRY(io::BufferPool::allocate(options.queue_depth, options.read_size));
    s->eventfd = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!s->eventfd) return fail_errno("eventfd for the prefetch ring");
    if (options.engine != Engine::Threads) {
        // Room for one read and one cancel per slot in the SQ, and for every completion in the CQ.
        auto ring = io::Ring::create({.sq_entries = 2 * options.queue_depth,
                                      .cq_entries = 4 * options.queue_depth,
                                      .defer_taskrun = options.defer_taskrun});
        if (!ring && (options.engine == Engine::IoUring || !denied(ring.error()))) return tl::unexpected(ring.error());
        if (ring) {
            s->ring = std::move(*ring);
            if (auto reg = s->ring->register_eventfd(s->eventfd.get()); !reg) {
                // A profile may allow io_uring_setup and deny io_uring_register: denied all the same.
                if (options.engine == Engine::IoUring || !denied(reg.error())) return tl::unexpected(reg.error());
                s->setup.io_uring_denied = reg.error().what();
                s->ring.reset();
            }
        }
        if (s->ring) {
            if (options.register_buffers) {
                // Fixed buffers save pinning the pages on every read; they count against
                // RLIMIT_MEMLOCK without CAP_IPC_LOCK, so plain reads are the fallback.
                const auto reg = s->ring->register_buffers(s->buffers.iovecs());
                s->setup.registered_buffers = reg.has_value();
                if (!reg) MC_LOG(LOG_INFO, "prefetcher: plain reads, no fixed buffers: {}", reg.error().what());
            }
            s->setup.ring_flags = s->ring->flags();
            s->setup.sq_entries = s->ring->sq_entries();
            s->setup.cq_entries = s->ring->cq_entries();
        } else if (!ring) {
            s->setup.io_uring_denied = ring.error().what();
        }
    }
    if (!s->ring) {
        const uint32_t threads = options.threads != 0 ? options.threads : std::min<uint32_t>(options.queue_depth, 16);
        s->pool = MC_TRY(io::ReadPool::create(std::min(threads, options.queue_depth), s->eventfd.get()));
        s->setup.engine = Engine::Threads;
        s->setup.threads = s->pool->threads();
        if (!s->setup.io_uring_denied.empty())
            MC_LOG(LOG_WARNING, "prefetcher: io_uring is denied here ({}): reading with {} threads (pread) instead; "
                   "allow io_uring_setup, io_uring_enter and io_uring_register in the seccomp profile for the faster path",
                   s->setup.io_uring_denied, s->setup.threads);
    } else {
        s->setup.engine = Engine::IoUring;
    }
    s->setup.numa_node = options.numa_node;
    s->slots.resize(2 * size_t{options.queue_depth});
    for (auto i = static_cast<uint32_t>(s->slots.size()); i > 0; --i) s->free_slots.push_back(i - 1);
    return Prefetcher(std::move(s));
}

Prefetcher::Prefetcher(std::unique_ptr<State> state) : state_(std::move(state)) {}
Prefetcher::Prefetcher(Prefetcher&&) noexcept = default;
Prefetcher& Prefetcher::operator=(Prefetcher&&) noexcept = default;
Prefetcher::~Prefetcher() = default;

void Prefetcher::set_callback(Callback callback) { state_->callback = std::move(callback); }
uint64_t Prefetcher::enqueue(const PrefetchRequest& request) { return state_->enqueue(request); }
size_t Prefetcher::cancel(uint64_t tag) { return state_->cancel(tag); }
std::vector<uint64_t> Prefetcher::overdue(std::chrono::nanoseconds deadline) const { return state_->overdue(deadline); }
void Prefetcher::restart_deadlines() { state_->restart_deadlines(); }
size_t Prefetcher::abandon(uint64_t tag) { return state_->abandon(tag); }
Result<void> Prefetcher::submit() { return state_->submit(); }
Result<void> Prefetcher::on_ready() { return state_->on_ready(); }
Result<void> Prefetcher::run_until_idle() { return state_->run_until_idle(); }
int Prefetcher::event_fd() const { return state_->eventfd.get(); }
bool Prefetcher::idle() const { return state_->idle(); }
PrefetchProgress Prefetcher::progress() const { return state_->progress; }
const Prefetcher::Setup& Prefetcher::setup() const { return state_->setup; }

}  // namespace moecache::daemon
