/*
 * plain.h — plain (non-pipelined) training on one backend: every layer of the layer sequence in
 * order for each micro-batch, the fused loss stage, then the backward deepest first. It is the
 * reference the RoundPipe engine is tested against, and the `--device cpu` path.
 *
 * Parameters and gradients live in the host Store. On the CPU backend the device slabs ARE the
 * store's slabs (no copies); other backends get device slabs that plain_sync_params() uploads and
 * plain_sync_grads() downloads.
 */
#ifndef LLMC_PLAIN_H
#define LLMC_PLAIN_H

#include <stdint.h>

#include "model.h"
#include "ops.h"
#include "store.h"

typedef struct Plain {
    const Model* m;
    Store* s;
    const Ops* ops;
    void* ctx;
    Workspace* ws;
    int B, T;        // micro-batch capacity
    int recompute;   // 1: keep only block inputs and recompute each block in the backward
    int aliased;     // device slabs are the host store's slabs
    void** dparam;   // (n_layers) device parameter slabs (compute dtype)
    float** dgrad;   // (n_layers) device fp32 gradient slabs
    void** x;        // (L+1) residual stream: x[l] is the input of block l, x[L] of the postfix
    void* dres;      // (N, C) residual-stream gradient
    int32_t* ids;    // (N) device
    int32_t* targets;  // (N) device
    float* losses;   // (N) device
    int32_t* ids_host;
    int32_t* targets_host;
    float* losses_host;
    // MoE models, the last plain_forward_backward: the sum of the per-token cross-entropies, and
    // the aux loss (its share of the returned sum is router_aux_loss_coef · aux · B·T when on)
    double ce_sum, aux;
} Plain;

Plain* plain_create(const Model* m, Store* s, const Ops* ops, void* ctx, int B, int T,
                    int recompute);
// 1 when micro-batches of B x T tokens should recompute each block in the backward (keeping
// every block's activations would take more than 8 GiB of the backend's memory).
int plain_needs_recompute(const Model* m, int act_bytes, int B, int T);
// Bytes plain_create allocates for that shape, on the backend (ops->alloc: the workspace, the
// residual streams, the device slabs unless aliased to the store's) and on the host (the batch);
// on the CPU backend all of it is host memory. The ops' own temporaries come on top
// (model_cpu_op_temp_bytes).
size_t plain_bytes(const Model* m, int act_bytes, int aliased, int B, int T, int recompute);
void plain_free(Plain* p);
// Copy the store's parameters to the device slabs (no-op when aliased).
void plain_sync_params(Plain* p);
// Add the device gradients into the store and zero them (no-op when aliased).
void plain_sync_grads(Plain* p);

// One micro-batch: tokens (B, T+1) host. Gradients (scaled by grad_scale) accumulate on the
// device slabs. Returns the sum of the B*T per-token losses (MoE models with the aux loss on:
// plus router_aux_loss_coef · aux · B·T, so that dividing by the step's tokens gives CE + the
// weighted aux loss, the differentiated objective).
double plain_forward_backward(Plain* p, const int32_t* tokens, int B, int T, float grad_scale);
// Forward only: the sum of the per-token cross-entropies (no aux loss).
double plain_forward_loss(Plain* p, const int32_t* tokens, int B, int T);
// Logits (V, host fp32) after the last of n tokens of one sequence (n <= T).
void plain_logits_last(Plain* p, const int32_t* tokens, int n, float* logits);
// The policy-gradient objective (GRPO, model.h model_postfix_policy) of B rows of T tokens:
// ids and targets (B*T, host; targets < 0 ignored), the per-token inputs pl and outputs logp,
// losses on the device (B*T each). With compute_grad, the gradients of the summed objective
// accumulate on the device slabs (the per-token weights carry the normalisation). Returns the
// summed objective (host).
double plain_policy_forward_backward(Plain* p, const int32_t* ids, const int32_t* targets,
                                     const PolicyLoss* pl, float* logp, float* losses,
                                     int compute_grad, int B, int T);

#endif  // LLMC_PLAIN_H
