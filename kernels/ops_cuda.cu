/*
 * ops_cuda.cu — the CUDA backend of the op table (llmc/ops.h): bf16 storage, fp32 accumulation.
 * Defines the context (CudaCtx, common.cuh), the memory ops, the device queries of kernels.h, and
 * the table `ops_cuda` that wires the launchers of the other kernels/ sources together.
 *
 * Semantics that differ from "enqueue and return":
 *  - alloc returns zeroed memory and waits for the zeroing (the buffer may be used on any stream).
 *  - upload / upload_f32 return once the host buffer may be reused (they wait for the copy);
 *    download / download_f32 / synchronize wait for everything queued before them, then check the
 *    device error word (bad token ids or targets flagged by kernels) and are fatal if it is set.
 *  - fp32 <-> bf16 conversions go through a pinned host staging buffer and a device fp32 chunk,
 *    STAGE_BYTES at a time, converted on the GPU with round-to-nearest-even.
 * Attention (also with sinks and sliding windows) goes to the flash kernels of attention.cu when
 * they take the shape (head dim 16, 32, 64 or 128, 16-byte aligned rows), otherwise to the simple
 * kernels of attention_fallback.cu.
 */
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "common.cuh"
#include "decode.h"
#include "dequant.h"
#include "kernels.h"
#include "moe.cuh"
#include "moe_matmul.h"

// ----------------------------------------------------------------------------
// device memory and context helpers

static void* device_alloc(CudaCtx* cx, size_t bytes, const char* what) {
    void* p = NULL;
    if (bytes == 0) return NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();  // clear the sticky-free error so the query below works
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        fatal("cannot allocate %zu bytes (%.3f GiB) of GPU memory for %s on device %d: %s; "
              "%.3f GiB free of %.3f GiB. HINT: lower the micro-batch size or the sequence "
              "length, or use more GPUs", bytes, bytes / 1073741824.0, what, cx->device,
              cudaGetErrorString(e), free_b / 1073741824.0, total_b / 1073741824.0);
    }
    return p;
}

void cuda_ctx_enter(CudaCtx* cx) { cuda_check(cudaSetDevice(cx->device)); }

static CudaCtx* ctx_enter(void* ctx) {
    CudaCtx* cx = (CudaCtx*)ctx;
    cuda_ctx_enter(cx);
    return cx;
}

void* cuda_scratch(CudaCtx* cx, int slot, size_t bytes) {
    if (bytes <= cx->scratch_bytes[slot]) return cx->scratch[slot];
    if (cx->scratch[slot]) {  // kernels queued earlier may still read the old buffer
        cuda_check(cudaStreamSynchronize(cx->stream));
        cuda_check(cudaFree(cx->scratch[slot]));
    }
    size_t cap = bytes + bytes / 4;  // some headroom: shapes vary a little (last LM-head chunk)
    cx->scratch[slot] = device_alloc(cx, cap, "op scratch");
    cx->scratch_epoch++;
    cx->scratch_bytes[slot] = cap;
    return cx->scratch[slot];
}

// An error word copied from the device (CUDA_ERR_* bits): fatal if set.
static void report_device_error_word(int e) {
    if (e & CUDA_ERR_TOKEN_ID)
        fatal("embedding: a token id outside [0, vocab) reached the GPU. HINT: the data's "
              "tokenizer must match the model's vocabulary");
    if (e & CUDA_ERR_TARGET)
        fatal("crossentropy: a target id >= vocab reached the GPU. HINT: the data's tokenizer "
              "must match the model's vocabulary");
    if (e & CUDA_ERR_EXPERT)
        fatal("moe_dispatch: an expert index outside [0, experts) reached the GPU (a routing bug)");
}

// The error word as copied into cx->h_error by the last synchronised copy.
static void report_device_errors(CudaCtx* cx) { report_device_error_word(*cx->h_error); }

// Fatal if a kernel flagged bad input since the last check. Waits for the stream.
static void check_device_errors(CudaCtx* cx) {
    cuda_check(cudaMemcpyAsync(cx->h_error, cx->d_error, sizeof(int), cudaMemcpyDeviceToHost,
                               cx->stream));
    cuda_check(cudaStreamSynchronize(cx->stream));
    report_device_errors(cx);
}

// ----------------------------------------------------------------------------
// device queries (kernels.h)

extern "C" int cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

#ifndef CUDA_BUILD_ARCH
#define CUDA_BUILD_ARCH "unknown"  // the Makefile passes GPU_ARCH
#endif
extern "C" const char* cuda_build_arch(void) { return CUDA_BUILD_ARCH; }

extern "C" int cuda_device_capability(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return 10 * major + minor;
}

extern "C" const char* cuda_device_name(int device) {
    // Per-thread buffer: the name stays valid until this thread's next call.
    static thread_local char name[256];
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return "unknown";
    }
    str_copy(name, sizeof name, prop.name);
    return name;
}

extern "C" int cuda_device_memory(int device, size_t* free_bytes, size_t* total_bytes) {
    int cur = 0;
    if (cudaGetDevice(&cur) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes);
    cudaSetDevice(cur);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// context lifecycle

extern "C" void* ops_cuda_create(int device, void* stream) {
    int n = cuda_device_count();
    if (device < 0 || device >= n)
        fatal("CUDA device %d is not available (%d device%s found). HINT: check nvidia-smi and "
              "CUDA_VISIBLE_DEVICES", device, n, n == 1 ? "" : "s");
    CudaCtx* cx = (CudaCtx*)calloc_check(1, sizeof(CudaCtx));
    cx->device = device;
    cuda_check(cudaSetDevice(device));
    if (stream) {
        cx->stream = (cudaStream_t)stream;
    } else {
        cuda_check(cudaStreamCreateWithFlags(&cx->stream, cudaStreamNonBlocking));
        cx->own_stream = 1;
    }
    int sms = 0, smem = 0;
    cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cuda_check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cx->n_sms = sms;
    cx->max_smem_optin = (size_t)smem;
    int major = 0, minor = 0;
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cx->sm90 = major == 9 && minor == 0;
    cublas_check(cublasLtCreate(&cx->lt));
    cx->lt_workspace = device_alloc(cx, LT_WORKSPACE_BYTES, "the cuBLASLt workspace");
    cx->d_error = (int*)device_alloc(cx, sizeof(int), "the error word");
    cuda_check(cudaMemsetAsync(cx->d_error, 0, sizeof(int), cx->stream));
    cuda_check(cudaMallocHost((void**)&cx->h_error, sizeof(int)));
    cuda_check(cudaStreamSynchronize(cx->stream));
    return cx;
}

extern "C" void ops_cuda_destroy(void* ctx) {
    if (!ctx) return;
    CudaCtx* cx = ctx_enter(ctx);
    cuda_check(cudaStreamSynchronize(cx->stream));
    prof_destroy(cx);
    cuda_matmul_plans_free(cx);
    for (int i = 0; i < SCRATCH_COUNT; i++)
        if (cx->scratch[i]) cuda_check(cudaFree(cx->scratch[i]));
    if (cx->host_stage) cuda_check(cudaFreeHost(cx->host_stage));
    for (int i = 0; i < 2; i++) {
        HostSlot* slots[2] = {&cx->up[i], &cx->down[i]};
        for (int k = 0; k < 2; k++) {
            if (slots[k]->p) cuda_check(cudaFreeHost(slots[k]->p));
            if (slots[k]->done) cuda_check(cudaEventDestroy(slots[k]->done));
        }
    }
    if (cx->h_slot_error) cuda_check(cudaFreeHost(cx->h_slot_error));
    cuda_check(cudaFreeHost(cx->h_error));
    cuda_check(cudaFree(cx->d_error));
    cuda_check(cudaFree(cx->lt_workspace));
    cublas_check(cublasLtDestroy(cx->lt));
    if (cx->own_stream) cuda_check(cudaStreamDestroy(cx->stream));
    free(cx);
}

extern "C" void* ops_cuda_stream(void* ctx) { return (void*)((CudaCtx*)ctx)->stream; }
extern "C" int ops_cuda_device(void* ctx) { return ((CudaCtx*)ctx)->device; }

// ----------------------------------------------------------------------------
// memory ops

static void* op_alloc(void* ctx, size_t bytes) {
    CudaCtx* cx = ctx_enter(ctx);
    void* p = device_alloc(cx, bytes, "a buffer");
    if (p) {
        cuda_check(cudaMemsetAsync(p, 0, bytes, cx->stream));
        cuda_check(cudaStreamSynchronize(cx->stream));
    }
    return p;
}

static void op_free(void* ctx, void* p) {
    ctx_enter(ctx);
    if (p) cuda_check(cudaFree(p));
}

static void op_zero(void* ctx, void* p, size_t bytes) {
    CudaCtx* cx = ctx_enter(ctx);
    if (bytes > 0) cuda_check(cudaMemsetAsync(p, 0, bytes, cx->stream));
}

static void op_copy(void* ctx, void* dst, const void* src, size_t bytes) {
    CudaCtx* cx = ctx_enter(ctx);
    if (bytes > 0 && dst != src)
        cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cx->stream));
}

static void* host_stage(CudaCtx* cx) {
    if (!cx->host_stage) cuda_check(cudaMallocHost(&cx->host_stage, STAGE_BYTES));
    return cx->host_stage;
}

static void op_upload_f32(void* ctx, void* dst, const float* src, size_t n) {
    CudaCtx* cx = ctx_enter(ctx);
    if (n == 0) return;
    const size_t chunk = STAGE_BYTES / sizeof(float);
    float* hs = (float*)host_stage(cx);
    float* ds = (float*)cuda_scratch(cx, SCRATCH_STAGE, STAGE_BYTES);
    for (size_t off = 0; off < n; off += chunk) {
        size_t cnt = n - off < chunk ? n - off : chunk;
        memcpy(hs, src + off, cnt * sizeof(float));
        cuda_check(cudaMemcpyAsync(ds, hs, cnt * sizeof(float), cudaMemcpyHostToDevice,
                                   cx->stream));
        cuda_convert_f32_to_bf16(cx, (bf16*)dst + off, ds, cnt);
        cuda_check(cudaStreamSynchronize(cx->stream));  // hs is refilled next
    }
}

static void op_download_f32(void* ctx, float* dst, const void* src, size_t n) {
    CudaCtx* cx = ctx_enter(ctx);
    check_device_errors(cx);
    const size_t chunk = STAGE_BYTES / sizeof(float);
    float* hs = (float*)host_stage(cx);
    float* ds = (float*)cuda_scratch(cx, SCRATCH_STAGE, STAGE_BYTES);
    for (size_t off = 0; off < n; off += chunk) {
        size_t cnt = n - off < chunk ? n - off : chunk;
        cuda_convert_bf16_to_f32(cx, ds, (const bf16*)src + off, cnt);
        cuda_check(cudaMemcpyAsync(hs, ds, cnt * sizeof(float), cudaMemcpyDeviceToHost,
                                   cx->stream));
        cuda_check(cudaStreamSynchronize(cx->stream));
        memcpy(dst + off, hs, cnt * sizeof(float));
    }
}

// From pageable memory cudaMemcpyAsync returns once the bytes are staged (src is the caller's
// again) and the copy stays ordered before the stream's next work, so nothing waits for it (a
// decode step's inputs go up and its graph is launched at once); from page-locked memory the
// copy reads src later, so it is waited for.
static void op_upload(void* ctx, void* dst, const void* src, size_t bytes) {
    CudaCtx* cx = ctx_enter(ctx);
    if (bytes == 0) return;
    cudaPointerAttributes attr;
    cuda_check(cudaPointerGetAttributes(&attr, src));
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cx->stream));
    if (attr.type != cudaMemoryTypeUnregistered) cuda_check(cudaStreamSynchronize(cx->stream));
}

// The error word and the bytes in one round trip (the error is reported before the bytes are
// used, as before).
static void op_download(void* ctx, void* dst, const void* src, size_t bytes) {
    CudaCtx* cx = ctx_enter(ctx);
    cuda_check(cudaMemcpyAsync(cx->h_error, cx->d_error, sizeof(int), cudaMemcpyDeviceToHost,
                               cx->stream));
    if (bytes) cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cx->stream));
    cuda_check(cudaStreamSynchronize(cx->stream));
    report_device_errors(cx);
}

static void op_synchronize(void* ctx) { check_device_errors(ctx_enter(ctx)); }

// ---- overlapped transfers (ops.h upload_async / download_start / download_finish) ----

// Slot h holding at least `bytes` with no copy in flight: waits for its last copy, grows it.
static void* host_slot_take(HostSlot* h, size_t bytes) {
    if (h->pending) cuda_check(cudaEventSynchronize(h->done));
    h->pending = 0;
    if (!h->done) cuda_check(cudaEventCreateWithFlags(&h->done, cudaEventDisableTiming));
    if (bytes > h->cap) {
        if (h->p) cuda_check(cudaFreeHost(h->p));
        h->p = NULL;
        cuda_check(cudaMallocHost(&h->p, bytes));
        h->cap = bytes;
    }
    return h->p;
}

static HostSlot* host_slot(HostSlot* pair, int slot, const char* op) {
    if (slot < 0 || slot > 1) fatal("internal: %s slot %d (0 or 1)", op, slot);
    return &pair[slot];
}

static void op_upload_async(void* ctx, void* dst, const void* src, size_t bytes, int slot) {
    CudaCtx* cx = ctx_enter(ctx);
    HostSlot* h = host_slot(cx->up, slot, "upload_async");
    if (bytes == 0) return;
    memcpy(host_slot_take(h, bytes), src, bytes);
    cuda_check(cudaMemcpyAsync(dst, h->p, bytes, cudaMemcpyHostToDevice, cx->stream));
    cuda_check(cudaEventRecord(h->done, cx->stream));
    h->pending = 1;
}

static void op_download_start(void* ctx, const void* src, size_t bytes, int slot) {
    CudaCtx* cx = ctx_enter(ctx);
    HostSlot* h = host_slot(cx->down, slot, "download_start");
    if (!cx->h_slot_error) cuda_check(cudaMallocHost((void**)&cx->h_slot_error, 2 * sizeof(int)));
    void* p = host_slot_take(h, bytes ? bytes : 1);
    cuda_check(cudaMemcpyAsync(cx->h_slot_error + slot, cx->d_error, sizeof(int),
                               cudaMemcpyDeviceToHost, cx->stream));
    if (bytes) cuda_check(cudaMemcpyAsync(p, src, bytes, cudaMemcpyDeviceToHost, cx->stream));
    cuda_check(cudaEventRecord(h->done, cx->stream));
    h->pending = 1;
}

static void op_download_finish(void* ctx, void* dst, size_t bytes, int slot) {
    CudaCtx* cx = ctx_enter(ctx);
    HostSlot* h = host_slot(cx->down, slot, "download_finish");
    if (!h->pending) fatal("internal: download_finish of slot %d without a download_start", slot);
    if (bytes > h->cap)
        fatal("internal: download_finish of %zu bytes from a slot of %zu", bytes, h->cap);
    cuda_check(cudaEventSynchronize(h->done));
    h->pending = 0;
    report_device_error_word(cx->h_slot_error[slot]);
    if (bytes) memcpy(dst, h->p, bytes);
}

// ----------------------------------------------------------------------------
// compute ops: thin casts onto the launchers

static void op_embedding_forward(void* ctx, void* out, const int32_t* ids, const void* wte, int N,
                                 int C) {
    // The vocabulary size is not an argument of the forward: ids are range-checked by the
    // backward (and the loss); here only negative ids can be caught.
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * N * C, "embedding fwd N=%d C=%d", N, C);
    cuda_embedding_forward(cx, (bf16*)out, ids, (const bf16*)wte, N, C, 0x7fffffff);
    prof_end(cx);
}

static void op_embedding_backward(void* ctx, float* dwte, const void* dout, const int32_t* ids,
                                  int N, int C, int V) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 10.0 * N * C, "embedding bwd N=%d C=%d V=%d", N, C, V);
    cuda_embedding_backward(cx, dwte, (const bf16*)dout, ids, N, C, V);
    prof_end(cx);
}

static void op_rmsnorm_forward(void* ctx, void* out, float* rstd, const void* inp, const void* w,
                               int N, int C, float eps) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * N * C, "rmsnorm fwd N=%d C=%d", N, C);
    cuda_rmsnorm_forward(cx, NULL, (bf16*)out, rstd, (const bf16*)inp, NULL, (const bf16*)w, N, C,
                         eps);
    prof_end(cx);
}

static void op_residual_rmsnorm_forward(void* ctx, void* res, void* out, float* rstd,
                                        const void* a, const void* b, const void* w, int N, int C,
                                        float eps) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 8.0 * N * C, "residual+rmsnorm fwd N=%d C=%d", N, C);
    cuda_rmsnorm_forward(cx, (bf16*)res, (bf16*)out, rstd, (const bf16*)a, (const bf16*)b,
                         (const bf16*)w, N, C, eps);
    prof_end(cx);
}

static void op_rmsnorm_backward(void* ctx, void* dinp, float* dw, const void* dout,
                                const void* inp, const void* w, const float* rstd, int N, int C) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 6.0 * N * C, "rmsnorm bwd N=%d C=%d", N, C);
    cuda_rmsnorm_backward(cx, (bf16*)dinp, dw, (const bf16*)dout, (const bf16*)inp,
                          (const bf16*)w, rstd, N, C);
    prof_end(cx);
}

static void op_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                              const void* bias, int N, int IC, int OC) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 2.0 * N * IC * OC, 0, "matmul fwd N=%d IC=%d OC=%d", N, IC, OC);
    cuda_matmul_forward(cx, (bf16*)out, (const bf16*)inp, (const bf16*)w, (const bf16*)bias, N,
                        IC, OC);
    prof_end(cx);
}

static void op_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias, const void* dout,
                               const void* inp, const void* w, int N, int IC, int OC) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, (dinp ? 4.0 : 2.0) * N * IC * OC, 0, "matmul bwd%s N=%d IC=%d OC=%d",
               dinp ? "" : " (dw only)", N, IC, OC);
    cuda_matmul_backward(cx, (bf16*)dinp, dw, dbias, (const bf16*)dout, (const bf16*)inp,
                         (const bf16*)w, N, IC, OC);
    prof_end(cx);
}

static void op_qknorm_rope_forward(void* ctx, void* out, float* rstd, const void* inp,
                                   const void* q_norm_w, const void* k_norm_w, const float* cos,
                                   const float* sin, int B, int T, int H, int KVH, int HD,
                                   float eps) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * B * T * (H + 2 * KVH) * HD, "qk-norm+rope fwd B=%d T=%d", B, T);
    cuda_qknorm_rope_forward(cx, (bf16*)out, rstd, (const bf16*)inp, (const bf16*)q_norm_w,
                             (const bf16*)k_norm_w, cos, sin, B, T, H, KVH, HD, eps);
    prof_end(cx);
}

static void op_qknorm_rope_backward(void* ctx, void* dinp, float* dq_norm_w, float* dk_norm_w,
                                    const void* dout, const void* inp, const void* q_norm_w,
                                    const void* k_norm_w, const float* rstd, const float* cos,
                                    const float* sin, int B, int T, int H, int KVH, int HD) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 6.0 * B * T * (H + 2 * KVH) * HD, "qk-norm+rope bwd B=%d T=%d", B, T);
    cuda_qknorm_rope_backward(cx, (bf16*)dinp, dq_norm_w, dk_norm_w, (const bf16*)dout,
                              (const bf16*)inp, (const bf16*)q_norm_w, (const bf16*)k_norm_w,
                              rstd, cos, sin, B, T, H, KVH, HD);
    prof_end(cx);
}

// The flash kernels take head dims 16/32/64/128 and 16-byte aligned rows.
static int flash_attention_ok(int H, int KVH, int HD, const void* a, const void* b, const void* c,
                              const void* d) {
    return attention_supports_head_dim(HD) && ((H + 2 * KVH) * HD) % 8 == 0 &&
           (H * HD) % 8 == 0 && is_aligned16(a) && is_aligned16(b) && is_aligned16(c) &&
           is_aligned16(d);
}

static void op_attention_forward(void* ctx, void* out, float* lse, const void* qkv, int B, int T,
                                 int H, int KVH, int HD) {
    CudaCtx* cx = ctx_enter(ctx);
    if (B <= 0 || T <= 0) return;
    const int flash = flash_attention_ok(H, KVH, HD, out, qkv, out, qkv);
    // causal: half of the 4 T^2 HD of QK^T and PV per head
    prof_begin(cx, 2.0 * B * H * (double)T * T * HD, 0, "attention fwd%s B=%d T=%d H=%d HD=%d",
               flash ? "" : " (fallback)", B, T, H, HD);
    if (flash)
        attention_forward_bf16(out, lse, qkv, B, T, H, KVH, HD, cx->stream);
    else
        cuda_attention_forward_simple(cx, (bf16*)out, lse, (const bf16*)qkv, B, T, H, KVH, HD);
    prof_end(cx);
}

static void op_attention_backward(void* ctx, void* dqkv, const void* dout, const void* qkv,
                                  const void* out, const float* lse, int B, int T, int H, int KVH,
                                  int HD) {
    CudaCtx* cx = ctx_enter(ctx);
    if (B <= 0 || T <= 0) return;
    const int flash = flash_attention_ok(H, KVH, HD, dqkv, dout, qkv, out);
    // the recomputed scores, dV, dP, dQ and dK: 2.5x the forward
    prof_begin(cx, 5.0 * B * H * (double)T * T * HD, 0, "attention bwd%s B=%d T=%d H=%d HD=%d",
               flash ? "" : " (fallback)", B, T, H, HD);
    if (flash) {
        size_t ws_bytes = attention_backward_workspace_bytes(B, T, H, KVH, HD);
        void* ws = cuda_scratch(cx, SCRATCH_ATTN, ws_bytes > 0 ? ws_bytes : 16);
        attention_backward_bf16(dqkv, dout, qkv, out, lse, ws, B, T, H, KVH, HD, cx->stream);
    } else {
        float* ws = (float*)cuda_scratch(cx, SCRATCH_ATTN,
                                         cuda_attention_simple_workspace_bytes(B, T, H));
        cuda_attention_backward_simple(cx, (bf16*)dqkv, (const bf16*)dout, (const bf16*)qkv,
                                       (const bf16*)out, lse, ws, B, T, H, KVH, HD);
    }
    prof_end(cx);
}

// Pairs (query, key) a row attends to per (b, h) summed over the rows: T(T+1)/2 causal, fewer
// with a window (for the profiler's FLOP count).
static double attention_visible_pairs(int T, int window) {
    const double t = T, w = window > 0 && window < T ? window : T;
    return w * (w + 1) / 2 + (t - w) * w;
}

static void op_attention_sink_forward(void* ctx, void* out, float* lse, const void* qkv,
                                      const void* sinks, int B, int T, int H, int KVH, int HD,
                                      int window) {
    CudaCtx* cx = ctx_enter(ctx);
    if (B <= 0 || T <= 0) return;
    const int flash = flash_attention_ok(H, KVH, HD, out, qkv, out, qkv);
    prof_begin(cx, 4.0 * B * H * attention_visible_pairs(T, window) * HD, 0,
               "attention sink fwd%s B=%d T=%d H=%d HD=%d window=%d", flash ? "" : " (fallback)",
               B, T, H, HD, window);
    if (flash)
        attention_sink_forward_bf16(out, lse, qkv, sinks, B, T, H, KVH, HD, window, cx->stream);
    else
        cuda_attention_sink_forward_simple(cx, (bf16*)out, lse, (const bf16*)qkv,
                                           (const bf16*)sinks, B, T, H, KVH, HD, window);
    prof_end(cx);
}

static void op_attention_sink_backward(void* ctx, void* dqkv, float* dsinks, const void* dout,
                                       const void* qkv, const void* out, const float* lse,
                                       const void* sinks, int B, int T, int H, int KVH, int HD,
                                       int window) {
    CudaCtx* cx = ctx_enter(ctx);
    if (B <= 0 || T <= 0) return;
    const int flash = flash_attention_ok(H, KVH, HD, dqkv, dout, qkv, out);
    prof_begin(cx, 10.0 * B * H * attention_visible_pairs(T, window) * HD, 0,
               "attention sink bwd%s B=%d T=%d H=%d HD=%d window=%d", flash ? "" : " (fallback)",
               B, T, H, HD, window);
    if (flash) {
        size_t ws_bytes = attention_backward_workspace_bytes(B, T, H, KVH, HD);
        void* ws = cuda_scratch(cx, SCRATCH_ATTN, ws_bytes > 0 ? ws_bytes : 16);
        attention_sink_backward_bf16(dqkv, dsinks, dout, qkv, out, lse, sinks, ws, B, T, H, KVH,
                                     HD, window, cx->stream);
    } else {
        float* ws = (float*)cuda_scratch(cx, SCRATCH_ATTN,
                                         cuda_attention_simple_workspace_bytes(B, T, H));
        cuda_attention_sink_backward_simple(cx, (bf16*)dqkv, (const bf16*)dout, (const bf16*)qkv,
                                            (const bf16*)out, lse, ws, B, T, H, KVH, HD, window);
        // the simple backward left D (B, H, T) in the workspace
        attention_sink_dsinks_bf16(dsinks, sinks, lse, ws, B, T, H, cx->stream);
    }
    prof_end(cx);
}

static int op_matmul_swiglu_forward(void* ctx, void* out, const void* inp, const void* w, int N,
                                    int IC, int F) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 4.0 * N * IC * F, 0, "matmul+swiglu fwd N=%d IC=%d F=%d", N, IC, F);
    const int done =
        cuda_matmul_swiglu_forward(cx, (bf16*)out, (const bf16*)inp, (const bf16*)w, N, IC, F);
    prof_end(cx);
    return done;
}

static void op_swiglu_forward(void* ctx, void* out, const void* gu, int N, int F) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 6.0 * N * F, "swiglu fwd N=%d F=%d", N, F);
    cuda_swiglu_forward(cx, (bf16*)out, (const bf16*)gu, N, F);
    prof_end(cx);
}

static void op_swiglu_backward(void* ctx, void* dgu, const void* dout, const void* gu, int N,
                               int F) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 10.0 * N * F, "swiglu bwd N=%d F=%d", N, F);
    cuda_swiglu_backward(cx, (bf16*)dgu, (const bf16*)dout, (const bf16*)gu, N, F);
    prof_end(cx);
}

static void op_add(void* ctx, void* out, const void* a, const void* b, size_t n) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 6.0 * (double)n, "add n=%zu", n);
    cuda_add(cx, (bf16*)out, (const bf16*)a, (const bf16*)b, n);
    prof_end(cx);
}

static void op_scale(void* ctx, void* out, const void* inp, float s, size_t n) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * (double)n, "scale n=%zu", n);
    cuda_scale(cx, (bf16*)out, (const bf16*)inp, s, n);
    prof_end(cx);
}

static void op_copy_cols(void* ctx, void* dst, const void* src, int N, int ld, int c0, int w) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * N * w, "copy cols N=%d ld=%d w=%d", N, ld, w);
    cuda_copy_cols(cx, (bf16*)dst, (const bf16*)src, N, ld, c0, w);
    prof_end(cx);
}

static void op_add_f32(void* ctx, float* dst, const float* src, size_t n) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 12.0 * (double)n, "add f32 n=%zu", n);
    cuda_add_f32(cx, dst, src, n);
    prof_end(cx);
}

static void op_dequantize(void* ctx, void* out, const void* blocks, int type, size_t n) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n, "dequantize type=%d n=%zu", type, n);
    cuda_dequantize(cx->stream, cx->n_sms, DEQUANT_AUTO, out, blocks, type, n);
    prof_end(cx);
}

static void op_matmul_cols_forward(void* ctx, void* out, int accumulate, const void* inp, int ldi,
                                   const void* w, float scale, int N, int IC, int OC, int ld,
                                   int c0) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 2.0 * N * IC * OC, 0, "cols fwd%s N=%d IC=%d OC=%d", accumulate ? " acc" : "",
               N, IC, OC);
    cuda_matmul_cols_forward(cx, (bf16*)out, accumulate, (const bf16*)inp, ldi, (const bf16*)w,
                             scale, N, IC, OC, ld, c0);
    prof_end(cx);
}

static void op_matmul_cols_backward(void* ctx, void* dinp, int accumulate, float* dw,
                                    const void* dout, const void* inp, const void* w, float scale,
                                    int N, int IC, int ldi, int OC, int ld, int c0) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 2.0 * N * IC * OC * ((dinp ? 1 : 0) + (dw ? 1 : 0)), 0,
               "cols bwd%s%s N=%d IC=%d OC=%d", dinp ? " dinp" : "", dw ? " dw" : "", N, IC, OC);
    cuda_matmul_cols_backward(cx, (bf16*)dinp, accumulate, dw, (const bf16*)dout,
                              (const bf16*)inp, (const bf16*)w, scale, N, IC, ldi, OC, ld, c0);
    prof_end(cx);
}

static void op_dropout(void* ctx, void* out, const void* inp, float p, uint64_t seed, int64_t row0,
                       int N, int C) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * N * C, "dropout N=%d C=%d", N, C);
    cuda_dropout(cx, (bf16*)out, (const bf16*)inp, p, seed, row0, N, C);
    prof_end(cx);
}

static void op_crossentropy_forward_backward(void* ctx, void* logits, float* losses,
                                             const int32_t* targets, int n, int V,
                                             float grad_scale, int compute_grad) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, (compute_grad ? 4.0 : 2.0) * n * V, "cross-entropy%s n=%d V=%d",
               compute_grad ? " fwd+bwd" : " fwd", n, V);
    cuda_crossentropy_forward_backward(cx, (bf16*)logits, losses, targets, n, V, grad_scale,
                                       compute_grad);
    prof_end(cx);
}

// ---- generation and the policy-gradient objective (decode.cu, policy.cu) ----

static void op_decode_rope_append(void* ctx, void* out, void* kc, void* vc, const void* inp,
                                  const void* q_norm_w, const void* k_norm_w, const float* cos,
                                  const float* sin, const int32_t* pos, const int32_t* slot, int n,
                                  int maxT, int H, int KVH, int HD, float eps) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * (H + 3 * KVH) * HD * 2, "decode rope+append n=%d", n);
    cuda_decode_rope_append(cx, (bf16*)out, (bf16*)kc, (bf16*)vc, (const bf16*)inp,
                            (const bf16*)q_norm_w, (const bf16*)k_norm_w, cos, sin, pos, slot, n,
                            maxT, H, KVH, HD, eps);
    prof_end(cx);
}

static void op_attention_decode(void* ctx, void* out, const void* qkv, const void* kc,
                                const void* vc, const int32_t* slot, const int32_t* len,
                                const void* sinks, int n, int maxT, int H, int KVH, int HD,
                                int window) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 0, "attention decode n=%d maxT=%d H=%d KVH=%d HD=%d", n, maxT, H, KVH, HD);
    cuda_attention_decode(cx, (bf16*)out, (const bf16*)qkv, (const bf16*)kc, (const bf16*)vc,
                          slot, len, (const bf16*)sinks, n, maxT, H, KVH, HD, window);
    prof_end(cx);
}

// ----------------------------------------------------------------------------
// recorded op sequences (CUDA graphs): the generator's decode step, replayed with one launch

typedef struct CudaGraph {
    cudaGraphExec_t exec;
    uint64_t epoch;  // the context's scratch_epoch it was recorded in
} CudaGraph;

static int op_graph_begin(void* ctx) {
    CudaCtx* cx = ctx_enter(ctx);
    if (cx->prof) return -1;  // the profile's events time ops one by one
    cx->capture_epoch = cx->scratch_epoch;
    cx->recording = 1;
    // thread-local: other threads (the engine's issue threads) go on with their own work
    cuda_check(cudaStreamBeginCapture(cx->stream, cudaStreamCaptureModeThreadLocal));
    return 0;
}

static void* op_graph_end(void* ctx) {
    CudaCtx* cx = ctx_enter(ctx);
    cudaGraph_t graph;
    cx->recording = 0;
    cuda_check(cudaStreamEndCapture(cx->stream, &graph));
    if (cx->scratch_epoch != cx->capture_epoch) {  // (growing scratch fails inside a recording)
        cuda_check(cudaGraphDestroy(graph));
        return NULL;
    }
    CudaGraph* g = (CudaGraph*)calloc_check(1, sizeof(CudaGraph));
    cuda_check(cudaGraphInstantiate(&g->exec, graph, 0));
    cuda_check(cudaGraphDestroy(graph));
    g->epoch = cx->scratch_epoch;
    return g;
}

static int op_graph_launch(void* ctx, void* graph) {
    CudaCtx* cx = ctx_enter(ctx);
    CudaGraph* g = (CudaGraph*)graph;
    if (g->epoch != cx->scratch_epoch) return -1;
    cuda_check(cudaGraphLaunch(g->exec, cx->stream));
    return 0;
}

static void op_graph_free(void* ctx, void* graph) {
    ctx_enter(ctx);
    CudaGraph* g = (CudaGraph*)graph;
    if (!g) return;
    cuda_check(cudaGraphExecDestroy(g->exec));
    free(g);
}

static void op_gather_ids(void* ctx, int32_t* ids, const int32_t* prev, const int32_t* from,
                          int n) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 12.0 * n, "gather ids n=%d", n);
    cuda_gather_ids(cx, ids, prev, from, n);
    prof_end(cx);
}

static void op_sample_tokens(void* ctx, int32_t* tokens, float* logp, const void* logits,
                             const float* u, int n, int V, float temperature) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * V, "sample n=%d V=%d", n, V);
    cuda_sample_tokens(cx, tokens, logp, (const bf16*)logits, u, n, V, temperature);
    prof_end(cx);
}

static void op_policy_forward_backward(void* ctx, void* logits, float* logp, float* losses,
                                       const int32_t* targets, const float* old_logp,
                                       const float* ref_logp, const float* adv,
                                       const float* weight, int n, int V, float inv_temp,
                                       float clip_low, float clip_high, float kl_beta,
                                       int compute_grad) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, (compute_grad ? 4.0 : 2.0) * n * V, "policy loss%s n=%d V=%d",
               compute_grad ? " fwd+bwd" : " fwd", n, V);
    cuda_policy_forward_backward(cx, (bf16*)logits, logp, losses, targets, old_logp, ref_logp,
                                 adv, weight, n, V, inv_temp, clip_low, clip_high, kl_beta,
                                 compute_grad);
    prof_end(cx);
}

static void op_moe_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                                  const void* bias, const int32_t* offsets, int R, int E, int IC,
                                  int OC, int w_in_out) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 2.0 * R * IC * OC, 0, "moe matmul fwd R=%d E=%d IC=%d OC=%d", R, E, IC, OC);
    cuda_moe_matmul_forward(cx, MOE_MM_AUTO, (bf16*)out, (const bf16*)inp, (const bf16*)w,
                            (const bf16*)bias, offsets, R, E, IC, OC, w_in_out);
    prof_end(cx);
}

static void op_moe_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias,
                                   const void* dout, const void* inp, const void* w,
                                   const int32_t* offsets, int R, int E, int IC, int OC,
                                   int w_in_out) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, ((dinp ? 2.0 : 0.0) + (dw ? 2.0 : 0.0)) * R * IC * OC, 0,
               "moe matmul bwd R=%d E=%d IC=%d OC=%d", R, E, IC, OC);
    cuda_moe_matmul_backward(cx, MOE_MM_AUTO, (bf16*)dinp, dw, dbias, (const bf16*)dout,
                             (const bf16*)inp, (const bf16*)w, offsets, R, E, IC, OC, w_in_out);
    prof_end(cx);
}

// ----------------------------------------------------------------------------
// mixture of experts (moe.cu; the grouped matmul is moe_matmul.cu's)

static void op_moe_route_forward(void* ctx, int32_t* idx, float* weights, const void* logits,
                                 int n, int E, int K, int mode) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * E + 8.0 * n * K, "moe route fwd n=%d E=%d K=%d", n, E, K);
    cuda_moe_route_forward(cx, idx, weights, (const bf16*)logits, n, E, K, mode);
    prof_end(cx);
}

static void op_moe_route_backward(void* ctx, void* dlogits, const float* dweights,
                                  const void* logits, const int32_t* idx, const float* weights,
                                  const float* counts, float aux_scale, int n, int E, int K,
                                  int mode) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * n * E + 12.0 * n * K, "moe route bwd n=%d E=%d K=%d", n, E, K);
    cuda_moe_route_backward(cx, (bf16*)dlogits, dweights, (const bf16*)logits, idx, weights,
                            counts, aux_scale, n, E, K, mode);
    prof_end(cx);
}

static void op_moe_dispatch(void* ctx, int32_t* offsets, int32_t* src, int32_t* dst,
                            const int32_t* idx, int n, int E, int K) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 16.0 * n * K, "moe dispatch n=%d E=%d K=%d", n, E, K);
    cuda_moe_dispatch(cx, offsets, src, dst, idx, n, E, K);
    prof_end(cx);
}

static void op_moe_gather(void* ctx, void* out, const void* inp, const int32_t* src, int n,
                          int K, int C) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 4.0 * n * K * C, "moe gather n=%d K=%d C=%d", n, K, C);
    cuda_moe_gather(cx, (bf16*)out, (const bf16*)inp, src, n, K, C);
    prof_end(cx);
}

static void op_moe_gather_backward(void* ctx, void* dinp, const void* dout, const int32_t* dst,
                                   int n, int K, int C) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * C * (K + 1), "moe gather bwd n=%d K=%d C=%d", n, K, C);
    cuda_moe_gather_backward(cx, (bf16*)dinp, (const bf16*)dout, dst, n, K, C);
    prof_end(cx);
}

static void op_moe_combine_forward(void* ctx, void* out, const void* y, const float* weights,
                                   const int32_t* dst, int n, int K, int C) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * C * (K + 1), "moe combine fwd n=%d K=%d C=%d", n, K, C);
    cuda_moe_combine_forward(cx, (bf16*)out, (const bf16*)y, weights, dst, n, K, C);
    prof_end(cx);
}

static void op_moe_combine_backward(void* ctx, void* dy, float* dweights, const void* dout,
                                    const void* y, const float* weights, const int32_t* dst,
                                    int n, int K, int C) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * C * (2 * K + 1), "moe combine bwd n=%d K=%d C=%d", n, K, C);
    cuda_moe_combine_backward(cx, (bf16*)dy, dweights, (const bf16*)dout, (const bf16*)y,
                              weights, dst, n, K, C);
    prof_end(cx);
}

static void op_moe_router_stats(void* ctx, float* stats, const void* logits,
                                const int32_t* offsets, int n, int E) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 2.0 * n * E, "moe router stats n=%d E=%d", n, E);
    cuda_moe_router_stats(cx, stats, (const bf16*)logits, offsets, n, E);
    prof_end(cx);
}

static void op_gptoss_glu_forward(void* ctx, void* out, const void* gu, int R, int F,
                                  float limit, float alpha) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 6.0 * R * F, "gpt-oss glu fwd R=%d F=%d", R, F);
    cuda_gptoss_glu_forward(cx, (bf16*)out, (const bf16*)gu, R, F, limit, alpha);
    prof_end(cx);
}

static void op_gptoss_glu_backward(void* ctx, void* dgu, const void* dout, const void* gu, int R,
                                   int F, float limit, float alpha) {
    CudaCtx* cx = ctx_enter(ctx);
    prof_begin(cx, 0, 10.0 * R * F, "gpt-oss glu bwd R=%d F=%d", R, F);
    cuda_gptoss_glu_backward(cx, (bf16*)dgu, (const bf16*)dout, (const bf16*)gu, R, F, limit,
                             alpha);
    prof_end(cx);
}

// ----------------------------------------------------------------------------
// the table

extern "C" const Ops ops_cuda = {
    .name = "cuda",
    .act_bytes = 2,
    .alloc = op_alloc,
    .free = op_free,
    .zero = op_zero,
    .copy = op_copy,
    .upload_f32 = op_upload_f32,
    .download_f32 = op_download_f32,
    .upload = op_upload,
    .download = op_download,
    .synchronize = op_synchronize,
    .upload_async = op_upload_async,
    .download_start = op_download_start,
    .download_finish = op_download_finish,
    .embedding_forward = op_embedding_forward,
    .embedding_backward = op_embedding_backward,
    .rmsnorm_forward = op_rmsnorm_forward,
    .residual_rmsnorm_forward = op_residual_rmsnorm_forward,
    .rmsnorm_backward = op_rmsnorm_backward,
    .matmul_forward = op_matmul_forward,
    .matmul_backward = op_matmul_backward,
    .qknorm_rope_forward = op_qknorm_rope_forward,
    .qknorm_rope_backward = op_qknorm_rope_backward,
    .attention_forward = op_attention_forward,
    .attention_backward = op_attention_backward,
    .swiglu_forward = op_swiglu_forward,
    .matmul_swiglu_forward = op_matmul_swiglu_forward,
    .swiglu_backward = op_swiglu_backward,
    .add = op_add,
    .scale = op_scale,
    .copy_cols = op_copy_cols,
    .add_f32 = op_add_f32,
    .crossentropy_forward_backward = op_crossentropy_forward_backward,
    .attention_decode = op_attention_decode,
    .policy_forward_backward = op_policy_forward_backward,
    .decode_rope_append = op_decode_rope_append,
    .sample_tokens = op_sample_tokens,
    .gather_ids = op_gather_ids,
    .profile_phase = ops_cuda_profile_phase,
    .graph_begin = op_graph_begin,
    .graph_end = op_graph_end,
    .graph_launch = op_graph_launch,
    .graph_free = op_graph_free,
    .attention_sink_forward = op_attention_sink_forward,
    .attention_sink_backward = op_attention_sink_backward,
    .moe_route_forward = op_moe_route_forward,
    .moe_route_backward = op_moe_route_backward,
    .moe_dispatch = op_moe_dispatch,
    .moe_gather = op_moe_gather,
    .moe_gather_backward = op_moe_gather_backward,
    .moe_matmul_forward = op_moe_matmul_forward,
    .moe_matmul_backward = op_moe_matmul_backward,
    .gptoss_glu_forward = op_gptoss_glu_forward,
    .gptoss_glu_backward = op_gptoss_glu_backward,
    .moe_combine_forward = op_moe_combine_forward,
    .moe_combine_backward = op_moe_combine_backward,
    .moe_router_stats = op_moe_router_stats,
    .matmul_cols_forward = op_matmul_cols_forward,
    .matmul_cols_backward = op_matmul_cols_backward,
    .dropout = op_dropout,
    .dequantize = op_dequantize,
};
