#include "moecache/backend/read_ahead.h"

#include "moecache/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace moecache::backend {

std::optional<MappingReads> mapping_reads(std::string_view text, uintptr_t address) {
    // Each mapping: a header "start-end perms offset dev inode [path]", then "Key: value" lines,
    // VmFlags among them.
    std::optional<MappingReads> found;
    for_each_line(text, [&](std::string_view line) {
        const size_t dash = line.find('-');
        const size_t space = line.find(' ');
        const bool header = dash != std::string_view::npos && space != std::string_view::npos && dash < space &&
                            line.substr(0, dash).find_first_not_of("0123456789abcdef") == std::string_view::npos;
        if (header) {
            if (found) return false;  // the mapping had no VmFlags line: not random
            const std::string a(line.substr(0, dash)), b(line.substr(dash + 1, space - dash - 1));
            char* end_a = nullptr;
            char* end_b = nullptr;
            const auto start = static_cast<uintptr_t>(strtoull(a.c_str(), &end_a, 16));
            const auto end = static_cast<uintptr_t>(strtoull(b.c_str(), &end_b, 16));
            if (*end_a == '\0' && *end_b == '\0' && address >= start && address < end) found = MappingReads{start, end, false};
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
    const int fd = open("/proc/self/smaps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::nullopt;
    std::string text;
    char buf[1 << 16];
    for (;;) {
        const ssize_t r = read(fd, buf, sizeof buf);
        if (r > 0) {
            text.append(buf, static_cast<size_t>(r));
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else {
            break;
        }
    }
    close(fd);
    return mapping_reads(text, reinterpret_cast<uintptr_t>(address));
}

bool read_ahead(const void* p, size_t n) {
    if (n == 0) return false;
    static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
    const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + n - 1) & ~(page - 1);
    const uintptr_t middle = (first + (last - first) / 2) & ~(page - 1);
    bool cached = true;
    for (const uintptr_t a : {first, middle, last}) {
        unsigned char in = 0;
        if (mincore(reinterpret_cast<void*>(a), page, &in) != 0) return false;  // not a mapping to read
        if ((in & 1) == 0) {
            cached = false;
            break;
        }
    }
    if (cached) return false;
    return syscall(SYS_madvise, reinterpret_cast<void*>(first), last + page - first, MADV_WILLNEED) == 0;
}

}  // namespace moecache::backend
