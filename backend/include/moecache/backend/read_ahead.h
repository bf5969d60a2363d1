// Reading experts the CPU or a copy is about to use, in large requests, where the runtime's mapping
// reads at random. A lazily loaded model (libmoecache-rearm.so: the mapping is MADV_RANDOM, the
// daemon decides what is read ahead) faults a page at a time: one synchronous 4 KiB read from
// storage each, so a layer's misses that are not in the page cache take seconds, and a prompt's
// staged copies minutes. The hook reads such misses from the file with pread; the backend computes
// them on the CPU straight from the mapping, so it reads the pages the page cache lacks first,
// with pread in large requests, and the compute finds them cached. Not MADV_WILLNEED: its reads
// are allocated without waiting for reclaim, so in a memory cgroup at its limit (the whole stack's
// squeeze) the kernel drops most of them, and the compute faulted 4 KiB at a time all the same
// (measured: 40 slices of 40 MiB in a 300 MiB cgroup, 278 514 major faults and 23 s after
// WILLNEED, 2 048 and 1.2 s after pread).
#pragma once

#include "moecache/unique_fd.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moecache::backend {

// The mapping that holds `address` in the text of a /proc/PID/smaps, and whether it reads at random
// (its VmFlags have rr: MADV_RANDOM); nullopt where no mapping holds it.
struct MappingReads {
    uintptr_t start = 0, end = 0;
    bool random = false;
    uint64_t offset = 0;  // the file offset the mapping starts at
    uint64_t inode = 0;   // the mapped file's (0: anonymous memory)
    std::string path;     // the mapped file's, as smaps names it ("" for anonymous memory)
};
std::optional<MappingReads> mapping_reads(std::string_view smaps_text, uintptr_t address);
// The same, of this process.
std::optional<MappingReads> own_mapping_reads(const void* address);

// The mapped file of `reads` opened for reading, where it is still the file mapped (same inode);
// an invalid descriptor where not (deleted, replaced, unreadable). Its reads read only what they
// ask for (POSIX_FADV_RANDOM on it: no readahead into the next experts).
UniqueFd open_mapped_file(const MappingReads& reads);

// Reads into the page cache, now, the pages of [p, p + n) (a file mapping) that it does not hold
// (mincore says which): each run of them from `fd` at `file_offset` (where p is in the file) with
// pread in requests of up to 2 MiB, into a scratch buffer of the calling thread; nothing is
// touched through the mapping. Without a descriptor (fd < 0) the kernel is asked instead
// (MADV_WILLNEED on each run: asynchronous, and dropped under memory pressure; the madvise is the
// system call itself, so that a preloaded library that drops the runtime's WILLNEED, lazy load,
// does not drop it). Returns the bytes read (or asked for); 0 when the page cache held all of it
// or the range is no mapping. mincore reports the page cache's state only for files the caller
// owns or may write (else only pages mapped into it): such a runtime reads cached pages again.
uint64_t read_ahead(const void* p, size_t n, int fd = -1, uint64_t file_offset = 0);

// The same for several ranges (a layer's misses): where there is 8 MiB or more to read, its preads
// are shared among `threads` threads (the caller and helpers started for the call): storage
// serves several requests at once faster than one after another (on the build machine's disk,
// 40 MiB slices through a descriptor of open_mapped_file: 3.1 GB/s from four threads, 2.1 from
// one; 1.7 and 1.3 in a 300 MiB cgroup). The bytes read (or asked for) of each range, in order; a
// range asked for twice is read for the first.
struct ReadRange {
    const void* p = nullptr;
    size_t bytes = 0;
    int fd = -1;
    uint64_t file_offset = 0;
};
std::vector<uint64_t> read_ahead_all(std::span<const ReadRange> ranges, unsigned threads = 4);

}  // namespace moecache::backend
