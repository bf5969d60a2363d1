#include "moecache/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace moecache::log {
namespace {

std::atomic<int> g_max_priority{LOG_INFO};

bool to_journal() {
    static const bool journal = std::getenv("JOURNAL_STREAM") != nullptr;
    return journal;
}

const char* label(int priority) {
    switch (priority) {
        case LOG_EMERG: case LOG_ALERT: case LOG_CRIT: case LOG_ERR: return "error: ";
        case LOG_WARNING: return "warning: ";
        case LOG_DEBUG: return "debug: ";
        default: return "";
    }
}

}  // namespace

bool enabled(int priority) { return priority <= g_max_priority.load(std::memory_order_relaxed); }
void set_max_priority(int priority) { g_max_priority.store(priority, std::memory_order_relaxed); }
int max_priority() { return g_max_priority.load(std::memory_order_relaxed); }

void write(int priority, std::string_view line) {
    std::string out;
    if (to_journal())
        out = fmt::format("<{}>{}\n", priority, line);
    else
        out = fmt::format("{}{}\n", label(priority), line);
    std::fwrite(out.data(), 1, out.size(), stderr);
}

}  // namespace moecache::log
