/*
 * test_gpu_moe.c — the CUDA mixture-of-experts ops (kernels/moe.cu) against the CPU reference
 * (ops_cpu, llmc/ops_cpu_moe.c), on random inputs that are bf16 values, so both backends see the
 * same numbers.
 *
 * Index outputs (the routing's idx, the dispatch's offsets, src, dst) must be EQUAL: both
 * backends get the same bf16 logits, half of the rows drawn from a few values so that ties (to
 * the lower expert index) are common. Sums the CUDA kernels do in the CPU's order and rounding
 * (gather backward, combine forward, the combine backward's dy) must equal the CPU result rounded
 * to bf16; the rest is held to bf16 (relative L2 1e-2) or fp32 (1e-5) tolerances. Outputs are
 * pre-filled with NaN where ops.h says "overwritten". Every op also runs twice: same bits. The
 * router's matmul (E = 32 or 128 outputs, with and without bias) goes through the dense matmul.
 *
 * Without a GPU (or in a build without CUDA) every test reports "skipped".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "testing.h"

#ifdef HAVE_CUDA

#include "../ops.h"
#include "../rng.h"
#include "gpu_testing.h"

// ----------------------------------------------------------------------------
// buffers and comparisons of these tests (the fixture: gpu_testing.h)

// An fp32 or int32 device buffer of 0xff bytes (NaN / -1); bf16 NaNs: dev_nan_bf16.

static void* dev_poison(Gpu* G, size_t bytes) {
    unsigned char* h = malloc_check(bytes > 0 ? bytes : 1);
    memset(h, 0xff, bytes);
    void* d = dev_raw(G, h, bytes);
    free(h);
    return d;
}

// got (bf16 values) == bf16(want) element for element.
static void check_bf16_exact(TestCtx* t, const char* what, const float* got, const float* want,
                             size_t n) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (!(got[i] == bf16_value(want[i]))) {
            if (bad++ == 0) first = i;
        }
    CHECK(t, bad == 0, "%s: %zu of %zu elements differ from the CPU's rounded to bf16 (first at "
          "%zu: %.8g vs %.8g)", what, bad, n, first, bad ? (double)got[first] : 0.0,
          bad ? (double)bf16_value(want[first]) : 0.0);
}

static void check_ints(TestCtx* t, const char* what, const int32_t* got, const int32_t* want,
                       size_t n) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i]) {
            if (bad++ == 0) first = i;
        }
    CHECK(t, bad == 0, "%s: %zu of %zu differ (first at %zu: %d vs %d)", what, bad, n, first,
          bad ? got[first] : 0, bad ? want[first] : 0);
}

// Router logits (n, E), bf16 values: odd rows ~ N(0, scale), even rows from 17 values in
// [-1, 1] (exact in bf16), so rows hold many exact ties, some among the largest.
static float* rand_logits(Gpu* G, int n, int E, float scale) {
    float* z = malloc_check((size_t)n * E * sizeof(float));
    for (int i = 0; i < n; i++)
        for (int e = 0; e < E; e++)
            z[(size_t)i * E + e] = i % 2 ? bf16_value(scale * rng_normal(&G->rng))
                                         : (float)((int)rng_below(&G->rng, 17) - 8) / 8.0f;
    return z;
}

// ----------------------------------------------------------------------------
// routing forward and backward

static void route_case(TestCtx* t, Gpu* G, int n, int E, int K, int mode) {
    char what[160];
    snprintf(what, sizeof what, "route n=%d E=%d K=%d mode=%d", n, E, K, mode);
    const size_t nE = (size_t)n * E, nK = (size_t)n * K;
    float* z = rand_logits(G, n, E, 2.0f);
    int32_t* idx_c = malloc_check(nK * sizeof(int32_t));
    float* w_c = malloc_check(nK * sizeof(float));
    G->c->moe_route_forward(G->cctx, idx_c, w_c, z, n, E, K, mode);

    void* d_z = dev_bf16(G, z, nE);
    void* d_idx = dev_poison(G, nK * sizeof(int32_t));
    void* d_w = dev_poison(G, nK * sizeof(float));
    G->g->moe_route_forward(G->gctx, d_idx, d_w, d_z, n, E, K, mode);
    int32_t* idx_g = host_raw(G, d_idx, nK * sizeof(int32_t));
    float* w_g = host_raw(G, d_w, nK * sizeof(float));
    char w2[200];
    snprintf(w2, sizeof w2, "%s idx", what);
    check_ints(t, w2, idx_g, idx_c, nK);
    snprintf(w2, sizeof w2, "%s weights", what);
    check_rel(t, w2, w_g, w_c, nK, 1e-5);
    // twice: same bits
    G->g->moe_route_forward(G->gctx, d_idx, d_w, d_z, n, E, K, mode);
    int32_t* idx_g2 = host_raw(G, d_idx, nK * sizeof(int32_t));
    float* w_g2 = host_raw(G, d_w, nK * sizeof(float));
    CHECK(t, memcmp(idx_g, idx_g2, nK * 4) == 0 && memcmp(w_g, w_g2, nK * 4) == 0,
          "%s: two runs differ", what);

    // backward from the CPU's routing (both backends get the same idx and weights), without and
    // with the aux term
    float* dw = malloc_check(nK * sizeof(float));
    for (size_t i = 0; i < nK; i++) dw[i] = rng_normal(&G->rng);
    float* counts = malloc_check((size_t)E * sizeof(float));
    for (int e = 0; e < E; e++) counts[e] = (float)rng_below(&G->rng, (uint64_t)(2 * n + 1));
    void* d_dw = dev_raw(G, dw, nK * sizeof(float));
    void* d_counts = dev_raw(G, counts, (size_t)E * sizeof(float));
    void* d_idx_c = dev_raw(G, idx_c, nK * sizeof(int32_t));
    void* d_w_c = dev_raw(G, w_c, nK * sizeof(float));
    float* dl_c = malloc_check(nE * sizeof(float));
    for (int aux = 0; aux <= 1; aux++) {
        // the model's scale: coef N E / R'^2 with counts ~ R' / E, so the term is O(p / n)
        const float aux_scale = aux ? 0.7f / (float)n : 0.0f;
        G->c->moe_route_backward(G->cctx, dl_c, dw, z, idx_c, w_c, counts, aux_scale, n, E, K,
                                 mode);
        void* d_dl = dev_nan_bf16(G, nE);
        G->g->moe_route_backward(G->gctx, d_dl, d_dw, d_z, d_idx_c, d_w_c, d_counts, aux_scale,
                                 n, E, K, mode);
        float* dl_g = host_bf16(G, d_dl, nE);
        snprintf(w2, sizeof w2, "%s backward aux=%d dlogits", what, aux);
        check_rel(t, w2, dl_g, dl_c, nE, 1e-2);
        G->g->moe_route_backward(G->gctx, d_dl, d_dw, d_z, d_idx_c, d_w_c, d_counts, aux_scale,
                                 n, E, K, mode);
        float* dl_g2 = host_bf16(G, d_dl, nE);
        CHECK(t, memcmp(dl_g, dl_g2, nE * sizeof(float)) == 0, "%s: two runs differ", w2);
        free(dl_g);
        free(dl_g2);
        gfree(G, d_dl);
    }

    free(z);
    free(idx_c);
    free(w_c);
    free(idx_g);
    free(w_g);
    free(idx_g2);
    free(w_g2);
    free(dw);
    free(counts);
    free(dl_c);
    void* bufs[] = {d_z, d_idx, d_w, d_dw, d_counts, d_idx_c, d_w_c};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gfree(G, bufs[i]);
}

static void test_gpu_moe_ops_route(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 151)) return;
    for (int mode = 0; mode <= 2; mode++) {
        route_case(t, &G, 300, 128, 8, mode);  // Qwen3-30B-A3B: 4 experts per lane
        route_case(t, &G, 257, 32, 4, mode);   // GPT-OSS-20B: one per lane, a partial block
        route_case(t, &G, 70, 60, 6, mode);    // padding lanes (E not a multiple of 32)
        route_case(t, &G, 40, 256, 8, mode);   // the largest E
        route_case(t, &G, 33, 5, 5, mode);     // K = E: every expert chosen
        route_case(t, &G, 9, 8, 1, mode);      // top-1
    }
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// dispatch and router statistics

// skew 0: idx from the CPU routing of random logits; 1: most assignments to one expert.
static void dispatch_case(TestCtx* t, Gpu* G, int n, int E, int K, int skew) {
    char what[160];
    snprintf(what, sizeof what, "dispatch n=%d E=%d K=%d skew=%d", n, E, K, skew);
    const size_t nK = (size_t)n * K;
    float* z = rand_logits(G, n, E, 1.0f);
    int32_t* idx = malloc_check((nK > 0 ? nK : 1) * sizeof(int32_t));
    float* w = malloc_check((nK > 0 ? nK : 1) * sizeof(float));
    if (skew)
        for (size_t r = 0; r < nK; r++)
            idx[r] = rng_below(&G->rng, 10) ? E / 2 : (int32_t)rng_below(&G->rng, (uint64_t)E);
    else if (n > 0)
        G->c->moe_route_forward(G->cctx, idx, w, z, n, E, K, MOE_ROUTE_SOFTMAX_TOPK);
    int32_t* off_c = malloc_check((size_t)(E + 1) * sizeof(int32_t));
    int32_t* src_c = malloc_check((nK > 0 ? nK : 1) * sizeof(int32_t));
    int32_t* dst_c = malloc_check((nK > 0 ? nK : 1) * sizeof(int32_t));
    G->c->moe_dispatch(G->cctx, off_c, src_c, dst_c, idx, n, E, K);

    void* d_idx = dev_raw(G, idx, nK * sizeof(int32_t));
    void* d_off = dev_poison(G, (size_t)(E + 1) * sizeof(int32_t));
    void* d_src = dev_poison(G, nK * sizeof(int32_t));
    void* d_dst = dev_poison(G, nK * sizeof(int32_t));
    for (int run = 0; run < 2; run++) {  // the second run finds the first's results in place
        G->g->moe_dispatch(G->gctx, d_off, d_src, d_dst, d_idx, n, E, K);
        int32_t* off_g = host_raw(G, d_off, (size_t)(E + 1) * sizeof(int32_t));
        int32_t* src_g = host_raw(G, d_src, nK * sizeof(int32_t));
        int32_t* dst_g = host_raw(G, d_dst, nK * sizeof(int32_t));
        char w2[200];
        snprintf(w2, sizeof w2, "%s run %d offsets", what, run);
        check_ints(t, w2, off_g, off_c, (size_t)E + 1);
        snprintf(w2, sizeof w2, "%s run %d src", what, run);
        check_ints(t, w2, src_g, src_c, nK);
        snprintf(w2, sizeof w2, "%s run %d dst", what, run);
        check_ints(t, w2, dst_g, dst_c, nK);
        free(off_g);
        free(src_g);
        free(dst_g);
    }

    // router statistics of these logits and offsets
    if (!skew) {
        float* st_c = malloc_check((size_t)2 * E * sizeof(float));
        G->c->moe_router_stats(G->cctx, st_c, z, off_c, n, E);
        void* d_z = dev_bf16(G, z, (size_t)n * E);
        void* d_st = dev_poison(G, (size_t)2 * E * sizeof(float));
        G->g->moe_router_stats(G->gctx, d_st, d_z, d_off, n, E);
        float* st_g = host_raw(G, d_st, (size_t)2 * E * sizeof(float));
        G->g->moe_router_stats(G->gctx, d_st, d_z, d_off, n, E);
        float* st_g2 = host_raw(G, d_st, (size_t)2 * E * sizeof(float));
        char w2[200];
        snprintf(w2, sizeof w2, "router stats n=%d E=%d counts", n, E);
        CHECK(t, memcmp(st_g, st_c, (size_t)E * sizeof(float)) == 0, "%s differ", w2);
        snprintf(w2, sizeof w2, "router stats n=%d E=%d probability sums", n, E);
        check_rel(t, w2, st_g + E, st_c + E, (size_t)E, 1e-5);
        CHECK(t, memcmp(st_g, st_g2, (size_t)2 * E * sizeof(float)) == 0, "%s: two runs differ",
              w2);
        free(st_c);
        free(st_g);
        free(st_g2);
        gfree(G, d_z);
        gfree(G, d_st);
    }

    free(z);
    free(idx);
    free(w);
    free(off_c);
    free(src_c);
    free(dst_c);
    void* bufs[] = {d_idx, d_off, d_src, d_dst};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gfree(G, bufs[i]);
}

static void test_gpu_moe_ops_dispatch(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 152)) return;
    dispatch_case(t, &G, 300, 128, 8, 0);    // 3 blocks of the sort, the last one partial
    dispatch_case(t, &G, 5000, 128, 8, 0);   // 40 blocks
    dispatch_case(t, &G, 3000, 32, 4, 0);    // GPT-OSS
    dispatch_case(t, &G, 2000, 256, 8, 1);   // one expert takes most rows (long runs)
    dispatch_case(t, &G, 31250, 256, 8, 0);  // 250,000 assignments: the scan's segments > 1
    dispatch_case(t, &G, 7, 8, 2, 0);        // fewer assignments than a tile
    dispatch_case(t, &G, 0, 16, 4, 1);       // empty: offsets all 0
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// gather, gather backward, combine forward and backward

// misalign: every activation pointer one element past 16-byte alignment (the scalar path).
static void rows_case(TestCtx* t, Gpu* G, int n, int E, int K, int C, int misalign) {
    char what[160];
    snprintf(what, sizeof what, "moe rows n=%d K=%d C=%d misalign=%d", n, K, C, misalign);
    const size_t nK = (size_t)n * K, nC = (size_t)n * C, RC = nK * C, m = misalign ? 1 : 0;
    float* z = rand_logits(G, n, E, 1.0f);
    int32_t* idx = malloc_check(nK * sizeof(int32_t));
    float* w = malloc_check(nK * sizeof(float));
    G->c->moe_route_forward(G->cctx, idx, w, z, n, E, K, MOE_ROUTE_SOFTMAX_TOPK_NORM);
    int32_t* off = malloc_check((size_t)(E + 1) * sizeof(int32_t));
    int32_t* src = malloc_check(nK * sizeof(int32_t));
    int32_t* dst = malloc_check(nK * sizeof(int32_t));
    G->c->moe_dispatch(G->cctx, off, src, dst, idx, n, E, K);
    void* d_src = dev_raw(G, src, nK * sizeof(int32_t));
    void* d_dst = dev_raw(G, dst, nK * sizeof(int32_t));
    void* d_w = dev_raw(G, w, nK * sizeof(float));
    char w2[200];

    // gather: exact copies
    float* x = rand_bf16(G, nC, 1.0f);
    float* xp_c = malloc_check(RC * sizeof(float));
    G->c->moe_gather(G->cctx, xp_c, x, src, n, K, C);
    char* d_x = dev_nan_bf16(G, nC + m);  // + m: room for the shift
    G->g->upload_f32(G->gctx, d_x + 2 * m, x, nC);
    char* d_xp = dev_nan_bf16(G, RC + m);
    G->g->moe_gather(G->gctx, d_xp + 2 * m, d_x + 2 * m, d_src, n, K, C);
    float* xp_g = host_bf16(G, d_xp + 2 * m, RC);
    snprintf(w2, sizeof w2, "%s gather", what);
    check_bf16_exact(t, w2, xp_g, xp_c, RC);

    // gather backward: Σ_k in order, one rounding: equal to the CPU's rounded
    float* dxp = rand_bf16(G, RC, 1.0f);
    float* dx_c = malloc_check(nC * sizeof(float));
    G->c->moe_gather_backward(G->cctx, dx_c, dxp, dst, n, K, C);
    char* d_dxp = dev_nan_bf16(G, RC + m);
    G->g->upload_f32(G->gctx, d_dxp + 2 * m, dxp, RC);
    char* d_dx = dev_nan_bf16(G, nC + m);
    G->g->moe_gather_backward(G->gctx, d_dx + 2 * m, d_dxp + 2 * m, d_dst, n, K, C);
    float* dx_g = host_bf16(G, d_dx + 2 * m, nC);
    snprintf(w2, sizeof w2, "%s gather backward", what);
    check_bf16_exact(t, w2, dx_g, dx_c, nC);

    // combine forward (y = dxp as the experts' output rows): exact as well
    float* out_c = malloc_check(nC * sizeof(float));
    G->c->moe_combine_forward(G->cctx, out_c, dxp, w, dst, n, K, C);
    char* d_out = dev_nan_bf16(G, nC + m);
    G->g->moe_combine_forward(G->gctx, d_out + 2 * m, d_dxp + 2 * m, d_w, d_dst, n, K, C);
    float* out_g = host_bf16(G, d_out + 2 * m, nC);
    snprintf(w2, sizeof w2, "%s combine forward", what);
    check_bf16_exact(t, w2, out_g, out_c, nC);

    // combine backward: dy = w · dout exact, dweights fp32 dot products
    float* dout = rand_bf16(G, nC, 1.0f);
    float* dy_c = malloc_check(RC * sizeof(float));
    float* dwt_c = malloc_check(nK * sizeof(float));
    G->c->moe_combine_backward(G->cctx, dy_c, dwt_c, dout, dxp, w, dst, n, K, C);
    char* d_dout = dev_nan_bf16(G, nC + m);
    G->g->upload_f32(G->gctx, d_dout + 2 * m, dout, nC);
    char* d_dy = dev_nan_bf16(G, RC + m);
    void* d_dwt = dev_poison(G, nK * sizeof(float));
    G->g->moe_combine_backward(G->gctx, d_dy + 2 * m, d_dwt, d_dout + 2 * m, d_dxp + 2 * m, d_w,
                               d_dst, n, K, C);
    float* dy_g = host_bf16(G, d_dy + 2 * m, RC);
    float* dwt_g = host_raw(G, d_dwt, nK * sizeof(float));
    snprintf(w2, sizeof w2, "%s combine backward dy", what);
    check_bf16_exact(t, w2, dy_g, dy_c, RC);
    snprintf(w2, sizeof w2, "%s combine backward dweights", what);
    check_rel(t, w2, dwt_g, dwt_c, nK, 1e-5);
    G->g->moe_combine_backward(G->gctx, d_dy + 2 * m, d_dwt, d_dout + 2 * m, d_dxp + 2 * m, d_w,
                               d_dst, n, K, C);
    float* dwt_g2 = host_raw(G, d_dwt, nK * sizeof(float));
    CHECK(t, memcmp(dwt_g, dwt_g2, nK * sizeof(float)) == 0, "%s: two runs differ", w2);

    free(z);
    free(idx);
    free(w);
    free(off);
    free(src);
    free(dst);
    free(x);
    free(xp_c);
    free(xp_g);
    free(dxp);
    free(dx_c);
    free(dx_g);
    free(out_c);
    free(out_g);
    free(dout);
    free(dy_c);
    free(dwt_c);
    free(dy_g);
    free(dwt_g);
    free(dwt_g2);
    void* bufs[] = {d_src, d_dst, d_w, d_x, d_xp, d_dxp, d_dx, d_out, d_dout, d_dy, d_dwt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gfree(G, bufs[i]);
}

static void test_gpu_moe_ops_rows(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 153)) return;
    rows_case(t, &G, 200, 128, 8, 2048, 0);  // Qwen3-30B-A3B widths, 16-byte path
    rows_case(t, &G, 150, 32, 4, 2880, 0);   // GPT-OSS-20B
    rows_case(t, &G, 77, 16, 3, 100, 0);     // C % 8 != 0: scalar path, partial last step
    rows_case(t, &G, 60, 16, 2, 64, 1);      // misaligned pointers: scalar path
    rows_case(t, &G, 50, 64, 16, 40, 0);     // K = 16, C < 32 * 8
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// GPT-OSS GLU

static void glu_case(TestCtx* t, Gpu* G, int R, int F, int misalign) {
    char what[160];
    snprintf(what, sizeof what, "gptoss glu R=%d F=%d misalign=%d", R, F, misalign);
    const float limit = 7.0f, alpha = 1.702f;
    const size_t RF = (size_t)R * F, m = misalign ? 1 : 0;
    float* gu = rand_bf16(G, 2 * RF, 4.0f);  // some beyond the limit: clamps active
    for (size_t i = 0; i < 2 * RF; i += 13) gu[i] = i % 2 ? -limit : limit;  // the bounds
    for (size_t i = 1; i < 2 * RF; i += 26) gu[i] = limit;
    float* out_c = malloc_check(RF * sizeof(float));
    G->c->gptoss_glu_forward(G->cctx, out_c, gu, R, F, limit, alpha);
    char* d_gu = dev_nan_bf16(G, 2 * RF + m);
    G->g->upload_f32(G->gctx, d_gu + 2 * m, gu, 2 * RF);
    char* d_out = dev_nan_bf16(G, RF + m);
    G->g->gptoss_glu_forward(G->gctx, d_out + 2 * m, d_gu + 2 * m, R, F, limit, alpha);
    float* out_g = host_bf16(G, d_out + 2 * m, RF);
    char w2[200];
    snprintf(w2, sizeof w2, "%s forward", what);
    check_rel(t, w2, out_g, out_c, RF, 1e-2);

    float* dout = rand_bf16(G, RF, 1.0f);
    float* dgu_c = malloc_check(2 * RF * sizeof(float));
    G->c->gptoss_glu_backward(G->cctx, dgu_c, dout, gu, R, F, limit, alpha);
    char* d_dout = dev_nan_bf16(G, RF + m);
    G->g->upload_f32(G->gctx, d_dout + 2 * m, dout, RF);
    char* d_dgu = dev_nan_bf16(G, 2 * RF + m);
    G->g->gptoss_glu_backward(G->gctx, d_dgu + 2 * m, d_dout + 2 * m, d_gu + 2 * m, R, F, limit,
                              alpha);
    float* dgu_g = host_bf16(G, d_dgu + 2 * m, 2 * RF);
    snprintf(w2, sizeof w2, "%s backward", what);
    check_rel(t, w2, dgu_g, dgu_c, 2 * RF, 1e-2);
    size_t zero_bad = 0;  // a clamp's zero gradient is exactly zero on both
    for (size_t i = 0; i < 2 * RF; i++) zero_bad += (dgu_c[i] == 0.0f) != (dgu_g[i] == 0.0f);
    CHECK(t, zero_bad == 0, "%s: %zu gradients zero on one backend only", w2, zero_bad);

    free(gu);
    free(out_c);
    free(out_g);
    free(dout);
    free(dgu_c);
    free(dgu_g);
    void* bufs[] = {d_gu, d_out, d_dout, d_dgu};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gfree(G, bufs[i]);
}

static void test_gpu_moe_ops_glu(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 154)) return;
    glu_case(t, &G, 300, 2880, 0);  // GPT-OSS-20B's F, 16-byte path
    glu_case(t, &G, 77, 45, 0);     // F % 8 != 0: scalar path
    glu_case(t, &G, 40, 64, 1);     // misaligned: scalar path
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// the router's matmul: E = 32 or 128 outputs, GPT-OSS with a bias

static void router_matmul_case(TestCtx* t, Gpu* G, int N, int IC, int OC, int with_bias) {
    char what[160];
    snprintf(what, sizeof what, "router matmul N=%d IC=%d OC=%d bias=%d", N, IC, OC, with_bias);
    gpu_check_matmul(t, G, what, N, IC, OC, with_bias, 0.05f, 0);
}

static void test_gpu_moe_ops_router_matmul(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 155)) return;
    router_matmul_case(t, &G, 300, 2880, 32, 1);   // GPT-OSS-20B
    router_matmul_case(t, &G, 300, 2880, 128, 1);  // GPT-OSS-120B
    router_matmul_case(t, &G, 257, 2048, 128, 0);  // Qwen3-30B-A3B
    gpu_close(&G);
}

#else  // no CUDA in this build

static void gpu_moe_skipped(TestCtx* t) { test_skip(t, "built without CUDA"); }
static void test_gpu_moe_ops_route(TestCtx* t) { gpu_moe_skipped(t); }
static void test_gpu_moe_ops_dispatch(TestCtx* t) { gpu_moe_skipped(t); }
static void test_gpu_moe_ops_rows(TestCtx* t) { gpu_moe_skipped(t); }
static void test_gpu_moe_ops_glu(TestCtx* t) { gpu_moe_skipped(t); }
static void test_gpu_moe_ops_router_matmul(TestCtx* t) { gpu_moe_skipped(t); }

#endif  // HAVE_CUDA

const TestCase tests_gpu_moe[] = {
    {"gpu_moe_ops_route", test_gpu_moe_ops_route},
    {"gpu_moe_ops_dispatch", test_gpu_moe_ops_dispatch},
    {"gpu_moe_ops_rows", test_gpu_moe_ops_rows},
    {"gpu_moe_ops_glu", test_gpu_moe_ops_glu},
    {"gpu_moe_ops_router_matmul", test_gpu_moe_ops_router_matmul},
    {NULL, NULL},
};
