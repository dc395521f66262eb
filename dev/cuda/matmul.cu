/*
 * dev/cuda/matmul.cu — lab of the linear-layer matmuls (kernels/matmul.cu): bf16 operands, fp32
 * accumulation, row-major tensors as the model stores them:
 *   forward  out (N, OC) = inp (N, IC) · Wᵀ (+ bias)       bf16 out
 *   dinp     dinp (N, IC) = dout (N, OC) · W (OC, IC)      bf16, overwritten
 *   dW       dW (OC, IC) += doutᵀ · inp                    fp32, accumulated
 *   dbias    dbias (OC) += Σ_rows dout                     fp32, accumulated
 *
 *   make dev-cuda && dev/cuda/build/matmul [--validate-only] [--variant K] [--seed S] [--decode]
 *     [--orient]
 *   (--decode: the validation, then only the decode rows benchmark; --orient: the same without
 *   variant 5's search, to compare the orientations, variants 2 / 3 against 7)
 *
 * Variants:
 *   1  naive: 32 x 32 shared-memory tiles, one output per thread, fp32 FMA on the CUDA cores
 *      (one strided kernel for the three products; dbias one thread per column).
 *   2  cuBLASLt (kernels/matmul.cu, included below) in its column-major orientation:
 *      the heuristic's first algorithm, cached per problem; bias fused in the epilogue when
 *      aligned; dbias as ordered per-chunk partial sums. Production for everything but the
 *      forward of few rows (variant 8).
 *   3  cuBLASLt, the fastest of the heuristic's first 8 algorithms, timed one by one: what
 *      autotuning would gain over variant 2 (benchmark only: the algorithms are cuBLAS's own).
 *   4  the forward for few rows (the generation step: <= 128 rows, no bias, k and OC in 64s;
 *      else variant 2): one block per 64 output columns and k range holding all rows, 4 warps
 *      of mma.sync m16n8k16 tiles (32 columns x 64 rows each), weights and rows staged in
 *      shared memory by cp.async four 64-wide k steps deep, the k range split 1-8 ways until
 *      the blocks fill one wave, the splits' fp32 partials summed in order. Correct (validated
 *      as production routing on the H200, session 11) but half cuBLASLt's speed at 128 rows:
 *      2 blocks of 4 warps per multiprocessor (110 KB of shared memory each) do not hide the
 *      latency; variant 8 is the wgmma version that production uses.
 *   5  decode rows only (benchmark): an explicit search of cuBLASLt's configurations per problem
 *      (64 / 128 / 256 rows x the four linears and the LM head): every bf16 algorithm id
 *      (cublasLtMatmulAlgoGetIds), per algorithm its capabilities (tile ids, stages ids, split-K
 *      support, reduction schemes, CTA swizzling; cuBLAS 13.1 has no cluster-shape capability,
 *      left at auto), configurations (tile, split-K in {1, 2, 3, 4, 6, 8, 12, 16} with the
 *      compute-type reduction: deterministic, partials in fp32, never in bf16; swizzle 0/1,
 *      stages) checked with cublasLtMatmulAlgoCheck within the production workspace (32 MiB);
 *      at most 512 checked and 48 timed per algorithm, 5 s of search per problem (5 runs
 *      each), the best 10 re-timed (median of --reps), the best 5 printed with their attributes
 *      and GB/s, each validated against the CPU reference on rows 0, 1, 63, 127, 255 (those
 *      below the row count) and run twice for the same bits. Prints how many were tried.
 *      Found on the H200 (session 12, 128 rows, ms; variant 2 / 3 / best of the search):
 *      qkv 0.012 / 0.011 / 0.0175 (algo 21 tile 17 splits 4), o 0.009 / 0.009 / 0.0132,
 *      gate_up 0.023 / 0.022 / 0.0268 (algo 21, no split), down 0.017 / 0.017 / 0.0196: nothing
 *      faster. The heuristic's choice (algo 66: tiles 15/92/208, clusters, custom options 1-3,
 *      down already split 2) is not among the algorithms with enumerable configurations.
 *   6  (retired) production with a few-rows split-K rule: the heuristic's algorithm split along
 *      k until its CTAs filled one wave. On the H200 it chose the heuristic's own configuration
 *      for every decode shape (the same times as variant 2): removed from production and lab.
 *   7  production (kernels/matmul.cu) in the row-major orientation (matmul_forward_orient with
 *      row_major = 1, for every row count): every layout CUBLASLT_ORDER_ROW, m = rows, n = OC,
 *      out (N, OC) = inp (N, IC) · W (OC, IC)ᵀ, the same memory, no transpose; the heuristic's
 *      first algorithm; bias by the separate kernel (the epilogue's bias is per row of D). The
 *      decode benchmark also times the best of the heuristic's first 8 in this orientation and
 *      prints the algorithm each chose (and variant 2's and 3's), or says the orientation has no
 *      algorithm.
 *   8  production (cuda_matmul_forward): the forward of at most 128 rows on the rows kernel of
 *      kernels/matmul_rows.cuh where it applies (wgmma, one wave of CTAs each on its own slice of
 *      the weight, k split across a cluster and summed in rank order through distributed shared
 *      memory), else variant 2; the backward is variant 2's.
 *   9  decode rows only (benchmark): the rows kernel in every configuration (tile 32 / 64 / 96 /
 *      128 weight rows x k split 1 / 2 / 4 / 8) that fits one wave, each validated against variant
 *      2's output (bf16 tolerance) and timed; prints how many clusters the device holds.
 * Validation (variants 1, 2, 4, 7 and 8): (N, IC, OC) = (77, 200, 136) with a 16-byte aligned bias
 * (the fused epilogue) and every gradient; (50, 64, 40) with a bias one element off alignment (the
 * separate bias kernel), dW and dbias without dinp; (1, 200, 136) without bias (one row, as the
 * generation path calls it); and (variant 4's kernel) the forward at (77, 2048, 1024), (128,
 * 640, 256), (1, 1024, 192), (128, 256, 64) (k split 8, 2, 4, 1 ways), the same bits twice and
 * for a row alone; variant 7 also the forward at (128, 2048, 2048) and (64, 6144, 2048) (decode
 * shapes) and the same bits twice (skipped, with a line, if the orientation has no algorithm).
 * bf16 outputs TOL_BF16, fp32 gradients (pre-filled:
 * they accumulate) TOL_F32, against sums in double.
 * Benchmark: the Qwen3-1.7B linear layers at N = 16384 tokens (qkv 2048 -> 4096, o 2048 -> 2048,
 * gate_up 2048 -> 12288, down 6144 -> 2048) and the LM head 2048 -> 151936 in the model's row
 * chunks on the GPU (4096) and in 220-row chunks (64 MiB of logits: the dW product reads and
 * writes the whole fp32 dW per chunk). TFLOP/s = 2 N IC OC / time against 989 dense bf16.
 * Variant 1 runs on the layer shapes only (the LM head would take seconds per call).
 * First, the generation step's products (64, 128 and 256 rows, forward, variants 2, 3, 5, 7) in
 * GB/s of the weights they read; the Qwen3-1.7B decode runs 128.
 */
#include "../../kernels/matmul.cu"
#include "../../kernels/ptx.cuh"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// variant 4: a hand-written product for few rows (see the top)

#define FEW_ROWS 128    // rows a block holds
#define FEW_BM 64       // output columns (weight rows) per block
#define FEW_BK 64       // k per stage
#define FEW_STAGES 4
#define FEW_LD (FEW_BK + 8)  // bf16 per shared row: 144 bytes, ldmatrix rows on distinct banks
#define FEW_SMEM ((size_t)FEW_STAGES * (FEW_BM + FEW_ROWS) * FEW_LD * sizeof(bf16))

// Block (column tile blockIdx.x, k split blockIdx.y): out columns [64 bx, 64 bx + 64) of rows
// 0 .. N-1 over k in [kper by, kper (by + 1)). Warp (wm, wn): columns 32 wm .. +32, rows 64 wn
// .. +64 (rows past N are zeros, never stored). part: (splits, N, OC) fp32, else out bf16.
__global__ void __launch_bounds__(128) matmul_few_rows_kernel(bf16* __restrict__ out,
                                                              float* __restrict__ part,
                                                              const bf16* __restrict__ x,
                                                              const bf16* __restrict__ w, int N,
                                                              int IC, int OC, int kper) {
    extern __shared__ __align__(16) bf16 few_sm[];
    bf16* sw = few_sm;                                           // (STAGES, BM, LD)
    bf16* sx = few_sm + (size_t)FEW_STAGES * FEW_BM * FEW_LD;    // (STAGES, ROWS, LD)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp & 1, wn = warp >> 1;
    const int c0 = blockIdx.x * FEW_BM, kb = blockIdx.y * kper, nk = kper / FEW_BK;
    auto load = [&](int slot, int kt) {
        const int k0 = kb + kt * FEW_BK;
        bf16* dw = sw + (size_t)slot * FEW_BM * FEW_LD;
        bf16* dx = sx + (size_t)slot * FEW_ROWS * FEW_LD;
#pragma unroll
        for (int i = tid; i < FEW_BM * 8; i += 128) {
            const int r = i >> 3, ch = i & 7;
            cp_async_16(smem_u32(dw + r * FEW_LD + ch * 8), w + (size_t)(c0 + r) * IC + k0 + ch * 8,
                        true);
        }
#pragma unroll
        for (int i = tid; i < FEW_ROWS * 8; i += 128) {
            const int r = i >> 3, ch = i & 7;
            const bool in = r < N;
            cp_async_16(smem_u32(dx + r * FEW_LD + ch * 8),
                        x + (size_t)(in ? r : 0) * IC + k0 + ch * 8, in);
        }
        cp_async_commit();
    };
    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
#pragma unroll
    for (int st = 0; st < FEW_STAGES - 1; st++) {
        if (st < nk)
            load(st, st);
        else
            cp_async_commit();  // (every thread commits one group per step: the counts align)
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<FEW_STAGES - 2>();  // step kt's group has landed (this thread's copies)
        __syncthreads();                  // everyone's, and step kt - 1's slot is free again
        const int nt = kt + FEW_STAGES - 1;
        if (nt < nk)
            load(nt % FEW_STAGES, nt);
        else
            cp_async_commit();
        const bf16* cw = sw + (size_t)(kt % FEW_STAGES) * FEW_BM * FEW_LD;
        const bf16* cx = sx + (size_t)(kt % FEW_STAGES) * FEW_ROWS * FEW_LD;
#pragma unroll
        for (int kk = 0; kk < FEW_BK; kk += 16) {
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = wm * 32 + i * 16 + (lane & 15), c = kk + (lane >> 4) * 8;
                ldsm_x4(a[i], smem_u32(cw + r * FEW_LD + c));
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {  // rows wn·64 + 16 j .. +16: two n8 tiles
                uint32_t b[4];
                const int r = wn * 64 + j * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int c = kk + ((lane >> 3) & 1) * 8;
                ldsm_x4(b, smem_u32(cx + r * FEW_LD + c));
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    mma_16816(acc[i][2 * j], a[i], b[0], b[1]);
                    mma_16816(acc[i][2 * j + 1], a[i], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    // acc[i][j][e]: column c0 + 32 wm + 16 i + lane/4 (+8 for e >= 2), row 64 wn + 8 j +
    // 2 (lane % 4) + (e & 1)
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = c0 + wm * 32 + i * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
                const int row = wn * 64 + j * 8 + 2 * (lane & 3) + (e & 1);
                if (row >= N) continue;
                if (part)
                    part[((size_t)blockIdx.y * N + row) * OC + col] = acc[i][j][e];
                else
                    out[(size_t)row * OC + col] = __float2bfloat16_rn(acc[i][j][e]);
            }
}

// out (N, OC) = bf16(Σ over the splits of part, in split order).
__global__ void matmul_few_rows_sum_kernel(bf16* __restrict__ out, const float* __restrict__ part,
                                           int splits, size_t n) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        float s = part[e];
        for (int k = 1; k < splits; k++) s += part[(size_t)k * n + e];
        out[e] = __float2bfloat16_rn(s);
    }
}

// The k splits of a few-rows product: doubled while the blocks fit one wave (one per
// multiprocessor) and each split keeps at least 256 of k in whole 64-wide steps. 0 when the
// product is not one for the few-rows kernel.
static int few_rows_splits(const CudaCtx* cx, const bf16* inp, const bf16* w, const bf16* bias,
                           int N, int IC, int OC) {
    if (N > FEW_ROWS || bias || IC % FEW_BK != 0 || OC % FEW_BM != 0 || !is_aligned16(inp) ||
        !is_aligned16(w) || FEW_SMEM > cx->max_smem_optin)
        return 0;
    const int tiles = OC / FEW_BM;
    if (tiles >= 4 * cx->n_sms) return 0;  // (the LM head: cuBLASLt's tiles fill the machine)
    int splits = 1;
    while (splits < 8 && tiles * splits * 2 <= cx->n_sms && (IC / (splits * 2)) % FEW_BK == 0 &&
           IC / (splits * 2) >= 256)
        splits *= 2;
    return splits;
}

static void matmul_few_rows(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w, int N,
                            int IC, int OC, int splits) {
    float* part = NULL;
    if (splits > 1)
        part = (float*)cuda_scratch(cx, SCRATCH_PARTIAL, (size_t)splits * N * OC * sizeof(float));
    cuda_check(cudaFuncSetAttribute(matmul_few_rows_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)FEW_SMEM));
    matmul_few_rows_kernel<<<dim3(OC / FEW_BM, splits), 128, FEW_SMEM, cx->stream>>>(
        out, part, inp, w, N, IC, OC, IC / splits);
    cuda_check_launch();
    if (part) {
        const size_t n = (size_t)N * OC;
        matmul_few_rows_sum_kernel<<<grid_size(n, 256) < 1024 ? grid_size(n, 256) : 1024, 256,
                                     0, cx->stream>>>(out, part, splits, n);
        cuda_check_launch();
    }
}


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
// variant dispatch (variants 1, 2, 4, 7; variants 3 and 5 are the benchmark's own loops)

static void matmul_forward(int v, CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w,
                           const bf16* bias, int N, int IC, int OC) {
    if (v == 2 || v == 7)  // cuBLASLt, column-major / row-major orientation
        return matmul_forward_orient(cx, out, inp, w, bias, N, IC, OC, v == 7);
    if (v == 8) return cuda_matmul_forward(cx, out, inp, w, bias, N, IC, OC);
    if (v == 4) {
        const int splits = few_rows_splits(cx, inp, w, bias, N, IC, OC);
        if (splits > 0) return matmul_few_rows(cx, out, inp, w, N, IC, OC, splits);
        return matmul_forward_orient(cx, out, inp, w, bias, N, IC, OC, 0);
    }
    // m = row, n = output column, k = input column
    matmul1<bf16>(cx, out, inp, w, bias, N, OC, IC, IC, 1, 1, IC);
}

static void matmul_backward(int v, CudaCtx* cx, bf16* dinp, float* dw, float* dbias,
                            const bf16* dout, const bf16* inp, const bf16* w, int N, int IC,
                            int OC) {
    if (v == 2 || v == 4 || v == 7 || v == 8)
        return cuda_matmul_backward(cx, dinp, dw, dbias, dout, inp, w, N, IC, OC);
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

static void lt_algo_describe(const cublasLtMatmulAlgo_t* a, char* buf, size_t n);

// One cuBLASLt problem D (m, n) = op(A) op(B) (+ beta D) as kernels/matmul.cu states it: bf16
// operands, fp32 compute, column-major or (row_major) every layout CUBLASLT_ORDER_ROW.
typedef struct LtProblem {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
} LtProblem;

static LtProblem lt_problem_create(int transa, int transb, int m, int n, int k, int lda, int ldb,
                                   int ldc, int out_f32, int row_major) {
    LtProblem p;
    cublas_check(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N,
                      tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublas_check(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    cublas_check(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublas_check(
        cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, transa ? k : m, transa ? m : k, lda));
    cublas_check(
        cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, transb ? n : k, transb ? k : n, ldb));
    cublas_check(cublasLtMatrixLayoutCreate(&p.d, out_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, ldc));
    if (row_major) {
        cublasLtOrder_t row = CUBLASLT_ORDER_ROW;
        cublasLtMatrixLayout_t layouts[3] = {p.a, p.b, p.d};
        for (cublasLtMatrixLayout_t l : layouts)
            cublas_check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &row,
                                                          sizeof row));
    }
    return p;
}

static void lt_problem_destroy(LtProblem* p) {
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->d);
    cublasLtMatmulDescDestroy(p->desc);
}

// Up to `max` of the heuristic's algorithms for the problem, with the production's restriction
// (no split-K reducing in a bf16 output); how many (0 when cuBLASLt has none or refuses).
static int lt_problem_heuristics(CudaCtx* cx, const LtProblem* p, int out_f32,
                                 cublasLtMatmulHeuristicResult_t* res, int max) {
    cublasLtMatmulPreference_t pref;
    cublas_check(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = LT_WORKSPACE_BYTES;
    uint32_t schemes = out_f32 ? (uint32_t)CUBLASLT_REDUCTION_SCHEME_MASK
                               : (uint32_t)CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublas_check(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
    int count = 0;
    cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(cx->lt, p->desc, p->a, p->b, p->d, p->d, pref, max, res,
                                       &count);
    cublasLtMatmulPreferenceDestroy(pref);
    return st == CUBLAS_STATUS_SUCCESS ? count : 0;
}

// Whether cuBLASLt has an algorithm for the forward of (rows, IC, OC) in the row-major
// orientation (variant 7's problem).
static int lt_row_major_supported(CudaCtx* cx, int rows, int IC, int OC) {
    LtProblem p = lt_problem_create(0, 1, rows, OC, IC, IC, IC, OC, 0, 1);
    cublasLtMatmulHeuristicResult_t res;
    const int count = lt_problem_heuristics(cx, &p, 0, &res, 1);
    lt_problem_destroy(&p);
    return count > 0;
}

// Time (ms, median) of `calls` back-to-back D = op(A) op(B) (+ beta D) with the fastest of up to
// 8 algorithms of the heuristic; the same problem as lt_matmul of kernels/matmul.cu (row_major:
// its row-major orientation). `desc` (if not NULL): the fastest algorithm described. INFINITY
// when cuBLASLt has no algorithm.
static double lt_best_of_heuristics(Lab* lab, int calls, int transa, int transb, int m, int n,
                                    int k, const bf16* A, int lda, const bf16* B, int ldb, void* D,
                                    int ldc, int out_f32, float beta, int row_major = 0,
                                    char* desc = NULL, size_t desc_n = 0) {
    CudaCtx* cx = lab->cx;
    LtProblem p = lt_problem_create(transa, transb, m, n, k, lda, ldb, ldc, out_f32, row_major);
    cublasLtMatmulHeuristicResult_t res[8];
    const int count = lt_problem_heuristics(cx, &p, out_f32, res, 8);
    double best = INFINITY;
    const float alpha = 1.0f;
    if (desc) snprintf(desc, desc_n, "(no algorithm)");
    for (int i = 0; i < count; i++) {
        double ms = lab_time_ms(
            lab,
            [&] {
                for (int c = 0; c < calls; c++)
                    cublas_check(cublasLtMatmul(cx->lt, p.desc, &alpha, A, p.a, B, p.b, &beta, D,
                                                p.d, D, p.d, &res[i].algo, cx->lt_workspace,
                                                LT_WORKSPACE_BYTES, cx->stream));
            },
            5, 1);
        if (ms < best && desc) lt_algo_describe(&res[i].algo, desc, desc_n);
        best = std::min(best, ms);
    }
    lt_problem_destroy(&p);
    return best;
}

// ----------------------------------------------------------------------------
// variant 5: an explicit search of cuBLASLt's configurations (decode rows benchmark only)

#define SEARCH_SPLITS_N 8
static const int SEARCH_SPLITS[SEARCH_SPLITS_N] = {1, 2, 3, 4, 6, 8, 12, 16};
#define SEARCH_CHECKED_PER_ALGO 512   // configurations AlgoCheck'ed per algorithm, at most
#define SEARCH_TIMED_PER_ALGO 48      // of those, timed per algorithm (sampled evenly)
#define SEARCH_BUDGET_S 5.0           // wall seconds of search per problem (15 problems)
#define SEARCH_TOP 5

// One configuration of an algorithm, and what it measured.
typedef struct LtConfig {
    cublasLtMatmulAlgo_t algo;
    size_t workspace;
    float waves;
    double ms;
} LtConfig;

// The forward product of kernels/matmul.cu as cuBLASLt sees it (column-major): D (OC, rows) =
// W_cm(IC, OC)ᵀ · x_cm (IC, rows), bf16 in and out, fp32 compute.
typedef struct LtForward {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
} LtForward;

static LtForward lt_forward_create(int rows, int IC, int OC) {
    LtForward f;
    cublas_check(cublasLtMatmulDescCreate(&f.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublas_check(
        cublasLtMatmulDescSetAttribute(f.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    cublas_check(
        cublasLtMatmulDescSetAttribute(f.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublas_check(cublasLtMatrixLayoutCreate(&f.a, CUDA_R_16BF, IC, OC, IC));
    cublas_check(cublasLtMatrixLayoutCreate(&f.b, CUDA_R_16BF, IC, rows, IC));
    cublas_check(cublasLtMatrixLayoutCreate(&f.d, CUDA_R_16BF, OC, rows, OC));
    return f;
}

static void lt_forward_destroy(LtForward* f) {
    cublasLtMatrixLayoutDestroy(f->a);
    cublasLtMatrixLayoutDestroy(f->b);
    cublasLtMatrixLayoutDestroy(f->d);
    cublasLtMatmulDescDestroy(f->desc);
}

static cublasStatus_t lt_forward_try(CudaCtx* cx, const LtForward* f,
                                     const cublasLtMatmulAlgo_t* algo, bf16* out, const bf16* x,
                                     const bf16* w) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul(cx->lt, f->desc, &alpha, w, f->a, x, f->b, &beta, out, f->d, out, f->d,
                          algo, cx->lt_workspace, LT_WORKSPACE_BYTES, cx->stream);
}

static void lt_forward_run(CudaCtx* cx, const LtForward* f, const cublasLtMatmulAlgo_t* algo,
                           bf16* out, const bf16* x, const bf16* w) {
    cublas_check(lt_forward_try(cx, f, algo, out, x, w));
}

// One configuration attribute of an algorithm (the size must match cuBLASLt's storage).
template <typename T>
static void lt_config_get(const cublasLtMatmulAlgo_t* a, cublasLtMatmulAlgoConfigAttributes_t at,
                          T* v) {
    size_t w = 0;
    cublas_check(cublasLtMatmulAlgoConfigGetAttribute(a, at, v, sizeof *v, &w));
}

template <typename T>
static void lt_cap_get(const cublasLtMatmulAlgo_t* a, cublasLtMatmulAlgoCapAttributes_t at, T* v) {
    size_t w = 0;
    cublas_check(cublasLtMatmulAlgoCapGetAttribute(a, at, v, sizeof *v, &w));
}

// Whether the algorithm takes attribute `at` = v.
template <typename T>
static bool lt_config_set(cublasLtMatmulAlgo_t* a, cublasLtMatmulAlgoConfigAttributes_t at, T v) {
    return cublasLtMatmulAlgoConfigSetAttribute(a, at, &v, sizeof v) == CUBLAS_STATUS_SUCCESS;
}

// "algo 21 tile 18 splits 8 (compute type) swizzle 0 stages 20 cluster 0 inner 0 custom 0"
static void lt_algo_describe(const cublasLtMatmulAlgo_t* a, char* buf, size_t n) {
    int32_t id = -1, splits = 1;
    uint32_t tile = 0, scheme = 0, swz = 0, stages = 0, custom = 0;
    uint16_t cluster = 0, inner = 0;
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_ID, &id);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster);
    lt_config_get(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner);
    snprintf(buf, n,
             "algo %d tile %u splits %d (%s) swizzle %u stages %u cluster %u inner %u custom %u",
             id, tile, splits,
             scheme == CUBLASLT_REDUCTION_SCHEME_NONE           ? "none"
             : scheme == CUBLASLT_REDUCTION_SCHEME_INPLACE      ? "in place"
             : scheme == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE ? "compute type"
                                                                : "output type",
             swz, stages, cluster, inner, custom);
}

// The uint32 array capability `cap` of an algorithm (tile or stages ids); {fallback} if none.
static std::vector<uint32_t> lt_cap_ids(const cublasLtMatmulAlgo_t* a,
                                        cublasLtMatmulAlgoCapAttributes_t cap, uint32_t fallback) {
    size_t bytes = 0;
    std::vector<uint32_t> ids;
    if (cublasLtMatmulAlgoCapGetAttribute(a, cap, NULL, 0, &bytes) == CUBLAS_STATUS_SUCCESS &&
        bytes >= sizeof(uint32_t)) {
        ids.resize(bytes / sizeof(uint32_t));
        size_t w = 0;
        cublas_check(cublasLtMatmulAlgoCapGetAttribute(a, cap, ids.data(), bytes, &w));
    }
    if (ids.empty()) ids.push_back(fallback);
    return ids;
}

// Every configuration of every bf16 algorithm that AlgoCheck accepts for the problem, within our
// workspace, with deterministic reductions that do not reduce in bf16 (none, or the compute-type
// scheme), capped per algorithm; grouped per algorithm.
static std::vector<std::vector<LtConfig>> lt_enumerate(CudaCtx* cx, const LtForward* f, int k,
                                                       long* n_space, long* n_checked,
                                                       long* n_passed) {
    int ids[512], n_ids = 0;
    cublas_check(cublasLtMatmulAlgoGetIds(cx->lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF,
                                          CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, 512, ids, &n_ids));
    std::vector<std::vector<LtConfig>> out;
    for (int i = 0; i < n_ids; i++) {
        cublasLtMatmulAlgo_t base;
        if (cublasLtMatmulAlgoInit(cx->lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF,
                                   CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, ids[i],
                                   &base) != CUBLAS_STATUS_SUCCESS)
            continue;
        int32_t splitk = 0;
        uint32_t schemes = 0, swz_support = 0;
        lt_cap_get(&base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &splitk);
        lt_cap_get(&base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes);
        lt_cap_get(&base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swz_support);
        const std::vector<uint32_t> tiles =
            lt_cap_ids(&base, CUBLASLT_ALGO_CAP_TILE_IDS, CUBLASLT_MATMUL_TILE_UNDEFINED);
        const std::vector<uint32_t> stages =
            lt_cap_ids(&base, CUBLASLT_ALGO_CAP_STAGES_IDS, CUBLASLT_MATMUL_STAGES_UNDEFINED);
        const int split_ok = splitk && (schemes & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
        // the space: (tile, splits, swizzle, stages); above the cap, a fixed pseudo-random
        // subset of it (the same on every run), so every tile and split count is drawn from
        std::vector<int32_t> splits;
        for (int si = 0; si < SEARCH_SPLITS_N; si++)
            if (SEARCH_SPLITS[si] == 1 || (split_ok && k / SEARCH_SPLITS[si] >= 128))
                splits.push_back(SEARCH_SPLITS[si]);
        const size_t n_swz = swz_support ? 2 : 1;
        const size_t space = tiles.size() * splits.size() * n_swz * stages.size();
        std::vector<size_t> order(space);
        for (size_t j = 0; j < space; j++) order[j] = j;
        uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)ids[i];
        for (size_t j = space; j > 1; j--) {  // Fisher-Yates with xorshift64
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
            std::swap(order[j - 1], order[h % j]);
        }
        if (space > SEARCH_CHECKED_PER_ALGO) order.resize(SEARCH_CHECKED_PER_ALGO);
        *n_space += (long)space;
        std::vector<LtConfig> mine;
        const long checked = (long)order.size();
        for (size_t idx : order) {
            const uint32_t st = stages[idx % stages.size()];
            const uint32_t swz = (uint32_t)(idx / stages.size() % n_swz);
            const int32_t s = splits[idx / stages.size() / n_swz % splits.size()];
            const uint32_t tile = tiles[idx / stages.size() / n_swz / splits.size()];
            LtConfig c;
            c.algo = base;
            const uint32_t scheme = s > 1 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                                          : CUBLASLT_REDUCTION_SCHEME_NONE;
            cublasLtMatmulHeuristicResult_t res;
            if (!lt_config_set(&c.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile) ||
                !lt_config_set(&c.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, s) ||
                !lt_config_set(&c.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, scheme) ||
                !lt_config_set(&c.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swz) ||
                !lt_config_set(&c.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, st) ||
                cublasLtMatmulAlgoCheck(cx->lt, f->desc, f->a, f->b, f->d, f->d, &c.algo, &res) !=
                    CUBLAS_STATUS_SUCCESS ||
                res.workspaceSize > LT_WORKSPACE_BYTES)
                continue;
            c.workspace = res.workspaceSize;
            c.waves = res.wavesCount;
            c.ms = INFINITY;
            mine.push_back(c);
        }
        *n_checked += checked;
        *n_passed += (long)mine.size();
        if (mine.size() > SEARCH_TIMED_PER_ALGO) {  // every (size / cap)-th: all tiles and splits
            std::vector<LtConfig> kept;
            for (int j = 0; j < SEARCH_TIMED_PER_ALGO; j++)
                kept.push_back(mine[(size_t)j * mine.size() / SEARCH_TIMED_PER_ALGO]);
            mine.swap(kept);
        }
        if (!mine.empty()) out.push_back(mine);
    }
    return out;
}

static double wall_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Variant 5 on one problem: enumerate, screen (5 runs each, round-robin over the algorithms
// until SEARCH_BUDGET_S after the start, enumeration included), re-time the best 2 x SEARCH_TOP
// (median of the lab's --reps), print the best SEARCH_TOP with their attributes, validate each
// against the CPU reference on the rows `ref_rows` (ref: (n_ref, OC)) and run it twice for the
// same bits. Returns the best time (ms).
static double lt_search(Lab* lab, const char* name, int rows, int IC, int OC, const bf16* x,
                        const bf16* w, bf16* out, const std::vector<int>& ref_rows,
                        const std::vector<float>& ref, double bytes) {
    CudaCtx* cx = lab->cx;
    const double t0 = wall_s();
    LtForward f = lt_forward_create(rows, IC, OC);
    long n_space = 0, n_checked = 0, n_passed = 0, n_timed = 0;
    std::vector<std::vector<LtConfig>> per_algo =
        lt_enumerate(cx, &f, IC, &n_space, &n_checked, &n_passed);
    std::vector<LtConfig> timed;
    int budget_hit = 0;
    for (size_t j = 0; !budget_hit; j++) {
        int any = 0;
        for (auto& cs : per_algo) {
            if (j >= cs.size()) continue;
            any = 1;
            if (j > 0 && wall_s() - t0 > SEARCH_BUDGET_S) {  // (each algorithm's first: always)
                budget_hit = 1;
                break;
            }
            LtConfig c = cs[j];
            // (a configuration AlgoCheck accepts may still be refused at the call: skipped)
            if (lt_forward_try(cx, &f, &c.algo, out, x, w) != CUBLAS_STATUS_SUCCESS) continue;
            c.ms = lab_time_ms(lab, [&] { lt_forward_run(cx, &f, &c.algo, out, x, w); }, 5, 1);
            timed.push_back(c);
            n_timed++;
        }
        if (!any) break;
    }
    std::sort(timed.begin(), timed.end(),
              [](const LtConfig& a, const LtConfig& b) { return a.ms < b.ms; });
    if (timed.size() > 2 * SEARCH_TOP) timed.resize(2 * SEARCH_TOP);
    for (LtConfig& c : timed)
        c.ms = lab_time_ms(lab, [&] { lt_forward_run(cx, &f, &c.algo, out, x, w); });
    std::sort(timed.begin(), timed.end(),
              [](const LtConfig& a, const LtConfig& b) { return a.ms < b.ms; });
    if (timed.size() > SEARCH_TOP) timed.resize(SEARCH_TOP);
    printf("  variant 5 %s rows=%d: %zu algorithms with configurations, %ld configurations, "
           "%ld checked, %ld accepted, %ld timed%s, %.1f s\n",
           name, rows, per_algo.size(), n_space, n_checked, n_passed, n_timed,
           budget_hit ? " (time budget reached)" : "", wall_s() - t0);
    const size_t n_out = (size_t)rows * OC;
    for (size_t i = 0; i < timed.size(); i++) {
        char desc[200], what[300];
        lt_algo_describe(&timed[i].algo, desc, sizeof desc);
        printf("    #%zu %.4f ms %5.0f GB/s waves %.2f workspace %zu B: %s\n", i + 1, timed[i].ms,
               bytes / (timed[i].ms * 1e-3) / 1e9, timed[i].waves, timed[i].workspace, desc);
        dev_poison(out, n_out * sizeof(bf16));
        lt_forward_run(cx, &f, &timed[i].algo, out, x, w);
        std::vector<float> a = dev_download_bf16(out, n_out);
        dev_poison(out, n_out * sizeof(bf16));
        lt_forward_run(cx, &f, &timed[i].algo, out, x, w);
        std::vector<float> b = dev_download_bf16(out, n_out);
        snprintf(what, sizeof what, "v5 %s rows=%d #%zu (%s): the same bits twice", name, rows,
                 i + 1, desc);
        lab_check_true(lab, what, memcmp(a.data(), b.data(), n_out * sizeof(float)) == 0);
        std::vector<float> got, want;
        for (size_t r = 0; r < ref_rows.size(); r++) {
            if (ref_rows[r] >= rows) continue;
            got.insert(got.end(), a.begin() + (size_t)ref_rows[r] * OC,
                       a.begin() + (size_t)(ref_rows[r] + 1) * OC);
            want.insert(want.end(), ref.begin() + r * OC, ref.begin() + (r + 1) * OC);
        }
        snprintf(what, sizeof what, "v5 %s rows=%d #%zu: out (sampled rows)", name, rows, i + 1);
        lab_check(lab, what, got.data(), want.data(), got.size(), TOL_BF16);
    }
    lt_forward_destroy(&f);
    return timed.empty() ? INFINITY : timed[0].ms;
}

// The algorithm the production plan cache holds for the forward of (rows, IC, OC) in the
// column-major or row-major orientation (after a call made it), described; "(none)" if none.
static void plan_describe(CudaCtx* cx, int rows, int IC, int OC, int row_major, char* buf,
                          size_t n) {
    snprintf(buf, n, "(none)");
    for (int i = 0; i < cx->n_plans; i++) {
        const MatmulKey* k = &cx->plans[i].key;
        const int match = row_major ? k->transa == 0 && k->transb == 1 && k->m == rows &&
                                          k->n == OC
                                    : k->transa == 1 && k->transb == 0 && k->m == OC &&
                                          k->n == rows;
        if (k->row_major == row_major && match && k->k == IC && !k->bias) {
            lt_algo_describe(&cx->plans[i].algo, buf, n);
            return;
        }
    }
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

// --decode (stripped by main before lab_main parses the rest): only the decode rows benchmark;
// --orient: that without variant 5's search (variants 2, 3, 4, 7: under a minute). Set once
// before the lab starts, read by the benchmark: the lab's callbacks take no extra argument.
static int decode_only = 0, orient_only = 0;

// Rows of the CPU reference of the decode rows benchmark (those below the row count are checked).
static const int DECODE_REF_ROWS[] = {0, 1, 63, 127, 255};

// Variant 9: the rows kernel in each configuration that fits one wave, checked against variant 2
// and timed (GB/s of the weights, as the rest of the decode benchmark).
static void bench_rows_configs(Lab* lab, const char* name, int rows, int IC, int OC, const bf16* x,
                               const bf16* w, bf16* out, double bytes) {
    CudaCtx* cx = lab->cx;
    if (!ATTN_WGMMA_BUILD || !cx->sm90) {
        printf("  variant 9: needs an sm_90a build on a 9.0 device\n");
        return;
    }
    bf16* ref = dev_alloc<bf16>((size_t)rows * OC);
    matmul_forward(2, cx, ref, x, w, NULL, rows, IC, OC);
    const std::vector<float> hr = dev_download_bf16(ref, (size_t)rows * OC);
    for (int bn = 32; bn <= 128; bn += 32) {
        if (OC % bn) continue;
        for (int split = 1; split <= RG_MAX_SPLIT && IC % (split * RG_BK) == 0; split *= 2) {
            const int ctas = OC / bn * split, clusters = rg_max_clusters(cx, bn, split, 0);
            if (ctas > cx->n_sms || (split > 1 && OC / bn > clusters)) continue;
            const RowsPlan p = {bn, split, 0};
            dev_poison(out, (size_t)rows * OC * 2);
            matmul_rows_launch(cx, out, x, w, NULL, rows, IC, OC, p);
            char what[160], shape[128];
            snprintf(what, sizeof what, "v9 %s rows=%d tile %d split %d: out vs variant 2", name,
                     rows, bn, split);
            lab_check(lab, what, dev_download_bf16(out, (size_t)rows * OC).data(), hr.data(),
                      (size_t)rows * OC, TOL_BF16);
            const double ms =
                lab_time_ms(lab, [&] { matmul_rows_launch(cx, out, x, w, NULL, rows, IC, OC, p); });
            snprintf(shape, sizeof shape, "%s N=%d tile %d split %d (%d CTAs, %d clusters)", name,
                     rows, bn, split, ctas, clusters);
            lab_report_bw("matmul fwd (decode, rows kernel)", 9, shape, "weights once, x, out",
                          bytes, ms);
        }
    }
    cuda_check(cudaFree(ref));
}

// The generation step's products: 64, 128 (8 prompts x 16 answers) and 256 rows through each
// linear layer of Qwen3-1.7B and the LM head, forward only; GB/s over the weights read (what
// bounds them). Variant 5 searches cuBLASLt's configurations per problem and prints its best;
// variants 2, 3 and 7 print the algorithm they chose; variant 7 also times the best of the
// heuristic's first 8 in its orientation ("row-major best of 8").
static void bench_decode(Lab* lab) {
    const int row_counts[] = {64, 128, 256}, max_rows = 256;
    const Shape shapes[] = {{"qkv", 2048, 4096, 0},     {"o", 2048, 2048, 0},
                            {"gate_up", 2048, 12288, 0}, {"down", 6144, 2048, 0},
                            {"lm_head", 2048, 151936, 0}};
    CudaCtx* cx = lab->cx;
    const double t_start = wall_s();
    printf("\nbenchmark: decode rows (forward, 64 / 128 / 256 rows)\n");
    lab_bench_header_bw();
    for (const Shape& sh : shapes) {
        bf16* x = dev_random<bf16>((size_t)max_rows * sh.IC, 1.0f, 1);
        bf16* w = dev_random<bf16>((size_t)sh.OC * sh.IC, 0.05f, 2);
        bf16* out = dev_alloc<bf16>((size_t)max_rows * sh.OC);
        // variant 5's reference: the rows DECODE_REF_ROWS of out in double (the weights are the
        // same for every row count, and a row's inputs too)
        std::vector<int> ref_rows(DECODE_REF_ROWS, DECODE_REF_ROWS + 5);
        std::vector<float> ref;
        if (lab_wants(&lab->args, 5) && !orient_only) {
            const std::vector<float> hw = dev_download_bf16(w, (size_t)sh.OC * sh.IC);
            const std::vector<float> hx = dev_download_bf16(x, (size_t)max_rows * sh.IC);
            ref.resize(ref_rows.size() * (size_t)sh.OC);
            for (size_t r = 0; r < ref_rows.size(); r++)
                matmul_forward_cpu(ref.data() + r * sh.OC, hx.data() + (size_t)ref_rows[r] * sh.IC,
                                   hw.data(), NULL, 1, sh.IC, sh.OC);
        }
        for (int rows : row_counts) {
            char shape[96];
            snprintf(shape, sizeof shape, "%s N=%d IC=%d OC=%d", sh.name, rows, sh.IC, sh.OC);
            const double bytes =
                2.0 * ((double)sh.OC * sh.IC + (double)rows * (sh.IC + sh.OC));
            for (int v = 2; v <= 9; v++) {
                if (v == 6 || (v == 5 && orient_only) || !lab_wants(&lab->args, v)) continue;
                if (v == 9) {
                    if (rows <= RG_ROWS) bench_rows_configs(lab, sh.name, rows, sh.IC, sh.OC, x, w,
                                                            out, bytes);
                    continue;
                }
                if (v == 8 && !strcmp(sh.name, "gate_up") && rows <= RG_ROWS) {
                    // the fused gate_up + SwiGLU against the product then SwiGLU
                    bf16* act = dev_alloc<bf16>((size_t)rows * sh.OC / 2);
                    const double t2 = lab_time_ms(lab, [&] {
                        matmul_forward(8, cx, out, x, w, NULL, rows, sh.IC, sh.OC);
                        cuda_swiglu_forward(cx, act, out, rows, sh.OC / 2);
                    });
                    const double t1 = lab_time_ms(lab, [&] {
                        cuda_matmul_swiglu_forward(cx, act, x, w, rows, sh.IC, sh.OC / 2);
                    });
                    lab_report_bw("gate_up + swiglu (decode, two ops)", 8, shape,
                                  "weights once, x, out", bytes, t2);
                    lab_report_bw("gate_up + swiglu (decode, fused)", 8, shape,
                                  "weights once, x, out", bytes, t1);
                    cuda_check(cudaFree(act));
                }
                if (v == 8) {
                    const RowsPlan p = rows_plan(cx, out, x, w, rows, sh.IC, sh.OC, 0);
                    if (p.bn)
                        printf("  variant 8 %s rows=%d: rows kernel, tile %d x split %d (%d CTAs)\n",
                               sh.name, rows, p.bn, p.split, sh.OC / p.bn * p.split);
                    else
                        printf("  variant 8 %s rows=%d: cuBLASLt (variant 2)\n", sh.name, rows);
                }
                if (v == 7 && !lt_row_major_supported(cx, rows, sh.IC, sh.OC)) {
                    printf("  variant 7 %s rows=%d: the row-major orientation has no cuBLASLt "
                           "algorithm for these types (not supported)\n",
                           sh.name, rows);
                    continue;
                }
                double ms;
                char desc[200];
                if (v == 3)
                    ms = lt_best_of_heuristics(lab, 1, 1, 0, sh.OC, rows, sh.IC, w, sh.IC, x,
                                               sh.IC, out, sh.OC, 0, 0.0f, 0, desc, sizeof desc);
                else if (v == 5)
                    ms = lt_search(lab, sh.name, rows, sh.IC, sh.OC, x, w, out, ref_rows, ref,
                                   bytes);
                else
                    ms = lab_time_ms(lab, [&] {
                        matmul_forward(v, cx, out, x, w, NULL, rows, sh.IC, sh.OC);
                    });
                lab_report_bw("matmul fwd (decode)", v, shape, "weights once, x, out", bytes, ms);
                if (v == 2 || v == 7)
                    plan_describe(cx, rows, sh.IC, sh.OC, v == 7, desc, sizeof desc);
                if (v == 2 || v == 3 || v == 7)
                    printf("  variant %d %s rows=%d: %s\n", v, sh.name, rows, desc);
                if (v == 7) {  // the best of the heuristic's first 8 in the row-major orientation
                    ms = lt_best_of_heuristics(lab, 1, 0, 1, rows, sh.OC, sh.IC, x, sh.IC, w,
                                               sh.IC, out, sh.OC, 0, 0.0f, 1, desc, sizeof desc);
                    lab_report_bw("matmul fwd (decode, row-major best of 8)", v, shape,
                                  "weights once, x, out", bytes, ms);
                    printf("  variant 7 best of 8 %s rows=%d: %s\n", sh.name, rows, desc);
                }
            }
        }
        void* bufs[] = {x, w, out};
        for (void* p : bufs) cuda_check(cudaFree(p));
    }
    printf("decode rows benchmark: %.1f s\n", wall_s() - t_start);
}

static void bench(Lab* lab) {
    bench_decode(lab);
    if (decode_only) return;
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
    "  2  cuBLASLt (kernels/matmul.cu): the heuristic's first algorithm, cached\n"
    "  3  cuBLASLt, the fastest of the heuristic's first 8 algorithms (benchmark only)\n"
    "  4  few rows (<= 128): a hand-written mma.sync product with split k (else variant 2)\n"
    "  5  decode rows: an explicit search of cuBLASLt configurations (benchmark only)\n"
    "  6  (retired: a few-rows split-K rule that chose the heuristic's own configuration)\n"
    "  7  cuBLASLt in the row-major orientation (CUBLASLT_ORDER_ROW, m = rows)\n"
    "  8  production: few rows (<= 128) on the wgmma rows kernel (matmul_rows.cuh), else 2\n"
    "  9  decode rows: the rows kernel in every configuration (benchmark only)\n"
    "flag: --decode  only the decode rows benchmark (after the validation)\n"
    "flag: --orient  the decode rows benchmark without variant 5's search (2, 3, 4, 7)\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    if (v == 3 || v == 5 || v == 6 || v == 9) return;  // (benchmark only / retired; 5 and 9
                                                         // validate what they time)
    if (v == 7 && !lt_row_major_supported(lab->cx, 128, 2048, 2048)) {
        printf("variant 7: the row-major orientation has no cuBLASLt algorithm for bf16 (128, "
               "2048, 2048): not supported, not validated\n");
        return;
    }
    validate(lab, v, r, 77, 200, 136, 1, 1);
    validate(lab, v, r, 50, 64, 40, 2, 0);
    validate(lab, v, r, 1, 200, 136, 0, 1);
    // the few-rows kernel (variant 2's forward at <= 128 rows, no bias, k and OC in 64s): k split
    // 8, 2, 4 and 1 ways; a row count that is not a multiple of 8; one row
    validate(lab, v, r, 77, 2048, 1024, 0, 0);
    validate(lab, v, r, 128, 640, 256, 0, 0);
    validate(lab, v, r, 1, 1024, 192, 0, 1);
    validate(lab, v, r, 128, 256, 64, 0, 0);
    if (v == 8) {  // the rows kernel: decode shapes, each tile width, split 1 / 2 / 4, a bias,
                   // row counts not a multiple of 8 (rows past M never stored: poisoned)
        const int cases[][4] = {{128, 2048, 4096, 0}, {128, 2048, 2048, 1}, {77, 6144, 2048, 0},
                                {1, 2048, 12288, 1},  {64, 2048, 12288, 0}, {100, 1024, 8192, 0}};
        for (const auto& c : cases) {
            const RowsPlan p =
                rows_plan(lab->cx, (bf16*)NULL, (bf16*)NULL, (bf16*)NULL, c[0], c[1], c[2], 0);
            printf("variant 8 (%d, %d, %d): %s tile %d split %d\n", c[0], c[1], c[2],
                   p.bn ? "rows kernel" : "cuBLASLt", p.bn, p.split);
            validate(lab, v, r, c[0], c[1], c[2], c[3], 0);
        }
    }
    if (v == 8) {  // the fused gate_up + SwiGLU: the same bits as the product then SwiGLU
        const int IC = 2048, F = 6144, rows[3] = {128, 77, 1};
        std::vector<float> x = rand_bf16(r, (size_t)128 * IC, 1.0f),
                           w = rand_bf16(r, (size_t)2 * F * IC, 0.05f);
        bf16 *d_x = dev_upload_bf16(x), *d_w = dev_upload_bf16(w);
        bf16 *d_gu = dev_alloc<bf16>((size_t)128 * 2 * F), *d_a = dev_alloc<bf16>((size_t)128 * F),
             *d_b = dev_alloc<bf16>((size_t)128 * F);
        for (int M : rows) {
            dev_poison(d_b, (size_t)128 * F * 2);
            matmul_forward(8, lab->cx, d_gu, d_x, d_w, NULL, M, IC, 2 * F);
            cuda_swiglu_forward(lab->cx, d_a, d_gu, M, F);
            const int fused = cuda_matmul_swiglu_forward(lab->cx, d_b, d_x, d_w, M, IC, F);
            const std::vector<float> a = dev_download_bf16(d_a, (size_t)M * F),
                                     b = dev_download_bf16(d_b, (size_t)M * F);
            char what[96];
            snprintf(what, sizeof what, "v8 fused gate_up + swiglu M=%d: the bits of the two ops", M);
            lab_check_true(lab, what, fused && memcmp(a.data(), b.data(), a.size() * 4) == 0);
        }
        void* bufs[] = {d_x, d_w, d_gu, d_a, d_b};
        for (void* p : bufs) cuda_check(cudaFree(p));
    }
    if (v == 7) {  // decode shapes (o at 128 rows; down at 64)
        validate(lab, v, r, 128, 2048, 2048, 0, 0);
        validate(lab, v, r, 64, 6144, 2048, 0, 0);
    }
    if (v == 4 || v == 7 || v == 8) {  // run twice (and for 4 and 8 a row alone): the same bits
        const int N = 77, IC = 2048, OC = v == 8 ? 4096 : 1024;
        std::vector<float> x = rand_bf16(r, (size_t)N * IC, 1.0f),
                           w = rand_bf16(r, (size_t)OC * IC, 0.1f);
        bf16 *d_x = dev_upload_bf16(x), *d_w = dev_upload_bf16(w);
        bf16 *d_a = dev_alloc<bf16>((size_t)N * OC), *d_b = dev_alloc<bf16>((size_t)N * OC);
        matmul_forward(v, lab->cx, d_a, d_x, d_w, NULL, N, IC, OC);
        matmul_forward(v, lab->cx, d_b, d_x, d_w, NULL, N, IC, OC);
        std::vector<float> a = dev_download_bf16(d_a, (size_t)N * OC),
                           b = dev_download_bf16(d_b, (size_t)N * OC);
        lab_check_true(lab, v == 4   ? "few rows: the same bits twice"
                            : v == 8 ? "v8 rows kernel: the same bits twice"
                                     : "v7 row-major: the same bits twice",
                       memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
        if (v != 7) {  // (cuBLASLt's plans depend on the row count: not asked of variant 7)
            matmul_forward(v, lab->cx, d_b, d_x + (size_t)40 * IC, d_w, NULL, 1, IC, OC);
            std::vector<float> one = dev_download_bf16(d_b, OC);
            lab_check_true(lab, v == 4 ? "few rows: a row alone as in the batch"
                                       : "v8 rows kernel: a row alone as in the batch",
                           memcmp(one.data(), a.data() + (size_t)40 * OC, OC * sizeof(float)) == 0);
        }
        void* bufs[] = {d_x, d_w, d_a, d_b};
        for (void* p : bufs) cuda_check(cudaFree(p));
    }
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    int n = 0;
    for (int i = 0; i < argc; i++) {
        if (i > 0 && !strcmp(argv[i], "--decode"))
            decode_only = 1;
        else if (i > 0 && !strcmp(argv[i], "--orient"))
            decode_only = orient_only = 1;
        else
            argv[n++] = argv[i];
    }
    return lab_main(n, argv, "matmul", VARIANTS, 9, 8, validate_variant, bench_lab);
}
