/*
 * rope.cu — Qwen3 QK-norm + rotate_half RoPE on the packed qkv rows (ops.h), forward and backward.
 *
 * Layout of one row: [q (H*HD) | k (KVH*HD) | v (KVH*HD)]; the first H+KVH heads are rotated (and
 * normed when the family has QK-norm), v is copied. Position t = row % T.
 *
 * Forward: one block per row. The q/k part is staged in shared memory as fp32, one warp per head
 * computes rstd (xor-butterfly sum: fixed order), then one thread per rotation pair (i, i+HD/2)
 * writes both outputs. Rounding mirrors HF in bf16 (a rounding after every tensor op): the norm is
 * w · bf16(x · rstd) rounded to bf16, and cos/sin are rounded to bf16 before use (HF casts them to
 * the activation dtype). The backward uses the same rounded cos/sin, so it is the exact transpose
 * of the forward's rotation.
 *
 * Backward: one block per group of rows (about 1024 blocks). Per row: un-rotate dout (rotation by
 * -φ) in shared memory, one warp per head computes mean(g·x̂), every element writes
 * dx = rstd (g - x̂ mean) with g = dy·w, and stores dy·x̂ in place of x. Thread j < 2·HD owns the
 * norm-weight gradient element j (q half, k half) and adds that row's products over the heads in
 * head order. Per-block partials are then reduced in block order: no atomics.
 */
#include "common.cuh"
#include "rope.cuh"

#define ROPE_THREADS 256
#define ROPE_BWD_BLOCKS 1024  // enough blocks to hide the per-row barriers (about 8 per SM)

// ----------------------------------------------------------------------------
// forward

__global__ void qknorm_rope_forward_kernel(bf16* __restrict__ out, float* __restrict__ rstd,
                                           const bf16* __restrict__ inp,
                                           const bf16* __restrict__ qw,
                                           const bf16* __restrict__ kw,
                                           const float* __restrict__ cosb,
                                           const float* __restrict__ sinb, int T, int H, int KVH,
                                           int HD, float eps, int vec) {
    extern __shared__ float sm[];
    const int heads = H + KVH, QK = heads * HD, QKV = QK + KVH * HD, half = HD / 2;
    float* sx = sm;          // (heads, HD) q and k of this row
    float* srs = sx + QK;    // (heads) rstd
    const int row = blockIdx.x, t = row % T;
    const bf16* in = inp + (size_t)row * QKV;
    bf16* o = out + (size_t)row * QKV;

    if (vec) {  // QKV and HD multiples of 8, rows 16-byte aligned
        for (int e = threadIdx.x * 8; e < QK; e += blockDim.x * 8) load_bf16<8>(in + e, sx + e);
        for (int e = QK + threadIdx.x * 8; e < QKV; e += blockDim.x * 8)
            *reinterpret_cast<uint4*>(o + e) = *reinterpret_cast<const uint4*>(in + e);
    } else {
        for (int e = threadIdx.x; e < QK; e += blockDim.x) sx[e] = __bfloat162float(in[e]);
        for (int e = QK + threadIdx.x; e < QKV; e += blockDim.x) o[e] = in[e];
    }
    __syncthreads();
    qk_row_rstd(sx, srs, rstd ? rstd + (size_t)row * heads : NULL, qw, kw, H, heads, HD, eps);
    for (int p = threadIdx.x; p < heads * half; p += blockDim.x) {
        const int hh = p / half, i = p % half;
        qk_row_rope_pair(sx, srs, qw, kw, cosb + (size_t)t * half, sinb + (size_t)t * half, H, HD,
                         hh, i, &o[hh * HD + i], &o[hh * HD + i + half]);
    }
}

static void rope_check_smem(CudaCtx* cx, const void* kernel, size_t smem, int H, int KVH, int HD) {
    if (smem > cx->max_smem_optin)
        fatal("qknorm_rope: H=%d KVH=%d HD=%d needs %zu bytes of shared memory per row (device "
              "limit %zu)", H, KVH, HD, smem, cx->max_smem_optin);
    if (smem > 48 * 1024)
        cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
}

void cuda_qknorm_rope_forward(CudaCtx* cx, bf16* out, float* rstd, const bf16* inp,
                              const bf16* q_norm_w, const bf16* k_norm_w, const float* cos,
                              const float* sin, int B, int T, int H, int KVH, int HD, float eps) {
    const int N = B * T, heads = H + KVH, QKV = (H + 2 * KVH) * HD;
    if (N <= 0) return;
    size_t smem = ((size_t)heads * HD + heads) * sizeof(float);
    rope_check_smem(cx, (const void*)qknorm_rope_forward_kernel, smem, H, KVH, HD);
    int vec = QKV % 8 == 0 && HD % 8 == 0 && is_aligned16(out) && is_aligned16(inp);
    qknorm_rope_forward_kernel<<<N, ROPE_THREADS, smem, cx->stream>>>(
        out, rstd, inp, q_norm_w, k_norm_w, cos, sin, T, H, KVH, HD, eps, vec);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// backward

// dw_partial: (blocks, HD) q-norm partials, then (blocks, HD) k-norm partials; NULL when the
// family has no QK-norm.
__global__ void qknorm_rope_backward_kernel(bf16* __restrict__ dinp, float* __restrict__ dw_partial,
                                            const bf16* __restrict__ dout,
                                            const bf16* __restrict__ inp,
                                            const bf16* __restrict__ qw,
                                            const bf16* __restrict__ kw,
                                            const float* __restrict__ rstd,
                                            const float* __restrict__ cosb,
                                            const float* __restrict__ sinb, int N, int T, int H,
                                            int KVH, int HD, int rpb) {
    extern __shared__ float sm[];
    const int heads = H + KVH, QK = heads * HD, QKV = QK + KVH * HD, half = HD / 2;
    const int lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    const int normed = qw != NULL || kw != NULL;
    float* sg = sm;             // (heads, HD) dout, then the un-rotated gradient dy
    float* sx = sg + QK;        // (heads, HD) inp, then dy · x̂
    float* smean = sx + QK;     // (heads) mean(g · x̂)
    float* sacc = smean + heads;  // (2, HD) this block's q/k norm-weight gradient
    for (int j = threadIdx.x; j < 2 * HD; j += blockDim.x) sacc[j] = 0.0f;
    const int row0 = blockIdx.x * rpb, row1 = min(N, row0 + rpb);
    for (int row = row0; row < row1; row++) {
        const int t = row % T;
        const bf16* g = dout + (size_t)row * QKV;
        const bf16* x = inp + (size_t)row * QKV;
        bf16* dx = dinp + (size_t)row * QKV;
        for (int e = threadIdx.x; e < QK; e += blockDim.x) {
            sg[e] = __bfloat162float(g[e]);
            if (normed) sx[e] = __bfloat162float(x[e]);
        }
        for (int e = QK + threadIdx.x; e < QKV; e += blockDim.x) dx[e] = g[e];  // v
        __syncthreads();
        // rotation by -φ: each pair is read and written by one thread
        for (int p = threadIdx.x; p < heads * half; p += blockDim.x) {
            const int hh = p / half, i = p % half;
            float c = bf16_round(cosb[(size_t)t * half + i]);
            float s = bf16_round(sinb[(size_t)t * half + i]);
            float g1 = sg[hh * HD + i], g2 = sg[hh * HD + i + half];
            sg[hh * HD + i] = g1 * c + g2 * s;
            sg[hh * HD + i + half] = g2 * c - g1 * s;
        }
        __syncthreads();
        if (normed) {
            for (int hh = threadIdx.x >> 5; hh < heads; hh += n_warps) {
                const bf16* w = hh < H ? qw : kw;
                if (!w) continue;
                float rs = rstd[(size_t)row * heads + hh], dot = 0.0f;
                for (int i = lane; i < HD; i += 32)
                    dot += (sg[hh * HD + i] * __bfloat162float(w[i])) * (sx[hh * HD + i] * rs);
                dot = warp_sum(dot);
                if (lane == 0) smean[hh] = dot / (float)HD;
            }
            __syncthreads();
        }
        for (int e = threadIdx.x; e < QK; e += blockDim.x) {
            const int hh = e / HD, i = e % HD;
            const bf16* w = hh < H ? qw : kw;
            float dy = sg[e], d = dy;
            if (w) {
                float rs = rstd[(size_t)row * heads + hh], xh = sx[e] * rs;
                d = rs * (dy * __bfloat162float(w[i]) - xh * smean[hh]);
                sx[e] = dy * xh;
            }
            dx[e] = __float2bfloat16_rn(d);
        }
        __syncthreads();
        if (dw_partial) {
            for (int j = threadIdx.x; j < 2 * HD; j += blockDim.x) {
                const int which = j / HD, i = j % HD;
                const int h0 = which == 0 ? 0 : H, h1 = which == 0 ? H : heads;
                if ((which == 0 ? qw : kw) == NULL) continue;
                float s = 0.0f;
                for (int hh = h0; hh < h1; hh++) s += sx[hh * HD + i];
                sacc[j] += s;
            }
        }
        __syncthreads();  // the next row overwrites sg and sx
    }
    if (dw_partial) {
        const int n_blocks = gridDim.x;
        for (int j = threadIdx.x; j < 2 * HD; j += blockDim.x) {
            const int which = j / HD, i = j % HD;
            dw_partial[((size_t)which * n_blocks + blockIdx.x) * HD + i] = sacc[j];
        }
    }
}

void cuda_qknorm_rope_backward(CudaCtx* cx, bf16* dinp, float* dq_norm_w, float* dk_norm_w,
                               const bf16* dout, const bf16* inp, const bf16* q_norm_w,
                               const bf16* k_norm_w, const float* rstd, const float* cos,
                               const float* sin, int B, int T, int H, int KVH, int HD) {
    const int N = B * T, heads = H + KVH;
    if (N <= 0) return;
    const int rpb = rows_per_block(N, ROPE_BWD_BLOCKS), blocks = (N + rpb - 1) / rpb;
    const int want_dw = (q_norm_w && dq_norm_w) || (k_norm_w && dk_norm_w);
    float* partial = NULL;
    if (want_dw)
        partial = (float*)cuda_scratch(cx, SCRATCH_PARTIAL,
                                       (size_t)2 * blocks * HD * sizeof(float));
    size_t smem = ((size_t)2 * heads * HD + heads + 2 * HD) * sizeof(float);
    rope_check_smem(cx, (const void*)qknorm_rope_backward_kernel, smem, H, KVH, HD);
    qknorm_rope_backward_kernel<<<blocks, ROPE_THREADS, smem, cx->stream>>>(
        dinp, partial, dout, inp, q_norm_w, k_norm_w, rstd, cos, sin, N, T, H, KVH, HD, rpb);
    cuda_check_launch();
    if (q_norm_w && dq_norm_w) cuda_reduce_partials(cx, dq_norm_w, partial, blocks, HD);
    if (k_norm_w && dk_norm_w)
        cuda_reduce_partials(cx, dk_norm_w, partial + (size_t)blocks * HD, blocks, HD);
}
