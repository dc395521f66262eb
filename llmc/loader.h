/*
 * loader.h — checkpoint files -> the host layer store: every tensor the store owns, found by its
 * HF name in a safetensors checkpoint or by its GGUF name in a GGUF file, shape-checked,
 * converted (or dequantised) to fp32 straight into the parameter slabs.
 *
 * The loader depends on the store and on the format readers; the store knows neither.
 * Conversions run in parallel, one task per tensor; the error reported is always the first
 * failing tensor in table order, whatever the number of threads.
 */
#ifndef LLMC_LOADER_H
#define LLMC_LOADER_H

#include "config.h"
#include "gguf.h"
#include "safetensors.h"
#include "store.h"

// Load every owned tensor by HF name from a checkpoint, checking shapes, through the table's HF
// view (per-expert or fused MoE experts; GPT-OSS MXFP4 _blocks/_scales pairs dequantised); extra
// tensors in the checkpoint are reported in *n_unused (a tied model's lm_head.weight is accepted
// if equal).
int loader_load_safetensors(Store* s, const StCheckpoint* ck, int* n_unused, char* err);
// The same from a GGUF file whose metadata gave cfg: every owned tensor by its GGUF name, shapes
// checked (ne reversed), dequantised, LLaMA q/k rows un-permuted (gguf_read_hf_tensor).
// rope_freqs.weight is consumed by the config; other extra tensors count in *n_unused.
int loader_load_gguf(Store* s, const GgufFile* f, const ModelConfig* cfg, int* n_unused,
                     char* err);

// A streamed base (store_create_streamed) stages at most this much fp32 per loader thread for a
// GGUF tensor that can be read in slices (whole rows or experts; loader.c: load_gguf_sliced),
// rather than the whole tensor (one Qwen3-235B expert tensor: 6 GiB).
#define LOADER_SLICE_BYTES (256.0 * 1048576.0)
// The fp32 staging one loader thread holds for a streamed tensor d of a GGUF (the estimate's:
// at most, where the file's types are unknown): its slice, else the whole tensor (twice over
// where it is rearranged, permuted, in two parts or kept as the GGUF's blocks).
double loader_gguf_staging_bytes(const TensorDesc* d, const ModelConfig* cfg, double slice_bytes);
// loader_load_gguf with another slice size (tests: small slices against the whole reads);
// *n_sliced (may be NULL): how many tensors were read in slices.
int loader_load_gguf_sliced(Store* s, const GgufFile* f, const ModelConfig* cfg,
                            double slice_bytes, int* n_unused, int* n_sliced, char* err);

// --mmap-base: point the Store's map_src / map_type at every frozen tensor where the open
// checkpoint (ck or gguf, the other NULL) holds it as the table lays it out (one tensor of its
// shape; safetensors F32 / F16 / BF16; GGUF F32 / F16 / BF16, or the tensor's own block type
// when --base-dtype keeps it), and mark them released: the loader then skips them and the
// engine uploads them from the mapping. -1 with a one-line err for a frozen tensor that needs a
// conversion the upload cannot make (a layout change on load: LLaMA's permuted q/k, fused or
// split experts, MXFP4 pairs; another dtype; a block format the checkpoint does not have).
int loader_map_base(Store* s, const StCheckpoint* ck, const GgufFile* gguf,
                    const ModelConfig* cfg, char* err);

#endif  // LLMC_LOADER_H
