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

// The figures every Prometheus exporter gives of its own process (process_* metrics).
struct ProcessFigures {
    double cpu_seconds = 0;         // user and system
    double start_time_seconds = 0;  // since the epoch
    uint64_t resident_bytes = 0, virtual_bytes = 0, open_fds = 0, max_fds = 0;
};
// From the texts of /proc/PID/stat and /proc/stat (btime): nullopt when stat is not one (its
// command may hold spaces and parentheses: the fields start after the last ')').
std::optional<ProcessFigures> parse_process_stat(std::string_view stat, std::string_view proc_stat,
                                                 long ticks_per_second, long page_size);
// This process's, from /proc (zeros where it cannot be read).
ProcessFigures read_process();

// Total and available RAM (MemTotal, MemAvailable) and this process's VmLck, from /proc.
uint64_t mem_total_bytes();
uint64_t vmlck_bytes();
uint64_t mem_available_bytes();

}  // namespace moecache::daemon
