// One logging macro. Lines go to stderr; under systemd (JOURNAL_STREAM set) each carries the
// journald priority prefix "<N>" so the journal files it at the right level. Never on a hot path.
#pragma once

#include <fmt/format.h>

#include <syslog.h>

namespace moecache::log {

void write(int priority, std::string_view line);
bool enabled(int priority);
void set_max_priority(int priority);  // LOG_DEBUG shows everything; default LOG_INFO
int max_priority();

}  // namespace moecache::log

#define MC_LOG(priority, ...)                                                      \
    do {                                                                           \
        if (::moecache::log::enabled(priority))                                    \
            ::moecache::log::write((priority), ::fmt::format(__VA_ARGS__));        \
    } while (0)
