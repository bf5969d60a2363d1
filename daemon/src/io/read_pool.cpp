#include "read_pool.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace moecache::daemon::io {

Result<std::unique_ptr<ReadPool>> ReadPool::create(uint32_t threads, int event_fd) {
    if (threads == 0 || threads > 64) return fail(EINVAL, fmt::format("read threads {} is out of range 1..64", threads));
    std::unique_ptr<ReadPool> p(new ReadPool(event_fd));
    try {
        for (uint32_t i = 0; i < threads; ++i) {
            p->workers_.emplace_back([raw = p.get()] { raw->work(); });
            ::pthread_setname_np(p->workers_.back().native_handle(), "moecache-read");
        }
    } catch (const std::system_error& e) {
        return fail(e.code().value(), "starting the prefetcher's read threads");  // the destructor joins those started
    }
    return p;
}

ReadPool::~ReadPool() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
        for (const Job& j : jobs_) ::close(j.fd);
        jobs_.clear();
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
}

void ReadPool::submit(int fd, void* buf, uint32_t length, uint64_t offset, uint64_t user_data) {
    // A descriptor of its own, as an io_uring read holds a reference to its file: the owner may
    // close its descriptor (a model closed) while the read waits, and the number may be reused.
    const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    std::lock_guard lock(mu_);
    if (own < 0) {
        post({user_data, -errno});
        return;
    }
    jobs_.push_back({own, buf, length, offset, user_data});
    cv_.notify_one();
}

void ReadPool::cancel(uint64_t user_data) {
    std::lock_guard lock(mu_);
    const auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](const Job& j) { return j.user_data == user_data; });
    if (it == jobs_.end()) return;
    ::close(it->fd);
    jobs_.erase(it);
    post({user_data, -ECANCELED});
}

std::vector<ReadPool::Completion> ReadPool::take() {
    std::vector<Completion> out;
    std::lock_guard lock(mu_);
    out.swap(done_);
    return out;
}

void ReadPool::post(const Completion& c) {
    const bool was_empty = done_.empty();
    done_.push_back(c);
    // One count per batch: the owner drains the eventfd before it takes, so a completion posted
    // after its take() finds the list empty again and rings.
    if (was_empty) {
        const uint64_t one = 1;
        while (::write(event_fd_, &one, sizeof one) < 0 && errno == EINTR) {
        }
    }
}

void ReadPool::work() {
    for (;;) {
        Job job{};
        {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
            if (stop_) return;
            job = jobs_.front();
            jobs_.pop_front();
        }
        ssize_t n = 0;
        do {
            n = ::pread(job.fd, job.buf, job.length, static_cast<off_t>(job.offset));
        } while (n < 0 && errno == EINTR);
        const int res = n < 0 ? -errno : static_cast<int>(n);
        ::close(job.fd);
        std::lock_guard lock(mu_);
        post({job.user_data, res});
    }
}

}  // namespace moecache::daemon::io
