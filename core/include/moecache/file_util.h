// Whole-file reads and atomic writes, for the small text files moecache keeps (configs, heat
// profiles) and for /proc files (whose size stat reports as 0, so reading goes to the end).
#pragma once

#include "moecache/error.h"

#include <cstdint>
#include <functional>
#include <string>

namespace moecache {

// The whole file; refuses anything that is not a regular file (or a /proc-like file) or that is
// larger than max_bytes, so that a wrong path (a model, /dev/zero) fails fast. Errors name `what`.
Result<std::string> read_whole_file(const std::string& path, uint64_t max_bytes, std::string_view what = "file");

// Reads exactly n bytes at `offset` (retrying short reads and EINTR); an early end of file is an
// error. Errors name `what` and the offset.
Result<void> pread_exact(int fd, void* buf, size_t n, uint64_t offset, std::string_view what);

// Writes a temporary file beside `path`, fsyncs it and renames it over `path`; creates the
// directory if needed. Readers see the old or the new text, never a part.
Result<void> write_file_atomic(const std::string& path, const std::string& text);

// What follows the last '/' (the whole path when there is none).
inline std::string base_name(const std::string& path) {
    const auto slash = path.rfind('/');
    return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The first directory on the way to `path` (a file, or a glob: up to its first wildcard) that
// `can_search` (access(X_OK | R_OK) for the caller) says is closed, or "" when none is: what to
// open up for a daemon that cannot see into, say, ollama's 0750 home.
std::string first_closed_directory(const std::string& path, const std::function<bool(const std::string&)>& can_search);

}  // namespace moecache
