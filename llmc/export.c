/*
 * export.c — the trained model out of the Store for other tools (declared in checkpoint.h):
 * --export-hf (HF layout: safetensors in the export dtype, sharded past a size, the index,
 * config.json, the tokenizer) and --export-gguf (GGUF v3 for llama.cpp: architecture metadata,
 * tensors under llama.cpp's names and layouts, the tokenizer records). Training-state checkpoints
 * and resume live in checkpoint.c.
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
#include "progress.h"

// ----------------------------------------------------------------------------
// HF export

// Float tensor in the export dtype: the store's own memory for F32, a converted copy otherwise.
static const void* export_data(const float* src, int64_t n, StDtype dt, void** owned,
                               const char* name, char* err) {
    *owned = NULL;
    if (dt == ST_F32) return src;
    uint16_t* out = malloc_check((size_t)(n > 0 ? n : 1) * 2);
    for (int64_t i = 0; i < n; i++) {
        out[i] = dt == ST_BF16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
        if (dt == ST_F16 && (out[i] & 0x7c00u) == 0x7c00u && isfinite(src[i])) {
            free(out);
            errorf(err,
                   "tensor '%s' element %lld = %g overflows F16 (use --export-dtype bf16 or "
                   "f32)",
                   name, (long long)i, (double)src[i]);
            return NULL;
        }
    }
    *owned = out;
    return out;
}

// Weight files of an earlier export that a new one would leave inconsistent (a stale index is
// preferred by loaders over model.safetensors).
static void remove_old_weights(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return;
    char path[4096];
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int a, b, n = 0;
        int shard = sscanf(e->d_name, "model-%5d-of-%5d.safetensors%n", &a, &b, &n) == 2 &&
                    e->d_name[n] == '\0';
        if (shard || strcmp(e->d_name, "model.safetensors") == 0 ||
            strcmp(e->d_name, "model.safetensors.index.json") == 0) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    }
    closedir(d);
}

static void copy_tokenizer_files(const char* from, const char* to) {
    static const char* const names[] = {"tokenizer.json",
                                        "tokenizer_config.json",
                                        "special_tokens_map.json",
                                        "vocab.json",
                                        "merges.txt",
                                        "tokenizer.model",
                                        "generation_config.json",
                                        "chat_template.jinja",
                                        NULL};
    char src[4096], dst[4096], err[ERR_LEN];
    for (int i = 0; names[i]; i++) {
        snprintf(src, sizeof src, "%s/%s", from, names[i]);
        snprintf(dst, sizeof dst, "%s/%s", to, names[i]);
        if (!file_exists(src) || strcmp(src, dst) == 0) continue;
        size_t len;
        char* text = file_read_all(src, 256u << 20, &len, err);
        if (!text || file_write_atomic(dst, text, len, err) != 0)
            printf("warning: tokenizer file not copied: %s\n", err);
        free(text);
    }
}

double checkpoint_export_bytes(const Model* m, int hf, ExportDtype dtype, uint64_t shard_bytes,
                              int gguf) {
    const TensorTable* tt = &m->tt;
    double hf_bytes = 0.0, shard = 0.0, gguf_bytes = 0.0;
    // --export-hf in bf16/f16: each shard's converted tensors are held until the shard is
    // written (export_data), shards planned as checkpoint_export_hf plans them
    const uint64_t size = dtype == EXPORT_F32 ? 4 : 2;
    for (int i = 0; i < tt->n && hf && dtype != EXPORT_F32; i++) {
        if (tt->t[i].tied_to >= 0) continue;
        const double bytes = (double)tt->t[i].numel * (double)size;
        if (shard > 0 && shard + bytes > (double)shard_bytes) shard = 0;
        shard += bytes;
        if (shard > hf_bytes) hf_bytes = shard;
    }
    // --export-gguf of a LLaMA: the permuted q and k weights (fp32) wait for the write
    for (int i = 0; i < tt->n && gguf && m->cfg.family == FAMILY_LLAMA; i++)
        if (tt->t[i].tied_to < 0 && (tt->t[i].kind == TK_WQ || tt->t[i].kind == TK_WK))
            gguf_bytes += (double)tt->t[i].numel * sizeof(float);
    return hf_bytes > gguf_bytes ? hf_bytes : gguf_bytes;  // one export at a time
}

int checkpoint_export_hf(const char* dir, const Model* m, const Store* s, ExportDtype dtype,
                         uint64_t shard_bytes, const ModelSource* src, char* err) {
    const StDtype dt = dtype == EXPORT_BF16 ? ST_BF16 : dtype == EXPORT_F16 ? ST_F16 : ST_F32;
    if (mkdir_p(dir, err) != 0) return -1;
    // Plan the shards greedily in checkpoint order (the HF view: the layout the model came in), as
    // transformers does: a new shard starts when the next tensor would push a non-empty shard past
    // shard_bytes.
    const TensorTable* tt = &m->tt;
    int* shard_of = malloc_check((size_t)(tt->n_hf > 0 ? tt->n_hf : 1) * sizeof(int));
    int n_shards = 0;
    uint64_t in_shard = 0, total = 0;
    for (int j = 0; j < tt->n_hf; j++) {
        uint64_t bytes = (uint64_t)tt->hf[j].numel * (uint64_t)st_dtype_size(dt);
        if (n_shards == 0 || (in_shard > 0 && in_shard + bytes > shard_bytes)) {
            n_shards++;
            in_shard = 0;
        }
        in_shard += bytes;
        total += bytes;
        shard_of[j] = n_shards - 1;
    }
    remove_old_weights(dir);
    char path[4096], file[64];
    int rc = 0;
    Progress pg;  // a line on a terminal only: bytes written, shard by shard
    char what[96];
    snprintf(what, sizeof what, "exporting %s", dir);
    progress_begin(&pg, what, (double)total);
    for (int sh = 0; sh < n_shards && rc == 0; sh++) {
        if (n_shards == 1)
            snprintf(file, sizeof file, "model.safetensors");
        else
            snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", sh + 1, n_shards);
        snprintf(path, sizeof path, "%s/%s", dir, file);
        StWriter w;
        st_writer_init(&w);
        st_writer_meta(&w, "format", "pt");
        void** owned = calloc_check((size_t)(tt->n_hf > 0 ? tt->n_hf : 1), sizeof(void*));
        for (int j = 0; j < tt->n_hf && rc == 0; j++) {
            if (shard_of[j] != sh) continue;
            const HfTensor* v = &tt->hf[j];
            char cerr[ERR_LEN];
            const void* data = export_data(store_param(s, v->index) + v->offset, v->numel, dt,
                                           &owned[j], v->name, cerr);
            if (!data)
                rc = errorf(err, "%s: %s", path, cerr);
            else
                st_writer_add(&w, v->name, dt, v->ndim, v->shape, data);
        }
        if (rc == 0) rc = st_writer_write(&w, path, err);
        st_writer_free(&w);
        for (int j = 0; j < tt->n_hf; j++) free(owned[j]);
        free(owned);
        for (int j = 0; j < tt->n_hf; j++)
            if (shard_of[j] == sh)
                progress_add(&pg, (double)tt->hf[j].numel * (double)st_dtype_size(dt));
    }
    progress_end(&pg);
    if (rc == 0 && n_shards > 1) {
        char* buf = NULL;
        size_t len = 0;
        FILE* mf = open_memstream(&buf, &len);
        if (!mf) fatal("open_memstream failed");
        fprintf(mf, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {",
                (unsigned long long)total);
        for (int j = 0; j < tt->n_hf; j++) {
            fprintf(mf, "%s\n    ", j ? "," : "");
            json_write_string(mf, tt->hf[j].name);
            fprintf(mf, ": \"model-%05d-of-%05d.safetensors\"", shard_of[j] + 1, n_shards);
        }
        fprintf(mf, "\n  }\n}\n");
        if (ferror(mf) || fclose(mf) != 0) fatal("building the index failed");
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        rc = file_write_atomic(path, buf, len, err);
        free(buf);
    }
    free(shard_of);
    if (rc != 0) return -1;
    char* json = config_to_hf_json(&m->cfg);
    char* at = strstr(json, "\"dtype\": \"float32\"");
    if (at && dt != ST_F32) {  // the weights' dtype, as save_pretrained records it
        const char* name = dt == ST_BF16 ? "bfloat16" : "float16";
        size_t head = (size_t)(at - json);
        const char* tail = at + strlen("\"dtype\": \"float32\"");
        size_t n = head + strlen(tail) + 32;
        char* fixed = malloc_check(n);
        snprintf(fixed, n, "%.*s\"dtype\": \"%s\"%s", (int)head, json, name, tail);
        free(json);
        json = fixed;
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    rc = file_write_atomic(path, json, strlen(json), err);
    free(json);
    if (rc == 0 && src && src->hf_dir[0]) copy_tokenizer_files(src->hf_dir, dir);
    // a GGUF source's tokenizer becomes tokenizer.json (an HF source's files are copied above)
    if (rc == 0 && src && src->tok && src->kind == SOURCE_GGUF)
        rc = tokenizer_write_hf(src->tok, dir, err);
    return rc;
}

// ----------------------------------------------------------------------------
// GGUF export

int checkpoint_export_gguf(const char* path, const Model* m, const Store* s, ExportDtype dtype,
                           const ModelSource* src, char* err) {
    const ModelConfig* c = &m->cfg;
    if (c->family == FAMILY_QWEN3MOE && config_num_moe_blocks(c) != c->L)
        return errorf(err, "%s: llama.cpp's qwen3moe GGUF has no dense MLP blocks, this model has "
                           "%d (mlp_only_layers / decoder_sparse_step): export to HF instead",
                      path, c->L - config_num_moe_blocks(c));
    const GgmlType wt = dtype == EXPORT_BF16  ? GGML_TYPE_BF16
                        : dtype == EXPORT_F16 ? GGML_TYPE_F16
                                              : GGML_TYPE_F32;
    GgufWriter w;
    gguf_writer_init(&w);
    gguf_writer_add_config(&w, c);
    // LlamaFileType: ALL_F32 0, MOSTLY_F16 1, MOSTLY_BF16 32
    gguf_writer_add_u32(&w, "general.file_type",
                        wt == GGML_TYPE_F32   ? 0
                        : wt == GGML_TYPE_F16 ? 1
                                              : 32);
    GgufTokenizer written = {0};  // records from an HF source's tokenizer
    if (src && src->tokenizer.n_kv > 0) {
        gguf_writer_add_records(&w, src->tokenizer.records, src->tokenizer.len,
                                src->tokenizer.n_kv);
    } else if (src && src->tok) {
        tokenizer_gguf_records(src->tok, c->V, &written);
        gguf_writer_add_records(&w, written.records, written.len, written.n_kv);
    } else {
        gguf_writer_add_string(&w, "tokenizer.ggml.model", "no_vocab");
    }
    const TensorTable* tt = &m->tt;
    GgufPart parts[2];
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to >= 0) continue;  // llama.cpp reuses token_embd when output is absent
        const int n_parts = gguf_tensor_parts(c, d, parts);
        // norms stay F32, as llama.cpp's converter keeps every 1-D tensor
        GgmlType type = d->ndim == 1 ? GGML_TYPE_F32 : wt;
        float* data = store_param(s, i);
        if (c->family == FAMILY_LLAMA && (d->kind == TK_WQ || d->kind == TK_WK)) {
            float* perm = malloc_check((size_t)d->numel * sizeof(float));
            gguf_permute_rows(data, perm, d->kind == TK_WQ ? c->H : c->KVH, d->shape[0],
                              d->shape[1], 0);
            gguf_writer_add_tensor(&w, parts[0].name, type, d->ndim, d->shape, perm, 1);
        } else if (gguf_parts_rearranged(c, d)) {
            // MoE experts in llama.cpp's layout: the parts back to back in one buffer, which
            // the first part's tensor owns (the writer frees it after writing them all)
            float* packed = malloc_check((size_t)d->numel * sizeof(float));
            gguf_parts_convert(c, d, data, packed, 0);
            int64_t off = 0;
            for (int p = 0; p < n_parts; off += parts[p].numel, p++)
                gguf_writer_add_tensor(&w, parts[p].name, type, parts[p].ndim, parts[p].shape,
                                       packed + off, p == 0);
        } else {
            gguf_writer_add_tensor(&w, parts[0].name, type, d->ndim, d->shape, data, 0);
        }
    }
    if (c->family == FAMILY_LLAMA && c->rope_type == ROPE_LLAMA3) {
        int64_t half = c->HD / 2;
        float* r = malloc_check((size_t)half * sizeof(float));
        gguf_llama3_rope_factors(c, r);
        gguf_writer_add_tensor(&w, "rope_freqs.weight", GGML_TYPE_F32, 1, &half, r, 1);
    }
    Progress pg;  // a line on a terminal only (the file is written in one pass)
    char what[96];
    snprintf(what, sizeof what, "exporting %s", path);
    progress_begin(&pg, what, 0.0);
    int rc = gguf_writer_write(&w, path, err);
    progress_end(&pg);
    gguf_writer_free(&w);
    gguf_tokenizer_free(&written);
    return rc;
}
