/*
 * moe_matmul.cu — the grouped GEMM of the experts: every expert's rows through its own weight,
 * in one launch per product, with the tile schedule computed on the device (the per-expert row
 * counts live in device memory: no host synchronisation per layer).
 *
 * The three products, each a GEMM D (M, N) = A (M, K) · B (K, N) per expert e:
 *   forward  out rows (M_e, OC) = inp rows (M_e, IC) · W_e(ᵀ)     M varies, N = OC, K = IC
 *   dinp     dinp rows (M_e, IC) = dout rows (M_e, OC) · W_e(ᵀ)   M varies, N = IC, K = OC
 *   dW       dW_e (OC, IC) += doutᵀ · inp  (w_in_out 0), or        M, N fixed, K = M_e varies
 *            dW_e (IC, OC) += inpᵀ · dout  (w_in_out 1)
 * where M_e = offsets[e+1] - offsets[e]. Operand layouts: A is K-major (rows of the activations)
 * in the "rows" products and M-major in dW (the reduction runs down the rows); B is K-major or
 * N-major depending on w_in_out and the product; both the loaders and the fragment reads exist
 * in both layouts, so no operand is ever transposed in memory.
 *
 * Tile schedule (rows products): m-tiles of BM rows never straddle two experts; the grid has
 * ceil(R / BM) + E m-tile slots (an upper bound on Σ_e ceil(M_e / BM)) times the n-tiles, and each
 * CTA finds its (expert, m-tile) by a warp scan over the device offsets; slots past the last tile
 * exit at once. dW: one CTA per (n-tile, m-tile, expert) owns its output tile and walks the
 * expert's rows in order: deterministic, no atomics; experts with no rows leave dW untouched.
 * dbias: one thread per (expert, column) sums the expert's rows in order.
 *
 * Variants (MOE_MM_* in moe_matmul.h; the lab validates and times each):
 *   1 naive: 32 x 32 shared-memory tiles, fp32 FMA. Any shape and alignment: the fallback when
 *     IC or OC is not a multiple of 8 or a pointer is not 16-byte aligned.
 *   2 mma.sync m16n8k16 (bf16 -> fp32) with ldmatrix (.trans for MN-major operands) and a 4-stage
 *     cp.async ring of 128 x 128 x 32 tiles, 8 warps of 64 x 32; XOR-swizzled shared tiles (no
 *     bank conflicts, no padding). Every sm_80+ GPU.
 *   3 Hopper wgmma (moe_matmul_wgmma.cuh; sm_90a build on a compute capability 9.0 device):
 *     persistent, warp-specialised (a cp.async producer warpgroup, 2 consumer warpgroups),
 *     128 x 256 x 64 tiles in a 4-stage mbarrier ring, m64n256k16 from shared memory. The
 *     production choice where available.
 * Edges: IC and OC multiples of 8 (16-byte chunks are wholly inside or wholly outside); rows
 * past an expert's end and columns past N are zero-filled on load and never stored.
 */
#include "moe_matmul.h"
#include "ptx.cuh"

// ----------------------------------------------------------------------------
// device: the tile schedule

// Tiles of bm rows of expert e (0 for e >= E or an empty expert).
__device__ __forceinline__ int moe_tile_count(const int32_t* offsets, int e, int E, int bm) {
    if (e >= E) return 0;
    const int m = offsets[e + 1] - offsets[e];
    return m > 0 ? (m + bm - 1) / bm : 0;
}

// One chunk of 32 experts (lane's expert e has cnt tiles; *base tiles precede the chunk): an
// inclusive scan by shuffles; returns 1 with (e, m-tile) of `slot` in every lane if the slot lies
// in this chunk, else adds the chunk's tiles to *base and returns 0.
__device__ __forceinline__ int moe_scan_chunk(int cnt, int e, int slot, int lane, int* base,
                                              int* e_out, int* mt_out) {
    const unsigned full = 0xffffffffu;
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(full, incl, o);
        if (lane >= o) incl += v;
    }
    const int excl = incl - cnt;
    const bool hit = cnt > 0 && slot >= *base + excl && slot < *base + incl;
    const unsigned b = __ballot_sync(full, hit);
    if (b) {  // exactly one lane hits
        const int src = __ffs(b) - 1;
        *e_out = __shfl_sync(full, e, src);
        *mt_out = __shfl_sync(full, slot - *base - excl, src);
        return 1;
    }
    *base += __shfl_sync(full, incl, 31);
    return 0;
}

// Expert e and m-tile mt (tiles of bm rows, experts in index order, expert e's rows split into
// ceil(M_e / bm) tiles) of grouped tile `slot`, for every lane of the calling warp; e = -1 past
// the last tile. No shared memory, no block barrier. The counts of the first 128 experts are
// loaded at once (their loads in flight together: the search costs about one memory latency for
// E <= 128), the others chunk by chunk.
__device__ __forceinline__ void moe_warp_find_tile(const int32_t* offsets, int E, int bm, int slot,
                                                   int lane, int* e_out, int* mt_out) {
    constexpr int PRE = 4;
    int cnt[PRE];
#pragma unroll
    for (int c = 0; c < PRE; c++) cnt[c] = moe_tile_count(offsets, 32 * c + lane, E, bm);
    int base = 0;
#pragma unroll
    for (int c = 0; c < PRE; c++) {
        if (32 * c >= E) break;
        if (moe_scan_chunk(cnt[c], 32 * c + lane, slot, lane, &base, e_out, mt_out)) return;
    }
    for (int e0 = 32 * PRE; e0 < E; e0 += 32)
        if (moe_scan_chunk(moe_tile_count(offsets, e0 + lane, E, bm), e0 + lane, slot, lane,
                           &base, e_out, mt_out))
            return;
    *e_out = -1;
    *mt_out = 0;
}

// The same for the whole CTA: warp 0 searches, info[0..1] = (e, mt) in shared memory. Ends with
// a barrier; `tid` is the linear thread index.
__device__ __forceinline__ void moe_find_tile(int* info, const int32_t* offsets, int E, int bm,
                                              int slot, int tid) {
    if (tid < 32) {
        int e, mt;
        moe_warp_find_tile(offsets, E, bm, slot, tid, &e, &mt);
        if (tid == 0) {
            info[0] = e;
            info[1] = mt;
        }
    }
    __syncthreads();
}

// ----------------------------------------------------------------------------
// variant 1: naive (32 x 32 tiles, one output per thread, fp32 FMA)

#define MOE_NAIVE_T 32

// Rows products: D rows (M_e, N) = A rows (M_e, K) · B_e with B_e(k, n) = B[e bstride + k sbk +
// n sbn]; bf16 out (+ bias (E, N)). grid (n-tiles, slots), block 32 x 32.
__global__ void moe_rows_kernel1(bf16* __restrict__ D, const bf16* __restrict__ A,
                                 const bf16* __restrict__ B, const bf16* __restrict__ bias,
                                 const int32_t* __restrict__ offsets, int E, int N, int K,
                                 int slots, size_t bstride, size_t sbk, size_t sbn) {
    __shared__ float As[MOE_NAIVE_T][MOE_NAIVE_T + 1], Bs[MOE_NAIVE_T][MOE_NAIVE_T + 1];
    __shared__ int info[2];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * MOE_NAIVE_T + tx;
    const int n = blockIdx.x * MOE_NAIVE_T + tx;
    for (int slot = blockIdx.y; slot < slots; slot += gridDim.y) {
        moe_find_tile(info, offsets, E, MOE_NAIVE_T, slot, tid);
        const int e = info[0], mt = info[1];
        __syncthreads();  // info is rewritten by the next slot's search
        if (e < 0) return;
        const int r0 = offsets[e], Me = offsets[e + 1] - r0;
        const int m = mt * MOE_NAIVE_T + ty;
        const bf16* Be = B + (size_t)e * bstride;
        float acc = 0.0f;
        for (int k0 = 0; k0 < K; k0 += MOE_NAIVE_T) {
            As[ty][tx] = m < Me && k0 + tx < K
                             ? __bfloat162float(A[(size_t)(r0 + m) * K + k0 + tx])
                             : 0.0f;
            Bs[ty][tx] = k0 + ty < K && n < N
                             ? __bfloat162float(Be[(size_t)(k0 + ty) * sbk + (size_t)n * sbn])
                             : 0.0f;
            __syncthreads();
#pragma unroll 8
            for (int kk = 0; kk < MOE_NAIVE_T; kk++) acc += As[ty][kk] * Bs[kk][tx];
            __syncthreads();
        }
        if (m < Me && n < N) {
            if (bias) acc += __bfloat162float(bias[(size_t)e * N + n]);
            D[(size_t)(r0 + m) * N + n] = __float2bfloat16_rn(acc);
        }
    }
}

// dW: D_e (M, N) += Σ_rows A(row, m) B(row, n) over expert e's rows, A (R, M), B (R, N).
// grid (n-tiles, m-tiles, E), block 32 x 32.
__global__ void moe_dw_kernel1(float* __restrict__ D, const bf16* __restrict__ A,
                               const bf16* __restrict__ B, const int32_t* __restrict__ offsets,
                               int M, int N) {
    __shared__ float As[MOE_NAIVE_T][MOE_NAIVE_T + 1], Bs[MOE_NAIVE_T][MOE_NAIVE_T + 1];
    const int tx = threadIdx.x, ty = threadIdx.y, e = blockIdx.z;
    const int r0 = offsets[e], Me = offsets[e + 1] - r0;
    if (Me <= 0) return;
    const int m0 = blockIdx.y * MOE_NAIVE_T, n = blockIdx.x * MOE_NAIVE_T + tx,
              m = m0 + ty;
    float acc = 0.0f;
    for (int k0 = 0; k0 < Me; k0 += MOE_NAIVE_T) {
        // As[k][m]: row k0 + ty, column m0 + tx (coalesced along m)
        As[ty][tx] = k0 + ty < Me && m0 + tx < M
                         ? __bfloat162float(A[(size_t)(r0 + k0 + ty) * M + m0 + tx])
                         : 0.0f;
        Bs[ty][tx] = k0 + ty < Me && n < N
                         ? __bfloat162float(B[(size_t)(r0 + k0 + ty) * N + n])
                         : 0.0f;
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < MOE_NAIVE_T; kk++) acc += As[kk][ty] * Bs[kk][tx];
        __syncthreads();
    }
    if (m < M && n < N) D[(size_t)e * M * N + (size_t)m * N + n] += acc;
}

// ----------------------------------------------------------------------------
// dbias (every variant): dbias[e, c] += Σ over expert e's rows of dout[row, c], rows in order

__global__ void moe_dbias_kernel(float* __restrict__ dbias, const bf16* __restrict__ dout,
                                 const int32_t* __restrict__ offsets, int N) {
    const int e = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= N) return;
    const int r0 = offsets[e], r1 = offsets[e + 1];
    if (r1 <= r0) return;
    float s = 0.0f;
    for (int r = r0; r < r1; r++) s += __bfloat162float(dout[(size_t)r * N + c]);
    dbias[(size_t)e * N + c] += s;
}

// ----------------------------------------------------------------------------
// variant 2: mma.sync, ldmatrix, cp.async ring

#define MOE_BM 128
#define MOE_BN 128
#define MOE_BK 32
#define MOE_STAGES 4
#define MOE_THREADS 256
#define MOE_TILE_BYTES (MOE_BM * MOE_BK * 2)  // one operand tile of a stage (8 KiB)
#define MOE_SMEM_BYTES (MOE_STAGES * 2 * MOE_TILE_BYTES)

// Shared tiles of one stage, 8 KiB each, in one of two layouts:
//   K-major  (128 rows of m or n) x (32 k): 64-byte rows, 16-byte chunk c of row r stored at
//            chunk c ^ ((r >> 1) & 3): the 8 rows an ldmatrix reads at one chunk column hit 8
//            distinct 16-byte bank groups.
//   MN-major (32 k) x (128 m or n): 256-byte rows, chunk c of row k at c ^ (k & 7).
__device__ __forceinline__ uint32_t moe_kmajor_off(int r, int k) {  // k a multiple of 8
    return (uint32_t)(r * 64 + (((k >> 3) ^ ((r >> 1) & 3)) << 4));
}
__device__ __forceinline__ uint32_t moe_mnmajor_off(int k, int mn) {  // mn a multiple of 8
    return (uint32_t)(k * 256 + (((mn >> 3) ^ (k & 7)) << 4));
}

// Where one operand's tiles come from. The element at (row, col) is g[row * ld + col], valid
// when row < row_end and col < col_end. K-major tiles: row = row0 + (m or n), col = col0 + k
// (k-tile kt adds 32 kt to col); MN-major tiles: row = row0 + k (k-tile kt adds 32 kt to row),
// col = col0 + (m or n).
typedef struct MoeTileSrc {
    const bf16* g;
    size_t ld;
    int row0, row_end, col0, col_end;
} MoeTileSrc;

// One operand tile of k-tile kt into shared memory at dst: 512 chunks of 16 bytes, 2 per thread.
template <bool KMAJOR>
__device__ __forceinline__ void moe_load_tile(uint32_t dst, const MoeTileSrc& s, int kt,
                                              int tid) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int idx = tid + i * MOE_THREADS;
        int row, col;
        uint32_t off;
        if (KMAJOR) {
            const int r = idx >> 2, c = idx & 3;
            row = s.row0 + r;
            col = s.col0 + kt * MOE_BK + c * 8;
            off = moe_kmajor_off(r, c * 8);
        } else {
            const int k = idx >> 4, c = idx & 15;
            row = s.row0 + kt * MOE_BK + k;
            col = s.col0 + c * 8;
            off = moe_mnmajor_off(k, c * 8);
        }
        const bool valid = row < s.row_end && col < s.col_end;
        cp_async_16(dst + off, valid ? s.g + (size_t)row * s.ld + col : s.g, valid);
    }
}

// acc (warp's 64 x 32: 4 m16 blocks x 4 n8 blocks) += the stage's A (128 x 32) · B (32 x 128).
// Warp (wm, wn) covers rows 64 wm .. and columns 32 wn .. of the CTA tile.
template <bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void moe_mma_stage(float (&acc)[4][4][4], uint32_t sa, uint32_t sb,
                                              int wm, int wn, int lane) {
#pragma unroll
    for (int kk = 0; kk < MOE_BK; kk += 16) {
        uint32_t af[4][4], bfr[4][2];
#pragma unroll
        for (int mi = 0; mi < 4; mi++) {
            if (A_KMAJOR) {  // matrices (m 0-7 | 8-15) x (k 0-7 | 8-15), lanes 0-15 k 0-7
                const int r = wm * 64 + mi * 16 + (lane & 15), k = kk + (lane >> 4) * 8;
                ldsm_x4(af[mi], sa + moe_kmajor_off(r, k));
            } else {  // stored [k][m]: .trans; matrix i: m + 8 (i & 1), k + 8 (i >> 1)
                const int i = lane >> 3, k = kk + (lane & 7) + (i >> 1) * 8,
                          m = wm * 64 + mi * 16 + (i & 1) * 8;
                ldsm_x4_trans(af[mi], sa + moe_mnmajor_off(k, m));
            }
        }
#pragma unroll
        for (int p = 0; p < 2; p++) {  // two n8 blocks per ldmatrix: b0, b1 of each
            uint32_t r[4];
            if (B_KMAJOR) {  // stored [n][k]; matrix i: n + 8 (i >> 1), k + 8 (i & 1)
                const int i = lane >> 3, n = wn * 32 + p * 16 + (lane & 7) + (i >> 1) * 8,
                          k = kk + (i & 1) * 8;
                ldsm_x4(r, sb + moe_kmajor_off(n, k));
            } else {  // stored [k][n]: .trans; matrix i: k + 8 (i & 1), n + 8 (i >> 1)
                const int i = lane >> 3, k = kk + (lane & 7) + (i & 1) * 8,
                          n = wn * 32 + p * 16 + (i >> 1) * 8;
                ldsm_x4_trans(r, sb + moe_mnmajor_off(k, n));
            }
            bfr[2 * p][0] = r[0];
            bfr[2 * p][1] = r[1];
            bfr[2 * p + 1][0] = r[2];
            bfr[2 * p + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int nj = 0; nj < 4; nj++)
                mma_16816(acc[mi][nj], af[mi], bfr[nj][0], bfr[nj][1]);
    }
}

// The k loop of one CTA tile: n_kt k-tiles through the MOE_STAGES-deep cp.async ring. Returns
// with every copy landed and every warp done reading shared memory.
template <bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void moe_mainloop(float (&acc)[4][4][4], uint32_t smem,
                                             const MoeTileSrc& a, const MoeTileSrc& b, int n_kt,
                                             int tid) {
    const int lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int nj = 0; nj < 4; nj++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][nj][q] = 0.0f;
#pragma unroll
    for (int s = 0; s < MOE_STAGES - 1; s++) {
        if (s < n_kt) {
            moe_load_tile<A_KMAJOR>(smem + s * 2 * MOE_TILE_BYTES, a, s, tid);
            moe_load_tile<B_KMAJOR>(smem + (s * 2 + 1) * MOE_TILE_BYTES, b, s, tid);
        }
        cp_async_commit();  // empty groups keep the count uniform
    }
    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait<MOE_STAGES - 2>();  // k-tile kt has landed (this thread's copies)
        __syncthreads();  // ... everyone's; and every warp is done with k-tile kt - 1's stage
        const int pf = kt + MOE_STAGES - 1;
        if (pf < n_kt) {  // refill the stage k-tile kt - 1 used
            const int s = pf % MOE_STAGES;
            moe_load_tile<A_KMAJOR>(smem + s * 2 * MOE_TILE_BYTES, a, pf, tid);
            moe_load_tile<B_KMAJOR>(smem + (s * 2 + 1) * MOE_TILE_BYTES, b, pf, tid);
        }
        cp_async_commit();
        const int s = kt % MOE_STAGES;
        moe_mma_stage<A_KMAJOR, B_KMAJOR>(acc, smem + s * 2 * MOE_TILE_BYTES,
                                          smem + (s * 2 + 1) * MOE_TILE_BYTES, wm, wn, lane);
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages
}

// Rows products: D rows (M_e, N) = A rows (M_e, K) · B_e (+ bias (E, N)), bf16 out. A (R, K)
// row-major; B_e = B + e bstride, K-major (B_e(k, n) = B_e[n ldb + k]) or N-major
// (B_e[k ldb + n]). grid (n-tiles, min(slots, 65535)), MOE_THREADS threads.
template <bool B_KMAJOR>
__global__ void __launch_bounds__(MOE_THREADS)
    moe_rows_kernel2(bf16* __restrict__ D, const bf16* __restrict__ A, const bf16* __restrict__ B,
                     const bf16* __restrict__ bias, const int32_t* __restrict__ offsets, int E,
                     int N, int K, int slots, size_t bstride, int ldb) {
    extern __shared__ __align__(128) unsigned char moe_smem[];
    __shared__ int info[2];
    const uint32_t smem = smem_u32(moe_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    const int n0 = blockIdx.x * MOE_BN, n_kt = (K + MOE_BK - 1) / MOE_BK;
    for (int slot = blockIdx.y; slot < slots; slot += gridDim.y) {
        moe_find_tile(info, offsets, E, MOE_BM, slot, tid);
        const int e = info[0], m0 = info[1] * MOE_BM;
        __syncthreads();  // info is rewritten by the next slot's search
        if (e < 0) return;
        const int r0 = offsets[e], Me = offsets[e + 1] - r0;
        const MoeTileSrc a = {A, (size_t)K, r0 + m0, r0 + Me, 0, K};
        MoeTileSrc b;
        if (B_KMAJOR)
            b = {B + (size_t)e * bstride, (size_t)ldb, n0, N, 0, K};
        else
            b = {B + (size_t)e * bstride, (size_t)ldb, 0, K, n0, N};
        float acc[4][4][4];
        moe_mainloop<true, B_KMAJOR>(acc, smem, a, b, n_kt, tid);
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int m = m0 + wm * 64 + mi * 16 + g + h * 8;
                if (m >= Me) continue;
                bf16* drow = D + (size_t)(r0 + m) * N;
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    const int n = n0 + wn * 32 + nj * 8 + t * 2;
                    if (n >= N) continue;  // N is a multiple of 8: n + 1 < N too
                    float v0 = acc[mi][nj][2 * h], v1 = acc[mi][nj][2 * h + 1];
                    if (bias) {
                        v0 += __bfloat162float(bias[(size_t)e * N + n]);
                        v1 += __bfloat162float(bias[(size_t)e * N + n + 1]);
                    }
                    *reinterpret_cast<__nv_bfloat162*>(drow + n) = __floats2bfloat162_rn(v0, v1);
                }
            }
    }
}

// dW: D_e (M, N) += Σ over expert e's rows of A(row, m) B(row, n), A (R, M), B (R, N) row-major
// (both MN-major operands). grid (n-tiles, m-tiles, E), MOE_THREADS threads.
__global__ void __launch_bounds__(MOE_THREADS)
    moe_dw_kernel2(float* __restrict__ D, const bf16* __restrict__ A, const bf16* __restrict__ B,
                   const int32_t* __restrict__ offsets, int M, int N) {
    extern __shared__ __align__(128) unsigned char moe_smem[];
    const uint32_t smem = smem_u32(moe_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    const int e = blockIdx.z, m0 = blockIdx.y * MOE_BM, n0 = blockIdx.x * MOE_BN;
    const int r0 = offsets[e], Me = offsets[e + 1] - r0;
    if (Me <= 0) return;
    const MoeTileSrc a = {A, (size_t)M, r0, r0 + Me, m0, M};
    const MoeTileSrc b = {B, (size_t)N, r0, r0 + Me, n0, N};
    float acc[4][4][4];
    moe_mainloop<false, false>(acc, smem, a, b, (Me + MOE_BK - 1) / MOE_BK, tid);
    float* De = D + (size_t)e * M * N;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = m0 + wm * 64 + mi * 16 + g + h * 8;
            if (m >= M) continue;
#pragma unroll
            for (int nj = 0; nj < 4; nj++) {
                const int n = n0 + wn * 32 + nj * 8 + t * 2;
                if (n >= N) continue;
                float2* p = reinterpret_cast<float2*>(De + (size_t)m * N + n);
                float2 v = *p;
                v.x += acc[mi][nj][2 * h];
                v.y += acc[mi][nj][2 * h + 1];
                *p = v;
            }
        }
}

// ----------------------------------------------------------------------------
// variant 3: Hopper wgmma

// m-tile slots of a rows product: an upper bound on Σ_e ceil(M_e / bm) for Σ_e M_e <= R.
static unsigned moe_slots(int R, int E, int bm) { return (unsigned)((R + bm - 1) / bm + E); }

#include "moe_matmul_wgmma.cuh"

// ----------------------------------------------------------------------------
// host: launchers per variant

// One rows product. B_e(k, n) = B[e bstride + k sbk + n sbn]: K-major when sbk == 1.
static void moe_rows_launch(CudaCtx* cx, int variant, bf16* D, const bf16* A, const bf16* B,
                            const bf16* bias, const int32_t* offsets, int R, int E, int N, int K,
                            size_t bstride, size_t sbk, size_t sbn) {
    const int b_kmajor = sbk == 1;
    const int ldb = (int)(b_kmajor ? sbn : sbk);
    if (variant == MOE_MM_NAIVE) {
        const unsigned slots = moe_slots(R, E, MOE_NAIVE_T);
        dim3 grid(grid_size((size_t)N, MOE_NAIVE_T), slots < 65535 ? slots : 65535);
        moe_rows_kernel1<<<grid, dim3(MOE_NAIVE_T, MOE_NAIVE_T), 0, cx->stream>>>(
            D, A, B, bias, offsets, E, N, K, (int)slots, bstride, sbk, sbn);
        cuda_check_launch();
    } else if (variant == MOE_MM_MMA) {
        const unsigned slots = moe_slots(R, E, MOE_BM);
        dim3 grid(grid_size((size_t)N, MOE_BN), slots < 65535 ? slots : 65535);
        if (b_kmajor) {
            cuda_check(cudaFuncSetAttribute(moe_rows_kernel2<true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            MOE_SMEM_BYTES));
            moe_rows_kernel2<true><<<grid, MOE_THREADS, MOE_SMEM_BYTES, cx->stream>>>(
                D, A, B, bias, offsets, E, N, K, (int)slots, bstride, ldb);
        } else {
            cuda_check(cudaFuncSetAttribute(moe_rows_kernel2<false>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            MOE_SMEM_BYTES));
            moe_rows_kernel2<false><<<grid, MOE_THREADS, MOE_SMEM_BYTES, cx->stream>>>(
                D, A, B, bias, offsets, E, N, K, (int)slots, bstride, ldb);
        }
        cuda_check_launch();
    } else {
        moe_rows_launch_wgmma(cx, D, A, B, bias, offsets, R, E, N, K, bstride, ldb, b_kmajor);
    }
}

// dW: D_e (M, N) += A_rowsᵀ · B_rows, A (R, M), B (R, N).
static void moe_dw_launch(CudaCtx* cx, int variant, float* D, const bf16* A, const bf16* B,
                          const int32_t* offsets, int R, int E, int M, int N) {
    if (variant == MOE_MM_NAIVE) {
        dim3 grid(grid_size((size_t)N, MOE_NAIVE_T), grid_size((size_t)M, MOE_NAIVE_T), E);
        moe_dw_kernel1<<<grid, dim3(MOE_NAIVE_T, MOE_NAIVE_T), 0, cx->stream>>>(D, A, B, offsets,
                                                                                M, N);
        cuda_check_launch();
    } else if (variant == MOE_MM_MMA) {
        dim3 grid(grid_size((size_t)N, MOE_BN), grid_size((size_t)M, MOE_BM), E);
        cuda_check(cudaFuncSetAttribute(moe_dw_kernel2, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        MOE_SMEM_BYTES));
        moe_dw_kernel2<<<grid, MOE_THREADS, MOE_SMEM_BYTES, cx->stream>>>(D, A, B, offsets, M, N);
        cuda_check_launch();
    } else {
        moe_dw_launch_wgmma(cx, D, A, B, offsets, R, E, M, N);
    }
}

// ----------------------------------------------------------------------------
// host: the variant choice and the two entry points

int cuda_moe_matmul_pick(int IC, int OC, const void* const* ptrs, int n_ptrs) {
    int ok = IC % 8 == 0 && OC % 8 == 0;
    for (int i = 0; i < n_ptrs; i++) ok &= ptrs[i] == NULL || is_aligned16(ptrs[i]);
    if (!ok) return MOE_MM_NAIVE;
    return moe_wgmma_available() ? MOE_MM_WGMMA : MOE_MM_MMA;
}

// The variant to run: the pick, or the forced one if it can take the problem.
static int moe_resolve(int variant, int IC, int OC, const void* const* ptrs, int n_ptrs) {
    const int pick = cuda_moe_matmul_pick(IC, OC, ptrs, n_ptrs);
    if (variant == MOE_MM_AUTO) return pick;
    if (variant < 1 || variant > MOE_MM_VARIANTS)
        fatal("moe_matmul: no variant %d (1..%d)", variant, MOE_MM_VARIANTS);
    if (variant != MOE_MM_NAIVE && pick == MOE_MM_NAIVE)
        fatal("moe_matmul: variant %d needs IC, OC multiples of 8 and 16-byte aligned pointers "
              "(IC %d, OC %d)", variant, IC, OC);
    if (variant == MOE_MM_WGMMA && !moe_wgmma_available())
        fatal("moe_matmul: variant 3 (wgmma) needs an sm_90a build on a compute capability 9.0 "
              "device");
    return variant;
}

void cuda_moe_matmul_forward(CudaCtx* cx, int variant, bf16* out, const bf16* inp, const bf16* w,
                             const bf16* bias, const int32_t* offsets, int R, int E, int IC,
                             int OC, int w_in_out) {
    if (R <= 0 || E <= 0 || IC <= 0 || OC <= 0) return;
    const void* ptrs[] = {out, inp, w, bias};
    const int v = moe_resolve(variant, IC, OC, ptrs, 4);
    // B_e(k = ic, n = oc): W_e[oc][ic] (w_in_out 0) or W_e[ic][oc] (w_in_out 1)
    moe_rows_launch(cx, v, out, inp, w, bias, offsets, R, E, OC, IC, (size_t)IC * OC,
                    w_in_out ? (size_t)OC : 1, w_in_out ? 1 : (size_t)IC);
}

void cuda_moe_matmul_backward(CudaCtx* cx, int variant, bf16* dinp, float* dw, float* dbias,
                              const bf16* dout, const bf16* inp, const bf16* w,
                              const int32_t* offsets, int R, int E, int IC, int OC,
                              int w_in_out) {
    if (R <= 0 || E <= 0 || IC <= 0 || OC <= 0) return;
    const void* ptrs[] = {dinp, dw, dout, inp, w};
    const int v = moe_resolve(variant, IC, OC, ptrs, 5);
    // dinp: B_e(k = oc, n = ic): W_e[oc][ic] (w_in_out 0) or W_e[ic][oc] (w_in_out 1)
    if (dinp)
        moe_rows_launch(cx, v, dinp, dout, w, NULL, offsets, R, E, IC, OC, (size_t)IC * OC,
                        w_in_out ? 1 : (size_t)IC, w_in_out ? (size_t)OC : 1);
    if (dw) {
        if (w_in_out)  // dW_e (IC, OC) += inpᵀ · dout
            moe_dw_launch(cx, v, dw, inp, dout, offsets, R, E, IC, OC);
        else  // dW_e (OC, IC) += doutᵀ · inp
            moe_dw_launch(cx, v, dw, dout, inp, offsets, R, E, OC, IC);
    }
    if (dbias) {
        dim3 grid(grid_size((size_t)OC, 128), E);
        moe_dbias_kernel<<<grid, 128, 0, cx->stream>>>(dbias, dout, offsets, OC);
        cuda_check_launch();
    }
}
