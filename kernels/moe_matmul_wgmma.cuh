/*
 * moe_matmul_wgmma.cuh — variant 3 of the grouped expert GEMM: Hopper warpgroup MMAs
 * (wgmma.mma_async, sm_90a only), warp-specialised and persistent. Part of kernels/moe_matmul.cu,
 * which includes it (the tile schedule and MoeTileSrc are there); the PTX wrappers (cp.async,
 * mbarriers, setmaxnreg, fences, wgmma commit / wait, the descriptor) are those of ptx.cuh.
 *
 * CTA: 384 threads = 3 warpgroups; tile BM x BN = 128 x 256, k-tiles of BK = 64.
 *   Warpgroups 0 and 1 are CONSUMERS: warpgroup w owns rows [64w, 64w + 64) of the CTA tile, a
 *   64 x 256 fp32 accumulator (128 registers per thread), one wgmma m64n256k16 per k-step
 *   (4 per k-tile), both operands from shared memory (SS).
 *   Warpgroup 2 is the PRODUCER: it copies the A and B tiles of every k-tile into a 4-stage ring
 *   with cp.async (16-byte chunks, zero-filled outside the expert's rows / the matrix) and
 *   publishes each stage through an mbarrier (cp.async.mbarrier.arrive.noinc: the hardware
 *   arrives once the thread's copies have landed; 128 arrivals complete a phase).
 *   Registers: 65536 / 384 = 170 at launch; the producer hands registers back (setmaxnreg.dec 40)
 *   and the consumers take them (setmaxnreg.inc 232): per SM sub-partition 2 x 232 + 40 = 504
 *   <= 512 per lane.
 * Persistence: grid = min(tiles, SMs); CTA b walks tiles b, b + grid, ... in the order n-tile
 *   fastest (the CTAs running at once share their A rows and their expert's weight in L2); the
 *   producer and every consumer warp compute the same tile sequence on their own (a warp scan of
 *   the offsets, moe_warp_find_tile), so the ring's running k-tile count u stays in step: stage
 *   s = u % S, phase parity (u / S) & 1, across tiles — the producer fills the next tile's stages
 *   while the consumers run the epilogue of the last one.
 * Ring protocol: consumer warps wait full[s] (parity (u/S)&1), fence.proxy.async (cp.async
 *   writes are generic-proxy, wgmma reads async-proxy; as the attention kernels do), issue the
 *   k-tile's 4 wgmmas as one commit group, then wgmma.wait_group 1 retires the previous k-tile's
 *   group, whose stage lane 0 of each warp releases (empty[s], 8 arrivals per phase); the last
 *   k-tile of a tile is retired by wait_group 0 before the epilogue. The producer waits empty[s]
 *   (parity ((u/S)&1)^1) before refilling stage s for u >= S. The producer never waits for a
 *   release the consumers cannot give (they consume every k-tile it publishes, in order), and it
 *   runs at most S k-tiles ahead of the slowest consumer warp, so no phase can alias.
 * Shared layouts (128-byte swizzle, SW128, as kernels/attention_common.cuh describes; every
 *   tile starts on a 1024-byte boundary):
 *   K-major tile of R rows x 64 k (A of the rows products: R = 128; B K-major: R = 256): row r
 *     is 128 bytes at r*128, chunk c (k 8c..8c+7) at ((c ^ (r & 7)) * 16). Descriptor of k-step
 *     kk: start + kk*32, SBO = 1024 (next 8 rows), LBO unused (16); warpgroup w's A rows start
 *     at 64w*128.
 *   MN-major tile of 64 k x C (A of dW: C = 128 m; B N-major: C = 256 n): panels of 64 columns,
 *     each 64 k-rows x 128 bytes = 8 KiB; (k, chunk c) at (c / 8)*8192 + k*128 +
 *     ((c % 8) ^ (k & 7))*16. Descriptor of k-step kk: start + kk*16*128, SBO = 1024 (next 8
 *     k-rows), LBO = 8192 (next 64 columns); transposed operand (imm-trans 1). Warpgroup w's A
 *     (64 m) is panel w.
 * Edges and semantics are those of the other variants (moe_matmul.cu): IC, OC multiples of 8;
 *   rows past the expert and columns past N are zero-filled and never stored; dW tiles of
 *   experts without rows are skipped (untouched), every output tile is owned by one CTA: no
 *   atomics, deterministic (the grid size does not change any sum).
 */
#ifndef KERNELS_MOE_MATMUL_WGMMA_CUH
#define KERNELS_MOE_MATMUL_WGMMA_CUH

#include "ptx.cuh"

// The Makefile defines ATTN_WGMMA_BUILD=1 when GPU_ARCH is sm_90a (the wgmma attention kernels
// use the same switch); the device code exists only for that target.
#ifndef ATTN_WGMMA_BUILD
#define ATTN_WGMMA_BUILD 0
#endif
#define MOE_WG_ENABLED PTX_SM90A  // ptx.cuh: the device pass of an sm_90a build

#define MOE_WG_BM 128
#define MOE_WG_BN 256
#define MOE_WG_BK 64
#define MOE_WG_STAGES 4
#define MOE_WG_THREADS 384
#define MOE_WG_PRODUCER_REGS 40
#define MOE_WG_CONSUMER_REGS 232
#define MOE_WG_A_BYTES (MOE_WG_BM * MOE_WG_BK * 2)  // 16 KiB
#define MOE_WG_B_BYTES (MOE_WG_BN * MOE_WG_BK * 2)  // 32 KiB
#define MOE_WG_STAGE_BYTES (MOE_WG_A_BYTES + MOE_WG_B_BYTES)
#define MOE_WG_PANEL_BYTES 8192  // 64 k-rows x 128 bytes
// ring + room to align the base to 1024 bytes + the mbarriers (2 per stage, 8 bytes each)
#define MOE_WG_SMEM_BYTES (MOE_WG_STAGES * MOE_WG_STAGE_BYTES + 1024 + 16 * MOE_WG_STAGES)

// ----------------------------------------------------------------------------
// device helpers (sm_90a): the m64n256k16 wgmma (the other wrappers are in ptx.cuh)

// d (64 x 256, f32) = A (64 x 16) · B (16 x 256) + (scale_d ? d : 0), one warpgroup, A and B
// from shared memory; TA / TB: the operand is MN-major (transposed).
template <int TA, int TB>
__device__ __forceinline__ void moe_wgmma_m64n256k16(float (&d)[32][4], uint64_t da, uint64_t db,
                                                     int scale_d) {
#if MOE_WG_ENABLED
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WG_REGS128
        ", %128, %129, p, 1, 1, %131, %132;\n}\n"
        : WG_ACC128(d)
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB)
        : "memory");
#endif
}

// ----------------------------------------------------------------------------
// device: tiles

// The sources of tile t of the persistent sequence (n-tile fastest). Returns 0 past the last
// tile, else 1 with *n_kt k-tiles (0: nothing to do, a dW tile of an expert without rows).
// Rows products: A (R, K) K-major; B_e K-major or N-major. dW: A (R, M) and B (R, N), M- and
// N-major, the expert's rows the reduction.
template <bool DW, bool B_KMAJOR>
__device__ __forceinline__ int moe_wg_tile(int t, int n_ntiles, int n_mtiles, const bf16* A,
                                           const bf16* B, const int32_t* offsets, int E, int M,
                                           int N, int K, size_t bstride, int ldb, int lane,
                                           MoeTileSrc* a, MoeTileSrc* b, int* e_out, int* m0_out,
                                           int* n_kt) {
    const int n0 = (t % n_ntiles) * MOE_WG_BN;
    int e, m0;
    if (DW) {
        const int rest = t / n_ntiles;
        e = rest / n_mtiles;
        m0 = (rest % n_mtiles) * MOE_WG_BM;
        if (e >= E) return 0;
    } else {
        int mt;
        moe_warp_find_tile(offsets, E, MOE_WG_BM, t / n_ntiles, lane, &e, &mt);
        if (e < 0) return 0;
        m0 = mt * MOE_WG_BM;
    }
    const int r0 = offsets[e], Me = offsets[e + 1] - r0;
    *e_out = e;
    *m0_out = m0;
    if (DW) {
        *a = {A, (size_t)M, r0, r0 + Me, m0, M};
        *b = {B, (size_t)N, r0, r0 + Me, n0, N};
        *n_kt = Me > 0 ? (Me + MOE_WG_BK - 1) / MOE_WG_BK : 0;
    } else {
        *a = {A, (size_t)K, r0 + m0, r0 + Me, 0, K};
        if (B_KMAJOR)
            *b = {B + (size_t)e * bstride, (size_t)ldb, n0, N, 0, K};
        else
            *b = {B + (size_t)e * bstride, (size_t)ldb, 0, K, n0, N};
        *n_kt = (K + MOE_WG_BK - 1) / MOE_WG_BK;
    }
    return 1;
}

// Producer copies of k-tile kt (128 threads, ptid 0..127). Each thread keeps one source pointer
// and one shared address and steps them by constants (few live registers: the producer runs on
// MOE_WG_PRODUCER_REGS).
// K-major tile of ROWS rows x 64 k: thread copies chunk c = ptid % 8 of rows r0 + 16 j, r0 =
// ptid / 8 (all in swizzle phase r0 % 8).
template <int ROWS>
__device__ __forceinline__ void moe_wg_load_kmajor(uint32_t dst, const MoeTileSrc& s, int kt,
                                                   int ptid) {
    const int c = ptid & 7, r0 = ptid >> 3;
    const int col = s.col0 + kt * MOE_WG_BK + c * 8;
    const int rows_left = col < s.col_end ? s.row_end - (s.row0 + r0) : 0;  // valid: 16 j < it
    const bf16* src = s.g + (size_t)(s.row0 + r0) * s.ld + col;
    const size_t step = 16 * s.ld;
    const uint32_t d = dst + r0 * 128 + ((c ^ (r0 & 7)) << 4);
#pragma unroll
    for (int j = 0; j < ROWS / 16; j++) {
        const bool valid = 16 * j < rows_left;
        cp_async_16(d + j * 16 * 128, valid ? src : s.g, valid);
        src += step;
    }
}
// MN-major tile of 64 k x COLS: thread copies chunk c = ptid % (COLS/8) of k-rows k0 + RSTEP j,
// k0 = ptid / (COLS/8) < RSTEP, so (k0 + RSTEP j) % 8 = k0 ^ ((RSTEP j) % 8).
template <int COLS>
__device__ __forceinline__ void moe_wg_load_mnmajor(uint32_t dst, const MoeTileSrc& s, int kt,
                                                    int ptid) {
    constexpr int CPR = COLS / 8, RSTEP = 128 / CPR;
    static_assert(RSTEP == 4 || RSTEP == 8, "k-row step of the copies");
    const int c = ptid % CPR, k0 = ptid / CPR;
    const int col = s.col0 + c * 8, row = s.row0 + kt * MOE_WG_BK + k0;
    const int rows_left = col < s.col_end ? s.row_end - row : 0;  // valid: RSTEP j < it
    const bf16* src = s.g + (size_t)row * s.ld + col;
    const size_t step = RSTEP * s.ld;
    const uint32_t d = dst + (uint32_t)((c >> 3) * MOE_WG_PANEL_BYTES) + k0 * 128;
#pragma unroll
    for (int j = 0; j < MOE_WG_BK / RSTEP; j++) {
        const bool valid = RSTEP * j < rows_left;
        const int phase = k0 ^ ((RSTEP * j) & 7);
        cp_async_16(d + RSTEP * j * 128 + (((c & 7) ^ phase) << 4), valid ? src : s.g, valid);
        src += step;
    }
}

// ----------------------------------------------------------------------------
// the kernel: DW = 0 rows products (bf16 out, optional bias), DW = 1 dW (fp32 +=)

template <bool DW, bool B_KMAJOR>
__global__ void __launch_bounds__(MOE_WG_THREADS, 1)
    moe_wgmma_kernel(void* __restrict__ Dv, const bf16* __restrict__ A,
                     const bf16* __restrict__ B, const bf16* __restrict__ bias,
                     const int32_t* __restrict__ offsets, int E, int M, int N, int K,
                     size_t bstride, int ldb, int n_ntiles, int n_mtiles, int n_tiles) {
#if MOE_WG_ENABLED
    constexpr bool A_KMAJOR = !DW;
    constexpr int S = MOE_WG_STAGES;
    extern __shared__ __align__(1024) unsigned char moe_wg_smem[];
    const uint32_t sbase = (smem_u32(moe_wg_smem) + 1023u) & ~1023u;
    const uint32_t bar_full = sbase + S * MOE_WG_STAGE_BYTES;  // [S] stage landed (128)
    const uint32_t bar_empty = bar_full + 8 * S;               // [S] stage released (8 warps)
    const int tid = threadIdx.x, lane = tid & 31;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);  // warp-uniform, visibly
    const int wg = warp >> 2;
    if (tid == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(bar_full + 8 * s, 128);
            mbar_init(bar_empty + 8 * s, 8);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 2) {  // producer
        setmaxnreg_dec<MOE_WG_PRODUCER_REGS>();
        const int ptid = tid - 256;
        uint32_t u = 0;
        for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
            MoeTileSrc a, b;
            int e, m0, n_kt;
            if (!moe_wg_tile<DW, B_KMAJOR>(t, n_ntiles, n_mtiles, A, B, offsets, E, M, N, K,
                                           bstride, ldb, lane, &a, &b, &e, &m0, &n_kt))
                break;
            for (int kt = 0; kt < n_kt; kt++, u++) {
                const uint32_t s = u % S;
                if (u >= S) mbar_wait(bar_empty + 8 * s, ((u / S) & 1) ^ 1);
                const uint32_t sa = sbase + s * MOE_WG_STAGE_BYTES, sb = sa + MOE_WG_A_BYTES;
                if (A_KMAJOR)
                    moe_wg_load_kmajor<MOE_WG_BM>(sa, a, kt, ptid);
                else
                    moe_wg_load_mnmajor<MOE_WG_BM>(sa, a, kt, ptid);
                if (B_KMAJOR)
                    moe_wg_load_kmajor<MOE_WG_BN>(sb, b, kt, ptid);
                else
                    moe_wg_load_mnmajor<MOE_WG_BN>(sb, b, kt, ptid);
                cp_async_mbar_arrive(bar_full + 8 * s);
            }
        }
        cp_async_wait<0>();
        return;
    }

    // consumers
    setmaxnreg_inc<MOE_WG_CONSUMER_REGS>();
    const int v = warp & 3, g = lane >> 2, tq = lane & 3;
    // descriptors' fixed parts; warpgroup wg's A rows (K-major) or A panel (M-major) at wg*8192
    const uint32_t a_lbo = A_KMAJOR ? 16 : MOE_WG_PANEL_BYTES;
    const uint32_t b_lbo = B_KMAJOR ? 16 : MOE_WG_PANEL_BYTES;
    const uint32_t a_kstep = A_KMAJOR ? 32 : 16 * 128, b_kstep = B_KMAJOR ? 32 : 16 * 128;
    float acc[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[i][q] = 0.0f;
    uint32_t u = 0;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        MoeTileSrc a, b;
        int e, m0, n_kt;
        if (!moe_wg_tile<DW, B_KMAJOR>(t, n_ntiles, n_mtiles, A, B, offsets, E, M, N, K, bstride,
                                       ldb, lane, &a, &b, &e, &m0, &n_kt))
            break;
        if (n_kt == 0) continue;  // dW of an expert without rows: untouched
        const int n0 = (t % n_ntiles) * MOE_WG_BN;
        for (int kt = 0; kt < n_kt; kt++, u++) {
            const uint32_t s = u % S;
            mbar_wait(bar_full + 8 * s, (u / S) & 1);
            fence_proxy_async_shared();
            const uint32_t sa = sbase + s * MOE_WG_STAGE_BYTES + wg * MOE_WG_PANEL_BYTES;
            const uint32_t sb = sbase + s * MOE_WG_STAGE_BYTES + MOE_WG_A_BYTES;
            wgmma_fence();
            wg_fence_acc(acc);
#pragma unroll
            for (int kk = 0; kk < MOE_WG_BK / 16; kk++)
                moe_wgmma_m64n256k16<A_KMAJOR ? 0 : 1, B_KMAJOR ? 0 : 1>(
                    acc, wg_desc(sa + kk * a_kstep, a_lbo, 1024),
                    wg_desc(sb + kk * b_kstep, b_lbo, 1024), kt > 0 || kk > 0);
            wgmma_commit();
            wg_fence_acc(acc);
            wgmma_wait<1>();  // the previous k-tile's wgmmas have retired: release its stage
            wg_fence_acc(acc);
            if (kt > 0 && lane == 0) mbar_arrive(bar_empty + 8 * ((u - 1) % S));
        }
        wgmma_wait<0>();
        wg_fence_acc(acc);
        if (lane == 0) mbar_arrive(bar_empty + 8 * ((u - 1) % S));

        // epilogue: warp v holds rows 16v + g (+8) of the warpgroup's 64, columns 8i + 2tq
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = m0 + wg * 64 + 16 * v + g + 8 * h;
            if (DW) {
                if (m >= M) continue;
                float* drow = (float*)Dv + (size_t)e * M * N + (size_t)m * N;
#pragma unroll
                for (int i = 0; i < 32; i++) {
                    const int n = n0 + 8 * i + 2 * tq;
                    if (n >= N) continue;
                    float2* p = reinterpret_cast<float2*>(drow + n);
                    float2 x = *p;
                    x.x += acc[i][2 * h];
                    x.y += acc[i][2 * h + 1];
                    *p = x;
                }
            } else {
                const int r0 = a.row0 - m0, Me = a.row_end - r0;  // the expert's rows
                if (m >= Me) continue;
                bf16* drow = (bf16*)Dv + (size_t)(r0 + m) * N;
#pragma unroll
                for (int i = 0; i < 32; i++) {
                    const int n = n0 + 8 * i + 2 * tq;
                    if (n >= N) continue;
                    float x0 = acc[i][2 * h], x1 = acc[i][2 * h + 1];
                    if (bias) {
                        x0 += __bfloat162float(bias[(size_t)e * N + n]);
                        x1 += __bfloat162float(bias[(size_t)e * N + n + 1]);
                    }
                    *reinterpret_cast<__nv_bfloat162*>(drow + n) = __floats2bfloat162_rn(x0, x1);
                }
            }
        }
    }
#endif
}

// ----------------------------------------------------------------------------
// host

// Whether variant 3 can run on the current device: the build carries its sm_90a device code and
// the device is a compute capability 9.0 part. Two attribute queries, no synchronisation.
static int moe_wgmma_available() {
    if (!ATTN_WGMMA_BUILD) return 0;
    int dev = 0, major = 0, minor = 0;
    cuda_check(cudaGetDevice(&dev));
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    return major == 9 && minor == 0;
}

template <bool DW, bool B_KMAJOR>
static void moe_wgmma_launch(CudaCtx* cx, void* D, const bf16* A, const bf16* B, const bf16* bias,
                             const int32_t* offsets, int E, int M, int N, int K, size_t bstride,
                             int ldb, int n_ntiles, int n_mtiles, long long n_tiles) {
    if (n_tiles > 0x7fffffffLL) fatal("moe_matmul: %lld tiles (too many for one launch)", n_tiles);
    auto kernel = moe_wgmma_kernel<DW, B_KMAJOR>;
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    MOE_WG_SMEM_BYTES));
    const int grid = n_tiles < cx->n_sms ? (int)n_tiles : cx->n_sms;
    kernel<<<grid, MOE_WG_THREADS, MOE_WG_SMEM_BYTES, cx->stream>>>(
        D, A, B, bias, offsets, E, M, N, K, bstride, ldb, n_ntiles, n_mtiles, (int)n_tiles);
    cuda_check_launch();
}

static void moe_rows_launch_wgmma(CudaCtx* cx, bf16* D, const bf16* A, const bf16* B,
                                  const bf16* bias, const int32_t* offsets, int R, int E, int N,
                                  int K, size_t bstride, int ldb, int b_kmajor) {
    const int n_ntiles = (N + MOE_WG_BN - 1) / MOE_WG_BN;
    const long long n_tiles = (long long)n_ntiles * moe_slots(R, E, MOE_WG_BM);
    if (b_kmajor)
        moe_wgmma_launch<false, true>(cx, D, A, B, bias, offsets, E, 0, N, K, bstride, ldb,
                                      n_ntiles, 0, n_tiles);
    else
        moe_wgmma_launch<false, false>(cx, D, A, B, bias, offsets, E, 0, N, K, bstride, ldb,
                                       n_ntiles, 0, n_tiles);
}

static void moe_dw_launch_wgmma(CudaCtx* cx, float* D, const bf16* A, const bf16* B,
                                const int32_t* offsets, int R, int E, int M, int N) {
    (void)R;
    const int n_ntiles = (N + MOE_WG_BN - 1) / MOE_WG_BN;
    const int n_mtiles = (M + MOE_WG_BM - 1) / MOE_WG_BM;
    moe_wgmma_launch<true, false>(cx, D, A, B, NULL, offsets, E, M, N, 0, 0, 0, n_ntiles, n_mtiles,
                                  (long long)n_ntiles * n_mtiles * E);
}

#endif  // KERNELS_MOE_MATMUL_WGMMA_CUH
