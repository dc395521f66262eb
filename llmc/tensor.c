/*
 * tensor.c — builds the tensor descriptor table of a model (see tensor.h for the layout rules).
 */
#include "tensor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static const char* const kind_names[TK_COUNT] = {
    "embed", "attn_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo",
    "mlp_norm", "w_gate", "w_up", "w_down", "final_norm", "lm_head"};

const char* tensor_kind_name(TensorKind k) { return (k >= 0 && k < TK_COUNT) ? kind_names[k] : "?"; }

typedef struct Builder {
    TensorTable* tt;
    int cap;
    int64_t* param_fill;  // running slab sizes per layer
    int64_t* grad_fill;
} Builder;

static TensorDesc* builder_add(Builder* b, TensorKind kind, int layer, int block, int ndim,
                               int64_t d0, int64_t d1) {
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
    d->numel = ndim > 1 ? d0 * d1 : d0;
    d->tied_to = -1;
    d->param_offset = b->param_fill[layer];
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

int tensor_table_build(TensorTable* tt, const ModelConfig* c, int decay_embeddings, char* err) {
    memset(tt, 0, sizeof *tt);
    if (c->family != FAMILY_LLAMA && c->family != FAMILY_QWEN3)
        return errorf(err, "tensor table: family %s is not supported yet", family_names[c->family]);
    const int L = c->L;
    tt->n_layers = L + 2;
    Builder b = {.tt = tt};
    b.param_fill = calloc_check((size_t)tt->n_layers, sizeof(int64_t));
    b.grad_fill = calloc_check((size_t)tt->n_layers, sizeof(int64_t));
    const int64_t V = c->V, C = c->C, F = c->F, HD = c->HD;
    const int64_t QD = (int64_t)c->H * HD, KVD = (int64_t)c->KVH * HD;
    char ours[64], hf[96], gg[64];

    // prefix
    TensorDesc* d = builder_add(&b, TK_EMBED, 0, -1, 2, V, C);
    set_names(d, "embed", "model.embed_tokens.weight", "token_embd.weight");
    d->decay = decay_embeddings;
    const int embed_index = 0;

    // blocks: the spec order is the slab order, q/k/v adjacent (one fused QKV matmul) and
    // gate/up adjacent (one fused gate-up matmul)
    for (int l = 0; l < L; l++) {
        const int layer = l + 1;
        struct {
            TensorKind kind;
            int ndim;
            int64_t d0, d1;
            const char* hf;
            const char* gguf;
        } spec[] = {
            {TK_ATTN_NORM, 1, C, 0, "input_layernorm.weight", "attn_norm.weight"},
            {TK_WQ, 2, QD, C, "self_attn.q_proj.weight", "attn_q.weight"},
            {TK_WK, 2, KVD, C, "self_attn.k_proj.weight", "attn_k.weight"},
            {TK_WV, 2, KVD, C, "self_attn.v_proj.weight", "attn_v.weight"},
            {TK_Q_NORM, 1, HD, 0, "self_attn.q_norm.weight", "attn_q_norm.weight"},
            {TK_K_NORM, 1, HD, 0, "self_attn.k_norm.weight", "attn_k_norm.weight"},
            {TK_WO, 2, C, QD, "self_attn.o_proj.weight", "attn_output.weight"},
            {TK_MLP_NORM, 1, C, 0, "post_attention_layernorm.weight", "ffn_norm.weight"},
            {TK_W_GATE, 2, F, C, "mlp.gate_proj.weight", "ffn_gate.weight"},
            {TK_W_UP, 2, F, C, "mlp.up_proj.weight", "ffn_up.weight"},
            {TK_W_DOWN, 2, C, F, "mlp.down_proj.weight", "ffn_down.weight"},
        };
        for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
            if ((spec[i].kind == TK_Q_NORM || spec[i].kind == TK_K_NORM) && !c->qk_norm) continue;
            d = builder_add(&b, spec[i].kind, layer, l, spec[i].ndim, spec[i].d0, spec[i].d1);
            snprintf(ours, sizeof ours, "layers.%d.%s", l, kind_names[spec[i].kind]);
            snprintf(hf, sizeof hf, "model.layers.%d.%s", l, spec[i].hf);
            snprintf(gg, sizeof gg, "blk.%d.%s", l, spec[i].gguf);
            set_names(d, ours, hf, gg);
            d->decay = spec[i].ndim >= 2;  // matrices only: never norms
        }
    }

    // postfix
    d = builder_add(&b, TK_FINAL_NORM, L + 1, -1, 1, C, 0);
    set_names(d, "final_norm", "model.norm.weight", "output_norm.weight");
    d = builder_add(&b, TK_LM_HEAD, L + 1, -1, 2, V, C);
    set_names(d, "lm_head", "lm_head.weight", "output.weight");
    d->decay = 1;
    if (c->tied_embeddings) {
        // Storage and optimizer state live with the embedding (layer 0); the postfix keeps a
        // gradient slot for the head's contribution, summed into the embedding's before the step.
        b.param_fill[L + 1] -= d->numel;
        d->param_offset = tt->t[embed_index].param_offset;
        d->owner_layer = 0;
        d->tied_to = embed_index;
        d->decay = tt->t[embed_index].decay;
        str_copy(d->hf_name, sizeof d->hf_name, "model.embed_tokens.weight");
        str_copy(d->gguf_name, sizeof d->gguf_name, "token_embd.weight");
    }

    tt->param_numel = b.param_fill;
    tt->grad_numel = b.grad_fill;
    tt->first = calloc_check((size_t)tt->n_layers, sizeof(int));
    tt->count = calloc_check((size_t)tt->n_layers, sizeof(int));
    for (int i = tt->n - 1; i >= 0; i--) tt->first[tt->t[i].layer] = i;
    for (int i = 0; i < tt->n; i++) tt->count[tt->t[i].layer]++;
    tt->total_params = 0;
    for (int i = 0; i < tt->n; i++)
        if (tt->t[i].tied_to < 0) tt->total_params += tt->t[i].numel;
    return 0;
}

void tensor_table_free(TensorTable* tt) {
    free(tt->t);
    free(tt->param_numel);
    free(tt->grad_numel);
    free(tt->first);
    free(tt->count);
    memset(tt, 0, sizeof *tt);
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
