/*
 * trainer.c — the step interface over plain training and the RoundPipe engine: building the
 * backend, one optimizer step with its statistics, evaluation, checkpoints, the end of the run.
 */
#include "trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "common.h"
#include "config.h"
#include "lora.h"
#include "plan_hint.h"
#include "quant.h"
#ifdef HAVE_CUDA
#include "../kernels/kernels.h"
#endif

// ----------------------------------------------------------------------------
// the batch split into micro-batches (plain path)

// Micro-batch mb of M splits the batch as evenly as possible: the first B % M get one more
// sequence (as the engine does, and the reference implementation).
static int mb_rows(const TrainArgs* a, int mb) {
    return a->batch / a->micro_batches + (mb < a->batch % a->micro_batches ? 1 : 0);
}

static const int32_t* mb_tokens(const TrainArgs* a, const int32_t* tokens, int mb) {
    int first = mb * (a->batch / a->micro_batches) + imin(mb, a->batch % a->micro_batches);
    return tokens + (size_t)first * (a->seq + 1);
}

// tokens (B, T+1). Returns the mean loss over the B*T targets; gradients land in the store.
// MoE models: the step's CE and aux parts (each micro-batch's aux weighted by its tokens, as its
// share of the objective is) and the expert load spread over all its micro-batches, into st.
static void moe_step_stats(const Trainer* t, const double* load, double ce_sum, double aux_sum,
                           StepStats* st) {
    const double n_tokens = (double)t->a->batch * t->a->seq;
    const int E = t->m->cfg.E;
    double mx = 0.0, sum = 0.0;
    for (int e = 0; e < E; e++) {
        sum += load[e];
        if (load[e] > mx) mx = load[e];
    }
    st->moe = 1;
    st->ce = ce_sum / n_tokens;
    st->aux = aux_sum / n_tokens;
    st->load_spread = sum > 0 ? mx / (sum / E) : 0.0;
}

// The gradients of one batch into the store; returns the step's mean objective (CE, plus the
// weighted aux loss for MoE models). st (optional): the MoE parts (moe_step_stats).
static double plain_batch_gradients(Trainer* t, const int32_t* tokens, StepStats* st) {
    const TrainArgs* a = t->a;
    const int T = a->seq;
    // Every micro-batch's gradient is scaled by 1/(tokens of the whole step), so the sum over
    // micro-batches is the gradient of the step's mean loss (docs/FORMATS.md §7.6).
    const float grad_scale = 1.0f / ((float)a->batch * (float)T);
    const int moe = t->m->n_moe > 0;
    double* load = moe ? calloc_check((size_t)t->m->cfg.E, sizeof(double)) : NULL;
    double loss_sum = 0.0, ce_sum = 0.0, aux_sum = 0.0;
    store_zero_grads(t->s);
    for (int mb = 0; mb < a->micro_batches; mb++) {
        t->plain->ws->lora_seed = lora_dropout_seed(a->seed, t->s->step, mb);
        loss_sum += plain_forward_backward(t->plain, mb_tokens(a, tokens, mb), mb_rows(a, mb), T,
                                           grad_scale);
        if (!moe) continue;
        const Plain* p = t->plain;
        ce_sum += p->ce_sum;
        aux_sum += p->aux * (double)mb_rows(a, mb) * T;
        for (int e = 0; e < t->m->cfg.E; e++) load[e] += p->ws->moe_counts_host[e];
    }
    plain_sync_grads(t->plain);
    store_fold_tied_grads(t->s);
    if (moe && st) moe_step_stats(t, load, ce_sum, aux_sum, st);
    free(load);
    return loss_sum / ((double)a->batch * T);
}

// ----------------------------------------------------------------------------
// building the backend


// GPUs, --threads 0: the controller (this thread) and the GPUs' issue threads (created by
// device_set_open, inheriting this thread's CPUs) keep the last N + 1 CPUs; the optimizer and its
// pool get the rest, so a pool thread never shares a core with a thread that feeds a launch
// queue. Returns the optimizer's CPUs in t->cpus (0: nothing pinned).
static int pin_feeding_threads(Trainer* t, int N) {
    if (!t->use_cuda || t->a->threads != 0) return 0;
    const int n_opt_cpus = threads_split_cpus(t->cpus, TRAINER_MAX_CPUS, N + 1, 2);
    if (n_opt_cpus > 0)
        printf("CPUs: the optimizer on %d, the controller and %d GPU issue thread(s) on %d\n",
               n_opt_cpus, N, N + 1);
    return n_opt_cpus;
}

// The N devices and the engine over them; prints the plan and the device line.
static int create_engine(Trainer* t, int N, int n_opt_cpus, TrainerEngineOptionsFn engine_options,
                         char* err) {
    const TrainArgs* a = t->a;
    TrainState* ts = t->ts;
    int per_dev = a->threads > 0 ? a->threads : threads_online_cpus() / N;
    DeviceOptions dopt = {.threads = per_dev > 0 ? per_dev : 1, .delay_seed = a->seed,
                          .max_delay_us = a->delay_us, .mem_limit = 0,
                          .profile_ops = a->profile_ops};
    const DeviceImpl* impl = &device_cpu_impl;
#ifdef HAVE_CUDA
    if (t->use_cuda) impl = &device_cuda_impl;
#endif
    device_set_open(&t->devs, impl, N, &dopt);
    EngineOptions eo = engine_options(a, t->use_cuda, N, ts->step);
    if (t->comm) {
        // data parallel through the engine: this rank's share of the global batch (its rows,
        // dp_take_rows, in M / W micro-batches), the gradients scaled by the global batch's
        // tokens and reduced over the ranks layer by layer (docs/DISTRIBUTED.md §6)
        const int W = t->comm->world;
        if (dp_check_batch(a->batch, a->micro_batches, W, err) != 0) return -1;
        eo.B = a->batch / W;
        eo.M = a->micro_batches / W;
        if (eo.M_R == a->micro_batches) eo.M_R = 0;  // (one round)
        eo.global_B = a->batch;
        eo.comm = t->comm;
        eo.reduce_bf16 = a->dp_reduce_bf16;
        // ZeRO-1 for the fp32 weights too, unless the plain path reads them between steps
        eo.shard_weights = !trainer_needs_plain(a, 1);
    }
    eo.seed = a->seed;  // LoRA dropout: the plain trainer's masks
    eo.release_frozen = trainer_releases_frozen(a, t->m, 1);  // (LoRA on GPUs)
    if (n_opt_cpus > 0) {
        eo.opt_cpus = t->cpus;
        eo.n_opt_cpus = n_opt_cpus;
        eo.opt_threads = n_opt_cpus;
    }
    const int weight_bytes = t->use_cuda ? 2 : 4;  // the engine devices' compute dtype
    if (ts->resumed && !a->sync && ts->pending_bytes) {
        // the delayed update's next weights, saved with the checkpoint
        if (ts->pending_bytes != weight_bytes)
            return errorf(err, "--resume: the checkpoint's pending weights have %d-byte elements "
                          "but this device computes with %d-byte elements (resume on the same "
                          "kind of device, or with --sync 1)", ts->pending_bytes, weight_bytes);
        eo.first_weights = (const void* const*)ts->pending;
        eo.first_norm = ts->pending_norm;
        eo.first_lr = ts->pending_lr;
    }
    t->eng = engine_create(t->m, t->s, &t->devs, &eo, err);
    if (!t->eng) {
        plan_hint_append(err, t->m, weight_bytes, N, &eo);  // a budget too small: which is enough
        return -1;
    }
    if (ts->resumed && !a->sync && !eo.first_weights)
        printf("note: the checkpoint has no pending weights of the delayed update: the first "
               "resumed iteration computes with the checkpoint's weights (one step fresher than "
               "an uninterrupted run)\n");
    train_state_free(ts);  // the pending weights are in the engine's buffers now
    engine_print_plan(t->eng, stdout);
    // (--rl: the engine's batch is the step's answers, eo.M micro-batches of --batch rows)
    const int M = a->rl.on ? eo.M : a->micro_batches, B = a->rl.on ? eo.B : a->batch;
    const int M_R = a->round_micro_batches > 0 ? a->round_micro_batches : M;
    if (M_R < N && a->split_rounds <= 0)
        printf("warning: %d micro-batches per round < %d devices: some devices idle every round "
               "(RoundPipe needs M_R >= N)\n", M_R, N);
    if (t->use_cuda)
        printf("device cuda:%d, batch %d x %d tokens in %d micro-batch(es)\n", N, B, a->seq, M);
    else
        printf("device cpu:%d (emulated, %d threads each), batch %d x %d tokens in %d "
               "micro-batch(es)\n", N, dopt.threads, B, a->seq, M);
    return 0;
}

// Engine runs only need the plain path for evaluation, sampling or --dump-state: on a GPU it
// holds a whole copy of the model, so it is made only when something will use it.
int trainer_needs_plain(const TrainArgs* a, int use_engine) {
    return !use_engine || a->val[0] || a->sample_tokens > 0 || a->dump_state[0] || a->rl.on;
}

int trainer_releases_frozen(const TrainArgs* a, const Model* m, int use_engine) {
    return use_engine && a->device == DEVICE_CUDA && m->tt.lora.r > 0 &&
           !trainer_needs_plain(a, use_engine) && !a->export_hf[0] && !a->export_gguf[0];
}

int trainer_streams_base(const TrainArgs* a, const Model* m, int use_engine) {
    return use_engine && m->tt.lora.r > 0 &&
           (quant_table_count(&m->tt) > 0 || a->device == DEVICE_CUDA) && !a->mmap_base &&
           !trainer_needs_plain(a, use_engine) && !a->export_hf[0] && !a->export_gguf[0];
}

int trainer_create(Trainer* t, const TrainArgs* a, const Model* m, Store* s, TrainState* ts,
                   int n_devices, TrainerEngineOptionsFn engine_options, char* err) {
    return trainer_create_ranked(t, a, m, s, ts, n_devices, engine_options, NULL, err);
}

int trainer_create_ranked(Trainer* t, const TrainArgs* a, const Model* m, Store* s,
                          TrainState* ts, int n_devices, TrainerEngineOptionsFn engine_options,
                          Comm* comm, char* err) {
    memset(t, 0, sizeof *t);
    if (comm && n_devices > 0) t->comm = comm;  // the engine's (plain: trainer_attach_comm)
    t->a = a;
    t->m = m;
    t->s = s;
    t->ts = ts;
    t->use_cuda = a->device == DEVICE_CUDA;
    t->drained = 1;
    const int use_engine = n_devices > 0;
    const int N = use_engine ? n_devices : 1;
    // (mixture-of-experts models on a backend without MoE ops: workspace_create says so)
    // The plain path also serves evaluation, sampling and --dump-state: on GPU 0 when training
    // on GPUs.
    t->ops = &ops_cpu;
#ifdef HAVE_CUDA
    if (t->use_cuda) {
        t->ops = &ops_cuda;
        t->ctx = ops_cuda_create(0, NULL);
        // --profile-ops times this context's ops too (GRPO's generator and its phases)
        if (a->profile_ops) ops_cuda_profile_enable(t->ctx);
    }
#endif
    if (!t->ctx) t->ctx = ops_cpu_create(a->threads);
    if (!use_engine) t->pool = threadpool_create(a->threads);
    const int Bm = mb_rows(a, 0);  // the largest micro-batch
    const int recompute = plain_needs_recompute(m, t->ops->act_bytes, Bm, a->seq);
    if (trainer_needs_plain(a, use_engine))
        t->plain = plain_create(m, s, t->ops, t->ctx, Bm, a->seq, recompute);
    const int n_opt_cpus = pin_feeding_threads(t, N);
    if (use_engine) {
        if (create_engine(t, N, n_opt_cpus, engine_options, err) != 0) return -1;
        // (the engine has made its bf16 copy of the base, releasing the fp32 one as it went)
        if (trainer_releases_frozen(a, m, use_engine)) store_release_frozen(s);
    } else if (t->use_cuda) {  // (--rl grpo: the plain path on GPU 0, AdamW on the host)
        printf("device cuda (GPU 0, plain path; AdamW on %d CPU threads), batch %d x %d tokens in "
               "%d micro-batch(es)%s\n", t->pool->n_threads, a->batch, a->seq, a->micro_batches,
               recompute ? ", recomputing activations" : "");
    } else {
        printf("device cpu (%d threads), batch %d x %d tokens in %d micro-batch(es)%s\n",
               t->pool->n_threads, a->batch, a->seq, a->micro_batches,
               recompute ? ", recomputing activations" : "");
    }
    train_state_free(ts);  // the pending weights: unused by a plain run
    if (!use_engine) {
        t->opt = malloc_named((size_t)m->tt.n * sizeof(AdamWTensor),
                              "the optimizer's tensor table");
        t->n_opt = store_adamw_tensors(s, t->opt);
    }
    t->sched = (LrSchedule){a->schedule, a->lr, a->warmup, a->steps, a->min_lr_frac, a->decay_frac};
    t->hyper = (AdamWHyper){a->lr, a->beta1, a->beta2, a->eps, a->weight_decay};
    t->tokens = malloc_named((size_t)a->batch * (a->seq + 1) * sizeof(int32_t),
                             "the token batch (--batch x (--seq + 1) tokens)");
    // tok/s, MFU and bubble over as many steps as devices (log.h); MFU on GPUs only, from the
    // model FLOPs per token (docs/PERFORMANCE.md §1.1)
    log_meter_init(&t->meter, t->eng ? t->devs.n : 1, (double)a->batch * a->seq,
                   config_flops_per_token(&m->cfg, a->seq),
                   t->use_cuda ? LOG_PEAK_FLOPS_PER_GPU * N : 0.0);
    if (comm && !use_engine) return trainer_attach_comm(t, comm, err);
    if (t->comm)
        t->dp_rows = malloc_named((size_t)(a->batch / comm->world) * (a->seq + 1) *
                                      sizeof(int32_t), "this rank's rows of the batch");
    return 0;
}

int trainer_attach_comm(Trainer* t, Comm* c, char* err) {
    const TrainArgs* a = t->a;
    if (t->eng)
        return errorf(err, "data parallel through the engine: the communicator goes to "
                           "trainer_create_ranked (internal error)");
    // (the engine's data parallel trains both: docs/DISTRIBUTED.md §6)
    if (t->m->tt.lora.r > 0 || t->m->n_moe > 0)
        return errorf(err, "data parallel on the plain path (--device cpu) does not train %s: "
                      "train through the engine (--device cpu:N or cuda)",
                      t->m->n_moe > 0 ? "mixture-of-experts models" : "LoRA adapters");
    if (dp_check_batch(a->batch, a->micro_batches, c->world, err) != 0) return -1;
    t->dp = malloc_named(sizeof(DpLayout), "the data-parallel layout");
    if (dp_layout_create(t->dp, t->s, c->world, c->rank, err) != 0) {
        free(t->dp);
        t->dp = NULL;
        return -1;
    }
    if (dp_check_same_weights(t->dp, c, err) != 0) {
        dp_layout_free(t->dp);
        free(t->dp);
        t->dp = NULL;
        return -1;
    }
    t->comm = c;
    t->dp_rows = malloc_named((size_t)(a->batch / c->world) * (a->seq + 1) * sizeof(int32_t),
                              "this rank's rows of the batch");
    return 0;
}

void trainer_free(Trainer* t) {
    if (t->dp) dp_layout_free(t->dp);
    free(t->dp);
    free(t->dp_rows);
    free(t->opt);
    free(t->tokens);
    if (t->eng) {
        engine_free(t->eng);
        device_set_close(&t->devs);
    }
    plain_free(t->plain);
    threadpool_destroy(t->pool);
#ifdef HAVE_CUDA
    if (t->use_cuda && t->a->profile_ops) {
        printf("plain path on GPU 0 (evaluation, sampling, GRPO's generator):\n");
        fflush(stdout);
        ops_cuda_profile_report(t->ctx, stdout);
    }
    if (t->use_cuda) ops_cuda_destroy(t->ctx);
    else
#endif
        ops_cpu_destroy(t->ctx);
    memset(t, 0, sizeof *t);
}

// ----------------------------------------------------------------------------
// one step

static void next_batch(DataLoader* dl, int32_t* tokens) {
    char err[ERR_LEN];
    if (dataloader_next_batch(dl, tokens, err) != 0) fatal("%s", err);
}

// The next batch into the engine: all of it, or with data parallelism this rank's rows.
static void engine_submit_next(Trainer* t, DataLoader* train) {
    next_batch(train, t->tokens);
    if (!t->comm) {
        engine_submit(t->eng, t->tokens);
        return;
    }
    dp_take_rows(t->tokens, t->a->batch, t->a->seq, t->comm->world, t->comm->rank, t->dp_rows);
    engine_submit(t->eng, t->dp_rows);
}

// The engine keeps up to two iterations in flight: this step's is submitted if nothing is (the
// first step, or the first after a stop), the next one unless the run stops after this step.
// The norm and lr are those of a fixed optimizer step (with the delayed update, the step
// applying the previous iteration's gradient).
static void engine_train_step(Trainer* t, DataLoader* train, int stop_after, StepStats* st) {
    Engine* eng = t->eng;
    int replans = engine_replans(eng);
    if (engine_in_flight(eng) == 0) engine_submit_next(t, train);
    if (!stop_after) engine_submit_next(t, train);
    EngineStepResult r = engine_collect(eng);
    if (r.error) fatal("%s", r.error);  // data parallel: a rank died or hung
    if (engine_replans(eng) != replans) {
        printf("re-planned from the measured stage times:\n");
        engine_print_plan(eng, stdout);
    }
    st->loss = r.loss;
    st->norm = r.norm;
    st->lr = r.lr;
    st->no_update = r.norm_step == 0;  // the delayed update's first iteration: no step yet
    st->bubble = r.bubble;
    if (r.load) moe_step_stats(t, r.load, r.ce_sum, r.aux_sum, st);  // MoE: as plain training
    st->dev_mib = 0;
    for (int g = 0; g < t->devs.n; g++) {
        DeviceStats ds;
        t->devs.impl->stats(t->devs.dev[g], &ds);
        st->dev_mib += (double)ds.mem_in_use / (1 << 20);
    }
    t->plain_stale = 1;
}

// Data parallel (dp.h): this rank's rows, the global loss, the ZeRO-1 step over the ranks. A
// failed collective (a rank that died or hung) ends the run with the comm's message naming it.
static void dp_train_step(Trainer* t, DataLoader* train, int step, StepStats* st) {
    const TrainArgs* a = t->a;
    char err[ERR_LEN];
    next_batch(train, t->tokens);
    const double local = dp_rank_gradients(t->plain, t->tokens, a->batch, a->seq, a->micro_batches,
                                           t->comm->world, t->comm->rank, t->dp_rows);
    double sum = 0.0;
    if (dp_sum_double(t->comm, local, &sum, err) != 0) fatal("%s", err);
    int failed = 0;
    const AdamWUpdate u = dp_step(t->dp, t->comm, t->pool, &t->hyper, &t->sched, a->grad_clip,
                                  step, &failed, err);
    if (failed) fatal("%s", err);
    st->loss = sum / ((double)a->batch * a->seq);
    st->norm = u.norm;
    st->lr = u.hyper.lr;
    t->s->step = step;
    plain_sync_params(t->plain);
}

static void plain_train_step(Trainer* t, DataLoader* train, int step, StepStats* st) {
    if (t->dp) {
        dp_train_step(t, train, step, st);
        return;
    }
    next_batch(train, t->tokens);
    st->loss = plain_batch_gradients(t, t->tokens, st);
    const AdamWUpdate u =
        adamw_update(t->pool, t->opt, t->n_opt, &t->hyper, &t->sched, t->a->grad_clip, step);
    st->norm = u.norm;
    st->lr = u.hyper.lr;
    t->s->step = step;
    plain_sync_params(t->plain);
}

// A non-finite loss computed with the weights the run started from (loaded, or randomly
// initialised) is no learning-rate problem: no update has touched them yet. Plain training and the
// synchronous engine compute their first step with them, the delayed update its first two.
static int uses_start_weights(const Trainer* t) {
    const int first_steps = t->eng && !t->a->sync ? 2 : 1;
    return t->n_collected <= first_steps;
}

static void fatal_nonfinite_loss(const Trainer* t, int step) {
    if (!uses_start_weights(t)) fatal("loss is not finite at step %d (try a lower --lr)", step);
    // (weights holding NaN or infinity are refused when they are loaded)
    fatal("loss is not finite at step %d, computed with the weights the run started from (no "
          "update has changed them yet, so not a learning-rate problem): their values overflow "
          "the computation; check --model (or --init-std) and the data", step);
}

StepStats trainer_step(Trainer* t, DataLoader* train, int step, int stop_after) {
    const double t0 = t->drained ? time_now_s() : t->t_last;
    StepStats st = {.step = step, .steps = t->a->steps, .mfu = -1, .bubble = -1, .dev_mib = -1};
    if (t->eng) engine_train_step(t, train, stop_after, &st);
    else plain_train_step(t, train, step, &st);
    t->n_collected++;
    if (!isfinite(st.loss)) fatal_nonfinite_loss(t, step);
    // nothing submitted after this step: its work after the loss (a stage plan's backward
    // stages; for a single step most of it) is step time too
    if (t->eng && stop_after) engine_wait_devices(t->eng);
    t->t_last = time_now_s();
    t->drained = stop_after;
    log_meter_record(&t->meter, &st, t->t_last - t0);
    st.host_mib = log_host_rss_mib();
    return st;
}

StepStats trainer_step_with(Trainer* t, int step, TrainerGradFn fn, void* arg) {
    if (t->eng || !t->plain) fatal("internal: trainer_step_with needs plain training");
    const double t0 = time_now_s();
    StepStats st = {.step = step, .steps = t->a->steps, .mfu = -1, .bubble = -1, .dev_mib = -1};
    store_zero_grads(t->s);
    st.loss = fn(arg, t->plain);
    plain_sync_grads(t->plain);
    store_fold_tied_grads(t->s);
    const AdamWUpdate u =
        adamw_update(t->pool, t->opt, t->n_opt, &t->hyper, &t->sched, t->a->grad_clip, step);
    st.norm = u.norm;
    st.lr = u.hyper.lr;
    t->s->step = step;
    plain_sync_params(t->plain);
    t->n_collected++;
    if (!isfinite(st.loss)) fatal_nonfinite_loss(t, step);
    t->t_last = time_now_s();
    t->drained = 1;
    log_meter_record(&t->meter, &st, t->t_last - t0);
    st.host_mib = log_host_rss_mib();
    return st;
}

StepStats trainer_step_engine_loss(Trainer* t, int step, const int32_t* tokens,
                                   const EngineLoss* loss, const float** logp) {
    if (!t->eng || engine_in_flight(t->eng) > 0)
        fatal("internal: trainer_step_engine_loss needs the engine with nothing in flight");
    const double t0 = time_now_s();
    StepStats st = {.step = step, .steps = t->a->steps, .mfu = -1, .bubble = -1, .dev_mib = -1};
    engine_submit_loss(t->eng, tokens, loss);
    const EngineStepResult r = engine_collect(t->eng);
    *logp = r.logp;
    st.loss = r.loss;
    st.norm = r.norm;
    st.lr = r.lr;
    st.no_update = r.norm_step == 0;  // the delayed update's first iteration: no step yet
    st.bubble = r.bubble;
    // the step of this iteration's gradient applied (delayed: queued during it) before the
    // caller reads the Store's weights
    engine_synchronize(t->eng);
    st.dev_mib = 0;
    for (int g = 0; g < t->devs.n; g++) {
        DeviceStats ds;
        t->devs.impl->stats(t->devs.dev[g], &ds);
        st.dev_mib += (double)ds.mem_in_use / (1 << 20);
    }
    t->plain_stale = 1;
    t->n_collected++;
    if (!isfinite(st.loss)) fatal_nonfinite_loss(t, step);
    t->t_last = time_now_s();
    t->drained = 1;
    log_meter_record(&t->meter, &st, t->t_last - t0);
    st.host_mib = log_host_rss_mib();
    return st;
}

// ----------------------------------------------------------------------------
// evaluation, checkpoints, the end

// The plain path computes with the store's weights: after engine steps, wait for the optimizer
// and copy them (a no-op on the CPU, where the plain path works on the store itself).
static void sync_plain(Trainer* t) {
    if (!t->plain_stale) return;
    engine_synchronize(t->eng);
    if (t->plain) plain_sync_params(t->plain);
    t->plain_stale = 0;
}

double trainer_evaluate(Trainer* t, DataLoader* val) {
    const TrainArgs* a = t->a;
    const int T = a->seq;
    sync_plain(t);
    int64_t n_batches = dataloader_batches_per_epoch(val);
    if (n_batches > a->eval_batches) n_batches = a->eval_batches;
    dataloader_reset(val);
    double sum = 0.0;
    for (int64_t i = 0; i < n_batches; i++) {
        next_batch(val, t->tokens);
        for (int mb = 0; mb < a->micro_batches; mb++)
            sum += plain_forward_loss(t->plain, mb_tokens(a, t->tokens, mb), mb_rows(a, mb), T);
    }
    return sum / ((double)n_batches * a->batch * T);
}

double trainer_batch_gradients(Trainer* t, DataLoader* train) {
    next_batch(train, t->tokens);
    return plain_batch_gradients(t, t->tokens, NULL);
}

int trainer_in_flight(const Trainer* t) { return t->eng ? (int)engine_in_flight(t->eng) : 0; }

// A data-parallel engine checkpoint: layer l's field complete on rank 0 as it is written.
static int gather_checkpoint_layer(void* ctx, int field, int l, char* err) {
    return engine_gather_layer(ctx, field, l, 0, err);
}

int trainer_save_checkpoint(Trainer* t, const DataLoader* train, int step, const char* args_json,
                            char* err) {
    TrainState* ts = t->ts;
    // data parallel, plain path: m and v whole on every rank (the single-process checkpoint),
    // rank 0 writes
    if (t->dp && dp_gather_state(t->dp, t->comm, err) != 0) return -1;
    // through the engine (ZeRO-1): rank 0 writes the same files, each layer gathered onto it as
    // it is written (every rank takes part), so it never holds the whole state; LoRA's adapters
    // (a PEFT directory, not in layer order, and small) are gathered whole onto rank 0 first
    const int lora_dp = t->eng && t->comm && t->m->tt.lora.r > 0;
    const int streamed = t->eng && t->comm && !lora_dp;
    if (lora_dp && engine_gather_state(t->eng, 0, 1, err) != 0) return -1;
    if (t->comm && t->comm->rank != 0 && !streamed) {
        if (lora_dp) engine_release_state(t->eng);
        return 0;
    }
    if (t->eng) engine_synchronize(t->eng);
    ts->step = step;
    dataloader_state_save(train, ts->train_loader);
    void** next = NULL;
    if (t->eng && !t->a->sync) {
        // the delayed update: the next iteration computes with weights one step behind
        const int n_layers = t->m->tt.n_layers;
        next = malloc_named((size_t)n_layers * sizeof(void*),
                            "the checkpoint's pending-weight table");
        for (int l = 0; l < n_layers; l++) next[l] = (void*)engine_next_weights(t->eng, l);
        ts->pending = next;
        ts->pending_bytes = engine_weight_bytes(t->eng);
        ts->pending_owned = 0;
        engine_last_update(t->eng, &ts->pending_norm, &ts->pending_lr);
    }
    const CkptGather g = {.layer = gather_checkpoint_layer, .ctx = t->eng,
                          .writer = streamed && t->comm->rank == 0};
    int rc = checkpoint_save_state_gathered(t->a->out, t->a->keep, t->m, t->s, ts, args_json,
                                            streamed ? &g : NULL, err);
    // (ZeRO-1: the last layer, or LoRA's whole state, back to the shard)
    if (streamed || lora_dp) engine_release_state(t->eng);
    free(next);
    ts->pending = NULL;
    ts->pending_bytes = 0;
    return rc;
}

int trainer_finish(Trainer* t, char* err) {
    if (!t->eng) return 0;
    engine_synchronize(t->eng);
    // data parallel: the exact fp32 weights on rank 0, for what it writes (--out, the exports)
    // and the plain path; sharded and nothing to write, they stay sharded (llmc/memory.c counts
    // the gathered copy)
    const TrainArgs* a = t->a;
    const int writes = a->out[0] || a->export_hf[0] || a->export_gguf[0] || a->export_lora[0];
    if (t->comm && (writes || trainer_needs_plain(a, 1)) &&
        engine_gather_state(t->eng, 0, 0, err) != 0)
        return -1;
    if (t->plain) plain_sync_params(t->plain);
    t->plain_stale = 0;
    if (engine_write_trace(t->eng, err) != 0) return -1;
    if (t->a->trace[0]) printf("trace written to %s\n", t->a->trace);
    return 0;
}
