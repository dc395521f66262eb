/*
 * test_memory.c — suite `memory`: the run's host memory estimate, the limit, the refusal.
 *
 *  - the limit: MemAvailable, a cgroup v2 limit set on an ancestor, a cgroup v1 limit, a
 *    namespaced cgroup (its path absent under the mount), the test override and a bad value, all
 *    read from fake /proc and /sys trees;
 *  - the estimate against what is really allocated: a child process builds plain training
 *    (every activation kept, recomputed, a chunked MLP) or the engine over emulated devices
 *    (synchronous, delayed with host activation checkpoints) and runs a step; the growth of its
 *    peak resident memory must not exceed the estimate by more than 3%, and the estimate must not
 *    exceed it by more than 30% (nothing large forgotten, nothing large invented);
 *  - the decision: the refusal names the estimate, the limit and its source and the flags that
 *    fit (computed, not guessed), and says when no flag can help;
 *  - the CLI: the tiny model at --seq 100000 and llama3.1-8b are refused within seconds with one
 *    line and exit 2, a normal run starts, --allow-overcommit starts a run that does not fit.
 */
#include <malloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../args.h"
#include "../common.h"
#include "../dp.h"
#include "../engine.h"
#include "../loader.h"
#include "../memory.h"
#include "../plain.h"
#include "../rng.h"
#include "../threads.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// the limit

static void put(TestCtx* t, const char* root, const char* rel, const char* text) {
    char path[1200], dir[1200], err[ERR_LEN];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    str_copy(dir, sizeof dir, path);
    *strrchr(dir, '/') = '\0';
    CHECK(t, mkdir_p(dir, err) == 0 && file_write_atomic(path, text, strlen(text), err) == 0, "%s",
          err);
}

static void test_memory_limit(TestCtx* t) {
    char root[1024], err[ERR_LEN];
    HostLimit lim;
    const char* env = getenv(MEMORY_LIMIT_ENV);
    char* saved = env ? strndup_check(env, strlen(env)) : NULL;
    unsetenv(MEMORY_LIMIT_ENV);
    const double MiB = 1048576.0;
    // MemAvailable alone
    test_path(t, root, sizeof root, "lim_plain");
    put(t, root, "proc/meminfo", "MemTotal:       4000000 kB\nMemFree:  100 kB\n"
                                 "MemAvailable:   3000000 kB\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 3000000 * 1024.0 &&
                 strstr(lim.source, "MemAvailable"),
          "MemAvailable: %.0f %s", lim.bytes, lim.source);
    // cgroup v2: the job's own level has no limit, its parent has 1 GiB with 512 MiB in use of
    // which 100 MiB inactive page cache: 612 MiB is less than MemAvailable
    test_path(t, root, sizeof root, "lim_v2");
    put(t, root, "proc/meminfo", "MemAvailable:   3000000 kB\n");
    put(t, root, "proc/self/cgroup", "0::/user.slice/job\n");
    put(t, root, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
    put(t, root, "sys/fs/cgroup/user.slice/memory.max", "1073741824\n");
    put(t, root, "sys/fs/cgroup/user.slice/memory.current", "536870912\n");
    put(t, root, "sys/fs/cgroup/user.slice/memory.stat", "anon 5\ninactive_file 104857600\n");
    put(t, root, "sys/fs/cgroup/user.slice/job/memory.max", "max\n");
    put(t, root, "sys/fs/cgroup/user.slice/job/memory.current", "1000\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 612 * MiB &&
                 strstr(lim.source, "cgroup v2 memory.max of /sys/fs/cgroup/user.slice") &&
                 !strstr(lim.source, root),
          "cgroup v2: %.0f %s", lim.bytes, lim.source);
    // cgroup v1 (memory shares a hierarchy with cpu), the root's "no limit" ignored
    test_path(t, root, sizeof root, "lim_v1");
    put(t, root, "proc/meminfo", "MemAvailable:   3000000 kB\n");
    put(t, root, "proc/self/cgroup", "12:pids:/x\n4:cpu,memory:/a/b\n0::/\n");
    put(t, root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put(t, root, "sys/fs/cgroup/memory/memory.usage_in_bytes", "5\n");
    put(t, root, "sys/fs/cgroup/memory/a/b/memory.limit_in_bytes", "2147483648\n");
    put(t, root, "sys/fs/cgroup/memory/a/b/memory.usage_in_bytes", "1073741824\n");
    put(t, root, "sys/fs/cgroup/memory/a/b/memory.stat", "cache 1\ntotal_inactive_file 0\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 1024 * MiB &&
                 strstr(lim.source, "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/a/b"),
          "cgroup v1: %.0f %s", lim.bytes, lim.source);
    // a cgroup namespace: /proc/self/cgroup names a path the mount does not show; the mount's
    // root is the container's cgroup. A limit above MemAvailable changes nothing.
    test_path(t, root, sizeof root, "lim_ns");
    put(t, root, "proc/meminfo", "MemAvailable:   1000 kB\n");
    put(t, root, "proc/self/cgroup", "0::/kubepods/pod1/abc\n");
    put(t, root, "sys/fs/cgroup/cgroup.controllers", "memory\n");
    put(t, root, "sys/fs/cgroup/memory.max", "2097152\n");
    put(t, root, "sys/fs/cgroup/memory.current", "0\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 1000 * 1024.0 &&
                 strstr(lim.source, "MemAvailable"),
          "namespaced, above MemAvailable: %.0f %s", lim.bytes, lim.source);
    put(t, root, "sys/fs/cgroup/memory.max", "524288\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 524288 &&
                 strstr(lim.source, "cgroup v2"),
          "namespaced: %.0f %s", lim.bytes, lim.source);
    CHECK(t, lim.ceiling, "a cgroup limit is a ceiling");
    // virtual machines: a balloon deflated on memory pressure gives its pages back; memory
    // plugged in on demand (virtio-mem) or a balloon deflated at the host's will make
    // MemAvailable no ceiling
    test_path(t, root, sizeof root, "lim_vm");
    put(t, root, "proc/meminfo", "MemAvailable:   1000 kB\n");
    put(t, root, "proc/vmstat", "nr_free_pages 5\nnr_balloon_pages 256\n");
    put(t, root, "sys/bus/virtio/drivers/virtio_balloon/virtio0/features", "0110010100000000\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 1000 * 1024.0 + 256 * 4096.0 &&
                 lim.ceiling && strstr(lim.source, "balloon"),
          "deflate-on-oom balloon: %.0f %d %s", lim.bytes, lim.ceiling, lim.source);
    put(t, root, "sys/bus/virtio/drivers/virtio_balloon/virtio0/features", "0100000000000000\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 1000 * 1024.0 && !lim.ceiling,
          "host-driven balloon: %.0f %d", lim.bytes, lim.ceiling);
    put(t, root, "proc/vmstat", "nr_balloon_pages 0\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.ceiling, "empty balloon: a ceiling");
    put(t, root, "sys/bus/virtio/drivers/virtio_mem/virtio3/features", "0\n");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && !lim.ceiling, "virtio-mem: no ceiling");
    // nothing readable: unknown (no check)
    test_path(t, root, sizeof root, "lim_none");
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 0, "unknown: %.0f",
          lim.bytes);
    // the override, for tests
    setenv(MEMORY_LIMIT_ENV, "3G", 1);
    CHECK(t, memory_host_limit(root, &lim, err) == 0 && lim.bytes == 3072 * MiB &&
                 strstr(lim.source, MEMORY_LIMIT_ENV),
          "override: %.0f %s", lim.bytes, lim.source);
    setenv(MEMORY_LIMIT_ENV, "lots", 1);
    CHECK(t, memory_host_limit(root, &lim, err) == -1 && strstr(err, MEMORY_LIMIT_ENV) &&
                 strstr(err, "lots"),
          "bad override: %s", err);
    if (saved) setenv(MEMORY_LIMIT_ENV, saved, 1);
    else unsetenv(MEMORY_LIMIT_ENV);
    free(saved);
}

// ----------------------------------------------------------------------------
// the estimate against resident memory

static double status_bytes(const char* key) {
    FILE* f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    double v = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, strlen(key)) == 0) v = strtod(line + strlen(key) + 1, NULL) * 1024;
    fclose(f);
    return v;
}

// A run shape: the flags that matter to memory, and for plain training whether the backward
// recomputes (the CLI decides that at 8 GiB; here it is forced to measure both paths).
typedef struct Shape {
    const char* name;
    const char* preset;
    int B, T, M, n_devices, sync, recompute, mlp_chunk;
    double device_mem;
    int host_single;
} Shape;

static EngineOptions shape_engine_options(const Shape* s) {
    EngineOptions eo = {.B = s->B, .T = s->T, .M = s->M, .sync = s->sync,
                        .device_budget = s->device_mem, .opt_threads = 1,
                        .host_single = s->host_single, .hyper = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f},
                        .sched = {LR_CONSTANT, 1e-3f, 0, 10, 0.1f, 0.2f}, .grad_clip = 1.0f};
    return eo;
}

static TrainArgs shape_args(const Shape* s) {
    TrainArgs a;
    args_defaults(&a);
    a.model = s->preset;
    a.batch = s->B;
    a.seq = s->T;
    a.micro_batches = s->M;
    a.n_devices = s->n_devices;
    a.sync = s->sync;
    a.device_mem = s->device_mem;
    a.host_single = s->host_single;
    a.mlp_chunk = s->mlp_chunk;
    a.threads = 1;
    a.val = "";
    a.sample_tokens = 0;
    return a;
}

// In a child process: building this shape's store and trainer and running one step; what that
// added to the peak resident memory (bytes), or -1.
static double measure_growth(const Shape* sh) {
    int fd[2];
    if (pipe(fd) != 0) return -1;
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        close(fd[0]);
        double grown = -1;
        // the earlier tests' freed heap goes back to the system first: reused, it would not show
        malloc_trim(0);
        FILE* cr = fopen("/proc/self/clear_refs", "w");  // reset the peak to the current size
        if (cr && fputs("5", cr) >= 0 && fclose(cr) == 0) {
            const double base = status_bytes("VmRSS:");
            char err[ERR_LEN];
            ModelConfig c;
            Model m;
            if (config_from_preset(&c, sh->preset, err) != 0 || model_init(&m, &c, 0, err) != 0)
                _exit(3);
            m.mlp_chunk = sh->mlp_chunk;
            Store s;
            store_create(&s, &m.tt);
            store_init_random(&s, 5, 0.02f);
            int32_t* tokens = malloc_check((size_t)sh->B * (sh->T + 1) * sizeof(int32_t));
            Rng rng;
            rng_seed(&rng, 11);
            for (int i = 0; i < sh->B * (sh->T + 1); i++)
                tokens[i] = (int32_t)rng_below(&rng, (uint64_t)c.V);
            if (sh->n_devices == 0) {
                void* ctx = ops_cpu_create(1);
                const int Bm = (sh->B + sh->M - 1) / sh->M;
                Plain* p = plain_create(&m, &s, &ops_cpu, ctx, Bm, sh->T, sh->recompute);
                plain_forward_backward(p, tokens, Bm, sh->T, 1.0f / (float)(Bm * sh->T));
            } else {
                DeviceSet devs;
                DeviceOptions dopt = {.threads = 1};
                device_set_open(&devs, &device_cpu_impl, sh->n_devices, &dopt);
                const EngineOptions eo = shape_engine_options(sh);
                Engine* e = engine_create(&m, &s, &devs, &eo, err);
                if (!e) _exit(4);
                engine_step(e, tokens);
                engine_synchronize(e);
            }
            grown = status_bytes("VmHWM:") - base;
        }
        if (write(fd[1], &grown, sizeof grown) != (ssize_t)sizeof grown) _exit(2);
        _exit(0);  // (nothing freed: the child's memory goes with it)
    }
    close(fd[1]);
    double grown = -1;
    if (read(fd[0], &grown, sizeof grown) != (ssize_t)sizeof grown) grown = -1;
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? grown : -1;
}

static void test_memory_estimate_vs_rss(TestCtx* t) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    // shadow memory and quarantined frees are resident memory no estimate counts
    test_skip(t, "a sanitizer build: its own memory is resident too");
    return;
#endif
    const Shape shapes[] = {
        {"plain, activations kept", "tiny", 2, 512, 1, 0, 0, 0, 0, 0, 0},
        {"plain, recomputed", "tiny", 4, 512, 2, 0, 0, 1, 0, 0, 0},
        {"plain, chunked MLP", "tiny", 1, 2048, 1, 0, 0, 0, 512, 0, 0},
        {"plain, untied llama", "test-llama", 4, 256, 1, 0, 0, 0, 0, 0, 0},
        {"plain, mixture of experts", "test-qwen3moe", 4, 256, 1, 0, 0, 0, 0, 0, 0},
        {"plain, gpt-oss (sinks, sliding window)", "test-gptoss", 4, 256, 1, 0, 0, 0, 0, 0, 0},
        {"engine cpu:2, sync", "tiny", 4, 256, 2, 2, 1, 0, 0, 0, 0},
        {"engine cpu:2, delayed, host checkpoints", "tiny", 4, 256, 2, 2, 0, 0, 0, 12e6, 0},
        {"engine cpu:3, one host checkpoint set", "tiny", 6, 128, 3, 3, 0, 0, 0, 12e6, 1},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const Shape* sh = &shapes[i];
        char err[ERR_LEN];
        ModelConfig c;
        Model m;
        CHECK(t, config_from_preset(&c, sh->preset, err) == 0 && model_init(&m, &c, 0, err) == 0,
              "%s", err);
        m.mlp_chunk = sh->mlp_chunk;
        const TrainArgs a = shape_args(sh);
        double est;
        if (sh->n_devices == 0) {
            // the primitives (memory_estimate would decide the recompute itself)
            const int Bm = (sh->B + sh->M - 1) / sh->M;
            est = store_bytes(&m.tt) + (double)plain_bytes(&m, 4, 1, Bm, sh->T, sh->recompute) +
                  (double)model_cpu_op_temp_bytes(&m, Bm, sh->T, 1) +
                  (double)sh->B * (sh->T + 1) * sizeof(int32_t);
            if (!sh->recompute) {
                const RunMemory r = memory_estimate(&a, &m, 0, NULL);
                CHECK(t, fabs(r.total - r.program - r.exports - est -
                              (double)sh->B * (sh->T + 1) * sizeof(int32_t)) < 1.0,
                      "%s: memory_estimate %.0f vs its parts %.0f", sh->name,
                      r.total - r.program, est);
            }
        } else {
            const EngineOptions eo = shape_engine_options(sh);
            const RunMemory r = memory_estimate(&a, &m, sh->n_devices, &eo);
            CHECK(t, !r.plan_failed, "%s: plan", sh->name);
            est = r.total - r.program - r.exports;
        }
        const double grown = measure_growth(sh);
        CHECK(t, grown > 0, "%s: measured %.0f", sh->name, grown);
        // never below what is used by more than 3% (and 2 MiB: the threads that zero the store,
        // their stacks and malloc arenas, which the program's allowance covers); never far above
        CHECK(t, grown <= 1.03 * est + (2 << 20) && est <= 1.3 * grown + (4 << 20),
              "%s: estimate %.2f MiB, resident growth %.2f MiB", sh->name, est / 1048576.0,
              grown / 1048576.0);
        if (getenv("MEMORY_TEST_VERBOSE"))
            printf("  %-42s estimate %8.2f MiB  resident growth %8.2f MiB  (%+.1f%%)\n", sh->name,
                   est / 1048576.0, grown / 1048576.0, 100.0 * (est - grown) / grown);
        model_free(&m);
    }
}

// ----------------------------------------------------------------------------
// the decision

// memory_check_run with its "host memory:" line sent to /dev/null: its return, err filled.
static int check_quietly(const TrainArgs* a, Model* m, int N, const EngineOptions* eo,
                         double limit, int ceiling, char* err) {
    HostLimit lim = {.bytes = limit, .ceiling = ceiling};
    str_copy(lim.source, sizeof lim.source, "the test's limit");
    fflush(stdout);
    const int saved = dup(1);
    FILE* null = fopen("/dev/null", "w");
    if (null) dup2(fileno(null), 1);
    const int rc = memory_check_run(a, m, N, eo, &lim, err);
    fflush(stdout);
    if (saved >= 0) {
        dup2(saved, 1);
        close(saved);
    }
    if (null) fclose(null);
    return rc;
}

static void test_memory_refusal_message(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "tiny", err) == 0 && model_init(&m, &c, 0, err) == 0, "%s",
          err);
    // plain: between the estimates with one and two micro-batches, two fit
    Shape sh = {"plain", "tiny", 8, 1024, 1, 0, 0, 0, 0, 0, 0};
    TrainArgs a = shape_args(&sh);
    const double one = memory_estimate(&a, &m, 0, NULL).total;
    a.micro_batches = 2;
    const double two = memory_estimate(&a, &m, 0, NULL).total;
    a.micro_batches = 1;
    CHECK(t, two < one, "more micro-batches need less: %.0f vs %.0f", two, one);
    CHECK(t, check_quietly(&a, &m, 0, NULL, 2 * one, 1, err) == 0, "fits: %s", err);
    CHECK(t, check_quietly(&a, &m, 0, NULL, (one + two) / 2, 1, err) == -1 &&
                 strstr(err, "not enough host memory: this run needs about") &&
                 strstr(err, "is available (the test's limit)") &&
                 strstr(err, "--micro-batches 2 (about") && strstr(err, "--allow-overcommit"),
          "plain refusal: %s", err);
    a.allow_overcommit = 1;
    CHECK(t, check_quietly(&a, &m, 0, NULL, (one + two) / 2, 1, err) == 0, "--allow-overcommit");
    a.allow_overcommit = 0;
    // a machine that adds memory on demand: a warning, not a refusal
    CHECK(t, check_quietly(&a, &m, 0, NULL, (one + two) / 2, 0, err) == 0, "no ceiling");
    // the weights alone do not fit: no flag helps
    CHECK(t, check_quietly(&a, &m, 0, NULL, store_bytes(&m.tt), 1, err) == -1 &&
                 strstr(err, "no flag makes this model fit here") && !strstr(err, "would fit"),
          "model too large: %s", err);
    // engine: between the synchronous and the delayed estimates --sync 1 fits (and with one set
    // of host checkpoints, --host-checkpoints single is offered too when it fits)
    Shape se = {"engine", "tiny", 4, 64, 2, 2, 0, 0, 0, 12e6, 0};
    a = shape_args(&se);
    EngineOptions eo = shape_engine_options(&se);
    const double delayed = memory_estimate(&a, &m, 2, &eo).total;
    a.sync = eo.sync = 1;
    const double sync = memory_estimate(&a, &m, 2, &eo).total;
    a.sync = eo.sync = 0;
    CHECK(t, sync < delayed, "sync needs less: %.0f vs %.0f", sync, delayed);
    CHECK(t, check_quietly(&a, &m, 2, &eo, (sync + delayed) / 2, 1, err) == -1 &&
                 strstr(err, "--sync 1 (about") && strstr(err, "would fit"),
          "engine refusal: %s", err);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// the CLI

static void test_memory_cli(TestCtx* t) {
    const char* env = getenv(MEMORY_LIMIT_ENV);
    char* saved = env ? strndup_check(env, strlen(env)) : NULL;
    // the tiny model at 100,000 tokens per sequence needs about 33 GiB: refused at once
    setenv(MEMORY_LIMIT_ENV, "18G", 1);
    double t0 = time_now_s();
    int rc = test_run_cli(t, "mem_seq", "--seq 100000 --steps 1");
    const double dt = time_now_s() - t0;
    char* e = test_read_output(t, "mem_seq", "err");
    char* o = test_read_output(t, "mem_seq", "out");
    const size_t n = strlen(e);
    CHECK(t, rc == 2 && n > 0 && strchr(e, '\n') == e + n - 1 &&
                 strstr(e, "train_roundpipe: error: not enough host memory") &&
                 strstr(e, "18.00 GiB is available (" MEMORY_LIMIT_ENV ")") &&
                 strstr(e, "--micro-batches 2 (about") && strstr(e, "--mlp-chunk 16384 (about") &&
                 strstr(e, "--allow-overcommit") && !strstr(o, "step "),
          "--seq 100000: exit %d: %s", rc, e);
    CHECK(t, dt < 20, "refused after %.1f s", dt);
    free(e);
    free(o);
    // llama3.1-8b: 120 GiB of weights and optimizer state
    setenv(MEMORY_LIMIT_ENV, "64G", 1);
    t0 = time_now_s();
    rc = test_run_cli(t, "mem_8b", "--model llama3.1-8b --steps 1");
    e = test_read_output(t, "mem_8b", "err");
    CHECK(t, rc == 2 && strstr(e, "not enough host memory") &&
                 strstr(e, "no flag makes this model fit here"),
          "llama3.1-8b: exit %d: %s", rc, e);
    CHECK(t, time_now_s() - t0 < 20, "refused after %.1f s", time_now_s() - t0);
    free(e);
    // the engine on emulated devices too
    rc = test_run_cli(t, "mem_8b_engine", "--model llama3.1-8b --device cpu:2 --steps 1");
    e = test_read_output(t, "mem_8b_engine", "err");
    CHECK(t, rc == 2 && strstr(e, "not enough host memory"), "llama3.1-8b cpu:2: exit %d: %s", rc,
          e);
    free(e);
    // a run that fits starts, and says what it needs
    setenv(MEMORY_LIMIT_ENV, "2G", 1);
    const char* small = "--batch 4 --seq 32 --steps 1 --val '' --sample-tokens 0 --threads 2";
    rc = test_run_cli(t, "mem_ok", small);
    o = test_read_output(t, "mem_ok", "out");
    CHECK(t, rc == 0 && strstr(o, "host memory: about") &&
                 strstr(o, "(available: 2.00 GiB, " MEMORY_LIMIT_ENV ")") &&
                 strstr(o, "step     1/1"),
          "normal run: exit %d: %s", rc, o);
    free(o);
    // ... not with 1 MiB, unless --allow-overcommit
    setenv(MEMORY_LIMIT_ENV, "1M", 1);
    rc = test_run_cli(t, "mem_tight", small);
    CHECK(t, rc == 2, "1 MiB: exit %d", rc);
    char args[512];
    snprintf(args, sizeof args, "%s --allow-overcommit", small);
    rc = test_run_cli(t, "mem_over", args);
    o = test_read_output(t, "mem_over", "out");
    CHECK(t, rc == 0 && strstr(o, "warning: this run needs about") &&
                 strstr(o, "--allow-overcommit: starting anyway") && strstr(o, "step     1/1"),
          "--allow-overcommit: exit %d: %s", rc, o);
    free(o);
    // --plan only warns
    rc = test_run_cli(t, "mem_plan", "--device cpu:2 --plan");
    o = test_read_output(t, "mem_plan", "out");
    CHECK(t, rc == 0 && strstr(o, "host memory for this plan:") &&
                 strstr(o, "warning: more than this machine reports"),
          "--plan: exit %d: %s", rc, o);
    free(o);
    if (saved) setenv(MEMORY_LIMIT_ENV, saved, 1);
    else unsetenv(MEMORY_LIMIT_ENV);
    free(saved);
}

#ifdef HAVE_CUDA  // (data parallel on the command line needs NCCL)
// A size as format_bytes writes it ("1.50 GiB", "358.2 MiB", ...) after `key`, in bytes; -1 if
// absent.
static double bytes_after(const char* text, const char* key) {
    const char* p = strstr(text, key);
    if (!p) return -1;
    char* end;
    const double v = strtod(p + strlen(key), &end);
    while (*end == ' ') end++;
    const double unit = strncmp(end, "GiB", 3) == 0   ? 1073741824.0
                        : strncmp(end, "MiB", 3) == 0 ? 1048576.0
                        : strncmp(end, "KiB", 3) == 0 ? 1024.0
                                                      : 1.0;
    return v * unit;
}
#endif

// Data parallel through the engine (a->dist_world ranks): the estimate is what rank 0 holds with
// ZeRO-1 (docs/DISTRIBUTED.md §6): AdamW's m and v for its shard; the fp32 weights for its shard
// when no plain path reads them, whole at start-up only beyond the delayed update's second
// gradient set, and whole again when --out or an export (--export-lora too) writes them; plus
// the collectives' buffer (the largest layer) and, with checkpoints, one streamed layer. LoRA's
// adapters: their fp32 weights whole on every rank, m and v sharded (gathered whole onto rank 0
// for a checkpoint). A run that fits only thanks to that
// passes the check; --plan --world W prints the figure the run's check compares.
static void test_memory_dp_rank(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "tiny", err) == 0 && model_init(&m, &c, 0, err) == 0, "%s",
          err);
    const int W = 4;
    int64_t lo[64], hi[64];
    dp_engine_state_ranges(&m.tt, W, 0, lo, hi);
    double others = 0.0, layer_max = 0.0;
    for (int l = 0; l < m.tt.n_layers; l++) {
        others += (double)(m.tt.state_numel[l] - (hi[l] - lo[l]));
        layer_max = fmax(layer_max, 4.0 * (double)m.tt.state_numel[l]);
    }
    Shape se = {"engine", "tiny", 4, 64, 4, 2, 0, 0, 0, 12e6, 0};
    for (int sync = 0; sync <= 1; sync++)
        for (int plain = 0; plain <= 1; plain++)
            for (int out = 0; out <= 1; out++) {
                se.sync = sync;
                TrainArgs a = shape_args(&se);
                EngineOptions eo = shape_engine_options(&se);
                if (plain) a.val = "data/tiny_val.bin";  // (the plain path reads the weights)
                if (out) a.out = "somewhere";
                const double whole = memory_estimate(&a, &m, 2, &eo).total;
                a.dist_world = W;
                const double rank = memory_estimate(&a, &m, 2, &eo).total;
                // m and v: 8 B per element of the others' shards; the fp32 weights 4 B, less
                // the start-up's whole copy (sync: no second gradient set to come after it) or
                // the final write's; the collectives' buffer; --out: a checkpoint's layer
                double want = 8.0 * others;
                if (!plain) want += 4.0 * others - (sync || out ? 4.0 * others : 0.0);
                want -= layer_max * (out ? 2.0 : 1.0);
                CHECK(t, fabs((whole - rank) - want) < 1.0,
                      "sync %d plain %d out %d: rank 0 holds %.0f bytes less than one process, "
                      "expected %.0f", sync, plain, out, whole - rank, want);
                if (sync || plain || out) continue;
                // between the two: one process is refused, rank 0 of four starts
                const double limit = (whole + rank) / 2;
                CHECK(t, check_quietly(&a, &m, 2, &eo, limit, 1, err) == 0, "rank 0 fits: %s",
                      err);
                a.dist_world = 1;
                CHECK(t, check_quietly(&a, &m, 2, &eo, limit, 1, err) == -1 &&
                             strstr(err, "not enough host memory"),
                      "one process does not fit: %s", err);
            }
    // --export-lora writes too: the fp32 weights gathered whole onto rank 0 at the end
    {
        se.sync = 0;
        TrainArgs a = shape_args(&se);
        EngineOptions eo = shape_engine_options(&se);
        a.export_lora = "somewhere";
        const double whole = memory_estimate(&a, &m, 2, &eo).total;
        a.dist_world = W;
        const double rank = memory_estimate(&a, &m, 2, &eo).total;
        const double want = 8.0 * others - layer_max;
        CHECK(t, fabs((whole - rank) - want) < 1.0,
              "--export-lora: rank 0 holds %.0f bytes less than one process, expected %.0f",
              whole - rank, want);
    }
    model_free(&m);
    // LoRA: the adapters' fp32 weights stay whole on every rank (store_release_state keeps a
    // layer with a frozen head), only their m and v are sharded; a checkpoint gathers the
    // adapters' m and v whole onto rank 0 at once
    const LoraSpec ls = {.r = 4, .alpha = 8, .targets = LORA_ALL_LINEAR};
    CHECK(t, model_init_lora(&m, &c, 0, &ls, err) == 0, "%s", err);
    dp_engine_state_ranges(&m.tt, W, 0, lo, hi);
    double lora_others = 0.0, lora_max = 0.0;
    for (int l = 0; l < m.tt.n_layers; l++) {
        lora_others += (double)(m.tt.state_numel[l] - (hi[l] - lo[l]));
        lora_max = fmax(lora_max, 4.0 * (double)m.tt.state_numel[l]);
    }
    CHECK(t, lora_others > 0, "the LoRA model's adapters are not sharded");
    for (int sync = 0; sync <= 1; sync++)
        for (int out = 0; out <= 1; out++) {
            se.sync = sync;
            TrainArgs a = shape_args(&se);
            EngineOptions eo = shape_engine_options(&se);
            a.lora_r = 4;
            if (out) a.out = "somewhere";
            const double whole = memory_estimate(&a, &m, 2, &eo).total;
            a.dist_world = W;
            const double rank = memory_estimate(&a, &m, 2, &eo).total;
            const double want = (out ? 0.0 : 8.0 * lora_others) - lora_max;
            CHECK(t, fabs((whole - rank) - want) < 1.0,
                  "LoRA sync %d out %d: rank 0 holds %.0f bytes less than one process, "
                  "expected %.0f", sync, out, whole - rank, want);
        }
    model_free(&m);
#ifdef HAVE_CUDA
    // the CLI: the plan's per-rank figure is the one the run's start-up check compares (the run
    // is refused there, before its rendezvous)
    const char* env = getenv(MEMORY_LIMIT_ENV);
    char* saved = env ? strndup_check(env, strlen(env)) : NULL;
    const char* flags = "--device cpu:2 --world 4 --batch 4 --micro-batches 4 --val '' "
                        "--sample-tokens 0 --steps 1";
    char args[512];
    snprintf(args, sizeof args, "%s --plan", flags);
    int rc = test_run_cli(t, "mem_dp_plan", args);
    char* o = test_read_output(t, "mem_dp_plan", "out");
    const double planned = bytes_after(o, "host memory per rank as this build runs it: ");
    const double node = bytes_after(o, "host memory for this plan: ");
    CHECK(t, rc == 0 && planned > 0 && node > planned, "--plan --world 4: exit %d: %s", rc, o);
    free(o);
    setenv(MEMORY_LIMIT_ENV, "1M", 1);
    snprintf(args, sizeof args, "%s --rank 0 --dist-init tcp://127.0.0.1:9", flags);
    rc = test_run_cli(t, "mem_dp_run", args);
    char* e = test_read_output(t, "mem_dp_run", "err");
    o = test_read_output(t, "mem_dp_run", "out");
    const double checked = bytes_after(e, "this run needs about ");
    CHECK(t, rc == 2 && strstr(o, "on rank 0 of 4 (ZeRO-1") &&
                 fabs(checked - planned) < 0.006 * 1073741824.0,
          "rank 0 of 4: the check's %.0f bytes, the plan's %.0f: exit %d: %s", checked, planned,
          rc, e);
    free(e);
    free(o);
    if (saved) setenv(MEMORY_LIMIT_ENV, saved, 1);
    else unsetenv(MEMORY_LIMIT_ENV);
    free(saved);
#endif
}

// A streamed base loaded from a GGUF stages a slice per loader thread, not a whole tensor:
// Qwen3-235B-A22B's expert tensors (6 GiB of fp32 each) count at most LOADER_SLICE_BYTES per
// thread, where a preset's random init counts its chunks as before.
static void test_memory_stream_staging_gguf(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    Model m;
    CHECK(t, config_from_preset(&c, "qwen3-235b-a22b", err) == 0, "%s", err);
    const LoraSpec l = {.r = 8, .alpha = 16, .targets = LORA_ALL_LINEAR};
    CHECK(t, model_init_lora(&m, &c, 0, &l, err) == 0, "%s", err);
    double largest = 0.0;
    for (int i = 0; i < m.tt.n; i++)
        if (!m.tt.t[i].trainable) largest = fmax(largest, 4.0 * (double)m.tt.t[i].numel);
    TrainArgs a;
    args_defaults(&a);
    a.device = DEVICE_CUDA;  // (every frozen tensor streamed into bf16)
    a.model = "somewhere/qwen3-235b.gguf";
    int from_file = 0;
    const double cpus = threads_online_cpus();
    const double gguf = memory_stream_staging(&a, &m, &from_file) / cpus;
    CHECK(t, from_file && largest > 4e9 && gguf <= LOADER_SLICE_BYTES &&
                 gguf > 0.5 * LOADER_SLICE_BYTES,
          "a GGUF: %.0f bytes staged per thread (the largest tensor %.0f)", gguf, largest);
    a.model = "qwen3-235b-a22b";
    const double init = memory_stream_staging(&a, &m, &from_file) / cpus;
    CHECK(t, !from_file && init == 4.0 * (1 << 20), "the random init: %.0f per thread", init);
    model_free(&m);
}

const TestCase tests_memory[] = {
    {"memory_limit", test_memory_limit},
    {"memory_estimate_vs_rss", test_memory_estimate_vs_rss},
    {"memory_refusal_message", test_memory_refusal_message},
    {"memory_cli", test_memory_cli},
    {"memory_dp_rank", test_memory_dp_rank},
    {"memory_stream_staging_gguf", test_memory_stream_staging_gguf},
    {NULL, NULL},
};
