/*
 * attention_wgmma.cuh — causal grouped-query flash-attention FORWARD on Hopper warpgroup MMAs
 * (wgmma.mma_async, sm_90a only), warp-specialised: what attention_forward_bf16 runs for HD 64
 * and 128 when the device code was built for sm_90a (the Makefile's default GPU_ARCH). Part of
 * kernels/attention.cu, which includes it after its own helpers (smem_u32, cp_async_16,
 * fast_exp2, pack_bf16, acc_to_frag_a, attention_check*, attention_forward_check); not a
 * stand-alone header. The wgmma backward (attention_bwd_wgmma.cuh) shares its helpers below.
 * dev/cuda/attention_wgmma.cuh forwards here, so the lab times this code.
 * Same contract as the mma.sync forward: packed qkv rows [q heads | k heads | v heads], query
 * head h reads kv head h / (H/KVH) with no K/V copies, causal (key j visible to query i iff
 * j <= i), bf16 out, lse = natural-log log-sum-exp of the scaled logits per (b, h, t) for the
 * backward, rows past T zero-filled and never stored, 64-bit offsets. HD 64 and 128 only.
 *
 * Validated on an H200 (session 6) in dev/cuda/attention.cu: 163 cases (causal, GQA, odd T, HD
 * 64 and 128) twice each, bit-identical repeats, relative L2 error ~2e-3, the big case (B=3
 * T=131072 H=32 KVH=8) compared whole with the C interface; compute-sanitizer memcheck,
 * synccheck and racecheck clean on a case that wraps the 3-stage rings. Its outputs are bit for
 * bit those of the previous production kernel (one CTA of two warpgroups that all loaded K/V
 * with cp.async and met at a __syncthreads per kv tile; same tiles, same arithmetic). Forward
 * TFLOP/s at HD=128 H=16 KVH=8 (median of 10), previous kernel -> this one with 3-stage rings
 * (k3v3) / 2-stage rings (k2v2): T=2048 B=16 396 -> 460 / 455; T=4096 B=4 403 -> 492 / 496;
 * T=16384 B=2 486 -> 607 / 556; T=65536 B=1 506 -> 562 / 589; B=3 T=131072 H=32 474 -> 562 /
 * 579. The C interface takes k3v3 below 32768 tokens and k2v2 from there on (kernels/attention.cu).
 * Measured and dropped: no ping-pong (462 / 496 / 558 / 574: worse from T=16384), a writer-side
 * proxy fence instead of cp.async.mbarrier.arrive (419 / 495 / 549 / 572).
 *
 * ---------------------------------------------------------------------------------------------
 * Work decomposition
 *   One CTA of 384 threads = 3 warpgroups per (query tile of BR = 128 rows, query head, batch);
 *   grid x = h + H*b, y = query tile counted from the last (longest rows first), as in
 *   kernels/attention.cu. Warpgroups 0 and 1 are CONSUMERS: warpgroup w owns query rows
 *   [q0 + 64w, q0 + 64w + 64) of every product (the wgmma M dimension is 64; inside a warpgroup
 *   warp v = warp % 4 holds rows 16v..16v+15 of each accumulator, so no reduction ever crosses
 *   warps). Warpgroup 2 is the PRODUCER: it copies Q and the K/V tiles (BC = 128 keys) into
 *   shared-memory rings with cp.async and publishes each through an mbarrier; the consumers
 *   never meet at a CTA-wide barrier in the loop, only wait for their data and their turn.
 *   Registers: the register file is split across the SM's 4 sub-partitions and warp w runs on
 *   sub-partition w % 4; the launch gets 65536 / 384 = 168 registers per thread, then the
 *   producer hands registers back (setmaxnreg.dec 24) and the consumers take them
 *   (setmaxnreg.inc 240): per sub-partition 2 x 240 + 24 = 504 <= 512 per lane, the CTA's pool
 *   (12 warps x 168 = 8 x 240 + 4 x 24). ptxas compiles each branch for its budget (consumers
 *   ~184 registers at HD=128, producer < 24; no spills).
 *
 * Producer: Q, K_0, then for t = 0 .. n_tiles-1: K_{t+1} (if any), V_t. Tile u goes to stage
 *   s = u % S of its ring (S = SK or SV stages); for u >= S it first waits for completion
 *   u/S - 1 of empty[s] (try_wait.parity, parity ((u/S) & 1) ^ 1): both consumer warpgroups
 *   have retired every wgmma that read tile u - S. Publication: each producer thread's
 *   cp.async.mbarrier.arrive.noinc on full[s] (128 expected arrivals) after its copies of the
 *   tile: the hardware arrives once every cp.async the thread issued so far has landed. The
 *   producer exits after commit + wait_group 0 (no copy left in flight behind it).
 *
 * Consumer warpgroup w, per kv tile; the P V product lags one tile behind so that the tensor
 * cores have work while the softmax runs (S_j = Q K_j^T: SS wgmma, Q and K from shared memory;
 * P V: RS wgmma, P from registers, V from shared memory):
 *   tile 0:  wait full_q, full_k[0]; fence; [turn]; issue S_0; [pass the turn]; wait_group 0;
 *            release K_0; softmax(S_0)
 *   step j = 1 .. n_tiles-1:
 *            wait_group 0            P_{j-2} V_{j-2} retired -> release V_{j-2} (j >= 2)
 *            p = bf16(P_{j-1}); O *= alpha_{j-1}     (s still holds P_{j-1} in fp32)
 *            wait full_k[j % SK], full_v[(j-1) % SV] (parities (j/SK)&1, ((j-1)/SV)&1)
 *            fence.proxy.async; [turn]
 *            issue S_j; issue O += P_{j-1} V_{j-1}; [pass the turn]
 *            wait_group 1            S_j retired -> release K_j
 *            mask (diagonal tiles only); online softmax in base 2 -> s = P_j (fp32), alpha_j
 *   tail:    wait_group 0 -> release V_{n-2}; convert, rescale; wait full_v[(n-1) % SV]; fence;
 *            [turn]; issue P_{n-1} V_{n-1}; [pass]; wait_group 0; warpgroup 0 consumes
 *            warpgroup 1's last turn arrival; epilogue (O / l, lse)
 *   Invariant: at the top of step j, O holds tiles <= j-2 at the scale of the running maximum
 *   m_{j-2}; alpha_{j-1} = 2^(m_{j-2} - m_{j-1}) brings it to m_{j-1} just before P_{j-1} V_{j-1}
 *   (at m_{j-1}) is added. A release is one mbarrier.arrive (release) per warp by lane 0 after
 *   the warp's wait_group: empty barriers expect 8 arrivals (every warp's slice of a wgmma reads
 *   all of B, K or V). Why the retiring wait_group 0 sits at the top of the next step and not
 *   after the softmax: ptxas schedules a WARPGROUP.DEPBAR as early as its basic block allows,
 *   whatever the PTX order, which would serialise it with the softmax; the back edge keeps it
 *   after. All wgmma issues and waits are on straight-line, CTA-uniform code (ptxas serialises
 *   wgmmas it cannot follow through branches: C7514/C7518/C7520 in the build log): both
 *   warpgroups walk all n_tiles tiles of the CTA (tiles holding keys <= its last row); a
 *   warpgroup whose rows are all past T computes rows nobody stores (Q rows zero: finite).
 *
 * Ping-pong (FA3's scheme): named barriers 1 and 2 over the 256 consumer threads ("turns").
 *   Warpgroup w syncs on 1 + w before each issue phase and arrives on 2 - w after it; warpgroup
 *   1 arrives on 1 once up front, so warpgroup 0 issues first; both run n_tiles + 1 issue phases
 *   and warpgroup 0 syncs once more after the loop: nothing is left half-complete. Steady state:
 *   while one warpgroup's products run on the tensor cores, the other does its softmax (alone
 *   on the MUFU) and queues its next products behind them.
 *
 * Deadlock freedom (checked at random by dev/cuda/attention_fwd_ws_model.py: producer and
 * consumers as program order, landings and completions at random moments, exact mbarrier
 * parity semantics): the producer's loads are in the fixed order K_0, K_1, V_0, K_2, V_1, ...;
 * the release a load waits for (K_u: S_{u-SK} retired; V_u: P_{u-SV} V_{u-SV} retired) needs
 * only tiles loaded EARLIER in that order (for SK, SV >= 2), in both warpgroups; the turns only
 * order issue phases whose data both warpgroups wait for identically. Phases cannot alias: a
 * full barrier's next phase needs the producer past the empty barrier that the consumers of
 * the current phase release, and conversely.
 *
 * Cross-proxy visibility: cp.async writes shared memory through the generic proxy, wgmma reads
 * it through the async proxy. As CUTLASS's cp.async GMMA mainloops, the consumer acquires the
 * full barrier (completed by cp.async.mbarrier.arrive) and then, as a margin, executes
 * fence.proxy.async before the wgmma. The reverse order (async-proxy reads, then a stage
 * refilled by generic writes): a wgmma's completion observed by wait_group "is followed by an
 * implicit generic-async proxy fence" (PTX ISA), and the release/acquire chain of the empty
 * barrier orders it before the new copies.
 *
 * ---------------------------------------------------------------------------------------------
 * Shared-memory layout: 128-byte swizzle ("SW128"), the same for Q, K and V
 *   A tile of R rows x HD bf16 columns is cut into HD/64 column panels of 64 columns = 128 bytes:
 *     byte offset of (row r, 16-byte chunk c of the row, c = column/8 in 0..HD/8-1) =
 *         (c / 8) * R * 128            panel (R rows of 128 bytes each)
 *       + r * 128                      row inside the panel
 *       + ((c % 8) ^ (r % 8)) * 16     chunk, XOR-swizzled with the row's position in its 8-row
 *                                      group
 *   Every panel starts on a 1024-byte boundary (R is a multiple of 8 and the base is 1024-aligned),
 *   so r % 8 equals address bits [7:9] and (c % 8) the unswizzled address bits [4:6]: this is the
 *   hardware's 128B swizzle, physical bits [4:6] = logical bits [4:6] XOR bits [7:9], applied to
 *   the address. An 8-row x 128-byte block (1024 bytes) is one swizzle atom.
 *
 * wgmma shared-memory matrix descriptor (64 bits; see wg_desc):
 *   bits  0-13  start address >> 4        bits 16-29  leading-dimension byte offset (LBO) >> 4
 *   bits 32-45  stride-dimension byte offset (SBO) >> 4
 *   bits 49-51  base offset = 0: every start address below has address bits [7:9] = 0, i.e. starts
 *               at row 0 of a swizzle atom (start offsets inside an atom are 0/32/64/96 bytes)
 *   bits 62-63  swizzle mode: 1 = 128B swizzle
 *
 * Operands (K-major = the reduction dimension is contiguous, MN-major = M or N contiguous):
 *   S = Q K^T, m64nBCk16, HD/16 k-steps kk (hd columns 16kk .. 16kk+15):
 *     A = Q, K-major (imm-trans-a 0), 64 rows of this warpgroup:
 *       start = sQ + (kk/4) * BR*128 [panel] + w * 64*128 [warpgroup's rows] + (kk%4) * 32
 *       The k-step's 16 columns = 32 bytes inside each 128-byte row; 8-row groups every
 *       SBO = 8 * 128 = 1024 bytes; LBO is not used by swizzled K-major layouts (set to 16 bytes,
 *       encoded 1). Advancing the start address by 32 bytes inside the atom (what CUTLASS-style
 *       descriptor iterators do) relies on the swizzle being a function of the final address
 *       bits: bits [7:9] stay those of the row, and the ISA's base offset is 0 because the
 *       pattern (the atom) starts on a 1024-byte boundary.
 *     B = K tile [key][hd], K-major (imm-trans-b 0), N = BC keys:
 *       start = sK[stage] + (kk/4) * BC*128 + (kk%4) * 32; SBO = 1024 (next 8 keys); LBO unused.
 *   O += P V, m64nHDk16, BC/16 k-steps kk (keys 16kk .. 16kk+15):
 *     A = P from registers (below).
 *     B = V tile [key][hd]: B is (K = keys) x (N = hd) with N contiguous, i.e. MN-major
 *       (imm-trans-b 1). PTX ISA canonical MN-major 128B-swizzle layout (T = 8 bf16 = 16 bytes):
 *       Swizzle<3,4,3> o ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO))
 *       i.e. an atom is 8 keys x 64 hd columns (8 rows of 128 bytes, swizzled as above); the next
 *       8 keys are SBO further, the next 64 hd columns (next atom along N) LBO further. (The
 *       ISA's 64B-swizzle bf16 example, ((8,4,2),(8,2)):((1,8,256),(32,512)), LBO = 256
 *       elements, SBO = 512 elements, shows the same roles.) Here:
 *       start = sV[stage] + kk * 16*128   (16 keys of 128 bytes: 1024-aligned)
 *       SBO = 1024 (keys 8..15 of the k-step follow keys 0..7 inside the panel)
 *       LBO = BC*128 (hd columns 64..127 are in the second panel, BC rows further); only read
 *             when HD = 128 (HD = 64 has one panel, N = 64 = one atom).
 *   All fields fit their 14 bits: addresses < 228 KB -> < 14592; LBO = BC*128 >> 4 = 8*BC <= 1024.
 *
 * Register fragments (PTX ISA "Matrix fragments for wgmma .m64nNk16"; per warp 16 rows, warp v
 * of the warpgroup rows 16v..16v+15; g = lane/4, t = lane%4):
 *   accumulator (f32, N/2 registers): d[4i + e], i = 0..N/8-1 (8-column block), e = 0..3:
 *       row 16v + g + 8*(e/2), column 8i + 2t + (e%2)
 *     = the mma.sync m16n8 C layout repeated over the N/8 blocks; stored here as acc[i][e].
 *   A in registers (bf16, 4 x .b32 holding a0..a7), one 64x16 k-step:
 *       reg 0 = (row g,   cols 2t, 2t+1)     reg 1 = (row g+8, cols 2t, 2t+1)
 *       reg 2 = (row g,   cols 2t+8, 2t+9)   reg 3 = (row g+8, cols 2t+8, 2t+9)
 *     = the mma.sync m16n8k16 A layout. So k-step kk of P V (keys 16kk..16kk+15) takes S blocks
 *     2kk (keys 16kk + 2t, +1 -> cols 2t, 2t+1) and 2kk+1 (keys 16kk + 8 + 2t, +1):
 *       reg 0 = pack(s[2kk][0], s[2kk][1])      reg 1 = pack(s[2kk][2], s[2kk][3])
 *       reg 2 = pack(s[2kk+1][0], s[2kk+1][1])  reg 3 = pack(s[2kk+1][2], s[2kk+1][3])
 *     exactly acc_to_frag_a of kernels/attention.cu: no data moves between threads.
 *
 * Async-register discipline: between a wgmma.mma_async and the wgmma.wait_group that retires it,
 * its accumulator and A registers must not be touched. wg_fence_acc/wg_fence_frag (empty asm with
 * "+f"/"+r" operands) pin those registers at the issue and wait points so that the compiler
 * cannot move their reads or writes across; wgmma.fence orders earlier register writes (softmax,
 * rescale, conversion) before the next batch of wgmma reads them. ptxas reports any wgmma it had
 * to serialise; the build log of this file has none (nvcc -Xptxas -v, sm_90a).
 * ---------------------------------------------------------------------------------------------
 */
#ifndef KERNELS_ATTENTION_WGMMA_CUH
#define KERNELS_ATTENTION_WGMMA_CUH

// wgmma exists only in the architecture-specific target sm_90a (-gencode
// arch=compute_90a,code=sm_90a), where nvcc defines __CUDA_ARCH_FEAT_SM90_ALL. Every wgmma and
// proxy-fence asm below is compiled only there, and the kernel body elsewhere is a trap, so the
// file also builds for any other target (-arch=sm_90, sm_80, ...). attention_wgmma_available()
// (below) then says no: attention_forward_bf16 / attention_backward_bf16 run the mma.sync
// kernels instead, the lab's variants are skipped.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_WG_ENABLED 1
#else
#define ATTN_WG_ENABLED 0
#endif

#define ATTN_WG_THREADS 128        // one warpgroup: 4 consecutive warps
#define ATTN_WG_ROWS 64            // wgmma M: query rows per warpgroup
#define ATTN_WG_K 16               // wgmma K for bf16
#define ATTN_SW128_ROW_BYTES 128   // one swizzled row: 64 bf16
#define ATTN_SW128_PANEL_COLS 64   // bf16 columns per 128-byte row = per panel
#define ATTN_SW128_ATOM_BYTES 1024 // 8 rows x 128 bytes: swizzle period, alignment of every atom
#define ATTN_SW128_MODE 1ull       // descriptor bits 62-63: 1 = 128-byte swizzle

// ----------------------------------------------------------------------------
// device helpers (sm_90a)

// Byte offset of 16-byte chunk c (columns 8c..8c+7) of row r in a SW128 tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128_offset(int r, int c, int rows) {
    return (uint32_t)((c >> 3) * rows * ATTN_SW128_ROW_BYTES + r * ATTN_SW128_ROW_BYTES +
                      (((c & 7) ^ (r & 7)) << 4));
}

// Offset of k-step kk (16 columns = 32 bytes) inside a K-major SW128 tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128_kstep_offset(int kk, int rows) {
    constexpr int KSTEPS_PER_PANEL = ATTN_SW128_PANEL_COLS / ATTN_WG_K;  // 4
    return (uint32_t)((kk / KSTEPS_PER_PANEL) * rows * ATTN_SW128_ROW_BYTES +
                      (kk % KSTEPS_PER_PANEL) * ATTN_WG_K * (int)sizeof(bf16));
}

// Shared-memory matrix descriptor, 128-byte swizzle, base offset 0 (fields in the header).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return (uint64_t)((addr >> 4) & 0x3FFF) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | (ATTN_SW128_MODE << 62);
}
// The start address is the low field: moving a descriptor by `bytes` (a multiple of 16) adds
// bytes >> 4 there. No carry into bit 14 is possible: every address is below 228 KB (< 2^18).
__device__ __forceinline__ uint64_t wg_desc_add(uint64_t desc, uint32_t bytes) {
    return desc + (uint64_t)(bytes >> 4);
}

// Copy rows [row0, row0+ROWS) x HD columns of one head into a SW128 tile at shared address
// `tile`, asynchronously; rows >= T are zero-filled (nothing read). Thread tid always copies
// 16-byte chunk c = tid % CHUNKS of rows r0 + k*RSTEP (r0 = tid / CHUNKS, RSTEP = NTHREADS /
// CHUNKS): consecutive threads read consecutive chunks of a row (coalesced), and since RSTEP is a
// multiple of 8 the swizzle phase r % 8 is the same for all of a thread's rows, so one source
// pointer and one shared address, stepped by constants, serve every chunk (few live registers).
template <int ROWS, int HD, int NTHREADS>
__device__ __forceinline__ void sw128_tile_load_async(uint32_t tile, const bf16* base,
                                                      int64_t stride, int row0, int T, int tid) {
    constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
    constexpr int RSTEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0,
                  "each thread copies one chunk column, rows RSTEP apart, same swizzle phase");
    const int c = tid % CHUNKS, r0 = tid / CHUNKS;
    const bf16* src = base + (int64_t)(row0 + r0) * stride + c * 8;
    const uint32_t dst = tile + sw128_offset(r0, c, ROWS);
#pragma unroll
    for (int k = 0; k < ROWS / RSTEP; k++) {
        const bool valid = row0 + r0 + k * RSTEP < T;
        cp_async_16(dst + k * RSTEP * ATTN_SW128_ROW_BYTES, valid ? src : base, valid);
        src += RSTEP * stride;
    }
}

__device__ __forceinline__ void fence_proxy_async_shared() {
#if ATTN_WG_ENABLED
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_fence() {
#if ATTN_WG_ENABLED
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if ATTN_WG_ENABLED
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Wait until at most N of this warpgroup's committed wgmma groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if ATTN_WG_ENABLED
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Pin accumulator / A-fragment registers at this point of the program (see the header).
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

// Operand lists of the accumulator: block i of 8 columns = registers d[i][0..3], in the PTX
// order d0, d1, ... (d[i][e] is fragment register 4i + e).
#define ATTN_WG_ACC4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define ATTN_WG_ACC32(d)                                                                       \
    ATTN_WG_ACC4(d, 0), ATTN_WG_ACC4(d, 1), ATTN_WG_ACC4(d, 2), ATTN_WG_ACC4(d, 3),           \
        ATTN_WG_ACC4(d, 4), ATTN_WG_ACC4(d, 5), ATTN_WG_ACC4(d, 6), ATTN_WG_ACC4(d, 7)
#define ATTN_WG_ACC64(d)                                                                       \
    ATTN_WG_ACC32(d), ATTN_WG_ACC4(d, 8), ATTN_WG_ACC4(d, 9), ATTN_WG_ACC4(d, 10),            \
        ATTN_WG_ACC4(d, 11), ATTN_WG_ACC4(d, 12), ATTN_WG_ACC4(d, 13), ATTN_WG_ACC4(d, 14),   \
        ATTN_WG_ACC4(d, 15)
#define ATTN_WG_REGS32                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTN_WG_REGS64                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "  \
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "  \
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x N, f32) = A (64 x 16, bf16) * B (16 x N, bf16) + (scale_d ? d : 0), one warpgroup.
//   ss: A and B from shared memory through descriptors, both K-major (imm-trans-a = imm-trans-b
//       = 0). Operands after the accumulators: A descriptor, B descriptor, scale-d (a predicate,
//       set from the int), imm-scale-a = 1, imm-scale-b = 1 (no negation), imm-trans-a,
//       imm-trans-b.
//   rs: A from four registers (layout in the header), B MN-major from shared memory
//       (imm-trans-b = 1); the register form has no imm-trans-a.
template <int N>
struct WgmmaBf16;

template <>
struct WgmmaBf16<64> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t da, uint64_t db,
                                              int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATTN_WG_REGS32
            ", %32, %33, p, 1, 1, 0, 0;\n}\n"
            : ATTN_WG_ACC32(d)
            : "l"(da), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
    static __device__ __forceinline__ void rs_trans_b(float (&d)[8][4], const uint32_t (&a)[4],
                                                      uint64_t db, int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATTN_WG_REGS32
            ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
            : ATTN_WG_ACC32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
};

template <>
struct WgmmaBf16<128> {
    static __device__ __forceinline__ void ss(float (&d)[16][4], uint64_t da, uint64_t db,
                                              int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " ATTN_WG_REGS64
            ", %64, %65, p, 1, 1, 0, 0;\n}\n"
            : ATTN_WG_ACC64(d)
            : "l"(da), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
    static __device__ __forceinline__ void rs_trans_b(float (&d)[16][4], const uint32_t (&a)[4],
                                                      uint64_t db, int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " ATTN_WG_REGS64
            ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : ATTN_WG_ACC64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
};

// ----------------------------------------------------------------------------
// forward kernel: shape of a CTA

#define ATTN_WGF_NWG 2                                      // consumer warpgroups per CTA
#define ATTN_WGF_BC 128                                     // keys per K/V tile
#define ATTN_WGF_CONSUMERS (ATTN_WGF_NWG * ATTN_WG_THREADS) // 256 consumer threads
#define ATTN_WGF_PRODUCERS ATTN_WG_THREADS                  // warpgroup 2: the producer
#define ATTN_WGF_THREADS (ATTN_WGF_CONSUMERS + ATTN_WGF_PRODUCERS)  // 384 threads per CTA
#define ATTN_WGF_MBAR_BYTES 128                             // room for the mbarriers (<= 16)
// Registers per thread after setmaxnreg: per SM sub-partition (16384 registers, one warp of each
// warpgroup) 2 * 240 + 24 = 504 <= 512 registers per lane. The launch itself gets
// 65536 / 384 = 168 (what ptxas reports as "Used 168 registers").
#define ATTN_WGF_CONSUMER_REGS 240
#define ATTN_WGF_PRODUCER_REGS 24

// ----------------------------------------------------------------------------
// device helpers (sm_90a): mbarriers, named barriers

// mbarrier at shared address `bar` expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if ATTN_WG_ENABLED
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Make the initialised mbarriers visible (to the async arrivals of cp.async as well).
__device__ __forceinline__ void mbar_init_fence() {
#if ATTN_WG_ENABLED
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// Block until the phase of parity `parity` of the mbarrier has completed (acquire, CTA scope).
// The loop lives inside one asm statement (PTX scopes the labels to the braces), so the
// compiler sees straight-line code.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if ATTN_WG_ENABLED
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
// Arrive (release, CTA scope) on the mbarrier when pred holds; predicated, no branch.
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
#if ATTN_WG_ENABLED
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
#if ATTN_WG_ENABLED
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Hand registers back to / take them from the SM's pool (whole warpgroup, sm_90a).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if ATTN_WG_ENABLED
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if ATTN_WG_ENABLED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
// Named barriers of the two consumer warpgroups (256 threads; id 0 is __syncthreads).
__device__ __forceinline__ void named_bar_sync(uint32_t id) {
#if ATTN_WG_ENABLED
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(ATTN_WGF_CONSUMERS) : "memory");
#endif
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id) {
#if ATTN_WG_ENABLED
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(ATTN_WGF_CONSUMERS) : "memory");
#endif
}

// ----------------------------------------------------------------------------
// forward kernel

template <int HD, int SK, int SV>
constexpr size_t attention_wgmma_smem_bytes() {
    return (size_t)(ATTN_WG_ROWS * ATTN_WGF_NWG + (SK + SV) * ATTN_WGF_BC) * HD * sizeof(bf16) +
           ATTN_SW128_ATOM_BYTES + ATTN_WGF_MBAR_BYTES;
}

template <int HD, int SK, int SV>
__global__ void __launch_bounds__(ATTN_WGF_THREADS, 1)
    attention_forward_wgmma_kernel(bf16* out, float* lse, const bf16* qkv, int T, int H, int KVH,
                                   float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(SK >= 2 && SV >= 2, "ring stages (see the deadlock argument in the header)");
    static_assert(1 + 2 * SK + 2 * SV <= ATTN_WGF_MBAR_BYTES / 8, "mbarrier room");
#if ATTN_WG_ENABLED
    constexpr int BC = ATTN_WGF_BC;
    constexpr int BR = ATTN_WG_ROWS * ATTN_WGF_NWG;  // 128 query rows per CTA
    constexpr int NB_S = BC / 8;                     // 8-column blocks of the S accumulator
    constexpr int NB_O = HD / 8;                     // of the O accumulator
    constexpr int KS_S = HD / ATTN_WG_K;             // k-steps of S = Q K^T
    constexpr int KS_O = BC / ATTN_WG_K;             // k-steps of O += P V
    constexpr uint32_t Q_BYTES = BR * HD * sizeof(bf16);
    constexpr uint32_t KV_BYTES = BC * HD * sizeof(bf16);     // one stage of K or of V
    constexpr uint32_t KV_PANEL = BC * ATTN_SW128_ROW_BYTES;  // 64 hd columns of a K/V stage
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = 16;  // unused by swizzled K-major layouts; encodes as 1
    static_assert(Q_BYTES % ATOM == 0 && KV_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_fwd_smem[];
    const uint32_t sbase = (smem_u32(attn_fwd_smem) + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sQ = sbase;                          // (BR, HD) SW128
    const uint32_t sK = sQ + Q_BYTES;                   // SK stages of (BC, HD) SW128
    const uint32_t sV = sK + SK * KV_BYTES;             // SV stages of (BC, HD) SW128
    const uint32_t bar_q = sV + SV * KV_BYTES;          // mbarriers, 8 bytes each
    const uint32_t bar_full_k = bar_q + 8;              // [SK]  K stage landed (128 arrivals)
    const uint32_t bar_empty_k = bar_full_k + 8 * SK;   // [SK]  K stage released (8 warps)
    const uint32_t bar_full_v = bar_empty_k + 8 * SK;   // [SV]
    const uint32_t bar_empty_v = bar_full_v + 8 * SV;   // [SV]

    const int tid = threadIdx.x, lane = tid & 31;
    // the warp index through a shuffle from lane 0: a warp-uniform value the compiler can see
    // as such (the producer/consumer branch below must not look divergent around the wgmmas)
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2;  // 0, 1: consumers; 2: producer
    const int h = blockIdx.x % H, b = blockIdx.x / H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;  // longest rows first
    const int kvh = h / (H / KVH);
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gQ = seq + (int64_t)h * HD;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    // kv tiles holding keys <= the CTA's last query (< T); both warpgroups walk all of them
    // (the wgmma control flow stays CTA-uniform: header)
    const int n_tiles = (min(q0 + BR, T) - 1) / BC + 1;

    if (tid == 0) {
        // full barriers: one arrival per producer thread (its cp.async.mbarrier.arrive.noinc)
        mbar_init(bar_q, ATTN_WGF_PRODUCERS);
        for (int s = 0; s < SK; s++) {
            mbar_init(bar_full_k + 8 * s, ATTN_WGF_PRODUCERS);        // producer threads
            mbar_init(bar_empty_k + 8 * s, ATTN_WGF_CONSUMERS / 32);  // consumer warps
        }
        for (int s = 0; s < SV; s++) {
            mbar_init(bar_full_v + 8 * s, ATTN_WGF_PRODUCERS);
            mbar_init(bar_empty_v + 8 * s, ATTN_WGF_CONSUMERS / 32);
        }
        mbar_init_fence();
    }
    __syncthreads();  // the only CTA-wide barrier

    if (wg == ATTN_WGF_NWG) {
        // ---------------- producer warpgroup: Q, K_0, then K_{t+1}, V_t, t = 0 .. n_tiles-1 ----
        // Loading tile u into stage u % S waits until both warpgroups released tile u - S of
        // that stage (completion u/S - 1 of its empty barrier: parity ((u/S) & 1) ^ 1); the
        // first S tiles of a ring need no wait. Each lane's cp.async.mbarrier.arrive.noinc
        // arrives on the stage's full barrier once all its copies so far have landed. The
        // copies are sw128_tile_load_async over the 128 producer threads.
        setmaxnreg_dec<ATTN_WGF_PRODUCER_REGS>();
        const int ptid = tid - ATTN_WGF_CONSUMERS;
        sw128_tile_load_async<BR, HD, ATTN_WGF_PRODUCERS>(sQ, gQ, QKV, q0, T, ptid);
        cp_async_mbar_arrive(bar_q);
        auto load_k = [&](int u) {
            const int s = u % SK;
            if (u >= SK) mbar_wait(bar_empty_k + 8 * s, ((u / SK) & 1) ^ 1);
            sw128_tile_load_async<BC, HD, ATTN_WGF_PRODUCERS>(sK + s * KV_BYTES, gK, QKV, u * BC,
                                                              T, ptid);
            cp_async_mbar_arrive(bar_full_k + 8 * s);
        };
        auto load_v = [&](int u) {
            const int s = u % SV;
            if (u >= SV) mbar_wait(bar_empty_v + 8 * s, ((u / SV) & 1) ^ 1);
            sw128_tile_load_async<BC, HD, ATTN_WGF_PRODUCERS>(sV + s * KV_BYTES, gV, QKV, u * BC,
                                                              T, ptid);
            cp_async_mbar_arrive(bar_full_v + 8 * s);
        };
        load_k(0);
        for (int t = 0; t < n_tiles; t++) {
            if (t + 1 < n_tiles) load_k(t + 1);
            load_v(t);
        }
        cp_async_commit();    // (the copies are in no group yet: wait_group sees groups)
        cp_async_wait_all();  // every copy landed: leave none in flight behind an exited warp
        return;
    }

    // ---------------- consumer warpgroups ----------------------------------------------------
    setmaxnreg_inc<ATTN_WGF_CONSUMER_REGS>();
    const int wv = warp & 3;  // warp inside the warpgroup: rows 16wv..16wv+15
    const int wq0 = q0 + wg * ATTN_WG_ROWS;
    const int my_row = wq0 + wv * 16 + (lane >> 2);  // rows my_row (e = 0, 1) and my_row + 8
    const bool releaser = lane == 0;                 // one arrival per warp on empty barriers

    const uint64_t desc_q =
        wg_desc(sQ + wg * ATTN_WG_ROWS * ATTN_SW128_ROW_BYTES, KMAJOR_LBO, ATOM);
    const uint64_t desc_k = wg_desc(sK, KMAJOR_LBO, ATOM);
    const uint64_t desc_v = wg_desc(sV, KV_PANEL, ATOM);

    float o[NB_O][4], s[NB_S][4];
    uint32_t p[KS_O][4];
#pragma unroll
    for (int i = 0; i < NB_O; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[i][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < NB_S; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[i][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < KS_O; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) p[i][e] = 0u;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

    // Ping-pong: named barrier 1 + w = "warpgroup w may issue". Warpgroup w syncs on it
    // before each issue phase and arrives on 2 - w after; warpgroup 1 arrives on barrier 1 once
    // up front, so warpgroup 0 issues first; after the last phase warpgroup 0 consumes warpgroup
    // 1's last arrival (no barrier is left half-complete).
    const uint32_t my_turn = 1 + wg, other_turn = 2 - wg;
    if (wg == 1) named_bar_arrive(1);

    // the steps (header), with the rings' stage indices
    auto issue_s = [&](int j) {
        const uint64_t dk = wg_desc_add(desc_k, (j % SK) * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_S; kk++)
            WgmmaBf16<BC>::ss(s, wg_desc_add(desc_q, sw128_kstep_offset(kk, BR)),
                              wg_desc_add(dk, sw128_kstep_offset(kk, BC)), kk > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {
        const uint64_t dv = wg_desc_add(desc_v, (j % SV) * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++)
            WgmmaBf16<HD>::rs_trans_b(o, p[kk],
                                      wg_desc_add(dv, kk * ATTN_WG_K * ATTN_SW128_ROW_BYTES), 1);
        wgmma_commit();
    };
    auto softmax = [&](int j, float (&alpha)[2]) -> bool {
        const int k0 = j * BC;
        if (k0 + BC - 1 > q0) {
#pragma unroll
            for (int i = 0; i < NB_S; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int row = my_row + (e >> 1) * 8;
                    const int key = k0 + i * 8 + (lane & 3) * 2 + (e & 1);
                    if (key > row) s[i][e] = -INFINITY;
                }
        }
        bool max_moved = false;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < NB_S; i++) mx = fmaxf(mx, fmaxf(s[i][2 * hf], s[i][2 * hf + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_old = row_max[hf];
            const float m_new = fmaxf(m_old, mx * scale_log2);
            max_moved |= m_new != m_old;
            alpha[hf] = m_new == m_old ? 1.0f : fast_exp2(m_old - m_new);
            row_max[hf] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < NB_S; i++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float pr = fast_exp2(fmaf(s[i][2 * hf + e], scale_log2, -m_new));
                    s[i][2 * hf + e] = pr;
                    sum += pr;
                }
            row_sum[hf] = row_sum[hf] * alpha[hf] + sum;
        }
        return max_moved;
    };
    auto convert_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++) acc_to_frag_a(p[kk], s[2 * kk], s[2 * kk + 1]);
    };
    auto rescale_o = [&](const float (&alpha)[2], bool moved) {
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int i = 0; i < NB_O; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) o[i][e] *= alpha[e >> 1];
        }
    };
    // Tile u of a ring has landed: its full barrier completed for the (u / S)-th time.
    auto wait_k = [&](int u) { mbar_wait(bar_full_k + 8 * (u % SK), (u / SK) & 1); };
    auto wait_v = [&](int u) { mbar_wait(bar_full_v + 8 * (u % SV), (u / SV) & 1); };

    // Schedule per warpgroup (header): step j = 1 .. n_tiles-1
    //   wait_group 0 (P_{j-2} V_{j-2} retired) -> release V_{j-2}; p = bf16(P_{j-1}); O *= alpha
    //   wait full K_j, full V_{j-1}; fence.proxy.async; [my turn]
    //   issue S_j; issue O += P_{j-1} V_{j-1}  [other's turn]
    //   wait_group 1 (S_j done) -> release K_j; softmax(S_j)
    float alpha[2];
    bool moved;
    // tile 0: S only
    mbar_wait(bar_q, 0);
    wait_k(0);
    fence_proxy_async_shared();
    wg_fence_acc(s);
    named_bar_sync(my_turn);
    wgmma_fence();
    issue_s(0);
    named_bar_arrive(other_turn);
    wgmma_wait<0>();
    wg_fence_acc(s);
    mbar_arrive_if(bar_empty_k + 8 * (0 % SK), releaser);
    moved = softmax(0, alpha);
    for (int j = 1; j < n_tiles; j++) {
        wgmma_wait<0>();  // P_{j-2} V_{j-2} retired (nothing in flight at j = 1)
        wg_fence_acc(o);
        wg_fence_frag(p);
        mbar_arrive_if(bar_empty_v + 8 * ((j + SV - 2) % SV), releaser && j >= 2);
        convert_p();
        rescale_o(alpha, moved);
        wait_k(j);
        wait_v(j - 1);
        fence_proxy_async_shared();
        wg_fence_acc(s);
        wg_fence_acc(o);
        wg_fence_frag(p);
        named_bar_sync(my_turn);
        wgmma_fence();
        issue_s(j);
        issue_pv(j - 1);
        named_bar_arrive(other_turn);
        wgmma_wait<1>();  // S_j done; the P V group may still run
        wg_fence_acc(s);
        mbar_arrive_if(bar_empty_k + 8 * (j % SK), releaser);
        moved = softmax(j, alpha);
    }
    // the last tile's P V
    wgmma_wait<0>();
    wg_fence_acc(o);
    wg_fence_frag(p);
    mbar_arrive_if(bar_empty_v + 8 * ((n_tiles + SV - 2) % SV), releaser && n_tiles >= 2);
    convert_p();
    rescale_o(alpha, moved);
    wait_v(n_tiles - 1);
    fence_proxy_async_shared();
    wg_fence_acc(o);
    wg_fence_frag(p);
    named_bar_sync(my_turn);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    named_bar_arrive(other_turn);
    wgmma_wait<0>();
    wg_fence_acc(o);
    if (wg == 0) named_bar_sync(1);  // warpgroup 1's last arrival

    // O / l -> bf16; lse = (max + log2(l)) * ln 2
    const int64_t out_stride = (int64_t)H * HD;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float l = row_sum[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = 1.0f / l;
        const int row = my_row + hf * 8;
        if (row < T) {
            bf16* dst =
                out + ((int64_t)b * T + row) * out_stride + (int64_t)h * HD + (lane & 3) * 2;
#pragma unroll
            for (int i = 0; i < NB_O; i++)
                *reinterpret_cast<uint32_t*>(dst + i * 8) =
                    pack_bf16(o[i][2 * hf] * inv, o[i][2 * hf + 1] * inv);
            if ((lane & 3) == 0)
                lse[((int64_t)b * H + h) * T + row] = (row_max[hf] + log2f(l)) * ATTN_LN2;
        }
    }
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

// ----------------------------------------------------------------------------
// host side

// Whether the wgmma kernels can run on the current device: the build carries their sm_90a device
// code (the Makefile defines ATTN_WGMMA_BUILD=1 when GPU_ARCH is sm_90a, the default, and so does
// the lab's build script) and the device is a compute capability 9.0 part (a build for sm_90a
// and, say, sm_80 runs the sm_80 code on an A100, where these kernels are a trap). Two attribute
// queries per call: no synchronisation, no state.
#ifndef ATTN_WGMMA_BUILD
#define ATTN_WGMMA_BUILD 0
#endif
static int attention_wgmma_available() {
    if (!ATTN_WGMMA_BUILD) return 0;
    int dev = 0, major = 0, minor = 0;
    attention_check(cudaGetDevice(&dev));
    attention_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    attention_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return major == 9 && minor == 0;
}

// Head dims the wgmma forward implements (one or two 64-column swizzle panels).
static int attention_wgmma_supports_head_dim(int HD) { return HD == 64 || HD == 128; }

template <int HD, int SK, int SV>
static void attention_forward_wgmma_run(bf16* out, float* lse, const bf16* qkv, int B, int T,
                                        int H, int KVH, cudaStream_t stream) {
    constexpr int BR = ATTN_WG_ROWS * ATTN_WGF_NWG;
    const size_t smem = attention_wgmma_smem_bytes<HD, SK, SV>();
    auto kernel = attention_forward_wgmma_kernel<HD, SK, SV>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), ATTN_WGF_THREADS, smem, stream>>>(
        out, lse, qkv, T, H, KVH, attention_scale_log2(HD));
    attention_check(cudaGetLastError());
}

// Dispatch on HD (64 or 128) once the arguments are checked (attention_forward_check) and the
// device code is known to be there (attention_wgmma_available). <K ring stages, V ring stages>.
template <int SK, int SV>
static void attention_forward_wgmma_hd(bf16* out, float* lse, const bf16* qkv, int B, int T,
                                       int H, int KVH, int HD, cudaStream_t stream) {
    if (HD == 64)
        attention_forward_wgmma_run<64, SK, SV>(out, lse, qkv, B, T, H, KVH, stream);
    else
        attention_forward_wgmma_run<128, SK, SV>(out, lse, qkv, B, T, H, KVH, stream);
}

// Forward through wgmma alone, same signature and contract as attention_forward_bf16, HD 64 and
// 128; exits with a message where it cannot run (the lab times it against the other shapes).
template <int SK, int SV>
static void attention_forward_wgmma(void* out, float* lse, const void* qkv, int B, int T, int H,
                                    int KVH, int HD, void* stream) {
    const char* fn = "attention_forward_wgmma";
    const int work = attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD);
    if (!attention_wgmma_supports_head_dim(HD)) {
        fprintf(stderr, "attention: %s: head dim %d not supported (supported: 64, 128)\n", fn, HD);
        exit(1);
    }
    if (!attention_wgmma_available()) {
        fprintf(stderr, "attention: %s needs sm_90a: this binary's device code was not built "
                "with -gencode arch=compute_90a,code=sm_90a\n", fn);
        exit(1);
    }
    if (!work) return;
    attention_forward_wgmma_hd<SK, SV>(static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv),
                                       B, T, H, KVH, HD, static_cast<cudaStream_t>(stream));
}

#endif  // KERNELS_ATTENTION_WGMMA_CUH
