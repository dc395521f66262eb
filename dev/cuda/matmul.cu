/*
 * dev/cuda/matmul.cu — lab of the linear-layer matmuls (kernels/matmul.cu): bf16 operands, fp32
 * accumulation, row-major tensors as the model stores them:
 *   forward  out (N, OC) = inp (N, IC) · Wᵀ (+ bias)       bf16 out
 *   dinp     dinp (N, IC) = dout (N, OC) · W (OC, IC)      bf16, overwritten
 *   dW       dW (OC, IC) += doutᵀ · inp                    fp32, accumulated
 *   dbias    dbias (OC) += Σ_rows dout                     fp32, accumulated
 *
 *   make dev-cuda && dev/cuda/build/matmul [--validate-only] [--variant K] [--seed S]
 *
 * Variants:
 *   1  naive: 32 x 32 shared-memory tiles, one output per thread, fp32 FMA on the CUDA cores
 *      (one strided kernel for the three products; dbias one thread per column).
 *   2  production (kernels/matmul.cu, included below): cuBLASLt with the heuristic's first
 *      algorithm, cached per problem; bias fused in the epilogue when aligned; dbias as ordered
 *      per-chunk partial sums.
 *   3  cuBLASLt, the fastest of the heuristic's first 8 algorithms, timed one by one: what
 *      autotuning would gain over variant 2 (benchmark only: the algorithms are cuBLAS's own).
 * Validation (variants 1 and 2): (N, IC, OC) = (77, 200, 136) with a 16-byte aligned bias (the
 * fused epilogue) and every gradient; (50, 64, 40) with a bias one element off alignment (the
 * separate bias kernel), dW and dbias without dinp; (1, 200, 136) without bias (one row, as the
 * generation path calls it). bf16 outputs TOL_BF16, fp32 gradients (pre-filled: they accumulate)
 * TOL_F32, against sums in double.
 * Benchmark: the Qwen3-1.7B linear layers at N = 16384 tokens (qkv 2048 -> 4096, o 2048 -> 2048,
 * gate_up 2048 -> 12288, down 6144 -> 2048) and the LM head 2048 -> 151936 in the model's row
 * chunks on the GPU (4096) and in 220-row chunks (64 MiB of logits: the dW product reads and
 * writes the whole fp32 dW per chunk). TFLOP/s = 2 N IC OC / time against 989 dense bf16.
 * Variant 1 runs on the layer shapes only (the LM head would take seconds per call).
 * First, the generation step's products (128 rows, forward, variants 2 and 3) in GB/s of the
 * weights they read.
 */
#include "../../kernels/matmul.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference (double sums)

static void matmul_forward_cpu(float* out, const float* inp, const float* w, const float* bias,
                               int N, int IC, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int i = 0; i < IC; i++)
                s += (double)inp[(size_t)n * IC + i] * w[(size_t)o * IC + i];
            out[(size_t)n * OC + o] = (float)s;
        }
}

// Any of dinp (overwritten), dw, dbias (accumulated) may be NULL.
static void matmul_backward_cpu(float* dinp, float* dw, float* dbias, const float* dout,
                                const float* inp, const float* w, int N, int IC, int OC) {
    if (dinp)
        for (int n = 0; n < N; n++)
            for (int i = 0; i < IC; i++) {
                double s = 0.0;
                for (int o = 0; o < OC; o++)
                    s += (double)dout[(size_t)n * OC + o] * w[(size_t)o * IC + i];
                dinp[(size_t)n * IC + i] = (float)s;
            }
    if (dw)
        for (int o = 0; o < OC; o++)
            for (int i = 0; i < IC; i++) {
                double s = dw[(size_t)o * IC + i];
                for (int n = 0; n < N; n++)
                    s += (double)dout[(size_t)n * OC + o] * inp[(size_t)n * IC + i];
                dw[(size_t)o * IC + i] = (float)s;
            }
    if (dbias)
        for (int o = 0; o < OC; o++) {
            double s = dbias[o];
            for (int n = 0; n < N; n++) s += dout[(size_t)n * OC + o];
            dbias[o] = (float)s;
        }
}

// ----------------------------------------------------------------------------
// variant 1: naive

// D (M, Nn) (row-major) = Σ_k A(m, k) B(k, n) (+ bias[n]), with A(m, k) = A[m sam + k sak] and
// B(k, n) = B[k sbk + n sbn]: the three products are this kernel with different strides. A bf16
// D is overwritten, an fp32 D accumulated. Block 32 x 32 threads, one output each.
template <typename OutT>
__global__ void matmul_kernel1(OutT* D, const bf16* A, const bf16* B, const bf16* bias, int M,
                               int Nn, int K, size_t sam, size_t sak, size_t sbk, size_t sbn) {
    __shared__ float As[32][33], Bs[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int m = blockIdx.y * 32 + ty, n = blockIdx.x * 32 + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 32) {
        const int ka = k0 + tx, kb = k0 + ty;
        As[ty][tx] = m < M && ka < K ? __bfloat162float(A[m * sam + ka * sak]) : 0.0f;
        Bs[ty][tx] = kb < K && n < Nn ? __bfloat162float(B[kb * sbk + n * sbn]) : 0.0f;
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < 32; kk++) acc += As[ty][kk] * Bs[kk][tx];
        __syncthreads();
    }
    if (m >= M || n >= Nn) return;
    const size_t i = (size_t)m * Nn + n;
    if (bias) acc += __bfloat162float(bias[n]);
    if constexpr (sizeof(OutT) == 4)
        D[i] += acc;
    else
        D[i] = __float2bfloat16_rn(acc);
}

__global__ void dbias_kernel1(float* dbias, const bf16* dout, int N, int OC) {
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float s = 0.0f;
    for (int n = 0; n < N; n++) s += __bfloat162float(dout[(size_t)n * OC + o]);
    dbias[o] += s;
}

template <typename OutT>
static void matmul1(CudaCtx* cx, OutT* D, const bf16* A, const bf16* B, const bf16* bias, int M,
                    int Nn, int K, size_t sam, size_t sak, size_t sbk, size_t sbn) {
    dim3 grid(grid_size(Nn, 32), grid_size(M, 32)), block(32, 32);
    matmul_kernel1<OutT>
        <<<grid, block, 0, cx->stream>>>(D, A, B, bias, M, Nn, K, sam, sak, sbk, sbn);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// variant dispatch (variants 1 and 2; variant 3 is the benchmark's own loop)

static void matmul_forward(int v, CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w,
                           const bf16* bias, int N, int IC, int OC) {
    if (v == 2) return cuda_matmul_forward(cx, out, inp, w, bias, N, IC, OC);
    // m = row, n = output column, k = input column
    matmul1<bf16>(cx, out, inp, w, bias, N, OC, IC, IC, 1, 1, IC);
}

static void matmul_backward(int v, CudaCtx* cx, bf16* dinp, float* dw, float* dbias,
                            const bf16* dout, const bf16* inp, const bf16* w, int N, int IC,
                            int OC) {
    if (v == 2) return cuda_matmul_backward(cx, dinp, dw, dbias, dout, inp, w, N, IC, OC);
    // dinp: m = row, n = input column, k = output column
    if (dinp) matmul1<bf16>(cx, dinp, dout, w, NULL, N, IC, OC, OC, 1, IC, 1);
    // dW: m = output column, n = input column, k = row
    if (dw) matmul1<float>(cx, dw, dout, inp, NULL, OC, IC, N, 1, OC, IC, 1);
    if (dbias) {
        dbias_kernel1<<<grid_size(OC, 128), 128, 0, cx->stream>>>(dbias, dout, N, OC);
        cuda_check_launch();
    }
}

// ----------------------------------------------------------------------------
// variant 3: the best of the cuBLASLt heuristic's first algorithms

// Time (ms, median) of `calls` back-to-back D = op(A) op(B) (+ beta D) with the fastest of up to
// 8 algorithms of the heuristic; the same column-major problem as lt_matmul of kernels/matmul.cu.
static double lt_best_of_heuristics(Lab* lab, int calls, int transa, int transb, int m, int n,
                                    int k, const bf16* A, int lda, const bf16* B, int ldb, void* D,
                                    int ldc, int out_f32, float beta) {
    CudaCtx* cx = lab->cx;
    cublasLtMatmulDesc_t desc;
    cublas_check(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N,
                      tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublas_check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    cublas_check(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtMatrixLayout_t la, lb, ld;
    cublas_check(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, transa ? k : m, transa ? m : k, lda));
    cublas_check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, transb ? n : k, transb ? k : n, ldb));
    cublas_check(cublasLtMatrixLayoutCreate(&ld, out_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, ldc));
    cublasLtMatmulPreference_t pref;
    cublas_check(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = LT_WORKSPACE_BYTES;
    // the production's restriction: no split-K reducing in a bf16 output
    uint32_t schemes = out_f32 ? (uint32_t)CUBLASLT_REDUCTION_SCHEME_MASK
                               : (uint32_t)CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublas_check(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
    cublasLtMatmulHeuristicResult_t res[8];
    int count = 0;
    cublas_check(
        cublasLtMatmulAlgoGetHeuristic(cx->lt, desc, la, lb, ld, ld, pref, 8, res, &count));
    double best = INFINITY;
    const float alpha = 1.0f;
    for (int i = 0; i < count; i++) {
        double ms = lab_time_ms(
            lab,
            [&] {
                for (int c = 0; c < calls; c++)
                    cublas_check(cublasLtMatmul(cx->lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D,
                                                ld, &res[i].algo, cx->lt_workspace, ws,
                                                cx->stream));
            },
            5, 1);
        best = std::min(best, ms);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    return best;
}

// ----------------------------------------------------------------------------
// validation

// bias_mode 0: none, 1: aligned, 2: one element off 16-byte alignment.
static void validate(Lab* lab, int v, Rng* r, int N, int IC, int OC, int bias_mode, int want_dinp) {
    std::vector<float> x = rand_bf16(r, (size_t)N * IC, 1.0f),
                       w = rand_bf16(r, (size_t)OC * IC, 0.1f);
    std::vector<float> dout = rand_bf16(r, (size_t)N * OC, 1.0f), b = rand_bf16(r, OC + 1, 1.0f);
    std::vector<float> dw = rand_f32(r, (size_t)OC * IC, 1.0f), db = rand_f32(r, OC, 1.0f);
    std::vector<float> out((size_t)N * OC), dinp((size_t)N * IC);
    const float* hb = bias_mode ? b.data() + (bias_mode == 2) : NULL;
    matmul_forward_cpu(out.data(), x.data(), w.data(), hb, N, IC, OC);
    bf16 *d_x = dev_upload_bf16(x), *d_w = dev_upload_bf16(w), *d_dout = dev_upload_bf16(dout);
    bf16* d_b = dev_upload_bf16(b);
    bf16 *d_out = dev_alloc<bf16>((size_t)N * OC), *d_dinp = dev_alloc<bf16>((size_t)N * IC);
    float *d_dw = dev_upload(dw), *d_db = dev_upload(db);
    dev_poison(d_out, (size_t)N * OC * 2);
    dev_poison(d_dinp, (size_t)N * IC * 2);
    matmul_forward(v, lab->cx, d_out, d_x, d_w, bias_mode ? d_b + (bias_mode == 2) : NULL, N, IC,
                   OC);
    matmul_backward(v, lab->cx, want_dinp ? d_dinp : NULL, d_dw, bias_mode ? d_db : NULL, d_dout,
                    d_x, d_w, N, IC, OC);
    matmul_backward_cpu(want_dinp ? dinp.data() : NULL, dw.data(), bias_mode ? db.data() : NULL,
                        dout.data(), x.data(), w.data(), N, IC, OC);
    char what[128], tag[80];
    snprintf(tag, sizeof tag, "v%d N=%d IC=%d OC=%d%s", v, N, IC, OC,
             bias_mode == 0   ? ""
             : bias_mode == 1 ? " bias"
                              : " unaligned bias");
    snprintf(what, sizeof what, "fwd %s: out", tag);
    lab_check(lab, what, dev_download_bf16(d_out, (size_t)N * OC).data(), out.data(),
              (size_t)N * OC, TOL_BF16);
    if (want_dinp) {
        snprintf(what, sizeof what, "bwd %s: dinp", tag);
        lab_check(lab, what, dev_download_bf16(d_dinp, (size_t)N * IC).data(), dinp.data(),
                  (size_t)N * IC, TOL_BF16);
    }
    snprintf(what, sizeof what, "bwd %s: dW", tag);
    lab_check(lab, what, dev_download(d_dw, (size_t)OC * IC).data(), dw.data(), (size_t)OC * IC,
              TOL_F32);
    snprintf(what, sizeof what, "bwd %s: dbias", tag);
    lab_check(lab, what, dev_download(d_db, OC).data(), db.data(), OC,
              bias_mode ? TOL_F32 : TOL_EXACT);
    void* bufs[] = {d_x, d_w, d_dout, d_b, d_out, d_dinp, d_dw, d_db};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

typedef struct Shape {
    const char* name;
    int IC, OC, chunk;  // chunk: rows per call (0: all N at once)
} Shape;

// The generation step's products: 128 rows (8 prompts x 16 answers) through each linear layer of
// Qwen3-1.7B and the LM head, forward only; GB/s over the weights read (what bounds them).
static void bench_decode(Lab* lab) {
    const int rows = 128;
    const Shape shapes[] = {{"qkv", 2048, 4096, 0},     {"o", 2048, 2048, 0},
                            {"gate_up", 2048, 12288, 0}, {"down", 6144, 2048, 0},
                            {"lm_head", 2048, 151936, 0}};
    CudaCtx* cx = lab->cx;
    printf("\nbenchmark: decode rows (forward, 128 rows)\n");
    lab_bench_header_bw();
    for (const Shape& sh : shapes) {
        bf16* x = dev_random<bf16>((size_t)rows * sh.IC, 1.0f, 1);
        bf16* w = dev_random<bf16>((size_t)sh.OC * sh.IC, 0.05f, 2);
        bf16* out = dev_alloc<bf16>((size_t)rows * sh.OC);
        char shape[96];
        snprintf(shape, sizeof shape, "%s N=%d IC=%d OC=%d", sh.name, rows, sh.IC, sh.OC);
        const double bytes = 2.0 * ((double)sh.OC * sh.IC + (double)rows * (sh.IC + sh.OC));
        for (int v = 2; v <= 3; v++) {
            if (!lab_wants(&lab->args, v)) continue;
            const double ms =
                v == 3 ? lt_best_of_heuristics(lab, 1, 1, 0, sh.OC, rows, sh.IC, w, sh.IC, x,
                                               sh.IC, out, sh.OC, 0, 0.0f)
                       : lab_time_ms(lab, [&] {
                             matmul_forward(v, cx, out, x, w, NULL, rows, sh.IC, sh.OC);
                         });
            lab_report_bw("matmul fwd (decode)", v, shape, "weights once, x, out", bytes, ms);
        }
        void* bufs[] = {x, w, out};
        for (void* p : bufs) cuda_check(cudaFree(p));
    }
}

static void bench(Lab* lab) {
    bench_decode(lab);
    const int N = 16384;
    const Shape shapes[] = {
        {"qkv", 2048, 4096, 0},
        {"o", 2048, 2048, 0},
        {"gate_up", 2048, 12288, 0},
        {"down", 6144, 2048, 0},
        {"lm_head/4096", 2048, 151936, 4096},
        {"lm_head/220", 2048, 151936, 220},
    };
    CudaCtx* cx = lab->cx;
    printf("\nbenchmark\n");
    lab_bench_header_flops();
    for (const Shape& sh : shapes) {
        const int rows = sh.chunk ? sh.chunk : N, calls = (N + rows - 1) / rows;
        bf16* x = dev_random<bf16>((size_t)rows * sh.IC, 1.0f, 1);
        bf16* w = dev_random<bf16>((size_t)sh.OC * sh.IC, 0.05f, 2);
        bf16* y = dev_random<bf16>((size_t)rows * sh.OC, 1.0f, 3);
        bf16* dx = dev_alloc<bf16>((size_t)rows * sh.IC);
        float* dw = dev_alloc<float>((size_t)sh.OC * sh.IC);
        bf16* out = dev_alloc<bf16>((size_t)rows * sh.OC);
        dev_zero(dw, (size_t)sh.OC * sh.IC * 4);
        // A chunked shape repeats one chunk `calls` times: the work of calls * rows rows.
        const double flop = 2.0 * calls * rows * (double)sh.IC * sh.OC;
        char shape[96];
        snprintf(shape, sizeof shape, "%s N=%d IC=%d OC=%d", sh.name, calls * rows, sh.IC, sh.OC);
        for (int v = 1; v <= 3; v++) {
            if (!lab_wants(&lab->args, v) || (v == 1 && sh.chunk)) continue;
            double f, bi, bw;
            if (v == 3) {
                f = lt_best_of_heuristics(lab, calls, 1, 0, sh.OC, rows, sh.IC, w, sh.IC, x, sh.IC,
                                          out, sh.OC, 0, 0.0f);
                bi = lt_best_of_heuristics(lab, calls, 0, 0, sh.IC, rows, sh.OC, w, sh.IC, y, sh.OC,
                                           dx, sh.IC, 0, 0.0f);
                bw = lt_best_of_heuristics(lab, calls, 0, 1, sh.IC, sh.OC, rows, x, sh.IC, y, sh.OC,
                                           dw, sh.IC, 1, 1.0f);
            } else {
                const int reps = v == 1 ? 3 : 0;  // 0: the lab's --reps
                f = lab_time_ms(
                    lab,
                    [&] {
                        for (int c = 0; c < calls; c++)
                            matmul_forward(v, cx, out, x, w, NULL, rows, sh.IC, sh.OC);
                    },
                    reps, v == 1 ? 1 : 2);
                bi = lab_time_ms(
                    lab,
                    [&] {
                        for (int c = 0; c < calls; c++)
                            matmul_backward(v, cx, dx, NULL, NULL, y, x, w, rows, sh.IC, sh.OC);
                    },
                    reps, v == 1 ? 1 : 2);
                bw = lab_time_ms(
                    lab,
                    [&] {
                        for (int c = 0; c < calls; c++)
                            matmul_backward(v, cx, NULL, dw, NULL, y, x, w, rows, sh.IC, sh.OC);
                    },
                    reps, v == 1 ? 1 : 2);
            }
            lab_report_flops("matmul fwd", v, shape, flop, f);
            lab_report_flops("matmul dinp", v, shape, flop, bi);
            lab_report_flops("matmul dW", v, shape, flop, bw);
        }
        void* bufs[] = {x, w, y, dx, dw, out};
        for (void* p : bufs) cuda_check(cudaFree(p));
    }
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: 32x32 shared-memory tiles, one output per thread, fp32 FMA\n"
    "  2  production (kernels/matmul.cu): cuBLASLt, the heuristic's first algorithm, cached\n"
    "  3  cuBLASLt, the fastest of the heuristic's first 8 algorithms (benchmark only)\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    validate(lab, v, r, 77, 200, 136, 1, 1);
    validate(lab, v, r, 50, 64, 40, 2, 0);
    validate(lab, v, r, 1, 200, 136, 0, 1);
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "matmul", VARIANTS, 3, 2, validate_variant, bench_lab);
}
