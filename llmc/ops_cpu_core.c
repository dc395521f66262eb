/*
 * ops_cpu_core.c — the CPU backend's infrastructure, below every op file (ops_cpu.c,
 * ops_cpu_attention.c, ops_cpu_moe.c): the GEMM register micro-kernels and the SIMD level that
 * picks them, the packed GEMM every matmul runs through, and the column-blocked bias gradient.
 * The context (CpuCtx) and the task runner (cpu_run) it uses are declared in ops_cpu_core.h.
 * It calls no op file: the imports of the backend point down to here.
 *
 * Matmuls share one packed GEMM, C (+)= A·B with A and B given by strides: both operands are packed
 * into panels (A: GEMM_MR rows, B: GEMM_NR columns, k-major, zero-padded), a task owns a
 * GEMM_MC x GEMM_NC tile of C and walks K in GEMM_KC blocks in ascending order, so every output
 * element is summed k = 0, 1, ..., K-1. The register micro-kernel is chosen at ops_cpu_create:
 * AVX-512F, AVX2+FMA or portable C. Both SIMD kernels use one fused multiply-add per term in the
 * same order, so they agree bit for bit; the portable kernel rounds the product separately.
 * Building with -DOPS_CPU_KERNEL=0/1/2 forces portable/AVX2/AVX-512 (to test every kernel).
 */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu_core.h"

// ----------------------------------------------------------------------------
// GEMM micro-kernels: c (MR rows, stride ldc) (+)= Σ_k a[k] ⊗ b[k] over packed panels

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
int ops_cpu_simd_level(void) {
#if defined(OPS_CPU_KERNEL)
    return OPS_CPU_KERNEL;
#else
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
#endif
}

GemmKernel ops_cpu_gemm_kernel_pick(int simd_level) {
    return simd_level == 2   ? gemm_kernel_avx512
           : simd_level == 1 ? gemm_kernel_avx2
                             : gemm_kernel_portable;
}

// ----------------------------------------------------------------------------
// packed GEMM: C (M, Nc) (+)= A (M, K) · B (K, Nc) (+ bias)

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

void ops_cpu_gemm_run(CpuCtx* cx, Gemm* g) {
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

// What ops_cpu_gemm_run allocates for the product (run's memory estimate, memory.c).
size_t ops_cpu_gemm_temp_bytes(int64_t M, int64_t Nc, int64_t K) {
    if (M <= 0 || Nc <= 0) return 0;  // (ops_cpu_gemm_run returns before packing)
    return ((size_t)task_count(M, GEMM_MR) * GEMM_MR + (size_t)task_count(Nc, GEMM_NR) * GEMM_NR) *
           (size_t)K * sizeof(float);
}

// ----------------------------------------------------------------------------
// dbias: the bias gradient of the matmuls (dense and per expert)

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

void ops_cpu_dbias(CpuCtx* cx, float* dbias, const float* dout, int N, int OC) {
    DbiasArgs d = {.dbias = dbias, .dout = dout, .N = N, .OC = OC};
    cpu_run(cx, task_count(OC, COL_BLOCK), matmul_dbias_task, &d);
}
