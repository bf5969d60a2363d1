// The re-armer's plan: one page per expert, inside the expert's first slice and in a shared
// mapping only, placed so that the expert owns most of the kernel's fault-around window.
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/client/rearm.h"

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

}  // namespace
}  // namespace moecache::client
