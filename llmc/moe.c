/*
 * moe.c — the mixture-of-experts MLP against the op table, and the aux loss (see moe.h).
 */
#include "moe.h"

#include <stdlib.h>
#include <string.h>

#include "common.h"

// GPT-OSS's expert activation constant (modeling_gpt_oss: alpha = 1.702, hard-coded).
#define GPTOSS_ALPHA 1.702f

static int is_oss(const ModelConfig* c) { return c->family == FAMILY_GPTOSS; }

static int route_mode(const ModelConfig* c) {
    if (is_oss(c)) return MOE_ROUTE_TOPK_SOFTMAX;
    return c->norm_topk_prob ? MOE_ROUTE_SOFTMAX_TOPK_NORM : MOE_ROUTE_SOFTMAX_TOPK;
}

// ----------------------------------------------------------------------------
// buffers

size_t moe_acts_bytes(const ModelConfig* c, size_t ab, int64_t N) {
    const size_t n = (size_t)N, R = n * (size_t)c->K, E = (size_t)c->E, F = (size_t)c->F_expert;
    return n * E * ab + n * c->K * (sizeof(int32_t) + sizeof(float)) + (E + 1) * sizeof(int32_t) +
           2 * R * sizeof(int32_t) + R * (3 * F + (size_t)c->C) * ab;
}

size_t moe_scratch_bytes(const ModelConfig* c, size_t ab, int64_t N) {
    const size_t n = (size_t)N, R = n * (size_t)c->K, F = (size_t)c->F_expert, C = (size_t)c->C;
    return 2 * R * C * ab + 3 * R * F * ab + n * (size_t)c->E * ab + n * c->K * sizeof(float) +
           n * C * ab;
}

void moe_acts_alloc(MoeActs* a, const ModelConfig* c, const Ops* ops, void* ctx, int64_t N) {
    const size_t n = (size_t)N, R = n * (size_t)c->K, ab = (size_t)ops->act_bytes;
    const size_t E = (size_t)c->E, F = (size_t)c->F_expert;
    a->logits = ops->alloc(ctx, n * E * ab);
    a->idx = ops->alloc(ctx, n * c->K * sizeof(int32_t));
    a->weights = ops->alloc(ctx, n * c->K * sizeof(float));
    a->offsets = ops->alloc(ctx, (E + 1) * sizeof(int32_t));
    a->src = ops->alloc(ctx, R * sizeof(int32_t));
    a->dst = ops->alloc(ctx, R * sizeof(int32_t));
    a->gu = ops->alloc(ctx, R * 2 * F * ab);
    a->act = ops->alloc(ctx, R * F * ab);
    a->out = ops->alloc(ctx, R * (size_t)c->C * ab);
}

void moe_acts_free(MoeActs* a, const Ops* ops, void* ctx) {
    void* p[] = {a->logits, a->idx, a->weights, a->offsets, a->src, a->dst, a->gu, a->act, a->out};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) ops->free(ctx, p[i]);
    memset(a, 0, sizeof *a);
}

void moe_scratch_alloc(MoeScratch* s, const ModelConfig* c, const Ops* ops, void* ctx, int64_t N) {
    const size_t n = (size_t)N, R = n * (size_t)c->K, ab = (size_t)ops->act_bytes;
    const size_t F = (size_t)c->F_expert, C = (size_t)c->C;
    s->xp = ops->alloc(ctx, R * C * ab);
    s->dy = ops->alloc(ctx, R * C * ab);
    s->dact = ops->alloc(ctx, R * F * ab);
    s->dgu = ops->alloc(ctx, R * 2 * F * ab);
    s->dlogits = ops->alloc(ctx, n * (size_t)c->E * ab);
    s->dweights = ops->alloc(ctx, n * c->K * sizeof(float));
    s->dx_router = ops->alloc(ctx, n * C * ab);
}

void moe_scratch_free(MoeScratch* s, const Ops* ops, void* ctx) {
    void* p[] = {s->xp, s->dy, s->dact, s->dgu, s->dlogits, s->dweights, s->dx_router};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        if (p[i]) ops->free(ctx, p[i]);
    memset(s, 0, sizeof *s);
}

int moe_ops_supported(const Ops* ops, const ModelConfig* c) {
    int ok = ops->moe_route_forward && ops->moe_route_backward && ops->moe_dispatch &&
             ops->moe_gather && ops->moe_gather_backward && ops->moe_matmul_forward &&
             ops->moe_matmul_backward && ops->moe_combine_forward && ops->moe_combine_backward &&
             ops->moe_router_stats;
    if (is_oss(c))
        ok = ok && ops->gptoss_glu_forward && ops->gptoss_glu_backward &&
             ops->attention_sink_forward && ops->attention_sink_backward;
    return ok;
}

// ----------------------------------------------------------------------------
// forward and backward

void moe_forward(const ModelConfig* c, const Ops* ops, void* ctx, MoeScratch* s, MoeActs* a,
                 const MoeWeights* w, const void* x, void* y, float* stats, int N) {
    const int C = c->C, E = c->E, K = c->K, F = c->F_expert, R = N * K, oss = is_oss(c);
    // router (HF: the logits in the activation dtype, the softmax in fp32 inside the route op)
    ops->matmul_forward(ctx, a->logits, x, w->router, w->router_bias, N, C, E);
    if (w->router_adapter) w->router_adapter(w->adapter_arg, x, a->logits, N);
    ops->moe_route_forward(ctx, a->idx, a->weights, a->logits, N, E, K, route_mode(c));
    ops->moe_dispatch(ctx, a->offsets, a->src, a->dst, a->idx, N, E, K);
    if (stats) ops->moe_router_stats(ctx, stats, a->logits, a->offsets, N, E);
    // experts: gate/up, activation, down, each expert on its own rows
    ops->moe_gather(ctx, s->xp, x, a->src, N, K, C);
    ops->moe_matmul_forward(ctx, a->gu, s->xp, w->gate_up, w->gate_up_bias, a->offsets, R, E, C,
                            2 * F, oss);
    if (w->expert_adapter) w->expert_adapter(w->adapter_arg, 0, s->xp, a->gu, a->offsets, R);
    if (oss)
        ops->gptoss_glu_forward(ctx, a->act, a->gu, R, F, c->swiglu_limit, GPTOSS_ALPHA);
    else
        ops->swiglu_forward(ctx, a->act, a->gu, R, F);
    ops->moe_matmul_forward(ctx, a->out, a->act, w->down, w->down_bias, a->offsets, R, E, F, C,
                            oss);
    if (w->expert_adapter) w->expert_adapter(w->adapter_arg, 1, a->act, a->out, a->offsets, R);
    ops->moe_combine_forward(ctx, y, a->out, a->weights, a->dst, N, K, C);
}

void moe_backward(const ModelConfig* c, const Ops* ops, void* ctx, MoeScratch* s,
                  const MoeActs* a, const MoeWeights* w, const MoeGrads* g, const void* x,
                  const void* dy, void* dx, const float* counts, float aux_scale, int N) {
    const int C = c->C, E = c->E, K = c->K, F = c->F_expert, R = N * K, oss = is_oss(c);
    // combine: each expert row's gradient, and the routing weights' gradient
    ops->moe_combine_backward(ctx, s->dy, s->dweights, dy, a->out, a->weights, a->dst, N, K, C);
    // down projection, activation, gate/up projection (its input re-gathered from x)
    ops->moe_matmul_backward(ctx, s->dact, g->down, g->down_bias, s->dy, a->act, w->down,
                             a->offsets, R, E, F, C, oss);
    if (w->expert_adapter_backward)
        w->expert_adapter_backward(w->adapter_arg, 1, a->act, s->dy, s->dact, a->offsets, R);
    if (oss)
        ops->gptoss_glu_backward(ctx, s->dgu, s->dact, a->gu, R, F, c->swiglu_limit,
                                 GPTOSS_ALPHA);
    else
        ops->swiglu_backward(ctx, s->dgu, s->dact, a->gu, R, F);
    ops->moe_gather(ctx, s->xp, x, a->src, N, K, C);
    // dy is dead once the down projection's backward has run: it takes the inputs' gradient
    ops->moe_matmul_backward(ctx, s->dy, g->gate_up, g->gate_up_bias, s->dgu, s->xp, w->gate_up,
                             a->offsets, R, E, C, 2 * F, oss);
    if (w->expert_adapter_backward)
        w->expert_adapter_backward(w->adapter_arg, 0, s->xp, s->dgu, s->dy, a->offsets, R);
    ops->moe_gather_backward(ctx, dx, s->dy, a->dst, N, K, C);
    // router: the routing weights' gradient (and the aux loss's) through the routing and W_r
    ops->moe_route_backward(ctx, s->dlogits, s->dweights, a->logits, a->idx, a->weights, counts,
                            aux_scale, N, E, K, route_mode(c));
    ops->matmul_backward(ctx, s->dx_router, g->router, g->router_bias, s->dlogits, x, w->router,
                         N, C, E);
    if (w->router_adapter_backward)
        w->router_adapter_backward(w->adapter_arg, x, s->dlogits, s->dx_router, N);
    ops->add(ctx, dx, dx, s->dx_router, (size_t)N * C);
}

// ----------------------------------------------------------------------------
// aux loss

double moe_aux_loss(const ModelConfig* c, const float* stats, int n_blocks, int64_t N,
                    float* counts, double* load_max, double* load_mean) {
    const int E = c->E;
    double aux = 0.0, mx = 0.0, sum = 0.0;
    for (int e = 0; e < E; e++) {
        double cnt = 0.0, p = 0.0;
        for (int b = 0; b < n_blocks; b++) {
            cnt += stats[(size_t)b * 2 * E + e];
            p += stats[(size_t)b * 2 * E + E + e];
        }
        if (counts) counts[e] = (float)cnt;
        aux += cnt * p;
        sum += cnt;
        if (cnt > mx) mx = cnt;
    }
    const double rows = (double)n_blocks * (double)N;
    if (load_max) *load_max = mx;
    if (load_mean) *load_mean = sum / E;
    return rows > 0 ? aux * E / (rows * rows) : 0.0;
}
