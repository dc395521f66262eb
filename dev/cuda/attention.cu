/*
 * dev/cuda/attention.cu — kernel lab for causal grouped-query flash attention (bf16, fp32
 * accumulation), in llm.c's form: numbered variants, a CPU reference, validation, a benchmark in
 * TFLOP/s. It includes kernels/attention.cu, so the kernels checked and timed here are the ones
 * the trainer links; the lab adds only the wrappers that run them with other tile shapes, the
 * timing of the backward's passes, and the atomic-dQ backward (attention_bwd_atomic.cuh).
 *
 * Build and run (needs a GPU; the build does not):
 *   dev/cuda/run_attention.sh [--quick] [--tiny] [--no-big] [--no-bench] [--long]
 *       [--shape B,T,H,KVH,HD] [--fwd I or I,J,...] [--bwd I or I,J,...]
 *   dev/cuda/run_attention.sh --sink [--no-bench]: sinks and sliding windows (GPT-OSS) only:
 *       their validation (C interface, mma.sync SW kernels, wgmma 2-stage forward; the option
 *       off bit for bit against the causal path) and the GPT-OSS benchmark (section "sinks and
 *       sliding windows" below)
 *   exit status 0 passed, 3 a check failed, 1 a CUDA error, 2 bad usage; --shape validates that
 *   one case only (e.g. under compute-sanitizer); --long adds a benchmark shape T=65536 B=1;
 *   --fwd -2 / --bwd -2 run no forward / backward variant. The build is for sm_90a: the mma.sync
 *   kernels are the same code there, the wgmma variants need it; variants a build or a head dim
 *   does not support are skipped (counted as "skipped" in the validation summary).
 *   dev/cuda/check_attention_refactor.sh compares two builds of this lab bit for bit and in speed
 *   (the --check-* modes at the end of this file).
 *
 * Variants ("kernels" is the C interface itself: on sm_90a at HD 64/128 it runs forward 7
 * (T < 32768) or 8 and backward 6, elsewhere forward 4 and backward 2):
 *   forward  0 kernels   1-6 mma.sync <rows blocks of 16 per warp, warps, keys per tile,
 *            blocks per SM asked of the register allocator>   7 wgmma ws k3v3   8 wgmma ws k2v2
 *   backward 0 kernels   1-5 mma.sync <dK/dV warps, query rows per tile | dQ warps, keys per
 *            tile>   6 wgmma bwd wg2 s3   7 wgmma bwd wg1 s2   8-10 atomic-dQ wgmma (below)
 *
 *   validation: fresh random bf16 inputs per case, a CPU reference with fp64 accumulation, relative
 *     L2 error of out, lse, dq, dk, dv (tolerance 2e-2); outputs poisoned with NaN before every
 *     launch so an unwritten element fails; every case run twice and compared bit for bit
 *     (a backward variant marked not deterministic: within the tolerance). A variant may name
 *     another whose bits it must reproduce (same_bits_as): compared on every case.
 *   big: B=3, T=131072 (B*T*QKV > 2^31 elements, so 32-bit offsets would fail), checked on
 *     sampled rows and keys of the last sequence against the same reference; the wgmma variants
 *     also whole, bit for bit, against the C interface's output.
 *   bench: HD=128, H=16, KVH=8 at T = 2048, 4096, 16384 (--long: 65536); TFLOP/s counted as
 *     the project counts attention (causal forward 2*B*H*T*T*HD, backward 2.5x that), against
 *     the ~600 TFLOP/s of PyTorch SDPA's cuDNN forward on an H200; then the backward's passes.
 *
 * wgmma forward, variants 7 "wgmma ws k3v3" and 8 "wgmma ws k2v2" (kernels/attention_wgmma.cuh:
 * scheme, warp specialisation, mbarrier rings, ping-pong, deadlock and proxy arguments; protocol
 * model dev/cuda/attention_fwd_ws_model.py, `python3` it after touching the protocol).
 *   Validated on an H200: 163 cases twice, bit-identical to the previous production kernel (the
 *   same arithmetic with all threads loading and a __syncthreads per tile), memcheck / synccheck
 *   / racecheck clean (T=1000, rings wrapped). 8 must reproduce 7's bits (same_bits_as).
 *   Checks after a change: 1. dev/cuda/run_attention.sh --tiny --no-big --no-bench --fwd 7,8
 *   --bwd -2 under `timeout 60` (a hang is a protocol error); 2. compute-sanitizer --tool
 *   memcheck | synccheck | racecheck .devbuild/attention --shape 1,1000,2,1,128 --no-big
 *   --no-bench --fwd 7,8 --bwd -2 --log /dev/null; 3. dev/cuda/run_attention.sh --fwd 7,8 --bwd
 *   -2 --long. Reading a failure: HD=64 right but HD=128 wrong -> V's LBO or the Q/K panel step;
 *   wrong at T=64 (one tile) -> descriptors, fragments or the Q barrier; only for T > 128 (k3v3:
 *   T > 384) -> ring stage / parity indices; only past the diagonal -> the mask.
 *
 * wgmma backward, variants 6 "wgmma bwd wg2 s3" and 7 "wgmma bwd wg1 s2"
 * (kernels/attention_bwd_wgmma.cuh: scheme, operand layouts, pipelines). Production's passes (D,
 * then dK/dV per kv tile walking query heads and tiles in a fixed order, then dQ per query tile;
 * 7 matmuls, no atomics) with every matmul on wgmma. wg2 s3: 2 warpgroups per CTA (128 keys /
 * 128 query rows), 3 ring slots; wg1 s2: 1 warpgroup, 2 slots, 2 CTAs per SM (shared memory at
 * HD=128: 100,352 / 99,328 bytes; registers 254 per thread, allocated as 256). Validated on an
 * H200 (all 163 cases within 3.9e-3, the big case, memcheck and racecheck clean, bit-identical
 * repeats). ptxas (nvcc 13.0, no spills, no serialised wgmma): dK/dV 254 registers at HD=128
 * (both), 192 at HD=64; dQ 176 (wg2 s3) / 161 (wg1 s2) at HD=128, 144 / 128 at HD=64.
 *   Checks after a change (I = 6 or 7):
 *   1. dev/cuda/run_attention.sh --tiny --no-big --no-bench --fwd -2 --bwd I
 *   2. compute-sanitizer --tool memcheck (then racecheck, synccheck) .devbuild/attention --tiny
 *      --no-big --no-bench --fwd -2 --bwd I --log /dev/null. racecheck covers the cp.async writes
 *      and the plain reads of the lse/D slots; it probably does not see wgmma's async-proxy reads
 *      of the Q/dO/K/V slots: the slot reuse argument (the kernel's "Pipelines") covers those,
 *      and a wrong result or "NOT DETERMINISTIC" in step 3 is the symptom if it fails.
 *   3. dev/cuda/run_attention.sh --no-big --no-bench --fwd -2 --bwd I (all cases, twice each)
 *   4. dev/cuda/run_attention.sh --fwd -2 --bwd I (the big case, the benchmark, the passes)
 *   5. ptxas: .devbuild/attention_ptxas.txt, entries attn_bwg_dkdv_kernel / attn_bwg_dq_kernel:
 *      no spills, and no "(C7515) ... wgmma.mma_async instructions are serialized" line (grep
 *      C75). A for loop the compiler may skip entirely made ptxas serialise every wgmma (a
 *      WARPGROUP.DEPBAR after each HGMMA in the SASS); both loops are do-while for that reason.
 *      The SASS (cuobjdump -sass) of each loop should read: [DEPBAR gsb0 0x0 (2 slots)],
 *      BAR.SYNC, loads, [DEPBAR 0x0 (dK/dV, 3 slots)], ARRIVE, 16 HGMMA 64x64 (S, dP), DEPBAR
 *      0x1, exp2, ARRIVE, 4 HGMMA 64xHD (dV | dQ), ... as in the kernel's "Pipelines".
 *   Reading a failure (the lab prints dq, dk, dv errors apart):
 *   - dv wrong  -> S^T / P^T (lse column values, mask) or the dO MN-major descriptor (LBO =
 *     BQ*128 at HD=128 only: HD=64 right and HD=128 wrong points there). dv right, dk wrong ->
 *     dP^T, D, dS^T or the Q MN-major descriptor (same LBO remark). dk and dv right, dq wrong ->
 *     the dQ kernel (its K MN-major descriptor LBO = BN*128, or the lse/D row values).
 *   - Everything wrong at T=64 (one tile) -> an operand of the SS products (K-major descriptors
 *     of a WG's 64-row slice: start + wg*64*128) or the accumulator -> A fragment mapping.
 *   - Right for wg1 s2 (7) and wrong for wg2 s3 (6) -> the warpgroup row offsets (wg*64*128
 *     inside the K/V or Q/dO tiles) or the 3-slot ring; the reverse -> the 2-slot ring (wait<0>
 *     placement before the barrier).
 *   - Wrong only when T > one tile, or with GQA (H/KVH > 1) -> ring stages / stage() mapping of
 *     `it` to (head, query tile). "NOT DETERMINISTIC" -> a missing fence / wgmma wait, a stage
 *     overwritten while a wgmma still reads it.
 *   - NaN (unwritten) -> rows/keys past T or a grid shape; a CUDA error -> smem attribute size.
 *
 * wgmma backward with atomic dQ, variants 8 "wgmma bwd atomic dq s3", 9 "... s2" and 10
 * "wgmma bwd bulk dq s3" (dev/cuda/attention_bwd_atomic.cuh: scheme, layouts, register budget,
 * memory-model argument, risks, first-run checklist; dev/cuda/check_bwd_atomic.sh runs that
 * checklist; CPU model dev/cuda/attention_bwd_atomic_model.py). STATUS: not yet run on a GPU.
 * Production's dK/dV pass (2 warpgroups, 128 keys, 3 or 2 ring slots) also computes dQ = dS K
 * per visited (query tile, head) from a dS tile stored by stmatrix .trans (SS wgmma, each
 * warpgroup half of the hd columns) and adds it to an fp32 accumulator in the workspace with
 * red.global.add.v4.f32 (10: staged in shared memory and added by one cp.reduce.async.bulk per
 * tile); a last pass converts it to bf16. 5 matmuls per tile pair instead of 7. NOT
 * deterministic (float atomics: the lab compares its repeats within the tolerance,
 * BackwardVariant::deterministic = false); bigger workspace (attention_backward_atomic_ws_bytes:
 * + B*H*ceil(T/64)*64*HD fp32). ptxas: 254 registers at HD=128, 202 at HD=64, no spills, no
 * serialised wgmma.
 *
 * Results (one H200, medians of 10, H=16 KVH=8 HD=128, TFLOP/s as above; docs/PERF.md has the
 * full log):
 *                               T=2048 B=16   T=4096 B=4   T=16384 B=2   T=65536 B=1
 *   forward  wgmma ws k3v3          460          492           607           562
 *            wgmma ws k2v2          455          496           556           589
 *            mma.sync (4)           295          314           332
 *   backward wgmma bwd wg2 s3       345          381           409           407
 *            wgmma bwd wg1 s2       331          387           374
 *            mma.sync (2)           184          202           217
 *   SDPA flash (FA2) fwd / bwd   295 / 210    283 / 235     334 / 303
 *   SDPA cuDNN       fwd / bwd   469 / 377    489 / 434     631 / 527
 *   Backward passes at T=4096 B=4: wgmma dK,dV 560 TFLOP/s of its 4 matmuls, dQ 562 of its 3;
 *   mma.sync ~293 each. The deterministic scheme does 7 matmuls where the 2.5x count assumes 5
 *   (dQ recomputes S and dP instead of fp32 atomics).
 *   validation: 163 cases (HD 16/32/64/128 x T 1/7/64/129/1000 x H/KVH 1/2/4/8 x B 1/3, plus
 *     T=4096, 2500, 3001), every variant: worst relative L2 2.1e-3 (out, lse), 4.3e-3 (dq, dk,
 *     dv); nothing unwritten; every run bit-identical to its repeat. big (B=3, T=131072, 2.4e9
 *     qkv elements): sampled errors <= 3.5e-3, no non-finite element.
 *
 * History (T=4096 forward unless said):
 *   mma.sync: mt1 w4 bc64 267, mt1 w8 bc64 248 (1 block/SM at 169 regs), mt2 w4 bc64 282 (255
 *     regs, 128 B spilled), mt2 w4 bc32 306 (no spill): 32 rows per warp halve the K/V ldmatrix
 *     traffic per mma. O rescaled only when a row maximum moves (warp vote): 306 -> 314 (280 ->
 *     297 at T=2048, 309 -> 331 at T=16384). mt2 w8 bc32 (BR=256, 1 block/SM) 277; mt2 w4 bc16
 *     243. Backward: the shapes within 2% of each other. T=1 dq/dk "failed" only because the
 *     exact value is 0 (metric floor added, see ErrAcc).
 *   wgmma: a two-warpgroup forward (377 / 449 / 495 at T=2048/4096/16384) and backward (wg2 s3
 *     345 / 381 / 409) wired into kernels/; then the warp-specialised forward (k3v3 460 / 492 /
 *     607) replaced the two-warpgroup one (396 / 403 / 486), k2v2 from T=32768 on.
 *   Tried and dropped (numbers in docs/PERF.md): an ordered mma.sync backward (dQ inside the
 *     dK/dV pass with per-tile turn counters: validated, 186 TFLOP/s at T=16384 against 217); a
 *     backward with the dQ pass's S and dP as RS wgmma and FA3 ping-pong (wrong dq at HD=64, and
 *     only 1-3% faster at HD=128); GQA head-pair packing and kv-head "L2 sections" launch order
 *     for forward and dQ (bit-identical but 0-5% slower: long-T attention is not DRAM-bound on
 *     K/V); for the warp-specialised forward: no ping-pong (worse from T=16384), a writer-side
 *     proxy fence (slower), 64-key tiles (455 at T=16384).
 * Next: TMA loads, Q/dO as register operands in the dQ pass, the atomic-dQ backward (8-10):
 * cuDNN reaches 631 / 527 at T=16384.
 */
#include "../../kernels/attention.cu"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "attention_bwd_atomic.cuh"

// ----------------------------------------------------------------------------
// the variants' entry points: production's kernels with other tile shapes, each behind the
// C interface's signature and checks (the lab's ForwardFn / BackwardFn)

// Forward through mma.sync with tile shape <row blocks of 16 per warp, warps, keys per tile,
// blocks per SM asked of the register allocator>.
template <int MT, int NWARPS, int BC, int MINB>
static void lab_forward_mma(void* out, float* lse, const void* qkv, int B, int T, int H, int KVH,
                            int HD, void* stream) {
    if (!attention_forward_check("lab_forward_mma", out, lse, qkv, B, T, H, KVH, HD)) return;
    attention_forward_mma_hd<MT, NWARPS, BC, MINB>(
        static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv), B, T, H, KVH, HD,
        static_cast<cudaStream_t>(stream));
}

// The wgmma entry points exit with a message where they cannot run (the lab's `supports` skips
// those cases first).
static void lab_require_wgmma(const char* fn, int HD) {
    if (!attention_wgmma_supports_head_dim(HD)) {
        fprintf(stderr, "attention: %s: head dim %d not supported (supported: 64, 128)\n", fn, HD);
        exit(1);
    }
    if (!attention_wgmma_available()) {
        fprintf(stderr, "attention: %s needs sm_90a: this binary's device code was not built "
                "with -gencode arch=compute_90a,code=sm_90a\n", fn);
        exit(1);
    }
}

// Forward through wgmma with <K ring stages, V ring stages>.
template <int SK, int SV>
static void lab_forward_wgmma(void* out, float* lse, const void* qkv, int B, int T, int H, int KVH,
                              int HD, void* stream) {
    const char* fn = "lab_forward_wgmma";
    const int work = attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD);
    lab_require_wgmma(fn, HD);
    if (!work) return;
    attention_forward_wgmma_hd<SK, SV>(static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv),
                                       B, T, H, KVH, HD, static_cast<cudaStream_t>(stream));
}

// Backward through mma.sync with <dK/dV warps (16 keys each), query rows per tile, dQ warps (16
// rows each), keys per tile>.
template <int KV_WARPS, int KV_BRQ, int Q_WARPS, int Q_BC>
static void lab_backward_mma(void* dqkv, const void* dout, const void* qkv, const void* out,
                             const float* lse, void* workspace, int B, int T, int H, int KVH,
                             int HD, void* stream) {
    if (!attention_backward_check("lab_backward_mma", dqkv, dout, qkv, out, lse, workspace, B, T,
                                  H, KVH, HD))
        return;
    attention_backward_mma_hd<KV_WARPS, KV_BRQ, Q_WARPS, Q_BC>(
        static_cast<bf16*>(dqkv), static_cast<const bf16*>(dout), static_cast<const bf16*>(qkv),
        static_cast<const bf16*>(out), lse, static_cast<float*>(workspace), B, T, H, KVH, HD,
        static_cast<cudaStream_t>(stream));
}

// Backward through wgmma with <dK/dV warpgroups (64 keys each), ring slots, dQ warpgroups (64
// rows each), ring slots>.
template <int KV_NWG, int KV_STAGES, int Q_NWG, int Q_STAGES>
static void lab_backward_wgmma(void* dqkv, const void* dout, const void* qkv, const void* out,
                               const float* lse, void* workspace, int B, int T, int H, int KVH,
                               int HD, void* stream) {
    const char* fn = "lab_backward_wgmma";
    lab_require_wgmma(fn, HD);
    if (!attention_backward_check(fn, dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD))
        return;
    attention_backward_wgmma_hd<KV_NWG, KV_STAGES, Q_NWG, Q_STAGES>(
        static_cast<bf16*>(dqkv), static_cast<const bf16*>(dout), static_cast<const bf16*>(qkv),
        static_cast<const bf16*>(out), lse, static_cast<float*>(workspace), B, T, H, KVH, HD,
        static_cast<cudaStream_t>(stream));
}

// The wgmma backward's passes with an event recorded after pass 1 (marks[0]) and after pass 2
// (marks[1]), so the lab times them apart (bench_backward_passes); HD 64 and 128.
template <int HD, int KV_NWG, int KV_STAGES, int Q_NWG, int Q_STAGES>
static void lab_backward_wgmma_passes(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                      const bf16* out, const float* lse, float* D, int B, int T,
                                      int H, int KVH, cudaStream_t s, cudaEvent_t* marks) {
    attention_backward_dot<HD>(D, dout, out, B, T, H, "lab_backward_wgmma_timed", s);
    attention_check(cudaEventRecord(marks[0], s));
    attn_bwg_dkdv_launch<HD, KV_NWG, KV_STAGES>(dqkv, dout, qkv, lse, D, B, T, H, KVH, s);
    attention_check(cudaEventRecord(marks[1], s));
    attn_bwg_dq_launch<HD, Q_NWG, Q_STAGES>(dqkv, dout, qkv, lse, D, B, T, H, KVH, s);
}
template <int KV_NWG, int KV_STAGES, int Q_NWG, int Q_STAGES>
static void lab_backward_wgmma_timed(void* dqkv, const void* dout, const void* qkv,
                                     const void* out, const float* lse, void* workspace, int B,
                                     int T, int H, int KVH, int HD, void* stream,
                                     cudaEvent_t* marks) {
    const char* fn = "lab_backward_wgmma_timed";
    lab_require_wgmma(fn, HD);
    if (!attention_backward_check(fn, dqkv, dout, qkv, out, lse, workspace, B, T, H, KVH, HD))
        return;
    attn_bwg_check_tiles(fn, T, ATTN_WG_ROWS * KV_NWG, ATTN_WG_ROWS * Q_NWG);
    bf16* dx = static_cast<bf16*>(dqkv);
    const bf16* dy = static_cast<const bf16*>(dout);
    const bf16* x = static_cast<const bf16*>(qkv);
    const bf16* y = static_cast<const bf16*>(out);
    float* D = static_cast<float*>(workspace);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (HD == 64)
        lab_backward_wgmma_passes<64, KV_NWG, KV_STAGES, Q_NWG, Q_STAGES>(dx, dy, x, y, lse, D, B,
                                                                          T, H, KVH, s, marks);
    else
        lab_backward_wgmma_passes<128, KV_NWG, KV_STAGES, Q_NWG, Q_STAGES>(dx, dy, x, y, lse, D,
                                                                           B, T, H, KVH, s, marks);
}

// ----------------------------------------------------------------------------
// host helpers: checks, bf16, random numbers, threads

#define lab_check(call) attention_check_at((call), #call, __FILE__, __LINE__)

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t float_to_bf16(float f) {  // round to nearest even (inputs are finite)
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
// Approximately standard normal: sum of four uniforms, rescaled to variance 1.
__host__ __device__ static inline float normal_from_hash(uint64_t h) {
    float s = 0.0f;
    for (int k = 0; k < 4; k++) s += (float)((h >> (16 * k)) & 0xffff) * (1.0f / 65536.0f);
    return (s - 2.0f) * 1.7320508f;
}
static void fill_random(std::vector<uint16_t>& v, uint64_t seed) {
    for (size_t i = 0; i < v.size(); i++)
        v[i] = float_to_bf16(normal_from_hash(splitmix64(seed * 0x100000001b3ull + i)));
}
__global__ void lab_fill_random_kernel(bf16* x, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t h = (uint64_t)i + seed * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
        h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
        h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
        x[i] = __float2bfloat16(normal_from_hash(h ^ (h >> 31)));
    }
}

// Run fn(i) for i in [0, n) on all cores; indices are dealt round-robin because row costs grow
// with i under the causal mask.
template <typename F>
static void parallel_for(int64_t n, F fn) {
    int nt = (int)std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> pool;
    for (int t = 0; t < nt; t++)
        pool.emplace_back([=]() {
            for (int64_t i = t; i < n; i += nt) fn(i);
        });
    for (auto& th : pool) th.join();
}

// ----------------------------------------------------------------------------
// CPU reference (fp64 accumulation over the bf16 inputs)

struct Shape {
    int B, T, H, KVH, HD;
    int64_t qkv_cols() const { return (int64_t)(H + 2 * KVH) * HD; }
    int64_t out_cols() const { return (int64_t)H * HD; }
};

// fp64 reference of one query row (b, h, i) with window (0: causal) and sink (NaN: none): out,
// lse, D = sum_j P_ij dP_ij, dq, and the row's sink-gradient term -P_sink D. p, dp: T doubles.
// D_given (optional): the row's D from the output the backward is given (the kernels compute D
// from their own bf16 output, not the exact one: in a row whose weight sits mostly on one key or
// on the sink, dP - D cancels and that rounding dominates the gradient), used instead of the
// exact D for dq and the sink term.
static void ref_query_row(const Shape& s, int window, double sink, const uint16_t* qkv,
                          const uint16_t* dout, int b, int h, int i, double* p, double* dp,
                          float* out_row, double* lse_out, double* D_out, float* dq_row,
                          double* dsink_term, const double* D_given) {
    const int HD = s.HD, kvh = h / (s.H / s.KVH);
    const int64_t QKV = s.qkv_cols(), OC = s.out_cols();
    const double scale = 1.0 / std::sqrt((double)HD);
    const bool has_sink = !std::isnan(sink);
    const int j0 = window > 0 ? std::max(0, i - window + 1) : 0;
    const uint16_t* q = qkv + ((int64_t)b * s.T + i) * QKV + (int64_t)h * HD;
    const uint16_t* dy = dout + ((int64_t)b * s.T + i) * OC + (int64_t)h * HD;
    std::vector<double> qd(HD), dyd(HD), acc(HD, 0.0);
    for (int d = 0; d < HD; d++) qd[d] = bf16_to_float(q[d]), dyd[d] = bf16_to_float(dy[d]);
    double mx = has_sink ? sink : -INFINITY;
    for (int j = j0; j <= i; j++) {
        const uint16_t* k = qkv + ((int64_t)b * s.T + j) * QKV + (int64_t)(s.H + kvh) * HD;
        const uint16_t* v = k + (int64_t)s.KVH * HD;
        double sk = 0.0, sv = 0.0;
        for (int d = 0; d < HD; d++) {
            sk += qd[d] * bf16_to_float(k[d]);
            sv += dyd[d] * bf16_to_float(v[d]);
        }
        p[j] = sk * scale;
        dp[j] = sv;
        mx = std::max(mx, p[j]);
    }
    double l = has_sink ? std::exp(sink - mx) : 0.0;
    for (int j = j0; j <= i; j++) l += (p[j] = std::exp(p[j] - mx));
    double D = 0.0;
    for (int j = j0; j <= i; j++) {
        p[j] /= l;
        D += p[j] * dp[j];
        const uint16_t* v =
            qkv + ((int64_t)b * s.T + j) * QKV + (int64_t)(s.H + s.KVH + kvh) * HD;
        for (int d = 0; d < HD; d++) acc[d] += p[j] * bf16_to_float(v[d]);
    }
    for (int d = 0; d < HD; d++) out_row[d] = (float)acc[d];
    *lse_out = mx + std::log(l);
    if (D_given) D = *D_given;
    *D_out = D;
    *dsink_term = has_sink ? -std::exp(sink - *lse_out) * D : 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = j0; j <= i; j++) {
        const double ds = p[j] * (dp[j] - D);
        const uint16_t* k = qkv + ((int64_t)b * s.T + j) * QKV + (int64_t)(s.H + kvh) * HD;
        for (int d = 0; d < HD; d++) acc[d] += ds * bf16_to_float(k[d]);
    }
    for (int d = 0; d < HD; d++) dq_row[d] = (float)(acc[d] * scale);
}

// One key row (b, kvh, j): dk, dv over the group's query heads and the queries i with
// j <= i < j + window (window 0: to T), given lse (sinks included) and D per (b, h, i).
static void ref_key_row(const Shape& s, int window, const uint16_t* qkv,
                        const uint16_t* dout, const double* lse, const double* Dv, int b,
                        int kvh, int j, float* dk_row, float* dv_row) {
    const int HD = s.HD, group = s.H / s.KVH;
    const int64_t QKV = s.qkv_cols(), OC = s.out_cols();
    const double scale = 1.0 / std::sqrt((double)HD);
    const int i_end = window > 0 ? std::min(s.T, j + window) : s.T;
    const uint16_t* k = qkv + ((int64_t)b * s.T + j) * QKV + (int64_t)(s.H + kvh) * HD;
    const uint16_t* v = k + (int64_t)s.KVH * HD;
    std::vector<double> kd(HD), vd(HD), dk(HD, 0.0), dv(HD, 0.0);
    for (int d = 0; d < HD; d++) kd[d] = bf16_to_float(k[d]), vd[d] = bf16_to_float(v[d]);
    for (int h = kvh * group; h < (kvh + 1) * group; h++)
        for (int i = j; i < i_end; i++) {
            const uint16_t* q = qkv + ((int64_t)b * s.T + i) * QKV + (int64_t)h * HD;
            const uint16_t* dy = dout + ((int64_t)b * s.T + i) * OC + (int64_t)h * HD;
            double sk = 0.0, sv = 0.0;
            for (int d = 0; d < HD; d++) {
                sk += bf16_to_float(q[d]) * kd[d];
                sv += bf16_to_float(dy[d]) * vd[d];
            }
            const int64_t r = ((int64_t)b * s.H + h) * s.T + i;
            const double P = std::exp(sk * scale - lse[r]);
            const double ds = P * (sv - Dv[r]);
            for (int d = 0; d < HD; d++) {
                dk[d] += ds * bf16_to_float(q[d]);
                dv[d] += P * bf16_to_float(dy[d]);
            }
        }
    for (int d = 0; d < HD; d++) dk_row[d] = (float)(dk[d] * scale), dv_row[d] = (float)dv[d];
}

struct Reference {
    std::vector<float> out;   // (B*T, H*HD)
    std::vector<double> lse;  // (B, H, T)
    std::vector<double> D;    // (B, H, T)
    std::vector<float> dqkv;  // (B*T, QKV)
};

// The whole reference with window (0: causal); sinks: H values or empty (none). dsinks (H) from zero. out_given
// (optional, bf16 (B*T, H*HD)): the backward's D from this output (ref_query_row).
static void ref_attention(const Shape& s, int window, const std::vector<float>& sinks,
                          const std::vector<uint16_t>& qkv,
                          const std::vector<uint16_t>& dout, Reference& r,
                          std::vector<double>& dsinks,
                          const std::vector<uint16_t>* out_given = nullptr) {
    const int64_t rows = (int64_t)s.B * s.T, n_lse = (int64_t)s.B * s.H * s.T;
    r.out.assign(rows * s.out_cols(), 0.0f);
    r.lse.assign(n_lse, 0.0);
    r.D.assign(n_lse, 0.0);
    r.dqkv.assign(rows * s.qkv_cols(), 0.0f);
    std::vector<double> term(n_lse, 0.0);
    parallel_for(n_lse, [&](int64_t idx) {
        const int i = (int)(idx % s.T), h = (int)(idx / s.T % s.H), b = (int)(idx / s.T / s.H);
        std::vector<double> p(s.T), dp(s.T);
        const int64_t row = (int64_t)b * s.T + i;
        const double sink = sinks.empty() ? NAN : (double)sinks[h];
        double Dg = 0.0;
        if (out_given) {
            const int64_t o = row * s.out_cols() + (int64_t)h * s.HD;
            for (int d = 0; d < s.HD; d++)
                Dg += (double)bf16_to_float(dout[o + d]) * bf16_to_float((*out_given)[o + d]);
        }
        ref_query_row(s, window, sink, qkv.data(), dout.data(), b, h, i, p.data(), dp.data(),
                      &r.out[row * s.out_cols() + (int64_t)h * s.HD], &r.lse[idx], &r.D[idx],
                      &r.dqkv[row * s.qkv_cols() + (int64_t)h * s.HD], &term[idx],
                      out_given ? &Dg : nullptr);
    });
    parallel_for((int64_t)s.B * s.KVH * s.T, [&](int64_t idx) {
        const int j = (int)(idx % s.T), g = (int)(idx / s.T % s.KVH),
                  b = (int)(idx / s.T / s.KVH);
        float* row = &r.dqkv[((int64_t)b * s.T + j) * s.qkv_cols()];
        ref_key_row(s, window, qkv.data(), dout.data(), r.lse.data(), r.D.data(), b, g, j,
                    row + (int64_t)(s.H + g) * s.HD, row + (int64_t)(s.H + s.KVH + g) * s.HD);
    });
    dsinks.assign(s.H, 0.0);
    for (int64_t idx = 0; idx < n_lse; idx++) dsinks[idx / s.T % s.H] += term[idx];
}

// ----------------------------------------------------------------------------
// variants (tile shapes of the kernels/attention.cu templates)

typedef void (*ForwardFn)(void*, float*, const void*, int, int, int, int, int, void*);
typedef void (*BackwardFn)(void*, const void*, const void*, const void*, const float*, void*, int,
                           int, int, int, int, void*);
// supports: which head dims (and builds) the variant runs, nullptr = every head dim of the C
// interface; the lab skips the others. big: also checked on the T=131072 case (validate_big).
// same_bits_as: the name of a variant whose out and lse this one must reproduce bit for bit
// (the same arithmetic in the same order, only the schedule differs), nullptr = none; checked
// on every validation case.
struct ForwardVariant {
    const char* name;
    ForwardFn fn;
    int (*supports)(int HD);
    bool big;
    const char* same_bits_as;
};
// ws_bytes: the workspace the variant needs, nullptr = attention_backward_workspace_bytes.
// same_bits_as: as for the forward (the whole dqkv, bit for bit, on every validation case and,
// against the C interface's backward, on the big case). deterministic: false for a variant that
// sums with float atomics; its two runs of a case must then agree within the tolerance (relative
// L2 of the second against the first) instead of bit for bit, and differing bits are counted
// ("nondeterministic") without failing the case.
struct BackwardVariant {
    const char* name;
    BackwardFn fn;
    int (*supports)(int HD);
    size_t (*ws_bytes)(int B, int T, int H, int KVH, int HD);
    bool big;
    const char* same_bits_as;
    bool deterministic;
};

// The wgmma variants run HD 64 and 128, and only from a binary with sm_90a device code (said once).
static int lab_wgmma_supports(int HD) {
    if (!attention_wgmma_supports_head_dim(HD)) return 0;
    if (!attention_wgmma_available()) {
        static bool told = false;
        if (!told) printf("  (wgmma variants skipped: no sm_90a device code in this binary)\n");
        told = true;
        return 0;
    }
    return 1;
}

// forward: <row blocks of 16 per warp, warps, keys per tile, blocks per SM for the allocator>;
// wgmma: <K ring stages, V ring stages> (kernels/attention_wgmma.cuh)
static const ForwardVariant forward_variants[] = {
    {"kernels", attention_forward_bf16, nullptr, false, nullptr},
    {"fwd mt1 w4 bc64", lab_forward_mma<1, 4, 64, 1>, nullptr, false, nullptr},
    {"fwd mt1 w8 bc32 minb2", lab_forward_mma<1, 8, 32, 2>, nullptr, false, nullptr},
    {"fwd mt2 w4 bc16", lab_forward_mma<2, 4, 16, 1>, nullptr, false, nullptr},
    {"fwd mt2 w4 bc32", lab_forward_mma<2, 4, 32, 1>, nullptr, false, nullptr},
    {"fwd mt2 w4 bc64", lab_forward_mma<2, 4, 64, 1>, nullptr, false, nullptr},
    {"fwd mt2 w8 bc32", lab_forward_mma<2, 8, 32, 1>, nullptr, false, nullptr},
    {"wgmma ws k3v3", lab_forward_wgmma<3, 3>, lab_wgmma_supports, true, nullptr},
    {"wgmma ws k2v2", lab_forward_wgmma<2, 2>, lab_wgmma_supports, true, "wgmma ws k3v3"},
};
static bool forward_runs(int v, int HD) {
    const ForwardVariant& f = forward_variants[v];
    return !f.supports || f.supports(HD);
}
// backward: <dK/dV warps (16 keys each), query rows per tile, dQ warps (16 rows each), keys per
// tile>; wgmma: <dK/dV warpgroups (64 keys each), ring slots, dQ warpgroups (64 rows each), ring
// slots> (kernels/attention_bwd_wgmma.cuh)
// wgmma atomic / bulk dq: <ring slots, bulk reductions> (dev/cuda/attention_bwd_atomic.cuh; NOT
// deterministic)
static const BackwardVariant backward_variants[] = {
    {"kernels", attention_backward_bf16, nullptr, nullptr, false, nullptr, true},
    {"bwd kv w4 q64 | dq w4 k64", lab_backward_mma<4, 64, 4, 64>, nullptr, nullptr, false,
     nullptr, true},
    {"bwd kv w8 q64 | dq w8 k64", lab_backward_mma<8, 64, 8, 64>, nullptr, nullptr, false,
     nullptr, true},
    {"bwd kv w8 q64 | dq w4 k64", lab_backward_mma<8, 64, 4, 64>, nullptr, nullptr, false,
     nullptr, true},
    {"bwd kv w4 q64 | dq w8 k64", lab_backward_mma<4, 64, 8, 64>, nullptr, nullptr, false,
     nullptr, true},
    {"bwd kv w8 q64 | dq w8 k32", lab_backward_mma<8, 64, 8, 32>, nullptr, nullptr, false,
     nullptr, true},
    {"wgmma bwd wg2 s3", lab_backward_wgmma<2, 3, 2, 3>, lab_wgmma_supports, nullptr, true,
     nullptr, true},
    {"wgmma bwd wg1 s2", lab_backward_wgmma<1, 2, 1, 2>, lab_wgmma_supports, nullptr, true,
     nullptr, true},
    {"wgmma bwd atomic dq s3", attention_backward_atomic<3, false>, lab_wgmma_supports,
     attention_backward_atomic_ws_bytes, true, nullptr, false},
    {"wgmma bwd atomic dq s2", attention_backward_atomic<2, false>, lab_wgmma_supports,
     attention_backward_atomic_ws_bytes, true, nullptr, false},
    {"wgmma bwd bulk dq s3", attention_backward_atomic<3, true>, lab_wgmma_supports,
     attention_backward_atomic_ws_bytes, true, nullptr, false},
};
#define N_FWD ((int)(sizeof(forward_variants) / sizeof(forward_variants[0])))
#define N_BWD ((int)(sizeof(backward_variants) / sizeof(backward_variants[0])))
static int forward_index(const char* name) {
    for (int v = 0; v < N_FWD; v++)
        if (!strcmp(forward_variants[v].name, name)) return v;
    return -1;
}
static int backward_index(const char* name) {
    for (int v = 0; v < N_BWD; v++)
        if (!strcmp(backward_variants[v].name, name)) return v;
    return -1;
}
static bool backward_runs(int v, int HD) {
    const BackwardVariant& f = backward_variants[v];
    return !f.supports || f.supports(HD);
}
// One workspace per case serves every backward variant: the largest any of them needs.
static size_t lab_workspace_bytes(int B, int T, int H, int KVH, int HD) {
    size_t bytes = attention_backward_workspace_bytes(B, T, H, KVH, HD);
    for (int v = 0; v < N_BWD; v++)
        if (backward_variants[v].ws_bytes && backward_runs(v, HD))
            bytes = std::max(bytes, backward_variants[v].ws_bytes(B, T, H, KVH, HD));
    return bytes;
}

// ----------------------------------------------------------------------------
// device buffers of one case

struct DeviceCase {
    Shape s;
    bf16 *qkv, *out, *dout, *dqkv;
    float *lse, *ws;
    size_t n_qkv, n_out, n_lse, ws_bytes;
};

static DeviceCase case_alloc(const Shape& s) {
    DeviceCase c;
    c.s = s;
    c.n_qkv = (size_t)s.B * s.T * s.qkv_cols();
    c.n_out = (size_t)s.B * s.T * s.out_cols();
    c.n_lse = (size_t)s.B * s.H * s.T;
    c.ws_bytes = lab_workspace_bytes(s.B, s.T, s.H, s.KVH, s.HD);
    lab_check(cudaMalloc(&c.qkv, c.n_qkv * 2));
    lab_check(cudaMalloc(&c.dqkv, c.n_qkv * 2));
    lab_check(cudaMalloc(&c.out, c.n_out * 2));
    lab_check(cudaMalloc(&c.dout, c.n_out * 2));
    lab_check(cudaMalloc(&c.lse, c.n_lse * 4));
    lab_check(cudaMalloc(&c.ws, std::max(c.ws_bytes, (size_t)16)));
    return c;
}
static void case_free(DeviceCase& c) {
    lab_check(cudaFree(c.qkv));
    lab_check(cudaFree(c.dqkv));
    lab_check(cudaFree(c.out));
    lab_check(cudaFree(c.dout));
    lab_check(cudaFree(c.lse));
    lab_check(cudaFree(c.ws));
}
// NaN everywhere (bf16 0xffff, fp32 0xffffffff): an element nobody writes stays NaN.
static void poison_forward(DeviceCase& c) {
    lab_check(cudaMemset(c.out, 0xff, c.n_out * 2));
    lab_check(cudaMemset(c.lse, 0xff, c.n_lse * 4));
}
static void poison_backward(DeviceCase& c) {
    lab_check(cudaMemset(c.dqkv, 0xff, c.n_qkv * 2));
    lab_check(cudaMemset(c.ws, 0xff, c.ws_bytes));
}

template <typename T>
static std::vector<T> to_host(const void* d, size_t n) {
    std::vector<T> h(n);
    lab_check(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

// ----------------------------------------------------------------------------
// validation against the CPU reference

// Relative L2 error over a set of (gpu, ref) pairs; NaN/Inf in gpu -> +inf ("unwritten").
// The reference norm is floored at 1e-3 RMS per element: at T=1 the exact dq and dk are 0 (the
// softmax of one logit is constant) and the GPU's fp32 rounding (~1e-7) must not count as 100%.
struct ErrAcc {
    double num = 0.0, den = 0.0;
    int64_t n = 0;
    bool bad = false;
    void add(double g, double r) {
        if (!std::isfinite(g)) bad = true;
        num += (g - r) * (g - r);
        den += r * r;
        n++;
    }
    double rel() const {
        return bad ? INFINITY : std::sqrt(num / std::max(den, 1e-6 * (double)std::max(n, (int64_t)1)));
    }
};

struct Errors {
    double out, lse, dq, dk, dv;
    double max() const { return std::max({out, lse, dq, dk, dv}); }
};

static void errors_forward(const Shape& s, const std::vector<uint16_t>& out,
                           const std::vector<float>& lse, const Reference& r, Errors& e) {
    ErrAcc eo, el;
    for (size_t i = 0; i < out.size(); i++) eo.add(bf16_to_float(out[i]), r.out[i]);
    for (size_t i = 0; i < lse.size(); i++) el.add(lse[i], r.lse[i]);
    (void)s;
    e.out = eo.rel();
    e.lse = el.rel();
}
// dqkv against a reference dqkv (the fp64 one, or a first run for the repeat check).
static void errors_backward(const Shape& s, const std::vector<uint16_t>& dqkv,
                            const std::vector<float>& ref, Errors& e) {
    ErrAcc eq, ek, ev;
    const int64_t QKV = s.qkv_cols();
    const int64_t kcol = (int64_t)s.H * s.HD, vcol = (int64_t)(s.H + s.KVH) * s.HD;
    for (int64_t row = 0; row < (int64_t)s.B * s.T; row++)
        for (int64_t c = 0; c < QKV; c++) {
            const int64_t i = row * QKV + c;
            ErrAcc& a = c < kcol ? eq : c < vcol ? ek : ev;
            a.add(bf16_to_float(dqkv[i]), ref[i]);
        }
    e.dq = eq.rel();
    e.dk = ek.rel();
    e.dv = ev.rel();
}

static const double TOLERANCE = 2e-2;

// Which variants run (-1: all, -2: none); --fwd/--bwd pick one, e.g. to find one that crashes;
// both also take a list (fwd/bwd = -3, the indices in fwd_set/bwd_set). --long adds a
// benchmark shape T=65536 B=1, forward and backward (the trainer's long-sequence regime).
struct LabOptions {
    bool quick = false, tiny = false, big = true, bench = true, long_bench = false;
    bool sink = false;  // --sink: the sink/window validation and benchmark only
    int shape[5] = {0, 0, 0, 0, 0};  // --shape B,T,H,KVH,HD: validate this one case only
    int fwd = -1, bwd = -1;
    uint64_t fwd_set = 0, bwd_set = 0;
    bool run_fwd(int v) const {
        return fwd == -1 || fwd == v || (fwd == -3 && v < 64 && ((fwd_set >> v) & 1));
    }
    bool run_bwd(int v) const {
        return bwd == -1 || bwd == v || (bwd == -3 && v < 64 && ((bwd_set >> v) & 1));
    }
};

struct VariantStats {
    double worst = 0.0;
    int failures = 0, nondeterministic = 0, skipped = 0;
    int bit_cases = 0, bit_diff = 0;  // compared with same_bits_as, of which differing
};

// One case: reference once; every forward and backward variant twice (bit-identical check).
// Returns the number of failures; prints one line per case (the "kernels" variant's errors).
static int validate_case(const Shape& s, uint64_t seed, const LabOptions& opt,
                         VariantStats* fstats, VariantStats* bstats, FILE* log) {
    std::vector<uint16_t> qkv((size_t)s.B * s.T * s.qkv_cols()),
        dout((size_t)s.B * s.T * s.out_cols());
    fill_random(qkv, seed * 2 + 1);
    fill_random(dout, seed * 2 + 2);
    Reference ref;
    std::vector<double> no_dsinks;
    ref_attention(s, 0, {}, qkv, dout, ref, no_dsinks);

    DeviceCase c = case_alloc(s);
    lab_check(cudaMemcpy(c.qkv, qkv.data(), qkv.size() * 2, cudaMemcpyHostToDevice));
    lab_check(cudaMemcpy(c.dout, dout.data(), dout.size() * 2, cudaMemcpyHostToDevice));
    int failures = 0;
    Errors shown = {0, 0, 0, 0, 0};
    bool shown_det = true;

    // forward variants; the "kernels" forward output stays in c.out/c.lse for the backward.
    // A variant that is only the same_bits_as target of a selected one runs once, unreported.
    std::vector<std::vector<uint16_t>> outs(N_FWD);
    std::vector<std::vector<float>> lses(N_FWD);
    for (int v = N_FWD - 1; v >= 0; v--) {
        bool target = false;
        for (int w = 0; w < N_FWD; w++)
            target = target || (opt.run_fwd(w) && forward_variants[w].same_bits_as &&
                                forward_index(forward_variants[w].same_bits_as) == v);
        if (!opt.run_fwd(v) && v != 0 && !target) continue;
        if (!forward_runs(v, s.HD)) {  // head dim, shape or build not implemented
            fstats[v].skipped++;
            continue;
        }
        const bool report = opt.run_fwd(v) || v == 0;
        std::vector<uint16_t> out[2];
        std::vector<float> lse[2];
        for (int run = 0; run < (report ? 2 : 1); run++) {
            poison_forward(c);
            forward_variants[v].fn(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
            lab_check(cudaDeviceSynchronize());
            out[run] = to_host<uint16_t>(c.out, c.n_out);
            lse[run] = to_host<float>(c.lse, c.n_lse);
        }
        outs[v] = out[0];
        lses[v] = lse[0];
        if (!report) continue;
        Errors e = {0, 0, 0, 0, 0};
        errors_forward(s, out[0], lse[0], ref, e);
        const bool det = out[0] == out[1] && memcmp(lse[0].data(), lse[1].data(), c.n_lse * 4) == 0;
        const double worst = std::max(e.out, e.lse);
        fstats[v].worst = std::max(fstats[v].worst, worst);
        if (!det) fstats[v].nondeterministic++;
        if (!(worst <= TOLERANCE) || !det) {
            fstats[v].failures++;
            failures++;
            // every failure goes to the log, the first few of each variant to stdout too
            for (FILE* f : {log, stdout})
                if (f == log || fstats[v].failures <= 3)
                    fprintf(f, "  FAIL %-28s B=%d T=%d H=%d KVH=%d HD=%d: out %.2e lse %.2e%s\n",
                            forward_variants[v].name, s.B, s.T, s.H, s.KVH, s.HD, e.out, e.lse,
                            det ? "" : " NOT DETERMINISTIC");
        }
        if (v == 0) shown.out = e.out, shown.lse = e.lse, shown_det = shown_det && det;
    }
    // bit-for-bit against the same_bits_as variant (run above)
    for (int v = 0; v < N_FWD; v++) {
        if (!opt.run_fwd(v) || !forward_variants[v].same_bits_as || outs[v].empty()) continue;
        const int r = forward_index(forward_variants[v].same_bits_as);
        if (r < 0 || outs[r].empty()) continue;
        long long d_out = 0, d_lse = 0;
        for (size_t i = 0; i < outs[v].size(); i++) d_out += outs[v][i] != outs[r][i];
        for (size_t i = 0; i < lses[v].size(); i++)
            d_lse += memcmp(&lses[v][i], &lses[r][i], 4) != 0;
        fstats[v].bit_cases++;
        if (d_out || d_lse) {
            fstats[v].bit_diff++;
            fstats[v].failures++;
            failures++;
            for (FILE* f : {log, stdout})
                if (f == log || fstats[v].bit_diff <= 3)
                    fprintf(f, "  FAIL %-28s B=%d T=%d H=%d KVH=%d HD=%d: NOT BIT-IDENTICAL to %s "
                            "(%lld out, %lld lse elements differ)\n", forward_variants[v].name,
                            s.B, s.T, s.H, s.KVH, s.HD, forward_variants[r].name, d_out, d_lse);
        }
    }
    // backward variants; as for the forward, a variant that is only the same_bits_as target of a
    // selected one runs once, unreported
    std::vector<std::vector<uint16_t>> dqkvs(N_BWD);
    for (int v = 0; v < N_BWD; v++) {
        bool target = false;
        for (int w = 0; w < N_BWD; w++)
            target = target || (opt.run_bwd(w) && backward_variants[w].same_bits_as &&
                                backward_index(backward_variants[w].same_bits_as) == v);
        if (!opt.run_bwd(v) && !target) continue;
        if (!backward_runs(v, s.HD)) {  // head dim (or shape) not implemented
            bstats[v].skipped++;
            continue;
        }
        const bool report = opt.run_bwd(v);
        std::vector<uint16_t> dqkv[2];
        for (int run = 0; run < (report ? 2 : 1); run++) {
            poison_backward(c);
            backward_variants[v].fn(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H,
                                    s.KVH, s.HD, nullptr);
            lab_check(cudaDeviceSynchronize());
            dqkv[run] = to_host<uint16_t>(c.dqkv, c.n_qkv);
        }
        dqkvs[v] = dqkv[0];
        if (!report) continue;
        Errors e = {0, 0, 0, 0, 0};
        errors_backward(s, dqkv[0], ref.dqkv, e);
        const bool det = dqkv[0] == dqkv[1];
        const double worst = std::max({e.dq, e.dk, e.dv});
        bstats[v].worst = std::max(bstats[v].worst, worst);
        if (!det) bstats[v].nondeterministic++;
        // float atomics: the repeat only has to agree within the tolerance
        bool repeat_ok = det;
        if (!det && !backward_variants[v].deterministic) {
            std::vector<float> first(dqkv[0].size());
            for (size_t i = 0; i < first.size(); i++) first[i] = bf16_to_float(dqkv[0][i]);
            Errors r = {0, 0, 0, 0, 0};
            errors_backward(s, dqkv[1], first, r);
            repeat_ok = std::max({r.dq, r.dk, r.dv}) <= TOLERANCE;
        }
        if (!(worst <= TOLERANCE) || !repeat_ok) {
            bstats[v].failures++;
            failures++;
            const char* why = repeat_ok                            ? ""
                              : backward_variants[v].deterministic ? " NOT DETERMINISTIC"
                                                                   : " REPEAT OUTSIDE TOLERANCE";
            for (FILE* f : {log, stdout})
                if (f == log || bstats[v].failures <= 3)
                    fprintf(f,
                            "  FAIL %-28s B=%d T=%d H=%d KVH=%d HD=%d: dq %.2e dk %.2e dv %.2e%s\n",
                            backward_variants[v].name, s.B, s.T, s.H, s.KVH, s.HD, e.dq, e.dk,
                            e.dv, why);
        }
        if (v == 0) shown.dq = e.dq, shown.dk = e.dk, shown.dv = e.dv, shown_det = shown_det && det;
    }
    // bit-for-bit against the same_bits_as backward (run above): dq, dk, dv counted apart
    for (int v = 0; v < N_BWD; v++) {
        if (!opt.run_bwd(v) || !backward_variants[v].same_bits_as || dqkvs[v].empty()) continue;
        const int r = backward_index(backward_variants[v].same_bits_as);
        if (r < 0 || dqkvs[r].empty()) continue;
        const int64_t QKV = s.qkv_cols(), kcol = (int64_t)s.H * s.HD,
                      vcol = (int64_t)(s.H + s.KVH) * s.HD;
        long long d[3] = {0, 0, 0};  // dq, dk, dv elements that differ
        for (size_t i = 0; i < dqkvs[v].size(); i++) {
            const int64_t col = (int64_t)(i % (size_t)QKV);
            d[col < kcol ? 0 : col < vcol ? 1 : 2] += dqkvs[v][i] != dqkvs[r][i];
        }
        bstats[v].bit_cases++;
        if (d[0] || d[1] || d[2]) {
            bstats[v].bit_diff++;
            bstats[v].failures++;
            failures++;
            for (FILE* f : {log, stdout})
                if (f == log || bstats[v].bit_diff <= 3)
                    fprintf(f, "  FAIL %-28s B=%d T=%d H=%d KVH=%d HD=%d: NOT BIT-IDENTICAL to %s "
                            "(%lld dq, %lld dk, %lld dv elements differ)\n",
                            backward_variants[v].name, s.B, s.T, s.H, s.KVH, s.HD,
                            backward_variants[r].name, d[0], d[1], d[2]);
        }
    }
    fprintf(log, "B=%d T=%-5d H=%-2d KVH=%d HD=%-3d  out %.2e lse %.2e dq %.2e dk %.2e dv %.2e  %s\n",
            s.B, s.T, s.H, s.KVH, s.HD, shown.out, shown.lse, shown.dq, shown.dk, shown.dv,
            shown_det ? "deterministic" : "NOT DETERMINISTIC");
    case_free(c);
    return failures;
}

static int validate_all(const LabOptions& opt, FILE* log) {
    const bool quick = opt.quick || opt.tiny;
    VariantStats fstats[N_FWD], bstats[N_BWD];
    int failures = 0, cases = 0;
    uint64_t seed = 1000;
    const bool one = opt.shape[0] > 0;  // --shape: this case only (e.g. under a sanitizer)
    if (one) {
        const Shape s = {opt.shape[0], opt.shape[1], opt.shape[2], opt.shape[3], opt.shape[4]};
        failures += validate_case(s, seed, opt, fstats, bstats, log);
        cases++;
    }
    const int hds[] = {16, 32, 64, 128};
    const int ts[] = {1, 7, 64, 129, 1000};
    const int ratios[] = {1, 2, 4, 8};
    const int bs[] = {1, 3};
    for (int hd : hds)
        for (int t : ts)
            for (int ratio : ratios)
                for (int b : bs) {
                    if (one) continue;
                    if (quick && (t == 1000 || b == 3)) continue;
                    if (opt.tiny && (ratio == 4 || t == 7 || t == 1)) continue;
                    // two kv heads for single sequences, one for batches: H from 1 to 16
                    const int kvh = b == 1 ? 2 : 1;
                    Shape s = {b, t, ratio * kvh, kvh, hd};
                    failures += validate_case(s, seed++, opt, fstats, bstats, log);
                    cases++;
                }
    // longer sequences: several tiles in every pass, tails that are not a tile multiple
    if (!quick && !one) {
        const Shape longer[] = {{1, 4096, 2, 1, 128}, {2, 2500, 4, 1, 64}, {1, 3001, 8, 2, 32}};
        for (const Shape& s : longer) {
            failures += validate_case(s, seed++, opt, fstats, bstats, log);
            cases++;
        }
    }
    printf("validation: %d cases, tolerance %.0e (relative L2 vs fp64 CPU reference)\n", cases,
           TOLERANCE);
    for (int v = 0; v < N_FWD; v++)
        if (opt.run_fwd(v)) {
            printf("  %-28s worst %.2e  failures %d  nondeterministic %d", forward_variants[v].name,
                   fstats[v].worst, fstats[v].failures, fstats[v].nondeterministic);
            if (forward_variants[v].same_bits_as)
                printf("  bit-identical to %s in %d/%d cases", forward_variants[v].same_bits_as,
                       fstats[v].bit_cases - fstats[v].bit_diff, fstats[v].bit_cases);
            if (fstats[v].skipped)
                printf("  skipped %d cases (head dim or shape not implemented, or no sm_90a)",
                       fstats[v].skipped);
            printf("\n");
        }
    for (int v = 0; v < N_BWD; v++)
        if (opt.run_bwd(v)) {
            printf("  %-28s worst %.2e  failures %d  nondeterministic %d",
                   backward_variants[v].name, bstats[v].worst, bstats[v].failures,
                   bstats[v].nondeterministic);
            if (!backward_variants[v].deterministic)
                printf(" (float atomics: repeats compared within the tolerance)");
            if (backward_variants[v].same_bits_as)
                printf("  bit-identical to %s in %d/%d cases", backward_variants[v].same_bits_as,
                       bstats[v].bit_cases - bstats[v].bit_diff, bstats[v].bit_cases);
            if (bstats[v].skipped)
                printf("  skipped %d cases (head dim or shape not implemented)",
                       bstats[v].skipped);
            printf("\n");
        }
    return failures;
}

// Count of non-finite bf16 values (poison left unwritten shows up here), on the device.
__global__ void lab_count_nonfinite_kernel(const uint16_t* x, int64_t n,
                                           unsigned long long* count) {
    unsigned long long c = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        c += (x[i] & 0x7f80) == 0x7f80;
    if (c) atomicAdd(count, c);
}
// Count of 16-bit elements that differ between a and b, on the device.
__global__ void lab_count_diff_kernel(const uint16_t* a, const uint16_t* b, int64_t n,
                                      unsigned long long* count) {
    unsigned long long c = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        c += a[i] != b[i];
    if (c) atomicAdd(count, c);
}
static long long count_diff16(const void* a, const void* b, size_t n) {
    unsigned long long* d;
    lab_check(cudaMalloc(&d, sizeof(*d)));
    lab_check(cudaMemset(d, 0, sizeof(*d)));
    lab_count_diff_kernel<<<4096, 256>>>(static_cast<const uint16_t*>(a),
                                         static_cast<const uint16_t*>(b), (int64_t)n, d);
    lab_check(cudaGetLastError());
    unsigned long long h;
    lab_check(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
    lab_check(cudaFree(d));
    return (long long)h;
}
static long long count_nonfinite(const void* x, size_t n) {
    unsigned long long* d;
    lab_check(cudaMalloc(&d, sizeof(*d)));
    lab_check(cudaMemset(d, 0, sizeof(*d)));
    lab_count_nonfinite_kernel<<<4096, 256>>>(static_cast<const uint16_t*>(x), (int64_t)n, d);
    lab_check(cudaGetLastError());
    unsigned long long h;
    lab_check(cudaMemcpy(&h, d, sizeof(h), cudaMemcpyDeviceToHost));
    lab_check(cudaFree(d));
    return (long long)h;
}

// ----------------------------------------------------------------------------
// big: T = 131072, offsets past 2^31 elements, sampled rows of the last sequence

static int validate_big(const LabOptions& opt, FILE* log) {
    const Shape s = {3, 131072, 32, 8, 128};
    printf("big: B=%d T=%d H=%d KVH=%d HD=%d, qkv has %.2e elements\n", s.B, s.T, s.H, s.KVH,
           s.HD, (double)s.B * s.T * s.qkv_cols());
    DeviceCase c = case_alloc(s);
    lab_fill_random_kernel<<<4096, 256>>>(c.qkv, (int64_t)c.n_qkv, 77);
    lab_check(cudaGetLastError());
    lab_fill_random_kernel<<<4096, 256>>>(c.dout, (int64_t)c.n_out, 78);
    lab_check(cudaGetLastError());
    poison_forward(c);
    poison_backward(c);
    cudaEvent_t e0, e1, e2;
    lab_check(cudaEventCreate(&e0));
    lab_check(cudaEventCreate(&e1));
    lab_check(cudaEventCreate(&e2));
    lab_check(cudaEventRecord(e0));
    attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
    lab_check(cudaEventRecord(e1));
    attention_backward_bf16(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H, s.KVH, s.HD,
                            nullptr);
    lab_check(cudaEventRecord(e2));
    lab_check(cudaDeviceSynchronize());
    float ms_f, ms_b;
    lab_check(cudaEventElapsedTime(&ms_f, e0, e1));
    lab_check(cudaEventElapsedTime(&ms_b, e1, e2));
    const double flops = 2.0 * s.B * s.H * (double)s.T * s.T * s.HD;
    printf("  forward %.1f ms (%.0f TFLOP/s), backward %.1f ms (%.0f TFLOP/s)\n", ms_f,
           flops / ms_f * 1e-9, ms_b, 2.5 * flops / ms_b * 1e-9);

    // every element written, anywhere
    const long long nan_out = count_nonfinite(c.out, c.n_out);
    const long long nan_dqkv = count_nonfinite(c.dqkv, c.n_qkv);
    long long nan_lse = 0;
    std::vector<float> lse_all = to_host<float>(c.lse, c.n_lse);
    for (float x : lse_all) nan_lse += !std::isfinite(x);
    printf("  non-finite elements: out %lld, lse %lld, dqkv %lld\n", nan_out, nan_lse, nan_dqkv);

    // the last sequence, on the host, as a B=1 problem
    const int b = s.B - 1;
    const Shape s1 = {1, s.T, s.H, s.KVH, s.HD};
    const size_t nq = (size_t)s.T * s.qkv_cols(), no = (size_t)s.T * s.out_cols();
    std::vector<uint16_t> qkv = to_host<uint16_t>(c.qkv + (size_t)b * nq, nq);
    std::vector<uint16_t> dout = to_host<uint16_t>(c.dout + (size_t)b * no, no);
    std::vector<uint16_t> out = to_host<uint16_t>(c.out + (size_t)b * no, no);
    std::vector<uint16_t> dqkv = to_host<uint16_t>(c.dqkv + (size_t)b * nq, nq);
    // lse from the GPU, D = rowsum(dO * O) from the GPU's out: inputs of the dK/dV reference
    std::vector<double> lse((size_t)s.H * s.T), D((size_t)s.H * s.T);
    parallel_for((int64_t)s.H * s.T, [&](int64_t idx) {
        const int i = (int)(idx % s.T), h = (int)(idx / s.T);
        lse[idx] = lse_all[((size_t)b * s.H + h) * s.T + i];
        double acc = 0.0;
        for (int d = 0; d < s.HD; d++) {
            const size_t o = (size_t)i * s.out_cols() + (size_t)h * s.HD + d;
            acc += (double)bf16_to_float(dout[o]) * bf16_to_float(out[o]);
        }
        D[idx] = acc;
    });
    // reference rows and keys in parallel (each is O(T*HD)), errors summed in a fixed order
    const int rows[] = {0, 1, 4095, 65537, s.T - 2, s.T - 1};
    const int keys[] = {0, 63, 70000, s.T - 1};
    const int n_rows = 6, n_keys = 4, row_heads = 5, key_groups = 3;  // heads 0,7,..; kv 0,3,6
    std::vector<float> ref_q((size_t)n_rows * row_heads * 2 * s.HD);  // out, dq per (row, head)
    std::vector<double> ref_lse((size_t)n_rows * row_heads);
    std::vector<float> ref_k((size_t)n_keys * key_groups * 2 * s.HD);  // dk, dv per (key, group)
    parallel_for(n_rows * row_heads, [&](int64_t idx) {
        const int i = rows[idx / row_heads], h = (int)(idx % row_heads) * 7;
        std::vector<double> p(s.T), dp(s.T);
        double rD;
        float* r = &ref_q[(size_t)idx * 2 * s.HD];
        double no_sink_term;
        ref_query_row(s1, 0, NAN, qkv.data(), dout.data(), 0, h, i, p.data(), dp.data(), r,
                      &ref_lse[idx], &rD, r + s.HD, &no_sink_term, nullptr);
    });
    parallel_for(n_keys * key_groups, [&](int64_t idx) {
        const int j = keys[idx / key_groups], g = (int)(idx % key_groups) * 3;
        float* r = &ref_k[(size_t)idx * 2 * s.HD];
        ref_key_row(s1, 0, qkv.data(), dout.data(), lse.data(), D.data(), 0, g, j, r, r + s.HD);
    });
    ErrAcc eo, el, eq, ek, ev;
    for (int idx = 0; idx < n_rows * row_heads; idx++) {
        const int i = rows[idx / row_heads], h = (idx % row_heads) * 7;
        const float* r = &ref_q[(size_t)idx * 2 * s.HD];
        for (int d = 0; d < s.HD; d++) {
            eo.add(bf16_to_float(out[(size_t)i * s.out_cols() + (size_t)h * s.HD + d]), r[d]);
            eq.add(bf16_to_float(dqkv[(size_t)i * s.qkv_cols() + (size_t)h * s.HD + d]),
                   r[s.HD + d]);
        }
        el.add(lse[(size_t)h * s.T + i], ref_lse[idx]);
    }
    for (int idx = 0; idx < n_keys * key_groups; idx++) {
        const int j = keys[idx / key_groups], g = (idx % key_groups) * 3;
        const float* r = &ref_k[(size_t)idx * 2 * s.HD];
        const size_t row = (size_t)j * s.qkv_cols();
        for (int d = 0; d < s.HD; d++) {
            ek.add(bf16_to_float(dqkv[row + (size_t)(s.H + g) * s.HD + d]), r[d]);
            ev.add(bf16_to_float(dqkv[row + (size_t)(s.H + s.KVH + g) * s.HD + d]), r[s.HD + d]);
        }
    }
    Errors e = {eo.rel(), el.rel(), eq.rel(), ek.rel(), ev.rel()};
    const bool ok = e.max() <= TOLERANCE && nan_out + nan_lse + nan_dqkv == 0;
    printf("  sampled rows of sequence %d: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e  %s\n", b,
           e.out, e.lse, e.dq, e.dk, e.dv, ok ? "ok" : "FAIL");
    fprintf(log, "big B=%d T=%d H=%d KVH=%d HD=%d: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e %s\n",
            s.B, s.T, s.H, s.KVH, s.HD, e.out, e.lse, e.dq, e.dk, e.dv, ok ? "ok" : "FAIL");
    int failures = ok ? 0 : 1;

    // forward variants marked `big` (64-bit offsets of their own): same rows, same reference
    bf16* out2;
    float* lse2;
    lab_check(cudaMalloc(&out2, c.n_out * 2));
    lab_check(cudaMalloc(&lse2, c.n_lse * 4));
    for (int v = 1; v < N_FWD; v++) {
        if (!forward_variants[v].big || !opt.run_fwd(v) || !forward_runs(v, s.HD))
            continue;
        lab_check(cudaMemset(out2, 0xff, c.n_out * 2));
        lab_check(cudaMemset(lse2, 0xff, c.n_lse * 4));
        lab_check(cudaEventRecord(e0));
        forward_variants[v].fn(out2, lse2, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
        lab_check(cudaEventRecord(e1));
        lab_check(cudaDeviceSynchronize());
        lab_check(cudaEventElapsedTime(&ms_f, e0, e1));
        const long long nan_out2 = count_nonfinite(out2, c.n_out);
        std::vector<float> lse2_all = to_host<float>(lse2, c.n_lse);
        long long nan_lse2 = 0;
        for (float x : lse2_all) nan_lse2 += !std::isfinite(x);
        std::vector<uint16_t> o2 = to_host<uint16_t>(out2 + (size_t)b * no, no);
        ErrAcc eo2, el2;
        for (int idx = 0; idx < n_rows * row_heads; idx++) {
            const int i = rows[idx / row_heads], h = (idx % row_heads) * 7;
            const float* r = &ref_q[(size_t)idx * 2 * s.HD];
            for (int d = 0; d < s.HD; d++)
                eo2.add(bf16_to_float(o2[(size_t)i * s.out_cols() + (size_t)h * s.HD + d]), r[d]);
            el2.add(lse2_all[((size_t)b * s.H + h) * s.T + i], ref_lse[idx]);
        }
        bool ok2 = std::max(eo2.rel(), el2.rel()) <= TOLERANCE && nan_out2 + nan_lse2 == 0;
        printf("  %-28s forward %.1f ms (%.0f TFLOP/s), non-finite out %lld lse %lld, sampled rows: "
               "out %.2e lse %.2e  %s\n", forward_variants[v].name, ms_f, flops / ms_f * 1e-9,
               nan_out2, nan_lse2, eo2.rel(), el2.rel(), ok2 ? "ok" : "FAIL");
        // Bit for bit, whole tensors, against the C interface's output (c.out, c.lse), when the
        // C interface runs the wgmma forward (HD 64/128 on sm_90a; both ring depths, same bits).
        const char* sb = "kernels";
        if (!strncmp(forward_variants[v].name, "wgmma ws", 8) && attention_uses_wgmma(s.HD)) {
            const long long d_out = count_diff16(out2, c.out, c.n_out);
            long long d_lse = 0;
            for (size_t i = 0; i < c.n_lse; i++) d_lse += memcmp(&lse2_all[i], &lse_all[i], 4) != 0;
            printf("  %-28s whole tensors vs the C interface (%s): %lld out, %lld lse elements "
                   "differ  %s\n", forward_variants[v].name, sb, d_out, d_lse,
                   d_out + d_lse ? "FAIL (not bit-identical)" : "bit-identical");
            fprintf(log, "big %s bitwise vs kernels: %lld out %lld lse differ\n",
                    forward_variants[v].name, d_out, d_lse);
            ok2 = ok2 && d_out + d_lse == 0;
        }
        fprintf(log, "big %s: out %.2e lse %.2e non-finite %lld %lld %s\n", forward_variants[v].name,
                eo2.rel(), el2.rel(), nan_out2, nan_lse2, ok2 ? "ok" : "FAIL");
        failures += ok2 ? 0 : 1;
    }
    lab_check(cudaFree(out2));
    lab_check(cudaFree(lse2));

    // backward variants marked `big` (workspaces and offsets of their own), on the same forward
    // output: same sampled rows and keys, same reference; dqkv and the workspace re-poisoned.
    // A variant whose same_bits_as is the C interface's backward ("wgmma bwd wg2 s3" at HD
    // 64/128 on sm_90a) is also compared with its dqkv, whole tensor, bit for bit: kept here.
    const bool bwd_wg2s3 = attention_uses_wgmma(s.HD) && ATTN_WG_BWD_KV_NWG == 2 &&
                           ATTN_WG_BWD_KV_STAGES == 3 && ATTN_WG_BWD_Q_NWG == 2 &&
                           ATTN_WG_BWD_Q_STAGES == 3;
    bf16* dqkv_kernels = nullptr;
    for (int v = 1; v < N_BWD; v++) {
        const char* sb = backward_variants[v].same_bits_as;
        if (bwd_wg2s3 && !dqkv_kernels && sb && !strcmp(sb, "wgmma bwd wg2 s3") &&
            backward_variants[v].big && opt.run_bwd(v) && backward_runs(v, s.HD)) {
            lab_check(cudaMalloc(&dqkv_kernels, c.n_qkv * 2));
            lab_check(cudaMemcpy(dqkv_kernels, c.dqkv, c.n_qkv * 2, cudaMemcpyDeviceToDevice));
        }
    }
    for (int v = 1; v < N_BWD; v++) {
        if (!backward_variants[v].big || !opt.run_bwd(v) || !backward_runs(v, s.HD))
            continue;
        poison_backward(c);
        lab_check(cudaEventRecord(e0));
        backward_variants[v].fn(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H, s.KVH,
                                s.HD, nullptr);
        lab_check(cudaEventRecord(e1));
        lab_check(cudaDeviceSynchronize());
        lab_check(cudaEventElapsedTime(&ms_b, e0, e1));
        const long long nan_dqkv2 = count_nonfinite(c.dqkv, c.n_qkv);
        std::vector<uint16_t> d2 = to_host<uint16_t>(c.dqkv + (size_t)b * nq, nq);
        ErrAcc eq2, ek2, ev2;
        for (int idx = 0; idx < n_rows * row_heads; idx++) {
            const int i = rows[idx / row_heads], h = (idx % row_heads) * 7;
            const float* r = &ref_q[(size_t)idx * 2 * s.HD];
            for (int d = 0; d < s.HD; d++)
                eq2.add(bf16_to_float(d2[(size_t)i * s.qkv_cols() + (size_t)h * s.HD + d]),
                        r[s.HD + d]);
        }
        for (int idx = 0; idx < n_keys * key_groups; idx++) {
            const int j = keys[idx / key_groups], g = (idx % key_groups) * 3;
            const float* r = &ref_k[(size_t)idx * 2 * s.HD];
            const size_t row = (size_t)j * s.qkv_cols();
            for (int d = 0; d < s.HD; d++) {
                ek2.add(bf16_to_float(d2[row + (size_t)(s.H + g) * s.HD + d]), r[d]);
                ev2.add(bf16_to_float(d2[row + (size_t)(s.H + s.KVH + g) * s.HD + d]),
                        r[s.HD + d]);
            }
        }
        const double worst2 = std::max({eq2.rel(), ek2.rel(), ev2.rel()});
        bool ok2 = worst2 <= TOLERANCE && nan_dqkv2 == 0;
        printf("  %-28s backward %.1f ms (%.0f TFLOP/s), non-finite dqkv %lld, sampled: dq %.2e "
               "dk %.2e dv %.2e  %s\n", backward_variants[v].name, ms_b, 2.5 * flops / ms_b * 1e-9,
               nan_dqkv2, eq2.rel(), ek2.rel(), ev2.rel(), ok2 ? "ok" : "FAIL");
        const char* sb = backward_variants[v].same_bits_as;
        if (dqkv_kernels && sb && !strcmp(sb, "wgmma bwd wg2 s3")) {
            const long long d_dqkv = count_diff16(c.dqkv, dqkv_kernels, c.n_qkv);
            printf("  %-28s whole dqkv vs the C interface (%s): %lld elements differ  %s\n",
                   backward_variants[v].name, sb, d_dqkv,
                   d_dqkv ? "FAIL (not bit-identical)" : "bit-identical");
            fprintf(log, "big %s bitwise vs kernels: %lld dqkv differ\n",
                    backward_variants[v].name, d_dqkv);
            ok2 = ok2 && d_dqkv == 0;
        }
        fprintf(log, "big %s: dq %.2e dk %.2e dv %.2e non-finite %lld %s\n",
                backward_variants[v].name, eq2.rel(), ek2.rel(), ev2.rel(), nan_dqkv2,
                ok2 ? "ok" : "FAIL");
        failures += ok2 ? 0 : 1;
    }
    if (dqkv_kernels) lab_check(cudaFree(dqkv_kernels));
    case_free(c);
    return failures;
}

// ----------------------------------------------------------------------------
// benchmark

static float median_ms(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static void bench(const LabOptions& opt, FILE* log) {
    const int H = 16, KVH = 8, HD = 128, reps = 10;
    // --long adds T=65536 B=1 (forward and backward): 512 query tiles per head of very different
    // cost, and K/V of 32 MiB per kv head (256 MiB in all, far past the 50 MB L2): the regime
    // where K/V traffic from HBM matters (the GQA-packed variants' hypothesis)
    const int n_shapes = opt.long_bench ? 4 : 3;
    const int tb[][2] = {{2048, 16}, {4096, 4}, {16384, 2}, {65536, 1}};
    cudaEvent_t a, z;
    lab_check(cudaEventCreate(&a));
    lab_check(cudaEventCreate(&z));
    printf("benchmark: H=%d KVH=%d HD=%d, median of %d; TFLOP/s with causal forward = "
           "2*B*H*T*T*HD, backward = 2.5x; %% of the ~600 TFLOP/s SDPA forward\n",
           H, KVH, HD, reps);
    for (int shape = 0; shape < n_shapes; shape++) {
        const int* p = tb[shape];
        const Shape s = {p[1], p[0], H, KVH, HD};
        DeviceCase c = case_alloc(s);
        lab_fill_random_kernel<<<2048, 256>>>(c.qkv, (int64_t)c.n_qkv, 5);
        lab_check(cudaGetLastError());
        lab_fill_random_kernel<<<2048, 256>>>(c.dout, (int64_t)c.n_out, 6);
        lab_check(cudaGetLastError());
        const double flops = 2.0 * s.B * s.H * (double)s.T * s.T * s.HD;
        for (int v = 0; v < N_FWD; v++) {
            if (!opt.run_fwd(v) || !forward_runs(v, s.HD)) continue;
            std::vector<float> t;
            for (int r = 0; r < reps + 2; r++) {
                lab_check(cudaEventRecord(a));
                forward_variants[v].fn(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
                lab_check(cudaEventRecord(z));
                lab_check(cudaEventSynchronize(z));
                float ms;
                lab_check(cudaEventElapsedTime(&ms, a, z));
                if (r >= 2) t.push_back(ms);
            }
            const float ms = median_ms(t);
            const double tf = flops / ms * 1e-9;
            printf("  T=%-5d B=%-2d %-28s %8.3f ms %6.1f TFLOP/s (%3.0f%%)\n", s.T, s.B,
                   forward_variants[v].name, ms, tf, 100.0 * tf / 600.0);
            fprintf(log, "bench fwd T=%d B=%d %s %.3f ms %.1f TFLOP/s\n", s.T, s.B,
                    forward_variants[v].name, ms, tf);
        }
        attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
        for (int v = 0; v < N_BWD; v++) {
            if (!opt.run_bwd(v) || !backward_runs(v, s.HD)) continue;
            std::vector<float> t;
            for (int r = 0; r < reps + 2; r++) {
                lab_check(cudaEventRecord(a));
                backward_variants[v].fn(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H,
                                        s.KVH, s.HD, nullptr);
                lab_check(cudaEventRecord(z));
                lab_check(cudaEventSynchronize(z));
                float ms;
                lab_check(cudaEventElapsedTime(&ms, a, z));
                if (r >= 2) t.push_back(ms);
            }
            const float ms = median_ms(t);
            const double tf = 2.5 * flops / ms * 1e-9;
            printf("  T=%-5d B=%-2d %-28s %8.3f ms %6.1f TFLOP/s (%3.0f%%)\n", s.T, s.B,
                   backward_variants[v].name, ms, tf, 100.0 * tf / 600.0);
            fprintf(log, "bench bwd T=%d B=%d %s %.3f ms %.1f TFLOP/s\n", s.T, s.B,
                    backward_variants[v].name, ms, tf);
        }
        case_free(c);
    }
}

// Whether the options select the backward variant called `name` (--bwd I, I,J,..., or all).
static bool lab_bwd_named(const LabOptions& opt, const char* name) {
    for (int v = 0; v < N_BWD; v++)
        if (!strcmp(backward_variants[v].name, name)) return opt.run_bwd(v);
    return false;
}

// Time the three backward passes of the mma.sync backward (the C interface's tile shapes) apart
// (HD=128), to see which one to work on next; then those of the wgmma backward variants.
static void bench_backward_passes(const LabOptions& opt, FILE* log, const Shape& s) {
    constexpr int HD = 128;
    DeviceCase c = case_alloc(s);
    lab_fill_random_kernel<<<2048, 256>>>(c.qkv, (int64_t)c.n_qkv, 7);
    lab_check(cudaGetLastError());
    lab_fill_random_kernel<<<2048, 256>>>(c.dout, (int64_t)c.n_out, 8);
    lab_check(cudaGetLastError());
    attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
    cudaEvent_t ev[4];
    for (auto& e : ev) lab_check(cudaEventCreate(&e));
    std::vector<float> t[3];
    for (int r = 0; r < 12; r++) {
        lab_check(cudaEventRecord(ev[0]));
        attention_backward_dot<HD>(c.ws, c.dout, c.out, s.B, s.T, s.H, "bench_backward_passes",
                                   nullptr);
        lab_check(cudaEventRecord(ev[1]));
        attention_backward_dkdv_launch<HD, ATTN_KV_WARPS, ATTN_KV_BRQ>(
            c.dqkv, c.dout, c.qkv, c.lse, c.ws, s.B, s.T, s.H, s.KVH, nullptr);
        lab_check(cudaEventRecord(ev[2]));
        attention_backward_dq_launch<HD, ATTN_Q_WARPS, ATTN_Q_BC>(c.dqkv, c.dout, c.qkv, c.lse,
                                                                  c.ws, s.B, s.T, s.H, s.KVH,
                                                                  nullptr);
        lab_check(cudaEventRecord(ev[3]));
        lab_check(cudaEventSynchronize(ev[3]));
        lab_check(cudaGetLastError());
        for (int k = 0; k < 3; k++) {
            float ms;
            lab_check(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
            if (r >= 2) t[k].push_back(ms);
        }
    }
    const double flops = 2.0 * s.B * s.H * (double)s.T * s.T * s.HD;  // one causal matmul pair
    const float d = median_ms(t[0]), kv = median_ms(t[1]), q = median_ms(t[2]);
    printf("backward passes, T=%d B=%d: D %.3f ms | dK,dV %.3f ms (%.0f TFLOP/s of 4 matmuls) | "
           "dQ %.3f ms (%.0f TFLOP/s of 3 matmuls)\n",
           s.T, s.B, d, kv, 2.0 * flops / kv * 1e-9, q, 1.5 * flops / q * 1e-9);
    fprintf(log, "backward passes T=%d B=%d: D %.3f ms, dKdV %.3f ms, dQ %.3f ms\n", s.T, s.B, d,
            kv, q);

    typedef void (*TimedFn)(void*, const void*, const void*, const void*, const float*, void*,
                            int, int, int, int, int, void*, cudaEvent_t*);
    // The wgmma backward variants (kernels/attention_bwd_wgmma.cuh), same shape and passes as
    // the C interface's: D | dK, dV (4 matmuls) | dQ (3 matmuls); the atomic-dQ ones
    // (dev/cuda/attention_bwd_atomic.cuh): zeroing and D | dK, dV, dQ (5 matmuls) | dQ
    // conversion (none).
    const struct {
        const char* name;
        TimedFn fn;
        const char *kv_pass, *q_pass;
        int kv_matmuls, q_matmuls;
    } wgmma_bwd[] = {
        {"wgmma bwd wg2 s3", lab_backward_wgmma_timed<2, 3, 2, 3>, "dK,dV", "dQ", 4, 3},
        {"wgmma bwd wg1 s2", lab_backward_wgmma_timed<1, 2, 1, 2>, "dK,dV", "dQ", 4, 3},
        {"wgmma bwd atomic dq s3", attention_backward_atomic_timed<3, false>, "dK,dV,dQ",
         "dQ convert", 5, 0},
        {"wgmma bwd atomic dq s2", attention_backward_atomic_timed<2, false>, "dK,dV,dQ",
         "dQ convert", 5, 0},
        {"wgmma bwd bulk dq s3", attention_backward_atomic_timed<3, true>, "dK,dV,dQ",
         "dQ convert", 5, 0}};
    for (const auto& o : wgmma_bwd) {
        if (!lab_bwd_named(opt, o.name)) continue;
        if (!lab_wgmma_supports(HD)) break;
        std::vector<float> tw[3];
        for (int r = 0; r < 12; r++) {
            lab_check(cudaEventRecord(ev[0]));
            o.fn(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H, s.KVH, s.HD, nullptr,
                 &ev[1]);
            lab_check(cudaEventRecord(ev[3]));
            lab_check(cudaEventSynchronize(ev[3]));
            lab_check(cudaGetLastError());
            for (int k = 0; k < 3; k++) {
                float ms;
                lab_check(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
                if (r >= 2) tw[k].push_back(ms);
            }
        }
        const float wd = median_ms(tw[0]), wkv = median_ms(tw[1]), wq = median_ms(tw[2]);
        // one causal matmul = flops / 2
        printf("%s passes, T=%d B=%d: D %.3f ms | %s %.3f ms (%.0f TFLOP/s of %d matmuls) | "
               "%s %.3f ms", o.name, s.T, s.B, wd, o.kv_pass, wkv,
               0.5 * o.kv_matmuls * flops / wkv * 1e-9, o.kv_matmuls, o.q_pass, wq);
        if (o.q_matmuls)
            printf(" (%.0f TFLOP/s of %d matmuls)", 0.5 * o.q_matmuls * flops / wq * 1e-9,
                   o.q_matmuls);
        printf("\n");
        fprintf(log, "%s passes T=%d B=%d: D %.3f ms, dKdV %.3f ms, dQ %.3f ms\n", o.name, s.T,
                s.B, wd, wkv, wq);
    }
    case_free(c);
}

// ----------------------------------------------------------------------------
// sinks and sliding windows (GPT-OSS): --sink
//
// The kernels' compile-time option SW (kernels/attention_common.cuh): key j visible to query i
// iff i - window < j <= i, one learned logit per head (bf16) in each row's softmax denominator.
//   validation: the C interface (attention_sink_forward_bf16 / attention_sink_backward_bf16:
//     wgmma at HD 64/128 on an sm_90a build, else mma.sync), the mma.sync SW kernels called
//     directly (the C interface's shapes) and the wgmma forward with 2-stage rings (the C
//     interface's choice from T = 32768 on), against an fp64 CPU reference with the window and
//     the sinks: out, lse, dq, dk, dv and dsinks (relative L2, TOLERANCE; the backward's reference
//     takes D from the variant's own bf16 output, as the kernels do); every run twice, bit
//     for bit; outputs poisoned with NaN first. Then the option off (sinks NULL, window 0)
//     against the causal C interface, bit for bit.
//   benchmark: the GPT-OSS attention (H 64, KVH 8, HD 64) at T = 2048, B = 13 (one micro-batch
//     of 26,624 rows): causal without sinks (the old path), causal with sinks, window 128 with
//     sinks. TFLOP/s over the pairs (query, key) actually visible, and the speed-up over causal.



// A way to run the sink attention: forward, and backward (dsinks += from the workspace's D).
typedef void (*SinkForwardFn)(void* out, float* lse, const void* qkv, const void* sinks, int B,
                              int T, int H, int KVH, int HD, int window);
typedef void (*SinkBackwardFn)(void* dqkv, float* dsinks, const void* dout, const void* qkv,
                               const void* out, const float* lse, const void* sinks, void* ws,
                               int B, int T, int H, int KVH, int HD, int window);
struct SinkVariant {
    const char* name;
    SinkForwardFn fwd;
    SinkBackwardFn bwd;  // nullptr: forward only
    int (*supports)(int HD);
};

static void sink_fwd_kernels(void* out, float* lse, const void* qkv, const void* sinks, int B,
                             int T, int H, int KVH, int HD, int window) {
    attention_sink_forward_bf16(out, lse, qkv, sinks, B, T, H, KVH, HD, window, nullptr);
}
static void sink_bwd_kernels(void* dqkv, float* dsinks, const void* dout, const void* qkv,
                             const void* out, const float* lse, const void* sinks, void* ws,
                             int B, int T, int H, int KVH, int HD, int window) {
    attention_sink_backward_bf16(dqkv, dsinks, dout, qkv, out, lse, sinks, ws, B, T, H, KVH, HD,
                                 window, nullptr);
}
// The mma.sync SW kernels with the C interface's tile shapes (what runs off Hopper).
static void sink_fwd_mma(void* out, float* lse, const void* qkv, const void* sinks, int B, int T,
                         int H, int KVH, int HD, int window) {
    const char* fn = "sink lab mma.sync forward";
    if (!attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD)) return;
    attention_forward_mma_hd<ATTN_FWD_MT, ATTN_FWD_WARPS, ATTN_FWD_BC, ATTN_FWD_MINB, true>(
        static_cast<bf16*>(out), lse, static_cast<const bf16*>(qkv), B, T, H, KVH, HD, nullptr,
        static_cast<const bf16*>(sinks), attention_window_for_kernels(fn, window, T));
}
static void sink_bwd_mma(void* dqkv, float* dsinks, const void* dout, const void* qkv,
                         const void* out, const float* lse, const void* sinks, void* ws, int B,
                         int T, int H, int KVH, int HD, int window) {
    const char* fn = "sink lab mma.sync backward";
    if (!attention_backward_check(fn, dqkv, dout, qkv, out, lse, ws, B, T, H, KVH, HD)) return;
    attention_backward_mma_hd<ATTN_KV_WARPS, ATTN_KV_BRQ, ATTN_Q_WARPS, ATTN_Q_BC, true>(
        static_cast<bf16*>(dqkv), static_cast<const bf16*>(dout), static_cast<const bf16*>(qkv),
        static_cast<const bf16*>(out), lse, static_cast<float*>(ws), B, T, H, KVH, HD, nullptr,
        attention_window_for_kernels(fn, window, T));
    attention_sink_dsinks_bf16(dsinks, sinks, lse, static_cast<const float*>(ws), B, T, H,
                               nullptr);
}
// The wgmma forward with 2-stage rings (the C interface's from T = 32768 on).
static void sink_fwd_wgmma_k2v2(void* out, float* lse, const void* qkv, const void* sinks, int B,
                                int T, int H, int KVH, int HD, int window) {
    const char* fn = "sink lab wgmma k2v2 forward";
    lab_require_wgmma(fn, HD);
    if (!attention_forward_check(fn, out, lse, qkv, B, T, H, KVH, HD)) return;
    attention_forward_wgmma_hd<2, 2, true>(static_cast<bf16*>(out), lse,
                                           static_cast<const bf16*>(qkv), B, T, H, KVH, HD,
                                           nullptr, static_cast<const bf16*>(sinks),
                                           attention_window_for_kernels(fn, window, T));
}

static const SinkVariant sink_variants[] = {
    {"kernels", sink_fwd_kernels, sink_bwd_kernels, nullptr},
    {"mma.sync SW", sink_fwd_mma, sink_bwd_mma, nullptr},
    {"wgmma SW k2v2 (fwd)", sink_fwd_wgmma_k2v2, nullptr, lab_wgmma_supports},
};
#define N_SINK ((int)(sizeof(sink_variants) / sizeof(sink_variants[0])))

struct SinkCaseSpec {
    int B, T, H, KVH, HD, window;
    bool sinks;
};

// One case: the reference once, every variant twice (bit for bit). Returns the failures.
static int sink_validate_case(const SinkCaseSpec& k, uint64_t seed, FILE* log) {
    const Shape s = {k.B, k.T, k.H, k.KVH, k.HD};
    std::vector<uint16_t> qkv((size_t)s.B * s.T * s.qkv_cols()),
        dout((size_t)s.B * s.T * s.out_cols());
    fill_random(qkv, seed * 2 + 1);
    fill_random(dout, seed * 2 + 2);
    std::vector<uint16_t> sinks16;
    std::vector<float> sinks;
    if (k.sinks)
        for (int h = 0; h < s.H; h++) {
            // a few units: comparable to the logits, so the sink takes a real share of a row
            const float x = 2.0f * normal_from_hash(splitmix64(seed * 7919 + h));
            sinks16.push_back(float_to_bf16(x));
            sinks.push_back(bf16_to_float(sinks16.back()));
        }
    Reference ref;
    std::vector<double> ref_ds;
    ref_attention(s, k.window, sinks, qkv, dout, ref, ref_ds);

    DeviceCase c = case_alloc(s);
    bf16* d_sinks = nullptr;
    float* d_ds = nullptr;
    lab_check(cudaMalloc(&d_ds, s.H * sizeof(float)));
    if (k.sinks) {
        lab_check(cudaMalloc(&d_sinks, s.H * sizeof(bf16)));
        lab_check(cudaMemcpy(d_sinks, sinks16.data(), s.H * 2, cudaMemcpyHostToDevice));
    }
    lab_check(cudaMemcpy(c.qkv, qkv.data(), c.n_qkv * 2, cudaMemcpyHostToDevice));
    lab_check(cudaMemcpy(c.dout, dout.data(), c.n_out * 2, cudaMemcpyHostToDevice));
    int failures = 0;
    for (int v = 0; v < N_SINK; v++) {
        const SinkVariant& sv = sink_variants[v];
        if (sv.supports && !sv.supports(s.HD)) continue;
        std::vector<uint16_t> out[2], dqkv[2];
        std::vector<float> lse[2], ds[2];
        for (int rep = 0; rep < 2; rep++) {
            poison_forward(c);
            sv.fwd(c.out, c.lse, c.qkv, d_sinks, s.B, s.T, s.H, s.KVH, s.HD, k.window);
            lab_check(cudaDeviceSynchronize());
            out[rep] = to_host<uint16_t>(c.out, c.n_out);
            lse[rep] = to_host<float>(c.lse, c.n_lse);
            if (!sv.bwd) continue;
            poison_backward(c);
            lab_check(cudaMemset(d_ds, 0, s.H * sizeof(float)));
            sv.bwd(c.dqkv, d_ds, c.dout, c.qkv, c.out, c.lse, d_sinks, c.ws, s.B, s.T, s.H,
                   s.KVH, s.HD, k.window);
            lab_check(cudaDeviceSynchronize());
            dqkv[rep] = to_host<uint16_t>(c.dqkv, c.n_qkv);
            ds[rep] = to_host<float>(d_ds, s.H);
        }
        Errors e = {0, 0, 0, 0, 0};
        errors_forward(s, out[0], lse[0], ref, e);
        ErrAcc eds;
        if (sv.bwd) {
            // the backward against the reference given this variant's own output (its D)
            Reference rb;
            std::vector<double> rb_ds;
            ref_attention(s, k.window, sinks, qkv, dout, rb, rb_ds, &out[0]);
            errors_backward(s, dqkv[0], rb.dqkv, e);
            for (int h = 0; h < s.H; h++) eds.add(ds[0][h], rb_ds[h]);
        }
        const double e_ds = k.sinks ? eds.rel() : 0.0;
        bool ds_zero = true;  // without sinks dsinks is left alone (here: stays 0)
        if (sv.bwd && !k.sinks)
            for (int h = 0; h < s.H; h++) ds_zero &= ds[0][h] == 0.0f;
        const bool same = out[0] == out[1] && lse[0] == lse[1] && dqkv[0] == dqkv[1] &&
                          ds[0] == ds[1];
        const bool ok = e.max() <= TOLERANCE && e_ds <= TOLERANCE && same && ds_zero;
        failures += !ok;
        printf("  %-20s B=%d T=%-5d H=%-2d KVH=%d HD=%-3d window=%-4d %s  out %.1e lse %.1e "
               "dq %.1e dk %.1e dv %.1e dsinks %.1e%s%s\n",
               sv.name, s.B, s.T, s.H, s.KVH, s.HD, k.window, k.sinks ? "sinks" : "     ", e.out,
               e.lse, e.dq, e.dk, e.dv, e_ds, same ? "" : "  NOT DETERMINISTIC",
               ok ? "" : "  FAILED");
        fprintf(log, "sink %s B=%d T=%d H=%d KVH=%d HD=%d window=%d sinks=%d: out %.3g lse %.3g "
                "dq %.3g dk %.3g dv %.3g dsinks %.3g same %d ok %d\n", sv.name, s.B, s.T, s.H,
                s.KVH, s.HD, k.window, (int)k.sinks, e.out, e.lse, e.dq, e.dk, e.dv, e_ds,
                (int)same, (int)ok);
    }
    if (d_sinks) lab_check(cudaFree(d_sinks));
    lab_check(cudaFree(d_ds));
    case_free(c);
    return failures;
}

// The option off: sinks NULL and window 0 through the sink C interface must reproduce the
// causal C interface bit for bit (out, lse, dqkv). Returns the failures.
static int sink_check_option_off(const Shape& s, FILE* log) {
    DeviceCase c = case_alloc(s);
    lab_fill_random_kernel<<<2048, 256>>>(c.qkv, (int64_t)c.n_qkv, 11);
    lab_check(cudaGetLastError());
    lab_fill_random_kernel<<<2048, 256>>>(c.dout, (int64_t)c.n_out, 12);
    lab_check(cudaGetLastError());
    bf16 *out2, *dqkv2;
    float* lse2;
    lab_check(cudaMalloc(&out2, c.n_out * 2));
    lab_check(cudaMalloc(&dqkv2, c.n_qkv * 2));
    lab_check(cudaMalloc(&lse2, c.n_lse * 4));
    attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
    attention_sink_forward_bf16(out2, lse2, c.qkv, nullptr, s.B, s.T, s.H, s.KVH, s.HD, 0,
                                nullptr);
    attention_backward_bf16(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H, s.KVH,
                            s.HD, nullptr);
    attention_sink_backward_bf16(dqkv2, nullptr, c.dout, c.qkv, c.out, c.lse, nullptr, c.ws, s.B,
                                 s.T, s.H, s.KVH, s.HD, 0, nullptr);
    lab_check(cudaDeviceSynchronize());
    const long long d_out = count_diff16(c.out, out2, c.n_out);
    const long long d_lse = count_diff16(c.lse, lse2, 2 * c.n_lse);
    const long long d_dqkv = count_diff16(c.dqkv, dqkv2, c.n_qkv);
    const bool ok = d_out == 0 && d_lse == 0 && d_dqkv == 0;
    printf("  option off vs causal  B=%d T=%-5d H=%-2d KVH=%d HD=%-3d  differing 16-bit words: "
           "out %lld lse %lld dqkv %lld%s\n", s.B, s.T, s.H, s.KVH, s.HD, d_out, d_lse, d_dqkv,
           ok ? "" : "  FAILED");
    fprintf(log, "sink option off B=%d T=%d H=%d KVH=%d HD=%d: diff out %lld lse %lld dqkv %lld\n",
            s.B, s.T, s.H, s.KVH, s.HD, d_out, d_lse, d_dqkv);
    lab_check(cudaFree(out2));
    lab_check(cudaFree(dqkv2));
    lab_check(cudaFree(lse2));
    case_free(c);
    return ok ? 0 : 1;
}

static int sink_validate_all(FILE* log) {
    const uint64_t seed = (uint64_t)time(nullptr);
    printf("sink/window validation (seed %llu): relative L2 vs the fp64 reference, tolerance "
           "%.0e; each run twice, bit for bit\n", (unsigned long long)seed, TOLERANCE);
    fprintf(log, "sink validation seed %llu\n", (unsigned long long)seed);
    int failures = 0;
    const int hds[] = {16, 32, 64, 128};
    // tails that are no tile multiple, windows of 1, below a tile, of several tiles, longer than
    // T, none; sinks and none; B > 1; GQA and not
    const SinkCaseSpec base[] = {
        {1, 1, 2, 1, 0, 1, true},     {2, 77, 4, 2, 0, 16, true},   {1, 300, 8, 2, 0, 128, true},
        {1, 300, 4, 4, 0, 1, true},   {2, 129, 4, 1, 0, 1000, true}, {1, 1000, 4, 2, 0, 200, false},
        {1, 1000, 4, 2, 0, 0, true},  {3, 257, 2, 1, 0, 64, true},  {1, 700, 2, 1, 0, 384, true},
    };
    uint64_t n = 0;
    for (int hd : hds)
        for (SinkCaseSpec k : base) {
            k.HD = hd;
            failures += sink_validate_case(k, seed + n++, log);
            fflush(stdout);
        }
    // GPT-OSS: H 64, KVH 8, HD 64, window 128 at T 2048; its full-causal layers with sinks
    failures += sink_validate_case({1, 2048, 64, 8, 64, 128, true}, seed + n++, log);
    failures += sink_validate_case({1, 1024, 16, 2, 64, 0, true}, seed + n++, log);
    const Shape off[] = {{2, 1000, 8, 2, 64}, {1, 700, 4, 2, 128}, {2, 333, 4, 2, 32},
                         {1, 129, 2, 1, 16}};
    for (const Shape& s : off) failures += sink_check_option_off(s, log);
    printf("sink/window validation: %d failures\n", failures);
    return failures;
}

// GPT-OSS attention at one micro-batch: causal (the old path), causal with sinks, window 128
// with sinks; forward and backward, median of 10.
static void sink_bench(FILE* log) {
    const Shape s = {13, 2048, 64, 8, 64};
    const int reps = 10;
    DeviceCase c = case_alloc(s);
    lab_fill_random_kernel<<<2048, 256>>>(c.qkv, (int64_t)c.n_qkv, 21);
    lab_check(cudaGetLastError());
    lab_fill_random_kernel<<<2048, 256>>>(c.dout, (int64_t)c.n_out, 22);
    lab_check(cudaGetLastError());
    bf16* d_sinks;
    float* d_ds;
    lab_check(cudaMalloc(&d_sinks, s.H * sizeof(bf16)));
    lab_check(cudaMalloc(&d_ds, s.H * sizeof(float)));
    lab_fill_random_kernel<<<1, 64>>>(d_sinks, s.H, 23);
    lab_check(cudaGetLastError());
    lab_check(cudaMemset(d_ds, 0, s.H * sizeof(float)));
    cudaEvent_t a, z;
    lab_check(cudaEventCreate(&a));
    lab_check(cudaEventCreate(&z));
    auto time_ms = [&](auto fn) {
        std::vector<float> t;
        for (int r = 0; r < reps + 2; r++) {
            lab_check(cudaEventRecord(a));
            fn();
            lab_check(cudaEventRecord(z));
            lab_check(cudaEventSynchronize(z));
            float ms;
            lab_check(cudaEventElapsedTime(&ms, a, z));
            if (r >= 2) t.push_back(ms);
        }
        return median_ms(t);
    };
    printf("sink/window benchmark: GPT-OSS attention B=%d T=%d H=%d KVH=%d HD=%d (%s), median "
           "of %d; TFLOP/s over the visible (query, key) pairs: forward 4*pairs*HD, backward "
           "2.5x\n", s.B, s.T, s.H, s.KVH, s.HD, attention_uses_wgmma(s.HD) ? "wgmma" : "mma.sync",
           reps);
    struct Mode {
        const char* name;
        int window;
        bool sinks, old_path;
    } modes[] = {{"causal (old path)", 0, false, true},
                 {"causal + sinks", 0, true, false},
                 {"window 128 + sinks", 128, true, false}};
    float causal_fwd = 0.0f, causal_bwd = 0.0f;
    for (const Mode& m : modes) {
        const bf16* sk = m.sinks ? d_sinks : nullptr;
        const double w = m.window > 0 ? m.window : s.T;
        const double pairs = w * (w + 1) / 2 + ((double)s.T - w) * w;
        const double flops = 4.0 * s.B * s.H * pairs * s.HD;
        const float f = time_ms([&] {
            if (m.old_path)
                attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
            else
                attention_sink_forward_bf16(c.out, c.lse, c.qkv, sk, s.B, s.T, s.H, s.KVH, s.HD,
                                            m.window, nullptr);
        });
        const float b = time_ms([&] {
            if (m.old_path)
                attention_backward_bf16(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H,
                                        s.KVH, s.HD, nullptr);
            else
                attention_sink_backward_bf16(c.dqkv, m.sinks ? d_ds : nullptr, c.dout, c.qkv,
                                             c.out, c.lse, sk, c.ws, s.B, s.T, s.H, s.KVH, s.HD,
                                             m.window, nullptr);
        });
        if (m.old_path) causal_fwd = f, causal_bwd = b;
        printf("  %-20s fwd %7.3f ms %6.1f TFLOP/s (x%.2f vs causal)   bwd %7.3f ms %6.1f "
               "TFLOP/s (x%.2f)\n", m.name, f, flops / f * 1e-9, causal_fwd / f, b,
               2.5 * flops / b * 1e-9, causal_bwd / b);
        fprintf(log, "sink bench %s: fwd %.3f ms %.1f TFLOP/s, bwd %.3f ms %.1f TFLOP/s\n",
                m.name, f, flops / f * 1e-9, b, 2.5 * flops / b * 1e-9);
    }
    lab_check(cudaFree(d_sinks));
    lab_check(cudaFree(d_ds));
    case_free(c);
}

// [refactor check: begin]
// ----------------------------------------------------------------------------
// refactor check: this build's outputs bit for bit, and its speed, against another build of the
// lab (dev/cuda/check_attention_refactor.sh). The script splices this block, from the marker
// above to the one at its end, into an older lab that lacks it (with the one line in main that
// calls check_main), so it uses only what every version of this lab has: Shape, DeviceCase and
// its helpers, fill_random, the variant tables, median_ms.
//   --check-dump FILE        every forward variant and every deterministic backward variant on
//                            the fixed cases below, outputs -> FILE
//   --check-compare A B      the dumps of two builds, per (variant, case, tensor): elements that
//                            differ; exit 0 when every tensor is bit-identical and none missing
//   --check-time B,T,H,KVH,HD FWD BWD [REPS]   median ms and TFLOP/s of the forward variants
//                            FWD and the backward variants BWD (index lists, "-" for none)

#include <map>
#include <string>

// Every head dim, GQA and plain, tails that are no tile multiple, several tiles in every pass,
// and the C interface's long-sequence forward (its 2-stage rings from T = 32768 on).
static const Shape check_cases[] = {
    {1, 1, 2, 1, 16},       {1, 7, 4, 2, 32},     {3, 129, 4, 1, 64},   {1, 1000, 8, 2, 128},
    {2, 257, 2, 2, 16},     {1, 1000, 4, 4, 32},  {2, 2500, 4, 1, 64},  {1, 4096, 8, 2, 128},
    {1, 3001, 8, 2, 32},    {1, 32769, 1, 1, 128}, {1, 32800, 2, 1, 64},
};
static const char* const check_tensor_names[] = {"out", "lse", "dq", "dk", "dv"};

static void check_fwrite(FILE* f, const void* p, size_t bytes, const char* path) {
    if (bytes && fwrite(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "attention lab: cannot write %s\n", path);
        exit(1);
    }
}
// One record: name length (u32), name, B T H KVH HD tensor (i32 each), byte count (u64), bytes.
static void check_write_record(FILE* f, const char* path, const char* variant, const Shape& s,
                               int tensor, const void* data, uint64_t bytes) {
    const uint32_t len = (uint32_t)strlen(variant);
    const int32_t head[6] = {s.B, s.T, s.H, s.KVH, s.HD, tensor};
    check_fwrite(f, &len, sizeof(len), path);
    check_fwrite(f, variant, len, path);
    check_fwrite(f, head, sizeof(head), path);
    check_fwrite(f, &bytes, sizeof(bytes), path);
    check_fwrite(f, data, bytes, path);
}

static int check_dump(const char* path) {
    FILE* f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "attention lab: cannot open %s for writing\n", path);
        return 1;
    }
    check_fwrite(f, "ATTNCHK1", 8, path);
    const int n_cases = (int)(sizeof(check_cases) / sizeof(check_cases[0]));
    for (int k = 0; k < n_cases; k++) {
        const Shape& s = check_cases[k];
        std::vector<uint16_t> qkv((size_t)s.B * s.T * s.qkv_cols()),
            dout((size_t)s.B * s.T * s.out_cols());
        fill_random(qkv, 2 * (500 + k) + 1);
        fill_random(dout, 2 * (500 + k) + 2);
        DeviceCase c = case_alloc(s);
        lab_check(cudaMemcpy(c.qkv, qkv.data(), qkv.size() * 2, cudaMemcpyHostToDevice));
        lab_check(cudaMemcpy(c.dout, dout.data(), dout.size() * 2, cudaMemcpyHostToDevice));
        int records = 0;
        for (int v = 0; v < N_FWD; v++) {
            if (!forward_runs(v, s.HD)) continue;
            poison_forward(c);
            forward_variants[v].fn(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
            lab_check(cudaDeviceSynchronize());
            std::vector<uint16_t> out = to_host<uint16_t>(c.out, c.n_out);
            std::vector<float> lse = to_host<float>(c.lse, c.n_lse);
            check_write_record(f, path, forward_variants[v].name, s, 0, out.data(), out.size() * 2);
            check_write_record(f, path, forward_variants[v].name, s, 1, lse.data(), lse.size() * 4);
            records += 2;
        }
        // the backward's inputs: the C interface's forward
        poison_forward(c);
        attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
        lab_check(cudaDeviceSynchronize());
        const int64_t rows = (int64_t)s.B * s.T, QKV = s.qkv_cols();
        const int64_t qc = (int64_t)s.H * s.HD, kc = (int64_t)s.KVH * s.HD;
        for (int v = 0; v < N_BWD; v++) {
            if (!backward_variants[v].deterministic || !backward_runs(v, s.HD)) continue;
            poison_backward(c);
            backward_variants[v].fn(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H,
                                    s.KVH, s.HD, nullptr);
            lab_check(cudaDeviceSynchronize());
            std::vector<uint16_t> dqkv = to_host<uint16_t>(c.dqkv, c.n_qkv);
            std::vector<uint16_t> dq((size_t)(rows * qc)), dk((size_t)(rows * kc)),
                dv((size_t)(rows * kc));
            for (int64_t r = 0; r < rows; r++) {
                const uint16_t* row = &dqkv[(size_t)(r * QKV)];
                memcpy(&dq[(size_t)(r * qc)], row, (size_t)qc * 2);
                memcpy(&dk[(size_t)(r * kc)], row + qc, (size_t)kc * 2);
                memcpy(&dv[(size_t)(r * kc)], row + qc + kc, (size_t)kc * 2);
            }
            check_write_record(f, path, backward_variants[v].name, s, 2, dq.data(), dq.size() * 2);
            check_write_record(f, path, backward_variants[v].name, s, 3, dk.data(), dk.size() * 2);
            check_write_record(f, path, backward_variants[v].name, s, 4, dv.data(), dv.size() * 2);
            records += 3;
        }
        case_free(c);
        printf("check-dump: B=%d T=%d H=%d KVH=%d HD=%d: %d tensors\n", s.B, s.T, s.H, s.KVH, s.HD,
               records);
        fflush(stdout);
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "attention lab: cannot write %s\n", path);
        return 1;
    }
    return 0;
}

struct CheckRecord {
    std::string key;  // variant | shape | tensor, printable
    int tensor;
    std::vector<unsigned char> bytes;
};
// The next record of a dump, false at its end; a truncated or foreign file exits.
static bool check_read_record(FILE* f, const char* path, CheckRecord& r) {
    uint32_t len;
    if (fread(&len, sizeof(len), 1, f) != 1) return false;
    std::string name(len, ' ');
    int32_t head[6];
    uint64_t bytes;
    if (len > 4096 || fread(&name[0], 1, len, f) != len || fread(head, sizeof(head), 1, f) != 1 ||
        fread(&bytes, sizeof(bytes), 1, f) != 1 || head[5] < 0 || head[5] > 4) {
        fprintf(stderr, "attention lab: %s: not a --check-dump file or truncated\n", path);
        exit(1);
    }
    char shape[96];
    snprintf(shape, sizeof(shape), "B=%d T=%d H=%d KVH=%d HD=%d %s", head[0], head[1], head[2],
             head[3], head[4], check_tensor_names[head[5]]);
    r.key = name + " | " + shape;
    r.tensor = head[5];
    r.bytes.resize((size_t)bytes);
    if (bytes && fread(r.bytes.data(), 1, (size_t)bytes, f) != bytes) {
        fprintf(stderr, "attention lab: %s: truncated\n", path);
        exit(1);
    }
    return true;
}
static FILE* check_open_dump(const char* path) {
    FILE* f = fopen(path, "rb");
    char magic[8];
    if (!f || fread(magic, 1, 8, f) != 8 || memcmp(magic, "ATTNCHK1", 8) != 0) {
        fprintf(stderr, "attention lab: %s: cannot open or not a --check-dump file\n", path);
        exit(1);
    }
    return f;
}

static int check_compare(const char* path_a, const char* path_b) {
    std::map<std::string, CheckRecord> a;
    std::vector<std::string> order_a;
    FILE* fa = check_open_dump(path_a);
    CheckRecord r;
    while (check_read_record(fa, path_a, r)) {
        order_a.push_back(r.key);
        a[r.key] = r;
    }
    fclose(fa);
    FILE* fb = check_open_dump(path_b);
    int same = 0, differ = 0, only_b = 0;
    while (check_read_record(fb, path_b, r)) {
        auto it = a.find(r.key);
        if (it == a.end()) {
            printf("  only in %s: %s\n", path_b, r.key.c_str());
            only_b++;
            continue;
        }
        const std::vector<unsigned char>& x = it->second.bytes;
        const size_t elt = r.tensor == 1 ? 4 : 2;  // lse fp32, the others bf16
        long long n_diff = 0, first = -1;
        if (x.size() != r.bytes.size()) {
            n_diff = -1;
        } else {
            for (size_t i = 0; i < x.size(); i += elt)
                if (memcmp(&x[i], &r.bytes[i], elt) != 0) {
                    if (first < 0) first = (long long)(i / elt);
                    n_diff++;
                }
        }
        if (n_diff == 0) {
            same++;
        } else {
            differ++;
            if (n_diff < 0)
                printf("  DIFFER %s: sizes %zu and %zu bytes\n", r.key.c_str(), x.size(),
                       r.bytes.size());
            else
                printf("  DIFFER %s: %lld of %zu elements (first at %lld)\n", r.key.c_str(),
                       n_diff, x.size() / elt, first);
        }
        a.erase(it);
    }
    fclose(fb);
    for (const std::string& k : order_a)
        if (a.count(k)) printf("  only in %s: %s\n", path_a, k.c_str());
    const int only_a = (int)a.size();
    printf("check-compare: %d tensors bit-identical, %d differ, %d only in %s, %d only in %s\n",
           same, differ, only_a, path_a, only_b, path_b);
    return differ || only_a || only_b || same == 0 ? 3 : 0;
}

// "I,J,..." -> indices below n (each checked), "-" -> none.
static std::vector<int> check_parse_list(const char* a, int n) {
    std::vector<int> v;
    if (!strcmp(a, "-")) return v;
    for (const char* p = a; *p;) {
        char* end;
        const long x = strtol(p, &end, 10);
        if (end == p || x < 0 || x >= n || (*end != ',' && *end != '\0')) {
            fprintf(stderr, "attention lab: bad variant list %s (indices below %d)\n", a, n);
            exit(2);
        }
        v.push_back((int)x);
        p = *end ? end + 1 : end;
    }
    return v;
}

static int check_time(const char* shape, const char* fwd, const char* bwd, int reps) {
    Shape s;
    if (sscanf(shape, "%d,%d,%d,%d,%d", &s.B, &s.T, &s.H, &s.KVH, &s.HD) != 5 || s.B < 1 ||
        s.T < 1 || s.H < 1 || s.KVH < 1 || s.H % s.KVH != 0 || reps < 1) {
        fprintf(stderr, "attention lab: --check-time wants B,T,H,KVH,HD (KVH divides H)\n");
        return 2;
    }
    const std::vector<int> fv = check_parse_list(fwd, N_FWD), bv = check_parse_list(bwd, N_BWD);
    DeviceCase c = case_alloc(s);
    lab_fill_random_kernel<<<2048, 256>>>(c.qkv, (int64_t)c.n_qkv, 5);
    lab_check(cudaGetLastError());
    lab_fill_random_kernel<<<2048, 256>>>(c.dout, (int64_t)c.n_out, 6);
    lab_check(cudaGetLastError());
    cudaEvent_t e0, e1;
    lab_check(cudaEventCreate(&e0));
    lab_check(cudaEventCreate(&e1));
    const double flops = 2.0 * s.B * s.H * (double)s.T * s.T * s.HD;
    for (int v : fv) {
        if (!forward_runs(v, s.HD)) {
            printf("check-time fwd %d - - %s (not run: head dim or build)\n", v,
                   forward_variants[v].name);
            continue;
        }
        std::vector<float> t;
        for (int r = 0; r < reps + 2; r++) {
            lab_check(cudaEventRecord(e0));
            forward_variants[v].fn(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
            lab_check(cudaEventRecord(e1));
            lab_check(cudaEventSynchronize(e1));
            float ms;
            lab_check(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) t.push_back(ms);
        }
        const float ms = median_ms(t);
        printf("check-time fwd %d %.3f %.1f %s\n", v, ms, flops / ms * 1e-9,
               forward_variants[v].name);
    }
    attention_forward_bf16(c.out, c.lse, c.qkv, s.B, s.T, s.H, s.KVH, s.HD, nullptr);
    for (int v : bv) {
        if (!backward_runs(v, s.HD)) {
            printf("check-time bwd %d - - %s (not run: head dim or build)\n", v,
                   backward_variants[v].name);
            continue;
        }
        std::vector<float> t;
        for (int r = 0; r < reps + 2; r++) {
            lab_check(cudaEventRecord(e0));
            backward_variants[v].fn(c.dqkv, c.dout, c.qkv, c.out, c.lse, c.ws, s.B, s.T, s.H,
                                    s.KVH, s.HD, nullptr);
            lab_check(cudaEventRecord(e1));
            lab_check(cudaEventSynchronize(e1));
            float ms;
            lab_check(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) t.push_back(ms);
        }
        const float ms = median_ms(t);
        printf("check-time bwd %d %.3f %.1f %s\n", v, ms, 2.5 * flops / ms * 1e-9,
               backward_variants[v].name);
    }
    lab_check(cudaEventDestroy(e0));
    lab_check(cudaEventDestroy(e1));
    case_free(c);
    return 0;
}

static int check_main(int argc, char** argv) {
    if (argc == 3 && !strcmp(argv[1], "--check-dump")) return check_dump(argv[2]);
    if (argc == 4 && !strcmp(argv[1], "--check-compare")) return check_compare(argv[2], argv[3]);
    if ((argc == 5 || argc == 6) && !strcmp(argv[1], "--check-time"))
        return check_time(argv[2], argv[3], argv[4], argc == 6 ? atoi(argv[5]) : 10);
    fprintf(stderr, "usage: %s --check-dump FILE | --check-compare A B | --check-time "
            "B,T,H,KVH,HD FWD BWD [REPS]   (FWD, BWD: variant index lists I,J,... or -)\n",
            argv[0]);
    return 2;
}
// [refactor check: end]

// ----------------------------------------------------------------------------
// main

int main(int argc, char** argv) {
    if (argc > 1 && !strncmp(argv[1], "--check-", 8)) return check_main(argc, argv);
    LabOptions opt;
    const char* log_path = "attention_lab.log";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--probe")) return 0;  // the binary loads: nothing else
        if (!strcmp(argv[i], "--count")) {            // numbers of variants, for the script
            printf("%d %d\n", N_FWD, N_BWD);
            return 0;
        }
        else if (!strcmp(argv[i], "--quick")) opt.quick = true;
        else if (!strcmp(argv[i], "--tiny")) opt.tiny = true;
        else if (!strcmp(argv[i], "--no-big")) opt.big = false;
        else if (!strcmp(argv[i], "--no-bench")) opt.bench = false;
        else if (!strcmp(argv[i], "--long")) opt.long_bench = true;
        else if (!strcmp(argv[i], "--sink")) opt.sink = true;
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
            int* d = opt.shape;
            if (sscanf(argv[++i], "%d,%d,%d,%d,%d", &d[0], &d[1], &d[2], &d[3], &d[4]) != 5 ||
                d[0] < 1 || d[1] < 1 || d[2] < 1 || d[3] < 1 || d[2] % d[3] != 0 || d[4] < 1) {
                fprintf(stderr, "attention lab: --shape wants B,T,H,KVH,HD (KVH divides H)\n");
                return 2;
            }
        }
        else if ((!strcmp(argv[i], "--fwd") || !strcmp(argv[i], "--bwd")) && i + 1 < argc) {
            const bool fwd = !strcmp(argv[i], "--fwd");
            const int n = fwd ? N_FWD : N_BWD;
            int& sel = fwd ? opt.fwd : opt.bwd;
            uint64_t& set = fwd ? opt.fwd_set : opt.bwd_set;
            const char* a = argv[++i];
            if (!strchr(a, ',')) {
                sel = atoi(a);
            } else {  // a list: every index must name a variant
                sel = -3;
                for (const char* p = a; *p;) {
                    const int v = *p >= '0' && *p <= '9' ? atoi(p) : -1;
                    if (v < 0 || v >= n || v >= 64) {
                        fprintf(stderr, "attention lab: bad %s variant list %s\n",
                                fwd ? "forward" : "backward", a);
                        return 2;
                    }
                    set |= 1ull << v;
                    const char* comma = strchr(p, ',');
                    p = comma ? comma + 1 : p + strlen(p);
                }
            }
        }
        else if (!strcmp(argv[i], "--log") && i + 1 < argc) log_path = argv[++i];
        else {
            fprintf(stderr,
                    "usage: %s [--quick] [--tiny] [--no-big] [--no-bench] [--long] [--sink] "
                    "[--shape B,T,H,KVH,HD] "
                    "[--fwd I[,J...]] [--bwd I[,J...]] [--log FILE] [--probe] [--count]\n"
                    "       %s --check-dump FILE | --check-compare A B | --check-time "
                    "B,T,H,KVH,HD FWD BWD [REPS]   (refactor check)\n"
                    "  forward variants:",
                    argv[0], argv[0]);
            for (int v = 0; v < N_FWD; v++) fprintf(stderr, " %d=%s", v, forward_variants[v].name);
            fprintf(stderr, "\n  backward variants:");
            for (int v = 0; v < N_BWD; v++) fprintf(stderr, " %d=%s", v, backward_variants[v].name);
            fprintf(stderr, "\n");
            return 2;
        }
    }
    if (opt.fwd >= N_FWD || opt.bwd >= N_BWD || opt.fwd < -3 || opt.bwd < -3) {
        fprintf(stderr, "attention lab: no such variant\n");
        return 2;
    }
    FILE* log = fopen(log_path, "w");
    if (!log) {
        fprintf(stderr, "attention lab: cannot open %s for writing\n", log_path);
        return 1;
    }
    cudaDeviceProp prop;
    lab_check(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, %d KB shared per block max\n", prop.name, prop.multiProcessorCount,
           (int)(prop.sharedMemPerBlockOptin / 1024));
    printf("head dims supported: 16:%d 32:%d 64:%d 96:%d 128:%d 256:%d\n",
           attention_supports_head_dim(16), attention_supports_head_dim(32),
           attention_supports_head_dim(64), attention_supports_head_dim(96),
           attention_supports_head_dim(128), attention_supports_head_dim(256));
    if (opt.sink) {  // sinks and sliding windows only
        int failures = sink_validate_all(log);
        if (opt.bench) sink_bench(log);
        fclose(log);
        printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
        return failures ? 3 : 0;
    }
    int failures = validate_all(opt, log);
    fflush(stdout);
    if (opt.big) failures += validate_big(opt, log);
    fflush(stdout);
    if (opt.bench) bench(opt, log);
    if (opt.bench) bench_backward_passes(opt, log, Shape{4, 4096, 16, 8, 128});
    // --long: the passes at T=65536 too (the GQA-packed dQ pass against production's)
    if (opt.bench && opt.long_bench) bench_backward_passes(opt, log, Shape{1, 65536, 16, 8, 128});
    fclose(log);
    printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 3 : 0;  // 1 is a CUDA error (attention_check exits 1)
}
