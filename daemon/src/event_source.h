// What woke the loop: each descriptor the loop waits on is registered with its source in the
// high half of its epoll data and the descriptor in the low half, and Daemon::step() has one
// handler per source.
#pragma once

#include <cstdint>

namespace moecache::daemon {

enum class EventSource : uint32_t { Signal, Timer, Listener, Client, PageCache, Bus, Reads, Pressure, OffLoop };
inline uint64_t event_data(EventSource source, int fd) {
    return (uint64_t{static_cast<uint32_t>(source)} << 32) | static_cast<uint32_t>(fd);
}

}  // namespace moecache::daemon
