#include "preload_main.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace moecache::test {

int preloaded_test_main(int argc, char** argv, const std::vector<std::pair<std::string, std::string>>& env) {
    std::string preload, driver_dir;
    std::vector<char*> args;
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        if (a.rfind("--preload=", 0) == 0) preload = a.substr(10);
        else if (a.rfind("--driver-dir=", 0) == 0) driver_dir = a.substr(13);
        else args.push_back(argv[i]);
    }
    const char* current = getenv("LD_PRELOAD");
    if (!preload.empty() && (current == nullptr || preload != current)) {
        setenv("LD_PRELOAD", preload.c_str(), 1);
        if (!driver_dir.empty()) setenv("LD_LIBRARY_PATH", driver_dir.c_str(), 1);
        for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
        // No hot profile carried from one test to the next (the same generated model has the same
        // name everywhere): a test that wants one names its folder.
        setenv("MOECACHE_CUDA_PROFILE", "off", 0);
        args.push_back(nullptr);
        execv("/proc/self/exe", args.data());
        perror("execv /proc/self/exe");
        return 2;
    }
    args.push_back(nullptr);
    int n = static_cast<int>(args.size()) - 1;
    ::testing::InitGoogleTest(&n, args.data());
    return RUN_ALL_TESTS();
}

}  // namespace moecache::test
