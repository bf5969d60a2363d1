// "Is it helping?": what `moecachectl status` (over D-Bus or HTTP) answers per model, from the
// daemon's status alone (pure): where the experts its runtime routed in decode were (a VRAM pool,
// RAM, storage), what the runtime read from storage a token, what the VRAM pools served, and any
// reason moecache cannot help (the model not loaded, no runtime reporting its routing, runtimes
// without a mapping of the model, a slow miss path, memory pressure).
#pragma once

#include "moecache/daemon/status.h"

#include <string>
#include <vector>

namespace moecache::daemon {

struct ModelVerdict {
    enum class Kind { Helping, Idle, Blind, CannotHelp };
    Kind kind = Kind::Idle;
    std::string line;  // "NAME: WORD: figures or the reason", one line
};
const char* to_string(ModelVerdict::Kind k);

// One verdict per model.
[[nodiscard]] ModelVerdict model_verdict(const DaemonStatus& s, const ModelStatus& m);

// The report as lines: a verdict per model, then the VRAM pools' savings per device and every
// reason that holds for the whole daemon. Empty when there is nothing to say (no model, no client).
[[nodiscard]] std::vector<std::string> helping_report(const DaemonStatus& s);

}  // namespace moecache::daemon
