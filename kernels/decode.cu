/*
 * decode.cu — the generation kernels (ops.h, generate.h): the decode step's q/k-norm + RoPE with
 * the KV-cache append, decode attention (one query row per sequence against its bf16 KV cache),
 * and the sampler (greedy or the full tempered softmax, with the log-prob of the drawn token).
 *
 * Rope + append: one block per row, the math and roundings of rope.cu's forward (HF in bf16:
 * w · bf16(x · rstd) rounded, cos/sin rounded to bf16) at the row's own position pos[i]; the
 * rotated k and the v of the row go to the cache at (slot[i], pos[i]).
 *
 * Decode attention, split-K over the keys: the keys of a row are cut into fixed chunks of
 * DEC_CHUNK positions (a function of the position only, never of the batch or the device), one
 * block per (row, kv head, chunk) holds the H/KVH query heads of its group, so every key and
 * value is read once per group (GQA). Inside a block each warp takes keys warp, warp + W, ...,
 * DEC_UNROLL at a time (loads in flight), with an online softmax per head in fp32; the warps
 * merge in index order. Each chunk leaves (max, sum, unnormalised output) in fp32 scratch; a
 * second kernel merges a row's chunks in chunk order, adds the sink logit, divides and rounds:
 * the same bits for the same inputs on every run, whatever else is in the batch.
 *
 * Sampler: one block per row. Pass 1 finds the max (and the first index holding it: greedy);
 * pass 2 sums expf((z - max) / temperature) per thread over a contiguous slice of the vocabulary
 * (in double, as the CPU sampler does), a block scan gives each slice's prefix, and the slice
 * where the host's uniform draw u · Σ falls walks its tokens in vocabulary order: the CPU's
 * inverse-CDF walk (generate.c gen_sample), so both draw the same token from the same u unless
 * two cumulative sums straddle u · Σ within rounding. logp = (z_tok - max)/temperature - log Σ.
 */
#include <math.h>

#include "common.cuh"
#include "decode.h"
#include "rope.cuh"

#define DEC_CHUNK 256     // keys per split-K chunk
#define DEC_WARPS 4       // warps per attention block
#define DEC_UNROLL 4      // keys per warp per iteration
#define DEC_MAX_GROUP 8   // query heads per kv head held by one block
#define ROPE_APPEND_THREADS 256
#define SAMPLE_THREADS 1024

// ----------------------------------------------------------------------------
// q/k-norm + RoPE at each row's position, k and v into the cache

__global__ void decode_rope_append_kernel(bf16* __restrict__ out, bf16* __restrict__ kc,
                                          bf16* __restrict__ vc, const bf16* __restrict__ inp,
                                          const bf16* __restrict__ qw, const bf16* __restrict__ kw,
                                          const float* __restrict__ cosb,
                                          const float* __restrict__ sinb,
                                          const int32_t* __restrict__ pos,
                                          const int32_t* __restrict__ slot, int maxT, int H,
                                          int KVH, int HD, float eps) {
    extern __shared__ float sm[];
    const int heads = H + KVH, QK = heads * HD, KD = KVH * HD, QKV = QK + KD, half = HD / 2;
    float* sx = sm;        // (heads, HD) q and k of this row
    float* srs = sx + QK;  // (heads) rstd
    const int row = blockIdx.x, t = pos[row];
    const bf16* in = inp + (size_t)row * QKV;
    bf16* o = out + (size_t)row * QKV;
    const size_t cache_at = ((size_t)slot[row] * maxT + t) * KD;
    for (int e = threadIdx.x; e < QK; e += blockDim.x) sx[e] = __bfloat162float(in[e]);
    for (int e = threadIdx.x; e < KD; e += blockDim.x) {
        const bf16 v = in[QK + e];
        o[QK + e] = v;
        vc[cache_at + e] = v;
    }
    __syncthreads();
    qk_row_rstd(sx, srs, NULL, qw, kw, H, heads, HD, eps);
    for (int p = threadIdx.x; p < heads * half; p += blockDim.x) {
        const int hh = p / half, i = p % half;
        bf16 y1, y2;
        qk_row_rope_pair(sx, srs, qw, kw, cosb + (size_t)t * half, sinb + (size_t)t * half, H, HD,
                         hh, i, &y1, &y2);
        o[hh * HD + i] = y1;
        o[hh * HD + i + half] = y2;
        if (hh >= H) {
            kc[cache_at + (size_t)(hh - H) * HD + i] = y1;
            kc[cache_at + (size_t)(hh - H) * HD + i + half] = y2;
        }
    }
}

void cuda_decode_rope_append(CudaCtx* cx, bf16* out, bf16* kc, bf16* vc, const bf16* inp,
                             const bf16* q_norm_w, const bf16* k_norm_w, const float* cos,
                             const float* sin, const int32_t* pos, const int32_t* slot, int n,
                             int maxT, int H, int KVH, int HD, float eps) {
    if (n <= 0) return;
    const size_t smem = ((size_t)(H + KVH) * HD + (H + KVH)) * sizeof(float);
    if (smem > 48 * 1024)
        fatal("decode rope: %d heads of %d need %zu bytes of shared memory", H + KVH, HD, smem);
    decode_rope_append_kernel<<<n, ROPE_APPEND_THREADS, smem, cx->stream>>>(
        out, kc, vc, inp, q_norm_w, k_norm_w, cos, sin, pos, slot, maxT, H, KVH, HD, eps);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// decode attention: split-K partials, then the ordered combine

// EPL consecutive head-dim elements per lane (lane * EPL ...), zero past HD. vec: one 8-byte
// access per lane (EPL 4, every head 8-byte aligned: the launcher checks).
template <int EPL>
__device__ __forceinline__ void load_lane(const bf16* p, int lane, int HD, int vec, float* f) {
    const int d0 = lane * EPL;
    if (EPL == 4 && vec && d0 + 4 <= HD) {
        uint2 u = *reinterpret_cast<const uint2*>(p + d0);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
        float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
        f[0] = a.x;
        f[1] = a.y;
        f[2] = b.x;
        f[3] = b.y;
        return;
    }
#pragma unroll
    for (int e = 0; e < EPL; e++) f[e] = d0 + e < HD ? __bfloat162float(p[d0 + e]) : 0.0f;
}

// Block (row i, kv head g, chunk c): keys [c·DEC_CHUNK, ...) ∩ [first, len) of row i's slot, for
// the `group` query heads of g. part_m, part_l (n, H, chunks), part_o (n, H, chunks, HD).
template <int EPL, int GM>
__global__ void decode_attention_partial_kernel(float* __restrict__ part_m,
                                                float* __restrict__ part_l,
                                                float* __restrict__ part_o,
                                                const bf16* __restrict__ qkv,
                                                const bf16* __restrict__ kc,
                                                const bf16* __restrict__ vc,
                                                const int32_t* __restrict__ slot,
                                                const int32_t* __restrict__ len, int maxT, int H,
                                                int KVH, int HD, int window, int chunks,
                                                float scale, int vec) {
    __shared__ float s_m[DEC_WARPS][DEC_MAX_GROUP], s_l[DEC_WARPS][DEC_MAX_GROUP];
    extern __shared__ float s_o[];  // (DEC_WARPS, group, HD)
    const int i = blockIdx.x, g = blockIdx.y, c = blockIdx.z;
    const int group = H / KVH, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int QKV = (H + 2 * KVH) * HD, KD = KVH * HD;
    const int L = len[i], first = window > 0 && L > window ? L - window : 0;
    const int j0 = max(c * DEC_CHUNK, first), j1 = min((c + 1) * DEC_CHUNK, L);
    const size_t pbase = ((size_t)i * H + (size_t)g * group) * chunks + c;  // head h0, chunk c
    if (j0 >= j1) {  // nothing of this row in the chunk: an empty partial
        for (int h = threadIdx.x; h < group; h += blockDim.x) {
            part_m[pbase + (size_t)h * chunks] = -INFINITY;
            part_l[pbase + (size_t)h * chunks] = 0.0f;
        }
        return;
    }
    float q[GM][EPL], acc[GM][EPL], m[GM], l[GM];  // GM >= group: registers for its heads
#pragma unroll
    for (int h = 0; h < GM; h++) {
        if (h >= group) break;
        load_lane<EPL>(qkv + (size_t)i * QKV + (size_t)(g * group + h) * HD, lane, HD, vec,
                       q[h]);
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            q[h][e] *= scale;
            acc[h][e] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const bf16* kb = kc + (size_t)slot[i] * maxT * KD + (size_t)g * HD;
    const bf16* vb = vc + (size_t)slot[i] * maxT * KD + (size_t)g * HD;
    for (int j = j0 + warp * DEC_UNROLL; j < j1; j += DEC_WARPS * DEC_UNROLL) {
        float k[DEC_UNROLL][EPL], v[DEC_UNROLL][EPL];
        const int nk = min(DEC_UNROLL, j1 - j);
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            if (u < nk) {
                load_lane<EPL>(kb + (size_t)(j + u) * KD, lane, HD, vec, k[u]);
                load_lane<EPL>(vb + (size_t)(j + u) * KD, lane, HD, vec, v[u]);
            } else {  // past the chunk: weight 0, and 0 · v must not meet garbage (NaN)
#pragma unroll
                for (int e = 0; e < EPL; e++) k[u][e] = v[u][e] = 0.0f;
            }
        }
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= group) break;
            float s[DEC_UNROLL], mx = m[h];
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; u++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; e++) d += q[h][e] * k[u][e];
                s[u] = u < nk ? warp_sum(d) : -INFINITY;
                mx = fmaxf(mx, s[u]);
            }
            const float corr = __expf(m[h] - mx);  // m = -inf at the start: 0
            l[h] *= corr;
#pragma unroll
            for (int e = 0; e < EPL; e++) acc[h][e] *= corr;
#pragma unroll
            for (int u = 0; u < DEC_UNROLL; u++) {
                const float p = __expf(s[u] - mx);  // s = -inf past the chunk: 0
                l[h] += p;
#pragma unroll
                for (int e = 0; e < EPL; e++) acc[h][e] += p * v[u][e];
            }
            m[h] = mx;
        }
    }
    // the warps' partial softmaxes merged in warp order
#pragma unroll
    for (int h = 0; h < GM; h++) {
        if (h >= group) break;
        if (lane == 0) {
            s_m[warp][h] = m[h];
            s_l[warp][h] = l[h];
        }
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            const int d = lane * EPL + e;
            if (d < HD) s_o[((size_t)warp * group + h) * HD + d] = acc[h][e];
        }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < group * HD; x += blockDim.x) {
        const int h = x / HD, d = x % HD;
        float M = -INFINITY;
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, s_m[w][h]);
        float sl = 0.0f, so = 0.0f;
        for (int w = 0; w < DEC_WARPS; w++) {
            const float f = s_m[w][h] == -INFINITY ? 0.0f : __expf(s_m[w][h] - M);
            sl += s_l[w][h] * f;
            so += s_o[((size_t)w * group + h) * HD + d] * f;
        }
        const size_t pi = pbase + (size_t)h * chunks;
        part_o[pi * HD + d] = so;
        if (d == 0) {
            part_m[pi] = M;
            part_l[pi] = sl;
        }
    }
}

// Block (row i, head h): its chunks merged in order, the sink logit added, out = o / Σ.
__global__ void decode_attention_combine_kernel(bf16* __restrict__ out,
                                                const float* __restrict__ part_m,
                                                const float* __restrict__ part_l,
                                                const float* __restrict__ part_o,
                                                const bf16* __restrict__ sinks,
                                                const int32_t* __restrict__ len, int H, int HD,
                                                int chunks) {
    const int i = blockIdx.x, h = blockIdx.y;
    const int used = min(chunks, (len[i] + DEC_CHUNK - 1) / DEC_CHUNK);
    const size_t pb = ((size_t)i * H + h) * chunks;
    float M = sinks ? __bfloat162float(sinks[h]) : -INFINITY;
    for (int c = 0; c < used; c++) M = fmaxf(M, part_m[pb + c]);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float den = sinks ? __expf(__bfloat162float(sinks[h]) - M) : 0.0f, o = 0.0f;
        for (int c = 0; c < used; c++) {
            const float mc = part_m[pb + c];
            if (mc == -INFINITY) continue;
            const float f = __expf(mc - M);
            den += part_l[pb + c] * f;
            o += part_o[(pb + c) * HD + d] * f;
        }
        out[((size_t)i * H + h) * HD + d] = __float2bfloat16_rn(den > 0.0f ? o / den : 0.0f);
    }
}

template <int EPL, int GM>
static void launch_partial_gm(CudaCtx* cx, float* pm, float* pl, float* po, const bf16* qkv,
                           const bf16* kc, const bf16* vc, const int32_t* slot, const int32_t* len,
                           int n, int maxT, int H, int KVH, int HD, int window, int chunks) {
    const dim3 grid(n, KVH, chunks);
    const size_t smem = (size_t)DEC_WARPS * (H / KVH) * HD * sizeof(float);
    // 8-byte lane loads: HD a multiple of 4 (then every head and row is 8-byte aligned when the
    // buffers are)
    const int vec = HD % 4 == 0 && ((uintptr_t)qkv & 7) == 0 && ((uintptr_t)kc & 7) == 0 &&
                    ((uintptr_t)vc & 7) == 0;
    decode_attention_partial_kernel<EPL, GM><<<grid, DEC_WARPS * 32, smem, cx->stream>>>(
        pm, pl, po, qkv, kc, vc, slot, len, maxT, H, KVH, HD, window, chunks,
        1.0f / sqrtf((float)HD), vec);
    cuda_check_launch();
}

template <int EPL>
static void launch_partial(CudaCtx* cx, float* pm, float* pl, float* po, const bf16* qkv,
                           const bf16* kc, const bf16* vc, const int32_t* slot, const int32_t* len,
                           int n, int maxT, int H, int KVH, int HD, int window, int chunks) {
    if (H / KVH <= 2)
        launch_partial_gm<EPL, 2>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD,
                                  window, chunks);
    else
        launch_partial_gm<EPL, DEC_MAX_GROUP>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H,
                                              KVH, HD, window, chunks);
}

size_t cuda_attention_decode_scratch_bytes(int n, int maxT, int H, int HD) {
    const size_t chunks = (size_t)(maxT + DEC_CHUNK - 1) / DEC_CHUNK;
    return (size_t)n * H * chunks * (HD + 2) * sizeof(float);
}

int cuda_attention_decode_supports(int H, int KVH, int HD) {
    return KVH > 0 && H % KVH == 0 && H / KVH <= DEC_MAX_GROUP && HD <= 256 &&
           (size_t)DEC_WARPS * (H / KVH) * HD * sizeof(float) <= 48 * 1024;
}

void cuda_attention_decode(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                           const bf16* vc, const int32_t* slot, const int32_t* len,
                           const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                           int window) {
    if (n <= 0) return;
    if (!cuda_attention_decode_supports(H, KVH, HD))
        fatal("decode attention: %d query heads over %d kv heads of dim %d is not supported "
              "(at most %d query heads per kv head, head dim <= 256)", H, KVH, HD, DEC_MAX_GROUP);
    const int chunks = (maxT + DEC_CHUNK - 1) / DEC_CHUNK;
    const size_t np = (size_t)n * H * chunks;
    float* pm = (float*)cuda_scratch(cx, SCRATCH_ATTN, cuda_attention_decode_scratch_bytes(n, maxT, H, HD));
    float* pl = pm + np;
    float* po = pl + np;
    if (HD <= 32)
        launch_partial<1>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                          chunks);
    else if (HD <= 64)
        launch_partial<2>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                          chunks);
    else if (HD <= 128)
        launch_partial<4>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                          chunks);
    else
        launch_partial<8>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                          chunks);
    decode_attention_combine_kernel<<<dim3(n, H), HD <= 128 ? 128 : 256, 0, cx->stream>>>(
        out, pm, pl, po, sinks, len, H, HD, chunks);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// sampling

// (value, index) max with ties to the lower index.
__device__ __forceinline__ void argmax_merge(float& v, int& idx, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < idx)) {
        v = v2;
        idx = i2;
    }
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Row i: tokens[i] drawn with the uniform u[i]; logp[2i] its log-prob under the distribution it
// was drawn from, logp[2i + 1] under the full tempered softmax (the same here: no truncation).
__global__ void sample_kernel(int32_t* __restrict__ tokens, float* __restrict__ logp,
                              const bf16* __restrict__ logits, const float* __restrict__ u, int V,
                              float temperature) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    __shared__ double s_d[32], s_f[32];
    __shared__ int s_pick;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_warps = blockDim.x >> 5;
    const bf16* z = logits + (size_t)row * V;
    // pass 1: the max and its first index
    float bv = -INFINITY;
    int bi = V;
    for (int v = tid; v < V; v += blockDim.x) argmax_merge(bv, bi, __bfloat162float(z[v]), v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_merge(bv, bi, v2, i2);
    }
    if (lane == 0) {
        s_v[warp] = bv;
        s_i[warp] = bi;
    }
    __syncthreads();
    bv = s_v[0];
    bi = s_i[0];
    for (int w = 1; w < n_warps; w++) argmax_merge(bv, bi, s_v[w], s_i[w]);
    if (bi >= V) bi = 0;  // a row of NaNs: token 0, as the CPU's scan
    if (temperature <= 0.0f) {  // greedy: a point mass
        if (tid == 0) {
            tokens[row] = bi;
            logp[2 * row] = logp[2 * row + 1] = 0.0f;
        }
        return;
    }
    // pass 2: this thread's slice [v0, v1) of the vocabulary: the walk's terms
    // exp((z - max) / temperature) in double (the CPU walk's), and the log-prob's
    // expf((z - max) · (1 / temperature)) summed in double (ops.h policy_forward_backward's)
    const float mx = bv, inv = 1.0f / temperature;
    const int per = (V + blockDim.x - 1) / blockDim.x, v0 = min(V, tid * per),
              v1 = min(V, v0 + per);
    double part = 0.0, part_full = 0.0;
    for (int v = v0; v < v1; v++) {
        const float zv = __bfloat162float(z[v]);
        part += exp((double)((zv - mx) / temperature));
        part_full += (double)expf((zv - mx) * inv);
    }
    // inclusive scan of `part` over the threads: in the warp, then the warps' totals in order
    double incl = part;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    part_full = warp_sum_f64(part_full);
    if (lane == 31) s_d[warp] = incl;
    if (lane == 0) s_f[warp] = part_full;
    if (tid == 0) s_pick = 0x7fffffff;
    __syncthreads();
    double before = 0.0, total = 0.0, full = 0.0;
    for (int w = 0; w < n_warps; w++) {
        if (w < warp) before += s_d[w];
        total += s_d[w];
        full += s_f[w];
    }
    incl += before;
    const double excl = incl - part, r = (double)u[row] * total;
    // the first slice whose cumulative sum reaches r (an integer minimum: order-free)
    if (v1 > v0 && incl >= r) atomicMin(&s_pick, tid);
    __syncthreads();
    if (tid != s_pick && !(s_pick == 0x7fffffff && tid == 0)) return;
    int tok = bi;  // r beyond every sum (rounding): the CPU keeps the argmax too
    if (s_pick != 0x7fffffff) {
        double rr = r - excl;
        tok = v1 - 1;
        for (int v = v0; v < v1; v++) {
            rr -= exp((double)((__bfloat162float(z[v]) - mx) / temperature));
            if (rr <= 0.0) {
                tok = v;
                break;
            }
        }
    }
    tokens[row] = tok;
    const float lp = (float)((double)((__bfloat162float(z[tok]) - mx) * inv) - log(full));
    logp[2 * row] = lp;
    logp[2 * row + 1] = lp;
}

void cuda_sample_tokens(CudaCtx* cx, int32_t* tokens, float* logp, const bf16* logits,
                        const float* u, int n, int V, float temperature) {
    if (n <= 0) return;
    sample_kernel<<<n, SAMPLE_THREADS, 0, cx->stream>>>(tokens, logp, logits, u, V, temperature);
    cuda_check_launch();
}
