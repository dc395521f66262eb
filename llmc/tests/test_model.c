/*
 * test_model.c — the whole model on the CPU backend: finite-difference gradient checks of every
 * tensor for both families, recompute vs kept activations, micro-batch splits, thread-count
 * independence, and a short overfitting run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../adamw.h"
#include "../common.h"
#include "../model.h"
#include "../ops.h"
#include "../plain.h"
#include "../rng.h"
#include "../store.h"
#include "testing.h"


typedef struct Fixture {
    Model m;
    Store s;
    void* ctx;
    Plain* p;
    int B, T;
    int32_t* tokens;  // (B, T+1)
} Fixture;

static void fixture_init_chunked(Fixture* f, const ModelConfig* c, int B, int T, int threads,
                                 int recompute, uint32_t seed, int mlp_chunk) {
    char err[ERR_LEN];
    memset(f, 0, sizeof *f);
    if (model_init(&f->m, c, 0, err) != 0) fatal("model_init: %s", err);
    f->m.mlp_chunk = mlp_chunk;
    store_create(&f->s, &f->m.tt);
    store_init_random(&f->s, seed, 0.3f);
    // perturb the norms too, so their gradients are exercised
    Rng r;
    rng_seed(&r, seed + 1);
    for (int i = 0; i < f->m.tt.n; i++) {
        const TensorDesc* d = &f->m.tt.t[i];
        if (d->tied_to >= 0 || d->ndim != 1) continue;
        float* p = store_param(&f->s, i);
        for (int64_t j = 0; j < d->numel; j++) p[j] = 1.0f + 0.2f * rng_normal(&r);
    }
    f->ctx = ops_cpu_create(threads);
    f->p = plain_create(&f->m, &f->s, &ops_cpu, f->ctx, B, T, recompute);
    f->B = B;
    f->T = T;
    f->tokens = malloc_check((size_t)B * (T + 1) * sizeof(int32_t));
    for (int i = 0; i < B * (T + 1); i++) f->tokens[i] = (int32_t)rng_below(&r, (uint64_t)c->V);
}

static void fixture_init(Fixture* f, const ModelConfig* c, int B, int T, int threads, int recompute,
                         uint32_t seed) {
    fixture_init_chunked(f, c, B, T, threads, recompute, seed, 0);
}

static void fixture_free(Fixture* f) {
    plain_free(f->p);
    ops_cpu_destroy(f->ctx);
    store_free(&f->s);
    model_free(&f->m);
    free(f->tokens);
}

// Mean loss and (folded) gradients of the fixture's batch.
static double fixture_grads(Fixture* f) {
    const double N = (double)f->B * f->T;
    store_zero_grads(&f->s);
    double loss = plain_forward_backward(f->p, f->tokens, f->B, f->T, (float)(1.0 / N)) / N;
    store_fold_tied_grads(&f->s);
    return loss;
}

static double fixture_loss(Fixture* f) {
    return plain_forward_loss(f->p, f->tokens, f->B, f->T) / ((double)f->B * f->T);
}

// fixture_loss as test_central_difference's callback.
static double fixture_loss_probe(void* f) { return fixture_loss(f); }

// For every tensor: the directional derivative along d (mostly along the gradient, plus noise)
// by central differences must match g·d.
static void gradcheck(TestCtx* t, ModelFamily fam, int tied) {
    ModelConfig c = test_small_config(fam, tied);
    Fixture f;
    fixture_init(&f, &c, 2, 7, t->n_threads, 0, 11);
    fixture_grads(&f);
    Rng r;
    rng_seed(&r, 99);
    for (int i = 0; i < f.m.tt.n; i++) {
        const TensorDesc* d = &f.m.tt.t[i];
        if (d->tied_to >= 0) continue;
        const int64_t n = d->numel;
        float* p = store_param(&f.s, i);
        const float* g = store_grad(&f.s, i);
        const double gnorm = test_gradient_norm(g, n);
        CHECK(t, gnorm > 0 && isfinite(gnorm), "%s: gradient norm %g", d->name, gnorm);
        double analytic;
        double* dir = test_probe_direction(&r, g, n, gnorm, &analytic);
        double fd = test_central_difference(p, dir, n, 1e-2, fixture_loss_probe, &f);
        CHECK(t, fabs(fd - analytic) <= 1e-2 * fabs(analytic) + 2e-5,
              "%s %s: finite difference %.7g vs analytic %.7g", family_names[fam], d->name, fd,
              analytic);
        free(dir);
    }
    fixture_free(&f);
}

static void test_model_gradcheck_llama(TestCtx* t) { gradcheck(t, FAMILY_LLAMA, 0); }
static void test_model_gradcheck_qwen3_tied(TestCtx* t) { gradcheck(t, FAMILY_QWEN3, 1); }

// Copy of every gradient slab, for comparisons.
static float* grads_copy(const Fixture* f, int64_t* n_out) {
    int64_t n = 0;
    for (int l = 0; l < f->m.tt.n_layers; l++) n += f->m.tt.grad_numel[l];
    float* out = malloc_check((size_t)n * sizeof(float));
    int64_t o = 0;
    for (int l = 0; l < f->m.tt.n_layers; l++) {
        memcpy(out + o, f->s.grad[l], (size_t)f->m.tt.grad_numel[l] * sizeof(float));
        o += f->m.tt.grad_numel[l];
    }
    *n_out = n;
    return out;
}

static void test_model_recompute_and_threads(TestCtx* t) {
    ModelConfig c = test_small_config(FAMILY_QWEN3, 0);
    Fixture a, b, d;
    fixture_init(&a, &c, 3, 9, 1, 0, 5);
    fixture_init(&b, &c, 3, 9, 1, 1, 5);
    fixture_init(&d, &c, 3, 9, 3, 1, 5);
    double la = fixture_grads(&a), lb = fixture_grads(&b), ld = fixture_grads(&d);
    int64_t n;
    float* ga = grads_copy(&a, &n);
    float* gb = grads_copy(&b, &n);
    float* gd = grads_copy(&d, &n);
    CHECK(t, la == lb && memcmp(ga, gb, (size_t)n * sizeof(float)) == 0,
          "recompute changes results: %.9g vs %.9g", la, lb);
    CHECK(t, lb == ld && memcmp(gb, gd, (size_t)n * sizeof(float)) == 0,
          "1 vs 3 threads differ: %.9g vs %.9g", lb, ld);
    free(ga);
    free(gb);
    free(gd);
    fixture_free(&a);
    fixture_free(&b);
    fixture_free(&d);
}

static void test_model_microbatch_split(TestCtx* t) {
    ModelConfig c = test_small_config(FAMILY_LLAMA, 1);
    Fixture f;
    fixture_init(&f, &c, 4, 6, t->n_threads, 0, 21);
    double whole = fixture_grads(&f);
    int64_t n;
    float* g1 = grads_copy(&f, &n);
    // the same batch as 4 micro-batches of one sequence, each scaled by 1/(B*T)
    store_zero_grads(&f.s);
    double sum = 0;
    const float scale = 1.0f / (4.0f * 6.0f);
    for (int mb = 0; mb < 4; mb++)
        sum += plain_forward_backward(f.p, f.tokens + mb * 7, 1, 6, scale);
    store_fold_tied_grads(&f.s);
    float* g4 = grads_copy(&f, &n);
    CHECK(t, fabs(sum / 24.0 - whole) <= 1e-6 * whole, "loss %.9g vs %.9g", sum / 24.0, whole);
    double e = rel_l2_error(g4, g1, (size_t)n);
    CHECK(t, e <= 1e-5, "gradient relative error %.3g between 1 and 4 micro-batches", e);
    free(g1);
    free(g4);
    fixture_free(&f);
}

static void test_model_overfit_batch(TestCtx* t) {
    ModelConfig c = test_small_config(FAMILY_QWEN3, 1);
    Fixture f;
    fixture_init(&f, &c, 2, 12, t->n_threads, 0, 3);
    AdamWTensor opt[64];
    int n = store_adamw_tensors(&f.s, opt);
    AdamWHyper h = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.0f};
    ThreadPool* pool = threadpool_create(1);
    double first = 0, last = 0;
    for (int step = 1; step <= 60; step++) {
        double loss = fixture_grads(&f);
        if (step == 1) first = loss;
        last = loss;
        adamw_update(pool, opt, n, &h, NULL, 1.0f, step);
    }
    CHECK(t, last < 0.25 * first, "loss %.4f -> %.4f: a fixed batch must be memorised", first, last);
    threadpool_destroy(pool);
    fixture_free(&f);
}

// Long-sequence mode: the MLP in row chunks, its activations recomputed in the backward, and
// ln1, qkv_raw, qkv and h recomputed too (not saved). Same loss to the bit (the forward runs the same
// ops on the same rows), gradients equal up to the order of the weight-gradient sums, for uneven
// chunks, with and without recompute.
static void test_model_chunked_mlp(TestCtx* t) {
    for (int fam = 0; fam < 2; fam++) {
        ModelConfig c = test_small_config(fam ? FAMILY_QWEN3 : FAMILY_LLAMA, fam);
        Fixture a, b;
        fixture_init(&a, &c, 3, 9, t->n_threads, 0, 13);
        fixture_init_chunked(&b, &c, 3, 9, t->n_threads, fam, 13, 5);  // 27 rows: 5 x 5 + 2
        const BlockActs* ba = &b.p->ws->acts[0];
        CHECK(t, b.p->ws->mlp_chunk == 5 && ba->gu == NULL && ba->ln1 == NULL &&
                     ba->qkv_raw == NULL && ba->h == NULL && ba->qkv == NULL &&
                     ba->rstd_qk == NULL && ba->att != NULL && ba->lse != NULL && ba->rstd1 != NULL,
              "chunked workspace keeps only att, lse and rstd1");
        // per block: att (+ fp32 rstd1 and lse) of the unchunked ln1, qkv_raw, qkv, att, h, ln2,
        // gu, act (+ fp32)
        const size_t set_a = workspace_act_set_bytes(&a.m, 4, 3, 9);
        const size_t set_b = workspace_act_set_bytes(&b.m, 4, 3, 9);
        const size_t rows = 27, att = (size_t)c.H * c.HD;
        CHECK(t, set_b == rows * att * 4 + rows * 4 + (size_t)3 * c.H * 9 * 4 && set_b < set_a,
              "chunked act set %zu bytes (unchunked %zu)", set_b, set_a);
        double la = fixture_grads(&a), lb = fixture_grads(&b);
        CHECK(t, la == lb, "loss %.9g vs chunked %.9g", la, lb);
        int64_t n;
        float* ga = grads_copy(&a, &n);
        float* gb = grads_copy(&b, &n);
        double e = rel_l2_error(gb, ga, (size_t)n);
        CHECK(t, e <= 1e-6, "%s: gradient relative error %.3g with a chunked MLP", family_names[c.family], e);
        CHECK(t, workspace_bytes(&b.m, 4, 3, 9, 1) < workspace_bytes(&a.m, 4, 3, 9, 1),
              "chunking must shrink the workspace");
        free(ga);
        free(gb);
        fixture_free(&a);
        fixture_free(&b);
    }
}

const TestCase tests_model[] = {
    {"model_gradcheck_llama", test_model_gradcheck_llama},
    {"model_gradcheck_qwen3_tied", test_model_gradcheck_qwen3_tied},
    {"model_recompute_and_threads", test_model_recompute_and_threads},
    {"model_microbatch_split", test_model_microbatch_split},
    {"model_overfit_batch", test_model_overfit_batch},
    {"model_chunked_mlp", test_model_chunked_mlp},
    {NULL, NULL},
};
