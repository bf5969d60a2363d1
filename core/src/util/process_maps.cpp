#include "moecache/process_maps.h"

#include "moecache/file_util.h"

#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>

namespace moecache {
namespace {

// Reads a hex number and the separator after it; false when there is none.
bool hex_field(std::string_view& s, uint64_t& out, char sep) {
    const auto* end = s.data() + s.size();
    auto [p, ec] = std::from_chars(s.data(), end, out, 16);
    if (ec != std::errc() || p == end || *p != sep) return false;
    s.remove_prefix(static_cast<size_t>(p - s.data()) + 1);
    return true;
}

std::string_view next_word(std::string_view& s) {
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    const size_t n = std::min(s.find(' '), s.size());
    const auto w = s.substr(0, n);
    s.remove_prefix(n);
    return w;
}

}  // namespace

Result<InodeId> identify_file(const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return fail_errno("stat {}", path);
    return InodeId{major(st.st_dev), minor(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

// A line: "7f12a000-7f12c000 r--s 00001000 fe:01 1234567   /path/to/model.gguf"
std::optional<MapsEntry> parse_maps_line(std::string_view line) {
    uint64_t start = 0, end = 0, offset = 0, dmaj = 0, dmin = 0, inode = 0;
    if (!hex_field(line, start, '-') || !hex_field(line, end, ' ')) return std::nullopt;
    const auto perms = next_word(line);
    const auto off_s = next_word(line);
    if (std::from_chars(off_s.data(), off_s.data() + off_s.size(), offset, 16).ec != std::errc()) return std::nullopt;
    auto dev = next_word(line);
    if (!hex_field(dev, dmaj, ':')) return std::nullopt;
    if (std::from_chars(dev.data(), dev.data() + dev.size(), dmin, 16).ec != std::errc()) return std::nullopt;
    const auto ino_s = next_word(line);
    if (std::from_chars(ino_s.data(), ino_s.data() + ino_s.size(), inode, 10).ec != std::errc()) return std::nullopt;
    if (end <= start) return std::nullopt;
    while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
    return MapsEntry{{static_cast<uintptr_t>(start), static_cast<uintptr_t>(end), offset, std::string(perms)},
                     {static_cast<uint32_t>(dmaj), static_cast<uint32_t>(dmin), inode},
                     std::string(line)};
}

std::vector<MapsEntry> parse_maps(std::string_view text) {
    std::vector<MapsEntry> out;
    while (!text.empty()) {
        const size_t eol = std::min(text.find('\n'), text.size());
        auto entry = parse_maps_line(text.substr(0, eol));
        text.remove_prefix(std::min(eol + 1, text.size()));
        if (entry && entry->file.inode != 0) out.push_back(std::move(*entry));
    }
    return out;
}

const MapsEntry* entry_at(const std::vector<MapsEntry>& entries, uintptr_t address) {
    for (const auto& e : entries)
        if (address >= e.mapping.start && address < e.mapping.end) return &e;
    return nullptr;
}

std::vector<FileMapping> find_mappings(std::string_view text, const InodeId& file) {
    std::vector<FileMapping> out;
    for (auto& e : parse_maps(text))
        if (e.file == file) out.push_back(std::move(e.mapping));
    return out;
}

std::vector<FileMapping> merge_adjacent(std::vector<FileMapping> in) {
    std::sort(in.begin(), in.end(), [](const FileMapping& a, const FileMapping& b) { return a.start < b.start; });
    std::vector<FileMapping> out;
    for (auto& m : in) {
        if (!out.empty()) {
            auto& last = out.back();
            if (last.end == m.start && last.perms == m.perms && last.file_offset + (last.end - last.start) == m.file_offset) {
                last.end = m.end;
                continue;
            }
        }
        out.push_back(std::move(m));
    }
    return out;
}

Result<std::string> read_proc_text(const char* path) {
    // /proc/self/maps of a process with many mappings can be tens of MiB; nothing here is larger.
    return read_whole_file(path, 256u << 20, "proc file");
}

}  // namespace moecache
