/*
 * store.c — host layer store: allocation, init, loading from safetensors or GGUF, tied-gradient
 * folding.
 */
#include "store.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "mxfp4.h"
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

void store_create(Store* s, const TensorTable* tt) {
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
        s->m[l] = slab_alloc(tt->param_numel[l]);
        s->v[l] = slab_alloc(tt->param_numel[l]);
        float* slabs[4] = {s->param[l], s->grad[l], s->m[l], s->v[l]};
        int64_t numel[4] = {tt->param_numel[l], tt->grad_numel[l], tt->param_numel[l],
                            tt->param_numel[l]};
        for (int k = 0; k < 4; k++) {
            z.slabs[4 * l + k] = slabs[k];
            z.numel[4 * l + k] = slabs[k] ? numel[k] : 0;
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
    free(s->param);
    free(s->grad);
    free(s->m);
    free(s->v);
    memset(s, 0, sizeof *s);
}

float* store_param(const Store* s, int i) {
    const TensorDesc* d = &s->tt->t[i];
    return s->param[d->owner_layer] + d->param_offset;
}

float* store_grad(const Store* s, int i) {
    const TensorDesc* d = &s->tt->t[i];
    return s->grad[d->layer] + d->grad_offset;
}

// Random init in chunks of INIT_CHUNK elements, each with its own generator seeded from (seed,
// tensor, chunk): the result does not depend on the number of threads, and a 1.7 B-parameter
// model initialises in seconds rather than a minute.
#define INIT_CHUNK (1 << 20)

typedef struct InitJob {
    const Store* s;
    uint32_t seed;
    float std;
    int* chunk_tensor;       // (n_chunks) tensor index of each chunk
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

static void init_chunk(void* arg, int64_t c) {
    const InitJob* job = arg;
    const int i = job->chunk_tensor[c];
    const TensorDesc* d = &job->s->tt->t[i];
    const int64_t b = job->chunk_begin[c];
    const int64_t n = d->numel - b < INIT_CHUNK ? d->numel - b : INIT_CHUNK;
    float* p = store_param(job->s, i) + b;
    if (d->ndim == 1) {
        for (int64_t j = 0; j < n; j++) p[j] = 1.0f;
        return;
    }
    Rng rng;
    rng_seed(&rng, mix32(job->seed ^ mix32((uint32_t)i * 0x9e3779b9u ^ mix32((uint32_t)(b / INIT_CHUNK)))));
    for (int64_t j = 0; j < n; j++) p[j] = job->std * rng_normal(&rng);
}

void store_init_random(Store* s, uint32_t seed, float std) {
    int64_t n_chunks = 0;
    for (int i = 0; i < s->tt->n; i++)
        if (s->tt->t[i].tied_to < 0) n_chunks += (s->tt->t[i].numel + INIT_CHUNK - 1) / INIT_CHUNK;
    InitJob job = {s, seed, std, malloc_check((size_t)n_chunks * sizeof(int)),
                   malloc_check((size_t)n_chunks * sizeof(int64_t))};
    int64_t c = 0;
    for (int i = 0; i < s->tt->n; i++) {
        if (s->tt->t[i].tied_to >= 0) continue;
        for (int64_t b = 0; b < s->tt->t[i].numel; b += INIT_CHUNK) {
            job.chunk_tensor[c] = i;
            job.chunk_begin[c] = b;
            c++;
        }
    }
    ThreadPool* pool = threadpool_create(0);
    threadpool_run(pool, n_chunks, init_chunk, &job);
    threadpool_destroy(pool);
    free(job.chunk_tensor);
    free(job.chunk_begin);
}

// Loading converts every owned tensor in its own task (conversion or dequantisation and the
// finiteness check are independent per tensor, and the sources are read-only maps); the error
// reported is the first failing tensor's in table order, whatever the number of threads.
// Safetensors sources load through the table's HF view (tensor.h): one task per HF tensor.
typedef struct LoadJob {
    Store* s;
    const StCheckpoint* ck;  // safetensors: the checkpoint ...
    const StTensor** st;     // ... the tensor of each HF view entry (NULL: an MXFP4 pair)
    const GgufFile* gguf;    // GGUF: the file and the config it gave (or NULL)
    const ModelConfig* cfg;
    char (*err)[ERR_LEN];    // per task
    int* rc;                 // per task, 0 = loaded
} LoadJob;

static void load_task(void* arg, int64_t task) {
    LoadJob* job = arg;
    const int i = (int)task;
    const TensorTable* tt = job->s->tt;
    if (job->gguf) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to >= 0) return;
        job->rc[i] = gguf_read_hf_tensor(job->gguf, job->cfg, d, store_param(job->s, i), job->err[i]);
        return;
    }
    const HfTensor* v = &tt->hf[i];
    float* out = store_param(job->s, v->index) + v->offset;
    if (job->st[i]) {
        job->rc[i] = st_tensor_to_f32(job->st[i], out, v->numel, job->err[i]);
    } else {  // GPT-OSS experts in MXFP4: [E, rows, G, 16] blocks of the [E, cols, rows] tensor
        int r = mxfp4_load(job->ck, v->name, v->shape[0], v->shape[1], v->shape[2], out,
                           job->err[i]);
        job->rc[i] = r == 1 ? 0 : -1;
    }
}

static int load_all(LoadJob* job, int n, char* err) {
    job->err = malloc_check((size_t)(n > 0 ? n : 1) * sizeof *job->err);
    job->rc = calloc_check((size_t)(n > 0 ? n : 1), sizeof(int));
    ThreadPool* pool = threadpool_create(0);
    threadpool_run(pool, n, load_task, job);
    threadpool_destroy(pool);
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++)
        if (job->rc[i] != 0) rc = errorf(err, "%s", job->err[i]);
    free(job->err);
    free(job->rc);
    return rc;
}

static void shape_string(char* out, size_t cap, int ndim, const int64_t* shape) {
    int off = snprintf(out, cap, "[");
    for (int k = 0; k < ndim && off < (int)cap - 24; k++)
        off += snprintf(out + off, cap - (size_t)off, k ? ", %lld" : "%lld", (long long)shape[k]);
    snprintf(out + off, cap - (size_t)off, "]");
}

// The checkpoint's tensor for HF view entry v, shape checked (NULL + rc 0: an MXFP4 pair stands
// in for it; rc -1 + err: missing or misshapen).
static const StTensor* find_hf_tensor(const StCheckpoint* ck, const HfTensor* v, int* rc,
                                      char* err) {
    *rc = 0;
    const StTensor* st = st_checkpoint_find(ck, v->name);
    if (!st) {
        char bname[160];
        snprintf(bname, sizeof bname, "%s_blocks", v->name);
        if (v->ndim == 3 && st_checkpoint_find(ck, bname)) return NULL;  // MXFP4 (load_task)
        *rc = errorf(err, "checkpoint has no tensor '%s'", v->name);
        return NULL;
    }
    int shape_ok = st->ndim == v->ndim;
    for (int k = 0; shape_ok && k < v->ndim; k++) shape_ok = st->shape[k] == v->shape[k];
    if (!shape_ok) {
        char want[64], got[64];
        shape_string(want, sizeof want, v->ndim, v->shape);
        shape_string(got, sizeof got, st->ndim, st->shape);
        *rc = errorf(err, "%s: tensor '%s' has shape %s, the config needs %s", st->file, v->name,
                     got, want);
    }
    return st;
}

int store_load(Store* s, const StCheckpoint* ck, int* n_unused, char* err) {
    const TensorTable* tt = s->tt;
    char terr[ERR_LEN];
    // names and shapes first (cheap, in checkpoint order), then the conversions in parallel
    LoadJob job = {.s = s, .ck = ck,
                   .st = calloc_check((size_t)(tt->n_hf > 0 ? tt->n_hf : 1), sizeof(StTensor*))};
    for (int j = 0; j < tt->n_hf; j++) {
        int rc;
        job.st[j] = find_hf_tensor(ck, &tt->hf[j], &rc, err);
        if (rc != 0) {
            free(job.st);
            return -1;
        }
    }
    const int rc = load_all(&job, tt->n_hf, err);
    free(job.st);
    if (rc != 0) return rc;
    // Report checkpoint tensors we do not use. A tied model may carry lm_head.weight: accept it
    // only if it equals the embedding, otherwise tying would silently change the model.
    int unused = 0;
    for (int k = 0; k < ck->n_tensors; k++) {
        const char* name = ck->tensors[k]->name;
        if (tensor_table_find_hf_tensor(tt, name) >= 0) continue;
        char base[160];
        str_copy(base, sizeof base, name);
        char* us = strrchr(base, '_');
        if (us && (strcmp(us, "_blocks") == 0 || strcmp(us, "_scales") == 0)) {
            *us = '\0';
            if (tensor_table_find_hf_tensor(tt, base) >= 0 && mxfp4_is_part_of(name, base)) continue;
        }
        int head = tensor_table_index(tt, TK_LM_HEAD, -1);
        if (strcmp(name, "lm_head.weight") == 0 && head >= 0 && tt->t[head].tied_to >= 0) {
            const TensorDesc* d = &tt->t[head];
            float* tmp = malloc_check((size_t)d->numel * sizeof(float));
            int bad = ck->tensors[k]->numel != d->numel ||
                      st_tensor_to_f32(ck->tensors[k], tmp, d->numel, terr) != 0 ||
                      memcmp(tmp, store_param(s, head), (size_t)d->numel * sizeof(float)) != 0;
            free(tmp);
            if (bad)
                return errorf(err, "%s: lm_head.weight differs from the embedding but the config "
                                   "ties them (tie_word_embeddings)", ck->tensors[k]->file);
            continue;
        }
        unused++;
    }
    if (n_unused) *n_unused = unused;
    return 0;
}

int store_load_gguf(Store* s, const GgufFile* f, const ModelConfig* cfg, int* n_unused, char* err) {
    const TensorTable* tt = s->tt;
    LoadJob job = {.s = s, .gguf = f, .cfg = cfg};
    if (load_all(&job, tt->n, err) != 0) return -1;
    int unused = 0;
    char name[GGUF_MAX_NAME + 32];
    for (int64_t k = 0; k < f->n_tensors; k++) {
        const char* have = f->tensors[k].name;
        if (strcmp(have, "rope_freqs.weight") == 0) continue;
        int used = 0;
        for (int i = 0; i < tt->n && !used; i++) {
            if (tt->t[i].tied_to >= 0) continue;
            gguf_tensor_name(cfg->family, &tt->t[i], name, sizeof name);
            used = strcmp(name, have) == 0;
        }
        unused += !used;
    }
    if (n_unused) *n_unused = unused;
    return 0;
}

void store_zero_grads(Store* s) {
    for (int l = 0; l < s->n_layers; l++)
        if (s->grad[l]) memset(s->grad[l], 0, (size_t)s->tt->grad_numel[l] * sizeof(float));
}

void store_fold_tied_grads(Store* s) {
    for (int i = 0; i < s->tt->n; i++) {
        const TensorDesc* d = &s->tt->t[i];
        if (d->tied_to < 0) continue;
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
        if (d->tied_to >= 0) continue;
        out[n].param = store_param(s, i);
        out[n].grad = store_grad(s, i);
        out[n].m = s->m[d->owner_layer] + d->param_offset;
        out[n].v = s->v[d->owner_layer] + d->param_offset;
        out[n].n = (size_t)d->numel;
        out[n].decay = d->decay;
        out[n].out_bf16 = NULL;
        n++;
    }
    return n;
}
