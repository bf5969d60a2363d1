// The configuration the root tests start from: one model, everything locked after one use, no
// elite share, no pressure triggers, a fast tick, no reads beyond what the plan locks (neither on a
// miss nor at a warm start); tests change what they test.
#pragma once

#include "moecache/daemon/config.h"

#include <string>

namespace moecache::test {

inline daemon::Config daemon_config(const std::string& model, const std::string& state_dir, uint64_t budget) {
    daemon::Config c;
    c.state_dir = state_dir;
    c.socket_path = state_dir + "/moecached.sock";
    c.lock_budget = daemon::ByteAmount{budget, std::nullopt};
    c.reserve = daemon::ByteAmount{0, std::nullopt};
    c.pressure_enabled = false;
    c.tick_seconds = 0.05;
    c.admit_after_uses = 1;
    c.elite_share = 0;
    c.on_miss = false;
    c.warm_start = false;
    daemon::ModelConfig m;
    m.path = model;
    m.lock_dense = false;
    m.where = "test";
    c.models.push_back(m);
    return c;
}

}  // namespace moecache::test
