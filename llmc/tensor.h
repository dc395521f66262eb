/*
 * tensor.h — the tensor descriptor table: every parameter tensor of a model with its names (ours,
 * HF, GGUF), shape, place in the layer-major slabs, weight-decay flag and tying. Loading, init,
 * the optimizer, checkpoints and --dump-state are all driven by this table; nothing else in the
 * code base indexes tensors by magic numbers.
 *
 * The layer sequence (docs/ROUNDPIPE.md §1.1): layer 0 is the prefix (token embedding), layers 1..L
 * are the decoder blocks (block l is layer l+1), layer L+1 is the postfix (final norm, LM head).
 * Each layer owns one parameter slab (its own tensors, contiguous, in table order) and one gradient
 * slab (every tensor the layer USES, including a tied LM head whose storage lives in layer 0).
 * Within a block, q/k/v are adjacent and gate/up are adjacent so the fused matmuls see one
 * (QKV, C) and one (2F, C) weight.
 */
#ifndef LLMC_TENSOR_H
#define LLMC_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

typedef enum {
    TK_EMBED = 0,
    TK_ATTN_NORM,
    TK_WQ,
    TK_WK,
    TK_WV,
    TK_Q_NORM,
    TK_K_NORM,
    TK_WO,
    TK_MLP_NORM,
    TK_W_GATE,
    TK_W_UP,
    TK_W_DOWN,
    TK_FINAL_NORM,
    TK_LM_HEAD,
    TK_COUNT
} TensorKind;

typedef struct TensorDesc {
    TensorKind kind;
    int layer;               // index in the layer sequence (0 prefix, 1..L blocks, L+1 postfix)
    int block;               // decoder block index, -1 for prefix/postfix tensors
    char name[64];           // ours: "embed", "layers.3.wq", "final_norm", "lm_head"
    char hf_name[96];        // "model.layers.3.self_attn.q_proj.weight"
    char gguf_name[64];      // "blk.3.attn_q.weight"
    int ndim;
    int64_t shape[4];        // HF (row-major) shape
    int64_t numel;
    int64_t param_offset;    // element offset in the owner layer's parameter slab (-1 when tied)
    int64_t grad_offset;     // element offset in `layer`'s gradient slab
    int decay;               // weight decay applies
    int tied_to;             // index of the tensor whose storage this one shares, or -1
    int owner_layer;         // layer whose parameter slab holds the storage
} TensorDesc;

typedef struct TensorTable {
    int n;                 // number of tensors
    TensorDesc* t;
    int n_layers;          // L + 2
    int64_t* param_numel;  // (n_layers) elements of each layer's parameter slab
    int64_t* grad_numel;   // (n_layers) elements of each layer's gradient slab
    int* first;            // (n_layers) index of the layer's first tensor in t
    int* count;            // (n_layers) number of tensors used by the layer
    int64_t total_params;  // unique parameters (tied counted once)
} TensorTable;

// Build the table for a config. decay_embeddings: also decay the token embedding (and therefore
// a tied head); norms never decay. Returns -1 with err for unsupported families.
int tensor_table_build(TensorTable* tt, const ModelConfig* cfg, int decay_embeddings, char* err);
void tensor_table_free(TensorTable* tt);
// Lookups; -1 if absent.
int tensor_table_find_hf(const TensorTable* tt, const char* hf_name);
int tensor_table_find(const TensorTable* tt, const char* name);
// Index of the tensor of `kind` in block `block` (or -1 for non-block kinds); -1 if absent.
int tensor_table_index(const TensorTable* tt, TensorKind kind, int block);
const char* tensor_kind_name(TensorKind k);

#endif  // LLMC_TENSOR_H
