/*
 * test_adamw.c — tests of llmc/adamw.c (suite `adamw`).
 *
 * The step is checked against a plain double-precision AdamW (decay on/off, clipping, bias
 * correction, changing lr), the SIMD paths against the scalar one (forced with ROUNDPIPE_SIMD),
 * thread counts against each other (bit for bit), the bf16 copy against f32_to_bf16, NaN
 * propagation, the gradient norm, the clip factor, every LR schedule at its key steps, and the
 * step sequence (adamw_update) in one call against the same step in groups of tensors.
 * Tensor sizes (1, 15, 17, chunk - 1, chunk + 3, ...) are not multiples of the vector width or of
 * ADAMW_CHUNK, so vector tails and short chunks are exercised.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../adamw.h"
#include "../common.h"
#include "../rng.h"
#include "../threads.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// fixture: a list of tensors with their own arrays

#define FIX_MAX 10

typedef struct Fixture {
    int n;
    AdamWTensor t[FIX_MAX];
    float* grad[FIX_MAX];  // writable views of t[i].grad
    uint16_t* bf16_base[FIX_MAX];  // allocations of t[i].out_bf16 (which starts a few elements in)
} Fixture;

static const size_t fix_sizes[] = {
    1, 15, 17, 0, 100, ADAMW_CHUNK + 3, 2 * ADAMW_CHUNK, 33, ADAMW_CHUNK - 1};
#define FIX_N_SIZES ((int)(sizeof fix_sizes / sizeof fix_sizes[0]))

// Params ~ N(0, 0.5), m = v = 0, decay on every other tensor, grads uniform in [-1, 1).
static void fixture_init(Fixture* f, const size_t* sizes, int n, int with_bf16, uint32_t seed) {
    Rng r;
    rng_seed(&r, seed);
    memset(f, 0, sizeof *f);
    f->n = n;
    for (int i = 0; i < n; i++) {
        size_t sz = sizes[i];
        AdamWTensor* t = &f->t[i];
        t->n = sz;
        t->param = aligned_alloc_check(sz * sizeof(float));
        f->grad[i] = aligned_alloc_check(sz * sizeof(float));
        t->grad = f->grad[i];
        t->m = aligned_alloc_check(sz * sizeof(float));
        t->v = aligned_alloc_check(sz * sizeof(float));
        t->decay = (i % 2 == 0);
        // the bf16 copies start at assorted 2-byte offsets from a 64-byte boundary (the vector
        // loops' streaming stores need 32-byte alignment and peel the head)
        f->bf16_base[i] = with_bf16 ? aligned_alloc_check((sz + 16) * sizeof(uint16_t)) : NULL;
        t->out_bf16 = with_bf16 ? f->bf16_base[i] + (5 * i) % 17 : NULL;
        for (size_t j = 0; j < sz; j++) {
            t->param[j] = 0.5f * rng_normal(&r);
            f->grad[i][j] = 2.0f * rng_uniform(&r) - 1.0f;
            t->m[j] = 0.0f;
            t->v[j] = 0.0f;
            if (t->out_bf16) t->out_bf16[j] = 0;
        }
    }
}

static void fixture_free(Fixture* f) {
    for (int i = 0; i < f->n; i++) {
        free(f->t[i].param);
        free(f->grad[i]);
        free(f->t[i].m);
        free(f->t[i].v);
        free(f->bf16_base[i]);
    }
}

static void fixture_new_grads(Fixture* f, Rng* r, float amplitude) {
    for (int i = 0; i < f->n; i++)
        for (size_t j = 0; j < f->t[i].n; j++)
            f->grad[i][j] = amplitude * (2.0f * rng_uniform(r) - 1.0f);
}

// ----------------------------------------------------------------------------
// helpers

// Distance in units in the last place; NaN vs NaN is 0, NaN vs number is huge.
static int64_t ulp_diff(float a, float b) {
    if (isnan(a) || isnan(b)) return (isnan(a) && isnan(b)) ? 0 : INT64_MAX;
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    int64_t oa = ia < 0 ? (int64_t)INT32_MIN - ia : ia;  // monotone integer order
    int64_t ob = ib < 0 ? (int64_t)INT32_MIN - ib : ib;
    return oa > ob ? oa - ob : ob - oa;
}

static int64_t max_ulp(const float* a, const float* b, size_t n) {
    int64_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t d = ulp_diff(a[i], b[i]);
        if (d > worst) worst = d;
    }
    return worst;
}

// ROUNDPIPE_SIMD is how tests pick a path; save and restore the caller's value around a test.
typedef struct SimdEnv {
    int had;
    char value[64];
} SimdEnv;

static SimdEnv simd_env_save(void) {
    SimdEnv e = {0};
    const char* v = getenv("ROUNDPIPE_SIMD");
    if (v) {
        e.had = 1;
        str_copy(e.value, sizeof e.value, v);
    }
    return e;
}

static void simd_env_restore(const SimdEnv* e) {
    if (e->had)
        setenv("ROUNDPIPE_SIMD", e->value, 1);
    else
        unsetenv("ROUNDPIPE_SIMD");
}

// Force a path; returns 1 if this CPU really runs it.
static int simd_force(const char* name) {
    setenv("ROUNDPIPE_SIMD", name, 1);
    return strcmp(adamw_simd_name(), name) == 0;
}

static const char* const simd_paths[] = {"scalar", "avx2", "avx512"};

// Force path k for this test; 0, with the path named on the test's line as skipped, when this
// CPU cannot run it (a test passes on the paths that ran: scalar always does).
static int simd_try(TestCtx* t, int k) {
    if (simd_force(simd_paths[k])) return 1;
    test_skip_part(t, "%s path, not on this CPU", simd_paths[k]);
    return 0;
}

static const AdamWHyper test_hyper = {
    .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};

// ----------------------------------------------------------------------------
// double-precision reference AdamW (the formula of the header, written the obvious way)

typedef struct RefState {
    double* p[FIX_MAX];
    double* m[FIX_MAX];
    double* v[FIX_MAX];
} RefState;

static void ref_init(RefState* r, const Fixture* f) {
    for (int i = 0; i < f->n; i++) {
        size_t n = f->t[i].n;
        r->p[i] = malloc_check((n ? n : 1) * sizeof(double));
        r->m[i] = calloc_check(n ? n : 1, sizeof(double));
        r->v[i] = calloc_check(n ? n : 1, sizeof(double));
        for (size_t j = 0; j < n; j++) r->p[i][j] = f->t[i].param[j];
    }
}

static void ref_free(RefState* r, const Fixture* f) {
    for (int i = 0; i < f->n; i++) {
        free(r->p[i]);
        free(r->m[i]);
        free(r->v[i]);
    }
}

static void ref_step(RefState* r, const Fixture* f, const AdamWHyper* h, int64_t step,
                     double grad_scale) {
    double lr = h->lr, b1 = h->beta1, b2 = h->beta2, eps = h->eps, wd = h->weight_decay;
    double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    for (int i = 0; i < f->n; i++) {
        for (size_t j = 0; j < f->t[i].n; j++) {
            double g = (double)f->t[i].grad[j] * grad_scale;
            if (f->t[i].decay) r->p[i][j] *= 1.0 - lr * wd;
            r->m[i][j] = b1 * r->m[i][j] + (1.0 - b1) * g;
            r->v[i][j] = b2 * r->v[i][j] + (1.0 - b2) * g * g;
            r->p[i][j] -= lr / bc1 * r->m[i][j] / (sqrt(r->v[i][j] / bc2) + eps);
        }
    }
}

static double ref_norm_sq(const Fixture* f) {
    double s = 0.0;
    for (int i = 0; i < f->n; i++)
        for (size_t j = 0; j < f->t[i].n; j++) s += (double)f->t[i].grad[j] * f->t[i].grad[j];
    return s;
}

// ----------------------------------------------------------------------------
// the step against the reference

static void test_step_matches_reference(TestCtx* t) {
    Fixture f;
    fixture_init(&f, fix_sizes, FIX_N_SIZES, 0, 1234);
    RefState ref;
    ref_init(&ref, &f);
    float* p0[FIX_MAX];
    for (int i = 0; i < f.n; i++) {
        p0[i] = malloc_check((f.t[i].n ? f.t[i].n : 1) * sizeof(float));
        memcpy(p0[i], f.t[i].param, f.t[i].n * sizeof(float));
    }
    ThreadPool* pool = threadpool_create(t->n_threads);
    Rng r;
    rng_seed(&r, 99);
    LrSchedule sched = {
        .type = LR_COSINE, .max_lr = 1e-2f, .warmup = 2, .total_steps = 8, .min_lr_frac = 0.1f};
    for (int64_t step = 1; step <= 8; step++) {
        // Vary the gradient scale so clipping is active on some steps and not on others.
        fixture_new_grads(&f, &r, step % 3 == 0 ? 1e-3f : 1.0f);
        double norm_sq = adamw_grad_norm_sq(pool, f.t, f.n);
        double want = ref_norm_sq(&f);
        CHECK(t, fabs(norm_sq - want) <= 1e-12 * want, "step %lld: norm^2 %.17g vs %.17g",
              (long long)step, norm_sq, want);
        float clip = (step % 2 == 1) ? 1.0f : 0.0f;
        const AdamWUpdate u = adamw_update_begin(&test_hyper, &sched, clip, step, norm_sq);
        if (step == 1)
            CHECK(t, u.clip_scale < 0.1f, "clipping should be active at step 1 (scale %g)",
                  u.clip_scale);
        if (step == 2)
            CHECK(t, u.clip_scale == 1.0f, "clip 0 disables clipping (scale %g)", u.clip_scale);
        CHECK(t, u.hyper.lr == lr_schedule_at(&sched, step) && u.norm == sqrt(norm_sq),
              "step %lld: the update's lr and norm", (long long)step);
        adamw_update_apply(pool, &u, f.t, f.n);
        ref_step(&ref, &f, &u.hyper, step, u.clip_scale);
    }
    // Relative L2 error of p, m, v and of the change in p (the part Adam computes), and a
    // per-element bound on p.
    double num_p = 0, den_p = 0, num_d = 0, den_d = 0, num_m = 0, den_m = 0, num_v = 0, den_v = 0;
    size_t bad = 0;
    for (int i = 0; i < f.n; i++) {
        for (size_t j = 0; j < f.t[i].n; j++) {
            double p = f.t[i].param[j], rp = ref.p[i][j], d0 = p0[i][j];
            num_p += (p - rp) * (p - rp);
            den_p += rp * rp;
            num_d += ((p - d0) - (rp - d0)) * ((p - d0) - (rp - d0));
            den_d += (rp - d0) * (rp - d0);
            num_m += (f.t[i].m[j] - ref.m[i][j]) * (f.t[i].m[j] - ref.m[i][j]);
            den_m += ref.m[i][j] * ref.m[i][j];
            num_v += (f.t[i].v[j] - ref.v[i][j]) * (f.t[i].v[j] - ref.v[i][j]);
            den_v += ref.v[i][j] * ref.v[i][j];
            if (!(fabs(p - rp) <= 1e-6 * fabs(rp) + 1e-7)) bad++;
        }
    }
    CHECK(t, sqrt(num_p / den_p) <= 1e-6, "param rel err %.3g", sqrt(num_p / den_p));
    CHECK(t, sqrt(num_d / den_d) <= 1e-5, "param update rel err %.3g", sqrt(num_d / den_d));
    CHECK(t, sqrt(num_m / den_m) <= 1e-6, "m rel err %.3g", sqrt(num_m / den_m));
    CHECK(t, sqrt(num_v / den_v) <= 1e-6, "v rel err %.3g", sqrt(num_v / den_v));
    CHECK(t, bad == 0, "%zu params off the reference by more than 1e-6 rel + 1e-7", bad);
    threadpool_destroy(pool);
    for (int i = 0; i < f.n; i++) free(p0[i]);
    ref_free(&ref, &f);
    fixture_free(&f);
}

// With a constant gradient, bias correction makes every step move each weight by exactly lr in
// the direction of -sign(g) (m_hat = g, v_hat = g^2). Without it the first step would be ~3x lr.
static void test_bias_correction(TestCtx* t) {
    const size_t sizes[] = {37};
    Fixture f;
    fixture_init(&f, sizes, 1, 0, 7);
    f.t[0].decay = 0;
    for (size_t j = 0; j < 37; j++) {
        float g = f.grad[0][j];
        f.grad[0][j] = g < 0 ? g - 0.01f : g + 0.01f;  // |g| >= 0.01 >> eps
    }
    double p0[37];
    for (size_t j = 0; j < 37; j++) p0[j] = f.t[0].param[j];
    AdamWHyper h = test_hyper;
    for (int64_t step = 1; step <= 3; step++) {
        adamw_step(NULL, f.t, 1, &h, step, 1.0f);
        size_t bad = 0;
        for (size_t j = 0; j < 37; j++) {
            double sign = f.grad[0][j] > 0 ? 1.0 : -1.0;
            double want = p0[j] - (double)step * h.lr * sign;
            if (!(fabs(f.t[0].param[j] - want) <= 1e-6)) bad++;
        }
        CHECK(t, bad == 0, "step %lld: %zu weights did not move by exactly lr", (long long)step,
              bad);
    }
    fixture_free(&f);
}

// ----------------------------------------------------------------------------
// SIMD paths, threads, bf16, NaN

// Run `steps` steps (with clipping and bf16) on a fresh fixture under the current path/pool.
static void run_steps(Fixture* f, ThreadPool* pool, int steps, double* norms) {
    Rng r;
    rng_seed(&r, 4321);
    for (int s = 1; s <= steps; s++) {
        fixture_new_grads(f, &r, 1.0f);
        double nsq = adamw_grad_norm_sq(pool, f->t, f->n);
        if (norms) norms[s - 1] = nsq;
        const AdamWUpdate u = adamw_update_begin(&test_hyper, NULL, 50.0f, s, nsq);
        adamw_update_apply(pool, &u, f->t, f->n);
    }
}

static void test_simd_paths_agree(TestCtx* t) {
    SimdEnv saved = simd_env_save();
    ThreadPool* pool = threadpool_create(t->n_threads);
    Fixture base;
    fixture_init(&base, fix_sizes, FIX_N_SIZES, 1, 555);
    double base_norms[4];
    CHECK(t, simd_force("scalar"), "the scalar path can always be forced (got %s)",
          adamw_simd_name());
    run_steps(&base, pool, 4, base_norms);
    int tested = 0;
    for (int k = 1; k < 3; k++) {
        if (!simd_try(t, k)) continue;
        tested++;
        Fixture f;
        fixture_init(&f, fix_sizes, FIX_N_SIZES, 1, 555);
        double norms[4];
        run_steps(&f, pool, 4, norms);
        for (int s = 0; s < 4; s++)
            CHECK(t, norms[s] == base_norms[s], "%s: norm^2 at step %d %.17g vs scalar %.17g",
                  simd_paths[k], s + 1, norms[s], base_norms[s]);
        int64_t up = 0, um = 0, uv = 0;
        size_t bf16_diff = 0;
        for (int i = 0; i < f.n; i++) {
            size_t n = f.t[i].n;
            int64_t a = max_ulp(f.t[i].param, base.t[i].param, n);
            int64_t b = max_ulp(f.t[i].m, base.t[i].m, n);
            int64_t c = max_ulp(f.t[i].v, base.t[i].v, n);
            up = a > up ? a : up;
            um = b > um ? b : um;
            uv = c > uv ? c : uv;
            for (size_t j = 0; j < n; j++) bf16_diff += f.t[i].out_bf16[j] != base.t[i].out_bf16[j];
        }
        // Same IEEE operations in the same order: the paths must agree bit for bit (the header
        // promises it); anything beyond 0 ulp means the loops diverged.
        CHECK(t, up == 0 && um == 0 && uv == 0, "%s vs scalar: max ulp p %lld m %lld v %lld",
              simd_paths[k], (long long)up, (long long)um, (long long)uv);
        CHECK(t, bf16_diff == 0, "%s vs scalar: %zu bf16 outputs differ", simd_paths[k], bf16_diff);
        fixture_free(&f);
    }
    // the test compares vector paths with scalar: with none here it has shown nothing
    if (tested == 0) test_skip(t, "no vector AdamW path (avx2, avx512) on this CPU");
    fixture_free(&base);
    threadpool_destroy(pool);
    simd_env_restore(&saved);
}

static void test_threads_bit_identical(TestCtx* t) {
    Fixture base;
    fixture_init(&base, fix_sizes, FIX_N_SIZES, 1, 777);
    double base_norms[3];
    run_steps(&base, NULL, 3, base_norms);  // no pool: serial
    const int counts[] = {1, 2, 3};
    for (int c = 0; c < 3; c++) {
        ThreadPool* pool = threadpool_create(counts[c]);
        Fixture f;
        fixture_init(&f, fix_sizes, FIX_N_SIZES, 1, 777);
        double norms[3];
        run_steps(&f, pool, 3, norms);
        CHECK(t, memcmp(norms, base_norms, sizeof norms) == 0, "%d threads: grad norms differ",
              counts[c]);
        size_t diff = 0;
        for (int i = 0; i < f.n; i++) {
            size_t n = f.t[i].n;
            diff += memcmp(f.t[i].param, base.t[i].param, n * sizeof(float)) != 0;
            diff += memcmp(f.t[i].m, base.t[i].m, n * sizeof(float)) != 0;
            diff += memcmp(f.t[i].v, base.t[i].v, n * sizeof(float)) != 0;
            diff += memcmp(f.t[i].out_bf16, base.t[i].out_bf16, n * sizeof(uint16_t)) != 0;
        }
        CHECK(t, diff == 0, "%d threads: %zu arrays differ from the serial run", counts[c], diff);
        fixture_free(&f);
        threadpool_destroy(pool);
    }
    fixture_free(&base);
}

// out_bf16 must equal f32_to_bf16(param) after the step, on every path: after a normal step, and
// on hand-picked bit patterns (ties, carries into the exponent, Inf, NaN, denormals) kept unchanged
// by a step with lr = 0 and zero gradients.
static void test_bf16_output(TestCtx* t) {
    SimdEnv saved = simd_env_save();
    static const uint32_t patterns[] = {0x3f800000u,
                                        0x3f808000u /* tie, even: down */,
                                        0x3f818000u /* tie, odd: up */,
                                        0x3f808001u,
                                        0x3f807fffu,
                                        0x7f7fffffu /* rounds to Inf */,
                                        0x00000001u,
                                        0x80000000u,
                                        0x7f800000u,
                                        0xff800000u,
                                        0x7fc00000u,
                                        0x7f800001u /* signaling NaN */,
                                        0xffffffffu,
                                        0xbf7fffffu,
                                        0x3fffffffu,
                                        0x807fffffu};
    const size_t n = 3 * 16 + 7;
    for (int k = 0; k < 3; k++) {
        if (!simd_try(t, k)) continue;
        // 1) after real updates
        Fixture f;
        fixture_init(&f, fix_sizes, FIX_N_SIZES, 1, 31337);
        run_steps(&f, NULL, 2, NULL);
        size_t bad = 0;
        for (int i = 0; i < f.n; i++)
            for (size_t j = 0; j < f.t[i].n; j++)
                bad += f.t[i].out_bf16[j] != f32_to_bf16(f.t[i].param[j]);
        CHECK(t, bad == 0, "%s: %zu bf16 outputs differ from f32_to_bf16(param)", simd_paths[k],
              bad);
        fixture_free(&f);

        // 2) special bit patterns, each at several positions (vector body and scalar tail)
        const size_t sizes[] = {n};
        Fixture g;
        fixture_init(&g, sizes, 1, 1, 1);
        Rng r;
        rng_seed(&r, 2024);
        uint32_t bits[3 * 16 + 7];
        for (size_t j = 0; j < n; j++) {
            size_t np = sizeof patterns / sizeof patterns[0];
            bits[j] = (j % 2 == 0) ? patterns[(j / 2) % np] : rng_u32(&r);
            memcpy(&g.t[0].param[j], &bits[j], 4);
            g.grad[0][j] = 0.0f;
        }
        AdamWHyper h = test_hyper;
        h.lr = 0.0f;
        adamw_step(NULL, g.t, 1, &h, 1, 1.0f);
        size_t bad_out = 0, changed = 0;
        for (size_t j = 0; j < n; j++) {
            float p = g.t[0].param[j];
            uint32_t u;
            memcpy(&u, &p, 4);
            if (!isnan(p) && u != bits[j]) changed++;
            if (g.t[0].out_bf16[j] != f32_to_bf16(p)) bad_out++;
        }
        CHECK(t, changed == 0, "%s: lr = 0 changed %zu params", simd_paths[k], changed);
        CHECK(t, bad_out == 0, "%s: %zu special values converted differently from f32_to_bf16",
              simd_paths[k], bad_out);
        fixture_free(&g);
    }
    simd_env_restore(&saved);
}

static int bf16_is_nan(uint16_t b) {
    return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0;
}

// A NaN or Inf gradient poisons exactly its own p, m, v (and bf16 copy), the norm, and the clip
// factor; the other elements are unaffected.
static void test_nan_propagates(TestCtx* t) {
    SimdEnv saved = simd_env_save();
    const size_t sizes[] = {ADAMW_CHUNK + 21, 9};
    const size_t poison[] = {0, 5, 16, 31, ADAMW_CHUNK - 1, ADAMW_CHUNK + 20};  // tensor 0
    const int n_poison = 6;
    for (int k = 0; k < 3; k++) {
        if (!simd_try(t, k)) continue;
        Fixture clean, f;
        fixture_init(&clean, sizes, 2, 1, 8);
        fixture_init(&f, sizes, 2, 1, 8);
        for (int q = 0; q < n_poison; q++) {
            f.grad[0][poison[q]] = (q % 2 == 0) ? NAN : INFINITY;
            clean.grad[0][poison[q]] = 0.0f;
        }
        f.grad[1][8] = NAN;
        clean.grad[1][8] = 0.0f;
        double nsq = adamw_grad_norm_sq(NULL, f.t, 2);
        CHECK(t, isnan(nsq), "%s: norm^2 of NaN gradients is %g", simd_paths[k], nsq);
        CHECK(t, isnan(adamw_clip_scale(sqrt(nsq), 1.0f)), "%s: clip factor of a NaN norm",
              simd_paths[k]);
        adamw_step(NULL, f.t, 2, &test_hyper, 1, 1.0f);
        adamw_step(NULL, clean.t, 2, &test_hyper, 1, 1.0f);
        size_t not_nan = 0, wrong_other = 0;
        for (int i = 0; i < 2; i++) {
            for (size_t j = 0; j < f.t[i].n; j++) {
                int poisoned = (i == 1 && j == 8);
                for (int q = 0; q < n_poison; q++) poisoned |= (i == 0 && j == poison[q]);
                if (poisoned) {
                    not_nan += !isnan(f.t[i].param[j]) + !bf16_is_nan(f.t[i].out_bf16[j]);
                    // m and v are NaN for a NaN gradient, +-Inf for an Inf one.
                    not_nan += isfinite(f.t[i].m[j]) + isfinite(f.t[i].v[j]);
                } else {
                    wrong_other += f.t[i].param[j] != clean.t[i].param[j];
                    wrong_other += f.t[i].m[j] != clean.t[i].m[j];
                    wrong_other += f.t[i].v[j] != clean.t[i].v[j];
                }
            }
        }
        CHECK(t, not_nan == 0, "%s: %zu poisoned values stayed finite", simd_paths[k], not_nan);
        CHECK(t, wrong_other == 0, "%s: %zu other values changed", simd_paths[k], wrong_other);
        fixture_free(&clean);
        fixture_free(&f);
    }
    simd_env_restore(&saved);
}

// ----------------------------------------------------------------------------
// gradient norm and clipping

static void test_grad_norm(TestCtx* t) {
    SimdEnv saved = simd_env_save();
    Fixture f;
    fixture_init(&f, fix_sizes, FIX_N_SIZES, 0, 4242);
    double want = ref_norm_sq(&f);
    ThreadPool* pools[3] = {threadpool_create(1), threadpool_create(2), threadpool_create(3)};
    setenv("ROUNDPIPE_SIMD", "scalar", 1);
    double first = adamw_grad_norm_sq(NULL, f.t, f.n);
    CHECK(t, fabs(first - want) <= 1e-12 * want, "norm^2 %.17g vs reference %.17g", first, want);
    for (int k = 0; k < 3; k++) {
        if (!simd_try(t, k)) continue;
        for (int p = 0; p < 3; p++) {
            for (int rep = 0; rep < 2; rep++) {
                double got = adamw_grad_norm_sq(pools[p], f.t, f.n);
                CHECK(t, got == first, "%s, %d threads: norm^2 %.17g vs %.17g (not deterministic)",
                      simd_paths[k], p + 1, got, first);
            }
        }
        // A sum that is exact in double: 0.5^2 per element.
        for (int i = 0; i < f.n; i++)
            for (size_t j = 0; j < f.t[i].n; j++) f.grad[i][j] = (j % 2) ? 0.5f : -0.5f;
        size_t total = 0;
        for (int i = 0; i < f.n; i++) total += f.t[i].n;
        double exact = adamw_grad_norm_sq(pools[1], f.t, f.n);
        CHECK(t, exact == 0.25 * (double)total, "%s: norm^2 %.17g, want %.17g", simd_paths[k],
              exact, 0.25 * (double)total);
        fixture_free(&f);
        fixture_init(&f, fix_sizes, FIX_N_SIZES, 0, 4242);
    }
    // in parts, a group of tensors at a time, last group first (as gradients arrive): the ordered
    // sum of the chunk sums is the same bits
    {
        const int64_t n_chunks = adamw_chunk_count(f.t, f.n);
        double* parts = calloc(n_chunks, sizeof(double));
        const int split = f.n / 2;
        const int64_t off = adamw_chunk_count(f.t, split);
        adamw_grad_norm_sq_parts(pools[2], f.t + split, f.n - split, parts + off);
        adamw_grad_norm_sq_parts(pools[0], f.t, split, parts);
        const double sum = adamw_norm_sq_total(parts, n_chunks);
        const double whole = adamw_grad_norm_sq(pools[1], f.t, f.n);
        CHECK(t, n_chunks > f.n && sum == whole, "%lld chunks: parts %.17g vs whole %.17g",
              (long long)n_chunks, sum, whole);
        free(parts);
    }
    const size_t empty_sizes[] = {0, 0};
    Fixture e;
    fixture_init(&e, empty_sizes, 2, 0, 1);
    CHECK(t, adamw_grad_norm_sq(pools[1], e.t, 2) == 0.0, "empty tensors give norm^2 0");
    CHECK(t, adamw_grad_norm_sq(pools[1], e.t, 0) == 0.0, "no tensors give norm^2 0");
    adamw_step(pools[1], e.t, 2, &test_hyper, 1, 1.0f);  // must not touch anything or crash
    fixture_free(&e);
    for (int p = 0; p < 3; p++) threadpool_destroy(pools[p]);
    fixture_free(&f);
    simd_env_restore(&saved);
}

static void test_clip_scale(TestCtx* t) {
    CHECK(t, adamw_clip_scale(100.0, 0.0f) == 1.0f, "clip 0 disables clipping");
    CHECK(t, adamw_clip_scale(100.0, -1.0f) == 1.0f, "negative clip disables clipping");
    CHECK(t, adamw_clip_scale(0.5, 1.0f) == 1.0f, "norm below clip: factor 1");
    CHECK(t, adamw_clip_scale(0.0, 1.0f) == 1.0f, "zero norm: factor 1");
    CHECK_NEAR(t, adamw_clip_scale(10.0, 1.0f), 1.0 / (10.0 + 1e-6), 1e-8, "norm 10, clip 1");
    CHECK_NEAR(t, adamw_clip_scale(4.0, 2.0f), 2.0 / (4.0 + 1e-6), 4e-8, "norm 4, clip 2");
    CHECK(t, adamw_clip_scale(INFINITY, 1.0f) == 0.0f, "infinite norm: factor 0");
    CHECK(t, isnan(adamw_clip_scale(NAN, 1.0f)), "NaN norm: NaN factor");
    CHECK(t, adamw_clip_scale(NAN, 0.0f) == 1.0f, "NaN norm, clipping off: 1");
}

static void test_simd_name(TestCtx* t) {
    SimdEnv saved = simd_env_save();
    unsetenv("ROUNDPIPE_SIMD");
    const char* best = adamw_simd_name();
    CHECK(t,
          strcmp(best, "scalar") == 0 || strcmp(best, "avx2") == 0 || strcmp(best, "avx512") == 0,
          "unexpected path name %s", best);
    CHECK(t, simd_force("scalar"), "scalar can be forced");
    setenv("ROUNDPIPE_SIMD", "avx512", 1);  // asking for the top gives the best available
    CHECK(t, strcmp(adamw_simd_name(), best) == 0, "avx512 request gave %s, best is %s",
          adamw_simd_name(), best);
    simd_env_restore(&saved);
}

// ----------------------------------------------------------------------------
// LR schedules

static float lr_at(LrScheduleType type, int warmup, int total, float min_frac, float decay_frac,
                   int64_t step) {
    LrSchedule s = {.type = type,
                    .max_lr = 1.0f,
                    .warmup = warmup,
                    .total_steps = total,
                    .min_lr_frac = min_frac,
                    .decay_frac = decay_frac};
    return lr_schedule_at(&s, step);
}

static void test_lr_schedules(TestCtx* t) {
    const double tol = 1e-6;
    // constant with warmup 10 over 100 steps; min_lr_frac is ignored
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 1), 0.1, tol, "constant step 1");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 5), 0.5, tol, "constant step 5");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 10), 1.0, tol, "constant warmup end");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 11), 1.0, tol, "constant after warmup");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 100), 1.0, tol, "constant end");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 1000), 1.0, tol, "constant past end");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 10, 100, 0.1f, 0, 0), 0.1, tol, "step 0 counts as 1");
    CHECK_NEAR(t, lr_at(LR_CONSTANT, 0, 100, 0.1f, 0, 1), 1.0, tol, "no warmup: max at step 1");

    // cosine: warmup 10, decay over 100 steps to 0.1
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 1), 0.1, tol, "cosine step 1");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 10), 1.0, tol, "cosine warmup end");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 11), 0.1 + 0.9 * 0.5 * (1 + cos(M_PI / 100)),
               tol, "cosine first decay step");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 60), 0.55, tol, "cosine middle");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 35), 0.1 + 0.9 * 0.5 * (1 + cos(M_PI / 4)),
               tol, "cosine quarter");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 110), 0.1, tol, "cosine end = min_lr");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 110, 0.1f, 0, 500), 0.1, tol, "cosine past end");
    CHECK_NEAR(t, lr_at(LR_COSINE, 0, 100, 0.0f, 0, 100), 0.0, tol, "cosine to zero");
    int monotone = 1;
    for (int s = 11; s <= 110; s++)
        monotone &=
            lr_at(LR_COSINE, 10, 110, 0.1f, 0, s) <= lr_at(LR_COSINE, 10, 110, 0.1f, 0, s - 1);
    CHECK(t, monotone, "cosine decays monotonically");

    // linear
    CHECK_NEAR(t, lr_at(LR_LINEAR, 10, 110, 0.1f, 0, 10), 1.0, tol, "linear warmup end");
    CHECK_NEAR(t, lr_at(LR_LINEAR, 10, 110, 0.1f, 0, 35), 0.775, tol, "linear quarter");
    CHECK_NEAR(t, lr_at(LR_LINEAR, 10, 110, 0.1f, 0, 60), 0.55, tol, "linear middle");
    CHECK_NEAR(t, lr_at(LR_LINEAR, 10, 110, 0.1f, 0, 110), 0.1, tol, "linear end");
    CHECK_NEAR(t, lr_at(LR_LINEAR, 10, 110, 0.1f, 0, 111), 0.1, tol, "linear past end");

    // wsd: D = 100, decay_frac 0.2 -> the last 20 steps (91..110) decay
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 5), 0.5, tol, "wsd warmup");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 60), 1.0, tol, "wsd stable");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 90), 1.0, tol, "wsd last stable step");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 91), 1.0 - 0.9 / 20, tol,
               "wsd first decay step");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 100), 0.55, tol, "wsd decay middle");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 110), 0.1, tol, "wsd end");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.2f, 1000), 0.1, tol, "wsd past end");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 0.0f, 110), 1.0, tol, "wsd decay_frac 0: no decay");
    CHECK_NEAR(t, lr_at(LR_WSD, 10, 110, 0.1f, 1.0f, 60), 0.55, tol, "wsd decay_frac 1 = linear");

    // total <= warmup: the schedule never leaves warmup, and past the end holds its last value
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 5, 0.1f, 0, 5), 0.5, tol, "short run: warmup value at end");
    CHECK_NEAR(t, lr_at(LR_COSINE, 10, 5, 0.1f, 0, 7), 0.5, tol, "short run: clamped past end");

    // max_lr scales everything
    LrSchedule s = {
        .type = LR_LINEAR, .max_lr = 3e-4f, .warmup = 10, .total_steps = 110, .min_lr_frac = 0.1f};
    CHECK_NEAR(t, lr_schedule_at(&s, 60), 3e-4 * 0.55, 1e-10, "linear middle with max_lr 3e-4");
}

static void test_lr_schedule_parse(TestCtx* t) {
    const LrScheduleType types[] = {LR_CONSTANT, LR_COSINE, LR_LINEAR, LR_WSD};
    for (int i = 0; i < 4; i++) {
        LrScheduleType got = LR_CONSTANT;
        const char* name = lr_schedule_name(types[i]);
        CHECK(t, lr_schedule_parse(name, &got) == 0 && got == types[i], "round trip of %s", name);
    }
    LrScheduleType x = LR_LINEAR;
    CHECK(t, lr_schedule_parse("Cosine", &x) == -1, "names are case-sensitive");
    CHECK(t, lr_schedule_parse("cos", &x) == -1, "unknown name");
    CHECK(t, lr_schedule_parse("", &x) == -1, "empty name");
    CHECK(t, x == LR_LINEAR, "a failed parse leaves the output alone");
    CHECK(t, strcmp(lr_schedule_name((LrScheduleType)42), "unknown") == 0, "out-of-range type");
}

// ----------------------------------------------------------------------------
// one optimizer step: adamw_update against its parts

// The whole step in one call (plain training) and the same step the way the engine's optimizer
// runs it (the norm in parts, groups deepest first, then the update applied group by group,
// shallowest first) give the same weights, m, v and bf16 copies bit for bit, and the factors of
// the step: sqrt of the norm^2, the schedule's lr, the clip factor.
static void test_update_in_groups(TestCtx* t) {
    Fixture whole, grouped;
    fixture_init(&whole, fix_sizes, FIX_N_SIZES, 1, 77);
    fixture_init(&grouped, fix_sizes, FIX_N_SIZES, 1, 77);
    ThreadPool* pool = threadpool_create(t->n_threads);
    const LrSchedule sched = {
        .type = LR_COSINE, .max_lr = 1e-2f, .warmup = 2, .total_steps = 6, .min_lr_frac = 0.1f};
    const int groups[] = {0, 2, 3, 6, FIX_N_SIZES};  // tensor ranges, like the engine's layers
    const int n_groups = (int)(sizeof groups / sizeof groups[0]) - 1;
    const int64_t n_chunks = adamw_chunk_count(grouped.t, grouped.n);
    double* parts = calloc_check((size_t)n_chunks, sizeof(double));
    Rng ra, rb;
    rng_seed(&ra, 5);
    rng_seed(&rb, 5);
    for (int64_t step = 1; step <= 6; step++) {
        const float clip = step % 2 ? 1.0f : 0.0f;  // clipping on and off
        fixture_new_grads(&whole, &ra, 1.0f);
        fixture_new_grads(&grouped, &rb, 1.0f);
        const AdamWUpdate a = adamw_update(pool, whole.t, whole.n, &test_hyper, &sched, clip, step);
        for (int g = n_groups - 1; g >= 0; g--)
            adamw_grad_norm_sq_parts(pool, grouped.t + groups[g], groups[g + 1] - groups[g],
                                     parts + adamw_chunk_count(grouped.t, groups[g]));
        const AdamWUpdate b = adamw_update_begin(&test_hyper, &sched, clip, step,
                                                 adamw_norm_sq_total(parts, n_chunks));
        for (int g = 0; g < n_groups; g++)
            adamw_update_apply(pool, &b, grouped.t + groups[g], groups[g + 1] - groups[g]);
        const double norm_sq = adamw_grad_norm_sq(NULL, whole.t, whole.n);
        CHECK(t, a.step == step && b.step == step, "step %lld: step numbers", (long long)step);
        CHECK(t, a.norm == b.norm && a.norm == sqrt(norm_sq), "step %lld: norm %.17g vs %.17g",
              (long long)step, a.norm, b.norm);
        CHECK(t, a.hyper.lr == lr_schedule_at(&sched, step) && b.hyper.lr == a.hyper.lr,
              "step %lld: lr %g vs %g", (long long)step, (double)a.hyper.lr, (double)b.hyper.lr);
        CHECK(t, a.clip_scale == adamw_clip_scale(a.norm, clip) && b.clip_scale == a.clip_scale,
              "step %lld: clip factor %g vs %g", (long long)step, (double)a.clip_scale,
              (double)b.clip_scale);
        CHECK(t, a.hyper.beta1 == test_hyper.beta1 && a.hyper.weight_decay == test_hyper.weight_decay,
              "step %lld: the other hyper-parameters pass through", (long long)step);
    }
    size_t differ = 0;
    for (int i = 0; i < whole.n; i++) {
        const size_t n = whole.t[i].n;
        differ += memcmp(whole.t[i].param, grouped.t[i].param, n * sizeof(float)) != 0;
        differ += memcmp(whole.t[i].m, grouped.t[i].m, n * sizeof(float)) != 0;
        differ += memcmp(whole.t[i].v, grouped.t[i].v, n * sizeof(float)) != 0;
        differ += memcmp(whole.t[i].out_bf16, grouped.t[i].out_bf16, n * sizeof(uint16_t)) != 0;
    }
    CHECK(t, differ == 0, "%zu arrays differ between one update and the grouped update", differ);
    // sched NULL: the constant lr of the hyper-parameters
    const AdamWUpdate c = adamw_update_begin(&test_hyper, NULL, 0.0f, 3, 4.0);
    CHECK(t, c.hyper.lr == test_hyper.lr && c.norm == 2.0 && c.clip_scale == 1.0f,
          "no schedule: lr %g, norm %g, clip factor %g", (double)c.hyper.lr, c.norm,
          (double)c.clip_scale);
    free(parts);
    threadpool_destroy(pool);
    fixture_free(&whole);
    fixture_free(&grouped);
}

// ----------------------------------------------------------------------------

const TestCase tests_adamw[] = {
    {"adamw_step_matches_reference", test_step_matches_reference},
    {"adamw_bias_correction", test_bias_correction},
    {"adamw_simd_paths_agree", test_simd_paths_agree},
    {"adamw_threads_bit_identical", test_threads_bit_identical},
    {"adamw_bf16_output", test_bf16_output},
    {"adamw_nan_propagates", test_nan_propagates},
    {"adamw_grad_norm", test_grad_norm},
    {"adamw_clip_scale", test_clip_scale},
    {"adamw_update_in_groups", test_update_in_groups},
    {"adamw_simd_name", test_simd_name},
    {"adamw_lr_schedules", test_lr_schedules},
    {"adamw_lr_schedule_parse", test_lr_schedule_parse},
    {NULL, NULL},
};
