/*
 * model.h — the decoder model written once against the op table (ops.h), layer by layer:
 * prefix (token embedding), decoder blocks, postfix (final norm + LM head + loss). Each function
 * runs one layer of the layer sequence (tensor.h) for one micro-batch on one backend, so the plain
 * trainer and the RoundPipe engine can both drive it.
 *
 * A Model is device-independent (config, tensor table, RoPE frequencies). A Workspace holds the
 * buffers one backend needs to run layers on micro-batches of up to B x T tokens: RoPE tables,
 * saved block activations (BlockActs, for the backward) and scratch for gradients and LM-head
 * chunks. The LM head and the loss are fused and chunked over tokens: full logits (N, V) are never
 * materialised, and the head's weight gradient is computed inside the forward
 * (docs/ROUNDPIPE.md §2.2).
 *
 * Block math (HF modeling_llama / modeling_qwen3 / modeling_qwen3_moe / modeling_gpt_oss):
 *     ln1 = RMSNorm(x) ; qkv = ln1·Wqkvᵀ (+ bqkv) ; (Qwen3: RMSNorm_HD(q), RMSNorm_HD(k)) ; RoPE(q, k)
 *     h   = x + Attn(q, k, v)·Woᵀ (+ bo)      GPT-OSS: sinks, a sliding window in some blocks
 *     ln2 = RMSNorm(h) ; gu = ln2·Wguᵀ ; x' = h + (silu(gate) * up)·Wdownᵀ
 *                                           or x' = h + MoE(ln2) (moe.h) in an MoE block
 * Blocks differ within a model (Qwen3-MoE's dense blocks, GPT-OSS's window per layer_types), so
 * the block functions take the block index. The aux loss couples the MoE blocks of a micro-batch:
 * after the last block's forward, model_moe_aux() computes it from what each block recorded and
 * sets up the gradient the blocks' backward adds.
 */
#ifndef LLMC_MODEL_H
#define LLMC_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "moe.h"
#include "ops.h"
#include "tensor.h"

// Element offsets of each weight inside a decoder block's parameter (and gradient) slab.
// q/k/v are adjacent (one (QKV, C) matrix, one (QKV) bias), gate/up are adjacent (one (2F, C)).
typedef struct BlockLayout {
    int64_t attn_norm, wqkv, q_norm, k_norm, wo, mlp_norm, wgu, wdown;  // -1 when absent
    int64_t bqkv, bo, sinks;                                            // GPT-OSS attention
    int64_t router, router_bias, exp_gu, exp_gu_bias, exp_down, exp_down_bias;  // MoE blocks
    int64_t lora_a[LORA_N_TARGETS], lora_b[LORA_N_TARGETS];  // LoRA adapters (lora.h), or -1
    int moe;     // the block routes to experts (else the dense SwiGLU MLP)
    int window;  // attention window (0: full causal)
} BlockLayout;

typedef struct Model {
    ModelConfig cfg;
    TensorTable tt;
    BlockLayout* layout;   // (L) per decoder block: offsets in its parameter slab
    BlockLayout* glayout;  // (L) the same tensors' offsets in its gradient slab (-1: frozen, as
                           // the base is under LoRA; equal to layout otherwise)
    float lora_scale;      // LoRA (tt.lora.r > 0): alpha / r, or alpha / sqrt(r) (rsLoRA)
    int n_moe;             // MoE blocks (0 for dense families)
    int* moe_slot;         // (L) the block's index among the MoE blocks, or -1
    int QKV;               // (H + 2*KVH) * HD
    float* inv_freq;       // (HD/2) RoPE inverse frequencies (host)
    float rope_scale;      // attention scaling folded into cos/sin (1 except yarn)
    // Long sequences: when > 0 and a workspace holds more than this many rows, the MLP runs in
    // row chunks of this size and its activations (ln2, gate/up, silu product) are not kept: the
    // backward recomputes them chunk by chunk from h. Such a block keeps only the attention's
    // output, its lse and rstd1: the backward recomputes ln1, qkv_raw, qkv (qk-norm and RoPE) and
    // h (the attention's input and output projections). Costs one more MLP forward and both
    // projections' forward in the backward, saves (3C + 2 QKV + 3F) x rows of each block's
    // activations (Qwen3-1.7B: 17 -> 1 GiB per block at 262,144 tokens) and shrinks the MLP
    // gradient scratch to a chunk.
    int mlp_chunk;
} Model;

// Activations of one block for one micro-batch, saved by the forward for the backward.
// N = B*T rows.
typedef struct BlockActs {
    void* ln1;       // (N, C)                         NULL with a chunked MLP: the backward
    float* rstd1;    // (N)                            recomputes ln1, qkv_raw, qkv and h (cheap
    void* qkv_raw;   // (N, QKV) before qk-norm/RoPE   next to the attention they feed)
    void* qkv;       // (N, QKV) after qk-norm/RoPE (NULL with a chunked MLP: recomputed)
    float* rstd_qk;  // (N, H + KVH) qk-norm rstd (NULL without qk-norm or with a chunked MLP)
    void* att;       // (N, H*HD) attention output before Wo
    float* lse;      // (B, H, T)
    void* h;         // (N, C) residual after attention (NULL with a chunked MLP)
    void* ln2;       // (N, C)          } NULL with a chunked MLP (Workspace.mlp_chunk):
    float* rstd2;    // (N)             } the backward recomputes them per chunk
    void* gu;        // (N, 2F) [gate | up]
    void* act;       // (N, F) silu(gate) * up
    void* lora_t;    // (N, lora_saved_t_width) the adapters' t = x·Aᵀ (lora.h; NULL without LoRA,
                     // with dropout or with a chunked MLP: the backward recomputes it)
    MoeActs moe;     // an MoE block's router, routing and expert activations (moe.h)
} BlockActs;

typedef struct Workspace {
    const Ops* ops;
    void* ctx;
    int B, T;          // capacity: micro-batches of at most B x T tokens
    int lm_chunk;      // rows per LM-head chunk
    float* rope_cos;   // (T, HD/2) device
    float* rope_sin;   // (T, HD/2) device
    int n_acts;
    BlockActs* acts;   // n_acts activation sets
    // scratch (device); proj, d_att, d_qkv_raw and xf share row_a, d_ln, d_qkv and d_xf row_b
    // (see workspace_create)
    void* row_a;       // (N, max(C, QKV))
    void* row_b;       // (N, max(C, QKV))
    void* proj;        // (N, C) attention / MLP output projection
    void* d_ln;        // (N, C)
    void* d_att;       // (N, H*HD)
    void* d_qkv;       // (N, QKV)
    void* d_qkv_raw;   // (N, QKV)
    void* d_act;       // (N, F)
    void* d_gu;        // (N, 2F)
    void* xf;          // (N, C) final-norm output
    float* rstdf;      // (N)
    void* d_xf;        // (N, C)
    void* logits;      // (lm_chunk, V)
    int mlp_chunk;     // rows per MLP chunk (0: whole micro-batch, activations kept)
    void* ln2_c;       // (mlp_chunk, C) chunk scratch of the chunked MLP
    float* rstd2_c;    // (mlp_chunk)
    void* gu_c;        // (mlp_chunk, 2F)
    void* act_c;       // (mlp_chunk, F)
    void* ln1_h;       // (N, C) chunked: the block's ln1, then its h (recomputed, not saved)
    void* qkv_raw_s;   // (N, QKV) chunked: the block's qkv_raw
    float* rstd1_s;    // (N) chunked: rstd1 of the backward's recompute (equal to the saved one)
    void* qkv_s;       // (N, QKV) chunked: the block's qkv (forward and recompute)
    float* rstd_qk_s;  // (N, H + KVH) chunked: its qk-norm rstd (NULL without qk-norm)
    // mixture of experts (unused by dense models)
    MoeScratch moe;      // the MoE blocks' scratch
    float* moe_stats;    // (n_moe, 2E) each MoE block's aux statistics of the last forward
    float* moe_counts;   // (E) tokens per expert over all MoE blocks (model_moe_aux)
    float* moe_counts_host;  // (E) host copy of moe_counts: a step sums its micro-batches' loads
    float moe_aux_scale; // factor of the aux loss's gradient in the backward (0: none)
    double moe_aux;      // aux loss of the last forward (model_moe_aux)
    double moe_load_max, moe_load_mean;  // tokens per expert over the MoE blocks: max, mean
    // LoRA (lora.h; NULL without): scratch of the adapters' products, and the dropout's state
    void* lora_xd;       // (N, max in) drop(x) (only with dropout)
    void* lora_t;        // (N, r) drop(x)·Aᵀ
    void* lora_dt;       // (N, r) its gradient
    void* lora_tmp;      // (N, max(in, out)) dt·A before its dropout (training with dropout)
    int lora_train;      // apply the dropout (training forward and backward; 0: evaluation)
    uint64_t lora_seed;  // the dropout masks' seed of this micro-batch (set by the trainer)
    int64_t lora_row0;   // the rows' first token within the micro-batch (the masks' key: an
                         // engine row chunk of the micro-batch drops what the whole one would)
} Workspace;

// ----------------------------------------------------------------------------
// model description

int model_init(Model* m, const ModelConfig* cfg, int decay_embeddings, char* err);
// The same with LoRA adapters on a frozen base (lora NULL or r = 0: none; tensor.h, lora.h).
int model_init_lora(Model* m, const ModelConfig* cfg, int decay_embeddings, const LoraSpec* lora,
                    char* err);
void model_free(Model* m);

// ----------------------------------------------------------------------------
// workspaces

// n_acts activation sets (1: the backward must recompute each block; L: keep every block's).
Workspace* workspace_create(const Model* m, const Ops* ops, void* ctx, int B, int T, int n_acts);
void workspace_free(Workspace* ws);
// Bytes of one block's saved activations (one BlockActs set) for B x T tokens.
size_t workspace_act_set_bytes(const Model* m, int act_bytes, int B, int T);
// Device bytes a workspace of this shape uses (for memory planning and the start-up report).
size_t workspace_bytes(const Model* m, int act_bytes, int B, int T, int n_acts);
// Host bytes the CPU backend's ops allocate for themselves at most at once while computing a
// micro-batch of B x T tokens on n_threads threads (the largest block or LM-head matmul, or the
// attention; ops_cpu_gemm_temp_bytes), plus one more of up to 32 MiB that malloc may keep in its
// heap after it is freed: memory estimates add it to the workspace.
size_t model_cpu_op_temp_bytes(const Model* m, int B, int T, int n_threads);

// ----------------------------------------------------------------------------
// layers. `slab` is the layer's parameter slab on the backend (compute dtype), `gslab` its fp32
// gradient slab (accumulated into). B x T must fit the workspace.

// x_out (N, C) = wte[ids].
void model_prefix_forward(const Model* m, Workspace* ws, void* x_out, const int32_t* ids,
                          const void* wte, int B, int T);
// dwte (V, C) += scatter(dx).
void model_prefix_backward(const Model* m, Workspace* ws, float* dwte, const void* dx,
                           const int32_t* ids, int B, int T);

// Decoder block `block` (0 .. L-1).
void model_block_forward_at(const Model* m, Workspace* ws, BlockActs* a, int block,
                            const void* slab, const void* x_in, void* x_out, int B, int T);
// dres (N, C): in = gradient w.r.t. the block output, out = gradient w.r.t. x_in (in place).
// `a` must hold this block's activations for x_in (from its forward, possibly a recompute); an
// MoE block's backward also needs model_moe_aux() to have run for this micro-batch.
void model_block_backward_at(const Model* m, Workspace* ws, const BlockActs* a, int block,
                             const void* slab, float* gslab, const void* x_in, void* dres, int B,
                             int T);
// MoE models, after every block's forward of a micro-batch of B x T tokens and before any block's
// backward: the aux loss from the blocks' statistics (ws->moe_aux, returned), the load spread
// (ws->moe_load_max / mean), and the aux gradient's setup (ws->moe_counts, ws->moe_aux_scale =
// router_aux_loss_coef · B·T · grad_scale · E / (n_moe B T)^2 when output_router_logits, else 0).
// The micro-batch's share of the objective is router_aux_loss_coef · aux · B·T · grad_scale (the
// caller adds coef · aux · B·T to its loss sum). 0 for dense models.
double model_moe_aux(const Model* m, Workspace* ws, int B, int T, float grad_scale);
// The ws->moe_aux_scale model_moe_aux sets for a micro-batch of B x T tokens: it depends on the
// shape only, so a device that runs MoE blocks' backward without the aux's forward (the RoundPipe
// engine's backward stages) sets it itself and needs only the counts from the one that ran it.
float model_moe_aux_scale(const Model* m, int B, int T, float grad_scale);
// The weight of the aux loss in the objective: router_aux_loss_coef when output_router_logits,
// else 0 (HF adds it only then).
double model_aux_weight(const Model* m);

// Final norm + LM head + cross-entropy, chunked over tokens, fused with the backward:
//   losses (N, fp32, device) = per-token loss; when compute_grad, dx (N, C) = dloss/dx_in and
//   dnorm_w (C) / dhead_w (V, C) are accumulated, with every gradient scaled by grad_scale
//   (= 1 / tokens of the optimizer step). targets (N) < 0 are ignored.
void model_postfix_forward_backward(const Model* m, Workspace* ws, const void* norm_w,
                                    const void* head_w, float* dnorm_w, float* dhead_w,
                                    const void* x_in, void* dx, const int32_t* targets,
                                    float* losses, float grad_scale, int compute_grad, int B,
                                    int T);
// Logits of the last position of each of the B sequences: logits (B, V) device buffer in the
// compute dtype (uses the workspace's logits chunk, so B <= lm_chunk).
void model_postfix_logits_last(const Model* m, Workspace* ws, const void* norm_w,
                               const void* head_w, const void* x_in, void* logits, int B, int T);
// Its second half: the LM head on the last position of each sequence of the normed rows already
// in ws->xf (B*T, C) (model_decode_final_norm's output).
void model_postfix_head_last(const Model* m, Workspace* ws, const void* head_w, void* logits,
                             int B, int T);

// ----------------------------------------------------------------------------
// generation (generate.h) and the policy-gradient objective (grpo.h)

// The rows of one decode step: n sequences, one new token each, at their own positions.
typedef struct DecodeRows {
    int n;                    // rows (the active sequences), <= the workspace's B*T
    const int32_t* pos;       // (n) host: each row's position in its sequence
    const int32_t* slot;      // (n) host: each row's KV-cache slot
    const int32_t* d_slot;    // (n) device: the same slots, for the decode attention
    const int32_t* d_len;     // (n) device: pos + 1, the keys each row attends to
    const int32_t* d_pos;     // (n) device: the positions (ops->decode_rope_append; else unused)
    const float* rope_cos;    // (maxT, HD/2) device RoPE tables covering every position
    const float* rope_sin;
    int maxT;                 // positions per cache slot
} DecodeRows;

// The post-RoPE packed qkv (N, QKV) of the block whose forward last ran with activation set a
// (the keys and values a prefill copies into the KV cache).
const void* model_block_qkv(const Workspace* ws, const BlockActs* a);
// Decoder block `block` for one new token per row: the forward's math, with this block's keys
// and values of the new tokens written into the cache kc, vc (slots, maxT, KVH*HD) at (slot,
// pos) and attention over each row's cache (ops->attention_decode). Uses activation set 0 of ws
// as scratch (ws without MLP chunks, B*T >= n).
// The block's input is x (n, C) itself, or with x_pending the previous decode block's output,
// which this block first writes into x. Its own output x' = h + proj is left pending in the
// workspace (ws->acts[0].h and ws->proj; the add is fused into the next op's norm): the next
// call must pass x_pending = 1 (x may be the same buffer), and after the last block
// model_decode_final_norm takes it. Nothing else may touch ws in between.
void model_block_decode_at(const Model* m, Workspace* ws, int block, const void* slab, void* kc,
                           void* vc, const DecodeRows* r, void* x, int x_pending);
// The final norm of a decode step: x (n, C) = the last block's pending output, ws->xf (n, C) =
// rmsnorm(x) with norm_w, in one op.
void model_decode_final_norm(const Model* m, Workspace* ws, const void* norm_w, void* x, int n);

// Per-token inputs of the clipped policy-gradient objective (ops.h policy_forward_backward),
// device fp32 buffers of N = B*T entries aligned with the targets; ref_logp NULL: no KL.
typedef struct PolicyLoss {
    const float *old_logp, *ref_logp, *adv, *weight;
    float inv_temp, clip_low, clip_high, kl_beta;
} PolicyLoss;

// As model_postfix_forward_backward with the policy objective instead of the cross-entropy:
// logp (N) the log-prob of each target under softmax(logits · inv_temp), losses (N) each
// token's weighted objective; when compute_grad, dx and the head's and norm's gradients of the
// summed objective (the weights carry the normalisation).
void model_postfix_policy(const Model* m, Workspace* ws, const void* norm_w, const void* head_w,
                          float* dnorm_w, float* dhead_w, const void* x_in, void* dx,
                          const int32_t* targets, const PolicyLoss* pl, float* logp,
                          float* losses, int compute_grad, int B, int T);

#endif  // LLMC_MODEL_H
