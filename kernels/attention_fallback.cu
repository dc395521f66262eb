/*
 * attention_fallback.cu — a simple, slow, obviously correct causal GQA attention (forward and
 * backward) for the shapes the flash kernels of kernels/attention.cu do not take: head dims other
 * than 16/32/64/128 (the test presets use HD 8 and 12) or rows that are not 16-byte aligned.
 * ops_cuda.cu picks it only then; real models never run it.
 *
 * One warp per row, fp32 math, HD <= 256 (each lane holds HD/32 elements of its row):
 *  - forward: one warp per (b, h, query t): online softmax over keys 0..t, one key at a time
 *    (q·k by an xor-butterfly warp sum). Saves lse of the scaled logits.
 *  - backward pass 1: one warp per (b, h, query t): D = rowsum(dO ∘ O) (kept in the workspace)
 *    and dq = scale Σ_j P_ij (dO·v_j - D) k_j.
 *  - backward pass 2: one warp per (b, kv head g, key j): dk = scale Σ ds_ij q_i and
 *    dv = Σ P_ij dO_i over the query heads of the group and the queries i >= j, in that order.
 * Every sum runs in a fixed order: deterministic, no atomics.
 * The sink variants (GPT-OSS) take sinks (H) or NULL and a sliding window: key j visible to query
 * t iff t - window < j <= t (the loops' bounds), the sink one more term of the softmax's
 * denominator (the forward starts from m = sink, l = 1); P = exp(s - lse) already includes it in
 * the backward. Without sinks and window they are the causal kernels.
 */
#include <math.h>

#include "common.cuh"

#define ATT_SIMPLE_MAX_PER_LANE 8  // HD <= 256
#define ATT_SIMPLE_WARPS 4

// Row pointers into the packed qkv / out buffers.
struct AttnDims {
    int B, T, H, KVH, HD, QKV, group;
    float scale;
    const bf16* sinks;  // (H) or NULL
    int window;         // 1 .. T (T: no window)
};

__device__ __forceinline__ const bf16* q_row(const bf16* qkv, const AttnDims& a, int b, int t,
                                             int h) {
    return qkv + ((size_t)b * a.T + t) * a.QKV + (size_t)h * a.HD;
}
__device__ __forceinline__ const bf16* k_row(const bf16* qkv, const AttnDims& a, int b, int t,
                                             int g) {
    return qkv + ((size_t)b * a.T + t) * a.QKV + (size_t)(a.H + g) * a.HD;
}
__device__ __forceinline__ const bf16* v_row(const bf16* qkv, const AttnDims& a, int b, int t,
                                             int g) {
    return qkv + ((size_t)b * a.T + t) * a.QKV + (size_t)(a.H + a.KVH + g) * a.HD;
}

// x[k] = row[lane + 32 k] (0 past HD).
__device__ __forceinline__ void load_row(float* x, const bf16* row, int HD, int lane) {
#pragma unroll
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
        int d = lane + 32 * k;
        x[k] = d < HD ? __bfloat162float(row[d]) : 0.0f;
    }
}

__device__ __forceinline__ float row_dot(const float* x, const bf16* row, int HD, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
        int d = lane + 32 * k;
        if (d < HD) s += x[k] * __bfloat162float(row[d]);
    }
    return warp_sum(s);
}

// ----------------------------------------------------------------------------
// forward

__global__ void attention_forward_simple_kernel(bf16* __restrict__ out, float* __restrict__ lse,
                                                const bf16* __restrict__ qkv, AttnDims a) {
    const int lane = threadIdx.x & 31;
    const size_t idx = (size_t)blockIdx.x * ATT_SIMPLE_WARPS + (threadIdx.x >> 5);
    if (idx >= (size_t)a.B * a.H * a.T) return;
    const int t = (int)(idx % a.T), h = (int)(idx / a.T % a.H), b = (int)(idx / a.T / a.H);
    const int g = h / a.group;
    float q[ATT_SIMPLE_MAX_PER_LANE], acc[ATT_SIMPLE_MAX_PER_LANE];
    load_row(q, q_row(qkv, a, b, t, h), a.HD, lane);
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) acc[k] = 0.0f;
    float m = a.sinks ? __bfloat162float(a.sinks[h]) : -INFINITY;
    float l = a.sinks ? 1.0f : 0.0f;  // e^(sink - m) at m = sink
    for (int j = max(0, t - a.window + 1); j <= t; j++) {
        float s = row_dot(q, k_row(qkv, a, b, j, g), a.HD, lane) * a.scale;
        float m_new = fmaxf(m, s), corr = expf(m - m_new), p = expf(s - m_new);
        l = l * corr + p;
        const bf16* v = v_row(qkv, a, b, j, g);
#pragma unroll
        for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
            int d = lane + 32 * k;
            acc[k] = acc[k] * corr + (d < a.HD ? p * __bfloat162float(v[d]) : 0.0f);
        }
        m = m_new;
    }
    bf16* o = out + ((size_t)b * a.T + t) * a.H * a.HD + (size_t)h * a.HD;
#pragma unroll
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
        int d = lane + 32 * k;
        if (d < a.HD) o[d] = __float2bfloat16_rn(acc[k] / l);
    }
    if (lane == 0) lse[((size_t)b * a.H + h) * a.T + t] = m + logf(l);
}

// ----------------------------------------------------------------------------
// backward

// Pass 1: D and dq, one warp per (b, h, t).
__global__ void attention_backward_dq_simple_kernel(bf16* __restrict__ dqkv, float* __restrict__ Dws,
                                                    const bf16* __restrict__ dout,
                                                    const bf16* __restrict__ qkv,
                                                    const bf16* __restrict__ out,
                                                    const float* __restrict__ lse, AttnDims a) {
    const int lane = threadIdx.x & 31;
    const size_t idx = (size_t)blockIdx.x * ATT_SIMPLE_WARPS + (threadIdx.x >> 5);
    if (idx >= (size_t)a.B * a.H * a.T) return;
    const int t = (int)(idx % a.T), h = (int)(idx / a.T % a.H), b = (int)(idx / a.T / a.H);
    const int g = h / a.group;
    const size_t o_off = ((size_t)b * a.T + t) * a.H * a.HD + (size_t)h * a.HD;
    const size_t bht = ((size_t)b * a.H + h) * a.T + t;
    float q[ATT_SIMPLE_MAX_PER_LANE], dO[ATT_SIMPLE_MAX_PER_LANE], dq[ATT_SIMPLE_MAX_PER_LANE];
    load_row(q, q_row(qkv, a, b, t, h), a.HD, lane);
    load_row(dO, dout + o_off, a.HD, lane);
    const float D = row_dot(dO, out + o_off, a.HD, lane), L = lse[bht];
    if (lane == 0) Dws[bht] = D;
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) dq[k] = 0.0f;
    for (int j = max(0, t - a.window + 1); j <= t; j++) {
        const bf16* kr = k_row(qkv, a, b, j, g);
        float p = expf(row_dot(q, kr, a.HD, lane) * a.scale - L);
        float ds = p * (row_dot(dO, v_row(qkv, a, b, j, g), a.HD, lane) - D);
#pragma unroll
        for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (d < a.HD) dq[k] += ds * __bfloat162float(kr[d]);
        }
    }
    bf16* dst = dqkv + ((size_t)b * a.T + t) * a.QKV + (size_t)h * a.HD;
#pragma unroll
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
        int d = lane + 32 * k;
        if (d < a.HD) dst[d] = __float2bfloat16_rn(dq[k] * a.scale);
    }
}

// Pass 2: dk and dv, one warp per (b, g, key j).
__global__ void attention_backward_dkv_simple_kernel(bf16* __restrict__ dqkv,
                                                     const float* __restrict__ Dws,
                                                     const bf16* __restrict__ dout,
                                                     const bf16* __restrict__ qkv,
                                                     const float* __restrict__ lse, AttnDims a) {
    const int lane = threadIdx.x & 31;
    const size_t idx = (size_t)blockIdx.x * ATT_SIMPLE_WARPS + (threadIdx.x >> 5);
    if (idx >= (size_t)a.B * a.KVH * a.T) return;
    const int j = (int)(idx % a.T), g = (int)(idx / a.T % a.KVH), b = (int)(idx / a.T / a.KVH);
    float kj[ATT_SIMPLE_MAX_PER_LANE], vj[ATT_SIMPLE_MAX_PER_LANE];
    float dk[ATT_SIMPLE_MAX_PER_LANE], dv[ATT_SIMPLE_MAX_PER_LANE];
    load_row(kj, k_row(qkv, a, b, j, g), a.HD, lane);
    load_row(vj, v_row(qkv, a, b, j, g), a.HD, lane);
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) dk[k] = dv[k] = 0.0f;
    for (int h = g * a.group; h < (g + 1) * a.group; h++) {
        for (int i = j; i < min(a.T, j + a.window); i++) {
            const size_t bht = ((size_t)b * a.H + h) * a.T + i;
            const bf16* qi = q_row(qkv, a, b, i, h);
            const bf16* dOi = dout + ((size_t)b * a.T + i) * a.H * a.HD + (size_t)h * a.HD;
            float p = expf(row_dot(kj, qi, a.HD, lane) * a.scale - lse[bht]);
            float ds = p * (row_dot(vj, dOi, a.HD, lane) - Dws[bht]);
#pragma unroll
            for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
                int d = lane + 32 * k;
                if (d < a.HD) {
                    dk[k] += ds * __bfloat162float(qi[d]);
                    dv[k] += p * __bfloat162float(dOi[d]);
                }
            }
        }
    }
    bf16* dkr = dqkv + ((size_t)b * a.T + j) * a.QKV + (size_t)(a.H + g) * a.HD;
    bf16* dvr = dkr + (size_t)a.KVH * a.HD;
#pragma unroll
    for (int k = 0; k < ATT_SIMPLE_MAX_PER_LANE; k++) {
        int d = lane + 32 * k;
        if (d < a.HD) {
            dkr[d] = __float2bfloat16_rn(dk[k] * a.scale);
            dvr[d] = __float2bfloat16_rn(dv[k]);
        }
    }
}

// ----------------------------------------------------------------------------
// launchers

// sinks (H) or NULL; window 0 (none) or >= T: T, which masks nothing.
static AttnDims attn_dims(int B, int T, int H, int KVH, int HD, const bf16* sinks, int window) {
    if (HD > 32 * ATT_SIMPLE_MAX_PER_LANE || H % KVH != 0)
        fatal("attention (simple path): unsupported shape H=%d KVH=%d HD=%d (HD <= %d, H a "
              "multiple of KVH)", H, KVH, HD, 32 * ATT_SIMPLE_MAX_PER_LANE);
    if (window < 0) fatal("attention (simple path): window %d is negative (0: none)", window);
    AttnDims a = {B, T, H, KVH, HD, (H + 2 * KVH) * HD, H / KVH, 1.0f / sqrtf((float)HD), sinks,
                  window == 0 || window > T ? T : window};
    return a;
}

size_t cuda_attention_simple_workspace_bytes(int B, int T, int H) {
    return (size_t)B * T * H * sizeof(float);
}

void cuda_attention_sink_forward_simple(CudaCtx* cx, bf16* out, float* lse, const bf16* qkv,
                                        const bf16* sinks, int B, int T, int H, int KVH, int HD,
                                        int window) {
    if (B <= 0 || T <= 0) return;
    AttnDims a = attn_dims(B, T, H, KVH, HD, sinks, window);
    attention_forward_simple_kernel<<<grid_size((size_t)B * H * T, ATT_SIMPLE_WARPS),
                                      32 * ATT_SIMPLE_WARPS, 0, cx->stream>>>(out, lse, qkv, a);
    cuda_check_launch();
}

void cuda_attention_sink_backward_simple(CudaCtx* cx, bf16* dqkv, const bf16* dout,
                                         const bf16* qkv, const bf16* out, const float* lse,
                                         float* workspace, int B, int T, int H, int KVH, int HD,
                                         int window) {
    if (B <= 0 || T <= 0) return;
    AttnDims a = attn_dims(B, T, H, KVH, HD, NULL, window);  // the sinks are in lse
    attention_backward_dq_simple_kernel<<<grid_size((size_t)B * H * T, ATT_SIMPLE_WARPS),
                                          32 * ATT_SIMPLE_WARPS, 0, cx->stream>>>(
        dqkv, workspace, dout, qkv, out, lse, a);
    cuda_check_launch();
    attention_backward_dkv_simple_kernel<<<grid_size((size_t)B * KVH * T, ATT_SIMPLE_WARPS),
                                           32 * ATT_SIMPLE_WARPS, 0, cx->stream>>>(
        dqkv, workspace, dout, qkv, lse, a);
    cuda_check_launch();
}

void cuda_attention_forward_simple(CudaCtx* cx, bf16* out, float* lse, const bf16* qkv, int B,
                                   int T, int H, int KVH, int HD) {
    cuda_attention_sink_forward_simple(cx, out, lse, qkv, NULL, B, T, H, KVH, HD, 0);
}

void cuda_attention_backward_simple(CudaCtx* cx, bf16* dqkv, const bf16* dout, const bf16* qkv,
                                    const bf16* out, const float* lse, float* workspace, int B,
                                    int T, int H, int KVH, int HD) {
    cuda_attention_sink_backward_simple(cx, dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH,
                                        HD, 0);
}
