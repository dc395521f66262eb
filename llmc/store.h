/*
 * store.h — the host layer store: per layer of the layer sequence one contiguous slab each of
 * fp32 parameters (the optimizer's master copy), fp32 gradient accumulators, AdamW m and v.
 *
 * Parameter slabs hold the tensors a layer OWNS; gradient slabs the tensors it USES (tensor.h), so
 * a tied LM head has gradient space in the postfix and storage in the prefix; store_fold_tied_grads
 * sums such gradients into the owner before the optimizer step. Slabs are 64-byte aligned.
 * With LoRA (tensor.h) the gradient, m and v slabs hold the adapters only: the base is frozen,
 * at the head of each parameter slab (store_release_frozen gives its fp32 pages back where the
 * engine keeps the one copy of the base the run needs, in bf16).
 * The store knows no file format: loader.h fills it from checkpoints.
 */
#ifndef LLMC_STORE_H
#define LLMC_STORE_H

#include <stdint.h>

#include "adamw.h"
#include "config.h"
#include "gguf.h"
#include "tensor.h"
#include "threads.h"

typedef struct Store {
    const TensorTable* tt;
    int n_layers;
    float** param;  // (n_layers) fp32 parameter slabs (NULL when a layer owns nothing)
    float** grad;   // (n_layers) fp32 gradient slabs
    float** m;      // (n_layers) AdamW first moments (same layout as param)
    float** v;      // (n_layers) AdamW second moments
    int64_t step;   // optimizer steps taken
    int frozen_released;  // store_release_frozen: the frozen base's fp32 values are gone
    uint8_t** qblocks;    // (tt->n) the blocks of each tensor held in a block format
                          // (TensorDesc.qtype, quant.h), NULL for the others; NULL: none
    // --mmap-base (loader_map_base): where each frozen tensor lies in the mapped checkpoint, and
    // its ggml type there (F32, F16, BF16 or a block type); NULL: every tensor is held here. A
    // mapped tensor has no fp32 values in its slab (frozen_released is set).
    const void** map_src;  // (tt->n)
    int* map_type;         // (tt->n)
    // store_create_shard: layer l's AdamW m and v are this rank's in [state_lo[l], state_hi[l])
    // only (a checkpoint's state is loaded there only); NULL: everywhere
    int64_t* state_lo;  // (n_layers)
    int64_t* state_hi;  // (n_layers)
    // store_create_streamed: the block-format tensors (TensorDesc.qtype) were never held in fp32:
    // the random init and the loader quantise each one into its blocks as they produce it, and
    // their part of the frozen heads is never written (its pages never committed). Reading one
    // (store_param) is fatal; the other frozen tensors (norms, embeddings, LM head) are fp32 here,
    // or bf16 in base16.
    int base_streamed;
    // store_create_streamed with bf16 (the engine on GPUs, whose compute dtype is bf16): the
    // frozen tensors not held as blocks are held in bf16 only, at their fp32 offsets (element j of
    // base16[l] is the bf16 of element j of layer l's frozen head; the blocks' stretches are
    // never written): the engine uploads from this copy, so the host never holds the base in
    // fp32 (LoRA on a bf16 base: 2 B per base parameter, not 4 and then 2). NULL: fp32 slabs.
    uint16_t** base16;  // (n_layers) NULL for a layer without a frozen head
} Store;

void store_create(Store* s, const TensorTable* tt);
// The same, leaving the frozen heads of the parameter slabs untouched (--mmap-base: their pages
// are never written, so never committed; the base is read from the mapped checkpoint).
void store_create_unfrozen(Store* s, const TensorTable* tt);
// The same for a base that never exists in fp32 (LoRA on the engine, nothing reading the fp32
// base: trainer_streams_base): the frozen heads are not zeroed (store_init_random and the loader
// write every frozen tensor), each block-format tensor gets its (unwritten) blocks, and
// base_streamed is set. bf16: the other frozen tensors are held in base16 (bf16) rather than in
// the fp32 heads (the engine on bf16 devices).
void store_create_streamed(Store* s, const TensorTable* tt, int bf16);
// Bytes store_create_streamed(bf16 = 1) allocates for base16.
double store_base16_bytes(const TensorTable* tt);
// Tensor i is held streamed (blocks or base16), not in fp32: store_param of it is fatal, and
// store_stream_values is how its values get in.
int store_streams_tensor(const Store* s, int i);
// Elements [from, from + n) of tensor i (store_streams_tensor) from their fp32 values w: into its
// blocks (whole blocks only: -1 with a one-line err otherwise) or converted to bf16 into base16.
int store_stream_values(Store* s, int i, const float* w, int64_t from, int64_t n, char* err);
// The same for one rank of a data-parallel engine run (ZeRO-1): AdamW's m and v of layer l are
// zeroed only in [state_lo[l], state_hi[l]) (the rank's shard, dp_engine_state_ranges); the rest
// of those slabs is never touched, so fresh pages there take no memory unless something writes
// them (recycled pages, which the engine gives back). The ranges are kept (state_lo, state_hi):
// checkpoint_load_state reads a checkpoint's m and v into them only.
void store_create_shard(Store* s, const TensorTable* tt, const int64_t* state_lo,
                        const int64_t* state_hi);
// Host bytes store_create allocates for tt: the fp32 weights, m, v and gradient slabs.
double store_bytes(const TensorTable* tt);
// Of which the frozen tensors' fp32 weights (LoRA's base: each slab's head, the adapters last).
double store_frozen_bytes(const TensorTable* tt);
// Give the memory of every slab's frozen head back to the system (LoRA on bf16 devices: the
// engine uploads the base from its own bf16 copy, so the host holds the base once, in bf16).
// The trainable tails stay where they are; a frozen tensor's fp32 values are gone for good
// (store_param of one is then fatal): only for runs that read the base from the Store no more
// (no plain path, no HF / GGUF export, no copy of the base in --out).
void store_release_frozen(Store* s);
// The same for elements [from, to) of layer l's frozen head only (the whole pages inside it),
// without marking the Store: for the engine, which releases each part of the base as soon as it
// has its bf16 copy (EngineOptions.release_frozen), so the host never holds both in full.
void store_release_range(Store* s, int l, int64_t from, int64_t to);
// Data parallel (ZeRO-1 through the engine): give back the memory of AdamW's m and v of layer l's
// elements [from, to) of its state slab (the whole pages inside; another rank's shard), and with
// weights also of its fp32 weights there (full training: the same offsets): the allocation
// stays, reading them gives zeros, writing them takes memory again.
void store_release_state(Store* s, int l, int64_t from, int64_t to, int weights);
void store_free(Store* s);

// Parameter / gradient of tensor i of the table (the gradient NULL for a frozen tensor; the
// parameter of a frozen one is fatal after store_release_frozen).
float* store_param(const Store* s, int i);
float* store_grad(const Store* s, int i);

// Seeded random init (HF style): matrices and embeddings ~ N(0, std), norms = 1; GPT-OSS: linear
// and expert biases = 0, sinks and the router bias ~ N(0, std). LoRA adapters are left to
// lora_init_random; the base gets the same values with or without them. A streamed base
// (base_streamed): each block-format tensor's values are generated a chunk at a time into a
// bounded buffer and quantised into its blocks there (the same values, so the same blocks as
// store_quantize_base makes of the fp32 init: quantisation is per block, chunks are whole blocks).
void store_init_random(Store* s, uint32_t seed, float std);

void store_zero_grads(Store* s);
// Add the gradient of every tied tensor into its owner's gradient (and zero the tied slot).
void store_fold_tied_grads(Store* s);
// Fill out[] with one AdamWTensor per owned trainable tensor; returns the count (<= tt->n).
int store_adamw_tensors(const Store* s, AdamWTensor* out);

// Quantise every marked tensor of the Store (in parallel, one task per tensor) into
// s->qblocks[i] and write the dequantised values back into its fp32 slab. keep: a GGUF tensor
// already in the target type and layout gives its blocks as they are (gguf NULL: quantise all).
// A streamed Store (store_create_streamed: the init and the loader made the blocks) is left as it
// is.
void store_quantize_base(Store* s, const GgufFile* gguf, const ModelConfig* cfg);

#endif  // LLMC_STORE_H
