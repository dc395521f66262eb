/*
 * dev/cuda/moe_matmul.cu — lab of the grouped expert GEMM (kernels/moe_matmul.cu): rows
 * offsets[e] .. offsets[e+1] of inp (R, IC) through expert e, w (E, OC, IC) (w_in_out 0,
 * nn.Linear: Qwen3-MoE) or (E, IC, OC) (w_in_out 1: GPT-OSS):
 *   forward  out rows = inp rows · W_e(ᵀ) (+ bias_e)        bf16, overwritten
 *   dinp     dinp rows = dout rows · W_e(ᵀ)                  bf16, overwritten
 *   dW       dW_e += doutᵀ · inp (or inpᵀ · dout)            fp32, accumulated
 *   dbias    dbias_e += Σ_rows dout                          fp32, accumulated
 *
 *   make dev-cuda && dev/cuda/build/moe_matmul [--validate-only] [--variant K] [--seed S]
 *
 * Variants (all in kernels/moe_matmul.cu, included below; the production launcher picks 3 on an
 * sm_90a build on a compute capability 9.0 device, else 2, and 1 for shapes not multiples of 8 or
 * misaligned pointers):
 *   1  naive: 32 x 32 shared-memory tiles, fp32 FMA
 *   2  mma.sync m16n8k16, ldmatrix, 4-stage cp.async ring, 128 x 128 x 32 tiles, 8 warps
 *   3  Hopper wgmma, persistent, warp-specialised (cp.async producer warpgroup, 2 consumer
 *      warpgroups of 64 x 256), 128 x 256 x 64 tiles, 4-stage mbarrier ring
 * Validation, every variant x product x layout: random imbalanced row counts with empty experts
 * (first, last, in a row), sizes multiples of 8 but not of the tiles, one case with many k-tiles;
 * variant 1 also on sizes that are not multiples of 8; the LoRA adapters' shapes (the rank 8, 32,
 * 64 as OC, then as IC). bf16 outputs TOL_BF16, fp32 gradients
 * (pre-filled with random values: they accumulate) TOL_F32 against sums in double; the dW and
 * dbias slices of experts without rows must come back bit-identical; dinp/out pre-filled with
 * NaN.
 * Benchmark (variants 2 and 3; variant 1 would take seconds per call): one micro-batch of the
 * paper's batch, n = 26,624 tokens, routed with counts ~ multinomial over mildly skewed expert
 * probabilities:
 *   Qwen3-30B-A3B  (R = 8 n)  gate_up IC 2048 -> OC 1536, down IC 768 -> OC 2048, E 128, w_in_out 0
 *   GPT-OSS-20B    (R = 4 n)  gate_up IC 2880 -> OC 5760, down IC 2880 -> OC 2880, E 32, w_in_out 1
 * TFLOP/s = 2 R IC OC / time against 989 dense bf16, and as a yardstick the cuBLASLt dense GEMM
 * of the same total size (kernels/matmul.cu: N = R rows through one weight, variant "lt").
 */
#include "../../kernels/moe_matmul.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference (double sums)

// W_e(k = ic, n = oc) in either layout.
static inline float w_at(const float* w, int e, int ic, int oc, int IC, int OC, int w_in_out) {
    const float* we = w + (size_t)e * IC * OC;
    return w_in_out ? we[(size_t)ic * OC + oc] : we[(size_t)oc * IC + ic];
}

static void moe_forward_cpu(float* out, const float* inp, const float* w, const float* bias,
                            const int32_t* offsets, int E, int IC, int OC, int w_in_out) {
    for (int e = 0; e < E; e++)
        for (int r = offsets[e]; r < offsets[e + 1]; r++)
            for (int o = 0; o < OC; o++) {
                double s = bias ? bias[(size_t)e * OC + o] : 0.0;
                for (int i = 0; i < IC; i++)
                    s += (double)inp[(size_t)r * IC + i] * w_at(w, e, i, o, IC, OC, w_in_out);
                out[(size_t)r * OC + o] = (float)s;
            }
}

static void moe_backward_cpu(float* dinp, float* dw, float* dbias, const float* dout,
                             const float* inp, const float* w, const int32_t* offsets, int E,
                             int IC, int OC, int w_in_out) {
    for (int e = 0; e < E; e++) {
        const int r0 = offsets[e], r1 = offsets[e + 1];
        if (r1 <= r0) continue;
        if (dinp)
            for (int r = r0; r < r1; r++)
                for (int i = 0; i < IC; i++) {
                    double s = 0.0;
                    for (int o = 0; o < OC; o++)
                        s += (double)dout[(size_t)r * OC + o] * w_at(w, e, i, o, IC, OC, w_in_out);
                    dinp[(size_t)r * IC + i] = (float)s;
                }
        float* dwe = dw + (size_t)e * IC * OC;
        for (int o = 0; o < OC; o++)
            for (int i = 0; i < IC; i++) {
                float* p = w_in_out ? &dwe[(size_t)i * OC + o] : &dwe[(size_t)o * IC + i];
                double s = *p;
                for (int r = r0; r < r1; r++)
                    s += (double)dout[(size_t)r * OC + o] * inp[(size_t)r * IC + i];
                *p = (float)s;
            }
        if (dbias)
            for (int o = 0; o < OC; o++) {
                double s = dbias[(size_t)e * OC + o];
                for (int r = r0; r < r1; r++) s += dout[(size_t)r * OC + o];
                dbias[(size_t)e * OC + o] = (float)s;
            }
    }
}

// ----------------------------------------------------------------------------
// routing: offsets from row counts

// Offsets of R rows drawn from a multinomial over the experts with weights p (some may be 0:
// those experts stay empty).
static std::vector<int32_t> multinomial_offsets(Rng* r, int R, const std::vector<double>& p) {
    const int E = (int)p.size();
    std::vector<double> cdf(E);
    double tot = 0.0;
    int last = 0;  // the last expert with weight (where a draw rounded up to tot lands)
    for (int e = 0; e < E; e++) {
        tot += p[e];
        cdf[e] = tot;
        if (p[e] > 0.0) last = e;
    }
    std::vector<int32_t> off(E + 1, 0);
    for (int i = 0; i < R; i++) {
        const double u = rng_uniform(r) * tot;
        const int e = (int)(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
        off[(e < E ? e : last) + 1]++;
    }
    for (int e = 0; e < E; e++) off[e + 1] += off[e];
    return off;
}

// Random imbalanced counts summing to R with some experts empty: the first and the last expert
// when `empty_ends`, about a quarter of the others, the rest weighted at random (a factor ~30
// between the lightest and the heaviest).
static std::vector<int32_t> random_offsets(Rng* r, int R, int E, int empty_ends) {
    std::vector<double> p(E);
    double tot = 0.0;
    for (int e = 0; e < E; e++) {
        const bool empty = (empty_ends && (e == 0 || e == E - 1)) || rng_uniform(r) < 0.25f;
        p[e] = empty ? 0.0 : 0.1 + 3.0 * rng_uniform(r) * rng_uniform(r);
        tot += p[e];
    }
    if (tot == 0.0) p[E / 2] = 1.0;
    return multinomial_offsets(r, R, p);
}

// ----------------------------------------------------------------------------
// validation

static void validate(Lab* lab, int v, Rng* r, int R, int E, int IC, int OC, int w_in_out,
                     int with_bias, int with_dinp) {
    std::vector<int32_t> off = random_offsets(r, R, E, 1);
    const size_t nx = (size_t)R * IC, ny = (size_t)R * OC, nw = (size_t)E * IC * OC;
    std::vector<float> x = rand_bf16(r, nx, 1.0f), w = rand_bf16(r, nw, 0.1f),
                       b = rand_bf16(r, (size_t)E * OC, 1.0f), dy = rand_bf16(r, ny, 1.0f);
    std::vector<float> dw = rand_f32(r, nw, 1.0f), db = rand_f32(r, (size_t)E * OC, 1.0f);
    const std::vector<float> dw0 = dw, db0 = db;
    std::vector<float> out(ny), dx(nx);
    moe_forward_cpu(out.data(), x.data(), w.data(), with_bias ? b.data() : NULL, off.data(), E,
                    IC, OC, w_in_out);
    moe_backward_cpu(with_dinp ? dx.data() : NULL, dw.data(), with_bias ? db.data() : NULL,
                     dy.data(), x.data(), w.data(), off.data(), E, IC, OC, w_in_out);

    bf16 *d_x = dev_upload_bf16(x), *d_w = dev_upload_bf16(w), *d_b = dev_upload_bf16(b),
         *d_dy = dev_upload_bf16(dy);
    float *d_dw = dev_upload(dw0), *d_db = dev_upload(db0);
    int32_t* d_off = dev_upload(off);
    bf16 *d_out = dev_alloc<bf16>(ny), *d_dx = dev_alloc<bf16>(nx);
    dev_poison(d_out, ny * 2);
    dev_poison(d_dx, nx * 2);
    CudaCtx* cx = lab->cx;
    cuda_moe_matmul_forward(cx, v, d_out, d_x, d_w, with_bias ? d_b : NULL, d_off, R, E, IC, OC,
                            w_in_out);
    cuda_moe_matmul_backward(cx, v, with_dinp ? d_dx : NULL, d_dw, with_bias ? d_db : NULL, d_dy,
                             d_x, d_w, d_off, R, E, IC, OC, w_in_out);
    cuda_check(cudaGetLastError());

    int n_empty = 0;
    for (int e = 0; e < E; e++) n_empty += off[e + 1] == off[e];
    char tag[128], what[192];
    snprintf(tag, sizeof tag, "v%d R=%d E=%d (%d empty) IC=%d OC=%d w_in_out=%d%s", v, R, E,
             n_empty, IC, OC, w_in_out, with_bias ? " bias" : "");
    snprintf(what, sizeof what, "fwd %s: out", tag);
    lab_check(lab, what, dev_download_bf16(d_out, ny).data(), out.data(), ny, TOL_BF16);
    if (with_dinp) {
        snprintf(what, sizeof what, "bwd %s: dinp", tag);
        lab_check(lab, what, dev_download_bf16(d_dx, nx).data(), dx.data(), nx, TOL_BF16);
    }
    std::vector<float> dw_g = dev_download(d_dw, nw), db_g = dev_download(d_db, (size_t)E * OC);
    snprintf(what, sizeof what, "bwd %s: dW", tag);
    lab_check(lab, what, dw_g.data(), dw.data(), nw, TOL_F32);
    snprintf(what, sizeof what, "bwd %s: dbias", tag);
    lab_check(lab, what, db_g.data(), db.data(), (size_t)E * OC, with_bias ? TOL_F32 : TOL_EXACT);
    int untouched = 1;
    for (int e = 0; e < E; e++) {
        if (off[e + 1] != off[e]) continue;
        const size_t o = (size_t)e * IC * OC;
        untouched &= memcmp(dw_g.data() + o, dw0.data() + o, (size_t)IC * OC * 4) == 0;
        untouched &=
            memcmp(db_g.data() + (size_t)e * OC, db0.data() + (size_t)e * OC, (size_t)OC * 4) == 0;
    }
    snprintf(what, sizeof what, "bwd %s: empty experts' dW, dbias untouched", tag);
    lab_check_true(lab, what, untouched);
    void* bufs[] = {d_x, d_w, d_b, d_dy, d_dw, d_db, d_off, d_out, d_dx};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

typedef struct Shape {
    const char* name;
    int tokens_k;  // experts per token (R = n * K)
    int E, IC, OC, w_in_out;
} Shape;

// Counts ~ multinomial(R, p) with p ∝ exp(0.3 z), z standard normal: a realistic router's mild
// imbalance (some tens of percent between experts), every expert non-empty at these sizes.
static std::vector<int32_t> routing_offsets(Rng* r, int R, int E) {
    std::vector<double> p(E);
    for (int e = 0; e < E; e++) p[e] = exp(0.3 * rng_normal(r));
    return multinomial_offsets(r, R, p);
}

static void bench(Lab* lab, Rng* r) {
    const int n_tokens = 26624;
    const Shape shapes[] = {
        {"qwen3-30b-a3b gate_up", 8, 128, 2048, 1536, 0},
        {"qwen3-30b-a3b down", 8, 128, 768, 2048, 0},
        {"gpt-oss-20b gate_up", 4, 32, 2880, 5760, 1},
        {"gpt-oss-20b down", 4, 32, 2880, 2880, 1},
    };
    CudaCtx* cx = lab->cx;
    printf("\nbenchmark (n = %d tokens; variant lt: cuBLASLt dense GEMM of the same size)\n",
           n_tokens);
    lab_bench_header_flops();
    for (const Shape& sh : shapes) {
        const int R = n_tokens * sh.tokens_k;
        std::vector<int32_t> off = routing_offsets(r, R, sh.E);
        int lo = R, hi = 0;
        for (int e = 0; e < sh.E; e++) {
            lo = std::min(lo, off[e + 1] - off[e]);
            hi = std::max(hi, off[e + 1] - off[e]);
        }
        int32_t* d_off = dev_upload(off);
        bf16* x = dev_random<bf16>((size_t)R * sh.IC, 1.0f, 1);
        bf16* w = dev_random<bf16>((size_t)sh.E * sh.IC * sh.OC, 0.05f, 2);
        bf16* dy = dev_random<bf16>((size_t)R * sh.OC, 1.0f, 3);
        bf16* dx = dev_alloc<bf16>((size_t)R * sh.IC);
        bf16* out = dev_alloc<bf16>((size_t)R * sh.OC);
        float* dw = dev_alloc<float>((size_t)sh.E * sh.IC * sh.OC);
        dev_zero(dw, (size_t)sh.E * sh.IC * sh.OC * 4);
        const double flop = 2.0 * R * (double)sh.IC * sh.OC;
        char shape[160];
        snprintf(shape, sizeof shape, "%s R=%d E=%d IC=%d OC=%d w_in_out=%d rows/expert %d..%d",
                 sh.name, R, sh.E, sh.IC, sh.OC, sh.w_in_out, lo, hi);
        for (int v = 2; v <= MOE_MM_VARIANTS; v++) {
            if (!lab_wants(&lab->args, v)) continue;
            if (v == MOE_MM_WGMMA && !moe_wgmma_available()) {
                printf("| (variant 3 not available on this build/device) |\n");
                continue;
            }
            double f = lab_time_ms(lab, [&] {
                cuda_moe_matmul_forward(cx, v, out, x, w, NULL, d_off, R, sh.E, sh.IC, sh.OC,
                                        sh.w_in_out);
            });
            double bi = lab_time_ms(lab, [&] {
                cuda_moe_matmul_backward(cx, v, dx, NULL, NULL, dy, x, w, d_off, R, sh.E, sh.IC,
                                         sh.OC, sh.w_in_out);
            });
            double bw = lab_time_ms(lab, [&] {
                cuda_moe_matmul_backward(cx, v, NULL, dw, NULL, dy, x, w, d_off, R, sh.E, sh.IC,
                                         sh.OC, sh.w_in_out);
            });
            lab_report_flops("moe fwd", v, shape, flop, f);
            lab_report_flops("moe dinp", v, shape, flop, bi);
            lab_report_flops("moe dW", v, shape, flop, bw);
        }
        if (lab->args.variant == 0) {  // the dense yardstick: one weight for all R rows
            double f = lab_time_ms(lab, [&] {
                cuda_matmul_forward(cx, out, x, w, NULL, R, sh.IC, sh.OC);
            });
            double bi = lab_time_ms(lab, [&] {
                cuda_matmul_backward(cx, dx, NULL, NULL, dy, x, w, R, sh.IC, sh.OC);
            });
            double bw = lab_time_ms(lab, [&] {
                cuda_matmul_backward(cx, NULL, dw, NULL, dy, x, w, R, sh.IC, sh.OC);
            });
            printf("| dense fwd | lt | %s | %.3f | %.1f | %.0f%% |\n", shape, f,
                   flop / (f * 1e-3) / 1e12, 100.0 * flop / (f * 1e-3) / H200_BF16_FLOP_PER_S);
            printf("| dense dinp | lt | %s | %.3f | %.1f | %.0f%% |\n", shape, bi,
                   flop / (bi * 1e-3) / 1e12, 100.0 * flop / (bi * 1e-3) / H200_BF16_FLOP_PER_S);
            printf("| dense dW | lt | %s | %.3f | %.1f | %.0f%% |\n", shape, bw,
                   flop / (bw * 1e-3) / 1e12, 100.0 * flop / (bw * 1e-3) / H200_BF16_FLOP_PER_S);
            fflush(stdout);
        }
        void* bufs[] = {d_off, x, w, dy, dx, out, dw};
        for (void* p : bufs) cuda_check(cudaFree(p));
    }
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: 32x32 shared-memory tiles, fp32 FMA (any shape)\n"
    "  2  mma.sync m16n8k16 + ldmatrix + 4-stage cp.async ring, 128x128x32 tiles (sm_80+)\n"
    "  3  wgmma, warp-specialised, cp.async producer (sm_90a build on a 9.0 device)\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    if (v == MOE_MM_WGMMA && !moe_wgmma_available()) {
        printf("  skip variant 3: needs an sm_90a build on a compute capability 9.0 device\n");
        return;
    }
    for (int wio = 0; wio <= 1; wio++) {
        validate(lab, v, r, 611, 9, 136, 200, wio, wio, 1);
        validate(lab, v, r, 611, 9, 200, 136, wio, !wio, 0);
        validate(lab, v, r, 1500, 6, 264, 392, wio, 1, 1);  // many k-tiles of dW
        validate(lab, v, r, 300, 3, 8, 520, wio, 0, 1);     // K = 8: one partial k-tile
        if (v == MOE_MM_NAIVE) validate(lab, v, r, 211, 5, 36, 22, wio, 1, 1);
    }
    // the per-expert LoRA adapters (llmc/lora.c): the rank as the narrow side, nn.Linear layout,
    // no bias: t = x·Aᵀ (OC = r, one partial n-tile), y = t·Bᵀ (IC = r, one partial k-tile)
    const int ranks[] = {8, 32, 64};
    for (int k = 0; k < 3; k++) {
        validate(lab, v, r, 611, 9, 264, ranks[k], 0, 0, 1);
        validate(lab, v, r, 611, 9, ranks[k], 392, 0, 0, 1);
    }
}

int main(int argc, char** argv) {
    return lab_main(argc, argv, "moe_matmul", VARIANTS, MOE_MM_VARIANTS, MOE_MM_VARIANTS,
                    validate_variant, bench);
}
