#include "moecache/daemon/off_loop.h"

#include "moecache/log.h"
#include "moecache/unique_fd.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

namespace moecache::daemon {

using Clock = std::chrono::steady_clock;

struct OffLoop::State {
    struct Job {
        std::string what;
        Clock::time_point due;
        Continuation late;
        bool given_up = false;
        bool finished = false;
        Continuation then;  // what it returned, for turn()
    };
    std::mutex mu;
    UniqueFd event;
    std::unordered_map<uint64_t, Job> jobs;  // running, finished but not turned, or given up
    uint64_t next_id = 1;
    uint64_t late_total = 0;

    void ring() const {
        const uint64_t one = 1;
        while (::write(event.get(), &one, sizeof one) < 0 && errno == EINTR) {
        }
    }
};

Result<OffLoop> OffLoop::create() {
    auto s = std::make_shared<State>();
    s->event = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!s->event) return fail_errno("eventfd for work off the loop");
    return OffLoop(std::move(s));
}

OffLoop::OffLoop(std::shared_ptr<State> s) : state_(std::move(s)) {}
OffLoop::OffLoop(OffLoop&&) noexcept = default;
OffLoop& OffLoop::operator=(OffLoop&&) noexcept = default;
OffLoop::~OffLoop() {
    if (!state_) return;
    // Running threads keep the state alive; their results, and the continuations of jobs not
    // turned, are dropped without running: the loop that would run them is going away.
    std::lock_guard lock(state_->mu);
    for (auto& [id, j] : state_->jobs) {
        j.given_up = true;
        j.late = nullptr;
    }
    std::erase_if(state_->jobs, [](const auto& v) { return v.second.finished; });
}

Result<uint64_t> OffLoop::run(std::string what, std::chrono::milliseconds deadline, Work work, Continuation late) {
    std::unique_lock lock(state_->mu);
    const auto threads = std::count_if(state_->jobs.begin(), state_->jobs.end(), [](const auto& v) { return !v.second.finished; });
    if (threads >= kMaxThreads) {
        const auto hung = std::count_if(state_->jobs.begin(), state_->jobs.end(),
                                        [](const auto& v) { return v.second.given_up && !v.second.finished; });
        return fail(EAGAIN, fmt::format("{}: {} jobs run off the loop already ({} of them past their deadline, blocked on "
                                        "their files)", what, threads, hung));
    }
    const uint64_t id = state_->next_id++;
    state_->jobs.emplace(id, State::Job{.what = std::move(what), .due = Clock::now() + deadline, .late = std::move(late), .then = {}});
    lock.unlock();
    try {
        std::thread t([s = state_, id, work = std::move(work)]() mutable {
            Continuation then = work();
            work = nullptr;  // what it captured goes here, on this thread
            std::unique_lock held(s->mu);
            const auto it = s->jobs.find(id);
            if (it == s->jobs.end()) return;
            if (it->second.given_up) {
                s->jobs.erase(it);
                held.unlock();  // `then` (its result) is destroyed outside the lock
                return;
            }
            it->second.then = std::move(then);
            it->second.finished = true;
            held.unlock();
            s->ring();
        });
        ::pthread_setname_np(t.native_handle(), "moecache-open");
        t.detach();
    } catch (const std::system_error& e) {
        std::lock_guard relock(state_->mu);
        state_->jobs.erase(id);
        return fail(e.code().value(), "starting a thread for work off the loop");
    }
    return id;
}

void OffLoop::turn() {
    uint64_t count = 0;
    while (::read(state_->event.get(), &count, sizeof count) < 0 && errno == EINTR) {
    }
    std::vector<Continuation> due;
    {
        std::lock_guard lock(state_->mu);
        const auto now = Clock::now();
        for (auto it = state_->jobs.begin(); it != state_->jobs.end();) {
            State::Job& j = it->second;
            if (j.finished) {
                due.push_back(std::move(j.then));
                it = state_->jobs.erase(it);
                continue;
            }
            if (!j.given_up && now >= j.due) {
                j.given_up = true;
                ++state_->late_total;
                if (j.late) due.push_back(std::move(j.late));
            }
            ++it;
        }
    }
    for (auto& c : due)
        if (c) c();
}

void OffLoop::wait(uint64_t id) {
    for (;;) {
        int ms = 0;
        {
            std::lock_guard lock(state_->mu);
            const auto it = state_->jobs.find(id);
            if (it == state_->jobs.end() || it->second.finished || it->second.given_up) break;
            ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(it->second.due - Clock::now()).count());
            if (ms <= 0) break;
        }
        pollfd p{.fd = state_->event.get(), .events = POLLIN, .revents = 0};
        (void)::poll(&p, 1, std::min(ms, 100));
    }
    turn();
}

void OffLoop::wait_all() {
    std::vector<uint64_t> ids;
    {
        std::lock_guard lock(state_->mu);
        for (const auto& [id, j] : state_->jobs) ids.push_back(id);
    }
    for (uint64_t id : ids) wait(id);
}

int OffLoop::event_fd() const { return state_->event.get(); }

int OffLoop::due_in_ms() const {
    std::lock_guard lock(state_->mu);
    int best = -1;
    const auto now = Clock::now();
    for (const auto& [id, j] : state_->jobs) {
        if (j.finished || j.given_up) continue;
        const auto ms = std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(j.due - now).count());
        if (best < 0 || ms < best) best = static_cast<int>(ms);
    }
    return best;
}

uint32_t OffLoop::running() const {
    std::lock_guard lock(state_->mu);
    return static_cast<uint32_t>(
        std::count_if(state_->jobs.begin(), state_->jobs.end(), [](const auto& v) { return !v.second.finished; }));
}

uint32_t OffLoop::given_up() const {
    std::lock_guard lock(state_->mu);
    return static_cast<uint32_t>(std::count_if(state_->jobs.begin(), state_->jobs.end(),
                                                [](const auto& v) { return v.second.given_up && !v.second.finished; }));
}

uint64_t OffLoop::late_total() const {
    std::lock_guard lock(state_->mu);
    return state_->late_total;
}

}  // namespace moecache::daemon
