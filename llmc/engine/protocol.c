/*
 * protocol.c — the consistency protocol (docs/ROUNDPIPE.md §5) and the optimizer thread: the
 * per-layer fences that order the controller's enqueueing, the devices' gated uploads and the
 * optimizer's steps, and the thread that runs one AdamW step per iteration in FIFO order.
 *
 * The five ordering rules, per layer l, as this file enforces them:
 *   1. step k writes master[(k + delay) % 2] only after iteration k-1's last gradient download of
 *      l, which follows that iteration's last upload of l (the buffer's previous reader):
 *      optimizer_step waits grad_recorded[l] and the layer's download event;
 *   2. iteration t uploads l only once param_ready[l] >= t: protocol_fence_params (sync, whole
 *      stages, controller), protocol_param_fence_fn (delayed, per layer, on a parameter stream);
 *   3. step k reads iteration k-1's gradient only after its download: the grad_ev event;
 *   4. iteration t downloads into gradient set t % n_hgrad only once grad_consumed[l] >= t -
 *      n_hgrad: protocol_fence_grads (and protocol_fence_split for split rounds' sets);
 *   5. steps run one at a time in order on the optimizer thread.
 *
 * Data parallel (opt.comm, shard.c): each layer's gradient is reduce-scattered over the ranks
 * as it arrives, the norm adds every rank's parts, AdamW steps this rank's shard and the updated
 * weights are all-gathered into master[buf], all on this thread, in the same order on every rank.
 *
 * Owns: the flags under mu (param_ready, grad_consumed, grad_recorded, split_summed, folded_iter,
 * steps_queued, steps_done, shutdown, norm_hist, lr_hist), the optimizer thread, its AdamW tables
 * and norm parts. Buffers it touches: the Store (fp32 weights, m, v; the gradient set of the
 * step's iteration and, with split rounds, hsplit, added into it), master[buf] (the layers'
 * trainable tails, written by step k for iteration k + delay), base (a frozen base's bf16 copy,
 * written once by protocol_masters_init). Events: it synchronises on grad_ev / split_ev, records
 * none.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

// ----------------------------------------------------------------------------
// fences (controller side of the consistency protocol)

// Split rounds: round r >= 1 of iteration t downloads layer l into the one set of its round,
// which must hold no gradient of iteration t-1 that the optimizer has yet to add (controller side;
// it waits only for the optimizer's progress on iterations already enqueued).
void protocol_fence_split(Engine* e, int l, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->split_summed[l] < t - 1) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Whether every layer of a stage (and the tied head's source) holds iteration t's weights now.
int protocol_params_ready(Engine* e, const Stage* st, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    int ready = st->head_off < 0 || e->param_ready[0] >= t;
    for (int l = st->b; l < st->e && ready; l++) ready = e->param_ready[l] >= t;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return ready;
}

// Rule 2 for a whole stage, on the controller thread (sync mode).
void protocol_fence_params(Engine* e, const Stage* st, int64_t t) {
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
void protocol_param_fence_fn(void* arg) {
    const MbJob* j = arg;
    Engine* e = j->e;
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->param_ready[j->from] < j->t) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Rule 4: iteration t's gradients go into hgrad[t % n_hgrad], which the optimizer step of
// iteration t - n_hgrad's gradients may still be reading.
void protocol_fence_grads(Engine* e, const Stage* st, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    for (int l = st->b; l < st->e; l++)
        while (e->grad_consumed[l] < t - e->n_hgrad) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Whether layer l holds iteration t's weights now (a gated upload fences only the layers that
// do not).
int protocol_layer_ready(Engine* e, int l, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    const int ready = e->param_ready[l] >= t;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return ready;
}

// The final gradient download of a stage's layers for iteration t is enqueued (its events are
// recorded): the optimizer's step for that gradient may wait on them (rules 1 and 3).
void protocol_grads_recorded(Engine* e, const Stage* st, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    for (int l = st->b; l < st->e; l++) e->grad_recorded[l] = t;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Iteration t folds its tied gradient on a device: the optimizer skips its own fold for it. Set
// when the iteration's last stage is enqueued, before any of its final gradients is recorded.
void protocol_mark_device_fold(Engine* e, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    e->folded_iter[t % e->n_hgrad] = t;
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// ----------------------------------------------------------------------------
// optimizer thread

// Initial master buffers: both hold θ_0, converted in parallel chunks (16 G conversions for an
// 8 B model would otherwise take a quarter of a minute at start-up).
#define MASTER_CHUNK (1 << 22)

typedef struct MasterInit {
    Engine* e;
    int64_t* first;        // (NL + 1) first chunk of each layer
    int64_t* head_chunks;  // (NL) of which the frozen head's
} MasterInit;

// Bytes of layer l's frozen head as the base copy holds it (internal.h).
size_t protocol_head_held_bytes(const Engine* e, int l) {
    const TensorTable* tt = &e->m->tt;
    size_t bytes = 0;
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->owner_layer != l || d->tied_to >= 0 || d->trainable) continue;
        if (!(e->s->map_src && e->s->map_src[i])) bytes += quant_tensor_bytes(d, e->ab);
    }
    return bytes;
}

// A quantised base (quant.h): layer l's frozen head as uploaded, into base[l] in one task: each
// tensor's blocks from the Store, the others converted to the compute dtype, back to back.
static void pack_layer_head(Engine* e, int l) {
    const TensorTable* tt = &e->m->tt;
    if (!e->base[l]) e->base[l] = e->impl->host_alloc(protocol_head_held_bytes(e, l) + 64);
    char* dst = e->base[l];
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->owner_layer != l || d->tied_to >= 0 || d->trainable) continue;
        if (e->s->map_src && e->s->map_src[i]) continue;  // (--mmap-base: uploaded from the map)
        const float* src = e->s->param[l] + d->param_offset;
        if (d->qtype) {
            memcpy(dst, e->s->qblocks[i], quant_tensor_bytes(d, 0));
        } else if (e->s->base16) {  // (a streamed base: bf16 already)
            memcpy(dst, e->s->base16[l] + d->param_offset, (size_t)d->numel * sizeof(uint16_t));
        } else if (e->ab == 4) {
            memcpy(dst, src, (size_t)d->numel * sizeof(float));
        } else {
            uint16_t* h = (uint16_t*)dst;
            for (int64_t j = 0; j < d->numel; j++) h[j] = f32_to_bf16(src[j]);
        }
        dst += quant_tensor_bytes(d, e->ab);
    }
    if (!e->opt.release_frozen || e->s->map_src) return;
    // (on GPUs the engine's copy is the only one the run reads: the Store's goes, fp32 and blocks)
    store_release_range(e->s, l, 0, e->train_off[l]);
    if (e->s->base16) {
        free(e->s->base16[l]);
        e->s->base16[l] = NULL;
    }
    for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++)
        if (tt->t[i].qtype && tt->t[i].owner_layer == l) {
            free(e->s->qblocks[i]);
            e->s->qblocks[i] = NULL;
        }
}

// Chunk c of the layers' slabs: the frozen head's chunks of a layer come first, converted once
// into the base's bf16 copy (fp32 devices read the Store's slab itself), then its trainable
// tail's, into both masters.
static void master_init_chunk(void* arg, int64_t c) {
    const MasterInit* mi = arg;
    Engine* e = mi->e;
    int l = 0;
    while (mi->first[l + 1] <= c) l++;
    const int64_t k = c - mi->first[l], off = e->train_off[l];
    if (k < mi->head_chunks[l] && e->quant) {
        pack_layer_head(e, l);
        return;
    }
    if (k < mi->head_chunks[l]) {
        const int64_t b = k * MASTER_CHUNK, n = imin64(off - b, MASTER_CHUNK);
        if (e->ab == 2) {
            const float* src = e->s->param[l] + b;
            uint16_t* dst = (uint16_t*)e->base[l] + b;
            for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
            // the chunk's own whole pages (the pages it shares with a neighbour chunk, which
            // another thread may still be reading, go with store_release_frozen afterwards)
            if (e->opt.release_frozen) store_release_range(e->s, l, b, b + n);
        }
        return;
    }
    const int64_t b = (k - mi->head_chunks[l]) * MASTER_CHUNK;
    const int64_t n = imin64(e->m->tt.param_numel[l] - off - b, MASTER_CHUNK);
    const float* src = e->s->param[l] + off + b;
    for (int buf = 0; buf < 2; buf++) {
        if (e->ab == 4) {
            memcpy((float*)e->master[buf][l] + b, src, (size_t)n * sizeof(float));
        } else {
            uint16_t* dst = (uint16_t*)e->master[buf][l] + b;
            for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
        }
    }
}

void protocol_masters_init(Engine* e) {
    const int NL = e->NL;
    MasterInit mi = {e, calloc_check((size_t)NL + 1, sizeof(int64_t)), NULL};
    int64_t* head_chunks = calloc_check((size_t)NL, sizeof(int64_t));
    for (int l = 0; l < NL; l++) {
        const int64_t off = e->train_off[l], tail = e->m->tt.param_numel[l] - off;
        // (a streamed bf16 base: the Store's base16 is the copy, nothing to convert)
        head_chunks[l] = e->quant ? off > 0
                         : e->s->base16 ? 0
                                        : (off + MASTER_CHUNK - 1) / MASTER_CHUNK;
        mi.first[l + 1] = mi.first[l] + head_chunks[l] + (tail + MASTER_CHUNK - 1) / MASTER_CHUNK;
    }
    mi.head_chunks = head_chunks;
    threadpool_run(e->pool, mi.first[NL], master_init_chunk, &mi);
    free(head_chunks);
    free(mi.first);
}

// Layer l's trainable tail from the Store into master[buf] (fp32 devices; bf16 devices have the
// optimizer write it in the same pass).
static void write_master(Engine* e, int buf, int l) {
    const int64_t n = e->m->tt.param_numel[l] - e->train_off[l];
    const float* src = e->s->param[l] + e->train_off[l];
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
    for (int i = 0; i < e->n_opt; i++)
        e->opt_tensors[i].grad = g[e->opt_layer[i]] + e->opt_goffset[i];
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
            e->impl->event_synchronize(engine_grad_event(e, k - 1, r, l));
            FoldArgs fa = {g[l], engine_grad_host(e, k - 1, r, l), e->m->tt.grad_numel[l]};
            threadpool_run(e->pool, (fa.n + FOLD_CHUNK - 1) / FOLD_CHUNK, fold_chunk, &fa);
        }
        if (e->split) {
            pthread_check(pthread_mutex_lock(&e->mu));
            e->split_summed[l] = k - 1;
            pthread_check(pthread_cond_broadcast(&e->cv));
            pthread_check(pthread_mutex_unlock(&e->mu));
        }
        // data parallel: the layer's reduce-scatter over the ranks now, while the devices
        // still run the backward of the layers below
        if (!e->fold_owner[l] || dev_folded) {
            if (e->dp) shard_reduce_layer(e, g, l);
            else layer_norm_parts(e, l);
        }
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
        if (d->tied_to < 0 || !d->trainable) continue;  // (LoRA: a frozen head has no gradient)
        const TensorDesc* o = &tt->t[d->tied_to];
        // in parallel: a tied head is the largest tensor (300 M elements for Qwen3-1.7B), and
        // with two GPUs the next iteration waits for this step
        FoldArgs fa = {g[o->layer] + o->grad_offset, g[d->layer] + d->grad_offset, d->numel};
        threadpool_run(e->pool, (d->numel + FOLD_CHUNK - 1) / FOLD_CHUNK, fold_chunk, &fa);
    }
    for (int l = 0; l < NL && !dev_folded; l++) {
        if (!e->fold_owner[l]) continue;
        if (e->dp) shard_reduce_layer(e, g, l);
        else layer_norm_parts(e, l);
    }
    // the step's norm (the chunk sums in order; data parallel: every rank's), clip factor and
    // lr, for the run's step number
    const double norm_sq =
        e->dp ? shard_norm_sq(e, k) : adamw_norm_sq_total(e->norm_parts, e->norm_first[NL]);
    const AdamWUpdate u = adamw_update_begin(&e->opt.hyper, &e->opt.sched, e->opt.grad_clip,
                                             e->opt.start_step + k, norm_sq);
    const int buf = (int)((k + e->delay) % 2);
    // Shallow layers first: the next iteration's first forward stages need their weights first.
    // (Gradients never gate this order: with the delayed optimizer they are double-buffered, in
    // sync mode the next iteration starts after the step anyway.)
    for (int l = 0; l < NL; l++) {
        int first = e->layer_first_opt[l], count = e->layer_first_opt[l + 1] - first;
        if (e->dp) {
            // data parallel: this rank's shard, then every rank's into master[buf]
            shard_apply_layer(e, &u, buf, l);
            count = 0;
        } else if (e->ab == 2) {
            // bf16 devices: the step writes the bf16 master copy in the same pass
            for (int i = first; i < first + count; i++)
                e->opt_tensors[i].out_bf16 = (uint16_t*)e->master[buf][l] + e->opt_offset[i];
        }
        if (count > 0) adamw_update_apply(e->pool, &u, e->opt_tensors + first, count);
        if (e->opt.fake_optimizer_us > 0) {  // tests: a slow step, spread over the layers by size
            const int64_t us = e->opt.fake_optimizer_us * tt->param_numel[l] / e->m->tt.total_params;
            struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
            nanosleep(&ts, NULL);
        }
        if (e->ab != 2 && !e->dp) write_master(e, buf, l);
        pthread_check(pthread_mutex_lock(&e->mu));
        e->param_ready[l] = k + e->delay;
        e->grad_consumed[l] = k - 1;
        pthread_check(pthread_cond_broadcast(&e->cv));
        pthread_check(pthread_mutex_unlock(&e->mu));
    }
    e->s->step = u.step;
    if (e->trace) {
        char name[48];
        snprintf(name, sizeof name, "AdamW step %lld", (long long)u.step);
        trace_add(e->trace, name, e->N, STREAM_COUNT, t_start, time_now_s());
    }
    pthread_check(pthread_mutex_lock(&e->mu));
    e->steps_done = k;
    e->norm_hist[k % 4] = u.norm;
    e->lr_hist[k % 4] = u.hyper.lr;
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
// set-up, hand-over and teardown (controller side)

void protocol_init(Engine* e) {
    const int NL = e->NL;
    const TensorTable* tt = &e->m->tt;
    Store* s = e->s;
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
    if (e->split) {
        e->split_summed = calloc_check((size_t)NL, sizeof(int64_t));
        for (int l = 0; l < NL; l++) e->split_summed[l] = -1;
    }
    pthread_check(pthread_mutex_init(&e->mu, NULL));
    pthread_check(pthread_cond_init(&e->cv, NULL));

    // optimizer: AdamW tensors grouped by owner layer
    e->opt_tensors = malloc_check((size_t)tt->n * sizeof(AdamWTensor));
    e->n_opt = store_adamw_tensors(s, e->opt_tensors);
    e->layer_first_opt = calloc_check((size_t)NL + 1, sizeof(int));
    e->opt_offset = calloc_check((size_t)(e->n_opt > 0 ? e->n_opt : 1), sizeof(int64_t));
    e->opt_goffset = calloc_check((size_t)(e->n_opt > 0 ? e->n_opt : 1), sizeof(int64_t));
    e->opt_layer = calloc_check((size_t)(e->n_opt > 0 ? e->n_opt : 1), sizeof(int));
    {
        // store_adamw_tensors lists the owned trainable tensors in table order, which is layer
        // order; each has its own offsets in the layer's trainable tail (master) and gradient
        // slab (the same for full training; LoRA's gradient slabs hold the adapters only)
        int idx = 0, t_i = 0;
        for (int l = 0; l < NL; l++) {
            e->layer_first_opt[l] = idx;
            for (; t_i < tt->n && tt->t[t_i].layer == l; t_i++) {
                const TensorDesc* d = &tt->t[t_i];
                if (d->tied_to >= 0 || !d->trainable) continue;
                if (d->param_offset < e->train_off[l] || d->grad_offset < 0)
                    fatal("internal: trainable tensor %s outside its layer's trainable tail",
                          d->name);
                e->opt_layer[idx] = l;
                e->opt_goffset[idx] = d->grad_offset;
                e->opt_offset[idx++] = d->param_offset - e->train_off[l];
            }
        }
        if (idx != e->n_opt) fatal("internal: %d optimizer tensors, %d listed", e->n_opt, idx);
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
            if (tt->t[i].tied_to >= 0 && tt->t[i].trainable)
                e->fold_owner[tt->t[tt->t[i].tied_to].layer] = 1;
    }
    pthread_check(pthread_create(&e->opt_thread, NULL, optimizer_main, e));
}

// Hand the optimizer step for iteration t's gradient to the optimizer thread.
void protocol_queue_step(Engine* e, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    e->steps_queued = t + 1;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

void protocol_wait_step(Engine* e, int64_t k, double* norm, double* lr) {
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->steps_done < k) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    *norm = e->norm_hist[k % 4];
    *lr = e->lr_hist[k % 4];
    pthread_check(pthread_mutex_unlock(&e->mu));
}

void protocol_wait_steps(Engine* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    while (e->steps_done < e->steps_queued) pthread_check(pthread_cond_wait(&e->cv, &e->mu));
    pthread_check(pthread_mutex_unlock(&e->mu));
}

void protocol_free(Engine* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    e->shutdown = 1;
    pthread_check(pthread_cond_broadcast(&e->cv));
    pthread_check(pthread_mutex_unlock(&e->mu));
    pthread_check(pthread_join(e->opt_thread, NULL));
    free(e->split_summed);
    free(e->param_ready);
    free(e->grad_consumed);
    free(e->grad_recorded);
    free(e->opt_tensors);
    free(e->layer_first_opt);
    free(e->norm_first);
    free(e->norm_parts);
    free(e->fold_owner);
    free(e->opt_offset);
    free(e->opt_goffset);
    free(e->opt_layer);
    pthread_check(pthread_mutex_destroy(&e->mu));
    pthread_check(pthread_cond_destroy(&e->cv));
}

// ----------------------------------------------------------------------------
// accessors

const void* engine_next_weights(const Engine* e, int layer) {
    return e->master[e->iter % 2][layer];  // the trainable tail (the frozen base never changes)
}

const void* engine_latest_weights(Engine* e, int layer) {
    // step k wrote master[(k + delay) % 2] (the buffer of iteration k + delay)
    pthread_check(pthread_mutex_lock(&e->mu));
    const int64_t k = e->steps_done;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return e->master[(k + e->delay) % 2][layer];
}

int engine_weight_bytes(const Engine* e) { return (int)e->ab; }

void engine_last_update(Engine* e, double* norm, double* lr) {
    pthread_check(pthread_mutex_lock(&e->mu));
    const int64_t k = e->steps_done;
    *norm = k > 0 ? e->norm_hist[k % 4] : (e->opt.first_weights ? e->opt.first_norm : 0.0);
    *lr = k > 0 ? e->lr_hist[k % 4] : (e->opt.first_weights ? e->opt.first_lr : 0.0);
    pthread_check(pthread_mutex_unlock(&e->mu));
}

int64_t engine_steps_done(const Engine* e) { return e->steps_done; }
