// The copy classifier: a host-to-device copy out of a model mapping is decoded into the experts it
// carries exactly when it is whole, consecutive slices of one expert tensor with at most 512 bytes
// of padding — llama.cpp's grouped copies — and into nothing otherwise.
#include "model_fixture.h"
#include "temp_dir.h"

#include "moecache/cuda/copy_classifier.h"

#include <gtest/gtest.h>

#include <random>

namespace moecache::cuda {
namespace {

class CopyClassifierTest : public testing::Test {
protected:
    void SetUp() override {
        auto files = test::write_model(test::small_spec(), dir_.file("m.gguf"), 2);
        auto m = load_expert_map(files.front());
        ASSERT_TRUE(m) << m.error().what();
        map_ = std::move(*m);
        // Each part mapped whole at its own (fake: nothing is dereferenced) address.
        for (uint32_t f = 0; f < map_.files.size(); ++f) {
            base_.push_back(0x7f0000000000ull + f * 0x100000000ull);
            c_.add_mapping(7, &map_, f, base_[f], map_.files[f].size, 0);
        }
    }
    [[nodiscard]] const void* at(uint32_t file, uint64_t offset) const {
        return reinterpret_cast<const void*>(base_[file] + offset);
    }
    test::TempDir dir_;
    ExpertMap map_;
    std::vector<uintptr_t> base_;
    CopyClassifier c_;
};

TEST_F(CopyClassifierTest, GroupedCopiesOfConsecutiveExpertsAreDecoded) {
    std::mt19937_64 rng(3);
    size_t checked = 0;
    for (const auto& layer : map_.layers) {
        for (const auto& t : layer.tensors) {
            for (int i = 0; i < 50; ++i) {
                const uint32_t first = static_cast<uint32_t>(rng() % map_.n_experts);
                const uint32_t n = 1 + static_cast<uint32_t>(rng() % (map_.n_experts - first));
                const uint64_t pad = rng() % 2 ? 0 : rng() % (kMaxCopyPadding + 1);
                const auto got = c_.classify(at(t.file, t.offset + first * t.bytes_per_expert), n * t.bytes_per_expert + pad);
                ASSERT_TRUE(got.has_value()) << t.name << " experts " << first << "+" << n << " pad " << pad;
                EXPECT_EQ(got->model, 7u);
                EXPECT_EQ(got->block, layer.index);
                EXPECT_EQ(got->first_expert, first);
                EXPECT_EQ(got->n_experts, n);
                EXPECT_EQ(got->padding, pad);
                ++checked;
            }
        }
    }
    EXPECT_GT(checked, 100u);
}

TEST_F(CopyClassifierTest, AnythingElseIsNotAnExpertCopy) {
    const auto& t = map_.layers[1].tensors[0];
    const uint64_t slice = t.bytes_per_expert;
    EXPECT_FALSE(c_.classify(at(t.file, t.offset + 3 * slice), slice + kMaxCopyPadding + 1)) << "too much padding";
    EXPECT_FALSE(c_.classify(at(t.file, t.offset + 3 * slice + 64), slice)) << "not at a slice's start";
    EXPECT_FALSE(c_.classify(at(t.file, t.offset + 3 * slice), slice / 2)) << "part of a slice";
    EXPECT_FALSE(c_.classify(at(t.file, t.offset + (map_.n_experts - 1) * slice), 2 * slice)) << "past the tensor";
    EXPECT_FALSE(c_.classify(at(0, 0), 4096)) << "the header";
    EXPECT_FALSE(c_.classify(reinterpret_cast<const void*>(0x1000), slice)) << "not a model mapping";
    EXPECT_FALSE(c_.classify(at(t.file, t.offset), 0));
    c_.remove_model(7);
    EXPECT_FALSE(c_.classify(at(t.file, t.offset), slice)) << "a removed model";
}

TEST_F(CopyClassifierTest, AMappingOfPartOfAFileIsReadByItsFileOffset) {
    CopyClassifier c;
    const auto& t = map_.layers[0].tensors[1];
    // Only the tensor's own bytes mapped, at an address of their own, as a runtime mapping a window.
    const uintptr_t base = 0x500000000000ull;
    c.add_mapping(1, &map_, t.file, base, t.bytes_per_expert * map_.n_experts, t.offset);
    const auto got = c.classify(reinterpret_cast<const void*>(base + 2 * t.bytes_per_expert), t.bytes_per_expert);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->first_expert, 2u);
    EXPECT_EQ(got->n_experts, 1u);
    // A later mapping of the same addresses replaces it.
    c.add_mapping(2, &map_, t.file, base, 4096, 0);
    EXPECT_FALSE(c.classify(reinterpret_cast<const void*>(base + 2 * t.bytes_per_expert), t.bytes_per_expert));
}

}  // namespace
}  // namespace moecache::cuda
