/*
 * adamw.c — the CPU AdamW step, the global gradient norm, the clipping factor, LR schedules and
 * the sequence of one optimizer step that joins them (adamw_update).
 *
 * Both passes split the concatenation of all tensors into chunks of ADAMW_CHUNK elements (a chunk
 * never spans two tensors) and hand the chunks to the thread pool as tasks. A chunk's result
 * depends only on its own elements, so the numbers do not depend on the thread count.
 *
 * The per-element work exists three times: AVX-512F, AVX2 and scalar. The vector versions are
 * compiled with __attribute__((target(...))) and picked at run time, so the binary needs no -march
 * flag and still runs on older CPUs. All three perform the same IEEE fp32 operations in the same
 * order (mul and add kept separate with optimize("fp-contract=off"), true sqrt and division, no
 * fast-math), so they produce bit-identical results, and NaN/Inf propagate exactly as in the
 * scalar math. The grad norm squares each float in double (exact) and sums into 16 fixed double
 * lanes, so it too is identical across paths.
 */
#include "adamw.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// SIMD path selection

typedef enum { SIMD_SCALAR = 0, SIMD_AVX2, SIMD_AVX512 } SimdPath;

static const char* const simd_names[] = {"scalar", "avx2", "avx512"};

// Best path the CPU (and OS) supports, lowered by ROUNDPIPE_SIMD if set. Evaluated per call (a
// getenv and a cpuid-table lookup) because the code base keeps no mutable globals.
static SimdPath adamw_simd_select(void) {
    __builtin_cpu_init();
    SimdPath best = SIMD_SCALAR;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = SIMD_AVX2;
    if (__builtin_cpu_supports("avx512f")) best = SIMD_AVX512;
    const char* env = getenv("ROUNDPIPE_SIMD");
    if (env == NULL || env[0] == '\0') return best;
    for (SimdPath want = SIMD_SCALAR; want <= SIMD_AVX512; want++) {
        // A request above what the CPU has gets the best it has.
        if (strcmp(env, simd_names[want]) == 0) return want < best ? want : best;
    }
    fatal("ROUNDPIPE_SIMD=%s: expected scalar, avx2 or avx512", env);
}

const char* adamw_simd_name(void) { return simd_names[adamw_simd_select()]; }

// Software prefetch distance in floats (2 KiB ahead on every stream). Measured on the 16-core
// H200 host: about +15% for the step (4.9 -> 5.6 Gparam/s) and the norm at 16 threads; the
// hardware prefetcher alone does not keep enough lines in flight per core. Prefetching past the
// end of an array is harmless (prefetches never fault).
#define ADAMW_PREFETCH 512

// The address is formed as an integer: pointer arithmetic past the end of an array is undefined.
static inline void prefetch_ahead(const float* x) {
    _mm_prefetch((const char*)((uintptr_t)x + ADAMW_PREFETCH * sizeof(float)), _MM_HINT_T0);
}

// ----------------------------------------------------------------------------
// chunk list

typedef struct AdamWChunk {
    int tensor;
    size_t offset;  // first element inside the tensor
    size_t len;     // 1..ADAMW_CHUNK
} AdamWChunk;

// Split every tensor into ADAMW_CHUNK-element chunks, in tensor order. Returns a malloc'd array
// (NULL when there are no elements) and its length in *n_chunks.
static AdamWChunk* adamw_build_chunks(const AdamWTensor* t, int n_tensors, int64_t* n_chunks) {
    size_t count = 0;
    for (int i = 0; i < n_tensors; i++) count += ceil_div(t[i].n, ADAMW_CHUNK);
    *n_chunks = (int64_t)count;
    if (count == 0) return NULL;
    size_t bytes;
    if (size_mul(count, sizeof(AdamWChunk), &bytes) != 0)
        fatal("adamw: too many chunks (%zu)", count);
    AdamWChunk* chunks = malloc_check(bytes);
    size_t k = 0;
    for (int i = 0; i < n_tensors; i++) {
        for (size_t off = 0; off < t[i].n; off += ADAMW_CHUNK) {
            size_t left = t[i].n - off;
            chunks[k++] = (AdamWChunk){i, off, left < ADAMW_CHUNK ? left : ADAMW_CHUNK};
        }
    }
    return chunks;
}

// ----------------------------------------------------------------------------
// gradient norm: sum of squares per chunk, 16 double lanes (lane j takes elements i with
// i % 16 == j inside each full block of 16), lanes added in order, then the tail in order.
// A float squared in double is exact, so fma and mul+add give the same lane sums.

#define NORM_LANES 16

static double norm_finish(const double* lanes, const float* g, size_t i, size_t n) {
    double s = 0.0;
    for (int j = 0; j < NORM_LANES; j++) s += lanes[j];
    for (; i < n; i++) s += (double)g[i] * (double)g[i];
    return s;
}

static double norm_chunk_scalar(const float* g, size_t n) {
    double lanes[NORM_LANES] = {0};
    size_t i = 0;
    for (; i + NORM_LANES <= n; i += NORM_LANES)
        for (int j = 0; j < NORM_LANES; j++) lanes[j] += (double)g[i + j] * (double)g[i + j];
    return norm_finish(lanes, g, i, n);
}

__attribute__((target("avx2,fma"))) static double norm_chunk_avx2(const float* g, size_t n) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                      _mm256_setzero_pd()};
    size_t i = 0;
    for (; i + NORM_LANES <= n; i += NORM_LANES) {
        prefetch_ahead(g + i);
        for (int q = 0; q < 4; q++) {
            __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4 * q));
            acc[q] = _mm256_fmadd_pd(x, x, acc[q]);
        }
    }
    double lanes[NORM_LANES];
    for (int q = 0; q < 4; q++) _mm256_storeu_pd(lanes + 4 * q, acc[q]);
    return norm_finish(lanes, g, i, n);
}

__attribute__((target("avx512f"))) static double norm_chunk_avx512(const float* g, size_t n) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    size_t i = 0;
    for (; i + NORM_LANES <= n; i += NORM_LANES) {
        prefetch_ahead(g + i);
        __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(g + i));
        __m512d b = _mm512_cvtps_pd(_mm256_loadu_ps(g + i + 8));
        lo = _mm512_fmadd_pd(a, a, lo);
        hi = _mm512_fmadd_pd(b, b, hi);
    }
    double lanes[NORM_LANES];
    _mm512_storeu_pd(lanes, lo);
    _mm512_storeu_pd(lanes + 8, hi);
    return norm_finish(lanes, g, i, n);
}

typedef struct NormJob {
    const AdamWTensor* t;
    const AdamWChunk* chunks;
    SimdPath simd;
    double* sums;  // (n_chunks,) one partial sum per chunk
} NormJob;

static void norm_task(void* arg, int64_t task) {
    const NormJob* job = arg;
    const AdamWChunk* c = &job->chunks[task];
    const float* g = job->t[c->tensor].grad + c->offset;
    double s;
    switch (job->simd) {
        case SIMD_AVX512: s = norm_chunk_avx512(g, c->len); break;
        case SIMD_AVX2: s = norm_chunk_avx2(g, c->len); break;
        default: s = norm_chunk_scalar(g, c->len); break;
    }
    job->sums[task] = s;
}

int64_t adamw_chunk_count(const AdamWTensor* t, int n_tensors) {
    int64_t count = 0;
    for (int i = 0; i < n_tensors; i++) count += (int64_t)ceil_div(t[i].n, ADAMW_CHUNK);
    return count;
}

void adamw_grad_norm_sq_parts(ThreadPool* pool, const AdamWTensor* t, int n_tensors, double* sums) {
    if (n_tensors <= 0) return;
    int64_t n_chunks;
    AdamWChunk* chunks = adamw_build_chunks(t, n_tensors, &n_chunks);
    if (n_chunks == 0) return;
    NormJob job = {t, chunks, adamw_simd_select(), sums};
    threadpool_run(pool, n_chunks, norm_task, &job);
    free(chunks);
}

double adamw_norm_sq_total(const double* sums, int64_t n_chunks) {
    // Chunk sums in chunk order: the same total whatever thread ran which chunk, and whatever
    // order the chunks were computed in.
    double total = 0.0;
    for (int64_t k = 0; k < n_chunks; k++) total += sums[k];
    return total;
}

double adamw_grad_norm_sq(ThreadPool* pool, const AdamWTensor* t, int n_tensors) {
    const int64_t n_chunks = adamw_chunk_count(t, n_tensors);
    if (n_chunks == 0) return 0.0;
    double* sums = malloc_check((size_t)n_chunks * sizeof(double));
    adamw_grad_norm_sq_parts(pool, t, n_tensors, sums);
    double total = adamw_norm_sq_total(sums, n_chunks);
    free(sums);
    return total;
}

float adamw_clip_scale(double norm, float clip) {
    if (clip <= 0.0f) return 1.0f;
    // torch.nn.utils.clip_grad_norm_: a NaN norm gives a NaN factor (the step then poisons the
    // weights visibly instead of silently skipping the clip); an infinite norm gives 0.
    if (isnan(norm)) return NAN;
    double coef = (double)clip / (norm + 1e-6);
    return coef < 1.0 ? (float)coef : 1.0f;
}

// ----------------------------------------------------------------------------
// the AdamW step

// fp32 factors of one step, computed once in double.
typedef struct AdamWConsts {
    float grad_scale;
    float b1, one_minus_b1;
    float b2, one_minus_b2;
    float step_size;     // lr / (1 - b1^t)
    float inv_sqrt_bc2;  // 1 / sqrt(1 - b2^t)
    float eps;
    float decay_factor;  // 1 - lr*wd (tensors with decay; others use 1)
} AdamWConsts;

// The reference element update; the vector loops do exactly these operations in this order.
static inline void adamw_update_one(const AdamWConsts* k, float decay, float* p, float grad,
                                    float* m, float* v) {
    float g = grad * k->grad_scale;
    float mi = k->b1 * *m + k->one_minus_b1 * g;
    float vi = k->b2 * *v + (k->one_minus_b2 * g) * g;
    float denom = sqrtf(vi) * k->inv_sqrt_bc2 + k->eps;
    *p = *p * decay - k->step_size * (mi / denom);
    *m = mi;
    *v = vi;
}

// The vector loops call this for their tails. noinline keeps it compiled for the base ISA (not
// re-optimized inside an AVX2 caller) and fp-contract=off keeps mul and add separate even in a GNU
// mode or with -march flags, so tails and the scalar path match the vector loops bit for bit.
__attribute__((noinline, optimize("fp-contract=off"))) static void step_chunk_scalar(
    const AdamWConsts* k, float decay, float* p, const float* g, float* m, float* v, uint16_t* out,
    size_t n) {
    for (size_t i = 0; i < n; i++) {
        adamw_update_one(k, decay, &p[i], g[i], &m[i], &v[i]);
        if (out) out[i] = f32_to_bf16(p[i]);
    }
}

static inline void step_prefetch(const float* p, const float* g, const float* m, const float* v,
                                 size_t i) {
    prefetch_ahead(p + i);
    prefetch_ahead(g + i);
    prefetch_ahead(m + i);
    prefetch_ahead(v + i);
}

// fp-contract=off: keep mul and add separate even if the file is built in a GNU mode (where GCC
// would fuse them into FMAs and break bit-identity with the scalar path).
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) static void step_chunk_avx2(
    const AdamWConsts* k, float decay, float* p, const float* g, float* m, float* v, uint16_t* out,
    size_t n) {
    const __m256 scale = _mm256_set1_ps(k->grad_scale);
    const __m256 b1 = _mm256_set1_ps(k->b1), omb1 = _mm256_set1_ps(k->one_minus_b1);
    const __m256 b2 = _mm256_set1_ps(k->b2), omb2 = _mm256_set1_ps(k->one_minus_b2);
    const __m256 step = _mm256_set1_ps(k->step_size), ibc2 = _mm256_set1_ps(k->inv_sqrt_bc2);
    const __m256 eps = _mm256_set1_ps(k->eps), dec = _mm256_set1_ps(decay);
    const __m256i round_base = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i qnan_bit = _mm256_set1_epi32(0x40);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (i % 16 == 0) step_prefetch(p, g, m, v, i);  // once per 64-byte line
        __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), scale);
        __m256 mi =
            _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(omb1, gi));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)),
                                  _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
        __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vi), ibc2), eps);
        __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), dec),
                                  _mm256_mul_ps(step, _mm256_div_ps(mi, denom)));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        _mm256_storeu_ps(p + i, pi);
        if (out) {
            // bf16 round to nearest even (as f32_to_bf16): (u + 0x7fff + ((u >> 16) & 1)) >> 16;
            // NaN lanes keep their top half with the quiet bit set.
            __m256i u = _mm256_castps_si256(pi);
            __m256i hi = _mm256_srli_epi32(u, 16);
            __m256i r =
                _mm256_add_epi32(u, _mm256_add_epi32(round_base, _mm256_and_si256(hi, one)));
            r = _mm256_srli_epi32(r, 16);
            __m256i nan_mask = _mm256_castps_si256(_mm256_cmp_ps(pi, pi, _CMP_UNORD_Q));
            r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, qnan_bit), nan_mask);
            // Values fit in 16 bits, so the saturating pack is a plain narrowing.
            __m128i packed =
                _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            _mm_storeu_si128((__m128i*)(out + i), packed);
        }
    }
    step_chunk_scalar(k, decay, p + i, g + i, m + i, v + i, out ? out + i : NULL, n - i);
}

__attribute__((target("avx512f"), optimize("fp-contract=off"))) static void step_chunk_avx512(
    const AdamWConsts* k, float decay, float* p, const float* g, float* m, float* v, uint16_t* out,
    size_t n) {
    const __m512 scale = _mm512_set1_ps(k->grad_scale);
    const __m512 b1 = _mm512_set1_ps(k->b1), omb1 = _mm512_set1_ps(k->one_minus_b1);
    const __m512 b2 = _mm512_set1_ps(k->b2), omb2 = _mm512_set1_ps(k->one_minus_b2);
    const __m512 step = _mm512_set1_ps(k->step_size), ibc2 = _mm512_set1_ps(k->inv_sqrt_bc2);
    const __m512 eps = _mm512_set1_ps(k->eps), dec = _mm512_set1_ps(decay);
    const __m512i round_base = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i qnan_bit = _mm512_set1_epi32(0x40);
    size_t i = 0;
    // The bf16 copy is only read later (by the upload's DMA): streaming stores skip the read
    // for ownership of its lines (2 of the ~32 bytes of memory traffic per element). They need
    // 32-byte alignment, so the first few elements go through the (bit-identical) scalar loop.
    if (out) {
        size_t head = (size_t)((32 - ((uintptr_t)out & 31)) & 31) / sizeof(uint16_t);
        if ((uintptr_t)out % sizeof(uint16_t) != 0 || head > n) head = n;
        step_chunk_scalar(k, decay, p, g, m, v, out, head);
        i = head;
    }
    for (; i + 16 <= n; i += 16) {
        step_prefetch(p, g, m, v, i);
        __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), scale);
        __m512 mi =
            _mm512_add_ps(_mm512_mul_ps(b1, _mm512_loadu_ps(m + i)), _mm512_mul_ps(omb1, gi));
        __m512 vi = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(v + i)),
                                  _mm512_mul_ps(_mm512_mul_ps(omb2, gi), gi));
        __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), ibc2), eps);
        __m512 pi = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), dec),
                                  _mm512_mul_ps(step, _mm512_div_ps(mi, denom)));
        _mm512_storeu_ps(m + i, mi);
        _mm512_storeu_ps(v + i, vi);
        _mm512_storeu_ps(p + i, pi);
        if (out) {
            // Same rounding as the AVX2 loop; vpmovdw (AVX-512F) narrows 32 -> 16 bits.
            __m512i u = _mm512_castps_si512(pi);
            __m512i hi = _mm512_srli_epi32(u, 16);
            __m512i r =
                _mm512_add_epi32(u, _mm512_add_epi32(round_base, _mm512_and_si512(hi, one)));
            r = _mm512_srli_epi32(r, 16);
            __mmask16 nan_mask = _mm512_cmp_ps_mask(pi, pi, _CMP_UNORD_Q);
            r = _mm512_mask_or_epi32(r, nan_mask, hi, qnan_bit);
            _mm256_stream_si256((__m256i*)(out + i), _mm512_cvtepi32_epi16(r));
        }
    }
    if (out) _mm_sfence();  // the streamed stores are visible before the task reports done
    step_chunk_scalar(k, decay, p + i, g + i, m + i, v + i, out ? out + i : NULL, n - i);
}

typedef struct StepJob {
    const AdamWTensor* t;
    const AdamWChunk* chunks;
    AdamWConsts k;
    SimdPath simd;
} StepJob;

static void step_task(void* arg, int64_t task) {
    const StepJob* job = arg;
    const AdamWChunk* c = &job->chunks[task];
    const AdamWTensor* t = &job->t[c->tensor];
    size_t o = c->offset;
    // Multiplying by exactly 1 keeps one loop for both kinds of tensor and changes no value.
    float decay = t->decay ? job->k.decay_factor : 1.0f;
    uint16_t* out = t->out_bf16 ? t->out_bf16 + o : NULL;
    switch (job->simd) {
        case SIMD_AVX512:
            step_chunk_avx512(&job->k, decay, t->param + o, t->grad + o, t->m + o, t->v + o, out,
                              c->len);
            break;
        case SIMD_AVX2:
            step_chunk_avx2(&job->k, decay, t->param + o, t->grad + o, t->m + o, t->v + o, out,
                            c->len);
            break;
        default:
            step_chunk_scalar(&job->k, decay, t->param + o, t->grad + o, t->m + o, t->v + o, out,
                              c->len);
            break;
    }
}

void adamw_step(ThreadPool* pool, const AdamWTensor* t, int n_tensors, const AdamWHyper* h,
                int64_t step, float grad_scale) {
    if (step < 1) fatal("adamw_step: step must be >= 1 (got %lld)", (long long)step);
    if (n_tensors <= 0) return;
    int64_t n_chunks;
    AdamWChunk* chunks = adamw_build_chunks(t, n_tensors, &n_chunks);
    if (n_chunks == 0) return;

    double lr = h->lr, b1 = h->beta1, b2 = h->beta2;
    double bc1 = 1.0 - pow(b1, (double)step);
    double bc2 = 1.0 - pow(b2, (double)step);
    StepJob job = {
        .t = t,
        .chunks = chunks,
        .k = {.grad_scale = grad_scale,
              .b1 = h->beta1,
              .one_minus_b1 = (float)(1.0 - b1),
              .b2 = h->beta2,
              .one_minus_b2 = (float)(1.0 - b2),
              .step_size = (float)(lr / bc1),
              .inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2)),
              .eps = h->eps,
              .decay_factor = (float)(1.0 - lr * (double)h->weight_decay)},
        .simd = adamw_simd_select(),
    };
    threadpool_run(pool, n_chunks, step_task, &job);
    free(chunks);
}

// ----------------------------------------------------------------------------
// one optimizer step: global norm -> clip factor -> scheduled lr -> AdamW

AdamWUpdate adamw_update_begin(const AdamWHyper* h, const LrSchedule* sched, float grad_clip,
                               int64_t step, double norm_sq) {
    AdamWUpdate u = {.step = step, .norm = sqrt(norm_sq), .hyper = *h};
    u.clip_scale = adamw_clip_scale(u.norm, grad_clip);
    if (sched) u.hyper.lr = lr_schedule_at(sched, step);
    return u;
}

void adamw_update_apply(ThreadPool* pool, const AdamWUpdate* u, const AdamWTensor* t,
                        int n_tensors) {
    adamw_step(pool, t, n_tensors, &u->hyper, u->step, u->clip_scale);
}

AdamWUpdate adamw_update(ThreadPool* pool, const AdamWTensor* t, int n_tensors,
                         const AdamWHyper* h, const LrSchedule* sched, float grad_clip,
                         int64_t step) {
    const AdamWUpdate u =
        adamw_update_begin(h, sched, grad_clip, step, adamw_grad_norm_sq(pool, t, n_tensors));
    adamw_update_apply(pool, &u, t, n_tensors);
    return u;
}

// ----------------------------------------------------------------------------
// learning-rate schedules

static const char* const lr_schedule_names[] = {"constant", "cosine", "linear", "wsd"};

int lr_schedule_parse(const char* s, LrScheduleType* out) {
    for (int i = 0; i < (int)(sizeof lr_schedule_names / sizeof lr_schedule_names[0]); i++) {
        if (s != NULL && strcmp(s, lr_schedule_names[i]) == 0) {
            *out = (LrScheduleType)i;
            return 0;
        }
    }
    return -1;
}

const char* lr_schedule_name(LrScheduleType t) {
    return (t >= LR_CONSTANT && t <= LR_WSD) ? lr_schedule_names[t] : "unknown";
}

float lr_schedule_at(const LrSchedule* s, int64_t step) {
    double max_lr = s->max_lr;
    int64_t W = s->warmup > 0 ? s->warmup : 0;
    int64_t T = s->total_steps;
    if (step < 1) step = 1;
    if (T >= 1 && step > T) step = T;  // past the end: the final value
    if (step <= W) return (float)(max_lr * (double)step / (double)W);
    int64_t D = T - W;  // steps after warmup
    if (s->type == LR_CONSTANT || D <= 0) return (float)max_lr;

    double min_lr = max_lr * (double)s->min_lr_frac;
    double x = (double)(step - W) / (double)D;  // (0, 1]; 1 at step T
    switch (s->type) {
        case LR_COSINE: return (float)(min_lr + (max_lr - min_lr) * 0.5 * (1.0 + cos(M_PI * x)));
        case LR_LINEAR: return (float)(max_lr - (max_lr - min_lr) * x);
        case LR_WSD: {
            double frac = s->decay_frac > 0.0f ? fmin(s->decay_frac, 1.0) : 0.0;  // NaN -> 0
            int64_t K = (int64_t)llround(frac * (double)D);  // decay steps
            if (K == 0 || step <= T - K) return (float)max_lr;
            return (float)(max_lr - (max_lr - min_lr) * (double)(step - (T - K)) / (double)K);
        }
        default: return (float)max_lr;
    }
}
