// What the kernel says of this machine's memory and of the daemon's locked pages, read from /proc.
// The paths are seams for tests, as systemd-oomd's readers have them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace moecache::daemon {

struct SystemMemory {
    uint64_t total = 0;      // MemTotal
    uint64_t available = 0;  // MemAvailable
};

// nullopt when the file cannot be read or lacks MemTotal; a missing MemAvailable reads as 0.
std::optional<SystemMemory> read_system_memory(const std::string& meminfo = "/proc/meminfo");
// VmLck of this process (0 when it cannot be read).
uint64_t read_locked_bytes(const std::string& status = "/proc/self/status");
// The bytes of a "Key:   123 kB" line of a /proc text (key with its colon); nullopt when there is
// no such line, its number is not one, or it does not fit in 64 bits once multiplied out.
std::optional<uint64_t> proc_kib_field(std::string_view text, std::string_view key);

// Total and available RAM (MemTotal, MemAvailable) and this process's VmLck, from /proc.
uint64_t mem_total_bytes();
uint64_t vmlck_bytes();
uint64_t mem_available_bytes();

}  // namespace moecache::daemon
