/*
 * tokenizer_internal.h — private to the tokenizer's three files: tokenizer.c (splitting, BPE,
 * encoding, decoding), tokenizer_load.c (reading tokenizer.json and GGUF metadata, building the
 * tables) and tokenizer_export.c (the GGUF records and tokenizer.json writers).
 *
 * What they share: the hashes of the vocabulary and merge tables (the loader fills the tables,
 * the encoder reads them), growing byte buffers, the byte-level alphabet, the split regexes as
 * tokenizer.json spells them and GGUF's token types. The hot lookups are static inline so the
 * encoder keeps them inlined across the file split.
 */
#ifndef LLMC_TOKENIZER_INTERNAL_H
#define LLMC_TOKENIZER_INTERNAL_H

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "tokenizer.h"

// The split regexes as tokenizer.json writes them, by TokSplit (tokenizer_load.c): the loader
// recognises them, the writer writes them back.
extern const char* const tok_split_regex[3];

// GGUF token types (llama.cpp's llama_token_type)
enum { GGUF_TOK_NORMAL = 1, GGUF_TOK_UNKNOWN = 2, GGUF_TOK_CONTROL = 3, GGUF_TOK_USER = 4,
       GGUF_TOK_UNUSED = 5, GGUF_TOK_BYTE = 6 };

// ----------------------------------------------------------------------------
// hashes and byte buffers

static inline uint64_t tok_hash_bytes(const uint8_t* p, size_t n) {
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

static inline uint64_t tok_hash_pair(int32_t a, int32_t b) {
    uint64_t h = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 31);
}

static inline void tok_bytes_reserve(uint8_t** p, size_t* len, size_t* cap, size_t more) {
    if (*len + more <= *cap) return;
    size_t want = *cap ? *cap : 256;
    while (want < *len + more) want *= 2;
    *p = realloc_check(*p, want);
    *cap = want;
}

static inline void tok_bytes_append(uint8_t** p, size_t* len, size_t* cap, const void* s, size_t n) {
    tok_bytes_reserve(p, len, cap, n);
    if (n) memcpy(*p + *len, s, n);
    *len += n;
}

// ----------------------------------------------------------------------------
// the byte-level alphabet (GPT-2's bytes_to_unicode): printable bytes stand for themselves, the
// other 68 (controls, space, DEL, no-break space, soft hyphen) for U+0100 + their rank

static inline uint32_t tok_bytelevel_char(uint8_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    if (b <= 0x20) return 256u + b;
    if (b <= 0xA0) return 256u + 33 + (b - 0x7Fu);
    return 256u + 67;  // 0xAD
}

static inline int tok_bytelevel_byte(uint32_t c) {
    if (c < 256) return ((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE) ? (int)c : -1;
    if (c >= 256 + 68) return -1;
    uint32_t k = c - 256;
    if (k < 33) return (int)k;
    if (k < 67) return (int)(0x7F + k - 33);
    return 0xAD;
}

// ----------------------------------------------------------------------------
// lookups

static inline int32_t tok_vocab_find(const Tokenizer* t, const uint8_t* s, size_t n) {
    if (!t->vocab_table) return -1;
    uint64_t h = tok_hash_bytes(s, n);
    uint32_t tag = (uint32_t)(h >> 32);
    for (uint64_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
        const TokVocabSlot* v = &t->vocab_table[i];
        if (v->id < 0) return -1;
        if (v->tag != tag) continue;  // the tag spares reading the pieces of other tokens
        uint64_t o = t->piece_off[v->id];
        if (t->piece_off[v->id + 1] - o == n && memcmp(t->pieces + o, s, n) == 0) return v->id;
    }
}

#endif  // LLMC_TOKENIZER_INTERNAL_H
