// What this build is: the project's version (project() in the top CMakeLists.txt) and the git
// commit it was built from, for --version, /metrics (moecache_build_info) and bug reports.
#pragma once

#include <string>

namespace moecache {

[[nodiscard]] const char* build_version();
// Twelve hex digits, "-dirty" after them when tracked files differed from the commit; the
// -DMOECACHE_COMMIT= given at configure time (a package built from a tarball); else "unknown".
[[nodiscard]] const char* build_commit();
// "0.1.0 (commit 1a2b3c4d5e6f)".
[[nodiscard]] std::string version_line();

}  // namespace moecache
