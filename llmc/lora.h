/*
 * lora.h — LoRA adapters on a frozen base (PEFT's LoraModel): the flags' target list, the scale,
 * the adapters' forward and backward against the op table (called by model.c after each base
 * linear), their init, merging them into the base for the exports, and PEFT adapter directories
 * (adapter_config.json + adapter_model.safetensors) in and out.
 *
 * Math for a targeted linear y = x·Wᵀ with A (r, in), B (out, r), s = alpha / r (rsLoRA:
 * alpha / sqrt(r)) and, while training, inverted dropout on the branch's input only:
 *     forward   t = drop(x)·Aᵀ (n, r) ;  y += s · t·Bᵀ
 *     backward  dB += (s·dy)ᵀ·t ;  dt = (s·dy)·B ;  dA += dtᵀ·drop(x) ;  dx += drop(dt·A)
 * The q, k, v (and gate, up) adapters are separate PEFT modules on our fused (QKV, C) (and
 * (2F, C)) linears: each writes its product into its column range of the fused output
 * (ops->matmul_cols_forward) and reads its range of the output gradient in place
 * (ops->matmul_cols_backward). Adapters that share their input run as one: their A's are adjacent
 * in the slab (tensor.h), so t = x·[A_q; A_k; A_v]ᵀ is one (n, 3r) product, and dx += dt·A and
 * dA += dtᵀ·x one each (with dropout each adapter has its own drop(x): adapter by adapter).
 * Without dropout, when the adapters cover the whole fused output (lora_covers) the model runs
 * them first, writing y = s·t·Bᵀ, and the base product adds onto it (y += x·Wᵀ; dx likewise):
 * the base GEMM is compute-bound, so reading y there is free, where adding the adapters after it
 * read y once more. The forward keeps t for the backward (BlockActs.lora_t) where the block keeps
 * its activations; elsewhere the backward recomputes it.
 *
 * The experts of an MoE block (PEFT's target_parameters gate_up_proj and down_proj, tensor.h) get
 * one adapter per expert, A_e (rank, in) and B_e (out, rank), acting on exactly the rows routed to
 * e: moe.c calls lora_expert_forward after each grouped projection with the dispatched rows, and
 * the adapters' products run through the same grouped matmul (ops->moe_matmul_*) as the experts:
 *     gu_e += s_gu · (x_e·A_gu,eᵀ)·B_gu,eᵀ ;  out_e += s_d · (h_e·A_d,eᵀ)·B_d,eᵀ
 * with the backward as above per expert. PEFT's ParamWrapper adds s·B_e·A_e to W_e instead (the
 * same function: each routed row goes through W_e + s·B_e·A_e); it refuses dropout, so do we.
 *
 * The dropout mask is a hash of (the workspace's seed, block, target, element), so a recomputed
 * forward and the backward see the mask the forward used, on every backend and row chunking.
 * The tensors live in the tensor table (tensor.h): A and B per targeted module per block, the
 * only trainable tensors of a LoRA run.
 */
#ifndef LLMC_LORA_H
#define LLMC_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "store.h"
#include "tensor.h"

// --lora-targets names that belong to MoE blocks (router; experts: LORA_EXPERTS_BIT, tensor.h).
#define LORA_ROUTER_BIT LORA_BIT(LORA_ROUTER)

// "all-linear" or a comma list of q,k,v,o,gate,up,down (PEFT's q_proj ... down_proj also
// accepted), router, experts. 0, or -1 with a one-line err.
int lora_parse_targets(const char* s, unsigned* targets, char* err);
// The targets as a comma list of short names, into buf.
void lora_targets_string(unsigned targets, char* buf, size_t cap);
// alpha / r, or alpha / sqrt(r) with rsLoRA.
float lora_scale(const LoraSpec* l);
// The dropout masks' seed of micro-batch mb of the step after `done` optimizer steps (the plain
// trainer and the engine alike, so they drop the same elements, and a resumed run as the
// straight one).
uint64_t lora_dropout_seed(uint32_t seed, int64_t done, int mb);

// ----------------------------------------------------------------------------
// the adapters' math (model.c calls these; no-ops without LoRA)

// Workspace scratch for n rows (bytes on the backend) and its allocation.
size_t lora_scratch_bytes(const Model* m, size_t act_bytes, int64_t n);
void lora_scratch_alloc(const Model* m, Workspace* ws, int64_t n);
void lora_scratch_free(Workspace* ws);

// Whether the adapters in `mask` write every column of their fused output (LoRA on, no dropout,
// and they cover its width): then the model runs lora_forward with accumulate 0 before the base
// product, which adds onto it, and lora_backward likewise.
int lora_covers(const Model* m, int block, unsigned mask);
// Columns of the t a block's forward keeps for its backward (BlockActs.lora_t (N, width)): the
// dense targets' r each, 0 without LoRA or with dropout (the backward recomputes t then).
int64_t lora_saved_t_width(const Model* m);
// Where the t of the adapters in mask starts in BlockActs.lora_t for n rows (elements): each
// fused linear's (n, k·r) in target order.
int64_t lora_saved_t_offset(const Model* m, int block, unsigned mask, int n);

// y (n, the fused output's width) columns of each targeted adapter = s·drop(x)·Aᵀ·Bᵀ, added to
// them when accumulate (else written: lora_covers), for the targets in `mask` (LORA_BIT set) that
// share input x. Rows are row0.. of the micro-batch (the dropout mask's key). slab: block
// `block`'s parameter slab on the backend. t_keep (n, k·r) or NULL: where to leave t = x·Aᵀ for
// lora_backward (no dropout).
void lora_forward(const Model* m, Workspace* ws, int block, unsigned mask, const void* slab,
                  const void* x, void* y, int n, int64_t row0, int accumulate, void* t_keep);
// The adapters' backward for the same targets: dA, dB accumulated into gslab (the block's
// gradient slab), dx (n, in) = their input gradient, added to it when accumulate. dy (n, fused
// width): the output's gradient. t_kept: the forward's t_keep of these rows, or NULL (recomputed).
void lora_backward(const Model* m, Workspace* ws, int block, unsigned mask, const void* slab,
                   float* gslab, const void* x, const void* dy, void* dx, int n, int64_t row0,
                   int accumulate, const void* t_kept);
// The expert adapters of target tg (LORA_EXP_GATE_UP or LORA_EXP_DOWN; no-ops without it) on the
// R dispatched rows (expert e's at offsets[e] .. offsets[e+1]): y (R, out) += each expert's
// s·x_e·A_eᵀ·B_eᵀ from x (R, in); the backward accumulates dA, dB into gslab and dx (R, in) += the
// input gradient from dy (R, out).
void lora_expert_forward(const Model* m, Workspace* ws, int block, LoraTarget tg,
                         const void* slab, const void* x, void* y, const int32_t* offsets, int R);
void lora_expert_backward(const Model* m, Workspace* ws, int block, LoraTarget tg,
                          const void* slab, float* gslab, const void* x, const void* dy, void* dx,
                          const int32_t* offsets, int R);

// ----------------------------------------------------------------------------
// weights

// PEFT's init: A ~ U(-1/sqrt(in), 1/sqrt(in)) (nn.Linear's kaiming_uniform(a = sqrt(5))), B = 0,
// each tensor from its own generator seeded by (seed, tensor).
void lora_init_random(const Model* m, Store* s, uint32_t seed);
// W += s · B·A for every adapter, per expert for the expert adapters (the --merge-lora exports;
// the base then carries them).
void lora_merge(const Model* m, Store* s);

// ----------------------------------------------------------------------------
// PEFT adapter directories

// A file written, for checkpoint checksums.
typedef struct LoraFile {
    char name[64];
    uint64_t bytes;
    uint32_t crc;
} LoraFile;

// dir/adapter_config.json and dir/adapter_model.safetensors (F32, PEFT keys). base_model: the
// config's base_model_name_or_path. files (may be NULL): the two files written.
int lora_save_peft(const char* dir, const Model* m, const Store* s, const char* base_model,
                   LoraFile files[2], char* err);
// Read a PEFT adapter directory into the store's adapters: its config must match the model's
// LoRA (r, lora_alpha, target_modules, use_rslora), every adapter key must be there with its
// shape, and no other key. -1 with a one-line err.
int lora_load_peft(const char* dir, const Model* m, Store* s, char* err);
// Only the adapter weights of dir/adapter_model.safetensors (no config check: a checkpoint).
int lora_load_weights(const char* path, const Model* m, Store* s, char* err);
// Adapter tensor i in its PEFT file layout: dst (numel) from src (the table's layout) and shape
// (2-D, PEFT's). The identity except for the experts' B: (E, out, rank) in the table, (out,
// rank·E) with column k·E + e in PEFT (ParamWrapper reshapes lora_B.weight to (out, rank, E)).
void lora_to_peft(const Model* m, int i, const float* src, float* dst, int64_t shape[2]);

#endif  // LLMC_LORA_H
