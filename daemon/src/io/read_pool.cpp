#include "read_pool.h"

#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

namespace moecache::daemon::io {

struct ReadPool::Shared {
    struct Job {
        int fd;
        void* buf;
        uint32_t length;
        uint64_t offset;
        uint64_t user_data;
    };
    UniqueFd event;
    std::mutex mu;
    std::condition_variable cv;       // jobs for the workers, or the stop
    std::condition_variable stopped;  // a worker ended
    std::deque<Job> jobs;
    std::vector<Completion> done;
    bool stop = false;
    uint32_t workers = 0;  // started and not ended

    void post(const Completion& c) {  // with mu held
        const bool was_empty = done.empty();
        done.push_back(c);
        // One count per batch: the owner drains the eventfd before it takes, so a completion posted
        // after its take() finds the list empty again and rings.
        if (was_empty) {
            const uint64_t one = 1;
            while (::write(event.get(), &one, sizeof one) < 0 && errno == EINTR) {
            }
        }
    }

    static void work(const std::shared_ptr<Shared>& s) {
        for (;;) {
            Job job{};
            {
                std::unique_lock lock(s->mu);
                s->cv.wait(lock, [&] { return s->stop || !s->jobs.empty(); });
                if (s->stop) break;
                job = s->jobs.front();
                s->jobs.pop_front();
            }
            ssize_t n = 0;
            do {
                n = ::pread(job.fd, job.buf, job.length, static_cast<off_t>(job.offset));
            } while (n < 0 && errno == EINTR);
            const int res = n < 0 ? -errno : static_cast<int>(n);
            ::close(job.fd);
            std::lock_guard lock(s->mu);
            s->post({job.user_data, res});
        }
        std::lock_guard lock(s->mu);
        --s->workers;
        s->stopped.notify_all();
    }
};

Result<std::unique_ptr<ReadPool>> ReadPool::create(uint32_t threads, int event_fd) {
    if (threads == 0 || threads > kMaxThreads)
        return fail(EINVAL, fmt::format("read threads {} is out of range 1..{}", threads, kMaxThreads));
    auto s = std::make_shared<Shared>();
    s->event = UniqueFd(::fcntl(event_fd, F_DUPFD_CLOEXEC, 0));
    if (!s->event) return fail_errno("duplicating the prefetcher's eventfd for its read threads");
    std::unique_ptr<ReadPool> p(new ReadPool(std::move(s)));
    for (uint32_t i = 0; i < threads; ++i) MC_TRY_VOID(p->start_worker());  // the destructor stops those started
    return p;
}

Result<void> ReadPool::start_worker() {
    {
        std::lock_guard lock(s_->mu);
        if (s_->workers >= kMaxThreads) return fail(EAGAIN, "the prefetcher's read threads are all taken");
        ++s_->workers;
    }
    try {
        std::thread t([s = s_] { Shared::work(s); });
        ::pthread_setname_np(t.native_handle(), "moecache-read");
        t.detach();
    } catch (const std::system_error& e) {
        std::lock_guard lock(s_->mu);
        --s_->workers;
        return fail(e.code().value(), "starting the prefetcher's read threads");
    }
    return {};
}

void ReadPool::add_worker() { (void)start_worker(); }

uint32_t ReadPool::threads() const {
    std::lock_guard lock(s_->mu);
    return s_->workers;
}

bool ReadPool::stop(std::chrono::milliseconds most) {
    stopped_ = true;
    std::unique_lock lock(s_->mu);
    s_->stop = true;
    for (const Shared::Job& j : s_->jobs) ::close(j.fd);
    s_->jobs.clear();
    s_->cv.notify_all();
    return s_->stopped.wait_for(lock, most, [&] { return s_->workers == 0; });
}

ReadPool::~ReadPool() {
    if (!stopped_) (void)stop(std::chrono::seconds(2));
}

void ReadPool::submit(int fd, void* buf, uint32_t length, uint64_t offset, uint64_t user_data) {
    // A descriptor of its own, as an io_uring read holds a reference to its file: the owner may
    // close its descriptor (a model closed) while the read waits, and the number may be reused.
    const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    std::lock_guard lock(s_->mu);
    if (own < 0) {
        s_->post({user_data, -errno});
        return;
    }
    s_->jobs.push_back({own, buf, length, offset, user_data});
    s_->cv.notify_one();
}

void ReadPool::cancel(uint64_t user_data) {
    std::lock_guard lock(s_->mu);
    const auto it = std::find_if(s_->jobs.begin(), s_->jobs.end(), [&](const Shared::Job& j) { return j.user_data == user_data; });
    if (it == s_->jobs.end()) return;
    ::close(it->fd);
    s_->jobs.erase(it);
    s_->post({user_data, -ECANCELED});
}

std::vector<ReadPool::Completion> ReadPool::take() {
    std::vector<Completion> out;
    std::lock_guard lock(s_->mu);
    out.swap(s_->done);
    return out;
}

}  // namespace moecache::daemon::io
