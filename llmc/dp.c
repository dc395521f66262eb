/*
 * dp.c — data parallelism on the plain path, over comm.h: the shard layout of the optimizer's
 * tensors, the ZeRO-1 optimizer step (fp32 reduce-scatter in rank order, the global norm from the
 * ranks' chunk sums, AdamW on this rank's shard, all-gather of the updated weights), the global
 * loss, and each rank's rows and micro-batches of the global batch. dp.h has the grouping and the
 * layout; every collective here runs on host buffers (CommStream NULL), so the same code runs on
 * the emulated ranks (threads) and on NCCL (staged through the rank's GPU).
 */
#include "dp.h"

#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "common.h"
#include "crc32c.h"

// ----------------------------------------------------------------------------
// the layout

int dp_layout_create(DpLayout* d, const Store* s, int world, int rank, char* err) {
    memset(d, 0, sizeof *d);
    if (world < 1 || rank < 0 || rank >= world)
        return errorf(err, "data parallel: rank %d of world size %d", rank, world);
    d->world = world;
    d->rank = rank;
    d->t = malloc_check((size_t)(s->tt->n > 0 ? s->tt->n : 1) * sizeof(AdamWTensor));
    d->n_tensors = store_adamw_tensors(s, d->t);
    d->offset = malloc_check((size_t)(d->n_tensors + 1) * sizeof(size_t));
    d->offset[0] = 0;
    for (int i = 0; i < d->n_tensors; i++) d->offset[i + 1] = d->offset[i] + d->t[i].n;
    d->n = d->offset[d->n_tensors];
    // rank r starts at the first chunk starting at or after r·n/W (chunks never span tensors,
    // as adamw.c cuts them), so every shard begins and ends on a chunk boundary
    d->lo = malloc_check((size_t)(world + 1) * sizeof(size_t));
    d->chunk_lo = malloc_check((size_t)(world + 1) * sizeof(int64_t));
    d->lo[0] = 0;
    d->chunk_lo[0] = 0;
    int r = 1;
    int64_t k = 0;
    for (int i = 0; i < d->n_tensors; i++) {
        for (size_t c0 = 0; c0 < d->t[i].n; c0 += ADAMW_CHUNK, k++) {
            const size_t f = d->offset[i] + c0;
            while (r < world && f >= (size_t)((uint64_t)r * d->n / (uint64_t)world)) {
                d->lo[r] = f;
                d->chunk_lo[r] = k;
                r++;
            }
        }
    }
    for (; r <= world; r++) {
        d->lo[r] = d->n;
        d->chunk_lo[r] = k;
    }
    d->block = 1;
    d->chunk_block = 1;
    for (r = 0; r < world; r++) {
        if (d->lo[r + 1] - d->lo[r] > d->block) d->block = d->lo[r + 1] - d->lo[r];
        if (d->chunk_lo[r + 1] - d->chunk_lo[r] > d->chunk_block)
            d->chunk_block = d->chunk_lo[r + 1] - d->chunk_lo[r];
    }
    d->send = malloc_named((size_t)world * d->block * sizeof(float),
                           "the data-parallel gradient buffer (one fp32 gradient set)");
    d->gather = malloc_named((size_t)world * d->block * sizeof(float),
                             "the data-parallel weight buffer (one fp32 weight set)");
    d->sums = malloc_check((size_t)world * (size_t)d->chunk_block * sizeof(double));
    // this rank's shard: the pieces of the tensors inside [lo, hi), the gradient in its block
    const size_t lo = d->lo[rank], hi = d->lo[rank + 1];
    d->shard = malloc_check((size_t)(d->n_tensors > 0 ? d->n_tensors : 1) * sizeof(AdamWTensor));
    float* mine = d->send + (size_t)rank * d->block;
    for (int i = 0; i < d->n_tensors; i++) {
        const size_t a = d->offset[i] > lo ? d->offset[i] : lo;
        const size_t b = d->offset[i + 1] < hi ? d->offset[i + 1] : hi;
        if (a >= b) continue;
        const size_t in_t = a - d->offset[i];
        d->shard[d->n_shard++] = (AdamWTensor){
            .param = d->t[i].param + in_t, .grad = mine + (a - lo), .m = d->t[i].m + in_t,
            .v = d->t[i].v + in_t, .n = b - a, .decay = d->t[i].decay, .out_bf16 = NULL};
    }
    if (adamw_chunk_count(d->shard, d->n_shard) != d->chunk_lo[rank + 1] - d->chunk_lo[rank]) {
        dp_layout_free(d);
        return errorf(err, "data parallel: the shard of rank %d does not follow the AdamW chunks "
                           "(internal error)", rank);
    }
    return 0;
}

void dp_layout_free(DpLayout* d) {
    free(d->t);
    free(d->offset);
    free(d->lo);
    free(d->chunk_lo);
    free(d->shard);
    free(d->send);
    free(d->gather);
    free(d->sums);
    memset(d, 0, sizeof *d);
}

// ----------------------------------------------------------------------------
// flat ranges of the store's tensors

typedef enum { DP_PARAM, DP_GRAD, DP_M, DP_V } DpField;

static float* field_of(const AdamWTensor* t, DpField f) {
    switch (f) {
        case DP_PARAM: return t->param;
        case DP_GRAD: return (float*)t->grad;  // read only (packing)
        case DP_M: return t->m;
        case DP_V: return t->v;
    }
    return NULL;
}

// Copy flat [lo, hi) of field f between the store's tensors and buf (out: store -> buf).
static void copy_flat(const DpLayout* d, DpField f, size_t lo, size_t hi, float* buf, int out) {
    for (int i = 0; i < d->n_tensors; i++) {
        const size_t a = d->offset[i] > lo ? d->offset[i] : lo;
        const size_t b = d->offset[i + 1] < hi ? d->offset[i + 1] : hi;
        if (a >= b) continue;
        float* x = field_of(&d->t[i], f) + (a - d->offset[i]);
        if (out) memcpy(buf + (a - lo), x, (b - a) * sizeof(float));
        else memcpy(x, buf + (a - lo), (b - a) * sizeof(float));
    }
}

// Every rank's block of field f into the collective buffer buf (world * block), zero-padded.
static void pack_all(const DpLayout* d, DpField f, float* buf) {
    for (int r = 0; r < d->world; r++) {
        float* blk = buf + (size_t)r * d->block;
        const size_t len = d->lo[r + 1] - d->lo[r];
        copy_flat(d, f, d->lo[r], d->lo[r + 1], blk, 1);
        memset(blk + len, 0, (d->block - len) * sizeof(float));
    }
}

static int comm_failed(Comm* c, const char* what, char* err) {
    char buf[ERR_LEN];
    const char* e = comm_error(c, buf, sizeof buf);
    return errorf(err, "data parallel: %s failed: %s", what, e ? e : "(no message)");
}

// This rank's shard of field f to every rank (all-gather), into every rank's store.
static int gather_field(DpLayout* d, Comm* c, DpField f, char* err) {
    float* mine = d->gather + (size_t)d->rank * d->block;
    const size_t len = d->lo[d->rank + 1] - d->lo[d->rank];
    copy_flat(d, f, d->lo[d->rank], d->lo[d->rank + 1], mine, 1);
    memset(mine + len, 0, (d->block - len) * sizeof(float));
    if (comm_all_gather(c, mine, d->gather, d->block, COMM_F32, NULL) != 0)
        return comm_failed(c, "the all-gather of the updated weights", err);
    for (int r = 0; r < d->world; r++)
        copy_flat(d, f, d->lo[r], d->lo[r + 1], d->gather + (size_t)r * d->block, 0);
    return 0;
}

// ----------------------------------------------------------------------------
// the step

AdamWUpdate dp_step(DpLayout* d, Comm* c, ThreadPool* pool, const AdamWHyper* h,
                    const LrSchedule* sched, float grad_clip, int64_t step, int* failed,
                    char* err) {
    AdamWUpdate u = {0};
    *failed = 1;
    // 1. the gradients: rank r's block of every rank summed in rank order, into r's block
    pack_all(d, DP_GRAD, d->send);
    float* mine = d->send + (size_t)d->rank * d->block;
    if (comm_reduce_scatter(c, d->send, mine, d->block, COMM_F32, NULL) != 0) {
        comm_failed(c, "the gradients' reduce-scatter", err);
        return u;
    }
    // 2. the global norm: each rank's chunk sums, gathered (as the doubles' bits) and added in
    // global chunk order, the same bits as adamw_grad_norm_sq over the whole model
    double* my_sums = d->sums + (size_t)d->rank * d->chunk_block;
    memset(my_sums, 0, (size_t)d->chunk_block * sizeof(double));
    adamw_grad_norm_sq_parts(pool, d->shard, d->n_shard, my_sums);
    const size_t n_f = (size_t)d->chunk_block * (sizeof(double) / sizeof(float));
    if (comm_all_gather(c, my_sums, d->sums, n_f, COMM_F32, NULL) != 0) {
        comm_failed(c, "the all-gather of the gradient norm's parts", err);
        return u;
    }
    double norm_sq = 0.0;
    for (int r = 0; r < d->world; r++)
        for (int64_t k = 0; k < d->chunk_lo[r + 1] - d->chunk_lo[r]; k++)
            norm_sq += d->sums[(size_t)r * d->chunk_block + k];
    // 3. AdamW on this rank's shard; 4. the updated weights to every rank
    u = adamw_update_begin(h, sched, grad_clip, step, norm_sq);
    adamw_update_apply(pool, &u, d->shard, d->n_shard);
    if (gather_field(d, c, DP_PARAM, err) != 0) return u;
    *failed = 0;
    return u;
}

int dp_check_same_weights(DpLayout* d, Comm* c, char* err) {
    // one CRC-32C per rank of all its trainable weights
    uint32_t crc = 0;
    for (int i = 0; i < d->n_tensors; i++)
        crc = crc32c_update(crc, d->t[i].param, d->t[i].n * sizeof(float));
    return dp_check_same_crc(c, crc, err);
}

int dp_check_same_crc(Comm* c, uint32_t crc, char* err) {
    // gathered as fp32 bits
    uint32_t* all = malloc_check((size_t)c->world * sizeof(uint32_t));
    all[c->rank] = crc;
    if (comm_all_gather(c, all + c->rank, all, 1, COMM_F32, NULL) != 0) {
        free(all);
        return comm_failed(c, "the all-gather of the weights' checksums", err);
    }
    int bad = -1;
    for (int r = 1; r < c->world && bad < 0; r++)
        if (all[r] != all[0]) bad = r;
    free(all);
    if (bad >= 0)
        return errorf(err, "data parallel: rank %d starts from other weights than rank 0 (start "
                           "every rank with the same --model, --seed and --resume)", bad);
    return 0;
}

int dp_gather_state(DpLayout* d, Comm* c, char* err) {
    if (gather_field(d, c, DP_M, err) != 0) return -1;
    return gather_field(d, c, DP_V, err);
}

int dp_sum_double(Comm* c, double local, double* out, char* err) {
    double* all = malloc_check((size_t)c->world * sizeof(double));
    all[c->rank] = local;
    const size_t n_f = sizeof(double) / sizeof(float);
    if (comm_all_gather(c, all + c->rank, all, n_f, COMM_F32, NULL) != 0) {
        free(all);
        return comm_failed(c, "the all-gather of the loss", err);
    }
    double sum = 0.0;
    for (int r = 0; r < c->world; r++) sum += all[r];
    free(all);
    *out = sum;
    return 0;
}

void dp_take_rows(const int32_t* tokens, int B, int T, int world, int rank, int32_t* out) {
    const size_t row = (size_t)T + 1;
    for (int i = 0; i < B / world; i++)
        memcpy(out + (size_t)i * row, tokens + (size_t)(rank + i * world) * row,
               row * sizeof(int32_t));
}

int dp_check_batch(int B, int M, int world, char* err) {
    if (B % world != 0)
        return errorf(err, "--batch %d does not divide by the world size %d (each rank takes "
                           "B / W sequences of the global batch)", B, world);
    if (M % world != 0)
        return errorf(err, "--micro-batches %d does not divide by the world size %d (each rank "
                           "runs M / W of them: give --micro-batches %d or a multiple)", M, world,
                      world);
    return 0;
}

double dp_rank_gradients(Plain* p, const int32_t* tokens, int B, int T, int M, int world,
                         int rank, int32_t* rows) {
    const int Br = B / world, Mr = M / world;
    const size_t row = (size_t)T + 1;
    dp_take_rows(tokens, B, T, world, rank, rows);
    // the gradient of the global step's mean loss: every micro-batch over B·T, as plain training
    const float grad_scale = 1.0f / ((float)B * (float)T);
    double loss_sum = 0.0;
    store_zero_grads(p->s);
    int first = 0;
    for (int mb = 0; mb < Mr; mb++) {
        const int n = Br / Mr + (mb < Br % Mr ? 1 : 0);
        loss_sum += plain_forward_backward(p, rows + (size_t)first * row, n, T, grad_scale);
        first += n;
    }
    plain_sync_grads(p);
    store_fold_tied_grads(p->s);
    return loss_sum;
}

// ----------------------------------------------------------------------------
// the engine's shard layout

void dp_layer_span(const AdamWTensor* t, const int64_t* goff, int n, int64_t* lo, int64_t* len) {
    *lo = n > 0 ? goff[0] : 0;
    *len = n > 0 ? goff[n - 1] + (int64_t)t[n - 1].n - goff[0] : 0;
}

int dp_layer_shard(const AdamWTensor* t, const int64_t* goff, int n, int world, int rank,
                   AdamWTensor* out, int* src, int64_t* at) {
    int64_t lo, len;
    dp_layer_span(t, goff, n, &lo, &len);
    size_t off, cnt;
    comm_shard_range((size_t)len, world, rank, &off, &cnt);
    const int64_t a0 = lo + (int64_t)off, b0 = a0 + (int64_t)cnt;
    int k = 0;
    for (int i = 0; i < n; i++) {
        const int64_t ta = goff[i], tb = ta + (int64_t)t[i].n;
        const int64_t a = ta > a0 ? ta : a0, b = tb < b0 ? tb : b0;
        if (a >= b) continue;
        const int64_t d = a - ta;
        out[k] = (AdamWTensor){.param = t[i].param ? t[i].param + d : NULL,
                               .grad = t[i].grad ? t[i].grad + d : NULL,
                               .m = t[i].m ? t[i].m + d : NULL, .v = t[i].v ? t[i].v + d : NULL,
                               .n = (size_t)(b - a), .decay = t[i].decay, .out_bf16 = NULL};
        if (src) src[k] = i;
        if (at) at[k] = d;
        k++;
    }
    return k;
}

void dp_engine_state_ranges(const TensorTable* tt, int world, int rank, int64_t* lo, int64_t* hi) {
    // the optimizer's tensors of each layer in table order (as the engine groups them), at their
    // gradient offsets (the same as their state offsets, for full training and LoRA's adapters;
    // shard_init checks)
    for (int l = 0; l < tt->n_layers; l++) {
        int64_t a = -1, b = 0;
        for (int i = 0; i < tt->n; i++) {
            const TensorDesc* d = &tt->t[i];
            if (d->tied_to >= 0 || !d->trainable || d->layer != l) continue;
            if (a < 0) a = d->grad_offset;
            b = d->grad_offset + d->numel;
        }
        if (a < 0) a = 0, b = 0;
        size_t off, len;
        comm_shard_range((size_t)(b - a), world, rank, &off, &len);
        lo[l] = a + (int64_t)off;
        hi[l] = lo[l] + (int64_t)len;
    }
}

double dp_engine_norm_sq(ThreadPool* pool, const Store* s, int world) {
    const TensorTable* tt = s->tt;
    const size_t cap = (size_t)(tt->n > 0 ? tt->n : 1);
    AdamWTensor* t = malloc_check(cap * sizeof(AdamWTensor));
    AdamWTensor* piece = malloc_check(cap * sizeof(AdamWTensor));
    int64_t* goff = malloc_check(cap * sizeof(int64_t));
    int* layer = malloc_check(cap * sizeof(int));
    const int n_t = store_adamw_tensors(s, t);
    // the optimizer's tensors in table order, which is layer order (as the engine groups them)
    int k = 0;
    for (int i = 0; i < tt->n && k < n_t; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to >= 0 || !d->trainable) continue;
        goff[k] = d->grad_offset;
        layer[k++] = d->layer;
    }
    double total = 0.0;
    for (int first = 0; first < n_t;) {
        int end = first;
        while (end < n_t && layer[end] == layer[first]) end++;
        for (int r = 0; r < world; r++) {
            const int n_p = dp_layer_shard(t + first, goff + first, end - first, world, r, piece,
                                           NULL, NULL);
            const int64_t n_c = adamw_chunk_count(piece, n_p);
            if (n_c == 0) continue;
            double* sums = malloc_check((size_t)n_c * sizeof(double));
            adamw_grad_norm_sq_parts(pool, piece, n_p, sums);
            for (int64_t c = 0; c < n_c; c++) total += sums[c];  // one by one, in chunk order
            free(sums);
        }
        first = end;
    }
    free(t);
    free(piece);
    free(goff);
    free(layer);
    return total;
}
