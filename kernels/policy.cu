/*
 * policy.cu — the clipped policy-gradient objective of GRPO over a chunk of bf16 logits (n, V),
 * in place (ops.h policy_forward_backward; CPU reference llmc/ops_cpu.c), fp32 math with the
 * softmax's sum in double, as the CPU op and the sampler (decode.cu) take it, so that an
 * on-policy ratio is 1 up to the forward's rounding.
 *
 * One block per row, three passes over the row (the later ones mostly from L2): the max; the sum
 * of expf((z - max) · inv_temp), per thread in double, merged over the block in a fixed order
 * (xor butterfly in a warp, warps in index order); then, when compute_grad, the row overwritten
 * with coef · inv_temp · (onehot - softmax). Thread 0 computes the token's scalars (log-prob,
 * ratio, clip, k3 KL, loss, coef) between the passes. A target < 0 is ignored (logp 0, loss 0,
 * zero gradient); a target >= V is flagged in the device error word and treated as ignored.
 */
#include <math.h>

#include "common.cuh"
#include "decode.h"

#define POLICY_THREADS 1024

__global__ void policy_kernel(bf16* __restrict__ logits, float* __restrict__ logp,
                              float* __restrict__ losses, const int32_t* __restrict__ targets,
                              const float* __restrict__ old_logp,
                              const float* __restrict__ ref_logp, const float* __restrict__ adv,
                              const float* __restrict__ weight, int V, float inv_temp,
                              float clip_low, float clip_high, float kl_beta, int compute_grad,
                              int* err) {
    __shared__ float s_m[32];
    __shared__ double s_s[32];
    __shared__ float s_g;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_warps = blockDim.x >> 5;
    bf16* z = logits + (size_t)row * V;
    int y = targets[row];
    if (y >= V) {
        if (tid == 0) atomicOr(err, CUDA_ERR_TARGET);
        y = -1;
    }
    if (y < 0) {  // ignored (uniform over the block)
        if (tid == 0) {
            if (logp) logp[row] = 0.0f;
            if (losses) losses[row] = 0.0f;
        }
        if (compute_grad)
            for (int v = tid; v < V; v += blockDim.x) z[v] = __float2bfloat16_rn(0.0f);
        return;
    }
    const float zy = __bfloat162float(z[y]);  // read before pass 3 overwrites it
    float mx = -INFINITY;
    for (int v = tid; v < V; v += blockDim.x) mx = fmaxf(mx, __bfloat162float(z[v]));
    mx = warp_max(mx);
    if (lane == 0) s_m[warp] = mx;
    __syncthreads();
    mx = s_m[0];
    for (int w = 1; w < n_warps; w++) mx = fmaxf(mx, s_m[w]);
    double sum = 0.0;
    for (int v = tid; v < V; v += blockDim.x) sum += (double)expf((__bfloat162float(z[v]) - mx) * inv_temp);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) s_s[warp] = sum;
    __syncthreads();
    sum = 0.0;
    for (int w = 0; w < n_warps; w++) sum += s_s[w];
    if (tid == 0) {
        const double lp = (double)((zy - mx) * inv_temp) - log(sum);
        if (logp) logp[row] = (float)lp;
        const double A = adv[row], wt = weight[row];
        const double r = exp(lp - (double)old_logp[row]);
        const double rc = fmin(fmax(r, 1.0 - clip_low), 1.0 + clip_high);
        // the clipped term is the smaller exactly where the clip binds in the advantage's
        // direction: there the objective is flat (coef 0)
        const int clipped = rc * A < r * A;
        double loss = -(clipped ? rc * A : r * A), coef = clipped ? 0.0 : -r * A;
        if (ref_logp && kl_beta != 0.0f) {
            const double d = (double)ref_logp[row] - lp;
            loss += kl_beta * (exp(d) - d - 1.0);
            coef += kl_beta * (1.0 - exp(d));
        }
        if (losses) losses[row] = (float)(wt * loss);
        s_g = (float)(wt * coef * inv_temp);
    }
    if (!compute_grad) return;
    __syncthreads();
    const float g = s_g, inv = (float)(1.0 / sum);
    for (int v = tid; v < V; v += blockDim.x) {
        const float p = expf((__bfloat162float(z[v]) - mx) * inv_temp) * inv;
        z[v] = __float2bfloat16_rn(v == y ? (1.0f - p) * g : -p * g);
    }
}

void cuda_policy_forward_backward(CudaCtx* cx, bf16* logits, float* logp, float* losses,
                                  const int32_t* targets, const float* old_logp,
                                  const float* ref_logp, const float* adv, const float* weight,
                                  int n, int V, float inv_temp, float clip_low, float clip_high,
                                  float kl_beta, int compute_grad) {
    if (n <= 0 || V <= 0) return;
    policy_kernel<<<n, POLICY_THREADS, 0, cx->stream>>>(logits, logp, losses, targets, old_logp,
                                                        ref_logp, adv, weight, V, inv_temp,
                                                        clip_low, clip_high, kl_beta,
                                                        compute_grad, cx->d_error);
    cuda_check_launch();
}
