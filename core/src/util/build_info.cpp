#include "moecache/build_info.h"

#include <fmt/format.h>

namespace moecache {

const char* build_version() { return MOECACHE_VERSION_STRING; }

std::string version_line() { return fmt::format("{} (commit {})", build_version(), build_commit()); }

}  // namespace moecache
