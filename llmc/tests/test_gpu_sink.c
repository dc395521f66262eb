/*
 * test_gpu_sink.c — the CUDA attention with learned sinks and sliding windows (GPT-OSS: ops.h's
 * attention_sink_forward / attention_sink_backward) against the fp32 CPU reference (ops_cpu).
 *
 * Random bf16-valued inputs (rounded on the host, so both backends see the same numbers) through
 * every path of the CUDA op: the Hopper wgmma kernels (HD 64 and 128 on an sm_90a build), the
 * mma.sync kernels (HD 16, 32) and the simple fallback (HD 12); T not a multiple of any tile,
 * windows of 1, shorter than a tile, longer than T, none; sinks and no sinks; B > 1; GQA.
 * Outputs start as NaN where ops.h says "overwritten" (out, dqkv), and dsinks starts at random
 * values since the op accumulates into it: the increment is compared, and without sinks dsinks
 * must not move. Then: the sink op without sinks and window is bit for bit the causal op (the
 * compile-time option leaves that path alone), and the backward repeats bit for bit.
 * Without a GPU (or CUDA in the build) every test reports "skipped".
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "testing.h"

#ifdef HAVE_CUDA

#include "../../kernels/attention.h"
#include "../ops.h"
#include "../rng.h"
#include "gpu_testing.h"

// ----------------------------------------------------------------------------
// one case: forward, backward and dsinks against the CPU

typedef struct SinkCase {
    int B, T, H, KVH, HD, window, sinks;  // sinks: 0 = NULL
} SinkCase;

static void sink_case(TestCtx* t, Gpu* G, SinkCase k) {
    char what[160], w2[200];
    snprintf(what, sizeof what, "sink attention B=%d T=%d H=%d KVH=%d HD=%d window=%d%s", k.B,
             k.T, k.H, k.KVH, k.HD, k.window, k.sinks ? " sinks" : "");
    const int B = k.B, T = k.T, H = k.H, KVH = k.KVH, HD = k.HD;
    const size_t N = (size_t)B * T, QKV = (size_t)(H + 2 * KVH) * HD, OD = (size_t)H * HD;
    const size_t n_lse = (size_t)B * H * T;
    float* qkv = rand_bf16(G, N * QKV, 1.0f);
    // sinks of a few units: comparable to the logits, so they take a real share of each row
    float* sinks = k.sinks ? rand_bf16(G, (size_t)H, 2.0f) : NULL;

    // forward
    float* out_c = malloc_check(N * OD * sizeof(float));
    float* lse_c = malloc_check(n_lse * sizeof(float));
    G->c->attention_sink_forward(G->cctx, out_c, lse_c, qkv, sinks, B, T, H, KVH, HD, k.window);
    void* d_qkv = dev_bf16(G, qkv, N * QKV);
    void* d_sinks = sinks ? dev_bf16(G, sinks, (size_t)H) : NULL;
    float* nan_buf = filled_floats(N * QKV, NAN);
    void* d_out = dev_bf16(G, nan_buf, N * OD);
    void* d_lse = G->g->alloc(G->gctx, n_lse * sizeof(float));
    G->g->attention_sink_forward(G->gctx, d_out, d_lse, d_qkv, d_sinks, B, T, H, KVH, HD,
                                 k.window);
    float* out_g = host_bf16(G, d_out, N * OD);
    float* lse_g = host_f32(G, d_lse, n_lse);
    snprintf(w2, sizeof w2, "%s out", what);
    const double e_out = check_rel(t, w2, out_g, out_c, N * OD, 1e-2);
    snprintf(w2, sizeof w2, "%s lse", what);
    check_rel(t, w2, lse_g, lse_c, n_lse, 1e-4);

    // backward, both backends on the same (bf16-rounded) out and the CPU's lse
    for (size_t i = 0; i < N * OD; i++) out_c[i] = bf16_value(out_c[i]);
    float* dout = rand_bf16(G, N * OD, 1.0f);
    float* dqkv_c = malloc_check(N * QKV * sizeof(float));
    float* dsinks0 = rand_floats(&G->rng, (size_t)H, 1.0f);  // accumulated into
    float* dsinks_c = malloc_check((size_t)H * sizeof(float));
    memcpy(dsinks_c, dsinks0, (size_t)H * sizeof(float));
    G->c->attention_sink_backward(G->cctx, dqkv_c, dsinks_c, dout, qkv, out_c, lse_c, sinks, B,
                                  T, H, KVH, HD, k.window);
    void* d_dout = dev_bf16(G, dout, N * OD);
    void* d_oc = dev_bf16(G, out_c, N * OD);
    void* d_lc = dev_raw(G, lse_c, n_lse * sizeof(float));
    void* d_dqkv = dev_bf16(G, nan_buf, N * QKV);
    void* d_dsinks = dev_raw(G, dsinks0, (size_t)H * sizeof(float));
    G->g->attention_sink_backward(G->gctx, d_dqkv, (float*)d_dsinks, d_dout, d_qkv, d_oc, d_lc,
                                  d_sinks, B, T, H, KVH, HD, k.window);
    float* dqkv_g = host_bf16(G, d_dqkv, N * QKV);
    float* dsinks_g = host_f32(G, d_dsinks, (size_t)H);
    // q, k and v parts apart (dq/dk go through the softmax gradient, dv does not)
    const size_t part_lo[3] = {0, OD, OD + (size_t)KVH * HD};
    const size_t part_w[3] = {OD, (size_t)KVH * HD, (size_t)KVH * HD};
    const char* part_name[3] = {"dq", "dk", "dv"};
    double e_part[3];
    for (int p = 0; p < 3; p++) {
        const size_t m = N * part_w[p];
        float* pg = malloc_check(m * sizeof(float));
        float* pc = malloc_check(m * sizeof(float));
        for (size_t r = 0; r < N; r++) {
            memcpy(pg + r * part_w[p], dqkv_g + r * QKV + part_lo[p], part_w[p] * sizeof(float));
            memcpy(pc + r * part_w[p], dqkv_c + r * QKV + part_lo[p], part_w[p] * sizeof(float));
        }
        snprintf(w2, sizeof w2, "%s %s", what, part_name[p]);
        e_part[p] = check_rel(t, w2, pg, pc, m, 3e-2);
        free(pg);
        free(pc);
    }
    // dsinks: the increment (the op adds to what was there); none without sinks
    double e_ds = 0.0;
    if (sinks) {
        float* inc_g = malloc_check((size_t)H * sizeof(float));
        float* inc_c = malloc_check((size_t)H * sizeof(float));
        for (int h = 0; h < H; h++) {
            inc_g[h] = dsinks_g[h] - dsinks0[h];
            inc_c[h] = dsinks_c[h] - dsinks0[h];
        }
        snprintf(w2, sizeof w2, "%s dsinks", what);
        e_ds = check_rel(t, w2, inc_g, inc_c, (size_t)H, 1e-2);
        free(inc_g);
        free(inc_c);
    } else {
        CHECK(t, memcmp(dsinks_g, dsinks0, (size_t)H * sizeof(float)) == 0,
              "%s: dsinks changed without sinks", what);
    }
    printf("  %s: out %.2g, dq %.2g, dk %.2g, dv %.2g, dsinks %.2g\n", what, e_out, e_part[0],
           e_part[1], e_part[2], e_ds);

    free(qkv);
    free(sinks);
    free(out_c);
    free(lse_c);
    free(nan_buf);
    free(out_g);
    free(lse_g);
    free(dout);
    free(dqkv_c);
    free(dsinks0);
    free(dsinks_c);
    free(dqkv_g);
    free(dsinks_g);
    void* bufs[] = {d_qkv, d_sinks, d_out, d_lse, d_dout, d_oc, d_lc, d_dqkv, d_dsinks};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) G->g->free(G->gctx, bufs[i]);
}

// The Hopper wgmma kernels (HD 64, 128 on an sm_90a build; mma.sync elsewhere).
static void test_gpu_sink_wgmma(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 15)) return;
    // GPT-OSS: H 64, KVH 8, HD 64, window 128 (T not a multiple of the 128-row tiles)
    sink_case(t, &G, (SinkCase){1, 520, 64, 8, 64, 128, 1});
    sink_case(t, &G, (SinkCase){2, 300, 8, 2, 64, 0, 1});     // full causal with sinks, B > 1
    sink_case(t, &G, (SinkCase){1, 200, 4, 2, 64, 1000, 1});  // window longer than T
    sink_case(t, &G, (SinkCase){2, 77, 4, 1, 64, 1, 1});      // window 1: the sink and the key
    sink_case(t, &G, (SinkCase){2, 333, 4, 2, 64, 100, 0});   // a window without sinks
    sink_case(t, &G, (SinkCase){1, 700, 4, 2, 64, 192, 1});   // rings wrap, window of 1.5 tiles
    sink_case(t, &G, (SinkCase){1, 600, 4, 2, 128, 200, 1});  // two swizzle panels
    sink_case(t, &G, (SinkCase){3, 5, 2, 2, 128, 3, 1});      // one partial tile
    printf("  sink attention: wgmma kernels %s at HD 64\n",
           attention_uses_wgmma(64) ? "used" : "NOT used");
    gpu_close(&G);
}

// The mma.sync kernels (HD 16, 32) and the simple fallback (HD 12).
static void test_gpu_sink_mma_fallback(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 16)) return;
    sink_case(t, &G, (SinkCase){2, 333, 4, 2, 32, 50, 1});
    sink_case(t, &G, (SinkCase){1, 300, 4, 2, 32, 0, 1});
    sink_case(t, &G, (SinkCase){2, 129, 4, 1, 32, 7, 0});
    sink_case(t, &G, (SinkCase){1, 90, 2, 2, 32, 1, 1});
    sink_case(t, &G, (SinkCase){3, 129, 4, 2, 16, 33, 1});
    sink_case(t, &G, (SinkCase){2, 40, 4, 2, 12, 9, 1});    // simple path
    sink_case(t, &G, (SinkCase){1, 50, 4, 1, 12, 0, 1});    // simple path, causal with sinks
    sink_case(t, &G, (SinkCase){1, 45, 2, 1, 12, 6, 0});    // simple path, window only
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// bit for bit: the option off is the causal op, and the backward repeats

static void sink_bits_case(TestCtx* t, Gpu* G, int B, int T, int H, int KVH, int HD) {
    const size_t N = (size_t)B * T, QKV = (size_t)(H + 2 * KVH) * HD, OD = (size_t)H * HD;
    const size_t n_lse = (size_t)B * H * T;
    float* qkv = rand_bf16(G, N * QKV, 1.0f);
    float* dout = rand_bf16(G, N * OD, 1.0f);
    float* sinks = rand_bf16(G, (size_t)H, 2.0f);
    void* d_qkv = dev_bf16(G, qkv, N * QKV);
    void* d_dout = dev_bf16(G, dout, N * OD);
    void* d_sinks = dev_bf16(G, sinks, (size_t)H);
    void* o1 = G->g->alloc(G->gctx, N * OD * 2);
    void* o2 = G->g->alloc(G->gctx, N * OD * 2);
    void* l1 = G->g->alloc(G->gctx, n_lse * sizeof(float));
    void* l2 = G->g->alloc(G->gctx, n_lse * sizeof(float));
    void* g1 = G->g->alloc(G->gctx, N * QKV * 2);
    void* g2 = G->g->alloc(G->gctx, N * QKV * 2);
    void* s1 = G->g->alloc(G->gctx, (size_t)H * sizeof(float));
    void* s2 = G->g->alloc(G->gctx, (size_t)H * sizeof(float));

    // no sinks, no window: the causal op's bits
    G->g->attention_forward(G->gctx, o1, l1, d_qkv, B, T, H, KVH, HD);
    G->g->attention_sink_forward(G->gctx, o2, l2, d_qkv, NULL, B, T, H, KVH, HD, 0);
    CHECK(t, same_device_bytes(G, o1, o2, N * OD * 2) && same_device_bytes(G, l1, l2, n_lse * 4),
          "HD %d: sink forward without sinks and window differs from the causal forward", HD);
    G->g->attention_backward(G->gctx, g1, d_dout, d_qkv, o1, l1, B, T, H, KVH, HD);
    G->g->attention_sink_backward(G->gctx, g2, NULL, d_dout, d_qkv, o1, l1, NULL, B, T, H, KVH,
                                  HD, 0);
    CHECK(t, same_device_bytes(G, g1, g2, N * QKV * 2),
          "HD %d: sink backward without sinks and window differs from the causal backward", HD);

    // sinks and a window: the same bits twice (dsinks from zero both times)
    G->g->attention_sink_forward(G->gctx, o1, l1, d_qkv, d_sinks, B, T, H, KVH, HD, 96);
    G->g->attention_sink_forward(G->gctx, o2, l2, d_qkv, d_sinks, B, T, H, KVH, HD, 96);
    CHECK(t, same_device_bytes(G, o1, o2, N * OD * 2) && same_device_bytes(G, l1, l2, n_lse * 4),
          "HD %d: sink forward not deterministic", HD);
    for (int r = 0; r < 2; r++)
        G->g->attention_sink_backward(G->gctx, r ? g2 : g1, (float*)(r ? s2 : s1), d_dout, d_qkv,
                                      o1, l1, d_sinks, B, T, H, KVH, HD, 96);
    CHECK(t, same_device_bytes(G, g1, g2, N * QKV * 2) &&
                 same_device_bytes(G, s1, s2, (size_t)H * 4),
          "HD %d: sink backward not deterministic", HD);

    free(qkv);
    free(dout);
    free(sinks);
    void* bufs[] = {d_qkv, d_dout, d_sinks, o1, o2, l1, l2, g1, g2, s1, s2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) G->g->free(G->gctx, bufs[i]);
}

static void test_gpu_sink_bits(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 17)) return;
    sink_bits_case(t, &G, 2, 1000, 8, 2, 64);   // wgmma on sm_90a
    sink_bits_case(t, &G, 1, 700, 4, 2, 128);   // wgmma on sm_90a
    sink_bits_case(t, &G, 2, 333, 4, 2, 32);    // mma.sync
    sink_bits_case(t, &G, 1, 60, 2, 1, 12);     // simple path
    gpu_close(&G);
}

#else  // no CUDA in this build

static void sink_gpu_skipped(TestCtx* t) { test_skip(t, "built without CUDA"); }
static void test_gpu_sink_wgmma(TestCtx* t) { sink_gpu_skipped(t); }
static void test_gpu_sink_mma_fallback(TestCtx* t) { sink_gpu_skipped(t); }
static void test_gpu_sink_bits(TestCtx* t) { sink_gpu_skipped(t); }

#endif  // HAVE_CUDA

const TestCase tests_gpu_sink[] = {
    {"gpu_sink_wgmma", test_gpu_sink_wgmma},
    {"gpu_sink_mma_fallback", test_gpu_sink_mma_fallback},
    {"gpu_sink_bits", test_gpu_sink_bits},
    {NULL, NULL},
};
