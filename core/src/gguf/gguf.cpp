#include "moecache/gguf.h"

#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <unordered_set>

namespace moecache {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;           // key length, 1-byte key, type, u8 value
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;  // 1-D tensor with a 1-byte name

// Sequential reader over a file descriptor with a small buffer; every read is bounds-checked
// against the real file size, so a header can claim anything without making us allocate it.
class Cursor {
public:
    Cursor(int fd, uint64_t size, const std::string& path) : fd_(fd), size_(size), path_(path) {}

    [[nodiscard]] uint64_t pos() const { return pos_; }
    [[nodiscard]] uint64_t remaining() const { return size_ - pos_; }
    [[nodiscard]] const std::string& path() const { return path_; }

    template <typename... Args>
    tl::unexpected<Error> error_at(uint64_t offset, fmt::format_string<Args...> f, Args&&... args) const {
        return fail(0, fmt::format("{}: at byte {}: {}", path_, offset,
                                   fmt::format(f, std::forward<Args>(args)...)));
    }

    Result<void> read(void* out, uint64_t n, std::string_view what) {
        if (n > remaining())
            return error_at(pos_, "{} needs {} bytes but the file ends after {} (truncated file?)",
                            what, n, remaining());
        auto* dst = static_cast<uint8_t*>(out);
        while (n > 0) {
            if (buf_pos_ == buf_len_) MC_TRY_VOID(fill(what));
            const uint64_t take = std::min<uint64_t>(n, buf_len_ - buf_pos_);
            std::memcpy(dst, buf_ + buf_pos_, take);
            buf_pos_ += take;
            pos_ += take;
            dst += take;
            n -= take;
        }
        return {};
    }

    Result<void> skip(uint64_t n, std::string_view what) {
        if (n > remaining())
            return error_at(pos_, "{} needs {} bytes but the file ends after {} (truncated file?)",
                            what, n, remaining());
        const uint64_t in_buf = buf_len_ - buf_pos_;
        if (n <= in_buf) {
            buf_pos_ += n;
        } else {
            buf_pos_ = buf_len_ = 0;
            file_pos_ = pos_ + n;
        }
        pos_ += n;
        return {};
    }

    template <typename T>
    Result<T> get(std::string_view what) {
        T v;
        MC_TRY_VOID(read(&v, sizeof v, what));
        return v;
    }

private:
    Result<void> fill(std::string_view what) {
        const uint64_t want = std::min<uint64_t>(sizeof buf_, size_ - file_pos_);
        ssize_t got;
        do {
            got = ::pread(fd_, buf_, want, static_cast<off_t>(file_pos_));
        } while (got < 0 && errno == EINTR);
        if (got < 0) return fail_errno("{}: reading {} at byte {}", path_, what, file_pos_);
        if (got == 0) return error_at(pos_, "{}: the file shrank while it was being read", what);
        buf_pos_ = 0;
        buf_len_ = static_cast<uint64_t>(got);
        file_pos_ += buf_len_;
        return {};
    }

    int fd_;
    uint64_t size_;
    const std::string& path_;
    uint64_t pos_ = 0;       // logical position
    uint64_t file_pos_ = 0;  // file position of buf_[buf_len_]
    uint8_t buf_[64 * 1024];
    uint64_t buf_pos_ = 0, buf_len_ = 0;
};

std::optional<uint64_t> scalar_size(GgufValueType t) {
    switch (t) {
        case GgufValueType::U8: case GgufValueType::I8: case GgufValueType::Bool: return 1;
        case GgufValueType::U16: case GgufValueType::I16: return 2;
        case GgufValueType::U32: case GgufValueType::I32: case GgufValueType::F32: return 4;
        case GgufValueType::U64: case GgufValueType::I64: case GgufValueType::F64: return 8;
        default: return std::nullopt;
    }
}

bool known_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::F64); }

Result<std::string> read_string(Cursor& c, uint64_t max_bytes, std::string_view what) {
    const uint64_t at = c.pos();
    const auto len_raw = MC_TRY(c.template get<uint64_t>(what));
    if (static_cast<int64_t>(len_raw) < 0)
        return c.error_at(at, "{} has a negative length ({})", what, static_cast<int64_t>(len_raw));
    if (len_raw > c.remaining())
        return c.error_at(at, "{} claims {} bytes but only {} remain in the file", what, len_raw,
                          c.remaining());
    if (len_raw > max_bytes)
        return c.error_at(at, "{} is {} bytes, more than the limit of {}", what, len_raw, max_bytes);
    std::string s(len_raw, '\0');
    MC_TRY_VOID(c.read(s.data(), len_raw, what));
    return s;
}

// Skips a string without keeping it (array elements).
Result<void> skip_string(Cursor& c, std::string_view what) {
    const uint64_t at = c.pos();
    const auto len = MC_TRY(c.template get<uint64_t>(what));
    if (static_cast<int64_t>(len) < 0)
        return c.error_at(at, "{} has a negative length ({})", what, static_cast<int64_t>(len));
    if (len > c.remaining())
        return c.error_at(at, "{} claims {} bytes but only {} remain in the file", what, len,
                          c.remaining());
    return c.skip(len, what);
}

template <typename T>
Result<GgufKv> scalar_kv(Cursor& c, GgufKv kv, std::string_view what) {
    const T v = MC_TRY(c.template get<T>(what));
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
        kv.value = static_cast<double>(v);
    else if constexpr (std::is_signed_v<T>)
        kv.value = static_cast<int64_t>(v);
    else
        kv.value = static_cast<uint64_t>(v);
    return kv;
}

Result<GgufKv> read_value(Cursor& c, GgufKv kv, const GgufLimits& limits) {
    const std::string what = fmt::format("value of key '{}'", kv.key);
    switch (kv.type) {
        case GgufValueType::U8: return scalar_kv<uint8_t>(c, std::move(kv), what);
        case GgufValueType::I8: return scalar_kv<int8_t>(c, std::move(kv), what);
        case GgufValueType::U16: return scalar_kv<uint16_t>(c, std::move(kv), what);
        case GgufValueType::I16: return scalar_kv<int16_t>(c, std::move(kv), what);
        case GgufValueType::U32: return scalar_kv<uint32_t>(c, std::move(kv), what);
        case GgufValueType::I32: return scalar_kv<int32_t>(c, std::move(kv), what);
        case GgufValueType::U64: return scalar_kv<uint64_t>(c, std::move(kv), what);
        case GgufValueType::I64: return scalar_kv<int64_t>(c, std::move(kv), what);
        case GgufValueType::F32: return scalar_kv<float>(c, std::move(kv), what);
        case GgufValueType::F64: return scalar_kv<double>(c, std::move(kv), what);
        case GgufValueType::Bool: {
            const auto at = c.pos();
            const auto b = MC_TRY(c.template get<uint8_t>(what));
            if (b > 1) return c.error_at(at, "{}: a bool must be 0 or 1, not {}", what, b);
            kv.value = b != 0;
            return kv;
        }
        case GgufValueType::String:
            kv.value = MC_TRY(read_string(c, limits.max_string_bytes, what));
            return kv;
        case GgufValueType::Array: {
            const uint64_t at = c.pos();
            const auto et = MC_TRY(c.template get<uint32_t>(what + " (array element type)"));
            if (et == static_cast<uint32_t>(GgufValueType::Array))
                return c.error_at(at, "{}: nested arrays are not allowed in GGUF", what);
            if (!known_type(et))
                return c.error_at(at, "{}: unknown array element type {}", what, et);
            const auto count = MC_TRY(c.template get<uint64_t>(what + " (array count)"));
            if (static_cast<int64_t>(count) < 0)
                return c.error_at(at + 4, "{}: negative array count ({})", what,
                                  static_cast<int64_t>(count));
            const auto element_type = static_cast<GgufValueType>(et);
            const uint64_t first = c.pos();
            auto too_many = [&] {
                return c.error_at(at + 4, "{}: an array of {} elements, more than any model's ({})", what, count,
                                  limits.max_array_elements);
            };
            if (element_type == GgufValueType::String) {
                // Each string needs at least its 8-byte length: reject impossible counts at once.
                if (count > c.remaining() / 8)
                    return c.error_at(at + 4, "{}: {} strings cannot fit in the {} bytes left", what,
                                      count, c.remaining());
                if (count > limits.max_array_elements) return too_many();
                for (uint64_t i = 0; i < count; ++i) {
                    MC_TRY_VOID(skip_string(c, what));
                    if (c.pos() > limits.max_header_bytes)  // checked as it is read, not after the array
                        return c.error_at(c.pos(), "the metadata is larger than the limit of {} bytes (in {})",
                                          limits.max_header_bytes, what);
                }
            } else {
                const uint64_t esz = *scalar_size(element_type);
                uint64_t total;
                if (__builtin_mul_overflow(count, esz, &total) || total > c.remaining())
                    return c.error_at(at + 4,
                                      "{}: {} elements of {} bytes run past the end of the file "
                                      "({} bytes left)",
                                      what, count, esz, c.remaining());
                if (count > limits.max_array_elements) return too_many();
                MC_TRY_VOID(c.skip(total, what));
            }
            kv.value = GgufArrayRef{element_type, count, first};
            return kv;
        }
    }
    return c.error_at(kv.offset, "{}: unknown value type {}", what, static_cast<uint32_t>(kv.type));
}

Result<void> check_alignment(const GgufFile& f, const GgufKv& kv, const GgufLimits& limits) {
    if (kv.type != GgufValueType::U32)
        return failf("{}: at byte {}: general.alignment must be a u32, not {}", f.path, kv.offset,
                     gguf_value_type_name(kv.type));
    const uint64_t a = std::get<uint64_t>(kv.value);
    if (a == 0) return failf("{}: at byte {}: general.alignment is 0", f.path, kv.offset);
    if ((a & (a - 1)) != 0)
        return failf("{}: at byte {}: general.alignment {} is not a power of two", f.path,
                     kv.offset, a);
    if (a > limits.max_alignment)
        return failf("{}: at byte {}: general.alignment {} is larger than the limit of {}", f.path,
                     kv.offset, a, limits.max_alignment);
    return {};
}

Result<GgufTensor> read_tensor_info(Cursor& c, const GgufLimits& limits) {
    GgufTensor t;
    t.info_offset = c.pos();
    t.name = MC_TRY(read_string(c, limits.max_tensor_name_bytes, "tensor name"));
    if (t.name.empty()) return c.error_at(t.info_offset, "a tensor has an empty name");
    const std::string what = fmt::format("tensor '{}'", t.name);
    const uint64_t dims_at = c.pos();
    t.n_dims = MC_TRY(c.template get<uint32_t>(what));
    if (t.n_dims == 0 || t.n_dims > 4)
        return c.error_at(dims_at, "{}: n_dims is {}; ggml tensors have 1 to 4 dimensions", what,
                          t.n_dims);
    for (uint32_t i = 0; i < t.n_dims; ++i) {
        const uint64_t at = c.pos();
        t.ne[i] = MC_TRY(c.template get<int64_t>(what));
        if (t.ne[i] <= 0)
            return c.error_at(at, "{}: dimension {} is {}; every dimension must be positive", what,
                              i, t.ne[i]);
    }
    const uint64_t type_at = c.pos();
    const auto type_id = MC_TRY(c.template get<uint32_t>(what));
    const auto info = ggml_type_info(type_id);
    if (!info)
        if (const auto retired = ggml_retired_type_name(type_id))
            return c.error_at(type_at, "{}: ggml tensor type {} ({}) was retired from GGUF files; "
                              "convert the model again with a current llama.cpp", what, type_id, *retired);
    t.data_offset = MC_TRY(c.template get<uint64_t>(what));
    if (!info) {
        // A newer ggml's type: the file still opens, the tensor's bytes are placed (read_gguf,
        // up to the next tensor) but not its strides, and the expert map reports it.
        t.type = ggml_unknown_type(type_id);
        return t;
    }
    t.type = *info;

    int64_t elements = 1;
    for (uint32_t i = 0; i < 4; ++i)
        if (__builtin_mul_overflow(elements, t.ne[i], &elements))
            return c.error_at(dims_at, "{}: its element count overflows 64 bits", what);
    if (t.ne[0] % t.type.block_elements != 0)
        return c.error_at(dims_at, "{}: ne[0] = {} is not a multiple of the {} block size {}", what,
                          t.ne[0], t.type.name, t.type.block_elements);
    t.nb[0] = t.type.block_bytes;
    uint64_t row;
    if (__builtin_mul_overflow(static_cast<uint64_t>(t.ne[0] / t.type.block_elements),
                               uint64_t{t.type.block_bytes}, &row))
        return c.error_at(dims_at, "{}: its row size overflows 64 bits", what);
    t.nb[1] = row;
    for (int i = 2; i < 4; ++i)
        if (__builtin_mul_overflow(t.nb[i - 1], static_cast<uint64_t>(t.ne[i - 1]), &t.nb[i]))
            return c.error_at(dims_at, "{}: its byte size overflows 64 bits", what);
    if (__builtin_mul_overflow(t.nb[3], static_cast<uint64_t>(t.ne[3]), &t.nbytes))
        return c.error_at(dims_at, "{}: its byte size overflows 64 bits", what);
    return t;
}

}  // namespace

std::string_view gguf_value_type_name(GgufValueType t) {
    switch (t) {
        case GgufValueType::U8: return "u8";
        case GgufValueType::I8: return "i8";
        case GgufValueType::U16: return "u16";
        case GgufValueType::I16: return "i16";
        case GgufValueType::U32: return "u32";
        case GgufValueType::I32: return "i32";
        case GgufValueType::F32: return "f32";
        case GgufValueType::Bool: return "bool";
        case GgufValueType::String: return "string";
        case GgufValueType::Array: return "array";
        case GgufValueType::U64: return "u64";
        case GgufValueType::I64: return "i64";
        case GgufValueType::F64: return "f64";
    }
    return "unknown";
}

std::optional<uint64_t> GgufKv::as_uint() const {
    if (const auto* u = std::get_if<uint64_t>(&value)) return *u;
    if (const auto* i = std::get_if<int64_t>(&value); i && *i >= 0) return static_cast<uint64_t>(*i);
    return std::nullopt;
}

const std::string* GgufKv::as_string() const { return std::get_if<std::string>(&value); }

const GgufKv* GgufFile::find(std::string_view key) const {
    for (const auto& kv : kvs)
        if (kv.key == key) return &kv;
    return nullptr;
}

const GgufTensor* GgufFile::find_tensor(std::string_view name) const {
    for (const auto& t : tensors)
        if (t.name == name) return &t;
    return nullptr;
}

Result<std::string> GgufFile::get_string(std::string_view key) const {
    const auto* kv = find(key);
    if (!kv) return failf("{}: metadata key '{}' is missing", path, key);
    if (const auto* s = kv->as_string()) return *s;
    return failf("{}: at byte {}: metadata key '{}' should be a string but is {}", path, kv->offset,
                 key, gguf_value_type_name(kv->type));
}

Result<std::optional<uint64_t>> GgufFile::get_uint_opt(std::string_view key) const {
    const auto* kv = find(key);
    if (!kv) return std::optional<uint64_t>{};
    if (auto u = kv->as_uint()) return u;
    return failf("{}: at byte {}: metadata key '{}' should be a non-negative integer but is {}",
                 path, kv->offset, key, gguf_value_type_name(kv->type));
}

Result<uint64_t> GgufFile::get_uint(std::string_view key) const {
    const auto v = MC_TRY(get_uint_opt(key));
    if (!v) return failf("{}: metadata key '{}' is missing", path, key);
    return *v;
}

Result<GgufFile> read_gguf(int fd, std::string path, const GgufLimits& limits) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return fail_errno("{}: fstat", path);
    if (!S_ISREG(st.st_mode)) return failf("{}: not a regular file", path);

    GgufFile f;
    f.path = std::move(path);
    f.file_size = static_cast<uint64_t>(st.st_size);
    auto cursor = std::make_unique<Cursor>(fd, f.file_size, f.path);
    Cursor& c = *cursor;

    const auto magic = MC_TRY(c.get<uint32_t>("the GGUF magic"));
    if (magic != kMagic)
        return c.error_at(0, "not a GGUF file: the magic is {:08x}, expected 'GGUF'", magic);
    f.version = MC_TRY(c.get<uint32_t>("the GGUF version"));
    if (f.version == 0) return c.error_at(4, "GGUF version 0 is not a valid version");
    if (f.version == 1)
        return c.error_at(4, "GGUF version 1 (32-bit counts) is not supported; convert the model "
                             "with a current llama.cpp");
    if (f.version > 3) {
        if ((f.version & 0xffff) == 0 && __builtin_bswap32(f.version) <= 3)
            return c.error_at(4, "the GGUF version {} is byte-swapped: a big-endian GGUF file, "
                                 "which this little-endian machine cannot use", f.version);
        return c.error_at(4, "GGUF version {} is newer than the versions this reader knows (2, 3)",
                          f.version);
    }

    const auto n_tensors_raw = MC_TRY(c.get<uint64_t>("the tensor count"));
    const auto n_kv_raw = MC_TRY(c.get<uint64_t>("the metadata count"));
    if (static_cast<int64_t>(n_tensors_raw) < 0)
        return c.error_at(8, "n_tensors is negative ({})", static_cast<int64_t>(n_tensors_raw));
    if (static_cast<int64_t>(n_kv_raw) < 0)
        return c.error_at(16, "n_kv is negative ({})", static_cast<int64_t>(n_kv_raw));
    if (n_kv_raw > limits.max_kvs)
        return c.error_at(16, "n_kv claims {} entries, more than any model's ({})", n_kv_raw, limits.max_kvs);
    if (n_tensors_raw > limits.max_tensors)
        return c.error_at(8, "n_tensors claims {} tensors, more than any model's file ({})", n_tensors_raw,
                          limits.max_tensors);
    // Memory is bounded by what the file really holds: a count that cannot fit is rejected now.
    if (n_kv_raw > c.remaining() / kMinKvBytes)
        return c.error_at(16, "n_kv claims {} entries; the {} bytes left hold at most {}", n_kv_raw,
                          c.remaining(), c.remaining() / kMinKvBytes);

    // No reserve() from a count the file claims: vectors grow only with what is really read.
    std::unordered_set<std::string> keys;
    for (uint64_t i = 0; i < n_kv_raw; ++i) {
        GgufKv kv;
        kv.offset = c.pos();
        kv.key = MC_TRY(read_string(c, limits.max_key_bytes, fmt::format("key #{}", i)));
        if (kv.key.empty()) return c.error_at(kv.offset, "metadata key #{} is empty", i);
        if (!keys.insert(kv.key).second)
            return c.error_at(kv.offset, "metadata key '{}' appears twice", kv.key);
        const uint64_t type_at = c.pos();
        const auto type = MC_TRY(c.get<uint32_t>(fmt::format("type of key '{}'", kv.key)));
        if (!known_type(type))
            return c.error_at(type_at, "key '{}' has unknown value type {}", kv.key, type);
        kv.type = static_cast<GgufValueType>(type);
        f.kvs.push_back(MC_TRY(read_value(c, std::move(kv), limits)));
        if (c.pos() > limits.max_header_bytes)
            return c.error_at(c.pos(), "the metadata is larger than the limit of {} bytes",
                              limits.max_header_bytes);
    }
    if (const auto* kv = f.find("general.alignment")) {
        MC_TRY_VOID(check_alignment(f, *kv, limits));
        f.alignment = std::get<uint64_t>(kv->value);
    }

    if (n_tensors_raw > c.remaining() / kMinTensorInfoBytes)
        return c.error_at(8, "n_tensors claims {} tensors; the {} bytes left hold at most {}",
                          n_tensors_raw, c.remaining(), c.remaining() / kMinTensorInfoBytes);
    std::unordered_set<std::string> names;
    for (uint64_t i = 0; i < n_tensors_raw; ++i) {
        auto t = MC_TRY(read_tensor_info(c, limits));
        if (!names.insert(t.name).second)
            return c.error_at(t.info_offset, "tensor name '{}' appears twice", t.name);
        if (t.data_offset % f.alignment != 0)
            return c.error_at(t.info_offset, "tensor '{}': offset {} is not a multiple of the "
                              "alignment {}", t.name, t.data_offset, f.alignment);
        f.tensors.push_back(std::move(t));
        if (c.pos() > limits.max_header_bytes)
            return c.error_at(c.pos(), "the tensor directory is larger than the limit of {} bytes",
                              limits.max_header_bytes);
    }

    f.data_offset = (c.pos() + f.alignment - 1) / f.alignment * f.alignment;
    if (f.data_offset > f.file_size && !f.tensors.empty())
        return c.error_at(c.pos(), "the data section would start at byte {}, past the end of the "
                          "file ({} bytes)", f.data_offset, f.file_size);

    // Place every tensor, then check that none overlaps the next one. A tensor of an unknown
    // type takes the bytes up to the next tensor's data (or the end of the file).
    std::vector<GgufTensor*> by_offset;
    by_offset.reserve(f.tensors.size());
    for (auto& t : f.tensors) {
        uint64_t end;
        if (__builtin_add_overflow(f.data_offset, t.data_offset, &t.file_offset) ||
            __builtin_add_overflow(t.file_offset, t.nbytes, &end))
            return c.error_at(t.info_offset, "tensor '{}': offset {} overflows", t.name,
                              t.data_offset);
        if (t.file_offset >= f.file_size)
            return c.error_at(t.info_offset, "tensor '{}': its data at byte {} lies past the end "
                              "of the file ({} bytes)", t.name, t.file_offset, f.file_size);
        if (end > f.file_size)
            return c.error_at(t.info_offset, "tensor '{}': the data section is truncated: the "
                              "tensor needs bytes {}..{} but the file has {}", t.name,
                              t.file_offset, end, f.file_size);
        by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensor* a, const GgufTensor* b) { return a->file_offset < b->file_offset; });
    for (size_t i = 0; i < by_offset.size(); ++i)
        if (!ggml_type_known(by_offset[i]->type))
            by_offset[i]->nbytes =
                (i + 1 < by_offset.size() ? by_offset[i + 1]->file_offset : f.file_size) - by_offset[i]->file_offset;
    for (size_t i = 1; i < by_offset.size(); ++i) {
        const auto* prev = by_offset[i - 1];
        const auto* cur = by_offset[i];
        if (prev->file_offset + prev->nbytes > cur->file_offset)
            return c.error_at(cur->info_offset, "tensor '{}' (bytes {}..{}) overlaps tensor '{}' "
                              "(bytes {}..{})", cur->name, cur->file_offset,
                              cur->file_offset + cur->nbytes, prev->name, prev->file_offset,
                              prev->file_offset + prev->nbytes);
    }
    return f;
}

Result<GgufFile> read_gguf(const std::string& path, const GgufLimits& limits) {
    // O_NONBLOCK: a FIFO in a model's place opens at once (and is refused as no regular file)
    // instead of blocking until a writer comes; reads of a regular file are unaffected.
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    if (!fd) return fail_errno("{}: cannot open", path);
    return read_gguf(fd.get(), path, limits);
}

}  // namespace moecache
