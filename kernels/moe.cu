/*
 * moe.cu — the mixture-of-experts ops of ops.h other than the grouped matmul (moe_matmul.cu):
 * routing forward and backward, the dispatch (a stable counting sort of the n*K assignments by
 * expert), the gather and its backward, the combine and its backward, the router statistics of
 * the aux loss, and the GPT-OSS clamped GLU. Launchers in moe.cuh; lab dev/cuda/moe.cu.
 *
 * Semantics are those of llmc/ops_cpu_moe.c, computed the same way where it decides bits:
 *  - Routing: one warp per row, the row of logits in registers (EPL per lane, E <= 256). The
 *    softmax is fp32 with the sum in double (as the CPU's), so p matches the CPU's up to expf's
 *    last bit; the top-k is a warp argmax K times with ties to the lower expert index; the K
 *    chosen live one per lane and are summed in k order in double. GPT-OSS's mode picks on the raw
 *    bf16 logits: its indices equal the CPU's bit for bit.
 *  - Dispatch: per block of DISPATCH_CHUNK assignments an expert histogram, one ordered exclusive
 *    scan of the (expert, block) counts, then a stable scatter (tiles in order, warps in order,
 *    lanes in order via __match_any_sync), so src/dst/offsets equal the CPU's exactly. Integer
 *    shared-memory atomics only (their result does not depend on the order).
 *  - Gather backward and combine forward: fp32 sums over k in order (multiply and add rounded
 *    separately, as the CPU does), one bf16 rounding at the end. Combine backward: one warp per
 *    (row, k); dweights a warp reduction (fixed xor butterfly).
 *  - Router statistics: per-block partial column sums of p in double over fixed row chunks, then
 *    the partials summed in block order (no atomics); counts from the offsets.
 *  - GPT-OSS GLU: the forward rounds to bf16 where HF transformers, computing in bf16, rounds
 *    (after gate*alpha, the sigmoid, gate*σ and up+1); the backward is fp32 throughout.
 * Every shape-dependent split is a function of the shape only, never of the device: the same
 * inputs give the same bits on every run.
 */
#include <type_traits>

#include "moe.cuh"

#define FULL_MASK 0xffffffffu

// ----------------------------------------------------------------------------
// helpers

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Calls launch(std::integral_constant<int, EPL>()) with the experts-per-lane template argument of
// the routing kernels: the smallest of 1, 2, 4, 8 whose 32 * EPL holds E.
template <typename Launch>
static void with_route_epl(int E, Launch launch) {
    if (E <= 32)
        launch(std::integral_constant<int, 1>());
    else if (E <= 64)
        launch(std::integral_constant<int, 2>());
    else if (E <= 128)
        launch(std::integral_constant<int, 4>());
    else
        launch(std::integral_constant<int, 8>());
}

static void route_check(const char* op, int E, int K, int mode) {
    if (E < 1 || E > MOE_MAX_EXPERTS)
        fatal("%s: %d experts; the CUDA backend takes 1..%d", op, E, MOE_MAX_EXPERTS);
    if (K < 1 || K > E || K > MOE_MAX_K)
        fatal("%s: %d experts per token with %d experts; the CUDA backend takes 1..min(E, %d)",
              op, K, E, MOE_MAX_K);
    if (mode < MOE_ROUTE_SOFTMAX_TOPK || mode > MOE_ROUTE_TOPK_SOFTMAX)
        fatal("%s: unknown routing mode %d", op, mode);
}

// ----------------------------------------------------------------------------
// routing: one warp per row, expert e = lane + 32 j in register j of its lane

#define ROUTE_WARPS 8  // rows per block

template <int EPL>
__device__ __forceinline__ void route_load_row(float* z, const bf16* row, int E, int lane) {
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane + 32 * j;
        z[j] = e < E ? __bfloat162float(row[e]) : -INFINITY;
    }
}

// p = softmax(z) as ops_cpu_moe.c's softmax_row: fp32 exp, the sum in double, one fp32 scale.
// Padding experts (e >= E) get p = 0.
template <int EPL>
__device__ __forceinline__ void route_softmax(float* p, const float* z, int E, int lane) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < EPL; j++)
        if (lane + 32 * j < E) m = fmaxf(m, z[j]);
    m = warp_max(m);
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        p[j] = lane + 32 * j < E ? expf(z[j] - m) : 0.0f;
        s += p[j];
    }
    s = warp_sum_double(s);
    const float inv = (float)(1.0 / s);
#pragma unroll
    for (int j = 0; j < EPL; j++) p[j] *= inv;
}

// The K largest of v, best first, ties to the lower expert index: K rounds of a warp argmax over
// the experts not yet taken. Lane k (< K) returns the k-th choice in *my_i, *my_v.
template <int EPL>
__device__ __forceinline__ void route_topk(int* my_i, float* my_v, const float* v, int E, int K,
                                           int lane) {
    unsigned taken = 0;  // bit j: expert lane + 32 j is chosen
    for (int k = 0; k < K; k++) {
        float bv = 0.0f;
        int bi = -1;
        // within a lane j ascends with e: strict > keeps the lower index on a tie
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            const int e = lane + 32 * j;
            if (e < E && !((taken >> j) & 1u) && (bi < 0 || v[j] > bv)) {
                bv = v[j];
                bi = e;
            }
        }
        // (value, -index) is a total order on non-NaN values: every lane ends with the same best
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        // lane 0's choice for all (NaN logits break the order; the lanes must still agree)
        bv = __shfl_sync(FULL_MASK, bv, 0);
        bi = __shfl_sync(FULL_MASK, bi, 0);
        if (bi >= 0 && (bi & 31) == lane) taken |= 1u << (bi >> 5);
        if (lane == k) {
            *my_i = bi;
            *my_v = bv;
        }
    }
}

template <int EPL>
__global__ void moe_route_forward_kernel(int32_t* __restrict__ idx, float* __restrict__ weights,
                                         const bf16* __restrict__ logits, int n, int E, int K,
                                         int mode) {
    const int row = blockIdx.x * ROUTE_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= n) return;  // the whole warp: row is per warp
    float z[EPL], v[EPL];
    route_load_row<EPL>(z, logits + (size_t)row * E, E, lane);
    if (mode == MOE_ROUTE_TOPK_SOFTMAX) {
#pragma unroll
        for (int j = 0; j < EPL; j++) v[j] = z[j];
    } else {
        route_softmax<EPL>(v, z, E, lane);
    }
    int my_i = 0;
    float my_v = 0.0f;
    route_topk<EPL>(&my_i, &my_v, v, E, K, lane);
    float w = my_v;  // MOE_ROUTE_SOFTMAX_TOPK: the chosen p
    if (mode == MOE_ROUTE_TOPK_SOFTMAX) {
        // softmax over the K chosen logits; the first is the largest
        const float top = __shfl_sync(FULL_MASK, my_v, 0);
        const float ex = lane < K ? expf(my_v - top) : 0.0f;
        double s = 0.0;
        for (int k = 0; k < K; k++) s += (double)__shfl_sync(FULL_MASK, ex, k);
        w = (float)((double)ex / s);
    } else if (mode == MOE_ROUTE_SOFTMAX_TOPK_NORM) {
        double s = 0.0;
        for (int k = 0; k < K; k++) s += (double)__shfl_sync(FULL_MASK, my_v, k);
        w = (float)((double)my_v / s);
    }
    if (lane < K) {
        idx[(size_t)row * K + lane] = my_i;
        weights[(size_t)row * K + lane] = w;
    }
}

// ops_cpu_moe.c's route_backward_task per row. Sums of K terms in k order, of E terms by the
// warp butterfly (double); the per-expert updates in the CPU's float/double mix (explicit _rn so
// no multiply-add is contracted where the CPU rounds twice).
template <int EPL>
__global__ void moe_route_backward_kernel(bf16* __restrict__ dlogits,
                                          const float* __restrict__ dweights,
                                          const bf16* __restrict__ logits,
                                          const int32_t* __restrict__ idx,
                                          const float* __restrict__ weights,
                                          const float* __restrict__ counts, float aux_scale, int n,
                                          int E, int K, int mode) {
    const int row = blockIdx.x * ROUTE_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= n) return;
    const size_t rk = (size_t)row * K;
    const int my_i = lane < K ? idx[rk + lane] : -1;
    const float my_w = lane < K ? weights[rk + lane] : 0.0f;
    const float my_dw = lane < K ? dweights[rk + lane] : 0.0f;
    double wdw = 0.0;
    for (int k = 0; k < K; k++)
        wdw += (double)__shfl_sync(FULL_MASK, my_w, k) * (double)__shfl_sync(FULL_MASK, my_dw, k);
    float p[EPL], dl[EPL];
    if (mode == MOE_ROUTE_SOFTMAX_TOPK || aux_scale != 0.0f) {
        float z[EPL];
        route_load_row<EPL>(z, logits + (size_t)row * E, E, lane);
        route_softmax<EPL>(p, z, E, lane);
    } else {
#pragma unroll
        for (int j = 0; j < EPL; j++) p[j] = 0.0f;
    }
    if (mode == MOE_ROUTE_SOFTMAX_TOPK) {
        // w_k = p_{i_k}: dl_j = p_j (dw(j) - Σ_k w_k dw_k)
#pragma unroll
        for (int j = 0; j < EPL; j++) dl[j] = (float)(-(double)p[j] * wdw);
        for (int k = 0; k < K; k++) {
            const int i = __shfl_sync(FULL_MASK, my_i, k);
            const float d = __shfl_sync(FULL_MASK, my_dw, k);
            const int sel = (i & 31) == lane ? i >> 5 : -1;  // its register here, if any
#pragma unroll
            for (int j = 0; j < EPL; j++) {
                const float upd = __fadd_rn(dl[j], __fmul_rn(p[j], d));
                dl[j] = j == sel ? upd : dl[j];
            }
        }
    } else {
        // renormalised over the chosen: dl_{i_k} = w_k (dw_k - Σ_j w_j dw_j), 0 elsewhere
#pragma unroll
        for (int j = 0; j < EPL; j++) dl[j] = 0.0f;
        for (int k = 0; k < K; k++) {
            const int i = __shfl_sync(FULL_MASK, my_i, k);
            const float wk = __shfl_sync(FULL_MASK, my_w, k);
            const float d = __shfl_sync(FULL_MASK, my_dw, k);
            const int sel = (i & 31) == lane ? i >> 5 : -1;
            const float val = (float)((double)wk * ((double)d - wdw));
#pragma unroll
            for (int j = 0; j < EPL; j++) dl[j] = j == sel ? val : dl[j];
        }
    }
    if (aux_scale != 0.0f) {  // aux_scale p_j (c_j - Σ_e c_e p_e)
        double cp = 0.0;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            const int e = lane + 32 * j;
            if (e < E) cp += (double)counts[e] * p[j];
        }
        cp = warp_sum_double(cp);
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            const int e = lane + 32 * j;
            if (e < E)
                dl[j] = __fadd_rn(
                    dl[j], (float)((double)__fmul_rn(aux_scale, p[j]) * ((double)counts[e] - cp)));
        }
    }
    bf16* out = dlogits + (size_t)row * E;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane + 32 * j;
        if (e < E) out[e] = __float2bfloat16_rn(dl[j]);
    }
}

void cuda_moe_route_forward(CudaCtx* cx, int32_t* idx, float* weights, const bf16* logits, int n,
                            int E, int K, int mode) {
    route_check("moe_route_forward", E, K, mode);
    if (n <= 0) return;
    const unsigned grid = grid_size((size_t)n, ROUTE_WARPS);
    with_route_epl(E, [&](auto epl) {
        moe_route_forward_kernel<decltype(epl)::value><<<grid, ROUTE_WARPS * 32, 0, cx->stream>>>(
            idx, weights, logits, n, E, K, mode);
    });
    cuda_check_launch();
}

void cuda_moe_route_backward(CudaCtx* cx, bf16* dlogits, const float* dweights, const bf16* logits,
                             const int32_t* idx, const float* weights, const float* counts,
                             float aux_scale, int n, int E, int K, int mode) {
    route_check("moe_route_backward", E, K, mode);
    if (aux_scale != 0.0f && counts == NULL)
        fatal("moe_route_backward: an aux term (aux_scale %g) needs the expert counts", aux_scale);
    if (n <= 0) return;
    const unsigned grid = grid_size((size_t)n, ROUTE_WARPS);
    with_route_epl(E, [&](auto epl) {
        moe_route_backward_kernel<decltype(epl)::value><<<grid, ROUTE_WARPS * 32, 0, cx->stream>>>(
            dlogits, dweights, logits, idx, weights, counts, aux_scale, n, E, K, mode);
    });
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// router statistics: stats[e] = rows routed to e, stats[E + e] = Σ_rows softmax(logits)[e]

#define STATS_TARGET_BLOCKS 256  // row chunks of the partial sums (fixed: the sum order is fixed)

// partial (blocks, E) double: block b's column sums over its row chunk; warp w takes rows
// r0 + w, r0 + w + ROUTE_WARPS, ... in order, then the warps are added in index order.
template <int EPL>
__global__ void moe_router_stats_partial_kernel(double* __restrict__ partial,
                                                const bf16* __restrict__ logits, int n, int E,
                                                int rows_per_block) {
    __shared__ double red[ROUTE_WARPS][MOE_MAX_EXPERTS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int r0 = blockIdx.x * rows_per_block, r1 = min(n, r0 + rows_per_block);
    double acc[EPL];
#pragma unroll
    for (int j = 0; j < EPL; j++) acc[j] = 0.0;
    for (int row = r0 + warp; row < r1; row += ROUTE_WARPS) {  // uniform per warp
        float z[EPL], p[EPL];
        route_load_row<EPL>(z, logits + (size_t)row * E, E, lane);
        route_softmax<EPL>(p, z, E, lane);
#pragma unroll
        for (int j = 0; j < EPL; j++) acc[j] += p[j];
    }
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane + 32 * j;
        if (e < E) red[warp][e] = acc[j];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double s = 0.0;
        for (int w = 0; w < ROUTE_WARPS; w++) s += red[w][e];
        partial[(size_t)blockIdx.x * E + e] = s;
    }
}

__global__ void moe_router_stats_finish_kernel(float* __restrict__ stats,
                                               const double* __restrict__ partial,
                                               const int32_t* __restrict__ offsets, int n_parts,
                                               int E) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    double s = 0.0;
    for (int b = 0; b < n_parts; b++) s += partial[(size_t)b * E + e];
    stats[E + e] = (float)s;
    stats[e] = (float)(offsets[e + 1] - offsets[e]);
}

void cuda_moe_router_stats(CudaCtx* cx, float* stats, const bf16* logits, const int32_t* offsets,
                           int n, int E) {
    if (E < 1 || E > MOE_MAX_EXPERTS)
        fatal("moe_router_stats: %d experts; the CUDA backend takes 1..%d", E, MOE_MAX_EXPERTS);
    int n_parts = 0;
    double* partial = NULL;
    if (n > 0) {
        const int rows = rows_per_block(n, STATS_TARGET_BLOCKS);
        n_parts = (n + rows - 1) / rows;
        partial = (double*)cuda_scratch(cx, SCRATCH_PARTIAL, (size_t)n_parts * E * sizeof(double));
        with_route_epl(E, [&](auto epl) {
            moe_router_stats_partial_kernel<decltype(epl)::value>
                <<<n_parts, ROUTE_WARPS * 32, 0, cx->stream>>>(partial, logits, n, E, rows);
        });
        cuda_check_launch();
    }
    moe_router_stats_finish_kernel<<<grid_size((size_t)E, 256), 256, 0, cx->stream>>>(
        stats, partial, offsets, n_parts, E);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// dispatch: a stable counting sort of the assignments r = row*K + k by expert

#define DISPATCH_THREADS 256
#define DISPATCH_WARPS (DISPATCH_THREADS / 32)
#define DISPATCH_TILES 4                                    // tiles of 256 per block, in order
#define DISPATCH_CHUNK (DISPATCH_THREADS * DISPATCH_TILES)  // assignments per block
#define SCAN_THREADS 1024

// Expert of assignment r; one outside [0, E) is flagged (when err is given) and taken as E - 1,
// so every position the sort writes stays in bounds.
__device__ __forceinline__ int dispatch_expert(const int32_t* idx, int r, int E, int* err) {
    int x = idx[r];
    if ((unsigned)x >= (unsigned)E) {
        if (err) atomicOr(err, CUDA_ERR_EXPERT);
        x = E - 1;
    }
    return x;
}

// hist (E, n_blocks), expert-major: assignments of block b's chunk that go to expert e.
__global__ void moe_dispatch_count_kernel(int* __restrict__ hist, const int32_t* __restrict__ idx,
                                          int R, int E, int n_blocks, int* err) {
    __shared__ int cnt[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    const int r0 = blockIdx.x * DISPATCH_CHUNK;
#pragma unroll
    for (int t = 0; t < DISPATCH_TILES; t++) {
        const int r = r0 + t * DISPATCH_THREADS + threadIdx.x;
        if (r < R) atomicAdd(&cnt[dispatch_expert(idx, r, E, err)], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        hist[(size_t)e * n_blocks + blockIdx.x] = cnt[e];
}

// In place: hist (E, n_blocks) becomes its exclusive prefix sum in (expert, block) order, the
// first sorted position of block b's assignments to expert e; offsets[e] = that of block 0,
// offsets[E] = the total. One block: each thread scans a contiguous segment.
__global__ void moe_dispatch_scan_kernel(int* __restrict__ hist, int32_t* __restrict__ offsets,
                                         int E, int n_blocks) {
    __shared__ int warp_total[SCAN_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int M = E * n_blocks, seg = (M + SCAN_THREADS - 1) / SCAN_THREADS;
    const int i0 = min(M, tid * seg), i1 = min(M, i0 + seg);
    int s = 0;
    for (int i = i0; i < i1; i++) s += hist[i];
    int x = s;  // inclusive scan of the segment sums: in the warp, then over the warps
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_total[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int t = warp_total[lane];  // SCAN_THREADS / 32 == 32 warps
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, t, o);
            if (lane >= o) t += y;
        }
        warp_total[lane] = t;
    }
    __syncthreads();
    int excl = x - s + (warp > 0 ? warp_total[warp - 1] : 0);
    for (int i = i0; i < i1; i++) {
        const int c = hist[i];
        hist[i] = excl;
        if (i % n_blocks == 0) offsets[i / n_blocks] = excl;
        excl += c;
    }
    if (tid == SCAN_THREADS - 1) offsets[E] = excl;  // the last segment ends at the total
}

// Block b places its chunk: the rank of an assignment among the earlier ones of its expert in
// the chunk is (earlier tiles) + (earlier warps of this tile) + (earlier lanes of its warp).
__global__ void __launch_bounds__(DISPATCH_THREADS)
    moe_dispatch_scatter_kernel(int32_t* __restrict__ src, int32_t* __restrict__ dst,
                                const int32_t* __restrict__ idx, const int* __restrict__ start,
                                int R, int E, int n_blocks) {
    __shared__ int base[MOE_MAX_EXPERTS];     // first position of this block's rows per expert
    __shared__ int running[MOE_MAX_EXPERTS];  // placed so far by earlier tiles
    __shared__ int wcount[DISPATCH_WARPS][MOE_MAX_EXPERTS];  // this tile, per warp
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e < E; e += DISPATCH_THREADS) {
        base[e] = start[(size_t)e * n_blocks + blockIdx.x];
        running[e] = 0;
        for (int w = 0; w < DISPATCH_WARPS; w++) wcount[w][e] = 0;
    }
    const int r0 = blockIdx.x * DISPATCH_CHUNK;
    int x[DISPATCH_TILES];  // all loads in flight at once
#pragma unroll
    for (int t = 0; t < DISPATCH_TILES; t++) {
        const int r = r0 + t * DISPATCH_THREADS + tid;
        x[t] = r < R ? dispatch_expert(idx, r, E, NULL) : -1;
    }
    __syncthreads();
    const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
    for (int t = 0; t < DISPATCH_TILES; t++) {
        const int r = r0 + t * DISPATCH_THREADS + tid;
        const unsigned same = __match_any_sync(FULL_MASK, x[t]);
        if (x[t] >= 0 && lane == 31 - __clz(same)) wcount[warp][x[t]] = __popc(same);
        __syncthreads();
        if (x[t] >= 0) {
            int rank = running[x[t]] + __popc(same & lanes_below);
            for (int w = 0; w < warp; w++) rank += wcount[w][x[t]];
            const int pos = base[x[t]] + rank;
            src[pos] = r;
            dst[r] = pos;
        }
        __syncthreads();
        for (int e = tid; e < E; e += DISPATCH_THREADS) {
            int s = 0;
            for (int w = 0; w < DISPATCH_WARPS; w++) {
                s += wcount[w][e];
                wcount[w][e] = 0;
            }
            running[e] += s;
        }
        __syncthreads();
    }
}

void cuda_moe_dispatch(CudaCtx* cx, int32_t* offsets, int32_t* src, int32_t* dst,
                       const int32_t* idx, int n, int E, int K) {
    if (E < 1 || E > MOE_MAX_EXPERTS)
        fatal("moe_dispatch: %d experts; the CUDA backend takes 1..%d", E, MOE_MAX_EXPERTS);
    const int64_t R = (int64_t)(n > 0 ? n : 0) * (K > 0 ? K : 0);
    if (R > (int64_t)INT32_MAX - DISPATCH_CHUNK)
        fatal("moe_dispatch: %lld routed rows exceed the int32 positions of the sort",
              (long long)R);
    if (R == 0) {
        cuda_check(cudaMemsetAsync(offsets, 0, (size_t)(E + 1) * sizeof(int32_t), cx->stream));
        return;
    }
    const int n_blocks = (int)((R + DISPATCH_CHUNK - 1) / DISPATCH_CHUNK);
    int* hist = (int*)cuda_scratch(cx, SCRATCH_SORT, (size_t)E * n_blocks * sizeof(int));
    moe_dispatch_count_kernel<<<n_blocks, DISPATCH_THREADS, 0, cx->stream>>>(hist, idx, (int)R, E,
                                                                            n_blocks, cx->d_error);
    cuda_check_launch();
    moe_dispatch_scan_kernel<<<1, SCAN_THREADS, 0, cx->stream>>>(hist, offsets, E, n_blocks);
    cuda_check_launch();
    moe_dispatch_scatter_kernel<<<n_blocks, DISPATCH_THREADS, 0, cx->stream>>>(src, dst, idx, hist,
                                                                              (int)R, E, n_blocks);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// gather, gather backward, combine: one warp per row, 16-byte accesses when C % 8 == 0

#define ROW_WARPS 8  // rows per block

// out (R, C) row i = inp row src[i] / K.
template <int VEC>
__global__ void moe_gather_kernel(bf16* __restrict__ out, const bf16* __restrict__ inp,
                                  const int32_t* __restrict__ src, int R, int K, int C) {
    const int i = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (i >= R) return;
    const bf16* s = inp + (size_t)(src[i] / K) * C;
    bf16* o = out + (size_t)i * C;
    if constexpr (VEC == 8) {
#pragma unroll 4
        for (int c = lane * 8; c < C; c += 32 * 8)  // several 16-byte loads in flight per lane
            *reinterpret_cast<uint4*>(o + c) = *reinterpret_cast<const uint4*>(s + c);
    } else {
#pragma unroll 4
        for (int c = lane; c < C; c += 32) o[c] = s[c];
    }
}

// out (n, C) row = Σ_k [weights[row, k] ·] y[dst[row*K + k]], k in order from 0.0f, fp32, one
// rounding. Lane k holds assignment k's row and weight; the column loop runs in step over the
// warp (the shuffles need every lane).
template <int VEC, bool WEIGHTED>
__global__ void moe_sum_rows_kernel(bf16* __restrict__ out, const bf16* __restrict__ y,
                                    const float* __restrict__ weights,
                                    const int32_t* __restrict__ dst, int n, int K, int C) {
    const int row = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= n) return;
    const size_t rk = (size_t)row * K;
    const int my_r = lane < K ? dst[rk + lane] : 0;
    const float my_w = WEIGHTED && lane < K ? weights[rk + lane] : 1.0f;
    bf16* o = out + (size_t)row * C;
    for (int cb = 0; cb < C; cb += 32 * VEC) {
        const int c = cb + lane * VEC;
        const bool active = c < C;  // VEC == 8: C % 8 == 0, so c < C covers c .. c + 7
        float acc[VEC];
#pragma unroll
        for (int q = 0; q < VEC; q++) acc[q] = 0.0f;
#pragma unroll 4
        for (int k = 0; k < K; k++) {  // the K rows' loads are independent: several in flight
            const int r = __shfl_sync(FULL_MASK, my_r, k);
            const float w = __shfl_sync(FULL_MASK, my_w, k);
            if (active) {
                float v[VEC];
                load_bf16<VEC>(y + (size_t)r * C + c, v);
#pragma unroll
                for (int q = 0; q < VEC; q++)
                    acc[q] = WEIGHTED ? __fadd_rn(acc[q], __fmul_rn(w, v[q])) : acc[q] + v[q];
            }
        }
        if (active) store_bf16<VEC>(o + c, acc);
    }
}

// One warp per (row, k): dy[dst] = w · dout[row] (one rounding), dweights = dout[row] · y[dst].
template <int VEC>
__global__ void moe_combine_backward_kernel(bf16* __restrict__ dy, float* __restrict__ dweights,
                                            const bf16* __restrict__ dout,
                                            const bf16* __restrict__ y,
                                            const float* __restrict__ weights,
                                            const int32_t* __restrict__ dst, int64_t pairs, int K,
                                            int C) {
    const int64_t pr = (int64_t)blockIdx.x * ROW_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (pr >= pairs) return;
    const size_t row = (size_t)(pr / K), r = (size_t)dst[pr];
    const float w = weights[pr];
    const bf16* g = dout + row * C;
    const bf16* yr = y + r * C;
    bf16* d = dy + r * C;
    float dot = 0.0f;
#pragma unroll 2
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float gv[VEC], yv[VEC], dv[VEC];
        load_bf16<VEC>(g + c, gv);
        load_bf16<VEC>(yr + c, yv);
#pragma unroll
        for (int q = 0; q < VEC; q++) {
            dv[q] = __fmul_rn(w, gv[q]);
            dot = fmaf(gv[q], yv[q], dot);
        }
        store_bf16<VEC>(d + c, dv);
    }
    dot = warp_sum(dot);
    if (lane == 0) dweights[pr] = dot;
}

void cuda_moe_gather(CudaCtx* cx, bf16* out, const bf16* inp, const int32_t* src, int n, int K,
                     int C) {
    const int64_t R = (int64_t)n * K;
    if (R <= 0 || C <= 0) return;
    const unsigned grid = grid_size((size_t)R, ROW_WARPS);
    if (C % 8 == 0 && is_aligned16(out) && is_aligned16(inp))
        moe_gather_kernel<8><<<grid, ROW_WARPS * 32, 0, cx->stream>>>(out, inp, src, (int)R, K, C);
    else
        moe_gather_kernel<1><<<grid, ROW_WARPS * 32, 0, cx->stream>>>(out, inp, src, (int)R, K, C);
    cuda_check_launch();
}

template <bool WEIGHTED>
static void sum_rows(CudaCtx* cx, bf16* out, const bf16* y, const float* weights,
                     const int32_t* dst, int n, int K, int C) {
    if (n <= 0 || C <= 0) return;
    if (K < 1 || K > MOE_MAX_K)
        fatal("moe %s: %d experts per token; the CUDA backend takes 1..%d",
              WEIGHTED ? "combine" : "gather backward", K, MOE_MAX_K);
    const unsigned grid = grid_size((size_t)n, ROW_WARPS);
    if (C % 8 == 0 && is_aligned16(out) && is_aligned16(y))
        moe_sum_rows_kernel<8, WEIGHTED><<<grid, ROW_WARPS * 32, 0, cx->stream>>>(
            out, y, weights, dst, n, K, C);
    else
        moe_sum_rows_kernel<1, WEIGHTED><<<grid, ROW_WARPS * 32, 0, cx->stream>>>(
            out, y, weights, dst, n, K, C);
    cuda_check_launch();
}

void cuda_moe_gather_backward(CudaCtx* cx, bf16* dinp, const bf16* dout, const int32_t* dst, int n,
                              int K, int C) {
    sum_rows<false>(cx, dinp, dout, NULL, dst, n, K, C);
}

void cuda_moe_combine_forward(CudaCtx* cx, bf16* out, const bf16* y, const float* weights,
                              const int32_t* dst, int n, int K, int C) {
    sum_rows<true>(cx, out, y, weights, dst, n, K, C);
}

void cuda_moe_combine_backward(CudaCtx* cx, bf16* dy, float* dweights, const bf16* dout,
                               const bf16* y, const float* weights, const int32_t* dst, int n,
                               int K, int C) {
    const int64_t pairs = (int64_t)n * K;
    if (pairs <= 0) return;
    if (C <= 0) {  // empty rows: the dot products are 0
        cuda_check(cudaMemsetAsync(dweights, 0, (size_t)pairs * sizeof(float), cx->stream));
        return;
    }
    const unsigned grid = grid_size((size_t)pairs, ROW_WARPS);
    if (C % 8 == 0 && is_aligned16(dy) && is_aligned16(dout) && is_aligned16(y))
        moe_combine_backward_kernel<8><<<grid, ROW_WARPS * 32, 0, cx->stream>>>(
            dy, dweights, dout, y, weights, dst, pairs, K, C);
    else
        moe_combine_backward_kernel<1><<<grid, ROW_WARPS * 32, 0, cx->stream>>>(
            dy, dweights, dout, y, weights, dst, pairs, K, C);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// GPT-OSS GLU on gu (R, 2F), gate/up interleaved: out (R, F) = (u + 1) · g · σ(alpha g) with
// g = min(gate, limit), u = clamp(up, -limit, limit). Element v of (R, F / VEC) covers columns
// col .. col + VEC - 1 of row v / (F / VEC), i.e. 2 VEC consecutive inputs.

template <int VEC>
__global__ void gptoss_glu_forward_kernel(bf16* __restrict__ out, const bf16* __restrict__ gu,
                                          size_t n_vec, int F, float limit, float alpha) {
    const int FV = F / VEC;
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n_vec;
         v += (size_t)gridDim.x * blockDim.x) {
        const size_t row = v / FV, col = (v % FV) * VEC;
        const bf16* in = gu + row * 2 * F + 2 * col;
        float a[2 * VEC], y[VEC];
        load_bf16<VEC>(in, a);
        load_bf16<VEC>(in + VEC, a + VEC);
#pragma unroll
        for (int q = 0; q < VEC; q++) {
            const float g = fminf(a[2 * q], limit);
            const float u = fminf(fmaxf(a[2 * q + 1], -limit), limit);
            // HF: glu = gate * sigmoid(gate * alpha); (up + 1) * glu, each op a bf16 tensor
            const float s = bf16_round(sigmoid_f(bf16_round(g * alpha)));
            y[q] = bf16_round(u + 1.0f) * bf16_round(g * s);
        }
        store_bf16<VEC>(out + row * F + col, y);
    }
}

// torch.clamp passes the gradient where min <= x <= max (the bounds included).
template <int VEC>
__global__ void gptoss_glu_backward_kernel(bf16* __restrict__ dgu, const bf16* __restrict__ dout,
                                           const bf16* __restrict__ gu, size_t n_vec, int F,
                                           float limit, float alpha) {
    const int FV = F / VEC;
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n_vec;
         v += (size_t)gridDim.x * blockDim.x) {
        const size_t row = v / FV, col = (v % FV) * VEC;
        const bf16* in = gu + row * 2 * F + 2 * col;
        float a[2 * VEC], dy[VEC], d[2 * VEC];
        load_bf16<VEC>(in, a);
        load_bf16<VEC>(in + VEC, a + VEC);
        load_bf16<VEC>(dout + row * F + col, dy);
#pragma unroll
        for (int q = 0; q < VEC; q++) {
            const float gate = a[2 * q], up = a[2 * q + 1];
            const float g = fminf(gate, limit);
            const float u = fminf(fmaxf(up, -limit), limit);
            const float sg = sigmoid_f(alpha * g);
            const float glu = g * sg;
            const float dglu = sg + alpha * g * sg * (1.0f - sg);
            d[2 * q] = gate <= limit ? dy[q] * (u + 1.0f) * dglu : 0.0f;
            d[2 * q + 1] = up >= -limit && up <= limit ? dy[q] * glu : 0.0f;
        }
        bf16* o = dgu + row * 2 * F + 2 * col;
        store_bf16<VEC>(o, d);
        store_bf16<VEC>(o + VEC, d + VEC);
    }
}

// A grid-stride launch: enough blocks to fill the GPU several times, never more than needed.
static unsigned glu_grid(CudaCtx* cx, size_t work_items) {
    size_t want = grid_size(work_items, 256), cap = (size_t)cx->n_sms * 16;
    if (want < 1) want = 1;
    return (unsigned)(want < cap ? want : cap);
}

void cuda_gptoss_glu_forward(CudaCtx* cx, bf16* out, const bf16* gu, int R, int F, float limit,
                             float alpha) {
    if (R <= 0 || F <= 0) return;
    const size_t n = (size_t)R * F;
    if (F % 8 == 0 && is_aligned16(out) && is_aligned16(gu))
        gptoss_glu_forward_kernel<8><<<glu_grid(cx, n / 8), 256, 0, cx->stream>>>(
            out, gu, n / 8, F, limit, alpha);
    else
        gptoss_glu_forward_kernel<1><<<glu_grid(cx, n), 256, 0, cx->stream>>>(out, gu, n, F,
                                                                              limit, alpha);
    cuda_check_launch();
}

void cuda_gptoss_glu_backward(CudaCtx* cx, bf16* dgu, const bf16* dout, const bf16* gu, int R,
                              int F, float limit, float alpha) {
    if (R <= 0 || F <= 0) return;
    const size_t n = (size_t)R * F;
    if (F % 8 == 0 && is_aligned16(dgu) && is_aligned16(dout) && is_aligned16(gu))
        gptoss_glu_backward_kernel<8><<<glu_grid(cx, n / 8), 256, 0, cx->stream>>>(
            dgu, dout, gu, n / 8, F, limit, alpha);
    else
        gptoss_glu_backward_kernel<1><<<glu_grid(cx, n), 256, 0, cx->stream>>>(
            dgu, dout, gu, n, F, limit, alpha);
    cuda_check_launch();
}
