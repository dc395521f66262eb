/*
 * test_dp_engine.c — data parallel through the RoundPipe engine (docs/DISTRIBUTED.md §6; suite
 * `dp_engine`): W emulated ranks (threads of this process over comm_emul), each an engine on its
 * own 1 or 2 emulated CPU devices, against a single-process run that groups the micro-batches
 * the same way (rank r's rows r, r + W, ... in M / W micro-batches, its gradients accumulated on
 * their own with the tied head folded, the W groups added in rank order with comm_reference_sum,
 * the norm summed in the engine's shard order, dp_engine_norm_sq, then one AdamW step): sync-mode
 * losses, norms, weights and the gathered m and v bit for bit on 1-4 ranks, with fp32 and bf16
 * gradients on the wire; the delayed update of one rank equals the engine without a
 * communicator (also with split rounds), and W ranks agree; a rank that dies or hangs makes the others stop with a
 * message naming it, within the timeout; the ZeRO-1 shards cover the parameters once, and each
 * rank keeps AdamW's m and v (and with EngineOptions.shard_weights its fp32 weights) in memory for
 * its shard only (about 1/W of them, mincore). The same for mixture-of-experts models (each
 * micro-batch's aux loss its own, the step's CE, aux and expert loads the global batch's) and
 * LoRA (the adapters alone reduced and sharded; dropout, a q8_0 base, expert adapters; rank 0's
 * PEFT export); checkpoints and resume through the trainer for all three.
 *
 * Rank threads only record; CHECKs run on the test's thread after pthread_join.
 */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../adamw.h"
#include "../args.h"
#include "../checkpoint.h"
#include "../comm.h"
#include "../common.h"
#include "../dataloader.h"
#include "../device.h"
#include "../dp.h"
#include "../engine.h"
#include "../lora.h"
#include "../model.h"
#include "../ops.h"
#include "../plain.h"
#include "../quant.h"
#include "../rng.h"
#include "../store.h"
#include "../threads.h"
#include "../trainer.h"
#include "testing.h"

#define DE_MAX_W 4
#define DE_STEPS 3
#define DE_B 12  // divides by 1, 2, 3 and 4
#define DE_M 12
#define DE_T 8
#define DE_MAX_E 8  // the test MoE presets' experts
// Under ThreadSanitizer (fifty-fold slower; `make tsan` runs the suites matching "engine") the
// MoE and LoRA cases run W = 2 ranks on 2 devices of one model each: the same hand-offs, events
// and collectives as the others.
#if defined(__SANITIZE_THREAD__)
#define DE_SAN 1
#else
#define DE_SAN 0
#endif

static const AdamWHyper de_hyper = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
static const LrSchedule de_sched = {LR_COSINE, 1e-2f, 1, DE_STEPS, 0.1f, 0.0f};
static const float de_clip = 0.5f;  // small enough to clip: the norm must agree exactly

// The run's batches: the same on every rank (every rank reads the global batch).
static void de_batch(const ModelConfig* c, int step, int32_t* tokens) {
    Rng r;
    rng_seed(&r, 2000u + (uint32_t)step);
    for (int i = 0; i < DE_B * (DE_T + 1); i++) tokens[i] = (int32_t)rng_below(&r, (uint64_t)c->V);
}

// The optimizer's tensors of a store end to end: field 0 weights, 1 m, 2 v (malloc'd).
static float* de_flat(const Store* s, int field, size_t* n_out) {
    AdamWTensor* t = malloc_check((size_t)s->tt->n * sizeof(AdamWTensor));
    const int nt = store_adamw_tensors(s, t);
    size_t n = 0;
    for (int i = 0; i < nt; i++) n += t[i].n;
    float* out = malloc_check((n > 0 ? n : 1) * sizeof(float));
    size_t o = 0;
    for (int i = 0; i < nt; i++) {
        const float* x = field == 0 ? t[i].param : field == 1 ? t[i].m : t[i].v;
        memcpy(out + o, x, t[i].n * sizeof(float));
        o += t[i].n;
    }
    free(t);
    *n_out = n;
    return out;
}

// The run's initial weights, the same on every rank. LoRA: A from lora_init_random and B random
// too (PEFT's B = 0 would leave the first step's A gradient zero), and a block-format base
// quantised (its dequantised values are the reference's weights).
static void de_init_lora(const Model* m, Store* s) {
    if (m->tt.lora.r <= 0) return;
    lora_init_random(m, s, 8);
    Rng r;
    rng_seed(&r, 9);
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->kind != TK_LORA_B) continue;
        float* p = store_param(s, i);
        for (int64_t j = 0; j < d->numel; j++) p[j] = 0.05f * rng_normal(&r);
    }
    store_quantize_base(s, NULL, &m->cfg);
}

static void de_init_store(const Model* m, Store* s) {
    store_init_random(s, 7, 0.2f);
    de_init_lora(m, s);
}

// ----------------------------------------------------------------------------
// the ranks

typedef struct DeRank {
    CommEmulWorld* w;   // NULL: no communicator (the engine alone, W = 1)
    const Model* m;
    int rank, world, N, sync, bf16;
    int shard_weights;  // EngineOptions.shard_weights
    int split;          // EngineOptions.split_rounds
    int shard_store;    // store_create_shard (m and v zeroed for the rank's shard only)
    double budget;      // device bytes for the stages (0: unlimited, one stage)
    CommFault fault;
    uint64_t fault_op;
    double timeout_s;
    double loss[DE_STEPS], norm[DE_STEPS];
    double ce[DE_STEPS], aux[DE_STEPS], load[DE_STEPS][DE_MAX_E];  // MoE: the step's statistics
    int failed;         // the step that failed (1-based; -1 set-up), 0 none
    char err[ERR_LEN];
    double secs;        // until the failure (or the end)
    float* flat[3];     // weights, m, v after engine_gather_state
    size_t n;
    int64_t shard;      // engine_shard_params
    int steps;          // steps to run (0: DE_STEPS)
    double mv_bytes, mv_resident;  // AdamW's m and v slabs: allocated, resident after the steps
    double w_bytes, w_resident;    // the fp32 weight slabs: the same
    const char* export_dir;  // LoRA, non-NULL: rank 0 exports the adapters there (PEFT)
    const char* ckpt;   // non-NULL: after the steps, a checkpoint streamed layer by layer into
                        // ckpt/streamed, then one of the whole gathered state into ckpt/whole
    double ckpt_peak;   // rank 0: the most of m, v and the fp32 weights resident while streaming
} DeRank;

// A streamed checkpoint's gathers (CkptGather), rank 0 measuring what it holds after each.
typedef struct DeGather {
    Engine* e;
    DeRank* k;
    const Store* s;
} DeGather;

// m, v and the fp32 weights of s resident now.
static double de_state_resident(const Store* s) {
    double b = 0.0;
    for (int l = 0; l < s->n_layers; l++) {
        const size_t bytes = (size_t)s->tt->state_numel[l] * sizeof(float);
        if (bytes > 0)
            b += test_resident_bytes(s->m[l], bytes) + test_resident_bytes(s->v[l], bytes) +
                 test_resident_bytes(s->param[l], bytes);
    }
    return b;
}

static int de_gather_layer(void* ctx, int field, int l, char* err) {
    DeGather* g = ctx;
    const int rc = engine_gather_layer(g->e, field, l, 0, err);
    if (g->k->rank == 0) {
        const double r = de_state_resident(g->s);
        if (r > g->k->ckpt_peak) g->k->ckpt_peak = r;
    }
    return rc;
}

// After the steps: the streamed checkpoint, then the whole state gathered onto rank 0 and written
// as before (the files must be the same).
static int de_checkpoints(DeRank* k, Engine* e, const Store* s) {
    TrainState ts;
    train_state_init(&ts, 1);
    ts.step = k->steps > 0 ? k->steps : DE_STEPS;
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/streamed", k->ckpt);
    DeGather dg = {e, k, s};
    const CkptGather g = {.layer = de_gather_layer, .ctx = &dg, .writer = k->rank == 0};
    engine_synchronize(e);
    int rc = checkpoint_save_state_gathered(dir, 0, k->m, s, &ts, "{}", &g, k->err);
    engine_release_state(e);
    if (rc == 0) rc = engine_gather_state(e, 0, 1, k->err);
    snprintf(dir, sizeof dir, "%s/whole", k->ckpt);
    if (rc == 0 && k->rank == 0) rc = checkpoint_save_state(dir, 0, k->m, s, &ts, "{}", k->err);
    engine_release_state(e);
    train_state_free(&ts);
    return rc;
}

static void* de_rank_main(void* arg) {
    DeRank* k = arg;
    const double t0 = time_now_s();
    Comm* c = NULL;
    if (k->w) {
        CommInit in = {.rank = k->rank, .world = k->world, .timeout_s = k->timeout_s,
                       .local = k->w};
        c = comm_emul_impl.init(&in, k->err);
        if (!c) {
            k->failed = -1;
            return NULL;
        }
        if (k->fault != COMM_FAULT_NONE) comm_emul_inject(c, k->fault, k->fault_op);
    }
    Store s;
    if (k->shard_store) {
        const int NL = k->m->tt.n_layers;
        int64_t* lo = malloc_check((size_t)NL * sizeof(int64_t));
        int64_t* hi = malloc_check((size_t)NL * sizeof(int64_t));
        dp_engine_state_ranges(&k->m->tt, k->world, k->rank, lo, hi);
        store_create_shard(&s, &k->m->tt, lo, hi);
        free(lo);
        free(hi);
    } else {
        store_create(&s, &k->m->tt);
    }
    de_init_store(k->m, &s);
    DeviceSet devs;
    const DeviceOptions dopt = {.threads = 1, .delay_seed = 99u + (uint32_t)k->rank,
                                .max_delay_us = 20};
    device_set_open(&devs, &device_cpu_impl, k->N, &dopt);
    EngineOptions eo = {.B = DE_B / k->world, .T = DE_T, .M = DE_M / k->world, .M_R = 0,
                        .sync = k->sync, .opt_threads = 1, .row_chunks = 1, .trace_path = "",
                        .hyper = de_hyper, .sched = de_sched, .grad_clip = de_clip, .comm = c,
                        .global_B = DE_B, .reduce_bf16 = k->bf16,
                        .shard_weights = k->shard_weights, .split_rounds = k->split};
    if (k->budget > 0)
        eo.device_budget = k->budget + (double)engine_fixed_device_bytes(k->m, 4, &eo);
    Engine* e = engine_create(k->m, &s, &devs, &eo, k->err);
    if (!e) {
        k->failed = -1;
    } else {
        k->shard = engine_shard_params(e);
        int32_t* tokens = malloc_check((size_t)DE_B * (DE_T + 1) * sizeof(int32_t));
        int32_t* rows = malloc_check((size_t)DE_B * (DE_T + 1) * sizeof(int32_t));
        const int steps = k->steps > 0 ? k->steps : DE_STEPS;
        for (int step = 1; step <= steps; step++) {
            de_batch(&k->m->cfg, step, tokens);
            dp_take_rows(tokens, DE_B, DE_T, k->world, k->rank, rows);
            const EngineStepResult r = engine_step(e, rows);
            if (r.error) {
                k->failed = step;
                snprintf(k->err, sizeof k->err, "%s", r.error);
                break;
            }
            k->loss[step - 1] = r.loss;
            k->norm[step - 1] = r.norm;
            k->ce[step - 1] = r.ce_sum;
            k->aux[step - 1] = r.aux_sum;
            for (int x = 0; r.load && x < k->m->cfg.E && x < DE_MAX_E; x++)
                k->load[step - 1][x] = r.load[x];
        }
        engine_synchronize(e);
        for (int l = 0; l < k->m->tt.n_layers; l++) {
            const size_t bytes = (size_t)k->m->tt.state_numel[l] * sizeof(float);
            if (bytes == 0) continue;
            k->mv_bytes += 2.0 * (double)bytes;
            k->mv_resident += test_resident_bytes(s.m[l], bytes) + test_resident_bytes(s.v[l], bytes);
            k->w_bytes += (double)bytes;
            k->w_resident += test_resident_bytes(s.param[l], bytes);
        }
        if (!k->failed && k->ckpt && de_checkpoints(k, e, &s) != 0) k->failed = DE_STEPS + 1;
        if (!k->failed && engine_gather_state(e, -1, 1, k->err) != 0) k->failed = DE_STEPS + 1;
        if (!k->failed && k->export_dir && k->rank == 0 &&
            lora_save_peft(k->export_dir, k->m, &s, "", NULL, k->err) != 0)
            k->failed = DE_STEPS + 1;
        k->secs = time_now_s() - t0;
        if (!k->failed)
            for (int f = 0; f < 3; f++) k->flat[f] = de_flat(&s, f, &k->n);
        free(tokens);
        free(rows);
        engine_free(e);
    }
    device_set_close(&devs);
    store_free(&s);
    comm_destroy(c);
    return NULL;
}

// W ranks as threads; proto sets everything but the world, the rank and the communicator.
static void de_run(const DeRank* proto, int W, const CommFault* faults, DeRank* ranks) {
    CommEmulWorld* w = comm_emul_world_create(W);
    pthread_t th[DE_MAX_W];
    for (int r = 0; r < W; r++) {
        ranks[r] = *proto;
        ranks[r].w = w;
        ranks[r].rank = r;
        ranks[r].world = W;
        ranks[r].fault = faults ? faults[r] : COMM_FAULT_NONE;
        pthread_check(pthread_create(&th[r], NULL, de_rank_main, &ranks[r]));
    }
    for (int r = 0; r < W; r++) pthread_check(pthread_join(th[r], NULL));
    comm_emul_world_destroy(w);
}

static void de_rank_free(DeRank* k) {
    for (int f = 0; f < 3; f++) free(k->flat[f]);
}

// ----------------------------------------------------------------------------
// the single-process grouping

typedef struct DeReference {
    double loss[DE_STEPS], norm[DE_STEPS];
    double ce[DE_STEPS], aux[DE_STEPS], load[DE_STEPS][DE_MAX_E];  // MoE: every rank's, in order
    float* flat[3];
    size_t n;
} DeReference;

// The single-process grouping of W ranks' steps; LoRA with export_dir: its adapters exported there.
static void de_reference_export(const Model* m, int W, int bf16, const char* export_dir,
                                DeReference* ref) {
    Store s;
    store_create(&s, &m->tt);
    de_init_store(m, &s);
    void* ctx = ops_cpu_create(1);
    const int Br = DE_B / W, Mr = DE_M / W;
    Plain* p = plain_create(m, &s, &ops_cpu, ctx, (Br + Mr - 1) / Mr, DE_T, 0);
    ThreadPool* pool = threadpool_create(1);
    AdamWTensor* t = malloc_check((size_t)m->tt.n * sizeof(AdamWTensor));
    const int nt = store_adamw_tensors(&s, t);
    size_t n = 0;
    for (int i = 0; i < nt; i++) n += t[i].n;
    float* groups[DE_MAX_W];
    uint16_t* groups16[DE_MAX_W];
    for (int r = 0; r < W; r++) {
        groups[r] = malloc_check(n * sizeof(float));
        groups16[r] = malloc_check(n * sizeof(uint16_t));
    }
    float* sum = malloc_check(n * sizeof(float));
    uint16_t* sum16 = malloc_check(n * sizeof(uint16_t));
    int32_t* tokens = malloc_check((size_t)DE_B * (DE_T + 1) * sizeof(int32_t));
    int32_t* rows = malloc_check((size_t)DE_B * (DE_T + 1) * sizeof(int32_t));
    const size_t row = (size_t)DE_T + 1;
    for (int step = 1; step <= DE_STEPS; step++) {
        de_batch(&m->cfg, step, tokens);
        double loss = 0.0, ce = 0.0, aux = 0.0, load[DE_MAX_E] = {0};
        for (int r = 0; r < W; r++) {
            // rank r: its rows in its micro-batches, every per-token loss summed in order (as
            // engine_collect sums them), its gradient accumulated from zero, the head folded
            dp_take_rows(tokens, DE_B, DE_T, W, r, rows);
            store_zero_grads(&s);
            double local = 0.0, local_ce = 0.0, local_aux = 0.0, local_load[DE_MAX_E] = {0};
            int first = 0;
            for (int mb = 0; mb < Mr; mb++) {
                const int rows_mb = Br / Mr + (mb < Br % Mr ? 1 : 0);
                // (LoRA's dropout masks: rank r's micro-batches after those of the ranks before)
                p->ws->lora_seed = lora_dropout_seed(0, step - 1, r * Mr + mb);
                const double obj = plain_forward_backward(p, rows + (size_t)first * row, rows_mb,
                                                          DE_T, 1.0f / ((float)DE_B * (float)DE_T));
                first += rows_mb;
                if (m->n_moe == 0) {
                    for (int x = 0; x < rows_mb * DE_T; x++) local += p->losses_host[x];
                    continue;
                }
                // MoE: the micro-batch's objective with its aux loss (the aux couples its rows),
                // its CE, aux x tokens and tokens per expert
                local += obj;
                local_ce += p->ce_sum;
                local_aux += p->aux * (double)rows_mb * DE_T;
                for (int x = 0; x < m->cfg.E && x < DE_MAX_E; x++)
                    local_load[x] += p->ws->moe_counts_host[x];
            }
            ce += local_ce;
            aux += local_aux;
            for (int x = 0; x < DE_MAX_E; x++) load[x] += local_load[x];
            plain_sync_grads(p);
            store_fold_tied_grads(&s);
            loss += local;
            size_t o = 0;
            for (int i = 0; i < nt; i++) {
                memcpy(groups[r] + o, t[i].grad, t[i].n * sizeof(float));
                o += t[i].n;
            }
            for (size_t i = 0; bf16 && i < n; i++) groups16[r][i] = f32_to_bf16(groups[r][i]);
        }
        if (bf16) {
            comm_reference_sum((const void* const*)groups16, W, n, COMM_BF16, sum16);
            for (size_t i = 0; i < n; i++) sum[i] = bf16_to_f32(sum16[i]);
        } else {
            comm_reference_sum((const void* const*)groups, W, n, COMM_F32, sum);
        }
        size_t o = 0;
        for (int i = 0; i < nt; i++) {
            memcpy((float*)t[i].grad, sum + o, t[i].n * sizeof(float));
            o += t[i].n;
        }
        const AdamWUpdate u = adamw_update_begin(&de_hyper, &de_sched, de_clip, step,
                                                 dp_engine_norm_sq(pool, &s, W));
        adamw_update_apply(pool, &u, t, nt);
        plain_sync_params(p);
        ref->loss[step - 1] = loss / ((double)DE_B * DE_T);
        ref->norm[step - 1] = u.norm;
        ref->ce[step - 1] = ce;
        ref->aux[step - 1] = aux;
        memcpy(ref->load[step - 1], load, sizeof load);
    }
    for (int f = 0; f < 3; f++) ref->flat[f] = de_flat(&s, f, &ref->n);
    char err[ERR_LEN];
    if (export_dir && lora_save_peft(export_dir, m, &s, "", NULL, err) != 0) fatal("%s", err);
    for (int r = 0; r < W; r++) {
        free(groups[r]);
        free(groups16[r]);
    }
    free(sum);
    free(sum16);
    free(tokens);
    free(rows);
    free(t);
    threadpool_destroy(pool);
    plain_free(p);
    ops_cpu_destroy(ctx);
    store_free(&s);
}

static void de_reference(const Model* m, int W, int bf16, DeReference* ref) {
    de_reference_export(m, W, bf16, NULL, ref);
}

static void de_reference_free(DeReference* ref) {
    for (int f = 0; f < 3; f++) free(ref->flat[f]);
}

static void de_model(TestCtx* t, Model* m) {
    char err[ERR_LEN];
    const ModelConfig c = test_engine_config(1);  // tied: the head's fold before the reduce
    CHECK(t, model_init(m, &c, 0, err) == 0, "%s", err);
}

// Every rank's record against the reference, bit for bit.
static void de_check_ranks(TestCtx* t, const char* what, const DeRank* ranks, int W,
                           const DeReference* ref) {
    for (int r = 0; r < W; r++) {
        const DeRank* k = &ranks[r];
        CHECK(t, k->failed == 0, "%s rank %d failed at step %d: %s", what, r, k->failed, k->err);
        if (k->failed) continue;
        for (int s = 0; s < DE_STEPS; s++) {
            CHECK(t, k->loss[s] == ref->loss[s], "%s rank %d step %d: loss %.17g, the "
                  "single-process grouping %.17g", what, r, s + 1, k->loss[s], ref->loss[s]);
            CHECK(t, k->norm[s] == ref->norm[s], "%s rank %d step %d: norm %.17g vs %.17g", what,
                  r, s + 1, k->norm[s], ref->norm[s]);
            if (k->m->n_moe == 0) continue;
            // MoE: the step's CE, aux and expert loads are the global batch's
            int same_load = 1;
            for (int x = 0; x < k->m->cfg.E && x < DE_MAX_E; x++)
                same_load &= k->load[s][x] == ref->load[s][x];
            CHECK(t, k->ce[s] == ref->ce[s] && k->aux[s] == ref->aux[s] && same_load,
                  "%s rank %d step %d: CE %.17g aux %.17g (loads equal %d), the single-process "
                  "grouping %.17g %.17g", what, r, s + 1, k->ce[s], k->aux[s], same_load,
                  ref->ce[s], ref->aux[s]);
        }
        CHECK(t, k->n == ref->n && memcmp(k->flat[0], ref->flat[0], ref->n * sizeof(float)) == 0,
              "%s rank %d: the sharded weights equal the unsharded ones", what, r);
        CHECK(t, k->n == ref->n && memcmp(k->flat[1], ref->flat[1], ref->n * sizeof(float)) == 0 &&
                 memcmp(k->flat[2], ref->flat[2], ref->n * sizeof(float)) == 0,
              "%s rank %d: AdamW's m and v gathered equal the unsharded ones", what, r);
    }
}

// ----------------------------------------------------------------------------
// the tests

static void test_dp_engine_sync(TestCtx* t) {
    Model m;
    de_model(t, &m);
    for (int W = 1; W <= DE_MAX_W; W++) {
        DeReference ref;
        de_reference(&m, W, 0, &ref);
        // one stage on one device; several stages over two devices (a small budget)
        for (int N = 1; N <= 2; N++) {
            // (two devices: the fp32 weights sharded too, gathered back at the end)
            const DeRank proto = {.m = &m, .N = N, .sync = 1, .timeout_s = 60.0,
                                  .budget = N == 2 ? 2.4e5 : 0, .shard_weights = N == 2,
                                  .shard_store = N == 2};
            DeRank ranks[DE_MAX_W];
            de_run(&proto, W, NULL, ranks);
            char what[48];
            snprintf(what, sizeof what, "W %d N %d", W, N);
            de_check_ranks(t, what, ranks, W, &ref);
            // ZeRO-1: the shards cover the parameters once
            int64_t total = 0;
            for (int r = 0; r < W; r++) total += ranks[r].shard;
            CHECK(t, total == m.tt.trainable_params, "%s: the shards hold %lld of %lld "
                  "parameters", what, (long long)total, (long long)m.tt.trainable_params);
            for (int r = 0; r < W; r++) de_rank_free(&ranks[r]);
        }
        de_reference_free(&ref);
    }
    // bf16 on the wire (summed in fp32, rounded once): the same grouping in bf16
    DeReference ref;
    de_reference(&m, 3, 1, &ref);
    const DeRank proto = {.m = &m, .N = 2, .sync = 1, .bf16 = 1, .timeout_s = 60.0};
    DeRank ranks[3];
    de_run(&proto, 3, NULL, ranks);
    de_check_ranks(t, "bf16 W 3", ranks, 3, &ref);
    for (int r = 0; r < 3; r++) de_rank_free(&ranks[r]);
    de_reference_free(&ref);
    model_free(&m);
}

// The delayed update: one rank with a communicator trains as the engine alone, bit for bit; W
// ranks agree with each other.
static void test_dp_engine_delayed(TestCtx* t) {
    Model m;
    de_model(t, &m);
    DeRank alone = {.m = &m, .rank = 0, .world = 1, .N = 2, .sync = 0, .budget = 2.4e5};
    de_rank_main(&alone);
    CHECK(t, alone.failed == 0, "the engine alone: %s", alone.err);
    for (int W = 1; W <= 2 && !alone.failed; W++) {
        const DeRank proto = {.m = &m, .N = 2, .sync = 0, .timeout_s = 60.0, .budget = 2.4e5};
        DeRank ranks[2];
        de_run(&proto, W, NULL, ranks);
        for (int r = 0; r < W; r++) {
            CHECK(t, ranks[r].failed == 0, "W %d rank %d: %s", W, r, ranks[r].err);
            if (ranks[r].failed) continue;
            const DeRank* want = W == 1 ? &alone : &ranks[0];
            for (int s = 0; s < DE_STEPS; s++)
                CHECK(t, ranks[r].loss[s] == want->loss[s] && ranks[r].norm[s] == want->norm[s],
                      "W %d rank %d step %d: loss %.17g norm %.17g, expected %.17g %.17g", W, r,
                      s + 1, ranks[r].loss[s], ranks[r].norm[s], want->loss[s], want->norm[s]);
            CHECK(t, memcmp(ranks[r].flat[0], want->flat[0], want->n * sizeof(float)) == 0,
                  "W %d rank %d: the same weights", W, r);
        }
        if (W == 2)  // (the grouping changes the sums' order, not the mathematics)
            CHECK(t, fabs(ranks[0].loss[DE_STEPS - 1] - alone.loss[DE_STEPS - 1]) <
                         1e-4 * fabs(alone.loss[DE_STEPS - 1]),
                  "two ranks close to one: %.9g vs %.9g", ranks[0].loss[DE_STEPS - 1],
                  alone.loss[DE_STEPS - 1]);
        for (int r = 0; r < W; r++) de_rank_free(&ranks[r]);
    }
    de_rank_free(&alone);
    // split rounds (one round per device at once, added in round order before the reduce): one
    // rank with a communicator is the engine alone, bit for bit
    DeRank split_alone = {.m = &m, .rank = 0, .world = 1, .N = 2, .sync = 0, .split = 1};
    de_rank_main(&split_alone);
    const DeRank proto = {.m = &m, .N = 2, .sync = 0, .timeout_s = 60.0, .split = 1};
    DeRank split_one[1];
    de_run(&proto, 1, NULL, split_one);
    CHECK(t, split_alone.failed == 0 && split_one[0].failed == 0, "split rounds: %s %s",
          split_alone.err, split_one[0].err);
    if (!split_alone.failed && !split_one[0].failed) {
        for (int s = 0; s < DE_STEPS; s++)
            CHECK(t, split_one[0].loss[s] == split_alone.loss[s] &&
                         split_one[0].norm[s] == split_alone.norm[s],
                  "split rounds step %d: %.17g vs %.17g", s + 1, split_one[0].loss[s],
                  split_alone.loss[s]);
        CHECK(t, memcmp(split_one[0].flat[0], split_alone.flat[0],
                        split_alone.n * sizeof(float)) == 0, "split rounds: the same weights");
    }
    de_rank_free(&split_alone);
    de_rank_free(&split_one[0]);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// mixture of experts

// test-qwen3moe with 5 blocks (block 1 dense: mlp_only_layers) or test-gptoss with 4 (a 4-token
// window < T in blocks 0 and 2), 8 experts, top-2, the aux loss on.
static void de_moe_model(TestCtx* t, Model* m, int gptoss) {
    char err[ERR_LEN];
    ModelConfig c;
    CHECK(t, config_from_preset(&c, gptoss ? "test-gptoss" : "test-qwen3moe", err) == 0, "%s",
          err);
    c.L = gptoss ? 4 : 5;
    if (gptoss) c.sliding[2] = 1;
    c.output_router_logits = 1;
    CHECK(t, model_init(m, &c, 0, err) == 0, "%s", err);
    CHECK(t, m->n_moe > 0 && c.E <= DE_MAX_E, "%s: %d MoE blocks of %d experts", c.name,
          m->n_moe, c.E);
}

// A device budget of about half the model's 16 B per parameter: several stages over two devices.
static double de_moe_budget(const Model* m) {
    double x = 0.0;
    for (int l = 0; l < m->tt.n_layers; l++) x += 16.0 * (double)m->tt.param_numel[l];
    return 0.5 * x;
}

// MoE models: each rank's micro-batches carry their own aux loss (it couples a micro-batch's
// rows, as in one process) and their expert counts; the loss is the ranks' objectives (CE plus the
// weighted aux) added in rank order, and the step's CE, aux and expert loads the global batch's.
// Sync mode on 1-4 ranks x 1-2 devices equals the single-process grouping bit for bit (losses,
// norms, statistics, weights, m and v), for both families.
static void test_dp_engine_moe_sync(TestCtx* t) {
    for (int gptoss = 0; gptoss <= 1 - DE_SAN; gptoss++) {
        Model m;
        de_moe_model(t, &m, gptoss);
        for (int W = 1 + DE_SAN; W <= (DE_SAN ? 2 : DE_MAX_W); W++) {
            DeReference ref;
            de_reference(&m, W, 0, &ref);
            for (int N = 1 + DE_SAN; N <= 2; N++) {
                const DeRank proto = {.m = &m, .N = N, .sync = 1, .timeout_s = 60.0,
                                      .budget = N == 2 ? de_moe_budget(&m) : 0,
                                      .shard_weights = N == 2, .shard_store = N == 2};
                DeRank ranks[DE_MAX_W];
                de_run(&proto, W, NULL, ranks);
                char what[128];
                snprintf(what, sizeof what, "%.64s W %d N %d", m.cfg.name, W, N);
                de_check_ranks(t, what, ranks, W, &ref);
                for (int r = 0; r < W; r++) de_rank_free(&ranks[r]);
            }
            de_reference_free(&ref);
        }
        model_free(&m);
    }
}

// The delayed update with ranks: one rank with a communicator is the engine alone, bit for bit
// (with moe, the router statistics too: CE, aux and expert loads; and two ranks close to one),
// two ranks agree with each other. what names the model in the messages.
static void de_delayed_ranks(TestCtx* t, const Model* m, const char* what, int moe) {
    const double budget = de_moe_budget(m);
    DeRank alone = {.m = m, .rank = 0, .world = 1, .N = 2, .sync = 0, .budget = budget};
    de_rank_main(&alone);
    CHECK(t, alone.failed == 0, "%s: the engine alone: %s", what, alone.err);
    for (int W = 1; W <= 2 && !alone.failed; W++) {
        const DeRank proto = {.m = m, .N = 2, .sync = 0, .timeout_s = 60.0, .budget = budget};
        DeRank ranks[2];
        de_run(&proto, W, NULL, ranks);
        for (int r = 0; r < W; r++) {
            CHECK(t, ranks[r].failed == 0, "%s W %d rank %d: %s", what, W, r, ranks[r].err);
            if (ranks[r].failed) continue;
            const DeRank* want = W == 1 ? &alone : &ranks[0];
            for (int s = 0; s < DE_STEPS; s++)
                CHECK(t, ranks[r].loss[s] == want->loss[s] && ranks[r].norm[s] == want->norm[s] &&
                             (!moe || (ranks[r].ce[s] == want->ce[s] &&
                                       ranks[r].aux[s] == want->aux[s] &&
                                       memcmp(ranks[r].load[s], want->load[s],
                                              sizeof want->load[s]) == 0)),
                      "%s W %d rank %d step %d: loss %.17g norm %.17g aux %.17g, expected "
                      "%.17g %.17g %.17g", what, W, r, s + 1, ranks[r].loss[s], ranks[r].norm[s],
                      ranks[r].aux[s], want->loss[s], want->norm[s], want->aux[s]);
            CHECK(t, memcmp(ranks[r].flat[0], want->flat[0], want->n * sizeof(float)) == 0,
                  "%s W %d rank %d: the same %s", what, W, r, moe ? "weights" : "adapters");
        }
        if (moe && W == 2)  // (another grouping of the same sums)
            CHECK(t, fabs(ranks[0].loss[DE_STEPS - 1] - alone.loss[DE_STEPS - 1]) <
                         1e-3 * fabs(alone.loss[DE_STEPS - 1]),
                  "%s: two ranks close to one: %.9g vs %.9g", what, ranks[0].loss[DE_STEPS - 1],
                  alone.loss[DE_STEPS - 1]);
        for (int r = 0; r < W; r++) de_rank_free(&ranks[r]);
    }
    de_rank_free(&alone);
}

// MoE models with the delayed update: one rank with a communicator is the engine alone, bit for
// bit (statistics too); two ranks agree with each other.
static void test_dp_engine_moe_delayed(TestCtx* t) {
    for (int gptoss = 0; gptoss <= 1 - DE_SAN; gptoss++) {
        Model m;
        de_moe_model(t, &m, gptoss);
        de_delayed_ranks(t, &m, m.cfg.name, 1);
        model_free(&m);
    }
}

// ----------------------------------------------------------------------------
// LoRA

// Adapters on every linear (r 4, alpha 8): kind 0 the dense tied model with dropout 0.1 (each
// rank's masks those of its micro-batches in the single-process grouping), 1 the same on a q8_0
// base (blocks uploaded and dequantised on the device; no dropout), 2 test-qwen3moe with adapters
// on its experts and router (MoE refuses dropout).
static void de_lora_model(TestCtx* t, Model* m, int kind) {
    char err[ERR_LEN];
    ModelConfig c = test_engine_config(1);
    if (kind == 1) c.F = 64;  // (q8_0's blocks of 32)
    if (kind == 2) {
        CHECK(t, config_from_preset(&c, "test-qwen3moe", err) == 0, "%s", err);
        c.L = 5;
        c.output_router_logits = 1;
    }
    const LoraSpec l = {.r = 4, .alpha = 8, .targets = LORA_ALL_LINEAR,
                        .dropout = kind == 0 ? 0.1f : 0.0f};
    CHECK(t, model_init_lora(m, &c, 0, &l, err) == 0, "%s", err);
    if (kind == 1)
        CHECK(t, quant_table_set(&m->tt, BASE_DTYPE_Q8_0, NULL, &c, err) == 0, "%s", err);
}

// Two files the same, byte for byte.
static int de_same_file(const char* a, const char* b) {
    char err[ERR_LEN];
    size_t na = 0, nb = 0;
    char* x = file_read_all(a, 1u << 30, &na, err);
    char* y = file_read_all(b, 1u << 30, &nb, err);
    const int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

// LoRA: only the adapters are reduced, sharded (ZeRO-1: m and v of the adapters' shard) and
// gathered; the frozen base (fp32, or q8_0 blocks) is every rank's own copy and never travels. Sync
// mode on 1-4 ranks x 1-2 devices equals the single-process grouping bit for bit (losses, norms,
// adapters, m and v), and rank 0's PEFT export of the adapters is the grouping's byte for byte.
static void test_dp_engine_lora_sync(TestCtx* t) {
    for (int kind = 0; kind < (DE_SAN ? 1 : 3); kind++) {
        Model m;
        de_lora_model(t, &m, kind);
        for (int W = 1 + DE_SAN; W <= (DE_SAN ? 2 : DE_MAX_W); W++) {
            char ref_dir[1024], rank_dir[1024], name[64];
            snprintf(name, sizeof name, "dp_lora%d_ref%d", kind, W);
            test_path(t, ref_dir, sizeof ref_dir, name);
            DeReference ref;
            de_reference_export(&m, W, 0, ref_dir, &ref);
            for (int N = 1 + DE_SAN; N <= 2; N++) {
                snprintf(name, sizeof name, "dp_lora%d_w%d_n%d", kind, W, N);
                test_path(t, rank_dir, sizeof rank_dir, name);
                const DeRank proto = {.m = &m, .N = N, .sync = 1, .timeout_s = 60.0,
                                      .budget = N == 2 ? de_moe_budget(&m) : 0,
                                      .shard_weights = N == 2, .shard_store = N == 2,
                                      .export_dir = rank_dir};
                DeRank ranks[DE_MAX_W];
                de_run(&proto, W, NULL, ranks);
                char what[160];
                snprintf(what, sizeof what, "LoRA %d (%.64s) W %d N %d", kind, m.cfg.name, W, N);
                de_check_ranks(t, what, ranks, W, &ref);
                CHECK(t, ranks[0].shard > 0 && ranks[0].n == (size_t)m.tt.trainable_params,
                      "%s: the adapters alone are sharded (%lld of %lld)", what,
                      (long long)ranks[0].shard, (long long)m.tt.trainable_params);
                static const char* const files[] = {"adapter_model.safetensors",
                                                    "adapter_config.json"};
                for (int f = 0; f < 2 && !ranks[0].failed; f++) {
                    char a[1200], b[1200];
                    snprintf(a, sizeof a, "%s/%s", rank_dir, files[f]);
                    snprintf(b, sizeof b, "%s/%s", ref_dir, files[f]);
                    CHECK(t, de_same_file(a, b), "%s: rank 0's %s is the single-process "
                          "grouping's", what, files[f]);
                }
                for (int r = 0; r < W; r++) de_rank_free(&ranks[r]);
            }
            de_reference_free(&ref);
        }
        model_free(&m);
    }
}

// LoRA with the delayed update: one rank with a communicator is the engine alone, bit for bit;
// two ranks agree with each other.
static void test_dp_engine_lora_delayed(TestCtx* t) {
    for (int kind = 0; kind < (DE_SAN ? 1 : 3); kind++) {
        Model m;
        de_lora_model(t, &m, kind);
        char what[32];
        snprintf(what, sizeof what, "LoRA %d", kind);
        de_delayed_ranks(t, &m, what, 0);
        model_free(&m);
    }
}

// A rank that dies, or hangs, in the middle of a step: the others stop with a message naming
// it (at once, or within the timeout), and nothing hangs.
static void test_dp_engine_rank_failure(TestCtx* t) {
    Model m;
    de_model(t, &m);
    for (int hang = 0; hang <= 1; hang++) {
        const CommFault faults[3] = {COMM_FAULT_NONE, hang ? COMM_FAULT_HANG : COMM_FAULT_DIE,
                                     COMM_FAULT_NONE};
        // op 0 is the weights' check, then step 1's per-layer reduce-scatters: op 3 is inside
        // step 1's backward
        const DeRank proto = {.m = &m, .N = 2, .sync = 1, .timeout_s = hang ? 1.0 : 60.0,
                              .fault_op = 3};
        DeRank ranks[3];
        const double t0 = time_now_s();
        de_run(&proto, 3, faults, ranks);
        const double secs = time_now_s() - t0;
        for (int r = 0; r < 3; r++) {
            CHECK(t, ranks[r].failed == 1, "%s: rank %d stopped at step 1 (got %d: %s)",
                  hang ? "hang" : "die", r, ranks[r].failed, ranks[r].err);
            if (r != 1)
                CHECK(t, strstr(ranks[r].err, "rank 1") && strstr(ranks[r].err, "data parallel"),
                      "%s: rank %d names rank 1: '%s'", hang ? "hang" : "die", r, ranks[r].err);
            de_rank_free(&ranks[r]);
        }
        CHECK(t, secs < (hang ? 20.0 : 30.0), "%s: the others stop %s (%.2f s)",
              hang ? "hang" : "die", hang ? "within the 1 s timeout" : "at once", secs);
    }
    model_free(&m);
}

// ZeRO-1's host memory: after the steps each rank holds AdamW's m and v and the fp32 weights
// (shard_weights) for its shard only, about 1/W of them (page rounding at each layer's shard
// edges).
static void test_dp_engine_memory(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c = test_engine_config(1);
    c.C = 128;  // slabs of many pages, so that page rounding is small beside a shard
    c.F = 384;
    c.HD = 32;
    c.L = 2;
    c.V = 256;
    Model m;
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    const long page = sysconf(_SC_PAGESIZE);
    for (int W = 1; W <= DE_MAX_W; W *= 2) {
        const DeRank proto = {.m = &m, .N = 1, .sync = 1, .timeout_s = 60.0, .steps = 1,
                              .shard_weights = 1, .shard_store = 1};
        DeRank ranks[DE_MAX_W];
        de_run(&proto, W, NULL, ranks);
        for (int r = 0; r < W; r++) {
            const DeRank* k = &ranks[r];
            CHECK(t, k->failed == 0, "W %d rank %d: %s", W, r, k->err);
            // two slabs (m, v) per layer, each shard's two edges on partial pages; a page the
            // allocator or transparent huge pages bring back near a slab's edge (other ranks'
            // threads allocate beside it): a quarter more at most
            const double want = k->mv_bytes / W, slack = 4.0 * (double)page * (m.tt.n_layers + 1);
            CHECK(t, k->mv_resident <= 1.25 * want + slack && k->mv_resident >= want - slack,
                  "W %d rank %d: m and v take %.0f of %.0f bytes (1/W: %.0f)", W, r,
                  k->mv_resident, k->mv_bytes, want);
            const double want_w = k->w_bytes / W, slack_w = slack / 2;
            CHECK(t, k->w_resident <= 1.25 * want_w + slack_w &&
                         k->w_resident >= want_w - slack_w,
                  "W %d rank %d: the fp32 weights take %.0f of %.0f bytes (1/W: %.0f)", W, r,
                  k->w_resident, k->w_bytes, want_w);
            if (r == 0)
                printf("       W=%d: per rank AdamW m and v %.2f MiB of %.2f MiB, fp32 weights "
                       "%.2f MiB of %.2f MiB\n", W, k->mv_resident / (1 << 20),
                       k->mv_bytes / (1 << 20), k->w_resident / (1 << 20),
                       k->w_bytes / (1 << 20));
            de_rank_free(&ranks[r]);
        }
    }
    model_free(&m);
}

// A checkpoint of W ranks streamed layer by layer (checkpoint_save_state_gathered): the same files
// as the whole state gathered onto rank 0, while rank 0 holds its shard and about one layer more
// (never the whole state); read back into a rank's Store (store_create_shard), AdamW's m and v
// land in its shard only, equal to the checkpoint's there.
static void test_dp_engine_checkpoint_stream(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c = test_engine_config(1);
    c.C = 128;  // slabs of many pages (as dp_engine_memory)
    c.F = 384;
    c.HD = 32;
    c.L = 4;
    c.V = 256;
    Model m;
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    const long page = sysconf(_SC_PAGESIZE);
    double all = 0.0, layer_max = 0.0;
    for (int l = 0; l < m.tt.n_layers; l++) {
        all += 12.0 * (double)m.tt.state_numel[l];
        layer_max = fmax(layer_max, 4.0 * (double)m.tt.state_numel[l]);
    }
    for (int W = 2; W <= DE_MAX_W; W *= 2) {
        char dir[1024], a[1200], b[1200];
        char name[32];
        snprintf(name, sizeof name, "dp_stream%d", W);
        test_path(t, dir, sizeof dir, name);
        mkdir(dir, 0755);
        const DeRank proto = {.m = &m, .N = 1, .sync = 1, .timeout_s = 60.0, .steps = 2,
                              .shard_weights = 1, .shard_store = 1, .ckpt = dir};
        DeRank ranks[DE_MAX_W];
        de_run(&proto, W, NULL, ranks);
        for (int r = 0; r < W; r++) CHECK(t, ranks[r].failed == 0, "W %d rank %d: %s", W, r,
                                          ranks[r].err);
        // rank 0's shard (the largest) and one layer, with page slack: not the whole state
        const double bound = 1.25 * all / W + 1.1 * layer_max +
                             6.0 * (double)page * (m.tt.n_layers + 1);
        CHECK(t, ranks[0].ckpt_peak > 0 && ranks[0].ckpt_peak <= bound && bound < all,
              "W %d: rank 0 held %.0f bytes of m, v and weights while writing (bound %.0f, the "
              "whole state %.0f)", W, ranks[0].ckpt_peak, bound, all);
        printf("       W=%d: rank 0 held at most %.2f MiB of the %.2f MiB of fp32 weights, m "
               "and v while streaming a checkpoint\n", W, ranks[0].ckpt_peak / (1 << 20),
               all / (1 << 20));
        static const char* const files[] = {"model.safetensors", "train_state.safetensors"};
        for (int f = 0; f < 2; f++) {
            snprintf(a, sizeof a, "%s/streamed/step_2/%s", dir, files[f]);
            snprintf(b, sizeof b, "%s/whole/step_2/%s", dir, files[f]);
            size_t na = 0, nb = 0;
            char* x = file_read_all(a, 1u << 30, &na, err);
            char* y = file_read_all(b, 1u << 30, &nb, err);
            CHECK(t, x && y && na == nb && memcmp(x, y, na) == 0,
                  "W %d: %s streamed (%zu bytes) equals the whole gather's (%zu)", W, files[f],
                  na, nb);
            free(x);
            free(y);
        }
        // read back into each rank's shard: m and v there only, equal to the whole reading's
        snprintf(a, sizeof a, "%s/streamed/step_2", dir);
        Store whole;
        store_create(&whole, &m.tt);
        TrainState ts;
        train_state_init(&ts, 1);
        CHECK(t, checkpoint_load_state(a, &m, &whole, &ts, "{}", err) == 0, "%s", err);
        Store shards[DE_MAX_W];  // (all alive at once: a freed one's pages would be recycled)
        for (int r = 0; r < W; r++) {
            int64_t lo[64], hi[64];
            dp_engine_state_ranges(&m.tt, W, r, lo, hi);
            Store s;
            store_create_shard(&s, &m.tt, lo, hi);
            // (pages the allocator recycled from earlier stores hold memory outside the shard
            // already: give them back, so what is resident after the load is what it touched)
            for (int l = 0; l < m.tt.n_layers; l++) {
                store_release_state(&s, l, 0, lo[l], 0);
                store_release_state(&s, l, hi[l], m.tt.state_numel[l], 0);
            }
            shards[r] = s;
            CHECK(t, checkpoint_load_state(a, &m, &s, &ts, "{}", err) == 0, "%s", err);
            double mv = 0.0, mv_all = 0.0;
            int same = 1;
            for (int l = 0; l < m.tt.n_layers; l++) {
                const size_t bytes = (size_t)m.tt.state_numel[l] * sizeof(float);
                if (bytes == 0) continue;
                mv += test_resident_bytes(s.m[l], bytes) + test_resident_bytes(s.v[l], bytes);
                mv_all += 2.0 * (double)bytes;
                const size_t n = (size_t)(hi[l] - lo[l]) * sizeof(float);
                same &= memcmp(s.m[l] + lo[l], whole.m[l] + lo[l], n) == 0 &&
                        memcmp(s.v[l] + lo[l], whole.v[l] + lo[l], n) == 0;
            }
            const double slack = 4.0 * (double)page * (m.tt.n_layers + 1);
            CHECK(t, same && mv <= 1.25 * mv_all / W + slack,
                  "W %d rank %d: m and v read into the shard (equal %d), %.0f of %.0f bytes "
                  "resident", W, r, same, mv, mv_all);
        }
        for (int r = 0; r < W; r++) store_free(&shards[r]);
        train_state_free(&ts);
        store_free(&whole);
        for (int r = 0; r < W; r++) de_rank_free(&ranks[r]);
    }
    model_free(&m);
}

// ----------------------------------------------------------------------------
// through the trainer: checkpoints and resume

#define DT_STEPS 4

typedef struct DeTrainerRank {
    CommEmulWorld* w;
    const Model* m;     // made from the preset m->cfg.name
    const char* shard;
    const char* out;
    int rank, world, sync;
    int first, last;  // steps first..last; first > 1 resumes from out's step first-1
    int save_at;      // save a checkpoint after this step (0: none)
    double loss[DT_STEPS], norm[DT_STEPS];
    double aux[DT_STEPS], spread[DT_STEPS];  // MoE: the step line's aux loss and load spread
    float* params;
    size_t n;
    int rc;
    char err[ERR_LEN];
} DeTrainerRank;

// The trainer's engine options from its flags (train_roundpipe's, for emulated devices).
static EngineOptions de_engine_options(const TrainArgs* a, int use_cuda, int n_devices,
                                       int64_t start_step) {
    (void)use_cuda;
    (void)n_devices;
    return (EngineOptions){.B = a->batch, .T = a->seq, .M = a->micro_batches,
                           .M_R = a->round_micro_batches, .row_chunks = 1, .sync = a->sync,
                           .opt_threads = 1, .trace_path = "", .start_step = start_step,
                           .hyper = {a->lr, a->beta1, a->beta2, a->eps, a->weight_decay},
                           .sched = {a->schedule, a->lr, a->warmup, a->steps, a->min_lr_frac,
                                     a->decay_frac},
                           .grad_clip = a->grad_clip};
}

static void* de_trainer_rank_main(void* arg) {
    DeTrainerRank* k = arg;
    TrainArgs a;
    args_defaults(&a);
    a.model = k->m->cfg.name;
    a.train = k->shard;
    a.val = "";
    a.out = k->out;
    a.batch = 4;
    a.seq = 16;
    a.micro_batches = 4;
    a.steps = DT_STEPS;
    a.warmup = 2;
    a.threads = 1;
    a.sync = k->sync;
    a.sample_tokens = 0;
    a.n_devices = 2;
    if (k->m->tt.lora.r > 0) {
        a.lora_r = k->m->tt.lora.r;
        a.lora_alpha = k->m->tt.lora.alpha;
        a.lora_targets = k->m->tt.lora.targets;
    }
    char* args_json = args_to_json(&a);
    Store s;
    store_create(&s, &k->m->tt);
    store_init_random(&s, 7, 0.02f);
    de_init_lora(k->m, &s);
    TrainState ts;
    train_state_init(&ts, a.seed);
    DataLoader train;
    k->rc = dataloader_open(&train, k->shard, a.batch, a.seq, 0, a.seed, k->m->cfg.V, k->err);
    if (k->rc == 0 && k->first > 1) {
        char dir[1200];
        snprintf(dir, sizeof dir, "%s/step_%d", k->out, k->first - 1);
        k->rc = checkpoint_load_state(dir, k->m, &s, &ts, args_json, k->err);
        ts.resumed = 1;  // (as checkpoint_init_weights marks it: the pending weights are used)
        if (k->rc == 0) k->rc = dataloader_state_restore(&train, ts.train_loader, k->err);
    }
    Comm* c = NULL;
    if (k->rc == 0 && k->w) {
        CommInit in = {.rank = k->rank, .world = k->world, .timeout_s = 30.0, .local = k->w};
        c = comm_emul_impl.init(&in, k->err);
        if (!c) k->rc = -1;
    }
    Trainer tr;
    int created = 0;
    if (k->rc == 0)
        k->rc = trainer_create_ranked(&tr, &a, k->m, &s, &ts, 2, de_engine_options, c, k->err);
    if (k->rc == 0) created = 1;
    for (int step = k->first; k->rc == 0 && step <= k->last; step++) {
        const StepStats st = trainer_step(&tr, &train, step, step == k->save_at || step == k->last);
        k->loss[step - 1] = st.loss;
        k->norm[step - 1] = st.norm;
        k->aux[step - 1] = st.aux;
        k->spread[step - 1] = st.load_spread;
        if (step == k->save_at)
            k->rc = trainer_save_checkpoint(&tr, &train, step, args_json, k->err);
    }
    if (k->rc == 0) {
        k->rc = trainer_finish(&tr, k->err);
        if (k->rank == 0) k->params = de_flat(&s, 0, &k->n);
    }
    if (created) trainer_free(&tr);
    comm_destroy(c);
    dataloader_close(&train);
    train_state_free(&ts);
    store_free(&s);
    free(args_json);
    return NULL;
}

static void de_trainer_run(const Model* m, const char* shard, const char* out, int W, int sync,
                           int first, int last, int save_at, DeTrainerRank* ranks) {
    CommEmulWorld* w = comm_emul_world_create(W);
    pthread_t th[DE_MAX_W];
    fflush(stdout);  // the trainers print their plans and device lines: not into the report
    const int saved = test_stdout_mute();
    for (int r = 0; r < W; r++) {
        ranks[r] = (DeTrainerRank){.w = w, .m = m, .shard = shard, .out = out, .rank = r,
                                   .world = W, .sync = sync, .first = first, .last = last,
                                   .save_at = save_at};
        pthread_check(pthread_create(&th[r], NULL, de_trainer_rank_main, &ranks[r]));
    }
    for (int r = 0; r < W; r++) pthread_check(pthread_join(th[r], NULL));
    test_stdout_restore(saved);
    comm_emul_world_destroy(w);
}

// Checkpoints of W ranks (AdamW's state gathered on rank 0, which writes them) resume
// bit-exactly with the same W, in sync mode and with the delayed update (its pending weights
// are every rank's full master copy), and resume with another W.
static void de_resume(TestCtx* t, const char* preset, int lora) {
    char err[ERR_LEN], shard[1024], out[1024];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, preset, err) == 0, "%s", err);
    const LoraSpec l = {.r = 4, .alpha = 8, .targets = LORA_ALL_LINEAR};
    CHECK(t, model_init_lora(&m, &c, 0, lora ? &l : NULL, err) == 0, "%s", err);
    enum { NTOK = 3000 };
    uint32_t* toks = malloc_check(NTOK * sizeof(uint32_t));
    for (int i = 0; i < NTOK; i++) toks[i] = (uint32_t)((i * 7 + i / 13) % 61);
    test_path(t, shard, sizeof shard, "dp_engine.bin");
    CHECK(t, shard_write(shard, toks, NTOK, 2, err) == 0, "%s", err);
    free(toks);
    for (int sync = 1; sync >= 0; sync--) {
        char name[64];
        snprintf(name, sizeof name, "dp_engine_ckpt%d_%.24s%s", sync, preset, lora ? "_lora" : "");
        test_path(t, out, sizeof out, name);
        mkdir(out, 0755);
        DeTrainerRank two[2], first[2], resumed[2], four[4];
        de_trainer_run(&m, shard, out, 2, sync, 1, DT_STEPS, 0, two);
        de_trainer_run(&m, shard, out, 2, sync, 1, 2, 2, first);
        de_trainer_run(&m, shard, out, 2, sync, 3, DT_STEPS, 0, resumed);
        de_trainer_run(&m, shard, out, 4, sync, 3, DT_STEPS, 0, four);
        DeTrainerRank* all[] = {two, two + 1, first, first + 1, resumed, resumed + 1,
                                four, four + 1, four + 2, four + 3};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            CHECK(t, all[i]->rc == 0, "sync %d run %zu rank %d: %s", sync, i, all[i]->rank,
                  all[i]->err);
        if (lora) {  // the adapters alone, as one process writes them (no copy of the base)
            char a[1200], b[1200];
            snprintf(a, sizeof a, "%s/step_2/adapter_model.safetensors", out);
            snprintf(b, sizeof b, "%s/step_2/model.safetensors", out);
            CHECK(t, access(a, F_OK) == 0 && access(b, F_OK) != 0,
                  "%s sync %d: the checkpoint holds the adapters (PEFT), not the base", preset,
                  sync);
        }
        for (int s = 2; s < DT_STEPS; s++) {
            CHECK(t, resumed[0].loss[s] == two[0].loss[s] && resumed[0].norm[s] == two[0].norm[s],
                  "sync %d step %d: resumed with two ranks %.17g (norm %.17g), straight %.17g "
                  "(%.17g)", sync, s + 1, resumed[0].loss[s], resumed[0].norm[s], two[0].loss[s],
                  two[0].norm[s]);
            CHECK(t, resumed[1].loss[s] == resumed[0].loss[s], "sync %d step %d: the ranks agree",
                  sync, s + 1);
            // MoE: the step line's aux loss and load spread (the global batch's) too
            CHECK(t, resumed[0].aux[s] == two[0].aux[s] && resumed[1].aux[s] == two[0].aux[s] &&
                     resumed[0].spread[s] == two[0].spread[s] &&
                     (m.n_moe == 0 || (two[0].aux[s] > 0 && two[0].spread[s] >= 1.0)),
                  "%s sync %d step %d: aux %.17g spread %.17g resumed, %.17g %.17g straight",
                  preset, sync, s + 1, resumed[0].aux[s], resumed[0].spread[s], two[0].aux[s],
                  two[0].spread[s]);
            CHECK(t, fabs(four[0].loss[s] - two[0].loss[s]) < 1e-4 * fabs(two[0].loss[s]),
                  "sync %d step %d: resumed with four ranks %.9g, two %.9g", sync, s + 1,
                  four[0].loss[s], two[0].loss[s]);
        }
        CHECK(t, resumed[0].params && two[0].params && resumed[0].n == two[0].n &&
                 memcmp(resumed[0].params, two[0].params, two[0].n * sizeof(float)) == 0,
              "sync %d: the resumed run's final weights equal the straight run's", sync);
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->params);
    }
    model_free(&m);
}

static void test_dp_engine_resume(TestCtx* t) { de_resume(t, "test-qwen3", 0); }

// MoE models through the trainer: the same resume (each family), the step line's aux loss and
// expert load spread those of the global batch on every rank.
static void test_dp_engine_moe_resume(TestCtx* t) {
    de_resume(t, "test-qwen3moe", 0);
    if (!DE_SAN) de_resume(t, "test-gptoss", 0);
}

// LoRA through the trainer: checkpoints of the adapters alone (gathered whole onto rank 0, the
// single-process PEFT files) resume bit-exactly with the same world size, and with another.
static void test_dp_engine_lora_resume(TestCtx* t) {
    de_resume(t, "test-qwen3", 1);
    if (!DE_SAN) de_resume(t, "test-qwen3moe", 1);
}

const TestCase tests_dp_engine[] = {
    {"dp_engine_sync", test_dp_engine_sync},
    {"dp_engine_delayed", test_dp_engine_delayed},
    {"dp_engine_rank_failure", test_dp_engine_rank_failure},
    {"dp_engine_memory", test_dp_engine_memory},
    {"dp_engine_checkpoint_stream", test_dp_engine_checkpoint_stream},
    {"dp_engine_resume", test_dp_engine_resume},
    {"dp_engine_moe_sync", test_dp_engine_moe_sync},
    {"dp_engine_moe_delayed", test_dp_engine_moe_delayed},
    {"dp_engine_moe_resume", test_dp_engine_moe_resume},
    {"dp_engine_lora_sync", test_dp_engine_lora_sync},
    {"dp_engine_lora_delayed", test_dp_engine_lora_delayed},
    {"dp_engine_lora_resume", test_dp_engine_lora_resume},
    {NULL, NULL},
};
