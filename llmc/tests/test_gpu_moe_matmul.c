/*
 * test_gpu_moe_matmul.c — the CUDA grouped expert GEMM (ops_cuda's moe_matmul_forward and
 * moe_matmul_backward, kernels/moe_matmul.cu) against the fp32 CPU reference (ops_cpu).
 *
 * Random bf16 inputs, random expert row counts with empty experts (the first, the last, several
 * in a row), rows both below and above one 128-row tile, sizes that are multiples of 8 but not of
 * the tile (the tensor-core kernels' edge tiles) and sizes that are not multiples of 8 or a
 * weight one element off 16-byte alignment (the fallback kernel). Both weight layouts (w_in_out
 * 0: (E, OC, IC), 1: (E, IC, OC)), with and without bias, with and without dinp. Outputs marked
 * "overwritten" in ops.h are pre-filled with NaN, the accumulated gradients with random values;
 * the dW slices of experts without rows must come back bit-identical, and a second run must
 * give the same bits (no atomics).
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
// one case

typedef struct MmCase {
    int E, IC, OC, w_in_out;
    const int* counts;  // (E) rows per expert
    int bias;           // forward bias and dbias
    int with_dinp;
    int w_pad;          // weight offset in elements from a 16-byte boundary (0: aligned)
} MmCase;

static void mm_run_case(TestCtx* t, Gpu* G, const MmCase* c) {
    const int E = c->E, IC = c->IC, OC = c->OC;
    int32_t* offsets = malloc_check((size_t)(E + 1) * sizeof(int32_t));
    offsets[0] = 0;
    for (int e = 0; e < E; e++) offsets[e + 1] = offsets[e] + c->counts[e];
    const int R = offsets[E];
    const size_t nx = (size_t)R * IC, ny = (size_t)R * OC, nw = (size_t)E * IC * OC;
    char what[160];
    snprintf(what, sizeof what, "moe_matmul E=%d R=%d IC=%d OC=%d w_in_out=%d%s%s%s", E, R, IC,
             OC, c->w_in_out, c->bias ? " bias" : "", c->with_dinp ? "" : " (no dinp)",
             c->w_pad ? " (misaligned w)" : "");

    float* x = rand_bf16(G, nx, 1.0f);
    float* w = rand_bf16(G, nw, 0.1f);
    float* b = c->bias ? rand_bf16(G, (size_t)E * OC, 1.0f) : NULL;
    float* dy = rand_bf16(G, ny, 1.0f);
    float* dw0 = rand_floats(&G->rng, nw, 0.5f);
    float* db0 = rand_floats(&G->rng, (size_t)E * OC, 0.5f);

    // CPU reference
    float* y_c = malloc_check((ny > 0 ? ny : 1) * sizeof(float));
    float* dx_c = malloc_check((nx > 0 ? nx : 1) * sizeof(float));
    float* dw_c = malloc_check(nw * sizeof(float));
    float* db_c = malloc_check((size_t)E * OC * sizeof(float));
    memcpy(dw_c, dw0, nw * sizeof(float));
    memcpy(db_c, db0, (size_t)E * OC * sizeof(float));
    G->c->moe_matmul_forward(G->cctx, y_c, x, w, b, offsets, R, E, IC, OC, c->w_in_out);
    G->c->moe_matmul_backward(G->cctx, c->with_dinp ? dx_c : NULL, dw_c, b ? db_c : NULL, dy, x, w,
                              offsets, R, E, IC, OC, c->w_in_out);

    // GPU, twice (the second run into fresh outputs must give the same bits)
    void *x_base, *w_base, *b_base = NULL, *dy_base;
    void* d_x = dev_bf16_pad(G, x, nx, 0, &x_base);
    void* d_w = dev_bf16_pad(G, w, nw, c->w_pad, &w_base);
    void* d_b = b ? dev_bf16_pad(G, b, (size_t)E * OC, 0, &b_base) : NULL;
    void* d_dy = dev_bf16_pad(G, dy, ny, 0, &dy_base);
    void* d_off = dev_raw(G, offsets, (size_t)(E + 1) * sizeof(int32_t));
    float *y_g[2], *dx_g[2], *dw_g[2], *db_g[2];
    float* nan_fill = malloc_check(((nx > ny ? nx : ny) + 1) * sizeof(float));
    for (size_t i = 0; i < (nx > ny ? nx : ny) + 1; i++) nan_fill[i] = NAN;
    for (int run = 0; run < 2; run++) {
        void* d_y = G->g->alloc(G->gctx, (ny + 1) * 2);
        void* d_dx = G->g->alloc(G->gctx, (nx + 1) * 2);
        G->g->upload_f32(G->gctx, d_y, nan_fill, ny);
        G->g->upload_f32(G->gctx, d_dx, nan_fill, nx);
        void* d_dw = dev_raw(G, dw0, nw * sizeof(float));
        void* d_db = dev_raw(G, db0, (size_t)E * OC * sizeof(float));
        G->g->moe_matmul_forward(G->gctx, d_y, d_x, d_w, d_b, d_off, R, E, IC, OC, c->w_in_out);
        G->g->moe_matmul_backward(G->gctx, c->with_dinp ? d_dx : NULL, d_dw, b ? d_db : NULL,
                                  d_dy, d_x, d_w, d_off, R, E, IC, OC, c->w_in_out);
        y_g[run] = host_bf16(G, d_y, ny);
        dx_g[run] = host_bf16(G, d_dx, nx);
        dw_g[run] = host_f32(G, d_dw, nw);
        db_g[run] = host_f32(G, d_db, (size_t)E * OC);
        G->g->free(G->gctx, d_y);
        G->g->free(G->gctx, d_dx);
        G->g->free(G->gctx, d_dw);
        G->g->free(G->gctx, d_db);
    }

    char w2[224];
    snprintf(w2, sizeof w2, "%s: out", what);
    check_rel(t, w2, y_g[0], y_c, ny, 1e-2);
    if (c->with_dinp) {
        snprintf(w2, sizeof w2, "%s: dinp", what);
        check_rel(t, w2, dx_g[0], dx_c, nx, 1e-2);
    }
    snprintf(w2, sizeof w2, "%s: dW", what);
    check_rel(t, w2, dw_g[0], dw_c, nw, 1e-4);
    snprintf(w2, sizeof w2, "%s: dbias", what);
    check_rel(t, w2, db_g[0], db_c, (size_t)E * OC, b ? 1e-5 : 0.0);
    // experts without rows: dW and dbias untouched, bit for bit
    int untouched = 1;
    for (int e = 0; e < E; e++) {
        if (c->counts[e] > 0) continue;
        const size_t o = (size_t)e * IC * OC;
        untouched &= memcmp(dw_g[0] + o, dw0 + o, (size_t)IC * OC * sizeof(float)) == 0;
        untouched &= memcmp(db_g[0] + (size_t)e * OC, db0 + (size_t)e * OC,
                            (size_t)OC * sizeof(float)) == 0;
    }
    CHECK(t, untouched, "%s: the gradients of experts without rows changed", what);
    int same = memcmp(y_g[0], y_g[1], ny * sizeof(float)) == 0 &&
               memcmp(dw_g[0], dw_g[1], nw * sizeof(float)) == 0 &&
               memcmp(db_g[0], db_g[1], (size_t)E * OC * sizeof(float)) == 0;
    if (c->with_dinp) same &= memcmp(dx_g[0], dx_g[1], nx * sizeof(float)) == 0;
    CHECK(t, same, "%s: two runs differ", what);

    for (int run = 0; run < 2; run++) {
        free(y_g[run]);
        free(dx_g[run]);
        free(dw_g[run]);
        free(db_g[run]);
    }
    G->g->free(G->gctx, x_base);
    G->g->free(G->gctx, w_base);
    if (b_base) G->g->free(G->gctx, b_base);
    G->g->free(G->gctx, dy_base);
    G->g->free(G->gctx, d_off);
    free(nan_fill);
    free(offsets);
    free(x);
    free(w);
    free(b);
    free(dy);
    free(dw0);
    free(db0);
    free(y_c);
    free(dx_c);
    free(dw_c);
    free(db_c);
}

// ----------------------------------------------------------------------------
// tests

// Tensor-core path: sizes multiples of 8 (not of the 128-wide tiles), empty experts, experts of
// 1, 7, 127, 128, 129 and several hundred rows (one row more or less than a tile, many k-tiles of
// dW).
static void test_gpu_moe_matmul_tiles(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 15)) return;
    const int c6[] = {0, 150, 7, 0, 260, 1};
    const int c5[] = {129, 0, 0, 128, 33};
    const int c4[] = {300, 0, 517, 127};
    const int c3[] = {0, 0, 41};
    MmCase cases[] = {
        {6, 136, 200, 0, c6, 0, 1, 0},  // nn.Linear layout, no bias (Qwen3-MoE)
        {6, 136, 200, 1, c6, 1, 1, 0},  // GPT-OSS layout with bias
        {5, 72, 264, 1, c5, 1, 0, 0},   // no dinp
        {5, 264, 72, 0, c5, 1, 1, 0},
        {4, 512, 384, 0, c4, 0, 1, 0},  // many k-tiles, several m-tiles per expert
        {4, 384, 512, 1, c4, 1, 1, 0},
        {3, 64, 8, 0, c3, 1, 1, 0},     // one n-tile of 8 columns
        {3, 8, 64, 1, c3, 0, 1, 0},     // K = 8: one partial k-tile
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) mm_run_case(t, &G, &cases[i]);
    gpu_close(&G);
}

// The fallback kernel: sizes that are not multiples of 8, or a misaligned weight.
static void test_gpu_moe_matmul_fallback(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 16)) return;
    const int c4[] = {37, 0, 70, 5};
    const int c3[] = {0, 33, 0};
    MmCase cases[] = {
        {4, 36, 20, 0, c4, 1, 1, 0},
        {4, 36, 20, 1, c4, 1, 1, 0},
        {3, 13, 6, 1, c3, 0, 0, 0},
        {4, 64, 40, 0, c4, 1, 1, 1},  // w one element past alignment
        {4, 64, 40, 1, c4, 0, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) mm_run_case(t, &G, &cases[i]);
    gpu_close(&G);
}

#else  // no CUDA in this build

static void test_gpu_moe_matmul_tiles(TestCtx* t) { test_skip(t, "built without CUDA"); }
static void test_gpu_moe_matmul_fallback(TestCtx* t) { test_skip(t, "built without CUDA"); }

#endif  // HAVE_CUDA

const TestCase tests_gpu_moe_matmul[] = {
    {"gpu_moe_matmul_tiles", test_gpu_moe_matmul_tiles},
    {"gpu_moe_matmul_fallback", test_gpu_moe_matmul_fallback},
    {NULL, NULL},
};
