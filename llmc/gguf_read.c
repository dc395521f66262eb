/*
 * gguf_read.c — the GGUF v3 container: a bounded parse of the header, the metadata records and the
 * tensor infos (offsets, alignment and overlaps checked), lookups and typed getters, and the
 * tokenizer records kept verbatim for exports; a stretch of a tensor's elements in fp32
 * (gguf_tensor_range_to_f32: a streamed base's loader reads large tensors in slices).
 *
 * Bounding rule: every count (keys, tensors, array elements) is first checked against the bytes
 * left divided by the smallest possible encoding of one item, and the arrays holding the parsed
 * items grow (doubling) as items are actually read, never to the claimed count up front: memory
 * is a small multiple of the bytes parsed as metadata, even for a hostile count in a file of many
 * GB. Nested arrays are limited to GGUF_MAX_ARRAY_DEPTH levels, so the recursion is bounded too.
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
// value types

static const char* const value_type_names[GGUF_TYPE_COUNT] = {
    "UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
    "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};
// Bytes of one scalar element (0 for STRING and ARRAY).
static const int value_type_sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char* gguf_value_type_name(GgufValueType t) {
    return (t >= 0 && t < GGUF_TYPE_COUNT) ? value_type_names[t] : "?";
}

// Keys and tensor names end up in one-line messages: NUL, newlines and other control bytes
// have no business in them (real files use ASCII identifiers).
static int has_control(GgufString s) {
    for (uint64_t i = 0; i < s.n; i++)
        if ((unsigned char)s.s[i] < 0x20 || (unsigned char)s.s[i] == 0x7f) return 1;
    return 0;
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
    *v = load_le32(c->p + c->pos);
    c->pos += 4;
    return 0;
}

static int cur_u64(Cursor* c, uint64_t* v, const char* what) {
    if (cur_need(c, 8, what)) return -1;
    *v = load_le64(c->p + c->pos);
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
            v->u = load_le16(q);
            c->pos += 2;
            return 0;
        case GGUF_TYPE_INT16:
            if (cur_need(c, 2, what)) return -1;
            v->i = (int16_t)load_le16(q);
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
    uint32_t magic = load_le32(f->map);
    if (magic != GGUF_MAGIC) {
        char m[16];
        return errorf(c->err, "%s: bad magic '%s' (0x%08x), expected 'GGUF': not a GGUF file",
                      f->path, str_printable((const char*)f->map, 4, m, sizeof m), magic);
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
        str_printable(key.s, key.n, kp, sizeof kp);
        if (key.n == 0 || key.n > GGUF_MAX_KEY || has_control(key))
            return errorf(c->err,
                          "%s: %s at offset %llu: key '%s' is empty, longer than %d bytes "
                          "or holds a control character",
                          f->path, what, (unsigned long long)kv->raw_begin, kp, GGUF_MAX_KEY);
        kv->key = strndup_check(key.s, key.n);
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
                            str_printable(sorted[i]->key, strlen(sorted[i]->key), kp, sizeof kp));
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
        str_printable(name.s, name.n, np, sizeof np);
        if (name.n == 0 || name.n >= GGUF_MAX_NAME || has_control(name))
            return errorf(c->err,
                          "%s: %s: name '%s' is empty, has %d or more bytes, or holds a "
                          "control character",
                          f->path, what, np, GGUF_MAX_NAME);
        t->name = strndup_check(name.s, name.n);
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
        int block_bytes = 0;
        const int block = ggml_type_block((int)type, &block_bytes);
        if (block == 0)
            return errorf(c->err,
                          "%s: tensor '%s': ggml type %s has a block size unknown to this "
                          "build (supported: %s)",
                          f->path, np, tn, ggml_supported_types());
        t->type = (GgmlType)type;
        if (t->ne[0] % block != 0)
            return errorf(c->err,
                          "%s: tensor '%s': ne[0] = %lld is not a multiple of the %s block "
                          "size %d",
                          f->path, np, (long long)t->ne[0], tn, block);
        uint64_t blocks = (uint64_t)t->numel / (uint64_t)block;
        if (blocks > UINT64_MAX / (uint64_t)block_bytes)
            return errorf(c->err, "%s: tensor '%s': byte size overflows", f->path, np);
        t->nbytes = blocks * (uint64_t)block_bytes;
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
    f->path = strndup_check(name, strlen(name));
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
    f->path = strndup_check(path, strlen(path));
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

int gguf_value_int(const GgufValue* v, int64_t* out) {
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
    return gguf_value_int(&kv->value, out) == 0 ? 1 : -1;
}

int gguf_get_float(const GgufFile* f, const char* key, double* out) {
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return 0;
    if (kv->value.type == GGUF_TYPE_FLOAT32 || kv->value.type == GGUF_TYPE_FLOAT64) {
        *out = kv->value.f;
        return 1;
    }
    int64_t i;
    if (gguf_value_int(&kv->value, &i) != 0) return -1;
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
    uint64_t u = size == 1 ? p[0] : size == 2 ? load_le16(p) : size == 4 ? load_le32(p) : load_le64(p);
    if (is_signed_type(v->elem_type)) {
        *out = size == 1 ? (int8_t)u : size == 2 ? (int16_t)u : size == 4 ? (int32_t)u : (int64_t)u;
        return 0;
    }
    if (u > (uint64_t)INT64_MAX) return -1;
    *out = (int64_t)u;
    return 0;
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
// a tensor's elements, in slices

// (gguf_tensor_to_f32's checks and messages over a stretch of whole blocks: a streamed base
// reads a large tensor a slice at a time, loader.c)
int gguf_tensor_range_to_f32(const GgufFile* f, const GgufTensor* t, int64_t from, int64_t n,
                             float* out, char* err) {
    if (!ggml_type_can_dequantize(t->type))
        return errorf(err,
                      "%s: tensor '%s' has type %s, which this build cannot load (supported: "
                      "%s)",
                      f->path, t->name, ggml_type_name(t->type), ggml_supported_types());
    int bytes = 0;
    const int block = ggml_type_block(t->type, &bytes);
    if (from < 0 || n < 0 || from + n > t->numel || from % block != 0 || n % block != 0)
        return errorf(err, "%s: tensor '%s': elements [%lld, %lld) of %lld are not whole %s "
                      "blocks", f->path, t->name, (long long)from, (long long)(from + n),
                      (long long)t->numel, ggml_type_name(t->type));
    ggml_dequantize(t->type, t->data + (size_t)(from / block) * (size_t)bytes, out, n);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(out[i]))
            return errorf(err, "%s: tensor '%s': element %lld is %s", f->path, t->name,
                          (long long)(from + i), isnan(out[i]) ? "NaN" : "infinite");
    return 0;
}
