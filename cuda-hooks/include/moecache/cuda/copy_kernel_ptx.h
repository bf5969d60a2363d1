// The hook's copy kernel as PTX, for the hook (src/hook/copy_kernel.cpp) and the benchmark that
// measures it (bench/copy_cost_bench.cpp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>

namespace moecache::cuda {

inline constexpr char kCopyKernelName[] = "moecache_copy16";
// copy16_n(dst0, src0, words0, ..., dst7, src7, words7): the range of the block's y index (the grid
// has as many rows as ranges), each as copy16 copies it: several slices in one launch.
inline constexpr char kCopyKernelNName[] = "moecache_copy16_n";
inline constexpr unsigned kCopyKernelNRanges = 8;

namespace copy_kernel_ptx {

// The pieces' text, one after another (each without its terminating zero), and one zero.
template <std::size_t... N>
constexpr std::array<char, (N + ...) - sizeof...(N) + 1> concat(const char (&... parts)[N]) {
    std::array<char, (N + ...) - sizeof...(N) + 1> out{};
    std::size_t at = 0;
    ((std::copy_n(parts, N - 1, out.begin() + static_cast<std::ptrdiff_t>(at)), at += N - 1), ...);
    return out;
}

inline constexpr char kHeader[] = R"(
.version 7.0
.target sm_70
.address_size 64
)";
// Both entries' registers.
inline constexpr char kRegisters[] = R"(
    .reg .pred %p, %q;
    .reg .u64 %rd<12>;
    .reg .u32 %r<6>;
    .reg .b32 %v<4>;
)";
// Once %rd1-%rd3 hold a range's dst, src and 16-byte word count: its copy, grid-stride over the
// blocks of the grid's x dimension, and the entry's end.
inline constexpr char kRange[] = R"(
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
LOOP:
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    shl.b64 %rd7, %rd4, 4;
    add.u64 %rd8, %rd2, %rd7;
    ld.global.v4.u32 {%v0, %v1, %v2, %v3}, [%rd8];
    add.u64 %rd9, %rd1, %rd7;
    st.global.v4.u32 [%rd9], {%v0, %v1, %v2, %v3};
    add.u64 %rd4, %rd4, %rd6;
    bra LOOP;
DONE:
    ret;
}
)";
inline constexpr char kCopy16[] =
    R"(.visible .entry moecache_copy16(.param .u64 p_dst, .param .u64 p_src, .param .u64 p_words)
{)";
inline constexpr char kCopy16Range[] = R"(
    ld.param.u64 %rd1, [p_dst];
    ld.param.u64 %rd2, [p_src];
    ld.param.u64 %rd3, [p_words];)";
// clang-format off
inline constexpr char kCopy16N[] = R"(.visible .entry moecache_copy16_n(.param .u64 p_d0, .param .u64 p_s0, .param .u64 p_w0, .param .u64 p_d1, .param .u64 p_s1, .param .u64 p_w1, .param .u64 p_d2, .param .u64 p_s2, .param .u64 p_w2, .param .u64 p_d3, .param .u64 p_s3, .param .u64 p_w3, .param .u64 p_d4, .param .u64 p_s4, .param .u64 p_w4, .param .u64 p_d5, .param .u64 p_s5, .param .u64 p_w5, .param .u64 p_d6, .param .u64 p_s6, .param .u64 p_w6, .param .u64 p_d7, .param .u64 p_s7, .param .u64 p_w7)
{)";
inline constexpr char kCopy16NRange[] = R"(
    mov.u32 %r5, %ctaid.y;
    ld.param.u64 %rd1, [p_d0];
    ld.param.u64 %rd2, [p_s0];
    ld.param.u64 %rd3, [p_w0];
    setp.eq.u32 %q, %r5, 1;
    @%q ld.param.u64 %rd1, [p_d1];
    @%q ld.param.u64 %rd2, [p_s1];
    @%q ld.param.u64 %rd3, [p_w1];
    setp.eq.u32 %q, %r5, 2;
    @%q ld.param.u64 %rd1, [p_d2];
    @%q ld.param.u64 %rd2, [p_s2];
    @%q ld.param.u64 %rd3, [p_w2];
    setp.eq.u32 %q, %r5, 3;
    @%q ld.param.u64 %rd1, [p_d3];
    @%q ld.param.u64 %rd2, [p_s3];
    @%q ld.param.u64 %rd3, [p_w3];
    setp.eq.u32 %q, %r5, 4;
    @%q ld.param.u64 %rd1, [p_d4];
    @%q ld.param.u64 %rd2, [p_s4];
    @%q ld.param.u64 %rd3, [p_w4];
    setp.eq.u32 %q, %r5, 5;
    @%q ld.param.u64 %rd1, [p_d5];
    @%q ld.param.u64 %rd2, [p_s5];
    @%q ld.param.u64 %rd3, [p_w5];
    setp.eq.u32 %q, %r5, 6;
    @%q ld.param.u64 %rd1, [p_d6];
    @%q ld.param.u64 %rd2, [p_s6];
    @%q ld.param.u64 %rd3, [p_w6];
    setp.eq.u32 %q, %r5, 7;
    @%q ld.param.u64 %rd1, [p_d7];
    @%q ld.param.u64 %rd2, [p_s7];
    @%q ld.param.u64 %rd3, [p_w7];)";
// clang-format on

inline constexpr auto kText =
    concat(kHeader, kCopy16, kRegisters, kCopy16Range, kRange, kCopy16N, kRegisters, kCopy16NRange, kRange);

}  // namespace copy_kernel_ptx

// copy16(dst, src, words): words 16-byte words, grid-stride; copy16_n the same for each of up to
// eight ranges. PTX of the oldest target that has everything it uses, so that any driver that runs
// the runtime compiles it for its device.
inline constexpr const char* kCopyKernelPtx = copy_kernel_ptx::kText.data();

}  // namespace moecache::cuda
