/*
 * test_train.c — ./train_roundpipe end to end: --help documents every flag, bad flags exit 2 with
 * one error line, bad inputs exit 1 with one error line, a short run learns and writes a valid
 * JSON-lines log and a loadable model, and --dump-state reproduces the HF parity gradients.
 * The step interface (llmc/trainer) directly: the engine with two iterations in flight gives the
 * same steps as the engine stopping after each one, and in sync mode the same as plain training.
 */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "../args.h"
#include "../common.h"
#include "../dataloader.h"
#include "../json.h"
#include "../safetensors.h"
#include "../trainer.h"
#include "testing.h"

static int count_lines(const char* s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static void test_train_help(TestCtx* t) {
    int rc = test_run_cli(t, "help", "--help");
    char* out = test_read_output(t, "help", "out");
    CHECK(t, rc == 0, "--help exit %d", rc);
    const char* flags[] = {"--model", "--train", "--val", "--batch", "--seq", "--micro-batches",
                           "--steps", "--lr", "--schedule", "--warmup", "--min-lr-frac",
                           "--weight-decay", "--beta1", "--beta2", "--eps", "--grad-clip",
                           "--shuffle", "--seed", "--eval-every", "--out", "--log", "--device",
                           "--threads", "--dump-state", "--decay-frac", "--decay-embeddings",
                           "--eval-batches", "--sample-tokens", "--prompt", "--init-std", "--temperature",
                           "--round", "--recompute", "--sync", "--device-mem", "--plan",
                           "--delay-us", "--trace", "--profile-steps", "--mlp-chunk", "--host-checkpoints",
                           "--profile-ops", "--row-chunks", "--split-rounds", "--no-split-rounds", NULL};
    for (int i = 0; flags[i]; i++) CHECK(t, strstr(out, flags[i]) != NULL, "--help lacks %s", flags[i]);
    CHECK(t, strstr(out, "default") != NULL, "--help shows defaults");
    free(out);
}

static void test_train_bad_flags(TestCtx* t) {
    const char* cases[] = {"--batch 0", "--batch x", "--lr -1", "--lr nan", "--schedule foo",
                           "--steps", "--frobnicate",
                           "--device tpu", "--device cuda:0", "--batch 4 --micro-batches 5", "--shuffle 2", "--grad-clip -1",
                           "--seed -3", "--min-lr-frac 2", "stray-argument", "--profile-ops --device cpu:2",
                           "--split-rounds", "--split-rounds --device cpu:2 --round 2", NULL};
    for (int i = 0; cases[i]; i++) {
        int rc = test_run_cli(t, "badflag", cases[i]);
        char* err = test_read_output(t, "badflag", "err");
        const char* last = err;
        for (const char* s = err; *s; s++)
            if (*s == '\n' && s[1]) last = s + 1;
        CHECK(t, rc == 2, "'%s' exit %d (want 2)", cases[i], rc);
        CHECK(t, count_lines(err) == 1 && strncmp(last, "train_roundpipe: error:", 23) == 0 &&
                     strstr(err, "see --help") && !strstr(err, "usage:"),
              "'%s': one error line with a hint to --help, got: %s", cases[i], err);
        free(err);
    }
}

static void test_train_bad_inputs(TestCtx* t) {
    // a shard with a token outside the fixture models' 128-token vocabulary
    char shard[1024], err[ERR_LEN], args[4096];
    uint32_t toks[2000];
    for (int i = 0; i < 2000; i++) toks[i] = (uint32_t)(i % 100);
    toks[1500] = 200;
    test_path(t, shard, sizeof shard, "bigtoken.bin");
    CHECK(t, shard_write(shard, toks, 2000, 2, err) == 0, "%s", err);
    struct {
        const char* args;
        const char* must_mention;
    } cases[] = {
        {"--model /nonexistent/model", "/nonexistent/model"},
        {"--model no-such-preset", "no-such-preset"},
        {"--train '/nonexistent/shard_*.bin'", "/nonexistent/shard_*.bin"},
        {"--model dev/parity/fixtures/llama --val '' --train", "vocab"},
        {"--model dev/parity/fixtures/llama/config.json --val '' --train", "1500"},
        {"--model README.md", "README.md"},
        {"--model dev/parity/fixtures/llama --val", "vocab"},
        {NULL, NULL},
    };
    for (int i = 0; cases[i].args; i++) {
        // cases ending in a data flag get the bad shard appended
        size_t len = strlen(cases[i].args);
        int wants_shard = len > 6 && (strcmp(cases[i].args + len - 7, "--train") == 0 ||
                                      strcmp(cases[i].args + len - 5, "--val") == 0);
        snprintf(args, sizeof args, "%s%s%s%s", cases[i].args, wants_shard ? " '" : "",
                 wants_shard ? shard : "", wants_shard ? "'" : "");
        int rc = test_run_cli(t, "badinput", args);
        char* err = test_read_output(t, "badinput", "err");
        CHECK(t, rc == 1, "'%s' exit %d (want 1)", cases[i].args, rc);
        CHECK(t, count_lines(err) == 1 && strstr(err, "error") && strstr(err, cases[i].must_mention),
              "'%s': want one error line mentioning '%s', got: %s", cases[i].args,
              cases[i].must_mention, err);
        free(err);
    }
}

static void test_train_short_run(TestCtx* t) {
    char args[4096], log[1024], outdir[1024];
    test_path(t, log, sizeof log, "run.jsonl");
    test_path(t, outdir, sizeof outdir, "saved");
    snprintf(args, sizeof args,
             "--steps 40 --batch 8 --seq 32 --warmup 5 --eval-every 20 --eval-batches 2 "
             "--threads 2 --sample-tokens 16 --log '%s' --out '%s'",
             log, outdir);
    int rc = test_run_cli(t, "run", args);
    char* out = test_read_output(t, "run", "out");
    CHECK(t, rc == 0, "exit %d; stderr in %s/run.err", rc, t->tmpdir);
    CHECK(t, strstr(out, "step    40/40") && strstr(out, "sample (16 tokens"), "step lines and sample");

    char err[ERR_LEN];
    char* text = file_read_all(log, 1 << 20, NULL, err);
    CHECK(t, text != NULL, "log: %s", err);
    int n_steps = 0, n_evals = 0;
    double first = 0, last = 0;
    for (char* line = text; text && *line;) {
        char* nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        JsonDoc doc;
        int ok = json_parse(line, len, &doc, err) == 0;
        CHECK(t, ok, "log line is not JSON: %.*s (%s)", (int)len, line, err);
        if (ok) {
            double loss, v;
            if (json_get_double(&doc.root, "loss", &loss) == 1) {
                CHECK(t, json_get_double(&doc.root, "lr", &v) == 1 &&
                             json_get_double(&doc.root, "norm", &v) == 1 &&
                             json_get_double(&doc.root, "ms", &v) == 1 &&
                             json_get_double(&doc.root, "tok_s", &v) == 1,
                      "step record keys: %.*s", (int)len, line);
                if (n_steps == 0) first = loss;
                last = loss;
                n_steps++;
            } else if (json_get_double(&doc.root, "val_loss", &v) == 1) {
                n_evals++;
            }
            json_free(&doc);
        }
        line = nl ? nl + 1 : line + len;
    }
    free(text);
    CHECK(t, n_steps == 40 && n_evals == 3, "%d step and %d eval records", n_steps, n_evals);
    CHECK(t, first > 5.0 && last < 0.75 * first, "loss must fall: %.4f -> %.4f", first, last);

    // the saved model loads back and evaluates to about the final training loss
    snprintf(args, sizeof args, "--model '%s' --steps 0 --sample-tokens 0 --eval-batches 2", outdir);
    rc = test_run_cli(t, "reload", args);
    char* out2 = test_read_output(t, "reload", "out");
    CHECK(t, rc == 0 && strstr(out2, "loaded weights") && strstr(out2, "val loss"),
          "reload exit %d: %s", rc, out2);
    free(out2);
    free(out);
}

// --dump-state on the parity fixture's batch (as a shard) gives HF's loss and gradients.
static void test_train_dump_state_parity(TestCtx* t) {
    char path[4300], err[ERR_LEN], shard[1024], dump[1024], args[4096];
    snprintf(path, sizeof path, "%s/dev/parity/fixtures/llama/expected.safetensors", t->exe_dir);
    StFile ex;
    if (st_open(&ex, path, err) != 0) {
        CHECK(t, 0, "%s", err);
        return;
    }
    const StTensor* tok = st_find(&ex, "tokens");
    int64_t n = tok->numel;
    uint32_t* toks = malloc_check((size_t)n * sizeof(uint32_t));
    for (int64_t i = 0; i < n; i++) {
        int32_t v;
        memcpy(&v, tok->data + 4 * i, 4);
        toks[i] = (uint32_t)v;
    }
    test_path(t, shard, sizeof shard, "parity_shard.bin");
    CHECK(t, shard_write(shard, toks, n, 2, err) == 0, "%s", err);
    free(toks);
    for (int mb = 1; mb <= 2; mb++) {
        snprintf(dump, sizeof dump, "%s/dump%d.safetensors", t->tmpdir, mb);
        snprintf(args, sizeof args,
                 "--model dev/parity/fixtures/llama --train '%s' --val '' --batch 2 --seq 16 "
                 "--micro-batches %d --dump-state '%s'",
                 shard, mb, dump);
        int rc = test_run_cli(t, "dump", args);
        CHECK(t, rc == 0, "dump-state exit %d", rc);
        StFile d;
        if (st_open(&d, dump, err) != 0) {
            CHECK(t, 0, "%s", err);
            continue;
        }
        float l, ref;
        st_tensor_to_f32(st_find(&d, "loss"), &l, 1, err);
        st_tensor_to_f32(st_find(&ex, "loss"), &ref, 1, err);
        CHECK(t, fabs(l - ref) <= 1e-5 * ref, "dump loss %.8g vs %.8g", l, ref);
        int compared = 0;
        for (int k = 0; k < ex.n_tensors; k++) {
            const StTensor* e = &ex.tensors[k];
            if (strncmp(e->name, "grad.", 5) != 0) continue;
            const StTensor* g = st_find(&d, e->name);
            CHECK(t, g && g->numel == e->numel, "dump lacks %s", e->name);
            if (!g || g->numel != e->numel) continue;
            float* a = malloc_check((size_t)g->numel * sizeof(float));
            float* b = malloc_check((size_t)g->numel * sizeof(float));
            st_tensor_to_f32(g, a, g->numel, err);
            st_tensor_to_f32(e, b, e->numel, err);
            double rel = rel_l2_error(a, b, (size_t)g->numel);
            CHECK(t, rel <= 1e-4, "%s (micro-batches %d): rel err %.3g", e->name, mb, rel);
            free(a);
            free(b);
            compared++;
        }
        CHECK(t, compared == d.n_tensors - 1, "dump has %d tensors, compared %d grads", d.n_tensors,
              compared);
        st_close(&d);
    }
    st_close(&ex);
}

// The "loss" fields of a JSON-lines log, as written (exact decimal strings).
static int read_log_losses(const char* path, char losses[][32], int cap) {
    char err[ERR_LEN];
    char* text = file_read_all(path, 1 << 20, NULL, err);
    if (!text) return 0;
    int n = 0;
    for (char* p = strstr(text, "\"loss\":"); p && n < cap; p = strstr(p + 1, "\"loss\":")) {
        p += 7;
        size_t len = strcspn(p, ",}");
        if (len >= 32) len = 31;
        memcpy(losses[n], p, len);
        losses[n][len] = '\0';
        n++;
    }
    free(text);
    return n;
}

// --device cpu:N --sync 1 trains bit-identically to plain training with the same micro-batches.
static void test_train_engine_cli(TestCtx* t) {
    char log_a[1024], log_b[1024], args[4096];
    test_path(t, log_a, sizeof log_a, "plain.jsonl");
    test_path(t, log_b, sizeof log_b, "engine.jsonl");
    const char* common = "--steps 6 --batch 8 --seq 32 --micro-batches 4 --warmup 2 --val '' "
                         "--sample-tokens 0 --threads 1";
    snprintf(args, sizeof args, "%s --log '%s'", common, log_a);
    CHECK(t, test_run_cli(t, "plainrun", args) == 0, "plain run failed");
    snprintf(args, sizeof args,
             "%s --device cpu:3 --sync 1 --recompute layer --device-mem 14M --delay-us 20 "
             "--log '%s'",
             common, log_b);
    int rc = test_run_cli(t, "enginerun", args);
    char* out = test_read_output(t, "enginerun", "out");
    CHECK(t, rc == 0 && strstr(out, "bubble") && strstr(out, "plan for tiny"),
          "engine run exit %d: %s", rc, out);
    free(out);
    char la[16][32], lb[16][32];
    int na = read_log_losses(log_a, la, 16), nb = read_log_losses(log_b, lb, 16);
    CHECK(t, na == 6 && nb == 6, "%d and %d logged steps", na, nb);
    for (int i = 0; i < na && i < nb; i++)
        CHECK(t, strcmp(la[i], lb[i]) == 0, "step %d: plain loss %s, engine loss %s", i + 1, la[i],
              lb[i]);
    // --trace: valid JSON with every device's streams and the optimizer
    char trace[1024], errb[ERR_LEN];
    test_path(t, trace, sizeof trace, "trace.json");
    snprintf(args, sizeof args, "%s --device cpu:4 --device-mem 14M --trace '%s'", common, trace);
    rc = test_run_cli(t, "tracerun", args);
    CHECK(t, rc == 0, "trace run exit %d", rc);
    char* tj = file_read_all(trace, 64u << 20, NULL, errb);
    CHECK(t, tj != NULL, "%s", errb);
    if (tj) {
        JsonDoc doc;
        CHECK(t, json_parse(tj, strlen(tj), &doc, errb) == 0, "trace is not JSON: %s", errb);
        const char* needles[] = {"\"cpu:0\"", "\"cpu:3\"", "\"host\"", "\"F1 mb0\"", "\"FB mb3",
                                 "\"AdamW step 6\"", "\"params", "\"up ", "\"down ", "\"grads ",
                                 "\"act_up\"", NULL};
        for (int i = 0; needles[i]; i++)
            CHECK(t, strstr(tj, needles[i]) != NULL, "trace lacks %s", needles[i]);
        json_free(&doc);
        free(tj);
    }
    // --plan prints the partition and exits
    rc = test_run_cli(t, "plan", "--device cpu:4 --micro-batches 4 --device-mem 14M --plan");
    out = test_read_output(t, "plan", "out");
    CHECK(t, rc == 0 && strstr(out, "FB") && strstr(out, "bubble") && !strstr(out, "step     1"),
          "--plan exit %d: %s", rc, out);
    free(out);
    // --plan needs only the model's shape: Qwen3-32B (512 GB of host state) plans in a moment
    // on any machine, for GPUs that need not be here
#ifdef HAVE_CUDA
    const char* big_plan = "--model qwen3-32b --device cuda:2 --batch 8 --seq 2048 "
                           "--micro-batches 4 --device-mem 100G --plan";
#else
    const char* big_plan = "--model qwen3-32b --device cpu:2 --batch 8 --seq 2048 "
                           "--micro-batches 4 --device-mem 100G --plan";
#endif
    rc = test_run_cli(t, "bigplan", big_plan);
    out = test_read_output(t, "bigplan", "out");
    CHECK(t, rc == 0 && strstr(out, "plan for qwen3-32b") && strstr(out, "N 2 devices") &&
                 strstr(out, "host memory for this plan:") && strstr(out, "device memory per device:"),
          "qwen3-32b --plan exit %d: %s", rc, out);
    // ... and warns when this machine reports less host memory than the plan needs (a warning:
    // virtual machines whose memory grows on demand report less than they hold)
    struct sysinfo si;
    if (sysinfo(&si) == 0 && ((double)si.totalram + (double)si.totalswap) * si.mem_unit < 400e9)
        CHECK(t, strstr(out, "warning: more than this machine reports") != NULL,
              "qwen3-32b --plan on a small host: %s", out);
    free(out);
    // split rounds are the default on 2+ GPUs when the plan is one stage and the micro-batches
    // divide evenly; never on emulated devices (there they would change the sums' order)
#ifdef HAVE_CUDA
    rc = test_run_cli(t, "autosplit", "--device cuda:2 --batch 8 --micro-batches 4 --plan");
    out = test_read_output(t, "autosplit", "out");
    CHECK(t, rc == 0 && strstr(out, "note: --split-rounds auto: each iteration runs as 2 rounds") &&
                 strstr(out, "2 x 2 micro-batches") && strstr(out, "split: the rounds at once"),
          "auto split: exit %d: %s", rc, out);
    free(out);
    const char* nosplit[] = {"--device cuda:2 --batch 8 --micro-batches 3 --plan",
                             "--device cuda:2 --batch 8 --micro-batches 4 --round 2 --plan",
                             "--device cuda:2 --batch 8 --micro-batches 4 --no-split-rounds --plan",
                             "--device cuda:1 --batch 8 --micro-batches 4 --plan", NULL};
    for (int i = 0; nosplit[i]; i++) {
        rc = test_run_cli(t, "nosplit", nosplit[i]);
        out = test_read_output(t, "nosplit", "out");
        CHECK(t, rc == 0 && !strstr(out, "split-rounds auto") && !strstr(out, "split:"),
              "%s: exit %d: %s", nosplit[i], rc, out);
        free(out);
    }
#else
    test_skip_part(t, "--plan for cuda devices, built without CUDA");
#endif
    rc = test_run_cli(t, "cpusplit", "--device cpu:2 --batch 8 --micro-batches 4 --plan");
    out = test_read_output(t, "cpusplit", "out");
    CHECK(t, rc == 0 && !strstr(out, "split:") && strstr(out, "1 x 4 micro-batches"),
          "emulated devices do not split by default: exit %d: %s", rc, out);
    free(out);
    rc = test_run_cli(t, "cpusplit", "--device cpu:2 --batch 8 --micro-batches 4 --split-rounds --plan");
    out = test_read_output(t, "cpusplit", "out");
    CHECK(t, rc == 0 && strstr(out, "2 x 2 micro-batches") && strstr(out, "split:"),
          "--split-rounds on emulated devices: exit %d: %s", rc, out);
    free(out);
    // --mlp-chunk auto chunks long micro-batches; 0 keeps the MLP whole
    rc = test_run_cli(t, "autochunk", "--device cpu:1 --batch 2 --seq 40000 --micro-batches 1 --plan");
    out = test_read_output(t, "autochunk", "out");
    CHECK(t, rc == 0 && strstr(out, "note: --mlp-chunk auto: the MLP runs in chunks of 16384 rows"),
          "auto chunk: exit %d: %s", rc, out);
    free(out);
    // up to 64K tokens per micro-batch: chunks where they make the plan cheaper (here the
    // unchunked plan needs 5 stages, the chunked 3), none where both fuse everything
    rc = test_run_cli(t, "cheaperchunk",
                      "--device cpu:1 --batch 1 --seq 32768 --micro-batches 1 --device-mem 800M --plan");
    out = test_read_output(t, "cheaperchunk", "out");
    CHECK(t, rc == 0 && strstr(out, "chunks of 16384 rows (a cheaper plan"),
          "cheaper chunked plan: exit %d: %s", rc, out);
    free(out);
    rc = test_run_cli(t, "samechunk",
                      "--device cpu:1 --batch 1 --seq 32768 --micro-batches 1 --device-mem 4G --plan");
    out = test_read_output(t, "samechunk", "out");
    CHECK(t, rc == 0 && !strstr(out, "--mlp-chunk auto") && strstr(out, "S 1;"),
          "everything fuses either way: exit %d: %s", rc, out);
    free(out);
    rc = test_run_cli(t, "nochunk",
                      "--device cpu:1 --batch 2 --seq 40000 --micro-batches 1 --mlp-chunk 0 --plan");
    out = test_read_output(t, "nochunk", "out");
    CHECK(t, rc == 0 && !strstr(out, "--mlp-chunk auto"), "no chunk: exit %d: %s", rc, out);
    free(out);
    // a layer that cannot fit the device budget is a clear error
    rc = test_run_cli(t, "noplan", "--device cpu:2 --device-mem 64K --steps 1");
    char* err = test_read_output(t, "noplan", "err");
    CHECK(t, rc == 1 && strstr(err, "budget"), "tiny budget: exit %d: %s", rc, err);
    free(err);
}

// ----------------------------------------------------------------------------
// the step interface

// The engine's options from the flags (what the CLI's engine_options gives on emulated devices).
static EngineOptions trainer_test_engine_options(const TrainArgs* a, int use_cuda, int n_devices,
                                                 int64_t start_step) {
    (void)use_cuda;
    (void)n_devices;
    return (EngineOptions){.B = a->batch, .T = a->seq, .M = a->micro_batches,
                           .sync = a->sync, .opt_threads = 1, .trace_path = "",
                           .start_step = start_step,
                           .hyper = {a->lr, a->beta1, a->beta2, a->eps, a->weight_decay},
                           .sched = {a->schedule, a->lr, a->warmup, a->steps, a->min_lr_frac,
                                     a->decay_frac},
                           .grad_clip = a->grad_clip};
}

enum { TRAINER_TEST_STEPS = 6 };

typedef struct TrainerRun {
    double loss[TRAINER_TEST_STEPS], norm[TRAINER_TEST_STEPS], lr[TRAINER_TEST_STEPS];
    int no_update[TRAINER_TEST_STEPS];
    float* params;  // every parameter slab after the last step, concatenated (malloc'd)
} TrainerRun;

// Train the test-qwen3 preset for TRAINER_TEST_STEPS steps on shard through the trainer:
// n_devices 0 plain, else the engine (sync or delayed); stop_every: the run stops after every
// step (as around checkpoints) instead of keeping the next iteration in flight.
static int trainer_run(TestCtx* t, const char* shard, int n_devices, int sync, int stop_every,
                       TrainerRun* out) {
    char err[ERR_LEN];
    TrainArgs a;
    args_defaults(&a);
    a.model = "test-qwen3";
    a.train = shard;
    a.val = "";
    a.batch = 4;
    a.seq = 16;
    a.micro_batches = 2;
    a.steps = TRAINER_TEST_STEPS;
    a.warmup = 2;
    a.sync = sync;
    a.threads = 1;
    a.sample_tokens = 0;
    a.n_devices = n_devices;
    ModelConfig cfg;
    Model m;
    if (config_from_preset(&cfg, a.model, err) != 0 || model_init(&m, &cfg, 0, err) != 0) {
        CHECK(t, 0, "%s", err);
        return -1;
    }
    Store s;
    store_create(&s, &m.tt);
    store_init_random(&s, 7, 0.02f);
    TrainState ts;
    train_state_init(&ts, a.seed);
    DataLoader train;
    if (dataloader_open(&train, shard, a.batch, a.seq, 0, a.seed, cfg.V, err) != 0) {
        CHECK(t, 0, "%s", err);
        return -1;
    }
    // the trainer prints its plan and device line: not into the test report
    const int saved_stdout = test_stdout_mute();
    Trainer tr;
    int rc = trainer_create(&tr, &a, &m, &s, &ts, n_devices, trainer_test_engine_options, err);
    for (int step = 1; rc == 0 && step <= a.steps; step++) {
        StepStats st = trainer_step(&tr, &train, step, stop_every || step == a.steps);
        out->loss[step - 1] = st.loss;
        out->norm[step - 1] = st.norm;
        out->lr[step - 1] = st.lr;
        out->no_update[step - 1] = st.no_update;
        CHECK(t, st.ms >= 0 && st.tok_s > 0 && st.mfu < 0 && (st.bubble >= 0) == (n_devices > 0),
              "step %d statistics: ms %g, tok/s %g, MFU %g, bubble %g", step, st.ms, st.tok_s,
              st.mfu, st.bubble);
    }
    if (rc == 0) rc = trainer_finish(&tr, err);
    test_stdout_restore(saved_stdout);
    CHECK(t, rc == 0, "trainer: %s", err);
    int64_t total = 0;
    for (int l = 0; l < m.tt.n_layers; l++) total += m.tt.param_numel[l];
    out->params = malloc_check((size_t)total * sizeof(float));
    int64_t o = 0;
    for (int l = 0; l < m.tt.n_layers; l++) {
        memcpy(out->params + o, s.param[l], (size_t)m.tt.param_numel[l] * sizeof(float));
        o += m.tt.param_numel[l];
    }
    if (rc == 0) trainer_free(&tr);
    dataloader_close(&train);
    train_state_free(&ts);
    store_free(&s);
    model_free(&m);
    return rc == 0 ? (int)total : -1;
}

static void check_same_runs(TestCtx* t, const TrainerRun* x, const TrainerRun* y, int n_params,
                            const char* what) {
    for (int i = 0; i < TRAINER_TEST_STEPS; i++)
        CHECK(t, x->loss[i] == y->loss[i] && x->norm[i] == y->norm[i] && x->lr[i] == y->lr[i],
              "%s, step %d: loss %.9g vs %.9g, norm %.9g vs %.9g, lr %g vs %g", what, i + 1,
              x->loss[i], y->loss[i], x->norm[i], y->norm[i], x->lr[i], y->lr[i]);
    CHECK(t, memcmp(x->params, y->params, (size_t)n_params * sizeof(float)) == 0,
          "%s: the final weights differ", what);
}

static void test_train_trainer_steps(TestCtx* t) {
    char shard[1024], err[ERR_LEN];
    enum { NTOK = 3000 };
    uint32_t toks[NTOK];
    for (int i = 0; i < NTOK; i++) toks[i] = (uint32_t)((i * 7 + i / 13) % 61);
    test_path(t, shard, sizeof shard, "trainer.bin");
    CHECK(t, shard_write(shard, toks, NTOK, 2, err) == 0, "%s", err);
    TrainerRun in_flight = {0}, stopping = {0}, plain = {0}, sync = {0};
    // the delayed update: the same steps whether iteration t+1 is in flight while t is collected
    int n = trainer_run(t, shard, 2, 0, 0, &in_flight);
    if (n > 0 && trainer_run(t, shard, 2, 0, 1, &stopping) == n)
        check_same_runs(t, &in_flight, &stopping, n, "delayed, in flight vs stopping");
    CHECK(t, in_flight.norm[0] == 0.0 && in_flight.norm[1] > 0.0 && in_flight.no_update[0] &&
                 !in_flight.no_update[1],
          "the delayed update reports no step with the first iteration");
    // sync mode trains as plain training does
    if (n > 0 && trainer_run(t, shard, 0, 0, 0, &plain) == n &&
        trainer_run(t, shard, 3, 1, 0, &sync) == n)
        check_same_runs(t, &plain, &sync, n, "plain vs engine --sync 1");
    for (int i = 0; i < TRAINER_TEST_STEPS; i++)
        CHECK(t, !plain.no_update[i] && !sync.no_update[i], "step %d: every step updates", i + 1);
    CHECK(t, plain.loss[TRAINER_TEST_STEPS - 1] < plain.loss[0], "loss must fall: %.4f -> %.4f",
          plain.loss[0], plain.loss[TRAINER_TEST_STEPS - 1]);
    free(in_flight.params);
    free(stopping.params);
    free(plain.params);
    free(sync.params);
}

const TestCase tests_train[] = {
    {"train_help", test_train_help},
    {"train_bad_flags", test_train_bad_flags},
    {"train_bad_inputs", test_train_bad_inputs},
    {"train_short_run", test_train_short_run},
    {"train_dump_state_parity", test_train_dump_state_parity},
    {"train_pipelined_cli", test_train_engine_cli},
    {"train_trainer_steps", test_train_trainer_steps},
    {NULL, NULL},
};
