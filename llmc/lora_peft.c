/*
 * lora_peft.c — PEFT adapter directories (declared in lora.h): adapter_config.json and
 * adapter_model.safetensors as PEFT's save_pretrained writes them for a CausalLM, and reading
 * them back strictly (the config must be the model's LoRA, every key present with its shape,
 * nothing else).
 *
 * Keys: base_model.model.model.layers.{i}.{self_attn|mlp}.{q|k|v|o|gate|up|down}_proj.lora_{A|B}
 * .weight, A (r, in) and B (out, r) (PEFT's LoraModel around the CausalLM; the adapter name
 * "default" is not in saved keys). The tensor table carries these names (tensor.h).
 *
 * Experts (PEFT 0.21 on transformers 5, where Qwen3-MoE's and GPT-OSS's experts are fused 3-D
 * nn.Parameters): target_parameters gate_up_proj and down_proj, one lora.ParamWrapper each
 * (peft/tuners/lora/layer.py), nested on mlp.experts: the keys mlp.experts.base_layer.lora_{A|B}
 * .weight (gate_up_proj, the inner wrapper) and mlp.experts.lora_{A|B}.weight (down_proj). Shapes:
 * lora_A = nn.Linear(in, rank·E) (rank·E, in), row e·rank + k; lora_B = nn.Linear(rank·E, out)
 * (out, rank·E), column k·E + e (get_delta_weight: A.reshape(E, rank, in), B.reshape(out, rank,
 * E)). On Qwen3-MoE, PEFT's v4 -> v5 conversion (utils/transformers_weight_conversion.py) turns
 * target_modules gate_proj, up_proj, down_proj, gate (and all-linear) into target_parameters with
 * gate_up_proj at rank 2r and alpha 2·alpha (rank_pattern, alpha_pattern) and the router as
 * "gate.weight"; we write and read that form.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "crc32c.h"
#include "json.h"
#include "lora.h"
#include "safetensors.h"

// ----------------------------------------------------------------------------
// the experts' layout (lora.h): B (E, out, rank) here, (out, rank·E) column k·E + e in PEFT

static int is_expert_b(const TensorDesc* d) { return d->kind == TK_LORA_B && d->ndim == 3; }

static void peft_shape(const TensorDesc* d, int64_t shape[2]) {
    if (d->ndim == 3 && d->kind == TK_LORA_A) {  // (E, rank, in) -> (rank·E, in)
        shape[0] = d->shape[0] * d->shape[1];
        shape[1] = d->shape[2];
    } else if (d->ndim == 3) {  // (E, out, rank) -> (out, rank·E)
        shape[0] = d->shape[1];
        shape[1] = d->shape[2] * d->shape[0];
    } else {
        shape[0] = d->shape[0];
        shape[1] = d->shape[1];
    }
}

// An expert B between the table's (E, out, r) and PEFT's (out, r·E) with column k·E + e; other
// tensors copied.
static void permute_b(const TensorDesc* d, const float* src, float* dst, int to_peft) {
    if (!is_expert_b(d)) {
        memcpy(dst, src, (size_t)d->numel * sizeof(float));
        return;
    }
    const int64_t E = d->shape[0], out = d->shape[1], r = d->shape[2];
    for (int64_t e = 0; e < E; e++)
        for (int64_t o = 0; o < out; o++)
            for (int64_t k = 0; k < r; k++) {
                const int64_t table = (e * out + o) * r + k, peft = o * r * E + k * E + e;
                if (to_peft)
                    dst[peft] = src[table];
                else
                    dst[table] = src[peft];
            }
}

void lora_to_peft(const Model* m, int i, const float* src, float* dst, int64_t shape[2]) {
    const TensorDesc* d = &m->tt.t[i];
    peft_shape(d, shape);
    permute_b(d, src, dst, 1);
}

// The inverse: PEFT's layout src into the table's dst.
static void lora_from_peft(const TensorDesc* d, const float* src, float* dst) {
    permute_b(d, src, dst, 0);
}

// ----------------------------------------------------------------------------
// writing

// adapter_config.json with PEFT's LoraConfig fields (sorted, as PEFT writes them). malloc'd.
static char* config_json(const ModelConfig* c, const LoraSpec* l, const char* base_model,
                         size_t* len) {
    // the experts' gate_up at its own rank and alpha (tensor.h), as PEFT's conversion writes it
    const int gu_r = lora_target_rank(c, l, LORA_EXP_GATE_UP);
    const int patterns = (l->targets & LORA_EXPERTS_BIT) && gu_r != l->r;
    char alpha_pattern[96] = "{}", rank_pattern[96] = "{}";
    if (patterns) {
        snprintf(alpha_pattern, sizeof alpha_pattern, "{\n    \".*\\\\.gate_up_proj\": %.9g\n  }",
                 (double)lora_target_alpha(c, l, LORA_EXP_GATE_UP));
        snprintf(rank_pattern, sizeof rank_pattern, "{\n    \".*\\\\.gate_up_proj\": %d\n  }", gu_r);
    }
    char* buf = NULL;
    FILE* f = open_memstream(&buf, len);
    if (!f) fatal("open_memstream failed");
    fprintf(f, "{\n  \"alpha_pattern\": %s,\n  \"auto_mapping\": null,\n"
               "  \"base_model_name_or_path\": ", alpha_pattern);
    json_write_string(f, base_model);
    fprintf(f, ",\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n"
               "  \"inference_mode\": true,\n  \"init_lora_weights\": true,\n"
               "  \"layers_pattern\": null,\n  \"layers_to_transform\": null,\n"
               "  \"lora_alpha\": %.9g,\n  \"lora_dropout\": %.7g,\n"
               "  \"modules_to_save\": null,\n  \"peft_type\": \"LORA\",\n  \"r\": %d,\n"
               "  \"rank_pattern\": %s,\n  \"revision\": null,\n  \"target_modules\": [",
            (double)l->alpha, (double)l->dropout, l->r, rank_pattern);
    int first = 1;
    for (int tg = 0; tg < LORA_EXP_GATE_UP; tg++) {
        if (!(l->targets & LORA_BIT(tg))) continue;
        fprintf(f, "%s\n    \"%s\"", first ? "" : ",", lora_target_name((LoraTarget)tg));
        first = 0;
    }
    fputs("\n  ],\n", f);
    if (l->targets & LORA_EXPERTS_BIT)
        fputs("  \"target_parameters\": [\n    \"gate_up_proj\",\n    \"down_proj\"\n  ],\n", f);
    fprintf(f, "  \"task_type\": \"CAUSAL_LM\",\n  \"use_dora\": false,\n"
               "  \"use_rslora\": %s\n}\n", l->rslora ? "true" : "false");
    if (ferror(f) || fclose(f) != 0) fatal("building adapter_config.json failed");
    return buf;
}

int lora_save_peft(const char* dir, const Model* m, const Store* s, const char* base_model,
                   LoraFile files[2], char* err) {
    const TensorTable* tt = &m->tt;
    if (tt->lora.r <= 0) return errorf(err, "internal: no LoRA adapters to save");
    if (mkdir_p(dir, err) != 0) return -1;
    char path[4200];
    size_t len = 0;
    char* json = config_json(&m->cfg, &tt->lora, base_model, &len);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    int rc = file_write_atomic(path, json, len, err);
    if (rc == 0 && files) {
        str_copy(files[0].name, sizeof files[0].name, "adapter_config.json");
        files[0].bytes = len;
        files[0].crc = crc32c(json, len);
    }
    free(json);
    if (rc != 0) return -1;

    StWriter w;
    st_writer_init(&w);
    st_writer_meta(&w, "format", "pt");
    // the experts' B in PEFT's layout: copies, alive until the file is written
    float** copies = calloc_check((size_t)tt->n, sizeof(float*));
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->lora_target < 0) continue;
        int64_t shape[2];
        peft_shape(d, shape);
        const float* data = store_param(s, i);
        if (is_expert_b(d)) {
            copies[i] = malloc_check((size_t)d->numel * sizeof(float));
            lora_to_peft(m, i, data, copies[i], shape);
            data = copies[i];
        }
        st_writer_add(&w, d->hf_name, ST_F32, 2, shape, data);
    }
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    rc = st_writer_write(&w, path, err);
    for (int i = 0; i < tt->n; i++) free(copies[i]);
    free(copies);
    if (rc == 0 && files) {
        str_copy(files[1].name, sizeof files[1].name, "adapter_model.safetensors");
        files[1].bytes = w.file_bytes;
        files[1].crc = w.file_crc32c;
    }
    st_writer_free(&w);
    return rc;
}

// ----------------------------------------------------------------------------
// reading

int lora_load_weights(const char* path, const Model* m, Store* s, char* err) {
    const TensorTable* tt = &m->tt;
    StFile f;
    if (st_open(&f, path, err) != 0) return -1;
    int rc = 0, n_found = 0, n_lora = 0;
    for (int i = 0; i < tt->n; i++) n_lora += tt->t[i].lora_target >= 0;
    for (int k = 0; k < f.n_tensors && rc == 0; k++) {
        const StTensor* t = &f.tensors[k];
        const int i = tensor_table_find_hf(tt, t->name);
        if (i < 0 || tt->t[i].lora_target < 0) {
            rc = errorf(err, "%s: unexpected tensor '%s' (not an adapter of this LoRA "
                             "configuration: check --lora-targets and the model)", path, t->name);
            break;
        }
        const TensorDesc* d = &tt->t[i];
        int64_t want[2];
        peft_shape(d, want);
        if (t->ndim != 2 || t->shape[0] != want[0] || t->shape[1] != want[1]) {
            rc = errorf(err, "%s: tensor '%s' has shape [%lld, %lld], expected [%lld, %lld] "
                             "(r = %d)", path, t->name, (long long)t->shape[0],
                        (long long)(t->ndim > 1 ? t->shape[1] : 0), (long long)want[0],
                        (long long)want[1], tt->lora.r);
            break;
        }
        if (is_expert_b(d)) {
            float* tmp = malloc_check((size_t)d->numel * sizeof(float));
            rc = st_tensor_to_f32(t, tmp, d->numel, err);
            if (rc == 0) lora_from_peft(d, tmp, store_param(s, i));
            free(tmp);
        } else {
            rc = st_tensor_to_f32(t, store_param(s, i), d->numel, err);
        }
        if (rc == 0) n_found++;
    }
    if (rc == 0 && n_found != n_lora) {
        for (int i = 0; i < tt->n; i++) {
            if (tt->t[i].lora_target >= 0 && !st_find(&f, tt->t[i].hf_name)) {
                rc = errorf(err, "%s: adapter tensor '%s' is missing (%d of %d present)", path,
                            tt->t[i].hf_name, n_found, n_lora);
                break;
            }
        }
    }
    st_close(&f);
    return rc;
}

// PEFT's rule for a target_modules list: an entry names the module whose full path equals it or
// ends with "." + entry ("q_proj" and "model.layers.0.self_attn.q_proj" both name layer 0's q
// projection; peft writes all-linear as the list of full paths). Each target must then be adapted
// in every block that has it, or in none: per-layer target lists are refused.
static int entry_matches(const char* entry, const char* module) {
    const size_t le = strlen(entry), lm = strlen(module);
    if (le > lm) return 0;
    if (strcmp(module + (lm - le), entry) != 0) return 0;
    return le == lm || module[lm - le - 1] == '.';
}

// target_modules: "all-linear" or a list of PEFT module names into a LoraTarget set.
static int config_targets(const JsonValue* v, const ModelConfig* c, unsigned* targets,
                          const char* path, char* err) {
    *targets = 0;
    if (v && v->type == JSON_STRING && strcmp(v->str, "all-linear") == 0) {
        *targets = LORA_ALL_LINEAR;
        return 0;
    }
    if (!v || v->type != JSON_ARRAY)
        return errorf(err, "%s: target_modules must be a list of module names (a regular "
                           "expression is not supported)", path);
    int covered[LORA_N_TARGETS] = {0}, present[LORA_N_TARGETS] = {0}, first_missing[LORA_N_TARGETS];
    for (int tg = 0; tg < LORA_N_TARGETS; tg++) first_missing[tg] = -1;
    for (size_t k = 0; k < v->n; k++)
        if (v->items[k].type != JSON_STRING)
            return errorf(err, "%s: target_modules[%zu] is not a string", path, k);
    for (size_t k = 0; k < v->n; k++) {
        const char* e = v->items[k].str;
        int hits = 0;
        for (int l = 0; l < c->L; l++)
            for (int tg = 0; tg < LORA_EXP_GATE_UP; tg++) {
                if (!lora_block_has_target(c, l, tg)) continue;
                char module[128];
                snprintf(module, sizeof module, "model.layers.%d.%s.%s", l,
                         lora_target_parent((LoraTarget)tg), lora_target_name((LoraTarget)tg));
                hits += entry_matches(e, module);
            }
        if (hits == 0)
            return errorf(err, "%s: target module '%s' names no linear this trainer adapts in "
                               "this model (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                               "down_proj, gate: an MoE router)", path, e);
    }
    for (int l = 0; l < c->L; l++)
        for (int tg = 0; tg < LORA_EXP_GATE_UP; tg++) {
            if (!lora_block_has_target(c, l, tg)) continue;
            char module[128];
            snprintf(module, sizeof module, "model.layers.%d.%s.%s", l,
                     lora_target_parent((LoraTarget)tg), lora_target_name((LoraTarget)tg));
            int hit = 0;
            for (size_t k = 0; k < v->n && !hit; k++) hit = entry_matches(v->items[k].str, module);
            present[tg]++;
            covered[tg] += hit;
            if (!hit && first_missing[tg] < 0) first_missing[tg] = l;
        }
    for (int tg = 0; tg < LORA_EXP_GATE_UP; tg++) {
        if (covered[tg] == 0) continue;
        if (covered[tg] != present[tg])
            return errorf(err, "%s: target_modules adapt %s in %d of the %d blocks that have it "
                               "(not in layer %d); per-layer targets are not supported", path,
                          lora_target_name((LoraTarget)tg), covered[tg], present[tg],
                          first_missing[tg]);
        *targets |= LORA_BIT(tg);
    }
    return 0;
}

// Whether name (a target_parameters entry, PEFT matches it as a suffix after a dot) names `leaf`.
static int names_param(const char* name, const char* leaf) {
    const size_t n = strlen(name), k = strlen(leaf);
    return n == k ? strcmp(name, leaf) == 0
                  : n > k && name[n - k - 1] == '.' && strcmp(name + n - k, leaf) == 0;
}

// rank_pattern / alpha_pattern: empty, or one key for the experts' gate_up_proj (a regular
// expression ending in gate_up_proj) with the rank / alpha it has here (tensor.h); want < 0: the
// run has none (no experts, or their gate_up at r).
static int check_pattern(const JsonValue* v, const char* key, double want, const char* path,
                         char* err) {
    if (!v || v->type == JSON_NULL || (v->type == JSON_OBJECT && v->n == 0)) {
        if (want >= 0)
            return errorf(err, "%s: no %s for the experts' gate_up_proj (this run has it at %g, "
                               "as PEFT's conversion of gate_proj + up_proj writes; pass "
                               "--lora-gate-up-rank with the adapter's r)", path, key, want);
        return 0;
    }
    const size_t klen = v->type == JSON_OBJECT && v->n == 1 ? strlen(v->keys[0]) : 0;
    if (klen < 12 || strcmp(v->keys[0] + klen - 12, "gate_up_proj") != 0 ||
        v->items[0].type != JSON_NUMBER)
        return errorf(err, "%s: %s is set; this trainer supports a per-module rank and alpha "
                           "only for the experts' gate_up_proj", path, key);
    if (v->items[0].number != want)
        return errorf(err, "%s: %s gives the experts' gate_up_proj %g, this run %g (pass "
                           "--lora-gate-up-rank with the adapter's rank)", path, key,
                      v->items[0].number, want >= 0 ? want : 0.0);
    return 0;
}

// target_parameters (the experts' gate_up_proj, down_proj; the router "gate.weight" as PEFT's
// conversion writes it) into targets, and the rank and alpha patterns that go with them.
static int config_parameters(const JsonValue* root, const Model* m, unsigned* targets,
                             const char* path, char* err) {
    const JsonValue* v = json_get(root, "target_parameters");
    if (v && v->type != JSON_NULL && v->type != JSON_ARRAY)
        return errorf(err, "%s: target_parameters must be a list of parameter names", path);
    for (size_t k = 0; v && v->type == JSON_ARRAY && k < v->n; k++) {
        const JsonValue* e = &v->items[k];
        const char* name = e->type == JSON_STRING ? e->str : "";
        if (names_param(name, "gate_up_proj")) *targets |= LORA_BIT(LORA_EXP_GATE_UP);
        else if (names_param(name, "down_proj")) *targets |= LORA_BIT(LORA_EXP_DOWN);
        else if (names_param(name, "gate.weight")) *targets |= LORA_BIT(LORA_ROUTER);
        else
            return errorf(err, "%s: target parameter '%s' is not supported (gate_up_proj, "
                               "down_proj: the experts; gate.weight: the router)", path, name);
    }
    const unsigned ex = *targets & LORA_EXPERTS_BIT;
    if (ex && ex != LORA_EXPERTS_BIT)
        return errorf(err, "%s: target_parameters adapts one of the experts' gate_up_proj and "
                           "down_proj; this trainer adapts both (--lora-targets experts)", path);
    const LoraSpec* l = &m->tt.lora;
    const int gu_r = lora_target_rank(&m->cfg, l, LORA_EXP_GATE_UP);
    const int experts = ex != 0 && gu_r != l->r;
    if (check_pattern(json_get(root, "rank_pattern"), "rank_pattern", experts ? gu_r : -1, path,
                      err) != 0 ||
        check_pattern(json_get(root, "alpha_pattern"), "alpha_pattern",
                      experts ? (double)lora_target_alpha(&m->cfg, l, LORA_EXP_GATE_UP) : -1,
                      path, err) != 0)
        return -1;
    return 0;
}

// A field this trainer does not implement must hold its default (empty / null / false).
static int check_default(const JsonValue* root, const char* key, const char* path, char* err) {
    const JsonValue* v = json_get(root, key);
    if (!v || v->type == JSON_NULL) return 0;
    if ((v->type == JSON_OBJECT || v->type == JSON_ARRAY) && v->n == 0) return 0;
    if (v->type == JSON_BOOL && !v->boolean) return 0;
    return errorf(err, "%s: %s is set; this trainer supports plain LoRA adapters only", path, key);
}

static int check_config(const JsonValue* root, const Model* m, const char* path, char* err) {
    const LoraSpec* l = &m->tt.lora;
    const char* s = NULL;
    if (json_get_string(root, "peft_type", &s) != 1 || strcmp(s, "LORA") != 0)
        return errorf(err, "%s: peft_type is not \"LORA\"", path);
    if (json_get_string(root, "bias", &s) == 1 && strcmp(s, "none") != 0)
        return errorf(err, "%s: bias \"%s\": only adapters without bias (\"none\") are supported",
                      path, s);
    static const char* const unsupported[] = {"use_dora", "fan_in_fan_out", "layers_to_transform",
                                              "modules_to_save", "lora_bias",
                                              "trainable_token_indices", "layer_replication",
                                              NULL};
    for (int k = 0; unsupported[k]; k++)
        if (check_default(root, unsupported[k], path, err) != 0) return -1;
    int64_t r = 0;
    if (json_get_int(root, "r", &r) != 1) return errorf(err, "%s: no integer r", path);
    if (r != l->r)
        return errorf(err, "%s: the adapter has r = %lld but --lora-r is %d", path, (long long)r,
                      l->r);
    double alpha = 0;
    if (json_get_double(root, "lora_alpha", &alpha) != 1)
        return errorf(err, "%s: no lora_alpha", path);
    if ((float)alpha != l->alpha)
        return errorf(err, "%s: the adapter has lora_alpha %g but --lora-alpha is %g (pass "
                           "--lora-alpha %g)", path, alpha, (double)l->alpha, alpha);
    int rs = 0;
    if (json_get_bool(root, "use_rslora", &rs) < 0)
        return errorf(err, "%s: use_rslora is not a boolean", path);
    if (rs != l->rslora)
        return errorf(err, "%s: the adapter has use_rslora %s but this run %s --rslora", path,
                      rs ? "true" : "false", l->rslora ? "has" : "has no");
    unsigned targets = 0;
    if (config_targets(json_get(root, "target_modules"), &m->cfg, &targets, path, err) != 0) return -1;
    if (config_parameters(root, m, &targets, path, err) != 0) return -1;
    // all-linear: the linears this model has (as the table narrowed --lora-targets)
    if (targets == LORA_ALL_LINEAR &&
        lora_targets_for_model(&m->cfg, targets, &targets, err) != 0)
        return -1;
    if (targets != l->targets) {
        char have[128], want[128];
        lora_targets_string(targets, have, sizeof have);
        lora_targets_string(l->targets, want, sizeof want);
        return errorf(err, "%s: the adapter targets %s but --lora-targets is %s (pass "
                           "--lora-targets %s)", path, have, want, have);
    }
    return 0;
}

int lora_load_peft(const char* dir, const Model* m, Store* s, char* err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    size_t len = 0;
    char* text = file_read_all(path, 1 << 20, &len, err);
    if (!text) return -1;
    JsonDoc doc;
    char jerr[ERR_LEN];
    if (json_parse(text, len, &doc, jerr) != 0) {
        free(text);
        return errorf(err, "%s: %s", path, jerr);
    }
    free(text);
    int rc = check_config(&doc.root, m, path, err);
    json_free(&doc);
    if (rc != 0) return -1;
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    if (!file_exists(path))
        return errorf(err, "%s: no such file (a PEFT adapter directory holds "
                           "adapter_model.safetensors)", path);
    return lora_load_weights(path, m, s, err);
}
