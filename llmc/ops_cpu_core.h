/*
 * ops_cpu_core.h — private to the CPU backend (ops_cpu_core.c, ops_cpu.c, ops_cpu_attention.c,
 * ops_cpu_moe.c): the context, the task helpers every parallel loop uses, the fixed-order dot
 * product, the packed GEMM's shape and entry point and the SIMD picks (ops_cpu_core.c, the bottom
 * every op file may use), and the op functions of the attention and MoE files that the table in
 * ops_cpu.c (the top) points at. Nothing outside the backend includes it.
 */
#ifndef LLMC_OPS_CPU_CORE_H
#define LLMC_OPS_CPU_CORE_H

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

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
    void* down[2];           // ops.h download_start's slots: the bytes as the start found them
    size_t down_cap[2];
    int down_pending[2];
} CpuCtx;

// Every parallel loop goes through here. The lock makes the backend safe to call from several
// threads at once (e.g. CPU streams sharing one ctx); results do not depend on the interleaving.
static inline void cpu_run(void* ctx, int64_t n_tasks, TaskFn fn, void* arg) {
    CpuCtx* cx = ctx;
    pthread_check(pthread_mutex_lock(&cx->run_mu));
    threadpool_run(cx->pool, n_tasks, fn, arg);
    pthread_check(pthread_mutex_unlock(&cx->run_mu));
}

static inline int64_t task_count(int64_t n, int64_t per_task) {
    return (n + per_task - 1) / per_task;
}

// Rows per task for row-wise ops: about 16K elements of work each (fixed by the row width only).
static inline int rows_per_task(size_t row_elems) {
    size_t r = row_elems > 0 ? 16384 / row_elems : 16384;
    return r < 1 ? 1 : (int)r;
}

#define COL_BLOCK 64  // columns per task of the column-parallel reductions (dw, dbias, dwte)

// ----------------------------------------------------------------------------
// vector helper: a fixed-order dot product (16 interleaved partial sums, then a fixed tree)

static inline float vec_dot(const float* a, const float* b, int n) {
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
// shared elementwise helper

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// ----------------------------------------------------------------------------
// packed GEMM (ops_cpu_core.c): C (M, Nc) (+)= A (M, K) · B (K, Nc) (+ bias)

#define GEMM_MR 8    // rows of a micro-tile (A panel height)
#define GEMM_NR 32   // columns of a micro-tile (B panel width): two AVX-512 vectors
#define GEMM_KC 256  // k block: an A and a B micro-panel stay in L1/L2 across the tile loop
#define GEMM_MC 64   // rows of C per task (multiple of MR)
#define GEMM_NC 128  // columns of C per task (multiple of NR)

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

// Packs both operands and runs the tiles on the pool; every element of C is summed k = 0 .. K-1.
void ops_cpu_gemm_run(CpuCtx* cx, Gemm* g);
// dbias (OC) += Σ_rows dout (N, OC), rows in order inside each column block.
void ops_cpu_dbias(CpuCtx* cx, float* dbias, const float* dout, int N, int OC);
// This CPU's SIMD level: 2 (AVX-512F), 1 (AVX2 + FMA) or 0 (portable); -DOPS_CPU_KERNEL forces one.
int ops_cpu_simd_level(void);
// The GEMM micro-kernel compiled for that SIMD level.
GemmKernel ops_cpu_gemm_kernel_pick(int simd_level);

// ----------------------------------------------------------------------------
// attention and its input (ops_cpu_attention.c)

// The attention row function compiled for SIMD level 2 (AVX-512F), 1 (AVX2) or 0 (portable).
AttRowFn ops_cpu_att_row_pick(int simd_level);
void ops_cpu_qknorm_rope_forward(void* ctx, void* out, float* rstd, const void* inp,
                                 const void* q_norm_w, const void* k_norm_w, const float* cos,
                                 const float* sin, int B, int T, int H, int KVH, int HD,
                                 float eps);
void ops_cpu_qknorm_rope_backward(void* ctx, void* dinp, float* dq_norm_w, float* dk_norm_w,
                                  const void* dout, const void* inp, const void* q_norm_w,
                                  const void* k_norm_w, const float* rstd, const float* cos,
                                  const float* sin, int B, int T, int H, int KVH, int HD);
void ops_cpu_attention_forward(void* ctx, void* out, float* lse, const void* qkv, int B, int T,
                               int H, int KVH, int HD);
void ops_cpu_attention_backward(void* ctx, void* dqkv, const void* dout, const void* qkv,
                                const void* out, const float* lse, int B, int T, int H, int KVH,
                                int HD);
void ops_cpu_attention_sink_forward(void* ctx, void* out, float* lse, const void* qkv,
                                    const void* sinks, int B, int T, int H, int KVH, int HD,
                                    int window);
void ops_cpu_attention_sink_backward(void* ctx, void* dqkv, float* dsinks, const void* dout,
                                     const void* qkv, const void* out, const float* lse,
                                     const void* sinks, int B, int T, int H, int KVH, int HD,
                                     int window);
void ops_cpu_attention_decode(void* ctx, void* out, const void* qkv, const void* kc,
                              const void* vc, const int32_t* slot, const int32_t* len,
                              const void* sinks, int n, int maxT, int H, int KVH, int HD,
                              int window);

// ----------------------------------------------------------------------------
// mixture of experts (ops_cpu_moe.c)

void ops_cpu_moe_route_forward(void* ctx, int32_t* idx, float* weights, const void* logits,
                               int n, int E, int K, int mode);
void ops_cpu_moe_route_backward(void* ctx, void* dlogits, const float* dweights,
                                const void* logits, const int32_t* idx, const float* weights,
                                const float* counts, float aux_scale, int n, int E, int K,
                                int mode);
void ops_cpu_moe_dispatch(void* ctx, int32_t* offsets, int32_t* src, int32_t* dst,
                          const int32_t* idx, int n, int E, int K);
void ops_cpu_moe_gather(void* ctx, void* out, const void* inp, const int32_t* src, int n, int K,
                        int C);
void ops_cpu_moe_gather_backward(void* ctx, void* dinp, const void* dout, const int32_t* dst,
                                 int n, int K, int C);
void ops_cpu_moe_combine_forward(void* ctx, void* out, const void* y, const float* weights,
                                 const int32_t* dst, int n, int K, int C);
void ops_cpu_moe_combine_backward(void* ctx, void* dy, float* dweights, const void* dout,
                                  const void* y, const float* weights, const int32_t* dst,
                                  int n, int K, int C);
void ops_cpu_moe_router_stats(void* ctx, float* stats, const void* logits,
                              const int32_t* offsets, int n, int E);
void ops_cpu_moe_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                                const void* bias, const int32_t* offsets, int R, int E, int IC,
                                int OC, int w_in_out);
void ops_cpu_moe_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias,
                                 const void* dout, const void* inp, const void* w,
                                 const int32_t* offsets, int R, int E, int IC, int OC,
                                 int w_in_out);
void ops_cpu_gptoss_glu_forward(void* ctx, void* out, const void* gu, int R, int F, float limit,
                                float alpha);
void ops_cpu_gptoss_glu_backward(void* ctx, void* dgu, const void* dout, const void* gu, int R,
                                 int F, float limit, float alpha);

#endif  // LLMC_OPS_CPU_CORE_H
