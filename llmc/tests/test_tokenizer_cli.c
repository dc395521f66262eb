/*
 * test_tokenizer_cli.c — the tokenizer through ./train_roundpipe (listed in tests_tokenizer of
 * test_tokenizer.c):
 *  - `--tokenize IN... --tokenizer FILE --out-shards PREFIX --val-frac X` is the shard tool (the
 *    same shards as tokenize_shards_run), with its help and its errors;
 *  - a model with a tokenizer (tiny random configs beside the fixture tokenizers of
 *    dev/tokenizer/fixtures) encodes --prompt with it and prints the sample decoded; the HF export
 *    copies its tokenizer files, the GGUF export carries it as tokenizer.ggml.* records (padded to
 *    the model's vocabulary), and that GGUF, trained from, samples the same text and exports a
 *    tokenizer.json that encodes as the fixture does;
 *  - a tokenizer larger than the model's vocabulary is one clear error; byte-level models keep
 *    their prompt as bytes; other models without a tokenizer say that --prompt needs one.
 */
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../dataloader.h"
#include "../gguf.h"
#include "../tokenize_shards.h"
#include "../tokenizer.h"
#include "testing.h"

// Inputs the exported tokenizers must encode as the fixture does (scripts, emoji, whitespace
// runs, numbers, code, special tokens, invalid UTF-8).
static const char* const SAMPLE_TEXTS[] = {
    "Hello world, this is a tiny document.",
    "日本語のテキストと中文，한국어도 있어요.",
    "emoji 👩‍👩‍👧 ok 🎉!!",
    "  spaces\n\n\tand\ttabs   \n",
    "numbers 1234567 and 3.14159; code: if (x) { return y; }",
    "<|im_start|>user\nhi there<|im_end|>\n<|begin_of_text|><|eot_id|>",
    "caf\xc3\xa9 cafe\xcc\x81 \xff\xfe bad bytes \xc3",
    NULL,
};

static int count_lines(const char* s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static void copy_file(TestCtx* t, const char* from, const char* to) {
    char err[ERR_LEN];
    size_t len;
    char* s = test_read_file(from, &len);
    CHECK(t, len > 0 && file_write_atomic(to, s, len, err) == 0, "copy %s -> %s", from, to);
    free(s);
}

// Do a and b encode every sample text to the same ids?
static int same_encodings(const Tokenizer* a, const Tokenizer* b) {
    int same = 1;
    for (int i = 0; SAMPLE_TEXTS[i] && same; i++) {
        TokIds x = {0}, y = {0};
        tokenizer_encode_once(a, SAMPLE_TEXTS[i], strlen(SAMPLE_TEXTS[i]), 0, &x);
        tokenizer_encode_once(b, SAMPLE_TEXTS[i], strlen(SAMPLE_TEXTS[i]), 0, &y);
        same = x.n == y.n && x.n > 0 && memcmp(x.ids, y.ids, x.n * sizeof(int32_t)) == 0;
        tokenizer_ids_free(&x);
        tokenizer_ids_free(&y);
    }
    return same;
}

// The printed sample of a run's stdout: from "sample (" to the next "\nexported" (or the end).
static char* sample_text(const char* out) {
    const char* s = strstr(out, "sample (");
    if (!s) return calloc_check(1, 1);
    const char* e = strstr(s, "\nexported");
    size_t n = e ? (size_t)(e - s) : strlen(s);
    char* r = malloc_check(n + 1);
    memcpy(r, s, n);
    r[n] = '\0';
    return r;
}

// ----------------------------------------------------------------------------
// --tokenize

void test_tokenizer_cli_tool(TestCtx* t) {
    char txt[1024], jsonl[1024], prefix[1024], api_prefix[1024], args[8192], err[ERR_LEN];
    const char* fixture = "dev/tokenizer/fixtures/qwen3.json";
    test_path(t, txt, sizeof txt, "cli_doc.txt");
    test_path(t, jsonl, sizeof jsonl, "cli_docs.jsonl");
    test_path(t, prefix, sizeof prefix, "cli_shards/q");
    test_path(t, api_prefix, sizeof api_prefix, "api_shards/q");
    const char* doc0 = "The first document: one whole .txt file.\nWith two lines.\n";
    CHECK(t, file_write_atomic(txt, doc0, strlen(doc0), err) == 0, "%s", err);
    const char* lines = "{\"text\": \"Hello world, this is a tiny document.\"}\n"
                        "{\"text\": \"\\u65e5\\u672c\\u8a9e \\ud83d\\ude00 and 12345\"}\n"
                        "{\"text\": \"<|im_start|>user\\nhi<|im_end|>\"}\n"
                        "{\"text\": \"numbers 3.14159; code: if (x) { return y; }\"}\n";
    CHECK(t, file_write_atomic(jsonl, lines, strlen(lines), err) == 0, "%s", err);

    // the tool through the main binary, then the same through the API: the same shards
    snprintf(args, sizeof args,
             "--tokenize '%s' '%s' --tokenizer %s --out-shards '%s' --val-frac 0.4 --threads 2",
             txt, jsonl, fixture, prefix);
    int rc = test_run_cli(t, "tok_tool", args);
    char* out = test_read_output(t, "tok_tool", "out");
    CHECK(t, rc == 0 && strstr(out, "5 documents"), "--tokenize exit %d: %s", rc, out);
    free(out);
    char fixture_path[1024];
    snprintf(fixture_path, sizeof fixture_path, "%s/%s", t->exe_dir, fixture);
    TokenizeShardsArgs a;
    tokenize_shards_defaults(&a);
    const char* inputs[2] = {txt, jsonl};
    a.inputs = inputs;
    a.n_inputs = 2;
    a.tokenizer = fixture_path;
    a.out_prefix = api_prefix;
    a.val_frac = 0.4;
    a.threads = 2;
    a.quiet = 1;
    TokenizeShardsStats st;
    CHECK(t, tokenize_shards_run(&a, NULL, &st, err) == 0, "%s", err);
    CHECK(t, st.n_val_shards == 1 && st.n_train_shards == 1 && st.val_docs > 0,
          "one val and one train shard, val documents %lld", (long long)st.val_docs);
    const char* names[2] = {"_train_000001.bin", "_val_000000.bin"};
    for (int k = 0; k < 2; k++) {
        char p1[1100], p2[1100];
        snprintf(p1, sizeof p1, "%s%s", prefix, names[k]);
        snprintf(p2, sizeof p2, "%s%s", api_prefix, names[k]);
        size_t n1, n2;
        char* b1 = test_read_file(p1, &n1);
        char* b2 = test_read_file(p2, &n2);
        CHECK(t, n1 > 1024 && n1 == n2 && memcmp(b1, b2, n1) == 0, "%s == %s", p1, p2);
        // the first document goes to train: the document token, then the .txt file's ids
        if (k == 0 && n1 > 1024) {
            Tokenizer tok;
            CHECK(t, tokenizer_load(&tok, fixture_path, err) == 0, "%s", err);
            TokIds ids = {0};
            tokenizer_encode_once(&tok, doc0, strlen(doc0), 0, &ids);
            const uint16_t* s = (const uint16_t*)(b1 + 1024);
            int ok = (n1 - 1024) / 2 > ids.n && s[0] == tokenizer_document_token(&tok);
            for (size_t i = 0; ok && i < ids.n; i++) ok = s[1 + i] == ids.ids[i];
            CHECK(t, ok, "train shard starts with <doc> + the ids of %s", txt);
            tokenizer_ids_free(&ids);
            tokenizer_free(&tok);
        }
        free(b1);
        free(b2);
    }

    // help: the tool's own, and the main binary's lines for it
    rc = test_run_cli(t, "tok_help", "--tokenize --help");
    out = test_read_output(t, "tok_help", "out");
    CHECK(t, rc == 0 && strstr(out, "usage: train_roundpipe --tokenize"), "--tokenize --help: %s",
          out);
    free(out);
    rc = test_run_cli(t, "main_help", "--help");
    out = test_read_output(t, "main_help", "out");
    CHECK(t,
          rc == 0 && strstr(out, "--tokenize IN...") && strstr(out, "--tokenizer FILE") &&
              strstr(out, "--out-shards PREFIX") && strstr(out, "--val-frac X"),
          "--help documents the tool");
    free(out);

    // errors: usage (exit 2) and a bad tokenizer file (exit 1), one line each
    snprintf(args, sizeof args, "--tokenize '%s' --tokenizer %s", txt, fixture);
    rc = test_run_cli(t, "tok_usage", args);
    char* e = test_read_output(t, "tok_usage", "err");
    CHECK(t, rc == 2 && count_lines(e) == 1 && strstr(e, "--out-shards"), "exit %d: %s", rc, e);
    free(e);
    snprintf(args, sizeof args, "--tokenize '%s' --tokenizer README.md --out-shards '%s'", txt,
             prefix);
    rc = test_run_cli(t, "tok_bad", args);
    e = test_read_output(t, "tok_bad", "err");
    CHECK(t, rc == 1 && count_lines(e) == 1 && strstr(e, "README.md"), "exit %d: %s", rc, e);
    free(e);
}

// ----------------------------------------------------------------------------
// a model with a tokenizer: prompt, sample, exports

// dir/config.json: a fixture model's config with vocab_size V; dir/tokenizer.json: the fixture
// tokenizer `style`.
static void make_model_dir(TestCtx* t, const char* dir, const char* family, int V,
                           const char* style) {
    char path[1200], from[1200], err[ERR_LEN];
    CHECK(t, mkdir_p(dir, err) == 0, "%s", err);
    snprintf(from, sizeof from, "%s/dev/parity/fixtures/%s/config.json", t->exe_dir, family);
    char* cfg = test_read_file(from, NULL);
    char* at = strstr(cfg, "\"vocab_size\": 128");
    CHECK(t, at != NULL, "%s has vocab_size 128", from);
    if (!at) {
        free(cfg);
        return;
    }
    char* fixed = malloc_check(strlen(cfg) + 32);
    int head = (int)(at - cfg);
    snprintf(fixed, strlen(cfg) + 32, "%.*s\"vocab_size\": %d%s", head, cfg, V,
             at + strlen("\"vocab_size\": 128"));
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK(t, file_write_atomic(path, fixed, strlen(fixed), err) == 0, "%s", err);
    free(cfg);
    free(fixed);
    snprintf(from, sizeof from, "%s/dev/tokenizer/fixtures/%s.json", t->exe_dir, style);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    copy_file(t, from, path);
}

void test_tokenizer_cli_model(TestCtx* t) {
    const struct {
        const char* style;   // fixture tokenizer
        const char* family;  // fixture model config
        int V;               // the model's vocabulary (the tokenizer's ids and some padding)
        const char* doc;     // the document token's text (qwen3: <|endoftext|>; llama3: BOS)
    } cases[] = {{"qwen3", "qwen3", 912, "<|endoftext|>"},
                 {"llama3", "llama", 1024, "<|begin_of_text|>"}};
    const char* prompt = "Hello <|im_start|>wor";
    for (int c = 0; c < 2; c++) {
        char dir[1024], shard[1024], gg[1024], hf[1024], hf2[1024], args[8192], err[ERR_LEN];
        char name[64], fixture[1200], tag[64];
        snprintf(name, sizeof name, "tm_%s", cases[c].style);
        test_path(t, dir, sizeof dir, name);
        make_model_dir(t, dir, cases[c].family, cases[c].V, cases[c].style);
        snprintf(fixture, sizeof fixture, "%s/dev/tokenizer/fixtures/%s.json", t->exe_dir,
                 cases[c].style);
        Tokenizer fx;
        if (tokenizer_load(&fx, fixture, err) != 0) {
            CHECK(t, 0, "%s", err);
            continue;
        }
        // training data: the sample texts through the fixture tokenizer
        TokIds ids = {0};
        for (int r = 0; r < 40; r++)
            for (int i = 0; SAMPLE_TEXTS[i]; i++) {
                tokenizer_ids_push(&ids, tokenizer_document_token(&fx));
                tokenizer_encode_once(&fx, SAMPLE_TEXTS[i], strlen(SAMPLE_TEXTS[i]), 0, &ids);
            }
        uint32_t* u = malloc_check(ids.n * sizeof(uint32_t));
        for (size_t i = 0; i < ids.n; i++) u[i] = (uint32_t)ids.ids[i];
        snprintf(name, sizeof name, "tm_%s.bin", cases[c].style);
        test_path(t, shard, sizeof shard, name);
        CHECK(t, shard_write(shard, u, (int64_t)ids.n, 2, err) == 0, "%s", err);
        free(u);
        tokenizer_ids_free(&ids);
        snprintf(name, sizeof name, "tm_%s.gguf", cases[c].style);
        test_path(t, gg, sizeof gg, name);
        snprintf(name, sizeof name, "tm_%s_hf", cases[c].style);
        test_path(t, hf, sizeof hf, name);
        snprintf(name, sizeof name, "tm_%s_hf2", cases[c].style);
        test_path(t, hf2, sizeof hf2, name);
        const char* common = "--val '' --batch 4 --seq 32 --threads 2 --sample-tokens 12 "
                             "--temperature 0";

        // 1. train from the config (random init), sample from the prompt, export both ways
        snprintf(args, sizeof args,
                 "--model '%s/config.json' --train '%s' %s --steps 10 --lr 1e-2 --prompt '%s' "
                 "--export-gguf '%s' --export-hf '%s'",
                 dir, shard, common, prompt, gg, hf);
        snprintf(tag, sizeof tag, "tm1_%s", cases[c].style);
        int rc = test_run_cli(t, tag, args);
        char* out = test_read_output(t, tag, "out");
        char want[256], loaded[128];
        snprintf(want, sizeof want, "\n%s%s", cases[c].doc, prompt);
        snprintf(loaded, sizeof loaded, "tokenizer: %d tokens from", fx.n_vocab);
        CHECK(t, rc == 0 && strstr(out, loaded) && strstr(out, want),
              "%s: exit %d, the tokenizer loaded and the prompt printed decoded after the "
              "document token: %s", tag, rc, out);
        char* sample1 = sample_text(out);
        free(out);
        // the HF export copies the source's tokenizer.json as it is
        char p1[1200], p2[1200];
        snprintf(p1, sizeof p1, "%s/tokenizer.json", dir);
        snprintf(p2, sizeof p2, "%s/tokenizer.json", hf);
        size_t n1, n2;
        char* b1 = test_read_file(p1, &n1);
        char* b2 = test_read_file(p2, &n2);
        CHECK(t, n1 > 0 && n1 == n2 && memcmp(b1, b2, n1) == 0, "%s copied verbatim", p2);
        free(b1);
        free(b2);
        // the GGUF export carries the tokenizer, padded to the model's vocabulary
        GgufFile f;
        Tokenizer g;
        rc = gguf_open(&f, gg, err);
        CHECK(t, rc == 0, "%s", err);
        if (rc == 0) {
            rc = tokenizer_load_gguf(&g, &f, err);
            CHECK(t, rc == 0, "%s", err);
            if (rc == 0) {
                CHECK(t, g.n_vocab == cases[c].V && same_encodings(&fx, &g) &&
                             g.bos_id == fx.bos_id && g.eos_id == fx.eos_id,
                      "%s: %d tokens (want %d), the fixture's encodings and special ids", gg,
                      g.n_vocab, cases[c].V);
                tokenizer_free(&g);
            }
            gguf_close(&f);
        }

        // 2. that GGUF as the model: the same prompt ids give the same greedy sample, and the
        //    HF export writes its tokenizer as tokenizer.json + tokenizer_config.json
        snprintf(args, sizeof args,
                 "--model '%s' --train '%s' %s --steps 0 --prompt '%s' --export-hf '%s'", gg,
                 shard, common, prompt, hf2);
        snprintf(tag, sizeof tag, "tm2_%s", cases[c].style);
        rc = test_run_cli(t, tag, args);
        out = test_read_output(t, tag, "out");
        snprintf(loaded, sizeof loaded, "tokenizer: %d tokens from", cases[c].V);
        char* sample2 = sample_text(out);
        CHECK(t, rc == 0 && strstr(out, loaded), "%s: exit %d: %s", tag, rc, out);
        CHECK(t, sample1[0] && strcmp(sample1, sample2) == 0,
              "%s: the GGUF samples as its source did:\n%s\n---\n%s", tag, sample1, sample2);
        free(out);
        free(sample1);
        free(sample2);
        snprintf(p2, sizeof p2, "%s/tokenizer_config.json", hf2);
        CHECK(t, file_exists(p2), "%s written", p2);
        Tokenizer h;
        rc = tokenizer_load(&h, hf2, err);
        CHECK(t, rc == 0, "%s", err);
        if (rc == 0) {
            CHECK(t, same_encodings(&fx, &h) && h.bos_id == fx.bos_id && h.eos_id == fx.eos_id,
                  "%s/tokenizer.json encodes as the fixture", hf2);
            tokenizer_free(&h);
        }
        tokenizer_free(&fx);
    }
}

// A tokenizer larger than the model's vocabulary; models without one.
void test_tokenizer_cli_mismatch(TestCtx* t) {
    char dir[1024], shard[1024], args[8192], err[ERR_LEN];
    test_path(t, dir, sizeof dir, "tm_small");
    make_model_dir(t, dir, "qwen3", 800, "qwen3");  // the tokenizer has 905 ids
    uint32_t toks[600];
    for (int i = 0; i < 600; i++) toks[i] = (uint32_t)((i * 7 + i / 5) % 100);
    test_path(t, shard, sizeof shard, "tm_small.bin");
    CHECK(t, shard_write(shard, toks, 600, 2, err) == 0, "%s", err);
    snprintf(args, sizeof args, "--model '%s/config.json' --train '%s' --val '' --steps 1", dir,
             shard);
    int rc = test_run_cli(t, "tm_small", args);
    char* e = test_read_output(t, "tm_small", "err");
    CHECK(t,
          rc == 1 && count_lines(e) == 1 && strstr(e, "905 tokens") && strstr(e, "800") &&
              strstr(e, "tokenizer.json"),
          "exit %d: %s", rc, e);
    free(e);
    // no tokenizer, not byte-level: the prompt cannot be encoded, and the run says so
    snprintf(args, sizeof args,
             "--model dev/parity/fixtures/qwen3/config.json --train '%s' --val '' --steps 0 "
             "--batch 2 --seq 16 --sample-tokens 3 --prompt hi",
             shard);
    rc = test_run_cli(t, "tm_noprompt", args);
    char* out = test_read_output(t, "tm_noprompt", "out");
    CHECK(t, rc == 0 && strstr(out, "--prompt needs a tokenizer") && !strstr(out, "tokenizer:"),
          "exit %d: %s", rc, out);
    free(out);
    // byte-level: the prompt's bytes after EOT, as before
    rc = test_run_cli(t, "tm_bytes",
                      "--val '' --steps 0 --sample-tokens 2 --prompt '12+3=' --temperature 0");
    out = test_read_output(t, "tm_bytes", "out");
    CHECK(t, rc == 0 && strstr(out, "\n<|eot|>12+3=") && !strstr(out, "tokenizer"),
          "exit %d: %s", rc, out);
    free(out);
}
