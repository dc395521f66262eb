/*
 * attention.cu — causal grouped-query flash attention, forward and backward, bf16 in/out with fp32
 * accumulation: the C interface of kernels/attention.h, and the kernels it runs. On Hopper
 * (sm_90a build, compute capability 9.0) at HD 64 and 128 those are the warpgroup-MMA (wgmma)
 * kernels of attention_wgmma.cuh (forward) and attention_bwd_wgmma.cuh (backward), included
 * below; everywhere else the mma.sync m16n8k16 kernels of this file (sm_80+). Both compute the
 * same function with the same scheme and the same deterministic sums; the device helpers they
 * share are in attention_common.cuh. The lab dev/cuda/attention.cu includes this file: it checks
 * these kernels against a CPU reference, times them, and holds the other tile shapes and the
 * variants that were tried.
 *
 * Scheme (FlashAttention-2):
 *  - forward: one block per (query tile, head, batch); K/V tiles stream through shared memory with
 *    cp.async double buffering; online softmax in fp32 in base 2 (log2(e)/sqrt(HD) folded into one
 *    scale), O rescaled only when a row's maximum moved; tiles right of the diagonal are never
 *    loaded. Saves lse (natural log) per query row. The wgmma forward keeps this scheme and this
 *    output (same out, same lse for the backward) with 128-key tiles, a producer warpgroup
 *    feeding K/V through mbarrier rings and two consumer warpgroups taking turns on the tensor
 *    cores.
 *  - backward: (1) D = rowsum(dO * O) per (b, h, t) into the workspace; (2) one block per
 *    (kv tile, kv head, batch) owns dK and dV of its keys in registers and walks every query head of
 *    its group and every query tile at or below the diagonal in a fixed order; (3) a separate pass,
 *    one block per (query tile, head, batch), recomputes P and dS and sums dQ over the kv tiles.
 *    No atomics anywhere, so results are bit-identical from run to run.
 *  - sinks and sliding windows (GPT-OSS; attention_sink_forward_bf16 / _backward_bf16): every
 *    kernel takes a compile-time flag SW; without it the code is the causal code it always was
 *    (the extra arguments are unused), so the causal path keeps its bits and its speed. With it
 *    the window (normalised on the host to 1..T, T = none) bounds the tile loops, so tiles
 *    outside every row's window are never loaded (forward and dQ: kv tiles from the one the
 *    first row's window reaches; dK/dV: query tiles up to the last query that sees the block's
 *    last key), and partially covered tiles get an element mask like the diagonal's; the sink
 *    enters each row's online softmax once, as its starting maximum and sum (softmax_start in
 *    attention_common.cuh), so lse includes it and the backward's P = exp(S - lse) is right as
 *    it is. dsinks = -sum p_sink D by a small kernel over D (pass 1's workspace) and lse: one
 *    block per head, a fixed-order sum.
 *
 * Invariants:
 *  - Each warp owns 16*MT whole rows of every product it accumulates, so no reduction ever crosses
 *    warps; the 4 lanes of a quad that share a row combine their maxima/sums with shuffles.
 *  - Rows past T are zero-filled in shared memory (cp.async with src-size 0): never uninitialised
 *    data, so a masked probability (exactly 0) never meets a NaN. Rows past T are never stored.
 *  - Offsets into the packed arrays are 64-bit (B*T*QKV can pass 2^31).
 *  - Shared-memory rows of the mma.sync kernels are padded by 16 bytes, which makes every
 *    ldmatrix phase conflict-free for HD in {16, 32, 64, 128}; the wgmma kernels use the
 *    hardware's 128-byte swizzle instead (attention_common.cuh).
 *  - The tile shapes are template parameters; the C interface instantiates one shape per kernel
 *    (the configuration at the end of this file), the lab times others.
 */
#include "attention_common.cuh"

// ----------------------------------------------------------------------------
// forward (mma.sync)

// One block: BR = 16*MT*NWARPS query rows of one (batch, head); K/V tiles of BC keys; MINB blocks
// per multiprocessor asked of the register allocator.
// grid: x = h + H*b, y = query tile counted from the last (longest rows first).
// SW (attention_common.cuh): sinks (H) or NULL, window normalised to [1, T]; key tiles left of
// the window of every row of the block are never loaded, as those right of the diagonal.
template <int HD, int MT, int NWARPS, int BC, int MINB, bool SW = false>
__global__ void __launch_bounds__(NWARPS * 32, MINB)
    attention_forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int H, int KVH,
                             float scale_log2, const bf16* sinks, int window) {
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
    // first tile holding a key the first query sees (SW: its window; causal: key 0)
    const int j_first = SW ? attn_first_key(q0, window) / BC : 0;

    tile_load_async<BR, HD, NT>(sQ, gQ, QKV, q0, T, tid);
    tile_load_async<BC, HD, NT>(sK + (j_first & 1) * BC * LD, gK, QKV, j_first * BC, T, tid);
    tile_load_async<BC, HD, NT>(sV + (j_first & 1) * BC * LD, gV, QKV, j_first * BC, T, tid);
    cp_async_commit();

    const int wrow = warp * 16 * MT;       // first row of this warp inside the tile
    const int wq0 = q0 + wrow;             // its first query index
    const int wq_last = wq0 + 16 * MT - 1;
    float o[MT][NB][4];
    float row_max[MT][2], row_sum[MT][2];  // per thread: rows lane/4 and lane/4 + 8 of each mt
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        acc_zero(o[mt]);
        softmax_start<SW>(row_max[mt], row_sum[mt], sinks, h, lane);
    }

    for (int j = j_first; j < n_tiles; j++) {
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
        if (SW && k0 + BC - 1 < wq0 - window + 1) continue;  // ... or left of its windows
        const bf16* tK = sK + (j & 1) * BC * LD;
        const bf16* tV = sV + (j & 1) * BC * LD;

        // S = Q K^T  (16*MT x BC per warp)
        float s[MT][BC / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) acc_zero(s[mt]);
        mma_rows_bt<HD, BC, LD>(s, sQ, wrow, tK, lane);

        // causal mask; keys >= T are always right of the diagonal of every valid query
        if constexpr (SW) {
            if (k0 + BC - 1 > wq0 || k0 <= wq_last - window) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    mask_causal_window(s[mt], wq0 + mt * 16 + (lane >> 2), k0, lane, window);
            }
        } else if (k0 + BC - 1 > wq0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                mask_causal(s[mt], wq0 + mt * 16 + (lane >> 2), k0, lane);
        }

        // online softmax; O is rescaled only when some row of the warp saw a new maximum (rarer
        // as tiles go by); alpha is exactly 1 for the rows that did not.
        float alpha[MT][2];
        bool max_moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            softmax_online(s[mt], row_max[mt], row_sum[mt], alpha[mt], scale_log2, max_moved);
        if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) rescale_rows(o[mt], alpha[mt]);
        }

        // O += P V
        mma_acc_b<BC, HD, LD>(o, s, tV, lane);
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
        store_out_lse(out, lse, o[mt], row_max[mt], row_sum[mt], b, h, wq0 + mt * 16 + (lane >> 2),
                      T, H, lane);
}

// SW: sinks and window (normalised) as the kernel takes them; without SW they are unused.
template <int HD, int MT, int NWARPS, int BC, int MINB, bool SW = false>
static void attention_forward_run(bf16* out, float* lse, const bf16* qkv, int B, int T, int H,
                                  int KVH, cudaStream_t stream, const bf16* sinks = nullptr,
                                  int window = 0) {
    constexpr int BR = 16 * MT * NWARPS;
    constexpr int LD = HD + ATTN_PAD;
    const size_t smem = (size_t)(BR + 4 * BC) * LD * sizeof(bf16);
    auto kernel = attention_forward_kernel<HD, MT, NWARPS, BC, MINB, SW>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), NWARPS * 32, smem, stream>>>(
        out, lse, qkv, T, H, KVH, attention_scale_log2(HD), sinks, window);
    attention_check(cudaGetLastError());
}

// Dispatch on HD once the arguments are checked (attention_forward_check).
template <int MT, int NWARPS, int BC, int MINB, bool SW = false>
static void attention_forward_mma_hd(bf16* o, float* lse, const bf16* x, int B, int T, int H,
                                     int KVH, int HD, cudaStream_t s, const bf16* sk = nullptr,
                                     int w = 0) {
    switch (HD) {
        case 16:
            attention_forward_run<16, MT, NWARPS, BC, MINB, SW>(o, lse, x, B, T, H, KVH, s, sk, w);
            break;
        case 32:
            attention_forward_run<32, MT, NWARPS, BC, MINB, SW>(o, lse, x, B, T, H, KVH, s, sk, w);
            break;
        case 64:
            attention_forward_run<64, MT, NWARPS, BC, MINB, SW>(o, lse, x, B, T, H, KVH, s, sk, w);
            break;
        default:
            attention_forward_run<128, MT, NWARPS, BC, MINB, SW>(o, lse, x, B, T, H, KVH, s, sk,
                                                                 w);
            break;
    }
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

// Pass 1 of every backward (the mma.sync and wgmma ones, and the lab's): D into the workspace.
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
// backward, pass 2: dK, dV (mma.sync)

// One block: BC = 16*NWARPS keys of one (batch, kv head); each warp owns 16 keys and their dK, dV
// rows. The block walks query heads of the group in order, and for each the query tiles (BRQ rows)
// from the one holding key k0 to the end; Q, dO, lse, D tiles are double buffered. Per tile, with
// keys as rows (transposed products, so P^T and dS^T come out of the accumulators already in the
// A-operand layout):  S^T = K Q^T, P^T = 2^(S^T*scale_log2 - lse_log2), dV += P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.
// grid: x = kvh + KVH*b, y = kv tile (tile 0 has the most work and starts first).
// SW: window normalised to [1, T] (the sinks are in lse already): the query tiles walked end at
// the last query that sees a key of the block.
template <int HD, int NWARPS, int BRQ, bool SW = false>
__global__ void __launch_bounds__(NWARPS * 32)
    attention_backward_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                   const float* lse, const float* D, int T, int H, int KVH,
                                   float scale_log2, float scale, int window) {
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
    // one past the last query tile that sees any key here (SW: the window of the last key)
    const int qt_end = SW ? (min(T, k0 + BC - 1 + window) - 1) / BRQ + 1 : (T + BRQ - 1) / BRQ;
    const int per_head = qt_end - qt0;  // query tiles per head
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
    acc_zero(dk);
    acc_zero(dv);

    for (int it = 0; it < n_iter; it++) {
        // Tile `it` has landed and every warp is done with tile it-1, whose buffers we refill.
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < n_iter) stage(it + 1, (it + 1) & 1);
        cp_async_commit();
        const int q0 = (qt0 + it % per_head) * BRQ;
        if (q0 + BRQ - 1 < wk0) continue;  // every query of this tile is left of these keys
        if (SW && q0 >= wk0 + 15 + window) continue;  // ... or past all their windows
        const int buf = it & 1;
        const bf16* tQ = sQ + buf * BRQ * LD;
        const bf16* tdO = sdO + buf * BRQ * LD;
        const float* tL = sL + buf * BRQ;
        const float* tD = sD + buf * BRQ;

        // S^T = K Q^T  (16 keys x BRQ queries)
        float st[BRQ / 8][4];
        acc_zero(st);
        mma_rows_bt<HD, BRQ, LD>(st, sK, wrow, tQ, lane);

        // P^T; masked where key > query, and for the zero-filled queries past T (SW: and where
        // the query is past the key's window)
        const bool edge =
            q0 < wk0 + 15 || q0 + BRQ > T || (SW && q0 + BRQ - 1 >= wk0 + window);
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                float p = fast_exp2(fmaf(st[nb][e], scale_log2, -tL[qi]));
                if (edge) {
                    const int key = wk0 + (lane >> 2) + (e >> 1) * 8;
                    const int q = q0 + qi;
                    if (key > q || q >= T || (SW && q >= key + window)) p = 0.0f;
                }
                st[nb][e] = p;
            }

        // dV += P^T dO
        mma_acc_b<BRQ, HD, LD>(dv, st, tdO, lane);

        // dP^T = V dO^T
        float dpt[BRQ / 8][4];
        acc_zero(dpt);
        mma_rows_bt<HD, BRQ, LD>(dpt, sV, wrow, tdO, lane);

        // dS^T = P^T (dP^T - D)
#pragma unroll
        for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qi = nb * 8 + (lane & 3) * 2 + (e & 1);
                dpt[nb][e] = st[nb][e] * (dpt[nb][e] - tD[qi]);
            }

        // dK += dS^T Q
        mma_acc_b<BRQ, HD, LD>(dk, dpt, tQ, lane);
    }

    store_dk_dv(dqkv, dk, dv, QKV, b, kvh, wk0 + (lane >> 2), T, H, KVH, lane, scale);
}

// ----------------------------------------------------------------------------
// backward, pass 3: dQ (mma.sync)

// One block: BR = 16*NWARPS query rows of one (batch, head), like the forward. Per kv tile:
// S = Q K^T, P = 2^(S*scale_log2 - lse_log2), dP = dO V^T, dS = P (dP - D), dQ += dS K.
// grid: x = h + H*b, y = query tile counted from the last.
// SW: window normalised to [1, T]; kv tiles left of every row's window are never loaded.
template <int HD, int NWARPS, int BC, bool SW = false>
__global__ void __launch_bounds__(NWARPS * 32)
    attention_backward_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                 const float* D, int T, int H, int KVH, float scale_log2,
                                 float scale, int window) {
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
    const int j_first = SW ? attn_first_key(q0, window) / BC : 0;  // first tile any row sees

    tile_load_async<BR, HD, NT>(sQ, seq + (int64_t)h * HD, QKV, q0, T, tid);
    tile_load_async<BR, HD, NT>(sdO, dout + (int64_t)b * T * OS + (int64_t)h * HD, OS, q0, T, tid);
    tile_load_async<BC, HD, NT>(sK + (j_first & 1) * BC * LD, gK, QKV, j_first * BC, T, tid);
    tile_load_async<BC, HD, NT>(sV + (j_first & 1) * BC * LD, gV, QKV, j_first * BC, T, tid);
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
    acc_zero(dq);

    for (int j = j_first; j < n_tiles; j++) {
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
        if (SW && k0 + BC - 1 < wq0 - window + 1) continue;  // left of this warp's windows
        const bf16* tK = sK + (j & 1) * BC * LD;
        const bf16* tV = sV + (j & 1) * BC * LD;

        // S = Q K^T and dP = dO V^T  (16 x BC each)
        float s[BC / 8][4], dp[BC / 8][4];
        acc_zero(s);
        acc_zero(dp);
        mma_rows_bt_pair<HD, BC, LD>(s, sQ, tK, dp, sdO, tV, wrow, lane);

        // dS = P (dP - D), P masked right of the diagonal (SW: and left of the window)
        const bool diag = k0 + BC - 1 > wq0 || (SW && k0 <= wq0 + 15 - window);
#pragma unroll
        for (int nb = 0; nb < BC / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(fmaf(s[nb][e], scale_log2, -lse_log2[e >> 1]));
                if (diag) {
                    const int row = wq0 + (lane >> 2) + (e >> 1) * 8;
                    const int key = k0 + nb * 8 + (lane & 3) * 2 + (e & 1);
                    if (key > row || (SW && key <= row - window)) p = 0.0f;
                }
                s[nb][e] = p * (dp[nb][e] - drow[e >> 1]);
            }

        // dQ += dS K
        mma_acc_b<BC, HD, LD>(dq, s, tK, lane);
    }

    store_dq(dqkv, dq, QKV, b, h, wq0 + (lane >> 2), T, lane, scale);
}

// The two passes' launches, apart (the lab times them one by one).
// SW: the window normalised to [1, T]; without SW unused.
template <int HD, int NWARPS, int BRQ, bool SW = false>
static void attention_backward_dkdv_launch(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                           const float* lse, const float* D, int B, int T, int H,
                                           int KVH, cudaStream_t stream, int window = 0) {
    constexpr int LD = HD + ATTN_PAD, BC = 16 * NWARPS;
    const float scale = 1.0f / sqrtf((float)HD);
    const size_t smem = (size_t)(2 * BC + 4 * BRQ) * LD * sizeof(bf16) + 4 * BRQ * sizeof(float);
    auto kernel = attention_backward_dkdv_kernel<HD, NWARPS, BRQ, SW>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, KVH, BC), NWARPS * 32, smem, stream>>>(
        dqkv, dout, qkv, lse, D, T, H, KVH, scale * ATTN_LOG2E, scale, window);
    attention_check(cudaGetLastError());
}
template <int HD, int NWARPS, int BC, bool SW = false>
static void attention_backward_dq_launch(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                         const float* lse, const float* D, int B, int T, int H,
                                         int KVH, cudaStream_t stream, int window = 0) {
    constexpr int LD = HD + ATTN_PAD, BR = 16 * NWARPS;
    const float scale = 1.0f / sqrtf((float)HD);
    const size_t smem = (size_t)(2 * BR + 4 * BC) * LD * sizeof(bf16);
    auto kernel = attention_backward_dq_kernel<HD, NWARPS, BC, SW>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), NWARPS * 32, smem, stream>>>(
        dqkv, dout, qkv, lse, D, T, H, KVH, scale * ATTN_LOG2E, scale, window);
    attention_check(cudaGetLastError());
}

// The three passes at one head dim. SW: the window normalised to [1, T] (without SW unused).
template <int HD, int KV_WARPS, int KV_BRQ, int Q_WARPS, int Q_BC, bool SW>
static void attention_backward_mma_run(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                       const bf16* out, const float* lse, float* D, int B, int T,
                                       int H, int KVH, cudaStream_t s, int window) {
    attention_backward_dot<HD>(D, dout, out, B, T, H, "attention_backward_bf16", s);
    attention_backward_dkdv_launch<HD, KV_WARPS, KV_BRQ, SW>(dqkv, dout, qkv, lse, D, B, T, H,
                                                             KVH, s, window);
    attention_backward_dq_launch<HD, Q_WARPS, Q_BC, SW>(dqkv, dout, qkv, lse, D, B, T, H, KVH, s,
                                                        window);
}

// The three passes, dispatched on HD once the arguments are checked (attention_backward_check).
// <dK/dV warps (16 keys each), query rows per tile, dQ warps (16 rows each), keys per tile>.
template <int KV_WARPS, int KV_BRQ, int Q_WARPS, int Q_BC, bool SW = false>
static void attention_backward_mma_hd(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                      const bf16* out, const float* lse, float* D, int B, int T,
                                      int H, int KVH, int HD, cudaStream_t s, int window = 0) {
    switch (HD) {
        case 16:
            attention_backward_mma_run<16, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC, SW>(
                dqkv, dout, qkv, out, lse, D, B, T, H, KVH, s, window);
            break;
        case 32:
            attention_backward_mma_run<32, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC, SW>(
                dqkv, dout, qkv, out, lse, D, B, T, H, KVH, s, window);
            break;
        case 64:
            attention_backward_mma_run<64, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC, SW>(
                dqkv, dout, qkv, out, lse, D, B, T, H, KVH, s, window);
            break;
        default:
            attention_backward_mma_run<128, KV_WARPS, KV_BRQ, Q_WARPS, Q_BC, SW>(
                dqkv, dout, qkv, out, lse, D, B, T, H, KVH, s, window);
            break;
    }
}

// ----------------------------------------------------------------------------
// backward on Hopper warpgroup MMAs (sm_90a), HD 64 and 128

#include "attention_bwd_wgmma.cuh"

// ----------------------------------------------------------------------------
// the C interface, and the configuration it runs (measured in dev/cuda/attention.cu; numbers in
// its header and docs/PERF.md)

// wgmma forward: 3-stage K/V rings below 32768 tokens, 2-stage rings from there on (the deeper
// ring wins at short T, the shallower one leaves room for more resident work at long T; both
// compute the same bits).
#define ATTN_WG_FWD_LONG_T 32768 // from here on the 2-stage rings
// wgmma backward: two warpgroups and 3 ring slots in both passes (the last products of a tile
// overlap the next ring barrier).
#define ATTN_WG_BWD_KV_NWG 2    // dK/dV pass: warpgroups of 64 keys per block
#define ATTN_WG_BWD_KV_STAGES 3 // its ring slots of streamed Q/dO tiles
#define ATTN_WG_BWD_Q_NWG 2     // dQ pass: warpgroups of 64 query rows per block
#define ATTN_WG_BWD_Q_STAGES 3  // its ring slots of streamed K/V tiles
// mma.sync forward: 32 rows per warp halve the shared-memory reads per mma against 16, and
// 32-key tiles keep S in registers without spills (255 registers, 2 blocks of 4 warps per SM).
// The backward shapes the lab timed were all within 2% of each other.
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
    if (!attention_backward_check("attention_backward_bf16", dqkv, dout, qkv, out, lse, workspace,
                                  B, T, H, KVH, HD))
        return;
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    float* D = static_cast<float*>(workspace);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (attention_takes_wgmma(HD))
        attention_backward_wgmma_hd<ATTN_WG_BWD_KV_NWG, ATTN_WG_BWD_KV_STAGES, ATTN_WG_BWD_Q_NWG,
                                    ATTN_WG_BWD_Q_STAGES>(dx, dy, x, y, lse, D, B, T, H, KVH, HD,
                                                          s);
    else
        attention_backward_mma_hd<ATTN_KV_WARPS, ATTN_KV_BRQ, ATTN_Q_WARPS, ATTN_Q_BC>(
            dx, dy, x, y, lse, D, B, T, H, KVH, HD, s);
}

extern "C" int attention_uses_wgmma(int HD) { return attention_takes_wgmma(HD); }

extern "C" int attention_supports_head_dim(int HD) {
    return HD == 16 || HD == 32 || HD == 64 || HD == 128;
}

// ----------------------------------------------------------------------------
// sinks and sliding windows (GPT-OSS): the same kernels with SW = true

// dsinks[h] += -sum over (b, t) of exp(sink_h - lse) * D, one block of 256 threads per head:
// thread i sums rows i, i + 256, ... in order, then a fixed tree (shuffles, then the 8 warp sums
// in order by thread 0): deterministic, no atomics. D = rowsum(dO * O) (pass 1's workspace).
__global__ void attention_sink_dsinks_kernel(float* dsinks, const bf16* sinks, const float* lse,
                                             const float* D, int B, int T, int H) {
    __shared__ float warp_sums[8];
    const int h = blockIdx.x, tid = threadIdx.x;
    const float sink = __bfloat162float(sinks[h]);
    float acc = 0.0f;
    for (int64_t i = tid; i < (int64_t)B * T; i += 256) {
        const int64_t b = i / T, t = i % T;
        const int64_t r = (b * H + h) * T + t;
        acc = fmaf(expf(sink - lse[r]), D[r], acc);
    }
#pragma unroll
    for (int k = 16; k >= 1; k >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, k);
    if ((tid & 31) == 0) warp_sums[tid >> 5] = acc;
    __syncthreads();
    if (tid == 0) {
        float total = 0.0f;
        for (int w = 0; w < 8; w++) total += warp_sums[w];
        dsinks[h] -= total;
    }
}

extern "C" void attention_sink_dsinks_bf16(float* dsinks, const void* sinks, const float* lse,
                                           const float* D, int B, int T, int H, void* stream) {
    if (dsinks == NULL || sinks == NULL || B <= 0 || T <= 0 || H <= 0) return;
    attention_sink_dsinks_kernel<<<H, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        dsinks, static_cast<const bf16*>(sinks), lse, D, B, T, H);
    attention_check(cudaGetLastError());
}

// As attention_forward_bf16 with SW kernels: the same choice of wgmma or mma.sync kernel.
extern "C" void attention_sink_forward_bf16(void* out, float* lse, const void* qkv,
                                            const void* sinks, int B, int T, int H, int KVH,
                                            int HD, int window, void* stream) {
    const char* fn = "attention_sink_forward_bf16";
    if (!attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD)) return;
    const int w = attention_window_for_kernels(fn, window, T);
    bf16* o = static_cast<bf16*>(out);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* sk = static_cast<const bf16*>(sinks);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (attention_takes_wgmma(HD) && T < ATTN_WG_FWD_LONG_T)
        attention_forward_wgmma_hd<3, 3, true>(o, lse, x, B, T, H, KVH, HD, s, sk, w);
    else if (attention_takes_wgmma(HD))
        attention_forward_wgmma_hd<2, 2, true>(o, lse, x, B, T, H, KVH, HD, s, sk, w);
    else
        attention_forward_mma_hd<ATTN_FWD_MT, ATTN_FWD_WARPS, ATTN_FWD_BC, ATTN_FWD_MINB, true>(
            o, lse, x, B, T, H, KVH, HD, s, sk, w);
}

// As attention_backward_bf16 with SW kernels (P = exp(S - lse) with the sink in lse), then the
// sinks' gradient from D and lse when dsinks and sinks are both given.
extern "C" void attention_sink_backward_bf16(void* dqkv, float* dsinks, const void* dout,
                                             const void* qkv, const void* out, const float* lse,
                                             const void* sinks, void* workspace, int B, int T,
                                             int H, int KVH, int HD, int window, void* stream) {
    const char* fn = "attention_sink_backward_bf16";
    if (!attention_backward_check(fn, dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD))
        return;
    const int w = attention_window_for_kernels(fn, window, T);
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    float* D = static_cast<float*>(workspace);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (attention_takes_wgmma(HD))
        attention_backward_wgmma_hd<ATTN_WG_BWD_KV_NWG, ATTN_WG_BWD_KV_STAGES, ATTN_WG_BWD_Q_NWG,
                                    ATTN_WG_BWD_Q_STAGES, true>(dx, dy, x, y, lse, D, B, T, H,
                                                                KVH, HD, s, w);
    else
        attention_backward_mma_hd<ATTN_KV_WARPS, ATTN_KV_BRQ, ATTN_Q_WARPS, ATTN_Q_BC, true>(
            dx, dy, x, y, lse, D, B, T, H, KVH, HD, s, w);
    attention_sink_dsinks_bf16(dsinks, sinks, lse, D, B, T, H, stream);
}
