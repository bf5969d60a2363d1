// Which experts a host-to-device copy carries. The hook sees cudaMemcpy*(dst, src, bytes, H2D);
// when src lies in the process's mapping of a registered model file and the bytes are whole,
// consecutive expert slices of one expert tensor — llama.cpp copies the experts the router picked
// grouped by consecutive ids, with up to 512 bytes of padding after the last one — the copy is
// router telemetry: (model, block, tensor, first expert, count). Pure arithmetic on the expert map
// and the mappings: no CUDA, no system call, safe inside a hooked call.
#pragma once

#include "moecache/model.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace moecache::cuda {

// llama.cpp pads a grouped copy by at most this much past the last expert's slice.
inline constexpr uint64_t kMaxCopyPadding = 512;

struct ExpertCopy {
    uint32_t model = 0;         // as given to add_mapping
    uint32_t block = 0;         // blk.N
    uint32_t first_expert = 0;  // the copy holds experts first_expert .. first_expert + n_experts - 1
    uint32_t n_experts = 0;
    uint64_t padding = 0;       // bytes past the last slice
    uint32_t file = 0;          // the model file the bytes come from
    uint32_t tensor = 0;        // which of the layer's expert tensors (MoeLayer::tensors)
    uint64_t slice_bytes = 0;   // one expert's slice of that tensor
    uint64_t file_offset = 0;   // of the first byte copied
    // Whether the padding lies in the same tensor (it is then the start of the next expert's slice).
    [[nodiscard]] bool padding_in_tensor(const ExpertMap& map) const;
};

class CopyClassifier {
public:
    // Model `model` (its expert map outlives the classifier's use of it) maps file `file` at
    // [address, address + length), holding the file's bytes from file_offset.
    void add_mapping(uint32_t model, const ExpertMap* map, uint32_t file, uintptr_t address, uint64_t length,
                     uint64_t file_offset);
    void remove_model(uint32_t model);

    // The experts a copy of `bytes` from `src` carries, if it carries whole expert slices; nullopt
    // for anything else (dense weights, activations, a partial slice, another file). O(log n).
    [[nodiscard]] std::optional<ExpertCopy> classify(const void* src, uint64_t bytes) const;
    // Whether `src` lies in any registered mapping at all.
    [[nodiscard]] bool covers(const void* src) const;
    [[nodiscard]] bool empty() const { return ranges_.empty(); }

private:
    struct Range {
        uintptr_t begin, end;
        uint64_t file_offset;
        uint32_t model, file;
        const ExpertMap* map;
    };
    std::vector<Range> ranges_;  // sorted by begin, not overlapping
};

}  // namespace moecache::cuda
