// ollama's names for its blobs, from manifests laid out as ollama writes them, and from hostile ones.
#include "temp_dir.h"

#include "moecache/ollama.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace moecache {
namespace {

const std::string kHex = "a3f1c0ffee00112233445566778899aabbccddeeff00112233445566778899aa";

std::string manifest(const std::string& model_digest) {
    return R"({"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",
"config":{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"sha256:0000","size":1},
"layers":[{"mediaType":"application/vnd.ollama.image.template","digest":"sha256:1111","size":2},
{"mediaType":"application/vnd.ollama.image.model","digest":")" + model_digest + R"(","size":3}]})";
}

class Ollama : public testing::Test {
protected:
    void SetUp() override {
        namespace fs = std::filesystem;
        fs::create_directories(dir_.file("models/blobs"));
        blob_ = dir_.file("models/blobs/sha256-" + kHex);
        test::write_file(blob_, "GGUF");
    }
    void add(const std::string& rel, const std::string& text) {
        const auto path = std::filesystem::path(dir_.file("models/manifests")) / rel;
        std::filesystem::create_directories(path.parent_path());
        test::write_file(path.string(), text);
    }
    test::TempDir dir_;
    std::string blob_;
};

TEST_F(Ollama, ABlobIsNamedByEveryTagThatHoldsItAsItsModel) {
    add("registry.ollama.ai/library/qwen3/30b-a3b", manifest("sha256:" + kHex));
    add("registry.ollama.ai/library/qwen3/latest", manifest("sha256:" + kHex));
    add("registry.ollama.ai/someone/kimi/q2", manifest("sha256:" + kHex));
    add("hf.co/unsloth/Qwen3-GGUF/Q4_K_M", manifest("sha256:" + kHex));
    add("registry.ollama.ai/library/other/latest", manifest("sha256:ffff"));
    EXPECT_EQ(ollama_tags(blob_), "hf.co/unsloth/Qwen3-GGUF:Q4_K_M,qwen3:30b-a3b,qwen3:latest,someone/kimi:q2");
}

TEST_F(Ollama, NothingForWhatIsNotANamedBlob) {
    EXPECT_EQ(ollama_tags(blob_), std::nullopt) << "no manifests folder";
    add("registry.ollama.ai/library/other/latest", manifest("sha256:ffff"));
    EXPECT_EQ(ollama_tags(blob_), std::nullopt) << "no manifest names it";
    EXPECT_EQ(ollama_tags(dir_.file("models/model.gguf")), std::nullopt);
    EXPECT_EQ(ollama_tags(dir_.file("models/blobs/sha256-NOTHEX")), std::nullopt);
    EXPECT_EQ(ollama_tags(dir_.file("elsewhere/sha256-" + kHex)), std::nullopt) << "not in a blobs folder";
}

TEST_F(Ollama, HostileManifestsAreSkipped) {
    add("registry.ollama.ai/library/garbage/1", "{not json");
    add("registry.ollama.ai/library/types/1", R"({"layers":[1,"x",{"mediaType":7,"digest":["sha256:)" + kHex + R"("]}]})");
    add("registry.ollama.ai/library/layers/1", R"({"layers":{"mediaType":"application/vnd.ollama.image.model"}})");
    add("registry.ollama.ai/library/array/1", "[]");
    add("registry.ollama.ai/library/huge/1", std::string(2u << 20, ' ') + manifest("sha256:" + kHex));
    std::filesystem::create_directories(dir_.file("models/manifests/registry.ollama.ai/library/dir/only"));
    add("registry.ollama.ai/library/good/1", manifest("sha256:" + kHex));
    EXPECT_EQ(ollama_tags(blob_), "good:1");
}

}  // namespace
}  // namespace moecache
