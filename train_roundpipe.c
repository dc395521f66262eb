/*
 * train_roundpipe.c — the run, top to bottom: parse the flags, load the model and its weights,
 * build the trainer (plain training on the CPU, or the RoundPipe engine over N devices), open the
 * data, train (step, log, checkpoint, evaluate), then sample and export. Every output is checked
 * before anything is loaded, --out is locked for the run, and SIGINT/SIGTERM stop it cleanly
 * (the step finishes, a checkpoint and the exports are written, exit 130/143). `--tokenize` is a
 * mode of its own: text into token shards (llmc/tokenize_shards.h).
 *
 *   make && ./train_roundpipe            trains the built-in tiny model on the shipped corpus
 *   ./train_roundpipe --help             every flag with its default
 *
 * Everything below is a table of contents: the work happens in llmc/ (trainer.h for the step).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llmc/args.h"
#include "llmc/checkpoint.h"
#include "llmc/common.h"
#include "llmc/config.h"
#include "llmc/comm.h"
#include "llmc/dataloader.h"
#include "llmc/dist.h"
#include "llmc/dp.h"
#include "llmc/engine.h"
#include "llmc/grpo.h"
#include "llmc/grpo_ranks.h"
#include "llmc/interrupt.h"
#include "llmc/log.h"
#include "llmc/loader.h"
#include "llmc/lora.h"
#include "llmc/quant.h"
#include "llmc/memory.h"
#include "llmc/model.h"
#include "llmc/outputs.h"
#include "llmc/plan_hint.h"
#include "llmc/sample.h"
#include "llmc/store.h"
#include "llmc/threads.h"
#include "llmc/tokenize_shards.h"
#include "llmc/trainer.h"
#ifdef HAVE_CUDA
#include "kernels/kernels.h"
#endif

// ----------------------------------------------------------------------------
// the devices and the plan

// The devices: N emulated (--device cpu:N), the GPUs (--device cuda, cuda:N), or none (0: plain
// training on the CPU).
static int resolve_devices(const TrainArgs* a) {
    int N = a->n_devices;
#ifdef HAVE_CUDA
    const int use_cuda = a->device == DEVICE_CUDA;
    // --plan with --device cuda:N plans for N GPUs that need not be here
    if (use_cuda && N == 0) N = cuda_device_count();
    if (use_cuda && N == 0) fatal("--device cuda: no CUDA device is visible (check the driver and "
                                  "CUDA_VISIBLE_DEVICES)");
    if (use_cuda && !a->plan_only && N > cuda_device_count())
        fatal("--device cuda:%d: only %d CUDA device(s) visible", N, cuda_device_count());
#endif
    return N;
}

// The engine's options from the flags (the plan policy behind them, --mlp-chunk and
// --split-rounds auto, the default device budget and the host-memory accounting, is the
// engine's: llmc/engine/plan.c).
static EngineOptions engine_options(const TrainArgs* a, int use_cuda, int n_devices,
                                    int64_t start_step) {
    EngineOptions eo = {.B = a->batch, .T = a->seq, .M = a->micro_batches,
                        .M_R = a->round_micro_batches, .row_chunks = a->row_chunks,
                        .grain = a->recompute_layer ? RECOMPUTE_LAYER : RECOMPUTE_STAGE,
                        .sync = a->sync, .device_budget = a->device_mem,
                        .opt_threads = a->threads, .trace_path = a->trace,
                        .replan_after = a->profile_steps, .start_step = start_step,
                        .host_single = a->host_single, .split_rounds = a->split_rounds > 0,
                        .hyper = {a->lr, a->beta1, a->beta2, a->eps, a->weight_decay},
                        .sched = {a->schedule, a->lr, a->warmup, a->steps, a->min_lr_frac,
                                  a->decay_frac},
                        .grad_clip = a->grad_clip};
    if (a->rl.on) {
        // GRPO (llmc/grpo.h): a step's batch is every answer, in micro-batches of --batch rows
        // (rl_args_check: --batch divides them), the policy objective in the loss head
        eo.B = a->rl.prompts * a->rl.group;
        eo.M = eo.B / a->batch;
        eo.policy = 1;
    }
    // On GPUs the optimizer's pool leaves a core to each GPU's issue thread and one to the
    // controller (they feed the launch queues; a pool thread sharing their core stalls a step)
    if (use_cuda && a->threads == 0)
        eo.opt_threads = imax(1, threads_online_cpus() - n_devices - 1);
#ifdef HAVE_CUDA
    if (use_cuda && eo.device_budget <= 0) {
        size_t free_b = 0, total_b = 0;
        // (--rl: GPU 0 also holds the generator's weights and KV cache, and the plain path's
        // weights for the KL reference: the engine plans with half of what is free)
        if (cuda_device_memory(0, &free_b, &total_b) == 0)
            eo.device_budget =
                engine_default_device_budget((double)free_b * (a->rl.on ? 0.5 : 1.0));
    }
#else
    (void)use_cuda;
#endif
    return eo;
}

// --plan with LoRA: the host's share of the frozen base and of the adapters. The base is held
// once, in the devices' compute dtype (the engine's bf16 copy on GPUs, which the Store's fp32
// copy is given back for, unless something still reads it; the Store's own fp32 slabs on
// emulated devices); the adapters have fp32 weights, gradients, AdamW m and v, and two
// compute-dtype masters.
static void print_lora_host_memory(const TrainArgs* a, const Model* m, int act_bytes, int N,
                                   const EngineOptions* eo) {
    const EngineHostMemory h = engine_host_memory(m, act_bytes, N > 0 ? N : 1, eo);
    const int released = trainer_releases_frozen(a, m, 1);
    const double gib = 1 << 30;
    if (a->mmap_base) {
        const double adapters = h.store - h.store_frozen + (h.masters - h.base) + h.grads;
        printf("LoRA host memory: the frozen base mapped from %s (--mmap-base: read through the "
               "page cache on each upload, none of it held) + the adapters %.3f GiB\n", a->model,
               adapters / (1 << 30));
        return;
    }
    const int blocks = quant_table_count(&m->tt) > 0;  // (--base-dtype: the engine's copy)
    const double base = act_bytes == 2 || blocks ? h.base : h.store_frozen;
    const double adapters = h.store - h.store_frozen + (h.masters - h.base) + h.grads;
    const double n = (double)m->tt.trainable_params;
    printf("LoRA host memory: the frozen base %.2f GiB (%s, one copy) + the adapters %.3f GiB "
           "(fp32 weights, gradients, AdamW m and v; two %s masters)", base / gib,
           blocks ? "ggml blocks" : act_bytes == 2 ? "bf16" : "fp32", adapters / gib,
           act_bytes == 2 ? "bf16" : "fp32");
    // per adapter parameter: what each part holds (the delayed update's second gradient set:
    // the step of iteration t reads one while iteration t + 1 accumulates into the other)
    printf(" = %.3f G parameters x (16 B fp32 weights, gradients, m, v + %d B masters%s)",
           n / 1e9, 2 * act_bytes, h.grads > 0 ? " + 4 B the delayed update's second gradient set, "
                                                 "--sync 1 drops it" : "");
    int from_file = 0;
    const double staging = memory_stream_staging(a, m, &from_file);
    if (trainer_streams_base(a, m, 1))
        printf("; no fp32 base: the %s %s each tensor as it makes it (staging %.2f GiB)",
               from_file ? "loader" : "random init",
               !blocks ? "converts to bf16" : act_bytes == 2 ? "quantises (or converts to bf16)"
                                                             : "quantises",
               staging / gib);
    else if (blocks && !released)
        printf("; plus the Store's fp32 base (%.2f GiB), which --val, --sample-tokens, "
               "--dump-state and HF/GGUF exports read (--val '' --sample-tokens 0 and no HF / "
               "GGUF export drop it)", h.store_frozen / gib);
    else if (act_bytes == 2)
        printf("; plus the Store's fp32 base (%.2f GiB), which --val, --sample-tokens, "
               "--dump-state and HF/GGUF exports read (--val '' --sample-tokens 0 drops it)",
               h.store_frozen / gib);
    printf("\n");
}

// --plan --world W: the traffic of W such nodes and what their compute hides (llmc/dp.h), from
// --step-ms or the model FLOPs at the MFU measured on one GPU. host_bytes: one node's estimate.
static void plan_data_parallel(const TrainArgs* a, const Model* m, int N, double host_bytes,
                               double rank_bytes) {
    const int use_cuda = a->device == DEVICE_CUDA;
    const int engine_run = N > 0;
    char source[128] = "";
    double step_s = 0.0;
    if (a->step_ms > 0) {
        step_s = a->step_ms / 1000.0;
        snprintf(source, sizeof source, "--step-ms");
    } else if (use_cuda) {
        const double flops = config_flops_per_token(&m->cfg, a->seq) * a->batch * a->seq;
        step_s = flops / (LOG_PEAK_FLOPS_PER_GPU * DP_PLAN_MFU * (N > 0 ? N : 1));
        snprintf(source, sizeof source, "the model FLOPs at %.0f%% MFU on %d GPU(s)",
                 100.0 * DP_PLAN_MFU, N > 0 ? N : 1);
    }
    // rounds per step: only the last one's backward completes gradients (plain training: every
    // micro-batch is a round of its own)
    int rounds = a->micro_batches;
    if (engine_run)
        rounds = a->split_rounds > 0 ? 1
                 : a->round_micro_batches > 0 ? a->micro_batches / a->round_micro_batches : 1;
    const int delayed = engine_run && !a->sync;
    const DpPlanInput in = {.m = m, .world = a->dist_world, .net_gbps = a->net_gbps,
                            .step_s = step_s, .rounds = rounds, .sync = !delayed,
                            .host_bytes = host_bytes,
                            .grad_sets = 1 + delayed + (a->split_rounds > 0 ? N - 1 : 0),
                            .built_sharded = !engine_run ? 0.0
                                             : trainer_needs_plain(a, 1) ? 8.0 : 12.0,
                            .host_rank_bytes = rank_bytes};
    dp_plan_print(&in, source, stdout);
}

// Before anything big is allocated: the plan's choices that depend on its shape (they may set
// a->split_rounds and model->mlp_chunk), then the host memory the run needs against what this
// machine has (llmc/memory.h): a run that does not fit is refused here, exit 2, unless
// --allow-overcommit. With --plan the plan itself, then 1 (the run is over). N: the devices (0:
// plain training). world: this run's data-parallel world size (--plan: --world W), whose rank 0
// the check counts (its ZeRO-1 shard; llmc/memory.h).
static int plan_and_check_memory(TrainArgs* a, Model* model, int N, int world) {
    char err[ERR_LEN];
    const int use_cuda = a->device == DEVICE_CUDA;
    // (--rl grpo trains on the engine too, but for experts: then on the plain path, N = 0)
    const int engine_run = (a->n_devices > 0 || use_cuda) && (!a->rl.on || N > 0);
    const int act_bytes = use_cuda ? 2 : 4;  // the engine devices' compute dtype
    HostLimit lim;
    if (memory_host_limit("", &lim, err) != 0) fatal("%s", err);
    // the plan's choices that depend on its shape: MLP chunks, then split rounds (one more fp32
    // gradient set per extra round, when the host has room for them)
    EngineOptions eo = engine_options(a, use_cuda, N > 0 ? N : 1, 0);
    if (engine_run || a->plan_only) {
        engine_resolve_mlp_chunk(model, a->mlp_chunk, act_bytes, N > 0 ? N : 1, &eo);
        a->split_rounds = engine_resolve_split_rounds(model, a->split_rounds, use_cuda, act_bytes,
                                                      N, &eo, lim.bytes);
        eo.split_rounds = a->split_rounds > 0;
    }
    if (a->plan_only) {
        // the plan needs only the model's shape: no store, devices or buffers
        EngineOptions peo = engine_options(a, use_cuda, N, 0);
        if (use_cuda && peo.device_budget <= 0)
            printf("note: no GPU memory to read here and no --device-mem: planning without a "
                   "device memory budget\n");
        if (engine_plan_print(model, act_bytes, N > 0 ? N : 1, &peo, stdout, NULL, err) != 0) {
            plan_hint_append(err, model, act_bytes, N > 0 ? N : 1, &peo);  // which budget is enough
            fatal("%s", err);
        }
        TrainArgs one = *a;  // (one node: the plan's own figure)
        one.dist_world = 1;
        const RunMemory rm = memory_estimate(&one, model, N, &peo);
        if (model->tt.lora.r > 0) print_lora_host_memory(a, model, act_bytes, N, &peo);
        const double gib = 1 << 30;
        printf("host memory for this plan: %.2f GiB (weights, optimizer state and gradients "
               "%.2f + host activation checkpoints %.2f + other activations and buffers %.2f + "
               "exports %.2f + the program %.2f)", rm.total / gib, rm.state / gib,
               rm.checkpoints / gib, (rm.activations - rm.checkpoints) / gib, rm.exports / gib,
               rm.program / gib);
        if (lim.bytes > 0) printf(" (available: %.2f GiB, %s)", lim.bytes / (1 << 30), lim.source);
        printf("\n");
        if (lim.bytes > 0 && rm.total > lim.bytes)
            printf("warning: more than this machine reports as available (--host-checkpoints "
                   "single, --sync 1 or more micro-batches need less)\n");
        if (a->dist_world > 1)
            plan_data_parallel(a, model, N, rm.total, memory_estimate(a, model, N, &peo).total);
        return 1;
    }
    TrainArgs ranked = *a;  // (what rank 0 of the world holds)
    ranked.dist_world = world;
    if (memory_check_run(&ranked, model, N, &eo, &lim, err) != 0) {
        fflush(stdout);
        fprintf(stderr, "train_roundpipe: error: %s\n", err);
        exit(2);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// data parallel (llmc/dp.h): who this process is, and its communicator

static void resolve_dist(const TrainArgs* a, DistConfig* d) {
    char err[ERR_LEN];
    const DistFlags f = {.init = a->dist_init, .rank = a->dist_rank, .world = a->dist_world,
                         .timeout_s = a->dist_timeout};
    if (a->plan_only) {  // --plan --world W projects W ranks without being one of them
        memset(d, 0, sizeof *d);
        d->world = 1;
        return;
    }
    if (dist_config_resolve(d, &f, dist_getenv, NULL, err) != 0) fatal("%s", err);
}

// W > 1: the rendezvous with rank 0 and this rank's NCCL communicator on its GPU (LOCAL_RANK;
// the collectives are host buffers staged through it, from the plain path's step or the engine's
// optimizer thread).
static Comm* open_data_parallel(const DistConfig* d) {
#ifdef HAVE_CUDA
    char err[ERR_LEN];
    CommToken token;
    if (dist_rendezvous(d, &comm_nccl_impl, &token, err) != 0) fatal("%s", err);
    const CommInit in = {.rank = d->rank, .world = d->world, .timeout_s = d->timeout_s,
                         .token = token, .gpu = d->local_rank};
    Comm* c = comm_nccl_impl.init(&in, err);
    if (!c) fatal("data parallel: %s", err);
    return c;
#else
    fatal("data parallel: world size %d needs NCCL: this binary was built without CUDA", d->world);
#endif
}

// The line every rank prints once its trainer holds the communicator.
static void print_data_parallel(const DistConfig* d, const Trainer* tr) {
    const long long shard = tr->dp ? (long long)(tr->dp->lo[d->rank + 1] - tr->dp->lo[d->rank])
                                   : (long long)engine_shard_params(tr->eng);
    const long long all = tr->dp ? (long long)tr->dp->n : (long long)tr->m->tt.trainable_params;
    printf("data parallel: rank %d of %d (NCCL on GPU %d), %d of the %d sequences of each batch, "
           "AdamW on %lld of the %lld parameters (ZeRO-1%s)\n", d->rank, d->world, d->local_rank,
           tr->a->batch / d->world, tr->a->batch, shard, all,
           tr->eng ? ", through the engine" : "");
}

// ----------------------------------------------------------------------------
// the trained model: --out, --export-hf, --export-gguf

static void export_model(const TrainArgs* a, const Model* m, Store* s, const ModelSource* src) {
    char err[ERR_LEN];
    const int lora = m->tt.lora.r > 0;
    if (a->out[0] && (s->frozen_released || s->base_streamed)) {
        // (LoRA on GPUs: the Store gave its fp32 base back; the base stays at --model)
        if (lora_save_peft(a->out, m, s, a->model, NULL, err) != 0) fatal("%s", err);
        printf("saved the LoRA adapters to %s (the frozen base stays at %s)\n", a->out,
               a->model[0] ? a->model : "the preset's seed");
    } else if (a->out[0]) {
        if (checkpoint_save_hf(a->out, m, s, err) != 0) fatal("%s", err);
        if (lora && lora_save_peft(a->out, m, s, a->model, NULL, err) != 0) fatal("%s", err);
        printf("saved the model to %s (model.safetensors, config.json%s)\n", a->out,
               lora ? ", the LoRA adapters" : "");
    }
    if (lora && a->export_lora[0]) {
        if (lora_save_peft(a->export_lora, m, s, a->model, NULL, err) != 0) fatal("%s", err);
        printf("exported the LoRA adapters to %s (PEFT: adapter_config.json, "
               "adapter_model.safetensors)\n", a->export_lora);
    }
    if (lora && a->merge_lora) {
        // the last use of the store: the HF / GGUF exports below carry W + scale·B·A
        lora_merge(m, s);
        printf("merged the LoRA adapters into the exported weights\n");
    }
    if (a->export_hf[0]) {
        if (checkpoint_export_hf(a->export_hf, m, s, a->export_dtype,
                                 (uint64_t)a->export_shard_bytes, src, err) != 0)
            fatal("%s", err);
        printf("exported the model to %s (HF layout, %s)\n", a->export_hf,
               export_dtype_name(a->export_dtype));
    }
    if (a->export_gguf[0]) {
        if (checkpoint_export_gguf(a->export_gguf, m, s, a->export_dtype, src, err) != 0)
            fatal("%s", err);
        printf("exported the model to %s (GGUF, %s)\n", a->export_gguf,
               export_dtype_name(a->export_dtype));
    }
}

// ----------------------------------------------------------------------------

// Every output checked before anything is loaded (llmc/outputs.h: one line, exit 2), its folders
// created, and --out locked for this run; --plan writes nothing, so it only checks.
static int check_outputs(Outputs* outs, const TrainArgs* a) {
    char err[ERR_LEN];
    outputs_init(outs);
    outputs_add_run(outs, a);
    if (outputs_check(outs, err) != 0 || (!a->plan_only && outputs_create(outs, err) != 0) ||
        (!a->plan_only && a->out[0] && outputs_lock(outs, a->out, err) != 0)) {
        fflush(stdout);
        fprintf(stderr, "train_roundpipe: error: %s\n", err);
        return 2;
    }
    return 0;
}

// A run stopped by a signal after step `done` (start: the step it began from; saved: the step
// of the last checkpoint written): the checkpoint of `done` (with --out) and the exports, then
// where they are. The caller exits with interrupt_exit_status(sig).
static void save_interrupted(Trainer* tr, const DataLoader* train, const TrainArgs* a,
                             const char* args_json, int sig, int start, int done, int saved) {
    char err[ERR_LEN];
    printf("interrupted by %s after step %d of %d\n", interrupt_name(sig), done, a->steps);
    if (done == start) {
        printf("no step was trained since the start (step %d): nothing new to save\n", start);
        return;
    }
    if (a->out[0] && saved != done) {
        if (trainer_save_checkpoint(tr, train, done, args_json, err) != 0) fatal("%s", err);
    }
    if (a->out[0])
        printf("checkpoint: %s/step_%d (continue with the same flags and --resume)\n", a->out,
               done);
    else
        printf("no checkpoint (no --out DIR): the run cannot be resumed\n");
}

// ----------------------------------------------------------------------------
// reinforcement learning: --rl grpo (llmc/grpo.h)

// GRPO steps from `start`: per step the answers (with the weights before the step, or one
// version older with --off-policy 1), their rewards and the policy step, then the new weights
// into the generator as version `step`; the held-out accuracy at the start, every
// --rl-eval-every steps and at the end; checkpoints as in pre-training. Returns the last step
// trained (*saved: the last checkpoint's).
static int train_rl(const TrainArgs* a, Trainer* tr, const Model* model, Store* store,
                    const Tokenizer* tok, const DataLoader* train, StepLog* lg,
                    const char* args_json, int start, int* saved, int n_train, Comm* rl_comm,
                    const DistConfig* dist) {
    char err[ERR_LEN];
    HostLimit lim;
    if (memory_host_limit("", &lim, err) != 0) fatal("%s", err);
    double budget = lim.bytes;  // the generator's KV cache and weights: host memory on the CPU,
                                // what the trainer left free on the GPU with --device cuda
    // --rollout-gpus K: the K devices after the n_train training ones generate
    const int K = a->rl.rollout_gpus;
    // --rl-rollout-ranks R: ranks 1..R of rl_comm generate; the weights go out from this rank's
    // GPU (LOCAL_RANK)
    const int R = rl_comm ? a->rl.rollout_ranks : 0;
    GrpoSplit split = {.impl = &device_cpu_impl, .K = K, .first = R > 0 ? dist->local_rank
                                                                         : n_train,
                       .budget = lim.bytes, .timeout_s = a->dist_timeout, .R = R,
                       .comm = rl_comm};
    const int per_dev = a->threads > 0 ? a->threads : threads_online_cpus() / (n_train + K);
    split.opt = (DeviceOptions){.threads = per_dev > 0 ? per_dev : 1, .delay_seed = a->seed,
                                .max_delay_us = a->delay_us};
#ifdef HAVE_CUDA
    size_t free_b = 0, total_b = 0;
    if (a->device == DEVICE_CUDA && cuda_device_memory(0, &free_b, &total_b) == 0)
        budget = 0.95 * (double)free_b;
    if (a->device == DEVICE_CUDA && R > 0) split.impl = &device_cuda_impl;
    if (a->device == DEVICE_CUDA && K > 0) {
        split.impl = &device_cuda_impl;
        split.budget = 0.0;  // the least free memory of the rollout GPUs
        for (int k = 0; k < K; k++)
            if (cuda_device_memory(n_train + k, &free_b, &total_b) == 0)
                split.budget = k == 0 ? 0.95 * (double)free_b
                                      : fmin(split.budget, 0.95 * (double)free_b);
    }
#endif
    Grpo grpo;
    if (grpo_create(&grpo, a, model, store, tr->plain, tok, start, budget, &split, err) != 0)
        fatal("--rl: %s", err);
    // resumed one step off-policy: the answers generated ahead for step start + 1, as saved (an
    // on-policy run generates its own)
    TrainState* ts = tr->ts;
    if (ts->rl_state_bytes && a->rl.off_policy &&
        grpo_state_restore(&grpo, ts->rl_state, ts->rl_state_bytes, start, err) != 0)
        fatal("--resume: %s", err);
    train_state_free_rl(ts);
    const RlArgs* r = &a->rl;
    printf("GRPO: %d prompts x %d answers of up to %d tokens per step (task %s, reward %s), "
           "temperature %g, adv-std %s, clip %g/%g, loss %s, kl-beta %g, %s\n", r->prompts,
           r->group, r->max_tokens, r->task, *r->reward_cmd ? "--reward-cmd" :
           r->reward == RL_REWARD_ARITH ? "arith" : "exact", (double)a->temperature,
           rl_adv_std_name(r->adv_std), (double)r->clip_low, (double)r->clip_high,
           rl_loss_agg_name(r->loss_agg), (double)r->kl_beta,
           r->off_policy ? "one step off-policy" : "on-policy");
    if (K > 0)
        printf("GRPO split schedule: devices 0..%d train, %d..%d generate (%s)\n", n_train - 1,
               n_train, n_train + K - 1,
               r->off_policy ? "concurrently: the next step's answers while a step trains"
                             : "in turn: on-policy");
    if (R > 0)
        printf("GRPO rollout ranks: rank 0 trains, ranks 1..%d generate (%s); weights v%d sent\n",
               R, r->off_policy ? "concurrently: the next step's answers while a step trains"
                                : "in turn: on-policy", start);
    grpo_log_eval(lg, start, grpo_evaluate(&grpo), grpo.task.n_eval);
    int done = start;
    for (int step = start + 1; step <= a->steps && !interrupt_signal(); step++) {
        grpo_rollout(&grpo, step);                          // answers and rewards
        const StepStats st = grpo_train(&grpo, tr, step);   // advantages, the policy step
        grpo_sync(&grpo, step);                             // the generator's weights: version step
        grpo_log_step(&grpo, lg, &st);
        done = step;
        interrupt_test_hook(step);
        if (a->save_every > 0 && (step % a->save_every == 0 || step == a->steps)) {
            size_t bytes = 0;
            void* rl_state = grpo_state_pack(&grpo, step, &bytes);
            ts->rl_state = rl_state;
            ts->rl_state_bytes = bytes;
            const int rc = trainer_save_checkpoint(tr, train, step, args_json, err);
            ts->rl_state = NULL;
            ts->rl_state_bytes = 0;
            free(rl_state);
            if (rc != 0) fatal("%s", err);
            *saved = step;
        }
        if (r->eval_every > 0 && step % r->eval_every == 0 && step != a->steps)
            grpo_log_eval(lg, step, grpo_evaluate(&grpo), grpo.task.n_eval);
    }
    if (done > start && !interrupt_signal())
        grpo_log_eval(lg, done, grpo_evaluate(&grpo), grpo.task.n_eval);
    grpo_free(&grpo);
    return done;
}

// A rollout rank of --rl-rollout-ranks (rank > 0): its generator on its GPU (LOCAL_RANK), the
// trainer's prompts in, answers out, new weights after each step, until rank 0 says stop
// (llmc/grpo_ranks.h grpo_serve). Nothing of training is loaded or printed here. Returns the exit
// status.
static int serve_rollouts(const TrainArgs* a, const DistConfig* dist, const Model* model) {
    char err[ERR_LEN];
    // SIGINT / SIGTERM stay blocked: a rollout rank ends on the trainer's stop, which comes after
    // the trainer's own clean stop (its last step's weight broadcast, its checkpoint), or when
    // the communicator times out because the trainer is gone
    interrupt_block();
    Comm* comm = open_data_parallel(dist);
    GrpoSplit where = {.impl = &device_cpu_impl, .first = dist->local_rank,
                       .opt = {.threads = a->threads > 0 ? a->threads : 1},
                       .timeout_s = a->dist_timeout, .R = a->rl.rollout_ranks, .comm = comm};
#ifdef HAVE_CUDA
    size_t free_b = 0, total_b = 0;
    if (a->device == DEVICE_CUDA) {
        where.impl = &device_cuda_impl;
        if (cuda_device_memory(dist->local_rank, &free_b, &total_b) == 0)
            where.budget = 0.95 * (double)free_b;
    }
#endif
    if (grpo_serve(a, model, &where, err) != 0) fatal("--rl-rollout-ranks: %s", err);
    comm_destroy(comm);
    return 0;
}

int main(int argc, char** argv) {
    char err[ERR_LEN];
    // line-buffered even into a file, so a killed run's log shows how far it got
    setvbuf(stdout, NULL, _IOLBF, 0);
    // --tokenize IN... --tokenizer FILE --out-shards PREFIX: text to token shards, no training
    if (tokenize_shards_requested(argc, argv)) return tokenize_shards_main(argc, argv);

    // 1. flags, then every output checked (and --out locked) before anything is loaded
    TrainArgs a;
    args_defaults(&a);
    int rc = args_parse(&a, argc, argv);
    if (rc == 1) return 0;  // --help
    if (rc != 0) return rc;
#ifndef HAVE_CUDA
    if (a.device == DEVICE_CUDA) {
        fprintf(stderr, "train_roundpipe: error: --device cuda: this binary was built without CUDA "
                        "(nvcc was not found by make); use --device cpu or rebuild with nvcc\n");
        return 2;
    }
#endif
    // data parallel: ranks other than 0 read what rank 0 reads and write nothing
    DistConfig dist;
    resolve_dist(&a, &dist);
    const int rank0 = dist.rank == 0;
    Outputs outs;
    if (rank0 && check_outputs(&outs, &a) != 0) return 2;
    if (!rank0) outputs_init(&outs);
    const int dump = a.dump_state[0] != '\0';

    // 2. model: configuration, the plan, the weights (a --resume checkpoint, the source's, or a
    // random init)
    ModelSource src;
    if (checkpoint_resolve_model(&src, a.model, err) != 0) fatal("%s", err);
    if (a.layers > 0 && config_truncate_layers(&src.cfg, a.layers, err) != 0) fatal("%s", err);
    Model model;
    const LoraSpec lora = {.r = a.lora_r, .alpha = a.lora_alpha, .rslora = a.rslora,
                           .dropout = a.lora_dropout, .targets = a.lora_targets,
                           .gate_up_r = a.lora_gate_up_r};
    if (model_init_lora(&model, &src.cfg, a.decay_embeddings, &lora, err) != 0)
        fatal("%s: %s", a.model, err);
    // --rl-rollout-ranks R: ranks 1..R only generate (the weights come from rank 0)
    const int rl_ranks = a.rl.on && a.rl.rollout_ranks > 0;
    if (rl_ranks && !rank0) {
        rc = serve_rollouts(&a, &dist, &model);
        model_free(&model);
        checkpoint_close_source(&src);
        outputs_release(&outs);
        return rc;
    }
    model.mlp_chunk = a.mlp_chunk > 0 ? a.mlp_chunk : 0;  // auto is resolved with the plan
    config_print(&model.cfg);
    if (model.tt.lora.r > 0) {
        char targets[128];
        lora_targets_string(model.tt.lora.targets, targets, sizeof targets);
        printf("LoRA: r %d, alpha %g (scale %g%s), targets %s, dropout %g: %lld trainable "
               "parameters (%.3f%% of %lld), the base frozen\n", model.tt.lora.r,
               (double)model.tt.lora.alpha, (double)model.lora_scale,
               model.tt.lora.rslora ? ", rsLoRA" : "", targets, (double)model.tt.lora.dropout,
               (long long)model.tt.trainable_params,
               100.0 * (double)model.tt.trainable_params / (double)model.tt.total_params,
               (long long)model.tt.total_params);
    }
    // --base-dtype: which frozen tensors are held in a block format (before the plan: it counts
    // their bytes); keep reads the GGUF's own types
    const GgufFile* base_gguf = src.kind == SOURCE_GGUF && src.has_weights ? &src.gguf : NULL;
    if (quant_table_set(&model.tt, (BaseDtype)a.base_dtype, base_gguf, &model.cfg, err) != 0)
        fatal("%s", err);
    if (quant_table_count(&model.tt) > 0)
        printf("LoRA base: %d tensors held as ggml blocks (--base-dtype %s): the frozen base "
               "%.3f GiB instead of %.3f GiB in bf16\n", quant_table_count(&model.tt),
               quant_base_dtype_name((BaseDtype)a.base_dtype),
               quant_head_bytes(&model.tt, 2) / (1 << 30),
               store_frozen_bytes(&model.tt) / 2 / (1 << 30));
    if (a.seq > model.cfg.max_pos && model.cfg.max_pos > 0)
        printf("warning: --seq %d exceeds max_position_embeddings %d\n", a.seq, model.cfg.max_pos);
    // --rl grpo: through the engine with --device cuda / cpu:N, colocated with generation (GPU 0);
    // a mixture-of-experts model trains on the plain path (N = 0), on GPU 0 with --device cuda
    int N = resolve_devices(&a);
    if (a.rl.on && model.n_moe > 0 && N > 0) {
        printf("note: --rl with experts trains on the plain path (the engine's policy objective "
               "is built for dense models)\n");
        N = 0;
    }
    // --rl --rollout-gpus K: the last K devices generate, the others train (split schedule)
    const int n_rollout = a.rl.on ? a.rl.rollout_gpus : 0;
    if (n_rollout > 0 && N <= n_rollout)
        fatal("--rollout-gpus %d: the split schedule needs at least one training device "
              "besides the rollout ones, and this run has %d engine device(s)%s. HINT: fewer "
              "rollout devices, or more devices (--device cpu:N / cuda:N)", n_rollout, N,
              N == 0 ? " (it trains on the plain path)" : "");
    N -= n_rollout;
    if (plan_and_check_memory(&a, &model, N, rl_ranks ? 1 : dist.world)) {  // --plan
        model_free(&model);
        checkpoint_close_source(&src);
        return 0;
    }
    // the tokenizer (tokenizer.json beside the model, or the GGUF's) for the prompt and exports
    if (checkpoint_load_tokenizer(&src, err) != 0) fatal("%s", err);
    // a rank of a data-parallel engine run zeroes AdamW's m and v for its ZeRO-1 shard only
    // (docs/DISTRIBUTED.md §6); a launcher's world of one on GPUs opens NCCL too (the same code
    // path at world size 1, for checking it against the run without it)
    // (--rl-rollout-ranks: the one trainer rank holds everything; its communicator is GRPO's)
    const int ranked = !rl_ranks && (dist.world > 1 || (strcmp(dist.source, "default") != 0 &&
                                                        a.device == DEVICE_CUDA));
    Store store;
    if (a.mmap_base) {  // the base stays in the mapped checkpoint (its slabs' heads untouched)
        if (!src.has_weights)
            fatal("--mmap-base: %s has no checkpoint to map (a preset or config.json is a random "
                  "init held in memory)", a.model);
        store_create_unfrozen(&store, &model.tt);
        if (loader_map_base(&store, src.kind == SOURCE_GGUF ? NULL : &src.ck, base_gguf,
                            &model.cfg, err) != 0)
            fatal("%s", err);
    } else if (trainer_streams_base(&a, &model, N > 0)) {
        // a base nothing reads in fp32: quantised (or, on GPUs, made bf16) as the init / loader
        // makes it (with data parallel the adapters' m and v stay whole: they are small)
        store_create_streamed(&store, &model.tt, a.device == DEVICE_CUDA);
    } else if (ranked && N > 0) {  // (LoRA: m and v of the adapters' shard)
        int64_t* lo = malloc_check((size_t)model.tt.n_layers * sizeof(int64_t));
        int64_t* hi = malloc_check((size_t)model.tt.n_layers * sizeof(int64_t));
        dp_engine_state_ranges(&model.tt, dist.world, dist.rank, lo, hi);
        store_create_shard(&store, &model.tt, lo, hi);
        free(lo);
        free(hi);
    } else {
        store_create(&store, &model.tt);
    }
    char* args_json = args_to_json(&a);
    TrainState ts;
    const InitOptions init = {.model = a.model, .out_dir = a.out, .resume = a.resume,
                              .seed = a.seed, .init_std = a.init_std, .lora_init = a.lora_init,
                              .keep_source = a.mmap_base || a.base_dtype == BASE_DTYPE_KEEP};
    if (checkpoint_init_weights(&init, &src, &model, &store, &ts, args_json, err) != 0)
        fatal("%s", err);
    store_quantize_base(&store, base_gguf, &model.cfg);  // (the base's blocks; none for bf16)
    if (!a.mmap_base) checkpoint_release_weights(&src);  // (--mmap-base: read on every upload)

    // 3. the trainer: plain training on the CPU, or the RoundPipe engine over the N devices (its
    // threads start with SIGINT/SIGTERM blocked: only this thread handles them)
    interrupt_block();
    Trainer tr;
    Comm* comm = ranked ? open_data_parallel(&dist) : NULL;
    Comm* rl_comm = rl_ranks ? open_data_parallel(&dist) : NULL;  // (the rollout ranks')
    if (trainer_create_ranked(&tr, &a, &model, &store, &ts, N, engine_options, comm, err) != 0)
        fatal("%s", err);
    if (comm) print_data_parallel(&dist, &tr);

    // 4. data
    DataLoader train, val;
    const int have_val = a.val[0] != '\0' && !dump && !a.rl.on && rank0;  // (RL: held-out accuracy)
    if (dataloader_open(&train, a.train, a.batch, a.seq, dump ? 0 : a.shuffle, a.seed,
                        model.cfg.V, err) != 0)
        fatal("--train: %s", err);
    if (have_val && dataloader_open(&val, a.val, a.batch, a.seq, 0, a.seed, model.cfg.V, err) != 0)
        fatal("--val: %s", err);
    if (ts.resumed && dataloader_state_restore(&train, ts.train_loader, err) != 0)
        fatal("--resume: %s", err);
    // from here a first SIGINT/SIGTERM stops the run cleanly, a second one at once
    interrupt_install();

    // --dump-state: the gradients of the first batch, then exit
    if (dump) {
        double loss = trainer_batch_gradients(&tr, &train);
        if (checkpoint_dump_state(a.dump_state, &model, &store, (float)loss, err) != 0)
            fatal("%s", err);
        printf("loss %.7f; gradients written to %s\n", loss, a.dump_state);
        checkpoint_close_source(&src);
        free(args_json);
        dataloader_close(&train);
        trainer_free(&tr);
        store_free(&store);
        model_free(&model);
        outputs_release(&outs);
        return interrupt_signal() ? interrupt_exit_status(interrupt_signal()) : 0;
    }

    // 5. training: step, log, checkpoint, evaluate (a signal: the steps in flight finish); with
    // --rl grpo the GRPO loop instead (train_rl)
    StepLog lg;
    if (log_open(&lg, rank0 ? a.log : "", ts.resumed ? (long long)ts.step : -1, err) != 0)
        fatal("%s", err);
    if (have_val) log_eval(&lg, (int)ts.step, trainer_evaluate(&tr, &val));
    const int start = (int)ts.step;
    int done = start, saved = -1;  // the last step trained, the last checkpoint's step
    if (a.rl.on)
        done = train_rl(&a, &tr, &model, &store, src.tok, &train, &lg, args_json, start, &saved,
                        N, rl_comm, &dist);
    for (int step = start + 1; step <= a.steps && !a.rl.on; step++) {
        const int stopping = interrupt_signal() != 0;
        if (stopping && trainer_in_flight(&tr) == 0) break;
        const int save = a.save_every > 0 && (step % a.save_every == 0 || step == a.steps);
        const int eval = have_val && a.eval_every > 0 && step % a.eval_every == 0 &&
                         step != a.steps;
        // a checkpoint, an evaluation, the end or a signal: nothing may stay in flight after
        // this step
        const StepStats st =
            trainer_step(&tr, &train, step, save || eval || step == a.steps || stopping);
        done = step;
        if (rank0) log_step(&lg, &st);
        interrupt_test_hook(step);
        if (save && trainer_save_checkpoint(&tr, &train, step, args_json, err) != 0)
            fatal("%s", err);
        if (save) saved = step;
        if (eval && !interrupt_signal()) log_eval(&lg, step, trainer_evaluate(&tr, &val));
    }
    const int sig = interrupt_signal();
    if (sig) save_interrupted(&tr, &train, &a, args_json, sig, start, done, saved);
    if (trainer_finish(&tr, err) != 0) fatal("%s", err);
    // (a resumed run that had nothing left to train evaluated at its start already)
    if (have_val && done > start && !sig) log_eval(&lg, a.steps, trainer_evaluate(&tr, &val));
    log_close(&lg);

    // 6. sample and export (interrupted: the exports of what was trained, no sample)
    if (a.sample_tokens > 0 && !sig && rank0)
        sample_print(tr.plain, a.seq, a.sample_tokens, a.prompt, a.temperature, a.seed, src.tok);
    if ((!sig || done > start) && rank0) export_model(&a, &model, &store, &src);

    checkpoint_close_source(&src);
    free(args_json);
    dataloader_close(&train);
    if (have_val) dataloader_close(&val);
    trainer_free(&tr);
    comm_destroy(comm);
    comm_destroy(rl_comm);
    store_free(&store);
    model_free(&model);
    outputs_release(&outs);
    // a signal during the exports of a finished run still says the run was interrupted
    const int final_sig = interrupt_signal();
    return final_sig ? interrupt_exit_status(final_sig) : 0;
}
