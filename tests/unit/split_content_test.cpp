// A split model is found from any part by its metadata, whatever the files are called: the blobs of
// a Hugging Face cache (snapshots/<rev>/NAME-0000i-of-0000N.gguf symlinks to blobs/<hash>) and of
// an ollama store (sha256-<hash>), opened from either name, in the reader, `moecachectl inspect`
// and (tests/gpu/hook_serving_test.cpp) the CUDA hook's model scan.
#include "model_fixture.h"
#include "run.h"
#include "temp_dir.h"

#include "moecache/model.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>

namespace moecache {
namespace {

namespace fs = std::filesystem;

class SplitByContent : public testing::Test {
protected:
    void SetUp() override {
        auto spec = test::small_spec();
        spec.n_layers = 6;
        fs::create_directories(dir_.file("gen"));
        named_ = test::write_model(spec, dir_.file("gen/model.gguf"), 3);
        ASSERT_EQ(named_.size(), 3u);
        auto m = load_expert_map(named_[0]);
        ASSERT_TRUE(m) << m.error().what();
        reference_ = std::move(*m);
    }
    // The map of the set opened from `path` matches the one opened by the generator's names.
    void expect_same_model(const std::string& path) {
        auto m = load_expert_map(path);
        ASSERT_TRUE(m) << path << ": " << m.error().what();
        ASSERT_EQ(m->files.size(), 3u);
        EXPECT_EQ(m->layers.size(), reference_.layers.size());
        EXPECT_EQ(m->expert_bytes_total, reference_.expert_bytes_total);
        for (size_t f = 0; f < 3; ++f) EXPECT_EQ(fs::file_size(m->files[f].path), reference_.files[f].size) << f;
    }
    test::TempDir dir_;
    std::vector<std::string> named_;
    ExpertMap reference_;
};

TEST_F(SplitByContent, AnOllamaStyleBlobSetOpensFromAnyPart) {
    fs::create_directories(dir_.file("blobs"));
    const char* names[] = {"sha256-c0ffee", "sha256-0a1b2c", "sha256-feed42"};  // no order in the names
    for (int i = 0; i < 3; ++i) fs::rename(named_[static_cast<size_t>(i)], dir_.file("blobs/") + names[i]);
    test::write_file(dir_.file("blobs/sha256-manifest"), "{\"not\": \"a model\"}");
    for (const char* n : names) expect_same_model(dir_.file("blobs/") + n);
    auto parts = open_gguf_model(dir_.file("blobs/sha256-feed42"));
    ASSERT_TRUE(parts);
    EXPECT_EQ((*parts)[0].path, dir_.file("blobs/sha256-c0ffee")) << "parts in split.no order";
}

TEST_F(SplitByContent, AHuggingFaceCacheOpensFromTheBlobOrTheSnapshot) {
    const std::string repo = dir_.file("models--org--model");
    fs::create_directories(repo + "/blobs");
    fs::create_directories(repo + "/snapshots/4f2e/q8");
    for (int i = 0; i < 3; ++i) {
        const std::string blob = repo + "/blobs/" + std::string(40, static_cast<char>('a' + i));
        fs::rename(named_[static_cast<size_t>(i)], blob);
        fs::create_symlink("../../../blobs/" + fs::path(blob).filename().string(),
                           repo + "/snapshots/4f2e/q8/" + fs::path(named_[static_cast<size_t>(i)]).filename().string());
    }
    expect_same_model(repo + "/snapshots/4f2e/q8/model-00002-of-00003.gguf");
    expect_same_model(repo + "/blobs/" + std::string(40, 'c'));
    // inspect names the set as it opened it.
    const auto r = test::run({MOECACHE_CTL_BIN, "inspect", repo + "/blobs/" + std::string(40, 'b'), "--json"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    ASSERT_EQ(j["files"].size(), 3u) << r.out;
}

TEST_F(SplitByContent, TwoFilesClaimingOnePartAreNamed) {
    fs::create_directories(dir_.file("store"));
    for (int i = 0; i < 3; ++i) fs::rename(named_[static_cast<size_t>(i)], dir_.file("store/blob") + std::to_string(i));
    fs::copy_file(dir_.file("store/blob1"), dir_.file("store/blob1-copy"));
    auto parts = open_gguf_model(dir_.file("store/blob0"));
    ASSERT_FALSE(parts);
    EXPECT_NE(parts.error().message.find("part 2 of 3 is ambiguous"), std::string::npos) << parts.error().message;
    EXPECT_NE(parts.error().message.find("blob1"), std::string::npos);
    // A hard link is the same file by another name: no ambiguity.
    fs::remove(dir_.file("store/blob1-copy"));
    fs::create_hard_link(dir_.file("store/blob1"), dir_.file("store/blob1-link"));
    EXPECT_TRUE(open_gguf_model(dir_.file("store/blob0")));
}

TEST_F(SplitByContent, AMissingPartIsNamedAndAFifoIsNeverOpenedForReading) {
    fs::create_directories(dir_.file("store"));
    fs::rename(named_[0], dir_.file("store/first"));
    fs::rename(named_[2], dir_.file("store/third"));
    ASSERT_EQ(mkfifo(dir_.file("store/a-fifo").c_str(), 0600), 0);
    auto opened = std::async(std::launch::async, [&] { return open_gguf_model(dir_.file("store/first")); });
    ASSERT_EQ(opened.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "blocked on the FIFO";
    auto parts = opened.get();
    ASSERT_FALSE(parts);
    EXPECT_NE(parts.error().message.find("part 2 is in none of"), std::string::npos) << parts.error().message;
    EXPECT_NE(parts.error().message.find(dir_.file("store")), std::string::npos);
}

}  // namespace
}  // namespace moecache
