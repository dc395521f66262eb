/*
 * crc32c.h — CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of checkpoint
 * files (checkpoint.c records one per file in the DONE marker; --resume verifies them).
 *
 * Two implementations with the same results: the SSE4.2 crc32 instruction where the CPU has it
 * (checked at run time; about 8 GB/s on one core), and slice-by-8 tables elsewhere (about
 * 2 GB/s). Values chain: crc32c_update(crc32c_update(0, a, n), b, m) is the CRC of a followed by
 * b, and the CRC of "123456789" is 0xE3069283.
 */
#ifndef LLMC_CRC32C_H
#define LLMC_CRC32C_H

#include <stddef.h>
#include <stdint.h>

// The CRC of the bytes so far (0 for none) extended by n more bytes at data.
uint32_t crc32c_update(uint32_t crc, const void* data, size_t n);
// The same through the portable tables, whatever the CPU (tests compare both paths).
uint32_t crc32c_update_portable(uint32_t crc, const void* data, size_t n);
// 1 when crc32c_update uses the SSE4.2 instruction on this CPU.
int crc32c_hardware(void);

static inline uint32_t crc32c(const void* data, size_t n) { return crc32c_update(0, data, n); }

#endif  // LLMC_CRC32C_H
