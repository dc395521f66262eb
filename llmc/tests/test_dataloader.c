/*
 * test_dataloader.c — tests of llmc/dataloader.c: window layout, token widths, globbing, epoch
 * shuffling, exact resume, and refusal of hostile shard files.
 *
 * Most shards hold tokens that encode their own position (shard * 100000 + index, uint32), so a
 * batch row tells which shard and offset it came from and every property can be checked exactly.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../common.h"
#include "../dataloader.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

#define POS_STRIDE 100000  // token value = shard * POS_STRIDE + index within the shard
#define POS_VOCAB 1000000

// Write a uint32 shard whose tokens encode (shard_id, index). Returns 0 on success.
static int write_pos_shard(TestCtx* t, const char* path, int shard_id, int64_t ntok) {
    uint32_t* tok = malloc_check((size_t)(ntok > 0 ? ntok : 1) * sizeof(uint32_t));
    for (int64_t i = 0; i < ntok; i++) tok[i] = (uint32_t)(shard_id * POS_STRIDE + i);
    char err[ERR_LEN] = "";
    int rc = shard_write(path, tok, ntok, 4, err);
    CHECK(t, rc == 0, "shard_write %s: %s", path, err);
    free(tok);
    return rc;
}

// Make a fresh sub-directory of the test tmpdir and return its path in buf.
static const char* test_subdir(TestCtx* t, char* buf, size_t cap, const char* name) {
    test_path(t, buf, cap, name);
    char err[ERR_LEN] = "";
    CHECK(t, mkdir_p(buf, err) == 0, "%s", err);
    return buf;
}

// Write raw bytes: a 256-int32 header (magic, version, ntok) followed by payload_bytes of zeros.
static void write_raw_shard(const char* path, int32_t magic, int32_t version, int32_t ntok,
                            size_t payload_bytes) {
    int32_t header[SHARD_HEADER_INTS] = {0};
    header[0] = magic;
    header[1] = version;
    header[2] = ntok;
    FILE* f = fopen_check(path, "wb");
    fwrite_check(header, sizeof header, 1, f, path);
    uint8_t zero[256] = {0};
    for (size_t left = payload_bytes; left > 0;) {
        size_t n = left < sizeof zero ? left : sizeof zero;
        fwrite_check(zero, 1, n, f, path);
        left -= n;
    }
    fclose_check(f, path);
}

// Open must fail with an error that names `must_name` and contains `keyword`.
static void expect_open_fails(TestCtx* t, const char* pattern, int B, int T, int vocab,
                              const char* must_name, const char* keyword) {
    DataLoader dl;
    char err[ERR_LEN] = "";
    int rc = dataloader_open(&dl, pattern, B, T, 0, 1, vocab, err);
    CHECK(t, rc == -1, "%s: open should fail", pattern);
    CHECK(t, strstr(err, must_name) != NULL, "error '%s' should name '%s'", err, must_name);
    CHECK(t, strstr(err, keyword) != NULL, "error '%s' should contain '%s'", err, keyword);
    CHECK(t, strchr(err, '\n') == NULL, "error is one line: '%s'", err);
    if (rc == 0) dataloader_close(&dl);
}

// ----------------------------------------------------------------------------
// layout

static void test_dataloader_first_batch_sequential(TestCtx* t) {
    char dir[1024], path[1100];
    test_subdir(t, dir, sizeof dir, "seq");
    snprintf(path, sizeof path, "%s/a.bin", dir);
    const int B = 4, T = 8, W = T + 1;
    const int64_t ntok = 10 * W + 5;  // 10 windows + a partial tail that must be dropped
    if (write_pos_shard(t, path, 0, ntok) != 0) return;

    DataLoader dl;
    char err[ERR_LEN] = "";
    CHECK(t, dataloader_open(&dl, path, B, T, 0, 7, POS_VOCAB, err) == 0, "%s", err);
    if (dl.shards == NULL) return;
    CHECK(t, dl.token_bytes == 4, "token width %d", dl.token_bytes);
    CHECK(t, dl.n_windows == 10, "n_windows %lld", (long long)dl.n_windows);
    CHECK(t, dataloader_batches_per_epoch(&dl) == 2, "batches/epoch %lld",
          (long long)dataloader_batches_per_epoch(&dl));
    int32_t batch[4 * 9];
    CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
    int bad = 0;
    for (int i = 0; i < B * W; i++) bad += batch[i] != i;
    CHECK(t, bad == 0, "first batch must be the first B*(T+1) tokens (%d differ)", bad);
    // batches 2 and 3: windows 4..7, then 8, 9 and (epoch 1) windows 0, 1
    CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
    CHECK(t, batch[0] == 4 * W, "second batch starts at window 4: %d", batch[0]);
    CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
    CHECK(t, batch[0] == 8 * W && batch[W] == 9 * W && batch[2 * W] == 0 && batch[3 * W] == W,
          "third batch wraps into epoch 1: %d %d %d %d", batch[0], batch[W], batch[2 * W],
          batch[3 * W]);
    CHECK(t, dl.epoch == 1 && dl.cursor == 2, "epoch %lld cursor %lld", (long long)dl.epoch,
          (long long)dl.cursor);
    // reset goes back to the very first batch
    dataloader_reset(&dl);
    CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
    CHECK(t, batch[0] == 0 && batch[B * W - 1] == B * W - 1, "reset: %d .. %d", batch[0],
          batch[B * W - 1]);
    dataloader_close(&dl);
}

// Windows never cross a shard boundary, start at multiples of T+1 of their shard, and the
// sequential stream walks the shards in order, dropping each shard's partial tail.
static void test_dataloader_windows_stay_in_shard(TestCtx* t) {
    char dir[1024], path[1100], pattern[1100];
    test_subdir(t, dir, sizeof dir, "cross");
    const int T = 6, W = T + 1, B = 3;
    const int64_t ntoks[3] = {5 * W + 3, 2 * W - 1, 4 * W + 6};  // 5, 1, 4 windows
    for (int s = 0; s < 3; s++) {
        snprintf(path, sizeof path, "%s/shard_%d.bin", dir, s);
        if (write_pos_shard(t, path, s + 1, ntoks[s]) != 0) return;
    }
    snprintf(pattern, sizeof pattern, "%s/shard_*.bin", dir);
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        DataLoader dl;
        char err[ERR_LEN] = "";
        CHECK(t, dataloader_open(&dl, pattern, B, T, shuffle, 3, POS_VOCAB, err) == 0, "%s", err);
        if (dl.shards == NULL) return;
        CHECK(t, dl.n_shards == 3 && dl.n_windows == 10, "shards %d windows %lld", dl.n_shards,
              (long long)dl.n_windows);
        int32_t batch[3 * 7];
        int bad_row = 0, bad_order = 0;
        for (int k = 0; k < 20; k++) {  // 60 windows: six epochs
            CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
            for (int b = 0; b < B; b++) {
                const int32_t* row = batch + b * W;
                int shard = row[0] / POS_STRIDE - 1, start = row[0] % POS_STRIDE;
                int ok = shard >= 0 && shard < 3 && start % W == 0 && start + W <= ntoks[shard];
                for (int j = 1; j < W; j++) ok &= row[j] == row[0] + j;
                bad_row += !ok;
                if (!shuffle) {
                    // expected global window (k*B + b) mod 10 in shard order
                    int w = (k * B + b) % 10;
                    int es = w < 5 ? 0 : (w < 6 ? 1 : 2);
                    int ew = w < 5 ? w : (w < 6 ? 0 : w - 6);
                    bad_order += row[0] != (es + 1) * POS_STRIDE + ew * W;
                }
            }
        }
        CHECK(t, bad_row == 0, "shuffle %d: %d rows cross a shard or misalign", shuffle, bad_row);
        CHECK(t, bad_order == 0, "shuffle 0: %d rows out of shard order", bad_order);
        dataloader_close(&dl);
    }
}

// The same tokens written with 2- and 4-byte widths give the same batches; uint32 carries ids
// above 65535; shard_write refuses such ids in a uint16 shard and leaves no file behind.
static void test_dataloader_uint16_and_uint32(TestCtx* t) {
    char p16[1100], p32[1100], pbig[1100], pbad[1100];
    test_path(t, p16, sizeof p16, "w16.bin");
    test_path(t, p32, sizeof p32, "w32.bin");
    test_path(t, pbig, sizeof pbig, "wbig.bin");
    test_path(t, pbad, sizeof pbad, "wbad.bin");
    const int64_t n = 1000;
    uint32_t tok[1000];
    for (int64_t i = 0; i < n; i++) tok[i] = (uint32_t)((i * 7919) % 65536);
    char err[ERR_LEN] = "";
    CHECK(t, shard_write(p16, tok, n, 2, err) == 0, "%s", err);
    CHECK(t, shard_write(p32, tok, n, 4, err) == 0, "%s", err);
    struct stat st;
    CHECK(t, stat(p16, &st) == 0 && st.st_size == 1024 + 2 * n, "uint16 size");
    CHECK(t, stat(p32, &st) == 0 && st.st_size == 1024 + 4 * n, "uint32 size");
    // header fields, read back raw
    int32_t h[3] = {0};
    FILE* f = fopen_check(p16, "rb");
    fread_check(h, sizeof h, 1, f, p16);
    fclose_check(f, p16);
    CHECK(t, h[0] == 20240520 && h[1] == 1 && h[2] == n, "uint16 header %d %d %d", h[0], h[1],
          h[2]);
    f = fopen_check(p32, "rb");
    fread_check(h, sizeof h, 1, f, p32);
    fclose_check(f, p32);
    CHECK(t, h[0] == 20240801 && h[1] == 7 && h[2] == n, "uint32 header %d %d %d", h[0], h[1],
          h[2]);

    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        DataLoader a, b;
        CHECK(t, dataloader_open(&a, p16, 5, 15, shuffle, 11, 65536, err) == 0, "%s", err);
        CHECK(t, dataloader_open(&b, p32, 5, 15, shuffle, 11, 65536, err) == 0, "%s", err);
        if (a.shards == NULL || b.shards == NULL) return;
        CHECK(t, a.token_bytes == 2 && b.token_bytes == 4, "widths %d %d", a.token_bytes,
              b.token_bytes);
        int32_t ba[5 * 16], bb[5 * 16];
        int differ = 0, bad_tok = 0;
        for (int k = 0; k < 30; k++) {
            CHECK(t, dataloader_next_batch(&a, ba, err) == 0, "%s", err);
            CHECK(t, dataloader_next_batch(&b, bb, err) == 0, "%s", err);
            differ += memcmp(ba, bb, sizeof ba) != 0;
            for (int i = 0; i < 5 * 16; i++) bad_tok += ba[i] < 0 || ba[i] >= 65536;
        }
        CHECK(t, differ == 0, "shuffle %d: %d batches differ between widths", shuffle, differ);
        CHECK(t, bad_tok == 0, "tokens out of range");
        dataloader_close(&a);
        dataloader_close(&b);
    }

    // ids past uint16: fine in a uint32 shard, refused in a uint16 one
    tok[3] = 70000;
    tok[999] = 150000;
    CHECK(t, shard_write(pbig, tok, n, 4, err) == 0, "%s", err);
    DataLoader dl;
    CHECK(t, dataloader_open(&dl, pbig, 1, 9, 0, 0, 151936, err) == 0, "%s", err);
    if (dl.shards) {
        int32_t row[10];
        CHECK(t, dataloader_next_batch(&dl, row, err) == 0, "%s", err);
        CHECK(t, row[3] == 70000, "uint32 token %d", row[3]);
        dataloader_close(&dl);
    }
    err[0] = '\0';
    CHECK(t, shard_write(pbad, tok, n, 2, err) == -1, "uint16 shard must refuse id 70000");
    CHECK(t, strstr(err, "70000") && strstr(err, "index 3") && strstr(err, pbad), "err: %s", err);
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s.tmp", pbad);
    CHECK(t, !file_exists(pbad) && !file_exists(tmp), "no file left after a refused write");
    CHECK(t, shard_write(pbad, tok, n, 3, err) == -1, "width 3 must be refused");
}

// A glob picks up every matching shard in sorted order (whatever the creation order) and ignores
// files that do not match.
static void test_dataloader_glob_multiple_shards(TestCtx* t) {
    char dir[1024], path[1100], pattern[1100];
    test_subdir(t, dir, sizeof dir, "glob");
    const int T = 4, W = T + 1;
    const int order[3] = {2, 0, 1};  // creation order differs from name order
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/data_train_%06d.bin", dir, order[i]);
        if (write_pos_shard(t, path, order[i] + 1, 3 * W) != 0) return;
    }
    snprintf(path, sizeof path, "%s/data_val_000000.bin", dir);
    if (write_pos_shard(t, path, 9, 3 * W) != 0) return;
    snprintf(pattern, sizeof pattern, "%s/data_train_*.bin", dir);

    DataLoader dl;
    char err[ERR_LEN] = "";
    CHECK(t, dataloader_open(&dl, pattern, 9, T, 0, 0, POS_VOCAB, err) == 0, "%s", err);
    if (dl.shards == NULL) return;
    CHECK(t, dl.n_shards == 3 && dl.n_windows == 9, "shards %d windows %lld", dl.n_shards,
          (long long)dl.n_windows);
    for (int s = 0; s < dl.n_shards; s++) {
        char want[64];
        snprintf(want, sizeof want, "data_train_%06d.bin", s);
        CHECK(t, str_ends_with(dl.shards[s].path, want), "shard %d is %s", s, dl.shards[s].path);
        CHECK(t, dl.shards[s].first_window == 3 * s, "first_window %lld",
              (long long)dl.shards[s].first_window);
    }
    int32_t batch[9 * 5];
    CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
    int bad = 0;
    for (int w = 0; w < 9; w++) bad += batch[w * W] != (w / 3 + 1) * POS_STRIDE + (w % 3) * W;
    CHECK(t, bad == 0, "%d windows out of sorted shard order", bad);
    dataloader_close(&dl);
}

// ----------------------------------------------------------------------------
// shuffling

// Read `n_batches` batches and return, per batch row, the global window index (sequence order).
static void read_window_ids(TestCtx* t, DataLoader* dl, int n_batches, int64_t* ids) {
    const int W = dl->T + 1;
    int32_t* batch = malloc_check((size_t)dl->B * (size_t)W * sizeof(int32_t));
    char err[ERR_LEN] = "";
    for (int k = 0; k < n_batches; k++) {
        CHECK(t, dataloader_next_batch(dl, batch, err) == 0, "%s", err);
        for (int b = 0; b < dl->B; b++) {
            int32_t v = batch[b * W];
            int shard = v / POS_STRIDE - 1, start = v % POS_STRIDE;
            ids[k * dl->B + b] = dl->shards[shard].first_window + start / W;
        }
    }
    free(batch);
}

static void test_dataloader_shuffle_each_window_once(TestCtx* t) {
    char dir[1024], path[1100], pattern[1100];
    test_subdir(t, dir, sizeof dir, "shuf");
    const int T = 3, W = T + 1, B = 5;
    snprintf(path, sizeof path, "%s/s_0.bin", dir);
    if (write_pos_shard(t, path, 1, 60 * W + 2) != 0) return;
    snprintf(path, sizeof path, "%s/s_1.bin", dir);
    if (write_pos_shard(t, path, 2, 43 * W) != 0) return;
    snprintf(pattern, sizeof pattern, "%s/s_*.bin", dir);

    DataLoader dl;
    char err[ERR_LEN] = "";
    CHECK(t, dataloader_open(&dl, pattern, B, T, 1, 1234, POS_VOCAB, err) == 0, "%s", err);
    if (dl.shards == NULL) return;
    const int64_t NW = dl.n_windows;
    CHECK(t, NW == 103, "n_windows %lld", (long long)NW);
    // 103 windows, batches of 5: batches straddle epoch boundaries; read three epochs
    const int n_batches = (int)((3 * NW + B - 1) / B);
    int64_t* ids = malloc_check((size_t)n_batches * B * sizeof(int64_t));
    read_window_ids(t, &dl, n_batches, ids);
    int* seen = calloc_check((size_t)NW, sizeof(int));
    for (int e = 0; e < 3; e++) {
        memset(seen, 0, (size_t)NW * sizeof(int));
        for (int64_t i = 0; i < NW; i++) seen[ids[e * NW + i]]++;
        int bad = 0;
        for (int64_t w = 0; w < NW; w++) bad += seen[w] != 1;
        CHECK(t, bad == 0, "epoch %d: %d windows not visited exactly once", e, bad);
    }
    int in_place0 = 0, same01 = 0;
    for (int64_t i = 0; i < NW; i++) {
        in_place0 += ids[i] == i;
        same01 += ids[i] == ids[NW + i];
    }
    CHECK(t, in_place0 < NW / 4, "epoch 0 looks unshuffled (%d fixed points)", in_place0);
    CHECK(t, same01 < NW / 4, "epochs 0 and 1 share the order (%d equal positions)", same01);
    // reset (from epoch 3) replays epoch 0's order
    dataloader_reset(&dl);
    int64_t again[2 * 5];
    read_window_ids(t, &dl, 2, again);
    CHECK(t, memcmp(again, ids, sizeof again) == 0, "reset must replay epoch 0");
    free(seen);
    free(ids);
    dataloader_close(&dl);
}

static void test_dataloader_seed_decides_order(TestCtx* t) {
    char path[1100];
    test_path(t, path, sizeof path, "seed.bin");
    const int T = 7, B = 4;
    if (write_pos_shard(t, path, 1, 200 * (T + 1)) != 0) return;
    int64_t ids[3][40];
    const uint32_t seeds[3] = {42, 42, 43};
    for (int i = 0; i < 3; i++) {
        DataLoader dl;
        char err[ERR_LEN] = "";
        CHECK(t, dataloader_open(&dl, path, B, T, 1, seeds[i], POS_VOCAB, err) == 0, "%s", err);
        if (dl.shards == NULL) return;
        read_window_ids(t, &dl, 10, ids[i]);
        dataloader_close(&dl);
    }
    CHECK(t, memcmp(ids[0], ids[1], sizeof ids[0]) == 0, "same seed must give the same order");
    int same = 0;
    for (int i = 0; i < 40; i++) same += ids[0][i] == ids[2][i];
    CHECK(t, same < 10, "seeds 42 and 43 give nearly the same order (%d of 40 equal)", same);
}

// ----------------------------------------------------------------------------
// resume

// Saving after k batches, closing, reopening, restoring and continuing gives exactly the batches
// of an uninterrupted run, including across epoch boundaries.
static void test_dataloader_resume_exact(TestCtx* t) {
    char dir[1024], path[1100], pattern[1100];
    test_subdir(t, dir, sizeof dir, "resume");
    const int T = 5, W = T + 1, B = 4;
    snprintf(path, sizeof path, "%s/r_0.bin", dir);
    if (write_pos_shard(t, path, 1, 14 * W + 1) != 0) return;
    snprintf(path, sizeof path, "%s/r_1.bin", dir);
    if (write_pos_shard(t, path, 2, 9 * W) != 0) return;  // 23 windows in all
    snprintf(pattern, sizeof pattern, "%s/r_*.bin", dir);

    enum { N_REF = 24 };  // > 4 epochs of 23 windows in batches of 4
    const size_t batch_n = (size_t)B * W;
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        int32_t* ref = malloc_check(N_REF * batch_n * sizeof(int32_t));
        DataLoader dl;
        char err[ERR_LEN] = "";
        CHECK(t, dataloader_open(&dl, pattern, B, T, shuffle, 99, POS_VOCAB, err) == 0, "%s", err);
        if (dl.shards == NULL) return;
        for (int k = 0; k < N_REF; k++)
            CHECK(t, dataloader_next_batch(&dl, ref + k * batch_n, err) == 0, "%s", err);
        dataloader_close(&dl);

        // k = 5: cursor 20 (3 before the end); 6: the saving batch crossed into epoch 1;
        // 17: mid epoch 2; 23: exactly at the end of epoch 3 (92 windows)
        const int ks[] = {0, 1, 5, 6, 11, 17, 23};
        for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
            int k = ks[ki];
            uint8_t state[DATALOADER_STATE_BYTES];
            int32_t batch[4 * 6];
            CHECK(t, dataloader_open(&dl, pattern, B, T, shuffle, 99, POS_VOCAB, err) == 0, "%s",
                  err);
            if (dl.shards == NULL) return;
            for (int i = 0; i < k; i++) dataloader_next_batch(&dl, batch, err);
            dataloader_state_save(&dl, state);
            dataloader_close(&dl);

            CHECK(t, dataloader_open(&dl, pattern, B, T, shuffle, 99, POS_VOCAB, err) == 0, "%s",
                  err);
            if (dl.shards == NULL) return;
            // read a little first, so restore must really move the position back
            dataloader_next_batch(&dl, batch, err);
            CHECK(t, dataloader_state_restore(&dl, state, err) == 0, "k=%d: %s", k, err);
            int differ = 0;
            for (int i = k; i < N_REF; i++) {
                CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
                differ += memcmp(batch, ref + i * batch_n, sizeof batch) != 0;
            }
            CHECK(t, differ == 0, "shuffle %d, resume after %d batches: %d batches differ",
                  shuffle, k, differ);
            dataloader_close(&dl);
        }
        free(ref);
    }
}

// A blob from another shape, seed or dataset, or a corrupt blob, is refused with the field named,
// and the loader keeps its position.
static void test_dataloader_restore_rejects_mismatch(TestCtx* t) {
    char dir[1024], path[1100], pattern[1100], pattern2[1100];
    test_subdir(t, dir, sizeof dir, "mismatch");
    snprintf(path, sizeof path, "%s/m_0.bin", dir);
    if (write_pos_shard(t, path, 1, 400) != 0) return;
    snprintf(path, sizeof path, "%s/m_1.bin", dir);
    if (write_pos_shard(t, path, 2, 300) != 0) return;
    snprintf(pattern, sizeof pattern, "%s/m_*.bin", dir);
    snprintf(pattern2, sizeof pattern2, "%s/m_0.bin", dir);

    DataLoader dl;
    char err[ERR_LEN] = "";
    uint8_t state[DATALOADER_STATE_BYTES], bad[DATALOADER_STATE_BYTES];
    CHECK(t, dataloader_open(&dl, pattern, 4, 9, 1, 5, POS_VOCAB, err) == 0, "%s", err);
    if (dl.shards == NULL) return;
    int32_t batch[4 * 10];
    for (int i = 0; i < 3; i++) dataloader_next_batch(&dl, batch, err);
    dataloader_state_save(&dl, state);
    dataloader_close(&dl);

    struct {
        const char* pattern;
        int B, T, shuffle;
        uint32_t seed;
        const char* field;
    } cases[] = {
        {pattern, 2, 9, 1, 5, "batch size B"},
        {pattern, 4, 8, 1, 5, "sequence length T"},
        {pattern, 4, 9, 0, 5, "shuffle"},
        {pattern, 4, 9, 1, 6, "seed"},
        {pattern2, 4, 9, 1, 5, "shard count"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK(t, dataloader_open(&dl, cases[i].pattern, cases[i].B, cases[i].T, cases[i].shuffle,
                                 cases[i].seed, POS_VOCAB, err) == 0, "%s", err);
        if (dl.shards == NULL) return;
        err[0] = '\0';
        CHECK(t, dataloader_state_restore(&dl, state, err) == -1, "case %zu: restore must fail", i);
        CHECK(t, strstr(err, cases[i].field) != NULL, "error '%s' should name '%s'", err,
              cases[i].field);
        CHECK(t, dl.epoch == 0 && dl.cursor == 0, "a refused restore must not move the loader");
        dataloader_close(&dl);
    }

    CHECK(t, dataloader_open(&dl, pattern, 4, 9, 1, 5, POS_VOCAB, err) == 0, "%s", err);
    if (dl.shards == NULL) return;
    memcpy(bad, state, sizeof bad);
    bad[0] ^= 0xff;
    CHECK(t, dataloader_state_restore(&dl, bad, err) == -1 && strstr(err, "magic"), "magic: %s",
          err);
    memcpy(bad, state, sizeof bad);
    bad[4] = 9;
    CHECK(t, dataloader_state_restore(&dl, bad, err) == -1 && strstr(err, "version"), "ver: %s",
          err);
    memcpy(bad, state, sizeof bad);
    bad[16] = 0xff;  // cursor 255 >= 70 windows
    CHECK(t, dataloader_state_restore(&dl, bad, err) == -1 && strstr(err, "cursor"), "cur: %s",
          err);
    memcpy(bad, state, sizeof bad);
    bad[15] = 0x80;  // epoch negative
    CHECK(t, dataloader_state_restore(&dl, bad, err) == -1 && strstr(err, "epoch"), "ep: %s", err);
    memcpy(bad, state, sizeof bad);
    bad[24] ^= 1;  // window count
    CHECK(t, dataloader_state_restore(&dl, bad, err) == -1 && strstr(err, "window count"),
          "nw: %s", err);
    CHECK(t, dataloader_state_restore(&dl, state, err) == 0, "the good blob still works: %s", err);
    CHECK(t, dl.cursor == 12, "cursor after restore %lld", (long long)dl.cursor);
    dataloader_close(&dl);
}

// ----------------------------------------------------------------------------
// hostile input

static void test_dataloader_hostile_shards(TestCtx* t) {
    char dir[1024], p[1100], p2[1100], pattern[1100];
    test_subdir(t, dir, sizeof dir, "hostile");
    const int V = 65536;

    snprintf(p, sizeof p, "%s/bad_magic.bin", dir);
    write_raw_shard(p, 12345, 1, 100, 200);
    expect_open_fails(t, p, 1, 8, V, p, "20240801");

    snprintf(p, sizeof p, "%s/bad_version.bin", dir);
    write_raw_shard(p, SHARD_MAGIC_U16, 7, 100, 200);  // the uint32 version with the uint16 magic
    expect_open_fails(t, p, 1, 8, V, p, "version 7");

    snprintf(p, sizeof p, "%s/truncated.bin", dir);
    write_raw_shard(p, SHARD_MAGIC_U16, 1, 100, 199);
    expect_open_fails(t, p, 1, 8, V, p, "expected 1224");

    snprintf(p, sizeof p, "%s/trailing.bin", dir);
    write_raw_shard(p, SHARD_MAGIC_U32, 7, 100, 402);
    expect_open_fails(t, p, 1, 8, V, p, "expected 1424");

    snprintf(p, sizeof p, "%s/ntok_below_zero.bin", dir);
    write_raw_shard(p, SHARD_MAGIC_U16, 1, -5, 0);
    expect_open_fails(t, p, 1, 8, V, p, "count -5 is negative");

    snprintf(p, sizeof p, "%s/tiny.bin", dir);
    FILE* f = fopen_check(p, "wb");
    fwrite_check("abc", 1, 3, f, p);
    fclose_check(f, p);
    expect_open_fails(t, p, 1, 8, V, p, "header");

    snprintf(p, sizeof p, "%s/empty.bin", dir);
    fclose_check(fopen_check(p, "wb"), p);
    expect_open_fails(t, p, 1, 8, V, p, "header");

    // token >= vocab at index 1234 (uint32 shard so 70000 is representable)
    snprintf(p, sizeof p, "%s/vocab.bin", dir);
    {
        uint32_t tok[2000];
        for (int i = 0; i < 2000; i++) tok[i] = (uint32_t)i;
        tok[1234] = 70000;
        tok[1500] = 80000;  // a second offender: the first must be reported
        char err[ERR_LEN] = "";
        CHECK(t, shard_write(p, tok, 2000, 4, err) == 0, "%s", err);
    }
    expect_open_fails(t, p, 1, 8, V, p, "token 70000 at index 1234 >= vocab size 65536");

    // mixed widths: a uint16 shard followed by a uint32 one
    snprintf(p, sizeof p, "%s/mix_0.bin", dir);
    snprintf(p2, sizeof p2, "%s/mix_1.bin", dir);
    {
        uint32_t tok[100] = {0};
        char err[ERR_LEN] = "";
        CHECK(t, shard_write(p, tok, 100, 2, err) == 0, "%s", err);
        CHECK(t, shard_write(p2, tok, 100, 4, err) == 0, "%s", err);
    }
    snprintf(pattern, sizeof pattern, "%s/mix_*.bin", dir);
    expect_open_fails(t, pattern, 1, 8, V, p2, "width");

    // too few tokens: 3 shards of 25 tokens, T = 9 -> 2 windows each (tails dropped), B = 7
    for (int s = 0; s < 3; s++) {
        snprintf(p, sizeof p, "%s/few_%d.bin", dir, s);
        write_pos_shard(t, p, s + 1, 25);
    }
    snprintf(pattern, sizeof pattern, "%s/few_*.bin", dir);
    expect_open_fails(t, pattern, 7, 9, POS_VOCAB, pattern, "75 tokens give only 6 windows");
    DataLoader dl;
    char err[ERR_LEN] = "";
    CHECK(t, dataloader_open(&dl, pattern, 6, 9, 1, 0, POS_VOCAB, err) == 0, "B=6 fits: %s", err);
    if (dl.shards) dataloader_close(&dl);

    snprintf(pattern, sizeof pattern, "%s/nothing_*.bin", dir);
    expect_open_fails(t, pattern, 1, 8, V, pattern, "no shard matches");

    // a directory matching the pattern is not a shard
    snprintf(p, sizeof p, "%s/adir.bin", dir);
    CHECK(t, mkdir_p(p, err) == 0, "%s", err);
    expect_open_fails(t, p, 1, 8, V, p, "regular file");
}

// Large shards are only sampled at open; next_batch still finds a bad token that the sample
// missed, and names the file and offset.
static void test_dataloader_batch_catches_unsampled_token(TestCtx* t) {
    char p[1100];
    test_path(t, p, sizeof p, "big.bin");
    const int64_t n = 4500000;  // > the size checked exhaustively at open
    const int T = 1023, W = T + 1, B = 64;
    uint32_t* tok = malloc_check((size_t)n * sizeof(uint32_t));
    for (int64_t i = 0; i < n; i++) tok[i] = (uint32_t)(i % 50000);
    int64_t bad_at = 2000001;  // past the checked head; odd, so no evenly spaced sample point
    tok[bad_at] = 60000;
    char err[ERR_LEN] = "";
    CHECK(t, shard_write(p, tok, n, 2, err) == 0, "%s", err);
    free(tok);

    DataLoader dl;
    int rc = dataloader_open(&dl, p, B, T, 0, 0, 50000, err);
    CHECK(t, rc == 0, "open samples a large shard and must miss index %lld: %s",
          (long long)bad_at, err);
    if (rc != 0) return;
    int32_t* batch = malloc_check((size_t)B * W * sizeof(int32_t));
    int64_t failed_at = -1;
    for (int64_t k = 0; k < dataloader_batches_per_epoch(&dl); k++) {
        if (dataloader_next_batch(&dl, batch, err) != 0) {
            failed_at = k;
            break;
        }
    }
    CHECK(t, failed_at == bad_at / ((int64_t)B * W), "failed at batch %lld", (long long)failed_at);
    CHECK(t, strstr(err, p) && strstr(err, "token 60000 at index 2000001 >= vocab size 50000"),
          "err: %s", err);
    free(batch);
    dataloader_close(&dl);
}

// The committed byte-level arithmetic corpus is a valid uint16 shard pair for a 256-token vocab,
// each document starts with EOT (0) and the text is arithmetic problems.
static void test_dataloader_tiny_corpus(TestCtx* t) {
    const char* names[2] = {"tiny_train.bin", "tiny_val.bin"};
    for (int i = 0; i < 2; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/data/%s", t->exe_dir, names[i]);
        if (!file_exists(path)) snprintf(path, sizeof path, "data/%s", names[i]);
        DataLoader dl;
        char err[ERR_LEN] = "";
        int rc = dataloader_open(&dl, path, 4, 64, 0, 0, 256, err);
        CHECK(t, rc == 0, "%s", err);
        if (rc != 0) continue;
        CHECK(t, dl.token_bytes == 2, "%s: token width %d", path, dl.token_bytes);
        CHECK(t, dl.shards[0].ntok > 10000, "%s: %lld tokens", path,
              (long long)dl.shards[0].ntok);
        int32_t batch[4 * 65];
        CHECK(t, dataloader_next_batch(&dl, batch, err) == 0, "%s", err);
        CHECK(t, batch[0] == 0, "%s: first token %d is not EOT", path, batch[0]);
        int n_eq = 0, n_nl = 0, bad = 0;
        for (int j = 1; j < 4 * 65; j++) {
            int c = batch[j];
            n_eq += c == '=';
            n_nl += c == '\n';
            bad += !(c == 0 || c == '\n' || c == '=' || c == '+' || c == '-' || c == '*' ||
                     (c >= '0' && c <= '9'));
        }
        CHECK(t, n_eq > 5 && n_nl > 5 && bad == 0, "%s: not arithmetic text (= %d, nl %d, bad %d)",
              path, n_eq, n_nl, bad);
        dataloader_close(&dl);
    }
}

// ----------------------------------------------------------------------------

const TestCase tests_dataloader[] = {
    {"dataloader_first_batch_sequential", test_dataloader_first_batch_sequential},
    {"dataloader_windows_stay_in_shard", test_dataloader_windows_stay_in_shard},
    {"dataloader_uint16_and_uint32", test_dataloader_uint16_and_uint32},
    {"dataloader_glob_multiple_shards", test_dataloader_glob_multiple_shards},
    {"dataloader_shuffle_each_window_once", test_dataloader_shuffle_each_window_once},
    {"dataloader_seed_decides_order", test_dataloader_seed_decides_order},
    {"dataloader_resume_exact", test_dataloader_resume_exact},
    {"dataloader_restore_rejects_mismatch", test_dataloader_restore_rejects_mismatch},
    {"dataloader_hostile_shards", test_dataloader_hostile_shards},
    {"dataloader_batch_catches_unsampled_token", test_dataloader_batch_catches_unsampled_token},
    {"dataloader_tiny_corpus", test_dataloader_tiny_corpus},
    {NULL, NULL},
};
