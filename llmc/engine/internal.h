/*
 * internal.h — the RoundPipe engine's private header: the Engine struct, the per-stage and
 * per-device state, the micro-batch jobs, and the functions the engine's files share. Only the
 * engine's own files include it; callers see llmc/engine.h.
 *
 * The engine is six files, the way docs/ROUNDPIPE.md explains the system:
 *   plan.c      memory model, plan choice (partition + row chunks), re-planning from profiles, the
 *               run's plan policy (--mlp-chunk / --split-rounds auto, host memory, device budget)
 *   dispatch.c  stages, rounds, slots and the never-reset cursor; the micro-batch jobs
 *   transfer.c  parameter uploads (LPT chunks, gated per layer), activation hand-offs, gradient
 *               downloads (deferred LPT bins, per layer)
 *   protocol.c  the per-layer fences (the five ordering rules) and the optimizer thread
 *   shard.c     data parallel: the ZeRO-1 shard of each layer, the per-layer reduce-scatter, the
 *               global norm and loss, the all-gather of the updated weights (docs/DISTRIBUTED.md
 *               §6; the optimizer thread calls it, host collectives only)
 *   jobs.c      the micro-batch closures and trace labels (the bottom: no events, no flags)
 *   engine.c    create / submit / collect / synchronize / free: allocation and the glue
 *
 * Buffers and the events guarding them
 *  - device parameter slots pslot[2] (stage s and stage s+N of a device alternate): an upload into
 *    slot k waits pslot_free[k], recorded after the last compute that read it.
 *  - device gradient slots gslot[2] (fp32): zeroed (or, in later rounds, loaded with the host's
 *    partial sum) before a backward stage, downloaded after its last micro-batch; reuse waits
 *    gslot_free[k], recorded after the download.
 *  - device activation buffers come in two parities (micro-batch i uses parity i % 2), so the
 *    upload of i+1 overlaps the compute of i and the download of i overlaps the compute of i+1
 *    ("upload one early, download one late", docs/ROUNDPIPE.md §4.2): an upload into parity p
 *    waits comp_done[p] and down_done[p]; a compute into parity p waits down_done[p].
 *  - host activations: x at a layer boundary (forward outputs, checkpoints) and dx (gradients
 *    between backward stages) per micro-batch, in two iteration parities; x_ev / dx_ev mark a
 *    download done and gate the consumer's upload (cross-device waits). Before iteration t reuses
 *    parity t % 2 the controller waits for iteration t-2 to be entirely done. The dx buffers of a
 *    micro-batch form a ring of two: boundaries alternate going down, and the producer of a
 *    boundary's dx runs only after the consumer of the boundary above it (same slot, two
 *    boundaries up) has uploaded it, through the backward chain's own events.
 *  - MoE models: device moe[p] (aux statistics and counts of the micro-batch in parity p) follows
 *    the activation parities' rules; host hmoe[ip][i] rides on x_ev (forward stages' rows, read
 *    by the fused stage), loss_ev (read by engine_collect) and dx_ev (the counts, read by
 *    backward stages) (docs/ROUNDPIPE.md §4.5).
 *
 * The consistency protocol (docs/ROUNDPIPE.md §5), per layer l, with two compute-dtype master
 * buffers:
 *  - iteration t uploads layer l from master[t % 2] once param_ready[l] >= t (rule 2): in sync
 *    mode the controller waits for a whole stage before enqueueing it; with the delayed update a
 *    stage not ready at enqueue time gets a host-function wait per layer on its parameter stream
 *    instead (gated upload), so the device starts while the step still writes deeper layers;
 *  - optimizer step k (gradient of iteration k-1) writes master[(k + delay) % 2]; the previous
 *    reader of that buffer is iteration k+delay-2 <= k-1, whose last upload of l precedes its last
 *    gradient download of l, which the step waited for (rule 1);
 *  - the step reads the host gradient of iteration k-1 and iteration k may only download into it
 *    once grad_consumed[l] >= k-1 (rules 3 and 4);
 *  - steps run in FIFO order on one thread (rule 5).
 *
 * Threads: the controller (the caller's thread) runs everything in engine.c, dispatch.c,
 * transfer.c and plan.c and the fences of protocol.c; the optimizer thread runs optimizer_main
 * (protocol.c); micro-batch jobs and host-function fences run on the devices' stream threads. The
 * protocol flags (param_ready, grad_consumed, grad_recorded, split_summed, folded_iter,
 * steps_queued / steps_done, the norm and lr history, shutdown) are read and written under mu only.
 */
#ifndef LLMC_ENGINE_INTERNAL_H
#define LLMC_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "../common.h"
#include "../engine.h"
#include "../moe.h"
#include "../quant.h"
#include "../trace.h"

// ----------------------------------------------------------------------------
// data structures

typedef struct Stage {
    SlotKind kind;
    int b, e;               // layers [b, e)
    int64_t* p_off;         // (e-b) element offset of each layer's parameters in the slot
    int64_t* g_off;         // (e-b) element offset of each layer's gradients in the grad slot
    int64_t head_off;       // fused stage with a tied head: offset of the embedding copy, else -1
    int64_t param_numel;    // slot elements (compute dtype)
    int64_t grad_numel;     // grad slot elements (fp32; 0 for forward stages)
    char name[16];          // "F1", "FB", "B2" (traces)
} Stage;

// One host<->device copy of at most PIECE_MAX_BYTES (transfer.c).
typedef struct Piece {
    void* dst;
    const void* src;
    size_t bytes;           // bytes written to dst
    // --mmap-base: src is a tensor of the mapped checkpoint (pageable), src_type its ggml type:
    // the copy goes through the device's pinned staging buffers, converted to the upload format
    int staged;
    int src_type;
} Piece;

// A backward stage's gradient download, deferred into the activation windows of the next stage
// on the same device (docs/ROUNDPIPE.md §4.4): LPT bins of <= 256 MiB pieces, bin j enqueued once
// the next stage's micro-batch j has had its activations downloaded.
typedef struct PendingGrads {
    int active;
    const Stage* st;
    int gk;               // gradient slot being downloaded
    int64_t t;            // iteration
    int final_round;
    int n_pieces;
    Piece* pieces;
    int* bin_of;          // (n_pieces)
    int n_bins, next_bin; // bins enqueued so far
    int fenced;           // rule-4 fence passed
} PendingGrads;

typedef struct DevState {
    Device* d;
    const Ops* ops;
    void* ctx;
    Workspace* ws;
    void* pslot[2];
    void* stage[2];         // --mmap-base: pinned staging buffers (STAGE_BYTES each) the mapped
                            // base goes through on its way up, used in turn (transfer.c)
    int stage_next;
    void* qslot[2];         // [slot] the stage's quantised base tensors as uploaded, in their
                            // blocks, dequantised into pslot on the compute stream (quant.h;
                            // NULL without --base-dtype)
    DevEvent* pslot_free[2];
    int pnext;
    float* gslot[2];
    DevEvent* gslot_free[2];
    int gnext;
    void** xs[2];           // [parity][k]: input of the k-th layer of the running stage
    void* dres[2];          // [parity] residual-stream gradient
    int32_t* ids[2];
    int32_t* targets[2];
    float* losses[2];
    float* pol[2];          // [parity] the policy objective's per-token buffers (Engine.pol_stride
                            // floats each: old, ref, adv, weight, logp; NULL without opt.policy)
    DevEvent* up_done[2];
    DevEvent* comp_done[2];
    DevEvent* down_done[2];
    DevEvent* param_done;   // parameter (and partial gradient) upload of the current stage done
    DevEvent** lev[2];      // [slot][k]: layer k of the stage in that slot uploaded (gated
                            // uploads; k = the stage's length: the tied head's copy)
    DevEvent** marks;       // (M_R) activation-upload marks of the last stage run on this device
    int n_marks;
    DevEvent* grads_ready;  // the last micro-batch of the stage whose gradients are pending
    DevEvent** gev;         // [k]: layer k of the running stage has its final gradient (per-layer
                            // downloads)
    PendingGrads pend;
    DevEvent* iter_end[2][STREAM_COUNT];
    // MoE models: [parity] (moe_floats) fp32, the micro-batch's aux statistics rows (one per MoE
    // block, 2E each) then the summed counts (E); a job points its workspace's moe_stats /
    // moe_counts here (the workspace's own buffers, ws_moe_stats / ws_moe_counts, are kept for
    // workspace_free), so the hand-offs of micro-batch i never race the compute of i+1
    float* moe[2];
    float *ws_moe_stats, *ws_moe_counts;
    double busy_last;       // compute busy seconds at the previous step (bubble accounting)
} DevState;

// What one job on a compute stream does with its micro-batch (row chunk): the whole of it, or one
// part, so that parts can wait for per-layer uploads or be followed by per-layer downloads.
typedef enum {
    MB_PHASE_WHOLE = 0,  // the whole micro-batch
    MB_PHASE_FORWARD,    // forward of layers [from, to) only
    MB_PHASE_REST,       // the rest after MB_PHASE_FORWARD jobs (fused: loss and backward;
                         // backward: backward)
    MB_PHASE_LOSS,       // the fused stage's loss (postfix forward + backward) only
    MB_PHASE_BACKWARD,   // backward of layers [from, to) only
    MB_PHASE_FOLD,       // fold the tied head's gradient into its owner's (stage holding both,
                         // after the last backward)
} MbPhase;

// Closure of one micro-batch of one stage, run on a compute stream (or, for a gated upload's
// fence, on a parameter stream). Lives in an arena until the iteration that created it is done.
typedef struct MbJob {
    struct Engine* e;
    DevState* ds;
    const Stage* st;
    int i;          // micro-batch index within the iteration
    int p;          // device buffer parity (i % 2)
    int ip;         // iteration parity
    int B;          // sequences in this job's row chunk (micro-batches and chunks may differ by one)
    int row0;       // the chunk's first row within the micro-batch
    const void* pslot;
    float* gslot;
    MbPhase phase;
    int from, to;
    int64_t t;      // protocol_param_fence_fn: wait until param_ready[from] >= t
    uint64_t lora_seed;  // LoRA: the dropout masks' seed of this micro-batch (lora_dropout_seed)
    Piece piece;    // --mmap-base: a staging fill (transfer.c: piece.src -> piece.dst, `from`
                    // elements or bytes on)
} MbJob;

typedef struct JobBlock {
    struct JobBlock* next;
    int used;
    MbJob jobs[256];
} JobBlock;

// Trace labels of one iteration (freed with its closures).
typedef struct LabelBlock {
    struct LabelBlock* next;
    int used;
    char names[256][40];
} LabelBlock;

struct Engine {
    // ---- the run's shape and plan (plan.c)
    const Model* m;
    Store* s;
    DeviceSet* devs;
    const DeviceImpl* impl;
    EngineOptions opt;
    int NL, N, M, M_R, R, Bm, T, C;
    int slot_sets;          // parameter/gradient slots per device: 2, or 1 (see plan_device_bytes)
    int K, Bc;              // row chunks per micro-batch, and the rows of the largest chunk
                            // (the workspace and its activation sets are sized for Bc rows)
    size_t ab;              // compute-dtype bytes
    PartitionPlan plan;
    int S;
    Stage* stages;          // (S) in slot order
    int delay;              // 1 async, 0 sync
    // ---- dispatch (dispatch.c)
    int64_t cursor;         // global slot counter, never reset
    int64_t iter;           // iterations enqueued
    int64_t collected;      // iterations whose results engine_collect returned (<= iter, >= iter-2)
    // ---- host buffers (allocated in engine.c; written by transfers and the optimizer)
    void** master[2];       // [buffer][layer] compute-dtype weights of the layer's trainable
                            // tail (elements [train_off[l], param_numel[l]) of its slab)
    int64_t* train_off;     // (NL) where the trainable tail of layer l's slab begins: 0 for full
                            // training; with LoRA the frozen base comes first, the adapters last
    void** base;            // (NL) the frozen head of layer l's slab (elements [0, train_off[l]))
                            // in the compute dtype, ONE copy for both iteration parities (it never
                            // changes): the Store's own fp32 slab on fp32 devices, a bf16 copy on
                            // bf16 devices; NULL where a layer has none
    int base_owned;         // base[l] are the engine's allocations (bf16), not the Store's slabs
    int quant;              // some frozen tensors are held in a block format (quant.h): base[l]
                            // then holds each head tensor as uploaded, its blocks or ab bytes
                            // per element, back to back (quant_layer_head_bytes)
    int* need_x;            // (NL+1) boundary b needs host x buffers
    int* need_dx;
    void*** hx[2];          // [iteration parity][boundary][micro-batch]
    void*** hdx[2];         // aliases of dx_ring: boundary b uses ring slot dx_slot[b]
    void** dx_ring[2][2];   // [iteration parity][ring slot][micro-batch]
    int* dx_slot;           // (NL+1) ring slot of each need_dx boundary, alternating downward
    int* dx_last;           // (NL+1) the lowest boundary sharing b's ring slot (its last reader
                            // ends the slot's use in an iteration)
    int32_t** hids[2];      // [iteration parity][micro-batch]
    int32_t** htgt[2];
    float** hloss[2];
    // the loss head's objective per iteration parity (engine_submit_loss): pol_on[ip] with its
    // scalars in pol_par[ip]; hpol[ip][i] micro-batch i's per-token inputs and the log-probs
    // downloaded (five pol_stride runs, as DevState.pol); act_rows[ip][i] the rows of
    // micro-batch i that are computed (mb_rows for the cross-entropy). Written by the controller
    // at submission (after the parity's previous iteration is done), read by the jobs.
    int pol_on[2];
    EngineLoss pol_par[2];
    float** hpol[2];
    int* act_rows[2];
    size_t pol_stride;      // tokens of the largest micro-batch
    float* logp_out;        // (B, T) the collected iteration's log-probs (EngineStepResult.logp)
    // MoE models (docs/ROUNDPIPE.md §4.5): per micro-batch, the same layout as DevState.moe: each
    // forward stage downloads its blocks' statistics rows, the fused stage uploads the rows before
    // its own, runs the aux loss (model_moe_aux) and downloads its rows and the counts, which each
    // backward stage uploads for its blocks' backward; engine_collect reads the aux back from it
    int moe_floats;         // n_moe * 2E + E (0 for dense models)
    float** hmoe[2];        // [iteration parity][micro-batch]
    double* moe_load;       // (E) the collected iteration's tokens per expert (EngineStepResult)
    DevEvent*** x_ev;       // [boundary][micro-batch]
    DevEvent*** dx_ev;
    int host_parities;      // 2, or 1 with opt.host_single (hx[1] / hdx[1] alias set 0)
    DevEvent*** x_free;     // [boundary][micro-batch] last consumer's upload done (single set)
    DevEvent*** dx_free;
    DevEvent** loss_ev[2];  // [iteration parity][micro-batch]
    // Host fp32 gradient accumulators: iteration t downloads into hgrad[t % n_hgrad]. With the
    // delayed optimizer two sets (the Store's and one more), so iteration t+1 never waits for the
    // step still reading iteration t's gradients (docs/ROUNDPIPE.md §6.2); one set in sync mode.
    float** hgrad[2];
    int n_hgrad;
    DevEvent** grad_ev[2];  // [gradient set][layer] the latest download of the layer into that set
    // split rounds (opt.split_rounds): rounds 1..R-1 download into sets of their own,
    // hsplit[round - 1][layer], which the optimizer adds into hgrad[t % n_hgrad] in round order
    // as they arrive; one set per round whatever n_hgrad: iteration t+1 downloads a layer into it
    // only after the optimizer has added iteration t's (split_summed, fenced on the controller)
    int split;
    float*** hsplit;
    DevEvent*** split_ev;
    int64_t* split_summed;  // (NL) the last iteration whose split rounds of layer l were added
    JobBlock* arena[2];
    LabelBlock* labels[2];
    Trace* trace;           // NULL unless opt.trace_path is set
    // ---- profiling and re-planning (plan.c, docs/ROUNDPIPE.md §2.7): compute of slot job j,
    // micro-batch r of an iteration of parity ip is bracketed by prof_ev[ip][2*(j*M_R + r)] and
    // [... + 1]
    DevEvent** prof_ev[2];
    uint8_t* prof_ok[2];    // [ip][j*M_R + r]: that bracket times compute alone (not the first
                            // micro-batch of a gated stage, which also waits for its uploads)
    int64_t prof_iter[2];   // iteration that used parity ip and is not yet collected (-1: none)
    double* cost_fwd;       // (NL) the costs the current plan was made with
    double* cost_bwd;
    CostProfile profile;
    int replans;            // times the plan was rebuilt from profiled costs
    int64_t gated_stages;   // see engine_gated_stages
    int frozen;             // the plan no longer changes
    DevState* dev;
    // ---- protocol flags (protocol.c; under mu)
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t* param_ready;   // (NL) master for iterations <= this is ready
    int64_t* grad_consumed; // (NL) gradients of iterations <= this are consumed
    int64_t* grad_recorded; // (NL) final gradient download of iterations <= this is enqueued
    // ---- optimizer thread (protocol.c)
    pthread_t opt_thread;
    int64_t steps_queued, steps_done;
    int shutdown;
    double norm_hist[4], lr_hist[4];  // [step % 4]: the norm and lr of recent steps
    ThreadPool* pool;
    AdamWTensor* opt_tensors;
    int n_opt;
    int* layer_first_opt;   // (NL+1) AdamW tensors of layer l are [first[l], first[l+1])
    int64_t* opt_offset;    // (n_opt) element offset of each AdamW tensor in its layer's
                            // trainable tail (master[buf][l])
    int64_t* opt_goffset;   // (n_opt) and in its layer's gradient slab (LoRA: adapters only)
    int* opt_layer;         // (n_opt) its layer
    int64_t* norm_first;    // (NL+1) the norm's chunk sums of layer l are [first[l], first[l+1])
    double* norm_parts;     // the chunk sums (adamw_grad_norm_sq_parts), filled as layers arrive
    int* fold_owner;        // (NL) layer l receives a tied tensor's gradient before its norm
    int64_t device_folds;   // iterations whose tied gradient was folded on a device
    int64_t folded_iter[4]; // per host gradient set: the last iteration whose tied gradient was
                            // folded on the device (the optimizer then skips its own fold)
    double t_last_step;
    // ---- data parallel (shard.c; NULL for one process)
    struct EngineShard* dp;
    uint32_t dp_crc;        // the trainable fp32 weights' CRC-32C, taken by shard_release_early
    int dp_crc_set;         // before their pages outside the shard went (shard_init compares it)
};

// Sequences in micro-batch i: the batch is split as evenly as possible (the first B % M
// micro-batches get one more), like the reference implementation.
static inline int mb_rows(const Engine* e, int i) {
    return e->opt.B / e->M + (i < e->opt.B % e->M ? 1 : 0);
}

// First sequence of micro-batch i within the batch.
static inline int mb_first_row(const Engine* e, int i) {
    return i * (e->opt.B / e->M) + imin(i, e->opt.B % e->M);
}

// MoE models: micro-batch i's share of the iteration's objective, as the plain trainer sums it
// (its CE sum, then plus the weighted aux loss times its tokens), its CE sum, its aux times its
// tokens and its tokens per expert (counts, E), once its device work is collected (loss_ev). The
// aux comes from the statistics the fused stage downloaded through the same moe_aux_loss that
// stage ran: the same bits. (engine_collect, and shard.c's global sums on the optimizer thread:
// both only read.)
static inline double mb_moe_objective(const Engine* e, int ip, int i, double* ce_sum,
                                      double* aux_tokens, float* counts) {
    const Model* m = e->m;
    const int rows = mb_rows(e, i), N = rows * e->T;
    double ce = 0.0;
    for (int k = 0; k < N; k++) ce += e->hloss[ip][i][k];
    double load_max, load_mean;
    const double aux =
        moe_aux_loss(&m->cfg, e->hmoe[ip][i], m->n_moe, N, counts, &load_max, &load_mean);
    *ce_sum = ce;
    *aux_tokens = aux * (double)rows * e->T;
    return ce + model_aux_weight(m) * aux * (double)N;
}

// MoE models: the first aux-statistics row of layer entry l (the MoE blocks before it: a stage
// [b, e) owns rows [engine_moe_row(b), engine_moe_row(e)), contiguous because rows follow the
// block order).
static inline int engine_moe_row(const Engine* e, int l) {
    int row = 0;
    for (int block = 0; block < l - 1 && block < e->m->cfg.L; block++)
        row += e->m->moe_slot[block] >= 0;
    return row;
}

// ----------------------------------------------------------------------------
// plan.c: the memory model, plan choice and re-planning

// The shape of a run and its size-based plan (partition and row chunks): everything engine_create
// and the plan-only functions share. Allocates only the cost tables. -1 with err on a bad shape.
int plan_init(Engine* e, const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
              char* err);
// Bytes of one residual-stream buffer of the largest micro-batch (B_m x T x C, compute dtype).
size_t plan_x_buffer_bytes(const Engine* e);
// Bytes of the largest stage's quantised blocks (the staging slots, quant.h; 0 without).
size_t plan_stage_block_bytes(const Engine* e, const PartitionPlan* plan);
// What each device allocates for a plan, and the sizes engine.c allocates with (any out pointer
// may be NULL): the largest stage's parameter and gradient elements, the activation sets, the
// longest stage.
EngineDeviceBytes plan_device_bytes(const Engine* e, const PartitionPlan* plan, int64_t* max_p_out,
                                    int64_t* max_g_out, int* acts_out, int* max_len_out);
// Which layer boundaries a plan passes through host memory (need_x, need_dx: NL + 1 each, zeroed).
void plan_boundaries(const Engine* e, const PartitionPlan* plan, int* need_x, int* need_dx);
// Host activation checkpoint sets (2: one per iteration parity; 1 with opt->host_single).
int plan_host_act_sets(const EngineOptions* opt);
// Host fp32 gradient sets, the Store's included (2 with the delayed update, 1 in sync mode).
int plan_host_grad_sets(const EngineOptions* opt);
// Fold the measured stage times of the iteration that used parity ip into the cost profile
// (no-op when that parity has nothing uncollected). Its device work must be done.
void plan_profile_collect(Engine* e, int ip);
// Once enough iterations are profiled: plan again with the measured costs and freeze the plan.
// 1 with the new plan in *plan when it differs from e->plan (the caller rebuilds the buffers).
int plan_replan(Engine* e, PartitionPlan* plan);

// ----------------------------------------------------------------------------
// shard.c: data parallel over opt.comm (docs/DISTRIBUTED.md §6). The optimizer thread calls the
// step's parts in this order on every rank, so the collectives form one sequence.

// The layout and buffers (after protocol_init's optimizer tables) and the check that every rank
// starts from the same weights (collective). 0, or -1 with err.
// Data parallel, right after the masters are made (before the gradient sets are allocated): the
// fp32 weights' checksum, then the pages of the fp32 weights (with opt.shard_weights) and of m
// and v outside this rank's shard back to the system, so the start-up peak holds them once.
void shard_release_early(Engine* e);
int shard_init(Engine* e, char* err);
void shard_free(Engine* e);
// Step k: layer l's gradient in set g reduce-scattered over the ranks (this rank's shard of the
// layer's optimizer range replaced by the sum), and its shard's chunk sums of squares.
void shard_reduce_layer(Engine* e, float** g, int l);
// Step k, every layer reduced: the global squared norm (the ranks' chunk sums, layer by layer in
// rank order) and the global loss of iteration k-1 (kept for engine_collect).
double shard_norm_sq(Engine* e, int64_t k);
// Step k: AdamW on this rank's shard of layer l, the updated weights into master[buf] (and the
// Store) on every rank by an all-gather.
void shard_apply_layer(Engine* e, const AdamWUpdate* u, int buf, int l);
// Iteration t's global loss sum (after step t+1) and the first failure's message (NULL: none);
// under mu.
double shard_loss(Engine* e, int64_t t);
// MoE models: iteration t's global CE sum, aux x tokens and tokens per expert (every rank's, added
// in rank order) into res (res->load: engine memory, until the next engine_collect).
void shard_moe_stats(Engine* e, int64_t t, EngineStepResult* res);
const char* shard_error(Engine* e);
// engine_gather_state's collectives, once the engine is idle (engine.c synchronises first).
int shard_gather_state(Engine* e, int root, int with_state, char* err);

// ----------------------------------------------------------------------------
// jobs.c: closures and trace labels (under every other engine file)

// A closure that lives until iteration parity ip's work is done (jobs_free).
MbJob* jobs_new(Engine* e, int ip);
// Release iteration parity ip's closures and trace labels (its device work must be done).
void jobs_free(Engine* e, int ip);
// Name the next work item queued on stream s of a device (only when tracing).
__attribute__((format(printf, 5, 6))) void jobs_label(Engine* e, int ip, DevState* ds,
                                                      StreamKind s, const char* fmt, ...);

// Where round `round` of iteration t downloads layer l's gradient (the Store's set, its
// delayed-update twin, or a split round's own set), and the event of that download: written by
// transfer.c, read by protocol.c's optimizer thread.
static inline float* engine_grad_host(const Engine* e, int64_t t, int round, int l) {
    return e->split && round > 0 ? e->hsplit[round - 1][l] : e->hgrad[t % e->n_hgrad][l];
}
static inline DevEvent* engine_grad_event(const Engine* e, int64_t t, int round, int l) {
    return e->split && round > 0 ? e->split_ev[round - 1][l] : e->grad_ev[t % e->n_hgrad][l];
}

// ----------------------------------------------------------------------------
// dispatch.c: stages, rounds, the cursor, micro-batch jobs

// e->stages from e->plan, in slot order; dispatch_stages_free releases them.
void dispatch_stages_build(Engine* e);
void dispatch_stages_free(Engine* e);
// Enqueue every round of iteration t on the devices the cursor names.
void dispatch_iteration(Engine* e, int64_t t);

// ----------------------------------------------------------------------------
// transfer.c: parameter uploads, activation hand-offs, gradient downloads

// A stage's parameters into parameter slot k for iteration t: LPT bins behind the running stage's
// activation-upload marks, or (gated) layer by layer behind the optimizer's per-layer fences.
void transfer_params_up(Engine* e, DevState* ds, const Stage* st, int k, int64_t t);
void transfer_params_up_gated(Engine* e, DevState* ds, const Stage* st, int k, int64_t t);
// The stage's quantised tensors from staging slot k into parameter slot k, on the compute stream
// behind their upload (gated: each layer behind its own). No-op without --base-dtype.
void transfer_params_dequant(Engine* e, DevState* ds, const Stage* st, int k, int64_t t, int gated);
// --mmap-base: the pinned staging buffers' size (each of the two per device).
#define STAGE_BYTES ((size_t)32 << 20)
// Gradient slot k of a backward stage: zeroed, or the host's partial sum of earlier rounds.
void transfer_grads_prepare(Engine* e, DevState* ds, const Stage* st, int k, int round, int64_t t);
// Micro-batch i (the r-th of its round) of stage st: activations up before its compute, down after.
void transfer_acts_up(Engine* e, DevState* ds, const Stage* st, int i, int r, int64_t t);
void transfer_acts_down(Engine* e, DevState* ds, const Stage* st, int i, int r, int64_t t);
// A backward stage's gradients from slot gk: deferred into the next stage's activation windows
// (transfer_grads_defer, then transfer_grads_issue per window, all of them at the latest by
// transfer_grads_flush_all at the round's end), or layer by layer (transfer_grads_layer_down,
// then transfer_grads_done).
void transfer_grads_defer(Engine* e, DevState* ds, const Stage* st, int gk, int64_t t, int round);
void transfer_grads_issue(Engine* e, DevState* ds, int all);
void transfer_grads_flush_all(Engine* e);
void transfer_grads_layer_down(Engine* e, DevState* ds, const Stage* st, int gk, int l, int64_t t,
                               int round, int folded);
void transfer_grads_done(Engine* e, DevState* ds, const Stage* st, int gk, int64_t t,
                         int final_round);

// ----------------------------------------------------------------------------
// protocol.c: per-layer fences and the optimizer thread

// Bytes of layer l's frozen head in the engine's base copy (the mapped tensors of --mmap-base
// are not in it).
size_t protocol_head_held_bytes(const Engine* e, int l);

// Rule 2: whether a stage's layers (and a tied head's source) hold iteration t's weights now;
// whether one layer does; wait for a whole stage on the controller (sync mode); wait for layer
// j->from on a parameter stream (host function of a gated upload; arg: MbJob).
int protocol_params_ready(Engine* e, const Stage* st, int64_t t);
int protocol_layer_ready(Engine* e, int l, int64_t t);
void protocol_fence_params(Engine* e, const Stage* st, int64_t t);
void protocol_param_fence_fn(void* arg);
// Rule 4: wait until iteration t may download a stage's gradients into its host set; for split
// rounds, layer l into its round's own set.
void protocol_fence_grads(Engine* e, const Stage* st, int64_t t);
void protocol_fence_split(Engine* e, int l, int64_t t);
// Tell the optimizer: a stage's final gradient downloads of iteration t are enqueued; iteration t
// folds its tied gradient on a device.
void protocol_grads_recorded(Engine* e, const Stage* st, int64_t t);
void protocol_mark_device_fold(Engine* e, int64_t t);
// Both master buffers from the Store's fp32 weights (θ_0), in parallel on e->pool.
void protocol_masters_init(Engine* e);
// The flags, the optimizer's tables, and the optimizer thread (started last).
void protocol_init(Engine* e);
// Queue the step for iteration t's gradient; wait for step k and read its norm and lr (k >= 1;
// for k = 0 the values mean nothing); wait for every queued step.
void protocol_queue_step(Engine* e, int64_t t);
void protocol_wait_step(Engine* e, int64_t k, double* norm, double* lr);
void protocol_wait_steps(Engine* e);
// Stop the optimizer thread (every queued step done) and free what protocol_init made.
void protocol_free(Engine* e);

#endif  // LLMC_ENGINE_INTERNAL_H
