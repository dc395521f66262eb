/*
 * moe_matmul.h — the grouped GEMM of the experts (kernels/moe_matmul.cu): the launchers
 * ops_cuda.cu wires into moe_matmul_forward / moe_matmul_backward, and the variant numbers the
 * lab (dev/cuda/moe_matmul.cu) selects.
 *
 * Semantics are those of llmc/ops.h (and the CPU reference llmc/ops_cpu_moe.c): rows
 * offsets[e] .. offsets[e+1] of inp (R, IC) go through expert e; w is (E, OC, IC) when
 * w_in_out == 0 (nn.Linear) or (E, IC, OC) when w_in_out == 1 (GPT-OSS). offsets (E + 1) live
 * in device memory and are never read by the host: tiles find their expert on the device.
 */
#ifndef KERNELS_MOE_MATMUL_H
#define KERNELS_MOE_MATMUL_H

#include "common.cuh"

// Variants: 0 lets the launcher pick (the production choice), else force one. A forced variant
// that cannot take the problem (shapes not multiples of 8, misaligned pointers, a device without
// wgmma) is fatal.
enum {
    MOE_MM_AUTO = 0,
    MOE_MM_NAIVE = 1,  // shared-memory tiles, fp32 FMA: any shape and alignment
    MOE_MM_MMA = 2,    // mma.sync m16n8k16 + ldmatrix + cp.async ring: every sm_80+ GPU
    MOE_MM_WGMMA = 3,  // Hopper wgmma (sm_90a builds on compute capability 9.0)
    MOE_MM_VARIANTS = 3
};

// out (R, OC) = per expert inp · W_e(ᵀ) (+ bias (E, OC)), bf16, overwritten on the experts'
// rows.
void cuda_moe_matmul_forward(CudaCtx* cx, int variant, bf16* out, const bf16* inp, const bf16* w,
                             const bf16* bias, const int32_t* offsets, int R, int E, int IC,
                             int OC, int w_in_out);
// dinp (R, IC) bf16 overwritten (NULL skips); dw fp32 += (w's layout; experts without rows are
// left untouched); dbias (E, OC) fp32 += column sums per expert (NULL skips).
void cuda_moe_matmul_backward(CudaCtx* cx, int variant, bf16* dinp, float* dw, float* dbias,
                              const bf16* dout, const bf16* inp, const bf16* w,
                              const int32_t* offsets, int R, int E, int IC, int OC, int w_in_out);
// The variant MOE_MM_AUTO runs for these sizes and pointers on the current device.
int cuda_moe_matmul_pick(int IC, int OC, const void* const* ptrs, int n_ptrs);

#endif  // KERNELS_MOE_MATMUL_H
