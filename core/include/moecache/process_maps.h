// Where a file is mapped in this process, read off /proc/self/maps by device and inode (a path
// string may be relative, a symlink or a deleted name; the inode is the file).
#pragma once

#include "moecache/error.h"

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moecache {

struct InodeId {
    uint32_t dev_major = 0;
    uint32_t dev_minor = 0;
    uint64_t inode = 0;
    bool operator==(const InodeId&) const = default;
};

struct FileMapping {
    uintptr_t start = 0;  // virtual address of the first byte
    uintptr_t end = 0;    // one past the last byte
    uint64_t file_offset = 0;  // of `start`
    std::string perms;

    // Whether file bytes [offset, offset + length) lie wholly in this mapping.
    [[nodiscard]] bool covers(uint64_t offset, uint64_t length) const {
        return offset >= file_offset && offset + length <= file_offset + (end - start);
    }
    // Where file byte `offset` is, for an offset it covers.
    [[nodiscard]] uintptr_t address_of(uint64_t offset) const { return start + (offset - file_offset); }
};

// One file-backed line of /proc/PID/maps. `path` is as the kernel prints it: it may end in
// " (deleted)" and cannot be told apart from a name containing a newline.
struct MapsEntry {
    FileMapping mapping;
    InodeId file;
    std::string path;
};

// Every file-backed mapping (inode != 0) in the text of a /proc/PID/maps, in its order. Lines that
// do not parse are skipped.
std::vector<MapsEntry> parse_maps(std::string_view maps_text);
// One line of it (or a mapping's first line in /proc/PID/smaps), anonymous memory included
// (file.ino 0, path "" or the kernel's name such as "[heap]"); nullopt where it does not parse.
std::optional<MapsEntry> parse_maps_line(std::string_view line);

// The entry whose mapping holds `address`, or null (memory no file backs).
const MapsEntry* entry_at(const std::vector<MapsEntry>& entries, uintptr_t address);

Result<InodeId> identify_file(const std::string& path);

// Every mapping of the file in the text of a /proc/PID/maps. Lines that do not parse are skipped.
std::vector<FileMapping> find_mappings(std::string_view maps_text, const InodeId& file);

// The same mappings with adjacent pieces that continue each other (address and file offset,
// same permissions) joined: a VMA split by madvise reads as one mapping again.
std::vector<FileMapping> merge_adjacent(std::vector<FileMapping> mappings);

// A whole /proc file (their size is unknown until read).
Result<std::string> read_proc_text(const char* path);

}  // namespace moecache
