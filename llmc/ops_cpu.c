/*
 * ops_cpu.c — the fp32 CPU reference backend of the op table (ops.h).
 *
 * ctx is a CpuCtx: a ThreadPool plus the SIMD kernels picked for this CPU. Buffers are plain
 * 64-byte aligned host memory; uploads and downloads are memcpy. Ops may be called from several
 * threads on one ctx: their parallel loops take turns on the pool.
 *
 * Determinism: every op splits its work into tasks whose number and extent depend only on the
 * problem size (never on the thread count), and every floating-point sum runs in a fixed order
 * inside one task. Reductions over rows (parameter gradients) either loop the rows in order inside
 * a column task, or sum per-row-block partials in block order. So results are bit-identical for
 * any number of threads.
 *
 * Matmuls share one packed GEMM, C (+)= A·B with A and B given by strides: both operands are packed
 * into panels (A: GEMM_MR rows, B: GEMM_NR columns, k-major, zero-padded), a task owns a
 * GEMM_MC x GEMM_NC tile of C and walks K in GEMM_KC blocks in ascending order, so every output
 * element is summed k = 0, 1, ..., K-1. The register micro-kernel is chosen at ops_cpu_create:
 * AVX-512F, AVX2+FMA or portable C. Both SIMD kernels use one fused multiply-add per term in the
 * same order, so they agree bit for bit; the portable kernel rounds the product separately.
 * Building with -DOPS_CPU_KERNEL=0/1/2 forces portable/AVX2/AVX-512 (to test every kernel).
 *
 * Attention is flash-style on 32 x 32 blocks of queries x keys through the same micro-kernel,
 * with a branch-free exp that vectorises (compiled per SIMD level like the kernel); see there.
 *
 * Mixture of experts (Qwen3-MoE, GPT-OSS): routing, a stable counting-sort dispatch, gathers and
 * combines in fixed k order, and a grouped matmul that runs the packed GEMM once per expert on
 * its rows. GPT-OSS attention (sinks, sliding windows) is a plain row-by-row reference: the
 * models that need it are small on the CPU.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "ops.h"
#include "threads.h"

// ----------------------------------------------------------------------------
// context and task helpers

// C tile of one micro-kernel call: c (MR, ldc) (+)= a (kc, MR packed) · b (kc, NR packed).
typedef void (*GemmKernel)(int kc, const float* a, const float* b, float* c, int ldc, int load_c);
// One row of attention probabilities (and dS); see att_row_body.
typedef void (*AttRowFn)(float* x, float* ds, int first, int m, float scale, const float* shift,
                         const float* dsum);

typedef struct CpuCtx {
    ThreadPool* pool;
    pthread_mutex_t run_mu;  // ThreadPool runs one job at a time: callers on several threads queue
    GemmKernel gemm_kernel;  // both picked for this CPU's SIMD level at ops_cpu_create
    AttRowFn att_row;
} CpuCtx;

// Every parallel loop goes through here. The lock makes the backend safe to call from several
// threads at once (e.g. CPU streams sharing one ctx); results do not depend on the interleaving.
static void cpu_run(void* ctx, int64_t n_tasks, TaskFn fn, void* arg) {
    CpuCtx* cx = ctx;
    pthread_check(pthread_mutex_lock(&cx->run_mu));
    threadpool_run(cx->pool, n_tasks, fn, arg);
    pthread_check(pthread_mutex_unlock(&cx->run_mu));
}

static int64_t task_count(int64_t n, int64_t per_task) { return (n + per_task - 1) / per_task; }

// Rows per task for row-wise ops: about 16K elements of work each (fixed by the row width only).
static int rows_per_task(size_t row_elems) {
    size_t r = row_elems > 0 ? 16384 / row_elems : 16384;
    return r < 1 ? 1 : (int)r;
}

#define COL_BLOCK 64  // columns per task of the column-parallel reductions (dw, dbias, dwte)

// ----------------------------------------------------------------------------
// vector helper: a fixed-order dot product (16 interleaved partial sums, then a fixed tree)

static float vec_dot(const float* a, const float* b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < n; j++) acc[j] += a[i + j] * b[i + j];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

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

// dx = rstd * (g - x̂ * mean(g * x̂)), g = dy * w, x̂ = x * rstd (FORMATS_AND_MODELS.md §5.2).
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
// GEMM micro-kernels: c (MR rows, stride ldc) (+)= Σ_k a[k] ⊗ b[k] over packed panels

#define GEMM_MR 8    // rows of a micro-tile (A panel height)
#define GEMM_NR 32   // columns of a micro-tile (B panel width): two AVX-512 vectors
#define GEMM_KC 256  // k block: an A and a B micro-panel stay in L1/L2 across the tile loop
#define GEMM_MC 64   // rows of C per task (multiple of MR)
#define GEMM_NC 128  // columns of C per task (multiple of NR)

// 8 x 32 tile in 16 zmm accumulators; per k: 2 vector loads of b, 8 broadcasts of a, 16 FMAs.
__attribute__((target("avx512f"))) static void gemm_kernel_avx512(int kc, const float* a,
                                                                   const float* b, float* c,
                                                                   int ldc, int load_c) {
    __m512 acc[GEMM_MR][2];
#pragma GCC unroll 8
    for (int i = 0; i < GEMM_MR; i++) {
        acc[i][0] = load_c ? _mm512_loadu_ps(c + (size_t)i * ldc) : _mm512_setzero_ps();
        acc[i][1] = load_c ? _mm512_loadu_ps(c + (size_t)i * ldc + 16) : _mm512_setzero_ps();
    }
    for (int k = 0; k < kc; k++) {
        __m512 b0 = _mm512_load_ps(b + (size_t)k * GEMM_NR);
        __m512 b1 = _mm512_load_ps(b + (size_t)k * GEMM_NR + 16);
#pragma GCC unroll 8
        for (int i = 0; i < GEMM_MR; i++) {
            __m512 ai = _mm512_set1_ps(a[(size_t)k * GEMM_MR + i]);
            acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < GEMM_MR; i++) {
        _mm512_storeu_ps(c + (size_t)i * ldc, acc[i][0]);
        _mm512_storeu_ps(c + (size_t)i * ldc + 16, acc[i][1]);
    }
}

// AVX2 has 16 ymm registers: the 8 x 32 tile runs as four 4 x 16 passes (8 accumulators each).
__attribute__((target("avx2,fma"))) static void gemm_kernel_avx2(int kc, const float* a,
                                                                  const float* b, float* c,
                                                                  int ldc, int load_c) {
    for (int i0 = 0; i0 < GEMM_MR; i0 += 4) {
        for (int j0 = 0; j0 < GEMM_NR; j0 += 16) {
            __m256 acc[4][2];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                float* ci = c + (size_t)(i0 + i) * ldc + j0;
                acc[i][0] = load_c ? _mm256_loadu_ps(ci) : _mm256_setzero_ps();
                acc[i][1] = load_c ? _mm256_loadu_ps(ci + 8) : _mm256_setzero_ps();
            }
            for (int k = 0; k < kc; k++) {
                __m256 b0 = _mm256_load_ps(b + (size_t)k * GEMM_NR + j0);
                __m256 b1 = _mm256_load_ps(b + (size_t)k * GEMM_NR + j0 + 8);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    __m256 ai = _mm256_set1_ps(a[(size_t)k * GEMM_MR + i0 + i]);
                    acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
                }
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                float* ci = c + (size_t)(i0 + i) * ldc + j0;
                _mm256_storeu_ps(ci, acc[i][0]);
                _mm256_storeu_ps(ci + 8, acc[i][1]);
            }
        }
    }
}

static void gemm_kernel_portable(int kc, const float* a, const float* b, float* c, int ldc,
                                 int load_c) {
    float acc[GEMM_MR][GEMM_NR];
    for (int i = 0; i < GEMM_MR; i++)
        for (int j = 0; j < GEMM_NR; j++) acc[i][j] = load_c ? c[(size_t)i * ldc + j] : 0.0f;
    for (int k = 0; k < kc; k++)
        for (int i = 0; i < GEMM_MR; i++) {
            float ai = a[(size_t)k * GEMM_MR + i];
            for (int j = 0; j < GEMM_NR; j++) acc[i][j] += ai * b[(size_t)k * GEMM_NR + j];
        }
    for (int i = 0; i < GEMM_MR; i++)
        for (int j = 0; j < GEMM_NR; j++) c[(size_t)i * ldc + j] = acc[i][j];
}

// 2: AVX-512F, 1: AVX2 + FMA, 0: portable C. -DOPS_CPU_KERNEL=level forces one (tests).
static int cpu_simd_level(void) {
#if defined(OPS_CPU_KERNEL)
    return OPS_CPU_KERNEL;
#else
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
#endif
}

// ----------------------------------------------------------------------------
// packed GEMM: C (M, Nc) (+)= A (M, K) · B (K, Nc) (+ bias)

typedef struct Gemm {
    int M, Nc, K;
    const float* a;  // A[i][k] = a[i * a_rs + k * a_cs]
    size_t a_rs, a_cs;
    const float* b;  // B[k][j] = b[k * b_rs + j * b_cs]
    size_t b_rs, b_cs;
    float* c;  // C[i][j] = c[i * ldc + j]
    int ldc;
    int accumulate;     // 1: C += A·B, 0: C = A·B
    const float* bias;  // (Nc) added after the product, or NULL
    float* a_pack;      // (ceil(M / MR), K, MR)
    float* b_pack;      // (ceil(Nc / NR), K, NR)
    int a_panels, b_panels, row_tiles, col_tiles;
    GemmKernel kernel;
} Gemm;

// Panels are zero-padded past the last row / column, so the kernel always runs whole tiles.
static void gemm_pack_a(const Gemm* g, int p) {
    int i0 = p * GEMM_MR, m = imin(GEMM_MR, g->M - i0);
    float* dst = g->a_pack + (size_t)p * g->K * GEMM_MR;
    if (m < GEMM_MR) memset(dst, 0, (size_t)g->K * GEMM_MR * sizeof(float));
    if (g->a_cs == 1) {  // rows of A are contiguous: read along k
        for (int i = 0; i < m; i++) {
            const float* src = g->a + (size_t)(i0 + i) * g->a_rs;
            for (int k = 0; k < g->K; k++) dst[(size_t)k * GEMM_MR + i] = src[k];
        }
    } else {  // columns of A are contiguous (A = doutᵀ): read MR-wide row segments
        for (int k = 0; k < g->K; k++)
            for (int i = 0; i < m; i++)
                dst[(size_t)k * GEMM_MR + i] =
                    g->a[(size_t)(i0 + i) * g->a_rs + (size_t)k * g->a_cs];
    }
}

static void gemm_pack_b(const Gemm* g, int p) {
    int j0 = p * GEMM_NR, n = imin(GEMM_NR, g->Nc - j0);
    float* dst = g->b_pack + (size_t)p * g->K * GEMM_NR;
    if (n < GEMM_NR) memset(dst, 0, (size_t)g->K * GEMM_NR * sizeof(float));
    if (g->b_cs == 1) {  // rows of B are contiguous: copy row segments
        for (int k = 0; k < g->K; k++)
            memcpy(dst + (size_t)k * GEMM_NR, g->b + (size_t)k * g->b_rs + j0,
                   (size_t)n * sizeof(float));
    } else {  // columns of B are contiguous (B = Wᵀ): read along k
        for (int j = 0; j < n; j++) {
            const float* src = g->b + (size_t)(j0 + j) * g->b_cs;
            for (int k = 0; k < g->K; k++) dst[(size_t)k * GEMM_NR + j] = src[(size_t)k * g->b_rs];
        }
    }
}

static void gemm_pack_task(void* arg, int64_t task) {
    const Gemm* g = arg;
    if (task < g->a_panels) gemm_pack_a(g, (int)task);
    else gemm_pack_b(g, (int)(task - g->a_panels));
}

// One micro-tile at C[i][j]; edge tiles go through a full-size scratch tile.
static void gemm_micro_tile(const Gemm* g, int kc, const float* ap, const float* bp, int i, int j,
                            int load_c) {
    int m = imin(GEMM_MR, g->M - i), n = imin(GEMM_NR, g->Nc - j);
    float* c = g->c + (size_t)i * g->ldc + j;
    if (m == GEMM_MR && n == GEMM_NR) {
        g->kernel(kc, ap, bp, c, g->ldc, load_c);
        return;
    }
    _Alignas(64) float tmp[GEMM_MR * GEMM_NR] = {0};
    if (load_c)
        for (int r = 0; r < m; r++)
            memcpy(tmp + r * GEMM_NR, c + (size_t)r * g->ldc, n * sizeof(float));
    g->kernel(kc, ap, bp, tmp, GEMM_NR, load_c);
    for (int r = 0; r < m; r++)
        memcpy(c + (size_t)r * g->ldc, tmp + r * GEMM_NR, n * sizeof(float));
}

static void gemm_tile_task(void* arg, int64_t task) {
    const Gemm* g = arg;
    int i_begin = (int)(task / g->col_tiles) * GEMM_MC, i_end = imin(g->M, i_begin + GEMM_MC);
    int j_begin = (int)(task % g->col_tiles) * GEMM_NC, j_end = imin(g->Nc, j_begin + GEMM_NC);
    // k blocks ascend, so every element of C is summed in the order k = 0 .. K-1.
    for (int k0 = 0; k0 < g->K; k0 += GEMM_KC) {
        int kc = imin(GEMM_KC, g->K - k0);
        int load_c = g->accumulate || k0 > 0;
        for (int j = j_begin; j < j_end; j += GEMM_NR) {
            const float* bp = g->b_pack + ((size_t)(j / GEMM_NR) * g->K + k0) * GEMM_NR;
            for (int i = i_begin; i < i_end; i += GEMM_MR) {
                const float* ap = g->a_pack + ((size_t)(i / GEMM_MR) * g->K + k0) * GEMM_MR;
                gemm_micro_tile(g, kc, ap, bp, i, j, load_c);
            }
        }
    }
    for (int i = i_begin; i < i_end; i++) {
        float* c = g->c + (size_t)i * g->ldc;
        if (g->K == 0 && !g->accumulate)
            for (int j = j_begin; j < j_end; j++) c[j] = 0.0f;
        if (g->bias)
            for (int j = j_begin; j < j_end; j++) c[j] += g->bias[j];
    }
}

static void gemm_run(CpuCtx* cx, Gemm* g) {
    if (g->M <= 0 || g->Nc <= 0) return;
    g->kernel = cx->gemm_kernel;
    g->a_panels = (int)task_count(g->M, GEMM_MR);
    g->b_panels = (int)task_count(g->Nc, GEMM_NR);
    g->row_tiles = (int)task_count(g->M, GEMM_MC);
    g->col_tiles = (int)task_count(g->Nc, GEMM_NC);
    g->a_pack = aligned_alloc_check((size_t)g->a_panels * GEMM_MR * g->K * sizeof(float));
    g->b_pack = aligned_alloc_check((size_t)g->b_panels * GEMM_NR * g->K * sizeof(float));
    cpu_run(cx, g->a_panels + g->b_panels, gemm_pack_task, g);
    cpu_run(cx, (int64_t)g->row_tiles * g->col_tiles, gemm_tile_task, g);
    free(g->a_pack);
    free(g->b_pack);
}

// ----------------------------------------------------------------------------
// matmul

static void cpu_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                               const void* bias, int N, int IC, int OC) {
    // out (N, OC) = inp (N, IC) · wᵀ: B[k][j] = w[j][k].
    Gemm g = {.M = N, .Nc = OC, .K = IC, .a = inp, .a_rs = (size_t)IC, .a_cs = 1, .b = w,
              .b_rs = 1, .b_cs = (size_t)IC, .c = out, .ldc = OC, .accumulate = 0, .bias = bias};
    gemm_run(ctx, &g);
}

typedef struct DbiasArgs {
    float* dbias;       // (OC)
    const float* dout;  // (N, OC)
    int N, OC;
} DbiasArgs;

static void matmul_dbias_task(void* arg, int64_t task) {
    const DbiasArgs* d = arg;
    int c0 = (int)task * COL_BLOCK, c1 = imin(d->OC, c0 + COL_BLOCK);
    float acc[COL_BLOCK] = {0};
    for (int n = 0; n < d->N; n++) {
        const float* row = d->dout + (size_t)n * d->OC;
        for (int c = c0; c < c1; c++) acc[c - c0] += row[c];
    }
    for (int c = c0; c < c1; c++) d->dbias[c] += acc[c - c0];
}

static void cpu_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias, const void* dout,
                                const void* inp, const void* w, int N, int IC, int OC) {
    if (dinp) {  // dinp (N, IC) = dout (N, OC) · w (OC, IC)
        Gemm g = {.M = N, .Nc = IC, .K = OC, .a = dout, .a_rs = (size_t)OC, .a_cs = 1, .b = w,
                  .b_rs = (size_t)IC, .b_cs = 1, .c = dinp, .ldc = IC, .accumulate = 0};
        gemm_run(ctx, &g);
    }
    if (dw) {  // dw (OC, IC) += doutᵀ (OC, N) · inp (N, IC): A[i][k] = dout[k][i]
        Gemm g = {.M = OC, .Nc = IC, .K = N, .a = dout, .a_rs = 1, .a_cs = (size_t)OC, .b = inp,
                  .b_rs = (size_t)IC, .b_cs = 1, .c = dw, .ldc = IC, .accumulate = 1};
        gemm_run(ctx, &g);
    }
    if (dbias) {
        DbiasArgs d = {.dbias = dbias, .dout = dout, .N = N, .OC = OC};
        cpu_run(ctx, task_count(OC, COL_BLOCK), matmul_dbias_task, &d);
    }
}

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

static void cpu_qknorm_rope_forward(void* ctx, void* out, float* rstd, const void* inp,
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

static void cpu_qknorm_rope_backward(void* ctx, void* dinp, float* dq_norm_w, float* dk_norm_w,
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

static AttnArgs attention_args(CpuCtx* cx, int B, int T, int H, int KVH, int HD) {
    return (AttnArgs){.kernel = cx->gemm_kernel, .row = cx->att_row, .B = B, .T = T, .H = H,
                      .KVH = KVH, .HD = HD, .QKV = (H + 2 * KVH) * HD,
                      .blocks = (int)task_count(T, ATT_BLOCK),
                      .HDp = (int)task_count(HD, GEMM_NR) * GEMM_NR,
                      .scale = 1.0f / sqrtf((float)HD)};
}

static void cpu_attention_forward(void* ctx, void* out, float* lse, const void* qkv, int B, int T,
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

static void cpu_attention_backward(void* ctx, void* dqkv, const void* dout, const void* qkv,
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
// SwiGLU

typedef struct SwigluArgs {
    float* out;         // (N, F) forward / (N, 2F) backward dgu
    const float* gu;    // (N, 2F) = [gate | up]
    const float* dout;  // (N, F)
    int N, F, rows_per_task;
} SwigluArgs;

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

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

// du = dy silu(a); da = dy u σ(a) (1 + a (1 - σ(a))) (FORMATS_AND_MODELS.md §5.5).
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

static void cpu_add_f32(void* ctx, float* dst, const float* src, size_t n) {
    cpu_add(ctx, dst, dst, src, n);  // fp32 activations: the same single rounding per element
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

static void cpu_attention_sink_forward(void* ctx, void* out, float* lse, const void* qkv,
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

static void cpu_attention_sink_backward(void* ctx, void* dqkv, float* dsinks, const void* dout,
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
// mixture of experts: routing

typedef struct RouteArgs {
    int32_t* idx;          // (n, K)
    float* weights;        // (n, K)
    float* dlogits;        // (n, E) backward
    const float* logits;   // (n, E)
    const float* dweights; // (n, K) backward
    const float* cweights; // (n, K) backward: the forward's weights
    const int32_t* cidx;   // (n, K) backward
    const float* counts;   // (E) backward, aux term
    float aux_scale;
    int n, E, K, mode, rows_per_task;
} RouteArgs;

// p (E) = softmax(z) in fp32 with a double sum (the Qwen3-MoE router, HF's fp32 softmax).
static void softmax_row(float* p, const float* z, int E) {
    float m = -INFINITY;
    for (int e = 0; e < E; e++) m = z[e] > m ? z[e] : m;
    double sum = 0.0;
    for (int e = 0; e < E; e++) {
        p[e] = expf(z[e] - m);
        sum += p[e];
    }
    const float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++) p[e] *= inv;
}

// The K largest of v (E), best first; a tie goes to the lower index (strict > while scanning up).
static void topk_row(int32_t* idx, const float* v, int E, int K) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k && !taken; j++) taken = idx[j] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        idx[k] = best;
    }
}

static void route_forward_task(void* arg, int64_t task) {
    const RouteArgs* r = arg;
    float* p = malloc_check((size_t)r->E * sizeof(float));
    const int n0 = (int)task * r->rows_per_task, n1 = imin(r->n, n0 + r->rows_per_task);
    for (int i = n0; i < n1; i++) {
        const float* z = r->logits + (size_t)i * r->E;
        int32_t* idx = r->idx + (size_t)i * r->K;
        float* w = r->weights + (size_t)i * r->K;
        if (r->mode == MOE_ROUTE_TOPK_SOFTMAX) {
            // top-k on the raw logits, softmax over the K chosen (the first is the largest)
            topk_row(idx, z, r->E, r->K);
            double sum = 0.0;
            for (int k = 0; k < r->K; k++) {
                w[k] = expf(z[idx[k]] - z[idx[0]]);
                sum += w[k];
            }
            for (int k = 0; k < r->K; k++) w[k] = (float)(w[k] / sum);
            continue;
        }
        softmax_row(p, z, r->E);
        topk_row(idx, p, r->E, r->K);
        double sum = 0.0;
        for (int k = 0; k < r->K; k++) sum += p[idx[k]];
        for (int k = 0; k < r->K; k++)
            w[k] = r->mode == MOE_ROUTE_SOFTMAX_TOPK_NORM ? (float)(p[idx[k]] / sum) : p[idx[k]];
    }
    free(p);
}

static void cpu_moe_route_forward(void* ctx, int32_t* idx, float* weights, const void* logits,
                                  int n, int E, int K, int mode) {
    RouteArgs r = {.idx = idx, .weights = weights, .logits = logits, .n = n, .E = E, .K = K,
                   .mode = mode, .rows_per_task = rows_per_task((size_t)E * 4)};
    cpu_run(ctx, task_count(n, r.rows_per_task), route_forward_task, &r);
}

// Renormalised modes: w = softmax over the chosen logits, so dl_{i_k} = w_k (dw_k - Σ_j w_j dw_j)
// and nothing reaches the others. Plain mode: w_k = p_{i_k}, so dl_j = p_j (dw(j) - Σ_k w_k dw_k)
// over all j, dw(j) = dw_k where j = i_k, else 0. The aux term: aux_scale p_j (c_j - Σ_e c_e p_e).
static void route_backward_task(void* arg, int64_t task) {
    const RouteArgs* r = arg;
    float* p = malloc_check((size_t)r->E * sizeof(float));
    const int n0 = (int)task * r->rows_per_task, n1 = imin(r->n, n0 + r->rows_per_task);
    for (int i = n0; i < n1; i++) {
        const float* z = r->logits + (size_t)i * r->E;
        const int32_t* idx = r->cidx + (size_t)i * r->K;
        const float* w = r->cweights + (size_t)i * r->K;
        const float* dw = r->dweights + (size_t)i * r->K;
        float* dl = r->dlogits + (size_t)i * r->E;
        double wdw = 0.0;
        for (int k = 0; k < r->K; k++) wdw += (double)w[k] * dw[k];
        const int need_p = r->mode == MOE_ROUTE_SOFTMAX_TOPK || r->aux_scale != 0.0f;
        if (need_p) softmax_row(p, z, r->E);
        if (r->mode == MOE_ROUTE_SOFTMAX_TOPK) {
            for (int e = 0; e < r->E; e++) dl[e] = (float)(-(double)p[e] * wdw);
            for (int k = 0; k < r->K; k++) dl[idx[k]] += p[idx[k]] * dw[k];
        } else {
            for (int e = 0; e < r->E; e++) dl[e] = 0.0f;
            for (int k = 0; k < r->K; k++) dl[idx[k]] = (float)(w[k] * (dw[k] - wdw));
        }
        if (r->aux_scale != 0.0f) {
            double cp = 0.0;
            for (int e = 0; e < r->E; e++) cp += (double)r->counts[e] * p[e];
            for (int e = 0; e < r->E; e++)
                dl[e] += (float)(r->aux_scale * p[e] * (r->counts[e] - cp));
        }
    }
    free(p);
}

static void cpu_moe_route_backward(void* ctx, void* dlogits, const float* dweights,
                                   const void* logits, const int32_t* idx, const float* weights,
                                   const float* counts, float aux_scale, int n, int E, int K,
                                   int mode) {
    RouteArgs r = {.dlogits = dlogits, .dweights = dweights, .logits = logits, .cidx = idx,
                   .cweights = weights, .counts = counts, .aux_scale = aux_scale, .n = n, .E = E,
                   .K = K, .mode = mode, .rows_per_task = rows_per_task((size_t)E * 4)};
    cpu_run(ctx, task_count(n, r.rows_per_task), route_backward_task, &r);
}

// A counting sort, on the calling thread: O(n K + E), small next to the experts' matmuls.
static void cpu_moe_dispatch(void* ctx, int32_t* offsets, int32_t* src, int32_t* dst,
                             const int32_t* idx, int n, int E, int K) {
    (void)ctx;
    const int64_t R = (int64_t)n * K;
    for (int e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t r = 0; r < R; r++) {
        if (idx[r] < 0 || idx[r] >= E) fatal("moe_dispatch: expert %d outside [0, %d)", idx[r], E);
        offsets[idx[r] + 1]++;
    }
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int32_t* cursor = malloc_check((size_t)(E > 0 ? E : 1) * sizeof(int32_t));
    for (int e = 0; e < E; e++) cursor[e] = offsets[e];
    for (int64_t r = 0; r < R; r++) {
        int32_t pos = cursor[idx[r]]++;
        src[pos] = (int32_t)r;
        dst[r] = pos;
    }
    free(cursor);
}

// ----------------------------------------------------------------------------
// mixture of experts: gather, combine, statistics

typedef struct MoeRowArgs {
    float* out;
    float* dweights;        // combine backward
    const float* inp;
    const float* y;
    const float* weights;
    const int32_t* map;     // src (gather) or dst (the rest)
    int n, K, C, rows_per_task;
} MoeRowArgs;

static void moe_gather_task(void* arg, int64_t task) {
    const MoeRowArgs* a = arg;
    const int64_t R = (int64_t)a->n * a->K;
    const int64_t i0 = task * a->rows_per_task, i1 = i0 + a->rows_per_task < R ? i0 + a->rows_per_task : R;
    for (int64_t i = i0; i < i1; i++)
        memcpy(a->out + (size_t)i * a->C, a->inp + (size_t)(a->map[i] / a->K) * a->C,
               (size_t)a->C * sizeof(float));
}

static void cpu_moe_gather(void* ctx, void* out, const void* inp, const int32_t* src, int n, int K,
                           int C) {
    MoeRowArgs a = {.out = out, .inp = inp, .map = src, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C)};
    cpu_run(ctx, task_count((int64_t)n * K, a.rows_per_task), moe_gather_task, &a);
}

// Rows of the n tokens: gather backward (weights NULL) or combine forward, Σ over k in order.
static void moe_sum_rows_task(void* arg, int64_t task) {
    const MoeRowArgs* a = arg;
    const int i0 = (int)task * a->rows_per_task, i1 = imin(a->n, i0 + a->rows_per_task);
    for (int i = i0; i < i1; i++) {
        float* o = a->out + (size_t)i * a->C;
        for (int c = 0; c < a->C; c++) o[c] = 0.0f;
        for (int k = 0; k < a->K; k++) {
            const float* y = a->y + (size_t)a->map[(size_t)i * a->K + k] * a->C;
            const float w = a->weights ? a->weights[(size_t)i * a->K + k] : 1.0f;
            if (a->weights)
                for (int c = 0; c < a->C; c++) o[c] += w * y[c];
            else
                for (int c = 0; c < a->C; c++) o[c] += y[c];
        }
    }
}

static void cpu_moe_gather_backward(void* ctx, void* dinp, const void* dout, const int32_t* dst,
                                    int n, int K, int C) {
    MoeRowArgs a = {.out = dinp, .y = dout, .map = dst, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C * K)};
    cpu_run(ctx, task_count(n, a.rows_per_task), moe_sum_rows_task, &a);
}

static void cpu_moe_combine_forward(void* ctx, void* out, const void* y, const float* weights,
                                    const int32_t* dst, int n, int K, int C) {
    MoeRowArgs a = {.out = out, .y = y, .weights = weights, .map = dst, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C * K)};
    cpu_run(ctx, task_count(n, a.rows_per_task), moe_sum_rows_task, &a);
}

static void moe_combine_backward_task(void* arg, int64_t task) {
    const MoeRowArgs* a = arg;
    const int i0 = (int)task * a->rows_per_task, i1 = imin(a->n, i0 + a->rows_per_task);
    for (int i = i0; i < i1; i++) {
        const float* g = a->inp + (size_t)i * a->C;  // dout of the row
        for (int k = 0; k < a->K; k++) {
            const size_t r = (size_t)a->map[(size_t)i * a->K + k];
            const float w = a->weights[(size_t)i * a->K + k];
            float* dy = a->out + r * a->C;
            for (int c = 0; c < a->C; c++) dy[c] = w * g[c];
            a->dweights[(size_t)i * a->K + k] = vec_dot(g, a->y + r * a->C, a->C);
        }
    }
}

static void cpu_moe_combine_backward(void* ctx, void* dy, float* dweights, const void* dout,
                                     const void* y, const float* weights, const int32_t* dst,
                                     int n, int K, int C) {
    MoeRowArgs a = {.out = dy, .dweights = dweights, .inp = dout, .y = y, .weights = weights,
                    .map = dst, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C * K)};
    cpu_run(ctx, task_count(n, a.rows_per_task), moe_combine_backward_task, &a);
}

typedef struct StatsArgs {
    float* probs;          // (n, E) scratch
    float* stats;          // (2E)
    const float* logits;   // (n, E)
    int n, E, rows_per_task;
} StatsArgs;

static void stats_softmax_task(void* arg, int64_t task) {
    const StatsArgs* a = arg;
    const int i0 = (int)task * a->rows_per_task, i1 = imin(a->n, i0 + a->rows_per_task);
    for (int i = i0; i < i1; i++)
        softmax_row(a->probs + (size_t)i * a->E, a->logits + (size_t)i * a->E, a->E);
}

// Column block of Σ_rows p, rows in order (double sums).
static void stats_sum_task(void* arg, int64_t task) {
    const StatsArgs* a = arg;
    const int c0 = (int)task * COL_BLOCK, c1 = imin(a->E, c0 + COL_BLOCK);
    double acc[COL_BLOCK] = {0};
    for (int i = 0; i < a->n; i++)
        for (int c = c0; c < c1; c++) acc[c - c0] += a->probs[(size_t)i * a->E + c];
    for (int c = c0; c < c1; c++) a->stats[a->E + c] = (float)acc[c - c0];
}

static void cpu_moe_router_stats(void* ctx, float* stats, const void* logits,
                                 const int32_t* offsets, int n, int E) {
    StatsArgs a = {.probs = malloc_check((size_t)(n > 0 ? n : 1) * E * sizeof(float)),
                   .stats = stats, .logits = logits, .n = n, .E = E,
                   .rows_per_task = rows_per_task((size_t)E * 4)};
    cpu_run(ctx, task_count(n, a.rows_per_task), stats_softmax_task, &a);
    cpu_run(ctx, task_count(E, COL_BLOCK), stats_sum_task, &a);
    for (int e = 0; e < E; e++) stats[e] = (float)(offsets[e + 1] - offsets[e]);
    free(a.probs);
}

// ----------------------------------------------------------------------------
// mixture of experts: grouped matmul (the packed GEMM once per expert, on its rows)

static void cpu_moe_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                                   const void* bias, const int32_t* offsets, int R, int E, int IC,
                                   int OC, int w_in_out) {
    (void)R;
    for (int e = 0; e < E; e++) {
        const int r0 = offsets[e], M = offsets[e + 1] - offsets[e];
        if (M <= 0) continue;
        const float* we = (const float*)w + (size_t)e * IC * OC;
        Gemm g = {.M = M, .Nc = OC, .K = IC, .a = (const float*)inp + (size_t)r0 * IC,
                  .a_rs = (size_t)IC, .a_cs = 1, .b = we,
                  .b_rs = w_in_out ? (size_t)OC : 1, .b_cs = w_in_out ? 1 : (size_t)IC,
                  .c = (float*)out + (size_t)r0 * OC, .ldc = OC, .accumulate = 0,
                  .bias = bias ? (const float*)bias + (size_t)e * OC : NULL};
        gemm_run(ctx, &g);
    }
}

static void cpu_moe_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias,
                                    const void* dout, const void* inp, const void* w,
                                    const int32_t* offsets, int R, int E, int IC, int OC,
                                    int w_in_out) {
    (void)R;
    for (int e = 0; e < E; e++) {
        const int r0 = offsets[e], M = offsets[e + 1] - offsets[e];
        if (M <= 0) continue;
        const float* we = (const float*)w + (size_t)e * IC * OC;
        const float* go = (const float*)dout + (size_t)r0 * OC;
        const float* x = (const float*)inp + (size_t)r0 * IC;
        if (dinp) {  // dinp (M, IC) = dout (M, OC) · W_e as (OC, IC)
            Gemm g = {.M = M, .Nc = IC, .K = OC, .a = go, .a_rs = (size_t)OC, .a_cs = 1,
                      .b = we, .b_rs = w_in_out ? 1 : (size_t)IC, .b_cs = w_in_out ? (size_t)OC : 1,
                      .c = (float*)dinp + (size_t)r0 * IC, .ldc = IC, .accumulate = 0};
            gemm_run(ctx, &g);
        }
        if (dw && !w_in_out) {  // dw_e (OC, IC) += doutᵀ · inp
            Gemm g = {.M = OC, .Nc = IC, .K = M, .a = go, .a_rs = 1, .a_cs = (size_t)OC, .b = x,
                      .b_rs = (size_t)IC, .b_cs = 1, .c = dw + (size_t)e * IC * OC, .ldc = IC,
                      .accumulate = 1};
            gemm_run(ctx, &g);
        } else if (dw) {  // dw_e (IC, OC) += inpᵀ · dout
            Gemm g = {.M = IC, .Nc = OC, .K = M, .a = x, .a_rs = 1, .a_cs = (size_t)IC, .b = go,
                      .b_rs = (size_t)OC, .b_cs = 1, .c = dw + (size_t)e * IC * OC, .ldc = OC,
                      .accumulate = 1};
            gemm_run(ctx, &g);
        }
        if (dbias) {
            DbiasArgs d = {.dbias = dbias + (size_t)e * OC, .dout = go, .N = M, .OC = OC};
            cpu_run(ctx, task_count(OC, COL_BLOCK), matmul_dbias_task, &d);
        }
    }
}

// ----------------------------------------------------------------------------
// GPT-OSS expert activation (interleaved gate/up, clamped, (up + 1) · gate · σ(alpha gate))

typedef struct GluArgs {
    float* out;
    const float* gu;    // (R, 2F) interleaved
    const float* dout;  // (R, F)
    int R, F, rows_per_task;
    float limit, alpha;
} GluArgs;

static void glu_forward_task(void* arg, int64_t task) {
    const GluArgs* a = arg;
    const int r0 = (int)task * a->rows_per_task, r1 = imin(a->R, r0 + a->rows_per_task);
    for (int r = r0; r < r1; r++) {
        const float* gu = a->gu + (size_t)r * 2 * a->F;
        float* o = a->out + (size_t)r * a->F;
        for (int i = 0; i < a->F; i++) {
            float g = fminf(gu[2 * i], a->limit);
            float u = fmaxf(fminf(gu[2 * i + 1], a->limit), -a->limit);
            o[i] = (u + 1.0f) * (g * sigmoidf(a->alpha * g));
        }
    }
}

static void cpu_gptoss_glu_forward(void* ctx, void* out, const void* gu, int R, int F, float limit,
                                   float alpha) {
    GluArgs a = {.out = out, .gu = gu, .R = R, .F = F, .limit = limit, .alpha = alpha,
                 .rows_per_task = rows_per_task((size_t)F)};
    cpu_run(ctx, task_count(R, a.rows_per_task), glu_forward_task, &a);
}

// torch.clamp passes the gradient where min <= x <= max (the bounds included).
static void glu_backward_task(void* arg, int64_t task) {
    const GluArgs* a = arg;
    const int r0 = (int)task * a->rows_per_task, r1 = imin(a->R, r0 + a->rows_per_task);
    for (int r = r0; r < r1; r++) {
        const float* gu = a->gu + (size_t)r * 2 * a->F;
        const float* dy = a->dout + (size_t)r * a->F;
        float* dgu = a->out + (size_t)r * 2 * a->F;
        for (int i = 0; i < a->F; i++) {
            const float gate = gu[2 * i], up = gu[2 * i + 1];
            const float g = fminf(gate, a->limit);
            const float u = fmaxf(fminf(up, a->limit), -a->limit);
            const float sg = sigmoidf(a->alpha * g);
            const float glu = g * sg;
            const float dglu = sg + a->alpha * g * sg * (1.0f - sg);
            dgu[2 * i] = gate <= a->limit ? dy[i] * (u + 1.0f) * dglu : 0.0f;
            dgu[2 * i + 1] = up >= -a->limit && up <= a->limit ? dy[i] * glu : 0.0f;
        }
    }
}

static void cpu_gptoss_glu_backward(void* ctx, void* dgu, const void* dout, const void* gu, int R,
                                    int F, float limit, float alpha) {
    GluArgs a = {.out = dgu, .gu = gu, .dout = dout, .R = R, .F = F, .limit = limit,
                 .alpha = alpha, .rows_per_task = rows_per_task((size_t)F)};
    cpu_run(ctx, task_count(R, a.rows_per_task), glu_backward_task, &a);
}

// ----------------------------------------------------------------------------
// the table

void* ops_cpu_create(int n_threads) {
    CpuCtx* cx = calloc_check(1, sizeof(CpuCtx));
    cx->pool = threadpool_create(n_threads);
    pthread_check(pthread_mutex_init(&cx->run_mu, NULL));
    int level = cpu_simd_level();
    cx->gemm_kernel = level == 2   ? gemm_kernel_avx512
                      : level == 1 ? gemm_kernel_avx2
                                   : gemm_kernel_portable;
    cx->att_row = level == 2 ? att_row_avx512 : level == 1 ? att_row_avx2 : att_row_portable;
    return cx;
}

void ops_cpu_destroy(void* ctx) {
    if (!ctx) return;
    CpuCtx* cx = ctx;
    threadpool_destroy(cx->pool);
    pthread_check(pthread_mutex_destroy(&cx->run_mu));
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
    .embedding_forward = cpu_embedding_forward,
    .embedding_backward = cpu_embedding_backward,
    .rmsnorm_forward = cpu_rmsnorm_forward,
    .residual_rmsnorm_forward = cpu_residual_rmsnorm_forward,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .matmul_forward = cpu_matmul_forward,
    .matmul_backward = cpu_matmul_backward,
    .qknorm_rope_forward = cpu_qknorm_rope_forward,
    .qknorm_rope_backward = cpu_qknorm_rope_backward,
    .attention_forward = cpu_attention_forward,
    .attention_backward = cpu_attention_backward,
    .swiglu_forward = cpu_swiglu_forward,
    .swiglu_backward = cpu_swiglu_backward,
    .add = cpu_add,
    .add_f32 = cpu_add_f32,
    .crossentropy_forward_backward = cpu_crossentropy_forward_backward,
    .attention_sink_forward = cpu_attention_sink_forward,
    .attention_sink_backward = cpu_attention_sink_backward,
    .moe_route_forward = cpu_moe_route_forward,
    .moe_route_backward = cpu_moe_route_backward,
    .moe_dispatch = cpu_moe_dispatch,
    .moe_gather = cpu_moe_gather,
    .moe_gather_backward = cpu_moe_gather_backward,
    .moe_matmul_forward = cpu_moe_matmul_forward,
    .moe_matmul_backward = cpu_moe_matmul_backward,
    .gptoss_glu_forward = cpu_gptoss_glu_forward,
    .gptoss_glu_backward = cpu_gptoss_glu_backward,
    .moe_combine_forward = cpu_moe_combine_forward,
    .moe_combine_backward = cpu_moe_combine_backward,
    .moe_router_stats = cpu_moe_router_stats,
};
