/*
 * dev/cuda/decode.cu — decode lab (kernels/decode.cu): the generation step's attention (one query
 * row per sequence against its bf16 KV cache, GQA, optional sinks and sliding window), the
 * rope + KV-cache append at each row's position, and the sampler.
 *
 *   make dev-cuda && dev/cuda/build/decode [--validate-only] [--variant K] [--seed S]
 *
 * Variants (decode attention; 3-5 and 9 run production's kernels and modes, 6-8 and 10-15 the
 * rejected modes, whose kernels are defined here, sharing production's tile math and combine):
 *   1  naive: one block per (row, query head), one pass over all of the row's keys; a thread
 *      per head-dim element, the logits of the row in shared memory (softmax in fp32).
 *   2  the previous production kernel (kept here): split-K over chunks of 256 keys, one block per
 *      (row, kv head, chunk) holding the kv head's query group, a lane per 4 head-dim elements
 *      (8-byte loads), warps over keys 4 at a time with a full-warp sum per key and head.
 *   3  production at head dim < 128 (kernels/decode.cu, included below): split-K over chunks of
 *      DEC_CHUNK = 128 keys; each warp reads whole key rows of its kv head with 16-byte lane
 *      loads (HD/8 lanes per key, 256/HD keys per warp load), the next tile's keys and values
 *      in flight while the current tile is computed, every query head of the group from that
 *      one read, the softmax in the log2 domain; then the chunks merged in order.
 *   4  variant 3 with half the keys per tile (fewer registers, more warps resident per SM): the
 *      bits of production at head dim >= 128 (variant 9), where the H200 measured it faster.
 *   5  variant 3 with chunks of 256 keys (half the partials, half the blocks).
 *   6  variant 4 with the chunk's keys and values staged in shared memory by cp.async first (the
 *      whole chunk in flight at once, in 4 groups the block walks as they land); the same
 *      arithmetic as variant 4, checked bit for bit against it.
 *   7  variant 3 staged the same way (bit for bit against variant 3).
 *   8  variant 6 with chunks of 64 keys (twice the blocks, half the shared memory each).
 *   9  variant 4 with a deeper pipeline: each thread copies its own words of the next 4 tiles
 *      into a ring in shared memory by cp.async (4 tiles per warp in flight, no registers to
 *      hold them); bit for bit variant 4. Production at head dim >= 128.
 *  10  variant 9 with a ring of 8 tiles (bit for bit variant 4).
 *  11  variant 3 with a ring of 4 tiles (bit for bit variant 3).
 *  12  variant 10 with chunks of 256 keys.
 *  13  one block per (row, kv head) walks the row's chunks in order, each chunk's tiles as
 *      variant 9's block takes them, the 4-tile ring running on across chunk ends, then merges
 *      its group's chunks in the block with the combine's arithmetic: no second launch and no
 *      empty blocks for the chunks past a short row; bit for bit variant 4. Production for a
 *      while; slower than variant 9 averaged over a 512-token rollout on the H200 (faster at
 *      16-128 keys, slower from 272).
 *  14  variant 13 with an 8-tile ring (bit for bit variant 4).
 *  15  variant 13 with full tiles (bit for bit variant 3: a candidate below head dim 128).
 * Validation on fresh random bf16 inputs against an fp64 reference: rows of lengths 1 .. maxT
 * (inside one chunk, across chunks, up to 4096) in shuffled cache slots; (H, KVH, HD) = (16, 8,
 * 128) (Qwen3-1.7B), (8, 2, 64) with sinks and a window, (64, 8, 64) (GPT-OSS-20B: group 8, with
 * sinks and a window), (32, 8, 128) (LLaMA-8B), (4, 4, 256), (4, 1, 16), (6, 2, 12) (HD not a
 * multiple of 4); the output within TOL_BF16; the split-K variants run twice must give the same
 * bits, and a row run alone the bits it had in the batch. Also the rope +
 * append (TOL_BF16 against an fp64 rotation of the bf16 inputs, cache slots checked; and the
 * production head kernel bit for bit against the row kernel, with and without the q/k norm, at
 * Qwen3-1.7B's, GPT-OSS-20B's and test-qwen3's heads) and the sampler, production and the
 * previous row sampler kept below, at V = 151936, 50000, 4099 (not a multiple of 8) and 100
 * (fewer words than slices) (greedy: the first argmax; tempered: the token of an fp64
 * inverse-CDF walk with the same uniform, and its log-prob within 1e-4).
 * Benchmark: 128 sequences (8 prompts x 16 answers), H 16, KVH 8, HD 128, every row at the same
 * length L in {16, 128, 272, 512, 1024, 4096} (cache maxT = L), then at L in {16, 272, 512} in
 * the rollout's cache of maxT = 528 (16 prompt + 512 generated tokens: the chunks past L are
 * launched and empty for the split grid), and LLaMA-8B's and GPT-OSS-20B's heads at 1024:
 * GB/s over the keys and values read (the bytes that bound it), per layer, next to a device copy.
 * Then the sampler at V = 151936 (Qwen3) for 128 rows (row 1: the previous sampler, one block of
 * 1024 threads per row, double exponentials for every token; row 2: production, SAMPLE_SLICES
 * blocks per row with fp32 terms, and a pick kernel walking the chosen slice in double), and
 * the rope + append for 128 rows of Qwen3-1.7B's heads (row 1: the row kernel, one block per row;
 * row 2: production, a warp per head), each with its time in us.
 */
#include "../../kernels/decode.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// the previous sampler (kept for its benchmark row and as a second check of the walk)

// The previous production sampler (row 1 of the sampler's benchmark), one block of 1024 threads
// per row. Row i: tokens[i] drawn with the uniform u[i]; logp[2i] its log-prob under the
// distribution it was drawn from, logp[2i + 1] under the full tempered softmax (the same: no
// truncation).
// vec: V a multiple of 8 and logits 16-byte aligned.
__global__ void sample_rows_kernel(int32_t* __restrict__ tokens, float* __restrict__ logp,
                              const bf16* __restrict__ logits, const float* __restrict__ u, int V,
                              float temperature, int vec) {
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    __shared__ double s_d[32], s_f[32];
    __shared__ int s_pick;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_warps = blockDim.x >> 5, words = (V + 7) / 8;
    const bf16* z = logits + (size_t)row * V;
    // pass 1: the max and its first index (8-token words strided over the block)
    float bv = -INFINITY;
    int bi = V;
#pragma unroll 4
    for (int k = tid; k < words; k += blockDim.x) {
        float f[8];
        sample_load8(z, k, V, vec, f);
#pragma unroll
        for (int e = 0; e < 8; e++) argmax_merge(bv, bi, f[e], 8 * k + e);
    }
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
    // pass 2: this thread's slice of whole words [w0, w1), tokens [8·w0, min(8·w1, V)): the
    // walk's terms exp((z - max) / temperature) in double (the CPU walk's), and the log-prob's
    // expf((z - max) · (1 / temperature)) summed in double (ops.h policy_forward_backward's)
    const float mx = bv, inv = 1.0f / temperature;
    const int per = (words + blockDim.x - 1) / blockDim.x, w0 = min(words, tid * per),
              w1 = min(words, w0 + per), v0 = 8 * w0, v1 = min(V, 8 * w1);
    double part = 0.0, part_full = 0.0;
    for (int k = w0; k < w1; k++) {
        float f[8];
        sample_load8(z, k, V, vec, f);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (8 * k + e >= V) break;
            part += exp((double)((f[e] - mx) / temperature));
            part_full += (double)expf((f[e] - mx) * inv);
        }
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
        for (int k = w0; k < w1; k++) {
            double t[8];
            sample_walk_terms(z, k, V, vec, mx, temperature, t);
            int hit = -1;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                if (hit >= 0 || 8 * k + e >= V) continue;
                rr -= t[e];
                if (rr <= 0.0) hit = 8 * k + e;
            }
            if (hit >= 0) {
                tok = hit;
                break;
            }
        }
    }
    tokens[row] = tok;
    const float lp = (float)((double)((__bfloat162float(z[tok]) - mx) * inv) - log(full));
    logp[2 * row] = lp;
    logp[2 * row + 1] = lp;
}

static void sample_tokens_rows(CudaCtx* cx, int32_t* tokens, float* logp, const bf16* logits,
                               const float* u, int n, int V, float temperature) {
    const int vec = V % 8 == 0 && is_aligned16(logits);
    sample_rows_kernel<<<n, 1024, 0, cx->stream>>>(tokens, logp, logits, u, V, temperature, vec);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// fp64 references

typedef struct DecShape {
    int n, maxT, H, KVH, HD, window, sinks;
} DecShape;

// out (n, H*HD): row i's query head h over keys first .. len-1 of slot[i] (sink: one more logit).
static void decode_attention_ref(std::vector<float>& out, const std::vector<float>& qkv,
                                 const std::vector<float>& kc, const std::vector<float>& vc,
                                 const std::vector<int32_t>& slot, const std::vector<int32_t>& len,
                                 const float* sinks, DecShape s) {
    const int QKV = (s.H + 2 * s.KVH) * s.HD, KD = s.KVH * s.HD, group = s.H / s.KVH;
    out.assign((size_t)s.n * s.H * s.HD, 0.0f);
    std::vector<double> a(s.maxT);
    for (int i = 0; i < s.n; i++)
        for (int h = 0; h < s.H; h++) {
            const int g = h / group, L = len[i];
            const int first = s.window > 0 && L > s.window ? L - s.window : 0;
            const float* q = &qkv[(size_t)i * QKV + (size_t)h * s.HD];
            double mx = sinks ? sinks[h] : -INFINITY;
            for (int j = first; j < L; j++) {
                const float* k = &kc[((size_t)slot[i] * s.maxT + j) * KD + (size_t)g * s.HD];
                double d = 0.0;
                for (int e = 0; e < s.HD; e++) d += (double)q[e] * k[e];
                a[j] = d / sqrt((double)s.HD);
                mx = std::max(mx, a[j]);
            }
            double den = sinks ? exp(sinks[h] - mx) : 0.0;
            std::vector<double> o(s.HD, 0.0);
            for (int j = first; j < L; j++) {
                const double p = exp(a[j] - mx);
                den += p;
                const float* v = &vc[((size_t)slot[i] * s.maxT + j) * KD + (size_t)g * s.HD];
                for (int e = 0; e < s.HD; e++) o[e] += p * v[e];
            }
            for (int e = 0; e < s.HD; e++)
                out[((size_t)i * s.H + h) * s.HD + e] = (float)(o[e] / den);
        }
}

// ----------------------------------------------------------------------------
// variant 1: one block per (row, query head), one pass

__global__ void decode_attention_naive_kernel(bf16* out, const bf16* qkv, const bf16* kc,
                                              const bf16* vc, const int32_t* slot,
                                              const int32_t* len, const bf16* sinks, int maxT,
                                              int H, int KVH, int HD, int window) {
    extern __shared__ float s_a[];  // (maxT) the row's logits
    const int i = blockIdx.x, h = blockIdx.y, g = h / (H / KVH);
    const int QKV = (H + 2 * KVH) * HD, KD = KVH * HD, L = len[i];
    const int first = window > 0 && L > window ? L - window : 0;
    const bf16* q = qkv + (size_t)i * QKV + (size_t)h * HD;
    const bf16* kb = kc + (size_t)slot[i] * maxT * KD + (size_t)g * HD;
    const bf16* vb = vc + (size_t)slot[i] * maxT * KD + (size_t)g * HD;
    const float scale = 1.0f / sqrtf((float)HD);
    for (int j = first + threadIdx.x; j < L; j += blockDim.x) {
        float d = 0.0f;
        for (int e = 0; e < HD; e++)
            d += __bfloat162float(q[e]) * __bfloat162float(kb[(size_t)j * KD + e]);
        s_a[j] = d * scale;
    }
    __syncthreads();
    float mx = sinks ? __bfloat162float(sinks[h]) : -INFINITY;
    for (int j = first; j < L; j++) mx = fmaxf(mx, s_a[j]);
    float den = sinks ? expf(__bfloat162float(sinks[h]) - mx) : 0.0f;
    for (int j = first; j < L; j++) den += expf(s_a[j] - mx);
    for (int e = threadIdx.x; e < HD; e += blockDim.x) {
        float o = 0.0f;
        for (int j = first; j < L; j++)
            o += expf(s_a[j] - mx) * __bfloat162float(vb[(size_t)j * KD + e]);
        out[((size_t)i * H + h) * HD + e] = __float2bfloat16_rn(o / den);
    }
}

// ----------------------------------------------------------------------------
// variant 2: the previous production kernel. Split-K over chunks of V2_CHUNK keys; in a block
// each warp takes keys warp, warp + W, ..., V2_UNROLL at a time, one head-dim slice per lane
// (8-byte loads) and a full-warp sum per key and head; the warps merge in index order.

#define V2_CHUNK 256  // keys per split-K chunk
#define V2_WARPS 4    // warps per attention block
#define V2_UNROLL 4   // keys per warp per iteration

// EPL consecutive head-dim elements per lane (lane * EPL ...), zero past HD. vec: one 8-byte
// access per lane (EPL 4, every head 8-byte aligned: the launcher checks).
template <int EPL>
__device__ __forceinline__ void v2_load_lane(const bf16* p, int lane, int HD, int vec, float* f) {
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

// Block (row i, kv head g, chunk c): keys [c·V2_CHUNK, ...) ∩ [first, len) of row i's slot, for
// the `group` query heads of g. part_m, part_l (n, H, chunks), part_o (n, H, chunks, HD).
template <int EPL, int GM>
__global__ void v2_partial_kernel(float* __restrict__ part_m, float* __restrict__ part_l,
                                  float* __restrict__ part_o, const bf16* __restrict__ qkv,
                                  const bf16* __restrict__ kc, const bf16* __restrict__ vc,
                                  const int32_t* __restrict__ slot, const int32_t* __restrict__ len,
                                  int maxT, int H, int KVH, int HD, int window, int chunks,
                                  float scale, int vec) {
    __shared__ float s_m[V2_WARPS][DEC_MAX_GROUP], s_l[V2_WARPS][DEC_MAX_GROUP];
    extern __shared__ float s_o[];  // (V2_WARPS, group, HD)
    const int i = blockIdx.x, g = blockIdx.y, c = blockIdx.z;
    const int group = H / KVH, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int QKV = (H + 2 * KVH) * HD, KD = KVH * HD;
    const int L = len[i], first = window > 0 && L > window ? L - window : 0;
    const int j0 = max(c * V2_CHUNK, first), j1 = min((c + 1) * V2_CHUNK, L);
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
        v2_load_lane<EPL>(qkv + (size_t)i * QKV + (size_t)(g * group + h) * HD, lane, HD, vec,
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
    for (int j = j0 + warp * V2_UNROLL; j < j1; j += V2_WARPS * V2_UNROLL) {
        float k[V2_UNROLL][EPL], v[V2_UNROLL][EPL];
        const int nk = min(V2_UNROLL, j1 - j);
#pragma unroll
        for (int u = 0; u < V2_UNROLL; u++) {
            if (u < nk) {
                v2_load_lane<EPL>(kb + (size_t)(j + u) * KD, lane, HD, vec, k[u]);
                v2_load_lane<EPL>(vb + (size_t)(j + u) * KD, lane, HD, vec, v[u]);
            } else {  // past the chunk: weight 0, and 0 · v must not meet garbage (NaN)
#pragma unroll
                for (int e = 0; e < EPL; e++) k[u][e] = v[u][e] = 0.0f;
            }
        }
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= group) break;
            float s[V2_UNROLL], mx = m[h];
#pragma unroll
            for (int u = 0; u < V2_UNROLL; u++) {
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
            for (int u = 0; u < V2_UNROLL; u++) {
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
        for (int w = 0; w < V2_WARPS; w++) M = fmaxf(M, s_m[w][h]);
        float sl = 0.0f, so = 0.0f;
        for (int w = 0; w < V2_WARPS; w++) {
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
__global__ void v2_combine_kernel(bf16* __restrict__ out, const float* __restrict__ part_m,
                                  const float* __restrict__ part_l,
                                  const float* __restrict__ part_o, const bf16* __restrict__ sinks,
                                  const int32_t* __restrict__ len, int H, int HD, int chunks) {
    const int i = blockIdx.x, h = blockIdx.y;
    const int used = min(chunks, (len[i] + V2_CHUNK - 1) / V2_CHUNK);
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
static void v2_launch_partial_gm(CudaCtx* cx, float* pm, float* pl, float* po, const bf16* qkv,
                                 const bf16* kc, const bf16* vc, const int32_t* slot,
                                 const int32_t* len, int n, int maxT, int H, int KVH, int HD,
                                 int window, int chunks) {
    const dim3 grid(n, KVH, chunks);
    const size_t smem = (size_t)V2_WARPS * (H / KVH) * HD * sizeof(float);
    // 8-byte lane loads: HD a multiple of 4 (then every head and row is 8-byte aligned when the
    // buffers are)
    const int vec = HD % 4 == 0 && ((uintptr_t)qkv & 7) == 0 && ((uintptr_t)kc & 7) == 0 &&
                    ((uintptr_t)vc & 7) == 0;
    v2_partial_kernel<EPL, GM><<<grid, V2_WARPS * 32, smem, cx->stream>>>(
        pm, pl, po, qkv, kc, vc, slot, len, maxT, H, KVH, HD, window, chunks,
        1.0f / sqrtf((float)HD), vec);
    cuda_check_launch();
}

template <int EPL>
static void v2_launch_partial(CudaCtx* cx, float* pm, float* pl, float* po, const bf16* qkv,
                              const bf16* kc, const bf16* vc, const int32_t* slot,
                              const int32_t* len, int n, int maxT, int H, int KVH, int HD,
                              int window, int chunks) {
    if (H / KVH <= 2)
        v2_launch_partial_gm<EPL, 2>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD,
                                     window, chunks);
    else
        v2_launch_partial_gm<EPL, DEC_MAX_GROUP>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H,
                                                 KVH, HD, window, chunks);
}

static void v2_attention_decode(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                                const bf16* vc, const int32_t* slot, const int32_t* len,
                                const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                                int window) {
    if (n <= 0) return;
    const int chunks = (maxT + V2_CHUNK - 1) / V2_CHUNK;
    const size_t np = (size_t)n * H * chunks;
    float* pm =
        (float*)cuda_scratch(cx, SCRATCH_ATTN, (size_t)n * H * chunks * (HD + 2) * sizeof(float));
    float* pl = pm + np;
    float* po = pl + np;
    if (HD <= 32)
        v2_launch_partial<1>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                             chunks);
    else if (HD <= 64)
        v2_launch_partial<2>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                             chunks);
    else if (HD <= 128)
        v2_launch_partial<4>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                             chunks);
    else
        v2_launch_partial<8>(cx, pm, pl, po, qkv, kc, vc, slot, len, n, maxT, H, KVH, HD, window,
                             chunks);
    v2_combine_kernel<<<dim3(n, H), HD <= 128 ? 128 : 256, 0, cx->stream>>>(out, pm, pl, po, sinks,
                                                                            len, H, HD, chunks);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// variants 6-8 and 10-15: the production partials' rejected modes (kept to measure). Each takes
// the tiles of the register kernel with the same T in the same order and arithmetic, so each
// gives the bits of variant 3 or 4; production's helpers (DecPartial, the combine) are shared.

#define DEC_STAGES 4  // cp.async groups of the staged partial (at most 4: cp_async_wait)

// The same partial with the chunk's keys and values staged in shared memory first: every thread
// issues its share of the chunk's 16-byte words as cp.async in DEC_STAGES commit groups of
// consecutive keys (the whole chunk in flight at once: a memory-bound kernel needs bytes in
// flight, and registers held only a tile), then the block walks the stages as each arrives,
// every warp its tiles in the register kernel's order, from shared memory: the same arithmetic,
// so the same bits as decode_attention_partial_kernel with the same T. Needs vec (16-byte rows).
// Shared memory: K and V words (2 x chunk x HD/8 uint4), then s_o.
template <int LPK, int GM, int T>
__global__ void __launch_bounds__(DEC_WARPS * 32) decode_attention_staged_kernel(DecAttn a) {
    constexpr int KPW = 32 / LPK, TK = KPW * T;
    extern __shared__ uint4 s_kv[];
    const int i = blockIdx.x, g = blockIdx.y, c = blockIdx.z, HD = a.HD, W8 = HD / 8;
    const int group = a.H / a.KVH, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / LPK, d0 = (lane % LPK) * 8, w = lane % LPK;
    const int KD = a.KVH * HD;
    const int L = a.len[i], first = a.window > 0 && L > a.window ? L - a.window : 0;
    const int j0 = max(c * a.chunk, first), j1 = min((c + 1) * a.chunk, L);
    if (j0 >= j1) return;
    uint4* sk = s_kv;
    uint4* sv = s_kv + (size_t)a.chunk * W8;
    float* s_o = reinterpret_cast<float*>(s_kv + 2 * (size_t)a.chunk * W8);
    // stage s holds keys [j0 + s·SK, j0 + (s+1)·SK), a whole number of the block's tile rounds
    const int round = DEC_WARPS * TK, nk = j1 - j0;
    const int SK = ((a.chunk + DEC_STAGES - 1) / DEC_STAGES + round - 1) / round * round;
    const int n_stages = (nk + SK - 1) / SK;  // <= DEC_STAGES
    const size_t at = (size_t)a.slot[i] * a.maxT * KD + (size_t)g * HD;
    const bf16* kb = a.kc + at;
    const bf16* vb = a.vc + at;
    for (int s = 0; s < DEC_STAGES; s++) {
        const int k0 = s * SK, k1 = min(nk, k0 + SK);
        for (int x = k0 * W8 + threadIdx.x; x < k1 * W8; x += blockDim.x) {
            const int k = x / W8, e = x % W8;
            cp_async_16(smem_u32(sk + x), kb + (size_t)(j0 + k) * KD + 8 * e, true);
            cp_async_16(smem_u32(sv + x), vb + (size_t)(j0 + k) * KD + 8 * e, true);
        }
        cp_async_commit();  // (empty groups past the last stage: every thread commits DEC_STAGES)
    }
    DecPartial<GM> p;
    dec_partial_init(p, a, i, g, group, d0);
    for (int s = 0; s < n_stages; s++) {
        // stage s has landed when at most DEC_STAGES - 1 - s groups are pending
        switch (DEC_STAGES - 1 - s) {
            case 0: cp_async_wait<0>(); break;
            case 1: cp_async_wait<1>(); break;
            case 2: cp_async_wait<2>(); break;
            default: cp_async_wait<3>(); break;
        }
        __syncthreads();
        const int js1 = min(j1, j0 + (s + 1) * SK);
        for (int jt = j0 + s * SK + warp * TK; jt < js1; jt += round) {
            uint4 kr[T], vr[T];
#pragma unroll
            for (int t = 0; t < T; t++) {
                const int j = jt + t * KPW + sub;
                const bool in = j < j1 && d0 < HD;
                kr[t] = in ? sk[(size_t)(j - j0) * W8 + w] : make_uint4(0, 0, 0, 0);
                vr[t] = in ? sv[(size_t)(j - j0) * W8 + w] : make_uint4(0, 0, 0, 0);
            }
            dec_partial_tile<LPK, GM, T>(p, kr, vr, jt, sub, j1, group);
        }
    }
    dec_partial_store<LPK, GM>(p, a, s_o, i, g, c, group, d0);
}

// One block per (row i, kv head g) walking the row's chunks [c0, c1) in order: each chunk's tiles
// exactly as the piped kernel's block for that chunk takes them (warp w: j0 + (w + k·DEC_WARPS)·TK),
// each chunk's partial stored as there, then the block merges its group's chunks in chunk order
// with the combine kernel's arithmetic: the bits of the split grid and its combine, without the
// second launch, and without the empty blocks a grid over maxT's chunks launches for short rows
// (the grid is (n, KVH) whatever maxT). The fixed cost per layer is what a decode step at a few
// hundred keys pays; 128 rows x 8 kv heads still fill the GPU several blocks deep. Each thread's
// ring runs ahead across chunk ends (the next chunk's first tiles are in flight while this one's
// last tile is computed and its partial stored). Needs vec. Shared memory: the piped kernel's.
template <int LPK, int GM, int T, int D>
__global__ void __launch_bounds__(DEC_WARPS * 32) decode_attention_walk_kernel(DecAttn a) {
    constexpr int KPW = 32 / LPK, TK = KPW * T, NT = DEC_WARPS * 32, round = DEC_WARPS * TK;
    extern __shared__ uint4 s_ring[];  // (D, T, 2, NT)
    const int i = blockIdx.x, g = blockIdx.y, HD = a.HD, tid = threadIdx.x;
    const int group = a.H / a.KVH, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / LPK, d0 = (lane % LPK) * 8;
    const int KD = a.KVH * HD, L = a.len[i];
    int first, c0, c1;
    dec_row_chunks(a, i, &first, &c0, &c1);
    float* s_o = reinterpret_cast<float*>(s_ring + (size_t)D * T * 2 * NT);
    const size_t at = (size_t)a.slot[i] * a.maxT * KD + (size_t)g * HD;
    const bf16* kb = a.kc + at;
    const bf16* vb = a.vc + at;
    // chunk c's keys of the row: [key0(c), key1(c)) (the split kernels' j0, j1 of block c)
    auto key0 = [&](int c) { return max(c * a.chunk, first); };
    auto key1 = [&](int c) { return min((c + 1) * a.chunk, L); };
    // the copy cursor: this warp's next tile to copy, at key ijt of chunk ic (ic == c1: none)
    int ic = c0, ijt = c0 < c1 ? key0(c0) + warp * TK : 0;
    auto settle = [&]() {  // a tile past its chunk: the warp's first tile of the next chunk
        while (ic < c1 && ijt >= key1(ic)) {
            ic++;
            if (ic < c1) ijt = key0(ic) + warp * TK;
        }
    };
    auto issue = [&](int r) {  // the cursor's tile into ring slot r (zeros past its chunk)
        if (ic < c1) {
            const int j1 = key1(ic);
#pragma unroll
            for (int t = 0; t < T; t++) {
                const int j = ijt + t * KPW + sub;
                const bool in = j < j1 && d0 < HD;
                const size_t off = in ? (size_t)j * KD + d0 : 0;
                cp_async_16(smem_u32(&s_ring[((size_t)(r * T + t) * 2 + 0) * NT + tid]), kb + off,
                            in);
                cp_async_16(smem_u32(&s_ring[((size_t)(r * T + t) * 2 + 1) * NT + tid]), vb + off,
                            in);
            }
            ijt += round;
            settle();
        }
        cp_async_commit();  // (an empty group past the last tile keeps the wait counts right)
    };
    settle();
    DecPartial<GM> p;
    dec_partial_init(p, a, i, g, group, d0);
#pragma unroll
    for (int r = 0; r < D; r++) issue(r);
    int r = 0;
    for (int c = c0; c < c1; c++) {
        const int j0 = key0(c), j1 = key1(c);
#pragma unroll
        for (int h = 0; h < GM; h++) {  // a fresh partial (the query stays)
            if (h >= group) break;
#pragma unroll
            for (int e = 0; e < 8; e++) p.acc[h][e] = 0.0f;
            p.m[h] = -INFINITY;
            p.l[h] = 0.0f;
        }
        for (int jt = j0 + warp * TK; jt < j1; jt += round) {
            cp_async_wait<D - 1>();  // this tile's group (the oldest) has landed
            uint4 kr[T], vr[T];
#pragma unroll
            for (int t = 0; t < T; t++) {
                kr[t] = s_ring[((size_t)(r * T + t) * 2 + 0) * NT + tid];
                vr[t] = s_ring[((size_t)(r * T + t) * 2 + 1) * NT + tid];
            }
            dec_partial_tile<LPK, GM, T>(p, kr, vr, jt, sub, j1, group);
            issue(r);  // (after the words were used) the tile D ahead in the warp's sequence
            r = r + 1 == D ? 0 : r + 1;
        }
        dec_partial_store<LPK, GM>(p, a, s_o, i, g, c, group, d0);
        // the store's shared words are free for the next chunk's, and its partial is visible to
        // every thread of the block (the merge below)
        __syncthreads();
    }
    cp_async_wait<0>();  // (nothing lands in shared memory after the block ends)
    for (int x = tid; x < group * HD; x += NT) {
        const int h = g * group + x / HD;
        dec_combine_store(a, i, h, x % HD, c0, c1, dec_combine_max(a, i, h, c0, c1));
    }
}

// The lab's modes (the production ones, DecMode, go through attention_decode_with).
typedef enum {
    LAB_STAGED_HALF = 0,  // the chunk staged in shared memory by cp.async, T / 2
    LAB_STAGED,           // staged, T
    LAB_PIPED8_HALF,      // a ring of 8 tiles, T / 2
    LAB_PIPED4,           // a ring of 4 tiles, T
    LAB_WALK4_HALF,       // one block per (row, kv head) over its chunks, 4-tile ring, merged in
                          // the block (no combine launch), T / 2
    LAB_WALK8_HALF,       // the walk with an 8-tile ring, T / 2
    LAB_WALK4,            // the walk with a 4-tile ring, T
} LabMode;

static int lab_mode_walks(int mode) {
    return mode == LAB_WALK4_HALF || mode == LAB_WALK8_HALF || mode == LAB_WALK4;
}

static int lab_mode_half(int mode) {
    return mode == LAB_STAGED_HALF || mode == LAB_PIPED8_HALF || mode == LAB_WALK4_HALF ||
           mode == LAB_WALK8_HALF;
}

template <int LPK, int GM, int T>
static void launch_staged(CudaCtx* cx, const DecAttn& a, int n) {
    const size_t smem = 2 * (size_t)a.chunk * a.HD * sizeof(bf16) + dec_smem_bytes(a, T, 0);
    cuda_check(cudaFuncSetAttribute(decode_attention_staged_kernel<LPK, GM, T>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    decode_attention_staged_kernel<LPK, GM, T>
        <<<dim3(n, a.KVH, a.chunks), DEC_WARPS * 32, smem, cx->stream>>>(a);
    cuda_check_launch();
}

// The walk with D tiles per thread over the grid (n, KVH): the piped kernel's shared memory.
template <int LPK, int GM, int T, int D>
static void launch_walk(CudaCtx* cx, const DecAttn& a, int n) {
    const size_t smem = dec_smem_bytes(a, T, D);
    cuda_check(cudaFuncSetAttribute(decode_attention_walk_kernel<LPK, GM, T, D>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    decode_attention_walk_kernel<LPK, GM, T, D>
        <<<dim3(n, a.KVH), DEC_WARPS * 32, smem, cx->stream>>>(a);
    cuda_check_launch();
}

// The lab modes' partials (dec_dispatch's Launch): T keys per lane group as production's.
struct DecLaunchLab {
    template <int LPK, int GM, int T>
    static void run_t(CudaCtx* cx, const DecAttn& a, int n, int mode) {
        if (mode == LAB_STAGED_HALF || mode == LAB_STAGED)
            launch_staged<LPK, GM, T>(cx, a, n);
        else if (mode == LAB_PIPED8_HALF)
            launch_piped<LPK, GM, T, 8>(cx, a, n);
        else if (mode == LAB_PIPED4)
            launch_piped<LPK, GM, T, 4>(cx, a, n);
        else if (mode == LAB_WALK8_HALF)
            launch_walk<LPK, GM, T, 8>(cx, a, n);
        else
            launch_walk<LPK, GM, T, 4>(cx, a, n);
    }
    template <int LPK, int GM>
    static void run(CudaCtx* cx, const DecAttn& a, int n, int mode) {
        constexpr int T = GM >= 8 ? 2 : 4;
        if (lab_mode_half(mode))
            run_t<LPK, GM, T / 2>(cx, a, n, mode);
        else
            run_t<LPK, GM, T>(cx, a, n, mode);
    }
};

// attention_decode_with for the lab's modes. They need 16-byte rows (vec): without, production's
// register kernel with the same T (and the combine launch).
static void attention_decode_lab(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                                 const bf16* vc, const int32_t* slot, const int32_t* len,
                                 const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                                 int window, int chunk, LabMode mode) {
    if (n <= 0) return;
    if (!dec_attn_vec(qkv, kc, vc, HD)) {
        attention_decode_with(cx, out, qkv, kc, vc, slot, len, sinks, n, maxT, H, KVH, HD, window,
                              chunk, lab_mode_half(mode) ? DEC_REGS_HALF : DEC_REGS);
        return;
    }
    const DecAttn a = dec_attn_setup(cx, out, qkv, kc, vc, slot, len, sinks, n, maxT, H, KVH, HD,
                                     window, chunk);
    dec_dispatch<DecLaunchLab>(cx, a, n, mode);
    if (!lab_mode_walks(mode)) launch_combine(cx, a, n);  // (the walk merged its chunks itself)
}

static void decode_attention(int variant, CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                             const bf16* vc, const int32_t* slot, const int32_t* len,
                             const bf16* sinks, DecShape s) {
    if (variant == 1) {
        decode_attention_naive_kernel<<<dim3(s.n, s.H), 128, (size_t)s.maxT * 4, cx->stream>>>(
            out, qkv, kc, vc, slot, len, sinks, s.maxT, s.H, s.KVH, s.HD, s.window);
        cuda_check_launch();
    } else if (variant == 2) {
        v2_attention_decode(cx, out, qkv, kc, vc, slot, len, sinks, s.n, s.maxT, s.H, s.KVH, s.HD,
                            s.window);
    } else {
        const int chunk = variant == 5 || variant == 12 ? 256 : variant == 8 ? 64 : DEC_CHUNK;
        if (variant == 3 || variant == 4 || variant == 5 || variant == 9) {  // production's modes
            const DecMode mode = variant == 4   ? DEC_REGS_HALF
                                 : variant == 9 ? DEC_PIPED4_HALF
                                                : DEC_REGS;
            attention_decode_with(cx, out, qkv, kc, vc, slot, len, sinks, s.n, s.maxT, s.H,
                                  s.KVH, s.HD, s.window, chunk, mode);
        } else {  // 6-8 staged, 10-12 rings, 13-15 walks
            const LabMode mode = variant == 6 || variant == 8    ? LAB_STAGED_HALF
                                 : variant == 7                   ? LAB_STAGED
                                 : variant == 10 || variant == 12 ? LAB_PIPED8_HALF
                                 : variant == 11                  ? LAB_PIPED4
                                 : variant == 13                  ? LAB_WALK4_HALF
                                 : variant == 14                  ? LAB_WALK8_HALF
                                                                  : LAB_WALK4;
            attention_decode_lab(cx, out, qkv, kc, vc, slot, len, sinks, s.n, s.maxT, s.H, s.KVH,
                                 s.HD, s.window, chunk, mode);
        }
    }
}

// ----------------------------------------------------------------------------
// validation

static void validate_attention(Lab* lab, int v, Rng* r, DecShape s) {
    const int QKV = (s.H + 2 * s.KVH) * s.HD, KD = s.KVH * s.HD, slots = s.n + 2;
    std::vector<int32_t> slot(s.n), len(s.n);
    for (int i = 0; i < s.n; i++) {
        slot[i] = (7 * i + 3) % slots;
        len[i] = 1 + (int)rng_below(r, (uint64_t)s.maxT);
    }
    len[0] = 1;
    len[s.n - 1] = s.maxT;
    std::vector<float> qkv = rand_bf16(r, (size_t)s.n * QKV, 2.0f);
    std::vector<float> kc = rand_bf16(r, (size_t)slots * s.maxT * KD, 2.0f);
    std::vector<float> vc = rand_bf16(r, (size_t)slots * s.maxT * KD, 1.0f);
    std::vector<float> sk = rand_bf16(r, (size_t)s.H, 2.0f);
    std::vector<float> want;
    decode_attention_ref(want, qkv, kc, vc, slot, len, s.sinks ? sk.data() : NULL, s);
    bf16 *d_qkv = dev_upload_bf16(qkv), *d_kc = dev_upload_bf16(kc), *d_vc = dev_upload_bf16(vc);
    bf16* d_sk = s.sinks ? dev_upload_bf16(sk) : NULL;
    int32_t *d_slot = dev_upload(slot), *d_len = dev_upload(len);
    const size_t no = (size_t)s.n * s.H * s.HD;
    bf16* d_out = dev_alloc<bf16>(no);
    bf16* d_out2 = dev_alloc<bf16>(no);
    dev_poison(d_out, no * 2);
    decode_attention(v, lab->cx, d_out, d_qkv, d_kc, d_vc, d_slot, d_len, d_sk, s);
    decode_attention(v, lab->cx, d_out2, d_qkv, d_kc, d_vc, d_slot, d_len, d_sk, s);
    std::vector<float> got = dev_download_bf16(d_out, no), got2 = dev_download_bf16(d_out2, no);
    char what[160];
    snprintf(what, sizeof what, "v%d attention n=%d maxT=%d H=%d KVH=%d HD=%d w=%d%s", v, s.n,
             s.maxT, s.H, s.KVH, s.HD, s.window, s.sinks ? " sinks" : "");
    lab_check(lab, what, got.data(), want.data(), no, TOL_BF16);
    if (v >= 2) {
        lab_check_true(lab, "  the same bits twice",
                       memcmp(got.data(), got2.data(), no * sizeof(float)) == 0);
        // the longest row alone: the same bits as in the batch (the splits depend on positions)
        const size_t last = (size_t)(s.n - 1) * s.H * s.HD, nh = (size_t)s.H * s.HD;
        DecShape one = s;
        one.n = 1;
        decode_attention(v, lab->cx, d_out2, d_qkv + (size_t)(s.n - 1) * QKV, d_kc, d_vc,
                         d_slot + s.n - 1, d_len + s.n - 1, d_sk, one);
        std::vector<float> alone = dev_download_bf16(d_out2, nh);
        lab_check_true(lab, "  a row alone as in the batch",
                       memcmp(alone.data(), got.data() + last, nh * sizeof(float)) == 0);
    }
    if (v == 6 || v == 7 || (v >= 9 && v <= 11) || v >= 13) {  // the bits of the register twin
        const int twin_v = v == 7 || v == 11 || v == 15 ? 3 : 4;
        decode_attention(twin_v, lab->cx, d_out2, d_qkv, d_kc, d_vc, d_slot, d_len, d_sk, s);
        std::vector<float> twin = dev_download_bf16(d_out2, no);
        lab_check_true(lab, twin_v == 4 ? "  the bits of variant 4" : "  the bits of variant 3",
                       memcmp(twin.data(), got.data(), no * sizeof(float)) == 0);
    }
    void* bufs[] = {d_qkv, d_kc, d_vc, d_sk, d_slot, d_len, d_out, d_out2};
    for (void* p : bufs)
        if (p) cuda_check(cudaFree(p));
}

// The rope + append against an fp64 rotation of the bf16 inputs (no q/k norm: its roundings are
// rope.cu's lab's subject; here the position lookup and the cache writes are).
static void validate_rope_append(Lab* lab, Rng* r) {
    const int n = 5, H = 16, KVH = 8, HD = 128, maxT = 50, slots = 7, half = HD / 2;
    const int QKV = (H + 2 * KVH) * HD, QD = H * HD, KD = KVH * HD;
    std::vector<int32_t> pos = {0, 49, 13, 7, 1}, slot = {6, 0, 3, 2, 5};
    std::vector<float> x = rand_bf16(r, (size_t)n * QKV, 2.0f), cs(maxT * half), sn(maxT * half);
    for (int p = 0; p < maxT; p++)
        for (int i = 0; i < half; i++) {
            const double f = p * pow(1e6, -2.0 * i / HD);
            cs[p * half + i] = (float)cos(f);
            sn[p * half + i] = (float)sin(f);
        }
    std::vector<float> want((size_t)n * QKV), kw((size_t)slots * maxT * KD, 0.0f),
        vw((size_t)slots * maxT * KD, 0.0f);
    for (int i = 0; i < n; i++) {
        const float* in = &x[(size_t)i * QKV];
        float* o = &want[(size_t)i * QKV];
        for (int hh = 0; hh < H + KVH; hh++)
            for (int k = 0; k < half; k++) {
                const double c = bf16r(cs[pos[i] * half + k]), s = bf16r(sn[pos[i] * half + k]);
                const double x1 = in[hh * HD + k], x2 = in[hh * HD + k + half];
                o[hh * HD + k] = (float)(x1 * c - x2 * s);
                o[hh * HD + k + half] = (float)(x2 * c + x1 * s);
            }
        for (int e = QD + KD; e < QKV; e++) o[e] = in[e];
        const size_t at = ((size_t)slot[i] * maxT + pos[i]) * KD;
        for (int e = 0; e < KD; e++) {
            kw[at + e] = o[QD + e];
            vw[at + e] = o[QD + KD + e];
        }
    }
    bf16* d_x = dev_upload_bf16(x);
    float *d_cs = dev_upload(cs), *d_sn = dev_upload(sn);
    int32_t *d_pos = dev_upload(pos), *d_slot = dev_upload(slot);
    bf16* d_o = dev_alloc<bf16>((size_t)n * QKV);
    bf16* d_k = dev_alloc<bf16>((size_t)slots * maxT * KD);
    bf16* d_v = dev_alloc<bf16>((size_t)slots * maxT * KD);
    dev_zero(d_k, (size_t)slots * maxT * KD * 2);
    dev_zero(d_v, (size_t)slots * maxT * KD * 2);
    cuda_decode_rope_append(lab->cx, d_o, d_k, d_v, d_x, NULL, NULL, d_cs, d_sn, d_pos, d_slot, n,
                            maxT, H, KVH, HD, 1e-6f);
    std::vector<float> o = dev_download_bf16(d_o, (size_t)n * QKV);
    std::vector<float> k = dev_download_bf16(d_k, (size_t)slots * maxT * KD);
    std::vector<float> v = dev_download_bf16(d_v, (size_t)slots * maxT * KD);
    lab_check(lab, "rope+append rows", o.data(), want.data(), o.size(), TOL_BF16);
    lab_check(lab, "rope+append key cache", k.data(), kw.data(), k.size(), TOL_BF16);
    lab_check(lab, "rope+append value cache", v.data(), vw.data(), v.size(), TOL_EXACT);
    void* bufs[] = {d_x, d_cs, d_sn, d_pos, d_slot, d_o, d_k, d_v};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// The head kernel (production, cuda_decode_rope_append) against the row kernel bit for bit, with
// and without the q/k norm: rows, key cache and value cache.
static void validate_rope_heads_bits(Lab* lab, Rng* r, int H, int KVH, int HD, int norm) {
    const int n = 9, maxT = 64, slots = 11, half = HD / 2;
    const int QKV = (H + 2 * KVH) * HD, KD = KVH * HD;
    std::vector<int32_t> pos(n), slot(n);
    for (int i = 0; i < n; i++) {
        pos[i] = (int)(rng_uniform(r) * maxT) % maxT;
        slot[i] = (i * 7 + 3) % slots;  // distinct slots
    }
    std::vector<float> x = rand_bf16(r, (size_t)n * QKV, 3.0f), cs(maxT * half), sn(maxT * half);
    std::vector<float> qw = rand_bf16(r, HD, 0.5f), kw = rand_bf16(r, HD, 0.5f);
    for (int i = 0; i < HD; i++) {
        qw[i] = bf16r(1.0f + qw[i]);
        kw[i] = bf16r(1.0f + kw[i]);
    }
    for (int p = 0; p < maxT; p++)
        for (int i = 0; i < half; i++) {
            const double f = p * pow(1e6, -2.0 * i / HD);
            cs[p * half + i] = (float)cos(f);
            sn[p * half + i] = (float)sin(f);
        }
    bf16 *d_x = dev_upload_bf16(x), *d_qw = dev_upload_bf16(qw), *d_kw = dev_upload_bf16(kw);
    float *d_cs = dev_upload(cs), *d_sn = dev_upload(sn);
    int32_t *d_pos = dev_upload(pos), *d_slot = dev_upload(slot);
    const size_t cache = (size_t)slots * maxT * KD;
    bf16* d[2][3];  // [rows kernel, head kernel][out, k cache, v cache]
    for (int k = 0; k < 2; k++) {
        d[k][0] = dev_alloc<bf16>((size_t)n * QKV);
        d[k][1] = dev_alloc<bf16>(cache);
        d[k][2] = dev_alloc<bf16>(cache);
        dev_zero(d[k][0], (size_t)n * QKV * 2);
        dev_zero(d[k][1], cache * 2);
        dev_zero(d[k][2], cache * 2);
    }
    const bf16* w_q = norm ? d_qw : NULL;
    const bf16* w_k = norm ? d_kw : NULL;
    launch_rope_append_rows(lab->cx, d[0][0], d[0][1], d[0][2], d_x, w_q, w_k, d_cs, d_sn, d_pos,
                            d_slot, n, maxT, H, KVH, HD, 1e-6f);
    cuda_decode_rope_append(lab->cx, d[1][0], d[1][1], d[1][2], d_x, w_q, w_k, d_cs, d_sn, d_pos,
                            d_slot, n, maxT, H, KVH, HD, 1e-6f);
    const char* what[3] = {"rows", "key cache", "value cache"};
    for (int b = 0; b < 3; b++) {
        const size_t len = b == 0 ? (size_t)n * QKV : cache;
        std::vector<float> want = dev_download_bf16(d[0][b], len);
        std::vector<float> got = dev_download_bf16(d[1][b], len);
        char name[128];
        snprintf(name, sizeof name, "rope+append heads = rows bits H=%d KVH=%d HD=%d %s: %s", H,
                 KVH, HD, norm ? "q/k norm" : "no norm", what[b]);
        lab_check(lab, name, got.data(), want.data(), len, TOL_EXACT);
    }
    void* bufs[] = {d_x, d_qw, d_kw, d_cs, d_sn, d_pos, d_slot};
    for (void* p : bufs) cuda_check(cudaFree(p));
    for (int k = 0; k < 2; k++)
        for (int b = 0; b < 3; b++) cuda_check(cudaFree(d[k][b]));
}

// The sampler: greedy = the first argmax; tempered = the fp64 walk's token with the same uniform
// (rows: the previous sampler, kept in this lab; else production).
static void validate_sampler(Lab* lab, Rng* r, int V, int rows) {
    const int n = 32;
    std::vector<float> z = rand_bf16(r, (size_t)n * V, 3.0f), u(n);
    for (int i = 0; i < n; i++) u[i] = rng_uniform(r);
    bf16* d_z = dev_upload_bf16(z);
    float* d_u = dev_upload(u);
    int32_t* d_tok = dev_alloc<int32_t>(n);
    float* d_lp = dev_alloc<float>(2 * n);
    for (int greedy = 1; greedy >= 0; greedy--) {
        const float temperature = greedy ? 0.0f : 0.7f;
        if (rows)
            sample_tokens_rows(lab->cx, d_tok, d_lp, d_z, d_u, n, V, temperature);
        else
            cuda_sample_tokens(lab->cx, d_tok, d_lp, d_z, d_u, n, V, temperature);
        std::vector<int32_t> tok = dev_download(d_tok, n);
        std::vector<float> lp = dev_download(d_lp, 2 * n);
        int same = 0;
        double worst = 0.0;
        for (int i = 0; i < n; i++) {
            const float* zi = &z[(size_t)i * V];
            int best = 0;
            for (int v = 1; v < V; v++)
                if (zi[v] > zi[best]) best = v;
            int want = best;
            double lw = 0.0;
            if (!greedy) {
                double sum = 0.0;
                for (int v = 0; v < V; v++) sum += exp((zi[v] - zi[best]) / (double)temperature);
                double rr = u[i] * sum;
                for (int v = 0; v < V; v++) {
                    rr -= exp((zi[v] - zi[best]) / (double)temperature);
                    if (rr <= 0.0) {
                        want = v;
                        break;
                    }
                }
                lw = (zi[want] - zi[best]) / (double)temperature - log(sum);
                worst = std::max(worst, fabs(lp[2 * i + 1] - lw));
            }
            same += tok[i] == want;
        }
        char what[128];
        snprintf(what, sizeof what,
                 "sampler%s V=%d %s: %d of %d tokens as the fp64 walk's, logp err %.1e",
                 rows ? " (rows)" : "", V, greedy ? "greedy" : "T=0.7", same, n, worst);
        lab_check_true(lab, what, same == n && worst < 1e-4);
    }
    void* bufs[] = {d_z, d_u, d_tok, d_lp};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

// One layer of a decode step: n rows all at length L in a cache of maxT positions, every row its
// own slot.
static void bench_attention(Lab* lab, int n, int L, int maxT, int H, int KVH, int HD,
                            const char* model) {
    const int QKV = (H + 2 * KVH) * HD, KD = KVH * HD;
    CudaCtx* cx = lab->cx;
    const DecShape s = {n, maxT, H, KVH, HD, 0, 0};
    bf16* qkv = dev_random<bf16>((size_t)n * QKV, 1.0f, 1);
    bf16* kc = dev_random<bf16>((size_t)n * maxT * KD, 1.0f, 2);
    bf16* vc = dev_random<bf16>((size_t)n * maxT * KD, 1.0f, 3);
    std::vector<int32_t> slot(n), len(n, L);
    for (int i = 0; i < n; i++) slot[i] = i;
    int32_t *d_slot = dev_upload(slot), *d_len = dev_upload(len);
    bf16* out = dev_alloc<bf16>((size_t)n * H * HD);
    char shape[128];
    snprintf(shape, sizeof shape, "%s n=%d L=%d maxT=%d H=%d KVH=%d HD=%d", model, n, L, maxT, H,
             KVH, HD);
    const double bytes = 2.0 * n * L * KD * 2 + (double)n * (QKV + H * HD) * 2;
    for (int v = 1; v <= 15; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        if (v == 1 && (size_t)maxT * 4 > 48 * 1024) continue;  // the naive kernel's logits
        const double ms = lab_time_ms(lab, [&] {
            decode_attention(v, cx, out, qkv, kc, vc, d_slot, d_len, NULL, s);
        });
        lab_report_bw("decode attention", v, shape, "K and V once, q, out", bytes, ms);
    }
    void* bufs[] = {qkv, kc, vc, d_slot, d_len, out};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// The rope + append of one layer: n rows at mixed positions, each its own cache slot.
static void bench_rope_append(Lab* lab, int n, int H, int KVH, int HD) {
    const int QKV = (H + 2 * KVH) * HD, KD = KVH * HD, maxT = 512, half = HD / 2;
    CudaCtx* cx = lab->cx;
    bf16* x = dev_random<bf16>((size_t)n * QKV, 2.0f, 5);
    bf16* w = dev_random<bf16>(HD, 1.0f, 6);
    float* cs = dev_random<float>((size_t)maxT * half, 1.0f, 7);
    float* sn = dev_random<float>((size_t)maxT * half, 1.0f, 8);
    std::vector<int32_t> pos(n), slot(n);
    for (int i = 0; i < n; i++) {
        pos[i] = (i * 37) % maxT;
        slot[i] = i;
    }
    int32_t *d_pos = dev_upload(pos), *d_slot = dev_upload(slot);
    bf16* out = dev_alloc<bf16>((size_t)n * QKV);
    bf16* kc = dev_alloc<bf16>((size_t)n * maxT * KD);
    bf16* vc = dev_alloc<bf16>((size_t)n * maxT * KD);
    char shape[128];
    snprintf(shape, sizeof shape, "qwen3-1.7b n=%d H=%d KVH=%d HD=%d", n, H, KVH, HD);
    const double bytes = 2.0 * n * QKV * 2 + 2.0 * n * KD * 2;
    for (int rv = 1; rv <= 2; rv++) {  // 1: the row kernel, 2: production (head kernel)
        const double ms = lab_time_ms(lab, [&] {
            if (rv == 1)
                launch_rope_append_rows(cx, out, kc, vc, x, w, w, cs, sn, d_pos, d_slot, n, maxT,
                                        H, KVH, HD, 1e-6f);
            else
                cuda_decode_rope_append(cx, out, kc, vc, x, w, w, cs, sn, d_pos, d_slot, n, maxT,
                                        H, KVH, HD, 1e-6f);
        });
        lab_report_bw("rope+append", rv, shape, "qkv in and out, k and v to the cache", bytes, ms);
        printf("    rope+append %s: %.2f us\n", rv == 1 ? "rows (old)" : "heads (new)", ms * 1e3);
    }
    void* bufs[] = {x, w, cs, sn, d_pos, d_slot, out, kc, vc};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

static void bench(Lab* lab) {
    const int n = 128;
    CudaCtx* cx = lab->cx;
    printf("\nbenchmark (one layer of a decode step, 128 sequences; GRPO's bench: L ~ 270)\n");
    lab_bench_header_bw();
    lab_report_copy(lab, (size_t)256 << 20);
    for (int L : {16, 128, 272, 512, 1024, 4096})
        bench_attention(lab, n, L, L, 16, 8, 128, "qwen3-1.7b");
    for (int L : {16, 272, 512})  // the rollout's cache: 16 prompt + 512 generated positions
        bench_attention(lab, n, L, 528, 16, 8, 128, "qwen3-1.7b");
    bench_attention(lab, n, 1024, 1024, 32, 8, 128, "llama-8b");
    bench_attention(lab, n, 1024, 1024, 64, 8, 64, "gpt-oss-20b");
    const int V = 151936;
    bf16* z = dev_random<bf16>((size_t)n * V, 4.0f, 4);
    std::vector<float> u(n, 0.37f);
    float* d_u = dev_upload(u);
    int32_t* tok = dev_alloc<int32_t>(n);
    float* lp = dev_alloc<float>(2 * n);
    for (float temperature : {0.0f, 1.0f})
        for (int sv = 1; sv <= 2; sv++) {  // 1: the previous row sampler, 2: production
            const double ms = lab_time_ms(lab, [&] {
                if (sv == 1)
                    sample_tokens_rows(cx, tok, lp, z, d_u, n, V, temperature);
                else
                    cuda_sample_tokens(cx, tok, lp, z, d_u, n, V, temperature);
            });
            lab_report_bw(temperature > 0 ? "sampler (T=1)" : "sampler (greedy)", sv,
                          "n=128 V=151936", "logits once", (double)n * V * 2, ms);
            printf("    sampler %s %s: %.1f us\n",
                   sv == 1 ? "rows (old, fp64 terms)" : "slices (new, fp32 terms)",
                   temperature > 0 ? "T=1" : "greedy", ms * 1e3);
        }
    void* bufs[] = {z, d_u, tok, lp};
    for (void* p : bufs) cuda_check(cudaFree(p));
    bench_rope_append(lab, n, 16, 8, 128);
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: one block per (row, query head), one pass over the row's keys\n"
    "  2  the previous production: 256-key split-K chunks, 8-byte lane loads, warp sums per key\n"
    "  3  production below head dim 128 (kernels/decode.cu): 16-byte lane loads of whole key\n"
    "     rows, next tile in flight, 128-key split-K chunks, ordered combine\n"
    "  4  variant 3 with half the keys per tile (the bits of production at head dim >= 128)\n"
    "  5  variant 3 with 256-key chunks\n"
    "  6  variant 4 staged in shared memory by cp.async (bit for bit variant 4)\n"
    "  7  variant 3 staged (bit for bit variant 3)\n"
    "  8  variant 6 with 64-key chunks\n"
    "  9  variant 4 with a 4-tile cp.async ring per thread (bit for bit variant 4; production\n"
    "     at head dim >= 128)\n"
    " 10  variant 4 with an 8-tile ring (bit for bit variant 4)\n"
    " 11  variant 3 with a 4-tile ring (bit for bit variant 3)\n"
    " 12  variant 10 with 256-key chunks\n"
    " 13  one block per (row, kv head) walking its chunks with the 4-tile ring, merged in the\n"
    "     block, no combine launch (bit for bit variant 4)\n"
    " 14  variant 13 with an 8-tile ring (bit for bit variant 4)\n"
    " 15  variant 13 with full tiles (bit for bit variant 3)\n";

static void validate_variant(Lab* lab, int v, Rng* r) {
    validate_attention(lab, v, r, DecShape{9, 600, 16, 8, 128, 0, 0});    // Qwen3-1.7B
    validate_attention(lab, v, r, DecShape{6, 4096, 16, 8, 128, 0, 0});   // lengths 1 .. 4096
    validate_attention(lab, v, r, DecShape{7, 300, 8, 2, 64, 100, 1});    // group 4, window, sinks
    validate_attention(lab, v, r, DecShape{5, 1000, 64, 8, 64, 128, 1});  // GPT-OSS-20B: group 8
    validate_attention(lab, v, r, DecShape{5, 700, 32, 8, 128, 0, 0});    // LLaMA-8B: group 4
    validate_attention(lab, v, r, DecShape{4, 200, 4, 4, 256, 0, 1});     // group 1, HD 256
    validate_attention(lab, v, r, DecShape{4, 40, 4, 1, 16, 0, 0});       // test-qwen3's heads
    validate_attention(lab, v, r, DecShape{5, 70, 6, 2, 12, 0, 1});       // HD not a multiple of 4
    if (v == 3) {
        validate_rope_append(lab, r);
        validate_rope_heads_bits(lab, r, 16, 8, 128, 1);  // Qwen3-1.7B
        validate_rope_heads_bits(lab, r, 16, 8, 128, 0);  // no q/k norm (LLaMA)
        validate_rope_heads_bits(lab, r, 64, 8, 64, 0);   // GPT-OSS-20B's heads
        validate_rope_heads_bits(lab, r, 4, 1, 16, 1);    // test-qwen3's heads
        for (int rows = 0; rows <= 1; rows++) {
            validate_sampler(lab, r, 151936, rows);  // Qwen3's vocabulary
            validate_sampler(lab, r, 50000, rows);   // 16-byte loads
            validate_sampler(lab, r, 4099, rows);    // V not a multiple of 8: element by element
            validate_sampler(lab, r, 100, rows);     // fewer words than slices: empty slices
        }
    }
}

static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "decode", VARIANTS, 15, 15, validate_variant, bench_lab);
}
