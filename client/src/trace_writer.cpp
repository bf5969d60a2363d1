#include "trace_writer.h"

#include "moecache/trace_format.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <span>

namespace moecache::client {

std::unique_ptr<TraceWriter> TraceWriter::open(const std::string& path) {
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) {
        std::fprintf(stderr, "moecache: MOECACHE_TRACE=%s: cannot create it (%s): no trace\n", path.c_str(),
                     std::strerror(errno));
        return nullptr;
    }
    try {
        return std::unique_ptr<TraceWriter>(new TraceWriter(std::move(fd), path));
    } catch (...) {
        return nullptr;  // no thread
    }
}

TraceWriter::TraceWriter(UniqueFd fd, std::string path)
    : fd_(std::move(fd)), path_(std::move(path)), start_(std::chrono::steady_clock::now()),
      buf_(trace::header_line(0)), thread_([this] { run(); }) {}

TraceWriter::~TraceWriter() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
}

void TraceWriter::add_model(uint32_t handle, const ExpertMap& map, const std::string& path) {
    const auto model = trace::model_of(handle, map, path);
    const std::string line = trace::model_line(model);
    std::lock_guard lock(mu_);
    if (models_.size() <= handle) models_.resize(handle + 1);
    models_[handle] = {model.n_experts, model.blocks};
    buf_ += line;
}

void TraceWriter::decision(uint32_t handle, uint32_t block, uint32_t tokens, const uint32_t* experts, uint32_t n) {
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start_).count();
    std::lock_guard lock(mu_);
    if (failed_ || handle >= models_.size() || models_[handle].n_experts == 0) return;
    const Shape& m = models_[handle];
    if (std::find(m.blocks.begin(), m.blocks.end(), block) == m.blocks.end()) return;
    kept_.clear();
    for (uint32_t i = 0; i < n; ++i)
        if (experts[i] < m.n_experts) kept_.push_back(experts[i]);
    trace::append_decision(buf_, static_cast<uint64_t>(us), handle, block, tokens, kept_);
}

void TraceWriter::run() {
    std::string out;
    for (;;) {
        bool stopping;
        {
            std::unique_lock lock(mu_);
            cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; });
            out.swap(buf_);
            stopping = stop_;
        }
        write_out(out);
        out.clear();
        if (stopping) return;
    }
}

void TraceWriter::write_out(const std::string& bytes) {
    size_t off = 0;
    while (off < bytes.size() && !failed_) {
        const ssize_t n = ::write(fd_.get(), bytes.data() + off, bytes.size() - off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            std::fprintf(stderr, "moecache: MOECACHE_TRACE=%s: writing failed (%s): the trace stops here\n",
                         path_.c_str(), n < 0 ? std::strerror(errno) : "nothing written");
            std::lock_guard lock(mu_);
            failed_ = true;
            buf_.clear();
            return;
        }
        off += static_cast<size_t>(n);
    }
}

}  // namespace moecache::client
