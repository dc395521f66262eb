/*
 * dev/cuda/norm.cu — RMSNorm lab (kernels/norm.cu): forward, optionally fused with the residual
 * add, and backward; bf16 rows (N, C), fp32 math.
 *
 *   make dev-cuda && dev/cuda/build/norm [--validate-only] [--variant K] [--seed S]
 *
 * Variants (forward and backward):
 *   1  naive: one thread per row (forward and dinp), one thread per column summing dw over the
 *      rows: the CPU loops moved onto the GPU.
 *   2  the production forward before session 12: rmsnorm_forward_kernel (kept in kernels/norm.cu
 *      as the fallback for rows over 4096 columns or unaligned ones), one warp per row with
 *      16-byte vectors in a loop, always 8 warps per block; backward as variant 3.
 *   3  production (kernels/norm.cu, included below): forward one warp per row, a lane's loads of
 *      a, b and w issued together into registers (rmsnorm_forward_regs_kernel), fewer warps per
 *      block for small N; backward one block per group of rows, dw as per-block partial sums
 *      reduced in block order (cuda_reduce_partials).
 * Validation: N x C = 333 x 2048 (the vector path) and 65 x 1003 (the scalar path), with and
 * without the residual (once with res in place of a, as ops.h allows); backward with dinp and dw
 * pre-filled (both accumulate), and dinp-only and dw-only calls. Tolerances: bf16 outputs
 * TOL_BF16, rstd and dw TOL_F32; res exactly (one rounding of a + b on both sides). Variant 3's
 * forward also equals variant 2's bit for bit (out, rstd, res) at N = 128 and 333, C = 2048,
 * with and without the residual (and in place): the same per-lane order and roundings.
 * Benchmark: N = 16384 (8 x 2048 tokens) and N = 128 (a decode step of 128 sequences), C = 2048
 * (Qwen3-1.7B).
 */
#include "../../kernels/norm.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference

// x = bf16(a + b) (stored in res) when b is given, else a; rstd (N) = 1 / sqrt(mean(x²) + eps);
// out (N, C) = w · bf16(x · rstd), before its final rounding to bf16.
static void rmsnorm_forward_cpu(float* res, float* out, float* rstd, const float* a, const float* b,
                                const float* w, int N, int C, float eps) {
    for (int n = 0; n < N; n++) {
        const size_t off = (size_t)n * C;
        const float* x = a + off;
        if (b) {
            for (int c = 0; c < C; c++) res[off + c] = bf16r(a[off + c] + b[off + c]);
            x = res + off;
        }
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        const float rs = 1.0f / sqrtf((float)(ss / C) + eps);
        rstd[n] = rs;
        for (int c = 0; c < C; c++) out[off + c] = w[c] * bf16r(x[c] * rs);
    }
}

// With x̂ = x · rstd and g = dout · w: dinp (N, C) += rstd (g - x̂ mean(g · x̂)) (before its
// rounding), dw (C) += Σ_n dout · x̂. Either output may be NULL.
static void rmsnorm_backward_cpu(float* dinp, float* dw, const float* dout, const float* x,
                                 const float* w, const float* rstd, int N, int C) {
    std::vector<double> acc(C, 0.0);
    for (int n = 0; n < N; n++) {
        const size_t off = (size_t)n * C;
        const float rs = rstd[n];
        double dot = 0.0;
        for (int c = 0; c < C; c++) dot += (double)(dout[off + c] * w[c]) * (x[off + c] * rs);
        const float mean = (float)(dot / C);
        for (int c = 0; c < C; c++) {
            const float xh = x[off + c] * rs;
            if (dinp) dinp[off + c] += rs * (dout[off + c] * w[c] - xh * mean);
            acc[c] += (double)dout[off + c] * xh;
        }
    }
    if (dw)
        for (int c = 0; c < C; c++) dw[c] += (float)acc[c];
}

// ----------------------------------------------------------------------------
// variant 1: naive

__global__ void rmsnorm_forward_kernel1(bf16* res, bf16* out, float* rstd, const bf16* a,
                                        const bf16* b, const bf16* w, int N, int C, float eps) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const size_t off = (size_t)n * C;
    const bf16* x = a + off;
    if (b) {  // res may alias a: each element is read before it is written
        for (int c = 0; c < C; c++)
            res[off + c] =
                __float2bfloat16_rn(__bfloat162float(a[off + c]) + __bfloat162float(b[off + c]));
        x = res + off;
    }
    float ss = 0.0f;
    for (int c = 0; c < C; c++) ss += __bfloat162float(x[c]) * __bfloat162float(x[c]);
    const float rs = 1.0f / sqrtf(ss / (float)C + eps);
    if (rstd) rstd[n] = rs;
    for (int c = 0; c < C; c++)
        out[off + c] =
            __float2bfloat16_rn(__bfloat162float(w[c]) * bf16_round(__bfloat162float(x[c]) * rs));
}

__global__ void rmsnorm_backward_dinp_kernel1(bf16* dinp, const bf16* dout, const bf16* inp,
                                              const bf16* w, const float* rstd, int N, int C) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const size_t off = (size_t)n * C;
    const float rs = rstd[n];
    float dot = 0.0f;
    for (int c = 0; c < C; c++)
        dot += (__bfloat162float(dout[off + c]) * __bfloat162float(w[c])) *
               (__bfloat162float(inp[off + c]) * rs);
    const float mean = dot / (float)C;
    for (int c = 0; c < C; c++) {
        const float xh = __bfloat162float(inp[off + c]) * rs;
        const float g = __bfloat162float(dout[off + c]) * __bfloat162float(w[c]);
        dinp[off + c] = __float2bfloat16_rn(__bfloat162float(dinp[off + c]) + rs * (g - xh * mean));
    }
}

__global__ void rmsnorm_backward_dw_kernel1(float* dw, const bf16* dout, const bf16* inp,
                                            const float* rstd, int N, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int n = 0; n < N; n++)
        s += __bfloat162float(dout[(size_t)n * C + c]) *
             (__bfloat162float(inp[(size_t)n * C + c]) * rstd[n]);
    dw[c] += s;
}

// ----------------------------------------------------------------------------
// variant dispatch

static void rmsnorm_forward(int variant, CudaCtx* cx, bf16* res, bf16* out, float* rstd,
                            const bf16* a, const bf16* b, const bf16* w, int N, int C, float eps) {
    switch (variant) {
        case 1:
            rmsnorm_forward_kernel1<<<grid_size(N, 128), 128, 0, cx->stream>>>(res, out, rstd, a, b,
                                                                               w, N, C, eps);
            cuda_check_launch();
            break;
        case 2: {
            const int warps = 8;
            const unsigned grid = grid_size((size_t)N, warps);
            if (C % 8 == 0 && is_aligned16(out) && is_aligned16(a) && is_aligned16(w) &&
                (!b || (is_aligned16(b) && is_aligned16(res))))
                rmsnorm_forward_kernel<8><<<grid, warps * 32, 0, cx->stream>>>(res, out, rstd, a, b,
                                                                                w, N, C, eps);
            else
                rmsnorm_forward_kernel<1><<<grid, warps * 32, 0, cx->stream>>>(res, out, rstd, a, b,
                                                                                w, N, C, eps);
            cuda_check_launch();
            break;
        }
        case 3:
            cuda_rmsnorm_forward(cx, res, out, rstd, a, b, w, N, C, eps);
            break;
    }
}

static void rmsnorm_backward(int variant, CudaCtx* cx, bf16* dinp, float* dw, const bf16* dout,
                             const bf16* inp, const bf16* w, const float* rstd, int N, int C) {
    switch (variant) {
        case 1:
            if (dinp) {
                rmsnorm_backward_dinp_kernel1<<<grid_size(N, 128), 128, 0, cx->stream>>>(
                    dinp, dout, inp, w, rstd, N, C);
                cuda_check_launch();
            }
            if (dw) {
                rmsnorm_backward_dw_kernel1<<<grid_size(C, 128), 128, 0, cx->stream>>>(
                    dw, dout, inp, rstd, N, C);
                cuda_check_launch();
            }
            break;
        case 2:
        case 3:
            cuda_rmsnorm_backward(cx, dinp, dw, dout, inp, w, rstd, N, C);
            break;
    }
}

// ----------------------------------------------------------------------------
// validation

static const float EPS = 1e-6f;

// Weights near 1, as trained norms are; activations of both signs.
static std::vector<float> rand_norm_weight(Rng* r, int C) {
    std::vector<float> w = rand_bf16(r, C, 0.5f);
    for (auto& x : w) x = bf16r(1.0f + x);
    return w;
}

// residual: 0 none, 1 into a separate res, 2 in place (res = a).
static void validate_forward(Lab* lab, int v, Rng* r, int N, int C, int residual) {
    const size_t NC = (size_t)N * C;
    std::vector<float> a = rand_bf16(r, NC, 2.0f), b, w = rand_norm_weight(r, C);
    if (residual) b = rand_bf16(r, NC, 2.0f);
    std::vector<float> res(NC), out(NC), rstd(N);
    rmsnorm_forward_cpu(res.data(), out.data(), rstd.data(), a.data(), residual ? b.data() : NULL,
                        w.data(), N, C, EPS);

    bf16 *d_a = dev_upload_bf16(a), *d_w = dev_upload_bf16(w), *d_b = NULL, *d_res = NULL;
    bf16* d_out = dev_alloc<bf16>(NC);
    float* d_rstd = dev_alloc<float>(N);
    dev_poison(d_out, NC * 2);
    dev_poison(d_rstd, (size_t)N * 4);
    if (residual) {
        d_b = dev_upload_bf16(b);
        d_res = residual == 2 ? d_a : dev_alloc<bf16>(NC);
        if (residual == 1) dev_poison(d_res, NC * 2);
    }
    rmsnorm_forward(v, lab->cx, d_res, d_out, d_rstd, d_a, d_b, d_w, N, C, EPS);
    char what[128];
    const char* mode = residual == 0 ? "" : residual == 1 ? " +residual" : " +residual in place";
    snprintf(what, sizeof what, "fwd v%d N=%d C=%d%s: out", v, N, C, mode);
    lab_check(lab, what, dev_download_bf16(d_out, NC).data(), out.data(), NC, TOL_BF16);
    snprintf(what, sizeof what, "fwd v%d N=%d C=%d%s: rstd", v, N, C, mode);
    lab_check(lab, what, dev_download(d_rstd, N).data(), rstd.data(), N, TOL_F32);
    if (residual) {
        snprintf(what, sizeof what, "fwd v%d N=%d C=%d%s: res", v, N, C, mode);
        lab_check(lab, what, dev_download_bf16(d_res, NC).data(), res.data(), NC, TOL_EXACT);
        cuda_check(cudaFree(d_b));
        if (residual == 1) cuda_check(cudaFree(d_res));
    }
    cuda_check(cudaFree(d_a));
    cuda_check(cudaFree(d_w));
    cuda_check(cudaFree(d_out));
    cuda_check(cudaFree(d_rstd));
}

// Variant v's forward against variant 2's (the kernel production used before), bit for bit: out,
// rstd and res on the same inputs (residual as in validate_forward).
static void validate_forward_same_bits(Lab* lab, int v, Rng* r, int N, int C, int residual) {
    const size_t NC = (size_t)N * C;
    std::vector<float> a = rand_bf16(r, NC, 2.0f), b, w = rand_norm_weight(r, C);
    if (residual) b = rand_bf16(r, NC, 2.0f);
    bf16 *d_w = dev_upload_bf16(w), *d_b = residual ? dev_upload_bf16(b) : NULL;
    std::vector<float> got[2][3];  // [old, new][out, rstd, res]
    for (int k = 0; k < 2; k++) {
        bf16* d_a = dev_upload_bf16(a);  // fresh: the in-place case overwrites it
        bf16* d_out = dev_alloc<bf16>(NC);
        float* d_rstd = dev_alloc<float>(N);
        bf16* d_res = residual == 2 ? d_a : residual ? dev_alloc<bf16>(NC) : NULL;
        dev_poison(d_out, NC * 2);
        dev_poison(d_rstd, (size_t)N * 4);
        if (residual == 1) dev_poison(d_res, NC * 2);
        rmsnorm_forward(k ? v : 2, lab->cx, d_res, d_out, d_rstd, d_a, d_b, d_w, N, C, EPS);
        got[k][0] = dev_download_bf16(d_out, NC);
        got[k][1] = dev_download(d_rstd, N);
        if (residual) got[k][2] = dev_download_bf16(d_res, NC);
        if (residual == 1) cuda_check(cudaFree(d_res));
        cuda_check(cudaFree(d_a));
        cuda_check(cudaFree(d_out));
        cuda_check(cudaFree(d_rstd));
    }
    const char* mode = residual == 0 ? "" : residual == 1 ? " +residual" : " +residual in place";
    const char* names[3] = {"out", "rstd", "res"};
    for (int j = 0; j < (residual ? 3 : 2); j++) {
        char what[128];
        snprintf(what, sizeof what, "fwd v%d = v2 N=%d C=%d%s: %s", v, N, C, mode, names[j]);
        lab_check(lab, what, got[1][j].data(), got[0][j].data(), got[0][j].size(), TOL_EXACT);
    }
    cuda_check(cudaFree(d_w));
    if (d_b) cuda_check(cudaFree(d_b));
}

static void validate_backward(Lab* lab, int v, Rng* r, int N, int C, int want_dinp, int want_dw) {
    const size_t NC = (size_t)N * C;
    std::vector<float> x = rand_bf16(r, NC, 2.0f), dout = rand_bf16(r, NC, 1.0f);
    std::vector<float> w = rand_norm_weight(r, C), dinp = rand_bf16(r, NC, 1.0f);
    std::vector<float> dw = rand_f32(r, C, 1.0f), out(NC), rstd(N);
    rmsnorm_forward_cpu(NULL, out.data(), rstd.data(), x.data(), NULL, w.data(), N, C, EPS);

    bf16 *d_x = dev_upload_bf16(x), *d_dout = dev_upload_bf16(dout), *d_w = dev_upload_bf16(w);
    bf16* d_dinp = dev_upload_bf16(dinp);
    float *d_dw = dev_upload(dw), *d_rstd = dev_upload(rstd);
    rmsnorm_backward(v, lab->cx, want_dinp ? d_dinp : NULL, want_dw ? d_dw : NULL, d_dout, d_x, d_w,
                     d_rstd, N, C);
    std::vector<float> dinp_ref = dinp, dw_ref = dw;  // untouched where not wanted
    rmsnorm_backward_cpu(want_dinp ? dinp_ref.data() : NULL, want_dw ? dw_ref.data() : NULL,
                         dout.data(), x.data(), w.data(), rstd.data(), N, C);
    char what[128];
    const char* mode = want_dinp && want_dw ? "" : want_dinp ? " (dinp only)" : " (dw only)";
    snprintf(what, sizeof what, "bwd v%d N=%d C=%d%s: dinp", v, N, C, mode);
    lab_check(lab, what, dev_download_bf16(d_dinp, NC).data(), dinp_ref.data(), NC,
              want_dinp ? TOL_BF16 : TOL_EXACT);
    snprintf(what, sizeof what, "bwd v%d N=%d C=%d%s: dw", v, N, C, mode);
    lab_check(lab, what, dev_download(d_dw, C).data(), dw_ref.data(), C,
              want_dw ? TOL_F32 : TOL_EXACT);
    void* bufs[] = {d_x, d_dout, d_w, d_dinp, d_dw, d_rstd};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

static void bench_shape(Lab* lab, int N, int C) {
    const double NC = (double)N * C;
    bf16* a = dev_random<bf16>((size_t)N * C, 2.0f, 1);
    bf16* b = dev_random<bf16>((size_t)N * C, 2.0f, 2);
    bf16* dout = dev_random<bf16>((size_t)N * C, 1.0f, 3);
    bf16* w = dev_random<bf16>(C, 1.0f, 4);
    bf16* out = dev_alloc<bf16>((size_t)N * C);
    bf16* res = dev_alloc<bf16>((size_t)N * C);
    bf16* dinp = dev_random<bf16>((size_t)N * C, 1.0f, 5);
    float* rstd = dev_alloc<float>(N);
    float* dw = dev_alloc<float>(C);
    dev_zero(dw, (size_t)C * 4);
    CudaCtx* cx = lab->cx;
    char shape[64];
    snprintf(shape, sizeof shape, "N=%d C=%d", N, C);
    for (int v = 1; v <= 3; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        double ms = lab_time_ms(
            lab, [&] { rmsnorm_forward(v, cx, NULL, out, rstd, a, NULL, w, N, C, EPS); });
        lab_report_bw("rmsnorm fwd", v, shape, "2NC in, 2NC + 4N out", 4 * NC + 4.0 * N, ms);
        ms = lab_time_ms(lab, [&] { rmsnorm_forward(v, cx, res, out, rstd, a, b, w, N, C, EPS); });
        lab_report_bw("residual+rmsnorm fwd", v, shape, "4NC in, 4NC + 4N out", 8 * NC + 4.0 * N,
                      ms);
        rmsnorm_forward(v, cx, NULL, out, rstd, a, NULL, w, N, C, EPS);  // rstd of a
        ms = lab_time_ms(lab, [&] { rmsnorm_backward(v, cx, dinp, dw, dout, a, w, rstd, N, C); });
        lab_report_bw("rmsnorm bwd", v, shape, "6NC + 4N in, 2NC out", 8 * NC + 4.0 * N, ms);
    }
    void* bufs[] = {a, b, dout, w, out, res, dinp, rstd, dw};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

static void bench(Lab* lab) {
    printf("\nbenchmark\n");
    lab_bench_header_bw();
    lab_report_copy(lab, (size_t)16384 * 2048 * 2);
    bench_shape(lab, 16384, 2048);  // a training micro-batch of 8 x 2048 tokens
    bench_shape(lab, 128, 2048);    // a decode step of 128 sequences
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: one thread per row (forward, dinp), one thread per column (dw)\n"
    "  2  the previous production forward: a warp per row, looped 16-byte loads, 8 warps per\n"
    "     block (backward as 3)\n"
    "  3  production (kernels/norm.cu): a warp per row forward, a lane's loads together in\n"
    "     registers, fewer warps per block for small N; row groups and ordered partial sums\n"
    "     backward\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    validate_forward(lab, v, r, 333, 2048, 0);
    validate_forward(lab, v, r, 333, 2048, 1);
    validate_forward(lab, v, r, 65, 1003, 0);
    validate_forward(lab, v, r, 65, 1003, 2);
    validate_backward(lab, v, r, 333, 2048, 1, 1);
    validate_backward(lab, v, r, 333, 2048, 1, 0);
    validate_backward(lab, v, r, 333, 2048, 0, 1);
    validate_backward(lab, v, r, 65, 1003, 1, 1);
    if (v == 3)
        for (int residual = 0; residual <= 2; residual++) {
            validate_forward_same_bits(lab, v, r, 128, 2048, residual);
            validate_forward_same_bits(lab, v, r, 333, 2048, residual);
        }
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "norm", VARIANTS, 3, 3, validate_variant, bench_lab);
}
