#pragma once

#include "moecache/error.h"

#include <charconv>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace moecache::mkmodel {
int run_cli(int argc, char** argv);

// Command-line values, whole or not at all (the generator tools' options share them).
template <typename T>
bool parse_number(const std::string& s, T& out) {
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc{} && p == s.data() + s.size();
}
bool parse_double(const std::string& s, double& out);

// The tools' option loop (moecache-mkmodel, moecache-tracegen, moecache-sim). -h/--help prints
// `usage`. `flag(arg)` takes an argument that needs no value (a flag, or a positional argument)
// and says whether it did; every other argument is an option whose value is the next one, for
// `option(name, value)`: true where it took it, false where it does not know the name, an error
// (such as bad_value's) in its own words. Returns the exit status to leave with (0 after --help;
// 2 after a bad argument, said on stderr after "`program`: "), or nothing to go on.
using OptionHandler = std::function<Result<bool>(const std::string& name, const std::string& value)>;
std::optional<int> parse_options(int argc, char** argv, std::string_view program, std::string_view usage,
                                 const std::function<bool(const std::string&)>& flag, const OptionHandler& option);
// "NAME: 'VALUE' is not a valid value", the error for a value that does not parse.
tl::unexpected<Error> bad_value(const std::string& name, const std::string& value);
// Says `message` on stderr after "`program`: " and returns 2, the exit status of a usage error.
int usage_error(std::string_view program, const std::string& message);
}
