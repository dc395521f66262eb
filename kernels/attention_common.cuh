/*
 * attention_common.cuh — what the flash-attention kernels share: the argument checks and launch
 * helpers of every launcher, the mma.sync building blocks (fragment addresses and loops over the
 * padded shared tiles), the Hopper wgmma building blocks (the 128-byte swizzled tiles, the wgmma
 * instructions and their k-step loops), and the row-block steps every kernel repeats (causal
 * mask, online softmax, the stores of out/lse, dQ, dK and dV). The PTX instruction wrappers
 * (cp.async, ldmatrix, mma.sync, mbarriers, fences, wgmma commit / wait, descriptors) are those of
 * ptx.cuh, which the MoE grouped GEMM shares.
 * Included by kernels/attention.cu (the mma.sync kernels and the C interface), whose
 * attention_wgmma.cuh (forward) and attention_bwd_wgmma.cuh (backward) use it too; the lab
 * dev/cuda/attention.cu includes kernels/attention.cu and so this file. Not a stand-alone
 * header of the C interface (that is attention.h).
 *
 * One helper per repeated step, with the arithmetic of the kernels it came from in the same
 * order: a kernel built from these helpers computes the same bits as before they existed.
 *
 * Fragment layout (mma.sync m16n8k16, and per warp the wgmma m64nNk16 accumulator, which is the
 * same layout repeated over N/8 column blocks): lane = 4g + t holds, of a 16-row block,
 * acc[i][e] = row g + 8*(e/2), column 8i + 2t + (e%2). So "row block" below means 16 rows of
 * which this thread holds two, row0 = (first row of the block) + g (e = 0, 1, hf = 0) and
 * row0 + 8 (e = 2, 3, hf = 1); the 4 lanes of a quad share a row and combine by shuffles.
 */
#ifndef KERNELS_ATTENTION_COMMON_CUH
#define KERNELS_ATTENTION_COMMON_CUH

#include "attention.h"
#include "ptx.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef __nv_bfloat16 bf16;

#define ATTN_PAD 8  // bf16 elements of padding per row of the mma.sync kernels' shared tiles
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

// ----------------------------------------------------------------------------
// host: error and argument checks

static void attention_check_at(cudaError_t err, const char* what, const char* file, int line) {
    if (err == cudaSuccess) return;
    fprintf(stderr, "attention: CUDA error %s (%s) in %s at %s:%d\n", cudaGetErrorName(err),
            cudaGetErrorString(err), what, file, line);
    exit(1);
}
#define attention_check(call) attention_check_at((call), #call, __FILE__, __LINE__)

static void attention_check_args(const char* fn, int B, int T, int H, int KVH, int HD) {
    if (B < 0 || T < 0 || H < 1 || KVH < 1 || H % KVH != 0) {
        fprintf(stderr, "attention: %s: bad shape B=%d T=%d H=%d KVH=%d (need B,T >= 0, H >= 1, "
                "KVH >= 1, H a multiple of KVH)\n", fn, B, T, H, KVH);
        exit(1);
    }
    if (!attention_supports_head_dim(HD)) {
        fprintf(stderr, "attention: %s: head dim %d not supported (supported: 16, 32, 64, 128)\n",
                fn, HD);
        exit(1);
    }
}

// The bf16 tiles move in 16-byte cp.async chunks; fp32 arrays need their natural alignment.
static void attention_check_aligned(const char* fn, const char* name, const void* p,
                                    uintptr_t bytes) {
    if (((uintptr_t)p & (bytes - 1)) != 0) {
        fprintf(stderr, "attention: %s: %s = %p is not %d-byte aligned\n", fn, name, p,
                (int)bytes);
        exit(1);
    }
}

// Every kernel's grid has one block per (head or kv head, batch) in x: at most 2^31 - 1.
static void attention_check_grid_x(const char* fn, int B, int H) {
    if ((int64_t)H * B > 0x7fffffff) {
        fprintf(stderr, "attention: %s: B*H = %lld too large\n", fn, (long long)H * B);
        exit(1);
    }
}

// The checks every forward launcher shares (the C interface, whichever kernel it picks, and the
// lab's variants). Returns 0 when there is nothing to compute (B or T is 0).
static int attention_forward_check(const char* fn, const void* out, const float* lse,
                                   const void* qkv, int B, int T, int H, int KVH, int HD) {
    attention_check_args(fn, B, T, H, KVH, HD);
    attention_check_aligned(fn, "out", out, 16);
    attention_check_aligned(fn, "lse", lse, 4);
    attention_check_aligned(fn, "qkv", qkv, 16);
    if (B == 0 || T == 0) return 0;
    attention_check_grid_x(fn, B, H);
    return 1;
}

// The checks every backward launcher shares. Returns 0 when there is nothing to compute.
static int attention_backward_check(const char* fn, const void* dqkv, const void* dout,
                                    const void* qkv, const void* out, const float* lse,
                                    const void* workspace, int B, int T, int H, int KVH, int HD) {
    attention_check_args(fn, B, T, H, KVH, HD);
    attention_check_aligned(fn, "dqkv", dqkv, 16);
    attention_check_aligned(fn, "dout", dout, 16);
    attention_check_aligned(fn, "qkv", qkv, 16);
    attention_check_aligned(fn, "out", out, 16);
    attention_check_aligned(fn, "lse", lse, 4);
    attention_check_aligned(fn, "workspace", workspace, 4);
    if (B == 0 || T == 0) return 0;
    attention_check_grid_x(fn, B, H);
    return 1;
}

// The sliding window as the SW kernels take it: 1 <= window <= T, T (masks nothing) for no
// window (0) or one at least as long as the sequence. A negative window is a caller's error.
static int attention_window_for_kernels(const char* fn, int window, int T) {
    if (window < 0) {
        fprintf(stderr, "attention: %s: window %d is negative (0: no window)\n", fn, window);
        exit(1);
    }
    return window == 0 || window > T ? T : window;
}

// ----------------------------------------------------------------------------
// host: launch helpers, and where the wgmma kernels can run

// grid: x = h + H*b (H heads, or kv heads for the dK/dV pass), y = tile of `rows` rows of T.
static dim3 attention_grid(int B, int T, int H, int rows) {
    return dim3((unsigned)(H * B), (unsigned)((T + rows - 1) / rows));
}

// Opt the kernel into `smem` bytes of dynamic shared memory.
template <typename Kernel>
static void attention_set_max_smem(Kernel kernel, size_t smem) {
    attention_check(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

// log2(e)/sqrt(HD): the logits' scale in base 2, the same in every forward kernel (the lse they
// save, and so the backward, must not depend on which one ran).
static float attention_scale_log2(int HD) { return ATTN_LOG2E / sqrtf((float)HD); }

// Whether the wgmma kernels can run on the current device: the build carries their sm_90a device
// code (the Makefile defines ATTN_WGMMA_BUILD=1 when GPU_ARCH is sm_90a, the default, and so does
// the lab's build script) and the device is a compute capability 9.0 part (a build for sm_90a
// and, say, sm_80 runs the sm_80 code on an A100, where these kernels are a trap). Two attribute
// queries per call: no synchronisation, no state.
#ifndef ATTN_WGMMA_BUILD
#define ATTN_WGMMA_BUILD 0
#endif
static int attention_wgmma_available() {
    if (!ATTN_WGMMA_BUILD) return 0;
    int dev = 0, major = 0, minor = 0;
    attention_check(cudaGetDevice(&dev));
    attention_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    attention_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return major == 9 && minor == 0;
}

// Head dims the wgmma kernels implement (one or two 64-column swizzle panels).
static int attention_wgmma_supports_head_dim(int HD) { return HD == 64 || HD == 128; }

// ----------------------------------------------------------------------------
// device: exp2, bf16 packing (cp.async, ldmatrix and mma.sync are in ptx.cuh)

// 2^x by the hardware approximation (about 2 ulp; flushes results below 2^-126 to zero, which is
// harmless here: every exponent is <= 0 and the values are probabilities). 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> bf16x2; the first lands in the low half (the lower column index).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// ----------------------------------------------------------------------------
// device: fragments of the padded shared tiles (mma.sync kernels)

// Fragment addresses, for a shared tile stored row-major with leading dimension LD (elements).
// A operand 16x16 at (row0, col0): ldmatrix x4 gives a0..a3 of mma m16n8k16.
template <int LD>
__device__ __forceinline__ uint32_t frag_a_addr(const bf16* tile, int row0, int col0, int lane) {
    return smem_u32(tile + (row0 + (lane & 15)) * LD + col0 + (lane >> 4) * 8);
}
// B operand for two n-blocks of 8, when the tile is stored [n][k] (B^T row-major, e.g. K for
// Q K^T): regs {b0,b1} of n-block n0..n0+7, then {b0,b1} of n0+8..n0+15; k from k0.
template <int LD>
__device__ __forceinline__ uint32_t frag_bt_addr(const bf16* tile, int n0, int k0, int lane) {
    return smem_u32(tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * LD + k0 +
                    ((lane >> 3) & 1) * 8);
}
// B operand for two n-blocks of 8, when the tile is stored [k][n] (e.g. V for P V); use with
// ldmatrix .trans.
template <int LD>
__device__ __forceinline__ uint32_t frag_b_trans_addr(const bf16* tile, int k0, int n0, int lane) {
    return smem_u32(tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + n0 + (lane >> 4) * 8);
}

// Accumulators of n-blocks 2*kk and 2*kk+1 (16 x 16 of C layout) as the A operand of k-step kk:
// the accumulator layout is the A layout, no data moves between threads.
__device__ __forceinline__ void acc_to_frag_a(uint32_t (&a)[4], const float (&c0)[4],
                                              const float (&c1)[4]) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}
// Every k-step of a 16 x 16*KS accumulator block as bf16 A fragments (wgmma register operands).
template <int KS>
__device__ __forceinline__ void acc_to_frags(uint32_t (&a)[KS][4], const float (&c)[2 * KS][4]) {
#pragma unroll
    for (int kk = 0; kk < KS; kk++) acc_to_frag_a(a[kk], c[2 * kk], c[2 * kk + 1]);
}

template <int NB>
__device__ __forceinline__ void acc_zero(float (&d)[NB][4]) {
#pragma unroll
    for (int i = 0; i < NB; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) d[i][e] = 0.0f;
}
template <int KS>
__device__ __forceinline__ void frag_zero(uint32_t (&a)[KS][4]) {
#pragma unroll
    for (int i = 0; i < KS; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) a[i][e] = 0u;
}

// Copy rows [row0, row0+ROWS) x HD columns of one head into a padded shared tile, asynchronously.
// base points at row 0 of this sequence, at the head's first column; rows >= T are zero-filled.
template <int ROWS, int HD, int NTHREADS>
__device__ __forceinline__ void tile_load_async(bf16* tile, const bf16* base, int64_t stride,
                                                int row0, int T, int tid) {
    constexpr int LD = HD + ATTN_PAD;
    constexpr int CHUNKS = HD / 8;
    constexpr int TOTAL = ROWS * CHUNKS;
#pragma unroll
    for (int it = 0; it < (TOTAL + NTHREADS - 1) / NTHREADS; it++) {
        int i = it * NTHREADS + tid;
        if (TOTAL % NTHREADS == 0 || i < TOTAL) {
            int r = i / CHUNKS, c = i % CHUNKS;
            bool valid = row0 + r < T;
            const bf16* src = valid ? base + (int64_t)(row0 + r) * stride + c * 8 : base;
            cp_async_16(smem_u32(tile + r * LD + c * 8), src, valid);
        }
    }
}

// acc (MT row blocks of 16 rows x N columns) += A B^T: A = rows row0 .. row0 + 16*MT of a padded
// shared tile (K columns), B = a padded shared tile of N rows x K columns (e.g. Q K^T with K
// stored [key][hd]). Per k-step of 16 the MT A fragments first, then each 16 columns of B once
// for all MT row blocks (MT = 2 halves the ldmatrix traffic of B per mma).
template <int K, int N, int LD, int MT>
__device__ __forceinline__ void mma_rows_bt(float (&acc)[MT][N / 8][4], const bf16* A, int row0,
                                            const bf16* B, int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            ldsm_x4(a[mt], frag_a_addr<LD>(A, row0 + mt * 16, kk * 16, lane));
#pragma unroll
        for (int p = 0; p < N / 16; p++) {
            uint32_t b[4];
            ldsm_x4(b, frag_bt_addr<LD>(B, p * 16, kk * 16, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(acc[mt][2 * p], a[mt], b[0], b[1]);
                mma_16816(acc[mt][2 * p + 1], a[mt], b[2], b[3]);
            }
        }
    }
}
template <int K, int N, int LD>
__device__ __forceinline__ void mma_rows_bt(float (&acc)[N / 8][4], const bf16* A, int row0,
                                            const bf16* B, int lane) {
    mma_rows_bt<K, N, LD, 1>(reinterpret_cast<float (&)[1][N / 8][4]>(acc), A, row0, B, lane);
}

// The same for two products that share their shapes, in one pass over the k-steps (the dQ
// pass's S = Q K^T and dP = dO V^T: 4 independent mma chains per fragment load).
template <int K, int N, int LD>
__device__ __forceinline__ void mma_rows_bt_pair(float (&acc0)[N / 8][4], const bf16* A0,
                                                 const bf16* B0, float (&acc1)[N / 8][4],
                                                 const bf16* A1, const bf16* B1, int row0,
                                                 int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a0[4], a1[4];
        ldsm_x4(a0, frag_a_addr<LD>(A0, row0, kk * 16, lane));
        ldsm_x4(a1, frag_a_addr<LD>(A1, row0, kk * 16, lane));
#pragma unroll
        for (int p = 0; p < N / 16; p++) {
            uint32_t b0[4], b1[4];
            ldsm_x4(b0, frag_bt_addr<LD>(B0, p * 16, kk * 16, lane));
            ldsm_x4(b1, frag_bt_addr<LD>(B1, p * 16, kk * 16, lane));
            mma_16816(acc0[2 * p], a0, b0[0], b0[1]);
            mma_16816(acc0[2 * p + 1], a0, b0[2], b0[3]);
            mma_16816(acc1[2 * p], a1, b1[0], b1[1]);
            mma_16816(acc1[2 * p + 1], a1, b1[2], b1[3]);
        }
    }
}

// acc (MT row blocks x N columns) += P B: P = MT row blocks x K columns of fp32 accumulators,
// rounded to bf16 A fragments; B = a padded shared tile of K rows x N columns, row-major (e.g.
// V in O += P V), read by ldmatrix .trans. Each 16 columns of B once for all MT row blocks.
template <int K, int N, int LD, int MT>
__device__ __forceinline__ void mma_acc_b(float (&acc)[MT][N / 8][4],
                                          const float (&p)[MT][K / 8][4], const bf16* B,
                                          int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) acc_to_frag_a(a[mt], p[mt][2 * kk], p[mt][2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < N / 16; n++) {
            uint32_t b[4];
            ldsm_x4_trans(b, frag_b_trans_addr<LD>(B, kk * 16, n * 16, lane));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_16816(acc[mt][2 * n], a[mt], b[0], b[1]);
                mma_16816(acc[mt][2 * n + 1], a[mt], b[2], b[3]);
            }
        }
    }
}
template <int K, int N, int LD>
__device__ __forceinline__ void mma_acc_b(float (&acc)[N / 8][4], const float (&p)[K / 8][4],
                                          const bf16* B, int lane) {
    mma_acc_b<K, N, LD, 1>(reinterpret_cast<float (&)[1][N / 8][4]>(acc),
                           reinterpret_cast<const float (&)[1][K / 8][4]>(p), B, lane);
}

// ----------------------------------------------------------------------------
// device: the row-block steps (one 16-row block of an accumulator; header)

// Causal mask of logits: -inf where key > row, keys k0 + 8i + 2t + e%2.
template <int NB>
__device__ __forceinline__ void mask_causal(float (&s)[NB][4], int row0, int k0, int lane) {
#pragma unroll
    for (int i = 0; i < NB; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = row0 + (e >> 1) * 8;
            const int key = k0 + i * 8 + (lane & 3) * 2 + (e & 1);
            if (key > row) s[i][e] = -INFINITY;
        }
}

// One tile of the online softmax in base 2 over the logits s (masked: -inf): the running maximum
// m (scaled, base 2) and sum l of each row move to this tile, alpha = 2^(m_old - m_new) rescales
// what was accumulated before (exactly 1 where the maximum did not move), and s becomes
// p = 2^(s*scale_log2 - m_new). Every row sees key 0 in tile 0, so m is finite from the first
// tile on. The quad's partial sums stay apart until the end (alpha is the same for all 4).
// max_moved |= whether some row's maximum moved.
template <int NB>
__device__ __forceinline__ void softmax_online(float (&s)[NB][4], float (&row_max)[2],
                                               float (&row_sum)[2], float (&alpha)[2],
                                               float scale_log2, bool& max_moved) {
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < NB; i++) mx = fmaxf(mx, fmaxf(s[i][2 * hf], s[i][2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_old = row_max[hf];
        const float m_new = fmaxf(m_old, mx * scale_log2);
        max_moved |= m_new != m_old;
        alpha[hf] = m_new == m_old ? 1.0f : fast_exp2(m_old - m_new);
        row_max[hf] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < NB; i++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float p = fast_exp2(fmaf(s[i][2 * hf + e], scale_log2, -m_new));
                s[i][2 * hf + e] = p;
                sum += p;
            }
        row_sum[hf] = row_sum[hf] * alpha[hf] + sum;
    }
}

// ----------------------------------------------------------------------------
// device: sinks and sliding windows (GPT-OSS), the compile-time option SW of every kernel
//
// With SW the kernels take `window`, normalised by the host to 1 <= window <= T (no window: T,
// which masks nothing): key j is visible to query t iff j <= t and j > t - window. `sinks` (H)
// bf16 or NULL: one more logit s_h per head in each row's softmax denominator, unscaled (natural
// log domain) and with no value. Without SW every kernel compiles to the causal code it had.

// Logits of keys outside the window or right of the diagonal: -inf (key > row or key <= row -
// window), keys k0 + 8i + 2t + e%2.
template <int NB>
__device__ __forceinline__ void mask_causal_window(float (&s)[NB][4], int row0, int k0, int lane,
                                                   int window) {
#pragma unroll
    for (int i = 0; i < NB; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = row0 + (e >> 1) * 8;
            const int key = k0 + i * 8 + (lane & 3) * 2 + (e & 1);
            if (key > row || key <= row - window) s[i][e] = -INFINITY;
        }
}

// First key visible to query row `row` (>= 0).
__device__ __forceinline__ int attn_first_key(int row, int window) {
    return max(0, row - window + 1);
}

// The running maximum (base 2, scaled) and sum a row's online softmax starts from. Causal
// (!SW): -inf and 0, and every row sees key 0 in its first tile. SW: a row's first tiles may hold
// none of its keys (the window starts inside the CTA's first tile for its first row only), and
// a fully masked tile must not compute 2^(-inf - (-inf)) = NaN: without a sink the maximum
// starts at the finite floor -1e30 (2^(-1e30 - m) = 0 once a real logit arrives: the same
// result), with a sink at s_h * log2(e) with l = 1 = 2^(s_h log2(e) - m) counted once per row,
// on lane t = 0 of the quad (the quad's partial sums are added in the epilogue). The sink is
// not multiplied by the softmax scale: it is a logit of the scaled domain already.
template <bool SW>
__device__ __forceinline__ void softmax_start(float (&row_max)[2], float (&row_sum)[2],
                                              const bf16* sinks, int h, int lane) {
    if constexpr (SW) {
        const bool sink = sinks != nullptr;
        const float m = sink ? __bfloat162float(sinks[h]) * ATTN_LOG2E : -1e30f;
        const float l = sink && (lane & 3) == 0 ? 1.0f : 0.0f;
        row_max[0] = row_max[1] = m;
        row_sum[0] = row_sum[1] = l;
    } else {
        (void)sinks;
        (void)h;
        (void)lane;
        row_max[0] = row_max[1] = -INFINITY;
        row_sum[0] = row_sum[1] = 0.0f;
    }
}

// o *= alpha of its row.
template <int NB>
__device__ __forceinline__ void rescale_rows(float (&o)[NB][4], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < NB; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[i][e] *= alpha[e >> 1];
}

// Row hf of this thread's block times `scale` as bf16: dst = the row's column 2t.
template <int NB>
__device__ __forceinline__ void store_row_bf16(bf16* dst, const float (&acc)[NB][4], int hf,
                                               float scale) {
#pragma unroll
    for (int i = 0; i < NB; i++)
        *reinterpret_cast<uint32_t*>(dst + i * 8) =
            pack_bf16(acc[i][2 * hf] * scale, acc[i][2 * hf + 1] * scale);
}

// The forward's epilogue for one row block of query rows row0, row0 + 8 of (b, h): out = O / l
// (bf16), lse = ln(sum_j e^(s_j*scale)) = (max + log2(l)) * ln 2; rows >= T are not stored.
// out: (B*T, H*HD) bf16; lse: (B, H, T) fp32.
template <int NB>
__device__ __forceinline__ void store_out_lse(bf16* out, float* lse, const float (&o)[NB][4],
                                              const float (&row_max)[2],
                                              const float (&row_sum)[2], int b, int h, int row0,
                                              int T, int H, int lane) {
    constexpr int HD = NB * 8;
    const int64_t out_stride = (int64_t)H * HD;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float l = row_sum[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = 1.0f / l;
        const int row = row0 + hf * 8;
        if (row < T) {
            bf16* dst =
                out + ((int64_t)b * T + row) * out_stride + (int64_t)h * HD + (lane & 3) * 2;
#pragma unroll
            for (int i = 0; i < NB; i++)
                *reinterpret_cast<uint32_t*>(dst + i * 8) =
                    pack_bf16(o[i][2 * hf] * inv, o[i][2 * hf + 1] * inv);
            if ((lane & 3) == 0)
                lse[((int64_t)b * H + h) * T + row] = (row_max[hf] + log2f(l)) * ATTN_LN2;
        }
    }
}

// The dQ epilogue for one row block of query rows row0, row0 + 8 of (b, h): dq * scale (the
// logits were scaled) into the q columns of dqkv (B*T, QKV); rows >= T are not stored.
template <int NB>
__device__ __forceinline__ void store_dq(bf16* dqkv, const float (&dq)[NB][4], int64_t QKV, int b,
                                         int h, int row0, int T, int lane, float scale) {
    constexpr int HD = NB * 8;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int q = row0 + hf * 8;
        if (q >= T) continue;
        bf16* dst = dqkv + ((int64_t)b * T + q) * QKV + (int64_t)h * HD + (lane & 3) * 2;
        store_row_bf16(dst, dq, hf, scale);
    }
}

// The dK/dV epilogue for one block of keys key0, key0 + 8 of (b, kv head kvh): dk * scale and
// dv into the k and v columns of dqkv (B*T, QKV); keys >= T are not stored.
template <int NB>
__device__ __forceinline__ void store_dk_dv(bf16* dqkv, const float (&dk)[NB][4],
                                            const float (&dv)[NB][4], int64_t QKV, int b, int kvh,
                                            int key0, int T, int H, int KVH, int lane,
                                            float scale) {
    constexpr int HD = NB * 8;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int key = key0 + hf * 8;
        if (key >= T) continue;
        bf16* row = dqkv + ((int64_t)b * T + key) * QKV + (lane & 3) * 2;
        bf16* dst_k = row + (int64_t)(H + kvh) * HD;
        bf16* dst_v = row + (int64_t)(H + KVH + kvh) * HD;
#pragma unroll
        for (int i = 0; i < NB; i++) {
            *reinterpret_cast<uint32_t*>(dst_k + i * 8) =
                pack_bf16(dk[i][2 * hf] * scale, dk[i][2 * hf + 1] * scale);
            *reinterpret_cast<uint32_t*>(dst_v + i * 8) =
                pack_bf16(dv[i][2 * hf], dv[i][2 * hf + 1]);
        }
    }
}

// ----------------------------------------------------------------------------
// wgmma (sm_90a): the 128-byte swizzled tiles, descriptors and fragments
//
// wgmma exists only in the architecture-specific target sm_90a (-gencode
// arch=compute_90a,code=sm_90a), where nvcc defines __CUDA_ARCH_FEAT_SM90_ALL. Every wgmma asm
// below (and every sm_90a wrapper of ptx.cuh) is compiled only there, and the wgmma kernels'
// bodies elsewhere are a trap, so the files also build for any other target (-arch=sm_90,
// sm_80, ...); attention_wgmma_available() then says no and the C interface runs the mma.sync
// kernels.
//
// Shared-memory layout: 128-byte swizzle ("SW128"), the same for every tile (Q, K, V, dO)
//   A tile of R rows x HD bf16 columns is cut into HD/64 column panels of 64 columns = 128 bytes:
//     byte offset of (row r, 16-byte chunk c of the row, c = column/8 in 0..HD/8-1) =
//         (c / 8) * R * 128            panel (R rows of 128 bytes each)
//       + r * 128                      row inside the panel
//       + ((c % 8) ^ (r % 8)) * 16     chunk, XOR-swizzled with the row's position in its 8-row
//                                      group
//   Every panel starts on a 1024-byte boundary (R is a multiple of 8 and the base is 1024-aligned),
//   so r % 8 equals address bits [7:9] and (c % 8) the unswizzled address bits [4:6]: this is the
//   hardware's 128B swizzle, physical bits [4:6] = logical bits [4:6] XOR bits [7:9], applied to
//   the address. An 8-row x 128-byte block (1024 bytes) is one swizzle atom.
//
// wgmma shared-memory matrix descriptor (64 bits; wg_desc):
//   bits  0-13  start address >> 4        bits 16-29  leading-dimension byte offset (LBO) >> 4
//   bits 32-45  stride-dimension byte offset (SBO) >> 4
//   bits 49-51  base offset = 0: every start address has address bits [7:9] = 0, i.e. starts at
//               row 0 of a swizzle atom (start offsets inside an atom are 0/32/64/96 bytes)
//   bits 62-63  swizzle mode: 1 = 128B swizzle
//   All fields fit their 14 bits: addresses < 228 KB -> < 14592; LBO <= 128 rows * 128 bytes.
//
// Operands (K-major = the reduction dimension is contiguous, MN-major = M or N contiguous):
//   SS product d = A B^T over the head dim, k-step kk = hd columns 16kk .. 16kk+15
//   (wgmma_group_ss), e.g. S = Q K^T:
//     A = 64 rows of a [row][hd] tile of RA rows, K-major (imm-trans-a 0): start = tile
//       + (kk/4) * RA*128 [panel] + (the warpgroup's first row) * 128 + (kk%4) * 32: the k-step's
//       16 columns are 32 bytes inside each 128-byte row; 8-row groups every SBO = 1024 bytes;
//       LBO is not used by swizzled K-major layouts (set to 16 bytes, encoded 1). Advancing the
//       start address by 32 bytes inside the atom (what CUTLASS-style descriptor iterators do)
//       relies on the swizzle being a function of the final address bits: bits [7:9] stay those
//       of the row, and the base offset is 0 because the atom starts on a 1024-byte boundary.
//     B = a [n][hd] tile of N rows, K-major (imm-trans-b 0): start = tile + (kk/4) * N*128
//       + (kk%4) * 32; SBO = 1024 (next 8 rows); LBO unused.
//   RS product d += A B, reduction over the rows of a [row][hd] tile, k-step kk = rows
//   16kk .. 16kk+15 (wgmma_group_rs), e.g. O += P V:
//     A = an fp32 accumulator converted in registers (acc_to_frags, below).
//     B[k = row][n = hd] = tile[row][hd]: N contiguous, MN-major (imm-trans-b 1). PTX ISA
//       canonical MN-major 128B-swizzle layout (T = 8 bf16 = 16 bytes):
//       Swizzle<3,4,3> o ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)), i.e. an atom is 8 rows x 64 hd
//       columns; the next 8 rows are SBO further, the next 64 hd columns (next atom along N) LBO
//       further: start = tile + kk * 16*128 (16 rows of 128 bytes: 1024-aligned), SBO = 1024,
//       LBO = R*128 (hd columns 64..127 are in the second panel, R rows further; only read when
//       HD = 128).
//
// Register fragments (PTX ISA "Matrix fragments for wgmma .m64nNk16"; warp v of the warpgroup
// holds rows 16v..16v+15; g = lane/4, t = lane%4):
//   accumulator (f32, N/2 registers): d[4i + e], i = 0..N/8-1, e = 0..3: row 16v + g + 8*(e/2),
//     column 8i + 2t + (e%2) = the mma.sync m16n8 C layout repeated over the N/8 blocks; stored
//     here as acc[i][e].
//   A in registers (bf16, 4 x .b32), one 64x16 k-step: reg 0 = (row g, cols 2t, 2t+1), reg 1 =
//     (row g+8, cols 2t, 2t+1), reg 2 = (row g, cols 2t+8, 2t+9), reg 3 = (row g+8, cols 2t+8,
//     2t+9) = the mma.sync m16n8k16 A layout. So k-step kk of P V takes accumulator blocks 2kk
//     and 2kk+1: exactly acc_to_frag_a, no data moves between threads.
//
// Async-register discipline: between a wgmma.mma_async and the wgmma.wait_group that retires it,
// its accumulator and A registers must not be touched. wg_fence_acc/wg_fence_frag (empty asm with
// "+f"/"+r" operands) pin those registers at the issue and wait points so that the compiler
// cannot move their reads or writes across; wgmma.fence orders earlier register writes (softmax,
// rescale, conversion) before the next batch of wgmma reads them. ptxas reports any wgmma it had
// to serialise (C7515 and neighbours in the -Xptxas -v log); the kernels here have none.

#define ATTN_WG_ENABLED PTX_SM90A  // the wgmma kernels' device code exists only there

#define ATTN_WG_THREADS 128        // one warpgroup: 4 consecutive warps
#define ATTN_WG_ROWS 64            // wgmma M: rows per warpgroup
#define ATTN_WG_K 16               // wgmma K for bf16
#define ATTN_SW128_ROW_BYTES 128   // one swizzled row: 64 bf16
#define ATTN_SW128_PANEL_COLS 64   // bf16 columns per 128-byte row = per panel
#define ATTN_SW128_ATOM_BYTES 1024 // 8 rows x 128 bytes: swizzle period, alignment of every atom
#define ATTN_SW128_KMAJOR_LBO 16   // unused by swizzled K-major layouts; encodes as 1

// Byte offset of 16-byte chunk c (columns 8c..8c+7) of row r in a SW128 tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128_offset(int r, int c, int rows) {
    return (uint32_t)((c >> 3) * rows * ATTN_SW128_ROW_BYTES + r * ATTN_SW128_ROW_BYTES +
                      (((c & 7) ^ (r & 7)) << 4));
}

// Offset of k-step kk (16 columns = 32 bytes) inside a K-major SW128 tile of `rows` rows.
__device__ __forceinline__ uint32_t sw128_kstep_offset(int kk, int rows) {
    constexpr int KSTEPS_PER_PANEL = ATTN_SW128_PANEL_COLS / ATTN_WG_K;  // 4
    return (uint32_t)((kk / KSTEPS_PER_PANEL) * rows * ATTN_SW128_ROW_BYTES +
                      (kk % KSTEPS_PER_PANEL) * ATTN_WG_K * (int)sizeof(bf16));
}

// Copy rows [row0, row0+ROWS) x HD columns of one head into a SW128 tile at shared address
// `tile`, asynchronously; rows >= T are zero-filled (nothing read). Thread tid always copies
// 16-byte chunk c = tid % CHUNKS of rows r0 + k*RSTEP (r0 = tid / CHUNKS, RSTEP = NTHREADS /
// CHUNKS): consecutive threads read consecutive chunks of a row (coalesced), and since RSTEP is a
// multiple of 8 the swizzle phase r % 8 is the same for all of a thread's rows, so one source
// pointer and one shared address, stepped by constants, serve every chunk (few live registers).
template <int ROWS, int HD, int NTHREADS>
__device__ __forceinline__ void sw128_tile_load_async(uint32_t tile, const bf16* base,
                                                      int64_t stride, int row0, int T, int tid) {
    constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
    constexpr int RSTEP = NTHREADS / CHUNKS;
    static_assert(NTHREADS % CHUNKS == 0 && RSTEP % 8 == 0 && ROWS % RSTEP == 0,
                  "each thread copies one chunk column, rows RSTEP apart, same swizzle phase");
    const int c = tid % CHUNKS, r0 = tid / CHUNKS;
    const bf16* src = base + (int64_t)(row0 + r0) * stride + c * 8;
    const uint32_t dst = tile + sw128_offset(r0, c, ROWS);
#pragma unroll
    for (int k = 0; k < ROWS / RSTEP; k++) {
        const bool valid = row0 + r0 + k * RSTEP < T;
        cp_async_16(dst + k * RSTEP * ATTN_SW128_ROW_BYTES, valid ? src : base, valid);
        src += RSTEP * stride;
    }
}

// d (64 x N, f32) = A (64 x 16, bf16) * B (16 x N, bf16) + (scale_d ? d : 0), one warpgroup.
//   ss: A and B from shared memory through descriptors, both K-major: ptx.cuh wgmma_ss.
//   rs: A from four registers (layout above), B MN-major from shared memory; operands after the
//       accumulators: the four A registers, B descriptor, scale-d (a predicate set from the int),
//       imm-scale-a = imm-scale-b = 1 (no negation), imm-trans-b = 1 (the register form has no
//       imm-trans-a).
template <int N>
struct WgmmaBf16;

template <>
struct WgmmaBf16<64> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t da, uint64_t db,
                                              int scale_d) {
        wgmma_ss<64>(d, da, db, scale_d);
    }
    static __device__ __forceinline__ void rs_trans_b(float (&d)[8][4], const uint32_t (&a)[4],
                                                      uint64_t db, int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_REGS32
            ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
            : WG_ACC32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
};

template <>
struct WgmmaBf16<128> {
    static __device__ __forceinline__ void ss(float (&d)[16][4], uint64_t da, uint64_t db,
                                              int scale_d) {
        wgmma_ss<128>(d, da, db, scale_d);
    }
    static __device__ __forceinline__ void rs_trans_b(float (&d)[16][4], const uint32_t (&a)[4],
                                                      uint64_t db, int scale_d) {
#if ATTN_WG_ENABLED
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_REGS64
            ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : WG_ACC64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d)
            : "memory");
#endif
    }
};

// One commit group: d (64 x N) = A B^T over KS k-steps of the head dim (SS, both K-major; the
// first k-step overwrites d). da: the warpgroup's rows of an A tile of RA rows, db: a B tile of
// N rows, both descriptors at k-step 0.
template <int N, int KS, int RA>
__device__ __forceinline__ void wgmma_group_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db) {
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
        WgmmaBf16<N>::ss(d, wg_desc_add(da, sw128_kstep_offset(kk, RA)),
                         wg_desc_add(db, sw128_kstep_offset(kk, N)), kk > 0);
    wgmma_commit();
}

// One commit group: d (64 x N) += A B over KS k-steps of 16 rows (RS): A = bf16 register
// fragments, one [4] per k-step; db = an MN-major B tile at its row 0.
template <int N, int KS>
__device__ __forceinline__ void wgmma_group_rs(float (&d)[N / 8][4], const uint32_t (&a)[KS][4],
                                               uint64_t db) {
#pragma unroll
    for (int kk = 0; kk < KS; kk++)
        WgmmaBf16<N>::rs_trans_b(d, a[kk], wg_desc_add(db, kk * ATTN_WG_K * ATTN_SW128_ROW_BYTES),
                                 1);
    wgmma_commit();
}

#endif  // KERNELS_ATTENTION_COMMON_CUH
