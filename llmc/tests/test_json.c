/*
 * test_json.c — suite `json`: the strict JSON parser and the string escaper.
 *
 * Checks every value kind, escape decoding (incl. surrogate pairs -> UTF-8), exact int64s beyond
 * 2^53, typed getters, a table of malformed documents that must fail with "at byte N: ...", the
 * depth limit, duplicate keys in big objects, and a deterministic mutation loop: mutated
 * documents either fail cleanly or parse into a tree that re-serializes to a fixed point.
 */
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../json.h"
#include "../rng.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

// Parse a buffer of exactly len bytes (malloc'd without a NUL so ASan sees any over-read).
static int parse_exact(const char* text, size_t len, JsonDoc* doc, char* err) {
    char* copy = malloc_check(len);
    memcpy(copy, text, len);
    int rc = json_parse(copy, len, doc, err);
    free(copy);  // the tree must not point into the input
    return rc;
}

// Canonical re-serialization of a tree (test-only; strings may contain NUL bytes).
static void dump_value(FILE* f, const JsonValue* v);

static void dump_string(FILE* f, const char* s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static void dump_value(FILE* f, const JsonValue* v) {
    switch (v->type) {
        case JSON_NULL: fputs("null", f); break;
        case JSON_BOOL: fputs(v->boolean ? "true" : "false", f); break;
        case JSON_NUMBER:
            if (v->is_integer) fprintf(f, "%lld", (long long)v->integer);
            else fprintf(f, "%.17g", v->number);
            break;
        case JSON_STRING: dump_string(f, v->str, v->str_len); break;
        case JSON_ARRAY:
            fputc('[', f);
            for (size_t i = 0; i < v->n; i++) {
                if (i) fputc(',', f);
                dump_value(f, &v->items[i]);
            }
            fputc(']', f);
            break;
        case JSON_OBJECT:
            fputc('{', f);
            for (size_t i = 0; i < v->n; i++) {
                if (i) fputc(',', f);
                dump_string(f, v->keys[i], v->key_lens[i]);
                fputc(':', f);
                dump_value(f, &v->items[i]);
            }
            fputc('}', f);
            break;
    }
}

static char* dump_doc(const JsonDoc* doc, size_t* len) {
    char* buf = NULL;
    FILE* f = open_memstream(&buf, len);
    dump_value(f, &doc->root);
    fclose(f);
    return buf;
}

static int starts_with(const char* s, const char* prefix) {
    return strncmp(s, prefix, strlen(prefix)) == 0;
}

// ----------------------------------------------------------------------------
// well-formed documents

static void test_json_values(TestCtx* t) {
    const char* text =
        " {\"a\": 1, \"b\": -2.5e3, \"c\": \"x\\\"y\\\\z\\/\\b\\f\\n\\r\\t\",\n"
        "  \"d\": [true, false, null], \"e\": {\"f\": {\"g\": []}}, \"h\": {},\n"
        "  \"big\": 9007199254740993, \"min\": -9223372036854775808,\n"
        "  \"max\": 9223372036854775807, \"over\": 9223372036854775808, \"neg0\": -0,\n"
        "  \"frac\": 0.125, \"exp\": 1E2, \"u\": \"\\u00e9\\u20AC\\ud83d\\ude00\\u0041\",\n"
        "  \"raw\": \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\",\n"
        "  \"nul\": \"a\\u0000b\", \"\": 7} \r\n\t";
    JsonDoc doc;
    char err[ERR_LEN] = "";
    int rc = parse_exact(text, strlen(text), &doc, err);
    CHECK(t, rc == 0, "parse failed: %s", err);
    if (rc != 0) return;
    const JsonValue* r = &doc.root;
    CHECK(t, r->type == JSON_OBJECT && r->n == 17, "root: type %d n %zu", r->type, r->n);
    // document order is kept
    const char* order[] = {"a", "b", "c", "d", "e", "h", "big", "min", "max", "over", "neg0",
                           "frac", "exp", "u", "raw", "nul"};
    for (int i = 0; i < 16 && (size_t)i < r->n; i++)
        CHECK(t, strcmp(r->keys[i], order[i]) == 0, "key %d is %s", i, r->keys[i]);

    const JsonValue* a = json_get(r, "a");
    CHECK(t, a && a->type == JSON_NUMBER && a->is_integer && a->integer == 1 && a->number == 1.0,
          "a");
    const JsonValue* b = json_get(r, "b");
    CHECK(t, b && !b->is_integer && b->number == -2500.0, "b");
    const JsonValue* c = json_get(r, "c");
    CHECK(t, c && c->type == JSON_STRING && c->str_len == 11 &&
                 memcmp(c->str, "x\"y\\z/\b\f\n\r\t", 12) == 0,
          "c escapes decode");
    const JsonValue* d = json_get(r, "d");
    CHECK(t, d && d->type == JSON_ARRAY && d->n == 3, "d array");
    if (d && d->n == 3) {
        CHECK(t, d->items[0].type == JSON_BOOL && d->items[0].boolean == 1, "true");
        CHECK(t, d->items[1].type == JSON_BOOL && d->items[1].boolean == 0, "false");
        CHECK(t, d->items[2].type == JSON_NULL, "null");
    }
    const JsonValue* g = json_get(json_get(json_get(r, "e"), "f"), "g");
    CHECK(t, g && g->type == JSON_ARRAY && g->n == 0, "nested e.f.g");
    const JsonValue* h = json_get(r, "h");
    CHECK(t, h && h->type == JSON_OBJECT && h->n == 0, "empty object");

    // exactness beyond 2^53 (a double would round 9007199254740993 to ...992)
    const JsonValue* big = json_get(r, "big");
    CHECK(t, big && big->is_integer && big->integer == 9007199254740993LL, "big exact");
    const JsonValue* mn = json_get(r, "min");
    CHECK(t, mn && mn->is_integer && mn->integer == INT64_MIN, "int64 min");
    const JsonValue* mx = json_get(r, "max");
    CHECK(t, mx && mx->is_integer && mx->integer == INT64_MAX, "int64 max");
    const JsonValue* over = json_get(r, "over");
    CHECK(t, over && !over->is_integer && over->number == 9223372036854775808.0,
          "2^63 does not fit int64 but is a number");
    const JsonValue* neg0 = json_get(r, "neg0");
    CHECK(t, neg0 && neg0->is_integer && neg0->integer == 0, "-0");
    double frac = 0, e2 = 0;
    CHECK(t, json_get_double(r, "frac", &frac) == 1 && frac == 0.125, "frac");
    CHECK(t, json_get_double(r, "exp", &e2) == 1 && e2 == 100.0, "1E2");
    CHECK(t, !json_get(r, "exp")->is_integer, "1E2 is not an integer literal");

    // \u escapes and surrogate pairs decode to the same UTF-8 as the raw bytes
    const JsonValue* u = json_get(r, "u");
    const JsonValue* raw = json_get(r, "raw");
    const char* u_want = "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80" "A";  // e-acute, euro, emoji, A
    CHECK(t, u && u->str_len == 10 && memcmp(u->str, u_want, 10) == 0, "\\u decoding");
    CHECK(t, raw && raw->str_len == 9 && memcmp(raw->str, u->str, 9) == 0, "raw UTF-8 kept");
    const JsonValue* nul = json_get(r, "nul");
    CHECK(t, nul && nul->str_len == 3 && memcmp(nul->str, "a\0b", 4) == 0, "embedded NUL");
    CHECK(t, json_get(r, "") && json_get(r, "")->integer == 7, "empty key");
    CHECK(t, json_get(r, "zz") == NULL && json_get(a, "a") == NULL, "missing / non-object");
    json_free(&doc);
    CHECK(t, doc.arena == NULL, "json_free clears the doc");

    // top-level scalars are JSON texts too (RFC 8259)
    const char* scalars[] = {"42", " \"s\" ", "true", "null", " [ ] ", "-1.5e-3"};
    for (int i = 0; i < 6; i++) {
        rc = parse_exact(scalars[i], strlen(scalars[i]), &doc, err);
        CHECK(t, rc == 0, "scalar %s: %s", scalars[i], err);
        if (rc == 0) json_free(&doc);
    }
}

static void test_json_getters(TestCtx* t) {
    const char* text = "{\"i\": 12, \"f\": 1.5, \"s\": \"str\", \"b\": true, \"n\": null, "
                       "\"o\": {}, \"big\": 1e300}";
    JsonDoc doc;
    char err[ERR_LEN];
    if (json_parse(text, strlen(text), &doc, err) != 0) {
        CHECK(t, 0, "parse: %s", err);
        return;
    }
    const JsonValue* r = &doc.root;
    int64_t i = -1;
    double d = -1;
    int b = -1;
    const char* s = NULL;
    CHECK(t, json_get_int(r, "i", &i) == 1 && i == 12, "int found");
    CHECK(t, json_get_int(r, "f", &i) == -1, "int from 1.5 is a type error");
    CHECK(t, json_get_int(r, "s", &i) == -1, "int from string");
    CHECK(t, json_get_int(r, "big", &i) == -1, "int from 1e300");
    CHECK(t, json_get_int(r, "missing", &i) == 0 && i == 12, "int missing leaves out alone");
    CHECK(t, json_get_int(r, "n", &i) == 0, "null counts as missing");
    CHECK(t, json_get_double(r, "i", &d) == 1 && d == 12.0, "double accepts integers");
    CHECK(t, json_get_double(r, "f", &d) == 1 && d == 1.5, "double");
    CHECK(t, json_get_double(r, "b", &d) == -1, "double from bool");
    CHECK(t, json_get_double(r, "x", &d) == 0, "double missing");
    CHECK(t, json_get_bool(r, "b", &b) == 1 && b == 1, "bool");
    CHECK(t, json_get_bool(r, "i", &b) == -1, "bool from int");
    CHECK(t, json_get_bool(r, "x", &b) == 0, "bool missing");
    CHECK(t, json_get_string(r, "s", &s) == 1 && strcmp(s, "str") == 0, "string");
    CHECK(t, json_get_string(r, "o", &s) == -1, "string from object");
    CHECK(t, json_get_string(r, "n", &s) == 0, "string null");
    CHECK(t, json_get_int(json_get(r, "s"), "i", &i) == 0, "getter on a non-object");
    json_free(&doc);
}

// ----------------------------------------------------------------------------
// malformed documents

typedef struct BadDoc {
    const char* text;
    size_t len;  // 0: strlen(text)
    const char* expect;  // substring of the error message (NULL: any)
} BadDoc;

static void test_json_malformed(TestCtx* t) {
    static const BadDoc bad[] = {
        {"", 0, "at byte 0:"},
        {"   ", 0, "end of input"},
        {"{", 0, NULL},
        {"[1,2", 0, NULL},
        {"{\"a\":1", 0, NULL},
        {"{\"a\"", 0, "':'"},
        {"\"abc", 0, "unterminated"},
        {"\"abc\\\"", 0, "unterminated"},
        {"tru", 0, NULL},
        {"nul", 0, NULL},
        {"truex", 0, NULL},
        {"[1,]", 0, "at byte 3:"},
        {"{\"a\":1,}", 0, NULL},
        {"{,}", 0, NULL},
        {"[,1]", 0, NULL},
        {"1 2", 0, "at byte 2:"},
        {"{} x", 0, NULL},
        {"[1]]", 0, NULL},
        {"01", 0, "leading zero"},
        {"-01", 0, "leading zero"},
        {"[00]", 0, "leading zero"},
        {"-", 0, NULL},
        {"1.", 0, NULL},
        {".5", 0, NULL},
        {"1e", 0, NULL},
        {"1e+", 0, NULL},
        {"+1", 0, NULL},
        {"0x10", 0, NULL},
        {"NaN", 0, NULL},
        {"-Infinity", 0, NULL},
        {"[1e999]", 0, "out of range"},
        {"\"\\x\"", 0, "invalid escape"},
        {"\"\\u12\"", 0, "\\u"},
        {"\"\\uZZZZ\"", 0, "\\u"},
        {"\"\\ud800\"", 0, "surrogate"},
        {"\"\\udc00\"", 0, "surrogate"},
        {"\"\\ud800\\u0041\"", 0, "surrogate"},
        {"\"\\ud800x\"", 0, "surrogate"},
        {"\"a\tb\"", 0, "control"},
        {"\"a\nb\"", 0, "control"},
        {"\"\x01\"", 0, "control"},
        {"\"\xff\"", 0, "UTF-8"},
        {"\"\xc0\x80\"", 0, "UTF-8"},          // overlong NUL
        {"\"\xed\xa0\x80\"", 0, "UTF-8"},      // UTF-8-encoded surrogate
        {"\"\xf4\x90\x80\x80\"", 0, "UTF-8"},  // above U+10FFFF
        {"\"\xe2\x82\"", 0, "UTF-8"},          // truncated sequence
        {"{\"a\":1,\"a\":2}", 0, "at byte 7: duplicate key \"a\""},
        {"{\"a\":{\"b\":1,\"c\":2,\"b\":3}}", 0, "duplicate key \"b\""},
        {"{1:2}", 0, "string key"},
        {"{\"a\" 1}", 0, NULL},
        {"{\"a\":}", 0, NULL},
        {"[true false]", 0, NULL},
        {"'a'", 0, NULL},
        {"/*c*/1", 0, NULL},
        {"\xef\xbb\xbf{}", 0, NULL},  // BOM
        {"{}\0", 3, "byte 0x00"},
        {"[1,\0]", 5, NULL},
    };
    const int n = (int)(sizeof bad / sizeof bad[0]);
    for (int i = 0; i < n; i++) {
        size_t len = bad[i].len ? bad[i].len : strlen(bad[i].text);
        JsonDoc doc;
        char err[ERR_LEN] = "";
        int rc = parse_exact(bad[i].text, len, &doc, err);
        CHECK(t, rc == -1, "case %d (%s) should fail", i, bad[i].text);
        if (rc == 0) {
            json_free(&doc);
            continue;
        }
        CHECK(t, starts_with(err, "at byte ") && strchr(err, '\n') == NULL,
              "case %d: message '%s'", i, err);
        if (bad[i].expect)
            CHECK(t, strstr(err, bad[i].expect) != NULL, "case %d: '%s' lacks '%s'", i, err,
                  bad[i].expect);
        CHECK(t, doc.arena == NULL, "case %d: doc cleared on failure", i);
    }
}

static void test_json_depth(TestCtx* t) {
    char buf[2 * (JSON_MAX_DEPTH + 1) + 8];
    for (int depth = JSON_MAX_DEPTH; depth <= JSON_MAX_DEPTH + 1; depth++) {
        // alternate arrays and objects: [{"k":[{"k":...}]}]
        size_t o = 0;
        char text[16 * (JSON_MAX_DEPTH + 2)];
        for (int i = 0; i < depth; i++)
            o += (size_t)sprintf(text + o, "%s", i % 2 ? "{\"k\":" : "[");
        o += (size_t)sprintf(text + o, "1");
        for (int i = depth - 1; i >= 0; i--) text[o++] = i % 2 ? '}' : ']';
        JsonDoc doc;
        char err[ERR_LEN] = "";
        int rc = parse_exact(text, o, &doc, err);
        if (depth <= JSON_MAX_DEPTH) {
            CHECK(t, rc == 0, "depth %d should parse: %s", depth, err);
            if (rc == 0) json_free(&doc);
        } else {
            CHECK(t, rc == -1 && strstr(err, "nesting") != NULL, "depth %d: '%s'", depth, err);
        }
    }
    // A long run of '[' must fail by the limit, not by running out of stack.
    memset(buf, '[', sizeof buf);
    JsonDoc doc;
    char err[ERR_LEN] = "";
    CHECK(t, parse_exact(buf, sizeof buf, &doc, err) == -1 && strstr(err, "nesting"), "%s", err);
}

// Thousands of keys (a big safetensors header): duplicates are still found, quickly.
static void test_json_many_keys(TestCtx* t) {
    const int n = 20000;
    char* text = malloc_check((size_t)n * 32 + 64);
    for (int dup = 0; dup <= 1; dup++) {
        size_t o = 0;
        text[o++] = '{';
        for (int i = 0; i < n; i++)
            o += (size_t)sprintf(text + o, "%s\"k%05d\":%d", i ? "," : "",
                                 (dup && i == n - 1) ? 123 : i, i);
        text[o++] = '}';
        JsonDoc doc;
        char err[ERR_LEN] = "";
        double t0 = time_now_s();
        int rc = parse_exact(text, o, &doc, err);
        double dt = time_now_s() - t0;
        CHECK(t, dt < 1.0, "parsing %d keys took %.3fs", n, dt);
        if (!dup) {
            CHECK(t, rc == 0 && doc.root.n == (size_t)n, "parse: %s", err);
            int64_t v = -1;
            CHECK(t, rc == 0 && json_get_int(&doc.root, "k19999", &v) == 1 && v == 19999,
                  "lookup last key");
            if (rc == 0) json_free(&doc);
        } else {
            CHECK(t, rc == -1 && strstr(err, "duplicate key \"k00123\""), "dup: '%s'", err);
        }
    }
    free(text);
}

// ----------------------------------------------------------------------------
// escaping

static void test_json_escape(TestCtx* t) {
    const char* s = "a\"b\\c\n\t\x01\x1f/\xc3\xa9";
    char buf[128];
    size_t n = json_escape(buf, sizeof buf, s);
    const char* want = "\"a\\\"b\\\\c\\n\\t\\u0001\\u001f/\xc3\xa9\"";
    CHECK(t, n == strlen(want) && strcmp(buf, want) == 0, "escaped: %s", buf);

    // json_write_string produces the same bytes
    char* mem = NULL;
    size_t mlen = 0;
    FILE* f = open_memstream(&mem, &mlen);
    json_write_string(f, s);
    fclose(f);
    CHECK(t, mlen == n && memcmp(mem, buf, n) == 0, "write_string: %s", mem);
    free(mem);

    // and it parses back to the original
    JsonDoc doc;
    char err[ERR_LEN] = "";
    CHECK(t, json_parse(buf, n, &doc, err) == 0 && doc.root.type == JSON_STRING &&
                 strcmp(doc.root.str, s) == 0,
          "roundtrip: %s", err);
    json_free(&doc);

    // truncation: NUL-terminated, quoted, never splits an escape sequence
    for (size_t cap = 0; cap < 40; cap++) {
        char small[40];
        memset(small, 'Z', sizeof small);
        size_t m = json_escape(small, cap, s);
        CHECK(t, cap == 0 || (m < cap && small[m] == '\0'), "cap %zu: %zu", cap, m);
        if (cap >= 3) {
            CHECK(t, small[0] == '"' && small[m - 1] == '"', "cap %zu: quoted: %s", cap, small);
            JsonDoc d2;
            CHECK(t, json_parse(small, m, &d2, err) == 0, "cap %zu: '%s' parses: %s", cap, small,
                  err);
            if (d2.arena) json_free(&d2);
        }
        int untouched = 1;  // nothing written past the NUL
        for (size_t k = cap == 0 ? 0 : m + 1; k < sizeof small; k++) untouched &= small[k] == 'Z';
        CHECK(t, untouched, "cap %zu: wrote past the terminator", cap);
    }
}

// ----------------------------------------------------------------------------
// mutation loop: must never crash; successful parses re-serialize to a fixed point

static void test_json_mutation(TestCtx* t) {
    static const char* seeds[] = {
        "{\"model.layers.0.self_attn.q_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[4096,4096],"
        "\"data_offsets\":[0,33554432]},\"__metadata__\":{\"format\":\"pt\"}}",
        "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":2048,\"rms_norm_eps\":1e-05,"
        "\"rope_scaling\":{\"factor\":32.0,\"rope_type\":\"llama3\"},\"tie_word_embeddings\":true,"
        "\"bos\":null,\"eos\":[128001,128008,128009]}",
        "[\"\\u00e9\\ud83d\\ude00\\n\\\"\", -0.5e-3, 9007199254740993, [[[]]], {\"\":{}}, "
        "\"\xc3\xa9\xe2\x82\xac\", false]",
    };
    static const char specials[] = "{}[]\",:\\u0123456789eE.-+ tfnrl\x00\x80\xc3\xed\xff";
    const int n_seeds = 3;
    Rng rng;
    rng_seed(&rng, 1234);
    int n_ok = 0, n_fail = 0;
    char* buf = malloc_check(4096);
    for (int seed = 0; seed < n_seeds; seed++) {
        JsonDoc doc;
        char err[ERR_LEN] = "";
        CHECK(t, json_parse(seeds[seed], strlen(seeds[seed]), &doc, err) == 0, "seed %d: %s",
              seed, err);
        json_free(&doc);
    }
    for (int it = 0; it < 20000; it++) {
        const char* src = seeds[rng_below(&rng, n_seeds)];
        size_t len = strlen(src);
        memcpy(buf, src, len);
        int n_mut = 1 + (int)rng_below(&rng, 3);
        for (int m = 0; m < n_mut; m++) {
            int kind = (int)rng_below(&rng, 5);
            size_t pos = len ? (size_t)rng_below(&rng, len) : 0;
            char c = rng_below(&rng, 4) == 0 ? (char)rng_below(&rng, 256)
                                             : specials[rng_below(&rng, sizeof specials - 1)];
            if (kind == 0 && len > 0) {  // replace a byte
                buf[pos] = c;
            } else if (kind == 1 && len > 0) {  // delete a byte
                memmove(buf + pos, buf + pos + 1, len - pos - 1);
                len--;
            } else if (kind == 2 && len < 2000) {  // insert a byte
                memmove(buf + pos + 1, buf + pos, len - pos);
                buf[pos] = c;
                len++;
            } else if (kind == 3) {  // truncate
                len = pos;
            } else if (len > 0 && len < 2000) {  // duplicate a range
                size_t span = 1 + (size_t)rng_below(&rng, len - pos < 40 ? len - pos : 40);
                memmove(buf + pos + span, buf + pos, len - pos);
                len += span;
            }
        }
        JsonDoc doc;
        char err[ERR_LEN] = "";
        if (parse_exact(buf, len, &doc, err) == 0) {
            n_ok++;
            size_t l1, l2;
            char* s1 = dump_doc(&doc, &l1);
            json_free(&doc);
            JsonDoc again;
            int rc = json_parse(s1, l1, &again, err);
            CHECK(t, rc == 0, "it %d: re-serialized text does not parse: %s", it, err);
            if (rc == 0) {
                char* s2 = dump_doc(&again, &l2);
                CHECK(t, l1 == l2 && memcmp(s1, s2, l1) == 0, "it %d: not a fixed point", it);
                free(s2);
                json_free(&again);
            }
            free(s1);
        } else {
            n_fail++;
            if (!starts_with(err, "at byte ")) CHECK(t, 0, "it %d: message '%s'", it, err);
        }
    }
    free(buf);
    CHECK(t, n_ok > 100 && n_fail > 1000, "mutations: %d parsed, %d rejected", n_ok, n_fail);
}

const TestCase tests_json[] = {
    {"json_values", test_json_values},
    {"json_getters", test_json_getters},
    {"json_malformed", test_json_malformed},
    {"json_depth", test_json_depth},
    {"json_many_keys", test_json_many_keys},
    {"json_escape", test_json_escape},
    {"json_mutation", test_json_mutation},
    {NULL, NULL},
};
