// moecache-map-probe FILE: maps FILE as llama.cpp does (shared, read-only, MAP_POPULATE, then
// POSIX_MADV_WILLNEED and MADV_WILLNEED on all of it), reports how much of it is in the page cache
// right after (mincore) and how much of it this process has mapped (the mapping's Rss in
// /proc/self/smaps), then reads every byte through the mapping and compares with pread.
// Prints one JSON line: {"pages":N,"resident":R,"mapped":M,"same":true|false}. For the lazy-load tests.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

// Pages of the mapping at `addr` present in this process's page tables.
size_t mapped_pages(const void* addr) {
    std::ifstream f("/proc/self/smaps");
    char start[32];
    std::snprintf(start, sizeof start, "%lx-", reinterpret_cast<unsigned long>(addr));
    bool in = false;
    for (std::string line; std::getline(f, line);) {
        if (line.rfind(start, 0) == 0) in = true;
        else if (in && line.rfind("Rss:", 0) == 0) return std::stoul(line.substr(4)) / 4;
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: moecache-map-probe FILE\n");
        return 2;
    }
    const int fd = ::open(argv[1], O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (fd < 0 || ::fstat(fd, &st) != 0 || st.st_size == 0) {
        std::perror(argv[1]);
        return 1;
    }
    const size_t len = static_cast<size_t>(st.st_size);
    auto* p = static_cast<unsigned char*>(::mmap(nullptr, len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0));
    if (p == MAP_FAILED) {
        std::perror("mmap");
        return 1;
    }
    if (::posix_madvise(p, len, POSIX_MADV_WILLNEED) != 0 || ::madvise(p, len, MADV_WILLNEED) != 0) {
        std::perror("madvise");
        return 1;
    }
    const size_t ps = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> v((len + ps - 1) / ps);
    if (::mincore(p, len, v.data()) != 0) {
        std::perror("mincore");
        return 1;
    }
    size_t resident = 0;
    for (auto b : v) resident += b & 1;
    const size_t mapped = mapped_pages(p);
    std::vector<unsigned char> buf(1 << 20);
    bool same = true;
    for (size_t off = 0; off < len && same; off += buf.size()) {
        const size_t n = std::min(buf.size(), len - off);
        same = ::pread(fd, buf.data(), n, static_cast<off_t>(off)) == static_cast<ssize_t>(n) && std::memcmp(buf.data(), p + off, n) == 0;
    }
    std::printf("{\"pages\":%zu,\"resident\":%zu,\"mapped\":%zu,\"same\":%s}\n", v.size(), resident, mapped,
                same ? "true" : "false");
    return 0;
}
