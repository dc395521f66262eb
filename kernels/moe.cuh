/*
 * moe.cuh — launchers of kernels/moe.cu, the mixture-of-experts ops of llmc/ops.h other than the
 * grouped matmul: routing (softmax / top-k, forward and backward with the aux term), the stable
 * counting-sort dispatch, gathers and combines, the router statistics of the aux loss and the
 * GPT-OSS clamped GLU. CUDA-only (CudaCtx, bf16): ops_cuda.cu and the lab dev/cuda/moe.cu include
 * it. Shapes and semantics are exactly those of ops.h (llmc/ops_cpu_moe.c is the reference);
 * every launcher enqueues on cx->stream and never waits.
 *
 * Limits (fatal with a clear message otherwise): routing and the router statistics take
 * E <= MOE_MAX_EXPERTS experts and 1 <= K <= min(E, 32) experts per row; the dispatch takes
 * E <= MOE_MAX_EXPERTS. An expert index outside [0, E) reaching the dispatch is counted as expert
 * E - 1 (every position stays in bounds) and flagged in the device error word
 * (CUDA_ERR_EXPERT), reported by the next synchronize or download.
 */
#ifndef KERNELS_MOE_CUH
#define KERNELS_MOE_CUH

#include "common.cuh"

#define MOE_MAX_EXPERTS 256  // one warp holds a row of router logits in registers (8 per lane)
#define MOE_MAX_K 32         // one lane per chosen expert

void cuda_moe_route_forward(CudaCtx* cx, int32_t* idx, float* weights, const bf16* logits, int n,
                            int E, int K, int mode);
void cuda_moe_route_backward(CudaCtx* cx, bf16* dlogits, const float* dweights, const bf16* logits,
                             const int32_t* idx, const float* weights, const float* counts,
                             float aux_scale, int n, int E, int K, int mode);
void cuda_moe_dispatch(CudaCtx* cx, int32_t* offsets, int32_t* src, int32_t* dst,
                       const int32_t* idx, int n, int E, int K);
void cuda_moe_gather(CudaCtx* cx, bf16* out, const bf16* inp, const int32_t* src, int n, int K,
                     int C);
void cuda_moe_gather_backward(CudaCtx* cx, bf16* dinp, const bf16* dout, const int32_t* dst, int n,
                              int K, int C);
void cuda_moe_combine_forward(CudaCtx* cx, bf16* out, const bf16* y, const float* weights,
                              const int32_t* dst, int n, int K, int C);
void cuda_moe_combine_backward(CudaCtx* cx, bf16* dy, float* dweights, const bf16* dout,
                               const bf16* y, const float* weights, const int32_t* dst, int n,
                               int K, int C);
void cuda_moe_router_stats(CudaCtx* cx, float* stats, const bf16* logits, const int32_t* offsets,
                           int n, int E);
void cuda_gptoss_glu_forward(CudaCtx* cx, bf16* out, const bf16* gu, int R, int F, float limit,
                             float alpha);
void cuda_gptoss_glu_backward(CudaCtx* cx, bf16* dgu, const bf16* dout, const bf16* gu, int R,
                              int F, float limit, float alpha);

#endif  // KERNELS_MOE_CUH
