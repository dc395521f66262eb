/*
 * test_gguf.c — suite `gguf`: GGUF reading against the fixtures written by the official gguf
 * package (dev/gguf/make_fixtures.py), exports, hostile files and the fuzz smoke run.
 *
 *  - F32 GGUF models load to exactly the weights of the same model from safetensors (LLaMA q/k
 *    un-permuted), F16/BF16 to the rounded values exactly, Q8_0/Q4_0/MXFP4 within quantisation
 *    error; every type of the quantisation zoo equals gguf-py's dequantisation bit for bit;
 *    metadata of every value type (nested arrays, alignment 64) reads back;
 *  - llama3 RoPE parameters are recovered from rope_freqs.weight (and bad ones refused);
 *  - exports (GGUF F32/F16/BF16, HF sharded) re-read to the same weights and tokenizer records,
 *    and through the CLI, --dump-state of the exported models equals the original bit for bit;
 *  - hostile files (truncated, bad magic/version, huge counts and lengths, bad offsets, unknown
 *    types, duplicates, bad shapes, missing tensors, NaN): -1 and one line naming file and field;
 *  - the fuzz smoke run: every committed seed of dev/fuzz/corpus plus deterministic mutations
 *    through the libFuzzer targets' entry points (dev/fuzz/fuzz_entries.h).
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "../../dev/fuzz/fuzz_entries.h"
#include "../checkpoint.h"
#include "../common.h"
#include "../gguf.h"
#include "../model.h"
#include "../rng.h"
#include "../store.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

static const char* fixture(const TestCtx* t, char* buf, size_t cap, const char* name) {
    snprintf(buf, cap, "%s/dev/gguf/fixtures/%s", t->exe_dir, name);
    return buf;
}

static int starts_with_path(const char* err, const char* path) {
    size_t n = strlen(path);
    return strncmp(err, path, n) == 0 && err[n] == ':' && strchr(err, '\n') == NULL;
}

// A model resolved from a spec, with its weights in a store.
typedef struct Loaded {
    ModelSource src;
    Model m;
    Store s;
    int ok;
} Loaded;

static int load_model(TestCtx* t, const char* spec, Loaded* L) {
    char err[ERR_LEN];
    memset(L, 0, sizeof *L);
    if (checkpoint_resolve_model(&L->src, spec, err) != 0) {
        CHECK(t, 0, "resolve %s: %s", spec, err);
        return -1;
    }
    if (model_init(&L->m, &L->src.cfg, 0, err) != 0) {
        CHECK(t, 0, "model_init %s: %s", spec, err);
        checkpoint_close_source(&L->src);
        return -1;
    }
    store_create(&L->s, &L->m.tt);
    int unused = -1;
    int rc = checkpoint_load_weights(&L->src, &L->s, &unused, err);
    CHECK(t, rc == 0 && unused == 0, "load %s: %s (unused %d)", spec, rc ? err : "", unused);
    checkpoint_release_weights(&L->src);
    L->ok = rc == 0;
    return rc;
}

static void unload(Loaded* L) {
    store_free(&L->s);
    model_free(&L->m);
    checkpoint_close_source(&L->src);
}

// CMP_F16/CMP_BF16: matrices rounded (GGUF keeps norms F32); CMP_BF16_ALL: every tensor (HF).
enum { CMP_EXACT, CMP_F16, CMP_BF16, CMP_BF16_ALL, CMP_TOL };

// Compare every owned tensor of b with a's (same table). tol: relative L2 for CMP_TOL (1-D
// tensors are always exact: the converters keep them F32). Returns the worst relative error.
static double compare_stores(TestCtx* t, const Loaded* a, const Loaded* b, int mode, double tol,
                             const char* what) {
    double worst = 0.0;
    CHECK(t, a->m.tt.n == b->m.tt.n, "%s: tensor tables differ", what);
    for (int i = 0; i < a->m.tt.n && i < b->m.tt.n; i++) {
        const TensorDesc* d = &a->m.tt.t[i];
        if (d->tied_to >= 0) continue;
        const float* x = store_param(&a->s, i);
        const float* y = store_param(&b->s, i);
        int bad = 0;
        if (mode == CMP_TOL && d->ndim > 1) {
            double rel = rel_l2_error(y, x, (size_t)d->numel);
            if (rel > worst) worst = rel;
            bad = !(rel <= tol);
            CHECK(t, !bad, "%s: %s rel err %.4g > %.4g", what, d->hf_name, rel, tol);
            continue;
        }
        for (int64_t k = 0; k < d->numel && !bad; k++) {
            float want = x[k];
            if (d->ndim > 1 && mode == CMP_F16) want = f16_to_f32(f32_to_f16(x[k]));
            if ((d->ndim > 1 && mode == CMP_BF16) || mode == CMP_BF16_ALL)
                want = bf16_to_f32(f32_to_bf16(x[k]));
            if (memcmp(&want, &y[k], 4) != 0) {
                bad = 1;
                CHECK(t, 0, "%s: %s[%lld] = %.9g, expected %.9g", what, d->hf_name, (long long)k,
                      (double)y[k], (double)want);
            }
        }
        t->checks++;
    }
    return worst;
}

static void check_same_config(TestCtx* t, const ModelConfig* a, const ModelConfig* b,
                              const char* what) {
    CHECK(t,
          a->family == b->family && a->V == b->V && a->C == b->C && a->L == b->L && a->H == b->H &&
              a->KVH == b->KVH && a->HD == b->HD && a->F == b->F &&
              a->tied_embeddings == b->tied_embeddings && a->qk_norm == b->qk_norm &&
              a->norm_eps == b->norm_eps && a->rope_theta == b->rope_theta &&
              a->rope_type == b->rope_type && a->bos_id == b->bos_id && a->eos_id == b->eos_id,
          "%s: configs differ", what);
    float fa[512], fb[512];
    config_rope_inv_freq(a, fa);
    config_rope_inv_freq(b, fb);
    for (int i = 0; i < a->HD / 2 && i < 512; i++)
        CHECK(t, fabsf(fa[i] - fb[i]) <= 1e-6f * fa[i], "%s: inv_freq[%d] %.9g vs %.9g", what, i,
              (double)fa[i], (double)fb[i]);
}

// ----------------------------------------------------------------------------
// fixtures: GGUF == safetensors

static void test_gguf_fixture_f32_exact(TestCtx* t) {
    const char* models[] = {"llama", "qwen3"};
    for (int k = 0; k < 2; k++) {
        char p1[1024], p2[1024], name[64];
        snprintf(name, sizeof name, "%s_f32.gguf", models[k]);
        Loaded hf, gg;
        if (load_model(t, fixture(t, p1, sizeof p1, models[k]), &hf) != 0) return;
        if (load_model(t, fixture(t, p2, sizeof p2, name), &gg) != 0) {
            unload(&hf);
            return;
        }
        check_same_config(t, &hf.m.cfg, &gg.m.cfg, name);
        compare_stores(t, &hf, &gg, CMP_EXACT, 0, name);
        if (k == 0) {
            // the file really holds permuted rows: raw attn_q differs, permuting HF matches it
            GgufFile f;
            char err[ERR_LEN];
            CHECK(t, gguf_open(&f, p2, err) == 0, "%s", err);
            const GgufTensor* q = gguf_find_tensor(&f, "blk.0.attn_q.weight");
            int qi = tensor_table_index(&hf.m.tt, TK_WQ, 0);
            const TensorDesc* d = &hf.m.tt.t[qi];
            float* raw = malloc_check((size_t)d->numel * 4);
            float* perm = malloc_check((size_t)d->numel * 4);
            CHECK(t, q && gguf_tensor_to_f32(&f, q, raw, d->numel, err) == 0, "%s", err);
            gguf_permute_rows(store_param(&hf.s, qi), perm, hf.m.cfg.H, d->shape[0], d->shape[1],
                              0);
            CHECK(t, memcmp(raw, store_param(&hf.s, qi), (size_t)d->numel * 4) != 0,
                  "attn_q is stored permuted");
            CHECK(t, memcmp(raw, perm, (size_t)d->numel * 4) == 0, "permute(HF q) == GGUF attn_q");
            CHECK(t,
                  gg.m.cfg.rope_type == ROPE_LLAMA3 && gg.m.cfg.rope_factor == 8.0 &&
                      gg.m.cfg.rope_original_max_pos == 256,
                  "llama3 parameters from rope_freqs: factor %g L0 %d", gg.m.cfg.rope_factor,
                  gg.m.cfg.rope_original_max_pos);
            free(raw);
            free(perm);
            gguf_close(&f);
            CHECK(t, gg.src.tokenizer.n_kv == 8, "tokenizer records kept: %lld",
                  (long long)gg.src.tokenizer.n_kv);
        }
        unload(&hf);
        unload(&gg);
    }
}

static void test_gguf_fixture_half_and_quantized(TestCtx* t) {
    struct {
        const char* model;
        const char* file;
        int mode;
        double tol;
    } cases[] = {
        {"llama", "llama_f16.gguf", CMP_F16, 0},     {"llama", "llama_bf16.gguf", CMP_BF16, 0},
        {"llama", "llama_q8_0.gguf", CMP_TOL, 0.01}, {"llama", "llama_q4_0.gguf", CMP_TOL, 0.15},
        {"qwen3", "qwen3_q8_0.gguf", CMP_TOL, 0.01}, {"qwen3", "qwen3_mxfp4.gguf", CMP_TOL, 0.25},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char p1[1024], p2[1024];
        Loaded hf, gg;
        if (load_model(t, fixture(t, p1, sizeof p1, cases[k].model), &hf) != 0) return;
        if (load_model(t, fixture(t, p2, sizeof p2, cases[k].file), &gg) == 0) {
            double worst = compare_stores(t, &hf, &gg, cases[k].mode, cases[k].tol, cases[k].file);
            // quantisation must actually change the weights (else the test proves nothing)
            if (cases[k].mode == CMP_TOL)
                CHECK(t, worst > 1e-4, "%s: worst %.3g", cases[k].file, worst);
            unload(&gg);
        }
        unload(&hf);
    }
}

// Every zoo tensor equals gguf-py's dequantisation exactly; Q2_K is refused by name; metadata of
// every value type reads back.
static void test_gguf_quant_zoo(TestCtx* t) {
    char path[1024], err[ERR_LEN];
    GgufFile f;
    if (gguf_open(&f, fixture(t, path, sizeof path, "quant_zoo.gguf"), err) != 0) {
        CHECK(t, 0, "%s", err);
        return;
    }
    CHECK(t, f.alignment == 64 && f.data_offset % 64 == 0, "alignment %u", f.alignment);
    int pairs = 0;
    for (int64_t i = 0; i < f.n_tensors; i++) {
        const GgufTensor* q = &f.tensors[i];
        CHECK(t, q->offset % 64 == 0, "%s offset %llu", q->name, (unsigned long long)q->offset);
        if (!str_ends_with(q->name, ".q")) continue;
        char ename[GGUF_MAX_NAME + 16];
        snprintf(ename, sizeof ename, "%.*s.expected", (int)(strlen(q->name) - 2), q->name);
        const GgufTensor* e = gguf_find_tensor(&f, ename);
        float* got = malloc_check((size_t)q->numel * 4);
        if (!e) {  // q2_k: readable, refused by name
            int rc = gguf_tensor_to_f32(&f, q, got, q->numel, err);
            CHECK(t,
                  rc == -1 && strstr(err, "Q2_K") && strstr(err, "q2_k.q") &&
                      starts_with_path(err, path),
                  "Q2_K refusal: %s", err);
        } else {
            float* want = malloc_check((size_t)e->numel * 4);
            CHECK(t, e->numel == q->numel && gguf_tensor_to_f32(&f, e, want, e->numel, err) == 0,
                  "%s", err);
            CHECK(t, gguf_tensor_to_f32(&f, q, got, q->numel, err) == 0, "%s: %s", q->name, err);
            int64_t bad = -1;
            for (int64_t k = 0; k < q->numel && bad < 0; k++)
                if (memcmp(&got[k], &want[k], 4) != 0) bad = k;
            CHECK(t, bad < 0, "%s (%s): element %lld = %.9g, oracle %.9g", q->name,
                  ggml_type_name(q->type), (long long)bad, bad >= 0 ? (double)got[bad] : 0.0,
                  bad >= 0 ? (double)want[bad] : 0.0);
            pairs++;
            free(want);
        }
        free(got);
    }
    CHECK(t, pairs == 11, "11 types compared (got %d)", pairs);

    int64_t v;
    double d;
    GgufString s;
    struct {
        const char* key;
        int64_t want;
    } ints[] = {{"zoo.u8", 200},          {"zoo.i8", -100},          {"zoo.u16", 60000},
                {"zoo.i16", -30000},      {"zoo.u32", 4000000000ll}, {"zoo.i32", -2000000000ll},
                {"zoo.i64", -(1ll << 62)}};
    for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
        CHECK(t, gguf_get_int(&f, ints[k].key, &v) == 1 && v == ints[k].want, "%s", ints[k].key);
    const GgufKV* u64 = gguf_find_kv(&f, "zoo.u64");
    CHECK(t, u64 && u64->value.u == (1ull << 63) + 5 && gguf_get_int(&f, "zoo.u64", &v) == -1,
          "u64 above INT64_MAX is kept raw and refused as int64");
    CHECK(t, gguf_get_float(&f, "zoo.f32", &d) == 1 && d == 0.25, "f32");
    CHECK(t, gguf_get_float(&f, "zoo.f64", &d) == 1 && d == -1.5e300, "f64");
    const GgufKV* b = gguf_find_kv(&f, "zoo.bool");
    CHECK(t, b && b->value.type == GGUF_TYPE_BOOL && b->value.u == 1, "bool");
    CHECK(
        t,
        gguf_get_string(&f, "zoo.str", &s) == 1 && s.n == 6 && memcmp(s.s, "h\xc3\xa9llo", 6) == 0,
        "string");
    CHECK(t,
          gguf_get_string(&f, "zoo.u8", &s) == -1 && gguf_get_int(&f, "zoo.str", &v) == -1 &&
              gguf_get_int(&f, "nope", &v) == 0,
          "typed getters refuse other types");
    const GgufKV* a = gguf_find_kv(&f, "zoo.arr_i32");
    CHECK(t,
          a && a->value.n == 3 && gguf_array_int(&a->value, 1, &v) == 0 && v == -2 &&
              gguf_array_int(&a->value, 3, &v) == -1,
          "int array");
    const GgufKV* as = gguf_find_kv(&f, "zoo.arr_str");
    CHECK(t,
          as && as->value.elem_type == GGUF_TYPE_STRING && as->value.n == 3 &&
              as->value.strs[1].n == 0 && as->value.strs[2].n == 3 &&
              memcmp(as->value.strs[2].s, "ccc", 3) == 0,
          "string array");
    const GgufKV* n = gguf_find_kv(&f, "zoo.nested");
    CHECK(t,
          n && n->value.elem_type == GGUF_TYPE_ARRAY && n->value.n == 2 &&
              n->value.arrays[0].n == 2 && n->value.arrays[1].n == 1 &&
              gguf_array_int(&n->value.arrays[1], 0, &v) == 0 && v == 3,
          "nested int arrays");
    const GgufKV* ns = gguf_find_kv(&f, "zoo.nested_str");
    CHECK(t,
          ns && ns->value.n == 2 && ns->value.arrays[1].elem_type == GGUF_TYPE_STRING &&
              ns->value.arrays[1].n == 2 && ns->value.arrays[1].strs[1].n == 2,
          "nested string arrays");
    gguf_close(&f);

    // the block decoders by hand on known blocks (independent of the oracle)
    uint8_t q8[34] = {0x00, 0x3c};  // d = 1.0
    for (int j = 0; j < 32; j++) q8[2 + j] = (uint8_t)(int8_t)(j - 16);
    float y[256];
    CHECK(t, ggml_dequantize(GGML_TYPE_Q8_0, q8, y, 32) == 0 && y[0] == -16.0f && y[31] == 15.0f,
          "Q8_0 by hand");
    uint8_t q4[18] = {0x00, 0x40};  // d = 2.0
    q4[2] = 0x9F;                   // element 0: 15-8 = 7, element 16: 9-8 = 1
    CHECK(t,
          ggml_dequantize(GGML_TYPE_Q4_0, q4, y, 32) == 0 && y[0] == 14.0f && y[16] == 2.0f &&
              y[1] == -16.0f,
          "Q4_0 by hand: %g %g %g", (double)y[0], (double)y[16], (double)y[1]);
    uint8_t mx[17] = {128};  // E8M0 128: E2M1 value * 2^(128-127)
    mx[1] = 0x7F;            // element 0: code 15 = -6 -> -12; element 16: code 7 = 6 -> 12
    CHECK(t, ggml_dequantize(GGML_TYPE_MXFP4, mx, y, 32) == 0 && y[0] == -12.0f && y[16] == 12.0f,
          "MXFP4 by hand: %g %g", (double)y[0], (double)y[16]);
    CHECK(t,
          ggml_dequantize(GGML_TYPE_Q2_K, q8, y, 256) == -1 && ggml_dequantize(99, q8, y, 32) == -1,
          "unsupported types refused");
}

// ----------------------------------------------------------------------------
// layout helpers: permutation, names, rope_freqs

static void test_gguf_permutation_and_names(TestCtx* t) {
    // 2 heads of hd 4, 3 columns: GGUF row 2i+j = HF row j*2+i within each head
    float hf[24], gg[24], back[24];
    for (int i = 0; i < 24; i++) hf[i] = (float)i;
    gguf_permute_rows(hf, gg, 2, 8, 3, 0);
    const int expect_rows[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // GGUF row r holds HF row expect[r]
    int ok = 1;
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 3; c++) ok &= gg[r * 3 + c] == hf[expect_rows[r] * 3 + c];
    CHECK(t, ok, "forward permutation");
    gguf_permute_rows(gg, back, 2, 8, 3, 1);
    CHECK(t, memcmp(back, hf, sizeof hf) == 0, "inverse undoes forward");

    // the HF -> GGUF table agrees with the descriptor table of every dense test model
    const char* presets[] = {"test-llama", "test-qwen3", "qwen3-1.7b"};
    char err[ERR_LEN], name[96], via_desc[96];
    for (int p = 0; p < 3; p++) {
        ModelConfig c;
        TensorTable tt;
        CHECK(t,
              config_from_preset(&c, presets[p], err) == 0 &&
                  tensor_table_build(&tt, &c, 0, err) == 0,
              "%s", err);
        for (int i = 0; i < tt.n; i++) {
            if (tt.t[i].tied_to >= 0) continue;
            gguf_tensor_name(c.family, &tt.t[i], via_desc, sizeof via_desc);
            CHECK(t,
                  gguf_name_from_hf(c.family, tt.t[i].hf_name, name, sizeof name) == 0 &&
                      strcmp(name, via_desc) == 0,
                  "%s: %s -> %s vs %s", presets[p], tt.t[i].hf_name, name, via_desc);
        }
        tensor_table_free(&tt);
    }
    // MoE spellings (for the MoE issue)
    struct {
        ModelFamily fam;
        const char* hf;
        const char* gguf;
    } moe[] = {
        {FAMILY_QWEN3MOE, "model.layers.3.mlp.experts.17.down_proj.weight",
         "blk.3.ffn_down_exps.weight"},
        {FAMILY_QWEN3MOE, "model.layers.0.mlp.gate.weight", "blk.0.ffn_gate_inp.weight"},
        {FAMILY_QWEN3MOE, "model.layers.1.mlp.experts.gate_up_proj", "blk.1.ffn_gate_exps.weight"},
        {FAMILY_GPTOSS, "model.layers.5.post_attention_layernorm.weight",
         "blk.5.post_attention_norm.weight"},
        {FAMILY_GPTOSS, "model.layers.2.self_attn.sinks", "blk.2.attn_sinks.weight"},
        {FAMILY_GPTOSS, "model.layers.2.mlp.router.bias", "blk.2.ffn_gate_inp.bias"},
        {FAMILY_GPTOSS, "model.layers.2.mlp.experts.down_proj_bias", "blk.2.ffn_down_exps.bias"},
        {FAMILY_GPTOSS, "model.layers.2.self_attn.k_proj.bias", "blk.2.attn_k.bias"},
    };
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++)
        CHECK(t,
              gguf_name_from_hf(moe[i].fam, moe[i].hf, name, sizeof name) == 0 &&
                  strcmp(name, moe[i].gguf) == 0,
              "%s -> %s", moe[i].hf, name);
    CHECK(t,
          gguf_name_from_hf(FAMILY_LLAMA, "model.layers.0.self_attn.sinks", name, sizeof name) ==
                  -1 &&
              gguf_name_from_hf(FAMILY_LLAMA, "model.layers.x.mlp.up_proj.weight", name,
                                sizeof name) == -1,
          "unmapped names refused");
}

// A copy of a model file through our writer (F32), with one fault injected.
typedef struct Fault {
    const char* drop_tensor;
    const char* transpose_tensor;
    const char* nan_tensor;
    const char* drop_key;
    const char* replace_key;  // with the u32 below
    uint32_t replace_value;
} Fault;

static int rewrite_with_fault(const char* src, const char* dst, const Fault* fl, char* err) {
    GgufFile f;
    if (gguf_open(&f, src, err) != 0) return -1;
    GgufWriter w;
    gguf_writer_init(&w);
    for (int64_t i = 0; i < f.n_kv; i++) {
        const char* k = f.kv[i].key;
        if (fl->drop_key && strcmp(k, fl->drop_key) == 0) continue;
        if (fl->replace_key && strcmp(k, fl->replace_key) == 0) {
            gguf_writer_add_u32(&w, k, fl->replace_value);
            continue;
        }
        gguf_writer_add_records(&w, f.map + f.kv[i].raw_begin,
                                (size_t)(f.kv[i].raw_end - f.kv[i].raw_begin), 1);
    }
    for (int64_t i = 0; i < f.n_tensors; i++) {
        const GgufTensor* tn = &f.tensors[i];
        if (fl->drop_tensor && strcmp(tn->name, fl->drop_tensor) == 0) continue;
        float* data = malloc_check((size_t)tn->numel * 4);
        ggml_dequantize(tn->type, tn->data, data, tn->numel);
        int64_t shape[4];
        for (int d = 0; d < tn->n_dims; d++) shape[d] = tn->ne[tn->n_dims - 1 - d];
        if (fl->transpose_tensor && strcmp(tn->name, fl->transpose_tensor) == 0) {
            int64_t tmp = shape[0];
            shape[0] = shape[1];
            shape[1] = tmp;
        }
        gguf_writer_add_tensor(&w, tn->name, GGML_TYPE_F32, tn->n_dims, shape, data, 1);
    }
    int rc = gguf_writer_write(&w, dst, err);
    gguf_writer_free(&w);
    gguf_close(&f);
    if (rc == 0 && fl->nan_tensor) {
        // our writer refuses NaN, so patch element 3 of the written file in place
        rc = gguf_open(&f, dst, err);
        const GgufTensor* tn = rc == 0 ? gguf_find_tensor(&f, fl->nan_tensor) : NULL;
        if (tn) {
            long off = (long)(f.data_offset + tn->offset + 3 * 4);
            float nan = NAN;
            FILE* fp = fopen_check(dst, "r+b");
            if (fseek(fp, off, SEEK_SET) != 0)
                rc = errorf(err, "seek failed");
            else
                fwrite_check(&nan, 4, 1, fp, dst);
            fclose_check(fp, dst);
        }
        if (rc == 0) gguf_close(&f);
    }
    return rc;
}

// A GGUF with the metadata of cfg (and rope_freqs when given), no weights; drop_key: without
// that key.
static void write_meta_only(const char* path, const ModelConfig* c, const float* rope_freqs,
                            const char* drop_key) {
    GgufWriter w;
    gguf_writer_init(&w);
    gguf_writer_add_config(&w, c);
    if (rope_freqs) {
        int64_t half = c->HD / 2;
        float* r = malloc_check((size_t)half * 4);
        memcpy(r, rope_freqs, (size_t)half * 4);
        gguf_writer_add_tensor(&w, "rope_freqs.weight", GGML_TYPE_F32, 1, &half, r, 1);
    }
    char err[ERR_LEN], full[1200];
    snprintf(full, sizeof full, "%s.full", path);
    if (gguf_writer_write(&w, drop_key ? full : path, err) != 0) fprintf(stderr, "%s\n", err);
    gguf_writer_free(&w);
    Fault fault = {.drop_key = drop_key};
    if (drop_key && rewrite_with_fault(full, path, &fault, err) != 0) fprintf(stderr, "%s\n", err);
}

static void test_gguf_llama3_rope_freqs(TestCtx* t) {
    char err[ERR_LEN], path[1024];
    test_path(t, path, sizeof path, "rope.gguf");
    struct {
        int HD;
        double theta, factor, lf, hf;
        int L0;
    } cases[] = {
        {128, 500000, 8, 1, 4, 8192},  // Llama 3.1 (6 blended frequencies)
        {64, 500000, 32, 1, 4, 8192},  // Llama 3.2
        {16, 500000, 8, 1, 4, 64},     // one blended frequency
        {64, 10000, 16, 2, 8, 1000},   // unusual low/high factors: the general solve
        {32, 500000, 4, 1, 4, 16},     // no blended frequency at all
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        ModelConfig c;
        CHECK(t, config_from_preset(&c, "test-llama", err) == 0, "%s", err);
        c.HD = cases[k].HD;
        c.rope_theta = cases[k].theta;
        c.rope_factor = cases[k].factor;
        c.rope_low_freq_factor = cases[k].lf;
        c.rope_high_freq_factor = cases[k].hf;
        c.rope_original_max_pos = cases[k].L0;
        float r[256];
        gguf_llama3_rope_factors(&c, r);
        write_meta_only(path, &c, r, NULL);
        GgufFile f;
        ModelConfig got;
        int rc = gguf_open(&f, path, err);
        if (rc == 0) rc = gguf_config(&f, &got, err);
        CHECK(t, rc == 0, "case %zu: %s", k, err);
        if (rc == 0) {
            float a[256], b[256];
            config_rope_inv_freq(&c, a);
            config_rope_inv_freq(&got, b);
            for (int i = 0; i < c.HD / 2; i++)
                CHECK(t, fabsf(a[i] - b[i]) <= 2e-6f * a[i], "case %zu inv_freq[%d] %.8g vs %.8g",
                      k, i, (double)a[i], (double)b[i]);
            CHECK(t, got.rope_type == ROPE_LLAMA3 && got.rope_factor == c.rope_factor,
                  "case %zu: type/factor", k);
            if (k < 3)
                CHECK(t,
                      got.rope_low_freq_factor == 1.0 && got.rope_high_freq_factor == 4.0 &&
                          got.rope_original_max_pos == c.rope_original_max_pos,
                      "case %zu: Meta's parameters recovered exactly (L0 %d)", k,
                      got.rope_original_max_pos);
        }
        gguf_close(&f);
        // not a llama3 curve: refused, naming the tensor
        r[c.HD / 2 - 2] = 3.0f * (float)c.rope_factor;
        r[1] = 0.5f;
        write_meta_only(path, &c, r, NULL);
        rc = gguf_open(&f, path, err);
        if (rc == 0) rc = gguf_config(&f, &got, err);
        CHECK(t, rc == -1 && strstr(err, "rope_freqs.weight") && starts_with_path(err, path),
              "case %zu bad curve: %s", k, err);
        gguf_close(&f);
    }
}

static void test_gguf_config_metadata(TestCtx* t) {
    char err[ERR_LEN], path[1024];
    test_path(t, path, sizeof path, "meta.gguf");
    ModelConfig c, got;
    GgufFile f;
    CHECK(t, config_from_preset(&c, "test-qwen3", err) == 0, "%s", err);
    // missing required keys name the key
    const char* required[] = {"qwen3.block_count",
                              "qwen3.embedding_length",
                              "qwen3.attention.head_count",
                              "qwen3.feed_forward_length",
                              "qwen3.attention.layer_norm_rms_epsilon",
                              "general.architecture"};
    for (size_t k = 0; k < sizeof required / sizeof required[0]; k++) {
        write_meta_only(path, &c, NULL, required[k]);
        int rc = gguf_open(&f, path, err);
        if (rc == 0) rc = gguf_config(&f, &got, err);
        CHECK(t, rc == -1 && strstr(err, required[k]) && starts_with_path(err, path), "%s: %s",
              required[k], err);
        gguf_close(&f);
    }
    // MoE architectures: the expert keys, llama.cpp's fixed choices and HF's defaults
    ModelConfig moe = c;
    moe.family = FAMILY_QWEN3MOE;
    moe.E = 8;
    moe.K = 2;
    moe.F_expert = 16;
    write_meta_only(path, &moe, NULL, NULL);
    int rc = gguf_open(&f, path, err);
    if (rc == 0) rc = gguf_config(&f, &got, err);
    CHECK(t,
          rc == 0 && got.family == FAMILY_QWEN3MOE && got.E == 8 && got.K == 2 &&
              got.F_expert == 16 && got.norm_topk_prob && got.decoder_sparse_step == 1 &&
              !got.output_router_logits && got.expert_layout == EXPERTS_PER_EXPERT &&
              config_num_moe_blocks(&got) == got.L,
          "qwen3moe config: rc %d (%s)", rc, rc ? err : "");
    gguf_close(&f);
    write_meta_only(path, &moe, NULL, "qwen3moe.expert_count");
    rc = gguf_open(&f, path, err);
    if (rc == 0) rc = gguf_config(&f, &got, err);
    CHECK(t, rc == -1 && strstr(err, "qwen3moe.expert_count"), "expert_count required: %s", err);
    gguf_close(&f);
    ModelConfig oss = c;
    oss.family = FAMILY_GPTOSS;
    oss.E = 4, oss.K = 2, oss.F_expert = 32, oss.sliding_window = 128;
    oss.rope_type = ROPE_YARN, oss.rope_factor = 32, oss.rope_original_max_pos = 4096;
    write_meta_only(path, &oss, NULL, NULL);
    rc = gguf_open(&f, path, err);
    GgufString arch = {NULL, 0};
    CHECK(t,
          rc == 0 && gguf_get_string(&f, "general.architecture", &arch) == 1 && arch.n == 7 &&
              memcmp(arch.s, "gpt-oss", 7) == 0,
          "gpt-oss spelled with its hyphen: %s", err);
    if (rc == 0) rc = gguf_config(&f, &got, err);
    CHECK(t,
          rc == 0 && got.family == FAMILY_GPTOSS && got.E == 4 && got.K == 2 &&
              got.F_expert == 32 && got.attention_bias && got.sliding_window == 128 &&
              got.sliding[0] && !got.sliding[1] && got.rope_type == ROPE_YARN &&
              got.rope_factor == 32 && !got.yarn_truncate && got.swiglu_limit == 7.0f &&
              got.expert_layout == EXPERTS_GPTOSS,
          "gpt-oss config: rc %d (%s)", rc, rc ? err : "");
    gguf_close(&f);
}

// ----------------------------------------------------------------------------
// exports

static void test_gguf_export_roundtrip(TestCtx* t) {
    const char* srcs[] = {"llama_f32.gguf", "qwen3_f32.gguf"};
    for (int k = 0; k < 2; k++) {
        char p[1024], out[1024], err[ERR_LEN];
        Loaded a;
        if (load_model(t, fixture(t, p, sizeof p, srcs[k]), &a) != 0) return;
        const ExportDtype dts[] = {EXPORT_F32, EXPORT_F16, EXPORT_BF16};
        const int modes[] = {CMP_EXACT, CMP_F16, CMP_BF16};
        for (int d = 0; d < 3; d++) {
            snprintf(out, sizeof out, "%s/export_%d_%d.gguf", t->tmpdir, k, d);
            CHECK(t, checkpoint_export_gguf(out, &a.m, &a.s, dts[d], &a.src, err) == 0, "%s", err);
            Loaded b;
            if (load_model(t, out, &b) != 0) continue;
            check_same_config(t, &a.m.cfg, &b.m.cfg, out);
            compare_stores(t, &a, &b, modes[d], 0, out);
            CHECK(t,
                  b.src.tokenizer.n_kv == a.src.tokenizer.n_kv &&
                      b.src.tokenizer.len == a.src.tokenizer.len &&
                      memcmp(b.src.tokenizer.records, a.src.tokenizer.records,
                             a.src.tokenizer.len) == 0,
                  "%s: tokenizer records carried verbatim", out);
            GgufFile f;
            CHECK(t, gguf_open(&f, out, err) == 0, "%s", err);
            CHECK(t,
                  !f.nonsequential && (gguf_find_tensor(&f, "output.weight") != NULL) == (k == 0) &&
                      (gguf_find_tensor(&f, "rope_freqs.weight") != NULL) == (k == 0),
                  "%s: layout (packed offsets, output.weight only when untied, rope_freqs for "
                  "llama3)",
                  out);
            int64_t ft = -1;
            CHECK(t,
                  gguf_get_int(&f, "general.file_type", &ft) == 1 && ft == (d == 0   ? 0
                                                                            : d == 1 ? 1
                                                                                     : 32),
                  "file_type %lld", (long long)ft);
            gguf_close(&f);
            unload(&b);
        }
        // HF export, forced into shards, reloads to the same weights
        snprintf(out, sizeof out, "%s/export_hf_%d", t->tmpdir, k);
        CHECK(t, checkpoint_export_hf(out, &a.m, &a.s, EXPORT_F32, 20000, &a.src, err) == 0, "%s",
              err);
        char idx[1200];
        snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", out);
        CHECK(t, file_exists(idx), "sharded export has an index");
        char last[1200];
        snprintf(last, sizeof last, "%s/model-00003-of-%05d.safetensors", out, k == 0 ? 4 : 6);
        CHECK(t, file_exists(last), "shards of at most 20000 bytes: %s", last);
        Loaded h;
        if (load_model(t, out, &h) == 0) {
            check_same_config(t, &a.m.cfg, &h.m.cfg, out);
            compare_stores(t, &a, &h, CMP_EXACT, 0, out);
            unload(&h);
        }
        // BF16, unsharded (a later export replaces the shards and the index)
        CHECK(t,
              checkpoint_export_hf(out, &a.m, &a.s, EXPORT_BF16, EXPORT_DEFAULT_SHARD_BYTES, &a.src,
                                   err) == 0,
              "%s", err);
        CHECK(t, !file_exists(idx), "stale index removed");
        if (load_model(t, out, &h) == 0) {
            compare_stores(t, &a, &h, CMP_BF16_ALL, 0, out);
            unload(&h);
        }
        unload(&a);
    }
    // F16 overflow is refused with a clear message
    char p[1024], out[1024], err[ERR_LEN];
    Loaded a;
    if (load_model(t, fixture(t, p, sizeof p, "qwen3_f32.gguf"), &a) == 0) {
        store_param(&a.s, 0)[5] = 1e6f;
        snprintf(out, sizeof out, "%s/overflow.gguf", t->tmpdir);
        CHECK(t,
              checkpoint_export_gguf(out, &a.m, &a.s, EXPORT_F16, &a.src, err) == -1 &&
                  strstr(err, "overflows F16") && strstr(err, "token_embd.weight") &&
                  !file_exists(out),
              "%s", err);
        unload(&a);
    }
}

// ----------------------------------------------------------------------------
// CLI: --model x.gguf trains and exports; dumps agree bit for bit

static char* read_file_bytes(const char* path, size_t* len) {
    char err[ERR_LEN];
    char* s = file_read_all(path, 64u << 20, len, err);
    if (!s) *len = 0;
    return s;
}

static void test_gguf_cli_dump_and_export(TestCtx* t) {
    char shard[1024], err[ERR_LEN], args[8192];
    uint32_t toks[600];
    for (int i = 0; i < 600; i++) toks[i] = (uint32_t)((i * 7 + i / 5) % 64);
    test_path(t, shard, sizeof shard, "g_shard.bin");
    CHECK(t, shard_write(shard, toks, 600, 2, err) == 0, "%s", err);
    const char* common = "--val '' --batch 2 --seq 16 --sample-tokens 0 --threads 2";
    // 1. the same model from safetensors and from GGUF: identical loss and gradients
    struct {
        const char* tag;
        const char* model;
    } srcs[] = {{"d_hf", "dev/gguf/fixtures/llama"},
                {"d_gguf", "dev/gguf/fixtures/llama_f32.gguf"},
                {"d_qhf", "dev/gguf/fixtures/qwen3"},
                {"d_qgguf", "dev/gguf/fixtures/qwen3_f32.gguf"}};
    char* dumps[4];
    size_t lens[4];
    for (int i = 0; i < 4; i++) {
        char dump[1024];
        snprintf(dump, sizeof dump, "%s/%s.safetensors", t->tmpdir, srcs[i].tag);
        snprintf(args, sizeof args, "--model %s --train '%s' %s --dump-state '%s'", srcs[i].model,
                 shard, common, dump);
        int rc = test_run_cli(t, srcs[i].tag, args);
        CHECK(t, rc == 0, "%s exit %d", srcs[i].tag, rc);
        dumps[i] = read_file_bytes(dump, &lens[i]);
    }
    for (int i = 0; i < 4; i += 2)
        CHECK(t,
              lens[i] > 0 && lens[i] == lens[i + 1] && memcmp(dumps[i], dumps[i + 1], lens[i]) == 0,
              "%s == %s bit for bit", srcs[i].tag, srcs[i + 1].tag);
    for (int i = 0; i < 4; i++) free(dumps[i]);

    // 2. train from GGUF, export both ways (HF forced into shards) and save --out: the three
    //    copies of the trained model give identical dumps
    char eg[1024], eh[1024], out[1024];
    test_path(t, eg, sizeof eg, "trained.gguf");
    test_path(t, eh, sizeof eh, "trained_hf");
    test_path(t, out, sizeof out, "trained_out");
    snprintf(args, sizeof args,
             "--model dev/gguf/fixtures/llama_q8_0.gguf --train '%s' %s --steps 3 --lr 1e-2 "
             "--export-gguf '%s' --export-hf '%s' --export-shard-size 30000 --out '%s'",
             shard, common, eg, eh, out);
    int rc = test_run_cli(t, "train_export", args);
    char* o = test_read_output(t, "train_export", "out");
    CHECK(t, rc == 0 && strstr(o, "exported the model to") && strstr(o, "step     3/3"),
          "train+export exit %d: %s", rc, o);
    free(o);
    const char* models[] = {eg, eh, out};
    for (int i = 0; i < 3; i++) {
        char dump[1024], tag[16];
        snprintf(tag, sizeof tag, "e%d", i);
        snprintf(dump, sizeof dump, "%s/%s.safetensors", t->tmpdir, tag);
        snprintf(args, sizeof args, "--model '%s' --train '%s' %s --dump-state '%s'", models[i],
                 shard, common, dump);
        CHECK(t, test_run_cli(t, tag, args) == 0, "dump of %s", models[i]);
        dumps[i] = read_file_bytes(dump, &lens[i]);
    }
    CHECK(t, lens[0] > 0 && lens[0] == lens[1] && memcmp(dumps[0], dumps[1], lens[0]) == 0,
          "exported GGUF == exported HF");
    CHECK(t, lens[0] == lens[2] && memcmp(dumps[0], dumps[2], lens[0]) == 0, "exported == --out");
    for (int i = 0; i < 3; i++) free(dumps[i]);

    // 3. a broken GGUF on the command line: exit 1, one line naming the file
    char bad[1024];
    test_path(t, bad, sizeof bad, "truncated.gguf");
    size_t n;
    char fx[1024];
    char* bytes = read_file_bytes(fixture(t, fx, sizeof fx, "llama_q4_0.gguf"), &n);
    CHECK(t, file_write_atomic(bad, bytes, n / 2, err) == 0, "%s", err);
    free(bytes);
    snprintf(args, sizeof args, "--model '%s' --train '%s' %s", bad, shard, common);
    rc = test_run_cli(t, "bad_gguf", args);
    char* e = test_read_output(t, "bad_gguf", "err");
    CHECK(t,
          rc == 1 && strstr(e, bad) && strstr(e, "error") && strchr(e, '\n') == e + strlen(e) - 1,
          "bad gguf exit %d: %s", rc, e);
    free(e);
}

// ----------------------------------------------------------------------------
// hostile files

typedef struct Buf {
    uint8_t* p;
    size_t n, cap;
} Buf;

static void b_put(Buf* b, const void* p, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc_check(b->p, b->cap);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void b_u32(Buf* b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    b_put(b, x, 4);
}
static void b_u64(Buf* b, uint64_t v) {
    b_u32(b, (uint32_t)v);
    b_u32(b, (uint32_t)(v >> 32));
}
static void b_str(Buf* b, const char* s) {
    b_u64(b, strlen(s));
    b_put(b, s, strlen(s));
}
static void kv_u32(Buf* b, const char* key, uint32_t v) {
    b_str(b, key);
    b_u32(b, GGUF_TYPE_UINT32);
    b_u32(b, v);
}
static void kv_str(Buf* b, const char* key, const char* v) {
    b_str(b, key);
    b_u32(b, GGUF_TYPE_STRING);
    b_str(b, v);
}

typedef struct TInfo {
    const char* name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    uint64_t offset;
} TInfo;

// header (counts as given) + kv bytes + tensor infos + padding to 32 + data_len bytes of data
static void make_gguf(Buf* out, uint32_t version, uint64_t n_kv, const Buf* kvs, uint64_t n_t,
                      const TInfo* ts, int n_ts, size_t data_len) {
    out->n = 0;
    b_u32(out, GGUF_MAGIC);
    b_u32(out, version);
    b_u64(out, n_t);
    b_u64(out, n_kv);
    if (kvs) b_put(out, kvs->p, kvs->n);
    for (int i = 0; i < n_ts; i++) {
        b_str(out, ts[i].name);
        b_u32(out, ts[i].n_dims);
        for (uint32_t d = 0; d < ts[i].n_dims && d < 4; d++) b_u64(out, ts[i].ne[d]);
        b_u32(out, ts[i].type);
        b_u64(out, ts[i].offset);
    }
    while (out->n % 32) b_put(out, "\0", 1);
    for (size_t i = 0; i < data_len; i++) b_put(out, "\x11", 1);
}

static void expect_refused(TestCtx* t, const Buf* b, const char* what, const char* must) {
    GgufFile f;
    char err[ERR_LEN] = "";
    int rc = gguf_open_memory(&f, b->p, b->n, "hostile.gguf", err);
    CHECK(t, rc == -1 && starts_with_path(err, "hostile.gguf") && strstr(err, must),
          "%s: want one line naming the file and '%s', got rc %d '%s'", what, must, rc, err);
    if (rc == 0) gguf_close(&f);
}

static void test_gguf_hostile_headers(TestCtx* t) {
    Buf b = {0}, kv = {0};
    const uint64_t HUGE = 1ull << 62;
    const TInfo one = {"w", 2, {32, 2}, GGML_TYPE_F32, 0};

    b.n = 0;
    expect_refused(t, &b, "empty", "too small");
    make_gguf(&b, 3, 0, NULL, 0, NULL, 0, 0);
    memcpy(b.p, "GGUX", 4);
    expect_refused(t, &b, "bad magic", "magic");
    make_gguf(&b, 1, 0, NULL, 0, NULL, 0, 0);
    expect_refused(t, &b, "v1", "version 1");
    make_gguf(&b, 0x03000000u, 0, NULL, 0, NULL, 0, 0);
    expect_refused(t, &b, "big-endian", "big-endian");
    make_gguf(&b, 9, 0, NULL, 0, NULL, 0, 0);
    expect_refused(t, &b, "v9", "version 9");
    make_gguf(&b, 3, HUGE, NULL, 0, NULL, 0, 0);
    expect_refused(t, &b, "huge kv count", "metadata_kv_count");
    make_gguf(&b, 3, 0, NULL, HUGE, NULL, 0, 0);
    expect_refused(t, &b, "huge tensor count", "tensor_count");
    b.n = 10;
    expect_refused(t, &b, "truncated header", "truncated");

    kv.n = 0;
    b_u64(&kv, HUGE);  // key length
    for (int i = 0; i < 100; i++) b_put(&kv, "k", 1);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "huge key length", "string length");
    kv.n = 0;
    b_str(&kv, "a.b");
    b_u32(&kv, 13);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "unknown value type", "unknown value type 13");
    kv.n = 0;
    b_str(&kv, "a.flag");
    b_u32(&kv, GGUF_TYPE_BOOL);
    b_put(&kv, "\x02", 1);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "bool 2", "BOOL");
    kv.n = 0;
    b_str(&kv, "a.arr");
    b_u32(&kv, GGUF_TYPE_ARRAY);
    b_u32(&kv, GGUF_TYPE_STRING);
    b_u64(&kv, HUGE);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "huge array", "a.arr");
    kv.n = 0;
    b_str(&kv, "a.arr");
    b_u32(&kv, GGUF_TYPE_ARRAY);
    b_u32(&kv, GGUF_TYPE_UINT32);
    b_u64(&kv, 3);
    b_u32(&kv, 1);  // only one of three elements
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    b.n = 24 + kv.n;  // no padding: the array runs off the end
    expect_refused(t, &b, "short array", "a.arr");
    kv.n = 0;
    b_str(&kv, "a.deep");
    b_u32(&kv, GGUF_TYPE_ARRAY);
    for (int d = 0; d < 20; d++) {
        b_u32(&kv, GGUF_TYPE_ARRAY);
        b_u64(&kv, 1);
    }
    b_u32(&kv, GGUF_TYPE_UINT8);
    b_u64(&kv, 0);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "nested bomb", "nested deeper");
    kv.n = 0;
    kv_u32(&kv, "a.x", 1);
    kv_u32(&kv, "a.x", 2);
    make_gguf(&b, 3, 2, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "duplicate key", "duplicate metadata key 'a.x'");
    kv.n = 0;
    b_str(&kv, "");
    b_u32(&kv, GGUF_TYPE_UINT8);
    b_put(&kv, "\x01", 1);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "empty key", "empty");
    kv.n = 0;
    kv_u32(&kv, "general.alignment", 48);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "alignment 48", "general.alignment");
    kv.n = 0;
    kv_str(&kv, "general.alignment", "32");
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "alignment type", "expected UINT32");

    // tensor infos
    TInfo ti[2];
    ti[0] = one;
    ti[0].n_dims = 5;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "5 dims", "n_dims 5");
    ti[0] = one;
    ti[0].type = 37;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "removed type", "unknown ggml type 37");
    ti[0].type = 200;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "type 200", "unknown ggml type 200");
    ti[0].type = 42;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "Q2_0", "Q2_0");
    ti[0] = one;
    ti[0].type = GGML_TYPE_Q8_0;
    ti[0].ne[0] = 33;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "partial block", "multiple of the Q8_0 block");
    ti[0] = one;
    ti[0].ne[0] = 1ull << 40;
    ti[0].ne[1] = 1ull << 40;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "numel overflow", "overflows");
    ti[0] = one;
    ti[0].ne[1] = 1ull << 63;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "negative ne", "negative");
    ti[0] = one;
    ti[0].offset = 4;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 512);
    expect_refused(t, &b, "misaligned", "alignment");
    ti[0] = one;
    ti[0].offset = 1ull << 40;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "out of range", "past the end");
    ti[0] = one;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 255);
    expect_refused(t, &b, "data truncated", "past the end");
    ti[0] = one;
    ti[1] = one;
    ti[1].name = "v";
    ti[1].offset = 224;  // w is [0, 256)
    make_gguf(&b, 3, 0, NULL, 2, ti, 2, 1024);
    expect_refused(t, &b, "overlap", "overlaps");
    ti[1].name = "w";
    ti[1].offset = 256;
    make_gguf(&b, 3, 0, NULL, 2, ti, 2, 1024);
    expect_refused(t, &b, "duplicate tensor", "duplicate tensor name 'w'");
    ti[0] = one;
    ti[0].name = "a_very_long_tensor_name_that_goes_past_the_ggml_limit_of_63_bytes_x";
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "long name", "name");
    ti[0] = one;
    ti[0].name = "blk.0\nattn_q.weight";  // found by the fuzzer: would split the message
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    expect_refused(t, &b, "newline in a name", "control character");
    kv.n = 0;
    kv_u32(&kv, "a\rb", 1);
    make_gguf(&b, 3, 1, &kv, 0, NULL, 0, 0);
    expect_refused(t, &b, "control byte in a key", "control character");
    ti[0] = one;
    make_gguf(&b, 3, 0, NULL, 1, ti, 1, 256);
    b.n = 24 + 8 + 1 + 4 + 16 + 4 + 4;  // cut inside the offset
    expect_refused(t, &b, "truncated tensor info", "truncated");

    // valid: non-sequential but aligned and disjoint offsets are accepted (flagged)
    ti[0] = one;
    ti[0].offset = 256;
    ti[1] = one;
    ti[1].name = "v";
    ti[1].offset = 0;
    make_gguf(&b, 3, 0, NULL, 2, ti, 2, 512);
    GgufFile f;
    char err[ERR_LEN];
    CHECK(t,
          gguf_open_memory(&f, b.p, b.n, "ok.gguf", err) == 0 && f.nonsequential == 1 &&
              f.tensors[0].data == b.p + f.data_offset + 256,
          "non-sequential offsets accepted: %s", err);
    gguf_close(&f);
    free(b.p);
    free(kv.p);
}

// Every prefix of a valid file is refused cleanly (and the full file opens).
static void test_gguf_truncations(TestCtx* t) {
    char path[1024], err[ERR_LEN];
    size_t n;
    char* bytes = read_file_bytes(fixture(t, path, sizeof path, "qwen3_mxfp4.gguf"), &n);
    CHECK(t, bytes && n > 4096, "fixture read");
    if (!bytes) return;
    GgufFile f;
    int refused = 0;
    for (size_t len = 0; len < n; len++) {
        // every byte of the header, then every 7th in the data section
        size_t hdr_end = 4096;
        if (len > hdr_end && len % 7 != 0 && len != n - 1) continue;
        if (gguf_open_memory(&f, (const uint8_t*)bytes, len, "cut.gguf", err) == 0) {
            // legal only when every tensor still fits: the padding after the last one was cut
            CHECK(t,
                  len >= f.data_offset + f.tensors[f.n_tensors - 1].offset +
                             f.tensors[f.n_tensors - 1].nbytes,
                  "prefix %zu accepted", len);
            gguf_close(&f);
        } else {
            refused++;
            CHECK(t, starts_with_path(err, "cut.gguf"), "prefix %zu: '%s'", len, err);
        }
    }
    CHECK(t, refused > 4000, "%d prefixes refused", refused);
    CHECK(t, gguf_open_memory(&f, (const uint8_t*)bytes, n, "full.gguf", err) == 0, "%s", err);
    gguf_close(&f);
    free(bytes);
}

static void test_gguf_hostile_models(TestCtx* t) {
    char src[1024], dst[1024], err[ERR_LEN];
    fixture(t, src, sizeof src, "llama_q8_0.gguf");
    test_path(t, dst, sizeof dst, "fault.gguf");
    struct {
        Fault fault;
        const char* must;
    } cases[] = {
        {{.drop_tensor = "blk.1.ffn_up.weight"},
         "'blk.1.ffn_up.weight' (HF model.layers.1.mlp.up_proj.weight) is missing"},
        {{.transpose_tensor = "blk.0.attn_k.weight"},
         "blk.0.attn_k.weight' has ne [16, 32], the config needs ne [32, 16]"},
        {{.nan_tensor = "blk.0.ffn_down.weight"}, "'blk.0.ffn_down.weight': element 3 is NaN"},
        {{.drop_key = "llama.block_count"}, "'llama.block_count' is missing"},
        {{.replace_key = "llama.embedding_length", .replace_value = 48},
         "token_embd.weight' has ne [32, 64], the config needs ne [48, 64]"},
        {{.replace_key = "llama.attention.head_count_kv", .replace_value = 3}, "not a multiple"},
        {{.replace_key = "llama.vocab_size", .replace_value = 65},
         "token_embd.weight' has ne [32, 64]"},
        {{.replace_key = "general.architecture"}, "general.architecture' must be a STRING"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        if (rewrite_with_fault(src, dst, &cases[k].fault, err) != 0) {
            CHECK(t, 0, "rewrite: %s", err);
            continue;
        }
        ModelSource s;
        int rc = checkpoint_resolve_model(&s, dst, err);
        if (rc == 0) {
            Model m;
            rc = model_init(&m, &s.cfg, 0, err);
            if (rc == 0) {
                Store st;
                store_create(&st, &m.tt);
                rc = checkpoint_load_weights(&s, &st, NULL, err);
                store_free(&st);
                model_free(&m);
            }
            checkpoint_close_source(&s);
        }
        CHECK(t, rc == -1 && starts_with_path(err, dst) && strstr(err, cases[k].must),
              "case %zu: want '%s', got '%s'", k, cases[k].must, err);
    }
    // an unknown architecture
    GgufWriter w;
    gguf_writer_init(&w);
    gguf_writer_add_string(&w, "general.architecture", "mamba");
    CHECK(t, gguf_writer_write(&w, dst, err) == 0, "%s", err);
    gguf_writer_free(&w);
    ModelSource s;
    CHECK(t,
          checkpoint_resolve_model(&s, dst, err) == -1 &&
              strstr(err, "unsupported architecture 'mamba'"),
          "%s", err);
}

// ----------------------------------------------------------------------------
// fuzz smoke: every committed seed and deterministic mutations through the fuzz entry points

typedef int (*FuzzEntry)(const uint8_t*, size_t);

static void mutate(Rng* rng, uint8_t* buf, size_t* len, size_t cap) {
    static const uint8_t specials[] = {0x00, 0x01, 0x02, 0x07, 0x08, 0x09, 0x0c,
                                       0x1f, 0x20, 0x27, 0x7f, 0x80, 0xfe, 0xff,
                                       '{',  '}',  '[',  ']',  '"',  ':',  ','};
    int n_mut = 1 + (int)rng_below(rng, 4);
    for (int m = 0; m < n_mut; m++) {
        size_t pos = *len ? (size_t)rng_below(rng, *len) : 0;
        uint8_t c = rng_below(rng, 2) ? (uint8_t)rng_below(rng, 256)
                                      : specials[rng_below(rng, sizeof specials)];
        switch (rng_below(rng, 6)) {
            case 0:  // flip one byte
                if (*len) buf[pos] = c;
                break;
            case 1:  // overwrite a little-endian u32/u64 field with an extreme value
                if (*len >= pos + 8) {
                    uint64_t v =
                        rng_below(rng, 2) ? ~0ull >> rng_below(rng, 64) : rng_below(rng, 70);
                    memcpy(buf + pos, &v, rng_below(rng, 2) ? 4 : 8);
                }
                break;
            case 2:  // truncate
                *len = pos;
                break;
            case 3:  // delete a range
                if (*len) {
                    size_t span = 1 + (size_t)rng_below(rng, 16);
                    if (span > *len - pos) span = *len - pos;
                    memmove(buf + pos, buf + pos + span, *len - pos - span);
                    *len -= span;
                }
                break;
            case 4:  // insert a byte
                if (*len < cap) {
                    memmove(buf + pos + 1, buf + pos, *len - pos);
                    buf[pos] = c;
                    (*len)++;
                }
                break;
            default:  // duplicate a range
                if (*len && *len + 32 <= cap) {
                    size_t span = 1 + (size_t)rng_below(rng, 32);
                    if (span > *len - pos) span = *len - pos;
                    memmove(buf + pos + span, buf + pos, *len - pos);
                    *len += span;
                }
                break;
        }
    }
}

static void test_gguf_fuzz_smoke(TestCtx* t) {
    struct {
        const char* dir;
        FuzzEntry fn;
        int mutations;  // per seed
    } targets[] = {{"json", fuzz_json, 2000},
                   {"safetensors", fuzz_safetensors, 1000},
                   {"gguf", fuzz_gguf, 1500},
                   {"shard", fuzz_shard, 500}};
    Rng rng;
    rng_seed(&rng, 20240601);
    for (size_t k = 0; k < sizeof targets / sizeof targets[0]; k++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/dev/fuzz/corpus/%s", t->exe_dir, targets[k].dir);
        DIR* d = opendir(dir);
        CHECK(t, d != NULL, "seed corpus %s", dir);
        if (!d) continue;
        int seeds = 0, accepted = 0, runs = 0;
        struct dirent* e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char path[2048];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            size_t len;
            char* seed = read_file_bytes(path, &len);
            if (!seed) continue;
            seeds++;
            int ok = targets[k].fn((const uint8_t*)seed, len);
            CHECK(t, ok == 1, "seed %s is accepted", path);
            size_t cap = len + 4096;
            uint8_t* buf = malloc_check(cap);
            for (int i = 0; i < targets[k].mutations; i++) {
                size_t n = len;
                memcpy(buf, seed, len);
                mutate(&rng, buf, &n, cap);
                // an exact-size copy so that ASan sees any read past the end
                uint8_t* exact = malloc_check(n ? n : 1);
                memcpy(exact, buf, n);
                accepted += targets[k].fn(exact, n);
                free(exact);
                runs++;
            }
            free(buf);
            free(seed);
        }
        closedir(d);
        CHECK(t, seeds >= 2 && runs > 0 && accepted < runs,
              "%s: %d seeds, %d of %d mutants accepted", targets[k].dir, seeds, accepted, runs);
    }
}

const TestCase tests_gguf[] = {
    {"gguf_fixture_f32_exact", test_gguf_fixture_f32_exact},
    {"gguf_fixture_half_and_quantized", test_gguf_fixture_half_and_quantized},
    {"gguf_quant_zoo", test_gguf_quant_zoo},
    {"gguf_permutation_and_names", test_gguf_permutation_and_names},
    {"gguf_llama3_rope_freqs", test_gguf_llama3_rope_freqs},
    {"gguf_config_metadata", test_gguf_config_metadata},
    {"gguf_export_roundtrip", test_gguf_export_roundtrip},
    {"gguf_cli_dump_and_export", test_gguf_cli_dump_and_export},
    {"gguf_hostile_headers", test_gguf_hostile_headers},
    {"gguf_truncations", test_gguf_truncations},
    {"gguf_hostile_models", test_gguf_hostile_models},
    {"gguf_fuzz_smoke", test_gguf_fuzz_smoke},
    {NULL, NULL},
};
