// Reading experts the CPU or a copy is about to use, in large requests, where the runtime's mapping
// reads at random. A lazily loaded model (libmoecache-rearm.so: the mapping is MADV_RANDOM, the
// daemon decides what is read ahead) faults a page at a time: one synchronous 4 KiB read from
// storage each, so a layer's misses that are not in the page cache take seconds, and a prompt's
// staged copies minutes. The hook reads such misses from the file with pread; the backend computes
// them on the CPU straight from the mapping, so it asks the kernel to read them first
// (MADV_WILLNEED: the whole range in large requests, at once, asynchronously) and the compute's
// faults wait for reads already under way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace moecache::backend {

// The mapping that holds `address` in the text of a /proc/PID/smaps, and whether it reads at random
// (its VmFlags have rr: MADV_RANDOM); nullopt where no mapping holds it.
struct MappingReads {
    uintptr_t start = 0, end = 0;
    bool random = false;
};
std::optional<MappingReads> mapping_reads(std::string_view smaps_text, uintptr_t address);
// The same, of this process.
std::optional<MappingReads> own_mapping_reads(const void* address);

// Asks the kernel to read [p, p + n) of a file mapping into the page cache now, unless its first,
// middle and last pages are cached already (a sample: the check costs three system calls, the read
// it saves milliseconds). True when it asked. The madvise is the system call itself: a preloaded
// library that drops the runtime's WILLNEED (lazy load) is not asked.
bool read_ahead(const void* p, size_t n);

}  // namespace moecache::backend
