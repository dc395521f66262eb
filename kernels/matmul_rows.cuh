/*
 * matmul_rows.cuh — the forward product for few rows (the decode step: at most 128 rows) on
 * Hopper warpgroup MMAs fed by the tensor memory accelerator (TMA), split along k across the
 * CTAs of a thread-block cluster. Part of kernels/matmul.cu, which includes it and routes
 * cuda_matmul_forward here when it applies.
 *
 *   out (M, OC) = inp (M, IC) · Wᵀ (+ bias),  M <= 128, bf16 in and out, fp32 accumulation.
 *
 * Why: at 128 rows a linear reads its whole weight once for little arithmetic (2 · 128 flops per
 * weight), so it is bound by HBM, and cuBLASLt's choices for these shapes reach 1.0-2.4 TB/s of
 * the H200's 4.8 (docs/PERF.md, session 13). Here every CTA streams its own slice of the weight,
 * all rows at once, one wave, the weight read exactly once.
 *
 * Tiles: a CTA owns BN = 32, 64, 96 or 128 weight rows (output columns n0 .. n0 + BN) and one of
 *   SPLIT equal k ranges; the SPLIT CTAs of one column tile form a cluster (SPLIT in 1, 2, 4, 8).
 *   Grid (SPLIT, OC / BN): one wave (CTAs <= SMs, clusters <= the clusters the device holds at
 *   once, cudaOccupancyMaxActiveClusters).
 * CTA: 288 threads. Warpgroups 0 and 1 are consumers: warpgroup w computes rows 64w .. 64w + 63
 *   against the BN weight rows, a 64 x BN fp32 accumulator, one wgmma m64nBNk16 per 16 of k,
 *   A = the rows' tile, B = the weight tile, both K-major from shared memory. Warp 8 is the
 *   producer: one lane issues, per 64-wide k step, two TMA tile copies (cp.async.bulk.tensor.2d:
 *   the rows tile 128 x 64, rows >= M filled with zeros by the TMA's bounds; the weight tile
 *   BN x 64) into a STAGES-deep ring. Stage s is published by mbarrier full[s] (one arrival
 *   with the stage's byte count, completed by the copies' transaction bytes) and released by
 *   empty[s] (one arrival per consumer warp once its wgmmas on it have retired). (Copies by
 *   cp.async from 128 producer threads ran at ~35 GB/s per SM whatever the stage count; the TMA
 *   takes ~50-60 GB/s per SM, with one CTA per SM or two: the lab's session-13 numbers,
 *   docs/PERF.md. The rows' tile is read again by every CTA of a k range, so the plan below
 *   weighs each CTA's (BN + 128) x k bytes.)
 *   The tensor maps use the 128-byte swizzle: row r of a tile is 128 bytes at r * 128 with its
 *   16-byte chunk c at (c ^ (r & 7)) * 16, the K-major layout wgmma reads (descriptor of k-step
 *   kk: start + 32 kk, SBO 1024; kernels/attention_common.cuh describes it); every tile starts
 *   on a 1024-byte boundary.
 * Split-K: with SPLIT > 1 each CTA leaves its fp32 tile (128 x BN) in its own shared memory, the
 *   cluster synchronises, and CTA rank r sums rows r·128/SPLIT .. (r+1)·128/SPLIT - 1 over the
 *   cluster's CTAs in rank order through distributed shared memory (ld.shared::cluster), adds the
 *   bias and rounds once to bf16: no partials in global memory, no atomics, the same bits on
 *   every run (the order is a function of the shape only).
 * Decode steps (programmatic dependent launch, ptx.cuh): while a step is recorded
 *   (cx->recording) the kernel is launched with programmatic serialization and the producer
 *   issues the weight tiles of the first STAGES k steps BEFORE pdl_wait, so the weight stream
 *   starts while the kernel before (a norm, the attention's combine, SwiGLU) is still running;
 *   the rows tiles (that kernel's output) are copied only after pdl_wait. Weights are constant
 *   during a recorded step. Outside recordings nothing is issued before the wait.
 * Fused SwiGLU (cuda_matmul_swiglu_forward, the decode step's MLP): the gate_up product with a
 *   CTA on BN/2 features, its gate rows and up rows in one tile, writes silu(gate) · up directly
 *   (the SwiGLU kernel and the (M, 2F) product's store and load disappear) with the roundings of
 *   the two ops.
 * Conditions (else cuBLASLt): M <= 128, IC a multiple of 64 · SPLIT, OC a multiple of BN,
 *   inp / W / out 16-byte aligned, an sm_90a build on a 9.0 device, and a configuration that
 *   fills at least half the SMs.
 */
#ifndef KERNELS_MATMUL_ROWS_CUH
#define KERNELS_MATMUL_ROWS_CUH

#include <cudaTypedefs.h>  // CUtensorMap, PFN_cuTensorMapEncodeTiled (types only: no libcuda link)

#include "ptx.cuh"

#ifndef ATTN_WGMMA_BUILD
#define ATTN_WGMMA_BUILD 0
#endif
#define RG_ENABLED PTX_SM90A

#define RG_ROWS 128   // rows a CTA holds (two consumer warpgroups of 64)
#define RG_BK 64      // k per stage (128 bytes: one swizzled row)
#define RG_STAGES 6  // ring depth (one CTA per SM; a 4-deep ring at two CTAs per SM was no faster)
#define RG_THREADS 288  // 2 consumer warpgroups + the producer warp
#define RG_MAX_SPLIT 8
#define RG_X_BYTES (RG_ROWS * RG_BK * 2)  // 16 KiB
#define RG_RED_PAD 4                      // fp32 per row of padding in the split-K tile

static __host__ __device__ constexpr int rg_stage_bytes(int bn) { return RG_X_BYTES + bn * RG_BK * 2; }
// ring + room to align the base to 1024 bytes + the mbarriers (2 per stage)
static __host__ __device__ constexpr int rg_smem_bytes(int bn) {
    return RG_STAGES * rg_stage_bytes(bn) + 1024 + 16 * RG_STAGES;
}

// ----------------------------------------------------------------------------
// device helpers (sm_90a): TMA, cluster rank / barrier / remote loads (the wgmma: ptx.cuh wgmma_ss)

// One arrival on the mbarrier that also expects `bytes` of transactions in this phase.
__device__ __forceinline__ void rg_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if RG_ENABLED
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
#endif
}
// The box of tensor map `map` at (c0 innermost, c1) into shared `dst`; its bytes complete as
// transactions on the mbarrier `bar`.
__device__ __forceinline__ void rg_tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
#if RG_ENABLED
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
        "[%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
#endif
}
__device__ __forceinline__ uint32_t rg_cluster_rank() {
    uint32_t r = 0;
#if RG_ENABLED
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
    return r;
}
// Every thread of every CTA of the cluster: writes before it are visible to reads after it.
__device__ __forceinline__ void rg_cluster_sync() {
#if RG_ENABLED
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// 16 bytes of CTA `rank`'s shared memory at the address `addr` has in this CTA.
__device__ __forceinline__ float4 rg_ld_cluster(uint32_t addr, uint32_t rank) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if RG_ENABLED
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
#endif
    return v;
}
// The consumers' named barrier (256 threads; barrier 0 is __syncthreads).
__device__ __forceinline__ void rg_consumers_sync() {
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

// ----------------------------------------------------------------------------
// the kernel

// SWIGLU: the weight is [gate (OC rows); up (OC rows)] and the CTA's BN rows are gate rows n0 ..
// n0 + BN/2 and the up rows OC + n0 .. (two boxes of BN/2 rows, tm_w's box), so each thread holds
// a feature's gate and up sums (accumulator columns c and c + BN/2): out (M, OC) = silu(gate) ·
// up with every rounding of matmul then swiglu_forward (elementwise.cu): gate and up to bf16,
// silu(gate) to bf16, the product to bf16. Split 1 only.
template <int BN, bool SWIGLU>
__global__ void __launch_bounds__(RG_THREADS, 1)
    matmul_rows_kernel(const __grid_constant__ CUtensorMap tm_x,
                       const __grid_constant__ CUtensorMap tm_w, bf16* __restrict__ out,
                       const bf16* __restrict__ bias, int M, int IC, int OC, int w_early) {
#if RG_ENABLED
    constexpr int S = RG_STAGES, SB = rg_stage_bytes(BN), NI = BN / 8;
    extern __shared__ __align__(1024) unsigned char rg_smem[];
    const uint32_t sbase = (smem_u32(rg_smem) + 1023u) & ~1023u;
    const uint32_t bar_full = sbase + S * SB;     // [S] stage landed (1 arrival + its bytes)
    const uint32_t bar_empty = bar_full + 8 * S;  // [S] stage released (8 consumer warps)
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2;
    const int split = gridDim.x, kper = IC / split, n_kt = kper / RG_BK;
    const int k_begin = blockIdx.x * kper, n0 = blockIdx.y * (SWIGLU ? BN / 2 : BN);
    // the weight tile's copies: rows n0 .. (one box), or gate rows n0 and up rows OC + n0
    auto load_w = [&](uint32_t dst, int k0, uint32_t bar) {
        if (SWIGLU) {
            rg_tma_load(dst, &tm_w, k0, n0, bar);
            rg_tma_load(dst + (BN / 2) * 128, &tm_w, k0, OC + n0, bar);
        } else {
            rg_tma_load(dst, &tm_w, k0, n0, bar);
        }
    };
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(bar_full + 8 * s, 1);
            mbar_init(bar_empty + 8 * s, 8);
        }
        mbar_init_fence();
    }
    __syncthreads();

    float acc[NI][4];
    if (wg == 2) {  // the producer warp: lane 0 issues every copy
        if (lane == 0) {
            const int pre = w_early ? (n_kt < S ? n_kt : S) : 0;
            for (int u = 0; u < pre; u++) {  // weights only: constant during a recorded step
                rg_arrive_expect_tx(bar_full + 8 * u, SB);
                load_w(sbase + u * SB + RG_X_BYTES, k_begin + u * RG_BK, bar_full + 8 * u);
            }
            pdl_wait();  // the rows (the kernel before's output) only once it has completed
            pdl_trigger();
            for (int u = 0; u < n_kt; u++) {
                const int s = u % S;
                const uint32_t st = sbase + s * SB, full = bar_full + 8 * s;
                const int k0 = k_begin + u * RG_BK;
                if (u >= S) mbar_wait(bar_empty + 8 * s, ((u / S) & 1) ^ 1);
                if (u >= pre) {
                    rg_arrive_expect_tx(full, SB);
                    load_w(st + RG_X_BYTES, k0, full);
                }
                rg_tma_load(st, &tm_x, k0, 0, full);
            }
        } else {
            pdl_wait();
            pdl_trigger();
        }
        __syncwarp();  // (the split-K epilogue's cluster barriers want the warp converged)
    } else {  // consumers
        pdl_wait();
        pdl_trigger();
#pragma unroll
        for (int i = 0; i < NI; i++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][q] = 0.0f;
        for (int u = 0; u < n_kt; u++) {
            const int s = u % S;
            mbar_wait(bar_full + 8 * s, (u / S) & 1);
            const uint32_t sa = sbase + s * SB + wg * 64 * 128, sb = sbase + s * SB + RG_X_BYTES;
            wgmma_fence();
            wg_fence_acc(acc);
#pragma unroll
            for (int kk = 0; kk < RG_BK / 16; kk++)
                wgmma_ss<BN>(acc, wg_desc(sa + kk * 32, 16, 1024), wg_desc(sb + kk * 32, 16, 1024),
                             u > 0 || kk > 0);
            wgmma_commit();
            wg_fence_acc(acc);
            wgmma_wait<1>();  // the previous k step's wgmmas have retired: release its stage
            wg_fence_acc(acc);
            if (u > 0 && lane == 0) mbar_arrive(bar_empty + 8 * ((u - 1) % S));
        }
        wgmma_wait<0>();
        wg_fence_acc(acc);
    }

    // Accumulator of consumer thread (warp v of warpgroup wg, g = lane / 4, t = lane % 4):
    // acc[i][q] is row 64 wg + 16 v + g + 8 (q / 2), column 8 i + 2 t + (q % 2) of the tile.
    const int v = warp & 3, g = lane >> 2, t = lane & 3;
    if (SWIGLU) {
        if (wg == 2) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = wg * 64 + 16 * v + g + 8 * h;
            if (m >= M) continue;
            bf16* orow = out + (size_t)m * OC + n0;
#pragma unroll
            for (int i = 0; i < NI / 2; i++) {
                float y[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float gt = bf16_round(acc[i][2 * h + e]);
                    const float up = bf16_round(acc[i + NI / 2][2 * h + e]);
                    y[e] = bf16_round(gt * sigmoid_f(gt)) * up;
                }
                *reinterpret_cast<__nv_bfloat162*>(orow + 8 * i + 2 * t) =
                    __floats2bfloat162_rn(y[0], y[1]);
            }
        }
        return;
    }
    if (split == 1) {
        if (wg == 2) return;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = wg * 64 + 16 * v + g + 8 * h;
            if (m >= M) continue;
            bf16* orow = out + (size_t)m * OC + n0;
#pragma unroll
            for (int i = 0; i < NI; i++) {
                const int n = 8 * i + 2 * t;
                float a0 = acc[i][2 * h], a1 = acc[i][2 * h + 1];
                if (bias) {
                    a0 += __bfloat162float(bias[n0 + n]);
                    a1 += __bfloat162float(bias[n0 + n + 1]);
                }
                *reinterpret_cast<__nv_bfloat162*>(orow + n) = __floats2bfloat162_rn(a0, a1);
            }
        }
        return;
    }

    // split-K: the fp32 tile (128 x BN, rows padded) into this CTA's ring, once every consumer
    // is past its last wgmma (no copy is in flight: every stage published was consumed)
    constexpr int LDR = BN + RG_RED_PAD;
    float* red = reinterpret_cast<float*>(rg_smem + (sbase - smem_u32(rg_smem)));
    if (wg < 2) {
        rg_consumers_sync();
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = wg * 64 + 16 * v + g + 8 * h;
#pragma unroll
            for (int i = 0; i < NI; i++)
                *reinterpret_cast<float2*>(red + m * LDR + 8 * i + 2 * t) =
                    make_float2(acc[i][2 * h], acc[i][2 * h + 1]);
        }
    }
    rg_cluster_sync();
    // CTA rank r: rows r·128/split .. of the sum over ranks 0 .. split-1 in order, 4 columns a
    // thread at a time (every thread of the CTA)
    const uint32_t rank = rg_cluster_rank();
    const int rows = RG_ROWS / split, r0 = (int)rank * rows;
    constexpr int C4 = BN / 4;
    for (int e = tid; e < rows * C4; e += RG_THREADS) {
        const int m = r0 + e / C4, c = (e % C4) * 4;
        if (m >= M) continue;
        const uint32_t a = sbase + (uint32_t)(m * LDR + c) * 4u;
        float4 s = rg_ld_cluster(a, 0);
        for (int q = 1; q < split; q++) {
            const float4 o = rg_ld_cluster(a, (uint32_t)q);
            s.x += o.x;
            s.y += o.y;
            s.z += o.z;
            s.w += o.w;
        }
        if (bias) {
            s.x += __bfloat162float(bias[n0 + c]);
            s.y += __bfloat162float(bias[n0 + c + 1]);
            s.z += __bfloat162float(bias[n0 + c + 2]);
            s.w += __bfloat162float(bias[n0 + c + 3]);
        }
        __nv_bfloat162 lo = __floats2bfloat162_rn(s.x, s.y), hi = __floats2bfloat162_rn(s.z, s.w);
        uint2 pk;
        pk.x = *reinterpret_cast<uint32_t*>(&lo);
        pk.y = *reinterpret_cast<uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(out + (size_t)m * OC + n0 + c) = pk;
    }
    rg_cluster_sync();  // no CTA leaves while another still reads its shared memory
#endif
}

// ----------------------------------------------------------------------------
// host

typedef struct RowsPlan {
    int bn, split;  // 0: not this kernel
    int swiglu;     // the fused gate_up + SwiGLU (out is (M, OC/2); split 1)
} RowsPlan;

typedef void (*RowsKernel)(const CUtensorMap, const CUtensorMap, bf16*, const bf16*, int, int, int,
                           int);

static int rg_bn_index(int bn) { return bn / 32 - 1; }
static int rg_split_index(int split) { return split == 1 ? 0 : split == 2 ? 1 : split == 4 ? 2 : 3; }
static RowsKernel rg_kernel(int bn, int swiglu) {
    if (swiglu)
        return bn == 64   ? matmul_rows_kernel<64, true>
               : bn == 96 ? matmul_rows_kernel<96, true>
                          : matmul_rows_kernel<128, true>;
    return bn == 32   ? matmul_rows_kernel<32, false>
           : bn == 64 ? matmul_rows_kernel<64, false>
           : bn == 96 ? matmul_rows_kernel<96, false>
                      : matmul_rows_kernel<128, false>;
}

// Clusters of `split` CTAs of the BN kernel that can be resident at once (cached in the context;
// also sets the kernel's shared-memory attribute, once).
static int rg_max_clusters(CudaCtx* cx, int bn, int split, int swiglu) {
    int* slot = &cx->rows_max_clusters[swiglu][rg_bn_index(bn)][rg_split_index(split)];
    if (*slot) return *slot;
    RowsKernel kernel = rg_kernel(bn, swiglu);
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    rg_smem_bytes(bn)));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(split, 1024 / split);
    cfg.blockDim = dim3(RG_THREADS);
    cfg.dynamicSmemBytes = rg_smem_bytes(bn);
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = split;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = 0;
    cuda_check(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
    *slot = n > 0 ? n : -1;
    return *slot;
}

// Whether the rows kernel can take the product and with which tile. A CTA streams its weight
// slice and the rows' slice, (BN + 128) x IC / SPLIT elements, and one SM takes them in at
// about 60 GB/s whatever the tile (the lab's session-13 numbers), so the plan is the one wave
// (CTAs <= SMs, clusters <= those the device holds) with the most CTAs, ties to the least per
// CTA; none when no configuration fills half the SMs (cuBLASLt then: the LM head's 1,187 tiles
// of 128 run in waves there; the rows kernel in waves measured no faster, docs/PERF.md). swiglu: the fused gate_up +
// SwiGLU (OC features, the weight 2 OC rows): split 1, a CTA on BN/2 features.
static RowsPlan rows_plan(CudaCtx* cx, const bf16* out, const bf16* inp, const bf16* w, int M,
                              int IC, int OC, int swiglu) {
    RowsPlan best = {0, 0, swiglu};
    if (!ATTN_WGMMA_BUILD || !cx->sm90 || M <= 0 || M > RG_ROWS || IC % RG_BK != 0 ||
        !is_aligned16(out) || !is_aligned16(inp) || !is_aligned16(w) ||
        rg_smem_bytes(128) > (int)cx->max_smem_optin)
        return best;
    long long best_cost = 0;
    int best_ctas = 0;
    for (int split = 1; split <= (swiglu ? 1 : RG_MAX_SPLIT) && IC % (split * RG_BK) == 0;
         split *= 2)
        for (int bn = swiglu ? 64 : 32; bn <= 128; bn += 32) {
            const int cols = swiglu ? bn / 2 : bn;  // output columns per CTA
            if (OC % cols != 0) continue;
            const long long ctas = (long long)(OC / cols) * split;
            const long long cost = (long long)(bn + RG_ROWS) * (IC / split);
            if (ctas > cx->n_sms || 2 * ctas < cx->n_sms) continue;
            if (best.bn && (ctas < best_ctas || (ctas == best_ctas && cost >= best_cost))) continue;
            if (split > 1 && OC / cols > rg_max_clusters(cx, bn, split, swiglu))
                continue;
            best_cost = cost;
            best_ctas = (int)ctas;
            best.bn = bn;
            best.split = split;
        }
    return best;
}

// A 2-D row-major bf16 tensor (rows x cols) as a tensor map with boxes of box_rows x 64 columns
// in the 128-byte swizzle; rows past `rows` read as zeros.
static CUtensorMap rg_tensor_map(CudaCtx* cx, const bf16* p, int rows, int cols, int box_rows) {
    if (!cx->encode_tiled) {
        cudaDriverEntryPointQueryResult q;
        void* fn = NULL;
        cuda_check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                    cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !fn)
            fatal("the CUDA driver has no cuTensorMapEncodeTiled (the rows matmul needs it)");
        cx->encode_tiled = fn;
    }
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)cols * sizeof(bf16)};
    const cuuint32_t box[2] = {RG_BK, (cuuint32_t)box_rows};
    const cuuint32_t estrides[2] = {1, 1};
    const CUresult r = ((PFN_cuTensorMapEncodeTiled_v12000)cx->encode_tiled)(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)p, dims, strides, box, estrides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        fatal("cuTensorMapEncodeTiled failed (%d) for a %d x %d bf16 tensor, box %d x %d", (int)r,
              rows, cols, box_rows, RG_BK);
    return map;
}

static void matmul_rows_launch(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w,
                               const bf16* bias, int M, int IC, int OC, RowsPlan p) {
    RowsKernel kernel = rg_kernel(p.bn, p.swiglu);
    rg_max_clusters(cx, p.bn, p.split, p.swiglu);  // (sets the shared-memory attribute once)
    const CUtensorMap tm_x = rg_tensor_map(cx, inp, M, IC, RG_ROWS);
    const CUtensorMap tm_w = p.swiglu ? rg_tensor_map(cx, w, 2 * OC, IC, p.bn / 2)
                                      : rg_tensor_map(cx, w, OC, IC, p.bn);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(p.split, OC / (p.swiglu ? p.bn / 2 : p.bn));
    cfg.blockDim = dim3(RG_THREADS);
    cfg.dynamicSmemBytes = rg_smem_bytes(p.bn);
    cfg.stream = cx->stream;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = p.split;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cx->recording ? 2 : 1;
    cuda_check(cudaLaunchKernelEx(&cfg, kernel, tm_x, tm_w, out, bias, M, IC, OC, cx->recording));
}

#endif  // KERNELS_MATMUL_ROWS_CUH
