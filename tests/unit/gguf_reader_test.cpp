// The GGUF reader on valid files built at run time: what it reports must match what the builder
// wrote, byte for byte.
#include "gguf_builder.h"
#include "temp_dir.h"

#include "moecache/ggml_type.h"
#include "moecache/gguf.h"
#include "moecache/model.h"

#include <gtest/gtest.h>

#include <cstring>

namespace moecache::test {
namespace {

// Writes desc to dir/name and reads it back.
Result<GgufFile> write_and_read(const TempDir& dir, const GgufDesc& desc,
                                const std::string& name = "model.gguf") {
    write_file(dir.file(name), desc.bytes());
    return read_gguf(dir.file(name));
}

template <typename T>
T load_at(const std::string& bytes, uint64_t offset) {
    T v{};
    std::memcpy(&v, bytes.data() + offset, sizeof v);
    return v;
}

TEST(GgufReader, AcceptsVersions2And3) {
    // v2 and v3 share the layout (64-bit counts); v3 only allowed big-endian files.
    for (uint32_t version : {2u, 3u}) {
        SCOPED_TRACE(version);
        TempDir dir;
        GgufDesc desc = tiny_moe();
        desc.version = version;
        const auto f = write_and_read(dir, desc);
        ASSERT_TRUE(f) << f.error().what();
        EXPECT_EQ(f->version, version);
        EXPECT_EQ(f->kvs.size(), desc.kvs.size());
        EXPECT_EQ(f->tensors.size(), desc.tensors.size());
        EXPECT_EQ(f->file_size, desc.bytes().size());
    }
}

TEST(GgufReader, ReadsEveryScalarType) {
    using T = GgufValueType;
    GgufDesc desc;
    desc.add_kv("u8", code(T::U8), GgufDesc::u8(200))
        .add_kv("i8", code(T::I8), GgufDesc::i8(-100))
        .add_kv("u16", code(T::U16), GgufDesc::u16(60000))
        .add_kv("i16", code(T::I16), GgufDesc::i16(-30000))
        .add_kv("u32", code(T::U32), GgufDesc::u32(4000000000u))
        .add_kv("i32", code(T::I32), GgufDesc::i32(-2000000000))
        .add_kv("f32", code(T::F32), GgufDesc::f32(1.5f))
        .add_kv("bool", code(T::Bool), GgufDesc::boolean(true))
        .add_kv("string", code(T::String), GgufDesc::str("qwen3moe"))
        .add_kv("u64", code(T::U64), GgufDesc::u64(uint64_t{1} << 63))
        .add_kv("i64", code(T::I64), GgufDesc::i64(-(int64_t{1} << 62)))
        .add_kv("f64", code(T::F64), GgufDesc::f64(-0.25));
    TempDir dir;
    const auto f = write_and_read(dir, desc);
    ASSERT_TRUE(f) << f.error().what();
    ASSERT_EQ(f->kvs.size(), desc.kvs.size());
    for (size_t i = 0; i < desc.kvs.size(); ++i) {
        EXPECT_EQ(f->kvs[i].key, desc.kvs[i].key);
        EXPECT_EQ(code(f->kvs[i].type), desc.kvs[i].type) << desc.kvs[i].key;
        EXPECT_EQ(f->kvs[i].offset, desc.kv_offset(i)) << desc.kvs[i].key;
    }
    // Integers are widened by signedness; floats become double.
    EXPECT_EQ(std::get<uint64_t>(f->find("u8")->value), 200u);
    EXPECT_EQ(std::get<int64_t>(f->find("i8")->value), -100);
    EXPECT_EQ(std::get<uint64_t>(f->find("u16")->value), 60000u);
    EXPECT_EQ(std::get<int64_t>(f->find("i16")->value), -30000);
    EXPECT_EQ(std::get<uint64_t>(f->find("u32")->value), 4000000000u);
    EXPECT_EQ(std::get<int64_t>(f->find("i32")->value), -2000000000);
    EXPECT_EQ(std::get<double>(f->find("f32")->value), 1.5);
    EXPECT_EQ(std::get<bool>(f->find("bool")->value), true);
    EXPECT_EQ(*f->find("string")->as_string(), "qwen3moe");
    EXPECT_EQ(std::get<uint64_t>(f->find("u64")->value), uint64_t{1} << 63);
    EXPECT_EQ(std::get<int64_t>(f->find("i64")->value), -(int64_t{1} << 62));
    EXPECT_EQ(std::get<double>(f->find("f64")->value), -0.25);
    // as_uint accepts any non-negative integer and nothing else.
    EXPECT_EQ(f->find("i8")->as_uint(), std::nullopt);
    EXPECT_EQ(f->find("u16")->as_uint(), 60000u);
}

TEST(GgufReader, KeepsArraysOnDiskAsReferences) {
    using T = GgufValueType;
    GgufDesc desc;
    desc.add_kv("numbers", code(T::Array), GgufDesc::u32_array({7, 8, 9}))
        .add_kv("words", code(T::Array), GgufDesc::str_array({"ab", "cde"}))
        .add_kv("empty", code(T::Array), GgufDesc::array(code(T::I64), 0))
        .add_u32("after", 42);  // read correctly only if the arrays were skipped exactly
    TempDir dir;
    const auto f = write_and_read(dir, desc);
    ASSERT_TRUE(f) << f.error().what();
    const std::string bytes = desc.bytes();

    const auto& numbers = std::get<GgufArrayRef>(f->find("numbers")->value);
    EXPECT_EQ(numbers.element_type, T::U32);
    EXPECT_EQ(numbers.count, 3u);
    EXPECT_EQ(numbers.offset, desc.kv_value_offset(0) + 4 + 8);  // after element type and count
    EXPECT_EQ(load_at<uint32_t>(bytes, numbers.offset), 7u);
    EXPECT_EQ(load_at<uint32_t>(bytes, numbers.offset + 8), 9u);

    const auto& words = std::get<GgufArrayRef>(f->find("words")->value);
    EXPECT_EQ(words.element_type, T::String);
    EXPECT_EQ(words.count, 2u);
    EXPECT_EQ(load_at<uint64_t>(bytes, words.offset), 2u);  // the length of "ab"
    EXPECT_EQ(bytes.substr(words.offset + 8, 2), "ab");

    const auto& empty = std::get<GgufArrayRef>(f->find("empty")->value);
    EXPECT_EQ(empty.element_type, T::I64);
    EXPECT_EQ(empty.count, 0u);
    EXPECT_EQ(f->get_uint("after").value_or(0), 42u);
}

TEST(GgufReader, DefaultAlignmentIs32) {
    GgufDesc desc = tiny_moe();
    TempDir dir;
    const auto f = write_and_read(dir, desc);
    ASSERT_TRUE(f) << f.error().what();
    EXPECT_EQ(f->alignment, 32u);
    EXPECT_EQ(f->data_offset, desc.data_offset());
    EXPECT_EQ(f->data_offset % 32, 0u);
}

TEST(GgufReader, HonoursGeneralAlignment) {
    GgufDesc desc;
    desc.alignment = 64;
    desc.add_u32("general.alignment", 64);
    desc.add_tensor("a", {3}).add_tensor("b", {5});  // 12 bytes: b starts at the next 64
    TempDir dir;
    const auto f = write_and_read(dir, desc);
    ASSERT_TRUE(f) << f.error().what();
    EXPECT_EQ(f->alignment, 64u);
    EXPECT_EQ(f->data_offset % 64, 0u);
    EXPECT_GE(f->data_offset, desc.header_end());
    EXPECT_LT(f->data_offset, desc.header_end() + 64);
    ASSERT_EQ(f->tensors.size(), 2u);
    EXPECT_EQ(f->tensors[1].data_offset, 64u);
    EXPECT_EQ(f->tensors[1].file_offset, f->data_offset + 64);
}

TEST(GgufReader, TensorGeometryFollowsGgmlBlocks) {
    // Block geometry from ggml-common.h's block structs, written out here independently of
    // ggml_type.cpp so that a wrong table entry shows up.
    struct Expected {
        uint32_t type;
        uint64_t block_elements, block_bytes;
    };
    const Expected types[] = {
        {ggml::F32, 1, 4},        {ggml::F16, 1, 2}, {ggml::Q8_0, 32, 34},  // f16 scale + 32 int8
        {ggml::Q4_K, 256, 144},                                             // 2 f16 + 12 scale bytes + 128 nibble bytes
        {ggml::IQ2_XXS, 256, 66},                                           // f16 + 64 bytes of grid indices
        {ggml::MXFP4, 32, 17},                                              // e8m0 scale + 16 nibble bytes
        {ggml::NVFP4, 64, 36},                                              // 4 ue4m3 scales + 32 nibble bytes
        {ggml::Q2_0, 64, 18},                                               // f16 scale + 16 bytes of 2-bit quants
    };
    GgufDesc desc;
    for (const auto& e : types)
        desc.add_tensor(fmt::format("t{}", e.type),
                        {static_cast<int64_t>(2 * e.block_elements), 3, 2, 5}, e.type);
    TempDir dir;
    const auto f = write_and_read(dir, desc);
    ASSERT_TRUE(f) << f.error().what();
    ASSERT_EQ(f->tensors.size(), std::size(types));
    for (size_t i = 0; i < std::size(types); ++i) {
        const auto& t = f->tensors[i];
        const auto& e = types[i];
        SCOPED_TRACE(t.name);
        const uint64_t row = 2 * e.block_bytes;
        EXPECT_EQ(t.type.id, e.type);
        EXPECT_EQ(t.n_dims, 4u);
        EXPECT_EQ(t.nb[0], e.block_bytes);
        EXPECT_EQ(t.nb[1], row);
        EXPECT_EQ(t.nb[2], row * 3);
        EXPECT_EQ(t.nb[3], row * 3 * 2);
        EXPECT_EQ(t.nbytes, row * 3 * 2 * 5);
        EXPECT_EQ(t.data_offset, desc.tensor_data_offset(i));
        EXPECT_EQ(t.file_offset, f->data_offset + desc.tensor_data_offset(i));
        EXPECT_EQ(t.info_offset, desc.tensor_info_offset(i));
    }
}

// A type this build does not know (a newer ggml's): the file opens, the tensor keeps its id, and
// its bytes are the span to the next tensor's data (to the end of the file for the last one).
TEST(GgufReader, ATensorOfANewerTypeOpensSpanningToTheNextTensor) {
    GgufDesc desc = tiny_moe();
    std::vector<uint64_t> at;
    for (size_t i = 0; i < desc.tensors.size(); ++i) at.push_back(desc.tensor_data_offset(i));
    const uint64_t data = desc.data_section_bytes();
    for (size_t i = 0; i < desc.tensors.size(); ++i) desc.tensors[i].offset = at[i];
    desc.data_bytes = data;
    const size_t mid = 1, last = desc.tensors.size() - 1;
    desc.tensors[mid].type = 1000;
    desc.tensors[last].type = 43;
    TempDir dir;
    const auto f = write_and_read(dir, desc);
    ASSERT_TRUE(f) << f.error().what();
    const auto& t = f->tensors[mid];
    EXPECT_EQ(t.type.id, 1000u);
    EXPECT_FALSE(ggml_type_known(t.type));
    EXPECT_EQ(t.nbytes, at[mid + 1] - at[mid]);
    EXPECT_EQ(t.nb[0], 0u) << "no strides for a geometry it does not know";
    EXPECT_EQ(f->tensors[last].nbytes, data - at[last]);
    EXPECT_TRUE(ggml_type_known(f->tensors[0].type));
}

TEST(GgufReader, SplitSetOpensTheSameFromAnyPart) {
    const GgufDesc whole = tiny_moe();
    const auto parts = split_set(whole, 3);
    TempDir dir;
    const std::string prefix = dir.file("model");
    for (uint32_t i = 0; i < 3; ++i) write_file(split_path(prefix, i, 3), parts[i].bytes());

    const auto from_first = open_gguf_model(split_path(prefix, 0, 3));
    const auto from_last = open_gguf_model(split_path(prefix, 2, 3));
    ASSERT_TRUE(from_first) << from_first.error().what();
    ASSERT_TRUE(from_last) << from_last.error().what();
    ASSERT_EQ(from_first->size(), 3u);
    ASSERT_EQ(from_last->size(), 3u);
    std::vector<std::string> names_first, names_last, names_whole;
    for (uint32_t i = 0; i < 3; ++i) {
        EXPECT_EQ((*from_first)[i].path, split_path(prefix, i, 3));
        EXPECT_EQ((*from_last)[i].path, split_path(prefix, i, 3));
        for (const auto& t : (*from_first)[i].tensors) names_first.push_back(t.name);
        for (const auto& t : (*from_last)[i].tensors) names_last.push_back(t.name);
    }
    for (const auto& t : whole.tensors) names_whole.push_back(t.name);
    EXPECT_EQ(names_first, names_whole);
    EXPECT_EQ(names_last, names_whole);
}

TEST(GgufReader, UnsplitFileOpensAsOnePart) {
    TempDir dir;
    write_file(dir.file("model.gguf"), tiny_moe().bytes());
    const auto parts = open_gguf_model(dir.file("model.gguf"));
    ASSERT_TRUE(parts) << parts.error().what();
    EXPECT_EQ(parts->size(), 1u);
}

}  // namespace
}  // namespace moecache::test
