/*
 * sample.h — text from the trained model at the end of a run: a prompt, then tokens drawn one at
 * a time from softmax(logits / temperature) over a sliding window of the last T tokens, on the
 * plain path (no KV cache: each token is a forward over the window). Byte-level vocabularies
 * (V 256) print as text, others as token ids.
 */
#ifndef LLMC_SAMPLE_H
#define LLMC_SAMPLE_H

#include <stdint.h>

#include "plain.h"

// Print "sample (N tokens, temperature X):", the prompt (EOT first where the model has one) and
// n_tokens sampled tokens; window: the longest context (<= the plain path's T); temperature 0:
// greedy. seed: the run's --seed (the sampler draws from a stream of its own).
void sample_print(Plain* p, int window, int n_tokens, const char* prompt, float temperature,
                  uint32_t seed);

#endif  // LLMC_SAMPLE_H
