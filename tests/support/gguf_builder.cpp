#include "gguf_builder.h"

#include "moecache/ggml_type.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace moecache::test {
namespace {

template <typename T>
std::string le(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::string out(sizeof v, '\0');
    std::memcpy(out.data(), &v, sizeof v);  // the tests only run on little-endian machines
    return out;
}

uint64_t round_up(uint64_t v, uint64_t a) { return a == 0 ? v : (v + a - 1) / a * a; }

// Serializes the header and records where each piece starts.
struct Layout {
    std::string header;
    std::vector<uint64_t> kv_at, kv_value_at, tensor_at, dims_at, type_at;
};

Layout layout(const GgufDesc& d) {
    Layout l;
    std::string& h = l.header;
    h += d.magic;
    h += le(d.version);
    h += le<uint64_t>(d.n_tensors.value_or(d.tensors.size()));
    h += le<uint64_t>(d.n_kv.value_or(d.kvs.size()));
    for (const auto& kv : d.kvs) {
        l.kv_at.push_back(h.size());
        h += GgufDesc::str(kv.key);
        h += le(kv.type);
        l.kv_value_at.push_back(h.size());
        h += kv.payload;
    }
    for (size_t i = 0; i < d.tensors.size(); ++i) {
        const auto& t = d.tensors[i];
        l.tensor_at.push_back(h.size());
        h += GgufDesc::str(t.name);
        l.dims_at.push_back(h.size());
        h += le<uint32_t>(t.n_dims.value_or(static_cast<uint32_t>(t.ne.size())));
        for (int64_t n : t.ne) h += le(n);
        l.type_at.push_back(h.size());
        h += le(t.type);
        h += le(d.tensor_data_offset(i));
    }
    return l;
}

uint64_t at(const std::vector<uint64_t>& v, size_t i, const char* what) {
    if (i >= v.size()) throw std::out_of_range(std::string("GgufDesc: no ") + what);
    return v[i];
}

}  // namespace

std::string GgufDesc::u32(uint32_t v) { return le(v); }
std::string GgufDesc::u64(uint64_t v) { return le(v); }
std::string GgufDesc::i32(int32_t v) { return le(v); }
std::string GgufDesc::f32(float v) { return le(v); }
std::string GgufDesc::u8(uint8_t v) { return le(v); }
std::string GgufDesc::i8(int8_t v) { return le(v); }
std::string GgufDesc::u16(uint16_t v) { return le(v); }
std::string GgufDesc::i16(int16_t v) { return le(v); }
std::string GgufDesc::i64(int64_t v) { return le(v); }
std::string GgufDesc::f64(double v) { return le(v); }
std::string GgufDesc::boolean(bool v) { return le<uint8_t>(v ? 1 : 0); }
std::string GgufDesc::str(const std::string& s) { return le<uint64_t>(s.size()) + s; }

std::string GgufDesc::array(uint32_t element_type, uint64_t count, const std::string& elements) {
    return le(element_type) + le(count) + elements;
}

std::string GgufDesc::str_array(const std::vector<std::string>& v) {
    std::string elements;
    for (const auto& s : v) elements += str(s);
    return array(code(GgufValueType::String), v.size(), elements);
}

std::string GgufDesc::u32_array(const std::vector<uint32_t>& v) {
    std::string elements;
    for (uint32_t x : v) elements += le(x);
    return array(code(GgufValueType::U32), v.size(), elements);
}

GgufDesc& GgufDesc::add_kv(std::string key, uint32_t type, std::string payload) {
    kvs.push_back({std::move(key), type, std::move(payload)});
    return *this;
}

GgufDesc& GgufDesc::set_kv(const std::string& key, uint32_t type, std::string payload) {
    for (auto& kv : kvs)
        if (kv.key == key) {
            kv.type = type;
            kv.payload = std::move(payload);
            return *this;
        }
    return add_kv(key, type, std::move(payload));
}

GgufDesc& GgufDesc::add_u32(std::string key, uint32_t v) {
    return add_kv(std::move(key), code(GgufValueType::U32), u32(v));
}

GgufDesc& GgufDesc::add_u64(std::string key, uint64_t v) {
    return add_kv(std::move(key), code(GgufValueType::U64), u64(v));
}

GgufDesc& GgufDesc::add_str(std::string key, const std::string& v) {
    return add_kv(std::move(key), code(GgufValueType::String), str(v));
}

GgufDesc& GgufDesc::add_tensor(std::string name, std::vector<int64_t> ne, uint32_t type) {
    GgufTensorDesc t;
    t.name = std::move(name);
    t.ne = std::move(ne);
    t.type = type;
    tensors.push_back(std::move(t));
    return *this;
}

uint64_t GgufDesc::tensor_nbytes(size_t i) const {
    const auto& t = tensors.at(i);
    const auto info = ggml_type_info(t.type);
    if (!info || t.ne.empty() || t.ne[0] <= 0 || t.ne[0] % info->block_elements != 0) return 0;
    uint64_t n = static_cast<uint64_t>(t.ne[0]) / info->block_elements * info->block_bytes;
    for (size_t d = 1; d < t.ne.size(); ++d)
        if (t.ne[d] <= 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(t.ne[d]), &n)) return 0;
    return n;
}

uint64_t GgufDesc::tensor_data_offset(size_t i) const {
    if (i >= tensors.size()) throw std::out_of_range("GgufDesc: no such tensor");
    if (tensors[i].offset) return *tensors[i].offset;
    uint64_t cursor = 0;
    for (size_t j = 0; j < i; ++j)
        if (!tensors[j].offset) cursor = round_up(cursor + tensor_nbytes(j), alignment);
    return cursor;
}

uint64_t GgufDesc::data_section_bytes() const {
    if (data_bytes) return *data_bytes;
    uint64_t end = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
        uint64_t tensor_end;
        if (__builtin_add_overflow(tensor_data_offset(i), tensor_nbytes(i), &tensor_end) ||
            tensor_end > (uint64_t{1} << 30))
            throw std::length_error("GgufDesc: tensor '" + tensors[i].name +
                                    "' ends past 1 GiB; set data_bytes");
        end = std::max(end, tensor_end);
    }
    return end;
}

uint64_t GgufDesc::header_end() const { return layout(*this).header.size(); }
uint64_t GgufDesc::data_offset() const { return round_up(header_end(), alignment); }
uint64_t GgufDesc::kv_offset(size_t i) const { return at(layout(*this).kv_at, i, "such kv"); }

uint64_t GgufDesc::kv_value_offset(size_t i) const {
    return at(layout(*this).kv_value_at, i, "such kv");
}

uint64_t GgufDesc::tensor_info_offset(size_t i) const {
    return at(layout(*this).tensor_at, i, "such tensor");
}

uint64_t GgufDesc::tensor_dims_offset(size_t i) const {
    return at(layout(*this).dims_at, i, "such tensor");
}

uint64_t GgufDesc::tensor_type_offset(size_t i) const {
    return at(layout(*this).type_at, i, "such tensor");
}

std::string GgufDesc::bytes() const {
    std::string out = layout(*this).header;
    out.resize(round_up(out.size(), alignment), '\0');
    out.append(data_section_bytes(), static_cast<char>(fill));
    return out;
}

void patch_u32(std::string& bytes, uint64_t at, uint32_t v) {
    if (at + sizeof v > bytes.size()) throw std::out_of_range("patch_u32 past the end");
    std::memcpy(bytes.data() + at, &v, sizeof v);
}

void patch_u64(std::string& bytes, uint64_t at, uint64_t v) {
    if (at + sizeof v > bytes.size()) throw std::out_of_range("patch_u64 past the end");
    std::memcpy(bytes.data() + at, &v, sizeof v);
}

std::vector<GgufDesc> split_set(const GgufDesc& whole, uint32_t n_parts) {
    if (n_parts == 0 || n_parts > whole.tensors.size())
        throw std::invalid_argument("split_set: need 1 to n_tensors parts");
    std::vector<GgufDesc> parts(n_parts);
    const size_t per = (whole.tensors.size() + n_parts - 1) / n_parts;
    for (uint32_t i = 0; i < n_parts; ++i) {
        GgufDesc& p = parts[i];
        p.version = whole.version;
        p.alignment = whole.alignment;
        for (const auto& kv : whole.kvs)  // later parts need the alignment their layout used
            if (i == 0 || kv.key == "general.alignment") p.kvs.push_back(kv);
        p.add_kv("split.no", code(GgufValueType::U16), GgufDesc::u16(static_cast<uint16_t>(i)))
            .add_kv("split.count", code(GgufValueType::U16),
                    GgufDesc::u16(static_cast<uint16_t>(n_parts)))
            .add_kv("split.tensors.count", code(GgufValueType::I32),
                    GgufDesc::i32(static_cast<int32_t>(whole.tensors.size())));
        const size_t begin = std::min(whole.tensors.size(), i * per);
        const size_t end = std::min(whole.tensors.size(), begin + per);
        for (size_t t = begin; t < end; ++t) {
            p.tensors.push_back(whole.tensors[t]);
            p.tensors.back().offset.reset();  // repacked within its part
        }
    }
    return parts;
}

GgufDesc tiny_moe(uint32_t n_layers, uint32_t n_experts, uint32_t n_used, int64_t n_embd,
                  int64_t n_ff, uint32_t expert_type) {
    constexpr int64_t kVocab = 16;
    const auto experts = static_cast<int64_t>(n_experts);
    GgufDesc d;
    d.add_str("general.architecture", "qwen3moe")
        .add_str("general.name", "tiny-moe")
        .add_u32("qwen3moe.block_count", n_layers)
        .add_u32("qwen3moe.embedding_length", static_cast<uint32_t>(n_embd))
        .add_u32("qwen3moe.expert_feed_forward_length", static_cast<uint32_t>(n_ff))
        .add_u32("qwen3moe.expert_count", n_experts)
        .add_u32("qwen3moe.expert_used_count", n_used);
    d.add_tensor("token_embd.weight", {n_embd, kVocab});
    for (uint32_t l = 0; l < n_layers; ++l) {
        const std::string blk = "blk." + std::to_string(l) + ".";
        d.add_tensor(blk + "attn_norm.weight", {n_embd});
        d.add_tensor(blk + "ffn_gate_inp.weight", {n_embd, experts});
        d.add_tensor(blk + "ffn_gate_exps.weight", {n_embd, n_ff, experts}, expert_type);
        d.add_tensor(blk + "ffn_up_exps.weight", {n_embd, n_ff, experts}, expert_type);
        d.add_tensor(blk + "ffn_down_exps.weight", {n_ff, n_embd, experts}, expert_type);
    }
    d.add_tensor("output_norm.weight", {n_embd});
    return d;
}

}  // namespace moecache::test
