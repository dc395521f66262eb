/*
 * test_resume.c — suite `resume`: training-state checkpoints through the CLI.
 *
 *  - bit-exact resume: N steps straight versus k steps + save + resume + N-k steps give the same
 *    log records (loss, lr, norm compared as the logged strings) and byte-identical weights,
 *    AdamW state, data-loader and RNG state in the final checkpoint and the final --out model;
 *    a checkpoint without DONE (a crash before completion) is ignored; shuffled data, several
 *    micro-batches, a tied (tiny) and an untied GGUF-loaded model;
 *  - layout and retention: the files of step_<N>/, --keep K, the step directory loads as --model,
 *    args.json holds the flags, no temporary directory is left;
 *  - checkpoint_find_latest picks the numerically newest complete directory;
 *  - refusals: --resume / --save-every without --out (exit 2), a changed batch size or model, a
 *    corrupted state file (exit 1, one line naming the file); a changed --lr only warns.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../checkpoint.h"
#include "../common.h"
#include "../dataloader.h"
#include "../json.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

static int same_bytes(const char* a, const char* b) {
    size_t na, nb;
    char* x = test_read_file(a, &na);
    char* y = test_read_file(b, &nb);
    int same = na > 0 && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

// ----------------------------------------------------------------------------
// bit-exact resume

// Straight N steps vs k steps, then resume for the rest. `model_args` picks model and data.
static void resume_case(TestCtx* t, const char* name, const char* model_args, int N, int k) {
    char args[8192];
    snprintf(args, sizeof args, "%s --val '' --sample-tokens 0 --threads 2", model_args);
    // the interrupted run saves every k steps and at N; every save after step k then loses its
    // DONE, as if the run had crashed before completing them
    TestResumeRuns r;
    test_resume_runs(t, &r, name, args, N, k, N);
    char* out = test_read_output(t, r.resumed_tag, "out");
    char want[1200];
    snprintf(want, sizeof want, "resumed from %s/step_%d (step %d)", r.resumed_out, k, k);
    CHECK(t, strstr(out, want) != NULL, "%s: '%s' in %s", name, want, out);
    free(out);

    char* lb2 = test_read_file(r.resumed_log, NULL);
    char rec[512];
    CHECK(t, !test_log_record(lb2, k, rec, sizeof rec),
          "%s: the resumed log starts after step %d", name, k);
    free(lb2);

    const char* files[] = {"model.safetensors", "train_state.safetensors", "config.json"};
    for (int i = 0; i < 3; i++) {
        char pa[1200], pb[1200];
        snprintf(pa, sizeof pa, "%s/step_%d/%s", r.straight_out, N, files[i]);
        snprintf(pb, sizeof pb, "%s/step_%d/%s", r.resumed_out, N, files[i]);
        CHECK(t, same_bytes(pa, pb), "%s: %s identical", name, files[i]);
    }
    char pa[1200], pb[1200];
    snprintf(pa, sizeof pa, "%s/model.safetensors", r.straight_out);
    snprintf(pb, sizeof pb, "%s/model.safetensors", r.resumed_out);
    CHECK(t, same_bytes(pa, pb), "%s: final --out model identical", name);
}

static void test_resume_bit_exact(TestCtx* t) {
    // the tiny preset (tied head) on the shipped corpus, shuffled, two micro-batches
    resume_case(t, "tiny", "--batch 4 --seq 32 --micro-batches 2 --warmup 2", 6, 3);
    // the RoundPipe engine over two emulated devices, synchronous optimizer
    resume_case(t, "engine", "--batch 4 --seq 32 --micro-batches 2 --warmup 2 --device cpu:2 --sync 1",
                6, 3);
    // ... and with the one-step-delayed update (the checkpoint keeps the pending weights)
    resume_case(t, "engine_async", "--batch 4 --seq 32 --micro-batches 2 --warmup 2 --device cpu:3",
                6, 3);
    // ... and with split rounds (the default on 2+ GPUs): the per-round gradient sets are summed
    // before every step, so a checkpoint holds nothing of them
    resume_case(t, "engine_split", "--batch 4 --seq 32 --micro-batches 4 --warmup 2 --device cpu:2 "
                "--split-rounds", 6, 3);
    // a mixture-of-experts model (MoE blocks around a dense one, the aux loss on) through the
    // engine in several stages, synchronous and delayed; the synchronous run logs what plain
    // training logs (loss, CE, aux, load spread, norm)
    const char* moe = "--model test-qwen3moe --batch 4 --seq 16 --micro-batches 2 --warmup 2";
    char moe_args[2048], moe_log[1024], plain_log[1024];
    snprintf(moe_args, sizeof moe_args, "%s --device cpu:2 --device-mem 1.2M --sync 1", moe);
    resume_case(t, "moe_engine", moe_args, 6, 3);
    snprintf(moe_args, sizeof moe_args, "%s --device cpu:3 --device-mem 1.2M", moe);
    resume_case(t, "moe_engine_async", moe_args, 6, 3);
    snprintf(moe_log, sizeof moe_log, "%s/moe_engine_a.jsonl", t->tmpdir);
    snprintf(plain_log, sizeof plain_log, "%s/moe_plain.jsonl", t->tmpdir);
    snprintf(moe_args, sizeof moe_args, "%s --val '' --sample-tokens 0 --threads 2 --steps 6 "
             "--log '%s'", moe, plain_log);
    CHECK(t, test_run_cli(t, "moe_plain", moe_args) == 0, "moe: plain run");
    char* lp = test_read_file(plain_log, NULL);
    CHECK(t, strstr(lp, "\"aux\":") != NULL, "moe: the plain log has no aux");
    free(lp);
    test_same_steps(t, "moe engine vs plain", moe_log, plain_log, 1, 6);
    // an untied LLaMA from a quantized GGUF, cosine schedule ending inside the resumed part
    char shard[1024], err[ERR_LEN], args[2048];
    uint32_t toks[3000];
    for (int i = 0; i < 3000; i++) toks[i] = (uint32_t)((i * 13 + i / 7) % 64);
    test_path(t, shard, sizeof shard, "r_shard.bin");
    CHECK(t, shard_write(shard, toks, 3000, 2, err) == 0, "%s", err);
    snprintf(args, sizeof args,
             "--model dev/gguf/fixtures/llama_q4_0.gguf --train '%s' --batch 4 --seq 16 "
             "--warmup 1 --lr 1e-2 --schedule wsd --decay-frac 0.5",
             shard);
    resume_case(t, "llama", args, 5, 2);
}

// ----------------------------------------------------------------------------
// layout and retention

static void test_resume_layout_and_keep(TestCtx* t) {
    char out[1024], args[4096], path[1300];
    test_path(t, out, sizeof out, "keep");
    snprintf(args, sizeof args,
             "--batch 4 --seq 16 --val '' --sample-tokens 0 --threads 2 --steps 5 --save-every 1 "
             "--keep 2 --lr 2e-3 --out '%s'",
             out);
    CHECK(t, test_run_cli(t, "keep", args) == 0, "keep run");
    for (int s = 1; s <= 5; s++) {
        snprintf(path, sizeof path, "%s/step_%d", out, s);
        CHECK(t, dir_exists(path) == (s >= 4), "step_%d %s", s, s >= 4 ? "kept" : "removed");
        snprintf(path, sizeof path, "%s/step_%d.tmp", out, s);
        CHECK(t, !dir_exists(path), "no step_%d.tmp left", s);
    }
    const char* files[] = {"DONE", "model.safetensors", "config.json", "train_state.safetensors",
                           "args.json"};
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/step_5/%s", out, files[i]);
        CHECK(t, file_exists(path), "%s", path);
    }
    snprintf(path, sizeof path, "%s/step_5/DONE", out);
    char* done = test_read_file(path, NULL);
    CHECK(t, strncmp(done, "step 5\n", 7) == 0 && strstr(done, "\nmodel.safetensors ") &&
                 strstr(done, "\ntrain_state.safetensors ") && strstr(done, "\nargs.json "),
          "DONE: '%s'", done);
    free(done);
    snprintf(path, sizeof path, "%s/step_5/args.json", out);
    char* text = test_read_file(path, NULL);
    JsonDoc doc;
    char err[ERR_LEN];
    double lr = 0;
    int64_t keep = 0;
    int ok = json_parse(text, strlen(text), &doc, err) == 0;
    CHECK(t,
          ok && json_get_double(&doc.root, "lr", &lr) == 1 && fabs(lr - 2e-3) < 1e-9 &&
              json_get_int(&doc.root, "keep", &keep) == 1 && keep == 2,
          "args.json: %s", err);
    if (ok) json_free(&doc);
    free(text);
    // a step directory is an HF model directory
    snprintf(args, sizeof args, "--model '%s/step_5' --steps 0 --sample-tokens 0 --eval-batches 1",
             out);
    int rc = test_run_cli(t, "load_step", args);
    char* o = test_read_output(t, "load_step", "out");
    CHECK(t, rc == 0 && strstr(o, "loaded weights"), "step dir as --model: exit %d %s", rc, o);
    free(o);
    // the state file holds what it should
    StFile f;
    snprintf(path, sizeof path, "%s/step_5/train_state.safetensors", out);
    CHECK(t, st_open(&f, path, err) == 0, "%s", err);
    if (f.tensors) {
        const StTensor* step = st_find(&f, "step");
        int64_t v = 0;
        if (step) memcpy(&v, step->data, 8);
        CHECK(t, step && step->dtype == ST_I64 && v == 5, "step tensor");
        CHECK(t,
              st_find(&f, "m.model.embed_tokens.weight") && st_find(&f, "v.model.norm.weight") &&
                  st_find(&f, "dataloader") && st_find(&f, "rng.mt") &&
                  !st_find(&f, "m.lm_head.weight"),
              "m, v (tied head stored once), loader and RNG state");
        st_close(&f);
    }
}

static void test_resume_find_latest(TestCtx* t) {
    char dir[1024], path[1300], found[1300], err[ERR_LEN];
    test_path(t, dir, sizeof dir, "latest");
    // step_011: leading zeros are not ours (the name built from 11 would not exist)
    const char* dirs[] = {"step_2", "step_10", "step_11", "step_12.tmp",
                          "stepx",  "step_",   "step_9",  "step_011"};
    const int complete[] = {1, 1, 0, 1, 1, 1, 1, 1};
    for (int i = 0; i < 8; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, dirs[i]);
        CHECK(t, mkdir_p(path, err) == 0, "%s", err);
        if (complete[i]) {
            snprintf(path, sizeof path, "%s/%s/DONE", dir, dirs[i]);
            CHECK(t, file_write_atomic(path, "x", 1, err) == 0, "%s", err);
        }
    }
    int64_t step = -1;
    int rc = checkpoint_find_latest(dir, found, sizeof found, &step, err);
    snprintf(path, sizeof path, "%s/step_10", dir);
    CHECK(t, rc == 1 && step == 10 && strcmp(found, path) == 0,
          "newest complete is step_10 (numeric order; no DONE, .tmp, zero-padded ignored): rc %d "
          "step %lld %s",
          rc, (long long)step, found);
    test_path(t, path, sizeof path, "no_such_dir");
    CHECK(t, checkpoint_find_latest(path, found, sizeof found, &step, err) == 0,
          "missing dir: none");
}

// ----------------------------------------------------------------------------
// refusals

static void test_resume_refusals(TestCtx* t) {
    char out[1024], args[4096], path[1300];
    const char* common = "--batch 4 --seq 16 --val '' --sample-tokens 0 --threads 2 --lr 2e-3";
    // flag errors: exit 2 with one error line and the hint to --help
    const char* bad_flags[] = {
        "--resume",          "--save-every 2",    "--resume --device cpu:2",
        "--keep -1 --out x", "--export-dtype f8", NULL};
    for (int i = 0; bad_flags[i]; i++) {
        int rc = test_run_cli(t, "badflag", bad_flags[i]);
        char* e = test_read_output(t, "badflag", "err");
        CHECK(t, rc == 2 && strstr(e, "see --help") && strstr(e, "train_roundpipe: error:"),
              "'%s' exit %d", bad_flags[i], rc);
        free(e);
    }
    // --resume into an empty directory starts from step 0
    test_path(t, out, sizeof out, "refuse");
    snprintf(args, sizeof args, "%s --steps 2 --save-every 2 --out '%s' --resume", common, out);
    int rc = test_run_cli(t, "fresh", args);
    char* o = test_read_output(t, "fresh", "out");
    CHECK(t, rc == 0 && strstr(o, "no complete checkpoint") && strstr(o, "step     2/2"),
          "fresh start: exit %d %s", rc, o);
    free(o);
    // a stale temporary directory of a later step is ignored and replaced
    snprintf(path, sizeof path, "%s/step_4.tmp", out);
    char err[ERR_LEN];
    CHECK(t, mkdir_p(path, err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/step_4.tmp/junk", out);
    CHECK(t, file_write_atomic(path, "x", 1, err) == 0, "%s", err);
    // a changed --lr resumes with a warning
    snprintf(args, sizeof args,
             "--batch 4 --seq 16 --val '' --sample-tokens 0 --threads 2 --lr 1e-3 --steps 4 "
             "--save-every 2 --out '%s' --resume",
             out);
    rc = test_run_cli(t, "lr_changed", args);
    o = test_read_output(t, "lr_changed", "out");
    CHECK(t, rc == 0 && strstr(o, "resumed from") && strstr(o, "warning: resuming with --lr 0.001"),
          "changed lr: exit %d %s", rc, o);
    free(o);
    snprintf(path, sizeof path, "%s/step_4.tmp", out);
    CHECK(t, !dir_exists(path), "stale step_4.tmp replaced");
    // a different batch size: the loader state does not fit
    snprintf(args, sizeof args,
             "--batch 8 --seq 16 --val '' --sample-tokens 0 --threads 2 --lr 2e-3 --steps 6 "
             "--out '%s' --resume",
             out);
    rc = test_run_cli(t, "batch_changed", args);
    char* e = test_read_output(t, "batch_changed", "err");
    CHECK(t, rc == 1 && test_one_error_line(e, "batch size"), "changed batch: exit %d %s", rc, e);
    free(e);
    // a different model
    snprintf(args, sizeof args, "%s --model test-qwen3 --steps 6 --out '%s' --resume", common, out);
    rc = test_run_cli(t, "model_changed", args);
    e = test_read_output(t, "model_changed", "err");
    CHECK(t, rc == 1 && test_one_error_line(e, "vocab_size is 256, this run's model has 96"),
          "changed model: exit %d %s", rc, e);
    free(e);
    // a corrupted (truncated) state file of a checkpoint whose DONE records no checksums (an
    // older version's): the loader refuses it (checksummed ones fall back: suite checksum)
    snprintf(path, sizeof path, "%s/step_4/DONE", out);
    CHECK(t, file_write_atomic(path, "step 4\n", 7, err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/step_4/train_state.safetensors", out);
    size_t n;
    char* bytes = test_read_file(path, &n);
    CHECK(t, file_write_atomic(path, bytes, n / 3, err) == 0, "%s", err);
    free(bytes);
    snprintf(args, sizeof args, "%s --steps 6 --out '%s' --resume", common, out);
    rc = test_run_cli(t, "corrupt", args);
    e = test_read_output(t, "corrupt", "err");
    CHECK(t, rc == 1 && test_one_error_line(e, path), "corrupt state: exit %d %s", rc, e);
    free(e);

    // the delayed engine's pending weights: a truncated file is refused
    test_path(t, out, sizeof out, "refuse_pending");
    snprintf(args, sizeof args, "%s --device cpu:2 --micro-batches 2 --steps 2 --save-every 2 "
             "--out '%s'", common, out);
    rc = test_run_cli(t, "pending_save", args);
    CHECK(t, rc == 0, "delayed engine run: exit %d", rc);
    snprintf(path, sizeof path, "%s/step_2/DONE", out);
    CHECK(t, file_write_atomic(path, "step 2\n", 7, err) == 0, "%s", err);
    snprintf(path, sizeof path, "%s/step_2/pending_weights.safetensors", out);
    bytes = test_read_file(path, &n);
    CHECK(t, bytes != NULL && n > 0, "%s written", path);
    if (bytes) {
        CHECK(t, file_write_atomic(path, bytes, n - 5, err) == 0, "%s", err);
        free(bytes);
    }
    snprintf(args, sizeof args, "%s --device cpu:2 --micro-batches 2 --steps 3 --out '%s' --resume",
             common, out);
    rc = test_run_cli(t, "pending_corrupt", args);
    e = test_read_output(t, "pending_corrupt", "err");
    CHECK(t, rc == 1 && test_one_error_line(e, "pending_weights.safetensors"),
          "corrupt pending weights: exit %d %s", rc, e);
    free(e);
}

const TestCase tests_resume[] = {
    {"resume_bit_exact", test_resume_bit_exact},
    {"resume_layout_and_keep", test_resume_layout_and_keep},
    {"resume_find_latest", test_resume_find_latest},
    {"resume_refusals", test_resume_refusals},
    {NULL, NULL},
};
