// MOECACHE_TRACE=FILE: the router decisions a client reports, written as a trace (docs/trace.md)
// by the process itself, with or without a daemon: the same format `moecachectl trace` records and
// moecache-sim replays. A report appends to a buffer under a lock held no longer than a swap; a
// thread of its own writes the buffer out every 200 ms and at the end. A write that fails ends the
// trace, said once on stderr; the runtime goes on.
#pragma once

#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moecache::client {

class TraceWriter {
public:
    // The trace at `path`, emptied; nullptr (said on stderr) where it cannot be created.
    static std::unique_ptr<TraceWriter> open(const std::string& path);
    ~TraceWriter();
    TraceWriter(const TraceWriter&) = delete;
    TraceWriter& operator=(const TraceWriter&) = delete;

    // Describes model `handle` (before its first decision).
    void add_model(uint32_t handle, const ExpertMap& map, const std::string& path);
    // A decision of a model not described, or for a block that is not one of its MoE blocks, is
    // left out, and so are experts out of its range: the trace reads back whatever the runtime says.
    void decision(uint32_t handle, uint32_t block, uint32_t tokens, const uint32_t* experts, uint32_t n);

private:
    TraceWriter(UniqueFd fd, std::string path);
    void run();
    void write_out(const std::string& bytes);

    UniqueFd fd_;
    std::string path_;
    std::chrono::steady_clock::time_point start_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::string buf_;  // under mu_
    struct Shape {
        uint32_t n_experts = 0;
        std::vector<uint32_t> blocks;
    };
    std::vector<Shape> models_;  // by handle, under mu_; n_experts 0: not described
    std::vector<uint32_t> kept_;  // the experts of the decision being written, under mu_
    bool stop_ = false, failed_ = false;
    std::thread thread_;
};

}  // namespace moecache::client
