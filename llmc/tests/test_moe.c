/*
 * test_moe.c — mixture-of-experts and GPT-OSS attention on the CPU backend.
 *
 * Every new op against a naive double-precision reference written here (docs/FORMATS.md §8.3):
 * the fp32 forward against the double forward, the double reference's analytic backward against
 * central finite differences of the double forward (loss L = Σ out ∘ R), and
 * the fp32 backward against the double backward; outputs are pre-filled with NaN where the op
 * overwrites and with random values where it accumulates. Then the whole model of both families
 * (dense and MoE blocks, the aux loss, sinks, windows, YaRN, biases): finite-difference checks of
 * every tensor, the aux loss against a direct computation, recompute / thread-count bit
 * identity, and the loss = CE + weighted aux convention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../adamw.h"
#include "../checkpoint.h"
#include "../common.h"
#include "../gguf.h"
#include "../json.h"
#include "../model.h"
#include "../moe.h"
#include "../mxfp4.h"
#include "../ops.h"
#include "../plain.h"
#include "../rng.h"
#include "../store.h"
#include "testing.h"

#define FWD_TOL 2e-6
#define BWD_TOL 1e-5
#define FD_CHECKS 160

// ----------------------------------------------------------------------------
// helpers (the shared ones are in testing.h)

static double* zero_doubles(size_t n) { return calloc_check(n > 0 ? n : 1, sizeof(double)); }

typedef double (*LossFn)(void* arg);

// Central differences of loss w.r.t. evenly spaced elements of x against grad. skip (optional):
// elements where the loss is not differentiable (a clamp's bound) are not probed.
static void check_fd_skip(TestCtx* t, const char* what, double* x, size_t n, const double* grad,
                          LossFn loss, void* arg, const unsigned char* skip) {
    double gmax = 0.0;
    for (size_t i = 0; i < n; i++) gmax = fmax(gmax, fabs(grad[i]));
    size_t step = n <= FD_CHECKS ? 1 : (n + FD_CHECKS - 1) / FD_CHECKS;
    double worst = 0.0;
    size_t worst_i = 0;
    for (size_t i = (n - 1) % step; i < n; i += step) {
        if (skip && skip[i]) continue;
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
    CHECK(t, worst <= 1e-6 * fmax(gmax, 1e-3),
          "%s: finite differences differ by %.3g at %zu (gradient max %.3g)", what, worst, worst_i,
          gmax);
}

static void check_fd(TestCtx* t, const char* what, double* x, size_t n, const double* grad,
                     LossFn loss, void* arg) {
    check_fd_skip(t, what, x, n, grad, loss, arg, NULL);
}

// ----------------------------------------------------------------------------
// routing

// The K best of v (E), ties to the lower index.
static void ref_topk(int* idx, const double* v, int E, int K) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= idx[j] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        idx[k] = best;
    }
}

static void ref_softmax(double* p, const double* z, int E) {
    double mx = -INFINITY, s = 0.0;
    for (int e = 0; e < E; e++) mx = fmax(mx, z[e]);
    for (int e = 0; e < E; e++) s += exp(z[e] - mx);
    for (int e = 0; e < E; e++) p[e] = exp(z[e] - mx) / s;
}

// idx (n, K), w (n, K) from logits (n, E); returns nothing, HF's math in double.
static void ref_route(int* idx, double* w, const double* logits, int n, int E, int K, int mode) {
    double* p = malloc_check((size_t)E * sizeof(double));
    for (int i = 0; i < n; i++) {
        const double* z = logits + (size_t)i * E;
        int* id = idx + (size_t)i * K;
        double* wi = w + (size_t)i * K;
        if (mode == MOE_ROUTE_TOPK_SOFTMAX) {
            ref_topk(id, z, E, K);
            double s = 0.0;
            for (int k = 0; k < K; k++) s += exp(z[id[k]] - z[id[0]]);
            for (int k = 0; k < K; k++) wi[k] = exp(z[id[k]] - z[id[0]]) / s;
            continue;
        }
        ref_softmax(p, z, E);
        ref_topk(id, p, E, K);
        double s = 0.0;
        for (int k = 0; k < K; k++) s += p[id[k]];
        for (int k = 0; k < K; k++)
            wi[k] = mode == MOE_ROUTE_SOFTMAX_TOPK_NORM ? p[id[k]] / s : p[id[k]];
    }
    free(p);
}

typedef struct RouteFd {
    double* logits;
    const double* R;       // (n, K)
    const double* counts;  // (E)
    double aux_scale;
    int n, E, K, mode;
    int* idx;
    double* w;
} RouteFd;

// L = Σ w ∘ R + aux_scale Σ_e counts_e Σ_rows softmax(logits)_e (counts held fixed).
static double route_loss(void* arg) {
    RouteFd* f = arg;
    ref_route(f->idx, f->w, f->logits, f->n, f->E, f->K, f->mode);
    double L = dot_d(f->w, f->R, (size_t)f->n * f->K);
    double* p = malloc_check((size_t)f->E * sizeof(double));
    for (int i = 0; i < f->n; i++) {
        ref_softmax(p, f->logits + (size_t)i * f->E, f->E);
        L += f->aux_scale * dot_d(p, f->counts, (size_t)f->E);
    }
    free(p);
    return L;
}

// The analytic gradient of route_loss (see ops.h / ops_cpu.c).
static void ref_route_backward(double* dl, const double* logits, const double* R,
                               const double* counts, double aux_scale, int n, int E, int K,
                               int mode) {
    int* idx = malloc_check((size_t)K * sizeof(int));
    double* w = malloc_check((size_t)K * sizeof(double));
    double* p = malloc_check((size_t)E * sizeof(double));
    for (int i = 0; i < n; i++) {
        const double* z = logits + (size_t)i * E;
        double* d = dl + (size_t)i * E;
        const double* dw = R + (size_t)i * K;
        ref_route(idx, w, z, 1, E, K, mode);
        ref_softmax(p, z, E);
        double wdw = 0.0;
        for (int k = 0; k < K; k++) wdw += w[k] * dw[k];
        for (int e = 0; e < E; e++) d[e] = 0.0;
        if (mode == MOE_ROUTE_SOFTMAX_TOPK) {
            for (int e = 0; e < E; e++) d[e] = -p[e] * wdw;
            for (int k = 0; k < K; k++) d[idx[k]] += p[idx[k]] * dw[k];
        } else {
            for (int k = 0; k < K; k++) d[idx[k]] = w[k] * (dw[k] - wdw);
        }
        double cp = dot_d(counts, p, (size_t)E);
        for (int e = 0; e < E; e++) d[e] += aux_scale * p[e] * (counts[e] - cp);
    }
    free(idx);
    free(w);
    free(p);
}

static void test_moe_route(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 31);
    const int n = 11, E = 8, K = 3;
    const char* names[3] = {"softmax-topk", "softmax-topk-norm", "topk-softmax"};
    for (int mode = 0; mode < 3; mode++) {
        float* logits = rand_floats(&r, (size_t)n * E, 1.5f);
        // a tie between experts 2 and 5 for first place, and between 1, 4 and 6 for the rest
        for (int e = 0; e < E; e++) logits[e] = -1.0f - 0.1f * e;
        logits[2] = logits[5] = 3.0f;
        logits[1] = logits[4] = logits[6] = 1.0f;
        int32_t* idx = malloc_check((size_t)n * K * sizeof(int32_t));
        float* w = filled_floats((size_t)n * K, NAN);
        ops_cpu.moe_route_forward(ctx, idx, w, logits, n, E, K, mode);
        double* ld = to_doubles(logits, (size_t)n * E);
        int* idx_ref = malloc_check((size_t)n * K * sizeof(int));
        double* w_ref = zero_doubles((size_t)n * K);
        ref_route(idx_ref, w_ref, ld, n, E, K, mode);
        int same = 1;
        for (int i = 0; i < n * K; i++) same &= idx[i] == idx_ref[i];
        CHECK(t, same, "%s: expert choices differ from the reference", names[mode]);
        CHECK(t, idx[0] == 2 && idx[1] == 5 && idx[2] == 1, "%s: ties go to the lower index: %d %d %d",
              names[mode], idx[0], idx[1], idx[2]);
        check_close(t, names[mode], w, w_ref, (size_t)n * K, FWD_TOL);

        // backward with the aux term (rows 1.. only: row 0's ties are not differentiable)
        const int m = n - 1;
        float* dw = rand_floats(&r, (size_t)m * K, 1.0f);
        float* counts = rand_floats(&r, (size_t)E, 3.0f);
        const float aux_scale = 0.7f;
        float* dl = filled_floats((size_t)m * E, NAN);
        ops_cpu.moe_route_backward(ctx, dl, dw, logits + E, idx + K, w + K, counts, aux_scale, m,
                                   E, K, mode);
        double* R = to_doubles(dw, (size_t)m * K);
        double* cd = to_doubles(counts, (size_t)E);
        double* dl_ref = zero_doubles((size_t)m * E);
        ref_route_backward(dl_ref, ld + E, R, cd, aux_scale, m, E, K, mode);
        check_close(t, names[mode], dl, dl_ref, (size_t)m * E, BWD_TOL);
        RouteFd fd = {.logits = ld + E, .R = R, .counts = cd, .aux_scale = aux_scale, .n = m,
                      .E = E, .K = K, .mode = mode,
                      .idx = malloc_check((size_t)m * K * sizeof(int)),
                      .w = zero_doubles((size_t)m * K)};
        check_fd(t, names[mode], ld + E, (size_t)m * E, dl_ref, route_loss, &fd);
        // without the aux term nothing reaches unchosen experts in the renormalised modes
        ops_cpu.moe_route_backward(ctx, dl, dw, logits + E, idx + K, w + K, counts, 0.0f, m, E, K,
                                   mode);
        int zero_elsewhere = 1;
        for (int i = 0; i < m && mode != MOE_ROUTE_SOFTMAX_TOPK; i++)
            for (int e = 0; e < E; e++) {
                int chosen = 0;
                for (int k = 0; k < K; k++) chosen |= idx[(size_t)(i + 1) * K + k] == e;
                if (!chosen) zero_elsewhere &= dl[(size_t)i * E + e] == 0.0f;
            }
        CHECK(t, zero_elsewhere, "%s: gradient on unchosen experts", names[mode]);
        free(fd.idx), free(fd.w);
        free(logits), free(idx), free(w), free(ld), free(idx_ref), free(w_ref), free(dw);
        free(counts), free(dl), free(R), free(cd), free(dl_ref);
    }
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// dispatch, gather, combine, statistics

static void test_moe_dispatch_combine(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 32);
    const int n = 13, E = 6, K = 2, C = 19, R = n * K;
    // expert 4 gets nothing; every row a distinct pair
    int32_t* idx = malloc_check((size_t)R * sizeof(int32_t));
    for (int i = 0; i < n; i++) {
        int a = (int)rng_below(&r, 5), b = (a + 1 + (int)rng_below(&r, 4)) % 5;
        if (a == 4) a = 5;
        if (b == 4) b = 5;
        if (a == b) b = (a + 1) % 4;
        idx[i * K] = a;
        idx[i * K + 1] = b;
    }
    int32_t offsets[7], *src = malloc_check((size_t)R * 4), *dst = malloc_check((size_t)R * 4);
    ops_cpu.moe_dispatch(ctx, offsets, src, dst, idx, n, E, K);
    int ok = offsets[0] == 0 && offsets[E] == R && offsets[5] == offsets[4];
    for (int i = 0; i < R; i++) {
        ok &= src[dst[i]] == i;
        ok &= dst[i] >= offsets[idx[i]] && dst[i] < offsets[idx[i] + 1];
    }
    for (int p = 1; p < R; p++)  // stable: inside an expert, assignments in order
        if (idx[src[p]] == idx[src[p - 1]]) ok &= src[p] > src[p - 1];
    CHECK(t, ok, "dispatch: offsets, inverse, stability");

    float* x = rand_floats(&r, (size_t)n * C, 1.0f);
    float* xp = filled_floats((size_t)R * C, NAN);
    ops_cpu.moe_gather(ctx, xp, x, src, n, K, C);
    int exact = 1;
    for (int p = 0; p < R; p++)
        exact &= memcmp(xp + (size_t)p * C, x + (size_t)(src[p] / K) * C, (size_t)C * 4) == 0;
    CHECK(t, exact, "gather copies rows");
    float* dxp = rand_floats(&r, (size_t)R * C, 1.0f);
    float* dx = filled_floats((size_t)n * C, NAN);
    ops_cpu.moe_gather_backward(ctx, dx, dxp, dst, n, K, C);
    double* dx_ref = zero_doubles((size_t)n * C);
    for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++) dx_ref[(size_t)(i / K) * C + c] += dxp[(size_t)dst[i] * C + c];
    check_close(t, "gather backward", dx, dx_ref, (size_t)n * C, FWD_TOL);

    // combine: out = Σ_k w y[dst]; dy = w dout; dw = dout · y
    float* y = rand_floats(&r, (size_t)R * C, 1.0f);
    float* w = rand_floats(&r, (size_t)R, 0.5f);
    float* out = filled_floats((size_t)n * C, NAN);
    ops_cpu.moe_combine_forward(ctx, out, y, w, dst, n, K, C);
    double* out_ref = zero_doubles((size_t)n * C);
    for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++)
            out_ref[(size_t)(i / K) * C + c] += (double)w[i] * y[(size_t)dst[i] * C + c];
    check_close(t, "combine forward", out, out_ref, (size_t)n * C, FWD_TOL);
    float* dout = rand_floats(&r, (size_t)n * C, 1.0f);
    float* dy = filled_floats((size_t)R * C, NAN);
    float* dw = filled_floats((size_t)R, NAN);
    ops_cpu.moe_combine_backward(ctx, dy, dw, dout, y, w, dst, n, K, C);
    double* dy_ref = zero_doubles((size_t)R * C);
    double* dw_ref = zero_doubles((size_t)R);
    for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++) {
            dy_ref[(size_t)dst[i] * C + c] = (double)w[i] * dout[(size_t)(i / K) * C + c];
            dw_ref[i] += (double)dout[(size_t)(i / K) * C + c] * y[(size_t)dst[i] * C + c];
        }
    check_close(t, "combine backward dy", dy, dy_ref, (size_t)R * C, BWD_TOL);
    check_close(t, "combine backward dweights", dw, dw_ref, (size_t)R, BWD_TOL);

    // statistics: counts from the offsets, Σ_rows softmax
    float* logits = rand_floats(&r, (size_t)n * E, 2.0f);
    float stats[12];
    ops_cpu.moe_router_stats(ctx, stats, logits, offsets, n, E);
    double want[12] = {0}, p[6];
    double* ld = to_doubles(logits, (size_t)n * E);
    for (int i = 0; i < n; i++) {
        ref_softmax(p, ld + (size_t)i * E, E);
        for (int e = 0; e < E; e++) want[E + e] += p[e];
    }
    for (int e = 0; e < E; e++) want[e] = offsets[e + 1] - offsets[e];
    check_close(t, "router stats", stats, want, 12, FWD_TOL);
    free(idx), free(src), free(dst), free(x), free(xp), free(dxp), free(dx), free(dx_ref);
    free(y), free(w), free(out), free(out_ref), free(dout), free(dy), free(dw), free(dy_ref);
    free(dw_ref), free(logits), free(ld);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// grouped matmul

typedef struct GmmCase {
    const int32_t* offsets;
    int R, E, IC, OC, w_in_out;
} GmmCase;

static double ref_w(const double* w, const GmmCase* g, int e, int o, int i) {
    return g->w_in_out ? w[((size_t)e * g->IC + i) * g->OC + o] : w[((size_t)e * g->OC + o) * g->IC + i];
}

static void ref_gmm_forward(double* out, const double* x, const double* w, const double* b,
                            const GmmCase* g) {
    for (int e = 0; e < g->E; e++)
        for (int r = g->offsets[e]; r < g->offsets[e + 1]; r++)
            for (int o = 0; o < g->OC; o++) {
                double s = b ? b[(size_t)e * g->OC + o] : 0.0;
                for (int i = 0; i < g->IC; i++) s += x[(size_t)r * g->IC + i] * ref_w(w, g, e, o, i);
                out[(size_t)r * g->OC + o] = s;
            }
}

typedef struct GmmFd {
    double *x, *w, *b;
    const double* R;
    double* out;
    const GmmCase* g;
} GmmFd;

static double gmm_loss(void* arg) {
    GmmFd* f = arg;
    ref_gmm_forward(f->out, f->x, f->w, f->b, f->g);
    return dot_d(f->out, f->R, (size_t)f->g->R * f->g->OC);
}

static void gmm_case(TestCtx* t, void* ctx, Rng* r, int w_in_out) {
    const int E = 4, IC = 21, OC = 35;
    const int32_t offsets[5] = {0, 7, 7, 16, 23};  // expert 1 has no rows
    GmmCase g = {offsets, 23, E, IC, OC, w_in_out};
    const size_t nx = (size_t)g.R * IC, nw = (size_t)E * IC * OC, nb = (size_t)E * OC,
                 no = (size_t)g.R * OC;
    float* x = rand_floats(r, nx, 1.0f);
    float* w = rand_floats(r, nw, 0.3f);
    float* b = rand_floats(r, nb, 0.5f);
    float* out = filled_floats(no, NAN);
    ops_cpu.moe_matmul_forward(ctx, out, x, w, b, offsets, g.R, E, IC, OC, w_in_out);
    double *xd = to_doubles(x, nx), *wd = to_doubles(w, nw), *bd = to_doubles(b, nb);
    double* out_ref = zero_doubles(no);
    ref_gmm_forward(out_ref, xd, wd, bd, &g);
    check_close(t, w_in_out ? "grouped matmul x·W" : "grouped matmul x·Wᵀ", out, out_ref, no, FWD_TOL);

    float* dout = rand_floats(r, no, 1.0f);
    float* dx = filled_floats(nx, NAN);
    float* dw0 = rand_floats(r, nw, 1.0f);  // accumulated into
    float* db0 = rand_floats(r, nb, 1.0f);
    float* dw = malloc_check(nw * 4);
    float* db = malloc_check(nb * 4);
    memcpy(dw, dw0, nw * 4);
    memcpy(db, db0, nb * 4);
    ops_cpu.moe_matmul_backward(ctx, dx, dw, db, dout, x, w, offsets, g.R, E, IC, OC, w_in_out);
    double* Rd = to_doubles(dout, no);
    double *dx_ref = zero_doubles(nx), *dw_ref = to_doubles(dw0, nw), *db_ref = to_doubles(db0, nb);
    for (int e = 0; e < E; e++)
        for (int rr = offsets[e]; rr < offsets[e + 1]; rr++)
            for (int o = 0; o < OC; o++) {
                const double go = Rd[(size_t)rr * OC + o];
                db_ref[(size_t)e * OC + o] += go;
                for (int i = 0; i < IC; i++) {
                    dx_ref[(size_t)rr * IC + i] += go * ref_w(wd, &g, e, o, i);
                    size_t wi = w_in_out ? ((size_t)e * IC + i) * OC + o : ((size_t)e * OC + o) * IC + i;
                    dw_ref[wi] += go * xd[(size_t)rr * IC + i];
                }
            }
    check_close(t, "grouped matmul dx", dx, dx_ref, nx, BWD_TOL);
    check_close(t, "grouped matmul dw", dw, dw_ref, nw, BWD_TOL);
    check_close(t, "grouped matmul dbias", db, db_ref, nb, BWD_TOL);
    // finite differences of the analytic gradients (the accumulated part removed)
    for (size_t i = 0; i < nw; i++) dw_ref[i] -= dw0[i];
    for (size_t i = 0; i < nb; i++) db_ref[i] -= db0[i];
    GmmFd fd = {xd, wd, bd, Rd, zero_doubles(no), &g};
    check_fd(t, "grouped matmul dx (fd)", xd, nx, dx_ref, gmm_loss, &fd);
    check_fd(t, "grouped matmul dw (fd)", wd, nw, dw_ref, gmm_loss, &fd);
    check_fd(t, "grouped matmul dbias (fd)", bd, nb, db_ref, gmm_loss, &fd);
    free(fd.out);
    free(x), free(w), free(b), free(out), free(xd), free(wd), free(bd), free(out_ref);
    free(dout), free(dx), free(dw0), free(db0), free(dw), free(db), free(Rd), free(dx_ref);
    free(dw_ref), free(db_ref);
}

static void test_moe_grouped_matmul(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 33);
    gmm_case(t, ctx, &r, 0);
    gmm_case(t, ctx, &r, 1);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// GPT-OSS clamped GLU

static void ref_glu_forward(double* out, const double* gu, int R, int F, double lim, double alpha) {
    for (int r = 0; r < R; r++)
        for (int i = 0; i < F; i++) {
            double g = fmin(gu[(size_t)r * 2 * F + 2 * i], lim);
            double u = fmax(fmin(gu[(size_t)r * 2 * F + 2 * i + 1], lim), -lim);
            out[(size_t)r * F + i] = (u + 1.0) * g / (1.0 + exp(-alpha * g));
        }
}

typedef struct GluFd {
    double* gu;
    const double* R;
    double* out;
    int n, F;
    double lim, alpha;
} GluFd;

static double glu_loss(void* arg) {
    GluFd* f = arg;
    ref_glu_forward(f->out, f->gu, f->n, f->F, f->lim, f->alpha);
    return dot_d(f->out, f->R, (size_t)f->n * f->F);
}

static void test_moe_gptoss_glu(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 34);
    const int R = 9, F = 23;
    const float lim = 2.5f, alpha = 1.702f;
    const size_t ngu = (size_t)R * 2 * F, no = (size_t)R * F;
    float* gu = rand_floats(&r, ngu, 2.5f);  // about a third beyond the clamps
    float* out = filled_floats(no, NAN);
    ops_cpu.gptoss_glu_forward(ctx, out, gu, R, F, lim, alpha);
    double* gud = to_doubles(gu, ngu);
    double* out_ref = zero_doubles(no);
    ref_glu_forward(out_ref, gud, R, F, lim, alpha);
    check_close(t, "gptoss glu forward", out, out_ref, no, FWD_TOL);
    float* dout = rand_floats(&r, no, 1.0f);
    float* dgu = filled_floats(ngu, NAN);
    ops_cpu.gptoss_glu_backward(ctx, dgu, dout, gu, R, F, lim, alpha);
    double* Rd = to_doubles(dout, no);
    double* dgu_ref = zero_doubles(ngu);
    unsigned char* skip = calloc_check(ngu, 1);
    int clamped = 0;
    for (int rr = 0; rr < R; rr++)
        for (int i = 0; i < F; i++) {
            size_t ig = (size_t)rr * 2 * F + 2 * i;
            double gate = gud[ig], up = gud[ig + 1], dy = Rd[(size_t)rr * F + i];
            double g = fmin(gate, lim), u = fmax(fmin(up, lim), -lim);
            double sg = 1.0 / (1.0 + exp(-alpha * g));
            dgu_ref[ig] = gate <= lim ? dy * (u + 1.0) * (sg + alpha * g * sg * (1.0 - sg)) : 0.0;
            dgu_ref[ig + 1] = fabs(up) <= lim ? dy * g * sg : 0.0;
            clamped += gate > lim || fabs(up) > lim;
            skip[ig] = fabs(gate - lim) < 1e-3;
            skip[ig + 1] = fabs(fabs(up) - lim) < 1e-3;
        }
    CHECK(t, clamped > R * F / 8, "the case exercises the clamps (%d of %d)", clamped, R * F);
    check_close(t, "gptoss glu backward", dgu, dgu_ref, ngu, BWD_TOL);
    GluFd fd = {gud, Rd, zero_doubles(no), R, F, lim, alpha};
    check_fd_skip(t, "gptoss glu (fd)", gud, ngu, dgu_ref, glu_loss, &fd, skip);
    free(fd.out), free(skip);
    free(gu), free(out), free(gud), free(out_ref), free(dout), free(dgu), free(Rd), free(dgu_ref);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// attention with sinks and windows

typedef struct SinkShape {
    int B, T, H, KVH, HD, window;
} SinkShape;

static const double* sq(const double* qkv, const SinkShape* s, int b, int t, int head) {
    return qkv + (size_t)(b * s->T + t) * (s->H + 2 * s->KVH) * s->HD + (size_t)head * s->HD;
}

// out (N, H*HD) and lse with HF's eager sink attention (concatenate the sink logit, softmax,
// drop it); sinks NULL: none.
static void ref_sink_forward(double* out, double* lse, const double* qkv, const double* sinks,
                             const SinkShape* s) {
    const double scale = 1.0 / sqrt((double)s->HD);
    double* a = malloc_check((size_t)(s->T + 1) * sizeof(double));
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->H; h++) {
            const int g = h / (s->H / s->KVH);
            for (int t = 0; t < s->T; t++) {
                const int j0 = s->window > 0 && t - s->window + 1 > 0 ? t - s->window + 1 : 0;
                double m = sinks ? sinks[h] : -INFINITY, sum = 0.0;
                for (int j = j0; j <= t; j++) {
                    a[j] = dot_d(sq(qkv, s, b, t, h), sq(qkv, s, b, j, s->H + g), (size_t)s->HD) * scale;
                    m = fmax(m, a[j]);
                }
                if (sinks) sum += exp(sinks[h] - m);
                for (int j = j0; j <= t; j++) sum += exp(a[j] - m);
                double* o = out + (size_t)(b * s->T + t) * s->H * s->HD + (size_t)h * s->HD;
                for (int d = 0; d < s->HD; d++) o[d] = 0.0;
                for (int j = j0; j <= t; j++) {
                    const double p = exp(a[j] - m) / sum;
                    const double* v = sq(qkv, s, b, j, s->H + s->KVH + g);
                    for (int d = 0; d < s->HD; d++) o[d] += p * v[d];
                }
                if (lse) lse[((size_t)b * s->H + h) * s->T + t] = m + log(sum);
            }
        }
    free(a);
}

typedef struct SinkFd {
    double *qkv, *sinks, *out;
    const double* R;
    const SinkShape* s;
} SinkFd;

static double sink_loss(void* arg) {
    SinkFd* f = arg;
    ref_sink_forward(f->out, NULL, f->qkv, f->sinks, f->s);
    return dot_d(f->out, f->R, (size_t)f->s->B * f->s->T * f->s->H * f->s->HD);
}

static void ref_sink_backward(double* dqkv, double* dsinks, const double* dout, const double* qkv,
                              const double* sinks, const SinkShape* s) {
    const double scale = 1.0 / sqrt((double)s->HD);
    const int QKV = (s->H + 2 * s->KVH) * s->HD;
    double* a = malloc_check((size_t)s->T * sizeof(double));
    double* dp = malloc_check((size_t)s->T * sizeof(double));
    memset(dqkv, 0, (size_t)s->B * s->T * QKV * sizeof(double));
    for (int b = 0; b < s->B; b++)
        for (int h = 0; h < s->H; h++) {
            const int g = h / (s->H / s->KVH);
            for (int t = 0; t < s->T; t++) {
                const int j0 = s->window > 0 && t - s->window + 1 > 0 ? t - s->window + 1 : 0;
                const double* q = sq(qkv, s, b, t, h);
                double m = sinks ? sinks[h] : -INFINITY, sum = 0.0;
                for (int j = j0; j <= t; j++) {
                    a[j] = dot_d(q, sq(qkv, s, b, j, s->H + g), (size_t)s->HD) * scale;
                    m = fmax(m, a[j]);
                }
                if (sinks) sum += exp(sinks[h] - m);
                for (int j = j0; j <= t; j++) sum += exp(a[j] - m);
                const double* dO = dout + (size_t)(b * s->T + t) * s->H * s->HD + (size_t)h * s->HD;
                double D = 0.0;  // dO · o
                for (int j = j0; j <= t; j++) {
                    dp[j] = dot_d(dO, sq(qkv, s, b, j, s->H + s->KVH + g), (size_t)s->HD);
                    D += exp(a[j] - m) / sum * dp[j];
                }
                if (sinks) dsinks[h] -= exp(sinks[h] - m) / sum * D;
                double* dq = dqkv + (size_t)(b * s->T + t) * QKV + (size_t)h * s->HD;
                for (int j = j0; j <= t; j++) {
                    const double p = exp(a[j] - m) / sum, ds = p * (dp[j] - D);
                    const double* k = sq(qkv, s, b, j, s->H + g);
                    double* dk = dqkv + (size_t)(b * s->T + j) * QKV + (size_t)(s->H + g) * s->HD;
                    double* dv = dk + (size_t)s->KVH * s->HD;
                    for (int d = 0; d < s->HD; d++) {
                        dq[d] += ds * k[d] * scale;
                        dk[d] += ds * q[d] * scale;
                        dv[d] += p * dO[d];
                    }
                }
            }
        }
    free(a);
    free(dp);
}

static void sink_case(TestCtx* t, void* ctx, Rng* r, SinkShape s, int with_sinks) {
    char what[96];
    snprintf(what, sizeof what, "sink attention T %d W %d %s", s.T, s.window,
             with_sinks ? "sinks" : "no sinks");
    const int QKV = (s.H + 2 * s.KVH) * s.HD;
    const size_t nq = (size_t)s.B * s.T * QKV, no = (size_t)s.B * s.T * s.H * s.HD,
                 nl = (size_t)s.B * s.H * s.T;
    float* qkv = rand_floats(r, nq, 1.0f);
    float* sinks = with_sinks ? rand_floats(r, (size_t)s.H, 1.5f) : NULL;
    float* out = filled_floats(no, NAN);
    float* lse = filled_floats(nl, NAN);
    ops_cpu.attention_sink_forward(ctx, out, lse, qkv, sinks, s.B, s.T, s.H, s.KVH, s.HD, s.window);
    double* qd = to_doubles(qkv, nq);
    double* sd = with_sinks ? to_doubles(sinks, (size_t)s.H) : NULL;
    double* out_ref = zero_doubles(no);
    double* lse_ref = zero_doubles(nl);
    ref_sink_forward(out_ref, lse_ref, qd, sd, &s);
    check_close(t, what, out, out_ref, no, FWD_TOL);
    check_close(t, what, lse, lse_ref, nl, FWD_TOL);
    float* dout = rand_floats(r, no, 1.0f);
    float* dqkv = filled_floats(nq, NAN);
    float* dsinks0 = rand_floats(r, (size_t)s.H, 1.0f);
    float* dsinks = malloc_check((size_t)s.H * 4);
    memcpy(dsinks, dsinks0, (size_t)s.H * 4);
    ops_cpu.attention_sink_backward(ctx, dqkv, with_sinks ? dsinks : NULL, dout, qkv, out, lse,
                                    sinks, s.B, s.T, s.H, s.KVH, s.HD, s.window);
    double* Rd = to_doubles(dout, no);
    double* dq_ref = zero_doubles(nq);
    double* ds_ref = zero_doubles((size_t)s.H);
    ref_sink_backward(dq_ref, ds_ref, Rd, qd, sd, &s);
    check_close(t, what, dqkv, dq_ref, nq, BWD_TOL);
    SinkFd fd = {qd, sd, zero_doubles(no), Rd, &s};
    check_fd(t, what, qd, nq, dq_ref, sink_loss, &fd);
    if (with_sinks) {
        for (int h = 0; h < s.H; h++) dsinks[h] -= dsinks0[h];
        check_close(t, what, dsinks, ds_ref, (size_t)s.H, BWD_TOL);
        check_fd(t, what, sd, (size_t)s.H, ds_ref, sink_loss, &fd);
    }
    free(fd.out);
    free(qkv), free(sinks), free(out), free(lse), free(qd), free(sd), free(out_ref), free(lse_ref);
    free(dout), free(dqkv), free(dsinks0), free(dsinks), free(Rd), free(dq_ref), free(ds_ref);
}

static void test_moe_sink_attention(TestCtx* t) {
    void* ctx = ops_cpu_create(t->n_threads);
    Rng r;
    rng_seed(&r, 35);
    sink_case(t, ctx, &r, (SinkShape){2, 11, 4, 2, 8, 4}, 1);   // window < T, GQA
    sink_case(t, ctx, &r, (SinkShape){1, 9, 2, 1, 16, 0}, 1);   // full causal with sinks
    sink_case(t, ctx, &r, (SinkShape){2, 7, 4, 4, 8, 3}, 0);    // window only
    sink_case(t, ctx, &r, (SinkShape){1, 5, 2, 2, 8, 16}, 1);   // window > T
    // no sinks, no window: the flash attention's results
    SinkShape s = {2, 40, 4, 2, 16, 0};
    const int QKV = (s.H + 2 * s.KVH) * s.HD;
    const size_t nq = (size_t)s.B * s.T * QKV, no = (size_t)s.B * s.T * s.H * s.HD;
    float* qkv = rand_floats(&r, nq, 1.0f);
    float *o1 = malloc_check(no * 4), *o2 = malloc_check(no * 4);
    float *l1 = malloc_check((size_t)s.B * s.H * s.T * 4), *l2 = malloc_check((size_t)s.B * s.H * s.T * 4);
    ops_cpu.attention_forward(ctx, o1, l1, qkv, s.B, s.T, s.H, s.KVH, s.HD);
    ops_cpu.attention_sink_forward(ctx, o2, l2, qkv, NULL, s.B, s.T, s.H, s.KVH, s.HD, 0);
    CHECK(t, rel_l2_error(o2, o1, no) < 1e-6, "plain case = flash attention: %.3g",
          rel_l2_error(o2, o1, no));
    free(qkv), free(o1), free(o2), free(l1), free(l2);
    ops_cpu_destroy(ctx);
}

// ----------------------------------------------------------------------------
// the whole model

typedef struct MoeFixture {
    Model m;
    Store s;
    void* ctx;
    Plain* p;
    int B, T;
    int32_t* tokens;
} MoeFixture;

// Small MoE models for finite differences: 8 experts, top-2; Qwen3-MoE with one dense block
// (mlp_only_layers), GPT-OSS with a window of 3 < T, sinks, YaRN, biases, a low clamp.
static ModelConfig moe_config(ModelFamily fam, int norm_topk, double aux_coef) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, fam == FAMILY_GPTOSS ? "test-gptoss" : "test-qwen3moe", err);
    c.V = 37;
    c.C = 24;
    c.H = 4;
    c.KVH = 2;
    c.HD = 8;
    c.F = 28;
    c.F_expert = 12;
    c.E = 8;
    c.K = 2;
    c.norm_topk_prob = norm_topk;
    c.router_aux_loss_coef = aux_coef;
    c.output_router_logits = aux_coef > 0;
    if (fam == FAMILY_GPTOSS) {
        c.L = 2;
        c.sliding_window = 3;
        c.swiglu_limit = 1.5f;
        c.F = c.F_expert;
    } else {
        c.L = 3;  // block 1 dense (the preset's mlp_only_layers)
    }
    return c;
}

static void moe_fixture_init(MoeFixture* f, const ModelConfig* c, int B, int T, int threads,
                             int recompute, uint32_t seed) {
    char err[ERR_LEN];
    memset(f, 0, sizeof *f);
    if (model_init(&f->m, c, 0, err) != 0) fatal("model_init: %s", err);
    store_create(&f->s, &f->m.tt);
    store_init_random(&f->s, seed, 0.3f);
    Rng r;
    rng_seed(&r, seed + 1);
    for (int i = 0; i < f->m.tt.n; i++) {
        const TensorDesc* d = &f->m.tt.t[i];
        if (d->tied_to >= 0 || d->ndim != 1) continue;
        float* p = store_param(&f->s, i);
        const int norm = d->kind == TK_ATTN_NORM || d->kind == TK_MLP_NORM ||
                         d->kind == TK_FINAL_NORM || d->kind == TK_Q_NORM || d->kind == TK_K_NORM;
        for (int64_t j = 0; j < d->numel; j++)
            p[j] = norm ? 1.0f + 0.2f * rng_normal(&r) : 0.3f * rng_normal(&r);
    }
    // a router scale that spreads the probabilities (routing far from ties)
    for (int i = 0; i < f->m.tt.n; i++)
        if (f->m.tt.t[i].kind == TK_ROUTER) {
            float* p = store_param(&f->s, i);
            for (int64_t j = 0; j < f->m.tt.t[i].numel; j++) p[j] *= 3.0f;
        }
    f->ctx = ops_cpu_create(threads);
    f->p = plain_create(&f->m, &f->s, &ops_cpu, f->ctx, B, T, recompute);
    f->B = B;
    f->T = T;
    f->tokens = malloc_check((size_t)B * (T + 1) * sizeof(int32_t));
    for (int i = 0; i < B * (T + 1); i++) f->tokens[i] = (int32_t)rng_below(&r, (uint64_t)c->V);
}

static void moe_fixture_free(MoeFixture* f) {
    plain_free(f->p);
    ops_cpu_destroy(f->ctx);
    store_free(&f->s);
    model_free(&f->m);
    free(f->tokens);
}

static double moe_grads(MoeFixture* f) {
    const double N = (double)f->B * f->T;
    store_zero_grads(&f->s);
    double loss = plain_forward_backward(f->p, f->tokens, f->B, f->T, (float)(1.0 / N)) / N;
    store_fold_tied_grads(&f->s);
    return loss;
}

// The objective without gradients: a forward-backward into a scratch copy of the gradients
// would also do, but the forward and the aux loss are all that is needed.
static double moe_objective(MoeFixture* f) {
    const double N = (double)f->B * f->T;
    double ce = plain_forward_loss(f->p, f->tokens, f->B, f->T) / N;
    double aux = model_moe_aux(&f->m, f->p->ws, f->B, f->T, 1.0f);
    return ce + model_aux_weight(&f->m) * aux;
}

// Every MoE block's set of chosen experts per row after the last forward (n_moe * B*T*K, each
// row's K ids sorted: the order inside the top K is continuous, the set is not).
static int32_t* routing_snapshot(const MoeFixture* f) {
    const int K = f->m.cfg.K;
    const int64_t n = (int64_t)f->B * f->T * K;
    int32_t* out = malloc_check((size_t)(f->m.n_moe > 0 ? f->m.n_moe : 1) * (size_t)n * 4);
    for (int l = 0, k = 0; l < f->m.cfg.L; l++) {
        if (!f->m.layout[l].moe) continue;
        int32_t* o = out + (size_t)(k++) * n;
        memcpy(o, f->p->ws->acts[l].moe.idx, (size_t)n * 4);
        for (int64_t r = 0; r < n; r += K)
            for (int a = 0; a < K; a++)
                for (int b = a + 1; b < K; b++)
                    if (o[r + b] < o[r + a]) {
                        int32_t tmp = o[r + a];
                        o[r + a] = o[r + b];
                        o[r + b] = tmp;
                    }
    }
    return out;
}

// For every tensor, the directional derivative along d (mostly along the gradient) by central
// differences must match g·d. A probe whose ± evaluations route differently from the point
// itself is skipped (top-k is discontinuous there): the case is built so that almost none are.
static void moe_gradcheck(TestCtx* t, const ModelConfig* c, const char* what) {
    MoeFixture f;
    moe_fixture_init(&f, c, 2, 7, t->n_threads, 0, 17);
    moe_grads(&f);
    moe_objective(&f);
    int32_t* base = routing_snapshot(&f);
    const size_t rbytes = (size_t)f.m.n_moe * f.B * f.T * c->K * 4;
    Rng r;
    rng_seed(&r, 99);
    int probes = 0, skipped = 0;
    for (int i = 0; i < f.m.tt.n; i++) {
        const TensorDesc* d = &f.m.tt.t[i];
        if (d->tied_to >= 0) continue;
        const int64_t n = d->numel;
        float* p = store_param(&f.s, i);
        const float* g = store_grad(&f.s, i);
        const double gnorm = test_gradient_norm(g, n);
        CHECK(t, gnorm > 0 && isfinite(gnorm), "%s %s: gradient norm %g", what, d->name, gnorm);
        double analytic;
        double* dir = test_probe_direction(&r, g, n, gnorm, &analytic);
        float* saved = malloc_check((size_t)n * sizeof(float));
        memcpy(saved, p, (size_t)n * sizeof(float));
        probes++;
        // a smaller step where the larger one crosses a routing change (the tolerance's absolute
        // part grows as the step shrinks: fp32 rounding of the loss over 2 eps)
        int done = 0;
        for (double eps = 1e-2; eps > 1e-4 && !done; eps /= 4) {
            for (int64_t j = 0; j < n; j++) p[j] = (float)(saved[j] + eps * dir[j]);
            double lp = moe_objective(&f);
            int32_t* rp = routing_snapshot(&f);
            for (int64_t j = 0; j < n; j++) p[j] = (float)(saved[j] - eps * dir[j]);
            double lm = moe_objective(&f);
            int32_t* rm = routing_snapshot(&f);
            memcpy(p, saved, (size_t)n * sizeof(float));
            if (memcmp(rp, base, rbytes) == 0 && memcmp(rm, base, rbytes) == 0) {
                double fd = (lp - lm) / (2 * eps);
                CHECK(t, fabs(fd - analytic) <= 1e-2 * fabs(analytic) + 2e-7 / eps,
                      "%s %s: finite difference %.7g vs analytic %.7g (step %g)", what, d->name,
                      fd, analytic, eps);
                done = 1;
            }
            free(rp), free(rm);
        }
        skipped += !done;
        free(dir), free(saved);
    }
    CHECK(t, skipped == 0, "%s: %d of %d tensors' probes change the routing at every step", what,
          skipped, probes);
    free(base);
    moe_fixture_free(&f);
}

static void test_moe_model_gradcheck_qwen3moe(TestCtx* t) {
    ModelConfig c = moe_config(FAMILY_QWEN3MOE, 1, 0.3);
    moe_gradcheck(t, &c, "qwen3moe norm_topk aux");
    c = moe_config(FAMILY_QWEN3MOE, 0, 0.0);
    moe_gradcheck(t, &c, "qwen3moe plain top-k, no aux");
}

static void test_moe_model_gradcheck_gptoss(TestCtx* t) {
    ModelConfig c = moe_config(FAMILY_GPTOSS, 0, 0.3);
    moe_gradcheck(t, &c, "gptoss aux");
}

// The aux loss against HF's formula evaluated here from the router logits each MoE block saved,
// and loss = CE + coef · aux; with output_router_logits off the loss is the CE alone.
static void test_moe_model_aux_loss(TestCtx* t) {
    for (int fam = 0; fam < 2; fam++) {
        ModelConfig c = moe_config(fam ? FAMILY_GPTOSS : FAMILY_QWEN3MOE, 1, 0.25);
        MoeFixture f;
        moe_fixture_init(&f, &c, 2, 6, t->n_threads, 0, 23);
        const int N = f.B * f.T, E = c.E, K = c.K;
        double loss = moe_grads(&f);
        // load_balancing_loss_func: P = softmax of all blocks' logits, top-K of P
        double* cnt = zero_doubles((size_t)E);
        double* psum = zero_doubles((size_t)E);
        double* p = zero_doubles((size_t)E);
        int* idx = malloc_check((size_t)K * sizeof(int));
        int rows = 0;
        for (int l = 0; l < c.L; l++) {
            if (!f.m.layout[l].moe) continue;
            const float* logits = f.p->ws->acts[l].moe.logits;
            for (int i = 0; i < N; i++, rows++) {
                double* z = to_doubles(logits + (size_t)i * E, (size_t)E);
                ref_softmax(p, z, E);
                ref_topk(idx, p, E, K);
                for (int k = 0; k < K; k++) cnt[idx[k]] += 1.0;
                for (int e = 0; e < E; e++) psum[e] += p[e];
                free(z);
            }
        }
        double aux = 0.0;
        for (int e = 0; e < E; e++) aux += (cnt[e] / rows) * (psum[e] / rows);
        aux *= E;
        CHECK(t, fabs(f.p->aux - aux) <= 1e-5 * aux, "%s aux %.9g vs %.9g", family_names[c.family],
              f.p->aux, aux);
        CHECK(t, aux > 0.9 * K && aux < 3.0 * K, "aux near K at this balance: %g", aux);
        CHECK_NEAR(t, loss, f.p->ce_sum / N + 0.25 * aux, 1e-6 * loss, "loss = CE + coef aux");
        CHECK(t, f.p->ws->moe_load_max >= f.p->ws->moe_load_mean &&
                     fabs(f.p->ws->moe_load_mean * E - (double)rows * K) < 1e-6,
              "load spread %g / %g", f.p->ws->moe_load_max, f.p->ws->moe_load_mean);
        moe_fixture_free(&f);
        free(cnt), free(psum), free(p), free(idx);
        // off: the loss is the cross-entropy, the routers get no aux gradient
        c.output_router_logits = 0;
        moe_fixture_init(&f, &c, 2, 6, t->n_threads, 0, 23);
        loss = moe_grads(&f);
        CHECK(t, loss == f.p->ce_sum / N, "aux off: loss %.9g vs CE %.9g", loss, f.p->ce_sum / N);
        moe_fixture_free(&f);
    }
}

static float* all_grads(const MoeFixture* f, int64_t* n_out) {
    int64_t n = 0;
    for (int l = 0; l < f->m.tt.n_layers; l++) n += f->m.tt.grad_numel[l];
    float* out = malloc_check((size_t)n * sizeof(float));
    int64_t o = 0;
    for (int l = 0; l < f->m.tt.n_layers; l++) {
        memcpy(out + o, f->s.grad[l], (size_t)f->m.tt.grad_numel[l] * sizeof(float));
        o += f->m.tt.grad_numel[l];
    }
    *n_out = n;
    return out;
}

// Recompute and 1 vs 3 threads: bit-identical losses and gradients.
static void test_moe_model_recompute_threads(TestCtx* t) {
    for (int fam = 0; fam < 2; fam++) {
        ModelConfig c = moe_config(fam ? FAMILY_GPTOSS : FAMILY_QWEN3MOE, 1, 0.1);
        MoeFixture a, b, d;
        moe_fixture_init(&a, &c, 3, 9, 1, 0, 5);
        moe_fixture_init(&b, &c, 3, 9, 1, 1, 5);
        moe_fixture_init(&d, &c, 3, 9, 3, 1, 5);
        double la = moe_grads(&a), lb = moe_grads(&b), ld = moe_grads(&d);
        int64_t n;
        float* ga = all_grads(&a, &n);
        float* gb = all_grads(&b, &n);
        float* gd = all_grads(&d, &n);
        CHECK(t, la == lb && memcmp(ga, gb, (size_t)n * 4) == 0, "%s: recompute changes results",
              family_names[c.family]);
        CHECK(t, lb == ld && memcmp(gb, gd, (size_t)n * 4) == 0, "%s: 1 vs 3 threads differ",
              family_names[c.family]);
        free(ga), free(gb), free(gd);
        moe_fixture_free(&a);
        moe_fixture_free(&b);
        moe_fixture_free(&d);
    }
}

// A few AdamW steps on one batch: the loss falls for both families.
static void test_moe_model_overfit(TestCtx* t) {
    for (int fam = 0; fam < 2; fam++) {
        ModelConfig c = moe_config(fam ? FAMILY_GPTOSS : FAMILY_QWEN3MOE, 1, 0.01);
        MoeFixture f;
        moe_fixture_init(&f, &c, 2, 8, t->n_threads, 0, 7);
        AdamWTensor* opt = malloc_check((size_t)f.m.tt.n * sizeof(AdamWTensor));
        int n_opt = store_adamw_tensors(&f.s, opt);
        AdamWHyper h = {3e-2f, 0.9f, 0.95f, 1e-8f, 0.0f};
        ThreadPool* pool = threadpool_create(t->n_threads);
        double first = 0, last = 0;
        for (int step = 1; step <= 25; step++) {
            last = moe_grads(&f);
            if (step == 1) first = last;
            double norm = sqrt(adamw_grad_norm_sq(pool, opt, n_opt));
            adamw_step(pool, opt, n_opt, &h, step, adamw_clip_scale(norm, 1.0f));
        }
        CHECK(t, last < 0.5 * first, "%s: loss %.4f -> %.4f", family_names[c.family], first, last);
        threadpool_destroy(pool);
        free(opt);
        moe_fixture_free(&f);
    }
}

// ----------------------------------------------------------------------------
// checkpoints: the layouts HF files use, MXFP4, --dump-state names

// A model of `preset` with the experts in `layout`, randomly initialised.
static void layout_model(Model* m, Store* s, const char* preset, ExpertLayout layout,
                         uint32_t seed) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, preset, err);
    c.expert_layout = layout;
    if (model_init(m, &c, 0, err) != 0) fatal("model_init: %s", err);
    store_create(s, &m->tt);
    store_init_random(s, seed, 0.5f);
}

// Every parameter (or gradient) slab of two stores: identical bits.
static int stores_equal(const Model* m, const Store* a, const Store* b, int grads) {
    for (int l = 0; l < m->tt.n_layers; l++) {
        int64_t n = grads ? m->tt.grad_numel[l] : m->tt.param_numel[l];
        const float* x = grads ? a->grad[l] : a->param[l];
        const float* y = grads ? b->grad[l] : b->param[l];
        if (n > 0 && memcmp(x, y, (size_t)n * sizeof(float)) != 0) return 0;
    }
    return 1;
}

// Save in the model's layout, resolve the directory (the layout detected from the names), load:
// the same parameters; the file holds the layout's names; the HF export (sharded) loads back too.
static void layout_roundtrip(TestCtx* t, const char* preset, ExpertLayout layout,
                             const char* must_have, const char* must_not_have) {
    char dir[1024], err[ERR_LEN], path[1200];
    snprintf(dir, sizeof dir, "%s/layout_%s_%d", t->tmpdir, preset, (int)layout);
    Model m;
    Store s;
    layout_model(&m, &s, preset, layout, 41);
    CHECK(t, checkpoint_save_hf(dir, &m, &s, err) == 0, "save: %s", err);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    StFile f;
    if (st_open(&f, path, err) != 0) {
        CHECK(t, 0, "%s", err);
    } else {
        CHECK(t, st_find(&f, must_have) != NULL && st_find(&f, must_not_have) == NULL,
              "%s layout %d: has %s, not %s", preset, (int)layout, must_have, must_not_have);
        CHECK(t, f.n_tensors == m.tt.n_hf, "%d tensors written, the view has %d", f.n_tensors,
              m.tt.n_hf);
        st_close(&f);
    }
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {  // the HF export, several shards
            snprintf(dir + strlen(dir), sizeof dir - strlen(dir), "_export");
            CHECK(t, checkpoint_export_hf(dir, &m, &s, EXPORT_F32, 20000, NULL, err) == 0,
                  "export: %s", err);
        }
        ModelSource src;
        if (checkpoint_resolve_model(&src, dir, err) != 0) {
            CHECK(t, 0, "resolve %s: %s", dir, err);
            continue;
        }
        CHECK(t, src.cfg.expert_layout == layout, "%s: layout detected %d, saved %d", dir,
              (int)src.cfg.expert_layout, (int)layout);
        Model m2;
        Store s2;
        if (model_init(&m2, &src.cfg, 0, err) != 0) {
            CHECK(t, 0, "model_init: %s", err);
            checkpoint_close_source(&src);
            continue;
        }
        store_create(&s2, &m2.tt);
        int unused = -1;
        CHECK(t, checkpoint_load_weights(&src, &s2, &unused, err) == 0 && unused == 0,
              "load %s: %s (unused %d)", dir, err, unused);
        CHECK(t, m2.tt.total_params == m.tt.total_params && stores_equal(&m, &s, &s2, 0),
              "%s: parameters differ after the round trip", dir);
        store_free(&s2);
        model_free(&m2);
        checkpoint_close_source(&src);
    }
    store_free(&s);
    model_free(&m);
}

static void test_moe_checkpoint_layouts(TestCtx* t) {
    layout_roundtrip(t, "test-qwen3moe", EXPERTS_PER_EXPERT,
                     "model.layers.2.mlp.experts.7.down_proj.weight",
                     "model.layers.2.mlp.experts.gate_up_proj");
    layout_roundtrip(t, "test-qwen3moe", EXPERTS_FUSED, "model.layers.2.mlp.experts.gate_up_proj",
                     "model.layers.2.mlp.experts.0.gate_proj.weight");
    layout_roundtrip(t, "test-gptoss", EXPERTS_GPTOSS,
                     "model.layers.1.mlp.experts.gate_up_proj_bias",
                     "model.layers.1.mlp.experts.0.gate_proj.weight");
    // the dense middle block of test-qwen3moe has the dense MLP's names
    Model m;
    Store s;
    layout_model(&m, &s, "test-qwen3moe", EXPERTS_PER_EXPERT, 1);
    CHECK(t, tensor_table_find_hf_tensor(&m.tt, "model.layers.1.mlp.gate_proj.weight") >= 0 &&
                 tensor_table_find_hf_tensor(&m.tt, "model.layers.1.mlp.gate.weight") < 0 &&
                 tensor_table_find_hf_tensor(&m.tt, "model.layers.0.mlp.gate.weight") >= 0,
          "dense and MoE blocks");
    // per-expert views are slices of the fused tensors: expert 3's up_proj of block 2
    int j = tensor_table_find_hf_tensor(&m.tt, "model.layers.2.mlp.experts.3.up_proj.weight");
    int gu = tensor_table_index(&m.tt, TK_EXP_GATE_UP, 2);
    const ModelConfig* c = &m.cfg;
    CHECK(t, j >= 0 && m.tt.hf[j].index == gu &&
                 m.tt.hf[j].offset == (int64_t)(2 * 3 + 1) * c->F_expert * c->C &&
                 m.tt.hf[j].shape[0] == c->F_expert && m.tt.hf[j].shape[1] == c->C,
          "per-expert slice");
    CHECK(t, m.tt.total_params == config_num_params(c), "table %lld vs config %lld",
          (long long)m.tt.total_params, (long long)config_num_params(c));
    store_free(&s);
    model_free(&m);
    layout_model(&m, &s, "test-gptoss", EXPERTS_GPTOSS, 1);
    CHECK(t, m.tt.total_params == config_num_params(&m.cfg), "gptoss table %lld vs config %lld",
          (long long)m.tt.total_params, (long long)config_num_params(&m.cfg));
    int sinks = tensor_table_index(&m.tt, TK_SINKS, 0), bq = tensor_table_index(&m.tt, TK_BQ, 1);
    int gub = tensor_table_index(&m.tt, TK_EXP_GATE_UP_BIAS, 0);
    CHECK(t, sinks >= 0 && !m.tt.t[sinks].decay && bq >= 0 && !m.tt.t[bq].decay && gub >= 0 &&
                 !m.tt.t[gub].decay && m.tt.t[tensor_table_index(&m.tt, TK_EXP_DOWN, 0)].decay,
          "decay: expert matrices only, not biases or sinks");
    store_free(&s);
    model_free(&m);
}

// GPT-OSS experts as the hub stores them (MXFP4 blocks and scales): dequantised on load to what
// HF's convert_moe_packed_tensors gives, evaluated here directly from the bytes.
static void test_moe_mxfp4_load(TestCtx* t) {
    char dir[1024], err[ERR_LEN], path[1200];
    snprintf(dir, sizeof dir, "%s/mxfp4", t->tmpdir);
    Model m;
    Store s;
    layout_model(&m, &s, "test-gptoss", EXPERTS_GPTOSS, 43);
    CHECK(t, checkpoint_save_hf(dir, &m, &s, err) == 0, "save: %s", err);
    // rewrite model.safetensors: the expert matrices as _blocks / _scales
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    StWriter w;
    st_writer_init(&w);
    Rng r;
    rng_seed(&r, 44);
    const ModelConfig* c = &m.cfg;
    uint8_t* bytes[16] = {0};
    int nb = 0;
    float* expect[4] = {0};
    int ne = 0;
    for (int j = 0; j < m.tt.n_hf; j++) {
        const HfTensor* v = &m.tt.hf[j];
        const TensorKind kind = m.tt.t[v->index].kind;
        if (kind != TK_EXP_GATE_UP && kind != TK_EXP_DOWN) {
            st_writer_add(&w, v->name, ST_F32, v->ndim, v->shape,
                          store_param(&s, v->index) + v->offset);
            continue;
        }
        // [E, cols, rows] parameter <- blocks [E, rows, cols/32, 16], scales [E, rows, cols/32]
        const int64_t E = v->shape[0], cols = v->shape[1], rows = v->shape[2], G = cols / 32;
        CHECK(t, cols % 32 == 0, "%s: %lld columns", v->name, (long long)cols);
        uint8_t* blk = malloc_check((size_t)(E * rows * G * 16));
        uint8_t* scl = malloc_check((size_t)(E * rows * G));
        for (int64_t i = 0; i < E * rows * G * 16; i++) blk[i] = (uint8_t)rng_below(&r, 256);
        for (int64_t i = 0; i < E * rows * G; i++) scl[i] = (uint8_t)(120 + rng_below(&r, 12));
        float* ex = malloc_check((size_t)(E * cols * rows) * sizeof(float));
        const float lut[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
        for (int64_t e = 0; e < E; e++)
            for (int64_t cc = 0; cc < cols; cc++)
                for (int64_t rr = 0; rr < rows; rr++) {
                    const int64_t g = cc / 32, b = (cc % 32) / 2;
                    uint8_t byte = blk[((e * rows + rr) * G + g) * 16 + b];
                    unsigned code = cc % 2 ? byte >> 4 : byte & 15;
                    ex[(e * cols + cc) * rows + rr] =
                        lut[code] * powf(2.0f, (float)scl[(e * rows + rr) * G + g] - 127.0f);
                }
        char* bn = malloc_check(128);
        char* sn = malloc_check(128);
        snprintf(bn, 128, "%s_blocks", v->name);
        snprintf(sn, 128, "%s_scales", v->name);
        int64_t bshape[4] = {E, rows, G, 16}, sshape[3] = {E, rows, G};
        st_writer_add(&w, bn, ST_U8, 4, bshape, blk);
        st_writer_add(&w, sn, ST_U8, 3, sshape, scl);
        if (nb <= 12) {  // freed after the file is written
            bytes[nb++] = blk, bytes[nb++] = scl;
            bytes[nb++] = (uint8_t*)bn, bytes[nb++] = (uint8_t*)sn;
        }
        if (ne < 4) {  // test-gptoss: 2 blocks x 2 expert matrices
            expect[ne++] = ex;
        } else {
            CHECK(t, 0, "test-gptoss has more expert matrices than expected");
            free(ex);
        }
    }
    CHECK(t, st_writer_write(&w, path, err) == 0, "%s", err);
    st_writer_free(&w);
    for (int k = 0; k < nb; k++) free(bytes[k]);
    ModelSource src;
    if (checkpoint_resolve_model(&src, dir, err) != 0) {
        CHECK(t, 0, "resolve: %s", err);
    } else {
        Model m2;
        Store s2;
        model_init(&m2, &src.cfg, 0, err);
        store_create(&s2, &m2.tt);
        int unused = -1;
        CHECK(t, checkpoint_load_weights(&src, &s2, &unused, err) == 0 && unused == 0,
              "mxfp4 load: %s (unused %d)", err, unused);
        int k = 0, ok = 1;
        for (int j = 0; j < m2.tt.n_hf && k < ne; j++) {
            const HfTensor* v = &m2.tt.hf[j];
            const TensorKind kind = m2.tt.t[v->index].kind;
            if (kind != TK_EXP_GATE_UP && kind != TK_EXP_DOWN) continue;
            ok &= memcmp(store_param(&s2, v->index), expect[k], (size_t)v->numel * 4) == 0;
            k++;
        }
        CHECK(t, k == 4 && ne == 4 && ok, "dequantised experts differ from HF's formula (%d tensors)", k);
        // everything else is the float source
        const int bias = tensor_table_index(&m2.tt, TK_EXP_DOWN_BIAS, 1);
        CHECK(t, memcmp(store_param(&s2, bias), store_param(&s, bias),
                        (size_t)m2.tt.t[bias].numel * 4) == 0,
              "biases load as they are");
        store_free(&s2);
        model_free(&m2);
        checkpoint_close_source(&src);
    }
    for (int k = 0; k < ne; k++) free(expect[k]);
    (void)c;
    store_free(&s);
    model_free(&m);
}

// --dump-state of an MoE model writes grad.<checkpoint name> for every HF tensor, in the layout
// the source used (hub per-expert names for test-qwen3moe), and the loss is CE + coef · aux.
static void test_moe_dump_state_cli(TestCtx* t) {
    char dir[1024], dump[1024], args[4096], err[ERR_LEN];
    snprintf(dir, sizeof dir, "%s/moe_cli_model", t->tmpdir);
    snprintf(args, sizeof args, "--model test-qwen3moe --steps 2 --batch 2 --seq 16 --val '' "
                                "--out '%s'", dir);
    CHECK(t, test_run_cli(t, "moe_train", args) == 0, "train + save failed");
    snprintf(dump, sizeof dump, "%s/moe_dump.safetensors", t->tmpdir);
    snprintf(args, sizeof args, "--model '%s' --batch 2 --seq 16 --dump-state '%s'", dir, dump);
    CHECK(t, test_run_cli(t, "moe_dump", args) == 0, "dump-state failed");
    StFile d;
    if (st_open(&d, dump, err) != 0) {
        CHECK(t, 0, "%s", err);
        return;
    }
    CHECK(t, st_find(&d, "grad.model.layers.0.mlp.experts.5.gate_proj.weight") &&
                 st_find(&d, "grad.model.layers.2.mlp.gate.weight") &&
                 st_find(&d, "grad.model.layers.1.mlp.down_proj.weight") &&
                 !st_find(&d, "grad.model.layers.0.mlp.experts.gate_up_proj"),
          "per-expert gradient names");
    ModelConfig c;
    config_from_preset(&c, "test-qwen3moe", err);
    Model m;
    model_init(&m, &c, 0, err);
    CHECK(t, d.n_tensors == m.tt.n_hf + 1, "%d tensors, expected %d gradients + loss",
          d.n_tensors, m.tt.n_hf);
    model_free(&m);
    st_close(&d);
}

// The logged objective: an MoE run's JSON records carry "ce" and "aux" with loss = ce + coef · aux
// (over two micro-batches, each one's aux weighted by its tokens), and "load_spread" (max / mean
// tokens per expert, in [1, E / K]), which the step line shows; a dense run's records have none
// of them. Engine and CUDA runs of MoE models are refused with one line.
static void test_moe_log_cli(TestCtx* t) {
    char args[4096], log[1024], err[ERR_LEN];
    test_path(t, log, sizeof log, "moe_log.jsonl");
    const char* models[2] = {"test-qwen3moe", "test-qwen3"};
    for (int k = 0; k < 2; k++) {
        const int moe = k == 0;
        ModelConfig c;
        CHECK(t, config_from_preset(&c, models[k], err) == 0, "%s", err);
        snprintf(args, sizeof args, "--model %s --steps 3 --batch 4 --seq 16 --micro-batches 2 "
                                    "--val '' --sample-tokens 0 --log '%s'", models[k], log);
        CHECK(t, test_run_cli(t, "moe_log", args) == 0, "%s run failed", models[k]);
        char* out = test_read_output(t, "moe_log", "out");
        CHECK(t, (strstr(out, "| experts max/mean ") != NULL) == moe, "%s: step line %s",
              models[k], out);
        free(out);
        char* text = file_read_all(log, 1 << 20, NULL, err);
        CHECK(t, text != NULL, "log: %s", err);
        int n_steps = 0;
        for (char* line = text; text && *line;) {
            char* nl = strchr(line, '\n');
            size_t len = nl ? (size_t)(nl - line) : strlen(line);
            JsonDoc doc;
            if (json_parse(line, len, &doc, err) != 0) {
                CHECK(t, 0, "log line is not JSON: %.*s (%s)", (int)len, line, err);
                break;
            }
            double loss = NAN, ce = NAN, aux = NAN, spread = NAN;
            json_get_double(&doc.root, "loss", &loss);
            int has_ce = json_get_double(&doc.root, "ce", &ce) == 1;
            int has_aux = json_get_double(&doc.root, "aux", &aux) == 1;
            int has_spread = json_get_double(&doc.root, "load_spread", &spread) == 1;
            json_free(&doc);
            n_steps++;
            if (!moe) {
                CHECK(t, !has_ce && !has_aux && !has_spread, "dense record: %.*s", (int)len, line);
            } else {
                CHECK(t, has_ce && has_aux && has_spread, "MoE record: %.*s", (int)len, line);
                const double obj = ce + c.router_aux_loss_coef * aux;
                CHECK(t, c.output_router_logits && aux > 0.9 && ce > 0 &&
                             fabs(loss - obj) <= 1e-6 * fabs(loss),
                      "loss %.9g vs ce %.9g + %g x aux %.9g", loss, ce, c.router_aux_loss_coef,
                      aux);
                CHECK(t, spread >= 1.0 && spread <= (double)c.E / c.K + 1e-9,
                      "load spread %g outside [1, %g]", spread, (double)c.E / c.K);
            }
            line = nl ? nl + 1 : line + len;
        }
        free(text);
        CHECK(t, n_steps == 3, "%s: %d step records", models[k], n_steps);
    }
    // engine runs (emulated devices) train them too, with the same step statistics
    // (test_resume_bit_exact compares an engine run's log with plain training's)
    CHECK(t, test_run_cli(t, "moe_engine", "--model test-gptoss --device cpu:2 --steps 1 --val '' "
                                           "--sample-tokens 0") == 0,
          "an engine run of an MoE model");
    char* e = test_read_output(t, "moe_engine", "out");
    CHECK(t, strstr(e, "| experts max/mean ") != NULL, "engine step line: %s", e);
    free(e);
}

// --layers N keeps the first N blocks: a preset trains and saves an N-block model, a deeper
// checkpoint loads its first N blocks (the rest reported unused), and N beyond the model fails.
static void test_moe_layers_cli(TestCtx* t) {
    char args[4096], dir[1024], dir1[1024], err[ERR_LEN];
    snprintf(dir, sizeof dir, "%s/layers_full", t->tmpdir);
    snprintf(dir1, sizeof dir1, "%s/layers_one", t->tmpdir);
    snprintf(args, sizeof args, "--model test-gptoss --steps 1 --val '' --sample-tokens 0 "
                                "--out '%s'", dir);
    CHECK(t, test_run_cli(t, "layers_full", args) == 0, "full-depth run");
    snprintf(args, sizeof args, "--model '%s' --layers 1 --steps 1 --val '' --sample-tokens 0 "
                                "--out '%s'", dir, dir1);
    CHECK(t, test_run_cli(t, "layers_one", args) == 0, "--layers 1 run");
    char* out = test_read_output(t, "layers_one", "out");
    CHECK(t, strstr(out, "L 1,") && strstr(out, "some checkpoint tensors are unused"),
          "one block, the deeper tensors unused: %s", out);
    free(out);
    ModelSource src;
    if (checkpoint_resolve_model(&src, dir1, err) == 0) {
        CHECK(t, src.cfg.L == 1 && src.cfg.family == FAMILY_GPTOSS && src.cfg.sliding[0],
              "saved model: L %d", src.cfg.L);
        checkpoint_close_source(&src);
    } else {
        CHECK(t, 0, "%s", err);
    }
    CHECK(t, test_run_cli(t, "layers_bad", "--model test-gptoss --layers 3 --steps 1") != 0,
          "--layers beyond the model must fail");
    char* e = test_read_output(t, "layers_bad", "err");
    CHECK(t, strstr(e, "--layers 3: the model has 2 decoder blocks") != NULL, "%s", e);
    free(e);
}

// The loss printed on stdout's "step <k>/<n> | loss X" line of a CLI run (NAN if absent).
static double step_loss(TestCtx* t, const char* tag, int k, int n) {
    char* out = test_read_output(t, tag, "out");
    char key[64];
    snprintf(key, sizeof key, "step %5d/%d | loss ", k, n);
    const char* at = strstr(out, key);
    double v = at ? strtod(at + strlen(key), NULL) : NAN;
    free(out);
    return v;
}

// Resume is bit-exact for both families (the HF-view weights and the table-named optimizer
// state of a per-expert Qwen3-MoE checkpoint): 4 steps straight vs 2 + resume.
static void test_moe_resume_cli(TestCtx* t) {
    const char* presets[2] = {"test-qwen3moe", "test-gptoss"};
    for (int k = 0; k < 2; k++) {
        char a[1024], b[1024], args[4096], tag[64];
        snprintf(a, sizeof a, "%s/moe_resume_a%d", t->tmpdir, k);
        snprintf(b, sizeof b, "%s/moe_resume_b%d", t->tmpdir, k);
        const char* common = "--steps 4 --batch 4 --seq 32 --val '' --save-every 2";
        snprintf(args, sizeof args, "--model %s %s --out '%s'", presets[k], common, a);
        snprintf(tag, sizeof tag, "moe_straight%d", k);
        CHECK(t, test_run_cli(t, tag, args) == 0, "%s straight run", presets[k]);
        const double l3 = step_loss(t, tag, 3, 4), l4 = step_loss(t, tag, 4, 4);
        snprintf(args, sizeof args, "--model %s %s --out '%s'", presets[k], common, b);
        CHECK(t, test_run_cli(t, "moe_first", args) == 0, "%s first run", presets[k]);
        char cmd[2200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s/step_4'", b);
        CHECK(t, system(cmd) == 0, "rm");
        snprintf(args, sizeof args, "--model %s %s --out '%s' --resume", presets[k], common, b);
        snprintf(tag, sizeof tag, "moe_resumed%d", k);
        CHECK(t, test_run_cli(t, tag, args) == 0, "%s resumed run", presets[k]);
        const double r3 = step_loss(t, tag, 3, 4), r4 = step_loss(t, tag, 4, 4);
        CHECK(t, isfinite(l3) && l3 == r3 && l4 == r4, "%s: straight %.6f %.6f, resumed %.6f %.6f",
              presets[k], l3, l4, r3, r4);
    }
}

// ----------------------------------------------------------------------------
// GGUF: llama.cpp's qwen3moe / gpt-oss layout, written here by hand as its converter does it
// (stacked [E, out, in] experts, gate and up apart, GPT-OSS's x·W experts transposed and its
// interleaved gate/up columns and biases split), read into the table, and written back by the
// export byte for byte.

// Tensor i of the table in llama.cpp's layout, as this test understands the converter: names and
// row-major shapes of up to two GGUF tensors; data[k] malloc'd.
static int llamacpp_tensors(const ModelConfig* c, const TensorDesc* d, const float* w,
                            char names[2][96], int* ndim, int64_t shape[2][3], float* data[2]) {
    const int64_t E = c->E, Fe = c->F_expert, C = c->C;
    const int oss = c->family == FAMILY_GPTOSS, b = d->block;
    if (d->kind == TK_EXP_GATE_UP || d->kind == TK_EXP_GATE_UP_BIAS) {
        const int bias = d->kind == TK_EXP_GATE_UP_BIAS;
        const int64_t per = bias ? Fe : Fe * C;
        for (int k = 0; k < 2; k++) {
            snprintf(names[k], 96, "blk.%d.ffn_%s_exps.%s", b, k ? "up" : "gate",
                     bias ? "bias" : "weight");
            data[k] = malloc_check((size_t)(E * per) * sizeof(float));
            shape[k][0] = E, shape[k][1] = Fe, shape[k][2] = C;
        }
        *ndim = bias ? 2 : 3;
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < Fe; i++)
                for (int64_t x = 0; x < (bias ? 1 : C); x++)
                    for (int k = 0; k < 2; k++) {
                        // gate rows then up rows (Qwen3-MoE); columns 2i / 2i + 1 (GPT-OSS)
                        const int64_t src = bias  ? e * 2 * Fe + 2 * i + k
                                            : oss ? (e * C + x) * 2 * Fe + 2 * i + k
                                                  : (e * 2 * Fe + k * Fe + i) * C + x;
                        data[k][(e * Fe + i) * (bias ? 1 : C) + x] = w[src];
                    }
        return 2;
    }
    *ndim = d->ndim;
    for (int k = 0; k < 3; k++) shape[0][k] = d->shape[k];
    data[0] = malloc_check((size_t)d->numel * sizeof(float));
    if (d->kind == TK_EXP_DOWN) {  // [E, C, Fe]; GPT-OSS's HF tensor is x·W [E, Fe, C]
        snprintf(names[0], 96, "blk.%d.ffn_down_exps.weight", b);
        shape[0][1] = C, shape[0][2] = Fe;
        for (int64_t e = 0; e < E; e++)
            for (int64_t x = 0; x < C; x++)
                for (int64_t i = 0; i < Fe; i++)
                    data[0][(e * C + x) * Fe + i] =
                        oss ? w[(e * Fe + i) * C + x] : w[(e * C + x) * Fe + i];
        return 1;
    }
    memcpy(data[0], w, (size_t)d->numel * sizeof(float));
    const char* fixed = d->kind == TK_ROUTER        ? "ffn_gate_inp.weight"
                        : d->kind == TK_ROUTER_BIAS  ? "ffn_gate_inp.bias"
                        : d->kind == TK_EXP_DOWN_BIAS ? "ffn_down_exps.bias"
                        : d->kind == TK_SINKS        ? "attn_sinks.weight"
                                                     : NULL;
    if (fixed) snprintf(names[0], 96, "blk.%d.%s", b, fixed);
    else gguf_tensor_name(c->family, d, names[0], 96);  // the dense names (test_gguf.c)
    return 1;
}

static void test_moe_gguf_layout(TestCtx* t) {
    const char* presets[2] = {"test-qwen3moe", "test-gptoss"};
    char err[ERR_LEN], path[1024], out[1024];
    for (int k = 0; k < 2; k++) {
        ModelConfig c;
        CHECK(t, config_from_preset(&c, presets[k], err) == 0, "%s", err);
        memset(c.mlp_only, 0, sizeof c.mlp_only);  // llama.cpp's qwen3moe has no dense blocks
        Model m;
        if (model_init(&m, &c, 0, err) != 0) {
            CHECK(t, 0, "%s", err);
            continue;
        }
        Store s;
        store_create(&s, &m.tt);
        Rng rng;
        rng_seed(&rng, 77u + (uint32_t)k);
        GgufWriter w;
        gguf_writer_init(&w);
        gguf_writer_add_config(&w, &c);
        int n_written = 0;
        for (int i = 0; i < m.tt.n; i++) {
            const TensorDesc* d = &m.tt.t[i];
            if (d->tied_to >= 0) continue;
            float* p = store_param(&s, i);
            for (int64_t j = 0; j < d->numel; j++) p[j] = rng_normal(&rng);
            char names[2][96];
            int ndim;
            int64_t shape[2][3];
            float* data[2];
            int n = llamacpp_tensors(&c, d, p, names, &ndim, shape, data);
            for (int q = 0; q < n; q++)
                gguf_writer_add_tensor(&w, names[q], GGML_TYPE_F32, ndim, shape[q], data[q], 1);
            n_written += n;
        }
        snprintf(path, sizeof path, "%s/moe_%s.gguf", t->tmpdir, presets[k]);
        CHECK(t, gguf_writer_write(&w, path, err) == 0, "%s", err);
        gguf_writer_free(&w);

        // read: the config, then every tensor into the table, nothing left over
        ModelSource src;
        if (checkpoint_resolve_model(&src, path, err) != 0) {
            CHECK(t, 0, "%s: %s", presets[k], err);
            store_free(&s);
            model_free(&m);
            continue;
        }
        const ModelConfig* g = &src.cfg;
        CHECK(t, g->family == c.family && g->E == c.E && g->K == c.K &&
                     g->F_expert == c.F_expert && g->sliding_window == c.sliding_window &&
                     config_num_moe_blocks(g) == c.L,
              "%s: config from GGUF", presets[k]);
        Model m2;
        CHECK(t, model_init(&m2, g, 0, err) == 0 && m2.tt.n == m.tt.n, "%s", err);
        Store s2;
        store_create(&s2, &m2.tt);
        int unused = -1;
        CHECK(t, checkpoint_load_weights(&src, &s2, &unused, err) == 0 && unused == 0,
              "%s: load: %s (%d unused)", presets[k], err, unused);
        for (int i = 0; i < m.tt.n && i < m2.tt.n; i++) {
            if (m.tt.t[i].tied_to >= 0) continue;
            int eq = memcmp(store_param(&s, i), store_param(&s2, i),
                            (size_t)m.tt.t[i].numel * sizeof(float)) == 0;
            CHECK(t, eq, "%s: %s differs after the GGUF read", presets[k], m.tt.t[i].hf_name);
        }
        // export: the same tensors, names, shapes and bytes as the hand-written file
        snprintf(out, sizeof out, "%s/moe_%s_export.gguf", t->tmpdir, presets[k]);
        CHECK(t, checkpoint_export_gguf(out, &m2, &s2, EXPORT_F32, &src, err) == 0, "%s", err);
        GgufFile a, b;
        if (gguf_open(&a, path, err) == 0 && gguf_open(&b, out, err) == 0) {
            CHECK(t, a.n_tensors == n_written && b.n_tensors == a.n_tensors, "%lld vs %lld tensors",
                  (long long)a.n_tensors, (long long)b.n_tensors);
            for (int64_t i = 0; i < a.n_tensors; i++) {
                const GgufTensor* ta = &a.tensors[i];
                const GgufTensor* tb = gguf_find_tensor(&b, ta->name);
                int eq = tb && tb->type == ta->type && tb->n_dims == ta->n_dims &&
                         memcmp(tb->ne, ta->ne, sizeof ta->ne) == 0 &&
                         memcmp(tb->data, ta->data, (size_t)ta->numel * sizeof(float)) == 0;
                CHECK(t, eq, "%s: exported %s differs", presets[k], ta->name);
            }
            gguf_close(&a);
            gguf_close(&b);
        } else {
            CHECK(t, 0, "%s", err);
        }
        store_free(&s2);
        model_free(&m2);
        checkpoint_close_source(&src);
        store_free(&s);
        model_free(&m);
    }
    // llama.cpp's qwen3moe cannot hold a dense block: the export says so
    ModelConfig c;
    config_from_preset(&c, "test-qwen3moe", err);
    Model m;
    model_init(&m, &c, 0, err);
    Store s;
    store_create(&s, &m.tt);
    snprintf(out, sizeof out, "%s/moe_dense_block.gguf", t->tmpdir);
    CHECK(t, checkpoint_export_gguf(out, &m, &s, EXPORT_F32, NULL, err) == -1 &&
                 strstr(err, "dense") != NULL,
          "a qwen3moe with a dense block refused: %s", err);
    store_free(&s);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// HF parity (dev/parity/make_moe_fixtures.py): loss, its CE and aux parts, every gradient under
// the checkpoint's own names, an 8-step AdamW trajectory. Skipped without the fixtures.

static float moe_meta_float(const StFile* f, const char* key) {
    const char* v = st_meta(f, key);
    double d = NAN;
    if (!v || parse_double(v, &d) != 0) return NAN;
    return (float)d;
}

static float fixture_scalar(const StFile* f, const char* name) {
    char err[ERR_LEN];
    float v = NAN;
    const StTensor* x = st_find(f, name);
    if (x && x->numel == 1) st_tensor_to_f32(x, &v, 1, err);
    return v;
}

static void moe_parity_dir(TestCtx* t, const char* dir, const char* name) {
    char err[ERR_LEN];
    ParityFixture f;
    if (test_parity_open_dir(t, dir, &f) != 0) return;
    const int B = f.B, T = f.T;
    const double N = (double)B * T;
    CHECK(t, config_is_moe(&f.m.cfg) && f.m.cfg.output_router_logits &&
                 fabs(f.m.cfg.router_aux_loss_coef - moe_meta_float(&f.ex, "aux_coef")) < 1e-9,
          "%s: an MoE config with the fixture's aux coefficient", name);
    void* ctx = ops_cpu_create(t->n_threads);
    Plain* p = plain_create(&f.m, &f.s, &ops_cpu, ctx, B, T, 0);

    // loss, its parts, gradients
    store_zero_grads(&f.s);
    double loss = plain_forward_backward(p, f.tokens, B, T, (float)(1.0 / N)) / N;
    store_fold_tied_grads(&f.s);
    const float ce = fixture_scalar(&f.ex, "ce"), aux = fixture_scalar(&f.ex, "aux");
    CHECK(t, fabs(loss - f.ref_loss) <= 1e-5 * fabs(f.ref_loss), "%s loss %.9g vs HF %.9g", name,
          loss, f.ref_loss);
    CHECK(t, fabs(p->ce_sum / N - ce) <= 1e-5 * fabs(ce), "%s ce %.9g vs HF %.9g", name,
          p->ce_sum / N, ce);
    CHECK(t, fabs(p->aux - aux) <= 1e-5 * fabs(aux), "%s aux %.9g vs HF %.9g", name, p->aux, aux);
    int n_grads = 0;
    const char* worst_name = "";
    const double worst_grad =
        test_check_fixture_grads(t, name, &f.m, &f.s, &f.ex, 1e-4, &n_grads, &worst_name);

    // AdamW trajectory: the loss before each of 8 updates on the same batch
    const StTensor* traj = st_find(&f.ex, "traj_loss");
    float ref_traj[8];
    CHECK(t, traj && traj->numel == 8 && st_tensor_to_f32(traj, ref_traj, 8, err) == 0,
          "traj_loss");
    AdamWTensor* opt = malloc_check((size_t)f.m.tt.n * sizeof(AdamWTensor));
    int n_opt = store_adamw_tensors(&f.s, opt);
    AdamWHyper h = {moe_meta_float(&f.ex, "lr"), moe_meta_float(&f.ex, "beta1"),
                    moe_meta_float(&f.ex, "beta2"), moe_meta_float(&f.ex, "eps"),
                    moe_meta_float(&f.ex, "weight_decay")};
    float clip = moe_meta_float(&f.ex, "grad_clip");
    CHECK(t, isfinite(h.lr) && isfinite(h.weight_decay) && isfinite(clip), "fixture metadata");
    ThreadPool* pool = threadpool_create(t->n_threads);
    double worst = 0;
    for (int step = 1; step <= 8 && traj; step++) {
        store_zero_grads(&f.s);
        double l = plain_forward_backward(p, f.tokens, B, T, (float)(1.0 / N)) / N;
        store_fold_tied_grads(&f.s);
        double diff = fabs(l - ref_traj[step - 1]);
        if (diff > worst) worst = diff;
        double norm = sqrt(adamw_grad_norm_sq(pool, opt, n_opt));
        adamw_step(pool, opt, n_opt, &h, step, adamw_clip_scale(norm, clip));
    }
    CHECK(t, worst <= 1e-4, "%s: AdamW trajectory differs by up to %.3g", name, worst);
    printf("  parity %s: loss rel error %.3g, %d gradients, worst rel L2 %.3g (%s), AdamW "
           "trajectory max |diff| %.3g\n",
           name, fabs(loss - f.ref_loss) / fabs(f.ref_loss), n_grads, worst_grad, worst_name, worst);
    threadpool_destroy(pool);
    free(opt);
    plain_free(p);
    ops_cpu_destroy(ctx);
    test_parity_close(&f);
}

static void moe_parity(TestCtx* t, const char* name) {
    char dir[4200], path[4300];
    snprintf(dir, sizeof dir, "%s/dev/parity/fixtures/%s", t->exe_dir, name);
    snprintf(path, sizeof path, "%s/expected.safetensors", dir);
    if (!file_exists(path)) {
        test_skip(t, "no fixture (python3 dev/parity/make_moe_fixtures.py writes "
                     "dev/parity/fixtures/%s)", name);
        return;
    }
    moe_parity_dir(t, dir, name);
}

static void test_moe_parity_qwen3moe(TestCtx* t) { moe_parity(t, "qwen3moe"); }
static void test_moe_parity_gptoss(TestCtx* t) { moe_parity(t, "gptoss"); }

// The parity test's plumbing on a fixture written here in the script's format from our own
// results (names of the hub per-expert layout, the metadata keys, ce / aux / traj tensors): it
// must pass exactly. Guards the test itself until the HF fixtures are committed.
static void test_moe_parity_selfcheck(TestCtx* t) {
    const char* presets[2] = {"test-qwen3moe", "test-gptoss"};
    for (int k = 0; k < 2; k++) {
        char dir[1024], path[1200], err[ERR_LEN];
        snprintf(dir, sizeof dir, "%s/selfcheck_%d", t->tmpdir, k);
        Model m;
        Store s;
        layout_model(&m, &s, presets[k], k ? EXPERTS_GPTOSS : EXPERTS_PER_EXPERT, 51);
        CHECK(t, checkpoint_save_hf(dir, &m, &s, err) == 0, "%s", err);
        const int B = 2, T = 9;
        const double N = (double)B * T;
        int32_t tokens[2 * 10];
        Rng r;
        rng_seed(&r, 52);
        for (int i = 0; i < B * (T + 1); i++) tokens[i] = (int32_t)rng_below(&r, (uint64_t)m.cfg.V);
        void* ctx = ops_cpu_create(t->n_threads);
        Plain* p = plain_create(&m, &s, &ops_cpu, ctx, B, T, 0);
        store_zero_grads(&s);
        float loss = (float)(plain_forward_backward(p, tokens, B, T, (float)(1.0 / N)) / N);
        float ce = (float)(p->ce_sum / N), aux = (float)p->aux;
        store_fold_tied_grads(&s);
        snprintf(path, sizeof path, "%s/grads.safetensors", dir);
        CHECK(t, checkpoint_dump_state(path, &m, &s, loss, err) == 0, "%s", err);
        // the trajectory with the script's hyper-parameters
        AdamWTensor* opt = malloc_check((size_t)m.tt.n * sizeof(AdamWTensor));
        int n_opt = store_adamw_tensors(&s, opt);
        AdamWHyper h = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
        ThreadPool* pool = threadpool_create(t->n_threads);
        float traj[8];
        for (int step = 1; step <= 8; step++) {
            store_zero_grads(&s);
            traj[step - 1] = (float)(plain_forward_backward(p, tokens, B, T, (float)(1.0 / N)) / N);
            store_fold_tied_grads(&s);
            double norm = sqrt(adamw_grad_norm_sq(pool, opt, n_opt));
            adamw_step(pool, opt, n_opt, &h, step, adamw_clip_scale(norm, 1.0f));
        }
        threadpool_destroy(pool);
        free(opt);
        plain_free(p);
        ops_cpu_destroy(ctx);
        // expected.safetensors: tokens, loss, ce, aux, traj_loss and the dumped grad.* tensors
        StFile g;
        if (st_open(&g, path, err) != 0) {
            CHECK(t, 0, "%s", err);
        } else {
            StWriter w;
            st_writer_init(&w);
            int64_t tshape[2] = {B, T + 1}, one = 1, eight = 8;
            st_writer_add(&w, "tokens", ST_I32, 2, tshape, tokens);
            st_writer_add(&w, "loss", ST_F32, 1, &one, &loss);
            st_writer_add(&w, "ce", ST_F32, 1, &one, &ce);
            st_writer_add(&w, "aux", ST_F32, 1, &one, &aux);
            st_writer_add(&w, "traj_loss", ST_F32, 1, &eight, traj);
            for (int i = 0; i < g.n_tensors; i++)
                if (strncmp(g.tensors[i].name, "grad.", 5) == 0)
                    st_writer_add(&w, g.tensors[i].name, ST_F32, g.tensors[i].ndim,
                                  g.tensors[i].shape, g.tensors[i].data);
            const char* meta[][2] = {{"lr", "0.01"}, {"beta1", "0.9"}, {"beta2", "0.95"},
                                     {"eps", "1e-08"}, {"weight_decay", "0.1"},
                                     {"grad_clip", "1.0"}, {"aux_coef", "0.01"}};
            for (size_t i = 0; i < sizeof meta / sizeof meta[0]; i++)
                st_writer_meta(&w, meta[i][0], meta[i][1]);
            snprintf(path, sizeof path, "%s/expected.safetensors", dir);
            CHECK(t, st_writer_write(&w, path, err) == 0, "%s", err);
            st_writer_free(&w);
            st_close(&g);
        }
        snprintf(path, sizeof path, "%s/grads.safetensors", dir);
        unlink(path);
        moe_parity_dir(t, dir, presets[k]);
        store_free(&s);
        model_free(&m);
    }
}

const TestCase tests_moe[] = {
    {"moe_route", test_moe_route},
    {"moe_dispatch_combine", test_moe_dispatch_combine},
    {"moe_grouped_matmul", test_moe_grouped_matmul},
    {"moe_gptoss_glu", test_moe_gptoss_glu},
    {"moe_sink_attention", test_moe_sink_attention},
    {"moe_model_gradcheck_qwen3moe", test_moe_model_gradcheck_qwen3moe},
    {"moe_model_gradcheck_gptoss", test_moe_model_gradcheck_gptoss},
    {"moe_model_aux_loss", test_moe_model_aux_loss},
    {"moe_model_recompute_threads", test_moe_model_recompute_threads},
    {"moe_model_overfit", test_moe_model_overfit},
    {"moe_checkpoint_layouts", test_moe_checkpoint_layouts},
    {"moe_mxfp4_load", test_moe_mxfp4_load},
    {"moe_gguf_layout", test_moe_gguf_layout},
    {"moe_dump_state_cli", test_moe_dump_state_cli},
    {"moe_log_cli", test_moe_log_cli},
    {"moe_layers_cli", test_moe_layers_cli},
    {"moe_resume_cli", test_moe_resume_cli},
    {"moe_parity_qwen3moe", test_moe_parity_qwen3moe},
    {"moe_parity_gptoss", test_moe_parity_gptoss},
    {"moe_parity_selfcheck", test_moe_parity_selfcheck},
    {NULL, NULL},
};
