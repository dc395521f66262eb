/*
 * gguf.c — GGUF v3 reading (bounded parse of header, metadata, tensor infos; offsets checked),
 * dequantisation (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q6_K MXFP4), architecture mapping
 * (metadata -> ModelConfig, descriptor -> GGUF name, ne order, LLaMA Q/K rows, rope_freqs),
 * tokenizer records, and the writer.
 *
 * Bounding rule: every count (keys, tensors, array elements) is first checked against the bytes
 * left divided by the smallest possible encoding of one item, and the arrays holding the parsed
 * items grow (doubling) as items are actually read, never to the claimed count up front: memory
 * is a small multiple of the bytes parsed as metadata, even for a hostile count in a file of many
 * GB. Nested arrays are limited to GGUF_MAX_ARRAY_DEPTH levels, so the recursion is bounded too.
 * Block layouts follow ggml (FORMATS_AND_MODELS.md §2.5) operation for operation, so results are
 * bit-identical to gguf-py's dequantize (our oracle in tests).
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

// ----------------------------------------------------------------------------
// type tables

typedef struct GgmlTypeInfo {
    const char* name;  // NULL: removed or unknown code
    int block;         // elements per block (0: size unknown to this build)
    int bytes;         // bytes per block
    int dequant;       // this build can dequantise it
} GgmlTypeInfo;

static const GgmlTypeInfo ggml_types[GGML_TYPE_COUNT] = {
    [0] = {"F32", 1, 4, 1},         [1] = {"F16", 1, 2, 1},         [2] = {"Q4_0", 32, 18, 1},
    [3] = {"Q4_1", 32, 20, 1},      [6] = {"Q5_0", 32, 22, 1},      [7] = {"Q5_1", 32, 24, 1},
    [8] = {"Q8_0", 32, 34, 1},      [9] = {"Q8_1", 32, 36, 0},      [10] = {"Q2_K", 256, 84, 0},
    [11] = {"Q3_K", 256, 110, 0},   [12] = {"Q4_K", 256, 144, 1},   [13] = {"Q5_K", 256, 176, 0},
    [14] = {"Q6_K", 256, 210, 1},   [15] = {"Q8_K", 256, 292, 0},   [16] = {"IQ2_XXS", 256, 66, 0},
    [17] = {"IQ2_XS", 256, 74, 0},  [18] = {"IQ3_XXS", 256, 98, 0}, [19] = {"IQ1_S", 256, 50, 0},
    [20] = {"IQ4_NL", 32, 18, 0},   [21] = {"IQ3_S", 256, 110, 0},  [22] = {"IQ2_S", 256, 82, 0},
    [23] = {"IQ4_XS", 256, 136, 0}, [24] = {"I8", 1, 1, 0},         [25] = {"I16", 1, 2, 0},
    [26] = {"I32", 1, 4, 0},        [27] = {"I64", 1, 8, 0},        [28] = {"F64", 1, 8, 0},
    [29] = {"IQ1_M", 256, 56, 0},   [30] = {"BF16", 1, 2, 1},       [34] = {"TQ1_0", 256, 54, 0},
    [35] = {"TQ2_0", 256, 66, 0},   [39] = {"MXFP4", 32, 17, 1},    [40] = {"NVFP4", 64, 36, 0},
    [41] = {"Q1_0", 128, 18, 0},    [42] = {"Q2_0", 0, 0, 0},
};

static const char* const value_type_names[GGUF_TYPE_COUNT] = {
    "UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
    "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};
// Bytes of one scalar element (0 for STRING and ARRAY).
static const int value_type_sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char* gguf_value_type_name(GgufValueType t) {
    return (t >= 0 && t < GGUF_TYPE_COUNT) ? value_type_names[t] : "?";
}

const char* ggml_type_name(int type) {
    return (type >= 0 && type < GGML_TYPE_COUNT) ? ggml_types[type].name : NULL;
}

int ggml_type_can_dequantize(int type) {
    return type >= 0 && type < GGML_TYPE_COUNT && ggml_types[type].dequant;
}

uint64_t ggml_type_bytes(int type, int64_t n) {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_types[type].block == 0 || n < 0) return 0;
    const GgmlTypeInfo* ti = &ggml_types[type];
    return (uint64_t)(n / ti->block) * (uint64_t)ti->bytes;
}

static const char* supported_types_list(void) {
    return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, MXFP4";
}

// ----------------------------------------------------------------------------
// little-endian helpers and printable names

static uint16_t le16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t le32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t le64(const uint8_t* p) { return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32); }

// Printable, bounded copy of untrusted bytes for one-line messages.
static const char* printable(const char* s, uint64_t n, char* buf, size_t cap) {
    size_t o = 0;
    for (uint64_t i = 0; i < n && o + 4 < cap; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (o + 4 >= cap && n > 0) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

// Keys and tensor names end up in one-line messages: NUL, newlines and other control bytes
// have no business in them (real files use ASCII identifiers).
static int has_control(GgufString s) {
    for (uint64_t i = 0; i < s.n; i++)
        if ((unsigned char)s.s[i] < 0x20 || (unsigned char)s.s[i] == 0x7f) return 1;
    return 0;
}

static char* copy_cstr(const char* s, uint64_t n) {
    char* d = malloc_check((size_t)n + 1);
    if (n) memcpy(d, s, (size_t)n);
    d[n] = '\0';
    return d;
}

// ----------------------------------------------------------------------------
// bounded cursor over the file

typedef struct Cursor {
    const char* path;
    const uint8_t* p;
    size_t size, pos;
    char* err;
} Cursor;

static size_t cur_left(const Cursor* c) { return c->size - c->pos; }

static int cur_need(Cursor* c, uint64_t n, const char* what) {
    if (n > cur_left(c))
        return errorf(c->err, "%s: truncated: %s needs %llu bytes at offset %zu, %zu left", c->path,
                      what, (unsigned long long)n, c->pos, cur_left(c));
    return 0;
}

static int cur_u32(Cursor* c, uint32_t* v, const char* what) {
    if (cur_need(c, 4, what)) return -1;
    *v = le32(c->p + c->pos);
    c->pos += 4;
    return 0;
}

static int cur_u64(Cursor* c, uint64_t* v, const char* what) {
    if (cur_need(c, 8, what)) return -1;
    *v = le64(c->p + c->pos);
    c->pos += 8;
    return 0;
}

static int cur_string(Cursor* c, GgufString* s, const char* what) {
    uint64_t n;
    if (cur_u64(c, &n, what)) return -1;
    if (n > cur_left(c))
        return errorf(c->err, "%s: %s: string length %llu at offset %zu exceeds the %zu bytes left",
                      c->path, what, (unsigned long long)n, c->pos - 8, cur_left(c));
    s->s = (const char*)c->p + c->pos;
    s->n = n;
    c->pos += (size_t)n;
    return 0;
}

// Capacity for a growing array of at most `limit` entries: 16, then doubling.
static uint64_t grow_capacity(uint64_t cap, uint64_t limit) {
    uint64_t next = cap ? 2 * cap : 16;
    return next < limit ? next : limit;
}

// ----------------------------------------------------------------------------
// metadata values

static void value_free(GgufValue* v) {
    if (v->type != GGUF_TYPE_ARRAY) return;
    free(v->strs);
    if (v->arrays)
        for (uint64_t i = 0; i < v->n; i++) value_free(&v->arrays[i]);
    free(v->arrays);
    v->strs = NULL;
    v->arrays = NULL;
}

// Read one value of `type`. ctx names the key for messages. depth counts enclosing arrays.
static int read_value(Cursor* c, GgufValueType type, GgufValue* v, int depth, const char* ctx) {
    memset(v, 0, sizeof *v);
    v->type = type;
    char what[160];
    snprintf(what, sizeof what, "the value of %s", ctx);
    const uint8_t* q = c->p + c->pos;
    switch (type) {
        case GGUF_TYPE_UINT8:
        case GGUF_TYPE_BOOL:
            if (cur_need(c, 1, what)) return -1;
            v->u = q[0];
            if (type == GGUF_TYPE_BOOL && v->u > 1)
                return errorf(c->err, "%s: %s: BOOL value %u at offset %zu is not 0 or 1", c->path,
                              ctx, (unsigned)q[0], c->pos);
            c->pos += 1;
            return 0;
        case GGUF_TYPE_INT8:
            if (cur_need(c, 1, what)) return -1;
            v->i = (int8_t)q[0];
            c->pos += 1;
            return 0;
        case GGUF_TYPE_UINT16:
            if (cur_need(c, 2, what)) return -1;
            v->u = le16(q);
            c->pos += 2;
            return 0;
        case GGUF_TYPE_INT16:
            if (cur_need(c, 2, what)) return -1;
            v->i = (int16_t)le16(q);
            c->pos += 2;
            return 0;
        case GGUF_TYPE_UINT32: {
            uint32_t x;
            if (cur_u32(c, &x, what)) return -1;
            v->u = x;
            return 0;
        }
        case GGUF_TYPE_INT32: {
            uint32_t x;
            if (cur_u32(c, &x, what)) return -1;
            v->i = (int32_t)x;
            return 0;
        }
        case GGUF_TYPE_UINT64: return cur_u64(c, &v->u, what);
        case GGUF_TYPE_INT64: {
            uint64_t x;
            if (cur_u64(c, &x, what)) return -1;
            v->i = (int64_t)x;
            return 0;
        }
        case GGUF_TYPE_FLOAT32: {
            uint32_t x;
            if (cur_u32(c, &x, what)) return -1;
            float fl;
            memcpy(&fl, &x, 4);
            v->f = fl;
            return 0;
        }
        case GGUF_TYPE_FLOAT64: {
            uint64_t x;
            if (cur_u64(c, &x, what)) return -1;
            memcpy(&v->f, &x, 8);
            return 0;
        }
        case GGUF_TYPE_STRING: return cur_string(c, &v->str, what);
        case GGUF_TYPE_ARRAY: break;
        default: return errorf(c->err, "%s: %s: unknown value type %d", c->path, ctx, (int)type);
    }

    // ARRAY: element type, count, packed elements
    uint32_t et;
    uint64_t n;
    if (cur_u32(c, &et, what) || cur_u64(c, &n, what)) return -1;
    if (et >= GGUF_TYPE_COUNT)
        return errorf(c->err, "%s: %s: unknown array element type %u at offset %zu", c->path, ctx,
                      et, c->pos - 12);
    v->elem_type = (GgufValueType)et;
    // Smallest encoding of one element: a scalar's size, a string's u64 length, an array's
    // u32 type + u64 count. A count the rest of the file cannot hold is refused before allocating.
    uint64_t min_bytes = et == GGUF_TYPE_STRING  ? 8
                         : et == GGUF_TYPE_ARRAY ? 12
                                                 : (uint64_t)value_type_sizes[et];
    if (n > cur_left(c) / min_bytes)
        return errorf(c->err,
                      "%s: %s: array of %llu %s elements at offset %zu cannot fit in the %zu bytes "
                      "left",
                      c->path, ctx, (unsigned long long)n, value_type_names[et], c->pos - 8,
                      cur_left(c));
    if (et == GGUF_TYPE_ARRAY && depth + 1 >= GGUF_MAX_ARRAY_DEPTH)
        return errorf(c->err, "%s: %s: arrays nested deeper than %d levels", c->path, ctx,
                      GGUF_MAX_ARRAY_DEPTH);
    if (et != GGUF_TYPE_STRING && et != GGUF_TYPE_ARRAY) {
        v->n = n;
        v->elems = c->p + c->pos;
        if (et == GGUF_TYPE_BOOL)
            for (uint64_t k = 0; k < n; k++)
                if (v->elems[k] > 1)
                    return errorf(c->err, "%s: %s: BOOL element %llu is %u, not 0 or 1", c->path,
                                  ctx, (unsigned long long)k, (unsigned)v->elems[k]);
        c->pos += (size_t)(n * min_bytes);
        return 0;
    }
    // The element arrays grow with what was actually parsed, not with the claimed count (a count
    // that fits a multi-GB file must not allocate before the elements are seen). v->n counts the
    // entries value_free must release.
    uint64_t cap = 0;
    for (uint64_t k = 0; k < n; k++) {
        if (k == cap) {
            cap = grow_capacity(cap, n);
            if (et == GGUF_TYPE_STRING)
                v->strs = realloc_check(v->strs, (size_t)cap * sizeof(GgufString));
            else
                v->arrays = realloc_check(v->arrays, (size_t)cap * sizeof(GgufValue));
        }
        v->n = k + 1;
        if (et == GGUF_TYPE_STRING) {
            if (cur_string(c, &v->strs[k], what)) return -1;
        } else {
            // an element of an array of arrays is encoded like an array value: type, count, data
            if (read_value(c, GGUF_TYPE_ARRAY, &v->arrays[k], depth + 1, ctx)) return -1;
        }
    }
    return 0;
}

// ----------------------------------------------------------------------------
// open / close

static int compare_kv_ptr(const void* a, const void* b) {
    return strcmp((*(const GgufKV* const*)a)->key, (*(const GgufKV* const*)b)->key);
}

static int compare_tensor_ptr_name(const void* a, const void* b) {
    return strcmp((*(const GgufTensor* const*)a)->name, (*(const GgufTensor* const*)b)->name);
}

static int compare_tensor_ptr_offset(const void* a, const void* b) {
    const GgufTensor* x = *(const GgufTensor* const*)a;
    const GgufTensor* y = *(const GgufTensor* const*)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes) return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

static int parse_header(GgufFile* f, Cursor* c, uint64_t* n_tensors, uint64_t* n_kv) {
    if (f->size < 4)
        return errorf(c->err, "%s: file is %zu bytes, too small for the GGUF magic", f->path,
                      f->size);
    uint32_t magic = le32(f->map);
    if (magic != GGUF_MAGIC) {
        char m[16];
        return errorf(c->err, "%s: bad magic '%s' (0x%08x), expected 'GGUF': not a GGUF file",
                      f->path, printable((const char*)f->map, 4, m, sizeof m), magic);
    }
    c->pos = 4;
    if (cur_u32(c, &f->version, "the version")) return -1;
    if (f->version == 0x03000000u || f->version == 0x02000000u)
        return errorf(c->err,
                      "%s: version field reads 0x%08x: a big-endian GGUF, which is not "
                      "supported",
                      f->path, f->version);
    if (f->version == 1)
        return errorf(c->err, "%s: GGUF version 1 is not supported (only 2 and 3)", f->path);
    if (f->version != 2 && f->version != 3)
        return errorf(c->err, "%s: unsupported GGUF version %u (only 2 and 3)", f->path,
                      f->version);
    if (cur_u64(c, n_tensors, "tensor_count") || cur_u64(c, n_kv, "metadata_kv_count")) return -1;
    // Smallest KV: 8-byte key length + 1-byte key + 4-byte type + 1-byte value. Smallest tensor
    // info: 8 + 1 name byte + 4 n_dims + 8 (one ne) + 4 type + 8 offset.
    if (*n_kv > cur_left(c) / 14)
        return errorf(c->err, "%s: metadata_kv_count %llu cannot fit in the %zu bytes left",
                      f->path, (unsigned long long)*n_kv, cur_left(c));
    if (*n_tensors > cur_left(c) / 33)
        return errorf(c->err, "%s: tensor_count %llu cannot fit in the %zu bytes left", f->path,
                      (unsigned long long)*n_tensors, cur_left(c));
    return 0;
}

static int parse_kvs(GgufFile* f, Cursor* c, uint64_t n_kv) {
    uint64_t cap = 0;
    for (uint64_t i = 0; i < n_kv; i++) {
        if (i == cap) {
            cap = grow_capacity(cap, n_kv);
            f->kv = realloc_check(f->kv, (size_t)cap * sizeof(GgufKV));
        }
        GgufKV* kv = &f->kv[i];
        memset(kv, 0, sizeof *kv);
        kv->raw_begin = c->pos;
        char what[64];
        snprintf(what, sizeof what, "metadata key #%llu", (unsigned long long)i);
        GgufString key = {NULL, 0};
        if (cur_string(c, &key, what)) return -1;
        char kp[96];
        printable(key.s, key.n, kp, sizeof kp);
        if (key.n == 0 || key.n > GGUF_MAX_KEY || has_control(key))
            return errorf(c->err,
                          "%s: %s at offset %llu: key '%s' is empty, longer than %d bytes "
                          "or holds a control character",
                          f->path, what, (unsigned long long)kv->raw_begin, kp, GGUF_MAX_KEY);
        kv->key = copy_cstr(key.s, key.n);
        f->n_kv = (int64_t)i + 1;  // from here on close() frees this entry
        char ctx[128];
        snprintf(ctx, sizeof ctx, "key '%s'", kp);
        uint32_t type;
        if (cur_u32(c, &type, ctx)) return -1;
        if (type >= GGUF_TYPE_COUNT)
            return errorf(c->err, "%s: key '%s': unknown value type %u", f->path, kp, type);
        if (read_value(c, (GgufValueType)type, &kv->value, 0, ctx)) return -1;
        kv->raw_end = c->pos;
    }
    // unique keys (ggml rejects duplicates too)
    if (n_kv > 1) {
        GgufKV** sorted = malloc_check((size_t)n_kv * sizeof(GgufKV*));
        for (uint64_t i = 0; i < n_kv; i++) sorted[i] = &f->kv[i];
        qsort(sorted, (size_t)n_kv, sizeof(GgufKV*), compare_kv_ptr);
        int rc = 0;
        for (uint64_t i = 1; i < n_kv && rc == 0; i++)
            if (strcmp(sorted[i - 1]->key, sorted[i]->key) == 0) {
                char kp[96];
                rc = errorf(c->err, "%s: duplicate metadata key '%s'", f->path,
                            printable(sorted[i]->key, strlen(sorted[i]->key), kp, sizeof kp));
            }
        free(sorted);
        if (rc) return -1;
    }
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const GgufKV* al = gguf_find_kv(f, "general.alignment");
    if (al) {
        if (al->value.type != GGUF_TYPE_UINT32)
            return errorf(c->err, "%s: key 'general.alignment' has type %s, expected UINT32",
                          f->path, gguf_value_type_name(al->value.type));
        uint64_t a = al->value.u;
        if (a == 0 || (a & (a - 1)) != 0 || a > (1u << 30))
            return errorf(c->err,
                          "%s: key 'general.alignment' = %llu is not a power of two "
                          "(at most 2^30)",
                          f->path, (unsigned long long)a);
        f->alignment = (uint32_t)a;
    }
    return 0;
}

static int parse_tensor_infos(GgufFile* f, Cursor* c, uint64_t n_tensors) {
    uint64_t cap = 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        if (i == cap) {
            cap = grow_capacity(cap, n_tensors);
            f->tensors = realloc_check(f->tensors, (size_t)cap * sizeof(GgufTensor));
        }
        GgufTensor* t = &f->tensors[i];
        memset(t, 0, sizeof *t);
        char what[64];
        snprintf(what, sizeof what, "tensor info #%llu", (unsigned long long)i);
        GgufString name = {NULL, 0};
        if (cur_string(c, &name, what)) return -1;
        char np[96];
        printable(name.s, name.n, np, sizeof np);
        if (name.n == 0 || name.n >= GGUF_MAX_NAME || has_control(name))
            return errorf(c->err,
                          "%s: %s: name '%s' is empty, has %d or more bytes, or holds a "
                          "control character",
                          f->path, what, np, GGUF_MAX_NAME);
        t->name = copy_cstr(name.s, name.n);
        f->n_tensors = (int64_t)i + 1;
        char ctx[128];
        snprintf(ctx, sizeof ctx, "tensor '%s'", np);
        uint32_t n_dims, type;
        if (cur_u32(c, &n_dims, ctx)) return -1;
        if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
            return errorf(c->err, "%s: tensor '%s': n_dims %u (must be 1..%d)", f->path, np, n_dims,
                          GGUF_MAX_DIMS);
        t->n_dims = (int)n_dims;
        uint64_t numel = 1;
        int has_zero = 0;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t ne;
            if (cur_u64(c, &ne, ctx)) return -1;
            if (ne > (uint64_t)INT64_MAX)
                return errorf(c->err, "%s: tensor '%s': ne[%u] = %llu is negative as int64",
                              f->path, np, d, (unsigned long long)ne);
            t->ne[d] = (int64_t)ne;
            if (ne == 0) {
                has_zero = 1;
                continue;
            }
            if (numel > (uint64_t)INT64_MAX / ne)
                return errorf(c->err, "%s: tensor '%s': element count overflows int64", f->path,
                              np);
            numel *= ne;
        }
        t->numel = has_zero ? 0 : (int64_t)numel;
        if (cur_u32(c, &type, ctx)) return -1;
        const char* tn = ggml_type_name((int)type);
        if (!tn) return errorf(c->err, "%s: tensor '%s': unknown ggml type %u", f->path, np, type);
        if (ggml_types[type].block == 0)
            return errorf(c->err,
                          "%s: tensor '%s': ggml type %s has a block size unknown to this "
                          "build (supported: %s)",
                          f->path, np, tn, supported_types_list());
        t->type = (GgmlType)type;
        const GgmlTypeInfo* ti = &ggml_types[type];
        if (t->ne[0] % ti->block != 0)
            return errorf(c->err,
                          "%s: tensor '%s': ne[0] = %lld is not a multiple of the %s block "
                          "size %d",
                          f->path, np, (long long)t->ne[0], tn, ti->block);
        uint64_t blocks = (uint64_t)t->numel / (uint64_t)ti->block;
        if (blocks > UINT64_MAX / (uint64_t)ti->bytes)
            return errorf(c->err, "%s: tensor '%s': byte size overflows", f->path, np);
        t->nbytes = blocks * (uint64_t)ti->bytes;
        if (cur_u64(c, &t->offset, ctx)) return -1;
    }
    return 0;
}

// Names unique; offsets aligned, inside the file and not overlapping.
static int check_tensor_layout(GgufFile* f, char* err) {
    const int64_t n = f->n_tensors;
    f->by_name = malloc_check((size_t)(n ? n : 1) * sizeof(GgufTensor*));
    for (int64_t i = 0; i < n; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, (size_t)n, sizeof(GgufTensor*), compare_tensor_ptr_name);
    for (int64_t i = 1; i < n; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            return errorf(err, "%s: duplicate tensor name '%s'", f->path, f->by_name[i]->name);

    uint64_t data_size = f->data_offset <= f->size ? f->size - f->data_offset : 0;
    for (int64_t i = 0; i < n; i++) {
        const GgufTensor* t = &f->tensors[i];
        if (t->offset % f->alignment != 0)
            return errorf(err, "%s: tensor '%s': offset %llu is not a multiple of the alignment %u",
                          f->path, t->name, (unsigned long long)t->offset, f->alignment);
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return errorf(err,
                          "%s: tensor '%s': bytes [%llu, +%llu) of the data section run past "
                          "the end of the file (data section %llu bytes)",
                          f->path, t->name, (unsigned long long)t->offset,
                          (unsigned long long)t->nbytes, (unsigned long long)data_size);
    }
    GgufTensor** by_off = malloc_check((size_t)(n ? n : 1) * sizeof(GgufTensor*));
    for (int64_t i = 0; i < n; i++) by_off[i] = &f->tensors[i];
    qsort(by_off, (size_t)n, sizeof(GgufTensor*), compare_tensor_ptr_offset);
    int rc = 0;
    for (int64_t i = 1; i < n && rc == 0; i++) {
        const GgufTensor* a = by_off[i - 1];
        const GgufTensor* b = by_off[i];
        if (b->offset < a->offset + a->nbytes)
            rc = errorf(err,
                        "%s: tensor '%s' (offset %llu) overlaps tensor '%s' (bytes [%llu, %llu))",
                        f->path, b->name, (unsigned long long)b->offset, a->name,
                        (unsigned long long)a->offset, (unsigned long long)(a->offset + a->nbytes));
    }
    free(by_off);
    if (rc) return -1;
    // The writers' form: offsets in tensor-info order, each tensor padded to the alignment.
    uint64_t expect = 0;
    for (int64_t i = 0; i < n; i++) {
        GgufTensor* t = &f->tensors[i];
        if (t->offset != expect) f->nonsequential = 1;
        expect = t->offset + t->nbytes;
        expect += (f->alignment - expect % f->alignment) % f->alignment;
        // an empty tensor may sit past the end of a file with no data section: no pointer then
        t->data = t->nbytes ? f->map + f->data_offset + t->offset : NULL;
    }
    return 0;
}

static int gguf_parse(GgufFile* f, char* err) {
    Cursor c = {.path = f->path, .p = f->map, .size = f->size, .pos = 0, .err = err};
    uint64_t n_tensors, n_kv;
    if (parse_header(f, &c, &n_tensors, &n_kv)) return -1;
    if (parse_kvs(f, &c, n_kv)) return -1;
    if (n_tensors > cur_left(&c) / 33)
        return errorf(err,
                      "%s: tensor_count %llu cannot fit in the %zu bytes left after the "
                      "metadata",
                      f->path, (unsigned long long)n_tensors, cur_left(&c));
    if (parse_tensor_infos(f, &c, n_tensors)) return -1;
    uint64_t a = f->alignment;
    f->data_offset = c.pos + (a - c.pos % a) % a;
    return check_tensor_layout(f, err);
}

int gguf_open_memory(GgufFile* f, const uint8_t* data, size_t size, const char* name, char* err) {
    memset(f, 0, sizeof *f);
    f->path = copy_cstr(name, strlen(name));
    f->map = data;
    f->size = size;
    if (gguf_parse(f, err) != 0) {
        gguf_close(f);
        return -1;
    }
    return 0;
}

int gguf_open(GgufFile* f, const char* path, char* err) {
    memset(f, 0, sizeof *f);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errorf(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return errorf(err, "%s: not a regular file", path);
    }
    void* m = NULL;
    if (sb.st_size > 0) {
        m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            return errorf(err, "%s: mmap failed: %s", path, strerror(e));
        }
    }
    close(fd);  // the mapping keeps the file alive
    f->path = copy_cstr(path, strlen(path));
    f->map = m;
    f->size = (size_t)sb.st_size;
    f->mapped = m != NULL;
    if (gguf_parse(f, err) != 0) {
        gguf_close(f);
        return -1;
    }
    return 0;
}

void gguf_close(GgufFile* f) {
    if (!f) return;
    for (int64_t i = 0; i < f->n_kv; i++) {
        free((char*)f->kv[i].key);
        value_free(&f->kv[i].value);
    }
    free(f->kv);
    for (int64_t i = 0; i < f->n_tensors; i++) free((char*)f->tensors[i].name);
    free(f->tensors);
    free(f->by_name);
    if (f->mapped) munmap((void*)f->map, f->size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

// ----------------------------------------------------------------------------
// lookups

const GgufKV* gguf_find_kv(const GgufFile* f, const char* key) {
    for (int64_t i = 0; i < f->n_kv; i++)
        if (strcmp(f->kv[i].key, key) == 0) return &f->kv[i];
    return NULL;
}

const GgufTensor* gguf_find_tensor(const GgufFile* f, const char* name) {
    if (!f->by_name) return NULL;
    int64_t lo = 0, hi = f->n_tensors - 1;
    while (lo <= hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(f->by_name[mid]->name, name);
        if (c == 0) return f->by_name[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

static int is_int_type(GgufValueType t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_INT8 || t == GGUF_TYPE_UINT16 ||
           t == GGUF_TYPE_INT16 || t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_INT32 ||
           t == GGUF_TYPE_UINT64 || t == GGUF_TYPE_INT64;
}

static int is_signed_type(GgufValueType t) {
    return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 ||
           t == GGUF_TYPE_INT64;
}

// A scalar integer value widened to int64 (-1 if not an integer or above INT64_MAX).
static int value_int(const GgufValue* v, int64_t* out) {
    if (!is_int_type(v->type)) return -1;
    if (is_signed_type(v->type)) {
        *out = v->i;
        return 0;
    }
    if (v->u > (uint64_t)INT64_MAX) return -1;
    *out = (int64_t)v->u;
    return 0;
}

int gguf_get_int(const GgufFile* f, const char* key, int64_t* out) {
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return 0;
    return value_int(&kv->value, out) == 0 ? 1 : -1;
}

int gguf_get_float(const GgufFile* f, const char* key, double* out) {
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return 0;
    if (kv->value.type == GGUF_TYPE_FLOAT32 || kv->value.type == GGUF_TYPE_FLOAT64) {
        *out = kv->value.f;
        return 1;
    }
    int64_t i;
    if (value_int(&kv->value, &i) != 0) return -1;
    *out = (double)i;
    return 1;
}

int gguf_get_string(const GgufFile* f, const char* key, GgufString* out) {
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return 0;
    if (kv->value.type != GGUF_TYPE_STRING) return -1;
    *out = kv->value.str;
    return 1;
}

int gguf_array_int(const GgufValue* v, uint64_t i, int64_t* out) {
    if (v->type != GGUF_TYPE_ARRAY || !is_int_type(v->elem_type) || i >= v->n) return -1;
    const int size = value_type_sizes[v->elem_type];
    const uint8_t* p = v->elems + i * (uint64_t)size;
    uint64_t u = size == 1 ? p[0] : size == 2 ? le16(p) : size == 4 ? le32(p) : le64(p);
    if (is_signed_type(v->elem_type)) {
        *out = size == 1 ? (int8_t)u : size == 2 ? (int16_t)u : size == 4 ? (int32_t)u : (int64_t)u;
        return 0;
    }
    if (u > (uint64_t)INT64_MAX) return -1;
    *out = (int64_t)u;
    return 0;
}

// ----------------------------------------------------------------------------
// dequantisation (ggml-quants.c dequantize_row_*, same operations in the same order)

static float f16_at(const uint8_t* p) { return f16_to_f32(le16(p)); }

// E8M0 exponent to 2^(e-128) (ggml's GGML_E8M0_TO_FP32_HALF), built from the bits.
static float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void dq_q8_0(const uint8_t* b, float* y) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

static void dq_q4_0(const uint8_t* b, float* y) {
    const float d = f16_at(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0x0F) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void dq_q4_1(const uint8_t* b, float* y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0x0F) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void dq_q5_0(const uint8_t* b, float* y) {
    const float d = f16_at(b);
    const uint32_t qh = le32(b + 2);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int hi0 = (int)((qh >> j) & 1u) << 4, hi1 = (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)(((qs[j] & 0x0F) | hi0) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | hi1) - 16) * d;
    }
}

static void dq_q5_1(const uint8_t* b, float* y) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = le32(b + 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int hi0 = (int)((qh >> j) & 1u) << 4, hi1 = (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)((qs[j] & 0x0F) | hi0) * d + m;
        y[j + 16] = (float)((qs[j] >> 4) | hi1) * d + m;
    }
}

// Six-bit scale and min of sub-block j of a Q4_K block (ggml's get_scale_min_k4).
static void q4k_scale_min(int j, const uint8_t* s, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dq_q4_k(const uint8_t* b, float* y) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int c = 0; c < 4; c++) {
        int sc, m;
        q4k_scale_min(2 * c, scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        q4k_scale_min(2 * c + 1, scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) y[64 * c + l] = d1 * (float)(q[32 * c + l] & 0x0F) - m1;
        for (int l = 0; l < 32; l++) y[64 * c + 32 + l] = d2 * (float)(q[32 * c + l] >> 4) - m2;
    }
}

static void dq_q6_k(const uint8_t* b, float* y) {
    const float d = f16_at(b + 208);
    for (int n = 0; n < 2; n++) {
        const uint8_t* ql = b + 64 * n;
        const uint8_t* qh = b + 128 + 32 * n;
        const int8_t* sc = (const int8_t*)(b + 192 + 8 * n);
        float* o = y + 128 * n;
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            o[l] = d * (float)sc[is] * (float)q1;
            o[l + 32] = d * (float)sc[is + 2] * (float)q2;
            o[l + 64] = d * (float)sc[is + 4] * (float)q3;
            o[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

static void dq_mxfp4(const uint8_t* b, float* y) {
    // E2M1 values times two; the E8M0 scale is halved to match (ggml's kvalues_mxfp4)
    static const int8_t k[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const float d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)k[b[1 + j] & 0x0F] * d;
        y[j + 16] = (float)k[b[1 + j] >> 4] * d;
    }
}

int ggml_dequantize(int type, const uint8_t* src, float* dst, int64_t n) {
    if (!ggml_type_can_dequantize(type) || n < 0 || n % ggml_types[type].block != 0) return -1;
    const int64_t nb = n / ggml_types[type].block;
    const int bs = ggml_types[type].bytes, be = ggml_types[type].block;
    switch (type) {
        case GGML_TYPE_F32:
            if (n) memcpy(dst, src, (size_t)n * 4);
            return 0;
        case GGML_TYPE_F16:
            for (int64_t i = 0; i < n; i++) dst[i] = f16_at(src + 2 * i);
            return 0;
        case GGML_TYPE_BF16:
            for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(le16(src + 2 * i));
            return 0;
        default: break;
    }
    void (*block_fn)(const uint8_t*, float*) = type == GGML_TYPE_Q8_0   ? dq_q8_0
                                               : type == GGML_TYPE_Q4_0 ? dq_q4_0
                                               : type == GGML_TYPE_Q4_1 ? dq_q4_1
                                               : type == GGML_TYPE_Q5_0 ? dq_q5_0
                                               : type == GGML_TYPE_Q5_1 ? dq_q5_1
                                               : type == GGML_TYPE_Q4_K ? dq_q4_k
                                               : type == GGML_TYPE_Q6_K ? dq_q6_k
                                                                        : dq_mxfp4;
    for (int64_t i = 0; i < nb; i++) block_fn(src + (size_t)i * bs, dst + (size_t)i * be);
    return 0;
}

int gguf_tensor_to_f32(const GgufFile* f, const GgufTensor* t, float* out, int64_t n, char* err) {
    if (n != t->numel)
        return errorf(err, "%s: tensor '%s': asked for %lld elements but it has %lld", f->path,
                      t->name, (long long)n, (long long)t->numel);
    if (!ggml_type_can_dequantize(t->type))
        return errorf(err,
                      "%s: tensor '%s' has type %s, which this build cannot load (supported: "
                      "%s)",
                      f->path, t->name, ggml_type_name(t->type), supported_types_list());
    ggml_dequantize(t->type, t->data, out, n);
    // A NaN or Inf in a checkpoint would silently poison training: refuse it, by index.
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(out[i]))
            return errorf(err, "%s: tensor '%s': element %lld is %s", f->path, t->name,
                          (long long)i, isnan(out[i]) ? "NaN" : "infinite");
    return 0;
}

// ----------------------------------------------------------------------------
// architectures and configuration

static const char* const arch_names[FAMILY_COUNT] = {"llama", "qwen3", "qwen3moe", "gpt-oss"};

const char* gguf_arch_name(ModelFamily family) {
    return (family >= 0 && family < FAMILY_COUNT) ? arch_names[family] : "?";
}

// {arch}.<suffix> as an integer in [lo, hi]. A per-layer ARRAY is accepted when every entry is
// equal (we have no per-layer sizes). Absent: 0 and *out untouched (an error when required).
static int arch_int(const GgufFile* f, const char* arch, const char* suffix, int required,
                    int64_t lo, int64_t hi, int* out, char* err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return required ? errorf(err, "%s: metadata key '%s' is missing", f->path, key) : 0;
    int64_t v;
    if (kv->value.type == GGUF_TYPE_ARRAY) {
        if (kv->value.n == 0 || gguf_array_int(&kv->value, 0, &v) != 0)
            return errorf(err, "%s: key '%s': expected an integer or a non-empty integer array",
                          f->path, key);
        for (uint64_t i = 1; i < kv->value.n; i++) {
            int64_t w;
            if (gguf_array_int(&kv->value, i, &w) != 0 || w != v)
                return errorf(err,
                              "%s: key '%s': per-layer values differ (layer %llu), which is "
                              "not supported",
                              f->path, key, (unsigned long long)i);
        }
    } else if (value_int(&kv->value, &v) != 0) {
        return errorf(err, "%s: key '%s' has type %s, expected an integer", f->path, key,
                      gguf_value_type_name(kv->value.type));
    }
    if (v < lo || v > hi)
        return errorf(err, "%s: key '%s' = %lld is out of range [%lld, %lld]", f->path, key,
                      (long long)v, (long long)lo, (long long)hi);
    *out = (int)v;
    return 0;
}

static int arch_float(const GgufFile* f, const char* arch, const char* suffix, int required,
                      double* out, char* err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int r = gguf_get_float(f, key, out);
    if (r == 0 && required) return errorf(err, "%s: metadata key '%s' is missing", f->path, key);
    if (r < 0 || (r == 1 && !isfinite(*out)))
        return errorf(err, "%s: key '%s' must be a finite number", f->path, key);
    return 0;
}

// Base (unscaled) inverse frequencies as llama.cpp / the converter compute them, and the llama3
// check: our scaled frequencies must equal base / rope_freqs within float rounding.
static int llama3_matches(const ModelConfig* c, const float* r, int* bad_index) {
    const int half = c->HD / 2;
    float* inv = malloc_check((size_t)half * sizeof(float));
    config_rope_inv_freq(c, inv);
    int ok = 1;
    for (int i = 0; i < half && ok; i++) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)c->HD);
        double want = (double)base / (double)r[i];
        if (!(fabs((double)inv[i] - want) <= 1e-4 * want)) {
            ok = 0;
            *bad_index = i;
        }
    }
    free(inv);
    return ok;
}

// Recover llama3 scaling parameters from rope_freqs.weight (the converter writes no keys for
// them). Meta's lf=1, hf=4 are tried first (every released Llama 3.x), with the original context
// length from the blended frequencies; otherwise the two wavelength thresholds are solved for.
// The result is only accepted if config_rope_inv_freq reproduces every frequency.
static int llama3_from_rope_freqs(const GgufFile* f, const GgufTensor* t, ModelConfig* c,
                                  char* err) {
    const int half = c->HD / 2;
    if (t->n_dims != 1 || t->ne[0] != half)
        return errorf(err,
                      "%s: tensor 'rope_freqs.weight' has %lld entries, head_dim/2 = %d "
                      "expected",
                      f->path, (long long)t->numel, half);
    float* r = malloc_check((size_t)half * sizeof(float));
    char terr[ERR_LEN];
    if (gguf_tensor_to_f32(f, t, r, half, terr) != 0) {
        free(r);
        return errorf(err, "%s", terr);
    }
    float factor = 1.0f;
    for (int i = 0; i < half; i++) {
        if (!(r[i] > 0.0f)) {
            errorf(err, "%s: rope_freqs.weight[%d] = %g is not positive", f->path, i, (double)r[i]);
            free(r);
            return -1;
        }
        if (r[i] > factor) factor = r[i];
    }
    if (factor <= 1.0f + 1e-6f) {  // all ones: no scaling
        free(r);
        return 0;
    }
    // wavelengths and classes: 0 unchanged, 1 blended, 2 divided by factor
    double* lam = malloc_check((size_t)half * sizeof(double));
    double* s = malloc_check((size_t)half * sizeof(double));
    int first_b = -1, last_b = -1, last_u = -1, first_lo = -1;
    for (int i = 0; i < half; i++) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)c->HD);
        lam[i] = 2.0 * M_PI / (double)base;
        s[i] = (1.0 / r[i] - 1.0 / factor) / (1.0 - 1.0 / factor);
        if (fabsf(r[i] - 1.0f) <= 1e-6f)
            last_u = i;
        else if (fabsf(r[i] - factor) <= 1e-6f * factor) {
            if (first_lo < 0) first_lo = i;
        } else {
            if (first_b < 0) first_b = i;
            last_b = i;
        }
    }
    c->rope_type = ROPE_LLAMA3;
    c->rope_factor = factor;
    int found = 0, bad = 0;
    // 1. Meta's lf = 1, hf = 4; L0 from a blended frequency (s = (L0/lam - 1)/3), else 8192
    double l0 = first_b >= 0 ? lam[first_b] * (3.0 * s[first_b] + 1.0) : 8192.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->rope_original_max_pos = (int)lround(l0);
    found = l0 >= 1 && l0 < 1e9 && llama3_matches(c, r, &bad);
    // 2. solve for lam_lo = L0/lf and lam_hi = L0/hf (lf = 1): A/lam - s*B = 1, A = lam_lo,
    //    B = lam_lo/lam_hi - 1, from two blended frequencies, or placed between the classes
    if (!found) {
        double A, B;
        double lam_u = last_u >= 0 ? lam[last_u] : 0.0;
        double lam_lo_min = first_lo >= 0 ? lam[first_lo] : 1e30;
        if (first_b >= 0 && last_b > first_b) {
            double det = -s[last_b] / lam[first_b] + s[first_b] / lam[last_b];
            A = (s[first_b] - s[last_b]) / det;
            B = (1.0 / lam[first_b] - 1.0 / lam[last_b]) / det;
        } else if (first_b >= 0) {
            // one blended point: pick lam_hi between the unchanged class and it, solve A
            double lb = lam[first_b], sb = s[first_b];
            double th = lam_u > 0 ? sqrt(lam_u * lb) : lb / 2;
            A = (1.0 - sb) / (1.0 / lb - sb / th);
            for (int it = 0; it < 60 && !(A < lam_lo_min); it++) {
                th = sqrt(th * lb);
                A = (1.0 - sb) / (1.0 / lb - sb / th);
            }
            B = A / th - 1.0;
        } else {
            double lo_end = lam_lo_min < 1e30 ? lam_lo_min : 2 * lam[half - 1];
            double hi_end = lam_u > 0 ? lam_u : lo_end / 4;
            double th = hi_end * pow(lo_end / hi_end, 1.0 / 3.0);
            A = hi_end * pow(lo_end / hi_end, 2.0 / 3.0);
            B = A / th - 1.0;
        }
        // integer L0 as config.json stores it; lf, hf keep the two thresholds exact
        double L0 = A >= 1.0 ? floor(A) : 1.0;
        if (isfinite(A) && isfinite(B) && A > 0 && B > 0 && A < 1e9) {
            c->rope_original_max_pos = (int)L0;
            c->rope_low_freq_factor = L0 / A;
            c->rope_high_freq_factor = L0 * (1.0 + B) / A;
            found = llama3_matches(c, r, &bad);
        }
    }
    int rc = 0;
    if (!found) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * bad) / (float)c->HD);
        rc = errorf(err,
                    "%s: rope_freqs.weight[%d] = %g does not match llama3 RoPE scaling "
                    "(factor %g, base frequency %g): cannot reproduce these frequencies",
                    f->path, bad, (double)r[bad], (double)factor, (double)base);
    }
    free(lam);
    free(s);
    free(r);
    return rc;
}

static int tokenizer_id(const GgufFile* f, const char* key, int* out, char* err) {
    int64_t v;
    int r = gguf_get_int(f, key, &v);
    if (r == 0) return 0;
    if (r < 0 || v < 0 || v > (1 << 30))
        return errorf(err, "%s: key '%s' must be a token id", f->path, key);
    *out = (int)v;
    return 0;
}

#define GGUF_BIG (1 << 30)  // upper bound of every size read from metadata

// general.architecture -> family (arch receives the printable name). Split files are refused.
static int config_family(const GgufFile* f, ModelConfig* c, char* arch, size_t cap, char* err) {
    GgufString as;
    int r = gguf_get_string(f, "general.architecture", &as);
    if (r == 0) return errorf(err, "%s: metadata key 'general.architecture' is missing", f->path);
    if (r < 0) return errorf(err, "%s: key 'general.architecture' must be a STRING", f->path);
    printable(as.s, as.n, arch, cap);
    int family = -1;
    for (int i = 0; i < FAMILY_COUNT; i++)
        if (as.n == strlen(arch_names[i]) && memcmp(as.s, arch_names[i], as.n) == 0) family = i;
    if (family < 0)
        return errorf(err,
                      "%s: unsupported architecture '%s' (supported: llama, qwen3, qwen3moe, "
                      "gpt-oss)",
                      f->path, arch);
    c->family = (ModelFamily)family;
    int64_t splits = 1;
    if (gguf_get_int(f, "split.count", &splits) == 1 && splits > 1)
        return errorf(err,
                      "%s: a split GGUF (split.count %lld); merge it first with "
                      "llama-gguf-split --merge",
                      f->path, (long long)splits);
    return 0;
}

// L, C, H, KVH, F, HD, eps, rope theta, context length.
static int config_sizes(const GgufFile* f, const char* arch, ModelConfig* c, char* err) {
    if (arch_int(f, arch, "block_count", 1, 1, CONFIG_MAX_LAYERS, &c->L, err) ||
        arch_int(f, arch, "embedding_length", 1, 1, GGUF_BIG, &c->C, err) ||
        arch_int(f, arch, "attention.head_count", 1, 1, GGUF_BIG, &c->H, err))
        return -1;
    c->KVH = c->H;
    if (arch_int(f, arch, "attention.head_count_kv", 0, 1, GGUF_BIG, &c->KVH, err)) return -1;
    int moe = c->family == FAMILY_QWEN3MOE || c->family == FAMILY_GPTOSS;
    if (arch_int(f, arch, "feed_forward_length", !moe, 1, GGUF_BIG, &c->F, err)) return -1;
    // head dim: key_length, else rope.dimension_count, else C/H
    c->HD = c->C / c->H;
    int rope_dim = 0, key_len = 0, val_len = 0;
    if (arch_int(f, arch, "rope.dimension_count", 0, 1, GGUF_BIG, &rope_dim, err) ||
        arch_int(f, arch, "attention.key_length", 0, 1, GGUF_BIG, &key_len, err) ||
        arch_int(f, arch, "attention.value_length", 0, 1, GGUF_BIG, &val_len, err))
        return -1;
    if (key_len)
        c->HD = key_len;
    else if (rope_dim)
        c->HD = rope_dim;
    if (val_len && val_len != c->HD)
        return errorf(err,
                      "%s: %s.attention.value_length %d differs from the key length %d (not "
                      "supported)",
                      f->path, arch, val_len, c->HD);
    if (rope_dim && rope_dim != c->HD)
        return errorf(err,
                      "%s: %s.rope.dimension_count %d differs from the head dim %d (partial "
                      "rotary embeddings are not supported)",
                      f->path, arch, rope_dim, c->HD);
    if (c->HD <= 0 || c->HD % 2 != 0)
        return errorf(err, "%s: head dim %d must be positive and even (RoPE)", f->path, c->HD);
    double eps = 0.0;
    if (arch_float(f, arch, "attention.layer_norm_rms_epsilon", 1, &eps, err)) return -1;
    if (!(eps > 0 && eps < 1))
        return errorf(err, "%s: %s.attention.layer_norm_rms_epsilon = %g must be in (0, 1)",
                      f->path, arch, eps);
    c->norm_eps = (float)eps;
    c->rope_theta = 10000.0;  // llama.cpp's default when the key is absent
    if (arch_float(f, arch, "rope.freq_base", 0, &c->rope_theta, err)) return -1;
    c->max_pos = 2048;
    return arch_int(f, arch, "context_length", 0, 1, GGUF_BIG, &c->max_pos, err);
}

// Vocabulary (vocab_size, else the token list, else the embedding's rows), tying (no
// output.weight), special token ids.
static int config_vocab(const GgufFile* f, const char* arch, ModelConfig* c, char* err) {
    const GgufTensor* embd = gguf_find_tensor(f, "token_embd.weight");
    const GgufKV* tokens = gguf_find_kv(f, "tokenizer.ggml.tokens");
    if (arch_int(f, arch, "vocab_size", 0, 1, GGUF_BIG, &c->V, err)) return -1;
    if (c->V == 0 && tokens && tokens->value.type == GGUF_TYPE_ARRAY && tokens->value.n > 0 &&
        tokens->value.n <= (uint64_t)GGUF_BIG)
        c->V = (int)tokens->value.n;
    if (c->V == 0 && embd && embd->n_dims == 2 && embd->ne[1] > 0 && embd->ne[1] <= GGUF_BIG)
        c->V = (int)embd->ne[1];
    if (c->V == 0)
        return errorf(err,
                      "%s: cannot tell the vocabulary size (no %s.vocab_size, "
                      "tokenizer.ggml.tokens or token_embd.weight)",
                      f->path, arch);
    c->tied_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    if (tokenizer_id(f, "tokenizer.ggml.bos_token_id", &c->bos_id, err) ||
        tokenizer_id(f, "tokenizer.ggml.eos_token_id", &c->eos_id, err))
        return -1;
    return 0;
}

// RoPE scaling (llama3 from rope_freqs.weight, YaRN from keys) and the MoE fields.
static int config_scaling_and_experts(const GgufFile* f, const char* arch, ModelConfig* c,
                                      char* err) {
    char key[128];
    GgufString st;
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    int r = gguf_get_string(f, key, &st);
    if (r < 0) return errorf(err, "%s: key '%s' must be a STRING", f->path, key);
    if (r == 1 && !(st.n == 4 && memcmp(st.s, "none", 4) == 0)) {
        char sp[32];
        printable(st.s, st.n, sp, sizeof sp);
        if (strcmp(sp, "yarn") != 0)
            return errorf(err,
                          "%s: %s = '%s' is not supported (supported: yarn, and llama3 "
                          "through rope_freqs.weight)",
                          f->path, key, sp);
        c->rope_type = ROPE_YARN;
        if (arch_float(f, arch, "rope.scaling.factor", 1, &c->rope_factor, err) ||
            arch_int(f, arch, "rope.scaling.original_context_length", 1, 1, GGUF_BIG,
                     &c->rope_original_max_pos, err) ||
            arch_float(f, arch, "rope.scaling.yarn_beta_fast", 0, &c->yarn_beta_fast, err) ||
            arch_float(f, arch, "rope.scaling.yarn_beta_slow", 0, &c->yarn_beta_slow, err))
            return -1;
    }
    const GgufTensor* rf = gguf_find_tensor(f, "rope_freqs.weight");
    if (rf && c->family == FAMILY_LLAMA && llama3_from_rope_freqs(f, rf, c, err) != 0) return -1;
    if (c->family != FAMILY_QWEN3MOE && c->family != FAMILY_GPTOSS) return 0;
    if (arch_int(f, arch, "expert_count", 1, 1, GGUF_BIG, &c->E, err) ||
        arch_int(f, arch, "expert_used_count", 1, 1, GGUF_BIG, &c->K, err) ||
        arch_int(f, arch, "expert_feed_forward_length", 1, 1, GGUF_BIG, &c->F_expert, err))
        return -1;
    c->decoder_sparse_step = 1;
    c->norm_topk_prob = c->family == FAMILY_QWEN3MOE;  // hard-coded by llama.cpp (§2.6)
    if (c->family == FAMILY_GPTOSS) {
        c->attention_bias = 1;
        c->swiglu_limit = 7.0f;
        if (arch_int(f, arch, "attention.sliding_window", 0, 0, GGUF_BIG, &c->sliding_window, err))
            return -1;
        if (c->F == 0) c->F = c->F_expert;
    }
    return 0;
}

int gguf_config(const GgufFile* f, ModelConfig* cfg, char* err) {
    ModelConfig c;
    memset(&c, 0, sizeof c);
    c.rope_factor = 1.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.yarn_beta_fast = 32.0;
    c.yarn_beta_slow = 1.0;
    c.bos_id = -1;
    c.eos_id = -1;
    char arch[64];
    if (config_family(f, &c, arch, sizeof arch, err) || config_sizes(f, arch, &c, err) ||
        config_vocab(f, arch, &c, err) || config_scaling_and_experts(f, arch, &c, err))
        return -1;
    c.qk_norm = c.family == FAMILY_QWEN3 || c.family == FAMILY_QWEN3MOE;
    GgufString name;
    if (gguf_get_string(f, "general.name", &name) == 1 && name.n > 0) {
        printable(name.s, name.n, c.name, sizeof c.name);
    } else {
        const char* base = strrchr(f->path, '/');
        str_copy(c.name, sizeof c.name, base ? base + 1 : f->path);
    }
    // The MoE math exists, but not the GGUF expert-tensor mapping (stacked ffn_*_exps, gpt-oss
    // de-interleaving): refuse rather than fail on the first expert tensor.
    if (config_is_moe(&c))
        return errorf(err, "%s: %s: loading mixture-of-experts weights from GGUF is not "
                           "implemented yet (use the HF safetensors checkpoint)",
                      f->path, family_names[c.family]);
    char verr[ERR_LEN];
    if (config_validate(&c, verr) != 0) return errorf(err, "%s: %s", f->path, verr);
    *cfg = c;
    return 0;
}

// ----------------------------------------------------------------------------
// tensor names and layout

void gguf_tensor_name(ModelFamily family, const TensorDesc* d, char* out, size_t cap) {
    if (family == FAMILY_GPTOSS && d->kind == TK_MLP_NORM) {
        snprintf(out, cap, "blk.%d.post_attention_norm.weight", d->block);
        return;
    }
    str_copy(out, cap, d->gguf_name);
}

// HF suffix (after "model.layers.N.") -> GGUF suffix (after "blk.N."), per family mask.
typedef struct NameMap {
    unsigned families;  // bit per ModelFamily
    const char* hf;
    const char* gguf;
} NameMap;

#define FAM(f)  (1u << (f))
#define FAM_ALL (FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE) | FAM(FAMILY_GPTOSS))

static const NameMap block_names[] = {
    {FAM_ALL, "input_layernorm.weight", "attn_norm.weight"},
    {FAM_ALL, "self_attn.q_proj.weight", "attn_q.weight"},
    {FAM_ALL, "self_attn.k_proj.weight", "attn_k.weight"},
    {FAM_ALL, "self_attn.v_proj.weight", "attn_v.weight"},
    {FAM_ALL, "self_attn.o_proj.weight", "attn_output.weight"},
    {FAM(FAMILY_GPTOSS), "self_attn.q_proj.bias", "attn_q.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.k_proj.bias", "attn_k.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.v_proj.bias", "attn_v.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.o_proj.bias", "attn_output.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.sinks", "attn_sinks.weight"},
    {FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "self_attn.q_norm.weight", "attn_q_norm.weight"},
    {FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "self_attn.k_norm.weight", "attn_k_norm.weight"},
    {FAM_ALL & ~FAM(FAMILY_GPTOSS), "post_attention_layernorm.weight", "ffn_norm.weight"},
    {FAM(FAMILY_GPTOSS), "post_attention_layernorm.weight", "post_attention_norm.weight"},
    {FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "mlp.gate_proj.weight",
     "ffn_gate.weight"},
    {FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "mlp.up_proj.weight",
     "ffn_up.weight"},
    {FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "mlp.down_proj.weight",
     "ffn_down.weight"},
    // MoE routers and stacked experts (§2.7). The stacked GGUF tensors are [E, out, in] row-major;
    // the HF forms differ per family (see GgufLayout notes in gguf_name_from_hf).
    {FAM(FAMILY_QWEN3MOE), "mlp.gate.weight", "ffn_gate_inp.weight"},
    {FAM(FAMILY_QWEN3MOE), "mlp.experts.gate_up_proj", "ffn_gate_exps.weight"},
    {FAM(FAMILY_QWEN3MOE), "mlp.experts.down_proj", "ffn_down_exps.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.router.weight", "ffn_gate_inp.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.router.bias", "ffn_gate_inp.bias"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.gate_up_proj", "ffn_gate_exps.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.gate_up_proj_bias", "ffn_gate_exps.bias"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.down_proj", "ffn_down_exps.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.down_proj_bias", "ffn_down_exps.bias"},
};

// Layout notes for the MoE entries (what the MoE loader must do beyond the name):
//  - qwen3moe per-expert "mlp.experts.{e}.{gate,up,down}_proj.weight" [out, in] are slice e of
//    ffn_{gate,up,down}_exps.weight; the transformers-5 fused "mlp.experts.gate_up_proj"
//    [E, 2Im, H] holds the gate rows then the up rows (ffn_gate_exps, then ffn_up_exps).
//  - gpt-oss "mlp.experts.gate_up_proj" [E, H, 2I] is x·W with gate/up interleaved in the
//    columns: ffn_gate_exps[e] = W[e][:, 0::2]ᵀ and ffn_up_exps[e] = W[e][:, 1::2]ᵀ (biases: the
//    same de-interleave, no transpose); "down_proj" [E, I, H] is ffn_down_exps[e]ᵀ.
int gguf_name_from_hf(ModelFamily family, const char* hf, char* out, size_t cap) {
    static const struct {
        const char* hf;
        const char* gguf;
    } top[] = {{"model.embed_tokens.weight", "token_embd.weight"},
               {"model.norm.weight", "output_norm.weight"},
               {"lm_head.weight", "output.weight"}};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (strcmp(hf, top[i].hf) == 0) {
            str_copy(out, cap, top[i].gguf);
            return 0;
        }
    int layer, n = 0;
    if (sscanf(hf, "model.layers.%d.%n", &layer, &n) != 1 || n == 0 || layer < 0) return -1;
    const char* rest = hf + n;
    // qwen3moe per-expert tensors: "mlp.experts.{e}.gate_proj.weight" -> the stacked tensor
    int e, m = 0;
    char which[16];
    if (family == FAMILY_QWEN3MOE &&
        sscanf(rest, "mlp.experts.%d.%15[a-z]_proj.weight%n", &e, which, &m) == 2 &&
        rest[m] == '\0' && e >= 0 &&
        (strcmp(which, "gate") == 0 || strcmp(which, "up") == 0 || strcmp(which, "down") == 0)) {
        snprintf(out, cap, "blk.%d.ffn_%s_exps.weight", layer, which);
        return 0;
    }
    for (size_t i = 0; i < sizeof block_names / sizeof block_names[0]; i++) {
        if (!(block_names[i].families & FAM(family)) || strcmp(rest, block_names[i].hf) != 0)
            continue;
        snprintf(out, cap, "blk.%d.%s", layer, block_names[i].gguf);
        return 0;
    }
    return -1;
}

void gguf_permute_rows(const float* src, float* dst, int n_head, int64_t rows, int64_t cols,
                       int inverse) {
    const int64_t hd = rows / n_head, half = hd / 2;
    for (int64_t h = 0; h < n_head; h++)
        for (int64_t i = 0; i < half; i++)
            for (int64_t j = 0; j < 2; j++) {
                int64_t gguf_row = h * hd + 2 * i + j, hf_row = h * hd + j * half + i;
                int64_t from = inverse ? gguf_row : hf_row, to = inverse ? hf_row : gguf_row;
                memcpy(dst + to * cols, src + from * cols, (size_t)cols * sizeof(float));
            }
}

void gguf_llama3_rope_factors(const ModelConfig* c, float* r) {
    const int half = c->HD / 2;
    const double lf = c->rope_low_freq_factor, hf = c->rope_high_freq_factor;
    const double L0 = c->rope_original_max_pos, factor = c->rope_factor;
    const double lam_lo = L0 / lf, lam_hi = L0 / hf;
    for (int i = 0; i < half; i++) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)c->HD);
        double lam = 2.0 * M_PI / (double)base;
        if (lam < lam_hi)
            r[i] = 1.0f;
        else if (lam > lam_lo)
            r[i] = (float)factor;
        else {
            double smooth = (L0 / lam - lf) / (hf - lf);
            r[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
        }
    }
}

static void shape_text(const int64_t* dims, int n, char* buf, size_t cap) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int k = 0; k < n && o + 24 < cap; k++)
        o += (size_t)snprintf(buf + o, cap - o, k ? ", %lld" : "%lld", (long long)dims[k]);
    snprintf(buf + o, cap - o, "]");
}

int gguf_read_hf_tensor(const GgufFile* f, const ModelConfig* cfg, const TensorDesc* d, float* out,
                        char* err) {
    char name[GGUF_MAX_NAME + 32];
    gguf_tensor_name(cfg->family, d, name, sizeof name);
    const GgufTensor* t = gguf_find_tensor(f, name);
    if (!t) return errorf(err, "%s: tensor '%s' (HF %s) is missing", f->path, name, d->hf_name);
    // ne is the HF shape reversed; trailing ne of 1 may be dropped by ggml's own writers
    int64_t want[GGUF_MAX_DIMS] = {1, 1, 1, 1};
    for (int k = 0; k < d->ndim && k < GGUF_MAX_DIMS; k++) want[k] = d->shape[d->ndim - 1 - k];
    int ok = d->ndim <= GGUF_MAX_DIMS;
    for (int k = 0; ok && k < GGUF_MAX_DIMS; k++) ok = t->ne[k] == want[k];
    if (!ok) {
        char got[96], need[96];
        shape_text(t->ne, t->n_dims, got, sizeof got);
        shape_text(want, d->ndim, need, sizeof need);
        return errorf(err, "%s: tensor '%s' has ne %s, the config needs ne %s (HF %s)", f->path,
                      name, got, need, d->hf_name);
    }
    int permute = cfg->family == FAMILY_LLAMA && (d->kind == TK_WQ || d->kind == TK_WK);
    if (!permute) return gguf_tensor_to_f32(f, t, out, d->numel, err);
    // llama.cpp permuted these rows for its adjacent-pair RoPE: undo it (§2.9)
    int n_head = d->kind == TK_WQ ? cfg->H : cfg->KVH;
    float* tmp = malloc_check((size_t)d->numel * sizeof(float));
    int rc = gguf_tensor_to_f32(f, t, tmp, d->numel, err);
    if (rc == 0) gguf_permute_rows(tmp, out, n_head, d->shape[0], d->shape[1], 1);
    free(tmp);
    return rc;
}

// ----------------------------------------------------------------------------
// tokenizer records

void gguf_tokenizer_extract(const GgufFile* f, GgufTokenizer* tok) {
    memset(tok, 0, sizeof *tok);
    size_t total = 0;
    for (int64_t i = 0; i < f->n_kv; i++)
        if (strncmp(f->kv[i].key, "tokenizer.", 10) == 0)
            total += (size_t)(f->kv[i].raw_end - f->kv[i].raw_begin);
    if (total == 0) return;
    tok->records = malloc_check(total);
    for (int64_t i = 0; i < f->n_kv; i++) {
        const GgufKV* kv = &f->kv[i];
        if (strncmp(kv->key, "tokenizer.", 10) != 0) continue;
        size_t n = (size_t)(kv->raw_end - kv->raw_begin);
        memcpy(tok->records + tok->len, f->map + kv->raw_begin, n);
        tok->len += n;
        tok->n_kv++;
    }
}

void gguf_tokenizer_free(GgufTokenizer* tok) {
    free(tok->records);
    memset(tok, 0, sizeof *tok);
}

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
    t->name = copy_cstr(name, strlen(name));
    t->type = type;
    t->n_dims = ndim;
    for (int k = 0; k < ndim; k++) t->ne[k] = shape[ndim - 1 - k];
    t->data = data;
    t->owned = owned ? (float*)data : NULL;
}

static void writer_add_arch_u32(GgufWriter* w, const char* arch, const char* suffix, int v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    gguf_writer_add_u32(w, key, (uint32_t)v);
}

static void writer_add_arch_f32(GgufWriter* w, const char* arch, const char* suffix, double v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    gguf_writer_add_f32(w, key, (float)v);
}

void gguf_writer_add_config(GgufWriter* w, const ModelConfig* c) {
    const char* arch = gguf_arch_name(c->family);
    gguf_writer_add_string(w, "general.architecture", arch);
    gguf_writer_add_string(w, "general.name", c->name);
    writer_add_arch_u32(w, arch, "block_count", c->L);
    writer_add_arch_u32(w, arch, "context_length", c->max_pos);
    writer_add_arch_u32(w, arch, "embedding_length", c->C);
    writer_add_arch_u32(w, arch, "feed_forward_length", c->F);
    writer_add_arch_u32(w, arch, "attention.head_count", c->H);
    writer_add_arch_u32(w, arch, "attention.head_count_kv", c->KVH);
    writer_add_arch_u32(w, arch, "attention.key_length", c->HD);
    writer_add_arch_u32(w, arch, "attention.value_length", c->HD);
    writer_add_arch_f32(w, arch, "attention.layer_norm_rms_epsilon", c->norm_eps);
    writer_add_arch_f32(w, arch, "rope.freq_base", c->rope_theta);
    writer_add_arch_u32(w, arch, "rope.dimension_count", c->HD);
    writer_add_arch_u32(w, arch, "vocab_size", c->V);
    if (c->rope_type == ROPE_YARN) {
        char key[128];
        snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
        gguf_writer_add_string(w, key, "yarn");
        writer_add_arch_f32(w, arch, "rope.scaling.factor", c->rope_factor);
        writer_add_arch_u32(w, arch, "rope.scaling.original_context_length",
                            c->rope_original_max_pos);
        writer_add_arch_f32(w, arch, "rope.scaling.yarn_beta_fast", c->yarn_beta_fast);
        writer_add_arch_f32(w, arch, "rope.scaling.yarn_beta_slow", c->yarn_beta_slow);
    }
    if (c->E > 0) {
        writer_add_arch_u32(w, arch, "expert_count", c->E);
        writer_add_arch_u32(w, arch, "expert_used_count", c->K);
        writer_add_arch_u32(w, arch, "expert_feed_forward_length", c->F_expert);
    }
    if (c->sliding_window > 0)
        writer_add_arch_u32(w, arch, "attention.sliding_window", c->sliding_window);
}

static int compare_writer_names(const void* a, const void* b) {
    return strcmp((*(const GgufWriterTensor* const*)a)->name,
                  (*(const GgufWriterTensor* const*)b)->name);
}

// Convert and write one tensor in chunks (no whole-tensor copy). -1 + err on a value the type
// cannot hold or an I/O error.
static int write_tensor_data(FILE* fp, const GgufWriterTensor* t, const char* path, char* err) {
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
        if (fwrite(buf, 1, bytes, fp) != bytes)
            return errorf(err, "%s: write failed: %s", path, strerror(errno));
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

    char* tmp = malloc_check(strlen(path) + 5);
    sprintf(tmp, "%s.tmp", path);
    int rc = 0;
    FILE* fp = fopen(tmp, "wb");
    if (!fp) {
        rc = errorf(err, "%s: cannot create: %s", tmp, strerror(errno));
    } else {
        int ok = fwrite(head.kv, 1, head.kv_len, fp) == head.kv_len;
        if (!ok) rc = errorf(err, "%s: write failed: %s", tmp, strerror(errno));
        for (int i = 0; i < w->n && rc == 0; i++) {
            rc = write_tensor_data(fp, &w->t[i], path, err);
            uint64_t nb = writer_tensor_bytes(&w->t[i]);
            size_t pad = (size_t)((A - nb % A) % A);
            if (rc == 0 && fwrite(zeros, 1, pad, fp) != pad)
                rc = errorf(err, "%s: write failed: %s", tmp, strerror(errno));
        }
        if (rc == 0 && (fflush(fp) != 0 || fsync(fileno(fp)) != 0))
            rc = errorf(err, "%s: flush failed: %s", tmp, strerror(errno));
        if (fclose(fp) != 0 && rc == 0)
            rc = errorf(err, "%s: close failed: %s", tmp, strerror(errno));
        if (rc == 0 && rename(tmp, path) != 0)
            rc = errorf(err, "%s: rename from %s failed: %s", path, tmp, strerror(errno));
        if (rc != 0) unlink(tmp);
    }
    free(tmp);
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
