/*
 * dev/cuda/lab.cuh — what the kernel labs of dev/cuda share (llm.c's dev/cuda/common.h): the
 * command line, random inputs, host bf16 rounding, device buffers, validation with a tolerance,
 * timing, and the H200 roofline the benchmarks are read against.
 *
 * A lab is one .cu per kernel family. It includes its family's production source from kernels/
 * (so the kernel validated and timed is the one the trainer links; the Makefile links the other
 * kernels/ objects and the host library), and defines next to it:
 *   - a CPU reference in fp32 (sums in double), mirroring the bf16 roundings of the production
 *     kernels (they round where HF transformers, computing in bf16, rounds: after every tensor
 *     op);
 *   - numbered variants: 1 the straightforward port of the reference, then the production kernel
 *     (and, in some labs, alternatives that did not earn a place in kernels/);
 *   - validation of every variant, forward and backward, on fresh random inputs (the seed is
 *     printed; --seed repeats a run) against the reference with a per-element tolerance;
 *   - a benchmark on the Qwen3-1.7B shapes: median time, GB/s (memory-bound ops: the fewest bytes
 *     the op must move, each input read and each output written once) or TFLOP/s (matmuls), and
 *     the share of the roofline.
 * Exit status: 0 every check passed, 3 a check failed, 2 bad usage, 1 a CUDA error (fatal).
 */
#ifndef DEV_CUDA_LAB_CUH
#define DEV_CUDA_LAB_CUH

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "../../kernels/common.cuh"
#include "../../kernels/kernels.h"
extern "C" {
#include "../../llmc/rng.h"
}

// H200 SXM datasheet: HBM3e bandwidth and dense bf16 tensor-core throughput.
#define H200_HBM_BYTES_PER_S 4.8e12
#define H200_BF16_FLOP_PER_S 989e12

// ----------------------------------------------------------------------------
// command line

typedef struct LabArgs {
    const char* name;   // the lab ("norm", ...)
    int validate_only;  // --validate-only: no benchmark
    int variant;        // --variant K: only variant K (0: all)
    int reps;           // --reps R: timed runs per benchmark (median reported)
    uint32_t seed;      // --seed S: the random inputs (default: from the clock)
} LabArgs;

static inline void lab_usage(const char* prog, const char* variants) {
    fprintf(stderr,
            "usage: %s [--validate-only] [--variant K] [--reps R] [--seed S]\n"
            "  Validates every variant against the CPU reference on fresh random inputs, then\n"
            "  benchmarks them on the Qwen3-1.7B shapes (needs a CUDA GPU).\n"
            "  --validate-only  skip the benchmark\n"
            "  --variant K      only variant K (default: all)\n"
            "  --reps R         timed runs per benchmark, median reported (default 20)\n"
            "  --seed S         seed of the random inputs (default: from the clock; printed)\n"
            "variants:\n%s"
            "exit status: 0 passed, 3 a check failed, 2 bad usage, 1 a CUDA error\n",
            prog, variants);
}

static inline int lab_parse_int(const char* s, long lo, long hi, long* out) {
    char* end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || *end != 0 || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

// `variants`: one line per variant ("  1  naive: ...\n"); n_variants: the highest number.
static inline LabArgs lab_parse_args(int argc, char** argv, const char* name, const char* variants,
                                     int n_variants) {
    LabArgs a = {name, 0, 0, 20, (uint32_t)time(NULL)};
    for (int i = 1; i < argc; i++) {
        const char* opt = argv[i];
        if (!strcmp(opt, "-h") || !strcmp(opt, "--help")) {
            lab_usage(argv[0], variants);
            exit(0);
        }
        if (!strcmp(opt, "--validate-only")) {
            a.validate_only = 1;
            continue;
        }
        long v = 0;
        const int has_value = i + 1 < argc;
        if (!strcmp(opt, "--variant")) {
            if (has_value && lab_parse_int(argv[++i], 1, n_variants, &v) == 0) {
                a.variant = (int)v;
                continue;
            }
            fprintf(stderr, "%s: --variant takes a number in [1, %d]\n", name, n_variants);
        } else if (!strcmp(opt, "--reps")) {
            if (has_value && lab_parse_int(argv[++i], 1, 10000, &v) == 0) {
                a.reps = (int)v;
                continue;
            }
            fprintf(stderr, "%s: --reps takes a number in [1, 10000]\n", name);
        } else if (!strcmp(opt, "--seed")) {
            if (has_value && lab_parse_int(argv[++i], 0, 0xffffffffL, &v) == 0) {
                a.seed = (uint32_t)v;
                continue;
            }
            fprintf(stderr, "%s: --seed takes a number in [0, 4294967295]\n", name);
        } else {
            fprintf(stderr, "%s: unknown argument '%s'\n", name, opt);
        }
        lab_usage(argv[0], variants);
        exit(2);
    }
    return a;
}

// Whether variant v runs in this invocation.
static inline int lab_wants(const LabArgs* a, int v) {
    return a->variant == 0 || a->variant == v;
}

// ----------------------------------------------------------------------------
// the lab's context: the production backend context on GPU 0, and the check tally

typedef struct Lab {
    LabArgs args;
    CudaCtx* cx;  // from ops_cuda_create: stream, SM count, scratch, cuBLASLt
    int checks, failures;
    void* flush;  // 2x the L2 size, written before every timed run
    size_t flush_bytes;
} Lab;

static inline Lab lab_init(const LabArgs* args) {
    Lab lab;
    memset(&lab, 0, sizeof lab);
    lab.args = *args;
    if (cuda_device_count() == 0)
        fatal("%s: no CUDA device: the kernel labs need a GPU", args->name);
    lab.cx = (CudaCtx*)ops_cuda_create(0, NULL);
    int l2 = 0;
    cuda_check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    lab.flush_bytes = 2 * (size_t)(l2 > 0 ? l2 : 64 << 20);
    cuda_check(cudaMalloc(&lab.flush, lab.flush_bytes));
    printf(
        "%s lab on %s (%d SMs), seed %u; roofline: %.1f TB/s HBM, %.0f TFLOP/s dense bf16 "
        "(H200)\n",
        args->name, cuda_device_name(0), lab.cx->n_sms, args->seed, H200_HBM_BYTES_PER_S / 1e12,
        H200_BF16_FLOP_PER_S / 1e12);
    return lab;
}

// Prints the verdict, frees the context; returns the exit status.
static inline int lab_finish(Lab* lab) {
    cuda_check(cudaStreamSynchronize(lab->cx->stream));
    cuda_check(cudaFree(lab->flush));
    ops_cuda_destroy(lab->cx);
    if (lab->failures)
        printf("%s: validation FAILED (%d of %d checks)\n", lab->args.name, lab->failures,
               lab->checks);
    else
        printf("%s: validation passed (%d checks)\n", lab->args.name, lab->checks);
    return lab->failures ? 3 : 0;
}

// A lab's main(): parse the flags, open the lab, run validate(lab, v, r) for each wanted variant
// v in 1..n_validated (one Rng seeded from --seed, drawn from in variant order), then bench(lab,
// r) unless --validate-only; the exit status is lab_finish's.
static inline int lab_main(int argc, char** argv, const char* name, const char* variants,
                           int n_variants, int n_validated, void (*validate)(Lab*, int, Rng*),
                           void (*bench)(Lab*, Rng*)) {
    LabArgs args = lab_parse_args(argc, argv, name, variants, n_variants);
    Lab lab = lab_init(&args);
    Rng r;
    rng_seed(&r, args.seed);
    printf("validation\n");
    for (int v = 1; v <= n_validated; v++) {
        if (!lab_wants(&args, v)) continue;
        validate(&lab, v, &r);
    }
    if (!args.validate_only) bench(&lab, &r);
    return lab_finish(&lab);
}

// ----------------------------------------------------------------------------
// host data

static inline float bf16r(float x) {
    return bf16_to_f32(f32_to_bf16(x));
}

// n values uniform in [-scale, scale), rounded to bf16 (so the reference sees the device's bits).
static inline std::vector<float> rand_bf16(Rng* r, size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& x : v) x = bf16r(scale * (2.0f * rng_uniform(r) - 1.0f));
    return v;
}

static inline std::vector<float> rand_f32(Rng* r, size_t n, float scale) {
    std::vector<float> v(n);
    for (auto& x : v) x = scale * (2.0f * rng_uniform(r) - 1.0f);
    return v;
}

// ----------------------------------------------------------------------------
// device buffers
//
// These helpers run on the legacy default stream, which the context's non-blocking stream does
// not wait for (and a copy from pageable memory may return before its DMA is done): each one ends
// with a device-wide synchronize, so whatever the lab enqueues next on cx->stream sees its result.

static inline void dev_sync(void) {
    cuda_check(cudaDeviceSynchronize());
}

template <typename T>
static inline T* dev_alloc(size_t n) {
    void* p = NULL;
    cuda_check(cudaMalloc(&p, (n ? n : 1) * sizeof(T)));
    return (T*)p;
}

static inline bf16* dev_upload_bf16(const std::vector<float>& h) {
    std::vector<uint16_t> u(h.size());
    for (size_t i = 0; i < h.size(); i++) u[i] = f32_to_bf16(h[i]);
    bf16* d = dev_alloc<bf16>(h.size());
    cuda_check(cudaMemcpy(d, u.data(), u.size() * 2, cudaMemcpyHostToDevice));
    dev_sync();
    return d;
}

template <typename T>
static inline T* dev_upload(const std::vector<T>& h) {
    T* d = dev_alloc<T>(h.size());
    cuda_check(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    dev_sync();
    return d;
}

static inline std::vector<float> dev_download_bf16(const bf16* d, size_t n) {
    dev_sync();  // the kernels of cx->stream are done
    std::vector<uint16_t> u(n);
    cuda_check(cudaMemcpy(u.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> h(n);
    for (size_t i = 0; i < n; i++) h[i] = bf16_to_f32(u[i]);
    return h;
}

template <typename T>
static inline std::vector<T> dev_download(const T* d, size_t n) {
    dev_sync();  // the kernels of cx->stream are done
    std::vector<T> h(n);
    cuda_check(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

// Fill with NaN bit patterns (0xff bytes), so an element a kernel forgets to write fails.
static inline void dev_poison(void* d, size_t bytes) {
    cuda_check(cudaMemset(d, 0xff, bytes));
    dev_sync();
}

static inline void dev_zero(void* d, size_t bytes) {
    cuda_check(cudaMemset(d, 0, bytes));
    dev_sync();
}

// Benchmark inputs, generated on the device (hundreds of MB): uniform in [-scale, scale) from a
// hash of the index and the seed.
__device__ __forceinline__ float lab_hash_uniform(size_t i, uint32_t seed) {
    uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull + seed;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
}

template <typename T>
__global__ void lab_fill_kernel(T* p, size_t n, float scale, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = scale * (2.0f * lab_hash_uniform(i, seed) - 1.0f);
        if constexpr (sizeof(T) == 2)
            p[i] = __float2bfloat16_rn(v);
        else
            p[i] = v;
    }
}

template <typename T>
static inline T* dev_random(size_t n, float scale, uint32_t seed) {
    T* d = dev_alloc<T>(n);
    lab_fill_kernel<T><<<1024, 256>>>(d, n, scale, seed);
    cuda_check_launch();
    dev_sync();
    return d;
}

// ----------------------------------------------------------------------------
// validation

// got passes where |got - ref| <= atol + rtol |ref| for every element, with atol = atol_rms times
// the root mean square of ref (absolute errors scale with the data: a difference of two products
// near zero carries the rounding of the products).
typedef struct Tol {
    double rtol, atol_rms;
} Tol;

// bf16 results: an intermediate rounding that flips by one bf16 step (2^-7 relative at most)
// plus the final rounding (2^-8) stays inside 2^-6; where such a value is one term of a
// difference (RoPE's x1 cos - x2 sin), the absolute part covers it (2^-5 of the rms). A wrong
// kernel misses by the order of the rms.
static const Tol TOL_BF16 = {1.0 / 64, 1.0 / 32};
// fp32 results of sums in another order (partial sums, cuBLASLt split-K).
static const Tol TOL_F32 = {1e-4, 1e-4};
// fp32 results computed with the GPU's fast exp (__expf) against libm.
static const Tol TOL_EXP = {1e-4, 1e-5};
static const Tol TOL_EXACT = {0, 0};

// Compare n values; print one line (and the first mismatches); count the check in the lab.
static inline int lab_check(Lab* lab, const char* what, const float* got, const float* ref,
                            size_t n, Tol tol) {
    double ss = 0.0, num = 0.0, max_err = 0.0;
    for (size_t i = 0; i < n; i++) ss += (double)ref[i] * ref[i];
    const double rms = n ? sqrt(ss / (double)n) : 0.0, atol = tol.atol_rms * rms;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!isfinite(got[i])) d = INFINITY;
        num += d * d;
        max_err = std::max(max_err, d);
        if (!(d <= atol + tol.rtol * fabs(ref[i]))) {
            if (bad < 3)
                printf("    mismatch at %zu: got %.7g, want %.7g\n", i, (double)got[i],
                       (double)ref[i]);
            bad++;
        }
    }
    const double rel_l2 = ss > 0 ? sqrt(num / ss) : sqrt(num);
    lab->checks++;
    if (bad) lab->failures++;
    printf("  %-4s %-52s max|err| %.2e  rel L2 %.2e\n", bad ? "FAIL" : "ok", what, max_err, rel_l2);
    if (bad)
        printf("    %zu of %zu elements outside the tolerance (rtol %.1e, atol %.2e)\n", bad, n,
               tol.rtol, atol);
    fflush(stdout);
    return bad == 0;
}

// A yes/no check (error flags, untouched buffers).
static inline int lab_check_true(Lab* lab, const char* what, int ok) {
    lab->checks++;
    if (!ok) lab->failures++;
    printf("  %-4s %s\n", ok ? "ok" : "FAIL", what);
    fflush(stdout);
    return ok;
}

// The device error word of the context (bad ids flagged by kernels); cleared after reading.
static inline int lab_take_device_error(Lab* lab) {
    int e = 0;
    cuda_check(cudaStreamSynchronize(lab->cx->stream));
    cuda_check(cudaMemcpy(&e, lab->cx->d_error, sizeof e, cudaMemcpyDeviceToHost));
    dev_zero(lab->cx->d_error, sizeof e);
    return e;
}

// ----------------------------------------------------------------------------
// timing

// Median time (ms) of `reps` runs of fn on the lab's stream, each timed with a pair of events
// after the L2 was flushed (a memset of twice its size), after `warmup` untimed runs.
template <typename F>
static inline double lab_time_ms(Lab* lab, F fn, int reps = 0, int warmup = 2) {
    cudaStream_t s = lab->cx->stream;
    if (reps <= 0) reps = lab->args.reps;
    cudaEvent_t a, b;
    cuda_check(cudaEventCreate(&a));
    cuda_check(cudaEventCreate(&b));
    for (int i = 0; i < warmup; i++) fn();
    std::vector<double> t;
    for (int i = 0; i < reps; i++) {
        cuda_check(cudaMemsetAsync(lab->flush, i & 0xff, lab->flush_bytes, s));
        cuda_check(cudaEventRecord(a, s));
        fn();
        cuda_check(cudaEventRecord(b, s));
        cuda_check(cudaEventSynchronize(b));
        float ms = 0.0f;
        cuda_check(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    cuda_check(cudaEventDestroy(a));
    cuda_check(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// Benchmark rows are markdown table rows ("| ..."), so run_labs.sh can collect them.
static inline void lab_bench_header_bw(void) {
    printf(
        "| op | variant | shape | bytes counted | ms | GB/s | %% of HBM |\n"
        "|---|---|---|---|---|---|---|\n");
}

static inline void lab_report_bw(const char* op, int variant, const char* shape,
                                 const char* counted, double bytes, double ms) {
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("| %s | %d | %s | %s | %.3f | %.0f | %.0f%% |\n", op, variant, shape, counted, ms, gbs,
           100.0 * gbs * 1e9 / H200_HBM_BYTES_PER_S);
    fflush(stdout);
}

static inline void lab_bench_header_flops(void) {
    printf("| op | variant | shape | ms | TFLOP/s | %% of peak |\n|---|---|---|---|---|---|\n");
}

static inline void lab_report_flops(const char* op, int variant, const char* shape, double flop,
                                    double ms) {
    const double tf = flop / (ms * 1e-3) / 1e12;
    printf("| %s | %d | %s | %.3f | %.1f | %.0f%% |\n", op, variant, shape, ms, tf,
           100.0 * tf * 1e12 / H200_BF16_FLOP_PER_S);
    fflush(stdout);
}

// The bandwidth a device-to-device copy reaches: the practical ceiling of the memory-bound ops.
static inline void lab_report_copy(Lab* lab, size_t bytes) {
    void *a = NULL, *b = NULL;
    cuda_check(cudaMalloc(&a, bytes));
    cuda_check(cudaMalloc(&b, bytes));
    double ms = lab_time_ms(lab, [&] {
        cuda_check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, lab->cx->stream));
    });
    lab_report_bw("copy (d2d, reference)", 0, "-", "read + write", 2.0 * bytes, ms);
    cuda_check(cudaFree(a));
    cuda_check(cudaFree(b));
}

#endif  // DEV_CUDA_LAB_CUH
