// The routing trace (moecachectl trace start/stop, docs/trace.md): router decisions as they arrive,
// written as JSON lines to a file the operator opened, buffered and flushed in 64 KiB writes from
// the loop. A write that fails stops the trace (said once); stop() then reports it. Owns its state:
// the daemon checks the file (a regular file, not a model it manages, empty or a trace) and feeds it.
#pragma once

#include "moecache/error.h"
#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <chrono>
#include <cstdint>
#include <set>
#include <span>
#include <string>

namespace moecache::daemon {

class RouterTrace {
public:
    // Begins a trace in `file` (truncated and written from its start), with the header line.
    Result<void> start(UniqueFd file, double tick_seconds);
    // Flushes and closes it: the decisions written, or EIO where a write failed (ENOENT: none).
    Result<uint64_t> stop();
    [[nodiscard]] bool on() const { return fd_.get() >= 0; }
    [[nodiscard]] uint64_t records() const { return records_; }

    // A model's description, once per trace (before its first decision).
    void model(uint32_t id, const ExpertMap& map, const std::string& path);
    // A router decision of model `id` (described by model() first).
    void decision(uint32_t id, uint32_t block, std::span<const uint32_t> experts, uint32_t tokens);
    // Writes what is buffered (the loop's turn end, shutdown).
    void flush();

private:
    static constexpr size_t kFlushBytes = 64 << 10;
    UniqueFd fd_;
    std::string buf_;
    uint64_t records_ = 0;
    bool failed_ = false;  // a write failed: the trace was closed, stop() says so
    std::set<uint32_t> described_;
    std::chrono::steady_clock::time_point start_{};
};

}  // namespace moecache::daemon
