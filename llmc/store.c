/*
 * store.c — host layer store: allocation (zeroed in parallel), seeded random init, parameter and
 * gradient addressing, tied-gradient folding, the optimizer's view of the slabs. Filling the
 * store from checkpoint files is loader.c's job. A streamed base's block-format tensors are
 * generated a chunk at a time and quantised into their blocks (quant.h), never into the slabs.
 */
#include "store.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "quant.h"
#include "rng.h"

static float* slab_alloc(int64_t n) {
    return n > 0 ? huge_alloc_check((size_t)n * sizeof(float)) : NULL;
}

// Zeroing the slabs is most of store_create's time for big models (128 GB for LLaMA-3.1-8B):
// spread it over the CPUs in fixed chunks of every slab.
#define ZERO_CHUNK (1 << 22)  // floats

typedef struct ZeroJob {
    float** slabs;     // (n) slab pointers
    int64_t* numel;    // (n)
    int64_t* first;    // (n + 1) first chunk index of each slab
    int n;
} ZeroJob;

static void zero_chunk(void* arg, int64_t c) {
    const ZeroJob* z = arg;
    int i = 0;
    while (z->first[i + 1] <= c) i++;
    int64_t b = (c - z->first[i]) * ZERO_CHUNK;
    int64_t n = z->numel[i] - b < ZERO_CHUNK ? z->numel[i] - b : ZERO_CHUNK;
    memset(z->slabs[i] + b, 0, (size_t)n * sizeof(float));
}

double store_bytes(const TensorTable* tt) {
    double bytes = 0;
    for (int l = 0; l < tt->n_layers; l++)  // param, gradient, m and v slabs (LoRA: the adapters'
        bytes += ((double)tt->param_numel[l] + (double)tt->grad_numel[l] +  // gradient and state)
                  2.0 * (double)tt->state_numel[l]) * sizeof(float);
    return bytes;
}

double store_frozen_bytes(const TensorTable* tt) {
    double bytes = 0;
    for (int l = 0; l < tt->n_layers; l++)
        bytes += (double)(tt->param_numel[l] - tt->state_numel[l]) * sizeof(float);
    return bytes;
}

void store_release_range(Store* s, int l, int64_t from, int64_t to) {
    const int64_t off = s->tt->param_numel[l] - s->tt->state_numel[l];
    if (to > off) to = off;  // (never the trainable tail)
    if (from >= to || !s->param[l]) return;
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t pg = page > 0 ? (uintptr_t)page : 4096u;
    // the whole pages inside the range (the allocation stays, for store_free, and so do the
    // tails' addresses); MADV_DONTNEED frees them, reading them again would give zeros
    const uintptr_t b = ((uintptr_t)(s->param[l] + from) + pg - 1) / pg * pg;
    const uintptr_t e = (uintptr_t)(s->param[l] + to) / pg * pg;
    if (e > b && madvise((void*)b, e - b, MADV_DONTNEED) != 0)
        fatal("madvise(MADV_DONTNEED) on the frozen base's %zu bytes: %s", (size_t)(e - b),
              strerror(errno));
}

// The whole pages of x[from, to) back to the system.
static void release_pages(float* x, int64_t from, int64_t to, const char* what) {
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t pg = page > 0 ? (uintptr_t)page : 4096u;
    const uintptr_t b = ((uintptr_t)(x + from) + pg - 1) / pg * pg;
    const uintptr_t e = (uintptr_t)(x + to) / pg * pg;
    if (e > b && madvise((void*)b, e - b, MADV_DONTNEED) != 0)
        fatal("madvise(MADV_DONTNEED) on %s's %zu bytes: %s", what, (size_t)(e - b),
              strerror(errno));
}

void store_release_state(Store* s, int l, int64_t from, int64_t to, int weights) {
    if (to > s->tt->state_numel[l]) to = s->tt->state_numel[l];
    if (from >= to || !s->m[l]) return;
    release_pages(s->m[l], from, to, "AdamW's m");
    release_pages(s->v[l], from, to, "AdamW's v");
    if (weights && s->tt->param_numel[l] == s->tt->state_numel[l])
        release_pages(s->param[l], from, to, "the fp32 weights");
}

void store_release_frozen(Store* s) {
    for (int l = 0; l < s->n_layers; l++)
        store_release_range(s, l, 0, s->tt->param_numel[l] - s->tt->state_numel[l]);
    s->frozen_released = 1;
}

static void store_create_ex(Store* s, const TensorTable* tt, int skip_frozen,
                            const int64_t* state_lo, const int64_t* state_hi);

void store_create(Store* s, const TensorTable* tt) { store_create_ex(s, tt, 0, NULL, NULL); }

void store_create_unfrozen(Store* s, const TensorTable* tt) {
    store_create_ex(s, tt, 1, NULL, NULL);
    s->frozen_released = 1;
}

void store_create_streamed(Store* s, const TensorTable* tt, int bf16) {
    store_create_ex(s, tt, 1, NULL, NULL);
    s->qblocks = calloc_check((size_t)tt->n, sizeof(uint8_t*));
    for (int i = 0; i < tt->n; i++)
        if (tt->t[i].qtype) s->qblocks[i] = malloc_check(quant_tensor_bytes(&tt->t[i], 0));
    s->base_streamed = 1;
    if (!bf16) return;
    // (not zeroed: the init and the loader write every frozen tensor; a block-format tensor's
    // stretch is never written, so its pages are never committed)
    s->base16 = calloc_check((size_t)tt->n_layers, sizeof(uint16_t*));
    for (int l = 0; l < tt->n_layers; l++) {
        const int64_t head = tt->param_numel[l] - tt->state_numel[l];
        if (head > 0) s->base16[l] = huge_alloc_check((size_t)head * sizeof(uint16_t));
    }
}

double store_base16_bytes(const TensorTable* tt) {
    double bytes = 0.0;
    for (int l = 0; l < tt->n_layers; l++)
        for (int i = tt->first[l]; i < tt->first[l] + tt->count[l]; i++) {
            const TensorDesc* d = &tt->t[i];
            if (d->owner_layer == l && d->tied_to < 0 && !d->trainable && !d->qtype)
                bytes += 2.0 * (double)d->numel;  // (the pages the blocks' stretches leave)
        }
    return bytes;
}

int store_streams_tensor(const Store* s, int i) {
    const TensorDesc* d = &s->tt->t[i];
    return s->base_streamed && d->tied_to < 0 && !d->trainable && (d->qtype || s->base16);
}

int store_stream_values(Store* s, int i, const float* w, int64_t from, int64_t n, char* err) {
    const TensorDesc* d = &s->tt->t[i];
    if (!d->qtype) {
        uint16_t* dst = s->base16[d->owner_layer] + d->param_offset + from;
        for (int64_t j = 0; j < n; j++) dst[j] = f32_to_bf16(w[j]);
        return 0;
    }
    int bytes = 0;
    const int block = ggml_type_block(d->qtype, &bytes);
    if (from % block != 0 || n % block != 0)
        return errorf(err, "%s: a checkpoint part of %lld elements at %lld is not whole %s blocks "
                      "(give --val or an export to hold the base in fp32)", d->name, (long long)n,
                      (long long)from, quant_type_name(d->qtype));
    quant_quantize(d->qtype, w, s->qblocks[i] + (size_t)(from / block) * (size_t)bytes, n);
    return 0;
}

void store_create_shard(Store* s, const TensorTable* tt, const int64_t* state_lo,
                        const int64_t* state_hi) {
    store_create_ex(s, tt, 0, state_lo, state_hi);
    const size_t bytes = (size_t)(tt->n_layers > 0 ? tt->n_layers : 1) * sizeof(int64_t);
    s->state_lo = malloc_check(bytes);
    s->state_hi = malloc_check(bytes);
    memcpy(s->state_lo, state_lo, (size_t)tt->n_layers * sizeof(int64_t));
    memcpy(s->state_hi, state_hi, (size_t)tt->n_layers * sizeof(int64_t));
}

static void store_create_ex(Store* s, const TensorTable* tt, int skip_frozen,
                            const int64_t* state_lo, const int64_t* state_hi) {
    memset(s, 0, sizeof *s);
    s->tt = tt;
    s->n_layers = tt->n_layers;
    s->param = calloc_check((size_t)s->n_layers, sizeof(float*));
    s->grad = calloc_check((size_t)s->n_layers, sizeof(float*));
    s->m = calloc_check((size_t)s->n_layers, sizeof(float*));
    s->v = calloc_check((size_t)s->n_layers, sizeof(float*));
    const int n = 4 * s->n_layers;
    ZeroJob z = {calloc_check((size_t)n, sizeof(float*)), calloc_check((size_t)n, sizeof(int64_t)),
                 calloc_check((size_t)n + 1, sizeof(int64_t)), n};
    for (int l = 0; l < s->n_layers; l++) {
        s->param[l] = slab_alloc(tt->param_numel[l]);
        s->grad[l] = slab_alloc(tt->grad_numel[l]);
        s->m[l] = slab_alloc(tt->state_numel[l]);
        s->v[l] = slab_alloc(tt->state_numel[l]);
        float* slabs[4] = {s->param[l], s->grad[l], s->m[l], s->v[l]};
        int64_t numel[4] = {tt->param_numel[l], tt->grad_numel[l], tt->state_numel[l],
                            tt->state_numel[l]};
        if (skip_frozen && slabs[0]) {  // (the trainable tail only)
            const int64_t head = tt->param_numel[l] - tt->state_numel[l];
            slabs[0] += head;
            numel[0] -= head;
        }
        for (int k = 0; k < 4; k++) {
            z.slabs[4 * l + k] = slabs[k];
            z.numel[4 * l + k] = slabs[k] ? numel[k] : 0;
            if (state_lo && k >= 2 && slabs[k]) {  // m and v: the rank's shard only
                z.slabs[4 * l + k] = slabs[k] + state_lo[l];
                z.numel[4 * l + k] = state_hi[l] - state_lo[l];
            }
        }
    }
    for (int i = 0; i < n; i++) z.first[i + 1] = z.first[i] + (z.numel[i] + ZERO_CHUNK - 1) / ZERO_CHUNK;
    ThreadPool* pool = threadpool_create(0);
    threadpool_run(pool, z.first[n], zero_chunk, &z);
    threadpool_destroy(pool);
    free(z.slabs);
    free(z.numel);
    free(z.first);
}

void store_free(Store* s) {
    for (int l = 0; l < s->n_layers; l++) {
        free(s->param[l]);
        free(s->grad[l]);
        free(s->m[l]);
        free(s->v[l]);
    }
    if (s->qblocks)
        for (int i = 0; i < s->tt->n; i++) free(s->qblocks[i]);
    free(s->qblocks);
    if (s->base16)
        for (int l = 0; l < s->n_layers; l++) free(s->base16[l]);
    free(s->base16);
    free(s->map_src);
    free(s->map_type);
    free(s->state_lo);
    free(s->state_hi);
    free(s->param);
    free(s->grad);
    free(s->m);
    free(s->v);
    memset(s, 0, sizeof *s);
}

float* store_param(const Store* s, int i) {
    const TensorDesc* d = &s->tt->t[i];
    if (s->frozen_released && !s->tt->t[d->tied_to >= 0 ? d->tied_to : i].trainable)
        fatal("internal: %s's fp32 weights were released (store_release_frozen)", d->name);
    if (store_streams_tensor(s, d->tied_to >= 0 ? d->tied_to : i))
        fatal("internal: %s is held as %s only (a streamed base has no fp32 values)", d->name,
              d->qtype ? quant_type_name(d->qtype) : "bf16");
    return s->param[d->owner_layer] + d->param_offset;
}

float* store_grad(const Store* s, int i) {
    const TensorDesc* d = &s->tt->t[i];
    if (d->grad_offset < 0) return NULL;  // frozen
    return s->grad[d->layer] + d->grad_offset;
}

// Random init in chunks of INIT_CHUNK elements, each with its own generator seeded from (seed,
// tensor, chunk): the result does not depend on the number of threads, and a 1.7 B-parameter
// model initialises in seconds rather than a minute.
#define INIT_CHUNK (1 << 20)

typedef struct InitJob {
    Store* s;
    uint32_t seed;
    float std;
    int* chunk_tensor;       // (n_chunks) tensor index of each chunk
    int* chunk_key;          // (n_chunks) its index among the base's tensors (the seed's key:
                             // the same base with or without LoRA adapters in the table)
    int64_t* chunk_begin;    // (n_chunks) first element of each chunk within its tensor
} InitJob;

static uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// Chunk c's n values ~ N(0, std) from its own generator.
static void init_normal(const InitJob* job, int64_t c, float* p, int64_t n) {
    Rng rng;
    const uint32_t key = (uint32_t)job->chunk_key[c];
    const int64_t b = job->chunk_begin[c];
    rng_seed(&rng, mix32(job->seed ^ mix32(key * 0x9e3779b9u ^ mix32((uint32_t)(b / INIT_CHUNK)))));
    for (int64_t j = 0; j < n; j++) p[j] = job->std * rng_normal(&rng);
}

static void init_chunk(void* arg, int64_t c) {
    const InitJob* job = arg;
    const int i = job->chunk_tensor[c];
    const TensorDesc* d = &job->s->tt->t[i];
    const int64_t b = job->chunk_begin[c];
    const int64_t n = d->numel - b < INIT_CHUNK ? d->numel - b : INIT_CHUNK;
    // a streamed base: the chunk's values into a buffer of their own, then into their blocks
    // (or bf16)
    const int streamed = store_streams_tensor(job->s, i);
    float* p = streamed ? malloc_check((size_t)n * sizeof(float)) : store_param(job->s, i) + b;
    // As HF's _init_weights: norms 1, linear and expert biases 0 (GPT-OSS), everything else
    // normal(0, std), GPT-OSS's sinks and router bias included. (Biases of 1 would add one
    // constant vector to every token's hidden state, and the router would send every token to
    // the same experts.)
    switch (d->kind) {
    case TK_BQ: case TK_BK: case TK_BV: case TK_BO: case TK_EXP_GATE_UP_BIAS:
    case TK_EXP_DOWN_BIAS:
        memset(p, 0, (size_t)n * sizeof(float));
        break;
    case TK_SINKS: case TK_ROUTER_BIAS:
        init_normal(job, c, p, n);
        break;
    default:
        if (d->ndim == 1) {
            for (int64_t j = 0; j < n; j++) p[j] = 1.0f;
        } else {
            init_normal(job, c, p, n);
        }
    }
    if (!streamed) return;
    // (INIT_CHUNK is a multiple of every format's block, so chunk b starts block b / block)
    char err[ERR_LEN];
    if (store_stream_values(job->s, i, p, b, n, err) != 0) fatal("internal: %s", err);
    free(p);
}

void store_init_random(Store* s, uint32_t seed, float std) {
    int64_t n_chunks = 0;
    for (int i = 0; i < s->tt->n; i++)
        if (s->tt->t[i].tied_to < 0 && s->tt->t[i].lora_target < 0)
            n_chunks += (s->tt->t[i].numel + INIT_CHUNK - 1) / INIT_CHUNK;
    InitJob job = {s, seed, std, malloc_check((size_t)n_chunks * sizeof(int)),
                   malloc_check((size_t)n_chunks * sizeof(int)),
                   malloc_check((size_t)n_chunks * sizeof(int64_t))};
    int64_t c = 0;
    int key = 0;
    for (int i = 0; i < s->tt->n; i++) {
        if (s->tt->t[i].lora_target >= 0) continue;  // adapters: lora_init_random
        const int k = key++;
        if (s->tt->t[i].tied_to >= 0) continue;
        for (int64_t b = 0; b < s->tt->t[i].numel; b += INIT_CHUNK) {
            job.chunk_tensor[c] = i;
            job.chunk_key[c] = k;
            job.chunk_begin[c] = b;
            c++;
        }
    }
    ThreadPool* pool = threadpool_create(0);
    threadpool_run(pool, n_chunks, init_chunk, &job);
    threadpool_destroy(pool);
    free(job.chunk_tensor);
    free(job.chunk_key);
    free(job.chunk_begin);
}

void store_zero_grads(Store* s) {
    for (int l = 0; l < s->n_layers; l++)
        if (s->grad[l]) memset(s->grad[l], 0, (size_t)s->tt->grad_numel[l] * sizeof(float));
}

void store_fold_tied_grads(Store* s) {
    for (int i = 0; i < s->tt->n; i++) {
        const TensorDesc* d = &s->tt->t[i];
        if (d->tied_to < 0 || !d->trainable) continue;
        float* src = store_grad(s, i);
        float* dst = store_grad(s, d->tied_to);
        for (int64_t j = 0; j < d->numel; j++) {
            dst[j] += src[j];
            src[j] = 0.0f;
        }
    }
}

int store_adamw_tensors(const Store* s, AdamWTensor* out) {
    int n = 0;
    for (int i = 0; i < s->tt->n; i++) {
        const TensorDesc* d = &s->tt->t[i];
        if (d->tied_to >= 0 || !d->trainable) continue;
        out[n].param = store_param(s, i);
        out[n].grad = store_grad(s, i);
        out[n].m = s->m[d->owner_layer] + d->state_offset;
        out[n].v = s->v[d->owner_layer] + d->state_offset;
        out[n].n = (size_t)d->numel;
        out[n].decay = d->decay;
        out[n].out_bf16 = NULL;
        n++;
    }
    return n;
}

// ----------------------------------------------------------------------------
// a block-format base (quant.h) from the fp32 init or load

typedef struct QuantJob {
    Store* s;
    const GgufFile* gguf;
    const ModelConfig* cfg;
    int* tensors;  // the marked tensors' indices
} QuantJob;

static void quant_tensor_task(void* arg, int64_t k) {
    const QuantJob* q = arg;
    const int i = q->tensors[k];
    const TensorDesc* d = &q->s->tt->t[i];
    float* w = store_param(q->s, i);
    uint8_t* blocks = malloc_check(quant_tensor_bytes(d, 0));
    quant_tensor_blocks(d, w, blocks, q->gguf, q->cfg);
    quant_dequantize(d->qtype, blocks, w, d->numel);
    q->s->qblocks[i] = blocks;
}

void store_quantize_base(Store* s, const GgufFile* gguf, const ModelConfig* cfg) {
    const TensorTable* tt = s->tt;
    const int n = quant_table_count(tt);
    if (n == 0 || s->frozen_released) return;  // (--mmap-base: every frozen tensor is mapped)
    if (s->base_streamed) return;  // (the init and the loader made the blocks: no fp32 values)
    if (!s->qblocks) s->qblocks = calloc_check((size_t)tt->n, sizeof(uint8_t*));
    QuantJob q = {s, gguf, cfg, malloc_check((size_t)n * sizeof(int))};
    int k = 0;
    for (int i = 0; i < tt->n; i++) {
        if (!tt->t[i].qtype) continue;
        if (s->map_src && s->map_src[i]) continue;  // (--mmap-base: uploaded from the mapping)
        free(s->qblocks[i]);
        s->qblocks[i] = NULL;
        q.tensors[k++] = i;
    }
    ThreadPool* pool = threadpool_create(0);
    threadpool_run(pool, k, quant_tensor_task, &q);
    threadpool_destroy(pool);
    free(q.tensors);
}
