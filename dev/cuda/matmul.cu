/*
 * dev/cuda/matmul.cu — lab for the linear-layer matmuls of the CUDA backend (kernels/matmul.cu).
 *
 *   make dev-cuda && ./build/dev/cuda/matmul [N]        (N tokens, default 16384)
 *
 * 1. Validation: ops_cuda.matmul_forward / matmul_backward on a small odd shape against a double
 *    CPU reference (bf16 inputs): out and dinp relative L2 <= 1e-2, dW (fp32, accumulated onto a
 *    random pre-fill) <= 1e-4.
 * 2. Benchmark, on the Qwen3-1.7B shapes (C = 2048): QKV 2048->4096, O 2048->2048, gate-up
 *    2048->12288, down 6144->2048, and the LM head 2048->151936 in row chunks (the model's chunk
 *    of 64 MiB of logits is 220 rows; larger chunks for comparison). For each: forward, dinp and
 *    dW through the backend (variant 1: the cuBLASLt heuristic's first algorithm, cached per
 *    shape), and variant 2: the best of the heuristic's first 8 algorithms timed one by one (what
 *    autotuning would gain). TFLOP/s = 2·N·IC·OC / time; variant 1 is the median of 20 timed runs
 *    after 3 warm-ups, variant 2 the median of 5 after 1 per algorithm; random data (never zeros).
 *
 * Measured (H200, CUDA 13.0, one run, 2026-11-30), TFLOP/s:
 *   shape          N      IC     OC   |  fwd   dinp    dW  | v2: fwd  dinp    dW
 *   qkv          16384  2048   4096   | 751.4  799.2  798.8 |   819.5  785.3  801.4
 *   o            16384  2048   2048   | 742.7  743.3  775.5 |   744.0  750.0  780.6
 *   gate_up      16384  2048  12288   | 796.5  822.3  736.6 |   746.3  820.8  735.5
 *   down         16384  6144   2048   | 803.8  773.1  800.6 |   810.8  818.8  790.2
 *   lm_head/220  16500  2048 151936   | 606.5  621.9  146.4 |   674.6  702.7  148.0
 *   lm_head/1024 16384  2048 151936   | 660.3  698.6  535.1 |   736.5  811.7  619.6
 *   lm_head/4096 16384  2048 151936   | 689.1  719.6  668.7 |   730.6  832.4  753.6
 * Readings: the layer matmuls run at 740-820 (the heuristic's first choice is within 10% of the
 * best of 8). The LM head's dW with the model's 220-row chunks is memory-bound (every chunk
 * reads and writes the whole 1.2 GB fp32 dW): 146 TFLOP/s; chunks of 1024 rows give 535 and of
 * 4096 rows 669. Autotuning over the first 8 algorithms would add up to ~15% on the LM head.
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {
#include "../../llmc/common.h"
#include "../../llmc/rng.h"
}
#include "../../kernels/kernels.h"

#define CK(call)                                                                         \
    do {                                                                                 \
        cudaError_t e__ = (call);                                                        \
        if (e__ != cudaSuccess) fatal("%s:%d: %s: %s", __FILE__, __LINE__, #call,        \
                                      cudaGetErrorString(e__));                          \
    } while (0)
#define LK(call)                                                                         \
    do {                                                                                 \
        cublasStatus_t s__ = (call);                                                     \
        if (s__ != CUBLAS_STATUS_SUCCESS) fatal("%s:%d: %s: status %d", __FILE__, __LINE__, \
                                                #call, (int)s__);                        \
    } while (0)

static const int REPS = 20, WARMUP = 3;      // variant 1 (the backend)
static const int REPS_V2 = 5, WARMUP_V2 = 1;  // variant 2: 8 algorithms each, fewer runs

// ----------------------------------------------------------------------------
// helpers

static void fill_random_bf16(const Ops* ops, void* ctx, void* dst, size_t n, float scale,
                             uint32_t seed) {
    Rng r;
    rng_seed(&r, seed);
    const size_t chunk = (size_t)1 << 22;
    std::vector<float> h(chunk);
    for (size_t off = 0; off < n; off += chunk) {
        size_t cnt = std::min(chunk, n - off);
        for (size_t i = 0; i < cnt; i++) h[i] = scale * (rng_uniform(&r) * 2.0f - 1.0f);
        ops->upload_f32(ctx, (char*)dst + off * 2, h.data(), cnt);
    }
}

static float bf16v(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Median of `reps` event-timed runs of fn (ms), after `warmup` runs.
template <typename F>
static double time_ms(cudaStream_t s, F fn, int reps = REPS, int warmup = WARMUP) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warmup; i++) fn();
    std::vector<double> t;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, s));
        fn();
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[t.size() / 2];
}

// ----------------------------------------------------------------------------
// 1. validation

static int validate(void* ctx) {
    const Ops* ops = &ops_cuda;
    const int N = 77, IC = 200, OC = 136;
    Rng r;
    rng_seed(&r, 7);
    std::vector<float> x((size_t)N * IC), w((size_t)OC * IC), dy((size_t)N * OC), b(OC);
    std::vector<float> dw0((size_t)OC * IC);
    for (auto& v : x) v = bf16v(rng_normal(&r));
    for (auto& v : w) v = bf16v(0.1f * rng_normal(&r));
    for (auto& v : dy) v = bf16v(rng_normal(&r));
    for (auto& v : b) v = bf16v(rng_normal(&r));
    for (auto& v : dw0) v = rng_normal(&r);
    void* dx = ops->alloc(ctx, x.size() * 2);
    void* dwt = ops->alloc(ctx, w.size() * 2);
    void* ddy = ops->alloc(ctx, dy.size() * 2);
    void* db = ops->alloc(ctx, b.size() * 2);
    void* dout = ops->alloc(ctx, (size_t)N * OC * 2);
    void* ddx = ops->alloc(ctx, (size_t)N * IC * 2);
    float* ddw = (float*)ops->alloc(ctx, dw0.size() * 4);
    ops->upload_f32(ctx, dx, x.data(), x.size());
    ops->upload_f32(ctx, dwt, w.data(), w.size());
    ops->upload_f32(ctx, ddy, dy.data(), dy.size());
    ops->upload_f32(ctx, db, b.data(), b.size());
    ops->upload(ctx, ddw, dw0.data(), dw0.size() * 4);
    ops->matmul_forward(ctx, dout, dx, dwt, db, N, IC, OC);
    ops->matmul_backward(ctx, ddx, ddw, NULL, ddy, dx, dwt, N, IC, OC);
    std::vector<float> out((size_t)N * OC), gx((size_t)N * IC), gw((size_t)OC * IC);
    ops->download_f32(ctx, out.data(), dout, out.size());
    ops->download_f32(ctx, gx.data(), ddx, gx.size());
    ops->download(ctx, gw.data(), ddw, gw.size() * 4);
    double e[3][2] = {{0, 0}, {0, 0}, {0, 0}};  // (num, den) of out, dinp, dW
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = b[o];
            for (int i = 0; i < IC; i++) s += (double)x[(size_t)n * IC + i] * w[(size_t)o * IC + i];
            double d = out[(size_t)n * OC + o] - s;
            e[0][0] += d * d;
            e[0][1] += s * s;
        }
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            double s = 0;
            for (int o = 0; o < OC; o++) s += (double)dy[(size_t)n * OC + o] * w[(size_t)o * IC + i];
            double d = gx[(size_t)n * IC + i] - s;
            e[1][0] += d * d;
            e[1][1] += s * s;
        }
    for (int o = 0; o < OC; o++)
        for (int i = 0; i < IC; i++) {
            double s = dw0[(size_t)o * IC + i];
            for (int n = 0; n < N; n++) s += (double)dy[(size_t)n * OC + o] * x[(size_t)n * IC + i];
            double d = gw[(size_t)o * IC + i] - s;
            e[2][0] += d * d;
            e[2][1] += s * s;
        }
    double rel[3];
    for (int k = 0; k < 3; k++) rel[k] = sqrt(e[k][0] / e[k][1]);
    int ok = rel[0] <= 1e-2 && rel[1] <= 1e-2 && rel[2] <= 1e-4;
    printf("validation N=%d IC=%d OC=%d: out %.2e, dinp %.2e, dW %.2e -> %s\n", N, IC, OC, rel[0],
           rel[1], rel[2], ok ? "OK" : "FAILED");
    void* bufs[] = {dx, dwt, ddy, db, dout, ddx, ddw};
    for (void* p : bufs) ops->free(ctx, p);
    return ok;
}

// ----------------------------------------------------------------------------
// 2. variant 2: time the heuristic's first algorithms directly

// Best time (ms) over up to 8 heuristic algorithms for D (m, n) = op(A) op(B) (+ beta D).
static double best_of_heuristics(cublasLtHandle_t lt, cudaStream_t s, void* ws, size_t ws_bytes,
                                 int transa, int transb, int m, int n, int k, const void* A,
                                 int lda, const void* B, int ldb, void* D, int ldc, int out_f32,
                                 float beta, int* n_algos) {
    cublasLtMatmulDesc_t desc;
    LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtMatrixLayout_t la, lb, ld;
    LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, transa ? k : m, transa ? m : k, lda));
    LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, transb ? n : k, transb ? k : n, ldb));
    LK(cublasLtMatrixLayoutCreate(&ld, out_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, ldc));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res[8];
    int count = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 8, res, &count));
    double best = 1e30;
    const float alpha = 1.0f;
    for (int i = 0; i < count; i++) {
        double ms = time_ms(s, [&] {
            LK(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &res[i].algo,
                              ws, ws_bytes, s));
        }, REPS_V2, WARMUP_V2);
        best = std::min(best, ms);
    }
    *n_algos = count;
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return best;
}

// ----------------------------------------------------------------------------
// 2. benchmark

typedef struct Shape {
    const char* name;
    int IC, OC, chunk;  // chunk: rows per call (0 = all N)
} Shape;

static void bench(void* ctx, int N) {
    const Ops* ops = &ops_cuda;
    cudaStream_t s = (cudaStream_t)ops_cuda_stream(ctx);
    cublasLtHandle_t lt;
    LK(cublasLtCreate(&lt));
    const size_t ws_bytes = (size_t)32 << 20;
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    const Shape shapes[] = {
        {"qkv", 2048, 4096, 0},        {"o", 2048, 2048, 0},
        {"gate_up", 2048, 12288, 0},   {"down", 6144, 2048, 0},
        {"lm_head/220", 2048, 151936, 220}, {"lm_head/1024", 2048, 151936, 1024},
        {"lm_head/4096", 2048, 151936, 4096},
    };
    printf("\n%-14s %6s %6s %6s | %8s %8s %8s | %8s %8s %8s  (TFLOP/s; v2 = best of heuristics)\n",
           "shape", "N", "IC", "OC", "fwd", "dinp", "dW", "fwd v2", "dinp v2", "dW v2");
    for (const Shape& sh : shapes) {
        const int rows = sh.chunk ? sh.chunk : N;
        const int calls = (N + rows - 1) / rows;
        void* x = ops->alloc(ctx, (size_t)rows * sh.IC * 2);
        void* w = ops->alloc(ctx, (size_t)sh.OC * sh.IC * 2);
        void* y = ops->alloc(ctx, (size_t)rows * sh.OC * 2);
        void* dx = ops->alloc(ctx, (size_t)rows * sh.IC * 2);
        float* dw = (float*)ops->alloc(ctx, (size_t)sh.OC * sh.IC * 4);
        fill_random_bf16(ops, ctx, x, (size_t)rows * sh.IC, 1.0f, 1);
        fill_random_bf16(ops, ctx, w, (size_t)sh.OC * sh.IC, 0.05f, 2);
        fill_random_bf16(ops, ctx, y, (size_t)rows * sh.OC, 1.0f, 3);
        // Chunked shapes repeat the same chunk `calls` times: the same work as N rows.
        double f = time_ms(s, [&] {
            for (int c = 0; c < calls; c++) ops->matmul_forward(ctx, y, x, w, NULL, rows, sh.IC, sh.OC);
        });
        fill_random_bf16(ops, ctx, y, (size_t)rows * sh.OC, 1.0f, 4);  // the forward overwrote it
        double bi = time_ms(s, [&] {
            for (int c = 0; c < calls; c++)
                ops->matmul_backward(ctx, dx, NULL, NULL, y, x, w, rows, sh.IC, sh.OC);
        });
        double bw = time_ms(s, [&] {
            for (int c = 0; c < calls; c++)
                ops->matmul_backward(ctx, NULL, dw, NULL, y, x, w, rows, sh.IC, sh.OC);
        });
        int na = 0;
        double f2 = calls * best_of_heuristics(lt, s, ws, ws_bytes, 1, 0, sh.OC, rows, sh.IC, w,
                                               sh.IC, x, sh.IC, y, sh.OC, 0, 0.0f, &na);
        fill_random_bf16(ops, ctx, y, (size_t)rows * sh.OC, 1.0f, 5);
        double bi2 = calls * best_of_heuristics(lt, s, ws, ws_bytes, 0, 0, sh.IC, rows, sh.OC, w,
                                                sh.IC, y, sh.OC, dx, sh.IC, 0, 0.0f, &na);
        double bw2 = calls * best_of_heuristics(lt, s, ws, ws_bytes, 0, 1, sh.IC, sh.OC, rows, x,
                                                sh.IC, y, sh.OC, dw, sh.IC, 1, 1.0f, &na);
        const double flop = 2.0 * (double)calls * rows * sh.IC * sh.OC;
        printf("%-14s %6d %6d %6d | %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f\n", sh.name,
               calls * rows, sh.IC, sh.OC, flop / f / 1e9, flop / bi / 1e9, flop / bw / 1e9,
               flop / f2 / 1e9, flop / bi2 / 1e9, flop / bw2 / 1e9);
        fflush(stdout);
        void* bufs[] = {x, w, y, dx, dw};
        for (void* p : bufs) ops->free(ctx, p);
    }
    CK(cudaFree(ws));
    cublasLtDestroy(lt);
}

int main(int argc, char** argv) {
    int N = argc > 1 ? atoi(argv[1]) : 16384;
    if (cuda_device_count() == 0) {
        printf("no GPU: nothing to do\n");
        return 0;
    }
    printf("device: %s\n", cuda_device_name(0));
    void* ctx = ops_cuda_create(0, NULL);
    int ok = validate(ctx);
    bench(ctx, N);
    ops_cuda_destroy(ctx);
    return ok ? 0 : 1;
}
