/*
 * test_ops.c — tests of the fp32 CPU backend (llmc/ops_cpu.c) against naive double-precision
 * references written here.
 *
 * For every op: the fp32 forward is compared with the double reference; the double reference's
 * analytic backward is checked against central finite differences of the double forward for the
 * scalar loss L = Σ out ∘ R (R random); the fp32 backward is compared with the double analytic
 * backward. Outputs are pre-filled (NaN where the header says "overwritten", random values where
 * it says "accumulate") so the accumulation semantics are checked too. A last group checks that
 * results with 1 and 3 threads are bit-identical (also with two caller threads sharing a ctx), and
 * one test prints the matmul GFLOP/s.
 * Under AddressSanitizer or ThreadSanitizer the large shapes shrink.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../ops.h"
#include "../rng.h"
#include "testing.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TEST_SANITIZED 1
#else
#define TEST_SANITIZED 0
#endif

// ----------------------------------------------------------------------------
// helpers

#define FWD_TOL 2e-6   // relative L2 error of an fp32 forward against the double reference
#define BWD_TOL 1e-5   // same for an fp32 backward
#define FD_CHECKS 160  // finite-difference probes per tensor (evenly spaced elements)

static float* copy_floats(const float* src, size_t n) {
    float* x = malloc_check((n > 0 ? n : 1) * sizeof(float));
    memcpy(x, src, n * sizeof(float));
    return x;
}

static double* zero_doubles(size_t n) { return calloc_check(n > 0 ? n : 1, sizeof(double)); }

// fp32 result against a double reference: relative L2 error and worst element, both <= tol
// (the worst element relative to the largest reference magnitude).
static int all_equal_bits(const void* a, const void* b, size_t bytes) {
    return memcmp(a, b, bytes) == 0;
}

// Scalar loss of a double forward, evaluated at the current contents of the inputs.
typedef double (*LossFn)(void* arg);

// Central differences of loss w.r.t. evenly spaced elements of x (perturbed in place, restored)
// against the analytic gradient grad; error relative to the gradient's largest magnitude.
static void check_fd(TestCtx* t, const char* what, double* x, size_t n, const double* grad,
                     LossFn loss, void* arg) {
    double gmax = 0.0;
    for (size_t i = 0; i < n; i++) gmax = fmax(gmax, fabs(grad[i]));
    size_t step = n <= FD_CHECKS ? 1 : (n + FD_CHECKS - 1) / FD_CHECKS;
    double worst = 0.0;
    size_t worst_i = 0;
    for (size_t i = (n - 1) % step; i < n; i += step) {  // the last element is always probed
        double x0 = x[i], h = 1e-5 * fmax(1.0, fabs(x0));
        x[i] = x0 + h;
        double lp = loss(arg);
        x[i] = x0 - h;
        double lm = loss(arg);
        x[i] = x0;
        double err = fabs((lp - lm) / (2 * h) - grad[i]);
        if (!(err <= worst)) {
            worst = err;
            worst_i = i;
        }
    }
    CHECK(t, worst <= 1e-6 * fmax(gmax, 1e-3), "%s: finite differences differ by %.3g at %zu "
          "(gradient max %.3g)", what, worst, worst_i, gmax);
}

// ----------------------------------------------------------------------------
// double references (naive loops, the math of docs/FORMATS.md §7)

static void ref_rmsnorm_forward(double* out, double* rstd, const double* x, const double* w, int N,
                                int C, double eps) {
    for (int n = 0; n < N; n++) {
        const double* xr = x + (size_t)n * C;
        double r = 1.0 / sqrt(dot_d(xr, xr, C) / C + eps);
        if (rstd) rstd[n] = r;
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = w[c] * xr[c] * r;
    }
}

// dx += rstd (g - x̂ mean(g x̂)), dw += Σ dy x̂, with g = dy w.
static void ref_rmsnorm_backward(double* dx, double* dw, const double* dy, const double* x,
                                 const double* w, int N, int C, double eps) {
    for (int n = 0; n < N; n++) {
        const double* xr = x + (size_t)n * C;
        const double* dyr = dy + (size_t)n * C;
        double r = 1.0 / sqrt(dot_d(xr, xr, C) / C + eps);
        double m = 0.0;
        for (int c = 0; c < C; c++) m += dyr[c] * w[c] * xr[c] * r;
        m /= C;
        for (int c = 0; c < C; c++) {
            dx[(size_t)n * C + c] += r * (dyr[c] * w[c] - xr[c] * r * m);
            dw[c] += dyr[c] * xr[c] * r;
        }
    }
}

static void ref_matmul_forward(double* out, const double* x, const double* w, const double* bias,
                               int N, int IC, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++)
            out[(size_t)n * OC + o] =
                dot_d(x + (size_t)n * IC, w + (size_t)o * IC, IC) + (bias ? bias[o] : 0.0);
}

// dx = dy·w (overwritten), dw += dyᵀ·x, db += Σ dy.
static void ref_matmul_backward(double* dx, double* dw, double* db, const double* dy,
                                const double* x, const double* w, int N, int IC, int OC) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            double s = 0.0;
            for (int o = 0; o < OC; o++) s += dy[(size_t)n * OC + o] * w[(size_t)o * IC + i];
            dx[(size_t)n * IC + i] = s;
        }
    for (int o = 0; o < OC; o++)
        for (int i = 0; i < IC; i++) {
            double s = 0.0;
            for (int n = 0; n < N; n++) s += dy[(size_t)n * OC + o] * x[(size_t)n * IC + i];
            dw[(size_t)o * IC + i] += s;
        }
    if (db)
        for (int o = 0; o < OC; o++)
            for (int n = 0; n < N; n++) db[o] += dy[(size_t)n * OC + o];
}

typedef struct Shape {
    int B, T, H, KVH, HD;
} Shape;

static int shape_qkv(Shape s) { return (s.H + 2 * s.KVH) * s.HD; }

// Per q/k head: optional RMSNorm over HD, then rotate_half RoPE at position t = n % T; v copied.
static void ref_rope_forward(double* out, double* rstd, const double* inp, const double* qw,
                             const double* kw, const double* cs, const double* sn, Shape s,
                             double eps) {
    int QKV = shape_qkv(s), half = s.HD / 2, heads = s.H + s.KVH;
    double* xn = malloc_check((size_t)s.HD * sizeof(double));
    for (int n = 0; n < s.B * s.T; n++) {
        int t = n % s.T;
        for (int hh = 0; hh < heads; hh++) {
            const double* x = inp + (size_t)n * QKV + (size_t)hh * s.HD;
            const double* w = hh < s.H ? qw : kw;
            for (int i = 0; i < s.HD; i++) xn[i] = x[i];
            if (w) {
                double r = 1.0 / sqrt(dot_d(x, x, s.HD) / s.HD + eps);
                if (rstd) rstd[(size_t)n * heads + hh] = r;
                for (int i = 0; i < s.HD; i++) xn[i] = w[i] * x[i] * r;
            }
            double* y = out + (size_t)n * QKV + (size_t)hh * s.HD;
            for (int i = 0; i < half; i++) {
                double c = cs[t * half + i], si = sn[t * half + i];
                y[i] = xn[i] * c - xn[i + half] * si;
                y[i + half] = xn[i + half] * c + xn[i] * si;
            }
        }
        for (int i = heads * s.HD; i < QKV; i++)
            out[(size_t)n * QKV + i] = inp[(size_t)n * QKV + i];
    }
    free(xn);
}

static void ref_rope_backward(double* dinp, double* dqw, double* dkw, const double* dout,
                              const double* inp, const double* qw, const double* kw,
                              const double* cs, const double* sn, Shape s, double eps) {
    int QKV = shape_qkv(s), half = s.HD / 2, heads = s.H + s.KVH;
    double* dy = malloc_check((size_t)s.HD * sizeof(double));
    for (int n = 0; n < s.B * s.T; n++) {
        int t = n % s.T;
        for (int hh = 0; hh < heads; hh++) {
            const double* g = dout + (size_t)n * QKV + (size_t)hh * s.HD;
            for (int i = 0; i < half; i++) {
                double c = cs[t * half + i], si = sn[t * half + i];
                dy[i] = g[i] * c + g[i + half] * si;
                dy[i + half] = g[i + half] * c - g[i] * si;
            }
            double* dx = dinp + (size_t)n * QKV + (size_t)hh * s.HD;
            const double* w = hh < s.H ? qw : kw;
            double* dw = hh < s.H ? dqw : dkw;
            if (!w) {
                for (int i = 0; i < s.HD; i++) dx[i] = dy[i];
                continue;
            }
            const double* x = inp + (size_t)n * QKV + (size_t)hh * s.HD;
            double r = 1.0 / sqrt(dot_d(x, x, s.HD) / s.HD + eps);
            double m = 0.0;
            for (int i = 0; i < s.HD; i++) m += dy[i] * w[i] * x[i] * r;
            m /= s.HD;
            for (int i = 0; i < s.HD; i++) {
                dx[i] = r * (dy[i] * w[i] - x[i] * r * m);
                dw[i] += dy[i] * x[i] * r;
            }
        }
        for (int i = heads * s.HD; i < QKV; i++)
            dinp[(size_t)n * QKV + i] = dout[(size_t)n * QKV + i];
    }
    free(dy);
}

static const double* ref_qkv_at(const double* qkv, Shape s, int b, int t, int head) {
    return qkv + (size_t)(b * s.T + t) * shape_qkv(s) + (size_t)head * s.HD;
}

// Softmax probabilities p[0..t] of query (b, t, h); returns the log-sum-exp of the logits.
static double ref_attention_probs(double* p, const double* qkv, Shape s, int b, int t, int h) {
    int g = h / (s.H / s.KVH);
    double scale = 1.0 / sqrt((double)s.HD), mx = -INFINITY, sum = 0.0;
    const double* q = ref_qkv_at(qkv, s, b, t, h);
    for (int j = 0; j <= t; j++) {
        p[j] = dot_d(q, ref_qkv_at(qkv, s, b, j, s.H + g), s.HD) * scale;
        mx = fmax(mx, p[j]);
    }
    for (int j = 0; j <= t; j++) sum += exp(p[j] - mx);
    for (int j = 0; j <= t; j++) p[j] = exp(p[j] - mx) / sum;
    return mx + log(sum);
}

static void ref_attention_forward(double* out, double* lse, const double* qkv, Shape s) {
    int g_size = s.H / s.KVH;
    double* p = malloc_check((size_t)s.T * sizeof(double));
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++)
            for (int t = 0; t < s.T; t++) {
                double l = ref_attention_probs(p, qkv, s, b, t, h);
                if (lse) lse[((size_t)b * s.H + h) * s.T + t] = l;
                double* o = out + (size_t)(b * s.T + t) * s.H * s.HD + (size_t)h * s.HD;
                for (int i = 0; i < s.HD; i++) o[i] = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double* v = ref_qkv_at(qkv, s, b, j, s.H + s.KVH + h / g_size);
                    for (int i = 0; i < s.HD; i++) o[i] += p[j] * v[i];
                }
            }
    free(p);
}

static void ref_attention_backward(double* dqkv, const double* dout, const double* qkv, Shape s) {
    int QKV = shape_qkv(s), g_size = s.H / s.KVH;
    double scale = 1.0 / sqrt((double)s.HD);
    double* p = malloc_check((size_t)s.T * sizeof(double));
    double* dp = malloc_check((size_t)s.T * sizeof(double));
    memset(dqkv, 0, (size_t)s.B * s.T * QKV * sizeof(double));
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++)
            for (int t = 0; t < s.T; t++) {
                int g = h / g_size;
                ref_attention_probs(p, qkv, s, b, t, h);
                const double* dO = dout + (size_t)(b * s.T + t) * s.H * s.HD + (size_t)h * s.HD;
                double D = 0.0;
                for (int j = 0; j <= t; j++) {
                    dp[j] = dot_d(dO, ref_qkv_at(qkv, s, b, j, s.H + s.KVH + g), s.HD);
                    D += p[j] * dp[j];
                }
                const double* q = ref_qkv_at(qkv, s, b, t, h);
                double* dq = dqkv + (size_t)(b * s.T + t) * QKV + (size_t)h * s.HD;
                for (int j = 0; j <= t; j++) {
                    double ds = p[j] * (dp[j] - D);
                    const double* k = ref_qkv_at(qkv, s, b, j, s.H + g);
                    double* dk = dqkv + (size_t)(b * s.T + j) * QKV + (size_t)(s.H + g) * s.HD;
                    double* dv = dk + (size_t)s.KVH * s.HD;
                    for (int i = 0; i < s.HD; i++) {
                        dq[i] += ds * k[i] * scale;
                        dk[i] += ds * q[i] * scale;
                        dv[i] += p[j] * dO[i];
                    }
                }
            }
    free(p);
    free(dp);
}

static double ref_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

static void ref_swiglu_forward(double* out, const double* gu, int N, int F) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < F; i++) {
            double a = gu[(size_t)n * 2 * F + i], u = gu[(size_t)n * 2 * F + F + i];
            out[(size_t)n * F + i] = a * ref_sigmoid(a) * u;
        }
}

static void ref_swiglu_backward(double* dgu, const double* dout, const double* gu, int N, int F) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < F; i++) {
            double a = gu[(size_t)n * 2 * F + i], u = gu[(size_t)n * 2 * F + F + i];
            double sg = ref_sigmoid(a), dy = dout[(size_t)n * F + i];
            dgu[(size_t)n * 2 * F + F + i] = dy * a * sg;
            dgu[(size_t)n * 2 * F + i] = dy * u * sg * (1.0 + a * (1.0 - sg));
        }
}

// losses and (softmax - onehot) * scale; ignored rows give 0 and a zero gradient row.
static void ref_crossentropy(double* losses, double* dlogits, const double* logits,
                             const int32_t* targets, int n, int V, double scale) {
    for (int i = 0; i < n; i++) {
        const double* z = logits + (size_t)i * V;
        double* dz = dlogits ? dlogits + (size_t)i * V : NULL;
        if (targets[i] < 0) {
            losses[i] = 0.0;
            if (dz)
                for (int j = 0; j < V; j++) dz[j] = 0.0;
            continue;
        }
        double mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, z[j]);
        for (int j = 0; j < V; j++) sum += exp(z[j] - mx);
        double lse = mx + log(sum);
        losses[i] = lse - z[targets[i]];
        if (dz)
            for (int j = 0; j < V; j++) dz[j] = (exp(z[j] - lse) - (j == targets[i])) * scale;
    }
}

// ----------------------------------------------------------------------------
// memory ops

static void test_ops_memory(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    const Ops* ops = &ops_cpu;
    CHECK(t, strcmp(ops->name, "cpu") == 0 && ops->act_bytes == 4, "name %s act_bytes %d",
          ops->name, ops->act_bytes);
    size_t n = 1001;
    float* buf = ops->alloc(ctx, n * sizeof(float));
    CHECK(t, ((uintptr_t)buf % 64) == 0, "alloc is not 64-byte aligned");
    int zero = 1;
    for (size_t i = 0; i < n; i++) zero &= buf[i] == 0.0f;
    CHECK(t, zero, "alloc is not zero-initialised");

    Rng r;
    rng_seed(&r, 1);
    float* host = rand_floats(&r, n, 1.0f);
    float* back = filled_floats(n, NAN);
    ops->upload_f32(ctx, buf, host, n);
    ops->download_f32(ctx, back, buf, n);
    CHECK(t, all_equal_bits(host, back, n * sizeof(float)), "upload_f32/download_f32 round trip");
    float* buf2 = ops->alloc(ctx, n * sizeof(float));
    ops->copy(ctx, buf2, buf, n * sizeof(float));
    memset(back, 0, n * sizeof(float));
    ops->download(ctx, back, buf2, n * sizeof(float));
    ops->synchronize(ctx);
    CHECK(t, all_equal_bits(host, back, n * sizeof(float)), "copy + download");
    int32_t ids[5] = {3, -1, 7, 0, 42}, ids_back[5] = {0};
    int32_t* dids = ops->alloc(ctx, sizeof ids);
    ops->upload(ctx, dids, ids, sizeof ids);
    ops->download(ctx, ids_back, dids, sizeof ids);
    CHECK(t, memcmp(ids, ids_back, sizeof ids) == 0, "upload/download of ids");
    ops->zero(ctx, buf2, 10 * sizeof(float));
    ops->download_f32(ctx, back, buf2, n);
    CHECK(t, back[0] == 0.0f && back[9] == 0.0f && back[10] == host[10], "zero of a prefix");
    void* empty = ops->alloc(ctx, 0);  // a zero-byte buffer is still a valid pointer to free
    ops->free(ctx, empty);
    ops->free(ctx, dids);
    ops->free(ctx, buf2);
    ops->free(ctx, buf);
    free(host);
    free(back);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// embedding

typedef struct EmbeddingFd {
    double* wte;
    const double* R;
    const int32_t* ids;
    int N, C;
} EmbeddingFd;

static double embedding_loss(void* arg) {
    const EmbeddingFd* e = arg;
    double L = 0.0;
    for (int n = 0; n < e->N; n++)
        L += dot_d(e->wte + (size_t)e->ids[n] * e->C, e->R + (size_t)n * e->C, e->C);
    return L;
}

static void test_ops_embedding(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 2);
    const int N = 37, C = 70, V = 11;  // V < N: ids repeat
    int32_t ids[37];
    for (int n = 0; n < N; n++) ids[n] = (int32_t)rng_below(&r, V);
    ids[0] = V - 1;
    float* wte = rand_floats(&r, (size_t)V * C, 1.0f);
    float* out = filled_floats((size_t)N * C, NAN);
    ops_cpu.embedding_forward(ctx, out, ids, wte, N, C);
    int exact = 1;
    for (int n = 0; n < N; n++)
        exact &= all_equal_bits(out + (size_t)n * C, wte + (size_t)ids[n] * C, C * sizeof(float));
    CHECK(t, exact, "embedding_forward rows equal wte[ids]");

    float* dout = rand_floats(&r, (size_t)N * C, 1.0f);
    float* dwte = rand_floats(&r, (size_t)V * C, 1.0f);  // accumulates
    double* want = to_doubles(dwte, (size_t)V * C);
    double* dgrad = zero_doubles((size_t)V * C);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) dgrad[(size_t)ids[n] * C + c] += dout[(size_t)n * C + c];
    for (size_t i = 0; i < (size_t)V * C; i++) want[i] += dgrad[i];
    ops_cpu.embedding_backward(ctx, dwte, dout, ids, N, C, V);
    check_close(t, "embedding_backward dwte +=", dwte, want, (size_t)V * C, 1e-6);

    EmbeddingFd fd = {.wte = to_doubles(wte, (size_t)V * C), .R = to_doubles(dout, (size_t)N * C),
                      .ids = ids, .N = N, .C = C};
    check_fd(t, "embedding dwte (fd)", fd.wte, (size_t)V * C, dgrad, embedding_loss, &fd);
    free(fd.wte);
    free((void*)fd.R);
    free(wte);
    free(out);
    free(dout);
    free(dwte);
    free(want);
    free(dgrad);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// RMSNorm

typedef struct RmsnormFd {
    double* x;
    double* w;
    const double* R;
    double* out;
    int N, C;
    double eps;
} RmsnormFd;

static double rmsnorm_loss(void* arg) {
    RmsnormFd* f = arg;
    ref_rmsnorm_forward(f->out, NULL, f->x, f->w, f->N, f->C, f->eps);
    return dot_d(f->out, f->R, (size_t)f->N * f->C);
}

static void check_rmsnorm(TestCtx* t, void* ctx, Rng* r, int N, int C, int with_fd) {
    char what[128];
    size_t NC = (size_t)N * C;
    const float eps = 1e-5f;
    float* x = rand_floats(r, NC, 1.5f);
    float* w = rand_floats(r, C, 1.0f);
    float* out = filled_floats(NC, NAN);
    float* rstd = filled_floats(N, NAN);
    ops_cpu.rmsnorm_forward(ctx, out, rstd, x, w, N, C, eps);
    double* xd = to_doubles(x, NC);
    double* wd = to_doubles(w, C);
    double* out_ref = zero_doubles(NC);
    double* rstd_ref = zero_doubles(N);
    ref_rmsnorm_forward(out_ref, rstd_ref, xd, wd, N, C, eps);
    snprintf(what, sizeof what, "rmsnorm_forward N=%d C=%d out", N, C);
    check_close(t, what, out, out_ref, NC, FWD_TOL);
    snprintf(what, sizeof what, "rmsnorm_forward N=%d C=%d rstd", N, C);
    check_close(t, what, rstd, rstd_ref, N, FWD_TOL);

    // Backward: dinp and dw both accumulate into random contents.
    float* dout = rand_floats(r, NC, 1.0f);
    float* dinp = rand_floats(r, NC, 1.0f);
    float* dw = rand_floats(r, C, 1.0f);
    double* R = to_doubles(dout, NC);
    double* dx_grad = zero_doubles(NC);
    double* dw_grad = zero_doubles(C);
    ref_rmsnorm_backward(dx_grad, dw_grad, R, xd, wd, N, C, eps);
    double* dx_want = to_doubles(dinp, NC);
    double* dw_want = to_doubles(dw, C);
    for (size_t i = 0; i < NC; i++) dx_want[i] += dx_grad[i];
    for (int c = 0; c < C; c++) dw_want[c] += dw_grad[c];
    ops_cpu.rmsnorm_backward(ctx, dinp, dw, dout, x, w, rstd, N, C);
    snprintf(what, sizeof what, "rmsnorm_backward N=%d C=%d dinp +=", N, C);
    check_close(t, what, dinp, dx_want, NC, BWD_TOL);
    snprintf(what, sizeof what, "rmsnorm_backward N=%d C=%d dw +=", N, C);
    check_close(t, what, dw, dw_want, C, BWD_TOL);
    // The pure gradient (without the pre-filled part) is checked too, so small gradients are not
    // hidden under large pre-filled values.
    float* dinp0 = filled_floats(NC, 0.0f);
    float* dw0 = filled_floats(C, 0.0f);
    ops_cpu.rmsnorm_backward(ctx, dinp0, dw0, dout, x, w, rstd, N, C);
    snprintf(what, sizeof what, "rmsnorm_backward N=%d C=%d dinp", N, C);
    check_close(t, what, dinp0, dx_grad, NC, BWD_TOL);
    snprintf(what, sizeof what, "rmsnorm_backward N=%d C=%d dw", N, C);
    check_close(t, what, dw0, dw_grad, C, BWD_TOL);

    if (with_fd) {
        RmsnormFd fd = {.x = xd, .w = wd, .R = R, .out = zero_doubles(NC), .N = N, .C = C,
                        .eps = eps};
        check_fd(t, "rmsnorm dinp (fd)", xd, NC, dx_grad, rmsnorm_loss, &fd);
        check_fd(t, "rmsnorm dw (fd)", wd, C, dw_grad, rmsnorm_loss, &fd);
        free(fd.out);
    }
    free(x), free(w), free(out), free(rstd), free(xd), free(wd), free(out_ref), free(rstd_ref);
    free(dout), free(dinp), free(dw), free(R), free(dx_grad), free(dw_grad), free(dx_want);
    free(dw_want), free(dinp0), free(dw0);
}

static void test_ops_rmsnorm(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 3);
    check_rmsnorm(t, ctx, &r, 7, 37, 1);
    check_rmsnorm(t, ctx, &r, 1, 3, 1);
    check_rmsnorm(t, ctx, &r, 5, 64, 1);
    check_rmsnorm(t, ctx, &r, 300, 129, 0);  // several row tasks and column tasks
    ops_cpu_destroy(ctx);
}

static void test_ops_residual_rmsnorm(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 4);
    const int N = 9, C = 45;
    const size_t NC = (size_t)N * C;
    const float eps = 1e-6f;
    float* a = rand_floats(&r, NC, 1.0f);
    float* b = rand_floats(&r, NC, 1.0f);
    float* w = rand_floats(&r, C, 1.0f);
    float* res = filled_floats(NC, NAN);
    float* out = filled_floats(NC, NAN);
    float* rstd = filled_floats(N, NAN);
    ops_cpu.residual_rmsnorm_forward(ctx, res, out, rstd, a, b, w, N, C, eps);
    float* sum = malloc_check(NC * sizeof(float));
    for (size_t i = 0; i < NC; i++) sum[i] = a[i] + b[i];
    CHECK(t, all_equal_bits(res, sum, NC * sizeof(float)), "res = a + b exactly");
    double* sd = to_doubles(sum, NC);
    double* wd = to_doubles(w, C);
    double* out_ref = zero_doubles(NC);
    double* rstd_ref = zero_doubles(N);
    ref_rmsnorm_forward(out_ref, rstd_ref, sd, wd, N, C, eps);
    check_close(t, "residual_rmsnorm out", out, out_ref, NC, FWD_TOL);
    check_close(t, "residual_rmsnorm rstd", rstd, rstd_ref, N, FWD_TOL);
    // It must equal add followed by rmsnorm_forward, also when res aliases a.
    float* out2 = filled_floats(NC, NAN);
    float* rstd2 = filled_floats(N, NAN);
    ops_cpu.residual_rmsnorm_forward(ctx, a, out2, rstd2, a, b, w, N, C, eps);
    CHECK(t, all_equal_bits(a, sum, NC * sizeof(float)), "res aliasing a: a holds a + b");
    CHECK(t, all_equal_bits(out2, out, NC * sizeof(float)) &&
             all_equal_bits(rstd2, rstd, N * sizeof(float)), "res aliasing a: same out and rstd");
    float* out3 = filled_floats(NC, NAN);
    ops_cpu.rmsnorm_forward(ctx, out3, rstd2, sum, w, N, C, eps);
    CHECK(t, all_equal_bits(out3, out, NC * sizeof(float)), "fused = add + rmsnorm_forward");
    free(a), free(b), free(w), free(res), free(out), free(rstd), free(sum), free(sd), free(wd);
    free(out_ref), free(rstd_ref), free(out2), free(rstd2), free(out3);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// matmul

typedef struct MatmulFd {
    double *x, *w, *bias;
    const double* R;
    double* out;
    int N, IC, OC;
} MatmulFd;

static double matmul_loss(void* arg) {
    MatmulFd* f = arg;
    ref_matmul_forward(f->out, f->x, f->w, f->bias, f->N, f->IC, f->OC);
    return dot_d(f->out, f->R, (size_t)f->N * f->OC);
}

static void check_matmul(TestCtx* t, void* ctx, Rng* r, int N, int IC, int OC, int with_bias,
                         int with_fd) {
    char what[160];
    size_t nx = (size_t)N * IC, nw = (size_t)OC * IC, no = (size_t)N * OC;
    float* x = rand_floats(r, nx, 1.0f);
    float* w = rand_floats(r, nw, 0.5f);
    float* bias = with_bias ? rand_floats(r, OC, 1.0f) : NULL;
    float* out = filled_floats(no, NAN);
    ops_cpu.matmul_forward(ctx, out, x, w, bias, N, IC, OC);
    double* xd = to_doubles(x, nx);
    double* wd = to_doubles(w, nw);
    double* bd = with_bias ? to_doubles(bias, OC) : NULL;
    double* out_ref = zero_doubles(no);
    ref_matmul_forward(out_ref, xd, wd, bd, N, IC, OC);
    snprintf(what, sizeof what, "matmul_forward N=%d IC=%d OC=%d bias=%d", N, IC, OC, with_bias);
    check_close(t, what, out, out_ref, no, FWD_TOL);

    float* dout = rand_floats(r, no, 1.0f);
    float* dinp = filled_floats(nx, NAN);               // overwritten
    float* dw = rand_floats(r, nw, 1.0f);               // accumulates
    float* dbias = with_bias ? rand_floats(r, OC, 1.0f) : NULL;
    double* R = to_doubles(dout, no);
    double* dx_grad = zero_doubles(nx);
    double* dw_grad = zero_doubles(nw);
    double* db_grad = zero_doubles(OC);
    ref_matmul_backward(dx_grad, dw_grad, db_grad, R, xd, wd, N, IC, OC);
    double* dw_want = to_doubles(dw, nw);
    double* db_want = to_doubles(dbias, with_bias ? OC : 0);
    for (size_t i = 0; i < nw; i++) dw_want[i] += dw_grad[i];
    for (int o = 0; with_bias && o < OC; o++) db_want[o] += db_grad[o];
    ops_cpu.matmul_backward(ctx, dinp, dw, dbias, dout, x, w, N, IC, OC);
    snprintf(what, sizeof what, "matmul_backward N=%d IC=%d OC=%d dinp", N, IC, OC);
    check_close(t, what, dinp, dx_grad, nx, BWD_TOL);
    snprintf(what, sizeof what, "matmul_backward N=%d IC=%d OC=%d dw +=", N, IC, OC);
    check_close(t, what, dw, dw_want, nw, BWD_TOL);
    if (with_bias) {
        snprintf(what, sizeof what, "matmul_backward N=%d IC=%d OC=%d dbias +=", N, IC, OC);
        check_close(t, what, dbias, db_want, OC, BWD_TOL);
    }
    // Pure dw from zero, and NULL dinp / dbias are skipped.
    float* dw0 = filled_floats(nw, 0.0f);
    ops_cpu.matmul_backward(ctx, NULL, dw0, NULL, dout, x, w, N, IC, OC);
    snprintf(what, sizeof what, "matmul_backward N=%d IC=%d OC=%d dw (dinp NULL)", N, IC, OC);
    check_close(t, what, dw0, dw_grad, nw, BWD_TOL);

    if (with_fd) {
        MatmulFd fd = {.x = xd, .w = wd, .bias = bd, .R = R, .out = zero_doubles(no), .N = N,
                       .IC = IC, .OC = OC};
        check_fd(t, "matmul dinp (fd)", xd, nx, dx_grad, matmul_loss, &fd);
        check_fd(t, "matmul dw (fd)", wd, nw, dw_grad, matmul_loss, &fd);
        if (with_bias) check_fd(t, "matmul dbias (fd)", bd, OC, db_grad, matmul_loss, &fd);
        free(fd.out);
    }
    free(x), free(w), free(bias), free(out), free(xd), free(wd), free(bd), free(out_ref);
    free(dout), free(dinp), free(dw), free(dbias), free(R), free(dx_grad), free(dw_grad);
    free(db_grad), free(dw_want), free(db_want), free(dw0);
}

static void test_ops_matmul(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 5);
    check_matmul(t, ctx, &r, 1, 1, 1, 1, 1);
    check_matmul(t, ctx, &r, 7, 13, 5, 1, 1);
    check_matmul(t, ctx, &r, 7, 13, 5, 0, 1);
    check_matmul(t, ctx, &r, 37, 70, 45, 1, 1);
    check_matmul(t, ctx, &r, 64, 128, 96, 0, 0);   // whole micro-tiles only
    check_matmul(t, ctx, &r, 77, 300, 161, 1, 0);  // several k blocks, edge tiles on both sides
    if (!TEST_SANITIZED) check_matmul(t, ctx, &r, 300, 259, 200, 1, 0);  // k = N spans k blocks
    ops_cpu_destroy(ctx);
}

// GFLOP/s of the default model's typical matmul (printed, not asserted), plus a sampled check.
static void test_ops_matmul_speed(TestCtx* t) {
    int N = TEST_SANITIZED ? 128 : 1024, IC = TEST_SANITIZED ? 64 : 512, OC = IC;
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 6);
    float* x = rand_floats(&r, (size_t)N * IC, 1.0f);
    float* w = rand_floats(&r, (size_t)OC * IC, 1.0f);
    float* out = filled_floats((size_t)N * OC, NAN);
    float* dx = filled_floats((size_t)N * IC, NAN);
    float* dw = filled_floats((size_t)OC * IC, 0.0f);
    ops_cpu.matmul_forward(ctx, out, x, w, NULL, N, IC, OC);  // warm up
    const int reps = TEST_SANITIZED ? 1 : 5;
    double t0 = time_now_s();
    for (int i = 0; i < reps; i++) ops_cpu.matmul_forward(ctx, out, x, w, NULL, N, IC, OC);
    double t_fwd = (time_now_s() - t0) / reps;
    t0 = time_now_s();
    for (int i = 0; i < reps; i++) ops_cpu.matmul_backward(ctx, dx, dw, NULL, out, x, w, N, IC, OC);
    double t_bwd = (time_now_s() - t0) / reps;
    double flops = 2.0 * N * IC * OC;
    printf("  matmul %dx%dx%d on %d threads: forward %.1f GFLOP/s, backward %.1f GFLOP/s\n", N,
           IC, OC, t->n_threads, flops / t_fwd * 1e-9, 2 * flops / t_bwd * 1e-9);
    double worst = 0.0;
    for (int s = 0; s < 64; s++) {
        int n = (int)rng_below(&r, N), o = (int)rng_below(&r, OC);
        double want = 0.0;
        for (int i = 0; i < IC; i++) want += (double)x[(size_t)n * IC + i] * w[(size_t)o * IC + i];
        worst = fmax(worst, fabs(out[(size_t)n * OC + o] - want) / sqrt((double)IC));
    }
    CHECK(t, worst < 1e-4, "sampled matmul outputs off by %.3g", worst);
    free(x), free(w), free(out), free(dx), free(dw);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// QK-norm + RoPE

static void rope_tables(float* cs, float* sn, int T, int HD) {
    int half = HD / 2;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            float inv_freq = powf(10000.0f, -2.0f * i / HD);
            cs[t * half + i] = cosf(t * inv_freq);
            sn[t * half + i] = sinf(t * inv_freq);
        }
}

typedef struct RopeFd {
    double *inp, *qw, *kw;
    const double *cs, *sn, *R;
    double* out;
    Shape s;
    double eps;
} RopeFd;

static double rope_loss(void* arg) {
    RopeFd* f = arg;
    ref_rope_forward(f->out, NULL, f->inp, f->qw, f->kw, f->cs, f->sn, f->s, f->eps);
    return dot_d(f->out, f->R, (size_t)f->s.B * f->s.T * shape_qkv(f->s));
}

static void check_rope(TestCtx* t, void* ctx, Rng* r, Shape s, int norm, int with_fd) {
    char what[160];
    snprintf(what, sizeof what, "B=%d T=%d H=%d KVH=%d HD=%d norm=%d", s.B, s.T, s.H, s.KVH, s.HD,
             norm);
    int N = s.B * s.T, heads = s.H + s.KVH, half = s.HD / 2;
    size_t n_qkv = (size_t)N * shape_qkv(s);
    const float eps = 1e-6f;
    float* inp = rand_floats(r, n_qkv, 1.0f);
    float* qw = norm ? rand_floats(r, s.HD, 1.0f) : NULL;
    float* kw = norm ? rand_floats(r, s.HD, 1.0f) : NULL;
    float* cs = malloc_check((size_t)s.T * half * sizeof(float));
    float* sn = malloc_check((size_t)s.T * half * sizeof(float));
    rope_tables(cs, sn, s.T, s.HD);
    float* out = filled_floats(n_qkv, NAN);
    float* rstd = norm ? filled_floats((size_t)N * heads, NAN) : NULL;
    ops_cpu.qknorm_rope_forward(ctx, out, rstd, inp, qw, kw, cs, sn, s.B, s.T, s.H, s.KVH, s.HD,
                                eps);
    double* inpd = to_doubles(inp, n_qkv);
    double* qwd = norm ? to_doubles(qw, s.HD) : NULL;
    double* kwd = norm ? to_doubles(kw, s.HD) : NULL;
    double* csd = to_doubles(cs, (size_t)s.T * half);
    double* snd = to_doubles(sn, (size_t)s.T * half);
    double* out_ref = zero_doubles(n_qkv);
    double* rstd_ref = zero_doubles((size_t)N * heads);
    ref_rope_forward(out_ref, rstd_ref, inpd, qwd, kwd, csd, snd, s, eps);
    char buf[256];
    snprintf(buf, sizeof buf, "qknorm_rope_forward %s out", what);
    check_close(t, buf, out, out_ref, n_qkv, FWD_TOL);
    if (norm) {
        snprintf(buf, sizeof buf, "qknorm_rope_forward %s rstd", what);
        check_close(t, buf, rstd, rstd_ref, (size_t)N * heads, FWD_TOL);
    }

    float* dout = rand_floats(r, n_qkv, 1.0f);
    float* dinp = filled_floats(n_qkv, NAN);  // overwritten
    float* dqw = norm ? rand_floats(r, s.HD, 1.0f) : NULL;
    float* dkw = norm ? rand_floats(r, s.HD, 1.0f) : NULL;
    double* R = to_doubles(dout, n_qkv);
    double* dx_grad = zero_doubles(n_qkv);
    double* dqw_grad = zero_doubles(s.HD);
    double* dkw_grad = zero_doubles(s.HD);
    ref_rope_backward(dx_grad, dqw_grad, dkw_grad, R, inpd, qwd, kwd, csd, snd, s, eps);
    double* dqw_want = to_doubles(dqw, norm ? s.HD : 0);
    double* dkw_want = to_doubles(dkw, norm ? s.HD : 0);
    for (int i = 0; norm && i < s.HD; i++) dqw_want[i] += dqw_grad[i], dkw_want[i] += dkw_grad[i];
    ops_cpu.qknorm_rope_backward(ctx, dinp, dqw, dkw, dout, inp, qw, kw, rstd, cs, sn, s.B, s.T,
                                 s.H, s.KVH, s.HD);
    snprintf(buf, sizeof buf, "qknorm_rope_backward %s dinp", what);
    check_close(t, buf, dinp, dx_grad, n_qkv, BWD_TOL);
    if (norm) {
        snprintf(buf, sizeof buf, "qknorm_rope_backward %s dq_norm_w +=", what);
        check_close(t, buf, dqw, dqw_want, s.HD, BWD_TOL);
        snprintf(buf, sizeof buf, "qknorm_rope_backward %s dk_norm_w +=", what);
        check_close(t, buf, dkw, dkw_want, s.HD, BWD_TOL);
    }
    if (with_fd) {
        RopeFd fd = {.inp = inpd, .qw = qwd, .kw = kwd, .cs = csd, .sn = snd, .R = R,
                     .out = zero_doubles(n_qkv), .s = s, .eps = eps};
        snprintf(buf, sizeof buf, "qknorm_rope %s dinp (fd)", what);
        check_fd(t, buf, inpd, n_qkv, dx_grad, rope_loss, &fd);
        if (norm) {
            snprintf(buf, sizeof buf, "qknorm_rope %s dq_norm_w (fd)", what);
            check_fd(t, buf, qwd, s.HD, dqw_grad, rope_loss, &fd);
            snprintf(buf, sizeof buf, "qknorm_rope %s dk_norm_w (fd)", what);
            check_fd(t, buf, kwd, s.HD, dkw_grad, rope_loss, &fd);
        }
        free(fd.out);
    }
    free(inp), free(qw), free(kw), free(cs), free(sn), free(out), free(rstd), free(inpd);
    free(qwd), free(kwd), free(csd), free(snd), free(out_ref), free(rstd_ref), free(dout);
    free(dinp), free(dqw), free(dkw), free(R), free(dx_grad), free(dqw_grad), free(dkw_grad);
    free(dqw_want), free(dkw_want);
}

static void test_ops_qknorm_rope(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 7);
    check_rope(t, ctx, &r, (Shape){2, 37, 4, 2, 16}, 1, 1);
    check_rope(t, ctx, &r, (Shape){2, 37, 4, 2, 16}, 0, 1);
    check_rope(t, ctx, &r, (Shape){3, 1, 2, 1, 8}, 1, 1);  // T = 1: every position is 0
    check_rope(t, ctx, &r, (Shape){1, 37, 4, 1, 8}, 0, 1);
    check_rope(t, ctx, &r, (Shape){2, 5, 3, 3, 64}, 1, 1);
    check_rope(t, ctx, &r, (Shape){1, 37, 2, 1, 128}, 1, 0);
    check_rope(t, ctx, &r, (Shape){1, 3, 2, 2, 128}, 0, 1);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// attention

typedef struct AttnFd {
    double* qkv;
    const double* R;
    double* out;
    Shape s;
} AttnFd;

static double attention_loss(void* arg) {
    AttnFd* f = arg;
    ref_attention_forward(f->out, NULL, f->qkv, f->s);
    return dot_d(f->out, f->R, (size_t)f->s.B * f->s.T * f->s.H * f->s.HD);
}

// qkv_scale sets the logit magnitude (a scaled logit has std qkv_scale²); tol_mult widens the
// tolerances for sharp softmaxes, whose outputs amplify the fp32 rounding of the logits.
static void check_attention(TestCtx* t, void* ctx, Rng* r, Shape s, float qkv_scale,
                            double tol_mult, int with_fd) {
    char what[200];
    int N = s.B * s.T;
    size_t n_qkv = (size_t)N * shape_qkv(s), n_out = (size_t)N * s.H * s.HD;
    size_t n_lse = (size_t)s.B * s.H * s.T;
    float* qkv = rand_floats(r, n_qkv, qkv_scale);
    float* out = filled_floats(n_out, NAN);
    float* lse = filled_floats(n_lse, NAN);
    ops_cpu.attention_forward(ctx, out, lse, qkv, s.B, s.T, s.H, s.KVH, s.HD);
    double* qkvd = to_doubles(qkv, n_qkv);
    double* out_ref = zero_doubles(n_out);
    double* lse_ref = zero_doubles(n_lse);
    ref_attention_forward(out_ref, lse_ref, qkvd, s);
    snprintf(what, sizeof what, "attention_forward B=%d T=%d H=%d KVH=%d HD=%d out", s.B, s.T,
             s.H, s.KVH, s.HD);
    check_close(t, what, out, out_ref, n_out, FWD_TOL * tol_mult);
    snprintf(what, sizeof what, "attention_forward B=%d T=%d H=%d KVH=%d HD=%d lse", s.B, s.T,
             s.H, s.KVH, s.HD);
    check_close(t, what, lse, lse_ref, n_lse, FWD_TOL * tol_mult);

    float* dout = rand_floats(r, n_out, 1.0f);
    float* dqkv = filled_floats(n_qkv, NAN);  // overwritten
    double* R = to_doubles(dout, n_out);
    double* grad = zero_doubles(n_qkv);
    ref_attention_backward(grad, R, qkvd, s);
    ops_cpu.attention_backward(ctx, dqkv, dout, qkv, out, lse, s.B, s.T, s.H, s.KVH, s.HD);
    snprintf(what, sizeof what, "attention_backward B=%d T=%d H=%d KVH=%d HD=%d dqkv", s.B, s.T,
             s.H, s.KVH, s.HD);
    check_close(t, what, dqkv, grad, n_qkv, BWD_TOL * tol_mult);
    if (with_fd) {
        AttnFd fd = {.qkv = qkvd, .R = R, .out = zero_doubles(n_out), .s = s};
        snprintf(what, sizeof what, "attention B=%d T=%d H=%d KVH=%d HD=%d dqkv (fd)", s.B, s.T,
                 s.H, s.KVH, s.HD);
        check_fd(t, what, qkvd, n_qkv, grad, attention_loss, &fd);
        free(fd.out);
    }
    free(qkv), free(out), free(lse), free(qkvd), free(out_ref), free(lse_ref), free(dout);
    free(dqkv), free(R), free(grad);
}

static void test_ops_attention(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 8);
    check_attention(t, ctx, &r, (Shape){1, 1, 2, 1, 8}, 1.5f, 1, 1);    // T = 1
    check_attention(t, ctx, &r, (Shape){2, 37, 3, 3, 16}, 1.5f, 1, 1);  // group of 1
    check_attention(t, ctx, &r, (Shape){2, 37, 4, 2, 16}, 1.5f, 1, 1);  // groups of 2
    check_attention(t, ctx, &r, (Shape){1, 37, 4, 1, 8}, 1.5f, 1, 1);   // group of 4
    check_attention(t, ctx, &r, (Shape){1, 20, 2, 2, 64}, 1.5f, 1, 1);
    check_attention(t, ctx, &r, (Shape){1, 37, 2, 1, 128}, 1.5f, 1, 0);
    check_attention(t, ctx, &r, (Shape){3, 1, 4, 2, 128}, 1.5f, 1, 1);
    check_attention(t, ctx, &r, (Shape){2, 100, 4, 1, 32}, 1.5f, 1, 0);  // several key blocks
    check_attention(t, ctx, &r, (Shape){1, 70, 2, 1, 16}, 4.0f, 4, 0);  // logits of std 16
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// SwiGLU, add

typedef struct SwigluFd {
    double* gu;
    const double* R;
    double* out;
    int N, F;
} SwigluFd;

static double swiglu_loss(void* arg) {
    SwigluFd* f = arg;
    ref_swiglu_forward(f->out, f->gu, f->N, f->F);
    return dot_d(f->out, f->R, (size_t)f->N * f->F);
}

static void test_ops_swiglu(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 9);
    const int N = 7, F = 37;
    size_t n_gu = (size_t)N * 2 * F, n_out = (size_t)N * F;
    float* gu = rand_floats(&r, n_gu, 2.0f);
    gu[0] = -30.0f;  // saturated sigmoid on both sides
    gu[1] = 30.0f;
    float* out = filled_floats(n_out, NAN);
    ops_cpu.swiglu_forward(ctx, out, gu, N, F);
    double* gud = to_doubles(gu, n_gu);
    double* out_ref = zero_doubles(n_out);
    ref_swiglu_forward(out_ref, gud, N, F);
    check_close(t, "swiglu_forward", out, out_ref, n_out, FWD_TOL);
    float* dout = rand_floats(&r, n_out, 1.0f);
    float* dgu = filled_floats(n_gu, NAN);
    double* R = to_doubles(dout, n_out);
    double* grad = zero_doubles(n_gu);
    ref_swiglu_backward(grad, R, gud, N, F);
    ops_cpu.swiglu_backward(ctx, dgu, dout, gu, N, F);
    check_close(t, "swiglu_backward dgu", dgu, grad, n_gu, BWD_TOL);
    SwigluFd fd = {.gu = gud, .R = R, .out = zero_doubles(n_out), .N = N, .F = F};
    check_fd(t, "swiglu dgu (fd)", gud, n_gu, grad, swiglu_loss, &fd);
    free(fd.out);
    free(gu), free(out), free(gud), free(out_ref), free(dout), free(dgu), free(R), free(grad);
    ops_cpu_destroy(ctx);
}

static void test_ops_add(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 10);
    const size_t n = 150001;  // several tasks, odd tail
    float* a = rand_floats(&r, n, 1.0f);
    float* b = rand_floats(&r, n, 1.0f);
    float* want = malloc_check(n * sizeof(float));
    for (size_t i = 0; i < n; i++) want[i] = a[i] + b[i];
    float* out = filled_floats(n, NAN);
    ops_cpu.add(ctx, out, a, b, n);
    CHECK(t, all_equal_bits(out, want, n * sizeof(float)), "add out = a + b");
    float* a2 = copy_floats(a, n);
    ops_cpu.add(ctx, a2, a2, b, n);
    CHECK(t, all_equal_bits(a2, want, n * sizeof(float)), "add with out aliasing a");
    float* b2 = copy_floats(b, n);
    ops_cpu.add(ctx, b2, a, b2, n);
    CHECK(t, all_equal_bits(b2, want, n * sizeof(float)), "add with out aliasing b");
    ops_cpu.add(ctx, out, a, b, 0);  // n = 0 is a no-op
    float* a3 = copy_floats(a, n);
    ops_cpu.add_f32(ctx, a3, b, n);
    CHECK(t, all_equal_bits(a3, want, n * sizeof(float)), "add_f32 dst += src");
    // scale (out = s · inp, in place) and copy_cols (a column range of N rows of width ld)
    float* a4 = copy_floats(a, n);
    ops_cpu.scale(ctx, a4, a4, 0.37f, n);
    int scaled = 1;
    for (size_t i = 0; i < n; i++) scaled &= a4[i] == 0.37f * a[i];
    CHECK(t, scaled, "scale out = s * inp (in place)");
    const int N = 301, ld = 500, c0 = 123, w = 77;
    float* cols = filled_floats((size_t)N * w, NAN);
    ops_cpu.copy_cols(ctx, cols, a, N, ld, c0, w);
    int copied = 1;
    for (int i = 0; i < N; i++)
        for (int j = 0; j < w; j++) copied &= cols[(size_t)i * w + j] == a[(size_t)i * ld + c0 + j];
    CHECK(t, copied, "copy_cols dst = src[:, c0:c0+w]");
    free(a4);
    free(cols);
    free(a3);
    free(a), free(b), free(want), free(out), free(a2), free(b2);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// cross-entropy

typedef struct XentFd {
    double* logits;
    const int32_t* targets;
    double* losses;
    int n, V;
    double scale;
} XentFd;

static double crossentropy_loss(void* arg) {
    XentFd* f = arg;
    ref_crossentropy(f->losses, NULL, f->logits, f->targets, f->n, f->V, f->scale);
    double L = 0.0;
    for (int i = 0; i < f->n; i++) L += f->losses[i] * f->scale;
    return L;
}

static void check_crossentropy(TestCtx* t, void* ctx, Rng* r, int n, int V, float logit_scale,
                               int with_fd) {
    char what[160];
    size_t nz = (size_t)n * V;
    int32_t* targets = malloc_check((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) targets[i] = (int32_t)rng_below(r, V);
    targets[1 % n] = -100;  // ignored positions
    if (n > 3) targets[3] = -1;
    targets[n - 1] = V - 1;
    const float scale = 0.37f;
    float* logits = rand_floats(r, nz, logit_scale);
    double* zd = to_doubles(logits, nz);
    double* loss_ref = zero_doubles(n);
    double* grad = zero_doubles(nz);
    ref_crossentropy(loss_ref, grad, zd, targets, n, V, scale);

    // Loss only: logits untouched.
    float* z0 = copy_floats(logits, nz);
    float* losses0 = filled_floats(n, NAN);
    ops_cpu.crossentropy_forward_backward(ctx, z0, losses0, targets, n, V, scale, 0);
    CHECK(t, all_equal_bits(z0, logits, nz * sizeof(float)), "compute_grad=0 keeps the logits");
    snprintf(what, sizeof what, "crossentropy n=%d V=%d losses", n, V);
    check_close(t, what, losses0, loss_ref, n, FWD_TOL);

    float* z = copy_floats(logits, nz);
    float* losses = filled_floats(n, NAN);
    ops_cpu.crossentropy_forward_backward(ctx, z, losses, targets, n, V, scale, 1);
    CHECK(t, all_equal_bits(losses, losses0, n * sizeof(float)),
          "losses independent of compute_grad");
    snprintf(what, sizeof what, "crossentropy n=%d V=%d dlogits", n, V);
    check_close(t, what, z, grad, nz, BWD_TOL);
    int ignored_zero = 1;
    for (int i = 0; i < n; i++)
        if (targets[i] < 0) {
            ignored_zero &= losses[i] == 0.0f;
            for (int j = 0; j < V; j++) ignored_zero &= z[(size_t)i * V + j] == 0.0f;
        }
    CHECK(t, ignored_zero, "ignored targets: loss 0 and zero gradient rows");
    if (with_fd) {
        XentFd fd = {.logits = zd, .targets = targets, .losses = zero_doubles(n), .n = n, .V = V,
                     .scale = scale};
        snprintf(what, sizeof what, "crossentropy n=%d V=%d dlogits (fd)", n, V);
        check_fd(t, what, zd, nz, grad, crossentropy_loss, &fd);
        free(fd.losses);
    }
    free(targets), free(logits), free(zd), free(loss_ref), free(grad), free(z0), free(losses0);
    free(z), free(losses);
}

static void test_ops_crossentropy(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 11);
    check_crossentropy(t, ctx, &r, 6, 37, 2.0f, 1);
    check_crossentropy(t, ctx, &r, 1, 1, 1.0f, 1);   // V = 1: loss 0, gradient 0
    check_crossentropy(t, ctx, &r, 9, 5003, 30.0f, 1);  // large logits need the max shift
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// thread-count independence

// Runs every op of interest on ctx; all outputs land in one buffer so a single memcmp compares.
typedef struct DetRun {
    float* mm_out;   // (N, OC)
    float* mm_dinp;  // (N, IC)
    float* mm_dw;    // (OC, IC)
    float* mm_db;    // (OC)
    float* att_out, *att_lse, *att_dqkv;
    float* rms_dinp, *rms_dw;
    float* emb_dwte;
    float* rope_dinp, *rope_dqw, *rope_dkw;
} DetRun;

typedef struct DetInputs {
    int N, IC, OC, V;
    Shape s;
    float *x, *w, *bias, *dy;        // matmul
    float *qkv, *att_dout;           // attention
    float *rms_w, *rms_rstd;         // rmsnorm, input x (N, IC), dout dinp-shaped
    int32_t* ids;                    // embedding
    float *rope_qw, *rope_kw, *cs, *sn, *rope_rstd;
} DetInputs;

static DetRun det_run(void* ctx, const DetInputs* in) {
    int N = in->N, IC = in->IC, OC = in->OC;
    Shape s = in->s;
    int Na = s.B * s.T;
    size_t n_qkv = (size_t)Na * shape_qkv(s), n_att = (size_t)Na * s.H * s.HD;
    DetRun d = {0};
    d.mm_out = filled_floats((size_t)N * OC, 0.0f);
    d.mm_dinp = filled_floats((size_t)N * IC, 0.0f);
    d.mm_dw = filled_floats((size_t)OC * IC, 0.25f);
    d.mm_db = filled_floats(OC, 0.25f);
    ops_cpu.matmul_forward(ctx, d.mm_out, in->x, in->w, in->bias, N, IC, OC);
    ops_cpu.matmul_backward(ctx, d.mm_dinp, d.mm_dw, d.mm_db, in->dy, in->x, in->w, N, IC, OC);
    d.att_out = filled_floats(n_att, 0.0f);
    d.att_lse = filled_floats((size_t)s.B * s.H * s.T, 0.0f);
    d.att_dqkv = filled_floats(n_qkv, 0.0f);
    ops_cpu.attention_forward(ctx, d.att_out, d.att_lse, in->qkv, s.B, s.T, s.H, s.KVH, s.HD);
    ops_cpu.attention_backward(ctx, d.att_dqkv, in->att_dout, in->qkv, d.att_out, d.att_lse, s.B,
                               s.T, s.H, s.KVH, s.HD);
    d.rms_dinp = filled_floats((size_t)N * IC, 0.5f);
    d.rms_dw = filled_floats(IC, 0.5f);
    ops_cpu.rmsnorm_backward(ctx, d.rms_dinp, d.rms_dw, in->x, in->x, in->rms_w, in->rms_rstd, N,
                             IC);
    d.emb_dwte = filled_floats((size_t)in->V * IC, 0.5f);
    ops_cpu.embedding_backward(ctx, d.emb_dwte, in->x, in->ids, N, IC, in->V);
    d.rope_dinp = filled_floats(n_qkv, 0.0f);
    d.rope_dqw = filled_floats(s.HD, 0.5f);
    d.rope_dkw = filled_floats(s.HD, 0.5f);
    ops_cpu.qknorm_rope_backward(ctx, d.rope_dinp, d.rope_dqw, d.rope_dkw, in->qkv, in->qkv,
                                 in->rope_qw, in->rope_kw, in->rope_rstd, in->cs, in->sn, s.B, s.T,
                                 s.H, s.KVH, s.HD);
    return d;
}

static void det_free(DetRun* d) {
    free(d->mm_out), free(d->mm_dinp), free(d->mm_dw), free(d->mm_db), free(d->att_out);
    free(d->att_lse), free(d->att_dqkv), free(d->rms_dinp), free(d->rms_dw), free(d->emb_dwte);
    free(d->rope_dinp), free(d->rope_dqw), free(d->rope_dkw);
}

static void test_ops_thread_count_independent(TestCtx* t) {
    Rng r;
    rng_seed(&r, 12);
    DetInputs in = {.N = TEST_SANITIZED ? 100 : 300, .IC = 259, .OC = 200, .V = 17,
                    .s = TEST_SANITIZED ? (Shape){2, 40, 4, 2, 16} : (Shape){2, 90, 4, 2, 32}};
    int N = in.N, IC = in.IC, OC = in.OC, Na = in.s.B * in.s.T;
    size_t n_qkv = (size_t)Na * shape_qkv(in.s), half = in.s.HD / 2;
    in.x = rand_floats(&r, (size_t)N * IC, 1.0f);
    in.w = rand_floats(&r, (size_t)OC * IC, 1.0f);
    in.bias = rand_floats(&r, OC, 1.0f);
    in.dy = rand_floats(&r, (size_t)N * OC, 1.0f);
    in.qkv = rand_floats(&r, n_qkv, 1.0f);
    in.att_dout = rand_floats(&r, (size_t)Na * in.s.H * in.s.HD, 1.0f);
    in.rms_w = rand_floats(&r, IC, 1.0f);
    in.rms_rstd = rand_floats(&r, N, 1.0f);
    in.ids = malloc_check((size_t)N * sizeof(int32_t));
    for (int n = 0; n < N; n++) in.ids[n] = (int32_t)rng_below(&r, in.V);
    in.rope_qw = rand_floats(&r, in.s.HD, 1.0f);
    in.rope_kw = rand_floats(&r, in.s.HD, 1.0f);
    in.cs = malloc_check(in.s.T * half * sizeof(float));
    in.sn = malloc_check(in.s.T * half * sizeof(float));
    rope_tables(in.cs, in.sn, in.s.T, in.s.HD);
    in.rope_rstd = rand_floats(&r, (size_t)Na * (in.s.H + in.s.KVH), 1.0f);

    void* ctx1 = ops_cpu_create(1);
    void* ctx3 = ops_cpu_create(3);
    DetRun a = det_run(ctx1, &in), b = det_run(ctx3, &in);
    size_t att = (size_t)Na * in.s.H * in.s.HD;
    CHECK(t, all_equal_bits(a.mm_out, b.mm_out, (size_t)N * OC * 4),
          "matmul_forward 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.mm_dinp, b.mm_dinp, (size_t)N * IC * 4),
          "matmul dinp 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.mm_dw, b.mm_dw, (size_t)OC * IC * 4), "matmul dw 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.mm_db, b.mm_db, (size_t)OC * 4), "matmul dbias 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.att_out, b.att_out, att * 4) &&
             all_equal_bits(a.att_lse, b.att_lse, (size_t)in.s.B * in.s.H * in.s.T * 4),
          "attention_forward 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.att_dqkv, b.att_dqkv, n_qkv * 4),
          "attention_backward 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.rms_dinp, b.rms_dinp, (size_t)N * IC * 4) &&
             all_equal_bits(a.rms_dw, b.rms_dw, (size_t)IC * 4), "rmsnorm_backward 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.emb_dwte, b.emb_dwte, (size_t)in.V * IC * 4),
          "embedding_backward 1 vs 3 threads");
    CHECK(t, all_equal_bits(a.rope_dinp, b.rope_dinp, n_qkv * 4) &&
             all_equal_bits(a.rope_dqw, b.rope_dqw, (size_t)in.s.HD * 4) &&
             all_equal_bits(a.rope_dkw, b.rope_dkw, (size_t)in.s.HD * 4),
          "qknorm_rope_backward 1 vs 3 threads");
    // A second run on the same context repeats itself exactly too.
    DetRun c = det_run(ctx3, &in);
    CHECK(t, all_equal_bits(c.mm_dw, b.mm_dw, (size_t)OC * IC * 4) &&
             all_equal_bits(c.att_dqkv, b.att_dqkv, n_qkv * 4), "repeat run on 3 threads");
    det_free(&a), det_free(&b), det_free(&c);
    ops_cpu_destroy(ctx1);
    ops_cpu_destroy(ctx3);
    free(in.x), free(in.w), free(in.bias), free(in.dy), free(in.qkv), free(in.att_dout);
    free(in.rms_w), free(in.rms_rstd), free(in.ids), free(in.rope_qw), free(in.rope_kw);
    free(in.cs), free(in.sn), free(in.rope_rstd);
}

// Two threads calling ops on one ctx at the same time get the same bits as calls in turn.
typedef struct ConcurrentJob {
    void* ctx;
    const DetInputs* in;
    DetRun run;
} ConcurrentJob;

static void* concurrent_job_main(void* arg) {
    ConcurrentJob* job = arg;
    job->run = det_run(job->ctx, job->in);
    return NULL;
}

static void test_ops_concurrent_callers(TestCtx* t) {
    Rng r;
    rng_seed(&r, 13);
    DetInputs in = {.N = 70, .IC = 45, .OC = 40, .V = 9, .s = (Shape){1, 40, 4, 2, 16}};
    int Na = in.s.B * in.s.T, half = in.s.HD / 2;
    size_t n_qkv = (size_t)Na * shape_qkv(in.s);
    in.x = rand_floats(&r, (size_t)in.N * in.IC, 1.0f);
    in.w = rand_floats(&r, (size_t)in.OC * in.IC, 1.0f);
    in.bias = rand_floats(&r, in.OC, 1.0f);
    in.dy = rand_floats(&r, (size_t)in.N * in.OC, 1.0f);
    in.qkv = rand_floats(&r, n_qkv, 1.0f);
    in.att_dout = rand_floats(&r, (size_t)Na * in.s.H * in.s.HD, 1.0f);
    in.rms_w = rand_floats(&r, in.IC, 1.0f);
    in.rms_rstd = rand_floats(&r, in.N, 1.0f);
    in.ids = malloc_check((size_t)in.N * sizeof(int32_t));
    for (int n = 0; n < in.N; n++) in.ids[n] = (int32_t)rng_below(&r, in.V);
    in.rope_qw = rand_floats(&r, in.s.HD, 1.0f);
    in.rope_kw = rand_floats(&r, in.s.HD, 1.0f);
    in.cs = malloc_check((size_t)in.s.T * half * sizeof(float));
    in.sn = malloc_check((size_t)in.s.T * half * sizeof(float));
    rope_tables(in.cs, in.sn, in.s.T, in.s.HD);
    in.rope_rstd = rand_floats(&r, (size_t)Na * (in.s.H + in.s.KVH), 1.0f);

    void* ctx = ops_cpu_create(t->n_threads);
    DetRun want = det_run(ctx, &in);
    ConcurrentJob jobs[2] = {{.ctx = ctx, .in = &in}, {.ctx = ctx, .in = &in}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        pthread_check(pthread_create(&th[i], NULL, concurrent_job_main, &jobs[i]));
    for (int i = 0; i < 2; i++) pthread_check(pthread_join(th[i], NULL));
    for (int i = 0; i < 2; i++) {
        DetRun* got = &jobs[i].run;
        CHECK(t, all_equal_bits(got->mm_out, want.mm_out, (size_t)in.N * in.OC * 4) &&
                     all_equal_bits(got->mm_dw, want.mm_dw, (size_t)in.OC * in.IC * 4) &&
                     all_equal_bits(got->att_dqkv, want.att_dqkv, n_qkv * 4) &&
                     all_equal_bits(got->emb_dwte, want.emb_dwte, (size_t)in.V * in.IC * 4) &&
                     all_equal_bits(got->rope_dinp, want.rope_dinp, n_qkv * 4),
              "caller thread %d differs from sequential calls", i);
        det_free(got);
    }
    det_free(&want);
    ops_cpu_destroy(ctx);
    free(in.x), free(in.w), free(in.bias), free(in.dy), free(in.qkv), free(in.att_dout);
    free(in.rms_w), free(in.rms_rstd), free(in.ids), free(in.rope_qw), free(in.rope_kw);
    free(in.cs), free(in.sn), free(in.rope_rstd);
}

// ----------------------------------------------------------------------------

const TestCase tests_ops[] = {
    {"ops_memory", test_ops_memory},
    {"ops_embedding", test_ops_embedding},
    {"ops_rmsnorm", test_ops_rmsnorm},
    {"ops_residual_rmsnorm", test_ops_residual_rmsnorm},
    {"ops_matmul", test_ops_matmul},
    {"ops_matmul_speed", test_ops_matmul_speed},
    {"ops_qknorm_rope", test_ops_qknorm_rope},
    {"ops_attention", test_ops_attention},
    {"ops_swiglu", test_ops_swiglu},
    {"ops_add", test_ops_add},
    {"ops_crossentropy", test_ops_crossentropy},
    {"ops_thread_count_independent", test_ops_thread_count_independent},
    {"ops_concurrent_callers", test_ops_concurrent_callers},
    {NULL, NULL},
};
