/*
 * tokenizer.c — byte-level BPE: loading (HF tokenizer.json, GGUF metadata), the three split
 * scanners, BPE merging with a piece cache, decoding, and writing (GGUF records, tokenizer.json).
 *
 * Ids, not strings, drive BPE: the byte-level alphabet (GPT-2's bytes_to_unicode) maps the 256
 * bytes one to one onto 256 characters, so a piece's characters are its bytes, a model token is
 * the bytes its text stands for, and a merge (a, b) -> ab is a pair of ids with a rank and a
 * result id. Tokens whose text is not in that alphabet (added tokens like <|im_start|>) never
 * take part in BPE; they are matched as atoms and decode to their text, as HF's ByteLevel
 * decoder does.
 *
 * The split scanners reproduce the leftmost-alternative, greedy-with-backtracking semantics of
 * the regexes alternative by alternative (comments name them); the fixtures of
 * dev/tokenizer/fixtures check them against HF tokenizers (Oniguruma) over a multilingual corpus.
 */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "json.h"
#include "unicode.h"

#define TOK_MAX_VOCAB (1 << 24)     // ids above this are refused (bounds memory on bad input)
#define TOK_CACHE_SLOTS (1 << 16)   // piece cache: slots (a power of two)
#define TOK_CACHE_MAX_PIECE 64      // longer pieces are merged every time
#define TOK_CACHE_MAX_KEYS (4u << 20)  // key bytes kept before the cache is cleared
#define TOK_CACHE_MAX_IDS (1u << 20)

static const char* const SPLIT_REGEX[3] = {
    [TOK_SPLIT_GPT2] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
    [TOK_SPLIT_LLAMA3] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                         "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    [TOK_SPLIT_QWEN2] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                        "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};
// GGUF tokenizer.ggml.pre of each split (the names llama.cpp's converter writes)
static const char* const SPLIT_GGUF_PRE[3] = {
    [TOK_SPLIT_GPT2] = "default", [TOK_SPLIT_LLAMA3] = "llama-bpe", [TOK_SPLIT_QWEN2] = "qwen2"};

// GGUF token types (llama.cpp's llama_token_type)
enum { GGUF_TOK_NORMAL = 1, GGUF_TOK_UNKNOWN = 2, GGUF_TOK_CONTROL = 3, GGUF_TOK_USER = 4,
       GGUF_TOK_UNUSED = 5, GGUF_TOK_BYTE = 6 };

// ----------------------------------------------------------------------------
// small helpers

static uint64_t hash_bytes(const uint8_t* p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    h ^= w;  // the final mix of MurmurHash3: every input bit reaches the low bits used as index
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static uint64_t hash_pair(int32_t a, int32_t b) {
    uint64_t h = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 31);
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t c = 16;
    while (c < n) c *= 2;
    return c;
}

// s[0..n) for a one-line message: printable ASCII as is, the rest as \xNN, at most ~40 bytes.
static const char* printable(const void* s, size_t n, char* buf, size_t cap) {
    const uint8_t* p = s;
    size_t k = 0;
    for (size_t i = 0; i < n && k + 8 < cap; i++) {
        if (i == 40) {
            k += (size_t)snprintf(buf + k, cap - k, "...");
            break;
        }
        if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\') buf[k++] = (char)p[i];
        else k += (size_t)snprintf(buf + k, cap - k, "\\x%02x", p[i]);
    }
    buf[k] = '\0';
    return buf;
}

static void bytes_reserve(uint8_t** p, size_t* len, size_t* cap, size_t more) {
    if (*len + more <= *cap) return;
    size_t want = *cap ? *cap : 256;
    while (want < *len + more) want *= 2;
    *p = realloc_check(*p, want);
    *cap = want;
}

static void bytes_append(uint8_t** p, size_t* len, size_t* cap, const void* s, size_t n) {
    bytes_reserve(p, len, cap, n);
    if (n) memcpy(*p + *len, s, n);
    *len += n;
}

void tokenizer_ids_push(TokIds* v, int32_t id) {
    if (v->n == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 64;
        v->ids = realloc_check(v->ids, v->cap * sizeof(int32_t));
    }
    v->ids[v->n++] = id;
}

void tokenizer_ids_free(TokIds* v) {
    free(v->ids);
    memset(v, 0, sizeof *v);
}

// ----------------------------------------------------------------------------
// the byte-level alphabet (GPT-2's bytes_to_unicode): printable bytes stand for themselves, the
// other 68 (controls, space, DEL, no-break space, soft hyphen) for U+0100 + their rank

static uint32_t bytelevel_char(uint8_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    if (b <= 0x20) return 256u + b;
    if (b <= 0xA0) return 256u + 33 + (b - 0x7Fu);
    return 256u + 67;  // 0xAD
}

static int bytelevel_byte(uint32_t c) {
    if (c < 256) return ((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE) ? (int)c : -1;
    if (c >= 256 + 68) return -1;
    uint32_t k = c - 256;
    if (k < 33) return (int)k;
    if (k < 67) return (int)(0x7F + k - 33);
    return 0xAD;
}

// The bytes a byte-level string s[0..n) stands for, into out (n bytes of room): their count, or
// -1 when a character is outside the alphabet (the string is then raw text).
static long bytelevel_decode(const uint8_t* s, size_t n, uint8_t* out) {
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        i += (size_t)utf8_decode(s + i, n - i, &c);
        int b = bytelevel_byte(c);
        if (b < 0) return -1;
        out[k++] = (uint8_t)b;
    }
    return (long)k;
}

// Append the byte-level spelling of bytes s[0..n).
static void bytelevel_encode(const uint8_t* s, size_t n, uint8_t** out, size_t* len, size_t* cap) {
    bytes_reserve(out, len, cap, 2 * n);
    for (size_t i = 0; i < n; i++) *len += (size_t)utf8_encode(bytelevel_char(s[i]), *out + *len);
}

// ----------------------------------------------------------------------------
// lookups

static int32_t vocab_find(const Tokenizer* t, const uint8_t* s, size_t n) {
    if (!t->vocab_table) return -1;
    uint64_t h = hash_bytes(s, n);
    uint32_t tag = (uint32_t)(h >> 32);
    for (uint64_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        const TokVocabSlot* v = &t->vocab_table[i];
        if (v->id < 0) return -1;
        if (v->tag != tag) continue;  // the tag spares reading the pieces of other tokens
        uint64_t o = t->piece_off[v->id];
        if (t->piece_off[v->id + 1] - o == n && memcmp(t->pieces + o, s, n) == 0) return v->id;
    }
}

// The merge of (a, b): its result id (rank in *rank), or -1.
static inline int32_t merge_find(const Tokenizer* t, int32_t a, int32_t b, int32_t* rank) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint64_t i = hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const TokMergeSlot* s = &t->merge_table[i];
        if (s->key == UINT64_MAX) return -1;
        if (s->key == key) {
            *rank = s->rank;
            return s->id;
        }
    }
}

int32_t tokenizer_find(const Tokenizer* t, const char* s, size_t n) {
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && memcmp(t->added_text + t->added[i].off, s, n) == 0)
            return t->added[i].id;
    return vocab_find(t, (const uint8_t*)s, n);
}

const uint8_t* tokenizer_piece(const Tokenizer* t, int32_t id, size_t* len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    *len = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    return t->pieces + t->piece_off[id];
}

// ----------------------------------------------------------------------------
// building: both loaders describe every id and merge as text, then build_finish makes the tables

typedef struct TokEntry {
    const uint8_t* s;  // the token's text as the file spells it (byte-level for model tokens)
    size_t n;
    uint8_t kind;      // TOK_KIND_*
    uint8_t lstrip, rstrip;
} TokEntry;

typedef struct TokMergeText {
    const uint8_t *a, *b;
    size_t an, bn;
} TokMergeText;

typedef struct TokBuild {
    const char* name;  // for messages
    int32_t n;         // ids [0, n)
    TokEntry* e;
    size_t n_merges;
    TokMergeText* m;
} TokBuild;

static int build_set(TokBuild* b, int64_t id, const void* s, size_t n, int kind, int lstrip,
                     int rstrip, char* err) {
    char p1[200], p2[200];
    if (id < 0 || id >= b->n)
        return errorf(err, "%s: token '%s' has id %lld, outside [0, %d)", b->name,
                      printable(s, n, p1, sizeof p1), (long long)id, b->n);
    TokEntry* e = &b->e[id];
    if (e->kind != TOK_KIND_NONE) {
        // HF lists a model token again among the added tokens (GPT-2's <|endoftext|>): fine
        // when the text is the same; the added kind wins
        if (e->n != n || memcmp(e->s, s, n) != 0)
            return errorf(err, "%s: id %lld is both '%s' and '%s'", b->name, (long long)id,
                          printable(e->s, e->n, p1, sizeof p1), printable(s, n, p2, sizeof p2));
        if (kind == TOK_KIND_NORMAL) return 0;
    }
    e->s = s;
    e->n = n;
    e->kind = (uint8_t)kind;
    e->lstrip = (uint8_t)lstrip;
    e->rstrip = (uint8_t)rstrip;
    return 0;
}

static int compare_added(const void* pa, const void* pb, void* ctx) {
    const Tokenizer* t = ctx;
    const TokAdded *a = pa, *b = pb;
    uint8_t fa = t->added_text[a->off], fb = t->added_text[b->off];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;  // longest first
    return a->id < b->id ? -1 : a->id > b->id;
}

static void vocab_insert(Tokenizer* t, int32_t id) {
    const uint8_t* s = t->pieces + t->piece_off[id];
    size_t n = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    uint64_t h = hash_bytes(s, n);
    for (uint64_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        int32_t o = t->vocab_table[i].id;
        if (o < 0) {
            t->vocab_table[i].id = id;
            t->vocab_table[i].tag = (uint32_t)(h >> 32);
            return;
        }
        // the same bytes twice (a GGUF may list a token twice): the lower id is found
        if (t->piece_off[o + 1] - t->piece_off[o] == n && memcmp(t->pieces + t->piece_off[o], s, n) == 0)
            return;
    }
}

static void merge_insert(Tokenizer* t, int32_t a, int32_t b, int32_t rank, int32_t id) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint64_t i = hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        TokMergeSlot* s = &t->merge_table[i];
        if (s->key == UINT64_MAX || s->key == key) {
            // a pair listed twice: the later rank wins, as in HF (its merge map is a HashMap
            // collected in file order)
            s->key = key;
            s->rank = rank;
            s->id = id;
            return;
        }
    }
}

// The id of the model token spelled s[0..n) in the byte-level alphabet; -2 when the spelling is
// not byte-level (such a merge can never apply), -1 when no token has these bytes.
static int32_t build_lookup(const Tokenizer* t, const uint8_t* s, size_t n, uint8_t** scratch,
                            size_t* cap) {
    if (n > *cap) {
        *cap = n;
        *scratch = realloc_check(*scratch, n);
    }
    long k = bytelevel_decode(s, n, *scratch);
    if (k < 0) return -2;
    return vocab_find(t, *scratch, (size_t)k);
}

static int build_finish(TokBuild* b, Tokenizer* t, char* err) {
    char p1[200], p2[200];
    const int32_t V = b->n;
    t->n_vocab = V;
    t->kind = calloc_check((size_t)V, 1);
    t->bytelevel = calloc_check((size_t)V, 1);
    t->piece_off = malloc_check(((size_t)V + 1) * sizeof(uint64_t));
    size_t total = 0, n_model = 0, added_bytes = 0, max_len = 0;
    for (int32_t i = 0; i < V; i++) {
        total += b->e[i].n;
        if (b->e[i].n > max_len) max_len = b->e[i].n;
        if (b->e[i].kind == TOK_KIND_NORMAL) n_model++;
        if (b->e[i].kind >= TOK_KIND_ADDED && b->e[i].n > 0) {
            t->n_added++;
            added_bytes += b->e[i].n;
        }
    }
    // pieces: what each id decodes to (HF's ByteLevel decoder: the bytes when every character is
    // in the alphabet, else the text itself)
    t->pieces = malloc_check(total + 1);
    uint64_t off = 0;
    for (int32_t i = 0; i < V; i++) {
        const TokEntry* e = &b->e[i];
        t->kind[i] = e->kind;
        t->piece_off[i] = off;
        long k = e->n ? bytelevel_decode(e->s, e->n, t->pieces + off) : -1;
        if (k >= 0) {
            t->bytelevel[i] = 1;
            off += (uint64_t)k;
        } else if (e->n) {
            memcpy(t->pieces + off, e->s, e->n);
            off += e->n;
        }
    }
    t->piece_off[V] = off;
    // model tokens by bytes (BPE works on them; added tokens are atoms)
    t->vocab_mask = pow2_at_least(2 * n_model + 1) - 1;
    t->vocab_table = malloc_check((t->vocab_mask + 1) * sizeof(TokVocabSlot));
    memset(t->vocab_table, 0xff, (t->vocab_mask + 1) * sizeof(TokVocabSlot));
    for (int32_t i = 0; i < V; i++)
        if (t->kind[i] == TOK_KIND_NORMAL && t->bytelevel[i]) vocab_insert(t, i);
    for (int c = 0; c < 256; c++) {
        uint8_t byte = (uint8_t)c;
        t->byte_id[c] = vocab_find(t, &byte, 1);
    }
    // added tokens, sorted for leftmost-longest matching
    t->added = calloc_check((size_t)t->n_added + 1, sizeof(TokAdded));
    t->added_text = malloc_check(added_bytes + 1);
    int k = 0;
    uint64_t aoff = 0;
    for (int32_t i = 0; i < V; i++) {
        const TokEntry* e = &b->e[i];
        if (e->kind < TOK_KIND_ADDED || e->n == 0) continue;
        if (e->n > UINT32_MAX) return errorf(err, "%s: added token %d is too long", b->name, i);
        TokAdded* a = &t->added[k++];
        a->id = i;
        a->special = e->kind == TOK_KIND_SPECIAL;
        a->lstrip = e->lstrip;
        a->rstrip = e->rstrip;
        a->off = aoff;
        a->len = (uint32_t)e->n;
        memcpy(t->added_text + aoff, e->s, e->n);
        aoff += e->n;
    }
    qsort_r(t->added, (size_t)t->n_added, sizeof(TokAdded), compare_added, t);
    for (int c = 0, j = 0; c <= 256; c++) {
        while (j < t->n_added && t->added_text[t->added[j].off] < c) j++;
        t->added_first[c] = j;
    }
    // merges: ids of both halves and of the result, which must be a model token (HF refuses
    // a merge whose result is not in the vocabulary too)
    t->merge_mask = pow2_at_least(2 * b->n_merges + 1) - 1;
    t->merge_table = malloc_check((t->merge_mask + 1) * sizeof(TokMergeSlot));
    for (uint64_t i = 0; i <= t->merge_mask; i++) t->merge_table[i].key = UINT64_MAX;
    t->merges = malloc_check((b->n_merges + 1) * sizeof(*t->merges));
    size_t scratch_cap = max_len + 1;
    uint8_t* scratch = malloc_check(scratch_cap);
    uint8_t* both = NULL;
    size_t both_n = 0, both_cap = 0;
    int rc = 0;
    for (size_t r = 0; r < b->n_merges && rc == 0; r++) {
        const TokMergeText* m = &b->m[r];
        int32_t l = build_lookup(t, m->a, m->an, &scratch, &scratch_cap);
        int32_t rr = build_lookup(t, m->b, m->bn, &scratch, &scratch_cap);
        if (l == -2 || rr == -2) continue;  // not byte-level: it can never apply
        if (l < 0 || rr < 0) {
            const TokMergeText* mm = m;
            rc = errorf(err, "%s: merge %zu ('%s' '%s'): '%s' is not in the vocabulary", b->name, r,
                        printable(mm->a, mm->an, p1, sizeof p1), printable(mm->b, mm->bn, p2, sizeof p2),
                        l < 0 ? p1 : p2);
            break;
        }
        both_n = 0;
        bytes_append(&both, &both_n, &both_cap, t->pieces + t->piece_off[l],
                     (size_t)(t->piece_off[l + 1] - t->piece_off[l]));
        bytes_append(&both, &both_n, &both_cap, t->pieces + t->piece_off[rr],
                     (size_t)(t->piece_off[rr + 1] - t->piece_off[rr]));
        int32_t id = vocab_find(t, both, both_n);
        if (id < 0) {
            rc = errorf(err, "%s: merge %zu ('%s' '%s'): the result is not in the vocabulary", b->name,
                        r, printable(m->a, m->an, p1, sizeof p1), printable(m->b, m->bn, p2, sizeof p2));
            break;
        }
        merge_insert(t, l, rr, (int32_t)r, id);
        t->merges[t->n_merges][0] = l;
        t->merges[t->n_merges][1] = rr;
        t->n_merges++;
    }
    free(scratch);
    free(both);
    return rc;
}

static void build_free(TokBuild* b) {
    free(b->e);
    free(b->m);
    memset(b, 0, sizeof *b);
}

static void tokenizer_defaults(Tokenizer* t) {
    memset(t, 0, sizeof *t);
    t->bos_id = t->eos_id = t->pad_id = t->unk_id = -1;
}

void tokenizer_free(Tokenizer* t) {
    free(t->kind);
    free(t->bytelevel);
    free(t->piece_off);
    free(t->pieces);
    free(t->added);
    free(t->added_text);
    free(t->merges);
    free(t->merge_table);
    free(t->vocab_table);
    tokenizer_defaults(t);
}

// ----------------------------------------------------------------------------
// tokenizer.json

static int json_is(const JsonValue* v, const char* s) {
    return v && v->type == JSON_STRING && v->str_len == strlen(s) && memcmp(v->str, s, v->str_len) == 0;
}

// obj.key as a bool with a default; -1 (with err) when it is there but not a bool.
static int json_flag(const JsonValue* obj, const char* key, int def, const char* name,
                     const char* what, int* out, char* err) {
    int r = json_get_bool(obj, key, out);
    if (r == 0) *out = def;
    if (r < 0) return errorf(err, "%s: %s.%s must be true or false", name, what, key);
    return 0;
}

static int json_type_of(const JsonValue* v, const char* name, const char* what, const char** type,
                        char* err) {
    if (!v || v->type != JSON_OBJECT) return errorf(err, "%s: %s must be an object", name, what);
    if (json_get_string(v, "type", type) != 1)
        return errorf(err, "%s: %s has no \"type\"", name, what);
    return 0;
}

static int parse_normalizer(Tokenizer* t, const JsonValue* v, const char* name, char* err) {
    if (!v || v->type == JSON_NULL) return 0;
    const char* type;
    if (json_type_of(v, name, "normalizer", &type, err)) return -1;
    if (strcmp(type, "NFC") == 0) {
        t->nfc = 1;
        return 0;
    }
    if (strcmp(type, "Sequence") == 0) {
        const JsonValue* list = json_get(v, "normalizers");
        if (!list || list->type != JSON_ARRAY)
            return errorf(err, "%s: normalizer Sequence has no \"normalizers\" list", name);
        for (size_t i = 0; i < list->n; i++)
            if (parse_normalizer(t, &list->items[i], name, err)) return -1;
        return 0;
    }
    char p[200];
    return errorf(err, "%s: normalizer '%s' is not supported (NFC or none)", name,
                  printable(type, strlen(type), p, sizeof p));
}

static int parse_pre_tokenizer(Tokenizer* t, const JsonValue* v, const char* name, char* err) {
    const char* type;
    char p[200];
    if (!v || v->type == JSON_NULL)
        return errorf(err, "%s: no pre_tokenizer (only byte-level BPE tokenizers are supported)", name);
    if (json_type_of(v, name, "pre_tokenizer", &type, err)) return -1;
    const JsonValue* list = v;
    size_t n = 1;
    if (strcmp(type, "Sequence") == 0) {
        list = json_get(v, "pretokenizers");
        if (!list || list->type != JSON_ARRAY)
            return errorf(err, "%s: pre_tokenizer Sequence has no \"pretokenizers\" list", name);
        n = list->n;
    }
    int have_split = 0, have_bytelevel = 0;
    for (size_t i = 0; i < n; i++) {
        const JsonValue* pt = list == v ? v : &list->items[i];
        if (json_type_of(pt, name, "pre_tokenizer", &type, err)) return -1;
        if (strcmp(type, "ByteLevel") == 0) {
            int use_regex, prefix;
            if (json_flag(pt, "use_regex", 1, name, "ByteLevel", &use_regex, err) ||
                json_flag(pt, "add_prefix_space", 1, name, "ByteLevel", &prefix, err))
                return -1;
            if (have_bytelevel) return errorf(err, "%s: two ByteLevel pre-tokenizers", name);
            if (use_regex && have_split)
                return errorf(err, "%s: a ByteLevel pre-tokenizer with use_regex after a Split is "
                                   "not supported", name);
            if (prefix && have_split)
                return errorf(err, "%s: ByteLevel add_prefix_space after a Split is not supported",
                              name);
            if (use_regex) {
                t->split = TOK_SPLIT_GPT2;
                have_split = 1;
            }
            t->add_prefix_space = prefix;
            have_bytelevel = 1;
        } else if (strcmp(type, "Split") == 0) {
            const JsonValue* pat = json_get(pt, "pattern");
            const char* re;
            if (!pat || json_get_string(pat, "Regex", &re) != 1)
                return errorf(err, "%s: Split pre-tokenizer needs a {\"Regex\": ...} pattern", name);
            int invert;
            if (json_flag(pt, "invert", 0, name, "Split", &invert, err)) return -1;
            if (!json_is(json_get(pt, "behavior"), "Isolated") || invert)
                return errorf(err, "%s: Split pre-tokenizer must have behavior Isolated, not inverted",
                              name);
            if (have_split || have_bytelevel)
                return errorf(err, "%s: the Split pre-tokenizer must come first, and only once", name);
            int which = -1;
            for (int k = 0; k < 3; k++)
                if (strcmp(re, SPLIT_REGEX[k]) == 0) which = k;
            if (which < 0)
                return errorf(err, "%s: Split regex '%s' is not one of GPT-2's, LLaMA-3's or "
                                   "Qwen2's", name, printable(re, strlen(re), p, sizeof p));
            t->split = (TokSplit)which;
            have_split = 1;
        } else {
            return errorf(err, "%s: pre-tokenizer '%s' is not supported (ByteLevel, Split)", name,
                          printable(type, strlen(type), p, sizeof p));
        }
    }
    if (!have_bytelevel)
        return errorf(err, "%s: no ByteLevel pre-tokenizer (only byte-level BPE is supported)", name);
    if (!have_split)
        return errorf(err, "%s: ByteLevel pre-tokenizer without a split regex is not supported", name);
    return 0;
}

static int parse_decoder(const JsonValue* v, const char* name, char* err) {
    const char* type;
    if (!v || v->type == JSON_NULL) return errorf(err, "%s: no decoder (ByteLevel expected)", name);
    if (json_type_of(v, name, "decoder", &type, err)) return -1;
    if (strcmp(type, "ByteLevel") == 0) return 0;
    if (strcmp(type, "Sequence") == 0) {
        const JsonValue* list = json_get(v, "decoders");
        if (list && list->type == JSON_ARRAY && list->n == 1)
            return parse_decoder(&list->items[0], name, err);
    }
    char p[200];
    return errorf(err, "%s: decoder '%s' is not supported (ByteLevel)", name,
                  printable(type, strlen(type), p, sizeof p));
}

// TemplateProcessing's "single" template: the special tokens before and after $A.
static int parse_template(Tokenizer* t, const JsonValue* v, const char* name, char* err) {
    const JsonValue* single = json_get(v, "single");
    const JsonValue* specials = json_get(v, "special_tokens");
    if (!single || single->type != JSON_ARRAY)
        return errorf(err, "%s: TemplateProcessing has no \"single\" template", name);
    int seen_a = 0;
    for (size_t i = 0; i < single->n; i++) {
        const JsonValue* item = &single->items[i];
        const JsonValue* seq = json_get(item, "Sequence");
        const JsonValue* sp = json_get(item, "SpecialToken");
        if (seq) {
            seen_a = 1;
            continue;
        }
        const char* key;
        if (!sp || json_get_string(sp, "id", &key) != 1)
            return errorf(err, "%s: TemplateProcessing item %zu is neither a Sequence nor a "
                               "SpecialToken", name, i);
        const JsonValue* entry = json_get(specials, key);
        const JsonValue* ids = json_get(entry, "ids");
        if (!ids || ids->type != JSON_ARRAY) {
            char p[200];
            return errorf(err, "%s: TemplateProcessing special token '%s' has no ids", name,
                          printable(key, strlen(key), p, sizeof p));
        }
        for (size_t k = 0; k < ids->n; k++) {
            const JsonValue* idv = &ids->items[k];
            if (idv->type != JSON_NUMBER || !idv->is_integer || idv->integer < 0 ||
                idv->integer >= t->n_vocab)
                return errorf(err, "%s: TemplateProcessing id outside the vocabulary", name);
            int* n = seen_a ? &t->n_suffix : &t->n_prefix;
            int32_t* dst = seen_a ? t->suffix : t->prefix;
            if (*n == 4) return errorf(err, "%s: TemplateProcessing adds more than 4 tokens", name);
            dst[(*n)++] = (int32_t)idv->integer;
        }
    }
    return 0;
}

static int parse_post_processor(Tokenizer* t, const JsonValue* v, const char* name, char* err) {
    const char* type;
    if (!v || v->type == JSON_NULL) return 0;
    if (json_type_of(v, name, "post_processor", &type, err)) return -1;
    if (strcmp(type, "ByteLevel") == 0) return 0;  // offsets only
    if (strcmp(type, "TemplateProcessing") == 0) return parse_template(t, v, name, err);
    if (strcmp(type, "Sequence") == 0) {
        const JsonValue* list = json_get(v, "processors");
        if (!list || list->type != JSON_ARRAY)
            return errorf(err, "%s: post_processor Sequence has no \"processors\" list", name);
        for (size_t i = 0; i < list->n; i++)
            if (parse_post_processor(t, &list->items[i], name, err)) return -1;
        return 0;
    }
    char p[200];
    return errorf(err, "%s: post_processor '%s' is not supported (TemplateProcessing, ByteLevel)",
                  name, printable(type, strlen(type), p, sizeof p));
}

static int parse_model_options(Tokenizer* t, const JsonValue* model, const char* name, char* err) {
    const char* type;
    char p[200];
    int r = json_get_string(model, "type", &type);
    if (r < 0) return errorf(err, "%s: model.type must be a string", name);
    if (r == 1 && strcmp(type, "BPE") != 0)
        return errorf(err, "%s: model type '%s' is not supported (byte-level BPE only)", name,
                      printable(type, strlen(type), p, sizeof p));
    double dropout = 0.0;
    if (json_get_double(model, "dropout", &dropout) < 0 || (dropout != 0.0))
        return errorf(err, "%s: BPE dropout is not supported", name);
    const char* affix[2] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        const char* s = "";
        if (json_get_string(model, affix[k], &s) < 0 || s[0] != '\0')
            return errorf(err, "%s: model.%s is not supported (byte-level BPE has none)", name,
                          affix[k]);
    }
    int byte_fallback;
    if (json_flag(model, "byte_fallback", 0, name, "model", &byte_fallback, err) ||
        json_flag(model, "ignore_merges", 0, name, "model", &t->ignore_merges, err) ||
        json_flag(model, "fuse_unk", 0, name, "model", &t->fuse_unk, err))
        return -1;
    if (byte_fallback)
        return errorf(err, "%s: byte_fallback BPE (SentencePiece style) is not supported", name);
    return 0;
}

// Split "a b" (exactly one space, as HF requires) into its halves.
static int merge_split(const char* s, size_t n, TokMergeText* out) {
    const char* sp = memchr(s, ' ', n);
    if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s))) return -1;
    out->a = (const uint8_t*)s;
    out->an = (size_t)(sp - s);
    out->b = (const uint8_t*)sp + 1;
    out->bn = n - out->an - 1;
    return 0;
}

// A merges item of tokenizer.json: "a b" or ["a", "b"].
static int merge_text(const JsonValue* m, TokMergeText* out) {
    if (m->type == JSON_STRING) return merge_split(m->str, m->str_len, out);
    if (m->type == JSON_ARRAY && m->n == 2 && m->items[0].type == JSON_STRING &&
        m->items[1].type == JSON_STRING) {
        out->a = (const uint8_t*)m->items[0].str;
        out->an = m->items[0].str_len;
        out->b = (const uint8_t*)m->items[1].str;
        out->bn = m->items[1].str_len;
        return 0;
    }
    return -1;
}

static int load_json_root(Tokenizer* t, const JsonValue* root, const char* name, char* err) {
    if (root->type != JSON_OBJECT) return errorf(err, "%s: not a JSON object", name);
    const JsonValue* model = json_get(root, "model");
    if (!model || model->type != JSON_OBJECT) return errorf(err, "%s: no \"model\" object", name);
    if (parse_model_options(t, model, name, err)) return -1;
    const JsonValue* vocab = json_get(model, "vocab");
    const JsonValue* merges = json_get(model, "merges");
    const JsonValue* added = json_get(root, "added_tokens");
    if (!vocab || vocab->type != JSON_OBJECT) return errorf(err, "%s: model.vocab must be an object", name);
    if (!merges || merges->type != JSON_ARRAY) return errorf(err, "%s: model.merges must be a list", name);
    if (added && added->type != JSON_NULL && added->type != JSON_ARRAY)
        return errorf(err, "%s: added_tokens must be a list", name);
    size_t n_added = added && added->type == JSON_ARRAY ? added->n : 0;
    // the id range: the largest id + 1, holes allowed (bounded by the entry count: bad input
    // must not make us allocate gigabytes)
    int64_t max_id = -1;
    for (size_t i = 0; i < vocab->n; i++) {
        const JsonValue* v = &vocab->items[i];
        if (v->type != JSON_NUMBER || !v->is_integer || v->integer < 0)
            return errorf(err, "%s: model.vocab values must be non-negative integers", name);
        if (v->integer > max_id) max_id = v->integer;
    }
    for (size_t i = 0; i < n_added; i++) {
        int64_t id;
        if (json_get_int(&added->items[i], "id", &id) != 1 || id < 0)
            return errorf(err, "%s: added_tokens[%zu] has no valid id", name, i);
        if (id > max_id) max_id = id;
    }
    size_t entries = vocab->n + n_added;
    if (max_id >= TOK_MAX_VOCAB || (uint64_t)max_id >= 2 * (uint64_t)entries + 65536)
        return errorf(err, "%s: token id %lld is too large for %zu tokens", name, (long long)max_id,
                      entries);
    TokBuild b = {.name = name, .n = (int32_t)(max_id + 1)};
    b.e = calloc_check((size_t)b.n + 1, sizeof(TokEntry));
    b.m = malloc_check((merges->n + 1) * sizeof(TokMergeText));
    int rc = 0;
    for (size_t i = 0; i < vocab->n && rc == 0; i++)
        rc = build_set(&b, vocab->items[i].integer, vocab->keys[i], vocab->key_lens[i],
                       TOK_KIND_NORMAL, 0, 0, err);
    for (size_t i = 0; i < n_added && rc == 0; i++) {
        const JsonValue* a = &added->items[i];
        const JsonValue* content = json_get(a, "content");
        int64_t id = 0;
        int special, lstrip, rstrip, single_word;
        json_get_int(a, "id", &id);
        if (!content || content->type != JSON_STRING) {
            rc = errorf(err, "%s: added_tokens[%zu] has no content", name, i);
            break;
        }
        if (json_flag(a, "special", 0, name, "added_tokens[]", &special, err) ||
            json_flag(a, "lstrip", 0, name, "added_tokens[]", &lstrip, err) ||
            json_flag(a, "rstrip", 0, name, "added_tokens[]", &rstrip, err) ||
            json_flag(a, "single_word", 0, name, "added_tokens[]", &single_word, err)) {
            rc = -1;
            break;
        }
        if (single_word) {
            char p[200];
            rc = errorf(err, "%s: added token '%s' has single_word, which is not supported", name,
                        printable(content->str, content->str_len, p, sizeof p));
            break;
        }
        rc = build_set(&b, id, content->str, content->str_len,
                       special ? TOK_KIND_SPECIAL : TOK_KIND_ADDED, lstrip, rstrip, err);
    }
    for (size_t i = 0; i < merges->n && rc == 0; i++)
        if (merge_text(&merges->items[i], &b.m[b.n_merges++]) != 0)
            rc = errorf(err, "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", name, i);
    if (rc == 0) rc = build_finish(&b, t, err);
    build_free(&b);
    if (rc) return -1;
    const char* unk;
    int r = json_get_string(model, "unk_token", &unk);
    if (r < 0) return errorf(err, "%s: model.unk_token must be a string", name);
    if (r == 1 && (t->unk_id = tokenizer_find(t, unk, strlen(unk))) < 0)
        return errorf(err, "%s: model.unk_token is not a token", name);
    if (parse_normalizer(t, json_get(root, "normalizer"), name, err) ||
        parse_pre_tokenizer(t, json_get(root, "pre_tokenizer"), name, err) ||
        parse_decoder(json_get(root, "decoder"), name, err) ||
        parse_post_processor(t, json_get(root, "post_processor"), name, err))
        return -1;
    // tokenizer.json does not name bos / eos; the template's tokens are the best guess (the
    // caller applies tokenizer_config.json when there is one)
    if (t->n_prefix == 1) t->bos_id = t->prefix[0];
    if (t->n_suffix == 1) t->eos_id = t->suffix[0];
    return 0;
}

int tokenizer_load_json(Tokenizer* t, const char* text, size_t len, const char* name, char* err) {
    tokenizer_defaults(t);
    JsonDoc doc;
    char jerr[ERR_LEN];
    if (json_parse(text, len, &doc, jerr) != 0) return errorf(err, "%s: %s", name, jerr);
    int rc = load_json_root(t, &doc.root, name, err);
    json_free(&doc);
    if (rc) tokenizer_free(t);
    return rc;
}

int tokenizer_apply_config(Tokenizer* t, const char* text, size_t len, const char* name, char* err) {
    JsonDoc doc;
    char jerr[ERR_LEN];
    if (json_parse(text, len, &doc, jerr) != 0) return errorf(err, "%s: %s", name, jerr);
    static const char* const keys[4] = {"bos_token", "eos_token", "pad_token", "unk_token"};
    int32_t* dst[4] = {&t->bos_id, &t->eos_id, &t->pad_id, &t->unk_id};
    int rc = 0;
    for (int k = 0; k < 4 && rc == 0; k++) {
        const JsonValue* v = json_get(&doc.root, keys[k]);
        if (v && v->type == JSON_OBJECT) v = json_get(v, "content");
        if (!v || v->type == JSON_NULL) continue;
        if (v->type != JSON_STRING) {
            rc = errorf(err, "%s: %s must be a string", name, keys[k]);
            break;
        }
        int32_t id = tokenizer_find(t, v->str, v->str_len);
        char p[200];
        if (id >= 0) *dst[k] = id;
        else if (k < 2)  // bos / eos must exist; a stray pad or unk name is left unset
            rc = errorf(err, "%s: %s '%s' is not a token of the tokenizer", name, keys[k],
                        printable(v->str, v->str_len, p, sizeof p));
    }
    json_free(&doc);
    return rc;
}

// ----------------------------------------------------------------------------
// GGUF metadata

static int gguf_string_array(const GgufFile* f, const char* key, int required, const GgufValue** out,
                             char* err) {
    const GgufKV* kv = gguf_find_kv(f, key);
    *out = NULL;
    if (!kv) return required ? errorf(err, "%s: metadata key '%s' is missing", f->path, key) : 0;
    if (kv->value.type != GGUF_TYPE_ARRAY || kv->value.elem_type != GGUF_TYPE_STRING)
        return errorf(err, "%s: key '%s' must be an array of strings", f->path, key);
    *out = &kv->value;
    return 0;
}

static int gguf_token_id(const GgufFile* f, const char* key, int32_t n, int32_t* out, char* err) {
    int64_t v;
    int r = gguf_get_int(f, key, &v);
    if (r == 0) return 0;
    if (r < 0 || v < 0 || v >= n)
        return errorf(err, "%s: key '%s' must be a token id below %d", f->path, key, n);
    *out = (int32_t)v;
    return 0;
}

static int gguf_flag(const GgufFile* f, const char* key, int* out, char* err) {
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return 0;
    if (kv->value.type != GGUF_TYPE_BOOL) return errorf(err, "%s: key '%s' must be a BOOL", f->path, key);
    *out = kv->value.u != 0;
    return 0;
}

static int load_gguf(Tokenizer* t, const GgufFile* f, char* err) {
    char p[200];
    GgufString model, pre = {"default", 7};
    int r = gguf_get_string(f, "tokenizer.ggml.model", &model);
    if (r == 0) return errorf(err, "%s: no tokenizer (tokenizer.ggml.model is missing)", f->path);
    if (r < 0) return errorf(err, "%s: key 'tokenizer.ggml.model' must be a STRING", f->path);
    if (model.n != 4 || memcmp(model.s, "gpt2", 4) != 0)
        return errorf(err, "%s: tokenizer.ggml.model '%s' is not supported (byte-level BPE 'gpt2' "
                           "only; 'llama' is SentencePiece)", f->path, printable(model.s, model.n, p, sizeof p));
    if (gguf_get_string(f, "tokenizer.ggml.pre", &pre) < 0)
        return errorf(err, "%s: key 'tokenizer.ggml.pre' must be a STRING", f->path);
#define PRE_IS(lit) (pre.n == sizeof(lit) - 1 && memcmp(pre.s, lit, pre.n) == 0)
    if (PRE_IS("default") || PRE_IS("gpt-2") || PRE_IS("gpt2")) {
        t->split = TOK_SPLIT_GPT2;
    } else if (PRE_IS("llama-bpe") || PRE_IS("llama3") || PRE_IS("llama-v3")) {
        t->split = TOK_SPLIT_LLAMA3;
        t->ignore_merges = 1;  // as LLaMA-3's tokenizer.json and llama.cpp
    } else if (PRE_IS("qwen2")) {
        t->split = TOK_SPLIT_QWEN2;
        t->nfc = 1;  // Qwen's tokenizer.json normalises NFC; GGUF does not say so
    } else {
        return errorf(err, "%s: tokenizer.ggml.pre '%s' is not supported (default, gpt-2, "
                           "llama-bpe, qwen2)", f->path, printable(pre.s, pre.n, p, sizeof p));
    }
#undef PRE_IS
    const GgufValue *tokens, *merges;
    if (gguf_string_array(f, "tokenizer.ggml.tokens", 1, &tokens, err) ||
        gguf_string_array(f, "tokenizer.ggml.merges", 1, &merges, err))
        return -1;
    if (tokens->n == 0 || tokens->n > TOK_MAX_VOCAB)
        return errorf(err, "%s: tokenizer.ggml.tokens has %llu entries", f->path,
                      (unsigned long long)tokens->n);
    const GgufKV* types = gguf_find_kv(f, "tokenizer.ggml.token_type");
    int64_t ty;
    if (types && (types->value.type != GGUF_TYPE_ARRAY || types->value.n != tokens->n ||
                  (types->value.n && gguf_array_int(&types->value, 0, &ty) != 0)))
        return errorf(err, "%s: tokenizer.ggml.token_type must be an integer array as long as the "
                           "tokens", f->path);
    TokBuild b = {.name = f->path, .n = (int32_t)tokens->n};
    b.e = calloc_check((size_t)b.n + 1, sizeof(TokEntry));
    b.m = malloc_check((merges->n + 1) * sizeof(TokMergeText));
    int rc = 0;
    int32_t unk = -1;
    for (int32_t i = 0; i < b.n && rc == 0; i++) {
        int64_t type = GGUF_TOK_NORMAL;
        if (types) gguf_array_int(&types->value, (uint64_t)i, &type);
        int kind = type == GGUF_TOK_CONTROL ? TOK_KIND_SPECIAL
                   : type == GGUF_TOK_USER  ? TOK_KIND_ADDED
                                            : TOK_KIND_NORMAL;
        if (type == GGUF_TOK_UNKNOWN && unk < 0) unk = i;
        if (type == GGUF_TOK_UNUSED) continue;  // a hole ([PAD<id>] placeholders)
        rc = build_set(&b, i, tokens->strs[i].s, tokens->strs[i].n, kind, 0, 0, err);
    }
    for (uint64_t i = 0; i < merges->n && rc == 0; i++) {
        if (merge_split(merges->strs[i].s, merges->strs[i].n, &b.m[b.n_merges++]) != 0)
            rc = errorf(err, "%s: tokenizer.ggml.merges[%llu] is not \"a b\"", f->path,
                        (unsigned long long)i);
    }
    if (rc == 0) rc = build_finish(&b, t, err);
    build_free(&b);
    if (rc) return -1;
    t->unk_id = unk;
    int add_bos = 0, add_eos = 0;
    if (gguf_token_id(f, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos_id, err) ||
        gguf_token_id(f, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos_id, err) ||
        gguf_token_id(f, "tokenizer.ggml.padding_token_id", t->n_vocab, &t->pad_id, err) ||
        gguf_token_id(f, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk_id, err) ||
        gguf_flag(f, "tokenizer.ggml.add_bos_token", &add_bos, err) ||
        gguf_flag(f, "tokenizer.ggml.add_eos_token", &add_eos, err))
        return -1;
    if (add_bos && t->bos_id < 0)
        return errorf(err, "%s: tokenizer.ggml.add_bos_token without a bos_token_id", f->path);
    if (add_eos && t->eos_id < 0)
        return errorf(err, "%s: tokenizer.ggml.add_eos_token without an eos_token_id", f->path);
    if (add_bos) t->prefix[t->n_prefix++] = t->bos_id;
    if (add_eos) t->suffix[t->n_suffix++] = t->eos_id;
    return 0;
}

int tokenizer_load_gguf(Tokenizer* t, const GgufFile* f, char* err) {
    tokenizer_defaults(t);
    int rc = load_gguf(t, f, err);
    if (rc) tokenizer_free(t);
    return rc;
}

int tokenizer_load_gguf_records(Tokenizer* t, const GgufTokenizer* rec, const char* name,
                                char* err) {
    // a GGUF file of these records and no tensors, parsed by the GGUF reader
    size_t n = 24 + rec->len + GGUF_DEFAULT_ALIGNMENT;
    uint8_t* buf = calloc_check(n, 1);
    uint32_t magic = GGUF_MAGIC, version = GGUF_VERSION;
    uint64_t n_tensors = 0, n_kv = (uint64_t)rec->n_kv;
    memcpy(buf, &magic, 4);
    memcpy(buf + 4, &version, 4);
    memcpy(buf + 8, &n_tensors, 8);
    memcpy(buf + 16, &n_kv, 8);
    if (rec->len) memcpy(buf + 24, rec->records, rec->len);
    GgufFile f;
    int rc = gguf_open_memory(&f, buf, n, name, err);
    if (rc == 0) {
        rc = tokenizer_load_gguf(t, &f, err);
        gguf_close(&f);
    }
    free(buf);
    return rc;
}

int tokenizer_load(Tokenizer* t, const char* path, char* err) {
    char file[4096], cfg[4096];
    tokenizer_defaults(t);
    if (dir_exists(path)) {
        snprintf(file, sizeof file, "%s/tokenizer.json", path);
        if (!file_exists(file)) return errorf(err, "%s: directory has no tokenizer.json", path);
    } else {
        str_copy(file, sizeof file, path);
    }
    FILE* fp = fopen(file, "rb");
    if (!fp) return errorf(err, "%s: cannot open the tokenizer file", file);
    uint8_t magic[4] = {0};
    size_t got = fread(magic, 1, 4, fp);
    fclose(fp);
    if (got == 4 && memcmp(magic, "GGUF", 4) == 0) {
        GgufFile f;
        if (gguf_open(&f, file, err) != 0) return -1;
        int rc = tokenizer_load_gguf(t, &f, err);
        gguf_close(&f);
        return rc;
    }
    size_t len;
    char* text = file_read_all(file, (size_t)1 << 31, &len, err);
    if (!text) return -1;
    int rc = tokenizer_load_json(t, text, len, file, err);
    free(text);
    if (rc) return rc;
    // tokenizer_config.json beside it names bos / eos / pad
    str_copy(cfg, sizeof cfg, file);
    char* slash = strrchr(cfg, '/');
    size_t dir_len = slash ? (size_t)(slash + 1 - cfg) : 0;
    snprintf(cfg + dir_len, sizeof cfg - dir_len, "tokenizer_config.json");
    if (file_exists(cfg)) {
        text = file_read_all(cfg, (size_t)1 << 28, &len, err);
        if (!text || tokenizer_apply_config(t, text, len, cfg, err) != 0) {
            free(text);
            tokenizer_free(t);
            return -1;
        }
        free(text);
    }
    return 0;
}

// ----------------------------------------------------------------------------
// pre-tokenizer scanners: each returns the end of the piece that starts at i (every position
// starts a piece: the last alternatives of each regex match any character)

// class of ASCII bytes: letters, digits, \t \n \v \f \r and space, the rest "other"
static const uint8_t ASCII_CLASS[128] = {
    ['\t'] = UNICODE_SPACE, ['\n'] = UNICODE_SPACE, ['\v'] = UNICODE_SPACE, ['\f'] = UNICODE_SPACE,
    ['\r'] = UNICODE_SPACE, [' '] = UNICODE_SPACE,
    ['0'] = UNICODE_NUMBER, ['1'] = UNICODE_NUMBER, ['2'] = UNICODE_NUMBER, ['3'] = UNICODE_NUMBER,
    ['4'] = UNICODE_NUMBER, ['5'] = UNICODE_NUMBER, ['6'] = UNICODE_NUMBER, ['7'] = UNICODE_NUMBER,
    ['8'] = UNICODE_NUMBER, ['9'] = UNICODE_NUMBER,
    ['A'] = 1, ['B'] = 1, ['C'] = 1, ['D'] = 1, ['E'] = 1, ['F'] = 1, ['G'] = 1, ['H'] = 1,
    ['I'] = 1, ['J'] = 1, ['K'] = 1, ['L'] = 1, ['M'] = 1, ['N'] = 1, ['O'] = 1, ['P'] = 1,
    ['Q'] = 1, ['R'] = 1, ['S'] = 1, ['T'] = 1, ['U'] = 1, ['V'] = 1, ['W'] = 1, ['X'] = 1,
    ['Y'] = 1, ['Z'] = 1,
    ['a'] = 1, ['b'] = 1, ['c'] = 1, ['d'] = 1, ['e'] = 1, ['f'] = 1, ['g'] = 1, ['h'] = 1,
    ['i'] = 1, ['j'] = 1, ['k'] = 1, ['l'] = 1, ['m'] = 1, ['n'] = 1, ['o'] = 1, ['p'] = 1,
    ['q'] = 1, ['r'] = 1, ['s'] = 1, ['t'] = 1, ['u'] = 1, ['v'] = 1, ['w'] = 1, ['x'] = 1,
    ['y'] = 1, ['z'] = 1,
};

// The code point at s[i] (i < n), its class in *cls; returns its length.
static inline int cp_at(const uint8_t* s, size_t n, size_t i, uint32_t* cp, int* cls) {
    uint8_t b = s[i];
    if (b < 0x80) {
        *cp = b;
        *cls = ASCII_CLASS[b];
        return 1;
    }
    int l = utf8_decode(s + i, n - i, cp);
    *cls = (int)unicode_class(*cp);
    return l;
}

// The end of the run of class cls that starts at j.
static inline size_t run_end(const uint8_t* s, size_t n, size_t j, int cls) {
    while (j < n) {
        uint8_t b = s[j];
        if (b < 0x80) {
            if (ASCII_CLASS[b] != cls) break;
            j++;
            continue;
        }
        uint32_t cp;
        int l = utf8_decode(s + j, n - j, &cp);
        if ((int)unicode_class(cp) != cls) break;
        j += (size_t)l;
    }
    return j;
}

// 's|'t|'re|'ve|'m|'ll|'d after the apostrophe at p - 1: the length matched after it, or 0.
// fold: case-insensitively, as (?i:...) — Oniguruma's folding also takes U+017F (long s) for s.
static size_t contraction(const uint8_t* s, size_t n, size_t p, int fold) {
    if (p >= n) return 0;
    uint8_t a = s[p];
    if (fold) {
        if (a == 0xC5 && p + 1 < n && s[p + 1] == 0xBF) return 2;  // U+017F
        if (a >= 'A' && a <= 'Z') a = (uint8_t)(a + 32);
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 1;
    if (a != 'r' && a != 'v' && a != 'l') return 0;
    if (p + 1 >= n) return 0;
    uint8_t c = s[p + 1];
    if (fold && c >= 'A' && c <= 'Z') c = (uint8_t)(c + 32);
    return c == (a == 'l' ? 'l' : 'e') ? 2 : 0;
}

// The whitespace alternatives of the piece starting at i (a whitespace character).
// newline: LLaMA-3 / Qwen2's \s*[\r\n]+ comes first: a run holding \r or \n ends after its last.
// Then \s+(?!\S): the run, less its last character when a non-space follows; then \s+.
static size_t split_space(const uint8_t* s, size_t n, size_t i, int newline) {
    size_t j = i, last = i, nl_end = 0;
    while (j < n) {
        uint32_t cp;
        int cls;
        int l = cp_at(s, n, j, &cp, &cls);
        if (cls != UNICODE_SPACE) break;
        if (cp == '\r' || cp == '\n') nl_end = j + 1;
        last = j;
        j += (size_t)l;
    }
    if (newline && nl_end) return nl_end;
    if (j == n || last == i) return j;
    return last;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
static size_t split_gpt2(const uint8_t* s, size_t n, size_t i) {
    uint32_t c0, c1 = 0;
    int k0, k1 = -1, l1 = 0;
    int l0 = cp_at(s, n, i, &c0, &k0);
    if (c0 == '\'') {
        size_t m = contraction(s, n, i + 1, 0);
        if (m) return i + 1 + m;
    }
    if (c0 == ' ' && i + 1 < n) l1 = cp_at(s, n, i + 1, &c1, &k1);
    if (k0 != UNICODE_SPACE) return run_end(s, n, i + (size_t)l0, k0);
    if (c0 == ' ' && k1 >= 0 && k1 != UNICODE_SPACE) return run_end(s, n, i + 1 + (size_t)l1, k1);
    return split_space(s, n, i, 0);
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
// \s*[\r\n]+|\s+(?!\S)|\s+      (LLaMA-3: digits 3; Qwen2: digits 1)
static size_t split_llama3(const uint8_t* s, size_t n, size_t i, int digits) {
    uint32_t c0, c1 = 0;
    int k0, k1 = -1;
    int l0 = cp_at(s, n, i, &c0, &k0);
    if (c0 == '\'') {
        size_t m = contraction(s, n, i + 1, 1);
        if (m) return i + 1 + m;
    }
    if (k0 == UNICODE_LETTER) return run_end(s, n, i + (size_t)l0, UNICODE_LETTER);
    if (i + (size_t)l0 < n) cp_at(s, n, i + (size_t)l0, &c1, &k1);
    // [^\r\n\p{L}\p{N}]\p{L}+: any other character or blank (not a newline) before letters
    if (k0 != UNICODE_NUMBER && c0 != '\r' && c0 != '\n' && k1 == UNICODE_LETTER)
        return run_end(s, n, i + (size_t)l0, UNICODE_LETTER);
    if (k0 == UNICODE_NUMBER) {
        size_t j = i + (size_t)l0;
        for (int d = 1; d < digits && j < n; d++) {
            uint32_t c;
            int k;
            int l = cp_at(s, n, j, &c, &k);
            if (k != UNICODE_NUMBER) break;
            j += (size_t)l;
        }
        return j;
    }
    // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    size_t start = k0 == UNICODE_OTHER ? i : (c0 == ' ' && k1 == UNICODE_OTHER) ? i + 1 : SIZE_MAX;
    if (start != SIZE_MAX) {
        size_t j = run_end(s, n, start, UNICODE_OTHER);
        while (j < n && (s[j] == '\r' || s[j] == '\n')) j++;
        return j;
    }
    return split_space(s, n, i, 1);
}

static inline size_t split_next(TokSplit split, const uint8_t* s, size_t n, size_t i) {
    switch (split) {
    case TOK_SPLIT_LLAMA3: return split_llama3(s, n, i, 3);
    case TOK_SPLIT_QWEN2: return split_llama3(s, n, i, 1);
    default: return split_gpt2(s, n, i);
    }
}

// ----------------------------------------------------------------------------
// BPE of one piece, and the piece cache

typedef struct TokSymbol {
    int32_t id;
    int32_t prev, next;  // linked list over the live symbols (-1: none)
    int32_t len;         // bytes covered; 0 once merged into its left neighbour
} TokSymbol;

typedef struct TokHeapItem {
    int32_t rank, pos, id;  // merge rank, left symbol, result
} TokHeapItem;

// A cached piece. Short pieces and one-token results sit in the slot itself, so that the usual
// hit (an English word that is one token) reads one cache line.
typedef struct TokCacheSlot {
    uint64_t key;      // pieces of up to 8 bytes: the bytes (zero-padded); longer: offset in keys
    uint32_t tag;      // hash bits, never 0 (0: an empty slot)
    uint16_t key_len, n_ids;
    int32_t id;        // one id: the id; more: their offset in cids
} TokCacheSlot;

static inline int heap_less(const TokHeapItem* a, const TokHeapItem* b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(TokHeapItem* h, size_t* n, TokHeapItem x) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static TokHeapItem heap_pop(TokHeapItem* h, size_t* n) {
    TokHeapItem top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
    return top;
}

static inline void push_pair(const Tokenizer* t, const TokSymbol* sym, TokHeapItem* h, size_t* hn,
                             int32_t pos) {
    int32_t rank, id = merge_find(t, sym[pos].id, sym[sym[pos].next].id, &rank);
    if (id >= 0) heap_push(h, hn, (TokHeapItem){rank, pos, id});
}

// Merge the bytes w[0..n) (lowest rank first, leftmost on ties: HF's BPE::merge_word) and
// append the ids.
static void bpe_piece(TokEncoder* e, const uint8_t* w, size_t n, TokIds* out) {
    const Tokenizer* t = e->tok;
    if (n > e->sym_cap) {
        e->sym_cap = n;
        e->sym = realloc_check(e->sym, n * sizeof(TokSymbol));
        e->heap = realloc_check(e->heap, 3 * n * sizeof(TokHeapItem));
    }
    TokSymbol* sym = e->sym;
    TokHeapItem* heap = e->heap;
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) {
            if (t->unk_id < 0) continue;  // HF drops a character the vocabulary lacks
            if (t->fuse_unk && m > 0 && sym[m - 1].id == t->unk_id) {
                sym[m - 1].len++;
                continue;
            }
            id = t->unk_id;
        }
        sym[m] = (TokSymbol){id, m - 1, m + 1, 1};
        m++;
    }
    if (m == 0) return;
    sym[m - 1].next = -1;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < m; i++) push_pair(t, sym, heap, &hn, i);
    while (hn > 0) {
        TokHeapItem top = heap_pop(heap, &hn);
        TokSymbol* a = &sym[top.pos];
        if (a->len == 0 || a->next < 0) continue;
        TokSymbol* b = &sym[a->next];
        int32_t rank, id = merge_find(t, a->id, b->id, &rank);
        if (id != top.id) continue;  // stale: a neighbour changed since this pair was queued
        a->id = id;
        a->len += b->len;
        b->len = 0;
        a->next = b->next;
        if (a->next >= 0) sym[a->next].prev = top.pos;
        if (a->prev >= 0) push_pair(t, sym, heap, &hn, a->prev);
        if (a->next >= 0) push_pair(t, sym, heap, &hn, top.pos);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) tokenizer_ids_push(out, sym[i].id);
}

static void cache_clear(TokEncoder* e) {
    memset(e->slots, 0, (e->slot_mask + 1) * sizeof(TokCacheSlot));
    e->n_used = e->keys_n = e->cids_n = 0;
}

static void encode_piece(TokEncoder* e, const uint8_t* w, size_t n, TokIds* out) {
    const Tokenizer* t = e->tok;
    if (n == 1 && t->byte_id[w[0]] >= 0) {
        tokenizer_ids_push(out, t->byte_id[w[0]]);
        return;
    }
    if (n > TOK_CACHE_MAX_PIECE) {
        int32_t id = t->ignore_merges ? vocab_find(t, w, n) : -1;
        if (id >= 0) tokenizer_ids_push(out, id);
        else bpe_piece(e, w, n, out);
        return;
    }
    uint64_t h = hash_bytes(w, n);
    uint32_t tag = (uint32_t)(h >> 32) | 1;
    uint64_t key = 0;
    if (n <= 8) memcpy(&key, w, n);
    uint64_t i = h & e->slot_mask;
    for (;; i = (i + 1) & e->slot_mask) {
        const TokCacheSlot* s = &e->slots[i];
        if (s->tag == 0) break;
        if (s->tag != tag || s->key_len != n) continue;
        if (n <= 8 ? s->key != key : memcmp(e->keys + s->key, w, n) != 0) continue;
        if (s->n_ids == 1) tokenizer_ids_push(out, s->id);
        else
            for (uint32_t k = 0; k < s->n_ids; k++) tokenizer_ids_push(out, e->cids[s->id + k]);
        e->hits++;
        return;
    }
    e->misses++;
    size_t start = out->n;
    int32_t id = t->ignore_merges ? vocab_find(t, w, n) : -1;  // LLaMA-3: a whole token as is
    if (id >= 0) tokenizer_ids_push(out, id);
    else bpe_piece(e, w, n, out);
    size_t k = out->n - start;
    // keep it: clear everything first when the cache is full (simple, and pieces repeat enough
    // that it refills at once)
    if (e->n_used * 4 >= (e->slot_mask + 1) * 3 || e->keys_n + n > TOK_CACHE_MAX_KEYS ||
        e->cids_n + k > TOK_CACHE_MAX_IDS) {
        cache_clear(e);
        for (i = h & e->slot_mask; e->slots[i].tag; i = (i + 1) & e->slot_mask) {}
    }
    TokCacheSlot* s = &e->slots[i];
    s->tag = tag;
    s->key_len = (uint16_t)n;
    s->n_ids = (uint16_t)k;
    if (n <= 8) {
        s->key = key;
    } else {
        s->key = e->keys_n;
        memcpy(e->keys + e->keys_n, w, n);
        e->keys_n += n;
    }
    if (k == 1) {
        s->id = out->ids[start];
    } else {
        s->id = (int32_t)e->cids_n;
        if (k) memcpy(e->cids + e->cids_n, out->ids + start, k * sizeof(int32_t));
        e->cids_n += k;
    }
    e->n_used++;
}

void tokenizer_encoder_init(TokEncoder* e, const Tokenizer* t) {
    memset(e, 0, sizeof *e);
    e->tok = t;
    e->slot_mask = TOK_CACHE_SLOTS - 1;
    e->slots = calloc_check(TOK_CACHE_SLOTS, sizeof(TokCacheSlot));
    e->keys = malloc_check(TOK_CACHE_MAX_KEYS);
    e->cids = malloc_check(TOK_CACHE_MAX_IDS * sizeof(int32_t));
}

void tokenizer_encoder_free(TokEncoder* e) {
    free(e->slots);
    free(e->keys);
    free(e->cids);
    free(e->norm);
    free(e->sym);
    free(e->heap);
    memset(e, 0, sizeof *e);
}

// ----------------------------------------------------------------------------
// encoding

// One stretch of text between added tokens: normalise, split, merge.
static void encode_stretch(TokEncoder* e, const uint8_t* s, size_t n, TokIds* out) {
    const Tokenizer* t = e->tok;
    if (n == 0) return;
    const int nfc = t->nfc && !unicode_nfc_quick(s, n);  // most text is NFC already
    if (nfc || t->add_prefix_space) {
        e->norm_n = 0;
        if (nfc) unicode_nfc(s, n, &e->norm, &e->norm_n, &e->norm_cap);
        else bytes_append(&e->norm, &e->norm_n, &e->norm_cap, s, n);
        if (t->add_prefix_space && e->norm[0] != ' ') {
            bytes_reserve(&e->norm, &e->norm_n, &e->norm_cap, 1);
            memmove(e->norm + 1, e->norm, e->norm_n);
            e->norm[0] = ' ';
            e->norm_n++;
        }
        s = e->norm;
        n = e->norm_n;
    }
    for (size_t i = 0; i < n;) {
        size_t j = split_next(t->split, s, n, i);
        encode_piece(e, s + i, j - i, out);
        i = j;
    }
}

// Is the code point ending at s[end) (after start) whitespace? Its start in *at.
static int space_before(const uint8_t* s, size_t start, size_t end, size_t* at) {
    size_t k = end - 1;
    while (k > start && end - k < 4 && (s[k] & 0xC0) == 0x80) k--;
    uint32_t cp;
    if ((size_t)utf8_decode(s + k, end - k, &cp) != end - k) {  // not one whole code point
        k = end - 1;
        utf8_decode(s + k, 1, &cp);
    }
    *at = k;
    return unicode_class(cp) == UNICODE_SPACE;
}

void tokenizer_encode(TokEncoder* e, const void* text, size_t len, int flags, TokIds* out) {
    const Tokenizer* t = e->tok;
    const uint8_t* s = text;
    if (flags & TOK_ENCODE_ADD_SPECIAL)
        for (int i = 0; i < t->n_prefix; i++) tokenizer_ids_push(out, t->prefix[i]);
    size_t start = 0;  // the stretch not yet encoded
    for (size_t p = 0; p < len && t->n_added > 0;) {
        int32_t lo = t->added_first[s[p]], hi = t->added_first[s[p] + 1];
        const TokAdded* hit = NULL;
        for (int32_t k = lo; k < hi; k++) {  // longest first
            const TokAdded* a = &t->added[k];
            if (a->len > len - p || memcmp(t->added_text + a->off, s + p, a->len) != 0) continue;
            if (a->special && (flags & TOK_ENCODE_NO_SPECIAL)) continue;
            hit = a;
            break;
        }
        if (!hit) {
            p++;
            continue;
        }
        size_t a = p, z = p + hit->len, at;
        if (hit->lstrip)
            while (a > start && space_before(s, start, a, &at)) a = at;
        if (hit->rstrip)
            while (z < len) {
                uint32_t cp;
                int cls, l = cp_at(s, len, z, &cp, &cls);
                if (cls != UNICODE_SPACE) break;
                z += (size_t)l;
            }
        encode_stretch(e, s + start, a - start, out);
        tokenizer_ids_push(out, hit->id);
        start = p = z;
    }
    encode_stretch(e, s + start, len - start, out);
    if (flags & TOK_ENCODE_ADD_SPECIAL)
        for (int i = 0; i < t->n_suffix; i++) tokenizer_ids_push(out, t->suffix[i]);
}

void tokenizer_encode_once(const Tokenizer* t, const void* text, size_t len, int flags, TokIds* out) {
    TokEncoder e;
    tokenizer_encoder_init(&e, t);
    tokenizer_encode(&e, text, len, flags, out);
    tokenizer_encoder_free(&e);
}

// ----------------------------------------------------------------------------
// decoding

int tokenizer_decode(const Tokenizer* t, const int32_t* ids, size_t n, int flags, uint8_t** out,
                     size_t* len, size_t* cap, char* err) {
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab)
            return errorf(err, "token id %d at position %zu is outside the vocabulary [0, %d)", id, i,
                          t->n_vocab);
        if ((flags & TOK_DECODE_SKIP_SPECIAL) && t->kind[id] == TOK_KIND_SPECIAL) continue;
        bytes_append(out, len, cap, t->pieces + t->piece_off[id],
                     (size_t)(t->piece_off[id + 1] - t->piece_off[id]));
    }
    bytes_reserve(out, len, cap, 1);
    (*out)[*len] = '\0';
    return 0;
}

// ----------------------------------------------------------------------------
// writing: the text of each token as the files spell it

// Append id's text: byte-level spelling for byte-level tokens, else the raw text.
static void token_text(const Tokenizer* t, int32_t id, uint8_t** out, size_t* len, size_t* cap) {
    const uint8_t* p = t->pieces + t->piece_off[id];
    size_t n = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    if (t->bytelevel[id]) bytelevel_encode(p, n, out, len, cap);
    else bytes_append(out, len, cap, p, n);
}

typedef struct Rec {
    uint8_t* p;
    size_t n, cap;
} Rec;

static void rec_u32(Rec* r, uint32_t v) { bytes_append(&r->p, &r->n, &r->cap, &v, 4); }
static void rec_u64(Rec* r, uint64_t v) { bytes_append(&r->p, &r->n, &r->cap, &v, 8); }
static void rec_str(Rec* r, const void* s, size_t n) {
    rec_u64(r, n);
    bytes_append(&r->p, &r->n, &r->cap, s, n);
}
static void rec_key(Rec* r, const char* key, uint32_t type) {
    rec_str(r, key, strlen(key));
    rec_u32(r, type);
}

void tokenizer_gguf_records(const Tokenizer* t, GgufTokenizer* out) {
    Rec r = {0};
    int64_t n_kv = 0;
    rec_key(&r, "tokenizer.ggml.model", GGUF_TYPE_STRING);
    rec_str(&r, "gpt2", 4);
    rec_key(&r, "tokenizer.ggml.pre", GGUF_TYPE_STRING);
    rec_str(&r, SPLIT_GGUF_PRE[t->split], strlen(SPLIT_GGUF_PRE[t->split]));
    n_kv += 2;
    // tokens (a hole becomes [PAD<id>], as llama.cpp's converter writes it)
    rec_key(&r, "tokenizer.ggml.tokens", GGUF_TYPE_ARRAY);
    rec_u32(&r, GGUF_TYPE_STRING);
    rec_u64(&r, (uint64_t)t->n_vocab);
    uint8_t* text = NULL;
    size_t text_n = 0, text_cap = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        text_n = 0;
        if (t->kind[i] == TOK_KIND_NONE) {
            char pad[32];
            int k = snprintf(pad, sizeof pad, "[PAD%d]", i);
            bytes_append(&text, &text_n, &text_cap, pad, (size_t)k);
        } else {
            token_text(t, i, &text, &text_n, &text_cap);
        }
        rec_str(&r, text, text_n);
    }
    rec_key(&r, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY);
    rec_u32(&r, GGUF_TYPE_INT32);
    rec_u64(&r, (uint64_t)t->n_vocab);
    for (int32_t i = 0; i < t->n_vocab; i++) {
        uint32_t type = t->kind[i] == TOK_KIND_SPECIAL ? GGUF_TOK_CONTROL
                        : t->kind[i] == TOK_KIND_ADDED ? GGUF_TOK_USER
                        : t->kind[i] == TOK_KIND_NONE  ? GGUF_TOK_UNUSED
                        : i == t->unk_id               ? GGUF_TOK_UNKNOWN
                                                       : GGUF_TOK_NORMAL;
        rec_u32(&r, type);
    }
    rec_key(&r, "tokenizer.ggml.merges", GGUF_TYPE_ARRAY);
    rec_u32(&r, GGUF_TYPE_STRING);
    rec_u64(&r, (uint64_t)t->n_merges);
    for (int32_t i = 0; i < t->n_merges; i++) {
        text_n = 0;
        token_text(t, t->merges[i][0], &text, &text_n, &text_cap);
        bytes_append(&text, &text_n, &text_cap, " ", 1);
        token_text(t, t->merges[i][1], &text, &text_n, &text_cap);
        rec_str(&r, text, text_n);
    }
    n_kv += 3;
    static const char* const id_keys[4] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                           "tokenizer.ggml.padding_token_id",
                                           "tokenizer.ggml.unknown_token_id"};
    const int32_t ids[4] = {t->bos_id, t->eos_id, t->pad_id, t->unk_id};
    for (int k = 0; k < 4; k++) {
        if (ids[k] < 0) continue;
        rec_key(&r, id_keys[k], GGUF_TYPE_UINT32);
        rec_u32(&r, (uint32_t)ids[k]);
        n_kv++;
    }
    // add_bos / add_eos: what GGUF can say of the template (one bos before, one eos after)
    int add_bos = t->n_prefix == 1 && t->prefix[0] == t->bos_id;
    int add_eos = t->n_suffix == 1 && t->suffix[0] == t->eos_id;
    rec_key(&r, "tokenizer.ggml.add_bos_token", GGUF_TYPE_BOOL);
    bytes_append(&r.p, &r.n, &r.cap, &(uint8_t){(uint8_t)add_bos}, 1);
    rec_key(&r, "tokenizer.ggml.add_eos_token", GGUF_TYPE_BOOL);
    bytes_append(&r.p, &r.n, &r.cap, &(uint8_t){(uint8_t)add_eos}, 1);
    n_kv += 2;
    free(text);
    out->records = r.p;
    out->len = r.n;
    out->n_kv = n_kv;
}

// Write s[0..n) as a JSON string literal (s is UTF-8 or raw bytes; raw bytes cannot occur in a
// tokenizer.json, so they are written as the replacement character's escape).
static void json_put_string(FILE* f, const uint8_t* s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = utf8_decode(s + i, n - i, &cp);
        if (cp >= UNICODE_RAW_BYTE) fputs("\\ufffd", f);
        else if (cp == '"' || cp == '\\') fprintf(f, "\\%c", (int)cp);
        else if (cp < 0x20) fprintf(f, "\\u%04x", cp);
        else fwrite(s + i, 1, (size_t)l, f);
        i += (size_t)l;
    }
    fputc('"', f);
}

int tokenizer_write_json(const Tokenizer* t, const char* path, char* err) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f) return errorf(err, "%s: cannot create", tmp);
    uint8_t* text = NULL;
    size_t text_n = 0, text_cap = 0;
    fprintf(f, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
               "  \"added_tokens\": [");
    int first = 1;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (t->kind[i] < TOK_KIND_ADDED) continue;
        int lstrip = 0, rstrip = 0;
        for (int k = 0; k < t->n_added; k++)
            if (t->added[k].id == i) {
                lstrip = t->added[k].lstrip;
                rstrip = t->added[k].rstrip;
            }
        text_n = 0;
        token_text(t, i, &text, &text_n, &text_cap);
        fprintf(f, "%s\n    {\"id\": %d, \"content\": ", first ? "" : ",", i);
        json_put_string(f, text, text_n);
        fprintf(f, ", \"single_word\": false, \"lstrip\": %s, \"rstrip\": %s, \"normalized\": false, "
                   "\"special\": %s}", lstrip ? "true" : "false", rstrip ? "true" : "false",
                t->kind[i] == TOK_KIND_SPECIAL ? "true" : "false");
        first = 0;
    }
    fprintf(f, "\n  ],\n  \"normalizer\": %s,\n", t->nfc ? "{\"type\": \"NFC\"}" : "null");
    if (t->split == TOK_SPLIT_GPT2) {
        fprintf(f, "  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": %s, "
                   "\"trim_offsets\": true, \"use_regex\": true},\n",
                t->add_prefix_space ? "true" : "false");
    } else {
        fprintf(f, "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": "
                   "\"Split\", \"pattern\": {\"Regex\": ");
        json_put_string(f, (const uint8_t*)SPLIT_REGEX[t->split], strlen(SPLIT_REGEX[t->split]));
        fprintf(f, "}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", "
                   "\"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false}]},\n");
    }
    // the template: prefix ids, $A, suffix ids
    if (t->n_prefix + t->n_suffix > 0) {
        fprintf(f, "  \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [");
        const char* sep = "";
        for (int i = 0; i < t->n_prefix + t->n_suffix + 1; i++) {
            if (i == t->n_prefix) {
                fprintf(f, "%s{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}", sep);
            } else {
                int32_t id = i < t->n_prefix ? t->prefix[i] : t->suffix[i - t->n_prefix - 1];
                text_n = 0;
                token_text(t, id, &text, &text_n, &text_cap);
                fprintf(f, "%s{\"SpecialToken\": {\"id\": ", sep);
                json_put_string(f, text, text_n);
                fprintf(f, ", \"type_id\": 0}}");
            }
            sep = ", ";
        }
        fprintf(f, "], \"pair\": [{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}, {\"Sequence\": "
                   "{\"id\": \"B\", \"type_id\": 1}}], \"special_tokens\": {");
        sep = "";
        for (int i = 0; i < t->n_prefix + t->n_suffix; i++) {
            int32_t id = i < t->n_prefix ? t->prefix[i] : t->suffix[i - t->n_prefix];
            int dup = 0;
            for (int k = 0; k < i; k++)
                dup |= (k < t->n_prefix ? t->prefix[k] : t->suffix[k - t->n_prefix]) == id;
            if (dup) continue;
            text_n = 0;
            token_text(t, id, &text, &text_n, &text_cap);
            fprintf(f, "%s", sep);
            json_put_string(f, text, text_n);
            fprintf(f, ": {\"id\": ");
            json_put_string(f, text, text_n);
            fprintf(f, ", \"ids\": [%d], \"tokens\": [", id);
            json_put_string(f, text, text_n);
            fprintf(f, "]}");
            sep = ", ";
        }
        fprintf(f, "}},\n");
    } else {
        fprintf(f, "  \"post_processor\": null,\n");
    }
    fprintf(f, "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": "
               "true, \"use_regex\": true},\n");
    fprintf(f, "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": ");
    if (t->unk_id >= 0) {
        text_n = 0;
        token_text(t, t->unk_id, &text, &text_n, &text_cap);
        json_put_string(f, text, text_n);
    } else {
        fprintf(f, "null");
    }
    fprintf(f, ", \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, "
               "\"fuse_unk\": %s, \"byte_fallback\": false, \"ignore_merges\": %s,\n    \"vocab\": {",
            t->fuse_unk ? "true" : "false", t->ignore_merges ? "true" : "false");
    first = 1;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (t->kind[i] != TOK_KIND_NORMAL) continue;
        text_n = 0;
        token_text(t, i, &text, &text_n, &text_cap);
        fprintf(f, "%s\n      ", first ? "" : ",");
        json_put_string(f, text, text_n);
        fprintf(f, ": %d", i);
        first = 0;
    }
    fprintf(f, "\n    },\n    \"merges\": [");
    for (int32_t i = 0; i < t->n_merges; i++) {
        fprintf(f, "%s\n      [", i ? "," : "");
        for (int k = 0; k < 2; k++) {
            text_n = 0;
            token_text(t, t->merges[i][k], &text, &text_n, &text_cap);
            if (k) fprintf(f, ", ");
            json_put_string(f, text, text_n);
        }
        fprintf(f, "]");
    }
    fprintf(f, "\n    ]\n  }\n}\n");
    free(text);
    if (fflush(f) != 0 || ferror(f)) {
        fclose(f);
        remove(tmp);
        return errorf(err, "%s: write failed", tmp);
    }
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        remove(tmp);
        return errorf(err, "%s: cannot write", path);
    }
    return 0;
}

int tokenizer_write_hf(const Tokenizer* t, const char* dir, char* err) {
    char path[4096];
    if (mkdir_p(dir, err) != 0) return -1;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (tokenizer_write_json(t, path, err) != 0) return -1;
    // tokenizer_config.json: the special tokens by text, as transformers writes them
    uint8_t* cfg = NULL;
    size_t n = 0, cap = 0;
    uint8_t* text = NULL;
    size_t text_n = 0, text_cap = 0;
    static const char* const keys[4] = {"bos_token", "eos_token", "pad_token", "unk_token"};
    const int32_t ids[4] = {t->bos_id, t->eos_id, t->pad_id, t->unk_id};
    const char* head0 = "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\"";
    bytes_append(&cfg, &n, &cap, head0, strlen(head0));
    for (int k = 0; k < 4; k++) {
        char head[64];
        int hn = snprintf(head, sizeof head, ",\n  \"%s\": ", keys[k]);
        bytes_append(&cfg, &n, &cap, head, (size_t)hn);
        if (ids[k] < 0) {
            bytes_append(&cfg, &n, &cap, "null", 4);
            continue;
        }
        text_n = 0;
        token_text(t, ids[k], &text, &text_n, &text_cap);
        bytes_reserve(&text, &text_n, &text_cap, 1);
        text[text_n] = '\0';
        size_t need = 6 * text_n + 3;
        bytes_reserve(&cfg, &n, &cap, need);
        n += json_escape((char*)cfg + n, need, (const char*)text);
    }
    bytes_append(&cfg, &n, &cap, "\n}\n", 3);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    int rc = file_write_atomic(path, cfg, n, err);
    free(cfg);
    free(text);
    return rc;
}
