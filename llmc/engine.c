/*
 * engine.c — the RoundPipe engine: planning, slot-major dispatch, the transfer engine, the
 * per-layer consistency protocol and the optimizer thread. Read engine.h first.
 *
 * Buffers and the events guarding them
 *  - device parameter slots pslot[2] (stage s and stage s+N of a device alternate): an upload into
 *    slot k waits pslot_free[k], recorded after the last compute that read it.
 *  - device gradient slots gslot[2] (fp32): zeroed (or, in later rounds, loaded with the host's
 *    partial sum) before a backward stage, downloaded after its last micro-batch; reuse waits
 *    gslot_free[k], recorded after the download.
 *  - device activation buffers come in two parities (micro-batch i uses parity i % 2), so the
 *    upload of i+1 overlaps the compute of i and the download of i overlaps the compute of i+1
 *    ("upload one early, download one late", ROUNDPIPE.md §7.2): an upload into parity p waits
 *    comp_done[p] and down_done[p]; a compute into parity p waits down_done[p].
 *  - host activations: x at a layer boundary (forward outputs, checkpoints) and dx (gradients
 *    between backward stages) per micro-batch, in two iteration parities; x_ev / dx_ev mark a
 *    download done and gate the consumer's upload (cross-device waits). Before iteration t reuses
 *    parity t % 2 the controller waits for iteration t-2 to be entirely done. The dx buffers of a
 *    micro-batch form a ring of two: boundaries alternate going down, and the producer of a
 *    boundary's dx runs only after the consumer of the boundary above it (same slot, two
 *    boundaries up) has uploaded it, through the backward chain's own events.
 *
 * The consistency protocol (ROUNDPIPE.md §9), per layer l, with two compute-dtype master buffers:
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
 */
#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "trace.h"

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

// A backward stage's gradient download, deferred into the activation windows of the next stage
// on the same device (ROUNDPIPE.md §7.5): LPT bins of <= 256 MiB pieces, bin j enqueued once the
// next stage's micro-batch j has had its activations downloaded.
typedef struct PendingGrads {
    int active;
    const struct Stage* st;
    int gk;               // gradient slot being downloaded
    int64_t t;            // iteration
    int final_round;
    int n_pieces;
    struct Piece* pieces;
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
    double busy_last;       // compute busy seconds at the previous step (bubble accounting)
} DevState;

// Closure of one micro-batch of one stage, run on a compute stream. Lives in an arena until the
// iteration that created it is done.
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
    int phase;      // 0: the whole micro-batch; 1: forward of layers [from, to) only; 2: the
                    // rest after phase-1 jobs (fused: loss and backward; backward: backward);
                    // 3: the fused stage's loss (postfix forward + backward) only; 4: backward
                    // of layers [from, to) only; 5: fold the tied head's gradient into its owner's
                    // (stage holding both, after the last backward)
    int from, to;
    int64_t t;      // param_fence_fn: wait until param_ready[from] >= t
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
    int64_t cursor;         // global slot counter, never reset
    int64_t iter;           // iterations enqueued
    int64_t collected;      // iterations whose results engine_collect returned (<= iter, >= iter-2)
    // host buffers
    void** master[2];       // [buffer][layer] compute-dtype weights
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
    DevEvent*** x_ev;       // [boundary][micro-batch]
    DevEvent*** dx_ev;
    int host_parities;      // 2, or 1 with opt.host_single (hx[1] / hdx[1] alias set 0)
    DevEvent*** x_free;     // [boundary][micro-batch] last consumer's upload done (single set)
    DevEvent*** dx_free;
    DevEvent** loss_ev[2];  // [iteration parity][micro-batch]
    // Host fp32 gradient accumulators: iteration t downloads into hgrad[t % n_hgrad]. With the
    // delayed optimizer two sets (the Store's and one more), so iteration t+1 never waits for the
    // step still reading iteration t's gradients (ROUNDPIPE.md §9.5); one set in sync mode.
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
    // profiling and re-planning (ROUNDPIPE.md §8.2): compute of slot job j, micro-batch r of an
    // iteration of parity ip is bracketed by prof_ev[ip][2*(j*M_R + r)] and [... + 1]
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
    // protocol flags (under mu)
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t* param_ready;   // (NL) master for iterations <= this is ready
    int64_t* grad_consumed; // (NL) gradients of iterations <= this are consumed
    int64_t* grad_recorded; // (NL) final gradient download of iterations <= this is enqueued
    // optimizer thread
    pthread_t opt_thread;
    int64_t steps_queued, steps_done;
    int shutdown;
    double norm_hist[4], lr_hist[4];  // [step % 4]: the norm and lr of recent steps
    ThreadPool* pool;
    AdamWTensor* opt_tensors;
    int n_opt;
    int* layer_first_opt;   // (NL+1) AdamW tensors of layer l are [first[l], first[l+1])
    int64_t* opt_offset;    // (n_opt) element offset of each AdamW tensor in its layer's slab
    int* opt_layer;         // (n_opt) its layer
    int64_t* norm_first;    // (NL+1) the norm's chunk sums of layer l are [first[l], first[l+1])
    double* norm_parts;     // the chunk sums (adamw_grad_norm_sq_parts), filled as layers arrive
    int* fold_owner;        // (NL) layer l receives a tied tensor's gradient before its norm
    int64_t device_folds;   // iterations whose tied gradient was folded on a device
    int64_t folded_iter[4]; // per host gradient set: the last iteration whose tied gradient was
                            // folded on the device (the optimizer then skips its own fold)
    double t_last_step;
};

static void* dev_alloc(Engine* e, DevState* ds, size_t bytes) {
    (void)ds;
    return e->impl->alloc(ds->d, bytes ? bytes : 64);
}

// Sequences in micro-batch i: the batch is split as evenly as possible (the first B % M
// micro-batches get one more), like the reference implementation.
static int mb_rows(const Engine* e, int i) { return e->opt.B / e->M + (i < e->opt.B % e->M ? 1 : 0); }

// First sequence of micro-batch i within the batch.
static int mb_first_row(const Engine* e, int i) {
    return i * (e->opt.B / e->M) + imin(i, e->opt.B % e->M);
}

// ----------------------------------------------------------------------------
// stages

static void stage_build(Engine* e, Stage* st, SlotKind kind, StageRange r) {
    const TensorTable* tt = &e->m->tt;
    st->kind = kind;
    st->b = r.begin;
    st->e = r.end;
    int n = r.end - r.begin;
    st->p_off = calloc_check((size_t)n, sizeof(int64_t));
    st->g_off = calloc_check((size_t)n, sizeof(int64_t));
    int64_t p = 0, g = 0;
    for (int k = 0; k < n; k++) {
        st->p_off[k] = p;
        st->g_off[k] = g;
        p += tt->param_numel[r.begin + k];
        g += tt->grad_numel[r.begin + k];
    }
    st->head_off = -1;
    int head = tensor_table_index(tt, TK_LM_HEAD, -1);
    if (r.end == e->NL && tt->t[head].tied_to >= 0) {
        st->head_off = p;  // the fused stage carries a copy of the embedding as its head
        p += tt->t[head].numel;
    }
    st->param_numel = p;
    st->grad_numel = kind == SLOT_FWD ? 0 : g;
}

static void stage_name(Stage* st, SlotKind kind, int stage_index) {
    if (kind == SLOT_FWD) snprintf(st->name, sizeof st->name, "F%d", stage_index + 1);
    else if (kind == SLOT_FUSED) snprintf(st->name, sizeof st->name, "FB");
    else snprintf(st->name, sizeof st->name, "B%d", stage_index + 1);
}

// Pointer to the parameters of layer l inside a stage's slot.
static const void* slot_layer(const Engine* e, const Stage* st, const void* slot, int l) {
    return (const char*)slot + (size_t)st->p_off[l - st->b] * e->ab;
}

// ----------------------------------------------------------------------------
// micro-batch compute (runs on the device's compute stream)

static const void* postfix_head(const Engine* e, const MbJob* j) {
    const TensorTable* tt = &e->m->tt;
    int head = tensor_table_index(tt, TK_LM_HEAD, -1);
    if (j->st->head_off >= 0) return (const char*)j->pslot + (size_t)j->st->head_off * e->ab;
    return (const char*)slot_layer(e, j->st, j->pslot, e->NL - 1) +
           (size_t)tt->t[head].param_offset * e->ab;
}

// A job's rows of a micro-batch buffer: residual-stream-shaped (x) or per-token (ids, targets,
// losses).
static void* xrows(const Engine* e, const MbJob* j, void* p) {
    return (char*)p + (size_t)j->row0 * e->T * e->C * e->ab;
}
static void* trows(const Engine* e, const MbJob* j, void* p, size_t elem) {
    return (char*)p + (size_t)j->row0 * e->T * elem;
}

// The activation set of block entry l in its stage: the stage's blocks in order (the prefix and
// postfix have none).
static int block_set(const Stage* st, int l) { return l - imax(st->b, 1); }

// Forward of layers [from, to) of the job's stage, keeping each block's activations in its own
// set when keep != 0 (block_set), else in set 0.
static void forward_layers(Engine* e, MbJob* j, int from, int to, int keep) {
    const Model* m = e->m;
    DevState* ds = j->ds;
    const Stage* st = j->st;
    void** xs = ds->xs[j->p];
    for (int l = from; l < to; l++) {
        int k = l - st->b;
        if (l == 0) {
            model_prefix_forward(m, ds->ws, xrows(e, j, xs[k + 1]),
                                 trows(e, j, ds->ids[j->p], sizeof(int32_t)),
                                 slot_layer(e, st, j->pslot, 0), j->B, e->T);
        } else {
            BlockActs* a = &ds->ws->acts[keep ? block_set(st, l) : 0];
            model_block_forward(m, ds->ws, a, slot_layer(e, st, j->pslot, l), xrows(e, j, xs[k]),
                                xrows(e, j, xs[k + 1]), j->B, e->T);
        }
    }
}

// Backward of the blocks [from, to) deepest first (stage grain: activations in block_set), then the
// prefix when from == 0. dres holds the gradient of layer to's input on entry.
static void backward_layers(Engine* e, MbJob* j, int from, int to) {
    const Model* m = e->m;
    DevState* ds = j->ds;
    const Stage* st = j->st;
    void** xs = ds->xs[j->p];
    for (int l = to - 1; l >= from; l--) {
        int k = l - st->b;
        void* dres = xrows(e, j, ds->dres[j->p]);
        if (l == 0) {
            model_prefix_backward(m, ds->ws, j->gslot + st->g_off[k], dres,
                                  trows(e, j, ds->ids[j->p], sizeof(int32_t)), j->B, e->T);
            continue;
        }
        if (e->opt.grain == RECOMPUTE_LAYER && st->kind == SLOT_BWD) {
            // layer grain: recompute just this block from its uploaded checkpoint; its output is
            // written over the deeper boundary's buffer, which the deeper block no longer needs
            model_block_forward(m, ds->ws, &ds->ws->acts[0], slot_layer(e, st, j->pslot, l),
                                xrows(e, j, xs[k]), xrows(e, j, xs[k + 1]), j->B, e->T);
            model_block_backward(m, ds->ws, &ds->ws->acts[0], slot_layer(e, st, j->pslot, l),
                                 j->gslot + st->g_off[k], xrows(e, j, xs[k]), dres, j->B, e->T);
        } else {
            model_block_backward(m, ds->ws, &ds->ws->acts[block_set(st, l)],
                                 slot_layer(e, st, j->pslot, l), j->gslot + st->g_off[k],
                                 xrows(e, j, xs[k]), dres, j->B, e->T);
        }
    }
}

// Whether a stage holds both a tied tensor's layer and its owner's, so its gradient can be folded
// on the device (the whole model in one stage).
static int stage_folds(const Engine* e, const Stage* st) {
    const TensorTable* tt = &e->m->tt;
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to < 0) continue;
        const int lo = tt->t[d->tied_to].layer;
        if (lo >= st->b && lo < st->e && d->layer >= st->b && d->layer < st->e) return 1;
    }
    return 0;
}

// The owner's gradient += the tied tensor's, the same single fp32 addition per element as the
// optimizer's fold on the host (fold_chunk), so the numbers do not change.
static void fold_on_device(Engine* e, const MbJob* j) {
    const TensorTable* tt = &e->m->tt;
    const Stage* st = j->st;
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to < 0) continue;
        const TensorDesc* o = &tt->t[d->tied_to];
        j->ds->ops->add_f32(j->ds->ctx, j->gslot + st->g_off[o->layer - st->b] + o->grad_offset,
                            j->gslot + st->g_off[d->layer - st->b] + d->grad_offset,
                            (size_t)d->numel);
    }
}

static void run_microbatch(void* arg) {
    MbJob* j = arg;
    Engine* e = j->e;
    const Stage* st = j->st;
    DevState* ds = j->ds;
    if (j->phase == 5) {
        if (e->opt.fake_compute_us == 0) fold_on_device(e, j);
        return;
    }
    if (e->opt.fake_compute_us > 0) {
        // split jobs: forward layers share the half of the time that is not the rest (all of it
        // in a forward stage)
        int64_t us = (int64_t)e->opt.fake_compute_us * j->B / mb_rows(e, j->i);  // this chunk's share
        const int n = st->e - st->b;
        if (j->phase == 1 || j->phase == 4)
            us = us * (j->to - j->from) / (st->kind == SLOT_FWD ? n : 2 * n);
        if (j->phase == 2) us /= 2;
        if (j->phase == 3) us = 0;
        struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        return;
    }
    if (j->phase == 1) {
        forward_layers(e, j, j->from, j->to, st->kind != SLOT_FWD);
        return;
    }
    if (j->phase == 4) {
        backward_layers(e, j, j->from, j->to);
        return;
    }
    if (st->kind == SLOT_FWD) {
        forward_layers(e, j, st->b, st->e, 0);
        return;
    }
    if (st->kind == SLOT_FUSED) {
        const int last = e->NL - 1;  // the postfix
        if (j->phase == 0) forward_layers(e, j, st->b, last, 1);
        const TensorTable* tt = &e->m->tt;
        int i_norm = tensor_table_index(tt, TK_FINAL_NORM, -1);
        int i_head = tensor_table_index(tt, TK_LM_HEAD, -1);
        float* g = j->gslot + st->g_off[last - st->b];
        const void* norm_w = (const char*)slot_layer(e, st, j->pslot, last) +
                             (size_t)tt->t[i_norm].param_offset * e->ab;
        const float grad_scale = 1.0f / ((float)e->opt.B * (float)e->T);
        model_postfix_forward_backward(e->m, ds->ws, norm_w, postfix_head(e, j),
                                       g + tt->t[i_norm].grad_offset, g + tt->t[i_head].grad_offset,
                                       xrows(e, j, ds->xs[j->p][last - st->b]),
                                       xrows(e, j, ds->dres[j->p]),
                                       trows(e, j, ds->targets[j->p], sizeof(int32_t)),
                                       trows(e, j, ds->losses[j->p], sizeof(float)), grad_scale,
                                       1, j->B, e->T);
        if (j->phase != 3) backward_layers(e, j, st->b, last);
        return;
    }
    // backward stage: recompute (stage grain) then backward
    if (e->opt.grain == RECOMPUTE_STAGE && j->phase == 0) forward_layers(e, j, st->b, st->e, 1);
    backward_layers(e, j, st->b, st->e);
}

// ----------------------------------------------------------------------------
// arena of closures

static MbJob* job_new(Engine* e, int ip) {
    JobBlock* blk = e->arena[ip];
    if (!blk || blk->used == (int)(sizeof blk->jobs / sizeof blk->jobs[0])) {
        JobBlock* nb = calloc_check(1, sizeof(JobBlock));
        nb->next = blk;
        e->arena[ip] = nb;
        blk = nb;
    }
    return &blk->jobs[blk->used++];
}

static void arena_free(JobBlock* b) {
    while (b) {
        JobBlock* n = b->next;
        free(b);
        b = n;
    }
}

static void labels_free(LabelBlock* b) {
    while (b) {
        LabelBlock* n = b->next;
        free(b);
        b = n;
    }
}

// Name the next work item queued on stream s of a device (only when tracing).
__attribute__((format(printf, 5, 6))) static void label(Engine* e, int ip, DevState* ds,
                                                        StreamKind s, const char* fmt, ...) {
    if (!e->trace) return;
    LabelBlock* blk = e->labels[ip];
    if (!blk || blk->used == (int)(sizeof blk->names / sizeof blk->names[0])) {
        LabelBlock* nb = calloc_check(1, sizeof(LabelBlock));
        nb->next = blk;
        e->labels[ip] = nb;
        blk = nb;
    }
    char* name = blk->names[blk->used++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof blk->names[0], fmt, ap);
    va_end(ap);
    e->impl->label(ds->d, s, name);
}

// ----------------------------------------------------------------------------
// fences (controller side of the consistency protocol)

// Where round `round` of iteration t downloads layer l's gradient, and the event of that download.
static float* grad_host(const Engine* e, int64_t t, int round, int l) {
    return e->split && round > 0 ? e->hsplit[round - 1][l] : e->hgrad[t % e->n_hgrad][l];
}
static DevEvent* grad_event(const Engine* e, int64_t t, int round, int l) {
    return e->split && round > 0 ? e->split_ev[round - 1][l] : e->grad_ev[t % e->n_hgrad][l];
}

// Split rounds: round r >= 1 of iteration t downloads layer l into the one set of its round,
// which must hold no gradient of iteration t-1 that the optimizer has yet to add (controller side;
// it waits only for the optimizer's progress on iterations already enqueued).
static void fence_split(Engine* e, int l, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->split_summed[l] < t - 1) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Whether every layer of a stage (and the tied head's source) holds iteration t's weights now.
static int params_ready(Engine* e, const Stage* st, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    int ready = st->head_off < 0 || e->param_ready[0] >= t;
    for (int l = st->b; l < st->e && ready; l++) ready = e->param_ready[l] >= t;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return ready;
}

// Rule 2 for a whole stage, on the controller thread (sync mode).
static void fence_params(Engine* e, const Stage* st, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    for (int l = st->b; l < st->e; l++)
        while (e->param_ready[l] < t) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    if (st->head_off >= 0)
        while (e->param_ready[0] < t) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Rule 2 for one layer, as a host function on a parameter stream (gated uploads, delayed update
// only): the stream waits until the optimizer has written layer j->from's weights for iteration
// j->t. That step applies iteration t-2's gradients, and iteration t-2 is complete before any of
// iteration t's work is enqueued (engine_submit), so the wait depends on no device work at all:
// it cannot deadlock even where host functions share one thread (CUDA may serialise them). In
// sync mode iteration t would wait for iteration t-1's gradients, whose own stages might sit
// behind such a host function: sync mode fences whole stages on the controller instead.
static void param_fence_fn(void* arg) {
    const MbJob* j = arg;
    Engine* e = j->e;
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->param_ready[j->from] < j->t) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Rule 4: iteration t's gradients go into hgrad[t % n_hgrad], which the optimizer step of
// iteration t - n_hgrad's gradients may still be reading.
static void fence_grads(Engine* e, const Stage* st, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    for (int l = st->b; l < st->e; l++)
        while (e->grad_consumed[l] < t - e->n_hgrad) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// ----------------------------------------------------------------------------
// transfers

typedef struct Piece {
    void* dst;
    const void* src;
    size_t bytes;
} Piece;

static int piece_cmp_desc(const void* a, const void* b) {
    size_t x = ((const Piece*)a)->bytes, y = ((const Piece*)b)->bytes;
    return x < y ? 1 : (x > y ? -1 : 0);
}

#define PIECE_MAX_BYTES (256u << 20)

// Append a copy of `bytes` from src to dst as pieces of at most 256 MiB (big tensors such as the
// LM head are split so no single copy hogs a window).
static void pieces_add(Piece** pieces, int* n, int* cap, void* dst, const void* src, size_t bytes) {
    for (size_t off = 0; off < bytes; off += PIECE_MAX_BYTES) {
        if (*n == *cap) *pieces = realloc_check(*pieces, (size_t)(*cap *= 2) * sizeof(Piece));
        size_t len = bytes - off < PIECE_MAX_BYTES ? bytes - off : PIECE_MAX_BYTES;
        (*pieces)[(*n)++] = (Piece){(char*)dst + off, (const char*)src + off, len};
    }
}

// Longest processing time first: pieces sorted by size, each to the least-loaded of n_bins bins.
static void lpt_assign(Piece* pieces, int n, int n_bins, int* bin_of) {
    qsort(pieces, (size_t)n, sizeof(Piece), piece_cmp_desc);
    size_t* load = calloc_check((size_t)n_bins, sizeof(size_t));
    for (int i = 0; i < n; i++) {
        int best = 0;
        for (int b = 1; b < n_bins; b++)
            if (load[b] < load[best]) best = b;
        bin_of[i] = best;
        load[best] += pieces[i].bytes;
    }
    free(load);
}


// Where layer l of a stage goes in parameter slot k, from iteration parity ip's master copy
// (l == st->e: the copy of the embedding that a stage carrying a tied head holds as its head).
// Returns the bytes, 0 when the stage carries no such head.
static size_t slot_layer_copy(const Engine* e, const DevState* ds, const Stage* st, int k, int ip,
                              int l, const void** src, char** dst) {
    const TensorTable* tt = &e->m->tt;
    if (l < st->e) {
        *src = e->master[ip][l];
        *dst = (char*)ds->pslot[k] + (size_t)st->p_off[l - st->b] * e->ab;
        return (size_t)tt->param_numel[l] * e->ab;
    }
    if (st->head_off < 0) return 0;
    *src = e->master[ip][0];
    *dst = (char*)ds->pslot[k] + (size_t)st->head_off * e->ab;
    return (size_t)tt->t[tensor_table_index(tt, TK_LM_HEAD, -1)].numel * e->ab;
}

// One copy on stream s in pieces of at most PIECE_MAX_BYTES, each labelled `name` in traces.
static void copy_pieces(Engine* e, int ip, DevState* ds, StreamKind s, void* dst, const void* src,
                        size_t bytes, int h2d, const char* name) {
    for (size_t off = 0; off < bytes; off += PIECE_MAX_BYTES) {
        const size_t len = bytes - off < PIECE_MAX_BYTES ? bytes - off : PIECE_MAX_BYTES;
        label(e, ip, ds, s, "%s", name);
        if (h2d) e->impl->copy_h2d(ds->d, s, (char*)dst + off, (const char*)src + off, len);
        else e->impl->copy_d2h(ds->d, s, (char*)dst + off, (const char*)src + off, len);
    }
}

// Upload a stage's parameters into slot `k` on the parameter stream, split into pieces of at most
// 256 MiB assigned longest-first to the bin with the least load (LPT, ROUNDPIPE.md §7.3); bin j
// waits the j-th activation-upload mark of the stage currently running on this device, so the
// parameter traffic fills the gaps between activation uploads instead of delaying them.
static void upload_params(Engine* e, DevState* ds, const Stage* st, int k, int64_t t) {
    const int ip = (int)(t % 2);
    int cap = 16, n = 0;
    Piece* pieces = malloc_check((size_t)cap * sizeof(Piece));
    for (int l = st->b; l <= st->e; l++) {
        const void* src;
        char* dst;
        const size_t bytes = slot_layer_copy(e, ds, st, k, ip, l, &src, &dst);
        if (bytes) pieces_add(&pieces, &n, &cap, dst, src, bytes);
    }
    int n_bins = ds->n_marks > 0 ? ds->n_marks : 1;
    int* bin_of = malloc_check((size_t)(n ? n : 1) * sizeof(int));
    lpt_assign(pieces, n, n_bins, bin_of);
    const DeviceImpl* im = e->impl;
    im->stream_wait(ds->d, STREAM_PARAM_UP, ds->pslot_free[k]);
    for (int b = 0; b < n_bins; b++) {
        if (ds->n_marks > 0) im->stream_wait(ds->d, STREAM_PARAM_UP, ds->marks[b]);
        for (int i = 0; i < n; i++)
            if (bin_of[i] == b) {
                label(e, ip, ds, STREAM_PARAM_UP, "params %s [%d]", st->name, b);
                im->copy_h2d(ds->d, STREAM_PARAM_UP, pieces[i].dst, pieces[i].src, pieces[i].bytes);
            }
    }
    free(bin_of);
    free(pieces);
}

// Gated upload (the optimizer has not finished iteration t's weights of this stage yet): layer by
// layer, shallowest first as the optimizer writes them, each behind a host fence on the parameter
// stream (param_fence_fn) and followed by its event lev[k][layer], so the first micro-batch's
// forward of layer l waits for layer l alone and the device starts while the CPU step still
// updates deeper layers. All of it after the running stage's last activation upload (no LPT
// bins: the parameter traffic is behind the optimizer anyway).
static void upload_params_gated(Engine* e, DevState* ds, const Stage* st, int k, int64_t t) {
    const int ip = (int)(t % 2);
    const DeviceImpl* im = e->impl;
    im->stream_wait(ds->d, STREAM_PARAM_UP, ds->pslot_free[k]);
    if (ds->n_marks > 0) im->stream_wait(ds->d, STREAM_PARAM_UP, ds->marks[ds->n_marks - 1]);
    for (int l = st->b; l <= st->e; l++) {
        const int owner = l < st->e ? l : 0;  // the tied head is a copy of layer 0's embedding
        const void* src;
        char* dst;
        const size_t bytes = slot_layer_copy(e, ds, st, k, ip, l, &src, &dst);
        if (!bytes) break;
        pthread_check(pthread_mutex_lock(&e->mu));
        const int ready = e->param_ready[owner] >= t;
        pthread_check(pthread_mutex_unlock(&e->mu));
        if (!ready) {
            MbJob* j = job_new(e, ip);
            *j = (MbJob){.e = e, .ds = ds, .st = st, .from = owner, .t = t};
            im->host_fn(ds->d, STREAM_PARAM_UP, param_fence_fn, j);
        }
        char name[40];
        snprintf(name, sizeof name, "params %s layer %d", st->name, l);
        copy_pieces(e, ip, ds, STREAM_PARAM_UP, dst, src, bytes, 1, name);
        im->event_record(ds->lev[k][l - st->b], ds->d, STREAM_PARAM_UP);
    }
}

// Prepare the gradient slot of a backward stage on the parameter stream: zero in the first round,
// the host's partial fp32 sum in later rounds (waiting for the previous round's download).
static void prepare_grads(Engine* e, DevState* ds, const Stage* st, int k, int round, int64_t t) {
    const int ip = (int)(t % 2);
    const DeviceImpl* im = e->impl;
    const TensorTable* tt = &e->m->tt;
    im->stream_wait(ds->d, STREAM_PARAM_UP, ds->gslot_free[k]);
    if (round == 0 || e->split) {  // (split rounds each start from zero)
        label(e, ip, ds, STREAM_PARAM_UP, "zero grads %s", st->name);
        im->memset_zero(ds->d, STREAM_PARAM_UP, ds->gslot[k], (size_t)st->grad_numel * sizeof(float));
        return;
    }
    for (int l = st->b; l < st->e; l++) {
        im->stream_wait(ds->d, STREAM_PARAM_UP, e->grad_ev[t % e->n_hgrad][l]);
        label(e, ip, ds, STREAM_PARAM_UP, "partial grads %s", st->name);
        im->copy_h2d(ds->d, STREAM_PARAM_UP, ds->gslot[k] + st->g_off[l - st->b],
                     e->hgrad[t % e->n_hgrad][l],
                     (size_t)tt->grad_numel[l] * sizeof(float));
    }
}

// ----------------------------------------------------------------------------
// gradient downloads (ROUNDPIPE.md §7.5): a backward stage's gradients are complete after its
// last micro-batch; they are downloaded in LPT chunks during the activation windows of the next
// stage on the same device (bin j after that stage's micro-batch j has been downloaded), on the
// gradient stream, so bulk gradient traffic never sits in front of an activation transfer.

static void grads_defer(Engine* e, DevState* ds, const Stage* st, int gk, int64_t t, int round) {
    const TensorTable* tt = &e->m->tt;
    PendingGrads* pg = &ds->pend;
    int cap = 16, n = 0;
    Piece* pieces = malloc_check((size_t)cap * sizeof(Piece));
    for (int l = st->b; l < st->e; l++)
        pieces_add(&pieces, &n, &cap, e->hgrad[t % e->n_hgrad][l],
                   ds->gslot[gk] + st->g_off[l - st->b],
                   (size_t)tt->grad_numel[l] * sizeof(float));
    pg->active = 1;
    pg->st = st;
    pg->gk = gk;
    pg->t = t;
    pg->final_round = round == e->R - 1;
    pg->pieces = pieces;
    pg->n_pieces = n;
    pg->n_bins = e->M_R;
    pg->bin_of = malloc_check((size_t)(n ? n : 1) * sizeof(int));
    lpt_assign(pieces, n, pg->n_bins, pg->bin_of);
    pg->next_bin = 0;
    pg->fenced = 0;
    e->impl->event_record(ds->grads_ready, ds->d, STREAM_COMPUTE);
}

// A stage's gradient download is enqueued: its slot is free once it is done, and after the final
// round the optimizer's step may wait for the layers' download events.
static void grads_done(Engine* e, DevState* ds, const Stage* st, int gk, int64_t t,
                       int final_round) {
    e->impl->event_record(ds->gslot_free[gk], ds->d, STREAM_GRAD_DOWN);
    if (!final_round) return;
    pthread_check(pthread_mutex_lock(&e->mu));
    for (int l = st->b; l < st->e; l++) e->grad_recorded[l] = t;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Enqueue the next bin of the pending download (the caller has made the gradient stream wait for
// the window it belongs to), or every remaining bin when all != 0; finish when the last is out.
static void grads_issue(Engine* e, DevState* ds, int all) {
    PendingGrads* pg = &ds->pend;
    if (!pg->active) return;
    const DeviceImpl* im = e->impl;
    const int ip = (int)(pg->t % 2);
    if (!pg->fenced) {
        // rule 4: the host buffers still hold the previous iteration's gradients until the
        // optimizer has consumed them
        fence_grads(e, pg->st, pg->t);
        im->stream_wait(ds->d, STREAM_GRAD_DOWN, ds->grads_ready);
        pg->fenced = 1;
    }
    do {
        int b = pg->next_bin++;
        for (int i = 0; i < pg->n_pieces; i++)
            if (pg->bin_of[i] == b) {
                label(e, ip, ds, STREAM_GRAD_DOWN, "grads %s [%d]", pg->st->name, b);
                im->copy_d2h(ds->d, STREAM_GRAD_DOWN, pg->pieces[i].dst, pg->pieces[i].src,
                             pg->pieces[i].bytes);
            }
    } while (all && pg->next_bin < pg->n_bins);
    if (pg->next_bin < pg->n_bins) return;
    const Stage* st = pg->st;
    for (int l = st->b; l < st->e; l++)
        im->event_record(e->grad_ev[pg->t % e->n_hgrad][l], ds->d, STREAM_GRAD_DOWN);
    grads_done(e, ds, st, pg->gk, pg->t, pg->final_round);
    free(pg->pieces);
    free(pg->bin_of);
    memset(pg, 0, sizeof *pg);
}

// Per-layer downloads (a stage whose gradients would otherwise go down only at the round's end,
// after its last micro-batch): layer l's final gradients go down as soon as the last micro-batch's
// backward has passed it (gev[l - b], recorded by the caller on the compute stream), so the
// optimizer's wait for the last layer ends right after the backward.
// folded: the tied tensors' gradients were folded into their owners' on the device, so the host
// needs none of them (a tied head is the largest tensor: 1.2 GB for Qwen3-1.7B) and they stay.
static void grads_layer_down(Engine* e, DevState* ds, const Stage* st, int gk, int l, int64_t t,
                             int round, int folded) {
    const TensorTable* tt = &e->m->tt;
    const DeviceImpl* im = e->impl;
    const int ip = (int)(t % 2);
    char name[40];
    snprintf(name, sizeof name, "grads %s layer %d", st->name, l);
    im->stream_wait(ds->d, STREAM_GRAD_DOWN, ds->gev[l - st->b]);
    float* dst = grad_host(e, t, round, l);
    const float* src = ds->gslot[gk] + st->g_off[l - st->b];
    // the layer's gradient in runs between its tied tensors (all of it when nothing is skipped)
    int64_t from = 0;
    for (;;) {
        int64_t to = tt->grad_numel[l], next = to;
        for (int i = 0; folded && i < tt->n; i++) {
            const TensorDesc* d = &tt->t[i];
            if (d->layer == l && d->tied_to >= 0 && d->numel > 0 && d->grad_offset >= from &&
                d->grad_offset < to) {
                to = d->grad_offset;
                next = d->grad_offset + d->numel;
            }
        }
        if (to > from)
            copy_pieces(e, ip, ds, STREAM_GRAD_DOWN, dst + from, src + from,
                        (size_t)(to - from) * sizeof(float), 0, name);
        if (next >= tt->grad_numel[l]) break;
        from = next;
    }
    im->event_record(grad_event(e, t, round, l), ds->d, STREAM_GRAD_DOWN);
}

// Round boundaries: the next round's gradient preparation and the optimizer read these buffers,
// so nothing may stay deferred past a round.
static void grads_flush_all(Engine* e) {
    for (int g = 0; g < e->N; g++) grads_issue(e, &e->dev[g], 1);
}

// ----------------------------------------------------------------------------
// one stage on one device

// Submit one part of a micro-batch (MbJob.phase) on the compute stream, labelled for traces.
__attribute__((format(printf, 6, 7))) static void submit_part(Engine* e, const MbJob* base,
                                                              int phase, int from, int to,
                                                              const char* fmt, ...) {
    MbJob* j = job_new(e, base->ip);
    *j = *base;
    j->phase = phase;
    j->from = from;
    j->to = to;
    if (e->trace) {
        char name[40];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(name, sizeof name, fmt, ap);
        va_end(ap);
        label(e, base->ip, base->ds, STREAM_COMPUTE, "%s", name);
    }
    e->impl->submit(base->ds->d, STREAM_COMPUTE, run_microbatch, j);
}

// The compute of one row chunk of a micro-batch, as one job, or split into parts: the forward
// layer by layer behind each layer's upload (first: the first chunk of a gated stage's first
// micro-batch), the backward layer by layer with each layer's gradient download behind it (last:
// the last chunk of the last micro-batch of a per-layer-download stage).
static void enqueue_chunk(Engine* e, const MbJob* base, int pk, int gk, int first, int last) {
    DevState* ds = base->ds;
    const Stage* st = base->st;
    const DeviceImpl* im = e->impl;
    Device* d = ds->d;
    char who[64];  // trace name: stage, micro-batch and, with row chunks, the first row
    if (e->K > 1) snprintf(who, sizeof who, "%s mb%d.%d", st->name, base->i, base->row0);
    else snprintf(who, sizeof who, "%s mb%d", st->name, base->i);
    if (!first && !last) {
        if (base->i % e->M_R == 0) im->stream_wait(d, STREAM_COMPUTE, ds->param_done);
        submit_part(e, base, 0, 0, 0, "%s", who);
        return;
    }
    const int fwd_end = st->kind == SLOT_FUSED            ? e->NL - 1
                        : st->kind == SLOT_FWD            ? st->e
                        : e->opt.grain == RECOMPUTE_STAGE ? st->e
                                                          : st->b;  // layer grain: none
    for (int l = st->b; l < fwd_end;) {
        const int to = first ? l + 1 : fwd_end;
        im->stream_wait(d, STREAM_COMPUTE, first ? ds->lev[pk][l - st->b] : ds->param_done);
        submit_part(e, base, 1, l, to, "%s fwd %d-%d", who, l, to - 1);
        l = to;
    }
    if (st->kind == SLOT_FWD) return;
    im->stream_wait(d, STREAM_COMPUTE, ds->param_done);
    if (!last) {
        submit_part(e, base, 2, 0, 0, "%s rest", who);
        return;
    }
    // rule 4 (host buffers of iteration t - n_hgrad consumed), and the previous stage's deferred
    // download first on the gradient stream
    grads_issue(e, ds, 1);
    fence_grads(e, st, base->t);
    // a tied head's gradient is folded into its owner's here when both are in this stage: the
    // host's fold (after the last gradient, before the step) is then skipped
    const int fold = stage_folds(e, st);
    if (fold) {
        pthread_check(pthread_mutex_lock(&e->mu));
        e->folded_iter[base->t % e->n_hgrad] = base->t;
        pthread_check(pthread_mutex_unlock(&e->mu));
        e->device_folds++;
    }
    for (int l = st->e - 1; l >= st->b; l--) {
        if (st->kind == SLOT_FUSED && l == e->NL - 1)
            submit_part(e, base, 3, 0, 0, "%s loss", who);
        else
            submit_part(e, base, 4, l, l + 1, "%s bwd %d", who, l);
        if (fold && e->fold_owner[l]) submit_part(e, base, 5, 0, 0, "%s fold tied grads", who);
        im->event_record(ds->gev[l - st->b], d, STREAM_COMPUTE);
        if (e->split && base->i / e->M_R > 0) fence_split(e, l, base->t);
        grads_layer_down(e, ds, st, gk, l, base->t, base->i / e->M_R, fold);
    }
}

static void enqueue_stage(Engine* e, const Stage* st, int g, int64_t t, int round, int job_idx) {
    DevState* ds = &e->dev[g];
    const DeviceImpl* im = e->impl;
    Device* d = ds->d;
    const int ip = (int)(t % 2);
    const int n = st->e - st->b;

    // parameters (and gradient slot) for this stage: when the optimizer is still writing them,
    // layer by layer behind per-layer fences (rule 2) with the first micro-batch's forward gated
    // per layer too, where the stage's forward runs shallow to deep (not for layer-grain
    // backward stages, whose recompute runs deepest first)
    int pk = ds->pnext;
    ds->pnext = (ds->pnext + 1) % e->slot_sets;
    if (!e->delay) fence_params(e, st, t);
    // (one slot set: always layer by layer, so the upload into the slot the previous iteration
    // just freed runs only just ahead of the forward)
    const int late = e->delay && !params_ready(e, st, t);
    const int gated = late || (e->delay && e->slot_sets == 1);
    const int split = gated && (st->kind != SLOT_BWD || e->opt.grain == RECOMPUTE_STAGE);
    // The last stage of the final round on its device has no later stage on that device whose
    // activation windows could carry its gradient download: the download then goes layer by
    // layer during its last micro-batch's backward instead of after it.
    const int si = job_idx % e->S;
    // (split rounds: every round is its device's last stage of the iteration)
    const int layer_grads =
        st->kind != SLOT_FWD && (round == e->R - 1 || e->split) && si >= e->S - e->N;
    if (gated) {
        upload_params_gated(e, ds, st, pk, t);
        e->gated_stages += late;
    } else {
        upload_params(e, ds, st, pk, t);
    }
    int gk = -1;
    if (st->kind != SLOT_FWD) {
        gk = ds->gnext;
        ds->gnext = (ds->gnext + 1) % e->slot_sets;
        prepare_grads(e, ds, st, gk, round, t);
    }
    im->event_record(ds->param_done, d, STREAM_PARAM_UP);

    for (int r = 0; r < e->M_R; r++) {
        const int i = round * e->M_R + r;  // micro-batch index within the iteration
        const int p = r % 2;
        void** xs = ds->xs[p];
        const int Bi = mb_rows(e, i);
        const size_t x_bytes = (size_t)Bi * e->T * e->C * e->ab;
        const size_t tok_bytes = (size_t)Bi * e->T * sizeof(int32_t);

        // activation upload (high priority path)
        im->stream_wait(d, STREAM_ACT_UP, ds->comp_done[p]);
        im->stream_wait(d, STREAM_ACT_UP, ds->down_done[p]);
        label(e, ip, ds, STREAM_ACT_UP, "up %s mb%d", st->name, i);
        if (st->b == 0) {
            im->copy_h2d(d, STREAM_ACT_UP, ds->ids[p], e->hids[ip][i], tok_bytes);
        } else {
            im->stream_wait(d, STREAM_ACT_UP, e->x_ev[st->b][i]);
            im->copy_h2d(d, STREAM_ACT_UP, xs[0], e->hx[ip][st->b][i], x_bytes);
            if (e->x_free) im->event_record(e->x_free[st->b][i], d, STREAM_ACT_UP);
        }
        if (st->kind == SLOT_FUSED)
            im->copy_h2d(d, STREAM_ACT_UP, ds->targets[p], e->htgt[ip][i], tok_bytes);
        if (st->kind == SLOT_BWD) {
            if (e->opt.grain == RECOMPUTE_LAYER) {
                for (int l = imax(st->b, 1); l < st->e; l++) {
                    if (l == st->b) continue;  // already uploaded as the stage input
                    im->stream_wait(d, STREAM_ACT_UP, e->x_ev[l][i]);
                    im->copy_h2d(d, STREAM_ACT_UP, xs[l - st->b], e->hx[ip][l][i], x_bytes);
                    if (e->x_free) im->event_record(e->x_free[l][i], d, STREAM_ACT_UP);
                }
            }
            im->stream_wait(d, STREAM_ACT_UP, e->dx_ev[st->e][i]);
            im->copy_h2d(d, STREAM_ACT_UP, ds->dres[p], e->hdx[ip][st->e][i], x_bytes);
            if (e->dx_free) im->event_record(e->dx_free[st->e][i], d, STREAM_ACT_UP);
        }
        im->event_record(ds->up_done[p], d, STREAM_ACT_UP);
        im->event_record(ds->marks[r], d, STREAM_ACT_UP);

        // compute
        im->stream_wait(d, STREAM_COMPUTE, ds->up_done[p]);
        im->stream_wait(d, STREAM_COMPUTE, ds->down_done[p]);
        // the profile times compute alone: the first micro-batch waits for the stage's parameters
        // before its bracket opens, except a gated stage's (its forward follows the uploads layer
        // by layer), whose bracket is then left out of the profile
        if (r == 0 && !split) im->stream_wait(d, STREAM_COMPUTE, ds->param_done);
        DevEvent** prof = &e->prof_ev[ip][2 * (job_idx * e->M_R + r)];
        e->prof_ok[ip][job_idx * e->M_R + r] = !(r == 0 && split);
        im->event_record(prof[0], d, STREAM_COMPUTE);
        // the micro-batch in row chunks, one after the other (each at least one row: K is at
        // most the smallest micro-batch)
        for (int c = 0; c < e->K; c++) {
            const int r0 = c * Bi / e->K, r1 = (c + 1) * Bi / e->K;
            const MbJob base = {.e = e, .ds = ds, .st = st, .i = i, .p = p, .ip = ip,
                                .B = r1 - r0, .row0 = r0, .pslot = ds->pslot[pk],
                                .gslot = gk >= 0 ? ds->gslot[gk] : NULL, .t = t};
            enqueue_chunk(e, &base, pk, gk, r == 0 && c == 0 && split,
                          r == e->M_R - 1 && c == e->K - 1 && layer_grads);
        }
        im->event_record(prof[1], d, STREAM_COMPUTE);
        im->event_record(ds->comp_done[p], d, STREAM_COMPUTE);

        // activation download
        im->stream_wait(d, STREAM_ACT_DOWN, ds->comp_done[p]);
        if (st->kind == SLOT_FWD) {
            for (int k = 1; k <= n; k++) {
                int bnd = st->b + k;
                if (!e->need_x[bnd]) continue;
                label(e, ip, ds, STREAM_ACT_DOWN, "down %s mb%d x%d", st->name, i, bnd);
                // one host set: the previous iteration's last reader of this buffer (the latest
                // consumer enqueued, causally the last) must be done with it
                if (e->x_free) im->stream_wait(d, STREAM_ACT_DOWN, e->x_free[bnd][i]);
                im->copy_d2h(d, STREAM_ACT_DOWN, e->hx[ip][bnd][i], xs[k], x_bytes);
                im->event_record(e->x_ev[bnd][i], d, STREAM_ACT_DOWN);
            }
        } else {
            if (st->kind == SLOT_FUSED) {
                im->copy_d2h(d, STREAM_ACT_DOWN, e->hloss[ip][i], ds->losses[p],
                             (size_t)Bi * e->T * sizeof(float));
                im->event_record(e->loss_ev[ip][i], d, STREAM_ACT_DOWN);
            }
            if (st->b > 0) {
                label(e, ip, ds, STREAM_ACT_DOWN, "down %s mb%d dx%d", st->name, i, st->b);
                // one host set: the previous iteration's last reader of this ring slot
                if (e->dx_free) im->stream_wait(d, STREAM_ACT_DOWN, e->dx_free[e->dx_last[st->b]][i]);
                im->copy_d2h(d, STREAM_ACT_DOWN, e->hdx[ip][st->b][i], ds->dres[p], x_bytes);
                im->event_record(e->dx_ev[st->b][i], d, STREAM_ACT_DOWN);
            }
        }
        im->event_record(ds->down_done[p], d, STREAM_ACT_DOWN);
        // this window's share of the previous stage's gradient download
        if (ds->pend.active) {
            im->stream_wait(d, STREAM_GRAD_DOWN, ds->down_done[p]);
            grads_issue(e, ds, 0);
        }
    }
    grads_issue(e, ds, 1);  // a pending download with more bins than windows
    ds->n_marks = e->M_R;
    im->event_record(ds->pslot_free[pk], d, STREAM_COMPUTE);

    // the gradients go down during the next stage on this device (or at the round's end), or
    // went down layer by layer above
    if (layer_grads) {
        grads_done(e, ds, st, gk, t, round == e->R - 1);
    } else if (st->kind != SLOT_FWD) {
        grads_defer(e, ds, st, gk, t, round);
    }
}

// ----------------------------------------------------------------------------
// optimizer thread

// Initial master buffers: both hold θ_0, converted in parallel chunks (16 G conversions for an
// 8 B model would otherwise take a quarter of a minute at start-up).
#define MASTER_CHUNK (1 << 22)

typedef struct MasterInit {
    Engine* e;
    int64_t* first;  // (NL + 1) first chunk of each layer
} MasterInit;

static void master_init_chunk(void* arg, int64_t c) {
    const MasterInit* mi = arg;
    Engine* e = mi->e;
    int l = 0;
    while (mi->first[l + 1] <= c) l++;
    const int64_t b = (c - mi->first[l]) * MASTER_CHUNK;
    const int64_t n = imin64(e->m->tt.param_numel[l] - b, MASTER_CHUNK);
    const float* src = e->s->param[l] + b;
    for (int buf = 0; buf < 2; buf++) {
        if (e->ab == 4) {
            memcpy((float*)e->master[buf][l] + b, src, (size_t)n * sizeof(float));
        } else {
            uint16_t* dst = (uint16_t*)e->master[buf][l] + b;
            for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
        }
    }
}

static void masters_init(Engine* e) {
    const int NL = e->NL;
    MasterInit mi = {e, calloc_check((size_t)NL + 1, sizeof(int64_t))};
    for (int l = 0; l < NL; l++)
        mi.first[l + 1] = mi.first[l] + (e->m->tt.param_numel[l] + MASTER_CHUNK - 1) / MASTER_CHUNK;
    threadpool_run(e->pool, mi.first[NL], master_init_chunk, &mi);
    free(mi.first);
}

static void write_master(Engine* e, int buf, int l) {
    const int64_t n = e->m->tt.param_numel[l];
    const float* src = e->s->param[l];
    if (n == 0) return;
    if (e->ab == 4) {
        memcpy(e->master[buf][l], src, (size_t)n * sizeof(float));
    } else {
        uint16_t* dst = e->master[buf][l];
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

typedef struct FoldArgs {
    float* dst;
    const float* src;
    int64_t n;
} FoldArgs;

#define FOLD_CHUNK (1 << 20)

static void fold_chunk(void* arg, int64_t c) {
    const FoldArgs* fa = arg;
    const int64_t b = c * FOLD_CHUNK, n = imin64(fa->n - b, FOLD_CHUNK);
    for (int64_t j = 0; j < n; j++) fa->dst[b + j] += fa->src[b + j];
}

// Optimizer step k: the gradient of iteration k-1, learning rate lr(k), then the updated weights
// go to the master buffer of iteration k + delay.
static void layer_norm_parts(Engine* e, int l) {
    const int first = e->layer_first_opt[l];
    adamw_grad_norm_sq_parts(e->pool, e->opt_tensors + first, e->layer_first_opt[l + 1] - first,
                             e->norm_parts + e->norm_first[l]);
}

static void optimizer_step(Engine* e, int64_t k) {
    const int NL = e->NL;
    double t_wait = time_now_s();
    // the gradient set iteration k-1 downloaded into
    float** g = e->hgrad[(k - 1) % e->n_hgrad];
    for (int i = 0; i < e->n_opt; i++) e->opt_tensors[i].grad = g[e->opt_layer[i]] + e->opt_offset[i];
    // Deepest first, as backward produces them; each layer's part of the norm while the rest are
    // still on their way (a layer that receives a tied gradient waits for the fold below).
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->grad_recorded[NL - 1] < k - 1) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    // (set when the iteration's last stage was enqueued, before any of its gradients is recorded)
    const int dev_folded = e->folded_iter[(k - 1) % e->n_hgrad] == k - 1;
    pthread_check(pthread_mutex_unlock(&e->mu));
    for (int l = NL - 1; l >= 0; l--) {
        pthread_check(pthread_mutex_lock(&e->mu));
        while (e->grad_recorded[l] < k - 1) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
        pthread_check(pthread_mutex_unlock(&e->mu));
        // each gradient set has its own events: iteration k may already be re-recording the
        // other set's, and a wait captures the latest record
        e->impl->event_synchronize(e->grad_ev[(k - 1) % e->n_hgrad][l]);
        // split rounds: the other rounds' gradients of this layer, added in round order; then
        // their sets may take iteration k's
        for (int r = 1; e->split && r < e->R; r++) {
            e->impl->event_synchronize(grad_event(e, k - 1, r, l));
            FoldArgs fa = {g[l], grad_host(e, k - 1, r, l), e->m->tt.grad_numel[l]};
            threadpool_run(e->pool, (fa.n + FOLD_CHUNK - 1) / FOLD_CHUNK, fold_chunk, &fa);
        }
        if (e->split) {
            pthread_check(pthread_mutex_lock(&e->mu));
            e->split_summed[l] = k - 1;
            pthread_check(pthread_cond_broadcast(&e->cv));
            pthread_check(pthread_mutex_unlock(&e->mu));
        }
        if (!e->fold_owner[l] || dev_folded) layer_norm_parts(e, l);
    }
    double t_start = time_now_s();
    if (e->trace) {
        char name[48];
        snprintf(name, sizeof name, "wait grads of iteration %lld", (long long)(k - 1));
        trace_add(e->trace, name, e->N, STREAM_COUNT, t_wait, t_start);
    }
    // a tied head's gradient is folded into its owner's (the Store's own folding works on the
    // Store's set only), unless the device did it (the whole model in one stage)
    const TensorTable* tt = &e->m->tt;
    for (int i = 0; i < tt->n && !dev_folded; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to < 0) continue;
        const TensorDesc* o = &tt->t[d->tied_to];
        // in parallel: a tied head is the largest tensor (300 M elements for Qwen3-1.7B), and
        // with two GPUs the next iteration waits for this step
        FoldArgs fa = {g[o->layer] + o->grad_offset, g[d->layer] + d->grad_offset, d->numel};
        threadpool_run(e->pool, (d->numel + FOLD_CHUNK - 1) / FOLD_CHUNK, fold_chunk, &fa);
    }
    double norm_sq = 0.0;
    for (int l = 0; l < NL && !dev_folded; l++)
        if (e->fold_owner[l]) layer_norm_parts(e, l);
    for (int64_t c = 0; c < e->norm_first[NL]; c++) norm_sq += e->norm_parts[c];  // in order
    double norm = sqrt(norm_sq);
    float scale = adamw_clip_scale(norm, e->opt.grad_clip);
    AdamWHyper h = e->opt.hyper;
    const int64_t step = e->opt.start_step + k;  // the run's step number
    h.lr = lr_schedule_at(&e->opt.sched, step);
    const int buf = (int)((k + e->delay) % 2);
    // Shallow layers first: the next iteration's first forward stages need their weights first.
    // (Gradients never gate this order: with the delayed optimizer they are double-buffered, in
    // sync mode the next iteration starts after the step anyway.)
    for (int l = 0; l < NL; l++) {
        int first = e->layer_first_opt[l], count = e->layer_first_opt[l + 1] - first;
        if (e->ab == 2) {
            // bf16 devices: the step writes the bf16 master copy in the same pass
            for (int i = first; i < first + count; i++)
                e->opt_tensors[i].out_bf16 = (uint16_t*)e->master[buf][l] + e->opt_offset[i];
        }
        if (count > 0) adamw_step(e->pool, e->opt_tensors + first, count, &h, step, scale);
        if (e->opt.fake_optimizer_us > 0) {  // tests: a slow step, spread over the layers by size
            const int64_t us = e->opt.fake_optimizer_us * tt->param_numel[l] / e->m->tt.total_params;
            struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
            nanosleep(&ts, NULL);
        }
        if (e->ab != 2) write_master(e, buf, l);
        pthread_check(pthread_mutex_lock(&e->mu));
        e->param_ready[l] = k + e->delay;
        e->grad_consumed[l] = k - 1;
        pthread_check(pthread_cond_broadcast(&e->cv));
        pthread_check(pthread_mutex_unlock(&e->mu));
    }
    e->s->step = step;
    if (e->trace) {
        char name[48];
        snprintf(name, sizeof name, "AdamW step %lld", (long long)step);
        trace_add(e->trace, name, e->N, STREAM_COUNT, t_start, time_now_s());
    }
    pthread_check(pthread_mutex_lock(&e->mu));
    e->steps_done = k;
    e->norm_hist[k % 4] = norm;
    e->lr_hist[k % 4] = h.lr;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

static void* optimizer_main(void* arg) {
    Engine* e = arg;
    (void)threads_pin_self(e->opt.opt_cpus, e->opt.n_opt_cpus);  // refused: runs anywhere
    for (;;) {
        pthread_check(pthread_mutex_lock(&e->mu));
        while (!e->shutdown && e->steps_done == e->steps_queued)
            pthread_check(pthread_cond_wait(&e->cv, &e->mu));
        if (e->steps_done == e->steps_queued) {  // shutdown with nothing left
            pthread_check(pthread_mutex_unlock(&e->mu));
            return NULL;
        }
        int64_t k = e->steps_done + 1;
        pthread_check(pthread_mutex_unlock(&e->mu));
        optimizer_step(e, k);
    }
}

// ----------------------------------------------------------------------------
// creation

// Device bytes every plan needs whatever its stages: the workspace's scratch (without activation
// sets), the kernels' own temporaries (attention-backward row sums, embedding-backward sort
// buffers, reduction partials, the cuBLASLt workspace: about N (16 + 4H) bytes + 64 MiB on GPUs,
// whose compute dtype is bf16; the emulated devices' ops use host memory), and of
// the hand-off buffers those not proportional to a stage's length (the incoming gradient, one
// spare residual-stream buffer, tokens, targets and losses) in one or two micro-batch parities.
static size_t parity_count(const Engine* e) { return e->M_R == 1 ? 1 : 2; }

static size_t x_buffer_bytes(const Engine* e) { return (size_t)e->Bm * e->T * e->C * e->ab; }

static size_t scratch_bytes(const Engine* e) {
    const size_t tok = (size_t)e->Bc * e->T;  // the compute works on one row chunk at a time
    const size_t kernels = e->ab == 2 ? tok * (16 + 4 * (size_t)e->m->cfg.H) + ((size_t)64 << 20) : 0;
    return workspace_bytes(e->m, (int)e->ab, e->Bc, e->T, 0) + kernels;
}

static size_t fixed_device_bytes(const Engine* e) {
    const size_t tok = (size_t)e->Bm * e->T;
    return scratch_bytes(e) +
           parity_count(e) * (2 * x_buffer_bytes(e) + tok * (2 * sizeof(int32_t) + sizeof(float)));
}

// Bytes a forward / backward stage needs per layer on a device: parameters (the fused stage
// carries a copy of a tied embedding as its head), plus for backward stages the fp32 gradients
// and, with stage-grain recompute, the block's saved activations for one micro-batch (every block
// of a backward stage keeps them until its backward). The planner gives each stage half the
// device budget because a device holds two stages' parameter and gradient slots (the running one
// and the prefetched one); the activations are not double-buffered (one stage computes at a
// time), so they count half here: 2 x (params + grads) + activations <= budget. ub: the same in
// the fused stage, which keeps its blocks' activations with layer-grain recompute too. The
// hand-off buffers every stage needs regardless are outside the budget.
static void layer_bytes(const Engine* e, double* fb, double* bb, double* ub) {
    const TensorTable* tt = &e->m->tt;
    int head = tensor_table_index(tt, TK_LM_HEAD, -1);
    const double set = (double)workspace_act_set_bytes(e->m, (int)e->ab, e->Bc, e->T);
    const double acts = e->opt.grain == RECOMPUTE_STAGE ? set : 0.0;
    // every layer of the running stage also has a residual-stream buffer on the device (its
    // input / recomputed output / uploaded checkpoint), in one or two micro-batch parities; like
    // the activations they are not double-buffered per slot
    const double xbuf = (double)parity_count(e) * (double)x_buffer_bytes(e);
    for (int l = 0; l < e->NL; l++) {
        const int block = l >= 1 && l < e->NL - 1;
        fb[l] = (double)tt->param_numel[l] * (double)e->ab + xbuf / 2;
        if (l == e->NL - 1 && tt->t[head].tied_to >= 0) fb[l] += (double)tt->t[head].numel * e->ab;
        bb[l] = fb[l] + (double)tt->grad_numel[l] * sizeof(float);
        if (block) bb[l] += acts / 2;
        // the fused stage keeps every block's activations whatever the grain (its forward is
        // the recompute)
        ub[l] = bb[l] + (block && e->opt.grain == RECOMPUTE_LAYER ? set / 2 : 0.0);
    }
}

static EngineDeviceBytes plan_device_bytes(const Engine* e, const PartitionPlan* plan,
                                           int64_t* max_p_out, int64_t* max_g_out, int* acts_out,
                                           int* max_len_out);

// Plan with the costs in e->cost_fwd / cost_bwd.
static int plan_partition(Engine* e, PartitionPlan* plan, char* err) {
    const int NL = e->NL;
    double* fb = calloc_check((size_t)NL, sizeof(double));
    double* bb = calloc_check((size_t)NL, sizeof(double));
    double* ub = calloc_check((size_t)NL, sizeof(double));
    layer_bytes(e, fb, bb, ub);
    // --device-mem is everything the engine allocates on a device: what every plan needs comes
    // off the top, and each stage gets half the rest (it shares the device with the prefetched one)
    double budget = 1e300;
    if (e->opt.device_budget > 0) {
        const double fixed = (double)fixed_device_bytes(e);
        if (e->opt.device_budget <= fixed) {
            free(fb);
            free(bb);
            free(ub);
            char have[32], need[32];
            format_bytes(e->opt.device_budget, have, sizeof have);
            format_bytes(fixed, need, sizeof need);
            return errorf(err, "device memory budget: %s is not more than the %s of scratch and "
                          "hand-off buffers that micro-batches of %d x %d tokens need (raise "
                          "--device-mem or use more micro-batches)", have, need, e->Bm, e->T);
        }
        budget = (e->opt.device_budget - fixed) / 2;
    }
    // (split rounds: each device runs its own rounds of the whole model, as one device would)
    PartitionInput in = {NL, e->cost_fwd, e->cost_bwd, fb, bb, e->split ? 1 : e->N, e->M, budget,
                         !e->opt.sync, ub};
    int rc = partition_plan(&in, plan, err);
    // The search gives every stage half the budget (two slot sets). The whole model as one stage
    // with one slot set (plan_device_bytes) is the other candidate when the budget binds; it is
    // weighed against whatever the search ends with below.
    PartitionPlan one;
    memset(&one, 0, sizeof one);
    one.n_layers = NL;
    one.n_bwd = 1;
    one.bwd[0] = (StageRange){0, NL};
    partition_evaluate(&in, &one);
    const int one_fits = e->opt.device_budget > 0 &&
                         (double)plan_device_bytes(e, &one, NULL, NULL, NULL, NULL).total <=
                             e->opt.device_budget;
    // The per-stage check cannot see that a device's buffers are sized for the largest stage of
    // each kind (parameters of one, activations of another): lower the per-stage budget in 3%
    // steps until the whole fits (a smaller budget only ever makes layers fit less).
    if (rc == 0 && e->opt.device_budget > 0) {
        double total = (double)plan_device_bytes(e, plan, NULL, NULL, NULL, NULL).total;
        double smallest = total;
        const double b0 = in.budget;
        for (int k = 1; total > e->opt.device_budget; k++) {
            in.budget = b0 * pow(0.97, k);
            if (k > 150 || partition_plan(&in, plan, err) != 0) {
                char have[32], need[32];
                format_bytes(e->opt.device_budget, have, sizeof have);
                format_bytes(smallest, need, sizeof need);
                rc = errorf(err, "partition: no plan fits the device memory budget of %s (the "
                            "smallest plan found needs %s; raise --device-mem or use more "
                            "micro-batches)", have, need);
                break;
            }
            total = (double)plan_device_bytes(e, plan, NULL, NULL, NULL, NULL).total;
            smallest = fmin(smallest, total);
        }
    }
    if (one_fits && (rc != 0 || one.cost < plan->cost)) {
        *plan = one;
        rc = 0;
    }
    free(fb);
    free(bb);
    free(ub);
    return rc;
}

static DevEvent* ev_new(Engine* e) { return e->impl->event_create(e->devs->dev[0]); }

static int max_stage_len(const Engine* e) {
    int n = 1;
    for (int i = 0; i < e->S; i++) n = imax(n, e->stages[i].e - e->stages[i].b);
    return n;
}

// What each device allocates for the plan (the same numbers plan_resources_create allocates
// with): two parameter and two gradient slots of the largest stage, the workspace with its
// activation sets (the fused stage keeps all of its blocks'; stage-grain backward stages too;
// layer-grain ones one), and the hand-off buffers (one residual-stream buffer per layer boundary
// of the longest stage, the incoming gradient, tokens, targets and losses, in one or two
// micro-batch parities).
static EngineDeviceBytes plan_device_bytes(const Engine* e, const PartitionPlan* plan,
                                           int64_t* max_p_out, int64_t* max_g_out, int* acts_out,
                                           int* max_len_out) {
    const TensorTable* tt = &e->m->tt;
    const int head = tensor_table_index(tt, TK_LM_HEAD, -1);
    const int S = plan->n_fwd + plan->n_bwd;
    int64_t max_p = 0, max_g = 0;
    int max_len = 1, max_bwd = 1, fused_sets = 1;
    for (int i = 0; i < S; i++) {
        SlotInfo si;
        partition_slot(plan, i, &si);
        int64_t p = 0, g = 0;
        for (int l = si.range.begin; l < si.range.end; l++) {
            p += tt->param_numel[l];
            g += tt->grad_numel[l];
        }
        if (si.range.end == e->NL && tt->t[head].tied_to >= 0) p += tt->t[head].numel;
        const int blocks = imin(si.range.end, e->NL - 1) - imax(si.range.begin, 1);
        if (si.kind == SLOT_FWD) g = 0;
        else if (si.kind == SLOT_BWD) max_bwd = imax(max_bwd, blocks);
        else fused_sets = imax(1, blocks);
        if (p > max_p) max_p = p;
        if (g > max_g) max_g = g;
        max_len = imax(max_len, si.range.end - si.range.begin);
    }
    const int acts = e->opt.grain == RECOMPUTE_LAYER ? fused_sets : imax(fused_sets, max_bwd);
    const size_t tok = (size_t)e->Bm * e->T;
    EngineDeviceBytes b;
    const size_t slot = (size_t)max_p * e->ab + (size_t)max_g * sizeof(float);
    b.slot_sets = 2;
    b.slots = 2 * slot;
    b.acts = (size_t)acts * workspace_act_set_bytes(e->m, (int)e->ab, e->Bc, e->T);
    b.scratch = scratch_bytes(e);
    b.handoff = parity_count(e) * ((size_t)(max_len + 2) * x_buffer_bytes(e) +
                                   tok * (2 * sizeof(int32_t) + sizeof(float)));
    b.total = b.slots + b.acts + b.scratch + b.handoff;
    // The whole model in one stage: the second slot set only prefetches that same stage for a
    // later iteration (on several devices its weights wait for the optimizer anyway; on one the
    // layer-by-layer upload runs just ahead of the first forward). One set when two do not fit.
    if (S == 1 && e->opt.device_budget > 0 && (double)b.total > e->opt.device_budget) {
        b.slot_sets = 1;
        b.slots = slot;
        b.total -= slot;
    }
    if (max_p_out) *max_p_out = max_p;
    if (max_g_out) *max_g_out = max_g;
    if (acts_out) *acts_out = acts;
    if (max_len_out) *max_len_out = max_len;
    return b;
}

// Which layer boundaries a plan passes through host memory: need_x[b] (the residual stream
// entering entry b: a stage's input, and with layer-grain recompute every block input a backward
// stage recomputes from) and need_dx[b] (its gradient, the input of the next backward stage).
static void plan_boundaries(const Engine* e, const PartitionPlan* plan, int* need_x, int* need_dx) {
    const int efused = plan->bwd[0].begin;
    for (int i = 0; i < plan->n_fwd; i++)
        if (plan->fwd[i].begin > 0) need_x[plan->fwd[i].begin] = 1;
    if (efused > 0) need_x[efused] = 1;
    for (int i = 1; i < plan->n_bwd; i++) {
        if (plan->bwd[i].begin > 0) need_x[plan->bwd[i].begin] = 1;
        if (e->opt.grain == RECOMPUTE_LAYER)
            for (int l = imax(1, plan->bwd[i].begin); l < plan->bwd[i].end; l++) need_x[l] = 1;
    }
    for (int i = 0; i < plan->n_bwd; i++)
        if (plan->bwd[i].begin > 0) need_dx[plan->bwd[i].begin] = 1;
}

// Host bytes of the plan's activation checkpoints and boundary gradients: every x boundary in
// plan_boundaries and the two-slot dx ring, per micro-batch, in one or two iteration sets
// (--host-checkpoints).
static size_t plan_host_act_bytes(const Engine* e, const PartitionPlan* plan) {
    int* nx = calloc_check((size_t)e->NL + 1, sizeof(int));
    int* ndx = calloc_check((size_t)e->NL + 1, sizeof(int));
    plan_boundaries(e, plan, nx, ndx);
    size_t n = 0, n_dx = 0;
    for (int b = 0; b <= e->NL; b++) {
        n += (size_t)nx[b];
        n_dx += (size_t)ndx[b];
    }
    n += n_dx < 2 ? n_dx : 2;  // the dx ring
    free(nx);
    free(ndx);
    return n * (size_t)e->M * x_buffer_bytes(e) * (e->opt.host_single ? 1 : 2);
}

// Everything whose shape depends on the plan: stages, host activation buffers and their events,
// and the device state (parameter/gradient slots, activation buffers, workspace).
static void plan_resources_create(Engine* e) {
    const Model* m = e->m;
    const int NL = e->NL;

    // stages in slot order
    e->S = e->plan.n_fwd + e->plan.n_bwd;
    e->stages = calloc_check((size_t)e->S, sizeof(Stage));
    for (int i = 0; i < e->S; i++) {
        SlotInfo si;
        partition_slot(&e->plan, i, &si);
        stage_build(e, &e->stages[i], si.kind, si.range);
        stage_name(&e->stages[i], si.kind, si.stage);
    }
    int64_t max_p = 0, max_g = 0;
    int acts = 1, max_len = 1;
    e->slot_sets = plan_device_bytes(e, &e->plan, &max_p, &max_g, &acts, &max_len).slot_sets;

    // which layer boundaries need host copies
    e->need_x = calloc_check((size_t)NL + 1, sizeof(int));
    e->need_dx = calloc_check((size_t)NL + 1, sizeof(int));
    plan_boundaries(e, &e->plan, e->need_x, e->need_dx);

    // the dx ring: going down, boundaries alternate between two slots
    e->dx_slot = calloc_check((size_t)NL + 1, sizeof(int));
    e->dx_last = calloc_check((size_t)NL + 1, sizeof(int));
    int n_dx = 0, last[2] = {-1, -1};
    for (int bnd = NL; bnd >= 0; bnd--) {
        if (!e->need_dx[bnd]) continue;
        e->dx_slot[bnd] = n_dx % 2;
        last[n_dx % 2] = bnd;
        n_dx++;
    }
    for (int bnd = 0; bnd <= NL; bnd++)
        if (e->need_dx[bnd]) e->dx_last[bnd] = last[e->dx_slot[bnd]];

    // host activation buffers (two iteration parities) and their events
    const size_t x_bytes = (size_t)e->Bm * e->T * e->C * e->ab;
    const size_t tok = (size_t)e->Bm * e->T;
    e->host_parities = e->opt.host_single ? 1 : 2;
    for (int b = 0; b < 2; b++) {
        if (b >= e->host_parities) {  // one set: parity 1 is parity 0
            e->hx[b] = e->hx[0];
            e->hdx[b] = e->hdx[0];
        }
        const int n_prof = 2 * e->R * e->S * e->M_R;
        e->prof_ev[b] = calloc_check((size_t)n_prof, sizeof(DevEvent*));
        e->prof_ok[b] = calloc_check((size_t)n_prof / 2, sizeof(uint8_t));
        for (int i = 0; i < n_prof; i++) e->prof_ev[b][i] = ev_new(e);
        e->prof_iter[b] = -1;
        if (b >= e->host_parities) continue;
        e->hx[b] = calloc_check((size_t)NL + 1, sizeof(void**));
        e->hdx[b] = calloc_check((size_t)NL + 1, sizeof(void**));
        for (int r = 0; r < 2; r++) {
            e->dx_ring[b][r] = NULL;
            if (n_dx <= r) continue;
            e->dx_ring[b][r] = calloc_check((size_t)e->M, sizeof(void*));
            for (int i = 0; i < e->M; i++) e->dx_ring[b][r][i] = e->impl->host_alloc(x_bytes);
        }
        for (int bnd = 0; bnd <= NL; bnd++) {
            if (e->need_x[bnd]) {
                e->hx[b][bnd] = calloc_check((size_t)e->M, sizeof(void*));
                for (int i = 0; i < e->M; i++) e->hx[b][bnd][i] = e->impl->host_alloc(x_bytes);
            }
            if (e->need_dx[bnd]) e->hdx[b][bnd] = e->dx_ring[b][e->dx_slot[bnd]];
        }
    }
    e->x_ev = calloc_check((size_t)NL + 1, sizeof(DevEvent**));
    e->dx_ev = calloc_check((size_t)NL + 1, sizeof(DevEvent**));
    if (e->host_parities == 1) {
        e->x_free = calloc_check((size_t)NL + 1, sizeof(DevEvent**));
        e->dx_free = calloc_check((size_t)NL + 1, sizeof(DevEvent**));
    }
    for (int bnd = 0; bnd <= NL; bnd++) {
        if (e->need_x[bnd]) {
            e->x_ev[bnd] = calloc_check((size_t)e->M, sizeof(DevEvent*));
            for (int i = 0; i < e->M; i++) e->x_ev[bnd][i] = ev_new(e);
            if (e->x_free) {
                e->x_free[bnd] = calloc_check((size_t)e->M, sizeof(DevEvent*));
                for (int i = 0; i < e->M; i++) e->x_free[bnd][i] = ev_new(e);
            }
        }
        if (e->need_dx[bnd]) {
            e->dx_ev[bnd] = calloc_check((size_t)e->M, sizeof(DevEvent*));
            for (int i = 0; i < e->M; i++) e->dx_ev[bnd][i] = ev_new(e);
            if (e->dx_free) {
                e->dx_free[bnd] = calloc_check((size_t)e->M, sizeof(DevEvent*));
                for (int i = 0; i < e->M; i++) e->dx_free[bnd][i] = ev_new(e);
            }
        }
    }

    // devices (plan_device_bytes says what and why)
    for (int g = 0; g < e->N; g++) {
        DevState* ds = &e->dev[g];
        ds->d = e->devs->dev[g];
        ds->ops = e->impl->ops(ds->d);
        ds->ctx = e->impl->ops_ctx(ds->d);
        ds->pnext = ds->gnext = 0;
        ds->n_marks = 0;
        ds->ws = workspace_create(m, ds->ops, ds->ctx, e->Bc, e->T, acts);
        for (int k = 0; k < 2; k++) {
            if (k < e->slot_sets) {
                ds->pslot[k] = dev_alloc(e, ds, (size_t)max_p * e->ab);
                ds->gslot[k] = dev_alloc(e, ds, (size_t)max_g * sizeof(float));
            } else {  // one slot set: the index never reaches 1 (pnext, gnext)
                ds->pslot[k] = ds->pslot[0];
                ds->gslot[k] = ds->gslot[0];
            }
            ds->pslot_free[k] = e->impl->event_create(ds->d);
            ds->gslot_free[k] = e->impl->event_create(ds->d);
            // activation buffers in two micro-batch parities; with one micro-batch per round
            // (long sequences) parity 1 is never used, so it shares parity 0's buffers
            if (k == 1 && e->M_R == 1) {
                ds->xs[1] = ds->xs[0];
                ds->dres[1] = ds->dres[0];
                ds->ids[1] = ds->ids[0];
                ds->targets[1] = ds->targets[0];
                ds->losses[1] = ds->losses[0];
            } else {
                ds->xs[k] = calloc_check((size_t)max_len + 1, sizeof(void*));
                for (int j = 0; j <= max_len; j++) ds->xs[k][j] = dev_alloc(e, ds, x_bytes);
                ds->dres[k] = dev_alloc(e, ds, x_bytes);
                ds->ids[k] = dev_alloc(e, ds, tok * sizeof(int32_t));
                ds->targets[k] = dev_alloc(e, ds, tok * sizeof(int32_t));
                ds->losses[k] = dev_alloc(e, ds, tok * sizeof(float));
            }
            ds->up_done[k] = e->impl->event_create(ds->d);
            ds->comp_done[k] = e->impl->event_create(ds->d);
            ds->down_done[k] = e->impl->event_create(ds->d);
            for (int s2 = 0; s2 < STREAM_COUNT; s2++) ds->iter_end[k][s2] = e->impl->event_create(ds->d);
        }
        ds->param_done = e->impl->event_create(ds->d);
        for (int k = 0; k < 2; k++) {
            ds->lev[k] = calloc_check((size_t)max_len + 1, sizeof(DevEvent*));
            for (int j = 0; j <= max_len; j++) ds->lev[k][j] = e->impl->event_create(ds->d);
        }
        ds->grads_ready = e->impl->event_create(ds->d);
        ds->gev = calloc_check((size_t)max_len + 1, sizeof(DevEvent*));
        for (int j = 0; j <= max_len; j++) ds->gev[j] = e->impl->event_create(ds->d);
        memset(&ds->pend, 0, sizeof ds->pend);
        ds->marks = calloc_check((size_t)e->M_R, sizeof(DevEvent*));
        for (int r = 0; r < e->M_R; r++) ds->marks[r] = e->impl->event_create(ds->d);
    }
}

// Free what plan_resources_create made. Every device must be idle.
static void plan_resources_free(Engine* e) {
    const DeviceImpl* im = e->impl;
    const int NL = e->NL;
    const int max_len = max_stage_len(e);
    for (int g = 0; g < e->N; g++) {
        DevState* ds = &e->dev[g];
        workspace_free(ds->ws);
        for (int k = 0; k < 2; k++) {
            if (k < e->slot_sets) {
                im->free(ds->d, ds->pslot[k]);
                im->free(ds->d, ds->gslot[k]);
            }
            im->event_destroy(ds->pslot_free[k]);
            im->event_destroy(ds->gslot_free[k]);
            if (!(k == 1 && e->M_R == 1)) {  // parity 1 shares parity 0's buffers then
                for (int j = 0; j <= max_len; j++) im->free(ds->d, ds->xs[k][j]);
                free(ds->xs[k]);
                im->free(ds->d, ds->dres[k]);
                im->free(ds->d, ds->ids[k]);
                im->free(ds->d, ds->targets[k]);
                im->free(ds->d, ds->losses[k]);
            }
            im->event_destroy(ds->up_done[k]);
            im->event_destroy(ds->comp_done[k]);
            im->event_destroy(ds->down_done[k]);
            for (int s2 = 0; s2 < STREAM_COUNT; s2++) im->event_destroy(ds->iter_end[k][s2]);
        }
        im->event_destroy(ds->param_done);
        for (int k = 0; k < 2; k++) {
            for (int j = 0; j <= max_len; j++) im->event_destroy(ds->lev[k][j]);
            free(ds->lev[k]);
        }
        im->event_destroy(ds->grads_ready);
        for (int j = 0; j <= max_len; j++) im->event_destroy(ds->gev[j]);
        free(ds->gev);
        for (int r = 0; r < e->M_R; r++) im->event_destroy(ds->marks[r]);
        free(ds->marks);
    }
    for (int b = 0; b < 2; b++) {
        for (int bnd = 0; bnd <= NL && b < e->host_parities; bnd++) {
            if (e->hx[b][bnd]) {
                for (int i = 0; i < e->M; i++) im->host_free(e->hx[b][bnd][i]);
                free(e->hx[b][bnd]);
            }
        }
        if (b < e->host_parities) {
            free(e->hx[b]);
            free(e->hdx[b]);
            for (int r = 0; r < 2; r++) {
                if (!e->dx_ring[b][r]) continue;
                for (int i = 0; i < e->M; i++) im->host_free(e->dx_ring[b][r][i]);
                free(e->dx_ring[b][r]);
                e->dx_ring[b][r] = NULL;
            }
        }
        const int n_prof = 2 * e->R * e->S * e->M_R;
        for (int i = 0; i < n_prof; i++) im->event_destroy(e->prof_ev[b][i]);
        free(e->prof_ev[b]);
        free(e->prof_ok[b]);
        arena_free(e->arena[b]);
        e->arena[b] = NULL;
        labels_free(e->labels[b]);
        e->labels[b] = NULL;
    }
    for (int bnd = 0; bnd <= NL; bnd++) {
        if (e->x_ev[bnd]) {
            for (int i = 0; i < e->M; i++) im->event_destroy(e->x_ev[bnd][i]);
            free(e->x_ev[bnd]);
        }
        if (e->dx_ev[bnd]) {
            for (int i = 0; i < e->M; i++) im->event_destroy(e->dx_ev[bnd][i]);
            free(e->dx_ev[bnd]);
        }
    }
    free(e->x_ev);
    free(e->dx_ev);
    for (int bnd = 0; e->x_free && bnd <= NL; bnd++) {
        if (e->x_free[bnd]) {
            for (int i = 0; i < e->M; i++) im->event_destroy(e->x_free[bnd][i]);
            free(e->x_free[bnd]);
        }
        if (e->dx_free[bnd]) {
            for (int i = 0; i < e->M; i++) im->event_destroy(e->dx_free[bnd][i]);
            free(e->dx_free[bnd]);
        }
    }
    free(e->x_free);
    free(e->dx_free);
    e->x_free = e->dx_free = NULL;
    for (int i = 0; i < e->S; i++) {
        free(e->stages[i].p_off);
        free(e->stages[i].g_off);
    }
    free(e->stages);
    free(e->need_x);
    free(e->need_dx);
    free(e->dx_slot);
    free(e->dx_last);
}

// Size-based (FLOP) cost estimates of one micro-batch for the current row chunks (e->Bc): the
// model chunks its MLP where a chunk's tokens exceed Model.mlp_chunk (model.c), and then every
// block's backward recomputes the MLP forward.
static void estimate_costs(Engine* e) {
    const int chunked = e->m->mlp_chunk > 0 && (int64_t)e->Bc * e->T > e->m->mlp_chunk;
    partition_estimate_costs(&e->m->cfg, e->T, e->Bm * e->T, chunked, e->cost_fwd, e->cost_bwd);
}

// The shape of a run and its size-based plan: everything engine_create and engine_plan_print
// share (no host or device memory beyond the cost tables). -1 with err on a bad shape.
static int engine_plan_init(Engine* e, const Model* m, int act_bytes, int n_devices,
                            const EngineOptions* opt, char* err) {
    e->m = m;
    e->opt = *opt;
    e->NL = m->tt.n_layers;
    e->N = n_devices;
    e->M = opt->M;
    e->M_R = opt->M_R > 0 ? opt->M_R : opt->M;
    e->T = opt->T;
    e->C = m->cfg.C;
    e->delay = opt->sync ? 0 : 1;
    e->split = opt->split_rounds != 0;
    if (e->split) {
        // (a round size of the whole batch is the default's spelling: the split makes it M/N)
        if (n_devices < 2 || e->M % n_devices != 0 ||
            (opt->M_R > 0 && opt->M_R != e->M && opt->M_R * n_devices != e->M))
            return errorf(err, "--split-rounds: %d micro-batches on %d device(s) (need at least 2 "
                          "devices, micro-batches a multiple of their number, and no other round "
                          "size)", e->M, n_devices);
        e->M_R = e->M / n_devices;
    }
    if (e->M <= 0 || e->M > opt->B || e->M % e->M_R != 0)
        return errorf(err, "micro-batches: %d micro-batches for a batch of %d sequences in rounds "
                      "of %d (need 1 <= M <= B and M a multiple of the round size)", e->M, opt->B,
                      e->M_R);
    e->R = e->M / e->M_R;
    e->Bm = (opt->B + e->M - 1) / e->M;  // the largest micro-batch (buffers are sized for it)
    const int min_rows = opt->B / e->M;  // the smallest micro-batch
    if (opt->row_chunks < 0 || opt->row_chunks > min_rows)
        return errorf(err, "row chunks: %d for micro-batches of %d sequences (need 0 = choose, or "
                      "1 .. %d)", opt->row_chunks, min_rows, min_rows);
    e->ab = (size_t)act_bytes;
    // size-based (FLOP) cost estimates until profiled times exist
    // (per row-chunk count below: whether the MLP is chunked depends on the chunk's tokens)
    e->cost_fwd = calloc_check((size_t)e->NL, sizeof(double));
    e->cost_bwd = calloc_check((size_t)e->NL, sizeof(double));
    // Row chunks: given, or the fewest (up to 8) whose plan is within 3% of the cheapest. More
    // chunks shrink the activations and scratch, so a tight budget fits more layers into the
    // fused stage (less recompute), at the price of smaller matrix products.
    const int k_max = opt->row_chunks > 0 ? opt->row_chunks : imin(min_rows, 8);
    PartitionPlan* plans = malloc_check((size_t)k_max * sizeof(PartitionPlan));
    int* ok = calloc_check((size_t)k_max, sizeof(int));
    char first_err[ERR_LEN] = "";
    double cheapest = INFINITY;
    for (int K = opt->row_chunks > 0 ? opt->row_chunks : 1; K <= k_max; K++) {
        e->K = K;
        e->Bc = (e->Bm + K - 1) / K;
        estimate_costs(e);
        char kerr[ERR_LEN];
        ok[K - 1] = plan_partition(e, &plans[K - 1], kerr) == 0;
        // split rounds run the whole model as one stage on every device
        if (ok[K - 1] && e->split && plans[K - 1].n_fwd + plans[K - 1].n_bwd != 1) {
            ok[K - 1] = 0;
            snprintf(kerr, sizeof kerr, "split rounds need the whole model in one stage, and with "
                     "%d row chunk(s) the plan has %d stages (more device memory, or more row "
                     "chunks, may fit it)", K, plans[K - 1].n_fwd + plans[K - 1].n_bwd);
        }
        if (ok[K - 1]) cheapest = fmin(cheapest, plans[K - 1].cost);
        else if (!first_err[0]) snprintf(first_err, sizeof first_err, "%s", kerr);
    }
    int chosen = 0;
    for (int K = 1; K <= k_max && !chosen; K++)
        if (ok[K - 1] && plans[K - 1].cost <= 1.03 * cheapest) chosen = K;
    if (chosen) {
        e->K = chosen;
        e->Bc = (e->Bm + chosen - 1) / chosen;
        estimate_costs(e);
        e->plan = plans[chosen - 1];
    }
    free(plans);
    free(ok);
    if (!chosen) {
        free(e->cost_fwd);
        free(e->cost_bwd);
        return errorf(err, "%s", first_err);
    }
    return 0;
}

// An engine that holds only a plan (engine_plan_init's cost tables, nothing else), or NULL with
// err; plan_only_free releases it.
static Engine* plan_only(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                         char* err) {
    Engine* e = calloc_check(1, sizeof(Engine));
    if (engine_plan_init(e, m, act_bytes, n_devices, opt, err) == 0) return e;
    free(e);
    return NULL;
}

static void plan_only_free(Engine* e) {
    free(e->cost_fwd);
    free(e->cost_bwd);
    free(e);
}

int engine_plan_fits(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                     char* err) {
    return engine_plan_print(m, act_bytes, n_devices, opt, NULL, NULL, err);
}

int engine_plan_cost(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                     double* cost, char* err) {
    Engine* e = plan_only(m, act_bytes, n_devices, opt, err);
    if (!e) return -1;
    *cost = e->plan.cost;
    plan_only_free(e);
    return 0;
}

int engine_plan_print(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                      FILE* f, size_t* host_act_bytes, char* err) {
    Engine* e = plan_only(m, act_bytes, n_devices, opt, err);
    if (!e) return -1;
    if (f) engine_print_plan(e, f);
    if (host_act_bytes) *host_act_bytes = plan_host_act_bytes(e, &e->plan);
    plan_only_free(e);
    return 0;
}

Engine* engine_create(const Model* m, Store* s, DeviceSet* devs, const EngineOptions* opt,
                      char* err) {
    Engine* e = calloc_check(1, sizeof(Engine));
    e->s = s;
    e->devs = devs;
    e->impl = devs->impl;
    if (engine_plan_init(e, m, e->impl->ops(devs->dev[0])->act_bytes, devs->n, opt, err) != 0) {
        free(e);
        return NULL;
    }
    const int NL = e->NL;
    const TensorTable* tt = &m->tt;
    cost_profile_init(&e->profile, NL);
    e->dev = calloc_check((size_t)e->N, sizeof(DevState));
    plan_resources_create(e);
    e->pool = threadpool_create_on(opt->opt_threads, opt->opt_cpus, opt->n_opt_cpus);

    // host buffers that do not depend on the plan: the compute-dtype weights and the batch
    const size_t tok = (size_t)e->Bm * e->T;
    for (int b = 0; b < 2; b++) {
        e->master[b] = calloc_check((size_t)NL, sizeof(void*));
        for (int l = 0; l < NL; l++) {
            e->master[b][l] = e->impl->host_alloc((size_t)tt->param_numel[l] * e->ab + 64);
        }
        e->hids[b] = calloc_check((size_t)e->M, sizeof(int32_t*));
        e->htgt[b] = calloc_check((size_t)e->M, sizeof(int32_t*));
        e->hloss[b] = calloc_check((size_t)e->M, sizeof(float*));
        for (int i = 0; i < e->M; i++) {
            e->hids[b][i] = e->impl->host_alloc(tok * sizeof(int32_t));
            e->htgt[b][i] = e->impl->host_alloc(tok * sizeof(int32_t));
            e->hloss[b][i] = e->impl->host_alloc(tok * sizeof(float));
        }
    }
    masters_init(e);
    if (opt->first_weights) {
        // a resumed delayed run: iteration 0 computes with the weights one step behind the Store
        for (int l = 0; l < NL; l++)
            memcpy(e->master[0][l], opt->first_weights[l], (size_t)tt->param_numel[l] * e->ab);
    }
    // the gradient accumulators are copy targets and sources: pin them
    e->n_hgrad = e->delay ? 2 : 1;
    e->hgrad[0] = s->grad;
    e->hgrad[1] = NULL;
    for (int l = 0; l < NL; l++)
        e->impl->host_register(s->grad[l], (size_t)tt->grad_numel[l] * sizeof(float));
    if (e->n_hgrad == 2) {
        e->hgrad[1] = calloc_check((size_t)NL, sizeof(float*));
        for (int l = 0; l < NL; l++)
            e->hgrad[1][l] = tt->grad_numel[l] > 0
                                 ? e->impl->host_alloc((size_t)tt->grad_numel[l] * sizeof(float))
                                 : NULL;
    }
    for (int b = 0; b < 2; b++) {
        e->loss_ev[b] = calloc_check((size_t)e->M, sizeof(DevEvent*));
        for (int i = 0; i < e->M; i++) e->loss_ev[b][i] = ev_new(e);
    }
    for (int b = 0; b < 2; b++) {
        e->grad_ev[b] = calloc_check((size_t)NL, sizeof(DevEvent*));
        for (int l = 0; l < NL; l++) e->grad_ev[b][l] = ev_new(e);
    }
    if (e->split) {
        e->hsplit = calloc_check((size_t)e->R - 1, sizeof(float**));
        e->split_ev = calloc_check((size_t)e->R - 1, sizeof(DevEvent**));
        e->split_summed = calloc_check((size_t)NL, sizeof(int64_t));
        for (int l = 0; l < NL; l++) e->split_summed[l] = -1;
        for (int r = 0; r < e->R - 1; r++) {
            e->hsplit[r] = calloc_check((size_t)NL, sizeof(float*));
            e->split_ev[r] = calloc_check((size_t)NL, sizeof(DevEvent*));
            for (int l = 0; l < NL; l++) {
                e->hsplit[r][l] = tt->grad_numel[l] > 0
                                      ? e->impl->host_alloc((size_t)tt->grad_numel[l] * sizeof(float))
                                      : NULL;
                e->split_ev[r][l] = ev_new(e);
            }
        }
    }

    // tracing: one process per device plus the host (optimizer)
    if (opt->trace_path && opt->trace_path[0]) {
        e->trace = trace_create(e->N + 1, 2000000);
        for (int g = 0; g < e->N; g++) {
            char name[32];
            snprintf(name, sizeof name, "%s:%d", e->impl->name, g);
            trace_name_pid(e->trace, g, name);
            e->impl->set_trace(e->dev[g].d, e->trace, g);
        }
        trace_name_pid(e->trace, e->N, "host");
        for (int s2 = 0; s2 < STREAM_COUNT; s2++) trace_name_tid(e->trace, s2, stream_names[s2]);
        trace_name_tid(e->trace, STREAM_COUNT, "optimizer");
    }

    // protocol flags: iterations 0..delay read θ_0, which both master buffers hold
    e->param_ready = calloc_check((size_t)NL, sizeof(int64_t));
    e->grad_consumed = calloc_check((size_t)NL, sizeof(int64_t));
    e->grad_recorded = calloc_check((size_t)NL, sizeof(int64_t));
    for (int l = 0; l < NL; l++) {
        e->param_ready[l] = e->delay;
        e->grad_consumed[l] = -1;
        e->grad_recorded[l] = -1;
    }
    for (int k = 0; k < 4; k++) e->folded_iter[k] = -1;
    pthread_check(pthread_mutex_init(&e->mu, NULL));
    pthread_check(pthread_cond_init(&e->cv, NULL));

    // optimizer: AdamW tensors grouped by owner layer
    e->opt_tensors = malloc_check((size_t)tt->n * sizeof(AdamWTensor));
    e->n_opt = store_adamw_tensors(s, e->opt_tensors);
    e->layer_first_opt = calloc_check((size_t)NL + 1, sizeof(int));
    e->opt_offset = calloc_check((size_t)(e->n_opt > 0 ? e->n_opt : 1), sizeof(int64_t));
    e->opt_layer = calloc_check((size_t)(e->n_opt > 0 ? e->n_opt : 1), sizeof(int));
    {
        // store_adamw_tensors lists the owned tensors in table order, which is layer order; an
        // owned tensor sits at the same offset in its layer's parameter and gradient slabs
        int idx = 0, t_i = 0;
        for (int l = 0; l < NL; l++) {
            e->layer_first_opt[l] = idx;
            for (; t_i < tt->n && tt->t[t_i].layer == l; t_i++) {
                if (tt->t[t_i].tied_to >= 0) continue;
                if (tt->t[t_i].grad_offset != tt->t[t_i].param_offset)
                    fatal("internal: tensor %s has different parameter and gradient offsets",
                          tt->t[t_i].name);
                e->opt_layer[idx] = l;
                e->opt_offset[idx++] = tt->t[t_i].param_offset;
            }
        }
        e->layer_first_opt[NL] = idx;
        e->norm_first = calloc_check((size_t)NL + 1, sizeof(int64_t));
        e->fold_owner = calloc_check((size_t)NL, sizeof(int));
        for (int l = 0; l < NL; l++)
            e->norm_first[l + 1] = e->norm_first[l] +
                                   adamw_chunk_count(e->opt_tensors + e->layer_first_opt[l],
                                                     e->layer_first_opt[l + 1] - e->layer_first_opt[l]);
        e->norm_parts = calloc_check((size_t)(e->norm_first[NL] > 0 ? e->norm_first[NL] : 1),
                                     sizeof(double));
        for (int i = 0; i < tt->n; i++)
            if (tt->t[i].tied_to >= 0) e->fold_owner[tt->t[tt->t[i].tied_to].layer] = 1;
    }
    pthread_check(pthread_create(&e->opt_thread, NULL, optimizer_main, e));
    for (int g = 0; g < e->N; g++) {
        DeviceStats st;
        e->impl->stats(e->dev[g].d, &st);
        e->dev[g].busy_last = st.busy_s[STREAM_COMPUTE];
    }
    e->t_last_step = time_now_s();
    return e;
}

// ----------------------------------------------------------------------------
// profiling and re-planning

// Turn the measured compute time of every stage of an iteration (averaged over micro-batches and
// rounds) into per-layer observations: a stage's time is shared among its layers in proportion to
// the costs the plan was made with (ROUNDPIPE.md §8.2). Layers of the fused stage never run a
// forward stage; their forward is a third of their (fused) backward, the 1:3 rule.
static void profile_collect(Engine* e, int ip) {
    if (e->prof_iter[ip] < 0) return;
    e->prof_iter[ip] = -1;
    const int NL = e->NL;
    double* fwd = calloc_check((size_t)NL, sizeof(double));
    double* bwd = calloc_check((size_t)NL, sizeof(double));
    for (int si = 0; si < e->S; si++) {
        // the stage's mean micro-batch time over its compute-only brackets (all of them if none is)
        const Stage* st = &e->stages[si];
        double sum[2] = {0, 0};
        int count[2] = {0, 0};
        for (int round = 0; round < e->R; round++) {
            for (int r = 0; r < e->M_R; r++) {
                const int k = (round * e->S + si) * e->M_R + r;
                const int ok = e->prof_ok[ip][k];
                sum[ok] += e->impl->event_elapsed(e->prof_ev[ip][2 * k], e->prof_ev[ip][2 * k + 1]);
                count[ok]++;
            }
        }
        const double measured = count[1] > 0 ? sum[1] / count[1] : sum[0] / count[0];
        const double* est = st->kind == SLOT_FWD ? e->cost_fwd : e->cost_bwd;
        double* obs = st->kind == SLOT_FWD ? fwd : bwd;
        double est_sum = 0;
        for (int l = st->b; l < st->e; l++) est_sum += est[l];
        for (int l = st->b; l < st->e; l++) obs[l] += est_sum > 0 ? measured * est[l] / est_sum : 0;
    }
    for (int l = e->plan.bwd[0].begin; l < NL; l++) fwd[l] = bwd[l] / 3.0;
    cost_profile_update(&e->profile, fwd, bwd);
    free(fwd);
    free(bwd);
}

static int plans_equal(const PartitionPlan* a, const PartitionPlan* b) {
    if (a->n_fwd != b->n_fwd || a->n_bwd != b->n_bwd) return 0;
    for (int i = 0; i < a->n_fwd; i++)
        if (a->fwd[i].begin != b->fwd[i].begin || a->fwd[i].end != b->fwd[i].end) return 0;
    for (int i = 0; i < a->n_bwd; i++)
        if (a->bwd[i].begin != b->bwd[i].begin || a->bwd[i].end != b->bwd[i].end) return 0;
    return 1;
}

// After replan_after profiled iterations: plan again with the measured costs, rebuild the
// plan-dependent buffers if the plan changed, and freeze it (ROUNDPIPE.md §18: profile, then
// freeze). Everything in flight is drained first; numerics do not depend on the plan.
static void maybe_replan(Engine* e) {
    // (split rounds keep their one-stage plan)
    if (e->frozen || e->split || e->opt.replan_after <= 0 || e->profile.n_obs < e->opt.replan_after)
        return;
    e->frozen = 1;
    double* fwd = calloc_check((size_t)e->NL, sizeof(double));
    double* bwd = calloc_check((size_t)e->NL, sizeof(double));
    if (cost_profile_get(&e->profile, fwd, bwd) == 0) {
        memcpy(e->cost_fwd, fwd, (size_t)e->NL * sizeof(double));
        memcpy(e->cost_bwd, bwd, (size_t)e->NL * sizeof(double));
        PartitionPlan plan;
        char err[ERR_LEN];
        if (plan_partition(e, &plan, err) == 0 && !plans_equal(&plan, &e->plan)) {
            engine_synchronize(e);
            plan_resources_free(e);
            e->plan = plan;
            plan_resources_create(e);
            e->replans++;
        }
    }
    free(fwd);
    free(bwd);
}

int engine_replans(const Engine* e) { return e->replans; }

int64_t engine_gated_stages(const Engine* e) { return e->gated_stages; }

int64_t engine_device_folds(const Engine* e) { return e->device_folds; }

int engine_row_chunks(const Engine* e) { return e->K; }

const void* engine_next_weights(const Engine* e, int layer) {
    return e->master[e->iter % 2][layer];
}

int engine_weight_bytes(const Engine* e) { return (int)e->ab; }

void engine_last_update(Engine* e, double* norm, double* lr) {
    pthread_check(pthread_mutex_lock(&e->mu));
    const int64_t k = e->steps_done;
    *norm = k > 0 ? e->norm_hist[k % 4] : (e->opt.first_weights ? e->opt.first_norm : 0.0);
    *lr = k > 0 ? e->lr_hist[k % 4] : (e->opt.first_weights ? e->opt.first_lr : 0.0);
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// ----------------------------------------------------------------------------
// stepping

// Iteration slot ip's device work is complete on every stream of every device.
static void wait_iteration_end(Engine* e, int ip) {
    for (int g = 0; g < e->N; g++)
        for (int s2 = 0; s2 < STREAM_COUNT; s2++)
            e->impl->event_synchronize(e->dev[g].iter_end[ip][s2]);
}

static void wait_iteration_done(Engine* e, int ip) {
    wait_iteration_end(e, ip);
    profile_collect(e, ip);
    arena_free(e->arena[ip]);
    e->arena[ip] = NULL;
    labels_free(e->labels[ip]);
    e->labels[ip] = NULL;
}

void engine_submit(Engine* e, const int32_t* tokens) {
    const int64_t t = e->iter;
    const int ip = (int)(t % 2);
    const int T = e->T;
    if (t - e->collected >= 2)
        fatal("engine_submit: two iterations are already in flight (collect one first)");
    wait_iteration_done(e, ip);  // iteration t-2 used these host buffers and closures
    maybe_replan(e);

    // split the batch into micro-batches of inputs and targets
    for (int i = 0; i < e->M; i++) {
        for (int b = 0; b < mb_rows(e, i); b++) {
            const int32_t* row = tokens + ((size_t)mb_first_row(e, i) + b) * (T + 1);
            memcpy(e->hids[ip][i] + (size_t)b * T, row, (size_t)T * sizeof(int32_t));
            memcpy(e->htgt[ip][i] + (size_t)b * T, row + 1, (size_t)T * sizeof(int32_t));
        }
    }
    for (int round = 0; round < e->R; round++) {
        for (int si = 0; si < e->S; si++) {
            int g = (int)(e->cursor % e->N);
            e->cursor++;
            enqueue_stage(e, &e->stages[si], g, t, round, round * e->S + si);
        }
        grads_flush_all(e);
    }
    e->prof_iter[ip] = t;
    for (int g = 0; g < e->N; g++)
        for (int s2 = 0; s2 < STREAM_COUNT; s2++)
            e->impl->event_record(e->dev[g].iter_end[ip][s2], e->dev[g].d, (StreamKind)s2);
    e->iter++;

    // hand the step for this iteration's gradient to the optimizer thread
    pthread_check(pthread_mutex_lock(&e->mu));
    e->steps_queued = t + 1;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

int64_t engine_in_flight(const Engine* e) { return e->iter - e->collected; }

EngineStepResult engine_collect(Engine* e) {
    if (e->collected >= e->iter) fatal("engine_collect: no iteration in flight");
    const int64_t t = e->collected;
    const int ip = (int)(t % 2);
    const int T = e->T;

    // the losses of this iteration, summed in micro-batch order
    double sum = 0.0;
    for (int i = 0; i < e->M; i++) {
        e->impl->event_synchronize(e->loss_ev[ip][i]);
        const size_t tok = (size_t)mb_rows(e, i) * T;
        for (size_t k = 0; k < tok; k++) sum += e->hloss[ip][i][k];
    }
    EngineStepResult res;
    memset(&res, 0, sizeof res);
    res.loss = sum / ((double)e->opt.B * T);
    // The step reported with this iteration, the same one whatever the timing (so logs are
    // reproducible): sync, the step of this iteration's gradient (the next iteration waits for it
    // anyway); delayed, step t, the one applying the previous iteration's gradient, which ran
    // during this iteration (and which the next iteration's first stages need anyway).
    const int64_t k = e->opt.sync ? t + 1 : t;
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->steps_done < k) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    if (k > 0) {
        res.norm = e->norm_hist[k % 4];
        res.lr = e->lr_hist[k % 4];
        res.norm_step = e->opt.start_step + k;
    } else if (e->opt.first_weights) {
        // resumed with the delayed update: the update the checkpoint already holds
        res.norm = e->opt.first_norm;
        res.lr = e->opt.first_lr;
        res.norm_step = e->opt.start_step;
    }
    pthread_check(pthread_mutex_unlock(&e->mu));

    // bubble: device compute idle time over the wall time since the previous step returned
    double now = time_now_s(), busy = 0.0;
    for (int g = 0; g < e->N; g++) {
        DeviceStats st;
        e->impl->stats(e->dev[g].d, &st);
        busy += st.busy_s[STREAM_COMPUTE] - e->dev[g].busy_last;
        e->dev[g].busy_last = st.busy_s[STREAM_COMPUTE];
    }
    double wall = now - e->t_last_step;
    e->t_last_step = now;
    res.bubble = wall > 0 ? 1.0 - busy / (wall * e->N) : 0.0;
    if (res.bubble < 0) res.bubble = 0;
    e->collected = t + 1;
    return res;
}

EngineStepResult engine_step(Engine* e, const int32_t* tokens) {
    while (engine_in_flight(e) >= 2) (void)engine_collect(e);
    engine_submit(e, tokens);
    EngineStepResult r = engine_collect(e);
    while (engine_in_flight(e) > 0) r = engine_collect(e);
    return r;
}

void engine_wait_devices(Engine* e) {
    for (int64_t k = e->iter >= 2 ? e->iter - 2 : 0; k < e->iter; k++) wait_iteration_end(e, (int)(k % 2));
}

void engine_synchronize(Engine* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->steps_done < e->steps_queued) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
    for (int g = 0; g < e->N; g++) e->impl->synchronize(e->dev[g].d);
    // oldest first, so the profile sees iterations in order
    int older = (int)((e->iter) % 2);
    profile_collect(e, older);
    profile_collect(e, 1 - older);
}

int64_t engine_steps_done(const Engine* e) { return e->steps_done; }

int engine_write_trace(Engine* e, char* err) {
    if (!e->trace) return 0;
    engine_synchronize(e);
    return trace_write(e->trace, e->opt.trace_path, err);
}

const PartitionPlan* engine_plan(const Engine* e) { return &e->plan; }

size_t engine_fixed_device_bytes(const Model* m, int act_bytes, const EngineOptions* opt) {
    Engine e;
    memset(&e, 0, sizeof e);
    e.m = m;
    e.T = opt->T;
    e.C = m->cfg.C;
    e.ab = (size_t)act_bytes;
    e.M_R = opt->M_R > 0 ? opt->M_R : opt->M;
    e.Bm = opt->M > 0 ? (opt->B + opt->M - 1) / opt->M : opt->B;
    const int K = opt->row_chunks > 0 ? opt->row_chunks : 1;
    e.Bc = (e.Bm + K - 1) / K;
    return fixed_device_bytes(&e);
}

EngineDeviceBytes engine_device_bytes(const Engine* e) {
    return plan_device_bytes(e, &e->plan, NULL, NULL, NULL, NULL);
}

static void print_bytes(FILE* f, const char* what, size_t bytes) {
    char b[32];
    format_bytes((double)bytes, b, sizeof b);
    fprintf(f, "%s%s", what, b);
}

void engine_print_plan(const Engine* e, FILE* f) {
    double* fb = calloc_check((size_t)e->NL, sizeof(double));
    double* bb = calloc_check((size_t)e->NL, sizeof(double));
    double* ub = calloc_check((size_t)e->NL, sizeof(double));
    layer_bytes(e, fb, bb, ub);
    partition_print(&e->plan, &e->m->cfg, fb, bb, ub, e->N, e->M, f);
    fprintf(f, "rounds per step %d x %d micro-batches of %s%d sequences", e->R, e->M_R,
            e->opt.B % e->M ? "up to " : "", e->Bm);
    if (e->K > 1) fprintf(f, " (computed in %d row chunks of up to %d)", e->K, e->Bc);
    if (e->split) fprintf(f, ", split: the rounds at once, one per device, gradients added");
    fprintf(f, ", %s recompute, %s optimizer\n",
            e->opt.grain == RECOMPUTE_LAYER ? "layer" : "stage",
            e->opt.sync ? "synchronous" : "one-step-delayed");
    const EngineDeviceBytes db = engine_device_bytes(e);
    print_bytes(f, "device memory per device: ", db.total);
    print_bytes(f, db.slot_sets == 1 ? " = stage slots (one set) " : " = stage slots ", db.slots);
    print_bytes(f, " + saved activations ", db.acts);
    print_bytes(f, " + scratch ", db.scratch);
    print_bytes(f, " + hand-off buffers ", db.handoff);
    print_bytes(f, "\nhost activation checkpoints: ", plan_host_act_bytes(e, &e->plan));
    fprintf(f, " (%s)\n", e->opt.host_single ? "one set" : "two sets: --host-checkpoints double");
    free(fb);
    free(bb);
    free(ub);
}

// ----------------------------------------------------------------------------
// teardown

void engine_free(Engine* e) {
    if (!e) return;
    engine_synchronize(e);
    pthread_check(pthread_mutex_lock(&e->mu));
    e->shutdown = 1;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
    pthread_check(pthread_join(e->opt_thread, NULL));
    const DeviceImpl* im = e->impl;
    const int NL = e->NL;
    if (e->trace) {
        for (int g = 0; g < e->N; g++) im->set_trace(e->dev[g].d, NULL, g);
        trace_free(e->trace);
    }
    plan_resources_free(e);
    free(e->dev);
    for (int l = 0; l < NL; l++) im->host_unregister(e->s->grad[l]);
    for (int r = 0; e->hsplit && r < e->R - 1; r++) {
        for (int l = 0; l < NL; l++) {
            im->host_free(e->hsplit[r][l]);
            im->event_destroy(e->split_ev[r][l]);
        }
        free(e->hsplit[r]);
        free(e->split_ev[r]);
    }
    free(e->hsplit);
    free(e->split_ev);
    free(e->split_summed);
    if (e->hgrad[1]) {
        for (int l = 0; l < NL; l++) im->host_free(e->hgrad[1][l]);
        free(e->hgrad[1]);
    }
    for (int b = 0; b < 2; b++) {
        for (int l = 0; l < NL; l++) im->host_free(e->master[b][l]);
        free(e->master[b]);
        for (int i = 0; i < e->M; i++) {
            im->host_free(e->hids[b][i]);
            im->host_free(e->htgt[b][i]);
            im->host_free(e->hloss[b][i]);
        }
        free(e->hids[b]);
        free(e->htgt[b]);
        free(e->hloss[b]);
    }
    for (int b = 0; b < 2; b++) {
        for (int i = 0; i < e->M; i++) im->event_destroy(e->loss_ev[b][i]);
        free(e->loss_ev[b]);
    }
    for (int b = 0; b < 2; b++) {
        for (int l = 0; l < NL; l++) im->event_destroy(e->grad_ev[b][l]);
        free(e->grad_ev[b]);
    }
    free(e->param_ready);
    free(e->grad_consumed);
    free(e->grad_recorded);
    free(e->opt_tensors);
    free(e->layer_first_opt);
    free(e->norm_first);
    free(e->norm_parts);
    free(e->fold_owner);
    free(e->opt_offset);
    free(e->opt_layer);
    free(e->cost_fwd);
    free(e->cost_bwd);
    cost_profile_free(&e->profile);
    threadpool_destroy(e->pool);
    pthread_check(pthread_mutex_destroy(&e->mu));
    pthread_check(pthread_cond_destroy(&e->cv));
    free(e);
}
