/*
 * ops_cpu_moe.c — the CPU backend's mixture-of-experts ops (ops.h) for Qwen3-MoE and GPT-OSS:
 * routing (softmax / top-k in the three modes, with the aux loss's gradient), a stable
 * counting-sort dispatch, gathers and combines summed in fixed k order, the router statistics of
 * the aux loss, a grouped matmul that runs the packed GEMM once per expert on its rows, and the
 * GPT-OSS clamped GLU. Forward and backward of each; the determinism rules of ops_cpu.c hold here
 * too. It uses only the core (ops_cpu_core.c, through ops_cpu_core.h); the table in ops_cpu.c
 * points at its ops.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops_cpu_core.h"

// ----------------------------------------------------------------------------
// mixture of experts: routing

typedef struct RouteArgs {
    int32_t* idx;          // (n, K)
    float* weights;        // (n, K)
    float* dlogits;        // (n, E) backward
    const float* logits;   // (n, E)
    const float* dweights; // (n, K) backward
    const float* cweights; // (n, K) backward: the forward's weights
    const int32_t* cidx;   // (n, K) backward
    const float* counts;   // (E) backward, aux term
    float aux_scale;
    int n, E, K, mode, rows_per_task;
} RouteArgs;

// p (E) = softmax(z) in fp32 with a double sum (the Qwen3-MoE router, HF's fp32 softmax).
static void softmax_row(float* p, const float* z, int E) {
    float m = -INFINITY;
    for (int e = 0; e < E; e++) m = z[e] > m ? z[e] : m;
    double sum = 0.0;
    for (int e = 0; e < E; e++) {
        p[e] = expf(z[e] - m);
        sum += p[e];
    }
    const float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++) p[e] *= inv;
}

// The K largest of v (E), best first; a tie goes to the lower index (strict > while scanning up).
static void topk_row(int32_t* idx, const float* v, int E, int K) {
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k && !taken; j++) taken = idx[j] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        idx[k] = best;
    }
}

static void route_forward_task(void* arg, int64_t task) {
    const RouteArgs* r = arg;
    float* p = malloc_check((size_t)r->E * sizeof(float));
    const int n0 = (int)task * r->rows_per_task, n1 = imin(r->n, n0 + r->rows_per_task);
    for (int i = n0; i < n1; i++) {
        const float* z = r->logits + (size_t)i * r->E;
        int32_t* idx = r->idx + (size_t)i * r->K;
        float* w = r->weights + (size_t)i * r->K;
        if (r->mode == MOE_ROUTE_TOPK_SOFTMAX) {
            // top-k on the raw logits, softmax over the K chosen (the first is the largest)
            topk_row(idx, z, r->E, r->K);
            double sum = 0.0;
            for (int k = 0; k < r->K; k++) {
                w[k] = expf(z[idx[k]] - z[idx[0]]);
                sum += w[k];
            }
            for (int k = 0; k < r->K; k++) w[k] = (float)(w[k] / sum);
            continue;
        }
        softmax_row(p, z, r->E);
        topk_row(idx, p, r->E, r->K);
        double sum = 0.0;
        for (int k = 0; k < r->K; k++) sum += p[idx[k]];
        for (int k = 0; k < r->K; k++)
            w[k] = r->mode == MOE_ROUTE_SOFTMAX_TOPK_NORM ? (float)(p[idx[k]] / sum) : p[idx[k]];
    }
    free(p);
}

void ops_cpu_moe_route_forward(void* ctx, int32_t* idx, float* weights, const void* logits,
                               int n, int E, int K, int mode) {
    RouteArgs r = {.idx = idx, .weights = weights, .logits = logits, .n = n, .E = E, .K = K,
                   .mode = mode, .rows_per_task = rows_per_task((size_t)E * 4)};
    cpu_run(ctx, task_count(n, r.rows_per_task), route_forward_task, &r);
}

// Renormalised modes: w = softmax over the chosen logits, so dl_{i_k} = w_k (dw_k - Σ_j w_j dw_j)
// and nothing reaches the others. Plain mode: w_k = p_{i_k}, so dl_j = p_j (dw(j) - Σ_k w_k dw_k)
// over all j, dw(j) = dw_k where j = i_k, else 0. The aux term: aux_scale p_j (c_j - Σ_e c_e p_e).
static void route_backward_task(void* arg, int64_t task) {
    const RouteArgs* r = arg;
    float* p = malloc_check((size_t)r->E * sizeof(float));
    const int n0 = (int)task * r->rows_per_task, n1 = imin(r->n, n0 + r->rows_per_task);
    for (int i = n0; i < n1; i++) {
        const float* z = r->logits + (size_t)i * r->E;
        const int32_t* idx = r->cidx + (size_t)i * r->K;
        const float* w = r->cweights + (size_t)i * r->K;
        const float* dw = r->dweights + (size_t)i * r->K;
        float* dl = r->dlogits + (size_t)i * r->E;
        double wdw = 0.0;
        for (int k = 0; k < r->K; k++) wdw += (double)w[k] * dw[k];
        const int need_p = r->mode == MOE_ROUTE_SOFTMAX_TOPK || r->aux_scale != 0.0f;
        if (need_p) softmax_row(p, z, r->E);
        if (r->mode == MOE_ROUTE_SOFTMAX_TOPK) {
            for (int e = 0; e < r->E; e++) dl[e] = (float)(-(double)p[e] * wdw);
            for (int k = 0; k < r->K; k++) dl[idx[k]] += p[idx[k]] * dw[k];
        } else {
            for (int e = 0; e < r->E; e++) dl[e] = 0.0f;
            for (int k = 0; k < r->K; k++) dl[idx[k]] = (float)(w[k] * (dw[k] - wdw));
        }
        if (r->aux_scale != 0.0f) {
            double cp = 0.0;
            for (int e = 0; e < r->E; e++) cp += (double)r->counts[e] * p[e];
            for (int e = 0; e < r->E; e++)
                dl[e] += (float)(r->aux_scale * p[e] * (r->counts[e] - cp));
        }
    }
    free(p);
}

void ops_cpu_moe_route_backward(void* ctx, void* dlogits, const float* dweights,
                                const void* logits, const int32_t* idx, const float* weights,
                                const float* counts, float aux_scale, int n, int E, int K,
                                int mode) {
    RouteArgs r = {.dlogits = dlogits, .dweights = dweights, .logits = logits, .cidx = idx,
                   .cweights = weights, .counts = counts, .aux_scale = aux_scale, .n = n, .E = E,
                   .K = K, .mode = mode, .rows_per_task = rows_per_task((size_t)E * 4)};
    cpu_run(ctx, task_count(n, r.rows_per_task), route_backward_task, &r);
}

// A counting sort, on the calling thread: O(n K + E), small next to the experts' matmuls.
void ops_cpu_moe_dispatch(void* ctx, int32_t* offsets, int32_t* src, int32_t* dst,
                          const int32_t* idx, int n, int E, int K) {
    (void)ctx;
    const int64_t R = (int64_t)n * K;
    for (int e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t r = 0; r < R; r++) {
        if (idx[r] < 0 || idx[r] >= E) fatal("moe_dispatch: expert %d outside [0, %d)", idx[r], E);
        offsets[idx[r] + 1]++;
    }
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int32_t* cursor = malloc_check((size_t)(E > 0 ? E : 1) * sizeof(int32_t));
    for (int e = 0; e < E; e++) cursor[e] = offsets[e];
    for (int64_t r = 0; r < R; r++) {
        int32_t pos = cursor[idx[r]]++;
        src[pos] = (int32_t)r;
        dst[r] = pos;
    }
    free(cursor);
}

// ----------------------------------------------------------------------------
// mixture of experts: gather, combine, statistics

typedef struct MoeRowArgs {
    float* out;
    float* dweights;        // combine backward
    const float* inp;
    const float* y;
    const float* weights;
    const int32_t* map;     // src (gather) or dst (the rest)
    int n, K, C, rows_per_task;
} MoeRowArgs;

static void moe_gather_task(void* arg, int64_t task) {
    const MoeRowArgs* a = arg;
    const int64_t R = (int64_t)a->n * a->K;
    const int64_t i0 = task * a->rows_per_task;
    const int64_t i1 = i0 + a->rows_per_task < R ? i0 + a->rows_per_task : R;
    for (int64_t i = i0; i < i1; i++)
        memcpy(a->out + (size_t)i * a->C, a->inp + (size_t)(a->map[i] / a->K) * a->C,
               (size_t)a->C * sizeof(float));
}

void ops_cpu_moe_gather(void* ctx, void* out, const void* inp, const int32_t* src, int n, int K,
                        int C) {
    MoeRowArgs a = {.out = out, .inp = inp, .map = src, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C)};
    cpu_run(ctx, task_count((int64_t)n * K, a.rows_per_task), moe_gather_task, &a);
}

// Rows of the n tokens: gather backward (weights NULL) or combine forward, Σ over k in order.
static void moe_sum_rows_task(void* arg, int64_t task) {
    const MoeRowArgs* a = arg;
    const int i0 = (int)task * a->rows_per_task, i1 = imin(a->n, i0 + a->rows_per_task);
    for (int i = i0; i < i1; i++) {
        float* o = a->out + (size_t)i * a->C;
        for (int c = 0; c < a->C; c++) o[c] = 0.0f;
        for (int k = 0; k < a->K; k++) {
            const float* y = a->y + (size_t)a->map[(size_t)i * a->K + k] * a->C;
            const float w = a->weights ? a->weights[(size_t)i * a->K + k] : 1.0f;
            if (a->weights)
                for (int c = 0; c < a->C; c++) o[c] += w * y[c];
            else
                for (int c = 0; c < a->C; c++) o[c] += y[c];
        }
    }
}

void ops_cpu_moe_gather_backward(void* ctx, void* dinp, const void* dout, const int32_t* dst,
                                 int n, int K, int C) {
    MoeRowArgs a = {.out = dinp, .y = dout, .map = dst, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C * K)};
    cpu_run(ctx, task_count(n, a.rows_per_task), moe_sum_rows_task, &a);
}

void ops_cpu_moe_combine_forward(void* ctx, void* out, const void* y, const float* weights,
                                 const int32_t* dst, int n, int K, int C) {
    MoeRowArgs a = {.out = out, .y = y, .weights = weights, .map = dst, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C * K)};
    cpu_run(ctx, task_count(n, a.rows_per_task), moe_sum_rows_task, &a);
}

static void moe_combine_backward_task(void* arg, int64_t task) {
    const MoeRowArgs* a = arg;
    const int i0 = (int)task * a->rows_per_task, i1 = imin(a->n, i0 + a->rows_per_task);
    for (int i = i0; i < i1; i++) {
        const float* g = a->inp + (size_t)i * a->C;  // dout of the row
        for (int k = 0; k < a->K; k++) {
            const size_t r = (size_t)a->map[(size_t)i * a->K + k];
            const float w = a->weights[(size_t)i * a->K + k];
            float* dy = a->out + r * a->C;
            for (int c = 0; c < a->C; c++) dy[c] = w * g[c];
            a->dweights[(size_t)i * a->K + k] = vec_dot(g, a->y + r * a->C, a->C);
        }
    }
}

void ops_cpu_moe_combine_backward(void* ctx, void* dy, float* dweights, const void* dout,
                                  const void* y, const float* weights, const int32_t* dst,
                                  int n, int K, int C) {
    MoeRowArgs a = {.out = dy, .dweights = dweights, .inp = dout, .y = y, .weights = weights,
                    .map = dst, .n = n, .K = K, .C = C,
                    .rows_per_task = rows_per_task((size_t)C * K)};
    cpu_run(ctx, task_count(n, a.rows_per_task), moe_combine_backward_task, &a);
}

typedef struct StatsArgs {
    float* probs;          // (n, E) scratch
    float* stats;          // (2E)
    const float* logits;   // (n, E)
    int n, E, rows_per_task;
} StatsArgs;

static void stats_softmax_task(void* arg, int64_t task) {
    const StatsArgs* a = arg;
    const int i0 = (int)task * a->rows_per_task, i1 = imin(a->n, i0 + a->rows_per_task);
    for (int i = i0; i < i1; i++)
        softmax_row(a->probs + (size_t)i * a->E, a->logits + (size_t)i * a->E, a->E);
}

// Column block of Σ_rows p, rows in order (double sums).
static void stats_sum_task(void* arg, int64_t task) {
    const StatsArgs* a = arg;
    const int c0 = (int)task * COL_BLOCK, c1 = imin(a->E, c0 + COL_BLOCK);
    double acc[COL_BLOCK] = {0};
    for (int i = 0; i < a->n; i++)
        for (int c = c0; c < c1; c++) acc[c - c0] += a->probs[(size_t)i * a->E + c];
    for (int c = c0; c < c1; c++) a->stats[a->E + c] = (float)acc[c - c0];
}

void ops_cpu_moe_router_stats(void* ctx, float* stats, const void* logits,
                              const int32_t* offsets, int n, int E) {
    StatsArgs a = {.probs = malloc_check((size_t)(n > 0 ? n : 1) * E * sizeof(float)),
                   .stats = stats, .logits = logits, .n = n, .E = E,
                   .rows_per_task = rows_per_task((size_t)E * 4)};
    cpu_run(ctx, task_count(n, a.rows_per_task), stats_softmax_task, &a);
    cpu_run(ctx, task_count(E, COL_BLOCK), stats_sum_task, &a);
    for (int e = 0; e < E; e++) stats[e] = (float)(offsets[e + 1] - offsets[e]);
    free(a.probs);
}

// ----------------------------------------------------------------------------
// mixture of experts: grouped matmul (the packed GEMM once per expert, on its rows)

void ops_cpu_moe_matmul_forward(void* ctx, void* out, const void* inp, const void* w,
                                const void* bias, const int32_t* offsets, int R, int E, int IC,
                                int OC, int w_in_out) {
    (void)R;
    for (int e = 0; e < E; e++) {
        const int r0 = offsets[e], M = offsets[e + 1] - offsets[e];
        if (M <= 0) continue;
        const float* we = (const float*)w + (size_t)e * IC * OC;
        Gemm g = {.M = M, .Nc = OC, .K = IC, .a = (const float*)inp + (size_t)r0 * IC,
                  .a_rs = (size_t)IC, .a_cs = 1, .b = we,
                  .b_rs = w_in_out ? (size_t)OC : 1, .b_cs = w_in_out ? 1 : (size_t)IC,
                  .c = (float*)out + (size_t)r0 * OC, .ldc = OC, .accumulate = 0,
                  .bias = bias ? (const float*)bias + (size_t)e * OC : NULL};
        ops_cpu_gemm_run(ctx, &g);
    }
}

void ops_cpu_moe_matmul_backward(void* ctx, void* dinp, float* dw, float* dbias,
                                 const void* dout, const void* inp, const void* w,
                                 const int32_t* offsets, int R, int E, int IC, int OC,
                                 int w_in_out) {
    (void)R;
    for (int e = 0; e < E; e++) {
        const int r0 = offsets[e], M = offsets[e + 1] - offsets[e];
        if (M <= 0) continue;
        const float* we = (const float*)w + (size_t)e * IC * OC;
        const float* go = (const float*)dout + (size_t)r0 * OC;
        const float* x = (const float*)inp + (size_t)r0 * IC;
        if (dinp) {  // dinp (M, IC) = dout (M, OC) · W_e as (OC, IC)
            Gemm g = {.M = M, .Nc = IC, .K = OC, .a = go, .a_rs = (size_t)OC, .a_cs = 1,
                      .b = we, .b_rs = w_in_out ? 1 : (size_t)IC, .b_cs = w_in_out ? (size_t)OC : 1,
                      .c = (float*)dinp + (size_t)r0 * IC, .ldc = IC, .accumulate = 0};
            ops_cpu_gemm_run(ctx, &g);
        }
        if (dw && !w_in_out) {  // dw_e (OC, IC) += doutᵀ · inp
            Gemm g = {.M = OC, .Nc = IC, .K = M, .a = go, .a_rs = 1, .a_cs = (size_t)OC, .b = x,
                      .b_rs = (size_t)IC, .b_cs = 1, .c = dw + (size_t)e * IC * OC, .ldc = IC,
                      .accumulate = 1};
            ops_cpu_gemm_run(ctx, &g);
        } else if (dw) {  // dw_e (IC, OC) += inpᵀ · dout
            Gemm g = {.M = IC, .Nc = OC, .K = M, .a = x, .a_rs = 1, .a_cs = (size_t)IC, .b = go,
                      .b_rs = (size_t)OC, .b_cs = 1, .c = dw + (size_t)e * IC * OC, .ldc = OC,
                      .accumulate = 1};
            ops_cpu_gemm_run(ctx, &g);
        }
        if (dbias) ops_cpu_dbias(ctx, dbias + (size_t)e * OC, go, M, OC);
    }
}

// ----------------------------------------------------------------------------
// GPT-OSS expert activation (interleaved gate/up, clamped, (up + 1) · gate · σ(alpha gate))

typedef struct GluArgs {
    float* out;
    const float* gu;    // (R, 2F) interleaved
    const float* dout;  // (R, F)
    int R, F, rows_per_task;
    float limit, alpha;
} GluArgs;

static void glu_forward_task(void* arg, int64_t task) {
    const GluArgs* a = arg;
    const int r0 = (int)task * a->rows_per_task, r1 = imin(a->R, r0 + a->rows_per_task);
    for (int r = r0; r < r1; r++) {
        const float* gu = a->gu + (size_t)r * 2 * a->F;
        float* o = a->out + (size_t)r * a->F;
        for (int i = 0; i < a->F; i++) {
            float g = fminf(gu[2 * i], a->limit);
            float u = fmaxf(fminf(gu[2 * i + 1], a->limit), -a->limit);
            o[i] = (u + 1.0f) * (g * sigmoidf(a->alpha * g));
        }
    }
}

void ops_cpu_gptoss_glu_forward(void* ctx, void* out, const void* gu, int R, int F, float limit,
                                float alpha) {
    GluArgs a = {.out = out, .gu = gu, .R = R, .F = F, .limit = limit, .alpha = alpha,
                 .rows_per_task = rows_per_task((size_t)F)};
    cpu_run(ctx, task_count(R, a.rows_per_task), glu_forward_task, &a);
}

// torch.clamp passes the gradient where min <= x <= max (the bounds included).
static void glu_backward_task(void* arg, int64_t task) {
    const GluArgs* a = arg;
    const int r0 = (int)task * a->rows_per_task, r1 = imin(a->R, r0 + a->rows_per_task);
    for (int r = r0; r < r1; r++) {
        const float* gu = a->gu + (size_t)r * 2 * a->F;
        const float* dy = a->dout + (size_t)r * a->F;
        float* dgu = a->out + (size_t)r * 2 * a->F;
        for (int i = 0; i < a->F; i++) {
            const float gate = gu[2 * i], up = gu[2 * i + 1];
            const float g = fminf(gate, a->limit);
            const float u = fmaxf(fminf(up, a->limit), -a->limit);
            const float sg = sigmoidf(a->alpha * g);
            const float glu = g * sg;
            const float dglu = sg + a->alpha * g * sg * (1.0f - sg);
            dgu[2 * i] = gate <= a->limit ? dy[i] * (u + 1.0f) * dglu : 0.0f;
            dgu[2 * i + 1] = up >= -a->limit && up <= a->limit ? dy[i] * glu : 0.0f;
        }
    }
}

void ops_cpu_gptoss_glu_backward(void* ctx, void* dgu, const void* dout, const void* gu, int R,
                                 int F, float limit, float alpha) {
    GluArgs a = {.out = dgu, .gu = gu, .dout = dout, .R = R, .F = F, .limit = limit,
                 .alpha = alpha, .rows_per_task = rows_per_task((size_t)F)};
    cpu_run(ctx, task_count(R, a.rows_per_task), glu_backward_task, &a);
}

