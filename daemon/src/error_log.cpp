#include "moecache/daemon/error_log.h"

#include "moecache/log.h"

namespace moecache::daemon {

namespace {
// By Doing, in its order.
constexpr std::array<const char*, kEveryDoing.size()> kDoingNames = {
    "reading the page cache's residency",
    "reading an expert into the page cache",
    "locking an expert",
    "looking at a file a [[model]] glob matched",
    "unlocking a closed model",
    "unwatching a model file's page cache",
    "saving heat profiles",
    "stopping the routing trace",
};
}  // namespace

const char* to_string(Doing d) { return kDoingNames[static_cast<size_t>(d)]; }

bool ErrorLog::note(Doing d, const std::string& what, Clock::time_point now) {
    const char* doing = to_string(d);
    Kind& k = kinds_[static_cast<size_t>(d)];
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
    for (const Doing d : kEveryDoing) out[to_string(d)] = kinds_[static_cast<size_t>(d)].total;
    return out;
}

}  // namespace moecache::daemon
