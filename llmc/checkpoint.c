/*
 * checkpoint.c — model source resolution (HF, safetensors, GGUF), HF-layout saving, --dump-state,
 * training-state checkpoints (save, find, verify, load). The HF / GGUF exports declared in
 * checkpoint.h live in export.c.
 *
 * Crash safety of a training-state checkpoint: every file is written through the atomic-write
 * helper (common.h: a temporary name, fsync, rename, directory fsync); the whole directory is
 * built as step_<N>.tmp, fsync'd and renamed to step_<N>, whose parent is fsync'd; DONE is
 * written last.
 * A reader only trusts directories named step_<N> that hold DONE, so a crash at any point leaves
 * either the previous complete checkpoints or the new one, never a torn one.
 *
 * Corruption after the fact (a disk error, a copy cut short, a stray write) is what DONE's
 * checksums catch: it records every file's size and CRC-32C, computed while the file was written;
 * --resume verifies them and falls back to the newest checkpoint that is intact.
 */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "crc32c.h"
#include "json.h"
#include "loader.h"
#include "lora.h"
#include "progress.h"

// ----------------------------------------------------------------------------
// --model resolution

static void dir_of(const char* path, char* out, size_t cap) {
    str_copy(out, cap, path);
    char* slash = strrchr(out, '/');
    if (slash)
        *slash = '\0';
    else
        str_copy(out, cap, ".");
}

static int resolve_gguf(ModelSource* src, const char* spec, char* err) {
    if (!file_exists(spec)) return errorf(err, "%s: no such file", spec);
    if (gguf_open(&src->gguf, spec, err) != 0) return -1;
    if (gguf_config(&src->gguf, &src->cfg, err) != 0) {
        gguf_close(&src->gguf);
        return -1;
    }
    if (src->gguf.nonsequential)
        printf("warning: %s: tensor offsets are valid but not in the writers' packed order\n",
               spec);
    gguf_tokenizer_extract(&src->gguf, &src->tokenizer);
    src->kind = SOURCE_GGUF;
    src->has_weights = 1;
    return 0;
}

// How a Qwen3-MoE checkpoint holds its experts: the hub's one tensor per expert, or the fused
// pair transformers 5 may save (config.json does not say). GPT-OSS has one layout.
static void detect_expert_layout(ModelConfig* c, const StCheckpoint* ck) {
    if (c->family != FAMILY_QWEN3MOE) return;
    for (int b = 0; b < c->L; b++) {
        if (!config_block_is_moe(c, b)) continue;
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", b);
        if (st_checkpoint_find(ck, name)) c->expert_layout = EXPERTS_FUSED;
        return;
    }
}

int checkpoint_resolve_model(ModelSource* src, const char* spec, char* err) {
    memset(src, 0, sizeof *src);
    char dir[1024];
    if (dir_exists(spec)) {
        if (snprintf(src->config_path, sizeof src->config_path, "%s/config.json", spec) >=
            (int)sizeof src->config_path)
            return errorf(err, "%s: path too long", spec);
        if (!file_exists(src->config_path))
            return errorf(err, "%s: directory has no config.json (expected an HF model directory)",
                          spec);
        if (config_from_hf_json(&src->cfg, src->config_path, err) != 0) return -1;
        if (st_checkpoint_open(&src->ck, spec, err) != 0) return -1;
        detect_expert_layout(&src->cfg, &src->ck);
        str_copy(src->hf_dir, sizeof src->hf_dir, spec);
        src->kind = SOURCE_SAFETENSORS;
        src->has_weights = 1;
        return 0;
    }
    if (str_ends_with(spec, ".gguf")) return resolve_gguf(src, spec, err);
    if (str_ends_with(spec, ".json")) {
        if (!file_exists(spec)) return errorf(err, "%s: no such file", spec);
        str_copy(src->config_path, sizeof src->config_path, spec);
        dir_of(spec, src->hf_dir, sizeof src->hf_dir);  // its tokenizer files, if any
        return config_from_hf_json(&src->cfg, spec, err);
    }
    if (str_ends_with(spec, ".safetensors")) {
        if (!file_exists(spec)) return errorf(err, "%s: no such file", spec);
        dir_of(spec, dir, sizeof dir);
        if (snprintf(src->config_path, sizeof src->config_path, "%s/config.json", dir) >=
            (int)sizeof src->config_path)
            return errorf(err, "%s: path too long", spec);
        if (!file_exists(src->config_path))
            return errorf(err, "%s: no config.json next to the checkpoint (looked for %s)", spec,
                          src->config_path);
        if (config_from_hf_json(&src->cfg, src->config_path, err) != 0) return -1;
        if (st_checkpoint_open(&src->ck, spec, err) != 0) return -1;
        detect_expert_layout(&src->cfg, &src->ck);
        str_copy(src->hf_dir, sizeof src->hf_dir, dir);
        src->kind = SOURCE_SAFETENSORS;
        src->has_weights = 1;
        return 0;
    }
    if (strchr(spec, '/') || file_exists(spec))
        return errorf(err, "%s: not a model directory, config.json, .safetensors or .gguf file",
                      spec);
    return config_from_preset(&src->cfg, spec, err);
}

int checkpoint_load_weights(const ModelSource* src, Store* s, int* n_unused, char* err) {
    if (!src->has_weights) return errorf(err, "the model source has no weights");
    if (src->kind == SOURCE_GGUF) return loader_load_gguf(s, &src->gguf, &src->cfg, n_unused, err);
    return loader_load_safetensors(s, &src->ck, n_unused, err);
}

void checkpoint_release_weights(ModelSource* src) {
    if (src->has_weights) {
        if (src->kind == SOURCE_GGUF)
            gguf_close(&src->gguf);
        else
            st_checkpoint_close(&src->ck);
    }
    src->has_weights = 0;
}

void checkpoint_close_source(ModelSource* src) {
    checkpoint_release_weights(src);
    gguf_tokenizer_free(&src->tokenizer);
    if (src->tok) tokenizer_free(src->tok);
    free(src->tok);
    src->tok = NULL;
}

// ----------------------------------------------------------------------------
// the tokenizer

int checkpoint_load_tokenizer(ModelSource* src, char* err) {
    char file[1200], terr[ERR_LEN];
    Tokenizer tok;
    int rc;
    if (src->kind == SOURCE_GGUF) {
        GgufString model;
        if (!src->has_weights || src->tokenizer.n_kv == 0) return 0;
        // our exports of a model without a tokenizer say so
        if (gguf_get_string(&src->gguf, "tokenizer.ggml.model", &model) == 1 && model.n == 8 &&
            memcmp(model.s, "no_vocab", 8) == 0)
            return 0;
        str_copy(file, sizeof file, src->gguf.path);
        rc = tokenizer_load_gguf(&tok, &src->gguf, terr);
    } else {
        if (!src->hf_dir[0]) return 0;
        snprintf(file, sizeof file, "%s/tokenizer.json", src->hf_dir);
        if (!file_exists(file)) return 0;
        rc = tokenizer_load(&tok, src->hf_dir, terr);
    }
    if (rc != 0) {
        printf("warning: %s; the tokenizer is not used (no prompt encoding, samples print ids)\n",
               terr);
        return 0;
    }
    if (tok.n_vocab > src->cfg.V) {
        errorf(err, "%s: the tokenizer has %d tokens, more than the model's vocabulary of %d "
                    "(vocab_size)", file, tok.n_vocab, src->cfg.V);
        tokenizer_free(&tok);
        return -1;
    }
    printf("tokenizer: %d tokens from %s\n", tok.n_vocab, file);
    src->tok = malloc_check(sizeof tok);
    *src->tok = tok;
    return 0;
}

// ----------------------------------------------------------------------------
// saving

// The files of a checkpoint directory with their sizes and CRC-32C, as DONE records them.
#define CKPT_MAX_FILES 8
typedef struct CkptFiles {
    int n;
    struct {
        char name[64];
        uint64_t bytes;
        uint32_t crc;
    } f[CKPT_MAX_FILES];
} CkptFiles;

static void files_add(CkptFiles* cf, const char* name, uint64_t bytes, uint32_t crc) {
    if (!cf) return;
    if (cf->n == CKPT_MAX_FILES) fatal("internal: more than %d checkpoint files", CKPT_MAX_FILES);
    str_copy(cf->f[cf->n].name, sizeof cf->f[cf->n].name, name);
    cf->f[cf->n].bytes = bytes;
    cf->f[cf->n].crc = crc;
    cf->n++;
}

// A whole buffer written atomically to dir/name, its checksum recorded in cf (may be NULL).
static int write_buffer(const char* dir, const char* name, const char* data, size_t len,
                        CkptFiles* cf, char* err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (file_write_atomic(path, data, len, err) != 0) return -1;
    files_add(cf, name, len, crc32c(data, len));
    return 0;
}

// model.safetensors and config.json of dir; cf (may be NULL) records their checksums.
// A data-parallel checkpoint (CkptGather): the layer and field of each tensor a writer was given
// (in the order added), and the one the Store holds complete now.
typedef struct GatherHook {
    const CkptGather* g;
    int* field;  // 0 the fp32 weights, 1 AdamW m, 2 v; -1: none (step, loader, rng)
    int* layer;
    int cur_field, cur_layer;
} GatherHook;

static void gather_hook_init(GatherHook* h, const CkptGather* g, int cap) {
    h->g = g;
    h->field = malloc_check((size_t)(cap > 0 ? cap : 1) * sizeof(int));
    h->layer = malloc_check((size_t)(cap > 0 ? cap : 1) * sizeof(int));
    h->cur_field = h->cur_layer = -1;
}

static void gather_hook_free(GatherHook* h) {
    free(h->field);
    free(h->layer);
}

// Before a tensor's bytes are written: its layer and field gathered when they change (the
// writer's file order, the same on every rank: the gathers are collectives).
static int gather_before(void* ctx, int index, char* err) {
    GatherHook* h = ctx;
    const int f = h->field[index], l = h->layer[index];
    if (f < 0 || (f == h->cur_field && l == h->cur_layer)) return 0;
    h->cur_field = f;
    h->cur_layer = l;
    return h->g->layer(h->g->ctx, f, l, err);
}

// Write (or, for a rank that does not write, g && !g->writer, only visit) w: its gathers run in
// file order either way.
static int writer_finish(StWriter* w, const char* path, GatherHook* h, char* err) {
    if (h && h->g) {
        w->before = gather_before;
        w->before_ctx = h;
        if (!h->g->writer) return st_writer_visit(w, err);
    }
    return st_writer_write(w, path, err);
}

static int save_hf_gathered(const char* dir, const Model* m, const Store* s, CkptFiles* cf,
                            const CkptGather* g, char* err) {
    const int writes = !g || g->writer;
    if (writes && mkdir_p(dir, err) != 0) return -1;
    char path[4096];
    StWriter w;
    st_writer_init(&w);
    st_writer_meta(&w, "format", "pt");
    GatherHook h;
    gather_hook_init(&h, g, m->tt.n_hf);
    for (int j = 0; j < m->tt.n_hf; j++) {  // the HF view: the layout the model came in
        const HfTensor* v = &m->tt.hf[j];
        const TensorDesc* d = &m->tt.t[v->index];
        h.field[j] = 0;
        h.layer[j] = d->owner_layer;
        // (store_param would refuse a released frozen base; a streamed checkpoint is full
        // training's: LoRA's adapters are gathered whole and written as one process writes them)
        const float* x = writes ? store_param(s, v->index) + v->offset
                                : s->param[d->owner_layer] + d->param_offset + v->offset;
        st_writer_add(&w, v->name, ST_F32, v->ndim, v->shape, x);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    int rc = writer_finish(&w, path, g ? &h : NULL, err);
    if (rc == 0 && writes) files_add(cf, "model.safetensors", w.file_bytes, w.file_crc32c);
    st_writer_free(&w);
    gather_hook_free(&h);
    if (rc != 0) return -1;
    if (!writes) return 0;
    char* json = config_to_hf_json(&m->cfg);
    rc = write_buffer(dir, "config.json", json, strlen(json), cf, err);
    free(json);
    return rc;
}

static int save_hf(const char* dir, const Model* m, const Store* s, CkptFiles* cf, char* err) {
    return save_hf_gathered(dir, m, s, cf, NULL, err);
}

int checkpoint_save_hf(const char* dir, const Model* m, const Store* s, char* err) {
    return save_hf(dir, m, s, NULL, err);
}

// With LoRA: grad.<PEFT key> of the adapters, the only gradients computed.
static int dump_lora_state(const char* path, const Model* m, const Store* s, float loss,
                           char* err) {
    StWriter w;
    st_writer_init(&w);
    int64_t one = 1;
    st_writer_add(&w, "loss", ST_F32, 1, &one, &loss);
    char** names = calloc_check((size_t)m->tt.n, sizeof(char*));
    float** grads = calloc_check((size_t)m->tt.n, sizeof(float*));  // in PEFT's layout
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->lora_target < 0) continue;
        size_t len = strlen(d->hf_name) + 6;
        names[i] = malloc_check(len);
        snprintf(names[i], len, "grad.%s", d->hf_name);
        int64_t shape[2];
        grads[i] = malloc_check((size_t)d->numel * sizeof(float));
        lora_to_peft(m, i, store_grad(s, i), grads[i], shape);
        st_writer_add(&w, names[i], ST_F32, 2, shape, grads[i]);
    }
    int rc = st_writer_write(&w, path, err);
    st_writer_free(&w);
    for (int i = 0; i < m->tt.n; i++) free(names[i]), free(grads[i]);
    free(names);
    free(grads);
    return rc;
}

int checkpoint_dump_state(const char* path, const Model* m, const Store* s, float loss, char* err) {
    if (m->tt.lora.r > 0) return dump_lora_state(path, m, s, loss, err);
    StWriter w;
    st_writer_init(&w);
    int64_t one = 1;
    st_writer_add(&w, "loss", ST_F32, 1, &one, &loss);
    // under the checkpoint's own tensor names (the HF view)
    char** names = calloc_check((size_t)(m->tt.n_hf > 0 ? m->tt.n_hf : 1), sizeof(char*));
    for (int j = 0; j < m->tt.n_hf; j++) {
        const HfTensor* v = &m->tt.hf[j];
        size_t len = strlen(v->name) + 6;
        names[j] = malloc_check(len);
        snprintf(names[j], len, "grad.%s", v->name);
        st_writer_add(&w, names[j], ST_F32, v->ndim, v->shape, store_grad(s, v->index) + v->offset);
    }
    int rc = st_writer_write(&w, path, err);
    st_writer_free(&w);
    for (int j = 0; j < m->tt.n_hf; j++) free(names[j]);
    free(names);
    return rc;
}

// ----------------------------------------------------------------------------
// directory helpers

// Remove a checkpoint directory we wrote: regular files only (one level), then the directory.
// Anything else inside (a subdirectory) is refused rather than deleted recursively.
static int remove_flat_dir(const char* dir, char* err) {
    DIR* d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : errorf(err, "%s: cannot open: %s", dir, strerror(errno));
    char path[4096];
    int rc = 0;
    struct dirent* e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (unlink(path) != 0)
            rc = errorf(err, "%s: cannot remove (checkpoint directories hold only files): %s", path,
                        strerror(errno));
    }
    closedir(d);
    if (rc == 0 && rmdir(dir) != 0) rc = errorf(err, "%s: cannot remove: %s", dir, strerror(errno));
    return rc;
}

// "step_<digits>" -> the step; -1 for anything else (including "step_<N>.tmp" and leading
// zeros, so that the name we build from the number is the directory found).
static int64_t parse_step_name(const char* name) {
    if (strncmp(name, "step_", 5) != 0) return -1;
    const char* p = name + 5;
    if (!*p || (p[0] == '0' && p[1] != '\0')) return -1;
    int64_t v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9' || v > (INT64_MAX - 9) / 10) return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

static int compare_steps(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return (x > y) - (x < y);
}

// Steps of the complete checkpoints in dir, ascending (malloc'd; *n entries).
static int64_t* list_complete_steps(const char* dir, int* n) {
    *n = 0;
    DIR* d = opendir(dir);
    if (!d) return NULL;
    int cap = 0;
    int64_t* steps = NULL;
    char path[4096];
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int64_t step = parse_step_name(e->d_name);
        if (step < 0) continue;
        snprintf(path, sizeof path, "%s/%s/DONE", dir, e->d_name);
        if (!file_exists(path)) continue;  // half-written: ignored
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            steps = realloc_check(steps, (size_t)cap * sizeof(int64_t));
        }
        steps[(*n)++] = step;
    }
    closedir(d);
    if (*n > 1) qsort(steps, (size_t)*n, sizeof(int64_t), compare_steps);
    return steps;
}

// ----------------------------------------------------------------------------
// training state

void train_state_init(TrainState* ts, uint32_t seed) {
    memset(ts, 0, sizeof *ts);
    rng_seed(&ts->rng, seed);
}

void train_state_free(TrainState* ts) {
    if (ts->pending && ts->pending_owned) {
        // layers share one allocation (see read_pending)
        free(ts->pending[0]);
    }
    if (ts->pending_owned) free(ts->pending);
    ts->pending = NULL;
    ts->pending_bytes = 0;
    ts->pending_owned = 0;
}

void train_state_free_rl(TrainState* ts) {
    if (ts->rl_state_owned) free((void*)ts->rl_state);
    ts->rl_state = NULL;
    ts->rl_state_bytes = 0;
    ts->rl_state_owned = 0;
}

static int write_pending(const char* path, const Model* m, const TrainState* ts, CkptFiles* cf,
                         char* err) {
    StWriter w;
    st_writer_init(&w);
    st_writer_meta(&w, "format", "train_roundpipe-pending-weights");
    char** names = calloc_check((size_t)m->tt.n_layers, sizeof(char*));
    for (int l = 0; l < m->tt.n_layers; l++) {
        // the layer's trainable tensors (the end of its slab): all of it for full training, the
        // adapters with LoRA (the frozen base is the same in every iteration)
        int64_t n = m->tt.state_numel[l];
        names[l] = malloc_check(32);
        snprintf(names[l], 32, "layer.%d", l);
        st_writer_add(&w, names[l], ts->pending_bytes == 2 ? ST_BF16 : ST_F32, 1, &n,
                      ts->pending[l]);
    }
    const double update[2] = {ts->pending_norm, ts->pending_lr};
    const int64_t two = 2;
    st_writer_add(&w, "update", ST_F64, 1, &two, update);
    int rc = st_writer_write(&w, path, err);
    if (rc == 0) files_add(cf, "pending_weights.safetensors", w.file_bytes, w.file_crc32c);
    st_writer_free(&w);
    for (int l = 0; l < m->tt.n_layers; l++) free(names[l]);
    free(names);
    return rc;
}

// Load pending_weights.safetensors if the checkpoint has one (0 without: ts->pending_bytes 0).
static int read_pending(const char* step_dir, const Model* m, TrainState* ts, char* err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/pending_weights.safetensors", step_dir);
    if (!file_exists(path)) return 0;
    StFile f;
    if (st_open(&f, path, err) != 0) return -1;
    const int NL = m->tt.n_layers;
    int bytes = 0;
    size_t total = 0;
    char name[32];
    for (int l = 0; l < NL; l++) {
        snprintf(name, sizeof name, "layer.%d", l);
        const StTensor* t = st_find(&f, name);
        int b = t ? (t->dtype == ST_BF16 ? 2 : t->dtype == ST_F32 ? 4 : 0) : 0;
        if (!t || b == 0 || t->ndim != 1 || t->numel != m->tt.state_numel[l] ||
            (bytes && b != bytes)) {
            st_close(&f);
            return errorf(err, "%s: tensor '%s' missing or not a [%lld] BF16/F32 vector", path,
                          name, (long long)m->tt.state_numel[l]);
        }
        bytes = b;
        total += (size_t)t->nbytes;
    }
    const StTensor* u = st_find(&f, "update");
    if (!u || u->dtype != ST_F64 || u->ndim != 1 || u->numel != 2) {
        st_close(&f);
        return errorf(err, "%s: tensor 'update' missing or not a [2] F64 vector", path);
    }
    double update[2];
    memcpy(update, u->data, sizeof update);
    if (!isfinite(update[0]) || !isfinite(update[1]) || update[0] < 0) {
        st_close(&f);
        return errorf(err, "%s: tensor 'update' holds a bad norm/lr", path);
    }
    ts->pending_norm = update[0];
    ts->pending_lr = update[1];
    ts->pending = calloc_check((size_t)NL, sizeof(void*));
    char* buf = malloc_check(total ? total : 1);
    size_t off = 0;
    for (int l = 0; l < NL; l++) {
        snprintf(name, sizeof name, "layer.%d", l);
        const StTensor* t = st_find(&f, name);
        ts->pending[l] = buf + off;
        if (t->nbytes) memcpy(buf + off, t->data, (size_t)t->nbytes);
        off += (size_t)t->nbytes;
    }
    st_close(&f);
    ts->pending_bytes = bytes;
    ts->pending_owned = 1;
    return 0;
}

static int write_train_state(const char* path, const Model* m, const Store* s, const TrainState* ts,
                             CkptFiles* cf, const CkptGather* g, char* err) {
    StWriter w;
    st_writer_init(&w);
    GatherHook h;
    gather_hook_init(&h, g, 2 * m->tt.n + 6);
    for (int i = 0; i < 6; i++) h.field[i] = -1;  // (step, loader, rng)
    st_writer_meta(&w, "format", "train_roundpipe-state");
    int64_t one = 1, n_dl = DATALOADER_STATE_BYTES, n_mt = 624;
    int32_t rng_index = ts->rng.index, rng_has_spare = ts->rng.has_spare;
    st_writer_add(&w, "step", ST_I64, 1, &one, &ts->step);
    st_writer_add(&w, "dataloader", ST_U8, 1, &n_dl, ts->train_loader);
    st_writer_add(&w, "rng.mt", ST_U32, 1, &n_mt, ts->rng.mt);
    st_writer_add(&w, "rng.index", ST_I32, 1, &one, &rng_index);
    st_writer_add(&w, "rng.has_spare", ST_I32, 1, &one, &rng_has_spare);
    st_writer_add(&w, "rng.spare", ST_F32, 1, &one, &ts->rng.spare);
    char name[128];
    for (int i = 0; i < m->tt.n; i++) {  // the trainable tensors' state (LoRA: the adapters')
        const TensorDesc* d = &m->tt.t[i];
        if (d->tied_to >= 0 || !d->trainable) continue;
        snprintf(name, sizeof name, "m.%s", d->hf_name);
        h.field[w.n] = 1;
        h.layer[w.n] = d->owner_layer;
        st_writer_add(&w, name, ST_F32, d->ndim, d->shape, s->m[d->owner_layer] + d->state_offset);
        snprintf(name, sizeof name, "v.%s", d->hf_name);
        h.field[w.n] = 2;
        h.layer[w.n] = d->owner_layer;
        st_writer_add(&w, name, ST_F32, d->ndim, d->shape, s->v[d->owner_layer] + d->state_offset);
    }
    int rc = writer_finish(&w, path, g ? &h : NULL, err);
    if (rc == 0 && (!g || g->writer))
        files_add(cf, "train_state.safetensors", w.file_bytes, w.file_crc32c);
    st_writer_free(&w);
    gather_hook_free(&h);
    return rc;
}

// Keep the newest `keep` complete checkpoints.
static int apply_retention(const char* dir, int keep, char* err) {
    if (keep <= 0) return 0;
    int n = 0;
    int64_t* steps = list_complete_steps(dir, &n);
    int rc = 0;
    char path[4096];
    for (int i = 0; i < n - keep && rc == 0; i++) {
        snprintf(path, sizeof path, "%s/step_%lld", dir, (long long)steps[i]);
        // DONE goes first, so an interrupted removal leaves an incomplete (ignored) directory
        char done[4200];
        snprintf(done, sizeof done, "%s/DONE", path);
        if (unlink(done) != 0) rc = errorf(err, "%s: cannot remove: %s", done, strerror(errno));
        if (rc == 0) rc = remove_flat_dir(path, err);
    }
    free(steps);
    return rc;
}

int checkpoint_save_state(const char* dir, int keep, const Model* m, const Store* s,
                          const TrainState* ts, const char* args_json, char* err) {
    return checkpoint_save_state_gathered(dir, keep, m, s, ts, args_json, NULL, err);
}

int checkpoint_save_state_gathered(const char* dir, int keep, const Model* m, const Store* s,
                                   const TrainState* ts, const char* args_json,
                                   const CkptGather* g, char* err) {
    char tmp[4096], final[4096], path[4200];
    if (g && !g->writer) {
        // a rank that does not write: the same gathers in the same order as the writer's files
        if (save_hf_gathered("", m, s, NULL, g, err) != 0) return -1;
        return write_train_state("", m, s, ts, NULL, g, err);
    }
    // (data parallel gathers LoRA's adapters and their m and v whole onto the writer first: the
    // PEFT files are not written layer by layer)
    if (g && m->tt.lora.r > 0)
        return errorf(err, "a checkpoint of LoRA adapters streamed layer by layer (internal "
                           "error: data parallel gathers the adapters whole before writing)");
    if (snprintf(tmp, sizeof tmp, "%s/step_%lld.tmp", dir, (long long)ts->step) >= (int)sizeof tmp)
        return errorf(err, "%s: path too long", dir);
    snprintf(final, sizeof final, "%s/step_%lld", dir, (long long)ts->step);
    if (mkdir_p(dir, err) != 0) return -1;
    if (remove_flat_dir(tmp, err) != 0) return -1;  // left over from a crash
    CkptFiles cf = {0};
    if (m->tt.lora.r > 0) {
        // LoRA: the frozen base is not copied (a resumed run loads it from --model again); the
        // config, and the adapters as a PEFT adapter directory
        if (mkdir_p(tmp, err) != 0) return -1;
        char* json = config_to_hf_json(&m->cfg);
        int rc = write_buffer(tmp, "config.json", json, strlen(json), &cf, err);
        free(json);
        LoraFile lf[2];
        if (rc != 0 || lora_save_peft(tmp, m, s, "", lf, err) != 0) return -1;
        for (int k = 0; k < 2; k++) files_add(&cf, lf[k].name, lf[k].bytes, lf[k].crc);
    } else if (save_hf_gathered(tmp, m, s, &cf, g, err) != 0) {
        return -1;
    }
    snprintf(path, sizeof path, "%s/train_state.safetensors", tmp);
    if (write_train_state(path, m, s, ts, &cf, g, err) != 0) return -1;
    if (write_buffer(tmp, "args.json", args_json, strlen(args_json), &cf, err) != 0) return -1;
    if (ts->pending_bytes) {
        snprintf(path, sizeof path, "%s/pending_weights.safetensors", tmp);
        if (write_pending(path, m, ts, &cf, err) != 0) return -1;
    }
    if (ts->rl_state_bytes &&
        write_buffer(tmp, "rl_state.bin", ts->rl_state, ts->rl_state_bytes, &cf, err) != 0)
        return -1;
    if (fsync_dir(tmp, err) != 0) return -1;
    // an older checkpoint of the same step (a re-run into the same --out) is replaced
    if (remove_flat_dir(final, err) != 0) return -1;
    if (rename(tmp, final) != 0)
        return errorf(err, "%s: rename from %s failed: %s", final, tmp, strerror(errno));
    if (fsync_dir(dir, err) != 0) return -1;
    // DONE: the step, then one line per file: name, size in bytes, CRC-32C (8 hex digits)
    char done[64 + CKPT_MAX_FILES * 128];
    int len = snprintf(done, sizeof done, "step %lld\n", (long long)ts->step);
    for (int i = 0; i < cf.n; i++)
        len += snprintf(done + len, sizeof done - (size_t)len, "%s %llu %08x\n", cf.f[i].name,
                        (unsigned long long)cf.f[i].bytes, (unsigned)cf.f[i].crc);
    snprintf(path, sizeof path, "%s/DONE", final);
    if (file_write_atomic(path, done, (size_t)len, err) != 0) return -1;
    if (fsync_dir(final, err) != 0) return -1;
    return apply_retention(dir, keep, err);
}

int checkpoint_find_latest(const char* dir, char* path, size_t cap, int64_t* step, char* err) {
    if (!dir_exists(dir)) return 0;
    int n = 0;
    int64_t* steps = list_complete_steps(dir, &n);
    int found = n > 0;
    if (found) {
        *step = steps[n - 1];
        if (snprintf(path, cap, "%s/step_%lld", dir, (long long)*step) >= (int)cap) {
            free(steps);
            return errorf(err, "%s: path too long", dir);
        }
    }
    free(steps);
    return found;
}

// ----------------------------------------------------------------------------
// checksums

// Size and CRC-32C of the file at path: 0, or -1 with err (it cannot be opened or read).
static int file_checksum(const char* path, uint64_t* bytes, uint32_t* crc, char* err) {
    FILE* f = fopen(path, "rb");
    if (!f) return errorf(err, "%s: cannot open: %s", path, strerror(errno));
    const size_t cap = 8u << 20;
    char* buf = malloc_check(cap);
    uint64_t total = 0;
    uint32_t c = 0;
    size_t n;
    while ((n = fread(buf, 1, cap, f)) > 0) {
        c = crc32c_update(c, buf, n);
        total += n;
    }
    const int failed = ferror(f);
    free(buf);
    fclose(f);  // read-only: nothing to lose at close
    if (failed) return errorf(err, "%s: read error", path);
    *bytes = total;
    *crc = c;
    return 0;
}

int checkpoint_verify(const char* step_dir, int* n_files, char* err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/DONE", step_dir);
    size_t len;
    char* text = file_read_all(path, 1 << 16, &len, err);
    if (!text) return -1;
    int rc = 1, n = 0, line_no = 0;
    char* save = NULL;
    for (char* line = strtok_r(text, "\n", &save); line && rc == 1;
         line = strtok_r(NULL, "\n", &save)) {
        line_no++;
        if (line_no == 1 && strncmp(line, "step ", 5) == 0) continue;
        // NAME SIZE CRC32C: a plain file name of this directory, a decimal size, 8 hex digits
        char name[64];
        unsigned long long want_bytes;
        unsigned want_crc;
        int end = 0;
        if (sscanf(line, "%63[^ /] %llu %8x%n", name, &want_bytes, &want_crc, &end) != 3 ||
            line[end] != '\0' || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) {
            rc = errorf(err, "%s: line %d is not 'NAME SIZE CRC32C' (the marker is damaged)",
                        path, line_no);
            break;
        }
        char file[4300];
        snprintf(file, sizeof file, "%s/%s", step_dir, name);
        uint64_t bytes = 0;
        uint32_t crc = 0;
        char ferr[ERR_LEN];
        if (!file_exists(file))
            rc = errorf(err, "%s is missing (its DONE marker lists it)", file);
        else if (file_checksum(file, &bytes, &crc, ferr) != 0)
            rc = errorf(err, "%s", ferr);
        else if (bytes != want_bytes)
            rc = errorf(err, "%s has %llu bytes, its DONE marker records %llu (truncated or "
                        "overwritten)", file, (unsigned long long)bytes, want_bytes);
        else if (crc != want_crc)
            rc = errorf(err, "%s is corrupt (CRC-32C %08x, its DONE marker records %08x)", file,
                        (unsigned)crc, want_crc);
        if (rc == 1) n++;
    }
    free(text);
    if (rc == 1 && n == 0) rc = 0;  // an older marker: the step alone
    if (n_files) *n_files = n;
    return rc < 0 ? -1 : rc;
}

// The saved config must describe the same model (a checkpoint of another model would load
// with a shape error at best; this names the field).
static int check_same_model(const char* step_dir, const ModelConfig* have, char* err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", step_dir);
    ModelConfig c;
    if (config_from_hf_json(&c, path, err) != 0) return -1;
    if (c.family != have->family)
        return errorf(err,
                      "%s: the checkpoint is a %s model, this run's model is %s (resume with "
                      "the same --model)",
                      path, family_names[c.family], family_names[have->family]);
    struct {
        const char* name;
        long long saved, now;
    } f[] = {{"vocab_size", c.V, have->V},
             {"hidden_size", c.C, have->C},
             {"num_hidden_layers", c.L, have->L},
             {"num_attention_heads", c.H, have->H},
             {"num_key_value_heads", c.KVH, have->KVH},
             {"head_dim", c.HD, have->HD},
             {"intermediate_size", c.F, have->F},
             {"tie_word_embeddings", c.tied_embeddings, have->tied_embeddings}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].saved != f[i].now)
            return errorf(err,
                          "%s: the checkpoint's %s is %lld, this run's model has %lld (resume "
                          "with the same --model)",
                          path, f[i].name, f[i].saved, f[i].now);
    return 0;
}

// One tensor of train_state.safetensors with the expected dtype and element count.
static const StTensor* state_tensor(const StFile* f, const char* name, StDtype dt, int64_t numel,
                                    char* err) {
    const StTensor* t = st_find(f, name);
    if (!t) {
        errorf(err, "%s: tensor '%s' is missing", f->path, name);
        return NULL;
    }
    if (t->dtype != dt || t->numel != numel) {
        errorf(err, "%s: tensor '%s' is %s with %lld elements, expected %s with %lld", f->path,
               name, st_dtype_name(t->dtype), (long long)t->numel, st_dtype_name(dt),
               (long long)numel);
        return NULL;
    }
    return t;
}

static int read_train_state(const char* path, const Model* m, Store* s, TrainState* ts, char* err) {
    StFile f;
    if (st_open(&f, path, err) != 0) return -1;
    int rc = -1;
    const StTensor *step, *dl, *mt, *idx, *spare, *has_spare;
    if (!(step = state_tensor(&f, "step", ST_I64, 1, err)) ||
        !(dl = state_tensor(&f, "dataloader", ST_U8, DATALOADER_STATE_BYTES, err)) ||
        !(mt = state_tensor(&f, "rng.mt", ST_U32, 624, err)) ||
        !(idx = state_tensor(&f, "rng.index", ST_I32, 1, err)) ||
        !(has_spare = state_tensor(&f, "rng.has_spare", ST_I32, 1, err)) ||
        !(spare = state_tensor(&f, "rng.spare", ST_F32, 1, err)))
        goto done;
    memcpy(&ts->step, step->data, 8);
    memcpy(ts->train_loader, dl->data, DATALOADER_STATE_BYTES);
    memcpy(ts->rng.mt, mt->data, sizeof ts->rng.mt);
    int32_t index, hs;
    memcpy(&index, idx->data, 4);
    memcpy(&hs, has_spare->data, 4);
    memcpy(&ts->rng.spare, spare->data, 4);
    if (ts->step < 0 || index < 0 || index > 624 || (hs != 0 && hs != 1)) {
        errorf(err, "%s: step %lld, rng.index %d or rng.has_spare %d out of range", path,
               (long long)ts->step, index, hs);
        goto done;
    }
    ts->rng.index = index;
    ts->rng.has_spare = hs;
    char name[128];
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->tied_to >= 0 || !d->trainable) continue;
        for (int which = 0; which < 2; which++) {
            snprintf(name, sizeof name, "%c.%s", which ? 'v' : 'm', d->hf_name);
            const StTensor* t = state_tensor(&f, name, ST_F32, d->numel, err);
            float* dst = (which ? s->v : s->m)[d->owner_layer] + d->state_offset;
            if (!t) goto done;
            if (s->state_lo) {
                // a rank's Store (ZeRO-1): its shard of the state only, so the rest of the
                // slabs is never touched (state_tensor checked F32: the bytes are the values)
                const int l = d->owner_layer;
                const int64_t end = d->state_offset + d->numel;
                const int64_t a = s->state_lo[l] > d->state_offset ? s->state_lo[l]
                                                                   : d->state_offset;
                const int64_t b = s->state_hi[l] < end ? s->state_hi[l] : end;
                if (b > a)
                    memcpy((which ? s->v : s->m)[l] + a,
                           t->data + (size_t)(a - d->state_offset) * sizeof(float),
                           (size_t)(b - a) * sizeof(float));
            } else if (st_tensor_to_f32(t, dst, d->numel, err) != 0) {
                goto done;
            }
        }
    }
    s->step = ts->step;
    rc = 0;
done:
    st_close(&f);
    return rc;
}

// Warn about training flags that differ from the checkpoint's args.json (a changed --lr or
// --steps is legitimate, but the continuation is then not the run that was interrupted).
static void warn_changed_flags(const char* step_dir, const char* args_json) {
    static const char* const keys[] = {"model",
                                       "train",
                                       "batch",
                                       "seq",
                                       "micro-batches",
                                       "steps",
                                       "lr",
                                       "schedule",
                                       "warmup",
                                       "min-lr-frac",
                                       "decay-frac",
                                       "weight-decay",
                                       "decay-embeddings",
                                       "beta1",
                                       "beta2",
                                       "eps",
                                       "grad-clip",
                                       "shuffle",
                                       "seed",
                                       "lora-alpha",
                                       "lora-dropout",
                                       "rslora",
                                       NULL};
    char path[4200], err[ERR_LEN];
    snprintf(path, sizeof path, "%s/args.json", step_dir);
    size_t len;
    char* text = file_read_all(path, 1 << 20, &len, err);
    if (!text) {
        printf("warning: %s\n", err);
        return;
    }
    JsonDoc saved, now;
    int ok_saved = json_parse(text, len, &saved, err) == 0;
    int ok_now = ok_saved && json_parse(args_json, strlen(args_json), &now, err) == 0;
    free(text);
    if (!ok_now) {
        printf("warning: %s: %s\n", path, err);
        if (ok_saved) json_free(&saved);
        return;
    }
    for (int i = 0; keys[i]; i++) {
        const JsonValue* a = json_get(&saved.root, keys[i]);
        const JsonValue* b = json_get(&now.root, keys[i]);
        if (!a || !b) continue;
        int same = a->type == b->type && ((a->type == JSON_NUMBER && a->number == b->number) ||
                                          (a->type == JSON_STRING && strcmp(a->str, b->str) == 0));
        if (same) continue;
        if (a->type == JSON_STRING && b->type == JSON_STRING)
            printf("warning: resuming with --%s %s; the checkpoint was trained with %s\n", keys[i],
                   b->str, a->str);
        else if (a->type == JSON_NUMBER && b->type == JSON_NUMBER)
            printf("warning: resuming with --%s %g; the checkpoint was trained with %g\n", keys[i],
                   b->number, a->number);
    }
    json_free(&saved);
    json_free(&now);
}

int checkpoint_load_state(const char* step_dir, const Model* m, Store* s, TrainState* ts,
                          const char* args_json, char* err) {
    if (check_same_model(step_dir, &m->cfg, err) != 0) return -1;
    char path[4200];
    if (m->tt.lora.r > 0) {
        // the adapters; the frozen base is the caller's (checkpoint_init_weights)
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", step_dir);
        if (lora_load_weights(path, m, s, err) != 0) return -1;
    } else {
        StCheckpoint ck;
        if (st_checkpoint_open(&ck, step_dir, err) != 0) return -1;
        int unused = 0;
        int rc = loader_load_safetensors(s, &ck, &unused, err);
        st_checkpoint_close(&ck);
        if (rc != 0) return -1;
    }
    snprintf(path, sizeof path, "%s/train_state.safetensors", step_dir);
    if (read_train_state(path, m, s, ts, err) != 0) return -1;
    if (read_pending(step_dir, m, ts, err) != 0) return -1;
    snprintf(path, sizeof path, "%s/rl_state.bin", step_dir);
    if (file_exists(path)) {
        size_t len = 0;
        char* buf = file_read_all(path, (size_t)1 << 34, &len, err);
        if (!buf) return -1;
        ts->rl_state = buf;
        ts->rl_state_bytes = len;
        ts->rl_state_owned = 1;
    }
    int64_t named = parse_step_name(strrchr(step_dir, '/') ? strrchr(step_dir, '/') + 1 : step_dir);
    if (named >= 0 && named != ts->step)
        return errorf(err, "%s: holds step %lld but the directory is named for step %lld", path,
                      (long long)ts->step, (long long)named);
    if (args_json) warn_changed_flags(step_dir, args_json);
    return 0;
}

// --resume: the newest complete checkpoint in out_dir whose files match their checksums, into
// dir ("" when there is none: the run starts from step 0); each one passed over gets a line
// naming the damaged file and the checkpoint tried next. *verified: the files checked.
static int resume_pick(const char* out_dir, char* dir, size_t cap, int* verified, char* err) {
    dir[0] = '\0';
    int n = 0;
    int64_t* steps = dir_exists(out_dir) ? list_complete_steps(out_dir, &n) : NULL;
    if (n == 0) printf("--resume: no complete checkpoint in %s, starting from step 0\n", out_dir);
    char cand[4096], why[ERR_LEN];
    for (int i = n - 1; i >= 0 && !dir[0]; i--) {
        if (snprintf(cand, sizeof cand, "%s/step_%lld", out_dir, (long long)steps[i]) >=
            (int)sizeof cand) {
            free(steps);
            return errorf(err, "%s: path too long", out_dir);
        }
        const int v = checkpoint_verify(cand, verified, why);
        if (v < 0 && i > 0)
            printf("warning: --resume: %s; falling back to %s/step_%lld\n", why, out_dir,
                   (long long)steps[i - 1]);
        else if (v < 0)
            printf("warning: --resume: %s, and %s holds no older complete checkpoint: starting "
                   "from step 0\n", why, out_dir);
        else
            str_copy(dir, cap, cand);
        if (v == 0)
            printf("note: %s/DONE records no checksums (written by an older version): its files "
                   "are not verified\n", cand);
    }
    free(steps);
    return 0;
}

// The source's weights, or the seeded random init.
static int load_base(const InitOptions* o, const ModelSource* src, const Model* m, Store* s,
                     char* err) {
    if (!src->has_weights) {
        store_init_random(s, o->seed, o->init_std);
        return 0;
    }
    int unused = 0;
    if (checkpoint_load_weights(src, s, &unused, err) != 0) return -1;
    printf("loaded %sweights from %s%s\n", m->tt.lora.r > 0 ? "the base's " : "", o->model,
           unused ? " (some checkpoint tensors are unused by this model)" : "");
    return 0;
}

int checkpoint_init_weights(const InitOptions* o, ModelSource* src, const Model* m, Store* s,
                            TrainState* ts, const char* args_json, char* err) {
    train_state_init(ts, o->seed);
    char dir[4096] = "";
    int verified = 0;
    if (o->resume && resume_pick(o->out_dir, dir, sizeof dir, &verified, err) != 0) return -1;
    int rc = 0;
    const int lora = m->tt.lora.r > 0;
    if (dir[0] && lora) {
        // LoRA checkpoints hold the adapters only: the frozen base comes from the source (or the
        // same seeded random init) first
        rc = load_base(o, src, m, s, err);
        if (rc != 0) return -1;
    }
    if (dir[0]) {
        rc = checkpoint_load_state(dir, m, s, ts, args_json, err);
        if (rc == 0) {
            ts->resumed = 1;
            printf("resumed from %s (step %lld)", dir, (long long)ts->step);
            if (verified > 0) printf(", %d files verified (CRC-32C)", verified);
            printf("\n");
        }
    } else {
        rc = load_base(o, src, m, s, err);
        // the adapters of a fresh LoRA run: PEFT's init, or a PEFT adapter directory
        if (rc == 0 && lora && o->lora_init && o->lora_init[0]) {
            rc = lora_load_peft(o->lora_init, m, s, err);
            if (rc == 0) printf("loaded LoRA adapters from %s\n", o->lora_init);
        } else if (rc == 0 && lora) {
            lora_init_random(m, s, o->seed);
        }
    }
    if (!o->keep_source) checkpoint_release_weights(src);
    return rc;
}
