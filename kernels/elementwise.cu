/*
 * elementwise.cu — the memory-bound ops without reductions across rows: fp32 <-> bf16 conversion
 * (host staging), token embedding gather, the decode step's id gather, SwiGLU forward/backward,
 * add, and the ordered reduction of per-block partial sums that the column reductions (rmsnorm
 * dw, dbias, qk-norm dw) share.
 *
 * Each kernel has a 16-byte path (8 bf16 per thread per step, grid-stride, several independent
 * loads in flight per thread) and a scalar path for widths that are not multiples of 8 or for
 * pointers that are not 16-byte aligned (a tensor at an odd offset inside a parameter slab).
 *
 * Rounding mirrors HF transformers in bf16: silu(gate) is rounded to bf16 before the product with
 * up (act_fn(gate) * up is two bf16 tensor ops there).
 *
 * The decode step's three (the id and embedding gathers, the SwiGLU forward) wait for the kernel
 * before them (ptx.cuh pdl_wait) before touching memory and are launched through cuda_launch, so
 * a recorded decode step can launch them early, during the tail of the kernel before.
 */
#include "common.cuh"
#include "ptx.cuh"

// ----------------------------------------------------------------------------
// fp32 <-> bf16

__global__ void convert_f32_to_bf16_kernel(bf16* __restrict__ dst, const float* __restrict__ src,
                                           size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void convert_bf16_to_f32_kernel(float* __restrict__ dst, const bf16* __restrict__ src,
                                           size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

// A grid-stride launch: enough blocks to fill the GPU several times, never more than needed.
static unsigned stride_grid(CudaCtx* cx, size_t work_items, int block) {
    size_t want = grid_size(work_items, block), cap = (size_t)cx->n_sms * 16;
    if (want < 1) want = 1;
    return (unsigned)(want < cap ? want : cap);
}

void cuda_convert_f32_to_bf16(CudaCtx* cx, bf16* dst, const float* src, size_t n) {
    if (n == 0) return;
    convert_f32_to_bf16_kernel<<<stride_grid(cx, n, 256), 256, 0, cx->stream>>>(dst, src, n);
    cuda_check_launch();
}

void cuda_convert_bf16_to_f32(CudaCtx* cx, float* dst, const bf16* src, size_t n) {
    if (n == 0) return;
    convert_bf16_to_f32_kernel<<<stride_grid(cx, n, 256), 256, 0, cx->stream>>>(dst, src, n);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// token embedding: out (N, C) = wte[ids] — one warp per row

template <int VEC>
__global__ void embedding_forward_kernel(bf16* __restrict__ out, const int32_t* __restrict__ ids,
                                         const bf16* __restrict__ wte, int N, int C, int V,
                                         int* err) {
    pdl_wait();  // (a recorded decode step: the kernel before has finished; see ptx.cuh)
    pdl_trigger();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (row >= N) return;
    int id = ids[row];
    bf16* dst = out + (size_t)row * C;
    if (id < 0 || id >= V) {  // reported at the next synchronize; the row is zeroed meanwhile
        if (lane == 0) atomicOr(err, CUDA_ERR_TOKEN_ID);
        for (int c = lane; c < C; c += 32) dst[c] = __float2bfloat16_rn(0.0f);
        return;
    }
    const bf16* src = wte + (size_t)id * C;
    if constexpr (VEC == 8) {
        for (int c = lane * 8; c < C; c += 32 * 8)
            *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
    } else {
        for (int c = lane; c < C; c += 32) dst[c] = src[c];
    }
}

void cuda_embedding_forward(CudaCtx* cx, bf16* out, const int32_t* ids, const bf16* wte, int N,
                            int C, int V) {
    if (N <= 0 || C <= 0) return;
    const int warps = 8;
    unsigned grid = grid_size((size_t)N, warps);
    if (C % 8 == 0 && is_aligned16(out) && is_aligned16(wte))
        cuda_launch(cx, embedding_forward_kernel<8>, grid, dim3(warps * 32), 0, out, ids, wte, N,
                    C, V, cx->d_error);
    else
        cuda_launch(cx, embedding_forward_kernel<1>, grid, dim3(warps * 32), 0, out, ids, wte, N,
                    C, V, cx->d_error);
}

// A decode step's ids from the step before (ops.h gather_ids): one thread per row.
__global__ void gather_ids_kernel(int32_t* __restrict__ ids, const int32_t* __restrict__ prev,
                                  const int32_t* __restrict__ from, int n) {
    pdl_wait();
    pdl_trigger();
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n && from[k] >= 0) ids[k] = prev[from[k]];
}

void cuda_gather_ids(CudaCtx* cx, int32_t* ids, const int32_t* prev, const int32_t* from, int n) {
    if (n <= 0) return;
    cuda_launch(cx, gather_ids_kernel, dim3(grid_size((size_t)n, 128)), dim3(128), 0, ids, prev,
                from, n);
}

// ----------------------------------------------------------------------------
// SwiGLU over gu (N, 2F) = [gate | up]: element e of the (N, F) output is row e / F, column e % F


template <int VEC>
__global__ void swiglu_forward_kernel(bf16* __restrict__ out, const bf16* __restrict__ gu,
                                      size_t n_vec, int F) {
    pdl_wait();
    pdl_trigger();
    const int FV = F / VEC;
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n_vec;
         v += (size_t)gridDim.x * blockDim.x) {
        size_t row = v / FV, col = (v % FV) * VEC;
        const bf16* gate = gu + row * 2 * F + col;
        float g[VEC], u[VEC], y[VEC];
        load_bf16<VEC>(gate, g);
        load_bf16<VEC>(gate + F, u);
#pragma unroll
        for (int k = 0; k < VEC; k++) y[k] = bf16_round(g[k] * sigmoid_f(g[k])) * u[k];
        store_bf16<VEC>(out + row * F + col, y);
    }
}

// du = dy silu(a); da = dy u σ(a) (1 + a (1 - σ(a))), the derivative of a σ(a) u.
template <int VEC>
__global__ void swiglu_backward_kernel(bf16* __restrict__ dgu, const bf16* __restrict__ dout,
                                       const bf16* __restrict__ gu, size_t n_vec, int F) {
    const int FV = F / VEC;
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n_vec;
         v += (size_t)gridDim.x * blockDim.x) {
        size_t row = v / FV, col = (v % FV) * VEC;
        const bf16* gate = gu + row * 2 * F + col;
        float g[VEC], u[VEC], dy[VEC], dg[VEC], du[VEC];
        load_bf16<VEC>(gate, g);
        load_bf16<VEC>(gate + F, u);
        load_bf16<VEC>(dout + row * F + col, dy);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float s = sigmoid_f(g[k]);
            du[k] = dy[k] * (g[k] * s);
            dg[k] = dy[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
        }
        bf16* dgate = dgu + row * 2 * F + col;
        store_bf16<VEC>(dgate, dg);
        store_bf16<VEC>(dgate + F, du);
    }
}

void cuda_swiglu_forward(CudaCtx* cx, bf16* out, const bf16* gu, int N, int F) {
    if (N <= 0 || F <= 0) return;
    size_t n = (size_t)N * F;
    if (F % 8 == 0 && is_aligned16(out) && is_aligned16(gu))
        cuda_launch(cx, swiglu_forward_kernel<8>, dim3(stride_grid(cx, n / 8, 256)), dim3(256), 0,
                    out, gu, n / 8, F);
    else
        cuda_launch(cx, swiglu_forward_kernel<1>, dim3(stride_grid(cx, n, 256)), dim3(256), 0, out,
                    gu, n, F);
}

void cuda_swiglu_backward(CudaCtx* cx, bf16* dgu, const bf16* dout, const bf16* gu, int N, int F) {
    if (N <= 0 || F <= 0) return;
    size_t n = (size_t)N * F;
    if (F % 8 == 0 && is_aligned16(dgu) && is_aligned16(dout) && is_aligned16(gu))
        swiglu_backward_kernel<8><<<stride_grid(cx, n / 8, 256), 256, 0, cx->stream>>>(
            dgu, dout, gu, n / 8, F);
    else
        swiglu_backward_kernel<1><<<stride_grid(cx, n, 256), 256, 0, cx->stream>>>(dgu, dout, gu,
                                                                                  n, F);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// add: out = a + b; out may alias a or b (each element is read before it is written, by the same
// thread), so no __restrict__ here.

template <int VEC>
__global__ void add_kernel(bf16* out, const bf16* a, const bf16* b, size_t n_vec) {
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n_vec;
         v += (size_t)gridDim.x * blockDim.x) {
        float x[VEC], y[VEC];
        load_bf16<VEC>(a + v * VEC, x);
        load_bf16<VEC>(b + v * VEC, y);
#pragma unroll
        for (int k = 0; k < VEC; k++) x[k] += y[k];
        store_bf16<VEC>(out + v * VEC, x);
    }
}

// out may alias inp (each element read, then written, by one thread).
__global__ void scale_kernel(bf16* out, const bf16* inp, float s, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(s * __bfloat162float(inp[i]));
}

void cuda_scale(CudaCtx* cx, bf16* out, const bf16* inp, float s, size_t n) {
    if (n == 0) return;
    scale_kernel<<<stride_grid(cx, n, 256), 256, 0, cx->stream>>>(out, inp, s, n);
    cuda_check_launch();
}

// dst (N, w) = src (N, ld) columns [c0, c0 + w): one block row per source row.
__global__ void copy_cols_kernel(bf16* __restrict__ dst, const bf16* __restrict__ src, int N,
                                 int ld, int c0, int w) {
    for (int row = blockIdx.x; row < N; row += gridDim.x)
        for (int j = threadIdx.x; j < w; j += blockDim.x)
            dst[(size_t)row * w + j] = src[(size_t)row * ld + c0 + j];
}

void cuda_copy_cols(CudaCtx* cx, bf16* dst, const bf16* src, int N, int ld, int c0, int w) {
    if (N <= 0 || w <= 0) return;
    copy_cols_kernel<<<N < 65535 ? N : 65535, 256, 0, cx->stream>>>(dst, src, N, ld, c0, w);
    cuda_check_launch();
}

void cuda_add(CudaCtx* cx, bf16* out, const bf16* a, const bf16* b, size_t n) {
    if (n == 0) return;
    size_t head = 0;
    if (is_aligned16(out) && is_aligned16(a) && is_aligned16(b)) {
        head = n / 8 * 8;
        if (head > 0)
            add_kernel<8><<<stride_grid(cx, head / 8, 256), 256, 0, cx->stream>>>(out, a, b,
                                                                                 head / 8);
    }
    if (n > head)
        add_kernel<1><<<stride_grid(cx, n - head, 256), 256, 0, cx->stream>>>(
            out + head, a + head, b + head, n - head);
    cuda_check_launch();
}

// fp32 dst += src (gradient folds): one rounding per element, as on the CPU.
template <int VEC>
__global__ void add_f32_kernel(float* __restrict__ dst, const float* __restrict__ src,
                               size_t n_vec) {
    for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n_vec;
         v += (size_t)gridDim.x * blockDim.x) {
        if (VEC == 4) {
            float4 x = reinterpret_cast<float4*>(dst)[v];
            const float4 y = reinterpret_cast<const float4*>(src)[v];
            x.x += y.x;
            x.y += y.y;
            x.z += y.z;
            x.w += y.w;
            reinterpret_cast<float4*>(dst)[v] = x;
        } else {
            dst[v] += src[v];
        }
    }
}

void cuda_add_f32(CudaCtx* cx, float* dst, const float* src, size_t n) {
    if (n == 0) return;
    size_t head = 0;
    if (is_aligned16(dst) && is_aligned16(src)) {
        head = n / 4 * 4;
        if (head > 0)
            add_f32_kernel<4><<<stride_grid(cx, head / 4, 256), 256, 0, cx->stream>>>(dst, src,
                                                                                     head / 4);
    }
    if (n > head)
        add_f32_kernel<1><<<stride_grid(cx, n - head, 256), 256, 0, cx->stream>>>(
            dst + head, src + head, n - head);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// LoRA's dropout (ops.h).

// lora_dropout_hash of ops.h, for the device (the same integer math: the same mask as the CPU).
__device__ __forceinline__ uint32_t dropout_hash(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32);
}

// out may alias inp (each element read, then written, by one thread).
__global__ void dropout_kernel(bf16* out, const bf16* inp, float inv_keep, uint32_t threshold,
                               uint64_t seed, uint64_t first, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const int keep = dropout_hash(seed, first + i) >= threshold;
        out[i] = __float2bfloat16_rn(keep ? __bfloat162float(inp[i]) * inv_keep : 0.0f);
    }
}

void cuda_dropout(CudaCtx* cx, bf16* out, const bf16* inp, float p, uint64_t seed, int64_t row0,
                  int N, int C) {
    const size_t n = (size_t)N * (size_t)C;
    if (n == 0) return;
    dropout_kernel<<<stride_grid(cx, n, 256), 256, 0, cx->stream>>>(
        out, inp, 1.0f / (1.0f - p), lora_dropout_threshold(p), seed,
        (uint64_t)row0 * (uint64_t)C, n);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// ordered reduction of per-block partial sums

// Block = 32 columns x REDUCE_SLICES slices of parts: slice y sums parts y, y + SLICES, ... in
// order (independent loads in flight), then the slice sums are added in slice order. The order
// depends on n_parts only.
#define REDUCE_SLICES 8

__global__ void reduce_partials_kernel(float* __restrict__ dst, const float* __restrict__ partial,
                                       int n_parts, int C) {
    __shared__ float red[REDUCE_SLICES][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < C) {
#pragma unroll 4
        for (int p = threadIdx.y; p < n_parts; p += REDUCE_SLICES) s += partial[(size_t)p * C + c];
    }
    red[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t = 0.0f;
        for (int y = 0; y < REDUCE_SLICES; y++) t += red[y][threadIdx.x];
        dst[c] += t;
    }
}

void cuda_reduce_partials(CudaCtx* cx, float* dst, const float* partial, int n_parts, int C) {
    if (C <= 0) return;
    reduce_partials_kernel<<<grid_size((size_t)C, 32), dim3(32, REDUCE_SLICES), 0, cx->stream>>>(
        dst, partial, n_parts, C);
    cuda_check_launch();
}
