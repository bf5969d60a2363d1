#include "moecache/mkmodel/gguf_writer.h"

#include "moecache/model.h"
#include "moecache/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace moecache::mkmodel {
namespace {

constexpr uint64_t kBufferBytes = 8u << 20;
constexpr uint64_t kWritebackWindow = 256u << 20;

class Sink {
public:
    Sink(int fd, std::string path, bool drop) : fd_(fd), path_(std::move(path)), drop_(drop) {}

    Result<void> put(const void* data, size_t n) {
        const auto* p = static_cast<const uint8_t*>(data);
        while (n > 0) {
            const size_t take = std::min(n, buf_.size() - len_);
            std::memcpy(buf_.data() + len_, p, take);
            len_ += take;
            p += take;
            n -= take;
            if (len_ == buf_.size()) MC_TRY_VOID(flush());
        }
        return {};
    }
    template <typename T>
    Result<void> put_le(T v) {
        return put(&v, sizeof v);  // this writer runs on little-endian machines only
    }
    Result<void> put_string(const std::string& s) {
        MC_TRY_VOID(put_le<uint64_t>(s.size()));
        return put(s.data(), s.size());
    }
    Result<void> pad_to(uint64_t alignment) {
        static const std::array<uint8_t, 4096> zeros{};
        uint64_t pad = (alignment - pos() % alignment) % alignment;
        while (pad > 0) {
            const uint64_t n = std::min<uint64_t>(pad, zeros.size());
            MC_TRY_VOID(put(zeros.data(), n));
            pad -= n;
        }
        return {};
    }
    // A region to be filled in place, for tensor rows: avoids a copy of the bulk of the file.
    uint8_t* reserve(size_t n) {
        if (buf_.size() - len_ < n) return nullptr;
        return buf_.data() + len_;
    }
    Result<void> commit(size_t n) {
        len_ += n;
        if (len_ == buf_.size()) return flush();
        return {};
    }
    [[nodiscard]] size_t free_bytes() const { return buf_.size() - len_; }
    [[nodiscard]] uint64_t pos() const { return written_ + len_; }

    // Writes what the buffer holds; all but the last pos() % kKeptAlignment bytes unless `all`, which
    // move to the buffer's start: a place in the buffer stays as aligned as its place in the file,
    // so a tensor's rows, aligned in the file, are aligned for the fill that writes floats into them.
    Result<void> flush(bool all = false) {
        const size_t out = all ? len_ : len_ / kKeptAlignment * kKeptAlignment;
        size_t off = 0;
        while (off < out) {
            const ssize_t n = ::write(fd_, buf_.data() + off, out - off);
            if (n < 0) {
                if (errno == EINTR) continue;
                return fail_errno("{}: write at byte {}", path_, written_ + off);
            }
            off += static_cast<size_t>(n);
        }
        written_ += out;
        std::memmove(buf_.data(), buf_.data() + out, len_ - out);
        len_ -= out;
        // Keep dirty pages bounded: start writeback of each full window, wait for the one before.
        while (written_ >= synced_ + kWritebackWindow) {
            ::sync_file_range(fd_, static_cast<off_t>(synced_), kWritebackWindow, SYNC_FILE_RANGE_WRITE);
            if (synced_ >= kWritebackWindow) {
                const off_t prev = static_cast<off_t>(synced_ - kWritebackWindow);
                ::sync_file_range(fd_, prev, kWritebackWindow,
                                  SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
                if (drop_) ::posix_fadvise(fd_, prev, kWritebackWindow, POSIX_FADV_DONTNEED);
            }
            synced_ += kWritebackWindow;
        }
        return {};
    }
    static constexpr size_t kKeptAlignment = 64;
    Result<void> finish() {
        MC_TRY_VOID(flush(/*all=*/true));
        if (::fdatasync(fd_) != 0) return fail_errno("{}: fdatasync", path_);
        if (drop_) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
        return {};
    }

private:
    int fd_;
    std::string path_;
    bool drop_;
    std::vector<uint8_t> buf_ = std::vector<uint8_t>(kBufferBytes);
    size_t len_ = 0;
    uint64_t written_ = 0;
    uint64_t synced_ = 0;
};

uint32_t type_code(const KvValue& v) {
    struct V {
        uint32_t operator()(uint32_t) const { return 4; }
        uint32_t operator()(I32) const { return 5; }
        uint32_t operator()(U16) const { return 2; }
        uint32_t operator()(uint64_t) const { return 10; }
        uint32_t operator()(float) const { return 6; }
        uint32_t operator()(bool) const { return 7; }
        uint32_t operator()(const std::string&) const { return 8; }
        uint32_t operator()(const StringArray&) const { return 9; }
        uint32_t operator()(const U32Array&) const { return 9; }
        uint32_t operator()(const I32Array&) const { return 9; }
        uint32_t operator()(const F32Array&) const { return 9; }
    };
    return std::visit(V{}, v);
}

Result<void> put_value(Sink& s, const KvValue& v) {
    MC_TRY_VOID(s.put_le<uint32_t>(type_code(v)));
    if (auto* x = std::get_if<uint32_t>(&v)) return s.put_le(*x);
    if (auto* x = std::get_if<I32>(&v)) return s.put_le(x->v);
    if (auto* x = std::get_if<U16>(&v)) return s.put_le(x->v);
    if (auto* x = std::get_if<uint64_t>(&v)) return s.put_le(*x);
    if (auto* x = std::get_if<float>(&v)) return s.put_le(*x);
    if (auto* x = std::get_if<bool>(&v)) return s.put_le<uint8_t>(*x ? 1 : 0);
    if (auto* x = std::get_if<std::string>(&v)) return s.put_string(*x);
    auto array = [&](uint32_t et, const auto& values, auto put_one) -> Result<void> {
        MC_TRY_VOID(s.put_le<uint32_t>(et));
        MC_TRY_VOID(s.put_le<uint64_t>(values.size()));
        for (const auto& e : values) MC_TRY_VOID(put_one(e));
        return {};
    };
    if (auto* x = std::get_if<StringArray>(&v))
        return array(8, x->values, [&](const std::string& e) { return s.put_string(e); });
    if (auto* x = std::get_if<U32Array>(&v))
        return array(4, x->values, [&](uint32_t e) { return s.put_le(e); });
    if (auto* x = std::get_if<I32Array>(&v))
        return array(5, x->values, [&](int32_t e) { return s.put_le(e); });
    if (auto* x = std::get_if<F32Array>(&v))
        return array(6, x->values, [&](float e) { return s.put_le(e); });
    return failf("unhandled metadata value type");
}

}  // namespace

uint64_t TensorSpec::row_bytes() const {
    return static_cast<uint64_t>(ne.at(0)) / type.block_elements * type.block_bytes;
}

uint64_t TensorSpec::n_rows() const {
    uint64_t n = 1;
    for (size_t i = 1; i < ne.size(); ++i) n *= static_cast<uint64_t>(ne[i]);
    return n;
}

Result<std::vector<WrittenFile>> GgufWriter::write(const std::string& path, const WriteOptions& opt) {
    if (opt.splits == 0 || opt.splits > tensors_.size())
        return failf("cannot split {} tensors into {} files", tensors_.size(), opt.splits);
    for (const auto& t : tensors_)
        if (t.ne.empty() || t.ne.size() > 4 || t.ne[0] % t.type.block_elements != 0)
            return failf("tensor {}: ne[0] = {} is not a multiple of the {} block size {}", t.name,
                         t.ne.empty() ? 0 : t.ne[0], t.type.name, t.type.block_elements);

    // Cut the tensor list into parts of about equal bytes, in order.
    uint64_t total = 0;
    for (const auto& t : tensors_) total += t.nbytes();
    std::vector<size_t> first_of_part{0};
    uint64_t acc = 0;
    for (size_t i = 0; i < tensors_.size() && first_of_part.size() < opt.splits; ++i) {
        acc += tensors_[i].nbytes();
        const uint64_t goal = total / opt.splits * first_of_part.size();
        const size_t left = tensors_.size() - (i + 1);
        if ((acc >= goal && left >= opt.splits - first_of_part.size()) ||
            left == opt.splits - first_of_part.size())
            first_of_part.push_back(i + 1);
    }
    first_of_part.push_back(tensors_.size());

    std::string prefix = path;
    if (prefix.size() > 5 && prefix.substr(prefix.size() - 5) == ".gguf") prefix.resize(prefix.size() - 5);

    std::vector<WrittenFile> out;
    for (uint32_t part = 0; part < opt.splits; ++part) {
        const std::string file = opt.splits == 1 ? path : split_path(prefix, part, opt.splits);
        UniqueFd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
        if (!fd) return fail_errno("{}: cannot create", file);
        Sink s(fd.get(), file, opt.drop_cache);

        std::vector<std::pair<std::string, KvValue>> kvs;
        if (part == 0) kvs = kvs_;
        if (opt.alignment != 32) kvs.emplace_back("general.alignment", opt.alignment);
        if (opt.splits > 1) {
            kvs.emplace_back("split.no", U16{static_cast<uint16_t>(part)});
            kvs.emplace_back("split.count", U16{static_cast<uint16_t>(opt.splits)});
            kvs.emplace_back("split.tensors.count", I32{static_cast<int32_t>(tensors_.size())});
        }
        const size_t t0 = first_of_part[part], t1 = first_of_part[part + 1];

        MC_TRY_VOID(s.put("GGUF", 4));
        MC_TRY_VOID(s.put_le<uint32_t>(3));
        MC_TRY_VOID(s.put_le<uint64_t>(t1 - t0));
        MC_TRY_VOID(s.put_le<uint64_t>(kvs.size()));
        for (const auto& [k, v] : kvs) {
            MC_TRY_VOID(s.put_string(k));
            MC_TRY_VOID(put_value(s, v));
        }
        uint64_t offset = 0;
        for (size_t i = t0; i < t1; ++i) {
            const auto& t = tensors_[i];
            MC_TRY_VOID(s.put_string(t.name));
            MC_TRY_VOID(s.put_le<uint32_t>(static_cast<uint32_t>(t.ne.size())));
            for (int64_t d : t.ne) MC_TRY_VOID(s.put_le<int64_t>(d));
            MC_TRY_VOID(s.put_le<uint32_t>(t.type.id));
            MC_TRY_VOID(s.put_le<uint64_t>(offset));
            offset += padded(t.nbytes(), opt.alignment);
        }
        MC_TRY_VOID(s.pad_to(opt.alignment));
        for (size_t i = t0; i < t1; ++i) {
            const auto& t = tensors_[i];
            const uint64_t rb = t.row_bytes(), rows = t.n_rows();
            for (uint64_t row = 0; row < rows;) {
                uint64_t n = std::min<uint64_t>(rows - row, s.free_bytes() / rb);
                if (n == 0) {
                    if (rb <= kBufferBytes - Sink::kKeptAlignment) {  // buffer nearly full: flush and go on
                        MC_TRY_VOID(s.flush());
                        continue;
                    }
                    std::vector<uint8_t> big(rb);  // a row larger than the buffer
                    t.fill(row, 1, big.data());
                    MC_TRY_VOID(s.put(big.data(), big.size()));
                    ++row;
                    continue;
                }
                t.fill(row, n, s.reserve(n * rb));
                MC_TRY_VOID(s.commit(n * rb));
                row += n;
            }
            MC_TRY_VOID(s.pad_to(opt.alignment));
        }
        MC_TRY_VOID(s.finish());
        out.push_back({file, s.pos()});
    }
    return out;
}

}  // namespace moecache::mkmodel
