// The hook's copy kernel as PTX, for the hook (src/hook/copy_kernel.cpp) and the benchmark that
// measures it (bench/copy_cost_bench.cpp).
#pragma once

namespace moecache::cuda {

inline constexpr char kCopyKernelName[] = "moecache_copy16";

// copy16(dst, src, words): words 16-byte words, grid-stride. PTX of the oldest target that has
// everything it uses, so that any driver that runs the runtime compiles it for its device.
inline constexpr char kCopyKernelPtx[] = R"(
.version 7.0
.target sm_70
.address_size 64
.visible .entry moecache_copy16(.param .u64 p_dst, .param .u64 p_src, .param .u64 p_words)
{
    .reg .pred %p;
    .reg .u64 %rd<12>;
    .reg .u32 %r<6>;
    .reg .b32 %v<4>;
    ld.param.u64 %rd1, [p_dst];
    ld.param.u64 %rd2, [p_src];
    ld.param.u64 %rd3, [p_words];
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

}  // namespace moecache::cuda
