/*
 * loader.c — checkpoint files (safetensors, GGUF) -> the host layer store: names and shapes
 * checked in table order first, then one conversion task per tensor on a thread pool.
 * Safetensors load through the table's HF view (tensor.h): one task per checkpoint tensor, so
 * per-expert, fused and MXFP4 expert layouts land in the same slabs. A streamed base
 * (Store.base_streamed): a frozen tensor's values go to a buffer of the task's own and from
 * there into its blocks or its bf16 copy (Store.base16), never into the slab; a large GGUF tensor
 * a slice of whole rows or experts at a time (load_gguf_sliced: LOADER_SLICE_BYTES per thread).
 */
#include "loader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "mxfp4.h"
#include "progress.h"
#include "quant.h"
#include "threads.h"

// ----------------------------------------------------------------------------
// parallel conversion

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
    double slice_bytes;      // GGUF, a streamed base: the fp32 staging per task (load_gguf_sliced)
    char* sliced;            // GGUF: per table tensor, 1 when read in slices
} LoadJob;

// A streamed base (store_create_streamed): tensor i's elements [from, from + n) of fp32 values w
// into its blocks (whole blocks: a view of whole rows; rows are whole blocks) or bf16.
static int stream_values(const LoadJob* job, int i, const float* w, int64_t from, int64_t n,
                         char* err) {
    const TensorDesc* d = &job->s->tt->t[i];
    if (d->qtype && from == 0 && n == d->numel) {  // (keep: the GGUF's own blocks where the same)
        quant_tensor_blocks(d, w, job->s->qblocks[i], job->gguf, job->cfg);
        return 0;
    }
    return store_stream_values(job->s, i, w, from, n, err);
}

// A streamed GGUF tensor i whose whole read would stage more than job->slice_bytes, read and
// stored a slice at a time: 1 when done so (job->rc[i] set), 0 when it is to be read whole. Its
// whole read stages its fp32 values and, rearranged or kept as the GGUF's own blocks, as much
// again (gguf_read_hf_tensor's parts, take_gguf_blocks' check in quant.c). A slice is whole rows
// of a tensor in one part in the table's layout, or whole experts of an MoE tensor whose parts
// are rearranged expert by expert (gguf_parts_convert on that many experts); each part's slice is
// its own rows, so whole blocks of its type and of the Store's. The results are the whole read's
// bit for bit: the blocks are quantised block by block, and where the whole read keeps the GGUF's
// blocks (one part, the Store's type, the values their dequantisation) the slices copy them too.
// Read whole: small tensors, LLaMA's permuted q/k rows, two parts back to back; and, for its
// message, any tensor whose slices fail (a missing part, another shape, a non-finite value).
// The slices of d as its layout allows (before the file's own checks): 1 with *U units (rows or
// experts) of *unit elements, k a slice, when d is to be read in slices of slice_bytes; 0 whole.
static int slice_plan(const TensorDesc* d, const ModelConfig* cfg, double slice_bytes,
                      int64_t* U, int64_t* unit, int64_t* k) {
    if (8.0 * (double)d->numel <= slice_bytes || d->ndim < 2) return 0;
    GgufPart parts[2];
    const int n = gguf_tensor_parts(cfg, d, parts);
    const int rearranged = gguf_parts_rearranged(cfg, d);
    *U = d->shape[0];
    if (*U < 2 || d->numel % *U != 0) return 0;
    if (rearranged ? *U != cfg->E : n != 1 || d->kind == TK_WQ || d->kind == TK_WK) return 0;
    *unit = d->numel / *U;
    int qbytes = 0;
    if (d->qtype && *unit % ggml_type_block(d->qtype, &qbytes) != 0) return 0;
    *k = (int64_t)(slice_bytes / (4.0 * (double)*unit * (rearranged ? 2 : 1)));
    if (*k < 1) *k = 1;
    if (*k > *U) *k = *U;
    return 1;
}

double loader_gguf_staging_bytes(const TensorDesc* d, const ModelConfig* cfg,
                                 double slice_bytes) {
    int64_t U = 0, unit = 0, k = 0;
    if (!slice_plan(d, cfg, slice_bytes, &U, &unit, &k)) {
        // (gguf_read_hf_tensor's parts beside the values where they are rearranged, permuted
        // or two; take_gguf_blocks' check where the GGUF's blocks may be kept)
        GgufPart parts[2];
        const int twice = gguf_tensor_parts(cfg, d, parts) != 1 ||
                          gguf_parts_rearranged(cfg, d) || d->qtype ||
                          (cfg->family == FAMILY_LLAMA && (d->kind == TK_WQ || d->kind == TK_WK));
        return (twice ? 2.0 : 1.0) * 4.0 * (double)d->numel;
    }
    return (gguf_parts_rearranged(cfg, d) ? 2.0 : 1.0) * 4.0 * (double)(k * unit);
}

static int load_gguf_sliced(LoadJob* job, int i) {
    const TensorDesc* d = &job->s->tt->t[i];
    const ModelConfig* cfg = job->cfg;
    int64_t U = 0, unit = 0, k = 0;
    if (!slice_plan(d, cfg, job->slice_bytes, &U, &unit, &k)) return 0;
    GgufPart parts[2];
    const int n = gguf_tensor_parts(cfg, d, parts);
    const int rearranged = gguf_parts_rearranged(cfg, d);
    int qbytes = 0;
    const int qblock = d->qtype ? ggml_type_block(d->qtype, &qbytes) : 1;
    const GgufTensor* t[2] = {NULL, NULL};
    int64_t part_unit[2] = {0, 0};
    char scratch[ERR_LEN];
    for (int p = 0; p < n; p++) {
        t[p] = gguf_part_tensor(job->gguf, &parts[p], d, scratch);
        int bytes = 0;
        if (!t[p] || parts[p].numel % U != 0 || !ggml_type_can_dequantize(t[p]->type)) return 0;
        part_unit[p] = parts[p].numel / U;
        if (part_unit[p] % ggml_type_block(t[p]->type, &bytes) != 0) return 0;
    }
    if (part_unit[0] + part_unit[1] != unit) return 0;
    // (one part of the Store's own type: its blocks copied, as take_gguf_blocks does)
    const int keep = !rearranged && d->qtype && (int)t[0]->type == d->qtype &&
                     t[0]->numel == d->numel;
    float* w = malloc_check((size_t)(k * unit) * sizeof(float));
    float* packed = rearranged ? malloc_check((size_t)(k * unit) * sizeof(float)) : NULL;
    ModelConfig c = *cfg;
    TensorDesc ds = *d;
    int rc = 0;
    for (int64_t u = 0; u < U && rc == 0; u += k) {
        const int64_t kk = U - u < k ? U - u : k;
        if (!rearranged) {
            rc = gguf_tensor_range_to_f32(job->gguf, t[0], u * unit, kk * unit, w, job->err[i]);
        } else {  // the parts' slices back to back, then the table's layout of kk experts
            int64_t at = 0;
            for (int p = 0; p < n && rc == 0; p++) {
                rc = gguf_tensor_range_to_f32(job->gguf, t[p], u * part_unit[p],
                                              kk * part_unit[p], packed + at, job->err[i]);
                at += kk * part_unit[p];
            }
            c.E = (int)kk;
            ds.numel = kk * unit;
            if (rc == 0) gguf_parts_convert(&c, &ds, w, packed, 1);
        }
        if (rc == 0 && keep) {
            const size_t at = (size_t)(u * unit / qblock) * (size_t)qbytes;
            memcpy(job->s->qblocks[i] + at, t[0]->data + at,
                   (size_t)(kk * unit / qblock) * (size_t)qbytes);
        } else if (rc == 0) {
            rc = store_stream_values(job->s, i, w, u * unit, kk * unit, job->err[i]);
        }
    }
    free(w);
    free(packed);
    if (rc != 0) return 0;  // (the whole read says what is wrong)
    job->rc[i] = 0;
    job->sliced[i] = 1;
    return 1;
}

static void load_task(void* arg, int64_t task) {
    LoadJob* job = arg;
    const int i = (int)task;
    const TensorTable* tt = job->s->tt;
    if (job->gguf) {
        const TensorDesc* d = &tt->t[i];
        // (tied: the owner's; LoRA adapters: not the base's; --mmap-base: read on upload)
        if (d->tied_to >= 0 || d->lora_target >= 0 || (job->s->map_src && job->s->map_src[i]))
            return;
        if (store_streams_tensor(job->s, i)) {  // (one tensor's fp32 values, or a slice's)
            if (load_gguf_sliced(job, i)) return;
            float* w = malloc_check((size_t)d->numel * sizeof(float));
            job->rc[i] = gguf_read_hf_tensor(job->gguf, job->cfg, d, w, job->err[i]);
            if (job->rc[i] == 0) job->rc[i] = stream_values(job, i, w, 0, d->numel, job->err[i]);
            free(w);
            return;
        }
        job->rc[i] =
            gguf_read_hf_tensor(job->gguf, job->cfg, d, store_param(job->s, i), job->err[i]);
        return;
    }
    const HfTensor* v = &tt->hf[i];
    if (job->s->map_src && job->s->map_src[v->index]) return;  // (--mmap-base: read on upload)
    const int streamed = store_streams_tensor(job->s, v->index);
    float* out = streamed ? malloc_check((size_t)v->numel * sizeof(float))
                          : store_param(job->s, v->index) + v->offset;
    if (job->st[i]) {
        job->rc[i] = st_tensor_to_f32(job->st[i], out, v->numel, job->err[i]);
    } else {  // GPT-OSS experts in MXFP4: [E, rows, G, 16] blocks of the [E, cols, rows] tensor
        int r = mxfp4_load(job->ck, v->name, v->shape[0], v->shape[1], v->shape[2], out,
                           job->err[i]);
        job->rc[i] = r == 1 ? 0 : -1;
    }
    if (!streamed) return;
    if (job->rc[i] == 0)
        job->rc[i] = stream_values(job, v->index, out, v->offset, v->numel, job->err[i]);
    free(out);
}

// The fp32 bytes task i writes into the Store (for the progress line).
static double load_task_bytes(const LoadJob* job, int i) {
    const TensorTable* tt = job->s->tt;
    if (job->gguf)
        return tt->t[i].tied_to >= 0 || tt->t[i].lora_target >= 0 ? 0.0 : 4.0 * (double)tt->t[i].numel;
    return 4.0 * (double)tt->hf[i].numel;
}
static double load_bytes_range(const LoadJob* job, int first, int count) {
    double b = 0.0;
    for (int i = first; i < first + count; i++) b += load_task_bytes(job, i);
    return b;
}
static double load_bytes(const LoadJob* job, int n) { return load_bytes_range(job, 0, n); }

// Tasks first .. first + count - 1 of a job, run as one group.
typedef struct LoadGroup {
    LoadJob* job;
    int first;
} LoadGroup;
static void load_group_task(void* arg, int64_t task) {
    LoadGroup* g = arg;
    load_task(g->job, g->first + task);
}

// n tasks: the table's entries (GGUF) or its HF view's (safetensors)
static int load_all(LoadJob* job, int n, char* err) {
    job->err = malloc_check((size_t)(n > 0 ? n : 1) * sizeof *job->err);
    job->rc = calloc_check((size_t)(n > 0 ? n : 1), sizeof(int));
    ThreadPool* pool = threadpool_create(0);
    // On a terminal a progress line (bytes converted, rate): the tasks then run in groups, the
    // line redrawn between groups; elsewhere (logs, tests) in one call, as the line is not shown
    Progress pg;
    progress_begin(&pg, "loading the checkpoint", load_bytes(job, n));
    if (!pg.out) {
        threadpool_run(pool, n, load_task, job);
    } else {
        LoadGroup g = {job, 0};
        const int group = 4 * pool->n_threads;
        for (g.first = 0; g.first < n; g.first += group) {
            const int count = n - g.first < group ? n - g.first : group;
            threadpool_run(pool, count, load_group_task, &g);
            progress_add(&pg, load_bytes_range(job, g.first, count));
        }
    }
    progress_end(&pg);
    threadpool_destroy(pool);
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++)
        if (job->rc[i] != 0) rc = errorf(err, "%s", job->err[i]);
    free(job->err);
    free(job->rc);
    return rc;
}

// ----------------------------------------------------------------------------
// safetensors

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

int loader_load_safetensors(Store* s, const StCheckpoint* ck, int* n_unused, char* err) {
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
    // only if it equals the embedding, otherwise tying would silently change the model. MXFP4
    // experts count as used through their _blocks / _scales pair.
    int unused = 0;
    for (int k = 0; k < ck->n_tensors; k++) {
        const char* name = ck->tensors[k]->name;
        if (tensor_table_find_hf_tensor(tt, name) >= 0) continue;
        char base[160];
        str_copy(base, sizeof base, name);
        char* us = strrchr(base, '_');
        if (us && (strcmp(us, "_blocks") == 0 || strcmp(us, "_scales") == 0)) {
            *us = '\0';
            if (tensor_table_find_hf_tensor(tt, base) >= 0 && mxfp4_is_part_of(name, base))
                continue;
        }
        int head = tensor_table_index(tt, TK_LM_HEAD, -1);
        if (strcmp(name, "lm_head.weight") == 0 && head >= 0 && tt->t[head].tied_to >= 0 &&
            ((s->map_src && s->map_src[tt->t[head].tied_to]) ||
             store_streams_tensor(s, tt->t[head].tied_to)))
            continue;  // (--mmap-base, a streamed base: the embedding is not in fp32 to compare)
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

// ----------------------------------------------------------------------------
// GGUF

int loader_load_gguf(Store* s, const GgufFile* f, const ModelConfig* cfg, int* n_unused,
                     char* err) {
    return loader_load_gguf_sliced(s, f, cfg, LOADER_SLICE_BYTES, n_unused, NULL, err);
}

int loader_load_gguf_sliced(Store* s, const GgufFile* f, const ModelConfig* cfg,
                            double slice_bytes, int* n_unused, int* n_sliced, char* err) {
    const TensorTable* tt = s->tt;
    LoadJob job = {.s = s, .gguf = f, .cfg = cfg, .slice_bytes = slice_bytes,
                   .sliced = calloc_check((size_t)(tt->n > 0 ? tt->n : 1), 1)};
    const int rc = load_all(&job, tt->n, err);
    int count = 0;
    for (int i = 0; i < tt->n; i++) count += job.sliced[i];
    free(job.sliced);
    if (n_sliced) *n_sliced = count;
    if (rc != 0) return -1;
    int unused = 0;
    GgufPart parts[2];
    for (int64_t k = 0; k < f->n_tensors; k++) {
        const char* have = f->tensors[k].name;
        if (strcmp(have, "rope_freqs.weight") == 0) continue;
        int used = 0;
        for (int i = 0; i < tt->n && !used; i++) {
            if (tt->t[i].tied_to >= 0 || tt->t[i].lora_target >= 0) continue;
            const int n = gguf_tensor_parts(cfg, &tt->t[i], parts);
            for (int p = 0; p < n && !used; p++) used = strcmp(parts[p].name, have) == 0;
        }
        unused += !used;
    }
    if (n_unused) *n_unused = unused;
    return 0;
}

// ----------------------------------------------------------------------------
// --mmap-base

// The ggml type of a safetensors dtype the upload converts (F32, F16, BF16), or -1.
static int st_ggml_type(StDtype dt) {
    return dt == ST_F32 ? GGML_TYPE_F32 : dt == ST_F16 ? GGML_TYPE_F16
                                        : dt == ST_BF16 ? GGML_TYPE_BF16 : -1;
}

// Where the checkpoint holds frozen tensor i as the table lays it out (NULL + err if nowhere).
static const void* map_one(const Store* s, const StCheckpoint* ck, const GgufFile* gguf,
                           const ModelConfig* cfg, int i, int* type, char* err) {
    const TensorTable* tt = s->tt;
    const TensorDesc* d = &tt->t[i];
    const int want_blocks = d->qtype;
    if (gguf) {
        GgufPart parts[2];
        const int whole = gguf_tensor_parts(cfg, d, parts) == 1 && !gguf_parts_rearranged(cfg, d) &&
                          !(cfg->family == FAMILY_LLAMA && (d->kind == TK_WQ || d->kind == TK_WK));
        const GgufTensor* t = gguf_find_tensor(gguf, parts[0].name);
        if (!t) {
            errorf(err, "%s: no tensor '%s'", gguf->path, parts[0].name);
            return NULL;
        }
        *type = (int)t->type;
        const int plain = *type == GGML_TYPE_F32 || *type == GGML_TYPE_F16 || *type == GGML_TYPE_BF16;
        if (whole && t->numel == d->numel && (want_blocks ? *type == want_blocks : plain))
            return t->data;
        errorf(err, "--mmap-base: %s is %s in %s%s: a mapped base is uploaded as stored (F32, F16 "
               "or BF16; a GGUF's Q8_0 / Q4_K / MXFP4 blocks with --base-dtype keep)", parts[0].name,
               ggml_type_name(*type) ? ggml_type_name(*type) : "?", gguf->path,
               whole ? "" : " (and needs a layout change on load)");
        return NULL;
    }
    int views = 0, v = -1;
    for (int k = 0; k < tt->n_hf; k++)
        if (tt->hf[k].index == i) {
            views++;
            v = k;
        }
    const StTensor* st = views == 1 ? st_checkpoint_find(ck, tt->hf[v].name) : NULL;
    *type = st ? st_ggml_type(st->dtype) : -1;
    if (st && st->numel == d->numel && *type >= 0 && !want_blocks) return st->data;
    errorf(err, "--mmap-base: %s is %s in the checkpoint: a mapped safetensors base is uploaded "
           "as stored (F32, F16 or BF16 tensors of the table's layout, --base-dtype bf16)",
           views == 1 ? tt->hf[v].name : d->hf_name,
           !st ? "not one tensor" : want_blocks ? "not in ggml blocks" : st_dtype_name(st->dtype));
    return NULL;
}

int loader_map_base(Store* s, const StCheckpoint* ck, const GgufFile* gguf,
                    const ModelConfig* cfg, char* err) {
    const TensorTable* tt = s->tt;
    s->map_src = calloc_check((size_t)tt->n, sizeof(void*));
    s->map_type = calloc_check((size_t)tt->n, sizeof(int));
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->trainable || d->tied_to >= 0) continue;
        s->map_src[i] = map_one(s, ck, gguf, cfg, i, &s->map_type[i], err);
        if (!s->map_src[i]) return -1;
    }
    s->frozen_released = 1;
    return 0;
}
