/*
 * ops_cpu_attention.c — the CPU backend's attention ops (ops.h): qk-norm + RoPE on packed qkv
 * rows, causal grouped-query attention (flash-style blocks through the GEMM micro-kernel, with a
 * branch-free exp compiled per SIMD level like the kernel), and GPT-OSS attention with learned
 * sinks and sliding windows (a plain row-by-row reference: the models that need it are small on
 * the CPU). Forward and backward of each; the determinism rules of ops_cpu.c hold here too. It
 * uses only the core (ops_cpu_core.c, through ops_cpu_core.h); the table in ops_cpu.c points
 * at its ops.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu_core.h"

// ----------------------------------------------------------------------------
// QK-norm + RoPE on packed qkv rows

typedef struct RopeArgs {
    float* out;            // (N, QKV) forward output / backward dinp
    float* rstd;           // (N, H + KVH) forward: saved norm rstd, may be NULL
    const float* inp;      // (N, QKV)
    const float* dout;     // (N, QKV) backward
    const float* crstd;    // (N, H + KVH) backward
    const float* q_norm_w; // (HD) or NULL
    const float* k_norm_w; // (HD) or NULL
    const float* cos;      // (T, HD/2)
    const float* sin;      // (T, HD/2)
    float* dw_partial;     // (n_tasks, 2, HD) backward: per-task q/k norm weight gradients
    int N, T, H, KVH, HD, rows_per_task;
    float eps;
} RopeArgs;

static void rope_forward_task(void* arg, int64_t task) {
    const RopeArgs* r = arg;
    int HD = r->HD, half = HD / 2, heads = r->H + r->KVH, QKV = (r->H + 2 * r->KVH) * HD;
    float* xn = malloc_check((size_t)HD * sizeof(float));  // normed head
    int n0 = (int)task * r->rows_per_task, n1 = imin(r->N, n0 + r->rows_per_task);
    for (int n = n0; n < n1; n++) {
        const float* cs = r->cos + (size_t)(n % r->T) * half;
        const float* sn = r->sin + (size_t)(n % r->T) * half;
        const float* row = r->inp + (size_t)n * QKV;
        float* orow = r->out + (size_t)n * QKV;
        for (int hh = 0; hh < heads; hh++) {
            const float* x = row + (size_t)hh * HD;
            const float* w = hh < r->H ? r->q_norm_w : r->k_norm_w;
            if (w) {
                double ss = 0.0;
                for (int i = 0; i < HD; i++) ss += (double)x[i] * x[i];
                float rs = (float)(1.0 / sqrt(ss / HD + r->eps));
                if (r->rstd) r->rstd[(size_t)n * heads + hh] = rs;
                for (int i = 0; i < HD; i++) xn[i] = w[i] * (x[i] * rs);
                x = xn;
            }
            float* y = orow + (size_t)hh * HD;
            for (int i = 0; i < half; i++) {
                y[i] = x[i] * cs[i] - x[i + half] * sn[i];
                y[i + half] = x[i + half] * cs[i] + x[i] * sn[i];
            }
        }
        memcpy(orow + (size_t)heads * HD, row + (size_t)heads * HD,
               (size_t)r->KVH * HD * sizeof(float));
    }
    free(xn);
}

void ops_cpu_qknorm_rope_forward(void* ctx, void* out, float* rstd, const void* inp,
                                 const void* q_norm_w, const void* k_norm_w, const float* cos,
                                 const float* sin, int B, int T, int H, int KVH, int HD,
                                 float eps) {
    RopeArgs r = {.out = out, .rstd = rstd, .inp = inp, .q_norm_w = q_norm_w,
                  .k_norm_w = k_norm_w, .cos = cos, .sin = sin, .N = B * T, .T = T, .H = H,
                  .KVH = KVH, .HD = HD, .eps = eps,
                  .rows_per_task = rows_per_task((size_t)(H + 2 * KVH) * HD)};
    cpu_run(ctx, task_count(r.N, r.rows_per_task), rope_forward_task, &r);
}

static void rope_backward_task(void* arg, int64_t task) {
    const RopeArgs* r = arg;
    int HD = r->HD, half = HD / 2, heads = r->H + r->KVH, QKV = (r->H + 2 * r->KVH) * HD;
    float* dy = malloc_check((size_t)HD * sizeof(float));  // gradient before the rotation
    float* dwq = r->dw_partial + (size_t)task * 2 * HD;
    float* dwk = dwq + HD;
    for (int i = 0; i < 2 * HD; i++) dwq[i] = 0.0f;
    int n0 = (int)task * r->rows_per_task, n1 = imin(r->N, n0 + r->rows_per_task);
    for (int n = n0; n < n1; n++) {
        const float* cs = r->cos + (size_t)(n % r->T) * half;
        const float* sn = r->sin + (size_t)(n % r->T) * half;
        const float* drow = r->dout + (size_t)n * QKV;
        float* dxrow = r->out + (size_t)n * QKV;
        for (int hh = 0; hh < heads; hh++) {
            const float* g = drow + (size_t)hh * HD;
            for (int i = 0; i < half; i++) {  // rotation by -φ
                dy[i] = g[i] * cs[i] + g[i + half] * sn[i];
                dy[i + half] = g[i + half] * cs[i] - g[i] * sn[i];
            }
            float* dx = dxrow + (size_t)hh * HD;
            const float* w = hh < r->H ? r->q_norm_w : r->k_norm_w;
            if (!w) {
                memcpy(dx, dy, (size_t)HD * sizeof(float));
                continue;
            }
            const float* x = r->inp + (size_t)n * QKV + (size_t)hh * HD;
            float rs = r->crstd[(size_t)n * heads + hh];
            float* dw = hh < r->H ? dwq : dwk;
            double dot = 0.0;
            for (int i = 0; i < HD; i++) dot += (double)(dy[i] * w[i]) * (double)(x[i] * rs);
            float mean = (float)(dot / HD);
            for (int i = 0; i < HD; i++) {
                float xh = x[i] * rs;
                dx[i] = rs * (dy[i] * w[i] - xh * mean);
                dw[i] += dy[i] * xh;
            }
        }
        memcpy(dxrow + (size_t)heads * HD, drow + (size_t)heads * HD,
               (size_t)r->KVH * HD * sizeof(float));
    }
    free(dy);
}

void ops_cpu_qknorm_rope_backward(void* ctx, void* dinp, float* dq_norm_w, float* dk_norm_w,
                                  const void* dout, const void* inp, const void* q_norm_w,
                                  const void* k_norm_w, const float* rstd, const float* cos,
                                  const float* sin, int B, int T, int H, int KVH, int HD) {
    RopeArgs r = {.out = dinp, .inp = inp, .dout = dout, .crstd = rstd, .q_norm_w = q_norm_w,
                  .k_norm_w = k_norm_w, .cos = cos, .sin = sin, .N = B * T, .T = T, .H = H,
                  .KVH = KVH, .HD = HD,
                  .rows_per_task = rows_per_task((size_t)(H + 2 * KVH) * HD)};
    int64_t n_tasks = task_count(r.N, r.rows_per_task);
    r.dw_partial = malloc_check((size_t)(n_tasks > 0 ? n_tasks : 1) * 2 * HD * sizeof(float));
    cpu_run(ctx, n_tasks, rope_backward_task, &r);
    // Ordered reduction of the per-task partials: the same sum order for any thread count.
    float* dws[2] = {q_norm_w ? dq_norm_w : NULL, k_norm_w ? dk_norm_w : NULL};
    for (int which = 0; which < 2; which++) {
        if (!dws[which]) continue;
        for (int i = 0; i < HD; i++) {
            float s = 0.0f;
            for (int64_t tk = 0; tk < n_tasks; tk++)
                s += r.dw_partial[(size_t)tk * 2 * HD + which * HD + i];
            dws[which][i] += s;
        }
    }
    free(r.dw_partial);
}

// ----------------------------------------------------------------------------
// causal grouped-query attention
//
// Flash-style blocks of ATT_BLOCK query rows x ATT_BLOCK keys; every product goes through the GEMM
// micro-kernel on packed panels. K and V are indexed per kv head (query head h reads kv head
// h / (H/KVH)), never repeated per head. Each call first packs the panels that many tasks share
// (Kᵀ and V of every key block, and in the backward also Qᵀ, dOᵀ, Q and dO of every query block);
// probabilities and dS are written by the softmax loops straight into A-panel layout.
// A logit is always Σ_d q_d k_d with d = 0 .. HD-1 in the kernel's order (a product commutes, so
// K·Qᵀ gives the same bits as Q·Kᵀ): the forward and both backward passes see the same logits.

#define ATT_BLOCK GEMM_NR  // query rows and keys per block (a block of keys is one B panel)

// A panel (K, MR) from up to MR rows of K contiguous floats (row stride ld); missing rows are 0.
static void pack_a_panel(float* dst, const float* src, size_t ld, int rows, int K) {
    if (rows < GEMM_MR) memset(dst, 0, (size_t)K * GEMM_MR * sizeof(float));
    for (int i = 0; i < rows; i++)
        for (int k = 0; k < K; k++) dst[(size_t)k * GEMM_MR + i] = src[(size_t)i * ld + k];
}

// B panel (K, NR) whose column j is row j of src (K contiguous floats, row stride ld).
static void pack_b_panel_t(float* dst, const float* src, size_t ld, int rows, int K) {
    memset(dst, 0, (size_t)K * GEMM_NR * sizeof(float));
    for (int j = 0; j < rows; j++)
        for (int k = 0; k < K; k++) dst[(size_t)k * GEMM_NR + j] = src[(size_t)j * ld + k];
}

// B panels (n_panels, K, NR) of the matrix whose k-th row is src row k (width floats, stride
// ld); rows >= `rows` and columns >= width are 0.
static void pack_b_panels(float* dst, const float* src, size_t ld, int rows, int K, int width,
                          int n_panels) {
    memset(dst, 0, (size_t)n_panels * K * GEMM_NR * sizeof(float));
    for (int p = 0; p < n_panels; p++) {
        int cols = imin(GEMM_NR, width - p * GEMM_NR);
        for (int k = 0; k < rows; k++)
            memcpy(dst + ((size_t)p * K + k) * GEMM_NR, src + (size_t)k * ld + p * GEMM_NR,
                   (size_t)cols * sizeof(float));
    }
}

// c (a_panels*MR, ldc) (+)= A panels (kc each) · B panels (kc each).
static void gemm_panels(GemmKernel kernel, int a_panels, int b_panels, int kc, const float* a,
                        const float* b, float* c, int ldc, int load_c) {
    for (int p = 0; p < a_panels; p++)
        for (int q = 0; q < b_panels; q++)
            kernel(kc, a + (size_t)p * kc * GEMM_MR, b + (size_t)q * kc * GEMM_NR,
                   c + (size_t)p * GEMM_MR * ldc + (size_t)q * GEMM_NR, ldc, load_c);
}

// Element (row r, k) of A panels with kc = ATT_BLOCK: where the softmax loops write P and dS.
static size_t att_a_index(int r, int k) {
    return ((size_t)(r / GEMM_MR) * ATT_BLOCK + k) * GEMM_MR + r % GEMM_MR;
}

// cond ? a : b on the bits: unlike a float select it cannot trap, so loops using it vectorise.
static inline float select_bits(int cond, float a, float b) {
    int32_t ia, ib, mask = -cond;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    int32_t r = (ia & mask) | (ib & ~mask);
    float f;
    memcpy(&f, &r, sizeof f);
    return f;
}

// exp(x) to about 1 ulp (Cephes expf): x = n ln2 + r, exp(r) by a polynomial, 2^n through the
// exponent bits. Branch-free plain arithmetic, so the loops below vectorise (libm's expf does not)
// and every clone gives the same bits. x is clamped to [-87.33, 88]: below that (and NaN) gives
// about 1e-38 instead of 0, which no softmax sum notices.
static inline float exp_approx(float x) {
    x = select_bits(!__builtin_isgreaterequal(x, -87.33654f), -87.33654f, x);
    x = select_bits(__builtin_isgreater(x, 88.0f), 88.0f, x);
    float fx = x * 1.44269504088896341f + 0.5f;
    int32_t n = (int32_t)fx;
    n -= __builtin_isgreater((float)n, fx);  // floor
    float nf = (float)n;
    float r = x - nf * 0.693359375f;  // ln2 in two parts: nf * 0.693359375 is exact
    r = r + nf * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    int32_t bits = (n + 127) << 23;  // n in [-126, 127]
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

// One row of probabilities, and optionally of dS, over the entries first <= i < m (0 elsewhere,
// up to ATT_BLOCK): x[i] = P = exp(x[i] * scale - shift[i]), then ds[i] = P (ds[i] - dsum[i]).
// Compiled once per ISA below (picked at ops_cpu_create like the GEMM kernel; no ifunc, which
// ThreadSanitizer builds cannot start with). Plain arithmetic, so all variants give the same bits.
static inline __attribute__((always_inline)) void att_row_body(float* x, float* ds, int first,
                                                               int m, float scale,
                                                               const float* shift,
                                                               const float* dsum) {
    for (int i = 0; i < first; i++) x[i] = 0.0f;
    for (int i = first; i < m; i++) x[i] = exp_approx(x[i] * scale - shift[i]);
    for (int i = m; i < ATT_BLOCK; i++) x[i] = 0.0f;
    if (!ds) return;
    for (int i = 0; i < first; i++) ds[i] = 0.0f;
    for (int i = first; i < m; i++) ds[i] = x[i] * (ds[i] - dsum[i]);
    for (int i = m; i < ATT_BLOCK; i++) ds[i] = 0.0f;
}

__attribute__((target("avx512f"))) static void att_row_avx512(float* x, float* ds, int first,
                                                               int m, float scale,
                                                               const float* shift,
                                                               const float* dsum) {
    att_row_body(x, ds, first, m, scale, shift, dsum);
}

__attribute__((target("avx2"))) static void att_row_avx2(float* x, float* ds, int first, int m,
                                                         float scale, const float* shift,
                                                         const float* dsum) {
    att_row_body(x, ds, first, m, scale, shift, dsum);
}

static void att_row_portable(float* x, float* ds, int first, int m, float scale,
                             const float* shift, const float* dsum) {
    att_row_body(x, ds, first, m, scale, shift, dsum);
}

AttRowFn ops_cpu_att_row_pick(int simd_level) {
    return simd_level == 2 ? att_row_avx512 : simd_level == 1 ? att_row_avx2 : att_row_portable;
}

typedef struct AttnArgs {
    float* out;          // (N, H*HD) forward output
    float* lse;          // (B, H, T) forward
    float* dqkv;         // (N, QKV) backward
    float* dsum;         // (B, H, T) backward: D = rowsum(dO ∘ O), written by the dq pass
    const float* qkv;    // (N, QKV)
    const float* dout;   // (N, H*HD)
    const float* cout;   // (N, H*HD) saved forward output
    const float* clse;   // (B, H, T)
    // Shared packed panels, one set per (b, head, block); NULL when the call does not need them.
    float *kt, *vt;      // (B, KVH, blocks, HD, AB) Kᵀ, Vᵀ
    float *kr, *vr;      // (B, KVH, blocks, HDp/NR, AB, NR) K, V rows
    float *qt, *dot;     // (B, H, blocks, HD, AB) Qᵀ, dOᵀ
    float *qr, *dor;     // (B, H, blocks, HDp/NR, AB, NR) Q, dO rows
    GemmKernel kernel;
    AttRowFn row;
    int B, T, H, KVH, HD, QKV, blocks;
    int HDp;             // HD rounded up to whole B panels
    float scale;         // 1/sqrt(HD)
} AttnArgs;

static const float* attn_q(const AttnArgs* a, int b, int t, int h) {
    return a->qkv + (size_t)(b * a->T + t) * a->QKV + (size_t)h * a->HD;
}
static const float* attn_k(const AttnArgs* a, int b, int t, int g) {
    return a->qkv + (size_t)(b * a->T + t) * a->QKV + (size_t)(a->H + g) * a->HD;
}
static const float* attn_v(const AttnArgs* a, int b, int t, int g) {
    return a->qkv + (size_t)(b * a->T + t) * a->QKV + (size_t)(a->H + a->KVH + g) * a->HD;
}
static size_t attn_o_offset(const AttnArgs* a, int b, int t, int h) {
    return (size_t)(b * a->T + t) * a->H * a->HD + (size_t)h * a->HD;
}
// Offsets of the shared panels of block blk of head `head` (of n_heads) in batch row b.
static size_t attn_t_offset(const AttnArgs* a, int b, int head, int n_heads, int blk) {
    return (((size_t)b * n_heads + head) * a->blocks + blk) * a->HD * ATT_BLOCK;
}
static size_t attn_r_offset(const AttnArgs* a, int b, int head, int n_heads, int blk) {
    return (((size_t)b * n_heads + head) * a->blocks + blk) * ATT_BLOCK * a->HDp;
}

// Task = (b, kv head g, key block): the shared K/V panels that are wanted.
static void attention_pack_kv_task(void* arg, int64_t task) {
    const AttnArgs* a = arg;
    int blk = (int)(task % a->blocks), g = (int)(task / a->blocks % a->KVH);
    int b = (int)(task / a->blocks / a->KVH), j0 = blk * ATT_BLOCK;
    int rows = imin(ATT_BLOCK, a->T - j0), panels = a->HDp / GEMM_NR;
    size_t ot = attn_t_offset(a, b, g, a->KVH, blk), orr = attn_r_offset(a, b, g, a->KVH, blk);
    if (a->kt) pack_b_panel_t(a->kt + ot, attn_k(a, b, j0, g), a->QKV, rows, a->HD);
    if (a->vt) pack_b_panel_t(a->vt + ot, attn_v(a, b, j0, g), a->QKV, rows, a->HD);
    if (a->kr)
        pack_b_panels(a->kr + orr, attn_k(a, b, j0, g), a->QKV, rows, ATT_BLOCK, a->HD, panels);
    if (a->vr)
        pack_b_panels(a->vr + orr, attn_v(a, b, j0, g), a->QKV, rows, ATT_BLOCK, a->HD, panels);
}

// Task = (b, query head h, query block): Q and dO panels for the dk/dv pass.
static void attention_pack_q_task(void* arg, int64_t task) {
    const AttnArgs* a = arg;
    int blk = (int)(task % a->blocks), h = (int)(task / a->blocks % a->H);
    int b = (int)(task / a->blocks / a->H), t0 = blk * ATT_BLOCK;
    int rows = imin(ATT_BLOCK, a->T - t0), panels = a->HDp / GEMM_NR;
    size_t ot = attn_t_offset(a, b, h, a->H, blk), orr = attn_r_offset(a, b, h, a->H, blk);
    const float* dO = a->dout + attn_o_offset(a, b, t0, h);
    size_t ld_o = (size_t)a->H * a->HD;
    pack_b_panel_t(a->qt + ot, attn_q(a, b, t0, h), a->QKV, rows, a->HD);
    pack_b_panel_t(a->dot + ot, dO, ld_o, rows, a->HD);
    pack_b_panels(a->qr + orr, attn_q(a, b, t0, h), a->QKV, rows, ATT_BLOCK, a->HD, panels);
    pack_b_panels(a->dor + orr, dO, ld_o, rows, ATT_BLOCK, a->HD, panels);
}

// Task = (b, h, block of query rows), heaviest (last) blocks first. Online softmax over the key
// blocks: running max m and sum l per row; the output accumulator is rescaled by exp(m_old - m).
static void attention_forward_task(void* arg, int64_t task) {
    const AttnArgs* a = arg;
    const int AB = ATT_BLOCK, HD = a->HD, HDp = a->HDp, vpanels = HDp / GEMM_NR;
    int blk = a->blocks - 1 - (int)(task % a->blocks), h = (int)(task / a->blocks % a->H);
    int b = (int)(task / a->blocks / a->H), g = h / (a->H / a->KVH);
    int t0 = blk * AB, m = imin(AB, a->T - t0), qpanels = (m + GEMM_MR - 1) / GEMM_MR;
    float* buf = aligned_alloc_check(((size_t)AB * HD + 2 * AB * AB + AB * HDp) * sizeof(float));
    float* qp = buf;                    // (AB/MR, HD, MR) queries as A panels
    float* s = qp + (size_t)AB * HD;    // (AB, AB) logits
    float* pp = s + (size_t)AB * AB;    // (AB/MR, AB, MR) probabilities as A panels
    float* o = pp + (size_t)AB * AB;    // (AB, HDp) unnormalised output
    float mrow[ATT_BLOCK];
    double lrow[ATT_BLOCK];
    for (int p = 0; p < qpanels; p++)
        pack_a_panel(qp + (size_t)p * HD * GEMM_MR, attn_q(a, b, t0 + p * GEMM_MR, h), a->QKV,
                     imin(GEMM_MR, m - p * GEMM_MR), HD);
    memset(o, 0, (size_t)AB * HDp * sizeof(float));
    memset(pp, 0, (size_t)AB * AB * sizeof(float));  // rows >= m stay 0
    for (int i = 0; i < AB; i++) mrow[i] = -INFINITY, lrow[i] = 0.0;
    for (int j0 = 0, jb = 0; j0 < t0 + m; j0 += AB, jb++) {
        int kb = imin(AB, t0 + m - j0);
        gemm_panels(a->kernel, qpanels, 1, HD, qp, a->kt + attn_t_offset(a, b, g, a->KVH, jb), s,
                    AB, 0);
        for (int i = 0; i < m; i++) {
            float* row = s + (size_t)i * AB;
            int nv = imin(kb, t0 + i - j0 + 1);  // causal: keys j <= t (>= 1: blocks are aligned)
            float mx = mrow[i];
            for (int jj = 0; jj < nv; jj++) mx = row[jj] * a->scale > mx ? row[jj] * a->scale : mx;
            float alpha = expf(mrow[i] - mx);  // 0 on the first block (m_old = -inf)
            float shift[ATT_BLOCK];
            for (int jj = 0; jj < nv; jj++) shift[jj] = mx;
            a->row(row, NULL, 0, nv, a->scale, shift, NULL);
            double sum = 0.0;
            for (int jj = 0; jj < AB; jj++) {
                pp[att_a_index(i, jj)] = row[jj];
                sum += row[jj];
            }
            lrow[i] = lrow[i] * alpha + sum;
            mrow[i] = mx;
            for (int d = 0; d < HD; d++) o[(size_t)i * HDp + d] *= alpha;
        }
        gemm_panels(a->kernel, qpanels, vpanels, AB, pp,
                    a->vr + attn_r_offset(a, b, g, a->KVH, jb), o, HDp, 1);
    }
    for (int i = 0; i < m; i++) {
        float inv = (float)(1.0 / lrow[i]);
        float* dst = a->out + attn_o_offset(a, b, t0 + i, h);
        for (int d = 0; d < HD; d++) dst[d] = o[(size_t)i * HDp + d] * inv;
        a->lse[((size_t)b * a->H + h) * a->T + t0 + i] = mrow[i] + (float)log(lrow[i]);
    }
    free(buf);
}

// Scratch of the shared panels; the pointers it sets must be freed by attention_free_panels.
static void attention_alloc_panels(AttnArgs* a, int backward) {
    size_t kv_t = (size_t)a->B * a->KVH * a->blocks * a->HD * ATT_BLOCK;
    size_t kv_r = (size_t)a->B * a->KVH * a->blocks * ATT_BLOCK * a->HDp;
    size_t q_t = (size_t)a->B * a->H * a->blocks * a->HD * ATT_BLOCK;
    size_t q_r = (size_t)a->B * a->H * a->blocks * ATT_BLOCK * a->HDp;
    a->kt = aligned_alloc_check(kv_t * sizeof(float));
    if (!backward) {
        a->vr = aligned_alloc_check(kv_r * sizeof(float));
        return;
    }
    a->vt = aligned_alloc_check(kv_t * sizeof(float));
    a->kr = aligned_alloc_check(kv_r * sizeof(float));
    a->qt = aligned_alloc_check(q_t * sizeof(float));
    a->dot = aligned_alloc_check(q_t * sizeof(float));
    a->qr = aligned_alloc_check(q_r * sizeof(float));
    a->dor = aligned_alloc_check(q_r * sizeof(float));
}

static void attention_free_panels(AttnArgs* a) {
    free(a->kt), free(a->vt), free(a->kr), free(a->vr);
    free(a->qt), free(a->dot), free(a->qr), free(a->dor);
}

// What the flash attention (attention_alloc_panels and its tasks' tiles) or the qk-norm
// backward allocates at most while it runs (the run's memory estimate, memory.c).
size_t ops_cpu_attention_temp_bytes(int B, int T, int H, int KVH, int HD, int n_threads) {
    const size_t AB = ATT_BLOCK, blocks = (size_t)task_count(T, ATT_BLOCK);
    const size_t HDp = (size_t)task_count(HD, GEMM_NR) * GEMM_NR;
    const size_t kv_t = (size_t)B * KVH * blocks * HD * AB;
    const size_t kv_r = (size_t)B * KVH * blocks * AB * HDp;
    const size_t q_t = (size_t)B * H * blocks * HD * AB, q_r = (size_t)B * H * blocks * AB * HDp;
    const size_t fwd_tile = AB * HD + 2 * AB * AB + AB * HDp;
    const size_t dq_tile = 2 * AB * HD + 3 * AB * AB + AB * HDp;
    const size_t dkv_tile = 2 * AB * HD + 4 * AB * AB + 2 * AB * HDp;
    const size_t threads = (size_t)(n_threads > 0 ? n_threads : 1);
    const size_t fwd = kv_t + kv_r + threads * fwd_tile;
    const size_t bwd = (size_t)B * H * T + 2 * kv_t + kv_r + 2 * q_t + 2 * q_r +
                       threads * (dq_tile > dkv_tile ? dq_tile : dkv_tile);
    // qk-norm + RoPE backward: a (2, HD) partial per task (rows_per_task rows each)
    const int rope_rows = rows_per_task((size_t)(H + 2 * KVH) * HD);
    const size_t rope = (size_t)task_count((int64_t)B * T, rope_rows) * 2 * HD;
    size_t most = fwd > bwd ? fwd : bwd;
    if (rope > most) most = rope;
    return most * sizeof(float);
}

static AttnArgs attention_args(CpuCtx* cx, int B, int T, int H, int KVH, int HD) {
    return (AttnArgs){.kernel = cx->gemm_kernel, .row = cx->att_row, .B = B, .T = T, .H = H,
                      .KVH = KVH, .HD = HD, .QKV = (H + 2 * KVH) * HD,
                      .blocks = (int)task_count(T, ATT_BLOCK),
                      .HDp = (int)task_count(HD, GEMM_NR) * GEMM_NR,
                      .scale = 1.0f / sqrtf((float)HD)};
}

void ops_cpu_attention_forward(void* ctx, void* out, float* lse, const void* qkv, int B, int T,
                               int H, int KVH, int HD) {
    CpuCtx* cx = ctx;
    AttnArgs a = attention_args(cx, B, T, H, KVH, HD);
    a.out = out, a.lse = lse, a.qkv = qkv;
    attention_alloc_panels(&a, 0);
    cpu_run(cx, (int64_t)B * KVH * a.blocks, attention_pack_kv_task, &a);
    cpu_run(cx, (int64_t)B * H * a.blocks, attention_forward_task, &a);
    attention_free_panels(&a);
}

// Pass 1, task = (b, h, block of query rows): D = rowsum(dO ∘ O) and
// dq = scale · dS·K with P = exp(s - lse), dS = P ∘ (dO·vᵀ - D).
static void attention_backward_dq_task(void* arg, int64_t task) {
    const AttnArgs* a = arg;
    const int AB = ATT_BLOCK, HD = a->HD, HDp = a->HDp, vpanels = HDp / GEMM_NR;
    int blk = a->blocks - 1 - (int)(task % a->blocks), h = (int)(task / a->blocks % a->H);
    int b = (int)(task / a->blocks / a->H), g = h / (a->H / a->KVH);
    int t0 = blk * AB, m = imin(AB, a->T - t0), qpanels = (m + GEMM_MR - 1) / GEMM_MR;
    float* buf = aligned_alloc_check(((size_t)2 * AB * HD + 3 * AB * AB + AB * HDp) *
                                     sizeof(float));
    float* qp = buf;                     // (AB/MR, HD, MR) queries as A panels
    float* dop = qp + (size_t)AB * HD;   // (AB/MR, HD, MR) dO rows as A panels
    float* s = dop + (size_t)AB * HD;    // (AB, AB) logits, then P
    float* dp = s + (size_t)AB * AB;     // (AB, AB) dO·vᵀ, then dS
    float* dsp = dp + (size_t)AB * AB;   // (AB/MR, AB, MR) dS as A panels
    float* dq = dsp + (size_t)AB * AB;   // (AB, HDp)
    float D[ATT_BLOCK], L[ATT_BLOCK];
    for (int i = 0; i < m; i++) {
        size_t bht = ((size_t)b * a->H + h) * a->T + t0 + i;
        size_t off = attn_o_offset(a, b, t0 + i, h);
        D[i] = vec_dot(a->dout + off, a->cout + off, HD);
        a->dsum[bht] = D[i];
        L[i] = a->clse[bht];
    }
    for (int p = 0; p < qpanels; p++) {
        int rows = imin(GEMM_MR, m - p * GEMM_MR);
        pack_a_panel(qp + (size_t)p * HD * GEMM_MR, attn_q(a, b, t0 + p * GEMM_MR, h), a->QKV,
                     rows, HD);
        pack_a_panel(dop + (size_t)p * HD * GEMM_MR,
                     a->dout + attn_o_offset(a, b, t0 + p * GEMM_MR, h), (size_t)a->H * HD, rows,
                     HD);
    }
    memset(dq, 0, (size_t)AB * HDp * sizeof(float));
    memset(dsp, 0, (size_t)AB * AB * sizeof(float));  // rows >= m stay 0
    for (int j0 = 0, jb = 0; j0 < t0 + m; j0 += AB, jb++) {
        int kb = imin(AB, t0 + m - j0);
        size_t ot = attn_t_offset(a, b, g, a->KVH, jb);
        gemm_panels(a->kernel, qpanels, 1, HD, qp, a->kt + ot, s, AB, 0);
        gemm_panels(a->kernel, qpanels, 1, HD, dop, a->vt + ot, dp, AB, 0);
        for (int i = 0; i < m; i++) {
            int nv = imin(kb, t0 + i - j0 + 1);
            float lse_row[ATT_BLOCK], d_row[ATT_BLOCK];
            for (int jj = 0; jj < nv; jj++) lse_row[jj] = L[i], d_row[jj] = D[i];
            float* ds = dp + (size_t)i * AB;  // dO·vᵀ becomes dS in place
            a->row(s + (size_t)i * AB, ds, 0, nv, a->scale, lse_row, d_row);
            for (int jj = 0; jj < AB; jj++) dsp[att_a_index(i, jj)] = ds[jj];
        }
        gemm_panels(a->kernel, qpanels, vpanels, AB, dsp,
                    a->kr + attn_r_offset(a, b, g, a->KVH, jb), dq, HDp, 1);
    }
    for (int i = 0; i < m; i++) {
        float* dst = a->dqkv + (size_t)(b * a->T + t0 + i) * a->QKV + (size_t)h * HD;
        for (int d = 0; d < HD; d++) dst[d] = dq[(size_t)i * HDp + d] * a->scale;
    }
    free(buf);
}

// Pass 2, task = (b, kv head g, block of keys): dk = scale · dSᵀ·Q and dv = Pᵀ·dO summed over
// the query heads of the group (in head order) and the query blocks from the diagonal on (in
// order). Works on transposed tiles (keys x queries) so dk and dv come out of the kernel.
static void attention_backward_dkv_task(void* arg, int64_t task) {
    const AttnArgs* a = arg;
    const int AB = ATT_BLOCK, HD = a->HD, HDp = a->HDp, vpanels = HDp / GEMM_NR;
    int blk = (int)(task % a->blocks), g = (int)(task / a->blocks % a->KVH);
    int b = (int)(task / a->blocks / a->KVH), group = a->H / a->KVH;
    int j0 = blk * AB, kb = imin(AB, a->T - j0), kpanels = (kb + GEMM_MR - 1) / GEMM_MR;
    float* buf = aligned_alloc_check(((size_t)2 * AB * HD + 4 * AB * AB + 2 * AB * HDp) *
                                     sizeof(float));
    float* ka = buf;                      // (AB/MR, HD, MR) keys as A panels
    float* va = ka + (size_t)AB * HD;     // (AB/MR, HD, MR) values as A panels
    float* st = va + (size_t)AB * HD;     // (AB keys, AB queries) logits, then Pᵀ
    float* dpt = st + (size_t)AB * AB;    // (AB, AB) v·dOᵀ, then dSᵀ
    float* pa = dpt + (size_t)AB * AB;    // (AB/MR, AB, MR) Pᵀ as A panels
    float* dsa = pa + (size_t)AB * AB;    // (AB/MR, AB, MR) dSᵀ as A panels
    float* dk = dsa + (size_t)AB * AB;    // (AB, HDp)
    float* dv = dk + (size_t)AB * HDp;    // (AB, HDp)
    for (int p = 0; p < kpanels; p++) {
        int rows = imin(GEMM_MR, kb - p * GEMM_MR);
        pack_a_panel(ka + (size_t)p * HD * GEMM_MR, attn_k(a, b, j0 + p * GEMM_MR, g), a->QKV,
                     rows, HD);
        pack_a_panel(va + (size_t)p * HD * GEMM_MR, attn_v(a, b, j0 + p * GEMM_MR, g), a->QKV,
                     rows, HD);
    }
    memset(dk, 0, (size_t)2 * AB * HDp * sizeof(float));  // dk and dv
    memset(pa, 0, (size_t)2 * AB * AB * sizeof(float));   // pa and dsa: rows >= kb stay 0
    for (int h = g * group; h < (g + 1) * group; h++) {
        for (int t0 = j0, tb = blk; t0 < a->T; t0 += AB, tb++) {
            int m = imin(AB, a->T - t0);
            size_t bh = ((size_t)b * a->H + h) * a->T;
            size_t ot = attn_t_offset(a, b, h, a->H, tb), orr = attn_r_offset(a, b, h, a->H, tb);
            gemm_panels(a->kernel, kpanels, 1, HD, ka, a->qt + ot, st, AB, 0);
            gemm_panels(a->kernel, kpanels, 1, HD, va, a->dot + ot, dpt, AB, 0);
            for (int jj = 0; jj < kb; jj++) {
                float* prow = st + (size_t)jj * AB;
                float* drow = dpt + (size_t)jj * AB;
                int first = imax(0, j0 + jj - t0);  // causal: queries t >= j
                a->row(prow, drow, first, m, a->scale, a->clse + bh + t0, a->dsum + bh + t0);
                for (int i = 0; i < AB; i++) {
                    pa[att_a_index(jj, i)] = prow[i];
                    dsa[att_a_index(jj, i)] = drow[i];
                }
            }
            gemm_panels(a->kernel, kpanels, vpanels, AB, pa, a->dor + orr, dv, HDp, 1);
            gemm_panels(a->kernel, kpanels, vpanels, AB, dsa, a->qr + orr, dk, HDp, 1);
        }
    }
    for (int jj = 0; jj < kb; jj++) {
        float* dkr = a->dqkv + (size_t)(b * a->T + j0 + jj) * a->QKV + (size_t)(a->H + g) * HD;
        float* dvr = dkr + (size_t)a->KVH * HD;
        for (int d = 0; d < HD; d++) {
            dkr[d] = dk[(size_t)jj * HDp + d] * a->scale;
            dvr[d] = dv[(size_t)jj * HDp + d];
        }
    }
    free(buf);
}

void ops_cpu_attention_backward(void* ctx, void* dqkv, const void* dout, const void* qkv,
                                const void* out, const float* lse, int B, int T, int H, int KVH,
                                int HD) {
    CpuCtx* cx = ctx;
    AttnArgs a = attention_args(cx, B, T, H, KVH, HD);
    a.dqkv = dqkv, a.qkv = qkv, a.dout = dout, a.cout = out, a.clse = lse;
    size_t n_bht = (size_t)B * H * T;
    a.dsum = malloc_check((n_bht > 0 ? n_bht : 1) * sizeof(float));
    attention_alloc_panels(&a, 1);
    cpu_run(cx, (int64_t)B * KVH * a.blocks, attention_pack_kv_task, &a);
    cpu_run(cx, (int64_t)B * H * a.blocks, attention_pack_q_task, &a);
    // Pass 2 reads D of every query row of its group, so pass 1 must finish first.
    cpu_run(cx, (int64_t)B * H * a.blocks, attention_backward_dq_task, &a);
    cpu_run(cx, (int64_t)B * KVH * a.blocks, attention_backward_dkv_task, &a);
    attention_free_panels(&a);
    free(a.dsum);
}

// ----------------------------------------------------------------------------
// attention with sinks and sliding windows (GPT-OSS)

typedef struct SinkAttnArgs {
    float* out;           // (N, H*HD) forward
    float* lse;           // (B, H, T) forward
    float* dqkv;          // (N, QKV) backward
    float* dsink_part;    // (B, H) backward: per (b, h) sink gradient, reduced in order after
    const float* qkv;     // (N, QKV)
    const float* cout;    // (N, H*HD) backward: the forward's output
    const float* clse;    // (B, H, T) backward
    const float* dout;    // (N, H*HD) backward
    const float* sinks;   // (H) or NULL
    float* dsum;          // (B, H, T) backward: D = rowsum(dout * out)
    int B, T, H, KVH, HD, window;
    float scale;
} SinkAttnArgs;

// First key visible to query t.
static int sink_first_key(const SinkAttnArgs* a, int t) {
    return a->window > 0 && t - a->window + 1 > 0 ? t - a->window + 1 : 0;
}

static const float* sink_q(const SinkAttnArgs* a, int b, int t, int h) {
    return a->qkv + (size_t)(b * a->T + t) * (a->H + 2 * a->KVH) * a->HD + (size_t)h * a->HD;
}
static const float* sink_k(const SinkAttnArgs* a, int b, int t, int g) {
    return sink_q(a, b, t, a->H + g);
}
static const float* sink_v(const SinkAttnArgs* a, int b, int t, int g) {
    return sink_q(a, b, t, a->H + a->KVH + g);
}

// Task (b, h): every query row of one head.
static void sink_attention_forward_task(void* arg, int64_t task) {
    const SinkAttnArgs* a = arg;
    const int b = (int)(task / a->H), h = (int)(task % a->H), g = h / (a->H / a->KVH);
    const int HD = a->HD;
    float* p = malloc_check((size_t)a->T * sizeof(float));
    for (int t = 0; t < a->T; t++) {
        const int j0 = sink_first_key(a, t);
        const float* q = sink_q(a, b, t, h);
        float m = a->sinks ? a->sinks[h] : -INFINITY;
        for (int j = j0; j <= t; j++) {
            p[j] = vec_dot(q, sink_k(a, b, j, g), HD) * a->scale;
            if (p[j] > m) m = p[j];
        }
        double sum = a->sinks ? exp((double)a->sinks[h] - m) : 0.0;
        for (int j = j0; j <= t; j++) {
            p[j] = expf(p[j] - m);
            sum += p[j];
        }
        float* o = a->out + (size_t)(b * a->T + t) * a->H * HD + (size_t)h * HD;
        for (int d = 0; d < HD; d++) o[d] = 0.0f;
        const float inv = (float)(1.0 / sum);
        for (int j = j0; j <= t; j++) {
            const float w = p[j] * inv;
            const float* v = sink_v(a, b, j, g);
            for (int d = 0; d < HD; d++) o[d] += w * v[d];
        }
        a->lse[((size_t)b * a->H + h) * a->T + t] = (float)(m + log(sum));
    }
    free(p);
}

void ops_cpu_attention_sink_forward(void* ctx, void* out, float* lse, const void* qkv,
                                    const void* sinks, int B, int T, int H, int KVH, int HD,
                                    int window) {
    SinkAttnArgs a = {.out = out, .lse = lse, .qkv = qkv, .sinks = sinks, .B = B, .T = T, .H = H,
                      .KVH = KVH, .HD = HD, .window = window, .scale = 1.0f / sqrtf((float)HD)};
    cpu_run(ctx, (int64_t)B * H, sink_attention_forward_task, &a);
}

// Pass 1, task (b, h): D = rowsum(dO ∘ O), dq = scale Σ_j dS_j k_j with P_j = exp(a_j - lse),
// dS_j = P_j (dO·v_j - D), and the sink's gradient -Σ_rows P_sink D.
static void sink_attention_dq_task(void* arg, int64_t task) {
    const SinkAttnArgs* a = arg;
    const int b = (int)(task / a->H), h = (int)(task % a->H), g = h / (a->H / a->KVH);
    const int HD = a->HD, QKV = (a->H + 2 * a->KVH) * HD;
    double dsink = 0.0;
    for (int t = 0; t < a->T; t++) {
        const size_t o_off = (size_t)(b * a->T + t) * a->H * HD + (size_t)h * HD;
        const size_t bht = ((size_t)b * a->H + h) * a->T + t;
        const float D = vec_dot(a->dout + o_off, a->cout + o_off, HD), L = a->clse[bht];
        a->dsum[bht] = D;
        if (a->sinks) dsink -= (double)expf(a->sinks[h] - L) * D;
        const float* q = sink_q(a, b, t, h);
        float* dq = a->dqkv + (size_t)(b * a->T + t) * QKV + (size_t)h * HD;
        for (int d = 0; d < HD; d++) dq[d] = 0.0f;
        for (int j = sink_first_key(a, t); j <= t; j++) {
            const float* k = sink_k(a, b, j, g);
            const float P = expf(vec_dot(q, k, HD) * a->scale - L);
            const float dS = P * (vec_dot(a->dout + o_off, sink_v(a, b, j, g), HD) - D);
            for (int d = 0; d < HD; d++) dq[d] += dS * k[d];
        }
        for (int d = 0; d < HD; d++) dq[d] *= a->scale;
    }
    a->dsink_part[task] = (float)dsink;
}

// Pass 2, task (b, kv head g): dk_j = scale Σ dS q, dv_j = Σ P dO over the group's heads (in
// order) and the queries that see key j (in order).
static void sink_attention_dkv_task(void* arg, int64_t task) {
    const SinkAttnArgs* a = arg;
    const int b = (int)(task / a->KVH), g = (int)(task % a->KVH), group = a->H / a->KVH;
    const int HD = a->HD, QKV = (a->H + 2 * a->KVH) * HD;
    for (int j = 0; j < a->T; j++) {
        float* dk = a->dqkv + (size_t)(b * a->T + j) * QKV + (size_t)(a->H + g) * HD;
        float* dv = dk + (size_t)a->KVH * HD;
        for (int d = 0; d < HD; d++) dk[d] = dv[d] = 0.0f;
        const float* k = sink_k(a, b, j, g);
        const float* v = sink_v(a, b, j, g);
        const int t_end = a->window > 0 ? imin(a->T, j + a->window) : a->T;
        for (int h = g * group; h < (g + 1) * group; h++) {
            for (int t = j; t < t_end; t++) {
                const size_t o_off = (size_t)(b * a->T + t) * a->H * HD + (size_t)h * HD;
                const size_t bht = ((size_t)b * a->H + h) * a->T + t;
                const float* q = sink_q(a, b, t, h);
                const float* dO = a->dout + o_off;
                const float P = expf(vec_dot(q, k, HD) * a->scale - a->clse[bht]);
                const float dS = P * (vec_dot(dO, v, HD) - a->dsum[bht]);
                for (int d = 0; d < HD; d++) {
                    dk[d] += dS * q[d];
                    dv[d] += P * dO[d];
                }
            }
        }
        for (int d = 0; d < HD; d++) dk[d] *= a->scale;
    }
}

void ops_cpu_attention_sink_backward(void* ctx, void* dqkv, float* dsinks, const void* dout,
                                     const void* qkv, const void* out, const float* lse,
                                     const void* sinks, int B, int T, int H, int KVH, int HD,
                                     int window) {
    SinkAttnArgs a = {.dqkv = dqkv, .qkv = qkv, .cout = out, .clse = lse, .dout = dout,
                      .sinks = sinks, .B = B, .T = T, .H = H, .KVH = KVH, .HD = HD,
                      .window = window, .scale = 1.0f / sqrtf((float)HD)};
    const size_t n_bht = (size_t)B * H * T;
    a.dsum = malloc_check((n_bht > 0 ? n_bht : 1) * sizeof(float));
    a.dsink_part = malloc_check((size_t)(B * H > 0 ? B * H : 1) * sizeof(float));
    // pass 2 reads D of every query row of its group, so pass 1 finishes first
    cpu_run(ctx, (int64_t)B * H, sink_attention_dq_task, &a);
    cpu_run(ctx, (int64_t)B * KVH, sink_attention_dkv_task, &a);
    if (dsinks && sinks)
        for (int h = 0; h < H; h++) {
            float s = 0.0f;
            for (int b = 0; b < B; b++) s += a.dsink_part[(size_t)b * H + h];
            dsinks[h] += s;
        }
    free(a.dsum);
    free(a.dsink_part);
}


// ----------------------------------------------------------------------------
// decode attention: one query row per sequence against its KV cache (generate.c)

typedef struct DecodeAttnArgs {
    float* out;            // (n, H*HD)
    const float* qkv;      // (n, QKV): the q part of each row
    const float* kc;       // (slots, maxT, KVH*HD)
    const float* vc;       // (slots, maxT, KVH*HD)
    const int32_t* slot;   // (n)
    const int32_t* len;    // (n)
    const float* sinks;    // (H) or NULL
    int maxT, H, KVH, HD, window;
    float scale;
} DecodeAttnArgs;

// Task (row i, head h): a softmax over the visible keys in two passes (max, then the weighted
// sum), in the same float arithmetic as the sink attention's reference.
static void decode_attention_task(void* arg, int64_t task) {
    const DecodeAttnArgs* a = arg;
    const int i = (int)(task / a->H), h = (int)(task % a->H), g = h / (a->H / a->KVH);
    const int HD = a->HD, KD = a->KVH * HD, QKV = (a->H + 2 * a->KVH) * HD;
    const int len = a->len[i], first = a->window > 0 && len > a->window ? len - a->window : 0;
    const float* q = a->qkv + (size_t)i * QKV + (size_t)h * HD;
    const float* kbase = a->kc + (size_t)a->slot[i] * a->maxT * KD + (size_t)g * HD;
    const float* vbase = a->vc + (size_t)a->slot[i] * a->maxT * KD + (size_t)g * HD;
    float* o = a->out + (size_t)i * a->H * HD + (size_t)h * HD;
    float mx = a->sinks ? a->sinks[h] : -INFINITY;
    for (int j = first; j < len; j++) {
        const float s = vec_dot(q, kbase + (size_t)j * KD, HD) * a->scale;
        mx = s > mx ? s : mx;
    }
    double den = a->sinks ? (double)expf(a->sinks[h] - mx) : 0.0;
    for (int d = 0; d < HD; d++) o[d] = 0.0f;
    for (int j = first; j < len; j++) {
        const float p = expf(vec_dot(q, kbase + (size_t)j * KD, HD) * a->scale - mx);
        den += p;
        const float* v = vbase + (size_t)j * KD;
        for (int d = 0; d < HD; d++) o[d] += p * v[d];
    }
    const float inv = den > 0.0 ? (float)(1.0 / den) : 0.0f;
    for (int d = 0; d < HD; d++) o[d] *= inv;
}

void ops_cpu_attention_decode(void* ctx, void* out, const void* qkv, const void* kc,
                              const void* vc, const int32_t* slot, const int32_t* len,
                              const void* sinks, int n, int maxT, int H, int KVH, int HD,
                              int window) {
    DecodeAttnArgs a = {.out = out, .qkv = qkv, .kc = kc, .vc = vc, .slot = slot, .len = len,
                        .sinks = sinks, .maxT = maxT, .H = H, .KVH = KVH, .HD = HD,
                        .window = window, .scale = 1.0f / sqrtf((float)HD)};
    for (int i = 0; i < n; i++)
        if (len[i] < 1 || len[i] > maxT)
            fatal("internal: decode attention over %d keys (cache of %d)", len[i], maxT);
    cpu_run(ctx, (int64_t)n * H, decode_attention_task, &a);
}
