/*
 * gpu_testing.c — the GPU test suites' shared fixture (gpu_testing.h): the CUDA and CPU op
 * contexts of a test, bf16 host inputs, device buffer upload/download, the comparisons, and the
 * op cases more than one suite runs (matmul).
 * (No suite here: the runner lists suites explicitly.) Compiled to nothing without HAVE_CUDA.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "testing.h"

#ifdef HAVE_CUDA

#include "../../kernels/kernels.h"
#include "gpu_testing.h"

// ----------------------------------------------------------------------------
// fixture

int gpu_open(TestCtx* t, Gpu* G, uint32_t seed) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return 0;
    }
    G->g = &ops_cuda;
    G->gctx = ops_cuda_create(0, NULL);
    G->c = &ops_cpu;
    G->cctx = ops_cpu_create(t->n_threads);
    rng_seed(&G->rng, seed);
    return 1;
}

void gpu_close(Gpu* G) {
    ops_cuda_destroy(G->gctx);
    ops_cpu_destroy(G->cctx);
}

// ----------------------------------------------------------------------------
// host inputs

float bf16_value(float x) { return bf16_to_f32(f32_to_bf16(x)); }

float* rand_bf16(Gpu* G, size_t n, float scale) {
    // the same draws, in the same order, as rand_floats: only the rounding is added
    float* x = rand_floats(&G->rng, n, scale);
    for (size_t i = 0; i < n; i++) x[i] = bf16_value(x[i]);
    return x;
}

// ----------------------------------------------------------------------------
// device buffers

void* dev_bf16(Gpu* G, const float* host, size_t n) { return dev_bf16_pad(G, host, n, 0, NULL); }

void* dev_bf16_pad(Gpu* G, const float* host, size_t n, int pad, void** base) {
    if (pad < 0 || (pad > 0 && base == NULL))
        fatal("dev_bf16_pad: pad %d needs pad >= 0 and, when > 0, base to return the allocation",
              pad);
    const size_t total = n + (size_t)pad;
    char* b = G->g->alloc(G->gctx, (total > 0 ? total : 1) * 2);
    if (base) *base = b;
    void* d = b + 2 * (size_t)pad;
    G->g->upload_f32(G->gctx, d, host, n);
    return d;
}

void* dev_raw(Gpu* G, const void* host, size_t bytes) {
    void* d = G->g->alloc(G->gctx, bytes > 0 ? bytes : 4);
    G->g->upload(G->gctx, d, host, bytes);
    return d;
}

void* dev_nan_bf16(Gpu* G, size_t n) {
    float* h = filled_floats(n, NAN);
    void* d = dev_bf16(G, h, n);
    free(h);
    return d;
}

float* host_bf16(Gpu* G, const void* dev, size_t n) {
    float* h = malloc_check((n > 0 ? n : 1) * sizeof(float));
    G->g->download_f32(G->gctx, h, dev, n);
    return h;
}

float* host_f32(Gpu* G, const void* dev, size_t n) {
    float* h = malloc_check((n > 0 ? n : 1) * sizeof(float));
    G->g->download(G->gctx, h, dev, n * sizeof(float));
    return h;
}

void* host_raw(Gpu* G, const void* dev, size_t bytes) {
    void* h = malloc_check(bytes > 0 ? bytes : 1);
    G->g->download(G->gctx, h, dev, bytes);
    return h;
}

void gfree(Gpu* G, void* dev) { G->g->free(G->gctx, dev); }

// ----------------------------------------------------------------------------
// comparisons

double check_rel(TestCtx* t, const char* what, const float* got, const float* want, size_t n,
                 double tol) {
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (!isfinite(got[i])) bad = i;
    const double e = rel_l2_error(got, want, n);
    CHECK(t, bad == n && e <= tol, "%s: relative L2 error %.3g (tol %.3g)%s", what, e, tol,
          bad < n ? ", non-finite element" : "");
    return e;
}

int same_device_bytes(Gpu* G, const void* a, const void* b, size_t bytes) {
    unsigned char* ha = malloc_check(bytes > 0 ? bytes : 1);
    unsigned char* hb = malloc_check(bytes > 0 ? bytes : 1);
    G->g->download(G->gctx, ha, a, bytes);
    G->g->download(G->gctx, hb, b, bytes);
    const int same = memcmp(ha, hb, bytes) == 0;
    free(ha);
    free(hb);
    return same;
}

// ----------------------------------------------------------------------------
// shared op cases

void gpu_check_matmul(TestCtx* t, Gpu* G, const char* what, int N, int IC, int OC, int with_bias,
                      float w_scale, int w_offset) {
    float* x = rand_bf16(G, (size_t)N * IC, 1.0f);
    float* w = rand_bf16(G, (size_t)OC * IC, w_scale);
    float* bias = with_bias ? rand_bf16(G, (size_t)OC, 1.0f) : NULL;
    float* out_c = malloc_check((size_t)N * OC * sizeof(float));
    G->c->matmul_forward(G->cctx, out_c, x, w, bias, N, IC, OC);

    void* d_x = dev_bf16(G, x, (size_t)N * IC);
    void* d_wbuf = NULL;
    void* d_w = dev_bf16_pad(G, w, (size_t)OC * IC, w_offset, &d_wbuf);
    void* d_bias = bias ? dev_bf16(G, bias, (size_t)OC) : NULL;
    void* d_out = dev_nan_bf16(G, (size_t)N * OC);
    G->g->matmul_forward(G->gctx, d_out, d_x, d_w, d_bias, N, IC, OC);
    float* out_g = host_bf16(G, d_out, (size_t)N * OC);
    check_rel(t, what, out_g, out_c, (size_t)N * OC, 1e-2);

    // backward: dinp overwritten (NaN pre-fill), dw and dbias accumulate (random pre-fill)
    float* dout = rand_bf16(G, (size_t)N * OC, 1.0f);
    float* dinp_c = malloc_check((size_t)N * IC * sizeof(float));
    float* dw_c = rand_floats(&G->rng, (size_t)OC * IC, 1.0f);
    float* db_c = rand_floats(&G->rng, (size_t)OC, 1.0f);
    void* d_dout = dev_bf16(G, dout, (size_t)N * OC);
    void* d_dinp = dev_nan_bf16(G, (size_t)N * IC);
    void* d_dw = dev_raw(G, dw_c, (size_t)OC * IC * sizeof(float));
    void* d_db = dev_raw(G, db_c, (size_t)OC * sizeof(float));
    G->c->matmul_backward(G->cctx, dinp_c, dw_c, with_bias ? db_c : NULL, dout, x, w, N, IC, OC);
    G->g->matmul_backward(G->gctx, d_dinp, d_dw, with_bias ? d_db : NULL, d_dout, d_x, d_w, N,
                          IC, OC);
    float* dinp_g = host_bf16(G, d_dinp, (size_t)N * IC);
    float* dw_g = host_f32(G, d_dw, (size_t)OC * IC);
    float* db_g = host_f32(G, d_db, (size_t)OC);
    char w2[256];
    snprintf(w2, sizeof w2, "%s dinp", what);
    check_rel(t, w2, dinp_g, dinp_c, (size_t)N * IC, 1e-2);
    snprintf(w2, sizeof w2, "%s dw", what);
    check_rel(t, w2, dw_g, dw_c, (size_t)OC * IC, 1e-4);
    snprintf(w2, sizeof w2, "%s dbias", what);
    check_rel(t, w2, db_g, db_c, (size_t)OC, 1e-5);

    float* hbufs[] = {x, w, bias, out_c, out_g, dout, dinp_c, dw_c, db_c, dinp_g, dw_g, db_g};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
    gfree(G, d_x);
    gfree(G, d_wbuf);  // the allocation (d_w itself when w_offset is 0)
    if (d_bias) gfree(G, d_bias);
    void* dbufs[] = {d_out, d_dout, d_dinp, d_dw, d_db};
    for (size_t i = 0; i < sizeof dbufs / sizeof dbufs[0]; i++) gfree(G, dbufs[i]);
}

#endif  // HAVE_CUDA
