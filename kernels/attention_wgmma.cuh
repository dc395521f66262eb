/*
 * attention_wgmma.cuh — causal grouped-query flash-attention FORWARD on Hopper warpgroup MMAs
 * (wgmma.mma_async, sm_90a only), warp-specialised: what attention_forward_bf16 runs for HD 64
 * and 128 when the device code was built for sm_90a (the Makefile's default GPU_ARCH). Part of
 * kernels/attention.cu, which includes it; the swizzled layouts, descriptors, fragments and wgmma
 * instructions are those of attention_common.cuh (described there), the mbarrier and setmaxnreg
 * wrappers those of ptx.cuh.
 * Same contract as the mma.sync forward: packed qkv rows [q heads | k heads | v heads], query
 * head h reads kv head h / (H/KVH) with no K/V copies, causal (key j visible to query i iff
 * j <= i), bf16 out, lse = natural-log log-sum-exp of the scaled logits per (b, h, t) for the
 * backward, rows past T zero-filled and never stored, 64-bit offsets. HD 64 and 128 only.
 * The ring depth is a template parameter (<K stages, V stages>): the C interface runs 3+3 below
 * 32768 tokens and 2+2 from there on; both compute the same bits (same tiles, same arithmetic).
 *
 * ---------------------------------------------------------------------------------------------
 * Work decomposition
 *   One CTA of 384 threads = 3 warpgroups per (query tile of BR = 128 rows, query head, batch);
 *   grid x = h + H*b, y = query tile counted from the last (longest rows first), as in
 *   kernels/attention.cu. Warpgroups 0 and 1 are CONSUMERS: warpgroup w owns query rows
 *   [q0 + 64w, q0 + 64w + 64) of every product (the wgmma M dimension is 64; inside a warpgroup
 *   warp v = warp % 4 holds rows 16v..16v+15 of each accumulator, so no reduction ever crosses
 *   warps). Warpgroup 2 is the PRODUCER: it copies Q and the K/V tiles (BC = 128 keys) into
 *   shared-memory rings with cp.async and publishes each through an mbarrier; the consumers
 *   never meet at a CTA-wide barrier in the loop, only wait for their data and their turn.
 *   Registers: the register file is split across the SM's 4 sub-partitions and warp w runs on
 *   sub-partition w % 4; the launch gets 65536 / 384 = 168 registers per thread, then the
 *   producer hands registers back (setmaxnreg.dec 24) and the consumers take them
 *   (setmaxnreg.inc 240): per sub-partition 2 x 240 + 24 = 504 <= 512 per lane, the CTA's pool
 *   (12 warps x 168 = 8 x 240 + 4 x 24). ptxas compiles each branch for its budget (consumers
 *   ~184 registers at HD=128, producer < 24; no spills).
 *
 * Producer: Q, K_0, then for t = 0 .. n_tiles-1: K_{t+1} (if any), V_t. Tile u goes to stage
 *   s = u % S of its ring (S = SK or SV stages); for u >= S it first waits for completion
 *   u/S - 1 of empty[s] (try_wait.parity, parity ((u/S) & 1) ^ 1): both consumer warpgroups
 *   have retired every wgmma that read tile u - S. Publication: each producer thread's
 *   cp.async.mbarrier.arrive.noinc on full[s] (128 expected arrivals) after its copies of the
 *   tile: the hardware arrives once every cp.async the thread issued so far has landed. The
 *   producer exits after commit + wait_group 0 (no copy left in flight behind it).
 *
 * Consumer warpgroup w, per kv tile; the P V product lags one tile behind so that the tensor
 * cores have work while the softmax runs (S_j = Q K_j^T: SS wgmma, Q and K from shared memory;
 * P V: RS wgmma, P from registers, V from shared memory):
 *   tile 0:  wait full_q, full_k[0]; fence; [turn]; issue S_0; [pass the turn]; wait_group 0;
 *            release K_0; softmax(S_0)
 *   step j = 1 .. n_tiles-1:
 *            wait_group 0            P_{j-2} V_{j-2} retired -> release V_{j-2} (j >= 2)
 *            p = bf16(P_{j-1}); O *= alpha_{j-1}     (s still holds P_{j-1} in fp32)
 *            wait full_k[j % SK], full_v[(j-1) % SV] (parities (j/SK)&1, ((j-1)/SV)&1)
 *            fence.proxy.async; [turn]
 *            issue S_j; issue O += P_{j-1} V_{j-1}; [pass the turn]
 *            wait_group 1            S_j retired -> release K_j
 *            mask (diagonal tiles only); online softmax in base 2 -> s = P_j (fp32), alpha_j
 *   tail:    wait_group 0 -> release V_{n-2}; convert, rescale; wait full_v[(n-1) % SV]; fence;
 *            [turn]; issue P_{n-1} V_{n-1}; [pass]; wait_group 0; warpgroup 0 consumes
 *            warpgroup 1's last turn arrival; epilogue (O / l, lse)
 *   Invariant: at the top of step j, O holds tiles <= j-2 at the scale of the running maximum
 *   m_{j-2}; alpha_{j-1} = 2^(m_{j-2} - m_{j-1}) brings it to m_{j-1} just before P_{j-1} V_{j-1}
 *   (at m_{j-1}) is added. A release is one mbarrier.arrive (release) per warp by lane 0 after
 *   the warp's wait_group: empty barriers expect 8 arrivals (every warp's slice of a wgmma reads
 *   all of B, K or V). Why the retiring wait_group 0 sits at the top of the next step and not
 *   after the softmax: ptxas schedules a WARPGROUP.DEPBAR as early as its basic block allows,
 *   whatever the PTX order, which would serialise it with the softmax; the back edge keeps it
 *   after. All wgmma issues and waits are on straight-line, CTA-uniform code (ptxas serialises
 *   wgmmas it cannot follow through branches: C7514/C7518/C7520 in the build log): both
 *   warpgroups walk all n_tiles tiles of the CTA (tiles holding keys <= its last row); a
 *   warpgroup whose rows are all past T computes rows nobody stores (Q rows zero: finite).
 *
 * Ping-pong (FA3's scheme): named barriers 1 and 2 over the 256 consumer threads ("turns").
 *   Warpgroup w syncs on 1 + w before each issue phase and arrives on 2 - w after it; warpgroup
 *   1 arrives on 1 once up front, so warpgroup 0 issues first; both run n_tiles + 1 issue phases
 *   and warpgroup 0 syncs once more after the loop: nothing is left half-complete. Steady state:
 *   while one warpgroup's products run on the tensor cores, the other does its softmax (alone
 *   on the MUFU) and queues its next products behind them.
 *
 * Deadlock freedom (checked at random by dev/cuda/attention_fwd_ws_model.py: producer and
 * consumers as program order, landings and completions at random moments, exact mbarrier
 * parity semantics): the producer's loads are in the fixed order K_0, K_1, V_0, K_2, V_1, ...;
 * the release a load waits for (K_u: S_{u-SK} retired; V_u: P_{u-SV} V_{u-SV} retired) needs
 * only tiles loaded EARLIER in that order (for SK, SV >= 2), in both warpgroups; the turns only
 * order issue phases whose data both warpgroups wait for identically. Phases cannot alias: a
 * full barrier's next phase needs the producer past the empty barrier that the consumers of
 * the current phase release, and conversely.
 *
 * Cross-proxy visibility: cp.async writes shared memory through the generic proxy, wgmma reads
 * it through the async proxy. As CUTLASS's cp.async GMMA mainloops, the consumer acquires the
 * full barrier (completed by cp.async.mbarrier.arrive) and then, as a margin, executes
 * fence.proxy.async before the wgmma. The reverse order (async-proxy reads, then a stage
 * refilled by generic writes): a wgmma's completion observed by wait_group "is followed by an
 * implicit generic-async proxy fence" (PTX ISA), and the release/acquire chain of the empty
 * barrier orders it before the new copies.
 *
 * ---------------------------------------------------------------------------------------------
 * Operands (the general SS / RS forms in attention_common.cuh):
 *   S = Q K^T, m64nBCk16, HD/16 k-steps over hd (wgmma_group_ss): A = the warpgroup's 64 rows
 *     of Q (start sQ + w*64*128, RA = BR), B = the K stage (N = BC keys).
 *   O += P V, m64nHDk16, BC/16 k-steps over keys (wgmma_group_rs): A = P from registers
 *     (acc_to_frags of S: the accumulator layout is the A layout), B = the V stage, MN-major,
 *     LBO = BC*128 (the second 64-column panel; read only at HD = 128), SBO = 1024.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef KERNELS_ATTENTION_WGMMA_CUH
#define KERNELS_ATTENTION_WGMMA_CUH

#include "attention_common.cuh"

// ----------------------------------------------------------------------------
// forward kernel: shape of a CTA

#define ATTN_WGF_NWG 2                                      // consumer warpgroups per CTA
#define ATTN_WGF_BC 128                                     // keys per K/V tile
#define ATTN_WGF_CONSUMERS (ATTN_WGF_NWG * ATTN_WG_THREADS) // 256 consumer threads
#define ATTN_WGF_PRODUCERS ATTN_WG_THREADS                  // warpgroup 2: the producer
#define ATTN_WGF_THREADS (ATTN_WGF_CONSUMERS + ATTN_WGF_PRODUCERS)  // 384 threads per CTA
#define ATTN_WGF_MBAR_BYTES 128                             // room for the mbarriers (<= 16)
// Registers per thread after setmaxnreg: per SM sub-partition (16384 registers, one warp of each
// warpgroup) 2 * 240 + 24 = 504 <= 512 registers per lane. The launch itself gets
// 65536 / 384 = 168 (what ptxas reports as "Used 168 registers").
#define ATTN_WGF_CONSUMER_REGS 240
#define ATTN_WGF_PRODUCER_REGS 24

// ----------------------------------------------------------------------------
// device helpers (sm_90a): named barriers (mbarriers, setmaxnreg: ptx.cuh)

// Named barriers of the two consumer warpgroups (256 threads; id 0 is __syncthreads).
__device__ __forceinline__ void named_bar_sync(uint32_t id) {
#if ATTN_WG_ENABLED
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(ATTN_WGF_CONSUMERS) : "memory");
#endif
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id) {
#if ATTN_WG_ENABLED
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(ATTN_WGF_CONSUMERS) : "memory");
#endif
}

// ----------------------------------------------------------------------------
// forward kernel

template <int HD, int SK, int SV>
constexpr size_t attention_wgmma_smem_bytes() {
    return (size_t)(ATTN_WG_ROWS * ATTN_WGF_NWG + (SK + SV) * ATTN_WGF_BC) * HD * sizeof(bf16) +
           ATTN_SW128_ATOM_BYTES + ATTN_WGF_MBAR_BYTES;
}

// SW (attention_common.cuh): sinks (H) or NULL, window normalised to [1, T]. The CTA walks the
// kv tiles from the first one its first row's window reaches (tile j_first) to its diagonal;
// the rings count tiles from j_first (u = tile - j_first), so the protocol below is unchanged.
template <int HD, int SK, int SV, bool SW = false>
__global__ void __launch_bounds__(ATTN_WGF_THREADS, 1)
    attention_forward_wgmma_kernel(bf16* out, float* lse, const bf16* qkv, int T, int H, int KVH,
                                   float scale_log2, const bf16* sinks, int window) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(SK >= 2 && SV >= 2, "ring stages (see the deadlock argument in the header)");
    static_assert(1 + 2 * SK + 2 * SV <= ATTN_WGF_MBAR_BYTES / 8, "mbarrier room");
#if ATTN_WG_ENABLED
    constexpr int BC = ATTN_WGF_BC;
    constexpr int BR = ATTN_WG_ROWS * ATTN_WGF_NWG;  // 128 query rows per CTA
    constexpr int NB_S = BC / 8;                     // 8-column blocks of the S accumulator
    constexpr int NB_O = HD / 8;                     // of the O accumulator
    constexpr int KS_S = HD / ATTN_WG_K;             // k-steps of S = Q K^T
    constexpr int KS_O = BC / ATTN_WG_K;             // k-steps of O += P V
    constexpr uint32_t Q_BYTES = BR * HD * sizeof(bf16);
    constexpr uint32_t KV_BYTES = BC * HD * sizeof(bf16);     // one stage of K or of V
    constexpr uint32_t KV_PANEL = BC * ATTN_SW128_ROW_BYTES;  // 64 hd columns of a K/V stage
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = ATTN_SW128_KMAJOR_LBO;
    static_assert(Q_BYTES % ATOM == 0 && KV_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_fwd_smem[];
    const uint32_t sbase = (smem_u32(attn_fwd_smem) + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sQ = sbase;                          // (BR, HD) SW128
    const uint32_t sK = sQ + Q_BYTES;                   // SK stages of (BC, HD) SW128
    const uint32_t sV = sK + SK * KV_BYTES;             // SV stages of (BC, HD) SW128
    const uint32_t bar_q = sV + SV * KV_BYTES;          // mbarriers, 8 bytes each
    const uint32_t bar_full_k = bar_q + 8;              // [SK]  K stage landed (128 arrivals)
    const uint32_t bar_empty_k = bar_full_k + 8 * SK;   // [SK]  K stage released (8 warps)
    const uint32_t bar_full_v = bar_empty_k + 8 * SK;   // [SV]
    const uint32_t bar_empty_v = bar_full_v + 8 * SV;   // [SV]

    const int tid = threadIdx.x, lane = tid & 31;
    // the warp index through a shuffle from lane 0: a warp-uniform value the compiler can see
    // as such (the producer/consumer branch below must not look divergent around the wgmmas)
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const int wg = warp >> 2;  // 0, 1: consumers; 2: producer
    const int h = blockIdx.x % H, b = blockIdx.x / H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;  // longest rows first
    const int kvh = h / (H / KVH);
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gQ = seq + (int64_t)h * HD;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    // kv tiles holding keys <= the CTA's last query (< T) from the first one its first query's
    // window reaches (causal: tile 0); both warpgroups walk all of them (the wgmma control flow
    // stays CTA-uniform: header). Ring index u = tile j_first + u.
    const int j_first = SW ? attn_first_key(q0, window) / BC : 0;
    const int n_tiles = (min(q0 + BR, T) - 1) / BC + 1 - j_first;

    if (tid == 0) {
        // full barriers: one arrival per producer thread (its cp.async.mbarrier.arrive.noinc)
        mbar_init(bar_q, ATTN_WGF_PRODUCERS);
        for (int s = 0; s < SK; s++) {
            mbar_init(bar_full_k + 8 * s, ATTN_WGF_PRODUCERS);        // producer threads
            mbar_init(bar_empty_k + 8 * s, ATTN_WGF_CONSUMERS / 32);  // consumer warps
        }
        for (int s = 0; s < SV; s++) {
            mbar_init(bar_full_v + 8 * s, ATTN_WGF_PRODUCERS);
            mbar_init(bar_empty_v + 8 * s, ATTN_WGF_CONSUMERS / 32);
        }
        mbar_init_fence();
    }
    __syncthreads();  // the only CTA-wide barrier

    if (wg == ATTN_WGF_NWG) {
        // ---------------- producer warpgroup: Q, K_0, then K_{t+1}, V_t, t = 0 .. n_tiles-1 ----
        // Loading tile u into stage u % S waits until both warpgroups released tile u - S of
        // that stage (completion u/S - 1 of its empty barrier: parity ((u/S) & 1) ^ 1); the
        // first S tiles of a ring need no wait. Each lane's cp.async.mbarrier.arrive.noinc
        // arrives on the stage's full barrier once all its copies so far have landed. The
        // copies are sw128_tile_load_async over the 128 producer threads.
        setmaxnreg_dec<ATTN_WGF_PRODUCER_REGS>();
        const int ptid = tid - ATTN_WGF_CONSUMERS;
        sw128_tile_load_async<BR, HD, ATTN_WGF_PRODUCERS>(sQ, gQ, QKV, q0, T, ptid);
        cp_async_mbar_arrive(bar_q);
        auto load_k = [&](int u) {
            const int s = u % SK;
            if (u >= SK) mbar_wait(bar_empty_k + 8 * s, ((u / SK) & 1) ^ 1);
            sw128_tile_load_async<BC, HD, ATTN_WGF_PRODUCERS>(sK + s * KV_BYTES, gK, QKV,
                                                              (j_first + u) * BC, T, ptid);
            cp_async_mbar_arrive(bar_full_k + 8 * s);
        };
        auto load_v = [&](int u) {
            const int s = u % SV;
            if (u >= SV) mbar_wait(bar_empty_v + 8 * s, ((u / SV) & 1) ^ 1);
            sw128_tile_load_async<BC, HD, ATTN_WGF_PRODUCERS>(sV + s * KV_BYTES, gV, QKV,
                                                              (j_first + u) * BC, T, ptid);
            cp_async_mbar_arrive(bar_full_v + 8 * s);
        };
        load_k(0);
        for (int t = 0; t < n_tiles; t++) {
            if (t + 1 < n_tiles) load_k(t + 1);
            load_v(t);
        }
        cp_async_commit();    // (the copies are in no group yet: wait_group sees groups)
        cp_async_wait_all();  // every copy landed: leave none in flight behind an exited warp
        return;
    }

    // ---------------- consumer warpgroups ----------------------------------------------------
    setmaxnreg_inc<ATTN_WGF_CONSUMER_REGS>();
    const int wv = warp & 3;  // warp inside the warpgroup: rows 16wv..16wv+15
    const int wq0 = q0 + wg * ATTN_WG_ROWS;
    const int my_row = wq0 + wv * 16 + (lane >> 2);  // rows my_row (e = 0, 1) and my_row + 8
    const bool releaser = lane == 0;                 // one arrival per warp on empty barriers

    const uint64_t desc_q =
        wg_desc(sQ + wg * ATTN_WG_ROWS * ATTN_SW128_ROW_BYTES, KMAJOR_LBO, ATOM);
    const uint64_t desc_k = wg_desc(sK, KMAJOR_LBO, ATOM);
    const uint64_t desc_v = wg_desc(sV, KV_PANEL, ATOM);

    float o[NB_O][4], s[NB_S][4];
    uint32_t p[KS_O][4];  // P as bf16 A fragments, one [4] per k-step of P V
    acc_zero(o);
    acc_zero(s);
    frag_zero(p);
    float row_max[2], row_sum[2];
    softmax_start<SW>(row_max, row_sum, sinks, h, lane);

    // Ping-pong: named barrier 1 + w = "warpgroup w may issue". Warpgroup w syncs on it
    // before each issue phase and arrives on 2 - w after; warpgroup 1 arrives on barrier 1 once
    // up front, so warpgroup 0 issues first; after the last phase warpgroup 0 consumes warpgroup
    // 1's last arrival (no barrier is left half-complete).
    const uint32_t my_turn = 1 + wg, other_turn = 2 - wg;
    if (wg == 1) named_bar_arrive(1);

    // the steps (header), with the rings' stage indices
    auto issue_s = [&](int j) {
        wgmma_group_ss<BC, KS_S, BR>(s, desc_q, wg_desc_add(desc_k, (j % SK) * KV_BYTES));
    };
    auto issue_pv = [&](int j) {
        wgmma_group_rs<HD, KS_O>(o, p, wg_desc_add(desc_v, (j % SV) * KV_BYTES));
    };
    // mask (tiles that cross the diagonal, SW: or the window's left edge of some row of the CTA:
    // CTA-uniform), online softmax: s = P_j in fp32
    auto softmax = [&](int j, float (&alpha)[2]) -> bool {
        const int k0 = (j_first + j) * BC;
        if constexpr (SW) {
            if (k0 + BC - 1 > q0 || k0 <= q0 + BR - 1 - window)
                mask_causal_window(s, my_row, k0, lane, window);
        } else if (k0 + BC - 1 > q0) {
            mask_causal(s, my_row, k0, lane);
        }
        bool max_moved = false;
        softmax_online(s, row_max, row_sum, alpha, scale_log2, max_moved);
        return max_moved;
    };
    auto convert_p = [&]() { acc_to_frags(p, s); };
    auto rescale_o = [&](const float (&alpha)[2], bool moved) {
        if (__any_sync(0xffffffffu, moved)) rescale_rows(o, alpha);
    };
    // Tile u of a ring has landed: its full barrier completed for the (u / S)-th time.
    auto wait_k = [&](int u) { mbar_wait(bar_full_k + 8 * (u % SK), (u / SK) & 1); };
    auto wait_v = [&](int u) { mbar_wait(bar_full_v + 8 * (u % SV), (u / SV) & 1); };

    // Schedule per warpgroup (header): step j = 1 .. n_tiles-1
    //   wait_group 0 (P_{j-2} V_{j-2} retired) -> release V_{j-2}; p = bf16(P_{j-1}); O *= alpha
    //   wait full K_j, full V_{j-1}; fence.proxy.async; [my turn]
    //   issue S_j; issue O += P_{j-1} V_{j-1}  [other's turn]
    //   wait_group 1 (S_j done) -> release K_j; softmax(S_j)
    float alpha[2];
    bool moved;
    // tile 0: S only
    mbar_wait(bar_q, 0);
    wait_k(0);
    fence_proxy_async_shared();
    wg_fence_acc(s);
    named_bar_sync(my_turn);
    wgmma_fence();
    issue_s(0);
    named_bar_arrive(other_turn);
    wgmma_wait<0>();
    wg_fence_acc(s);
    mbar_arrive_if(bar_empty_k + 8 * (0 % SK), releaser);
    moved = softmax(0, alpha);
    for (int j = 1; j < n_tiles; j++) {
        wgmma_wait<0>();  // P_{j-2} V_{j-2} retired (nothing in flight at j = 1)
        wg_fence_acc(o);
        wg_fence_frag(p);
        mbar_arrive_if(bar_empty_v + 8 * ((j + SV - 2) % SV), releaser && j >= 2);
        convert_p();
        rescale_o(alpha, moved);
        wait_k(j);
        wait_v(j - 1);
        fence_proxy_async_shared();
        wg_fence_acc(s);
        wg_fence_acc(o);
        wg_fence_frag(p);
        named_bar_sync(my_turn);
        wgmma_fence();
        issue_s(j);
        issue_pv(j - 1);
        named_bar_arrive(other_turn);
        wgmma_wait<1>();  // S_j done; the P V group may still run
        wg_fence_acc(s);
        mbar_arrive_if(bar_empty_k + 8 * (j % SK), releaser);
        moved = softmax(j, alpha);
    }
    // the last tile's P V
    wgmma_wait<0>();
    wg_fence_acc(o);
    wg_fence_frag(p);
    mbar_arrive_if(bar_empty_v + 8 * ((n_tiles + SV - 2) % SV), releaser && n_tiles >= 2);
    convert_p();
    rescale_o(alpha, moved);
    wait_v(n_tiles - 1);
    fence_proxy_async_shared();
    wg_fence_acc(o);
    wg_fence_frag(p);
    named_bar_sync(my_turn);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    named_bar_arrive(other_turn);
    wgmma_wait<0>();
    wg_fence_acc(o);
    if (wg == 0) named_bar_sync(1);  // warpgroup 1's last arrival

    store_out_lse(out, lse, o, row_max, row_sum, b, h, my_row, T, H, lane);
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

// ----------------------------------------------------------------------------
// host side

// SW: sinks and window (normalised) as the kernel takes them; without SW unused.
template <int HD, int SK, int SV, bool SW = false>
static void attention_forward_wgmma_run(bf16* out, float* lse, const bf16* qkv, int B, int T,
                                        int H, int KVH, cudaStream_t stream,
                                        const bf16* sinks = nullptr, int window = 0) {
    constexpr int BR = ATTN_WG_ROWS * ATTN_WGF_NWG;
    const size_t smem = attention_wgmma_smem_bytes<HD, SK, SV>();
    auto kernel = attention_forward_wgmma_kernel<HD, SK, SV, SW>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), ATTN_WGF_THREADS, smem, stream>>>(
        out, lse, qkv, T, H, KVH, attention_scale_log2(HD), sinks, window);
    attention_check(cudaGetLastError());
}

// Dispatch on HD (64 or 128) once the arguments are checked (attention_forward_check) and the
// device code is known to be there (attention_wgmma_available). <K ring stages, V ring stages>.
template <int SK, int SV, bool SW = false>
static void attention_forward_wgmma_hd(bf16* out, float* lse, const bf16* qkv, int B, int T,
                                       int H, int KVH, int HD, cudaStream_t stream,
                                       const bf16* sinks = nullptr, int window = 0) {
    if (HD == 64)
        attention_forward_wgmma_run<64, SK, SV, SW>(out, lse, qkv, B, T, H, KVH, stream, sinks,
                                                    window);
    else
        attention_forward_wgmma_run<128, SK, SV, SW>(out, lse, qkv, B, T, H, KVH, stream, sinks,
                                                     window);
}

#endif  // KERNELS_ATTENTION_WGMMA_CUH
