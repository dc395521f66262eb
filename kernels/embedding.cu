/*
 * embedding.cu — deterministic token-embedding backward: dwte (V, C) += scatter of dout (N, C) by
 * ids, without float atomics.
 *
 * 1. A stable LSD radix sort (8-bit digits, as many passes as the largest key needs) of the token
 *    positions 0..N-1 by id, all on the GPU. Each pass: per-tile digit histograms (tiles of 256
 *    positions, integer counts), one exclusive scan over the digit-major (digit, tile) table, and a
 *    scatter where each position's rank among equal digits in its tile is counted over the tile
 *    (positions before it), so equal ids keep their position order. Invalid ids (outside [0, V))
 *    get the key V, sort last and are skipped (and flagged in the device error word).
 * 2. One warp per (segment start, 256-column chunk): the warp sums the dout rows of its id's
 *    segment in sorted order, i.e. in token order, eight independent row loads in flight, and adds
 *    the sum into the id's dwte row. Each dwte element has exactly one writer.
 * Every sum therefore has a fixed order: the result is bit-identical run to run.
 */
#include "common.cuh"

#define SORT_TILE 256  // positions per tile = threads per block of the sort kernels
#define RADIX 256      // 8-bit digits
#define SEG_UNROLL 8   // rows loaded at once by the segment sum

// ----------------------------------------------------------------------------
// radix sort of (key = id, value = position)

__global__ void sort_init_kernel(int* __restrict__ keys, int* __restrict__ vals,
                                 const int32_t* __restrict__ ids, int N, int V, int* err) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    int id = ids[i];
    if (id < 0 || id >= V) {
        atomicOr(err, CUDA_ERR_TOKEN_ID);
        id = V;
    }
    keys[i] = id;
    vals[i] = i;
}

// hist (RADIX, n_tiles): count of each digit in each tile (integer atomics in shared memory: the
// counts are exact whatever the order).
__global__ void radix_hist_kernel(const int* __restrict__ keys, int N, int shift,
                                  int* __restrict__ hist, int n_tiles) {
    __shared__ int cnt[RADIX];
    cnt[threadIdx.x] = 0;
    __syncthreads();
    int i = blockIdx.x * SORT_TILE + threadIdx.x;
    if (i < N) atomicAdd(&cnt[(keys[i] >> shift) & (RADIX - 1)], 1);
    __syncthreads();
    hist[(size_t)threadIdx.x * n_tiles + blockIdx.x] = cnt[threadIdx.x];
}

// In-place exclusive scan of M ints by one block of 1024 threads: each thread scans a contiguous
// range serially; the range totals are scanned in shared memory.
__global__ void exclusive_scan_kernel(int* data, int M) {
    __shared__ int part[1024];
    const int per = (M + 1023) / 1024, start = threadIdx.x * per, end = min(M, start + per);
    int s = 0;
    for (int i = start; i < end; i++) s += data[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int off = 1; off < 1024; off *= 2) {
        int v = threadIdx.x >= off ? part[threadIdx.x - off] : 0;
        __syncthreads();
        part[threadIdx.x] += v;
        __syncthreads();
    }
    int base = part[threadIdx.x] - s;
    for (int i = start; i < end; i++) {
        int t = data[i];
        data[i] = base;
        base += t;
    }
}

// Stable scatter of one tile: destination = start of (digit, tile) + rank of the element among
// the tile's earlier elements with the same digit.
__global__ void radix_scatter_kernel(const int* __restrict__ keys_in, const int* __restrict__ vals_in,
                                     int* __restrict__ keys_out, int* __restrict__ vals_out, int N,
                                     int shift, const int* __restrict__ offs, int n_tiles) {
    __shared__ int dig[SORT_TILE];
    int i = blockIdx.x * SORT_TILE + threadIdx.x;
    int d = i < N ? (keys_in[i] >> shift) & (RADIX - 1) : -1;
    dig[threadIdx.x] = d;
    __syncthreads();
    if (i >= N) return;
    int rank = 0;
    for (int j = 0; j < (int)threadIdx.x; j++) rank += dig[j] == d;
    int pos = offs[(size_t)d * n_tiles + blockIdx.x] + rank;
    keys_out[pos] = keys_in[i];
    vals_out[pos] = vals_in[i];
}

// ----------------------------------------------------------------------------
// segment sums

// blockIdx.x * warps + warp = sorted index i; blockIdx.y = chunk of 32*VEC columns.
template <int VEC>
__global__ void embedding_segment_sum_kernel(float* __restrict__ dwte, const bf16* __restrict__ dout,
                                             const int* __restrict__ keys,
                                             const int* __restrict__ vals, int N, int C, int V) {
    const int i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= N) return;
    const int key = keys[i];
    if (key >= V || (i > 0 && keys[i - 1] == key)) return;  // invalid, or not a segment start
    const int c = blockIdx.y * 32 * VEC + lane * VEC;
    if (c >= C) return;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) acc[k] = 0.0f;
    for (int j = i; j < N; j += SEG_UNROLL) {
        int r[SEG_UNROLL];
        float v[SEG_UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < SEG_UNROLL; u++)  // keys are sorted: the matches form a prefix
            r[u] = (j + u < N && keys[j + u] == key) ? vals[j + u] : -1;
#pragma unroll
        for (int u = 0; u < SEG_UNROLL; u++)
            if (r[u] >= 0) load_bf16<VEC>(dout + (size_t)r[u] * C + c, v[u]);
#pragma unroll
        for (int u = 0; u < SEG_UNROLL; u++)
            if (r[u] >= 0)
#pragma unroll
                for (int k = 0; k < VEC; k++) acc[k] += v[u][k];
        if (r[SEG_UNROLL - 1] < 0) break;
    }
    float* dst = dwte + (size_t)key * C + c;
#pragma unroll
    for (int k = 0; k < VEC; k++) dst[k] += acc[k];
}

void cuda_embedding_backward(CudaCtx* cx, float* dwte, const bf16* dout, const int32_t* ids, int N,
                             int C, int V) {
    if (N <= 0 || C <= 0) return;
    const int n_tiles = (N + SORT_TILE - 1) / SORT_TILE;
    int bits = 1;
    while (bits < 31 && (V >> bits) != 0) bits++;  // keys go up to V (the invalid-id key)
    const int passes = (bits + 7) / 8;
    const size_t hist_n = (size_t)RADIX * n_tiles;
    int* buf = (int*)cuda_scratch(cx, SCRATCH_SORT, (4 * (size_t)N + hist_n) * sizeof(int));
    int *keys = buf, *vals = buf + N, *keys2 = buf + 2 * (size_t)N, *vals2 = buf + 3 * (size_t)N;
    int* hist = buf + 4 * (size_t)N;

    sort_init_kernel<<<n_tiles, SORT_TILE, 0, cx->stream>>>(keys, vals, ids, N, V, cx->d_error);
    cuda_check_launch();
    for (int p = 0; p < passes; p++) {
        radix_hist_kernel<<<n_tiles, SORT_TILE, 0, cx->stream>>>(keys, N, 8 * p, hist, n_tiles);
        cuda_check_launch();
        exclusive_scan_kernel<<<1, 1024, 0, cx->stream>>>(hist, (int)hist_n);
        cuda_check_launch();
        radix_scatter_kernel<<<n_tiles, SORT_TILE, 0, cx->stream>>>(keys, vals, keys2, vals2, N,
                                                                     8 * p, hist, n_tiles);
        cuda_check_launch();
        int* t = keys;
        keys = keys2;
        keys2 = t;
        t = vals;
        vals = vals2;
        vals2 = t;
    }

    const int warps = 8;
    if (C % 8 == 0 && is_aligned16(dout)) {
        dim3 grid(grid_size((size_t)N, warps), grid_size((size_t)C, 32 * 8));
        embedding_segment_sum_kernel<8><<<grid, warps * 32, 0, cx->stream>>>(dwte, dout, keys,
                                                                              vals, N, C, V);
    } else {
        dim3 grid(grid_size((size_t)N, warps), grid_size((size_t)C, 32));
        embedding_segment_sum_kernel<1><<<grid, warps * 32, 0, cx->stream>>>(dwte, dout, keys,
                                                                              vals, N, C, V);
    }
    cuda_check_launch();
}
