/*
 * rng.h — Mersenne Twister (mt19937) random numbers: seeded model init, data shuffling, sampling.
 *
 * The whole generator state is the struct, so saving/restoring it (checkpoints, loader resume)
 * is a plain copy. Same seed, same sequence on every machine.
 */
#ifndef LLMC_RNG_H
#define LLMC_RNG_H

#include <stdint.h>

typedef struct Rng {
    uint32_t mt[624];
    int index;
    int has_spare;  // Box-Muller produces two normals; the second is kept here
    float spare;
} Rng;

void rng_seed(Rng* r, uint32_t seed);
uint32_t rng_u32(Rng* r);
// Uniform in [0, n) without modulo bias. n > 0.
uint64_t rng_below(Rng* r, uint64_t n);
// Uniform float in [0, 1).
float rng_uniform(Rng* r);
// Takes back the last draw of one word (rng_u32, rng_uniform): the next draw repeats it and the
// stream goes on as it would have. (A draw that regenerated the words leaves them regenerated,
// at their start: the same stream.) Only after a draw.
void rng_unget_u32(Rng* r);
// Standard normal (Box-Muller).
float rng_normal(Rng* r);
// Fisher-Yates shuffle of an index array.
void rng_shuffle_u32(Rng* r, uint32_t* a, uint64_t n);
void rng_shuffle_u64(Rng* r, uint64_t* a, uint64_t n);

#endif  // LLMC_RNG_H
