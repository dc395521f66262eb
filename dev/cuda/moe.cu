/*
 * dev/cuda/moe.cu — lab of the mixture-of-experts ops of kernels/moe.cu (the grouped matmul has
 * its own lab): routing forward and backward (three modes, the aux term), the stable dispatch,
 * the gather and its backward, the combine and its backward, the router statistics, and the
 * GPT-OSS clamped GLU.
 *
 *   make dev-cuda && dev/cuda/build/moe [--validate-only] [--variant K] [--seed S]
 *
 * Variants:
 *   1  naive: one thread per row for the routing (the CPU loop, p in local memory), one thread
 *      for the whole dispatch (the CPU's counting sort), one thread per element for the gathers,
 *      combines and the GLU, one per (row, k) for the combine backward, a softmax per row into a
 *      buffer then one thread per column for the statistics.
 *   2  production (kernels/moe.cu, included below): a warp per row with the logits in registers
 *      and a warp argmax per chosen expert; the dispatch as block histograms, one ordered scan
 *      and a stable scatter (__match_any_sync ranks); warp-per-row gathers and combines with
 *      16-byte accesses; a warp per (row, k) for the combine backward; the statistics as
 *      per-block double partials reduced in block order; grid-stride 16-byte GLU.
 * Reference: the CPU backend (ops_cpu, llmc/ops_cpu_moe.c: the contract of ops.h), on the same
 * bf16 inputs; for the GLU forward a loop here that rounds where HF's bf16 computation does
 * (gate*alpha, the sigmoid, gate*σ, up+1), as the kernels do. Indices (idx, offsets, src, dst)
 * must be equal; the gather, gather backward, combine forward and the combine backward's dy
 * equal the CPU's fp32 results rounded to bf16 (the same sums in the same order); the rest
 * TOL_BF16 (bf16 outputs) or TOL_F32 / TOL_EXP (fp32 outputs, another summation order, CUDA's
 * expf). Logits: half the rows drawn from 17 values, so exact ties (to the lower index) are
 * common, some among the largest.
 * Benchmark: one micro-batch of the paper's batch (n = 26,624 rows) on Qwen3-30B-A3B (C 2048,
 * E 128, K 8, F 768, softmax-topk) and GPT-OSS-20B (C 2880, E 32, K 4, F 2880, topk-softmax):
 * GB/s of the bytes each op must move (each input read once, each output written once) against
 * the HBM roofline.
 */
#include "../../kernels/moe.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference: the CPU backend, plus the GLU forward with HF's bf16 roundings

static void* cpu_ctx(void) {
    static void* ctx = NULL;  // the lab is single-threaded: one CPU backend context for all
    if (!ctx) ctx = ops_cpu_create(0);
    return ctx;
}

static void glu_forward_cpu(float* out, const float* gu, int R, int F, float limit, float alpha) {
    for (size_t r = 0; r < (size_t)R; r++)
        for (int i = 0; i < F; i++) {
            const float g = fminf(gu[r * 2 * F + 2 * i], limit);
            const float u = fmaxf(fminf(gu[r * 2 * F + 2 * i + 1], limit), -limit);
            const float s = bf16r(1.0f / (1.0f + expf(-bf16r(g * alpha))));
            out[r * F + i] = bf16r(u + 1.0f) * bf16r(g * s);
        }
}

// ----------------------------------------------------------------------------
// variant 1: naive

__global__ void route_forward_kernel1(int32_t* idx, float* weights, const bf16* logits, int n,
                                      int E, int K, int mode) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v[MOE_MAX_EXPERTS];
    const bf16* z = logits + (size_t)i * E;
    float m = -INFINITY;
    for (int e = 0; e < E; e++) {
        v[e] = __bfloat162float(z[e]);
        m = fmaxf(m, v[e]);
    }
    if (mode != MOE_ROUTE_TOPK_SOFTMAX) {
        double s = 0.0;
        for (int e = 0; e < E; e++) {
            v[e] = expf(v[e] - m);
            s += v[e];
        }
        const float inv = (float)(1.0 / s);
        for (int e = 0; e < E; e++) v[e] *= inv;
    }
    int32_t* id = idx + (size_t)i * K;
    float* w = weights + (size_t)i * K;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= id[j] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        id[k] = best;
    }
    double s = 0.0;
    for (int k = 0; k < K; k++) {
        w[k] = mode == MOE_ROUTE_TOPK_SOFTMAX ? expf(v[id[k]] - v[id[0]]) : v[id[k]];
        s += w[k];
    }
    if (mode != MOE_ROUTE_SOFTMAX_TOPK)
        for (int k = 0; k < K; k++) w[k] = (float)(w[k] / s);
}

__global__ void route_backward_kernel1(bf16* dlogits, const float* dweights, const bf16* logits,
                                       const int32_t* idx, const float* weights,
                                       const float* counts, float aux_scale, int n, int E, int K,
                                       int mode) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float p[MOE_MAX_EXPERTS], dl[MOE_MAX_EXPERTS];
    const bf16* z = logits + (size_t)i * E;
    const int32_t* id = idx + (size_t)i * K;
    const float* w = weights + (size_t)i * K;
    const float* dw = dweights + (size_t)i * K;
    double wdw = 0.0;
    for (int k = 0; k < K; k++) wdw += (double)w[k] * dw[k];
    float m = -INFINITY;
    for (int e = 0; e < E; e++) m = fmaxf(m, __bfloat162float(z[e]));
    double s = 0.0;
    for (int e = 0; e < E; e++) {
        p[e] = expf(__bfloat162float(z[e]) - m);
        s += p[e];
    }
    const float inv = (float)(1.0 / s);
    for (int e = 0; e < E; e++) p[e] *= inv;
    if (mode == MOE_ROUTE_SOFTMAX_TOPK) {
        for (int e = 0; e < E; e++) dl[e] = (float)(-(double)p[e] * wdw);
        for (int k = 0; k < K; k++) dl[id[k]] = __fadd_rn(dl[id[k]], __fmul_rn(p[id[k]], dw[k]));
    } else {
        for (int e = 0; e < E; e++) dl[e] = 0.0f;
        for (int k = 0; k < K; k++) dl[id[k]] = (float)(w[k] * (dw[k] - wdw));
    }
    if (aux_scale != 0.0f) {
        double cp = 0.0;
        for (int e = 0; e < E; e++) cp += (double)counts[e] * p[e];
        for (int e = 0; e < E; e++)
            dl[e] = __fadd_rn(dl[e], (float)(__fmul_rn(aux_scale, p[e]) * (counts[e] - cp)));
    }
    for (int e = 0; e < E; e++) dlogits[(size_t)i * E + e] = __float2bfloat16_rn(dl[e]);
}

// The CPU's counting sort on one thread.
__global__ void dispatch_kernel1(int32_t* offsets, int32_t* src, int32_t* dst, const int32_t* idx,
                                 int R, int E) {
    int cursor[MOE_MAX_EXPERTS];
    for (int e = 0; e <= E; e++) offsets[e] = 0;
    for (int r = 0; r < R; r++) offsets[idx[r] + 1]++;
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    for (int e = 0; e < E; e++) cursor[e] = offsets[e];
    for (int r = 0; r < R; r++) {
        const int pos = cursor[idx[r]]++;
        src[pos] = r;
        dst[r] = pos;
    }
}

__global__ void gather_kernel1(bf16* out, const bf16* inp, const int32_t* src, int K, int C,
                               size_t total) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < total) out[i] = inp[(size_t)(src[i / C] / K) * C + i % C];
}

__global__ void sum_rows_kernel1(bf16* out, const bf16* y, const float* weights,
                                 const int32_t* dst, int K, int C, size_t total) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t row = i / C, c = i % C;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) {
        const float v = __bfloat162float(y[(size_t)dst[row * K + k] * C + c]);
        acc = weights ? __fadd_rn(acc, __fmul_rn(weights[row * K + k], v)) : acc + v;
    }
    out[i] = __float2bfloat16_rn(acc);
}

__global__ void combine_backward_kernel1(bf16* dy, float* dweights, const bf16* dout,
                                         const bf16* y, const float* weights, const int32_t* dst,
                                         int K, int C, size_t pairs) {
    const size_t p = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (p >= pairs) return;
    const bf16* g = dout + (p / K) * C;
    const size_t r = (size_t)dst[p];
    float dot = 0.0f;
    for (int c = 0; c < C; c++) {
        const float gv = __bfloat162float(g[c]);
        dy[r * C + c] = __float2bfloat16_rn(__fmul_rn(weights[p], gv));
        dot += gv * __bfloat162float(y[r * C + c]);
    }
    dweights[p] = dot;
}

__global__ void stats_softmax_kernel1(float* probs, const bf16* logits, int n, int E) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const bf16* z = logits + (size_t)i * E;
    float* p = probs + (size_t)i * E;
    float m = -INFINITY;
    for (int e = 0; e < E; e++) m = fmaxf(m, __bfloat162float(z[e]));
    double s = 0.0;
    for (int e = 0; e < E; e++) {
        p[e] = expf(__bfloat162float(z[e]) - m);
        s += p[e];
    }
    const float inv = (float)(1.0 / s);
    for (int e = 0; e < E; e++) p[e] *= inv;
}

__global__ void stats_sum_kernel1(float* stats, const float* probs, const int32_t* offsets, int n,
                                  int E) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    double s = 0.0;
    for (int i = 0; i < n; i++) s += probs[(size_t)i * E + e];
    stats[E + e] = (float)s;
    stats[e] = (float)(offsets[e + 1] - offsets[e]);
}

__global__ void glu_forward_kernel1(bf16* out, const bf16* gu, int F, float limit, float alpha,
                                    size_t total) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t r = i / F, f = i % F;
    const float g = fminf(__bfloat162float(gu[r * 2 * F + 2 * f]), limit);
    const float u = fminf(fmaxf(__bfloat162float(gu[r * 2 * F + 2 * f + 1]), -limit), limit);
    const float s = bf16_round(1.0f / (1.0f + expf(-bf16_round(g * alpha))));
    out[i] = __float2bfloat16_rn(bf16_round(u + 1.0f) * bf16_round(g * s));
}

__global__ void glu_backward_kernel1(bf16* dgu, const bf16* dout, const bf16* gu, int F,
                                     float limit, float alpha, size_t total) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t r = i / F, f = i % F;
    const float gate = __bfloat162float(gu[r * 2 * F + 2 * f]);
    const float up = __bfloat162float(gu[r * 2 * F + 2 * f + 1]);
    const float dy = __bfloat162float(dout[i]);
    const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
    const float sg = 1.0f / (1.0f + expf(-alpha * g)), glu = g * sg;
    const float dglu = sg + alpha * g * sg * (1.0f - sg);
    dgu[r * 2 * F + 2 * f] = __float2bfloat16_rn(gate <= limit ? dy * (u + 1.0f) * dglu : 0.0f);
    dgu[r * 2 * F + 2 * f + 1] =
        __float2bfloat16_rn(up >= -limit && up <= limit ? dy * glu : 0.0f);
}

// ----------------------------------------------------------------------------
// variant dispatch

static void route_forward(int v, CudaCtx* cx, int32_t* idx, float* w, const bf16* z, int n, int E,
                          int K, int mode) {
    if (v == 2) return cuda_moe_route_forward(cx, idx, w, z, n, E, K, mode);
    route_forward_kernel1<<<grid_size(n, 128), 128, 0, cx->stream>>>(idx, w, z, n, E, K, mode);
    cuda_check_launch();
}

static void route_backward(int v, CudaCtx* cx, bf16* dl, const float* dw, const bf16* z,
                           const int32_t* idx, const float* w, const float* counts, float aux,
                           int n, int E, int K, int mode) {
    if (v == 2) return cuda_moe_route_backward(cx, dl, dw, z, idx, w, counts, aux, n, E, K, mode);
    route_backward_kernel1<<<grid_size(n, 128), 128, 0, cx->stream>>>(dl, dw, z, idx, w, counts,
                                                                      aux, n, E, K, mode);
    cuda_check_launch();
}

static void dispatch(int v, CudaCtx* cx, int32_t* off, int32_t* src, int32_t* dst,
                     const int32_t* idx, int n, int E, int K) {
    if (v == 2) return cuda_moe_dispatch(cx, off, src, dst, idx, n, E, K);
    dispatch_kernel1<<<1, 1, 0, cx->stream>>>(off, src, dst, idx, n * K, E);
    cuda_check_launch();
}

static void gather(int v, CudaCtx* cx, bf16* out, const bf16* inp, const int32_t* src, int n,
                   int K, int C) {
    if (v == 2) return cuda_moe_gather(cx, out, inp, src, n, K, C);
    const size_t total = (size_t)n * K * C;
    gather_kernel1<<<grid_size(total, 256), 256, 0, cx->stream>>>(out, inp, src, K, C, total);
    cuda_check_launch();
}

// weights NULL: the gather backward; else the combine forward.
static void sum_rows(int v, CudaCtx* cx, bf16* out, const bf16* y, const float* weights,
                     const int32_t* dst, int n, int K, int C) {
    if (v == 2)
        return weights ? cuda_moe_combine_forward(cx, out, y, weights, dst, n, K, C)
                       : cuda_moe_gather_backward(cx, out, y, dst, n, K, C);
    const size_t total = (size_t)n * C;
    sum_rows_kernel1<<<grid_size(total, 256), 256, 0, cx->stream>>>(out, y, weights, dst, K, C,
                                                                    total);
    cuda_check_launch();
}

static void combine_backward(int v, CudaCtx* cx, bf16* dy, float* dwt, const bf16* dout,
                             const bf16* y, const float* w, const int32_t* dst, int n, int K,
                             int C) {
    if (v == 2) return cuda_moe_combine_backward(cx, dy, dwt, dout, y, w, dst, n, K, C);
    const size_t pairs = (size_t)n * K;
    combine_backward_kernel1<<<grid_size(pairs, 128), 128, 0, cx->stream>>>(dy, dwt, dout, y, w,
                                                                            dst, K, C, pairs);
    cuda_check_launch();
}

static void router_stats(int v, CudaCtx* cx, float* stats, const bf16* z, const int32_t* off,
                         int n, int E) {
    if (v == 2) return cuda_moe_router_stats(cx, stats, z, off, n, E);
    float* probs = (float*)cuda_scratch(cx, SCRATCH_ATTN, (size_t)(n > 0 ? n : 1) * E * 4);
    stats_softmax_kernel1<<<grid_size(n, 128), 128, 0, cx->stream>>>(probs, z, n, E);
    cuda_check_launch();
    stats_sum_kernel1<<<grid_size(E, 128), 128, 0, cx->stream>>>(stats, probs, off, n, E);
    cuda_check_launch();
}

static void glu_forward(int v, CudaCtx* cx, bf16* out, const bf16* gu, int R, int F, float limit,
                        float alpha) {
    if (v == 2) return cuda_gptoss_glu_forward(cx, out, gu, R, F, limit, alpha);
    const size_t total = (size_t)R * F;
    glu_forward_kernel1<<<grid_size(total, 256), 256, 0, cx->stream>>>(out, gu, F, limit, alpha,
                                                                       total);
    cuda_check_launch();
}

static void glu_backward(int v, CudaCtx* cx, bf16* dgu, const bf16* dout, const bf16* gu, int R,
                         int F, float limit, float alpha) {
    if (v == 2) return cuda_gptoss_glu_backward(cx, dgu, dout, gu, R, F, limit, alpha);
    const size_t total = (size_t)R * F;
    glu_backward_kernel1<<<grid_size(total, 256), 256, 0, cx->stream>>>(dgu, dout, gu, F, limit,
                                                                        alpha, total);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------
// validation

// Logits (n, E): odd rows ~ U(-scale, scale) in bf16, even rows from 17 values in [-1, 1].
static std::vector<float> rand_logits(Rng* r, int n, int E, float scale) {
    std::vector<float> z = rand_bf16(r, (size_t)n * E, scale);
    for (int i = 0; i < n; i += 2)
        for (int e = 0; e < E; e++)
            z[(size_t)i * E + e] = (float)((int)rng_below(r, 17) - 8) / 8.0f;
    return z;
}

static int ints_equal(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    return a.size() == b.size() && (a.empty() || !memcmp(a.data(), b.data(), a.size() * 4));
}

// bf16 results that must equal the CPU's fp32 results rounded to bf16.
static void check_rounded(Lab* lab, const char* what, const std::vector<float>& got,
                          std::vector<float> ref) {
    for (auto& x : ref) x = bf16r(x);
    lab_check(lab, what, got.data(), ref.data(), ref.size(), TOL_EXACT);
}

static void validate_route(Lab* lab, int v, Rng* r, int n, int E, int K, int mode) {
    const size_t nE = (size_t)n * E, nK = (size_t)n * K;
    std::vector<float> z = rand_logits(r, n, E, 3.0f), w_ref(nK), dl_ref(nE);
    std::vector<int32_t> idx_ref(nK);
    ops_cpu.moe_route_forward(cpu_ctx(), idx_ref.data(), w_ref.data(), z.data(), n, E, K, mode);
    bf16* d_z = dev_upload_bf16(z);
    int32_t* d_idx = dev_alloc<int32_t>(nK);
    float* d_w = dev_alloc<float>(nK);
    dev_poison(d_idx, nK * 4);
    dev_poison(d_w, nK * 4);
    route_forward(v, lab->cx, d_idx, d_w, d_z, n, E, K, mode);
    char what[128];
    snprintf(what, sizeof what, "route fwd v%d n=%d E=%d K=%d mode %d: idx", v, n, E, K, mode);
    lab_check_true(lab, what, ints_equal(dev_download(d_idx, nK), idx_ref));
    snprintf(what, sizeof what, "route fwd v%d n=%d E=%d K=%d mode %d: weights", v, n, E, K, mode);
    lab_check(lab, what, dev_download(d_w, nK).data(), w_ref.data(), nK, TOL_EXP);

    // backward from the reference routing, with the aux term
    std::vector<float> dw = rand_f32(r, nK, 1.0f), counts(E);
    for (auto& c : counts) c = (float)rng_below(r, (uint64_t)(2 * n + 1));
    const float aux = 0.5f / (float)n;
    ops_cpu.moe_route_backward(cpu_ctx(), dl_ref.data(), dw.data(), z.data(), idx_ref.data(),
                               w_ref.data(), counts.data(), aux, n, E, K, mode);
    int32_t* d_idx_ref = dev_upload(idx_ref);
    float *d_w_ref = dev_upload(w_ref), *d_dw = dev_upload(dw), *d_counts = dev_upload(counts);
    bf16* d_dl = dev_alloc<bf16>(nE);
    dev_poison(d_dl, nE * 2);
    route_backward(v, lab->cx, d_dl, d_dw, d_z, d_idx_ref, d_w_ref, d_counts, aux, n, E, K, mode);
    snprintf(what, sizeof what, "route bwd v%d n=%d E=%d K=%d mode %d: dlogits", v, n, E, K, mode);
    lab_check(lab, what, dev_download_bf16(d_dl, nE).data(), dl_ref.data(), nE, TOL_BF16);
    void* bufs[] = {d_z, d_idx, d_w, d_idx_ref, d_w_ref, d_dw, d_counts, d_dl};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// The dispatch of a routing of random logits, then the statistics, gathers and combines on it.
static void validate_rows(Lab* lab, int v, Rng* r, int n, int E, int K, int C) {
    const size_t nK = (size_t)n * K, nC = (size_t)n * C, RC = nK * C;
    std::vector<float> z = rand_logits(r, n, E, 2.0f), w(nK);
    std::vector<int32_t> idx(nK), off(E + 1), src(nK), dst(nK);
    ops_cpu.moe_route_forward(cpu_ctx(), idx.data(), w.data(), z.data(), n, E, K,
                              MOE_ROUTE_SOFTMAX_TOPK_NORM);
    ops_cpu.moe_dispatch(cpu_ctx(), off.data(), src.data(), dst.data(), idx.data(), n, E, K);
    int32_t* d_idx = dev_upload(idx);
    int32_t *d_off = dev_alloc<int32_t>(E + 1), *d_src = dev_alloc<int32_t>(nK),
            *d_dst = dev_alloc<int32_t>(nK);
    dev_poison(d_off, (E + 1) * 4);
    dev_poison(d_src, nK * 4);
    dev_poison(d_dst, nK * 4);
    dispatch(v, lab->cx, d_off, d_src, d_dst, d_idx, n, E, K);
    char what[128];
    snprintf(what, sizeof what, "dispatch v%d n=%d E=%d K=%d: offsets, src, dst", v, n, E, K);
    lab_check_true(lab, what, ints_equal(dev_download(d_off, E + 1), off) &&
                                  ints_equal(dev_download(d_src, nK), src) &&
                                  ints_equal(dev_download(d_dst, nK), dst));

    std::vector<float> st_ref(2 * E);
    ops_cpu.moe_router_stats(cpu_ctx(), st_ref.data(), z.data(), off.data(), n, E);
    bf16* d_z = dev_upload_bf16(z);
    float* d_st = dev_alloc<float>(2 * E);
    dev_poison(d_st, 2 * E * 4);
    router_stats(v, lab->cx, d_st, d_z, d_off, n, E);
    snprintf(what, sizeof what, "router stats v%d n=%d E=%d: counts, Σ p", v, n, E);
    lab_check(lab, what, dev_download(d_st, 2 * E).data(), st_ref.data(), 2 * E, TOL_F32);

    std::vector<float> x = rand_bf16(r, nC, 1.0f), y = rand_bf16(r, RC, 1.0f);
    std::vector<float> g = rand_bf16(r, nC, 1.0f), xp(RC), dx(nC), out(nC), dy(RC), dwt(nK);
    ops_cpu.moe_gather(cpu_ctx(), xp.data(), x.data(), src.data(), n, K, C);
    ops_cpu.moe_gather_backward(cpu_ctx(), dx.data(), y.data(), dst.data(), n, K, C);
    ops_cpu.moe_combine_forward(cpu_ctx(), out.data(), y.data(), w.data(), dst.data(), n, K, C);
    ops_cpu.moe_combine_backward(cpu_ctx(), dy.data(), dwt.data(), g.data(), y.data(), w.data(),
                                 dst.data(), n, K, C);
    bf16 *d_x = dev_upload_bf16(x), *d_y = dev_upload_bf16(y), *d_g = dev_upload_bf16(g);
    float* d_w = dev_upload(w);
    bf16 *d_xp = dev_alloc<bf16>(RC), *d_dx = dev_alloc<bf16>(nC), *d_out = dev_alloc<bf16>(nC),
         *d_dy = dev_alloc<bf16>(RC);
    float* d_dwt = dev_alloc<float>(nK);
    dev_poison(d_xp, RC * 2);
    dev_poison(d_dx, nC * 2);
    dev_poison(d_out, nC * 2);
    dev_poison(d_dy, RC * 2);
    dev_poison(d_dwt, nK * 4);
    int32_t *d_src_ref = dev_upload(src), *d_dst_ref = dev_upload(dst);
    gather(v, lab->cx, d_xp, d_x, d_src_ref, n, K, C);
    sum_rows(v, lab->cx, d_dx, d_y, NULL, d_dst_ref, n, K, C);
    sum_rows(v, lab->cx, d_out, d_y, d_w, d_dst_ref, n, K, C);
    combine_backward(v, lab->cx, d_dy, d_dwt, d_g, d_y, d_w, d_dst_ref, n, K, C);
    snprintf(what, sizeof what, "gather v%d n=%d K=%d C=%d: out", v, n, K, C);
    check_rounded(lab, what, dev_download_bf16(d_xp, RC), xp);
    snprintf(what, sizeof what, "gather bwd v%d n=%d K=%d C=%d: dinp", v, n, K, C);
    check_rounded(lab, what, dev_download_bf16(d_dx, nC), dx);
    snprintf(what, sizeof what, "combine fwd v%d n=%d K=%d C=%d: out", v, n, K, C);
    check_rounded(lab, what, dev_download_bf16(d_out, nC), out);
    snprintf(what, sizeof what, "combine bwd v%d n=%d K=%d C=%d: dy", v, n, K, C);
    check_rounded(lab, what, dev_download_bf16(d_dy, RC), dy);
    snprintf(what, sizeof what, "combine bwd v%d n=%d K=%d C=%d: dweights", v, n, K, C);
    lab_check(lab, what, dev_download(d_dwt, nK).data(), dwt.data(), nK, TOL_F32);
    void* bufs[] = {d_idx, d_off, d_src, d_dst, d_z, d_st, d_x, d_y, d_g, d_w, d_xp,
                    d_dx, d_out, d_dy, d_dwt, d_src_ref, d_dst_ref};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

static void validate_glu(Lab* lab, int v, Rng* r, int R, int F) {
    const float limit = 7.0f, alpha = 1.702f;
    const size_t RF = (size_t)R * F;
    std::vector<float> gu = rand_bf16(r, 2 * RF, 10.0f), dout = rand_bf16(r, RF, 1.0f);
    for (size_t i = 0; i < 2 * RF; i += 11) gu[i] = i % 2 ? -limit : limit;  // on the bounds
    std::vector<float> out(RF), dgu(2 * RF);
    glu_forward_cpu(out.data(), gu.data(), R, F, limit, alpha);
    ops_cpu.gptoss_glu_backward(cpu_ctx(), dgu.data(), dout.data(), gu.data(), R, F, limit, alpha);
    bf16 *d_gu = dev_upload_bf16(gu), *d_dout = dev_upload_bf16(dout);
    bf16 *d_out = dev_alloc<bf16>(RF), *d_dgu = dev_alloc<bf16>(2 * RF);
    dev_poison(d_out, RF * 2);
    dev_poison(d_dgu, RF * 4);
    glu_forward(v, lab->cx, d_out, d_gu, R, F, limit, alpha);
    glu_backward(v, lab->cx, d_dgu, d_dout, d_gu, R, F, limit, alpha);
    char what[128];
    snprintf(what, sizeof what, "gpt-oss glu fwd v%d R=%d F=%d: out", v, R, F);
    lab_check(lab, what, dev_download_bf16(d_out, RF).data(), out.data(), RF, TOL_BF16);
    snprintf(what, sizeof what, "gpt-oss glu bwd v%d R=%d F=%d: dgu", v, R, F);
    lab_check(lab, what, dev_download_bf16(d_dgu, 2 * RF).data(), dgu.data(), 2 * RF, TOL_BF16);
    void* bufs[] = {d_gu, d_dout, d_out, d_dgu};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

typedef struct Shape {
    const char* name;
    int n, C, E, K, F, mode, glu;
} Shape;

static void bench_shape(Lab* lab, const Shape* s) {
    CudaCtx* cx = lab->cx;
    const int n = s->n, C = s->C, E = s->E, K = s->K, F = s->F;
    const size_t nE = (size_t)n * E, nK = (size_t)n * K, nC = (size_t)n * C, RC = nK * C;
    const size_t RF = nK * F;
    // a real routing of random logits, by the production kernels
    bf16* z = dev_random<bf16>(nE, 2.0f, 11);
    int32_t *idx = dev_alloc<int32_t>(nK), *off = dev_alloc<int32_t>(E + 1),
            *src = dev_alloc<int32_t>(nK), *dst = dev_alloc<int32_t>(nK);
    float *w = dev_alloc<float>(nK), *dw = dev_random<float>(nK, 1.0f, 12);
    float *counts = dev_random<float>(E, 1000.0f, 13), *st = dev_alloc<float>(2 * E);
    cuda_moe_route_forward(cx, idx, w, z, n, E, K, s->mode);
    cuda_moe_dispatch(cx, off, src, dst, idx, n, E, K);
    bf16 *dl = dev_alloc<bf16>(nE), *x = dev_random<bf16>(nC, 1.0f, 14);
    bf16 *xp = dev_alloc<bf16>(RC), *y = dev_random<bf16>(RC, 1.0f, 15), *out = dev_alloc<bf16>(nC);
    float* dwt = dev_alloc<float>(nK);
    dev_sync();
    char shape[96];
    for (int v = 1; v <= 2; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        snprintf(shape, sizeof shape, "%s n=%d E=%d K=%d", s->name, n, E, K);
        double ms = lab_time_ms(lab, [&] { route_forward(v, cx, idx, w, z, n, E, K, s->mode); });
        lab_report_bw("route fwd", v, shape, "2nE in, 8nK out", 2.0 * nE + 8.0 * nK, ms);
        ms = lab_time_ms(lab, [&] {
            route_backward(v, cx, dl, dw, z, idx, w, counts, 1e-4f, n, E, K, s->mode);
        });
        lab_report_bw("route bwd (+aux)", v, shape, "2nE + 12nK in, 2nE out",
                      4.0 * nE + 12.0 * nK, ms);
        ms = lab_time_ms(lab, [&] { dispatch(v, cx, off, src, dst, idx, n, E, K); }, v == 1 ? 3 : 0);
        lab_report_bw("dispatch", v, shape, "4nK in, 8nK out", 12.0 * nK, ms);
        ms = lab_time_ms(lab, [&] { router_stats(v, cx, st, z, off, n, E); });
        lab_report_bw("router stats", v, shape, "2nE in", 2.0 * nE, ms);
        snprintf(shape, sizeof shape, "%s n=%d K=%d C=%d", s->name, n, K, C);
        ms = lab_time_ms(lab, [&] { gather(v, cx, xp, x, src, n, K, C); });
        lab_report_bw("gather", v, shape, "2nC in, 2nKC out", 2.0 * nC + 2.0 * RC, ms);
        ms = lab_time_ms(lab, [&] { sum_rows(v, cx, out, y, NULL, dst, n, K, C); });
        lab_report_bw("gather bwd", v, shape, "2nKC in, 2nC out", 2.0 * RC + 2.0 * nC, ms);
        ms = lab_time_ms(lab, [&] { sum_rows(v, cx, out, y, w, dst, n, K, C); });
        lab_report_bw("combine fwd", v, shape, "2nKC in, 2nC out", 2.0 * RC + 2.0 * nC, ms);
        ms = lab_time_ms(lab, [&] { combine_backward(v, cx, xp, dwt, x, y, w, dst, n, K, C); });
        lab_report_bw("combine bwd", v, shape, "2nC + 2nKC in, 2nKC out", 2.0 * nC + 4.0 * RC,
                      ms);
    }
    void* bufs[] = {z, idx, off, src, dst, w, dw, counts, st, dl, x, xp, y, out, dwt};
    for (void* p : bufs) cuda_check(cudaFree(p));
    if (!s->glu) return;
    bf16* gu = dev_random<bf16>(2 * RF, 8.0f, 16);
    bf16* go = dev_random<bf16>(RF, 1.0f, 17);
    bf16* buf = dev_alloc<bf16>(2 * RF);
    for (int v = 1; v <= 2; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        snprintf(shape, sizeof shape, "%s R=%zu F=%d", s->name, nK, F);
        double ms = lab_time_ms(lab, [&] { glu_forward(v, cx, buf, gu, (int)nK, F, 7.0f, 1.702f); });
        lab_report_bw("gpt-oss glu fwd", v, shape, "4RF in, 2RF out", 6.0 * RF, ms);
        ms = lab_time_ms(lab, [&] { glu_backward(v, cx, buf, go, gu, (int)nK, F, 7.0f, 1.702f); });
        lab_report_bw("gpt-oss glu bwd", v, shape, "6RF in, 4RF out", 10.0 * RF, ms);
    }
    void* bufs2[] = {gu, go, buf};
    for (void* p : bufs2) cuda_check(cudaFree(p));
}

static void bench(Lab* lab) {
    const Shape shapes[] = {
        {"qwen3-30b-a3b", 26624, 2048, 128, 8, 768, MOE_ROUTE_SOFTMAX_TOPK_NORM, 0},
        {"gpt-oss-20b", 26624, 2880, 32, 4, 2880, MOE_ROUTE_TOPK_SOFTMAX, 1},
    };
    printf("\nbenchmark\n");
    lab_bench_header_bw();
    lab_report_copy(lab, (size_t)26624 * 8 * 2048 * 2);
    for (const Shape& s : shapes) bench_shape(lab, &s);
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: a thread per row (routing), one thread (dispatch), a thread per element\n"
    "  2  production (kernels/moe.cu): warps per row, block-histogram dispatch, 16-byte rows\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    for (int mode = 0; mode <= 2; mode++) {
        validate_route(lab, v, r, 300, 128, 8, mode);
        validate_route(lab, v, r, 257, 32, 4, mode);
        validate_route(lab, v, r, 70, 60, 6, mode);
        validate_route(lab, v, r, 40, 256, 8, mode);
    }
    validate_rows(lab, v, r, 300, 128, 8, 2048);  // 16-byte paths, 3 sort blocks
    validate_rows(lab, v, r, 150, 32, 4, 2880);
    validate_rows(lab, v, r, 77, 16, 3, 100);     // scalar paths
    validate_rows(lab, v, r, 4000, 256, 8, 16);   // 32 sort blocks, E = 256
    validate_glu(lab, v, r, 100, 2880);
    validate_glu(lab, v, r, 33, 45);              // scalar path
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "moe", VARIANTS, 2, 2, validate_variant, bench_lab);
}
