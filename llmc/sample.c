/*
 * sample.c — temperature sampling over a sliding window, printed as it goes.
 */
#include "sample.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "rng.h"

// Printable for byte-level vocabularies: EOT as <|eot|>, newlines kept, other non-ASCII bytes
// escaped.
static void print_token(const ModelConfig* c, int tok) {
    if (c->V == 256) {
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
                  uint32_t seed) {
    const ModelConfig* c = &p->m->cfg;
    int cap = n_tokens + (int)strlen(prompt) + 1;
    int32_t* toks = malloc_check((size_t)cap * sizeof(int32_t));
    float* logits = malloc_check((size_t)c->V * sizeof(float));
    Rng rng;
    rng_seed(&rng, seed + 17);  // apart from the init's stream
    int n = 0;
    if (c->bos_id >= 0) toks[n++] = c->bos_id;
    if (c->V == 256)
        for (const char* s = prompt; *s; s++) toks[n++] = (unsigned char)*s;
    if (n == 0) toks[n++] = 0;
    printf("sample (%d tokens, temperature %g):\n", n_tokens, (double)temperature);
    for (int i = 0; i < n; i++) print_token(c, toks[i]);
    for (int i = 0; i < n_tokens; i++) {
        int ctx = n < window ? n : window;  // sliding window of at most T tokens
        plain_logits_last(p, toks + n - ctx, ctx, logits);
        toks[n] = sample_token(logits, c->V, temperature, &rng);
        print_token(c, toks[n++]);
    }
    printf("\n");
    free(toks);
    free(logits);
}
