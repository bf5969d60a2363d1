#include "moecache/backend/read_ahead.h"

#include "moecache/process_maps.h"
#include "moecache/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_set>
#include <vector>

namespace moecache::backend {

std::optional<MappingReads> mapping_reads(std::string_view text, uintptr_t address) {
    // Each mapping: a header as in /proc/PID/maps, then "Key: value" lines, VmFlags among them.
    std::optional<MappingReads> found;
    for_each_line(text, [&](std::string_view line) {
        if (const auto header = parse_maps_line(line)) {
            if (found) return false;  // the mapping had no VmFlags line: not random
            if (address >= header->mapping.start && address < header->mapping.end) {
                found.emplace();
                found->start = header->mapping.start;
                found->end = header->mapping.end;
                found->offset = header->mapping.file_offset;
                found->inode = header->file.inode;
                if (found->inode != 0) found->path = header->path;
            }
            return true;
        }
        if (found && line.rfind("VmFlags:", 0) == 0) {
            const std::string flags = " " + std::string(line.substr(8)) + " ";
            found->random = flags.find(" rr ") != std::string::npos;
            return false;
        }
        return true;
    });
    return found;
}

std::optional<MappingReads> own_mapping_reads(const void* address) {
    const auto text = read_proc_text("/proc/self/smaps");
    if (!text) return std::nullopt;
    return mapping_reads(*text, reinterpret_cast<uintptr_t>(address));
}

UniqueFd open_mapped_file(const MappingReads& reads) {
    if (reads.inode == 0 || reads.path.empty() || reads.path.front() != '/') return UniqueFd();
    // O_NONBLOCK: a path replaced by a FIFO does not block the open (its type is checked next).
    UniqueFd fd(open(reads.path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    struct stat st {};
    if (!fd || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_ino) != reads.inode)
        return UniqueFd();
    // Its reads are the runs asked for, no more: no readahead around them into experts nobody asked
    // for, which a squeezed page cache would make room for by dropping others (this descriptor's
    // own state; the runtime's is left alone). Several requests at once keep storage busy instead.
    (void)posix_fadvise(fd.get(), 0, 0, POSIX_FADV_RANDOM);
    return fd;
}

namespace {

constexpr size_t kChunk = 2u << 20;     // one pread
constexpr size_t kGap = 16;             // cached pages between two runs read with them: one request
constexpr uint64_t kShared = 8u << 20;  // less than this to read: the caller reads it alone

struct Chunk {
    int fd;
    uint64_t offset, bytes;
    size_t range;
};

// Reads the chunks from `next` on until none is left; the bytes read added to done[chunk.range].
// Never throws (a helper thread's exception would end the process): without a buffer, no reads.
void read_chunks(const std::vector<Chunk>& chunks, std::atomic<size_t>& next,
                 std::vector<std::atomic<uint64_t>>& done) noexcept {
    std::unique_ptr<char[]> buffer;
    try {
        buffer = std::make_unique_for_overwrite<char[]>(kChunk);
    } catch (const std::bad_alloc&) {
        return;  // the other readers, or the compute's faults, take what is left
    }
    for (size_t k = next.fetch_add(1); k < chunks.size(); k = next.fetch_add(1)) {
        const Chunk& c = chunks[k];
        for (uint64_t at = 0; at < c.bytes;) {
            const ssize_t r = pread(c.fd, buffer.get(), c.bytes - at, static_cast<off_t>(c.offset + at));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;  // an error or the file's end: the compute faults in what is left
            at += static_cast<uint64_t>(r);
            done[c.range].fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
        }
    }
}

}  // namespace

std::vector<uint64_t> read_ahead_all(std::span<const ReadRange> ranges, unsigned threads) {
    static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    std::vector<std::atomic<uint64_t>> done(ranges.size());
    std::vector<Chunk> chunks;
    uint64_t to_read = 0;
    std::vector<unsigned char> in;
    std::unordered_set<const void*> planned;  // a range asked for twice is read for its first
    for (size_t r = 0; r < ranges.size(); ++r) {
        const ReadRange& rr = ranges[r];
        if (rr.bytes == 0 || !planned.insert(rr.p).second) continue;
        const uintptr_t first = reinterpret_cast<uintptr_t>(rr.p) & ~(page - 1);
        const uintptr_t end = (reinterpret_cast<uintptr_t>(rr.p) + rr.bytes + page - 1) & ~(page - 1);
        const size_t pages = (end - first) / page;
        in.resize(pages);
        if (mincore(reinterpret_cast<void*>(first), end - first, in.data()) != 0) continue;  // not a mapping to read
        const uint64_t lead = reinterpret_cast<uintptr_t>(rr.p) - first;
        const int fd = rr.file_offset < lead ? -1 : rr.fd;  // -1: cannot be where p is in the file
        const uint64_t file_first = rr.file_offset - lead;  // the file offset of page `first`
        for (size_t i = 0; i < pages;) {
            if ((in[i] & 1) != 0) {
                ++i;
                continue;
            }
            size_t last = i + 1;  // [i, last): the run, with gaps of cached pages inside
            for (size_t j = i + 1; j < pages && j - last <= kGap; ++j)
                if ((in[j] & 1) == 0) last = j + 1;
            const uint64_t bytes = (last - i) * page;
            if (fd < 0) {
                if (syscall(SYS_madvise, reinterpret_cast<void*>(first + i * page), bytes, MADV_WILLNEED) == 0)
                    done[r].fetch_add(bytes, std::memory_order_relaxed);
            } else {
                for (uint64_t at = 0; at < bytes; at += kChunk)
                    chunks.push_back(Chunk{fd, file_first + i * page + at, std::min<uint64_t>(kChunk, bytes - at), r});
                to_read += bytes;
            }
            i = last;
        }
    }
    std::atomic<size_t> next{0};
    const size_t helpers = to_read < kShared || threads < 2 ? 0 : std::min<size_t>(threads, chunks.size()) - 1;
    std::vector<std::thread> pool;
    pool.reserve(helpers);  // no reallocation with threads in it
    for (size_t t = 0; t < helpers; ++t) {
        try {
            pool.emplace_back([&] { read_chunks(chunks, next, done); });
        } catch (const std::system_error&) {
            break;  // no thread to be had: fewer read
        }
    }
    read_chunks(chunks, next, done);
    for (auto& t : pool) t.join();
    std::vector<uint64_t> out(ranges.size());
    for (size_t r = 0; r < ranges.size(); ++r) out[r] = done[r].load(std::memory_order_relaxed);
    return out;
}

uint64_t read_ahead(const void* p, size_t n, int fd, uint64_t file_offset) {
    const ReadRange one{p, n, fd, file_offset};
    return read_ahead_all(std::span(&one, 1), 1)[0];
}

}  // namespace moecache::backend
