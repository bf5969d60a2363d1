#include "moecache/cuda/copy_classifier.h"

#include <algorithm>

namespace moecache::cuda {

void CopyClassifier::add_mapping(uint32_t model, const ExpertMap* map, uint32_t file, uintptr_t address,
                                 uint64_t length, uint64_t file_offset) {
    if (length == 0 || address + length < address) return;
    const Range r{address, address + length, file_offset, model, file, map};
    // A newer mapping of the same addresses replaces what it overlaps (a runtime remapped).
    ranges_.erase(std::remove_if(ranges_.begin(), ranges_.end(),
                                 [&](const Range& o) { return o.begin < r.end && r.begin < o.end; }),
                  ranges_.end());
    ranges_.insert(std::upper_bound(ranges_.begin(), ranges_.end(), r,
                                    [](const Range& a, const Range& b) { return a.begin < b.begin; }),
                   r);
}

void CopyClassifier::remove_model(uint32_t model) {
    ranges_.erase(std::remove_if(ranges_.begin(), ranges_.end(), [&](const Range& r) { return r.model == model; }),
                  ranges_.end());
}

std::optional<ExpertCopy> CopyClassifier::classify(const void* src, uint64_t bytes) const {
    const auto a = reinterpret_cast<uintptr_t>(src);
    if (bytes == 0 || a + bytes < a) return std::nullopt;
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), a,
                               [](uintptr_t x, const Range& r) { return x < r.begin; });
    if (it == ranges_.begin()) return std::nullopt;
    --it;
    if (a >= it->end) return std::nullopt;
    const uint64_t offset = it->file_offset + (a - it->begin);
    const auto pos = it->map->position(it->file, offset);
    if (!pos || pos->slice_offset != 0) return std::nullopt;  // not at the start of a slice
    const uint64_t n = bytes / pos->slice_bytes, pad = bytes % pos->slice_bytes;
    if (n == 0 || pad > kMaxCopyPadding) return std::nullopt;
    // The slices themselves lie in this tensor; the padding may run past it.
    if (offset + n * pos->slice_bytes > pos->tensor_end) return std::nullopt;
    if (a + n * pos->slice_bytes > it->end) return std::nullopt;  // not all of it in this mapping
    const MoeLayer* layer = it->map->layer(pos->layer);
    if (layer == nullptr) return std::nullopt;
    uint32_t tensor = 0;
    while (tensor < layer->tensors.size()) {
        const auto& t = layer->tensors[tensor];
        if (t.file == it->file && offset >= t.offset && offset < pos->tensor_end && t.bytes_per_expert == pos->slice_bytes &&
            t.offset + uint64_t{it->map->n_experts} * t.bytes_per_expert == pos->tensor_end)
            break;
        ++tensor;
    }
    if (tensor == layer->tensors.size()) return std::nullopt;
    return ExpertCopy{it->model, pos->layer, pos->expert, static_cast<uint32_t>(n), pad,
                      it->file,  tensor,     pos->slice_bytes, offset};
}

bool CopyClassifier::covers(const void* src) const {
    const auto a = reinterpret_cast<uintptr_t>(src);
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), a,
                               [](uintptr_t x, const Range& r) { return x < r.begin; });
    return it != ranges_.begin() && a < std::prev(it)->end;
}

bool ExpertCopy::padding_in_tensor(const ExpertMap& map) const {
    return first_expert + n_experts < map.n_experts;
}

}  // namespace moecache::cuda
