/*
 * fuzz_entries.h — the parser entry points shared by the libFuzzer targets (dev/fuzz/fuzz_*.c,
 * `make fuzz`) and by the fuzz smoke test of `make test` (gguf_fuzz_smoke in
 * llmc/tests/test_gguf.c, which feeds the committed seeds and deterministic mutations of them).
 *
 * Each entry takes arbitrary bytes and must return without crashing, leaking, or allocating
 * without bound; it returns 1 if the input was accepted, 0 if it was refused. A refusal must come
 * with a one-line message that starts with the file name (checked here: a violation aborts, which
 * both libFuzzer and the smoke test report). The safetensors and shard readers map paths, so their
 * entries hand the bytes over as a memfd (/proc/self/fd/N).
 *
 * Functions are static inline: this header is included once per program.
 */
#ifndef DEV_FUZZ_FUZZ_ENTRIES_H
#define DEV_FUZZ_FUZZ_ENTRIES_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../llmc/common.h"
#include "../../llmc/config.h"
#include "../../llmc/dataloader.h"
#include "../../llmc/gguf.h"
#include "../../llmc/json.h"
#include "../../llmc/safetensors.h"
#include "../../llmc/tensor.h"

// Tensors above this many elements are not converted (the parsers already bound them by the
// input size; this keeps each fuzz execution fast).
#define FUZZ_MAX_CONVERT (1 << 20)

static inline void fuzz_check_message(const char* err, const char* prefix) {
    if (strncmp(err, prefix, strlen(prefix)) != 0 || strchr(err, '\n') != NULL) {
        fprintf(stderr, "fuzz: bad error message (must be one line starting with '%s'): '%s'\n",
                prefix, err);
        abort();
    }
}

// The bytes as an anonymous file; path receives its /proc/self/fd name. -1 on failure.
static inline int fuzz_memfd(const uint8_t* data, size_t size, char* path, size_t cap) {
    int fd = memfd_create("fuzz", MFD_CLOEXEC);
    if (fd < 0) return -1;
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(fd, data + off, size - off);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        off += (size_t)w;
    }
    snprintf(path, cap, "/proc/self/fd/%d", fd);
    return fd;
}

static inline int fuzz_json(const uint8_t* data, size_t size) {
    JsonDoc doc;
    char err[ERR_LEN] = "";
    if (json_parse((const char*)data, size, &doc, err) != 0) {
        fuzz_check_message(err, "at byte ");
        return 0;
    }
    // the lookups must cope with whatever was parsed
    int64_t i;
    double d;
    const char* s;
    json_get_int(&doc.root, "hidden_size", &i);
    json_get_double(&doc.root, "rope_theta", &d);
    json_get_string(&doc.root, "model_type", &s);
    json_free(&doc);
    return 1;
}

static inline int fuzz_safetensors(const uint8_t* data, size_t size) {
    char path[64], err[ERR_LEN] = "";
    int fd = fuzz_memfd(data, size, path, sizeof path);
    if (fd < 0) return 0;
    StFile f;
    int ok = st_open(&f, path, err) == 0;
    if (ok) {
        for (int i = 0; i < f.n_tensors; i++) {
            const StTensor* t = &f.tensors[i];
            if (t->numel > FUZZ_MAX_CONVERT) continue;
            float* buf = malloc_check((size_t)(t->numel > 0 ? t->numel : 1) * sizeof(float));
            if (st_tensor_to_f32(t, buf, t->numel, err) != 0) fuzz_check_message(err, path);
            free(buf);
        }
        st_close(&f);
    } else {
        fuzz_check_message(err, path);
    }
    close(fd);
    return ok;
}

static inline int fuzz_gguf(const uint8_t* data, size_t size) {
    GgufFile f;
    char err[ERR_LEN] = "";
    if (gguf_open_memory(&f, data, size, "fuzz.gguf", err) != 0) {
        fuzz_check_message(err, "fuzz.gguf: ");
        return 0;
    }
    for (int64_t i = 0; i < f.n_tensors; i++) {
        const GgufTensor* t = &f.tensors[i];
        if (t->numel > FUZZ_MAX_CONVERT) continue;
        float* buf = malloc_check((size_t)(t->numel > 0 ? t->numel : 1) * sizeof(float));
        if (gguf_tensor_to_f32(&f, t, buf, t->numel, err) != 0)
            fuzz_check_message(err, "fuzz.gguf: ");
        free(buf);
    }
    // the model path: config from metadata, then every tensor of the descriptor table
    ModelConfig cfg;
    TensorTable tt;
    if (gguf_config(&f, &cfg, err) == 0 && tensor_table_build(&tt, &cfg, 0, err) == 0) {
        for (int i = 0; i < tt.n; i++) {
            const TensorDesc* d = &tt.t[i];
            if (d->tied_to >= 0 || d->numel > FUZZ_MAX_CONVERT) continue;
            float* buf = malloc_check((size_t)d->numel * sizeof(float));
            if (gguf_read_hf_tensor(&f, &cfg, d, buf, err) != 0)
                fuzz_check_message(err, "fuzz.gguf: ");
            free(buf);
        }
        tensor_table_free(&tt);
    } else {
        fuzz_check_message(err, "fuzz.gguf: ");
    }
    GgufTokenizer tok;
    gguf_tokenizer_extract(&f, &tok);
    gguf_tokenizer_free(&tok);
    gguf_close(&f);
    return 1;
}

static inline int fuzz_shard(const uint8_t* data, size_t size) {
    char path[64], err[ERR_LEN] = "";
    int fd = fuzz_memfd(data, size, path, sizeof path);
    if (fd < 0) return 0;
    DataLoader dl;
    int ok = dataloader_open(&dl, path, 2, 4, 1, 7, 1 << 17, err) == 0;
    if (ok) {
        int32_t tokens[2 * 5];
        uint8_t state[DATALOADER_STATE_BYTES];
        for (int i = 0; i < 3; i++)
            if (dataloader_next_batch(&dl, tokens, err) != 0) fuzz_check_message(err, path);
        dataloader_state_save(&dl, state);
        if (dataloader_state_restore(&dl, state, err) != 0) {
            fprintf(stderr, "fuzz: the loader refused its own state: %s\n", err);
            abort();
        }
        dataloader_close(&dl);
    } else if (strstr(err, path) == NULL) {
        fprintf(stderr, "fuzz: shard error does not name the file: '%s'\n", err);
        abort();
    }
    close(fd);
    return ok;
}

#endif  // DEV_FUZZ_FUZZ_ENTRIES_H
