// Writes the fuzzer's seed corpus: valid tiny MoE files, and one file per class of damage the
// reader must reject (the classes of tests/unit/gguf_malformed_test.cpp), so that libFuzzer
// starts next to every check instead of having to find the format first.
// usage: moecache-make-seed-corpus DIR
#include "gguf_builder.h"
#include "temp_dir.h"

#include "moecache/ggml_type.h"
#include "moecache/gguf.h"
#include "moecache/model.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

using namespace moecache;
using namespace moecache::test;

namespace {

using T = GgufValueType;

// Small seeds keep the fuzzer fast: the reader never reads tensor data, so the data section
// only has to be there.
GgufDesc small_moe(uint32_t expert_type = ggml::F32, int64_t n_embd = 8) {
    return tiny_moe(2, 4, 2, n_embd, n_embd, expert_type);
}

// small_moe() with one change.
std::string moe(const std::function<void(GgufDesc&)>& change) {
    GgufDesc d = small_moe();
    change(d);
    return d.bytes();
}

// small_moe() with one more key.
std::string moe_with(const std::string& key, uint32_t type, const std::string& payload) {
    return moe([&](GgufDesc& d) { d.set_kv(key, type, payload); });
}

// small_moe() with its first layer tensor reshaped.
std::string moe_shape(std::vector<int64_t> ne, uint32_t type) {
    return moe([&](GgufDesc& d) {
        d.tensors[1].ne = ne;
        d.tensors[1].type = type;
    });
}

std::vector<std::pair<std::string, std::string>> seeds() {
    const auto arr = code(T::Array);
    const uint64_t neg1 = static_cast<uint64_t>(int64_t{-1});
    const uint64_t huge = uint64_t{1} << 40;
    const int64_t big31 = int64_t{1} << 31, big32 = int64_t{1} << 32;
    using D = GgufDesc;
    return {
        {"valid-f32", small_moe().bytes()},
        {"valid-q8_0", small_moe(ggml::Q8_0, 32).bytes()},
        {"valid-nvfp4", small_moe(ggml::NVFP4, 64).bytes()},
        {"valid-mxfp4-v2", moe([](GgufDesc& d) {
             d = small_moe(ggml::MXFP4, 32);
             d.version = 2;
         })},
        {"valid-align64-arrays", moe([&](GgufDesc& d) {
             d.alignment = 64;
             d.add_u32("general.alignment", 64)
                 .add_kv("tokenizer.ggml.tokens", arr, D::str_array({"a", "bc"}))
                 .add_kv("tokenizer.ggml.scores", arr, D::array(code(T::F32), 1, D::f32(0)))
                 .add_kv("general.flag", code(T::Bool), D::boolean(true))
                 .add_kv("general.f64", code(T::F64), D::f64(1.0));
         })},
        {"valid-split-part", split_set(small_moe(), 2)[0].bytes()},
        {"bad-magic", moe([](GgufDesc& d) { d.magic = "GGJT"; })},
        {"version-0", moe([](GgufDesc& d) { d.version = 0; })},
        {"version-1", moe([](GgufDesc& d) { d.version = 1; })},
        {"version-4", moe([](GgufDesc& d) { d.version = 4; })},
        {"version-byte-swapped", moe([](GgufDesc& d) { d.version = 0x03000000; })},
        {"n-tensors-negative", moe([&](GgufDesc& d) { d.n_tensors = neg1; })},
        {"n-tensors-huge", moe([&](GgufDesc& d) { d.n_tensors = huge; })},
        {"n-kv-negative", moe([&](GgufDesc& d) { d.n_kv = neg1; })},
        {"n-kv-huge", moe([&](GgufDesc& d) { d.n_kv = huge; })},
        {"string-negative", moe_with("general.name", code(T::String), D::u64(neg1))},
        {"string-past-eof", moe_with("general.name", code(T::String), D::u64(huge))},
        {"key-empty", moe_with("", code(T::U32), D::u32(1))},
        {"key-duplicate", moe([](GgufDesc& d) { d.add_str("general.architecture", "llama"); })},
        {"value-type-unknown", moe_with("general.x", 13, D::u32(0))},
        {"array-nested", moe_with("general.x", arr, D::array(arr, 1, D::u32_array({1})))},
        {"array-element-type-unknown", moe_with("general.x", arr, D::array(13, 1, D::u32(0)))},
        {"array-past-eof", moe_with("general.x", arr, D::array(code(T::U32), huge))},
        {"array-strings-huge", moe_with("general.x", arr, D::array(code(T::String), huge))},
        {"alignment-0", moe_with("general.alignment", code(T::U32), D::u32(0))},
        {"alignment-48", moe_with("general.alignment", code(T::U32), D::u32(48))},
        {"alignment-huge", moe_with("general.alignment", code(T::U32), D::u32(1u << 30))},
        {"alignment-u64", moe_with("general.alignment", code(T::U64), D::u64(32))},
        {"tensor-duplicate", moe([](GgufDesc& d) { d.tensors[2].name = d.tensors[1].name; })},
        {"n-dims-5", moe([](GgufDesc& d) { d.tensors[1].n_dims = 5; })},
        {"n-dims-0", moe([](GgufDesc& d) { d.tensors[1].n_dims = 0; })},
        {"dim-zero", moe_shape({0, 4}, ggml::F32)},
        {"dim-negative", moe_shape({32, -4}, ggml::F32)},
        {"elements-overflow", moe_shape({big32, big32}, ggml::F32)},
        {"bytes-overflow", moe_shape({big31, big31}, ggml::F64)},
        {"row-not-whole-blocks", moe_shape({100, 2}, ggml::Q4_K)},
        {"tensor-type-retired", moe_shape({32}, 31)},
        // A newer ggml's type: the file opens, the tensor spanning to the next one's data.
        {"valid-tensor-type-newer", moe([](GgufDesc& d) {
             std::vector<uint64_t> at;
             for (size_t i = 0; i < d.tensors.size(); ++i) at.push_back(d.tensor_data_offset(i));
             const uint64_t bytes = d.data_section_bytes();
             for (size_t i = 0; i < d.tensors.size(); ++i) d.tensors[i].offset = at[i];
             d.data_bytes = bytes;
             d.tensors[1].type = 1000;
         })},
        {"offset-misaligned", moe([](GgufDesc& d) { d.tensors[2].offset = d.tensor_data_offset(2) + 4; })},
        {"offset-overlap", moe([](GgufDesc& d) { d.tensors[2].offset = d.tensor_data_offset(1); })},
        {"offset-past-eof", moe([](GgufDesc& d) {
             d.data_bytes = d.data_section_bytes();
             d.tensors.back().offset = uint64_t{1} << 30;
         })},
        {"data-truncated", moe([](GgufDesc& d) { d.data_bytes = d.data_section_bytes() - 1; })},
        {"expert-block-past-count", moe([](GgufDesc& d) {
             d.add_tensor("blk.4000000000.ffn_up_exps.weight", {8, 8, 4});
         })},
        {"expert-count-mismatch", moe_with("qwen3moe.expert_count", code(T::U32), D::u32(3))},
    };
}

// A seed must be what its name says, or the corpus no longer starts next to the check it names.
bool accepted(const std::string& path) {
    const auto f = read_gguf(path);
    return f && ExpertMap::build({*f});
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const std::string dir = argv[1];
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
        std::fprintf(stderr, "%s: cannot create: %s\n", dir.c_str(), std::strerror(errno));
        return 1;
    }
    try {
        const auto all = seeds();
        for (const auto& [name, bytes] : all) {
            const std::string path = dir + "/" + name + ".gguf";
            write_file(path, bytes);
            if (accepted(path) != name.starts_with("valid-")) {
                std::fprintf(stderr, "%s: the seed is %s by the reader\n", path.c_str(),
                             accepted(path) ? "accepted" : "rejected");
                return 1;
            }
        }
        std::printf("%zu seeds in %s\n", all.size(), dir.c_str());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: %s\n", dir.c_str(), e.what());
        return 1;
    }
    return 0;
}
