/*
 * test_quant.c — the frozen base in a block format (quant.h, --base-dtype): ggml's quantisers
 * against gguf-py's blocks, the table's marks and refusals, LoRA training on a q8_0 / q4_k /
 * mxfp4 base through the engine (emulated devices: the blocks uploaded and dequantised on the
 * device) bit-identical to the same run on the dequantised weights, the CLI (plain = engine,
 * resume, --plan's bytes, one-line refusals), and the GPU dequantiser against the CPU's
 * (skipped without a GPU).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../checkpoint.h"
#include "../common.h"
#include "../device.h"
#include "../engine.h"
#include "../gguf.h"
#include "../loader.h"
#include "../lora.h"
#include "../model.h"
#include "../ops.h"
#include "../quant.h"
#include "../rng.h"
#include "../store.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// the quantisers

// x[i] = ((i * 7919) % 2001 - 1000) / 137 in fp32 (one correctly rounded division: numpy gives
// the same bits), block 1 zero, block 2 scaled by 0.01: the inputs of the fixture below.
static void fixture_input(float* x) {
    for (int i = 0; i < 128; i++) {
        x[i] = (float)((i * 7919) % 2001 - 1000) / 137.0f;
        if (i >= 32 && i < 64) x[i] = 0.0f;
        if (i >= 64 && i < 96) x[i] *= 0.01f;
    }
}

// gguf-py 0.17's quants.quantize of fixture_input (Q8_0, MXFP4; it has no Q4_K quantiser).
static const char* const fixture_q8_0 =
    "5b2b81746a5f54493e34291e1308fef3e8ddd2c8bdb2a79c92877a6f655a4f44392f0000000000000000000000"
    "0000000000000000000000000000000000000000000000a410c8bdb2a79c91867d72675c51463b30251a0f04f9"
    "eee4d9cec3b8ada2978c81782e2b6e63584d42372c21150afff4e9ded3c8bdb2a79c91867f74695e53483d3227"
    "1b";
static const char* const fixture_mxfp4 =
    "7fdfd7e7e7f6f6f6f574737271606a5b5c0000000000000000000000000000000000792c1c0d0d9eaebec6c6d6"
    "d5d5e5e4e3637fe7e7e6f6f6f57474727160695b5c4d3d";

static int hex_equal(const uint8_t* b, size_t n, const char* hex) {
    if (strlen(hex) != 2 * n) return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1 || v != b[i]) return 0;
    }
    return 1;
}

static void test_quant_blocks(TestCtx* t) {
    float x[128];
    fixture_input(x);
    uint8_t q8[4 * 34], mx[4 * 17];
    quant_quantize(GGML_TYPE_Q8_0, x, q8, 128);
    quant_quantize(GGML_TYPE_MXFP4, x, mx, 128);
    CHECK(t, hex_equal(q8, sizeof q8, fixture_q8_0), "Q8_0 blocks = gguf-py's");
    CHECK(t, hex_equal(mx, sizeof mx, fixture_mxfp4), "MXFP4 blocks = gguf-py's");

    // every format on random rows: the dequantised values near the inputs, zeros exact, and
    // quantising the dequantised values again gives the same blocks (Q8_0, MXFP4: their scale
    // comes back from the block's largest element)
    Rng r;
    rng_seed(&r, 11);
    const int n = 4096;
    float* w = malloc_check(n * sizeof(float));
    float* y = malloc_check(n * sizeof(float));
    uint8_t* b = malloc_check((size_t)n * 2);
    uint8_t* b2 = malloc_check((size_t)n * 2);
    const int types[3] = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_MXFP4};
    const double tol[3] = {0.01, 0.08, 0.2};  // relative rms error
    for (int k = 0; k < 3; k++) {
        for (int i = 0; i < n; i++) w[i] = 0.05f * rng_normal(&r) * (1.0f + (float)(i / 256));
        for (int i = 256; i < 512; i++) w[i] = 0.0f;
        quant_quantize(types[k], w, b, n);
        quant_dequantize(types[k], b, y, n);
        double num = 0, den = 0;
        int zeros = 1;
        for (int i = 0; i < n; i++) {
            num += (double)(y[i] - w[i]) * (y[i] - w[i]);
            den += (double)w[i] * w[i];
            if (i >= 256 && i < 512) zeros &= y[i] == 0.0f;
        }
        CHECK(t, sqrt(num / den) < tol[k] && zeros, "%s: relative rms error %.4f (< %.2f), zeros %d",
              quant_type_name(types[k]), sqrt(num / den), tol[k], zeros);
        if (types[k] != GGML_TYPE_Q4_K) {
            quant_quantize(types[k], y, b2, n);
            CHECK(t, memcmp(b, b2, ggml_type_bytes(types[k], n)) == 0, "%s: a fixed point",
                  quant_type_name(types[k]));
        }
    }
    free(w);
    free(y);
    free(b);
    free(b2);
}

// ----------------------------------------------------------------------------
// the table

static LoraSpec all_linear(void) {
    return (LoraSpec){.r = 4, .alpha = 8, .targets = LORA_ALL_LINEAR};
}

static void test_quant_table(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c = test_engine_config(0);
    c.F = 64;  // (the down projection's width: a multiple of 32)
    LoraSpec l = all_linear();
    l.targets = LORA_BIT(LORA_Q) | LORA_BIT(LORA_DOWN);
    Model m;
    CHECK(t, model_init_lora(&m, &c, 0, &l, err) == 0, "%s", err);
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_Q8_0, NULL, &c, err) == 0, "%s", err);
    int wq = 0, wdown = 0, other = 0;
    for (int i = 0; i < m.tt.n; i++) {
        const TensorDesc* d = &m.tt.t[i];
        if (!d->qtype) continue;
        wq += d->kind == TK_WQ;
        wdown += d->kind == TK_W_DOWN;
        other += d->kind != TK_WQ && d->kind != TK_W_DOWN;
    }
    CHECK(t, wq == c.L && wdown == c.L && other == 0, "q and down marked (%d, %d), nothing else "
          "(%d)", wq, wdown, other);
    // the head as held: blocks for the marked tensors, bf16 for the rest
    const int lq = tensor_table_index(&m.tt, TK_WQ, 0);
    const size_t q_bytes = (size_t)ggml_type_bytes(GGML_TYPE_Q8_0, m.tt.t[lq].numel);
    CHECK(t, q_bytes == (size_t)m.tt.t[lq].numel / 32 * 34, "Q8_0 bytes");
    CHECK(t, quant_layer_head_bytes(&m.tt, 1, 2) <
                 (size_t)(m.tt.param_numel[1] - m.tt.state_numel[1]) * 2, "the head shrinks");
    CHECK(t, quant_layer_block_bytes(&m.tt, 0) == 0, "no blocks in the prefix");
    // q4_k: C = 32 is not a multiple of 256
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_Q4_K, NULL, &c, err) != 0 &&
                 strstr(err, "not a multiple of q4_k's 256-element blocks"), "%s", err);
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_KEEP, NULL, &c, err) != 0 &&
                 strstr(err, "not a GGUF file"), "%s", err);
    model_free(&m);
    // without LoRA
    CHECK(t, model_init_lora(&m, &c, 0, NULL, err) == 0, "%s", err);
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_MXFP4, NULL, &c, err) != 0 &&
                 strstr(err, "LoRA runs"), "%s", err);
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_BF16, NULL, &c, err) == 0, "bf16 is always fine");
    model_free(&m);
    BaseDtype bd;
    CHECK(t, quant_parse_base_dtype("Q4_K", &bd, err) == 0 && bd == BASE_DTYPE_Q4_K, "parse");
    CHECK(t, quant_parse_base_dtype("q3_k", &bd, err) != 0 && strstr(err, "unknown"), "%s", err);
}

// keep: a GGUF's Q8_0 tensors become the Store's blocks byte for byte (the fixture's q/k/v/o/
// gate/up/down), and the run trains on the values the loader gives (the same losses as without
// --base-dtype)
static void test_quant_keep_gguf(TestCtx* t) {
    char err[ERR_LEN];
    const char* path = "dev/gguf/fixtures/qwen3_q8_0.gguf";
    if (access(path, F_OK) != 0) {
        test_skip(t, "no fixture dev/gguf/fixtures/qwen3_q8_0.gguf");
        return;
    }
    ModelSource src;
    CHECK(t, checkpoint_resolve_model(&src, path, err) == 0, "%s", err);
    Model m;
    const LoraSpec l = all_linear();
    CHECK(t, model_init_lora(&m, &src.cfg, 0, &l, err) == 0, "%s", err);
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_KEEP, &src.gguf, &src.cfg, err) == 0, "%s", err);
    Store s;
    store_create(&s, &m.tt);
    CHECK(t, checkpoint_load_weights(&src, &s, NULL, err) == 0, "%s", err);
    store_quantize_base(&s, &src.gguf, &src.cfg);
    int n = 0, same = 0;
    for (int i = 0; i < m.tt.n; i++) {
        const TensorDesc* d = &m.tt.t[i];
        if (!d->qtype) continue;
        GgufPart parts[2];
        gguf_tensor_parts(&src.cfg, d, parts);
        const GgufTensor* g = gguf_find_tensor(&src.gguf, parts[0].name);
        n++;
        same += g && s.qblocks[i] && g->type == GGML_TYPE_Q8_0 &&
                memcmp(s.qblocks[i], g->data, quant_tensor_bytes(d, 0)) == 0;
    }
    CHECK(t, n == 7 * src.cfg.L && same == n, "%d of %d kept tensors are the file's blocks", same,
          n);
    store_free(&s);
    model_free(&m);
    checkpoint_close_source(&src);

    char args[4096], la[1024], lb[1024];
    test_path(t, la, sizeof la, "q_keep.jsonl");
    test_path(t, lb, sizeof lb, "q_nokeep.jsonl");
    const char* common = "--model dev/gguf/fixtures/qwen3_q8_0.gguf --lora-r 4 --steps 2 --val '' "
                         "--sample-tokens 0 --threads 1 -m 2 --device cpu:2 --sync 1 --seq 16 "
                         "--batch 4";
    snprintf(args, sizeof args, "%s --base-dtype keep --log '%s'", common, la);
    CHECK(t, test_run_cli(t, "qkeep", args) == 0, "keep run");
    snprintf(args, sizeof args, "%s --log '%s'", common, lb);
    CHECK(t, test_run_cli(t, "qnokeep", args) == 0, "bf16 run");
    test_same_steps(t, "keep vs bf16", la, lb, 1, 2);
}

// ----------------------------------------------------------------------------
// LoRA training through the engine (emulated devices) on a quantised base

#define Q_STEPS 3

typedef struct QRun {
    double loss[Q_STEPS];
    float* params;  // every slab after the last step
    int64_t n_params;
    uint64_t param_up;  // bytes on the devices' parameter streams
} QRun;

// mode: Q_RELEASE gives the Store's base back (EngineOptions.release_frozen, as on GPUs);
// Q_STREAMED creates the Store streamed (store_create_streamed: the blocks made by the init, no
// fp32 values; values must be NULL). Either way run->params are the adapters alone.
#define Q_RELEASE 1
#define Q_STREAMED 2
// Q_BF16 (with Q_STREAMED): the frozen tensors not in blocks are held in bf16 (Store.base16), as
// a streamed base is on GPUs; only for devices that compute in bf16
#define Q_BF16 4

// quant: --base-dtype's type for the run (0: none, on the Store `values` gives); values (may be
// NULL): the fp32 weights to start from instead of the seeded init (every slab, concatenated).
static int q_engine_on(TestCtx* t, const DeviceImpl* impl, int mode, QRun* run,
                       const ModelConfig* c, const LoraSpec* l, BaseDtype bd, const float* values,
                       int N, double budget, int sync, const int32_t* tokens, int B, int T,
                       float** values_out) {
    char err[ERR_LEN];
    memset(run, 0, sizeof *run);
    Model m;
    Store s;
    if (model_init_lora(&m, c, 0, l, err) != 0) fatal("q_engine: %s", err);
    if (quant_table_set(&m.tt, bd, NULL, c, err) != 0) fatal("q_engine: %s", err);
    const int release = (mode & Q_RELEASE) != 0, streamed = (mode & Q_STREAMED) != 0;
    if (streamed)
        store_create_streamed(&s, &m.tt, (mode & Q_BF16) != 0);
    else
        store_create(&s, &m.tt);
    store_init_random(&s, 7, 0.2f);
    lora_init_random(&m, &s, 7);
    int64_t o = 0;
    for (int k = 0; values && k < m.tt.n_layers; k++) {
        memcpy(s.param[k], values + o, (size_t)m.tt.param_numel[k] * sizeof(float));
        o += m.tt.param_numel[k];
    }
    store_quantize_base(&s, NULL, c);
    if (values_out && !streamed) {  // the dequantised start (the reference run's weights)
        int64_t n = 0;
        for (int k = 0; k < m.tt.n_layers; k++) n += m.tt.param_numel[k];
        *values_out = malloc_check((size_t)n * sizeof(float));
        o = 0;
        for (int k = 0; k < m.tt.n_layers; k++) {
            memcpy(*values_out + o, s.param[k], (size_t)m.tt.param_numel[k] * sizeof(float));
            o += m.tt.param_numel[k];
        }
    }
    DeviceOptions dopt = {.threads = 1, .delay_seed = 5, .max_delay_us = 30};
    DeviceSet devs;
    device_set_open(&devs, impl, N, &dopt);
    EngineOptions eo = {.B = B, .T = T, .M = 2, .M_R = 2, .grain = RECOMPUTE_STAGE, .sync = sync,
                        .device_budget = budget, .opt_threads = 1, .row_chunks = 1,
                        .trace_path = "", .seed = 7, .release_frozen = release,
                        .hyper = (AdamWHyper){3e-2f, 0.9f, 0.95f, 1e-8f, 0.1f},
                        .sched = (LrSchedule){LR_COSINE, 3e-2f, 1, Q_STEPS, 0.1f, 0.2f},
                        .grad_clip = 1.0f};
    if (budget > 0)
        eo.device_budget +=
            (double)engine_fixed_device_bytes(&m, impl->ops(devs.dev[0])->act_bytes, &eo);
    Engine* e = engine_create(&m, &s, &devs, &eo, err);
    CHECK(t, e != NULL, "engine_create: %s", err);
    if (e) {
        for (int step = 0; step < Q_STEPS; step++)
            run->loss[step] = engine_step(e, tokens + (size_t)step * B * (T + 1)).loss;
        engine_synchronize(e);
        for (int g = 0; g < N; g++) {
            DeviceStats st;
            impl->stats(devs.dev[g], &st);
            run->param_up += st.bytes[STREAM_PARAM_UP];
        }
        engine_free(e);
        // every slab (after a release or streamed: the adapters alone)
        const int tails = release || streamed;
        for (int k = 0; k < m.tt.n_layers; k++)
            run->n_params += tails ? m.tt.state_numel[k] : m.tt.param_numel[k];
        run->params = malloc_check((size_t)(run->n_params ? run->n_params : 1) * sizeof(float));
        o = 0;
        for (int k = 0; k < m.tt.n_layers; k++) {
            const int64_t skip = tails ? m.tt.param_numel[k] - m.tt.state_numel[k] : 0;
            memcpy(run->params + o, s.param[k] + skip,
                   (size_t)(m.tt.param_numel[k] - skip) * sizeof(float));
            o += m.tt.param_numel[k] - skip;
        }
    }
    device_set_close(&devs);
    store_free(&s);
    model_free(&m);
    return e ? 0 : -1;
}

static int q_engine(TestCtx* t, QRun* run, const ModelConfig* c, const LoraSpec* l, BaseDtype bd,
                    const float* values, int N, double budget, int sync, const int32_t* tokens,
                    int B, int T, float** values_out) {
    return q_engine_on(t, &device_cpu_impl, 0, run, c, l, bd, values, N, budget, sync, tokens, B,
                       T, values_out);
}

// A config whose linears' widths take a format's blocks (Q4_K: 256).
static ModelConfig q_config(BaseDtype bd) {
    ModelConfig c = test_engine_config(1);
    if (bd == BASE_DTYPE_Q4_K) {
        c.C = 256;
        c.H = 4;
        c.KVH = 2;
        c.HD = 64;
        c.F = 256;
        c.L = 3;
    } else {
        c.F = 64;
    }
    return c;
}

// q8_0, q4_k and mxfp4 bases: the engine's run (blocks uploaded, dequantised on the device) is
// bit for bit the run on the dequantised weights held in fp32, on one and on three devices
// (several stages), sync and one-step-delayed; the parameter streams carry fewer bytes.
static void test_quant_engine_matches_dequantised(TestCtx* t) {
    const int B = 4, T = 8;
    const BaseDtype dtypes[3] = {BASE_DTYPE_Q8_0, BASE_DTYPE_Q4_K, BASE_DTYPE_MXFP4};
    for (int k = 0; k < 3; k++) {
        const ModelConfig c = q_config(dtypes[k]);
        const LoraSpec l = all_linear();
        int32_t* tokens = malloc_check((size_t)Q_STEPS * B * (T + 1) * sizeof(int32_t));
        Rng r;
        rng_seed(&r, 21 + k);
        for (int i = 0; i < Q_STEPS * B * (T + 1); i++) tokens[i] = (int32_t)rng_below(&r, c.V);
        const struct { int N; double budget; int sync; } cases[] = {{1, 0, 1}, {3, 2.0e5, 1},
                                                                    {2, 0, 0}};
        for (size_t j = 0; j < sizeof cases / sizeof cases[0]; j++) {
            const double budget = cases[j].budget * (dtypes[k] == BASE_DTYPE_Q4_K ? 30 : 1);
            QRun a, b;
            float* deq = NULL;
            if (q_engine(t, &a, &c, &l, dtypes[k], NULL, cases[j].N, budget, cases[j].sync, tokens,
                         B, T, &deq) != 0)
                continue;
            if (q_engine(t, &b, &c, &l, BASE_DTYPE_BF16, deq, cases[j].N, budget, cases[j].sync,
                         tokens, B, T, NULL) == 0) {
                int same = a.n_params == b.n_params &&
                           memcmp(a.params, b.params, (size_t)a.n_params * sizeof(float)) == 0;
                for (int s = 0; s < Q_STEPS; s++) same &= a.loss[s] == b.loss[s];
                CHECK(t, same, "%s case %zu: losses %.9g %.9g %.9g vs the dequantised weights' "
                      "%.9g %.9g %.9g", quant_base_dtype_name(dtypes[k]), j, a.loss[0], a.loss[1],
                      a.loss[2], b.loss[0], b.loss[1], b.loss[2]);
                CHECK(t, a.param_up < b.param_up, "%s case %zu: %llu parameter bytes up vs %llu",
                      quant_base_dtype_name(dtypes[k]), j, (unsigned long long)a.param_up,
                      (unsigned long long)b.param_up);
                CHECK(t, isfinite(a.loss[0]) && isfinite(a.loss[Q_STEPS - 1]), "%s: finite losses",
                      quant_base_dtype_name(dtypes[k]));
                free(b.params);
            }
            free(a.params);
            free(deq);
        }
        free(tokens);
    }
}

// ----------------------------------------------------------------------------
// a streamed base (store_create_streamed)

// The same init twice: held (fp32, the base quantised after it, as the loader does) into a, and
// streamed (the blocks made by the init; bf16: the GPUs' Store with base16) into b.
static void q_held_and_streamed(const Model* m, const ModelConfig* c, int bf16, Store* a,
                                Store* b) {
    store_create(a, &m->tt);
    store_init_random(a, 7, 0.2f);
    store_quantize_base(a, NULL, c);
    store_create_streamed(b, &m->tt, bf16);
    store_init_random(b, 7, 0.2f);
}

// The streamed init makes the blocks store_quantize_base makes of the fp32 init, byte for byte,
// and the same fp32 values for the frozen tensors it holds in fp32; the engine's runs on the
// two Stores (one and three devices, sync and one-step-delayed) give bit-identical losses and
// adapters, for q8_0, q4_k and mxfp4.
static void test_quant_streamed_engine(TestCtx* t) {
    char err[ERR_LEN];
    const int B = 4, T = 8;
    const BaseDtype dtypes[3] = {BASE_DTYPE_Q8_0, BASE_DTYPE_Q4_K, BASE_DTYPE_MXFP4};
    for (int k = 0; k < 3; k++) {
        const char* name = quant_base_dtype_name(dtypes[k]);
        const ModelConfig c = q_config(dtypes[k]);
        const LoraSpec l = all_linear();
        Model m;
        CHECK(t, model_init_lora(&m, &c, 0, &l, err) == 0, "%s", err);
        CHECK(t, quant_table_set(&m.tt, dtypes[k], NULL, &c, err) == 0, "%s", err);
        Store a, b;
        q_held_and_streamed(&m, &c, 0, &a, &b);
        store_quantize_base(&b, NULL, &c);  // (a streamed Store: nothing to do)
        int n_q = 0, same_q = 0, n_f = 0, same_f = 0;
        for (int i = 0; i < m.tt.n; i++) {
            const TensorDesc* d = &m.tt.t[i];
            if (d->trainable || d->tied_to >= 0) continue;
            if (d->qtype) {
                n_q++;
                same_q += memcmp(a.qblocks[i], b.qblocks[i], quant_tensor_bytes(d, 0)) == 0;
            } else {
                n_f++;
                same_f += memcmp(store_param(&a, i), store_param(&b, i),
                                 (size_t)d->numel * sizeof(float)) == 0;
            }
        }
        CHECK(t, n_q > 0 && same_q == n_q, "%s: %d of %d tensors' blocks as the fp32 init's", name,
              same_q, n_q);
        CHECK(t, n_f > 0 && same_f == n_f, "%s: %d of %d fp32 frozen tensors as the fp32 init's",
              name, same_f, n_f);
        store_free(&a);
        store_free(&b);
        model_free(&m);

        int32_t* tokens = malloc_check((size_t)Q_STEPS * B * (T + 1) * sizeof(int32_t));
        Rng r;
        rng_seed(&r, 41 + k);
        for (int i = 0; i < Q_STEPS * B * (T + 1); i++) tokens[i] = (int32_t)rng_below(&r, c.V);
        const struct { int N; double budget; int sync; } cases[] = {{1, 0, 1}, {3, 2.0e5, 1},
                                                                    {2, 0, 0}, {3, 2.0e5, 0}};
        for (size_t j = 0; j < sizeof cases / sizeof cases[0]; j++) {
            const double budget = cases[j].budget * (dtypes[k] == BASE_DTYPE_Q4_K ? 30 : 1);
            QRun x, y;
            if (q_engine_on(t, &device_cpu_impl, 0, &x, &c, &l, dtypes[k], NULL, cases[j].N,
                            budget, cases[j].sync, tokens, B, T, NULL) != 0)
                continue;
            if (q_engine_on(t, &device_cpu_impl, Q_STREAMED, &y, &c, &l, dtypes[k], NULL,
                            cases[j].N, budget, cases[j].sync, tokens, B, T, NULL) == 0) {
                // (x holds every slab, y the adapters: compare the adapters, the slabs' tails)
                int64_t o = 0, p = 0;
                int same = 1;
                Model mm;
                model_init_lora(&mm, &c, 0, &l, err);
                for (int L = 0; L < mm.tt.n_layers; L++) {
                    const int64_t head = mm.tt.param_numel[L] - mm.tt.state_numel[L];
                    same &= memcmp(x.params + o + head, y.params + p,
                                   (size_t)mm.tt.state_numel[L] * sizeof(float)) == 0;
                    o += mm.tt.param_numel[L];
                    p += mm.tt.state_numel[L];
                }
                model_free(&mm);
                for (int s = 0; s < Q_STEPS; s++) same &= x.loss[s] == y.loss[s];
                CHECK(t, same && p == y.n_params, "%s case %zu: streamed losses %.9g %.9g %.9g vs "
                      "%.9g %.9g %.9g (or adapters differ)", name, j, y.loss[0], y.loss[1],
                      y.loss[2], x.loss[0], x.loss[1], x.loss[2]);
                CHECK(t, x.param_up == y.param_up, "%s case %zu: %llu parameter bytes up vs %llu",
                      name, j, (unsigned long long)y.param_up, (unsigned long long)x.param_up);
                free(y.params);
            }
            free(x.params);
        }
        free(tokens);
    }
}

// One streamed load of the GGUF at path (its source src) into a fresh Store: the base in bd
// (bf16: the GPUs' Store, Store.base16), slices of slice_bytes; 0 when loaded.
static int q_sliced_load(const ModelSource* src, const LoraSpec* l, BaseDtype bd, int bf16,
                         double slice_bytes, Model* m, Store* s, int* n_sliced, char* err) {
    if (model_init_lora(m, &src->cfg, 0, l, err) != 0) fatal("q_sliced_load: %s", err);
    if (quant_table_set(&m->tt, bd, &src->gguf, &src->cfg, err) != 0)
        fatal("q_sliced_load: %s", err);
    store_create_streamed(s, &m->tt, bf16);
    return loader_load_gguf_sliced(s, &src->gguf, &src->cfg, slice_bytes, NULL, n_sliced, err);
}

// The frozen tensors of two streamed Stores of one table the same, bit for bit (blocks, bf16
// copies, fp32 values); how many differ.
static int q_stores_differ(const Model* m, const Store* a, const Store* b) {
    int bad = 0;
    for (int i = 0; i < m->tt.n; i++) {
        const TensorDesc* d = &m->tt.t[i];
        if (d->trainable || d->tied_to >= 0 || d->lora_target >= 0) continue;
        if (d->qtype)
            bad += memcmp(a->qblocks[i], b->qblocks[i], quant_tensor_bytes(d, 0)) != 0;
        else if (store_streams_tensor(a, i))
            bad += memcmp(a->base16[d->owner_layer] + d->param_offset,
                          b->base16[d->owner_layer] + d->param_offset,
                          (size_t)d->numel * sizeof(uint16_t)) != 0;
        else
            bad += memcmp(store_param(a, i), store_param(b, i),
                          (size_t)d->numel * sizeof(float)) != 0;
    }
    return bad;
}

// A streamed base loaded from a GGUF in slices (loader.c: load_gguf_sliced, a bounded staging
// per thread) is the whole tensors' load bit for bit: MoE experts rearranged expert by expert
// (Qwen3-MoE's gate/up parts, GPT-OSS's transposed down and interleaved biases), rows of one
// part, the GGUF's own blocks kept (--base-dtype keep), into blocks and into bf16; slices of one
// row or expert and of several with a shorter last one. Non-finite values give the whole read's
// message (the first in the file's order, not the first slice's).
static void test_quant_streamed_sliced_load(TestCtx* t) {
    char err[ERR_LEN], path[1024];
    const LoraSpec l = all_linear();
    struct {
        const char* spec;  // a preset (exported here) or a fixture
        ExportDtype dt;
    } srcs[] = {{"test-qwen3moe", EXPORT_F32}, {"test-gptoss", EXPORT_BF16},
                {"test-llama", EXPORT_F16}, {"dev/gguf/fixtures/qwen3_q8_0.gguf", EXPORT_F32},
                {"dev/gguf/fixtures/qwen3_mxfp4.gguf", EXPORT_F32}};
    for (size_t k = 0; k < sizeof srcs / sizeof srcs[0]; k++) {
        const int fixture = strchr(srcs[k].spec, '/') != NULL;
        if (fixture && access(srcs[k].spec, F_OK) != 0) {
            test_skip(t, "no fixture %s", srcs[k].spec);
            continue;
        }
        if (fixture) {
            snprintf(path, sizeof path, "%s", srcs[k].spec);
        } else {  // a random model of the preset, widths whole q8_0 blocks, exported
            ModelConfig c;
            CHECK(t, config_from_preset(&c, srcs[k].spec, err) == 0, "%s", err);
            c.C = 64;
            c.H = 4;
            c.KVH = 2;
            c.HD = 16;
            c.F = 64;
            if (c.E > 0) c.F_expert = 32;
            memset(c.mlp_only, 0, sizeof c.mlp_only);  // (llama.cpp's qwen3moe: every block MoE)
            c.decoder_sparse_step = c.decoder_sparse_step > 0 ? 1 : 0;
            Model m0;
            Store s0;
            CHECK(t, model_init(&m0, &c, 0, err) == 0, "%s", err);
            store_create(&s0, &m0.tt);
            store_init_random(&s0, 11 + (uint32_t)k, 0.2f);
            test_path(t, path, sizeof path, "sliced.gguf");
            const int rc = checkpoint_export_gguf(path, &m0, &s0, srcs[k].dt, NULL, err);
            CHECK(t, rc == 0, "%s", err);
            store_free(&s0);
            model_free(&m0);
            if (rc != 0) continue;
        }
        ModelSource src;
        if (checkpoint_resolve_model(&src, path, err) != 0) {
            CHECK(t, 0, "%s", err);
            continue;
        }
        const struct { BaseDtype bd; int bf16; } modes[] = {
            {fixture ? BASE_DTYPE_KEEP : BASE_DTYPE_Q8_0, 0},
            {fixture ? BASE_DTYPE_KEEP : BASE_DTYPE_Q8_0, 1},
            {BASE_DTYPE_BF16, 1}};
        for (size_t j = 0; j < sizeof modes / sizeof modes[0]; j++) {
            Model ma;
            Store a;
            int n_whole = -1;
            CHECK(t, q_sliced_load(&src, &l, modes[j].bd, modes[j].bf16, 1e30, &ma, &a, &n_whole,
                                   err) == 0 && n_whole == 0,
                  "%s mode %zu, whole: %s (%d sliced)", path, j, err, n_whole);
            const double slices[2] = {1.0, 3000.0};  // (one row or expert; several rows)
            for (int q = 0; q < 2; q++) {
                Model mb;
                Store b;
                int n_sliced = 0;
                CHECK(t, q_sliced_load(&src, &l, modes[j].bd, modes[j].bf16, slices[q], &mb, &b,
                                       &n_sliced, err) == 0,
                      "%s mode %zu slices of %.0f B: %s", path, j, slices[q], err);
                const int bad = q_stores_differ(&ma, &a, &b);
                CHECK(t, n_sliced > 0 && bad == 0,
                      "%s mode %zu slices of %.0f B: %d tensors sliced, %d differ", srcs[k].spec,
                      j, slices[q], n_sliced, bad);
                store_free(&b);
                model_free(&mb);
            }
            store_free(&a);
            model_free(&ma);
        }
        checkpoint_close_source(&src);
    }
    // a NaN in the last expert of Qwen3-MoE's up projection: the same message either way
    ModelConfig c;
    CHECK(t, config_from_preset(&c, "test-qwen3moe", err) == 0, "%s", err);
    c.C = 64;
    c.H = 4;
    c.KVH = 2;
    c.HD = 16;
    c.F_expert = 32;
    memset(c.mlp_only, 0, sizeof c.mlp_only);
    c.decoder_sparse_step = 1;
    Model m0;
    Store s0;
    CHECK(t, model_init(&m0, &c, 0, err) == 0, "%s", err);
    store_create(&s0, &m0.tt);
    store_init_random(&s0, 5, 0.2f);
    test_path(t, path, sizeof path, "sliced_nan.gguf");
    int rc = checkpoint_export_gguf(path, &m0, &s0, EXPORT_F32, NULL, err);
    CHECK(t, rc == 0, "%s", err);
    store_free(&s0);
    model_free(&m0);
    // (the export refuses a NaN: written into the file) in the first expert of the up part and
    // the last of the gate part: the whole read meets the gate's first, slices the up's
    GgufFile g;
    long at[2] = {-1, -1};
    if (rc == 0 && gguf_open(&g, path, err) == 0) {
        const GgufTensor* gate = gguf_find_tensor(&g, "blk.0.ffn_gate_exps.weight");
        const GgufTensor* up = gguf_find_tensor(&g, "blk.0.ffn_up_exps.weight");
        if (gate && up && gate->type == GGML_TYPE_F32 && up->type == GGML_TYPE_F32) {
            at[0] = (long)(gate->data - g.map) + (long)(4 * (gate->numel - 1));
            at[1] = (long)(up->data - g.map);
        }
        gguf_close(&g);
    }
    FILE* fp = at[0] > 0 ? fopen(path, "r+b") : NULL;
    const float nan = NAN;
    rc = fp ? 0 : -1;
    for (int k = 0; k < 2 && rc == 0; k++)
        rc = fseek(fp, at[k], SEEK_SET) == 0 && fwrite(&nan, 4, 1, fp) == 1 ? 0 : -1;
    if (fp && fclose(fp) != 0) rc = -1;
    CHECK(t, rc == 0, "could not write NaNs into %s", path);
    ModelSource src;
    if (rc != 0 || checkpoint_resolve_model(&src, path, err) != 0) {
        CHECK(t, 0, "%s", err);
        return;
    }
    char whole[ERR_LEN] = "", sliced[ERR_LEN] = "";
    Model ma, mb;
    Store a, b;
    const int ra = q_sliced_load(&src, &l, BASE_DTYPE_Q8_0, 0, 1e30, &ma, &a, NULL, whole);
    const int rb = q_sliced_load(&src, &l, BASE_DTYPE_Q8_0, 0, 1.0, &mb, &b, NULL, sliced);
    CHECK(t, ra == -1 && rb == -1 && strstr(whole, "ffn_gate_exps.weight': element") &&
                 strstr(whole, "NaN") && strcmp(whole, sliced) == 0,
          "a NaN: whole %d '%s', sliced %d '%s'", ra, whole, rb, sliced);
    store_free(&a);
    store_free(&b);
    model_free(&ma);
    model_free(&mb);
    checkpoint_close_source(&src);
}

// One layer wide enough that its frozen slabs are fresh mappings (tens of MiB), whose pages the
// streamed-base tests can watch; F: the MLP width.
static ModelConfig q_paged_config(BaseDtype q, int F) {
    ModelConfig c = q_config(q);
    c.C = 1024;
    c.H = 8;
    c.KVH = 4;
    c.HD = 128;
    c.F = F;
    c.L = 1;
    return c;
}

// A streamed init never touches the block-format tensors' part of the frozen heads: their pages
// stay out of memory (mincore), where the fp32 init's Store has all of them; layers of 60 MiB
// (slabs that big are fresh mappings, never recycled heap pages).
static void test_quant_streamed_pages(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c = q_paged_config(BASE_DTYPE_Q4_K, 2048);
    const LoraSpec l = all_linear();
    Model m;
    CHECK(t, model_init_lora(&m, &c, 0, &l, err) == 0, "%s", err);
    CHECK(t, quant_table_set(&m.tt, BASE_DTYPE_Q4_K, NULL, &c, err) == 0, "%s", err);
    for (int streamed = 0; streamed < 2; streamed++) {
        Store s;
        if (streamed)
            store_create_streamed(&s, &m.tt, 0);
        else
            store_create(&s, &m.tt);
        store_init_random(&s, 7, 0.2f);
        store_quantize_base(&s, NULL, &c);
        double bytes = 0.0, resident = 0.0;
        for (int i = 0; i < m.tt.n; i++) {
            const TensorDesc* d = &m.tt.t[i];
            if (!d->qtype) continue;
            // (the tensor's range less 2 MiB at each end: writing a neighbour may bring in the
            // transparent huge page it shares with it)
            const size_t edge = (size_t)2 << 20, n = (size_t)d->numel * sizeof(float);
            if (n <= 2 * edge) continue;
            const char* p = (const char*)(s.param[d->owner_layer] + d->param_offset);
            bytes += (double)(n - 2 * edge);
            resident += test_resident_bytes(p + edge, n - 2 * edge);
        }
        if (streamed)
            CHECK(t, bytes > 10e6 && resident < 0.01 * bytes, "streamed: %.0f of the %.0f fp32 "
                  "bytes of the block-format tensors in memory", resident, bytes);
        else
            CHECK(t, resident > 0.9 * bytes, "the fp32 init: only %.0f of %.0f bytes in memory",
                  resident, bytes);
        store_free(&s);
    }
    model_free(&m);
}

// A streamed base held in bf16 (store_create_streamed with bf16, the GPUs' Store): every frozen
// tensor not in blocks is in base16 as the bf16 of the fp32 init's values (what the engine's
// conversion makes of them), the block-format tensors' blocks are the fp32 init's, and none of
// the fp32 frozen heads is in memory; store_base16_bytes counts what base16 holds.
static void test_quant_streamed_bf16(TestCtx* t) {
    char err[ERR_LEN];
    for (int q = 0; q < 2; q++) {  // a bf16 base, then a q8_0 one (its norms, embeddings in bf16)
        ModelConfig c = q_paged_config(BASE_DTYPE_Q8_0, 4096);
        const LoraSpec l = all_linear();
        Model m;
        CHECK(t, model_init_lora(&m, &c, 0, &l, err) == 0, "%s", err);
        CHECK(t, quant_table_set(&m.tt, q ? BASE_DTYPE_Q8_0 : BASE_DTYPE_BF16, NULL, &c, err) == 0,
              "%s", err);
        Store a, b;
        q_held_and_streamed(&m, &c, 1, &a, &b);
        int64_t bad = 0, held = 0;
        double bytes = 0.0, resident = 0.0;
        for (int i = 0; i < m.tt.n; i++) {
            const TensorDesc* d = &m.tt.t[i];
            if (d->trainable || d->tied_to >= 0) continue;
            CHECK(t, store_streams_tensor(&b, i), "%s is not streamed", d->name);
            if (d->qtype) {
                bad += memcmp(a.qblocks[i], b.qblocks[i], quant_tensor_bytes(d, 0)) != 0;
            } else {
                const float* x = a.param[d->owner_layer] + d->param_offset;
                const uint16_t* y = b.base16[d->owner_layer] + d->param_offset;
                for (int64_t j = 0; j < d->numel; j++) bad += y[j] != f32_to_bf16(x[j]);
                held += d->numel;
            }
            const size_t edge = (size_t)2 << 20, n = (size_t)d->numel * sizeof(float);
            if (n <= 2 * edge) continue;
            const char* p = (const char*)(b.param[d->owner_layer] + d->param_offset);
            bytes += (double)(n - 2 * edge);
            resident += test_resident_bytes(p + edge, n - 2 * edge);
        }
        CHECK(t, bad == 0, "q %d: %lld values or blocks differ from the fp32 init's", q,
              (long long)bad);
        CHECK(t, held > 0 && store_base16_bytes(&m.tt) == 2.0 * (double)held,
              "q %d: store_base16_bytes %.0f for %lld bf16 values", q, store_base16_bytes(&m.tt),
              (long long)held);
        CHECK(t, bytes > 10e6 && resident < 0.01 * bytes, "q %d: %.0f of the %.0f fp32 bytes of the frozen "
              "tensors in memory", q, resident, bytes);
        store_free(&a);
        store_free(&b);
        model_free(&m);
    }
}

// ----------------------------------------------------------------------------
// the CLI

static void test_quant_cli_refusals(TestCtx* t) {
    struct {
        const char* args;
        const char* must;
    } cases[] = {
        {"--base-dtype q8_0", "LoRA runs only"},
        {"--lora-r 4 --base-dtype q5_k", "unknown"},
        {"--lora-r 4 --base-dtype q4_k", "not a multiple of q4_k's 256-element blocks"},
        {"--lora-r 4 --base-dtype keep", "not a GGUF file"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char args[512];
        snprintf(args, sizeof args, "--steps 1 --val '' --sample-tokens 0 %s", cases[k].args);
        int rc = test_run_cli(t, "qflags", args);
        char* err = test_read_output(t, "qflags", "err");
        CHECK(t, rc != 0 && test_one_error_line(err, cases[k].must),
              "'%s': exit %d, '%s' (want '%s')", cases[k].args, rc, err, cases[k].must);
        free(err);
    }
}

// Plain and engine (sync) runs on a q8_0 base log the same losses; a resumed engine run (the
// one-step-delayed default) the straight run's; --plan counts the blocks.
static void test_quant_cli_train(TestCtx* t) {
    char args[4096], la[1024], lb[1024];
    const char* common = "--val '' --sample-tokens 0 --threads 1 --lora-r 4 --lora-dropout 0.1 "
                         "--lr 1e-2 -m 2 --base-dtype q8_0";
    test_path(t, la, sizeof la, "q_plain.jsonl");
    test_path(t, lb, sizeof lb, "q_sync.jsonl");
    snprintf(args, sizeof args, "%s --steps 3 --log '%s'", common, la);
    CHECK(t, test_run_cli(t, "qplain", args) == 0, "plain run on a q8_0 base");
    char* so = test_read_output(t, "qplain", "out");
    CHECK(t, strstr(so, "held as ggml blocks (--base-dtype q8_0)"), "the base line: %s", so);
    free(so);
    snprintf(args, sizeof args, "%s --steps 3 --log '%s' --device cpu:2 --sync 1 --device-mem 6M",
             common, lb);
    CHECK(t, test_run_cli(t, "qsync", args) == 0, "engine run on a q8_0 base");
    so = test_read_output(t, "qsync", "out");
    CHECK(t, strstr(so, "parameter uploads per round: "), "the plan's upload line: %s", so);
    free(so);
    test_same_steps(t, "plain vs engine", la, lb, 1, 3);
    snprintf(args, sizeof args, "%s --device cpu:2 --device-mem 6M", common);
    TestResumeRuns r;
    test_resume_runs(t, &r, "q_r", args, 4, 2, 2);

    // --plan: the base's host bytes as blocks (tiny: 4 blocks of 7 linears in q8_0)
    snprintf(args, sizeof args, "--lora-r 4 --plan --device cpu:2 --base-dtype mxfp4");
    CHECK(t, test_run_cli(t, "qplan", args) == 0, "--plan");
    so = test_read_output(t, "qplan", "out");
    CHECK(t, strstr(so, "parameter uploads per round: ") && strstr(so, "(the base as ggml blocks"),
          "--plan's upload line: %s", so);
    free(so);
}

// The default model exported as a bf16 safetensors checkpoint into the test directory's `name`
// (its path into m), by a run tagged `tag`: the mapped-base tests' --model.
static void q_bf16_checkpoint(TestCtx* t, const char* name, const char* tag, char* m, size_t cap) {
    char args[2048];
    test_path(t, m, cap, name);
    snprintf(args, sizeof args, "--steps 0 --val '' --sample-tokens 0 --export-hf '%s' "
             "--export-dtype bf16", m);
    CHECK(t, test_run_cli(t, tag, args) == 0, "a bf16 checkpoint");
}

// --mmap-base: the base read from the mapped checkpoint on every upload gives the losses of the
// run that holds it (a bf16 safetensors export of the default model; sync and delayed, resumed);
// --plan's host line; refusals.
static void test_quant_cli_mmap(TestCtx* t) {
    char args[8192], m[1024], la[1024], lb[1024], ob[1024], lc[1024];
    q_bf16_checkpoint(t, "q_bf16_model", "qexport", m, sizeof m);
    test_path(t, la, sizeof la, "q_held.jsonl");
    test_path(t, lb, sizeof lb, "q_mapped.jsonl");
    test_path(t, lc, sizeof lc, "q_mapped2.jsonl");
    test_path(t, ob, sizeof ob, "q_mapped_out");
    for (int sync = 1; sync >= 0; sync--) {
        char common[2048];
        snprintf(common, sizeof common, "--model '%s' --val '' --sample-tokens 0 --threads 1 "
                 "--lora-r 4 --lora-dropout 0.1 --lr 1e-2 -m 2 --device cpu:2 --device-mem 6M "
                 "--sync %d --steps 4", m, sync);
        snprintf(args, sizeof args, "%s --log '%s'", common, la);
        CHECK(t, test_run_cli(t, "qheld", args) == 0, "the base held (sync %d)", sync);
        if (sync) {
            snprintf(args, sizeof args, "%s --mmap-base --log '%s'", common, lb);
            CHECK(t, test_run_cli(t, "qmapped", args) == 0, "the base mapped");
        } else {  // (in two parts: a resumed run maps it again)
            snprintf(args, sizeof args, "%s --mmap-base --log '%s' --out '%s' --save-every 2 "
                     "--steps 2", common, lb, ob);
            CHECK(t, test_run_cli(t, "qmapped", args) == 0, "the base mapped, first part");
            snprintf(args, sizeof args, "%s --mmap-base --log '%s' --out '%s' --save-every 2 "
                     "--resume", common, lc, ob);
            CHECK(t, test_run_cli(t, "qmapped2", args) == 0, "the base mapped, resumed");
        }
        // (the records' timings differ, and test_same_steps leaves them out: the losses and
        // norms are what must agree)
        char what[64];
        snprintf(what, sizeof what, "sync %d, held vs mapped", sync);
        test_same_steps(t, what, la, lb, 1, sync ? 4 : 2);
        if (!sync) test_same_steps(t, "sync 0, held vs mapped (resumed)", la, lc, 3, 4);
    }
    // a GGUF (F32 tensors, Qwen3: no layout change on load)
    const char* gg = "--model dev/gguf/fixtures/qwen3_f32.gguf --lora-r 4 --steps 2 --val '' "
                     "--sample-tokens 0 --threads 1 -m 2 --device cpu:2 --sync 1 --seq 16 --batch 4";
    snprintf(args, sizeof args, "%s --log '%s'", gg, la);
    CHECK(t, test_run_cli(t, "qgheld", args) == 0, "GGUF, the base held");
    snprintf(args, sizeof args, "%s --mmap-base --log '%s'", gg, lb);
    CHECK(t, test_run_cli(t, "qgmapped", args) == 0, "GGUF, the base mapped");
    test_same_steps(t, "GGUF, held vs mapped", la, lb, 1, 2);
    snprintf(args, sizeof args, "--model '%s' --lora-r 4 --plan --device cpu:2 --mmap-base", m);
    CHECK(t, test_run_cli(t, "qmplan", args) == 0, "--plan --mmap-base");
    char* so = test_read_output(t, "qmplan", "out");
    CHECK(t, strstr(so, "the frozen base mapped from"), "--plan's host line: %s", so);
    free(so);
    struct {
        const char* args;
        const char* must;
    } cases[] = {
        {"--mmap-base", "LoRA runs only"},
        {"--lora-r 4 --mmap-base", "needs the RoundPipe engine"},
        {"--lora-r 4 --mmap-base --device cpu:2 --val data/tiny_val.bin", "--val '' --sample-tokens 0"},
        {"--lora-r 4 --mmap-base --device cpu:2", "no checkpoint to map"},
        {"--lora-r 4 --mmap-base --device cpu:2 --model dev/gguf/fixtures/llama_bf16.gguf",
         "needs a layout change on load"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(args, sizeof args, "--steps 1 --val '' --sample-tokens 0 %s", cases[k].args);
        int rc = test_run_cli(t, "qmflags", args);
        char* err = test_read_output(t, "qmflags", "err");
        CHECK(t, rc != 0 && test_one_error_line(err, cases[k].must),
              "'%s': exit %d, '%s' (want '%s')", cases[k].args, rc, err, cases[k].must);
        free(err);
    }
}

// The CLI streams a block-format base on the engine when nothing reads it in fp32 (--val '',
// --sample-tokens 0, no HF / GGUF export) and holds it in fp32 otherwise (--val): the same
// losses either way, from the random init (q8_0 sync, mxfp4 delayed) and from a
// safetensors checkpoint; --plan says which; --out holds the adapters.
static void test_quant_cli_streamed(TestCtx* t) {
    char args[8192], la[1024], lb[1024], m[1024], o[1024];
    test_path(t, la, sizeof la, "q_held_fp32.jsonl");
    test_path(t, lb, sizeof lb, "q_streamed.jsonl");
    test_path(t, m, sizeof m, "q_st_model");
    test_path(t, o, sizeof o, "q_st_out");
    const char* dts[2] = {"q8_0", "mxfp4"};
    for (int k = 0; k < 2; k++) {
        const int sync = k == 0;  // (q8_0 sync, mxfp4 one-step-delayed)
        char common[1024], what[64];
        snprintf(common, sizeof common, "--sample-tokens 0 --threads 1 --lora-r 4 "
                 "--lora-dropout 0.1 --lr 1e-2 -m 2 --device cpu:2 --device-mem 6M --steps 3 "
                 "--eval-every 0 --base-dtype %s --sync %d", dts[k], sync);
        snprintf(args, sizeof args, "%s --val data/tiny_val.bin --log '%s'", common, la);
        CHECK(t, test_run_cli(t, "qsheld", args) == 0, "%s sync %d: the fp32 base held",
              dts[k], sync);
        snprintf(args, sizeof args, "%s --val '' --log '%s' --out '%s'", common, lb, o);
        CHECK(t, test_run_cli(t, "qsstream", args) == 0, "%s sync %d: streamed", dts[k], sync);
        snprintf(what, sizeof what, "%s sync %d", dts[k], sync);
        test_same_steps(t, what, la, lb, 1, 3);
        char* so = test_read_output(t, "qsstream", "out");
        CHECK(t, strstr(so, "saved the LoRA adapters"), "--out of a streamed base: %s", so);
        free(so);
    }
    // from a safetensors checkpoint (the loader quantises each part as it converts it)
    snprintf(args, sizeof args, "--steps 0 --val '' --sample-tokens 0 --export-hf '%s'", m);
    CHECK(t, test_run_cli(t, "qsexport", args) == 0, "a checkpoint");
    char common[2048];
    snprintf(common, sizeof common, "--model '%s' --sample-tokens 0 --threads 1 --lora-r 4 --lr "
             "1e-2 -m 2 --device cpu:2 --device-mem 6M --steps 3 --eval-every 0 --base-dtype "
             "q8_0", m);
    snprintf(args, sizeof args, "%s --val data/tiny_val.bin --log '%s'", common, la);
    CHECK(t, test_run_cli(t, "qsheld", args) == 0, "safetensors: the fp32 base held");
    snprintf(args, sizeof args, "%s --val '' --log '%s'", common, lb);
    CHECK(t, test_run_cli(t, "qsstream", args) == 0, "safetensors: streamed");
    test_same_steps(t, "safetensors", la, lb, 1, 3);
    // --plan
    const char* plan = "--lora-r 4 --plan --device cpu:2 --base-dtype q8_0 --sample-tokens 0";
    snprintf(args, sizeof args, "%s --val ''", plan);
    CHECK(t, test_run_cli(t, "qsplan", args) == 0, "--plan, streamed");
    char* so = test_read_output(t, "qsplan", "out");
    CHECK(t, strstr(so, "no fp32 base: the random init quantises each tensor"), "%s", so);
    free(so);
    snprintf(args, sizeof args, "%s --val data/tiny_val.bin", plan);
    CHECK(t, test_run_cli(t, "qsplan", args) == 0, "--plan, held");
    so = test_read_output(t, "qsplan", "out");
    CHECK(t, strstr(so, "plus the Store's fp32 base"), "%s", so);
    free(so);
}

// ----------------------------------------------------------------------------
// the GPU's dequantiser against the CPU's (bf16 of the same fp32 values: exact)

#ifdef HAVE_CUDA
#include "../../kernels/dequant.h"
#include "../../kernels/kernels.h"

// The engine on GPUs: a quantised base (blocks up, kernels/dequant.cu) trains as the bf16 base
// holding the dequantised weights (the same bf16 bits on the device: losses equal up to the
// GPU's own run-to-run differences), and releasing the Store's base changes nothing.
static void test_quant_gpu_engine(TestCtx* t) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return;
    }
    const int B = 4, T = 8;
    const BaseDtype dtypes[3] = {BASE_DTYPE_Q8_0, BASE_DTYPE_Q4_K, BASE_DTYPE_MXFP4};
    for (int k = 0; k < 3; k++) {
        const ModelConfig c = q_config(dtypes[k]);
        const LoraSpec l = all_linear();
        int32_t* tokens = malloc_check((size_t)Q_STEPS * B * (T + 1) * sizeof(int32_t));
        Rng r;
        rng_seed(&r, 31 + k);
        for (int i = 0; i < Q_STEPS * B * (T + 1); i++) tokens[i] = (int32_t)rng_below(&r, c.V);
        QRun a, b, rel;
        float* deq = NULL;
        const char* name = quant_base_dtype_name(dtypes[k]);
        if (q_engine_on(t, &device_cuda_impl, 0, &a, &c, &l, dtypes[k], NULL, 1, 0, 1, tokens, B, T,
                        &deq) == 0) {
            if (q_engine_on(t, &device_cuda_impl, 0, &b, &c, &l, BASE_DTYPE_BF16, deq, 1, 0, 1,
                            tokens, B, T, NULL) == 0) {
                for (int s = 0; s < Q_STEPS; s++)
                    CHECK(t, fabs(a.loss[s] - b.loss[s]) <= 1e-5 * fabs(b.loss[s]),
                          "%s step %d: loss %.7f vs %.7f on the dequantised bf16 base", name, s,
                          a.loss[s], b.loss[s]);
                CHECK(t, a.param_up < b.param_up, "%s: %llu parameter bytes up vs %llu", name,
                      (unsigned long long)a.param_up, (unsigned long long)b.param_up);
                printf("  %s: loss %.6f (dequantised bf16 base %.6f), parameter bytes up %llu vs "
                       "%llu\n", name, a.loss[Q_STEPS - 1], b.loss[Q_STEPS - 1],
                       (unsigned long long)a.param_up, (unsigned long long)b.param_up);
                free(b.params);
            }
            if (q_engine_on(t, &device_cuda_impl, 1, &rel, &c, &l, dtypes[k], NULL, 1, 0, 1, tokens,
                            B, T, NULL) == 0) {
                int same = 1;
                for (int s = 0; s < Q_STEPS; s++) same &= rel.loss[s] == a.loss[s];
                CHECK(t, same, "%s: releasing the Store's base changes the losses", name);
                QRun st;
                if (q_engine_on(t, &device_cuda_impl, Q_RELEASE | Q_STREAMED | Q_BF16, &st, &c,
                                &l, dtypes[k], NULL, 1, 0, 1, tokens, B, T, NULL) == 0) {
                    same = st.n_params == rel.n_params &&
                           memcmp(st.params, rel.params, (size_t)st.n_params * 4) == 0;
                    for (int s = 0; s < Q_STEPS; s++) same &= st.loss[s] == a.loss[s];
                    CHECK(t, same, "%s: the streamed base changes the losses or adapters", name);
                    free(st.params);
                }
                free(rel.params);
            }
            free(a.params);
        }
        free(deq);
        free(tokens);
    }
    // a bf16 base streamed (Store.base16: never in fp32, the engine uploads from the Store's bf16
    // copy) is the run whose engine converts the Store's fp32 base, sync and delayed, on one and
    // on two GPUs (several stages)
    const ModelConfig c = q_config(BASE_DTYPE_BF16);
    const LoraSpec l = all_linear();
    const int n_gpus = cuda_device_count() > 1 ? 2 : 1;
    int32_t* tokens = malloc_check((size_t)Q_STEPS * B * (T + 1) * sizeof(int32_t));
    Rng r;
    rng_seed(&r, 37);
    for (int i = 0; i < Q_STEPS * B * (T + 1); i++) tokens[i] = (int32_t)rng_below(&r, c.V);
    for (int N = 1; N <= n_gpus; N++)
        for (int sync = 1; sync >= 0; sync--) {
            QRun rel, st;
            if (q_engine_on(t, &device_cuda_impl, Q_RELEASE, &rel, &c, &l, BASE_DTYPE_BF16, NULL,
                            N, 0, sync, tokens, B, T, NULL) != 0)
                continue;
            if (q_engine_on(t, &device_cuda_impl, Q_RELEASE | Q_STREAMED | Q_BF16, &st, &c, &l,
                            BASE_DTYPE_BF16, NULL, N, 0, sync, tokens, B, T, NULL) == 0) {
                int same = st.n_params == rel.n_params &&
                           memcmp(st.params, rel.params, (size_t)st.n_params * 4) == 0;
                for (int s = 0; s < Q_STEPS; s++) same &= st.loss[s] == rel.loss[s];
                CHECK(t, same, "bf16 base, %d GPU(s), sync %d: the streamed base changes the "
                      "losses or adapters", N, sync);
                printf("  bf16 streamed, %d GPU(s), sync %d: loss %.6f (converted %.6f)\n", N, sync,
                       st.loss[Q_STEPS - 1], rel.loss[Q_STEPS - 1]);
                free(st.params);
            }
            free(rel.params);
        }
    free(tokens);
}

static void test_quant_gpu_dequant(TestCtx* t) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return;
    }
    void* g = ops_cuda_create(0, NULL);
    Rng r;
    rng_seed(&r, 17);
    const size_t n = 256 * 1000;
    float* w = malloc_check(n * sizeof(float));
    float* want = malloc_check(n * sizeof(float));
    float* got = malloc_check(n * sizeof(float));
    uint8_t* b = malloc_check(n * 2);
    const int types[3] = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_MXFP4};
    void* dout = ops_cuda.alloc(g, n * 2 + 16);
    void* dblk = ops_cuda.alloc(g, n * 2);
    for (int k = 0; k < 3; k++) {
        for (size_t i = 0; i < n; i++) w[i] = 0.02f * rng_normal(&r) * (1.0f + (float)(i % 7));
        quant_quantize(types[k], w, b, (int64_t)n);
        quant_dequantize(types[k], b, want, (int64_t)n);
        const size_t bytes = ggml_type_bytes(types[k], (int64_t)n);
        ops_cuda.upload(g, dblk, b, bytes);
        // the op (aligned: the vector variant) and an output at an odd bf16 offset (scalar)
        for (int off = 0; off < 2; off++) {
            void* o = (char*)dout + 2 * off;
            ops_cuda.dequantize(g, o, dblk, types[k], n);
            ops_cuda.download_f32(g, got, o, n);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++) bad += got[i] != bf16_to_f32(f32_to_bf16(want[i]));
            CHECK(t, bad == 0, "%s (output offset %d): %zu of %zu elements differ from "
                  "bf16(the CPU's)", quant_type_name(types[k]), off, bad, n);
        }
    }
    ops_cuda.free(g, dout);
    ops_cuda.free(g, dblk);
    ops_cuda_destroy(g);
    free(w);
    free(want);
    free(got);
    free(b);
}

// On the GPU: --mmap-base (the base uploaded from the mapped checkpoint) gives the losses of the
// run that holds it, streamed in bf16 (Store.base16, --val '') or in fp32 beside the engine's
// bf16 copy (--val: the plain path reads it), sync and one-step-delayed (resumed: the base
// mapped again), from a bf16 safetensors checkpoint; and a q8_0 base streamed on the GPU (its
// blocks and the rest in bf16) gives the losses of the one held in fp32.
static void test_quant_gpu_cli_mmap(TestCtx* t) {
    if (cuda_device_count() == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return;
    }
    char args[8192], m[1024], lh[1024], ls[1024], lm[1024], lm2[1024], o[1024];
    q_bf16_checkpoint(t, "qg_bf16_model", "qgexport", m, sizeof m);
    test_path(t, lh, sizeof lh, "qg_held.jsonl");
    test_path(t, ls, sizeof ls, "qg_streamed.jsonl");
    test_path(t, lm, sizeof lm, "qg_mapped.jsonl");
    test_path(t, lm2, sizeof lm2, "qg_mapped2.jsonl");
    test_path(t, o, sizeof o, "qg_mapped_out");
    for (int sync = 1; sync >= 0; sync--) {
        char common[2048], what[64];
        snprintf(common, sizeof common, "--model '%s' --sample-tokens 0 --eval-every 0 --lora-r 4 "
                 "--lora-dropout 0.1 --lr 1e-2 -m 2 --device cuda --sync %d --steps 4", m, sync);
        snprintf(args, sizeof args, "%s --val data/tiny_val.bin --log '%s'", common, lh);
        CHECK(t, test_run_cli(t, "qgheld", args) == 0, "sync %d: the fp32 base held", sync);
        snprintf(args, sizeof args, "%s --val '' --log '%s'", common, ls);
        CHECK(t, test_run_cli(t, "qgstream", args) == 0, "sync %d: the base streamed", sync);
        char* so = test_read_output(t, "qgstream", "out");
        CHECK(t, strstr(so, "loaded the base's weights"), "sync %d: %s", sync, so);
        free(so);
        if (sync) {
            snprintf(args, sizeof args, "%s --val '' --mmap-base --log '%s'", common, lm);
            CHECK(t, test_run_cli(t, "qgmapped", args) == 0, "the base mapped");
        } else {  // (in two parts: the resumed run maps the base again)
            snprintf(args, sizeof args, "%s --val '' --mmap-base --log '%s' --out '%s' "
                     "--save-every 2 --steps 2", common, lm, o);
            CHECK(t, test_run_cli(t, "qgmapped", args) == 0, "the base mapped, first part");
            snprintf(args, sizeof args, "%s --val '' --mmap-base --log '%s' --out '%s' "
                     "--save-every 2 --resume", common, lm2, o);
            CHECK(t, test_run_cli(t, "qgmapped2", args) == 0, "the base mapped, resumed");
        }
        snprintf(what, sizeof what, "GPU sync %d, held vs streamed", sync);
        test_same_steps(t, what, lh, ls, 1, 4);
        snprintf(what, sizeof what, "GPU sync %d, held vs mapped", sync);
        test_same_steps(t, what, lh, lm, 1, sync ? 4 : 2);
        // (the resumed log's steps 3 and 4 against the held run's)
        if (!sync) test_same_steps(t, "GPU sync 0, held vs mapped (resumed)", lh, lm2, 3, 4);
    }
    // a q8_0 base on the GPU: held in fp32 (--val) and streamed (blocks + bf16)
    char common[2048];
    snprintf(common, sizeof common, "--model '%s' --sample-tokens 0 --eval-every 0 --lora-r 4 "
             "--lr 1e-2 -m 2 --device cuda --steps 3 --base-dtype q8_0", m);
    snprintf(args, sizeof args, "%s --val data/tiny_val.bin --log '%s'", common, lh);
    CHECK(t, test_run_cli(t, "qgqheld", args) == 0, "q8_0: the fp32 base held");
    snprintf(args, sizeof args, "%s --val '' --log '%s'", common, ls);
    CHECK(t, test_run_cli(t, "qgqstream", args) == 0, "q8_0: streamed");
    test_same_steps(t, "GPU q8_0 held vs streamed", lh, ls, 1, 3);
}
#else
static void test_quant_gpu_dequant(TestCtx* t) { test_skip(t, "built without CUDA"); }
static void test_quant_gpu_engine(TestCtx* t) { test_skip(t, "built without CUDA"); }
static void test_quant_gpu_cli_mmap(TestCtx* t) { test_skip(t, "built without CUDA"); }
#endif

const TestCase tests_quant[] = {
    {"quant_blocks", test_quant_blocks},
    {"quant_table", test_quant_table},
    {"quant_keep_gguf", test_quant_keep_gguf},
    {"quant_engine_matches_dequantised", test_quant_engine_matches_dequantised},
    {"quant_streamed_engine", test_quant_streamed_engine},
    {"quant_streamed_pages", test_quant_streamed_pages},
    {"quant_streamed_bf16", test_quant_streamed_bf16},
    {"quant_streamed_sliced_load", test_quant_streamed_sliced_load},
    {"quant_cli_streamed", test_quant_cli_streamed},
    {"quant_cli_refusals", test_quant_cli_refusals},
    {"quant_cli_train", test_quant_cli_train},
    {"quant_cli_mmap", test_quant_cli_mmap},
    {"gpu_quant_dequant", test_quant_gpu_dequant},
    {"gpu_quant_engine", test_quant_gpu_engine},
    {"gpu_quant_cli_mmap", test_quant_gpu_cli_mmap},
    {NULL, NULL},
};
