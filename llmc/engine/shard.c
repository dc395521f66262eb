/*
 * shard.c — data parallel through the engine (docs/DISTRIBUTED.md §6): W ranks, each a RoundPipe
 * engine on its own devices, reduce each layer's gradient over the ranks as soon as this rank's
 * last backward of the layer has been downloaded (the optimizer thread takes the layers deepest
 * first, while the devices still run the backward of the layers below), step AdamW on this
 * rank's shard of every layer (ZeRO-1) and all-gather the updated compute-dtype weights into the
 * master buffer every rank uploads from.
 *
 * The layout (dp.h: dp_layer_shard). Layer l's optimizer tensors lie end to end in its gradient
 * slab and, at the same offsets, in its master buffers (the trainable tail), its m / v slabs and
 * its parameter slab from train_off[l]: the span [lo[l], lo[l] + n[l]) (a tied head's gradient
 * sits after them in the postfix, is folded into the embedding's before the embedding's layer is
 * reduced, and never travels). With LoRA the tensors are the layer's adapters, after its frozen
 * head: the base is every rank's own and never travels (docs/DISTRIBUTED.md §6.2). Rank r owns
 * comm_shard_range(n[l], W, r) of the span: one reduce-scatter and one all-gather per layer over
 * the span zero-padded to W blocks of ceil(n / W). This rank's shard, cut at the tensors'
 * boundaries, is its pieces: AdamW views whose param, m and v point into the Store, grad into the
 * step's gradient set, out_bf16 into the step's master buffer.
 *
 * The step, on the optimizer thread (protocol.c calls the parts in this order on every rank, so
 * the collectives form one sequence; all of them host buffers, CommStream NULL):
 *   1. per layer as it arrives: the reduce-scatter of the span (fp32, or bf16 on the wire with
 *      opt.reduce_bf16, summed in fp32), the shard's AdamW chunk sums of squares;
 *   2. one all-gather of every rank's chunk sums and its sums (doubles as pairs of fp32): its
 *      objective (per-token losses; MoE models: plus each micro-batch's weighted aux loss) and,
 *      for MoE models, its CE, aux x tokens and tokens per expert (docs/DISTRIBUTED.md §6.1);
 *      the norm adds the chunk sums layer by layer, in a layer rank by rank, each rank's in
 *      chunk order (W = 1: the engine's own order, bit for bit), every sum the ranks' in rank
 *      order: the same bits on every rank, so every rank clips alike;
 *   3. per layer, shallow first: AdamW on the shard, the all-gather of the updated weights in the
 *      compute dtype into master[buf]. On fp32 devices the gathered weights are the Store's fp32
 *      weights too; on bf16 devices the Store keeps its exact fp32 shard and, outside it, the
 *      gathered bf16 values widened (what a bf16 evaluation computes with anyway);
 *      engine_gather_state makes the fp32 weights exact, and m and v whole, on the rank that
 *      writes a checkpoint or the exports.
 *
 * Host memory (ZeRO-1): AdamW's m and v outside this rank's shard give their pages back as soon
 * as the engine has made its masters (shard_release_early, before the gradient sets beyond the
 * Store's are allocated), so they take 8 B / W per parameter instead of 8 B; so do the fp32
 * weights with opt.shard_weights (runs without a plain path for evaluation or sampling: 4 B / W
 * instead of 4 B; the Store outside the shard then stays stale until engine_gather_state). A
 * checkpoint is streamed: engine_gather_layer brings one layer's weights, m or v onto the
 * writing rank as it is written and gives the one before back, so that rank holds one layer
 * more, never the whole state. The gradient sets stay whole (the full gradient is downloaded,
 * then reduce-scattered on the host). llmc/memory.c counts all of this for the start-up check.
 *
 * Failures: the first failed collective's message (the comm's, naming the rank that died or hung)
 * is kept; the step goes on without collectives (every later op fails at once anyway), so no
 * fence waits forever, and engine_collect hands the message to the caller, which ends the run.
 *
 * Owns: e->dp, e->dp_crc. Buffers it touches: the step's gradient set (each layer's span), the
 * Store's fp32 weights (the trainable part), m and v, master[buf], the step iteration's host
 * losses and MoE statistics (read). Events: it synchronises on loss_ev of the step's iteration;
 * records none.
 */
#include <stdlib.h>
#include <string.h>

#include "../alloc.h"
#include "../crc32c.h"
#include "../dp.h"
#include "internal.h"

// The sums every rank adds to the norm's all-gather, each added over the ranks in rank order: the
// iteration's objective (its per-token losses; MoE models: plus the weighted aux loss times the
// micro-batches' tokens), and for MoE models the CE sum, the aux times tokens and the tokens per
// expert (E of them), so that the step line reports the global batch's.
enum { SHARD_SUM_LOSS, SHARD_SUM_CE, SHARD_SUM_AUX, SHARD_SUM_LOAD };

typedef struct EngineShard {
    Comm* c;
    int W, rank;
    CommDtype wire;         // the gradients on the wire (fp32, or bf16 summed in fp32)
    int64_t* lo;            // (NL) layer l's span in its slabs: [lo, lo + n)
    int64_t* n;
    int64_t* block;         // (NL) comm_shard_block(n, W)
    int64_t* off;           // (NL) this rank's shard of the span: [lo + off, lo + off + len)
    int64_t* len;
    AdamWTensor* piece;     // this rank's shard in pieces of the optimizer's tensors, by layer
    int* first;             // (NL + 1) layer l's pieces are [first[l], first[l + 1])
    int* src;               // (pieces) the optimizer tensor (e->opt_tensors) of each piece
    int64_t* at;            // (pieces) its first element within that tensor
    int64_t* parts_first;   // (W * (NL + 1)) rank r's chunk sums of layer l begin at
                            // parts[r * parts_block + parts_first[r * (NL + 1) + l]]
    int64_t parts_block;    // each rank's slot in parts: its chunk sums, then its sums
    int64_t sums_at;        // where the sums (n_sums of them) begin in a slot
    double* parts;          // (W * parts_block)
    void* buf;              // (max over l of W * block) fp32: the collectives' buffer
    int64_t shard_params;   // sum over l of len
    int gathered;           // engine_gather_layer: the layer whose pages outside the shard the
                            // writing rank holds now (-1: none)
    int n_sums;             // the sums each rank adds to the norm's all-gather (SHARD_SUM_*)
    // under e->mu
    double* sums[4];        // [k % 4] (n_sums) the global sums of step k's iteration (k - 1)
    double* load_out;       // (E) MoE models: the collected iteration's loads (engine_collect)
    int failed;
    char err[ERR_LEN];
} EngineShard;

// ----------------------------------------------------------------------------
// set-up

// Layer l's optimizer tensors and their gradient-slab offsets (protocol.c groups them by layer).
static int layer_pieces(const Engine* e, int l, int rank, AdamWTensor* out, int* src,
                        int64_t* at) {
    const int first = e->layer_first_opt[l];
    const int n = dp_layer_shard(e->opt_tensors + first, e->opt_goffset + first,
                                 e->layer_first_opt[l + 1] - first, e->dp->W, rank, out, src, at);
    for (int p = 0; src && p < n; p++) src[p] += first;
    return n;
}

int shard_init(Engine* e, char* err) {
    Comm* c = e->opt.comm;
    const Model* m = e->m;
    const int NL = e->NL;
    // A layer's optimizer tensors (all of them; LoRA: its adapters, after the frozen base in the
    // parameter slab) lie at the same offsets in its gradient slab, its trainable tail (the
    // masters; the Store's parameter slab from train_off) and its m / v slabs: one span per layer
    // serves every collective. The frozen base is the same on every rank and never travels.
    for (int i = 0; i < e->n_opt; i++) {
        const int l = e->opt_layer[i];
        const AdamWTensor* t = &e->opt_tensors[i];
        const int64_t g = e->opt_goffset[i];
        if (e->opt_offset[i] != g || t->param != e->s->param[l] + e->train_off[l] + g ||
            t->m != e->s->m[l] + g || t->v != e->s->v[l] + g)
            return errorf(err, "data parallel: a tensor's weights and gradient are laid out "
                               "differently (internal error)");
    }
    EngineShard* d = calloc_check(1, sizeof(EngineShard));
    e->dp = d;
    d->c = c;
    d->W = c->world;
    d->rank = c->rank;
    d->gathered = -1;
    d->wire = e->opt.reduce_bf16 ? COMM_BF16 : COMM_F32;
    d->lo = calloc_check((size_t)NL, sizeof(int64_t));
    d->n = calloc_check((size_t)NL, sizeof(int64_t));
    d->block = calloc_check((size_t)NL, sizeof(int64_t));
    d->off = calloc_check((size_t)NL, sizeof(int64_t));
    d->len = calloc_check((size_t)NL, sizeof(int64_t));
    const size_t cap = (size_t)(e->n_opt > 0 ? e->n_opt : 1);
    d->piece = calloc_check(cap, sizeof(AdamWTensor));
    d->src = calloc_check(cap, sizeof(int));
    d->at = calloc_check(cap, sizeof(int64_t));
    d->first = calloc_check((size_t)NL + 1, sizeof(int));
    d->parts_first = calloc_check((size_t)d->W * (NL + 1), sizeof(int64_t));
    AdamWTensor* tmp = calloc_check(cap, sizeof(AdamWTensor));
    int64_t max_wb = 1;
    for (int l = 0; l < NL; l++) {
        const int first = e->layer_first_opt[l];
        dp_layer_span(e->opt_tensors + first, e->opt_goffset + first,
                      e->layer_first_opt[l + 1] - first, &d->lo[l], &d->n[l]);
        d->block[l] = (int64_t)comm_shard_block((size_t)d->n[l], d->W);
        size_t off, len;
        comm_shard_range((size_t)d->n[l], d->W, d->rank, &off, &len);
        d->off[l] = (int64_t)off;
        d->len[l] = (int64_t)len;
        d->shard_params += d->len[l];
        if (d->W * d->block[l] > max_wb) max_wb = d->W * d->block[l];
        d->first[l + 1] = d->first[l] + layer_pieces(e, l, d->rank, d->piece + d->first[l],
                                                     d->src + d->first[l], d->at + d->first[l]);
    }
    // every rank's chunk sums per layer (the norm adds them in layer, then rank order)
    int64_t most = 0;
    for (int r = 0; r < d->W; r++) {
        int64_t* pf = d->parts_first + (size_t)r * (NL + 1);
        for (int l = 0; l < NL; l++)
            pf[l + 1] = pf[l] + adamw_chunk_count(tmp, layer_pieces(e, l, r, tmp, NULL, NULL));
        if (pf[NL] > most) most = pf[NL];
    }
    free(tmp);
    d->n_sums = m->n_moe > 0 ? SHARD_SUM_LOAD + m->cfg.E : SHARD_SUM_LOSS + 1;
    d->sums_at = most;
    d->parts_block = most + d->n_sums;
    d->parts = calloc_check((size_t)d->W * (size_t)d->parts_block, sizeof(double));
    for (int k = 0; k < 4; k++) d->sums[k] = calloc_check((size_t)d->n_sums, sizeof(double));
    if (m->n_moe > 0) d->load_out = calloc_check((size_t)m->cfg.E, sizeof(double));
    d->buf = malloc_named((size_t)max_wb * sizeof(float),
                          "the data-parallel collective buffer (the largest layer, fp32)");
    // every rank starts from the same weights (nothing is broadcast): their checksums compared
    // (taken before the pages outside the shard went: shard_release_early)
    uint32_t crc = e->dp_crc;
    for (int i = 0; i < e->n_opt && !e->dp_crc_set; i++)
        crc = crc32c_update(crc, e->opt_tensors[i].param, e->opt_tensors[i].n * sizeof(float));
    if (dp_check_same_crc(c, crc, err) != 0) return -1;
    // ZeRO-1: AdamW's m and v (and with opt.shard_weights the fp32 weights) outside this rank's
    // shard give their memory back (the Store allocated, zeroed or loaded them whole; the
    // masters hold the weights; nothing reads the rest until engine_gather_state)
    engine_release_state(e);
    return 0;
}

void shard_release_early(Engine* e) {
    const TensorTable* tt = &e->m->tt;
    const Comm* c = e->opt.comm;
    // the checksum shard_init compares, over the optimizer's tensors in its order (the same list
    // protocol_init makes)
    AdamWTensor* t = malloc_check((size_t)(tt->n > 0 ? tt->n : 1) * sizeof(AdamWTensor));
    const int n = store_adamw_tensors(e->s, t);
    uint32_t crc = 0;
    for (int i = 0; i < n; i++) crc = crc32c_update(crc, t[i].param, t[i].n * sizeof(float));
    free(t);
    e->dp_crc = crc;
    e->dp_crc_set = 1;
    int64_t* lo = malloc_check((size_t)tt->n_layers * sizeof(int64_t));
    int64_t* hi = malloc_check((size_t)tt->n_layers * sizeof(int64_t));
    dp_engine_state_ranges(tt, c->world, c->rank, lo, hi);  // (shard_init's shard, checked there)
    for (int l = 0; l < tt->n_layers; l++) {
        store_release_state(e->s, l, 0, lo[l], e->opt.shard_weights);
        store_release_state(e->s, l, hi[l], tt->state_numel[l], e->opt.shard_weights);
    }
    free(lo);
    free(hi);
}

void shard_free(Engine* e) {
    EngineShard* d = e->dp;
    if (!d) return;
    free(d->lo);
    free(d->n);
    free(d->block);
    free(d->off);
    free(d->len);
    free(d->piece);
    free(d->first);
    free(d->src);
    free(d->at);
    free(d->parts_first);
    free(d->parts);
    for (int k = 0; k < 4; k++) free(d->sums[k]);
    free(d->load_out);
    free(d->buf);
    free(d);
    e->dp = NULL;
}

int64_t engine_shard_params(const Engine* e) {
    return e->dp ? e->dp->shard_params : (int64_t)e->m->tt.trainable_params;
}

// ----------------------------------------------------------------------------
// failures

// Keep the first failure (the comm's message names the rank); later collectives are skipped.
static void shard_fail(Engine* e, const char* what) {
    EngineShard* d = e->dp;
    char buf[ERR_LEN];
    const char* msg = comm_error(d->c, buf, sizeof buf);
    pthread_check(pthread_mutex_lock(&e->mu));
    if (!d->failed) {
        d->failed = 1;
        snprintf(d->err, sizeof d->err, "data parallel: %s failed: %s", what,
                 msg ? msg : "(no message)");
    }
    pthread_check(pthread_mutex_unlock(&e->mu));
}

// Only the optimizer thread (or the controller while the engine is synchronized) sets it.
static int shard_failed(Engine* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    const int f = e->dp->failed;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return f;
}

const char* shard_error(Engine* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    const char* msg = e->dp->failed ? e->dp->err : NULL;
    pthread_check(pthread_mutex_unlock(&e->mu));
    return msg;
}

double shard_loss(Engine* e, int64_t t) {
    pthread_check(pthread_mutex_lock(&e->mu));
    const double sum = e->dp->sums[(t + 1) % 4][SHARD_SUM_LOSS];
    pthread_check(pthread_mutex_unlock(&e->mu));
    return sum;
}

void shard_moe_stats(Engine* e, int64_t t, EngineStepResult* res) {
    EngineShard* d = e->dp;
    if (d->n_sums <= SHARD_SUM_LOAD) return;
    pthread_check(pthread_mutex_lock(&e->mu));
    const double* g = d->sums[(t + 1) % 4];
    res->ce_sum = g[SHARD_SUM_CE];
    res->aux_sum = g[SHARD_SUM_AUX];
    memcpy(d->load_out, g + SHARD_SUM_LOAD, (size_t)e->m->cfg.E * sizeof(double));
    pthread_check(pthread_mutex_unlock(&e->mu));
    res->load = d->load_out;
}

// ----------------------------------------------------------------------------
// the step (optimizer thread)

void shard_reduce_layer(Engine* e, float** g, int l) {
    EngineShard* d = e->dp;
    for (int p = d->first[l]; p < d->first[l + 1]; p++)
        d->piece[p].grad = g[l] + e->opt_goffset[d->src[p]] + d->at[p];
    const int64_t n = d->n[l], blk = d->block[l], len = d->len[l];
    const double t0 = time_now_s();
    if (n > 0 && !shard_failed(e)) {
        const float* span = g[l] + d->lo[l];
        float* mine = g[l] + d->lo[l] + d->off[l];
        const size_t padded = (size_t)d->W * (size_t)blk;
        int rc;
        if (d->wire == COMM_F32) {
            float* b = d->buf;
            memcpy(b, span, (size_t)n * sizeof(float));
            memset(b + n, 0, (padded - (size_t)n) * sizeof(float));
            rc = comm_reduce_scatter(d->c, b, b + (size_t)d->rank * blk, (size_t)blk, COMM_F32,
                                     NULL);
            if (rc == 0) memcpy(mine, b + (size_t)d->rank * blk, (size_t)len * sizeof(float));
        } else {
            // bf16 on the wire (rounded once here), summed in fp32 (the emulation; NCCL rounds
            // after every addition, docs/DISTRIBUTED.md §4)
            uint16_t* b = d->buf;
            for (int64_t i = 0; i < n; i++) b[i] = f32_to_bf16(span[i]);
            memset(b + n, 0, (padded - (size_t)n) * sizeof(uint16_t));
            rc = comm_reduce_scatter(d->c, b, b + (size_t)d->rank * blk, (size_t)blk, COMM_BF16,
                                     NULL);
            const uint16_t* r = b + (size_t)d->rank * blk;
            for (int64_t i = 0; rc == 0 && i < len; i++) mine[i] = bf16_to_f32(r[i]);
        }
        if (rc != 0) shard_fail(e, "the gradients' reduce-scatter");
        if (e->trace) {  // (the optimizer's row of the trace: the overlap with the backward)
            char name[48];
            snprintf(name, sizeof name, "reduce-scatter layer %d", l);
            trace_add(e->trace, name, e->N, STREAM_COUNT, t0, time_now_s());
        }
    }
    double* sums = d->parts + (size_t)d->rank * d->parts_block +
                   d->parts_first[(size_t)d->rank * (e->NL + 1) + l];
    adamw_grad_norm_sq_parts(e->pool, d->piece + d->first[l], d->first[l + 1] - d->first[l],
                             sums);
}

// This rank's sums of iteration k-1 (its micro-batches in engine_collect's order) into out.
static void local_sums(Engine* e, int64_t k, double* out) {
    const int n_sums = e->dp->n_sums, E = e->m->cfg.E;
    const int ip = (int)((k - 1) % 2);
    memset(out, 0, (size_t)n_sums * sizeof(double));
    float* counts = n_sums > SHARD_SUM_LOAD ? malloc_check((size_t)E * sizeof(float)) : NULL;
    for (int i = 0; i < e->M; i++) {
        e->impl->event_synchronize(e->loss_ev[ip][i]);
        if (counts) {
            // MoE: the micro-batch's objective with its aux loss, as engine_collect adds it
            double ce, aux_tokens;
            out[SHARD_SUM_LOSS] += mb_moe_objective(e, ip, i, &ce, &aux_tokens, counts);
            out[SHARD_SUM_CE] += ce;
            out[SHARD_SUM_AUX] += aux_tokens;
            for (int x = 0; x < E; x++) out[SHARD_SUM_LOAD + x] += counts[x];
            continue;
        }
        const size_t tok = (size_t)mb_rows(e, i) * e->T;
        for (size_t x = 0; x < tok; x++) out[SHARD_SUM_LOSS] += e->hloss[ip][i][x];
    }
    free(counts);
}

double shard_norm_sq(Engine* e, int64_t k) {
    EngineShard* d = e->dp;
    const int NL = e->NL;
    double* mine = d->parts + (size_t)d->rank * d->parts_block;
    local_sums(e, k, mine + d->sums_at);
    if (!shard_failed(e)) {
        // (doubles as pairs of fp32: an all-gather copies bits exactly)
        const size_t n_f = (size_t)d->parts_block * (sizeof(double) / sizeof(float));
        if (comm_all_gather(d->c, mine, d->parts, n_f, COMM_F32, NULL) != 0)
            shard_fail(e, "the all-gather of the gradient norm's parts and the loss");
    }
    double norm_sq = 0.0;
    for (int l = 0; l < NL; l++)
        for (int r = 0; r < d->W; r++) {
            const int64_t* pf = d->parts_first + (size_t)r * (NL + 1);
            for (int64_t c = pf[l]; c < pf[l + 1]; c++)
                norm_sq += d->parts[(size_t)r * d->parts_block + c];
        }
    pthread_check(pthread_mutex_lock(&e->mu));
    double* g = d->sums[k % 4];
    for (int j = 0; j < d->n_sums; j++) {
        g[j] = 0.0;
        for (int r = 0; r < d->W; r++)
            g[j] += d->parts[(size_t)r * d->parts_block + d->sums_at + j];
    }
    pthread_check(pthread_mutex_unlock(&e->mu));
    return norm_sq;
}

// Whether every rank keeps layer l's fp32 weights whole (updated outside its shard from the
// all-gather): unless opt.shard_weights gives their pages back. LoRA's adapters (a layer with a
// frozen head) stay whole: store_release_state keeps them, and they are few.
static int keeps_weights(const Engine* e, int l) {
    return !e->opt.shard_weights || e->train_off[l] > 0;
}

void shard_apply_layer(Engine* e, const AdamWUpdate* u, int buf, int l) {
    EngineShard* d = e->dp;
    const int first = d->first[l], count = d->first[l + 1] - first;
    for (int p = first; p < first + count; p++)
        d->piece[p].out_bf16 = e->ab == 2 ? (uint16_t*)e->master[buf][l] +
                                                e->opt_offset[d->src[p]] + d->at[p]
                                          : NULL;
    if (count > 0) adamw_update_apply(e->pool, u, d->piece + first, count);
    const int64_t n = d->n[l], blk = d->block[l], lo = d->lo[l], off = d->off[l], len = d->len[l];
    if (n == 0 || shard_failed(e)) return;
    float* param = e->s->param[l] + e->train_off[l] + lo;
    const int whole = keeps_weights(e, l);
    if (e->ab == 4) {
        // fp32 devices: the updated fp32 weights are the masters and the Store's
        float* b = d->buf;
        float* mine = b + (size_t)d->rank * blk;
        memcpy(mine, param + off, (size_t)len * sizeof(float));
        memset(mine + len, 0, (size_t)(blk - len) * sizeof(float));
        if (comm_all_gather(d->c, mine, b, (size_t)blk, COMM_F32, NULL) != 0) {
            shard_fail(e, "the all-gather of the updated weights");
            return;
        }
        memcpy((float*)e->master[buf][l] + lo, b, (size_t)n * sizeof(float));
        if (whole) memcpy(param, b, (size_t)n * sizeof(float));
    } else {
        uint16_t* b = d->buf;
        uint16_t* mine = b + (size_t)d->rank * blk;
        uint16_t* master = (uint16_t*)e->master[buf][l] + lo;
        memcpy(mine, master + off, (size_t)len * sizeof(uint16_t));
        memset(mine + len, 0, (size_t)(blk - len) * sizeof(uint16_t));
        const double t0 = time_now_s();
        if (comm_all_gather(d->c, mine, b, (size_t)blk, COMM_BF16, NULL) != 0) {
            shard_fail(e, "the all-gather of the updated weights");
            return;
        }
        if (e->trace) {
            char name[48];
            snprintf(name, sizeof name, "all-gather layer %d", l);
            trace_add(e->trace, name, e->N, STREAM_COUNT, t0, time_now_s());
        }
        memcpy(master, b, (size_t)n * sizeof(uint16_t));
        // the Store outside the shard: the gathered values widened (exact: engine_gather_state)
        for (int64_t i = 0; i < off && whole; i++) param[i] = bf16_to_f32(b[i]);
        for (int64_t i = off + len; i < n && whole; i++)
            param[i] = bf16_to_f32(b[i]);
    }
}

// ----------------------------------------------------------------------------
// the whole state on every rank (controller, the engine synchronized)

// Layer l's pages of m and v (and with opt.shard_weights of the fp32 weights) outside the shard.
static void release_layer(Engine* e, int l) {
    const EngineShard* d = e->dp;
    const int w = e->opt.shard_weights;
    store_release_state(e->s, l, 0, d->lo[l] + d->off[l], w);
    store_release_state(e->s, l, d->lo[l] + d->off[l] + d->len[l], e->m->tt.state_numel[l], w);
}

void engine_release_state(Engine* e) {
    EngineShard* d = e->dp;
    if (!d) return;
    for (int l = 0; l < e->NL; l++) release_layer(e, l);
    d->gathered = -1;
}

// Field f of layer l (0 the fp32 weights, 1 m, 2 v) over its span, all-gathered; kept in the
// Store with keep. -1 once a collective failed (shard_error has the message).
static int gather_field(Engine* e, int l, int f, int keep) {
    EngineShard* d = e->dp;
    const int64_t n = d->n[l], blk = d->block[l];
    if (shard_failed(e)) return -1;
    if (n == 0) return 0;
    float* fields[3] = {e->s->param[l] + e->train_off[l], e->s->m[l], e->s->v[l]};
    float* x = fields[f] + d->lo[l];
    float* b = d->buf;
    float* mine = b + (size_t)d->rank * blk;
    memcpy(mine, x + d->off[l], (size_t)d->len[l] * sizeof(float));
    memset(mine + d->len[l], 0, (size_t)(blk - d->len[l]) * sizeof(float));
    if (comm_all_gather(d->c, mine, b, (size_t)blk, COMM_F32, NULL) != 0) {
        shard_fail(e, "the all-gather of the weights and AdamW's state");
        return -1;
    }
    if (keep) memcpy(x, b, (size_t)n * sizeof(float));
    return 0;
}

int shard_gather_state(Engine* e, int root, int with_state, char* err) {
    EngineShard* d = e->dp;
    if (!d) return 0;
    const int keep = root < 0 || root == d->rank;
    for (int l = 0; l < e->NL; l++)
        for (int f = 0; f < (with_state ? 3 : 1); f++)
            if (gather_field(e, l, f, keep) != 0) break;
    const char* msg = shard_error(e);
    return msg ? errorf(err, "%s", msg) : 0;
}

int engine_gather_layer(Engine* e, int field, int l, int root, char* err) {
    EngineShard* d = e->dp;
    if (!d) return 0;
    const int keep = root == d->rank;
    // the layer gathered before goes back to its shard: the writer holds one layer more
    if (keep && d->gathered >= 0 && d->gathered != l) release_layer(e, d->gathered);
    d->gathered = l;
    gather_field(e, l, field, keep);
    const char* msg = shard_error(e);
    return msg ? errorf(err, "%s", msg) : 0;
}
