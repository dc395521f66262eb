/*
 * tokenizer_load.c — a Tokenizer from an HF tokenizer.json (with tokenizer_config.json beside
 * it) or from GGUF tokenizer.ggml.* metadata, and its release.
 *
 * Both readers describe every id and every merge as the file spells it (TokBuild); build_finish
 * then checks them and makes the tables the encoder reads (tokenizer_internal.h): the bytes of
 * each id, model tokens by their bytes, merges by their pair of ids, added tokens sorted for
 * leftmost-longest matching. Everything the encoder cannot reproduce exactly (other models,
 * normalisers, pre-tokenizers, BPE options) is refused with a one-line error naming the file,
 * and ids are bounded so that bad input cannot make us allocate without limit.
 */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "json.h"
#include "tokenizer_internal.h"
#include "unicode.h"

#define TOK_MAX_VOCAB (1 << 24)     // ids above this are refused (bounds memory on bad input)

const char* const tok_split_regex[3] = {
    [TOK_SPLIT_GPT2] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
    [TOK_SPLIT_LLAMA3] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                         "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    [TOK_SPLIT_QWEN2] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                        "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};

// ----------------------------------------------------------------------------
// small helpers

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

// The bytes a byte-level string s[0..n) stands for, into out (n bytes of room): their count, or
// -1 when a character is outside the alphabet (the string is then raw text).
static long bytelevel_decode(const uint8_t* s, size_t n, uint8_t* out) {
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        i += (size_t)utf8_decode(s + i, n - i, &c);
        int b = tok_bytelevel_byte(c);
        if (b < 0) return -1;
        out[k++] = (uint8_t)b;
    }
    return (long)k;
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
    uint64_t h = tok_hash_bytes(s, n);
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
    for (uint64_t i = tok_hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
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
    return tok_vocab_find(t, *scratch, (size_t)k);
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
        t->byte_id[c] = tok_vocab_find(t, &byte, 1);
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
        tok_bytes_append(&both, &both_n, &both_cap, t->pieces + t->piece_off[l],
                     (size_t)(t->piece_off[l + 1] - t->piece_off[l]));
        tok_bytes_append(&both, &both_n, &both_cap, t->pieces + t->piece_off[rr],
                     (size_t)(t->piece_off[rr + 1] - t->piece_off[rr]));
        int32_t id = tok_vocab_find(t, both, both_n);
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
                if (strcmp(re, tok_split_regex[k]) == 0) which = k;
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
