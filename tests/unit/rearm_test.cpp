// The re-armer's plan: one page per expert, inside the expert's first slice and in a shared
// mapping only, placed so that the expert owns most of the kernel's fault-around window; its
// pace (a round per period, at most a rate of pages a second, in slices); and a slice of a round
// unmapping exactly its pages from a real mapping.
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/client/rearm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>


namespace moecache::client {
namespace {

class RearmPlan : public testing::Test {
protected:
    void SetUp() override {
        auto files = test::write_model(test::small_spec(), dir_.file("m.gguf"));
        auto m = load_expert_map(files.front());
        ASSERT_TRUE(m) << m.error().what();
        map_ = std::move(*m);
    }
    // The whole file mapped at a page-aligned (not window-aligned) address.
    [[nodiscard]] std::vector<std::vector<FileMapping>> mapped(const std::string& perms, uintptr_t base = 0x7f0000001000) const {
        return {{FileMapping{base, base + ((map_.files[0].size + 4095) & ~uint64_t{4095}), 0, perms}}};
    }
    test::TempDir dir_;
    ExpertMap map_;
};

TEST_F(RearmPlan, OnePagePerExpertInsideItsFirstSliceOwningMostOfItsWindow) {
    const auto mappings = mapped("r--s");
    const auto r = ExpertRearmer::plan(map_, mappings);
    ASSERT_EQ(r.pages(), map_.layers.size() * map_.n_experts);
    const uintptr_t base = mappings[0][0].start;
    for (const auto& p : r.planned()) {
        EXPECT_EQ(p.address % 4096, 0u);
        const auto ref = map_.lookup(0, p.address - base);
        ASSERT_TRUE(ref.has_value());
        EXPECT_EQ(ref->layer, p.expert.layer);
        EXPECT_EQ(ref->expert, p.expert.expert);
        // The 64 KiB-aligned window around the page: the expert owns more of it than any other.
        const uintptr_t w = p.address & ~(ExpertRearmer::kFaultAroundBytes - 1);
        std::map<std::pair<uint32_t, uint32_t>, uint64_t> owners;
        map_.for_each_overlap(0, w - base, w - base + ExpertRearmer::kFaultAroundBytes,
                              [&](ExpertRef e, uint64_t bytes) { owners[{e.layer, e.expert}] += bytes; });
        const auto best = std::max_element(owners.begin(), owners.end(),
                                           [](const auto& a, const auto& b) { return a.second < b.second; });
        ASSERT_NE(best, owners.end());
        EXPECT_EQ(best->first, std::make_pair(p.expert.layer, p.expert.expert));
    }
}

TEST_F(RearmPlan, PrivateOrPartialMappingsAreLeftAlone) {
    // A private mapping: a page the runtime once wrote would be discarded by MADV_DONTNEED.
    EXPECT_EQ(ExpertRearmer::plan(map_, mapped("r--p")).pages(), 0u);
    EXPECT_EQ(ExpertRearmer::plan(map_, {}).pages(), 0u);
    // Only the first half of the file mapped: only experts whose first slice lies in it.
    auto half = mapped("r--s");
    half[0][0].end = half[0][0].start + map_.files[0].size / 2;
    const auto r = ExpertRearmer::plan(map_, half);
    EXPECT_GT(r.pages(), 0u);
    EXPECT_LT(r.pages(), map_.layers.size() * map_.n_experts);
    for (const auto& p : r.planned()) EXPECT_LT(p.address, half[0][0].end);
}

TEST(RearmPace, ARoundPerPeriodAtMostRatePagesASecondInSlices) {
    // The re-armer's defaults on a model of 1792 experts: 400 a second stretch the round to 4.48 s.
    auto p = RearmPace::of(1792, 1000, 400);
    EXPECT_EQ(p.round_ms, 4480u);
    EXPECT_GE(p.tick_ms, RearmPace::kTickMs);
    EXPECT_GE(p.per_tick * (p.round_ms / p.tick_ms), 1792u);  // every page once a round
    EXPECT_LE(p.per_tick * 1000 / p.tick_ms, 400u * 102 / 100);
    // Few experts: the period rules, still in slices of at least a tick.
    p = RearmPace::of(100, 1000, 400);
    EXPECT_EQ(p.round_ms, 1000u);
    EXPECT_EQ(p.tick_ms, 250u);
    EXPECT_EQ(p.per_tick, 25u);
    // No limit: the whole plan each period; a period under a tick is one slice.
    p = RearmPace::of(100000, 1000, 0);
    EXPECT_EQ(p.round_ms, 1000u);
    EXPECT_EQ(p.per_tick * 4, 100000u);
    p = RearmPace::of(500, 2, 400);
    EXPECT_EQ(p.round_ms, 1250u);
    p = RearmPace::of(500, 2, 0);
    EXPECT_EQ(p.round_ms, 2u);
    EXPECT_EQ(p.tick_ms, 2u);
    EXPECT_EQ(p.per_tick, 500u);
    // More ticks than pages: one page a slice.
    p = RearmPace::of(3, 10000, 0);
    EXPECT_EQ(p.per_tick, 1u);
    EXPECT_EQ(p.tick_ms, 3333u);
    p = RearmPace::of(0, 1000, 400);  // nothing planned: nothing to divide by zero
    EXPECT_EQ(p.per_tick, 0u);
    EXPECT_GT(p.tick_ms, 0u);
}

// Whether the page at `address` is mapped in this process (pagemap's present bit).
bool mapped_here(uintptr_t address) {
    const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    uint64_t entry = 0;
    const bool ok = ::pread(fd, &entry, sizeof entry, static_cast<off_t>(address / 4096 * 8)) == sizeof entry;
    ::close(fd);
    return ok && (entry >> 63) != 0;
}

TEST_F(RearmPlan, ASliceUnmapsItsPagesAndNothingElse) {
    const int fd = ::open(map_.files[0].path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    const size_t len = map_.files[0].size;
    void* base = ::mmap(nullptr, len, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    ::close(fd);
    ASSERT_NE(base, MAP_FAILED);
    const auto start = reinterpret_cast<uintptr_t>(base);
    auto r = ExpertRearmer::plan(map_, {{FileMapping{start, start + ((len + 4095) & ~uint64_t{4095}), 0, "r--s"}}});
    ASSERT_GE(r.pages(), 8u);
    auto touch = [](uintptr_t address) { (void)*reinterpret_cast<const volatile unsigned char*>(address); };
    // The first round asks for 4 KiB page-table entries; a large folio the kernel had mapped
    // with one PMD is unmapped whole by it. From then on a page is unmapped alone.
    EXPECT_EQ(r.rearm(), r.pages());
    for (const auto& p : r.planned()) EXPECT_FALSE(mapped_here(p.address));
    for (const auto& p : r.planned()) touch(p.address);
    for (const auto& p : r.planned()) ASSERT_TRUE(mapped_here(p.address)) << "a read maps the page back";

    EXPECT_EQ(r.rearm(2, 3), 3u);
    for (size_t i = 0; i < r.pages(); ++i)
        EXPECT_EQ(mapped_here(r.planned()[i].address), i < 2 || i >= 5) << "planned page " << i;
    // A slice past the end is clamped; one wholly past it does nothing.
    EXPECT_EQ(r.rearm(r.pages() - 1, 100), 1u);
    EXPECT_FALSE(mapped_here(r.planned().back().address));
    EXPECT_EQ(r.rearm(r.pages(), 10), 0u);
    touch(r.planned()[2].address);
    EXPECT_TRUE(mapped_here(r.planned()[2].address));
    EXPECT_FALSE(r.refused());
    ::munmap(base, len);
}

}  // namespace
}  // namespace moecache::client
