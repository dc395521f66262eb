/*
 * crc32c.c — CRC-32C: the SSE4.2 instruction when the CPU has it, slice-by-8 tables otherwise.
 *
 * The tables are computed once (pthread_once) into static storage and never written again: they
 * are constants that would take 2048 literal words to spell out, not state.
 */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#define CRC32C_POLY 0x82F63B78u  // Castagnoli, bit-reflected

// ----------------------------------------------------------------------------
// slice-by-8 tables

// table[0][b]: the CRC of byte b; table[k][b]: the same byte followed by k zero bytes, so eight
// lookups advance the CRC over eight bytes at once.
static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_build(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1u)));
        table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (uint32_t b = 0; b < 256; b++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xff];
}

// Little-endian 32-bit load whatever the host's byte order (compiles to one load on x86 / ARM).
// Its own, not common.h's load_le32: this file is a leaf that common.c's file writer calls.
static inline uint32_t crc_load32(const uint8_t* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint32_t crc32c_update_portable(uint32_t crc, const void* data, size_t n) {
    if (pthread_once(&table_once, table_build) != 0) table_build();  // (cannot fail on Linux)
    const uint8_t* p = data;
    uint32_t c = ~crc;
    for (; n >= 8; n -= 8, p += 8) {
        const uint32_t lo = c ^ crc_load32(p), hi = crc_load32(p + 4);
        c = table[7][lo & 0xff] ^ table[6][(lo >> 8) & 0xff] ^ table[5][(lo >> 16) & 0xff] ^
            table[4][lo >> 24] ^ table[3][hi & 0xff] ^ table[2][(hi >> 8) & 0xff] ^
            table[1][(hi >> 16) & 0xff] ^ table[0][hi >> 24];
    }
    for (; n > 0; n--, p++) c = (c >> 8) ^ table[0][(c ^ *p) & 0xff];
    return ~c;
}

// ----------------------------------------------------------------------------
// SSE4.2

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t update_sse42(uint32_t crc, const void* data,
                                                                size_t n) {
    const uint8_t* p = data;
    uint64_t c = ~crc;
    for (; n > 0 && ((uintptr_t)p & 7); n--, p++) c = _mm_crc32_u8((uint32_t)c, *p);
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    for (; n > 0; n--, p++) c = _mm_crc32_u8((uint32_t)c, *p);
    return ~(uint32_t)c;
}
#endif

int crc32c_hardware(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    return 0;
#endif
}

uint32_t crc32c_update(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
    if (crc32c_hardware()) return update_sse42(crc, data, n);
#endif
    return crc32c_update_portable(crc, data, n);
}
