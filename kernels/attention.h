/*
 * attention.h — causal grouped-query flash attention on the GPU (bf16 in and out, fp32
 * accumulation), forward and backward. Implemented in kernels/attention.cu; developed and
 * benchmarked in dev/cuda/attention.cu.
 *
 * Layout: one packed projection row per token, [q heads | k heads | v heads], QKV = (H+2*KVH)*HD
 * columns. Query head h reads kv head h / (H/KVH) (H must be a multiple of KVH). Scale 1/sqrt(HD);
 * key j is visible to query i iff j <= i. All calls are asynchronous on `stream` (a cudaStream_t
 * passed as void*); bad arguments and CUDA failures print a message and exit(1). The sink entry
 * points (GPT-OSS) add learned per-head sinks and a sliding window to the same kernels.
 */
#ifndef KERNELS_ATTENTION_H
#define KERNELS_ATTENTION_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// qkv: bf16 (B*T, (H + 2*KVH)*HD) packed rows [q heads | k heads | v heads]; query head h uses
// kv head h / (H/KVH). out: bf16 (B*T, H*HD). lse: fp32 (B, H, T) log-sum-exp of the scaled
// logits (scale 1/sqrt(HD)), saved for the backward. Causal: key j visible to query i iff j <= i.
void attention_forward_bf16(void* out, float* lse, const void* qkv, int B, int T, int H, int KVH,
                            int HD, void* stream);
size_t attention_backward_workspace_bytes(int B, int T, int H, int KVH, int HD);
// dqkv: bf16 (B*T, QKV) gradient w.r.t. q, k, v (overwritten, every element written). dout:
// bf16 (B*T, H*HD). workspace: device memory of the size above (e.g. D = rowsum(dO*O) in fp32).
// Deterministic: no floating-point atomics (dK/dV of a kv head sum its query-head group inside
// one block in a fixed order; dQ by a separate pass over kv blocks, or another fixed-order scheme).
void attention_backward_bf16(void* dqkv, const void* dout, const void* qkv, const void* out,
                             const float* lse, void* workspace, int B, int T, int H, int KVH,
                             int HD, void* stream);
// Attention with sinks and sliding windows (GPT-OSS), the same kernels compiled with the option:
// key j visible to query i iff j <= i and (window == 0 or j > i - window); sinks: bf16 (H), one
// more logit s_h per head in every row's softmax denominator (unscaled: the logits' domain after
// the 1/sqrt(HD) scale), with no value; NULL for none. lse includes the sink. window 0 (or >= T):
// causal only; window < 0 is an error.
void attention_sink_forward_bf16(void* out, float* lse, const void* qkv, const void* sinks, int B,
                                 int T, int H, int KVH, int HD, int window, void* stream);
// dqkv as attention_backward_bf16 (overwritten); dsinks: fp32 (H), += -sum over (b, t) of
// exp(s_h - lse) * rowsum(dout * out), deterministic (NULL, or sinks NULL: skipped). The
// workspace is attention_backward_workspace_bytes.
void attention_sink_backward_bf16(void* dqkv, float* dsinks, const void* dout, const void* qkv,
                                  const void* out, const float* lse, const void* sinks,
                                  void* workspace, int B, int T, int H, int KVH, int HD,
                                  int window, void* stream);
// dsinks (H) fp32 += -sum over (b, t) of exp(sinks[h] - lse) * D with D = rowsum(dout * out)
// (B, H, T) fp32 as the backwards leave it in their workspace: the sink part of
// attention_sink_backward_bf16, for a backward that computed D elsewhere (the simple kernels).
// Nothing when dsinks or sinks is NULL.
void attention_sink_dsinks_bf16(float* dsinks, const void* sinks, const float* lse,
                                const float* D, int B, int T, int H, void* stream);
// 1 if HD is supported (at least 16, 32, 64, 128), else 0.
int attention_supports_head_dim(int HD);
// 1 when the forward and backward at this head dim run the Hopper wgmma kernels on the current
// device (HD 64 or 128, a build with sm_90a device code, a compute capability 9.0 device), 0 when
// they run the mma.sync ones.
int attention_uses_wgmma(int HD);

#ifdef __cplusplus
}
#endif

#endif  // KERNELS_ATTENTION_H
