// The value syntaxes of the config that TOML has no type for: sizes ("48GiB", "60%") and expert
// pins ("12:0-7"). Sizes are computed in integers, so "99999999999TiB" is an overflow error and
// not a float that silently saturates.
#include "moecache/daemon/config.h"

#include <arpa/inet.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <utility>

namespace moecache::daemon {
namespace {

constexpr std::string_view kSizeHint =
    "write bytes (\"4096\"), a size with a unit B, KiB, MiB, GiB, TiB (or K, M, G, T), such as "
    "\"48GiB\", or a share of RAM such as \"60%\"";

std::string_view trim(std::string_view s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
    return s;
}

bool is_digit(char ch) { return ch >= '0' && ch <= '9'; }

// The length of the decimal number at the front of `s` ("12", "1.5"); 0 when there is none. A
// '.' belongs to the number only when a digit follows, so "1." leaves "." as the unit.
size_t number_length(std::string_view s) {
    size_t n = 0;
    while (n < s.size() && is_digit(s[n])) ++n;
    if (n == 0) return 0;
    if (n + 1 < s.size() && s[n] == '.' && is_digit(s[n + 1])) {
        n += 1;
        while (n < s.size() && is_digit(s[n])) ++n;
    }
    return n;
}

// Binary multipliers only: "G" meaning 10^9 on some tools and 2^30 on others is exactly the
// confusion a budget must not have, so every spelling here is a power of 1024.
std::optional<uint64_t> unit_multiplier(std::string_view unit) {
    static constexpr std::array<std::pair<std::string_view, uint64_t>, 10> kUnits{{
        {"", 1},
        {"b", 1},
        {"k", 1ull << 10},
        {"kib", 1ull << 10},
        {"m", 1ull << 20},
        {"mib", 1ull << 20},
        {"g", 1ull << 30},
        {"gib", 1ull << 30},
        {"t", 1ull << 40},
        {"tib", 1ull << 40},
    }};
    std::string lower(unit);
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    for (const auto& [name, multiplier] : kUnits)
        if (name == lower) return multiplier;
    return std::nullopt;
}

// number * multiplier in exact integer arithmetic; a fraction below one byte is dropped.
Result<uint64_t> scale(std::string_view text, std::string_view number, uint64_t multiplier) {
    const auto dot = number.find('.');
    const auto whole_digits = number.substr(0, dot);
    uint64_t whole = 0;
    const auto [end, ec] = std::from_chars(whole_digits.begin(), whole_digits.end(), whole);
    uint64_t bytes = 0;
    if (ec == std::errc::result_out_of_range || end != whole_digits.end() ||
        __builtin_mul_overflow(whole, multiplier, &bytes))
        return failf("'{}' is too large: a size must fit in 64 bits (16 EiB)", text);
    if (dot == std::string_view::npos) return bytes;

    // 18 digits fit in 64 bits; further digits weigh less than a byte even for TiB (2^40 < 10^13).
    const auto frac_digits = number.substr(dot + 1, 18);
    uint64_t frac = 0, denom = 1;
    for (const char ch : frac_digits) {
        frac = frac * 10 + static_cast<uint64_t>(ch - '0');
        denom *= 10;
    }
    const auto frac_bytes =
        static_cast<uint64_t>(static_cast<unsigned __int128>(frac) * multiplier / denom);
    if (__builtin_add_overflow(bytes, frac_bytes, &bytes))
        return failf("'{}' is too large: a size must fit in 64 bits (16 EiB)", text);
    return bytes;
}

Result<ByteAmount> parse_percent(std::string_view text, std::string_view number) {
    double p = 0;
    const auto [end, ec] = std::from_chars(number.begin(), number.end(), p);
    if (ec != std::errc() || end != number.end())
        return failf("'{}' is not a percentage: {}", text, kSizeHint);
    if (!(p > 0 && p <= 100))
        return failf("'{}' is out of range: a share of RAM must be more than 0% and at most 100%",
                     text);
    return ByteAmount{0, p};
}

// One number of a pin: a layer or an expert index.
Result<uint32_t> parse_index(std::string_view part, std::string_view what, std::string_view pin) {
    constexpr std::string_view kPinHint =
        "write \"LAYER\", \"LAYER:EXPERT\" or \"LAYER:FIRST-LAST\", such as \"12\", \"12:3\" or "
        "\"12:0-7\"";
    if (part.empty() || !std::all_of(part.begin(), part.end(), is_digit))
        return failf("'{}' is not a pin: the {} is not a number; {}", pin, what, kPinHint);
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(part.begin(), part.end(), v);
    if (ec != std::errc() || end != part.end())
        return failf("'{}' is not a pin: the {} {} is too large (the limit is {})", pin, what, part,
                     std::numeric_limits<uint32_t>::max());
    return v;
}

}  // namespace

uint64_t ByteAmount::resolve(uint64_t mem_total) const {
    if (!percent) return bytes;
    // long double carries MemTotal's 64 bits exactly on x86-64, so 100% is all of it.
    const long double share =
        static_cast<long double>(mem_total) * static_cast<long double>(*percent) / 100.0L;
    if (share >= static_cast<long double>(mem_total)) return mem_total;
    return static_cast<uint64_t>(share);
}

Result<ByteAmount> parse_byte_amount(std::string_view text) {
    const auto s = trim(text);
    if (s.empty()) return failf("the size is empty: {}", kSizeHint);
    if (s.front() == '-') return failf("'{}' is negative: a size is at least 0 bytes", text);
    const size_t n = number_length(s);
    if (n == 0)
        return failf("'{}' is not a size: it does not start with a number; {}", text, kSizeHint);
    const auto number = s.substr(0, n);
    const auto unit = trim(s.substr(n));  // "48 GiB" reads like "48GiB"
    if (unit == "%") return parse_percent(text, number);
    const auto multiplier = unit_multiplier(unit);
    if (!multiplier)
        return failf("'{}' is not a size: unknown unit '{}'; {}", text, unit, kSizeHint);
    return ByteAmount{MC_TRY(scale(text, number, *multiplier)), std::nullopt};
}

Result<ExpertPin> parse_expert_pin(std::string_view text) {
    const auto s = trim(text);
    const auto colon = s.find(':');
    ExpertPin pin;
    pin.layer = MC_TRY(parse_index(s.substr(0, colon), "layer", text));
    if (colon == std::string_view::npos) {
        pin.first = 0;
        pin.last = std::numeric_limits<uint32_t>::max();
        pin.whole_layer = true;
        return pin;
    }
    const auto experts = s.substr(colon + 1);
    const auto dash = experts.find('-');
    pin.first = MC_TRY(parse_index(experts.substr(0, dash), "expert", text));
    pin.last = pin.first;
    if (dash != std::string_view::npos)
        pin.last = MC_TRY(parse_index(experts.substr(dash + 1), "last expert", text));
    if (pin.first > pin.last)
        return failf("'{}' is a backwards range: first > last ({} > {}); write {}:{}-{}", text,
                     pin.first, pin.last, pin.layer, pin.last, pin.first);
    return pin;
}

std::string format_bytes(uint64_t bytes) {
    static constexpr std::array<std::pair<uint64_t, std::string_view>, 4> kUnits{
        {{1ull << 40, "TiB"}, {1ull << 30, "GiB"}, {1ull << 20, "MiB"}, {1ull << 10, "KiB"}}};
    for (const auto& [size, name] : kUnits)
        if (bytes >= size && bytes % size == 0) return fmt::format("{} {}", bytes / size, name);
    for (const auto& [size, name] : kUnits)
        if (bytes >= size)
            return fmt::format("{} bytes ({:.1f} {})", bytes,
                               static_cast<double>(bytes) / static_cast<double>(size), name);
    return fmt::format("{} bytes", bytes);
}

}  // namespace moecache::daemon
