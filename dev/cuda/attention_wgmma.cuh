/*
 * dev/cuda/attention_wgmma.cuh — the lab's name for the Hopper wgmma attention forward, whose one
 * copy now lives in kernels/attention_wgmma.cuh (the kernel attention_forward_bf16 runs at HD 64
 * and 128 on sm_90a; layouts, descriptors, fragment mappings and the pipeline are derived there).
 * kernels/attention.cu includes it, so after "../../kernels/attention.cu" this include adds
 * nothing; it stays so that lab files which include it by this name (for the SW128 and wgmma
 * helpers, descriptors, WgmmaBf16, attention_forward_wgmma<BC, NWG>, attention_wgmma_available,
 * attention_wgmma_supports_head_dim) keep compiling unchanged. Include kernels/attention.cu first.
 */
#ifndef DEV_CUDA_ATTENTION_WGMMA_CUH
#define DEV_CUDA_ATTENTION_WGMMA_CUH

#include "../../kernels/attention_wgmma.cuh"

#endif  // DEV_CUDA_ATTENTION_WGMMA_CUH
