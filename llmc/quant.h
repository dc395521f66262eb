/*
 * quant.h — the frozen base in a block format (--base-dtype, LoRA runs): which tensors of the
 * table are held quantised (TensorDesc.qtype, a per-tensor storage format), ggml's reference
 * quantisers for Q8_0, Q4_K and MXFP4 (the same operations in the same order as ggml-quants.c's
 * quantize_row_*_ref, so the blocks are what gguf-py / llama-quantize write), the Store's block
 * copy of those tensors, and the byte counts the engine's uploads, the planner and the memory
 * estimate use.
 *
 * A quantised tensor is held on the host as its blocks (Store.qblocks), uploaded as its blocks
 * and dequantised on the device (ops->dequantize) into the stage's parameter slot, in the
 * compute dtype. The Store's fp32 slab holds the dequantised values of those blocks (what every
 * path computes with: the plain trainer, exports, --dump-state), so a run on a q4_k base is the
 * run on the weights dequant(quant(W)), bit for bit on the CPU. A streamed base
 * (store_create_streamed: the engine, nothing reading the base in fp32) has the blocks alone:
 * the random init and the loader quantise each tensor as they make it (the same blocks).
 *
 * Which tensors: the frozen linear weights that adapters sit on (q, k, v, o, gate, up, down of
 * the targets) and the MoE experts. Norms, embeddings, the LM head, biases, routers that carry no
 * adapter and the adapters themselves stay in the compute dtype. Blocks run along a row (the
 * tensor's last, contiguous dimension), as in GGUF: that width must be a multiple of the block.
 */
#ifndef LLMC_QUANT_H
#define LLMC_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "tensor.h"

// --base-dtype
typedef enum {
    BASE_DTYPE_BF16 = 0,  // the compute dtype (no block format): today's behaviour
    BASE_DTYPE_Q8_0,
    BASE_DTYPE_Q4_K,
    BASE_DTYPE_MXFP4,
    BASE_DTYPE_KEEP       // as the GGUF stores each tensor (Q8_0 / Q4_K / MXFP4; others bf16)
} BaseDtype;

// "bf16" / "q8_0" / "q4_k" / "mxfp4" / "keep" (case-insensitive). 0, or -1 with a one-line err.
int quant_parse_base_dtype(const char* s, BaseDtype* out, char* err);
const char* quant_base_dtype_name(BaseDtype d);
// A block format the engine can hold and dequantise on a device: GGML_TYPE_Q8_0, _Q4_K, _MXFP4.
int quant_type_supported(int type);
// "q8_0", "q4_k", "mxfp4" ("bf16" for 0).
const char* quant_type_name(int type);
// Bytes of n elements of tensor d as held on the host and uploaded: its blocks, or n * ab.
size_t quant_tensor_bytes(const TensorDesc* d, size_t ab);

// ----------------------------------------------------------------------------
// the table

// Mark the tensors held in a block format (TensorDesc.qtype): for q8_0 / q4_k / mxfp4 that
// format; keep: the GGUF's type of each tensor where it is one of those (gguf may be NULL: keep
// then refuses, the model not being a GGUF). Refuses (-1, one-line err) without LoRA and for a
// tensor whose width is not a multiple of the format's block. bf16: nothing to do.
int quant_table_set(TensorTable* tt, BaseDtype dtype, const GgufFile* gguf, const ModelConfig* cfg,
                    char* err);
// Number of tensors held in a block format.
int quant_table_count(const TensorTable* tt);
// Layer l's frozen head as held and uploaded (quantised tensors as blocks, the rest in ab bytes
// per element), and its quantised tensors' blocks alone (the device's staging bytes).
size_t quant_layer_head_bytes(const TensorTable* tt, int l, size_t ab);
size_t quant_layer_block_bytes(const TensorTable* tt, int l);
// The same summed over the model.
double quant_head_bytes(const TensorTable* tt, size_t ab);

// ----------------------------------------------------------------------------
// blocks

// n elements of x (a multiple of the type's block) -> y, ggml's reference quantiser.
void quant_quantize(int type, const float* x, uint8_t* y, int64_t n);
// n elements of blocks y -> fp32 x (ggml_dequantize).
void quant_dequantize(int type, const uint8_t* y, float* x, int64_t n);

// Tensor d's blocks from all of its fp32 values w: the GGUF's own blocks where keep finds them
// there (as store_quantize_base does; gguf NULL: quantised), else ggml's quantiser.
void quant_tensor_blocks(const TensorDesc* d, const float* w, uint8_t* blocks,
                         const GgufFile* gguf, const ModelConfig* cfg);


// ----------------------------------------------------------------------------
// a streamed base (store_create_streamed: the block-format tensors never held in fp32)

// The fp32 bytes the block-format tensors would take (what a streamed base does not hold).
double quant_fp32_bytes(const TensorTable* tt);
// The fp32 staging the streamed init or load holds at once with `threads` threads: one chunk
// of the random init each, or (from_file) one tensor's values each. bf16: every frozen tensor is
// streamed (Store.base16), not only the block-format ones.
double quant_stream_staging_bytes(const TensorTable* tt, int threads, int from_file, int bf16);

#endif  // LLMC_QUANT_H
