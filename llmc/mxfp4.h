/*
 * mxfp4.h — GPT-OSS's MXFP4 expert weights as the HF hub stores them (transformers
 * integrations/mxfp4.py, docs/FORMATS.md §8.2), dequantised for full training.
 *
 * `name_blocks` U8 [E, rows, G, 16] and `name_scales` U8 [E, rows, G]: group g of a row holds 32
 * E2M1 values, byte b's low nibble is element 2b and its high nibble element 2b+1, each times
 * 2^(scale - 127). Dequantised to [E, rows, 32 G] and then transposed to the parameter layout
 * [E, 32 G, rows] (gate_up_proj [E, C, 2F], down_proj [E, F, C]). Not ggml's MXFP4 nibble order.
 */
#ifndef LLMC_MXFP4_H
#define LLMC_MXFP4_H

#include <stdint.h>

#include "safetensors.h"

// The E2M1 value of a 4-bit code.
float mxfp4_value(unsigned code);
// out [E, 32 G, rows] from blocks [E, rows, G, 16] and scales [E, rows, G].
void mxfp4_dequant_transposed(const uint8_t* blocks, const uint8_t* scales, int64_t E,
                              int64_t rows, int64_t G, float* out);
// The HF checkpoint tensor `name` ([E, cols, rows] float) from name_blocks / name_scales of ck:
// 1 = present and written to out (numel must match), 0 = the pair is absent, -1 + err if it is
// present but malformed (dtype, shapes).
int mxfp4_load(const StCheckpoint* ck, const char* name, int64_t E, int64_t cols, int64_t rows,
               float* out, char* err);
// 1 if `name` is the _blocks or _scales half of an MXFP4 pair whose base name is `base`.
int mxfp4_is_part_of(const char* name, const char* base);

#endif  // LLMC_MXFP4_H
