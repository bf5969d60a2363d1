#include "moecache/text.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include <cstdint>
#include <cstdio>

namespace moecache {

size_t utf8_length(std::string_view s) {
    if (s.empty()) return 0;
    const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
    const unsigned char c = b(0);
    if (c < 0x80) return 1;
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if ((c & 0xe0) == 0xc0) n = 2, cp = c & 0x1f, min = 0x80;
    else if ((c & 0xf0) == 0xe0) n = 3, cp = c & 0x0f, min = 0x800;
    else if ((c & 0xf8) == 0xf0) n = 4, cp = c & 0x07, min = 0x10000;
    else return 0;
    if (s.size() < n) return 0;
    for (size_t i = 1; i < n; ++i) {
        if ((b(i) & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (b(i) & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return n;
}

std::string printable_utf8(std::string_view s) {
    bool valid = true;
    for (std::string_view r = s; !r.empty();) {
        const size_t n = utf8_length(r);
        if (n == 0) {
            valid = false;
            break;
        }
        r.remove_prefix(n);
    }
    if (valid) return std::string(s);
    std::string out;
    out.reserve(s.size() + 16);
    while (!s.empty()) {
        const size_t n = utf8_length(s);
        if (n == 0) {
            char hex[5];
            std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned char>(s[0]));
            out += hex;
            s.remove_prefix(1);
            continue;
        }
        if (n == 1 && s[0] == '\\') out += "\\\\";
        else out.append(s.substr(0, n));
        s.remove_prefix(n);
    }
    return out;
}

uint64_t name_hash(std::string_view s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

std::string shown_name(std::string_view s) {
    if (s.size() <= kMaxShownName) return std::string(s);
    const uint64_t h = name_hash(s);
    constexpr size_t kTail = 17;  // "~" and 16 hex digits
    size_t keep = 0;
    while (keep < s.size()) {  // whole characters only (a byte that starts none counts as one)
        const size_t n = std::max<size_t>(utf8_length(s.substr(keep)), 1);
        if (keep + n > kMaxShownName - kTail) break;
        keep += n;
    }
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out(s.substr(0, keep));
    out += '~';
    for (int i = 15; i >= 0; --i) out += kHex[(h >> (4 * i)) & 15];
    return out;
}

std::string human_bytes(uint64_t bytes) {
    static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = static_cast<double>(bytes);
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < std::size(kUnits)) {
        v /= 1024.0;
        ++u;
    }
    return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, kUnits[u]);
}

}  // namespace moecache
