// Builds GGUF files byte by byte for tests: a valid description by default, with every field a
// test may want to break exposed (counts, versions, types, offsets, alignment). Fixtures are made
// at run time from a description, never kept as binary files.
#pragma once

#include "moecache/gguf.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecache::test {

// The GGUF value type code of t, for GgufKvDesc::type.
constexpr uint32_t code(GgufValueType t) { return static_cast<uint32_t>(t); }

struct GgufKvDesc {
    std::string key;
    uint32_t type;        // GGUF value type code
    std::string payload;  // the encoded value, after the type code
};

struct GgufTensorDesc {
    std::string name;
    std::vector<int64_t> ne;
    uint32_t type = 0;                // ggml type id (0 = F32)
    std::optional<uint64_t> offset;   // default: packed in order, aligned
    std::optional<uint32_t> n_dims;   // default: ne.size()
};

struct GgufDesc {
    std::string magic = "GGUF";
    uint32_t version = 3;
    std::optional<uint64_t> n_tensors;  // default: tensors.size()
    std::optional<uint64_t> n_kv;       // default: kvs.size()
    std::vector<GgufKvDesc> kvs;
    std::vector<GgufTensorDesc> tensors;
    uint64_t alignment = 32;            // used for layout; add a general.alignment kv to declare it
    std::optional<uint64_t> data_bytes; // default: exactly what the tensors need
    uint8_t fill = 0;                   // byte value of tensor data

    // Encoders for KV payloads.
    static std::string u32(uint32_t v);
    static std::string u64(uint64_t v);
    static std::string i32(int32_t v);
    static std::string f32(float v);
    static std::string str(const std::string& s);  // u64 length + bytes
    static std::string str_array(const std::vector<std::string>& v);
    static std::string u32_array(const std::vector<uint32_t>& v);
    static std::string u8(uint8_t v);
    static std::string i8(int8_t v);
    static std::string u16(uint16_t v);
    static std::string i16(int16_t v);
    static std::string i64(int64_t v);
    static std::string f64(double v);
    static std::string boolean(bool v);
    // An array payload with any element type and count, which need not match `elements` (the
    // raw bytes that follow the count): for arrays that lie about their size.
    static std::string array(uint32_t element_type, uint64_t count,
                             const std::string& elements = {});

    GgufDesc& add_u32(std::string key, uint32_t v);
    GgufDesc& add_u64(std::string key, uint64_t v);
    GgufDesc& add_str(std::string key, const std::string& v);
    GgufDesc& add_kv(std::string key, uint32_t type, std::string payload);
    // Replaces the type and payload of `key` where it exists (keeping its place), else adds it.
    GgufDesc& set_kv(const std::string& key, uint32_t type, std::string payload);
    GgufDesc& add_tensor(std::string name, std::vector<int64_t> ne, uint32_t type = 0);

    // The whole file.
    [[nodiscard]] std::string bytes() const;
    // Where the header (metadata and tensor directory) ends and the padding before data begins.
    [[nodiscard]] uint64_t header_end() const;

    // Where things land in bytes(), for tests that patch the file or check reported offsets.
    [[nodiscard]] uint64_t kv_offset(size_t i) const;        // kv i: its key length
    [[nodiscard]] uint64_t kv_value_offset(size_t i) const;  // kv i: its payload, after the type
    [[nodiscard]] uint64_t tensor_info_offset(size_t i) const;  // directory entry i: its name
    [[nodiscard]] uint64_t tensor_dims_offset(size_t i) const;  // directory entry i: its n_dims
    [[nodiscard]] uint64_t tensor_type_offset(size_t i) const;  // directory entry i: its type
    [[nodiscard]] uint64_t data_offset() const;  // header_end() rounded up to `alignment`
    // Tensor i's offset in the data section as written: `offset` when set; otherwise tensors
    // without one are packed in order, each aligned (an override never moves the others).
    [[nodiscard]] uint64_t tensor_data_offset(size_t i) const;
    // Tensor i's data size from its type and shape; 0 when the type or shape is invalid.
    [[nodiscard]] uint64_t tensor_nbytes(size_t i) const;
    // The data section length written by bytes(): `data_bytes`, else the end of the furthest
    // tensor. Set data_bytes when a test places a tensor at a huge offset.
    [[nodiscard]] uint64_t data_section_bytes() const;
};

// Overwrites little-endian integers in a file image, for fields GgufDesc cannot express.
void patch_u32(std::string& bytes, uint64_t at, uint32_t v);
void patch_u64(std::string& bytes, uint64_t at, uint64_t v);

// `whole` cut into a split set as llama.cpp's gguf-split writes it: the tensors in n_parts
// contiguous runs, the metadata in part 0 only (general.alignment in all), and in every part
// split.no (u16), split.count (u16) and split.tensors.count (i32). Write part i to
// split_path(prefix, i, n_parts).
std::vector<GgufDesc> split_set(const GgufDesc& whole, uint32_t n_parts);

// A small, valid MoE model description (architecture "qwen3moe"), for tests to start from.
GgufDesc tiny_moe(uint32_t n_layers = 2, uint32_t n_experts = 4, uint32_t n_used = 2,
                  int64_t n_embd = 32, int64_t n_ff = 32, uint32_t expert_type = 0);

}  // namespace moecache::test
