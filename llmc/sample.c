/*
 * sample.c — temperature sampling over a sliding window, printed as it goes (decoded by the
 * model's tokenizer when it has one).
 */
#include "sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "common.h"
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

// Sample from softmax(logits / temperature); temperature 0 = greedy.
static int sample_token(const float* logits, int V, float temperature, Rng* rng) {
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (temperature <= 0.0f) return best;
    double sum = 0.0;
    for (int v = 0; v < V; v++) sum += exp((logits[v] - logits[best]) / temperature);
    double r = rng_uniform(rng) * sum;
    for (int v = 0; v < V; v++) {
        r -= exp((logits[v] - logits[best]) / temperature);
        if (r <= 0.0) return v;
    }
    return best;
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
    for (int i = 0; i < n_tokens; i++) {
        int ctx = n < window ? n : window;  // sliding window of at most T tokens
        plain_logits_last(p, toks + n - ctx, ctx, logits);
        toks[n] = sample_token(logits, c->V, temperature, &rng);
        print_token(c, tok, toks[n++]);
    }
    printf("\n");
    free(toks);
    free(logits);
}
