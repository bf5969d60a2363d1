// A GGUF model as the runtime sees it: one file, or a split set opened from any one of its parts
// (found by name or by metadata), and the map of its routed experts.
#pragma once

#include "moecache/error.h"
#include "moecache/gguf.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moecache {

struct SplitName {
    std::string prefix;  // NAME of NAME-00002-of-00005.gguf
    uint32_t index = 0;  // 0-based (the 2 above is index 1)
    uint32_t count = 0;
};
std::optional<SplitName> parse_split_name(const std::string& path);
std::string split_path(const std::string& prefix, uint32_t index, uint32_t count);

// The paths of every part of the split set that `part` (read from `path`) belongs to, in order;
// just `path` for a model of one file. By name where the parts follow NAME-0000i-of-0000N.gguf
// (for a Hugging Face cache blob, the name a snapshots/ symlink gives it), else by content: the
// GGUF files beside it (where it is named and where it really lies) whose split.count and
// split.tensors.count match and whose split.no is the part wanted. Never opens anything but
// regular files for reading; two files claiming one part is an error naming both.
Result<std::vector<std::string>> find_split_parts(const std::string& path, const GgufFile& part);

// Opens every part of the model that `path` belongs to (any part; see find_split_parts), in order,
// and checks that they form one set: each part's split.no / split.count / split.tensors.count agree
// with the others, and no tensor name appears in two parts.
Result<std::vector<GgufFile>> open_gguf_model(const std::string& path);
// The same from descriptors (every part, part 1 first; `names` for messages): nothing is opened by
// name, so a name swapped meanwhile (a FIFO, a symlink to a file the caller may not read) cannot
// be what is read.
Result<std::vector<GgufFile>> open_gguf_model(const std::vector<int>& fds, const std::vector<std::string>& names);

// One expert tensor of a layer, e.g. blk.7.ffn_up_exps.weight: expert e is the byte slice
// [offset + e * bytes_per_expert, offset + (e + 1) * bytes_per_expert) of file `file`.
struct ExpertTensor {
    std::string name;
    uint32_t file = 0;
    uint64_t offset = 0;
    uint64_t bytes_per_expert = 0;
    GgmlTypeInfo type{};
};

struct MoeLayer {
    uint32_t index = 0;
    std::vector<ExpertTensor> tensors;
    uint64_t bytes_per_expert = 0;  // the sum over its expert tensors
    uint64_t shared_expert_bytes = 0;
    [[nodiscard]] uint64_t expert_bytes(uint32_t n_experts) const { return bytes_per_expert * n_experts; }
};

struct ByteRange {
    uint32_t file = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
};

struct ExpertRef {
    uint32_t layer = 0;  // block index (blk.N)
    uint32_t expert = 0;
};

// Where a byte of a file lies in the expert tensors: expert `expert` of block `layer`, at
// `slice_offset` into that expert's slice of one tensor, whose slices are `slice_bytes` long and
// whose last byte is just before file offset `tensor_end`.
struct ExpertPosition {
    uint32_t layer = 0;  // block index (blk.N)
    uint32_t expert = 0;
    uint64_t slice_offset = 0;
    uint64_t slice_bytes = 0;
    uint64_t tensor_end = 0;
};

struct ModelFileInfo {
    std::string path;
    uint64_t size = 0;
};

class ExpertMap {
public:
    // Bounds from real models with wide margins (DeepSeek-V3 61 x 256, Kimi K2 61 x 384, Qwen3-Next
    // 48 x 512, Qwen3-235B 94 x 128): build() refuses a model past them.
    static constexpr uint32_t kMaxModelBlocks = 1024;
    static constexpr uint32_t kMaxExpertsPerLayer = 8192;
    static constexpr uint64_t kMaxModelExperts = 1u << 18;  // layers x experts
    std::string architecture;
    std::string name;  // general.name, when present
    std::vector<ModelFileInfo> files;
    uint32_t n_blocks = 0;            // <arch>.block_count
    uint32_t n_experts = 0;           // <arch>.expert_count
    uint32_t n_experts_used = 0;      // <arch>.expert_used_count
    uint32_t n_experts_shared = 0;    // <arch>.expert_shared_count, when present
    uint32_t n_leading_dense = 0;     // <arch>.leading_dense_block_count, when present
    std::vector<MoeLayer> layers;     // MoE layers only, by block index
    uint64_t expert_bytes_total = 0;  // routed experts
    uint64_t shared_expert_bytes_total = 0;
    uint64_t dense_bytes_total = 0;   // every other tensor
    uint64_t header_bytes_total = 0;  // metadata, directory and padding
    // Tensors of ggml types this build does not know (a newer ggml's): the model opens, their
    // bytes (up to the next tensor) count with the dense part, and an expert tensor among them
    // is no routed expert here: its layer's other tensors are, or the layer is dense.
    struct UnknownTypeTensor {
        std::string name;
        uint32_t file = 0;
        uint32_t type_id = 0;
        uint64_t bytes = 0;
        bool expert = false;  // a routed-expert tensor (*_exps)
    };
    std::vector<UnknownTypeTensor> unknown_type_tensors;

    [[nodiscard]] const MoeLayer* layer(uint32_t block) const;
    // The byte ranges of one expert: one per expert tensor of its layer.
    [[nodiscard]] std::vector<ByteRange> ranges(uint32_t block, uint32_t expert) const;
    // Every byte of every file that is no routed-expert slice (attention, norms, embeddings,
    // headers, padding): "the dense part", per file in offset order.
    [[nodiscard]] std::vector<ByteRange> dense_ranges() const;
    // The key heat profiles are kept under: "<architecture>-<blocks>x<experts>-<name>", each name
    // lowercased with anything but letters and digits made '-'. No file offsets: another
    // quantization of the same model has the same key.
    [[nodiscard]] std::string profile_key() const;
    // Which expert holds this byte, if any. O(log n).
    [[nodiscard]] std::optional<ExpertRef> lookup(uint32_t file, uint64_t offset) const;
    // The same, with the position inside the expert's slice of its tensor. O(log n).
    [[nodiscard]] std::optional<ExpertPosition> position(uint32_t file, uint64_t offset) const;
    // Calls fn(ExpertRef, bytes) for every expert whose slices overlap [begin, end) of `file`, with
    // the bytes of the overlap (an expert with slices in two overlapping tensors is called twice).
    // Returns the bytes of the range that belong to no routed expert. O(log n + experts overlapped).
    template <class Fn>
    uint64_t for_each_overlap(uint32_t file, uint64_t begin, uint64_t end, Fn&& fn) const;

    // Builds the map and cross-checks the metadata against the tensor shapes.
    static Result<ExpertMap> build(const std::vector<GgufFile>& parts);

private:
    struct Span {
        uint32_t file;
        uint64_t begin, end;  // of the whole tensor
        uint64_t bytes_per_expert;
        uint32_t layer;
    };
    std::vector<Span> spans_;  // sorted by (file, begin)
};

template <class Fn>
uint64_t ExpertMap::for_each_overlap(uint32_t file, uint64_t begin, uint64_t end, Fn&& fn) const {
    if (begin >= end) return 0;
    uint64_t covered = 0;
    // The first span that ends after `begin`: spans of one file do not overlap, so they are
    // sorted by their ends too.
    auto it = std::lower_bound(spans_.begin(), spans_.end(), std::pair{file, begin},
                               [](const Span& s, const std::pair<uint32_t, uint64_t>& k) {
                                   return s.file < k.first || (s.file == k.first && s.end <= k.second);
                               });
    for (; it != spans_.end() && it->file == file && it->begin < end; ++it) {
        const uint64_t lo = std::max(begin, it->begin), hi = std::min(end, it->end);
        if (lo >= hi || it->bytes_per_expert == 0) continue;
        covered += hi - lo;
        for (uint64_t e = (lo - it->begin) / it->bytes_per_expert; it->begin + e * it->bytes_per_expert < hi; ++e) {
            const uint64_t s0 = std::max(lo, it->begin + e * it->bytes_per_expert);
            const uint64_t s1 = std::min(hi, it->begin + (e + 1) * it->bytes_per_expert);
            fn(ExpertRef{it->layer, static_cast<uint32_t>(e)}, s1 - s0);
        }
    }
    return (end - begin) - covered;
}

Result<ExpertMap> load_expert_map(const std::string& path);

}  // namespace moecache
