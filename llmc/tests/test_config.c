/*
 * test_config.c — presets, parameter counts, RoPE frequencies (llama3, yarn) against the values
 * transformers produces, and HF config.json parsing in both RoPE spellings, with bad inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../config.h"
#include "testing.h"

static void test_config_presets_counts(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    CHECK(t, config_from_preset(&c, "qwen3-1.7b", err) == 0, "%s", err);
    // docs/FORMATS.md §2.4 / docs/PERFORMANCE.md §1.2
    CHECK(t, config_num_params(&c) == 1720574976ll, "qwen3-1.7b total %lld",
          (long long)config_num_params(&c));
    CHECK(t, config_num_matmul_params(&c) == 1720451072ll, "qwen3-1.7b N_mm %lld",
          (long long)config_num_matmul_params(&c));
    CHECK_NEAR(t, config_flops_per_token(&c, 2048) / 1e9, 11.027, 0.001, "F_model 1.7b @2048");
    CHECK(t, c.tied_embeddings && c.qk_norm && c.HD == 128, "qwen3-1.7b shape");
    CHECK(t, config_from_preset(&c, "qwen3-32b", err) == 0, "%s", err);
    CHECK(t, config_num_params(&c) == 32762123264ll, "qwen3-32b total %lld",
          (long long)config_num_params(&c));
    CHECK(t, config_from_preset(&c, "llama3.1-8b", err) == 0, "%s", err);
    CHECK(t, config_num_params(&c) == 8030261248ll, "llama3.1-8b total %lld",
          (long long)config_num_params(&c));
    CHECK(t, config_num_matmul_params(&c) == 7504658432ll, "llama3.1-8b N_mm");
    CHECK(t, !c.tied_embeddings && !c.qk_norm && c.rope_type == ROPE_LLAMA3, "llama3.1-8b");
    for (const char* const* p = config_preset_names(); *p; p++)
        CHECK(t, config_from_preset(&c, *p, err) == 0, "preset %s: %s", *p, err);
    CHECK(t, config_from_preset(&c, "qwen4-9b", err) != 0 && strstr(err, "qwen4-9b") &&
                 strstr(err, "qwen3-1.7b"),
          "unknown preset error lists presets: %s", err);
}

static void test_config_rope_llama3(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, "llama3.1-8b", err);
    float inv[64];
    float s = config_rope_inv_freq(&c, inv);
    CHECK(t, s == 1.0f, "no attention scaling");
    // transformers 5.17 values (docs/FORMATS.md §7.3)
    const double want[10] = {3.942276e-3, 3.211446e-3, 2.166571e-3, 1.371894e-3, 8.56751e-4,
                             5.24846e-4,  3.12694e-4,  1.78508e-4,  9.5562e-5,   7.7847e-5};
    for (int i = 0; i < 10; i++)
        CHECK(t, fabs(inv[27 + i] - want[i]) <= 2e-5 * want[i] + 1e-12, "inv[%d] %.7g vs %.7g",
              27 + i, inv[27 + i], want[i]);
    CHECK_NEAR(t, inv[0], 1.0, 1e-7, "inv[0] unchanged");
}

static void test_config_rope_yarn(TestCtx* t) {
    ModelConfig c;
    memset(&c, 0, sizeof c);
    c.HD = 64;
    c.rope_theta = 150000;
    c.rope_type = ROPE_YARN;
    c.rope_factor = 32;
    c.rope_original_max_pos = 4096;
    c.yarn_beta_fast = 32;
    c.yarn_beta_slow = 1;
    float inv[32];
    float s = config_rope_inv_freq(&c, inv);
    CHECK_NEAR(t, s, 1.3465736, 1e-6, "yarn attention factor");
    const double want[14] = {0.107024,   0.0737446,  0.0508133,  0.0317057,  0.0193350,
                             0.0115920,  6.79496e-3, 3.86036e-3, 2.09379e-3, 1.05260e-3,
                             4.56484e-4, 1.29319e-4, 3.8309e-5,  2.6396e-5};
    for (int i = 0; i < 14; i++)
        CHECK(t, fabs(inv[6 + i] - want[i]) <= 2e-5 * want[i], "yarn inv[%d] %.7g vs %.7g", 6 + i,
              inv[6 + i], want[i]);
}

static int write_text(TestCtx* t, const char* name, const char* text, char* path, size_t cap) {
    char err[ERR_LEN];
    test_path(t, path, cap, name);
    return file_write_atomic(path, text, strlen(text), err);
}

static void test_config_hf_json(TestCtx* t) {
    char path[512], err[ERR_LEN];
    ModelConfig c;
    // legacy spelling, llama3 scaling, eos list, no head_dim
    write_text(t, "legacy.json",
               "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"vocab_size\":"
               "128256,\"hidden_size\":4096,\"intermediate_size\":14336,\"num_hidden_layers\":32,"
               "\"num_attention_heads\":32,\"num_key_value_heads\":8,\"rms_norm_eps\":1e-05,"
               "\"rope_theta\":500000.0,\"rope_scaling\":{\"factor\":8.0,\"low_freq_factor\":1.0,"
               "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192,\"rope_type\":"
               "\"llama3\"},\"tie_word_embeddings\":false,\"bos_token_id\":128000,\"eos_token_id\":"
               "[128001,128008,128009],\"hidden_act\":\"silu\",\"max_position_embeddings\":131072}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "legacy: %s", err);
    ModelConfig ref;
    config_from_preset(&ref, "llama3.1-8b", err);
    CHECK(t, c.family == FAMILY_LLAMA && c.HD == 128 && c.KVH == 8 && c.eos_id == 128001 &&
                 c.rope_type == ROPE_LLAMA3 && c.rope_factor == 8.0 &&
                 c.rope_original_max_pos == 8192 && c.rope_theta == 500000.0,
          "legacy fields");
    CHECK(t, config_num_params(&c) == config_num_params(&ref), "legacy = preset");

    // transformers-5 spelling, Qwen3 with head_dim != C/H
    write_text(t, "v5.json",
               "{\"model_type\":\"qwen3\",\"vocab_size\":151936,\"hidden_size\":2048,"
               "\"intermediate_size\":6144,\"num_hidden_layers\":28,\"num_attention_heads\":16,"
               "\"num_key_value_heads\":8,\"head_dim\":128,\"rms_norm_eps\":1e-06,"
               "\"rope_parameters\":{\"rope_theta\":1000000,\"rope_type\":\"default\"},"
               "\"tie_word_embeddings\":true,\"layer_types\":[\"full_attention\"],"
               "\"use_sliding_window\":false,\"sliding_window\":null,\"dtype\":\"bfloat16\"}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "v5: %s", err);
    CHECK(t, c.family == FAMILY_QWEN3 && c.qk_norm && c.tied_embeddings && c.rope_theta == 1e6 &&
                 c.rope_type == ROPE_DEFAULT && c.HD == 128,
          "v5 fields");
    CHECK(t, config_num_params(&c) == 1720574976ll, "v5 qwen3-1.7b count");

    // nested per-layer-type rope_parameters
    write_text(t, "nested.json",
               "{\"model_type\":\"qwen3\",\"vocab_size\":100,\"hidden_size\":64,"
               "\"intermediate_size\":128,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
               "\"rope_parameters\":{\"full_attention\":{\"rope_theta\":10000,\"rope_type\":"
               "\"default\"},\"sliding_attention\":{\"rope_theta\":10000,\"rope_type\":"
               "\"default\"}}}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0 && c.rope_theta == 10000 && c.KVH == 4 &&
                 c.HD == 16,
          "nested: %s", err);

    // the committed parity fixtures (written by transformers)
    const char* fixtures[] = {"dev/parity/fixtures/llama/config.json",
                              "dev/parity/fixtures/qwen3/config.json"};
    for (int i = 0; i < 2; i++) {
        char fpath[4200];
        snprintf(fpath, sizeof fpath, "%s/%s", t->exe_dir, fixtures[i]);
        CHECK(t, config_from_hf_json(&c, fpath, err) == 0, "%s: %s", fixtures[i], err);
    }
    CHECK(t, c.HD == 32 && c.C == 64 && c.H == 4 && c.tied_embeddings, "qwen3 fixture shape");

    // round trip through our own writer
    config_from_preset(&ref, "test-llama", err);
    char* json = config_to_hf_json(&ref);
    write_text(t, "roundtrip.json", json, path, sizeof path);
    free(json);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "roundtrip: %s", err);
    float a[8], b[8];
    config_rope_inv_freq(&ref, a);
    config_rope_inv_freq(&c, b);
    CHECK(t, c.V == ref.V && c.C == ref.C && c.F == ref.F && c.KVH == ref.KVH && c.HD == ref.HD &&
                 c.norm_eps == ref.norm_eps && c.tied_embeddings == ref.tied_embeddings &&
                 memcmp(a, b, sizeof(float) * (size_t)(ref.HD / 2)) == 0,
          "roundtrip fields");
}

static void test_config_hf_json_errors(TestCtx* t) {
    char path[512], err[ERR_LEN];
    ModelConfig c;
    const char* base_ok =
        "\"vocab_size\":100,\"hidden_size\":64,\"intermediate_size\":128,"
        "\"num_hidden_layers\":2,\"num_attention_heads\":4";
    struct {
        const char* json;
        const char* must_mention;
    } cases[] = {
        {"{\"model_type\":\"llama\",\"hidden_size\":64}", "vocab_size"},
        {"{\"model_type\":\"mamba\",\"vocab_size\":1}", "mamba"},
        {"[1,2]", "object"},
        {"{\"model_type\":\"llama\",\"vocab_size\":\"big\"}", "vocab_size"},
        {"{\"model_type\":\"llama\",\"vocab_size\":-5}", "vocab_size"},
        {"{\"model_type\":\"llama\",", "JSON"},
        {NULL, NULL},
    };
    for (int i = 0; cases[i].json; i++) {
        write_text(t, "bad.json", cases[i].json, path, sizeof path);
        int rc = config_from_hf_json(&c, path, err);
        CHECK(t, rc != 0 && strstr(err, cases[i].must_mention) && strstr(err, "bad.json"),
              "case %d: rc %d err '%s'", i, rc, rc ? err : "");
    }
    char buf[1024];
    struct {
        const char* extra;
        const char* must_mention;
    } more[] = {
        {"\"num_key_value_heads\":3", "multiple"},
        {"\"rope_scaling\":{\"rope_type\":\"dynamic\",\"factor\":2}", "dynamic"},
        {"\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8}", "llama3"},
        {"\"hidden_act\":\"gelu\"", "gelu"},
        {"\"tie_word_embeddings\":3", "tie_word_embeddings"},
        {"\"head_dim\":7", "even"},
        {"\"rms_norm_eps\":-1", "rms_norm_eps"},
        {"\"num_hidden_layers\":100000", "limit"},
        {NULL, NULL},
    };
    for (int i = 0; more[i].extra; i++) {
        // base_ok without the layer count, so a case may set it itself (no duplicate keys)
        const char* layers = strstr(more[i].extra, "num_hidden_layers") ? "" : ",\"num_hidden_layers\":2";
        snprintf(buf, sizeof buf,
                 "{\"model_type\":\"llama\",\"vocab_size\":100,\"hidden_size\":64,"
                 "\"intermediate_size\":128,\"num_attention_heads\":4%s,%s}",
                 layers, more[i].extra);
        write_text(t, "bad2.json", buf, path, sizeof path);
        int rc = config_from_hf_json(&c, path, err);
        CHECK(t, rc != 0 && strstr(err, more[i].must_mention), "extra %s: rc %d err '%s'",
              more[i].extra, rc, rc ? err : "");
    }
    // MoE configs with bad expert fields
    struct {
        const char* json;
        const char* must_mention;
    } moe_bad[] = {
        {"\"model_type\":\"qwen3_moe\",\"num_experts_per_tok\":2,\"moe_intermediate_size\":32",
         "num_experts"},
        {"\"model_type\":\"qwen3_moe\",\"num_experts\":8,\"num_local_experts\":4,"
         "\"num_experts_per_tok\":2,\"moe_intermediate_size\":32", "disagree"},
        {"\"model_type\":\"qwen3_moe\",\"num_experts\":2,\"num_experts_per_tok\":4,"
         "\"moe_intermediate_size\":32", "num_experts_per_tok"},
        {"\"model_type\":\"qwen3_moe\",\"num_experts\":8,\"num_experts_per_tok\":2,"
         "\"moe_intermediate_size\":32,\"mlp_only_layers\":[5]", "mlp_only_layers"},
        {"\"model_type\":\"gpt_oss\",\"num_local_experts\":8,\"num_experts_per_tok\":2,"
         "\"layer_types\":[\"full_attention\"]", "layer_types"},
        {"\"model_type\":\"gpt_oss\",\"num_local_experts\":8,\"num_experts_per_tok\":2,"
         "\"quantization_config\":{\"quant_method\":\"gptq\"}", "mxfp4"},
        {"\"model_type\":\"llama\",\"num_experts\":8", "experts"},
        {NULL, NULL},
    };
    for (int i = 0; moe_bad[i].json; i++) {
        snprintf(buf, sizeof buf, "{%s,%s}", base_ok, moe_bad[i].json);
        write_text(t, "moe.json", buf, path, sizeof path);
        int rc = config_from_hf_json(&c, path, err);
        CHECK(t, rc != 0 && strstr(err, moe_bad[i].must_mention), "moe case %d: rc %d err '%s'",
              i, rc, rc ? err : "");
    }
    CHECK(t, config_from_hf_json(&c, "/nonexistent/config.json", err) != 0 &&
                 strstr(err, "/nonexistent/config.json"),
          "missing file: %s", err);
}

// Qwen3-MoE in the hub spelling and in transformers 5's, GPT-OSS with layer_types and YaRN: the
// fields, the block structure, our own writer's round trip, and the hub models' counts
// (docs/FORMATS.md §2.4).
static void test_config_moe(TestCtx* t) {
    char path[512], err[ERR_LEN];
    ModelConfig c, d;
    write_text(t, "qmoe.json",
               "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"model_type\":\"qwen3_moe\","
               "\"vocab_size\":151936,\"hidden_size\":4096,\"intermediate_size\":12288,"
               "\"num_hidden_layers\":94,\"num_attention_heads\":64,\"num_key_value_heads\":4,"
               "\"head_dim\":128,\"rms_norm_eps\":1e-06,\"rope_theta\":1000000.0,"
               "\"num_experts\":128,\"num_experts_per_tok\":8,\"moe_intermediate_size\":1536,"
               "\"decoder_sparse_step\":1,\"mlp_only_layers\":[],\"norm_topk_prob\":true,"
               "\"output_router_logits\":false,\"router_aux_loss_coef\":0.001,"
               "\"tie_word_embeddings\":false,\"use_sliding_window\":false,\"sliding_window\":null}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "qwen3moe: %s", err);
    CHECK(t, c.family == FAMILY_QWEN3MOE && c.E == 128 && c.K == 8 && c.F_expert == 1536 &&
                 c.norm_topk_prob && !c.output_router_logits && c.qk_norm &&
                 c.expert_layout == EXPERTS_PER_EXPERT && config_num_moe_blocks(&c) == 94,
          "qwen3moe fields");
    CHECK(t, config_num_params(&c) == 235093634560ll, "235B total %lld",
          (long long)config_num_params(&c));
    config_from_preset(&d, "qwen3-235b-a22b", err);
    CHECK(t, config_num_params(&d) == config_num_params(&c), "preset = config.json");

    // transformers-5 spelling, dense blocks by step and by list
    write_text(t, "qmoe5.json",
               "{\"model_type\":\"qwen3_moe\",\"vocab_size\":100,\"hidden_size\":64,"
               "\"intermediate_size\":96,\"num_hidden_layers\":6,\"num_attention_heads\":4,"
               "\"num_key_value_heads\":2,\"head_dim\":16,\"num_local_experts\":8,"
               "\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
               "\"decoder_sparse_step\":2,\"mlp_only_layers\":[3],"
               "\"output_router_logits\":true,\"router_aux_loss_coef\":0.02,"
               "\"rope_parameters\":{\"rope_theta\":10000,\"rope_type\":\"default\"}}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "qwen3moe v5: %s", err);
    CHECK(t, c.E == 8 && c.output_router_logits && c.router_aux_loss_coef == 0.02 &&
                 !c.norm_topk_prob,
          "v5 fields");
    const int want_moe[6] = {0, 1, 0, 0, 0, 1};  // (i + 1) % 2 == 0, except 3
    for (int b = 0; b < 6; b++)
        CHECK(t, config_block_is_moe(&c, b) == want_moe[b], "block %d moe %d", b,
              config_block_is_moe(&c, b));
    char* json = config_to_hf_json(&c);
    write_text(t, "qmoe_rt.json", json, path, sizeof path);
    free(json);
    CHECK(t, config_from_hf_json(&d, path, err) == 0, "roundtrip: %s", err);
    CHECK(t, d.E == c.E && d.K == c.K && d.F_expert == c.F_expert && d.F == c.F &&
                 d.decoder_sparse_step == 2 && memcmp(d.mlp_only, c.mlp_only, sizeof c.mlp_only) == 0 &&
                 d.output_router_logits && d.router_aux_loss_coef == 0.02 &&
                 config_num_params(&d) == config_num_params(&c),
          "qwen3moe roundtrip");

    // GPT-OSS: hub fields, default layer_types, YaRN, MXFP4 quantization_config accepted
    write_text(t, "oss.json",
               "{\"architectures\":[\"GptOssForCausalLM\"],\"model_type\":\"gpt_oss\","
               "\"vocab_size\":201088,\"hidden_size\":2880,\"intermediate_size\":2880,"
               "\"num_hidden_layers\":24,\"num_attention_heads\":64,\"num_key_value_heads\":8,"
               "\"head_dim\":64,\"num_local_experts\":32,\"experts_per_token\":4,"
               "\"sliding_window\":128,\"swiglu_limit\":7.0,\"rms_norm_eps\":1e-05,"
               "\"rope_theta\":150000,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":32.0,"
               "\"beta_fast\":32.0,\"beta_slow\":1.0,\"truncate\":false,"
               "\"original_max_position_embeddings\":4096},\"attention_bias\":true,"
               "\"router_aux_loss_coef\":0.9,\"tie_word_embeddings\":false,"
               "\"quantization_config\":{\"quant_method\":\"mxfp4\",\"modules_to_not_convert\":"
               "[\"model.layers.*.self_attn\"]}}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "gpt-oss: %s", err);
    CHECK(t, c.family == FAMILY_GPTOSS && c.E == 32 && c.K == 4 && c.F_expert == 2880 &&
                 c.attention_bias && !c.qk_norm && c.rope_type == ROPE_YARN && !c.yarn_truncate &&
                 c.sliding_window == 128 && c.swiglu_limit == 7.0f &&
                 c.expert_layout == EXPERTS_GPTOSS,
          "gpt-oss fields");
    CHECK(t, config_block_window(&c, 0) == 128 && config_block_window(&c, 1) == 0 &&
                 config_block_window(&c, 22) == 128 && config_block_window(&c, 23) == 0,
          "default layer_types: sliding at even blocks");
    CHECK(t, config_num_params(&c) == 20914757184ll, "gpt-oss-20b total %lld",
          (long long)config_num_params(&c));
    config_from_preset(&d, "gpt-oss-20b", err);
    CHECK(t, config_num_params(&d) == config_num_params(&c), "preset = config.json");
    float ia[32], ib[32];
    CHECK(t, config_rope_inv_freq(&c, ia) == config_rope_inv_freq(&d, ib) &&
                 memcmp(ia, ib, sizeof ia) == 0,
          "yarn preset = config.json");
    json = config_to_hf_json(&c);
    write_text(t, "oss_rt.json", json, path, sizeof path);
    free(json);
    CHECK(t, config_from_hf_json(&d, path, err) == 0, "roundtrip: %s", err);
    CHECK(t, d.E == c.E && d.K == c.K && d.F == c.F && memcmp(d.sliding, c.sliding, sizeof c.sliding) == 0 &&
                 d.sliding_window == c.sliding_window && d.rope_type == ROPE_YARN &&
                 !d.yarn_truncate && d.rope_factor == 32.0 && d.attention_bias &&
                 config_num_params(&d) == config_num_params(&c),
          "gpt-oss roundtrip");
    // transformers' yarn reads truncate with the default true
    write_text(t, "oss_trunc.json",
               "{\"model_type\":\"gpt_oss\",\"vocab_size\":100,\"hidden_size\":64,"
               "\"intermediate_size\":32,\"num_hidden_layers\":3,\"num_attention_heads\":4,"
               "\"num_key_value_heads\":2,\"head_dim\":16,\"num_local_experts\":8,"
               "\"num_experts_per_tok\":2,\"layer_types\":[\"full_attention\","
               "\"sliding_attention\",\"full_attention\"],\"sliding_window\":4,"
               "\"rope_parameters\":{\"rope_type\":\"yarn\",\"rope_theta\":10000,"
               "\"factor\":4.0,\"original_max_position_embeddings\":64}}",
               path, sizeof path);
    CHECK(t, config_from_hf_json(&c, path, err) == 0, "gpt-oss v5: %s", err);
    CHECK(t, c.yarn_truncate && config_block_window(&c, 0) == 0 &&
                 config_block_window(&c, 1) == 4 && config_block_window(&c, 2) == 0,
          "explicit layer_types, truncate default");
    // active parameters (docs/PERFORMANCE.md §1.1): the matmul ones of one token
    config_from_preset(&c, "qwen3-30b-a3b", err);
    CHECK(t, config_validate(&c, err) == 0 && config_num_moe_blocks(&c) == 48, "30b-a3b: %s", err);
}

const TestCase tests_config[] = {
    {"config_presets_counts", test_config_presets_counts},
    {"config_rope_llama3", test_config_rope_llama3},
    {"config_rope_yarn", test_config_rope_yarn},
    {"config_moe", test_config_moe},
    {"config_hf_json", test_config_hf_json},
    {"config_hf_json_errors", test_config_hf_json_errors},
    {NULL, NULL},
};
