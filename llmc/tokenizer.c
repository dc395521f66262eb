/*
 * tokenizer.c — byte-level BPE at work: the three pre-tokenizer scanners (GPT-2, LLaMA-3, Qwen2
 * splits), BPE merging of each piece with a per-encoder piece cache, encoding (added tokens as
 * atoms, normalisation, split, merge) and decoding. Loading lives in tokenizer_load.c, the
 * writers of the exports in tokenizer_export.c; this file only reads a built Tokenizer.
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
#include "tokenizer_internal.h"
#include "unicode.h"

#define TOK_CACHE_SLOTS (1 << 16)   // piece cache: slots (a power of two)
#define TOK_CACHE_MAX_PIECE 64      // longer pieces are merged every time
#define TOK_CACHE_MAX_KEYS (4u << 20)  // key bytes kept before the cache is cleared
#define TOK_CACHE_MAX_IDS (1u << 20)

// ----------------------------------------------------------------------------
// id buffers and lookups

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

// The merge of (a, b): its result id (rank in *rank), or -1.
static inline int32_t merge_find(const Tokenizer* t, int32_t a, int32_t b, int32_t* rank) {
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint64_t i = tok_hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
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
    return tok_vocab_find(t, (const uint8_t*)s, n);
}

int32_t tokenizer_document_token(const Tokenizer* t) {
    if (t->bos_id >= 0) return t->bos_id;
    if (t->eos_id >= 0) return t->eos_id;
    return tokenizer_find(t, "<|endoftext|>", 13);
}

const uint8_t* tokenizer_piece(const Tokenizer* t, int32_t id, size_t* len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    *len = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    return t->pieces + t->piece_off[id];
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
        int32_t id = t->ignore_merges ? tok_vocab_find(t, w, n) : -1;
        if (id >= 0) tokenizer_ids_push(out, id);
        else bpe_piece(e, w, n, out);
        return;
    }
    uint64_t h = tok_hash_bytes(w, n);
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
    int32_t id = t->ignore_merges ? tok_vocab_find(t, w, n) : -1;  // LLaMA-3: a whole token as is
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
        else tok_bytes_append(&e->norm, &e->norm_n, &e->norm_cap, s, n);
        if (t->add_prefix_space && e->norm[0] != ' ') {
            tok_bytes_reserve(&e->norm, &e->norm_n, &e->norm_cap, 1);
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
        tok_bytes_append(out, len, cap, t->pieces + t->piece_off[id],
                     (size_t)(t->piece_off[id + 1] - t->piece_off[id]));
    }
    tok_bytes_reserve(out, len, cap, 1);
    (*out)[*len] = '\0';
    return 0;
}
