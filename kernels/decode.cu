/*
 * decode.cu — the generation kernels (ops.h, generate.h): the decode step's q/k-norm + RoPE with
 * the KV-cache append, decode attention (one query row per sequence against its bf16 KV cache),
 * and the sampler (greedy or the full tempered softmax, with the log-prob of the drawn token).
 *
 * Rope + append: the math and roundings of rope.cu's forward (HF in bf16: w · bf16(x · rstd)
 * rounded, cos/sin rounded to bf16) at the row's own position pos[i]; the rotated k and the v of
 * the row go to the cache at (slot[i], pos[i]). One warp per head (q, k or v) of a row, 4 heads a
 * block, 16-byte loads (a decode step's 128 rows are 1024 blocks, not 128): each head staged
 * alone in its warp's shared memory and normed in rope.cuh qk_row_rstd's order, so the bits are
 * those of the row kernel (one block per row, the whole row staged) that remains for head dims
 * not a multiple of 8 or unaligned buffers; the lab checks the two bit for bit.
 *
 * Decode attention, split-K over the keys: the keys of a row are cut into fixed chunks of
 * DEC_CHUNK positions (a function of the position only, never of the batch or the device), one
 * block per (row, kv head, chunk) holds the H/KVH query heads of its group, so every key and
 * value is read once per group (GQA). The cache rows (slot, position, KVH·HD) put one kv head's
 * HD elements of a key contiguous: HD/8 lanes read them with one 16-byte load each, so a warp
 * load covers 256/HD whole keys (two for HD 128: two aligned 256-byte runs, every sector used).
 * Each warp walks tiles of keys with the next tiles' keys and values already in flight while the
 * current tile is computed (a memory-bound kernel needs the bytes in flight, not more warps):
 * one tile ahead in registers, or (head dim 128) four half tiles ahead in a per-thread ring in
 * shared memory filled by cp.async; an online softmax per head in fp32 in the log2 domain (q
 * pre-scaled by log2 e / sqrt(HD)); its lane groups merge by an xor butterfly, the warps in index
 * order. How the keys arrive never changes the arithmetic: the ring gives the bits of the
 * register walk with the same tile. Each chunk leaves (max, sum, unnormalised output) in fp32
 * scratch; a second kernel merges a row's chunks in chunk order, adds the sink logit, divides and
 * rounds: the same bits for the same inputs on every run, whatever else is in the batch. The
 * variants measured and rejected (the chunk staged whole in shared memory, an 8-tile ring, one
 * block per (row, kv head) walking its chunks) live in the lab, dev/cuda/decode.cu.
 *
 * Sampler: each row cut into SAMPLE_SLICES fixed slices of whole 8-token words (a function of
 * V only). Pass 1, one block per (slice, row): the slice's max m and first argmax, then (tempered)
 * its sum of expf((z - m) / temperature) in fp32 terms (the exponent the CPU walk's, divided
 * without a division; a word's 8 terms added in fp32, the words in double): a double exponential
 * per token of the vocabulary cost 75 us at 128 rows. Pass 2, one block per row: warp 0 merges
 * the slices a lane each (greedy: the first argmax), rescales each slice's sum by exp((m - max) /
 * temperature), scans them in slice order and picks the first slice whose cumulative sum
 * reaches the host's uniform draw u · Σ; the block then walks that slice at the row's max in the
 * CPU walk's terms exp((double)((z - max) / temperature)) (each thread's contiguous run of words
 * summed, a block scan in thread order, the one run where the rest falls walked token by token in
 * vocabulary order): the CPU's walk (generate.c gen_sample), so both draw the same token from the
 * same u unless two cumulative sums straddle u · Σ within the slice sums' fp32 rounding (~1e-7
 * relative). logp = (z_tok - max) · (1 / temperature) - log Σ (Σ the walk's, within ~1e-6 of the
 * CPU's log-prob normaliser). Every order is fixed by V: the same bits on every run. Rows of
 * 8-aligned width are read with 16-byte loads; the walk computes 8 terms at a time. (The sampler
 * before the slices, one block of 1024 threads per row, is the lab's row 1.)
 *
 * Every kernel here that production launches waits for the kernel before it (ptx.cuh pdl_wait)
 * before touching what that kernel writes and is launched through cuda_launch, so a recorded
 * decode step can launch it early, during the tail of the kernel before. The attention's partial
 * kernels do more before the wait: the row's length and slot are the host's (uploaded before the
 * step), and every key but the newest was written by an earlier step, so a block whose chunk
 * holds no keys ends at once and the others' first tiles of older keys are in flight while the
 * rope + append (which writes the newest key) runs (dec_early_keys; ops.h attention_decode).
 */
#include <math.h>

#include "common.cuh"
#include "decode.h"
#include "ptx.cuh"
#include "rope.cuh"

#define DEC_CHUNK 128     // keys per split-K chunk (a function of the position only)
#define DEC_WARPS 4       // warps per attention block
#define DEC_MAX_GROUP 8   // query heads per kv head held by one block
#define ROPE_APPEND_THREADS 256  // the row kernel's block
#define ROPE_HEADS 4      // heads (warps) per block of the head kernel
#define SAMPLE_THREADS 256  // per block of both sampler kernels
#define SAMPLE_SLICES 32    // blocks per row of the sampler's first pass (slices of the vocabulary)

// ----------------------------------------------------------------------------
// q/k-norm + RoPE at each row's position, k and v into the cache

// The row kernel (any head dim, any alignment; the lab's reference for the head kernel below):
// one block per row, the row's q and k heads staged in shared memory as fp32.
__global__ void decode_rope_append_kernel(bf16* __restrict__ out, bf16* __restrict__ kc,
                                          bf16* __restrict__ vc, const bf16* __restrict__ inp,
                                          const bf16* __restrict__ qw, const bf16* __restrict__ kw,
                                          const float* __restrict__ cosb,
                                          const float* __restrict__ sinb,
                                          const int32_t* __restrict__ pos,
                                          const int32_t* __restrict__ slot, int maxT, int H,
                                          int KVH, int HD, float eps) {
    pdl_wait();  // (a recorded decode step: the kernel before has finished; see ptx.cuh)
    pdl_trigger();
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

// The head kernel: one warp per head of a row (q, k or v), ROPE_HEADS heads per block, so a
// decode step's few rows still fill the GPU (128 rows of Qwen3-1.7B: 1024 blocks). A head moves
// in 16-byte words; a q or k head is staged in its warp's shared memory as fp32 and normed with
// qk_row_rstd's arithmetic (lane l sums elements l, l + 32, ... in that order, then the same
// butterfly) and rotated by qk_row_rope_pair itself: the row kernel's bits. Needs HD % 8 == 0 and
// 16-byte aligned buffers.
__global__ void __launch_bounds__(ROPE_HEADS * 32)
    decode_rope_append_heads_kernel(bf16* __restrict__ out, bf16* __restrict__ kc,
                                    bf16* __restrict__ vc, const bf16* __restrict__ inp,
                                    const bf16* __restrict__ qw, const bf16* __restrict__ kw,
                                    const float* __restrict__ cosb,
                                    const float* __restrict__ sinb,
                                    const int32_t* __restrict__ pos,
                                    const int32_t* __restrict__ slot, int maxT, int H, int KVH,
                                    int HD, float eps) {
    pdl_wait();
    pdl_trigger();
    extern __shared__ float sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hh = blockIdx.x * ROPE_HEADS + warp, row = blockIdx.y;
    const int heads = H + KVH, KD = KVH * HD, QKV = heads * HD + KD, half = HD / 2, words = HD / 8;
    if (hh >= heads + KVH) return;  // (no barrier below spans the block)
    const int t = pos[row];
    const bf16* in = inp + (size_t)row * QKV + (size_t)hh * HD;
    bf16* o = out + (size_t)row * QKV + (size_t)hh * HD;
    const size_t cache_row = ((size_t)slot[row] * maxT + t) * KD;
    if (hh >= heads) {  // a v head: copied to the row and the cache
        bf16* vd = vc + cache_row + (size_t)(hh - heads) * HD;
        for (int k = lane; k < words; k += 32) {
            const uint4 w = *reinterpret_cast<const uint4*>(in + 8 * k);
            *reinterpret_cast<uint4*>(o + 8 * k) = w;
            *reinterpret_cast<uint4*>(vd + 8 * k) = w;
        }
        return;
    }
    float* sx = sm + (size_t)warp * HD;  // (HD) this head, fp32
    for (int k = lane; k < words; k += 32) {
        const uint4 u = *reinterpret_cast<const uint4*>(in + 8 * k);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 f = __bfloat1622float2(h2[e]);
            sx[8 * k + 2 * e] = f.x;
            sx[8 * k + 2 * e + 1] = f.y;
        }
    }
    __syncwarp();
    const bf16* w = hh < H ? qw : kw;
    float rs = 0.0f;
    if (w) {  // qk_row_rstd's expression for one head
        float ss = 0.0f;
        for (int i = lane; i < HD; i += 32) ss += sx[i] * sx[i];
        ss = warp_sum(ss);
        rs = 1.0f / sqrtf(ss / (float)HD + eps);
    }
    const float *cost = cosb + (size_t)t * half, *sint = sinb + (size_t)t * half;
    bf16* kd = hh >= H ? kc + cache_row + (size_t)(hh - H) * HD : NULL;
    // lane pairs (2p, 2p + half) and (2p + 1, 2p + 1 + half): 4-byte stores, a warp's contiguous
    for (int p = lane; p < half / 2; p += 32) {
        bf16 a1, a2, b1, b2;
        qk_row_rope_pair(sx, &rs, w, w, cost, sint, 1, HD, 0, 2 * p, &a1, &a2);
        qk_row_rope_pair(sx, &rs, w, w, cost, sint, 1, HD, 0, 2 * p + 1, &b1, &b2);
        const __nv_bfloat162 lo = __halves2bfloat162(a1, b1), hi = __halves2bfloat162(a2, b2);
        *reinterpret_cast<__nv_bfloat162*>(o + 2 * p) = lo;
        *reinterpret_cast<__nv_bfloat162*>(o + half + 2 * p) = hi;
        if (kd) {
            *reinterpret_cast<__nv_bfloat162*>(kd + 2 * p) = lo;
            *reinterpret_cast<__nv_bfloat162*>(kd + half + 2 * p) = hi;
        }
    }
}

// The row kernel's launch (the fallback, and the lab's reference).
static void launch_rope_append_rows(CudaCtx* cx, bf16* out, bf16* kc, bf16* vc, const bf16* inp,
                                    const bf16* q_norm_w, const bf16* k_norm_w, const float* cos,
                                    const float* sin, const int32_t* pos, const int32_t* slot,
                                    int n, int maxT, int H, int KVH, int HD, float eps) {
    const size_t smem = ((size_t)(H + KVH) * HD + (H + KVH)) * sizeof(float);
    if (smem > 48 * 1024)
        fatal("decode rope: %d heads of %d need %zu bytes of shared memory", H + KVH, HD, smem);
    cuda_launch(cx, decode_rope_append_kernel, dim3(n), dim3(ROPE_APPEND_THREADS), smem, out, kc,
                vc, inp, q_norm_w, k_norm_w, cos, sin, pos, slot, maxT, H, KVH, HD, eps);
}

void cuda_decode_rope_append(CudaCtx* cx, bf16* out, bf16* kc, bf16* vc, const bf16* inp,
                             const bf16* q_norm_w, const bf16* k_norm_w, const float* cos,
                             const float* sin, const int32_t* pos, const int32_t* slot, int n,
                             int maxT, int H, int KVH, int HD, float eps) {
    if (n <= 0) return;
    const int vec = HD % 8 == 0 && is_aligned16(out) && is_aligned16(kc) && is_aligned16(vc) &&
                    is_aligned16(inp);
    const size_t smem = (size_t)ROPE_HEADS * HD * sizeof(float);
    if (!vec || smem > 48 * 1024) {
        launch_rope_append_rows(cx, out, kc, vc, inp, q_norm_w, k_norm_w, cos, sin, pos, slot, n,
                                maxT, H, KVH, HD, eps);
        return;
    }
    const dim3 grid((unsigned)((H + 2 * KVH + ROPE_HEADS - 1) / ROPE_HEADS), (unsigned)n);
    cuda_launch(cx, decode_rope_append_heads_kernel, grid, dim3(ROPE_HEADS * 32), smem, out, kc,
                vc, inp, q_norm_w, k_norm_w, cos, sin, pos, slot, maxT, H, KVH, HD, eps);
}

// ----------------------------------------------------------------------------
// decode attention: split-K partials, then the ordered combine

// The launch's shape and buffers (one struct: the kernels take it by value).
typedef struct DecAttn {
    float* part_m;    // (n, H, chunks) running max of each partial, log2 units
    float* part_l;    // (n, H, chunks) its sum of weights
    float* part_o;    // (n, H, chunks, HD) its unnormalised output
    const bf16* qkv;  // (n, QKV) post-RoPE q, k, v of each row
    const bf16* kc;   // (slots, maxT, KVH*HD)
    const bf16* vc;
    const int32_t* slot;  // (n)
    const int32_t* len;   // (n) keys of each row (its position + 1)
    bf16* out;            // (n, H*HD) the attention of each row (the combine writes it)
    const bf16* sinks;    // (H) sink logits or NULL
    int maxT, H, KVH, HD, window, chunk, chunks;
    float qscale;  // log2(e) / sqrt(HD): the logits in log2 units
    int vec;       // HD a multiple of 8 and every buffer 16-byte aligned
} DecAttn;

// 8 consecutive head-dim elements d0 .. d0+7 of a bf16 row as one 16-byte word, zeros past HD
// (vec: one access; else element by element).
__device__ __forceinline__ uint4 dec_load8(const bf16* p, int d0, int HD, int vec) {
    if (vec) return d0 < HD ? *reinterpret_cast<const uint4*>(p + d0) : make_uint4(0, 0, 0, 0);
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const bf16 zero = __float2bfloat16_rn(0.0f);
        const int a = d0 + 2 * k;
        const __nv_bfloat162 pair =
            __halves2bfloat162(a < HD ? p[a] : zero, a + 1 < HD ? p[a + 1] : zero);
        w[k] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void dec_unpack8(uint4 u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x;
        f[2 * k + 1] = t.y;
    }
}

// The per-block state of a partial: the group's query heads (pre-scaled), each lane group's online
// softmax (max and sum in log2 units) and unnormalised output, for its 8 head-dim elements.
template <int GM>
struct DecPartial {
    float q[GM][8], acc[GM][8], m[GM], l[GM];
};

// Start: query heads g·group .. of row i, scaled; no key yet.
template <int GM>
__device__ __forceinline__ void dec_partial_init(DecPartial<GM>& p, const DecAttn& a, int i,
                                                 int g, int group, int d0) {
    const int QKV = (a.H + 2 * a.KVH) * a.HD;
#pragma unroll
    for (int h = 0; h < GM; h++) {
        if (h >= group) break;
        const bf16* qh = a.qkv + (size_t)i * QKV + (size_t)(g * group + h) * a.HD;
        dec_unpack8(dec_load8(qh, d0, a.HD, a.vec), p.q[h]);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            p.q[h][e] *= a.qscale;
            p.acc[h][e] = 0.0f;
        }
        p.m[h] = -INFINITY;
        p.l[h] = 0.0f;
    }
}

// One tile: T keys per lane group, key t of this lane group at position jt + t·KPW + sub (its k
// and v words kr[t], vr[t]: zeros past j1). The logits by a dot product over the LPK lanes of a
// key, the online softmax, the weighted values.
template <int LPK, int GM, int T>
__device__ __forceinline__ void dec_partial_tile(DecPartial<GM>& p, const uint4 (&kr)[T],
                                                 const uint4 (&vr)[T], int jt, int sub, int j1,
                                                 int group) {
    constexpr int KPW = 32 / LPK;
    float s[T][GM];  // logits, then weights (0 past the chunk: its k and v are zeros)
#pragma unroll
    for (int t = 0; t < T; t++) {
        float kf[8];
        dec_unpack8(kr[t], kf);
        const int valid = jt + t * KPW + sub < j1;
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= group) break;
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) d = fmaf(p.q[h][e], kf[e], d);
#pragma unroll
            for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            s[t][h] = valid ? d : -INFINITY;
        }
    }
#pragma unroll
    for (int h = 0; h < GM; h++) {
        if (h >= group) break;
        float mx = p.m[h];
#pragma unroll
        for (int t = 0; t < T; t++) mx = fmaxf(mx, s[t][h]);
        const float base = mx == -INFINITY ? 0.0f : mx;  // no key yet: every weight 0
        const float corr = exp2f(p.m[h] - base);
        p.l[h] *= corr;
#pragma unroll
        for (int e = 0; e < 8; e++) p.acc[h][e] *= corr;
        p.m[h] = mx;
#pragma unroll
        for (int t = 0; t < T; t++) s[t][h] = exp2f(s[t][h] - base);
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
        float vf[8];
        dec_unpack8(vr[t], vf);
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= group) break;
            p.l[h] += s[t][h];
#pragma unroll
            for (int e = 0; e < 8; e++) p.acc[h][e] = fmaf(s[t][h], vf[e], p.acc[h][e]);
        }
    }
}

// The end of a block: the warp's lane groups merged by an xor butterfly (the lanes of key group 0
// are read), then the warps in index order through shared memory (s_o: DEC_WARPS x group x HD
// floats), into the chunk's partial.
template <int LPK, int GM>
__device__ __forceinline__ void dec_partial_store(DecPartial<GM>& p, const DecAttn& a, float* s_o,
                                                  int i, int g, int c, int group, int d0) {
    __shared__ float s_m[DEC_WARPS][GM], s_l[DEC_WARPS][GM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / LPK, HD = a.HD;
#pragma unroll
    for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= group) break;
            const float mo = __shfl_xor_sync(0xffffffffu, p.m[h], o);
            const float lo = __shfl_xor_sync(0xffffffffu, p.l[h], o);
            const float M = fmaxf(p.m[h], mo);
            const float fa = p.m[h] == -INFINITY ? 0.0f : exp2f(p.m[h] - M);
            const float fb = mo == -INFINITY ? 0.0f : exp2f(mo - M);
            p.l[h] = p.l[h] * fa + lo * fb;
#pragma unroll
            for (int e = 0; e < 8; e++)
                p.acc[h][e] = p.acc[h][e] * fa + __shfl_xor_sync(0xffffffffu, p.acc[h][e], o) * fb;
            p.m[h] = M;
        }
    }
    if (sub == 0) {
#pragma unroll
        for (int h = 0; h < GM; h++) {
            if (h >= group) break;
            if (lane == 0) {
                s_m[warp][h] = p.m[h];
                s_l[warp][h] = p.l[h];
            }
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (d0 + e < HD) s_o[((size_t)warp * group + h) * HD + d0 + e] = p.acc[h][e];
        }
    }
    __syncthreads();
    const size_t pbase = ((size_t)i * a.H + (size_t)g * group) * a.chunks + c;  // head h0, chunk c
    for (int x = threadIdx.x; x < group * HD; x += blockDim.x) {
        const int h = x / HD, d = x % HD;
        float M = -INFINITY;
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, s_m[w][h]);
        float sl = 0.0f, so = 0.0f;
        for (int w = 0; w < DEC_WARPS; w++) {
            const float f = s_m[w][h] == -INFINITY ? 0.0f : exp2f(s_m[w][h] - M);
            sl += s_l[w][h] * f;
            so += s_o[((size_t)w * group + h) * HD + d] * f;
        }
        const size_t pi = pbase + (size_t)h * a.chunks;
        a.part_o[pi * HD + d] = so;
        if (d == 0) {
            a.part_m[pi] = M;
            a.part_l[pi] = sl;
        }
    }
}

// Whether a warp's tile of keys jt .. jt + TK - 1 (those below j1) holds only keys older than the
// row's newest, L - 1: keys that earlier decode steps (or the prefill) wrote, so the tile may be
// loaded before pdl_wait (ptx.cuh's rule: the kernel before, the step's rope + append, writes
// key L - 1 only). The row's length, slot and chunk bounds come from the host's upload before
// the step, so a block also finds out before the wait whether its chunk holds keys at all: the
// empty blocks of short rows end at once, and the first keys are in flight while the rope runs.
__device__ __forceinline__ bool dec_early_keys(int jt, int TK, int j1, int L) {
    return min(jt + TK, j1) <= L - 1;
}

// Block (row i, kv head g, chunk c): keys [c·chunk, (c+1)·chunk) ∩ [first, len) of row i's slot
// for the `group` query heads of g (group <= GM). LPK lanes hold one key (8 head-dim elements
// each), so a warp load covers KPW = 32/LPK whole keys; warp w takes tiles of TK = T·KPW keys at
// j0 + (w + k·DEC_WARPS)·TK, the next tile's loads issued before the current tile's math. Each
// group of LPK lanes keeps its own online softmax; the warp merges them by an xor butterfly, the
// block its warps in index order, into the chunk's partial.
template <int LPK, int GM, int T>
__global__ void __launch_bounds__(DEC_WARPS * 32) decode_attention_partial_kernel(DecAttn a) {
    constexpr int KPW = 32 / LPK, TK = KPW * T;
    extern __shared__ float s_o[];  // (DEC_WARPS, group, HD)
    const int i = blockIdx.x, g = blockIdx.y, c = blockIdx.z, HD = a.HD;
    const int group = a.H / a.KVH, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / LPK, d0 = (lane % LPK) * 8;  // key within a warp load, its elements
    const int KD = a.KVH * HD;
    // before pdl_wait: the host's lengths and slots, and keys older than the newest (see
    // dec_early_keys)
    const int L = a.len[i], first = a.window > 0 && L > a.window ? L - a.window : 0;
    const int j0 = max(c * a.chunk, first), j1 = min((c + 1) * a.chunk, L);
    if (j0 >= j1) return;  // the combine reads only the chunks holding keys of the row
    const size_t at = (size_t)a.slot[i] * a.maxT * KD + (size_t)g * HD;
    const bf16* kb = a.kc + at;
    const bf16* vb = a.vc + at;
    uint4 kr[T], vr[T];  // the tile being computed
    int jt = j0 + warp * TK;
    auto load_first = [&]() {
#pragma unroll
        for (int t = 0; t < T; t++) {
            const int j = jt + t * KPW + sub;
            kr[t] = j < j1 ? dec_load8(kb + (size_t)j * KD, d0, HD, a.vec) : make_uint4(0, 0, 0, 0);
            vr[t] = j < j1 ? dec_load8(vb + (size_t)j * KD, d0, HD, a.vec) : make_uint4(0, 0, 0, 0);
        }
    };
    const bool early = dec_early_keys(jt, TK, j1, L);
    if (early) load_first();
    pdl_wait();
    pdl_trigger();
    DecPartial<GM> p;
    dec_partial_init(p, a, i, g, group, d0);
    if (!early) load_first();
    for (; jt < j1; jt += DEC_WARPS * TK) {
        uint4 kn[T], vn[T];  // the next tile, in flight during this one's math
        const int jn = jt + DEC_WARPS * TK;
#pragma unroll
        for (int t = 0; t < T; t++) {
            const int j = jn + t * KPW + sub;
            kn[t] = j < j1 ? dec_load8(kb + (size_t)j * KD, d0, HD, a.vec) : make_uint4(0, 0, 0, 0);
            vn[t] = j < j1 ? dec_load8(vb + (size_t)j * KD, d0, HD, a.vec) : make_uint4(0, 0, 0, 0);
        }
        dec_partial_tile<LPK, GM, T>(p, kr, vr, jt, sub, j1, group);
#pragma unroll
        for (int t = 0; t < T; t++) {
            kr[t] = kn[t];
            vr[t] = vn[t];
        }
    }
    dec_partial_store<LPK, GM>(p, a, s_o, i, g, c, group, d0);
}

// The chunks of row i holding its keys: [c0, c1) (first: the window's first key).
__device__ __forceinline__ void dec_row_chunks(const DecAttn& a, int i, int* first, int* c0,
                                               int* c1) {
    const int L = a.len[i];
    *first = a.window > 0 && L > a.window ? L - a.window : 0;
    *c0 = *first / a.chunk;
    *c1 = min(a.chunks, (L + a.chunk - 1) / a.chunk);
}

// Query head h of row i: the max over its chunks' partials [c0, c1) and the sink (log2 units).
__device__ __forceinline__ float dec_combine_max(const DecAttn& a, int i, int h, int c0, int c1) {
    const float LOG2E = 1.4426950408889634f;
    const size_t pb = ((size_t)i * a.H + h) * a.chunks;
    float M = a.sinks ? __bfloat162float(a.sinks[h]) * LOG2E : -INFINITY;
    for (int c = c0; c < c1; c++) M = fmaxf(M, a.part_m[pb + c]);
    return M;
}

// Element d of query head h of row i: its chunks merged in chunk order under the max M, the sink
// added, o / Σ rounded (the combine kernel's arithmetic; the lab's walk variants end with it).
__device__ __forceinline__ void dec_combine_store(const DecAttn& a, int i, int h, int d, int c0,
                                                  int c1, float M) {
    const float LOG2E = 1.4426950408889634f;
    const size_t pb = ((size_t)i * a.H + h) * a.chunks;
    const float sink = a.sinks ? __bfloat162float(a.sinks[h]) * LOG2E : -INFINITY;
    float den = a.sinks ? exp2f(sink - M) : 0.0f, o = 0.0f;
    for (int c = c0; c < c1; c++) {
        const float mc = a.part_m[pb + c];
        if (mc == -INFINITY) continue;  // (every chunk read holds keys: only NaN inputs)
        const float f = exp2f(mc - M);
        den += a.part_l[pb + c] * f;
        o += a.part_o[(pb + c) * a.HD + d] * f;
    }
    a.out[((size_t)i * a.H + h) * a.HD + d] = __float2bfloat16_rn(den > 0.0f ? o / den : 0.0f);
}

// Block (row i, head h): the chunks holding keys of the row merged in order, the sink logit
// added, out = o / Σ.
__global__ void decode_attention_combine_kernel(DecAttn a) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x, h = blockIdx.y;
    int first, c0, c1;
    dec_row_chunks(a, i, &first, &c0, &c1);
    const float M = dec_combine_max(a, i, h, c0, c1);
    for (int d = threadIdx.x; d < a.HD; d += blockDim.x) dec_combine_store(a, i, h, d, c0, c1, M);
}

// The register kernel's tiles with a deeper pipeline in shared memory: each thread copies its own
// 16-byte words of the next D tiles (its key's k and v for each of the T keys it holds) into a
// ring of its own with cp.async (zero-filled past the chunk), so D tiles per warp are in flight
// without the registers to hold them; the words come back to the thread that copied them (no
// barrier). The tiles, their order and the arithmetic are the register kernel's with the same T:
// the same bits. Needs vec. Shared memory: D x T x 2 x blockDim.x words, then s_o.
template <int LPK, int GM, int T, int D>
__global__ void __launch_bounds__(DEC_WARPS * 32) decode_attention_piped_kernel(DecAttn a) {
    constexpr int KPW = 32 / LPK, TK = KPW * T, NT = DEC_WARPS * 32;
    extern __shared__ uint4 s_ring[];  // (D, T, 2, NT)
    const int i = blockIdx.x, g = blockIdx.y, c = blockIdx.z, HD = a.HD, tid = threadIdx.x;
    const int group = a.H / a.KVH, lane = tid & 31, warp = tid >> 5;
    const int sub = lane / LPK, d0 = (lane % LPK) * 8;
    const int KD = a.KVH * HD;
    const int L = a.len[i], first = a.window > 0 && L > a.window ? L - a.window : 0;
    const int j0 = max(c * a.chunk, first), j1 = min((c + 1) * a.chunk, L);
    if (j0 >= j1) return;
    float* s_o = reinterpret_cast<float*>(s_ring + (size_t)D * T * 2 * NT);
    const size_t at = (size_t)a.slot[i] * a.maxT * KD + (size_t)g * HD;
    const bf16* kb = a.kc + at;
    const bf16* vb = a.vc + at;
    constexpr int round = DEC_WARPS * TK;
    // tile jt into ring slot r: one commit group per tile (empty words past the chunk)
    auto issue = [&](int jt, int r) {
#pragma unroll
        for (int t = 0; t < T; t++) {
            const int j = jt + t * KPW + sub;
            const bool in = j < j1 && d0 < HD;
            const size_t off = in ? (size_t)j * KD + d0 : 0;
            cp_async_16(smem_u32(&s_ring[((size_t)(r * T + t) * 2 + 0) * NT + tid]), kb + off, in);
            cp_async_16(smem_u32(&s_ring[((size_t)(r * T + t) * 2 + 1) * NT + tid]), vb + off, in);
        }
        cp_async_commit();
    };
    // the ring's first tiles: those of older keys only before pdl_wait (dec_early_keys), in
    // ring order (a thread's commit groups stay in tile order)
    const int jt0 = j0 + warp * TK;
    int early = 0;
    while (early < D && dec_early_keys(jt0 + early * round, TK, j1, L)) {
        issue(jt0 + early * round, early);
        early++;
    }
    pdl_wait();
    pdl_trigger();
    DecPartial<GM> p;
    dec_partial_init(p, a, i, g, group, d0);
    for (int r = early; r < D; r++) issue(jt0 + r * round, r);
    int r = 0;
    for (int jt = jt0; jt < j1; jt += round) {
        cp_async_wait<D - 1>();  // this tile's group (the oldest) has landed
        uint4 kr[T], vr[T];
#pragma unroll
        for (int t = 0; t < T; t++) {
            kr[t] = s_ring[((size_t)(r * T + t) * 2 + 0) * NT + tid];
            vr[t] = s_ring[((size_t)(r * T + t) * 2 + 1) * NT + tid];
        }
        dec_partial_tile<LPK, GM, T>(p, kr, vr, jt, sub, j1, group);
        issue(jt + D * round, r);  // (after the words were used) the tile D rounds ahead
        r = r + 1 == D ? 0 : r + 1;
    }
    cp_async_wait<0>();  // (nothing lands in shared memory after the block ends)
    dec_partial_store<LPK, GM>(p, a, s_o, i, g, c, group, d0);
}

// How the partial kernel gets its keys (cuda_attention_decode picks one; the lab times them and
// its own rejected modes).
typedef enum {
    DEC_REGS = 0,     // registers, the next tile in flight; T keys per lane group
    DEC_REGS_HALF,    // the same with T / 2 (fewer registers, more warps per SM)
    DEC_PIPED4_HALF,  // a ring of 4 tiles per thread in shared memory (cp.async), T / 2
} DecMode;

// HD a multiple of 8 and every buffer 16-byte aligned: the ring kernels' 16-byte copies.
static int dec_attn_vec(const bf16* qkv, const bf16* kc, const bf16* vc, int HD) {
    return HD % 8 == 0 && is_aligned16(qkv) && is_aligned16(kc) && is_aligned16(vc);
}

static size_t attention_decode_scratch(int n, int maxT, int H, int HD, int chunk) {
    const size_t chunks = (size_t)(maxT + chunk - 1) / chunk;
    return (size_t)n * H * chunks * (HD + 2) * sizeof(float);
}

size_t cuda_attention_decode_scratch_bytes(int n, int maxT, int H, int HD) {
    return attention_decode_scratch(n, maxT, H, HD, DEC_CHUNK);
}

int cuda_attention_decode_supports(int H, int KVH, int HD) {
    return KVH > 0 && H % KVH == 0 && H / KVH <= DEC_MAX_GROUP && HD <= 256;
}

// The launch struct of one call with chunks of `chunk` keys (production: DEC_CHUNK), its partials
// in the SCRATCH_ATTN scratch.
static DecAttn dec_attn_setup(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                              const bf16* vc, const int32_t* slot, const int32_t* len,
                              const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                              int window, int chunk) {
    if (!cuda_attention_decode_supports(H, KVH, HD))
        fatal("decode attention: %d query heads over %d kv heads of dim %d is not supported "
              "(at most %d query heads per kv head, head dim <= 256)", H, KVH, HD, DEC_MAX_GROUP);
    DecAttn a;
    a.chunk = chunk;
    a.chunks = (maxT + chunk - 1) / chunk;
    const size_t np = (size_t)n * H * a.chunks;
    a.part_m = (float*)cuda_scratch(cx, SCRATCH_ATTN,
                                    attention_decode_scratch(n, maxT, H, HD, chunk));
    a.part_l = a.part_m + np;
    a.part_o = a.part_l + np;
    a.qkv = qkv;
    a.kc = kc;
    a.vc = vc;
    a.slot = slot;
    a.len = len;
    a.maxT = maxT;
    a.H = H;
    a.KVH = KVH;
    a.HD = HD;
    a.window = window;
    a.qscale = 1.4426950408889634f / sqrtf((float)HD);
    a.out = out;
    a.sinks = sinks;
    a.vec = dec_attn_vec(qkv, kc, vc, HD);
    return a;
}

// Shared memory of a block: s_o (DEC_WARPS x group x HD floats) for the partial's store, after a
// ring of D tiles of T keys per thread (k and v words) for the ring kernels (D = 0: none).
static size_t dec_smem_bytes(const DecAttn& a, int T, int D) {
    return (size_t)D * T * 2 * DEC_WARPS * 32 * sizeof(uint4) +
           (size_t)DEC_WARPS * (a.H / a.KVH) * a.HD * sizeof(float);
}

// The register kernel over the split grid (n, KVH, chunks).
template <int LPK, int GM, int T>
static void launch_regs(CudaCtx* cx, const DecAttn& a, int n) {
    cuda_launch(cx, decode_attention_partial_kernel<LPK, GM, T>, dim3(n, a.KVH, a.chunks),
                dim3(DEC_WARPS * 32), dec_smem_bytes(a, T, 0), a);
}

// The ring kernel with D tiles per thread over the split grid (production: D = 4).
template <int LPK, int GM, int T, int D>
static void launch_piped(CudaCtx* cx, const DecAttn& a, int n) {
    const size_t smem = dec_smem_bytes(a, T, D);
    cuda_check(cudaFuncSetAttribute(decode_attention_piped_kernel<LPK, GM, T, D>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cuda_launch(cx, decode_attention_piped_kernel<LPK, GM, T, D>, dim3(n, a.KVH, a.chunks),
                dim3(DEC_WARPS * 32), smem, a);
}

// The production modes' partials for lane groups of LPK lanes and GM heads held per block: T keys
// per lane group per tile (GM = 8 heads: 2, for registers); the half modes: half that.
struct DecLaunchModes {
    template <int LPK, int GM>
    static void run(CudaCtx* cx, const DecAttn& a, int n, int mode) {
        constexpr int T = GM >= 8 ? 2 : 4;
        if (mode == DEC_PIPED4_HALF)
            launch_piped<LPK, GM, T / 2, 4>(cx, a, n);
        else if (mode == DEC_REGS_HALF)
            launch_regs<LPK, GM, T / 2>(cx, a, n);
        else
            launch_regs<LPK, GM, T>(cx, a, n);
    }
};

// Launch::run<LPK, GM>(cx, a, n, mode) instantiated for the call's head dim (LPK = HD/8 lanes per
// key, rounded up to a power of two) and query group (GM heads held, at least the group); the lab
// passes its own Launch for its modes.
template <class Launch, int LPK>
static void dec_dispatch_group(CudaCtx* cx, const DecAttn& a, int n, int mode) {
    const int group = a.H / a.KVH;
    if (group <= 2)
        Launch::template run<LPK, 2>(cx, a, n, mode);
    else if (group <= 4)
        Launch::template run<LPK, 4>(cx, a, n, mode);
    else
        Launch::template run<LPK, DEC_MAX_GROUP>(cx, a, n, mode);
}

template <class Launch>
static void dec_dispatch(CudaCtx* cx, const DecAttn& a, int n, int mode) {
    if (a.HD <= 16)
        dec_dispatch_group<Launch, 2>(cx, a, n, mode);
    else if (a.HD <= 32)
        dec_dispatch_group<Launch, 4>(cx, a, n, mode);
    else if (a.HD <= 64)
        dec_dispatch_group<Launch, 8>(cx, a, n, mode);
    else if (a.HD <= 128)
        dec_dispatch_group<Launch, 16>(cx, a, n, mode);
    else
        dec_dispatch_group<Launch, 32>(cx, a, n, mode);
}

// The combine of every row's chunks, after the partials.
static void launch_combine(CudaCtx* cx, const DecAttn& a, int n) {
    cuda_launch(cx, decode_attention_combine_kernel, dim3(n, a.H), dim3(a.HD <= 128 ? 128 : 256), 0,
                a);
}

// The attention with a given chunk length and mode (the production's: DEC_CHUNK and the mode
// cuda_attention_decode picks; the lab measures the others). The ring needs 16-byte rows (vec):
// without, the register kernel with the same T.
static void attention_decode_with(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                                  const bf16* vc, const int32_t* slot, const int32_t* len,
                                  const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                                  int window, int chunk, DecMode mode) {
    if (n <= 0) return;
    const DecAttn a = dec_attn_setup(cx, out, qkv, kc, vc, slot, len, sinks, n, maxT, H, KVH, HD,
                                     window, chunk);
    if (!a.vec && mode == DEC_PIPED4_HALF) mode = DEC_REGS_HALF;
    dec_dispatch<DecLaunchModes>(cx, a, n, mode);
    launch_combine(cx, a, n);
}

void cuda_attention_decode(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                           const bf16* vc, const int32_t* slot, const int32_t* len,
                           const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                           int window) {
    // head dim 128: half tiles with the 4-tile ring (the lab's variant 9, the bits of variant 4;
    // on the H200 Qwen3-1.7B at 272 cached keys 62 us a layer against 65 for variant 4, 75 for
    // full tiles and 64 for the walk of variant 13, which is slower averaged over a 512-token
    // rollout; LLaMA-8B at 1024 274 against 276 and 438). Head dim 64: full tiles in registers
    // (variant 3: GPT-OSS-20B at 1024 451 us against 492-501 for 4 and 9).
    attention_decode_with(cx, out, qkv, kc, vc, slot, len, sinks, n, maxT, H, KVH, HD, window,
                          DEC_CHUNK, HD >= 128 ? DEC_PIPED4_HALF : DEC_REGS);
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

// The 8 logits of word k of row z (vec: one 16-byte load; else element by element, -inf past V).
__device__ __forceinline__ void sample_load8(const bf16* z, int k, int V, int vec, float* f) {
    if (vec) {
        dec_unpack8(*reinterpret_cast<const uint4*>(z + 8 * k), f);
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) f[e] = 8 * k + e < V ? __bfloat162float(z[8 * k + e]) : -INFINITY;
}

// The inverse-CDF walk's 8 terms of word k: exp((z - max) / temperature) in double, the CPU
// sampler's arithmetic (generate.c gen_sample).
__device__ __forceinline__ void sample_walk_terms(const bf16* z, int k, int V, int vec, float mx,
                                                  float temperature, double* t) {
    float f[8];
    sample_load8(z, k, V, vec, f);
#pragma unroll
    for (int e = 0; e < 8; e++) t[e] = exp((double)((f[e] - mx) / temperature));
}

// Row i: tokens[i] drawn with the uniform u[i]; logp[2i] its log-prob under the distribution it
// was drawn from, logp[2i + 1] under the full tempered softmax (the same here: no truncation).
// A row is cut into SAMPLE_SLICES slices of whole 8-token words (their bounds a function of V
// only); one block per (slice, row) leaves its slice's SamplePart, then one block per row merges
// them (one lane per slice, in a fixed order) and walks.
typedef struct SamplePart {
    double sum;  // Σ expf((z - m) / temperature) over the slice (fp32 terms, summed in double)
    float m;     // the slice's max (-inf: an empty slice)
    int idx;     // the first index holding it (V: none)
} SamplePart;

// Words [*w0, *w1) of slice s of a row of `words` 8-token words.
__device__ __forceinline__ void sample_slice(int words, int s, int* w0, int* w1) {
    const int per = (words + SAMPLE_SLICES - 1) / SAMPLE_SLICES;
    *w0 = min(words, s * per);
    *w1 = min(words, *w0 + per);
}

// Block-wide (value, first index) max; every thread gets it. s_v, s_i: 32 entries.
__device__ __forceinline__ void sample_block_argmax(float& bv, int& bi, float* s_v, int* s_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
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
}

// The CPU walk's exponent fl(d / temperature) without a division: q0 = d · inv, then one fma
// correction. With inv the correctly rounded 1 / temperature, the corrected quotient is the
// correctly rounded one (Markstein; no over- or underflow at logit scales), so the bits of the
// IEEE division (a division costs a reciprocal on the special-function unit and a slow-path
// check per token: the unit that also computes the exponential).
__device__ __forceinline__ float sample_scaled(float d, float temperature, float inv) {
    const float q = d * inv;
    return fmaf(fmaf(-q, temperature, d), inv, q);
}

// Pass 1 of slice blockIdx.x of row blockIdx.y: its max and first argmax (words strided over the
// block, several 16-byte loads in flight), then (tempered) Σ expf((z - m) / temperature) at that
// max m: fp32 terms (the double exponential of every token of the vocabulary was the whole cost
// of the tempered path), each word's 8 summed in fp32 and the words in double.
// vec: V a multiple of 8 and logits 16-byte aligned.
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_slices_kernel(SamplePart* __restrict__ part, const bf16* __restrict__ logits, int V,
                         float temperature, int vec) {
    pdl_wait();
    pdl_trigger();
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    __shared__ double s_d[32];
    const int s = blockIdx.x, row = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n_warps = blockDim.x >> 5;
    const bf16* z = logits + (size_t)row * V;
    int w0, w1;
    sample_slice((V + 7) / 8, s, &w0, &w1);
    float bv = -INFINITY;
    int bi = V;
#pragma unroll 4
    for (int k = w0 + tid; k < w1; k += blockDim.x) {
        float f[8];
        sample_load8(z, k, V, vec, f);
#pragma unroll
        for (int e = 0; e < 8; e++) argmax_merge(bv, bi, f[e], 8 * k + e);
    }
    sample_block_argmax(bv, bi, s_v, s_i);
    SamplePart* out = part + (size_t)row * SAMPLE_SLICES + s;
    if (temperature <= 0.0f || bi >= V) {  // greedy, an empty slice or one of NaNs: no sum
        if (tid == 0) *out = SamplePart{0.0, bv, bi};
        return;
    }
    const float mx = bv, inv = 1.0f / temperature;
    double sum = 0.0;
#pragma unroll 2
    for (int k = w0 + tid; k < w1; k += blockDim.x) {  // (the slice is in L1/L2 by now)
        float f[8];
        sample_load8(z, k, V, vec, f);
        float word = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float d = f[e] - mx;  // -inf past V and for -inf logits: a zero term
            const float t = expf(sample_scaled(d, temperature, inv));
            word += d > -INFINITY ? t : 0.0f;
        }
        sum += (double)word;
    }
    sum = warp_sum_f64(sum);
    if (lane == 0) s_d[warp] = sum;
    __syncthreads();
    if (tid == 0) {
        sum = 0.0;
        for (int w = 0; w < n_warps; w++) sum += s_d[w];
        *out = SamplePart{sum, bv, bi};
    }
}

// Pass 2, one block per row. Warp 0, a lane per slice: the row's max and first argmax (a
// butterfly: max value, then lowest index, whatever the order), each slice's sum rescaled to the
// row's max, their inclusive scan in slice order (a fixed tree), and the first slice whose
// cumulative sum reaches u · Σ. Then the block walks that slice at the row's max in the CPU's
// terms exp((double)((z - max) / temperature)): each thread's contiguous run of words summed, a
// block scan in thread order, and the one run where the rest of u · Σ falls walked token by token.
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_pick_kernel(int32_t* __restrict__ tokens, float* __restrict__ logp,
                       const SamplePart* __restrict__ part, const bf16* __restrict__ logits,
                       const float* __restrict__ u, int V, float temperature, int vec) {
    static_assert(SAMPLE_SLICES == 32, "the pick kernel merges the slices a lane each");
    pdl_wait();
    pdl_trigger();
    __shared__ double s_d[32];
    __shared__ double s_r, s_total;  // the rest of u · Σ past the picked slice's start; Σ
    __shared__ float s_mx;
    __shared__ int s_bi, s_pick, s_slice;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int words = (V + 7) / 8;
    const bf16* z = logits + (size_t)row * V;
    if (temperature <= 0.0f && warp != 0) return;  // greedy: warp 0's argmax is the token
    if (warp == 0) {
        const SamplePart p = part[(size_t)row * SAMPLE_SLICES + lane];
        float mx = p.m;
        int bi = p.idx;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v2 = __shfl_xor_sync(0xffffffffu, mx, o);
            const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
            argmax_merge(mx, bi, v2, i2);
        }
        if (bi >= V) bi = 0;  // a row of NaNs: token 0, as the CPU's scan
        if (temperature <= 0.0f) {  // greedy: a point mass
            if (lane == 0) {
                tokens[row] = bi;
                logp[2 * row] = logp[2 * row + 1] = 0.0f;
            }
            return;
        }
        // empty (or NaN) slices: no mass, never picked
        const double c = p.idx < V ? p.sum * exp((double)((p.m - mx) / temperature)) : 0.0;
        double incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        const double total = __shfl_sync(0xffffffffu, incl, 31);
        const double r = (double)u[row] * total;
        const unsigned hit = __ballot_sync(0xffffffffu, p.idx < V && incl >= r);
        const int pick = hit ? __ffs(hit) - 1 : -1;
        const double before = __shfl_sync(0xffffffffu, incl - c, pick >= 0 ? pick : 0);
        if (lane == 0) {
            s_mx = mx;
            s_bi = bi;
            s_slice = pick;
            s_r = r - before;
            s_total = total;
            s_pick = 0x7fffffff;
        }
    }
    __syncthreads();
    const float mx = s_mx, inv = 1.0f / temperature;
    const int pick = s_slice;
    int tok = s_bi;  // r beyond every sum (rounding): the CPU keeps the argmax too
    if (pick >= 0) {
        int sw0, sw1;
        sample_slice(words, pick, &sw0, &sw1);
        const int per = (sw1 - sw0 + blockDim.x - 1) / blockDim.x;
        const int w0 = min(sw1, sw0 + tid * per), w1 = min(sw1, w0 + per);
        const int v0 = 8 * w0, v1 = min(V, 8 * w1);
        double run = 0.0;
        for (int k = w0; k < w1; k++) {
            double t[8];
            sample_walk_terms(z, k, V, vec, mx, temperature, t);
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (8 * k + e < V) run += t[e];
        }
        // inclusive scan of `run` over the threads: in the warp, then the warps' totals in order
        double incl = run;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        if (lane == 31) s_d[warp] = incl;
        __syncthreads();
        double ahead = 0.0;
        for (int w = 0; w < warp; w++) ahead += s_d[w];
        incl += ahead;
        const double rs = s_r, excl = incl - run;
        if (v1 > v0 && incl >= rs) atomicMin(&s_pick, tid);  // an integer minimum: order-free
        __syncthreads();
        // rs beyond the slice's walk (rounding between the rescaled and the walked sums): the
        // slice's last token, as a walk that runs out
        if (s_pick == 0x7fffffff) {
            if (tid != 0) return;
            tok = min(V, 8 * sw1) - 1;
        } else {
            if (tid != s_pick) return;
            double rr = rs - excl;
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
    } else if (tid != 0) {
        return;
    }
    tokens[row] = tok;
    // the token's tempered logit in the CPU's arithmetic, less the log of the walk's Σ (its fp32
    // terms differ from the CPU's log-prob terms by rounding: ~1e-6 relative)
    const float lp = (float)((double)((__bfloat162float(z[tok]) - mx) * inv) - log(s_total));
    logp[2 * row] = lp;
    logp[2 * row + 1] = lp;
}

static size_t sample_scratch_bytes(int n) {
    return (size_t)n * SAMPLE_SLICES * sizeof(SamplePart);
}

void cuda_sample_tokens(CudaCtx* cx, int32_t* tokens, float* logp, const bf16* logits,
                        const float* u, int n, int V, float temperature) {
    if (n <= 0) return;
    const int vec = V % 8 == 0 && is_aligned16(logits);
    // the attention's workspace: free once its combine is enqueued (stream order)
    SamplePart* part =
        (SamplePart*)cuda_scratch(cx, SCRATCH_ATTN, sample_scratch_bytes(n));
    cuda_launch(cx, sample_slices_kernel, dim3(SAMPLE_SLICES, n), dim3(SAMPLE_THREADS), 0, part,
                logits, V, temperature, vec);
    cuda_launch(cx, sample_pick_kernel, dim3(n), dim3(SAMPLE_THREADS), 0, tokens, logp, part,
                logits, u, V, temperature, vec);
}
