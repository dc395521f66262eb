/*
 * test_checksum.c — suite `checksum`: CRC-32C and the checksummed checkpoints.
 *
 *  - CRC-32C: known answers ("123456789", the iSCSI test vectors of RFC 3720 B.4), the SSE4.2
 *    path against the tables at every alignment and split, atomic writes checksum what they wrote;
 *  - DONE records every file of a checkpoint (name, size, CRC-32C) and checkpoint_verify accepts
 *    it, then names the file once one byte of it changes, it is cut short or it is gone;
 *  - --resume through the CLI: a flipped byte in model.safetensors, a truncated train state, a
 *    corrupt delayed-engine pending-weights file and a damaged DONE each fall back to the
 *    previous checkpoint with a line naming the file, and the run continues from there
 *    bit-exactly (the same log record and byte-identical checkpoint and model as the
 *    uninterrupted run); with none intact it starts from step 0; an intact one resumes as
 *    before; an older DONE without checksums resumes with a note.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../checkpoint.h"
#include "../common.h"
#include "../crc32c.h"
#include "../rng.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// CRC-32C

static void test_checksum_crc32c(TestCtx* t) {
    const char* nine = "123456789";
    CHECK(t, crc32c(nine, 9) == 0xE3069283u, "crc32c(123456789) = %08x", crc32c(nine, 9));
    CHECK(t, crc32c_update_portable(0, nine, 9) == 0xE3069283u, "tables: %08x",
          crc32c_update_portable(0, nine, 9));
    CHECK(t, crc32c(nine, 0) == 0 && crc32c_update(0x12345678u, nine, 0) == 0x12345678u,
          "no bytes: unchanged");
    // RFC 3720 B.4: 32 bytes of zeros, of ones, ascending, descending
    uint8_t v[4][32];
    for (int i = 0; i < 32; i++) {
        v[0][i] = 0;
        v[1][i] = 0xff;
        v[2][i] = (uint8_t)i;
        v[3][i] = (uint8_t)(31 - i);
    }
    const uint32_t want[4] = {0x8A9136AAu, 0x62A8AB43u, 0x46DD794Eu, 0x113FDB5Cu};
    for (int k = 0; k < 4; k++) {
        CHECK(t, crc32c(v[k], 32) == want[k], "RFC 3720 vector %d: %08x", k, crc32c(v[k], 32));
        CHECK(t, crc32c_update_portable(0, v[k], 32) == want[k], "tables, vector %d", k);
    }
    // both paths agree at every alignment and length, and a CRC continues across any split
    const size_t n = 4099;
    uint8_t* buf = malloc_check(n + 8);
    Rng rng;
    rng_seed(&rng, 7);
    for (size_t i = 0; i < n + 8; i++) buf[i] = (uint8_t)rng_u32(&rng);
    int bad = 0;
    for (size_t off = 0; off < 8; off++)
        for (size_t len = 0; len <= n; len += 1 + len / 3) {
            const uint32_t whole = crc32c_update_portable(0, buf + off, len);
            bad += crc32c(buf + off, len) != whole;
            const size_t cut = len * 5 / 11;
            bad += crc32c_update(crc32c(buf + off, cut), buf + off + cut, len - cut) != whole;
            bad += crc32c_update_portable(crc32c_update_portable(0, buf + off, cut),
                                          buf + off + cut, len - cut) != whole;
        }
    CHECK(t, bad == 0, "%d mismatches between the paths or across splits", bad);
    if (!crc32c_hardware()) test_skip_part(t, "SSE4.2 CRC-32C (this CPU has none)");
    // an atomic write checksums exactly what it wrote
    char path[1024], err[ERR_LEN];
    test_path(t, path, sizeof path, "crc_atomic.bin");
    AtomicFile af;
    CHECK(t, atomic_file_open(&af, path, err) == 0, "%s", err);
    CHECK(t, atomic_file_write(&af, buf, 1000, err) == 0, "%s", err);
    CHECK(t, atomic_file_write(&af, buf + 1000, n - 1000, err) == 0, "%s", err);
    CHECK(t, af.bytes == n && af.crc32c == crc32c(buf, n), "AtomicFile: %llu bytes, %08x",
          (unsigned long long)af.bytes, af.crc32c);
    CHECK(t, atomic_file_commit(&af, err) == 0, "%s", err);
    free(buf);
}

// ----------------------------------------------------------------------------
// helpers

static int run_ok(TestCtx* t, const char* tag, const char* args) {
    const int rc = test_run_cli(t, tag, args);
    if (rc != 0) {
        char* e = test_read_output(t, tag, "err");
        CHECK(t, rc == 0, "%s: exit %d: %s", tag, rc, e);
        free(e);
    }
    return rc == 0;
}

static int same_file(const char* a, const char* b) {
    size_t na, nb;
    char* x = test_read_file(a, &na);
    char* y = test_read_file(b, &nb);
    const int same = na > 0 && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

static void copy_file(TestCtx* t, const char* from, const char* to) {
    size_t n;
    char err[ERR_LEN];
    char* bytes = test_read_file(from, &n);
    CHECK(t, n > 0 && file_write_atomic(to, bytes, n, err) == 0, "copy %s", from);
    free(bytes);
}

// ----------------------------------------------------------------------------
// DONE and checkpoint_verify

static void test_checksum_done_marker(TestCtx* t) {
    char out[1024], args[4096], step[1200], path[1300], err[ERR_LEN];
    test_path(t, out, sizeof out, "sum_marker");
    // the delayed engine: its checkpoints hold pending_weights.safetensors too
    snprintf(args, sizeof args, "--batch 4 --seq 16 --val '' --sample-tokens 0 --threads 2 "
             "--device cpu:2 --micro-batches 2 --steps 2 --save-every 2 --out '%s'", out);
    if (!run_ok(t, "marker", args)) return;
    snprintf(step, sizeof step, "%s/step_2", out);
    snprintf(path, sizeof path, "%s/DONE", step);
    char* done = test_read_file(path, NULL);
    const char* names[] = {"model.safetensors", "config.json", "train_state.safetensors",
                           "args.json", "pending_weights.safetensors"};
    CHECK(t, strncmp(done, "step 2\n", 7) == 0, "DONE starts with the step: '%s'", done);
    for (int i = 0; i < 5; i++) {
        // "NAME SIZE CRC32C" with the file's own size and checksum
        snprintf(path, sizeof path, "%s/%s", step, names[i]);
        size_t n;
        char* bytes = test_read_file(path, &n);
        char line[256];
        snprintf(line, sizeof line, "\n%s %zu %08x\n", names[i], n, crc32c(bytes, n));
        CHECK(t, n > 0 && strstr(done, line) != NULL, "DONE lacks '%s': '%s'", line + 1, done);
        free(bytes);
    }
    free(done);
    int n_files = 0;
    CHECK(t, checkpoint_verify(step, &n_files, err) == 1 && n_files == 5,
          "intact: verify %d files: %s", n_files, err);
    // one byte changed, then put back; cut short; gone: each named
    snprintf(path, sizeof path, "%s/config.json", step);
    size_t n;
    char* bytes = test_read_file(path, &n);
    bytes[n / 2] ^= 0x20;
    CHECK(t, file_write_atomic(path, bytes, n, err) == 0, "%s", err);
    CHECK(t, checkpoint_verify(step, NULL, err) == -1 && strstr(err, path) &&
                 strstr(err, "corrupt (CRC-32C"),
          "flipped byte: %s", err);
    bytes[n / 2] ^= 0x20;
    CHECK(t, file_write_atomic(path, bytes, n - 1, err) == 0, "%s", err);
    CHECK(t, checkpoint_verify(step, NULL, err) == -1 && strstr(err, path) &&
                 strstr(err, "truncated"),
          "truncated: %s", err);
    CHECK(t, unlink(path) == 0, "remove %s", path);
    CHECK(t, checkpoint_verify(step, NULL, err) == -1 && strstr(err, path) &&
                 strstr(err, "missing"),
          "missing: %s", err);
    CHECK(t, file_write_atomic(path, bytes, n, err) == 0, "%s", err);
    free(bytes);
    CHECK(t, checkpoint_verify(step, NULL, err) == 1, "restored: %s", err);
    // a damaged marker, and an older one without checksums
    snprintf(path, sizeof path, "%s/DONE", step);
    char* text = test_read_file(path, &n);
    const char* damaged[] = {"step 2\nmodel.safetensors 12\n", "step 2\n../x 1 00000000\n",
                             "step 2\nconfig.json 1 0000000g\n", "step 2\nconfig.json 1 0 extra\n",
                             NULL};
    for (int i = 0; damaged[i]; i++) {
        CHECK(t, file_write_atomic(path, damaged[i], strlen(damaged[i]), err) == 0, "%s", err);
        CHECK(t, checkpoint_verify(step, NULL, err) == -1 && strstr(err, "DONE") &&
                     strstr(err, "NAME SIZE CRC32C"),
              "damaged DONE '%s': %s", damaged[i], err);
    }
    CHECK(t, file_write_atomic(path, "step 2\n", 7, err) == 0, "%s", err);
    CHECK(t, checkpoint_verify(step, &n_files, err) == 0 && n_files == 0, "older DONE: nothing");
    CHECK(t, file_write_atomic(path, text, n, err) == 0, "%s", err);
    free(text);
}

// ----------------------------------------------------------------------------
// --resume falls back

// Damage to step_<N> of a run saved every step, and what --resume must say about it.
typedef enum { FLIP_BYTE, TRUNCATE, REMOVE, DONE_GARBAGE } Damage;

// A run of N steps saving every step (into `name`), then `file` of step_<N> is damaged:
// --resume falls back to step_<N-1> with a line naming the file, and step N is then the
// uninterrupted run's (log record, checkpoint files, final model).
static void fallback_case(TestCtx* t, const char* name, const char* run_args, int N,
                          const char* file, Damage damage) {
    char out[1024], log1[1024], log2[1024], args[4096], path[1300], keep[1300], err[ERR_LEN];
    snprintf(out, sizeof out, "%s/%s", t->tmpdir, name);
    snprintf(log1, sizeof log1, "%s/%s_1.jsonl", t->tmpdir, name);
    snprintf(log2, sizeof log2, "%s/%s_2.jsonl", t->tmpdir, name);
    const char* common = "--val '' --sample-tokens 0 --threads 2";
    snprintf(args, sizeof args, "%s %s --steps %d --save-every 1 --out '%s' --log '%s'", run_args,
             common, N, out, log1);
    if (!run_ok(t, "fb_first", args)) return;
    // what the uninterrupted run wrote, before the damage
    const char* kept[] = {"model.safetensors", "train_state.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/step_%d/%s", out, N, kept[i]);
        snprintf(keep, sizeof keep, "%s/%s_%s", t->tmpdir, name, kept[i]);
        copy_file(t, path, keep);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    snprintf(keep, sizeof keep, "%s/%s_final.safetensors", t->tmpdir, name);
    copy_file(t, path, keep);

    snprintf(path, sizeof path, "%s/step_%d/%s", out, N, file);
    size_t n;
    char* bytes = test_read_file(path, &n);
    CHECK(t, n > 64, "%s: %s written", name, path);
    if (damage == FLIP_BYTE) {
        bytes[n - n / 3] ^= 0x01;  // inside the tensor data: the file still parses
        CHECK(t, file_write_atomic(path, bytes, n, err) == 0, "%s", err);
    } else if (damage == TRUNCATE) {
        CHECK(t, file_write_atomic(path, bytes, n - 8, err) == 0, "%s", err);
    } else if (damage == REMOVE) {
        CHECK(t, unlink(path) == 0, "remove %s", path);
    } else {
        const char* garbage = "step 4\n\x01\x02 garbage\n";
        CHECK(t, file_write_atomic(path, garbage, strlen(garbage), err) == 0, "%s", err);
    }
    free(bytes);

    snprintf(args, sizeof args, "%s %s --steps %d --save-every 1 --out '%s' --log '%s' --resume",
             run_args, common, N, out, log2);
    if (!run_ok(t, "fb_resume", args)) return;
    char* o = test_read_output(t, "fb_resume", "out");
    char want[1500];
    snprintf(want, sizeof want, "warning: --resume: %s", path);
    CHECK(t, strstr(o, want) != NULL, "%s: '%s' in %s", name, want, o);
    snprintf(want, sizeof want, "; falling back to %s/step_%d\n", out, N - 1);
    CHECK(t, strstr(o, want) != NULL, "%s: '%s' in %s", name, want, o);
    snprintf(want, sizeof want, "resumed from %s/step_%d (step %d)", out, N - 1, N - 1);
    CHECK(t, strstr(o, want) != NULL, "%s: '%s' in %s", name, want, o);
    free(o);
    // step N again, bit-exactly
    char* l1 = test_read_file(log1, NULL);
    char* l2 = test_read_file(log2, NULL);
    char a[512], b[512];
    CHECK(t,
          test_log_record(l1, N, a, sizeof a) && test_log_record(l2, N, b, sizeof b) &&
              strcmp(a, b) == 0,
          "%s: step %d '%s' vs '%s'", name, N, a, b);
    CHECK(t, !test_log_record(l2, N - 1, b, sizeof b), "%s: the resumed run starts at step %d",
          name, N);
    free(l1);
    free(l2);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/step_%d/%s", out, N, kept[i]);
        snprintf(keep, sizeof keep, "%s/%s_%s", t->tmpdir, name, kept[i]);
        CHECK(t, same_file(path, keep), "%s: %s as the uninterrupted run's", name, path);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    snprintf(keep, sizeof keep, "%s/%s_final.safetensors", t->tmpdir, name);
    CHECK(t, same_file(path, keep), "%s: final model as the uninterrupted run's", name);
    snprintf(path, sizeof path, "%s/step_%d", out, N);
    CHECK(t, checkpoint_verify(path, NULL, err) == 1, "%s: step_%d rewritten intact: %s", name, N,
          err);
}

static void test_checksum_resume_fallback(TestCtx* t) {
    const char* tiny = "--batch 4 --seq 32 --micro-batches 2 --warmup 2";
    fallback_case(t, "fb_flip", tiny, 4, "model.safetensors", FLIP_BYTE);
    fallback_case(t, "fb_trunc", tiny, 4, "train_state.safetensors", TRUNCATE);
    fallback_case(t, "fb_done", tiny, 4, "DONE", DONE_GARBAGE);
    // the delayed engine: the pending weights are part of the checkpoint
    fallback_case(t, "fb_pending", "--batch 4 --seq 32 --micro-batches 2 --warmup 2 --device cpu:2",
                  4, "pending_weights.safetensors", FLIP_BYTE);
    fallback_case(t, "fb_gone", tiny, 3, "args.json", REMOVE);
}

static void test_checksum_resume_edges(TestCtx* t) {
    char out[1024], log1[1024], log2[1024], args[4096], path[1300], err[ERR_LEN];
    const char* common = "--batch 4 --seq 16 --val '' --sample-tokens 0 --threads 2";
    test_path(t, out, sizeof out, "sum_edges");
    test_path(t, log1, sizeof log1, "sum_edges_1.jsonl");
    test_path(t, log2, sizeof log2, "sum_edges_2.jsonl");
    snprintf(args, sizeof args, "%s --steps 2 --save-every 2 --out '%s' --log '%s'", common, out,
             log1);
    if (!run_ok(t, "edge_first", args)) return;
    // intact: resumes as before, saying the files were checked
    snprintf(args, sizeof args, "%s --steps 3 --out '%s' --resume", common, out);
    if (!run_ok(t, "edge_intact", args)) return;
    char* o = test_read_output(t, "edge_intact", "out");
    char want[1500];
    snprintf(want, sizeof want, "resumed from %s/step_2 (step 2), 4 files verified (CRC-32C)\n",
             out);
    CHECK(t, strstr(o, want) && !strstr(o, "warning: --resume") && strstr(o, "step     3/3"),
          "intact: %s", o);
    free(o);
    // an older DONE without checksums: resumes with a note
    snprintf(path, sizeof path, "%s/step_2/DONE", out);
    char* done = test_read_file(path, NULL);
    CHECK(t, file_write_atomic(path, "step 2\n", 7, err) == 0, "%s", err);
    if (!run_ok(t, "edge_old", args)) return;
    o = test_read_output(t, "edge_old", "out");
    snprintf(want, sizeof want, "note: %s/step_2/DONE records no checksums", out);
    CHECK(t, strstr(o, want) && strstr(o, "resumed from") && !strstr(o, "files verified"),
          "older DONE: %s", o);
    free(o);
    CHECK(t, file_write_atomic(path, done, strlen(done), err) == 0, "%s", err);
    free(done);
    // the only checkpoint is corrupt: start from step 0, as the first run did
    snprintf(path, sizeof path, "%s/step_2/train_state.safetensors", out);
    size_t n;
    char* bytes = test_read_file(path, &n);
    bytes[n - 5] ^= 0x40;
    CHECK(t, file_write_atomic(path, bytes, n, err) == 0, "%s", err);
    free(bytes);
    snprintf(args, sizeof args, "%s --steps 2 --out '%s' --log '%s' --resume", common, out, log2);
    if (!run_ok(t, "edge_none", args)) return;
    o = test_read_output(t, "edge_none", "out");
    snprintf(want, sizeof want, "warning: --resume: %s is corrupt", path);
    CHECK(t, strstr(o, want) && strstr(o, "holds no older complete checkpoint: starting from "
                                          "step 0") && !strstr(o, "resumed from"),
          "none intact: %s", o);
    free(o);
    char* l1 = test_read_file(log1, NULL);
    char* l2 = test_read_file(log2, NULL);
    char a[512], b[512];
    for (int s = 1; s <= 2; s++)
        CHECK(t, test_log_record(l1, s, a, sizeof a) && test_log_record(l2, s, b, sizeof b) &&
                     strcmp(a, b) == 0,
              "from scratch, step %d: '%s' vs '%s'", s, a, b);
    free(l1);
    free(l2);
}

const TestCase tests_checksum[] = {
    {"checksum_crc32c", test_checksum_crc32c},
    {"checksum_done_marker", test_checksum_done_marker},
    {"checksum_resume_fallback", test_checksum_resume_fallback},
    {"checksum_resume_edges", test_checksum_resume_edges},
    {NULL, NULL},
};
