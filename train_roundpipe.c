/*
 * train_roundpipe.c — the trainer, top to bottom: parse flags, resolve the model, load or init
 * the weights, open the data, train (micro-batches -> gradients -> AdamW), evaluate, sample, save.
 *
 *   make && ./train_roundpipe            trains the built-in tiny model on the shipped corpus
 *   ./train_roundpipe --help             every flag with its default
 *
 * Everything below is a table of contents: the work happens in llmc/.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "llmc/adamw.h"
#include "llmc/args.h"
#include "llmc/checkpoint.h"
#include "llmc/common.h"
#include "llmc/dataloader.h"
#include "llmc/device.h"
#include "llmc/engine.h"
#include "llmc/log.h"
#include "llmc/model.h"
#include "llmc/ops.h"
#include "llmc/plain.h"
#include "llmc/rng.h"
#include "llmc/store.h"
#include "llmc/threads.h"
#ifdef HAVE_CUDA
#include "kernels/kernels.h"
#endif

// ----------------------------------------------------------------------------
// one optimizer step's forward/backward: the batch split into micro-batches

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
static double train_forward_backward(Plain* p, const TrainArgs* a, const int32_t* tokens) {
    const int T = a->seq;
    // Every micro-batch's gradient is scaled by 1/(tokens of the whole step), so the sum over
    // micro-batches is the gradient of the step's mean loss (FORMATS_AND_MODELS.md §7).
    const float grad_scale = 1.0f / ((float)a->batch * (float)T);
    double loss_sum = 0.0;
    store_zero_grads(p->s);
    for (int mb = 0; mb < a->micro_batches; mb++)
        loss_sum += plain_forward_backward(p, mb_tokens(a, tokens, mb), mb_rows(a, mb), T, grad_scale);
    plain_sync_grads(p);
    store_fold_tied_grads(p->s);
    return loss_sum / ((double)a->batch * T);
}

static double evaluate(Plain* p, DataLoader* val, const TrainArgs* a, int32_t* tokens) {
    const int T = a->seq;
    int64_t n_batches = dataloader_batches_per_epoch(val);
    if (n_batches > a->eval_batches) n_batches = a->eval_batches;
    char err[ERR_LEN];
    dataloader_reset(val);
    double sum = 0.0;
    for (int64_t i = 0; i < n_batches; i++) {
        if (dataloader_next_batch(val, tokens, err) != 0) fatal("%s", err);
        for (int mb = 0; mb < a->micro_batches; mb++)
            sum += plain_forward_loss(p, mb_tokens(a, tokens, mb), mb_rows(a, mb), T);
    }
    return sum / ((double)n_batches * a->batch * T);
}

// ----------------------------------------------------------------------------
// sampling (printable for byte-level vocabularies)

static void print_token(const ModelConfig* c, int tok) {
    if (c->V == 256) {
        if (tok == c->bos_id) printf("<|eot|>");
        else if (tok == '\n') printf("\n");
        else if (tok >= 32 && tok < 127) putchar(tok);
        else printf("\\x%02x", tok);
    } else {
        printf("%d ", tok);
    }
}

// Sample from softmax(logits / temperature); temperature 0 = greedy.
static int sample_token(const float* logits, int V, float temperature, Rng* rng) {
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (temperature <= 0.0f) return best;
    double sum = 0.0;
    for (int v = 0; v < V; v++) sum += exp((logits[v] - logits[best]) / temperature);
    double r = rng_uniform(rng) * sum;
    for (int v = 0; v < V; v++) {
        r -= exp((logits[v] - logits[best]) / temperature);
        if (r <= 0.0) return v;
    }
    return best;
}

static void generate_sample(Plain* p, const TrainArgs* a) {
    const ModelConfig* c = &p->m->cfg;
    int cap = a->sample_tokens + (int)strlen(a->prompt) + 1;
    int32_t* toks = malloc_check((size_t)cap * sizeof(int32_t));
    float* logits = malloc_check((size_t)c->V * sizeof(float));
    Rng rng;
    rng_seed(&rng, a->seed + 17);
    int n = 0;
    if (c->bos_id >= 0) toks[n++] = c->bos_id;
    if (c->V == 256)
        for (const char* s = a->prompt; *s; s++) toks[n++] = (unsigned char)*s;
    if (n == 0) toks[n++] = 0;
    printf("sample (%d tokens, temperature %g):\n", a->sample_tokens, (double)a->temperature);
    for (int i = 0; i < n; i++) print_token(c, toks[i]);
    for (int i = 0; i < a->sample_tokens; i++) {
        int ctx = n < a->seq ? n : a->seq;  // sliding window of at most T tokens
        plain_logits_last(p, toks + n - ctx, ctx, logits);
        toks[n] = sample_token(logits, c->V, a->temperature, &rng);
        print_token(c, toks[n++]);
    }
    printf("\n");
    free(toks);
    free(logits);
}

// The engine's options from the flags. On GPUs without --device-mem the engine may allocate 90%
// of the memory still free on GPU 0 (the rest: allocator rounding, cuBLAS and CUDA internals).
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
    // On GPUs the optimizer's pool leaves a core to each GPU's issue thread and one to the
    // controller (they feed the launch queues; a pool thread sharing their core stalls a step)
    if (use_cuda && a->threads == 0)
        eo.opt_threads = imax(1, threads_online_cpus() - n_devices - 1);
#ifdef HAVE_CUDA
    if (use_cuda && eo.device_budget <= 0) {
        size_t free_b = 0, total_b = 0;
        if (cuda_device_memory(0, &free_b, &total_b) == 0) eo.device_budget = 0.9 * (double)free_b;
    }
#else
    (void)use_cuda;
#endif
    return eo;
}

// --mlp-chunk auto: chunk the MLP in 16384 rows when micro-batches hold more than 65,536 tokens
// (long sequences: the MLP's activations would dominate device and host memory, and its
// recompute is small next to the attention) or when no engine plan fits without.
static void resolve_mlp_chunk(Model* m, const TrainArgs* a, int act_bytes, int n_devices,
                              const EngineOptions* eo) {
    if (a->mlp_chunk >= 0) return;
    char err[ERR_LEN];
    const int rows = 16384;
    const int Bm = (a->batch + a->micro_batches - 1) / a->micro_batches;
    const int64_t tokens = (int64_t)Bm * a->seq;
    m->mlp_chunk = 0;
    if (tokens <= rows) return;  // micro-batches too small for chunks to matter
    // Up to 64K tokens per micro-batch chunks only where they make the plan cheaper (less
    // recompute: the activations they save let more layers into the fused stage) or where no plan
    // fits without them; beyond, always.
    double plain_cost = 0.0, chunked_cost = 0.0;
    const int plain_fits =
        tokens <= 65536 && engine_plan_cost(m, act_bytes, n_devices, eo, &plain_cost, err) == 0;
    m->mlp_chunk = rows;
    if (plain_fits && (engine_plan_cost(m, act_bytes, n_devices, eo, &chunked_cost, err) != 0 ||
                       chunked_cost >= 0.99 * plain_cost)) {
        m->mlp_chunk = 0;
        return;
    }
    printf("note: --mlp-chunk auto: the MLP runs in chunks of %d rows (%s)\n", rows,
           tokens > 65536 ? "long micro-batches"
           : plain_fits   ? "a cheaper plan: less recompute"
                          : "no plan fits without");
}

// --split-rounds auto (the default): split each iteration into one round per GPU when that is
// possible and the host has room for the extra gradient sets. On two H200s it measured 24,338
// vs 23,383 tok/s (LLaMA-3.1-8B) and 90,006 vs 88,519 (Qwen3-1.7B): the optimizer step of an
// iteration overlaps the next one instead of stalling the GPU whose turn comes next.
// eo: the run's engine options; host_need: the host bytes of the weights, optimizer state and
// gradients without the split; extra: what the split adds.
static void resolve_split_rounds(TrainArgs* a, const Model* m, int act_bytes, int n_devices,
                                 const EngineOptions* eo, double host_need, double extra,
                                 double host_total) {
    if (a->split_rounds >= 0) return;
    a->split_rounds = 0;
    if (a->device != DEVICE_CUDA || n_devices < 2 || a->micro_batches % n_devices != 0 ||
        a->round_micro_batches > 0)
        return;
    EngineOptions split = *eo;
    split.split_rounds = 1;
    char err[ERR_LEN];
    size_t host_acts = 0;  // the split plan's host activation checkpoints
    if (engine_plan_print(m, act_bytes, n_devices, &split, NULL, &host_acts, err) != 0)
        return;  // no one-stage plan
    if (host_total > 0 && host_need + (double)host_acts + extra > 0.9 * host_total) {
        printf("note: --split-rounds auto: not splitting rounds (the extra %.1f GiB of gradients "
               "would not fit in host memory)\n", extra / (1 << 30));
        return;
    }
    a->split_rounds = 1;
    printf("note: --split-rounds auto: each iteration runs as %d rounds at once, one per GPU "
           "(--no-split-rounds for the paper's schedule)\n", n_devices);
}

// ----------------------------------------------------------------------------

int main(int argc, char** argv) {
    char err[ERR_LEN];
    // line-buffered even into a file, so a killed run's log shows how far it got
    setvbuf(stdout, NULL, _IOLBF, 0);
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
    const int dump = a.dump_state[0] != '\0';

    // 1. model: configuration and weights
    ModelSource src;
    if (checkpoint_resolve_model(&src, a.model, err) != 0) fatal("%s", err);
    Model model;
    if (model_init(&model, &src.cfg, a.decay_embeddings, err) != 0) fatal("%s: %s", a.model, err);
    model.mlp_chunk = a.mlp_chunk > 0 ? a.mlp_chunk : 0;  // auto is resolved with the plan
    config_print(&model.cfg);
    if (a.seq > model.cfg.max_pos && model.cfg.max_pos > 0)
        printf("warning: --seq %d exceeds max_position_embeddings %d\n", a.seq, model.cfg.max_pos);
    // the devices: N emulated (--device cpu:N), the GPUs (--device cuda, cuda:N), or none
    const int use_cuda = a.device == DEVICE_CUDA;
    int N = a.n_devices;
#ifdef HAVE_CUDA
    // --plan with --device cuda:N plans for N GPUs that need not be here
    if (use_cuda && N == 0) N = cuda_device_count();
    if (use_cuda && N == 0) fatal("--device cuda: no CUDA device is visible (check the driver and "
                                  "CUDA_VISIBLE_DEVICES)");
    if (use_cuda && !a.plan_only && N > cuda_device_count())
        fatal("--device cuda:%d: only %d CUDA device(s) visible", N, cuda_device_count());
#endif
    // What the host needs, before anything big is allocated (PERFORMANCE_MODEL.md §5): the
    // Store's 16 B/param; with the engine two compute-dtype weight copies, with the delayed
    // optimizer a second fp32 gradient set, and activation checkpoints (at most one per layer
    // boundary plus the two-slot gradient ring, per micro-batch, in one or two sets).
    const int engine_run = a.n_devices > 0 || a.device == DEVICE_CUDA;
    const double P = (double)model.tt.total_params;
    const double wbytes = a.device == DEVICE_CUDA ? 2.0 : 4.0;
    double host_fixed = 16.0 * P;
    if (engine_run) host_fixed += 2.0 * wbytes * P + (a.sync ? 0.0 : 4.0 * P);
    const double ckpt = engine_run ? (a.host_single ? 1.0 : 2.0) * (double)a.batch * a.seq *
                                         model.cfg.C * wbytes * (model.cfg.L + 3)
                                   : 0.0;
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    const double host_total = pages > 0 && page > 0 ? (double)pages * page : 0.0;
    // the plan's choices that depend on its shape: MLP chunks, then split rounds (one more fp32
    // gradient set per extra round)
    const double split_extra = N > 1 ? (N - 1) * 4.0 * P : 0.0;
    if (engine_run || a.plan_only) {
        const EngineOptions eo = engine_options(&a, use_cuda, N > 0 ? N : 1, 0);
        resolve_mlp_chunk(&model, &a, use_cuda ? 2 : 4, N > 0 ? N : 1, &eo);
        resolve_split_rounds(&a, &model, use_cuda ? 2 : 4, N, &eo, host_fixed, split_extra,
                             host_total);
    }
    if (engine_run && a.split_rounds > 0) host_fixed += split_extra;
    struct sysinfo si;
    const double host_swap = sysinfo(&si) == 0 ? (double)si.totalswap * si.mem_unit : 0.0;
    printf("host memory: %.2f GiB for weights, optimizer state and gradients",
           host_fixed / (1 << 30));
    if (engine_run) printf(" + up to %.2f GiB of activation checkpoints", ckpt / (1 << 30));
    printf(" (machine: %.1f GiB)\n", host_total / (1 << 30));
    // A warning, not a refusal: virtual machines whose memory grows on demand report a MemTotal
    // far below what they can hold.
    if (host_total > 0 && host_fixed > 0.9 * (host_total + host_swap))
        printf("warning: the weights, optimizer state and gradients alone need more than 90%% "
               "of the memory this machine reports (%.1f GiB + %.1f GiB swap)\n",
               host_total / (1 << 30), host_swap / (1 << 30));
    if (a.plan_only) {
        // the plan needs only the model's shape: no store, devices or buffers
        EngineOptions eo = engine_options(&a, use_cuda, N, 0);
        if (use_cuda && eo.device_budget <= 0)
            printf("note: no GPU memory to read here and no --device-mem: planning without a "
                   "device memory budget\n");
        size_t host_acts = 0;
        if (engine_plan_print(&model, use_cuda ? 2 : 4, N > 0 ? N : 1, &eo, stdout, &host_acts,
                              err) != 0)
            fatal("%s", err);
        const double need = host_fixed + (engine_run ? (double)host_acts : 0.0);
        printf("host memory for this plan: %.2f GiB (this machine reports %.1f GiB + %.1f GiB "
               "swap)\n", need / (1 << 30), host_total / (1 << 30), host_swap / (1 << 30));
        if (host_total > 0 && need > host_total + host_swap)
            printf("warning: more than this machine reports (--host-checkpoints single, --sync 1 "
                   "or more micro-batches need less)\n");
        model_free(&model);
        checkpoint_close_source(&src);
        return 0;
    }
    if (engine_run && config_is_moe(&model.cfg))
        fatal("model family %s: mixture-of-experts models train only with --device cpu so far "
              "(neither the RoundPipe engine nor the CUDA kernels run them yet)",
              family_names[model.cfg.family]);
    Store store;
    store_create(&store, &model.tt);
    // weights: a training-state checkpoint (--resume), the source's, or a random init
    char* args_json = args_to_json(&a);
    TrainState ts;
    if (checkpoint_init_weights(&a, &src, &model, &store, &ts, args_json, err) != 0)
        fatal("%s", err);

    // 2. backend: plain training on the CPU, or the RoundPipe engine over the devices. The plain
    // path also serves evaluation, sampling and --dump-state (on GPU 0 when training on GPUs).
    const int use_engine = use_cuda || N > 0;
    if (N == 0) N = 1;
    const Ops* ops = &ops_cpu;
    void* ctx = NULL;
#ifdef HAVE_CUDA
    if (use_cuda) {
        ops = &ops_cuda;
        ctx = ops_cuda_create(0, NULL);
    }
#endif
    if (!ctx) ctx = ops_cpu_create(a.threads);
    ThreadPool* opt_pool = threadpool_create(a.threads);
    const int Bm = mb_rows(&a, 0);  // the largest micro-batch
    // Keep every block's activations unless that would need more than 8 GiB: then recompute.
    int recompute = workspace_bytes(&model, ops->act_bytes, Bm, a.seq, model.cfg.L) > (8ull << 30);
    // Engine runs only need the plain path for evaluation, sampling or --dump-state: on a GPU it
    // holds a whole copy of the model, so it is made only when something will use it.
    const int need_plain = !use_engine || a.val[0] || a.sample_tokens > 0 || dump;
    Plain* plain = need_plain ? plain_create(&model, &store, ops, ctx, Bm, a.seq, recompute) : NULL;
    DeviceSet devs = {0};
    Engine* eng = NULL;
    const int ops_weight_bytes = use_cuda ? 2 : 4;  // the engine devices' compute dtype
    // GPUs, --threads 0: the controller and the GPUs' issue threads (created by device_set_open,
    // inheriting this thread's CPUs) keep the last N + 1 CPUs; the optimizer and its pool get the
    // rest, so a pool thread never shares a core with a thread that feeds a launch queue.
    enum { MAX_CPUS = 4096 };
    int cpus[MAX_CPUS];  // lives as long as main: the engine keeps a pointer to its part
    int n_cpus = 0, n_opt_cpus = 0;
    if (use_cuda && a.threads == 0) {
        n_cpus = threads_allowed_cpus(cpus, MAX_CPUS);
        if (n_cpus >= N + 3 && threads_pin_self(cpus + n_cpus - (N + 1), N + 1) == 0) {
            n_opt_cpus = n_cpus - (N + 1);
            printf("CPUs: the optimizer on %d, the controller and %d GPU issue thread(s) on %d\n",
                   n_opt_cpus, N, N + 1);
        }
    }
    if (use_engine) {
        int per_dev = a.threads > 0 ? a.threads : threads_online_cpus() / N;
        DeviceOptions dopt = {.threads = per_dev > 0 ? per_dev : 1, .delay_seed = a.seed,
                              .max_delay_us = a.delay_us, .mem_limit = 0,
                              .profile_ops = a.profile_ops};
        const DeviceImpl* impl = &device_cpu_impl;
#ifdef HAVE_CUDA
        if (use_cuda) impl = &device_cuda_impl;
#endif
        device_set_open(&devs, impl, N, &dopt);
        EngineOptions eo = engine_options(&a, use_cuda, N, ts.step);
        if (n_opt_cpus > 0) {
            eo.opt_cpus = cpus;
            eo.n_opt_cpus = n_opt_cpus;
            eo.opt_threads = n_opt_cpus;
        }
        if (ts.resumed && !a.sync && ts.pending_bytes) {
            // the delayed update's next weights, saved with the checkpoint
            if (ts.pending_bytes != ops_weight_bytes)
                fatal("--resume: the checkpoint's pending weights have %d-byte elements but "
                      "this device computes with %d-byte elements (resume on the same kind of "
                      "device, or with --sync 1)", ts.pending_bytes, ops_weight_bytes);
            eo.first_weights = (const void* const*)ts.pending;
            eo.first_norm = ts.pending_norm;
            eo.first_lr = ts.pending_lr;
        }
        eng = engine_create(&model, &store, &devs, &eo, err);
        if (!eng) fatal("%s", err);
        if (ts.resumed && !a.sync && !eo.first_weights)
            printf("note: the checkpoint has no pending weights of the delayed update: the "
                   "first resumed iteration computes with the checkpoint's weights (one step "
                   "fresher than an uninterrupted run)\n");
        train_state_free(&ts);
        engine_print_plan(eng, stdout);
        if (a.plan_only) return 0;
        const int M_R = a.round_micro_batches > 0 ? a.round_micro_batches : a.micro_batches;
        if (M_R < N && a.split_rounds <= 0)
            printf("warning: %d micro-batches per round < %d devices: some devices idle every "
                   "round (RoundPipe needs M_R >= N)\n", M_R, N);
        if (use_cuda)
            printf("device cuda:%d, batch %d x %d tokens in %d micro-batch(es)\n", N, a.batch,
                   a.seq, a.micro_batches);
        else
            printf("device cpu:%d (emulated, %d threads each), batch %d x %d tokens in %d "
                   "micro-batch(es)\n", N, dopt.threads, a.batch, a.seq, a.micro_batches);
    } else {
        printf("device cpu (%d threads), batch %d x %d tokens in %d micro-batch(es)%s\n",
               opt_pool->n_threads, a.batch, a.seq, a.micro_batches,
               recompute ? ", recomputing activations" : "");
    }
    train_state_free(&ts);  // the pending weights: copied into the engine, unused by a plain run
    // model FLOPs per token for the MFU column (GPU runs; PERFORMANCE_MODEL.md §1)
    const double flops_per_token = config_flops_per_token(&model.cfg, a.seq);

    // 3. data
    DataLoader train, val;
    int have_val = a.val[0] != '\0' && !dump;
    if (dataloader_open(&train, a.train, a.batch, a.seq, dump ? 0 : a.shuffle, a.seed,
                        model.cfg.V, err) != 0)
        fatal("--train: %s", err);
    if (have_val && dataloader_open(&val, a.val, a.batch, a.seq, 0, a.seed, model.cfg.V, err) != 0)
        fatal("--val: %s", err);
    if (ts.resumed && dataloader_state_restore(&train, ts.train_loader, err) != 0)
        fatal("--resume: %s", err);
    int32_t* tokens = malloc_check((size_t)a.batch * (a.seq + 1) * sizeof(int32_t));

    // 4. --dump-state: gradients of the first batch, then exit
    if (dump) {
        if (dataloader_next_batch(&train, tokens, err) != 0) fatal("%s", err);
        double loss = train_forward_backward(plain, &a, tokens);
        if (checkpoint_dump_state(a.dump_state, &model, &store, (float)loss, err) != 0)
            fatal("%s", err);
        printf("loss %.7f; gradients written to %s\n", loss, a.dump_state);
        return 0;
    }

    // 5. training
    StepLog lg;
    if (log_open(&lg, a.log, ts.resumed, err) != 0) fatal("%s", err);
    LrSchedule sched = {a.schedule, a.lr, a.warmup, a.steps, a.min_lr_frac, a.decay_frac};
    AdamWHyper hyper = {a.lr, a.beta1, a.beta2, a.eps, a.weight_decay};
    AdamWTensor* opt = malloc_check((size_t)model.tt.n * sizeof(AdamWTensor));
    int n_opt = store_adamw_tensors(&store, opt);
    if (have_val) log_eval(&lg, (int)ts.step, evaluate(plain, &val, &a, tokens));
    // With the engine the next iteration is submitted before this one is collected (two in
    // flight), except where the run must stop and look: checkpoints, evaluations, the end. A
    // step's time is then the time between two collections: the iteration period.
    double t_step = time_now_s();
    // tok/s, MFU and bubble over the last W steps (W = the engine's devices): with the whole
    // model in one stage each GPU takes every other iteration and the step times alternate long
    // and short; over W steps they are the steady rate. ms stays the step's own time.
    enum { RATE_WINDOW_MAX = 64 };
    const int rate_window = eng ? imax(1, imin(devs.n, RATE_WINDOW_MAX)) : 1;
    double win_dt[RATE_WINDOW_MAX] = {0}, win_idle[RATE_WINDOW_MAX] = {0};
    int win_n = 0;
    for (int step = (int)ts.step + 1; step <= a.steps; step++) {
        double t0 = t_step;
        StepStats st = {.step = step, .steps = a.steps, .mfu = -1, .bubble = -1, .dev_mib = -1};
        const int stop_after = step == a.steps ||
                               (a.save_every > 0 && step % a.save_every == 0) ||
                               (have_val && a.eval_every > 0 && step % a.eval_every == 0);
        if (eng) {
            // the norm and lr are those of a fixed optimizer step (with the delayed update, the
            // step applying the previous iteration's gradient)
            int replans = engine_replans(eng);
            if (engine_in_flight(eng) == 0) {
                if (dataloader_next_batch(&train, tokens, err) != 0) fatal("%s", err);
                engine_submit(eng, tokens);
            }
            if (!stop_after) {
                if (dataloader_next_batch(&train, tokens, err) != 0) fatal("%s", err);
                engine_submit(eng, tokens);
            }
            EngineStepResult r = engine_collect(eng);
            if (engine_replans(eng) != replans) {
                printf("re-planned from the measured stage times:\n");
                engine_print_plan(eng, stdout);
            }
            st.loss = r.loss;
            st.norm = r.norm;
            st.lr = r.lr;
            st.bubble = r.bubble;
            st.dev_mib = 0;
            for (int g = 0; g < devs.n; g++) {
                DeviceStats ds;
                devs.impl->stats(devs.dev[g], &ds);
                st.dev_mib += (double)ds.mem_in_use / (1 << 20);
            }
        } else {
            if (dataloader_next_batch(&train, tokens, err) != 0) fatal("%s", err);
            st.loss = train_forward_backward(plain, &a, tokens);
            st.norm = sqrt(adamw_grad_norm_sq(opt_pool, opt, n_opt));
            st.lr = hyper.lr = lr_schedule_at(&sched, step);
            adamw_step(opt_pool, opt, n_opt, &hyper, step, adamw_clip_scale(st.norm, a.grad_clip));
            store.step = step;
            plain_sync_params(plain);
        }
        if (!isfinite(st.loss)) fatal("loss is not finite at step %d (try a lower --lr)", step);
        // nothing submitted after this step: its work after the loss (a stage plan's backward
        // stages; for a single step most of it) is step time too
        if (eng && stop_after) engine_wait_devices(eng);
        t_step = time_now_s();
        double dt = t_step - t0;
        st.ms = dt * 1e3;
        win_dt[win_n % rate_window] = dt;
        win_idle[win_n % rate_window] = st.bubble >= 0 ? st.bubble * dt : 0.0;
        win_n++;
        double sum_dt = 0.0, sum_idle = 0.0;
        const int in_window = imin(win_n, rate_window);
        for (int w = 0; w < in_window; w++) {
            sum_dt += win_dt[w];
            sum_idle += win_idle[w];
        }
        st.tok_s = (double)a.batch * a.seq * in_window / sum_dt;
        if (st.bubble >= 0) st.bubble = sum_idle / sum_dt;
        if (use_cuda) st.mfu = flops_per_token * st.tok_s / (989e12 * N);
        st.host_mib = log_host_rss_mib();
        log_step(&lg, &st);
        if (a.save_every > 0 && (step % a.save_every == 0 || step == a.steps)) {
            if (eng) engine_synchronize(eng);
            ts.step = step;
            dataloader_state_save(&train, ts.train_loader);
            void** next = NULL;
            if (eng && !a.sync) {
                // the delayed update: the next iteration computes with weights one step behind
                next = malloc_check((size_t)model.tt.n_layers * sizeof(void*));
                for (int l = 0; l < model.tt.n_layers; l++) next[l] = (void*)engine_next_weights(eng, l);
                ts.pending = next;
                ts.pending_bytes = engine_weight_bytes(eng);
                ts.pending_owned = 0;
                engine_last_update(eng, &ts.pending_norm, &ts.pending_lr);
            }
            if (checkpoint_save_state(a.out, a.keep, &model, &store, &ts, args_json, err) != 0)
                fatal("%s", err);
            free(next);
            ts.pending = NULL;
            ts.pending_bytes = 0;
        }
        if (have_val && a.eval_every > 0 && step % a.eval_every == 0 && step != a.steps) {
            if (eng) {
                engine_synchronize(eng);
                if (plain) plain_sync_params(plain);
            }
            log_eval(&lg, step, evaluate(plain, &val, &a, tokens));
        }
        if (stop_after) t_step = time_now_s();  // checkpoints and evaluations are not step time
    }
    if (eng) {
        engine_synchronize(eng);
        if (plain) plain_sync_params(plain);
        if (engine_write_trace(eng, err) != 0) fatal("%s", err);
        if (a.trace[0]) printf("trace written to %s\n", a.trace);
    }
    if (have_val && a.steps > 0) log_eval(&lg, a.steps, evaluate(plain, &val, &a, tokens));
    log_close(&lg);

    // 6. sample and save
    if (a.sample_tokens > 0) generate_sample(plain, &a);
    if (a.out[0]) {
        if (checkpoint_save_hf(a.out, &model, &store, err) != 0) fatal("%s", err);
        printf("saved the model to %s (model.safetensors, config.json)\n", a.out);
    }
    if (a.export_hf[0]) {
        if (checkpoint_export_hf(a.export_hf, &model, &store, a.export_dtype,
                                 (uint64_t)a.export_shard_bytes, &src, err) != 0)
            fatal("%s", err);
        printf("exported the model to %s (HF layout, %s)\n", a.export_hf,
               export_dtype_name(a.export_dtype));
    }
    if (a.export_gguf[0]) {
        if (checkpoint_export_gguf(a.export_gguf, &model, &store, a.export_dtype, &src, err) != 0)
            fatal("%s", err);
        printf("exported the model to %s (GGUF, %s)\n", a.export_gguf,
               export_dtype_name(a.export_dtype));
    }
    checkpoint_close_source(&src);
    free(args_json);

    free(opt);
    free(tokens);
    dataloader_close(&train);
    if (have_val) dataloader_close(&val);
    if (eng) {
        engine_free(eng);
        device_set_close(&devs);
    }
    plain_free(plain);
    threadpool_destroy(opt_pool);
#ifdef HAVE_CUDA
    if (use_cuda) ops_cuda_destroy(ctx);
    else
#endif
        ops_cpu_destroy(ctx);
    store_free(&store);
    model_free(&model);
    return 0;
}
