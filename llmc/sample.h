/*
 * sample.h — text from the trained model at the end of a run: a prompt, then tokens drawn one at
 * a time from softmax(logits / temperature) by the generation engine (generate.h: KV cache, one
 * decode step per token) while the text fits the window of T tokens; past it, each token is a
 * forward over the last T tokens (a sliding window, as before the engine). A model with a tokenizer
 * encodes the prompt with it and prints decoded text; byte-level vocabularies (V 256) without
 * one take the prompt's bytes and print them as text; other models print token ids.
 */
#ifndef LLMC_SAMPLE_H
#define LLMC_SAMPLE_H

#include <stdint.h>

#include "plain.h"
#include "tokenizer.h"

// Print "sample (N tokens, temperature X):", the prompt (EOT first where the model has one) and
// n_tokens sampled tokens; window: the longest context (<= the plain path's T); temperature 0:
// greedy. seed: the run's --seed (the sampler draws from a stream of its own). tok: the model's
// tokenizer (NULL: none); with one the prompt starts with its document token, as the shards of
// --tokenize do.
void sample_print(Plain* p, int window, int n_tokens, const char* prompt, float temperature,
                  uint32_t seed, const Tokenizer* tok);

#endif  // LLMC_SAMPLE_H
