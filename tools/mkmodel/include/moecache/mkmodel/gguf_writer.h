// Streaming GGUF writer: the header is laid out first, then every tensor's bytes are generated
// row by row into a fixed buffer and written, so a model of any size costs a few MiB of memory.
// Split sets follow llama.cpp's layout: NAME-0000i-of-0000N.gguf, all metadata in the first part,
// split.no / split.count / split.tensors.count in every part.
#pragma once

#include "moecache/error.h"
#include "moecache/ggml_type.h"

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace moecache::mkmodel {

// Fills n_rows whole rows starting at row `first_row` into out (n_rows * row_bytes bytes).
// Must be deterministic in (first_row, n_rows) so that any chunking gives the same file.
using RowFiller = std::function<void(uint64_t first_row, uint64_t n_rows, uint8_t* out)>;

struct TensorSpec {
    std::string name;
    GgmlTypeInfo type;
    std::vector<int64_t> ne;  // ne[0] innermost
    RowFiller fill;

    [[nodiscard]] uint64_t row_bytes() const;
    [[nodiscard]] uint64_t n_rows() const;
    [[nodiscard]] uint64_t nbytes() const { return row_bytes() * n_rows(); }
};

struct StringArray {
    std::vector<std::string> values;
};
struct U32Array {
    std::vector<uint32_t> values;
};
struct I32Array {
    std::vector<int32_t> values;
};
struct F32Array {
    std::vector<float> values;
};
struct U16 {
    uint16_t v;
};
struct I32 {
    int32_t v;
};
using KvValue = std::variant<uint32_t, I32, U16, uint64_t, float, bool, std::string, StringArray,
                             U32Array, I32Array, F32Array>;

struct WriteOptions {
    uint32_t splits = 1;
    uint32_t alignment = 32;
    bool drop_cache = false;  // drop written pages from the page cache as writing goes on
};

struct WrittenFile {
    std::string path;
    uint64_t bytes = 0;
};

// `bytes` rounded up to a multiple of `alignment`: a tensor's room in the file.
[[nodiscard]] constexpr uint64_t padded(uint64_t bytes, uint32_t alignment) {
    return (bytes + alignment - 1) / alignment * alignment;
}

class GgufWriter {
public:
    void add(std::string key, KvValue value) { kvs_.emplace_back(std::move(key), std::move(value)); }
    void add_tensor(TensorSpec t) { tensors_.push_back(std::move(t)); }

    // `path` ends in .gguf; with splits > 1 it is the prefix of the NAME-0000i-of-0000N.gguf names.
    Result<std::vector<WrittenFile>> write(const std::string& path, const WriteOptions& opt);
    // The tensors' bytes as write() lays them out (each padded to the alignment), headers aside:
    // what a file would weigh, without writing it (moecache-mkmodel --dry-run).
    [[nodiscard]] uint64_t tensor_bytes(uint32_t alignment) const {
        uint64_t b = 0;
        for (const auto& t : tensors_) b += padded(t.nbytes(), alignment);
        return b;
    }

private:
    std::vector<std::pair<std::string, KvValue>> kvs_;
    std::vector<TensorSpec> tensors_;
};

}  // namespace moecache::mkmodel
