/*
 * common.cuh — what every .cu file of kernels/ shares: checked CUDA/cuBLASLt calls, the backend
 * context (CudaCtx), per-context scratch buffers, bf16 vector loads/stores, deterministic warp and
 * block sums, and the launchers each .cu file exports to ops_cuda.cu.
 *
 * Invariants:
 *  - Every launcher enqueues on cx->stream only, never synchronizes (unless it says so) and checks
 *    the launch with cuda_check_launch().
 *  - No floating-point atomics anywhere: every sum runs in a fixed order (xor-butterfly inside a
 *    warp, warps in index order inside a block, per-block partials reduced in block order by a
 *    second kernel). Work splits depend on the problem shape only, never on the device, so the
 *    same inputs give the same bits on every run.
 *  - Vector paths move 16 bytes (8 bf16) per access; they are taken only when every pointer is
 *    16-byte aligned and the row width is a multiple of 8, otherwise the scalar path runs.
 */
#ifndef KERNELS_COMMON_CUH
#define KERNELS_COMMON_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "../llmc/common.h"
#include "../llmc/ops.h"
}

typedef __nv_bfloat16 bf16;

// ----------------------------------------------------------------------------
// checked calls

static inline void cuda_check_at(cudaError_t e, const char* what, const char* file, int line) {
    if (e != cudaSuccess)
        fatal_at(file, line, "CUDA call %s failed: %s (%s)", what, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}
static inline void cublas_check_at(cublasStatus_t s, const char* what, const char* file,
                                   int line) {
    if (s != CUBLAS_STATUS_SUCCESS)
        fatal_at(file, line, "cuBLASLt call %s failed: status %d (%s)", what, (int)s,
                 cublasLtGetStatusString(s));
}
#define cuda_check(call) cuda_check_at((call), #call, __FILE__, __LINE__)
#define cublas_check(call) cublas_check_at((call), #call, __FILE__, __LINE__)
// After every kernel launch: catches bad launch configurations at the call site.
#define cuda_check_launch() cuda_check_at(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ----------------------------------------------------------------------------
// the backend context

// Bits of the device error word: conditions a kernel can detect but not report itself.
enum { CUDA_ERR_TOKEN_ID = 1, CUDA_ERR_TARGET = 2, CUDA_ERR_EXPERT = 4 };

// Scratch slots: one op uses a slot only while it enqueues, and stream order keeps the kernels of
// consecutive ops apart, so one buffer per slot suffices.
enum {
    SCRATCH_PARTIAL = 0,  // fp32 per-block partial sums of the column reductions
    SCRATCH_SORT,         // embedding backward: radix-sort keys, values and histograms
    SCRATCH_ATTN,         // attention backward workspace
    SCRATCH_STAGE,        // device side of the host <-> device fp32 staging
    SCRATCH_COUNT
};

typedef struct MatmulPlan MatmulPlan;  // matmul.cu: one cached cuBLASLt problem
typedef struct OpProfile OpProfile;    // profile.cu: device time per op (--profile-ops)

// A page-locked host buffer of an overlapped transfer and the event after its copy.
typedef struct HostSlot {
    void* p;
    size_t cap;
    cudaEvent_t done;  // recorded after the slot's copy (NULL until the first)
    int pending;       // a copy is in flight (download: not yet finished)
} HostSlot;

typedef struct CudaCtx {
    int device;
    cudaStream_t stream;
    int own_stream;             // created by ops_cuda_create (destroyed with the context)
    int n_sms;
    size_t max_smem_optin;      // largest dynamic shared memory a block may opt into
    cublasLtHandle_t lt;
    void* lt_workspace;         // cuBLASLt workspace (LT_WORKSPACE_BYTES)
    MatmulPlan* plans;          // cache of heuristic choices, one per problem shape
    int n_plans, next_evict;
    void* scratch[SCRATCH_COUNT];
    size_t scratch_bytes[SCRATCH_COUNT];
    void* host_stage;           // pinned host staging buffer (STAGE_BYTES)
    int* d_error;               // device error word (CUDA_ERR_* bits)
    int* h_error;               // pinned host copy of it
    OpProfile* prof;            // NULL unless ops_cuda_profile_enable
    uint64_t scratch_epoch;     // bumped whenever a scratch buffer moves (graphs recorded
                                // before then read the old one: stale)
    uint64_t capture_epoch;     // scratch_epoch when the recording in progress began
    int sm90;                   // a compute capability 9.0 device (the sm_90a kernels run)
    int rows_max_clusters[2][4][4];  // matmul_rows.cuh: resident clusters per (plain / fused
                                     // SwiGLU, tile, split); 0 unknown
    void* encode_tiled;         // matmul_rows.cuh: the driver's cuTensorMapEncodeTiled (NULL: not yet)
    int recording;              // a decode step is being recorded (op_graph_begin .. graph_end):
                                // cuda_launch adds programmatic serialization, weights constant
    HostSlot up[2], down[2];    // ops.h upload_async / download_start's page-locked buffers
    int* h_slot_error;          // (2) pinned: the error word as each slot's download left it
} CudaCtx;

#define LT_WORKSPACE_BYTES ((size_t)32 << 20)  // cuBLAS's recommendation for Hopper
#define STAGE_BYTES ((size_t)32 << 20)         // host <-> device conversion chunk

// Scratch of at least `bytes` in slot `slot` (grown on demand; growing waits for the stream).
void* cuda_scratch(CudaCtx* cx, int slot, size_t bytes);
// Make cx->device current on the calling thread (ops may be called from any thread).
void cuda_ctx_enter(CudaCtx* cx);
// Op profile (profile.cu): around each op's kernels when cx->prof is set, else nothing. The key
// (printf-style) names the op and its shape; flop and bytes per call (0: not counted) give the
// report's rates.
void prof_begin(CudaCtx* cx, double flop, double bytes, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
void prof_end(CudaCtx* cx);
void prof_destroy(CudaCtx* cx);

// ----------------------------------------------------------------------------
// launches

// kernel<<<grid, block, smem, cx->stream>>>(args...), checked; while a decode step is recorded
// (cx->recording) with programmatic stream serialization: the kernel may start before the one
// before it ends, so it must follow ptx.cuh's pdl_wait rule (every kernel launched through here
// calls pdl_wait before it touches what earlier kernels write).
template <typename... KArgs, typename... Args>
static inline void cuda_launch(CudaCtx* cx, void (*kernel)(KArgs...), dim3 grid, dim3 block,
                               size_t smem, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cx->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cx->recording ? 1 : 0;
    cuda_check(cudaLaunchKernelEx(&cfg, kernel, ((KArgs)args)...));
}

// ----------------------------------------------------------------------------
// small host helpers

static inline int is_aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }
static inline unsigned grid_size(size_t n, int block) {
    return (unsigned)((n + (size_t)block - 1) / (size_t)block);
}
// Rows per block of the row-group reductions: a function of N and a fixed block target only
// (never of the device), so the per-block partial sums and their reduction order are fixed for a
// shape. target_blocks trades occupancy against the size of the partials.
static inline int rows_per_block(int N, int target_blocks) {
    return N <= target_blocks ? 1 : (N + target_blocks - 1) / target_blocks;
}

// ----------------------------------------------------------------------------
// device helpers: bf16 vectors, rounding, deterministic sums

__device__ __forceinline__ float bf16_round(float x) {
    return __bfloat162float(__float2bfloat16_rn(x));
}

// The logistic function of every SiLU / GLU kernel (SwiGLU, the fused gate_up + SwiGLU, GPT-OSS's
// GLU): one expression, so their bits agree.
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + __expf(-x)); }

// VEC consecutive bf16 <-> fp32. VEC == 8 is one 16-byte access (p must be 16-byte aligned).
template <int VEC>
__device__ __forceinline__ void load_bf16(const bf16* p, float* f) {
    if constexpr (VEC == 8) {
        uint4 u = *reinterpret_cast<const uint4*>(p);
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float2 t = __bfloat1622float2(h[k]);
            f[2 * k] = t.x;
            f[2 * k + 1] = t.y;
        }
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) f[k] = __bfloat162float(p[k]);
    }
}

template <int VEC>
__device__ __forceinline__ void store_bf16(bf16* p, const float* f) {
    if constexpr (VEC == 8) {
        uint4 u;
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
        for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
        *reinterpret_cast<uint4*>(p) = u;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; k++) p[k] = __float2bfloat16_rn(f[k]);
    }
}

// Sum over the warp by an xor butterfly: every lane ends with the same bits.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim a multiple of 32): warp sums, then warps in index order. Every
// thread returns the same value. `red` is 32 floats of shared memory; calls may follow each other.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous call's readers are done with red
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < n_warps; w++) s += red[w];
    return s;
}

// ----------------------------------------------------------------------------
// launchers (one file each; ops_cuda.cu wires them into the table)

// elementwise.cu
void cuda_convert_f32_to_bf16(CudaCtx* cx, bf16* dst, const float* src, size_t n);
void cuda_convert_bf16_to_f32(CudaCtx* cx, float* dst, const bf16* src, size_t n);
void cuda_embedding_forward(CudaCtx* cx, bf16* out, const int32_t* ids, const bf16* wte, int N,
                            int C, int V);
// ops.h gather_ids: ids[k] = prev[from[k]] where from[k] >= 0 (k < n).
void cuda_gather_ids(CudaCtx* cx, int32_t* ids, const int32_t* prev, const int32_t* from, int n);
void cuda_swiglu_forward(CudaCtx* cx, bf16* out, const bf16* gu, int N, int F);
void cuda_swiglu_backward(CudaCtx* cx, bf16* dgu, const bf16* dout, const bf16* gu, int N, int F);
void cuda_add(CudaCtx* cx, bf16* out, const bf16* a, const bf16* b, size_t n);
void cuda_scale(CudaCtx* cx, bf16* out, const bf16* inp, float s, size_t n);
void cuda_copy_cols(CudaCtx* cx, bf16* dst, const bf16* src, int N, int ld, int c0, int w);
void cuda_add_f32(CudaCtx* cx, float* dst, const float* src, size_t n);
void cuda_dropout(CudaCtx* cx, bf16* out, const bf16* inp, float p, uint64_t seed, int64_t row0,
                  int N, int C);
// dst (C) += Σ_p partial (n_parts, C), parts summed in an order fixed by n_parts.
void cuda_reduce_partials(CudaCtx* cx, float* dst, const float* partial, int n_parts, int C);

// embedding.cu
void cuda_embedding_backward(CudaCtx* cx, float* dwte, const bf16* dout, const int32_t* ids, int N,
                             int C, int V);

// norm.cu
void cuda_rmsnorm_forward(CudaCtx* cx, bf16* res, bf16* out, float* rstd, const bf16* a,
                          const bf16* b, const bf16* w, int N, int C, float eps);
void cuda_rmsnorm_backward(CudaCtx* cx, bf16* dinp, float* dw, const bf16* dout, const bf16* inp,
                           const bf16* w, const float* rstd, int N, int C);

// matmul.cu
// out (N, F) = silu(gate) · up of gu = inp · wᵀ (w: (2F, IC) = [gate; up]) without storing gu,
// with matmul then swiglu's roundings; 0 (nothing done) when the rows kernel does not apply.
int cuda_matmul_swiglu_forward(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w, int N,
                               int IC, int F);
void cuda_matmul_forward(CudaCtx* cx, bf16* out, const bf16* inp, const bf16* w, const bf16* bias,
                         int N, int IC, int OC);
void cuda_matmul_backward(CudaCtx* cx, bf16* dinp, float* dw, float* dbias, const bf16* dout,
                          const bf16* inp, const bf16* w, int N, int IC, int OC);
void cuda_matmul_cols_forward(CudaCtx* cx, bf16* out, int accumulate, const bf16* inp, int ldi,
                              const bf16* w, float scale, int N, int IC, int OC, int ld, int c0);
void cuda_matmul_cols_backward(CudaCtx* cx, bf16* dinp, int accumulate, float* dw,
                               const bf16* dout, const bf16* inp, const bf16* w, float scale,
                               int N, int IC, int ldi, int OC, int ld, int c0);
void cuda_matmul_plans_free(CudaCtx* cx);

// rope.cu
void cuda_qknorm_rope_forward(CudaCtx* cx, bf16* out, float* rstd, const bf16* inp,
                              const bf16* q_norm_w, const bf16* k_norm_w, const float* cos,
                              const float* sin, int B, int T, int H, int KVH, int HD, float eps);
void cuda_qknorm_rope_backward(CudaCtx* cx, bf16* dinp, float* dq_norm_w, float* dk_norm_w,
                               const bf16* dout, const bf16* inp, const bf16* q_norm_w,
                               const bf16* k_norm_w, const float* rstd, const float* cos,
                               const float* sin, int B, int T, int H, int KVH, int HD);

// attention_fallback.cu (head dims or alignments the flash kernels of attention.cu do not take)
size_t cuda_attention_simple_workspace_bytes(int B, int T, int H);
void cuda_attention_forward_simple(CudaCtx* cx, bf16* out, float* lse, const bf16* qkv, int B,
                                   int T, int H, int KVH, int HD);
void cuda_attention_backward_simple(CudaCtx* cx, bf16* dqkv, const bf16* dout, const bf16* qkv,
                                    const bf16* out, const float* lse, float* workspace, int B,
                                    int T, int H, int KVH, int HD);
// The same with sinks (H) or NULL and a sliding window (0: none), as ops.h's sink ops; the
// backward leaves D (B, H, T) in the workspace for the sinks' gradient (attention.h).
void cuda_attention_sink_forward_simple(CudaCtx* cx, bf16* out, float* lse, const bf16* qkv,
                                        const bf16* sinks, int B, int T, int H, int KVH, int HD,
                                        int window);
void cuda_attention_sink_backward_simple(CudaCtx* cx, bf16* dqkv, const bf16* dout,
                                         const bf16* qkv, const bf16* out, const float* lse,
                                         float* workspace, int B, int T, int H, int KVH, int HD,
                                         int window);

// loss.cu
void cuda_crossentropy_forward_backward(CudaCtx* cx, bf16* logits, float* losses,
                                        const int32_t* targets, int n, int V, float grad_scale,
                                        int compute_grad);

#endif  // KERNELS_COMMON_CUH
