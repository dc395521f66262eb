/*
 * test_common.c — checked helpers, number parsing, float conversions, the thread pool, the RNG,
 * atomic writes, printable strings.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../rng.h"
#include "../threads.h"
#include "testing.h"

static void test_common_parse_numbers(TestCtx* t) {
    int64_t i;
    double d;
    CHECK(t, parse_int64("42", &i) == 0 && i == 42, "42");
    CHECK(t, parse_int64("-7", &i) == 0 && i == -7, "-7");
    CHECK(t, parse_int64("", &i) != 0, "empty");
    CHECK(t, parse_int64("12x", &i) != 0, "trailing garbage");
    CHECK(t, parse_int64("99999999999999999999", &i) != 0, "overflow");
    CHECK(t, parse_double("3e-4", &d) == 0 && d == 3e-4, "3e-4");
    CHECK(t, parse_double("nan", &d) != 0, "nan rejected");
    CHECK(t, parse_double("inf", &d) != 0, "inf rejected");
    CHECK(t, parse_double("1.5.2", &d) != 0, "garbage");
    size_t s;
    CHECK(t, size_mul(SIZE_MAX / 2, 3, &s) != 0, "size_mul overflow");
    CHECK(t, size_add(SIZE_MAX, 1, &s) != 0, "size_add overflow");
    CHECK(t, size_mul(1000, 1000, &s) == 0 && s == 1000000, "size_mul");
}

static void test_common_float_conversions(TestCtx* t) {
    // bf16: exact values, round to nearest even, NaN stays NaN
    CHECK(t, bf16_to_f32(f32_to_bf16(1.0f)) == 1.0f, "bf16 1");
    CHECK(t, bf16_to_f32(f32_to_bf16(-2.5f)) == -2.5f, "bf16 -2.5");
    float x = 1.0f + 1.0f / 256.0f;  // halfway between two bf16 values: ties to even (1.0)
    CHECK(t, bf16_to_f32(f32_to_bf16(x)) == 1.0f, "bf16 tie to even");
    x = 1.0f + 3.0f / 256.0f;  // halfway: ties to even (1 + 4/256)
    CHECK(t, bf16_to_f32(f32_to_bf16(x)) == 1.0f + 4.0f / 256.0f, "bf16 tie up to even");
    CHECK(t, isnan(bf16_to_f32(f32_to_bf16(NAN))), "bf16 nan");
    // fp16: a sweep of all 65536 halves round-trips (NaNs stay NaN)
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = f16_to_f32((uint16_t)h);
        uint16_t back = f32_to_f16(f);
        if (isnan(f)) {
            if (!isnan(f16_to_f32(back))) bad++;
        } else if (back != h) {
            bad++;
        }
    }
    CHECK(t, bad == 0, "%d fp16 values do not round-trip", bad);
    CHECK(t, f16_to_f32(0x3c00) == 1.0f && f16_to_f32(0xc000) == -2.0f, "fp16 values");
    CHECK(t, f16_to_f32(0x0001) == ldexpf(1.0f, -24), "fp16 smallest subnormal");
    CHECK(t, f32_to_f16(65520.0f) == 0x7c00, "fp16 overflow to inf");
}

typedef struct SumArg {
    int64_t* out;
} SumArg;

static void sum_task(void* arg, int64_t i) {
    SumArg* a = arg;
    a->out[i] = i * i;
}

static void test_common_threadpool(TestCtx* t) {
    for (int threads = 1; threads <= 4; threads++) {
        ThreadPool* pool = threadpool_create(threads);
        int64_t out[257];
        int errors = 0;
        // many short runs back to back: catches lost wake-ups and generation mix-ups
        for (int rep = 0; rep < 2000; rep++) {
            int64_t n = 1 + rep % 257;
            memset(out, 0xff, sizeof out);
            SumArg a = {out};
            threadpool_run(pool, n, sum_task, &a);
            for (int64_t i = 0; i < n; i++)
                if (out[i] != i * i) errors++;
            for (int64_t i = n; i < 257; i++)
                if (out[i] != -1) errors++;
        }
        CHECK(t, errors == 0, "%d wrong task results with %d threads", errors, threads);
        threadpool_destroy(pool);
    }
}

static void affinity_task(void* arg, int64_t i) {
    int* seen = arg;  // (n_tasks) how many CPUs task i's thread may run on, and its first
    int cpus[8];
    seen[2 * i] = threads_allowed_cpus(cpus, 8);
    seen[2 * i + 1] = seen[2 * i] > 0 ? cpus[0] : -1;
}

// Pinning: a pool created on one CPU runs its workers there; threads_pin_self narrows the
// calling thread and can widen it again.
static void test_common_affinity(TestCtx* t) {
    int all[256];
    const int n = threads_allowed_cpus(all, 256);
    CHECK(t, n >= 1, "allowed CPUs: %d", n);
    if (n < 1) return;
    CHECK(t, threads_pin_self(all + n - 1, 1) == 0, "pin to CPU %d", all[n - 1]);
    int now[256];
    CHECK(t, threads_allowed_cpus(now, 256) == 1 && now[0] == all[n - 1], "pinned to one CPU");
    CHECK(t, threads_pin_self(all, n) == 0 && threads_allowed_cpus(now, 256) == n,
          "widened again");
    ThreadPool* pool = threadpool_create_on(3, all, 1);
    enum { TASKS = 64 };
    int seen[2 * TASKS];
    // the caller (unpinned) takes part too and may take every task of a run: repeat until a
    // worker ran some; every task ran either on the caller (all CPUs) or pinned
    int on_one = 0;
    for (int rep = 0; rep < 200 && on_one == 0; rep++) {
        threadpool_run(pool, TASKS, affinity_task, seen);
        for (int i = 0; i < TASKS; i++) {
            on_one += n > 1 && seen[2 * i] == 1 && seen[2 * i + 1] == all[0];
            CHECK(t, seen[2 * i] == n || (seen[2 * i] == 1 && seen[2 * i + 1] == all[0]),
                  "task %d: %d CPUs", i, seen[2 * i]);
        }
        if (n == 1) break;
    }
    CHECK(t, on_one >= 1 || n == 1, "no task ran on a pinned worker in 200 runs");
    threadpool_destroy(pool);
}

static void test_common_rng(TestCtx* t) {
    Rng a, b;
    rng_seed(&a, 5489u);
    // The reference mt19937 with the default seed 5489 yields 3499211612 first.
    CHECK(t, rng_u32(&a) == 3499211612u, "mt19937 first output");
    rng_seed(&a, 7);
    rng_seed(&b, 7);
    int same = 1;
    for (int i = 0; i < 1000; i++) same &= rng_u32(&a) == rng_u32(&b);
    CHECK(t, same, "same seed, same stream");
    double mean = 0, var = 0;
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        double x = rng_normal(&a);
        mean += x;
        var += x * x;
    }
    mean /= n;
    var = var / n - mean * mean;
    CHECK(t, fabs(mean) < 0.02 && fabs(var - 1.0) < 0.03, "normal mean %g var %g", mean, var);
    uint64_t counts[7] = {0};
    for (int i = 0; i < 70000; i++) counts[rng_below(&a, 7)]++;
    int ok = 1;
    for (int i = 0; i < 7; i++) ok &= counts[i] > 9400 && counts[i] < 10600;
    CHECK(t, ok, "rng_below roughly uniform");
    uint32_t perm[100];
    for (uint32_t i = 0; i < 100; i++) perm[i] = i;
    rng_shuffle_u32(&a, perm, 100);
    int seen[100] = {0}, dup = 0;
    for (int i = 0; i < 100; i++) dup += seen[perm[i]]++ != 0;
    CHECK(t, dup == 0, "shuffle is a permutation");
}

static void test_common_files(TestCtx* t) {
    char dir[512], path[600], err[ERR_LEN];
    test_path(t, dir, sizeof dir, "a/b/c");
    CHECK(t, mkdir_p(dir, err) == 0, "mkdir_p: %s", err);
    CHECK(t, dir_exists(dir), "dir exists");
    snprintf(path, sizeof path, "%s/file.txt", dir);
    CHECK(t, file_write_atomic(path, "hello", 5, err) == 0, "write: %s", err);
    size_t len = 0;
    char* s = file_read_all(path, 100, &len, err);
    CHECK(t, s && len == 5 && strcmp(s, "hello") == 0, "read back");
    free(s);
    CHECK(t, file_read_all(path, 3, &len, err) == NULL && strstr(err, "limit"), "size limit");
    CHECK(t, file_read_all("/nonexistent/x", 100, &len, err) == NULL && strstr(err, "/nonexistent/x"),
          "missing file names the path: %s", err);
    CHECK(t, mkdir_p(path, err) != 0, "mkdir_p over a file fails");
}

// The atomic-write helper: nothing at the final name before the commit, the old contents kept
// when a writer gives up, no temporary left behind in any outcome, one-line errors.
static void test_common_atomic_write(TestCtx* t) {
    char dir[512], path[600], tmp[700], err[ERR_LEN];
    test_path(t, dir, sizeof dir, "atomic");
    CHECK(t, mkdir_p(dir, err) == 0, "mkdir_p: %s", err);
    snprintf(path, sizeof path, "%s/out.bin", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    AtomicFile af;
    CHECK(t, atomic_file_open(&af, path, err) == 0, "open: %s", err);
    CHECK(t, atomic_file_write(&af, "ab", 2, err) == 0 && atomic_file_write(&af, NULL, 0, err) == 0,
          "write: %s", err);
    fprintf(af.f, "c%d", 1);
    CHECK(t, !file_exists(path) && file_exists(tmp), "only the temporary exists before the commit");
    CHECK(t, atomic_file_commit(&af, err) == 0, "commit: %s", err);
    size_t len = 0;
    char* s = file_read_all(path, 100, &len, err);
    CHECK(t, s && len == 4 && memcmp(s, "abc1", 4) == 0, "committed contents");
    free(s);
    CHECK(t, !file_exists(tmp), "no temporary after the commit");

    // a writer that gives up leaves the old file as it was
    CHECK(t, atomic_file_open(&af, path, err) == 0, "reopen: %s", err);
    CHECK(t, atomic_file_write(&af, "zzzz", 4, err) == 0, "write: %s", err);
    atomic_file_abort(&af);
    s = file_read_all(path, 100, &len, err);
    CHECK(t, s && len == 4 && memcmp(s, "abc1", 4) == 0, "abort keeps the old contents");
    free(s);
    CHECK(t, !file_exists(tmp), "no temporary after an abort");

    // failures: a missing directory (create) and a directory in the way (rename)
    snprintf(tmp, sizeof tmp, "%s/missing/x.bin", dir);
    CHECK(t, file_write_atomic(tmp, "x", 1, err) == -1 && strstr(err, "x.bin.tmp: cannot create") &&
                 !strchr(err, '\n'),
          "missing directory: %s", err);
    snprintf(tmp, sizeof tmp, "%s/sub", dir);
    CHECK(t, mkdir_p(tmp, err) == 0, "mkdir_p: %s", err);
    snprintf(path, sizeof path, "%s/sub/keep", dir);
    CHECK(t, file_write_atomic(path, "k", 1, err) == 0, "write: %s", err);
    CHECK(t, file_write_atomic(tmp, "x", 1, err) == -1 && strstr(err, "rename") && strstr(err, tmp),
          "directory in the way: %s", err);
    snprintf(path, sizeof path, "%s/sub.tmp", dir);
    CHECK(t, !file_exists(path), "no temporary after a failed rename");
}

static void test_common_printable(TestCtx* t) {
    char buf[16];
    CHECK(t, strcmp(str_printable("a\nb\x80" "c\x1b", 6, buf, sizeof buf), "a?b?c?") == 0, "'%s'", buf);
    CHECK(t, strcmp(str_printable("x\0y", 3, buf, sizeof buf), "x?y") == 0, "NUL byte: '%s'", buf);
    CHECK(t, strcmp(str_printable("", 0, buf, sizeof buf), "") == 0, "empty");
    const char* long_name = "abcdefghijklmnopqrstuvwxyz";
    str_printable(long_name, strlen(long_name), buf, sizeof buf);
    CHECK(t, strcmp(buf, "abcdefghijkl...") == 0, "cut with '...': '%s'", buf);
}

const TestCase tests_common[] = {
    {"common_parse_numbers", test_common_parse_numbers},
    {"common_float_conversions", test_common_float_conversions},
    {"common_threadpool", test_common_threadpool},
    {"common_affinity", test_common_affinity},
    {"common_rng", test_common_rng},
    {"common_files", test_common_files},
    {"common_atomic_write", test_common_atomic_write},
    {"common_printable", test_common_printable},
    {NULL, NULL},
};
