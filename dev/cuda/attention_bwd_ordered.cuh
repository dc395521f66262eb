/*
 * attention_bwd_ordered.cuh — lab-only backward of causal grouped-query attention that computes
 * dQ inside the dK/dV pass: 5 matrix products per (kv tile, query tile, head) instead of the 7 of
 * kernels/attention.cu, still deterministic and still without floating-point atomics.
 * STATUS: written and compiled, NOT YET RUN ON A GPU (see the checklist in dev/cuda/attention.cu).
 * Included by dev/cuda/attention.cu after kernels/attention.cu, whose device helpers (tile loads,
 * ldmatrix fragment addresses, mma.sync, the D = rowsum(dO*O) pass) it uses.
 *
 * Scheme
 *  - Pass 1 (kernels/attention.cu): D = rowsum(dO * O), (B, H, T) fp32.
 *  - Pass 2 (this file): one block per (kv tile j of BC = 16*NWARPS keys, kv head, batch), the
 *    dK/dV block of kernels/attention.cu (each warp owns 16 keys, dK and dV in registers) with
 *    two changes: (a) its pairs are walked query tile outer, from the last tile down to the
 *    diagonal, head of the group inner (why: "Turn order" below); (b) after dS^T of a pair, the
 *    block also computes that pair's dQ contribution dS K (BRQ x HD, fp32) and adds it into a
 *    global fp32 dQ accumulator, in a fixed order of kv tiles enforced by a counter per
 *    (query tile, head, batch):
 *        wait until counter == j   (thread 0 spins on ld.acquire.gpu, __nanosleep backoff)
 *        acc = (j == 0 ? 0 : acc) + contribution   (plain ld/st.global.cg, no atomics)
 *        __threadfence(); counter = j + 1          (st.release.gpu by thread 0)
 *    so dQ = ((c_0 + c_1) + c_2) + ... in kv-tile order: bit-identical from run to run.
 *  - Pass 3 (this file): dQ bf16 = scale * accumulator, into the q columns of dqkv.
 *  Per pair: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q,
 *  dQ_tile = dS K: five products. The last one needs all the block's keys at once (each warp
 *  holds dS^T of its own 16 keys only), so dS^T goes to shared memory in bf16 (the same rounding
 *  as the A operand of dK += dS^T Q) and the dQ tile is split over the warps by 16-row block and
 *  column range: warp w has rows 16*(w % (BRQ/16)) .. +15 and HD/(NWARPS/(BRQ/16)) columns.
 *
 * Workspace (attention_backward_ordered_workspace_bytes), 256-byte aligned regions:
 *    D            B*H*T fp32                                   (pass 1; same place as the C API's)
 *    dQ accum.    B*H*T*HD fp32, rows (b, h, t) of HD           (never zeroed: kv tile 0 stores)
 *    counters     B*H*ceil(T/BRQ) u32, then 1 u32 ticket        (cudaMemsetAsync to 0 per call)
 *
 * Grid and tickets. A 1-D grid of n_kv_tiles * KVH * B blocks. CUDA documents no order in which
 * blocks start, so blockIdx is not used: the first thing a block does is take a ticket
 * t = atomicAdd(ticket, 1) (an integer atomic, once per block), and the ticket decides its work:
 * kv tile j = t / (KVH*B), column c = t % (KVH*B), kv head c % KVH, batch c / KVH. Tickets are
 * handed out in the order blocks actually run, and the kv tile 0 blocks (the most work) go first.
 *
 * Turn order. kv tile j visits query tiles qt >= floor(j*BC/BRQ) (every tile holding a query >=
 * its first key), a bound that grows with j: the kv tiles contributing to query tile qt are a
 * prefix 0..J(qt) of the column, and the turn of kv tile j is simply j (counter value j).
 * Pairs are walked as it = 0, 1, ...: query tile n_qt-1 - it/group, head kvh*group + it%group.
 * This index of a (query tile, head) is the same in every block of the column, whatever its j,
 * so the blocks of a column meet each counter in the same step of their own loops and, once
 * started, move in lockstep: block j about one pair behind block j-1, which releases pair i when
 * it reaches the critical section of pair i+1 (deferred release, below). The waits are a start-up
 * cost of about j pairs for the blocks that start together. (With the dK/dV kernel's order, head
 * outer and query tiles upwards from the diagonal, block j would reach each (tile, head h)
 * (h+1)*BC/BRQ pairs before block j-1 does, and wait for it at every head.)
 *
 * Progress (no deadlock, whatever the number of resident blocks, even one at a time):
 *  1. A block only ever waits for block j-1 of its own column (the previous turn), whose ticket
 *     is smaller by KVH*B: that block took its ticket first, so it has started, i.e. it is
 *     resident or finished.
 *  2. A block never waits while holding a turn: the release of pair it-1 (deferred, below) is
 *     issued by thread 0 before it spins for pair it, and the last release follows the loop.
 *  3. Induction on tickets: the started, unfinished block with the smallest ticket waits only for
 *     finished blocks; a finished block j-1 has taken and released its turn on every counter
 *     that block j uses (prefix property above), leaving the counter at j, and nobody else
 *     writes it before block j does; so every wait of that block ends and it finishes. Its
 *     multiprocessor slot frees up, the hardware starts the next block, which takes the next
 *     ticket, and so on until the grid is done.
 *  Another kernel sharing the GPU cannot break this (it only delays), and blocks of different
 *  columns never wait on each other (their counters are disjoint). A watchdog turns a wait longer
 *  than ATTN_ORD_WATCHDOG_NS into a printf and __trap (a CUDA error, not a hung lab).
 *
 * Memory ordering (why block j's read of a dQ tile sees block j-1's write of it):
 *    block j-1, every thread T:  st.cg W(acc) ; ... ; fence.sc.gpu (__threadfence) ; bar.sync
 *    block j-1, thread 0:        bar.sync ; st.release.gpu counter = j
 *    block j,   thread 0:        ld.acquire.gpu counter == j (spin) ; bar.sync
 *    block j,   every thread U:  bar.sync ; ld.cg R(acc) ; add ; st.cg W'(acc)
 *  - PTX memory model (ISA, "Memory synchronization"): a bar{.cta}.sync synchronizes with the
 *    bar{.cta}.sync of the other threads on the same barrier (release/acquire at CTA scope), and
 *    st.release.gpu read by ld.acquire.gpu (both strong, gpu scope, same GPU: morally strong)
 *    synchronizes-with. Base causality order is transitive over program order and these
 *    synchronizes-with edges: W -> bar(j-1) -> release -> acquire -> bar(j) -> R, so R cannot read
 *    a value older than W (causality axiom), for every thread pair (T, U). W' of block j likewise
 *    follows R of block j-1 (R -> ... -> release of j-1 -> ... -> W'): no write-after-read race.
 *  - The model needs neither the per-thread fence nor the .cg hints; they are kept so that the
 *    argument also holds at the hardware level without relying on fence cumulativity through
 *    bar.sync: each thread's fence.sc.gpu waits until its own stores are performed at gpu scope
 *    (L2, the device's point of coherence) before the barrier, and .cg accesses are served by L2,
 *    never by a possibly stale L1 line of this SM (ld.acquire.gpu also invalidates L1).
 *  - The release is deferred by one pair: the stores of pair it-1 are fenced and released just
 *    before the acquire of pair it, a whole pair of products later, so the fence finds them long
 *    performed and costs little. Ordering is unchanged (fence, bar.sync, release, in that order).
 *  - Stream order: D (pass 1) and the counter memset complete before pass 2 starts, pass 2 before
 *    pass 3 (kernel boundaries on one stream). Rows past T are never read nor written.
 *  - Compiler: the spin and the release are asm volatile with a "memory" clobber, and the
 *    accumulator accesses sit between __syncthreads(), which the compiler does not move memory
 *    accesses across.
 *
 * Cost model (to check on the GPU): per pair, one read and one write of a BRQ x HD fp32 tile
 * (32 KB each at HD=128, BRQ=64) besides the 32 KB of Q and dO tiles, and a critical section of
 * about two L2 round trips (acquire, then the loads) in which this block, alone on its SM, does
 * no math. Only 1 block fits an SM (dK and dV of HD=128 fill the registers), so that latency is
 * not hidden by another block; see the checklist in dev/cuda/attention.cu for what to try next.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <algorithm>

#define ATTN_ORD_ALIGN 256                    // bytes: alignment of each workspace region
#define ATTN_ORD_BACKOFF_MIN_NS 32            // first __nanosleep of a spin
#define ATTN_ORD_BACKOFF_MAX_NS 512           // backoff cap: adds at most this to a wait
#define ATTN_ORD_WATCHDOG_NS 10000000000ull   // 10 s: a wait this long is a bug (deadlock)
#define ATTN_ORD_CONVERT_THREADS 256

// ----------------------------------------------------------------------------
// device helpers: ordering primitives, A operand from a transposed tile

__device__ __forceinline__ unsigned ld_acquire_gpu_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu_u32(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// Cold path of the watchdog, out of line so the spin loop carries no call (no register saves).
__device__ __noinline__ void ordered_watchdog_fail(const unsigned* counter, unsigned turn,
                                                   unsigned seen) {
    printf("attention ordered backward: block %d waited > %llu ns for turn %u of counter %p (it "
           "holds %u): deadlock or a lost release\n",
           (int)blockIdx.x, (unsigned long long)ATTN_ORD_WATCHDOG_NS, turn, counter, seen);
    __trap();
}

// Spin (one thread) until *counter == turn; acquire semantics on the read that succeeds.
__device__ __forceinline__ void ordered_wait_turn(const unsigned* counter, unsigned turn) {
    unsigned seen = ld_acquire_gpu_u32(counter);
    if (seen == turn) return;  // the common case in steady state: no timer, no sleep
    unsigned ns = ATTN_ORD_BACKOFF_MIN_NS;
    const uint64_t start = globaltimer_ns();
    do {
        __nanosleep(ns);
        ns = min(2 * ns, (unsigned)ATTN_ORD_BACKOFF_MAX_NS);
        if (globaltimer_ns() - start > ATTN_ORD_WATCHDOG_NS)
            ordered_watchdog_fail(counter, turn, seen);
        seen = ld_acquire_gpu_u32(counter);
    } while (seen != turn);
}

// A operand (16 rows m0.., 16 k from k0) of mma m16n8k16 when the tile is stored transposed,
// [k][m] row-major with leading dimension LD (dS^T stored keys x queries, read as dS).
// frag_b_trans_addr<LD>(tile, k0, m0) has lane l address row k0 + (l&7) + 8*((l>>3)&1), column
// m0 + 8*(l>>4), so the x4 .trans load yields the 8x8 blocks (k+0, m+0), (k+8, m+0), (k+0, m+8),
// (k+8, m+8), each transposed: thread t gets (m = t/4, k = 2*(t%4), +1) of the block, which is
// the A layout. The A registers are a0 (m+0, k+0), a1 (m+8, k+0), a2 (m+0, k+8), a3 (m+8, k+8):
// loaded blocks 0, 2, 1, 3.
template <int LD>
__device__ __forceinline__ void ldsm_a_transposed(uint32_t (&a)[4], const bf16* tile, int k0,
                                                  int m0, int lane) {
    uint32_t r[4];
    ldsm_x4_trans(r, frag_b_trans_addr<LD>(tile, k0, m0, lane));
    a[0] = r[0];
    a[1] = r[2];
    a[2] = r[1];
    a[3] = r[3];
}

// ----------------------------------------------------------------------------
// tile shape rules

// The dQ tile (BRQ x HD) is split over the warps: BRQ/16 row blocks times NWARPS/(BRQ/16) column
// ranges of HD/(NWARPS/(BRQ/16)) columns, each a whole number of 16-column ldmatrix loads.
template <int HD, int NWARPS, int BRQ>
constexpr bool ordered_shape_ok() {
    return BRQ % 16 == 0 && NWARPS % (BRQ / 16) == 0 && HD % (NWARPS / (BRQ / 16)) == 0 &&
           (HD / (NWARPS / (BRQ / 16))) % 16 == 0 && HD % 16 == 0;
}

template <int HD, int NWARPS, int BRQ>
constexpr size_t ordered_smem_bytes() {
    constexpr int BC = 16 * NWARPS, LD = HD + ATTN_PAD, LDS = BRQ + ATTN_PAD;
    return (size_t)(2 * BC + 4 * BRQ) * LD * sizeof(bf16) + (size_t)BC * LDS * sizeof(bf16) +
           4 * BRQ * sizeof(float) + sizeof(unsigned);
}

// ----------------------------------------------------------------------------
// pass 2: dK, dV and the ordered dQ accumulation

// acc: (B, H, T, HD) fp32; counters: (B, H, n_qt) u32 then the ticket, all zero at launch.
template <int HD, int NWARPS, int BRQ>
__global__ void __launch_bounds__(NWARPS * 32)
    attention_backward_ordered_kernel(bf16* dqkv, float* acc, unsigned* counters,
                                      const bf16* dout, const bf16* qkv, const float* lse,
                                      const float* D, int B, int T, int H, int KVH,
                                      float scale_log2, float scale) {
    static_assert(ordered_shape_ok<HD, NWARPS, BRQ>(), "dQ tile does not split over the warps");
    constexpr int BC = 16 * NWARPS;
    constexpr int LD = HD + ATTN_PAD;
    constexpr int LDS = BRQ + ATTN_PAD;  // dS^T rows (BRQ queries), padded like the other tiles
    constexpr int NT = NWARPS * 32;
    constexpr int NB = HD / 8;
    constexpr int QRB = BRQ / 16;             // 16-row blocks of the dQ tile
    constexpr int COL_PARTS = NWARPS / QRB;   // column ranges of the dQ tile
    constexpr int DQ_COLS = HD / COL_PARTS;   // columns per warp
    constexpr int DQ_NB = DQ_COLS / 8;        // their n-blocks
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16* sK = reinterpret_cast<bf16*>(attention_smem);        // (BC, LD)
    bf16* sV = sK + BC * LD;                                    // (BC, LD)
    bf16* sQ = sV + BC * LD;                                    // (2, BRQ, LD)
    bf16* sdO = sQ + 2 * BRQ * LD;                              // (2, BRQ, LD)
    bf16* sdSt = sdO + 2 * BRQ * LD;                            // (BC, LDS) dS^T, keys x queries
    float* sL = reinterpret_cast<float*>(sdSt + BC * LDS);      // (2, BRQ) lse * log2(e)
    float* sD = sL + 2 * BRQ;                                   // (2, BRQ)
    unsigned* s_ticket = reinterpret_cast<unsigned*>(sD + 2 * BRQ);  // this block's ticket

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    unsigned* ticket = counters + (int64_t)B * H * ((T + BRQ - 1) / BRQ);
    if (tid == 0) *s_ticket = atomicAdd(ticket, 1u);
    __syncthreads();
    const unsigned my_ticket = *s_ticket;
    const int n_cols = KVH * B;  // columns (kv head, batch); the host checked it fits an int
    const int j = (int)(my_ticket / (unsigned)n_cols);
    const int col = (int)(my_ticket % (unsigned)n_cols);
    const int kvh = col % KVH, b = col / KVH;

    const int k0 = j * BC;
    const int group = H / KVH;
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;  // row stride of out / dout
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* dseq = dout + (int64_t)b * T * OS;
    const int n_qt = (T + BRQ - 1) / BRQ;  // query tiles per head
    const int qt0 = k0 / BRQ;              // first query tile holding a query >= k0
    const int n_iter = group * (n_qt - qt0);

    // Stage the (Q, dO, lse, D) tile of pair `it` into buffer `buf`.
    auto stage = [&](int it, int buf) {
        const int hq = kvh * group + it % group;
        const int q0 = (n_qt - 1 - it / group) * BRQ;
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
    const int wk0 = k0 + wrow;              // first key of this warp
    const int m0 = (warp % QRB) * 16;       // this warp's rows of the dQ tile
    const int c0 = (warp / QRB) * DQ_COLS;  // and its first column
    float dk[NB][4], dv[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[nb][e] = dv[nb][e] = 0.0f;
    unsigned* held = nullptr;  // counter of the previous pair, written but not yet released

    for (int it = 0; it < n_iter; it++) {
        // Tile `it` has landed, every warp is done with tile it-1 (its buffers are refilled now)
        // and with the dS^T of pair it-1 in shared memory (rewritten below).
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < n_iter) stage(it + 1, (it + 1) & 1);
        cp_async_commit();
        const int qt = n_qt - 1 - it / group;
        const int hq = kvh * group + it % group;
        const int q0 = qt * BRQ;
        const int buf = it & 1;
        const bf16* tQ = sQ + buf * BRQ * LD;
        const bf16* tdO = sdO + buf * BRQ * LD;
        const float* tL = sL + buf * BRQ;
        const float* tD = sD + buf * BRQ;
        // Warps 0..n_active-1 have a key <= the tile's last query; the others (diagonal tiles
        // only) have P = dS = 0 and skip their products and their k-step of dQ. q0 >= qt0*BRQ >
        // k0 - BRQ, so the numerator is >= 0 and n_active >= 1.
        const int n_active = min(NWARPS, (q0 + BRQ - 1 - k0) / 16 + 1);

        if (warp < n_active) {
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

            // dS^T (bf16, as in the A operand above) to shared memory, this warp's 16 key rows:
            // element (nb, e) is key wrow + lane/4 + 8*(e/2), query nb*8 + 2*(lane%4) + e%2; the
            // two queries of a pair are adjacent, one 32-bit store. Words of a row: LDS/2 =
            // 4 (mod 32) for BRQ = 64 (36), 20 for 32: the 32 lanes hit 32 banks.
#pragma unroll
            for (int nb = 0; nb < BRQ / 8; nb++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++)
                    *reinterpret_cast<uint32_t*>(sdSt + (wrow + (lane >> 2) + hf * 8) * LDS +
                                                 nb * 8 + (lane & 3) * 2) =
                        pack_bf16(dpt[nb][2 * hf], dpt[nb][2 * hf + 1]);
        }
        __syncthreads();  // dS^T of all active warps is in shared memory

        // dQ_tile += dS K for this warp's rows m0..m0+15 and columns c0..c0+DQ_COLS-1; k-step kk
        // covers keys k0 + 16*kk.., the keys of warp kk, so only the active ones.
        float dq[DQ_NB][4];
#pragma unroll
        for (int nb = 0; nb < DQ_NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) dq[nb][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < NWARPS; kk++) {
            if (kk >= n_active) break;
            uint32_t a[4];
            ldsm_a_transposed<LDS>(a, sdSt, kk * 16, m0, lane);
#pragma unroll
            for (int p = 0; p < DQ_COLS / 16; p++) {
                uint32_t bk[4];
                ldsm_x4_trans(bk, frag_b_trans_addr<LD>(sK, kk * 16, c0 + p * 16, lane));
                mma_16816(dq[2 * p], a, bk[0], bk[1]);
                mma_16816(dq[2 * p + 1], a, bk[2], bk[3]);
            }
        }

        // Ordered accumulation. First release the previous pair (its stores were issued a pair
        // of products ago), then wait for this pair's turn: a turn is never held while waiting.
        unsigned* counter = counters + ((int64_t)b * H + hq) * n_qt + qt;
        if (held) __threadfence();  // this thread's stores of pair it-1 performed at gpu scope
        __syncthreads();            // ... for every thread of the block
        if (tid == 0) {
            if (held) st_release_gpu_u32(held, (unsigned)j + 1);
            ordered_wait_turn(counter, (unsigned)j);
        }
        __syncthreads();  // the turn is ours: kv tiles 0..j-1 have added into this tile

        // Rows q0 + m0 + lane/4 + 8*hf, columns c0 + nb*8 + 2*(lane%4), +1 (the C layout). All
        // loads first, then adds and stores; kv tile 0 starts the sum (the accumulator holds
        // garbage from earlier calls, never zeroed). Rows past T are not in the accumulator.
        float* rows = acc + (((int64_t)b * H + hq) * T + q0 + m0 + (lane >> 2)) * HD + c0 +
                      (lane & 3) * 2;
        float2 old[2][DQ_NB];
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const bool add = j > 0 && q0 + m0 + (lane >> 2) + hf * 8 < T;
#pragma unroll
            for (int nb = 0; nb < DQ_NB; nb++)
                old[hf][nb] = add ? __ldcg(reinterpret_cast<const float2*>(
                                        rows + (int64_t)hf * 8 * HD + nb * 8))
                                  : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            if (q0 + m0 + (lane >> 2) + hf * 8 >= T) continue;
#pragma unroll
            for (int nb = 0; nb < DQ_NB; nb++)
                __stcg(reinterpret_cast<float2*>(rows + (int64_t)hf * 8 * HD + nb * 8),
                       make_float2(old[hf][nb].x + dq[nb][2 * hf],
                                   old[hf][nb].y + dq[nb][2 * hf + 1]));
        }
        held = counter;
    }
    // Release the last pair (n_iter >= 1: every block has at least its diagonal query tile).
    __threadfence();
    __syncthreads();
    if (tid == 0) st_release_gpu_u32(held, (unsigned)j + 1);

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
// pass 3: dQ = scale * accumulator -> bf16, into the q columns of dqkv

// One thread per 4 consecutive elements of a row (b, h, t) of the accumulator: a 16-byte load,
// an 8-byte store into dqkv row b*T + t at column h*HD + c.
template <int HD>
__global__ void __launch_bounds__(ATTN_ORD_CONVERT_THREADS)
    attention_backward_ordered_convert_kernel(bf16* dqkv, const float* acc, int B, int T, int H,
                                              int KVH, float scale) {
    constexpr int QUADS = HD / 4;
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t n = (int64_t)B * H * T * QUADS;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(i % QUADS) * 4;
        const int64_t r = i / QUADS;  // (b*H + h)*T + t
        const int t = (int)(r % T);
        const int64_t bh = r / T;
        const int h = (int)(bh % H);
        const int64_t b = bh / H;
        const float4 v = __ldcs(reinterpret_cast<const float4*>(acc) + i);  // read once
        uint2 packed;
        packed.x = pack_bf16(v.x * scale, v.y * scale);
        packed.y = pack_bf16(v.z * scale, v.w * scale);
        *reinterpret_cast<uint2*>(dqkv + (b * T + t) * QKV + (int64_t)h * HD + c) = packed;
    }
}

// ----------------------------------------------------------------------------
// host side

struct OrderedWorkspace {
    size_t d_off, acc_off, cnt_off, bytes;
    int64_t n_counters;  // (B, H, n_qt), the ticket follows
};

static size_t ordered_align(size_t x) {
    return (x + ATTN_ORD_ALIGN - 1) / ATTN_ORD_ALIGN * ATTN_ORD_ALIGN;
}

static OrderedWorkspace ordered_workspace(int B, int T, int H, int HD, int BRQ) {
    OrderedWorkspace w = {0, 0, 0, 0, 0};
    if (B <= 0 || T <= 0 || H <= 0 || HD <= 0) return w;
    const size_t rows = (size_t)B * (size_t)H * (size_t)T;
    w.n_counters = (int64_t)B * H * ((T + BRQ - 1) / BRQ);
    w.d_off = 0;
    w.acc_off = ordered_align(rows * sizeof(float));
    w.cnt_off = w.acc_off + ordered_align(rows * (size_t)HD * sizeof(float));
    w.bytes = w.cnt_off + (size_t)(w.n_counters + 1) * sizeof(unsigned);
    return w;
}

// Bytes of workspace attention_backward_ordered<NWARPS, BRQ> needs: D (B*H*T*4), the fp32 dQ
// accumulator (B*T*H*HD*4), the counters (B*H*ceil(T/BRQ)*4) and the ticket (4), 256-aligned.
template <int BRQ>
static size_t attention_backward_ordered_workspace_bytes(int B, int T, int H, int KVH, int HD) {
    (void)KVH;
    return ordered_workspace(B, T, H, HD, BRQ).bytes;
}

// Head dims this shape runs: 32, 64, 128 where the dQ tile splits over the warps (16 never).
template <int NWARPS, int BRQ>
static int attention_backward_ordered_supports(int HD) {
    return (HD == 32 && ordered_shape_ok<32, NWARPS, BRQ>()) ||
           (HD == 64 && ordered_shape_ok<64, NWARPS, BRQ>()) ||
           (HD == 128 && ordered_shape_ok<128, NWARPS, BRQ>());
}

// The three passes; marks (optional, 2 events) are recorded after pass 1 and after pass 2 so the
// lab can time the passes apart.
template <int HD, int NWARPS, int BRQ>
static void attention_backward_ordered_run(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                           const bf16* out, const float* lse, unsigned char* ws,
                                           int B, int T, int H, int KVH, cudaStream_t stream,
                                           cudaEvent_t* marks) {
    const char* fn = "attention_backward_ordered";
    constexpr int BC = 16 * NWARPS;
    const float scale = 1.0f / sqrtf((float)HD);
    const float scale_log2 = scale * ATTN_LOG2E;
    const OrderedWorkspace w = ordered_workspace(B, T, H, HD, BRQ);
    float* D = reinterpret_cast<float*>(ws + w.d_off);
    float* acc = reinterpret_cast<float*>(ws + w.acc_off);
    unsigned* counters = reinterpret_cast<unsigned*>(ws + w.cnt_off);

    const int64_t rows = (int64_t)B * T * H;
    const int64_t n_kv_tiles = (T + BC - 1) / BC;
    const int64_t blocks = n_kv_tiles * KVH * B;
    if (blocks > 0x7fffffff) {
        fprintf(stderr, "attention: %s: B*T*H = %lld too large\n", fn, (long long)rows);
        exit(1);
    }
    attention_backward_dot<HD>(D, dout, out, B, T, H, fn, stream);
    attention_check(
        cudaMemsetAsync(counters, 0, (size_t)(w.n_counters + 1) * sizeof(unsigned), stream));
    if (marks) attention_check(cudaEventRecord(marks[0], stream));

    const size_t smem = ordered_smem_bytes<HD, NWARPS, BRQ>();
    auto kernel = attention_backward_ordered_kernel<HD, NWARPS, BRQ>;
    attention_set_max_smem(kernel, smem);
    kernel<<<(unsigned)blocks, NWARPS * 32, smem, stream>>>(dqkv, acc, counters, dout, qkv, lse, D,
                                                            B, T, H, KVH, scale_log2, scale);
    attention_check(cudaGetLastError());
    if (marks) attention_check(cudaEventRecord(marks[1], stream));

    const int64_t quads = rows * (HD / 4);
    const int64_t conv_blocks = std::min<int64_t>((quads + ATTN_ORD_CONVERT_THREADS - 1) /
                                                      ATTN_ORD_CONVERT_THREADS,
                                                  (int64_t)1 << 20);
    attention_backward_ordered_convert_kernel<HD>
        <<<(unsigned)conv_blocks, ATTN_ORD_CONVERT_THREADS, 0, stream>>>(dqkv, acc, B, T, H, KVH,
                                                                         scale);
    attention_check(cudaGetLastError());
}

// Same contract as attention_backward_bf16 (kernels/attention.h), with the workspace of
// attention_backward_ordered_workspace_bytes<BRQ>; the head dims of
// attention_backward_ordered_supports.
template <int NWARPS, int BRQ>
static void attention_backward_ordered_timed(void* dqkv, const void* dout, const void* qkv,
                                             const void* out, const float* lse, void* workspace,
                                             int B, int T, int H, int KVH, int HD, void* stream,
                                             cudaEvent_t* marks) {
    const char* fn = "attention_backward_ordered";
    attention_check_args(fn, B, T, H, KVH, HD);
    attention_check_aligned(fn, "dqkv", dqkv, 16);
    attention_check_aligned(fn, "dout", dout, 16);
    attention_check_aligned(fn, "qkv", qkv, 16);
    attention_check_aligned(fn, "out", out, 16);
    attention_check_aligned(fn, "lse", lse, 4);
    attention_check_aligned(fn, "workspace", workspace, 16);
    if (B == 0 || T == 0) return;
    if ((int64_t)KVH * B > 0x7fffffff || (int64_t)H * B > 0x7fffffff) {
        fprintf(stderr, "attention: %s: B*H = %lld too large\n", fn, (long long)H * B);
        exit(1);
    }
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    unsigned char* ws = static_cast<unsigned char*>(workspace);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (HD) {
        case 32:
            if constexpr (ordered_shape_ok<32, NWARPS, BRQ>()) {
                attention_backward_ordered_run<32, NWARPS, BRQ>(dx, dy, x, y, lse, ws, B, T, H,
                                                                KVH, s, marks);
                return;
            }
            break;
        case 64:
            if constexpr (ordered_shape_ok<64, NWARPS, BRQ>()) {
                attention_backward_ordered_run<64, NWARPS, BRQ>(dx, dy, x, y, lse, ws, B, T, H,
                                                                KVH, s, marks);
                return;
            }
            break;
        case 128:
            if constexpr (ordered_shape_ok<128, NWARPS, BRQ>()) {
                attention_backward_ordered_run<128, NWARPS, BRQ>(dx, dy, x, y, lse, ws, B, T, H,
                                                                 KVH, s, marks);
                return;
            }
            break;
        default: break;
    }
    fprintf(stderr, "attention: %s: head dim %d not supported by this tile shape (%d warps, %d "
            "query rows)\n", fn, HD, NWARPS, BRQ);
    exit(1);
}

// The lab's BackwardFn signature.
template <int NWARPS, int BRQ>
static void attention_backward_ordered(void* dqkv, const void* dout, const void* qkv,
                                       const void* out, const float* lse, void* workspace, int B,
                                       int T, int H, int KVH, int HD, void* stream) {
    attention_backward_ordered_timed<NWARPS, BRQ>(dqkv, dout, qkv, out, lse, workspace, B, T, H,
                                                  KVH, HD, stream, nullptr);
}
