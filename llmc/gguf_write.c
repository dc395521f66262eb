/*
 * gguf_write.c — the GGUF v3 writer of exports: metadata records serialised as they are added,
 * tensors (F32, F16 or BF16 from fp32 sources) converted and streamed in chunks at write time,
 * each padded to the default alignment, the whole file written atomically (atomic_file_*).
 */
#include "gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// writer

void gguf_writer_init(GgufWriter* w) { memset(w, 0, sizeof *w); }

static void wr_bytes(GgufWriter* w, const void* p, size_t n) {
    if (w->kv_len + n > w->kv_cap) {
        size_t cap = w->kv_cap ? w->kv_cap : 1024;
        while (cap < w->kv_len + n) cap *= 2;
        w->kv = realloc_check(w->kv, cap);
        w->kv_cap = cap;
    }
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
}

static void wr_u32(GgufWriter* w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    wr_bytes(w, b, 4);
}

static void wr_u64(GgufWriter* w, uint64_t v) {
    wr_u32(w, (uint32_t)v);
    wr_u32(w, (uint32_t)(v >> 32));
}

static void wr_string(GgufWriter* w, const char* s) {
    size_t n = strlen(s);
    wr_u64(w, n);
    wr_bytes(w, s, n);
}

static void wr_key(GgufWriter* w, const char* key, GgufValueType type) {
    wr_string(w, key);
    wr_u32(w, (uint32_t)type);
    w->n_kv++;
}

void gguf_writer_add_u32(GgufWriter* w, const char* key, uint32_t v) {
    wr_key(w, key, GGUF_TYPE_UINT32);
    wr_u32(w, v);
}

void gguf_writer_add_f32(GgufWriter* w, const char* key, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    wr_key(w, key, GGUF_TYPE_FLOAT32);
    wr_u32(w, u);
}

void gguf_writer_add_bool(GgufWriter* w, const char* key, int v) {
    uint8_t b = v ? 1 : 0;
    wr_key(w, key, GGUF_TYPE_BOOL);
    wr_bytes(w, &b, 1);
}

void gguf_writer_add_string(GgufWriter* w, const char* key, const char* v) {
    wr_key(w, key, GGUF_TYPE_STRING);
    wr_string(w, v);
}

void gguf_writer_add_records(GgufWriter* w, const uint8_t* records, size_t len, int64_t n_kv) {
    if (len) wr_bytes(w, records, len);
    w->n_kv += n_kv;
}

void gguf_writer_add_tensor(GgufWriter* w, const char* name, GgmlType type, int ndim,
                            const int64_t* shape, const float* data, int owned) {
    // Misuse is a programming error, not bad input: fail loudly.
    if ((type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_BF16) || ndim < 1 ||
        ndim > GGUF_MAX_DIMS || strlen(name) >= GGUF_MAX_NAME)
        fatal_at(__FILE__, __LINE__, "gguf_writer_add_tensor('%s'): bad type %d, ndim %d or name",
                 name, (int)type, ndim);
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 32;
        w->t = realloc_check(w->t, (size_t)w->cap * sizeof(GgufWriterTensor));
    }
    GgufWriterTensor* t = &w->t[w->n++];
    memset(t, 0, sizeof *t);
    t->name = strndup_check(name, strlen(name));
    t->type = type;
    t->n_dims = ndim;
    for (int k = 0; k < ndim; k++) t->ne[k] = shape[ndim - 1 - k];
    t->data = data;
    t->owned = owned ? (float*)data : NULL;
}

static int compare_writer_names(const void* a, const void* b) {
    return strcmp((*(const GgufWriterTensor* const*)a)->name,
                  (*(const GgufWriterTensor* const*)b)->name);
}

// Convert and write one tensor in chunks (no whole-tensor copy). -1 + err on a value the type
// cannot hold or an I/O error.
static int write_tensor_data(AtomicFile* af, const GgufWriterTensor* t, const char* path,
                             char* err) {
    int64_t numel = 1;
    for (int k = 0; k < t->n_dims; k++) numel *= t->ne[k];
    enum { CHUNK = 16384 };
    uint8_t buf[CHUNK * 4];
    for (int64_t base = 0; base < numel; base += CHUNK) {
        int64_t n = numel - base < CHUNK ? numel - base : CHUNK;
        const float* src = t->data + base;
        size_t bytes;
        for (int64_t i = 0; i < n; i++)
            if (!isfinite(src[i]))
                return errorf(err, "%s: tensor '%s' element %lld is not finite", path, t->name,
                              (long long)(base + i));
        if (t->type == GGML_TYPE_F32) {
            memcpy(buf, src, (size_t)n * 4);
            bytes = (size_t)n * 4;
        } else {
            for (int64_t i = 0; i < n; i++) {
                uint16_t h = t->type == GGML_TYPE_F16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
                if (t->type == GGML_TYPE_F16 && (h & 0x7c00u) == 0x7c00u)
                    return errorf(err,
                                  "%s: tensor '%s' element %lld = %g overflows F16 (use "
                                  "--export-dtype bf16 or f32)",
                                  path, t->name, (long long)(base + i), (double)src[i]);
                buf[2 * i] = (uint8_t)h;
                buf[2 * i + 1] = (uint8_t)(h >> 8);
            }
            bytes = (size_t)n * 2;
        }
        if (atomic_file_write(af, buf, bytes, err) != 0) return -1;
    }
    return 0;
}

static uint64_t writer_tensor_bytes(const GgufWriterTensor* t) {
    int64_t numel = 1;
    for (int k = 0; k < t->n_dims; k++) numel *= t->ne[k];
    return ggml_type_bytes(t->type, numel);
}

int gguf_writer_write(GgufWriter* w, const char* path, char* err) {
    GgufWriterTensor** order = malloc_check((size_t)(w->n ? w->n : 1) * sizeof(*order));
    for (int i = 0; i < w->n; i++) order[i] = &w->t[i];
    qsort(order, (size_t)w->n, sizeof(*order), compare_writer_names);
    for (int i = 1; i < w->n; i++)
        if (strcmp(order[i - 1]->name, order[i]->name) == 0) {
            errorf(err, "%s: duplicate tensor name '%s'", path, order[i]->name);
            free(order);
            return -1;
        }
    free(order);

    // header, KV records and tensor infos built in memory (small; `head` is only used as a byte
    // buffer), then the data streamed
    GgufWriter head;
    gguf_writer_init(&head);
    wr_u32(&head, GGUF_MAGIC);
    wr_u32(&head, GGUF_VERSION);
    wr_u64(&head, (uint64_t)w->n);
    wr_u64(&head, (uint64_t)w->n_kv);
    wr_bytes(&head, w->kv, w->kv_len);
    const uint64_t A = GGUF_DEFAULT_ALIGNMENT;
    uint64_t offset = 0;
    for (int i = 0; i < w->n; i++) {
        const GgufWriterTensor* t = &w->t[i];
        wr_string(&head, t->name);
        wr_u32(&head, (uint32_t)t->n_dims);
        for (int k = 0; k < t->n_dims; k++) wr_u64(&head, (uint64_t)t->ne[k]);
        wr_u32(&head, (uint32_t)t->type);
        wr_u64(&head, offset);
        offset += writer_tensor_bytes(t);
        offset += (A - offset % A) % A;
    }
    static const uint8_t zeros[GGUF_DEFAULT_ALIGNMENT] = {0};
    wr_bytes(&head, zeros, (size_t)((A - head.kv_len % A) % A));

    AtomicFile af;
    int rc = atomic_file_open(&af, path, err);
    if (rc == 0) {
        rc = atomic_file_write(&af, head.kv, head.kv_len, err);
        for (int i = 0; i < w->n && rc == 0; i++) {
            rc = write_tensor_data(&af, &w->t[i], path, err);
            uint64_t nb = writer_tensor_bytes(&w->t[i]);
            if (rc == 0) rc = atomic_file_write(&af, zeros, (size_t)((A - nb % A) % A), err);
        }
        if (rc == 0)
            rc = atomic_file_commit(&af, err);
        else
            atomic_file_abort(&af);
    }
    free(head.kv);
    return rc;
}

void gguf_writer_free(GgufWriter* w) {
    if (!w) return;
    free(w->kv);
    for (int i = 0; i < w->n; i++) {
        free(w->t[i].name);
        free(w->t[i].owned);
    }
    free(w->t);
    memset(w, 0, sizeof *w);
}
