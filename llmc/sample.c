/*
 * sample.c — --sample-tokens: the generation engine (generate.h) on the plain path's weights,
 * then, past the context window, a sliding window; printed as it goes (decoded by the model's
 * tokenizer when it has one).
 */
#include "sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "common.h"
#include "generate.h"
#include "rng.h"

// A token's text as the tokenizer decodes it: bytes as they are (a character split over two
// tokens comes together on the terminal), control characters but newline and tab escaped; ids
// past the tokenizer's vocabulary (the model's padding rows) as [id].
static void print_piece(const Tokenizer* t, int id) {
    size_t n = 0;
    const uint8_t* s = tokenizer_piece(t, id, &n);
    if (!s) {
        printf("[%d]", id);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if ((s[i] < 0x20 && s[i] != '\n' && s[i] != '\t') || s[i] == 0x7f) printf("\\x%02x", s[i]);
        else putchar(s[i]);
    }
}

// One token as printed: through the tokenizer when the model has one; else byte-level
// vocabularies as text (EOT as <|eot|>, newlines kept, other non-ASCII bytes escaped), and other
// vocabularies as ids.
static void print_token(const ModelConfig* c, const Tokenizer* t, int tok) {
    if (t) {
        print_piece(t, tok);
    } else if (c->V == 256) {
        if (tok == c->bos_id) printf("<|eot|>");
        else if (tok == '\n') printf("\n");
        else if (tok >= 32 && tok < 127) putchar(tok);
        else printf("\\x%02x", tok);
    } else {
        printf("%d ", tok);
    }
}

void sample_print(Plain* p, int window, int n_tokens, const char* prompt, float temperature,
                  uint32_t seed, const Tokenizer* tok) {
    const ModelConfig* c = &p->m->cfg;
    // the prompt's ids: at most one per byte, and a document token
    int cap = n_tokens + (int)strlen(prompt) + 2;
    int32_t* toks = malloc_named((size_t)cap * sizeof(int32_t), "the sampled tokens");
    float* logits = malloc_named((size_t)c->V * sizeof(float), "the sampler's logits (V floats)");
    Rng rng;
    rng_seed(&rng, seed + 17);  // apart from the init's stream
    int n = 0;
    if (tok) {
        const int32_t doc = tokenizer_document_token(tok);
        if (doc >= 0) toks[n++] = doc;
        TokIds ids = {0};
        tokenizer_encode_once(tok, prompt, strlen(prompt), 0, &ids);
        memcpy(toks + n, ids.ids, ids.n * sizeof(int32_t));
        n += (int)ids.n;
        tokenizer_ids_free(&ids);
    } else {
        if (c->bos_id >= 0) toks[n++] = c->bos_id;
        if (c->V == 256)
            for (const char* s = prompt; *s; s++) toks[n++] = (unsigned char)*s;
        else if (prompt[0])
            printf("note: --prompt needs a tokenizer, and the model has none: sampling without it\n");
    }
    if (n == 0) toks[n++] = 0;
    printf("sample (%d tokens, temperature %g):\n", n_tokens, (double)temperature);
    for (int i = 0; i < n; i++) print_token(c, tok, toks[i]);
    // While the text fits the window: the generation engine (KV cache, one decode step per
    // token) on the plain path's weights. Past the window, or on a backend without the decode
    // op: a forward over the last `window` tokens per token (positions restart at 0 there, as
    // training saw them).
    Generator g;
    char err[ERR_LEN];
    const GenOptions go = {.max_seqs = 1, .max_len = window, .temperature = temperature,
                           .top_k = 0, .top_p = 1.0f};
    int done = 0;
    if (n < window && gen_create(&g, p->m, p->ops, p->ctx, &go, 0, err) == 0) {
        float* lp = malloc_named((size_t)window * 2 * sizeof(float), "the sampler's log-probs");
        int32_t* seq = malloc_named((size_t)window * sizeof(int32_t), "the sampled sequence");
        memcpy(seq, toks, (size_t)n * sizeof(int32_t));
        GenSeq gs = {.tokens = seq, .logp = lp, .logp_full = lp + window, .prompt_len = n,
                     .max_new = imin(n_tokens, window - n), .stop_a = -1, .stop_b = -1,
                     .rng = rng};
        gen_borrow_weights(&g, p->dparam, 0);
        gen_run(&g, &gs, 1, 1);
        rng = gs.rng;
        done = gs.len - n;
        memcpy(toks + n, seq + n, (size_t)done * sizeof(int32_t));
        for (int i = 0; i < done; i++) print_token(c, tok, toks[n + i]);
        n += done;
        gen_free(&g);
        free(lp);
        free(seq);
    }
    Generator one = {.m = p->m, .o = go};  // gen_sample's view: the model and the options
    for (int i = done; i < n_tokens; i++) {
        int ctx = n < window ? n : window;  // sliding window of at most T tokens
        plain_logits_last(p, toks + n - ctx, ctx, logits);
        float lp, lpf;
        one.probs = NULL;
        toks[n] = gen_sample(&one, logits, &rng, &lp, &lpf);
        print_token(c, tok, toks[n++]);
    }
    printf("\n");
    free(toks);
    free(logits);
}
