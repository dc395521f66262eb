/*
 * dp_plan.c — data parallelism on paper: for W ranks (nodes) linked at G Gbit/s, the bytes a step
 * moves per rank (ring reduce-scatter of the gradients, all-gather of the updated weights), the
 * part of that time the step's compute does not hide, and the host memory per rank with ZeRO-1.
 * `--plan --world W --net-gbps G` prints it; docs/PERFORMANCE.md §7 derives the formulas and
 * projects LLaMA-3.1-8B and Qwen3-32B from measured single-node step times.
 *
 * The overlap model. Only the last round of a step completes gradients, so the reduce-scatter of
 * a layer starts when that round's backward of the layer is done (docs/DISTRIBUTED.md §6) and the
 * layers' collectives queue on the link in backward order: postfix (the LM head), blocks L..1,
 * the prefix (the embedding, with a tied head's gradient folded in). The backward takes 2/3 of a
 * round's compute (the matmuls' backward is twice their forward; recomputation only lengthens
 * it, so 2/3 is the cautious share) and is spread over the layers by their FLOPs per token (the
 * head 6·C·V, each block an equal share of the rest, the embedding's gather none). What the link
 * still carries after the last layer's backward is the reduce-scatter's tail. With the
 * synchronous optimizer the tail, the CPU step of the shard and the wait of the next round's
 * forward for its weights (all-gathered in forward order, overlapping that forward) add to the
 * step; with the one-step-delayed update the next iteration is already running, so the traffic
 * costs time only when the link is busier than the step is long. Every layer's collective is a
 * ring of W - 1 steps, each paying DP_PLAN_HOP_LATENCY_S besides its bytes at the link's rate.
 */
#include "dp.h"

#include <math.h>
#include <stdlib.h>

#include "common.h"
#include "config.h"

// ----------------------------------------------------------------------------
// the model's layers: gradient elements and compute shares

// Elements the optimizer steps in layer l (trainable, owned: a tied head's gradient is folded
// into the prefix's embedding before the reduce-scatter).
static double layer_params(const Model* m, int l) { return (double)m->tt.state_numel[l]; }

// Share of a pass's compute in layer l (prefix 0, blocks 1..L, postfix L+1).
static double layer_share(const Model* m, int l, double head_share) {
    const int L = m->cfg.L;
    if (l == 0) return 0.0;
    if (l == L + 1) return head_share;
    return (1.0 - head_share) / L;
}

// The link after the layers' collectives queued behind their compute: layers in `order`, each
// ready at the end of its compute (ready_s[i], in that order) and taking comm_s[i] on the link.
// Returns when the link is done.
static double link_finish(const double* ready_s, const double* comm_s, int n) {
    double link = 0.0;
    for (int i = 0; i < n; i++) link = fmax(link, ready_s[i]) + comm_s[i];
    return link;
}

static double net_seconds(double bytes, double gbps) { return bytes * 8.0 / (gbps * 1e9); }

// One ring collective of W ranks over `elems` elements of `bytes_per` bytes: W - 1 steps, each
// moving 1/W of the buffer and paying the hop latency.
static double ring_seconds(double elems, double bytes_per, int world, double gbps) {
    const double W = world;
    return (W - 1) * DP_PLAN_HOP_LATENCY_S + net_seconds(elems * bytes_per * (W - 1) / W, gbps);
}

// The reduce-scatter's tail after the last layer's backward, for `bytes_per_param` gradients.
static double rs_tail(const DpPlanInput* in, double head_share, double window, double per_param) {
    const Model* m = in->m;
    const int n = m->tt.n_layers;
    double* ready = malloc_check((size_t)n * sizeof(double));
    double* comm = malloc_check((size_t)n * sizeof(double));
    double t = 0.0;
    for (int i = 0; i < n; i++) {
        const int l = n - 1 - i;  // backward order: postfix, blocks L..1, prefix
        t += window * layer_share(m, l, head_share);
        ready[i] = t;
        comm[i] = ring_seconds(layer_params(m, l), per_param, in->world, in->net_gbps);
    }
    const double tail = fmax(0.0, link_finish(ready, comm, n) - window);
    free(ready);
    free(comm);
    return tail;
}

// Sync: how long the next round's forward waits for its weights, all-gathered in forward order
// (each layer's compute starts when its weights are there and the layer before is done).
static double ag_stall(const DpPlanInput* in, double head_share, double window) {
    const Model* m = in->m;
    double link = 0.0, fwd = 0.0;
    for (int l = 0; l < m->tt.n_layers; l++) {
        link += ring_seconds(layer_params(m, l), 2.0, in->world, in->net_gbps);
        fwd = fmax(fwd, link) + window * layer_share(m, l, head_share);
    }
    return fmax(0.0, fwd - window);
}

// ----------------------------------------------------------------------------

DpPlan dp_plan_estimate(const DpPlanInput* in) {
    DpPlan p = {0};
    const Model* m = in->m;
    const double W = in->world;
    p.params = (double)m->tt.trainable_params;
    const double ring = (W - 1) / W;  // a ring collective sends (W-1)/W of the buffer per rank
    p.rs_bytes = 4.0 * p.params * ring;
    p.rs_bf16_bytes = 2.0 * p.params * ring;
    p.ag_bytes = 2.0 * p.params * ring;
    // one collective per layer, each paying the ring's W - 1 hop latencies
    const double hops = (double)m->tt.n_layers * (W - 1) * DP_PLAN_HOP_LATENCY_S;
    p.rs_s = hops + net_seconds(p.rs_bytes, in->net_gbps);
    p.rs_bf16_s = hops + net_seconds(p.rs_bf16_bytes, in->net_gbps);
    p.ag_s = hops + net_seconds(p.ag_bytes, in->net_gbps);
    // ZeRO-1: fp32 master weights, m and v (12 B) and the gradient sets (4 B each) of the
    // trainable parameters are kept for 1/W of them; the compute-dtype copies stay whole
    p.host_saved = p.params * (12.0 + 4.0 * in->grad_sets) * ring;
    p.host_bytes_rank = in->host_bytes - p.host_saved;
    // as built (engine/shard.c): the engine's m and v, and its fp32 weights where no plain path
    // reads them, for 1/W; the gradient sets whole (downloaded whole, reduce-scattered on the host)
    p.host_built_saved = p.params * in->built_sharded * ring;
    p.host_built_rank = in->host_bytes - p.host_built_saved;
    if (in->host_rank_bytes > 0) {
        p.host_built_rank = in->host_rank_bytes;
        p.host_built_saved = in->host_bytes - in->host_rank_bytes;
    }
    p.opt_s = p.params / W / DP_PLAN_ADAMW_PARAMS_PER_S;
    if (in->step_s <= 0 || in->world <= 1) {
        p.efficiency = p.efficiency_bf16 = 1.0;
        return p;
    }
    const double flops = config_flops_per_token(&m->cfg, 1);
    const double head_share = fmin(1.0, 6.0 * (double)m->cfg.C * m->cfg.V / flops);
    const int R = in->rounds > 0 ? in->rounds : 1;
    p.bwd_window_s = in->step_s / R * 2.0 / 3.0;
    p.fwd_window_s = in->step_s / R / 3.0;
    p.rs_tail_s = rs_tail(in, head_share, p.bwd_window_s, 4.0);
    p.rs_bf16_tail_s = rs_tail(in, head_share, p.bwd_window_s, 2.0);
    if (in->sync) {
        p.ag_stall_s = ag_stall(in, head_share, p.fwd_window_s);
        p.exposed_s = p.rs_tail_s + p.opt_s + p.ag_stall_s;
        p.exposed_bf16_s = p.rs_bf16_tail_s + p.opt_s + p.ag_stall_s;
    } else {
        p.exposed_s = fmax(0.0, p.rs_s + p.ag_s - in->step_s);
        p.exposed_bf16_s = fmax(0.0, p.rs_bf16_s + p.ag_s - in->step_s);
    }
    p.efficiency = in->step_s / (in->step_s + p.exposed_s);
    p.efficiency_bf16 = in->step_s / (in->step_s + p.exposed_bf16_s);
    return p;
}

void dp_plan_print(const DpPlanInput* in, const char* step_source, FILE* f) {
    const DpPlan p = dp_plan_estimate(in);
    const double GiB = 1024.0 * 1024.0 * 1024.0;
    fprintf(f, "data parallel over %d ranks at %g Gbit/s per node (ring collectives, ZeRO-1; per "
               "rank and step, %.0f trainable parameters):\n", in->world, in->net_gbps, p.params);
    fprintf(f, "  reduce-scatter of the fp32 gradients  %.2f GiB  %.3f s  (bf16 gradients: "
               "%.2f GiB, %.3f s)\n", p.rs_bytes / GiB, p.rs_s, p.rs_bf16_bytes / GiB,
            p.rs_bf16_s);
    fprintf(f, "  all-gather of the updated bf16 weights %.2f GiB  %.3f s\n", p.ag_bytes / GiB,
            p.ag_s);
    if (in->step_s > 0 && in->world > 1) {
        fprintf(f, "  step compute %.3f s (%s); the last round's backward %.3f s hides the "
                   "reduce-scatter layer by layer\n", in->step_s, step_source, p.bwd_window_s);
        fprintf(f, "  reduce-scatter left after the last layer's backward: %.3f s (bf16 "
                   "gradients: %.3f s)\n", p.rs_tail_s, p.rs_bf16_tail_s);
        if (in->sync)
            fprintf(f, "  --sync: + the AdamW shard on the CPUs %.3f s + the next forward waiting "
                       "for its weights %.3f s\n", p.opt_s, p.ag_stall_s);
        else
            fprintf(f, "  delayed update: the next iteration runs meanwhile; exposed only what "
                       "the link needs beyond the step (%.3f s of traffic per %.3f s step)\n",
                    p.rs_s + p.ag_s, in->step_s);
        fprintf(f, "  not hidden per step: %.3f s, efficiency %.1f%% (bf16 gradients: %.3f s, "
                   "%.1f%%)\n", p.exposed_s, 100.0 * p.efficiency, p.exposed_bf16_s,
                100.0 * p.efficiency_bf16);
    } else if (in->world > 1) {
        fprintf(f, "  (no step time to compare with: give --step-ms, the measured single-node "
                   "step)\n");
    }
    fprintf(f, "  host memory per rank with ZeRO-1: %.2f GiB (%.2f GiB less: fp32 master weights, "
               "AdamW m and v and %d gradient set(s) kept for 1/%d of the parameters)\n",
            p.host_bytes_rank / GiB, p.host_saved / GiB, in->grad_sets, in->world);
    fprintf(f, "  host memory per rank as this build runs it: %.2f GiB (%.2f GiB %s: %s)\n",
            p.host_built_rank / GiB, fabs(p.host_built_saved) / GiB,
            p.host_built_saved >= 0 ? "less" : "more",
            in->built_sharded >= 12.0 ? "fp32 weights, AdamW m and v for 1/W, the fp32 weights "
                                        "whole at start-up beyond the extra gradient sets and "
                                        "while --out or the exports write; the gradient sets and "
                                        "the compute-dtype masters stay whole"
            : in->built_sharded >= 8.0 ? "AdamW m and v for 1/W; the fp32 weights stay whole for "
                                         "the plain path's evaluation or sampling (--val '' "
                                         "--sample-tokens 0 shards them), the gradient sets and "
                                         "the compute-dtype masters for now"
                                       : "the plain path keeps its whole store, its packed "
                                         "gradients and gathered weights");
    if (in->host_rank_bytes > 0)
        fprintf(f, "  (the start-up check of each rank compares this figure, rank 0's, with "
                   "the memory available)\n");
}
