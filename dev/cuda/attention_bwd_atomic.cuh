/*
 * dev/cuda/attention_bwd_atomic.cuh — LAB variant of the causal grouped-query flash-attention
 * BACKWARD on Hopper wgmma (sm_90a) that computes dQ inside the dK/dV pass and sums it over the
 * kv tiles with fp32 atomics (red.global.add.v4.f32): 5 matmuls per (query tile, kv tile) pair
 * instead of production's 7 (production's dQ pass recomputes S and dP). NOT DETERMINISTIC: the
 * order of the fp32 additions into a dQ element depends on CTA scheduling, so dq may differ in
 * its last bits from run to run (dk, dv are summed in a fixed order, as production's). Lab
 * backward variants in dev/cuda/attention.cu (deterministic = false: repeats compared within
 * the tolerance), <ring slots, bulk>:
 *    8 "wgmma bwd atomic dq s3"  <3, false>  every thread red.global.add.v4.f32's its dQ part
 *    9 "wgmma bwd atomic dq s2"  <2, false>  same, 2 ring slots (less shared memory)
 *   10 "wgmma bwd bulk dq s3"    <3, true>   dQ staged in shared memory, one
 *                                            cp.reduce.async.bulk .add.f32 per tile (TMA unit)
 * The three share everything else; 8 vs 10 measures the reduction path. Included
 * by the lab after kernels/attention.cu, whose pieces it uses: attention_backward_dot (pass 1),
 * from kernels/attention_common.cuh the checks, launch helpers, SW128 layouts, WgmmaBf16 and
 * its k-step groups, acc_to_frags and the dK/dV epilogue; from kernels/ptx.cuh the descriptors,
 * fences / waits / register pins and cp_async_4; from kernels/attention_wgmma.cuh the named
 * barriers. HD 64 and 128.
 *
 * STATUS: written blind, NOT YET RUN on a GPU. The CPU model
 * dev/cuda/attention_bwd_atomic_model.py (python3 + numpy, ~10 s) emulates its new data paths
 * from the PTX ISA's definitions (stmatrix .trans into SW128, the dQ wgmma's descriptors, the
 * fragment-order reds and the conversion) and passes at HD 64 and 128; it cannot settle the one
 * hardware assumption new here (HD=64: an MN-major B start 64 bytes into a swizzle row; the
 * fallback, split by keys, is described below). It compiles for
 * sm_90a without spills or serialised wgmmas (numbers below), and the SASS of the loop reads as
 * designed (cuobjdump -sass): DEPBAR, BAR.SYNC, 16 HGMMA 64x64 (S^T, dP^T), DEPBAR 0x1, exp2,
 * 4 HGMMA 64xHD tnspB (dV), DEPBAR 0x1, dS^T, 4 STSM.16.MT88.4, FENCE.VIEW.ASYNC.S, BAR.SYNC,
 * 8 HGMMA 64x(HD/2) tnspB (dQ), 4 HGMMA 64xHD tnspB (dK), DEPBAR 0x1, HD/16 REDG.E.ADD.F32x4
 * (bulk: HD/16 STS.128, FENCE.VIEW.ASYNC.S, BAR.ARV / BAR.SYNC 1 (warp 0), UBLKRED.G.S.ADD.F32).
 *
 * ---------------------------------------------------------------------------------------------
 * Scheme
 *   zero    the dQ accumulator (cudaMemsetAsync on the stream).
 *   pass 1  D = rowsum(dO * O): production's attention_backward_dot.
 *   pass 2  one CTA of 2 warpgroups (256 threads) per (kv tile of BN = 128 keys, kv head,
 *           batch), exactly production's dK/dV kernel "wg2" (attn_bwg_dkdv_kernel: warpgroup w
 *           owns keys k0 + 64w .. +63; the CTA walks the query heads of its group, then the
 *           query tiles of BQ = 64 rows from the one holding k0; Q, dO, lse, D stream through a
 *           cp.async ring of STAGES = 3 or 2 slots; S^T = K_w Q^T and dP^T = V_w dO^T (SS),
 *           dV += P^T dO and dK += dS^T Q (RS, P^T and dS^T as register A fragments)), plus,
 *           per (query tile, head):
 *             dS^T fragments (bf16, the A operand of dK) -> shared memory as dS (queries x the
 *               CTA's 128 keys) by stmatrix .trans: 4 stmatrix.x4 per thread;
 *             fence.proxy.async; __syncthreads (both warpgroups' keys of dS are needed);
 *             dQ_w = dS K[:, w*HD/2 .. +HD/2]   (SS wgmma m64n{HD/2}k16, 8 k-steps over the
 *               128 keys): warpgroup w computes HALF OF THE COLUMNS of the tile's dQ over ALL
 *               the CTA's keys, so each dQ element gets one atomic add per CTA (not one per
 *               warpgroup) and the accumulator is 32 (HD=128) or 16 (HD=64) registers;
 *             red.global.add.v4.f32 of the accumulator into the fp32 workspace block of
 *               (b, head, query tile): HD/16 vector reds per thread per tile, each a coalesced
 *               512-byte line per warp (the block is stored in fragment order, below).
 *             BULK instead: the accumulator -> a shared fp32 staging block in the same order
 *               (HD/16 st.shared.v4 per thread, conflict-free), fence.proxy.async, named
 *               barrier 1 (warp 0 syncs, the other 7 warps only arrive), thread 0 issues one
 *               cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 of the whole block
 *               (BQ*HD*4 bytes, contiguous in global because of the block layout) and commits
 *               it; before the next iteration's ring barrier thread 0 waits for the bulk group
 *               to have READ the staging block (cp.async.bulk.wait_group.read 0), so nobody
 *               rewrites it early; at exit it waits for completion (wait_group 0).
 *   pass 3  dQ = scale * accumulator -> bf16 into dqkv's q columns (one float4 per thread
 *           step, attn_bwa_dq_convert_kernel).
 *
 * dQ accumulator layout (workspace, after D): one block of 64 x HD fp32 per (b, h, query tile),
 * block index (b*H + h)*n_qt + qt, n_qt = ceil(T/64) (the last tile padded: rows past T receive
 * zeros and are never converted). Inside a block, float4 number (w*NB_Q + i)*128 + t holds
 * dq[i][0..3] of thread t (= 32v + lane) of warpgroup w, NB_Q = HD/16: rows 16v + lane/4 (x, y)
 * and +8 (z, w), columns w*HD/2 + 8i + 2(lane%4) + {0, 1}. So the reds of a warp cover 512
 * contiguous bytes, and the conversion inverts this mapping.
 * Workspace = align256(B*H*T*4) [D] + B*H*n_qt*64*HD*4 [accumulator]: at B*T = 262,144 tokens,
 * H = 16, HD = 128 that is 2.1 GB (production's: 16 MB) -- a trainer that adopted this would
 * have to size its workspace accordingly.
 *
 * Operand layouts (notation of kernels/attention_common.cuh and attention_bwd_wgmma.cuh; only
 * what is new here):
 *   dS tile: BQ = 64 query rows x BN = 128 key columns, bf16, SW128: 2 panels of 64 rows x 128
 *     bytes (panel p = keys 64p..64p+63 = warpgroup p's keys), 16 KB, 1024-aligned.
 *   stmatrix.x4.trans, k-step kk (queries 16kk..16kk+15): register j of dsf[kk] (acc_to_frag_a
 *     of dS^T blocks 2kk, 2kk+1) is the 8x8 block (keys 8(j%2) + 0..7 of the warp's 16, queries
 *     16kk + 8(j/2) + 0..7) in mma fragment layout (row = key); .trans stores it with memory
 *     rows = queries, 8 keys (16 bytes = one swizzle chunk) per row. Lane l addresses row
 *     (query) 16kk + 8(j/2) + l%8 of block j = l/8, chunk (64w + 16v)/8 + j%2 of the dS tile:
 *     sw128_offset(query, chunk, 64). Conflict-free (8 rows x distinct swizzled chunks).
 *   dQ = dS K, SS, m64n{HD/2}k16, k-step kk = keys 16kk..16kk+15 (kk = 0..7):
 *     A = dS tile, K-major (keys contiguous), all 64 rows: start = sdS + sw128_kstep_offset(kk,
 *         64) (the forward's Q operand with R = 64), LBO 16, SBO 1024.
 *     B = K tile [key][hd] (resident, BN = 128 rows), (K = keys) x (N = hd), N contiguous:
 *         MN-major, imm-trans-b 1 (as production pass 3's B of dQ += dS K): start = sK +
 *         kk*16*128 + the warpgroup's column offset: HD=128: w * 128*128 (panel w, N = 64 = one
 *         atom); HD=64: w * 64 bytes (hd columns 32..63 of the single panel, N = 32: a start
 *         address inside the swizzle atom along N, as the K-major k-steps start 32/64/96 bytes
 *         into the atom along K); LBO = 128*128 (unread), SBO = 1024.
 *   Accumulator dq[i][e] (i = 0..NB_Q-1): row (query) 16v + g + 8(e/2), column 8i + 2t + e%2
 *     of the warpgroup's HD/2 columns.
 *
 * Pipeline, iteration it, per warpgroup (groups committed: [S^T], [dP^T], [dV], [dQ], [dK]):
 *     [STAGES=2: wait_group 0]  ring(it)  [STAGES=3: wait_group 0]   (production's)
 *     issue S^T, dP^T; wait_group 1 (S^T); P^T -> pf; issue dV; wait_group 1 (dP^T)
 *     dS^T -> dsf; stmatrix dsf -> dS; fence.proxy.async; __syncthreads
 *     issue dQ; issue dK
 *     wait_group 1                      dV and dQ retired (dK runs across the back edge)
 *     red.global.add.v4 of dq   (bulk: st.shared staging, barrier 1, thread 0's bulk reduction)
 *   The ring's __syncthreads of iteration it+1 follows every warpgroup's retirement of dQ_it,
 *   so the dS tile is rewritten only after both warpgroups' wgmmas stopped reading it (the
 *   completed wait_group implies the generic-async proxy fence, as for the ring slots). dQ is
 *   issued BEFORE dK so that the wait that frees dq leaves dK in flight (the other order would
 *   need wait_group 0). Alternative worth a measurement: dK before the dS barrier (it then runs
 *   while the warpgroups meet), dQ after it, wait_group 0 before the reds.
 *
 * Registers (the crux; production's dK/dV kernel is at 254 at HD=128): the dQ accumulator
 * (HD/2 columns: 32 registers at HD=128) is live only from the dQ issue to the reds, when S^T
 * and dP^T (64 registers) are dead (P^T lives on as pf until dV retires, dS^T as dsf until dK
 * retires). So the peak is production's (dK, dV 128 + S^T, dP^T 64 + pf, dsf 32 + addresses),
 * and no producer warpgroup / setmaxnreg (FA3's layout) is needed; ptxas reuses the dP^T
 * registers for dq. Measured here (nvcc 13.0, sm_90a, -Xptxas -v; no spill, no C75xx line):
 *   attn_bwa_kernel<128, 3, false>: 254 registers, 182,784 bytes dynamic shared memory
 *   attn_bwa_kernel<128, 2, false>: 254 registers, 149,504 bytes
 *   attn_bwa_kernel<128, 3, true>:  254 registers, 215,552 bytes (2 named barriers)
 *   attn_bwa_kernel< 64, 3, false>: 202 registers, 100,864 bytes
 *   attn_bwa_kernel< 64, 2, false>: 202 registers,  83,968 bytes
 *   attn_bwa_kernel< 64, 3, true>:  202 registers, 117,248 bytes
 *   attn_bwa_dq_convert_kernel<128 / 64>: 26 registers
 *   Shared memory = K, V (2 x 128 x HD bf16) | STAGES x Q, dO (64 x HD) | dS (64 x 128 bf16,
 *   16 KB) | STAGES x {lse, D} (512 B) | [bulk: dQ staging, 64 x HD fp32] | 1 KB alignment
 *   slack. One CTA (8 warps) per SM in all (registers: 256 x 254 or 202 > half the register
 *   file).
 *
 * Memory-model argument
 *   - The zeroing (cudaMemsetAsync), pass 1, pass 2 and pass 3 are issued in that order on one
 *     stream: each starts after the previous one completed, its writes visible. No grid reads
 *     what it writes through atomics, so no ordering inside pass 2 is needed beyond atomicity.
 *   - red.global.add.v4.f32 (SASS REDG.E.ADD.F32x4...STRONG.GPU) is a relaxed gpu-scope atomic
 *     add of each of the 4 elements: concurrent CTAs adding to the same element lose no update;
 *     the vector form is 4 element-wise atomics (not one 16-byte atomic), which is all a sum
 *     needs. The .f32 add flushes subnormals (FTZ): |dq| contributions below 2^-126 are lost,
 *     far below bf16 resolution of the result.
 *   - Pass 3 reads the accumulator with plain loads after pass 2's grid completed (kernel
 *     boundary on the stream): every red of pass 2 is performed by then.
 *   - Inside a CTA the dS tile goes generic proxy (stmatrix) -> async proxy (wgmma): each
 *     writer executes fence.proxy.async before the __syncthreads that precedes the wgmma.
 *   - Bulk: the staging block goes generic proxy (st.shared) -> async proxy (the bulk
 *     reduction's read): each writer's fence.proxy.async, then barrier 1 (bar.arrive / bar.sync
 *     order the writes before thread 0's issue). The reduction's element-wise adds into global
 *     memory are atomic with respect to each other and to other CTAs' (PTX ISA,
 *     cp.reduce.async.bulk); they are complete at the kernel's end (thread 0's wait_group 0,
 *     and the grid boundary before pass 3). The staging block is rewritten only after thread
 *     0's wait_group.read and the ring's __syncthreads that follows it.
 *
 * Expected speed (to measure): production's passes at T=4096 B=4 H=16 HD=128 run dK/dV at 560
 * TFLOP/s of its 4 matmuls and dQ at 562 of its 3. This pass 2 runs 5; at the same 560 the
 * backward would take 5/7 of production's time (2.5x-forward count ~520 after the zeroing and
 * conversion, instead of 381 at T=4096; ~1.25 s instead of 1.73 s per call at 262,144
 * tokens). Costs not in production: one more __syncthreads and a dS -> shared -> dQ chain per
 * tile during which each warpgroup's tensor work is only dV / dK; 32 KB of fp32 reds per
 * (query tile, kv tile) pair (at 560 TFLOP/s about 1.7 TB/s of reduction traffic into L2 over
 * the GPU; FA3 moves the same volume with TMA reduce-adds; whether the accumulator blocks stay
 * in L2 between the CTAs that add to them decides the DRAM cost); zeroing + conversion ~ 3 x
 * the accumulator's bytes of DRAM traffic (0.1 ms at T=4096 B=4, ~7% there; ~1.3 ms of a
 * ~1.3 s call at 262,144 tokens).
 *
 * Risks, most likely first, and how to read each (the lab prints dq, dk, dv errors apart):
 *   1. dq wrong, dk and dv right (dk, dv use production's code): the dS store (stmatrix.trans
 *      fragment/address mapping), the dS A descriptor, the K B descriptor or the accumulator
 *      layout <-> conversion mapping. dq right at T <= 64 with H = KVH (one CTA per sequence,
 *      one query tile) but wrong beyond -> the block index (hq, qt) of the reds; dq wrong
 *      already at T = 64 -> the layouts; rel. error ~1.4 = a permutation, a constant ratio = a
 *      scale.
 *   2. dq right at HD=128, wrong at HD=64: the N = 32 B operand that starts 64 bytes into the
 *      swizzle row (above). Fallback: at HD=64 split dQ by keys instead (warpgroup w: its own
 *      64 keys = A panel w, B = K rows 64w.., N = 64, 4 k-steps), both warpgroups adding to the
 *      same block (twice the reds at HD=64).
 *   3. Slower than hoped: compare the "dK,dV,dQ" pass of bench_backward_passes with
 *      production's two passes (same line format). If it is far below 560 TFLOP/s of its 5
 *      matmuls: the reds (variant 10, the bulk reduction, against 8), the extra barrier (try
 *      the other dQ/dK order), or L2 misses on the accumulator (ncu: lts__t_sectors_op_red,
 *      dram bytes).
 *   3b. Variant 10 only wrong or hanging: the staging order (the bulk block must be exactly
 *      the global block), the wait_group.read placement, or barrier 1's count (256 = 8 warps:
 *      1 syncing + 7 arriving).
 *   4. "REPEAT OUTSIDE TOLERANCE" or dq errors that vary between runs beyond rounding: a race
 *      on the dS tile (the barrier or the fence.proxy.async), or a dQ read before it retired.
 *   5. dq NaN (the lab poisons dqkv and the workspace): the accumulator not zeroed / region
 *      offset (attention_backward_atomic_ws_bytes) or blocks past the last query tile.
 *   6. dk or dv wrong: the shared-memory map (dS sits between the dO ring and {lse, D}) or a
 *      register pin; the rest is production's kernel.
 *   7. CUDA error at launch: the shared-memory size (182,784 bytes at HD=128 s3, below the
 *      232,448 opt-in maximum).
 *
 * First GPU run (or dev/cuda/check_bwd_atomic.sh, which does these in one device call):
 *   dev/cuda/run_attention.sh --build-only
 *   grep -c C75 .devbuild/attention_ptxas.txt          (want 0; and attn_bwa_kernel: 0 spills)
 *   timeout 60 .devbuild/attention --tiny --no-big --no-bench --fwd -2 --bwd 8
 *   timeout 60 .devbuild/attention --tiny --no-big --no-bench --fwd -2 --bwd 9
 *   timeout 60 .devbuild/attention --tiny --no-big --no-bench --fwd -2 --bwd 10
 *   dev/cuda/run_attention.sh --fwd -2 --bwd 6,8,9,10 --long   (all cases twice, the big case,
 *       the benchmark against production's variant 6 "wgmma bwd wg2 s3", the passes)
 *   compute-sanitizer --tool memcheck|racecheck|synccheck .devbuild/attention
 *       --shape 1,1000,2,1,128 --no-big --no-bench --fwd -2 --bwd 8,9,10 --log /dev/null
 *       (racecheck sees the stmatrix / staging writes but probably not the async-proxy reads)
 *   Pass: worst error of 8-10 comparable to 6's (~4e-3), 0 failures; "nondeterministic"
 *   counts > 0 are expected (float atomics) and only fail if a repeat is outside tolerance.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef DEV_CUDA_ATTENTION_BWD_ATOMIC_CUH
#define DEV_CUDA_ATTENTION_BWD_ATOMIC_CUH

#include "../../kernels/attention_bwd_wgmma.cuh"  // (already included by kernels/attention.cu)

#define ATTN_BWA_NWG 2                                 // warpgroups per CTA (64 keys each)
#define ATTN_BWA_BN (ATTN_WG_ROWS * ATTN_BWA_NWG)      // keys per CTA
#define ATTN_BWA_BQ 64                                 // query rows per streamed tile
#define ATTN_BWA_THREADS (ATTN_WG_THREADS * ATTN_BWA_NWG)
#define ATTN_BWA_ALIGN 256                             // workspace regions start on 256 bytes
#define ATTN_BWA_STAGED_BAR 1                          // named barrier: dQ staging written

// ----------------------------------------------------------------------------
// device helpers (sm_90a)

// Four 8x8 bf16 matrices from registers to shared memory, each stored transposed: the element a
// lane holds at (row g, columns 2t, 2t+1) of matrix j (the mma fragment layout) lands in memory
// rows 2t, 2t+1 at column g of the 8x8 block whose 8 rows lanes 8j..8j+7 address.
__device__ __forceinline__ void attn_bwa_stsm_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
#if ATTN_WG_ENABLED
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#endif
}

// Four consecutive floats added to global memory atomically (relaxed, gpu scope), no result.
__device__ __forceinline__ void attn_bwa_red_v4(float* dst, float a, float b, float c, float d) {
#if ATTN_WG_ENABLED
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
#endif
}

// Four floats to shared memory (16-byte aligned address).
__device__ __forceinline__ void attn_bwa_st_shared_v4(uint32_t addr, float a, float b, float c,
                                                      float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
}

// Bulk asynchronous reduction: `bytes` of fp32 at shared address src added element-wise to
// global dst (the TMA unit reads shared memory through the async proxy), tracked as a bulk
// group of the issuing thread.
__device__ __forceinline__ void attn_bwa_bulk_reduce_add(float* dst, uint32_t src,
                                                         uint32_t bytes) {
#if ATTN_WG_ENABLED
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
        "cp.async.bulk.commit_group;\n" ::"l"(dst),
        "r"(src), "r"(bytes)
        : "memory");
#endif
}
// The issuing thread's bulk groups have finished reading shared memory (the source may be
// rewritten) / have completed (their global writes performed).
__device__ __forceinline__ void attn_bwa_bulk_wait_read() {
#if ATTN_WG_ENABLED
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void attn_bwa_bulk_wait() {
#if ATTN_WG_ENABLED
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

#define ATTN_BWA_ACC16(d) \
    WG_ACC4(d, 0), WG_ACC4(d, 1), WG_ACC4(d, 2), WG_ACC4(d, 3)
#define ATTN_BWA_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// d (64 x N, f32) = A (64 x 16, bf16, K-major descriptor) * B (16 x N, bf16, MN-major
// descriptor: imm-trans-b 1) + (scale_d ? d : 0): the SS form of dQ = dS K.
template <int N>
struct AttnBwaSsTransB;

template <>
struct AttnBwaSsTransB<64> {
    static __device__ __forceinline__ void mma(float (&d)[8][4], uint64_t da, uint64_t db,
                                               int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
            ", %32, %33, p, 1, 1, 0, 1;\n}\n"
            : WG_ACC32(d)
            : "l"(da), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
};

template <>
struct AttnBwaSsTransB<32> {
    static __device__ __forceinline__ void mma(float (&d)[4][4], uint64_t da, uint64_t db,
                                               int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " ATTN_BWA_REGS16
            ", %16, %17, p, 1, 1, 0, 1;\n}\n"
            : ATTN_BWA_ACC16(d)
            : "l"(da), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
};

// ----------------------------------------------------------------------------
// pass 2: dK, dV, and dQ partials into the fp32 accumulator

template <int HD, int STAGES, bool BULK>
constexpr size_t attn_bwa_smem_bytes() {
    return (size_t)(2 * ATTN_BWA_BN + 2 * STAGES * ATTN_BWA_BQ) * HD * sizeof(bf16) +
           (size_t)ATTN_BWA_BQ * ATTN_BWA_BN * sizeof(bf16) +
           (size_t)STAGES * 2 * ATTN_BWA_BQ * sizeof(float) +
           (BULK ? (size_t)ATTN_BWA_BQ * HD * sizeof(float) : 0) + ATTN_SW128_ATOM_BYTES;
}

// dq_acc: (B, H, n_qt) blocks of 64 x HD fp32 in fragment order (header), zeroed before the
// launch; every CTA adds its partials to the blocks of the query tiles it visits: BULK = false
// by red.global.add.v4.f32 from every thread, true through a shared staging block and one
// cp.reduce.async.bulk per tile from thread 0.
template <int HD, int STAGES, bool BULK>
__global__ void __launch_bounds__(ATTN_BWA_THREADS, 1)
    attn_bwa_kernel(bf16* dqkv, float* dq_acc, const bf16* dout, const bf16* qkv,
                    const float* lse, const float* D, int T, int H, int KVH, float scale_log2,
                    float scale) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(STAGES == 2 || STAGES == 3, "ring slots of the Q/dO tiles");
    static_assert(ATTN_BWA_THREADS == ATTN_WGF_CONSUMERS, "named_bar_* count 256 threads");
#if ATTN_WG_ENABLED
    constexpr int BQ = ATTN_BWA_BQ, BN = ATTN_BWA_BN, NT = ATTN_BWA_THREADS;
    constexpr int NB_S = BQ / 8;            // 8-column blocks of S^T, dP^T
    constexpr int NB_O = HD / 8;            // of dK, dV
    constexpr int KS_S = HD / ATTN_WG_K;    // k-steps of S^T, dP^T (over hd)
    constexpr int KS_O = BQ / ATTN_WG_K;    // k-steps of dV, dK (over queries)
    constexpr int DQ_N = HD / ATTN_BWA_NWG; // dQ columns per warpgroup (wgmma N)
    constexpr int NB_Q = DQ_N / 8;          // 8-column blocks of a warpgroup's dQ
    constexpr int KS_Q = BN / ATTN_WG_K;    // k-steps of dQ (over the CTA's keys)
    constexpr uint32_t KV_BYTES = BN * HD * sizeof(bf16);
    constexpr uint32_t QT_BYTES = BQ * HD * sizeof(bf16);     // one slot of Q or of dO
    constexpr uint32_t QT_PANEL = BQ * ATTN_SW128_ROW_BYTES;  // LBO of the MN-major Q/dO operand
    constexpr uint32_t KV_PANEL = BN * ATTN_SW128_ROW_BYTES;  // LBO of the MN-major K operand
    constexpr uint32_t DS_BYTES = BQ * BN * sizeof(bf16);     // dS, (BQ, BN) SW128
    constexpr uint32_t LD_BYTES = 2 * BQ * sizeof(float);     // one slot of {lse, D}
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = 16;
    constexpr uint32_t WG_ROWS_BYTES = ATTN_WG_ROWS * ATTN_SW128_ROW_BYTES;
    constexpr uint32_t KSTEP_ROWS_BYTES = ATTN_WG_K * ATTN_SW128_ROW_BYTES;
    // hd column DQ_N * wg of the K tile: the second panel at HD=128, 32 columns into the row at
    // HD=64 (a start address inside the swizzle atom, as the K-major k-steps use)
    constexpr uint32_t DQ_B_STEP =
        (DQ_N / ATTN_SW128_PANEL_COLS) * KV_PANEL + (DQ_N % ATTN_SW128_PANEL_COLS) * sizeof(bf16);
    constexpr bool LATE_RETIRE = STAGES >= 3;
    static_assert(KV_BYTES % ATOM == 0 && QT_BYTES % ATOM == 0 && DS_BYTES % ATOM == 0,
                  "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_bwa_smem[];
    const uint32_t sraw = smem_u32(attn_bwa_smem);
    const uint32_t sbase = (sraw + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sK = sbase;                    // (BN, HD) SW128, resident
    const uint32_t sV = sK + KV_BYTES;            // (BN, HD) SW128, resident
    const uint32_t sQ = sV + KV_BYTES;            // STAGES x (BQ, HD) SW128
    const uint32_t sdO = sQ + STAGES * QT_BYTES;  // STAGES x (BQ, HD) SW128
    const uint32_t sdS = sdO + STAGES * QT_BYTES; // (BQ queries, BN keys) SW128
    const uint32_t sLD = sdS + DS_BYTES;          // STAGES x {lse[BQ], D[BQ]} fp32
    const uint32_t sDQ = sLD + STAGES * LD_BYTES; // BULK: (BQ, HD) fp32 staging, block order
    const float* gLD = reinterpret_cast<const float*>(attn_bwa_smem + (sLD - sraw));

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid / ATTN_WG_THREADS;
    const int wv = (tid >> 5) & 3;
    const int kvh = blockIdx.x % KVH, b = blockIdx.x / KVH;
    const int k0 = blockIdx.y * BN;
    const int group = H / KVH;
    const int n_qt = (T + BQ - 1) / BQ;
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* dseq = dout + (int64_t)b * T * OS;
    const int qt0 = k0 / BQ;
    const int per_head = n_qt - qt0;
    const int n_iter = group * per_head;
    const int my_key = k0 + wg * ATTN_WG_ROWS + wv * 16 + (lane >> 2);
    // this thread's float4s of a dQ block: (wg, block i, thread) -> ((wg*NB_Q + i)*128 + t)*4
    const int my_f4 = wg * NB_Q * ATTN_WG_THREADS + (tid % ATTN_WG_THREADS);
    float* const seq_dq = dq_acc + ((int64_t)b * H * n_qt) * (BQ * HD);
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);  // warp-uniform for the compiler

    auto stage = [&](int it, int slot) {
        const int hq = kvh * group + it / per_head;
        const int q0 = (qt0 + it % per_head) * BQ;
        sw128_tile_load_async<BQ, HD, NT>(sQ + slot * QT_BYTES, seq + (int64_t)hq * HD, QKV, q0,
                                          T, tid);
        sw128_tile_load_async<BQ, HD, NT>(sdO + slot * QT_BYTES, dseq + (int64_t)hq * HD, OS, q0,
                                          T, tid);
        const int64_t r0 = ((int64_t)b * H + hq) * T;
        for (int i = tid; i < 2 * BQ; i += NT) {
            const int q = q0 + (i % BQ);
            const bool valid = q < T;
            const float* src = (i < BQ ? lse : D) + r0 + (valid ? q : 0);
            cp_async_4(sLD + slot * LD_BYTES + i * (uint32_t)sizeof(float), src, valid);
        }
    };

    const uint64_t desc_k = wg_desc(sK + wg * WG_ROWS_BYTES, KMAJOR_LBO, ATOM);  // A of S^T
    const uint64_t desc_v = wg_desc(sV + wg * WG_ROWS_BYTES, KMAJOR_LBO, ATOM);  // A of dP^T
    const uint64_t desc_q_kmaj = wg_desc(sQ, KMAJOR_LBO, ATOM);   // B of S^T
    const uint64_t desc_o_kmaj = wg_desc(sdO, KMAJOR_LBO, ATOM);  // B of dP^T
    const uint64_t desc_q_nmaj = wg_desc(sQ, QT_PANEL, ATOM);     // B of dK += dS^T Q
    const uint64_t desc_o_nmaj = wg_desc(sdO, QT_PANEL, ATOM);    // B of dV += P^T dO
    const uint64_t desc_ds = wg_desc(sdS, KMAJOR_LBO, ATOM);      // A of dQ = dS K (whole tile)
    const uint64_t desc_k_nmaj = wg_desc(sK + wg * DQ_B_STEP, KV_PANEL, ATOM);  // B of dQ
    // stmatrix address of this lane at k-step 0: matrix j = lane/8 holds queries 8(j/2)..+7
    // (memory rows) x keys 8(j%2)..+7 of this warp's 16 (one 16-byte chunk of the row)
    const int st_j = lane >> 3;
    const uint32_t st_addr =
        sdS + sw128_offset(8 * (st_j >> 1) + (lane & 7),
                           (wg * ATTN_WG_ROWS + wv * 16) / 8 + (st_j & 1), BQ);

    sw128_tile_load_async<BN, HD, NT>(sK, seq + (int64_t)(H + kvh) * HD, QKV, k0, T, tid);
    sw128_tile_load_async<BN, HD, NT>(sV, seq + (int64_t)(H + KVH + kvh) * HD, QKV, k0, T, tid);
    stage(0, 0);
    cp_async_commit();

    float dk[NB_O][4], dv[NB_O][4], s[NB_S][4], dp[NB_S][4], dq[NB_Q][4];
    uint32_t pf[KS_O][4], dsf[KS_O][4];
    acc_zero(dk);
    acc_zero(dv);
    // s, dp, dq: overwritten by their first k-step (scale-d 0); pf, dsf written before each use.
    // Zeroed once so no path reads garbage.
    acc_zero(s);
    acc_zero(dp);
    acc_zero(dq);
    frag_zero(pf);
    frag_zero(dsf);

    // production's dK/dV products (attn_bwg_dkdv_kernel)
    auto issue_sdp = [&](int slot) {
        wgmma_group_ss<BQ, KS_S, BN>(s, desc_k, wg_desc_add(desc_q_kmaj, slot * QT_BYTES));
        wgmma_group_ss<BQ, KS_S, BN>(dp, desc_v, wg_desc_add(desc_o_kmaj, slot * QT_BYTES));
    };
    auto issue_dv = [&](int slot) {
        wgmma_group_rs<HD, KS_O>(dv, pf, wg_desc_add(desc_o_nmaj, slot * QT_BYTES));
    };
    auto issue_dk = [&](int slot) {
        wgmma_group_rs<HD, KS_O>(dk, dsf, wg_desc_add(desc_q_nmaj, slot * QT_BYTES));
    };
    // dQ[:, DQ_N wg ..] = dS K[:, DQ_N wg ..]: k-step kk = keys 16kk..16kk+15 of the CTA (A: 16
    // columns of the dS tile, K-major; B: 16 rows of the K tile, MN-major), one group
    auto issue_dq = [&]() {
#pragma unroll
        for (int kk = 0; kk < KS_Q; kk++)
            AttnBwaSsTransB<DQ_N>::mma(dq, wg_desc_add(desc_ds, sw128_kstep_offset(kk, BQ)),
                                       wg_desc_add(desc_k_nmaj, kk * KSTEP_ROWS_BYTES), kk > 0);
        wgmma_commit();
    };
    auto retire_all = [&]() {
        wgmma_wait<0>();
        wg_fence_acc(dk);
        wg_fence_acc(dv);
        wg_fence_acc(dq);
        wg_fence_frag(pf);
        wg_fence_frag(dsf);
    };

    // do-while: n_iter >= 1 (k0 < T); a skippable loop makes ptxas serialise every wgmma
    int slot = 0;
    int it = 0;
    do {
        if constexpr (!LATE_RETIRE) retire_all();  // dK of it-1 reads slot (it+1) % 2
        if (BULK && tid == 0) attn_bwa_bulk_wait_read();  // staging of it-1 read by the TMA
        cp_async_wait_all();
        fence_proxy_async_shared();
        __syncthreads();  // also: dQ of it-1 retired in both warpgroups before dS is rewritten
        const int next = slot + 1 == STAGES ? 0 : slot + 1;
        if (it + 1 < n_iter) stage(it + 1, next);
        cp_async_commit();
        if constexpr (LATE_RETIRE) retire_all();  // dK of it-1 ran across the ring

        const int hq = kvh * group + it / per_head;
        const int qt = qt0 + it % per_head;
        const int q0 = qt * BQ;
        const float* tL = gLD + slot * (2 * BQ);
        const float* tD = tL + BQ;

        wg_fence_acc(s);
        wg_fence_acc(dp);
        wgmma_fence();
        issue_sdp(slot);
        wgmma_wait<1>();  // S^T done
        wg_fence_acc(s);

        // P^T = 2^(S^T * scale_log2 - lse * log2e); 0 where key > query or query >= T
        const bool edge = q0 < k0 + BN - 1 || q0 + BQ > T;  // CTA-uniform
#pragma unroll
        for (int i = 0; i < NB_S; i++) {
            const int qi = i * 8 + (lane & 3) * 2;
            const float2 l2 = *reinterpret_cast<const float2*>(tL + qi);
            const float nl[2] = {-l2.x * ATTN_LOG2E, -l2.y * ATTN_LOG2E};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(fmaf(s[i][e], scale_log2, nl[e & 1]));
                if (edge) {
                    const int key = my_key + (e >> 1) * 8;
                    const int q = q0 + qi + (e & 1);
                    if (key > q || q >= T) p = 0.0f;
                }
                s[i][e] = p;
            }
        }
        acc_to_frags(pf, s);

        wg_fence_frag(pf);
        wg_fence_acc(dv);
        wgmma_fence();
        issue_dv(slot);
        wgmma_wait<1>();  // dP^T done (dV may still run)
        wg_fence_acc(dp);

#pragma unroll
        for (int i = 0; i < NB_S; i++) {
            const int qi = i * 8 + (lane & 3) * 2;
            const float2 d2 = *reinterpret_cast<const float2*>(tD + qi);
            const float dd[2] = {d2.x, d2.y};
#pragma unroll
            for (int e = 0; e < 4; e++) dp[i][e] = s[i][e] * (dp[i][e] - dd[e & 1]);
        }
        acc_to_frags(dsf, dp);

        // dS (queries x keys) into shared memory for dQ: the bf16 dS^T fragments stored
        // transposed, k-step kk = queries 16kk..16kk+15 (16 rows of 128 bytes further)
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++)
            attn_bwa_stsm_x4_trans(st_addr + kk * KSTEP_ROWS_BYTES, dsf[kk]);
        fence_proxy_async_shared();
        __syncthreads();  // both warpgroups' keys of dS written

        wg_fence_frag(dsf);
        wg_fence_acc(dk);
        wg_fence_acc(dq);
        wgmma_fence();
        issue_dq();
        issue_dk(slot);
        wgmma_wait<1>();  // dV and dQ done (dK may run across the back edge)
        wg_fence_acc(dv);
        wg_fence_acc(dq);
        wg_fence_frag(pf);

        // this warpgroup's dQ partial of (query tile qt, head hq) into the accumulator
        float* const block = seq_dq + ((int64_t)hq * n_qt + qt) * (BQ * HD);
        if constexpr (BULK) {
#pragma unroll
            for (int i = 0; i < NB_Q; i++)
                attn_bwa_st_shared_v4(sDQ + (my_f4 + i * ATTN_WG_THREADS) * 16, dq[i][0],
                                      dq[i][1], dq[i][2], dq[i][3]);
            fence_proxy_async_shared();
            // warp 0 waits for everyone's staging writes, the others go on
            if (warp == 0)
                named_bar_sync(ATTN_BWA_STAGED_BAR);
            else
                named_bar_arrive(ATTN_BWA_STAGED_BAR);
            if (tid == 0) attn_bwa_bulk_reduce_add(block, sDQ, BQ * HD * sizeof(float));
        } else {
#pragma unroll
            for (int i = 0; i < NB_Q; i++)
                attn_bwa_red_v4(block + (my_f4 + i * ATTN_WG_THREADS) * 4, dq[i][0], dq[i][1],
                                dq[i][2], dq[i][3]);
        }
        slot = next;
    } while (++it < n_iter);
    retire_all();
    if (BULK && tid == 0) attn_bwa_bulk_wait();  // no reduction left in flight at exit

    store_dk_dv(dqkv, dk, dv, QKV, b, kvh, my_key, T, H, KVH, lane, scale);
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

// ----------------------------------------------------------------------------
// pass 3: dQ = scale * the accumulator, bf16, into dqkv's q columns

// One float4 of a 64 x HD block (b, h, query tile) per step: block element ((w*NB_Q + i)*128 +
// t)*4 + e is, for warpgroup w, 8-column block i and thread t = 32v + lane of the pass 2
// accumulator layout, row 16v + lane/4 + 8(e/2), column w*HD/2 + 8i + 2(lane%4) + e%2.
template <int HD>
__global__ void attn_bwa_dq_convert_kernel(bf16* dqkv, const float4* acc, int64_t n4, int T, int H,
                                           int KVH, int n_qt, float scale) {
    constexpr int NB_Q = HD / ATTN_BWA_NWG / 8;
    constexpr int BLOCK4 = ATTN_BWA_BQ * HD / 4;  // float4s per block
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    for (int64_t f = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; f < n4;
         f += (int64_t)gridDim.x * blockDim.x) {
        const int64_t blk = f / BLOCK4;
        const int r = (int)(f % BLOCK4);
        const int t = r % ATTN_WG_THREADS, i = r / ATTN_WG_THREADS % NB_Q;
        const int w = r / (ATTN_WG_THREADS * NB_Q);
        const int qt = (int)(blk % n_qt), h = (int)(blk / n_qt % H);
        const int64_t b = blk / n_qt / H;
        const int row = qt * ATTN_BWA_BQ + (t >> 5) * 16 + ((t & 31) >> 2);
        if (row >= T) continue;
        const float4 a = acc[f];
        bf16* dst = dqkv + (b * T + row) * QKV + (int64_t)h * HD + w * (HD / ATTN_BWA_NWG) + i * 8 +
                    (t & 3) * 2;
        *reinterpret_cast<uint32_t*>(dst) = pack_bf16(a.x * scale, a.y * scale);
        if (row + 8 < T)
            *reinterpret_cast<uint32_t*>(dst + 8 * QKV) = pack_bf16(a.z * scale, a.w * scale);
    }
}

// ----------------------------------------------------------------------------
// host side

static size_t attn_bwa_align(size_t bytes) {
    return (bytes + ATTN_BWA_ALIGN - 1) & ~(size_t)(ATTN_BWA_ALIGN - 1);
}
// The dQ accumulator: one 64 x HD fp32 block per (b, h, query tile), the last tile padded.
static size_t attn_bwa_dq_bytes(int B, int T, int H, int HD) {
    const size_t n_qt = ((size_t)T + ATTN_BWA_BQ - 1) / ATTN_BWA_BQ;
    return (size_t)B * H * n_qt * ATTN_BWA_BQ * HD * sizeof(float);
}
// Workspace: D (B*H*T fp32) | dQ accumulator, each region 256-byte aligned.
static size_t attention_backward_atomic_ws_bytes(int B, int T, int H, int KVH, int HD) {
    (void)KVH;
    if (B <= 0 || T <= 0 || H <= 0) return 0;
    return attn_bwa_align((size_t)B * T * H * sizeof(float)) + attn_bwa_dq_bytes(B, T, H, HD);
}

// The three passes (and the accumulator's zeroing before pass 2), stream-ordered; marks
// (optional, 2 events) after pass 1 and after pass 2, as lab_backward_wgmma_timed.
template <int HD, int STAGES, bool BULK>
static void attn_bwa_run(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                         const float* lse, void* workspace, int B, int T, int H, int KVH,
                         cudaStream_t stream, cudaEvent_t* marks) {
    const char* fn = "attention_backward_atomic";
    const float scale = 1.0f / sqrtf((float)HD);
    const float scale_log2 = scale * ATTN_LOG2E;
    const int64_t kv_tiles = (T + ATTN_BWA_BN - 1) / ATTN_BWA_BN;
    if (kv_tiles > 65535) {
        fprintf(stderr, "attention: %s: T = %d too large\n", fn, T);
        exit(1);
    }
    float* D = static_cast<float*>(workspace);
    float* acc = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                          attn_bwa_align((size_t)B * T * H * sizeof(float)));
    const size_t acc_bytes = attn_bwa_dq_bytes(B, T, H, HD);
    const int n_qt = (T + ATTN_BWA_BQ - 1) / ATTN_BWA_BQ;
    attention_check(cudaMemsetAsync(acc, 0, acc_bytes, stream));
    attention_backward_dot<HD>(D, dout, out, B, T, H, fn, stream);
    if (marks) attention_check(cudaEventRecord(marks[0], stream));
    {
        const size_t smem = attn_bwa_smem_bytes<HD, STAGES, BULK>();
        auto kernel = attn_bwa_kernel<HD, STAGES, BULK>;
        attention_set_max_smem(kernel, smem);
        kernel<<<attention_grid(B, T, KVH, ATTN_BWA_BN), ATTN_BWA_THREADS, smem, stream>>>(
            dqkv, acc, dout, qkv, lse, D, T, H, KVH, scale_log2, scale);
        attention_check(cudaGetLastError());
    }
    if (marks) attention_check(cudaEventRecord(marks[1], stream));
    {
        const int64_t n4 = (int64_t)(acc_bytes / sizeof(float4));
        const int64_t blocks = std::min<int64_t>((n4 + 255) / 256, 1 << 20);
        attn_bwa_dq_convert_kernel<HD><<<(unsigned)blocks, 256, 0, stream>>>(
            dqkv, reinterpret_cast<const float4*>(acc), n4, T, H, KVH, n_qt, scale);
        attention_check(cudaGetLastError());
    }
}

// Same contract as attention_backward_bf16 except the workspace
// (attention_backward_atomic_ws_bytes) and the bits: dq is summed by fp32 atomics in no fixed
// order (dk, dv are as deterministic as production's). HD 64 and 128, sm_90a. <ring slots,
// bulk reductions (else red.global.add.v4)>.
template <int STAGES, bool BULK>
static void attention_backward_atomic_timed(void* dqkv, const void* dout, const void* qkv,
                                            const void* out, const float* lse, void* workspace,
                                            int B, int T, int H, int KVH, int HD, void* stream,
                                            cudaEvent_t* marks) {
    const char* fn = "attention_backward_atomic";
    if (!attention_wgmma_supports_head_dim(HD)) {
        fprintf(stderr, "attention: %s: head dim %d not supported (supported: 64, 128)\n", fn, HD);
        exit(1);
    }
    if (!attention_wgmma_available()) {
        fprintf(stderr, "attention: %s needs sm_90a: this binary's device code was not built "
                "with -gencode arch=compute_90a,code=sm_90a\n", fn);
        exit(1);
    }
    if (!attention_backward_check(fn, dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD))
        return;
    attention_check_aligned(fn, "workspace", workspace, 16);  // red.v4 / float4 of the accumulator
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (HD == 64)
        attn_bwa_run<64, STAGES, BULK>(dx, dy, x, y, lse, workspace, B, T, H, KVH, s, marks);
    else
        attn_bwa_run<128, STAGES, BULK>(dx, dy, x, y, lse, workspace, B, T, H, KVH, s, marks);
}

// The lab's BackwardFn signature.
template <int STAGES, bool BULK>
static void attention_backward_atomic(void* dqkv, const void* dout, const void* qkv,
                                      const void* out, const float* lse, void* workspace, int B,
                                      int T, int H, int KVH, int HD, void* stream) {
    attention_backward_atomic_timed<STAGES, BULK>(dqkv, dout, qkv, out, lse, workspace, B, T, H,
                                                  KVH, HD, stream, nullptr);
}

#endif  // DEV_CUDA_ATTENTION_BWD_ATOMIC_CUH
