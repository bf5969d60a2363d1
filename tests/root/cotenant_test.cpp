// Issue 20 row 10: moecached shares a memory cgroup with a process that grows (the demo's layout,
// a container with both). The pages the daemon locks are charged to that cgroup and reclaim
// cannot take them, so without care the co-tenant's growth ends in the cgroup's OOM killer. The
// daemon's lock cap leaves what the co-tenant holds that reclaim cannot take: as it grows, the
// daemon lets go of its coldest locks, and nothing is killed.
#include "memory_cgroup.h"
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace moecache {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

TEST(CoTenant, AProcessGrowingInTheDaemonsCgroupTakesLocksBackAndNothingIsKilled) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: a memory cgroup and the daemon's locks";
    constexpr uint64_t kLimit = 256 * kMiB, kGrowth = 176 * kMiB, kStep = 2 * kMiB;
    auto made = test::MemoryCgroup::create("moecache-cotenant-test-", kLimit);
    if (!made) GTEST_SKIP() << "no memory cgroup: " << made.error().what();
    const auto& cg = *made;
    test::TempDir dir;
    const std::string model = dir.file("model.gguf");
    auto spec = test::small_spec();  // 12 layers x 32 experts of 408 KiB: 153 MiB of experts
    spec.n_layers = 12;
    spec.n_experts = 32;
    spec.n_ff_exp = 512;
    test::write_model(spec, model);
    test::drop_page_cache(model);  // the daemon's reads charge its pages to the cgroup
    std::string pins;
    for (int l = 0; l < 12; ++l) pins += (l ? ", \"" : "\"") + std::to_string(l) + "\"";
    const std::string cfg = dir.file("moecached.toml");
    test::write_file(cfg, "[daemon]\nstate_dir = \"" + dir.file("state") + "\"\ntick_seconds = 0.1\nsocket = \"" +
                              dir.file("sock") + "\"\n[budget]\nlock = \"200MiB\"\nreserve = \"24MiB\"\n"
                              "[metrics]\nlisten = \"\"\n[dbus]\nbus = \"off\"\n[telemetry]\npage_cache = \"off\"\n"
                              "[[model]]\npath = \"" + model + "\"\nlock_dense = false\npin = [" + pins + "]\n");
    test::Background daemon(cg->inside({MOECACHE_DAEMON_BIN, "--config", cfg}));
    ASSERT_TRUE(daemon.wait_for("moecached running", 20)) << daemon.output();
    // Everything pinned is locked: 150 MiB or more that reclaim cannot take.
    const auto until = [&](const std::function<bool()>& done, double seconds) {
        const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
        while (std::chrono::steady_clock::now() < end) {
            if (done()) return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        return done();
    };
    ASSERT_TRUE(until([&] { return cg->stat("unevictable") >= 150 * kMiB; }, 30))
        << "the daemon locked " << (cg->stat("unevictable") >> 20) << " MiB\n"
        << daemon.output();
    const uint64_t locked_before = cg->stat("unevictable");

    // The co-tenant: 176 MiB of its own, 2 MiB every 20 ms, held for 2 s.
    const pid_t tenant = ::fork();
    if (tenant == 0) {
        if (!cg->add(::getpid())) ::_exit(3);
        std::vector<char*> blocks;
        for (uint64_t got = 0; got < kGrowth; got += kStep) {
            auto* b = static_cast<char*>(std::malloc(kStep));
            if (b == nullptr) ::_exit(4);
            std::memset(b, 1, kStep);
            blocks.push_back(b);
            ::usleep(20000);
        }
        ::sleep(2);
        ::_exit(0);
    }
    ASSERT_GT(tenant, 0);
    int status = 0;
    ASSERT_EQ(::waitpid(tenant, &status, 0), tenant);
    const uint64_t locked_after = cg->stat("unevictable");
    std::cout << "[ measured ] cgroup limit " << (kLimit >> 20) << " MiB: the daemon held " << (locked_before >> 20)
              << " MiB locked, then " << (locked_after >> 20) << " MiB beside a co-tenant of " << (kGrowth >> 20)
              << " MiB; OOM kills " << cg->oom_kills() << "\n";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the co-tenant " << (WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status)) : "failed")
        << "\n" << daemon.output();
    EXPECT_EQ(cg->oom_kills(), 0u) << daemon.output();
    EXPECT_LE(locked_after, kLimit - kGrowth) << "the daemon kept what the co-tenant needed";
    EXPECT_EQ(::kill(daemon.pid(), 0), 0) << "moecached is gone\n" << daemon.output();
    daemon.signal(SIGTERM);
    EXPECT_EQ(daemon.wait(30), 0) << daemon.output();
}

}  // namespace
}  // namespace moecache
