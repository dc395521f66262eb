/*
 * test_tokenizer.c — the tokenizer suite: Unicode tables and NFC, id-exact encoding against HF
 * tokenizers (dev/tokenizer/fixtures: Qwen3-, LLaMA-3- and GPT-2-style tokenizers and ids made by
 * dev/tokenizer/make_fixtures.py), exact byte round trips (invalid UTF-8 included), GGUF
 * metadata (a record set built here, and the exports' records read back), the tokenizer.json
 * writer, error messages, the piece cache, the shard tool, and a fuzz smoke run of the
 * tokenizer fuzz target's entry point over its seeds and mutations. The tests through
 * ./train_roundpipe (--tokenize; the prompt, sample and exports of a model with a tokenizer) are
 * in test_tokenizer_cli.c.
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "../../dev/fuzz/fuzz_tokenizer.h"
#include "../common.h"
#include "../dataloader.h"
#include "../gguf.h"
#include "../json.h"
#include "../tokenize_shards.h"
#include "../tokenizer.h"
#include "../unicode.h"
#include "testing.h"

static const char* const STYLES[3] = {"qwen3", "llama3", "gpt2"};

// ----------------------------------------------------------------------------
// helpers

static int load_style(TestCtx* t, const char* style, Tokenizer* tok) {
    char path[2048], err[ERR_LEN];
    snprintf(path, sizeof path, "%s/dev/tokenizer/fixtures/%s.json", t->exe_dir, style);
    int rc = tokenizer_load(tok, path, err);
    CHECK(t, rc == 0, "load %s: %s", style, err);
    return rc;
}

static uint8_t* hex_decode(const char* hex, size_t n, size_t* out_n) {
    uint8_t* out = malloc_check(n / 2 + 1);
    for (size_t i = 0; i + 1 < n; i += 2) {
        unsigned v;
        sscanf(hex + i, "%2x", &v);
        out[i / 2] = (uint8_t)v;
    }
    *out_n = n / 2;
    return out;
}

typedef struct Cases {
    JsonDoc doc;
    const JsonValue* list;
    char* text;
} Cases;

static int cases_open(TestCtx* t, Cases* c) {
    char path[2048], err[ERR_LEN];
    snprintf(path, sizeof path, "%s/dev/tokenizer/fixtures/cases.json", t->exe_dir);
    size_t len;
    c->text = file_read_all(path, 64u << 20, &len, err);
    CHECK(t, c->text != NULL, "%s", err);
    if (!c->text) return -1;
    int rc = json_parse(c->text, len, &c->doc, err);
    CHECK(t, rc == 0, "%s: %s", path, err);
    if (rc) {
        free(c->text);
        return -1;
    }
    c->list = json_get(&c->doc.root, "cases");
    CHECK(t, c->list && c->list->type == JSON_ARRAY && c->list->n > 200, "cases list");
    return c->list && c->list->type == JSON_ARRAY ? 0 : -1;
}

static void cases_close(Cases* c) {
    json_free(&c->doc);
    free(c->text);
}

static int ids_equal(const JsonValue* want, const TokIds* got) {
    if (!want || want->type != JSON_ARRAY || want->n != got->n) return 0;
    for (size_t i = 0; i < got->n; i++)
        if (want->items[i].integer != got->ids[i]) return 0;
    return 1;
}

static void print_ids(const char* what, const TokIds* v) {
    fprintf(stderr, "    %s:", what);
    for (size_t i = 0; i < v->n && i < 40; i++) fprintf(stderr, " %d", v->ids[i]);
    fprintf(stderr, "\n");
}

// What Rust's String::from_utf8_lossy (HF's decode) makes of bytes: each maximal ill-formed
// subsequence becomes U+FFFD.
static void utf8_lossy(const uint8_t* s, size_t n, uint8_t** out, size_t* len) {
    *out = malloc_check(3 * n + 1);
    *len = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = utf8_decode(s + i, n - i, &cp);
        if (cp < UNICODE_RAW_BYTE) {
            memcpy(*out + *len, s + i, (size_t)l);
            *len += (size_t)l;
            i += (size_t)l;
            continue;
        }
        uint8_t b = s[i];
        int need = b >= 0xC2 && b <= 0xDF ? 1 : b >= 0xE0 && b <= 0xEF ? 2 : b >= 0xF0 && b <= 0xF4 ? 3 : 0;
        size_t k = 1;
        for (int j = 0; j < need && i + k < n; j++, k++) {
            uint8_t c = s[i + k], lo = 0x80, hi = 0xBF;
            if (j == 0 && b == 0xE0) lo = 0xA0;
            if (j == 0 && b == 0xED) hi = 0x9F;
            if (j == 0 && b == 0xF0) lo = 0x90;
            if (j == 0 && b == 0xF4) hi = 0x8F;
            if (c < lo || c > hi) break;
        }
        memcpy(*out + *len, "\xef\xbf\xbd", 3);
        *len += 3;
        i += k;
    }
}

// Encode every fixture case with tok and compare with the column `style`; returns mismatches.
static int check_cases(TestCtx* t, const Tokenizer* tok, const char* style, const char* what) {
    Cases c;
    if (cases_open(t, &c)) return 1;
    TokEncoder e;
    tokenizer_encoder_init(&e, tok);
    char dec_key[64];
    snprintf(dec_key, sizeof dec_key, "%s_decoded", style);
    int bad = 0, n = 0;
    for (size_t i = 0; i < c.list->n; i++) {
        const JsonValue* cs = &c.list->items[i];
        const JsonValue* hex = json_get(cs, "hex");
        int64_t add = 0, nospecial = 0, invalid = 0;
        json_get_int(cs, "add_special", &add);
        json_get_int(cs, "no_special", &nospecial);
        json_get_int(cs, "invalid", &invalid);
        size_t len;
        uint8_t* text = hex_decode(hex->str, hex->str_len, &len);
        TokIds ids = {0};
        int flags = (add ? TOK_ENCODE_ADD_SPECIAL : 0) | (nospecial ? TOK_ENCODE_NO_SPECIAL : 0);
        tokenizer_encode(&e, text, len, flags, &ids);
        n++;
        if (!ids_equal(json_get(cs, style), &ids)) {
            if (bad++ < 5) {
                fprintf(stderr, "  %s %s: case %zu (%s) differs\n", what, style, i, hex->str);
                print_ids("got", &ids);
            }
        }
        // decoding: what HF's decode gives, and for ordinary text the input bytes again
        uint8_t* out = NULL;
        size_t out_n = 0, out_cap = 0;
        char err[ERR_LEN];
        int rc = tokenizer_decode(tok, ids.ids, ids.n, 0, &out, &out_n, &out_cap, err);
        const JsonValue* want = json_get(cs, dec_key);
        if (want) {
            size_t wn, ln;
            uint8_t *w = hex_decode(want->str, want->str_len, &wn), *lossy;
            utf8_lossy(out, out_n, &lossy, &ln);
            if (rc != 0 || wn != ln || memcmp(w, lossy, wn) != 0) {
                if (bad++ < 5) fprintf(stderr, "  %s %s: case %zu decodes differently\n", what, style, i);
            }
            free(w);
            free(lossy);
        }
        if (!add) {
            // exact round trip (Qwen: of the NFC form)
            uint8_t* norm = NULL;
            size_t norm_n = 0, norm_cap = 0;
            if (tok->nfc) unicode_nfc(text, len, &norm, &norm_n, &norm_cap);
            const uint8_t* ref = tok->nfc ? norm : text;
            size_t ref_n = tok->nfc ? norm_n : len;
            // GPT-2 style: <mask> swallows blanks, ĠSpecialWord decodes to " SpecialWord"
            int lossy = strcmp(style, "gpt2") == 0 && (strstr(hex->str, "3c6d61736b3e") ||
                                                       strstr(hex->str, "c4a05370656369616c"));
            if (!lossy && (out_n != ref_n || (ref_n && memcmp(out, ref, ref_n) != 0))) {
                if (bad++ < 5)
                    fprintf(stderr, "  %s %s: case %zu does not round-trip%s\n", what, style, i,
                            invalid ? " (invalid UTF-8)" : "");
            }
            free(norm);
        }
        free(out);
        tokenizer_ids_free(&ids);
        free(text);
    }
    CHECK(t, bad == 0, "%s %s: %d of %d cases differ", what, style, bad, n);
    CHECK(t, e.hits > 0 && e.misses > 0, "the piece cache was used (%lld hits, %lld misses)",
          (long long)e.hits, (long long)e.misses);
    tokenizer_encoder_free(&e);
    cases_close(&c);
    return bad;
}

// ----------------------------------------------------------------------------
// Unicode

static void test_tokenizer_unicode(TestCtx* t) {
    CHECK(t, strcmp(unicode_tables_version, "14.0.0") >= 0, "tables %s", unicode_tables_version);
    struct {
        uint32_t cp;
        UnicodeClass cls;
    } classes[] = {{'A', UNICODE_LETTER}, {'z', UNICODE_LETTER}, {'5', UNICODE_NUMBER},
                   {' ', UNICODE_SPACE},  {'\t', UNICODE_SPACE}, {0x0B, UNICODE_SPACE},
                   {0x1C, UNICODE_OTHER}, {0x85, UNICODE_SPACE}, {0xA0, UNICODE_SPACE},
                   {0x180E, UNICODE_OTHER}, {0x200B, UNICODE_OTHER}, {0x2028, UNICODE_SPACE},
                   {0x3000, UNICODE_SPACE}, {0x4E2D, UNICODE_LETTER}, {0xAC00, UNICODE_LETTER},
                   {0x216B, UNICODE_NUMBER}, {0xBD, UNICODE_NUMBER}, {0x0661, UNICODE_NUMBER},
                   {0x0301, UNICODE_OTHER}, {0x1F600, UNICODE_OTHER}, {'\'', UNICODE_OTHER},
                   {0x17F, UNICODE_LETTER}, {0x10FFFF, UNICODE_OTHER},
                   {UNICODE_RAW_BYTE + 0xFF, UNICODE_OTHER}};
    for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++)
        CHECK(t, unicode_class(classes[i].cp) == classes[i].cls, "class of U+%04X: %d, want %d",
              classes[i].cp, unicode_class(classes[i].cp), classes[i].cls);
    CHECK(t, unicode_ccc(0x301) == 230 && unicode_ccc(0x323) == 220 && unicode_ccc('a') == 0, "ccc");
    // NFC against values from Python's unicodedata.normalize("NFC", ...)
    struct {
        const char *in, *want;
    } nfc[] = {
        {"e\xcc\x81", "\xc3\xa9"},                          // e + acute -> é
        {"A\xcc\x8a", "\xc3\x85"},                          // A + ring -> Å
        {"\xe2\x84\xab", "\xc3\x85"},                       // ANGSTROM SIGN (singleton) -> Å
        {"a\xcc\x81\xcc\xa3", "\xe1\xba\xa1\xcc\x81"},      // reordered: dot below first, composed
        {"a\xcc\xa3\xcc\x81", "\xe1\xba\xa1\xcc\x81"},
        {"\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", "\xea\xb0\x81"},  // Hangul L V T -> 각
        {"\xea\xb0\x80\xe1\x86\xa8", "\xea\xb0\x81"},      // LV + T
        {"\xe0\xa5\x98", "\xe0\xa4\x95\xe0\xa4\xbc"},      // U+0958: composition exclusion
        {"e\xcc\x81\xcc\x81", "\xc3\xa9\xcc\x81"},         // the second acute is blocked
        {"\xcc\x81x", "\xcc\x81x"},                        // a leading combining mark stays
        {"\xff\xcc\x81", "\xff\xcc\x81"},                  // a raw byte composes with nothing
        {"plain ascii", "plain ascii"},
        {"\xe1\xba\x9b\xcc\xa3", "\xe1\xba\x9b\xcc\xa3"},  // U+1E9B U+0323 (NFC keeps)
        {"\xe0\xb7\x99\xe0\xb7\x8f", "\xe0\xb7\x9c"},      // Sinhala: a starter second half
    };
    for (size_t i = 0; i < sizeof nfc / sizeof nfc[0]; i++) {
        uint8_t* out = NULL;
        size_t n = 0, cap = 0;
        unicode_nfc((const uint8_t*)nfc[i].in, strlen(nfc[i].in), &out, &n, &cap);
        CHECK(t, n == strlen(nfc[i].want) && memcmp(out, nfc[i].want, n) == 0, "NFC case %zu", i);
        free(out);
    }
    // decoding: invalid sequences are one raw byte each, and re-encode to themselves
    const uint8_t bad[] = {0xC0, 0xAF, 0xED, 0xA0, 0x80, 0xF4, 0x90, 0x80, 0x80, 0xE2, 0x82, 'x', 0x80};
    for (size_t i = 0; i < sizeof bad;) {
        uint32_t cp;
        int l = utf8_decode(bad + i, sizeof bad - i, &cp);
        uint8_t enc[4];
        int m = utf8_encode(cp, enc);
        CHECK(t, l == 1 && m == 1 && enc[0] == bad[i] &&
                     (bad[i] == 'x' ? cp == 'x' : cp == UNICODE_RAW_BYTE + bad[i]),
              "byte %zu", i);
        i += (size_t)l;
    }
}

// ----------------------------------------------------------------------------
// the HF fixtures

static void test_tokenizer_fixtures(TestCtx* t) {
    for (int s = 0; s < 3; s++) {
        Tokenizer tok;
        if (load_style(t, STYLES[s], &tok)) continue;
        check_cases(t, &tok, STYLES[s], "tokenizer.json");
        tokenizer_free(&tok);
    }
}

static void test_tokenizer_fixture_settings(TestCtx* t) {
    Tokenizer q, l, g;
    if (load_style(t, "qwen3", &q) || load_style(t, "llama3", &l) || load_style(t, "gpt2", &g)) return;
    CHECK(t, q.split == TOK_SPLIT_QWEN2 && q.nfc && !q.ignore_merges && q.n_prefix == 0, "qwen3");
    CHECK(t, l.split == TOK_SPLIT_LLAMA3 && !l.nfc && l.ignore_merges && l.n_prefix == 1 &&
                 l.bos_id == tokenizer_find(&l, "<|begin_of_text|>", 17),
          "llama3: template prefix %d, bos %d", l.n_prefix, l.bos_id);
    CHECK(t, g.split == TOK_SPLIT_GPT2 && !g.add_prefix_space, "gpt2");
    int32_t im = tokenizer_find(&q, "<|im_start|>", 12), think = tokenizer_find(&q, "<think>", 7);
    CHECK(t, im >= 0 && q.kind[im] == TOK_KIND_SPECIAL && think >= 0 && q.kind[think] == TOK_KIND_ADDED,
          "kinds");
    // skip_special drops <|im_start|> but keeps <think>
    int32_t ids[3] = {im, think, q.byte_id['x']};
    uint8_t* out = NULL;
    size_t n = 0, cap = 0;
    char err[ERR_LEN];
    CHECK(t, tokenizer_decode(&q, ids, 3, TOK_DECODE_SKIP_SPECIAL, &out, &n, &cap, err) == 0 &&
                 strcmp((char*)out, "<think>x") == 0, "skip special: '%s'", out ? (char*)out : "");
    int32_t bad_id = q.n_vocab;
    CHECK(t, tokenizer_decode(&q, &bad_id, 1, 0, &out, &n, &cap, err) == -1 &&
                 strstr(err, "outside the vocabulary"), "bad id: %s", err);
    free(out);
    tokenizer_free(&q);
    tokenizer_free(&l);
    tokenizer_free(&g);
}

// A model directory: tokenizer.json with tokenizer_config.json beside it naming eos / pad.
static void test_tokenizer_config(TestCtx* t) {
    char src[1024], dir[1024], path[1100], err[ERR_LEN];
    snprintf(src, sizeof src, "%s/dev/tokenizer/fixtures/qwen3.json", t->exe_dir);
    snprintf(dir, sizeof dir, "%s/qwen_dir", t->tmpdir);
    CHECK(t, mkdir_p(dir, err) == 0, "%s", err);
    size_t len;
    char* json = test_read_file(src, &len);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    CHECK(t, file_write_atomic(path, json, len, err) == 0, "%s", err);
    free(json);
    const char* cfg = "{\"bos_token\": null, \"eos_token\": {\"content\": \"<|im_end|>\", \"lstrip\": "
                      "false}, \"pad_token\": \"<|endoftext|>\", \"unk_token\": \"<unk>\", "
                      "\"model_max_length\": 131072}";
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    CHECK(t, file_write_atomic(path, cfg, strlen(cfg), err) == 0, "%s", err);
    Tokenizer tok;
    int rc = tokenizer_load(&tok, dir, err);
    CHECK(t, rc == 0, "%s", err);
    if (rc == 0) {
        CHECK(t, tok.bos_id == -1 && tok.eos_id == tokenizer_find(&tok, "<|im_end|>", 10) &&
                     tok.pad_id == tokenizer_find(&tok, "<|endoftext|>", 13) && tok.unk_id == -1,
              "bos %d eos %d pad %d unk %d", tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id);
        tokenizer_free(&tok);
    }
    // written back as an HF directory (tokenizer.json + tokenizer_config.json): the same again
    rc = tokenizer_load(&tok, dir, err);
    char out_dir[1100];
    snprintf(out_dir, sizeof out_dir, "%s/qwen_export", t->tmpdir);
    rc = rc ? rc : tokenizer_write_hf(&tok, out_dir, err);
    CHECK(t, rc == 0, "write hf: %s", err);
    Tokenizer back;
    rc = rc ? rc : tokenizer_load(&back, out_dir, err);
    CHECK(t, rc == 0, "reload hf: %s", err);
    if (rc == 0) {
        CHECK(t, back.eos_id == tok.eos_id && back.pad_id == tok.pad_id && back.bos_id == -1,
              "special ids survive the export");
        TokIds a = {0}, b = {0};
        const char* text = "<|im_start|>user\nCafe\xcc\x81 12345<|im_end|>";
        tokenizer_encode_once(&tok, text, strlen(text), 0, &a);
        tokenizer_encode_once(&back, text, strlen(text), 0, &b);
        CHECK(t, a.n == b.n && a.n > 5 && memcmp(a.ids, b.ids, a.n * 4) == 0, "same ids");
        tokenizer_ids_free(&a);
        tokenizer_ids_free(&b);
        tokenizer_free(&back);
        tokenizer_free(&tok);
    }
    cfg = "{\"bos_token\": \"<nope>\"}";
    CHECK(t, file_write_atomic(path, cfg, strlen(cfg), err) == 0, "%s", err);
    rc = tokenizer_load(&tok, dir, err);
    CHECK(t, rc == -1 && strstr(err, "tokenizer_config.json: bos_token '<nope>' is not a token"),
          "%s", err);
}

// Random bytes (valid and invalid UTF-8, specials, whitespace) round-trip exactly.
static void test_tokenizer_roundtrip_random(TestCtx* t) {
    static const char* const atoms[] = {"a", "Z", "9", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL",
                                        "\xc3\xa9", "e\xcc\x81", "\xe4\xb8\xad", "\xf0\x9f\x98\x80",
                                        "\xe3\x80\x80", "\xff", "\x80", "\xe2\x82", "<|endoftext|>",
                                        "<|im_start|>", "<think>", "\xcc\xa3", "12345", ".,;"};
    uint64_t x = 0x243F6A8885A308D3ull;
    int bad = 0;
    for (int s = 0; s < 3; s++) {
        Tokenizer tok;
        if (load_style(t, STYLES[s], &tok)) continue;
        TokEncoder e;
        tokenizer_encoder_init(&e, &tok);
        for (int it = 0; it < 400; it++) {
            uint8_t buf[512];
            size_t n = 0;
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            int k = (int)(x % 40);
            for (int j = 0; j < k; j++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                if (x % 5 == 0) {
                    buf[n++] = (uint8_t)(x >> 24);  // any byte
                } else {
                    const char* a = atoms[(x >> 8) % (sizeof atoms / sizeof atoms[0])];
                    memcpy(buf + n, a, strlen(a));
                    n += strlen(a);
                }
            }
            TokIds ids = {0};
            tokenizer_encode(&e, buf, n, 0, &ids);
            uint8_t* out = NULL;
            size_t on = 0, cap = 0;
            char err[ERR_LEN];
            tokenizer_decode(&tok, ids.ids, ids.n, 0, &out, &on, &cap, err);
            uint8_t* norm = NULL;
            size_t nn = 0, ncap = 0;
            unicode_nfc(buf, n, &norm, &nn, &ncap);
            const uint8_t* ref = tok.nfc ? norm : buf;
            size_t rn = tok.nfc ? nn : n;
            if (on != rn || (rn && memcmp(out, ref, rn) != 0)) bad++;
            free(out);
            free(norm);
            tokenizer_ids_free(&ids);
        }
        tokenizer_encoder_free(&e);
        tokenizer_free(&tok);
    }
    CHECK(t, bad == 0, "%d random inputs do not round-trip", bad);
}

// ----------------------------------------------------------------------------
// GGUF metadata

typedef struct Recs {
    uint8_t* p;
    size_t n, cap;
    int64_t n_kv;
} Recs;

static void recs_put(Recs* r, const void* s, size_t n) {
    if (r->n + n > r->cap) {
        r->cap = 2 * (r->n + n) + 256;
        r->p = realloc_check(r->p, r->cap);
    }
    memcpy(r->p + r->n, s, n);
    r->n += n;
}
static void recs_u32(Recs* r, uint32_t v) { recs_put(r, &v, 4); }
static void recs_u64(Recs* r, uint64_t v) { recs_put(r, &v, 8); }
static void recs_str(Recs* r, const char* s) {
    recs_u64(r, strlen(s));
    recs_put(r, s, strlen(s));
}
static void recs_key(Recs* r, const char* key, uint32_t type) {
    recs_str(r, key);
    recs_u32(r, type);
    r->n_kv++;
}
static void recs_strings(Recs* r, const char* key, const char* const* s, int n) {
    recs_key(r, key, GGUF_TYPE_ARRAY);
    recs_u32(r, GGUF_TYPE_STRING);
    recs_u64(r, (uint64_t)n);
    for (int i = 0; i < n; i++) recs_str(r, s[i]);
}

// GPT-2's byte-level character of byte b, UTF-8 into out.
static void byte_char(int b, char* out) {
    int c;
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) c = b;
    else if (b <= 0x20) c = 256 + b;
    else if (b <= 0xA0) c = 256 + 33 + (b - 0x7F);
    else c = 256 + 67;
    uint8_t u[5] = {0};
    utf8_encode((uint32_t)c, u);
    memcpy(out, u, 5);
}

// A tiny Qwen2-style vocabulary: the 256 bytes (id = byte), five merges, three added tokens.
static void tiny_gguf_records(Recs* r, const char* pre) {
    static char chars[256][8];
    const char* tokens[264];
    for (int b = 0; b < 256; b++) {
        byte_char(b, chars[b]);
        tokens[b] = chars[b];
    }
    const char* extra[8] = {"he", "ll", "hell", "hello", "\xc4\xa0w", "<|endoftext|>", "<|im_start|>",
                            "<think>"};
    for (int i = 0; i < 8; i++) tokens[256 + i] = extra[i];
    const char* merges[5] = {"h e", "l l", "he ll", "hell o", "\xc4\xa0 w"};
    recs_key(r, "tokenizer.ggml.model", GGUF_TYPE_STRING);
    recs_str(r, "gpt2");
    recs_key(r, "tokenizer.ggml.pre", GGUF_TYPE_STRING);
    recs_str(r, pre);
    recs_strings(r, "tokenizer.ggml.tokens", tokens, 264);
    recs_key(r, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY);
    recs_u32(r, GGUF_TYPE_INT32);
    recs_u64(r, 264);
    for (int i = 0; i < 264; i++) recs_u32(r, i == 261 || i == 262 ? 3 : i == 263 ? 4 : 1);
    recs_strings(r, "tokenizer.ggml.merges", merges, 5);
    recs_key(r, "tokenizer.ggml.eos_token_id", GGUF_TYPE_UINT32);
    recs_u32(r, 261);
    recs_key(r, "tokenizer.ggml.padding_token_id", GGUF_TYPE_UINT32);
    recs_u32(r, 261);
    recs_key(r, "tokenizer.ggml.add_bos_token", GGUF_TYPE_BOOL);
    recs_put(r, "\0", 1);
}

static void check_tiny(TestCtx* t, const Tokenizer* tok, const char* what) {
    TokEncoder e;
    tokenizer_encoder_init(&e, tok);
    const char* text = "hello world<|endoftext|><think>e\xcc\x81";
    TokIds ids = {0};
    tokenizer_encode(&e, text, strlen(text), TOK_ENCODE_ADD_SPECIAL, &ids);
    // "hello" " world" (Ġw merged) "<|endoftext|>" "<think>" NFC(e + acute) = é = C3 A9
    const int32_t want[] = {259, 260, 'o', 'r', 'l', 'd', 261, 263, 0xC3, 0xA9};
    int same = ids.n == 10;
    for (size_t i = 0; same && i < 10; i++) same = ids.ids[i] == want[i];
    CHECK(t, same, "%s: tiny GGUF vocabulary encodes as expected (%zu ids)", what, ids.n);
    CHECK(t, tok->eos_id == 261 && tok->pad_id == 261 && tok->bos_id == -1 && tok->n_prefix == 0 &&
                 tok->kind[261] == TOK_KIND_SPECIAL && tok->kind[263] == TOK_KIND_ADDED &&
                 tok->split == TOK_SPLIT_QWEN2 && tok->nfc,
          "%s: metadata", what);
    uint8_t* out = NULL;
    size_t n = 0, cap = 0;
    char err[ERR_LEN];
    tokenizer_decode(tok, ids.ids, ids.n, 0, &out, &n, &cap, err);
    CHECK(t, strcmp((char*)out, "hello world<|endoftext|><think>\xc3\xa9") == 0, "%s: decode", what);
    free(out);
    tokenizer_ids_free(&ids);
    tokenizer_encoder_free(&e);
}

static void test_tokenizer_gguf(TestCtx* t) {
    char err[ERR_LEN], path[1024];
    Recs r = {0};
    tiny_gguf_records(&r, "qwen2");
    GgufTokenizer rec = {.records = r.p, .len = r.n, .n_kv = r.n_kv};
    Tokenizer tok;
    int rc = tokenizer_load_gguf_records(&tok, &rec, "tiny.gguf", err);
    CHECK(t, rc == 0, "records: %s", err);
    if (rc == 0) {
        check_tiny(t, &tok, "records");
        tokenizer_free(&tok);
    }
    // the same records in a GGUF file, loaded by path (the magic tells it from tokenizer.json)
    GgufWriter w;
    gguf_writer_init(&w);
    gguf_writer_add_string(&w, "general.architecture", "llama");
    gguf_writer_add_records(&w, r.p, r.n, r.n_kv);
    test_path(t, path, sizeof path, "tiny_tok.gguf");
    rc = gguf_writer_write(&w, path, err);
    CHECK(t, rc == 0, "write: %s", err);
    gguf_writer_free(&w);
    rc = tokenizer_load(&tok, path, err);
    CHECK(t, rc == 0, "file: %s", err);
    if (rc == 0) {
        check_tiny(t, &tok, "file");
        tokenizer_free(&tok);
    }
    free(r.p);
    // unsupported models and pre-tokenizers are refused by name
    struct {
        const char *model, *pre, *want;
    } bad[] = {{"llama", "default", "'llama' is not supported"},
               {"gpt2", "deepseek-coder", "tokenizer.ggml.pre 'deepseek-coder' is not supported"}};
    for (int k = 0; k < 2; k++) {
        Recs b = {0};
        recs_key(&b, "tokenizer.ggml.model", GGUF_TYPE_STRING);
        recs_str(&b, bad[k].model);
        recs_key(&b, "tokenizer.ggml.pre", GGUF_TYPE_STRING);
        recs_str(&b, bad[k].pre);
        GgufTokenizer br = {.records = b.p, .len = b.n, .n_kv = b.n_kv};
        rc = tokenizer_load_gguf_records(&tok, &br, "bad.gguf", err);
        CHECK(t, rc == -1 && strncmp(err, "bad.gguf: ", 10) == 0 && strstr(err, bad[k].want),
              "refused: %s", err);
        free(b.p);
    }
}

// Every fixture tokenizer exported as GGUF records and as tokenizer.json, read back: same ids.
static void test_tokenizer_export_roundtrip(TestCtx* t) {
    char err[ERR_LEN], path[1024];
    for (int s = 0; s < 3; s++) {
        Tokenizer tok, back;
        if (load_style(t, STYLES[s], &tok)) continue;
        GgufTokenizer rec;
        tokenizer_gguf_records(&tok, tok.n_vocab, &rec);
        int rc = tokenizer_load_gguf_records(&back, &rec, "export.gguf", err);
        CHECK(t, rc == 0, "%s: GGUF records: %s", STYLES[s], err);
        if (rc == 0) {
            CHECK(t, back.n_vocab == tok.n_vocab && back.bos_id == tok.bos_id &&
                         back.n_merges == tok.n_merges && back.nfc == tok.nfc,
                  "%s: GGUF metadata", STYLES[s]);
            // GGUF cannot say lstrip/rstrip: the GPT-2 style's <mask> cases differ there
            if (s < 2) check_cases(t, &back, STYLES[s], "gguf export");
            tokenizer_free(&back);
        }
        gguf_tokenizer_free(&rec);
        snprintf(path, sizeof path, "%s/export_%s.json", t->tmpdir, STYLES[s]);
        rc = tokenizer_write_json(&tok, path, err);
        CHECK(t, rc == 0, "%s: write json: %s", STYLES[s], err);
        rc = rc ? rc : tokenizer_load(&back, path, err);
        CHECK(t, rc == 0, "%s: reload json: %s", STYLES[s], err);
        if (rc == 0) {
            check_cases(t, &back, STYLES[s], "json export");
            tokenizer_free(&back);
        }
        tokenizer_free(&tok);
    }
}

// ----------------------------------------------------------------------------
// errors

static void test_tokenizer_errors(TestCtx* t) {
    static const char* const vocab = "\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}";
    static const char* const pre =
        "\"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}, "
        "\"decoder\": {\"type\": \"ByteLevel\"}";
    struct {
        const char* json;
        const char* want;
    } cases[] = {
        {"[1, 2]", "not a JSON object"},
        {"{\"model\": {\"type\": \"WordPiece\"}}", "model type 'WordPiece' is not supported"},
        {"{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, %V, \"merges\": []}, %P}",
         "byte_fallback"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": [\"a c\"]}, %P}", "'c' is not in the vocabulary"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": [\"b a\"]}, %P}", "the result is not in the vocabulary"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": [\"a b c\"]}, %P}", "neither"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 99999999}, \"merges\": []}, %P}", "too large"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}, %P}", "id 0 is both"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}, \"pre_tokenizer\": {\"type\": \"Sequence\", "
         "\"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\w+\"}, \"behavior\": "
         "\"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", \"use_regex\": false, "
         "\"add_prefix_space\": false}]}, \"decoder\": {\"type\": \"ByteLevel\"}}",
         "Split regex '\\x5cw+' is not one of"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}, \"pre_tokenizer\": {\"type\": "
         "\"Metaspace\"}, \"decoder\": {\"type\": \"ByteLevel\"}}", "pre-tokenizer 'Metaspace'"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}, \"normalizer\": {\"type\": \"NFKC\"}, %P}",
         "normalizer 'NFKC'"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}, \"added_tokens\": [{\"id\": 3, "
         "\"content\": \"x\", \"single_word\": true}], %P}", "single_word"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}, \"pre_tokenizer\": null}", "no pre_tokenizer"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}, %P, \"post_processor\": {\"type\": "
         "\"BertProcessing\"}}", "post_processor 'BertProcessing'"},
        {"{\"model\": {\"type\": \"BPE\", %V, \"merges\": []}", "at byte"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char json[2048], err[ERR_LEN] = "";
        // expand %V (a small vocabulary) and %P (GPT-2 pre-tokenizer and decoder)
        size_t k = 0;
        for (const char* p = cases[i].json; *p && k < sizeof json - 400; p++) {
            if (p[0] == '%' && (p[1] == 'V' || p[1] == 'P')) {
                const char* s = p[1] == 'V' ? vocab : pre;
                memcpy(json + k, s, strlen(s));
                k += strlen(s);
                p++;
            } else {
                json[k++] = *p;
            }
        }
        json[k] = '\0';
        Tokenizer tok;
        int rc = tokenizer_load_json(&tok, json, k, "bad.json", err);
        CHECK(t, rc == -1 && strncmp(err, "bad.json: ", 10) == 0 && strstr(err, cases[i].want) &&
                     !strchr(err, '\n'),
              "case %zu: '%s' (want '%s')", i, err, cases[i].want);
        if (rc == 0) tokenizer_free(&tok);
    }
    // a missing file
    char err[ERR_LEN];
    Tokenizer tok;
    CHECK(t, tokenizer_load(&tok, "/nonexistent/tokenizer.json", err) == -1 &&
                 strstr(err, "/nonexistent/tokenizer.json"), "%s", err);
}

// ----------------------------------------------------------------------------
// the piece cache: results are the same with a cold cache, a warm one, and after it overflows

static void test_tokenizer_cache(TestCtx* t) {
    Tokenizer tok;
    if (load_style(t, "llama3", &tok)) return;
    // many distinct words: more than the cache holds, so it is cleared along the way
    size_t cap = 1u << 20, n = 0;
    char* text = malloc_check(cap);
    uint64_t x = 88172645463325252ull;
    while (n + 16 < cap) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int len = 2 + (int)(x % 7);
        text[n++] = ' ';
        for (int j = 0; j < len; j++) text[n++] = (char)('a' + (x >> (5 * j + 8)) % 26);
    }
    TokEncoder warm, cold;
    tokenizer_encoder_init(&warm, &tok);
    TokIds a = {0}, b = {0};
    tokenizer_encode(&warm, text, n, 0, &a);
    tokenizer_ids_free(&a);
    tokenizer_encode(&warm, text, n, 0, &a);  // second pass: (partly) cached
    int same = 1;
    // word by word through fresh encoders gives the same ids
    tokenizer_encoder_init(&cold, &tok);
    tokenizer_encode(&cold, text, n, 0, &b);
    same = a.n == b.n && memcmp(a.ids, b.ids, a.n * sizeof(int32_t)) == 0;
    CHECK(t, same, "warm and cold caches agree (%zu vs %zu ids)", a.n, b.n);
    CHECK(t, warm.hits > 0 && warm.misses > 40000, "hits %lld misses %lld", (long long)warm.hits,
          (long long)warm.misses);
    tokenizer_ids_free(&a);
    tokenizer_ids_free(&b);
    tokenizer_encoder_free(&warm);
    tokenizer_encoder_free(&cold);
    free(text);
    tokenizer_free(&tok);
}

// ----------------------------------------------------------------------------
// the fuzz target's entry point over its seeds and mutations

static void test_tokenizer_fuzz_smoke(TestCtx* t) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/dev/fuzz/corpus/tokenizer", t->exe_dir);
    DIR* d = opendir(dir);
    CHECK(t, d != NULL, "seed corpus %s", dir);
    if (!d) return;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    int seeds = 0, accepted = 0, runs = 0;
    struct dirent* ent;
    while ((ent = readdir(d)) != NULL) {
        if (ent->d_name[0] == '.') continue;
        char path[2048], err[ERR_LEN];
        snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
        size_t len;
        char* seed = file_read_all(path, 1u << 20, &len, err);
        if (!seed) continue;
        seeds++;
        CHECK(t, fuzz_tokenizer((const uint8_t*)seed, len) == 1, "seed %s is accepted", path);
        for (int i = 0; i < 300; i++) {
            uint8_t* m = malloc_check(len + 64);
            memcpy(m, seed, len);
            size_t n = len;
            for (int k = 0; k < 1 + i % 4; k++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                size_t at = n ? (size_t)(x % n) : 0;
                switch ((x >> 32) % 4) {
                case 0: if (n) m[at] = (uint8_t)(x >> 40); break;           // replace a byte
                case 1: if (n) m[at] ^= (uint8_t)(1u << ((x >> 40) % 8)); break;  // flip a bit
                case 2: if (n) { memmove(m + at, m + at + 1, n - at - 1); n--; } break;  // delete
                default:  // insert an interesting byte
                    memmove(m + at + 1, m + at, n - at);
                    m[at] = "\"\\{}[]:, \x00\xff\xc3\xcc'\n"[(x >> 40) % 16];
                    n++;
                }
            }
            uint8_t* exact = malloc_check(n ? n : 1);
            memcpy(exact, m, n);
            accepted += fuzz_tokenizer(exact, n);
            runs++;
            free(exact);
            free(m);
        }
        free(seed);
    }
    closedir(d);
    CHECK(t, seeds >= 3 && accepted > 0 && accepted < runs, "%d seeds, %d of %d mutants accepted",
          seeds, accepted, runs);
}

// ----------------------------------------------------------------------------
// the shard tool

// Cutting documents into chunks never changes their tokens.
static void test_tokenizer_parallel_chunks(TestCtx* t) {
    Cases c;
    if (cases_open(t, &c)) return;
    // a text of every valid case, one per line, twice over, and some code
    uint8_t* text = NULL;
    size_t n = 0, cap = 0;
    for (int rep = 0; rep < 2; rep++)
        for (size_t i = 0; i < c.list->n; i++) {
            const JsonValue* cs = &c.list->items[i];
            int64_t inv = 0;
            json_get_int(cs, "invalid", &inv);
            const JsonValue* hex = json_get(cs, "hex");
            size_t len;
            uint8_t* s = hex_decode(hex->str, hex->str_len, &len);
            if (n + len + 64 > cap) {
                cap = 2 * (n + len + 64);
                text = realloc_check(text, cap);
            }
            memcpy(text + n, s, len);
            n += len;
            const char* sep = rep ? ".\nNext line\n" : "}\nx = 1\n\n  y\n";
            memcpy(text + n, sep, strlen(sep));
            n += strlen(sep);
            free(s);
        }
    cases_close(&c);
    for (int s = 0; s < 3; s++) {
        Tokenizer tok;
        if (load_style(t, STYLES[s], &tok)) continue;
        Tokenizer* use = &tok;
        Tokenizer gg;
        if (s == 2) {
            // the GPT-2 fixture's <mask> strips blanks, which forbids cuts; its GGUF form does not
            GgufTokenizer rec;
            char err[ERR_LEN];
            tokenizer_gguf_records(&tok, tok.n_vocab, &rec);
            CHECK(t, tokenizer_load_gguf_records(&gg, &rec, "gpt2.gguf", err) == 0, "%s", err);
            gguf_tokenizer_free(&rec);
            use = &gg;
        }
        TokEncoder e;
        tokenizer_encoder_init(&e, use);
        TokIds whole = {0}, parts = {0};
        tokenizer_encode(&e, text, n, 0, &whole);
        tokenize_parallel(use, (const char*)text, n, 200, 3, &parts);
        CHECK(t, whole.n == parts.n && memcmp(whole.ids, parts.ids, whole.n * sizeof(int32_t)) == 0,
              "%s: chunked encoding differs (%zu vs %zu ids)", STYLES[s], whole.n, parts.n);
        tokenizer_ids_free(&whole);
        tokenizer_ids_free(&parts);
        tokenizer_encoder_free(&e);
        if (use == &gg) tokenizer_free(&gg);
        tokenizer_free(&tok);
    }
    free(text);
}

static void write_text(TestCtx* t, const char* name, const char* text, char* path, size_t cap) {
    test_path(t, path, cap, name);
    FILE* f = fopen(path, "wb");
    CHECK(t, f != NULL, "create %s", path);
    if (!f) return;
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}

// All tokens of the shards of one split, concatenated (and the files' count in *n_files).
static int32_t* read_split(TestCtx* t, const char* prefix, const char* split, int first, size_t* n,
                           int* n_files, int* token_bytes, int64_t limit) {
    int32_t* all = NULL;
    *n = 0;
    *n_files = 0;
    for (int i = first;; i++) {
        char path[1200];
        snprintf(path, sizeof path, "%s_%s_%06d.bin", prefix, split, i);
        size_t len;
        char* data = file_exists(path) ? test_read_file(path, &len) : NULL;
        if (!data) break;
        int32_t hdr[3];
        memcpy(hdr, data, sizeof hdr);
        int tb = hdr[0] == SHARD_MAGIC_U16 ? 2 : 4;
        *token_bytes = tb;
        CHECK(t, (hdr[0] == SHARD_MAGIC_U16 && hdr[1] == SHARD_VERSION_U16) ||
                     (hdr[0] == SHARD_MAGIC_U32 && hdr[1] == SHARD_VERSION_U32), "%s header", path);
        CHECK(t, len == 1024 + (size_t)hdr[2] * (size_t)tb && hdr[2] > 0 && hdr[2] <= limit,
              "%s: %d tokens in %zu bytes", path, hdr[2], len);
        all = realloc_check(all, (*n + (size_t)hdr[2]) * sizeof(int32_t));
        for (int k = 0; k < hdr[2]; k++) {
            const uint8_t* p = (const uint8_t*)data + 1024 + (size_t)k * (size_t)tb;
            all[(*n)++] = tb == 2 ? (int32_t)(p[0] | p[1] << 8)
                                  : (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 |
                                              (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        }
        free(data);
        (*n_files)++;
    }
    return all;
}

static void test_tokenizer_shards(TestCtx* t) {
    Tokenizer tok;
    if (load_style(t, "qwen3", &tok)) return;
    char p1[1024], p2[1024], p3[1024], prefix[1024], err[ERR_LEN];
    const char* docs[] = {"The first document.\nIt has two lines.\n",
                          "Second: \u81ea\u7136\u8bed\u8a00 e\u0301 <|im_start|>x",
                          "third \"quoted\" text\twith\ttabs", "fourth", "",
                          "sixth: 12345 ... done"};
    // docs 0-1 as text files, the rest as JSONL lines (escapes decoded, blank lines skipped)
    write_text(t, "a.txt", "The first document.\nIt has two lines.\n", p1, sizeof p1);
    write_text(t, "b.txt", "Second: \xe8\x87\xaa\xe7\x84\xb6\xe8\xaf\xad\xe8\xa8\x80 e\xcc\x81 "
                           "<|im_start|>x", p2, sizeof p2);
    write_text(t, "c.jsonl", "{\"text\": \"third \\\"quoted\\\" text\\twith\\ttabs\", \"id\": 3}\n"
                             "\n{\"text\": \"fourth\"}\n{\"text\": \"\"}\n"
                             "{\"id\": 6, \"text\": \"sixth: 12345 ... done\"}\n", p3, sizeof p3);
    const char* inputs[] = {p1, p2, p3};
    // the expected stream: <|endoftext|>? no: Qwen-style has no BOS/EOS, so --eot names one
    TokEncoder e;
    tokenizer_encoder_init(&e, &tok);
    int32_t eot = tokenizer_find(&tok, "<|endoftext|>", 13);
    TokIds want = {0};
    size_t doc_start[7];
    for (int d = 0; d < 6; d++) {
        doc_start[d] = want.n;
        tokenizer_ids_push(&want, eot);
        tokenizer_encode(&e, docs[d], strlen(docs[d]), 0, &want);
    }
    doc_start[6] = want.n;
    tokenizer_encoder_free(&e);
    char files1[2][65536];
    size_t files1_n[2] = {0, 0};
    for (int threads = 1; threads <= 4; threads += 3) {
        TokenizeShardsArgs a;
        tokenize_shards_defaults(&a);
        a.inputs = inputs;
        a.n_inputs = 3;
        snprintf(prefix, sizeof prefix, "%s/out%d/data", t->tmpdir, threads);
        a.out_prefix = prefix;
        a.val_frac = 0.3;
        a.shard_tokens = 7;
        a.eot = "<|endoftext|>";
        a.threads = threads;
        a.progress = 0;
        a.quiet = 1;
        TokenizeShardsStats st;
        int rc = tokenize_shards_run(&a, &tok, &st, err);
        CHECK(t, rc == 0, "run: %s", err);
        if (rc) break;
        size_t nv, nt;
        int fv, ft, tb = 0;
        int32_t* v = read_split(t, prefix, "val", 0, &nv, &fv, &tb, 7);
        int32_t* tr = read_split(t, prefix, "train", 1, &nt, &ft, &tb, 7);
        CHECK(t, tb == 2 && st.token_bytes == 2, "uint16 tokens for a small vocabulary");
        CHECK(t, st.docs == 6 && (size_t)st.tokens == want.n && nv + nt == want.n &&
                     (size_t)st.val_tokens == nv && st.val_docs > 0 && nv <= 0.3 * (double)want.n,
              "%lld docs, %lld tokens (%zu val + %zu train of %zu)", (long long)st.docs,
              (long long)st.tokens, nv, nt, want.n);
        CHECK(t, fv == st.n_val_shards && ft == st.n_train_shards && ft >= 2, "shard files");
        // the documents in order, each to one split
        size_t iv = 0, it = 0;
        int same = 1;
        for (int d = 0; d < 6; d++) {
            size_t len = doc_start[d + 1] - doc_start[d];
            int in_val = iv + len <= nv && memcmp(v + iv, want.ids + doc_start[d], len * 4) == 0;
            if (in_val) {
                iv += len;
            } else {
                same &= it + len <= nt && memcmp(tr + it, want.ids + doc_start[d], len * 4) == 0;
                it += len;
            }
        }
        CHECK(t, same && iv == nv && it == nt, "documents in input order, whole, in one split");
        // the same bytes whatever the thread count
        size_t nbytes = (nv + nt) * 4;
        if (threads == 1) {
            memcpy(files1[0], v, nv * 4);
            memcpy(files1[1], tr, nt * 4);
            files1_n[0] = nv;
            files1_n[1] = nt;
        } else {
            CHECK(t, files1_n[0] == nv && files1_n[1] == nt && memcmp(files1[0], v, nv * 4) == 0 &&
                         memcmp(files1[1], tr, nt * 4) == 0, "1 and 4 threads agree (%zu bytes)", nbytes);
        }
        // the loader takes the shards
        char glob[1200];
        snprintf(glob, sizeof glob, "%s_train_*.bin", prefix);
        DataLoader dl;
        rc = dataloader_open(&dl, glob, 1, 3, 0, 1, tok.n_vocab, err);
        CHECK(t, rc == 0, "dataloader: %s", err);
        if (rc == 0) dataloader_close(&dl);
        free(v);
        free(tr);
    }
    tokenizer_ids_free(&want);
    tokenizer_free(&tok);
}

// A vocabulary past 65536 ids gives uint32 shards; errors name the file and line.
static void test_tokenizer_shards_u32_and_errors(TestCtx* t) {
    // 256 byte tokens and an added <|endoftext|> at id 66000
    char* json = malloc_check(1 << 16);
    size_t k = (size_t)sprintf(json, "{\"added_tokens\": [{\"id\": 66000, \"content\": \"<|endoftext|>\", "
                                     "\"special\": true}], \"model\": {\"type\": \"BPE\", \"merges\": [], "
                                     "\"vocab\": {");
    for (int b = 0; b < 256; b++) {
        char c[8];
        byte_char(b, c);
        char esc[16];
        json_escape(esc, sizeof esc, c);
        k += (size_t)sprintf(json + k, "%s%s: %d", b ? ", " : "", esc, b);
    }
    k += (size_t)sprintf(json + k, "}}, \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": "
                                   "false}, \"decoder\": {\"type\": \"ByteLevel\"}}");
    char err[ERR_LEN], p1[1024], p2[1024], prefix[1024];
    Tokenizer tok;
    int rc = tokenizer_load_json(&tok, json, k, "wide.json", err);
    free(json);
    CHECK(t, rc == 0, "%s", err);
    if (rc) return;
    write_text(t, "w.txt", "hi", p1, sizeof p1);
    const char* inputs[] = {p1};
    TokenizeShardsArgs a;
    tokenize_shards_defaults(&a);
    a.inputs = inputs;
    a.n_inputs = 1;
    snprintf(prefix, sizeof prefix, "%s/wide/x", t->tmpdir);
    a.out_prefix = prefix;
    a.progress = 0;
    a.quiet = 1;
    TokenizeShardsStats st;
    rc = tokenize_shards_run(&a, &tok, &st, err);
    CHECK(t, rc == 0, "%s", err);
    size_t n;
    int files, tb = 0;
    int32_t* v = read_split(t, prefix, "train", 1, &n, &files, &tb, a.shard_tokens);
    CHECK(t, tb == 4 && n == 3 && v && v[0] == 66000 && v[1] == 'h' && v[2] == 'i',
          "uint32 shard: %zu tokens", n);
    free(v);
    // errors
    write_text(t, "bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": 5}\n", p2, sizeof p2);
    inputs[0] = p2;
    rc = tokenize_shards_run(&a, &tok, &st, err);
    CHECK(t, rc == -1 && strstr(err, "bad.jsonl:2: no string field \"text\""), "%s", err);
    write_text(t, "bad2.jsonl", "{\"text\": \"ok\"\n", p2, sizeof p2);
    rc = tokenize_shards_run(&a, &tok, &st, err);
    CHECK(t, rc == -1 && strstr(err, "bad2.jsonl:1: invalid JSON"), "%s", err);
    inputs[0] = "/nonexistent.txt";
    rc = tokenize_shards_run(&a, &tok, &st, err);
    CHECK(t, rc == -1 && strstr(err, "/nonexistent.txt"), "%s", err);
    inputs[0] = p1;
    a.eot = "<nope>";
    rc = tokenize_shards_run(&a, &tok, &st, err);
    CHECK(t, rc == -1 && strstr(err, "--eot '<nope>'"), "%s", err);
    a.eot = "";
    a.val_frac = 1.5;
    rc = tokenize_shards_run(&a, &tok, &st, err);
    CHECK(t, rc == -1 && strstr(err, "--val-frac"), "%s", err);
    tokenizer_free(&tok);
    // the command line refuses bad flags with status 2
    char* argv1[] = {"train_roundpipe", "--tokenize", p1, "--tokenizer", "x.json", NULL};
    char* argv2[] = {"train_roundpipe", "--tokenize", p1, "--tokenizer", "x", "--out-shards", "y",
                     "--bogus", "1", NULL};
    char* argv3[] = {"train_roundpipe", "--tokenize", p1, "--tokenizer", "x", "--out-shards", "y",
                     "--val-frac", "abc", NULL};
    CHECK(t, tokenize_shards_requested(5, argv1) && !tokenize_shards_requested(1, argv1), "requested");
    CHECK(t, tokenize_shards_main(5, argv1) == 2, "missing --out-shards");
    CHECK(t, tokenize_shards_main(9, argv2) == 2, "unknown flag");
    CHECK(t, tokenize_shards_main(9, argv3) == 2, "bad value");
}

// through ./train_roundpipe (test_tokenizer_cli.c)
void test_tokenizer_cli_tool(TestCtx* t);
void test_tokenizer_cli_model(TestCtx* t);
void test_tokenizer_cli_mismatch(TestCtx* t);

const TestCase tests_tokenizer[] = {
    {"tokenizer_unicode", test_tokenizer_unicode},
    {"tokenizer_fixtures", test_tokenizer_fixtures},
    {"tokenizer_fixture_settings", test_tokenizer_fixture_settings},
    {"tokenizer_config", test_tokenizer_config},
    {"tokenizer_roundtrip_random", test_tokenizer_roundtrip_random},
    {"tokenizer_gguf", test_tokenizer_gguf},
    {"tokenizer_export_roundtrip", test_tokenizer_export_roundtrip},
    {"tokenizer_errors", test_tokenizer_errors},
    {"tokenizer_cache", test_tokenizer_cache},
    {"tokenizer_fuzz_smoke", test_tokenizer_fuzz_smoke},
    {"tokenizer_parallel_chunks", test_tokenizer_parallel_chunks},
    {"tokenizer_shards", test_tokenizer_shards},
    {"tokenizer_shards_u32_and_errors", test_tokenizer_shards_u32_and_errors},
    {"tokenizer_cli_tool", test_tokenizer_cli_tool},
    {"tokenizer_cli_model", test_tokenizer_cli_model},
    {"tokenizer_cli_mismatch", test_tokenizer_cli_mismatch},
    {NULL, NULL},
};
