/*
 * test_gpu.c — the CUDA backend (kernels/, ops_cuda) against the fp32 CPU reference (ops_cpu).
 *
 * Every op runs on fresh random inputs that are bf16 values (rounded on the host first), so both
 * backends see the same numbers; the GPU result must match the CPU one within bf16 tolerances
 * (relative L2 ~1e-2 for bf16 outputs, tighter for fp32 ones). Outputs are pre-filled with NaN
 * where ops.h says "overwritten" and with random values where it says "accumulate", so the
 * accumulation semantics are checked too. Then: bit-identical results when an op is run twice,
 * the whole model (plain trainer, both test presets) on the GPU against the CPU, and the HF parity
 * fixtures through the GPU path.
 *
 * Then the RoundPipe engine on GPUs: against the plain trainer over several schedules and device
 * budgets (with its memory prediction), and a TRAIN_STEPS-step training run against the engine on
 * emulated CPU devices (loss curve and final weights, at head dim 128).
 *
 * Without a GPU (or in a build without CUDA) every test reports "skipped" (test_skip), so
 * `make test` stays green on CPU-only machines without counting these as passed, and
 * `make test-gpu` (./test_roundpipe --no-skip gpu) fails there.
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
#include "../../kernels/kernels.h"
#include "../checkpoint.h"
#include "../device.h"
#include "../engine.h"
#include "../model.h"
#include "../ops.h"
#include "../plain.h"
#include "../rng.h"
#include "../safetensors.h"
#include "../store.h"
#include "gpu_testing.h"

// ----------------------------------------------------------------------------
// device, memory ops

static void test_gpu_device_and_memory(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 1)) return;
    size_t fr = 0, tot = 0;
    CHECK(t, cuda_device_memory(0, &fr, &tot) == 0 && tot > 0 && fr <= tot, "memory query");
    const char* name = cuda_device_name(0);
    CHECK(t, name && name[0] != '\0', "device name");
    printf("  device 0: %s, %.1f GiB free of %.1f GiB\n", name, fr / 1073741824.0,
           tot / 1073741824.0);
    CHECK(t, strcmp(G.g->name, "cuda") == 0 && G.g->act_bytes == 2, "table identity");

    // alloc is zeroed
    const size_t n = 1003;
    void* d = G.g->alloc(G.gctx, n * 2);
    float* h = host_bf16(&G, d, n);
    int zero = 1;
    for (size_t i = 0; i < n; i++) zero &= h[i] == 0.0f;
    CHECK(t, zero, "alloc must return zeroed memory");
    free(h);

    // upload_f32 rounds to nearest even bf16; download_f32 is exact
    float* x = rand_floats(&G.rng, n, 3.0f);
    G.g->upload_f32(G.gctx, d, x, n);
    h = host_bf16(&G, d, n);
    int exact = 1;
    for (size_t i = 0; i < n; i++) exact &= h[i] == bf16_value(x[i]);
    CHECK(t, exact, "upload_f32/download_f32 must round to nearest even bf16");
    free(h);

    // copy and zero
    void* d2 = G.g->alloc(G.gctx, n * 2);
    G.g->copy(G.gctx, d2, d, n * 2);
    h = host_bf16(&G, d2, n);
    exact = 1;
    for (size_t i = 0; i < n; i++) exact &= h[i] == bf16_value(x[i]);
    CHECK(t, exact, "copy");
    free(h);
    G.g->zero(G.gctx, d2, 10 * 2);
    h = host_bf16(&G, d2, n);
    CHECK(t, h[0] == 0.0f && h[9] == 0.0f && h[10] == bf16_value(x[10]), "zero of a prefix");
    free(h);

    // raw bytes
    int32_t ids[257];
    for (int i = 0; i < 257; i++) ids[i] = (int32_t)rng_u32(&G.rng);
    void* di = dev_raw(&G, ids, sizeof ids);
    int32_t back[257];
    G.g->download(G.gctx, back, di, sizeof back);
    CHECK(t, memcmp(ids, back, sizeof ids) == 0, "raw upload/download");
    G.g->synchronize(G.gctx);

    // conversions larger than the staging chunk (32 MiB of fp32)
    const size_t big = ((size_t)9 << 20) + 5;
    float* xb = rand_floats(&G.rng, big, 1.0f);
    void* db = dev_bf16(&G, xb, big);
    float* hb = host_bf16(&G, db, big);
    exact = 1;
    for (size_t i = 0; i < big; i++) exact &= hb[i] == bf16_value(xb[i]);
    CHECK(t, exact, "chunked upload_f32/download_f32 of %zu elements", big);
    free(xb);
    free(hb);
    gfree(&G, db);

    free(x);
    gfree(&G, d);
    gfree(&G, d2);
    gfree(&G, di);
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// embedding

static void embedding_case(TestCtx* t, Gpu* G, int N, int C, int V, int id_range) {
    char what[96];
    int32_t* ids = malloc_check((size_t)N * sizeof(int32_t));
    for (int i = 0; i < N; i++) {  // many repeats; a few ids at the top of the vocabulary
        ids[i] = (int32_t)rng_below(&G->rng, (uint64_t)id_range);
        if (i % 17 == 3) ids[i] = V - 1 - (int32_t)rng_below(&G->rng, 3);
    }
    float* wte = rand_bf16(G, (size_t)V * C, 1.0f);
    float* out_c = malloc_check((size_t)N * C * sizeof(float));
    G->c->embedding_forward(G->cctx, out_c, ids, wte, N, C);
    void* d_ids = dev_raw(G, ids, (size_t)N * sizeof(int32_t));
    void* d_wte = dev_bf16(G, wte, (size_t)V * C);
    void* d_out = G->g->alloc(G->gctx, (size_t)N * C * 2);
    G->g->embedding_forward(G->gctx, d_out, d_ids, d_wte, N, C);
    float* out_g = host_bf16(G, d_out, (size_t)N * C);
    snprintf(what, sizeof what, "embedding_forward N=%d C=%d", N, C);
    CHECK(t, memcmp(out_g, out_c, (size_t)N * C * sizeof(float)) == 0, "%s: not exact", what);

    // backward: dwte += scatter(dout), pre-filled
    float* dout = rand_bf16(G, (size_t)N * C, 1.0f);
    float* dwte_c = rand_floats(&G->rng, (size_t)V * C, 0.5f);
    void* d_dwte = dev_raw(G, dwte_c, (size_t)V * C * sizeof(float));
    void* d_dout = dev_bf16(G, dout, (size_t)N * C);
    G->c->embedding_backward(G->cctx, dwte_c, dout, ids, N, C, V);
    void* d_dwte2 = G->g->alloc(G->gctx, (size_t)V * C * sizeof(float));
    G->g->copy(G->gctx, d_dwte2, d_dwte, (size_t)V * C * sizeof(float));
    G->g->embedding_backward(G->gctx, d_dwte, d_dout, d_ids, N, C, V);
    G->g->embedding_backward(G->gctx, d_dwte2, d_dout, d_ids, N, C, V);
    float* dwte_g = host_f32(G, d_dwte, (size_t)V * C);
    float* dwte_g2 = host_f32(G, d_dwte2, (size_t)V * C);
    snprintf(what, sizeof what, "embedding_backward N=%d C=%d V=%d", N, C, V);
    check_rel(t, what, dwte_g, dwte_c, (size_t)V * C, 1e-5);
    CHECK(t, memcmp(dwte_g, dwte_g2, (size_t)V * C * sizeof(float)) == 0,
          "%s: two runs differ", what);

    free(ids);
    free(wte);
    free(out_c);
    free(out_g);
    free(dout);
    free(dwte_c);
    free(dwte_g);
    free(dwte_g2);
    gfree(G, d_ids);
    gfree(G, d_wte);
    gfree(G, d_out);
    gfree(G, d_dwte);
    gfree(G, d_dwte2);
    gfree(G, d_dout);
}

static void test_gpu_embedding(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 2)) return;
    embedding_case(t, &G, 300, 64, 1000, 40);     // two radix passes (keys need 10 bits)
    embedding_case(t, &G, 77, 20, 97, 97);        // scalar path, one pass
    embedding_case(t, &G, 2000, 256, 70000, 500);  // three passes, segments of ~4 rows
    embedding_case(t, &G, 1000, 32, 300, 1);      // one id everywhere: one long segment
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// RMSNorm

static void rmsnorm_case(TestCtx* t, Gpu* G, int N, int C, int residual) {
    char what[96];
    const size_t n = (size_t)N * C;
    const float eps = 1e-5f;
    float* a = rand_bf16(G, n, 1.0f);
    float* b = rand_bf16(G, n, 1.0f);
    float* w = rand_bf16(G, (size_t)C, 1.0f);
    for (int c = 0; c < C; c++) w[c] = bf16_value(1.0f + 0.3f * w[c]);
    float* out_c = malloc_check(n * sizeof(float));
    float* res_c = malloc_check(n * sizeof(float));
    float* rstd_c = malloc_check((size_t)N * sizeof(float));
    void* d_a = dev_bf16(G, a, n);
    void* d_b = dev_bf16(G, b, n);
    void* d_w = dev_bf16(G, w, (size_t)C);
    float* nan_n = filled_floats(n, NAN);
    void* d_out = dev_bf16(G, nan_n, n);
    void* d_rstd = G->g->alloc(G->gctx, (size_t)N * sizeof(float));
    if (residual) {
        // The GPU rounds the residual sum to bf16 (as HF adds two bf16 tensors) and normalises
        // the rounded sum: the CPU reference normalises bf16(a + b) too.
        for (size_t i = 0; i < n; i++) res_c[i] = bf16_value(a[i] + b[i]);
        G->c->rmsnorm_forward(G->cctx, out_c, rstd_c, res_c, w, N, C, eps);
        // res aliases a on the GPU (allowed by ops.h)
        G->g->residual_rmsnorm_forward(G->gctx, d_a, d_out, d_rstd, d_a, d_b, d_w, N, C, eps);
        float* res_g = host_bf16(G, d_a, n);
        snprintf(what, sizeof what, "residual N=%d C=%d", N, C);
        check_rel(t, what, res_g, res_c, n, 1e-2);
        int exact = 1;  // the residual sum is bf16(a + b)
        for (size_t i = 0; i < n; i++) exact &= res_g[i] == res_c[i];
        CHECK(t, exact, "%s: res != bf16(a + b)", what);
        free(res_g);
    } else {
        G->c->rmsnorm_forward(G->cctx, out_c, rstd_c, a, w, N, C, eps);
        G->g->rmsnorm_forward(G->gctx, d_out, d_rstd, d_a, d_w, N, C, eps);
    }
    float* out_g = host_bf16(G, d_out, n);
    float* rstd_g = host_f32(G, d_rstd, (size_t)N);
    snprintf(what, sizeof what, "rmsnorm%s forward N=%d C=%d", residual ? "(+res)" : "", N, C);
    check_rel(t, what, out_g, out_c, n, 1e-2);
    snprintf(what, sizeof what, "rmsnorm%s rstd N=%d C=%d", residual ? "(+res)" : "", N, C);
    check_rel(t, what, rstd_g, rstd_c, (size_t)N, 1e-5);

    if (!residual) {  // backward: dinp += , dw += ; both pre-filled
        float* dout = rand_bf16(G, n, 1.0f);
        float* dinp_c = rand_bf16(G, n, 1.0f);
        float* dw_c = rand_floats(&G->rng, (size_t)C, 1.0f);
        void* d_dout = dev_bf16(G, dout, n);
        void* d_dinp = dev_bf16(G, dinp_c, n);
        void* d_dw = dev_raw(G, dw_c, (size_t)C * sizeof(float));
        void* d_rc = dev_raw(G, rstd_c, (size_t)N * sizeof(float));  // same rstd for both
        G->c->rmsnorm_backward(G->cctx, dinp_c, dw_c, dout, a, w, rstd_c, N, C);
        G->g->rmsnorm_backward(G->gctx, d_dinp, d_dw, d_dout, d_a, d_w, d_rc, N, C);
        float* dinp_g = host_bf16(G, d_dinp, n);
        float* dw_g = host_f32(G, d_dw, (size_t)C);
        snprintf(what, sizeof what, "rmsnorm backward dinp N=%d C=%d", N, C);
        check_rel(t, what, dinp_g, dinp_c, n, 1e-2);
        snprintf(what, sizeof what, "rmsnorm backward dw N=%d C=%d", N, C);
        check_rel(t, what, dw_g, dw_c, (size_t)C, 1e-4);
        free(dout);
        free(dinp_c);
        free(dw_c);
        free(dinp_g);
        free(dw_g);
        gfree(G, d_dout);
        gfree(G, d_dinp);
        gfree(G, d_dw);
        gfree(G, d_rc);
    }
    free(a);
    free(b);
    free(w);
    free(out_c);
    free(res_c);
    free(rstd_c);
    free(nan_n);
    free(out_g);
    free(rstd_g);
    gfree(G, d_a);
    gfree(G, d_b);
    gfree(G, d_w);
    gfree(G, d_out);
    gfree(G, d_rstd);
}

static void test_gpu_rmsnorm(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 3)) return;
    rmsnorm_case(t, &G, 70, 256, 0);
    rmsnorm_case(t, &G, 33, 36, 0);      // scalar path
    rmsnorm_case(t, &G, 600, 2048, 0);   // several rows per block in the backward
    rmsnorm_case(t, &G, 70, 256, 1);
    rmsnorm_case(t, &G, 33, 36, 1);
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// matmul

// w_offset shifts the weight by that many elements inside its buffer (misaligned pointers).
static void matmul_case(TestCtx* t, Gpu* G, int N, int IC, int OC, int with_bias, int w_offset) {
    char what[128];
    snprintf(what, sizeof what, "matmul N=%d IC=%d OC=%d bias=%d woff=%d", N, IC, OC, with_bias,
             w_offset);
    gpu_check_matmul(t, G, what, N, IC, OC, with_bias, 0.1f, w_offset);
}

static void test_gpu_matmul(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 4)) return;
    matmul_case(t, &G, 64, 128, 96, 1, 0);
    matmul_case(t, &G, 64, 128, 96, 0, 0);
    matmul_case(t, &G, 37, 24, 40, 1, 0);
    matmul_case(t, &G, 37, 24, 40, 0, 1);   // 2-byte aligned weight
    matmul_case(t, &G, 5, 36, 12, 0, 3);    // odd everything
    matmul_case(t, &G, 1, 64, 300, 1, 0);   // one row (generation)
    matmul_case(t, &G, 512, 768, 1024, 1, 0);
    // --profile-ops: the report names each op with its shape and counts its calls
    ops_cuda_profile_enable(G.gctx);
    for (int k = 0; k < 2; k++) matmul_case(t, &G, 64, 128, 96, 1, 0);
    FILE* f = tmpfile();
    CHECK(t, f != NULL, "tmpfile");
    if (f) {
        ops_cuda_profile_report(G.gctx, f);
        char buf[4096] = {0};
        rewind(f);
        size_t got = fread(buf, 1, sizeof buf - 1, f);
        buf[got] = 0;
        fclose(f);
        CHECK(t, strstr(buf, "op profile of cuda:1") && strstr(buf, "matmul fwd N=") &&
                     strstr(buf, "matmul bwd") && strstr(buf, "per op:"),
              "profile report lacks the matmuls:\n%s", buf);
        printf("%s", buf);
    }
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// QK-norm + RoPE

static void rope_case(TestCtx* t, Gpu* G, int B, int T, int H, int KVH, int HD, int normed) {
    char what[128];
    snprintf(what, sizeof what, "qknorm_rope B=%d T=%d H=%d KVH=%d HD=%d norm=%d", B, T, H, KVH,
             HD, normed);
    const int N = B * T, QKV = (H + 2 * KVH) * HD, half = HD / 2, heads = H + KVH;
    const size_t n = (size_t)N * QKV;
    const float eps = 1e-6f;
    float* inp = rand_bf16(G, n, 1.0f);
    float* qw = normed ? rand_bf16(G, (size_t)HD, 1.0f) : NULL;
    float* kw = normed ? rand_bf16(G, (size_t)HD, 1.0f) : NULL;
    for (int i = 0; normed && i < HD; i++) {
        qw[i] = bf16_value(1.0f + 0.3f * qw[i]);
        kw[i] = bf16_value(1.0f + 0.3f * kw[i]);
    }
    float* cs = malloc_check((size_t)T * half * sizeof(float));
    float* sn = malloc_check((size_t)T * half * sizeof(float));
    for (int p = 0; p < T; p++)
        for (int i = 0; i < half; i++) {
            float ang = (float)p * powf(10000.0f, -2.0f * i / HD);
            cs[(size_t)p * half + i] = cosf(ang);
            sn[(size_t)p * half + i] = sinf(ang);
        }
    float* out_c = malloc_check(n * sizeof(float));
    float* rstd_c = filled_floats((size_t)N * heads, 0.0f);
    G->c->qknorm_rope_forward(G->cctx, out_c, normed ? rstd_c : NULL, inp, qw, kw, cs, sn, B, T,
                              H, KVH, HD, eps);
    void* d_inp = dev_bf16(G, inp, n);
    void* d_qw = normed ? dev_bf16(G, qw, (size_t)HD) : NULL;
    void* d_kw = normed ? dev_bf16(G, kw, (size_t)HD) : NULL;
    void* d_cs = dev_raw(G, cs, (size_t)T * half * sizeof(float));
    void* d_sn = dev_raw(G, sn, (size_t)T * half * sizeof(float));
    float* nan_n = filled_floats(n, NAN);
    void* d_out = dev_bf16(G, nan_n, n);
    void* d_rstd = G->g->alloc(G->gctx, (size_t)N * heads * sizeof(float));
    G->g->qknorm_rope_forward(G->gctx, d_out, normed ? d_rstd : NULL, d_inp, d_qw, d_kw, d_cs,
                              d_sn, B, T, H, KVH, HD, eps);
    float* out_g = host_bf16(G, d_out, n);
    check_rel(t, what, out_g, out_c, n, 1e-2);
    int v_exact = 1;  // v is copied
    for (int r = 0; r < N; r++)
        for (int e = heads * HD; e < QKV; e++)
            v_exact &= out_g[(size_t)r * QKV + e] == inp[(size_t)r * QKV + e];
    CHECK(t, v_exact, "%s: v part not copied exactly", what);
    if (normed) {
        float* rstd_g = host_f32(G, d_rstd, (size_t)N * heads);
        char w2[160];
        snprintf(w2, sizeof w2, "%s rstd", what);
        check_rel(t, w2, rstd_g, rstd_c, (size_t)N * heads, 1e-5);
        free(rstd_g);
    }

    // backward: dinp overwritten, norm-weight gradients accumulate
    float* dout = rand_bf16(G, n, 1.0f);
    float* dinp_c = malloc_check(n * sizeof(float));
    float* dqw_c = rand_floats(&G->rng, (size_t)HD, 1.0f);
    float* dkw_c = rand_floats(&G->rng, (size_t)HD, 1.0f);
    void* d_dout = dev_bf16(G, dout, n);
    void* d_dinp = dev_bf16(G, nan_n, n);
    void* d_dqw = dev_raw(G, dqw_c, (size_t)HD * sizeof(float));
    void* d_dkw = dev_raw(G, dkw_c, (size_t)HD * sizeof(float));
    void* d_rc = dev_raw(G, rstd_c, (size_t)N * heads * sizeof(float));
    G->c->qknorm_rope_backward(G->cctx, dinp_c, normed ? dqw_c : NULL, normed ? dkw_c : NULL,
                               dout, inp, qw, kw, rstd_c, cs, sn, B, T, H, KVH, HD);
    G->g->qknorm_rope_backward(G->gctx, d_dinp, normed ? d_dqw : NULL, normed ? d_dkw : NULL,
                               d_dout, d_inp, d_qw, d_kw, d_rc, d_cs, d_sn, B, T, H, KVH, HD);
    float* dinp_g = host_bf16(G, d_dinp, n);
    char w2[160];
    snprintf(w2, sizeof w2, "%s dinp", what);
    check_rel(t, w2, dinp_g, dinp_c, n, 1e-2);
    if (normed) {
        float* dqw_g = host_f32(G, d_dqw, (size_t)HD);
        float* dkw_g = host_f32(G, d_dkw, (size_t)HD);
        snprintf(w2, sizeof w2, "%s dq_norm_w", what);
        check_rel(t, w2, dqw_g, dqw_c, (size_t)HD, 2e-2);
        snprintf(w2, sizeof w2, "%s dk_norm_w", what);
        check_rel(t, w2, dkw_g, dkw_c, (size_t)HD, 2e-2);
        free(dqw_g);
        free(dkw_g);
    }
    free(inp);
    free(qw);
    free(kw);
    free(cs);
    free(sn);
    free(out_c);
    free(rstd_c);
    free(out_g);
    free(nan_n);
    free(dout);
    free(dinp_c);
    free(dqw_c);
    free(dkw_c);
    free(dinp_g);
    void* bufs[] = {d_inp, d_qw, d_kw, d_cs, d_sn, d_out, d_rstd, d_dout, d_dinp, d_dqw, d_dkw,
                    d_rc};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) gfree(G, bufs[i]);
}

static void test_gpu_qknorm_rope(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 5)) return;
    rope_case(t, &G, 2, 5, 4, 2, 16, 1);
    rope_case(t, &G, 2, 5, 4, 2, 16, 0);
    rope_case(t, &G, 1, 7, 4, 2, 12, 0);    // test-llama head dim, scalar path
    rope_case(t, &G, 1, 7, 4, 2, 12, 1);
    rope_case(t, &G, 2, 300, 16, 8, 128, 1);  // Qwen3-1.7B heads, many rows per block
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// attention

static void attention_case(TestCtx* t, Gpu* G, int B, int T, int H, int KVH, int HD) {
    char what[128];
    snprintf(what, sizeof what, "attention B=%d T=%d H=%d KVH=%d HD=%d", B, T, H, KVH, HD);
    const int N = B * T, QKV = (H + 2 * KVH) * HD, OD = H * HD;
    float* qkv = rand_bf16(G, (size_t)N * QKV, 1.0f);
    float* out_c = malloc_check((size_t)N * OD * sizeof(float));
    float* lse_c = malloc_check((size_t)B * H * T * sizeof(float));
    G->c->attention_forward(G->cctx, out_c, lse_c, qkv, B, T, H, KVH, HD);
    void* d_qkv = dev_bf16(G, qkv, (size_t)N * QKV);
    float* nan_o = filled_floats((size_t)N * QKV, NAN);
    void* d_out = dev_bf16(G, nan_o, (size_t)N * OD);
    void* d_lse = G->g->alloc(G->gctx, (size_t)B * H * T * sizeof(float));
    G->g->attention_forward(G->gctx, d_out, d_lse, d_qkv, B, T, H, KVH, HD);
    float* out_g = host_bf16(G, d_out, (size_t)N * OD);
    float* lse_g = host_f32(G, d_lse, (size_t)B * H * T);
    check_rel(t, what, out_g, out_c, (size_t)N * OD, 1e-2);
    char w2[160];
    snprintf(w2, sizeof w2, "%s lse", what);
    check_rel(t, w2, lse_g, lse_c, (size_t)B * H * T, 1e-4);

    // backward, both backends on the same (bf16-rounded) out and lse
    for (size_t i = 0; i < (size_t)N * OD; i++) out_c[i] = bf16_value(out_c[i]);
    float* dout = rand_bf16(G, (size_t)N * OD, 1.0f);
    float* dqkv_c = malloc_check((size_t)N * QKV * sizeof(float));
    G->c->attention_backward(G->cctx, dqkv_c, dout, qkv, out_c, lse_c, B, T, H, KVH, HD);
    void* d_dout = dev_bf16(G, dout, (size_t)N * OD);
    void* d_oc = dev_bf16(G, out_c, (size_t)N * OD);
    void* d_lc = dev_raw(G, lse_c, (size_t)B * H * T * sizeof(float));
    void* d_dqkv = dev_bf16(G, nan_o, (size_t)N * QKV);
    G->g->attention_backward(G->gctx, d_dqkv, d_dout, d_qkv, d_oc, d_lc, B, T, H, KVH, HD);
    float* dqkv_g = host_bf16(G, d_dqkv, (size_t)N * QKV);
    snprintf(w2, sizeof w2, "%s dqkv", what);
    check_rel(t, w2, dqkv_g, dqkv_c, (size_t)N * QKV, 2e-2);
    // q, k and v parts separately (dq/dk go through the softmax gradient, dv does not)
    const int part_lo[3] = {0, H * HD, (H + KVH) * HD}, part_w[3] = {H * HD, KVH * HD, KVH * HD};
    const char* part_name[3] = {"dq", "dk", "dv"};
    for (int p = 0; p < 3; p++) {
        size_t m = (size_t)N * part_w[p];
        float* pg = malloc_check(m * sizeof(float));
        float* pc = malloc_check(m * sizeof(float));
        for (int r = 0; r < N; r++) {
            memcpy(pg + (size_t)r * part_w[p], dqkv_g + (size_t)r * QKV + part_lo[p],
                   (size_t)part_w[p] * sizeof(float));
            memcpy(pc + (size_t)r * part_w[p], dqkv_c + (size_t)r * QKV + part_lo[p],
                   (size_t)part_w[p] * sizeof(float));
        }
        snprintf(w2, sizeof w2, "%s %s", what, part_name[p]);
        double e = check_rel(t, w2, pg, pc, m, 3e-2);
        printf("  %s: %s relative L2 error %.3g\n", what, part_name[p], e);
        free(pg);
        free(pc);
    }

    free(qkv);
    free(out_c);
    free(lse_c);
    free(nan_o);
    free(out_g);
    free(lse_g);
    free(dout);
    free(dqkv_c);
    free(dqkv_g);
    void* bufs[] = {d_qkv, d_out, d_lse, d_dout, d_oc, d_lc, d_dqkv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gfree(G, bufs[i]);
}

static void test_gpu_attention(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 6)) return;
    attention_case(t, &G, 2, 33, 4, 2, 16);   // flash path (mma.sync)
    attention_case(t, &G, 1, 20, 4, 1, 12);   // simple path (head dim 12)
    attention_case(t, &G, 1, 130, 2, 1, 128);  // flash path, several tiles
    attention_case(t, &G, 2, 17, 4, 2, 32);
    // HD 64 and 128 run the wgmma forward on sm_90a builds (128-row query tiles of two 64-row
    // warpgroups, 128-key K/V tiles): T below one tile, a last tile whose second warpgroup has
    // no row below T (T = 300: rows 256..299), a few rows only (T = 1 is left out: its exact dq
    // and dk are 0, which a relative error cannot measure), several K/V tiles through the ring.
    attention_case(t, &G, 2, 77, 4, 2, 64);
    attention_case(t, &G, 1, 300, 8, 2, 64);
    attention_case(t, &G, 3, 5, 2, 2, 128);
    attention_case(t, &G, 1, 600, 4, 2, 128);
    // the default build (GPU_ARCH=sm_90a) on a Hopper GPU takes the wgmma path at HD 64 and 128
    // (a build flag lost on the way would fall back to mma.sync silently: correct, but slow)
    if (cuda_device_capability(0) == 90 && strcmp(cuda_build_arch(), "sm_90a") == 0)
        CHECK(t, attention_uses_wgmma(64) && attention_uses_wgmma(128) && !attention_uses_wgmma(32),
              "an sm_90a build on compute capability 9.0 must run the wgmma attention");
    printf("  attention: wgmma kernels %s at HD 128 (build %s, compute capability %d)\n",
           attention_uses_wgmma(128) ? "used" : "NOT used", cuda_build_arch(),
           cuda_device_capability(0));
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// SwiGLU, add

static void swiglu_case(TestCtx* t, Gpu* G, int N, int F) {
    char what[96];
    const size_t n = (size_t)N * F;
    float* gu = rand_bf16(G, 2 * n, 2.0f);
    float* out_c = malloc_check(n * sizeof(float));
    G->c->swiglu_forward(G->cctx, out_c, gu, N, F);
    void* d_gu = dev_bf16(G, gu, 2 * n);
    float* nan2 = filled_floats(2 * n, NAN);
    void* d_out = dev_bf16(G, nan2, n);
    G->g->swiglu_forward(G->gctx, d_out, d_gu, N, F);
    float* out_g = host_bf16(G, d_out, n);
    snprintf(what, sizeof what, "swiglu forward N=%d F=%d", N, F);
    check_rel(t, what, out_g, out_c, n, 1e-2);
    float* dout = rand_bf16(G, n, 1.0f);
    float* dgu_c = malloc_check(2 * n * sizeof(float));
    G->c->swiglu_backward(G->cctx, dgu_c, dout, gu, N, F);
    void* d_dout = dev_bf16(G, dout, n);
    void* d_dgu = dev_bf16(G, nan2, 2 * n);
    G->g->swiglu_backward(G->gctx, d_dgu, d_dout, d_gu, N, F);
    float* dgu_g = host_bf16(G, d_dgu, 2 * n);
    snprintf(what, sizeof what, "swiglu backward N=%d F=%d", N, F);
    check_rel(t, what, dgu_g, dgu_c, 2 * n, 1e-2);
    free(gu);
    free(out_c);
    free(nan2);
    free(out_g);
    free(dout);
    free(dgu_c);
    free(dgu_g);
    gfree(G, d_gu);
    gfree(G, d_out);
    gfree(G, d_dout);
    gfree(G, d_dgu);
}

static void test_gpu_swiglu_add(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 7)) return;
    swiglu_case(t, &G, 17, 64);
    swiglu_case(t, &G, 9, 20);  // scalar path
    swiglu_case(t, &G, 300, 1536);
    // add: out = bf16(a + b) exactly, with the 16-byte path and a scalar tail; out may alias a
    const size_t sizes[2] = {1000, 1003};
    for (int k = 0; k < 2; k++) {
        size_t n = sizes[k];
        float* a = rand_bf16(&G, n, 1.0f);
        float* b = rand_bf16(&G, n, 1.0f);
        void* d_a = dev_bf16(&G, a, n);
        void* d_b = dev_bf16(&G, b, n);
        void* d_o = G.g->alloc(G.gctx, n * 2);
        G.g->add(G.gctx, d_o, d_a, d_b, n);
        G.g->add(G.gctx, d_a, d_a, d_b, n);
        float* o = host_bf16(&G, d_o, n);
        float* o2 = host_bf16(&G, d_a, n);
        int exact = 1;
        for (size_t i = 0; i < n; i++) exact &= o[i] == bf16_value(a[i] + b[i]) && o2[i] == o[i];
        CHECK(t, exact, "add n=%zu: out != bf16(a + b)", n);
        free(a);
        free(b);
        free(o);
        free(o2);
        gfree(&G, d_a);
        gfree(&G, d_b);
        gfree(&G, d_o);
    }
    // add_f32: dst += src in fp32, bit for bit the CPU's (the float4 path, a scalar tail, and a
    // misaligned start that takes the scalar path throughout)
    const size_t fsizes[3] = {4096, 4099, 1001};
    for (int k = 0; k < 3; k++) {
        const size_t n = fsizes[k], off = k == 2 ? 1 : 0;
        float* a = rand_floats(&G.rng, n + off, 3.0f);
        float* b = rand_floats(&G.rng, n + off, 1e-3f);
        float* d_a = G.g->alloc(G.gctx, (n + off) * sizeof(float));
        float* d_b = G.g->alloc(G.gctx, (n + off) * sizeof(float));
        G.g->upload(G.gctx, d_a, a, (n + off) * sizeof(float));
        G.g->upload(G.gctx, d_b, b, (n + off) * sizeof(float));
        G.g->add_f32(G.gctx, d_a + off, d_b + off, n);
        float* got = malloc_check((n + off) * sizeof(float));
        G.g->download(G.gctx, got, d_a, (n + off) * sizeof(float));
        G.c->add_f32(G.cctx, a + off, b + off, n);
        CHECK(t, memcmp(got, a, (n + off) * sizeof(float)) == 0, "add_f32 n=%zu off=%zu: GPU != CPU",
              n, off);
        free(a);
        free(b);
        free(got);
        G.g->free(G.gctx, d_a);
        G.g->free(G.gctx, d_b);
    }
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// cross-entropy

static void xent_case(TestCtx* t, Gpu* G, int n, int V, int compute_grad) {
    char what[96];
    snprintf(what, sizeof what, "crossentropy n=%d V=%d grad=%d", n, V, compute_grad);
    const size_t nv = (size_t)n * V;
    float* z = rand_bf16(G, nv, 3.0f);
    int32_t* tg = malloc_check((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) tg[i] = (int32_t)rng_below(&G->rng, (uint64_t)V);
    tg[n / 2] = -1;  // ignored
    tg[0] = V - 1;
    void* d_z = dev_bf16(G, z, nv);
    void* d_tg = dev_raw(G, tg, (size_t)n * sizeof(int32_t));
    float* nanl = filled_floats((size_t)n, NAN);
    void* d_loss = dev_raw(G, nanl, (size_t)n * sizeof(float));
    float* loss_c = malloc_check((size_t)n * sizeof(float));
    const float scale = 0.25f;
    G->c->crossentropy_forward_backward(G->cctx, z, loss_c, tg, n, V, scale, compute_grad);
    G->g->crossentropy_forward_backward(G->gctx, d_z, d_loss, d_tg, n, V, scale, compute_grad);
    float* loss_g = host_f32(G, d_loss, (size_t)n);
    check_rel(t, what, loss_g, loss_c, (size_t)n, 1e-5);
    CHECK(t, loss_g[n / 2] == 0.0f, "%s: ignored target has loss %g", what, loss_g[n / 2]);
    float* zg = host_bf16(G, d_z, nv);
    char w2[128];
    snprintf(w2, sizeof w2, "%s dlogits", what);
    check_rel(t, w2, zg, z, nv, compute_grad ? 1e-2 : 0.0);
    if (compute_grad) {
        int zero = 1;
        for (int j = 0; j < V; j++) zero &= zg[(size_t)(n / 2) * V + j] == 0.0f;
        CHECK(t, zero, "%s: ignored row must have a zero gradient", what);
    }
    free(z);
    free(tg);
    free(nanl);
    free(loss_c);
    free(loss_g);
    free(zg);
    gfree(G, d_z);
    gfree(G, d_tg);
    gfree(G, d_loss);
}

static void test_gpu_crossentropy(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 8)) return;
    xent_case(t, &G, 7, 1000, 1);
    xent_case(t, &G, 7, 1000, 0);
    xent_case(t, &G, 5, 97, 1);  // scalar path
    xent_case(t, &G, 3, 151936, 1);  // Qwen3 vocabulary
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// determinism: every op with a reduction, twice on the same inputs, bit for bit

static void test_gpu_determinism(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 9)) return;
    const int N = 4096, C = 512, OC = 384, B = 2, T = 256, H = 8, KVH = 4, HD = 64;
    const int QKV = (H + 2 * KVH) * HD;
    float* x = rand_bf16(&G, (size_t)N * C, 1.0f);
    float* dy = rand_bf16(&G, (size_t)N * QKV, 1.0f);
    float* w = rand_bf16(&G, (size_t)QKV * C, 0.1f);
    float* rs = filled_floats((size_t)N * (H + KVH), 1.3f);
    void* d_x = dev_bf16(&G, x, (size_t)N * C);
    void* d_dy = dev_bf16(&G, dy, (size_t)N * QKV);
    void* d_w = dev_bf16(&G, w, (size_t)QKV * C);
    void* d_rs = dev_raw(&G, rs, (size_t)N * (H + KVH) * sizeof(float));
    void* o1 = G.g->alloc(G.gctx, (size_t)N * QKV * 4);
    void* o2 = G.g->alloc(G.gctx, (size_t)N * QKV * 4);
    void* f1 = G.g->alloc(G.gctx, (size_t)QKV * C * 4);
    void* f2 = G.g->alloc(G.gctx, (size_t)QKV * C * 4);

    // rmsnorm backward (dinp and dw)
    for (int r = 0; r < 2; r++)
        G.g->rmsnorm_backward(G.gctx, r ? o2 : o1, r ? f2 : f1, d_dy, d_x, d_w, d_rs, N, C);
    CHECK(t, same_device_bytes(&G, o1, o2, (size_t)N * C * 2) &&
                 same_device_bytes(&G, f1, f2, (size_t)C * 4), "rmsnorm_backward differs");
    // matmul backward (dinp, dW, dbias)
    G.g->zero(G.gctx, f1, (size_t)QKV * C * 4);
    G.g->zero(G.gctx, f2, (size_t)QKV * C * 4);
    for (int r = 0; r < 2; r++)
        G.g->matmul_backward(G.gctx, r ? o2 : o1, r ? f2 : f1, NULL, d_dy, d_x, d_w, N, C, OC);
    CHECK(t, same_device_bytes(&G, o1, o2, (size_t)N * C * 2) &&
                 same_device_bytes(&G, f1, f2, (size_t)OC * C * 4), "matmul_backward differs");
    // qknorm_rope backward (dinp, norm weights): the x buffer doubles as qkv input
    float* cs = filled_floats((size_t)T * HD / 2, 0.6f);
    float* sn = filled_floats((size_t)T * HD / 2, 0.8f);
    void* d_cs = dev_raw(&G, cs, (size_t)T * HD / 2 * 4);
    void* d_sn = dev_raw(&G, sn, (size_t)T * HD / 2 * 4);
    void* d_qkv = dev_bf16(&G, dy, (size_t)B * T * QKV);
    void* d_nw = dev_bf16(&G, w, (size_t)HD);
    G.g->zero(G.gctx, f1, (size_t)2 * HD * 4);
    G.g->zero(G.gctx, f2, (size_t)2 * HD * 4);
    for (int r = 0; r < 2; r++) {
        float* f = r ? f2 : f1;
        G.g->qknorm_rope_backward(G.gctx, r ? o2 : o1, f, f + HD, d_dy, d_qkv, d_nw, d_nw, d_rs,
                                  d_cs, d_sn, B, T, H, KVH, HD);
    }
    CHECK(t, same_device_bytes(&G, o1, o2, (size_t)B * T * QKV * 2) &&
                 same_device_bytes(&G, f1, f2, (size_t)2 * HD * 4),
          "qknorm_rope_backward differs");
    // attention forward (out and lse; HD 64: the wgmma kernel on sm_90a builds), then backward
    void* d_att = G.g->alloc(G.gctx, (size_t)B * T * H * HD * 2);
    void* d_lse = G.g->alloc(G.gctx, (size_t)B * H * T * 4);
    G.g->attention_forward(G.gctx, d_att, d_lse, d_qkv, B, T, H, KVH, HD);
    G.g->attention_forward(G.gctx, o1, f1, d_qkv, B, T, H, KVH, HD);
    CHECK(t, same_device_bytes(&G, d_att, o1, (size_t)B * T * H * HD * 2) &&
                 same_device_bytes(&G, d_lse, f1, (size_t)B * H * T * 4),
          "attention_forward differs");
    for (int r = 0; r < 2; r++)
        G.g->attention_backward(G.gctx, r ? o2 : o1, d_x, d_qkv, d_att, d_lse, B, T, H, KVH, HD);
    CHECK(t, same_device_bytes(&G, o1, o2, (size_t)B * T * QKV * 2),
          "attention_backward differs");
    // cross-entropy
    const int n = 64, V = 5000;
    int32_t tg[64];
    for (int i = 0; i < n; i++) tg[i] = (int32_t)rng_below(&G.rng, V);
    void* d_tg = dev_raw(&G, tg, sizeof tg);
    G.g->copy(G.gctx, o2, d_dy, (size_t)n * V * 2);
    G.g->copy(G.gctx, o1, d_dy, (size_t)n * V * 2);
    for (int r = 0; r < 2; r++)
        G.g->crossentropy_forward_backward(G.gctx, r ? o2 : o1, (float*)(r ? f2 : f1), d_tg, n, V,
                                           0.5f, 1);
    CHECK(t, same_device_bytes(&G, o1, o2, (size_t)n * V * 2) &&
                 same_device_bytes(&G, f1, f2, (size_t)n * 4), "crossentropy differs");

    free(x);
    free(dy);
    free(w);
    free(rs);
    free(cs);
    free(sn);
    void* bufs[] = {d_x, d_dy, d_w, d_rs, o1, o2, f1, f2, d_cs, d_sn, d_qkv, d_nw, d_att, d_lse,
                    d_tg};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gfree(&G, bufs[i]);
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// the whole model: plain trainer on the GPU vs the CPU

static int64_t grads_total(const Model* m) {
    int64_t n = 0;
    for (int l = 0; l < m->tt.n_layers; l++) n += m->tt.grad_numel[l];
    return n;
}

static float* grads_flat(const Model* m, const Store* s) {
    float* out = malloc_check((size_t)grads_total(m) * sizeof(float));
    int64_t o = 0;
    for (int l = 0; l < m->tt.n_layers; l++) {
        memcpy(out + o, s->grad[l], (size_t)m->tt.grad_numel[l] * sizeof(float));
        o += m->tt.grad_numel[l];
    }
    return out;
}

// Round every parameter of the store to a bf16 value (so both backends see the same weights).
static void store_round_bf16(const Model* m, Store* s) {
    for (int l = 0; l < m->tt.n_layers; l++)
        for (int64_t i = 0; i < m->tt.param_numel[l]; i++)
            s->param[l][i] = bf16_value(s->param[l][i]);
}

// Mean loss and folded gradients (into s) of one batch on a backend.
static double run_batch(const Model* m, Store* s, const Ops* ops, void* ctx, const int32_t* tokens,
                        int B, int T, int recompute) {
    Plain* p = plain_create(m, s, ops, ctx, B, T, recompute);
    const double N = (double)B * T;
    store_zero_grads(s);
    double loss = plain_forward_backward(p, tokens, B, T, (float)(1.0 / N)) / N;
    plain_sync_grads(p);
    store_fold_tied_grads(s);
    plain_free(p);
    return loss;
}

// Per-tensor relative L2 errors of the GPU gradients against the reference; returns the worst.
static double compare_tensor_grads(TestCtx* t, const char* label, const Model* m, const Store* got,
                                   const Store* want, double tol) {
    double worst = 0.0;
    const char* worst_name = "";
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->tied_to >= 0) continue;
        double e = rel_l2_error(store_grad(got, i), store_grad(want, i), (size_t)d->numel);
        CHECK(t, e <= tol, "%s %s: gradient relative L2 error %.3g (tol %.3g)", label, d->name, e,
              tol);
        if (!(e <= worst)) {
            worst = e;
            worst_name = d->name;
        }
    }
    printf("  %s: worst tensor gradient error %.3g (%s)\n", label, worst, worst_name);
    return worst;
}

// mlp_chunk > 0: long-sequence mode (the MLP in row chunks; ln1, qkv_raw, qkv, h and the MLP's
// activations recomputed by the backward) on both backends. tensor_tol: the per-tensor gradient
// tolerance (the whole-model one is 3e-2).
static void model_case(TestCtx* t, Gpu* G, const char* preset, int mlp_chunk, double tensor_tol) {
    char err[ERR_LEN];
    ModelConfig cfg;
    CHECK(t, config_from_preset(&cfg, preset, err) == 0, "%s", err);
    Model m;
    if (model_init(&m, &cfg, 0, err) != 0) {
        CHECK(t, 0, "model_init %s: %s", preset, err);
        return;
    }
    m.mlp_chunk = mlp_chunk;
    Store sc, sg;
    store_create(&sc, &m.tt);
    store_create(&sg, &m.tt);
    // std 0.1: with larger weights the tiny models' attention is nearly one-hot, and the
    // gradients through the softmax drown in bf16 rounding (seen: 6% errors in wq/wk at 0.3)
    store_init_random(&sc, 17, 0.1f);
    Rng r;
    rng_seed(&r, 18);
    for (int i = 0; i < m.tt.n; i++) {  // perturb the norms so their gradients matter
        const TensorDesc* d = &m.tt.t[i];
        if (d->tied_to >= 0 || d->ndim != 1) continue;
        float* p = store_param(&sc, i);
        for (int64_t j = 0; j < d->numel; j++) p[j] = 1.0f + 0.2f * rng_normal(&r);
    }
    store_round_bf16(&m, &sc);
    for (int l = 0; l < m.tt.n_layers; l++)
        memcpy(sg.param[l], sc.param[l], (size_t)m.tt.param_numel[l] * sizeof(float));
    const int B = 2, T = 48;
    int32_t* tokens = malloc_check((size_t)B * (T + 1) * sizeof(int32_t));
    for (int i = 0; i < B * (T + 1); i++) tokens[i] = (int32_t)rng_below(&r, (uint64_t)cfg.V);

    double lc = run_batch(&m, &sc, G->c, G->cctx, tokens, B, T, 0);
    double lg = run_batch(&m, &sg, G->g, G->gctx, tokens, B, T, 0);
    printf("  %s%s: loss cpu %.6f gpu %.6f\n", preset, mlp_chunk ? " (chunked MLP)" : "", lc, lg);
    CHECK(t, fabs(lg - lc) <= 1e-2 * fabs(lc), "%s: loss %.6f on the GPU vs %.6f on the CPU",
          preset, lg, lc);
    float* gc = grads_flat(&m, &sc);
    float* gg = grads_flat(&m, &sg);
    const size_t ng = (size_t)grads_total(&m);
    char label[96];
    snprintf(label, sizeof label, "%s all gradients", preset);
    check_rel(t, label, gg, gc, ng, 3e-2);
    snprintf(label, sizeof label, "%s gpu vs cpu", preset);
    compare_tensor_grads(t, label, &m, &sg, &sc, tensor_tol);

    // recompute and a second run: the same bits
    double lg2 = run_batch(&m, &sg, G->g, G->gctx, tokens, B, T, 1);
    float* gg2 = grads_flat(&m, &sg);
    CHECK(t, lg2 == lg && memcmp(gg, gg2, ng * sizeof(float)) == 0,
          "%s: GPU recompute run differs from the first run (loss %.9g vs %.9g)", preset, lg2,
          lg);

    free(gc);
    free(gg);
    free(gg2);
    free(tokens);
    store_free(&sc);
    store_free(&sg);
    model_free(&m);
}

static void test_gpu_model(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 10)) return;
    model_case(t, &G, "test-llama", 0, 6e-2);   // HD 12: the simple attention path
    model_case(t, &G, "test-qwen3", 0, 6e-2);   // HD 16: the flash attention path, QK-norm
    model_case(t, &G, "test-qwen3", 40, 6e-2);  // 96 rows in MLP chunks of 40, 40, 16
    gpu_close(&G);
}

// ----------------------------------------------------------------------------
// HF parity fixtures through the GPU path (fp32 fixtures, bf16 compute)

// tol: the per-tensor gradient tolerance.
static void parity_case(TestCtx* t, Gpu* G, const char* name, double tol) {
    ParityFixture f;
    if (test_parity_open(t, name, &f) != 0) return;
    double loss = run_batch(&f.m, &f.s, G->g, G->gctx, f.tokens, f.B, f.T, 0);
    printf("  parity %s: GPU loss %.6f, HF %.6f\n", name, loss, f.ref_loss);
    CHECK(t, fabs(loss - f.ref_loss) <= 1e-2 * fabs(f.ref_loss), "%s: GPU loss %.6f vs HF %.6f",
          name, loss, f.ref_loss);
    char what[96];
    snprintf(what, sizeof what, "%s (GPU)", name);
    int n_grads = 0;
    double worst = test_check_fixture_grads(t, what, &f.m, &f.s, &f.ex, tol, &n_grads, NULL);
    printf("  parity %s: %d gradients, worst relative L2 error %.3g\n", name, n_grads, worst);
    CHECK(t, n_grads > 0, "%s: no gradients compared", name);
    test_parity_close(&f);
}

static void test_gpu_parity(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 11)) return;
    parity_case(t, &G, "llama", 5e-2);
    parity_case(t, &G, "qwen3", 5e-2);
    gpu_close(&G);
}

// Mixture-of-experts models on the GPU: against the CPU backend on the same bf16 weights, then
// the HF fixtures (dev/parity/make_moe_fixtures.py: the aux loss on, GPT-OSS with sinks, a sliding
// window shorter than T and YaRN) within bf16 noise. Per tensor the noise is larger than in a
// dense model: the bf16 router logits send a few near-tie tokens to other experts than the fp32
// ones do (each such token moves a whole row of an expert's gradient), and the router's gradient
// through a top-2 softmax is a difference of two nearly equal products (measured on the H200:
// up to 0.10 for a rarely chosen expert, 0.12 for the GPT-OSS router; 0.035 for the dense
// models). The kernels themselves are checked op by op in gpu_moe_* at bf16 tolerances.
static void test_gpu_moe_model(TestCtx* t) {
    Gpu G;
    if (!gpu_open(t, &G, 12)) return;
    model_case(t, &G, "test-qwen3moe", 0, 0.2);  // a dense block and two MoE blocks
    model_case(t, &G, "test-gptoss", 0, 0.2);    // sinks, window 4 < T on even blocks, biases
    parity_case(t, &G, "qwen3moe", 0.2);
    parity_case(t, &G, "gptoss", 0.2);
    gpu_close(&G);
}


// ----------------------------------------------------------------------------
// the RoundPipe engine on GPUs: the loss trajectory against plain training on the GPU (the same
// kernels; synchronous or with the one-step-delayed update written out by hand), and the device
// memory it takes against its prediction. Few steps at a tolerance that says the schedules agree,
// not that training happened: gpu_engine_training below checks that.

#define ENGINE_STEPS 3

static const AdamWHyper gpu_engine_hyper = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
static const LrSchedule gpu_engine_sched = {LR_COSINE, 1e-3f, 1, ENGINE_STEPS, 0.1f, 0.2f};

// Plain training on GPU 0 (testing.c's reference trainer) with the engine runs' init and
// optimizer; delayed: the one-step-delayed update written out by hand.
static void gpu_engine_reference(const ModelConfig* c, int B, int T, int M, int delayed,
                                 int mlp_chunk, const int32_t* tokens, double* loss) {
    void* ctx = ops_cuda_create(0, NULL);
    RefTrain r = {.c = c, .ops = &ops_cuda, .ctx = ctx, .B = B, .T = T, .M = M,
                  .steps = ENGINE_STEPS, .delayed = delayed, .mlp_chunk = mlp_chunk,
                  .hyper = gpu_engine_hyper,
                  .sched = gpu_engine_sched, .init_seed = 11, .init_scale = 0.05f};
    test_reference_train(&r, tokens, loss, NULL, NULL);
    ops_cuda_destroy(ctx);
}

typedef struct GpuEngineCase {
    int N, M, sync;
    RecomputeGrain grain;
    double stage_bytes;  // device budget beyond the fixed part (0 = unlimited)
    double total_bytes;  // > 0: the whole device budget instead
    int slow_opt_us;     // the optimizer step takes this much longer (gated uploads)
    int split;           // split rounds (needs two GPUs)
    int mlp_chunk;       // Model.mlp_chunk: long-sequence mode (chunked MLP, lean activations)
} GpuEngineCase;

// What one case did besides its losses.
typedef struct GpuEngineRun {
    int S;               // stages (-1: the engine could not be made)
    size_t used;         // bytes taken on the busiest device over the first two steps
    EngineDeviceBytes db;  // the prediction
    int64_t gated;       // stages uploaded behind per-layer fences
} GpuEngineRun;

// With the delayed update the iterations go as the trainer sends them: t+1 submitted before t
// is collected (two in flight).
static GpuEngineRun gpu_engine_run(TestCtx* t, const DeviceImpl* impl, const ModelConfig* c, int B,
                                   int T, const GpuEngineCase* ec, const int32_t* tokens,
                                   double* loss) {
    GpuEngineRun run = {.S = -1};
    // (impl: device_cuda_impl; the emulated devices would do for a fp32 comparison)
    char err[ERR_LEN];
    Model m;
    if (model_init(&m, c, 0, err) != 0) {
        CHECK(t, 0, "model: %s", err);
        return run;
    }
    m.mlp_chunk = ec->mlp_chunk;
    Store s;
    store_create(&s, &m.tt);
    store_init_random(&s, 11, 0.05f);
    DeviceOptions dopt = {.threads = t->n_threads > 0 ? t->n_threads : 1};
    DeviceSet devs;
    device_set_open(&devs, impl, ec->N, &dopt);
    const int cuda = impl == &device_cuda_impl;
    size_t free0[8] = {0}, tot = 0;
    for (int g = 0; cuda && g < ec->N && g < 8; g++) cuda_device_memory(g, &free0[g], &tot);
    EngineOptions eo = {.B = B, .T = T, .M = ec->M, .M_R = ec->M, .grain = ec->grain,
                        .sync = ec->sync, .opt_threads = 2, .trace_path = "",
                        .fake_optimizer_us = ec->slow_opt_us, .split_rounds = ec->split,
                        .hyper = gpu_engine_hyper,
                        .sched = gpu_engine_sched, .grad_clip = 1.0f};
    if (ec->stage_bytes > 0)
        eo.device_budget = (double)engine_fixed_device_bytes(&m, cuda ? 2 : 4, &eo) + ec->stage_bytes;
    if (ec->total_bytes > 0) eo.device_budget = ec->total_bytes;
    Engine* e = engine_create(&m, &s, &devs, &eo, err);
    CHECK(t, e != NULL, "engine_create: %s", err);
    if (e) {
        run.S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
        run.db = engine_device_bytes(e);
        for (int step = 0; step < ENGINE_STEPS; step++) {
            const int32_t* batch = tokens + (size_t)step * B * (T + 1);
            if (ec->sync) {
                loss[step] = engine_step(e, batch).loss;
            } else {
                if (step == 0) engine_submit(e, batch);
                if (step + 1 < ENGINE_STEPS) engine_submit(e, batch + (size_t)B * (T + 1));
                loss[step] = engine_collect(e).loss;
            }
            // (after the second step: with the delayed update the third is in flight and its
            // memory all there, and its uploads were gated or not before this waits for the
            // optimizer)
            if (step == 1 && cuda) {
                engine_synchronize(e);
                for (int g = 0; g < ec->N && g < 8; g++) {
                    size_t fr = 0;
                    cuda_device_memory(g, &fr, &tot);
                    if (free0[g] > fr && free0[g] - fr > run.used) run.used = free0[g] - fr;
                }
            }
        }
        engine_synchronize(e);
        run.gated = engine_gated_stages(e);
        engine_free(e);
    }
    device_set_close(&devs);
    store_free(&s);
    model_free(&m);
    return run;
}

static void test_gpu_engine(TestCtx* t) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return;
    }
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, "test-qwen3", err);
    // big enough that the allocator's rounding is small next to the prediction
    c.V = 32000;
    c.C = 1024;
    c.L = 4;
    c.H = 8;
    c.KVH = 4;
    c.HD = 128;
    c.F = 3072;
    const int B = 8, T = 1024;
    Rng r;
    rng_seed(&r, 5);
    int32_t* tokens = malloc_check((size_t)ENGINE_STEPS * B * (T + 1) * sizeof(int32_t));
    for (int i = 0; i < ENGINE_STEPS * B * (T + 1); i++)
        tokens[i] = (int32_t)rng_below(&r, (uint64_t)c.V);
    const int N2 = cuda_device_count() >= 2 ? 2 : 1;
    const double small = 750.0 * (1 << 20);
    // the last three: a slow optimizer (uploads gated by host functions on the parameter stream),
    // split rounds, and a budget between one and two slot sets of the whole model (filled in from
    // case 0; it must stay last)
    GpuEngineCase cases[] = {
        {1, 4, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0},     {1, 4, 1, RECOMPUTE_STAGE, small, 0, 0, 0, 0},
        {1, 4, 0, RECOMPUTE_LAYER, small, 0, 0, 0, 0}, {N2, 4, 1, RECOMPUTE_STAGE, small, 0, 0, 0, 0},
        {N2, 4, 0, RECOMPUTE_STAGE, 0, 0, 0, 0, 0},    {N2, 4, 0, RECOMPUTE_STAGE, 0, 0, 20000, 0, 0},
        // split rounds (two GPUs): the same sums in another order, so the losses agree to
        // rounding rather than bit for bit
        {2, 4, 0, RECOMPUTE_STAGE, 0, 0, 0, 1, 0},
        // long-sequence mode: micro-batches computed in row chunks of 1024 tokens, the MLP in
        // chunks of 384 (uneven), lean activations, under a budget that forces 4 stages (checked
        // with --plan's search on this config: 540-620 MiB give 3-5 stages, 640 one): the memory
        // prediction of the recompute scratch
        {1, 4, 1, RECOMPUTE_STAGE, 580.0 * (1 << 20), 0, 0, 0, 384},
        {N2, 4, 0, RECOMPUTE_STAGE, 0, -1, 0, 0, 0},
    };
    const size_t n_cases = sizeof cases / sizeof cases[0];
    for (size_t k = 0; k < n_cases; k++) {
        GpuEngineCase* ec = &cases[k];
        if (ec->split && N2 < 2) continue;
        double lg[ENGINE_STEPS], lc[ENGINE_STEPS];
        const GpuEngineRun run = gpu_engine_run(t, &device_cuda_impl, &c, B, T, ec, tokens, lg);
        if (run.S < 0) continue;
        if (k == 0)  // one stage, two slot sets: budget the last case between one and two sets
            cases[n_cases - 1].total_bytes = (double)run.db.total - (double)run.db.slots / 4;
        gpu_engine_reference(&c, B, T, ec->M, !ec->sync, ec->mlp_chunk, tokens, lc);
        printf("  N %d M %d %s %s%s budget %s: S %d, %d slot set(s), %lld gated stages; losses "
               "engine %.5f %.5f %.5f, plain %.5f %.5f %.5f; device memory %.1f MiB used, %.1f "
               "MiB predicted\n",
               ec->N, ec->M, ec->sync ? "sync" : "delayed",
               ec->grain == RECOMPUTE_LAYER ? "layer" : "stage",
               ec->mlp_chunk > 0 ? " chunked-MLP" : "", ec->stage_bytes > 0 ? "small" : ec->total_bytes > 0 ? "one slot set" : "none",
               run.S, run.db.slot_sets, (long long)run.gated, lg[0], lg[1], lg[2], lc[0], lc[1],
               lc[2], run.used / 1048576.0, run.db.total / 1048576.0);
        for (int i = 0; i < ENGINE_STEPS; i++)
            CHECK(t, isfinite(lg[i]) && fabs(lg[i] - lc[i]) <= 2e-3 * fabs(lc[i]),
                  "case %zu step %d: engine loss %.6f vs plain %.6f", k, i, lg[i], lc[i]);
        if (ec->stage_bytes > 0)
            CHECK(t, run.S >= 3, "case %zu: the budget should force stages", k);
        if (ec->slow_opt_us > 0) CHECK(t, run.gated > 0, "case %zu: no gated upload", k);
        if (ec->total_bytes > 0)
            CHECK(t, run.S == 1 && run.db.slot_sets == 1, "case %zu: S %d, %d slot sets", k,
                  run.S, run.db.slot_sets);
        // the prediction bounds what the engine took (allocator rounding aside) and is not
        // far above it (the kernels' 64 MiB allowance aside)
        const size_t used = run.used, total = run.db.total;
        CHECK(t, used <= total + total / 20 + ((size_t)64 << 20),
              "case %zu: %zu bytes used, %zu predicted", k, used, total);
        CHECK(t, used + ((size_t)96 << 20) >= total - total / 10,
              "case %zu: %zu bytes used, far below the %zu predicted", k, used, total);
    }
    free(tokens);
}

// ----------------------------------------------------------------------------
// a training run: the engine on GPUs against the engine on emulated CPU devices
//
// The same model, data, schedule (plan, micro-batches, rounds, the one-step-delayed update, N)
// and optimizer on device_cuda_impl (bf16 compute with fp32 accumulation, the production
// kernels; head dim 128 runs the wgmma attention on Hopper) and on device_cpu_impl (ops_cpu,
// fp32), TRAIN_STEPS iterations. The test gpu_engine above compares few steps at a tolerance that
// training barely moves; this one asks what only training that happened shows:
//   1. the loss falls by a clear margin on both (the data is learnable: see train_tokens);
//   2. every step's loss is within TRAIN_LOSS_TOL (relative) of the CPU engine's;
//   3. the final fp32 weights differ from the CPU engine's by less than TRAIN_WEIGHT_TOL times
//      the distance the CPU engine moved them: ||w_gpu - w_cpu|| < 0.1 ||w_cpu - w_0||, over
//      the whole model and, with a looser TRAIN_TENSOR_TOL, per tensor (the attention
//      projections and qk-norm weights only train right if the attention backward is right).
// And it checks that those bounds would catch a run that did not train (asserted, not assumed):
// the initial weights, and the CPU engine's weights TRAIN_EARLY steps in, are beyond the weight
// bound; a loss curve stuck at its start or at step TRAIN_EARLY + 1 is beyond the loss bound.
//
// Tolerances. bf16 keeps 8 bits of mantissa (relative 2^-9) of every stored activation and of
// the weights a device computes with; AdamW normalises each element's step, so elements whose
// gradient is within rounding noise of zero take steps of either sign and the two runs drift
// apart like sqrt(steps) while training moves the weights like steps. Measured with emulated
// devices that round every op's output and weights to bf16 (a calibration outside the suite):
// losses within 1.7e-3 (relative) of fp32 at every step, final weights 0.017 of the change apart
// (0.03 for the worst tensor); the bounds leave about 6x for what that emulation does not model
// (the kernels' own summation orders, the attention's bf16 probabilities). The same emulation
// with the attention backward's q gradient halved failed the per-tensor bound (0.31, a norm
// weight); with no weight gradients from the matmuls it failed everything.

#define TRAIN_STEPS 20
#define TRAIN_EARLY 3
#define TRAIN_LOSS_TOL 1e-2    // per step, relative to the CPU engine's loss
#define TRAIN_MIN_FALL 0.4     // the last TRAIN_TAIL steps' mean loss is at least this fraction
#define TRAIN_TAIL 4           // below the first step's, on both
#define TRAIN_WEIGHT_TOL 0.1   // ||w_gpu - w_cpu|| / ||w_cpu - w_0||, whole model
#define TRAIN_TENSOR_TOL 0.2   // the same per tensor

static const AdamWHyper train_hyper = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
static const LrSchedule train_sched = {LR_COSINE, 1e-3f, 2, TRAIN_STEPS, 0.1f, 0.2f};

// TRAIN_STEPS batches of B sequences of T + 1 tokens that a few steps can learn: 64 of the V
// tokens (spread over the vocabulary), each followed by a fixed successor 3 times in 4 and by any
// of the 64 otherwise. The loss starts near ln V (6.2 at V 512) and can fall towards ~1.6 (the
// bigram entropy); the unigram part alone (ln 64 = 4.2) takes few AdamW steps.
static int32_t* train_tokens(int B, int T, int V) {
    enum { K = 64 };
    Rng r;
    rng_seed(&r, 2718);
    int32_t id[K], next[K];
    for (int k = 0; k < K; k++) {
        id[k] = (int32_t)((37 * k + 11) % V);
        next[k] = k;
    }
    for (int k = K - 1; k > 0; k--) {  // a random successor permutation
        const int j = (int)rng_below(&r, (uint64_t)k + 1);
        const int32_t x = next[k];
        next[k] = next[j];
        next[j] = x;
    }
    const size_t n = (size_t)TRAIN_STEPS * B * (T + 1);
    int32_t* tok = malloc_check(n * sizeof(int32_t));
    int cur = (int)rng_below(&r, K);
    for (size_t i = 0; i < n; i++) {
        if (i % (size_t)(T + 1) == 0 || rng_below(&r, 4) == 0) cur = (int)rng_below(&r, K);
        else cur = next[cur];
        tok[i] = id[cur];
    }
    return tok;
}

typedef struct TrainRun {
    int ok;                     // the engine was made and ran every step
    PartitionPlan plan;         // the plan it ran
    int row_chunks, slot_sets;
    double loss[TRAIN_STEPS];   // engine_collect's loss of each iteration
    float* w;                   // the fp32 weights after the last step (test_params_copy)
    float* w_early;             // want_early: the weights after early_steps steps (else NULL)
    int64_t early_steps;
    double seconds;
} TrainRun;

// TRAIN_STEPS iterations of the engine on n devices of impl, from the weights w0 (in
// test_params_copy's layout), with the delayed update as the trainer runs it (t + 1 submitted
// before t is collected). budget: EngineOptions.device_budget (the caller picks it per compute
// dtype so that both runs get the same plan; the test checks they did).
static TrainRun train_run(TestCtx* t, const DeviceImpl* impl, int n, const Model* m,
                          const float* w0, const int32_t* tokens, int B, int T, int M, int M_R,
                          double budget, int want_early) {
    TrainRun run;
    memset(&run, 0, sizeof run);
    char err[ERR_LEN];
    int64_t n_flat = 0;  // (the weights' count: the model's)
    Store s;
    store_create(&s, &m->tt);
    int64_t o = 0;
    for (int l = 0; l < m->tt.n_layers; l++) {
        memcpy(s.param[l], w0 + o, (size_t)m->tt.param_numel[l] * sizeof(float));
        o += m->tt.param_numel[l];
    }
    DeviceOptions dopt = {.threads = t->n_threads > 0 ? t->n_threads : 1};
    DeviceSet devs;
    device_set_open(&devs, impl, n, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M_R, .grain = RECOMPUTE_STAGE, .sync = 0,
                        .device_budget = budget, .opt_threads = 2, .trace_path = "",
                        .row_chunks = 1, .hyper = train_hyper, .sched = train_sched,
                        .grad_clip = 1.0f};
    const double t0 = time_now_s();
    Engine* e = engine_create(m, &s, &devs, &eo, err);
    CHECK(t, e != NULL, "engine_create (%s): %s", impl == &device_cuda_impl ? "cuda" : "cpu", err);
    if (e) {
        run.plan = *engine_plan(e);
        run.row_chunks = engine_row_chunks(e);
        run.slot_sets = engine_device_bytes(e).slot_sets;
        const size_t stride = (size_t)B * (T + 1);
        for (int step = 0; step < TRAIN_STEPS; step++) {
            if (step == 0) engine_submit(e, tokens);
            if (step + 1 < TRAIN_STEPS) engine_submit(e, tokens + (size_t)(step + 1) * stride);
            run.loss[step] = engine_collect(e).loss;
            if (want_early && step == TRAIN_EARLY - 1) {
                // (a wait changes when things run, never what they compute)
                engine_synchronize(e);
                run.early_steps = engine_steps_done(e);
                run.w_early = test_params_copy(m, &s, &n_flat);
            }
        }
        engine_synchronize(e);
        CHECK(t, engine_steps_done(e) == TRAIN_STEPS, "%lld optimizer steps applied, want %d",
              (long long)engine_steps_done(e), TRAIN_STEPS);
        run.w = test_params_copy(m, &s, &n_flat);
        run.ok = 1;
        engine_free(e);
    }
    run.seconds = time_now_s() - t0;
    device_set_close(&devs);
    store_free(&s);
    return run;
}

static int plans_equal(const PartitionPlan* a, const PartitionPlan* b) {
    if (a->n_layers != b->n_layers || a->n_fwd != b->n_fwd || a->n_bwd != b->n_bwd) return 0;
    for (int i = 0; i < a->n_fwd; i++)
        if (a->fwd[i].begin != b->fwd[i].begin || a->fwd[i].end != b->fwd[i].end) return 0;
    for (int i = 0; i < a->n_bwd; i++)
        if (a->bwd[i].begin != b->bwd[i].begin || a->bwd[i].end != b->bwd[i].end) return 0;
    return 1;
}

// A plan's ranges, "F[0,3) FB[3,5) B[2,3) B[0,2) ", into buf.
static const char* plan_text(const PartitionPlan* p, char* buf, size_t cap) {
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < p->n_fwd && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "F[%d,%d) ", p->fwd[i].begin,
                                 p->fwd[i].end);
    for (int i = 0; i < p->n_bwd && used < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s[%d,%d) ", i == 0 ? "FB" : "B",
                                 p->bwd[i].begin, p->bwd[i].end);
    return buf;
}

static double mean_tail(const double* loss) {
    double sum = 0.0;
    for (int i = TRAIN_STEPS - TRAIN_TAIL; i < TRAIN_STEPS; i++) sum += loss[i];
    return sum / TRAIN_TAIL;
}

static void test_gpu_engine_training(TestCtx* t) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return;
    }
    char err[ERR_LEN];
    ModelConfig c;
    CHECK(t, config_from_preset(&c, "test-qwen3", err) == 0, "%s", err);
    // Qwen3-style (qk-norm, tied head), GQA, head dim 128: the production attention kernels
    c.V = 512;
    c.C = 256;
    c.L = 3;
    c.H = 2;
    c.KVH = 1;
    c.HD = 128;
    c.F = 512;
    Model m;
    if (model_init(&m, &c, 0, err) != 0) {
        CHECK(t, 0, "model_init: %s", err);
        return;
    }
    // 4 sequences of 256 tokens (two 128-row query tiles each), one per micro-batch, in two
    // rounds of two; two devices when there are two GPUs (the CPU engine emulates as many)
    const int B = 4, T = 256, M = 4, M_R = 2;
    const int N = cuda_device_count() >= 2 ? 2 : 1;
    const int wgmma = attention_uses_wgmma(c.HD);
    int32_t* tokens = train_tokens(B, T, c.V);

    // the initial weights, rounded to bf16 so that both engines start from the same numbers
    Store s0;
    store_create(&s0, &m.tt);
    store_init_random(&s0, 31, 0.05f);
    store_round_bf16(&m, &s0);
    int64_t nw = 0;
    float* w0 = test_params_copy(&m, &s0, &nw);
    store_free(&s0);

    // a device budget that splits the model into four stages, F1 (embedding + blocks 0-1),
    // FB (block 2 + head), B2 (block 1), B3 (embedding + block 0): what every plan needs plus
    // stage room, one figure per compute dtype (bf16 parameters and activations take half the
    // room). engine_plan_print gives this plan for 21.8-30 MB of stage room on fp32 devices and
    // 13.8-19.2 MB on bf16 ones, N 1 or 2; the test checks that both engines ran it.
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M_R, .grain = RECOMPUTE_STAGE,
                        .row_chunks = 1};
    const double budget_f32 = (double)engine_fixed_device_bytes(&m, 4, &eo) + 25.5e6;
    const double budget_bf16 = (double)engine_fixed_device_bytes(&m, 2, &eo) + 16.3e6;
    TrainRun cpu = train_run(t, &device_cpu_impl, N, &m, w0, tokens, B, T, M, M_R, budget_f32, 1);
    TrainRun gpu = train_run(t, &device_cuda_impl, N, &m, w0, tokens, B, T, M, M_R, budget_bf16, 0);
    if (cpu.ok && gpu.ok) {
        // 0. the same schedule, and one that pipelines (several stages)
        char pc[512], pg[512];
        const int S = cpu.plan.n_fwd + cpu.plan.n_bwd;
        printf("  N %d, M %d in rounds of %d, S %d: cpu %s(%d slot sets), gpu %s(%d); wgmma "
               "attention %s; %.1f s cpu, %.1f s gpu\n", N, M, M_R, S,
               plan_text(&cpu.plan, pc, sizeof pc), cpu.slot_sets,
               plan_text(&gpu.plan, pg, sizeof pg), gpu.slot_sets,
               wgmma ? "used" : "not used", cpu.seconds, gpu.seconds);
        CHECK(t, plans_equal(&cpu.plan, &gpu.plan) && cpu.row_chunks == gpu.row_chunks,
              "different schedules: cpu %s(%d row chunks), gpu %s(%d)", pc, cpu.row_chunks, pg,
              gpu.row_chunks);
        CHECK(t, S == 4, "the budget should split the model into four stages (S %d)", S);
        if (cuda_device_capability(0) == 90 && strcmp(cuda_build_arch(), "sm_90a") == 0)
            CHECK(t, wgmma, "an sm_90a build on compute capability 9.0 must "
                  "run the wgmma attention at HD %d", c.HD);

        // 1. the loss falls on both, by a margin that the loss bound resolves many times over
        printf("  loss  step: cpu engine / gpu engine\n");
        for (int i = 0; i < TRAIN_STEPS; i++)
            if (i < 4 || i % 4 == 3)
                printf("  loss %5d: %.5f / %.5f\n", i + 1, cpu.loss[i], gpu.loss[i]);
        const double tail_c = mean_tail(cpu.loss), tail_g = mean_tail(gpu.loss);
        CHECK(t, tail_c <= (1.0 - TRAIN_MIN_FALL) * cpu.loss[0],
              "the CPU engine did not train: loss %.5f -> %.5f", cpu.loss[0], tail_c);
        CHECK(t, tail_g <= (1.0 - TRAIN_MIN_FALL) * gpu.loss[0],
              "the GPU engine did not train: loss %.5f -> %.5f", gpu.loss[0], tail_g);

        // 2. step by step, the GPU engine's loss follows the CPU engine's
        double worst = 0.0;
        for (int i = 0; i < TRAIN_STEPS; i++) {
            const double rel = fabs(gpu.loss[i] - cpu.loss[i]) / cpu.loss[i];
            CHECK(t, isfinite(gpu.loss[i]) && rel <= TRAIN_LOSS_TOL,
                  "step %d: gpu engine loss %.6f vs cpu engine %.6f (relative %.3g, tol %.3g)",
                  i + 1, gpu.loss[i], cpu.loss[i], rel, TRAIN_LOSS_TOL);
            if (!(rel <= worst)) worst = rel;
        }
        // the self-check: an untrained GPU run (its loss stuck at the first step's), or one that
        // trained TRAIN_EARLY steps and stopped, would be out of bounds at the last step
        const double last = cpu.loss[TRAIN_STEPS - 1];
        const double stuck0 = fabs(cpu.loss[0] - last) / last;
        const double stuck3 = fabs(cpu.loss[TRAIN_EARLY] - last) / last;
        printf("  loss: worst relative difference %.3g (tol %.3g); a run stuck at step 1 would "
               "be %.3g off at the end, stuck at step %d %.3g\n", worst, TRAIN_LOSS_TOL, stuck0,
               TRAIN_EARLY + 1, stuck3);
        CHECK(t, stuck0 > 4 * TRAIN_LOSS_TOL && stuck3 > 2 * TRAIN_LOSS_TOL,
              "self-check: the loss bound %.3g cannot tell training from none (stuck at step 1: "
              "%.3g, at step %d: %.3g)", TRAIN_LOSS_TOL, stuck0, TRAIN_EARLY + 1, stuck3);

        // 3. the final weights, against the distance training moved them
        const double change = l2_dist(cpu.w, w0, (size_t)nw);
        const double diff = l2_dist(gpu.w, cpu.w, (size_t)nw);
        const double gpu_change = l2_dist(gpu.w, w0, (size_t)nw);
        const double early = cpu.w_early ? l2_dist(cpu.w_early, cpu.w, (size_t)nw) : 0.0;
        printf("  weights: ||w_gpu - w_cpu|| / ||w_cpu - w_0|| = %.3g (tol %.3g); ||w_gpu - "
               "w_0|| / ||w_cpu - w_0|| = %.3g; the CPU engine's weights after %lld steps are "
               "%.3g away\n", diff / change, TRAIN_WEIGHT_TOL, gpu_change / change,
               (long long)cpu.early_steps, early / change);
        CHECK(t, change > 0 && diff <= TRAIN_WEIGHT_TOL * change,
              "final weights: gpu vs cpu engine %.4g, %.3g of the %.4g training moved them (tol "
              "%.3g)", diff, diff / change, change, TRAIN_WEIGHT_TOL);
        // the self-check: untrained weights and weights trained only TRAIN_EARLY steps would
        // fail the bound (by a factor of two at least)
        CHECK(t, l2_dist(w0, cpu.w, (size_t)nw) > 2 * TRAIN_WEIGHT_TOL * change,
              "self-check: the initial weights are within reach of the bound");
        CHECK(t, cpu.w_early != NULL && cpu.early_steps < TRAIN_STEPS / 2 &&
                     early > 2 * TRAIN_WEIGHT_TOL * change,
              "self-check: weights after %lld steps are %.3g of the change from the final ones, "
              "within reach of the bound %.3g", (long long)cpu.early_steps, early / change,
              TRAIN_WEIGHT_TOL);

        // per tensor: the same measure, looser (a small tensor's few elements are noisier)
        double worst_t = 0.0;
        const char* worst_name = "";
        for (int i = 0; i < m.tt.n; i++) {
            const TensorDesc* d = &m.tt.t[i];
            if (d->tied_to >= 0) continue;
            // its offset in test_params_copy's layout: the slabs before its own, then its place in
            // that slab (as store_param finds it)
            int64_t off = d->param_offset;
            for (int l = 0; l < d->owner_layer; l++) off += m.tt.param_numel[l];
            const double ch = l2_dist(cpu.w + off, w0 + off, (size_t)d->numel);
            const double df = l2_dist(gpu.w + off, cpu.w + off, (size_t)d->numel);
            CHECK(t, ch > 0 && df <= TRAIN_TENSOR_TOL * ch,
                  "%s: gpu vs cpu engine %.4g, %.3g of the %.4g training moved it (tol %.3g)",
                  d->name, df, ch > 0 ? df / ch : INFINITY, ch, TRAIN_TENSOR_TOL);
            if (ch > 0 && !(df / ch <= worst_t)) {
                worst_t = df / ch;
                worst_name = d->name;
            }
        }
        printf("  weights per tensor: worst %.3g (%s, tol %.3g)\n", worst_t, worst_name,
               TRAIN_TENSOR_TOL);
    }
    free(cpu.w);
    free(cpu.w_early);
    free(gpu.w);
    free(gpu.w_early);
    free(w0);
    free(tokens);
    model_free(&m);
}

#else  // no CUDA in this build

static void gpu_skipped(TestCtx* t) { test_skip(t, "built without CUDA"); }
static void test_gpu_device_and_memory(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_embedding(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_rmsnorm(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_matmul(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_qknorm_rope(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_attention(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_swiglu_add(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_crossentropy(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_determinism(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_model(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_parity(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_moe_model(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_engine(TestCtx* t) { gpu_skipped(t); }
static void test_gpu_engine_training(TestCtx* t) { gpu_skipped(t); }

#endif  // HAVE_CUDA

const TestCase tests_gpu[] = {
    {"gpu_device_and_memory", test_gpu_device_and_memory},
    {"gpu_embedding", test_gpu_embedding},
    {"gpu_rmsnorm", test_gpu_rmsnorm},
    {"gpu_matmul", test_gpu_matmul},
    {"gpu_qknorm_rope", test_gpu_qknorm_rope},
    {"gpu_attention", test_gpu_attention},
    {"gpu_swiglu_add", test_gpu_swiglu_add},
    {"gpu_crossentropy", test_gpu_crossentropy},
    {"gpu_determinism", test_gpu_determinism},
    {"gpu_model", test_gpu_model},
    {"gpu_parity", test_gpu_parity},
    {"gpu_moe_model", test_gpu_moe_model},
    {"gpu_engine", test_gpu_engine},
    {"gpu_engine_training", test_gpu_engine_training},
    {NULL, NULL},
};
