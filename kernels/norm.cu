/*
 * norm.cu — RMSNorm forward (optionally fused with the residual add) and backward, bf16 rows with
 * fp32 math.
 *
 * Forward: one warp per row. The sum of squares is a per-lane sum then an xor butterfly, so rstd
 * is the same bits on every run. Rounding mirrors HF in bf16 (a rounding after every tensor op):
 * the residual sum is rounded to bf16 (two bf16 tensors added), the norm reads the rounded sum,
 * and out = w · bf16(x · rstd) is rounded after the weight multiply. Two kernels with the same
 * per-lane order (lane l owns the 8-wide vectors l, l + 32, ... of its row, summed in that order),
 * hence the same bits: rmsnorm_forward_regs_kernel (rows up to 4096 columns, 16-byte aligned)
 * issues all of a lane's loads of a, b and w at once and keeps the row in registers between the
 * two passes; rmsnorm_forward_kernel walks any row in a loop, one vector at a time (wider or
 * unaligned rows). Warps per block shrink with N (rmsnorm_forward_warps) so that the decode's
 * few rows (N = 128) spread over every SM instead of 16 blocks; a row's math never depends on
 * the block shape. Both forward kernels wait for the kernel before them (ptx.cuh pdl_wait) before
 * touching what it writes (the register kernel fetches the constant norm weight first) and are
 * launched through cuda_launch, so a recorded decode step can launch them early, during the tail
 * of the kernel before.
 *
 * Backward: one block per group of rows (about 512 blocks, a function of N only). For each row
 * a block sum gives mean(g·x̂); dinp += rstd (g - x̂ mean) with g = dy·w. For dw every thread owns
 * fixed columns and accumulates dy·x̂ over the block's rows in row order in shared memory; the
 * block writes its partial row of dw, and cuda_reduce_partials adds the partials in block order.
 * No atomics.
 */
#include "common.cuh"
#include "ptx.cuh"

// ----------------------------------------------------------------------------
// forward

// res may alias a: each lane reads a[c] and b[c] before writing res[c], and later re-reads only
// elements it wrote itself.
template <int VEC>
__global__ void rmsnorm_forward_kernel(bf16* res, bf16* __restrict__ out, float* __restrict__ rstd,
                                       const bf16* a, const bf16* b, const bf16* __restrict__ w,
                                       int N, int C, float eps) {
    pdl_wait();  // (a recorded decode step: the kernel before has finished; see ptx.cuh)
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= N) return;
    const size_t off = (size_t)row * C;
    const bf16* x = a + off;
    float ss = 0.0f;
    if (b) {
        for (int c = lane * VEC; c < C; c += 32 * VEC) {
            float xa[VEC], xb[VEC];
            load_bf16<VEC>(a + off + c, xa);
            load_bf16<VEC>(b + off + c, xb);
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                xa[k] = bf16_round(xa[k] + xb[k]);
                ss += xa[k] * xa[k];
            }
            store_bf16<VEC>(res + off + c, xa);
        }
        x = res + off;
    } else {
        for (int c = lane * VEC; c < C; c += 32 * VEC) {
            float xa[VEC];
            load_bf16<VEC>(x + c, xa);
#pragma unroll
            for (int k = 0; k < VEC; k++) ss += xa[k] * xa[k];
        }
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / (float)C + eps);
    if (rstd && lane == 0) rstd[row] = rs;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float xa[VEC], wv[VEC];
        load_bf16<VEC>(x + c, xa);
        load_bf16<VEC>(w + c, wv);
#pragma unroll
        for (int k = 0; k < VEC; k++) xa[k] = wv[k] * bf16_round(xa[k] * rs);
        store_bf16<VEC>(out + off + c, xa);
    }
}

// A lane's NV vectors of 8 bf16 (column lane * 8 + i * 256 for vector i), loaded together: the
// lane's loads are independent, so a row costs one memory round trip per pass instead of C / 256.
// Vectors past C (a row narrower than 256 · NV) are skipped by a predicate, never read.
// res may alias a: all of a lane's reads of a and b happen before its first write to res, and no
// other lane touches its columns. w is fetched before the butterfly since it does not need rstd;
// x stays in registers (the residual sum already rounded to bf16, as the loop kernel re-reads it).
template <int NV>
__global__ void __launch_bounds__(256)
    rmsnorm_forward_regs_kernel(bf16* res, bf16* __restrict__ out, float* __restrict__ rstd,
                                const bf16* a, const bf16* b, const bf16* __restrict__ w, int N,
                                int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= N) return;
    const size_t off = (size_t)row * C;
    uint4 xv[NV], bv[NV], wv[NV];
    // the norm's weight before pdl_wait (a recorded decode step's weights are constant)
#pragma unroll
    for (int i = 0; i < NV; i++)
        if (lane * 8 + i * 256 < C) wv[i] = *reinterpret_cast<const uint4*>(w + lane * 8 + i * 256);
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c = lane * 8 + i * 256;
        if (c < C) {
            xv[i] = *reinterpret_cast<const uint4*>(a + off + c);
            if (b) bv[i] = *reinterpret_cast<const uint4*>(b + off + c);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c = lane * 8 + i * 256;
        if (c >= C) continue;
        float xa[8];
        load_bf16<8>(reinterpret_cast<const bf16*>(&xv[i]), xa);
        if (b) {
            float xb[8];
            load_bf16<8>(reinterpret_cast<const bf16*>(&bv[i]), xb);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                xa[k] = bf16_round(xa[k] + xb[k]);
                ss += xa[k] * xa[k];
            }
            store_bf16<8>(reinterpret_cast<bf16*>(&xv[i]), xa);  // exact: xa is bf16 already
            *reinterpret_cast<uint4*>(res + off + c) = xv[i];
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) ss += xa[k] * xa[k];
        }
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / (float)C + eps);
    if (rstd && lane == 0) rstd[row] = rs;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c = lane * 8 + i * 256;
        if (c >= C) continue;
        float xa[8], wf[8];
        load_bf16<8>(reinterpret_cast<const bf16*>(&xv[i]), xa);
        load_bf16<8>(reinterpret_cast<const bf16*>(&wv[i]), wf);
#pragma unroll
        for (int k = 0; k < 8; k++) xa[k] = wf[k] * bf16_round(xa[k] * rs);
        store_bf16<8>(out + off + c, xa);
    }
}

// Warps (rows) per block of the forward: 8 when there are rows for every SM several times over,
// fewer for small N so that the blocks cover the GPU (N = 128: 128 one-warp blocks on 132 SMs
// rather than 16 eight-warp blocks). A function of N only; the bits do not depend on it.
static inline int rmsnorm_forward_warps(int N) {
    return N >= 4096 ? 8 : N >= 1024 ? 4 : N >= 512 ? 2 : 1;
}

// The register kernel covers rows up to 32 lanes x NORM_FWD_MAX_NV vectors x 8 = 4096 columns.
#define NORM_FWD_MAX_NV 16

void cuda_rmsnorm_forward(CudaCtx* cx, bf16* res, bf16* out, float* rstd, const bf16* a,
                          const bf16* b, const bf16* w, int N, int C, float eps) {
    if (N <= 0 || C <= 0) return;
    const int warps = rmsnorm_forward_warps(N);
    unsigned grid = grid_size((size_t)N, warps);
    int vec = C % 8 == 0 && is_aligned16(out) && is_aligned16(a) && is_aligned16(w) &&
              (!b || (is_aligned16(b) && is_aligned16(res)));
    const int nv = vec ? (C + 255) / 256 : 0;  // 16-byte vectors per lane
    const dim3 block(warps * 32);
    if (vec && nv <= 4)
        cuda_launch(cx, rmsnorm_forward_regs_kernel<4>, grid, block, 0, res, out, rstd, a, b, w, N,
                    C, eps);
    else if (vec && nv <= 8)
        cuda_launch(cx, rmsnorm_forward_regs_kernel<8>, grid, block, 0, res, out, rstd, a, b, w, N,
                    C, eps);
    else if (vec && nv <= NORM_FWD_MAX_NV)
        cuda_launch(cx, rmsnorm_forward_regs_kernel<NORM_FWD_MAX_NV>, grid, block, 0, res, out,
                    rstd, a, b, w, N, C, eps);
    else if (vec)
        cuda_launch(cx, rmsnorm_forward_kernel<8>, grid, block, 0, res, out, rstd, a, b, w, N, C,
                    eps);
    else
        cuda_launch(cx, rmsnorm_forward_kernel<1>, grid, block, 0, res, out, rstd, a, b, w, N, C,
                    eps);
}

// ----------------------------------------------------------------------------
// backward

#define NORM_BWD_THREADS 256
#define NORM_BWD_BLOCKS 512  // about 4 blocks per SM; partials are 512 x C floats

// acc (C floats of dynamic shared memory) is used only when dw_partial is non-NULL.
template <int VEC>
__global__ void rmsnorm_backward_kernel(bf16* __restrict__ dinp, float* __restrict__ dw_partial,
                                        const bf16* __restrict__ dout,
                                        const bf16* __restrict__ inp, const bf16* __restrict__ w,
                                        const float* __restrict__ rstd, int N, int C, int rpb) {
    extern __shared__ float acc[];
    __shared__ float red[32];
    const int stride = blockDim.x * VEC;
    if (dw_partial)
        for (int c = threadIdx.x * VEC; c < C; c += stride)
#pragma unroll
            for (int k = 0; k < VEC; k++) acc[c + k] = 0.0f;
    const int row0 = blockIdx.x * rpb, row1 = min(N, row0 + rpb);
    for (int row = row0; row < row1; row++) {
        const size_t off = (size_t)row * C;
        const float rs = rstd[row];
        float dot = 0.0f;
        for (int c = threadIdx.x * VEC; c < C; c += stride) {
            float dy[VEC], x[VEC], wv[VEC];
            load_bf16<VEC>(dout + off + c, dy);
            load_bf16<VEC>(inp + off + c, x);
            load_bf16<VEC>(w + c, wv);
#pragma unroll
            for (int k = 0; k < VEC; k++) dot += (dy[k] * wv[k]) * (x[k] * rs);
        }
        const float mean = block_sum(dot, red) / (float)C;
        for (int c = threadIdx.x * VEC; c < C; c += stride) {
            float dy[VEC], x[VEC], wv[VEC], dx[VEC];
            load_bf16<VEC>(dout + off + c, dy);
            load_bf16<VEC>(inp + off + c, x);
            load_bf16<VEC>(w + c, wv);
            if (dinp) load_bf16<VEC>(dinp + off + c, dx);
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                float xh = x[k] * rs;
                if (dinp) dx[k] += rs * (dy[k] * wv[k] - xh * mean);
                if (dw_partial) acc[c + k] += dy[k] * xh;
            }
            if (dinp) store_bf16<VEC>(dinp + off + c, dx);
        }
    }
    if (dw_partial)
        for (int c = threadIdx.x * VEC; c < C; c += stride)
#pragma unroll
            for (int k = 0; k < VEC; k++) dw_partial[(size_t)blockIdx.x * C + c + k] = acc[c + k];
}

void cuda_rmsnorm_backward(CudaCtx* cx, bf16* dinp, float* dw, const bf16* dout, const bf16* inp,
                           const bf16* w, const float* rstd, int N, int C) {
    if (N <= 0 || C <= 0 || (!dinp && !dw)) return;
    const int rpb = rows_per_block(N, NORM_BWD_BLOCKS), blocks = (N + rpb - 1) / rpb;
    float* partial = NULL;
    size_t smem = 0;
    if (dw) {
        partial = (float*)cuda_scratch(cx, SCRATCH_PARTIAL, (size_t)blocks * C * sizeof(float));
        smem = (size_t)C * sizeof(float);
        if (smem > cx->max_smem_optin)
            fatal("rmsnorm_backward: width C=%d needs %zu bytes of shared memory (device limit "
                  "%zu)", C, smem, cx->max_smem_optin);
    }
    int vec = C % 8 == 0 && is_aligned16(dout) && is_aligned16(inp) && is_aligned16(w) &&
              (!dinp || is_aligned16(dinp));
    if (vec) {
        if (smem > 48 * 1024)
            cuda_check(cudaFuncSetAttribute(rmsnorm_backward_kernel<8>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
        rmsnorm_backward_kernel<8><<<blocks, NORM_BWD_THREADS, smem, cx->stream>>>(
            dinp, partial, dout, inp, w, rstd, N, C, rpb);
    } else {
        if (smem > 48 * 1024)
            cuda_check(cudaFuncSetAttribute(rmsnorm_backward_kernel<1>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)smem));
        rmsnorm_backward_kernel<1><<<blocks, NORM_BWD_THREADS, smem, cx->stream>>>(
            dinp, partial, dout, inp, w, rstd, N, C, rpb);
    }
    cuda_check_launch();
    if (dw) cuda_reduce_partials(cx, dw, partial, blocks, C);
}
