/*
 * dev/cuda/attention_gqa_pack.cuh — lab variants of the wgmma attention forward and of the dQ
 * pass of the wgmma backward that change WHICH query rows/heads a CTA takes and in WHICH ORDER
 * CTAs run, to test whether long sequences are DRAM-bound on K/V: PACK = the two warpgroups of
 * a CTA take the SAME 64 query rows of TWO query heads of one GQA group (the brief's idea);
 * L2 = CTAs launched in kv-head sections whose K/V fits in L2. Arithmetic per row unchanged:
 * outputs bit-identical to production (checked by the lab).
 *
 * STATUS: written without a GPU (nvcc 13, sm_90a build only): NOT YET RUN. Checklist at the end
 * of this header.
 *
 *   lab forward variant (dev/cuda/attention.cu)   <BC, PACK, L2>   same_bits_as
 *   13 "wgmma gqa pack bc128"                      128, yes, no     "wgmma bc128 wg2" (7)
 *   14 "wgmma gqa pack bc64"                        64, yes, no     "wgmma bc64 wg2"  (8)
 *   15 "wgmma l2 sections bc128"                   128, no,  yes    "wgmma bc128 wg2" (7)
 *   16 "wgmma gqa pack l2 bc128"                   128, yes, yes    "wgmma bc128 wg2" (7)
 *   17 "wgmma gqa ctl bc128"                       128, no,  no     "wgmma bc128 wg2" (7)  control
 *   lab backward variant                          dQ <STAGES, PACK, L2>; D, dK/dV: production's
 *   12 "wgmma bwd gqa pack dq"                     3, yes, no       "wgmma bwd wg2 s3" (8)
 *   13 "wgmma bwd l2 dq"                           3, no,  yes      "wgmma bwd wg2 s3" (8)
 *   14 "wgmma bwd gqa pack l2 dq"                  3, yes, yes      "wgmma bwd wg2 s3" (8)
 *   PACK variants need an even H/KVH: the lab skips other shapes (supports_shape hook, counted
 *   "skipped"); called directly they run production instead (same bits by construction).
 *
 * =============================================================================================
 * Hypothesis (from the brief) and what this file does about it
 *   At long sequences the wgmma forward is L2/DRAM-bound on K/V: 538 TFLOP/s at T=16384 (K/V of
 *   a kv head 8 MiB) but 475 at T=131072 and 432 at T=262144 (128 MiB per kv head). Per CTA
 *   iteration a 64 KiB K/V tile (128 keys x 128 dims x K,V x bf16) feeds ~8.4 MFLOP; at ~4
 *   TFLOP/s per SM that is ~32 GB/s per SM, ~4.3 TB/s over 132 SMs, about HBM bandwidth if
 *   CTAs of a head drift apart and stop sharing tiles in L2.
 *
 *   CORRECTION (worked out while writing this; the lab measures it): packing a head pair per CTA
 *   (PACK) does NOT change the K/V bytes moved from L2 to the SMs per FLOP. Production's CTA
 *   is 128 query rows x 1 head, the packed CTA 64 rows x 2 heads: both multiply each 64 KiB K/V
 *   tile by 128 (row, head) query vectors, 8.4 MFLOP per tile in both, and the total number of
 *   tile loads over the grid is the same (two 64-row CTAs of a pair instead of two 128-row CTAs
 *   of two heads). What PACK changes is only WHICH CTAs read the same K/V: production shares a
 *   kv head between CTAs (h=2g, y) and (2g+1, y), launched adjacently with the same length;
 *   packed between (pair g, y) and (pair g, y+1), launched 8 CTAs apart (H/2 = 8 pairs) with
 *   the same length at BC=128. Both are pairs of CTAs in lockstep: DRAM traffic should be about
 *   the same. Expected gain of PACK alone: ~0 (within noise). Halving the L2->SM traffic for
 *   real needs a CTA of 128 rows x 2 heads (4 consumer warpgroups: 4 x 128 x ~218 registers >
 *   64K: impossible here), or a 2-CTA cluster with TMA multicast of each K/V tile (future).
 *
 *   What can cut DRAM traffic is the ORDER in which CTAs run (L2): production's grid runs
 *   x = h + H*b fastest, so the ~132 resident CTAs span all B*KVH kv heads; at T=65536 (H=16,
 *   KVH=8) that is 8 x 32 MiB = 256 MiB of K/V in flight against a 50 MB L2, and once CTAs
 *   desynchronise (lengths differ, replacements start at tile 0) almost every tile read misses.
 *   L2 variants launch the CTAs in KV-HEAD SECTIONS: the CTAs of `units_per_section`
 *   consecutive (batch, kv head) units first (longest query tiles first inside the section,
 *   head slots fastest), then the next units; units_per_section = as many units as keep their
 *   K+V within ATTN_GQP_L2_BUDGET = 24 MiB (at least 1). At T=65536 a section is one kv head
 *   (32 MiB: its whole K/V stays in L2 after the first pass, DRAM traffic for K/V ~1/66 of
 *   production's); at T=16384 three units (24 MiB); at T=131072/262144 (64/128 MiB per unit)
 *   one unit, which no longer fits, but all ~132 resident CTAs then stream the same kv head
 *   roughly in step (FA3's tile scheduler does the same "L2 swizzle" by head). Same CTAs, same
 *   work per CTA: bit-identical to production by construction.
 *   Expected: if the hypothesis holds, 15/16 at T=65536 approach the T=16384 rate (~530
 *   TFLOP/s) against production's ~470-480; no change at T <= 16384 (K/V already fits). If 15
 *   does not beat 7 at --long, the long-T loss is not DRAM on K/V (look at causal tail
 *   imbalance instead: T=65536 B=1 H=16 has 8192 CTAs, of which the last wave is short).
 *
 * ---------------------------------------------------------------------------------------------
 * Design
 *   Both kernels are production's bodies (kernels/attention_wgmma.cuh forward with BC keys and
 *   2 warpgroups; kernels/attention_bwd_wgmma.cuh dQ pass with 2 warpgroups, BN = 64, 3 ring
 *   slots) with the same pipeline, waits, fences, ring and arithmetic, copied (nothing under kernels/ is
 *   modified) and changed only in:
 *   - Q (and dO) held as two 64-row SW128 tiles, one per warpgroup: tile i = head h0 + i, rows
 *     q0..q0+63 (PACK) or head h0, rows q0 + 64i.. (not packed: production's CTA). Warpgroup w's
 *     A descriptor starts at tile w, k-steps via sw128_kstep_offset(kk, 64) (panel stride
 *     64*128 bytes). Same bytes of shared memory as production (HD=128: forward 164,864, dQ
 *     164,864), 1 CTA of 256 threads per SM.
 *   - (b, head slot, q0) per CTA from attn_gqp_tile: production's 2D heavy-first grid
 *     (x = slot + slots*b, y counted from the last query tile) or, with L2, a 1D grid in kv-head
 *     sections. PACK: slot = head pair (2 heads of one group, H/KVH even), 64-row query tiles,
 *     both warpgroups the same rows: same causal diagonal, same tile count (balanced).
 *   - n_tiles = production's for ITS 128-row CTA holding these rows: q0p = q0 - q0 % 128,
 *     n_tiles = (min(q0p + 128, T) - 1) / BC + 1. At BC = 128 that is also the count of the 64
 *     rows alone; at BC = 64 (forward variant 14, the dQ pass) the lower 64-row half walks one
 *     tile fully right of its diagonal, exactly as production's warpgroup 0 does, so each row
 *     receives exactly production's products in production's order (no reliance on "adding an
 *     all-zero product leaves the fp32 accumulator bit-unchanged").
 *   - The mask test uses this CTA's first row q0 (production: its 128-row CTA's first row q0p):
 *     the masked VALUES are identical (a tile one test skips and the other masks has no key
 *     right of any of these rows, so the mask changes nothing there).
 *   - Rescale by warp vote (__any_sync) is per warp in both: rows whose maximum did not move
 *     have alpha exactly 1.0f, so O * 1 = O: no bit depends on the warp grouping.
 *   Backward: D (attention_backward_dot_kernel) and dK/dV (attn_bwg_dkdv_kernel<HD, 2, 64, 3>)
 *   are production's kernels launched as production does; only the dQ pass is replaced.
 *
 * ptxas (nvcc 13, sm_90a, 256 threads, 1 CTA/SM; production in brackets), no spills, no C75:
 *   forward  HD=128 BC=128: pack 216, not packed (15/17) 218 [218]; BC=64 pack 166 [166]
 *            HD=64  BC=128: pack 176, not packed 178 [175];        BC=64 pack 128 [128]
 *   dQ       HD=128: 180 (pack and not) [176];  HD=64: 146 [144]
 *   SASS (cuobjdump): the same HGMMA / WARPGROUP.DEPBAR / BAR.SYNC / LDGSTS / MUFU.EX2 counts as
 *   production for every instance (forward HD=128 BC=128: 32 / 5 / 3 / 48 / 132; dQ HD=128:
 *   20 / 3 / 1 / 32 / 63); ~250 more instructions, all in the prologue (tile mapping, with a
 *   64-bit division in the sectioned path: once per CTA).
 *
 * Risks, most likely first
 *   1. The hypothesis for PACK is wrong on paper (above): expect 13/14/12 within noise of 7/8.
 *      The L2 variants (15, 16, 13/14 backward) are the real test of "DRAM-bound on K/V".
 *   2. Block dispatch order: the sections rely on CTAs being dispatched in increasing linear
 *      block id (true in practice on Hopper, not documented). Correctness never depends on it.
 *   3. Section tail: heavy-first holds only inside a section, so the grid's last CTAs are the
 *      last section's short ones (fine) but each section boundary mixes two kv heads' K/V (at
 *      most 2 x 24 MiB live). A wrong budget shows as 15 slower than 7 at T <= 16384: then try
 *      ATTN_GQP_L2_BUDGET 16 or 40 MiB.
 *   4. Bit identity (13-17, backward 12-14 against 7/8/8): relies on a wgmma row's result not
 *      depending on its neighbours in M or on its position in the 64-row tile (both hold for
 *      the identical-operand argument above; the wgmma2 variants rely on the same). A NOT
 *      BIT-IDENTICAL with small errors points at a changed order; large errors at a mapping bug
 *      (17 = control: same code without PACK/L2; if 17 fails the shared code is wrong).
 *   5. Descriptor of a 64-row Q tile (panel stride 8 KiB instead of 16 KiB): the same SW128
 *      tile shape production's dK/dV pass uses for its 64-row Q/dO B operands, here as the A
 *      operand (K-major, SBO 1024): HD=64 right and HD=128 wrong would point at the panel step.
 *
 * H200 checklist (one device call; dev/cuda/run_attention.sh builds with sm_90a):
 *   1. dev/cuda/run_attention.sh --tiny --no-big --no-bench --fwd 13,14,15,16,17 --bwd 12,13,14
 *      (HD 64/128 x T 64/129; pack variants skip ratio-1 shapes; each compares its bits with
 *      7/8 forward, 8 backward, which the lab runs unreported).
 *   2. compute-sanitizer --tool memcheck .devbuild/attention --tiny --no-big --no-bench --fwd
 *      13,15,16 --bwd 12,14 --log /dev/null; then --tool racecheck the same way.
 *   3. dev/cuda/run_attention.sh --no-bench --fwd 7,13,14,15,16,17 --bwd 8,12,13,14
 *      (all cases twice, "bit-identical to ... N/N", big case B=3 T=131072 H=32 KVH=8 with the
 *      whole-tensor bit comparison against the C interface, forward and backward).
 *   4. dev/cuda/run_attention.sh --no-big --quick --long --fwd 7,8,13,15,16 --bwd 8,12,13,14
 *      (benchmark T = 2048/4096/16384/65536, forward and backward, then the backward passes at
 *      T=4096 B=4 and T=65536 B=1: compare the dQ column of 12/13/14 with 8's).
 *   5. Optional, if ncu exists (DRAM bytes of K/V, the hypothesis directly): ncu --metrics
 *      dram__bytes_read.sum,lts__t_sector_hit_rate.pct on the T=65536 benchmark launches of
 *      variants 7 and 15 (.devbuild/attention --tiny --no-big --long --fwd 7,15 --bwd -2; pick
 *      the launches with -k and --launch-skip from a first ncu --print-summary per-kernel run).
 *      Expected if the hypothesis holds: 15 reads several times fewer DRAM bytes than 7.
 */
#ifndef DEV_CUDA_ATTENTION_GQA_PACK_CUH
#define DEV_CUDA_ATTENTION_GQA_PACK_CUH

#include "../../kernels/attention_wgmma.cuh"      // (already included by kernels/attention.cu)
#include "../../kernels/attention_bwd_wgmma.cuh"  // (idem)

#define ATTN_GQP_HEADS 2      // query heads per CTA = warpgroups per CTA
#define ATTN_GQP_ROWS 64      // query rows per CTA (= ATTN_WG_ROWS: both warpgroups, same rows)
#define ATTN_GQP_PROD_BR 128  // production's query rows per CTA (64 x 2 warpgroups), mimicked
                              // for the number of kv tiles walked (bit identity, see header)

// Whether the packed kernels apply: an even number of query heads per kv head (a head pair
// 2j, 2j+1 then lies in one group), head dim 64 or 128. Otherwise the launchers fall back to
// production (same bits by construction); the lab skips such shapes (its shape hook).
static int attn_gqp_supports_shape(int H, int KVH, int HD) {
    return attention_wgmma_supports_head_dim(HD) && KVH > 0 && H % KVH == 0 &&
           (H / KVH) % ATTN_GQP_HEADS == 0;
}

// Kv-head sections ("L2 order"): the CTAs of `units_per_section` consecutive (batch, kv head)
// units are launched before those of the next units, query tiles longest first inside a
// section, the head slots of a unit fastest; so the CTAs resident at any time read the K/V of
// few kv heads, which then stays in L2 (units_per_section = 0: production's 2D order, x = head
// slot + slots * b, y = query tile from the last). Grid: 1D, CTA id L = blockIdx.x (blocks are
// dispatched in increasing linear id in practice; nothing here depends on it for correctness).
// Host side: attn_gqp_units_per_section picks the units whose K/V fit in ATTN_GQP_L2_BUDGET.
struct AttnGqpTile {
    int b, slot, q0;  // batch, head slot (query head, or head pair when packed), first query row
};
__device__ __forceinline__ AttnGqpTile attn_gqp_tile(int units_per_section, int slots_per_unit,
                                                     int T, int KVH, int rows) {
    AttnGqpTile t;
    if (units_per_section == 0) {  // production: x = slot + slots * b, y = tile from the last
        const int slots = slots_per_unit * KVH;
        t.slot = blockIdx.x % slots;
        t.b = blockIdx.x / slots;
        t.q0 = (gridDim.y - 1 - blockIdx.y) * rows;
        return t;
    }
    const int n_y = (T + rows - 1) / rows;  // query tiles per head
    const int64_t per_unit = (int64_t)slots_per_unit * n_y;
    const int n_units = (int)(gridDim.x / per_unit);  // B * KVH
    const int64_t L = blockIdx.x;
    const int64_t per_section = per_unit * units_per_section;
    const int sec = (int)(L / per_section);
    const int first_unit = sec * units_per_section;
    const int units_here = min(units_per_section, n_units - first_unit);
    const int64_t r = L - (int64_t)sec * per_section;
    const int width = units_here * slots_per_unit;  // CTAs per query tile in this section
    const int y_rank = (int)(r / width), rem = (int)(r % width);
    const int unit = first_unit + rem / slots_per_unit;  // unit = kvh + KVH * b
    t.b = unit / KVH;
    t.slot = (unit % KVH) * slots_per_unit + rem % slots_per_unit;
    t.q0 = (n_y - 1 - y_rank) * rows;
    return t;
}

#define ATTN_GQP_L2_BUDGET (24u << 20)  // bytes of K/V per section: about half the H200's L2
// Units per section: as many (batch, kv head) units as keep their K and V (T x HD bf16 each)
// within ATTN_GQP_L2_BUDGET, at least 1, at most all.
static int attn_gqp_units_per_section(int B, int T, int KVH, int HD) {
    const double unit_bytes = 2.0 * T * HD * sizeof(bf16);
    const double fit = (double)ATTN_GQP_L2_BUDGET / unit_bytes;
    const int all = B * KVH;
    return fit >= all ? all : fit < 1.0 ? 1 : (int)fit;
}
// Grid of a CTA tiling: 2D for production's order, 1D for sections.
static dim3 attn_gqp_grid(int units_per_section, int B, int KVH, int slots_per_unit, int n_y) {
    if (units_per_section == 0) return dim3((unsigned)(B * KVH * slots_per_unit), (unsigned)n_y);
    return dim3((unsigned)((int64_t)B * KVH * slots_per_unit * n_y));
}

// ----------------------------------------------------------------------------
// forward

// Q of the two heads (2 x 64 rows) + 2 stages of K + 2 of V (BC rows each) + alignment slack:
// the same bytes as production's 128-row CTA.
template <int HD, int BC>
constexpr size_t attn_gqp_fwd_smem_bytes() {
    return (size_t)(ATTN_GQP_HEADS * ATTN_GQP_ROWS + 4 * BC) * HD * sizeof(bf16) +
           ATTN_SW128_ATOM_BYTES;
}

// PACK: CTA = (64 query rows, head pair 2j, 2j+1 of one GQA group, batch); warpgroup w computes
// head 2j + w, rows [q0, q0 + 64). !PACK: production's CTA = (128 rows, one head, batch),
// warpgroup w rows [q0 + 64w, q0 + 64w + 64). Order of the CTAs: attn_gqp_tile (production's
// heavy-first 2D grid when units_per_section = 0, else kv-head sections).
// Production's kernel body (attention_forward_wgmma_kernel<HD, BC, 2>) with only these changes:
// Q is held as two 64-row SW128 tiles (one per warpgroup: its head's rows when packed, its
// half of the 128 rows otherwise) and each warpgroup's Q descriptor points at its tile; the
// CTA's (b, head, q0) come from attn_gqp_tile; n_tiles is the one of production's 128-row CTA
// holding these rows; the output head is per warpgroup when packed.
template <int HD, int BC, bool PACK>
__global__ void __launch_bounds__(ATTN_GQP_HEADS * ATTN_WG_THREADS, 1)
    attn_gqp_fwd_kernel(bf16* out, float* lse, const bf16* qkv, int T, int H, int KVH,
                        float scale_log2, int units_per_section) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(BC == 64 || BC == 128, "keys per tile: wgmma N of S (64 or 128 implemented)");
#if ATTN_WG_ENABLED
    constexpr int BR = ATTN_GQP_ROWS;       // query rows per warpgroup = per Q tile
    constexpr int CTA_ROWS = PACK ? BR : ATTN_GQP_PROD_BR;  // query rows per CTA
    constexpr int HPC = PACK ? ATTN_GQP_HEADS : 1;          // query heads per CTA
    constexpr int NT = ATTN_WG_THREADS * ATTN_GQP_HEADS;
    constexpr int NB_S = BC / 8;            // 8-column blocks of the S accumulator
    constexpr int NB_O = HD / 8;            // of the O accumulator
    constexpr int KS_S = HD / ATTN_WG_K;    // k-steps of S = Q K^T
    constexpr int KS_O = BC / ATTN_WG_K;    // k-steps of O += P V
    constexpr uint32_t QH_BYTES = BR * HD * sizeof(bf16);     // one Q tile: (64, HD) SW128
    constexpr uint32_t KV_BYTES = BC * HD * sizeof(bf16);     // one stage of K or of V
    constexpr uint32_t KV_PANEL = BC * ATTN_SW128_ROW_BYTES;  // 64 hd columns of a K/V stage
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;          // SBO of every operand: 8 rows
    constexpr uint32_t KMAJOR_LBO = 16;  // unused by swizzled K-major layouts; encodes as 1
    static_assert(QH_BYTES % ATOM == 0 && KV_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_gqp_fwd_smem[];
    const uint32_t sbase = (smem_u32(attn_gqp_fwd_smem) + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sQ = sbase;                               // 2 tiles of (64, HD) SW128
    const uint32_t sK = sQ + ATTN_GQP_HEADS * QH_BYTES;      // 2 stages of (BC, HD) SW128
    const uint32_t sV = sK + 2 * KV_BYTES;                   // 2 stages of (BC, HD) SW128

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid / ATTN_WG_THREADS;     // this thread's warpgroup (= its head if packed)
    const int wv = (tid >> 5) & 3;            // its warp inside the warpgroup: rows 16wv..16wv+15
    const int G = H / KVH;
    const AttnGqpTile tile = attn_gqp_tile(units_per_section, G / HPC, T, KVH, CTA_ROWS);
    const int b = tile.b, q0 = tile.q0;
    const int h0 = tile.slot * HPC;           // the CTA's (first) head
    const int h = h0 + (PACK ? wg : 0);       // this warpgroup's head
    const int kvh = h0 / G;                   // packed: G even, so h0 and h0 + 1 share it
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gQ = seq + (int64_t)h0 * HD;  // head h0; head h0 + 1 is HD columns further
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    // Tiles walked: production's n_tiles for its 128-row CTA holding rows q0..q0+63, so every
    // row sees exactly the products production gives it (at BC = 128 this is also the count for
    // these 64 rows; at BC = 64 the lower half of a 128-row block walks one tile fully right of
    // its diagonal, as production's warpgroup 0 does). CTA-uniform: wgmma control flow must be.
    const int q0p = q0 - q0 % ATTN_GQP_PROD_BR;
    const int n_tiles = (min(q0p + ATTN_GQP_PROD_BR, T) - 1) / BC + 1;
    // first query row held by this thread (row of accumulator registers e = 0, 1; e = 2, 3 hold
    // row + 8)
    const int wq0 = q0 + (PACK ? 0 : wg * BR);  // this warpgroup's first query row
    const int my_row = wq0 + wv * 16 + (lane >> 2);

    // Descriptors at k-step 0 / stage 0. Q: this warpgroup's tile (64 rows, panel stride
    // 64*128 bytes).
    const uint64_t desc_q = wg_desc(sQ + wg * QH_BYTES, KMAJOR_LBO, ATOM);
    const uint64_t desc_k = wg_desc(sK, KMAJOR_LBO, ATOM);
    const uint64_t desc_v = wg_desc(sV, KV_PANEL, ATOM);

    // Q tile i: head h0 + i, rows q0.. (packed), or head h0, rows q0 + 64i.. (not packed)
#pragma unroll
    for (int i = 0; i < ATTN_GQP_HEADS; i++)
        sw128_tile_load_async<BR, HD, NT>(sQ + i * QH_BYTES, gQ + (PACK ? i * HD : 0), QKV,
                                          q0 + (PACK ? 0 : i * BR), T, tid);
    sw128_tile_load_async<BC, HD, NT>(sK, gK, QKV, 0, T, tid);
    cp_async_commit();

    float o[NB_O][4], s[NB_S][4];
    uint32_t p[KS_O][4];  // P of the previous tile as bf16 A fragments, one [4] per k-step
#pragma unroll
    for (int i = 0; i < NB_O; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[i][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < NB_S; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[i][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < KS_O; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) p[i][e] = 0u;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // rows my_row, +8

    // The pipeline steps, verbatim from production (kernels/attention_wgmma.cuh).
    auto ring_advance = [&](int j) {
        cp_async_wait_all();
        fence_proxy_async_shared();
        __syncthreads();
        if (j + 1 < n_tiles)
            sw128_tile_load_async<BC, HD, NT>(sK + ((j + 1) & 1) * KV_BYTES, gK, QKV, (j + 1) * BC,
                                              T, tid);
        if (j < n_tiles)
            sw128_tile_load_async<BC, HD, NT>(sV + (j & 1) * KV_BYTES, gV, QKV, j * BC, T, tid);
        cp_async_commit();
    };
    auto issue_s = [&](int j) {
        const uint64_t dk = wg_desc_add(desc_k, (j & 1) * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_S; kk++)
            WgmmaBf16<BC>::ss(s, wg_desc_add(desc_q, sw128_kstep_offset(kk, BR)),
                              wg_desc_add(dk, sw128_kstep_offset(kk, BC)), kk > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {
        const uint64_t dv = wg_desc_add(desc_v, (j & 1) * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++)
            WgmmaBf16<HD>::rs_trans_b(o, p[kk],
                                      wg_desc_add(dv, kk * ATTN_WG_K * ATTN_SW128_ROW_BYTES), 1);
        wgmma_commit();
    };
    // Mask: on tiles reaching right of this CTA's first row (production tests its own 128-row
    // CTA's first row; the masked VALUES are the same: a tile one test skips and the other
    // masks has no key right of any of these rows).
    auto softmax = [&](int j, float (&alpha)[2]) -> bool {
        const int k0 = j * BC;
        if (k0 + BC - 1 > q0) {
#pragma unroll
            for (int i = 0; i < NB_S; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int row = my_row + (e >> 1) * 8;
                    const int key = k0 + i * 8 + (lane & 3) * 2 + (e & 1);
                    if (key > row) s[i][e] = -INFINITY;
                }
        }
        bool max_moved = false;
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < NB_S; i++) mx = fmaxf(mx, fmaxf(s[i][2 * hf], s[i][2 * hf + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_old = row_max[hf];
            const float m_new = fmaxf(m_old, mx * scale_log2);
            max_moved |= m_new != m_old;
            alpha[hf] = m_new == m_old ? 1.0f : fast_exp2(m_old - m_new);
            row_max[hf] = m_new;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < NB_S; i++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const float pr = fast_exp2(fmaf(s[i][2 * hf + e], scale_log2, -m_new));
                    s[i][2 * hf + e] = pr;
                    sum += pr;
                }
            row_sum[hf] = row_sum[hf] * alpha[hf] + sum;
        }
        return max_moved;
    };
    auto convert_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++) acc_to_frag_a(p[kk], s[2 * kk], s[2 * kk + 1]);
    };
    auto rescale_o = [&](const float (&alpha)[2], bool moved) {
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int i = 0; i < NB_O; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) o[i][e] *= alpha[e >> 1];
        }
    };

    // Production's schedule, unchanged (see kernels/attention_wgmma.cuh).
    float alpha[2];
    bool moved;
    ring_advance(0);
    wg_fence_acc(s);
    wgmma_fence();
    issue_s(0);
    wgmma_wait<0>();
    wg_fence_acc(s);
    moved = softmax(0, alpha);
    for (int j = 1; j < n_tiles; j++) {
        wgmma_wait<0>();
        wg_fence_acc(o);
        wg_fence_frag(p);
        ring_advance(j);
        convert_p();
        rescale_o(alpha, moved);
        wg_fence_acc(s);
        wg_fence_acc(o);
        wg_fence_frag(p);
        wgmma_fence();
        issue_s(j);
        issue_pv(j - 1);
        wgmma_wait<1>();
        wg_fence_acc(s);
        moved = softmax(j, alpha);
    }
    wgmma_wait<0>();
    wg_fence_acc(o);
    wg_fence_frag(p);
    ring_advance(n_tiles);
    convert_p();
    rescale_o(alpha, moved);
    wg_fence_acc(o);
    wg_fence_frag(p);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();
    wg_fence_acc(o);

    const int64_t out_stride = (int64_t)H * HD;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float l = row_sum[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = 1.0f / l;
        const int row = my_row + hf * 8;
        if (row < T) {
            bf16* dst = out + ((int64_t)b * T + row) * out_stride + (int64_t)h * HD + (lane & 3) * 2;
#pragma unroll
            for (int i = 0; i < NB_O; i++)
                *reinterpret_cast<uint32_t*>(dst + i * 8) =
                    pack_bf16(o[i][2 * hf] * inv, o[i][2 * hf + 1] * inv);
            if ((lane & 3) == 0)
                lse[((int64_t)b * H + h) * T + row] = (row_max[hf] + log2f(l)) * ATTN_LN2;
        }
    }
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

template <int HD, int BC, bool PACK>
static void attn_gqp_fwd_run(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int KVH,
                             int units_per_section, cudaStream_t stream) {
    constexpr int CTA_ROWS = PACK ? ATTN_GQP_ROWS : ATTN_GQP_PROD_BR;
    constexpr int HPC = PACK ? ATTN_GQP_HEADS : 1;
    const size_t smem = attn_gqp_fwd_smem_bytes<HD, BC>();
    auto kernel = attn_gqp_fwd_kernel<HD, BC, PACK>;
    attention_set_max_smem(kernel, smem);
    const dim3 grid = attn_gqp_grid(units_per_section, B, KVH, H / KVH / HPC,
                                    (T + CTA_ROWS - 1) / CTA_ROWS);
    kernel<<<grid, ATTN_GQP_HEADS * ATTN_WG_THREADS, smem, stream>>>(
        out, lse, qkv, T, H, KVH, attention_scale_log2(HD), units_per_section);
    attention_check(cudaGetLastError());
}

// The lab's ForwardFn: production's contract; bit-identical to attention_forward_wgmma<BC, 2>
// (every row gets the same products in the same order). PACK: head pairs per CTA, which needs
// an even H/KVH: where it is odd, production runs instead. L2: kv-head sections
// (attn_gqp_units_per_section) instead of production's grid order.
template <int BC, bool PACK, bool L2>
static void attention_forward_gqa_pack(void* out, float* lse, const void* qkv, int B, int T,
                                       int H, int KVH, int HD, void* stream) {
    const char* fn = "attention_forward_gqa_pack";
    const int work = attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD);
    if (!attention_wgmma_supports_head_dim(HD)) {
        fprintf(stderr, "attention: %s: head dim %d not supported (supported: 64, 128)\n", fn, HD);
        exit(1);
    }
    if (!attention_wgmma_available()) {
        fprintf(stderr, "attention: %s needs sm_90a device code\n", fn);
        exit(1);
    }
    if (!work) return;
    if (PACK && !attn_gqp_supports_shape(H, KVH, HD)) {  // odd group: no pair shares a kv head
        attention_forward_wgmma<BC, 2>(out, lse, qkv, B, T, H, KVH, HD, stream);
        return;
    }
    constexpr int CTA_ROWS = PACK ? ATTN_GQP_ROWS : ATTN_GQP_PROD_BR;
    const int64_t n_y = (T + CTA_ROWS - 1) / CTA_ROWS;
    if ((!L2 && n_y > 65535) || (L2 && n_y * B * H > 0x7fffffff)) {
        fprintf(stderr, "attention: %s: T = %d too large for the grid\n", fn, T);
        exit(1);
    }
    const int ups = L2 ? attn_gqp_units_per_section(B, T, KVH, HD) : 0;
    bf16* o = static_cast<bf16*>(out);
    const bf16* x = static_cast<const bf16*>(qkv);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (HD == 64)
        attn_gqp_fwd_run<64, BC, PACK>(o, lse, x, B, T, H, KVH, ups, s);
    else
        attn_gqp_fwd_run<128, BC, PACK>(o, lse, x, B, T, H, KVH, ups, s);
}

// ----------------------------------------------------------------------------
// backward, pass 3 (dQ), packed

// Q and dO of the two heads (2 x 64 rows each) + STAGES x (K, V) tiles of BN keys + slack: the
// same bytes as production's dQ CTA of 2 warpgroups.
template <int HD, int BN, int STAGES>
constexpr size_t attn_gqp_dq_smem_bytes() {
    return (size_t)(2 * ATTN_GQP_HEADS * ATTN_GQP_ROWS + 2 * STAGES * BN) * HD * sizeof(bf16) +
           ATTN_SW128_ATOM_BYTES;
}

// CTAs and their order as in the forward (PACK: 64 rows of a head pair, warpgroup w = head
// 2j + w; !PACK: production's 128 rows of one head; attn_gqp_tile). Production's
// attn_bwg_dq_kernel<HD, 2, BN, STAGES> body with the same changes as the forward (two 64-row
// Q and dO tiles with per-warpgroup descriptors, (b, head, q0) from attn_gqp_tile, n_tiles of
// production's 128-row CTA, per-warpgroup head for lse, D and the dQ store when packed).
template <int HD, int BN, int STAGES, bool PACK>
__global__ void __launch_bounds__(ATTN_GQP_HEADS * ATTN_WG_THREADS, 1)
    attn_gqp_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                       const float* D, int T, int H, int KVH, float scale_log2, float scale,
                       int units_per_section) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(BN == 64 || BN == 128, "keys per tile: wgmma N of S (64 or 128 implemented)");
    static_assert(STAGES == 2 || STAGES == 3, "ring slots of the K/V tiles");
#if ATTN_WG_ENABLED
    constexpr int BR = ATTN_GQP_ROWS;       // query rows per warpgroup = per Q / dO tile
    constexpr int CTA_ROWS = PACK ? BR : ATTN_GQP_PROD_BR;
    constexpr int HPC = PACK ? ATTN_GQP_HEADS : 1;
    constexpr int NT = ATTN_WG_THREADS * ATTN_GQP_HEADS;
    constexpr int NB_S = BN / 8;
    constexpr int NB_O = HD / 8;
    constexpr int KS_S = HD / ATTN_WG_K;
    constexpr int KS_O = BN / ATTN_WG_K;
    constexpr uint32_t QH_BYTES = BR * HD * sizeof(bf16);     // one Q (or dO) tile: 64 rows
    constexpr uint32_t KV_BYTES = BN * HD * sizeof(bf16);
    constexpr uint32_t KV_PANEL = BN * ATTN_SW128_ROW_BYTES;
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = 16;
    constexpr uint32_t KSTEP_ROWS_BYTES = ATTN_WG_K * ATTN_SW128_ROW_BYTES;
    constexpr bool LATE_RETIRE = STAGES >= 3;
    static_assert(QH_BYTES % ATOM == 0 && KV_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_gqp_dq_smem[];
    const uint32_t sbase = (smem_u32(attn_gqp_dq_smem) + (ATOM - 1)) & ~(ATOM - 1);
    const uint32_t sQ = sbase;                                 // 2 tiles of (64, HD) SW128
    const uint32_t sdO = sQ + ATTN_GQP_HEADS * QH_BYTES;       // 2 tiles of (64, HD) SW128
    const uint32_t sK = sdO + ATTN_GQP_HEADS * QH_BYTES;       // STAGES x (BN, HD) SW128
    const uint32_t sV = sK + STAGES * KV_BYTES;                // STAGES x (BN, HD) SW128

    const int tid = threadIdx.x, lane = tid & 31;
    const int wg = tid / ATTN_WG_THREADS;
    const int wv = (tid >> 5) & 3;
    const int G = H / KVH;
    const AttnGqpTile tile = attn_gqp_tile(units_per_section, G / HPC, T, KVH, CTA_ROWS);
    const int b = tile.b, q0 = tile.q0;
    const int h0 = tile.slot * HPC;
    const int h = h0 + (PACK ? wg : 0);
    const int kvh = h0 / G;
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const int64_t OS = (int64_t)H * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    // production's tile count for its 128-row CTA holding these rows (see the forward)
    const int q0p = q0 - q0 % ATTN_GQP_PROD_BR;
    const int n_tiles = (min(q0p + ATTN_GQP_PROD_BR, T) - 1) / BN + 1;
    const int my_row = q0 + (PACK ? 0 : wg * BR) + wv * 16 + (lane >> 2);  // e = 0,1; +8: 2,3

    float lse_log2[2], drow[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int q = my_row + hf * 8;
        const int64_t r = ((int64_t)b * H + h) * T + q;
        lse_log2[hf] = q < T ? lse[r] * ATTN_LOG2E : 0.0f;
        drow[hf] = q < T ? D[r] : 0.0f;
    }

    const uint64_t desc_q = wg_desc(sQ + wg * QH_BYTES, KMAJOR_LBO, ATOM);   // A of S
    const uint64_t desc_o = wg_desc(sdO + wg * QH_BYTES, KMAJOR_LBO, ATOM);  // A of dP
    const uint64_t desc_k_kmaj = wg_desc(sK, KMAJOR_LBO, ATOM);  // B of S
    const uint64_t desc_v_kmaj = wg_desc(sV, KMAJOR_LBO, ATOM);  // B of dP
    const uint64_t desc_k_nmaj = wg_desc(sK, KV_PANEL, ATOM);    // B of dQ += dS K

    // tile i: head h0 + i, rows q0.. (packed), or head h0, rows q0 + 64i.. (not packed)
#pragma unroll
    for (int i = 0; i < ATTN_GQP_HEADS; i++) {
        const int hi = h0 + (PACK ? i : 0), ri = q0 + (PACK ? 0 : i * BR);
        sw128_tile_load_async<BR, HD, NT>(sQ + i * QH_BYTES, seq + (int64_t)hi * HD, QKV, ri, T,
                                          tid);
        sw128_tile_load_async<BR, HD, NT>(sdO + i * QH_BYTES,
                                          dout + (int64_t)b * T * OS + (int64_t)hi * HD, OS, ri,
                                          T, tid);
    }
    sw128_tile_load_async<BN, HD, NT>(sK, gK, QKV, 0, T, tid);
    sw128_tile_load_async<BN, HD, NT>(sV, gV, QKV, 0, T, tid);
    cp_async_commit();

    float dq[NB_O][4], s[NB_S][4], dp[NB_S][4];
    uint32_t dsf[KS_O][4];
#pragma unroll
    for (int i = 0; i < NB_O; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[i][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < NB_S; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
    for (int i = 0; i < KS_O; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dsf[i][e] = 0u;

    auto issue_sdp = [&](int slot) {
        const uint64_t bk = wg_desc_add(desc_k_kmaj, slot * KV_BYTES);
        const uint64_t bv = wg_desc_add(desc_v_kmaj, slot * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_S; kk++)
            WgmmaBf16<BN>::ss(s, wg_desc_add(desc_q, sw128_kstep_offset(kk, BR)),
                              wg_desc_add(bk, sw128_kstep_offset(kk, BN)), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < KS_S; kk++)
            WgmmaBf16<BN>::ss(dp, wg_desc_add(desc_o, sw128_kstep_offset(kk, BR)),
                              wg_desc_add(bv, sw128_kstep_offset(kk, BN)), kk > 0);
        wgmma_commit();
    };
    auto issue_dq = [&](int slot) {
        const uint64_t bk = wg_desc_add(desc_k_nmaj, slot * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++)
            WgmmaBf16<HD>::rs_trans_b(dq, dsf[kk], wg_desc_add(bk, kk * KSTEP_ROWS_BYTES), 1);
        wgmma_commit();
    };

    // production's loop, unchanged (do-while: n_tiles >= 1)
    int slot = 0;
    int j = 0;
    do {
        if constexpr (!LATE_RETIRE) {
            wgmma_wait<0>();
            wg_fence_acc(dq);
            wg_fence_frag(dsf);
        }
        cp_async_wait_all();
        fence_proxy_async_shared();
        __syncthreads();
        const int next = slot + 1 == STAGES ? 0 : slot + 1;
        if (j + 1 < n_tiles) {
            sw128_tile_load_async<BN, HD, NT>(sK + next * KV_BYTES, gK, QKV, (j + 1) * BN, T, tid);
            sw128_tile_load_async<BN, HD, NT>(sV + next * KV_BYTES, gV, QKV, (j + 1) * BN, T, tid);
        }
        cp_async_commit();

        wg_fence_acc(s);
        wg_fence_acc(dp);
        wgmma_fence();
        issue_sdp(slot);
        wgmma_wait<1>();
        wg_fence_acc(s);
        wg_fence_acc(dq);
        wg_fence_frag(dsf);

        // P = 2^(S * scale_log2 - lse_log2), 0 where key > row (mask test on this CTA's first
        // row: same values as production's test on its 128-row CTA, see the forward)
        const int k0 = j * BN;
        const bool diag = k0 + BN - 1 > q0;  // CTA-uniform
#pragma unroll
        for (int i = 0; i < NB_S; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(fmaf(s[i][e], scale_log2, -lse_log2[e >> 1]));
                if (diag) {
                    const int row = my_row + (e >> 1) * 8;
                    const int key = k0 + i * 8 + (lane & 3) * 2 + (e & 1);
                    if (key > row) p = 0.0f;
                }
                s[i][e] = p;
            }

        wgmma_wait<0>();
        wg_fence_acc(dp);
#pragma unroll
        for (int i = 0; i < NB_S; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) dp[i][e] = s[i][e] * (dp[i][e] - drow[e >> 1]);
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++) acc_to_frag_a(dsf[kk], dp[2 * kk], dp[2 * kk + 1]);

        wg_fence_frag(dsf);
        wg_fence_acc(dq);
        wgmma_fence();
        issue_dq(slot);
        slot = next;
    } while (++j < n_tiles);
    wgmma_wait<0>();
    wg_fence_acc(dq);
    wg_fence_frag(dsf);

#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int q = my_row + hf * 8;
        if (q >= T) continue;
        bf16* dst = dqkv + ((int64_t)b * T + q) * QKV + (int64_t)h * HD + (lane & 3) * 2;
#pragma unroll
        for (int i = 0; i < NB_O; i++)
            *reinterpret_cast<uint32_t*>(dst + i * 8) =
                pack_bf16(dq[i][2 * hf] * scale, dq[i][2 * hf + 1] * scale);
    }
#else
    __trap();  // built without sm_90a device code: never launched (the host checks first)
#endif
}

// Production's passes 1 and 2 (D; dK/dV with 2 warpgroups, 3 slots, attn_bwg_dkdv_kernel), then
// the packed dQ pass. marks (optional, 2 events): recorded after pass 1 and after pass 2.
template <int HD, int Q_STAGES, bool PACK>
static void attn_gqp_bwd_run(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                             const float* lse, float* D, int B, int T, int H, int KVH,
                             int units_per_section, cudaStream_t stream, cudaEvent_t* marks) {
    const char* fn = "attention_backward_gqa_pack";
    constexpr int KV_NWG = ATTN_WG_BWD_KV_NWG, KV_STAGES = ATTN_WG_BWD_KV_STAGES;
    constexpr int BQ = ATTN_BWG_BQ, BN = ATTN_BWG_BN;
    constexpr int KV_BN = ATTN_WG_ROWS * KV_NWG;
    const float scale = 1.0f / sqrtf((float)HD);
    const float scale_log2 = scale * ATTN_LOG2E;

    const int64_t kv_tiles = (T + KV_BN - 1) / KV_BN;
    constexpr int CTA_ROWS = PACK ? ATTN_GQP_ROWS : ATTN_GQP_PROD_BR;
    constexpr int HPC = PACK ? ATTN_GQP_HEADS : 1;
    const int64_t q_tiles = (T + CTA_ROWS - 1) / CTA_ROWS;
    if (kv_tiles > 65535 || (units_per_section == 0 && q_tiles > 65535) ||
        q_tiles * B * H > 0x7fffffff) {
        fprintf(stderr, "attention: %s: B*T*H = %lld or T = %d too large\n", fn,
                (long long)B * T * H, T);
        exit(1);
    }
    attention_backward_dot<HD>(D, dout, out, B, T, H, fn, stream);
    if (marks) attention_check(cudaEventRecord(marks[0], stream));
    {
        const size_t smem = attn_bwg_dkdv_smem_bytes<HD, KV_NWG, BQ, KV_STAGES>();
        auto kernel = attn_bwg_dkdv_kernel<HD, KV_NWG, BQ, KV_STAGES>;
        attention_set_max_smem(kernel, smem);
        kernel<<<attention_grid(B, T, KVH, KV_BN), KV_NWG * ATTN_WG_THREADS, smem, stream>>>(dqkv, dout, qkv, lse, D, T, H,
                                                                 KVH, scale_log2, scale);
        attention_check(cudaGetLastError());
    }
    if (marks) attention_check(cudaEventRecord(marks[1], stream));
    {
        const size_t smem = attn_gqp_dq_smem_bytes<HD, BN, Q_STAGES>();
        auto kernel = attn_gqp_dq_kernel<HD, BN, Q_STAGES, PACK>;
        attention_set_max_smem(kernel, smem);
        const dim3 grid = attn_gqp_grid(units_per_section, B, KVH, H / KVH / HPC, (int)q_tiles);
        kernel<<<grid, ATTN_GQP_HEADS * ATTN_WG_THREADS, smem, stream>>>(
            dqkv, dout, qkv, lse, D, T, H, KVH, scale_log2, scale, units_per_section);
        attention_check(cudaGetLastError());
    }
}

// Same contract and workspace as attention_backward_bf16; HD 64 and 128; sm_90a. dQ bit-identical
// to production's (same products per row, same order), dK, dV and D by production's kernels.
// PACK needs an even H/KVH: where it is odd, production's wgmma backward runs (marks included).
// L2: the dQ pass in kv-head sections.
template <int Q_STAGES, bool PACK, bool L2>
static void attention_backward_gqa_pack_timed(void* dqkv, const void* dout, const void* qkv,
                                              const void* out, const float* lse, void* workspace,
                                              int B, int T, int H, int KVH, int HD, void* stream,
                                              cudaEvent_t* marks) {
    const char* fn = "attention_backward_gqa_pack";
    if (!attention_wgmma_supports_head_dim(HD) || (PACK && !attn_gqp_supports_shape(H, KVH, HD))) {
        attention_backward_wgmma_timed<ATTN_WG_BWD_KV_NWG, ATTN_WG_BWD_KV_STAGES,
                                       ATTN_WG_BWD_Q_NWG, ATTN_WG_BWD_Q_STAGES>(
            dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD, stream, marks);
        return;
    }
    if (!attention_wgmma_available()) {
        fprintf(stderr, "attention: %s needs sm_90a device code\n", fn);
        exit(1);
    }
    if (!attention_backward_check(fn, dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD))
        return;
    const int ups = L2 ? attn_gqp_units_per_section(B, T, KVH, HD) : 0;
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    float* D = static_cast<float*>(workspace);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (HD == 64)
        attn_gqp_bwd_run<64, Q_STAGES, PACK>(dx, dy, x, y, lse, D, B, T, H, KVH, ups, s, marks);
    else
        attn_gqp_bwd_run<128, Q_STAGES, PACK>(dx, dy, x, y, lse, D, B, T, H, KVH, ups, s, marks);
}

// The lab's BackwardFn signature.
template <int Q_STAGES, bool PACK, bool L2>
static void attention_backward_gqa_pack(void* dqkv, const void* dout, const void* qkv,
                                        const void* out, const float* lse, void* workspace, int B,
                                        int T, int H, int KVH, int HD, void* stream) {
    attention_backward_gqa_pack_timed<Q_STAGES, PACK, L2>(dqkv, dout, qkv, out, lse, workspace, B,
                                                          T, H, KVH, HD, stream, nullptr);
}

#endif  // DEV_CUDA_ATTENTION_GQA_PACK_CUH
