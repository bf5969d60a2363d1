// The ggml tensor types a GGUF file can hold, with their block geometry.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace moecache {

struct GgmlTypeInfo {
    uint32_t id;
    std::string_view name;
    uint32_t block_elements;  // elements per block (1 for plain types)
    uint32_t block_bytes;     // bytes per block
};

// nullopt for an id that is unknown, or that ggml has retired (the Q4_0_4_4 family, Q4_2 ...).
std::optional<GgmlTypeInfo> ggml_type_info(uint32_t id);
// What a tensor of a type this build does not know is (a newer ggml's): its id, no geometry.
[[nodiscard]] inline GgmlTypeInfo ggml_unknown_type(uint32_t id) { return GgmlTypeInfo{id, "unknown", 0, 0}; }
[[nodiscard]] inline bool ggml_type_known(const GgmlTypeInfo& t) { return t.block_elements != 0; }
// The types this build knows, in id order (checked against ggml.h in the tests).
[[nodiscard]] std::span<const GgmlTypeInfo> ggml_known_types();
std::optional<GgmlTypeInfo> ggml_type_by_name(std::string_view name);  // case-insensitive
// The name of a type id ggml once had and has since removed from GGUF files (Q4_2, Q4_0_4_4 ...).
std::optional<std::string_view> ggml_retired_type_name(uint32_t id);

namespace ggml {
inline constexpr uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10,
                          Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ2_XXS = 16, IQ2_XS = 17,
                          IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, I8 = 24, I16 = 25,
                          I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
                          NVFP4 = 40, Q1_0 = 41, Q2_0 = 42;
}

}  // namespace moecache
