/*
 * test_grpo_engine.c — the policy-gradient objective (GRPO) through the RoundPipe engine's loss
 * head (EngineLoss, engine_submit_loss) on emulated CPU devices:
 *  - in process: with --sync the engine's losses, log-probs and weights are bit-identical to the
 *    plain path's policy steps (plain_policy_forward_backward per micro-batch, then AdamW) on 1-3
 *    devices, several stages, rows that are not computed (a partial and an empty micro-batch),
 *    with and without the KL term; the delayed update's first iteration is the same, and its
 *    later ones stay finite (they compute with weights one step behind). The names contain
 *    "engine", so the ThreadSanitizer suite runs them;
 *  - the CLI: --rl grpo --device cpu:N --sync 1 logs what --device cpu logs, step by step, and
 *    a resumed engine run (sync and delayed) logs its last step as the straight run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../adamw.h"
#include "../common.h"
#include "../device.h"
#include "../engine.h"
#include "../model.h"
#include "../plain.h"
#include "../rng.h"
#include "../store.h"
#include "../threads.h"
#include "testing.h"

#define PSTEPS 3

// ----------------------------------------------------------------------------
// the engine against the plain path, in process

// One step's batch: tokens (B, T+1), per-token targets (some positions untrained), behaviour and
// reference log-probs, advantages per row and the aggregation weights.
typedef struct PolicyBatch {
    int32_t* tokens;
    int32_t* tgt;
    float *old, *ref, *adv, *w;
} PolicyBatch;

static void batch_make(PolicyBatch* pb, int B, int T, int V, int rows, uint32_t seed) {
    Rng r;
    rng_seed(&r, seed);
    const size_t N = (size_t)B * T;
    pb->tokens = malloc_check((size_t)B * (T + 1) * sizeof(int32_t));
    pb->tgt = malloc_check(N * sizeof(int32_t));
    float** f[] = {&pb->old, &pb->ref, &pb->adv, &pb->w};
    for (int i = 0; i < 4; i++) *f[i] = calloc_check(N, sizeof(float));
    for (size_t i = 0; i < (size_t)B * (T + 1); i++) pb->tokens[i] = (int32_t)rng_below(&r, (uint64_t)V);
    for (int b = 0; b < B; b++) {
        const float A = rng_uniform(&r) < 0.5f ? -1.0f : 1.0f;
        for (int j = 0; j < T; j++) {
            const size_t o = (size_t)b * T + j;
            const int trained = b < rows && j % 3 != 0;
            pb->tgt[o] = trained ? pb->tokens[(size_t)b * (T + 1) + j + 1] : -1;
            // behaviour log-probs near the model's (about -log V), so some ratios clip
            pb->old[o] = trained ? -logf((float)V) + 0.6f * (rng_uniform(&r) - 0.5f) : 0.0f;
            pb->ref[o] = trained ? -logf((float)V) + 0.4f * (rng_uniform(&r) - 0.5f) : 0.0f;
            pb->adv[o] = trained ? A * (0.5f + rng_uniform(&r)) : 0.0f;
            pb->w[o] = trained ? 1.0f / (float)(rows * T) : 0.0f;
        }
    }
}

static void batch_free(PolicyBatch* pb) {
    free(pb->tokens);
    free(pb->tgt);
    free(pb->old);
    free(pb->ref);
    free(pb->adv);
    free(pb->w);
}

typedef struct PolicyRun {
    double loss[PSTEPS];
    float* logp[PSTEPS];   // (B, T)
    float* params;
    int64_t n_params;
} PolicyRun;

static void run_free(PolicyRun* r) {
    for (int s = 0; s < PSTEPS; s++) free(r->logp[s]);
    free(r->params);
}

static AdamWHyper pol_hyper(void) { return (AdamWHyper){3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f}; }
static LrSchedule pol_sched(void) { return (LrSchedule){LR_COSINE, 3e-3f, 1, PSTEPS, 0.1f, 0.2f}; }

static void params_of(PolicyRun* run, const Model* m, const Store* s) {
    int64_t n = 0;
    for (int l = 0; l < m->tt.n_layers; l++) n += m->tt.param_numel[l];
    run->params = malloc_check((size_t)n * sizeof(float));
    run->n_params = n;
    int64_t o = 0;
    for (int l = 0; l < m->tt.n_layers; l++) {
        memcpy(run->params + o, s->param[l], (size_t)m->tt.param_numel[l] * sizeof(float));
        o += m->tt.param_numel[l];
    }
}

static PolicyLoss policy_scalars(int kl) {
    return (PolicyLoss){.inv_temp = 1.0f / 0.9f, .clip_low = 0.2f, .clip_high = 0.28f,
                        .kl_beta = kl ? 0.05f : 0.0f};
}

// The plain path: micro-batches of Bm rows of the first `rows`, the policy objective's forward
// and backward each, then AdamW (as grpo.c's plain step).
static void run_plain(PolicyRun* run, const ModelConfig* c, int B, int T, int M, int rows,
                      const PolicyBatch* batches, int kl) {
    char err[ERR_LEN];
    Model m;
    if (model_init(&m, c, 0, err) != 0) fatal("%s", err);
    Store s;
    store_create(&s, &m.tt);
    store_init_random(&s, 7, 0.2f);
    void* ctx = ops_cpu_create(1);
    const int Bm = B / M;
    Plain* p = plain_create(&m, &s, &ops_cpu, ctx, Bm, T, 0);
    AdamWTensor* opt = malloc_check((size_t)m.tt.n * sizeof(AdamWTensor));
    const int n = store_adamw_tensors(&s, opt);
    ThreadPool* pool = threadpool_create(2);
    const size_t NB = (size_t)Bm * T;
    float* d[6];
    for (int i = 0; i < 6; i++) d[i] = ops_cpu.alloc(ctx, NB * sizeof(float));
    int32_t* ids = malloc_check(NB * sizeof(int32_t));
    const AdamWHyper hyper = pol_hyper();
    const LrSchedule sched = pol_sched();
    for (int step = 0; step < PSTEPS; step++) {
        const PolicyBatch* pb = &batches[step];
        run->logp[step] = calloc_check((size_t)B * T, sizeof(float));
        plain_sync_params(p);
        store_zero_grads(&s);
        double sum = 0.0;
        for (int mb = 0; mb < M; mb++) {
            const int first = mb * Bm, nb = imin(Bm, rows - first);
            if (nb <= 0) break;
            const size_t at = (size_t)first * T, N = (size_t)nb * T;
            for (int k = 0; k < nb; k++)
                memcpy(ids + (size_t)k * T, pb->tokens + (size_t)(first + k) * (T + 1),
                       (size_t)T * sizeof(int32_t));
            ops_cpu.upload(ctx, d[0], pb->old + at, N * sizeof(float));
            ops_cpu.upload(ctx, d[1], pb->ref + at, N * sizeof(float));
            ops_cpu.upload(ctx, d[2], pb->adv + at, N * sizeof(float));
            ops_cpu.upload(ctx, d[3], pb->w + at, N * sizeof(float));
            PolicyLoss pl = policy_scalars(kl);
            pl.old_logp = d[0];
            pl.ref_logp = kl ? d[1] : NULL;
            pl.adv = d[2];
            pl.weight = d[3];
            sum += plain_policy_forward_backward(p, ids, pb->tgt + at, &pl, d[4], d[5], 1, nb, T);
            ops_cpu.download(ctx, run->logp[step] + at, d[4], N * sizeof(float));
        }
        plain_sync_grads(p);
        store_fold_tied_grads(&s);
        adamw_update(pool, opt, n, &hyper, &sched, 1.0f, step + 1);
        run->loss[step] = sum;
    }
    params_of(run, &m, &s);
    for (int i = 0; i < 6; i++) ops_cpu.free(ctx, d[i]);
    free(ids);
    threadpool_destroy(pool);
    free(opt);
    plain_free(p);
    ops_cpu_destroy(ctx);
    store_free(&s);
    model_free(&m);
}

typedef struct PolicyCase {
    int N, M_R, sync;
    RecomputeGrain grain;
    double budget;  // device bytes for the stages (small: several stages)
} PolicyCase;

// The engine: the same batches through engine_submit_loss. -1 when it could not be built.
static int run_engine_policy(TestCtx* t, PolicyRun* run, const ModelConfig* c, int B, int T,
                             int M, int rows, const PolicyBatch* batches, int kl,
                             const PolicyCase* pc) {
    char err[ERR_LEN];
    Model m;
    if (model_init(&m, c, 0, err) != 0) fatal("%s", err);
    Store s;
    store_create(&s, &m.tt);
    store_init_random(&s, 7, 0.2f);
    DeviceSet devs;
    const DeviceOptions dopt = {.threads = 1, .delay_seed = 5, .max_delay_us = 40};
    device_set_open(&devs, &device_cpu_impl, pc->N, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = pc->M_R, .grain = pc->grain,
                        .sync = pc->sync, .device_budget = pc->budget, .opt_threads = 1,
                        .row_chunks = 1, .trace_path = "", .policy = 1, .hyper = pol_hyper(),
                        .sched = pol_sched(), .grad_clip = 1.0f};
    if (pc->budget > 0) eo.device_budget += (double)engine_fixed_device_bytes(&m, 4, &eo);
    Engine* e = engine_create(&m, &s, &devs, &eo, err);
    CHECK(t, e != NULL, "engine_create: %s", err);
    int S = -1;
    if (e) {
        // the memory model covers the policy buffers
        const EngineDeviceBytes db = engine_device_bytes(e);
        for (int g = 0; g < pc->N; g++) {
            DeviceStats st;
            device_cpu_impl.stats(devs.dev[g], &st);
            CHECK(t, st.mem_in_use == db.slots + db.handoff,
                  "device %d holds %zu bytes, predicted %zu", g, st.mem_in_use,
                  db.slots + db.handoff);
        }
        const PolicyLoss sc = policy_scalars(kl);
        for (int step = 0; step < PSTEPS; step++) {
            const PolicyBatch* pb = &batches[step];
            const EngineLoss L = {.targets = pb->tgt, .old_logp = pb->old,
                                  .ref_logp = kl ? pb->ref : NULL, .adv = pb->adv,
                                  .weight = pb->w, .inv_temp = sc.inv_temp,
                                  .clip_low = sc.clip_low, .clip_high = sc.clip_high,
                                  .kl_beta = sc.kl_beta, .rows = rows};
            engine_submit_loss(e, pb->tokens, &L);
            const EngineStepResult r = engine_collect(e);
            run->loss[step] = r.loss;
            run->logp[step] = malloc_check((size_t)B * T * sizeof(float));
            CHECK(t, r.logp != NULL, "no log-probs collected");
            if (r.logp) memcpy(run->logp[step], r.logp, (size_t)B * T * sizeof(float));
        }
        engine_synchronize(e);
        // the weight sync's source (grpo_sync): the masters of the last step applied hold the
        // Store's weights bit for bit (fp32 devices: copies); with the delayed update the next
        // iteration's are one step behind them
        int latest_same = 1, next_differs = 0;
        for (int l = 0; l < m.tt.n_layers; l++) {
            const int64_t n = m.tt.state_numel[l], off = m.tt.param_numel[l] - n;
            const size_t bytes = (size_t)n * sizeof(float);
            latest_same &= memcmp(engine_latest_weights(e, l), s.param[l] + off, bytes) == 0;
            next_differs |= memcmp(engine_next_weights(e, l), s.param[l] + off, bytes) != 0;
        }
        CHECK(t, latest_same, "N=%d sync %d: engine_latest_weights is not the Store's weights",
              pc->N, pc->sync);
        CHECK(t, next_differs == !pc->sync, "N=%d sync %d: the next iteration's weights %s the "
              "Store's", pc->N, pc->sync, next_differs ? "differ from" : "equal");
        S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
        params_of(run, &m, &s);
        engine_free(e);
    }
    device_set_close(&devs);
    store_free(&s);
    model_free(&m);
    return S;
}

static void test_engine_policy_matches_plain(TestCtx* t) {
    const int B = 8, T = 12, M = 4, rows = 5;  // micro-batches of 2 rows: 2, 2, 1 and none
    for (int tied = 0; tied <= 1; tied++) {
        const ModelConfig c = test_engine_config(tied);
        PolicyBatch batches[PSTEPS];
        for (int s = 0; s < PSTEPS; s++) batch_make(&batches[s], B, T, c.V, rows, 11 + s + tied);
        for (int kl = 0; kl <= 1; kl++) {
            PolicyRun ref;
            run_plain(&ref, &c, B, T, M, rows, batches, kl);
            const PolicyCase cases[] = {
                {1, 4, 1, RECOMPUTE_STAGE, 0},
                {2, 4, 1, RECOMPUTE_STAGE, 2.4e5},
                {3, 2, 1, RECOMPUTE_LAYER, 2.4e5},
                {3, 1, 1, RECOMPUTE_STAGE, 2.4e5},
            };
            for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
                PolicyRun r;
                memset(&r, 0, sizeof r);
                const int S = run_engine_policy(t, &r, &c, B, T, M, rows, batches, kl, &cases[k]);
                if (S < 0) continue;
                int same = r.n_params == ref.n_params &&
                           memcmp(r.params, ref.params, (size_t)r.n_params * sizeof(float)) == 0;
                for (int s = 0; s < PSTEPS; s++)
                    same &= r.loss[s] == ref.loss[s] &&
                            memcmp(r.logp[s], ref.logp[s], (size_t)B * T * sizeof(float)) == 0;
                CHECK(t, same,
                      "tied %d kl %d N=%d M_R=%d grain %d (S=%d): losses %.9g %.9g %.9g, plain "
                      "%.9g %.9g %.9g: not bit-identical", tied, kl, cases[k].N, cases[k].M_R,
                      cases[k].grain, S, r.loss[0], r.loss[1], r.loss[2], ref.loss[0],
                      ref.loss[1], ref.loss[2]);
                if (cases[k].budget > 0) CHECK(t, S >= 3, "the budget should force stages (S=%d)", S);
                run_free(&r);
            }
            // the delayed update: iteration 0 computes with the initial weights as plain's
            // step 1; later iterations one step behind (finite, different)
            const PolicyCase delayed = {2, 4, 0, RECOMPUTE_STAGE, 2.4e5};
            PolicyRun d;
            memset(&d, 0, sizeof d);
            if (run_engine_policy(t, &d, &c, B, T, M, rows, batches, kl, &delayed) >= 0) {
                CHECK(t, d.loss[0] == ref.loss[0] &&
                             memcmp(d.logp[0], ref.logp[0], (size_t)B * T * sizeof(float)) == 0,
                      "delayed: the first iteration %.9g vs plain %.9g", d.loss[0], ref.loss[0]);
                for (int s = 1; s < PSTEPS; s++)
                    CHECK(t, isfinite(d.loss[s]) && fabs(d.loss[s] - ref.loss[s]) < 0.05,
                          "delayed step %d: %.9g vs plain %.9g", s, d.loss[s], ref.loss[s]);
                run_free(&d);
            }
            run_free(&ref);
        }
        for (int s = 0; s < PSTEPS; s++) batch_free(&batches[s]);
    }
}

// ----------------------------------------------------------------------------
// the CLI: --rl grpo through the engine

// The value of "key" in the JSON-lines log record of step `step` ("" when absent).
static void log_value(const char* log, int step, const char* key, char* out, size_t cap) {
    char want[64];
    snprintf(want, sizeof want, "{\"step\":%d,\"loss\"", step);
    out[0] = '\0';
    const char* rec = NULL;
    for (const char* s = log; s && (s = strstr(s, want)) != NULL; s++) rec = s;  // the last one
    if (!rec) return;
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char* v = strstr(rec, k);
    const char* end = strchr(rec, '\n');
    if (!v || (end && v > end)) return;
    v += strlen(k);
    size_t n = strcspn(v, ",}");
    if (n >= cap) n = cap - 1;
    memcpy(out, v, n);
    out[n] = '\0';
}

// A reward command scoring each answer by its line's length (deterministic per answer, so
// groups have spread and a resumed run's process scores as the straight one's did).
static int reward_script(TestCtx* t, char* path, size_t cap) {
    test_path(t, path, cap, "grpo_engine_reward.sh");
    FILE* f = fopen(path, "w");
    CHECK(t, f != NULL, "cannot write %s", path);
    if (!f) return -1;
    fputs("#!/bin/sh\nwhile IFS= read -r line; do echo $(( ${#line} % 3 )); done\n", f);
    fclose(f);
    return 0;
}

#define GRPO_ENGINE_FLAGS                                                                        \
    "--rl grpo --seq 16 --rl-prompts 4 --rl-group 4 --batch 4 --rl-max-tokens 4 --rl-eval 2 "   \
    "--threads 2 --sample-tokens 0 --lr 1e-3 --warmup 1 --schedule constant --row-chunks 1 "     \
    "--rl-eval-every 0"

static const char* const LOG_KEYS[] = {"loss", "reward", "norm", "ratio", "clip_frac", "kl",
                                        "accuracy"};

// Step by step, every key of LOG_KEYS the same in two logs (a key missing in both is fine).
static void logs_equal(TestCtx* t, const char* what, const char* a, const char* b, int from,
                       int to) {
    for (int s = from; s <= to; s++)
        for (size_t k = 0; k < sizeof LOG_KEYS / sizeof LOG_KEYS[0]; k++) {
            char va[64], vb[64];
            log_value(a, s, LOG_KEYS[k], va, sizeof va);
            log_value(b, s, LOG_KEYS[k], vb, sizeof vb);
            CHECK(t, strcmp(va, vb) == 0 && (k > 0 || va[0]), "%s: step %d %s: %s vs %s", what,
                  s, LOG_KEYS[k], va, vb);
        }
}

static void test_grpo_engine_cli_matches_plain(TestCtx* t) {
    char script[512], args[4096], logp[512], logs[3][512];
    if (reward_script(t, script, sizeof script) != 0) return;
    test_path(t, logp, sizeof logp, "grpo_engine_plain.jsonl");
    snprintf(args, sizeof args, "%s --steps 3 --kl-beta 0.05 --reward-cmd 'sh %s' --log '%s'",
             GRPO_ENGINE_FLAGS, script, logp);
    int rc = test_run_cli(t, "grpo_engine_plain", args);
    CHECK(t, rc == 0, "plain run exited %d", rc);
    char* plain = test_read_file(logp, NULL);
    for (int n = 1; n <= 3; n++) {
        char tag[64];
        snprintf(tag, sizeof tag, "grpo_engine_cpu%d", n);
        test_path(t, logs[n - 1], sizeof logs[0], n == 1 ? "ge1.jsonl" : n == 2 ? "ge2.jsonl"
                                                                                : "ge3.jsonl");
        snprintf(args, sizeof args, "%s --steps 3 --kl-beta 0.05 --reward-cmd 'sh %s' --log '%s' "
                 "--device cpu:%d --sync 1", GRPO_ENGINE_FLAGS, script, logs[n - 1], n);
        rc = test_run_cli(t, tag, args);
        char* out = test_read_output(t, tag, "out");
        CHECK(t, rc == 0 && out && strstr(out, "device cpu:"), "%s: exit %d: %s", tag, rc,
              out ? out : "");
        free(out);
        char* eng = test_read_file(logs[n - 1], NULL);
        logs_equal(t, tag, plain, eng, 1, 3);
        free(eng);
    }
    free(plain);
}

// Resumed from a checkpoint after step 2, an engine run logs steps 3-4 as the straight run
// (sync and the delayed update, whose pending weights the checkpoint keeps).
static void test_grpo_engine_cli_resume(TestCtx* t) {
    char script[512], args[4096];
    if (reward_script(t, script, sizeof script) != 0) return;
    for (int sync = 0; sync <= 1; sync++) {
        char la[512], lb[512], dir[512], tag[64];
        test_path(t, la, sizeof la, sync ? "gr_s_a.jsonl" : "gr_d_a.jsonl");
        test_path(t, lb, sizeof lb, sync ? "gr_s_b.jsonl" : "gr_d_b.jsonl");
        test_path(t, dir, sizeof dir, sync ? "gr_s_ck" : "gr_d_ck");
        snprintf(tag, sizeof tag, "grpo_engine_resume%d", sync);
        snprintf(args, sizeof args, "%s --steps 4 --reward-cmd 'sh %s' --log '%s' --device cpu:2 "
                 "--sync %d", GRPO_ENGINE_FLAGS, script, la, sync);
        int rc = test_run_cli(t, tag, args);
        CHECK(t, rc == 0, "%s: straight run exited %d", tag, rc);
        snprintf(args, sizeof args, "%s --steps 2 --save-every 2 --out '%s' --reward-cmd 'sh %s' "
                 "--device cpu:2 --sync %d", GRPO_ENGINE_FLAGS, dir, script, sync);
        rc = test_run_cli(t, tag, args);
        CHECK(t, rc == 0, "%s: first half exited %d", tag, rc);
        snprintf(args, sizeof args, "%s --steps 4 --resume --out '%s' --reward-cmd 'sh %s' "
                 "--log '%s' --device cpu:2 --sync %d", GRPO_ENGINE_FLAGS, dir, script, lb, sync);
        rc = test_run_cli(t, tag, args);
        char* out = test_read_output(t, tag, "out");
        CHECK(t, rc == 0, "%s: resumed half exited %d: %s", tag, rc, out ? out : "");
        free(out);
        char* a = test_read_file(la, NULL);
        char* b = test_read_file(lb, NULL);
        logs_equal(t, tag, a, b, 3, 4);
        free(a);
        free(b);
    }
}

const TestCase tests_grpo_engine[] = {
    {"engine_policy_matches_plain", test_engine_policy_matches_plain},
    {"grpo_engine_cli_matches_plain", test_grpo_engine_cli_matches_plain},
    {"grpo_engine_cli_resume", test_grpo_engine_cli_resume},
    {NULL, NULL},
};
