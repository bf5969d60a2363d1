// A synthetic routing (moecache-tracegen) as a trace, without the round trip through a file: one
// model (id 0, the given key), every layer's expert `expert_bytes`, one decision per token and
// layer, tokens `token_us` apart. What tracegen::write_trace writes reads back as the same.
#pragma once

#include "moecache/sim/trace.h"
#include "moecache/tracegen/tracegen.h"

namespace moecache::sim {

Trace trace_of(const tracegen::Routing& routing, const std::string& key, uint64_t expert_bytes, uint64_t token_us);

// The other way: the decode steps of `model` in a recorded trace as a Routing, for
// tracegen::measure (tracegen::routing_from_steps says which steps count).
Result<tracegen::Routing> routing_of(const Trace& trace, const TraceModel& model);

}  // namespace moecache::sim
