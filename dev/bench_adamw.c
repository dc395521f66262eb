/*
 * bench_adamw.c — throughput of the CPU AdamW step and gradient norm (llmc/adamw.c) per thread
 * count. A standalone program with its own main; not part of the trainer build.
 *
 * Build and run from the repository root:
 *   gcc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -O3 -pthread -o bench_adamw \
 *       dev/bench_adamw.c llmc/adamw.c llmc/threads.c llmc/common.c -lm
 *   ./bench_adamw [-log2n 28 | -n PARAMS] [-tensors 64] [-steps 7] [-warmup 2] [-threads MAX]
 *                 [-bf16] [-nohuge] [-simd scalar|avx2|avx512]
 *
 * It allocates n fp32 params, grads, m and v (16 B/param: 4 GiB at the default 2^28), split into
 * `tensors` separately aligned tensors like a model's layers. For thread counts 1, 2, 4, ... up to
 * MAX (default: all online CPUs, which is always included) it runs warm-up steps, then timed steps,
 * and prints the median step time, Gparam/s and the effective bandwidth at 28 B/param (read p, g,
 * m, v; write p, m, v; 30 B with -bf16, which also writes the bf16 copy), plus the same for the
 * gradient norm (4 B/param). The state arrays are advised to use transparent huge pages as the
 * trainer's store is (huge_alloc_check); -nohuge leaves them on normal pages. -simd sets
 * ROUNDPIPE_SIMD to force a lower inner loop.
 *
 * Target (docs/PERFORMANCE.md §5): >= 4.0 Gparam/s on the 16-core H200 host, the speed of
 * PyTorch's fused CPU AdamW.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../llmc/adamw.h"
#include "../llmc/common.h"
#include "../llmc/threads.h"

// ----------------------------------------------------------------------------
// options

typedef struct BenchOpts {
    size_t n;       // total parameters
    int n_tensors;  // how many tensors they are split into
    int steps;      // timed steps per thread count (median reported)
    int warmup;     // untimed steps per thread count
    int max_threads;
    int bf16;  // also write the bf16 copy
    int huge;  // state arrays advised to use transparent huge pages (as the trainer's store)
} BenchOpts;

static void bench_usage(void) {
    fprintf(stderr,
            "usage: bench_adamw [-log2n K | -n PARAMS] [-tensors T] [-steps S] [-warmup W]\n"
            "                   [-threads MAX] [-bf16] [-simd scalar|avx2|avx512]\n");
    exit(2);
}

static int64_t bench_arg_int(int argc, char** argv, int i, int64_t lo, int64_t hi) {
    int64_t v;
    if (i + 1 >= argc || parse_int64(argv[i + 1], &v) != 0 || v < lo || v > hi) {
        fprintf(stderr, "bench_adamw: %s needs an integer in [%lld, %lld]\n", argv[i],
                (long long)lo, (long long)hi);
        bench_usage();
    }
    return v;
}

static BenchOpts bench_parse_args(int argc, char** argv) {
    BenchOpts o = {.n = (size_t)1 << 28, .n_tensors = 64, .steps = 7, .warmup = 2,
                   .max_threads = threads_online_cpus(), .bf16 = 0, .huge = 1};
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (strcmp(a, "-log2n") == 0) {
            o.n = (size_t)1 << bench_arg_int(argc, argv, i++, 4, 34);
        } else if (strcmp(a, "-n") == 0) {
            o.n = (size_t)bench_arg_int(argc, argv, i++, 1, 1LL << 34);
        } else if (strcmp(a, "-tensors") == 0) {
            o.n_tensors = (int)bench_arg_int(argc, argv, i++, 1, 100000);
        } else if (strcmp(a, "-steps") == 0) {
            o.steps = (int)bench_arg_int(argc, argv, i++, 5, 10000);
        } else if (strcmp(a, "-warmup") == 0) {
            o.warmup = (int)bench_arg_int(argc, argv, i++, 0, 10000);
        } else if (strcmp(a, "-threads") == 0) {
            o.max_threads = (int)bench_arg_int(argc, argv, i++, 1, 4096);
        } else if (strcmp(a, "-bf16") == 0) {
            o.bf16 = 1;
        } else if (strcmp(a, "-nohuge") == 0) {
            o.huge = 0;
        } else if (strcmp(a, "-simd") == 0 && i + 1 < argc) {
            setenv("ROUNDPIPE_SIMD", argv[++i], 1);  // read by adamw_simd_name / adamw_step
        } else {
            bench_usage();
        }
    }
    if ((size_t)o.n_tensors > o.n) o.n_tensors = (int)o.n;
    return o;
}

// ----------------------------------------------------------------------------
// buffers

typedef struct BenchState {
    AdamWTensor* t;  // (n_tensors,)
    int n_tensors;
    size_t n;
} BenchState;

// First touch happens in the fill below, which runs on the pool so pages spread over the threads'
// memory nodes instead of all landing on the main thread's node.
typedef struct FillJob {
    AdamWTensor* t;
} FillJob;

static void bench_fill_task(void* arg, int64_t i) {
    AdamWTensor* t = &((FillJob*)arg)->t[i];
    uint32_t h = 2166136261u ^ (uint32_t)i;
    for (size_t j = 0; j < t->n; j++) {
        h = h * 1664525u + 1013904223u;  // LCG: cheap, deterministic values in [-1, 1)
        float u = (float)(h >> 8) * (1.0f / 8388608.0f) - 1.0f;
        t->param[j] = 0.02f * u;
        ((float*)t->grad)[j] = 1e-3f * u * u - 5e-4f;
        t->m[j] = 0.0f;
        t->v[j] = 0.0f;
        if (t->out_bf16) t->out_bf16[j] = 0;
    }
}

static float* bench_floats(const BenchOpts* o, size_t n) {
    return o->huge ? huge_alloc_check(n * sizeof(float)) : aligned_alloc_check(n * sizeof(float));
}

static BenchState bench_alloc(const BenchOpts* o, ThreadPool* pool) {
    BenchState s = {.n_tensors = o->n_tensors, .n = o->n};
    s.t = calloc_check((size_t)o->n_tensors, sizeof(AdamWTensor));
    size_t per = o->n / (size_t)o->n_tensors, extra = o->n % (size_t)o->n_tensors;
    for (int i = 0; i < o->n_tensors; i++) {
        AdamWTensor* t = &s.t[i];
        t->n = per + ((size_t)i < extra ? 1 : 0);
        t->param = bench_floats(o, t->n);
        t->grad = bench_floats(o, t->n);
        t->m = bench_floats(o, t->n);
        t->v = bench_floats(o, t->n);
        t->decay = (i % 4 != 3);  // most weights decay; norms and biases do not
        t->out_bf16 = o->bf16 ? aligned_alloc_check(t->n * sizeof(uint16_t)) : NULL;
    }
    FillJob job = {s.t};
    threadpool_run(pool, o->n_tensors, bench_fill_task, &job);
    return s;
}

static void bench_free(BenchState* s) {
    for (int i = 0; i < s->n_tensors; i++) {
        free(s->t[i].param);
        free((float*)s->t[i].grad);
        free(s->t[i].m);
        free(s->t[i].v);
        free(s->t[i].out_bf16);
    }
    free(s->t);
}

// ----------------------------------------------------------------------------
// timing

static int cmp_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

static double median(double* x, int n) {
    qsort(x, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

typedef struct BenchResult {
    double step_s;  // median seconds per AdamW step
    double norm_s;  // median seconds per grad-norm pass
} BenchResult;

static BenchResult bench_run(const BenchOpts* o, BenchState* s, int n_threads, int64_t* step) {
    ThreadPool* pool = threadpool_create(n_threads);
    AdamWHyper h = {.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    double* ts = malloc_check((size_t)o->steps * sizeof(double));
    double* tn = malloc_check((size_t)o->steps * sizeof(double));
    double sink = 0.0;
    for (int i = 0; i < o->warmup + o->steps; i++) {
        double t0 = time_now_s();
        double nsq = adamw_grad_norm_sq(pool, s->t, s->n_tensors);
        double t1 = time_now_s();
        adamw_step(pool, s->t, s->n_tensors, &h, ++*step, adamw_clip_scale(sqrt(nsq), 1.0f));
        double t2 = time_now_s();
        sink += nsq;
        if (i >= o->warmup) {
            tn[i - o->warmup] = t1 - t0;
            ts[i - o->warmup] = t2 - t1;
        }
    }
    if (!isfinite(sink)) fprintf(stderr, "warning: non-finite gradient norm\n");
    BenchResult r = {median(ts, o->steps), median(tn, o->steps)};
    free(ts);
    free(tn);
    threadpool_destroy(pool);
    return r;
}

// ----------------------------------------------------------------------------

int main(int argc, char** argv) {
    BenchOpts o = bench_parse_args(argc, argv);
    double bytes_per_param = o.bf16 ? 30.0 : 28.0;
    printf("bench_adamw: %zu params (%.2f GiB of fp32 state%s) in %d tensors, simd %s, %d online "
           "CPUs\n",
           o.n, (double)o.n * (o.bf16 ? 18.0 : 16.0) / (1 << 30), o.bf16 ? " + bf16 copy" : "",
           o.n_tensors, adamw_simd_name(), threads_online_cpus());
    printf("median of %d steps after %d warm-up; step bandwidth counts %.0f B/param, "
           "norm 4 B/param\n",
           o.steps, o.warmup, bytes_per_param);

    ThreadPool* fill_pool = threadpool_create(o.max_threads);
    double t0 = time_now_s();
    BenchState s = bench_alloc(&o, fill_pool);
    threadpool_destroy(fill_pool);
    printf("allocated and filled in %.2fs\n\n", time_now_s() - t0);

    printf("%7s %10s %10s %9s %10s %10s\n", "threads", "step ms", "Gparam/s", "GB/s", "norm ms",
           "norm GB/s");
    int64_t step = 0;
    for (int nt = 1;; nt *= 2) {
        if (nt > o.max_threads) nt = o.max_threads;
        BenchResult r = bench_run(&o, &s, nt, &step);
        double gps = (double)o.n / r.step_s * 1e-9;
        printf("%7d %10.2f %10.3f %9.1f %10.2f %10.1f\n", nt, r.step_s * 1e3, gps,
               gps * bytes_per_param, r.norm_s * 1e3, (double)o.n * 4.0 / r.norm_s * 1e-9);
        fflush(stdout);
        if (nt == o.max_threads) break;
    }
    bench_free(&s);
    return 0;
}
