/*
 * attention.cu — causal grouped-query flash attention, forward and backward, bf16 in/out with fp32
 * accumulation, on tensor cores through mma.sync m16n8k16 (sm_80+; tuned on H200), and for the
 * forward and backward at HD 64 and 128 through Hopper warpgroup MMAs (wgmma, sm_90a:
 * attention_wgmma.cuh and attention_bwd_wgmma.cuh, included below; on H200 1.6-1.8x the mma.sync
 * forward and 1.8-1.9x its backward). The C interface is
 * kernels/attention.h; the development versions, the CPU reference, the validation and the
 * benchmark live in dev/cuda/attention.cu (which includes this file).
 *
 * Scheme (FlashAttention-2):
 *  - forward: one block per (query tile, head, batch); K/V tiles stream through shared memory with
 *    cp.async double buffering; online softmax in fp32 in base 2 (log2(e)/sqrt(HD) folded into one
 *    scale), O rescaled only when a row's maximum moved; tiles right of the diagonal are never
 *    loaded. Saves lse (natural log) per query row. The wgmma forward keeps this scheme and this
 *    output (same out, same lse for the backward) with 128-key tiles, the P V product of one
 *    tile overlapping the softmax of the next, a producer warpgroup feeding K/V through
 *    mbarrier rings and two consumer warpgroups taking turns on the tensor cores;
 *    attention_forward_bf16 takes it when the head dim and the device code allow, else the
 *    mma.sync kernel.
 *  - backward: (1) D = rowsum(dO * O) per (b, h, t) into the workspace; (2) one block per
 *    (kv tile, kv head, batch) owns dK and dV of its keys in registers and walks every query head of
 *    its group and every query tile at or below the diagonal in a fixed order; (3) a separate pass,
 *    one block per (query tile, head, batch), recomputes P and dS and sums dQ over the kv tiles.
 *    No atomics anywhere, so results are bit-identical from run to run.
 *
 * Invariants:
 *  - Each warp owns 16*MT whole rows of every product it accumulates, so no reduction ever crosses
 *    warps; the 4 lanes of a quad that share a row combine their maxima/sums with shuffles.
 *  - Rows past T are zero-filled in shared memory (cp.async with src-size 0): never uninitialised
 *    data, so a masked probability (exactly 0) never meets a NaN. Rows past T are never stored.
 *  - Offsets into the packed arrays are 64-bit (B*T*QKV can pass 2^31).
 *  - Shared-memory rows of the mma.sync kernels are padded by 16 bytes, which makes every
 *    ldmatrix phase conflict-free for HD in {16, 32, 64, 128}; the wgmma kernel uses the
 *    hardware's 128-byte swizzle instead (attention_wgmma.cuh).
 */
#include "attention.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef __nv_bfloat16 bf16;

// ----------------------------------------------------------------------------
// error checks

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

// ----------------------------------------------------------------------------
// device helpers: cp.async, ldmatrix, mma.sync

#define ATTN_PAD 8                      // bf16 elements of padding per shared-memory row
#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// 16-byte global->shared copy; when !valid nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a (16x16, row-major) * b (16x8, col-major), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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

// Accumulators of n-blocks 2*kk and 2*kk+1 (16 x 16 of C layout) as the A operand of k-step kk.
__device__ __forceinline__ void acc_to_frag_a(uint32_t (&a)[4], const float (&c0)[4],
                                              const float (&c1)[4]) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
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

// ----------------------------------------------------------------------------
// launch helpers

// grid: x = h + H*b (H heads, or kv heads for the dK/dV pass), y = tile of `rows` rows of T.
static dim3 attention_grid(int B, int T, int H, int rows) {
    return dim3((unsigned)(H * B), (unsigned)((T + rows - 1) / rows));
}

// Opt the kernel into `smem` bytes of dynamic shared memory (every shape here passes the 48 KB
// a launch gets without asking).
template <typename Kernel>
static void attention_set_max_smem(Kernel kernel, size_t smem) {
    attention_check(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

// log2(e)/sqrt(HD): the logits' scale in base 2, the same in every forward kernel (the lse they
// save, and so the backward, must not depend on which one ran).
static float attention_scale_log2(int HD) { return ATTN_LOG2E / sqrtf((float)HD); }

// ----------------------------------------------------------------------------
// forward

// One block: BR = 16*MT*NWARPS query rows of one (batch, head); K/V tiles of BC keys; MINB blocks
// per multiprocessor asked of the register allocator.
// grid: x = h + H*b, y = query tile counted from the last (longest rows first).
template <int HD, int MT, int NWARPS, int BC, int MINB>
__global__ void __launch_bounds__(NWARPS * 32, MINB)
    attention_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int H, int KVH,
                             float scale_log2) {
    constexpr int BR = 16 * MT * NWARPS;
    constexpr int LD = HD + ATTN_PAD;
    constexpr int NT = NWARPS * 32;
    constexpr int NB = HD / 8;  // n-blocks of the output
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16* sQ = reinterpret_cast<bf16*>(attention_smem);  // (BR, LD)
    bf16* sK = sQ + BR * LD;                              // (2, BC, LD)
    bf16* sV = sK + 2 * BC * LD;                          // (2, BC, LD)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x % H, b = blockIdx.x / H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;
    const int kvh = h / (H / KVH);
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gQ = seq + (int64_t)h * HD;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    const int n_tiles = (min(q0 + BR, T) - 1) / BC + 1;  // tiles holding keys <= last query

    tile_load_async<BR, HD, NT>(sQ, gQ, QKV, q0, T, tid);
    tile_load_async<BC, HD, NT>(sK, gK, QKV, 0, T, tid);
    tile_load_async<BC, HD, NT>(sV, gV, QKV, 0, T, tid);
    cp_async_commit();

    const int wrow = warp * 16 * MT;       // first row of this warp inside the tile
    const int wq0 = q0 + wrow;             // its first query index
    const int wq_last = wq0 + 16 * MT - 1;
    float o[MT][NB][4];
    float row_max[MT][2], row_sum[MT][2];  // per thread: rows lane/4 and lane/4 + 8 of each mt
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][nb][e] = 0.0f;
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.0f;
    }

    for (int j = 0; j < n_tiles; j++) {
        // Tile j has landed, and every warp is done with tile j-1, whose buffer we refill now.
        cp_async_wait_all();
        __syncthreads();
        if (j + 1 < n_tiles) {
            int nxt = (j + 1) & 1;
            tile_load_async<BC, HD, NT>(sK + nxt * BC * LD, gK, QKV, (j + 1) * BC, T, tid);
            tile_load_async<BC, HD, NT>(sV + nxt * BC * LD, gV, QKV, (j + 1) * BC, T, tid);
        }
        cp_async_commit();
        const int k0 = j * BC;
        if (k0 > wq_last) continue;  // every key of this tile is right of this warp's diagonal
        const bf16* tK = sK + (j & 1) * BC * LD;
        const bf16* tV = sV + (j & 1) * BC * LD;

        // S = Q K^T  (16*MT x BC per warp)
        float s[MT][BC / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nb = 0; nb < BC / 8; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[mt][nb][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldsm_x4(a[mt], frag_a_addr<LD>(sQ, wrow + mt * 16, kk * 16, lane));
#pragma unroll
            for (int p = 0; p < BC / 16; p++) {
                uint32_t bk[4];
                ldsm_x4(bk, frag_bt_addr<LD>(tK, p * 16, kk * 16, lane));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_16816(s[mt][2 * p], a[mt], bk[0], bk[1]);
                    mma_16816(s[mt][2 * p + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        // causal mask; keys >= T are always right of the diagonal of every valid query
        if (k0 + BC - 1 > wq0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nb = 0; nb < BC / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int row = wq0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
                        int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                        if (key > row) s[mt][nb][e] = -INFINITY;
                    }
        }

        // online softmax in base 2: p = 2^(s*scale_log2 - max); rescale O and the running sum.
        // Every row sees key 0 in tile 0, so its max is finite from the first tile on.
        float alpha[MT][2];
        bool max_moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float mx = -INFINITY;
#pragma unroll
                for (int nb = 0; nb < BC / 8; nb++)
                    mx = fmaxf(mx, fmaxf(s[mt][nb][2 * hf], s[mt][nb][2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_old = row_max[mt][hf];
                const float m_new = fmaxf(m_old, mx * scale_log2);
                max_moved |= m_new != m_old;
                alpha[mt][hf] = m_new == m_old ? 1.0f : fast_exp2(m_old - m_new);
                row_max[mt][hf] = m_new;
                float sum = 0.0f;
#pragma unroll
                for (int nb = 0; nb < BC / 8; nb++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float p = fast_exp2(fmaf(s[mt][nb][2 * hf + e], scale_log2, -m_new));
                        s[mt][nb][2 * hf + e] = p;
                        sum += p;
                    }
                // The quad's partial sums stay apart until the end: alpha is the same for all 4.
                row_sum[mt][hf] = row_sum[mt][hf] * alpha[mt][hf] + sum;
            }
        // Rescale O only when some row of the warp saw a new maximum (rarer as tiles go by);
        // alpha is exactly 1 for the rows that did not.
        if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++) o[mt][nb][e] *= alpha[mt][e >> 1];
        }

        // O += P V
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) acc_to_frag_a(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int p = 0; p < HD / 16; p++) {
                uint32_t bv[4];
                ldsm_x4_trans(bv, frag_b_trans_addr<LD>(tV, kk * 16, p * 16, lane));
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_16816(o[mt][2 * p], a[mt], bv[0], bv[1]);
                    mma_16816(o[mt][2 * p + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
    }

    // O / l -> bf16; lse = ln(sum_j e^(s_j*scale)) = (max + log2(l)) * ln 2
    const int64_t out_stride = (int64_t)H * HD;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float l = row_sum[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float inv = 1.0f / l;
            int row = wq0 + mt * 16 + (lane >> 2) + hf * 8;
            if (row < T) {
                bf16* dst = out + ((int64_t)b * T + row) * out_stride + (int64_t)h * HD +
                            (lane & 3) * 2;
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
                    *reinterpret_cast<uint32_t*>(dst + nb * 8) =
                        pack_bf16(o[mt][nb][2 * hf] * inv, o[mt][nb][2 * hf + 1] * inv);
                if ((lane & 3) == 0)
                    lse[((int64_t)b * H + h) * T + row] = (row_max[mt][hf] + log2f(l)) * ATTN_LN2;
            }
        }
}

template <int HD, int MT, int NWARPS, int BC, int MINB>
static void attention_forward_run(bf16* out, float* lse, const bf16* qkv, int B, int T, int H,
                                  int KVH, cudaStream_t stream) {
    constexpr int BR = 16 * MT * NWARPS;
    constexpr int LD = HD + ATTN_PAD;
    const size_t smem = (size_t)(BR + 4 * BC) * LD * sizeof(bf16);
    auto kernel = attention_forward_kernel<HD, MT, NWARPS, BC, MINB>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), NWARPS * 32, smem, stream>>>(out, lse, qkv, T, H, KVH,
                                                                      attention_scale_log2(HD));
    attention_check(cudaGetLastError());
}

// Dispatch on HD once the arguments are checked (attention_forward_check).
template <int MT, int NWARPS, int BC, int MINB>
static void attention_forward_mma_hd(bf16* o, float* lse, const bf16* x, int B, int T, int H,
                                     int KVH, int HD, cudaStream_t s) {
    switch (HD) {
        case 16: attention_forward_run<16, MT, NWARPS, BC, MINB>(o, lse, x, B, T, H, KVH, s); break;
        case 32: attention_forward_run<32, MT, NWARPS, BC, MINB>(o, lse, x, B, T, H, KVH, s); break;
        case 64: attention_forward_run<64, MT, NWARPS, BC, MINB>(o, lse, x, B, T, H, KVH, s); break;
        default: attention_forward_run<128, MT, NWARPS, BC, MINB>(o, lse, x, B, T, H, KVH, s); break;
    }
}

// Forward through mma.sync with a chosen tile shape (the lab times several shapes).
template <int MT, int NWARPS, int BC, int MINB>
static void attention_forward_tiled(void* out, float* lse, const void* qkv, int B, int T, int H,
                                    int KVH, int HD, void* stream) {
    if (!attention_forward_check("attention_forward_bf16", out, lse, qkv, B, T, H, KVH, HD))
        return;
    attention_forward_mma_hd<MT, NWARPS, BC, MINB>(
        static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv), B, T, H, KVH, HD,
        static_cast<cudaStream_t>(stream));
}

// ----------------------------------------------------------------------------
// forward on Hopper warpgroup MMAs (sm_90a), HD 64 and 128

#include "attention_wgmma.cuh"

// ----------------------------------------------------------------------------
// backward, pass 1: D = rowsum(dO * O)

// One warp per (token, head) row. D: (B, H, T) fp32.
template <int HD>
__global__ void attention_backward_dot_kernel(float* D, const bf16* dout, const bf16* out, int B,
                                              int T, int H) {
    const int lane = threadIdx.x & 31;
    const int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (w >= (int64_t)B * T * H) return;
    const int h = (int)(w % H);
    const int64_t bt = w / H;  // b*T + t
    const int64_t off = bt * H * HD + (int64_t)h * HD;
    float acc = 0.0f;
#pragma unroll
    for (int d = lane * 2; d < HD; d += 64) {
        float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + off + d));
        float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out + off + d));
        acc = fmaf(a.x, c.x, fmaf(a.y, c.y, acc));
    }
#pragma unroll
    for (int k = 16; k >= 1; k >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, k);
    if (lane == 0) {
        const int64_t b = bt / T, t = bt % T;
        D[(b * H + h) * T + t] = acc;
    }
}

// Pass 1 of every backward launcher (these and the lab's): D into the workspace on `stream`.
template <int HD>
static void attention_backward_dot(float* D, const bf16* dout, const bf16* out, int B, int T,
                                   int H, const char* fn, cudaStream_t stream) {
    const int64_t rows = (int64_t)B * T * H;
    const int64_t blocks = (rows + 7) / 8;  // 8 warps of 256 threads, one row each
    if (blocks > 0x7fffffff) {
        fprintf(stderr, "attention: %s: B*T*H = %lld too large\n", fn, (long long)rows);
        exit(1);
    }
    attention_backward_dot_kernel<HD><<<(unsigned)blocks, 256, 0, stream>>>(D, dout, out, B, T, H);
    attention_check(cudaGetLastError());
}

// ----------------------------------------------------------------------------
// backward, pass 2: dK, dV

// One block: BC = 16*NWARPS keys of one (batch, kv head); each warp owns 16 keys and their dK, dV
// rows. The block walks query heads of the group in order, and for each the query tiles (BRQ rows)
// from the one holding key k0 to the end; Q, dO, lse, D tiles are double buffered. Per tile, with
// keys as rows (transposed products, so P^T and dS^T come out of the accumulators already in the
// A-operand layout):  S^T = K Q^T, P^T = 2^(S^T*scale_log2 - lse_log2), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.
// grid: x = kvh + KVH*b, y = kv tile (tile 0 has the most work and starts first).
template <int HD, int NWARPS, int BRQ>
__global__ void __launch_bounds__(NWARPS * 32)
    attention_backward_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                   const float* lse, const float* D, int T, int H, int KVH,
                                   float scale_log2, float scale) {
    constexpr int BC = 16 * NWARPS;
    constexpr int LD = HD + ATTN_PAD;
    constexpr int NT = NWARPS * 32;
    constexpr int NB = HD / 8;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16* sK = reinterpret_cast<bf16*>(attention_smem);  // (BC, LD)
    bf16* sV = sK + BC * LD;                              // (BC, LD)
    bf16* sQ = sV + BC * LD;                              // (2, BRQ, LD)
    bf16* sdO = sQ + 2 * BRQ * LD;                        // (2, BRQ, LD)
    float* sL = reinterpret_cast<float*>(sdO + 2 * BRQ * LD);  // (2, BRQ) lse * log2(e)
    float* sD = sL + 2 * BRQ;                                  // (2, BRQ)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int kvh = blockIdx.x % KVH, b = blockIdx.x / KVH;
    const int k0 = blockIdx.y * BC;
    const int group = H / KVH;
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;  // row stride of out / dout
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* dseq = dout + (int64_t)b * T * OS;
    const int qt0 = k0 / BRQ;                       // first query tile that sees any key here
    const int per_head = (T + BRQ - 1) / BRQ - qt0;  // query tiles per head
    const int n_iter = group * per_head;

    // Stage the (Q, dO, lse, D) tile of iteration `it` into buffer `buf`.
    auto stage = [&](int it, int buf) {
        const int hq = kvh * group + it / per_head;
        const int q0 = (qt0 + it % per_head) * BRQ;
        tile_load_async<BRQ, HD, NT>(sQ + buf * BRQ * LD, seq + (int64_t)hq * HD, QKV, q0, T, tid);
        tile_load_async<BRQ, HD, NT>(sdO + buf * BRQ * LD, dseq + (int64_t)hq * HD, OS, q0, T,
                                     tid);
        for (int i = tid; i < BRQ; i += NT) {
            const int q = q0 + i;
            const int64_t r = ((int64_t)b * H + hq) * T + q;
            sL[buf * BRQ + i] = q < T ? lse[r] * ATTN_LOG2E : 0.0f;
            sD[buf * BRQ + i] = q < T ? D[r] : 0.0f;
        }
    };

    tile_load_async<BC, HD, NT>(sK, seq + (int64_t)(H + kvh) * HD, QKV, k0, T, tid);
    tile_load_async<BC, HD, NT>(sV, seq + (int64_t)(H + KVH + kvh) * HD, QKV, k0, T, tid);
    stage(0, 0);
    cp_async_commit();

    const int wrow = warp * 16;
    const int wk0 = k0 + wrow;  // first key of this warp
    float dk[NB][4], dv[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[nb][e] = dv[nb][e] = 0.0f;

    for (int it = 0; it < n_iter; it++) {
        // Tile `it` has landed and every warp is done with tile it-1, whose buffers we refill.
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < n_iter) stage(it + 1, (it + 1) & 1);
        cp_async_commit();
        const int q0 = (qt0 + it % per_head) * BRQ;
        if (q0 + BRQ - 1 < wk0) continue;  // every query of this tile is left of these keys
        const int buf = it & 1;
        const bf16* tQ = sQ + buf * BRQ * LD;
        const bf16* tdO = sdO + buf * BRQ * LD;
        const float* tL = sL + buf * BRQ;
        const float* tD = sD + buf * BRQ;

        // S^T = K Q^T  (16 keys x BRQ queries)
        float st[BRQ / 8][4];
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[nb][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t a[4];
            ldsm_x4(a, frag_a_addr<LD>(sK, wrow, kk * 16, lane));
#pragma unroll
            for (int p = 0; p < BRQ / 16; p++) {
                uint32_t bq[4];
                ldsm_x4(bq, frag_bt_addr<LD>(tQ, p * 16, kk * 16, lane));
                mma_16816(st[2 * p], a, bq[0], bq[1]);
                mma_16816(st[2 * p + 1], a, bq[2], bq[3]);
            }
        }

        // P^T; masked where key > query, and for the zero-filled queries past T
        const bool edge = q0 < wk0 + 15 || q0 + BRQ > T;
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                float p = fast_exp2(fmaf(st[nb][e], scale_log2, -tL[qi]));
                if (edge) {
                    const int key = wk0 + (lane >> 2) + (e >> 1) * 8;
                    const int q = q0 + qi;
                    if (key > q || q >= T) p = 0.0f;
                }
                st[nb][e] = p;
            }

        // dV += P^T dO
#pragma unroll
        for (int kk = 0; kk < BRQ / 16; kk++) {
            uint32_t a[4];
            acc_to_frag_a(a, st[2 * kk], st[2 * kk + 1]);
#pragma unroll
            for (int p = 0; p < HD / 16; p++) {
                uint32_t bo[4];
                ldsm_x4_trans(bo, frag_b_trans_addr<LD>(tdO, kk * 16, p * 16, lane));
                mma_16816(dv[2 * p], a, bo[0], bo[1]);
                mma_16816(dv[2 * p + 1], a, bo[2], bo[3]);
            }
        }

        // dP^T = V dO^T
        float dpt[BRQ / 8][4];
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) dpt[nb][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t a[4];
            ldsm_x4(a, frag_a_addr<LD>(sV, wrow, kk * 16, lane));
#pragma unroll
            for (int p = 0; p < BRQ / 16; p++) {
                uint32_t bo[4];
                ldsm_x4(bo, frag_bt_addr<LD>(tdO, p * 16, kk * 16, lane));
                mma_16816(dpt[2 * p], a, bo[0], bo[1]);
                mma_16816(dpt[2 * p + 1], a, bo[2], bo[3]);
            }
        }

        // dS^T = P^T (dP^T - D)
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                dpt[nb][e] = st[nb][e] * (dpt[nb][e] - tD[qi]);
            }

        // dK += dS^T Q
#pragma unroll
        for (int kk = 0; kk < BRQ / 16; kk++) {
            uint32_t a[4];
            acc_to_frag_a(a, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
            for (int p = 0; p < HD / 16; p++) {
                uint32_t bq[4];
                ldsm_x4_trans(bq, frag_b_trans_addr<LD>(tQ, kk * 16, p * 16, lane));
                mma_16816(dk[2 * p], a, bq[0], bq[1]);
                mma_16816(dk[2 * p + 1], a, bq[2], bq[3]);
            }
        }
    }

    // dK = scale * sum dS^T Q (the logits were scaled); write the rows of keys < T
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int key = wk0 + (lane >> 2) + hf * 8;
        if (key >= T) continue;
        bf16* row = dqkv + ((int64_t)b * T + key) * QKV + (lane & 3) * 2;
        bf16* dst_k = row + (int64_t)(H + kvh) * HD;
        bf16* dst_v = row + (int64_t)(H + KVH + kvh) * HD;
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            *reinterpret_cast<uint32_t*>(dst_k + nb * 8) =
                pack_bf16(dk[nb][2 * hf] * scale, dk[nb][2 * hf + 1] * scale);
            *reinterpret_cast<uint32_t*>(dst_v + nb * 8) =
                pack_bf16(dv[nb][2 * hf], dv[nb][2 * hf + 1]);
        }
    }
}

// ----------------------------------------------------------------------------
// backward, pass 3: dQ

// One block: BR = 16*NWARPS query rows of one (batch, head), like the forward. Per kv tile:
// S = Q K^T, P = 2^(S*scale_log2 - lse_log2), dP = dO V^T, dS = P (dP - D), dQ += dS K.
// grid: x = h + H*b, y = query tile counted from the last.
template <int HD, int NWARPS, int BC>
__global__ void __launch_bounds__(NWARPS * 32)
    attention_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                 const float* D, int T, int H, int KVH, float scale_log2,
                                 float scale) {
    constexpr int BR = 16 * NWARPS;
    constexpr int LD = HD + ATTN_PAD;
    constexpr int NT = NWARPS * 32;
    constexpr int NB = HD / 8;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16* sQ = reinterpret_cast<bf16*>(attention_smem);  // (BR, LD)
    bf16* sdO = sQ + BR * LD;                             // (BR, LD)
    bf16* sK = sdO + BR * LD;                             // (2, BC, LD)
    bf16* sV = sK + 2 * BC * LD;                          // (2, BC, LD)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x % H, b = blockIdx.x / H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;
    const int kvh = h / (H / KVH);
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    const int n_tiles = (min(q0 + BR, T) - 1) / BC + 1;

    tile_load_async<BR, HD, NT>(sQ, seq + (int64_t)h * HD, QKV, q0, T, tid);
    tile_load_async<BR, HD, NT>(sdO, dout + (int64_t)b * T * OS + (int64_t)h * HD, OS, q0, T, tid);
    tile_load_async<BC, HD, NT>(sK, gK, QKV, 0, T, tid);
    tile_load_async<BC, HD, NT>(sV, gV, QKV, 0, T, tid);
    cp_async_commit();

    const int wrow = warp * 16;
    const int wq0 = q0 + wrow;
    float lse_log2[2], drow[2];  // rows lane/4 and lane/4 + 8 of this warp
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int q = wq0 + (lane >> 2) + hf * 8;
        const int64_t r = ((int64_t)b * H + h) * T + q;
        lse_log2[hf] = q < T ? lse[r] * ATTN_LOG2E : 0.0f;
        drow[hf] = q < T ? D[r] : 0.0f;
    }
    float dq[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[nb][e] = 0.0f;

    for (int j = 0; j < n_tiles; j++) {
        cp_async_wait_all();
        __syncthreads();
        if (j + 1 < n_tiles) {
            int nxt = (j + 1) & 1;
            tile_load_async<BC, HD, NT>(sK + nxt * BC * LD, gK, QKV, (j + 1) * BC, T, tid);
            tile_load_async<BC, HD, NT>(sV + nxt * BC * LD, gV, QKV, (j + 1) * BC, T, tid);
        }
        cp_async_commit();
        const int k0 = j * BC;
        if (k0 > wq0 + 15) continue;
        const bf16* tK = sK + (j & 1) * BC * LD;
        const bf16* tV = sV + (j & 1) * BC * LD;

        // S = Q K^T and dP = dO V^T  (16 x BC each)
        float s[BC / 8][4], dp[BC / 8][4];
#pragma unroll
        for (int nb = 0; nb < BC / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nb][e] = dp[nb][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t aq[4], ao[4];
            ldsm_x4(aq, frag_a_addr<LD>(sQ, wrow, kk * 16, lane));
            ldsm_x4(ao, frag_a_addr<LD>(sdO, wrow, kk * 16, lane));
#pragma unroll
            for (int p = 0; p < BC / 16; p++) {
                uint32_t bk[4], bv[4];
                ldsm_x4(bk, frag_bt_addr<LD>(tK, p * 16, kk * 16, lane));
                ldsm_x4(bv, frag_bt_addr<LD>(tV, p * 16, kk * 16, lane));
                mma_16816(s[2 * p], aq, bk[0], bk[1]);
                mma_16816(s[2 * p + 1], aq, bk[2], bk[3]);
                mma_16816(dp[2 * p], ao, bv[0], bv[1]);
                mma_16816(dp[2 * p + 1], ao, bv[2], bv[3]);
            }
        }

        // dS = P (dP - D), P masked right of the diagonal
        const bool diag = k0 + BC - 1 > wq0;
#pragma unroll
        for (int nb = 0; nb < BC / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(fmaf(s[nb][e], scale_log2, -lse_log2[e >> 1]));
                if (diag) {
                    const int row = wq0 + (lane >> 2) + (e >> 1) * 8;
                    const int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                    if (key > row) p = 0.0f;
                }
                s[nb][e] = p * (dp[nb][e] - drow[e >> 1]);
            }

        // dQ += dS K
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            uint32_t a[4];
            acc_to_frag_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int p = 0; p < HD / 16; p++) {
                uint32_t bk[4];
                ldsm_x4_trans(bk, frag_b_trans_addr<LD>(tK, kk * 16, p * 16, lane));
                mma_16816(dq[2 * p], a, bk[0], bk[1]);
                mma_16816(dq[2 * p + 1], a, bk[2], bk[3]);
            }
        }
    }

#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int q = wq0 + (lane >> 2) + hf * 8;
        if (q >= T) continue;
        bf16* dst = dqkv + ((int64_t)b * T + q) * QKV + (int64_t)h * HD + (lane & 3) * 2;
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
            *reinterpret_cast<uint32_t*>(dst + nb * 8) =
                pack_bf16(dq[nb][2 * hf] * scale, dq[nb][2 * hf + 1] * scale);
    }
}

template <int HD, int KV_WARPS, int KV_BRQ, int Q_WARPS, int Q_BC>
static void attention_backward_run(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                                   const float* lse, float* D, int B, int T, int H, int KVH,
                                   cudaStream_t stream) {
    constexpr int LD = HD + ATTN_PAD;
    const float scale = 1.0f / sqrtf((float)HD);
    const float scale_log2 = scale * ATTN_LOG2E;

    attention_backward_dot<HD>(D, dout, out, B, T, H, "attention_backward_bf16", stream);

    {
        constexpr int BC = 16 * KV_WARPS;
        const size_t smem =
            (size_t)(2 * BC + 4 * KV_BRQ) * LD * sizeof(bf16) + 4 * KV_BRQ * sizeof(float);
        auto kernel = attention_backward_dkdv_kernel<HD, KV_WARPS, KV_BRQ>;
        attention_set_max_smem(kernel, smem);
        kernel<<<attention_grid(B, T, KVH, BC), KV_WARPS * 32, smem, stream>>>(
            dqkv, dout, qkv, lse, D, T, H, KVH, scale_log2, scale);
        attention_check(cudaGetLastError());
    }
    {
        constexpr int BR = 16 * Q_WARPS;
        const size_t smem = (size_t)(2 * BR + 4 * Q_BC) * LD * sizeof(bf16);
        auto kernel = attention_backward_dq_kernel<HD, Q_WARPS, Q_BC>;
        attention_set_max_smem(kernel, smem);
        kernel<<<attention_grid(B, T, H, BR), Q_WARPS * 32, smem, stream>>>(
            dqkv, dout, qkv, lse, D, T, H, KVH, scale_log2, scale);
        attention_check(cudaGetLastError());
    }
}

// Backward with chosen tile shapes, dispatched on HD (the lab times several shapes).
template <int KV_WARPS, int KV_BRQ, int Q_WARPS, int Q_BC>
static void attention_backward_tiled(void* dqkv, const void* dout, const void* qkv,
                                     const void* out, const float* lse, void* workspace, int B,
                                     int T, int H, int KVH, int HD, void* stream) {
    if (!attention_backward_check("attention_backward_bf16", dqkv, dout, qkv, out, lse, workspace,
                                  B, T, H, KVH, HD))
        return;
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    float* D = static_cast<float*>(workspace);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (HD) {
        case 16:
            attention_backward_run<16, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC>(dx, dy, x, y, lse, D, B,
                                                                        T, H, KVH, s);
            break;
        case 32:
            attention_backward_run<32, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC>(dx, dy, x, y, lse, D, B,
                                                                        T, H, KVH, s);
            break;
        case 64:
            attention_backward_run<64, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC>(dx, dy, x, y, lse, D, B,
                                                                        T, H, KVH, s);
            break;
        default:
            attention_backward_run<128, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC>(dx, dy, x, y, lse, D, B,
                                                                         T, H, KVH, s);
            break;
    }
}

// ----------------------------------------------------------------------------
// backward on Hopper warpgroup MMAs (sm_90a), HD 64 and 128

#include "attention_bwd_wgmma.cuh"

// ----------------------------------------------------------------------------
// the C interface (tile shapes chosen in dev/cuda/attention.cu)

// Timed on H200 at HD=128 (dev/cuda/attention.cu, "Results"): 32 rows per warp halve the shared-
// memory reads per mma against 16, and 32-key tiles keep S in registers without spills (255 regs,
// 2 blocks of 4 warps per SM). The backward shapes were all within 2% of each other.
// The wgmma forward (lab, session 6): warp-specialised, 3-stage K/V rings below 32768 tokens and
// 2-stage rings from there on: T = 2048 / 4096 / 16384 k3v3 460 / 492 / 607 TFLOP/s (k2v2 455 /
// 496 / 556), T = 65536 and B=3 T=131072 H=32 k2v2 589 / 579 (k3v3 562 / 562); the previous
// two-warpgroup kernel measured 396 / 403 / 486 / 506 / 474 (the mma.sync kernel: 295, 311, 338
// at the first three). Both rings compute the same bits.
#define ATTN_WG_FWD_LONG_T 32768 // from here on the 2-stage rings
// The wgmma backward (lab, session 5): two warpgroups and 3 ring slots in both passes ("wg2 s3")
// against one warpgroup and 2 slots: 345 / 381 / 409 against 331 / 387 / 374 TFLOP/s at T =
// 2048 / 4096 / 16384 (the mma.sync backward: 188 / 202 / 217).
#define ATTN_WG_BWD_KV_NWG 2    // dK/dV pass: warpgroups of 64 keys per block
#define ATTN_WG_BWD_KV_STAGES 3 // its ring slots of streamed Q/dO tiles
#define ATTN_WG_BWD_Q_NWG 2     // dQ pass: warpgroups of 64 query rows per block
#define ATTN_WG_BWD_Q_STAGES 3  // its ring slots of streamed K/V tiles
#define ATTN_FWD_MT 2      // 16-row blocks per warp
#define ATTN_FWD_WARPS 4   // query tile = 16 * MT * WARPS = 128 rows
#define ATTN_FWD_BC 32     // keys per K/V tile
#define ATTN_FWD_MINB 1    // blocks per multiprocessor asked of the register allocator
#define ATTN_KV_WARPS 8    // dK/dV: 16 keys per warp, 128 per block
#define ATTN_KV_BRQ 64     // query rows per tile in the dK/dV pass
#define ATTN_Q_WARPS 8     // dQ: 16 query rows per warp, 128 per block
#define ATTN_Q_BC 64       // keys per tile in the dQ pass

// The wgmma kernels where they can run: HD 64/128 and sm_90a device code for this device.
static int attention_takes_wgmma(int HD) {
    return attention_wgmma_supports_head_dim(HD) && attention_wgmma_available();
}

// The wgmma kernel where it can run, else the mma.sync one; both take every T >= 1 and write the
// same out and lse.
extern "C" void attention_forward_bf16(void* out, float* lse, const void* qkv, int B, int T,
                                       int H, int KVH, int HD, void* stream) {
    if (!attention_forward_check("attention_forward_bf16", out, lse, qkv, B, T, H, KVH, HD))
        return;
    bf16* o = static_cast<bf16*>(out);
    const bf16* x = static_cast<const bf16*>(qkv);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (attention_takes_wgmma(HD) && T < ATTN_WG_FWD_LONG_T)
        attention_forward_wgmma_hd<3, 3>(o, lse, x, B, T, H, KVH, HD, s);
    else if (attention_takes_wgmma(HD))
        attention_forward_wgmma_hd<2, 2>(o, lse, x, B, T, H, KVH, HD, s);
    else
        attention_forward_mma_hd<ATTN_FWD_MT, ATTN_FWD_WARPS, ATTN_FWD_BC, ATTN_FWD_MINB>(
            o, lse, x, B, T, H, KVH, HD, s);
}

extern "C" size_t attention_backward_workspace_bytes(int B, int T, int H, int KVH, int HD) {
    (void)KVH;
    (void)HD;
    if (B <= 0 || T <= 0 || H <= 0) return 0;
    return (size_t)B * (size_t)T * (size_t)H * sizeof(float);  // D: (B, H, T) fp32
}

// The wgmma backward where it can run (as the forward), else the mma.sync one; the same
// workspace, both deterministic.
extern "C" void attention_backward_bf16(void* dqkv, const void* dout, const void* qkv,
                                        const void* out, const float* lse, void* workspace,
                                        int B, int T, int H, int KVH, int HD, void* stream) {
    if (attention_takes_wgmma(HD))
        attention_backward_wgmma<ATTN_WG_BWD_KV_NWG, ATTN_WG_BWD_KV_STAGES, ATTN_WG_BWD_Q_NWG,
                                 ATTN_WG_BWD_Q_STAGES>(dqkv, dout, qkv, out, lse, workspace, B, T,
                                                       H, KVH, HD, stream);
    else
        attention_backward_tiled<ATTN_KV_WARPS, ATTN_KV_BRQ, ATTN_Q_WARPS, ATTN_Q_BC>(
            dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD, stream);
}

extern "C" int attention_uses_wgmma(int HD) { return attention_takes_wgmma(HD); }

extern "C" int attention_supports_head_dim(int HD) {
    return HD == 16 || HD == 32 || HD == 64 || HD == 128;
}
