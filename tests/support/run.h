// Runs a program and captures what it prints, for tests of the command-line tools.
#pragma once

#include <string>
#include <vector>

namespace moecache::test {

struct RunResult {
    int exit_code = -1;  // -1: did not exit normally
    std::string out;
    std::string err;
    long max_rss_kib = 0;  // peak resident set of the child
    double seconds = 0;
};

// argv[0] is the program path; no shell is involved. Environment entries "K=V" are added.
RunResult run(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
              int timeout_seconds = 300);

}  // namespace moecache::test
