/*
 * json.c — strict RFC 8259 parser (config.json, safetensors headers, index files) and a string
 * escaper for writers.
 *
 * Design:
 *  - Recursive descent over text[0..len) (the text is NOT NUL-terminated: every read is bounds
 *    checked). Nesting is limited to JSON_MAX_DEPTH, so recursion depth is bounded.
 *  - The tree lives in one arena (a chain of bump-allocated blocks) owned by JsonDoc. Children of
 *    an array/object are collected on a temporary stack while parsing and copied into the arena
 *    as one contiguous items[] array when the container closes. Every decoded string is no
 *    longer than its literal, and a document may hold at most one value per JSON_BYTES_PER_VALUE
 *    input bytes (plus JSON_VALUE_SLACK), so memory is a fixed multiple of the input size: an
 *    80-byte JsonValue in the arena and a 104-byte stack entry (capacity doubling) per value,
 *    about 50 bytes per input byte at worst. Without the cap "[0,0,0,...]" (one value per 2
 *    bytes) took about 93 bytes per input byte, 9 GB for a 100 MB safetensors header. Real
 *    documents are far sparser (a safetensors header entry is >= 7 bytes per value).
 *  - Strict: no comments, no trailing commas, no leading zeros, no NaN/Infinity, no unescaped
 *    control characters, valid UTF-8 only, no lone surrogates, no duplicate keys in one object
 *    (checked at object end by sorting the keys: O(n log n), safetensors headers have thousands).
 *  - Errors: one line "at byte N: what"; the caller prefixes the file name.
 */
#include "json.h"

#include <math.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// arena: a chain of blocks, each bump-allocated; freed all at once by json_free

typedef struct ArenaBlock ArenaBlock;
struct ArenaBlock {
    ArenaBlock* next;
    size_t used, cap;
    alignas(16) unsigned char data[];
};

// The value cap: at most len / JSON_BYTES_PER_VALUE + JSON_VALUE_SLACK values per document.
#define JSON_BYTES_PER_VALUE 6
#define JSON_VALUE_SLACK 4096

#define ARENA_FIRST_BLOCK 4096
#define ARENA_MAX_BLOCK (1u << 20)

// Returns 16-byte aligned memory for size bytes (never NULL; out of memory is fatal).
static void* arena_alloc(ArenaBlock** head, size_t size) {
    size = (size + 15) & ~(size_t)15;
    ArenaBlock* b = *head;
    if (b == NULL || b->cap - b->used < size) {
        // Blocks grow geometrically up to 1 MB, so waste is bounded and small documents stay small.
        size_t cap = b ? b->cap * 2 : ARENA_FIRST_BLOCK;
        if (cap > ARENA_MAX_BLOCK) cap = ARENA_MAX_BLOCK;
        if (cap < size) cap = size;
        size_t total;
        if (size_add(sizeof(ArenaBlock), cap, &total) != 0) fatal("json: arena size overflow");
        ArenaBlock* nb = malloc_check(total);
        nb->next = b;
        nb->used = 0;
        nb->cap = cap;
        *head = nb;
        b = nb;
    }
    void* p = b->data + b->used;
    b->used += size;
    return p;
}

static void arena_free(ArenaBlock* b) {
    while (b) {
        ArenaBlock* next = b->next;
        free(b);
        b = next;
    }
}

// ----------------------------------------------------------------------------
// parser state

// A child waiting on the stack until its container closes.
typedef struct JsonPending {
    JsonValue v;
    const char* key;  // objects only
    size_t key_len;
    size_t key_pos;  // byte offset of the key (for the duplicate-key message)
} JsonPending;

typedef struct JsonParser {
    const char* text;
    size_t len, pos;
    ArenaBlock* arena;
    JsonPending* stack;
    size_t stack_n, stack_cap;
    size_t n_values, max_values;  // the value cap (bounds memory by the input size)
    char* err;
} JsonParser;

static int json_fail(JsonParser* p, size_t pos, const char* what) {
    return errorf(p->err, "at byte %zu: %s", pos, what);
}

// Describe the byte at pos for messages: "'x'", "byte 0x07" or "end of input".
static void json_describe_at(const JsonParser* p, size_t pos, char* buf, size_t cap) {
    if (pos >= p->len) {
        snprintf(buf, cap, "end of input");
        return;
    }
    unsigned char c = (unsigned char)p->text[pos];
    if (c >= 0x20 && c < 0x7f) snprintf(buf, cap, "'%c'", c);
    else snprintf(buf, cap, "byte 0x%02x", c);
}

static int json_fail_unexpected(JsonParser* p, const char* expected) {
    char what[32];
    json_describe_at(p, p->pos, what, sizeof what);
    return errorf(p->err, "at byte %zu: expected %s, found %s", p->pos, expected, what);
}

static void json_push(JsonParser* p, const JsonPending* e) {
    if (p->stack_n == p->stack_cap) {
        size_t cap = p->stack_cap ? p->stack_cap * 2 : 64;
        size_t bytes;
        if (size_mul(cap, sizeof(JsonPending), &bytes) != 0) fatal("json: stack size overflow");
        p->stack = realloc_check(p->stack, bytes);
        p->stack_cap = cap;
    }
    p->stack[p->stack_n++] = *e;
}

static void json_skip_ws(JsonParser* p) {
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

// ----------------------------------------------------------------------------
// strings

static int json_hex4(const char* s, uint32_t* out) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        uint32_t d;
        if (c >= '0' && c <= '9') d = (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') d = (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') d = (uint32_t)(c - 'A' + 10);
        else return -1;
        v = v * 16 + d;
    }
    *out = v;
    return 0;
}

static size_t json_put_utf8(char* dst, uint32_t cp) {
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Length of the valid UTF-8 sequence starting at s[0] (a byte >= 0x80), or 0 if invalid
// (overlong forms, UTF-16 surrogates and code points above U+10FFFF are invalid; RFC 3629).
static size_t json_utf8_len(const unsigned char* s, size_t avail) {
    unsigned char c = s[0];
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c == 0xE0) n = 3, lo = 0xA0;
    else if (c == 0xED) n = 3, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) n = 3;
    else if (c == 0xF0) n = 4, lo = 0x90;
    else if (c == 0xF4) n = 4, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) n = 4;
    else return 0;
    if (avail < n) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return n;
}

// p->pos is at the opening quote. Decodes into the arena.
static int json_parse_string(JsonParser* p, const char** out, size_t* out_len) {
    size_t start = p->pos + 1;
    // First pass: find the closing quote so the arena buffer can be sized (decoded <= raw).
    size_t end = start;
    while (end < p->len && p->text[end] != '"') end += (p->text[end] == '\\') ? 2 : 1;
    if (end >= p->len) return json_fail(p, p->pos, "unterminated string");

    char* dst = arena_alloc(&p->arena, end - start + 1);
    size_t o = 0, i = start;
    while (i < end) {
        unsigned char c = (unsigned char)p->text[i];
        if (c < 0x20) return json_fail(p, i, "unescaped control character in string");
        if (c >= 0x80) {
            size_t n = json_utf8_len((const unsigned char*)p->text + i, end - i);
            if (n == 0) return json_fail(p, i, "invalid UTF-8 in string");
            memcpy(dst + o, p->text + i, n);
            o += n;
            i += n;
            continue;
        }
        if (c != '\\') {
            dst[o++] = (char)c;
            i++;
            continue;
        }
        // escape: end - i >= 2 is guaranteed by the first pass
        char e = p->text[i + 1];
        switch (e) {
            case '"': dst[o++] = '"'; break;
            case '\\': dst[o++] = '\\'; break;
            case '/': dst[o++] = '/'; break;
            case 'b': dst[o++] = '\b'; break;
            case 'f': dst[o++] = '\f'; break;
            case 'n': dst[o++] = '\n'; break;
            case 'r': dst[o++] = '\r'; break;
            case 't': dst[o++] = '\t'; break;
            case 'u': {
                uint32_t cp;
                if (end - i < 6 || json_hex4(p->text + i + 2, &cp) != 0)
                    return json_fail(p, i, "bad \\u escape (need 4 hex digits)");
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return json_fail(p, i, "lone low surrogate in \\u escape");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    uint32_t lo;
                    if (end - i < 12 || p->text[i + 6] != '\\' || p->text[i + 7] != 'u' ||
                        json_hex4(p->text + i + 8, &lo) != 0 || lo < 0xDC00 || lo > 0xDFFF)
                        return json_fail(p, i, "high surrogate not followed by a low surrogate");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    i += 6;
                }
                o += json_put_utf8(dst + o, cp);
                i += 6;
                continue;
            }
            default: {
                char what[64];
                json_describe_at(p, i + 1, what, sizeof what);
                return errorf(p->err, "at byte %zu: invalid escape \\ followed by %s", i, what);
            }
        }
        i += 2;
    }
    dst[o] = '\0';
    *out = dst;
    *out_len = o;
    p->pos = end + 1;
    return 0;
}

// ----------------------------------------------------------------------------
// numbers

static int json_is_digit(const JsonParser* p, size_t pos) {
    return pos < p->len && p->text[pos] >= '0' && p->text[pos] <= '9';
}

static int json_parse_number(JsonParser* p, JsonValue* v) {
    size_t start = p->pos, i = p->pos;
    int negative = 0, is_integer = 1;
    if (i < p->len && p->text[i] == '-') negative = 1, i++;
    if (!json_is_digit(p, i)) {
        p->pos = i;
        return json_fail_unexpected(p, "a digit");
    }
    if (p->text[i] == '0') {
        i++;
        if (json_is_digit(p, i)) return json_fail(p, start, "leading zeros are not allowed");
    } else {
        while (json_is_digit(p, i)) i++;
    }
    size_t int_end = i;
    if (i < p->len && p->text[i] == '.') {
        is_integer = 0;
        i++;
        if (!json_is_digit(p, i)) {
            p->pos = i;
            return json_fail_unexpected(p, "a digit after '.'");
        }
        while (json_is_digit(p, i)) i++;
    }
    if (i < p->len && (p->text[i] == 'e' || p->text[i] == 'E')) {
        is_integer = 0;
        i++;
        if (i < p->len && (p->text[i] == '+' || p->text[i] == '-')) i++;
        if (!json_is_digit(p, i)) {
            p->pos = i;
            return json_fail_unexpected(p, "a digit in the exponent");
        }
        while (json_is_digit(p, i)) i++;
    }

    // strtod needs a NUL-terminated copy; long literals are rare but legal.
    size_t n = i - start;
    char small[128];
    char* buf = n < sizeof small ? small : malloc_check(n + 1);
    memcpy(buf, p->text + start, n);
    buf[n] = '\0';
    double d = strtod(buf, NULL);
    if (buf != small) free(buf);
    if (!isfinite(d)) return json_fail(p, start, "number out of range");

    v->type = JSON_NUMBER;
    v->number = d;
    v->is_integer = 0;
    v->integer = 0;
    if (is_integer) {
        // Exact int64 (doubles lose integers above 2^53, e.g. 9007199254740993).
        uint64_t mag = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        int fits = 1;
        for (size_t k = start + (size_t)negative; k < int_end; k++) {
            uint64_t digit = (uint64_t)(p->text[k] - '0');
            if (mag > (limit - digit) / 10) {
                fits = 0;
                break;
            }
            mag = mag * 10 + digit;
        }
        if (fits) {
            v->is_integer = 1;
            v->integer = negative ? (int64_t)(0 - mag) : (int64_t)mag;
        }
    }
    p->pos = i;
    return 0;
}

// ----------------------------------------------------------------------------
// values, arrays, objects

static int json_parse_value(JsonParser* p, JsonValue* v, int depth);

// Move the children pushed since `base` into one contiguous arena array.
static void json_collect_items(JsonParser* p, size_t base, JsonValue* v, int with_keys) {
    size_t n = p->stack_n - base;
    v->n = n;
    v->items = NULL;
    v->keys = NULL;
    v->key_lens = NULL;
    if (n == 0) return;
    JsonValue* items = arena_alloc(&p->arena, n * sizeof(JsonValue));
    const char** keys = with_keys ? arena_alloc(&p->arena, n * sizeof(char*)) : NULL;
    size_t* lens = with_keys ? arena_alloc(&p->arena, n * sizeof(size_t)) : NULL;
    for (size_t i = 0; i < n; i++) {
        items[i] = p->stack[base + i].v;
        if (with_keys) {
            keys[i] = p->stack[base + i].key;
            lens[i] = p->stack[base + i].key_len;
        }
    }
    v->items = items;
    v->keys = keys;
    v->key_lens = lens;
    p->stack_n = base;
}

static int json_compare_pending_keys(const void* a, const void* b) {
    const JsonPending* x = *(const JsonPending* const*)a;
    const JsonPending* y = *(const JsonPending* const*)b;
    size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    int c = memcmp(x->key, y->key, n);
    if (c != 0) return c;
    return (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

// Sort the keys of the object being closed and report the first duplicate.
static int json_check_duplicate_keys(JsonParser* p, size_t base) {
    size_t n = p->stack_n - base;
    if (n < 2) return 0;
    const JsonPending* local[16];
    const JsonPending** sorted = n <= 16 ? local : malloc_check(n * sizeof(*sorted));
    for (size_t i = 0; i < n; i++) sorted[i] = &p->stack[base + i];
    qsort(sorted, n, sizeof(*sorted), json_compare_pending_keys);
    int rc = 0;
    for (size_t i = 1; i < n; i++) {
        if (json_compare_pending_keys(&sorted[i - 1], &sorted[i]) == 0) {
            const JsonPending* later =
                sorted[i]->key_pos > sorted[i - 1]->key_pos ? sorted[i] : sorted[i - 1];
            char key[80];
            str_printable(later->key, later->key_len, key, sizeof key);
            rc = errorf(p->err, "at byte %zu: duplicate key \"%s\"", later->key_pos, key);
            break;
        }
    }
    if (sorted != local) free(sorted);
    return rc;
}

static int json_parse_array(JsonParser* p, JsonValue* v, int depth) {
    if (depth > JSON_MAX_DEPTH) return json_fail(p, p->pos, "nesting deeper than 64 levels");
    size_t base = p->stack_n;
    p->pos++;  // '['
    json_skip_ws(p);
    if (p->pos < p->len && p->text[p->pos] == ']') {
        p->pos++;
    } else {
        for (;;) {
            JsonPending e = {0};
            if (json_parse_value(p, &e.v, depth) != 0) return -1;
            json_push(p, &e);
            json_skip_ws(p);
            if (p->pos < p->len && p->text[p->pos] == ',') {
                p->pos++;
                continue;
            }
            if (p->pos < p->len && p->text[p->pos] == ']') {
                p->pos++;
                break;
            }
            return json_fail_unexpected(p, "',' or ']' in array");
        }
    }
    v->type = JSON_ARRAY;
    json_collect_items(p, base, v, 0);
    return 0;
}

static int json_parse_object(JsonParser* p, JsonValue* v, int depth) {
    if (depth > JSON_MAX_DEPTH) return json_fail(p, p->pos, "nesting deeper than 64 levels");
    size_t base = p->stack_n;
    p->pos++;  // '{'
    json_skip_ws(p);
    if (p->pos < p->len && p->text[p->pos] == '}') {
        p->pos++;
    } else {
        for (;;) {
            JsonPending e = {0};
            json_skip_ws(p);
            if (p->pos >= p->len || p->text[p->pos] != '"')
                return json_fail_unexpected(p, "a string key");
            e.key_pos = p->pos;
            if (json_parse_string(p, &e.key, &e.key_len) != 0) return -1;
            json_skip_ws(p);
            if (p->pos >= p->len || p->text[p->pos] != ':')
                return json_fail_unexpected(p, "':' after key");
            p->pos++;
            if (json_parse_value(p, &e.v, depth) != 0) return -1;
            json_push(p, &e);
            json_skip_ws(p);
            if (p->pos < p->len && p->text[p->pos] == ',') {
                p->pos++;
                continue;
            }
            if (p->pos < p->len && p->text[p->pos] == '}') {
                p->pos++;
                break;
            }
            return json_fail_unexpected(p, "',' or '}' in object");
        }
    }
    if (json_check_duplicate_keys(p, base) != 0) return -1;
    v->type = JSON_OBJECT;
    json_collect_items(p, base, v, 1);
    return 0;
}

static int json_parse_literal(JsonParser* p, const char* word) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0)
        return json_fail_unexpected(p, "a JSON value");
    p->pos += n;
    return 0;
}

// depth = number of containers enclosing this value.
static int json_parse_value(JsonParser* p, JsonValue* v, int depth) {
    memset(v, 0, sizeof *v);
    json_skip_ws(p);
    if (++p->n_values > p->max_values)
        return json_fail(p, p->pos, "too many values for the input size (a hostile document?)");
    if (p->pos >= p->len) return json_fail_unexpected(p, "a JSON value");
    char c = p->text[p->pos];
    switch (c) {
        case '{': return json_parse_object(p, v, depth + 1);
        case '[': return json_parse_array(p, v, depth + 1);
        case '"':
            v->type = JSON_STRING;
            return json_parse_string(p, &v->str, &v->str_len);
        case 't':
            v->type = JSON_BOOL;
            v->boolean = 1;
            return json_parse_literal(p, "true");
        case 'f':
            v->type = JSON_BOOL;
            return json_parse_literal(p, "false");
        case 'n':
            v->type = JSON_NULL;
            return json_parse_literal(p, "null");
        default:
            if (c == '-' || (c >= '0' && c <= '9')) return json_parse_number(p, v);
            return json_fail_unexpected(p, "a JSON value");
    }
}

// ----------------------------------------------------------------------------
// public parse / free

int json_parse(const char* text, size_t len, JsonDoc* doc, char* err) {
    memset(doc, 0, sizeof *doc);
    JsonParser p = {.text = text, .len = len, .err = err,
                    .max_values = len / JSON_BYTES_PER_VALUE + JSON_VALUE_SLACK};
    int rc = json_parse_value(&p, &doc->root, 0);
    if (rc == 0) {
        json_skip_ws(&p);
        if (p.pos < p.len) rc = json_fail_unexpected(&p, "end of input after the JSON value");
    }
    free(p.stack);
    if (rc != 0) {
        arena_free(p.arena);
        memset(doc, 0, sizeof *doc);
        return -1;
    }
    doc->arena = p.arena;
    return 0;
}

void json_free(JsonDoc* doc) {
    if (!doc) return;
    arena_free(doc->arena);
    memset(doc, 0, sizeof *doc);
}

// ----------------------------------------------------------------------------
// lookups

const JsonValue* json_get(const JsonValue* obj, const char* key) {
    if (!obj || obj->type != JSON_OBJECT || !key) return NULL;
    size_t n = strlen(key);
    for (size_t i = 0; i < obj->n; i++)
        if (obj->key_lens[i] == n && memcmp(obj->keys[i], key, n) == 0) return &obj->items[i];
    return NULL;
}

int json_get_int(const JsonValue* obj, const char* key, int64_t* out) {
    const JsonValue* v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_NUMBER || !v->is_integer) return -1;
    *out = v->integer;
    return 1;
}

int json_get_double(const JsonValue* obj, const char* key, double* out) {
    const JsonValue* v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_NUMBER) return -1;
    *out = v->number;
    return 1;
}

int json_get_bool(const JsonValue* obj, const char* key, int* out) {
    const JsonValue* v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_BOOL) return -1;
    *out = v->boolean;
    return 1;
}

int json_get_string(const JsonValue* obj, const char* key, const char** out) {
    const JsonValue* v = json_get(obj, key);
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_STRING) return -1;
    *out = v->str;
    return 1;
}

// ----------------------------------------------------------------------------
// writing

// The escaped form of one byte into buf (at most 6 chars + NUL); returns its length.
// Bytes >= 0x80 pass through: the input is assumed to be UTF-8 already.
static size_t json_escape_byte(unsigned char c, char* buf) {
    switch (c) {
        case '"': memcpy(buf, "\\\"", 3); return 2;
        case '\\': memcpy(buf, "\\\\", 3); return 2;
        case '\b': memcpy(buf, "\\b", 3); return 2;
        case '\f': memcpy(buf, "\\f", 3); return 2;
        case '\n': memcpy(buf, "\\n", 3); return 2;
        case '\r': memcpy(buf, "\\r", 3); return 2;
        case '\t': memcpy(buf, "\\t", 3); return 2;
        default: break;
    }
    if (c < 0x20 || c == 0x7f) {
        snprintf(buf, 7, "\\u%04x", c);
        return 6;
    }
    buf[0] = (char)c;
    buf[1] = '\0';
    return 1;
}

void json_write_string(FILE* f, const char* s) {
    char buf[8];
    fputc('"', f);
    for (const unsigned char* q = (const unsigned char*)s; *q; q++) {
        size_t n = json_escape_byte(*q, buf);
        fwrite(buf, 1, n, f);
    }
    fputc('"', f);
}

size_t json_escape(char* dst, size_t cap, const char* s) {
    if (cap == 0) return 0;
    size_t o = 0;
    char buf[8];
    // The quotes and every escape sequence are written whole or not at all.
    if (cap < 3) {
        dst[0] = '\0';
        return 0;
    }
    dst[o++] = '"';
    const unsigned char* q = (const unsigned char*)s;
    while (*q) {
        // One unit: an escaped byte, or a whole UTF-8 sequence (never cut a character in two).
        size_t n, adv = 1;
        const char* unit = buf;
        if (*q >= 0xC0) {
            while (adv < 4 && (q[adv] & 0xC0) == 0x80) adv++;
            n = adv;
            unit = (const char*)q;
        } else {
            n = json_escape_byte(*q, buf);
        }
        if (o + n + 2 > cap) break;  // keep room for the closing quote and the NUL
        memcpy(dst + o, unit, n);
        o += n;
        q += adv;
    }
    dst[o++] = '"';
    dst[o] = '\0';
    return o;
}
