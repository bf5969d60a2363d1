// Builds GGUF files byte by byte for tests: a valid description by default, with every field a
// test may want to break exposed (counts, versions, types, offsets, alignment). Fixtures are made
// at run time from a description, never kept as binary files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecache::test {

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

    GgufDesc& add_u32(std::string key, uint32_t v);
    GgufDesc& add_u64(std::string key, uint64_t v);
    GgufDesc& add_str(std::string key, const std::string& v);
    GgufDesc& add_tensor(std::string name, std::vector<int64_t> ne, uint32_t type = 0);

    // The whole file.
    [[nodiscard]] std::string bytes() const;
    // Byte offset where the tensor directory entry of tensor i starts, etc., for patching.
    [[nodiscard]] uint64_t header_end() const;
};

// A small, valid MoE model description (architecture "qwen3moe"), for tests to start from.
GgufDesc tiny_moe(uint32_t n_layers = 2, uint32_t n_experts = 4, uint32_t n_used = 2,
                  int64_t n_embd = 32, int64_t n_ff = 32, uint32_t expert_type = 0);

}  // namespace moecache::test
