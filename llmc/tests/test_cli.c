/*
 * test_cli.c — suite `cli`: the run's safety around training, end to end through the trainer.
 *
 *  - outputs checked before the first step (llmc/outputs): colliding outputs, an output over an
 *    input, file/folder mismatches and unwritable folders are refused with one line and exit 2
 *    before anything is written; missing folders are created; --plan creates nothing; the module
 *    itself (path spellings that name one file, the names an output folder reserves);
 *  - one run per --out folder: a second process is refused with the first one's pid, a SIGTERM
 *    stops the first one cleanly (exit 143, a complete checkpoint), and its stale lock is taken
 *    over;
 *  - SIGINT at an exact step (the test hook): exit 130, a checkpoint and the --out model, and
 *    --resume continues bit-exactly (plain training, and the delayed engine, which drains the
 *    iteration in flight first); a second signal exits at once without saving;
 *  - a resumed log is marked ({"resume": N}) and reads as one consistent run, also after a run
 *    killed past its last checkpoint and one that left half a line;
 *  - messages: values too large say so, an unknown flag suggests the closest one, one line each;
 *    non-finite weights are named and no --lr advice is given; the delayed engine's first step
 *    shows "norm -" / "lr -" and null in the log;
 *  - a --device-mem too small for any plan names the smallest that fits (llmc/plan_hint);
 *  - the progress line (llmc/progress): silent off a terminal and for short work, bytes and
 *    rate on one, its final state on a line of its own.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../common.h"
#include "../dataloader.h"
#include "../json.h"
#include "../outputs.h"
#include "../progress.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

// snprintf for the test's paths and command lines (all far below their buffers; truncation would
// only make a check fail).
__attribute__((format(printf, 3, 4))) static void fmt(char* buf, size_t cap, const char* f, ...) {
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, cap, f, ap);
    va_end(ap);
}

static int count_lines(const char* s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static int path_exists(const char* p) {
    struct stat st;
    return stat(p, &st) == 0;
}

// test_run_cli with one environment variable set for the run.
static int run_cli_env(TestCtx* t, const char* tag, const char* name, const char* value,
                       const char* args) {
    setenv(name, value, 1);
    const int rc = test_run_cli(t, tag, args);
    unsetenv(name);
    return rc;
}

// The trainer started in the background (stdout/stderr to tmpdir/<tag>.out/.err); its pid.
static pid_t spawn_cli(TestCtx* t, const char* tag, const char* args) {
    char cmd[8192];
    fmt(cmd, sizeof cmd, "exec %s %s > '%s/%s.out' 2> '%s/%s.err'", test_trainer_binary(),
             args, t->tmpdir, tag, t->tmpdir, tag);
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        if (chdir(t->exe_dir) != 0) _exit(127);
        execl("/bin/sh", "sh", "-c", cmd, (char*)NULL);
        _exit(127);
    }
    return pid;
}

// Wait until path holds needle (up to timeout_s); 1 if it did.
static int wait_for_text(const char* path, const char* needle, double timeout_s) {
    const double t0 = time_now_s();
    while (time_now_s() - t0 < timeout_s) {
        char* s = test_read_file(path, NULL);
        const int found = strstr(s, needle) != NULL;
        free(s);
        if (found) return 1;
        usleep(20000);
    }
    return 0;
}

// The exit status of a child (-1: killed by a signal, or still running after timeout_s).
static int wait_exit(pid_t pid, double timeout_s) {
    const double t0 = time_now_s();
    int st = 0;
    for (;;) {
        const pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (r < 0 || time_now_s() - t0 > timeout_s) break;
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

// A run's log as one consistent run: for each step the deterministic head of its record
// ("{"step":N,"loss":..,"lr":..,"norm":.."), a {"resume":N} line dropping the records of later
// steps. *dup: a step logged twice without a resume marker in between. Returns the highest step.
enum { CLI_MAX_STEPS = 64 };
typedef struct LogRun {
    char head[CLI_MAX_STEPS + 1][160];
    int n_resume;   // resume markers
    int dup;        // a step repeated without a marker
    int bad_lines;  // lines that are not JSON
} LogRun;

static int read_log_run(const char* path, LogRun* r) {
    memset(r, 0, sizeof *r);
    char* text = test_read_file(path, NULL);
    char err[ERR_LEN];
    int last = 0;
    for (char* line = text; *line;) {
        char* nl = strchr(line, '\n');
        const size_t len = nl ? (size_t)(nl - line) : strlen(line);
        JsonDoc doc;
        if (json_parse(line, len, &doc, err) != 0) {
            r->bad_lines++;
        } else {
            double v;
            int64_t step;
            if (json_get_double(&doc.root, "resume", &v) == 1) {
                r->n_resume++;
                for (int s = (int)v + 1; s <= CLI_MAX_STEPS; s++) r->head[s][0] = '\0';
            } else if (json_get_double(&doc.root, "loss", &v) == 1 &&
                       json_get_double(&doc.root, "step", &v) == 1) {
                step = (int64_t)v;
                const char* end = strstr(line, ",\"ms\":");
                if (step >= 1 && step <= CLI_MAX_STEPS && end && end - line < 160) {
                    if (r->head[step][0]) r->dup = 1;
                    memcpy(r->head[step], line, (size_t)(end - line));
                    r->head[step][end - line] = '\0';
                    if (step > last) last = (int)step;
                }
            }
            json_free(&doc);
        }
        line = nl ? nl + 1 : line + len;
    }
    free(text);
    return last;
}

static void check_same_log(TestCtx* t, const char* straight, const char* resumed, int steps,
                           const char* what) {
    LogRun a, b;
    read_log_run(straight, &a);
    read_log_run(resumed, &b);
    CHECK(t, !b.dup && b.bad_lines == 0, "%s: the resumed log repeats a step (%d) or has %d bad "
          "lines", what, b.dup, b.bad_lines);
    for (int s = 1; s <= steps; s++)
        CHECK(t, a.head[s][0] && strcmp(a.head[s], b.head[s]) == 0, "%s step %d: '%s' vs '%s'",
              what, s, a.head[s], b.head[s]);
}

// A tiny shard of 4000 tokens below 89 (test-qwen3 has 96 tokens, test-llama 128).
static void write_shard(TestCtx* t, char* path, size_t cap) {
    char err[ERR_LEN];
    static uint32_t toks[4000];
    for (int i = 0; i < 4000; i++) toks[i] = (uint32_t)((i * 7 + i / 11) % 89);
    test_path(t, path, cap, "cli_shard.bin");
    CHECK(t, shard_write(path, toks, 4000, 2, err) == 0, "%s", err);
}

// ----------------------------------------------------------------------------
// outputs

static void test_cli_outputs_refused(TestCtx* t) {
    char d[1024], args[8192];
    test_path(t, d, sizeof d, "outs");
    CHECK(t, mkdir(d, 0755) == 0, "mkdir %s", d);
    char file[1100];
    fmt(file, sizeof file, "%s/afile", d);
    FILE* f = fopen(file, "w");
    CHECK(t, f && fputs("x", f) >= 0 && fclose(f) == 0, "cannot write %s", file);
    struct {
        const char* fmt;  // %1$s: the folder d
        const char* must_mention;
    } cases[] = {
        {"--export-gguf %1$s/hf/model.safetensors --export-hf %1$s/hf", "--export-hf"},
        {"--log %1$s/run/config.json --out %1$s/run", "--out"},
        {"--log %1$s/run/step_4/x.jsonl --out %1$s/run", "step_4"},
        {"--export-hf %1$s/run/step_2 --out %1$s/run", "step_2"},
        {"--trace %1$s/t.json --log %1$s/t.json --device cpu:2", "same path"},
        {"--trace %1$s/x/../t.json --log %1$s/./t.json --device cpu:2", "same path"},
        {"--out %1$s/same --export-hf %1$s/same/", "same path"},
        {"--log %1$s/l.jsonl --export-gguf %1$s/l.jsonl.tmp", "l.jsonl"},
        {"--log %1$s", "is a folder"},
        {"--export-gguf %1$s/new/", "ends in '/'"},
        {"--out %1$s/afile", "not a folder"},
        {"--log %1$s/afile/x.jsonl", "is a file"},
        {"--log %1$s/afile/deeper/x.jsonl", "is a file"},
        {"--log /proc/self/no/x.jsonl", "cannot write"},
        {"--log data/tiny_train.bin", "--train"},
        {"--dump-state data/tiny_val.bin", "--val"},
        {NULL, NULL},
    };
    for (int i = 0; cases[i].fmt; i++) {
        char flags[8192];
        fmt(flags, sizeof flags, cases[i].fmt, d);
        fmt(args, sizeof args, "%s --steps 1 --sample-tokens 0", flags);
        const int rc = test_run_cli(t, "refused", args);
        char* err = test_read_output(t, "refused", "err");
        char* out = test_read_output(t, "refused", "out");
        CHECK(t, rc == 2 && count_lines(err) == 1 && strstr(err, "train_roundpipe: error:") &&
                     strstr(err, cases[i].must_mention),
              "'%s': exit %d, want one line mentioning '%s': %s", flags, rc,
              cases[i].must_mention, err);
        CHECK(t, !strstr(out, "step "), "'%s': trained before refusing", flags);
        free(err);
        free(out);
    }
    // refused runs created nothing
    char p[4096];
    fmt(p, sizeof p, "%s/hf", d);
    CHECK(t, !path_exists(p), "a refused run created %s", p);
    fmt(p, sizeof p, "%s/run", d);
    CHECK(t, !path_exists(p), "a refused run created %s", p);
    // --plan checks but writes nothing
    fmt(args, sizeof args, "--device cpu:2 --plan --out %s/planned --log %s/p/l.jsonl", d, d);
    int rc = test_run_cli(t, "plan", args);
    fmt(p, sizeof p, "%s/planned", d);
    CHECK(t, rc == 0 && !path_exists(p), "--plan: exit %d, %s created", rc, p);
    // the folders of every output are created, with their parents
    fmt(args, sizeof args,
             "--steps 1 --batch 2 --seq 16 --val '' --sample-tokens 0 --threads 1 "
             "--out %1$s/a/b/run --log %1$s/c/d/run.jsonl --export-gguf %1$s/e/model.gguf "
             "--export-hf %1$s/f/g",
             d);
    rc = test_run_cli(t, "created", args);
    const char* made[] = {"a/b/run/model.safetensors", "a/b/run/.lock", "c/d/run.jsonl",
                          "e/model.gguf", "f/g/config.json", NULL};
    CHECK(t, rc == 0, "nested outputs: exit %d", rc);
    for (int i = 0; made[i]; i++) {
        fmt(p, sizeof p, "%s/%s", d, made[i]);
        CHECK(t, path_exists(p), "%s was not written", p);
    }
    // the log is written in place: /dev/null will do; a file written by renaming a temporary
    // over it must not be /dev/null (the rename would replace the device)
    rc = test_run_cli(t, "devnull", "--steps 1 --batch 2 --seq 16 --val '' --sample-tokens 0 "
                                    "--threads 1 --log /dev/null");
    CHECK(t, rc == 0, "--log /dev/null: exit %d", rc);
    const char* atomic[] = {"--trace /dev/null --device cpu:1", "--export-gguf /dev/null",
                            "--dump-state /dev/null", NULL};
    for (int i = 0; atomic[i]; i++) {
        fmt(args, sizeof args, "--steps 1 --sample-tokens 0 %s", atomic[i]);
        rc = test_run_cli(t, "devnull", args);
        char* err = test_read_output(t, "devnull", "err");
        CHECK(t, rc == 2 && strstr(err, "not a regular file"), "%s: exit %d: %s", atomic[i], rc,
              err);
        free(err);
    }
    struct stat st;
    CHECK(t, stat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode), "/dev/null is no device now");
}

static void test_cli_outputs_module(TestCtx* t) {
    char d[1024], err[ERR_LEN], a_path[4096], b_path[4096], link[4096];
    test_path(t, d, sizeof d, "outmod");
    CHECK(t, mkdir(d, 0755) == 0, "mkdir");
    fmt(a_path, sizeof a_path, "%s/real", d);
    CHECK(t, mkdir(a_path, 0755) == 0, "mkdir");
    fmt(link, sizeof link, "%s/link", d);
    CHECK(t, symlink(a_path, link) == 0, "symlink");
    static const char* const writes[] = {"weights.bin", "ckpt_*", NULL};
    Outputs o;
    // a symlinked folder and the folder itself are one path
    outputs_init(&o);
    fmt(b_path, sizeof b_path, "%s/link/new/../x.log", d);
    char c_path[4096];
    fmt(c_path, sizeof c_path, "%s/real/x.log", d);
    outputs_add(&o, "--a", b_path, OUTPUT_FILE, NULL);
    outputs_add(&o, "--b", c_path, OUTPUT_FILE, NULL);
    CHECK(t, outputs_check(&o, err) != 0 && strstr(err, "same path"), "symlink: %s", err);
    // names a folder's writer reserves, and everything under a reserved folder
    outputs_init(&o);
    outputs_add(&o, "--dir", a_path, OUTPUT_DIR, writes);
    fmt(b_path, sizeof b_path, "%s/link/ckpt_7/y", d);
    outputs_add(&o, "--f", b_path, OUTPUT_FILE, NULL);
    CHECK(t, outputs_check(&o, err) != 0 && strstr(err, "ckpt_7"), "reserved folder: %s", err);
    outputs_init(&o);
    outputs_add(&o, "--dir", a_path, OUTPUT_DIR, writes);
    fmt(b_path, sizeof b_path, "%s/weights.bin.tmp", a_path);
    outputs_add(&o, "--f", b_path, OUTPUT_FILE, NULL);
    CHECK(t, outputs_check(&o, err) != 0, "a writer's temporary is reserved too");
    // other names in the folder are free; empty paths are not asked for
    outputs_init(&o);
    outputs_add(&o, "--dir", a_path, OUTPUT_DIR, writes);
    fmt(b_path, sizeof b_path, "%s/notes.txt", a_path);
    outputs_add(&o, "--f", b_path, OUTPUT_FILE, NULL);
    outputs_add(&o, "--none", "", OUTPUT_FILE, NULL);
    CHECK(t, outputs_check(&o, err) == 0 && o.n == 2, "free name: %s", err);
    // an input matched by a glob
    outputs_init(&o);
    fmt(b_path, sizeof b_path, "%s/notes.txt", a_path);
    FILE* f = fopen(b_path, "w");
    CHECK(t, f && fclose(f) == 0, "create %s", b_path);
    char pattern[4200];
    fmt(pattern, sizeof pattern, "%s/link/*.txt", d);
    outputs_add(&o, "--f", b_path, OUTPUT_FILE, NULL);
    outputs_add_input(&o, "--in", pattern, 1);
    CHECK(t, outputs_check(&o, err) != 0 && strstr(err, "--in"), "input: %s", err);
    // the lock: a second holder in this process is refused (flock locks are per open file)
    Outputs l1, l2;
    outputs_init(&l1);
    outputs_init(&l2);
    CHECK(t, outputs_lock(&l1, a_path, err) == 0, "lock: %s", err);
    char pid[32];
    fmt(pid, sizeof pid, "pid %ld", (long)getpid());
    CHECK(t, outputs_lock(&l2, a_path, err) != 0 && strstr(err, pid), "second lock: %s", err);
    outputs_release(&l1);
    CHECK(t, outputs_lock(&l2, a_path, err) == 0, "lock after release: %s", err);
    outputs_release(&l2);
}

// ----------------------------------------------------------------------------
// the lock, and signals from another process

static void test_cli_lock_two_processes(TestCtx* t) {
    char d[1024], args[16384], lock[4096], ckpt[4200];
    test_path(t, d, sizeof d, "locked");
    fmt(lock, sizeof lock, "%s/.lock", d);
    // the first run trains "forever" and holds the lock
    fmt(args, sizeof args, "--steps 100000 --batch 2 --seq 16 --val '' --sample-tokens 0 "
                                "--threads 1 --save-every 1000 --out '%s'", d);
    const pid_t first = spawn_cli(t, "first", args);
    char out_path[4096], pid_text[32];
    fmt(out_path, sizeof out_path, "%s/first.out", t->tmpdir);
    fmt(pid_text, sizeof pid_text, "%ld\n", (long)first);
    CHECK(t, first > 0 && wait_for_text(lock, pid_text, 60) && wait_for_text(out_path, "step ", 60),
          "the first run did not start (lock holds its pid, a step printed)");
    // a second run on the folder is refused with the first one's pid, before loading anything
    fmt(args, sizeof args, "--steps 2 --out '%s'", d);
    int rc = test_run_cli(t, "second", args);
    char* err = test_read_output(t, "second", "err");
    char want[64];
    fmt(want, sizeof want, "pid %ld", (long)first);
    CHECK(t, rc == 2 && count_lines(err) == 1 && strstr(err, want), "second run: exit %d: %s", rc,
          err);
    free(err);
    // SIGTERM: the first run finishes its step, saves a checkpoint and exits 143
    kill(first, SIGTERM);
    rc = wait_exit(first, 60);
    char* out = test_read_output(t, "first", "out");
    CHECK(t, rc == 143 && strstr(out, "interrupted by SIGTERM") && strstr(out, "--resume"),
          "SIGTERM: exit %d: %s", rc, out);
    int step = 0;
    const char* p = strstr(out, "interrupted by SIGTERM after step ");
    if (p) step = atoi(p + strlen("interrupted by SIGTERM after step "));
    fmt(ckpt, sizeof ckpt, "%s/step_%d/DONE", d, step);
    CHECK(t, step > 0 && path_exists(ckpt), "no complete checkpoint %s", ckpt);
    free(out);
    // its lock is stale now (the file still holds its pid): the next run takes it over
    fmt(args, sizeof args, "--steps %d --batch 2 --seq 16 --val '' --sample-tokens 0 "
                                "--threads 1 --out '%s' --resume", step + 1, d);
    rc = test_run_cli(t, "third", args);
    char* lk = test_read_file(lock, NULL);
    CHECK(t, rc == 0 && atol(lk) != (long)first && atol(lk) > 0,
          "a stale lock is taken over: exit %d, lock '%s'", rc, lk);
    free(lk);
}

// ----------------------------------------------------------------------------
// SIGINT at a step, checkpoint, resume

static void interrupt_and_resume(TestCtx* t, const char* shard, const char* device,
                                 int stop_at_least) {
    char straight[1024], log[1024], d[1024], args[16384], common[4096], tag[64];
    const int steps = 8;
    fmt(common, sizeof common,
             "--model test-qwen3 --train '%s' --val '' --steps %d --batch 4 --seq 16 "
             "--micro-batches 2 --sample-tokens 0 --threads 1 --warmup 2 --device %s",
             shard, steps, device);
    fmt(tag, sizeof tag, "int_%s", device[3] ? "engine" : "plain");
    char name[96];
    fmt(name, sizeof name, "%s_straight.jsonl", tag);
    test_path(t, straight, sizeof straight, name);
    fmt(name, sizeof name, "%s.jsonl", tag);
    test_path(t, log, sizeof log, name);
    fmt(name, sizeof name, "%s_out", tag);
    test_path(t, d, sizeof d, name);
    fmt(args, sizeof args, "%s --log '%s'", common, straight);
    CHECK(t, test_run_cli(t, tag, args) == 0, "%s: the straight run failed", device);
    // SIGINT during step 3: plain training stops after it, the delayed engine after the
    // iteration in flight (step 4)
    fmt(args, sizeof args, "%s --log '%s' --out '%s'", common, log, d);
    int rc = run_cli_env(t, tag, "TRAIN_ROUNDPIPE_TEST_SIGNAL", "INT@3", args);
    char* out = test_read_output(t, tag, "out");
    char want[128], path[4096];
    fmt(want, sizeof want, "interrupted by SIGINT after step %d of %d", stop_at_least, steps);
    fmt(path, sizeof path, "%s/step_%d/DONE", d, stop_at_least);
    CHECK(t, rc == 130 && strstr(out, want) && path_exists(path) && strstr(out, "saved the model"),
          "%s: exit %d, want '%s' and %s: %s", device, rc, want, path, out);
    free(out);
    // resume: the same records as the straight run, after a {"resume":N} marker
    fmt(args, sizeof args, "%s --log '%s' --out '%s' --resume", common, log, d);
    rc = test_run_cli(t, tag, args);
    CHECK(t, rc == 0, "%s: resume exit %d", device, rc);
    char* text = test_read_file(log, NULL);
    fmt(want, sizeof want, "\n{\"resume\":%d}\n", stop_at_least);
    CHECK(t, strstr(text, want), "%s: no resume marker %s", device, want);
    free(text);
    check_same_log(t, straight, log, steps, device);
}

static void test_cli_interrupt_resume(TestCtx* t) {
    char shard[1024];
    write_shard(t, shard, sizeof shard);
    interrupt_and_resume(t, shard, "cpu", 3);
    interrupt_and_resume(t, shard, "cpu:2", 4);
    // SIGTERM exits 143; a second signal exits at once: no checkpoint, no model
    char d[1024], args[16384];
    test_path(t, d, sizeof d, "twice");
    fmt(args, sizeof args, "--train '%s' --model test-qwen3 --val '' --steps 6 --batch 2 "
                                "--seq 16 --sample-tokens 0 --threads 1 --out '%s'", shard, d);
    int rc = run_cli_env(t, "twice", "TRAIN_ROUNDPIPE_TEST_SIGNAL", "TERM@2*2", args);
    char p[4096];
    fmt(p, sizeof p, "%s/model.safetensors", d);
    char* err = test_read_output(t, "twice", "err");
    CHECK(t, rc == 143 && !path_exists(p) && strstr(err, "exiting now"),
          "second signal: exit %d, model written %d: %s", rc, path_exists(p), err);
    free(err);
    // interrupted without --out: nothing to resume from, said so
    fmt(args, sizeof args, "--train '%s' --model test-qwen3 --val '' --steps 6 --batch 2 "
                                "--seq 16 --sample-tokens 0 --threads 1", shard);
    rc = run_cli_env(t, "noout", "TRAIN_ROUNDPIPE_TEST_SIGNAL", "TERM@2", args);
    char* out = test_read_output(t, "noout", "out");
    CHECK(t, rc == 143 && strstr(out, "no checkpoint") && !strstr(out, "sample ("),
          "no --out: exit %d: %s", rc, out);
    free(out);
}

// A run killed past its last checkpoint (and mid-line): the resumed log marks the restart and
// reads as one run.
static void test_cli_log_resume(TestCtx* t) {
    char shard[1024], straight[1024], log[1024], d[1024], args[16384], common[4096];
    write_shard(t, shard, sizeof shard);
    test_path(t, straight, sizeof straight, "logres_straight.jsonl");
    test_path(t, log, sizeof log, "logres.jsonl");
    test_path(t, d, sizeof d, "logres_out");
    fmt(common, sizeof common,
             "--model test-qwen3 --train '%s' --val '' --steps 7 --batch 4 --seq 16 "
             "--sample-tokens 0 --threads 1 --save-every 2", shard);
    fmt(args, sizeof args, "%s --log '%s' --out '%s_straight'", common, straight, d);
    CHECK(t, test_run_cli(t, "logres", args) == 0, "straight run");
    // two signals after step 5: the second exits at once, so the newest checkpoint is step 4
    // while the log holds step 5; then a half-written line, as a kill mid-write leaves
    fmt(args, sizeof args, "%s --log '%s' --out '%s'", common, log, d);
    int rc = run_cli_env(t, "logres", "TRAIN_ROUNDPIPE_TEST_SIGNAL", "INT@5*2", args);
    CHECK(t, rc == 130, "killed run: exit %d", rc);
    FILE* f = fopen(log, "a");
    CHECK(t, f && fputs("{\"step\":6,\"lo", f) >= 0 && fclose(f) == 0, "append to %s", log);
    fmt(args, sizeof args, "%s --log '%s' --out '%s' --resume", common, log, d);
    rc = test_run_cli(t, "logres", args);
    CHECK(t, rc == 0, "resume: exit %d", rc);
    char* text = test_read_file(log, NULL);
    CHECK(t, strstr(text, "\"lo\n{\"resume\":4}\n{\"step\":5,"),
          "the marker ends the half line and precedes the repeated step 5: %s", text);
    free(text);
    LogRun a, b;
    read_log_run(straight, &a);
    read_log_run(log, &b);
    CHECK(t, b.n_resume == 1 && !b.dup && b.bad_lines == 1, "resume markers %d, dup %d, bad %d",
          b.n_resume, b.dup, b.bad_lines);
    for (int s = 1; s <= 7; s++)
        CHECK(t, strcmp(a.head[s], b.head[s]) == 0, "step %d: '%s' vs '%s'", s, a.head[s],
              b.head[s]);
    // a new run (no --resume) starts the log afresh
    fmt(args, sizeof args, "%s --log '%s' --out '%s_fresh'", common, log, d);
    CHECK(t, test_run_cli(t, "logres", args) == 0, "fresh run");
    text = test_read_file(log, NULL);
    CHECK(t, !strstr(text, "resume") && count_lines(text) == 7, "fresh log: %s", text);
    free(text);
}

// ----------------------------------------------------------------------------
// messages

static void test_cli_messages(TestCtx* t) {
    struct {
        const char* args;
        const char* want;
    } cases[] = {
        {"--batch 2000000", "too large (at most 1048576)"},
        {"--batch 99999999999999999999", "too large"},
        {"--steps 1e12", "expected an integer"},
        {"--save-every 99999999999", "too large"},
        {"--seq 0", "too small (at least 1)"},
        {"--lr 11", "too large (at most 10)"},
        {"--lr 1e400", "too large"},
        {"--lr nan", "expected a finite number"},
        {"--lr 0", "too small"},
        {"--seed 99999999999", "too large"},
        {"--seed -1", "too small"},
        {"--device cpu:100", "too large"},
        {"--device-mem 1e400", "too large"},
        {"--device-mem 5000P", "expected a positive size"},
        {"--batchs 4", "did you mean --batch?"},
        {"--lrr 1e-3", "did you mean --lr?"},
        {"--export-gguff x", "did you mean --export-gguf?"},
        {"--zzzzzzzz", "unknown flag"},
        {"--steps", "needs a value"},
        {NULL, NULL},
    };
    for (int i = 0; cases[i].args; i++) {
        const int rc = test_run_cli(t, "msg", cases[i].args);
        char* err = test_read_output(t, "msg", "err");
        CHECK(t, rc == 2 && count_lines(err) == 1 && strstr(err, cases[i].want) &&
                     strstr(err, "(see --help)"),
              "'%s': exit %d, want one line with '%s': %s", cases[i].args, rc, cases[i].want, err);
        free(err);
    }
}

// Overwrite n floats of tensor `name` in a safetensors file with value.
static int poke_tensor(TestCtx* t, const char* path, const char* name, int64_t n, float value) {
    char err[ERR_LEN];
    StFile st;
    int64_t offset = -1, numel = 0;
    if (st_open(&st, path, err) == 0) {
        const StTensor* x = st_find(&st, name);
        if (x) {
            offset = (int64_t)(x->data - st.map);
            numel = x->numel;
        }
        st_close(&st);
    }
    CHECK(t, offset > 0 && numel >= n, "no %s in %s", name, path);
    if (offset <= 0 || numel < n) return -1;
    const int fd = open(path, O_WRONLY);
    int ok = fd >= 0;
    for (int64_t i = 0; ok && i < (n < 0 ? numel : n); i++)
        ok = pwrite(fd, &value, 4, offset + 4 * i) == 4;
    if (fd >= 0 && close(fd) != 0) ok = 0;
    CHECK(t, ok, "cannot write %s", path);
    return ok ? 0 : -1;
}

// Weights that make the loss non-finite before any update: no --lr advice. A NaN in the file
// is refused when loading, naming the tensor and element.
static void test_cli_nonfinite_weights(TestCtx* t) {
    char d[1024], args[16384], path[4096], shard[1024];
    write_shard(t, shard, sizeof shard);
    test_path(t, d, sizeof d, "bigmodel");
    fmt(args, sizeof args, "--model test-llama --steps 0 --val '' --sample-tokens 0 "
                           "--train '%s' --out '%s'", shard, d);
    CHECK(t, test_run_cli(t, "bigmodel", args) == 0, "write the model");
    // an LM head of 3e38 (finite): the logits overflow to infinity at once
    fmt(path, sizeof path, "%s/model.safetensors", d);
    if (poke_tensor(t, path, "lm_head.weight", -1, 3e38f) != 0) return;
    for (int engine = 0; engine <= 2; engine++) {
        fmt(args, sizeof args, "--model '%s' --steps 3 --val '' --sample-tokens 0 --train '%s' "
                               "--batch 2 --seq 16 --threads 1%s", d, shard,
            engine == 1 ? " --device cpu:2" : engine == 2 ? " --device cpu:2 --sync 1" : "");
        const int rc = test_run_cli(t, "bigrun", args);
        char* e = test_read_output(t, "bigrun", "err");
        CHECK(t, rc == 1 && count_lines(e) == 1 && strstr(e, "not finite at step 1") &&
                     strstr(e, "weights the run started from") && !strstr(e, "--lr"),
              "huge weights (%d): exit %d: %s", engine, rc, e);
        free(e);
    }
    // a NaN: refused by the loader, which names it
    const char* victim = "model.layers.0.mlp.up_proj.weight";
    if (poke_tensor(t, path, victim, 1, NAN) != 0) return;
    fmt(args, sizeof args, "--model '%s' --steps 3 --val '' --sample-tokens 0 --train '%s' "
                           "--batch 2 --seq 16 --threads 1", d, shard);
    const int rc = test_run_cli(t, "nanrun", args);
    char* e = test_read_output(t, "nanrun", "err");
    CHECK(t, rc == 1 && count_lines(e) == 1 && strstr(e, victim) && strstr(e, "NaN") &&
                 !strstr(e, "--lr"),
          "NaN weights: exit %d: %s", rc, e);
    free(e);
}

// The delayed engine's first step applies no update: "-" on the line, null in the log.
static void test_cli_delayed_first_step(TestCtx* t) {
    char log[1024], args[16384];
    test_path(t, log, sizeof log, "delayed.jsonl");
    fmt(args, sizeof args, "--steps 2 --batch 4 --seq 16 --val '' --sample-tokens 0 "
                                "--threads 1 --device cpu:2 --log '%s'", log);
    const int rc = test_run_cli(t, "delayed", args);
    char* out = test_read_output(t, "delayed", "out");
    char* text = test_read_file(log, NULL);
    CHECK(t, rc == 0 && strstr(out, "| norm        - | lr         - |") &&
                 strstr(out, "step     2/2") &&
                 !strstr(strstr(out, "step     2/2"), "norm        -"),
          "step lines: %s", out);
    CHECK(t, strstr(text, "{\"step\":1,") && strstr(text, "\"lr\":null,\"norm\":null") &&
                 !strstr(strstr(text, "{\"step\":2,"), "null"),
          "log: %s", text);
    free(out);
    free(text);
}

// A --device-mem too small for any plan: the error says the smallest that fits, which does.
static void test_cli_device_mem_hint(TestCtx* t) {
    int rc = test_run_cli(t, "devmem", "--device cpu:2 --device-mem 64K --steps 1 --val '' "
                                       "--sample-tokens 0 --threads 1");
    char* err = test_read_output(t, "devmem", "err");
    const char* p = strstr(err, "the smallest --device-mem that fits is ");
    char value[32] = "";
    if (p) sscanf(p + strlen("the smallest --device-mem that fits is "), "%31[0-9MG]", value);
    CHECK(t, rc == 1 && count_lines(err) == 1 && value[0], "64K: exit %d: %s", rc, err);
    free(err);
    char args[512];
    fmt(args, sizeof args, "--device cpu:2 --device-mem %s --steps 1 --val '' --sample-tokens 0 "
                           "--threads 1", value);
    rc = test_run_cli(t, "devmem", args);
    CHECK(t, rc == 0, "--device-mem %s (the suggested value): exit %d", value, rc);
}

// ----------------------------------------------------------------------------
// the progress line

static void test_cli_progress(TestCtx* t) {
    char* buf = NULL;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    Progress p;
    // not a terminal: nothing, whatever happens
    progress_begin_on(&p, f, 0, "loading x", 4e9);
    progress_update_at(&p, 1e9, p.t_start + 5);
    progress_end(&p);
    fflush(f);
    CHECK(t, len == 0, "not a terminal, yet drawn: %s", buf);
    // a terminal: nothing in the first half second, then the line with bytes, percent and rate
    progress_begin_on(&p, f, 1, "loading x", 4.0 * (1 << 30));
    p.t_start = 1000.0;  // a clock of the test's own: offsets of 0.2 s and 1 s are exact there
    progress_update_at(&p, 0.5 * (1 << 30), p.t_start + 0.2);
    fflush(f);
    CHECK(t, len == 0, "drawn within the first half second: %s", buf);
    progress_update_at(&p, 1.0 * (1 << 30), p.t_start + 1.0);
    fflush(f);
    CHECK(t, buf && strstr(buf, "\rloading x: 1.00 GiB / 4.00 GiB (25%), 1.00 GiB/s, 3 s left"),
          "line: %s", buf ? buf : "");
    const size_t after_first = len;
    progress_update_at(&p, 1.1 * (1 << 30), p.t_start + 1.05);  // too soon to redraw
    fflush(f);
    CHECK(t, len == after_first, "redrawn too often");
    progress_end(&p);
    fflush(f);
    CHECK(t, len > after_first && buf[len - 1] == '\n', "the end leaves its line");
    fclose(f);
    free(buf);
    // unknown totals
    char line[256];
    progress_format(line, sizeof line, "converting", 3.0 * (1 << 20), 0, 2.0);
    CHECK(t, strcmp(line, "converting: 3.00 MiB, 1.50 MiB/s") == 0, "%s", line);
}

const TestCase tests_cli[] = {
    {"cli_outputs_refused", test_cli_outputs_refused},
    {"cli_outputs_module", test_cli_outputs_module},
    {"cli_lock_two_processes", test_cli_lock_two_processes},
    {"cli_interrupt_resume", test_cli_interrupt_resume},
    {"cli_log_resume", test_cli_log_resume},
    {"cli_messages", test_cli_messages},
    {"cli_nonfinite_weights", test_cli_nonfinite_weights},
    {"cli_delayed_first_step", test_cli_delayed_first_step},
    {"cli_device_mem_hint", test_cli_device_mem_hint},
    {"cli_progress", test_cli_progress},
    {NULL, NULL},
};
