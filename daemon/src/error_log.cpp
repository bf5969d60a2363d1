#include "moecache/daemon/error_log.h"

#include "moecache/log.h"

namespace moecache::daemon {

bool ErrorLog::note(const std::string& doing, const std::string& what, Clock::time_point now) {
    Kind& k = kinds_[doing];
    ++k.total;
    if (k.total > 1 && now - k.logged < kLogEvery) {
        ++k.unlogged;
        return false;
    }
    if (k.unlogged > 0) {
        MC_LOG(LOG_WARNING, "{} failed: {} (and {} more times since the last report)", doing, what, k.unlogged);
    } else {
        MC_LOG(LOG_WARNING, "{} failed: {}", doing, what);
    }
    k.logged = now;
    k.unlogged = 0;
    return true;
}

std::map<std::string, uint64_t> ErrorLog::totals() const {
    std::map<std::string, uint64_t> out;
    for (const auto& [doing, k] : kinds_) out[doing] = k.total;
    return out;
}

}  // namespace moecache::daemon
