// The GGUF reader on hostile files: one test per class of damage. Each fixture is a valid
// description with one thing broken, built at run time. Every rejection must name the file, say
// what is wrong in words a user can act on and, where there is one, the byte offset of the field.
#include "gguf_builder.h"
#include "temp_dir.h"

#include "moecache/ggml_type.h"
#include "moecache/gguf.h"
#include "moecache/model.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <initializer_list>

namespace moecache::test {
namespace {

using T = GgufValueType;

// The smallest file with a key and a tensor, so that every section exists.
GgufDesc small() {
    GgufDesc d;
    d.add_str("general.architecture", "llama");
    d.add_tensor("w", {8});
    return d;
}

// How the reader prefixes the offset of the field at fault.
std::string at_byte(uint64_t offset) { return fmt::format("at byte {}:", offset); }

void expect_mentions(const std::string& message, std::initializer_list<std::string> phrases) {
    for (const auto& p : phrases)
        EXPECT_NE(message.find(p), std::string::npos) << "no '" << p << "' in: " << message;
}

class GgufMalformed : public ::testing::Test {
protected:
    // Fails the test unless reading `bytes` fails with a message that names the file and holds
    // every phrase.
    void expect_rejected(const std::string& bytes, std::initializer_list<std::string> phrases) {
        write_file(path_, bytes);
        const auto f = read_gguf(path_);
        ASSERT_FALSE(f) << path_ << " was accepted";
        expect_mentions(f.error().what(), {path_});
        expect_mentions(f.error().what(), phrases);
    }
    void expect_rejected(const GgufDesc& d, std::initializer_list<std::string> phrases) {
        expect_rejected(d.bytes(), phrases);
    }

    TempDir dir_;
    const std::string path_ = dir_.file("bad.gguf");
};

// ---- The fixed header ------------------------------------------------------------------------

TEST_F(GgufMalformed, BadMagic) {
    GgufDesc d = small();
    d.magic = "GGJT";  // an older llama.cpp format
    expect_rejected(d, {"not a GGUF file", "magic", at_byte(0)});
}

TEST_F(GgufMalformed, Version0) {
    GgufDesc d = small();
    d.version = 0;
    expect_rejected(d, {"version 0", at_byte(4)});
}

TEST_F(GgufMalformed, Version1) {
    // v1 had 32-bit counts: reading it as v2 would misplace every later field.
    GgufDesc d = small();
    d.version = 1;
    expect_rejected(d, {"version 1", "not supported", at_byte(4)});
}

TEST_F(GgufMalformed, FutureVersion) {
    for (uint32_t v : {4u, 99u}) {
        GgufDesc d = small();
        d.version = v;
        expect_rejected(d, {fmt::format("version {}", v), "newer", at_byte(4)});
    }
}

TEST_F(GgufMalformed, ByteSwappedVersion) {
    GgufDesc d = small();
    d.version = 0x03000000;  // version 3 written big-endian
    expect_rejected(d, {"byte-swapped", "big-endian", at_byte(4)});
}

TEST_F(GgufMalformed, NegativeTensorCount) {
    GgufDesc d = small();
    d.n_tensors = static_cast<uint64_t>(int64_t{-1});
    expect_rejected(d, {"n_tensors is negative", at_byte(8)});
}

TEST_F(GgufMalformed, HugeTensorCount) {
    GgufDesc d = small();
    d.n_tensors = uint64_t{1} << 40;
    expect_rejected(d, {"n_tensors claims 1099511627776", at_byte(8)});
}

TEST_F(GgufMalformed, NegativeKvCount) {
    GgufDesc d = small();
    d.n_kv = static_cast<uint64_t>(int64_t{-5});
    expect_rejected(d, {"n_kv is negative (-5)", at_byte(16)});
}

TEST_F(GgufMalformed, HugeKvCount) {
    GgufDesc d = small();
    d.n_kv = uint64_t{1} << 40;
    expect_rejected(d, {"n_kv claims 1099511627776", at_byte(16)});
}

long max_rss_kib() {
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    return r.ru_maxrss;
}

TEST_F(GgufMalformed, HugeCountsFailFastWithoutAllocating) {
    GgufDesc many_kvs = small();
    many_kvs.n_kv = uint64_t{1} << 40;
    GgufDesc many_tensors = small();
    many_tensors.n_tensors = uint64_t{1} << 40;
    for (const GgufDesc* d : {&many_kvs, &many_tensors}) {
        write_file(path_, d->bytes());
        // Read in a child: its peak RSS starts from the RSS at fork, so the growth is this read's
        // alone, whatever earlier tests did to this process's peak.
        const auto start = std::chrono::steady_clock::now();
        const pid_t pid = ::fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            const long before = max_rss_kib();
            const bool rejected = !read_gguf(path_);
            const long grown_kib = max_rss_kib() - before;
            ::_exit(!rejected ? 3 : grown_kib >= 64 * 1024 ? 4 : 0);
        }
        int status = 0;
        ASSERT_EQ(::waitpid(pid, &status, 0), pid);
        const auto elapsed = std::chrono::steady_clock::now() - start;
        ASSERT_TRUE(WIFEXITED(status)) << "the reader crashed (out of memory?)";
        EXPECT_EQ(WEXITSTATUS(status), 0) << "3: accepted; 4: RSS grew by 64 MiB or more";
        EXPECT_LT(elapsed, std::chrono::seconds(1));
    }
}

TEST_F(GgufMalformed, TruncatedHeader) {
    // The file ends inside n_kv: 4 of its 8 bytes are there.
    expect_rejected(small().bytes().substr(0, 20), {"truncated", at_byte(16)});
}

// ---- Metadata ---------------------------------------------------------------------------------

TEST_F(GgufMalformed, NegativeStringLength) {
    GgufDesc d = small();
    d.add_kv("general.name", code(T::String), GgufDesc::u64(static_cast<uint64_t>(int64_t{-3})));
    expect_rejected(d, {"'general.name'", "negative length (-3)", at_byte(d.kv_value_offset(1))});

    std::string bytes = small().bytes();
    patch_u64(bytes, small().kv_offset(0), static_cast<uint64_t>(int64_t{-1}));  // the key's
    expect_rejected(bytes, {"key #0", "negative length (-1)", at_byte(small().kv_offset(0))});
}

TEST_F(GgufMalformed, StringLengthPastEof) {
    GgufDesc d = small();
    d.add_kv("general.name", code(T::String), GgufDesc::u64(1 << 20) + "abc");
    expect_rejected(d, {"'general.name'", "claims 1048576 bytes", at_byte(d.kv_value_offset(1))});

    std::string bytes = small().bytes();
    patch_u64(bytes, small().kv_offset(0), 1 << 20);  // the key's
    expect_rejected(bytes, {"key #0", "claims 1048576 bytes", at_byte(small().kv_offset(0))});
}

TEST_F(GgufMalformed, EmptyKey) {
    GgufDesc d = small();
    d.add_u32("", 1);
    expect_rejected(d, {"key #1 is empty", at_byte(d.kv_offset(1))});
}

TEST_F(GgufMalformed, DuplicateKey) {
    // A second value for a key would silently win or lose depending on the reader.
    GgufDesc d = small();
    d.add_str("general.architecture", "qwen3moe");
    expect_rejected(d, {"'general.architecture' appears twice", at_byte(d.kv_offset(1))});
}

TEST_F(GgufMalformed, UnknownValueType) {
    GgufDesc d = small();
    d.add_kv("general.x", 13, GgufDesc::u32(0));
    expect_rejected(d, {"'general.x'", "unknown value type 13", at_byte(d.kv_value_offset(1) - 4)});
}

TEST_F(GgufMalformed, NestedArray) {
    GgufDesc d = small();
    d.add_kv("general.x", code(T::Array),
             GgufDesc::array(code(T::Array), 1, GgufDesc::u32_array({1})));
    expect_rejected(d, {"'general.x'", "nested arrays", at_byte(d.kv_value_offset(1))});
}

TEST_F(GgufMalformed, UnknownArrayElementType) {
    GgufDesc d = small();
    d.add_kv("general.x", code(T::Array), GgufDesc::array(13, 1, GgufDesc::u32(0)));
    expect_rejected(d, {"'general.x'", "unknown array element type 13",
                        at_byte(d.kv_value_offset(1))});
}

TEST_F(GgufMalformed, ArrayPastEof) {
    // The count's offset follows the 4-byte element type.
    GgufDesc d = small();
    d.add_kv("general.x", code(T::Array), GgufDesc::array(code(T::U32), uint64_t{1} << 40));
    expect_rejected(d, {"'general.x'", "run past the end of the file",
                        at_byte(d.kv_value_offset(1) + 4)});
    // count x 8 wraps around 64 bits to a small number.
    d.set_kv("general.x", code(T::Array), GgufDesc::array(code(T::U64), (uint64_t{1} << 61) + 1));
    expect_rejected(d, {"'general.x'", "run past the end of the file",
                        at_byte(d.kv_value_offset(1) + 4)});
}

TEST_F(GgufMalformed, HugeStringArrayCount) {
    GgufDesc d = small();
    d.add_kv("tokenizer.ggml.tokens", code(T::Array),
             GgufDesc::array(code(T::String), uint64_t{1} << 40));
    expect_rejected(d, {"'tokenizer.ggml.tokens'", "strings cannot fit",
                        at_byte(d.kv_value_offset(1) + 4)});
    // A count that fits, with an element whose length runs past the end.
    const uint64_t second = d.kv_value_offset(1) + 12 + 9;
    d.set_kv("tokenizer.ggml.tokens", code(T::Array),
             GgufDesc::array(code(T::String), 2, GgufDesc::str("a") + GgufDesc::u64(1 << 30)));
    expect_rejected(d, {"'tokenizer.ggml.tokens'", "claims 1073741824 bytes", at_byte(second)});
}

// Counts within what a sparse file holds but past any model's: refused at once, named, before
// a loop or an allocation they would drive (an array of 2^30 empty strings in a sparse file held the
// daemon's loop ~12 s a registration; the metadata's size was checked only after the whole array).
TEST_F(GgufMalformed, CountsPastAnyModelAreRefusedAtOnce) {
    auto sparse = [&](const GgufDesc& d, uint64_t size) {
        write_file(path_, d.bytes());
        ASSERT_EQ(truncate(path_.c_str(), static_cast<off_t>(size)), 0);
    };
    auto refused = [&](std::initializer_list<std::string> phrases) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto f = read_gguf(path_);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        ASSERT_FALSE(f) << "accepted";
        expect_mentions(f.error().what(), phrases);
        EXPECT_LT(s, 1.0) << "seconds to refuse it";
    };
    GgufDesc d = small();
    d.add_kv("tokenizer.ggml.tokens", code(T::Array), GgufDesc::array(code(T::String), (uint64_t{1} << 24) + 1));
    sparse(d, 8ull << 30);  // 2^24 + 1 empty strings fit in 8 GiB of zeros
    refused({"'tokenizer.ggml.tokens'", "an array of 16777217 elements, more than any model's"});
    // The array last, no tensors: the zeros of the sparse file are its 2^24 empty strings, 128 MiB of
    // lengths, within the array bound: the header's bound, checked as they are read, stops it.
    d = GgufDesc{};
    d.add_str("general.architecture", "llama");
    d.add_kv("tokenizer.ggml.tokens", code(T::Array), GgufDesc::array(code(T::String), uint64_t{1} << 24));
    sparse(d, 8ull << 30);
    const auto f = read_gguf(path_);
    EXPECT_TRUE(f.has_value()) << "2^24 empty strings are a valid, if odd, header of 128 MiB: " << f.error().what();
    GgufLimits tight;
    tight.max_header_bytes = 64ull << 20;
    const auto g = read_gguf(path_, tight);
    ASSERT_FALSE(g);
    expect_mentions(g.error().what(), {"larger than the limit of 67108864 bytes (in value of key 'tokenizer.ggml.tokens')"});
    d = small();
    d.n_kv = uint64_t{1} << 20;
    sparse(d, 8ull << 30);
    refused({"n_kv claims 1048576 entries, more than any model's"});
}

TEST_F(GgufMalformed, AlignmentZero) {
    GgufDesc d = small();
    d.add_u32("general.alignment", 0);
    expect_rejected(d, {"general.alignment is 0", at_byte(d.kv_offset(1))});
}

TEST_F(GgufMalformed, AlignmentNotPowerOfTwo) {
    GgufDesc d = small();
    d.add_u32("general.alignment", 48);
    expect_rejected(d, {"general.alignment 48 is not a power of two", at_byte(d.kv_offset(1))});
}

TEST_F(GgufMalformed, AlignmentHuge) {
    // A power of two, but data padded to 1 GiB boundaries is no real model.
    GgufDesc d = small();
    d.add_u32("general.alignment", 1u << 30);
    expect_rejected(d, {"general.alignment 1073741824 is larger than the limit",
                        at_byte(d.kv_offset(1))});
}

TEST_F(GgufMalformed, AlignmentNotU32) {
    // ggml reads it as u32 only; another type would make readers disagree on the layout.
    GgufDesc d = small();
    d.add_u64("general.alignment", 32);
    expect_rejected(d, {"general.alignment must be a u32, not u64", at_byte(d.kv_offset(1))});
}

// ---- Tensor directory -------------------------------------------------------------------------

TEST_F(GgufMalformed, DuplicateTensorName) {
    GgufDesc d = small();
    d.add_tensor("w", {8});
    expect_rejected(d, {"tensor name 'w' appears twice", at_byte(d.tensor_info_offset(1))});
}

TEST_F(GgufMalformed, DimensionCountOutOfRange) {
    for (uint32_t n_dims : {5u, 0u}) {
        GgufDesc d = small();
        d.tensors[0].n_dims = n_dims;
        expect_rejected(d, {"tensor 'w'", fmt::format("n_dims is {}", n_dims),
                            at_byte(d.tensor_dims_offset(0))});
    }
}

TEST_F(GgufMalformed, DimensionNotPositive) {
    for (int64_t ne1 : {0, -2}) {
        GgufDesc d = small();
        d.tensors[0].ne = {8, ne1};
        expect_rejected(d, {"tensor 'w'", fmt::format("dimension 1 is {}", ne1),
                            at_byte(d.tensor_dims_offset(0) + 4 + 8)});
    }
}

TEST_F(GgufMalformed, ElementCountOverflow) {
    GgufDesc d = small();
    d.tensors[0].ne = {int64_t{1} << 32, int64_t{1} << 32};  // 2^64 elements
    expect_rejected(d, {"tensor 'w'", "element count overflows", at_byte(d.tensor_dims_offset(0))});
}

TEST_F(GgufMalformed, ByteSizeOverflow) {
    // 2^62 elements fit in int64, but not their 2^65 bytes of F64.
    GgufDesc d = small();
    d.tensors[0].ne = {int64_t{1} << 31, int64_t{1} << 31};
    d.tensors[0].type = ggml::F64;
    expect_rejected(d, {"tensor 'w'", "byte size overflows", at_byte(d.tensor_dims_offset(0))});
    // One row of 2^62 F32 is already 2^64 bytes.
    d.tensors[0].ne = {int64_t{1} << 62};
    d.tensors[0].type = ggml::F32;
    expect_rejected(d, {"tensor 'w'", "row size overflows", at_byte(d.tensor_dims_offset(0))});
}

TEST_F(GgufMalformed, RowNotWholeBlocks) {
    GgufDesc d = small();
    d.tensors[0].ne = {100, 2};
    d.tensors[0].type = ggml::Q4_K;
    expect_rejected(d, {"tensor 'w'", "ne[0] = 100 is not a multiple of the Q4_K block size 256",
                        at_byte(d.tensor_dims_offset(0))});
}

TEST_F(GgufMalformed, RetiredTensorType) {
    // 31 is a type id ggml retired (Q4_0_4_4), named as such (a type this build does not know
    // yet, a newer ggml's, opens: GgufReader.ATensorOfANewerTypeOpensSpanningToTheNextTensor).
    GgufDesc d = small();
    d.tensors[0].type = 31;
    expect_rejected(d, {"tensor 'w'", "type 31 (Q4_0_4_4) was retired", at_byte(d.tensor_type_offset(0))});
}

TEST_F(GgufMalformed, MisalignedTensorOffset) {
    GgufDesc d = small();
    d.add_tensor("v", {8});
    d.tensors[1].offset = 36;
    expect_rejected(d, {"tensor 'v'", "offset 36 is not a multiple of the alignment 32",
                        at_byte(d.tensor_info_offset(1))});
}

TEST_F(GgufMalformed, OverlappingTensors) {
    GgufDesc d = small();
    d.tensors[0].ne = {16};  // bytes 0..64 of the data section
    d.add_tensor("v", {8});
    d.tensors[1].offset = 32;
    expect_rejected(d, {"tensor 'v'", "overlaps tensor 'w'", at_byte(d.tensor_info_offset(1))});
}

TEST_F(GgufMalformed, TensorOffsetPastEof) {
    GgufDesc d = small();
    d.add_tensor("v", {8});
    d.tensors[1].offset = 1 << 20;
    d.data_bytes = d.tensor_nbytes(0);
    expect_rejected(d, {"tensor 'v'", "past the end of the file",
                        at_byte(d.tensor_info_offset(1))});
}

TEST_F(GgufMalformed, TensorOffsetOverflows) {
    GgufDesc d = small();
    d.tensors[0].offset = ~uint64_t{31};  // aligned, but data_offset + offset wraps around
    d.data_bytes = 0;
    expect_rejected(d, {"tensor 'w'", "overflows", at_byte(d.tensor_info_offset(0))});
}

TEST_F(GgufMalformed, TruncatedDataSection) {
    GgufDesc d = small();
    d.add_tensor("v", {8});
    d.data_bytes = d.tensor_data_offset(1) + d.tensor_nbytes(1) - 1;
    expect_rejected(d, {"tensor 'v'", "truncated", at_byte(d.tensor_info_offset(1))});
}

// ---- Split sets -------------------------------------------------------------------------------

class GgufMalformedSplit : public ::testing::Test {
protected:
    std::string part(uint32_t i, uint32_t n = 3) const { return split_path(prefix_, i, n); }

    void write(const std::vector<GgufDesc>& parts) {
        for (uint32_t i = 0; i < parts.size(); ++i)
            write_file(part(i, static_cast<uint32_t>(parts.size())), parts[i].bytes());
    }

    // Fails the test unless opening `path` fails with a message holding every phrase.
    static void expect_rejected(const std::string& path,
                                std::initializer_list<std::string> phrases) {
        const auto parts = open_gguf_model(path);
        ASSERT_FALSE(parts) << path << " was accepted";
        expect_mentions(parts.error().what(), phrases);
    }

    TempDir dir_;
    const std::string prefix_ = dir_.file("model");
    std::vector<GgufDesc> parts_ = split_set(tiny_moe(), 3);
};

TEST_F(GgufMalformedSplit, MissingPart) {
    write_file(part(0), parts_[0].bytes());
    write_file(part(2), parts_[2].bytes());
    expect_rejected(part(0), {part(0), "part 2 of 3 is missing", part(1)});
    expect_rejected(part(2), {part(2), "part 2 of 3 is missing", part(1)});
}

TEST_F(GgufMalformedSplit, PartWithOtherSplitCount) {
    parts_[1].set_kv("split.count", code(T::U16), GgufDesc::u16(4));
    write(parts_);
    expect_rejected(part(0), {part(1), "does not belong to this split set", "found 1 of 4"});
}

TEST_F(GgufMalformedSplit, PartWithOtherSplitNo) {
    parts_[1].set_kv("split.no", code(T::U16), GgufDesc::u16(2));
    write(parts_);
    expect_rejected(part(0), {part(1), "does not belong to this split set",
                              "expected split.no 1 of split.count 3, found 2 of 3"});
}

TEST_F(GgufMalformedSplit, PartWithOtherTensorCount) {
    parts_[2].set_kv("split.tensors.count", code(T::I32), GgufDesc::i32(99));
    write(parts_);
    expect_rejected(part(0), {part(2), "does not belong to this split set",
                              "split.tensors.count is 99 here"});
}

TEST_F(GgufMalformedSplit, TensorCountDisagreesWithParts) {
    for (auto& p : parts_) p.set_kv("split.tensors.count", code(T::I32), GgufDesc::i32(99));
    write(parts_);
    expect_rejected(part(0), {part(0), "split.tensors.count says 99 tensors but the 3 parts hold"});
}

TEST_F(GgufMalformedSplit, TensorInTwoParts) {
    const std::string name = parts_[1].tensors[0].name;
    parts_[2].tensors.push_back(parts_[1].tensors[0]);
    write(parts_);
    expect_rejected(part(0), {part(2), fmt::format("tensor '{}' is also in part 2", name)});
}

TEST_F(GgufMalformedSplit, SplitCountDisagreesWithName) {
    // One file whose name says 3 parts; its metadata says 2, or that it is whole.
    for (uint16_t count : {2, 1}) {
        GgufDesc d = tiny_moe();
        d.add_kv("split.no", code(T::U16), GgufDesc::u16(0))
            .add_kv("split.count", code(T::U16), GgufDesc::u16(count));
        write_file(part(0), d.bytes());
        expect_rejected(part(0), {part(0), fmt::format("the name says 3 parts but split.count "
                                                       "says {}", count)});
    }
}

TEST_F(GgufMalformedSplit, SplitCountWithoutSplitName) {
    const std::string path = dir_.file("model.gguf");
    write_file(path, parts_[0].bytes());
    expect_rejected(path, {path, "does not follow NAME-0000i-of-0000N.gguf"});
}

// ---- Expert map -------------------------------------------------------------------------------

TEST(ExpertMapMalformed, BlockIndexPastBlockCount) {
    // The map is indexed by block number: a name like blk.4000000000.* must not size it, whether
    // block_count is there to check it against or not.
    const struct {
        const char* name;
        bool with_block_count;
    } cases[] = {
        {"blk.4000000000.ffn_up_exps.weight", true},
        {"blk.4000000000.ffn_up_exps.weight", false},
        {"blk.4294967295.ffn_up_shexp.weight", true},
    };
    for (const auto& c : cases) {
        SCOPED_TRACE(c.name);
        GgufDesc d = tiny_moe();
        if (!c.with_block_count)
            std::erase_if(d.kvs, [](const auto& kv) { return kv.key == "qwen3moe.block_count"; });
        d.add_tensor(c.name, {32, 32, 4});
        TempDir dir;
        write_file(dir.file("m.gguf"), d.bytes());
        const auto f = read_gguf(dir.file("m.gguf"));
        ASSERT_TRUE(f) << f.error().what();
        const auto map = ExpertMap::build({*f});
        ASSERT_FALSE(map) << "accepted";
        expect_mentions(map.error().what(),
                        {dir.file("m.gguf"), c.name, "past qwen3moe.block_count"});
    }
}

}  // namespace
}  // namespace moecache::test
