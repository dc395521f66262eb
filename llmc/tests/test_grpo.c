/*
 * test_grpo.c — GRPO on the CPU: the decode attention against the full attention, the
 * generation engine against a forward per token, the policy-gradient op against finite
 * differences and a reference written out here, and (CLI) runs of --rl grpo that learn.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../generate.h"
#include "../model.h"
#include "../ops.h"
#include "../plain.h"
#include "../rng.h"
#include "../store.h"
#include "testing.h"

static void fill_normal(float* x, size_t n, Rng* r, float scale) {
    for (size_t i = 0; i < n; i++) x[i] = rng_normal(r) * scale;
}

// ----------------------------------------------------------------------------
// decode attention

// Each row t of a causal attention (plain, or with sinks and a window) equals one decode step of
// query t against keys 0..t held in a cache slot.
static void test_grpo_decode_attention_matches_full(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    const int T = 9, H = 4, KVH = 2, HD = 8, QKV = (H + 2 * KVH) * HD, KD = KVH * HD;
    const int maxT = 12, slots = 3;
    Rng r;
    rng_seed(&r, 5);
    float* qkv = malloc_check((size_t)T * QKV * sizeof(float));
    float* full = malloc_check((size_t)T * H * HD * sizeof(float));
    float* dec = malloc_check((size_t)T * H * HD * sizeof(float));
    float* lse = malloc_check((size_t)H * T * sizeof(float));
    float* kc = calloc_check((size_t)slots * maxT * KD, sizeof(float));
    float* vc = calloc_check((size_t)slots * maxT * KD, sizeof(float));
    float sinks[4] = {0.3f, -1.0f, 0.8f, 0.0f};
    fill_normal(qkv, (size_t)T * QKV, &r, 1.0f);
    for (int j = 0; j < T; j++) {  // slot 2 holds the keys and values
        memcpy(kc + ((size_t)2 * maxT + j) * KD, qkv + (size_t)j * QKV + H * HD, KD * sizeof(float));
        memcpy(vc + ((size_t)2 * maxT + j) * KD, qkv + (size_t)j * QKV + (H + KVH) * HD,
               KD * sizeof(float));
    }
    for (int variant = 0; variant < 2; variant++) {
        const int window = variant ? 3 : 0;
        const float* s = variant ? sinks : NULL;
        if (variant) ops_cpu.attention_sink_forward(ctx, full, lse, qkv, s, 1, T, H, KVH, HD, window);
        else ops_cpu.attention_forward(ctx, full, lse, qkv, 1, T, H, KVH, HD);
        // all T query rows in one call, each with its own key count
        int32_t slot[9], len[9];
        for (int i = 0; i < T; i++) {
            slot[i] = 2;
            len[i] = i + 1;
        }
        ops_cpu.attention_decode(ctx, dec, qkv, kc, vc, slot, len, s, T, maxT, H, KVH, HD, window);
        const double err = rel_l2_error(dec, full, (size_t)T * H * HD);
        CHECK(t, err < 1e-5, "variant %d: decode vs full attention rel err %.3g", variant, err);
    }
    free(qkv);
    free(full);
    free(dec);
    free(lse);
    free(kc);
    free(vc);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// the generation engine

// log softmax(logits / temperature)[tok], in double.
static double ref_logp(const float* logits, int V, float temperature, int tok) {
    double mx = -INFINITY, sum = 0.0;
    for (int v = 0; v < V; v++) mx = fmax(mx, (double)logits[v] / temperature);
    for (int v = 0; v < V; v++) sum += exp((double)logits[v] / temperature - mx);
    return (double)logits[tok] / temperature - mx - log(sum);
}

// Two groups of two sequences, prompts of different lengths: every sampled token's logp_full
// equals the log-softmax of a full forward over its prefix (plain_logits_last), the sampling is
// repeatable per seed, and each sequence's budget is kept; for every family (GQA, qk-norm, MoE,
// GPT-OSS sinks and windows).
static void test_grpo_generate_matches_forward(TestCtx* t) {
    const char* presets[] = {"test-llama", "test-qwen3", "test-qwen3moe", "test-gptoss"};
    for (size_t k = 0; k < sizeof presets / sizeof presets[0]; k++) {
        ModelConfig cfg;
        char err[ERR_LEN];
        Model m;
        if (config_from_preset(&cfg, presets[k], err) != 0 || model_init(&m, &cfg, 0, err) != 0) {
            CHECK(t, 0, "%s: %s", presets[k], err);
            continue;
        }
        Store s;
        store_create(&s, &m.tt);
        store_init_random(&s, 11, 0.3f);  // peaked distributions: sampling differences show
        void* ctx = ops_cpu_create(t->n_threads);
        const int maxT = 16, V = cfg.V;
        Plain* p = plain_create(&m, &s, &ops_cpu, ctx, 1, maxT, 0);
        Generator g;
        const GenOptions go = {.max_seqs = 4, .max_len = maxT, .temperature = 0.9f, .top_k = 0,
                               .top_p = 1.0f};
        CHECK(t, gen_create(&g, &m, &ops_cpu, ctx, &go, 1, err) == 0, "%s", err);
        gen_load_weights(&g, &s, 3);
        int32_t toks[2][4][16];
        float lp[4][32];
        GenSeq seqs[4];
        for (int run = 0; run < 2; run++) {
            for (int i = 0; i < 4; i++) {
                const int P = i < 2 ? 3 : 6;
                for (int j = 0; j < P; j++) toks[run][i][j] = (7 * (i / 2) + 5 * j + 1) % V;
                seqs[i] = (GenSeq){.tokens = toks[run][i], .logp = lp[i], .logp_full = lp[i] + 16,
                                   .prompt_len = P, .max_new = i == 1 ? 4 : 20, .stop_a = -1,
                                   .stop_b = -1};
                rng_seed(&seqs[i].rng, 100 + i);
            }
            gen_run(&g, seqs, 4, 2);
        }
        CHECK(t, memcmp(toks[0], toks[1], sizeof toks[0]) == 0, "%s: same seeds, other tokens",
              presets[k]);
        float* logits = malloc_check((size_t)V * sizeof(float));
        double worst = 0.0;
        for (int i = 0; i < 4; i++) {
            const GenSeq* q = &seqs[i];
            CHECK(t, q->version == 3, "%s: version %lld", presets[k], (long long)q->version);
            CHECK(t, q->len == (i == 1 ? q->prompt_len + 4 : maxT), "%s: seq %d len %d",
                  presets[k], i, q->len);
            for (int j = q->prompt_len; j < q->len; j++) {
                plain_logits_last(p, q->tokens, j, logits);
                const double want = ref_logp(logits, V, go.temperature, q->tokens[j]);
                worst = fmax(worst, fabs(want - q->logp_full[j]));
                CHECK(t, q->logp[j] == q->logp_full[j], "no top-k/p: the same log-prob");
            }
        }
        CHECK(t, worst < 2e-4, "%s: sampled log-probs vs a full forward: max |diff| %.3g",
              presets[k], worst);
        free(logits);
        gen_free(&g);
        plain_free(p);
        ops_cpu_destroy(ctx);
        store_free(&s);
        model_free(&m);
    }
}

// Top-k / top-p: the sampled token is always inside the kept set and its log-prob is the
// renormalised one; greedy is the argmax with log-prob 0.
static void test_grpo_sample_topk_topp(TestCtx* t) {
    ModelConfig cfg;
    char err[ERR_LEN];
    Model m;
    CHECK(t, config_from_preset(&cfg, "test-llama", err) == 0 && model_init(&m, &cfg, 0, err) == 0,
          "%s", err);
    const int V = cfg.V;
    Generator g = {.m = &m, .o = {.temperature = 1.0f, .top_k = 3, .top_p = 1.0f}};
    g.probs = malloc_check((size_t)V * 16);
    float logits[96];
    for (int v = 0; v < V; v++) logits[v] = -(float)v * 0.1f;  // token 0 most likely
    Rng r;
    rng_seed(&r, 1);
    double z = 0.0;
    for (int v = 0; v < 3; v++) z += exp(logits[v]);
    int ok = 1;
    for (int i = 0; i < 200; i++) {
        float lp, lpf;
        const int tok = gen_sample(&g, logits, &r, &lp, &lpf);
        ok &= tok < 3 && fabs(lp - (logits[tok] - log(z))) < 1e-5 &&
              fabs(lpf - ref_logp(logits, V, 1.0f, tok)) < 1e-5;
    }
    CHECK(t, ok, "top-k 3: a token outside the top 3 or a wrong log-prob");
    g.o.top_k = 0;
    g.o.top_p = 0.05f;  // token 0 alone has more than 5% of the mass
    float lp, lpf;
    CHECK(t, gen_sample(&g, logits, &r, &lp, &lpf) == 0 && lp == 0.0f, "top-p: %g", (double)lp);
    g.o.temperature = 0.0f;
    CHECK(t, gen_sample(&g, logits, &r, &lp, &lpf) == 0 && lp == 0.0f, "greedy");
    free(g.probs);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// the policy-gradient op

// The op's per-token objective written out in double (ops.h), for the finite differences.
static double ref_policy_loss(const float* z, int V, int y, double old, double ref, double A,
                              double w, double inv_temp, double cl, double ch, double beta) {
    double mx = -INFINITY, sum = 0.0;
    for (int v = 0; v < V; v++) mx = fmax(mx, z[v] * inv_temp);
    for (int v = 0; v < V; v++) sum += exp(z[v] * inv_temp - mx);
    const double lp = z[y] * inv_temp - mx - log(sum);
    const double r = exp(lp - old), rc = fmin(fmax(r, 1 - cl), 1 + ch);
    const double d = ref - lp;
    return w * (-fmin(r * A, rc * A) + beta * (exp(d) - d - 1));
}

// Gradient of the op against central differences of the reference objective, on tokens with
// the ratio inside the clip range, clipped above (A > 0) and below (A < 0), masked (weight 0)
// and ignored (target -1); the op's logp and losses against the reference.
static void test_grpo_policy_op_gradient(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    enum { n = 6, V = 13 };
    Rng r;
    rng_seed(&r, 9);
    float z[n * V], g[n * V], logp[n], loss[n], old[n], ref[n], adv[n], w[n];
    int32_t y[n] = {3, 0, 12, 5, -1, 7};
    const double ratio[n] = {1.1, 1.6, 0.5, 0.9, 1.0, 1.02};  // π_θ / π_old wanted per token
    const float A[n] = {0.8f, 1.2f, -0.7f, -1.1f, 1.0f, 0.5f}, W[n] = {0.2f, 0.3f, 0.25f, 0.0f,
                                                                        0.1f, 0.4f};
    const float inv_temp = 1.0f / 0.7f, cl = 0.2f, ch = 0.28f, beta = 0.05f;
    fill_normal(z, n * V, &r, 1.5f);
    for (int i = 0; i < n; i++) {
        const int yy = y[i] < 0 ? 0 : y[i];
        double mx = -INFINITY, sum = 0.0;
        for (int v = 0; v < V; v++) mx = fmax(mx, z[i * V + v] * inv_temp);
        for (int v = 0; v < V; v++) sum += exp(z[i * V + v] * inv_temp - mx);
        const double lp = z[i * V + yy] * inv_temp - mx - log(sum);
        old[i] = (float)(lp - log(ratio[i]));
        ref[i] = (float)(lp + 0.3 * rng_normal(&r));
        adv[i] = A[i];
        w[i] = W[i];
    }
    memcpy(g, z, sizeof z);
    ops_cpu.policy_forward_backward(ctx, g, logp, loss, y, old, ref, adv, w, n, V, inv_temp, cl,
                                    ch, beta, 1);
    double worst = 0.0, worst_loss = 0.0;
    for (int i = 0; i < n; i++) {
        if (y[i] < 0) {
            CHECK(t, loss[i] == 0.0f && logp[i] == 0.0f, "ignored token: loss %g", (double)loss[i]);
            continue;
        }
        const double want = ref_policy_loss(z + i * V, V, y[i], old[i], ref[i], adv[i], w[i],
                                            inv_temp, cl, ch, beta);
        worst_loss = fmax(worst_loss, fabs(want - loss[i]));
        for (int v = 0; v < V; v++) {
            float zp[V], zm[V];
            memcpy(zp, z + i * V, sizeof zp);
            memcpy(zm, z + i * V, sizeof zm);
            const float h = 1e-3f;
            zp[v] += h;
            zm[v] -= h;
            const double fd = (ref_policy_loss(zp, V, y[i], old[i], ref[i], adv[i], w[i], inv_temp,
                                               cl, ch, beta) -
                               ref_policy_loss(zm, V, y[i], old[i], ref[i], adv[i], w[i], inv_temp,
                                               cl, ch, beta)) /
                              (2.0 * h);
            worst = fmax(worst, fabs(fd - g[i * V + v]));
        }
    }
    CHECK(t, worst_loss < 1e-5, "losses vs the reference: max |diff| %.3g", worst_loss);
    CHECK(t, worst < 2e-4, "gradient vs finite differences: max |diff| %.3g", worst);
    // clipped tokens carry only the KL's gradient; without KL none at all
    ops_cpu.policy_forward_backward(ctx, memcpy(g, z, sizeof z), logp, loss, y, old, NULL, adv, w,
                                    n, V, inv_temp, cl, ch, 0.0f, 1);
    double clipped = 0.0;
    for (int v = 0; v < V; v++) clipped += fabs(g[1 * V + v]) + fabs(g[2 * V + v]) + fabs(g[3 * V + v]);
    CHECK(t, clipped == 0.0, "clipped / masked tokens have a gradient: %g", clipped);
    ops_cpu_destroy(ctx);
}

const TestCase tests_grpo[] = {
    {"grpo_decode_attention_matches_full", test_grpo_decode_attention_matches_full},
    {"grpo_generate_matches_forward", test_grpo_generate_matches_forward},
    {"grpo_sample_topk_topp", test_grpo_sample_topk_topp},
    {"grpo_policy_op_gradient", test_grpo_policy_op_gradient},
    {NULL, NULL},
};
