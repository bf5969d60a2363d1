#include "moecache/ggml_type.h"

#include <array>
#include <cctype>

namespace moecache {
namespace {

// Block geometry as ggml defines it (type_traits in ggml.c; block structs in ggml-common.h).
constexpr std::array kTypes = {
    GgmlTypeInfo{ggml::F32, "F32", 1, 4},
    GgmlTypeInfo{ggml::F16, "F16", 1, 2},
    GgmlTypeInfo{ggml::Q4_0, "Q4_0", 32, 18},
    GgmlTypeInfo{ggml::Q4_1, "Q4_1", 32, 20},
    GgmlTypeInfo{ggml::Q5_0, "Q5_0", 32, 22},
    GgmlTypeInfo{ggml::Q5_1, "Q5_1", 32, 24},
    GgmlTypeInfo{ggml::Q8_0, "Q8_0", 32, 34},
    GgmlTypeInfo{ggml::Q8_1, "Q8_1", 32, 36},
    GgmlTypeInfo{ggml::Q2_K, "Q2_K", 256, 84},
    GgmlTypeInfo{ggml::Q3_K, "Q3_K", 256, 110},
    GgmlTypeInfo{ggml::Q4_K, "Q4_K", 256, 144},
    GgmlTypeInfo{ggml::Q5_K, "Q5_K", 256, 176},
    GgmlTypeInfo{ggml::Q6_K, "Q6_K", 256, 210},
    GgmlTypeInfo{ggml::Q8_K, "Q8_K", 256, 292},
    GgmlTypeInfo{ggml::IQ2_XXS, "IQ2_XXS", 256, 66},
    GgmlTypeInfo{ggml::IQ2_XS, "IQ2_XS", 256, 74},
    GgmlTypeInfo{ggml::IQ3_XXS, "IQ3_XXS", 256, 98},
    GgmlTypeInfo{ggml::IQ1_S, "IQ1_S", 256, 50},
    GgmlTypeInfo{ggml::IQ4_NL, "IQ4_NL", 32, 18},
    GgmlTypeInfo{ggml::IQ3_S, "IQ3_S", 256, 110},
    GgmlTypeInfo{ggml::IQ2_S, "IQ2_S", 256, 82},
    GgmlTypeInfo{ggml::IQ4_XS, "IQ4_XS", 256, 136},
    GgmlTypeInfo{ggml::I8, "I8", 1, 1},
    GgmlTypeInfo{ggml::I16, "I16", 1, 2},
    GgmlTypeInfo{ggml::I32, "I32", 1, 4},
    GgmlTypeInfo{ggml::I64, "I64", 1, 8},
    GgmlTypeInfo{ggml::F64, "F64", 1, 8},
    GgmlTypeInfo{ggml::IQ1_M, "IQ1_M", 256, 56},
    GgmlTypeInfo{ggml::BF16, "BF16", 1, 2},
    GgmlTypeInfo{ggml::TQ1_0, "TQ1_0", 256, 54},
    GgmlTypeInfo{ggml::TQ2_0, "TQ2_0", 256, 66},
    GgmlTypeInfo{ggml::MXFP4, "MXFP4", 32, 17},
    GgmlTypeInfo{ggml::NVFP4, "NVFP4", 64, 36},
    GgmlTypeInfo{ggml::Q1_0, "Q1_0", 128, 18},
    GgmlTypeInfo{ggml::Q2_0, "Q2_0", 64, 18},
};

bool iequals(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
        if (std::toupper(static_cast<unsigned char>(a[i])) != std::toupper(static_cast<unsigned char>(b[i])))
            return false;
    return true;
}

}  // namespace

std::optional<GgmlTypeInfo> ggml_type_info(uint32_t id) {
    for (const auto& t : kTypes)
        if (t.id == id) return t;
    return std::nullopt;
}

std::span<const GgmlTypeInfo> ggml_known_types() { return kTypes; }

std::optional<std::string_view> ggml_retired_type_name(uint32_t id) {
    switch (id) {
        case 4: return "Q4_2";
        case 5: return "Q4_3";
        case 31: return "Q4_0_4_4";
        case 32: return "Q4_0_4_8";
        case 33: return "Q4_0_8_8";
        case 36: return "IQ4_NL_4_4";
        case 37: return "IQ4_NL_4_8";
        case 38: return "IQ4_NL_8_8";
        default: return std::nullopt;
    }
}

std::optional<GgmlTypeInfo> ggml_type_by_name(std::string_view name) {
    for (const auto& t : kTypes)
        if (iequals(t.name, name)) return t;
    return std::nullopt;
}

}  // namespace moecache
