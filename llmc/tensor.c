/*
 * tensor.c — builds the tensor descriptor table of a model and its HF view (see tensor.h for the
 * layout rules), with the LoRA adapters' tensors and their PEFT keys when LoRA is on.
 */
#include "tensor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static const char* const kind_names[TK_COUNT] = {
    "embed",    "attn_norm", "wq",     "wk",          "wv",          "q_norm",
    "k_norm",   "wo",        "mlp_norm", "w_gate",    "w_up",        "w_down",
    "final_norm", "lm_head", "bq",     "bk",          "bv",          "bo",
    "sinks",    "router",    "router_bias", "experts_gate_up", "experts_gate_up_bias",
    "experts_down", "experts_down_bias", "lora_A", "lora_B"};

const char* tensor_kind_name(TensorKind k) { return (k >= 0 && k < TK_COUNT) ? kind_names[k] : "?"; }

typedef struct Builder {
    TensorTable* tt;
    int cap;
    int64_t* param_fill;  // running slab sizes per layer
    int64_t* grad_fill;
} Builder;

static TensorDesc* builder_add(Builder* b, TensorKind kind, int layer, int block, int ndim,
                               int64_t d0, int64_t d1, int64_t d2) {
    TensorTable* tt = b->tt;
    if (tt->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 64;
        tt->t = realloc_check(tt->t, (size_t)b->cap * sizeof(TensorDesc));
    }
    TensorDesc* d = &tt->t[tt->n++];
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->layer = layer;
    d->block = block;
    d->owner_layer = layer;
    d->ndim = ndim;
    d->shape[0] = d0;
    d->shape[1] = ndim > 1 ? d1 : 0;
    d->shape[2] = ndim > 2 ? d2 : 0;
    d->numel = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    d->tied_to = -1;
    d->trainable = 1;
    d->lora_target = -1;
    d->param_offset = b->param_fill[layer];
    d->state_offset = d->param_offset;
    b->param_fill[layer] += d->numel;
    d->grad_offset = b->grad_fill[layer];
    b->grad_fill[layer] += d->numel;
    return d;
}

static void set_names(TensorDesc* d, const char* ours, const char* hf, const char* gguf) {
    str_copy(d->name, sizeof d->name, ours);
    str_copy(d->hf_name, sizeof d->hf_name, hf);
    str_copy(d->gguf_name, sizeof d->gguf_name, gguf);
}

// One tensor of a block: kind, shape, HF and GGUF suffixes (after "model.layers.N." and
// "blk.N."), whether it is present, whether weight decay applies (matrices only).
typedef struct BlockSpec {
    TensorKind kind;
    int ndim;
    int64_t d0, d1, d2;
    const char* hf;
    const char* gguf;
    int present;
    int decay;
} BlockSpec;

// The tensors of decoder block l, in slab order (tensor.h).
static int block_specs(const ModelConfig* c, int l, BlockSpec* out) {
    const int64_t C = c->C, F = c->F, HD = c->HD, E = c->E, Fe = c->F_expert;
    const int64_t QD = (int64_t)c->H * HD, KVD = (int64_t)c->KVH * HD;
    const int oss = c->family == FAMILY_GPTOSS, moe = config_block_is_moe(c, l);
    const int bias = c->attention_bias;
    const BlockSpec spec[] = {
        {TK_ATTN_NORM, 1, C, 0, 0, "input_layernorm.weight", "attn_norm.weight", 1, 0},
        {TK_WQ, 2, QD, C, 0, "self_attn.q_proj.weight", "attn_q.weight", 1, 1},
        {TK_WK, 2, KVD, C, 0, "self_attn.k_proj.weight", "attn_k.weight", 1, 1},
        {TK_WV, 2, KVD, C, 0, "self_attn.v_proj.weight", "attn_v.weight", 1, 1},
        {TK_BQ, 1, QD, 0, 0, "self_attn.q_proj.bias", "attn_q.bias", bias, 0},
        {TK_BK, 1, KVD, 0, 0, "self_attn.k_proj.bias", "attn_k.bias", bias, 0},
        {TK_BV, 1, KVD, 0, 0, "self_attn.v_proj.bias", "attn_v.bias", bias, 0},
        {TK_Q_NORM, 1, HD, 0, 0, "self_attn.q_norm.weight", "attn_q_norm.weight", c->qk_norm, 0},
        {TK_K_NORM, 1, HD, 0, 0, "self_attn.k_norm.weight", "attn_k_norm.weight", c->qk_norm, 0},
        {TK_WO, 2, C, QD, 0, "self_attn.o_proj.weight", "attn_output.weight", 1, 1},
        {TK_BO, 1, C, 0, 0, "self_attn.o_proj.bias", "attn_output.bias", bias, 0},
        {TK_SINKS, 1, c->H, 0, 0, "self_attn.sinks", "attn_sinks.weight", oss, 0},
        {TK_MLP_NORM, 1, C, 0, 0, "post_attention_layernorm.weight",
         oss ? "post_attention_norm.weight" : "ffn_norm.weight", 1, 0},
        {TK_W_GATE, 2, F, C, 0, "mlp.gate_proj.weight", "ffn_gate.weight", !moe, 1},
        {TK_W_UP, 2, F, C, 0, "mlp.up_proj.weight", "ffn_up.weight", !moe, 1},
        {TK_W_DOWN, 2, C, F, 0, "mlp.down_proj.weight", "ffn_down.weight", !moe, 1},
        {TK_ROUTER, 2, E, C, 0, oss ? "mlp.router.weight" : "mlp.gate.weight",
         "ffn_gate_inp.weight", moe, 1},
        {TK_ROUTER_BIAS, 1, E, 0, 0, "mlp.router.bias", "ffn_gate_inp.bias", moe && oss, 0},
        {TK_EXP_GATE_UP, 3, E, oss ? C : 2 * Fe, oss ? 2 * Fe : C, "mlp.experts.gate_up_proj",
         "ffn_gate_exps.weight", moe, 1},
        {TK_EXP_GATE_UP_BIAS, 2, E, 2 * Fe, 0, "mlp.experts.gate_up_proj_bias",
         "ffn_gate_exps.bias", moe && oss, 0},
        {TK_EXP_DOWN, 3, E, oss ? Fe : C, oss ? C : Fe, "mlp.experts.down_proj",
         "ffn_down_exps.weight", moe, 1},
        {TK_EXP_DOWN_BIAS, 2, E, C, 0, "mlp.experts.down_proj_bias", "ffn_down_exps.bias",
         moe && oss, 0},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++)
        if (spec[i].present) out[n++] = spec[i];
    return n;
}

static void hf_add(TensorTable* tt, int* cap, const char* name, int ndim, int64_t d0, int64_t d1,
                   int64_t d2, int index, int64_t offset) {
    if (tt->n_hf == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        tt->hf = realloc_check(tt->hf, (size_t)*cap * sizeof(HfTensor));
    }
    HfTensor* h = &tt->hf[tt->n_hf++];
    memset(h, 0, sizeof *h);
    str_copy(h->name, sizeof h->name, name);
    h->ndim = ndim;
    h->shape[0] = d0;
    h->shape[1] = ndim > 1 ? d1 : 0;
    h->shape[2] = ndim > 2 ? d2 : 0;
    h->numel = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    h->index = index;
    h->offset = offset;
}

static uint64_t name_hash(const char* s) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

// The HF view (tensor.h) in checkpoint order: every owned tensor in table order, except that the
// hub Qwen3-MoE layout lists expert e's gate_proj, up_proj, down_proj in place of the fused pair.
static void build_hf_view(TensorTable* tt, const ModelConfig* c) {
    int cap = 0;
    const int per_expert = c->family == FAMILY_QWEN3MOE && c->expert_layout == EXPERTS_PER_EXPERT;
    for (int i = 0; i < tt->n; i++) {
        const TensorDesc* d = &tt->t[i];
        if (d->tied_to >= 0 || d->lora_target >= 0) continue;  // adapters: the PEFT files
        if (per_expert && d->kind == TK_EXP_DOWN) continue;  // listed with the gate/up slices
        if (!(per_expert && d->kind == TK_EXP_GATE_UP)) {
            hf_add(tt, &cap, d->hf_name, d->ndim, d->shape[0], d->shape[1], d->shape[2], i, 0);
            continue;
        }
        const int down = tensor_table_index(tt, TK_EXP_DOWN, d->block);
        const int64_t C = c->C, Fe = c->F_expert;
        char name[96];
        for (int e = 0; e < c->E; e++) {
            const char* which[3] = {"gate", "up", "down"};
            for (int k = 0; k < 3; k++) {
                snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight",
                         d->block, e, which[k]);
                if (k < 2)
                    hf_add(tt, &cap, name, 2, Fe, C, 0, i, ((int64_t)e * 2 + k) * Fe * C);
                else
                    hf_add(tt, &cap, name, 2, C, Fe, 0, down, (int64_t)e * C * Fe);
            }
        }
    }
    tt->hf_hash_cap = 16;
    while (tt->hf_hash_cap < 2 * tt->n_hf) tt->hf_hash_cap *= 2;
    tt->hf_hash = malloc_check((size_t)tt->hf_hash_cap * sizeof(int));
    for (int k = 0; k < tt->hf_hash_cap; k++) tt->hf_hash[k] = -1;
    for (int j = 0; j < tt->n_hf; j++) {
        uint64_t h = name_hash(tt->hf[j].name) & (uint64_t)(tt->hf_hash_cap - 1);
        while (tt->hf_hash[h] >= 0) h = (h + 1) & (uint64_t)(tt->hf_hash_cap - 1);
        tt->hf_hash[h] = j;
    }
}

// ----------------------------------------------------------------------------
// LoRA targets

// PEFT's names: target_modules for the linears, target_parameters for the experts.
static const char* const lora_names[LORA_N_TARGETS] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate",
    "gate_up_proj", "down_proj"};

const char* lora_target_name(LoraTarget target) {
    return target >= 0 && target < LORA_N_TARGETS ? lora_names[target] : "?";
}

const char* lora_target_parent(LoraTarget target) {
    return target <= LORA_O ? "self_attn" : "mlp";
}

void lora_target_dims(const ModelConfig* c, LoraTarget target, int64_t* in, int64_t* out) {
    const int64_t C = c->C, F = c->F, QD = (int64_t)c->H * c->HD, KVD = (int64_t)c->KVH * c->HD;
    const int64_t Fe = c->F_expert;
    const int64_t ins[LORA_N_TARGETS] = {C, C, C, QD, C, C, F, C, C, Fe};
    const int64_t outs[LORA_N_TARGETS] = {QD, KVD, KVD, C, F, F, C, c->E, 2 * Fe, C};
    *in = ins[target];
    *out = outs[target];
}

int lora_target_is_expert(LoraTarget target) {
    return target == LORA_EXP_GATE_UP || target == LORA_EXP_DOWN;
}

// PEFT 0.21 on transformers 5 (peft/utils/transformers_weight_conversion.py,
// _convert_peft_config_moe): Qwen3-MoE is a "qwen2_moe" conversion model, so target_modules
// gate_proj + up_proj (and "all-linear", which names them) become target_parameters gate_up_proj
// with rank_pattern {".*\.gate_up_proj": 2r} and alpha_pattern {".*\.gate_up_proj": 2·alpha};
// GPT-OSS has no conversion: gate_up_proj at r, as target_parameters give it.
// --lora-gate-up-rank overrides (PEFT's target_parameters with a rank_pattern).
int lora_target_rank(const ModelConfig* c, const LoraSpec* l, LoraTarget target) {
    if (target != LORA_EXP_GATE_UP) return l->r;
    if (l->gate_up_r > 0) return l->gate_up_r;
    return c->family == FAMILY_QWEN3MOE ? 2 * l->r : l->r;
}

float lora_target_alpha(const ModelConfig* c, const LoraSpec* l, LoraTarget target) {
    const int rank = lora_target_rank(c, l, target);
    return rank == l->r ? l->alpha : (float)((double)l->alpha * rank / l->r);
}

// Whether block l has the linear tg adapts (MoE blocks: no dense MLP; dense blocks: no router).
int lora_block_has_target(const ModelConfig* c, int l, int tg) {
    const int moe = config_block_is_moe(c, l);
    if (tg == LORA_ROUTER || lora_target_is_expert((LoraTarget)tg)) return moe;
    if (tg >= LORA_GATE) return !moe;
    return 1;
}

// The family's rule: all-linear as PEFT means it there; router / experts where they are no
// nn.Linear, or not adapted yet, refused.
static int family_targets(const ModelConfig* c, unsigned targets, unsigned* out, char* err) {
    const unsigned moe_bits = LORA_BIT(LORA_ROUTER) | LORA_EXPERTS_BIT;
    const int all = targets == LORA_ALL_LINEAR;
    *out = targets;
    if (!config_is_moe(c)) {
        if (all) *out &= ~moe_bits;
        else if (targets & moe_bits)
            return errorf(err, "LoRA: router and experts are modules of mixture-of-experts blocks; "
                               "family %s has none", family_names[c->family]);
        return 0;
    }
    if (c->family == FAMILY_QWEN3MOE && all) {
        // PEFT 0.21 on transformers 5 resolves all-linear on Qwen3-MoE to the attention's
        // linears plus the v4 names gate, gate_proj, up_proj, down_proj, which its conversion
        // (_convert_peft_config_moe) turns into target_parameters gate.weight, gate_up_proj,
        // down_proj and drops from target_modules: the experts and the router are adapted, a
        // dense block's MLP (mlp_only_layers) is not
        *out &= ~(LORA_BIT(LORA_GATE) | LORA_BIT(LORA_UP) | LORA_BIT(LORA_DOWN));
    }
    if (c->family == FAMILY_GPTOSS) {
        // GptOssTopKRouter and the fused expert parameters are no nn.Linear and GPT-OSS has no
        // v4 -> v5 conversion: PEFT's all-linear leaves them out. The experts take adapters when
        // named (target_parameters gate_up_proj, down_proj); the router (weight and bias of a
        // custom module) is not supported.
        if (all) *out &= ~moe_bits;
        else if (targets & LORA_BIT(LORA_ROUTER))
            return errorf(err, "LoRA on gpt-oss: its router is not an nn.Linear module (PEFT "
                               "adapts it only through target_parameters), so LoRA takes its "
                               "attention (q, k, v, o) and experts only");
    }
    return 0;
}

// The targets narrowed to the linears some block of the model has (an MoE model without a dense
// block has no gate_proj / up_proj / down_proj), so the PEFT config names only modules it adapts.
static unsigned targets_present(const ModelConfig* c, unsigned targets) {
    unsigned have = 0;
    for (int l = 0; l < c->L; l++)
        for (int tg = 0; tg < LORA_N_TARGETS; tg++)
            if (lora_block_has_target(c, l, tg)) have |= LORA_BIT(tg);
    return targets & have;
}

int lora_targets_for_model(const ModelConfig* c, unsigned targets, unsigned* out, char* err) {
    if (family_targets(c, targets, out, err) != 0) return -1;
    *out = targets_present(c, *out);
    return 0;
}

// The PEFT key's module path of an adapter in block l: the linear's, or for the experts the
// ParamWrapper's. PEFT wraps the experts module once per targeted parameter, in the module's
// parameter order (gate_up_proj, then down_proj; tuners_utils.py _inject_parameters), each wrapper
// around the previous: down_proj's is the outer one (mlp.experts), gate_up_proj's the inner one
// (mlp.experts.base_layer), as transformers_weight_conversion.py's build_peft_weight_mapping names
// them.
static void lora_module_path(char* buf, size_t cap, int l, LoraTarget tg) {
    if (tg == LORA_EXP_GATE_UP)
        snprintf(buf, cap, "model.layers.%d.mlp.experts.base_layer", l);
    else if (tg == LORA_EXP_DOWN)
        snprintf(buf, cap, "model.layers.%d.mlp.experts", l);
    else
        snprintf(buf, cap, "model.layers.%d.%s.%s", l, lora_target_parent(tg), lora_names[tg]);
}

// An adapter's place in its block's slabs (parameters, gradients, AdamW state): every A (pass 0,
// in target order), then every B (pass 1). The table keeps A, B per target (its order names the
// init's generators and the optimizer's chunks, unchanged); the slabs put the A's of q, k, v (and
// gate, up) next to each other, so the adapters of linears that share their input run as one
// (3r, C) product and their gradients accumulate into one (3r, C) block (lora.c).
static int lora_slab_pass(const TensorDesc* d) { return d->kind == TK_LORA_B; }

// Block l's adapters, A then B per target in target order in the table, after the block's own
// tensors. The expert adapters are 3-D, (E, rank, in) and (E, out, rank) (tensor.h). In the slab
// (lora_slab_order) the A's come first, then the B's.
static void add_lora_tensors(Builder* b, const ModelConfig* c, const LoraSpec* lora, int l) {
    const int first = b->tt->n;
    const int64_t start = b->param_fill[l + 1];
    for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
        if (!(lora->targets & LORA_BIT(tg)) || !lora_block_has_target(c, l, tg)) continue;
        int64_t in, out;
        lora_target_dims(c, (LoraTarget)tg, &in, &out);
        const int r = lora_target_rank(c, lora, (LoraTarget)tg);
        const int expert = lora_target_is_expert((LoraTarget)tg);
        for (int k = 0; k < 2; k++) {
            const int64_t d0 = k ? out : r, d1 = k ? r : in;
            TensorDesc* d = expert ? builder_add(b, k ? TK_LORA_B : TK_LORA_A, l + 1, l, 3, c->E,
                                                 d0, d1)
                                   : builder_add(b, k ? TK_LORA_B : TK_LORA_A, l + 1, l, 2, d0,
                                                 d1, 0);
            char ours[64], path[80], peft[128];
            snprintf(ours, sizeof ours, "layers.%d.%s%s.lora_%c", l, expert ? "experts." : "",
                     lora_names[tg], k ? 'B' : 'A');
            lora_module_path(path, sizeof path, l, (LoraTarget)tg);
            snprintf(peft, sizeof peft, "base_model.model.%s.lora_%c.weight", path,
                     k ? 'B' : 'A');
            set_names(d, ours, peft, "");
            d->lora_target = tg;
            d->decay = 1;  // as every matrix: AdamW's weight decay applies to the adapters
        }
    }
    int64_t fill = start;
    for (int pass = 0; pass < 2; pass++)
        for (int i = first; i < b->tt->n; i++) {
            TensorDesc* d = &b->tt->t[i];
            if (lora_slab_pass(d) != pass) continue;
            d->param_offset = d->state_offset = fill;
            fill += d->numel;
        }
}

// With adapters only they train: gradient slots and AdamW state for them alone, in the slab's
// order (each block's A's, then its B's: lora_slab_pass).
static void freeze_base(TensorTable* tt, int64_t* grad_fill, int64_t* state_fill) {
    for (int l = 0; l < tt->n_layers; l++) grad_fill[l] = state_fill[l] = 0;
    for (int i = 0; i < tt->n; i++) {
        TensorDesc* d = &tt->t[i];
        d->trainable = d->lora_target >= 0;
        d->grad_offset = d->state_offset = -1;
    }
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < tt->n; i++) {
            TensorDesc* d = &tt->t[i];
            if (!d->trainable || lora_slab_pass(d) != pass) continue;
            d->grad_offset = grad_fill[d->layer];
            grad_fill[d->layer] += d->numel;
            d->state_offset = state_fill[d->owner_layer];
            state_fill[d->owner_layer] += d->numel;
        }
}

int tensor_table_build(TensorTable* tt, const ModelConfig* c, int decay_embeddings, char* err) {
    return tensor_table_build_lora(tt, c, decay_embeddings, NULL, err);
}

int tensor_table_build_lora(TensorTable* tt, const ModelConfig* c, int decay_embeddings,
                            const LoraSpec* lora, char* err) {
    memset(tt, 0, sizeof *tt);
    if (c->family < 0 || c->family >= FAMILY_COUNT)
        return errorf(err, "tensor table: unknown model family");
    const int use_lora = lora && lora->r > 0;
    // the targets this model has (MoE blocks: no dense MLP, the router; dense blocks: no router)
    LoraSpec spec_model = {0};
    if (use_lora) {
        spec_model = *lora;
        if (lora_targets_for_model(c, lora->targets, &spec_model.targets, err) != 0) return -1;
        if (spec_model.targets == 0)
            return errorf(err, "LoRA: no target module (this model has none of them)");
        // PEFT's ParamWrapper refuses lora_dropout (lora/layer.py: the delta is added to the
        // weight, so x cannot be dropped on the branch alone): no reference, and an export PEFT
        // could not load
        if ((spec_model.targets & LORA_EXPERTS_BIT) && lora->dropout > 0)
            return errorf(err, "LoRA dropout on the experts: PEFT adapts them through "
                               "target_parameters, which does not work with lora_dropout != 0 "
                               "(drop the experts from --lora-targets or the dropout)");
        lora = &spec_model;
        tt->lora = spec_model;
    }
    const int L = c->L;
    tt->n_layers = L + 2;
    Builder b = {.tt = tt};
    b.param_fill = calloc_check((size_t)tt->n_layers, sizeof(int64_t));
    b.grad_fill = calloc_check((size_t)tt->n_layers, sizeof(int64_t));
    const int64_t V = c->V, C = c->C;
    char ours[64], hf[96], gg[64];

    // prefix
    TensorDesc* d = builder_add(&b, TK_EMBED, 0, -1, 2, V, C, 0);
    set_names(d, "embed", "model.embed_tokens.weight", "token_embd.weight");
    d->decay = decay_embeddings;
    const int embed_index = 0;

    // blocks: the spec order is the slab order, q/k/v adjacent (one fused QKV matmul) and
    // gate/up adjacent (one fused gate-up matmul)
    BlockSpec spec[32];
    for (int l = 0; l < L; l++) {
        const int layer = l + 1;
        const int n = block_specs(c, l, spec);
        for (int i = 0; i < n; i++) {
            d = builder_add(&b, spec[i].kind, layer, l, spec[i].ndim, spec[i].d0, spec[i].d1,
                            spec[i].d2);
            snprintf(ours, sizeof ours, "layers.%d.%s", l, kind_names[spec[i].kind]);
            snprintf(hf, sizeof hf, "model.layers.%d.%s", l, spec[i].hf);
            snprintf(gg, sizeof gg, "blk.%d.%s", l, spec[i].gguf);
            set_names(d, ours, hf, gg);
            d->decay = spec[i].decay;  // matrices only: never norms, biases or sinks
        }
        if (use_lora) add_lora_tensors(&b, c, lora, l);
    }

    // postfix
    d = builder_add(&b, TK_FINAL_NORM, L + 1, -1, 1, C, 0, 0);
    set_names(d, "final_norm", "model.norm.weight", "output_norm.weight");
    d = builder_add(&b, TK_LM_HEAD, L + 1, -1, 2, V, C, 0);
    set_names(d, "lm_head", "lm_head.weight", "output.weight");
    d->decay = 1;
    if (c->tied_embeddings) {
        // Storage and optimizer state live with the embedding (layer 0); the postfix keeps a
        // gradient slot for the head's contribution, summed into the embedding's before the step.
        b.param_fill[L + 1] -= d->numel;
        d->param_offset = tt->t[embed_index].param_offset;
        d->owner_layer = 0;
        d->tied_to = embed_index;
        d->state_offset = tt->t[embed_index].state_offset;
        d->decay = tt->t[embed_index].decay;
        str_copy(d->hf_name, sizeof d->hf_name, "model.embed_tokens.weight");
        str_copy(d->gguf_name, sizeof d->gguf_name, "token_embd.weight");
    }

    tt->param_numel = b.param_fill;
    tt->grad_numel = b.grad_fill;
    tt->state_numel = calloc_check((size_t)tt->n_layers, sizeof(int64_t));
    if (use_lora)
        freeze_base(tt, tt->grad_numel, tt->state_numel);
    else
        memcpy(tt->state_numel, tt->param_numel, (size_t)tt->n_layers * sizeof(int64_t));
    tt->first = calloc_check((size_t)tt->n_layers, sizeof(int));
    tt->count = calloc_check((size_t)tt->n_layers, sizeof(int));
    for (int i = tt->n - 1; i >= 0; i--) tt->first[tt->t[i].layer] = i;
    for (int i = 0; i < tt->n; i++) tt->count[tt->t[i].layer]++;
    tt->total_params = 0;
    for (int i = 0; i < tt->n; i++) {
        if (tt->t[i].tied_to >= 0) continue;
        tt->total_params += tt->t[i].numel;
        if (tt->t[i].trainable) tt->trainable_params += tt->t[i].numel;
    }
    build_hf_view(tt, c);
    return 0;
}

void tensor_table_free(TensorTable* tt) {
    free(tt->t);
    free(tt->param_numel);
    free(tt->grad_numel);
    free(tt->state_numel);
    free(tt->first);
    free(tt->count);
    free(tt->hf);
    free(tt->hf_hash);
    memset(tt, 0, sizeof *tt);
}

int tensor_table_find_hf_tensor(const TensorTable* tt, const char* name) {
    if (tt->hf_hash_cap <= 0) return -1;
    uint64_t h = name_hash(name) & (uint64_t)(tt->hf_hash_cap - 1);
    while (tt->hf_hash[h] >= 0) {
        if (strcmp(tt->hf[tt->hf_hash[h]].name, name) == 0) return tt->hf_hash[h];
        h = (h + 1) & (uint64_t)(tt->hf_hash_cap - 1);
    }
    return -1;
}

int tensor_table_find_hf(const TensorTable* tt, const char* hf_name) {
    for (int i = 0; i < tt->n; i++)
        if (tt->t[i].tied_to < 0 && strcmp(tt->t[i].hf_name, hf_name) == 0) return i;
    return -1;
}

int tensor_table_find(const TensorTable* tt, const char* name) {
    for (int i = 0; i < tt->n; i++)
        if (strcmp(tt->t[i].name, name) == 0) return i;
    return -1;
}

int tensor_table_lora_index(const TensorTable* tt, int block, LoraTarget target, int b) {
    const int layer = block + 1;
    if (tt->lora.r <= 0 || block < 0 || layer >= tt->n_layers - 1) return -1;
    const TensorKind kind = b ? TK_LORA_B : TK_LORA_A;
    for (int i = tt->first[layer]; i < tt->first[layer] + tt->count[layer]; i++)
        if (tt->t[i].kind == kind && tt->t[i].lora_target == (int)target) return i;
    return -1;
}

int tensor_table_index(const TensorTable* tt, TensorKind kind, int block) {
    if (block >= 0) {
        int layer = block + 1;
        if (layer >= tt->n_layers - 1) return -1;
        for (int i = tt->first[layer]; i < tt->first[layer] + tt->count[layer]; i++)
            if (tt->t[i].kind == kind) return i;
        return -1;
    }
    for (int i = 0; i < tt->n; i++)
        if (tt->t[i].kind == kind && tt->t[i].block < 0) return i;
    return -1;
}
