/*
 * dev/cuda/rope.cu — QK-norm + RoPE lab (kernels/rope.cu): Qwen3's per-head RMSNorm of q and k
 * followed by the rotate_half rotary embedding, on packed qkv rows (N, (H + 2 KVH) HD), forward
 * and backward. Without norm weights (LLaMA) it is RoPE alone.
 *
 *   make dev-cuda && dev/cuda/build/rope [--validate-only] [--variant K] [--seed S]
 *
 * Variants (forward and backward):
 *   1  naive: one thread per (row, head) does the norm and the rotation of its head (v heads are
 *      copied); backward likewise for dinp, and one block per norm-weight element sums its
 *      gradient over all rows and heads.
 *   2  production (kernels/rope.cu, included below): one block per row with the row's q/k staged
 *      in shared memory, a warp per head for rstd; backward one block per group of rows with
 *      per-block partials of the norm-weight gradients reduced in block order.
 * Validation: (B, T, H, KVH, HD) = (3, 37, 4, 2, 128) with QK-norm, (2, 29, 6, 2, 64) without,
 * and (2, 23, 3, 1, 36) with QK-norm (HD not a multiple of 8: the scalar path); positions are
 * row % T. Forward: out (TOL_BF16), rstd (TOL_F32). Backward: dinp (overwritten, TOL_BF16), the
 * q/k norm-weight gradients (pre-filled: they accumulate; TOL_F32).
 * Benchmark: B = 8, T = 2048, H = 16, KVH = 8, HD = 128 (Qwen3-1.7B), QK-norm on.
 */
#include "../../kernels/rope.cu"
#include "lab.cuh"

// ----------------------------------------------------------------------------
// CPU reference (the roundings of the CUDA kernels: HF computes in bf16)

typedef struct RopeShape {
    int B, T, H, KVH, HD;
} RopeShape;

// cos/sin (T, HD/2) of position t and frequency theta^(-2i/HD), as the model builds them (fp32;
// the kernels round them to bf16 before use, as HF casts them to the activation dtype).
static void rope_tables(std::vector<float>& cs, std::vector<float>& sn, int T, int HD) {
    const int half = HD / 2;
    cs.resize((size_t)T * half);
    sn.resize((size_t)T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double f = t * pow(1e6, -2.0 * i / HD);
            cs[(size_t)t * half + i] = (float)cos(f);
            sn[(size_t)t * half + i] = (float)sin(f);
        }
}

// For each row and q/k head: x̂ = x · rstd, n = bf16(w · bf16(x̂)) when the head's norm weight is
// given (else n = x); out = n rotated by the position's angle (before its bf16 rounding); v heads
// copied. rstd (N, H + KVH).
static void qknorm_rope_forward_cpu(float* out, float* rstd, const float* inp, const float* qw,
                                    const float* kw, const float* cs, const float* sn, RopeShape s,
                                    float eps) {
    const int heads = s.H + s.KVH, QKV = (heads + s.KVH) * s.HD, half = s.HD / 2;
    std::vector<float> n_(s.HD);
    for (int row = 0; row < s.B * s.T; row++) {
        const int t = row % s.T;
        for (int hh = 0; hh < heads; hh++) {
            const float* x = inp + (size_t)row * QKV + (size_t)hh * s.HD;
            const float* w = hh < s.H ? qw : kw;
            float rs = 0.0f;
            if (w) {
                double ss = 0.0;
                for (int i = 0; i < s.HD; i++) ss += (double)x[i] * x[i];
                rs = 1.0f / sqrtf((float)(ss / s.HD) + eps);
                rstd[(size_t)row * heads + hh] = rs;
            }
            for (int i = 0; i < s.HD; i++) n_[i] = w ? bf16r(w[i] * bf16r(x[i] * rs)) : x[i];
            float* y = out + (size_t)row * QKV + (size_t)hh * s.HD;
            for (int i = 0; i < half; i++) {
                const float c = bf16r(cs[(size_t)t * half + i]),
                            si = bf16r(sn[(size_t)t * half + i]);
                y[i] = n_[i] * c - n_[i + half] * si;
                y[i + half] = n_[i + half] * c + n_[i] * si;
            }
        }
        for (int e = heads * s.HD; e < QKV; e++)
            out[(size_t)row * QKV + e] = inp[(size_t)row * QKV + e];
    }
}

// dy = dout rotated back (by -φ, with the same bf16 cos/sin); with a norm weight
// dinp = rstd (dy w - x̂ mean(dy w x̂)) and dw += dy x̂ (dq_w over the q heads, dk_w over the k
// heads), else dinp = dy; v heads copied. dinp before its bf16 rounding.
static void qknorm_rope_backward_cpu(float* dinp, float* dqw, float* dkw, const float* dout,
                                     const float* inp, const float* qw, const float* kw,
                                     const float* rstd, const float* cs, const float* sn,
                                     RopeShape s) {
    const int heads = s.H + s.KVH, QKV = (heads + s.KVH) * s.HD, half = s.HD / 2;
    std::vector<double> acc(2 * s.HD, 0.0);
    std::vector<float> dy(s.HD);
    for (int row = 0; row < s.B * s.T; row++) {
        const int t = row % s.T;
        for (int hh = 0; hh < heads; hh++) {
            const size_t off = (size_t)row * QKV + (size_t)hh * s.HD;
            const float* g = dout + off;
            for (int i = 0; i < half; i++) {
                const float c = bf16r(cs[(size_t)t * half + i]),
                            si = bf16r(sn[(size_t)t * half + i]);
                dy[i] = g[i] * c + g[i + half] * si;
                dy[i + half] = g[i + half] * c - g[i] * si;
            }
            const float* w = hh < s.H ? qw : kw;
            if (!w) {
                for (int i = 0; i < s.HD; i++) dinp[off + i] = dy[i];
                continue;
            }
            const float rs = rstd[(size_t)row * heads + hh];
            double dot = 0.0;
            for (int i = 0; i < s.HD; i++) dot += (double)(dy[i] * w[i]) * (inp[off + i] * rs);
            const float mean = (float)(dot / s.HD);
            for (int i = 0; i < s.HD; i++) {
                const float xh = inp[off + i] * rs;
                dinp[off + i] = rs * (dy[i] * w[i] - xh * mean);
                acc[(hh < s.H ? 0 : s.HD) + i] += (double)dy[i] * xh;
            }
        }
        for (int e = heads * s.HD; e < QKV; e++)
            dinp[(size_t)row * QKV + e] = dout[(size_t)row * QKV + e];
    }
    for (int i = 0; i < s.HD; i++) {
        if (qw) dqw[i] += (float)acc[i];
        if (kw) dkw[i] += (float)acc[s.HD + i];
    }
}

// ----------------------------------------------------------------------------
// variant 1: naive

// One thread per (row, head) over all H + 2 KVH heads of the row.
__global__ void qknorm_rope_forward_kernel1(bf16* out, float* rstd, const bf16* inp, const bf16* qw,
                                            const bf16* kw, const float* cosb, const float* sinb,
                                            int N, int T, int H, int KVH, int HD, float eps) {
    const int heads = H + KVH, all = heads + KVH, half = HD / 2;
    const size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * all) return;
    const int row = (int)(idx / all), hh = (int)(idx % all), t = row % T;
    const size_t off = (size_t)row * all * HD + (size_t)hh * HD;
    if (hh >= heads) {  // v
        for (int i = 0; i < HD; i++) out[off + i] = inp[off + i];
        return;
    }
    const bf16* w = hh < H ? qw : kw;
    float rs = 0.0f;
    if (w) {
        float ss = 0.0f;
        for (int i = 0; i < HD; i++)
            ss += __bfloat162float(inp[off + i]) * __bfloat162float(inp[off + i]);
        rs = 1.0f / sqrtf(ss / (float)HD + eps);
        if (rstd) rstd[(size_t)row * heads + hh] = rs;
    }
    for (int i = 0; i < half; i++) {
        float x1 = __bfloat162float(inp[off + i]), x2 = __bfloat162float(inp[off + i + half]);
        if (w) {
            x1 = bf16_round(__bfloat162float(w[i]) * bf16_round(x1 * rs));
            x2 = bf16_round(__bfloat162float(w[i + half]) * bf16_round(x2 * rs));
        }
        const float c = bf16_round(cosb[(size_t)t * half + i]);
        const float s = bf16_round(sinb[(size_t)t * half + i]);
        out[off + i] = __float2bfloat16_rn(x1 * c - x2 * s);
        out[off + i + half] = __float2bfloat16_rn(x2 * c + x1 * s);
    }
}

// Element i of the gradient before the rotation (rotation by -φ of dout's head g).
__device__ __forceinline__ float rope_unrotate1(const bf16* g, const float* cosb, const float* sinb,
                                                int t, int half, int i) {
    const int j = i < half ? i : i - half;
    const float c = bf16_round(cosb[(size_t)t * half + j]);
    const float s = bf16_round(sinb[(size_t)t * half + j]);
    const float g1 = __bfloat162float(g[j]), g2 = __bfloat162float(g[j + half]);
    return i < half ? g1 * c + g2 * s : g2 * c - g1 * s;
}

__global__ void qknorm_rope_backward_dinp_kernel1(bf16* dinp, const bf16* dout, const bf16* inp,
                                                  const bf16* qw, const bf16* kw, const float* rstd,
                                                  const float* cosb, const float* sinb, int N,
                                                  int T, int H, int KVH, int HD) {
    const int heads = H + KVH, all = heads + KVH, half = HD / 2;
    const size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * all) return;
    const int row = (int)(idx / all), hh = (int)(idx % all), t = row % T;
    const size_t off = (size_t)row * all * HD + (size_t)hh * HD;
    if (hh >= heads) {  // v
        for (int i = 0; i < HD; i++) dinp[off + i] = dout[off + i];
        return;
    }
    const bf16* w = hh < H ? qw : kw;
    const float rs = w ? rstd[(size_t)row * heads + hh] : 0.0f;
    float mean = 0.0f;
    if (w) {
        float dot = 0.0f;
        for (int i = 0; i < HD; i++)
            dot += (rope_unrotate1(dout + off, cosb, sinb, t, half, i) * __bfloat162float(w[i])) *
                   (__bfloat162float(inp[off + i]) * rs);
        mean = dot / (float)HD;
    }
    for (int i = 0; i < HD; i++) {
        const float dy = rope_unrotate1(dout + off, cosb, sinb, t, half, i);
        float d = dy;
        if (w) {
            const float xh = __bfloat162float(inp[off + i]) * rs;
            d = rs * (dy * __bfloat162float(w[i]) - xh * mean);
        }
        dinp[off + i] = __float2bfloat16_rn(d);
    }
}

// Block j < HD: dqw[j]; block HD + j: dkw[j]. Threads stride over the rows, the block sum (fixed
// order) adds them.
__global__ void qknorm_rope_backward_dw_kernel1(float* dqw, float* dkw, const bf16* dout,
                                                const bf16* inp, const float* rstd,
                                                const float* cosb, const float* sinb, int N, int T,
                                                int H, int KVH, int HD) {
    __shared__ float red[32];
    const int heads = H + KVH, all = heads + KVH, half = HD / 2;
    const int which = blockIdx.x / HD, i = blockIdx.x % HD;
    float* dw = which == 0 ? dqw : dkw;
    if (!dw) return;
    const int h0 = which == 0 ? 0 : H, h1 = which == 0 ? H : heads;
    float s = 0.0f;
    for (int row = threadIdx.x; row < N; row += blockDim.x)
        for (int hh = h0; hh < h1; hh++) {
            const size_t off = (size_t)row * all * HD + (size_t)hh * HD;
            const float dy = rope_unrotate1(dout + off, cosb, sinb, row % T, half, i);
            s += dy * (__bfloat162float(inp[off + i]) * rstd[(size_t)row * heads + hh]);
        }
    s = block_sum(s, red);
    if (threadIdx.x == 0) dw[i] += s;
}

// ----------------------------------------------------------------------------
// variant dispatch

static void qknorm_rope_forward(int variant, CudaCtx* cx, bf16* out, float* rstd, const bf16* inp,
                                const bf16* qw, const bf16* kw, const float* cs, const float* sn,
                                RopeShape s, float eps) {
    switch (variant) {
        case 1: {
            const size_t n = (size_t)s.B * s.T * (s.H + 2 * s.KVH);
            qknorm_rope_forward_kernel1<<<grid_size(n, 128), 128, 0, cx->stream>>>(
                out, rstd, inp, qw, kw, cs, sn, s.B * s.T, s.T, s.H, s.KVH, s.HD, eps);
            cuda_check_launch();
            break;
        }
        case 2:
            cuda_qknorm_rope_forward(cx, out, rstd, inp, qw, kw, cs, sn, s.B, s.T, s.H, s.KVH, s.HD,
                                     eps);
            break;
    }
}

static void qknorm_rope_backward(int variant, CudaCtx* cx, bf16* dinp, float* dqw, float* dkw,
                                 const bf16* dout, const bf16* inp, const bf16* qw, const bf16* kw,
                                 const float* rstd, const float* cs, const float* sn, RopeShape s) {
    switch (variant) {
        case 1: {
            const int N = s.B * s.T;
            const size_t n = (size_t)N * (s.H + 2 * s.KVH);
            qknorm_rope_backward_dinp_kernel1<<<grid_size(n, 128), 128, 0, cx->stream>>>(
                dinp, dout, inp, qw, kw, rstd, cs, sn, N, s.T, s.H, s.KVH, s.HD);
            cuda_check_launch();
            if ((qw && dqw) || (kw && dkw)) {
                qknorm_rope_backward_dw_kernel1<<<2 * s.HD, 256, 0, cx->stream>>>(
                    qw ? dqw : NULL, kw ? dkw : NULL, dout, inp, rstd, cs, sn, N, s.T, s.H, s.KVH,
                    s.HD);
                cuda_check_launch();
            }
            break;
        }
        case 2:
            cuda_qknorm_rope_backward(cx, dinp, dqw, dkw, dout, inp, qw, kw, rstd, cs, sn, s.B, s.T,
                                      s.H, s.KVH, s.HD);
            break;
    }
}

// ----------------------------------------------------------------------------
// validation

static const float EPS = 1e-6f;

static void validate(Lab* lab, int v, Rng* r, RopeShape s, int qk_norm) {
    const int N = s.B * s.T, heads = s.H + s.KVH, QKV = (heads + s.KVH) * s.HD;
    const size_t NQ = (size_t)N * QKV;
    std::vector<float> cs, sn;
    rope_tables(cs, sn, s.T, s.HD);
    std::vector<float> x = rand_bf16(r, NQ, 2.0f), dout = rand_bf16(r, NQ, 1.0f);
    std::vector<float> qw = rand_bf16(r, s.HD, 0.5f), kw = rand_bf16(r, s.HD, 0.5f);
    for (auto& w : qw) w = bf16r(1.0f + w);
    for (auto& w : kw) w = bf16r(1.0f + w);
    std::vector<float> dqw = rand_f32(r, s.HD, 1.0f), dkw = rand_f32(r, s.HD, 1.0f);
    std::vector<float> out(NQ), rstd((size_t)N * heads, 0.0f), dinp(NQ);
    const float* hq = qk_norm ? qw.data() : NULL;
    const float* hk = qk_norm ? kw.data() : NULL;
    qknorm_rope_forward_cpu(out.data(), rstd.data(), x.data(), hq, hk, cs.data(), sn.data(), s,
                            EPS);

    bf16 *d_x = dev_upload_bf16(x), *d_dout = dev_upload_bf16(dout);
    bf16 *d_qw = qk_norm ? dev_upload_bf16(qw) : NULL, *d_kw = qk_norm ? dev_upload_bf16(kw) : NULL;
    float *d_cs = dev_upload(cs), *d_sn = dev_upload(sn);
    bf16 *d_out = dev_alloc<bf16>(NQ), *d_dinp = dev_alloc<bf16>(NQ);
    float* d_rstd = dev_alloc<float>((size_t)N * heads);
    float *d_dqw = dev_upload(dqw), *d_dkw = dev_upload(dkw);
    dev_poison(d_out, NQ * 2);
    dev_poison(d_dinp, NQ * 2);
    dev_poison(d_rstd, (size_t)N * heads * 4);

    char what[128], tag[96];
    snprintf(tag, sizeof tag, "v%d B=%d T=%d H=%d KVH=%d HD=%d%s", v, s.B, s.T, s.H, s.KVH, s.HD,
             qk_norm ? " qk-norm" : "");
    qknorm_rope_forward(v, lab->cx, d_out, d_rstd, d_x, d_qw, d_kw, d_cs, d_sn, s, EPS);
    snprintf(what, sizeof what, "fwd %s: out", tag);
    lab_check(lab, what, dev_download_bf16(d_out, NQ).data(), out.data(), NQ, TOL_BF16);
    if (qk_norm) {
        snprintf(what, sizeof what, "fwd %s: rstd", tag);
        lab_check(lab, what, dev_download(d_rstd, (size_t)N * heads).data(), rstd.data(),
                  (size_t)N * heads, TOL_F32);
    }

    // The backward reads the reference's rstd, so it is checked on its own.
    float* d_rstd_ref = dev_upload(rstd);
    qknorm_rope_backward(v, lab->cx, d_dinp, d_dqw, d_dkw, d_dout, d_x, d_qw, d_kw, d_rstd_ref,
                         d_cs, d_sn, s);
    std::vector<float> dqw_ref = dqw, dkw_ref = dkw;
    qknorm_rope_backward_cpu(dinp.data(), dqw_ref.data(), dkw_ref.data(), dout.data(), x.data(), hq,
                             hk, rstd.data(), cs.data(), sn.data(), s);
    snprintf(what, sizeof what, "bwd %s: dinp", tag);
    lab_check(lab, what, dev_download_bf16(d_dinp, NQ).data(), dinp.data(), NQ, TOL_BF16);
    snprintf(what, sizeof what, "bwd %s: dq_norm_w", tag);
    lab_check(lab, what, dev_download(d_dqw, s.HD).data(), dqw_ref.data(), s.HD,
              qk_norm ? TOL_F32 : TOL_EXACT);
    snprintf(what, sizeof what, "bwd %s: dk_norm_w", tag);
    lab_check(lab, what, dev_download(d_dkw, s.HD).data(), dkw_ref.data(), s.HD,
              qk_norm ? TOL_F32 : TOL_EXACT);
    void* bufs[] = {d_x,   d_dout, d_qw,   d_kw,  d_cs,  d_sn,
                    d_out, d_dinp, d_rstd, d_dqw, d_dkw, d_rstd_ref};
    for (void* p : bufs)
        if (p) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

static void bench(Lab* lab) {
    const RopeShape s = {8, 2048, 16, 8, 128};
    const int N = s.B * s.T, heads = s.H + s.KVH, QKV = (heads + s.KVH) * s.HD;
    const double NQ = (double)N * QKV, NQK = (double)N * heads * s.HD, NH = (double)N * heads;
    std::vector<float> cs, sn;
    rope_tables(cs, sn, s.T, s.HD);
    float *d_cs = dev_upload(cs), *d_sn = dev_upload(sn);
    bf16* x = dev_random<bf16>((size_t)NQ, 2.0f, 1);
    bf16* dout = dev_random<bf16>((size_t)NQ, 1.0f, 2);
    bf16* w = dev_random<bf16>(2 * s.HD, 1.0f, 3);
    bf16* out = dev_alloc<bf16>((size_t)NQ);
    float* rstd = dev_alloc<float>((size_t)NH);
    float* dw = dev_alloc<float>(2 * s.HD);
    dev_zero(dw, 2 * s.HD * 4);
    CudaCtx* cx = lab->cx;
    const char* shape = "B=8 T=2048 H=16 KVH=8 HD=128";
    printf("\nbenchmark\n");
    lab_bench_header_bw();
    lab_report_copy(lab, (size_t)NQ * 2);
    for (int v = 1; v <= 2; v++) {
        if (!lab_wants(&lab->args, v)) continue;
        double ms = lab_time_ms(lab, [&] {
            qknorm_rope_forward(v, cx, out, rstd, x, w, w + s.HD, d_cs, d_sn, s, EPS);
        });
        lab_report_bw("qk-norm+rope fwd", v, shape, "2NQ in, 2NQ + 4NH out", 4 * NQ + 4 * NH, ms);
        ms = lab_time_ms(lab, [&] {
            qknorm_rope_backward(v, cx, out, dw, dw + s.HD, dout, x, w, w + s.HD, rstd, d_cs, d_sn,
                                 s);
        });
        lab_report_bw("qk-norm+rope bwd", v, shape, "2NQ + 2NQK + 4NH in, 2NQ out",
                      4 * NQ + 2 * NQK + 4 * NH, ms);
    }
    void* bufs[] = {d_cs, d_sn, x, dout, w, out, rstd, dw};
    for (void* p : bufs) cuda_check(cudaFree(p));
}

// ----------------------------------------------------------------------------

static const char* VARIANTS =
    "  1  naive: one thread per (row, head); a block per norm-weight element for its gradient\n"
    "  2  production (kernels/rope.cu): a block per row (forward) or row group (backward)\n";

// The validation cases of variant v (lab_main runs them for every variant asked for).
static void validate_variant(Lab* lab, int v, Rng* r) {
    validate(lab, v, r, RopeShape{3, 37, 4, 2, 128}, 1);
    validate(lab, v, r, RopeShape{2, 29, 6, 2, 64}, 0);
    validate(lab, v, r, RopeShape{2, 23, 3, 1, 36}, 1);
}

// bench as lab_main's callback (the benchmark draws nothing from the lab's Rng).
static void bench_lab(Lab* lab, Rng*) { bench(lab); }

int main(int argc, char** argv) {
    return lab_main(argc, argv, "rope", VARIANTS, 2, 2, validate_variant, bench_lab);
}
