/*
 * dev/cuda/memory_bound.cu — bandwidth lab for the memory-bound ops of the CUDA backend
 * (kernels/elementwise.cu, norm.cu, rope.cu, embedding.cu, loss.cu), on Qwen3-1.7B shapes.
 *
 *   make dev-cuda && ./build/dev/cuda/memory_bound [N]     (N tokens, default 16384)
 *
 * Each op runs through the ops_cuda table on random data; the time is the median of 20
 * event-timed runs after 3 warm-ups. GB/s counts the fewest bytes the op must move (each input
 * read once, each output written once; the table lists the count), so it compares directly with a
 * device-to-device copy (the first row; about 4.3 TB/s on an H200). Correctness of every op is the
 * job of the `gpu` test suite (llmc/tests/test_gpu.c), not of this lab.
 *
 * Measured (H200, N=16384, 2026-11-30; rows marked * after raising the backward block counts
 * from ~256 to 512 (rmsnorm) / 1024 (rope) blocks and the 32x8 partial-sum reduction):
 *   copy (d2d)             4125 GB/s      qknorm+rope fwd        1688 GB/s
 *   embedding fwd          3399 GB/s      qknorm+rope bwd *       856 GB/s  (was 444)
 *   embedding bwd          1086 GB/s      swiglu fwd             3686 GB/s
 *   rmsnorm fwd            2550 GB/s      swiglu bwd             3788 GB/s
 *   residual+rmsnorm fwd   3193 GB/s      add                    3763 GB/s
 *   rmsnorm bwd *          2190 GB/s      crossentropy n=220     2131 GB/s (n=1024: 2425)
 *                          (was 1650)
 * Next candidates: the rope kernels (one block per row with scalar bf16 stores forward, several
 * barriers per row backward) and the embedding backward (sort passes dominate at N=16384).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

extern "C" {
#include "../../llmc/common.h"
#include "../../llmc/rng.h"
}
#include "../../kernels/kernels.h"

#define CK(call)                                                                         \
    do {                                                                                 \
        cudaError_t e__ = (call);                                                        \
        if (e__ != cudaSuccess) fatal("%s:%d: %s: %s", __FILE__, __LINE__, #call,        \
                                      cudaGetErrorString(e__));                          \
    } while (0)

template <typename F>
static double time_ms(cudaStream_t s, F fn) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) fn();
    std::vector<double> t;
    for (int i = 0; i < 20; i++) {
        CK(cudaEventRecord(a, s));
        fn();
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[t.size() / 2];
}

// n random bf16 values: one random block of (1 << 20) + 3 values, tiled (host time is device
// time on the lent machine; the odd length keeps rows from repeating in step).
static void* rand_bf16(void* ctx, size_t n, float scale, uint32_t seed) {
    void* d = ops_cuda.alloc(ctx, n * 2);
    Rng r;
    rng_seed(&r, seed);
    const size_t block = ((size_t)1 << 20) + 3;
    std::vector<float> h(block);
    for (auto& v : h) v = scale * (rng_uniform(&r) * 2.0f - 1.0f);
    for (size_t off = 0; off < n; off += block)
        ops_cuda.upload_f32(ctx, (char*)d + off * 2, h.data(), std::min(block, n - off));
    return d;
}

static void report(const char* name, const char* bytes_note, double bytes, double ms) {
    printf("%-22s %-34s %9.3f ms %8.0f GB/s\n", name, bytes_note, ms, bytes / ms / 1e6);
    fflush(stdout);
}

int main(int argc, char** argv) {
    const int N = argc > 1 ? atoi(argv[1]) : 16384;
    if (cuda_device_count() == 0) {
        printf("no GPU: nothing to do\n");
        return 0;
    }
    const Ops* o = &ops_cuda;
    void* ctx = ops_cuda_create(0, NULL);
    cudaStream_t s = (cudaStream_t)ops_cuda_stream(ctx);
    const int C = 2048, F = 6144, V = 151936, H = 16, KVH = 8, HD = 128, T = 2048, B = N / T;
    const int QKV = (H + 2 * KVH) * HD, heads = H + KVH;
    const double NC = (double)N * C, NF = (double)N * F, NQ = (double)N * QKV;
    printf("device: %s; N=%d C=%d F=%d QKV=%d V=%d\n", cuda_device_name(0), N, C, F, QKV, V);
    printf("%-22s %-34s %12s %13s\n", "op", "bytes counted", "time", "bandwidth");

    void* a = rand_bf16(ctx, (size_t)N * F * 2, 1.0f, 1);  // big enough for every input role
    void* b = rand_bf16(ctx, (size_t)N * F * 2, 1.0f, 2);
    void* c = rand_bf16(ctx, (size_t)N * F * 2, 1.0f, 3);
    void* d = rand_bf16(ctx, (size_t)N * C, 1.0f, 8);
    void* w = rand_bf16(ctx, (size_t)QKV, 1.0f, 4);
    float* rstd = (float*)o->alloc(ctx, (size_t)N * heads * 4);
    float* dw = (float*)o->alloc(ctx, (size_t)V * C * 4);

    double ms = time_ms(s, [&] { o->copy(ctx, b, a, (size_t)NF * 2 * 2); });
    report("copy (d2d)", "read + write 2NF bf16", 2.0 * NF * 2 * 2, ms);

    // embedding: random ids over the vocabulary
    std::vector<int32_t> ids(N);
    Rng r;
    rng_seed(&r, 5);
    for (auto& v : ids) v = (int32_t)rng_below(&r, V);
    std::vector<int32_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    const double unique = (double)(std::unique(sorted.begin(), sorted.end()) - sorted.begin());
    int32_t* d_ids = (int32_t*)o->alloc(ctx, (size_t)N * 4);
    o->upload(ctx, d_ids, ids.data(), (size_t)N * 4);
    void* wte = rand_bf16(ctx, (size_t)V * C, 1.0f, 6);
    ms = time_ms(s, [&] { o->embedding_forward(ctx, c, d_ids, wte, N, C); });
    report("embedding fwd", "gather 2NC + write 2NC", 4 * NC, ms);
    ms = time_ms(s, [&] { o->embedding_backward(ctx, dw, a, d_ids, N, C, V); });
    report("embedding bwd", "read 2NC + rmw 8C per unique id", 2 * NC + 8.0 * C * unique, ms);
    o->free(ctx, wte);

    ms = time_ms(s, [&] { o->rmsnorm_forward(ctx, c, rstd, a, w, N, C, 1e-6f); });
    report("rmsnorm fwd", "read 2NC + write 2NC", 4 * NC, ms);
    ms = time_ms(s, [&] { o->residual_rmsnorm_forward(ctx, c, b, rstd, a, d, w, N, C, 1e-6f); });
    report("residual+rmsnorm fwd", "read 4NC + write 4NC", 8 * NC, ms);
    ms = time_ms(s, [&] { o->rmsnorm_backward(ctx, c, dw, b, a, w, rstd, N, C); });
    report("rmsnorm bwd", "read 6NC + write 2NC", 8 * NC, ms);

    float* cs = (float*)o->alloc(ctx, (size_t)T * HD / 2 * 4);
    float* sn = (float*)o->alloc(ctx, (size_t)T * HD / 2 * 4);
    {
        std::vector<float> h((size_t)T * HD / 2);
        for (size_t i = 0; i < h.size(); i++) h[i] = 0.5f + 0.001f * (float)(i % 97);
        o->upload(ctx, cs, h.data(), h.size() * 4);
        o->upload(ctx, sn, h.data(), h.size() * 4);
    }
    ms = time_ms(s, [&] {
        o->qknorm_rope_forward(ctx, c, rstd, a, w, w, cs, sn, B, T, H, KVH, HD, 1e-6f);
    });
    report("qknorm+rope fwd", "read 2NQ + write 2NQ", 4 * NQ, ms);
    ms = time_ms(s, [&] {
        o->qknorm_rope_backward(ctx, c, dw, dw + HD, b, a, w, w, rstd, cs, sn, B, T, H, KVH, HD);
    });
    report("qknorm+rope bwd", "read 4NQ + write 2NQ", 6 * NQ, ms);

    ms = time_ms(s, [&] { o->swiglu_forward(ctx, c, a, N, F); });
    report("swiglu fwd", "read 4NF + write 2NF", 6 * NF, ms);
    ms = time_ms(s, [&] { o->swiglu_backward(ctx, c, b, a, N, F); });
    report("swiglu bwd", "read 6NF + write 4NF", 10 * NF, ms);
    ms = time_ms(s, [&] { o->add(ctx, c, a, b, (size_t)NC); });
    report("add", "read 4NC + write 2NC", 6 * NC, ms);

    // cross-entropy over LM-head chunks: the model's 220-row chunk and a larger one
    const int chunks[2] = {220, 1024};
    void* logits = rand_bf16(ctx, (size_t)1024 * V, 4.0f, 7);
    int32_t* tg = d_ids;
    for (int k = 0; k < 2; k++) {
        const int n = chunks[k];
        const double nv = (double)n * V;
        char name[64];
        snprintf(name, sizeof name, "crossentropy n=%d", n);
        ms = time_ms(s, [&] {
            o->crossentropy_forward_backward(ctx, logits, (float*)rstd, tg, n, V, 1e-4f, 1);
        });
        report(name, "read 2nV + write 2nV", 4 * nv, ms);
    }
    o->synchronize(ctx);
    void* bufs[] = {a, b, c, d, w, rstd, dw, d_ids, cs, sn, logits};
    for (void* p : bufs) o->free(ctx, p);
    ops_cuda_destroy(ctx);
    return 0;
}
