// Router traces as docs/trace.md defines them (moecachectl trace, moecache-tracegen), read back
// for replay. Every line is checked: a trace is input like any other, and an error names the file,
// the line and what is wrong with it.
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moecache::sim {

struct TraceModel {
    uint32_t id = 0;
    std::string key;
    std::string path;
    uint32_t n_experts = 0;
    std::vector<uint32_t> blocks;            // MoE blocks in layer order
    std::vector<uint64_t> bytes_per_expert;  // per layer
};

struct TraceDecision {
    uint64_t t_us = 0;
    uint32_t model = 0;   // a TraceModel id
    uint32_t layer = 0;   // index into the model's blocks
    uint32_t tokens = 0;  // tokens of the batch routed here
    std::vector<uint32_t> experts;
    // A batch's ranking (moecache/batch_report.h): the decisions of 0 tokens that followed it in
    // the same layer, each a level's experts. Heat only: what was routed is `experts`.
    std::vector<std::vector<uint32_t>> more;
};

struct Trace {
    double tick_seconds = 0;
    std::vector<TraceModel> models;
    std::vector<TraceDecision> decisions;
    [[nodiscard]] const TraceModel* model(uint32_t id) const;
    // Appends a decision; one of 0 tokens after a batch of the same model and layer is that batch's
    // `more` (a trace without its batch keeps it as a decision of its own).
    void add(TraceDecision d);
};

// Reads a whole trace. Lines of unknown shape are refused, unknown keys ignored.
Result<Trace> read_trace(const std::string& path);

}  // namespace moecache::sim
