#include "moecache/file_util.h"

#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

namespace moecache {

Result<std::string> read_whole_file(const std::string& path, uint64_t max_bytes, std::string_view what) {
    // O_NONBLOCK: a FIFO put where a file was expected opens at once (and is refused below)
    // instead of blocking the caller until a writer comes; a regular file reads as usual.
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd) return fail_errno("{}: cannot open the {}", path, what);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return fail_errno("{}: fstat", path);
    if (!S_ISREG(st.st_mode)) return failf("{}: not a regular file", path);
    if (static_cast<uint64_t>(st.st_size) > max_bytes)
        return failf("{}: {} bytes is too large for a {} (the limit is {})", path, st.st_size, what, max_bytes);
    std::string text;
    char buf[65536];
    for (;;) {
        const ssize_t n = ::read(fd.get(), buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR) continue;
            return fail_errno("{}: read", path);
        }
        if (n == 0) break;
        text.append(buf, static_cast<size_t>(n));
        if (text.size() > max_bytes)
            return failf("{}: too large for a {} (the limit is {} bytes)", path, what, max_bytes);
    }
    return text;
}

Result<void> write_file_atomic(const std::string& path, const std::string& text) {
    const auto dir = std::filesystem::path(path).parent_path();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);
    if (ec) return fail(ec.value(), fmt::format("{}: cannot create the directory", dir.string()));
    const std::string tmp = path + ".tmp";
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (!fd) return fail_errno("{}: cannot create", tmp);
    // What failed leaves nothing behind (a full disk would keep a partial file): the old file stays.
    auto failed = [&](const char* doing) {
        auto e = fail_errno("{}: {}", tmp, doing);
        ::unlink(tmp.c_str());
        return e;
    };
    for (size_t off = 0; off < text.size();) {
        const ssize_t n = ::write(fd.get(), text.data() + off, text.size() - off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return failed("write");
        }
        off += static_cast<size_t>(n);
    }
    if (::fsync(fd.get()) != 0) return failed("fsync");
    fd.reset();
    if (::rename(tmp.c_str(), path.c_str()) != 0) return failed(fmt::format("rename to {}", path).c_str());
    return {};
}

Result<void> pread_exact(int fd, void* buf, size_t n, uint64_t offset, std::string_view what) {
    auto* p = static_cast<uint8_t*>(buf);
    while (n > 0) {
        const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
        if (got < 0) {
            if (errno == EINTR) continue;
            return fail_errno("read {} at offset {}", what, offset);
        }
        if (got == 0) return failf("read {} at offset {}: unexpected end of file", what, offset);
        p += got;
        n -= static_cast<size_t>(got);
        offset += static_cast<uint64_t>(got);
    }
    return {};
}

std::string first_closed_directory(const std::string& path, const std::function<bool(const std::string&)>& can_search) {
    if (path.empty() || path[0] != '/') return "";
    // The directories up to the last '/' before the first wildcard.
    const std::string fixed = path.substr(0, std::min(path.find_first_of("*?["), path.size()));
    const size_t last = fixed.rfind('/');
    for (size_t p = fixed.find('/', 1); p != std::string::npos && p <= last; p = fixed.find('/', p + 1))
        if (const std::string dir = fixed.substr(0, p); !can_search(dir)) return dir;
    return "";
}

}  // namespace moecache
