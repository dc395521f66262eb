/*
 * dispatch.c — the schedule as it runs (docs/ROUNDPIPE.md §3): the stages of the plan in slot
 * order, the rounds of an iteration, the never-reset cursor that sends global slot i to device
 * schedule_slot_device(i, 0, N), and the micro-batch jobs a stage runs on its device's compute
 * stream (whole, or split into MbPhase parts behind per-layer uploads and ahead of per-layer
 * downloads).
 *
 * Owns: e->stages, e->cursor, the job arenas and trace labels (arena[ip], labels[ip]), a
 * device's slot choice (pnext, gnext), its compute stream, and the order in which a slot's work
 * is enqueued. Events it records: param_done (after the stage's parameter upload), comp_done[p]
 * (compute of parity p done), gev[k] (layer k's final gradient, for per-layer downloads),
 * pslot_free[k] (the stage's last compute that read slot k) and the profile brackets prof_ev
 * (with prof_ok); its compute waits on up_done[p], down_done[p], param_done and lev[k][l].
 * Buffers it touches: device buffers only, from jobs on the compute stream (the slot's parameters
 * and gradients, the activation parities, the workspace and, for MoE models, the parity's aux
 * statistics and counts, DevState.moe). Host buffers and copies are transfer.c's (but the fused
 * stage's model_moe_aux, which copies a few KiB synchronously on the compute stream); the
 * protocol's flags are reached only through protocol.c.
 */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "../lora.h"

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

void dispatch_stages_build(Engine* e) {
    e->S = e->plan.n_fwd + e->plan.n_bwd;
    e->stages = calloc_check((size_t)e->S, sizeof(Stage));
    for (int i = 0; i < e->S; i++) {
        SlotInfo si;
        partition_slot(&e->plan, i, &si);
        stage_build(e, &e->stages[i], si.kind, si.range);
        stage_name(&e->stages[i], si.kind, si.stage);
    }
}

void dispatch_stages_free(Engine* e) {
    for (int i = 0; i < e->S; i++) {
        free(e->stages[i].p_off);
        free(e->stages[i].g_off);
    }
    free(e->stages);
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
            model_block_forward_at(m, ds->ws, a, l - 1, slot_layer(e, st, j->pslot, l),
                                   xrows(e, j, xs[k]), xrows(e, j, xs[k + 1]), j->B, e->T);
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
            // (LoRA: a frozen embedding has no gradient, and the prefix no backward)
            const int64_t g_embed = m->tt.t[tensor_table_index(&m->tt, TK_EMBED, -1)].grad_offset;
            if (g_embed >= 0)
                model_prefix_backward(m, ds->ws, j->gslot + st->g_off[k] + g_embed, dres,
                                      trows(e, j, ds->ids[j->p], sizeof(int32_t)), j->B, e->T);
            continue;
        }
        if (e->opt.grain == RECOMPUTE_LAYER && st->kind == SLOT_BWD) {
            // layer grain: recompute just this block from its uploaded checkpoint; its output is
            // written over the deeper boundary's buffer, which the deeper block no longer needs
            // (an MoE block's recompute rewrites its aux statistics row with the same bits and
            // leaves the counts alone)
            model_block_forward_at(m, ds->ws, &ds->ws->acts[0], l - 1,
                                   slot_layer(e, st, j->pslot, l), xrows(e, j, xs[k]),
                                   xrows(e, j, xs[k + 1]), j->B, e->T);
            model_block_backward_at(m, ds->ws, &ds->ws->acts[0], l - 1,
                                    slot_layer(e, st, j->pslot, l), j->gslot + st->g_off[k],
                                    xrows(e, j, xs[k]), dres, j->B, e->T);
        } else {
            model_block_backward_at(m, ds->ws, &ds->ws->acts[block_set(st, l)], l - 1,
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
        if (d->tied_to < 0 || !d->trainable) continue;  // (LoRA: a frozen head has no gradient)
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
        if (d->tied_to < 0 || !d->trainable) continue;
        const TensorDesc* o = &tt->t[d->tied_to];
        j->ds->ops->add_f32(j->ds->ctx, j->gslot + st->g_off[o->layer - st->b] + o->grad_offset,
                            j->gslot + st->g_off[d->layer - st->b] + d->grad_offset,
                            (size_t)d->numel);
    }
}

// MoE models: the job's workspace reads and writes its micro-batch parity's aux statistics and
// counts (DevState.moe, which the hand-offs move), and the aux gradient's factor for its shape
// (model_moe_aux sets the same in the fused stage; backward stages get only the counts).
static void moe_bind(Engine* e, const MbJob* j, float grad_scale) {
    Workspace* ws = j->ds->ws;
    ws->moe_stats = j->ds->moe[j->p];
    ws->moe_counts = j->ds->moe[j->p] + (size_t)e->m->n_moe * 2 * e->m->cfg.E;
    ws->moe_aux_scale = model_moe_aux_scale(e->m, j->B, e->T, grad_scale);
}

// One job on a compute stream: the part of its micro-batch (row chunk) that MbJob.phase names.
static void run_microbatch(void* arg) {
    MbJob* j = arg;
    Engine* e = j->e;
    const Stage* st = j->st;
    DevState* ds = j->ds;
    if (j->phase == MB_PHASE_FOLD) {
        if (e->opt.fake_compute_us == 0) fold_on_device(e, j);
        return;
    }
    if (j->B <= 0) return;  // rows not computed (EngineLoss.rows): no loss, no gradient
    if (e->opt.fake_compute_us > 0) {
        // split jobs: forward layers share the half of the time that is not the rest (all of it
        // in a forward stage)
        int64_t us = (int64_t)e->opt.fake_compute_us * j->B / mb_rows(e, j->i);  // this chunk's share
        const int n = st->e - st->b;
        if (j->phase == MB_PHASE_FORWARD || j->phase == MB_PHASE_BACKWARD)
            us = us * (j->to - j->from) / (st->kind == SLOT_FWD ? n : 2 * n);
        if (j->phase == MB_PHASE_REST) us /= 2;
        if (j->phase == MB_PHASE_LOSS) us = 0;
        struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
        nanosleep(&ts, NULL);
        return;
    }
    // the gradient of every micro-batch is scaled by 1 / (tokens of the step: of the global
    // batch with data parallelism)
    const int B = e->opt.global_B > 0 ? e->opt.global_B : e->opt.B;
    const float grad_scale = 1.0f / ((float)B * (float)e->T);
    if (e->m->n_moe > 0) moe_bind(e, j, grad_scale);
    // LoRA: the plain trainer's dropout masks for this micro-batch (the workspace is the
    // device's, used by one job at a time on its compute stream)
    ds->ws->lora_train = 1;
    ds->ws->lora_seed = j->lora_seed;
    ds->ws->lora_row0 = (int64_t)j->row0 * e->T;
    if (j->phase == MB_PHASE_FORWARD) {
        forward_layers(e, j, j->from, j->to, st->kind != SLOT_FWD);
        return;
    }
    if (j->phase == MB_PHASE_BACKWARD) {
        backward_layers(e, j, j->from, j->to);
        return;
    }
    if (st->kind == SLOT_FWD) {
        forward_layers(e, j, st->b, st->e, 0);
        return;
    }
    if (st->kind == SLOT_FUSED) {
        const int last = e->NL - 1;  // the postfix
        if (j->phase == MB_PHASE_WHOLE) forward_layers(e, j, st->b, last, 1);
        const TensorTable* tt = &e->m->tt;
        int i_norm = tensor_table_index(tt, TK_FINAL_NORM, -1);
        int i_head = tensor_table_index(tt, TK_LM_HEAD, -1);
        float* g = j->gslot + st->g_off[last - st->b];
        const void* norm_w = (const char*)slot_layer(e, st, j->pslot, last) +
                             (size_t)tt->t[i_norm].param_offset * e->ab;
        // MoE: every block of the micro-batch has run its forward (the forward stages' rows were
        // uploaded before this job): the aux loss, and the counts its backward needs (the
        // host part of model_moe_aux copies synchronously: once per micro-batch, a few KiB)
        model_moe_aux(e->m, ds->ws, j->B, e->T, grad_scale);
        // (LoRA: the frozen norm and head have no gradient: NULL)
        const int64_t g_norm = tt->t[i_norm].grad_offset, g_head = tt->t[i_head].grad_offset;
        if (e->pol_on[j->ip]) {
            // the policy objective: its per-token inputs next to the targets (DevState.pol),
            // the log-probs written into the fifth run for the download
            const EngineLoss* lp = &e->pol_par[j->ip];
            const size_t S = e->pol_stride, r0 = (size_t)j->row0 * e->T;
            float* pb = ds->pol[j->p];
            const PolicyLoss pl = {.old_logp = pb + r0,
                                   .ref_logp = lp->ref_logp ? pb + S + r0 : NULL,
                                   .adv = pb + 2 * S + r0, .weight = pb + 3 * S + r0,
                                   .inv_temp = lp->inv_temp, .clip_low = lp->clip_low,
                                   .clip_high = lp->clip_high, .kl_beta = lp->kl_beta};
            model_postfix_policy(e->m, ds->ws, norm_w, postfix_head(e, j),
                                 g_norm >= 0 ? g + g_norm : NULL, g_head >= 0 ? g + g_head : NULL,
                                 xrows(e, j, ds->xs[j->p][last - st->b]),
                                 xrows(e, j, ds->dres[j->p]),
                                 trows(e, j, ds->targets[j->p], sizeof(int32_t)), &pl,
                                 pb + 4 * S + r0, trows(e, j, ds->losses[j->p], sizeof(float)), 1,
                                 j->B, e->T);
        } else {
            model_postfix_forward_backward(e->m, ds->ws, norm_w, postfix_head(e, j),
                                           g_norm >= 0 ? g + g_norm : NULL,
                                           g_head >= 0 ? g + g_head : NULL,
                                           xrows(e, j, ds->xs[j->p][last - st->b]),
                                           xrows(e, j, ds->dres[j->p]),
                                           trows(e, j, ds->targets[j->p], sizeof(int32_t)),
                                           trows(e, j, ds->losses[j->p], sizeof(float)),
                                           grad_scale, 1, j->B, e->T);
        }
        if (j->phase != MB_PHASE_LOSS) backward_layers(e, j, st->b, last);
        return;
    }
    // backward stage: recompute (stage grain) then backward
    if (e->opt.grain == RECOMPUTE_STAGE && j->phase == MB_PHASE_WHOLE)
        forward_layers(e, j, st->b, st->e, 1);
    backward_layers(e, j, st->b, st->e);
}


// ----------------------------------------------------------------------------
// one stage on one device

// Submit one part of a micro-batch (MbJob.phase) on the compute stream, labelled for traces.
__attribute__((format(printf, 6, 7))) static void submit_part(Engine* e, const MbJob* base,
                                                              MbPhase phase, int from, int to,
                                                              const char* fmt, ...) {
    MbJob* j = jobs_new(e, base->ip);
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
        jobs_label(e, base->ip, base->ds, STREAM_COMPUTE, "%s", name);
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
        submit_part(e, base, MB_PHASE_WHOLE, 0, 0, "%s", who);
        return;
    }
    const int fwd_end = st->kind == SLOT_FUSED            ? e->NL - 1
                        : st->kind == SLOT_FWD            ? st->e
                        : e->opt.grain == RECOMPUTE_STAGE ? st->e
                                                          : st->b;  // layer grain: none
    for (int l = st->b; l < fwd_end;) {
        const int to = first ? l + 1 : fwd_end;
        im->stream_wait(d, STREAM_COMPUTE, first ? ds->lev[pk][l - st->b] : ds->param_done);
        submit_part(e, base, MB_PHASE_FORWARD, l, to, "%s fwd %d-%d", who, l, to - 1);
        l = to;
    }
    if (st->kind == SLOT_FWD) return;
    im->stream_wait(d, STREAM_COMPUTE, ds->param_done);
    if (!last) {
        submit_part(e, base, MB_PHASE_REST, 0, 0, "%s rest", who);
        return;
    }
    // rule 4 (host buffers of iteration t - n_hgrad consumed), and the previous stage's deferred
    // download first on the gradient stream
    transfer_grads_issue(e, ds, 1);
    protocol_fence_grads(e, st, base->t);
    // a tied head's gradient is folded into its owner's here when both are in this stage: the
    // host's fold (after the last gradient, before the step) is then skipped
    const int fold = stage_folds(e, st);
    if (fold) {
        protocol_mark_device_fold(e, base->t);
        e->device_folds++;
    }
    for (int l = st->e - 1; l >= st->b; l--) {
        if (st->kind == SLOT_FUSED && l == e->NL - 1)
            submit_part(e, base, MB_PHASE_LOSS, 0, 0, "%s loss", who);
        else
            submit_part(e, base, MB_PHASE_BACKWARD, l, l + 1, "%s bwd %d", who, l);
        if (fold && e->fold_owner[l])
            submit_part(e, base, MB_PHASE_FOLD, 0, 0, "%s fold tied grads", who);
        im->event_record(ds->gev[l - st->b], d, STREAM_COMPUTE);
        if (e->split && base->i / e->M_R > 0) protocol_fence_split(e, l, base->t);
        transfer_grads_layer_down(e, ds, st, gk, l, base->t, base->i / e->M_R, fold);
    }
}

// One slot: stage st of round `round` of iteration t on device g (job_idx: the slot's index within
// the iteration, round * S + si). The stage's parameters and gradient slot, then per micro-batch:
// activations up, compute, activations down.
// Micro-batch i's index for LoRA's dropout masks: with data parallelism its index in the
// single-process grouping (rank r's micro-batches follow those of the ranks before it), so that
// the ranks draw different masks; i itself in a run of one process.
static int mb_global(const Engine* e, int i) {
    return e->opt.comm ? e->opt.comm->rank * e->M + i : i;
}

static void enqueue_stage(Engine* e, const Stage* st, int g, int64_t t, int round, int job_idx) {
    DevState* ds = &e->dev[g];
    const DeviceImpl* im = e->impl;
    Device* d = ds->d;
    const int ip = (int)(t % 2);

    // parameters (and gradient slot) for this stage: when the optimizer is still writing them,
    // layer by layer behind per-layer fences (rule 2) with the first micro-batch's forward gated
    // per layer too, where the stage's forward runs shallow to deep (not for layer-grain
    // backward stages, whose recompute runs deepest first)
    int pk = ds->pnext;
    ds->pnext = (ds->pnext + 1) % e->slot_sets;
    if (!e->delay) protocol_fence_params(e, st, t);
    // (one slot set: always layer by layer, so the upload into the slot the previous iteration
    // just freed runs only just ahead of the forward)
    const int late = e->delay && !protocol_params_ready(e, st, t);
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
        transfer_params_up_gated(e, ds, st, pk, t);
        e->gated_stages += late;
    } else {
        transfer_params_up(e, ds, st, pk, t);
    }
    int gk = -1;
    if (st->kind != SLOT_FWD) {
        gk = ds->gnext;
        ds->gnext = (ds->gnext + 1) % e->slot_sets;
        transfer_grads_prepare(e, ds, st, gk, round, t);
    }
    im->event_record(ds->param_done, d, STREAM_PARAM_UP);
    transfer_params_dequant(e, ds, st, pk, t, gated);  // (a quantised base, quant.h)

    for (int r = 0; r < e->M_R; r++) {
        const int i = round * e->M_R + r;  // micro-batch index within the iteration
        const int p = r % 2;
        const int Bi = mb_rows(e, i);

        // activations up (the high-priority path), then the compute
        transfer_acts_up(e, ds, st, i, r, t);
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
            // (rows past act_rows are not computed: EngineLoss.rows; B 0 skips the compute)
            const int rows = imax(0, imin(r1, e->act_rows[ip][i]) - r0);
            const MbJob base = {.e = e, .ds = ds, .st = st, .i = i, .p = p, .ip = ip,
                                .B = rows, .row0 = r0, .pslot = ds->pslot[pk],
                                .gslot = gk >= 0 ? ds->gslot[gk] : NULL, .t = t,
                                .lora_seed = lora_dropout_seed(e->opt.seed,
                                                               e->opt.start_step + t,
                                                               mb_global(e, i))};
            enqueue_chunk(e, &base, pk, gk, r == 0 && c == 0 && split,
                          r == e->M_R - 1 && c == e->K - 1 && layer_grads);
        }
        im->event_record(prof[1], d, STREAM_COMPUTE);
        im->event_record(ds->comp_done[p], d, STREAM_COMPUTE);
        // activations down (the previous stage's gradients fill the windows between them)
        transfer_acts_down(e, ds, st, i, r, t);
        // this window's share of the previous stage's gradient download
        if (ds->pend.active) {
            im->stream_wait(d, STREAM_GRAD_DOWN, ds->down_done[p]);
            transfer_grads_issue(e, ds, 0);
        }
    }
    transfer_grads_issue(e, ds, 1);  // a pending download with more bins than windows
    ds->n_marks = e->M_R;
    im->event_record(ds->pslot_free[pk], d, STREAM_COMPUTE);

    // the gradients go down during the next stage on this device (or at the round's end), or
    // went down layer by layer above
    if (layer_grads) {
        transfer_grads_done(e, ds, st, gk, t, round == e->R - 1);
    } else if (st->kind != SLOT_FWD) {
        transfer_grads_defer(e, ds, st, gk, t, round);
    }
}


// ----------------------------------------------------------------------------
// rounds

// Enqueue every round of iteration t: the S slots of a round in order, each on the device the
// cursor names (never reset, so rounds and iterations go on round-robin where the last stopped,
// docs/ROUNDPIPE.md §3.2). Nothing stays deferred past a round: the next round's gradient
// preparation and the optimizer read the host gradient buffers.
void dispatch_iteration(Engine* e, int64_t t) {
    for (int round = 0; round < e->R; round++) {
        for (int si = 0; si < e->S; si++) {
            const int g = schedule_slot_device(e->cursor, 0, e->N);
            e->cursor++;
            enqueue_stage(e, &e->stages[si], g, t, round, round * e->S + si);
        }
        transfer_grads_flush_all(e);
    }
}

int64_t engine_gated_stages(const Engine* e) { return e->gated_stages; }

int64_t engine_device_folds(const Engine* e) { return e->device_folds; }
