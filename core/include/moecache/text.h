// Text that leaves the daemon for protocols that take UTF-8 only (D-Bus strings, Prometheus
// labels), from names the kernel takes as bytes (file paths, process names).
#pragma once

#include <cstddef>
#include <cstdint>
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

// A name as it is shown and keyed (metrics labels, log lines, D-Bus, profile keys): s itself up to
// kMaxShownName bytes; a longer one is cut at a character boundary and ends in "~" and 16 hex
// digits of a hash of the whole (so that two long names stay apart). A GGUF's general.name may be
// megabytes: shown in full it was copied into every metric sample, log line and reply each turn.
inline constexpr size_t kMaxShownName = 256;
// FNV-1a (64 bits) of s: what tells long or shortened names apart where they are shown.
uint64_t name_hash(std::string_view s);
std::string shown_name(std::string_view s);

// A size for people: "512 B", "1.5 KiB", "12.3 GiB" (powers of 1024, one decimal).
std::string human_bytes(uint64_t bytes);

// Calls f(line) for each line of text, without its newline (a last line without one too), until f
// returns false. For /proc files and other line-oriented text read whole.
template <class F>
void for_each_line(std::string_view text, F&& f) {
    size_t pos = 0;
    while (pos < text.size()) {
        size_t eol = text.find('\n', pos);
        if (eol == std::string_view::npos) eol = text.size();
        if (!f(text.substr(pos, eol - pos))) return;
        pos = eol + 1;
    }
}

}  // namespace moecache
