/*
 * dev/cuda/attention_fwd_wgmma2.cuh — LAB variants of the causal GQA flash-attention FORWARD on
 * Hopper wgmma (sm_90a): kernels/attention_wgmma.cuh ("production", lab variant 7 "wgmma bc128
 * wg2") with a warp-specialised pipeline: a PRODUCER WARPGROUP feeds K/V tiles through
 * mbarrier rings to two CONSUMER WARPGROUPS, which no longer meet at a CTA-wide barrier per kv
 * tile and (optionally) PING-PONG their tensor-core work with named barriers (FA3's scheme).
 * Same contract as attention_forward_bf16: out (B,T,H*HD) bf16, lse (B,H,T) fp32 natural log,
 * GQA without K/V copies, causal, rows past T zero-filled and never stored, 64-bit offsets, HD
 * 64 and 128, deterministic. The arithmetic is production's, operation for operation (same
 * tiles, same wgmma k-step order, same softmax code, same rescale points): the outputs must be
 * BIT-IDENTICAL to variant 7, and the lab checks exactly that (every validation case, and whole
 * tensors on the big case) — the strongest test of the new synchronisation.
 *
 * STATUS: written without a GPU (session 7), compiled only (nvcc 13, sm_90a): NOT YET RUN.
 * Protocol checked on the CPU: dev/cuda/attention_fwd_wgmma2_model.py (random interleavings;
 * below). Checklist at the end of this header; one-call script dev/cuda/check_fwd_wgmma2.sh.
 *
 *   lab forward variant          <SK, SV, PP, WF>  shared memory (HD=128 / 64)
 *    9 "wgmma2 ws pp k3v3"        3, 3, yes, no     230,528 / 115,840 bytes   (the candidate)
 *   10 "wgmma2 ws k3v3"           3, 3, no,  no     230,528 / 115,840         (9 minus ping-pong)
 *   11 "wgmma2 ws pp k2v2"        2, 2, yes, no     164,992 /  83,072         (ring depth)
 *   12 "wgmma2 ws pp k3v3 wf"     3, 3, yes, yes    230,528 / 115,840         (proxy fallback)
 *   SK/SV: stages of the K and V rings (BC = 128 keys each); PP: ping-pong; WF: writer-side
 *   proxy fence (production's discipline) instead of cp.async.mbarrier.arrive (below).
 *
 * =============================================================================================
 * Why (the model behind the change)
 *   Per CTA and kv tile (HD=128, BC=128, 2 warpgroups of 64 rows): tensor work 2 x (S: 8 x
 *   m64n128k16 + P V: 8 x m64n128k16) = 32 x 64 clk = 2048 clk at 4096 FLOP/clk/SM; softmax per
 *   warpgroup 8192 ex2 (MUFU 16/clk/SM: 512 clk alone) plus ~4 FP32 ops per element, the
 *   rescale and the conversion: ~700-1000 clk. Production measures 538 TFLOP/s at T=16384,
 *   i.e. ~3770 clk per 2048-clk tile (54% of the 990 TFLOP/s dense peak). Its per-tile
 *   __syncthreads (the cp.async ring needs it) keeps the warpgroups in lockstep: both issue S_j
 *   and P_{j-1} V_{j-1} together, both wait for S_j, then BOTH run the softmax at once (sharing
 *   MUFU: ~1024 clk for the two) while the tensor pipe holds only the two P V products
 *   (1024 clk); then the slower one's softmax, the barrier, and the issue latency leave the
 *   pipe empty every tile.
 *   Here the loop has no CTA-wide barrier. The warpgroups wait only for their data (mbarriers)
 *   and, with PP, for their turn to ISSUE: warpgroup 0 issues S_j, P_{j-1} V_{j-1}; then
 *   warpgroup 1 issues its pair; then warpgroup 0 again. Steady state: while warpgroup 1's 1024
 *   clk of products run, warpgroup 0 does its softmax (alone on MUFU) and queues its next
 *   products behind them, and vice versa, so the tensor pipe always has queued work and the
 *   step approaches the 2048-clk tensor time plus issue overheads (FA3, with this scheme and
 *   TMA, reports roughly 600-650 TFLOP/s causal HD=128 at long sequences on H100). Loads move
 *   to a dedicated warpgroup (production's consumers issued 16 LDGSTS per thread per tile).
 *   Expected: +10-25% over variant 7 at T >= 4096 if the tensor pipe was the idle resource;
 *   variant 10 (no PP) vs 9 says what the ping-pong itself buys, 11 vs 9 what the deeper rings
 *   buy.
 *   Idea "heavy-first scheduling" is ALREADY production's (and these variants'): the grid is
 *   x = h + H*b (fastest), y = query tile with q0 = (gridDim.y - 1 - blockIdx.y) * 128, so
 *   CTAs are dispatched longest-first across all heads and batches; nothing to gain there.
 *   Not done: TMA (needs host-side tensor maps through the driver entry point: more risk
 *   without a GPU; the cp.async producer is FA3's PagedKV / PackGQA path); S with Q in
 *   registers (64 more registers: 184 + 64 > 240).
 *
 * ---------------------------------------------------------------------------------------------
 * Roles and registers
 *   CTA of 384 threads = 3 warpgroups, one per (128 query rows, query head, batch), grid and
 *   tile order as production. Warpgroups 0 and 1 (threads 0..255) are production's consumers
 *   (64 query rows each); warpgroup 2 (threads 256..383) is the producer.
 *   Why a whole producer warpgroup: the register file is split across the 4 SM sub-partitions
 *   (16384 registers each) and warp w runs on sub-partition w % 4, so with 288 threads (one
 *   producer warp) sub-partition 0 holds 3 warps and ptxas caps every thread at 168 registers:
 *   that build spilled 240 bytes and serialised the wgmmas (C7512). With 384 threads and
 *   setmaxnreg (sm_90a), the producer gives registers back (setmaxnreg.dec 24) and the
 *   consumers take them (setmaxnreg.inc 240): per sub-partition 240 + 240 + 24 = 504 <= 512
 *   registers per lane, the CTA's pool exactly (12 warps x 168 = 8 x 240 + 4 x 24). ptxas
 *   compiles each branch for its budget: "Used 168 registers" is the launch value; the SASS
 *   shows the consumer code using R0..R183, the producer code (after USETMAXREG.DEALLOC 0x18)
 *   R0..R19. The consumer's USETMAXREG.TRY_ALLOC retries until the producer has deallocated.
 *
 * Shared memory (1024-aligned base): Q (128 x HD, SW128) | SK K stages | SV V stages (128 x HD
 *   each, SW128) | 1 + 2 SK + 2 SV mbarriers (8 bytes each): full_q; full_k[s], empty_k[s];
 *   full_v[s], empty_v[s]. Layouts, descriptors and fragments are production's, unchanged (only
 *   the stage of tile j is j % SK, j % SV instead of j & 1). 232,448 bytes is the opt-in limit.
 *
 * Producer warpgroup (setmaxnreg.dec 24): copies Q (production's sw128_tile_load_async, 128
 *   threads: 16 cp.async of 16 bytes per thread per tile at HD=128), then K_0, then for t = 0 ..
 *   n_tiles-1: K_{t+1} (if any), V_t — production's ring order. Tile u goes to stage s = u % S;
 *   for u >= S it first waits for completion number u/S - 1 of empty[s] (try_wait.parity with
 *   parity ((u/S) & 1) ^ 1): both warpgroups have retired every wgmma that read tile u - S.
 *   Publication (the full barrier, 128 expected arrivals = one per producer thread):
 *    WF = false: each thread's cp.async.mbarrier.arrive.noinc after its copies of the tile: the
 *      hardware arrives once every cp.async the thread issued so far has landed. The consumer
 *      executes fence.proxy.async after its try_wait (acquire) and before the wgmma (see risk 2).
 *    WF = true: production's discipline, writer side: each copy is one cp.async group; after
 *      issuing copy n, every producer thread waits for its copy n-1 (cp.async.wait_group 1),
 *      executes fence.proxy.async and arrives (mbarrier.arrive: release) on copy n-1's full
 *      barrier; the last copy after wait_group 0. Consumers need no fence.
 *   The producer exits after a final commit + wait_group 0 (no copy left in flight).
 *
 * Consumer warpgroup w (setmaxnreg.inc 240), production's schedule with the ring replaced:
 *   tile 0:  wait full_q, full_k[0]; [fence]; [PP: bar.sync 1+w]; issue S_0; [PP: bar.arrive
 *            2-w]; wait_group 0; release K_0; softmax(S_0)
 *   step j = 1 .. n_tiles-1:
 *            wait_group 0            P_{j-2} V_{j-2} retired -> release V_{j-2} (j >= 2)
 *            p = bf16(P_{j-1}); O *= alpha_{j-1}
 *            wait full_k[j % SK] (parity (j/SK)&1), full_v[(j-1) % SV] (parity ((j-1)/SV)&1)
 *            [fence.proxy.async]; [PP: bar.sync 1+w]
 *            issue S_j; issue O += P_{j-1} V_{j-1}; [PP: bar.arrive 2-w]
 *            wait_group 1            S_j retired -> release K_j
 *            softmax(S_j)
 *   tail:    wait_group 0 -> release V_{n-2}; convert, rescale; wait full_v[(n-1) % SV];
 *            [fence]; [PP: turn]; issue P_{n-1} V_{n-1}; [PP]; wait_group 0;
 *            [PP: warpgroup 0 bar.sync 1: consumes warpgroup 1's last arrival]; epilogue
 *   A release is one mbarrier.arrive (release) per warp by lane 0 (predicated, no branch) after
 *   the warp's wgmma.wait_group: empty barriers expect 8 arrivals (4 warps x 2 warpgroups).
 *   Every warp must arrive because each warp's slice of a wgmma reads all of B (K or V).
 *   The retiring wait_group 0 sits at the top of the next step, as in production (ptxas hoists
 *   a WARPGROUP.DEPBAR to the start of its basic block; the back edge keeps it after the
 *   softmax). SASS of the loop (HD=128, PP): DEPBAR.LE gsb0 0x0 | SYNCS.ARRIVE (V) | convert,
 *   rescale | 2 x SYNCS.PHASECHK.TRYWAIT (out-of-line retry) | MEMBAR + FENCE.VIEW.ASYNC.S |
 *   BAR.SYNC R, 0x100 | WARPGROUP.ARRIVE | 8 HGMMA 64x128x16 (S) | 8 HGMMA ...tnspB (P V) |
 *   BAR.ARV R, 0x100 | DEPBAR.LE gsb0 0x1 | SYNCS.ARRIVE (K) | mask | 66 MUFU.EX2 | back edge.
 *
 * Ping-pong (PP): named barriers 1 and 2, 256 threads (the producer never joins; barrier 0 =
 *   __syncthreads is used once, after the mbarrier init). Warpgroup w syncs on 1 + w before
 *   each issue phase and arrives on 2 - w after it; warpgroup 1 arrives on 1 once before its
 *   first phase, so warpgroup 0 issues first; both run n_tiles + 1 issue phases (tile 0, the
 *   n_tiles - 1 steps, the tail), so warpgroup 1 arrives n + 2 times on barrier 1 and warpgroup
 *   0 syncs n + 1 times in the loop plus once after it: nothing is left half-complete. Issue
 *   phases strictly alternate 0, 1, 0, 1, ...; a warpgroup never arrives twice in one barrier
 *   generation (its next arrival on 2 - w follows its own bar.sync on 1 + w, which needs the
 *   other warpgroup's arrival after that one's own sync). The barrier id is a register (ptxas
 *   reserves all 16 barriers: one CTA per SM anyway).
 *
 * Deadlock freedom (the model below checks it exhaustively-at-random): the producer's loads are
 *   in a fixed order K_0, K_1, V_0, K_2, V_1, ...; the release a load waits for (K_u: S_{u-SK}
 *   retired; V_u: P_{u-SV} V_{u-SV} retired, i.e. step u-SV+2 begun) needs only tiles loaded
 *   EARLIER in that order (for SK, SV >= 2), in both warpgroups; the ping-pong only orders issue
 *   phases whose data both warpgroups wait for identically. With WF the newest copy is still
 *   unpublished while the producer blocks on an empty barrier, and no release depends on it
 *   (K_{t+1} is not needed before step t+1, V_t not before step t+1). Phases cannot alias: a
 *   full barrier's next phase needs the producer past the empty barrier that the consumers of
 *   the current phase release, and conversely.
 *
 * Cross-proxy visibility (the one new memory-model argument). cp.async writes shared memory
 *   through the generic proxy, wgmma reads it through the async proxy. Production: each writer
 *   waits for its copies (wait_group), fence.proxy.async, then __syncthreads. WF = true keeps
 *   exactly that, with mbarrier.arrive (release) / try_wait (acquire) in place of the barrier.
 *   WF = false relies on what CUTLASS's cp.async GMMA mainloops and FA3's cp.async paths do
 *   (cp.async.mbarrier.arrive, consumer wait, wgmma, no fence at all), plus a consumer-side
 *   fence.proxy.async after the acquire as a margin. Async-proxy reads followed by generic
 *   writes (a stage refilled): the wgmma's completion, observed by wait_group before the
 *   release, "is followed by an implicit generic-async proxy fence" (PTX ISA, async proxy), so
 *   the release/acquire chain orders the reads before the new copies.
 *
 * ---------------------------------------------------------------------------------------------
 * ptxas (nvcc 13.0, sm_90a, dev/cuda/run_attention.sh --build-only), all 8 instantiations
 *   (HD 64/128 x variants 9-12): "Used 168 registers" (launch value), 0 bytes spilled, 0 stack,
 *   no C75xx line in the whole log; "used 16 barriers" with PP, 1 without. SASS (cuobjdump of
 *   .devbuild/attention): consumers R0..R183 at HD=128 (production: 218 registers), R0..R151
 *   at HD=64; producers R0..R19 (<= 24). 32 HGMMA at HD=128 (8 S tile 0, 8 + 8 loop, 8 tail).
 *   (This build machine's toolkit has no cuobjdump; a CUDA 13 cuobjdump + nvdisasm was used.
 *   On the device machine: cuobjdump -sass .devbuild/attention, functions _Z15attn_fw2_kernel*.)
 *
 * CPU model: python3 dev/cuda/attention_fwd_wgmma2_model.py — the producer and both consumers
 *   as their program order, cp.async landings and wgmma completions at random moments, exact
 *   mbarrier phase/parity semantics, named-barrier generations: 21,600 runs (rings (2,2),
 *   (2,3), (3,3), (3,2); PP and WF on/off; 1..9 tiles), no deadlock, every S_j / P V_j reads
 *   its tile landed, no copy into a stage a running wgmma reads, no phase mixing, alternation
 *   under PP, nothing half-complete at exit. Seeded bugs (no pre-loop arrive, no post-loop
 *   sync, wrong empty parity, V released one step early, WF publishing without waiting) are
 *   all caught.
 *
 * ---------------------------------------------------------------------------------------------
 * Risks, most likely first, and how to read a failure (the lab prints out/lse errors, "NOT
 * DETERMINISTIC", and "NOT BIT-IDENTICAL to wgmma bc128 wg2 (N out, M lse elements differ)"):
 *  1. A hang (the check script runs each variant under `timeout`: status 124). All four hang ->
 *     something common: setmaxnreg (a consumer's TRY_ALLOC spinning: the CTA's pool must be
 *     exactly 12 x 168 x 32; a different ptxas/driver launch register count breaks the
 *     arithmetic) or the mbarrier counts. 9/10/11 hang, 12 not -> the full barriers never
 *     complete with cp.async.mbarrier.arrive.noinc (count 128 = one per producer thread).
 *     9/11/12 hang, 10 not -> the ping-pong protocol (ids 1/2, count 256, the pre-loop arrive
 *     and the post-loop sync). compute-sanitizer --tool synccheck names barrier misuse.
 *  2. Wrong or non-deterministic results / bit differences in 9-11 but not 12, growing with T
 *     (multi-tile cases, the big case): the cp.async -> wgmma visibility without a writer-side
 *     fence. Take 12's publication (WF) for the others (its cost: the producer waits for each
 *     copy before publishing it; the 3-stage rings leave ~1.5-2 tiles of slack for that).
 *  3. CUDA error at launch in 9, 10, 12 but not 11: 230,528 bytes of shared memory above the
 *     device's opt-in limit (the lab prints "KB shared per block max"): use k2v2 (164,992) or a
 *     <3, 2> ring (197,760).
 *  4. All four wrong but production right: at T <= 128 (one tile) -> the producer's copies with
 *     128 threads (sw128_tile_load_async<.., 128>: RSTEP 8 at HD=128, 16 at HD=64; validated
 *     only with 256 threads before) or the Q barrier; only for T > 128 (and only from the 4th
 *     tile for k3v3: T > 384) -> ring stage/parity indices (j % S, (j / S) & 1); only HD=64 ->
 *     the copy mapping at HD=64. Only rows past the diagonal -> the mask (production's code).
 *  5. Slower than variant 7: look at 10 vs 9 (ping-pong), 11 vs 9 (ring depth: producer
 *     latency), 12 vs 9 (writer- vs consumer-side fence), and the --long row (T=65536 B=1).
 *     Knobs next: release V right after its P V retires in the step (needs the wait inside the
 *     step, which ptxas may hoist), drop the consumer-side fence (FA3 has none), 3 stages of V
 *     and 2 of K (197,760 bytes) to free shared memory for an O staging tile (coalesced
 *     stores), TMA for K/V.
 *  6. A different ptxas on the device (C75xx lines, spills): the consumer budget has 56
 *     registers of headroom (184 of 240), so a few more are harmless.
 *
 * ---------------------------------------------------------------------------------------------
 * Checklist on the H200 (one device call: `bash dev/cuda/check_fwd_wgmma2.sh`, ~5-9 minutes;
 * it does the following, logs in $OUT):
 *  0. dev/cuda/run_attention.sh --build-only; grep -c C75 .devbuild/attention_ptxas.txt (0);
 *     attn_fw2_kernel: 0 bytes spilled in all 8 instantiations.
 *  1. per variant, tiny cases, under timeout (a hang costs 60 s, not the call):
 *     timeout 60 .devbuild/attention --tiny --no-big --no-bench --bwd -2 --fwd 9   (10, 11, 12)
 *  2. full lab for production and the variants that terminated:
 *     dev/cuda/run_attention.sh --fwd 7,9,10,11,12 --bwd -2 --long
 *     -> validation (163 cases, twice each, "bit-identical to wgmma bc128 wg2 in N/N cases"),
 *        big case (B=3 T=131072 H=32 KVH=8: sampled rows vs fp64 and whole tensors bit for bit
 *        vs the C interface), benchmark T=2048 B=16 / 4096 B=4 / 16384 B=2 / 65536 B=1, HD=128
 *        H=16 KVH=8 (variant 7 measured 398 / 459 / 538 at the first three).
 *  3. compute-sanitizer --tool memcheck|synccheck|racecheck .devbuild/attention
 *     --shape 1,1000,2,1,128 --no-big --no-bench --bwd -2 --fwd 9,10,11,12 --log /dev/null
 *     (T=1000: 8 kv tiles, every stage of a 3-stage ring reused). racecheck does not see
 *     wgmma's async-proxy reads; step 2's bit-identity checks cover those.
 *  Then: if 9 (or 12) passes and is faster, the C interface can take it (kernels/attention.cu,
 *  "the C interface": attention_forward_wgmma_hd -> this kernel), and the backward reads the
 *  same lse bits (identical to production's).
 * =============================================================================================
 */
#ifndef DEV_CUDA_ATTENTION_FWD_WGMMA2_CUH
#define DEV_CUDA_ATTENTION_FWD_WGMMA2_CUH

#include "../../kernels/attention_wgmma.cuh"  // (already included by kernels/attention.cu)

#define ATTN_FW2_NWG 2                                      // consumer warpgroups per CTA
#define ATTN_FW2_BC 128                                     // keys per K/V tile
#define ATTN_FW2_CONSUMERS (ATTN_FW2_NWG * ATTN_WG_THREADS) // 256 consumer threads
#define ATTN_FW2_PRODUCERS ATTN_WG_THREADS                  // warpgroup 2: the producer
#define ATTN_FW2_THREADS (ATTN_FW2_CONSUMERS + ATTN_FW2_PRODUCERS)  // 384 threads per CTA
#define ATTN_FW2_MBAR_BYTES 128                             // room for the mbarriers (<= 16)
// Registers per thread after setmaxnreg: per SM sub-partition (16384 registers, one warp of each
// warpgroup) 2 * 240 + 24 = 504 <= 512 registers per lane. The launch itself gets
// 65536 / 384 = 168 (what ptxas reports as "Used 168 registers").
#define ATTN_FW2_CONSUMER_REGS 240
#define ATTN_FW2_PRODUCER_REGS 24

// ----------------------------------------------------------------------------
// device helpers (sm_90a): mbarriers, named barriers

// mbarrier at shared address `bar` expecting `count` arrivals per phase.
__device__ __forceinline__ void fw2_mbar_init(uint32_t bar, uint32_t count) {
#if ATTN_WG_ENABLED
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Make the initialised mbarriers visible (to the async arrivals of cp.async as well).
__device__ __forceinline__ void fw2_mbar_init_fence() {
#if ATTN_WG_ENABLED
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// Block until the phase of parity `parity` of the mbarrier has completed (acquire, CTA scope).
// The loop lives inside one asm statement (PTX scopes the labels to the braces), so the
// compiler sees straight-line code.
__device__ __forceinline__ void fw2_mbar_wait(uint32_t bar, uint32_t parity) {
#if ATTN_WG_ENABLED
    asm volatile(
        "{\n.reg .pred P1;\n"
        "FW2_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra FW2_DONE;\n"
        "bra FW2_WAIT;\n"
        "FW2_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}
// Arrive (release, CTA scope) on the mbarrier when pred holds; predicated, no branch.
__device__ __forceinline__ void fw2_mbar_arrive_if(uint32_t bar, bool pred) {
#if ATTN_WG_ENABLED
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 st;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar),
        "r"((int)pred)
        : "memory");
#endif
}
// One arrival on the mbarrier once every cp.async this thread issued so far has completed
// (.noinc: the arrival is one of the `count` the barrier was initialised with).
__device__ __forceinline__ void fw2_cp_async_arrive(uint32_t bar) {
#if ATTN_WG_ENABLED
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}
// Wait until at most N of this thread's committed cp.async groups are pending.
template <int N>
__device__ __forceinline__ void fw2_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Hand registers back to / take them from the SM's pool (whole warpgroup, sm_90a).
template <int N>
__device__ __forceinline__ void fw2_setmaxnreg_dec() {
#if ATTN_WG_ENABLED
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void fw2_setmaxnreg_inc() {
#if ATTN_WG_ENABLED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
// Named barriers of the two consumer warpgroups (256 threads; id 0 is __syncthreads).
__device__ __forceinline__ void fw2_bar_sync(uint32_t id) {
#if ATTN_WG_ENABLED
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(ATTN_FW2_CONSUMERS) : "memory");
#endif
}
__device__ __forceinline__ void fw2_bar_arrive(uint32_t id) {
#if ATTN_WG_ENABLED
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(ATTN_FW2_CONSUMERS) : "memory");
#endif
}

// ----------------------------------------------------------------------------
// forward kernel

template <int HD, int SK, int SV>
constexpr size_t attn_fw2_smem_bytes() {
    return (size_t)(ATTN_WG_ROWS * ATTN_FW2_NWG + (SK + SV) * ATTN_FW2_BC) * HD * sizeof(bf16) +
           ATTN_SW128_ATOM_BYTES + ATTN_FW2_MBAR_BYTES;
}

template <int HD, int SK, int SV, bool PP, bool WF>
__global__ void __launch_bounds__(ATTN_FW2_THREADS, 1)
    attn_fw2_kernel(bf16* out, float* lse, const bf16* qkv, int T, int H, int KVH,
                    float scale_log2) {
    static_assert(HD == 64 || HD == 128, "head dim: one or two 64-column swizzle panels");
    static_assert(SK >= 2 && SV >= 2, "ring stages (see the deadlock argument in the header)");
    static_assert(1 + 2 * SK + 2 * SV <= ATTN_FW2_MBAR_BYTES / 8, "mbarrier room");
#if ATTN_WG_ENABLED
    constexpr int BC = ATTN_FW2_BC;
    constexpr int BR = ATTN_WG_ROWS * ATTN_FW2_NWG;  // 128 query rows per CTA
    constexpr int NB_S = BC / 8;                     // 8-column blocks of the S accumulator
    constexpr int NB_O = HD / 8;                     // of the O accumulator
    constexpr int KS_S = HD / ATTN_WG_K;             // k-steps of S = Q K^T
    constexpr int KS_O = BC / ATTN_WG_K;             // k-steps of O += P V
    constexpr uint32_t Q_BYTES = BR * HD * sizeof(bf16);
    constexpr uint32_t KV_BYTES = BC * HD * sizeof(bf16);     // one stage of K or of V
    constexpr uint32_t KV_PANEL = BC * ATTN_SW128_ROW_BYTES;  // 64 hd columns of a K/V stage
    constexpr uint32_t ATOM = ATTN_SW128_ATOM_BYTES;
    constexpr uint32_t KMAJOR_LBO = 16;  // unused by swizzled K-major layouts; encodes as 1
    static_assert(Q_BYTES % ATOM == 0 && KV_BYTES % ATOM == 0, "regions stay atom-aligned");

    extern __shared__ __align__(1024) unsigned char attn_fw2_smem[];
    const uint32_t sbase = (smem_u32(attn_fw2_smem) + (ATOM - 1)) & ~(ATOM - 1);
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
    const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;  // longest rows first, as production
    const int kvh = h / (H / KVH);
    const int64_t QKV = (int64_t)(H + 2 * KVH) * HD;
    const bf16* seq = qkv + (int64_t)b * T * QKV;
    const bf16* gQ = seq + (int64_t)h * HD;
    const bf16* gK = seq + (int64_t)(H + kvh) * HD;
    const bf16* gV = seq + (int64_t)(H + KVH + kvh) * HD;
    // kv tiles holding keys <= the CTA's last query (< T); both warpgroups walk all of them
    // (production's reasoning: the wgmma control flow stays CTA-uniform)
    const int n_tiles = (min(q0 + BR, T) - 1) / BC + 1;

    if (tid == 0) {
        // full barriers: one arrival per producer thread (its cp.async.mbarrier.arrive.noinc,
        // or with WF its release-arrive after wait_group + fence)
        fw2_mbar_init(bar_q, ATTN_FW2_PRODUCERS);
        for (int s = 0; s < SK; s++) {
            fw2_mbar_init(bar_full_k + 8 * s, ATTN_FW2_PRODUCERS);        // producer threads
            fw2_mbar_init(bar_empty_k + 8 * s, ATTN_FW2_CONSUMERS / 32);  // consumer warps
        }
        for (int s = 0; s < SV; s++) {
            fw2_mbar_init(bar_full_v + 8 * s, ATTN_FW2_PRODUCERS);
            fw2_mbar_init(bar_empty_v + 8 * s, ATTN_FW2_CONSUMERS / 32);
        }
        fw2_mbar_init_fence();
    }
    __syncthreads();  // the only CTA-wide barrier

    if (wg == ATTN_FW2_NWG) {
        // ---------------- producer warpgroup: Q, K_0, then K_{t+1}, V_t, t = 0 .. n_tiles-1 ----
        // Loading tile u into stage u % S waits until both warpgroups released tile u - S of
        // that stage (completion u/S - 1 of its empty barrier: parity ((u/S) & 1) ^ 1); the
        // first S tiles of a ring need no wait. Each lane's cp.async.mbarrier.arrive.noinc
        // arrives on the stage's full barrier once all its copies so far have landed. The
        // copies are production's (sw128_tile_load_async over the 128 producer threads).
        // WF (writer-side fence, production's proxy discipline): each copy is one cp.async
        // group; after issuing copy n, every producer thread waits for its copy n-1
        // (wait_group 1), executes fence.proxy.async and arrives (release) on copy n-1's full
        // barrier. The newest copy stays unpublished while the producer blocks on an empty
        // barrier; the consumers never need it to release that stage (header, "deadlock").
        fw2_setmaxnreg_dec<ATTN_FW2_PRODUCER_REGS>();
        const int ptid = tid - ATTN_FW2_CONSUMERS;
        uint32_t unpublished = bar_q;  // WF: full barrier of the newest copy
        auto publish = [&](uint32_t bar) {
            if (WF) {
                cp_async_commit();
                fw2_cp_async_wait<1>();  // this thread's previous copy has landed
                fence_proxy_async_shared();
                fw2_mbar_arrive_if(unpublished, true);
                unpublished = bar;
            } else {
                fw2_cp_async_arrive(bar);
            }
        };
        sw128_tile_load_async<BR, HD, ATTN_FW2_PRODUCERS>(sQ, gQ, QKV, q0, T, ptid);
        if (!WF) fw2_cp_async_arrive(bar_q);
        if (WF) cp_async_commit();
        auto load_k = [&](int u) {
            const int s = u % SK;
            if (u >= SK) fw2_mbar_wait(bar_empty_k + 8 * s, ((u / SK) & 1) ^ 1);
            sw128_tile_load_async<BC, HD, ATTN_FW2_PRODUCERS>(sK + s * KV_BYTES, gK, QKV, u * BC,
                                                              T, ptid);
            publish(bar_full_k + 8 * s);
        };
        auto load_v = [&](int u) {
            const int s = u % SV;
            if (u >= SV) fw2_mbar_wait(bar_empty_v + 8 * s, ((u / SV) & 1) ^ 1);
            sw128_tile_load_async<BC, HD, ATTN_FW2_PRODUCERS>(sV + s * KV_BYTES, gV, QKV, u * BC,
                                                              T, ptid);
            publish(bar_full_v + 8 * s);
        };
        load_k(0);
        for (int t = 0; t < n_tiles; t++) {
            if (t + 1 < n_tiles) load_k(t + 1);
            load_v(t);
        }
        cp_async_commit();    // (without WF the copies are in no group: wait_group sees groups)
        cp_async_wait_all();  // every copy landed: leave none in flight behind an exited warp
        if (WF) {
            fence_proxy_async_shared();
            fw2_mbar_arrive_if(unpublished, true);  // the last copy (V_{n_tiles-1})
        }
        return;
    }

    // ---------------- consumer warpgroups ----------------------------------------------------
    fw2_setmaxnreg_inc<ATTN_FW2_CONSUMER_REGS>();
    const int wv = warp & 3;  // warp inside the warpgroup: rows 16wv..16wv+15
    const int wq0 = q0 + wg * ATTN_WG_ROWS;
    const int my_row = wq0 + wv * 16 + (lane >> 2);  // rows my_row (e = 0, 1) and my_row + 8
    const bool releaser = lane == 0;                 // one arrival per warp on empty barriers

    const uint64_t desc_q =
        wg_desc(sQ + wg * ATTN_WG_ROWS * ATTN_SW128_ROW_BYTES, KMAJOR_LBO, ATOM);
    const uint64_t desc_k = wg_desc(sK, KMAJOR_LBO, ATOM);
    const uint64_t desc_v = wg_desc(sV, KV_PANEL, ATOM);

    float o[NB_O][4], s[NB_S][4];
    uint32_t p[KS_O][4];
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
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

    // Ping-pong (PP): named barrier 1 + w = "warpgroup w may issue". Warpgroup w syncs on it
    // before each issue phase and arrives on 2 - w after; warpgroup 1 arrives on barrier 1 once
    // up front, so warpgroup 0 issues first; after the last phase warpgroup 0 consumes warpgroup
    // 1's last arrival (no barrier is left half-complete).
    const uint32_t my_turn = 1 + wg, other_turn = 2 - wg;
    if (PP && wg == 1) fw2_bar_arrive(1);

    // the steps, production's code (attention_wgmma.cuh) with the ring's stage indices
    auto issue_s = [&](int j) {
        const uint64_t dk = wg_desc_add(desc_k, (j % SK) * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_S; kk++)
            WgmmaBf16<BC>::ss(s, wg_desc_add(desc_q, sw128_kstep_offset(kk, BR)),
                              wg_desc_add(dk, sw128_kstep_offset(kk, BC)), kk > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {
        const uint64_t dv = wg_desc_add(desc_v, (j % SV) * KV_BYTES);
#pragma unroll
        for (int kk = 0; kk < KS_O; kk++)
            WgmmaBf16<HD>::rs_trans_b(o, p[kk],
                                      wg_desc_add(dv, kk * ATTN_WG_K * ATTN_SW128_ROW_BYTES), 1);
        wgmma_commit();
    };
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
    // Tile u of a ring has landed: its full barrier completed for the (u / S)-th time.
    auto wait_k = [&](int u) { fw2_mbar_wait(bar_full_k + 8 * (u % SK), (u / SK) & 1); };
    auto wait_v = [&](int u) { fw2_mbar_wait(bar_full_v + 8 * (u % SV), (u / SV) & 1); };

    // Schedule per warpgroup (production's, header): step j = 1 .. n_tiles-1
    //   wait_group 0 (P_{j-2} V_{j-2} retired) -> release V_{j-2}; p = bf16(P_{j-1}); O *= alpha
    //   wait full K_j, full V_{j-1}; fence.proxy.async; [PP: my turn]
    //   issue S_j; issue O += P_{j-1} V_{j-1}  [PP: other's turn]
    //   wait_group 1 (S_j done) -> release K_j; softmax(S_j)
    float alpha[2];
    bool moved;
    // tile 0: S only
    fw2_mbar_wait(bar_q, 0);
    wait_k(0);
    if (!WF) fence_proxy_async_shared();
    wg_fence_acc(s);
    if (PP) fw2_bar_sync(my_turn);
    wgmma_fence();
    issue_s(0);
    if (PP) fw2_bar_arrive(other_turn);
    wgmma_wait<0>();
    wg_fence_acc(s);
    fw2_mbar_arrive_if(bar_empty_k + 8 * (0 % SK), releaser);
    moved = softmax(0, alpha);
    for (int j = 1; j < n_tiles; j++) {
        wgmma_wait<0>();  // P_{j-2} V_{j-2} retired (nothing in flight at j = 1)
        wg_fence_acc(o);
        wg_fence_frag(p);
        fw2_mbar_arrive_if(bar_empty_v + 8 * ((j + SV - 2) % SV), releaser && j >= 2);
        convert_p();
        rescale_o(alpha, moved);
        wait_k(j);
        wait_v(j - 1);
        if (!WF) fence_proxy_async_shared();
        wg_fence_acc(s);
        wg_fence_acc(o);
        wg_fence_frag(p);
        if (PP) fw2_bar_sync(my_turn);
        wgmma_fence();
        issue_s(j);
        issue_pv(j - 1);
        if (PP) fw2_bar_arrive(other_turn);
        wgmma_wait<1>();  // S_j done; the P V group may still run
        wg_fence_acc(s);
        fw2_mbar_arrive_if(bar_empty_k + 8 * (j % SK), releaser);
        moved = softmax(j, alpha);
    }
    // the last tile's P V
    wgmma_wait<0>();
    wg_fence_acc(o);
    wg_fence_frag(p);
    fw2_mbar_arrive_if(bar_empty_v + 8 * ((n_tiles + SV - 2) % SV), releaser && n_tiles >= 2);
    convert_p();
    rescale_o(alpha, moved);
    wait_v(n_tiles - 1);
    if (!WF) fence_proxy_async_shared();
    wg_fence_acc(o);
    wg_fence_frag(p);
    if (PP) fw2_bar_sync(my_turn);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    if (PP) fw2_bar_arrive(other_turn);
    wgmma_wait<0>();
    wg_fence_acc(o);
    if (PP && wg == 0) fw2_bar_sync(1);  // warpgroup 1's last arrival

    // O / l -> bf16; lse = (max + log2(l)) * ln 2 (production's epilogue)
    const int64_t out_stride = (int64_t)H * HD;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float l = row_sum[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = 1.0f / l;
        const int row = my_row + hf * 8;
        if (row < T) {
            bf16* dst =
                out + ((int64_t)b * T + row) * out_stride + (int64_t)h * HD + (lane & 3) * 2;
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

// ----------------------------------------------------------------------------
// host side

template <int HD, int SK, int SV, bool PP, bool WF>
static void attn_fw2_run(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int KVH,
                         cudaStream_t stream) {
    constexpr int BR = ATTN_WG_ROWS * ATTN_FW2_NWG;
    const size_t smem = attn_fw2_smem_bytes<HD, SK, SV>();
    auto kernel = attn_fw2_kernel<HD, SK, SV, PP, WF>;
    attention_set_max_smem(kernel, smem);
    kernel<<<attention_grid(B, T, H, BR), ATTN_FW2_THREADS, smem, stream>>>(
        out, lse, qkv, T, H, KVH, attention_scale_log2(HD));
    attention_check(cudaGetLastError());
}

// Same signature and contract as attention_forward_bf16; HD 64 and 128; sm_90a device code.
// <K ring stages, V ring stages, ping-pong of the two consumer warpgroups, writer-side fence>
template <int SK, int SV, bool PP, bool WF>
static void attention_forward_wgmma2(void* out, float* lse, const void* qkv, int B, int T, int H,
                                     int KVH, int HD, void* stream) {
    const char* fn = "attention_forward_wgmma2";
    const int work = attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD);
    if (!attention_wgmma_supports_head_dim(HD)) {
        fprintf(stderr, "attention: %s: head dim %d not supported (supported: 64, 128)\n", fn, HD);
        exit(1);
    }
    if (!attention_wgmma_available()) {
        fprintf(stderr, "attention: %s needs sm_90a: this binary's device code was not built "
                "with -gencode arch=compute_90a,code=sm_90a\n", fn);
        exit(1);
    }
    if (!work) return;
    bf16* o = static_cast<bf16*>(out);
    const bf16* x = static_cast<const bf16*>(qkv);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (HD == 64)
        attn_fw2_run<64, SK, SV, PP, WF>(o, lse, x, B, T, H, KVH, s);
    else
        attn_fw2_run<128, SK, SV, PP, WF>(o, lse, x, B, T, H, KVH, s);
}

#endif  // DEV_CUDA_ATTENTION_FWD_WGMMA2_CUH
