/*
 * ops.h — the operation table a compute backend implements. The model (model.c) is written once
 * against it; ops_cpu.c is the fp32 reference, the CUDA backend (bf16 storage, fp32 accumulation)
 * implements the same table.
 *
 * Conventions:
 *  - `void*` buffers hold activations or weights in the backend's compute dtype (ops->act_bytes
 *    bytes per element: fp32 on the CPU, bf16 on CUDA). `float*` buffers are always fp32
 *    (parameter gradients, rstd, log-sum-exp, per-token losses). `int32_t*` are token ids.
 *    All pointers are device pointers of the backend (plain host pointers on the CPU).
 *  - N = B*T rows (tokens). Row-major everywhere. Weights follow nn.Linear: W is (OC, IC) and
 *    a matmul computes out = inp · Wᵀ (+ bias).
 *  - Parameter gradients always ACCUMULATE (+=) in fp32: micro-batches and chunks add up.
 *  - Input gradients: documented per op; `dinp` of rmsnorm ACCUMULATES (it writes into the
 *    residual-stream gradient), every other dinp is OVERWRITTEN (=). A NULL dinp means "skip".
 *  - The packed qkv layout: one row is [q (H*HD) | k (KVH*HD) | v (KVH*HD)], QKV = (H+2*KVH)*HD.
 *    The packed gate/up layout: one row is [gate (F) | up (F)].
 *  - Results must not depend on the number of threads (fixed work split), so runs are repeatable.
 *  - The mixture-of-experts and sink-attention ops at the end of the table may be NULL on a
 *    backend that does not implement them yet: the model refuses MoE families there
 *    (workspace_create). R = n*K routed rows: the n rows of a block each go to K experts.
 */
#ifndef LLMC_OPS_H
#define LLMC_OPS_H

#include <stddef.h>
#include <stdint.h>

// How router logits become routing weights (moe_route_forward).
typedef enum {
    MOE_ROUTE_SOFTMAX_TOPK = 0,  // Qwen3-MoE: p = softmax(logits) over E, the K largest p
    MOE_ROUTE_SOFTMAX_TOPK_NORM, // ... renormalised to sum to 1 (norm_topk_prob)
    MOE_ROUTE_TOPK_SOFTMAX       // GPT-OSS: the K largest logits, softmax over those K
} MoeRouteMode;

typedef struct Ops {
    const char* name;  // "cpu", "cuda"
    int act_bytes;     // bytes per compute-dtype element

    // ---- memory (backend buffers) ----
    void* (*alloc)(void* ctx, size_t bytes);  // zero-initialised; fatal on failure
    void (*free)(void* ctx, void* p);
    void (*zero)(void* ctx, void* p, size_t bytes);
    void (*copy)(void* ctx, void* dst, const void* src, size_t bytes);  // device to device
    // Host fp32 <-> compute-dtype buffer conversions (n elements).
    void (*upload_f32)(void* ctx, void* dst, const float* src, size_t n);
    void (*download_f32)(void* ctx, float* dst, const void* src, size_t n);
    // Raw byte copies host <-> device (fp32 buffers, ids).
    void (*upload)(void* ctx, void* dst, const void* src, size_t bytes);
    void (*download)(void* ctx, void* dst, const void* src, size_t bytes);
    void (*synchronize)(void* ctx);
    // Transfers that overlap the backend's work (NULL: the backend has none; the generator then
    // waits on each decode step), through page-locked buffers of the backend's own, one per
    // direction and `slot` (0 or 1). upload_async: src is taken at once (the caller may reuse it
    // on return); dst receives it after the work issued before. download_start: src's bytes as
    // the work issued before leaves them go to slot's host buffer; returns at once.
    // download_finish: waits for that slot's download_start, reports the device errors flagged
    // before it (as download does) and copies its first `bytes` to dst.
    void (*upload_async)(void* ctx, void* dst, const void* src, size_t bytes, int slot);
    void (*download_start)(void* ctx, const void* src, size_t bytes, int slot);
    void (*download_finish)(void* ctx, void* dst, size_t bytes, int slot);

    // ---- token embedding ----
    // out (N, C) = wte[ids[n]]. ids (N), wte (V, C).
    void (*embedding_forward)(void* ctx, void* out, const int32_t* ids, const void* wte, int N,
                              int C);
    // dwte (V, C) += scatter of dout (N, C) by ids. Deterministic (no float atomics).
    void (*embedding_backward)(void* ctx, float* dwte, const void* dout, const int32_t* ids, int N,
                               int C, int V);

    // ---- RMSNorm ----
    // out = w * (inp * rstd), rstd = 1/sqrt(mean(inp²) + eps). inp/out (N, C), w (C), rstd (N).
    void (*rmsnorm_forward)(void* ctx, void* out, float* rstd, const void* inp, const void* w,
                            int N, int C, float eps);
    // Fused residual: res = a + b, then out = rmsnorm(res). res may alias a.
    void (*residual_rmsnorm_forward)(void* ctx, void* res, void* out, float* rstd, const void* a,
                                     const void* b, const void* w, int N, int C, float eps);
    // dinp (N, C) += d/dinp; dw (C) += Σ_rows dout * inp * rstd.
    void (*rmsnorm_backward)(void* ctx, void* dinp, float* dw, const void* dout, const void* inp,
                             const void* w, const float* rstd, int N, int C);

    // ---- matmul ----
    // out (N, OC) = inp (N, IC) · w (OC, IC)ᵀ + bias (OC) (bias may be NULL).
    void (*matmul_forward)(void* ctx, void* out, const void* inp, const void* w, const void* bias,
                           int N, int IC, int OC);
    // dinp (N, IC) = dout · w (overwritten; NULL skips); dw (OC, IC) += doutᵀ · inp;
    // dbias (OC) += Σ_rows dout (NULL skips).
    void (*matmul_backward)(void* ctx, void* dinp, float* dw, float* dbias, const void* dout,
                            const void* inp, const void* w, int N, int IC, int OC);

    // ---- Qwen3 QK-norm + RoPE on the packed qkv rows ----
    // For each row n (position t = n % T) and each q head and k head: if the norm weight is
    // non-NULL, RMSNorm over HD with that weight (rstd saved in rstd (N, H+KVH): q heads first);
    // then rotate_half RoPE: x'_i = x_i cos_i - x_{i+HD/2} sin_i, x'_{i+HD/2} = x_{i+HD/2} cos_i +
    // x_i sin_i, with cos/sin (T, HD/2) fp32 tables. The v part is copied. out must not alias inp.
    void (*qknorm_rope_forward)(void* ctx, void* out, float* rstd, const void* inp,
                                const void* q_norm_w, const void* k_norm_w, const float* cos,
                                const float* sin, int B, int T, int H, int KVH, int HD, float eps);
    // dinp (N, QKV) = gradient through RoPE (rotation by -φ) and the norms (overwritten);
    // dq_norm_w, dk_norm_w (HD) += (NULL when the family has no QK-norm).
    void (*qknorm_rope_backward)(void* ctx, void* dinp, float* dq_norm_w, float* dk_norm_w,
                                 const void* dout, const void* inp, const void* q_norm_w,
                                 const void* k_norm_w, const float* rstd, const float* cos,
                                 const float* sin, int B, int T, int H, int KVH, int HD);

    // ---- causal grouped-query attention ----
    // out (N, H*HD): for query head h (kv head h / (H/KVH)), softmax(q·kᵀ / sqrt(HD)) · v over
    // keys 0..t (causal). qkv (N, QKV) packed. lse (B, H, T) saves the log-sum-exp of the scaled
    // logits for the backward.
    void (*attention_forward)(void* ctx, void* out, float* lse, const void* qkv, int B, int T,
                              int H, int KVH, int HD);
    // dqkv (N, QKV) = gradient w.r.t. q, k, v (overwritten).
    void (*attention_backward)(void* ctx, void* dqkv, const void* dout, const void* qkv,
                               const void* out, const float* lse, int B, int T, int H, int KVH,
                               int HD);

    // ---- SwiGLU ----
    // out (N, F) = silu(gate) * up with gu (N, 2F) = [gate | up].
    void (*swiglu_forward)(void* ctx, void* out, const void* gu, int N, int F);
    // out (N, F) = silu(gate) * up of gu = inp (N, IC) · w (2F, IC)ᵀ without storing gu, with the
    // roundings of matmul_forward then swiglu_forward. Returns 0 (nothing done: call those two)
    // when the backend has no fused path for the shape; NULL: none (the CPU backend).
    int (*matmul_swiglu_forward)(void* ctx, void* out, const void* inp, const void* w, int N,
                                 int IC, int F);
    // dgu (N, 2F) = gradient w.r.t. gate and up (overwritten).
    void (*swiglu_backward)(void* ctx, void* dgu, const void* dout, const void* gu, int N, int F);

    // ---- elementwise ----
    // out = a + b (n elements; out may alias a or b).
    void (*add)(void* ctx, void* out, const void* a, const void* b, size_t n);
    // out = s · inp (n elements; out may alias inp).
    void (*scale)(void* ctx, void* out, const void* inp, float s, size_t n);
    // dst (N, w) = src (N, ld) columns [c0, c0 + w) (a strided copy: the prefill's keys and values).
    void (*copy_cols)(void* ctx, void* dst, const void* src, int N, int ld, int c0, int w);
    // dst += src in fp32 on both backends (gradient buffers: a tied head's into its owner's).
    void (*add_f32)(void* ctx, float* dst, const float* src, size_t n);

    // ---- softmax cross-entropy over a chunk of logits ----
    // logits (n, V). losses[i] = logsumexp(logits[i]) - logits[i][targets[i]] (fp32 math).
    // If compute_grad, logits is overwritten with dlogits = (softmax - onehot) * grad_scale.
    // targets[i] < 0 means "ignored": loss 0 and zero gradient.
    void (*crossentropy_forward_backward)(void* ctx, void* logits, float* losses,
                                          const int32_t* targets, int n, int V, float grad_scale,
                                          int compute_grad);

    // ---- generation and policy-gradient ops (generate.h, grpo.h; may be NULL on a backend that
    // does not implement them yet: generation and --rl refuse that backend) ----
    // Decode attention, one query row per sequence against its KV cache: for row i (n rows),
    // the q heads of qkv row i (N, QKV packed; only q is read) attend to keys 0 .. len[i]-1 of
    // cache slot slot[i]: kc, vc (slots, maxT, KVH*HD) in the compute dtype. window > 0 keeps
    // the last `window` keys; sinks (H) or NULL adds one value-less logit per head to the
    // denominator (as attention_sink_forward). out (n, H*HD) overwritten. slot, len (n) int32.
    // In a recorded op sequence (graph_begin) slot and len must come from before the sequence and
    // the ops recorded before this one may write only key len[i]-1 of each row (the decode step's
    // new key): the CUDA kernels read the older keys while the op before still runs.
    void (*attention_decode)(void* ctx, void* out, const void* qkv, const void* kc, const void* vc,
                             const int32_t* slot, const int32_t* len, const void* sinks, int n,
                             int maxT, int H, int KVH, int HD, int window);
    // The clipped policy-gradient objective over a chunk of logits (n, V), per token i with a
    // target (targets[i] >= 0; < 0: ignored, logp 0, zero gradient):
    //   logp_i = log softmax(logits_i · inv_temp)[target]           (into logp, fp32)
    //   r_i = exp(logp_i - old_logp_i), A = adv_i, w = weight_i
    //   loss_i = w · (-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_beta · k3_i)
    //   k3_i = exp(ref_i - logp_i) - (ref_i - logp_i) - 1           (ref_logp NULL: no KL term)
    // losses (n) gets loss_i; when compute_grad, logits is overwritten with dloss_i/dlogits =
    // coef_i · inv_temp · (onehot - softmax), coef_i = dloss_i/dlogp_i (0 where the clip is
    // active). old_logp, ref_logp, adv, weight (n) fp32.
    void (*policy_forward_backward)(void* ctx, void* logits, float* logp, float* losses,
                                    const int32_t* targets, const float* old_logp,
                                    const float* ref_logp, const float* adv, const float* weight,
                                    int n, int V, float inv_temp, float clip_low, float clip_high,
                                    float kl_beta, int compute_grad);

    // The decode step's q/k-norm + RoPE with the KV-cache append (NULL: the model runs
    // qknorm_rope_forward per row and copies): out (n, QKV) = qknorm_rope_forward of row i as a
    // one-token sequence at position pos[i] (cos/sin (maxT, HD/2) tables of every position), and
    // its rotated k and its v written to kc, vc (slots, maxT, KVH*HD) at (slot[i], pos[i]).
    // pos, slot (n) int32 backend buffers. No rstd is kept (no backward).
    void (*decode_rope_append)(void* ctx, void* out, void* kc, void* vc, const void* inp,
                               const void* q_norm_w, const void* k_norm_w, const float* cos,
                               const float* sin, const int32_t* pos, const int32_t* slot, int n,
                               int maxT, int H, int KVH, int HD, float eps);
    // Sampling on the backend (NULL: the host samples, generate.c gen_sample): row i of logits
    // (n, V) draws tokens[i] from softmax(logits_i / temperature) by the inverse-CDF walk in
    // vocabulary order with the uniform u[i] in [0, 1) (the host's per-sequence RNG draws it, so
    // both give the same token unless two cumulative sums straddle u·Σ within rounding);
    // temperature <= 0: the first argmax. logp (n, 2) fp32: [the token's log-prob under the
    // distribution it was drawn from, under the full tempered softmax] (0 when greedy). No top-k
    // or top-p: the host samples those. tokens, logp, u are backend buffers.
    void (*sample_tokens)(void* ctx, int32_t* tokens, float* logp, const void* logits,
                          const float* u, int n, int V, float temperature);
    // A decode step's input tokens taken from the step before it on the backend, so the step can
    // be issued before the host has read that one's samples: ids[k] = prev[from[k]] where
    // from[k] >= 0, ids[k] unchanged where from[k] < 0 (k < n; int32 backend buffers).
    void (*gather_ids)(void* ctx, int32_t* ids, const int32_t* prev, const int32_t* from, int n);
    // Op profile phases (NULL: the backend has none; a no-op unless --profile-ops): the ops issued
    // from now on count toward phase `name` until the next call (NULL: no phase).
    void (*profile_phase)(void* ctx, const char* name);
    // Recorded sequences of ops (NULL: the backend has none; CUDA graphs). graph_begin: the ops
    // issued from now on are recorded, not run (-1: not now, e.g. while --profile-ops times ops
    // one by one); only ops whose buffers already have their size may be recorded (no scratch
    // grows, no host transfer). graph_end: the recording as a replayable graph (NULL: the
    // recording was refused). graph_launch: replay it (the same ops on the same buffers, so the
    // same bits); -1 when it is stale (a scratch buffer it used has moved since): free it and
    // record again. graph_free releases one.
    int (*graph_begin)(void* ctx);
    void* (*graph_end)(void* ctx);
    int (*graph_launch)(void* ctx, void* graph);
    void (*graph_free)(void* ctx, void* graph);

    // ---- attention with sinks and sliding windows (GPT-OSS) ----
    // As attention_forward, with key j visible to query t iff j <= t and (window == 0 or
    // j > t - window), and, when sinks (H) is non-NULL, one more logit s_h per head in the softmax
    // denominator that has no value: o = Σ_j e^{a_j - m} v_j / (Σ_j e^{a_j - m} + e^{s_h - m}).
    // lse (B, H, T) is the log of that whole denominator (sink included).
    void (*attention_sink_forward)(void* ctx, void* out, float* lse, const void* qkv,
                                   const void* sinks, int B, int T, int H, int KVH, int HD,
                                   int window);
    // dqkv (N, QKV) overwritten; dsinks (H) += -Σ_rows p_sink · rowsum(dout ∘ out) (NULL skips).
    void (*attention_sink_backward)(void* ctx, void* dqkv, float* dsinks, const void* dout,
                                    const void* qkv, const void* out, const float* lse,
                                    const void* sinks, int B, int T, int H, int KVH, int HD,
                                    int window);

    // ---- mixture of experts ----
    // Routing of n rows over E experts, K per row: idx (n, K) the chosen experts, best first
    // (ties: the lower expert index first), weights (n, K) fp32 their routing weights, from the
    // router logits (n, E) (MoeRouteMode; the softmax in fp32).
    void (*moe_route_forward)(void* ctx, int32_t* idx, float* weights, const void* logits, int n,
                              int E, int K, int mode);
    // dlogits (n, E) (overwritten) = the routing's backward of dweights (n, K) fp32, plus, when
    // aux_scale != 0, the load-balancing term aux_scale · p_j (counts_j - Σ_e counts_e p_e) with
    // p = softmax(logits) and counts (E) fp32 (the gradient of aux_scale · Σ_e counts_e Σ_rows p_e).
    void (*moe_route_backward)(void* ctx, void* dlogits, const float* dweights, const void* logits,
                               const int32_t* idx, const float* weights, const float* counts,
                               float aux_scale, int n, int E, int K, int mode);
    // Sort the R = n*K assignments r = row*K + k by expert, stably (row, then k): offsets (E+1)
    // prefix sums of the tokens per expert, src (R) the assignment at each sorted position, dst (R)
    // the sorted position of each assignment (src[dst[r]] == r).
    void (*moe_dispatch)(void* ctx, int32_t* offsets, int32_t* src, int32_t* dst,
                         const int32_t* idx, int n, int E, int K);
    // out (R, C) = inp[src[i] / K]: each expert's rows, grouped by expert.
    void (*moe_gather)(void* ctx, void* out, const void* inp, const int32_t* src, int n, int K,
                       int C);
    // dinp (n, C) = Σ_k dout[dst[row*K + k]], k in order (overwritten): the gather's backward.
    void (*moe_gather_backward)(void* ctx, void* dinp, const void* dout, const int32_t* dst, int n,
                                int K, int C);
    // Grouped matmul: rows offsets[e] .. offsets[e+1] of inp (R, IC) through expert e's weight,
    // out (R, OC) = inp · W_eᵀ + bias_e with w (E, OC, IC) (w_in_out 0, nn.Linear), or
    // out = inp · W_e + bias_e with w (E, IC, OC) (w_in_out 1, GPT-OSS). bias (E, OC) or NULL.
    void (*moe_matmul_forward)(void* ctx, void* out, const void* inp, const void* w,
                               const void* bias, const int32_t* offsets, int R, int E, int IC,
                               int OC, int w_in_out);
    // dinp (R, IC) overwritten (NULL skips); dw (w's layout) += each expert's doutᵀ·inp over its
    // rows; dbias (E, OC) += each expert's Σ_rows dout (NULL skips).
    void (*moe_matmul_backward)(void* ctx, void* dinp, float* dw, float* dbias, const void* dout,
                                const void* inp, const void* w, const int32_t* offsets, int R,
                                int E, int IC, int OC, int w_in_out);
    // GPT-OSS expert activation on gu (R, 2F) with gate/up interleaved (gate = even columns):
    // g = min(gate, limit), u = clamp(up, -limit, limit), out (R, F) = (u + 1) · g · σ(alpha g).
    void (*gptoss_glu_forward)(void* ctx, void* out, const void* gu, int R, int F, float limit,
                               float alpha);
    // dgu (R, 2F) overwritten; zero where a clamp is active.
    void (*gptoss_glu_backward)(void* ctx, void* dgu, const void* dout, const void* gu, int R,
                                int F, float limit, float alpha);
    // out (n, C) = Σ_k weights[row, k] · y[dst[row*K + k]], k in order (overwritten).
    void (*moe_combine_forward)(void* ctx, void* out, const void* y, const float* weights,
                                const int32_t* dst, int n, int K, int C);
    // dy (R, C) = weights · dout of the row (overwritten); dweights (n, K) fp32 (overwritten) =
    // dout[row] · y[dst[row*K + k]].
    void (*moe_combine_backward)(void* ctx, void* dy, float* dweights, const void* dout,
                                 const void* y, const float* weights, const int32_t* dst, int n,
                                 int K, int C);
    // One block's load statistics for the aux loss (overwritten, fp32): stats[e] = rows routed to
    // expert e (offsets[e+1] - offsets[e]), stats[E + e] = Σ_rows softmax(logits)[e].
    void (*moe_router_stats)(void* ctx, float* stats, const void* logits, const int32_t* offsets,
                             int n, int E);

    // ---- LoRA (lora.h): an adapter's products on column ranges of fused rows ----
    // out (N, ld) columns [c0, c0 + OC) = scale · inp · w (OC, IC)ᵀ, added to what they hold when
    // accumulate (else overwritten; the other columns untouched). inp (N, IC) has its rows ldi
    // apart (ldi >= IC: a column range of a wider buffer, as one adapter's part of a fused t).
    void (*matmul_cols_forward)(void* ctx, void* out, int accumulate, const void* inp, int ldi,
                                const void* w, float scale, int N, int IC, int OC, int ld, int c0);
    // With g = scale · dout (N, ld) columns [c0, c0 + OC): dinp = g · w (accumulate: +=; NULL
    // skips) and dw (OC, IC) += gᵀ · inp (NULL skips), where dinp and inp are (N, IC) with their
    // rows ldi apart (ldi >= IC).
    void (*matmul_cols_backward)(void* ctx, void* dinp, int accumulate, float* dw,
                                 const void* dout, const void* inp, const void* w, float scale,
                                 int N, int IC, int ldi, int OC, int ld, int c0);
    // Inverted dropout with a counter-based mask: out (N, C) = inp · keep / (1 - p), where
    // element (i, j) is kept iff lora_dropout_hash(seed, (row0 + i) · C + j) >= p · 2^32 (the same
    // mask on every backend, for any row chunking). It is its own backward (the same call on the
    // output gradient). out may alias inp.
    void (*dropout)(void* ctx, void* out, const void* inp, float p, uint64_t seed, int64_t row0,
                    int N, int C);

    // ---- a frozen base held in ggml blocks (quant.h) ----
    // out (n) compute dtype = the n elements of blocks (a device buffer) of ggml type `type`
    // (GGML_TYPE_Q8_0, _Q4_K, _MXFP4; n a multiple of its block), as ggml's dequantize_row_*.
    void (*dequantize)(void* ctx, void* out, const void* blocks, int type, size_t n);
} Ops;

// The dropout mask's hash (splitmix64 finaliser of seed + (i + 1)·golden), its top 32 bits.
static inline uint32_t lora_dropout_hash(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32);
}
// Elements whose hash is below this are dropped: p · 2^32, rounded down, capped.
static inline uint32_t lora_dropout_threshold(float p) {
    double t = (double)p * 4294967296.0;
    return t >= 4294967295.0 ? 4294967295u : (uint32_t)t;
}

// The CPU fp32 reference backend. ctx = ops_cpu_create(n_threads) (n_threads <= 0: all CPUs).
extern const Ops ops_cpu;
void* ops_cpu_create(int n_threads);
void ops_cpu_destroy(void* ctx);
// Host bytes one op of the CPU backend allocates for itself while it runs, on top of the buffers
// it is given (freed before it returns; memory estimates add the largest): a matmul's packed
// operands, for the product (M, K) x (K, Nc); the attention's packed panels and its per-task
// tiles with n_threads tasks at once (backward or forward, whichever needs more), or the qk-norm
// backward's per-task partials.
size_t ops_cpu_gemm_temp_bytes(int64_t M, int64_t Nc, int64_t K);
size_t ops_cpu_attention_temp_bytes(int B, int T, int H, int KVH, int HD, int n_threads);

#endif  // LLMC_OPS_H
