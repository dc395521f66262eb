/*
 * tokenizer_export.c — a loaded Tokenizer written back out for the exports: GGUF tokenizer.ggml.*
 * records (gguf_writer_add_records takes them as they are) and an HF tokenizer.json with the
 * tokenizer_config.json that names its special tokens. What is written loads back to the same
 * ids and the same encodings (test_tokenizer checks both round trips).
 */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "json.h"
#include "tokenizer_internal.h"
#include "unicode.h"

// GGUF tokenizer.ggml.pre of each split (the names llama.cpp's converter writes)
static const char* const SPLIT_GGUF_PRE[3] = {
    [TOK_SPLIT_GPT2] = "default", [TOK_SPLIT_LLAMA3] = "llama-bpe", [TOK_SPLIT_QWEN2] = "qwen2"};

// Append the byte-level spelling of bytes s[0..n).
static void bytelevel_encode(const uint8_t* s, size_t n, uint8_t** out, size_t* len, size_t* cap) {
    tok_bytes_reserve(out, len, cap, 2 * n);
    for (size_t i = 0; i < n; i++) *len += (size_t)utf8_encode(tok_bytelevel_char(s[i]), *out + *len);
}

// ----------------------------------------------------------------------------
// writing: the text of each token as the files spell it

// Append id's text: byte-level spelling for byte-level tokens, else the raw text.
static void token_text(const Tokenizer* t, int32_t id, uint8_t** out, size_t* len, size_t* cap) {
    const uint8_t* p = t->pieces + t->piece_off[id];
    size_t n = (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    if (t->bytelevel[id]) bytelevel_encode(p, n, out, len, cap);
    else tok_bytes_append(out, len, cap, p, n);
}

typedef struct Rec {
    uint8_t* p;
    size_t n, cap;
} Rec;

static void rec_u32(Rec* r, uint32_t v) { tok_bytes_append(&r->p, &r->n, &r->cap, &v, 4); }
static void rec_u64(Rec* r, uint64_t v) { tok_bytes_append(&r->p, &r->n, &r->cap, &v, 8); }
static void rec_str(Rec* r, const void* s, size_t n) {
    rec_u64(r, n);
    tok_bytes_append(&r->p, &r->n, &r->cap, s, n);
}
static void rec_key(Rec* r, const char* key, uint32_t type) {
    rec_str(r, key, strlen(key));
    rec_u32(r, type);
}

void tokenizer_gguf_records(const Tokenizer* t, int32_t n_vocab, GgufTokenizer* out) {
    // ids past the tokenizer's up to the model's vocabulary are holes too (llama.cpp takes the
    // vocabulary size from the token list, and it must match the embedding's rows)
    const int32_t n = n_vocab > t->n_vocab ? n_vocab : t->n_vocab;
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
    rec_u64(&r, (uint64_t)n);
    uint8_t* text = NULL;
    size_t text_n = 0, text_cap = 0;
    for (int32_t i = 0; i < n; i++) {
        text_n = 0;
        if (i >= t->n_vocab || t->kind[i] == TOK_KIND_NONE) {
            char pad[32];
            int k = snprintf(pad, sizeof pad, "[PAD%d]", i);
            tok_bytes_append(&text, &text_n, &text_cap, pad, (size_t)k);
        } else {
            token_text(t, i, &text, &text_n, &text_cap);
        }
        rec_str(&r, text, text_n);
    }
    rec_key(&r, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY);
    rec_u32(&r, GGUF_TYPE_INT32);
    rec_u64(&r, (uint64_t)n);
    for (int32_t i = 0; i < n; i++) {
        uint32_t type = i >= t->n_vocab                ? GGUF_TOK_UNUSED
                        : t->kind[i] == TOK_KIND_SPECIAL ? GGUF_TOK_CONTROL
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
        tok_bytes_append(&text, &text_n, &text_cap, " ", 1);
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
    tok_bytes_append(&r.p, &r.n, &r.cap, &(uint8_t){(uint8_t)add_bos}, 1);
    rec_key(&r, "tokenizer.ggml.add_eos_token", GGUF_TYPE_BOOL);
    tok_bytes_append(&r.p, &r.n, &r.cap, &(uint8_t){(uint8_t)add_eos}, 1);
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
    AtomicFile af;  // written as a whole or not at all; stdio errors surface at the commit
    if (atomic_file_open(&af, path, err) != 0) return -1;
    FILE* f = af.f;
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
        json_put_string(f, (const uint8_t*)tok_split_regex[t->split], strlen(tok_split_regex[t->split]));
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
    return atomic_file_commit(&af, err);
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
    tok_bytes_append(&cfg, &n, &cap, head0, strlen(head0));
    for (int k = 0; k < 4; k++) {
        char head[64];
        int hn = snprintf(head, sizeof head, ",\n  \"%s\": ", keys[k]);
        tok_bytes_append(&cfg, &n, &cap, head, (size_t)hn);
        if (ids[k] < 0) {
            tok_bytes_append(&cfg, &n, &cap, "null", 4);
            continue;
        }
        text_n = 0;
        token_text(t, ids[k], &text, &text_n, &text_cap);
        tok_bytes_reserve(&text, &text_n, &text_cap, 1);
        text[text_n] = '\0';
        size_t need = 6 * text_n + 3;
        tok_bytes_reserve(&cfg, &n, &cap, need);
        n += json_escape((char*)cfg + n, need, (const char*)text);
    }
    tok_bytes_append(&cfg, &n, &cap, "\n}\n", 3);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    int rc = file_write_atomic(path, cfg, n, err);
    free(cfg);
    free(text);
    return rc;
}
