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
 * (QKV, C) and one (2F, C) weight; the q/k/v biases (GPT-OSS) are adjacent too (one (QKV) bias).
 *
 * Mixture-of-experts blocks keep all experts of a block in one tensor per projection, in the
 * layout their family's fused HF tensors have (docs/FORMATS.md §8.2):
 *   Qwen3-MoE  experts gate_up (E, 2F, C): per expert [gate rows | up rows], nn.Linear (out, in);
 *              experts down (E, C, F)
 *   GPT-OSS    experts gate_up (E, C, 2F): x·W (in, out), gate/up interleaved in the columns;
 *              gate_up bias (E, 2F) interleaved the same way; down (E, F, C); down bias (E, C)
 * so a GPT-OSS checkpoint and a transformers-5 Qwen3-MoE checkpoint map 1:1 onto the table.
 *
 * The HF view (HfTensor): the tensors an HF checkpoint of this model holds, each a contiguous
 * range of one table tensor. Dense models and fused expert layouts: one per owned table tensor,
 * the whole of it. Qwen3-MoE in the hub layout (EXPERTS_PER_EXPERT): mlp.experts.{e}.gate_proj,
 * up_proj, down_proj, each a slice of the fused expert tensors. Loading, saving, --dump-state and
 * the HF export go through the view, so a model leaves in the layout it came in.
 *
 * LoRA (tensor_table_build_lora, lora.h): each adapted linear of a block gets two more tensors at
 * the end of the block's slab, A (r, in) and B (out, r) (in the table A, B per linear; in the
 * slabs every A of the block first, then every B: the A's of q, k, v are one (3r, C) matrix there,
 * those of gate, up one (2r, C), and their gradients likewise), named by their PEFT keys
 * (base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight). They are the only
 * trainable tensors then: the base is frozen, with no gradient slot (grad_offset -1) and no AdamW
 * state (state_offset -1), so the gradient and m/v slabs hold the adapters only. The HF view
 * leaves the adapters out (the base model is what loads and exports as HF / GGUF).
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
    // attention biases and sinks (GPT-OSS)
    TK_BQ,
    TK_BK,
    TK_BV,
    TK_BO,
    TK_SINKS,
    // mixture of experts
    TK_ROUTER,            // (E, C)
    TK_ROUTER_BIAS,       // (E) GPT-OSS
    TK_EXP_GATE_UP,       // (E, 2F, C) Qwen3-MoE / (E, C, 2F) GPT-OSS (see above)
    TK_EXP_GATE_UP_BIAS,  // (E, 2F) GPT-OSS, interleaved
    TK_EXP_DOWN,          // (E, C, F) Qwen3-MoE / (E, F, C) GPT-OSS
    TK_EXP_DOWN_BIAS,     // (E, C) GPT-OSS
    // LoRA adapters (TensorDesc.lora_target says which linear)
    TK_LORA_A,            // (r, in)
    TK_LORA_B,            // (out, r)
    TK_COUNT
} TensorKind;

// The linears LoRA can adapt, in PEFT's module names: q_proj, k_proj, v_proj, o_proj, gate_proj,
// up_proj, down_proj (a dense MLP's), gate (an MoE block's router, nn.Linear (E, C)), and the
// experts of an MoE block: their fused gate_up_proj (E, 2F, C) and down_proj (E, C, F) parameters,
// which PEFT adapts through target_parameters (lora.ParamWrapper), one adapter per expert:
//   gate_up  A (E, rg, C), B (E, 2F, rg)     rg = 2r on Qwen3-MoE (PEFT's v4 -> v5 conversion of
//   down     A (E, r, F),  B (E, C, r)       gate_proj + up_proj: rank_pattern 2r, alpha 2·alpha),
//                                            r on GPT-OSS (target_parameters as given), or
//                                            --lora-gate-up-rank (alpha · rg / r)
// in the table's layout (each expert's A and B contiguous, the grouped matmul's (E, OC, IC)); the
// PEFT files hold A as (rg·E, in) (the same bytes) and B as (out, rg·E) with column k·E + e
// (lora_peft.c converts).
typedef enum {
    LORA_Q = 0,
    LORA_K,
    LORA_V,
    LORA_O,
    LORA_GATE,
    LORA_UP,
    LORA_DOWN,
    LORA_ROUTER,
    LORA_EXP_GATE_UP,
    LORA_EXP_DOWN,
    LORA_N_TARGETS
} LoraTarget;

#define LORA_BIT(target) (1u << (target))
// --lora-targets experts: both expert projections (they are adapted together, as PEFT's
// conversion of gate_proj, up_proj, down_proj does).
#define LORA_EXPERTS_BIT (LORA_BIT(LORA_EXP_GATE_UP) | LORA_BIT(LORA_EXP_DOWN))
// PEFT's all-linear: every linear but the LM head. The tensor table keeps the bits the model has
// (lora_targets_for_model): a dense model drops router and experts, GPT-OSS both (no nn.Linear
// there, and no v4 -> v5 conversion that would name them).
#define LORA_ALL_LINEAR ((1u << LORA_N_TARGETS) - 1u)
// The dense targets' count: the dropout masks' seeds of q .. down hash it (unchanged by router).
#define LORA_N_DENSE_TARGETS 7
// The router's masks' key stride (the value of LORA_N_TARGETS when the router came).
#define LORA_ROUTER_SEED_STRIDE 8

// A LoRA configuration (r = 0: none). scale = alpha / r, or alpha / sqrt(r) with rslora.
typedef struct LoraSpec {
    int r;
    float alpha;
    int rslora;
    float dropout;      // on the adapter branch's input, while training
    unsigned targets;   // LORA_BIT(LoraTarget) set
    int gate_up_r;      // the experts' gate_up adapter rank; 0: the family's (see above)
} LoraSpec;

typedef struct TensorDesc {
    TensorKind kind;
    int layer;               // index in the layer sequence (0 prefix, 1..L blocks, L+1 postfix)
    int block;               // decoder block index, -1 for prefix/postfix tensors
    char name[64];           // ours: "embed", "layers.3.wq", "final_norm", "lm_head"
    char hf_name[96];        // "model.layers.3.self_attn.q_proj.weight"
    char gguf_name[64];      // "blk.3.attn_q.weight"
    int ndim;                // 1, 2 or 3
    int64_t shape[4];        // HF (row-major) shape (expert adapters: the table's, see above)
    int64_t numel;
    int64_t param_offset;    // element offset in the owner layer's parameter slab (-1 when tied)
    int64_t grad_offset;     // element offset in `layer`'s gradient slab
    int decay;               // weight decay applies
    int tied_to;             // index of the tensor whose storage this one shares, or -1
    int owner_layer;         // layer whose parameter slab holds the storage
    int trainable;           // the optimizer updates it (with LoRA: the adapters only)
    int64_t state_offset;    // element offset in the owner layer's AdamW m / v slabs (-1: frozen)
    int lora_target;         // TK_LORA_A / TK_LORA_B: the LoraTarget adapted; -1 otherwise
    int qtype;               // storage format of a frozen tensor (--base-dtype, quant.h): a ggml
                             // block type, or 0 = the compute dtype
} TensorDesc;

// One tensor of an HF checkpoint of the model: elements [offset, offset + numel) of table tensor
// `index` (its own parameter, gradient, m or v storage), under the checkpoint's name and shape.
typedef struct HfTensor {
    char name[96];
    int ndim;
    int64_t shape[3];
    int64_t numel;
    int index;
    int64_t offset;
} HfTensor;

typedef struct TensorTable {
    int n;                 // number of tensors
    TensorDesc* t;
    int n_layers;          // L + 2
    int64_t* param_numel;  // (n_layers) elements of each layer's parameter slab
    int64_t* grad_numel;   // (n_layers) elements of each layer's gradient slab
    int64_t* state_numel;  // (n_layers) elements of each layer's AdamW m (and v) slab
    int* first;            // (n_layers) index of the layer's first tensor in t
    int* count;            // (n_layers) number of tensors used by the layer
    int64_t total_params;  // unique parameters (tied counted once)
    int64_t trainable_params;  // of which trainable (all of them without LoRA)
    LoraSpec lora;         // the adapters (r = 0: none)
    int n_hf;              // the HF view (see above), in checkpoint order
    HfTensor* hf;
    int hf_hash_cap;       // open-addressing index of hf by name (a power of two)
    int* hf_hash;          // (hf_hash_cap) index into hf, or -1
} TensorTable;

// Build the table for a config. decay_embeddings: also decay the token embedding (and therefore
// a tied head); norms never decay. Returns -1 with err for unsupported families.
int tensor_table_build(TensorTable* tt, const ModelConfig* cfg, int decay_embeddings, char* err);
// The same with LoRA adapters (lora NULL or r = 0: none): the targets the model has
// (lora_targets_for_model; -1 with err for those its family cannot take).
int tensor_table_build_lora(TensorTable* tt, const ModelConfig* cfg, int decay_embeddings,
                            const LoraSpec* lora, char* err);
void tensor_table_free(TensorTable* tt);
// Lookups; -1 if absent.
int tensor_table_find_hf(const TensorTable* tt, const char* hf_name);
int tensor_table_find(const TensorTable* tt, const char* name);
// The HF view's tensor of this name (-1 if absent): a hash lookup (a 235B MoE has 36k tensors).
int tensor_table_find_hf_tensor(const TensorTable* tt, const char* name);
// Index of the tensor of `kind` in block `block` (or -1 for non-block kinds); -1 if absent.
int tensor_table_index(const TensorTable* tt, TensorKind kind, int block);
// Index of block `block`'s LoRA A (b = 0) or B (b = 1) tensor of `target`; -1 if absent.
int tensor_table_lora_index(const TensorTable* tt, int block, LoraTarget target, int b);
// The targets a model of this configuration takes (all-linear narrowed to its linears), or -1
// with a one-line err (router / experts on a model whose family has none as nn.Linear).
int lora_targets_for_model(const ModelConfig* c, unsigned targets, unsigned* out, char* err);
// PEFT's module name of a target ("q_proj") and its place in the block ("self_attn", "mlp").
const char* lora_target_name(LoraTarget target);
const char* lora_target_parent(LoraTarget target);
// Whether block l of this configuration has the linear `target` (the router only in MoE blocks,
// gate / up / down only in dense-MLP blocks).
int lora_block_has_target(const ModelConfig* c, int l, int target);
// (in, out) features of a target's linear in model c (the experts: of one expert).
void lora_target_dims(const ModelConfig* c, LoraTarget target, int64_t* in, int64_t* out);
// A target's rank and alpha: r and alpha, except the experts' gate_up: l->gate_up_r (0: 2r on
// Qwen3-MoE, r on GPT-OSS, see above) and alpha scaled with it (alpha / r kept, as PEFT's
// conversion does).
int lora_target_rank(const ModelConfig* c, const LoraSpec* l, LoraTarget target);
float lora_target_alpha(const ModelConfig* c, const LoraSpec* l, LoraTarget target);
// 1 for the expert targets (per-expert adapters through the grouped matmul).
int lora_target_is_expert(LoraTarget target);
const char* tensor_kind_name(TensorKind k);

#endif  // LLMC_TENSOR_H
