/*
 * engine.h — the RoundPipe engine (docs/ROUNDPIPE.md): stages of the layer sequence dispatched
 * round-robin to N stateless devices, asymmetric forward/backward partitions with a fused
 * loss stage, a prioritised transfer engine over four copy streams per device, a per-layer
 * consistency protocol and a one-step-delayed CPU optimizer.
 *
 * One optimizer step = one iteration = R rounds of M_R micro-batches (M = R*M_R). A round is the
 * slot sequence F_1..F_Sf, FB (fused: forward + loss + backward of the deepest layers), B_2..B_Sb.
 * Global slot i goes to device (g0 + i) mod N; the cursor g0 is never reset (rounds, iterations).
 *
 * Threads: the caller's thread is the controller. It walks the slots in order and ENQUEUES all of
 * a stage's work (parameter upload, per micro-batch activation upload / compute / download,
 * gradient download) on the device's streams; cross-stage dependencies are device events, which a
 * producer always records before a consumer waits on them because slots are enqueued in order
 * (docs/ROUNDPIPE.md §3.2). The controller blocks only at fences on the host flags of
 * the consistency protocol. One optimizer thread runs AdamW steps from a FIFO.
 *
 * Precision: devices compute in their backend's dtype (fp32 emulated, bf16 CUDA); the host keeps
 * fp32 master weights, m, v and fp32 gradient accumulators (the Store) plus two compute-dtype
 * copies of the weights ("master" buffers, docs/ROUNDPIPE.md §5.1): the optimizer step for
 * iteration t's gradient writes the updated weights straight into the buffer the next iteration to
 * use them uploads from, so no separate P-copy or G-copy pass exists. With the delayed update the
 * fp32 gradient accumulators are double-buffered too (one more set, pinned), so an iteration's
 * gradient downloads never wait for the step still reading the previous iteration's: the CPU
 * step hides behind a whole iteration. Host memory: 16 B/param (Store) + 2 x compute dtype
 * (masters) + 4 B/param (second gradient set, delayed mode only), plus activation checkpoints.
 *
 * Delayed update (default, docs/ROUNDPIPE.md §6.1): iteration t computes with θ_{max(t-1,0)}; with
 * `sync`, iteration t computes with θ_t (the step waits for the previous iteration).
 *
 * Determinism: every micro-batch runs the same ops in the same order whatever device it lands on;
 * gradients of a layer accumulate micro-batch by micro-batch (and round by round, by re-uploading
 * the fp32 partial sum), so in sync mode results are bit-identical for any N, and equal to the
 * plain trainer's for the same micro-batch count.
 */
#ifndef LLMC_ENGINE_H
#define LLMC_ENGINE_H

#include <stdint.h>
#include <stdio.h>

#include "adamw.h"
#include "comm.h"
#include "device.h"
#include "model.h"
#include "partition.h"
#include "store.h"

typedef enum { RECOMPUTE_STAGE = 0, RECOMPUTE_LAYER } RecomputeGrain;

// The events a trace records at most (recording stops beyond; the file says so).
#define ENGINE_TRACE_EVENTS 2000000

typedef struct EngineOptions {
    int B, T;                // batch (sequences per step) and sequence length
    int M;                   // micro-batches per iteration
    int M_R;                 // micro-batches per round (M % M_R == 0; 0 = M: one round)
    RecomputeGrain grain;
    int sync;                // 1: synchronous optimizer (no staleness)
    double device_budget;    // bytes of device memory the engine may allocate per device: stage
                             // slots, activations, scratch and hand-off buffers (0 = unlimited)
    int opt_threads;         // optimizer threads (0 = all CPUs)
    const int* opt_cpus;     // the optimizer thread and its pool run on these CPUs (NULL: anywhere)
    int n_opt_cpus;
    const char* trace_path;  // Chrome trace JSON ("" = none); at most ENGINE_TRACE_EVENTS events
    int host_single;         // 1: one set of host activation checkpoints instead of one per
                             // iteration parity (half the host memory; a producer then waits
                             // until the previous iteration's last consumer has read a buffer)
    int64_t start_step;      // optimizer steps already applied (resume): step k of this engine is
                             // step start_step + k of the run (LR schedule, bias correction)
    uint32_t seed;           // LoRA: the run's seed, for the dropout masks (lora_dropout_seed of
                             // step start_step + t, micro-batch i: the plain trainer's masks)
    int release_frozen;      // LoRA on bf16 devices: the caller reads the Store's fp32 frozen
                             // base no more, so the engine gives its pages back as it makes its
                             // bf16 copy (store_release_range; the caller then marks the Store
                             // with store_release_frozen): the host holds at most the fp32 base
                             // at any time, and the bf16 base once afterwards
    const void* const* first_weights;  // resume with the delayed update: per layer, in the
                             // compute dtype, the weights the first iteration computes with (one
                             // step behind the Store's); NULL = the Store's weights. Only the
                             // layer's trainable tensors: tt.state_numel[l] elements, the end of
                             // its slab (everything for full training, the adapters with LoRA)
    double first_norm, first_lr;  // with first_weights: the norm and lr of the update the Store
                             // already holds, reported with the first iteration (as the straight
                             // run reports that update with the iteration it ran during)
    int row_chunks;          // compute each micro-batch in this many row chunks, one after the
                             // other (activations and scratch sized for a chunk, so more layers
                             // fit the fused stage; gradients are the same sums); 0 = choose:
                             // the fewest chunks (<= 8, each >= 1 sequence) within 3% of the
                             // cheapest plan
    int split_rounds;        // 1: on N >= 2 devices with the whole model in one stage, each
                             // iteration is N rounds of M/N micro-batches that run at the same
                             // time, one per device, each accumulating its own gradient from zero;
                             // the optimizer adds the rounds' gradients in round order (data
                             // parallel within an iteration, so its step overlaps the next
                             // iteration instead of sitting between t and t+2 on one device). Not
                             // bit-identical to one sequential accumulation (the same sums in
                             // another order). M_R is then M/N.
    int replan_after;        // re-plan once with profiled costs after this many iterations, then
                             // freeze the plan (0 = keep the size-based plan)
    int fake_compute_us;     // tests only: a stage's micro-batch sleeps this long instead of
                             // computing (uniform stage times, to measure the schedule's bubble)
    int fake_optimizer_us;   // tests only: every optimizer step takes this much longer
    // data parallel (docs/DISTRIBUTED.md §6): this rank's communicator (NULL: one process). B and
    // M are then this rank's share (B/W sequences in M/W micro-batches); every gradient is scaled
    // by 1 / (global_B · T) and the optimizer thread reduce-scatters each layer's gradient over
    // the ranks as soon as its download is done (while the backward of the layers below goes
    // on), steps AdamW on this rank's shard (ZeRO-1) and all-gathers the updated weights. Full
    // training of dense models only.
    Comm* comm;
    int global_B;            // the global batch (0 = B)
    int reduce_bf16;         // the gradients travel in bf16 (summed in fp32), else fp32
    int shard_weights;       // the Store's fp32 weights outside this rank's shard give their
                             // memory back too (only where nothing reads them between steps: no
                             // plain path for evaluation or sampling); engine_gather_layer brings
                             // them back one layer at a time for checkpoints, engine_gather_state
                             // whole for the exports
    int policy;              // 1: iterations may carry the policy-gradient objective instead of
                             // the cross-entropy (engine_submit_loss): its per-token inputs and
                             // log-probs get buffers on the devices and the host (20 B per token
                             // of a micro-batch, per parity). Dense models on one process
    // optimizer
    AdamWHyper hyper;
    LrSchedule sched;
    float grad_clip;
} EngineOptions;

typedef struct EngineStepResult {
    double loss;        // mean loss of this iteration's tokens
    double norm;        // global gradient norm of the step reported with this iteration: with
                        // --sync the step of this iteration's gradient, with the delayed update
                        // the step of the previous iteration's (none for the first: 0)
    double lr;          // its learning rate
    int64_t norm_step;  // the run's number of that step (0 = none)
    double bubble;      // fraction of device compute time idle during this iteration (0..1)
    // MoE models (as the plain trainer's step statistics): the sum of the per-token CE losses,
    // the sum over micro-batches of aux x tokens, and the tokens routed to each expert (E, summed
    // over the MoE blocks and micro-batches; engine memory, valid until the next engine_collect;
    // NULL for dense models). loss is (ce_sum + router_aux_loss_coef · aux_sum) / (B·T) when
    // the aux loss is on, else ce_sum / (B·T).
    double ce_sum, aux_sum;
    const double* load;
    // data parallel: loss is the global batch's (every rank's sum, added in rank order); error
    // (engine memory, NULL when all went well) is the first failed collective's message, naming
    // the rank that died or hung: the run must end (the weights are not consistent any more)
    const char* error;
    // the policy objective (engine_submit_loss): loss is then the sum of the per-token objectives
    // (their weights carry the normalisation), summed micro-batch by micro-batch as the plain
    // path sums them; logp (B, T) each target's log-prob under the weights the iteration computed
    // with (0 where there is no target and in rows not computed), engine memory valid until the
    // next engine_collect. NULL for the cross-entropy.
    const float* logp;
} EngineStepResult;

// The loss head's objective of one iteration when it is not the cross-entropy on the next tokens:
// the clipped policy-gradient objective (model.h PolicyLoss, ops.h policy_forward_backward), its
// per-token inputs handed in with the tokens as host arrays (B, T) aligned with the tokens' rows
// (copied at submission, like the tokens). Gradients are not scaled: the weights carry the
// normalisation (EngineOptions.global_B plays no part).
typedef struct EngineLoss {
    const int32_t* targets;  // (B, T) the token position j is trained to predict (< 0: none),
                             // instead of the tokens' next column
    const float *old_logp, *ref_logp, *adv, *weight;  // (B, T); ref_logp NULL: no KL term
    float inv_temp, clip_low, clip_high, kl_beta;
    int rows;                // rows of the batch that carry data, the first ones (B: all; 0:
                             // none): the rest are not computed (no loss, no gradient), so a
                             // micro-batch of none costs its transfers only, and the sums are the
                             // plain path's over the same rows
} EngineLoss;

typedef struct Engine Engine;

// Plan the partition and allocate everything. -1 + one line if the model cannot be planned (e.g.
// a layer larger than the device budget) or the options are inconsistent.
Engine* engine_create(const Model* m, Store* s, DeviceSet* devs, const EngineOptions* opt,
                      char* err);
void engine_free(Engine* e);
// What one device holds for the plan, in bytes (every device allocates the same; all of it is
// allocated when the engine is created). total = slots + acts + scratch + handoff.
typedef struct EngineDeviceBytes {
    size_t slots;    // parameter (compute dtype) and fp32 gradient slots of the largest stage:
                     // two of each (the running stage and the prefetched one), or one of each
                     // when the whole model is one stage and two would not fit the budget
    int slot_sets;   // 1 or 2
    size_t acts;     // saved block activations (the fused stage's blocks, stage-grain backward)
    size_t scratch;  // the workspace's temporaries (attention, MLP, LM-head chunk, RoPE tables)
    size_t handoff;  // residual-stream, incoming-gradient, token, target and loss buffers
    size_t total;
} EngineDeviceBytes;
EngineDeviceBytes engine_device_bytes(const Engine* e);
// The part of that every plan of this shape needs (scratch and the hand-off buffers not
// proportional to a stage's length): --device-mem must exceed it; the stages share the rest.
size_t engine_fixed_device_bytes(const Model* m, int act_bytes, const EngineOptions* opt);

// The chosen partition (for --plan and tests).
const PartitionPlan* engine_plan(const Engine* e);
// Print the plan, predicted bubble and per-device memory.
void engine_print_plan(const Engine* e, FILE* f);
// The same plan without an engine (no store, devices or buffers): for --plan on any machine.
// act_bytes: the devices' compute dtype (2 bf16 GPUs, 4 fp32 emulated); *host_act_bytes (may be
// NULL): the host memory its activation checkpoints take; f may be NULL (nothing printed). -1
// with err on a bad shape.
int engine_plan_print(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                      FILE* f, size_t* host_act_bytes, char* err);
// 0 when a plan fits (the same search, nothing printed); -1 with err otherwise.
int engine_plan_fits(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                     char* err);
// What the chosen plan allocates (the same search, nothing printed): per device, on the host for
// activation checkpoints, and the rows a device computes at a time (Bc x T tokens: the row chunk
// its ops' temporaries are sized for). -1 with err when no plan fits.
typedef struct EnginePlanMemory {
    EngineDeviceBytes device;  // each device's buffers (emulated devices: host memory)
    size_t host_checkpoints;   // host activation checkpoints and boundary gradients
    int Bc;                    // sequences per row chunk
} EnginePlanMemory;
int engine_plan_memory(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                       EnginePlanMemory* out, char* err);
// The same, with the chosen plan's cost (PartitionPlan.cost: the work on one device, S x t_max
// on several) in *cost: plans of one shape under different settings compare by it.
int engine_plan_cost(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                     double* cost, char* err);

// ----------------------------------------------------------------------------
// the run's plan policy (plan.c): the decisions a caller makes before it creates an engine, with
// the engine's own accounting. They take explicit values: a CLI maps its flags to EngineOptions.

// Host memory of a run in bytes (docs/PERFORMANCE.md §3), before anything is allocated: what
// engine_create allocates besides the caller's Store, and the Store itself.
typedef struct EngineHostMemory {
    double store;            // the Store: fp32 weights, m, v and gradients, 16 B/param
    double masters;          // the two compute-dtype weight copies, 2 x act_bytes per trainable
                             // param, and one copy of a frozen base (LoRA) in the compute dtype
                             // (included: base; none on fp32 devices, which read the Store's)
    double base;             // of which the frozen base's compute-dtype copy
    double store_frozen;     // of the Store: its fp32 copy of the frozen base (0 without LoRA),
                             // which a run can give back once the engine holds its own
                             // (store_release_frozen)
    double grads;            // the delayed update's second fp32 gradient set, 4 B/param (0 in
                             // sync mode)
    double split_extra;      // one fp32 gradient set per extra round with split rounds,
                             // (N - 1) x 4 B/param: what opt->split_rounds adds (or would add)
    double staging;          // every micro-batch's tokens, targets and losses, two iterations
    double fixed;            // store + masters + grads + staging (+ split_extra with
                             // opt->split_rounds)
    double checkpoints_max;  // host activation checkpoints at most: (L + 3) residual-stream
                             // buffers per sequence (every stage boundary but the prefix's, and
                             // the two-slot gradient ring), in one or two sets (opt->host_single);
                             // a plan's own figure: engine_plan_print's host_act_bytes
} EngineHostMemory;
EngineHostMemory engine_host_memory(const Model* m, int act_bytes, int n_devices,
                                    const EngineOptions* opt);
// The device budget (EngineOptions.device_budget) when none is given: 90% of the memory free on
// the device (the rest: allocator rounding, cuBLAS and CUDA internals).
double engine_default_device_budget(double device_free_bytes);
// --mlp-chunk: requested >= 0 is taken as given (0 = no chunks); -1 = auto: chunk the MLP in
// 16384 rows when micro-batches hold more than 65,536 tokens, or more than 16384 tokens and the
// chunked plan costs at least 1% less (less recompute) or is the only one that fits. Sets
// m->mlp_chunk (the plans are tried with it) and returns it; prints a "note:" line when auto
// chunks.
int engine_resolve_mlp_chunk(Model* m, int requested, int act_bytes, int n_devices,
                             const EngineOptions* opt);
// --split-rounds: requested >= 0 is returned as given; -1 = auto: 1 on gpus (the devices are
// GPUs) with n_devices >= 2, M a multiple of n_devices, no round size given (opt->M_R == 0), a
// one-stage split plan, and room in host_total bytes (0 = unknown: no check) for its extra
// gradient sets within 90%; else 0. Prints a "note:" line when it splits or when host memory
// stops it.
int engine_resolve_split_rounds(const Model* m, int requested, int gpus, int act_bytes,
                                int n_devices, const EngineOptions* opt, double host_total);

// ----------------------------------------------------------------------------
// running

// Iterations are submitted and collected in order, at most two in flight: with the delayed
// update iteration t+1 needs nothing of iteration t (its weights are those after step t-1), so a
// GPU can start it while another still runs iteration t, and a plan of fewer stages than devices
// (the whole model in the fused stage) still keeps two devices busy.
// engine_submit: enqueue every round of one iteration on tokens (B, T+1) (copied; the caller may
// reuse the buffer) and hand the optimizer step for its gradient to the optimizer thread. It
// returns once everything is enqueued (the per-layer fences may make it wait for an earlier
// optimizer step). Fatal with two iterations already in flight.
void engine_submit(Engine* e, const int32_t* tokens);
// engine_submit with the loss head's objective of this iteration (NULL: the cross-entropy);
// the engine must have been created with EngineOptions.policy.
void engine_submit_loss(Engine* e, const int32_t* tokens, const EngineLoss* loss);
// Wait for the oldest uncollected iteration's losses and its reported step; fatal with none.
// The losses are known before the iteration's work is over (a stage plan's backward stages run
// after the fused stage): the time between two collections is the iteration period only while
// the next iteration is already in flight.
EngineStepResult engine_collect(Engine* e);
// Wait until the devices have done all work submitted so far (not the optimizer's CPU steps):
// with nothing submitted after it, the last collected iteration's time ends here.
void engine_wait_devices(Engine* e);
// Iterations submitted and not yet collected (0, 1 or 2).
int64_t engine_in_flight(const Engine* e);
// engine_submit + engine_collect of that iteration (collecting any earlier ones first).
EngineStepResult engine_step(Engine* e, const int32_t* tokens);
// Wait until all enqueued work and all queued optimizer steps are done; afterwards the Store's
// fp32 weights hold every applied update (for evaluation, sampling and checkpoints).
void engine_synchronize(Engine* e);
// Optimizer steps applied so far.
int64_t engine_steps_done(const Engine* e);
// The trainable weights (compute dtype, the last tt.state_numel[l] elements of layer l's slab:
// all of it for full training, the adapters with LoRA) the next iteration will compute with:
// with the delayed update one step behind the Store's. Valid after engine_synchronize; a
// checkpoint keeps them so a resumed run (EngineOptions.first_weights) continues bit-exactly.
const void* engine_next_weights(const Engine* e, int layer);
// The trainable weights (compute dtype, as engine_next_weights) of the last optimizer step
// applied: the Store's fp32 weights rounded as f32_to_bf16 (bf16 devices) or copied (fp32). In
// sync mode the same as engine_next_weights; with the delayed update the other master buffer,
// one step ahead of it. Valid after engine_synchronize (pinned host memory).
const void* engine_latest_weights(Engine* e, int layer);
// Bytes per element of those weights (the compute dtype).
int engine_weight_bytes(const Engine* e);
// The gradient norm and lr of the last optimizer step applied (0, 0 before any). Valid after
// engine_synchronize.
void engine_last_update(Engine* e, double* norm, double* lr);
// Times the plan was rebuilt from profiled stage times (0 or 1).
int engine_replans(const Engine* e);
// Stages enqueued before the optimizer had finished their weights, so uploaded layer by layer
// behind per-layer fences (their first micro-batch's forward gated per layer too).
int64_t engine_gated_stages(const Engine* e);
// Iterations whose tied head gradient was folded into the embedding's on the device (the whole
// model in one stage) rather than by the optimizer on the host.
int64_t engine_device_folds(const Engine* e);
// Row chunks per micro-batch (EngineOptions.row_chunks, or the one chosen).
int engine_row_chunks(const Engine* e);
// Data parallel: make the Store's exact fp32 weights (and with with_state AdamW's m and v) whole
// on rank root (-1: every rank) by all-gathers of the shards, for a checkpoint or the exports.
// Collective (every rank calls it at the same point); the engine synchronises first. 0, or -1
// with err (a failed collective). engine_release_state gives the memory of m and v outside the
// rank's shard back again (after the checkpoint is written).
int engine_gather_state(Engine* e, int root, int with_state, char* err);
void engine_release_state(Engine* e);
// Data parallel, a checkpoint streamed (checkpoint_save_state_gathered): layer l's fp32 weights
// (field 0), m (1) or v (2) complete on rank root, whose pages outside its shard of the layer
// gathered before go back (root holds one layer more than its shard). Collective, in the same
// order on every rank; call engine_synchronize first and engine_release_state after the last.
int engine_gather_layer(Engine* e, int field, int l, int root, char* err);
// Data parallel: this rank's AdamW shard (parameters), and all of them.
int64_t engine_shard_params(const Engine* e);
// Write the Chrome trace (opt.trace_path) of everything so far; no-op without a trace path.
int engine_write_trace(Engine* e, char* err);

#endif  // LLMC_ENGINE_H
