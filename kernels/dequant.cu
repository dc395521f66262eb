/*
 * dequant.cu — ggml blocks (Q8_0, Q4_K, MXFP4) to bf16 on the GPU (dequant.h): the frozen LoRA
 * base's quantised tensors, expanded per stage from the staging slot into the parameter slot.
 *
 * Block layouts (ggml-common.h; the CPU twin is llmc/gguf_quant.c):
 *   Q8_0   34 bytes / 32: d (f16), qs[32] int8                 y = qs[j] * d
 *   Q4_K  144 bytes / 256: d, dmin (f16), scales[12] (8 six-bit scale/min pairs), qs[128]:
 *          sub-block s (32 elements) = nibbles of qs[32 (s/2) ..], low for even s, high for odd
 *          y = d * sc_s * q - dmin * m_s
 *   MXFP4  17 bytes / 32: e (E8M0), qs[16]: element j low nibble of qs[j], j + 16 high nibble
 *          y = kvalues[q] * 2^(e - 128)     (kvalues: E2M1 times two)
 * Every product is exact in fp32, so the device and the CPU give the same fp32 value, rounded
 * once to bf16 (no FMA contraction can change an exact product's sum either).
 *
 * Variant 1 (naive): one thread per element, reading its block's header per element. Variant 2
 * (production): one thread per 32-element (sub-)block, the header and 16/32 quant bytes read
 * once, the 32 outputs written as four 16-byte stores (out 16-byte aligned; else variant 1).
 * Memory-bound: the lab (dev/cuda/dequant.cu) reports GB/s of blocks read + bf16 written.
 */
#include <cuda_fp16.h>

#include "common.cuh"
#include "dequant.h"

// ggml type codes (llmc/gguf.h's GgmlType)
static constexpr int DQ_Q8_0 = 8, DQ_Q4_K = 12, DQ_MXFP4 = 39;

// ----------------------------------------------------------------------------
// per-element decoding (shared by both variants)

__device__ __forceinline__ float dq_f16(const uint8_t* p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

// 2^(e - 128) from the bits (ggml's GGML_E8M0_TO_FP32_HALF)
__device__ __forceinline__ float dq_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    return __uint_as_float(bits);
}

__constant__ int8_t dq_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Six-bit scale and min of sub-block j of a Q4_K block (ggml's get_scale_min_k4).
__device__ __forceinline__ void dq_q4k_scale_min(int j, const uint8_t* s, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// ----------------------------------------------------------------------------
// variant 1: one thread per element

__global__ void dequant_naive_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ blocks,
                                     int type, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float y;
        if (type == DQ_Q8_0) {
            const uint8_t* b = blocks + (i / 32) * 34;
            y = __fmul_rn((float)(int8_t)b[2 + i % 32], dq_f16(b));
        } else if (type == DQ_MXFP4) {
            const uint8_t* b = blocks + (i / 32) * 17;
            const int j = (int)(i % 32);
            const int q = j < 16 ? (b[1 + j] & 0x0F) : (b[1 + j - 16] >> 4);
            y = __fmul_rn((float)dq_kvalues_mxfp4[q], dq_e8m0_half(b[0]));
        } else {  // Q4_K
            const uint8_t* b = blocks + (i / 256) * 144;
            const int j = (int)(i % 256), s = j / 32, l = j % 32;
            int sc, m;
            dq_q4k_scale_min(s, b + 4, &sc, &m);
            const float d = __fmul_rn(dq_f16(b), (float)sc), dm = __fmul_rn(dq_f16(b + 2), (float)m);
            const uint8_t qb = b[16 + 32 * (s / 2) + l];
            const int q = (s & 1) ? (qb >> 4) : (qb & 0x0F);
            y = __fsub_rn(__fmul_rn(d, (float)q), dm);
        }
        out[i] = __float2bfloat16_rn(y);
    }
}

// ----------------------------------------------------------------------------
// variant 2: one thread per 32-element (sub-)block, 16-byte stores

__device__ __forceinline__ void store32(bf16* out, const float* y) {
    uint4* o = reinterpret_cast<uint4*>(out);
#pragma unroll
    for (int v = 0; v < 4; v++) {
        __nv_bfloat162 h[4];
#pragma unroll
        for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(y[8 * v + 2 * k], y[8 * v + 2 * k + 1]);
        o[v] = *reinterpret_cast<uint4*>(h);
    }
}

__global__ void dequant_subblock_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ blocks,
                                        int type, size_t n_sub) {
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n_sub;
         t += (size_t)gridDim.x * blockDim.x) {
        float y[32];
        if (type == DQ_Q8_0) {
            const uint8_t* b = blocks + t * 34;
            const float d = dq_f16(b);
#pragma unroll
            for (int j = 0; j < 32; j++) y[j] = __fmul_rn((float)(int8_t)b[2 + j], d);
        } else if (type == DQ_MXFP4) {
            const uint8_t* b = blocks + t * 17;
            const float d = dq_e8m0_half(b[0]);
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const uint8_t q = b[1 + j];
                y[j] = __fmul_rn((float)dq_kvalues_mxfp4[q & 0x0F], d);
                y[j + 16] = __fmul_rn((float)dq_kvalues_mxfp4[q >> 4], d);
            }
        } else {  // Q4_K: sub-block s of block t / 8
            const uint8_t* b = blocks + (t / 8) * 144;
            const int s = (int)(t % 8);
            int sc, m;
            dq_q4k_scale_min(s, b + 4, &sc, &m);
            const float d = __fmul_rn(dq_f16(b), (float)sc), dm = __fmul_rn(dq_f16(b + 2), (float)m);
            const uint4* qv = reinterpret_cast<const uint4*>(b + 16 + 32 * (s / 2));
            // (b + 16 is 16-byte aligned only when the block is; read bytes otherwise)
            uint8_t qs[32];
            if ((reinterpret_cast<uintptr_t>(qv) & 15) == 0) {
                *reinterpret_cast<uint4*>(qs) = qv[0];
                *reinterpret_cast<uint4*>(qs + 16) = qv[1];
            } else {
#pragma unroll
                for (int l = 0; l < 32; l++) qs[l] = b[16 + 32 * (s / 2) + l];
            }
            const int shift = (s & 1) ? 4 : 0;
#pragma unroll
            for (int l = 0; l < 32; l++)
                y[l] = __fsub_rn(__fmul_rn(d, (float)((qs[l] >> shift) & 0x0F)), dm);
        }
        store32(out + t * 32, y);
    }
}

// ----------------------------------------------------------------------------
// launcher

static unsigned dq_grid(int n_sms, size_t items, int block) {
    size_t want = (items + (size_t)block - 1) / (size_t)block, cap = (size_t)(n_sms > 0 ? n_sms : 1) * 16;
    if (want < 1) want = 1;
    return (unsigned)(want < cap ? want : cap);
}

extern "C" void cuda_dequantize(void* stream, int n_sms, int variant, void* out, const void* blocks,
                                int type, size_t n) {
    if (type != DQ_Q8_0 && type != DQ_Q4_K && type != DQ_MXFP4)
        fatal("cuda_dequantize: ggml type %d has no GPU dequantiser (Q8_0, Q4_K, MXFP4)", type);
    if (n % (type == DQ_Q4_K ? 256 : 32) != 0)
        fatal("cuda_dequantize: %zu elements are not whole blocks", n);
    if (n == 0) return;
    cudaStream_t s = (cudaStream_t)stream;
    const int aligned = (reinterpret_cast<uintptr_t>(out) & 15) == 0;
    if (variant == DEQUANT_AUTO) variant = aligned ? DEQUANT_SUBBLOCK : DEQUANT_NAIVE;
    if (variant == DEQUANT_SUBBLOCK && !aligned)
        fatal("cuda_dequantize: variant 2 needs a 16-byte aligned output");
    if (variant == DEQUANT_NAIVE)
        dequant_naive_kernel<<<dq_grid(n_sms, n, 256), 256, 0, s>>>((bf16*)out,
                                                                    (const uint8_t*)blocks, type, n);
    else
        dequant_subblock_kernel<<<dq_grid(n_sms, n / 32, 128), 128, 0, s>>>(
            (bf16*)out, (const uint8_t*)blocks, type, n / 32);
    cuda_check_launch();
}
