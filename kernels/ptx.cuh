/*
 * ptx.cuh — the PTX instruction wrappers every hand-written kernel uses: cp.async, ldmatrix,
 * mma.sync (sm_80+), programmatic dependent launch (sm_90), and the Hopper ones (sm_90a):
 * mbarriers, register hand-over (setmaxnreg), proxy fences, wgmma fences / commit / wait, the
 * wgmma shared-memory matrix descriptor, the wgmma accumulator operand lists and the K-major
 * shared-memory wgmma (wgmma_ss). One definition of each, shared by the flash-attention kernels
 * (attention_common.cuh and the files it serves), the grouped expert GEMM (moe_matmul.cu,
 * moe_matmul_wgmma.cuh) and the rows kernel (matmul_rows.cuh); what only one kernel family uses
 * with its own constants (named barriers, its other wgmma forms) stays with that family.
 *
 * Each wrapper is its instruction and operands and nothing else (the descriptor helpers: the bit
 * packing of the fields), all force-inlined: a kernel that calls these instead of private copies
 * of the same asm compiles to the same SASS.
 *
 * The sm_90a wrappers compile to their instruction only in the architecture-specific target
 * (-gencode arch=compute_90a,code=sm_90a, where nvcc defines __CUDA_ARCH_FEAT_SM90_ALL) and to
 * nothing elsewhere: the kernels that use them are themselves compiled only there (PTX_SM90A),
 * so the sources build for any target.
 */
#ifndef KERNELS_PTX_CUH
#define KERNELS_PTX_CUH

#include <cuda_runtime.h>
#include <stdint.h>

// 1 in the device pass of an sm_90a build (wgmma, setmaxnreg, mbarrier waits exist), else 0.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PTX_SM90A 1
#else
#define PTX_SM90A 0
#endif

// ----------------------------------------------------------------------------
// shared addresses, cp.async

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte global->shared copy; when !valid nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
// 4-byte global->shared copy (lse, D of one query); !valid: nothing read, zero written.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed cp.async groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// ----------------------------------------------------------------------------
// programmatic dependent launch (sm_90; the launch side is common.cuh cuda_launch)
//
// A kernel launched with programmatic stream serialization may start while the kernel before it
// in the stream is still running, once every block of that one has called pdl_trigger (or
// exited). pdl_wait blocks the thread until the kernel before has completed and its writes are
// visible; without the launch attribute both are no-ops. The rule of every kernel that calls
// them: nothing before pdl_wait reads what an earlier kernel may write or writes what it may
// read (only constants: weights of a recorded decode step). A kernel that waits before it
// triggers keeps the chain: the next one can only start once this one is past its own wait.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ----------------------------------------------------------------------------
// ldmatrix, mma.sync

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a (16x16, row-major) * b (16x8, col-major), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ----------------------------------------------------------------------------
// sm_90a: mbarriers, register hand-over

// mbarrier at shared address `bar` expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if PTX_SM90A
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Make the initialised mbarriers visible (to the async arrivals of cp.async as well).
__device__ __forceinline__ void mbar_init_fence() {
#if PTX_SM90A
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// Block until the phase of parity `parity` of the mbarrier has completed (acquire, CTA scope).
// The loop lives inside one asm statement (PTX scopes the labels to the braces), so the
// compiler sees straight-line code.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if PTX_SM90A
    asm volatile(
        "{\n.reg .pred P1;\n"
        "MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra MBAR_DONE;\n"
        "bra MBAR_WAIT;\n"
        "MBAR_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}
// Arrive (release, CTA scope) on the mbarrier.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if PTX_SM90A
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
                 : "memory");
#endif
}
// The same when pred holds; predicated, no branch.
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
#if PTX_SM90A
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 st;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar),
        "r"((int)pred)
        : "memory");
#endif
}
// One arrival on the mbarrier once every cp.async this thread issued so far has completed
// (.noinc: the arrival is one of the `count` the barrier was initialised with).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
#if PTX_SM90A
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Hand registers back to / take them from the SM's pool (whole warpgroup).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if PTX_SM90A
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if PTX_SM90A
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// ----------------------------------------------------------------------------
// sm_90a: fences, wgmma groups, register pinning, descriptors

// Order this thread's generic-proxy writes of shared memory (cp.async, st.shared, stmatrix)
// before later async-proxy reads of it (wgmma operands from shared memory).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if PTX_SM90A
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Order earlier register writes (accumulators, A fragments) before the next wgmmas read them.
__device__ __forceinline__ void wgmma_fence() {
#if PTX_SM90A
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if PTX_SM90A
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Wait until at most N of this warpgroup's committed wgmma groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if PTX_SM90A
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Pin accumulator / A-fragment registers at this point of the program: between a
// wgmma.mma_async and the wgmma.wait_group that retires it, its registers must not be touched,
// and these empty asm statements ("+f" / "+r" operands) keep the compiler from moving their reads
// or writes across the issue and wait points.
template <int NB>
__device__ __forceinline__ void wg_fence_acc(float (&d)[NB][4]) {
#pragma unroll
    for (int i = 0; i < NB; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e])::"memory");
}
template <int KS>
__device__ __forceinline__ void wg_fence_frag(uint32_t (&a)[KS][4]) {
#pragma unroll
    for (int i = 0; i < KS; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[i][e])::"memory");
}

// Operand list of accumulator block i (8 columns: registers d[i][0..3], fragment registers
// 4i .. 4i+3 in the PTX order) of a wgmma; the lists below are built from it.
#define WG_ACC4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])

// The accumulator operands of an m64nNk16 wgmma, N/2 fp32 registers a thread: WG_ACCr(d) are
// d[0 .. r/4)[4] as "+f" operands in the PTX order, WG_REGSr the matching "{%0, .., %r-1}" of the
// instruction (the operands after them are numbered from r).
#define WG_ACC16(d) WG_ACC4(d, 0), WG_ACC4(d, 1), WG_ACC4(d, 2), WG_ACC4(d, 3)
#define WG_ACC32(d) WG_ACC16(d), WG_ACC4(d, 4), WG_ACC4(d, 5), WG_ACC4(d, 6), WG_ACC4(d, 7)
#define WG_ACC48(d) WG_ACC32(d), WG_ACC4(d, 8), WG_ACC4(d, 9), WG_ACC4(d, 10), WG_ACC4(d, 11)
#define WG_ACC64(d) WG_ACC48(d), WG_ACC4(d, 12), WG_ACC4(d, 13), WG_ACC4(d, 14), WG_ACC4(d, 15)
#define WG_ACC128(d)                                                                          \
    WG_ACC64(d), WG_ACC4(d, 16), WG_ACC4(d, 17), WG_ACC4(d, 18), WG_ACC4(d, 19),              \
        WG_ACC4(d, 20), WG_ACC4(d, 21), WG_ACC4(d, 22), WG_ACC4(d, 23), WG_ACC4(d, 24),       \
        WG_ACC4(d, 25), WG_ACC4(d, 26), WG_ACC4(d, 27), WG_ACC4(d, 28), WG_ACC4(d, 29),       \
        WG_ACC4(d, 30), WG_ACC4(d, 31)
#define WG_R0_15                                                                                  \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "                                       \
    "%12, %13, %14, %15"
#define WG_R16_31                                                                                 \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "                             \
    "%28, %29, %30, %31"
#define WG_R32_47                                                                                 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "                             \
    "%44, %45, %46, %47"
#define WG_R48_63                                                                                 \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "                             \
    "%60, %61, %62, %63"
#define WG_R64_127                                                                                \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, "                             \
    "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, "                             \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, "                             \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                 \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, "                 \
    "%124, %125, %126, %127"
#define WG_REGS16 "{" WG_R0_15 "}"
#define WG_REGS32 "{" WG_R0_15 ", " WG_R16_31 "}"
#define WG_REGS48 "{" WG_R0_15 ", " WG_R16_31 ", " WG_R32_47 "}"
#define WG_REGS64 "{" WG_R0_15 ", " WG_R16_31 ", " WG_R32_47 ", " WG_R48_63 "}"
#define WG_REGS128 "{" WG_R0_15 ", " WG_R16_31 ", " WG_R32_47 ", " WG_R48_63 ", " WG_R64_127 "}"

// d (64 x N, f32) = A (64 x 16, bf16) · B (16 x N, bf16) + (scale_d ? d : 0), one warpgroup, A
// and B from shared memory through descriptors, both K-major: the SS form of the flash-attention
// kernels (attention_common.cuh WgmmaBf16) and the rows kernel (matmul_rows.cuh). Operands after
// the accumulators: A descriptor, B descriptor, scale-d (a predicate set from the int),
// imm-scale-a = imm-scale-b = 1 (no negation), imm-trans-a = imm-trans-b = 0. N = 32, 64, 96, 128.
#define WG_SS_ASM(SHAPE, REGS, ACC, OA, OB, OP)                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " OP ", 0;\n"                            \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 " REGS ", " OA ", " OB  \
                 ", p, 1, 1, 0, 0;\n}\n"                                                      \
                 : ACC                                                                        \
                 : "l"(da), "l"(db), "r"(scale_d)                                             \
                 : "memory")
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db,
                                         int scale_d) {
    static_assert(N == 32 || N == 64 || N == 96 || N == 128, "wgmma_ss: N = 32, 64, 96 or 128");
#if PTX_SM90A
    if constexpr (N == 32)
        WG_SS_ASM("m64n32k16", WG_REGS16, WG_ACC16(d), "%16", "%17", "%18");
    else if constexpr (N == 64)
        WG_SS_ASM("m64n64k16", WG_REGS32, WG_ACC32(d), "%32", "%33", "%34");
    else if constexpr (N == 96)
        WG_SS_ASM("m64n96k16", WG_REGS48, WG_ACC48(d), "%48", "%49", "%50");
    else
        WG_SS_ASM("m64n128k16", WG_REGS64, WG_ACC64(d), "%64", "%65", "%66");
#endif
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle, base offset 0 (64 bits):
//   bits  0-13  start address >> 4        bits 16-29  leading-dimension byte offset (LBO) >> 4
//   bits 32-45  stride-dimension byte offset (SBO) >> 4
//   bits 49-51  base offset = 0 (every start address lies in row 0 of a 1024-byte swizzle atom)
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle
// Every field fits its 14 bits: shared addresses are below 228 KB.
#define PTX_WG_DESC_SW128 1ull
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return (uint64_t)((addr >> 4) & 0x3FFF) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | (PTX_WG_DESC_SW128 << 62);
}
// The start address is the low field: moving a descriptor by `bytes` (a multiple of 16) adds
// bytes >> 4 there. No carry into bit 14 is possible: every address is below 228 KB (< 2^18).
__device__ __forceinline__ uint64_t wg_desc_add(uint64_t desc, uint32_t bytes) {
    return desc + (uint64_t)(bytes >> 4);
}

#endif  // KERNELS_PTX_CUH
