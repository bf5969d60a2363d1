// The daemon's Prometheus metrics: what DaemonStatus holds, in the text exposition format (base
// units, `_total` for counters, HELP and TYPE for each family). Labels stay bounded: a model is its
// id and its file name, never an expert; kinds and tiers are fixed sets.
#pragma once

#include "moecache/daemon/daemon.h"

#include <string>
#include <string_view>
#include <vector>

namespace moecache::daemon {

// `paths`: the file label is the model's path; else its file name and a hash of the path.
std::string render_metrics(const DaemonStatus& s, bool paths = true);

// What keeps the daemon from helping, for /health's "degraded" lines (empty: ready): a configured
// model that is not loaded, memory pressure holding the locks down, runtimes whose copies come from
// memory that maps no model. A daemon that runs without the bus or the page-cache telemetry by
// configuration is not degraded.
std::vector<std::string> health_problems(const DaemonStatus& s);

// /status's body: moecachectl status's answer where there is no D-Bus (a container, the bundle):
// the daemon's version, what it holds, and the "is it helping" lines (helping.h), as text.
std::string render_status_text(const DaemonStatus& s);

// A label value as the format wants it: backslash, double quote and newline escaped, and bytes that
// are not UTF-8 replaced by U+FFFD (Prometheus rejects them).
std::string escape_label_value(std::string_view v);

}  // namespace moecache::daemon
