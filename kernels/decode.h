/*
 * decode.h — the launchers of the generation and GRPO kernels that ops_cuda.cu wires into the op
 * table (llmc/ops.h): kernels/decode.cu (the decode step's q/k-norm + RoPE with the KV-cache
 * append, decode attention, sampling; lab dev/cuda/decode.cu) and kernels/policy.cu (the clipped
 * policy-gradient objective over a chunk of logits). Semantics are ops.h's; the CPU references
 * are llmc/ops_cpu_attention.c (ops_cpu_attention_decode), llmc/generate.c (gen_sample) and
 * llmc/ops_cpu.c (the policy op). All launchers enqueue on cx->stream and return.
 */
#ifndef KERNELS_DECODE_H
#define KERNELS_DECODE_H

#include "common.cuh"

// out (n, QKV): row i's q and k heads normed (when the weights are given) and rotated at position
// pos[i], v copied; the rotated k and the v also into kc, vc (slots, maxT, KVH*HD) at
// (slot[i], pos[i]). cos/sin (maxT, HD/2) fp32 tables. pos, slot (n) device int32.
void cuda_decode_rope_append(CudaCtx* cx, bf16* out, bf16* kc, bf16* vc, const bf16* inp,
                             const bf16* q_norm_w, const bf16* k_norm_w, const float* cos,
                             const float* sin, const int32_t* pos, const int32_t* slot, int n,
                             int maxT, int H, int KVH, int HD, float eps);

// ops.h attention_decode (split-K with an ordered combine; scratch in SCRATCH_ATTN).
int cuda_attention_decode_supports(int H, int KVH, int HD);
size_t cuda_attention_decode_scratch_bytes(int n, int maxT, int H, int HD);
void cuda_attention_decode(CudaCtx* cx, bf16* out, const bf16* qkv, const bf16* kc,
                           const bf16* vc, const int32_t* slot, const int32_t* len,
                           const bf16* sinks, int n, int maxT, int H, int KVH, int HD,
                           int window);

// ops.h sample_tokens: row i of logits (n, V) sampled with the uniform u[i] (temperature <= 0:
// greedy); tokens (n), logp (n, 2) [under the sampling distribution, under the full softmax].
void cuda_sample_tokens(CudaCtx* cx, int32_t* tokens, float* logp, const bf16* logits,
                        const float* u, int n, int V, float temperature);

// ops.h policy_forward_backward on bf16 logits (in place), fp32 math.
void cuda_policy_forward_backward(CudaCtx* cx, bf16* logits, float* logp, float* losses,
                                  const int32_t* targets, const float* old_logp,
                                  const float* ref_logp, const float* adv, const float* weight,
                                  int n, int V, float inv_temp, float clip_low, float clip_high,
                                  float kl_beta, int compute_grad);

#endif  // KERNELS_DECODE_H
