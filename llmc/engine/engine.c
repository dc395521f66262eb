/*
 * engine.c — the RoundPipe engine's glue: engine_create (plan, then allocate every host and device
 * buffer and event the plan needs, start the optimizer thread), engine_submit / engine_collect /
 * engine_step (one iteration in, its losses and reported step out, two in flight at most),
 * engine_synchronize, engine_free. Read engine.h first, then internal.h (the buffer and
 * event map), then plan.c, dispatch.c, transfer.c and protocol.c.
 *
 * Owns: the allocation and release of every buffer and event in the Engine struct (the other
 * files only use them), the tokens' split into micro-batches (hids, htgt; with the policy
 * objective its per-token inputs into hpol and the rows computed, act_rows), the losses' sum
 * (hloss after loss_ev; the policy objective's log-probs from hpol into logp_out; MoE models:
 * plus each micro-batch's aux from hmoe, with the step's CE, aux and expert loads), the
 * iteration bookkeeping (iter, collected, prof_iter) and the per-iteration end events iter_end, which it records on every stream and waits on before iteration t + 2
 * reuses parity t % 2's host buffers and closures. The bubble accounting (busy_last,
 * t_last_step).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

// ----------------------------------------------------------------------------
// plan-dependent buffers

static void* dev_alloc(Engine* e, DevState* ds, size_t bytes) {
    (void)ds;
    return e->impl->alloc(ds->d, bytes ? bytes : 64);
}

static DevEvent* ev_new(Engine* e) { return e->impl->event_create(e->devs->dev[0]); }

static int max_stage_len(const Engine* e) {
    int n = 1;
    for (int i = 0; i < e->S; i++) n = imax(n, e->stages[i].e - e->stages[i].b);
    return n;
}

// Everything whose shape depends on the plan: stages, host activation buffers and their events,
// and the device state (parameter/gradient slots, activation buffers, workspace).
static void plan_resources_create(Engine* e) {
    const Model* m = e->m;
    const int NL = e->NL;

    dispatch_stages_build(e);  // in slot order
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
    const size_t x_bytes = plan_x_buffer_bytes(e);
    const size_t tok = (size_t)e->Bm * e->T;
    e->host_parities = plan_host_act_sets(&e->opt);
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
        ds->ws_moe_stats = ds->ws->moe_stats;
        ds->ws_moe_counts = ds->ws->moe_counts;
        for (int k = 0; k < 2; k++) {
            if (k < e->slot_sets) {
                ds->pslot[k] = dev_alloc(e, ds, (size_t)max_p * e->ab);
                if (e->quant) ds->qslot[k] = dev_alloc(e, ds, plan_stage_block_bytes(e, &e->plan));
                if (e->s->map_src) ds->stage[k] = e->impl->host_alloc(STAGE_BYTES);
                ds->gslot[k] = dev_alloc(e, ds, (size_t)max_g * sizeof(float));
            } else {  // one slot set: the index never reaches 1 (pnext, gnext)
                ds->pslot[k] = ds->pslot[0];
                ds->qslot[k] = ds->qslot[0];
                ds->stage[k] = ds->stage[0];
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
                ds->pol[1] = ds->pol[0];
            } else {
                ds->xs[k] = calloc_check((size_t)max_len + 1, sizeof(void*));
                for (int j = 0; j <= max_len; j++) ds->xs[k][j] = dev_alloc(e, ds, x_bytes);
                ds->dres[k] = dev_alloc(e, ds, x_bytes);
                ds->ids[k] = dev_alloc(e, ds, tok * sizeof(int32_t));
                ds->targets[k] = dev_alloc(e, ds, tok * sizeof(int32_t));
                ds->losses[k] = dev_alloc(e, ds, tok * sizeof(float));
                ds->pol[k] = e->opt.policy ? dev_alloc(e, ds, 5 * tok * sizeof(float)) : NULL;
            }
            if (e->moe_floats > 0)  // (one micro-batch per round: parity 1 is parity 0)
                ds->moe[k] = k == 1 && e->M_R == 1
                                 ? ds->moe[0]
                                 : dev_alloc(e, ds, (size_t)e->moe_floats * sizeof(float));
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
        // the workspace frees its own MoE buffers, not the parity buffers its jobs pointed it to
        ds->ws->moe_stats = ds->ws_moe_stats;
        ds->ws->moe_counts = ds->ws_moe_counts;
        workspace_free(ds->ws);
        for (int k = 0; k < 2; k++) {
            if (k < e->slot_sets) {
                im->free(ds->d, ds->pslot[k]);
                im->free(ds->d, ds->gslot[k]);
                if (ds->qslot[k]) im->free(ds->d, ds->qslot[k]);
                if (ds->stage[k]) im->host_free(ds->stage[k]);
            }
            ds->qslot[k] = NULL;
            ds->stage[k] = NULL;
            im->event_destroy(ds->pslot_free[k]);
            im->event_destroy(ds->gslot_free[k]);
            if (!(k == 1 && e->M_R == 1)) {  // parity 1 shares parity 0's buffers then
                for (int j = 0; j <= max_len; j++) im->free(ds->d, ds->xs[k][j]);
                free(ds->xs[k]);
                im->free(ds->d, ds->dres[k]);
                im->free(ds->d, ds->ids[k]);
                im->free(ds->d, ds->targets[k]);
                im->free(ds->d, ds->losses[k]);
                if (ds->pol[k]) im->free(ds->d, ds->pol[k]);
                if (e->moe_floats > 0) im->free(ds->d, ds->moe[k]);
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
        jobs_free(e, b);
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
    dispatch_stages_free(e);
    free(e->need_x);
    free(e->need_dx);
    free(e->dx_slot);
    free(e->dx_last);
}

// ----------------------------------------------------------------------------
// creation

Engine* engine_create(const Model* m, Store* s, DeviceSet* devs, const EngineOptions* opt,
                      char* err) {
    if (opt->policy && (m->n_moe > 0 || opt->comm)) {
        snprintf(err, ERR_LEN, "the policy objective through the engine is built for dense "
                 "models on one process (%s)", m->n_moe > 0 ? "this model has experts"
                                                        : "data parallel");
        return NULL;
    }
    Engine* e = calloc_check(1, sizeof(Engine));
    e->s = s;
    e->devs = devs;
    e->impl = devs->impl;
    if (plan_init(e, m, e->impl->ops(devs->dev[0])->act_bytes, devs->n, opt, err) != 0) {
        free(e);
        return NULL;
    }
    const int NL = e->NL;
    const TensorTable* tt = &m->tt;
    cost_profile_init(&e->profile, NL);
    e->dev = calloc_check((size_t)e->N, sizeof(DevState));
    plan_resources_create(e);
    e->pool = threadpool_create_on(opt->opt_threads, opt->opt_cpus, opt->n_opt_cpus);

    // host buffers that do not depend on the plan: the compute-dtype weights and the batch. Each
    // layer's slab is a frozen head (LoRA: the base) and a trainable tail (the tensors the
    // optimizer updates; all of them for full training): the tail has a master per iteration
    // parity, the head one copy for both, since it never changes (the Store's own fp32 slab on
    // fp32 devices; one bf16 copy on bf16 devices)
    const size_t tok = (size_t)e->Bm * e->T;
    e->train_off = calloc_check((size_t)NL, sizeof(int64_t));
    e->base = calloc_check((size_t)NL, sizeof(void*));
    // (a quantised base, quant.h: the engine's copy holds the head as uploaded, on fp32 devices
    // too; a mapped base, --mmap-base: the tensors the mapping does not hold)
    if (s->map_src) e->quant = 1;
    if (s->base16 && e->ab != sizeof(uint16_t))
        fatal("internal: a bf16 streamed base on devices that compute in %d-byte elements",
              (int)e->ab);
    // (a streamed bf16 base, Store.base16: the Store's copy is the engine's, as the fp32 slabs
    // are on fp32 devices; with a quantised base pack_layer_head copies it)
    e->base_owned = (e->ab != sizeof(float) || e->quant) && !(s->base16 && !e->quant);
    for (int l = 0; l < NL; l++) {
        e->train_off[l] = tt->param_numel[l] - tt->state_numel[l];
        if (e->train_off[l] == 0) continue;
        if (e->base_owned && e->quant && opt->release_frozen && !s->map_src) {
            // (pack_layer_head allocates it as it packs the layer and gives the Store's copy
            // back: the host never holds two copies of a quantised base)
            e->base[l] = NULL;
        } else if (e->base_owned) {
            e->base[l] = e->impl->host_alloc(protocol_head_held_bytes(e, l) + 64);
        } else {
            e->base[l] = s->base16 ? (void*)s->base16[l] : (void*)s->param[l];
            e->impl->host_register(e->base[l], (size_t)e->train_off[l] * e->ab);
        }
    }
    for (int b = 0; b < 2; b++) {
        e->master[b] = calloc_check((size_t)NL, sizeof(void*));
        for (int l = 0; l < NL; l++) {
            e->master[b][l] = e->impl->host_alloc(
                (size_t)(tt->param_numel[l] - e->train_off[l]) * e->ab + 64);
        }
        e->hids[b] = calloc_check((size_t)e->M, sizeof(int32_t*));
        e->htgt[b] = calloc_check((size_t)e->M, sizeof(int32_t*));
        e->hloss[b] = calloc_check((size_t)e->M, sizeof(float*));
        for (int i = 0; i < e->M; i++) {
            e->hids[b][i] = e->impl->host_alloc(tok * sizeof(int32_t));
            e->htgt[b][i] = e->impl->host_alloc(tok * sizeof(int32_t));
            e->hloss[b][i] = e->impl->host_alloc(tok * sizeof(float));
        }
        e->act_rows[b] = calloc_check((size_t)e->M, sizeof(int));
        for (int i = 0; i < e->M; i++) e->act_rows[b][i] = mb_rows(e, i);
        if (opt->policy) {
            e->hpol[b] = calloc_check((size_t)e->M, sizeof(float*));
            for (int i = 0; i < e->M; i++) {
                e->hpol[b][i] = e->impl->host_alloc(5 * tok * sizeof(float));
                memset(e->hpol[b][i], 0, 5 * tok * sizeof(float));
            }
        }
        if (e->moe_floats > 0) {
            e->hmoe[b] = calloc_check((size_t)e->M, sizeof(float*));
            for (int i = 0; i < e->M; i++) {
                e->hmoe[b][i] = e->impl->host_alloc((size_t)e->moe_floats * sizeof(float));
                memset(e->hmoe[b][i], 0, (size_t)e->moe_floats * sizeof(float));
            }
        }
    }
    if (e->moe_floats > 0) e->moe_load = calloc_check((size_t)m->cfg.E, sizeof(double));
    e->pol_stride = tok;
    if (opt->policy) e->logp_out = calloc_check((size_t)opt->B * e->T, sizeof(float));
    protocol_masters_init(e);
    if (opt->first_weights) {
        // a resumed delayed run: iteration 0 computes with the weights one step behind the Store
        for (int l = 0; l < NL; l++)
            memcpy(e->master[0][l], opt->first_weights[l],
                   (size_t)(tt->param_numel[l] - e->train_off[l]) * e->ab);
    }
    // data parallel (ZeRO-1): the masters hold the weights now; what lies outside this rank's
    // shard goes before the gradient sets take their memory (the start-up peak)
    if (opt->comm) shard_release_early(e);
    // the gradient accumulators are copy targets and sources: pin them
    e->n_hgrad = plan_host_grad_sets(&e->opt);
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
        e->trace = trace_create(e->N + 1, ENGINE_TRACE_EVENTS);
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

    // the protocol's flags and the optimizer thread, last: the thread may run from here on
    protocol_init(e);
    // data parallel: the shard layout, and every rank's weights compared (collective; the
    // optimizer thread has no step yet, so the communicator is the controller's for now)
    if (opt->comm && shard_init(e, err) != 0) {
        engine_free(e);
        return NULL;
    }
    for (int g = 0; g < e->N; g++) {
        DeviceStats st;
        e->impl->stats(e->dev[g].d, &st);
        e->dev[g].busy_last = st.busy_s[STREAM_COMPUTE];
    }
    e->t_last_step = time_now_s();
    return e;
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
    plan_profile_collect(e, ip);
    jobs_free(e, ip);
}

// Re-plan once from the profiled stage times (plan_replan); when the plan changes, everything in
// flight is drained and the plan-dependent buffers are rebuilt (numerics do not depend on the
// plan).
static void maybe_replan(Engine* e) {
    PartitionPlan plan;
    if (!plan_replan(e, &plan)) return;
    engine_synchronize(e);
    plan_resources_free(e);
    e->plan = plan;
    plan_resources_create(e);
    e->replans++;
}

void engine_submit(Engine* e, const int32_t* tokens) { engine_submit_loss(e, tokens, NULL); }

// The policy objective's per-token inputs of iteration parity ip into its micro-batches' host
// buffers (five pol_stride runs: old, ref, adv, weight, then the log-probs coming back), and the
// rows each micro-batch computes.
static void stage_policy(Engine* e, int ip, const EngineLoss* loss) {
    const int T = e->T;
    const size_t S = e->pol_stride;
    const int rows = imax(0, imin(loss->rows, e->opt.B));
    e->pol_par[ip] = *loss;
    for (int i = 0; i < e->M; i++) {
        const int first = mb_first_row(e, i), n = mb_rows(e, i);
        e->act_rows[ip][i] = imax(0, imin(n, rows - first));
        const size_t at = (size_t)first * T, cnt = (size_t)n * T;
        float* h = e->hpol[ip][i];
        memcpy(e->htgt[ip][i], loss->targets + at, cnt * sizeof(int32_t));
        memcpy(h, loss->old_logp + at, cnt * sizeof(float));
        if (loss->ref_logp) memcpy(h + S, loss->ref_logp + at, cnt * sizeof(float));
        memcpy(h + 2 * S, loss->adv + at, cnt * sizeof(float));
        memcpy(h + 3 * S, loss->weight + at, cnt * sizeof(float));
    }
}

void engine_submit_loss(Engine* e, const int32_t* tokens, const EngineLoss* loss) {
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
            if (!loss)  // (the objective's own targets: stage_policy)
                memcpy(e->htgt[ip][i] + (size_t)b * T, row + 1, (size_t)T * sizeof(int32_t));
        }
    }
    if (loss && !e->opt.policy)
        fatal("internal: engine_submit_loss with an objective on an engine without opt.policy");
    e->pol_on[ip] = loss != NULL;
    if (loss) {
        stage_policy(e, ip, loss);
    } else {
        for (int i = 0; i < e->M; i++) e->act_rows[ip][i] = mb_rows(e, i);
    }
    dispatch_iteration(e, t);
    e->prof_iter[ip] = t;
    for (int g = 0; g < e->N; g++)
        for (int s2 = 0; s2 < STREAM_COUNT; s2++)
            e->impl->event_record(e->dev[g].iter_end[ip][s2], e->dev[g].d, (StreamKind)s2);
    e->iter++;

    protocol_queue_step(e, t);  // the step for this iteration's gradient
}

int64_t engine_in_flight(const Engine* e) { return e->iter - e->collected; }

// Micro-batch i's objective into *sum, its CE, aux and expert loads into res.
static void collect_moe(Engine* e, int ip, int i, double* sum, EngineStepResult* res) {
    const int E = e->m->cfg.E;
    if (i == 0) memset(e->moe_load, 0, (size_t)E * sizeof(double));
    float* counts = malloc_check((size_t)E * sizeof(float));
    double ce, aux_tokens;
    *sum += mb_moe_objective(e, ip, i, &ce, &aux_tokens, counts);
    res->ce_sum += ce;
    res->aux_sum += aux_tokens;
    for (int x = 0; x < E; x++) e->moe_load[x] += counts[x];
    free(counts);
}

EngineStepResult engine_collect(Engine* e) {
    if (e->collected >= e->iter) fatal("engine_collect: no iteration in flight");
    const int64_t t = e->collected;
    const int ip = (int)(t % 2);
    const int T = e->T;

    // the losses of this iteration, summed in micro-batch order
    EngineStepResult res;
    memset(&res, 0, sizeof res);
    double sum = 0.0;
    if (e->pol_on[ip]) {
        // the policy objective: each micro-batch's sum over its computed rows, then their sum
        // (the plain path's order), and the log-probs back in batch order
        memset(e->logp_out, 0, (size_t)e->opt.B * T * sizeof(float));
        for (int i = 0; i < e->M; i++) {
            e->impl->event_synchronize(e->loss_ev[ip][i]);
            const size_t tok = (size_t)e->act_rows[ip][i] * T;
            double mb = 0.0;
            for (size_t k = 0; k < tok; k++) mb += e->hloss[ip][i][k];
            sum += mb;
            memcpy(e->logp_out + (size_t)mb_first_row(e, i) * T,
                   e->hpol[ip][i] + 4 * e->pol_stride, tok * sizeof(float));
        }
        res.loss = sum;
        res.logp = e->logp_out;
    }
    for (int i = 0; i < e->M && !e->pol_on[ip]; i++) {
        e->impl->event_synchronize(e->loss_ev[ip][i]);
        const size_t tok = (size_t)mb_rows(e, i) * T;
        if (e->moe_floats > 0) {
            collect_moe(e, ip, i, &sum, &res);
            continue;
        }
        for (size_t k = 0; k < tok; k++) sum += e->hloss[ip][i][k];
    }
    if (e->moe_floats > 0) res.load = e->moe_load;
    if (!e->pol_on[ip]) res.loss = sum / ((double)e->opt.B * T);
    if (e->dp) {
        // data parallel: the global loss, which the step of this iteration's gradient gathers
        // with the norm's parts (the same bits on every rank)
        double n1, l1;
        protocol_wait_step(e, t + 1, &n1, &l1);
        res.loss = shard_loss(e, t) / ((double)e->opt.global_B * T);
        if (e->moe_floats > 0) shard_moe_stats(e, t, &res);  // (the global CE, aux and loads)
        res.error = shard_error(e);
    }
    // The step reported with this iteration, the same one whatever the timing (so logs are
    // reproducible): sync, the step of this iteration's gradient (the next iteration waits for it
    // anyway); delayed, step t, the one applying the previous iteration's gradient, which ran
    // during this iteration (and which the next iteration's first stages need anyway).
    const int64_t k = e->opt.sync ? t + 1 : t;
    double norm, lr;
    protocol_wait_step(e, k, &norm, &lr);
    if (k > 0) {
        res.norm = norm;
        res.lr = lr;
        res.norm_step = e->opt.start_step + k;
    } else if (e->opt.first_weights) {
        // resumed with the delayed update: the update the checkpoint already holds
        res.norm = e->opt.first_norm;
        res.lr = e->opt.first_lr;
        res.norm_step = e->opt.start_step;
    }

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
    protocol_wait_steps(e);
    for (int g = 0; g < e->N; g++) e->impl->synchronize(e->dev[g].d);
    // oldest first, so the profile sees iterations in order
    int older = (int)((e->iter) % 2);
    plan_profile_collect(e, older);
    plan_profile_collect(e, 1 - older);
}

int engine_gather_state(Engine* e, int root, int with_state, char* err) {
    engine_synchronize(e);  // (every queued step done: the shards hold their final values)
    return shard_gather_state(e, root, with_state, err);
}

int engine_write_trace(Engine* e, char* err) {
    if (!e->trace) return 0;
    engine_synchronize(e);
    return trace_write(e->trace, e->opt.trace_path, err);
}

// ----------------------------------------------------------------------------
// teardown

void engine_free(Engine* e) {
    if (!e) return;
    engine_synchronize(e);
    protocol_free(e);  // stops the optimizer thread
    shard_free(e);
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
    if (e->hgrad[1]) {
        for (int l = 0; l < NL; l++) im->host_free(e->hgrad[1][l]);
        free(e->hgrad[1]);
    }
    for (int l = 0; l < NL; l++) {
        if (!e->base[l]) continue;
        if (e->base_owned) im->host_free(e->base[l]);
        else im->host_unregister(e->base[l]);
    }
    free(e->base);
    free(e->train_off);
    for (int b = 0; b < 2; b++) {
        for (int l = 0; l < NL; l++) im->host_free(e->master[b][l]);
        free(e->master[b]);
        for (int i = 0; i < e->M; i++) {
            im->host_free(e->hids[b][i]);
            im->host_free(e->htgt[b][i]);
            im->host_free(e->hloss[b][i]);
            if (e->hmoe[b]) im->host_free(e->hmoe[b][i]);
            if (e->hpol[b]) im->host_free(e->hpol[b][i]);
        }
        free(e->hpol[b]);
        free(e->act_rows[b]);
        free(e->hmoe[b]);
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
    free(e->moe_load);
    free(e->logp_out);
    free(e->cost_fwd);
    free(e->cost_bwd);
    cost_profile_free(&e->profile);
    threadpool_destroy(e->pool);
    free(e);
}
