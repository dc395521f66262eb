/*
 * rng.c — mt19937 (Matsumoto & Nishimura 1998) with the standard 32-bit tempering.
 */
#include "rng.h"

#include <math.h>

#include "common.h"

void rng_seed(Rng* r, uint32_t seed) {
    r->mt[0] = seed;
    for (int i = 1; i < 624; i++)
        r->mt[i] = 1812433253u * (r->mt[i - 1] ^ (r->mt[i - 1] >> 30)) + (uint32_t)i;
    r->index = 624;
    r->has_spare = 0;
    r->spare = 0.0f;
}

static void rng_twist(Rng* r) {
    for (int i = 0; i < 624; i++) {
        uint32_t y = (r->mt[i] & 0x80000000u) | (r->mt[(i + 1) % 624] & 0x7fffffffu);
        uint32_t v = r->mt[(i + 397) % 624] ^ (y >> 1);
        if (y & 1u) v ^= 0x9908b0dfu;
        r->mt[i] = v;
    }
    r->index = 0;
}

uint32_t rng_u32(Rng* r) {
    if (r->index >= 624) rng_twist(r);
    uint32_t y = r->mt[r->index++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

static uint64_t rng_u64(Rng* r) { return ((uint64_t)rng_u32(r) << 32) | rng_u32(r); }

uint64_t rng_below(Rng* r, uint64_t n) {
    if (n <= 1) return 0;
    // rejection sampling: draw from [0, limit) where limit is a multiple of n
    if (n <= 0xffffffffu) {
        uint32_t limit = (uint32_t)(0x100000000ull - (0x100000000ull % n));
        for (;;) {
            uint32_t x = rng_u32(r);
            if (limit == 0 || x < limit) return x % n;
        }
    }
    uint64_t limit = UINT64_MAX - (UINT64_MAX % n);
    for (;;) {
        uint64_t x = rng_u64(r);
        if (x < limit) return x % n;
    }
}

float rng_uniform(Rng* r) { return (float)(rng_u32(r) >> 8) * (1.0f / 16777216.0f); }

void rng_unget_u32(Rng* r) {
    if (r->index < 1 || r->index > 624) fatal("internal: rng_unget_u32 with no draw to take back");
    r->index--;
}

float rng_normal(Rng* r) {
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u1 = ((double)rng_u32(r) + 1.0) / 4294967297.0;  // (0, 1]
    double u2 = (double)rng_u32(r) / 4294967296.0;
    double mag = sqrt(-2.0 * log(u1));
    r->spare = (float)(mag * sin(2.0 * M_PI * u2));
    r->has_spare = 1;
    return (float)(mag * cos(2.0 * M_PI * u2));
}

void rng_shuffle_u32(Rng* r, uint32_t* a, uint64_t n) {
    for (uint64_t i = n; i > 1; i--) {
        uint64_t j = rng_below(r, i);
        uint32_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

void rng_shuffle_u64(Rng* r, uint64_t* a, uint64_t n) {
    for (uint64_t i = n; i > 1; i--) {
        uint64_t j = rng_below(r, i);
        uint64_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}
