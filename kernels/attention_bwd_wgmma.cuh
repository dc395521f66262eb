/*
 * attention_bwd_wgmma.cuh — causal grouped-query flash-attention BACKWARD on Hopper warpgroup
 * MMAs (wgmma.mma_async, sm_90a only), deterministic (no float atomics): what
 * attention_backward_bf16 runs at HD 64 and 128 when the device has sm_90a code. Part of
 * kernels/attention.cu, which includes it after its pass 1 (attention_backward_dot); the
 * layouts, descriptors, fragments and wgmma instructions are those of attention_common.cuh, the
 * ones the wgmma forward uses. Same contract as attention_backward_bf16 (kernels/attention.h),
 * same workspace (D, B*H*T fp32). The warpgroups per CTA and the ring slots of each pass are
 * template parameters: the C interface runs 2 warpgroups and 3 slots in both passes.
 *
 * Scheme (the production backward of kernels/attention.cu with every matmul on wgmma)
 *   pass 1  D = rowsum(dO * O) per (b, h, t): attention_backward_dot_kernel (kernels/attention.cu).
 *   pass 2  dK, dV: one CTA per (kv tile of BN = 64*NWG keys, kv head, batch); warpgroup w owns
 *           keys k0 + 64w .. +63 (the wgmma M dimension), their dK and dV in registers. The CTA
 *           walks the query heads of its group (outer) and the query tiles of BQ = 64 rows from
 *           the one holding key k0 to the last (inner): it = head_index * per_head + tile_index,
 *           a fixed order, so dK/dV of a kv head sum over its query heads deterministically (as
 *           production). Per (query tile, head), keys as rows, so P^T and dS^T come out of the
 *           accumulators already as the register A operand of the next product:
 *              S^T  = K_w Q^T                       (SS)
 *              P^T  = 2^(S^T * scale*log2e - lse*log2e), 0 where key > query or query >= T
 *              dV_w += P^T dO                       (RS)
 *              dP^T = V_w dO^T                      (SS)
 *              dS^T = P^T * (dP^T - D)              (D per query = per column)
 *              dK_w += dS^T Q                       (RS)
 *           Written at the end: dK * scale, dV (bf16), rows of keys < T.
 *   pass 3  dQ: one CTA per (query tile of BR = 64*NWG rows, head, batch), warpgroup w owns rows
 *           q0 + 64w .. +63; walks the kv tiles (BN = 64 keys) holding keys <= the CTA's last
 *           row:  S = Q_w K^T (SS), P = 2^(S*scale*log2e - lse*log2e) masked, dP = dO_w V^T (SS),
 *           dS = P (dP - D), dQ_w += dS K (RS). Written: dQ * scale.
 *   No atomics anywhere; each output element is written by exactly one thread, its sums run in a
 *   fixed order: bit-identical from run to run.
 *
 * ---------------------------------------------------------------------------------------------
 * Operand layouts (notation of attention_common.cuh: SW128 tiles of R rows x HD columns,
 * 64-column panels of R rows x 128 bytes, chunk c of row r at ((c%8) ^ (r%8))*16; descriptors
 * with swizzle mode 1, base offset 0, SBO = 1024 = 8 rows; K-major = the reduction dimension is
 * the contiguous one). All tiles here are stored [row][hd] with hd contiguous, as they are in
 * global memory: K, V tiles (BN rows, pass 2 resident / pass 3 ring), Q, dO tiles (BQ rows, pass
 * 2 ring / BR rows, pass 3 resident).
 *
 *   SS products, m64nNk16, HD/16 k-steps kk over hd columns 16kk..16kk+15 (exactly the
 *   forward's S = Q K^T):
 *     A = the warpgroup's 64 rows of a [row][hd] tile of R rows, K-major (imm-trans-a 0):
 *         start = tile + sw128_kstep_offset(kk, R) + w*64*128     (w*64*128 = 8 atoms: aligned)
 *         LBO = 16 (unused by swizzled K-major), SBO = 1024.
 *     B = a [n][hd] tile of N rows (N = the wgmma N), K-major (imm-trans-b 0):
 *         start = tile + sw128_kstep_offset(kk, N), LBO = 16, SBO = 1024.
 *     pass 2: S^T  A = K (R = BN), B = Q stage (N = BQ);   dP^T  A = V (R = BN), B = dO stage.
 *     pass 3: S    A = Q (R = BR), B = K stage (N = BN);   dP    A = dO (R = BR), B = V stage.
 *     (B[k = hd][n] = tile[n][hd]: the reduction index hd is contiguous: K-major.)
 *
 *   RS products, m64n{HD}k16, reduction over the rows of a [row][hd] tile, k-step kk = rows
 *   16kk..16kk+15 (exactly the forward's O += P V):
 *     A = an fp32 accumulator (64 x 16 columns of it per k-step) converted in registers:
 *         frag[kk] = acc_to_frag_a(acc[2kk], acc[2kk+1])   (accumulator layout = A layout,
 *         no data moves between threads; see the forward's header)
 *     B[k = row][n = hd] = tile[row][hd]: N contiguous, MN-major (imm-trans-b 1):
 *         start = tile + kk * 16*128 (16 rows of 128 bytes, 1024-aligned),
 *         SBO = 1024 (rows 8..15 of the k-step), LBO = R*128 (hd columns 64..127 = the second
 *         panel; read only at HD = 128).
 *     pass 2: dV += P^T dO   A = P^T (keys x queries), B = dO stage (R = BQ, k = query rows)
 *             dK += dS^T Q   A = dS^T,                 B = Q stage  (R = BQ)
 *     pass 3: dQ += dS K     A = dS (queries x keys),  B = K stage  (R = BN, k = key rows)
 *
 *   Accumulator element acc[i][e] of warp v of a warpgroup, lane = 4g + t: row 16v + g + 8(e/2),
 *   column 8i + 2t + (e%2) (forward header). Pass 2: row = key, column = query; the lse and D
 *   of a column come from shared memory (per stage, fp32, BQ each), columns 2t, 2t+1 of block i
 *   as one 8-byte load. Pass 3: row = query (lse, D in registers, 2 rows per thread), column =
 *   key.
 *
 * ---------------------------------------------------------------------------------------------
 * Pipelines (both passes; STAGES = 2 or 3 ring slots for the streamed tiles, loads one tile
 * ahead by cp.async, every thread a loader (the forward has a producer warpgroup and mbarriers
 * instead; the backward keeps this scheme); no TMA, no mbarrier)
 *   ring(it): cp.async.wait_group 0 (tile it landed); fence.proxy.async (cp.async writes are
 *             generic-proxy, wgmma reads async-proxy); __syncthreads(); issue the cp.async loads
 *             of tile it+1 into slot (it+1) % STAGES; commit.
 *   Slot (it+1) % STAGES held tile it+1-STAGES, read by the wgmmas of that iteration. Those must
 *   be retired (wgmma.wait_group in every warpgroup, before the barrier in program order):
 *     STAGES = 2: tile it-1, whose last products (pass 2: dV, dK; pass 3: dQ) are still in
 *                 flight at the end of iteration it-1, so the iteration starts with wait_group 0
 *                 BEFORE ring(it).
 *     STAGES = 3: tile it-2, retired during iteration it-1 (pass 2: wait_group 0 after ring(it-1);
 *                 pass 3: the wait_group 1 after S/dP of it-1), so ring(it) needs no wait and the
 *                 last products of iteration it-1 overlap the barrier and the load issue (pass 3:
 *                 also S_it and dP_it, queued behind dQ_{it-1}).
 *   The same fence.proxy.async, after the retiring wait_group in program order, orders the
 *   async-proxy reads before the next generic writes to the slot (as in the forward).
 *
 *   pass 2, iteration it (per warpgroup; groups committed: [S^T], [dP^T], [dV], [dK]):
 *     [STAGES=2: wait_group 0]  ring(it)  [STAGES=3: wait_group 0]      dV, dK of it-1 retired
 *     issue S^T, commit; issue dP^T, commit
 *     wait_group 1                              S^T done (dP^T may run)
 *     P^T (exp2, mask) in place, P^T -> bf16 A fragments pf
 *     issue dV += P^T dO, commit                (runs while dS^T is computed)
 *     wait_group 1                              dP^T done (dV may run)
 *     dS^T = P^T (dP^T - D) in place, -> bf16 A fragments dsf
 *     issue dK += dS^T Q, commit                (runs across the loop back edge)
 *   after the loop: wait_group 0.
 *   pass 3, iteration j:
 *     [STAGES=2: wait_group 0]  ring(j)
 *     issue S, commit; issue dP, commit
 *     wait_group 1                              dQ_{j-1} (STAGES=3) and S done
 *     P (exp2, mask) in place
 *     wait_group 0                              dP done
 *     dS = P (dP - D) in place, -> bf16 A fragments dsf
 *     issue dQ += dS K, commit
 *   after the loop: wait_group 0.
 *   wgmma.fence before every batch of issues (registers written by ordinary instructions before
 *   a wgmma reads them: accumulators, A fragments); wg_fence_acc / wg_fence_frag pin the in-flight
 *   accumulators and A fragments at each retiring wait (the forward's discipline): no compiler
 *   read of an accumulator before its wait, no reuse of an A fragment's registers before its
 *   wait. All wgmma issues and waits are on CTA-uniform straight-line code (the mask branches and
 *   the tail conditions contain no wgmma).
 *
 * Masking. Pass 2: a (query tile, kv tile) pair needs the mask when some key exceeds some query,
 * q0 < k0 + BN - 1, or when the tile reaches past T (its zero-filled rows give S = 0 and lse = 0
 * would make P = 1): p = 0 where key > query or query >= T (as production). A warpgroup whose 64
 * keys are all right of a tile's queries (first tile of warpgroup 1) multiplies zeros: harmless.
 * Pass 3: p = 0 where key > row, on tiles with k0 + BN - 1 > q0 (CTA-uniform); rows >= T get
 * lse = 0, D = 0 and zero Q, dO rows: finite, never stored. Keys >= T are zero rows of K and V
 * and always masked (key >= T > every valid query).
 * * Shared memory (base aligned to 1024 at run time, 1024 bytes of slack in the size):
 *   pass 2: K (BN x HD) | V (BN x HD) | STAGES x Q (BQ x HD) | STAGES x dO | STAGES x {lse[BQ],
 *           D[BQ]} fp32 (cp.async 4-byte copies, zero-filled past T)
 *   pass 3: Q (BR x HD) | dO (BR x HD) | STAGES x K (BN x HD) | STAGES x V
 *   HD=128, 2 warpgroups, 3 slots: pass 2 160 KB + 1.5 KB (lse, D) + 1 KB slack = 166,400
 *   bytes, pass 3 160 KB + 1 KB = 164,864 bytes: 1 CTA (8 warps) per SM.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef KERNELS_ATTENTION_BWD_WGMMA_CUH
#define KERNELS_ATTENTION_BWD_WGMMA_CUH

#include "attention_common.cuh"

#define ATTN_BWG_BQ 64  // pass 2: query rows per streamed tile (wgmma N of S^T, dP^T)
#define ATTN_BWG_BN 64  // pass 3: keys per streamed tile (wgmma N of S, dP)

// ----------------------------------------------------------------------------
// pass 2: dK, dV

template <int HD, int NWG, int BQ, int STAGES>
constexpr size_t attn_bwg_dkdv_smem_bytes() {
    return (size_t)(2 * ATTN_WG_ROWS * NWG + 2 * STAGES * BQ) * HD * sizeof(bf16) +
           (size_t)STAGES * 2 * BQ * sizeof(float) + ATTN_SW128_ATOM_BYTES;
}

// SW: window normalised to [1, T] (the sinks are in lse already): the query tiles walked end at
// the last query that sees a key of the CTA; P^T is also 0 where the query is past the key's
// window.
template <int HD, int NWG, int BQ, int STAGES, bool SW = false>
__global__ void __launch_bounds__(NWG * ATTN_WG_THREADS, 1)
    attn_bwg_dkdv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                         const float* D, int T, int H, int KVH, float scale_log2, float scale,
                         int window) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(BQ == 64, "query rows per tile: wgmma N of S^T (registers: 64)");
    static_assert(NWG >= 1 && NWG <= 2, "warpgroups per CTA");
    static_assert(STAGES == 2 || STAGES == 3, "ring slots of the Q/dO tiles");
#if ATTN_WG_ENABLED
    constexpr int BN = ATTN_WG_ROWS * NWG;  // keys per CTA
    constexpr int NT = ATTN_WG_THREADS * NWG;
    constexpr int NB_S = BQ / 8;            // 8-column blocks of S^T, dP^T
    constexpr int NB_O = HD / 8;            // of dK, dV
    constexpr int KS_S = HD / ATTN_WG_K;    // k-steps of S^T, dP^T (over hd)
    constexpr int KS_O = BQ / ATTN_WG_K;    // k-steps of dV, dK (over queries)
    constexpr uint32_t KV_BYTES = BN * HD * sizeof(bf16);
    constexpr uint32_t QT_BYTES = BQ * HD * sizeof(bf16);     // one slot of Q or of dO
    constexpr uint32_t QT_PANEL = BQ * ATTN_SW128_ROW_BYTES;  // LBO of the MN-major Q/dO operand
    constexpr uint32_t LD_BYTES = 2 * BQ * sizeof(float);     // one slot of {lse, D}
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = ATTN_SW128_KMAJOR_LBO;
    constexpr uint32_t WG_ROWS_BYTES = ATTN_WG_ROWS * ATTN_SW128_ROW_BYTES;  // 64 rows = 8 atoms
    constexpr bool LATE_RETIRE = STAGES >= 3;
    static_assert(KV_BYTES % ATOM == 0 && QT_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_bwg_dkdv_smem[];
    const uint32_t sraw = smem_u32(attn_bwg_dkdv_smem);
    const uint32_t sbase = (sraw + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sK = sbase;                    // (BN, HD) SW128, resident
    const uint32_t sV = sK + KV_BYTES;            // (BN, HD) SW128, resident
    const uint32_t sQ = sV + KV_BYTES;            // STAGES x (BQ, HD) SW128
    const uint32_t sdO = sQ + STAGES * QT_BYTES;  // STAGES x (BQ, HD) SW128
    const uint32_t sLD = sdO + STAGES * QT_BYTES; // STAGES x {lse[BQ], D[BQ]} fp32
    const float* gLD = reinterpret_cast<const float*>(attn_bwg_dkdv_smem + (sLD - sraw));

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid / ATTN_WG_THREADS;
    const int wv = (tid >> 5) & 3;
    const int kvh = blockIdx.x % KVH, b = blockIdx.x / KVH;
    const int k0 = blockIdx.y * BN;
    const int group = H / KVH;
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;  // row stride of dout
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* dseq = dout + (int64_t)b * T * OS;
    const int qt0 = k0 / BQ;                         // first query tile holding a query >= k0
    // one past the last query tile holding a query that sees a key of the CTA (SW: the window
    // of its last key)
    const int qt_end = SW ? (min(T, k0 + BN - 1 + window) - 1) / BQ + 1 : (T + BQ - 1) / BQ;
    const int per_head = qt_end - qt0;               // >= 1 since k0 < T
    const int n_iter = group * per_head;
    // key of accumulator rows e = 0, 1 of this thread (e = 2, 3: + 8)
    const int my_key = k0 + wg * ATTN_WG_ROWS + wv * 16 + (lane >> 2);

    // Stage (Q, dO, lse, D) of iteration `it` (head outer, query tile inner) into slot `slot`.
    auto stage = [&](int it, int slot) {
        const int hq = kvh * group + it / per_head;
        const int q0 = (qt0 + it % per_head) * BQ;
        sw128_tile_load_async<BQ, HD, NT>(sQ + slot * QT_BYTES, seq + (int64_t)hq * HD, QKV, q0,
                                          T, tid);
        sw128_tile_load_async<BQ, HD, NT>(sdO + slot * QT_BYTES, dseq + (int64_t)hq * HD, OS, q0,
                                          T, tid);
        const int64_t r0 = ((int64_t)b * H + hq) * T;  // (b, hq, t = 0) of lse and D
        for (int i = tid; i < 2 * BQ; i += NT) {
            const int q = q0 + (i % BQ);
            const bool valid = q < T;
            const float* src = (i < BQ ? lse : D) + r0 + (valid ? q : 0);
            cp_async_4(sLD + slot * LD_BYTES + i * (uint32_t)sizeof(float), src, valid);
        }
    };

    // descriptors at k-step 0, slot 0 (header)
    const uint64_t desc_k = wg_desc(sK + wg * WG_ROWS_BYTES, KMAJOR_LBO, ATOM);  // A of S^T
    const uint64_t desc_v = wg_desc(sV + wg * WG_ROWS_BYTES, KMAJOR_LBO, ATOM);  // A of dP^T
    const uint64_t desc_q_kmaj = wg_desc(sQ, KMAJOR_LBO, ATOM);   // B of S^T
    const uint64_t desc_o_kmaj = wg_desc(sdO, KMAJOR_LBO, ATOM);  // B of dP^T
    const uint64_t desc_q_nmaj = wg_desc(sQ, QT_PANEL, ATOM);     // B of dK += dS^T Q
    const uint64_t desc_o_nmaj = wg_desc(sdO, QT_PANEL, ATOM);    // B of dV += P^T dO

    // prologue: K, V of this CTA and the first (Q, dO, lse, D) tile, one group
    sw128_tile_load_async<BN, HD, NT>(sK, seq + (int64_t)(H + kvh) * HD, QKV, k0, T, tid);
    sw128_tile_load_async<BN, HD, NT>(sV, seq + (int64_t)(H + KVH + kvh) * HD, QKV, k0, T, tid);
    stage(0, 0);
    cp_async_commit();

    float dk[NB_O][4], dv[NB_O][4], s[NB_S][4], dp[NB_S][4];
    uint32_t pf[KS_O][4], dsf[KS_O][4];  // P^T, dS^T as bf16 A fragments, one [4] per k-step
    acc_zero(dk);
    acc_zero(dv);
    // s, dp: overwritten by their first k-step (scale-d 0); pf, dsf written before each use.
    // Zeroed once so no path reads garbage.
    acc_zero(s);
    acc_zero(dp);
    frag_zero(pf);
    frag_zero(dsf);

    // S^T = K_w Q^T and dP^T = V_w dO^T, two commit groups (first k-step: scale-d 0)
    auto issue_sdp = [&](int slot) {
        wgmma_group_ss<BQ, KS_S, BN>(s, desc_k, wg_desc_add(desc_q_kmaj, slot * QT_BYTES));
        wgmma_group_ss<BQ, KS_S, BN>(dp, desc_v, wg_desc_add(desc_o_kmaj, slot * QT_BYTES));
    };
    // dV += P^T dO (k-step kk: query rows 16kk..16kk+15 of the dO slot), one group
    auto issue_dv = [&](int slot) {
        wgmma_group_rs<HD, KS_O>(dv, pf, wg_desc_add(desc_o_nmaj, slot * QT_BYTES));
    };
    // dK += dS^T Q, one group
    auto issue_dk = [&](int slot) {
        wgmma_group_rs<HD, KS_O>(dk, dsf, wg_desc_add(desc_q_nmaj, slot * QT_BYTES));
    };
    auto retire_all = [&]() {
        wgmma_wait<0>();
        wg_fence_acc(dk);
        wg_fence_acc(dv);
        wg_fence_frag(pf);
        wg_fence_frag(dsf);
    };

    // do-while: n_iter >= 1 (k0 < T, so per_head >= 1); a skippable loop makes ptxas serialise
    // every wgmma (see the dQ kernel)
    int slot = 0;  // ring slot of tile it
    int it = 0;
    do {
        if constexpr (!LATE_RETIRE) retire_all();  // dV, dK of it-1 read slot (it+1) % 2
        // ring(it): tile it landed (this thread's copies, then everyone's via the barrier)
        cp_async_wait_all();
        fence_proxy_async_shared();
        __syncthreads();
        const int next = slot + 1 == STAGES ? 0 : slot + 1;
        if (it + 1 < n_iter) stage(it + 1, next);
        cp_async_commit();
        if constexpr (LATE_RETIRE) retire_all();  // dV, dK of it-1 ran across the ring

        const int q0 = (qt0 + it % per_head) * BQ;
        const float* tL = gLD + slot * (2 * BQ);  // lse of the slot's queries (natural log)
        const float* tD = tL + BQ;                // D

        wg_fence_acc(s);
        wg_fence_acc(dp);
        wgmma_fence();
        issue_sdp(slot);
        wgmma_wait<1>();  // S^T done
        wg_fence_acc(s);

        // P^T = 2^(S^T * scale_log2 - lse * log2e); 0 where key > query or query >= T (SW: or
        // query >= key + window)
        const bool edge = q0 < k0 + BN - 1 || q0 + BQ > T ||
                          (SW && q0 + BQ - 1 >= k0 + window);  // CTA-uniform
#pragma unroll
        for (int i = 0; i < NB_S; i++) {
            const int qi = i * 8 + (lane & 3) * 2;  // query (in the tile) of e = 0, 2; +1: e = 1, 3
            const float2 l2 = *reinterpret_cast<const float2*>(tL + qi);
            const float nl[2] = {-l2.x * ATTN_LOG2E, -l2.y * ATTN_LOG2E};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(fmaf(s[i][e], scale_log2, nl[e & 1]));
                if (edge) {
                    const int key = my_key + (e >> 1) * 8;
                    const int q = q0 + qi + (e & 1);
                    if (key > q || q >= T || (SW && q >= key + window)) p = 0.0f;
                }
                s[i][e] = p;
            }
        }
        acc_to_frags(pf, s);

        wg_fence_frag(pf);
        wg_fence_acc(dv);
        wgmma_fence();
        issue_dv(slot);
        wgmma_wait<1>();  // dP^T done (dV may still run)
        wg_fence_acc(dp);

        // dS^T = P^T (dP^T - D), D per query (column)
#pragma unroll
        for (int i = 0; i < NB_S; i++) {
            const int qi = i * 8 + (lane & 3) * 2;
            const float2 d2 = *reinterpret_cast<const float2*>(tD + qi);
            const float dd[2] = {d2.x, d2.y};
#pragma unroll
            for (int e = 0; e < 4; e++) dp[i][e] = s[i][e] * (dp[i][e] - dd[e & 1]);
        }
        acc_to_frags(dsf, dp);

        wg_fence_frag(dsf);
        wg_fence_acc(dk);
        wgmma_fence();
        issue_dk(slot);
        slot = next;
    } while (++it < n_iter);
    retire_all();

    // dK = scale * sum dS^T Q (the logits were scaled), dV; rows of keys < T
    store_dk_dv(dqkv, dk, dv, QKV, b, kvh, my_key, T, H, KVH, lane, scale);
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

// ----------------------------------------------------------------------------
// pass 3: dQ

template <int HD, int NWG, int BN, int STAGES>
constexpr size_t attn_bwg_dq_smem_bytes() {
    return (size_t)(2 * ATTN_WG_ROWS * NWG + 2 * STAGES * BN) * HD * sizeof(bf16) +
           ATTN_SW128_ATOM_BYTES;
}

// SW: window normalised to [1, T]: the CTA walks the kv tiles from the first one its first
// row's window reaches; P is also 0 left of a row's window.
template <int HD, int NWG, int BN, int STAGES, bool SW = false>
__global__ void __launch_bounds__(NWG * ATTN_WG_THREADS, 1)
    attn_bwg_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                       const float* D, int T, int H, int KVH, float scale_log2, float scale,
                       int window) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(BN == 64 || BN == 128, "keys per tile: wgmma N of S (64 or 128 implemented)");
    static_assert(NWG >= 1 && NWG <= 2, "warpgroups per CTA");
    static_assert(STAGES == 2 || STAGES == 3, "ring slots of the K/V tiles");
#if ATTN_WG_ENABLED
    constexpr int BR = ATTN_WG_ROWS * NWG;  // query rows per CTA
    constexpr int NT = ATTN_WG_THREADS * NWG;
    constexpr int NB_S = BN / 8;            // 8-column blocks of S, dP
    constexpr int NB_O = HD / 8;            // of dQ
    constexpr int KS_S = HD / ATTN_WG_K;    // k-steps of S, dP (over hd)
    constexpr int KS_O = BN / ATTN_WG_K;    // k-steps of dQ (over keys)
    constexpr uint32_t Q_BYTES = BR * HD * sizeof(bf16);
    constexpr uint32_t KV_BYTES = BN * HD * sizeof(bf16);     // one slot of K or of V
    constexpr uint32_t KV_PANEL = BN * ATTN_SW128_ROW_BYTES;  // LBO of the MN-major K operand
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = ATTN_SW128_KMAJOR_LBO;
    constexpr uint32_t WG_ROWS_BYTES = ATTN_WG_ROWS * ATTN_SW128_ROW_BYTES;
    constexpr bool LATE_RETIRE = STAGES >= 3;
    static_assert(Q_BYTES % ATOM == 0 && KV_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_bwg_dq_smem[];
    const uint32_t sbase = (smem_u32(attn_bwg_dq_smem) + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sQ = sbase;                   // (BR, HD) SW128, resident
    const uint32_t sdO = sQ + Q_BYTES;           // (BR, HD) SW128, resident
    const uint32_t sK = sdO + Q_BYTES;           // STAGES x (BN, HD) SW128
    const uint32_t sV = sK + STAGES * KV_BYTES;  // STAGES x (BN, HD) SW128

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid / ATTN_WG_THREADS;
    const int wv = (tid >> 5) & 3;
    const int h = blockIdx.x % H, b = blockIdx.x / H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;  // longest rows first
    const int kvh = h / (H / KVH);
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    // kv tiles holding keys <= the CTA's last row (< T), from the first one its first row's
    // window reaches (causal: tile 0); both warpgroups walk all of them. Loop index j = tile
    // j_first + j.
    const int j_first = SW ? attn_first_key(q0, window) / BN : 0;
    const int n_tiles = (min(q0 + BR, T) - 1) / BN + 1 - j_first;
    const int my_row = q0 + wg * ATTN_WG_ROWS + wv * 16 + (lane >> 2);  // e = 0,1; +8: e = 2,3

    float lse_log2[2], drow[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int q = my_row + hf * 8;
        const int64_t r = ((int64_t)b * H + h) * T + q;
        lse_log2[hf] = q < T ? lse[r] * ATTN_LOG2E : 0.0f;
        drow[hf] = q < T ? D[r] : 0.0f;
    }

    const uint64_t desc_q = wg_desc(sQ + wg * WG_ROWS_BYTES, KMAJOR_LBO, ATOM);   // A of S
    const uint64_t desc_o = wg_desc(sdO + wg * WG_ROWS_BYTES, KMAJOR_LBO, ATOM);  // A of dP
    const uint64_t desc_k_kmaj = wg_desc(sK, KMAJOR_LBO, ATOM);  // B of S
    const uint64_t desc_v_kmaj = wg_desc(sV, KMAJOR_LBO, ATOM);  // B of dP
    const uint64_t desc_k_nmaj = wg_desc(sK, KV_PANEL, ATOM);    // B of dQ += dS K

    sw128_tile_load_async<BR, HD, NT>(sQ, seq + (int64_t)h * HD, QKV, q0, T, tid);
    sw128_tile_load_async<BR, HD, NT>(sdO, dout + (int64_t)b * T * OS + (int64_t)h * HD, OS, q0,
                                      T, tid);
    sw128_tile_load_async<BN, HD, NT>(sK, gK, QKV, j_first * BN, T, tid);
    sw128_tile_load_async<BN, HD, NT>(sV, gV, QKV, j_first * BN, T, tid);
    cp_async_commit();

    float dq[NB_O][4], s[NB_S][4], dp[NB_S][4];
    uint32_t dsf[KS_O][4];  // dS as bf16 A fragments, one [4] per k-step
    acc_zero(dq);
    acc_zero(s);
    acc_zero(dp);
    frag_zero(dsf);

    // S = Q_w K^T and dP = dO_w V^T, two commit groups (first k-step: scale-d 0)
    auto issue_sdp = [&](int slot) {
        wgmma_group_ss<BN, KS_S, BR>(s, desc_q, wg_desc_add(desc_k_kmaj, slot * KV_BYTES));
        wgmma_group_ss<BN, KS_S, BR>(dp, desc_o, wg_desc_add(desc_v_kmaj, slot * KV_BYTES));
    };
    // dQ += dS K (k-step kk: keys 16kk..16kk+15 of the K slot), one group
    auto issue_dq = [&](int slot) {
        wgmma_group_rs<HD, KS_O>(dq, dsf, wg_desc_add(desc_k_nmaj, slot * KV_BYTES));
    };

    // do-while: n_tiles >= 1 (q0 < T). A loop the compiler may skip gives a path on which the
    // accumulators are zero-initialised by plain moves and merges with the in-flight path at the
    // final wait; ptxas then serialises every wgmma of the kernel (C7515 in the build log).
    int slot = 0;
    int j = 0;
    do {
        if constexpr (!LATE_RETIRE) {  // dQ of j-1 reads slot (j+1) % 2
            wgmma_wait<0>();
            wg_fence_acc(dq);
            wg_fence_frag(dsf);
        }
        cp_async_wait_all();
        fence_proxy_async_shared();
        __syncthreads();
        const int next = slot + 1 == STAGES ? 0 : slot + 1;
        if (j + 1 < n_tiles) {
            const int kn = (j_first + j + 1) * BN;
            sw128_tile_load_async<BN, HD, NT>(sK + next * KV_BYTES, gK, QKV, kn, T, tid);
            sw128_tile_load_async<BN, HD, NT>(sV + next * KV_BYTES, gV, QKV, kn, T, tid);
        }
        cp_async_commit();

        wg_fence_acc(s);
        wg_fence_acc(dp);
        wgmma_fence();
        issue_sdp(slot);
        wgmma_wait<1>();  // S done, and dQ of j-1 (groups retire in order)
        wg_fence_acc(s);
        wg_fence_acc(dq);
        wg_fence_frag(dsf);

        // P = 2^(S * scale_log2 - lse_log2), 0 where key > row (SW: or key <= row - window)
        const int k0 = (j_first + j) * BN;
        const bool diag =
            k0 + BN - 1 > q0 || (SW && k0 <= q0 + BR - 1 - window);  // CTA-uniform
#pragma unroll
        for (int i = 0; i < NB_S; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(fmaf(s[i][e], scale_log2, -lse_log2[e >> 1]));
                if (diag) {
                    const int row = my_row + (e >> 1) * 8;
                    const int key = k0 + i * 8 + (lane & 3) * 2 + (e & 1);
                    if (key > row || (SW && key <= row - window)) p = 0.0f;
                }
                s[i][e] = p;
            }

        wgmma_wait<0>();  // dP done
        wg_fence_acc(dp);
#pragma unroll
        for (int i = 0; i < NB_S; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) dp[i][e] = s[i][e] * (dp[i][e] - drow[e >> 1]);
        acc_to_frags(dsf, dp);

        wg_fence_frag(dsf);
        wg_fence_acc(dq);
        wgmma_fence();
        issue_dq(slot);
        slot = next;
    } while (++j < n_tiles);
    wgmma_wait<0>();
    wg_fence_acc(dq);
    wg_fence_frag(dsf);

    store_dq(dqkv, dq, QKV, b, h, my_row, T, lane, scale);
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

// ----------------------------------------------------------------------------
// host side

// The two wgmma passes' launches, apart (the lab times them one by one). <warpgroups per CTA,
// ring slots>.
// SW: the window normalised to [1, T]; without SW unused.
template <int HD, int NWG, int STAGES, bool SW = false>
static void attn_bwg_dkdv_launch(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                 const float* D, int B, int T, int H, int KVH,
                                 cudaStream_t stream, int window = 0) {
    constexpr int BQ = ATTN_BWG_BQ, BN = ATTN_WG_ROWS * NWG;
    const float scale = 1.0f / sqrtf((float)HD);
    const size_t smem = attn_bwg_dkdv_smem_bytes<HD, NWG, BQ, STAGES>();
    auto kernel = attn_bwg_dkdv_kernel<HD, NWG, BQ, STAGES, SW>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, KVH, BN), NWG * ATTN_WG_THREADS, smem, stream>>>(
        dqkv, dout, qkv, lse, D, T, H, KVH, scale * ATTN_LOG2E, scale, window);
    attention_check(cudaGetLastError());
}
template <int HD, int NWG, int STAGES, bool SW = false>
static void attn_bwg_dq_launch(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                               const float* D, int B, int T, int H, int KVH, cudaStream_t stream,
                               int window = 0) {
    constexpr int BN = ATTN_BWG_BN, BR = ATTN_WG_ROWS * NWG;
    const float scale = 1.0f / sqrtf((float)HD);
    const size_t smem = attn_bwg_dq_smem_bytes<HD, NWG, BN, STAGES>();
    auto kernel = attn_bwg_dq_kernel<HD, NWG, BN, STAGES, SW>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), NWG * ATTN_WG_THREADS, smem, stream>>>(
        dqkv, dout, qkv, lse, D, T, H, KVH, scale * ATTN_LOG2E, scale, window);
    attention_check(cudaGetLastError());
}

// The grids' y dimension (tiles of T) is at most 65535.
static void attn_bwg_check_tiles(const char* fn, int T, int kv_rows, int q_rows) {
    const int64_t kv_tiles = (T + kv_rows - 1) / kv_rows, q_tiles = (T + q_rows - 1) / q_rows;
    if (kv_tiles > 65535 || q_tiles > 65535) {
        fprintf(stderr, "attention: %s: T = %d too large\n", fn, T);
        exit(1);
    }
}

// The three passes, dispatched on HD (64 or 128) once the arguments are checked
// (attention_backward_check) and the device code is known to be there
// (attention_wgmma_available). <warpgroups and ring slots of the dK/dV pass, of the dQ pass>.
// SW: the window normalised to [1, T] (without SW unused).
template <int KV_NWG, int KV_STAGES, int Q_NWG, int Q_STAGES, bool SW = false>
static void attention_backward_wgmma_hd(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                        const bf16* out, const float* lse, float* D, int B, int T,
                                        int H, int KVH, int HD, cudaStream_t s, int window = 0) {
    const char* fn = "attention_backward_bf16";
    attn_bwg_check_tiles(fn, T, ATTN_WG_ROWS * KV_NWG, ATTN_WG_ROWS * Q_NWG);
    if (HD == 64) {
        attention_backward_dot<64>(D, dout, out, B, T, H, fn, s);
        attn_bwg_dkdv_launch<64, KV_NWG, KV_STAGES, SW>(dqkv, dout, qkv, lse, D, B, T, H, KVH, s,
                                                        window);
        attn_bwg_dq_launch<64, Q_NWG, Q_STAGES, SW>(dqkv, dout, qkv, lse, D, B, T, H, KVH, s,
                                                    window);
    } else {
        attention_backward_dot<128>(D, dout, out, B, T, H, fn, s);
        attn_bwg_dkdv_launch<128, KV_NWG, KV_STAGES, SW>(dqkv, dout, qkv, lse, D, B, T, H, KVH,
                                                         s, window);
        attn_bwg_dq_launch<128, Q_NWG, Q_STAGES, SW>(dqkv, dout, qkv, lse, D, B, T, H, KVH, s,
                                                     window);
    }
}

#endif  // KERNELS_ATTENTION_BWD_WGMMA_CUH
