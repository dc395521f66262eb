/*
 * rope.cuh — the per-row Qwen3 q/k-norm + RoPE math shared by the training forward (rope.cu) and
 * the decode step's rope + KV append (decode.cu): one block per row, the row's q and k heads in
 * shared memory as fp32, HF's bf16 roundings (w · bf16(x · rstd) rounded, cos/sin rounded).
 */
#pragma once

#include "common.cuh"

// srs[hh] = 1 / sqrt(mean(x²) + eps) of each head whose norm weight is present (a warp per head);
// rstd (may be NULL) gets the same. Ends with a barrier when a norm is present.
__device__ __forceinline__ void qk_row_rstd(const float* sx, float* srs, float* rstd,
                                            const bf16* qw, const bf16* kw, int H, int heads,
                                            int HD, float eps) {
    if (!qw && !kw) return;
    const int lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    for (int hh = threadIdx.x >> 5; hh < heads; hh += n_warps) {
        if ((hh < H ? qw : kw) == NULL) continue;
        float ss = 0.0f;
        for (int i = lane; i < HD; i += 32) ss += sx[hh * HD + i] * sx[hh * HD + i];
        ss = warp_sum(ss);
        const float rs = 1.0f / sqrtf(ss / (float)HD + eps);
        if (lane == 0) {
            srs[hh] = rs;
            if (rstd) rstd[hh] = rs;
        }
    }
    __syncthreads();
}

// Pair (i, i + HD/2) of head hh, normed (when its weight is present) and rotated by the position's
// cos/sin (cost, sint: that position's half-row tables): *y1, *y2.
__device__ __forceinline__ void qk_row_rope_pair(const float* sx, const float* srs, const bf16* qw,
                                                 const bf16* kw, const float* cost,
                                                 const float* sint, int H, int HD, int hh, int i,
                                                 bf16* y1, bf16* y2) {
    const int half = HD / 2;
    const bf16* w = hh < H ? qw : kw;
    float x1 = sx[hh * HD + i], x2 = sx[hh * HD + i + half];
    if (w) {
        const float rs = srs[hh];
        x1 = bf16_round(__bfloat162float(w[i]) * bf16_round(x1 * rs));
        x2 = bf16_round(__bfloat162float(w[i + half]) * bf16_round(x2 * rs));
    }
    const float c = bf16_round(cost[i]), s = bf16_round(sint[i]);
    *y1 = __float2bfloat16_rn(x1 * c - x2 * s);
    *y2 = __float2bfloat16_rn(x2 * c + x1 * s);
}
