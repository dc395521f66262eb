/*
 * loader.c — checkpoint files (safetensors, GGUF) -> the host layer store: names and shapes
 * checked in table order first, then one conversion task per tensor on a thread pool.
 */
#include "loader.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "threads.h"

// ----------------------------------------------------------------------------
// parallel conversion

// Loading converts every owned tensor in its own task (conversion or dequantisation and the
// finiteness check are independent per tensor, and the sources are read-only maps); the error
// reported is the first failing tensor's in table order, whatever the number of threads.
typedef struct LoadJob {
    Store* s;
    const StTensor** st;     // safetensors: the checkpoint tensor of each table entry (or NULL)
    const GgufFile* gguf;    // GGUF: the file and the config it gave (or NULL)
    const ModelConfig* cfg;
    char (*err)[ERR_LEN];    // per table entry
    int* rc;                 // per table entry, 0 = loaded
} LoadJob;

static void load_task(void* arg, int64_t task) {
    LoadJob* job = arg;
    const int i = (int)task;
    const TensorDesc* d = &job->s->tt->t[i];
    if (d->tied_to >= 0) return;
    float* out = store_param(job->s, i);
    job->rc[i] = job->gguf ? gguf_read_hf_tensor(job->gguf, job->cfg, d, out, job->err[i])
                           : st_tensor_to_f32(job->st[i], out, d->numel, job->err[i]);
}

static int load_all(LoadJob* job, char* err) {
    const int n = job->s->tt->n;
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

// ----------------------------------------------------------------------------
// safetensors

int loader_load_safetensors(Store* s, const StCheckpoint* ck, int* n_unused, char* err) {
    const TensorTable* tt = s->tt;
    char terr[ERR_LEN];
    // names and shapes first (cheap, in table order), then the conversions in parallel
    LoadJob job = {.s = s, .st = calloc_check((size_t)(tt->n > 0 ? tt->n : 1), sizeof(StTensor*))};
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to >= 0) continue;
        const StTensor* st = st_checkpoint_find(ck, d->hf_name);
        job.st[i] = st;
        if (!st) {
            free(job.st);
            return errorf(err, "checkpoint has no tensor '%s'", d->hf_name);
        }
        int shape_ok = st->ndim == d->ndim;
        for (int k = 0; shape_ok && k < d->ndim; k++) shape_ok = st->shape[k] == d->shape[k];
        if (!shape_ok) {
            char want[64], got[64];
            if (d->ndim == 1) snprintf(want, sizeof want, "[%lld]", (long long)d->shape[0]);
            else snprintf(want, sizeof want, "[%lld, %lld]", (long long)d->shape[0], (long long)d->shape[1]);
            int off = snprintf(got, sizeof got, "[");
            for (int k = 0; k < st->ndim && off < (int)sizeof got - 24; k++)
                off += snprintf(got + off, sizeof got - off, k ? ", %lld" : "%lld", (long long)st->shape[k]);
            snprintf(got + off, sizeof got - off, "]");
            free(job.st);
            return errorf(err, "%s: tensor '%s' has shape %s, the config needs %s", st->file,
                          d->hf_name, got, want);
        }
    }
    const int rc = load_all(&job, err);
    free(job.st);
    if (rc != 0) return rc;
    // Report checkpoint tensors we do not use. A tied model may carry lm_head.weight: accept it
    // only if it equals the embedding, otherwise tying would silently change the model.
    int unused = 0;
    for (int k = 0; k < ck->n_tensors; k++) {
        const char* name = ck->tensors[k]->name;
        if (tensor_table_find_hf(tt, name) >= 0) continue;
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

// ----------------------------------------------------------------------------
// GGUF

int loader_load_gguf(Store* s, const GgufFile* f, const ModelConfig* cfg, int* n_unused,
                     char* err) {
    const TensorTable* tt = s->tt;
    LoadJob job = {.s = s, .gguf = f, .cfg = cfg};
    if (load_all(&job, err) != 0) return -1;
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
