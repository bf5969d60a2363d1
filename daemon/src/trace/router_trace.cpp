#include "moecache/daemon/router_trace.h"

#include "moecache/log.h"
#include "moecache/trace_format.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace moecache::daemon {

Result<void> RouterTrace::start(UniqueFd file, double tick_seconds) {
    if (on()) return fail(EBUSY, "a trace is being recorded already: stop it first");
    // The caller opened it without truncating (a refused start must not destroy a file): a trace
    // starts at the beginning.
    if (::ftruncate(file.get(), 0) != 0 || ::lseek(file.get(), 0, SEEK_SET) != 0) return fail_errno("trace file");
    fd_ = std::move(file);
    failed_ = false;
    buf_.clear();
    records_ = 0;
    described_.clear();
    start_ = std::chrono::steady_clock::now();
    buf_ += trace::header_line(tick_seconds);
    return {};
}

Result<uint64_t> RouterTrace::stop() {
    if (!on() && !failed_) return fail(ENOENT, "no trace is being recorded");
    flush();
    const uint64_t n = records_;
    fd_.reset();
    if (failed_) {
        failed_ = false;
        return fail(EIO, fmt::format("the trace stopped early, after {} router decisions: writing it failed", n));
    }
    return n;
}

void RouterTrace::model(uint32_t id, const ExpertMap& map, const std::string& path) {
    if (!on() || !described_.insert(id).second) return;
    buf_ += trace::model_line(trace::model_of(id, map, path));
}

void RouterTrace::decision(uint32_t id, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens) {
    if (!on()) return;
    const auto us =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_).count();
    trace::append_decision(buf_, static_cast<uint64_t>(us), id, block, tokens, experts);
    ++records_;
    if (buf_.size() >= kFlushBytes) flush();
}

void RouterTrace::flush() {
    if (!on()) return;
    size_t off = 0;
    while (off < buf_.size()) {
        const ssize_t n = ::write(fd_.get(), buf_.data() + off, buf_.size() - off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            MC_LOG(LOG_ERR, "trace stopped: writing it failed after {} records: {}", records_,
                   n < 0 ? std::strerror(errno) : "no space written");
            fd_.reset();
            failed_ = true;
            break;
        }
        off += static_cast<size_t>(n);
    }
    buf_.clear();
}

}  // namespace moecache::daemon
