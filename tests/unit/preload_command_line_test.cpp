// The preloaded libraries at a process's start: every process they reach runs as it would without
// them (a constructor that crashed once took /bin/true down with it), MOECACHE_KEEP_MAPPING turns a
// runtime's `--load-mode none` into `mmap` before main reads it, and without it the CPU preload says
// once why moecache cannot help such a runtime.
#include "run.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace moecache::test {
namespace {

std::vector<std::string> preloads() {
    std::vector<std::string> libs = {MOECACHE_REARM_LIB};
#ifdef MOECACHE_CUDA_HOOK_LIB
    libs.emplace_back(MOECACHE_CUDA_HOOK_LIB);
#endif
    return libs;
}

TEST(PreloadCommandLine, EveryProcessRunsAsItWouldWithout) {
    for (const auto& lib : preloads()) {
        const auto t = run({"/bin/true"}, {"LD_PRELOAD=" + lib});
        EXPECT_EQ(t.exit_code, 0) << lib << ": " << t.err;
        const auto sh = run({"/bin/sh", "-c", "exit 3"}, {"LD_PRELOAD=" + lib});
        EXPECT_EQ(sh.exit_code, 3) << lib << ": " << sh.err;
        const auto echo = run({"/bin/echo", "--load-mode", "none"}, {"LD_PRELOAD=" + lib});
        EXPECT_EQ(echo.out, "--load-mode none\n") << lib << ": untouched unless asked";
    }
}

TEST(PreloadCommandLine, KeepingTheMappingRewritesTheLoadModeBeforeMainReadsIt) {
    for (const auto& lib : preloads()) {
        const auto r = run({"/bin/echo", "-m", "model.gguf", "--load-mode", "none", "--port", "8080"},
                           {"LD_PRELOAD=" + lib, "MOECACHE_KEEP_MAPPING=1"});
        EXPECT_EQ(r.exit_code, 0) << lib << ": " << r.err;
        EXPECT_EQ(r.out, "-m model.gguf --load-mode mmap --port 8080\n") << lib;
        EXPECT_NE(r.err.find("--load-mode none became --load-mode mmap (MOECACHE_KEEP_MAPPING)"), std::string::npos)
            << lib << ": " << r.err;
    }
}

TEST(PreloadCommandLine, ACpuRuntimeWithoutAMappingIsToldWhyAndWhatToDo) {
    const auto r = run({"/bin/echo", "-m", "model.gguf", "--load-mode", "none"}, {"LD_PRELOAD=" MOECACHE_REARM_LIB});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.err.find("moecache-rearm: this runtime was started with --load-mode none"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("PARAMETER use_mmap true"), std::string::npos) << r.err;
    const auto mapped = run({"/bin/echo", "-m", "model.gguf"}, {"LD_PRELOAD=" MOECACHE_REARM_LIB});
    EXPECT_EQ(mapped.err.find("moecache-rearm: this runtime"), std::string::npos)
        << "a mapped model is no problem: " << mapped.err;
}

}  // namespace
}  // namespace moecache::test
