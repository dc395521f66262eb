/*
 * plain.c — plain training step: prefix, blocks, fused postfix, backward deepest first.
 */
#include "plain.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"

// Keeping every block's activations is the fast path; past 8 GiB of them the backward
// recomputes each block from its input instead (one activation set).
#define PLAIN_KEEP_ACTS_MAX (8ull << 30)

int plain_needs_recompute(const Model* m, int act_bytes, int B, int T) {
    return workspace_bytes(m, act_bytes, B, T, m->cfg.L) > PLAIN_KEEP_ACTS_MAX;
}

size_t plain_bytes(const Model* m, int act_bytes, int aliased, int B, int T, int recompute) {
    const TensorTable* tt = &m->tt;
    const size_t N = (size_t)B * T, ab = (size_t)act_bytes;
    // what plain_create allocates, in its order: the workspace, the device slabs (none when
    // aliased), the residual streams x[0..L] and their gradient, ids, targets, losses (device
    // and host)
    size_t bytes = workspace_bytes(m, act_bytes, B, T, recompute ? 1 : m->cfg.L);
    for (int l = 0; l < tt->n_layers && !aliased; l++)
        bytes += (size_t)tt->param_numel[l] * ab + (size_t)tt->grad_numel[l] * sizeof(float);
    bytes += ((size_t)m->cfg.L + 2) * N * (size_t)m->cfg.C * ab;
    bytes += 2 * N * (2 * sizeof(int32_t) + sizeof(float));
    return bytes;
}

Plain* plain_create(const Model* m, Store* s, const Ops* ops, void* ctx, int B, int T,
                    int recompute) {
    Plain* p = calloc_check(1, sizeof(Plain));
    const ModelConfig* c = &m->cfg;
    const TensorTable* tt = &m->tt;
    const size_t N = (size_t)B * T, ab = (size_t)ops->act_bytes;
    p->m = m;
    p->s = s;
    p->ops = ops;
    p->ctx = ctx;
    p->B = B;
    p->T = T;
    p->recompute = recompute;
    p->ws = workspace_create(m, ops, ctx, B, T, recompute ? 1 : c->L);
    // fp32 backends compute straight on the store's slabs
    p->aliased = ops->act_bytes == 4 && strcmp(ops->name, "cpu") == 0;
    p->dparam = calloc_check((size_t)tt->n_layers, sizeof(void*));
    p->dgrad = calloc_check((size_t)tt->n_layers, sizeof(float*));
    for (int l = 0; l < tt->n_layers; l++) {
        if (p->aliased) {
            p->dparam[l] = s->param[l];
            p->dgrad[l] = s->grad[l];
        } else {
            if (tt->param_numel[l] > 0) p->dparam[l] = ops->alloc(ctx, tt->param_numel[l] * ab);
            if (tt->grad_numel[l] > 0)
                p->dgrad[l] = ops->alloc(ctx, tt->grad_numel[l] * sizeof(float));
        }
    }
    p->x = calloc_check((size_t)c->L + 1, sizeof(void*));
    for (int l = 0; l <= c->L; l++) p->x[l] = ops->alloc(ctx, N * c->C * ab);
    p->dres = ops->alloc(ctx, N * c->C * ab);
    p->ids = ops->alloc(ctx, N * sizeof(int32_t));
    p->targets = ops->alloc(ctx, N * sizeof(int32_t));
    p->losses = ops->alloc(ctx, N * sizeof(float));
    p->ids_host = malloc_check(N * sizeof(int32_t));
    p->targets_host = malloc_check(N * sizeof(int32_t));
    p->losses_host = malloc_check(N * sizeof(float));
    plain_sync_params(p);
    return p;
}

void plain_free(Plain* p) {
    if (!p) return;
    const Ops* ops = p->ops;
    const TensorTable* tt = &p->m->tt;
    if (!p->aliased) {
        for (int l = 0; l < tt->n_layers; l++) {
            if (p->dparam[l]) ops->free(p->ctx, p->dparam[l]);
            if (p->dgrad[l]) ops->free(p->ctx, p->dgrad[l]);
        }
    }
    for (int l = 0; l <= p->m->cfg.L; l++) ops->free(p->ctx, p->x[l]);
    ops->free(p->ctx, p->dres);
    ops->free(p->ctx, p->ids);
    ops->free(p->ctx, p->targets);
    ops->free(p->ctx, p->losses);
    workspace_free(p->ws);
    free(p->dparam);
    free(p->dgrad);
    free(p->x);
    free(p->ids_host);
    free(p->targets_host);
    free(p->losses_host);
    free(p);
}

void plain_sync_params(Plain* p) {
    if (p->aliased) return;
    const TensorTable* tt = &p->m->tt;
    for (int l = 0; l < tt->n_layers; l++)
        if (p->dparam[l]) p->ops->upload_f32(p->ctx, p->dparam[l], p->s->param[l], tt->param_numel[l]);
}

void plain_sync_grads(Plain* p) {
    if (p->aliased) return;
    const TensorTable* tt = &p->m->tt;
    for (int l = 0; l < tt->n_layers; l++) {
        if (!p->dgrad[l]) continue;
        size_t n = (size_t)tt->grad_numel[l];
        float* tmp = malloc_check(n * sizeof(float));
        p->ops->download(p->ctx, tmp, p->dgrad[l], n * sizeof(float));
        for (size_t i = 0; i < n; i++) p->s->grad[l][i] += tmp[i];
        free(tmp);
        p->ops->zero(p->ctx, p->dgrad[l], n * sizeof(float));
    }
}

// ----------------------------------------------------------------------------
// micro-batch

// Split (B, T+1) windows into inputs and targets and upload them.
static void upload_batch(Plain* p, const int32_t* tokens, int B, int T) {
    if (B > p->B || T > p->T || B <= 0 || T <= 0)
        fatal("internal: micro-batch %dx%d exceeds the workspace %dx%d", B, T, p->B, p->T);
    for (int b = 0; b < B; b++) {
        memcpy(p->ids_host + (size_t)b * T, tokens + (size_t)b * (T + 1), (size_t)T * sizeof(int32_t));
        memcpy(p->targets_host + (size_t)b * T, tokens + (size_t)b * (T + 1) + 1,
               (size_t)T * sizeof(int32_t));
    }
    const size_t N = (size_t)B * T;
    p->ops->upload(p->ctx, p->ids, p->ids_host, N * sizeof(int32_t));
    p->ops->upload(p->ctx, p->targets, p->targets_host, N * sizeof(int32_t));
}

static double download_loss_sum(Plain* p, int N) {
    p->ops->download(p->ctx, p->losses_host, p->losses, (size_t)N * sizeof(float));
    double sum = 0.0;
    for (int i = 0; i < N; i++) sum += p->losses_host[i];
    return sum;
}

// Pointer of tensor `i`'s parameters in its device slab.
static const void* dparam_of(const Plain* p, int i) {
    const TensorDesc* d = &p->m->tt.t[i];
    return (const char*)p->dparam[d->owner_layer] + (size_t)d->param_offset * p->ops->act_bytes;
}

// NULL for a frozen tensor (LoRA): its gradient is not computed.
static float* dgrad_of(const Plain* p, int i) {
    const TensorDesc* d = &p->m->tt.t[i];
    if (d->grad_offset < 0) return NULL;
    return p->dgrad[d->layer] + d->grad_offset;
}

static void forward_blocks(Plain* p, int B, int T) {
    const Model* m = p->m;
    const int L = m->cfg.L;
    int i_embed = tensor_table_index(&m->tt, TK_EMBED, -1);
    model_prefix_forward(m, p->ws, p->x[0], p->ids, dparam_of(p, i_embed), B, T);
    for (int l = 0; l < L; l++) {
        BlockActs* a = &p->ws->acts[p->recompute ? 0 : l];
        model_block_forward_at(m, p->ws, a, l, p->dparam[l + 1], p->x[l], p->x[l + 1], B, T);
    }
}

// The blocks' backward deepest first, then the embedding's, from the postfix's dres.
static void backward_blocks(Plain* p, int B, int T) {
    const Model* m = p->m;
    for (int l = m->cfg.L - 1; l >= 0; l--) {
        BlockActs* a = &p->ws->acts[p->recompute ? 0 : l];
        // Recompute: x[l+1] is no longer needed once block l+1's backward is done, so the
        // recomputed output can overwrite it.
        if (p->recompute)
            model_block_forward_at(m, p->ws, a, l, p->dparam[l + 1], p->x[l], p->x[l + 1], B, T);
        model_block_backward_at(m, p->ws, a, l, p->dparam[l + 1], p->dgrad[l + 1], p->x[l],
                                p->dres, B, T);
    }
    int i_embed = tensor_table_index(&m->tt, TK_EMBED, -1);
    model_prefix_backward(m, p->ws, dgrad_of(p, i_embed), p->dres, p->ids, B, T);
}

double plain_forward_backward(Plain* p, const int32_t* tokens, int B, int T, float grad_scale) {
    const Model* m = p->m;
    const int L = m->cfg.L, N = B * T;
    upload_batch(p, tokens, B, T);
    p->ws->lora_train = 1;  // LoRA dropout while training (ws->lora_seed: the trainer's)
    forward_blocks(p, B, T);
    // MoE: the aux loss of this forward, and its gradient's setup for the blocks' backward
    p->aux = model_moe_aux(m, p->ws, B, T, grad_scale);

    int i_norm = tensor_table_index(&m->tt, TK_FINAL_NORM, -1);
    int i_head = tensor_table_index(&m->tt, TK_LM_HEAD, -1);
    model_postfix_forward_backward(m, p->ws, dparam_of(p, i_norm), dparam_of(p, i_head),
                                   dgrad_of(p, i_norm), dgrad_of(p, i_head), p->x[L], p->dres,
                                   p->targets, p->losses, grad_scale, 1, B, T);
    backward_blocks(p, B, T);
    p->ce_sum = download_loss_sum(p, N);
    return p->ce_sum + model_aux_weight(m) * p->aux * (double)N;
}

double plain_forward_loss(Plain* p, const int32_t* tokens, int B, int T) {
    const Model* m = p->m;
    upload_batch(p, tokens, B, T);
    p->ws->lora_train = 0;
    forward_blocks(p, B, T);
    int i_norm = tensor_table_index(&m->tt, TK_FINAL_NORM, -1);
    int i_head = tensor_table_index(&m->tt, TK_LM_HEAD, -1);
    model_postfix_forward_backward(m, p->ws, dparam_of(p, i_norm), dparam_of(p, i_head), NULL,
                                   NULL, p->x[m->cfg.L], NULL, p->targets, p->losses, 1.0f, 0, B,
                                   T);
    return download_loss_sum(p, B * T);
}

void plain_logits_last(Plain* p, const int32_t* tokens, int n, float* logits) {
    const Model* m = p->m;
    if (n <= 0 || n > p->T) fatal("internal: plain_logits_last with %d tokens (max %d)", n, p->T);
    memcpy(p->ids_host, tokens, (size_t)n * sizeof(int32_t));
    p->ops->upload(p->ctx, p->ids, p->ids_host, (size_t)n * sizeof(int32_t));
    p->ws->lora_train = 0;
    forward_blocks(p, 1, n);
    int i_norm = tensor_table_index(&m->tt, TK_FINAL_NORM, -1);
    int i_head = tensor_table_index(&m->tt, TK_LM_HEAD, -1);
    // the logits land in the workspace's chunk buffer
    model_postfix_logits_last(m, p->ws, dparam_of(p, i_norm), dparam_of(p, i_head), p->x[m->cfg.L],
                              p->ws->logits, 1, n);
    p->ops->download_f32(p->ctx, logits, p->ws->logits, (size_t)m->cfg.V);
}

double plain_policy_forward_backward(Plain* p, const int32_t* ids, const int32_t* targets,
                                     const PolicyLoss* pl, float* logp, float* losses,
                                     int compute_grad, int B, int T) {
    const Model* m = p->m;
    const size_t N = (size_t)B * T;
    if (B > p->B || T > p->T || B <= 0 || T <= 0)
        fatal("internal: policy batch %dx%d exceeds the workspace %dx%d", B, T, p->B, p->T);
    p->ops->upload(p->ctx, p->ids, ids, N * sizeof(int32_t));
    p->ops->upload(p->ctx, p->targets, targets, N * sizeof(int32_t));
    p->ws->lora_train = compute_grad;
    forward_blocks(p, B, T);
    if (compute_grad) p->aux = model_moe_aux(m, p->ws, B, T, 0.0f);  // routing only: no aux loss
    int i_norm = tensor_table_index(&m->tt, TK_FINAL_NORM, -1);
    int i_head = tensor_table_index(&m->tt, TK_LM_HEAD, -1);
    model_postfix_policy(m, p->ws, dparam_of(p, i_norm), dparam_of(p, i_head),
                         compute_grad ? dgrad_of(p, i_norm) : NULL,
                         compute_grad ? dgrad_of(p, i_head) : NULL, p->x[m->cfg.L],
                         compute_grad ? p->dres : NULL, p->targets, pl, logp, losses,
                         compute_grad, B, T);
    if (compute_grad) backward_blocks(p, B, T);
    p->ops->download(p->ctx, p->losses_host, losses, N * sizeof(float));
    double sum = 0.0;
    for (size_t i = 0; i < N; i++) sum += p->losses_host[i];
    return sum;
}
