/*
 * test_roundpipe.c — the test suite runner (`make test`).
 *
 * Every suite lives in llmc/tests/test_<suite>.c and exports a NULL-terminated TestCase array.
 * The runner executes every test (or those whose name contains one of the filter arguments) and
 * prints
 * one line per test:
 *   ok   <name>  <checks> <seconds>   passed (parts it could not run here listed as "skipped: ...")
 *   FAIL <name>  ...                  a CHECK failed, or it ran none and did not say it skipped
 *   skip <name> (why)                 it cannot run here (no GPU, a build without CUDA)
 * and finishes with "N passed, M failed, K skipped". The exit status is non-zero on any failure
 * (and, with --no-skip, on any skip), zero otherwise: a skipped test is never counted as passed.
 *
 *   ./test_roundpipe              run everything
 *   ./test_roundpipe json         run the tests whose name contains "json" (none: an error)
 *   ./test_roundpipe json rng     those whose name contains "json" or "rng" (each must match)
 *   ./test_roundpipe --list       list test names
 *   ./test_roundpipe --no-skip gpu  the GPU suite, failing when it cannot run (make test-gpu)
 *   ./test_roundpipe --partial    tolerate suites missing from a module-only build
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "llmc/common.h"
#include "llmc/threads.h"
#include "llmc/tests/testing.h"

// Suites are weak so a partial build (one module and its tests) still links; a missing suite in
// the full build is reported as a failure below.
#define SUITES(X)  \
    X(common)      \
    X(json)        \
    X(safetensors) \
    X(config)      \
    X(tensor)      \
    X(dataloader)  \
    X(adamw)       \
    X(ops)         \
    X(model)       \
    X(moe)         \
    X(lora)        \
    X(quant)       \
    X(parity)      \
    X(gpu)         \
    X(gpu_sink)    \
    X(gpu_moe)     \
    X(gpu_moe_matmul) \
    X(gpu_comm)    \
    X(gpu_dp_engine) \
    X(device)      \
    X(partition)   \
    X(engine)      \
    X(gguf)        \
    X(tokenizer)   \
    X(resume)      \
    X(checksum)    \
    X(comm)        \
    X(dp)          \
    X(dp_engine)   \
    X(grpo_engine) \
    X(memory)      \
    X(train)       \
    X(grpo)        \
    X(cli)

#define DECLARE_SUITE(s) extern const TestCase tests_##s[] __attribute__((weak));
SUITES(DECLARE_SUITE)

typedef struct Suite {
    const char* name;
    const TestCase* cases;
} Suite;

int main(int argc, char** argv) {
    const char** filters = calloc((size_t)argc, sizeof(char*));  // the name filters (any may match)
    int n_filters = 0, list_only = 0, allow_partial = 0, no_skip = 0;
    if (!filters) fatal("out of memory for %d arguments", argc);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--list") == 0) list_only = 1;
        else if (strcmp(argv[i], "--partial") == 0) allow_partial = 1;  // module-only builds
        else if (strcmp(argv[i], "--no-skip") == 0) no_skip = 1;  // asked-for tests must run
        else if (argv[i][0] == '-') {
            fprintf(stderr, "test_roundpipe: unknown option %s (--list, --partial, --no-skip)\n",
                    argv[i]);
            return 2;
        }
        else filters[n_filters++] = argv[i];
    }
    int* filter_hits = calloc((size_t)(n_filters > 0 ? n_filters : 1), sizeof(int));
    if (!filter_hits) fatal("out of memory for %d filters", n_filters);
#define SUITE_ENTRY(s) {#s, tests_##s},
    const Suite suites[] = {SUITES(SUITE_ENTRY)};
    const int n_suites = (int)(sizeof suites / sizeof suites[0]);

    char tmpdir[] = "/tmp/test_roundpipe.XXXXXX";
    if (!list_only && mkdtemp(tmpdir) == NULL) fatal("cannot create a temporary directory");
    char exe_dir[4096] = ".";
    {
        ssize_t n = readlink("/proc/self/exe", exe_dir, sizeof exe_dir - 1);
        if (n > 0) {
            exe_dir[n] = '\0';
            char* slash = strrchr(exe_dir, '/');
            if (slash) *slash = '\0';
        } else {
            str_copy(exe_dir, sizeof exe_dir, ".");
        }
    }
    int n_threads = threads_online_cpus();
    if (n_threads > 4) n_threads = 4;  // keep CPU tests representative of the 2-core CI machine

    int passed = 0, failed = 0, skipped = 0;
    char first_skip[400] = "";  // "<name>: <why>" of the first skipped test (for --no-skip)
    double t_start = time_now_s();
    for (int s = 0; s < n_suites; s++) {
        if (suites[s].cases == NULL) {
            if (!allow_partial && !list_only && n_filters == 0) {
                printf("FAIL suite %s is missing from this build\n", suites[s].name);
                failed++;
            }
            continue;
        }
        for (const TestCase* tc = suites[s].cases; tc->name != NULL; tc++) {
            int selected = n_filters == 0;
            for (int f = 0; f < n_filters; f++)
                if (strstr(tc->name, filters[f])) selected = ++filter_hits[f];
            if (!selected) continue;
            if (list_only) {
                printf("%s\n", tc->name);
                continue;
            }
            TestCtx t = {.name = tc->name, .tmpdir = tmpdir, .exe_dir = exe_dir,
                         .n_threads = n_threads};
            double t0 = time_now_s();
            fflush(stdout);
            tc->fn(&t);
            double dt = time_now_s() - t0;
            if (t.failures > 0) {
                failed++;
                printf("FAIL %-44s %d of %d checks failed %8.2fs\n", tc->name, t.failures, t.checks,
                       dt);
            } else if (t.skip_why[0]) {
                // a skip is never a pass: it says why, and how many checks ran before it
                skipped++;
                if (t.checks > 0)
                    printf("skip %-44s (%s; after %d check(s))\n", tc->name, t.skip_why, t.checks);
                else
                    printf("skip %-44s (%s)\n", tc->name, t.skip_why);
                if (!first_skip[0])
                    snprintf(first_skip, sizeof first_skip, "%s: %s", tc->name, t.skip_why);
            } else if (t.checks == 0) {
                // a test that checked nothing and did not say why has not shown anything
                failed++;
                printf("FAIL %-44s ran no checks and did not report a skip %8.2fs\n", tc->name, dt);
            } else {
                passed++;
                printf("ok   %-44s %4d checks %8.2fs", tc->name, t.checks, dt);
                if (t.skipped_parts[0]) printf("  (skipped: %s)", t.skipped_parts);
                printf("\n");
            }
            fflush(stdout);
        }
    }
    // the verdicts beyond the counts come first: the counts stay the closing line
    int rc = failed == 0 ? 0 : 1;
    for (int f = 0; f < n_filters; f++)
        if (filter_hits[f] == 0) {
            printf("FAIL no test name contains '%s' (./test_roundpipe --list lists them)\n",
                   filters[f]);
            rc = 1;
        }
    free(filter_hits);
    free(filters);
    if (no_skip && skipped > 0) {
        printf("FAIL --no-skip: %d test(s) did not run here (%s)\n", skipped, first_skip);
        rc = 1;
    }
    if (!list_only) {
        char cmd[4200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmpdir);
        printf("total time %.1fs\n", time_now_s() - t_start);
        printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    }
    return rc;
}
