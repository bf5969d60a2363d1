// The page locker on the real kernel: neighbouring experts share the page at their boundary, and
// unlocking one of them must not unlock the other's pages; VmLck follows the locker's own count.
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/daemon/daemon.h"
#include "moecache/daemon/mapped_model.h"
#include "moecache/daemon/page_locker.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>

namespace moecache::daemon {
namespace {

uint64_t vmlck() { return vmlck_bytes(); }

TEST(PageLocker, SharedBoundaryPagesStayLockedForTheNeighbour) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: mlock beyond RLIMIT_MEMLOCK";
    test::TempDir dir;
    auto spec = test::small_spec();
    spec.expert_type = *ggml_type_info(ggml::Q4_K);  // 144-byte blocks: slices are not page aligned
    test::write_model(spec, dir.file("m.gguf"));
    auto model = MappedModel::open(dir.file("m.gguf"));
    ASSERT_TRUE(model) << model.error().what();
    const auto& map = (*model)->map();
    const uint64_t ps = PageLocker::page_size();
    // Two neighbours in one tensor whose shared boundary falls inside a page.
    const auto layer = map.layers[1].index;
    ByteRange a{}, b{};
    bool found = false;
    for (uint32_t e = 0; e + 1 < map.n_experts && !found; ++e) {
        a = map.ranges(layer, e)[0];
        b = map.ranges(layer, e + 1)[0];
        found = (a.offset + a.length) % ps != 0;
    }
    ASSERT_TRUE(found) << "every slice boundary is page aligned; pick another shape";
    const uint64_t shared_page = (a.offset + a.length) / ps;
    ASSERT_EQ(b.offset / ps, shared_page);

    PageLocker locker(**model);
    const uint64_t base = vmlck();
    const uint64_t cost_a = locker.cost(a);
    ASSERT_EQ(*locker.lock(a), cost_a);
    EXPECT_EQ(vmlck() - base, locker.locked_bytes());
    // b costs one page less than its span: the shared page is already locked.
    const uint64_t span_b = ((b.offset + b.length - 1) / ps - b.offset / ps + 1) * ps;
    EXPECT_EQ(locker.cost(b), span_b - ps);
    ASSERT_EQ(*locker.lock(b), span_b - ps);
    EXPECT_EQ(vmlck() - base, locker.locked_bytes());
    // Unlocking a leaves the shared page locked for b.
    const uint64_t freed = *locker.unlock(a, false);
    EXPECT_EQ(freed, cost_a - ps);
    EXPECT_EQ(locker.locked_bytes(), span_b);
    EXPECT_EQ(vmlck() - base, span_b);
    // The shared page is b's now: locking a again costs it nothing.
    EXPECT_EQ(locker.cost(a), cost_a - ps);
    EXPECT_EQ(*locker.unlock(b, false), span_b);
    EXPECT_EQ(locker.locked_bytes(), 0u);
    EXPECT_EQ(vmlck(), base);
}

TEST(PageLocker, AFailedLockLeavesNothingLocked) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root";
    test::TempDir dir;
    test::write_model(test::small_spec(), dir.file("m.gguf"));
    auto model = MappedModel::open(dir.file("m.gguf"));
    ASSERT_TRUE(model) << model.error().what();
    PageLocker locker(**model);
    const uint64_t base = vmlck();
    // A range past the end of the mapping cannot be locked: an error, and nothing stays locked.
    const uint64_t size = (*model)->files()[0].identity.size;
    auto r = locker.lock({0, size - 100, 1ull << 20});
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("past the end"), std::string::npos) << r.error().message;
    EXPECT_EQ(locker.locked_bytes(), 0u);
    EXPECT_EQ(vmlck(), base);
}

}  // namespace
}  // namespace moecache::daemon
