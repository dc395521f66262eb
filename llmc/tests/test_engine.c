/*
 * test_engine.c — the RoundPipe engine on emulated CPU devices:
 *  - sync mode is bit-identical to the plain trainer (same micro-batches) for 1..4 devices, both
 *    recompute grains, several rounds per step, with random delays injected into every stream;
 *  - different micro-batch counts agree within fp32 summation noise;
 *  - async mode equals a reference loop that applies AdamW with a one-step delay;
 *  - the never-reset device cursor and plan validity.
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
#include "testing.h"

#define STEPS 4

// Timing assertions get more room under the sanitizers, which slow every memory access (the
// sanitizer builds exist to find races and memory errors, not to measure schedules).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define TIMING_SLACK 3.0
#else
#define TIMING_SLACK 1.0
#endif

typedef struct Run {
    double loss[STEPS];
    float* params;  // all parameter slabs concatenated after the last step
    int64_t n_params;
    int64_t gated;  // stages uploaded behind per-layer fences
    int slot_sets;  // parameter/gradient slot sets per device
    int64_t device_folds;  // iterations whose tied gradient was folded on a device
} Run;

static int32_t* make_batches(int B, int T, uint32_t seed, int V) {
    Rng r;
    rng_seed(&r, seed);
    int32_t* tok = malloc_check((size_t)STEPS * B * (T + 1) * sizeof(int32_t));
    for (int i = 0; i < STEPS * B * (T + 1); i++) tok[i] = (int32_t)rng_below(&r, (uint64_t)V);
    return tok;
}

static void init_store(Store* s, const Model* m) {
    store_create(s, &m->tt);
    store_init_random(s, 7, 0.2f);
}

// A model of config c with randomly initialised weights and n emulated devices.
typedef struct Fixture {
    Model m;
    Store s;
    DeviceSet devs;
} Fixture;

static void fixture_open(Fixture* f, const ModelConfig* c, int n_devices, const DeviceOptions* dopt) {
    char err[ERR_LEN];
    if (model_init(&f->m, c, 0, err) != 0) fatal("fixture: %s", err);
    init_store(&f->s, &f->m);
    device_set_open(&f->devs, &device_cpu_impl, n_devices, dopt);
}

static void fixture_close(Fixture* f) {
    device_set_close(&f->devs);
    store_free(&f->s);
    model_free(&f->m);
}

static AdamWHyper test_hyper(void) { return (AdamWHyper){3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f}; }
static LrSchedule test_sched(void) { return (LrSchedule){LR_COSINE, 3e-3f, 2, STEPS, 0.1f, 0.2f}; }

// The reference trainer (testing.c) on the CPU backend with this suite's init and optimizer.
// rounds > 1: the gradient of each round accumulated on its own, then added (split rounds);
// mlp_chunk > 0: long-sequence mode (Model.mlp_chunk).
static void run_reference_mode(Run* run, const ModelConfig* c, int B, int T, int M,
                               const int32_t* tokens, int delayed, int rounds, int mlp_chunk) {
    void* ctx = ops_cpu_create(1);
    RefTrain r = {.c = c, .ops = &ops_cpu, .ctx = ctx, .B = B, .T = T, .M = M, .steps = STEPS,
                  .delayed = delayed, .rounds = rounds, .mlp_chunk = mlp_chunk,
                  .hyper = test_hyper(), .sched = test_sched(), .init_seed = 7,
                  .init_scale = 0.2f};
    test_reference_train(&r, tokens, run->loss, &run->params, &run->n_params);
    ops_cpu_destroy(ctx);
}

static void run_reference_rounds(Run* run, const ModelConfig* c, int B, int T, int M,
                                 const int32_t* tokens, int delayed, int rounds) {
    run_reference_mode(run, c, B, T, M, tokens, delayed, rounds, 0);
}

static void run_reference(Run* run, const ModelConfig* c, int B, int T, int M,
                          const int32_t* tokens, int delayed) {
    run_reference_mode(run, c, B, T, M, tokens, delayed, 0, 0);
}

typedef struct EngineCase {
    int N, M, M_R, sync, delays;  // delays: see run_engine
    RecomputeGrain grain;
    double budget;  // device bytes (forces several stages when small)
    int replan_after;
    int host_single;  // one set of host checkpoints
    int slow_opt_us;  // the optimizer step takes this much longer (forces gated uploads)
    int row_chunks;   // 0: one (the sums match plain training with M micro-batches); K: K chunks
    int split;        // split rounds (one round per device at once)
} EngineCase;

// mlp_chunk: Model.mlp_chunk (long-sequence mode: chunked MLP, lean block activations)
static int run_engine_chunked(TestCtx* t, Run* run, const ModelConfig* c, int B, int T,
                              const EngineCase* ec, const int32_t* tokens, int mlp_chunk) {
    char err[ERR_LEN];
    // delays: 0 none, 1 up to 50 us before every stream item, larger values: up to that many us
    // before every activation upload only (readers of host checkpoints lag far behind)
    DeviceOptions dopt = {.threads = 1, .delay_seed = 99,
                          .max_delay_us = ec->delays == 1 ? 50 : ec->delays,
                          .delay_streams = ec->delays > 1 ? 1u << STREAM_ACT_UP : 0};
    Fixture fx;
    fixture_open(&fx, c, ec->N, &dopt);
    fx.m.mlp_chunk = mlp_chunk;
    EngineOptions eo = {.B = B, .T = T, .M = ec->M, .M_R = ec->M_R, .grain = ec->grain,
                        .sync = ec->sync, .device_budget = ec->budget, .opt_threads = 1,
                        .replan_after = ec->replan_after, .host_single = ec->host_single,
                        .fake_optimizer_us = ec->slow_opt_us,
                        .row_chunks = ec->row_chunks > 0 ? ec->row_chunks : 1, .trace_path = "",
                        .split_rounds = ec->split,
                        .hyper = test_hyper(), .sched = test_sched(), .grad_clip = 1.0f};
    // the case's budget is for the stages: the scratch and fixed hand-off buffers come on top
    if (ec->budget > 0) eo.device_budget += (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
    Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
    CHECK(t, e != NULL, "engine_create: %s", err);
    if (!e) {
        fixture_close(&fx);
        return -1;
    }
    // the memory model: the emulated devices hold exactly the predicted slots and hand-off
    // buffers (their workspace lives in host memory), and the whole prediction keeps the budget
    const EngineDeviceBytes db = engine_device_bytes(e);
    CHECK(t, db.total == db.slots + db.acts + db.scratch + db.handoff, "device bytes add up");
    if (eo.device_budget > 0)
        CHECK(t, (double)db.total <= eo.device_budget, "predicted %zu bytes over the budget %.0f",
              db.total, eo.device_budget);
    for (int g = 0; g < ec->N; g++) {
        DeviceStats st;
        device_cpu_impl.stats(fx.devs.dev[g], &st);
        CHECK(t, st.mem_in_use == db.slots + db.handoff,
              "device %d holds %zu bytes, predicted %zu (slots %zu + hand-off %zu)", g,
              st.mem_in_use, db.slots + db.handoff, db.slots, db.handoff);
    }
    // half the cases keep two iterations in flight (submit t+1 before collecting t), as the
    // trainer does; the results must not change
    const int pipelined = (ec->N + ec->M + ec->sync) % 2 == 0;
    for (int step = 0; step < STEPS; step++) {
        if (pipelined) {
            engine_submit(e, tokens + (size_t)step * B * (T + 1));
            if (step > 0) run->loss[step - 1] = engine_collect(e).loss;
            CHECK(t, engine_in_flight(e) == 1, "in flight after step %d", step);
        } else {
            run->loss[step] = engine_step(e, tokens + (size_t)step * B * (T + 1)).loss;
        }
    }
    if (pipelined) run->loss[STEPS - 1] = engine_collect(e).loss;
    CHECK(t, engine_in_flight(e) == 0, "nothing in flight at the end");
    engine_synchronize(e);
    CHECK(t, engine_steps_done(e) == STEPS, "steps done %lld", (long long)engine_steps_done(e));
    int S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
    if (ec->replan_after > 0)
        printf("       N=%d: re-planned %d time(s) from profiled times, now S=%d\n", ec->N,
               engine_replans(e), S);
    run->params = test_params_copy(&fx.m, &fx.s, &run->n_params);
    run->gated = engine_gated_stages(e);
    run->device_folds = engine_device_folds(e);
    run->slot_sets = db.slot_sets;
    engine_free(e);
    fixture_close(&fx);
    return S;
}

static int run_engine(TestCtx* t, Run* run, const ModelConfig* c, int B, int T,
                      const EngineCase* ec, const int32_t* tokens) {
    return run_engine_chunked(t, run, c, B, T, ec, tokens, 0);
}

static int runs_identical(const Run* a, const Run* b) {
    for (int i = 0; i < STEPS; i++)
        if (a->loss[i] != b->loss[i]) return 0;
    return a->n_params == b->n_params &&
           memcmp(a->params, b->params, (size_t)a->n_params * sizeof(float)) == 0;
}

static void test_engine_sync_matches_plain(TestCtx* t) {
    const int B = 8, T = 12;
    for (int tied = 0; tied <= 1; tied++) {
        ModelConfig c = test_engine_config(tied);
        int32_t* tokens = make_batches(B, T, 3 + tied, c.V);
        Run ref;
        run_reference(&ref, &c, B, T, 4, tokens, 0);
        // small budgets force many stages; rounds of 2 micro-batches exercise the cross-round
        // gradient accumulation
        const EngineCase cases[] = {
            {1, 4, 4, 1, 0, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 0},
            {1, 4, 2, 1, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 0, 0, 0},
            {2, 4, 4, 1, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 0, 0, 0},
            {3, 4, 4, 1, 1, RECOMPUTE_LAYER, 2.4e5, 0, 0, 0, 0, 0},
            {4, 4, 2, 1, 1, RECOMPUTE_LAYER, 3.2e5, 0, 0, 0, 0, 0},
            {4, 4, 4, 1, 1, RECOMPUTE_STAGE, 3.2e5, 0, 0, 0, 0, 0},
            // re-planned from profiled times after 2 iterations: the plan may change mid-run,
            // the numbers must not
            {3, 4, 4, 1, 1, RECOMPUTE_STAGE, 2.4e5, 2, 0, 0, 0, 0},
            {2, 4, 2, 1, 0, RECOMPUTE_LAYER, 4.4e5, 2, 0, 0, 0, 0},
            // one micro-batch per round (the long-sequence shape): single-parity buffers
            {2, 4, 1, 1, 1, RECOMPUTE_LAYER, 2.4e5, 0, 0, 0, 0, 0},
            {3, 4, 1, 1, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 0, 0, 0},
            // one set of host checkpoints (producers wait for the previous iteration's readers)
            {3, 4, 2, 1, 1, RECOMPUTE_LAYER, 2.4e5, 0, 1, 0, 0, 0},
            {2, 4, 4, 1, 1, RECOMPUTE_STAGE, 2.4e5, 0, 1, 0, 0, 0},
            // a slow optimizer, two iterations in flight (sync mode fences whole stages on the
            // controller: no gated uploads)
            {3, 4, 4, 1, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 20000, 0, 0},
            {1, 4, 2, 1, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 20000, 0, 0},
            // two micro-batches in two row chunks each: the same sums as four micro-batches
            {1, 2, 2, 1, 0, RECOMPUTE_STAGE, 0, 0, 0, 0, 2, 0},
            {2, 2, 2, 1, 1, RECOMPUTE_STAGE, 3.2e5, 0, 0, 0, 2, 0},
            {3, 2, 1, 1, 1, RECOMPUTE_LAYER, 3.2e5, 0, 0, 0, 2, 0},
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            Run r;
            int S = run_engine(t, &r, &c, B, T, &cases[k], tokens);
            if (S < 0) continue;
            CHECK(t, runs_identical(&r, &ref),
                  "tied %d, N=%d M_R=%d grain %d (S=%d): loss %.9g/%.9g ... not bit-identical to "
                  "plain %.9g/%.9g",
                  tied, cases[k].N, cases[k].M_R, cases[k].grain, S, r.loss[0], r.loss[STEPS - 1],
                  ref.loss[0], ref.loss[STEPS - 1]);
            CHECK(t, r.gated == 0, "case %zu: %lld gated uploads in sync mode", k,
                  (long long)r.gated);
            // the whole model in one stage folds a tied head's gradient on the device
            if (cases[k].replan_after == 0)
                CHECK(t, r.device_folds == (tied && S == 1 ? STEPS : 0),
                      "case %zu (tied %d, S %d): %lld device folds", k, tied, S,
                      (long long)r.device_folds);
            // (a re-planned run's stage count depends on measured times: not asserted)
            if (cases[k].budget > 0 && cases[k].replan_after == 0)
                CHECK(t, S >= 4, "budget should force several stages (S=%d)", S);
            free(r.params);
        }
        free(ref.params);
        free(tokens);
    }
}

// Long-sequence mode (a chunked MLP; blocks keep only qkv, att and lse, their backward
// recomputes the rest): the engine is bit-identical to plain training in the same mode, in
// stage and layer grain, with several stages, one micro-batch per round and split rounds.
static void test_engine_long_sequence_mode(TestCtx* t) {
    const int B = 4, T = 12;
    ModelConfig c = test_engine_config(1);
    int32_t* tokens = make_batches(B, T, 9, c.V);
    const int chunk = 5;  // 12 or 24 rows per micro-batch: uneven chunks
    for (int M = 1; M <= 2; M++) {
        Run ref;
        run_reference_mode(&ref, &c, B, T, M, tokens, 0, 0, chunk);
        const double budget = M == 1 ? 3.0e5 : 2.4e5;  // a few stages
        EngineCase cases[] = {
            {1, M, M, 1, 0, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 0},
            {2, M, M, 1, 1, RECOMPUTE_STAGE, budget, 0, 0, 0, 0, 0},
            {3, M, M, 1, 1, RECOMPUTE_LAYER, budget, 0, 1, 0, 0, 0},
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            Run run;
            const int S = run_engine_chunked(t, &run, &c, B, T, &cases[k], tokens, chunk);
            if (S < 0) continue;
            CHECK(t, runs_identical(&run, &ref),
                  "M %d case %zu (N %d, S %d): loss %.9g/%.9g vs plain %.9g/%.9g", M, k,
                  cases[k].N, S, run.loss[0], run.loss[STEPS - 1], ref.loss[0],
                  ref.loss[STEPS - 1]);
            if (cases[k].budget > 0) CHECK(t, S >= 3, "M %d case %zu: S %d", M, k, S);
            free(run.params);
        }
        free(ref.params);
    }
    // split rounds in this mode: bit-identical to a reference that splits the same way
    Run ref, run;
    run_reference_mode(&ref, &c, B, T, 2, tokens, 1, 2, chunk);
    const EngineCase split = {2, 2, 2, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 1};
    if (run_engine_chunked(t, &run, &c, B, T, &split, tokens, chunk) >= 0) {
        CHECK(t, runs_identical(&run, &ref), "split rounds: loss %.9g vs %.9g", run.loss[0],
              ref.loss[0]);
        free(run.params);
    }
    free(ref.params);
    free(tokens);
}

static void test_engine_microbatch_counts(TestCtx* t) {
    const int B = 8, T = 12;
    ModelConfig c = test_engine_config(0);
    int32_t* tokens = make_batches(B, T, 5, c.V);
    Run a, b;
    EngineCase ca = {2, 2, 2, 1, 0, RECOMPUTE_STAGE, 3.2e5, 0, 0, 0, 0, 0};
    EngineCase cb = {2, 8, 4, 1, 0, RECOMPUTE_STAGE, 3.2e5, 0, 0, 0, 0, 0};
    run_engine(t, &a, &c, B, T, &ca, tokens);
    run_engine(t, &b, &c, B, T, &cb, tokens);
    CHECK(t, fabs(a.loss[0] - b.loss[0]) <= 1e-5 * fabs(a.loss[0]), "first loss %.9g vs %.9g",
          a.loss[0], b.loss[0]);
    for (int i = 1; i < STEPS; i++)
        CHECK(t, fabs(a.loss[i] - b.loss[i]) <= 1e-3 * fabs(a.loss[i]), "loss %d: %.9g vs %.9g", i,
              a.loss[i], b.loss[i]);
    free(a.params);
    free(b.params);
    free(tokens);
}

static void test_engine_async_delayed(TestCtx* t) {
    const int B = 8, T = 12;
    for (int tied = 0; tied <= 1; tied++) {
        ModelConfig c = test_engine_config(tied);
        int32_t* tokens = make_batches(B, T, 11 + tied, c.V);
        Run ref;
        run_reference(&ref, &c, B, T, 4, tokens, 1);
        const EngineCase cases[] = {{1, 4, 4, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 0},
                                    {3, 4, 2, 0, 1, RECOMPUTE_LAYER, 2.4e5, 0, 1, 0, 0, 0},
                                    // long random delays on the activation uploads only (the
                                    // readers of the one host set of checkpoints)
                                    {3, 4, 2, 0, 3000, RECOMPUTE_LAYER, 2.4e5, 0, 1, 0, 0, 0},
                                    {3, 4, 4, 0, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 0, 0, 0},
                                    {2, 4, 2, 0, 1, RECOMPUTE_LAYER, 2.4e5, 0, 0, 0, 0, 0},
                                    // no budget: everything fused, two devices taking every
                                    // other iteration, two in flight
                                    {2, 4, 4, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 0},
                                    // a slow optimizer: stages enqueued before their weights
                                    // are written upload and start layer by layer (pipelined
                                    // cases: engine_step waits for that step anyway)
                                    {2, 4, 4, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 20000, 0, 0},
                                    {2, 4, 2, 0, 1, RECOMPUTE_STAGE, 2.4e5, 0, 0, 20000, 0, 0},
                                    {2, 4, 4, 0, 1, RECOMPUTE_LAYER, 2.4e5, 0, 1, 20000, 0, 0},
                                    // row chunks (2 x 2 = the reference's 4 micro-batches),
                                    // also with gated uploads and per-layer downloads
                                    {2, 2, 2, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 20000, 2, 0},
                                    {2, 2, 1, 0, 1, RECOMPUTE_LAYER, 2.4e5, 0, 1, 0, 2, 0},
                                    // re-planned from a profile of gated stages (their first
                                    // micro-batches left out; with one per round, kept)
                                    {2, 4, 4, 0, 1, RECOMPUTE_STAGE, 2.4e5, 2, 0, 20000, 0, 0},
                                    {2, 4, 1, 0, 1, RECOMPUTE_STAGE, 2.4e5, 2, 0, 20000, 0, 0}};
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            Run r;
            int S = run_engine(t, &r, &c, B, T, &cases[k], tokens);
            if (S < 0) continue;
            if (cases[k].N == 2 && cases[k].budget == 0)
                CHECK(t, S == 1, "two devices, no budget: S = %d, expected 1", S);
            if (cases[k].slow_opt_us > 0)
                CHECK(t, r.gated > 0, "case %zu: a slow optimizer but no gated upload", k);
            if (cases[k].replan_after == 0)
                CHECK(t, r.device_folds == (tied && S == 1 ? STEPS : 0),
                      "case %zu (tied %d, S %d): %lld device folds", k, tied, S,
                      (long long)r.device_folds);
            CHECK(t, runs_identical(&r, &ref),
                  "async tied %d N=%d M_R=%d: loss %.9g %.9g %.9g %.9g vs reference %.9g %.9g "
                  "%.9g %.9g",
                  tied, cases[k].N, cases[k].M_R, r.loss[0], r.loss[1], r.loss[2], r.loss[3],
                  ref.loss[0], ref.loss[1], ref.loss[2], ref.loss[3]);
            free(r.params);
        }
        free(ref.params);
        free(tokens);
    }
}

// Makespan of one sync iteration with uniform stages, in units of t (one micro-batch of one
// stage): slot i runs on device i % N, starts once its device is free and the previous slot has
// produced its first micro-batch, and lasts M*t.
static double uniform_makespan(int S, int N, int M) {
    double dev_free[64] = {0}, prev_start = -1.0, end = 0.0;
    for (int i = 0; i < S; i++) {
        double start = dev_free[i % N];
        if (i > 0 && start < prev_start + 1.0) start = prev_start + 1.0;
        dev_free[i % N] = start + M;
        prev_start = start;
        if (start + M > end) end = start + M;
    }
    return end;
}

// Uniform stages (every micro-batch of every stage sleeps the same time) in sync mode: the
// measured idle fraction of the devices matches the schedule's. When S is a multiple of N, device
// g starts at g*t and runs S/N slots back to back, the makespan is (S*M/N + N-1)*t and the idle
// fraction is exactly the paper's N(N-1) / (M*S + N(N-1)).
static void test_engine_bubble_formula(TestCtx* t) {
    const int B = 8, T = 8, M = 4;
    ModelConfig c = test_engine_config(0);
    int32_t* tokens = make_batches(B, T, 1, c.V);
    char err[ERR_LEN];
    for (int S_ = 4; S_ <= 12; S_ += 4) {
        CHECK_NEAR(t, 1.0 - S_ * M / (2.0 * uniform_makespan(S_, 2, M)),
                   2.0 / (M * S_ + 2.0), 1e-12, "makespan model = paper formula when N | S");
    }
    const int Ns[3] = {2, 3, 4};
    for (int k = 0; k < 3; k++) {
        const int N = Ns[k];
        DeviceOptions dopt = {.threads = 1};
        Fixture fx;
        fixture_open(&fx, &c, N, &dopt);
        EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .sync = 1, .device_budget = 2.4e5,
                            .opt_threads = 1, .trace_path = "", .fake_compute_us = 25000,
                            .hyper = test_hyper(), .sched = test_sched(), .grad_clip = 1.0f};
        eo.device_budget += (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
        Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
        CHECK(t, e != NULL, "%s", err);
        if (e) {
            const int S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
            const double want = 1.0 - (double)S * M / (N * uniform_makespan(S, N, M));
            engine_step(e, tokens);  // warm-up: the first measurement includes set-up
            double sum = 0;
            for (int i = 0; i < 2; i++) sum += engine_step(e, tokens).bubble;
            double got = sum / 2;
            CHECK(t, fabs(got - want) < 0.05 * TIMING_SLACK,
                  "N=%d S=%d: measured bubble %.3f, schedule %.3f", N,
                  S, got, want);
            printf("       N=%d M=%d S=%d: bubble measured %.2f%%, uniform schedule %.2f%%, "
                   "paper formula %.2f%%\n",
                   N, M, S, 100 * got, 100 * want, 100.0 * N * (N - 1) / (M * S + N * (N - 1)));
            engine_free(e);
        }
        fixture_close(&fx);
    }
    free(tokens);
}

// Split rounds: N rounds at once, one per device, each from zero, added in round order: bit for
// bit the reference that accumulates the rounds the same way, sync and delayed, with injected
// delays, a slow optimizer (gated uploads) and row chunks; refused where it cannot apply.
static void test_engine_split_rounds(TestCtx* t) {
    const int B = 8, T = 12;
    for (int tied = 0; tied <= 1; tied++) {
        ModelConfig c = test_engine_config(tied);
        int32_t* tokens = make_batches(B, T, 21 + tied, c.V);
        const EngineCase cases[] = {
            {2, 4, 0, 1, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 1},
            {2, 4, 0, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 1},
            {4, 4, 0, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 1},
            {2, 4, 0, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 20000, 0, 1},
            {2, 2, 0, 0, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 2, 1},  // 1 micro-batch x 2 chunks each
        };
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            const EngineCase* ec = &cases[k];
            Run ref, r;
            const int M_ref = ec->M * (ec->row_chunks > 0 ? ec->row_chunks : 1);
            run_reference_rounds(&ref, &c, B, T, M_ref, tokens, !ec->sync, ec->N);
            const int S = run_engine(t, &r, &c, B, T, ec, tokens);
            if (S >= 0) {
                CHECK(t, S == 1, "case %zu: split rounds with S = %d", k, S);
                CHECK(t, runs_identical(&r, &ref),
                      "split tied %d case %zu (N=%d sync %d): loss %.9g %.9g %.9g %.9g vs "
                      "reference %.9g %.9g %.9g %.9g", tied, k, ec->N, ec->sync, r.loss[0],
                      r.loss[1], r.loss[2], r.loss[3], ref.loss[0], ref.loss[1], ref.loss[2],
                      ref.loss[3]);
                // (every round folds its own part)
                CHECK(t, r.device_folds == (tied ? STEPS * ec->N : 0),
                      "case %zu: %lld device folds", k, (long long)r.device_folds);
                if (ec->slow_opt_us > 0)
                    CHECK(t, r.gated > 0, "case %zu: a slow optimizer but no gated upload", k);
                free(r.params);
            }
            free(ref.params);
        }
        free(tokens);
    }
    // refused: one device; a budget that forces several stages
    ModelConfig c = test_engine_config(0);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    for (int k = 0; k < 2; k++) {
        Fixture fx;
        fixture_open(&fx, &c, k == 0 ? 1 : 2, &dopt);
        EngineOptions eo = {.B = 8, .T = 12, .M = 4, .split_rounds = 1, .opt_threads = 1,
                            .trace_path = "", .hyper = test_hyper(), .sched = test_sched(),
                            .grad_clip = 1.0f, .row_chunks = 1};
        if (k == 1) eo.device_budget = 2.4e5 + (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
        err[0] = 0;
        Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
        CHECK(t, e == NULL && strstr(err, k == 0 ? "at least 2" : "one stage"),
              "split rounds case %d should be refused (err: %s)", k, err);
        if (e) engine_free(e);
        fixture_close(&fx);
    }
}

// A stage plan's loss is known before its backward stages have run: engine_collect returns then,
// and engine_wait_devices (which the trainer calls when nothing follows a step) waits for the rest.
static void test_engine_wait_devices(TestCtx* t) {
    const int B = 8, T = 8, M = 4;
    ModelConfig c = test_engine_config(0);
    int32_t* tokens = make_batches(B, T, 1, c.V);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    Fixture fx;
    fixture_open(&fx, &c, 1, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .sync = 0, .device_budget = 2.4e5,
                        .opt_threads = 1, .trace_path = "", .fake_compute_us = 5000,
                        .hyper = test_hyper(), .sched = test_sched(), .grad_clip = 1.0f};
    eo.device_budget += (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
    Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
    CHECK(t, e != NULL, "%s", err);
    if (e) {
        const PartitionPlan* p = engine_plan(e);
        const int S = p->n_fwd + p->n_bwd;
        CHECK(t, S >= 3, "the budget should force backward stages after the fused one (S %d)", S);
        DeviceStats st;
        engine_submit(e, tokens);
        (void)engine_collect(e);
        fx.devs.impl->stats(fx.devs.dev[0], &st);
        const double at_loss = st.busy_s[STREAM_COMPUTE];
        engine_wait_devices(e);
        fx.devs.impl->stats(fx.devs.dev[0], &st);
        const double at_end = st.busy_s[STREAM_COMPUTE];
        const double all = (double)S * M * eo.fake_compute_us * 1e-6;
        CHECK(t, at_loss < all - 0.5 * eo.fake_compute_us * 1e-6,
              "the loss came after all %d stages (%.3f s of %.3f s)", S, at_loss, all);
        CHECK(t, at_end >= all - 1e-3, "after engine_wait_devices %.3f s of %.3f s done", at_end, all);
        printf("       S=%d: compute done %.0f ms at the loss, %.0f ms after the wait (of %.0f)\n", S,
               at_loss * 1e3, at_end * 1e3, all * 1e3);
        engine_free(e);
    }
    fixture_close(&fx);
    free(tokens);
}

// The delayed optimizer must hide a slow CPU step: with uniform stages and a step that takes 80% of
// an iteration, the devices stay busy. (With one host gradient set, iteration t+1's gradient
// downloads waited for the step reading iteration t's: 23% bubble here, 31% at 95%.)
static void test_engine_slow_optimizer_hidden(TestCtx* t) {
    const int B = 8, T = 8, M = 8;
    ModelConfig c = test_engine_config(0);
    int32_t* tokens = make_batches(B, T, 1, c.V);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    Fixture fx;
    fixture_open(&fx, &c, 2, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .sync = 0, .device_budget = 2.4e5,
                        .opt_threads = 1, .trace_path = "", .fake_compute_us = 8000,
                        .hyper = test_hyper(), .sched = test_sched(), .grad_clip = 1.0f};
    eo.device_budget += (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
    Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
    CHECK(t, e != NULL, "%s", err);
    if (e) {
        const int S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
        // one iteration of device work: S*M micro-batch slots over 2 devices
        const double iter_us = (double)S * M * eo.fake_compute_us / 2;
        engine_free(e);
        eo.fake_optimizer_us = (int)(0.8 * iter_us);
        e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
        for (int i = 0; i < 2; i++) engine_step(e, tokens);  // fill the pipeline
        double sum = 0;
        for (int i = 0; i < 3; i++) sum += engine_step(e, tokens).bubble;
        CHECK(t, sum / 3 < 0.10 * TIMING_SLACK, "bubble %.1f%% with a step of 80%% of an iteration (S=%d)",
              100 * sum / 3, S);
        printf("       S=%d, step %.0f ms per %.0f ms iteration: bubble %.2f%%\n", S,
               0.8 * iter_us / 1e3, iter_us / 1e3, 100 * sum / 3);
        engine_free(e);
    }
    fixture_close(&fx);
    free(tokens);
}

// The mean wall time per iteration over steps - warm iterations after warm ones, one at a time
// (engine_step) or with two in flight (the trainer's submit t+1, collect t).
static double measure_period(Engine* e, const int32_t* tokens, int steps, int warm,
                             int pipelined) {
    double t0 = 0.0;
    for (int k = 0; k < steps; k++) {
        if (k == warm) t0 = time_now_s();
        if (pipelined) {
            if (engine_in_flight(e) == 0) engine_submit(e, tokens);
            if (k + 1 < steps) engine_submit(e, tokens);
            (void)engine_collect(e);
        } else {
            (void)engine_step(e, tokens);
        }
    }
    return (time_now_s() - t0) / (steps - warm);
}

// Two iterations in flight: with the whole model in the fused stage (S = 1) on two devices,
// iteration t+1 runs on the second device while t runs on the first (the delayed update makes
// them independent), so the period halves; one at a time it would not.
static void test_engine_two_iterations_overlap(TestCtx* t) {
    const int B = 8, T = 8, M = 4, FAKE = 15000;
    ModelConfig c = test_engine_config(1);
    int32_t* tokens = make_batches(B, T, 2, c.V);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    Fixture fx;
    fixture_open(&fx, &c, 2, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .sync = 0, .opt_threads = 1,
                        .trace_path = "", .fake_compute_us = FAKE, .hyper = test_hyper(),
                        .sched = test_sched(), .grad_clip = 1.0f};
    Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
    CHECK(t, e != NULL, "%s", err);
    if (e) {
        const int S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
        CHECK(t, S == 1, "two devices, no budget: everything fused expected, S = %d", S);
        const double iter_s = (double)S * M * FAKE / 1e6;  // one iteration on one device
        double period[2];
        for (int pipelined = 0; pipelined <= 1; pipelined++)
            period[pipelined] = measure_period(e, tokens, 8, 2, pipelined);
        printf("       S=%d, one iteration %.0f ms on one device: period %.0f ms one at a time, "
               "%.0f ms two in flight\n", S, iter_s * 1e3, period[0] * 1e3, period[1] * 1e3);
        CHECK(t, period[0] >= 0.95 * iter_s, "one at a time: period %.1f ms below one iteration",
              period[0] * 1e3);
        CHECK(t, period[1] <= 0.7 * iter_s * TIMING_SLACK,
              "two in flight: period %.1f ms, expected about half of %.1f ms", period[1] * 1e3,
              iter_s * 1e3);
        engine_free(e);
    }
    fixture_close(&fx);
    free(tokens);
}

// Gated uploads hide the optimizer step behind the first micro-batch's forward: S = 1 on two
// devices, one micro-batch (its forward half the iteration), a step of half an iteration. Each
// device needs the step applying its own previous gradient; uploading a stage only once the whole
// step is done, a device would idle for all of it: period >= (iteration + step) / 2. Layer by layer
// the forward follows the step and only the loss and backward wait for its end.
static void test_engine_gated_uploads_hide_step(TestCtx* t) {
    const int B = 8, T = 8, M = 1, FAKE = 60000, STEP_US = 30000;
    ModelConfig c = test_engine_config(1);
    int32_t* tokens = make_batches(B, T, 2, c.V);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    Fixture fx;
    fixture_open(&fx, &c, 2, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .sync = 0, .opt_threads = 1,
                        .trace_path = "", .fake_compute_us = FAKE, .fake_optimizer_us = STEP_US,
                        .hyper = test_hyper(), .sched = test_sched(), .grad_clip = 1.0f};
    Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
    CHECK(t, e != NULL, "%s", err);
    if (e) {
        const int S = engine_plan(e)->n_fwd + engine_plan(e)->n_bwd;
        CHECK(t, S == 1, "two devices, no budget: everything fused expected, S = %d", S);
        const int steps = 10;
        const double period = measure_period(e, tokens, steps, 3, 1);
        const double whole = (FAKE + STEP_US) / 2e6;  // what fencing whole stages would give
        printf("       S=1, M=1: iteration %d ms, step %d ms: period %.1f ms (whole-stage "
               "fences: >= %.0f ms), %lld gated stages\n", FAKE / 1000, STEP_US / 1000,
               period * 1e3, whole * 1e3, (long long)engine_gated_stages(e));
        CHECK(t, engine_gated_stages(e) >= steps - 3, "gated stages %lld",
              (long long)engine_gated_stages(e));
        CHECK(t, period <= 0.9 * whole * TIMING_SLACK, "period %.1f ms, expected well under %.1f",
              period * 1e3, whole * 1e3);
        engine_free(e);
    }
    fixture_close(&fx);
    free(tokens);
}

// Split rounds hide the optimizer step behind the next iteration: two devices, the whole model in
// one stage, a step of 40% of an iteration's device work. Alternating whole iterations, a device
// waits for the step of its own previous iteration; split, both devices run every iteration and
// the step of t overlaps iteration t+1.
static void test_engine_split_rounds_hide_step(TestCtx* t) {
    const int B = 8, T = 8, M = 4, FAKE = 10000, STEP_US = 16000;
    ModelConfig c = test_engine_config(1);
    int32_t* tokens = make_batches(B, T, 2, c.V);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    double period[2] = {0, 0};
    for (int split = 0; split <= 1; split++) {
        Fixture fx;
        fixture_open(&fx, &c, 2, &dopt);
        EngineOptions eo = {.B = B, .T = T, .M = M, .sync = 0, .opt_threads = 1,
                            .split_rounds = split, .trace_path = "", .fake_compute_us = FAKE,
                            .fake_optimizer_us = STEP_US, .hyper = test_hyper(),
                            .sched = test_sched(), .grad_clip = 1.0f, .row_chunks = 1};
        Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
        CHECK(t, e != NULL, "%s", err);
        if (e) {
            period[split] = measure_period(e, tokens, 10, 3, 1);
            engine_free(e);
        }
        fixture_close(&fx);
    }
    // ideal: M * FAKE of device work per iteration over two devices
    const double ideal = M * FAKE / 2e6;
    printf("       iteration %d ms of device work, step %d ms: period %.1f ms alternating, %.1f "
           "ms split (ideal %.1f)\n", M * FAKE / 1000, STEP_US / 1000, period[0] * 1e3,
           period[1] * 1e3, ideal * 1e3);
    CHECK(t, period[1] <= 1.15 * ideal * TIMING_SLACK, "split period %.1f ms, ideal %.1f ms",
          period[1] * 1e3, ideal * 1e3);
    CHECK(t, period[1] < 0.9 * period[0] || TIMING_SLACK > 1.0,
          "split %.1f ms not shorter than alternating %.1f ms", period[1] * 1e3, period[0] * 1e3);
    free(tokens);
}

// Row chunks chosen by the planner: under a tight device budget, computing each micro-batch in
// row chunks shrinks the activations and scratch so more layers fit the fused stage (less
// recompute); the choice is never worse than one chunk, takes one chunk when that is within 3%,
// and does take several somewhere in a range of budgets.
static void test_engine_row_chunks_chosen(TestCtx* t) {
    const int B = 16, T = 16, M = 2;
    ModelConfig c = test_engine_config(0);
    char err[ERR_LEN];
    DeviceOptions dopt = {.threads = 1};
    Fixture fx;
    fixture_open(&fx, &c, 1, &dopt);
    int several = 0, one = 0, compared = 0;
    for (double stage = 1.0e5; stage <= 2.0e7; stage *= 1.5) {
        double cost[2] = {0, 0};
        int chunks[2] = {0, 0}, ok = 1;
        for (int aut = 0; aut <= 1; aut++) {
            EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .sync = 1, .opt_threads = 1,
                                .row_chunks = aut ? 0 : 1, .trace_path = "",
                                .hyper = test_hyper(), .sched = test_sched(), .grad_clip = 1.0f};
            eo.device_budget = stage + (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
            Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
            if (!e) {
                ok = 0;
                continue;
            }
            cost[aut] = engine_plan(e)->cost;
            chunks[aut] = engine_row_chunks(e);
            CHECK(t, (double)engine_device_bytes(e).total <= eo.device_budget,
                  "chunks %d: the plan exceeds the budget", chunks[aut]);
            engine_free(e);
        }
        if (!ok) continue;
        compared++;
        CHECK(t, chunks[0] == 1 && cost[1] <= cost[0], "budget %.0f: auto cost %g (K %d) above "
              "one chunk's %g", stage, cost[1], chunks[1], cost[0]);
        if (cost[0] <= 1.03 * cost[1])
            CHECK(t, chunks[1] == 1, "budget %.0f: one chunk is within 3%% but K = %d", stage,
                  chunks[1]);
        several += chunks[1] > 1;
        one += chunks[1] == 1;
    }
    printf("       %d budgets compared: %d chose several row chunks, %d one\n", compared, several,
           one);
    CHECK(t, several >= 1 && one >= 1, "%d budgets compared: %d with several chunks, %d with one",
          compared, several, one);
    fixture_close(&fx);
}

// The whole model in one stage with one parameter/gradient slot set, when two sets do not fit
// the budget but one does: planned (S = 1 rather than a recomputing multi-stage plan), allocated
// as predicted (run_engine checks the emulated devices' bytes) and numerically the delayed
// reference, on one device and on two taking every other iteration.
static void test_engine_one_slot_set(TestCtx* t) {
    const int B = 8, T = 12, M = 4;
    ModelConfig c = test_engine_config(1);
    int32_t* tokens = make_batches(B, T, 21, c.V);
    Run ref;
    run_reference(&ref, &c, B, T, M, tokens, 1);
    for (int N = 1; N <= 2; N++) {
        char err[ERR_LEN];
        DeviceOptions dopt = {.threads = 1};
        Fixture fx;
        fixture_open(&fx, &c, N, &dopt);
        EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M, .opt_threads = 1, .row_chunks = 1,
                            .trace_path = "", .hyper = test_hyper(), .sched = test_sched(),
                            .grad_clip = 1.0f};
        Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
        CHECK(t, e != NULL, "%s", err);
        if (!e) {
            fixture_close(&fx);
            continue;
        }
        const EngineDeviceBytes two = engine_device_bytes(e);
        CHECK(t, engine_plan(e)->n_fwd + engine_plan(e)->n_bwd == 1 && two.slot_sets == 2,
              "no budget: one stage, two slot sets expected");
        const double fixed = (double)engine_fixed_device_bytes(&fx.m, 4, &eo);
        engine_free(e);
        fixture_close(&fx);
        // a total between one set's and two sets' needs
        const EngineCase ec = {N, M, M, 0, 1, RECOMPUTE_STAGE,
                               (double)two.total - (double)two.slots / 4 - fixed, 0, 0, 0, 0, 0};
        Run r;
        int S = run_engine(t, &r, &c, B, T, &ec, tokens);
        if (S < 0) continue;
        CHECK(t, S == 1 && r.slot_sets == 1, "N=%d: S = %d with %d slot sets, expected 1 and 1", N,
              S, r.slot_sets);
        CHECK(t, runs_identical(&r, &ref), "N=%d: one slot set: loss %.9g ... vs reference %.9g",
              N, r.loss[STEPS - 1], ref.loss[STEPS - 1]);
        free(r.params);
    }
    free(ref.params);
    free(tokens);
}

// ----------------------------------------------------------------------------
// mixture of experts

// test-qwen3moe with 5 blocks (block 1 dense: mlp_only_layers) or test-gptoss with 4 (a 4-token
// window < T in blocks 0 and 2, full attention in 1 and 3), the aux loss on or off.
static ModelConfig engine_moe_config(int gptoss, int aux) {
    char err[ERR_LEN];
    ModelConfig c;
    if (config_from_preset(&c, gptoss ? "test-gptoss" : "test-qwen3moe", err) != 0)
        fatal("%s", err);
    c.L = gptoss ? 4 : 5;
    if (gptoss) c.sliding[2] = 1;
    c.output_router_logits = aux;
    return c;
}

// The stages' share of the smallest device budget (in 3% steps) that still plans: as many stages
// as the model allows.
static double engine_tight_budget(const ModelConfig* c, int N, int B, int T, int M, int M_R,
                                  RecomputeGrain grain) {
    char err[ERR_LEN];
    Model m;
    if (model_init(&m, c, 0, err) != 0) fatal("%s", err);
    EngineOptions eo = {.B = B, .T = T, .M = M, .M_R = M_R, .grain = grain, .sync = 1,
                        .row_chunks = 1};
    const double fixed = (double)engine_fixed_device_bytes(&m, 4, &eo);
    double x = 0;
    for (int l = 0; l < m.tt.n_layers; l++) x += 16.0 * (double)m.tt.param_numel[l];
    for (;;) {
        eo.device_budget = fixed + 0.97 * x;
        if (engine_plan_fits(&m, 4, N, &eo, err) != 0) break;
        x *= 0.97;
    }
    model_free(&m);
    return x;
}

// MoE models through the engine are bit-identical to plain training (losses with and without the
// aux loss, and the weights after the steps, hence every gradient): forward stages hand their
// blocks' aux statistics to the fused stage, which hands the counts to the backward stages,
// whose recompute (stage or layer grain) routes the same tokens; also with the delayed update,
// gated uploads, one set of host checkpoints, rounds and split rounds.
static void test_engine_moe_matches_plain(TestCtx* t) {
    const int B = 8, T = 12;
    // (under ThreadSanitizer, which slows these runs fifty-fold, with the aux loss on only: the
    // hand-offs and their events are the same without it)
#if defined(__SANITIZE_THREAD__)
    const int k_step = 2;
#else
    const int k_step = 1;
#endif
    for (int k = 0; k < 4; k += k_step) {
        const int gptoss = k / 2, aux = k % 2 == 0;
        ModelConfig c = engine_moe_config(gptoss, aux);
        int32_t* tokens = make_batches(B, T, 21 + k, c.V);
        Run ref[3];  // sync, delayed, sync in two split rounds
        run_reference(&ref[0], &c, B, T, 4, tokens, 0);
        run_reference(&ref[1], &c, B, T, 4, tokens, 1);
        run_reference_rounds(&ref[2], &c, B, T, 4, tokens, 0, 2);
        const double st = engine_tight_budget(&c, 3, B, T, 4, 4, RECOMPUTE_STAGE);
        const double ly = engine_tight_budget(&c, 3, B, T, 4, 4, RECOMPUTE_LAYER);
        const struct {
            EngineCase ec;
            int ref;
        } cases[] = {
            {{1, 4, 4, 1, 0, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 0}, 0},
            {{2, 4, 4, 1, 1, RECOMPUTE_STAGE, st, 0, 0, 0, 0, 0}, 0},
            {{3, 4, 4, 1, 1, RECOMPUTE_LAYER, ly, 0, 0, 0, 0, 0}, 0},
            {{3, 4, 2, 1, 1, RECOMPUTE_STAGE, st, 0, 0, 0, 0, 0}, 0},
            {{2, 4, 1, 1, 1, RECOMPUTE_LAYER, ly, 0, 0, 0, 0, 0}, 0},
            {{3, 4, 4, 1, 1, RECOMPUTE_STAGE, st, 0, 1, 0, 0, 0}, 0},
            {{3, 4, 2, 0, 1, RECOMPUTE_LAYER, ly, 0, 1, 0, 0, 0}, 1},
            {{2, 4, 4, 0, 1, RECOMPUTE_STAGE, st, 0, 0, 20000, 0, 0}, 1},
            {{2, 4, 4, 1, 1, RECOMPUTE_STAGE, 0, 0, 0, 0, 0, 1}, 2},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            const EngineCase* ec = &cases[i].ec;
            Run r;
            int S = run_engine(t, &r, &c, B, T, ec, tokens);
            if (S < 0) continue;
            if (ec->budget > 0) CHECK(t, S >= 3, "%s case %zu: only %d stages", c.name, i, S);
            const Run* want = &ref[cases[i].ref];
            CHECK(t, runs_identical(&r, want),
                  "%s aux %d case %zu (N=%d M_R=%d grain %d, S=%d): loss %.9g/%.9g vs plain "
                  "%.9g/%.9g",
                  c.name, aux, i, ec->N, ec->M_R, ec->grain, S, r.loss[0], r.loss[STEPS - 1],
                  want->loss[0], want->loss[STEPS - 1]);
            free(r.params);
        }
        for (int i = 0; i < 3; i++) free(ref[i].params);
        free(tokens);
    }
    // row chunks would split the rows the aux loss couples: refused with one line
    char err[ERR_LEN];
    ModelConfig c = engine_moe_config(0, 1);
    Fixture fx;
    DeviceOptions dopt = {.threads = 1};
    fixture_open(&fx, &c, 1, &dopt);
    EngineOptions eo = {.B = 8, .T = 12, .M = 2, .row_chunks = 2, .sync = 1, .opt_threads = 1,
                        .trace_path = "", .hyper = test_hyper(), .sched = test_sched()};
    Engine* e = engine_create(&fx.m, &fx.s, &fx.devs, &eo, err);
    CHECK(t, e == NULL && strstr(err, "mixture-of-experts"), "MoE with row chunks: %s",
          e ? "accepted" : err);
    engine_free(e);
    fixture_close(&fx);
}

const TestCase tests_engine[] = {
    {"engine_sync_matches_plain", test_engine_sync_matches_plain},
    {"engine_microbatch_counts", test_engine_microbatch_counts},
    {"engine_async_delayed", test_engine_async_delayed},
    {"engine_bubble_formula", test_engine_bubble_formula},
    {"engine_wait_devices", test_engine_wait_devices},
    {"engine_split_rounds", test_engine_split_rounds},
    {"engine_long_sequence_mode", test_engine_long_sequence_mode},
    {"engine_split_rounds_hide_step", test_engine_split_rounds_hide_step},
    {"engine_slow_optimizer_hidden", test_engine_slow_optimizer_hidden},
    {"engine_two_iterations_overlap", test_engine_two_iterations_overlap},
    {"engine_gated_uploads_hide_step", test_engine_gated_uploads_hide_step},
    {"engine_row_chunks_chosen", test_engine_row_chunks_chosen},
    {"engine_one_slot_set", test_engine_one_slot_set},
    {"engine_moe_matches_plain", test_engine_moe_matches_plain},
    {NULL, NULL},
};
