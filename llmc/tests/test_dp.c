/*
 * test_dp.c — data parallelism on the plain path (llmc/dp.h; suite `dp`): the shard layout, and
 * W emulated ranks (threads of this process over comm_emul) training the tiny model for a few
 * steps against a single-process run that groups the micro-batches the same way (dp.h: rank r's
 * rows r, r + W, ... in M / W micro-batches, its gradients accumulated on their own, the W groups
 * added in rank order with comm_reference_sum, then one AdamW step over the whole model):
 * losses, norms, weights and, after dp_gather_state, AdamW's m and v bit for bit, on 1-4 ranks.
 * A rank that dies makes the others fail with a message naming it. Through the trainer
 * (trainer_attach_comm): one rank with a communicator trains as plain training does, bit for
 * bit; two ranks agree with each other and stay close to one; a checkpoint of two ranks (AdamW's
 * state gathered, rank 0 writing) resumes bit-exactly with two; a rank started from other
 * weights is refused. And --plan --world W.
 *
 * Rank threads only record; CHECKs run on the test's thread after pthread_join.
 */
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../adamw.h"
#include "../args.h"
#include "../checkpoint.h"
#include "../dataloader.h"
#include "../comm.h"
#include "../common.h"
#include "../config.h"
#include "../dp.h"
#include "../model.h"
#include "../ops.h"
#include "../plain.h"
#include "../rng.h"
#include "../store.h"
#include "../threads.h"
#include "../trainer.h"
#include "testing.h"

#define DP_MAX_W 4
#define DP_STEPS 3
#define DP_B 12  // divides by 1, 2, 3 and 4
#define DP_M 12
#define DP_T 8

static const AdamWHyper dp_hyper = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
static const LrSchedule dp_sched = {LR_COSINE, 1e-2f, 1, DP_STEPS, 0.1f, 0.0f};
static const float dp_clip = 0.5f;  // small enough to clip: the norm must agree exactly

// The run's batches: the same on every rank (every rank reads the global batch).
static void dp_batch(const ModelConfig* c, int step, int32_t* tokens) {
    Rng r;
    rng_seed(&r, 1000u + (uint32_t)step);
    for (int i = 0; i < DP_B * (DP_T + 1); i++) tokens[i] = (int32_t)rng_below(&r, (uint64_t)c->V);
}

// One rank's (or the reference's) model replica.
typedef struct Replica {
    Store s;
    void* ctx;
    Plain* p;
    ThreadPool* pool;
} Replica;

static void replica_init(Replica* x, const Model* m) {
    store_create(&x->s, &m->tt);
    store_init_random(&x->s, 5, 0.05f);
    x->ctx = ops_cpu_create(1);
    x->p = plain_create(m, &x->s, &ops_cpu, x->ctx, DP_B, DP_T, 0);
    x->pool = threadpool_create(1);
}

static void replica_free(Replica* x) {
    plain_free(x->p);
    ops_cpu_destroy(x->ctx);
    threadpool_destroy(x->pool);
    store_free(&x->s);
}

// Every trainable element of field (0 param, 1 m, 2 v) laid end to end (the layout's order).
static float* flat_copy(const Store* s, int field, size_t* n_out) {
    AdamWTensor* t = malloc_check((size_t)s->tt->n * sizeof(AdamWTensor));
    const int n = store_adamw_tensors(s, t);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += t[i].n;
    float* out = malloc_check((total ? total : 1) * sizeof(float));
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        const float* x = field == 0 ? t[i].param : field == 1 ? t[i].m : t[i].v;
        memcpy(out + o, x, t[i].n * sizeof(float));
        o += t[i].n;
    }
    free(t);
    *n_out = total;
    return out;
}

// ----------------------------------------------------------------------------
// the layout

static void test_dp_layout(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "tiny", err) == 0, "%s", err);
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    Store s;
    store_create(&s, &m.tt);
    for (int W = 1; W <= 7; W++) {
        for (int rank = 0; rank < W; rank++) {
            DpLayout d;
            CHECK(t, dp_layout_create(&d, &s, W, rank, err) == 0, "W %d: %s", W, err);
            CHECK(t, d.n == (size_t)m.tt.trainable_params, "W %d: %zu elements, model %lld", W,
                  d.n, (long long)m.tt.trainable_params);
            CHECK(t, d.lo[0] == 0 && d.lo[W] == d.n, "W %d: the shards cover the model", W);
            for (int r = 0; r < W; r++)
                CHECK(t, d.lo[r] <= d.lo[r + 1], "W %d: shard %d in order", W, r);
            CHECK(t, d.block <= d.n / W + ADAMW_CHUNK, "W %d: block %zu for %zu elements", W,
                  d.block, d.n);
            size_t len = 0;
            for (int i = 0; i < d.n_shard; i++) len += d.shard[i].n;
            CHECK(t, len == d.lo[rank + 1] - d.lo[rank], "W %d rank %d: shard pieces", W, rank);
            // a shard starts on a chunk boundary of its tensor (or on a tensor's start)
            if (d.n_shard > 0) {
                const float* p0 = d.shard[0].param;
                int ok = 0;
                for (int i = 0; i < d.n_tensors; i++)
                    if (p0 >= d.t[i].param && p0 < d.t[i].param + d.t[i].n)
                        ok = (size_t)(p0 - d.t[i].param) % ADAMW_CHUNK == 0;
                CHECK(t, ok, "W %d rank %d: the shard starts on an AdamW chunk boundary", W, rank);
            }
            dp_layout_free(&d);
        }
    }
    CHECK(t, dp_check_batch(12, 6, 4, err) != 0 && strstr(err, "--micro-batches 6"), "%s", err);
    CHECK(t, dp_check_batch(10, 10, 4, err) != 0 && strstr(err, "--batch 10"), "%s", err);
    CHECK(t, dp_check_batch(12, 12, 4, err) == 0, "12 x 12 over 4 ranks");
    store_free(&s);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// W ranks against the single-process grouping

typedef struct DpRank {
    CommEmulWorld* w;
    const Model* m;
    int rank, world;
    CommFault fault;   // injected on this rank at its first op
    double timeout_s;  // the communicator's
    double loss[DP_STEPS], norm[DP_STEPS];
    int failed;        // the step that failed (1-based), 0 none
    char err[ERR_LEN];
    float* params;     // (n) the final weights
    float* mv[2];      // (n) m and v after dp_gather_state
    size_t n;
} DpRank;

static void* dp_rank_main(void* arg) {
    DpRank* k = arg;
    CommInit in = {.rank = k->rank, .world = k->world, .timeout_s = k->timeout_s, .local = k->w};
    Comm* c = comm_emul_impl.init(&in, k->err);
    if (!c) {
        k->failed = -1;
        return NULL;
    }
    if (k->fault != COMM_FAULT_NONE) comm_emul_inject(c, k->fault, 0);
    Replica x;
    replica_init(&x, k->m);
    DpLayout d;
    if (dp_layout_create(&d, &x.s, k->world, k->rank, k->err) != 0) {
        k->failed = -1;
    } else {
        int32_t* tokens = malloc_check((size_t)DP_B * (DP_T + 1) * sizeof(int32_t));
        int32_t* rows = malloc_check((size_t)DP_B * (DP_T + 1) * sizeof(int32_t));
        for (int step = 1; step <= DP_STEPS && !k->failed; step++) {
            dp_batch(&k->m->cfg, step, tokens);
            const double local =
                dp_rank_gradients(x.p, tokens, DP_B, DP_T, DP_M, k->world, k->rank, rows);
            double sum = 0.0;
            int failed = 0;
            if (dp_sum_double(c, local, &sum, k->err) != 0) failed = 1;
            AdamWUpdate u = {0};
            if (!failed)
                u = dp_step(&d, c, x.pool, &dp_hyper, &dp_sched, dp_clip, step, &failed, k->err);
            if (failed) {
                k->failed = step;
                break;
            }
            k->loss[step - 1] = sum / ((double)DP_B * DP_T);
            k->norm[step - 1] = u.norm;
        }
        if (!k->failed && dp_gather_state(&d, c, k->err) != 0) k->failed = DP_STEPS + 1;
        if (!k->failed) {
            k->params = flat_copy(&x.s, 0, &k->n);
            k->mv[0] = flat_copy(&x.s, 1, &k->n);
            k->mv[1] = flat_copy(&x.s, 2, &k->n);
        }
        free(tokens);
        free(rows);
        dp_layout_free(&d);
    }
    replica_free(&x);
    comm_destroy(c);
    return NULL;
}

static void dp_run_ranks(const Model* m, int W, const CommFault* faults, double timeout_s,
                         DpRank* ranks) {
    CommEmulWorld* w = comm_emul_world_create(W);
    pthread_t th[DP_MAX_W];
    for (int r = 0; r < W; r++) {
        ranks[r] = (DpRank){.w = w, .m = m, .rank = r, .world = W, .timeout_s = timeout_s,
                            .fault = faults ? faults[r] : COMM_FAULT_NONE};
        pthread_check(pthread_create(&th[r], NULL, dp_rank_main, &ranks[r]));
    }
    for (int r = 0; r < W; r++) pthread_check(pthread_join(th[r], NULL));
    comm_emul_world_destroy(w);
}

static void dp_rank_free(DpRank* k) {
    free(k->params);
    free(k->mv[0]);
    free(k->mv[1]);
}

// The single-process run grouping the micro-batches as W ranks do (dp.h).
typedef struct DpReference {
    double loss[DP_STEPS], norm[DP_STEPS];
    float* params;
    float* mv[2];
    size_t n;
} DpReference;

static void dp_reference(const Model* m, int W, DpReference* ref) {
    Replica x;
    replica_init(&x, m);
    AdamWTensor* t = malloc_check((size_t)m->tt.n * sizeof(AdamWTensor));
    const int nt = store_adamw_tensors(&x.s, t);
    size_t n = 0;
    for (int i = 0; i < nt; i++) n += t[i].n;
    float* groups[DP_MAX_W];
    for (int r = 0; r < W; r++) groups[r] = malloc_check(n * sizeof(float));
    float* sum = malloc_check(n * sizeof(float));
    int32_t* tokens = malloc_check((size_t)DP_B * (DP_T + 1) * sizeof(int32_t));
    int32_t* rows = malloc_check((size_t)DP_B * (DP_T + 1) * sizeof(int32_t));
    for (int step = 1; step <= DP_STEPS; step++) {
        dp_batch(&m->cfg, step, tokens);
        double loss = 0.0;
        for (int r = 0; r < W; r++) {
            loss += dp_rank_gradients(x.p, tokens, DP_B, DP_T, DP_M, W, r, rows);
            size_t o = 0;
            for (int i = 0; i < nt; i++) {
                memcpy(groups[r] + o, t[i].grad, t[i].n * sizeof(float));
                o += t[i].n;
            }
        }
        comm_reference_sum((const void* const*)groups, W, n, COMM_F32, sum);
        size_t o = 0;
        for (int i = 0; i < nt; i++) {
            memcpy((float*)t[i].grad, sum + o, t[i].n * sizeof(float));
            o += t[i].n;
        }
        const AdamWUpdate u = adamw_update(x.pool, t, nt, &dp_hyper, &dp_sched, dp_clip, step);
        ref->loss[step - 1] = loss / ((double)DP_B * DP_T);
        ref->norm[step - 1] = u.norm;
    }
    ref->params = flat_copy(&x.s, 0, &ref->n);
    ref->mv[0] = flat_copy(&x.s, 1, &ref->n);
    ref->mv[1] = flat_copy(&x.s, 2, &ref->n);
    for (int r = 0; r < W; r++) free(groups[r]);
    free(sum);
    free(tokens);
    free(rows);
    free(t);
    replica_free(&x);
}

static void test_dp_sync_losses(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "tiny", err) == 0, "%s", err);
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    DpReference one;
    dp_reference(&m, 1, &one);
    for (int W = 1; W <= DP_MAX_W; W++) {
        DpReference ref;
        dp_reference(&m, W, &ref);
        DpRank ranks[DP_MAX_W];
        dp_run_ranks(&m, W, NULL, 30.0, ranks);
        for (int r = 0; r < W; r++) {
            const DpRank* k = &ranks[r];
            CHECK(t, k->failed == 0, "W %d rank %d failed at step %d: %s", W, r, k->failed,
                  k->err);
            if (k->failed) continue;
            for (int s = 0; s < DP_STEPS; s++) {
                CHECK(t, k->loss[s] == ref.loss[s], "W %d rank %d step %d: loss %.17g, the "
                      "single-process grouping %.17g", W, r, s + 1, k->loss[s], ref.loss[s]);
                CHECK(t, k->norm[s] == ref.norm[s], "W %d rank %d step %d: norm %.17g vs %.17g",
                      W, r, s + 1, k->norm[s], ref.norm[s]);
            }
            CHECK(t, k->n == ref.n && memcmp(k->params, ref.params, ref.n * sizeof(float)) == 0,
                  "W %d rank %d: the sharded run's weights equal the unsharded ones", W, r);
            CHECK(t, memcmp(k->mv[0], ref.mv[0], ref.n * sizeof(float)) == 0 &&
                     memcmp(k->mv[1], ref.mv[1], ref.n * sizeof(float)) == 0,
                  "W %d rank %d: AdamW m and v gathered equal the unsharded ones", W, r);
        }
        // the grouping changes the sums' order, not the mathematics: close to one rank's run
        CHECK(t, fabs(ref.loss[DP_STEPS - 1] - one.loss[DP_STEPS - 1]) <
                     1e-4 * fabs(one.loss[DP_STEPS - 1]),
              "W %d: last loss %.9g, one rank %.9g", W, ref.loss[DP_STEPS - 1],
              one.loss[DP_STEPS - 1]);
        for (int r = 0; r < W; r++) dp_rank_free(&ranks[r]);
        free(ref.params);
        free(ref.mv[0]);
        free(ref.mv[1]);
    }
    free(one.params);
    free(one.mv[0]);
    free(one.mv[1]);
    model_free(&m);
}

// A rank that dies at its first collective: the others fail at once, naming it.
static void test_dp_rank_failure(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "tiny", err) == 0, "%s", err);
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    const CommFault faults[3] = {COMM_FAULT_NONE, COMM_FAULT_DIE, COMM_FAULT_NONE};
    DpRank ranks[3];
    const double t0 = time_now_s();
    dp_run_ranks(&m, 3, faults, 60.0, ranks);
    const double secs = time_now_s() - t0;
    for (int r = 0; r < 3; r++) {
        CHECK(t, ranks[r].failed == 1, "rank %d stopped at step 1 (got %d)", r, ranks[r].failed);
        if (r != 1)
            CHECK(t, strstr(ranks[r].err, "rank 1") && strstr(ranks[r].err, "data parallel"),
                  "rank %d names the dead rank: '%s'", r, ranks[r].err);
        dp_rank_free(&ranks[r]);
    }
    CHECK(t, secs < 30.0, "the others fail at once, not at the 60 s timeout (%.2f s)", secs);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// through the trainer

#define DPT_STEPS 4

typedef struct DpTrainerRank {
    CommEmulWorld* w;    // NULL: no communicator (plain training)
    const Model* m;
    const char* shard;
    const char* out;     // checkpoints
    int rank, world;
    int first, last;     // steps first..last; first > 1 resumes from out's step first-1
    int save_at;         // save a checkpoint after this step (0: none)
    uint32_t init_seed;  // the random init (7 unless a test gives a rank other weights)
    double loss[DPT_STEPS], norm[DPT_STEPS], lr[DPT_STEPS];
    float* params;
    size_t n;
    int rc;
    char err[ERR_LEN];
} DpTrainerRank;

static void* dp_trainer_rank_main(void* arg) {
    DpTrainerRank* k = arg;
    TrainArgs a;
    args_defaults(&a);
    a.model = "test-qwen3";
    a.train = k->shard;
    a.val = "";
    a.out = k->out;
    a.batch = 4;
    a.seq = 16;
    a.micro_batches = 2;
    a.steps = DPT_STEPS;
    a.warmup = 2;
    a.threads = 1;
    a.sample_tokens = 0;
    char* args_json = args_to_json(&a);
    Store s;
    store_create(&s, &k->m->tt);
    store_init_random(&s, k->init_seed ? k->init_seed : 7, 0.02f);
    TrainState ts;
    train_state_init(&ts, a.seed);
    DataLoader train;
    k->rc = dataloader_open(&train, k->shard, a.batch, a.seq, 0, a.seed, k->m->cfg.V, k->err);
    if (k->rc == 0 && k->first > 1) {
        char dir[1200];
        snprintf(dir, sizeof dir, "%s/step_%d", k->out, k->first - 1);
        k->rc = checkpoint_load_state(dir, k->m, &s, &ts, args_json, k->err);
        if (k->rc == 0) k->rc = dataloader_state_restore(&train, ts.train_loader, k->err);
    }
    Comm* c = NULL;
    if (k->rc == 0 && k->w) {
        CommInit in = {.rank = k->rank, .world = k->world, .timeout_s = 10.0, .local = k->w};
        c = comm_emul_impl.init(&in, k->err);
        if (!c) k->rc = -1;
    }
    Trainer tr;
    int created = 0;
    if (k->rc == 0) k->rc = trainer_create(&tr, &a, k->m, &s, &ts, 0, NULL, k->err);
    if (k->rc == 0) created = 1;
    if (k->rc == 0 && c) k->rc = trainer_attach_comm(&tr, c, k->err);
    for (int step = k->first; k->rc == 0 && step <= k->last; step++) {
        const StepStats st = trainer_step(&tr, &train, step, 1);
        k->loss[step - 1] = st.loss;
        k->norm[step - 1] = st.norm;
        k->lr[step - 1] = st.lr;
        if (step == k->save_at)
            k->rc = trainer_save_checkpoint(&tr, &train, step, args_json, k->err);
    }
    if (k->rc == 0) {
        k->rc = trainer_finish(&tr, k->err);
        k->params = flat_copy(&s, 0, &k->n);
    }
    if (created) trainer_free(&tr);
    comm_destroy(c);
    dataloader_close(&train);
    train_state_free(&ts);
    store_free(&s);
    free(args_json);
    return NULL;
}

// W ranks (threads) of one run; comm 0: one rank without a communicator.
static void dp_trainer_run(const Model* m, const char* shard, const char* out, int W, int comm,
                           int first, int last, int save_at, DpTrainerRank* ranks,
                           uint32_t rank1_seed) {
    CommEmulWorld* w = comm ? comm_emul_world_create(W) : NULL;
    pthread_t th[DP_MAX_W];
    fflush(stdout);  // the trainers print their device lines: not into the test report
    const int saved = test_stdout_mute();
    for (int r = 0; r < W; r++) {
        ranks[r] = (DpTrainerRank){.w = w, .m = m, .shard = shard, .out = out, .rank = r,
                                   .world = W, .first = first, .last = last, .save_at = save_at,
                                   .init_seed = r == 1 ? rank1_seed : 0};
        pthread_check(pthread_create(&th[r], NULL, dp_trainer_rank_main, &ranks[r]));
    }
    for (int r = 0; r < W; r++) pthread_check(pthread_join(th[r], NULL));
    test_stdout_restore(saved);
    if (w) comm_emul_world_destroy(w);
}

static int dp_same(const DpTrainerRank* x, const DpTrainerRank* y, int from) {
    for (int i = from - 1; i < DPT_STEPS; i++)
        if (x->loss[i] != y->loss[i] || x->norm[i] != y->norm[i] || x->lr[i] != y->lr[i]) return 0;
    return x->n == y->n && x->params && y->params &&
           memcmp(x->params, y->params, x->n * sizeof(float)) == 0;
}

static void test_dp_trainer(TestCtx* t) {
    char err[ERR_LEN], shard[1024], out[1024];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "test-qwen3", err) == 0, "%s", err);
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    enum { NTOK = 3000 };
    uint32_t* toks = malloc_check(NTOK * sizeof(uint32_t));
    for (int i = 0; i < NTOK; i++) toks[i] = (uint32_t)((i * 7 + i / 13) % 61);
    test_path(t, shard, sizeof shard, "dp_trainer.bin");
    CHECK(t, shard_write(shard, toks, NTOK, 2, err) == 0, "%s", err);
    free(toks);
    test_path(t, out, sizeof out, "dp_ckpt");
    mkdir(out, 0755);
    DpTrainerRank plain[1], one[1], two[2], first[2], resumed[2];
    dp_trainer_run(&m, shard, out, 1, 0, 1, DPT_STEPS, 0, plain, 0);
    dp_trainer_run(&m, shard, out, 1, 1, 1, DPT_STEPS, 0, one, 0);
    dp_trainer_run(&m, shard, out, 2, 1, 1, DPT_STEPS, 0, two, 0);
    dp_trainer_run(&m, shard, out, 2, 1, 1, 2, 2, first, 0);
    dp_trainer_run(&m, shard, out, 2, 1, 3, DPT_STEPS, 0, resumed, 0);
    DpTrainerRank* all[] = {plain, one, two, two + 1, first, first + 1, resumed, resumed + 1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        CHECK(t, all[i]->rc == 0, "run %zu rank %d: %s", i, all[i]->rank, all[i]->err);
    CHECK(t, dp_same(plain, one, 1), "one rank with a communicator trains as plain training");
    CHECK(t, dp_same(&two[0], &two[1], 1), "the two ranks agree on losses and weights");
    for (int i = 0; i < DPT_STEPS; i++)
        CHECK(t, fabs(two[0].loss[i] - plain[0].loss[i]) < 1e-5 * fabs(plain[0].loss[i]),
              "step %d: two ranks %.9g, one %.9g", i + 1, two[0].loss[i], plain[0].loss[i]);
    CHECK(t, plain[0].loss[DPT_STEPS - 1] < plain[0].loss[0], "the loss falls");
    for (int r = 0; r < 2; r++)
        CHECK(t, dp_same(&resumed[r], &two[r], 3), "rank %d: resumed from the checkpoint of two "
              "ranks, steps 3-%d bit-identical to the straight run", r, DPT_STEPS);
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->params);
    // a rank started from other weights is refused when the communicator is attached
    DpTrainerRank other[2];
    dp_trainer_run(&m, shard, out, 2, 1, 1, 1, 0, other, 8);
    for (int r = 0; r < 2; r++) {
        CHECK(t, other[r].rc != 0 && strstr(other[r].err, "rank 1 starts from other weights"),
              "rank %d: '%s'", r, other[r].err);
        free(other[r].params);
    }
    model_free(&m);
}

// ----------------------------------------------------------------------------
// --plan --world W

static void test_dp_plan(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "llama3.1-8b", err) == 0, "%s", err);
    CHECK(t, model_init(&m, &c, 0, err) == 0, "%s", err);
    DpPlanInput in = {.m = &m, .world = 8, .net_gbps = 100, .step_s = 20.0, .rounds = 1,
                      .sync = 0, .host_bytes = 200e9, .grad_sets = 2};
    const DpPlan p = dp_plan_estimate(&in);
    const double P = (double)m.tt.trainable_params;
    CHECK(t, fabs(p.rs_bytes - 4.0 * P * 7 / 8) < 1.0 && fabs(p.ag_bytes - 2.0 * P * 7 / 8) < 1.0,
          "ring bytes: %g %g", p.rs_bytes, p.ag_bytes);
    CHECK(t, p.rs_s > 4.0 * P * 7 / 8 * 8 / 100e9 && p.rs_s < 4.0 * P * 8 / 100e9 + 0.1,
          "reduce-scatter time %g", p.rs_s);
    CHECK(t, fabs(p.host_saved - P * 20.0 * 7 / 8) < 1e3, "ZeRO-1 saves %g", p.host_saved);
    CHECK(t, p.exposed_s == 0.0 && p.efficiency == 1.0, "delayed, 20 s step: all hidden");
    in.step_s = 1.0;  // a step shorter than its traffic: the rest shows
    const DpPlan q = dp_plan_estimate(&in);
    CHECK(t, fabs(q.exposed_s - (q.rs_s + q.ag_s - 1.0)) < 1e-9 && q.efficiency < 1.0,
          "delayed, 1 s step: exposed %g", q.exposed_s);
    in.sync = 1;
    in.step_s = 20.0;
    const DpPlan s = dp_plan_estimate(&in);
    CHECK(t, s.rs_tail_s > 0 && s.rs_tail_s < s.rs_s && s.rs_bf16_tail_s < s.rs_tail_s,
          "sync: the reduce-scatter's tail %g of %g (bf16 %g)", s.rs_tail_s, s.rs_s,
          s.rs_bf16_tail_s);
    CHECK(t, s.exposed_s > s.rs_tail_s && s.efficiency < 1.0, "sync exposed %g", s.exposed_s);
    in.world = 512;
    const DpPlan big = dp_plan_estimate(&in);
    CHECK(t, big.rs_s > s.rs_s && big.rs_tail_s > s.rs_tail_s && big.opt_s < s.opt_s,
          "more ranks: more hop latency (%g vs %g s), a smaller AdamW shard", big.rs_s, s.rs_s);
    model_free(&m);

    // the CLI: --plan with a world size needs no rank or address, and prints the section
    int rc = test_run_cli(t, "dp_plan", "--plan --world 8 --net-gbps 400 --step-ms 1000");
    char* o = test_read_output(t, "dp_plan", "out");
    CHECK(t, rc == 0 && strstr(o, "data parallel over 8 ranks at 400 Gbit/s") &&
             strstr(o, "reduce-scatter left after the last layer's backward") &&
             strstr(o, "host memory per rank with ZeRO-1") &&
             strstr(o, "host memory per rank as this build runs it"),
          "--plan --world 8: rc %d\n%s", rc, o);
    free(o);
    rc = test_run_cli(t, "dp_gbps", "--plan --world 8 --net-gbps 0");
    o = test_read_output(t, "dp_gbps", "err");
    CHECK(t, rc == 2 && strstr(o, "--net-gbps '0'"), "--net-gbps 0 refused: rc %d '%s'", rc, o);
    free(o);
}

const TestCase tests_dp[] = {
    {"dp_layout", test_dp_layout},
    {"dp_sync_losses", test_dp_sync_losses},
    {"dp_rank_failure", test_dp_rank_failure},
    {"dp_trainer", test_dp_trainer},
    {"dp_plan", test_dp_plan},
    {NULL, NULL},
};
