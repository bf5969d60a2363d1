// A GGUF reader for hostile files. It reads the header (metadata and tensor directory) of one
// file, checks every count, length, dimension, offset and alignment before use, and keeps memory
// bounded whatever the header claims: arrays stay on disk (only their type, count and offset are
// kept), strings are bounded by the bytes the file really has. Tensor data is never read.
#pragma once

#include "moecache/error.h"
#include "moecache/ggml_type.h"

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace moecache {

enum class GgufValueType : uint32_t {
    U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, Bool = 7,
    String = 8, Array = 9, U64 = 10, I64 = 11, F64 = 12,
};
std::string_view gguf_value_type_name(GgufValueType t);

struct GgufArrayRef {
    GgufValueType element_type;
    uint64_t count;
    uint64_t offset;  // file offset of the first element
};

struct GgufKv {
    std::string key;
    GgufValueType type;
    uint64_t offset;  // file offset of the key
    // Integers of every width are widened; Array keeps only where its elements are.
    std::variant<uint64_t, int64_t, double, bool, std::string, GgufArrayRef> value;

    [[nodiscard]] std::optional<uint64_t> as_uint() const;  // any non-negative integer
    [[nodiscard]] const std::string* as_string() const;
};

struct GgufTensor {
    std::string name;
    uint32_t n_dims = 0;
    std::array<int64_t, 4> ne{1, 1, 1, 1};  // elements per dimension, ne[0] innermost
    std::array<uint64_t, 4> nb{};           // byte strides, as ggml computes them
    // Its type; one this build does not know (a newer ggml's: ggml_type_known() false) has its id
    // only, no strides, and nbytes is the span up to the next tensor's data (or the file's end).
    GgmlTypeInfo type{};
    uint64_t data_offset = 0;  // relative to the file's data section, as stored
    uint64_t file_offset = 0;  // absolute position in the file
    uint64_t nbytes = 0;
    uint64_t info_offset = 0;  // where its directory entry starts, for messages
};

struct GgufFile {
    std::string path;
    uint32_t version = 0;
    uint64_t file_size = 0;
    uint64_t alignment = 32;
    uint64_t data_offset = 0;  // start of the data section
    std::vector<GgufKv> kvs;
    std::vector<GgufTensor> tensors;  // in directory order

    [[nodiscard]] const GgufKv* find(std::string_view key) const;
    [[nodiscard]] const GgufTensor* find_tensor(std::string_view name) const;
    // Typed getters: an error names the key, its actual type and the file.
    [[nodiscard]] Result<std::string> get_string(std::string_view key) const;
    [[nodiscard]] Result<uint64_t> get_uint(std::string_view key) const;
    [[nodiscard]] Result<std::optional<uint64_t>> get_uint_opt(std::string_view key) const;
};

struct GgufLimits {
    uint64_t max_key_bytes = 65535;         // GGUF's own limit
    uint64_t max_tensor_name_bytes = 255;   // ggml uses 63; some forks more
    uint64_t max_string_bytes = 64u << 20;  // a value string (chat templates are tens of KiB)
    uint64_t max_alignment = 1u << 24;
    // Counts and sizes from real models with wide margins, checked as they are read (before any
    // allocation or loop they would drive): the largest vocabularies are ~10^6 entries, a model's
    // metadata tens of MiB, its tensors a few thousand. A file past them is refused, named.
    uint64_t max_header_bytes = 256ull << 20;  // metadata + directory
    uint64_t max_kvs = 1u << 16;               // metadata entries (models have < 100)
    uint64_t max_tensors = 1u << 17;           // tensors of one file (DeepSeek-V3: ~1 100)
    uint64_t max_array_elements = 1u << 24;    // elements of one array (a vocabulary: ~10^5-10^6)
};

// Reads the header of the GGUF file at fd. `path` is used in messages only.
Result<GgufFile> read_gguf(int fd, std::string path, const GgufLimits& limits = {});
Result<GgufFile> read_gguf(const std::string& path, const GgufLimits& limits = {});

}  // namespace moecache
