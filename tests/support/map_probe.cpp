// moecache-map-probe FILE: maps FILE as llama.cpp does (shared, read-only, MAP_POPULATE, then
// POSIX_MADV_WILLNEED and MADV_WILLNEED on all of it), reports how much of it is in the page cache
// right after (mincore), then reads every byte through the mapping and compares with pread.
// Prints one JSON line: {"pages":N,"resident":R,"same":true|false}. For the lazy-load tests.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <vector>

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
    std::vector<unsigned char> buf(1 << 20);
    bool same = true;
    for (size_t off = 0; off < len && same; off += buf.size()) {
        const size_t n = std::min(buf.size(), len - off);
        same = ::pread(fd, buf.data(), n, static_cast<off_t>(off)) == static_cast<ssize_t>(n) && std::memcmp(buf.data(), p + off, n) == 0;
    }
    std::printf("{\"pages\":%zu,\"resident\":%zu,\"same\":%s}\n", v.size(), resident, same ? "true" : "false");
    return 0;
}
