/*
 * ops_cpu.c — the fp32 CPU reference backend of the op table (ops.h), its top file: the table
 * itself (it names every op), the context's create/destroy, memory, the token embedding, RMSNorm,
 * the matmul, SwiGLU, the elementwise adds, column scatters and dropout, the softmax
 * cross-entropy and the policy loss. Below it, each using only the core: attention and its input
 * (qk-norm + RoPE, GPT-OSS sinks and sliding windows) in ops_cpu_attention.c, the
 * mixture-of-experts ops (routing, dispatch, gathers, the grouped matmul, combines, the GPT-OSS
 * clamped GLU) in ops_cpu_moe.c. At the bottom, ops_cpu_core.c: the packed GEMM, its SIMD
 * micro-kernels and the bias gradient; ops_cpu_core.h declares what the files share.
 *
 * ctx is a CpuCtx: a ThreadPool plus the SIMD kernels picked for this CPU. Buffers are plain
 * 64-byte aligned host memory; uploads and downloads are memcpy. Ops may be called from several
 * threads on one ctx: their parallel loops take turns on the pool.
 *
 * Determinism: every op splits its work into tasks whose number and extent depend only on the
 * problem size (never on the thread count), and every floating-point sum runs in a fixed order
 * inside one task. Reductions over rows (parameter gradients) either loop the rows in order inside
 * a column task, or sum per-row-block partials in block order. So results are bit-identical for
 * any number of threads. The matmuls' order is described in ops_cpu_core.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "ops_cpu_core.h"

// ----------------------------------------------------------------------------
// memory

static void* cpu_alloc(void* ctx, size_t bytes) {
    (void)ctx;
    void* p = aligned_alloc_check(bytes);
    memset(p, 0, bytes);
    return p;
}

static void cpu_free(void* ctx, void* p) {
    (void)ctx;
    free(p);
}

static void cpu_zero(void* ctx, void* p, size_t bytes) {
    (void)ctx;
    if (bytes > 0) memset(p, 0, bytes);
}

// memmove: a copy onto itself (or an overlapping one) stays well defined.
static void cpu_copy(void* ctx, void* dst, const void* src, size_t bytes) {
    (void)ctx;
    if (bytes > 0) memmove(dst, src, bytes);
}

static void cpu_upload_f32(void* ctx, void* dst, const float* src, size_t n) {
    (void)ctx;
    if (n > 0) memcpy(dst, src, n * sizeof(float));
}

static void cpu_download_f32(void* ctx, float* dst, const void* src, size_t n) {
    (void)ctx;
    if (n > 0) memcpy(dst, src, n * sizeof(float));
}

static void cpu_upload(void* ctx, void* dst, const void* src, size_t bytes) {
    (void)ctx;
    if (bytes > 0) memcpy(dst, src, bytes);
}

static void cpu_download(void* ctx, void* dst, const void* src, size_t bytes) {
    (void)ctx;
    if (bytes > 0) memcpy(dst, src, bytes);
}

static void cpu_synchronize(void* ctx) { (void)ctx; }

// The overlapped transfers: every op has finished when it returns, so only the snapshot a
// download_start promises is kept (the work issued after it may overwrite src).
static void cpu_upload_async(void* ctx, void* dst, const void* src, size_t bytes, int slot) {
    (void)ctx, (void)slot;
    if (bytes > 0) memcpy(dst, src, bytes);
}

static void cpu_download_start(void* ctx, const void* src, size_t bytes, int slot) {
    CpuCtx* cx = ctx;
    if (slot < 0 || slot > 1) fatal("internal: download_start slot %d (0 or 1)", slot);
    if (bytes > cx->down_cap[slot]) {
        free(cx->down[slot]);
        cx->down[slot] = malloc_check(bytes);
        cx->down_cap[slot] = bytes;
    }
    if (bytes > 0) memcpy(cx->down[slot], src, bytes);
    cx->down_pending[slot] = 1;
}

static void cpu_download_finish(void* ctx, void* dst, size_t bytes, int slot) {
    CpuCtx* cx = ctx;
    if (slot < 0 || slot > 1 || !cx->down_pending[slot] || bytes > cx->down_cap[slot])
        fatal("internal: download_finish of %zu bytes from slot %d without a start of as many",
              bytes, slot);
    cx->down_pending[slot] = 0;
    if (bytes > 0) memcpy(dst, cx->down[slot], bytes);
}

static void cpu_gather_ids(void* ctx, int32_t* ids, const int32_t* prev, const int32_t* from,
                           int n) {
    (void)ctx;
    for (int k = 0; k < n; k++)
        if (from[k] >= 0) ids[k] = prev[from[k]];
}

// ----------------------------------------------------------------------------
// token embedding

typedef struct EmbeddingArgs {
    float* out;           // (N, C)
    float* dwte;          // (V, C)
    const float* dout;    // (N, C)
    const int32_t* ids;   // (N)
    const float* wte;     // (V, C)
    int N, C, V, rows_per_task;
} EmbeddingArgs;

static void embedding_forward_task(void* arg, int64_t task) {
    const EmbeddingArgs* e = arg;
    int n0 = (int)task * e->rows_per_task, n1 = imin(e->N, n0 + e->rows_per_task);
    for (int n = n0; n < n1; n++)
        memcpy(e->out + (size_t)n * e->C, e->wte + (size_t)e->ids[n] * e->C,
               (size_t)e->C * sizeof(float));
}

static void cpu_embedding_forward(void* ctx, void* out, const int32_t* ids, const void* wte, int N,
                                  int C) {
    EmbeddingArgs e = {.out = out, .ids = ids, .wte = wte, .N = N, .C = C,
                       .rows_per_task = rows_per_task((size_t)C)};
    cpu_run(ctx, task_count(N, e.rows_per_task), embedding_forward_task, &e);
}

// One task owns a block of columns and walks the tokens in order: no two tasks touch the same
// dwte element, and each element sums its tokens in token order.
static void embedding_backward_task(void* arg, int64_t task) {
    const EmbeddingArgs* e = arg;
    int c0 = (int)task * COL_BLOCK, c1 = imin(e->C, c0 + COL_BLOCK);
    for (int n = 0; n < e->N; n++) {
        int id = e->ids[n];
        if (id < 0 || id >= e->V)
            fatal("embedding_backward: token id %d outside [0, %d)", id, e->V);
        float* dst = e->dwte + (size_t)id * e->C;
        const float* src = e->dout + (size_t)n * e->C;
        for (int c = c0; c < c1; c++) dst[c] += src[c];
    }
}

static void cpu_embedding_backward(void* ctx, float* dwte, const void* dout, const int32_t* ids,
                                   int N, int C, int V) {
    EmbeddingArgs e = {.dwte = dwte, .dout = dout, .ids = ids, .N = N, .C = C, .V = V};
    cpu_run(ctx, task_count(C, COL_BLOCK), embedding_backward_task, &e);
}

// ----------------------------------------------------------------------------
// RMSNorm

typedef struct RmsnormArgs {
    float* res;          // (N, C) residual sum, or NULL (plain rmsnorm)
    float* out;          // (N, C)
    float* rstd;         // (N), may be NULL in the forward
    const float* a;      // (N, C) input (or first residual term)
    const float* b;      // (N, C) second residual term, or NULL
    const float* w;      // (C)
    float* dinp;         // (N, C) backward: accumulated
    float* dw;           // (C) backward: accumulated
    const float* dout;   // (N, C)
    const float* crstd;  // (N) saved rstd for the backward
    int N, C, rows_per_task;
    float eps;
} RmsnormArgs;

static void rmsnorm_forward_task(void* arg, int64_t task) {
    const RmsnormArgs* r = arg;
    int n0 = (int)task * r->rows_per_task, n1 = imin(r->N, n0 + r->rows_per_task);
    for (int n = n0; n < n1; n++) {
        size_t off = (size_t)n * r->C;
        const float* x = r->a + off;
        if (r->res) {  // fused residual: x = a + b, written first so res may alias a
            float* res = r->res + off;
            const float* b = r->b + off;
            for (int c = 0; c < r->C; c++) res[c] = x[c] + b[c];
            x = res;
        }
        double ss = 0.0;
        for (int c = 0; c < r->C; c++) ss += (double)x[c] * x[c];
        float rs = (float)(1.0 / sqrt(ss / r->C + r->eps));
        if (r->rstd) r->rstd[n] = rs;
        float* y = r->out + off;
        for (int c = 0; c < r->C; c++) y[c] = r->w[c] * (x[c] * rs);
    }
}

static void cpu_rmsnorm_forward(void* ctx, void* out, float* rstd, const void* inp, const void* w,
                                int N, int C, float eps) {
    RmsnormArgs r = {.out = out, .rstd = rstd, .a = inp, .w = w, .N = N, .C = C, .eps = eps,
                     .rows_per_task = rows_per_task((size_t)C)};
    cpu_run(ctx, task_count(N, r.rows_per_task), rmsnorm_forward_task, &r);
}

static void cpu_residual_rmsnorm_forward(void* ctx, void* res, void* out, float* rstd,
                                         const void* a, const void* b, const void* w, int N, int C,
                                         float eps) {
    RmsnormArgs r = {.res = res, .out = out, .rstd = rstd, .a = a, .b = b, .w = w, .N = N, .C = C,
                     .eps = eps, .rows_per_task = rows_per_task((size_t)C)};
    cpu_run(ctx, task_count(N, r.rows_per_task), rmsnorm_forward_task, &r);
}

// dx = rstd * (g - x̂ * mean(g * x̂)), g = dy * w, x̂ = x * rstd (docs/FORMATS.md §7.2).
static void rmsnorm_backward_dinp_task(void* arg, int64_t task) {
    const RmsnormArgs* r = arg;
    int n0 = (int)task * r->rows_per_task, n1 = imin(r->N, n0 + r->rows_per_task);
    for (int n = n0; n < n1; n++) {
        size_t off = (size_t)n * r->C;
        const float* x = r->a + off;
        const float* dy = r->dout + off;
        float rs = r->crstd[n];
        double dot = 0.0;
        for (int c = 0; c < r->C; c++) dot += (double)(dy[c] * r->w[c]) * (double)(x[c] * rs);
        float mean = (float)(dot / r->C);
        float* dx = r->dinp + off;
        for (int c = 0; c < r->C; c++) dx[c] += rs * (dy[c] * r->w[c] - (x[c] * rs) * mean);
    }
}

// dw: a task owns COL_BLOCK columns and sums the rows in order.
static void rmsnorm_backward_dw_task(void* arg, int64_t task) {
    const RmsnormArgs* r = arg;
    int c0 = (int)task * COL_BLOCK, c1 = imin(r->C, c0 + COL_BLOCK);
    float acc[COL_BLOCK] = {0};
    for (int n = 0; n < r->N; n++) {
        size_t off = (size_t)n * r->C;
        float rs = r->crstd[n];
        for (int c = c0; c < c1; c++) acc[c - c0] += r->dout[off + c] * (r->a[off + c] * rs);
    }
    for (int c = c0; c < c1; c++) r->dw[c] += acc[c - c0];
}

static void cpu_rmsnorm_backward(void* ctx, void* dinp, float* dw, const void* dout,
                                 const void* inp, const void* w, const float* rstd, int N, int C) {
    RmsnormArgs r = {.a = inp, .w = w, .dinp = dinp, .dw = dw, .dout = dout, .crstd = rstd,
                     .N = N, .C = C, .rows_per_task = rows_per_task((size_t)C)};
    if (dinp) cpu_run(ctx, task_count(N, r.rows_per_task), rmsnorm_backward_dinp_task, &r);
    if (dw) cpu_run(ctx, task_count(C, COL_BLOCK), rmsnorm_backward_dw_task, &r);
}

// ----------------------------------------------------------------------------
// matmul

static void cpu_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                               const void* bias, int N, int IC, int OC) {
    // out (N, OC) = inp (N, IC) · wᵀ: B[k][j] = w[j][k].
    Gemm g = {.M = N, .Nc = OC, .K = IC, .a = inp, .a_rs = (size_t)IC, .a_cs = 1, .b = w,
              .b_rs = 1, .b_cs = (size_t)IC, .c = out, .ldc = OC, .accumulate = 0, .bias = bias};
    ops_cpu_gemm_run(ctx, &g);
}

static void cpu_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias, const void* dout,
                                const void* inp, const void* w, int N, int IC, int OC) {
    if (dinp) {  // dinp (N, IC) = dout (N, OC) · w (OC, IC)
        Gemm g = {.M = N, .Nc = IC, .K = OC, .a = dout, .a_rs = (size_t)OC, .a_cs = 1, .b = w,
                  .b_rs = (size_t)IC, .b_cs = 1, .c = dinp, .ldc = IC, .accumulate = 0};
        ops_cpu_gemm_run(ctx, &g);
    }
    if (dw) {  // dw (OC, IC) += doutᵀ (OC, N) · inp (N, IC): A[i][k] = dout[k][i]
        Gemm g = {.M = OC, .Nc = IC, .K = N, .a = dout, .a_rs = 1, .a_cs = (size_t)OC, .b = inp,
                  .b_rs = (size_t)IC, .b_cs = 1, .c = dw, .ldc = IC, .accumulate = 1};
        ops_cpu_gemm_run(ctx, &g);
    }
    if (dbias) ops_cpu_dbias(ctx, dbias, dout, N, OC);
}

// ----------------------------------------------------------------------------
// SwiGLU

typedef struct SwigluArgs {
    float* out;         // (N, F) forward / (N, 2F) backward dgu
    const float* gu;    // (N, 2F) = [gate | up]
    const float* dout;  // (N, F)
    int N, F, rows_per_task;
} SwigluArgs;

static void swiglu_forward_task(void* arg, int64_t task) {
    const SwigluArgs* s = arg;
    int n0 = (int)task * s->rows_per_task, n1 = imin(s->N, n0 + s->rows_per_task);
    for (int n = n0; n < n1; n++) {
        const float* gate = s->gu + (size_t)n * 2 * s->F;
        const float* up = gate + s->F;
        float* o = s->out + (size_t)n * s->F;
        for (int i = 0; i < s->F; i++) o[i] = gate[i] * sigmoidf(gate[i]) * up[i];
    }
}

static void cpu_swiglu_forward(void* ctx, void* out, const void* gu, int N, int F) {
    SwigluArgs s = {.out = out, .gu = gu, .N = N, .F = F,
                    .rows_per_task = rows_per_task((size_t)F)};
    cpu_run(ctx, task_count(N, s.rows_per_task), swiglu_forward_task, &s);
}

// du = dy silu(a); da = dy u σ(a) (1 + a (1 - σ(a))) (docs/FORMATS.md §7.5).
static void swiglu_backward_task(void* arg, int64_t task) {
    const SwigluArgs* s = arg;
    int n0 = (int)task * s->rows_per_task, n1 = imin(s->N, n0 + s->rows_per_task);
    for (int n = n0; n < n1; n++) {
        const float* gate = s->gu + (size_t)n * 2 * s->F;
        const float* up = gate + s->F;
        const float* dy = s->dout + (size_t)n * s->F;
        float* dgate = s->out + (size_t)n * 2 * s->F;
        float* dup = dgate + s->F;
        for (int i = 0; i < s->F; i++) {
            float a = gate[i], sg = sigmoidf(a);
            dup[i] = dy[i] * (a * sg);
            dgate[i] = dy[i] * up[i] * sg * (1.0f + a * (1.0f - sg));
        }
    }
}

static void cpu_swiglu_backward(void* ctx, void* dgu, const void* dout, const void* gu, int N,
                                int F) {
    SwigluArgs s = {.out = dgu, .gu = gu, .dout = dout, .N = N, .F = F,
                    .rows_per_task = rows_per_task((size_t)F)};
    cpu_run(ctx, task_count(N, s.rows_per_task), swiglu_backward_task, &s);
}

// ----------------------------------------------------------------------------
// elementwise add

#define ADD_CHUNK 65536

typedef struct AddArgs {
    float* out;
    const float* a;
    const float* b;
    size_t n;
} AddArgs;

static void add_task(void* arg, int64_t task) {
    const AddArgs* d = arg;
    size_t i0 = (size_t)task * ADD_CHUNK, i1 = i0 + ADD_CHUNK < d->n ? i0 + ADD_CHUNK : d->n;
    for (size_t i = i0; i < i1; i++) d->out[i] = d->a[i] + d->b[i];
}

static void cpu_add(void* ctx, void* out, const void* a, const void* b, size_t n) {
    AddArgs d = {.out = out, .a = a, .b = b, .n = n};
    cpu_run(ctx, task_count((int64_t)n, ADD_CHUNK), add_task, &d);
}

typedef struct ScaleArgs {
    float* out;
    const float* inp;
    float s;
    size_t n;
} ScaleArgs;

static void scale_task(void* arg, int64_t task) {
    const ScaleArgs* d = arg;
    size_t i0 = (size_t)task * ADD_CHUNK, i1 = i0 + ADD_CHUNK < d->n ? i0 + ADD_CHUNK : d->n;
    for (size_t i = i0; i < i1; i++) d->out[i] = d->s * d->inp[i];
}

static void cpu_scale(void* ctx, void* out, const void* inp, float s, size_t n) {
    ScaleArgs d = {.out = out, .inp = inp, .s = s, .n = n};
    cpu_run(ctx, task_count((int64_t)n, ADD_CHUNK), scale_task, &d);
}

static void cpu_add_f32(void* ctx, float* dst, const float* src, size_t n) {
    cpu_add(ctx, dst, dst, src, n);  // fp32 activations: the same single rounding per element
}

// ----------------------------------------------------------------------------
// LoRA: column ranges of fused outputs, dropout

typedef struct ColsArgs {
    float* dst;
    const float* src;
    float scale, p, inv_keep;
    int accumulate;  // put_cols: add (1) or store (0)
    uint32_t threshold;
    uint64_t seed;
    int64_t row0;
    int N, ld, c0, w, rows_per_task;
} ColsArgs;

// dst (N, ld) columns [c0, c0 + w) = scale · src (N, w), added to what they hold when accumulate.
static void put_cols_task(void* arg, int64_t task) {
    const ColsArgs* a = arg;
    int n0 = (int)task * a->rows_per_task, n1 = imin(a->N, n0 + a->rows_per_task);
    for (int n = n0; n < n1; n++) {
        float* o = a->dst + (size_t)n * a->ld + a->c0;
        const float* x = a->src + (size_t)n * a->w;
        for (int j = 0; j < a->w; j++) {
            float d = a->scale * x[j];
            o[j] = a->accumulate ? o[j] + d : d;
        }
    }
}

static void put_cols(void* ctx, float* dst, const float* src, float scale, int accumulate, int N,
                     int ld, int c0, int w) {
    ColsArgs a = {.dst = dst, .src = src, .scale = scale, .accumulate = accumulate, .N = N,
                  .ld = ld, .c0 = c0, .w = w, .rows_per_task = rows_per_task((size_t)w)};
    cpu_run(ctx, task_count(N, a.rows_per_task), put_cols_task, &a);
}

// The column-range products as the plain ops compose them (the product in fp32, then the scaled
// add or store, one rounding each: an adapter's product stored and the base's added onto it are
// the same bits as the other way round).
static void cpu_matmul_cols_forward(void* ctx, void* out, int accumulate, const void* inp, int ldi,
                                    const void* w, float scale, int N, int IC, int OC, int ld,
                                    int c0) {
    float* tmp = malloc_check((size_t)N * (size_t)OC * sizeof(float) + 1);
    // tmp (N, OC) = inp · wᵀ: B[k][j] = w[j][k]
    Gemm g = {.M = N, .Nc = OC, .K = IC, .a = inp, .a_rs = (size_t)ldi, .a_cs = 1, .b = w,
              .b_rs = 1, .b_cs = (size_t)IC, .c = tmp, .ldc = OC, .accumulate = 0};
    ops_cpu_gemm_run(ctx, &g);
    put_cols(ctx, out, tmp, scale, accumulate, N, ld, c0, OC);
    free(tmp);
}

static void get_cols_task(void* arg, int64_t task) {
    const ColsArgs* a = arg;
    int n0 = (int)task * a->rows_per_task, n1 = imin(a->N, n0 + a->rows_per_task);
    for (int n = n0; n < n1; n++) {
        float* o = a->dst + (size_t)n * a->w;
        const float* x = a->src + (size_t)n * a->ld + a->c0;
        for (int j = 0; j < a->w; j++) o[j] = a->scale * x[j];
    }
}

static void cpu_copy_cols(void* ctx, void* dst, const void* src, int N, int ld, int c0, int w) {
    ColsArgs a = {.dst = dst, .src = src, .scale = 1.0f, .N = N, .ld = ld, .c0 = c0, .w = w,
                  .rows_per_task = rows_per_task((size_t)w)};
    cpu_run(ctx, task_count(N, a.rows_per_task), get_cols_task, &a);  // (1 · x is exact)
}

static void cpu_matmul_cols_backward(void* ctx, void* dinp, int accumulate, float* dw,
                                     const void* dout, const void* inp, const void* w, float scale,
                                     int N, int IC, int ldi, int OC, int ld, int c0) {
    // g = scale · dout's columns (dout itself when that is the identity)
    const int whole = scale == 1.0f && ld == OC && c0 == 0;
    float* g = whole ? NULL : malloc_check((size_t)N * (size_t)OC * sizeof(float) + 1);
    if (!whole) {
        ColsArgs a = {.dst = g, .src = dout, .scale = scale, .N = N, .ld = ld, .c0 = c0, .w = OC,
                      .rows_per_task = rows_per_task((size_t)OC)};
        cpu_run(ctx, task_count(N, a.rows_per_task), get_cols_task, &a);
    }
    const float* gg = whole ? dout : g;
    if (dinp) {  // dinp (N, IC) (+)= g (N, OC) · w (OC, IC): the product, then one add
        float* tmp = accumulate ? malloc_check((size_t)N * (size_t)IC * sizeof(float) + 1) : NULL;
        Gemm p = {.M = N, .Nc = IC, .K = OC, .a = gg, .a_rs = (size_t)OC, .a_cs = 1, .b = w,
                  .b_rs = (size_t)IC, .b_cs = 1, .c = tmp ? tmp : dinp,
                  .ldc = tmp ? IC : ldi, .accumulate = 0};
        ops_cpu_gemm_run(ctx, &p);
        if (tmp) put_cols(ctx, dinp, tmp, 1.0f, 1, N, ldi, 0, IC);  // (1 · x is exact)
        free(tmp);
    }
    if (dw) {  // dw (OC, IC) += gᵀ (OC, N) · inp (N, IC): A[i][k] = g[k][i]
        Gemm p = {.M = OC, .Nc = IC, .K = N, .a = gg, .a_rs = 1, .a_cs = (size_t)OC, .b = inp,
                  .b_rs = (size_t)ldi, .b_cs = 1, .c = dw, .ldc = IC, .accumulate = 1};
        ops_cpu_gemm_run(ctx, &p);
    }
    free(g);
}

static void dropout_task(void* arg, int64_t task) {
    const ColsArgs* a = arg;
    int n0 = (int)task * a->rows_per_task, n1 = imin(a->N, n0 + a->rows_per_task);
    for (int n = n0; n < n1; n++) {
        const uint64_t base = (uint64_t)(a->row0 + n) * (uint64_t)a->w;
        float* o = a->dst + (size_t)n * a->w;
        const float* x = a->src + (size_t)n * a->w;
        for (int j = 0; j < a->w; j++) {
            const int keep = lora_dropout_hash(a->seed, base + (uint64_t)j) >= a->threshold;
            o[j] = keep ? x[j] * a->inv_keep : 0.0f;
        }
    }
}

static void cpu_dropout(void* ctx, void* out, const void* inp, float p, uint64_t seed,
                        int64_t row0, int N, int C) {
    ColsArgs a = {.dst = out, .src = inp, .p = p, .inv_keep = 1.0f / (1.0f - p),
                  .threshold = lora_dropout_threshold(p), .seed = seed, .row0 = row0, .N = N,
                  .w = C, .rows_per_task = rows_per_task((size_t)C)};
    cpu_run(ctx, task_count(N, a.rows_per_task), dropout_task, &a);
}

// ----------------------------------------------------------------------------
// a frozen base in ggml blocks: dequantisation on use (ggml_dequantize, the loader's own)

#define DEQUANT_TASK 65536  // elements per task (a multiple of every block size)

typedef struct DequantArgs {
    float* out;
    const uint8_t* blocks;
    int type, block, block_bytes;
    size_t n;
} DequantArgs;

static void dequant_task(void* arg, int64_t task) {
    const DequantArgs* a = arg;
    const size_t b = (size_t)task * DEQUANT_TASK;
    const size_t n = a->n - b < DEQUANT_TASK ? a->n - b : DEQUANT_TASK;
    ggml_dequantize(a->type, a->blocks + b / (size_t)a->block * (size_t)a->block_bytes, a->out + b,
                    (int64_t)n);
}

static void cpu_dequantize(void* ctx, void* out, const void* blocks, int type, size_t n) {
    DequantArgs a = {.out = out, .blocks = blocks, .type = type, .n = n};
    a.block = ggml_type_block(type, &a.block_bytes);
    if (a.block == 0 || n % (size_t)a.block != 0 || !ggml_type_can_dequantize(type))
        fatal("internal: dequantize of %zu elements of ggml type %d", n, type);
    cpu_run(ctx, task_count((int64_t)n, DEQUANT_TASK), dequant_task, &a);
}

// ----------------------------------------------------------------------------
// softmax cross-entropy

typedef struct XentArgs {
    float* logits;           // (n, V), overwritten by dlogits when compute_grad
    float* losses;           // (n)
    const int32_t* targets;  // (n)
    int n, V, rows_per_task, compute_grad;
    float grad_scale;
} XentArgs;

static void crossentropy_task(void* arg, int64_t task) {
    const XentArgs* x = arg;
    int i0 = (int)task * x->rows_per_task, i1 = imin(x->n, i0 + x->rows_per_task);
    for (int i = i0; i < i1; i++) {
        float* z = x->logits + (size_t)i * x->V;
        int y = x->targets[i];
        if (y < 0) {  // ignored position
            if (x->losses) x->losses[i] = 0.0f;
            if (x->compute_grad) memset(z, 0, (size_t)x->V * sizeof(float));
            continue;
        }
        if (y >= x->V) fatal("crossentropy: target %d outside [0, %d)", y, x->V);
        float zy = z[y];
        float mx = -INFINITY;
        for (int j = 0; j < x->V; j++) mx = z[j] > mx ? z[j] : mx;
        // The exponentials are kept in place when the gradient is wanted (one expf per logit).
        double sum = 0.0;
        for (int j = 0; j < x->V; j++) {
            float e = expf(z[j] - mx);
            sum += e;
            if (x->compute_grad) z[j] = e;
        }
        if (x->losses) x->losses[i] = (float)((double)mx + log(sum) - (double)zy);
        if (x->compute_grad) {
            float inv = (float)(1.0 / sum);
            float py = z[y] * inv;
            for (int j = 0; j < x->V; j++) z[j] = (z[j] * inv) * x->grad_scale;
            z[y] = (py - 1.0f) * x->grad_scale;
        }
    }
}

static void cpu_crossentropy_forward_backward(void* ctx, void* logits, float* losses,
                                              const int32_t* targets, int n, int V,
                                              float grad_scale, int compute_grad) {
    XentArgs x = {.logits = logits, .losses = losses, .targets = targets, .n = n, .V = V,
                  .rows_per_task = rows_per_task((size_t)V), .compute_grad = compute_grad,
                  .grad_scale = grad_scale};
    cpu_run(ctx, task_count(n, x.rows_per_task), crossentropy_task, &x);
}

// ----------------------------------------------------------------------------
// clipped policy-gradient objective (GRPO) over a chunk of logits

typedef struct PolicyArgs {
    float* logits;           // (n, V), overwritten by dlogits when compute_grad
    float* logp;             // (n)
    float* losses;           // (n)
    const int32_t* targets;  // (n)
    const float *old_logp, *ref_logp, *adv, *weight;  // (n); ref_logp may be NULL
    int n, V, rows_per_task, compute_grad;
    float inv_temp, clip_low, clip_high, kl_beta;
} PolicyArgs;

static void policy_task(void* arg, int64_t task) {
    const PolicyArgs* x = arg;
    int i0 = (int)task * x->rows_per_task, i1 = imin(x->n, i0 + x->rows_per_task);
    for (int i = i0; i < i1; i++) {
        float* z = x->logits + (size_t)i * x->V;
        int y = x->targets[i];
        if (y < 0) {
            if (x->logp) x->logp[i] = 0.0f;
            if (x->losses) x->losses[i] = 0.0f;
            if (x->compute_grad) memset(z, 0, (size_t)x->V * sizeof(float));
            continue;
        }
        if (y >= x->V) fatal("policy loss: target %d outside [0, %d)", y, x->V);
        const float zy = z[y];
        float mx = -INFINITY;
        for (int j = 0; j < x->V; j++) mx = z[j] > mx ? z[j] : mx;
        double sum = 0.0;
        for (int j = 0; j < x->V; j++) {
            float e = expf((z[j] - mx) * x->inv_temp);
            sum += e;
            if (x->compute_grad) z[j] = e;
        }
        // the same arithmetic as the sampler's log-prob (generate.c), so that on-policy r = 1
        const double lp = (double)((zy - mx) * x->inv_temp) - log(sum);
        if (x->logp) x->logp[i] = (float)lp;
        const double A = x->adv[i], w = x->weight[i];
        const double r = exp(lp - (double)x->old_logp[i]);
        const double rc = fmin(fmax(r, 1.0 - x->clip_low), 1.0 + x->clip_high);
        // min(r A, clip(r) A): the clipped term is the smaller one exactly when the clip binds
        // in the direction the advantage pushes (r above 1 + ε_high for A > 0, below 1 - ε_low
        // for A < 0); there the objective is flat in θ
        const int clipped = rc * A < r * A;
        double loss = -(clipped ? rc * A : r * A), coef = clipped ? 0.0 : -r * A;
        if (x->ref_logp && x->kl_beta != 0.0f) {
            const double d = (double)x->ref_logp[i] - lp;
            loss += x->kl_beta * (exp(d) - d - 1.0);
            coef += x->kl_beta * (1.0 - exp(d));  // d k3 / d logp
        }
        if (x->losses) x->losses[i] = (float)(w * loss);
        if (x->compute_grad) {
            // d logp / d z_j = τ⁻¹ (onehot_j - p_j)
            const float g = (float)(w * coef * x->inv_temp), inv = (float)(1.0 / sum);
            const float py = z[y] * inv;
            for (int j = 0; j < x->V; j++) z[j] = -(z[j] * inv) * g;
            z[y] = (1.0f - py) * g;
        }
    }
}

static void cpu_policy_forward_backward(void* ctx, void* logits, float* logp, float* losses,
                                        const int32_t* targets, const float* old_logp,
                                        const float* ref_logp, const float* adv,
                                        const float* weight, int n, int V, float inv_temp,
                                        float clip_low, float clip_high, float kl_beta,
                                        int compute_grad) {
    PolicyArgs x = {.logits = logits, .logp = logp, .losses = losses, .targets = targets,
                    .old_logp = old_logp, .ref_logp = ref_logp, .adv = adv, .weight = weight,
                    .n = n, .V = V, .rows_per_task = rows_per_task((size_t)V),
                    .compute_grad = compute_grad, .inv_temp = inv_temp, .clip_low = clip_low,
                    .clip_high = clip_high, .kl_beta = kl_beta};
    cpu_run(ctx, task_count(n, x.rows_per_task), policy_task, &x);
}

// ----------------------------------------------------------------------------
// the table

void* ops_cpu_create(int n_threads) {
    CpuCtx* cx = calloc_check(1, sizeof(CpuCtx));
    cx->pool = threadpool_create(n_threads);
    pthread_check(pthread_mutex_init(&cx->run_mu, NULL));
    int level = ops_cpu_simd_level();
    cx->gemm_kernel = ops_cpu_gemm_kernel_pick(level);
    cx->att_row = ops_cpu_att_row_pick(level);
    return cx;
}

void ops_cpu_destroy(void* ctx) {
    if (!ctx) return;
    CpuCtx* cx = ctx;
    threadpool_destroy(cx->pool);
    pthread_check(pthread_mutex_destroy(&cx->run_mu));
    free(cx->down[0]);
    free(cx->down[1]);
    free(cx);
}

const Ops ops_cpu = {
    .name = "cpu",
    .act_bytes = 4,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .upload_f32 = cpu_upload_f32,
    .download_f32 = cpu_download_f32,
    .upload = cpu_upload,
    .download = cpu_download,
    .synchronize = cpu_synchronize,
    .upload_async = cpu_upload_async,
    .download_start = cpu_download_start,
    .download_finish = cpu_download_finish,
    .gather_ids = cpu_gather_ids,
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .residual_rmsnorm_forward = cpu_residual_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .matmul_forward = cpu_matmul_forward,
    .matmul_backward = cpu_matmul_backward,
    .qknorm_rope_forward = ops_cpu_qknorm_rope_forward,
    .qknorm_rope_backward = ops_cpu_qknorm_rope_backward,
    .attention_forward = ops_cpu_attention_forward,
    .attention_backward = ops_cpu_attention_backward,
    .swiglu_forward = cpu_swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .add = cpu_add,
    .scale = cpu_scale,
    .copy_cols = cpu_copy_cols,
    .add_f32 = cpu_add_f32,
    .crossentropy_forward_backward = cpu_crossentropy_forward_backward,
    .attention_decode = ops_cpu_attention_decode,
    .policy_forward_backward = cpu_policy_forward_backward,
    .attention_sink_forward = ops_cpu_attention_sink_forward,
    .attention_sink_backward = ops_cpu_attention_sink_backward,
    .moe_route_forward = ops_cpu_moe_route_forward,
    .moe_route_backward = ops_cpu_moe_route_backward,
    .moe_dispatch = ops_cpu_moe_dispatch,
    .moe_gather = ops_cpu_moe_gather,
    .moe_gather_backward = ops_cpu_moe_gather_backward,
    .moe_matmul_forward = ops_cpu_moe_matmul_forward,
    .moe_matmul_backward = ops_cpu_moe_matmul_backward,
    .gptoss_glu_forward = ops_cpu_gptoss_glu_forward,
    .gptoss_glu_backward = ops_cpu_gptoss_glu_backward,
    .moe_combine_forward = ops_cpu_moe_combine_forward,
    .moe_combine_backward = ops_cpu_moe_combine_backward,
    .moe_router_stats = ops_cpu_moe_router_stats,
    .matmul_cols_forward = cpu_matmul_cols_forward,
    .matmul_cols_backward = cpu_matmul_cols_backward,
    .dropout = cpu_dropout,
    .dequantize = cpu_dequantize,
};

