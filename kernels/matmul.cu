/*
 * matmul.cu — the three matmuls of a linear layer through cuBLASLt (bf16 operands, fp32
 * accumulation), and the dbias column sum. Forward products of at most 128 rows (the decode step)
 * run on the hand-written kernel of matmul_rows.cuh where its conditions hold.
 *
 * Row-major vs cuBLAS column-major: a row-major (R, K) matrix is the same memory as a column-major
 * (K, R) one, so each row-major product is computed as its transpose:
 *   forward   out (N, OC) = inp · Wᵀ    ->  outᵀ (OC, N) = W_cm(IC, OC)ᵀ · inp_cm (IC, N)
 *   dinp      dinp (N, IC) = dout · W   ->  dinpᵀ (IC, N) = W_cm (IC, OC) · dout_cm (OC, N)
 *   dW        dW (OC, IC) += doutᵀ · inp ->  dWᵀ (IC, OC) += inp_cm (IC, N) · dout_cm (OC, N)ᵀ
 * where X_cm is the row-major buffer read as column-major. dW is fp32 with beta = 1 (parameter
 * gradients accumulate); out and dinp are bf16 (beta = 0).
 *
 * Plans: the matmul descriptor, the four layouts and the heuristic's algorithm are cached per
 * problem (orientation, transposes, m, n, k, types, epilogue, beta, pointer alignments) in the
 * context, so the heuristic runs once per shape. Every product takes the heuristic's first
 * algorithm. Split-K schemes that reduce in the output type are excluded for bf16 outputs (partial
 * sums would be rounded to bf16); every cuBLASLt reduction scheme is deterministic (in-place
 * reduction is sequenced by counters). (A rule splitting the heuristic's algorithm along k for few
 * rows chose the heuristic's own configuration for every decode shape on the H200, and an explicit
 * search of cuBLASLt's configurations found nothing faster: the lab keeps the search as variant 5.)
 *
 * Row-major orientation (the lab's variant 7 only): a forward product can be given to cuBLASLt
 * the other way round, m = rows: every layout CUBLASLT_ORDER_ROW,
 *   out (N, OC) row = inp (N, IC) row · W (OC, IC) rowᵀ      (transa N, transb T)
 * the same memory as the column-major form, so no transpose kernel. The fused bias epilogue adds a
 * bias per row of D (here per token), so with a bias this orientation adds it with
 * add_bias_kernel. At the decode step's 128 rows cuBLASLt picks the same algorithm and times as
 * in the column-major form (docs/PERF.md, session 12), so production keeps the column-major one.
 *
 * dbias (OC) += Σ_rows dout: per-block partial column sums over fixed row chunks, then the ordered
 * reduction of elementwise.cu. No atomics.
 */
#include "common.cuh"
#include "matmul_rows.cuh"

// ----------------------------------------------------------------------------
// plan cache

#define PLAN_CACHE_SIZE 64

typedef struct MatmulKey {
    int row_major;  // every layout CUBLASLT_ORDER_ROW (m, n, k and ld in row-major terms)
    int transa, transb, m, n, k, lda, ldb, ldc;
    int out_f32;   // D (and C) fp32 instead of bf16
    int bias;      // bias epilogue
    int beta_one;  // accumulate into D
    int align_a, align_b, align_d, align_bias;  // pointer alignments in bytes (up to 16)
} MatmulKey;

struct MatmulPlan {
    MatmulKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

static int ptr_alignment(const void* p) {
    uintptr_t a = (uintptr_t)p;
    int al = 16;
    while (al > 1 && (a % (uintptr_t)al) != 0) al /= 2;
    return al;
}

static void plan_destroy(MatmulPlan* p) {
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->d);
    cublasLtMatmulDescDestroy(p->desc);
}

void cuda_matmul_plans_free(CudaCtx* cx) {
    for (int i = 0; i < cx->n_plans; i++) plan_destroy(&cx->plans[i]);
    free(cx->plans);
    cx->plans = NULL;
    cx->n_plans = 0;
}

static MatmulPlan* plan_get(CudaCtx* cx, const MatmulKey* key) {
    for (int i = 0; i < cx->n_plans; i++)
        if (memcmp(&cx->plans[i].key, key, sizeof *key) == 0) return &cx->plans[i];
    if (!cx->plans) cx->plans = (MatmulPlan*)calloc_check(PLAN_CACHE_SIZE, sizeof(MatmulPlan));
    MatmulPlan* p;
    if (cx->n_plans < PLAN_CACHE_SIZE) {
        p = &cx->plans[cx->n_plans++];
    } else {  // full: replace entries round-robin (shapes are few; this is a safety valve)
        p = &cx->plans[cx->next_evict];
        cx->next_evict = (cx->next_evict + 1) % PLAN_CACHE_SIZE;
        plan_destroy(p);
    }
    memset(p, 0, sizeof *p);
    p->key = *key;

    const cudaDataType_t dt = key->out_f32 ? CUDA_R_32F : CUDA_R_16BF;
    cublas_check(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = key->transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = key->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (key->bias) {
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bt = CUDA_R_16BF;
        cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
        cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    // Stored (pre-transpose) shapes, column-major (or row-major: the same rows and columns with
    // every layout's order set to row).
    int a_rows = key->transa ? key->k : key->m, a_cols = key->transa ? key->m : key->k;
    int b_rows = key->transb ? key->n : key->k, b_cols = key->transb ? key->k : key->n;
    cublas_check(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, a_rows, a_cols, key->lda));
    cublas_check(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, b_rows, b_cols, key->ldb));
    cublas_check(cublasLtMatrixLayoutCreate(&p->d, dt, key->m, key->n, key->ldc));
    if (key->row_major) {
        cublasLtOrder_t row = CUBLASLT_ORDER_ROW;
        cublasLtMatrixLayout_t layouts[3] = {p->a, p->b, p->d};
        for (int i = 0; i < 3; i++)
            cublas_check(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_ORDER,
                                                          &row, sizeof row));
    }

    cublasLtMatmulPreference_t pref;
    cublas_check(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = LT_WORKSPACE_BYTES;
    uint32_t schemes = key->out_f32 ? (uint32_t)CUBLASLT_REDUCTION_SCHEME_MASK
                                    : (uint32_t)CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    uint32_t al_a = key->align_a, al_b = key->align_b, al_d = key->align_d;
    cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d));

    cublasLtMatmulHeuristicResult_t res;
    int count = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cx->lt, p->desc, p->a, p->b, p->d, p->d,
                                                       pref, 1, &res, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || count == 0)
        fatal("cuBLASLt has no algorithm for m=%d n=%d k=%d (%s, trans %d%d, lda %d ldb %d ldc %d, "
              "%s output, bias %d, alignments %d/%d/%d): status %s", key->m, key->n, key->k,
              key->row_major ? "row-major" : "column-major", key->transa, key->transb, key->lda,
              key->ldb, key->ldc,
              key->out_f32 ? "fp32" : "bf16", key->bias, key->align_a, key->align_b,
              key->align_d, cublasLtGetStatusString(st));
    p->algo = res.algo;
    return p;
}

// D (m, n) = alpha op(A) op(B) + beta D (column-major, or row-major with row_major = 1), with the
// plan for this problem.
static void lt_matmul(CudaCtx* cx, int transa, int transb, int m, int n, int k, const bf16* A,
                      int lda, const bf16* B, int ldb, void* D, int ldc, int out_f32,
                      const bf16* bias, float beta, float alpha, int row_major) {
    MatmulKey key;
    memset(&key, 0, sizeof key);  // padding bytes take part in the memcmp
    key.row_major = row_major;
    key.transa = transa;
    key.transb = transb;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.out_f32 = out_f32;
    key.bias = bias != NULL;
    key.beta_one = beta != 0.0f;
    key.align_a = ptr_alignment(A);
    key.align_b = ptr_alignment(B);
    key.align_d = ptr_alignment(D);
    key.align_bias = bias ? ptr_alignment(bias) : 0;
    MatmulPlan* p = plan_get(cx, &key);
    if (bias)
        cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &bias, sizeof bias));
    cublas_check(cublasLtMatmul(cx->lt, p->desc, &alpha, A, p->a, B, p->b, &beta, D, p->d, D,
                                p->d, &p->algo, cx->lt_workspace, LT_WORKSPACE_BYTES,
                                cx->stream));
}

// ----------------------------------------------------------------------------
// bias helpers

// out (N, OC) += bias, for bias pointers the epilogue cannot take (misaligned).
__global__ void add_bias_kernel(bf16* __restrict__ out, const bf16* __restrict__ bias, int N,
                                int OC) {
    size_t total = (size_t)N * OC;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(out[i]) + __bfloat162float(bias[i % OC]));
}

#define DBIAS_CHUNKS 64  // row chunks of the dbias partial sums (fixed: the sum order is fixed)

// partial (chunks, OC): column sums of dout over row chunk blockIdx.y, rows in order.
__global__ void dbias_partial_kernel(float* __restrict__ partial, const bf16* __restrict__ dout,
                                     int N, int OC, int rows_per_chunk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float s = 0.0f;
    for (int r = r0; r < r1; r++) s += __bfloat162float(dout[(size_t)r * OC + c]);
    partial[(size_t)blockIdx.y * OC + c] = s;
}

// ----------------------------------------------------------------------------
// the three products

// The forward in either orientation (see the top); the lab times both.
//   column-major: outᵀ (OC, N) = W_cm (IC, OC)ᵀ · inp_cm (IC, N)    m = OC, n = N
//   row-major:    out (N, OC) = inp (N, IC) · W (OC, IC)ᵀ            m = N, n = OC
// The bias epilogue adds per row of D: per output column only in the column-major form.
static void matmul_forward_orient(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w,
                                  const bf16* bias, int N, int IC, int OC, int row_major) {
    if (N <= 0 || OC <= 0) return;
    int fused_bias = bias != NULL && is_aligned16(bias) && !row_major;
    if (row_major)
        lt_matmul(cx, 0, 1, N, OC, IC, inp, IC, w, IC, out, OC, 0, NULL, 0.0f, 1.0f, 1);
    else
        lt_matmul(cx, 1, 0, OC, N, IC, w, IC, inp, IC, out, OC, 0, fused_bias ? bias : NULL,
                  0.0f, 1.0f, 0);
    if (bias && !fused_bias) {
        add_bias_kernel<<<grid_size((size_t)N * OC, 256) < 4096 ? grid_size((size_t)N * OC, 256)
                                                                 : 4096,
                          256, 0, cx->stream>>>(out, bias, N, OC);
        cuda_check_launch();
    }
}

int cuda_matmul_swiglu_forward(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w, int N,
                               int IC, int F) {
    const RowsPlan p = rows_plan(cx, out, inp, w, N, IC, F, 1);
    if (!p.bn) return 0;
    matmul_rows_launch(cx, out, inp, w, NULL, N, IC, F, p);
    return 1;
}

// Few rows (the decode step) on the rows kernel of matmul_rows.cuh where it applies, else
// cuBLASLt in the column-major orientation.
void cuda_matmul_forward(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w, const bf16* bias,
                         int N, int IC, int OC) {
    const RowsPlan p = rows_plan(cx, out, inp, w, N, IC, OC, 0);
    if (p.bn) return matmul_rows_launch(cx, out, inp, w, bias, N, IC, OC, p);
    matmul_forward_orient(cx, out, inp, w, bias, N, IC, OC, 0);
}

void cuda_matmul_backward(CudaCtx* cx, bf16* dinp, float* dw, float* dbias, const bf16* dout,
                          const bf16* inp, const bf16* w, int N, int IC, int OC) {
    if (N <= 0) return;
    if (dinp) lt_matmul(cx, 0, 0, IC, N, OC, w, IC, dout, OC, dinp, IC, 0, NULL, 0.0f, 1.0f, 0);
    if (dw) lt_matmul(cx, 0, 1, IC, OC, N, inp, IC, dout, OC, dw, IC, 1, NULL, 1.0f, 1.0f, 0);
    if (dbias) {
        int chunks = N < DBIAS_CHUNKS ? N : DBIAS_CHUNKS;
        int rows = (N + chunks - 1) / chunks;
        chunks = (N + rows - 1) / rows;
        float* partial =
            (float*)cuda_scratch(cx, SCRATCH_PARTIAL, (size_t)chunks * OC * sizeof(float));
        dim3 grid(grid_size((size_t)OC, 256), (unsigned)chunks);
        dbias_partial_kernel<<<grid, 256, 0, cx->stream>>>(partial, dout, N, OC, rows);
        cuda_check_launch();
        cuda_reduce_partials(cx, dbias, partial, chunks, OC);
    }
}

// ----------------------------------------------------------------------------
// LoRA's column-range products (ops.h): the same three products on a column range of fused rows,
// with the scale as cuBLASLt's alpha and the ranges as pointer offsets and leading dimensions, so
// no (N, OC) copy is made: the forward stores into (beta = 0) or accumulates onto (beta = 1, bf16
// C = D) its columns of out, reading its input's columns in place (one adapter's part of a fused
// t); the backward reads its columns of dout in place and writes or accumulates dinp's.

void cuda_matmul_cols_forward(CudaCtx* cx, bf16* out, int accumulate, const bf16* inp, int ldi,
                              const bf16* w, float scale, int N, int IC, int OC, int ld, int c0) {
    if (N <= 0 || OC <= 0) return;
    lt_matmul(cx, 1, 0, OC, N, IC, w, IC, inp, ldi, out + c0, ld, 0, NULL,
              accumulate ? 1.0f : 0.0f, scale, 0);
}

void cuda_matmul_cols_backward(CudaCtx* cx, bf16* dinp, int accumulate, float* dw,
                               const bf16* dout, const bf16* inp, const bf16* w, float scale,
                               int N, int IC, int ldi, int OC, int ld, int c0) {
    if (N <= 0) return;
    const bf16* g = dout + c0;
    if (dinp)
        lt_matmul(cx, 0, 0, IC, N, OC, w, IC, g, ld, dinp, ldi, 0, NULL, accumulate ? 1.0f : 0.0f,
                  scale, 0);
    if (dw) lt_matmul(cx, 0, 1, IC, OC, N, inp, ldi, g, ld, dw, IC, 1, NULL, 1.0f, scale, 0);
}
