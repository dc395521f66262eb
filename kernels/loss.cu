/*
 * loss.cu — fused softmax cross-entropy forward and backward over a chunk of bf16 logits (n, V),
 * in place (ops.h). fp32 math.
 *
 * One block per row, two passes over the row: pass 1 keeps a running (max, sum of exp) per thread
 * (one rescale per 8-element vector), merged over the block in a fixed order (xor butterfly in a
 * warp, then warps in index order): the log-sum-exp is the same bits on every run. The loss is
 * lse - z[target]. Pass 2 (compute_grad) overwrites the row with (softmax - onehot) · grad_scale,
 * rounded to bf16. Pass 2 re-reads the row, which mostly hits L2 (a 151936-wide bf16 row is 297 KB).
 * A target < 0 means ignored: loss 0, zero gradient. A target >= V is flagged in the device error
 * word (reported at the next synchronize) and treated as ignored.
 */
#include <math.h>

#include "common.cuh"

#define XENT_THREADS 1024

// Merge (m2, s2) into (m, s): the sum of exp(z - m) over both parts, relative to the larger max.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float M = fmaxf(m, m2);
    if (M == -INFINITY) return;  // both parts empty
    s = s * __expf(m - M) + s2 * __expf(m2 - M);
    m = M;
}

template <int VEC>
__global__ void crossentropy_kernel(bf16* __restrict__ logits, float* __restrict__ losses,
                                    const int32_t* __restrict__ targets, int V, float grad_scale,
                                    int compute_grad, int* err) {
    __shared__ float red_m[32], red_s[32];
    const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bf16* z = logits + (size_t)row * V;
    int y = targets[row];
    if (y >= V) {
        if (threadIdx.x == 0) atomicOr(err, CUDA_ERR_TARGET);
        y = -1;
    }
    if (y < 0) {  // ignored position (uniform over the block)
        if (threadIdx.x == 0 && losses) losses[row] = 0.0f;
        if (compute_grad)
            for (int c = threadIdx.x; c < V; c += blockDim.x) z[c] = __float2bfloat16_rn(0.0f);
        return;
    }
    // read before any thread of pass 2 can overwrite it (pass 2 starts after the merge's barriers)
    const float zy = threadIdx.x == 0 ? __bfloat162float(z[y]) : 0.0f;

    float m = -INFINITY, s = 0.0f;
    for (int c = threadIdx.x * VEC; c < V; c += blockDim.x * VEC) {
        float v[VEC];
        load_bf16<VEC>(z + c, v);
        float vmax = v[0];
#pragma unroll
        for (int k = 1; k < VEC; k++) vmax = fmaxf(vmax, v[k]);
        if (vmax > m) {
            s = m == -INFINITY ? 0.0f : s * __expf(m - vmax);
            m = vmax;
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) s += __expf(v[k] - m);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    if (lane == 0) {
        red_m[warp] = m;
        red_s[warp] = s;
    }
    __syncthreads();
    m = red_m[0];
    s = red_s[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) lse_merge(m, s, red_m[w], red_s[w]);
    if (threadIdx.x == 0 && losses) losses[row] = m + logf(s) - zy;
    if (!compute_grad) return;

    const float inv = 1.0f / s;
    for (int c = threadIdx.x * VEC; c < V; c += blockDim.x * VEC) {
        float v[VEC];
        load_bf16<VEC>(z + c, v);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float p = __expf(v[k] - m) * inv;
            v[k] = (c + k == y ? p - 1.0f : p) * grad_scale;
        }
        store_bf16<VEC>(z + c, v);
    }
}

void cuda_crossentropy_forward_backward(CudaCtx* cx, bf16* logits, float* losses,
                                        const int32_t* targets, int n, int V, float grad_scale,
                                        int compute_grad) {
    if (n <= 0 || V <= 0) return;
    if (V % 8 == 0 && is_aligned16(logits))
        crossentropy_kernel<8><<<n, XENT_THREADS, 0, cx->stream>>>(
            logits, losses, targets, V, grad_scale, compute_grad, cx->d_error);
    else
        crossentropy_kernel<1><<<n, XENT_THREADS, 0, cx->stream>>>(
            logits, losses, targets, V, grad_scale, compute_grad, cx->d_error);
    cuda_check_launch();
}
