// main() of the tests that need the CUDA hook preloaded. ctest cannot pass several environment
// variables through test discovery, so the test takes --preload=LIB (and --driver-dir=DIR for the
// fake driver) and runs itself again with LD_PRELOAD (and LD_LIBRARY_PATH) set, plus `env`.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace moecache::test {

int preloaded_test_main(int argc, char** argv, const std::vector<std::pair<std::string, std::string>>& env = {});

}  // namespace moecache::test
