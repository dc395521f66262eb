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
 * Variant 1 (naive): one thread per element, reading its block's header per element (the one for
 * an output that is not 16-byte aligned). Variant 2: one thread per 32-element (sub-)block, the
 * header and 16/32 quant bytes read once, the 32 outputs written as four 16-byte stores (kept for
 * the lab's comparison). Variant 3 (production): a warp per tile of blocks, 16-byte loads into
 * shared memory, the E2M1 codes decoded from their bits, every store instruction of a warp 512
 * contiguous bytes (see its section). Memory-bound: the lab (dev/cuda/dequant.cu) reports GB/s of
 * blocks read + bf16 written.
 */
#include <cuda_fp16.h>

#include "common.cuh"
#include "dequant.h"

// ggml type codes (llmc/gguf.h's GgmlType)
static constexpr int DQ_Q8_0 = 8, DQ_Q4_K = 12, DQ_MXFP4 = 39;

// ----------------------------------------------------------------------------
// per-element decoding (variants 1 and 2; variant 3 has its own below)

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
// variant 3: coalesced warp tiles, no lookup table
//
// Variant 2 is slow on MXFP4 (15% of HBM) for three reasons this variant removes: the E2M1 table
// sits in constant memory, which serialises a warp's lookups over its distinct indices (up to 16
// ways, 32 times per thread); each thread reads its 17-byte block byte by byte at a 17-byte
// stride; and each 16-byte store instruction of a warp lands on 16 different 128-byte lines (a
// 64-byte stride), so a line is written in pieces by four instructions.
//
// Q8_0 and MXFP4 (34- and 17-byte blocks, no alignment beyond a byte): a warp takes a tile of 32
// blocks (1024 elements). Its lanes load the 16-byte chunks covering the tile's bytes with 16-byte
// loads (prefetching the next tile's chunks into registers while decoding this one), put them in
// the warp's shared memory, then decode 8 elements per lane and store: lane `lane` of round s
// writes chunk 32 s + lane of the tile's 2 KiB of bf16, so every store instruction covers 512
// contiguous bytes. Q4_K (144-byte blocks, 16-byte aligned where the base is): a warp takes two
// blocks per round, lane c their elements 8c.., from one 16-byte header load each (the same
// address in every lane: one transaction) and one 8-byte load of its quant bytes, the next
// round's loads in flight meanwhile.
//
// E2M1 without a table: the code's exponent and mantissa bits placed at the fp32 exponent's low
// two bits and the mantissa's top bit read as 2^-126 times the FP4 value (for exponent 0 a
// subnormal, 0.5 x 2^-126), so times 2^127 they give ggml's kvalue (twice the FP4 value) exactly.

static constexpr int DQ_TILE_WARPS = 8;  // warps per CTA of the tile kernels
static constexpr int DQ_TILE_MIN_CTAS = 6;  // CTAs per SM they are compiled for (<= 40 registers)

// Byte k of u (0..255) minus (minus - 2^23) as a float, exactly and without I2F: the byte made
// the low mantissa byte of 2^23 (one PRMT), then `minus` subtracted (2^23, or 2^23 + 128 to
// read the byte as an int8 whose sign bit was flipped).
__device__ __forceinline__ float dq_byte_as_float(uint32_t u, int k, float minus) {
    return __fsub_rn(__uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440u | (uint32_t)k)), minus);
}

// 8 bytes at p (any alignment) from shared memory: three aligned words, two funnel shifts. The
// third word may lie past the data (the tile buffer has a spare chunk); shift 0 ignores it.
__device__ __forceinline__ uint2 dq_smem_bytes8(const uint8_t* p) {
    const uint32_t mis = (uint32_t)(reinterpret_cast<uintptr_t>(p) & 3);
    // (pointer arithmetic, not a cast from an integer: the loads stay ld.shared)
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p - mis);
    return make_uint2(__funnelshift_r(w[0], w[1], 8 * mis), __funnelshift_r(w[1], w[2], 8 * mis));
}

// kvalues[q] * d for the nibbles at bits sh..sh+3 of each byte of w (elements of 4 bytes).
__device__ __forceinline__ void dq_mxfp4_word(uint32_t w, int sh, float d, float* y) {
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t q = w >> (8 * k + sh);
        const float x = __uint_as_float(((q & 7u) << 22) | ((q & 8u) << 28));  // 2^-126 * FP4
        // + 0: code 8 is -0 here but +0 in ggml's kvalues (an int 0); x + 0 = x otherwise
        y[k] = __fmaf_rn(__fmul_rn(x, 0x1p127f), d, 0.0f);
    }
}

// The lane's share of the 16-byte chunks that cover [p, p + len) (a tile), counted from the chunk
// holding p: lane + 32 k. A chunk wholly inside the tensor's bytes [lo, hi) is one 16-byte load;
// one that sticks out of it (at most the tensor's first and last) is read byte by byte (zeros
// outside), so no load leaves the tensor.
template <int NL>
__device__ __forceinline__ void dq_tile_load(uint4 (&v)[NL], const uint8_t* p, int len,
                                             uintptr_t lo, uintptr_t hi, int lane) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)15;
    const int n = (int)((reinterpret_cast<uintptr_t>(p) + (uintptr_t)len - a + 15) / 16);
#pragma unroll
    for (int k = 0; k < NL; k++) {
        const int i = lane + 32 * k;
        if (i >= n) continue;
        const uintptr_t c = a + 16 * (uintptr_t)i;
        if (c >= lo && c + 16 <= hi) {
            v[k] = __ldg(reinterpret_cast<const uint4*>(c));
        } else {
            uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
            for (int j = 0; j < 16; j++)
                if (c + j >= lo && c + j < hi)
                    w[j / 4] |= (uint32_t)__ldg(reinterpret_cast<const uint8_t*>(c + j)) << (8 * (j % 4));
            v[k] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// 8 floats as bf16 in one 16-byte store
__device__ __forceinline__ uint32_t dq_bf16x2_bits(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}
// (__stwb: one 16-byte store instruction for sure; a plain uint4 assignment came out of the
// compiler as four 4-byte stores in one of the unrolled rounds)
__device__ __forceinline__ void dq_store8(bf16* out, const float* y) {
    __stwb(reinterpret_cast<uint4*>(out), make_uint4(dq_bf16x2_bits(y[0], y[1]), dq_bf16x2_bits(y[2], y[3]),
                                                  dq_bf16x2_bits(y[4], y[5]), dq_bf16x2_bits(y[6], y[7])));
}

// Q8_0 or MXFP4 (TYPE): nb blocks -> out (16-byte aligned), a warp per 32-block tile.
template <int TYPE>
__global__ void __launch_bounds__(32 * DQ_TILE_WARPS, DQ_TILE_MIN_CTAS)
    dequant_tile_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ blocks, size_t nb) {
    constexpr int BB = TYPE == DQ_Q8_0 ? 34 : 17;        // bytes per block
    constexpr int NC = (32 * BB + 15) / 16 + 1;          // chunks covering a tile at any alignment
    constexpr int NL = (NC + 31) / 32;                   // chunks per lane
    __shared__ uint4 tile[DQ_TILE_WARPS][NC + 1];        // + 1: dq_smem_bytes8's spare word
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const size_t n_tiles = (nb + 31) / 32, stride = (size_t)gridDim.x * DQ_TILE_WARPS;
    const uintptr_t lo = reinterpret_cast<uintptr_t>(blocks), hi = lo + nb * BB;
    size_t t = blockIdx.x * (size_t)DQ_TILE_WARPS + wid;
    uint4 v[NL];
#pragma unroll
    for (int k = 0; k < NL; k++) v[k] = make_uint4(0, 0, 0, 0);
    if (t < n_tiles) dq_tile_load<NL>(v, blocks + t * 32 * BB, (int)min((size_t)32, nb - 32 * t) * BB, lo, hi, lane);
    for (; t < n_tiles; t += stride) {
        const uint8_t* p = blocks + t * 32 * BB;
        const int nbt = (int)min((size_t)32, nb - 32 * t);  // blocks in this tile
        __syncwarp();  // every lane is done reading the previous tile
#pragma unroll
        for (int k = 0; k < NL; k++)
            if (lane + 32 * k < NC) tile[wid][lane + 32 * k] = v[k];
        const size_t tn = t + stride;  // the next tile's loads fly while this one is decoded
        if (tn < n_tiles)
            dq_tile_load<NL>(v, blocks + tn * 32 * BB, (int)min((size_t)32, nb - 32 * tn) * BB, lo, hi, lane);
        __syncwarp();
        const uint8_t* sb = reinterpret_cast<const uint8_t*>(tile[wid]) + (reinterpret_cast<uintptr_t>(p) & 15);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int j = 8 * s + lane / 4, c = lane & 3;  // block j of the tile, its chunk c
            if (j >= nbt) break;
            const uint8_t* b = sb + j * BB;
            float y[8];
            if (TYPE == DQ_MXFP4) {  // chunk c: low (c < 2) or high nibbles of qs[8 (c & 1) ..]
                const float d = dq_e8m0_half(b[0]);
                const uint2 q = dq_smem_bytes8(b + 1 + 8 * (c & 1));
                dq_mxfp4_word(q.x, 4 * (c >> 1), d, y);
                dq_mxfp4_word(q.y, 4 * (c >> 1), d, y + 4);
            } else {  // chunk c: qs[8 c ..]; int8 + 128 as a float, minus 128
                const float d = __half2float(__ushort_as_half((unsigned short)(b[0] | (b[1] << 8))));
                const uint2 q = dq_smem_bytes8(b + 2 + 8 * c);
#pragma unroll
                for (int k = 0; k < 8; k++)
                    y[k] = __fmul_rn(dq_byte_as_float((k < 4 ? q.x : q.y) ^ 0x80808080u, k & 3, 8388736.0f), d);
            }
            dq_store8(out + (t * 32 + j) * 32 + 8 * c, y);
        }
    }
}

static constexpr int DQ_Q4K_PER_WARP = 2;  // Q4_K blocks a warp decodes per round

// Q4_K block b's header (d, dmin as f16, scales[12]) and the 8 quant bytes at qoff.
template <bool ALIGNED>
__device__ __forceinline__ void dq_q4k_load(const uint8_t* b, int qoff, uint4* h, uint2* q) {
    if (ALIGNED) {
        *h = __ldg(reinterpret_cast<const uint4*>(b));
        *q = __ldg(reinterpret_cast<const uint2*>(b + qoff));
    } else {
        uint32_t w[6] = {0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 16; j++) w[j / 4] |= (uint32_t)__ldg(b + j) << (8 * (j % 4));
#pragma unroll
        for (int j = 0; j < 8; j++) w[4 + j / 4] |= (uint32_t)__ldg(b + qoff + j) << (8 * (j % 4));
        *h = make_uint4(w[0], w[1], w[2], w[3]);
        *q = make_uint2(w[4], w[5]);
    }
}

// Q4_K: nb blocks -> out (16-byte aligned), a warp per DQ_Q4K_PER_WARP blocks a round, the next
// round's loads in flight while this one is decoded; ALIGNED: blocks 16-byte aligned (then so is
// every block: 144 = 9 x 16), else byte loads.
template <bool ALIGNED>
__global__ void __launch_bounds__(32 * DQ_TILE_WARPS, DQ_TILE_MIN_CTAS)
    dequant_q4k_warp_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ blocks, size_t nb) {
    constexpr int P = DQ_Q4K_PER_WARP;
    const int c = threadIdx.x & 31, s = c / 4;  // lane: elements 8 c .. of sub-block s
    const int qoff = 16 + 32 * (s / 2) + 8 * (c % 4), sh = 4 * (s & 1);
    const size_t stride = (size_t)gridDim.x * DQ_TILE_WARPS * P;
    size_t t0 = (blockIdx.x * (size_t)DQ_TILE_WARPS + (threadIdx.x >> 5)) * P;
    uint4 h[P];
    uint2 q[P];
#pragma unroll
    for (int u = 0; u < P; u++) {
        h[u] = make_uint4(0, 0, 0, 0);
        q[u] = make_uint2(0, 0);
        if (t0 + u < nb) dq_q4k_load<ALIGNED>(blocks + (t0 + u) * 144, qoff, &h[u], &q[u]);
    }
    for (; t0 < nb; t0 += stride) {
        uint4 hc[P];
        uint2 qc[P];
#pragma unroll
        for (int u = 0; u < P; u++) {
            hc[u] = h[u];
            qc[u] = q[u];
            if (t0 + stride + u < nb) dq_q4k_load<ALIGNED>(blocks + (t0 + stride + u) * 144, qoff, &h[u], &q[u]);
        }
#pragma unroll
        for (int u = 0; u < P; u++) {
            if (t0 + u >= nb) break;
            // get_scale_min_k4 on the words of scales[0..3], [4..7], [8..11]
            const uint32_t s0 = hc[u].y, s1 = hc[u].z, s2 = hc[u].w, k8 = 8 * (s & 3);
            int sc, m;
            if (s < 4) {
                sc = (int)((s0 >> k8) & 63);
                m = (int)((s1 >> k8) & 63);
            } else {
                sc = (int)(((s2 >> k8) & 0x0F) | (((s0 >> k8) >> 6 & 3) << 4));
                m = (int)(((s2 >> k8) >> 4 & 0x0F) | (((s1 >> k8) >> 6 & 3) << 4));
            }
            const float d = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(hc[u].x & 0xFFFF))), (float)sc);
            const float dm = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(hc[u].x >> 16))), (float)m);
            float y[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint32_t nib = ((k < 4 ? qc[u].x : qc[u].y) >> sh) & 0x0F0F0F0Fu;
                y[k] = __fsub_rn(__fmul_rn(d, dq_byte_as_float(nib, k & 3, 8388608.0f)), dm);
            }
            dq_store8(out + (t0 + u) * 256 + 8 * c, y);
        }
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
    if (variant == DEQUANT_AUTO) variant = aligned ? DEQUANT_TILE : DEQUANT_NAIVE;
    if (variant != DEQUANT_NAIVE && !aligned)
        fatal("cuda_dequantize: variant %d needs a 16-byte aligned output", variant);
    bf16* o = (bf16*)out;
    const uint8_t* b = (const uint8_t*)blocks;
    if (variant == DEQUANT_NAIVE) {
        dequant_naive_kernel<<<dq_grid(n_sms, n, 256), 256, 0, s>>>(o, b, type, n);
    } else if (variant == DEQUANT_SUBBLOCK) {
        dequant_subblock_kernel<<<dq_grid(n_sms, n / 32, 128), 128, 0, s>>>(o, b, type, n / 32);
    } else {
        // one warp per 32-block tile (Q8_0, MXFP4) or per DQ_Q4K_PER_WARP blocks (Q4_K), the
        // grid no larger than what is resident at once: the work is split evenly between the
        // CTAs (grid stride), so a CTA waiting for a slot would finish a whole share late
        const int threads = 32 * DQ_TILE_WARPS;
        const void* kernel =
            type == DQ_Q8_0    ? (const void*)dequant_tile_kernel<DQ_Q8_0>
            : type == DQ_MXFP4 ? (const void*)dequant_tile_kernel<DQ_MXFP4>
            : (reinterpret_cast<uintptr_t>(blocks) & 15) == 0 ? (const void*)dequant_q4k_warp_kernel<true>
                                                                : (const void*)dequant_q4k_warp_kernel<false>;
        int per_sm = 0;
        cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
        const size_t warps = type == DQ_Q4_K ? (n / 256 + DQ_Q4K_PER_WARP - 1) / DQ_Q4K_PER_WARP
                                             : (n / 32 + 31) / 32;
        const size_t want = (warps + DQ_TILE_WARPS - 1) / DQ_TILE_WARPS,
                     cap = (size_t)(n_sms > 0 ? n_sms : 1) * (size_t)(per_sm > 0 ? per_sm : 1);
        const unsigned grid = (unsigned)(want < cap ? want : cap);
        size_t nb = type == DQ_Q4_K ? n / 256 : n / 32;
        void* args[] = {&o, &b, &nb};
        cuda_check(cudaLaunchKernel(kernel, grid, threads, args, 0, s));
    }
    cuda_check_launch();
}
