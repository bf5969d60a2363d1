// libFuzzer target for the GGUF reader and the expert map: whatever the bytes, they must be
// mapped or rejected with an error that names the file; never a crash, a hang, undefined
// behaviour or an allocation the file cannot justify (-rss_limit_mb / -malloc_limit_mb catch it).
#include "moecache/gguf.h"
#include "moecache/model.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr const char* kPath = "fuzz-input";

[[noreturn]] void die(const char* what) {
    std::perror(what);
    std::abort();
}

// One memfd for the whole run: read_gguf wants a regular file, and a memfd is one that lives in
// memory, so each input costs no disk I/O and leaves nothing behind.
int input_fd() {
    static const int fd = [] {
        const int f = ::memfd_create("gguf-fuzz-input", MFD_CLOEXEC);
        if (f < 0) die("memfd_create");
        return f;
    }();
    return fd;
}

void replace_contents(int fd, const uint8_t* data, size_t size) {
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) die("ftruncate");
    size_t done = 0;
    while (done < size) {
        const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die("pwrite");
        done += static_cast<size_t>(n);
    }
}

// Every message a user can meet must say which file it is about.
void check_names_file(const moecache::Error& e) {
    if (e.message.find(kPath) == std::string::npos) {
        std::fprintf(stderr, "error without the file name: %s\n", e.message.c_str());
        std::abort();
    }
}

// A map that was built must answer its own questions: the first byte of each expert's range is
// that expert's.
void check_map(const moecache::ExpertMap& map) {
    for (const auto& layer : map.layers)
        for (const uint32_t expert : {0u, map.n_experts - 1})
            for (const auto& r : map.ranges(layer.index, expert)) {
                const auto ref = map.lookup(r.file, r.offset);
                if (!ref || ref->layer != layer.index || ref->expert != expert) {
                    std::fprintf(stderr, "lookup(%u, %lu) does not give blk.%u expert %u back\n",
                                 r.file, static_cast<unsigned long>(r.offset), layer.index, expert);
                    std::abort();
                }
            }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const int fd = input_fd();
    replace_contents(fd, data, size);
    auto file = moecache::read_gguf(fd, kPath);
    if (!file) {
        check_names_file(file.error());
        return 0;
    }
    std::vector<moecache::GgufFile> parts;
    parts.push_back(std::move(*file));
    const auto map = moecache::ExpertMap::build(parts);
    if (!map) {
        check_names_file(map.error());
        return 0;
    }
    check_map(*map);
    return 0;
}
