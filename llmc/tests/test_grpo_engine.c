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
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../adamw.h"
#include "../args.h"
#include "../checkpoint.h"
#include "../comm.h"
#include "../common.h"
#include "../config.h"
#include "../dataloader.h"
#include "../device.h"
#include "../engine.h"
#include "../grpo.h"
#include "../model.h"
#include "../plain.h"
#include "../rng.h"
#include "../store.h"
#include "../threads.h"
#include "../trainer.h"
#include "../weightsync.h"
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
    run->params = test_params_copy(&m, &s, &run->n_params);
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
        run->params = test_params_copy(&m, &s, &run->n_params);
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
            test_log_value(a, s, LOG_KEYS[k], va, sizeof va);
            test_log_value(b, s, LOG_KEYS[k], vb, sizeof vb);
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

// Resumed from a checkpoint after step 2, a run logs steps 3-4 as the straight run: on the engine
// on-policy with the synchronous update, and one step off with the delayed update (whose pending
// weights the checkpoint keeps; on-policy GRPO refuses the delayed update); on the plain path one
// step off. One step off, the checkpoint keeps the answers generated ahead for step 3
// (rl_state.bin): their weights are gone by then.
static void test_grpo_engine_cli_resume(TestCtx* t) {
    char script[512], args[4096];
    if (reward_script(t, script, sizeof script) != 0) return;
    const struct { const char* name; const char* flags; } runs[] = {
        {"sync", "--device cpu:2 --sync 1 --off-policy 0"},
        {"delayed", "--device cpu:2 --sync 0 --off-policy 1"},
        {"plain", "--off-policy 1"},
    };
    for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
        char la[512], lb[512], dir[512], tag[64], name[96];
        snprintf(tag, sizeof tag, "grpo_resume_%s", runs[k].name);
        snprintf(name, sizeof name, "%s_a.jsonl", tag);
        test_path(t, la, sizeof la, name);
        snprintf(name, sizeof name, "%s_b.jsonl", tag);
        test_path(t, lb, sizeof lb, name);
        snprintf(name, sizeof name, "%s_ck", tag);
        test_path(t, dir, sizeof dir, name);
        snprintf(args, sizeof args, "%s --steps 4 --reward-cmd 'sh %s' --log '%s' %s",
                 GRPO_ENGINE_FLAGS, script, la, runs[k].flags);
        int rc = test_run_cli(t, tag, args);
        CHECK(t, rc == 0, "%s: straight run exited %d", tag, rc);
        snprintf(args, sizeof args, "%s --steps 2 --save-every 2 --out '%s' --reward-cmd 'sh %s' "
                 "%s", GRPO_ENGINE_FLAGS, dir, script, runs[k].flags);
        rc = test_run_cli(t, tag, args);
        CHECK(t, rc == 0, "%s: first half exited %d", tag, rc);
        snprintf(args, sizeof args, "%s --steps 4 --resume --out '%s' --reward-cmd 'sh %s' "
                 "--log '%s' %s", GRPO_ENGINE_FLAGS, dir, script, lb, runs[k].flags);
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

// ----------------------------------------------------------------------------
// the split schedule (--rollout-gpus K)

// The split schedule logs what the colocated run logs, step by step, where the math says it
// must: --sync 1, on-policy and one step off (the rollout of step t+1 on v_{t-1} while step t
// trains), one and two rollout devices (the answers divided by prompt: each has its own
// sampler); the staleness stays within --max-staleness; the step line shows the sync and the
// broadcast.
static void test_grpo_engine_split_matches_colocated(TestCtx* t) {
    char script[512], args[4096];
    if (reward_script(t, script, sizeof script) != 0) return;
    for (int off = 0; off <= 1; off++) {
        char lc[512], tag[64];
        test_path(t, lc, sizeof lc, off ? "gs_c1.jsonl" : "gs_c0.jsonl");
        snprintf(tag, sizeof tag, "grpo_engine_split_col%d", off);
        snprintf(args, sizeof args, "%s --steps 4 --kl-beta 0.05 --reward-cmd 'sh %s' --log '%s' "
                 "--device cpu:1 --sync 1 --off-policy %d", GRPO_ENGINE_FLAGS, script, lc, off);
        int rc = test_run_cli(t, tag, args);
        CHECK(t, rc == 0, "%s: exited %d", tag, rc);
        char* col = test_read_file(lc, NULL);
        for (int K = 1; K <= 2; K++) {
            char ls[512], name[80];
            snprintf(tag, sizeof tag, "grpo_engine_split%d_%d", K, off);
            snprintf(name, sizeof name, "%s.jsonl", tag);
            test_path(t, ls, sizeof ls, name);
            snprintf(args, sizeof args, "%s --steps 4 --kl-beta 0.05 --reward-cmd 'sh %s' "
                     "--log '%s' --device cpu:%d --rollout-gpus %d --sync 1 --off-policy %d",
                     GRPO_ENGINE_FLAGS, script, ls, K + 1, K, off);
            rc = test_run_cli(t, tag, args);
            char* out = test_read_output(t, tag, "out");
            CHECK(t, rc == 0 && out && strstr(out, "split schedule") &&
                         strstr(out, "weight sync:") &&
                         (K == 1 || strstr(out, "broadcast to 1 more rollout devices")),
                  "%s: exit %d: %s", tag, rc, out ? out : "");
            free(out);
            char* split = test_read_file(ls, NULL);
            logs_equal(t, tag, col, split, 1, 4);
            for (int s = 1; s <= 4; s++) {
                char v[64];
                test_log_value(split, s, "staleness", v, sizeof v);
                CHECK(t, atoi(v) <= off, "%s: step %d staleness %s", tag, s, v);
            }
            free(split);
        }
        free(col);
    }
}

// Resumed from a checkpoint after step 2, a split run logs steps 3-4 as the straight split run:
// on-policy with the synchronous update, and one step off with the delayed update, whose
// checkpoint keeps the batch the rollout devices generated ahead for step 3 (rl_state.bin).
static void test_grpo_engine_split_resume(TestCtx* t) {
    char script[512], args[4096];
    if (reward_script(t, script, sizeof script) != 0) return;
    for (int off = 0; off <= 1; off++) {
        char la[512], lb[512], dir[512], split[128], tag[32];
        test_path(t, la, sizeof la, off ? "gsr_a1.jsonl" : "gsr_a0.jsonl");
        test_path(t, lb, sizeof lb, off ? "gsr_b1.jsonl" : "gsr_b0.jsonl");
        test_path(t, dir, sizeof dir, off ? "gsr_ck1" : "gsr_ck0");
        snprintf(split, sizeof split, "--device cpu:3 --rollout-gpus 2 --off-policy %d --sync %d",
                 off, !off);
        snprintf(tag, sizeof tag, "split resume, off %d", off);
        snprintf(args, sizeof args, "%s --steps 4 --reward-cmd 'sh %s' --log '%s' %s",
                 GRPO_ENGINE_FLAGS, script, la, split);
        int rc = test_run_cli(t, "grpo_engine_split_resume", args);
        CHECK(t, rc == 0, "off %d: straight run exited %d", off, rc);
        snprintf(args, sizeof args, "%s --steps 2 --save-every 2 --out '%s' --reward-cmd 'sh %s' "
                 "%s", GRPO_ENGINE_FLAGS, dir, script, split);
        rc = test_run_cli(t, "grpo_engine_split_resume", args);
        CHECK(t, rc == 0, "off %d: first half exited %d", off, rc);
        snprintf(args, sizeof args, "%s --steps 4 --resume --out '%s' --reward-cmd 'sh %s' "
                 "--log '%s' %s", GRPO_ENGINE_FLAGS, dir, script, lb, split);
        rc = test_run_cli(t, "grpo_engine_split_resume", args);
        CHECK(t, rc == 0, "off %d: resumed half exited %d", off, rc);
        char* a = test_read_file(la, NULL);
        char* b = test_read_file(lb, NULL);
        logs_equal(t, tag, a, b, 3, 4);
        free(a);
        free(b);
    }
}

// --rollout-gpus refusals: one clear line, a non-zero exit.
static void test_grpo_engine_split_refusals(TestCtx* t) {
    const char* bad[][2] = {
        {"--rollout-gpus 1", "needs --device cuda or cpu:N"},
        {"--rollout-gpus 2 --device cpu:2", "at least one training device"},
        {"--rollout-gpus 5 --device cpu:6", "at most that many"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char args[1024];
        snprintf(args, sizeof args, "%s --steps 1 %s", GRPO_ENGINE_FLAGS, bad[i][0]);
        const int rc = test_run_cli(t, "grpo_split_bad", args);
        char* e = test_read_output(t, "grpo_split_bad", "err");
        CHECK(t, rc != 0 && e && test_one_error_line(e, bad[i][1]), "'%s': exit %d, %s",
              bad[i][0], rc, e ? e : "");
        free(e);
    }
}

// The manifest: packed and unpacked unchanged; a receiver refuses a sender whose tensor differs
// in shape or dtype, or is missing, naming it; the broadcast over emulated devices places each
// tensor by name (a receiver whose layout lists the tensors in another order gets them where
// its own manifest says).
static void test_engine_weight_manifest_broadcast(TestCtx* t) {
    const ModelConfig c = test_engine_config(0);
    char err[ERR_LEN];
    Model m;
    if (model_init(&m, &c, 0, err) != 0) fatal("%s", err);
    WeightManifest a, b;
    weight_manifest_build(&a, &m.tt, 4);
    void* packed = malloc_check(weight_manifest_bytes(&a));
    weight_manifest_pack(&a, packed);
    CHECK(t, weight_manifest_unpack(&b, packed, weight_manifest_bytes(&a), err) == 0, "%s", err);
    CHECK(t, b.n == a.n && a.n > 4 && memcmp(a.e, b.e, (size_t)a.n * sizeof(WeightEntry)) == 0,
          "the manifest changed on its way (%d vs %d tensors)", b.n, a.n);
    CHECK(t, weight_manifest_check(&a, &b, err) == 0, "%s", err);
    const int k = a.n / 2;
    b.e[k].shape[0]++;
    CHECK(t, weight_manifest_check(&a, &b, err) != 0 && strstr(err, a.e[k].name) &&
                 strstr(err, "is sent as"), "a shape mismatch: %s", err);
    b.e[k].shape[0]--;
    b.e[k].dtype = 2;
    CHECK(t, weight_manifest_check(&a, &b, err) != 0 && strstr(err, a.e[k].name) &&
                 strstr(err, "bf16"), "a dtype mismatch: %s", err);
    b.e[k].dtype = 4;
    snprintf(b.e[k].name, sizeof b.e[k].name, "layers.99.nothing");
    CHECK(t, weight_manifest_check(&a, &b, err) != 0 && strstr(err, a.e[k].name),
          "a missing tensor: %s", err);
    CHECK(t, weight_manifest_unpack(&b, packed, 3, err) != 0, "3 bytes taken for a manifest");
    free(packed);
    weight_manifest_free(&b);

    // three emulated devices; in rank 2's layout the first two tensors of a block trade places
    const int K = 3, NL = m.tt.n_layers;
    DeviceSet devs;
    device_set_open(&devs, &device_cpu_impl, K, NULL);
    WeightManifest mine[3];
    for (int r = 0; r < K; r++) weight_manifest_build(&mine[r], &m.tt, 4);
    int sw = 0;
    while (sw + 1 < a.n && mine[2].e[sw].layer != mine[2].e[sw + 1].layer) sw++;
    CHECK(t, sw + 1 < a.n, "no slab with two tensors");
    if (sw + 1 < a.n) {
        WeightEntry* e0 = &mine[2].e[sw];
        WeightEntry* e1 = &mine[2].e[sw + 1];
        const int64_t off0 = e0->offset;
        e1->offset = off0;
        e0->offset = off0 + e1->numel;
    }
    void** slabs[3];
    for (int r = 0; r < K; r++) {
        slabs[r] = calloc_check((size_t)NL, sizeof(void*));
        for (int l = 0; l < NL; l++) {
            slabs[r][l] = calloc_check((size_t)(m.tt.param_numel[l] + 1), sizeof(float));
            if (r == 0)
                for (int64_t i = 0; i < m.tt.param_numel[l]; i++)
                    ((float*)slabs[0][l])[i] = (float)(l * 100000 + i);
        }
    }
    WeightBcast wb;
    int rc = weight_bcast_open(&wb, &device_cpu_impl, devs.dev, NULL, K, 10.0, err);
    CHECK(t, rc == 0, "weight_bcast_open: %s", err);
    if (rc == 0) rc = weight_bcast_manifest(&wb, &a, mine, err);
    CHECK(t, rc == 0, "weight_bcast_manifest: %s", err);
    int64_t want = 0;
    for (int i = 0; i < a.n; i++) want += a.e[i].numel * 4;
    const int64_t got = rc == 0 ? weight_bcast_run(&wb, (void* const* const*)slabs, err) : -1;
    CHECK(t, got == want, "broadcast %lld bytes, want %lld: %s", (long long)got,
          (long long)want, err);
    int placed = 1;
    for (int r = 1; r < K && got > 0; r++)
        for (int i = 0; i < a.n; i++) {
            const WeightEntry* s = &a.e[i];
            const WeightEntry* d = &mine[r].e[i];  // (built in the same order: same index)
            placed &= memcmp((float*)slabs[r][d->layer] + d->offset,
                             (float*)slabs[0][s->layer] + s->offset,
                             (size_t)s->numel * sizeof(float)) == 0;
        }
    CHECK(t, placed, "a receiver's tensors are not where its manifest puts them");
    weight_bcast_close(&wb);
    // a receiver whose layout does not match refuses before any weight moves
    mine[1].e[1].shape[0] += 1;
    rc = weight_bcast_open(&wb, &device_cpu_impl, devs.dev, NULL, K, 10.0, err);
    if (rc == 0) rc = weight_bcast_manifest(&wb, &a, mine, err);
    CHECK(t, rc != 0 && strstr(err, "rollout device 1") && strstr(err, a.e[1].name),
          "a mismatched receiver: %s", err);
    weight_bcast_close(&wb);
    for (int r = 0; r < K; r++) {
        for (int l = 0; l < NL; l++) free(slabs[r][l]);
        free(slabs[r]);
        weight_manifest_free(&mine[r]);
    }
    device_set_close(&devs);
    weight_manifest_free(&a);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// the broadcast across processes: one rank per thread, as rollout ranks of their own would be

typedef struct XRank {
    CommEmulWorld* world;
    int rank, world_n;
    WeightRole role;
    Device* dev;
    const WeightManifest* mine;
    void** slabs;        // (n_layers) this rank's, device memory of dev
    int64_t got;         // bytes received (-1: failed)
    int manifest_rc;
    char err[ERR_LEN];
} XRank;

static void* xrank_main(void* arg) {
    XRank* x = arg;
    x->got = -1;
    CommInit in = {.rank = x->rank, .world = x->world_n, .timeout_s = 10.0, .local = x->world};
    Comm* c = comm_emul_impl.init(&in, x->err);
    if (!c) return NULL;
    const CommStream st = {.impl = &device_cpu_impl, .dev = x->dev, .stream = STREAM_COMPUTE};
    WeightRank wr;
    x->manifest_rc = weight_rank_manifest(&wr, c, &st, 0, x->role, x->mine, x->err);
    if (x->manifest_rc == 0) {
        x->got = weight_rank_run(&wr, x->slabs, x->err);
        weight_rank_close(&wr);
    }
    comm_destroy(c);
    return NULL;
}

// Three ranks in one communicator: rank 0 sends (the trainer rank), rank 1 passes (another
// trainer rank), rank 2 receives (a rollout rank) in a layout whose first two tensors of a slab
// trade places. Every tensor lands where rank 2's manifest puts its name, rank 1's slabs stay
// untouched; then rank 2's layout differs in a shape and every rank refuses with the same line
// naming rank 2 and the tensor, before any weight moves.
static void test_engine_weight_rank_broadcast(TestCtx* t) {
    const ModelConfig c = test_engine_config(0);
    char err[ERR_LEN];
    Model m;
    if (model_init(&m, &c, 0, err) != 0) fatal("%s", err);
    const int W = 3, NL = m.tt.n_layers;
    WeightManifest mine[3];
    for (int r = 0; r < W; r++) weight_manifest_build(&mine[r], &m.tt, 4);
    const WeightManifest* a = &mine[0];
    int sw = 0;
    while (sw + 1 < a->n && mine[2].e[sw].layer != mine[2].e[sw + 1].layer) sw++;
    CHECK(t, sw + 1 < a->n, "no slab with two tensors");
    if (sw + 1 < a->n) {
        WeightEntry* e0 = &mine[2].e[sw];
        WeightEntry* e1 = &mine[2].e[sw + 1];
        const int64_t off0 = e0->offset;
        e1->offset = off0;
        e0->offset = off0 + e1->numel;
    }
    DeviceSet devs;
    device_set_open(&devs, &device_cpu_impl, W, NULL);
    void** slabs[3];
    for (int r = 0; r < W; r++) {
        slabs[r] = calloc_check((size_t)NL, sizeof(void*));
        for (int l = 0; l < NL; l++) {
            const size_t bytes = (size_t)(m.tt.param_numel[l] + 1) * sizeof(float);
            slabs[r][l] = device_cpu_impl.alloc(devs.dev[r], bytes);
            float* f = slabs[r][l];
            for (int64_t i = 0; i <= m.tt.param_numel[l]; i++)
                f[i] = r == 0 ? (float)(l * 100000 + i) : -1.0f;
        }
    }
    int64_t want = 0;
    for (int i = 0; i < a->n; i++) want += a->e[i].numel * 4;
    for (int round = 0; round < 2; round++) {
        if (round == 1) mine[2].e[1].shape[0] += 1;
        CommEmulWorld* w = comm_emul_world_create(W);
        XRank x[3];
        pthread_t th[3];
        const WeightRole roles[3] = {WEIGHT_SEND, WEIGHT_PASS, WEIGHT_RECV};
        for (int r = 0; r < W; r++) {
            x[r] = (XRank){.world = w, .rank = r, .world_n = W, .role = roles[r],
                           .dev = devs.dev[r], .mine = roles[r] == WEIGHT_PASS ? NULL : &mine[r],
                           .slabs = slabs[r]};
            pthread_check(pthread_create(&th[r], NULL, xrank_main, &x[r]));
        }
        for (int r = 0; r < W; r++) pthread_check(pthread_join(th[r], NULL));
        comm_emul_world_destroy(w);
        if (round == 0) {
            for (int r = 0; r < W; r++)
                CHECK(t, x[r].got == want, "rank %d: %lld bytes, want %lld: %s", r,
                      (long long)x[r].got, (long long)want, x[r].err);
            int placed = 1, untouched = 1;
            for (int i = 0; i < a->n; i++) {
                const WeightEntry* s = &a->e[i];
                const WeightEntry* d = &mine[2].e[i];  // (built in the same order: same index)
                placed &= memcmp((float*)slabs[2][d->layer] + d->offset,
                                 (float*)slabs[0][s->layer] + s->offset,
                                 (size_t)s->numel * sizeof(float)) == 0;
            }
            for (int l = 0; l < NL; l++)
                for (int64_t i = 0; i <= m.tt.param_numel[l]; i++)
                    untouched &= ((float*)slabs[1][l])[i] == -1.0f;
            CHECK(t, placed, "the rollout rank's tensors are not where its manifest puts them");
            CHECK(t, untouched, "the passing rank's weights changed");
        } else {
            for (int r = 0; r < W; r++)
                CHECK(t, x[r].manifest_rc != 0 && strstr(x[r].err, "rank 2") &&
                             strstr(x[r].err, a->e[1].name) && !strchr(x[r].err, '\n') &&
                             strcmp(x[r].err, x[0].err) == 0,
                      "rank %d of a mismatched receiver: %s", r, x[r].err);
        }
    }
    for (int r = 0; r < W; r++) {
        for (int l = 0; l < NL; l++) device_cpu_impl.free(devs.dev[r], slabs[r][l]);
        free(slabs[r]);
        weight_manifest_free(&mine[r]);
    }
    device_set_close(&devs);
    model_free(&m);
}


// ----------------------------------------------------------------------------
// rollout ranks (--rl-rollout-ranks R): one trainer rank and R rollout ranks, one thread each
// over the communicator's emulation, as the processes of a launched world would be

#define XR_STEPS 4
#define XR_MAX_W 4

typedef struct XrRank {
    const TrainArgs* a;
    const Model* m;          // this rank's model (a rollout rank may get one of another shape)
    CommEmulWorld* w;        // NULL: colocated, no communicator (the reference)
    int rank, world;
    int n_devices;           // the trainer: 0 plain training, N the engine over cpu:N
    int first, last;         // steps trained (first > 1: resumed from out/step_{first - 1})
    int save_at;             // a checkpoint after this step (0: none)
    const char* out;
    const char* shard;
    CommFault fault;         // a rollout rank: injected at its at_op-th op
    uint64_t fault_at;
    double timeout_s;        // the communicator's (0: 10 s)
    double loss[XR_STEPS + 1], reward[XR_STEPS + 1], ratio[XR_STEPS + 1], len[XR_STEPS + 1];
    int64_t version[XR_STEPS + 1];
    int staleness[XR_STEPS + 1];
    float* params;           // the trainer's weights after the last step
    int64_t n_params;
    int gen_cap;             // the trainer's generator's sequences
    double accuracy;         // its held-out accuracy after the last step
    int rc;
    char err[ERR_LEN];
} XrRank;

static EngineOptions xr_engine_options(const TrainArgs* a, int use_cuda, int n_devices,
                                       int64_t start_step) {
    (void)use_cuda;
    (void)n_devices;
    // (as train_roundpipe.c's for --rl: every answer of a step, micro-batches of --batch rows)
    const int B = a->rl.prompts * a->rl.group;
    return (EngineOptions){.B = B, .T = a->seq, .M = B / a->batch, .row_chunks = 1,
                           .sync = a->sync, .opt_threads = 1, .trace_path = "",
                           .start_step = start_step, .policy = 1,
                           .hyper = {a->lr, a->beta1, a->beta2, a->eps, a->weight_decay},
                           .sched = {a->schedule, a->lr, a->warmup, a->steps, a->min_lr_frac,
                                     a->decay_frac},
                           .grad_clip = a->grad_clip};
}

// The trainer rank (or, without a world, the colocated run): train_roundpipe.c's GRPO loop.
static void xr_trainer(XrRank* k) {
    const TrainArgs* a = k->a;
    char* args_json = args_to_json(a);
    Store s;
    store_create(&s, &k->m->tt);
    store_init_random(&s, a->seed, 0.02f);
    TrainState ts;
    train_state_init(&ts, a->seed);
    DataLoader train;
    k->rc = dataloader_open(&train, k->shard, a->batch, a->seq, 0, a->seed, k->m->cfg.V, k->err);
    const int opened = k->rc == 0;
    if (k->rc == 0 && k->first > 1) {
        char dir[1200];
        snprintf(dir, sizeof dir, "%s/step_%d", k->out, k->first - 1);
        k->rc = checkpoint_load_state(dir, k->m, &s, &ts, args_json, k->err);
        ts.resumed = 1;
        if (k->rc == 0) k->rc = dataloader_state_restore(&train, ts.train_loader, k->err);
    }
    Comm* c = NULL;
    if (k->rc == 0 && k->w) {
        CommInit in = {.rank = 0, .world = k->world,
                       .timeout_s = k->timeout_s > 0 ? k->timeout_s : 10.0, .local = k->w};
        c = comm_emul_impl.init(&in, k->err);
        if (!c) k->rc = -1;
    }
    Trainer tr;
    int made_tr = 0, made_g = 0;
    if (k->rc == 0)
        k->rc = trainer_create(&tr, a, k->m, &s, &ts, k->n_devices, xr_engine_options, k->err);
    made_tr = k->rc == 0;
    const GrpoSplit split = {.impl = &device_cpu_impl, .first = 0, .opt = {.threads = 1},
                             .timeout_s = 10.0, .R = k->world - 1, .comm = c};
    Grpo g;
    if (k->rc == 0)
        k->rc = grpo_create(&g, a, k->m, &s, tr.plain, NULL, k->first - 1, 0.0, c ? &split : NULL,
                            k->err);
    made_g = k->rc == 0;
    if (made_g) k->gen_cap = g.gen.o.max_seqs;
    if (k->rc == 0 && ts.rl_state_bytes && a->rl.off_policy)
        k->rc = grpo_state_restore(&g, ts.rl_state, ts.rl_state_bytes, k->first - 1, k->err);
    train_state_free_rl(&ts);
    for (int step = k->first; k->rc == 0 && step <= k->last; step++) {
        grpo_rollout(&g, step);
        const StepStats st = grpo_train(&g, &tr, step);
        grpo_sync(&g, step);
        k->loss[step] = st.loss;
        k->reward[step] = g.st.reward_mean;
        k->ratio[step] = g.st.ratio_mean;
        k->len[step] = g.st.answer_len;
        k->version[step] = g.st.version;
        k->staleness[step] = g.st.staleness;
        if (step == k->save_at) {
            size_t bytes = 0;
            void* rl_state = grpo_state_pack(&g, step, &bytes);
            ts.rl_state = rl_state;
            ts.rl_state_bytes = bytes;
            k->rc = trainer_save_checkpoint(&tr, &train, step, args_json, k->err);
            ts.rl_state = NULL;
            ts.rl_state_bytes = 0;
            free(rl_state);
        }
    }
    if (k->rc == 0) k->accuracy = grpo_evaluate(&g);
    if (made_g) grpo_free(&g);  // (tells the rollout ranks to stop)
    if (made_tr && k->rc == 0) k->rc = trainer_finish(&tr, k->err);
    if (k->rc == 0) k->params = test_params_copy(k->m, &s, &k->n_params);
    if (made_tr) trainer_free(&tr);
    comm_destroy(c);
    if (opened) dataloader_close(&train);
    train_state_free(&ts);
    store_free(&s);
    free(args_json);
}

// A rollout rank: the CLI's serve_rollouts on an emulated device of its own.
static void xr_rollout(XrRank* k) {
    CommInit in = {.rank = k->rank, .world = k->world,
                   .timeout_s = k->timeout_s > 0 ? k->timeout_s : 10.0, .local = k->w};
    Comm* c = comm_emul_impl.init(&in, k->err);
    if (!c) {
        k->rc = -1;
        return;
    }
    if (k->fault != COMM_FAULT_NONE) comm_emul_inject(c, k->fault, k->fault_at);
    const GrpoSplit where = {.impl = &device_cpu_impl, .first = k->rank, .opt = {.threads = 1},
                             .timeout_s = 10.0, .R = k->world - 1, .comm = c};
    k->rc = grpo_serve(k->a, k->m, &where, k->err);
    comm_destroy(c);
}

static void* xr_main(void* arg) {
    XrRank* k = arg;
    if (k->rank == 0) xr_trainer(k);
    else xr_rollout(k);
    return NULL;
}

// The ranks of one run (ranks[0] the trainer; world 1: the colocated run, no communicator),
// their output kept out of the report.
static void xr_run(XrRank* ranks, int world) {
    CommEmulWorld* w = world > 1 ? comm_emul_world_create(world) : NULL;
    pthread_t th[XR_MAX_W];
    const int saved = test_stdout_mute();
    for (int r = 0; r < world; r++) {
        ranks[r].w = w;
        ranks[r].rank = r;
        ranks[r].world = world;
        pthread_check(pthread_create(&th[r], NULL, xr_main, &ranks[r]));
    }
    for (int r = 0; r < world; r++) pthread_check(pthread_join(th[r], NULL));
    test_stdout_restore(saved);
    if (w) comm_emul_world_destroy(w);
}

// The run's flags as the CLI parses them (--rl-rollout-ranks is set after: the parse checks it
// against the process's world, which is one here).
static int xr_args(TestCtx* t, TrainArgs* a, const char* flags) {
    char line[4096];
    snprintf(line, sizeof line, "train_roundpipe %s", flags);
    char* argv[64];
    int argc = 0;
    for (char* tok = strtok(line, " "); tok && argc < 63; tok = strtok(NULL, " ")) argv[argc++] = tok;
    argv[argc] = NULL;
    args_defaults(a);
    const int rc = args_parse(a, argc, argv);
    CHECK(t, rc == 0, "args_parse '%s': %d", flags, rc);
    return rc;
}

// A tiny token shard for the trainer's data loader (GRPO reads none of it; checkpoints keep its
// position).
static void xr_shard(TestCtx* t, char* path, size_t cap) {
    char err[ERR_LEN];
    uint32_t toks[512];
    for (int i = 0; i < 512; i++) toks[i] = (uint32_t)((i * 7) % 200);
    test_path(t, path, cap, "xr_shard.bin");
    CHECK(t, shard_write(path, toks, 512, 2, err) == 0, "%s", err);
}

static void xr_same(TestCtx* t, const char* what, const XrRank* ref, const XrRank* got, int from,
                    int to) {
    CHECK(t, ref->rc == 0 && got->rc == 0, "%s: reference %d (%s), run %d (%s)", what, ref->rc,
          ref->err, got->rc, got->err);
    if (ref->rc != 0 || got->rc != 0) return;
    for (int s = from; s <= to; s++) {
        CHECK(t, memcmp(&ref->loss[s], &got->loss[s], sizeof(double)) == 0 &&
                     memcmp(&ref->reward[s], &got->reward[s], sizeof(double)) == 0 &&
                     memcmp(&ref->ratio[s], &got->ratio[s], sizeof(double)) == 0 &&
                     ref->len[s] == got->len[s] && ref->version[s] == got->version[s] &&
                     ref->staleness[s] == got->staleness[s],
              "%s: step %d: loss %.9g vs %.9g, reward %.9g vs %.9g, ratio %.9g vs %.9g, len %g vs "
              "%g, v%lld vs v%lld", what, s, ref->loss[s], got->loss[s], ref->reward[s],
              got->reward[s], ref->ratio[s], got->ratio[s], ref->len[s], got->len[s],
              (long long)ref->version[s], (long long)got->version[s]);
    }
    CHECK(t, ref->n_params == got->n_params && ref->params && got->params &&
                 memcmp(ref->params, got->params, (size_t)ref->n_params * sizeof(float)) == 0,
          "%s: the trained weights differ", what);
}

#define XR_FLAGS                                                                                 \
    "--rl grpo --seq 16 --rl-prompts 4 --rl-group 4 --batch 4 --rl-max-tokens 4 --rl-eval 2 "   \
    "--threads 1 --sample-tokens 0 --lr 1e-3 --warmup 1 --schedule constant --row-chunks 1 "     \
    "--rl-eval-every 0 --steps 4 --kl-beta 0.05"

// The schedules the rank tests run: the plain path and the engine (cpu:1), on-policy with the
// synchronous update and one step off (the engine's with the delayed one).
typedef struct XrCase {
    const char* name;
    const char* flags;
    int N;  // engine devices (0: the plain path)
} XrCase;
static const XrCase XR_CASES[] = {
    {"plain, on-policy", "--off-policy 0", 0},
    {"cpu:1, on-policy", "--off-policy 0 --device cpu:1 --sync 1", 1},
    {"plain, one step off", "--off-policy 1", 0},
    {"cpu:1, one step off, delayed", "--off-policy 1 --device cpu:1 --sync 0", 1},
};
#define XR_N_CASES (sizeof XR_CASES / sizeof XR_CASES[0])

// The rank tests' reward script (script, 512 bytes), token shard (shard, 512 bytes) and tiny
// model; -1 (reported) when the script cannot be written.
static int xr_setup(TestCtx* t, char* script, char* shard, Model* m) {
    if (reward_script(t, script, 512) != 0) return -1;
    xr_shard(t, shard, 512);
    ModelConfig c;
    char err[ERR_LEN];
    config_from_preset(&c, "tiny", err);
    if (model_init(m, &c, 0, err) != 0) fatal("%s", err);
    return 0;
}

// One trainer rank with one and two rollout ranks logs what the colocated run logs, step by
// step (loss, reward, ratio, answer length, version, staleness; the weights at the end): on the
// plain path and through the engine (cpu:1), on-policy with --sync 1; and one step off (plain,
// and the engine's delayed update) against the colocated run one step off — the same math: in
// both the batch of step t+1 is generated with v_{t-1} (colocated before step t trains, here
// during it on the rollout ranks; the weights change only after the batch is back), as the
// in-process split schedule does (its test compares it with the colocated run the same way).
static void test_grpo_ranks_match_colocated(TestCtx* t) {
    char script[512], shard[512], flags[2048];
    Model m;
    if (xr_setup(t, script, shard, &m) != 0) return;
    const XrCase* cases = XR_CASES;
    for (size_t k = 0; k < XR_N_CASES; k++) {
        TrainArgs a;
        snprintf(flags, sizeof flags, "%s %s", XR_FLAGS, cases[k].flags);
        if (xr_args(t, &a, flags) != 0) continue;
        char cmd[600];  // (set after the parse: the value has a space)
        snprintf(cmd, sizeof cmd, "sh %s", script);
        a.rl.reward_cmd = cmd;
        XrRank ref[1] = {{.a = &a, .m = &m, .n_devices = cases[k].N, .first = 1,
                          .last = XR_STEPS, .shard = shard}};
        xr_run(ref, 1);
        for (int R = 1; R <= 2; R++) {
            TrainArgs ar = a;
            ar.rl.rollout_ranks = R;
            XrRank x[3];
            for (int r = 0; r <= R; r++)
                x[r] = (XrRank){.a = &ar, .m = &m, .n_devices = cases[k].N, .first = 1,
                                .last = XR_STEPS, .shard = shard};
            xr_run(x, R + 1);
            char what[128];
            snprintf(what, sizeof what, "%s, %d rollout rank(s)", cases[k].name, R);
            xr_same(t, what, &ref[0], &x[0], 1, XR_STEPS);
            // the trainer's generator only evaluates: min(answers, held-out problems) sequences,
            // and the held-out accuracy is the colocated run's
            CHECK(t, x[0].gen_cap == imin(a.rl.prompts * a.rl.group, a.rl.eval) &&
                         x[0].gen_cap < ref[0].gen_cap &&
                         memcmp(&x[0].accuracy, &ref[0].accuracy, sizeof(double)) == 0,
                  "%s: the trainer's generator holds %d sequences (colocated %d), held-out "
                  "accuracy %g vs %g", what, x[0].gen_cap, ref[0].gen_cap, x[0].accuracy,
                  ref[0].accuracy);
            for (int r = 1; r <= R; r++)
                CHECK(t, x[r].rc == 0, "%s: rollout rank %d: %s", what, r, x[r].err);
            for (int s = 1; s <= XR_STEPS; s++)
                CHECK(t, x[0].staleness[s] <= a.rl.off_policy, "%s: step %d staleness %d", what,
                      s, x[0].staleness[s]);
            free(x[0].params);
        }
        free(ref[0].params);
    }
    model_free(&m);
}

// Resumed from the trainer's checkpoint after step 2, a run with a rollout rank logs steps 3-4
// and ends with the weights of the straight run: on-policy, and one step off, whose checkpoint
// keeps the batch the rollout rank generated ahead for step 3 (rl_state.bin: not generated
// again); on the plain path and through the engine on cpu:1 (on-policy with the synchronous
// update, one step off with the delayed one, whose pending weights the checkpoint keeps); the
// trainer re-sends the weights of the checkpoint's version at the start.
static void test_grpo_ranks_resume(TestCtx* t) {
    char script[512], shard[512], flags[2048], out[512];
    Model m;
    if (xr_setup(t, script, shard, &m) != 0) return;
    const XrCase* cases = XR_CASES;
    for (size_t k = 0; k < XR_N_CASES; k++) {
        char name[32];
        snprintf(name, sizeof name, "xr_resume%zu", k);
        test_path(t, out, sizeof out, name);
        mkdir(out, 0755);
        TrainArgs a;
        snprintf(flags, sizeof flags, "%s %s --out %s --save-every 2", XR_FLAGS, cases[k].flags,
                 out);
        if (xr_args(t, &a, flags) != 0) continue;
        char cmd[600];
        snprintf(cmd, sizeof cmd, "sh %s", script);
        a.rl.reward_cmd = cmd;
        a.rl.rollout_ranks = 1;
        a.rl.kl_beta = 0.0f;  // (the KL reference is the weights a run starts from: a resumed
                              // run's differs from the straight run's)
        XrRank straight[2], first[2], second[2];
        const int N = cases[k].N;
        for (int r = 0; r < 2; r++) {
            straight[r] = (XrRank){.a = &a, .m = &m, .n_devices = N, .first = 1,
                                   .last = XR_STEPS, .shard = shard, .out = out};
            first[r] = (XrRank){.a = &a, .m = &m, .n_devices = N, .first = 1, .last = 2,
                                .save_at = 2, .shard = shard, .out = out};
            second[r] = (XrRank){.a = &a, .m = &m, .n_devices = N, .first = 3, .last = XR_STEPS,
                                 .shard = shard, .out = out};
        }
        xr_run(straight, 2);
        xr_run(first, 2);
        CHECK(t, first[0].rc == 0 && first[1].rc == 0, "%s: the first half: %s / %s",
              cases[k].name, first[0].err, first[1].err);
        xr_run(second, 2);
        char what[96];
        snprintf(what, sizeof what, "resumed, %s", cases[k].name);
        xr_same(t, what, &straight[0], &second[0], 3, XR_STEPS);
        CHECK(t, second[1].rc == 0, "%s: the rollout rank: %s", what, second[1].err);
        free(straight[0].params);
        free(first[0].params);
        free(second[0].params);
    }
    model_free(&m);
}

// A rollout rank whose layout differs from the trainer's (a model of another width): every rank
// refuses at the manifest exchange with the same one line naming the rank and the tensor, before
// any weight moves. A rollout rank that dies during the run: the trainer fails in one line naming
// it, at once; one that hangs: the same after the communicator's timeout (1 s), no hang (a
// process of its own here: the trainer's failure ends the process, as the CLI's).
static void test_grpo_ranks_failures(TestCtx* t) {
    char script[512], shard[512], flags[2048];
    if (reward_script(t, script, sizeof script) != 0) return;
    xr_shard(t, shard, sizeof shard);
    ModelConfig c;
    char err[ERR_LEN];
    config_from_preset(&c, "tiny", err);
    ModelConfig c2 = c;
    c2.F += 8;
    Model m, m2;
    if (model_init(&m, &c, 0, err) != 0 || model_init(&m2, &c2, 0, err) != 0) fatal("%s", err);
    TrainArgs a;
    snprintf(flags, sizeof flags, "%s --off-policy 0", XR_FLAGS);
    if (xr_args(t, &a, flags) != 0) return;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "sh %s", script);
    a.rl.reward_cmd = cmd;
    a.rl.rollout_ranks = 1;
    XrRank x[2] = {{.a = &a, .m = &m, .first = 1, .last = 2, .shard = shard},
                   {.a = &a, .m = &m2, .first = 1, .last = 2, .shard = shard}};
    xr_run(x, 2);
    for (int r = 0; r < 2; r++)
        CHECK(t, x[r].rc != 0 && strstr(x[r].err, "rank 1") && strstr(x[r].err, "layers.0.") &&
                     !strchr(x[r].err, '\n') && strcmp(x[r].err, x[0].err) == 0,
              "rank %d of a mismatched rollout rank: %s", r, x[r].err);
    free(x[0].params);

    // the rollout rank dies at the first batch's answers: its ops are the verdicts' all-gather,
    // the manifest's two broadcasts and the verdicts' all-gather (the start), the weights'
    // header and one op per tensor, the batch's header and prompts, then the answers'
    WeightManifest wm;
    weight_manifest_build(&wm, &m.tt, 4);
    const uint64_t die_at = 4 + 1 + (uint64_t)wm.n + 2;
    weight_manifest_free(&wm);
    for (int hang = 0; hang <= 1; hang++) {
        char errf[512];
        test_path(t, errf, sizeof errf, hang ? "xr_hangs.err" : "xr_dies.err");
        fflush(stdout);
        fflush(stderr);
        const pid_t pid = fork();
        if (pid == 0) {
            const int fd = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd >= 0) dup2(fd, 2);
            alarm(120);  // (a hang fails the test instead of stopping the suite)
            XrRank d[2] = {{.a = &a, .m = &m, .first = 1, .last = 2, .shard = shard,
                            .timeout_s = 1.0},
                           {.a = &a, .m = &m, .first = 1, .last = 2, .shard = shard,
                            .fault = hang ? COMM_FAULT_HANG : COMM_FAULT_DIE, .fault_at = die_at,
                            .timeout_s = 1.0}};
            xr_run(d, 2);
            if (d[0].rc != 0) fatal("--rl: %s", d[0].err);  // (as train_roundpipe.c's)
            _exit(0);
        }
        int status = 0;
        const double t0 = time_now_s();
        CHECK(t, pid > 0 && waitpid(pid, &status, 0) == pid, "fork / waitpid failed");
        const double took = time_now_s() - t0;
        char* e = test_read_file(errf, NULL);
        CHECK(t, WIFEXITED(status) && WEXITSTATUS(status) != 0 && e &&
                     test_one_error_line(e, hang ? "did not arrive" : "rank 1 died at all_gather") &&
                     strstr(e, "--rl-rollout-ranks") && took < 30.0,
              "a %s rollout rank: status %d after %.1f s: %s", hang ? "hanging" : "dead", status,
              took, e ? e : "");
        free(e);
    }
    model_free(&m);
    model_free(&m2);
}

// --rl-rollout-ranks refusals: one clear line, a non-zero exit, before anything is loaded.
static void test_grpo_ranks_refusals(TestCtx* t) {
    const char* at = "--dist-init tcp://127.0.0.1:9 --rank 0";
    const char* bad[][2] = {
        {"--rl-rollout-ranks 1", "needs a world of R + 1 ranks"},
        {"--rl-rollout-ranks 2 --world 2", "needs a world of R + 1 ranks"},
        {"--rl-rollout-ranks 1 --world 3", "exactly one trainer rank"},
        {"--rl-rollout-ranks 1 --world 2 --rollout-gpus 1 --device cpu:2", "--rollout-gpus"},
        {"--rl-rollout-ranks 1 --world 2", "needs --device cuda"},
        {"--rl-rollout-ranks 5 --world 6 --device cuda", "at most --rl-prompts"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char args[1024];
        snprintf(args, sizeof args, "%s --steps 1 %s %s", GRPO_ENGINE_FLAGS, bad[i][0],
                 strstr(bad[i][0], "--world") ? at : "");
        const int rc = test_run_cli(t, "grpo_ranks_bad", args);
        char* e = test_read_output(t, "grpo_ranks_bad", "err");
        CHECK(t, rc != 0 && e && test_one_error_line(e, bad[i][1]) &&
                     strstr(e, "--rl-rollout-ranks"), "'%s': exit %d, %s", bad[i][0], rc,
              e ? e : "");
        free(e);
    }
}

const TestCase tests_grpo_engine[] = {
    {"engine_weight_manifest_broadcast", test_engine_weight_manifest_broadcast},
    {"engine_weight_rank_broadcast", test_engine_weight_rank_broadcast},
    {"grpo_engine_split_matches_colocated", test_grpo_engine_split_matches_colocated},
    {"grpo_engine_split_resume", test_grpo_engine_split_resume},
    {"grpo_engine_split_refusals", test_grpo_engine_split_refusals},
    {"grpo_ranks_match_colocated", test_grpo_ranks_match_colocated},
    {"grpo_ranks_resume", test_grpo_ranks_resume},
    {"grpo_ranks_failures", test_grpo_ranks_failures},
    {"grpo_ranks_refusals", test_grpo_ranks_refusals},
    {"engine_policy_matches_plain", test_engine_policy_matches_plain},
    {"grpo_engine_cli_matches_plain", test_grpo_engine_cli_matches_plain},
    {"grpo_engine_cli_resume", test_grpo_engine_cli_resume},
    {NULL, NULL},
};
