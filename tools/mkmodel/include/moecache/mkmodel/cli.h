#pragma once

#include <charconv>
#include <string>

namespace moecache::mkmodel {
int run_cli(int argc, char** argv);

// Command-line values, whole or not at all (the generator tools' options share them).
template <typename T>
bool parse_number(const std::string& s, T& out) {
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc{} && p == s.data() + s.size();
}
bool parse_double(const std::string& s, double& out);
}
