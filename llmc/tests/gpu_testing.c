/*
 * gpu_testing.c — the GPU test suites' shared fixture (gpu_testing.h): the CUDA and CPU op
 * contexts of a test, bf16 host inputs, device buffer upload/download, and the comparisons.
 * (No suite here: the runner lists suites explicitly.) Compiled to nothing without HAVE_CUDA.
 */
#include <math.h>
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

#endif  // HAVE_CUDA
