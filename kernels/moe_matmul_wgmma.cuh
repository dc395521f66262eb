/*
 * moe_matmul_wgmma.cuh — variant 3 of the grouped expert GEMM (kernels/moe_matmul.cu, which
 * includes it): Hopper wgmma. (Placeholder until the kernel lands: never available.)
 */
#ifndef KERNELS_MOE_MATMUL_WGMMA_CUH
#define KERNELS_MOE_MATMUL_WGMMA_CUH

static int moe_wgmma_available() { return 0; }

static void moe_rows_launch_wgmma(CudaCtx*, bf16*, const bf16*, const bf16*, const bf16*,
                                  const int32_t*, int, int, int, int, size_t, int, int) {
    fatal("moe_matmul: the wgmma variant is not built");
}
static void moe_dw_launch_wgmma(CudaCtx*, float*, const bf16*, const bf16*, const int32_t*, int,
                                int, int, int) {
    fatal("moe_matmul: the wgmma variant is not built");
}

#endif  // KERNELS_MOE_MATMUL_WGMMA_CUH
