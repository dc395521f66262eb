/*
 * dequant.h — dequantisation of ggml blocks to bf16 on the GPU (kernels/dequant.cu): a frozen
 * LoRA base held in Q8_0, Q4_K or MXFP4 (llmc/quant.h) is uploaded as its blocks and expanded
 * into the stage's parameter slot per stage. The C interface the op table (ops_cuda.cu) and the
 * lab (dev/cuda/dequant.cu) call; the variant numbers the lab selects.
 *
 * Semantics: out[i] = bf16(the fp32 value ggml's dequantize_row_* gives element i), rounded to
 * nearest even once. Every fp32 product of the formats is exact (an fp16 scale times at most
 * 8-bit integers), so the result is bit-identical to bf16(ggml_dequantize) on the CPU.
 */
#ifndef KERNELS_DEQUANT_H
#define KERNELS_DEQUANT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Variants: 0 lets the launcher pick (3, or 1 where out is not 16-byte aligned).
enum {
    DEQUANT_AUTO = 0,
    DEQUANT_NAIVE = 1,     // one thread per element, its block's header read per element
    DEQUANT_SUBBLOCK = 2,  // one thread per 32-element (sub-)block: header once, 4 x 16-byte stores
    DEQUANT_TILE = 3,      // a warp per tile of blocks: 16-byte loads, coalesced 16-byte stores
    DEQUANT_VARIANTS = 3
};

// out (n) bf16 = blocks (n elements of ggml `type`: GGML_TYPE_Q8_0 = 8, Q4_K = 12, MXFP4 = 39;
// n a multiple of the block), on `stream` (a cudaStream_t). Fatal on another type.
void cuda_dequantize(void* stream, int n_sms, int variant, void* out, const void* blocks, int type,
                     size_t n);

#ifdef __cplusplus
}
#endif

#endif  // KERNELS_DEQUANT_H
