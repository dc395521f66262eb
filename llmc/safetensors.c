/*
 * safetensors.c — read (mmap + full validation), open sharded checkpoints, convert to fp32, write.
 *
 * Layout (docs/FORMATS.md §3.1): u64 LE header length N | N bytes of JSON | data buffer.
 * Invariants after a successful st_open:
 *  - every tensor has a known dtype, rank <= ST_MAX_DIMS, non-negative dims whose product and byte
 *    size do not overflow, and data_offsets with end - begin == numel * dtype size;
 *  - sorted by begin, the tensors tile the data buffer exactly (no gap, no overlap, no trailing
 *    bytes), so every data pointer lies inside the mapping;
 *  - tensors[] is sorted by name (strcmp order) and names are unique, NUL-free C strings.
 * The mapping is read-only (PROT_READ, MAP_PRIVATE) and only 1-byte alignment of tensor data is
 * assumed: conversions read elements with memcpy.
 * Every error is one line that starts with the file path and names the tensor or field.
 */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"
#include "json.h"

#define ST_MAX_HEADER 100000000ull  // the reference reader's limit
#define ST_MAX_INDEX_BYTES (100u << 20)

// ----------------------------------------------------------------------------
// dtypes

static const char* const st_dtype_names[ST_DTYPE_COUNT] = {
    "BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
    "F64", "I64", "U64", "F8_E5M2", "F8_E4M3",
};
static const int st_dtype_sizes[ST_DTYPE_COUNT] = {1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8, 1, 1};

const char* st_dtype_name(StDtype dt) {
    return (dt >= 0 && dt < ST_DTYPE_COUNT) ? st_dtype_names[dt] : "?";
}

int st_dtype_size(StDtype dt) { return (dt >= 0 && dt < ST_DTYPE_COUNT) ? st_dtype_sizes[dt] : 0; }

static int st_dtype_parse(const char* s, StDtype* out) {
    for (int i = 0; i < ST_DTYPE_COUNT; i++) {
        if (strcmp(s, st_dtype_names[i]) == 0) {
            *out = (StDtype)i;
            return 0;
        }
    }
    return -1;
}

// ----------------------------------------------------------------------------
// helpers

static char* st_strdup(const char* s) {
    size_t n = strlen(s);
    char* d = malloc_check(n + 1);
    memcpy(d, s, n + 1);
    return d;
}

static int st_compare_tensor_names(const void* a, const void* b) {
    return strcmp(((const StTensor*)a)->name, ((const StTensor*)b)->name);
}

static int st_compare_tensor_ptr_names(const void* a, const void* b) {
    return strcmp((*(const StTensor* const*)a)->name, (*(const StTensor* const*)b)->name);
}

// Sort by (begin, end) so zero-sized tensors sit before a non-empty one at the same offset.
typedef struct StSpan {
    uint64_t begin, end;
    int index;
} StSpan;

static int st_compare_spans(const void* a, const void* b) {
    const StSpan* x = a;
    const StSpan* y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

// ----------------------------------------------------------------------------
// header validation

// A JSON integer >= 0, written as an integer literal.
static int st_json_uint(const JsonValue* v, uint64_t* out) {
    if (v->type != JSON_NUMBER || !v->is_integer || v->integer < 0) return -1;
    *out = (uint64_t)v->integer;
    return 0;
}

// Validate one header entry and fill t (all but name/file/data). data_size: bytes after the header.
static int st_parse_tensor(const char* path, const char* name, const JsonValue* e,
                           uint64_t data_size, StTensor* t, uint64_t* begin, char* err) {
    if (e->type != JSON_OBJECT)
        return errorf(err, "%s: tensor '%s': header entry is not an object", path, name);
    const JsonValue *dtype = NULL, *shape = NULL, *offsets = NULL;
    for (size_t i = 0; i < e->n; i++) {
        const char* k = e->keys[i];
        if (strcmp(k, "dtype") == 0 && e->key_lens[i] == 5) dtype = &e->items[i];
        else if (strcmp(k, "shape") == 0 && e->key_lens[i] == 5) shape = &e->items[i];
        else if (strcmp(k, "data_offsets") == 0 && e->key_lens[i] == 12) offsets = &e->items[i];
        else {
            char key[64];
            return errorf(err, "%s: tensor '%s': unknown field '%s'", path, name,
                          str_printable(k, e->key_lens[i], key, sizeof key));
        }
    }
    if (!dtype || !shape || !offsets) {
        return errorf(err, "%s: tensor '%s': missing field '%s'", path, name,
                      !dtype ? "dtype" : !shape ? "shape" : "data_offsets");
    }

    if (dtype->type != JSON_STRING)
        return errorf(err, "%s: tensor '%s': dtype is not a string", path, name);
    if (strlen(dtype->str) != dtype->str_len || st_dtype_parse(dtype->str, &t->dtype) != 0) {
        char d[40];
        return errorf(err, "%s: tensor '%s': unsupported dtype '%s'", path, name,
                      str_printable(dtype->str, dtype->str_len, d, sizeof d));
    }

    if (shape->type != JSON_ARRAY)
        return errorf(err, "%s: tensor '%s': shape is not an array", path, name);
    if (shape->n > ST_MAX_DIMS) {
        return errorf(err, "%s: tensor '%s': shape has %zu dimensions (at most %d supported)",
                      path, name, shape->n, ST_MAX_DIMS);
    }
    t->ndim = (int)shape->n;
    // numel: the product of the non-zero dims must fit in int64 even when another dim is 0, so
    // that code multiplying shape entries never overflows.
    uint64_t prod = 1;
    int has_zero = 0;
    for (int d = 0; d < t->ndim; d++) {
        uint64_t dim;
        if (st_json_uint(&shape->items[d], &dim) != 0) {
            return errorf(err, "%s: tensor '%s': shape[%d] is not a non-negative integer", path,
                          name, d);
        }
        t->shape[d] = (int64_t)dim;
        if (dim == 0) {
            has_zero = 1;
            continue;
        }
        if (prod > (uint64_t)INT64_MAX / dim)
            return errorf(err, "%s: tensor '%s': shape product overflows", path, name);
        prod *= dim;
    }
    t->numel = has_zero ? 0 : (int64_t)prod;
    uint64_t size = (uint64_t)st_dtype_size(t->dtype);
    if ((uint64_t)t->numel > UINT64_MAX / size)
        return errorf(err, "%s: tensor '%s': byte size overflows", path, name);
    t->nbytes = (uint64_t)t->numel * size;

    uint64_t b, en;
    if (offsets->type != JSON_ARRAY || offsets->n != 2 ||
        st_json_uint(&offsets->items[0], &b) != 0 || st_json_uint(&offsets->items[1], &en) != 0) {
        return errorf(err,
                      "%s: tensor '%s': data_offsets must be [begin, end] non-negative integers",
                      path, name);
    }
    if (b > en) {
        return errorf(err, "%s: tensor '%s': data_offsets begin %llu > end %llu", path, name,
                      (unsigned long long)b, (unsigned long long)en);
    }
    if (en - b != t->nbytes) {
        return errorf(err,
                      "%s: tensor '%s': data_offsets span %llu bytes but %s shape needs %llu",
                      path, name, (unsigned long long)(en - b), st_dtype_name(t->dtype),
                      (unsigned long long)t->nbytes);
    }
    if (en > data_size) {
        return errorf(err,
                      "%s: tensor '%s': data_offsets end %llu is past the data buffer (%llu bytes)",
                      path, name, (unsigned long long)en, (unsigned long long)data_size);
    }
    *begin = b;
    return 0;
}

// Check that the tensors tile [0, data_size) exactly.
static int st_check_tiling(const char* path, StTensor* ts, const uint64_t* begins, int n,
                           uint64_t data_size, char* err) {
    StSpan* spans = malloc_check((size_t)(n > 0 ? n : 1) * sizeof(StSpan));
    for (int i = 0; i < n; i++) spans[i] = (StSpan){begins[i], begins[i] + ts[i].nbytes, i};
    qsort(spans, (size_t)n, sizeof(StSpan), st_compare_spans);
    uint64_t expected = 0;
    int rc = 0;
    char name[96];
    for (int i = 0; i < n && rc == 0; i++) {
        const char* nm = ts[spans[i].index].name;
        str_printable(nm, strlen(nm), name, sizeof name);
        if (spans[i].begin > expected) {
            rc = errorf(err, "%s: tensor '%s': gap in the data buffer (bytes %llu..%llu unused)",
                        path, name, (unsigned long long)expected,
                        (unsigned long long)spans[i].begin);
        } else if (spans[i].begin < expected) {
            rc = errorf(err, "%s: tensor '%s': overlaps the previous tensor (begin %llu < %llu)",
                        path, name, (unsigned long long)spans[i].begin,
                        (unsigned long long)expected);
        }
        expected = spans[i].end;
    }
    if (rc == 0 && expected != data_size) {
        rc = errorf(err, "%s: %llu trailing bytes after the last tensor (data buffer %llu bytes, "
                         "tensors end at %llu)",
                    path, (unsigned long long)(data_size - expected), (unsigned long long)data_size,
                    (unsigned long long)expected);
    }
    free(spans);
    return rc;
}

// Fill f->tensors / f->meta from the parsed header. f->map/size/path are set.
static int st_load_header(StFile* f, const JsonValue* root, uint64_t header_len, char* err) {
    const char* path = f->path;
    uint64_t data_size = f->size - 8 - header_len;
    const uint8_t* data = f->map + 8 + header_len;

    // Count tensors and the bytes their names need; names live after the tensor array in one block.
    size_t n = 0, name_bytes = 0;
    const JsonValue* meta = NULL;
    for (size_t i = 0; i < root->n; i++) {
        if (root->key_lens[i] == 12 && memcmp(root->keys[i], "__metadata__", 12) == 0) {
            meta = &root->items[i];
            continue;
        }
        if (strlen(root->keys[i]) != root->key_lens[i]) {
            char nm[96];
            return errorf(err, "%s: tensor '%s': name contains a NUL byte", path,
                          str_printable(root->keys[i], root->key_lens[i], nm, sizeof nm));
        }
        n++;
        name_bytes += root->key_lens[i] + 1;  // bounded by the header length: no overflow
    }
    if (n > (size_t)INT32_MAX) return errorf(err, "%s: too many tensors", path);

    if (meta) {
        if (meta->type != JSON_OBJECT)
            return errorf(err, "%s: __metadata__ is not an object of strings", path);
        for (size_t i = 0; i < meta->n; i++) {
            if (meta->items[i].type != JSON_STRING) {
                char k[64];
                return errorf(err, "%s: __metadata__ '%s': value is not a string", path,
                              str_printable(meta->keys[i], meta->key_lens[i], k, sizeof k));
            }
        }
        f->n_meta = (int)meta->n;
        f->meta_keys = calloc_check(meta->n, sizeof(char*));
        f->meta_vals = calloc_check(meta->n, sizeof(char*));
        for (size_t i = 0; i < meta->n; i++) {
            // Embedded NULs truncate: metadata is informational only.
            f->meta_keys[i] = st_strdup(meta->keys[i]);
            f->meta_vals[i] = st_strdup(meta->items[i].str);
        }
    }

    f->tensors = malloc_check(n * sizeof(StTensor) + name_bytes);
    char* names = (char*)(f->tensors + n);
    uint64_t* begins = malloc_check((n > 0 ? n : 1) * sizeof(uint64_t));
    size_t k = 0;
    int rc = 0;
    for (size_t i = 0; i < root->n && rc == 0; i++) {
        if (root->items + i == meta) continue;
        StTensor* t = &f->tensors[k];
        memset(t, 0, sizeof *t);
        memcpy(names, root->keys[i], root->key_lens[i] + 1);
        t->name = names;
        t->file = f->path;
        names += root->key_lens[i] + 1;
        char nm[96];
        str_printable(t->name, root->key_lens[i], nm, sizeof nm);
        rc = st_parse_tensor(path, nm, &root->items[i], data_size, t, &begins[k], err);
        k++;
    }
    f->n_tensors = (int)k;  // tensors [0, k) have valid names, whatever rc is
    if (rc == 0) rc = st_check_tiling(path, f->tensors, begins, (int)n, data_size, err);
    if (rc == 0) {
        for (size_t i = 0; i < n; i++)
            f->tensors[i].data = f->tensors[i].nbytes ? data + begins[i] : NULL;
        qsort(f->tensors, n, sizeof(StTensor), st_compare_tensor_names);
    }
    free(begins);
    return rc;
}

// ----------------------------------------------------------------------------
// open / close / find

int st_open(StFile* f, const char* path, char* err) {
    memset(f, 0, sizeof *f);
    f->path = st_strdup(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        errorf(err, "%s: cannot open: %s", path, strerror(errno));
        st_close(f);
        return -1;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        errorf(err, "%s: not a regular file", path);
        st_close(f);
        return -1;
    }
    if (sb.st_size < 8) {
        close(fd);
        errorf(err, "%s: file is %lld bytes, too small for the 8-byte header length", path,
               (long long)sb.st_size);
        st_close(f);
        return -1;
    }
    void* m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);  // the mapping keeps the file alive
    if (m == MAP_FAILED) {
        errorf(err, "%s: mmap failed: %s", path, strerror(errno));
        st_close(f);
        return -1;
    }
    f->map = m;
    f->size = (size_t)sb.st_size;

    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--) header_len = (header_len << 8) | f->map[i];
    if (header_len > ST_MAX_HEADER) {
        errorf(err, "%s: header length %llu exceeds the limit of %llu bytes", path,
               (unsigned long long)header_len, ST_MAX_HEADER);
        st_close(f);
        return -1;
    }
    if (8 + header_len > f->size) {
        errorf(err, "%s: header length %llu runs past the end of the file (%zu bytes)", path,
               (unsigned long long)header_len, f->size);
        st_close(f);
        return -1;
    }
    const char* header = (const char*)f->map + 8;
    size_t first = 0;
    while (first < header_len && (header[first] == ' ' || header[first] == '\t' ||
                                  header[first] == '\n' || header[first] == '\r'))
        first++;
    if (first >= header_len || header[first] != '{') {
        errorf(err, "%s: header is not a JSON object (must start with '{')", path);
        st_close(f);
        return -1;
    }
    JsonDoc doc;
    char jerr[ERR_LEN];
    if (json_parse(header, (size_t)header_len, &doc, jerr) != 0) {
        errorf(err, "%s: header JSON (file offset 8) %s", path, jerr);
        st_close(f);
        return -1;
    }
    int rc = st_load_header(f, &doc.root, header_len, err);
    json_free(&doc);
    if (rc != 0) {
        st_close(f);
        return -1;
    }
    return 0;
}

void st_close(StFile* f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->size);
    free(f->tensors);  // names live in the same block
    for (int i = 0; i < f->n_meta; i++) {
        free(f->meta_keys[i]);
        free(f->meta_vals[i]);
    }
    free(f->meta_keys);
    free(f->meta_vals);
    free(f->path);
    memset(f, 0, sizeof *f);
}

const StTensor* st_find(const StFile* f, const char* name) {
    int lo = 0, hi = f->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(f->tensors[mid].name, name);
        if (c == 0) return &f->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

const char* st_meta(const StFile* f, const char* key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_vals[i];
    return NULL;
}

// ----------------------------------------------------------------------------
// checkpoints (single file or sharded)

static char* st_path_join(const char* dir, const char* name) {
    size_t a = strlen(dir), b = strlen(name);
    char* p = malloc_check(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

// Directory part of a path ("." when there is none).
static char* st_path_dir(const char* path) {
    const char* slash = strrchr(path, '/');
    if (!slash) return st_strdup(".");
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    char* d = malloc_check(n + 1);
    memcpy(d, path, n);
    d[n] = '\0';
    return d;
}

// Collect every tensor of every file, sorted by name; a name in two files is an error.
static int st_checkpoint_index_tensors(StCheckpoint* ck, char* err) {
    size_t total = 0;
    for (int i = 0; i < ck->n_files; i++) total += (size_t)ck->files[i].n_tensors;
    if (total > (size_t)INT32_MAX) return errorf(err, "checkpoint: too many tensors");
    ck->tensors = malloc_check((total > 0 ? total : 1) * sizeof(StTensor*));
    size_t k = 0;
    for (int i = 0; i < ck->n_files; i++)
        for (int j = 0; j < ck->files[i].n_tensors; j++)
            ck->tensors[k++] = &ck->files[i].tensors[j];
    ck->n_tensors = (int)total;
    qsort(ck->tensors, total, sizeof(StTensor*), st_compare_tensor_ptr_names);
    for (size_t i = 1; i < total; i++) {
        if (strcmp(ck->tensors[i - 1]->name, ck->tensors[i]->name) == 0) {
            char nm[96];
            const char* name = ck->tensors[i]->name;
            return errorf(err, "%s: tensor '%s' appears in two shards (also in %s)",
                          ck->tensors[i]->file, str_printable(name, strlen(name), nm, sizeof nm),
                          ck->tensors[i - 1]->file);
        }
    }
    return 0;
}

typedef struct StMapEntry {
    const char* name;   // tensor name (weight_map key)
    const char* shard;  // shard file name (weight_map value)
} StMapEntry;

static int st_compare_map_by_shard(const void* a, const void* b) {
    return strcmp(((const StMapEntry*)a)->shard, ((const StMapEntry*)b)->shard);
}

static int st_compare_map_by_name(const void* a, const void* b) {
    return strcmp(((const StMapEntry*)a)->name, ((const StMapEntry*)b)->name);
}

// Validate the weight_map of index `path` and fill `entries`. Does not touch the shards.
static int st_index_read_map(const char* path, const JsonValue* root, StMapEntry* entries,
                             char* err) {
    const JsonValue* wm = json_get(root, "weight_map");
    for (size_t i = 0; i < wm->n; i++) {
        char nm[96], sh[96];
        const JsonValue* v = &wm->items[i];
        str_printable(wm->keys[i], wm->key_lens[i], nm, sizeof nm);
        if (strlen(wm->keys[i]) != wm->key_lens[i])
            return errorf(err, "%s: weight_map: tensor '%s': name contains a NUL byte", path, nm);
        if (v->type != JSON_STRING)
            return errorf(err, "%s: weight_map: tensor '%s': shard is not a string", path, nm);
        str_printable(v->str, v->str_len, sh, sizeof sh);
        // Shards must sit next to the index: no paths, no escaping the directory.
        if (v->str_len == 0 || strlen(v->str) != v->str_len || strchr(v->str, '/') ||
            strstr(v->str, "..")) {
            return errorf(err, "%s: weight_map: tensor '%s': invalid shard file name '%s'", path,
                          nm, sh);
        }
        entries[i] = (StMapEntry){wm->keys[i], v->str};
    }
    return 0;
}

static int st_checkpoint_open_index(StCheckpoint* ck, const char* path, char* err) {
    size_t len;
    char* text = file_read_all(path, ST_MAX_INDEX_BYTES, &len, err);
    if (!text) return -1;
    JsonDoc doc;
    char jerr[ERR_LEN];
    if (json_parse(text, len, &doc, jerr) != 0) {
        free(text);
        return errorf(err, "%s: %s", path, jerr);
    }
    free(text);
    const JsonValue* root = &doc.root;
    const JsonValue* wm = json_get(root, "weight_map");
    const JsonValue* md = json_get(root, "metadata");
    int rc = 0;
    if (root->type != JSON_OBJECT) rc = errorf(err, "%s: index is not a JSON object", path);
    else if (!wm || wm->type != JSON_OBJECT)
        rc = errorf(err, "%s: missing or non-object \"weight_map\"", path);
    else if (wm->n == 0) rc = errorf(err, "%s: \"weight_map\" is empty", path);
    else if (md && md->type != JSON_OBJECT && md->type != JSON_NULL)
        rc = errorf(err, "%s: \"metadata\" is not an object", path);
    if (rc != 0) {
        json_free(&doc);
        return -1;
    }

    size_t n = wm->n;
    StMapEntry* entries = malloc_check(n * sizeof(StMapEntry));
    rc = st_index_read_map(path, root, entries, err);

    // Open each distinct shard once, in shard-name order.
    char* dir = st_path_dir(path);
    if (rc == 0) {
        qsort(entries, n, sizeof(StMapEntry), st_compare_map_by_shard);
        ck->files = calloc_check(n, sizeof(StFile));
        for (size_t i = 0; i < n && rc == 0; i++) {
            if (i > 0 && strcmp(entries[i].shard, entries[i - 1].shard) == 0) continue;
            char* shard_path = st_path_join(dir, entries[i].shard);
            if (!file_exists(shard_path)) {
                char nm[96];
                rc = errorf(err, "%s: shard %s (holding tensor '%s') does not exist", path,
                            shard_path,
                            str_printable(entries[i].name, strlen(entries[i].name), nm, sizeof nm));
            } else if (st_open(&ck->files[ck->n_files], shard_path, err) == 0) {
                ck->n_files++;
            } else {
                rc = -1;
            }
            free(shard_path);
        }
    }
    if (rc == 0) rc = st_checkpoint_index_tensors(ck, err);

    // Every weight_map entry must be in the shard it names; every tensor must be in the map.
    if (rc == 0) {
        qsort(entries, n, sizeof(StMapEntry), st_compare_map_by_name);
        for (size_t i = 0; i < n && rc == 0; i++) {
            const StTensor* t = st_checkpoint_find(ck, entries[i].name);
            char nm[96];
            str_printable(entries[i].name, strlen(entries[i].name), nm, sizeof nm);
            if (!t) {
                rc = errorf(err, "%s: tensor '%s' is mapped to shard %s, which does not contain it",
                            path, nm, entries[i].shard);
            } else {
                const char* base = strrchr(t->file, '/');
                base = base ? base + 1 : t->file;
                if (strcmp(base, entries[i].shard) != 0) {
                    rc = errorf(err, "%s: tensor '%s' is mapped to shard %s but is in %s", path,
                                nm, entries[i].shard, t->file);
                }
            }
        }
        // Both lists are sorted and every map entry was found: walk them together.
        for (size_t i = 0, j = 0; rc == 0 && (int)j < ck->n_tensors; j++) {
            if (i < n && strcmp(entries[i].name, ck->tensors[j]->name) == 0) {
                i++;
                continue;
            }
            char nm[96];
            const char* name = ck->tensors[j]->name;
            rc = errorf(err, "%s: tensor '%s' in shard %s is missing from the weight_map", path,
                        str_printable(name, strlen(name), nm, sizeof nm), ck->tensors[j]->file);
        }
    }
    free(dir);
    free(entries);
    json_free(&doc);
    return rc;
}

int st_checkpoint_open(StCheckpoint* ck, const char* path, char* err) {
    memset(ck, 0, sizeof *ck);
    int rc;
    if (dir_exists(path)) {
        char* index = st_path_join(path, "model.safetensors.index.json");
        char* single = st_path_join(path, "model.safetensors");
        if (file_exists(index)) {
            rc = st_checkpoint_open_index(ck, index, err);
        } else if (file_exists(single)) {
            ck->files = calloc_check(1, sizeof(StFile));
            rc = st_open(&ck->files[0], single, err);
            if (rc == 0) ck->n_files = 1;
            if (rc == 0) rc = st_checkpoint_index_tensors(ck, err);
        } else {
            rc = errorf(err, "%s: directory has neither model.safetensors.index.json nor "
                             "model.safetensors", path);
        }
        free(index);
        free(single);
    } else if (str_ends_with(path, ".json")) {
        rc = st_checkpoint_open_index(ck, path, err);
    } else {
        ck->files = calloc_check(1, sizeof(StFile));
        rc = st_open(&ck->files[0], path, err);
        if (rc == 0) ck->n_files = 1;
        if (rc == 0) rc = st_checkpoint_index_tensors(ck, err);
    }
    if (rc != 0) st_checkpoint_close(ck);
    return rc;
}

void st_checkpoint_close(StCheckpoint* ck) {
    if (!ck) return;
    for (int i = 0; i < ck->n_files; i++) st_close(&ck->files[i]);
    free(ck->files);
    free(ck->tensors);
    memset(ck, 0, sizeof *ck);
}

const StTensor* st_checkpoint_find(const StCheckpoint* ck, const char* name) {
    int lo = 0, hi = ck->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(ck->tensors[mid]->name, name);
        if (c == 0) return ck->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

// ----------------------------------------------------------------------------
// conversion

int st_tensor_to_f32(const StTensor* t, float* out, int64_t n, char* err) {
    if (n != t->numel) {
        return errorf(err, "%s: tensor '%s': asked for %lld elements but it has %lld", t->file,
                      t->name, (long long)n, (long long)t->numel);
    }
    const uint8_t* src = t->data;
    switch (t->dtype) {
        case ST_F32:
            if (n > 0) memcpy(out, src, (size_t)n * sizeof(float));
            break;
        case ST_F16:
            for (int64_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, src + 2 * i, 2);
                out[i] = f16_to_f32(h);
            }
            break;
        case ST_BF16:
            for (int64_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, src + 2 * i, 2);
                out[i] = bf16_to_f32(h);
            }
            break;
        default:
            return errorf(err, "%s: tensor '%s': dtype %s cannot be converted to float", t->file,
                          t->name, st_dtype_name(t->dtype));
    }
    // A NaN or Inf in a checkpoint would silently poison training: refuse it here, by index.
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(out[i])) {
            return errorf(err, "%s: tensor '%s': element %lld is %s", t->file, t->name,
                          (long long)i, isnan(out[i]) ? "NaN" : "infinite");
        }
    }
    return 0;
}

// ----------------------------------------------------------------------------
// writing

void st_writer_init(StWriter* w) { memset(w, 0, sizeof *w); }

void st_writer_add(StWriter* w, const char* name, StDtype dtype, int ndim, const int64_t* shape,
                   const void* data) {
    // Misuse here is a programming error, not bad input: fail loudly.
    if (dtype < 0 || dtype >= ST_DTYPE_COUNT || ndim < 0 || ndim > ST_MAX_DIMS)
        fatal_at(__FILE__, __LINE__, "st_writer_add('%s'): bad dtype %d or ndim %d", name,
                 (int)dtype, ndim);
    if (w->n == w->cap) {
        w->cap = w->cap ? w->cap * 2 : 16;
        w->t = realloc_check(w->t, (size_t)w->cap * sizeof(StWriterTensor));
    }
    StWriterTensor* t = &w->t[w->n++];
    memset(t, 0, sizeof *t);
    t->name = st_strdup(name);
    t->dtype = dtype;
    t->ndim = ndim;
    uint64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            fatal_at(__FILE__, __LINE__, "st_writer_add('%s'): negative shape[%d]", name, d);
        t->shape[d] = shape[d];
        if (shape[d] != 0 && numel > (uint64_t)INT64_MAX / (uint64_t)shape[d])
            fatal_at(__FILE__, __LINE__, "st_writer_add('%s'): shape overflows", name);
        numel *= (uint64_t)shape[d];
    }
    t->nbytes = numel * (uint64_t)st_dtype_size(dtype);
    t->data = data;
}

void st_writer_meta(StWriter* w, const char* key, const char* value) {
    for (int i = 0; i < w->n_meta; i++) {
        if (strcmp(w->meta_keys[i], key) == 0) {  // last value wins: keys must stay unique
            free(w->meta_vals[i]);
            w->meta_vals[i] = st_strdup(value);
            return;
        }
    }
    w->meta_keys = realloc_check(w->meta_keys, (size_t)(w->n_meta + 1) * sizeof(char*));
    w->meta_vals = realloc_check(w->meta_vals, (size_t)(w->n_meta + 1) * sizeof(char*));
    w->meta_keys[w->n_meta] = st_strdup(key);
    w->meta_vals[w->n_meta] = st_strdup(value);
    w->n_meta++;
}

static int st_compare_writer_ptr_names(const void* a, const void* b) {
    return strcmp((*(const StWriterTensor* const*)a)->name,
                  (*(const StWriterTensor* const*)b)->name);
}

// Build the padded header JSON into a malloc'd buffer; order[] gives the tensors in name order.
static char* st_writer_header(const StWriter* w, StWriterTensor* const* order, size_t* out_len) {
    char* buf = NULL;
    size_t len = 0;
    FILE* m = open_memstream(&buf, &len);
    if (!m) fatal_at(__FILE__, __LINE__, "open_memstream failed: %s", strerror(errno));
    fputc('{', m);
    int first = 1;
    if (w->n_meta > 0) {
        fputs("\"__metadata__\":{", m);
        for (int i = 0; i < w->n_meta; i++) {
            if (i) fputc(',', m);
            json_write_string(m, w->meta_keys[i]);
            fputc(':', m);
            json_write_string(m, w->meta_vals[i]);
        }
        fputc('}', m);
        first = 0;
    }
    uint64_t offset = 0;
    for (int i = 0; i < w->n; i++) {
        const StWriterTensor* t = order[i];
        if (!first) fputc(',', m);
        first = 0;
        json_write_string(m, t->name);
        fprintf(m, ":{\"dtype\":\"%s\",\"shape\":[", st_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++)
            fprintf(m, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        fprintf(m, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                (unsigned long long)(offset + t->nbytes));
        offset += t->nbytes;
    }
    fputc('}', m);
    // Pad with spaces so the data buffer starts 8-byte aligned (8 + len is a multiple of 8).
    fflush(m);  // updates len
    for (size_t pad = (8 - len % 8) % 8; pad > 0; pad--) fputc(' ', m);
    if (ferror(m) || fclose(m) != 0) fatal_at(__FILE__, __LINE__, "building header failed");
    *out_len = len;
    return buf;
}

int st_writer_write(StWriter* w, const char* path, char* err) {
    StWriterTensor** order = malloc_check((size_t)(w->n > 0 ? w->n : 1) * sizeof(*order));
    for (int i = 0; i < w->n; i++) order[i] = &w->t[i];
    qsort(order, (size_t)w->n, sizeof(*order), st_compare_writer_ptr_names);
    for (int i = 0; i < w->n; i++) {
        if ((i > 0 && strcmp(order[i - 1]->name, order[i]->name) == 0) ||
            strcmp(order[i]->name, "__metadata__") == 0) {
            errorf(err, "%s: duplicate or reserved tensor name '%s'", path, order[i]->name);
            free(order);
            return -1;
        }
        if (order[i]->nbytes > 0 && order[i]->data == NULL) {
            errorf(err, "%s: tensor '%s' has no data", path, order[i]->name);
            free(order);
            return -1;
        }
    }
    size_t header_len;
    char* header = st_writer_header(w, order, &header_len);

    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)header_len >> (8 * i));
    AtomicFile af;
    int rc = atomic_file_open(&af, path, err);
    if (rc == 0) {
        rc = atomic_file_write(&af, len8, 8, err);
        if (rc == 0) rc = atomic_file_write(&af, header, header_len, err);
        // Stream tensors straight from the caller's buffers: no copy of a multi-GB file.
        for (int i = 0; i < w->n && rc == 0; i++) {
            if (w->before) rc = w->before(w->before_ctx, (int)(order[i] - w->t), err);
            if (rc == 0) rc = atomic_file_write(&af, order[i]->data, (size_t)order[i]->nbytes, err);
        }
        w->file_bytes = af.bytes;  // (the commit releases af)
        w->file_crc32c = af.crc32c;
        if (rc == 0)
            rc = atomic_file_commit(&af, err);
        else
            atomic_file_abort(&af);
    }
    free(header);
    free(order);
    return rc;
}

int st_writer_visit(StWriter* w, char* err) {
    StWriterTensor** order = malloc_check((size_t)(w->n > 0 ? w->n : 1) * sizeof(*order));
    for (int i = 0; i < w->n; i++) order[i] = &w->t[i];
    qsort(order, (size_t)w->n, sizeof(*order), st_compare_writer_ptr_names);
    int rc = 0;
    for (int i = 0; i < w->n && rc == 0 && w->before; i++)
        rc = w->before(w->before_ctx, (int)(order[i] - w->t), err);
    free(order);
    return rc;
}

void st_writer_free(StWriter* w) {
    if (!w) return;
    for (int i = 0; i < w->n; i++) free(w->t[i].name);
    free(w->t);
    for (int i = 0; i < w->n_meta; i++) {
        free(w->meta_keys[i]);
        free(w->meta_vals[i]);
    }
    free(w->meta_keys);
    free(w->meta_vals);
    memset(w, 0, sizeof *w);
}
