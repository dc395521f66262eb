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

#endif  // LLMC_LOADER_H
