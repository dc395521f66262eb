/*
 * test_parity.c — the fp32 CPU model against HF transformers fixtures (dev/parity/fixtures/<name>,
 * made by dev/parity/make_fixtures.py): loss, every gradient by HF name, and an 8-step AdamW
 * trajectory with clipping and the matrices-only decay rule.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../adamw.h"
#include "../common.h"
#include "../model.h"
#include "../ops.h"
#include "../plain.h"
#include "../safetensors.h"
#include "../store.h"
#include "testing.h"

static float meta_float(const StFile* f, const char* key) {
    const char* v = st_meta(f, key);
    double d = NAN;
    if (!v || parse_double(v, &d) != 0) return NAN;
    return (float)d;
}

static void parity_check(TestCtx* t, const char* name) {
    char err[ERR_LEN];
    ParityFixture f;
    if (test_parity_open(t, name, &f) != 0) return;
    const int B = f.B, T = f.T;

    void* ctx = ops_cpu_create(t->n_threads);
    Plain* p = plain_create(&f.m, &f.s, &ops_cpu, ctx, B, T, 0);
    const double N = (double)B * T;

    // loss and gradients
    store_zero_grads(&f.s);
    double loss = plain_forward_backward(p, f.tokens, B, T, (float)(1.0 / N)) / N;
    store_fold_tied_grads(&f.s);
    CHECK(t, fabs(loss - f.ref_loss) <= 1e-5 * fabs(f.ref_loss), "%s loss %.9g vs HF %.9g", name,
          loss, f.ref_loss);
    int n_grads = 0;
    test_check_fixture_grads(t, name, &f.m, &f.s, &f.ex, 1e-4, &n_grads, NULL);
    int n_expected = 0;
    for (int k = 0; k < f.ex.n_tensors; k++) n_expected += strncmp(f.ex.tensors[k].name, "grad.", 5) == 0;
    CHECK(t, n_grads == n_expected, "%s: compared %d of %d fixture gradients", name, n_grads,
          n_expected);

    // AdamW trajectory: loss before each of 8 updates on the same batch
    const StTensor* traj = st_find(&f.ex, "traj_loss");
    float ref_traj[8];
    CHECK(t, traj && traj->numel == 8 && st_tensor_to_f32(traj, ref_traj, 8, err) == 0,
          "traj_loss");
    AdamWTensor opt[64];
    int n_opt = store_adamw_tensors(&f.s, opt);
    AdamWHyper h = {meta_float(&f.ex, "lr"), meta_float(&f.ex, "beta1"), meta_float(&f.ex, "beta2"),
                    meta_float(&f.ex, "eps"), meta_float(&f.ex, "weight_decay")};
    float clip = meta_float(&f.ex, "grad_clip");
    CHECK(t, isfinite(h.lr) && isfinite(h.weight_decay) && isfinite(clip), "fixture metadata");
    ThreadPool* pool = threadpool_create(t->n_threads);
    double worst = 0;
    for (int step = 1; step <= 8; step++) {
        store_zero_grads(&f.s);
        double l = plain_forward_backward(p, f.tokens, B, T, (float)(1.0 / N)) / N;
        store_fold_tied_grads(&f.s);
        double diff = fabs(l - ref_traj[step - 1]);
        if (diff > worst) worst = diff;
        adamw_update(pool, opt, n_opt, &h, NULL, clip, step);
    }
    CHECK(t, worst <= 1e-4, "%s: AdamW trajectory differs by up to %.3g", name, worst);

    threadpool_destroy(pool);
    plain_free(p);
    ops_cpu_destroy(ctx);
    test_parity_close(&f);
}

static void test_parity_llama(TestCtx* t) { parity_check(t, "llama"); }
static void test_parity_qwen3(TestCtx* t) { parity_check(t, "qwen3"); }

const TestCase tests_parity[] = {
    {"parity_llama", test_parity_llama},
    {"parity_qwen3", test_parity_qwen3},
    {NULL, NULL},
};
