// Text that leaves the daemon for protocols that take UTF-8 only (D-Bus strings, Prometheus
// labels), from names the kernel takes as bytes (file paths, process names).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace moecache {

// Length of the valid UTF-8 sequence at the start of s, or 0 (overlongs, surrogates and code
// points past U+10FFFF are invalid; so is an empty s).
size_t utf8_length(std::string_view s);

// s where it is valid UTF-8; each byte that is not, as \xNN (and a backslash as \\ only where s
// needed escaping at all, so that valid text passes through unchanged). For display: the daemon
// keeps the real bytes.
std::string printable_utf8(std::string_view s);

}  // namespace moecache
