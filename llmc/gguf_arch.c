/*
 * gguf_arch.c — what GGUF files mean for our models: general.architecture and the {arch}.* keys
 * -> ModelConfig (and back, for exports), llama3 RoPE scaling recovered from rope_freqs.weight,
 * descriptor and HF tensor names -> GGUF names, the ne order (HF shape reversed), llama.cpp's
 * LLaMA q/k row permutation, and its layout of the qwen3moe / gpt-oss expert tensors.
 */
#include "gguf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// architectures and configuration

static const char* const arch_names[FAMILY_COUNT] = {"llama", "qwen3", "qwen3moe", "gpt-oss"};

const char* gguf_arch_name(ModelFamily family) {
    return (family >= 0 && family < FAMILY_COUNT) ? arch_names[family] : "?";
}

// {arch}.<suffix> as an integer in [lo, hi]. A per-layer ARRAY is accepted when every entry is
// equal (we have no per-layer sizes). Absent: 0 and *out untouched (an error when required).
static int arch_int(const GgufFile* f, const char* arch, const char* suffix, int required,
                    int64_t lo, int64_t hi, int* out, char* err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    const GgufKV* kv = gguf_find_kv(f, key);
    if (!kv) return required ? errorf(err, "%s: metadata key '%s' is missing", f->path, key) : 0;
    int64_t v;
    if (kv->value.type == GGUF_TYPE_ARRAY) {
        if (kv->value.n == 0 || gguf_array_int(&kv->value, 0, &v) != 0)
            return errorf(err, "%s: key '%s': expected an integer or a non-empty integer array",
                          f->path, key);
        for (uint64_t i = 1; i < kv->value.n; i++) {
            int64_t w;
            if (gguf_array_int(&kv->value, i, &w) != 0 || w != v)
                return errorf(err,
                              "%s: key '%s': per-layer values differ (layer %llu), which is "
                              "not supported",
                              f->path, key, (unsigned long long)i);
        }
    } else if (gguf_value_int(&kv->value, &v) != 0) {
        return errorf(err, "%s: key '%s' has type %s, expected an integer", f->path, key,
                      gguf_value_type_name(kv->value.type));
    }
    if (v < lo || v > hi)
        return errorf(err, "%s: key '%s' = %lld is out of range [%lld, %lld]", f->path, key,
                      (long long)v, (long long)lo, (long long)hi);
    *out = (int)v;
    return 0;
}

static int arch_float(const GgufFile* f, const char* arch, const char* suffix, int required,
                      double* out, char* err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int r = gguf_get_float(f, key, out);
    if (r == 0 && required) return errorf(err, "%s: metadata key '%s' is missing", f->path, key);
    if (r < 0 || (r == 1 && !isfinite(*out)))
        return errorf(err, "%s: key '%s' must be a finite number", f->path, key);
    return 0;
}

// Base (unscaled) inverse frequencies as llama.cpp / the converter compute them, and the llama3
// check: our scaled frequencies must equal base / rope_freqs within float rounding.
static int llama3_matches(const ModelConfig* c, const float* r, int* bad_index) {
    const int half = c->HD / 2;
    float* inv = malloc_check((size_t)half * sizeof(float));
    config_rope_inv_freq(c, inv);
    int ok = 1;
    for (int i = 0; i < half && ok; i++) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)c->HD);
        double want = (double)base / (double)r[i];
        if (!(fabs((double)inv[i] - want) <= 1e-4 * want)) {
            ok = 0;
            *bad_index = i;
        }
    }
    free(inv);
    return ok;
}

// Recover llama3 scaling parameters from rope_freqs.weight (the converter writes no keys for
// them). Meta's lf=1, hf=4 are tried first (every released Llama 3.x), with the original context
// length from the blended frequencies; otherwise the two wavelength thresholds are solved for.
// The result is only accepted if config_rope_inv_freq reproduces every frequency.
static int llama3_from_rope_freqs(const GgufFile* f, const GgufTensor* t, ModelConfig* c,
                                  char* err) {
    const int half = c->HD / 2;
    if (t->n_dims != 1 || t->ne[0] != half)
        return errorf(err,
                      "%s: tensor 'rope_freqs.weight' has %lld entries, head_dim/2 = %d "
                      "expected",
                      f->path, (long long)t->numel, half);
    float* r = malloc_check((size_t)half * sizeof(float));
    char terr[ERR_LEN];
    if (gguf_tensor_to_f32(f, t, r, half, terr) != 0) {
        free(r);
        return errorf(err, "%s", terr);
    }
    float factor = 1.0f;
    for (int i = 0; i < half; i++) {
        if (!(r[i] > 0.0f)) {
            errorf(err, "%s: rope_freqs.weight[%d] = %g is not positive", f->path, i, (double)r[i]);
            free(r);
            return -1;
        }
        if (r[i] > factor) factor = r[i];
    }
    if (factor <= 1.0f + 1e-6f) {  // all ones: no scaling
        free(r);
        return 0;
    }
    // wavelengths and classes: 0 unchanged, 1 blended, 2 divided by factor
    double* lam = malloc_check((size_t)half * sizeof(double));
    double* s = malloc_check((size_t)half * sizeof(double));
    int first_b = -1, last_b = -1, last_u = -1, first_lo = -1;
    for (int i = 0; i < half; i++) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)c->HD);
        lam[i] = 2.0 * M_PI / (double)base;
        s[i] = (1.0 / r[i] - 1.0 / factor) / (1.0 - 1.0 / factor);
        if (fabsf(r[i] - 1.0f) <= 1e-6f)
            last_u = i;
        else if (fabsf(r[i] - factor) <= 1e-6f * factor) {
            if (first_lo < 0) first_lo = i;
        } else {
            if (first_b < 0) first_b = i;
            last_b = i;
        }
    }
    c->rope_type = ROPE_LLAMA3;
    c->rope_factor = factor;
    int found = 0, bad = 0;
    // 1. Meta's lf = 1, hf = 4; L0 from a blended frequency (s = (L0/lam - 1)/3), else 8192
    double l0 = first_b >= 0 ? lam[first_b] * (3.0 * s[first_b] + 1.0) : 8192.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 4.0;
    c->rope_original_max_pos = (int)lround(l0);
    found = l0 >= 1 && l0 < 1e9 && llama3_matches(c, r, &bad);
    // 2. solve for lam_lo = L0/lf and lam_hi = L0/hf (lf = 1): A/lam - s*B = 1, A = lam_lo,
    //    B = lam_lo/lam_hi - 1, from two blended frequencies, or placed between the classes
    if (!found) {
        double A, B;
        double lam_u = last_u >= 0 ? lam[last_u] : 0.0;
        double lam_lo_min = first_lo >= 0 ? lam[first_lo] : 1e30;
        if (first_b >= 0 && last_b > first_b) {
            double det = -s[last_b] / lam[first_b] + s[first_b] / lam[last_b];
            A = (s[first_b] - s[last_b]) / det;
            B = (1.0 / lam[first_b] - 1.0 / lam[last_b]) / det;
        } else if (first_b >= 0) {
            // one blended point: pick lam_hi between the unchanged class and it, solve A
            double lb = lam[first_b], sb = s[first_b];
            double th = lam_u > 0 ? sqrt(lam_u * lb) : lb / 2;
            A = (1.0 - sb) / (1.0 / lb - sb / th);
            for (int it = 0; it < 60 && !(A < lam_lo_min); it++) {
                th = sqrt(th * lb);
                A = (1.0 - sb) / (1.0 / lb - sb / th);
            }
            B = A / th - 1.0;
        } else {
            double lo_end = lam_lo_min < 1e30 ? lam_lo_min : 2 * lam[half - 1];
            double hi_end = lam_u > 0 ? lam_u : lo_end / 4;
            double th = hi_end * pow(lo_end / hi_end, 1.0 / 3.0);
            A = hi_end * pow(lo_end / hi_end, 2.0 / 3.0);
            B = A / th - 1.0;
        }
        // integer L0 as config.json stores it; lf, hf keep the two thresholds exact
        double L0 = A >= 1.0 ? floor(A) : 1.0;
        if (isfinite(A) && isfinite(B) && A > 0 && B > 0 && A < 1e9) {
            c->rope_original_max_pos = (int)L0;
            c->rope_low_freq_factor = L0 / A;
            c->rope_high_freq_factor = L0 * (1.0 + B) / A;
            found = llama3_matches(c, r, &bad);
        }
    }
    int rc = 0;
    if (!found) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * bad) / (float)c->HD);
        rc = errorf(err,
                    "%s: rope_freqs.weight[%d] = %g does not match llama3 RoPE scaling "
                    "(factor %g, base frequency %g): cannot reproduce these frequencies",
                    f->path, bad, (double)r[bad], (double)factor, (double)base);
    }
    free(lam);
    free(s);
    free(r);
    return rc;
}

static int tokenizer_id(const GgufFile* f, const char* key, int* out, char* err) {
    int64_t v;
    int r = gguf_get_int(f, key, &v);
    if (r == 0) return 0;
    if (r < 0 || v < 0 || v > (1 << 30))
        return errorf(err, "%s: key '%s' must be a token id", f->path, key);
    *out = (int)v;
    return 0;
}

#define GGUF_BIG (1 << 30)  // upper bound of every size read from metadata

// general.architecture -> family (arch receives the printable name). Split files are refused.
static int config_family(const GgufFile* f, ModelConfig* c, char* arch, size_t cap, char* err) {
    GgufString as;
    int r = gguf_get_string(f, "general.architecture", &as);
    if (r == 0) return errorf(err, "%s: metadata key 'general.architecture' is missing", f->path);
    if (r < 0) return errorf(err, "%s: key 'general.architecture' must be a STRING", f->path);
    str_printable(as.s, as.n, arch, cap);
    int family = -1;
    for (int i = 0; i < FAMILY_COUNT; i++)
        if (as.n == strlen(arch_names[i]) && memcmp(as.s, arch_names[i], as.n) == 0) family = i;
    if (family < 0)
        return errorf(err,
                      "%s: unsupported architecture '%s' (supported: llama, qwen3, qwen3moe, "
                      "gpt-oss)",
                      f->path, arch);
    c->family = (ModelFamily)family;
    int64_t splits = 1;
    if (gguf_get_int(f, "split.count", &splits) == 1 && splits > 1)
        return errorf(err,
                      "%s: a split GGUF (split.count %lld); merge it first with "
                      "llama-gguf-split --merge",
                      f->path, (long long)splits);
    return 0;
}

// L, C, H, KVH, F, HD, eps, rope theta, context length.
static int config_sizes(const GgufFile* f, const char* arch, ModelConfig* c, char* err) {
    if (arch_int(f, arch, "block_count", 1, 1, CONFIG_MAX_LAYERS, &c->L, err) ||
        arch_int(f, arch, "embedding_length", 1, 1, GGUF_BIG, &c->C, err) ||
        arch_int(f, arch, "attention.head_count", 1, 1, GGUF_BIG, &c->H, err))
        return -1;
    c->KVH = c->H;
    if (arch_int(f, arch, "attention.head_count_kv", 0, 1, GGUF_BIG, &c->KVH, err)) return -1;
    int moe = c->family == FAMILY_QWEN3MOE || c->family == FAMILY_GPTOSS;
    if (arch_int(f, arch, "feed_forward_length", !moe, 1, GGUF_BIG, &c->F, err)) return -1;
    // head dim: key_length, else rope.dimension_count, else C/H
    c->HD = c->C / c->H;
    int rope_dim = 0, key_len = 0, val_len = 0;
    if (arch_int(f, arch, "rope.dimension_count", 0, 1, GGUF_BIG, &rope_dim, err) ||
        arch_int(f, arch, "attention.key_length", 0, 1, GGUF_BIG, &key_len, err) ||
        arch_int(f, arch, "attention.value_length", 0, 1, GGUF_BIG, &val_len, err))
        return -1;
    if (key_len)
        c->HD = key_len;
    else if (rope_dim)
        c->HD = rope_dim;
    if (val_len && val_len != c->HD)
        return errorf(err,
                      "%s: %s.attention.value_length %d differs from the key length %d (not "
                      "supported)",
                      f->path, arch, val_len, c->HD);
    if (rope_dim && rope_dim != c->HD)
        return errorf(err,
                      "%s: %s.rope.dimension_count %d differs from the head dim %d (partial "
                      "rotary embeddings are not supported)",
                      f->path, arch, rope_dim, c->HD);
    if (c->HD <= 0 || c->HD % 2 != 0)
        return errorf(err, "%s: head dim %d must be positive and even (RoPE)", f->path, c->HD);
    double eps = 0.0;
    if (arch_float(f, arch, "attention.layer_norm_rms_epsilon", 1, &eps, err)) return -1;
    if (!(eps > 0 && eps < 1))
        return errorf(err, "%s: %s.attention.layer_norm_rms_epsilon = %g must be in (0, 1)",
                      f->path, arch, eps);
    c->norm_eps = (float)eps;
    c->rope_theta = 10000.0;  // llama.cpp's default when the key is absent
    if (arch_float(f, arch, "rope.freq_base", 0, &c->rope_theta, err)) return -1;
    c->max_pos = 2048;
    return arch_int(f, arch, "context_length", 0, 1, GGUF_BIG, &c->max_pos, err);
}

// Vocabulary (vocab_size, else the token list, else the embedding's rows), tying (no
// output.weight), special token ids.
static int config_vocab(const GgufFile* f, const char* arch, ModelConfig* c, char* err) {
    const GgufTensor* embd = gguf_find_tensor(f, "token_embd.weight");
    const GgufKV* tokens = gguf_find_kv(f, "tokenizer.ggml.tokens");
    if (arch_int(f, arch, "vocab_size", 0, 1, GGUF_BIG, &c->V, err)) return -1;
    if (c->V == 0 && tokens && tokens->value.type == GGUF_TYPE_ARRAY && tokens->value.n > 0 &&
        tokens->value.n <= (uint64_t)GGUF_BIG)
        c->V = (int)tokens->value.n;
    if (c->V == 0 && embd && embd->n_dims == 2 && embd->ne[1] > 0 && embd->ne[1] <= GGUF_BIG)
        c->V = (int)embd->ne[1];
    if (c->V == 0)
        return errorf(err,
                      "%s: cannot tell the vocabulary size (no %s.vocab_size, "
                      "tokenizer.ggml.tokens or token_embd.weight)",
                      f->path, arch);
    c->tied_embeddings = gguf_find_tensor(f, "output.weight") == NULL;
    if (tokenizer_id(f, "tokenizer.ggml.bos_token_id", &c->bos_id, err) ||
        tokenizer_id(f, "tokenizer.ggml.eos_token_id", &c->eos_id, err))
        return -1;
    return 0;
}

// RoPE scaling (llama3 from rope_freqs.weight, YaRN from keys) and the MoE fields.
static int config_scaling_and_experts(const GgufFile* f, const char* arch, ModelConfig* c,
                                      char* err) {
    char key[128];
    GgufString st;
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    int r = gguf_get_string(f, key, &st);
    if (r < 0) return errorf(err, "%s: key '%s' must be a STRING", f->path, key);
    if (r == 1 && !(st.n == 4 && memcmp(st.s, "none", 4) == 0)) {
        char sp[32];
        str_printable(st.s, st.n, sp, sizeof sp);
        if (strcmp(sp, "yarn") != 0)
            return errorf(err,
                          "%s: %s = '%s' is not supported (supported: yarn, and llama3 "
                          "through rope_freqs.weight)",
                          f->path, key, sp);
        c->rope_type = ROPE_YARN;
        if (arch_float(f, arch, "rope.scaling.factor", 1, &c->rope_factor, err) ||
            arch_int(f, arch, "rope.scaling.original_context_length", 1, 1, GGUF_BIG,
                     &c->rope_original_max_pos, err) ||
            arch_float(f, arch, "rope.scaling.yarn_beta_fast", 0, &c->yarn_beta_fast, err) ||
            arch_float(f, arch, "rope.scaling.yarn_beta_slow", 0, &c->yarn_beta_slow, err))
            return -1;
    }
    const GgufTensor* rf = gguf_find_tensor(f, "rope_freqs.weight");
    if (rf && c->family == FAMILY_LLAMA && llama3_from_rope_freqs(f, rf, c, err) != 0) return -1;
    if (c->family != FAMILY_QWEN3MOE && c->family != FAMILY_GPTOSS) return 0;
    if (arch_int(f, arch, "expert_count", 1, 1, GGUF_BIG, &c->E, err) ||
        arch_int(f, arch, "expert_used_count", 1, 1, GGUF_BIG, &c->K, err) ||
        arch_int(f, arch, "expert_feed_forward_length", 1, 1, GGUF_BIG, &c->F_expert, err))
        return -1;
    c->decoder_sparse_step = 1;  // every block routes (llama.cpp has no dense qwen3moe blocks)
    // not stored in GGUF: hard-coded by llama.cpp (docs/FORMATS.md §4.2)
    c->norm_topk_prob = c->family == FAMILY_QWEN3MOE;
    // The aux loss as the released HF configs have it (off; their coefficients)
    c->output_router_logits = 0;
    c->router_aux_loss_coef = c->family == FAMILY_GPTOSS ? 0.9 : 0.001;
    // HF exports: the hub's layouts (one tensor per Qwen3-MoE expert; GPT-OSS's fused x·W)
    c->expert_layout = c->family == FAMILY_GPTOSS ? EXPERTS_GPTOSS : EXPERTS_PER_EXPERT;
    if (c->F == 0) c->F = c->F_expert;  // no dense block: the width is unused
    if (c->family == FAMILY_GPTOSS) {
        c->attention_bias = 1;
        c->swiglu_limit = 7.0f;
        c->yarn_truncate = 0;  // GPT-OSS's rope_scaling: truncate false
        if (arch_int(f, arch, "attention.sliding_window", 0, 0, GGUF_BIG, &c->sliding_window, err))
            return -1;
        // layer_types: sliding at even blocks (HF's default, llama.cpp's swa pattern 2)
        for (int i = 0; i < c->L && i < CONFIG_MAX_LAYERS; i++)
            c->sliding[i] = c->sliding_window > 0 && i % 2 == 0;
    }
    return 0;
}

int gguf_config(const GgufFile* f, ModelConfig* cfg, char* err) {
    ModelConfig c;
    memset(&c, 0, sizeof c);
    c.rope_factor = 1.0;
    c.rope_low_freq_factor = 1.0;
    c.rope_high_freq_factor = 4.0;
    c.yarn_beta_fast = 32.0;
    c.yarn_beta_slow = 1.0;
    c.bos_id = -1;
    c.eos_id = -1;
    char arch[64];
    if (config_family(f, &c, arch, sizeof arch, err) || config_sizes(f, arch, &c, err) ||
        config_vocab(f, arch, &c, err) || config_scaling_and_experts(f, arch, &c, err))
        return -1;
    c.qk_norm = c.family == FAMILY_QWEN3 || c.family == FAMILY_QWEN3MOE;
    GgufString name;
    if (gguf_get_string(f, "general.name", &name) == 1 && name.n > 0) {
        str_printable(name.s, name.n, c.name, sizeof c.name);
    } else {
        const char* base = strrchr(f->path, '/');
        str_copy(c.name, sizeof c.name, base ? base + 1 : f->path);
    }
    char verr[ERR_LEN];
    if (config_validate(&c, verr) != 0) return errorf(err, "%s: %s", f->path, verr);
    *cfg = c;
    return 0;
}

// ----------------------------------------------------------------------------
// tensor names and layout

void gguf_tensor_name(ModelFamily family, const TensorDesc* d, char* out, size_t cap) {
    if (family == FAMILY_GPTOSS && d->kind == TK_MLP_NORM) {
        snprintf(out, cap, "blk.%d.post_attention_norm.weight", d->block);
        return;
    }
    str_copy(out, cap, d->gguf_name);
}

// HF suffix (after "model.layers.N.") -> GGUF suffix (after "blk.N."), per family mask.
typedef struct NameMap {
    unsigned families;  // bit per ModelFamily
    const char* hf;
    const char* gguf;
} NameMap;

#define FAM(f)  (1u << (f))
#define FAM_ALL (FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE) | FAM(FAMILY_GPTOSS))

static const NameMap block_names[] = {
    {FAM_ALL, "input_layernorm.weight", "attn_norm.weight"},
    {FAM_ALL, "self_attn.q_proj.weight", "attn_q.weight"},
    {FAM_ALL, "self_attn.k_proj.weight", "attn_k.weight"},
    {FAM_ALL, "self_attn.v_proj.weight", "attn_v.weight"},
    {FAM_ALL, "self_attn.o_proj.weight", "attn_output.weight"},
    {FAM(FAMILY_GPTOSS), "self_attn.q_proj.bias", "attn_q.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.k_proj.bias", "attn_k.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.v_proj.bias", "attn_v.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.o_proj.bias", "attn_output.bias"},
    {FAM(FAMILY_GPTOSS), "self_attn.sinks", "attn_sinks.weight"},
    {FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "self_attn.q_norm.weight", "attn_q_norm.weight"},
    {FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "self_attn.k_norm.weight", "attn_k_norm.weight"},
    {FAM_ALL & ~FAM(FAMILY_GPTOSS), "post_attention_layernorm.weight", "ffn_norm.weight"},
    {FAM(FAMILY_GPTOSS), "post_attention_layernorm.weight", "post_attention_norm.weight"},
    {FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "mlp.gate_proj.weight",
     "ffn_gate.weight"},
    {FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "mlp.up_proj.weight",
     "ffn_up.weight"},
    {FAM(FAMILY_LLAMA) | FAM(FAMILY_QWEN3) | FAM(FAMILY_QWEN3MOE), "mlp.down_proj.weight",
     "ffn_down.weight"},
    // MoE routers and stacked experts (docs/FORMATS.md §4.4). The stacked GGUF tensors are
    // [E, out, in] row-major; the HF forms differ per family (see GgufLayout notes in
    // gguf_name_from_hf).
    {FAM(FAMILY_QWEN3MOE), "mlp.gate.weight", "ffn_gate_inp.weight"},
    {FAM(FAMILY_QWEN3MOE), "mlp.experts.gate_up_proj", "ffn_gate_exps.weight"},
    {FAM(FAMILY_QWEN3MOE), "mlp.experts.down_proj", "ffn_down_exps.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.router.weight", "ffn_gate_inp.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.router.bias", "ffn_gate_inp.bias"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.gate_up_proj", "ffn_gate_exps.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.gate_up_proj_bias", "ffn_gate_exps.bias"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.down_proj", "ffn_down_exps.weight"},
    {FAM(FAMILY_GPTOSS), "mlp.experts.down_proj_bias", "ffn_down_exps.bias"},
};

// Layout notes for the MoE entries (what the MoE loader must do beyond the name):
//  - qwen3moe per-expert "mlp.experts.{e}.{gate,up,down}_proj.weight" [out, in] are slice e of
//    ffn_{gate,up,down}_exps.weight; the transformers-5 fused "mlp.experts.gate_up_proj"
//    [E, 2Im, H] holds the gate rows then the up rows (ffn_gate_exps, then ffn_up_exps).
//  - gpt-oss "mlp.experts.gate_up_proj" [E, H, 2I] is x·W with gate/up interleaved in the
//    columns: ffn_gate_exps[e] = W[e][:, 0::2]ᵀ and ffn_up_exps[e] = W[e][:, 1::2]ᵀ (biases: the
//    same de-interleave, no transpose); "down_proj" [E, I, H] is ffn_down_exps[e]ᵀ.
int gguf_name_from_hf(ModelFamily family, const char* hf, char* out, size_t cap) {
    static const struct {
        const char* hf;
        const char* gguf;
    } top[] = {{"model.embed_tokens.weight", "token_embd.weight"},
               {"model.norm.weight", "output_norm.weight"},
               {"lm_head.weight", "output.weight"}};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (strcmp(hf, top[i].hf) == 0) {
            str_copy(out, cap, top[i].gguf);
            return 0;
        }
    int layer, n = 0;
    if (sscanf(hf, "model.layers.%d.%n", &layer, &n) != 1 || n == 0 || layer < 0) return -1;
    const char* rest = hf + n;
    // qwen3moe per-expert tensors: "mlp.experts.{e}.gate_proj.weight" -> the stacked tensor
    int e, m = 0;
    char which[16];
    if (family == FAMILY_QWEN3MOE &&
        sscanf(rest, "mlp.experts.%d.%15[a-z]_proj.weight%n", &e, which, &m) == 2 &&
        rest[m] == '\0' && e >= 0 &&
        (strcmp(which, "gate") == 0 || strcmp(which, "up") == 0 || strcmp(which, "down") == 0)) {
        snprintf(out, cap, "blk.%d.ffn_%s_exps.weight", layer, which);
        return 0;
    }
    for (size_t i = 0; i < sizeof block_names / sizeof block_names[0]; i++) {
        if (!(block_names[i].families & FAM(family)) || strcmp(rest, block_names[i].hf) != 0)
            continue;
        snprintf(out, cap, "blk.%d.%s", layer, block_names[i].gguf);
        return 0;
    }
    return -1;
}

void gguf_permute_rows(const float* src, float* dst, int n_head, int64_t rows, int64_t cols,
                       int inverse) {
    const int64_t hd = rows / n_head, half = hd / 2;
    for (int64_t h = 0; h < n_head; h++)
        for (int64_t i = 0; i < half; i++)
            for (int64_t j = 0; j < 2; j++) {
                int64_t gguf_row = h * hd + 2 * i + j, hf_row = h * hd + j * half + i;
                int64_t from = inverse ? gguf_row : hf_row, to = inverse ? hf_row : gguf_row;
                memcpy(dst + to * cols, src + from * cols, (size_t)cols * sizeof(float));
            }
}

void gguf_llama3_rope_factors(const ModelConfig* c, float* r) {
    const int half = c->HD / 2;
    const double lf = c->rope_low_freq_factor, hf = c->rope_high_freq_factor;
    const double L0 = c->rope_original_max_pos, factor = c->rope_factor;
    const double lam_lo = L0 / lf, lam_hi = L0 / hf;
    for (int i = 0; i < half; i++) {
        float base = 1.0f / powf((float)c->rope_theta, (float)(2 * i) / (float)c->HD);
        double lam = 2.0 * M_PI / (double)base;
        if (lam < lam_hi)
            r[i] = 1.0f;
        else if (lam > lam_lo)
            r[i] = (float)factor;
        else {
            double smooth = (L0 / lam - lf) / (hf - lf);
            r[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
        }
    }
}

static void shape_text(const int64_t* dims, int n, char* buf, size_t cap) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int k = 0; k < n && o + 24 < cap; k++)
        o += (size_t)snprintf(buf + o, cap - o, k ? ", %lld" : "%lld", (long long)dims[k]);
    snprintf(buf + o, cap - o, "]");
}

// ----------------------------------------------------------------------------
// the MoE expert tensors: our layout <-> llama.cpp's (gguf.h)

int gguf_tensor_parts(const ModelConfig* cfg, const TensorDesc* d, GgufPart parts[2]) {
    const int64_t E = cfg->E, Fe = cfg->F_expert, C = cfg->C;
    int n = 1;
    gguf_tensor_name(cfg->family, d, parts[0].name, sizeof parts[0].name);
    parts[0].ndim = d->ndim;
    for (int k = 0; k < 3; k++) parts[0].shape[k] = k < d->ndim ? d->shape[k] : 0;
    if (d->kind == TK_EXP_GATE_UP || d->kind == TK_EXP_GATE_UP_BIAS) {
        const int bias = d->kind == TK_EXP_GATE_UP_BIAS;
        n = 2;
        snprintf(parts[1].name, sizeof parts[1].name, "blk.%d.ffn_up_exps.%s", d->block,
                 bias ? "bias" : "weight");
        for (int p = 0; p < 2; p++) {
            parts[p].ndim = bias ? 2 : 3;
            parts[p].shape[0] = E;
            parts[p].shape[1] = Fe;
            parts[p].shape[2] = bias ? 0 : C;
        }
    } else if (d->kind == TK_EXP_DOWN) {  // [E, C, Fe] for both families
        parts[0].shape[1] = C;
        parts[0].shape[2] = Fe;
    }
    for (int p = 0; p < n; p++) {
        parts[p].numel = 1;
        for (int k = 0; k < parts[p].ndim; k++) parts[p].numel *= parts[p].shape[k];
    }
    return n;
}

int gguf_parts_rearranged(const ModelConfig* cfg, const TensorDesc* d) {
    return d->kind == TK_EXP_GATE_UP || d->kind == TK_EXP_GATE_UP_BIAS ||
           (d->kind == TK_EXP_DOWN && cfg->family == FAMILY_GPTOSS);
}

// One element: table[ti] <-> packed[pi].
static void move_elem(float* table, float* packed, int64_t ti, int64_t pi, int to_table) {
    if (to_table) table[ti] = packed[pi];
    else packed[pi] = table[ti];
}

void gguf_parts_convert(const ModelConfig* cfg, const TensorDesc* d, float* table, float* packed,
                        int to_table) {
    const int64_t E = cfg->E, Fe = cfg->F_expert, C = cfg->C;
    const int oss = cfg->family == FAMILY_GPTOSS;
    const int64_t half = E * Fe * (d->kind == TK_EXP_GATE_UP ? C : 1);  // the up part's offset
    if (!gguf_parts_rearranged(cfg, d)) {
        if (to_table) memcpy(table, packed, (size_t)d->numel * sizeof(float));
        else memcpy(packed, table, (size_t)d->numel * sizeof(float));
        return;
    }
    for (int64_t e = 0; e < E; e++) {
        if (d->kind == TK_EXP_GATE_UP && !oss) {  // [E, 2Fe, C]: gate rows, then up rows
            for (int64_t r = 0; r < 2 * Fe; r++)
                for (int64_t c = 0; c < C; c++)
                    move_elem(table, packed, (e * 2 * Fe + r) * C + c,
                              (r >= Fe ? half : 0) + (e * Fe + r % Fe) * C + c, to_table);
        } else if (d->kind == TK_EXP_GATE_UP) {  // [E, C, 2Fe]: x·W, gate/up interleaved
            for (int64_t c = 0; c < C; c++)
                for (int64_t j = 0; j < 2 * Fe; j++)
                    move_elem(table, packed, (e * C + c) * 2 * Fe + j,
                              (j & 1 ? half : 0) + (e * Fe + j / 2) * C + c, to_table);
        } else if (d->kind == TK_EXP_GATE_UP_BIAS) {  // [E, 2Fe] interleaved
            for (int64_t j = 0; j < 2 * Fe; j++)
                move_elem(table, packed, e * 2 * Fe + j, (j & 1 ? half : 0) + e * Fe + j / 2,
                          to_table);
        } else {  // GPT-OSS down [E, Fe, C]: x·W, llama.cpp's [E, C, Fe] transposed
            for (int64_t i = 0; i < Fe; i++)
                for (int64_t c = 0; c < C; c++)
                    move_elem(table, packed, (e * Fe + i) * C + c, (e * C + c) * Fe + i, to_table);
        }
    }
}

// ----------------------------------------------------------------------------
// reading a descriptor

const GgufTensor* gguf_part_tensor(const GgufFile* f, const GgufPart* p, const TensorDesc* d,
                                   char* err) {
    const GgufTensor* t = gguf_find_tensor(f, p->name);
    if (!t) {
        errorf(err, "%s: tensor '%s' (HF %s) is missing", f->path, p->name, d->hf_name);
        return NULL;
    }
    // ne is the HF shape reversed; trailing ne of 1 may be dropped by ggml's own writers
    int64_t want[GGUF_MAX_DIMS] = {1, 1, 1, 1};
    for (int k = 0; k < p->ndim && k < GGUF_MAX_DIMS; k++) want[k] = p->shape[p->ndim - 1 - k];
    int ok = p->ndim <= GGUF_MAX_DIMS;
    for (int k = 0; ok && k < GGUF_MAX_DIMS; k++) ok = t->ne[k] == want[k];
    if (!ok) {
        char got[96], need[96];
        shape_text(t->ne, t->n_dims, got, sizeof got);
        shape_text(want, p->ndim, need, sizeof need);
        errorf(err, "%s: tensor '%s' has ne %s, the config needs ne %s (HF %s)", f->path,
               p->name, got, need, d->hf_name);
        return NULL;
    }
    return t;
}

// Part p's tensor into out (p->numel floats), its ne checked against the part's shape reversed.
static int read_part(const GgufFile* f, const GgufPart* p, const TensorDesc* d, float* out,
                     char* err) {
    const GgufTensor* t = gguf_part_tensor(f, p, d, err);
    return t ? gguf_tensor_to_f32(f, t, out, p->numel, err) : -1;
}

int gguf_read_hf_tensor(const GgufFile* f, const ModelConfig* cfg, const TensorDesc* d, float* out,
                        char* err) {
    GgufPart parts[2];
    const int n = gguf_tensor_parts(cfg, d, parts);
    const int permute = cfg->family == FAMILY_LLAMA && (d->kind == TK_WQ || d->kind == TK_WK);
    if (n == 1 && !permute && !gguf_parts_rearranged(cfg, d))
        return read_part(f, parts, d, out, err);
    float* tmp = malloc_check((size_t)d->numel * sizeof(float));
    int rc = read_part(f, &parts[0], d, tmp, err);
    if (rc == 0 && n == 2) rc = read_part(f, &parts[1], d, tmp + parts[0].numel, err);
    // llama.cpp permuted LLaMA's q/k rows for its adjacent-pair RoPE (docs/FORMATS.md §4.4)
    if (rc == 0 && permute)
        gguf_permute_rows(tmp, out, d->kind == TK_WQ ? cfg->H : cfg->KVH, d->shape[0],
                          d->shape[1], 1);
    else if (rc == 0)
        gguf_parts_convert(cfg, d, out, tmp, 1);
    free(tmp);
    return rc;
}

// ----------------------------------------------------------------------------
// the architecture metadata of exports

static void writer_add_arch_u32(GgufWriter* w, const char* arch, const char* suffix, int v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    gguf_writer_add_u32(w, key, (uint32_t)v);
}

static void writer_add_arch_f32(GgufWriter* w, const char* arch, const char* suffix, double v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    gguf_writer_add_f32(w, key, (float)v);
}

void gguf_writer_add_config(GgufWriter* w, const ModelConfig* c) {
    const char* arch = gguf_arch_name(c->family);
    gguf_writer_add_string(w, "general.architecture", arch);
    gguf_writer_add_string(w, "general.name", c->name);
    writer_add_arch_u32(w, arch, "block_count", c->L);
    writer_add_arch_u32(w, arch, "context_length", c->max_pos);
    writer_add_arch_u32(w, arch, "embedding_length", c->C);
    writer_add_arch_u32(w, arch, "feed_forward_length", c->F);
    writer_add_arch_u32(w, arch, "attention.head_count", c->H);
    writer_add_arch_u32(w, arch, "attention.head_count_kv", c->KVH);
    writer_add_arch_u32(w, arch, "attention.key_length", c->HD);
    writer_add_arch_u32(w, arch, "attention.value_length", c->HD);
    writer_add_arch_f32(w, arch, "attention.layer_norm_rms_epsilon", c->norm_eps);
    writer_add_arch_f32(w, arch, "rope.freq_base", c->rope_theta);
    writer_add_arch_u32(w, arch, "rope.dimension_count", c->HD);
    writer_add_arch_u32(w, arch, "vocab_size", c->V);
    if (c->rope_type == ROPE_YARN) {
        char key[128];
        snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
        gguf_writer_add_string(w, key, "yarn");
        writer_add_arch_f32(w, arch, "rope.scaling.factor", c->rope_factor);
        writer_add_arch_u32(w, arch, "rope.scaling.original_context_length",
                            c->rope_original_max_pos);
        writer_add_arch_f32(w, arch, "rope.scaling.yarn_beta_fast", c->yarn_beta_fast);
        writer_add_arch_f32(w, arch, "rope.scaling.yarn_beta_slow", c->yarn_beta_slow);
    }
    if (c->E > 0) {
        writer_add_arch_u32(w, arch, "expert_count", c->E);
        writer_add_arch_u32(w, arch, "expert_used_count", c->K);
        writer_add_arch_u32(w, arch, "expert_feed_forward_length", c->F_expert);
    }
    if (c->sliding_window > 0)
        writer_add_arch_u32(w, arch, "attention.sliding_window", c->sliding_window);
}
