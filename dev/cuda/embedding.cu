/*
 * dev/cuda/embedding.cu — token-embedding lab: the gather out (N, C) = wte[ids] (forward, in
 * kernels/elementwise.cu) and the deterministic scatter-add dwte (V, C) += dout by ids (backward,
 * kernels/embedding.cu), bf16 activations, fp32 gradient.
 *
 *   make dev-cuda && dev/cuda/build/embedding [--validate-only] [--variant K] [--seed S]
 *
 * Variants:
 *   1  naive: forward one thread per element; backward one thread per column walking the tokens
 *      in order (each dwte element has one writer: deterministic, no atomics, little parallelism).
 *   2  production: forward one warp per row with 16-byte copies (linked from elementwise.o);
 *      backward (kernels/embedding.cu, included below) a stable radix sort of the token positions
 *      by id, then one warp per (id segment, column chunk) summing its rows in token order.
 * Validation: (N, C, V) = (4099, 1000, 5000) with half the tokens drawn from 16 ids (segments
 * longer than the segment sum's unroll) and (2048, 100, 151936) uniform (three radix passes; C
 * not a multiple of 8: the scalar paths). Forward exactly; backward (dwte pre-filled: it
 * accumulates) TOL_F32 against sums in double. Production only: ids outside [0, V) zero their
 * forward row, are skipped by the backward, and set the context's device error word; the
 * decode step's id gather (gather_ids, kernels/elementwise.cu) exactly.
 * Benchmark: N = 16384 tokens, C = 2048, V = 151936 (Qwen3-1.7B), ids uniform and log-uniform
 * (a Zipf-like text distribution: long segments for frequent ids).
 */
#include "../../kernels/embedding.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference

static void embedding_forward_cpu(float* out, const int32_t* ids, const float* wte, int N, int C,
                                  int V) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            out[(size_t)n * C + c] = ids[n] >= 0 && ids[n] < V ? wte[(size_t)ids[n] * C + c] : 0.0f;
}

// dwte (V, C) += Σ_{n: ids[n] = v} dout[n] (sums in double); ids outside [0, V) are skipped.
static void embedding_backward_cpu(float* dwte, const float* dout, const int32_t* ids, int N, int C,
                                   int V) {
    std::vector<double> acc((size_t)V * C, 0.0);
    std::vector<char> seen(V, 0);
    for (int n = 0; n < N; n++) {
        if (ids[n] < 0 || ids[n] >= V) continue;
        seen[ids[n]] = 1;
        for (int c = 0; c < C; c++) acc[(size_t)ids[n] * C + c] += dout[(size_t)n * C + c];
    }
    for (int v = 0; v < V; v++)
        if (seen[v])
            for (int c = 0; c < C; c++) dwte[(size_t)v * C + c] += (float)acc[(size_t)v * C + c];
}

// ----------------------------------------------------------------------------
// variant 1: naive

__global__ void embedding_forward_kernel1(bf16* out, const int32_t* ids, const bf16* wte, int N,
                                          int C, int V) {
    const size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)N * C) return;
    const int id = ids[e / C];
    out[e] = id >= 0 && id < V ? wte[(size_t)id * C + e % C] : __float2bfloat16_rn(0.0f);
}

__global__ void embedding_backward_kernel1(float* dwte, const bf16* dout, const int32_t* ids, int N,
                                           int C, int V) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int n = 0; n < N; n++) {
        const int id = ids[n];
        if (id >= 0 && id < V)
            dwte[(size_t)id * C + c] += __bfloat162float(dout[(size_t)n * C + c]);
    }
}

// ----------------------------------------------------------------------------
// variant dispatch

static void embedding_forward(int v, CudaCtx* cx, bf16* out, const int32_t* ids, const bf16* wte,
                              int N, int C, int V) {
    if (v == 2) return cuda_embedding_forward(cx, out, ids, wte, N, C, V);
    embedding_forward_kernel1<<<grid_size((size_t)N * C, 256), 256, 0, cx->stream>>>(out, ids, wte,
                                                                                     N, C, V);
    cuda_check_launch();
}

static void embedding_backward(int v, CudaCtx* cx, float* dwte, const bf16* dout,
                               const int32_t* ids, int N, int C, int V) {
    if (v == 2) return cuda_embedding_backward(cx, dwte, dout, ids, N, C, V);
    embedding_backward_kernel1<<<grid_size(C, 128), 128, 0, cx->stream>>>(dwte, dout, ids, N, C, V);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// validation

// skew: half the tokens from 16 frequent ids, the rest uniform over [0, V).
static std::vector<int32_t> rand_ids(Rng* r, int N, int V, int skew) {
    std::vector<int32_t> ids(N);
    for (auto& id : ids)
        id = skew && rng_uniform(r) < 0.5f ? (int32_t)rng_below(r, 16) * (V / 16)
                                           : (int32_t)rng_below(r, V);
    return ids;
}

static void validate(Lab* lab, int v, Rng* r, int N, int C, int V, int skew) {
    const size_t NC = (size_t)N * C, VC = (size_t)V * C;
    std::vector<int32_t> ids = rand_ids(r, N, V, skew);
    std::vector<float> wte = rand_bf16(r, VC, 1.0f), dout = rand_bf16(r, NC, 1.0f);
    std::vector<float> dwte = rand_f32(r, VC, 1.0f), out(NC);
    embedding_forward_cpu(out.data(), ids.data(), wte.data(), N, C, V);
    int32_t* d_ids = dev_upload(ids);
    bf16 *d_wte = dev_upload_bf16(wte), *d_dout = dev_upload_bf16(dout),
         *d_out = dev_alloc<bf16>(NC);
    float* d_dwte = dev_upload(dwte);
    dev_poison(d_out, NC * 2);
    embedding_forward(v, lab->cx, d_out, d_ids, d_wte, N, C, V);
    embedding_backward(v, lab->cx, d_dwte, d_dout, d_ids, N, C, V);
    embedding_backward_cpu(dwte.data(), dout.data(), ids.data(), N, C, V);
    char what[128];
    snprintf(what, sizeof what, "fwd v%d N=%d C=%d V=%d%s: out", v, N, C, V, skew ? " skewed" : "");
    lab_check(lab, what, dev_download_bf16(d_out, NC).data(), out.data(), NC, TOL_EXACT);
    snprintf(what, sizeof what, "bwd v%d N=%d C=%d V=%d%s: dwte", v, N, C, V,
             skew ? " skewed" : "");
    lab_check(lab, what, dev_download(d_dwte, VC).data(), dwte.data(), VC, TOL_F32);
    lab_check_true(lab, "no device error flagged for valid ids", lab_take_device_error(lab) == 0);
    void* bufs[] = {d_ids, d_wte, d_dout, d_out, d_dwte};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// Production only: ids -1 and V among valid ones.
static void validate_bad_ids(Lab* lab, Rng* r) {
    const int N = 300, C = 64, V = 1000;
    std::vector<int32_t> ids = rand_ids(r, N, V, 0);
    ids[7] = -1;
    ids[200] = V;
    std::vector<float> wte = rand_bf16(r, (size_t)V * C, 1.0f),
                       dout = rand_bf16(r, (size_t)N * C, 1.0f);
    std::vector<float> dwte = rand_f32(r, (size_t)V * C, 1.0f), out((size_t)N * C);
    embedding_forward_cpu(out.data(), ids.data(), wte.data(), N, C, V);
    int32_t* d_ids = dev_upload(ids);
    bf16 *d_wte = dev_upload_bf16(wte), *d_dout = dev_upload_bf16(dout);
    bf16* d_out = dev_alloc<bf16>((size_t)N * C);
    float* d_dwte = dev_upload(dwte);
    dev_poison(d_out, (size_t)N * C * 2);
    lab_take_device_error(lab);
    cuda_embedding_forward(lab->cx, d_out, d_ids, d_wte, N, C, V);
    const int e_fwd = lab_take_device_error(lab);
    cuda_embedding_backward(lab->cx, d_dwte, d_dout, d_ids, N, C, V);
    const int e_bwd = lab_take_device_error(lab);
    embedding_backward_cpu(dwte.data(), dout.data(), ids.data(), N, C, V);
    lab_check(lab, "fwd v2 ids -1 and V: out (rows zeroed)",
              dev_download_bf16(d_out, (size_t)N * C).data(), out.data(), (size_t)N * C, TOL_EXACT);
    lab_check(lab, "bwd v2 ids -1 and V: dwte (skipped)",
              dev_download(d_dwte, (size_t)V * C).data(), dwte.data(), (size_t)V * C, TOL_F32);
    lab_check_true(lab, "ids -1 and V flagged in the device error word (fwd and bwd)",
                   (e_fwd & CUDA_ERR_TOKEN_ID) && (e_bwd & CUDA_ERR_TOKEN_ID));
    void* bufs[] = {d_ids, d_wte, d_dout, d_out, d_dwte};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// Production only: the decode step's id gather (kernels/elementwise.cu gather_ids), ids taken
// from the step before's samples where from >= 0, kept elsewhere; exact.
static void validate_gather_ids(Lab* lab, Rng* r) {
    const int n = 1000, S = 1500;
    std::vector<int32_t> ids = rand_ids(r, n, 151936, 0), prev = rand_ids(r, S, 151936, 0);
    std::vector<int32_t> from(n), want = ids;
    for (int k = 0; k < n; k++) {
        from[k] = rng_below(r, 4) == 0 ? -1 : (int32_t)rng_below(r, (uint64_t)S);
        if (from[k] >= 0) want[k] = prev[from[k]];
    }
    int32_t *d_ids = dev_upload(ids), *d_prev = dev_upload(prev), *d_from = dev_upload(from);
    cuda_gather_ids(lab->cx, d_ids, d_prev, d_from, n);
    const std::vector<int32_t> got = dev_download(d_ids, (size_t)n);
    lab_check_true(lab, "gather ids v2: from the step before where from >= 0, kept elsewhere",
                   got == want);
    void* bufs[] = {d_ids, d_prev, d_from};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

static void bench(Lab* lab) {
    const int N = 16384, C = 2048, V = 151936;
    const double NC = (double)N * C;
    Rng r;
    rng_seed(&r, 5);
    std::vector<int32_t> uniform(N), zipf(N);
    for (int n = 0; n < N; n++) {
        uniform[n] = (int32_t)rng_below(&r, V);
        // log-uniform over [1, V]: id k has probability ~ 1/k (Zipf's law with exponent 1)
        zipf[n] = (int32_t)std::min<double>(V - 1, floor(pow((double)V, rng_uniform(&r))) - 1);
    }
    bf16* wte = dev_random<bf16>((size_t)V * C, 1.0f, 1);
    bf16* dout = dev_random<bf16>((size_t)NC, 1.0f, 2);
    bf16* out = dev_alloc<bf16>((size_t)NC);
    float* dwte = dev_alloc<float>((size_t)V * C);
    dev_zero(dwte, (size_t)V * C * 4);
    CudaCtx* cx = lab->cx;
    printf("\nbenchmark\n");
    lab_bench_header_bw();
    lab_report_copy(lab, (size_t)NC * 2);
    for (int dist = 0; dist < 2; dist++) {
        std::vector<int32_t>& ids = dist ? zipf : uniform;
        std::vector<int32_t> sorted = ids;
        std::sort(sorted.begin(), sorted.end());
        const double unique = (double)(std::unique(sorted.begin(), sorted.end()) - sorted.begin());
        int32_t* d_ids = dev_upload(ids);
        char shape[96];
        snprintf(shape, sizeof shape, "N=%d C=%d V=%d %s ids (%.0f distinct)", N, C, V,
                 dist ? "Zipf" : "uniform", unique);
        for (int v = 1; v <= 2; v++) {
            if (!lab_wants(&lab->args, v)) continue;
            double ms =
                lab_time_ms(lab, [&] { embedding_forward(v, cx, out, d_ids, wte, N, C, V); });
            lab_report_bw("embedding fwd", v, shape, "4N + 2NC in, 2NC out", 4 * NC + 4.0 * N, ms);
            ms = lab_time_ms(lab, [&] { embedding_backward(v, cx, dwte, dout, d_ids, N, C, V); });
            lab_report_bw("embedding bwd", v, shape, "4N + 2NC in, rmw 8C per distinct id",
                          2 * NC + 4.0 * N + 8.0 * C * unique, ms);
        }
        cuda_check(cudaFree(d_ids));
    }
    void* bufs[] = {wte, dout, out, dwte};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: forward a thread per element; backward a thread per column over the tokens\n"
    "  2  production: forward a warp per row (kernels/elementwise.cu); backward radix sort by id\n"
    "     and ordered segment sums (kernels/embedding.cu)\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    validate(lab, v, r, 4099, 1000, 5000, 1);
    validate(lab, v, r, 2048, 100, 151936, 0);
    if (v == 2) {
        validate_bad_ids(lab, r);
        validate_gather_ids(lab, r);
    }
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "embedding", VARIANTS, 2, 2, validate_variant, bench_lab);
}
