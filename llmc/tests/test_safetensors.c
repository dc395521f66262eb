/*
 * test_safetensors.c — suite `safetensors`: writer -> reader round trips, the minimal file,
 * fp16/bf16/fp32 conversion, hand-built hostile files (each must fail with a message naming the
 * file), a mutation loop over a valid file's bytes (st_open must fail cleanly or return
 * tensors that lie inside the mapping), and sharded checkpoints opened through a directory or an
 * index .json.
 */
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../rng.h"
#include "../safetensors.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

// A raw safetensors file: u64 LE header_len, the header bytes, then data_len bytes of data
// (0xAB filler, or `data` when given).
// Fixture files go through the atomic-write helper like every other writer; a failure to write
// one is a machine failure, not a test result.
static void write_bytes(const char* path, const void* data, size_t n) {
    char err[ERR_LEN];
    if (file_write_atomic(path, data, n, err) != 0) fatal("%s", err);
}

static void write_raw(const char* path, uint64_t header_len, const char* header,
                      size_t header_bytes, const void* data, size_t data_len) {
    uint8_t* buf = malloc_check(8 + header_bytes + data_len);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(header_len >> (8 * i));
    if (header_bytes) memcpy(buf + 8, header, header_bytes);
    for (size_t i = 0; i < data_len; i++)
        buf[8 + header_bytes + i] = data ? ((const uint8_t*)data)[i] : 0xAB;
    write_bytes(path, buf, 8 + header_bytes + data_len);
    free(buf);
}

// The usual case: header_len = strlen(header).
static void write_st(const char* path, const char* header, size_t data_len) {
    write_raw(path, strlen(header), header, strlen(header), NULL, data_len);
}

static void make_dir(TestCtx* t, const char* path) {
    char err[ERR_LEN];
    CHECK(t, mkdir_p(path, err) == 0, "%s", err);
}

static int starts_with_path(const char* err, const char* path) {
    size_t n = strlen(path);
    return strncmp(err, path, n) == 0 && err[n] == ':';
}

static void write_text(const char* path, const char* text) { write_bytes(path, text, strlen(text)); }

// ----------------------------------------------------------------------------
// round trip

static void test_safetensors_roundtrip(TestCtx* t) {
    char path[512], tmp[600];
    test_path(t, path, sizeof path, "roundtrip.safetensors");
    float w[12];
    for (int i = 0; i < 12; i++) w[i] = (float)i * 0.25f - 1.0f;
    uint16_t bias[5] = {0x3F80, 0xC000, 0x0000, 0x8000, 0x4049};
    uint8_t bytes[7] = {1, 2, 3, 4, 5, 6, 255};
    uint16_t h[6] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x0000, 0x3555};
    float scalar = 3.5f;
    const int64_t s_w[2] = {3, 4}, s_bias[1] = {5}, s_u8[1] = {7}, s_h[2] = {2, 3};
    const int64_t s_empty[2] = {0, 4};

    StWriter wr;
    st_writer_init(&wr);
    // added out of name order: the file must still be in name order
    st_writer_add(&wr, "model.b.weight", ST_F32, 2, s_w, w);
    st_writer_add(&wr, "model.a.bias", ST_BF16, 1, s_bias, bias);
    st_writer_add(&wr, "c.bytes", ST_U8, 1, s_u8, bytes);  // odd size: later tensors unaligned
    st_writer_add(&wr, "d.half", ST_F16, 2, s_h, h);
    st_writer_add(&wr, "e.scalar", ST_F32, 0, NULL, &scalar);
    st_writer_add(&wr, "f.empty", ST_F32, 2, s_empty, NULL);
    st_writer_meta(&wr, "format", "pt");
    st_writer_meta(&wr, "note", "quote\" backslash\\ newline\n tab\t");
    st_writer_meta(&wr, "format", "pt2");  // replaces, keys stay unique
    char err[ERR_LEN] = "";
    int rc = st_writer_write(&wr, path, err);
    CHECK(t, rc == 0, "write: %s", err);
    st_writer_free(&wr);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(t, !file_exists(tmp), "temporary file left behind");

    StFile f;
    rc = st_open(&f, path, err);
    CHECK(t, rc == 0, "open: %s", err);
    if (rc != 0) return;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f.map[i];
    CHECK(t, hlen % 8 == 0 && f.map[8] == '{', "header length %llu padded to 8",
          (unsigned long long)hlen);
    CHECK(t, f.size == 8 + hlen + 48 + 10 + 7 + 12 + 4, "file size %zu", f.size);
    CHECK(t, f.n_tensors == 6, "n_tensors %d", f.n_tensors);
    for (int i = 1; i < f.n_tensors; i++)
        CHECK(t, strcmp(f.tensors[i - 1].name, f.tensors[i].name) < 0, "sorted by name");
    CHECK(t, f.n_meta == 2 && strcmp(st_meta(&f, "format"), "pt2") == 0, "meta format");
    CHECK(t, st_meta(&f, "note") && strcmp(st_meta(&f, "note"),
                                           "quote\" backslash\\ newline\n tab\t") == 0,
          "meta with escapes");
    CHECK(t, st_meta(&f, "absent") == NULL, "absent meta");

    const StTensor* tw = st_find(&f, "model.b.weight");
    CHECK(t, tw && tw->dtype == ST_F32 && tw->ndim == 2 && tw->shape[0] == 3 &&
                 tw->shape[1] == 4 && tw->numel == 12 && tw->nbytes == 48 &&
                 memcmp(tw->data, w, 48) == 0 && strcmp(tw->file, path) == 0,
          "model.b.weight");
    const StTensor* tb = st_find(&f, "model.a.bias");
    CHECK(t, tb && tb->dtype == ST_BF16 && tb->ndim == 1 && tb->numel == 5 && tb->nbytes == 10 &&
                 memcmp(tb->data, bias, 10) == 0,
          "model.a.bias");
    const StTensor* tu = st_find(&f, "c.bytes");
    CHECK(t, tu && tu->dtype == ST_U8 && tu->nbytes == 7 && memcmp(tu->data, bytes, 7) == 0,
          "c.bytes");
    const StTensor* th = st_find(&f, "d.half");
    CHECK(t, th && th->dtype == ST_F16 && th->numel == 6 && memcmp(th->data, h, 12) == 0,
          "d.half");
    const StTensor* ts = st_find(&f, "e.scalar");
    CHECK(t, ts && ts->ndim == 0 && ts->numel == 1 && ts->nbytes == 4 &&
                 memcmp(ts->data, &scalar, 4) == 0,
          "rank-0 scalar");
    const StTensor* te = st_find(&f, "f.empty");
    CHECK(t, te && te->ndim == 2 && te->numel == 0 && te->nbytes == 0 && te->data == NULL,
          "zero-sized tensor");
    CHECK(t, st_find(&f, "model") == NULL && st_find(&f, "zzz") == NULL && st_find(&f, "") == NULL,
          "absent names");
    // name order in the data buffer: c.bytes first, right after the header
    CHECK(t, tu && tu->data == f.map + 8 + hlen, "first tensor at the data start");
    st_close(&f);
    CHECK(t, f.map == NULL && f.tensors == NULL, "st_close clears");

    // A duplicate name is refused and leaves no file.
    char dup[512];
    test_path(t, dup, sizeof dup, "dup.safetensors");
    st_writer_init(&wr);
    st_writer_add(&wr, "x", ST_F32, 0, NULL, &scalar);
    st_writer_add(&wr, "x", ST_F32, 0, NULL, &scalar);
    CHECK(t, st_writer_write(&wr, dup, err) == -1 && strstr(err, "'x'") && strstr(err, dup),
          "duplicate: %s", err);
    CHECK(t, !file_exists(dup), "no file written");
    st_writer_free(&wr);
}

// The smallest legal file: an empty header map.
static void test_safetensors_minimal(TestCtx* t) {
    static const uint8_t ref[16] = {8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
    char path[512], err[ERR_LEN] = "";
    test_path(t, path, sizeof path, "minimal.safetensors");
    write_raw(path, 8, (const char*)ref + 8, 8, NULL, 0);
    StFile f;
    int rc = st_open(&f, path, err);
    CHECK(t, rc == 0 && f.n_tensors == 0 && f.n_meta == 0 && f.size == 16, "open: %s", err);
    if (rc == 0) st_close(&f);

    // The writer produces exactly those 16 bytes for an empty set.
    StWriter wr;
    st_writer_init(&wr);
    CHECK(t, st_writer_write(&wr, path, err) == 0, "write: %s", err);
    st_writer_free(&wr);
    size_t len = 0;
    char* got = file_read_all(path, 1024, &len, err);
    CHECK(t, got && len == 16 && memcmp(got, ref, 16) == 0, "writer minimal file");
    free(got);

    // Also opened as a checkpoint: zero tensors.
    StCheckpoint ck;
    rc = st_checkpoint_open(&ck, path, err);
    CHECK(t, rc == 0 && ck.n_tensors == 0 && ck.n_files == 1, "checkpoint: %s", err);
    if (rc == 0) st_checkpoint_close(&ck);
}

// ----------------------------------------------------------------------------
// conversion to fp32

static void test_safetensors_to_f32(TestCtx* t) {
    char path[512], err[ERR_LEN] = "";
    test_path(t, path, sizeof path, "convert.safetensors");
    uint8_t pad[3] = {9, 9, 9};  // "a.pad" sorts first: every float tensor starts unaligned
    uint16_t h[6] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x8000, 0x3555};
    const float h_want[6] = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-08f, -0.0f,
                             0.333251953125f};
    uint16_t bf[5] = {0x3F80, 0xC0A0, 0x0000, 0x4049, 0x0001};
    const float bf_want[5] = {1.0f, -5.0f, 0.0f, 3.140625f, 9.18354962e-41f};
    float f32[4] = {1.5f, -1e-30f, 3.4e38f, 1.17549435e-38f};
    float nan_f32[4] = {0.0f, 1.0f, NAN, 2.0f};
    uint16_t inf_bf[3] = {0x3F80, 0x3F80, 0x7F80};
    const int64_t s3[1] = {3}, s23[2] = {2, 3}, s5[1] = {5}, s4[1] = {4};
    StWriter wr;
    st_writer_init(&wr);
    st_writer_add(&wr, "a.pad", ST_U8, 1, s3, pad);
    st_writer_add(&wr, "b.f16", ST_F16, 2, s23, h);
    st_writer_add(&wr, "c.bf16", ST_BF16, 1, s5, bf);
    st_writer_add(&wr, "d.f32", ST_F32, 1, s4, f32);
    st_writer_add(&wr, "e.nan", ST_F32, 1, s4, nan_f32);
    st_writer_add(&wr, "f.inf", ST_BF16, 1, s3, inf_bf);
    int rc = st_writer_write(&wr, path, err);
    st_writer_free(&wr);
    CHECK(t, rc == 0, "write: %s", err);
    StFile f;
    if (st_open(&f, path, err) != 0) {
        CHECK(t, 0, "open: %s", err);
        return;
    }
    float out[8];
    const StTensor* th = st_find(&f, "b.f16");
    CHECK(t, th && ((uintptr_t)th->data % 2) == 1, "f16 data is unaligned");
    CHECK(t, th && st_tensor_to_f32(th, out, 6, err) == 0, "f16: %s", err);
    for (int i = 0; i < 6; i++)
        CHECK(t, memcmp(&out[i], &h_want[i], 4) == 0, "f16[%d] = %.9g want %.9g", i, out[i],
              h_want[i]);
    const StTensor* tb = st_find(&f, "c.bf16");
    CHECK(t, tb && st_tensor_to_f32(tb, out, 5, err) == 0, "bf16: %s", err);
    for (int i = 0; i < 5; i++)
        CHECK(t, out[i] == bf_want[i], "bf16[%d] = %.9g want %.9g", i, out[i], bf_want[i]);
    const StTensor* tf = st_find(&f, "d.f32");
    CHECK(t, tf && st_tensor_to_f32(tf, out, 4, err) == 0 && memcmp(out, f32, 16) == 0, "f32: %s",
          err);

    // refusals name the file, the tensor and the element
    const StTensor* tn = st_find(&f, "e.nan");
    CHECK(t, tn && st_tensor_to_f32(tn, out, 4, err) == -1 && strstr(err, path) &&
                 strstr(err, "'e.nan'") && strstr(err, "element 2") && strstr(err, "NaN"),
          "nan: %s", err);
    const StTensor* ti = st_find(&f, "f.inf");
    CHECK(t, ti && st_tensor_to_f32(ti, out, 3, err) == -1 && strstr(err, "element 2") &&
                 strstr(err, "infinite"),
          "inf: %s", err);
    const StTensor* tp = st_find(&f, "a.pad");
    CHECK(t, tp && st_tensor_to_f32(tp, out, 3, err) == -1 &&
                 strstr(err, "tensor 'a.pad': dtype U8 cannot be converted to float"),
          "u8: %s", err);
    CHECK(t, tf && st_tensor_to_f32(tf, out, 5, err) == -1 && strstr(err, "'d.f32'"),
          "count mismatch: %s", err);
    st_close(&f);
}

// ----------------------------------------------------------------------------
// hostile files

typedef struct Hostile {
    const char* what;
    const char* header;
    size_t data_len;
    const char* expect;  // substring of the message
} Hostile;

static void expect_open_fails(TestCtx* t, const char* path, const char* what, const char* expect) {
    StFile f;
    char err[ERR_LEN] = "";
    int rc = st_open(&f, path, err);
    CHECK(t, rc == -1, "%s: should fail", what);
    if (rc == 0) {
        st_close(&f);
        return;
    }
    CHECK(t, starts_with_path(err, path) && strchr(err, '\n') == NULL, "%s: message '%s'", what,
          err);
    if (expect) CHECK(t, strstr(err, expect) != NULL, "%s: '%s' lacks '%s'", what, err, expect);
    CHECK(t, f.map == NULL && f.tensors == NULL && f.path == NULL, "%s: StFile cleared", what);
}

static void test_safetensors_hostile(TestCtx* t) {
    static const Hostile cases[] = {
        {"not an object", "[]      ", 0, "JSON object"},
        {"bad JSON", "{\"a\":  ", 0, "header JSON"},
        {"trailing garbage in header", "{} x    ", 0, "header JSON"},
        {"gap between tensors",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         12, "gap"},
        {"overlap",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, "overlap"},
        {"data not starting at 0",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 8, "gap"},
        {"trailing bytes", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
         "trailing"},
        {"data past the end", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         4, "past"},
        {"size mismatch", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4,
         "needs 8"},
        {"unknown dtype", "{\"a\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,1]}}", 1,
         "dtype 'Q4'"},
        {"dtype not a string", "{\"a\":{\"dtype\":5,\"shape\":[2],\"data_offsets\":[0,1]}}", 1,
         "dtype"},
        {"negative shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0,
         "shape[0]"},
        {"fractional shape", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}",
         1, "shape[0]"},
        {"huge shape overflows",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", 0,
         "overflow"},
        {"bytes overflow",
         "{\"a\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,0]}}", 0,
         "overflow"},
        {"shape beyond int64",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[18446744073709551616],\"data_offsets\":[0,0]}}", 0,
         "shape[0]"},
        {"too many dims",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1,
         "dimensions"},
        {"duplicate name",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
         2, "duplicate key"},
        {"metadata not an object", "{\"__metadata__\":\"pt\"}", 0, "__metadata__"},
        {"metadata value not a string", "{\"__metadata__\":{\"format\":1}}", 0, "'format'"},
        {"unknown field",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"offsets\":[0,1]}}", 1,
         "unknown field 'offsets'"},
        {"missing data_offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, "data_offsets"},
        {"missing shape", "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, "shape"},
        {"begin > end", "{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[1,0]}}", 1,
         "begin"},
        {"three offsets", "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,1]}}", 1,
         "data_offsets"},
        {"entry not an object", "{\"a\":5}", 0, "not an object"},
        {"NUL in a tensor name",
         "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "NUL"},
    };
    const int n = (int)(sizeof cases / sizeof cases[0]);
    char path[512];
    for (int i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof name, "hostile_%02d.safetensors", i);
        test_path(t, path, sizeof path, name);
        write_st(path, cases[i].header, cases[i].data_len);
        expect_open_fails(t, path, cases[i].what, cases[i].expect);
        // tensor errors name the tensor
        if (strstr(cases[i].header, "\"a\":{") && !strstr(cases[i].what, "duplicate") &&
            !strstr(cases[i].what, "JSON") && !strstr(cases[i].what, "trailing")) {
            StFile f;
            char err[ERR_LEN] = "";
            if (st_open(&f, path, err) == 0) st_close(&f);
            CHECK(t, strstr(err, "tensor '") != NULL, "%s: no tensor named in '%s'",
                  cases[i].what, err);
        }
    }

    // Framing errors.
    test_path(t, path, sizeof path, "short.safetensors");
    write_raw(path, 0, NULL, 0, NULL, 0);  // 8 bytes: header length 0, empty header
    expect_open_fails(t, path, "empty header", "JSON object");
    write_bytes(path, "\x08\0\0\0", 4);
    expect_open_fails(t, path, "4-byte file", "too small");
    write_raw(path, 100, "{}", 2, NULL, 10);
    expect_open_fails(t, path, "truncated header", "past the end");
    write_raw(path, 1ull << 40, "{}", 2, NULL, 6);
    expect_open_fails(t, path, "huge header length", "limit");
    write_raw(path, 100000001ull, "{}", 2, NULL, 6);
    expect_open_fails(t, path, "header length 100,000,001", "limit");
    write_raw(path, UINT64_MAX, "{}", 2, NULL, 6);
    expect_open_fails(t, path, "header length 2^64-1", "limit");
    test_path(t, path, sizeof path, "does_not_exist.safetensors");
    expect_open_fails(t, path, "missing file", "cannot open");
    expect_open_fails(t, t->tmpdir, "a directory", "regular file");

    // Legal oddities: leading whitespace, padding, zero-sized tensors sharing an offset.
    test_path(t, path, sizeof path, "odd_ok.safetensors");
    write_st(path,
             "  {\"z\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},"
             "\"y\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
             "\"x\":{\"dtype\":\"I64\",\"shape\":[3,0],\"data_offsets\":[2,2]},"
             "\"__metadata__\":{}}      ",
             2);
    StFile f;
    char err[ERR_LEN] = "";
    int rc = st_open(&f, path, err);
    CHECK(t, rc == 0 && f.n_tensors == 3 && strcmp(f.tensors[0].name, "x") == 0, "odd: %s", err);
    if (rc == 0) st_close(&f);
}

// Mutate the length field and header of a valid file: st_open never crashes, and whatever it
// accepts satisfies the reader's invariants.
static void test_safetensors_mutation(TestCtx* t) {
    char path[512], err[ERR_LEN];
    test_path(t, path, sizeof path, "mutate_src.safetensors");
    uint16_t a[6] = {1, 2, 3, 4, 5, 6};
    uint8_t b[3] = {7, 8, 9};
    const int64_t sa[2] = {2, 3}, sb[1] = {3};
    StWriter wr;
    st_writer_init(&wr);
    st_writer_add(&wr, "a", ST_BF16, 2, sa, a);
    st_writer_add(&wr, "b", ST_U8, 1, sb, b);
    st_writer_meta(&wr, "format", "pt");
    CHECK(t, st_writer_write(&wr, path, err) == 0, "%s", err);
    st_writer_free(&wr);
    size_t len = 0;
    char* src = file_read_all(path, 4096, &len, err);
    if (!src) {
        CHECK(t, 0, "%s", err);
        return;
    }
    static const char specials[] = "{}[]\",:0123456789-.e \x00\xff";
    char* buf = malloc_check(len + 64);
    test_path(t, path, sizeof path, "mutated.safetensors");
    Rng rng;
    rng_seed(&rng, 99);
    int n_ok = 0;
    for (int it = 0; it < 1500; it++) {
        memcpy(buf, src, len);
        size_t n = len;
        int n_mut = 1 + (int)rng_below(&rng, 3);
        for (int m = 0; m < n_mut; m++) {
            size_t pos = (size_t)rng_below(&rng, n);
            int kind = (int)rng_below(&rng, 4);
            char c = rng_below(&rng, 2) ? (char)rng_below(&rng, 256)
                                        : specials[rng_below(&rng, sizeof specials - 1)];
            if (kind == 0) {  // replace a byte
                buf[pos] = c;
            } else if (kind == 1 && n > 1) {  // delete a byte
                memmove(buf + pos, buf + pos + 1, n - pos - 1);
                n--;
            } else if (kind == 2 && n < len + 60) {  // insert a byte
                memmove(buf + pos + 1, buf + pos, n - pos);
                buf[pos] = c;
                n++;
            } else {  // truncate
                n = pos;
            }
        }
        write_bytes(path, buf, n);
        StFile sf;
        err[0] = '\0';
        if (st_open(&sf, path, err) == 0) {
            n_ok++;
            uint64_t total = 0;
            for (int i = 0; i < sf.n_tensors; i++) {
                const StTensor* tt = &sf.tensors[i];
                total += tt->nbytes;
                CHECK(t, tt->nbytes == 0 ||
                             (tt->data >= sf.map && tt->data + tt->nbytes <= sf.map + sf.size),
                      "it %d: tensor outside the mapping", it);
            }
            CHECK(t, total <= sf.size, "it %d: tensor bytes exceed the file", it);
            st_close(&sf);
        } else if (!starts_with_path(err, path)) {
            CHECK(t, 0, "it %d: message '%s'", it, err);
        }
    }
    CHECK(t, n_ok > 0, "some mutations stay valid (%d)", n_ok);
    free(buf);
    free(src);
}

// ----------------------------------------------------------------------------
// sharded checkpoints

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

// Write `names` (F32 vectors of 2 values: {k, k + 0.5} with k the tensor's global index) to path.
static void write_shard(TestCtx* t, const char* dir, const char* file, const char* const* names,
                        int n, float (*vals)[2]) {
    char path[600], err[ERR_LEN];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    const int64_t shape[1] = {2};
    StWriter wr;
    st_writer_init(&wr);
    for (int i = 0; i < n; i++) st_writer_add(&wr, names[i], ST_F32, 1, shape, vals[i]);
    st_writer_meta(&wr, "format", "pt");
    CHECK(t, st_writer_write(&wr, path, err) == 0, "%s", err);
    st_writer_free(&wr);
}

static void write_index(const char* dir, const char* map_json) {
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    char text[1024];
    int n = snprintf(text, sizeof text, "{\"metadata\": {\"total_size\": 24}, \"weight_map\": {%s}}\n",
                     map_json);
    if (n < 0 || n >= (int)sizeof text) fatal("write_index: map too long");
    write_bytes(path, text, (size_t)n);
}

static const char* const MAP_OK =
    "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\"";

// A two-shard checkpoint in tmpdir/<name>; shard2 holds `extra` too when given.
static void make_sharded(TestCtx* t, char* dir, size_t cap, const char* name, const char* map_json,
                         const char* extra, float (*vals)[2]) {
    test_path(t, dir, cap, name);
    make_dir(t, dir);
    const char* s1[2] = {"a", "b"};
    const char* s2[2] = {"c", extra};
    write_shard(t, dir, SHARD1, s1, 2, vals);
    write_shard(t, dir, SHARD2, s2, extra ? 2 : 1, vals + 2);
    write_index(dir, map_json);
}

static void expect_ck_fails(TestCtx* t, const char* path, const char* what, const char* expect) {
    StCheckpoint ck;
    char err[ERR_LEN] = "";
    int rc = st_checkpoint_open(&ck, path, err);
    CHECK(t, rc == -1, "%s: should fail", what);
    if (rc == 0) {
        st_checkpoint_close(&ck);
        return;
    }
    CHECK(t, strstr(err, expect) != NULL && strchr(err, '\n') == NULL, "%s: '%s' lacks '%s'", what,
          err, expect);
    CHECK(t, ck.files == NULL && ck.tensors == NULL, "%s: checkpoint cleared", what);
}

static void test_safetensors_sharded(TestCtx* t) {
    float vals[4][2] = {{0, 0.5f}, {1, 1.5f}, {2, 2.5f}, {3, 3.5f}};
    char dir[512], path[600], err[ERR_LEN] = "";
    make_sharded(t, dir, sizeof dir, "ck_ok", MAP_OK, NULL, vals);

    for (int via = 0; via < 2; via++) {
        if (via == 0) snprintf(path, sizeof path, "%s", dir);
        else snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        StCheckpoint ck;
        int rc = st_checkpoint_open(&ck, path, err);
        CHECK(t, rc == 0, "open via %s: %s", via ? "index" : "directory", err);
        if (rc != 0) continue;
        CHECK(t, ck.n_files == 2 && ck.n_tensors == 3, "files %d tensors %d", ck.n_files,
              ck.n_tensors);
        const char* names[3] = {"a", "b", "c"};
        for (int i = 0; i < 3 && i < ck.n_tensors; i++) {
            CHECK(t, strcmp(ck.tensors[i]->name, names[i]) == 0, "sorted: %s", ck.tensors[i]->name);
            const StTensor* tt = st_checkpoint_find(&ck, names[i]);
            float out[2];
            CHECK(t, tt && st_tensor_to_f32(tt, out, 2, err) == 0 && out[0] == vals[i][0] &&
                         out[1] == vals[i][1],
                  "tensor %s data", names[i]);
            CHECK(t, tt && strstr(tt->file, i < 2 ? SHARD1 : SHARD2) != NULL, "tensor %s file %s",
                  names[i], tt ? tt->file : "?");
        }
        CHECK(t, st_checkpoint_find(&ck, "d") == NULL, "absent tensor");
        st_checkpoint_close(&ck);
    }

    // A plain .safetensors path, and a directory holding only model.safetensors.
    snprintf(path, sizeof path, "%s/%s", dir, SHARD2);
    StCheckpoint ck;
    int rc = st_checkpoint_open(&ck, path, err);
    CHECK(t, rc == 0 && ck.n_files == 1 && ck.n_tensors == 1, "single file: %s", err);
    if (rc == 0) st_checkpoint_close(&ck);
    char single[512];
    test_path(t, single, sizeof single, "ck_single");
    make_dir(t, single);
    const char* one[1] = {"w"};
    write_shard(t, single, "model.safetensors", one, 1, vals);
    rc = st_checkpoint_open(&ck, single, err);
    CHECK(t, rc == 0 && ck.n_tensors == 1 && st_checkpoint_find(&ck, "w"), "single dir: %s", err);
    if (rc == 0) st_checkpoint_close(&ck);

    // Failures.
    test_path(t, path, sizeof path, "ck_empty");
    make_dir(t, path);
    expect_ck_fails(t, path, "empty directory", "neither");

    make_sharded(t, dir, sizeof dir, "ck_missing",
                 "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\", "
                 "\"d\": \"model-00003-of-00003.safetensors\"",
                 NULL, vals);
    expect_ck_fails(t, dir, "missing shard",
                    "model-00003-of-00003.safetensors (holding tensor 'd') does not exist");

    make_sharded(t, dir, sizeof dir, "ck_wrong",
                 "\"a\": \"" SHARD1 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD1 "\"", NULL, vals);
    // c is in shard 2, which the map never names: c is reported as missing from shard 1
    expect_ck_fails(t, dir, "tensor in the wrong shard", "'c' is mapped to shard " SHARD1);

    make_sharded(t, dir, sizeof dir, "ck_wrong2",
                 "\"a\": \"" SHARD2 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\"", NULL, vals);
    expect_ck_fails(t, dir, "tensor in the wrong (opened) shard", "'a' is mapped to shard " SHARD2
                                                                 " but is in");

    make_sharded(t, dir, sizeof dir, "ck_twice", MAP_OK, "a", vals);
    expect_ck_fails(t, dir, "tensor in two shards",
                    ".safetensors: tensor 'a' appears in two shards (also in ");

    make_sharded(t, dir, sizeof dir, "ck_unmapped", MAP_OK, "d", vals);
    expect_ck_fails(t, dir, "tensor missing from the map", "'d' in shard");

    make_sharded(t, dir, sizeof dir, "ck_slash",
                 "\"a\": \"../" SHARD1 "\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\"", NULL,
                 vals);
    expect_ck_fails(t, dir, "shard name with ..", "invalid shard file name");
    write_index(dir, "\"a\": \"sub/x.safetensors\", \"b\": \"" SHARD1 "\", \"c\": \"" SHARD2 "\"");
    expect_ck_fails(t, dir, "shard name with /", "invalid shard file name");
    write_index(dir, "\"a\": 1");
    expect_ck_fails(t, dir, "shard name not a string", "not a string");
    write_index(dir, "");
    expect_ck_fails(t, dir, "empty weight_map", "empty");
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    write_text(path, "{\"metadata\": {}}");
    expect_ck_fails(t, path, "no weight_map", "weight_map");
    write_text(path, "{\"weight_map\": {\"a\": \"x\"},}");
    expect_ck_fails(t, path, "bad index JSON", "at byte");
    test_path(t, path, sizeof path, "nope.json");
    expect_ck_fails(t, path, "missing index", "cannot open");
}

const TestCase tests_safetensors[] = {
    {"safetensors_roundtrip", test_safetensors_roundtrip},
    {"safetensors_minimal", test_safetensors_minimal},
    {"safetensors_to_f32", test_safetensors_to_f32},
    {"safetensors_hostile", test_safetensors_hostile},
    {"safetensors_mutation", test_safetensors_mutation},
    {"safetensors_sharded", test_safetensors_sharded},
    {NULL, NULL},
};
