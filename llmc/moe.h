/*
 * moe.h — the mixture-of-experts MLP of a decoder block (Qwen3-MoE, GPT-OSS), written once against
 * the op table (ops.h), and the load-balancing auxiliary loss.
 *
 * Forward of one block on N rows x (N, C) (the post-attention RMSNorm's output):
 *     logits = x·W_rᵀ (+ b_r)                     router (E, C)
 *     (idx, w) = route(logits)                    Qwen3-MoE: softmax in fp32, top-K on p,
 *                                                 renormalised when norm_topk_prob;
 *                                                 GPT-OSS: top-K logits, softmax over them
 *     rows sorted by expert (stable), gathered    R = N*K rows, expert e's at offsets[e]..
 *     gu = x_e·W_gu[e] (+ b_gu[e]) per expert     Qwen3-MoE: [gate | up], SwiGLU
 *     h  = act(gu)                                GPT-OSS: interleaved, clamped (up+1)·g·σ(1.702 g)
 *     o  = h·W_d[e] (+ b_d[e])
 *     y  = Σ_k w_k · o_(row, k)                   in k order: deterministic, no atomics
 * Backward: the same steps in reverse; the routing weights' gradient dw_k = <dy, o_k> is the only
 * path from the loss to the router besides the aux loss. LoRA hooks in (MoeWeights): the router's
 * adapter adds to the logits before the routing, the experts' adapters (lora.h) add to gu and o
 * on the dispatched rows right after each grouped projection, so everything after sees them.
 *
 * Aux loss (HF load_balancing_loss_func over one forward call): with the router logits of all L'
 * MoE blocks of a micro-batch stacked into R' = L'·N rows, P = softmax, counts_e = rows routed to e
 * (over the K slots), aux = E / R'^2 · Σ_e counts_e · Σ_rows P_e. Each block's forward records its
 * counts and Σ_rows P (moe_router_stats); moe_aux_loss combines them once every block has run. The
 * counts are constant (top-k), so d aux / d logits_j = E / R'^2 · p_j (counts_j - Σ_e counts_e p_e),
 * which each block's backward adds to its router gradient with the summed counts.
 */
#ifndef LLMC_MOE_H
#define LLMC_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "ops.h"

// One MoE block's saved forward state for one micro-batch of N rows (R = N*K).
typedef struct MoeActs {
    void* logits;      // (N, E) router logits (compute dtype)
    int32_t* idx;      // (N, K) chosen experts
    float* weights;    // (N, K) routing weights
    int32_t* offsets;  // (E + 1) first sorted row of each expert
    int32_t* src;      // (R) assignment (row*K + k) at each sorted position
    int32_t* dst;      // (R) sorted position of each assignment
    void* gu;          // (R, 2F) expert gate/up projections
    void* act;         // (R, F) expert activations
    void* out;         // (R, C) expert outputs (with the down bias), before the routing weights
} MoeActs;

// Scratch shared by the MoE blocks of a workspace.
typedef struct MoeScratch {
    void* xp;          // (R, C) the gathered rows each expert sees
    void* dy;          // (R, C) gradient of the experts' outputs, then of their inputs
    void* dact;        // (R, F)
    void* dgu;         // (R, 2F)
    void* dlogits;     // (N, E)
    float* dweights;   // (N, K)
    void* dx_router;   // (N, C) the router's share of the input gradient
} MoeScratch;

// Pointers into a block's parameter slab (compute dtype) / fp32 gradient slab; biases NULL for
// Qwen3-MoE. router_adapter (NULL: none) adds a LoRA branch to the router's logits (N, E) in the
// forward; router_adapter_backward runs its backward from the logits' gradient, adding its input
// gradient into dx (N, C). expert_adapter (NULL: none) adds the per-expert LoRA branch of
// projection proj (0: gate/up, 1: down) to its output out (R, OC) from its input inp (R, IC), on
// the dispatched rows (offsets); expert_adapter_backward accumulates its input gradient into dinp
// (R, IC) from dout (R, OC). arg: the caller's context for all of them.
typedef struct MoeWeights {
    const void *router, *router_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void (*router_adapter)(void* arg, const void* x, void* logits, int N);
    void (*router_adapter_backward)(void* arg, const void* x, const void* dlogits, void* dx,
                                    int N);
    void* adapter_arg;
    void (*expert_adapter)(void* arg, int proj, const void* inp, void* out,
                           const int32_t* offsets, int R);
    void (*expert_adapter_backward)(void* arg, int proj, const void* inp, const void* dout,
                                    void* dinp, const int32_t* offsets, int R);
} MoeWeights;
typedef struct MoeGrads {
    float *router, *router_bias, *gate_up, *gate_up_bias, *down, *down_bias;
} MoeGrads;

// Bytes of one MoeActs / of a MoeScratch for N rows.
size_t moe_acts_bytes(const ModelConfig* c, size_t act_bytes, int64_t N);
size_t moe_scratch_bytes(const ModelConfig* c, size_t act_bytes, int64_t N);
void moe_acts_alloc(MoeActs* a, const ModelConfig* c, const Ops* ops, void* ctx, int64_t N);
void moe_acts_free(MoeActs* a, const Ops* ops, void* ctx);
void moe_scratch_alloc(MoeScratch* s, const ModelConfig* c, const Ops* ops, void* ctx, int64_t N);
void moe_scratch_free(MoeScratch* s, const Ops* ops, void* ctx);
// 1 if the backend implements every op an MoE family needs.
int moe_ops_supported(const Ops* ops, const ModelConfig* c);

// y (N, C) = the MoE MLP of x (N, C) (overwritten); stats (2E, fp32, device) = this block's
// aux-loss statistics (tokens per expert, Σ_rows router probabilities).
void moe_forward(const ModelConfig* c, const Ops* ops, void* ctx, MoeScratch* s, MoeActs* a,
                 const MoeWeights* w, const void* x, void* y, float* stats, int N);
// dx (N, C) = the gradient w.r.t. x (overwritten) from dy (N, C); parameter gradients accumulate.
// counts (E, fp32, device) and aux_scale: the aux loss's gradient (aux_scale 0: none), see above.
void moe_backward(const ModelConfig* c, const Ops* ops, void* ctx, MoeScratch* s,
                  const MoeActs* a, const MoeWeights* w, const MoeGrads* g, const void* x,
                  const void* dy, void* dx, const float* counts, float aux_scale, int N);

// The aux loss of one forward from the host copies of its n_blocks blocks' stats (n_blocks, 2E)
// over N rows each: returns aux; counts (E) = tokens per expert summed over the blocks (what the
// backward needs); *load_max / *load_mean = the largest and the mean of counts.
double moe_aux_loss(const ModelConfig* c, const float* stats, int n_blocks, int64_t N,
                    float* counts, double* load_max, double* load_mean);

#endif  // LLMC_MOE_H
