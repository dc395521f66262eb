/*
 * checkpoint.c — model source resolution, HF-layout saving, --dump-state output.
 */
#include "checkpoint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// --model resolution

static void dir_of(const char* path, char* out, size_t cap) {
    str_copy(out, cap, path);
    char* slash = strrchr(out, '/');
    if (slash) *slash = '\0';
    else str_copy(out, cap, ".");
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
        src->has_weights = 1;
        return 0;
    }
    if (str_ends_with(spec, ".gguf"))
        return errorf(err, "%s: GGUF checkpoints are not supported by this build yet (use an HF "
                           "directory or .safetensors)", spec);
    if (str_ends_with(spec, ".json")) {
        if (!file_exists(spec)) return errorf(err, "%s: no such file", spec);
        str_copy(src->config_path, sizeof src->config_path, spec);
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
        src->has_weights = 1;
        return 0;
    }
    if (strchr(spec, '/') || file_exists(spec))
        return errorf(err, "%s: not a model directory, config.json or .safetensors file", spec);
    return config_from_preset(&src->cfg, spec, err);
}

void checkpoint_close_source(ModelSource* src) {
    if (src->has_weights) st_checkpoint_close(&src->ck);
    src->has_weights = 0;
}

// ----------------------------------------------------------------------------
// saving

int checkpoint_save_hf(const char* dir, const Model* m, const Store* s, char* err) {
    if (mkdir_p(dir, err) != 0) return -1;
    char path[4096];
    StWriter w;
    st_writer_init(&w);
    st_writer_meta(&w, "format", "pt");
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->tied_to >= 0) continue;
        st_writer_add(&w, d->hf_name, ST_F32, d->ndim, d->shape, store_param(s, i));
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    int rc = st_writer_write(&w, path, err);
    st_writer_free(&w);
    if (rc != 0) return -1;
    char* json = config_to_hf_json(&m->cfg);
    snprintf(path, sizeof path, "%s/config.json", dir);
    rc = file_write_atomic(path, json, strlen(json), err);
    free(json);
    return rc;
}

int checkpoint_dump_state(const char* path, const Model* m, const Store* s, float loss, char* err) {
    StWriter w;
    st_writer_init(&w);
    int64_t one = 1;
    st_writer_add(&w, "loss", ST_F32, 1, &one, &loss);
    char** names = calloc_check((size_t)m->tt.n, sizeof(char*));
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->tied_to >= 0) continue;
        size_t len = strlen(d->hf_name) + 6;
        names[i] = malloc_check(len);
        snprintf(names[i], len, "grad.%s", d->hf_name);
        st_writer_add(&w, names[i], ST_F32, d->ndim, d->shape, store_grad(s, i));
    }
    int rc = st_writer_write(&w, path, err);
    st_writer_free(&w);
    for (int i = 0; i < m->tt.n; i++) free(names[i]);
    free(names);
    return rc;
}
