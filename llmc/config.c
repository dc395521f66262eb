/*
 * config.c — presets, HF config.json parsing (legacy and transformers-5 RoPE spellings),
 * validation, RoPE frequencies (default, llama3, yarn) and parameter/FLOP counts.
 */
#include "config.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "json.h"

const char* const family_names[FAMILY_COUNT] = {"llama", "qwen3", "qwen3moe", "gptoss"};

// ----------------------------------------------------------------------------
// presets

typedef struct Preset {
    const char* name;
    ModelFamily family;
    int V, C, L, H, KVH, HD, F;
    float eps;
    int tied;
    double theta;
    RopeType rope;
    double factor;  // llama3 / yarn scaling factor (0 when unused)
    int orig_max;   // llama3 / yarn original_max_position_embeddings
    int max_pos;
    int bos, eos;
} Preset;

// The MoE part of a preset (by name).
typedef struct MoePreset {
    const char* name;
    int E, K, Fe;       // experts, experts per token, expert width
    int mlp_only_mask;  // Qwen3-MoE mlp_only_layers as a bit mask of the first 32 blocks
    int window;         // GPT-OSS sliding window (even blocks slide, as layer_types' default)
    double aux_coef;    // router_aux_loss_coef
    int aux_on;         // output_router_logits
} MoePreset;

// Hub configurations (docs/FORMATS.md §2.4) and small models for tests and the default run.
static const Preset presets[] = {
    {"qwen3-0.6b", FAMILY_QWEN3, 151936, 1024, 28, 16, 8, 128, 3072, 1e-6f, 1, 1e6, ROPE_DEFAULT, 0, 0, 40960, 151643, 151645},
    {"qwen3-1.7b", FAMILY_QWEN3, 151936, 2048, 28, 16, 8, 128, 6144, 1e-6f, 1, 1e6, ROPE_DEFAULT, 0, 0, 40960, 151643, 151645},
    {"qwen3-8b", FAMILY_QWEN3, 151936, 4096, 36, 32, 8, 128, 12288, 1e-6f, 0, 1e6, ROPE_DEFAULT, 0, 0, 40960, 151643, 151645},
    {"qwen3-32b", FAMILY_QWEN3, 151936, 5120, 64, 64, 8, 128, 25600, 1e-6f, 0, 1e6, ROPE_DEFAULT, 0, 0, 40960, 151643, 151645},
    {"llama3.2-1b", FAMILY_LLAMA, 128256, 2048, 16, 32, 8, 64, 8192, 1e-5f, 1, 5e5, ROPE_LLAMA3, 32.0, 8192, 131072, 128000, 128001},
    {"llama3.1-8b", FAMILY_LLAMA, 128256, 4096, 32, 32, 8, 128, 14336, 1e-5f, 0, 5e5, ROPE_LLAMA3, 8.0, 8192, 131072, 128000, 128001},
    // Mixture-of-experts (hub config.json values; the aux loss off, as those files have it)
    {"qwen3-30b-a3b", FAMILY_QWEN3MOE, 151936, 2048, 48, 32, 4, 128, 6144, 1e-6f, 0, 1e6, ROPE_DEFAULT, 0, 0, 40960, 151643, 151645},
    {"qwen3-235b-a22b", FAMILY_QWEN3MOE, 151936, 4096, 94, 64, 4, 128, 12288, 1e-6f, 0, 1e6, ROPE_DEFAULT, 0, 0, 40960, 151643, 151645},
    {"gpt-oss-20b", FAMILY_GPTOSS, 201088, 2880, 24, 64, 8, 64, 2880, 1e-5f, 0, 150000, ROPE_YARN, 32.0, 4096, 131072, 199998, 200002},
    {"gpt-oss-120b", FAMILY_GPTOSS, 201088, 2880, 36, 64, 8, 64, 2880, 1e-5f, 0, 150000, ROPE_YARN, 32.0, 4096, 131072, 199998, 200002},
    // The default model: byte-level vocabulary (the shipped arithmetic corpus), Qwen3-style.
    {"tiny", FAMILY_QWEN3, 256, 128, 4, 4, 2, 32, 384, 1e-6f, 1, 1e4, ROPE_DEFAULT, 0, 0, 1024, 0, 0},
    // Small test models: GQA, llama3 scaling, untied head; Qwen3 with HD != C/H, tied.
    {"test-llama", FAMILY_LLAMA, 96, 48, 2, 4, 2, 12, 80, 1e-5f, 0, 5e5, ROPE_LLAMA3, 8.0, 32, 512, 1, 2},
    {"test-qwen3", FAMILY_QWEN3, 96, 48, 2, 4, 1, 16, 64, 1e-6f, 1, 1e6, ROPE_DEFAULT, 0, 0, 512, 1, 2},
    // Small MoE test models: 8 experts, top-2, the aux loss on; Qwen3-MoE with a dense middle
    // block (mlp_only_layers [1]); GPT-OSS with a 4-token window, YaRN and biases (C and F multiples
// of 32, as MXFP4 needs).
    {"test-qwen3moe", FAMILY_QWEN3MOE, 96, 48, 3, 4, 2, 16, 64, 1e-6f, 0, 1e6, ROPE_DEFAULT, 0, 0, 512, 1, 2},
    {"test-gptoss", FAMILY_GPTOSS, 96, 64, 2, 4, 2, 16, 32, 1e-5f, 0, 1e4, ROPE_YARN, 4.0, 64, 512, 1, 2},
};

// Hub config.json values, the aux loss off as those files have it; the test models have 8
// experts, top-2 and the aux loss on (Qwen3-MoE with a dense middle block, mlp_only_layers [1];
// GPT-OSS with a 4-token window).
static const MoePreset moe_presets[] = {
    {"qwen3-30b-a3b", 128, 8, 768, 0, 0, 0.001, 0},
    {"qwen3-235b-a22b", 128, 8, 1536, 0, 0, 0.001, 0},
    {"gpt-oss-20b", 32, 4, 2880, 0, 128, 0.9, 0},
    {"gpt-oss-120b", 128, 4, 2880, 0, 128, 0.9, 0},
    {"test-qwen3moe", 8, 2, 24, 1 << 1, 0, 0.01, 1},
    {"test-gptoss", 8, 2, 32, 0, 4, 0.01, 1},
};

static const char* const preset_name_list[] = {"qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "qwen3-32b",
                                               "llama3.2-1b", "llama3.1-8b", "qwen3-30b-a3b",
                                               "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b",
                                               "tiny", "test-llama", "test-qwen3", "test-qwen3moe",
                                               "test-gptoss", NULL};

const char* const* config_preset_names(void) { return preset_name_list; }

static void config_defaults(ModelConfig* c) {
    memset(c, 0, sizeof *c);
    c->rope_factor = 1.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->yarn_beta_fast = 32.0;
    c->yarn_beta_slow = 1.0;
    c->bos_id = -1;
    c->eos_id = -1;
    c->decoder_sparse_step = 1;
    c->router_aux_loss_coef = 0.001;
    c->swiglu_limit = 7.0f;
}

// GPT-OSS's layer_types default: sliding_attention at even blocks, full_attention at odd ones.
static void default_layer_types(ModelConfig* c) {
    for (int i = 0; i < c->L && i < CONFIG_MAX_LAYERS; i++) c->sliding[i] = i % 2 == 0;
}

int config_from_preset(ModelConfig* cfg, const char* name, char* err) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        const Preset* p = &presets[i];
        if (strcmp(p->name, name) != 0) continue;
        config_defaults(cfg);
        str_copy(cfg->name, sizeof cfg->name, p->name);
        cfg->family = p->family;
        cfg->V = p->V;
        cfg->C = p->C;
        cfg->L = p->L;
        cfg->H = p->H;
        cfg->KVH = p->KVH;
        cfg->HD = p->HD;
        cfg->F = p->F;
        cfg->norm_eps = p->eps;
        cfg->tied_embeddings = p->tied;
        cfg->qk_norm = p->family == FAMILY_QWEN3 || p->family == FAMILY_QWEN3MOE;
        cfg->rope_theta = p->theta;
        cfg->rope_type = p->rope;
        if (p->rope == ROPE_LLAMA3) {
            cfg->rope_factor = p->factor;
            cfg->rope_low_freq_factor = 1.0;
            cfg->rope_high_freq_factor = 4.0;
            cfg->rope_original_max_pos = p->orig_max;
        } else if (p->rope == ROPE_YARN) {  // GPT-OSS: beta_fast 32, beta_slow 1, no truncation
            cfg->rope_factor = p->factor;
            cfg->rope_original_max_pos = p->orig_max;
            cfg->yarn_truncate = 0;
        }
        cfg->max_pos = p->max_pos;
        cfg->bos_id = p->bos;
        cfg->eos_id = p->eos;
        for (size_t k = 0; k < sizeof moe_presets / sizeof moe_presets[0]; k++) {
            const MoePreset* q = &moe_presets[k];
            if (strcmp(q->name, name) != 0) continue;
            cfg->E = q->E;
            cfg->K = q->K;
            cfg->F_expert = q->Fe;
            cfg->sliding_window = q->window;
            cfg->router_aux_loss_coef = q->aux_coef;
            cfg->output_router_logits = q->aux_on;
            for (int b = 0; b < 32 && b < p->L; b++) cfg->mlp_only[b] = (q->mlp_only_mask >> b) & 1;
        }
        if (p->family == FAMILY_QWEN3MOE) {
            cfg->norm_topk_prob = 1;  // the released configs
            cfg->expert_layout = EXPERTS_PER_EXPERT;  // the hub layout
        } else if (p->family == FAMILY_GPTOSS) {
            cfg->attention_bias = 1;
            default_layer_types(cfg);
            cfg->expert_layout = EXPERTS_GPTOSS;
        }
        return config_validate(cfg, err);
    }
    char list[512] = "";
    for (int i = 0; preset_name_list[i]; i++) {
        if (i) strncat(list, ", ", sizeof list - strlen(list) - 1);
        strncat(list, preset_name_list[i], sizeof list - strlen(list) - 1);
    }
    return errorf(err, "unknown model preset '%s' (presets: %s; or give an HF directory, a "
                       "config.json or a .safetensors file)", name, list);
}

// ----------------------------------------------------------------------------
// HF config.json

// Required positive int field.
static int get_pos_int(const JsonValue* o, const char* key, int* out, const char* path, char* err) {
    int64_t v;
    int r = json_get_int(o, key, &v);
    if (r == 0) return errorf(err, "%s: missing field '%s'", path, key);
    if (r < 0 || v <= 0 || v > (1 << 30))
        return errorf(err, "%s: field '%s' must be a positive integer", path, key);
    *out = (int)v;
    return 0;
}

// Optional positive int field (keeps *out when absent or null).
static int get_opt_int(const JsonValue* o, const char* key, int* out, const char* path, char* err) {
    int64_t v;
    int r = json_get_int(o, key, &v);
    if (r == 0) return 0;
    if (r < 0 || v < 0 || v > (1 << 30))
        return errorf(err, "%s: field '%s' must be a non-negative integer", path, key);
    *out = (int)v;
    return 0;
}

static int get_opt_double(const JsonValue* o, const char* key, double* out, const char* path,
                          char* err) {
    double v;
    int r = json_get_double(o, key, &v);
    if (r == 0) return 0;
    if (r < 0 || !isfinite(v)) return errorf(err, "%s: field '%s' must be a number", path, key);
    *out = v;
    return 0;
}

static int get_opt_bool(const JsonValue* o, const char* key, int* out, const char* path, char* err) {
    int v;
    int r = json_get_bool(o, key, &v);
    if (r == 0) return 0;
    if (r < 0) return errorf(err, "%s: field '%s' must be true or false", path, key);
    *out = v;
    return 0;
}

// bos/eos may be an int, a list of ints (take the first) or null.
static int get_token_id(const JsonValue* o, const char* key, int* out, const char* path, char* err) {
    const JsonValue* v = json_get(o, key);
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type == JSON_ARRAY) {
        if (v->n == 0) return 0;
        v = &v->items[0];
    }
    if (v->type != JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer > (1 << 30))
        return errorf(err, "%s: field '%s' must be a token id or a list of token ids", path, key);
    *out = (int)v->integer;
    return 0;
}

// RoPE: accept rope_parameters (transformers 5, possibly nested per layer type) or the legacy
// rope_theta + rope_scaling (docs/FORMATS.md §2.2).
static int parse_rope(ModelConfig* c, const JsonValue* root, const char* path, char* err) {
    const JsonValue* rp = json_get(root, "rope_parameters");
    if (rp && rp->type == JSON_NULL) rp = NULL;
    if (rp && rp->type != JSON_OBJECT)
        return errorf(err, "%s: field 'rope_parameters' must be an object", path);
    const JsonValue* scal = NULL;
    if (rp) {
        const JsonValue* full = json_get(rp, "full_attention");
        if (full) {
            if (full->type != JSON_OBJECT)
                return errorf(err, "%s: 'rope_parameters.full_attention' must be an object", path);
            // other layer types must agree on theta and type for dense families
            for (size_t i = 0; i < rp->n; i++) {
                const JsonValue* other = &rp->items[i];
                if (other->type != JSON_OBJECT) continue;
                double t1 = 0, t2 = 0;
                const char *s1 = "default", *s2 = "default";
                json_get_double(full, "rope_theta", &t1);
                json_get_double(other, "rope_theta", &t2);
                json_get_string(full, "rope_type", &s1);
                json_get_string(other, "rope_type", &s2);
                if (t1 != t2 || strcmp(s1, s2) != 0)
                    return errorf(err, "%s: rope_parameters.%s differs from full_attention (per "
                                       "layer-type RoPE is not supported for this family)",
                                  path, rp->keys[i]);
            }
            rp = full;
        }
        if (json_get_double(rp, "rope_theta", &c->rope_theta) != 1)
            return errorf(err, "%s: 'rope_parameters.rope_theta' missing or not a number", path);
        scal = rp;
    } else {
        c->rope_theta = 10000.0;  // the transformers default when the field is absent
        if (json_get_double(root, "rope_theta", &c->rope_theta) < 0)
            return errorf(err, "%s: field 'rope_theta' must be a number", path);
        scal = json_get(root, "rope_scaling");
        if (scal && scal->type == JSON_NULL) scal = NULL;
        if (scal && scal->type != JSON_OBJECT)
            return errorf(err, "%s: field 'rope_scaling' must be an object or null", path);
    }
    if (!(c->rope_theta > 1.0) || !isfinite(c->rope_theta))
        return errorf(err, "%s: rope_theta must be > 1 (got %g)", path, c->rope_theta);
    const char* type = "default";
    if (scal) {
        const char* t = NULL;
        if (json_get_string(scal, "rope_type", &t) == 1 || json_get_string(scal, "type", &t) == 1)
            type = t;
    }
    if (strcmp(type, "default") == 0) {
        c->rope_type = ROPE_DEFAULT;
    } else if (strcmp(type, "llama3") == 0) {
        c->rope_type = ROPE_LLAMA3;
        double orig = 0;
        if (json_get_double(scal, "factor", &c->rope_factor) != 1 ||
            json_get_double(scal, "low_freq_factor", &c->rope_low_freq_factor) != 1 ||
            json_get_double(scal, "high_freq_factor", &c->rope_high_freq_factor) != 1 ||
            json_get_double(scal, "original_max_position_embeddings", &orig) != 1)
            return errorf(err, "%s: llama3 RoPE scaling needs factor, low_freq_factor, "
                               "high_freq_factor and original_max_position_embeddings", path);
        if (!(c->rope_factor > 0) || !(c->rope_high_freq_factor > c->rope_low_freq_factor) ||
            !(c->rope_low_freq_factor > 0) || !(orig >= 1 && orig < 1e9))
            return errorf(err, "%s: llama3 RoPE scaling parameters out of range", path);
        c->rope_original_max_pos = (int)orig;
    } else if (strcmp(type, "yarn") == 0) {
        c->rope_type = ROPE_YARN;
        double orig = 0;
        if (json_get_double(scal, "factor", &c->rope_factor) != 1 ||
            json_get_double(scal, "original_max_position_embeddings", &orig) != 1)
            return errorf(err, "%s: yarn RoPE scaling needs factor and "
                               "original_max_position_embeddings", path);
        // transformers reads truncate with the default true (GPT-OSS writes false)
        c->yarn_truncate = 1;
        if (get_opt_double(scal, "beta_fast", &c->yarn_beta_fast, path, err) ||
            get_opt_double(scal, "beta_slow", &c->yarn_beta_slow, path, err) ||
            get_opt_bool(scal, "truncate", &c->yarn_truncate, path, err) ||
            get_opt_double(scal, "attention_factor", &c->rope_attention_factor, path, err))
            return -1;
        if (json_get(scal, "mscale") || json_get(scal, "mscale_all_dim"))
            return errorf(err, "%s: yarn mscale / mscale_all_dim are not supported", path);
        if (!(c->yarn_beta_fast > 0) || !(c->yarn_beta_slow > 0) || c->rope_attention_factor < 0)
            return errorf(err, "%s: yarn beta_fast, beta_slow must be positive", path);
        if (!(c->rope_factor >= 1) || !(orig >= 1 && orig < 1e9))
            return errorf(err, "%s: yarn RoPE scaling parameters out of range", path);
        c->rope_original_max_pos = (int)orig;
    } else {
        char tp[64];
        return errorf(err, "%s: unsupported rope_type '%s' (supported: default, llama3, yarn)",
                      path, str_printable(type, strlen(type), tp, sizeof tp));
    }
    return 0;
}

// The experts: num_experts (Qwen3-MoE hub files) or num_local_experts (transformers 5, GPT-OSS);
// both may be present and must agree.
static int get_experts(const JsonValue* o, int* E, const char* path, char* err) {
    int a = 0, b = 0;
    int ha = json_get(o, "num_experts") != NULL, hb = json_get(o, "num_local_experts") != NULL;
    if (!ha && !hb) return errorf(err, "%s: missing field 'num_experts' (or 'num_local_experts')", path);
    if (ha && get_pos_int(o, "num_experts", &a, path, err)) return -1;
    if (hb && get_pos_int(o, "num_local_experts", &b, path, err)) return -1;
    if (ha && hb && a != b)
        return errorf(err, "%s: num_experts %d and num_local_experts %d disagree", path, a, b);
    *E = ha ? a : b;
    return 0;
}

// Qwen3-MoE's mlp_only_layers [int, ...] (block indices) into c->mlp_only.
static int get_mlp_only_layers(ModelConfig* c, const JsonValue* o, const char* path, char* err) {
    const JsonValue* v = json_get(o, "mlp_only_layers");
    if (!v || v->type == JSON_NULL) return 0;
    if (v->type != JSON_ARRAY) return errorf(err, "%s: field 'mlp_only_layers' must be a list", path);
    for (size_t i = 0; i < v->n; i++) {
        const JsonValue* x = &v->items[i];
        if (x->type != JSON_NUMBER || !x->is_integer || x->integer < 0 || x->integer >= c->L)
            return errorf(err, "%s: mlp_only_layers[%zu] must be a block index in [0, %d)", path,
                          i, c->L);
        c->mlp_only[x->integer] = 1;
    }
    return 0;
}

// layer_types ["sliding_attention" | "full_attention", ...], one per block, into c->sliding.
// Absent: GPT-OSS's default (sliding at even blocks); other families: all full.
static int get_layer_types(ModelConfig* c, const JsonValue* o, const char* path, char* err) {
    const JsonValue* v = json_get(o, "layer_types");
    if (!v || v->type == JSON_NULL) {
        if (c->family == FAMILY_GPTOSS) default_layer_types(c);
        return 0;
    }
    if (v->type != JSON_ARRAY || (int)v->n != c->L)
        return errorf(err, "%s: field 'layer_types' must be a list of %d strings", path, c->L);
    for (size_t i = 0; i < v->n; i++) {
        const JsonValue* x = &v->items[i];
        int sliding = x->type == JSON_STRING && strcmp(x->str, "sliding_attention") == 0;
        int full = x->type == JSON_STRING && strcmp(x->str, "full_attention") == 0;
        if (!sliding && !full)
            return errorf(err, "%s: layer_types[%zu] must be \"sliding_attention\" or "
                               "\"full_attention\"", path, i);
        c->sliding[i] = (uint8_t)sliding;
    }
    return 0;
}

// The MoE fields of qwen3_moe and gpt_oss configs (docs/FORMATS.md §8.1).
static int parse_moe(ModelConfig* c, const JsonValue* o, const char* path, char* err) {
    if (get_experts(o, &c->E, path, err)) return -1;
    if (json_get(o, "num_experts_per_tok")) {
        if (get_pos_int(o, "num_experts_per_tok", &c->K, path, err)) return -1;
    } else if (get_pos_int(o, "experts_per_token", &c->K, path, err)) {
        return -1;
    }
    if (get_opt_double(o, "router_aux_loss_coef", &c->router_aux_loss_coef, path, err) ||
        get_opt_bool(o, "output_router_logits", &c->output_router_logits, path, err))
        return -1;
    if (c->family == FAMILY_QWEN3MOE) {
        if (get_pos_int(o, "moe_intermediate_size", &c->F_expert, path, err) ||
            get_opt_int(o, "decoder_sparse_step", &c->decoder_sparse_step, path, err) ||
            get_opt_bool(o, "norm_topk_prob", &c->norm_topk_prob, path, err) ||
            get_mlp_only_layers(c, o, path, err) || get_layer_types(c, o, path, err))
            return -1;
        for (int i = 0; i < c->L; i++)
            if (c->sliding[i])
                return errorf(err, "%s: sliding_attention layers are not supported for qwen3_moe",
                              path);
        c->expert_layout = EXPERTS_PER_EXPERT;  // until the checkpoint says otherwise
        return 0;
    }
    // GPT-OSS: intermediate_size is the expert width; attention biases are always on
    c->F_expert = c->F;
    c->attention_bias = 1;
    c->sliding_window = 128;
    double lim = 7.0;
    if (get_opt_int(o, "sliding_window", &c->sliding_window, path, err) ||
        get_opt_double(o, "swiglu_limit", &lim, path, err) || get_layer_types(c, o, path, err))
        return -1;
    if (!(lim > 0)) return errorf(err, "%s: field 'swiglu_limit' must be positive", path);
    c->swiglu_limit = (float)lim;
    // MXFP4 experts are dequantised on load; any other quantisation is not understood
    const JsonValue* q = json_get(o, "quantization_config");
    if (q && q->type != JSON_NULL) {
        const char* method = NULL;
        if (json_get_string(q, "quant_method", &method) != 1 || strcmp(method, "mxfp4") != 0)
            return errorf(err, "%s: quantization_config: only quant_method \"mxfp4\" is "
                               "supported (its experts are dequantised on load)", path);
    }
    c->expert_layout = EXPERTS_GPTOSS;
    return 0;
}

int config_from_hf_json(ModelConfig* cfg, const char* path, char* err) {
    char ferr[ERR_LEN];
    size_t len = 0;
    char* text = file_read_all(path, 16u << 20, &len, ferr);
    if (!text) return errorf(err, "%s", ferr);
    JsonDoc doc;
    if (json_parse(text, len, &doc, ferr) != 0) {
        free(text);
        return errorf(err, "%s: invalid JSON %s", path, ferr);
    }
    free(text);
    const JsonValue* o = &doc.root;
    int rc = -1;
    ModelConfig c;
    config_defaults(&c);
    if (o->type != JSON_OBJECT) {
        errorf(err, "%s: top level must be a JSON object", path);
        goto done;
    }

    // family from model_type (fall back to architectures[0])
    const char* mt = NULL;
    if (json_get_string(o, "model_type", &mt) != 1) {
        const JsonValue* arch = json_get(o, "architectures");
        if (arch && arch->type == JSON_ARRAY && arch->n > 0 && arch->items[0].type == JSON_STRING) {
            const char* a = arch->items[0].str;
            mt = strcmp(a, "LlamaForCausalLM") == 0      ? "llama"
                 : strcmp(a, "Qwen3ForCausalLM") == 0    ? "qwen3"
                 : strcmp(a, "Qwen3MoeForCausalLM") == 0 ? "qwen3_moe"
                 : strcmp(a, "GptOssForCausalLM") == 0   ? "gpt_oss"
                                                         : a;
        }
    }
    if (!mt) {
        errorf(err, "%s: missing field 'model_type'", path);
        goto done;
    }
    if (strcmp(mt, "llama") == 0) c.family = FAMILY_LLAMA;
    else if (strcmp(mt, "qwen3") == 0) c.family = FAMILY_QWEN3;
    else if (strcmp(mt, "qwen3_moe") == 0) c.family = FAMILY_QWEN3MOE;
    else if (strcmp(mt, "gpt_oss") == 0) c.family = FAMILY_GPTOSS;
    else {
        char mp[64];
        errorf(err, "%s: unsupported model_type '%s' (supported: llama, qwen3, qwen3_moe, gpt_oss)",
               path, str_printable(mt, strlen(mt), mp, sizeof mp));
        goto done;
    }

    if (get_pos_int(o, "vocab_size", &c.V, path, err) ||
        get_pos_int(o, "hidden_size", &c.C, path, err) ||
        get_pos_int(o, "num_hidden_layers", &c.L, path, err) ||
        get_pos_int(o, "num_attention_heads", &c.H, path, err))
        goto done;
    if (get_pos_int(o, "intermediate_size", &c.F, path, err)) goto done;
    c.KVH = c.H;
    if (get_opt_int(o, "num_key_value_heads", &c.KVH, path, err)) goto done;
    c.HD = c.C / c.H;
    if (get_opt_int(o, "head_dim", &c.HD, path, err)) goto done;
    double eps = 1e-6;
    if (get_opt_double(o, "rms_norm_eps", &eps, path, err)) goto done;
    if (!(eps > 0 && eps < 1)) {
        errorf(err, "%s: field 'rms_norm_eps' must be in (0, 1)", path);
        goto done;
    }
    c.norm_eps = (float)eps;
    c.tied_embeddings = 0;  // LlamaConfig, Qwen3Config, ... default
    if (get_opt_bool(o, "tie_word_embeddings", &c.tied_embeddings, path, err)) goto done;
    if (get_opt_bool(o, "attention_bias", &c.attention_bias, path, err)) goto done;
    c.max_pos = 2048;
    if (get_opt_int(o, "max_position_embeddings", &c.max_pos, path, err)) goto done;
    if (get_token_id(o, "bos_token_id", &c.bos_id, path, err) ||
        get_token_id(o, "eos_token_id", &c.eos_id, path, err))
        goto done;
    const char* act = NULL;
    if (json_get_string(o, "hidden_act", &act) == 1 && strcmp(act, "silu") != 0) {
        char ap[64];
        errorf(err, "%s: hidden_act '%s' is not supported (only silu)", path,
               str_printable(act, strlen(act), ap, sizeof ap));
        goto done;
    }
    int mlp_bias = 0;
    if (get_opt_bool(o, "mlp_bias", &mlp_bias, path, err)) goto done;
    if (mlp_bias) {
        errorf(err, "%s: mlp_bias true is not supported", path);
        goto done;
    }
    c.qk_norm = c.family == FAMILY_QWEN3 || c.family == FAMILY_QWEN3MOE;
    if (c.family == FAMILY_QWEN3 || c.family == FAMILY_QWEN3MOE) {
        int sw = 0;
        if (get_opt_bool(o, "use_sliding_window", &sw, path, err)) goto done;
        if (sw) {
            errorf(err, "%s: use_sliding_window true is not supported for qwen3", path);
            goto done;
        }
    }
    if (c.family == FAMILY_QWEN3MOE || c.family == FAMILY_GPTOSS) {
        if (parse_moe(&c, o, path, err)) goto done;
    } else if (json_get(o, "num_experts") || json_get(o, "num_local_experts")) {
        errorf(err, "%s: experts in a %s config (model_type qwen3_moe or gpt_oss has them)", path,
               family_names[c.family]);
        goto done;
    }
    if (parse_rope(&c, o, path, err)) goto done;

    {
        // name: the directory holding config.json
        char tmp[1024];
        str_copy(tmp, sizeof tmp, path);
        char* slash = strrchr(tmp, '/');
        if (slash) *slash = '\0';
        char* base = strrchr(tmp, '/');
        str_copy(c.name, sizeof c.name, slash ? (base ? base + 1 : tmp) : "hf-model");
    }
    char verr[ERR_LEN];
    if (config_validate(&c, verr) != 0) {
        errorf(err, "%s: %s", path, verr);
        goto done;
    }
    *cfg = c;
    rc = 0;
done:
    json_free(&doc);
    return rc;
}

// ----------------------------------------------------------------------------
// validation

int config_validate(const ModelConfig* c, char* err) {
    if (c->family < 0 || c->family >= FAMILY_COUNT) return errorf(err, "unknown model family");
    if (c->V <= 0 || c->C <= 0 || c->L <= 0 || c->H <= 0 || c->KVH <= 0 || c->HD <= 0)
        return errorf(err, "model sizes must be positive (V=%d C=%d L=%d H=%d KVH=%d HD=%d)", c->V,
                      c->C, c->L, c->H, c->KVH, c->HD);
    if (c->L > CONFIG_MAX_LAYERS)
        return errorf(err, "num_hidden_layers %d exceeds the limit of %d", c->L, CONFIG_MAX_LAYERS);
    if (c->H % c->KVH != 0)
        return errorf(err, "num_attention_heads %d is not a multiple of num_key_value_heads %d",
                      c->H, c->KVH);
    if (c->HD % 2 != 0) return errorf(err, "head_dim %d must be even for RoPE", c->HD);
    if ((int64_t)c->H * c->HD > (1 << 20) || (int64_t)c->V * c->C > ((int64_t)1 << 36))
        return errorf(err, "model dimensions are implausibly large");
    if (!(c->norm_eps > 0)) return errorf(err, "rms_norm_eps must be positive");
    if (c->F <= 0) return errorf(err, "intermediate_size must be positive");
    if (c->attention_bias && c->family != FAMILY_GPTOSS && c->family != FAMILY_QWEN3MOE)
        return errorf(err, "attention_bias is not supported for family %s",
                      family_names[c->family]);
    if (config_is_moe(c)) {
        if (c->E <= 0 || c->K <= 0 || c->K > c->E || c->F_expert <= 0)
            return errorf(err, "experts: need 0 < num_experts_per_tok %d <= num_experts %d and "
                               "an expert width > 0 (got %d)", c->K, c->E, c->F_expert);
        if (c->E > 65536) return errorf(err, "num_experts %d exceeds the limit of 65536", c->E);
        if (c->family == FAMILY_QWEN3MOE && c->decoder_sparse_step <= 0)
            return errorf(err, "decoder_sparse_step must be positive");
        if (!(c->router_aux_loss_coef >= 0) || !isfinite(c->router_aux_loss_coef))
            return errorf(err, "router_aux_loss_coef must be >= 0");
        if (c->family == FAMILY_GPTOSS && !(c->swiglu_limit > 0))
            return errorf(err, "swiglu_limit must be positive");
        if (c->sliding_window < 0) return errorf(err, "sliding_window must be >= 0");
    }
    if (c->bos_id >= c->V || c->eos_id >= c->V)
        return errorf(err, "bos/eos token id out of the vocabulary (V=%d)", c->V);
    return 0;
}

// ----------------------------------------------------------------------------
// RoPE frequencies (transformers modeling_rope_utils, in fp32)

float config_rope_inv_freq(const ModelConfig* c, float* inv) {
    const int half = c->HD / 2;
    const float base = (float)c->rope_theta;
    for (int i = 0; i < half; i++) {
        float e = (float)(2 * i) / (float)c->HD;
        inv[i] = 1.0f / powf(base, e);
    }
    float attn_scale = 1.0f;
    if (c->rope_type == ROPE_LLAMA3) {
        const float factor = (float)c->rope_factor;
        const float lf = (float)c->rope_low_freq_factor, hf = (float)c->rope_high_freq_factor;
        const float old_ctx = (float)c->rope_original_max_pos;
        const float low_wavelen = old_ctx / lf, high_wavelen = old_ctx / hf;
        for (int i = 0; i < half; i++) {
            float wavelen = (float)(2.0 * M_PI) / inv[i];
            float scaled = wavelen > low_wavelen ? inv[i] / factor : inv[i];
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
                float s = (old_ctx / wavelen - lf) / (hf - lf);
                scaled = (1.0f - s) * scaled / factor + s * scaled;
            }
            inv[i] = scaled;
        }
    } else if (c->rope_type == ROPE_YARN) {
        const double d = c->HD, b = c->rope_theta, L0 = c->rope_original_max_pos;
        double low = d * log(L0 / (c->yarn_beta_fast * 2 * M_PI)) / (2 * log(b));
        double high = d * log(L0 / (c->yarn_beta_slow * 2 * M_PI)) / (2 * log(b));
        if (c->yarn_truncate) {
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0) low = 0;
        if (high > d - 1) high = d - 1;
        if (low == high) high += 0.001;
        const float factor = (float)c->rope_factor;
        for (int i = 0; i < half; i++) {
            float ramp = (float)(((double)i - low) / (high - low));
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            float extra_factor = 1.0f - ramp;
            float pos_freq = 1.0f / inv[i];
            float interp = 1.0f / (factor * pos_freq);
            float extrap = 1.0f / pos_freq;
            inv[i] = interp * (1.0f - extra_factor) + extrap * extra_factor;
        }
        // get_mscale(factor): 1 for factor <= 1; a config's attention_factor wins
        attn_scale = c->rope_attention_factor > 0  ? (float)c->rope_attention_factor
                     : c->rope_factor <= 1.0       ? 1.0f
                                                   : (float)(0.1 * log(c->rope_factor) + 1.0);
    }
    return attn_scale;
}

// ----------------------------------------------------------------------------
// counts

// Attention projections of one block (matrices, then biases).
static int64_t attn_params(const ModelConfig* c) {
    int64_t C = c->C, qkv = (int64_t)(c->H + 2 * c->KVH) * c->HD, o = (int64_t)c->H * c->HD;
    return C * qkv + o * C;
}

static int64_t attn_extra_params(const ModelConfig* c) {
    int64_t n = 2 * (int64_t)c->C + (c->qk_norm ? 2 * (int64_t)c->HD : 0);
    if (c->attention_bias) n += (int64_t)(c->H + 2 * c->KVH) * c->HD + c->C;
    if (c->family == FAMILY_GPTOSS) n += c->H;  // sinks
    return n;
}

// The MLP of block b: all parameters, or those one token's matmuls use (the router and K experts).
static int64_t mlp_params(const ModelConfig* c, int b, int active) {
    const int64_t C = c->C;
    if (!config_block_is_moe(c, b)) return 3 * C * (int64_t)c->F;
    const int64_t E = c->E, Fe = c->F_expert, n = active ? c->K : E;
    int64_t p = E * C + n * 3 * C * Fe;
    if (!active && c->family == FAMILY_GPTOSS) p += E + E * (2 * Fe + C);  // router, expert biases
    return p;
}

int64_t config_num_params(const ModelConfig* c) {
    int64_t C = c->C, V = c->V, total = V * C + C + (c->tied_embeddings ? 0 : V * C);
    for (int b = 0; b < c->L; b++) total += attn_params(c) + attn_extra_params(c) + mlp_params(c, b, 0);
    return total;
}

int64_t config_num_matmul_params(const ModelConfig* c) {
    int64_t n = (int64_t)c->V * c->C;
    for (int b = 0; b < c->L; b++) n += attn_params(c) + mlp_params(c, b, 1);
    return n;
}

double config_flops_per_token(const ModelConfig* c, int T) {
    // 12·H·HD FLOPs (q·k and p·v, forward and backward) per visible (query, key) pair, keys per
    // query on average T/2 under the causal mask (6·T·H·HD) and W - W²/(2T) under a window W < T
    // (every query past the first W sees W keys), which meets T/2 at W = T.
    double att = 0.0;
    for (int b = 0; b < c->L; b++) {
        const double w = config_block_window(c, b);
        const double keys = w > 0 && w < T ? w - w * w / (2.0 * T) : 0.5 * T;
        att += 12.0 * keys * c->H * c->HD;
    }
    return 6.0 * (double)config_num_matmul_params(c) + att;
}

// ----------------------------------------------------------------------------
// mixture-of-experts structure

int config_is_moe(const ModelConfig* c) {
    return c->family == FAMILY_QWEN3MOE || c->family == FAMILY_GPTOSS;
}

int config_block_is_moe(const ModelConfig* c, int block) {
    if (!config_is_moe(c) || c->E <= 0 || block < 0 || block >= c->L) return 0;
    if (c->family == FAMILY_GPTOSS) return 1;
    // Qwen3MoeDecoderLayer: (layer_idx not in mlp_only_layers) and num_experts > 0 and
    // (layer_idx + 1) % decoder_sparse_step == 0
    return !c->mlp_only[block] && c->decoder_sparse_step > 0 &&
           (block + 1) % c->decoder_sparse_step == 0;
}

int config_block_window(const ModelConfig* c, int block) {
    if (c->family != FAMILY_GPTOSS || block < 0 || block >= c->L || !c->sliding[block]) return 0;
    return c->sliding_window;
}

int config_truncate_layers(ModelConfig* c, int n, char* err) {
    if (n < 1 || n > c->L)
        return errorf(err, "--layers %d: the model has %d decoder blocks", n, c->L);
    c->L = n;
    return config_validate(c, err);
}

int config_num_moe_blocks(const ModelConfig* c) {
    int n = 0;
    for (int b = 0; b < c->L; b++) n += config_block_is_moe(c, b);
    return n;
}

// ----------------------------------------------------------------------------
// printing and export

void config_print(const ModelConfig* c) {
    printf("model %s: family %s, V %d, C %d, L %d, H %d, KVH %d, HD %d, F %d, %s head\n", c->name,
           family_names[c->family], c->V, c->C, c->L, c->H, c->KVH, c->HD, c->F,
           c->tied_embeddings ? "tied" : "untied");
    const char* rope = c->rope_type == ROPE_LLAMA3 ? "llama3" : c->rope_type == ROPE_YARN ? "yarn"
                                                                                          : "default";
    printf("  rope %s theta %g%s, norm eps %g, %.3f M parameters\n", rope, c->rope_theta,
           c->qk_norm ? ", qk-norm" : "", (double)c->norm_eps,
           (double)config_num_params(c) / 1e6);
    if (config_is_moe(c)) {
        int n_slide = 0;
        for (int b = 0; b < c->L; b++) n_slide += config_block_window(c, b) > 0;
        printf("  experts: %d MoE blocks of %d experts (top %d, width %d), %.3f M active "
               "parameters; aux loss %s (coef %g)", config_num_moe_blocks(c), c->E, c->K,
               c->F_expert, (double)config_num_matmul_params(c) / 1e6,
               c->output_router_logits ? "on" : "off", c->router_aux_loss_coef);
        if (n_slide) printf("; %d sliding-window blocks (W %d)", n_slide, c->sliding_window);
        printf("\n");
    }
}

// The MoE fields of config.json (what config_from_hf_json reads back).
static void write_moe_json(FILE* f, const ModelConfig* c) {
    if (c->family == FAMILY_QWEN3MOE) {
        fprintf(f, "  \"num_experts\": %d,\n  \"num_experts_per_tok\": %d,\n"
                   "  \"moe_intermediate_size\": %d,\n  \"decoder_sparse_step\": %d,\n"
                   "  \"norm_topk_prob\": %s,\n  \"mlp_only_layers\": [",
                c->E, c->K, c->F_expert, c->decoder_sparse_step,
                c->norm_topk_prob ? "true" : "false");
        int first = 1;
        for (int b = 0; b < c->L; b++)
            if (c->mlp_only[b]) {
                fprintf(f, "%s%d", first ? "" : ", ", b);
                first = 0;
            }
        fprintf(f, "],\n  \"use_sliding_window\": false,\n");
    } else {
        fprintf(f, "  \"num_local_experts\": %d,\n  \"num_experts_per_tok\": %d,\n"
                   "  \"sliding_window\": %d,\n  \"swiglu_limit\": %.9g,\n  \"layer_types\": [",
                c->E, c->K, c->sliding_window, (double)c->swiglu_limit);
        for (int b = 0; b < c->L; b++)
            fprintf(f, "%s\"%s\"", b ? ", " : "", c->sliding[b] ? "sliding_attention" : "full_attention");
        fprintf(f, "],\n");
    }
    fprintf(f, "  \"router_aux_loss_coef\": %.17g,\n  \"output_router_logits\": %s,\n",
            c->router_aux_loss_coef, c->output_router_logits ? "true" : "false");
}

char* config_to_hf_json(const ModelConfig* c) {
    static const char* const archs[FAMILY_COUNT] = {"LlamaForCausalLM", "Qwen3ForCausalLM",
                                                    "Qwen3MoeForCausalLM", "GptOssForCausalLM"};
    static const char* const types[FAMILY_COUNT] = {"llama", "qwen3", "qwen3_moe", "gpt_oss"};
    // The legacy spelling (top-level rope_theta + rope_scaling): transformers 4 reads it and
    // transformers 5 converts it to rope_parameters.
    char rope[512];
    if (c->rope_type == ROPE_LLAMA3) {
        snprintf(rope, sizeof rope,
                 "{\"rope_type\": \"llama3\", \"factor\": %.17g, "
                 "\"low_freq_factor\": %.17g, \"high_freq_factor\": %.17g, "
                 "\"original_max_position_embeddings\": %d}",
                 c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor,
                 c->rope_original_max_pos);
    } else if (c->rope_type == ROPE_YARN) {
        int n = snprintf(rope, sizeof rope,
                         "{\"rope_type\": \"yarn\", \"factor\": %.17g, \"beta_fast\": %.17g, "
                         "\"beta_slow\": %.17g, \"truncate\": %s, "
                         "\"original_max_position_embeddings\": %d",
                         c->rope_factor, c->yarn_beta_fast, c->yarn_beta_slow,
                         c->yarn_truncate ? "true" : "false", c->rope_original_max_pos);
        if (c->rope_attention_factor > 0)
            n += snprintf(rope + n, sizeof rope - (size_t)n, ", \"attention_factor\": %.17g",
                          c->rope_attention_factor);
        snprintf(rope + n, sizeof rope - (size_t)n, "}");
    } else {
        snprintf(rope, sizeof rope, "null");
    }
    char bos[32] = "null", eos[32] = "null";
    if (c->bos_id >= 0) snprintf(bos, sizeof bos, "%d", c->bos_id);
    if (c->eos_id >= 0) snprintf(eos, sizeof eos, "%d", c->eos_id);
    char* s = NULL;
    size_t len = 0;
    FILE* f = open_memstream(&s, &len);
    if (!f) fatal("open_memstream failed");
    fprintf(f,
            "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n"
            "  \"vocab_size\": %d,\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n"
            "  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n"
            "  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n  \"rms_norm_eps\": %.9g,\n"
            "  \"hidden_act\": \"silu\",\n  \"max_position_embeddings\": %d,\n"
            "  \"tie_word_embeddings\": %s,\n  \"attention_bias\": %s,\n"
            "  \"bos_token_id\": %s,\n  \"eos_token_id\": %s,\n",
            archs[c->family], types[c->family], c->V, c->C, c->F, c->L, c->H, c->KVH, c->HD,
            (double)c->norm_eps, c->max_pos, c->tied_embeddings ? "true" : "false",
            c->attention_bias ? "true" : "false", bos, eos);
    if (config_is_moe(c)) write_moe_json(f, c);
    fprintf(f, "  \"rope_theta\": %.17g,\n  \"rope_scaling\": %s,\n  \"dtype\": \"float32\"\n}\n",
            c->rope_theta, rope);
    if (ferror(f) || fclose(f) != 0) fatal("config_to_hf_json: writing failed");
    return s;
}
