/*
 * fuzz_tokenizer.h — the entry point of the tokenizer fuzz target (dev/fuzz/fuzz_tokenizer.c,
 * `make fuzz`), shared with the fuzz smoke test of `make test` (tokenizer_fuzz_smoke in
 * llmc/tests/test_tokenizer.c).
 *
 * Input: a tokenizer.json, then optionally a NUL byte and text to encode (without a NUL the
 * tokenizer.json's own bytes are encoded). A tokenizer that loads must encode the text (any
 * bytes), in every flag combination, and decode it back exactly: to the text itself, or its NFC
 * form when the tokenizer normalises — whenever nothing makes the round trip lossy (a byte with
 * no token, added tokens that swallow whitespace, a prefix space). A refusal must be a one-line
 * message starting with the name. Static inline: included once per program.
 */
#ifndef DEV_FUZZ_FUZZ_TOKENIZER_H
#define DEV_FUZZ_FUZZ_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../llmc/common.h"
#include "../../llmc/tokenizer.h"
#include "../../llmc/unicode.h"

static inline void fuzz_tokenizer_fail(const char* what) {
    fprintf(stderr, "fuzz_tokenizer: %s\n", what);
    abort();
}

static inline int fuzz_tokenizer(const uint8_t* data, size_t size) {
    const uint8_t* nul = memchr(data, 0, size);
    size_t json_len = nul ? (size_t)(nul - data) : size;
    const uint8_t* text = nul ? nul + 1 : data;
    size_t text_len = nul ? size - json_len - 1 : size;
    Tokenizer tok;
    char err[ERR_LEN] = "";
    if (tokenizer_load_json(&tok, (const char*)data, json_len, "fuzz.json", err) != 0) {
        if (strncmp(err, "fuzz.json: ", 11) != 0 || strchr(err, '\n'))
            fuzz_tokenizer_fail("bad error message");
        return 0;
    }
    int lossless = !tok.add_prefix_space;
    for (int b = 0; b < 256; b++) lossless &= tok.byte_id[b] >= 0;
    for (int i = 0; i < tok.n_added; i++) {
        // an added token spelled in the byte-level alphabet decodes to other bytes (as in HF)
        size_t pn;
        const uint8_t* piece = tokenizer_piece(&tok, tok.added[i].id, &pn);
        lossless &= !tok.added[i].lstrip && !tok.added[i].rstrip && pn == tok.added[i].len &&
                    memcmp(piece, tok.added_text + tok.added[i].off, pn) == 0;
    }
    TokEncoder e;
    tokenizer_encoder_init(&e, &tok);
    for (int flags = 0; flags < 4; flags++) {
        TokIds ids = {0};
        tokenizer_encode(&e, text, text_len, flags, &ids);
        uint8_t* out = NULL;
        size_t n = 0, cap = 0;
        if (tokenizer_decode(&tok, ids.ids, ids.n, 0, &out, &n, &cap, err) != 0)
            fuzz_tokenizer_fail("an encoded id does not decode");
        if (lossless && !(flags & TOK_ENCODE_ADD_SPECIAL)) {
            uint8_t* norm = NULL;
            size_t nn = 0, ncap = 0;
            if (tok.nfc) unicode_nfc(text, text_len, &norm, &nn, &ncap);
            const uint8_t* ref = tok.nfc ? norm : text;
            size_t rn = tok.nfc ? nn : text_len;
            if (n != rn || (rn && memcmp(out, ref, rn) != 0)) fuzz_tokenizer_fail("no round trip");
            free(norm);
        }
        free(out);
        tokenizer_ids_free(&ids);
    }
    tokenizer_encoder_free(&e);
    tokenizer_free(&tok);
    return 1;
}

#endif  // DEV_FUZZ_FUZZ_TOKENIZER_H
