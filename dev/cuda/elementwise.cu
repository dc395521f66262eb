/*
 * dev/cuda/elementwise.cu — lab of the memory-bound ops without row reductions
 * (kernels/elementwise.cu): SwiGLU forward and backward, bf16 add, fp32 add (gradient folds),
 * fp32 <-> bf16 conversion (host staging), and the ordered reduction of per-block partial sums
 * that the column reductions share. The token-embedding gather of the same file is validated and
 * timed by dev/cuda/embedding.cu.
 *
 *   make dev-cuda && dev/cuda/build/elementwise [--validate-only] [--variant K] [--seed S]
 *
 * Variants:
 *   1  naive: one thread per element (one per column for the partial-sum reduction).
 *   2  production (kernels/elementwise.cu, included below): grid-stride loops over 16-byte
 *      vectors (8 bf16 or 4 fp32) with a scalar path for odd widths or unaligned pointers; the
 *      reduction reads 8 slices of parts per column at once. The conversions exist in
 *      production only (variant 2): they are the straightforward kernel already.
 * Validation: SwiGLU on (N, F) = (77, 1000) (vector path) and (33, 999) (scalar path), against
 * HF's rounding (silu(gate) rounded to bf16 before the product; TOL_BF16; the GPU's __expf
 * against libm's exp); add and fp32 add on 1,000,003 elements (vector body and scalar tail), on
 * pointers one element off 16-byte alignment, and in place (exact: one rounding on both sides);
 * conversions exactly (round to nearest even); the partial-sum reduction on 512 x 2048 and
 * 7 x 100 parts (TOL_F32).
 * Benchmark: Qwen3-1.7B shapes, N = 16384 tokens, C = 2048, F = 6144; the fp32 add over one
 * layer's gradients (50,331,648 floats); conversions over one staging chunk (8 Mi floats);
 * the reduction of rmsnorm's 512 partial rows of 2048.
 */
#include "../../kernels/elementwise.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference

static float sigmoid_cpu(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// out (N, F) = bf16(silu(gate)) · up with gu (N, 2F) = [gate | up] (before the final rounding).
static void swiglu_forward_cpu(float* out, const float* gu, int N, int F) {
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            const float g = gu[(size_t)n * 2 * F + f], u = gu[(size_t)n * 2 * F + F + f];
            out[(size_t)n * F + f] = bf16r(g * sigmoid_cpu(g)) * u;
        }
}

// dgu (N, 2F) = [dgate | dup]: dup = dy silu(g), dgate = dy u σ(g) (1 + g (1 - σ(g))).
static void swiglu_backward_cpu(float* dgu, const float* dout, const float* gu, int N, int F) {
    for (int n = 0; n < N; n++)
        for (int f = 0; f < F; f++) {
            const float g = gu[(size_t)n * 2 * F + f], u = gu[(size_t)n * 2 * F + F + f];
            const float dy = dout[(size_t)n * F + f], s = sigmoid_cpu(g);
            dgu[(size_t)n * 2 * F + f] = dy * u * s * (1.0f + g * (1.0f - s));
            dgu[(size_t)n * 2 * F + F + f] = dy * (g * s);
        }
}

// ----------------------------------------------------------------------------
// variant 1: naive

__global__ void swiglu_forward_kernel1(bf16* out, const bf16* gu, int N, int F) {
    const size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)N * F) return;
    const size_t n = e / F, f = e % F;
    const float g = __bfloat162float(gu[n * 2 * F + f]),
                u = __bfloat162float(gu[n * 2 * F + F + f]);
    out[e] = __float2bfloat16_rn(bf16_round(g / (1.0f + expf(-g))) * u);
}

__global__ void swiglu_backward_kernel1(bf16* dgu, const bf16* dout, const bf16* gu, int N, int F) {
    const size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (e >= (size_t)N * F) return;
    const size_t n = e / F, f = e % F;
    const float g = __bfloat162float(gu[n * 2 * F + f]),
                u = __bfloat162float(gu[n * 2 * F + F + f]);
    const float dy = __bfloat162float(dout[e]), s = 1.0f / (1.0f + expf(-g));
    dgu[n * 2 * F + f] = __float2bfloat16_rn(dy * u * s * (1.0f + g * (1.0f - s)));
    dgu[n * 2 * F + F + f] = __float2bfloat16_rn(dy * (g * s));
}

__global__ void add_kernel1(bf16* out, const bf16* a, const bf16* b, size_t n) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

__global__ void add_f32_kernel1(float* dst, const float* src, size_t n) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) dst[i] += src[i];
}

__global__ void reduce_partials_kernel1(float* dst, const float* partial, int n_parts, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int p = 0; p < n_parts; p++) s += partial[(size_t)p * C + c];
    dst[c] += s;
}

// ----------------------------------------------------------------------------
// variant dispatch (the conversions: production only)

static void swiglu_forward(int v, CudaCtx* cx, bf16* out, const bf16* gu, int N, int F) {
    if (v == 2) return cuda_swiglu_forward(cx, out, gu, N, F);
    swiglu_forward_kernel1<<<grid_size((size_t)N * F, 256), 256, 0, cx->stream>>>(out, gu, N, F);
    cuda_check_launch();
}

static void swiglu_backward(int v, CudaCtx* cx, bf16* dgu, const bf16* dout, const bf16* gu, int N,
                            int F) {
    if (v == 2) return cuda_swiglu_backward(cx, dgu, dout, gu, N, F);
    swiglu_backward_kernel1<<<grid_size((size_t)N * F, 256), 256, 0, cx->stream>>>(dgu, dout, gu, N,
                                                                                   F);
    cuda_check_launch();
}

static void add(int v, CudaCtx* cx, bf16* out, const bf16* a, const bf16* b, size_t n) {
    if (v == 2) return cuda_add(cx, out, a, b, n);
    add_kernel1<<<grid_size(n, 256), 256, 0, cx->stream>>>(out, a, b, n);
    cuda_check_launch();
}

static void add_f32(int v, CudaCtx* cx, float* dst, const float* src, size_t n) {
    if (v == 2) return cuda_add_f32(cx, dst, src, n);
    add_f32_kernel1<<<grid_size(n, 256), 256, 0, cx->stream>>>(dst, src, n);
    cuda_check_launch();
}

static void reduce_partials(int v, CudaCtx* cx, float* dst, const float* partial, int n_parts,
                            int C) {
    if (v == 2) return cuda_reduce_partials(cx, dst, partial, n_parts, C);
    reduce_partials_kernel1<<<grid_size(C, 256), 256, 0, cx->stream>>>(dst, partial, n_parts, C);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// validation

static void validate_swiglu(Lab* lab, int v, Rng* r, int N, int F) {
    const size_t NF = (size_t)N * F;
    std::vector<float> gu = rand_bf16(r, 2 * NF, 4.0f), dout = rand_bf16(r, NF, 1.0f);
    std::vector<float> out(NF), dgu(2 * NF);
    swiglu_forward_cpu(out.data(), gu.data(), N, F);
    swiglu_backward_cpu(dgu.data(), dout.data(), gu.data(), N, F);
    bf16 *d_gu = dev_upload_bf16(gu), *d_dout = dev_upload_bf16(dout);
    bf16 *d_out = dev_alloc<bf16>(NF), *d_dgu = dev_alloc<bf16>(2 * NF);
    dev_poison(d_out, NF * 2);
    dev_poison(d_dgu, NF * 4);
    swiglu_forward(v, lab->cx, d_out, d_gu, N, F);
    swiglu_backward(v, lab->cx, d_dgu, d_dout, d_gu, N, F);
    char what[128];
    snprintf(what, sizeof what, "swiglu fwd v%d N=%d F=%d: out", v, N, F);
    lab_check(lab, what, dev_download_bf16(d_out, NF).data(), out.data(), NF, TOL_BF16);
    snprintf(what, sizeof what, "swiglu bwd v%d N=%d F=%d: dgu", v, N, F);
    lab_check(lab, what, dev_download_bf16(d_dgu, 2 * NF).data(), dgu.data(), 2 * NF, TOL_BF16);
    void* bufs[] = {d_gu, d_dout, d_out, d_dgu};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// mode 0: aligned; 1: every pointer one element past 16-byte alignment; 2: in place (out = a,
// dst as given).
static void validate_add(Lab* lab, int v, Rng* r, size_t n, int mode) {
    const size_t k = mode == 1 ? 1 : 0;  // element offset
    std::vector<float> a = rand_bf16(r, n + k, 4.0f), b = rand_bf16(r, n + k, 4.0f);
    std::vector<float> fa = rand_f32(r, n + k, 4.0f), fb = rand_f32(r, n + k, 4.0f);
    std::vector<float> sum(n), fsum(n);
    for (size_t i = 0; i < n; i++) {
        sum[i] = bf16r(a[k + i] + b[k + i]);
        fsum[i] = fa[k + i] + fb[k + i];
    }
    bf16 *d_a = dev_upload_bf16(a), *d_b = dev_upload_bf16(b);
    bf16* d_out = mode == 2 ? d_a : dev_alloc<bf16>(n + k);
    float *d_fa = dev_upload(fa), *d_fb = dev_upload(fb);
    if (mode != 2) dev_poison(d_out, (n + k) * 2);
    add(v, lab->cx, d_out + k, d_a + k, d_b + k, n);
    add_f32(v, lab->cx, d_fa + k, d_fb + k, n);
    char what[128];
    const char* tag = mode == 0 ? "" : mode == 1 ? " unaligned" : " in place";
    snprintf(what, sizeof what, "add v%d n=%zu%s: out", v, n, tag);
    lab_check(lab, what, dev_download_bf16(d_out + k, n).data(), sum.data(), n, TOL_EXACT);
    snprintf(what, sizeof what, "add f32 v%d n=%zu%s: dst", v, n, mode == 1 ? " unaligned" : "");
    lab_check(lab, what, dev_download(d_fa + k, n).data(), fsum.data(), n, TOL_EXACT);
    if (mode != 2) cuda_check(cudaFree(d_out));
    void* bufs[] = {d_a, d_b, d_fa, d_fb};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

static void validate_convert(Lab* lab, Rng* r, size_t n) {
    // Wide range and exact ties: random fp32, plus values halfway between two bf16.
    std::vector<float> f = rand_f32(r, n, 1e3f);
    for (size_t i = 0; i < n; i += 7) {
        uint32_t u;
        memcpy(&u, &f[i], 4);
        u = (u & 0xffff0000u) | 0x8000u;  // a tie: rounds to the even neighbour
        memcpy(&f[i], &u, 4);
    }
    std::vector<float> rounded(n);
    for (size_t i = 0; i < n; i++) rounded[i] = bf16r(f[i]);
    float* d_f = dev_upload(f);
    bf16* d_h = dev_alloc<bf16>(n);
    float* d_back = dev_alloc<float>(n);
    dev_poison(d_h, n * 2);
    dev_poison(d_back, n * 4);
    cuda_convert_f32_to_bf16(lab->cx, d_h, d_f, n);
    cuda_convert_bf16_to_f32(lab->cx, d_back, d_h, n);
    char what[128];
    snprintf(what, sizeof what, "convert f32 -> bf16 v2 n=%zu", n);
    lab_check(lab, what, dev_download_bf16(d_h, n).data(), rounded.data(), n, TOL_EXACT);
    snprintf(what, sizeof what, "convert bf16 -> f32 v2 n=%zu", n);
    lab_check(lab, what, dev_download(d_back, n).data(), rounded.data(), n, TOL_EXACT);
    void* bufs[] = {d_f, d_h, d_back};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

static void validate_reduce(Lab* lab, int v, Rng* r, int n_parts, int C) {
    std::vector<float> partial = rand_f32(r, (size_t)n_parts * C, 1.0f), dst = rand_f32(r, C, 1.0f);
    std::vector<float> ref(C);
    for (int c = 0; c < C; c++) {
        double s = 0.0;
        for (int p = 0; p < n_parts; p++) s += partial[(size_t)p * C + c];
        ref[c] = (float)(dst[c] + s);
    }
    float *d_partial = dev_upload(partial), *d_dst = dev_upload(dst);
    reduce_partials(v, lab->cx, d_dst, d_partial, n_parts, C);
    char what[128];
    snprintf(what, sizeof what, "reduce partials v%d parts=%d C=%d: dst", v, n_parts, C);
    lab_check(lab, what, dev_download(d_dst, C).data(), ref.data(), C, TOL_F32);
    cuda_check(cudaFree(d_partial));
    cuda_check(cudaFree(d_dst));
}

// ----------------------------------------------------------------------------
// benchmark

static void bench(Lab* lab) {
    const int N = 16384, C = 2048, F = 6144, PARTS = 512;
    const size_t NF = (size_t)N * F, NC = (size_t)N * C, LAYER = 50331648, STAGE = 8 << 20;
    CudaCtx* cx = lab->cx;
    bf16* gu = dev_random<bf16>(2 * NF, 4.0f, 1);
    bf16* dout = dev_random<bf16>(NF, 1.0f, 2);
    bf16* out = dev_alloc<bf16>(2 * NF);
    float* fa = dev_random<float>(LAYER, 1.0f, 3);
    float* fb = dev_random<float>(LAYER, 1.0f, 4);
    char shape[64];
    printf("\nbenchmark\n");
    lab_bench_header_bw();
    lab_report_copy(lab, NF * 4);
    for (int v = 1; v <= 2; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        snprintf(shape, sizeof shape, "N=%d F=%d", N, F);
        double ms = lab_time_ms(lab, [&] { swiglu_forward(v, cx, out, gu, N, F); });
        lab_report_bw("swiglu fwd", v, shape, "4NF in, 2NF out", 6.0 * NF, ms);
        ms = lab_time_ms(lab, [&] { swiglu_backward(v, cx, out, dout, gu, N, F); });
        lab_report_bw("swiglu bwd", v, shape, "6NF in, 4NF out", 10.0 * NF, ms);
        snprintf(shape, sizeof shape, "n=N*C=%zu", NC);
        ms = lab_time_ms(lab, [&] { add(v, cx, out, gu, dout, NC); });
        lab_report_bw("add", v, shape, "4n in, 2n out", 6.0 * NC, ms);
        snprintf(shape, sizeof shape, "n=%zu (a layer)", LAYER);
        ms = lab_time_ms(lab, [&] { add_f32(v, cx, fa, fb, LAYER); });
        lab_report_bw("add f32", v, shape, "8n in, 4n out", 12.0 * LAYER, ms);
        snprintf(shape, sizeof shape, "parts=%d C=%d", PARTS, C);
        ms = lab_time_ms(lab, [&] { reduce_partials(v, cx, fa, fb, PARTS, C); });
        lab_report_bw("reduce partials", v, shape, "4 parts C + 4C in, 4C out",
                      4.0 * PARTS * C + 8.0 * C, ms);
    }
    if (lab_wants(&lab->args, 2)) {
        snprintf(shape, sizeof shape, "n=%zu (a staging chunk)", STAGE);
        double ms = lab_time_ms(lab, [&] { cuda_convert_f32_to_bf16(cx, out, fa, STAGE); });
        lab_report_bw("convert f32 -> bf16", 2, shape, "4n in, 2n out", 6.0 * STAGE, ms);
        ms = lab_time_ms(lab, [&] { cuda_convert_bf16_to_f32(cx, fb, gu, STAGE); });
        lab_report_bw("convert bf16 -> f32", 2, shape, "2n in, 4n out", 6.0 * STAGE, ms);
    }
    void* bufs[] = {gu, dout, out, fa, fb};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: one thread per element (per column for the partial-sum reduction)\n"
    "  2  production (kernels/elementwise.cu): grid-stride 16-byte vectors, scalar fallback\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    validate_swiglu(lab, v, r, 77, 1000);
    validate_swiglu(lab, v, r, 33, 999);
    validate_add(lab, v, r, 1000003, 0);
    validate_add(lab, v, r, 4099, 1);
    validate_add(lab, v, r, 4099, 2);
    validate_reduce(lab, v, r, 512, 2048);
    validate_reduce(lab, v, r, 7, 100);
    if (v == 2) validate_convert(lab, r, 1000003);
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "elementwise", VARIANTS, 2, 2, validate_variant, bench_lab);
}
