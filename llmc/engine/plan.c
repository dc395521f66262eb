/*
 * plan.c — the engine's planning (docs/ROUNDPIPE.md §2): the memory model of a device and of the
 * host, the choice of partition and row chunks, re-planning once from profiled stage times, and
 * the run's plan policy that callers share with the engine (host memory, the default device
 * budget, --mlp-chunk auto, --split-rounds auto).
 *
 * Owns: e->plan, e->K / e->Bc, the cost tables (cost_fwd, cost_bwd), the profile (prof_ev and
 * prof_ok are read here, after an iteration is done; dispatch.c records them) and the re-plan
 * decision (engine.c rebuilds the buffers). Touches no stream, no protocol flag and no buffer
 * contents: it computes sizes, and engine.c allocates what it says. The functions that plan
 * without an engine (engine_plan_print, engine_plan_cost, ...) run the same code on an Engine
 * that holds only the shape and the cost tables.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

// ----------------------------------------------------------------------------
// the memory model

// Device activation buffers come in two micro-batch parities, or one when a round holds a single
// micro-batch (long sequences: parity 1 would never be used).
static size_t parity_count(const Engine* e) { return e->M_R == 1 ? 1 : 2; }

size_t plan_x_buffer_bytes(const Engine* e) { return (size_t)e->Bm * e->T * e->C * e->ab; }

// MoE models: one micro-batch's aux statistics rows and summed counts (DevState.moe), per parity.
static size_t moe_handoff_bytes(const Engine* e) {
    const int n_moe = e->m->n_moe, E = e->m->cfg.E;
    return n_moe > 0 ? ((size_t)n_moe * 2 * E + (size_t)E) * sizeof(float) : 0;
}

// The policy objective (EngineOptions.policy): one micro-batch's per-token inputs and log-probs
// (DevState.pol: five floats per token), per parity.
static size_t pol_handoff_bytes(const Engine* e) {
    return e->opt.policy ? 5 * (size_t)e->Bm * e->T * sizeof(float) : 0;
}

static size_t scratch_bytes(const Engine* e) {
    const size_t tok = (size_t)e->Bc * e->T;  // the compute works on one row chunk at a time
    const size_t kernels = e->ab == 2 ? tok * (16 + 4 * (size_t)e->m->cfg.H) + ((size_t)64 << 20) : 0;
    return workspace_bytes(e->m, (int)e->ab, e->Bc, e->T, 0) + kernels;
}

// Device bytes every plan needs whatever its stages: the workspace's scratch (without activation
// sets), the kernels' own temporaries (attention-backward row sums, embedding-backward sort
// buffers, reduction partials, the cuBLASLt workspace: about N (16 + 4H) bytes + 64 MiB on GPUs,
// whose compute dtype is bf16; the emulated devices' ops use host memory), and of
// the hand-off buffers those not proportional to a stage's length (the incoming gradient, one
// spare residual-stream buffer, tokens, targets and losses) in one or two micro-batch parities.
// (MoE models add their per-micro-batch aux statistics and counts, DevState.moe.)
static size_t fixed_device_bytes(const Engine* e) {
    const size_t tok = (size_t)e->Bm * e->T;
    return scratch_bytes(e) +
           parity_count(e) * (2 * plan_x_buffer_bytes(e) +
                              tok * (2 * sizeof(int32_t) + sizeof(float)) + moe_handoff_bytes(e) +
                              pol_handoff_bytes(e));
}

// Bytes a forward / backward stage needs per layer on a device: parameters (the fused stage
// carries a copy of a tied embedding as its head), plus for backward stages the fp32 gradients
// and, with stage-grain recompute, the block's saved activations for one micro-batch (every block
// of a backward stage keeps them until its backward). The planner gives each stage half the
// device budget because a device holds two stages' parameter and gradient slots (the running one
// and the prefetched one); the activations are not double-buffered (one stage computes at a
// time), so they count half here: 2 x (params + grads) + activations <= budget. ub: the same in
// the fused stage, which keeps its blocks' activations with layer-grain recompute too. The
// hand-off buffers every stage needs regardless are outside the budget.
static void layer_bytes(const Engine* e, double* fb, double* bb, double* ub) {
    const TensorTable* tt = &e->m->tt;
    int head = tensor_table_index(tt, TK_LM_HEAD, -1);
    const double set = (double)workspace_act_set_bytes(e->m, (int)e->ab, e->Bc, e->T);
    const double acts = e->opt.grain == RECOMPUTE_STAGE ? set : 0.0;
    // every layer of the running stage also has a residual-stream buffer on the device (its
    // input / recomputed output / uploaded checkpoint), in one or two micro-batch parities; like
    // the activations they are not double-buffered per slot
    const double xbuf = (double)parity_count(e) * (double)plan_x_buffer_bytes(e);
    for (int l = 0; l < e->NL; l++) {
        const int block = l >= 1 && l < e->NL - 1;
        fb[l] = (double)tt->param_numel[l] * (double)e->ab + xbuf / 2 +
                (double)quant_layer_block_bytes(tt, l);  // (a quantised base's staging)
        if (l == e->NL - 1 && tt->t[head].tied_to >= 0) fb[l] += (double)tt->t[head].numel * e->ab;
        bb[l] = fb[l] + (double)tt->grad_numel[l] * sizeof(float);
        if (block) bb[l] += acts / 2;
        // the fused stage keeps every block's activations whatever the grain (its forward is
        // the recompute)
        ub[l] = bb[l] + (block && e->opt.grain == RECOMPUTE_LAYER ? set / 2 : 0.0);
    }
}

size_t plan_stage_block_bytes(const Engine* e, const PartitionPlan* plan) {
    const TensorTable* tt = &e->m->tt;
    size_t max_q = 0;
    for (int i = 0; i < plan->n_fwd + plan->n_bwd; i++) {
        SlotInfo si;
        partition_slot(plan, i, &si);
        size_t q = 0;
        for (int l = si.range.begin; l < si.range.end; l++) q += quant_layer_block_bytes(tt, l);
        if (q > max_q) max_q = q;
    }
    return max_q;
}

// What each device allocates for the plan (the same numbers engine.c's plan_resources_create
// allocates with): two parameter and two gradient slots of the largest stage, the workspace with its
// activation sets (the fused stage keeps all of its blocks'; stage-grain backward stages too;
// layer-grain ones one), and the hand-off buffers (one residual-stream buffer per layer boundary
// of the longest stage, the incoming gradient, tokens, targets and losses, in one or two
// micro-batch parities).
EngineDeviceBytes plan_device_bytes(const Engine* e, const PartitionPlan* plan,
                                           int64_t* max_p_out, int64_t* max_g_out, int* acts_out,
                                           int* max_len_out) {
    const TensorTable* tt = &e->m->tt;
    const int head = tensor_table_index(tt, TK_LM_HEAD, -1);
    const int S = plan->n_fwd + plan->n_bwd;
    int64_t max_p = 0, max_g = 0;
    int max_len = 1, max_bwd = 1, fused_sets = 1;
    for (int i = 0; i < S; i++) {
        SlotInfo si;
        partition_slot(plan, i, &si);
        int64_t p = 0, g = 0;
        for (int l = si.range.begin; l < si.range.end; l++) {
            p += tt->param_numel[l];
            g += tt->grad_numel[l];
        }
        if (si.range.end == e->NL && tt->t[head].tied_to >= 0) p += tt->t[head].numel;
        const int blocks = imin(si.range.end, e->NL - 1) - imax(si.range.begin, 1);
        if (si.kind == SLOT_FWD) g = 0;
        else if (si.kind == SLOT_BWD) max_bwd = imax(max_bwd, blocks);
        else fused_sets = imax(1, blocks);
        if (p > max_p) max_p = p;
        if (g > max_g) max_g = g;
        max_len = imax(max_len, si.range.end - si.range.begin);
    }
    const int acts = e->opt.grain == RECOMPUTE_LAYER ? fused_sets : imax(fused_sets, max_bwd);
    const size_t tok = (size_t)e->Bm * e->T;
    EngineDeviceBytes b;
    // (a quantised base: its blocks' staging beside the slot, quant.h)
    const size_t slot = (size_t)max_p * e->ab + (size_t)max_g * sizeof(float) +
                        plan_stage_block_bytes(e, plan);
    b.slot_sets = 2;
    b.slots = 2 * slot;
    b.acts = (size_t)acts * workspace_act_set_bytes(e->m, (int)e->ab, e->Bc, e->T);
    b.scratch = scratch_bytes(e);
    b.handoff = parity_count(e) * ((size_t)(max_len + 2) * plan_x_buffer_bytes(e) +
                                   tok * (2 * sizeof(int32_t) + sizeof(float)) +
                                   moe_handoff_bytes(e) + pol_handoff_bytes(e));
    b.total = b.slots + b.acts + b.scratch + b.handoff;
    // The whole model in one stage: the second slot set only prefetches that same stage for a
    // later iteration (on several devices its weights wait for the optimizer anyway; on one the
    // layer-by-layer upload runs just ahead of the first forward). One set when two do not fit.
    if (S == 1 && e->opt.device_budget > 0 && (double)b.total > e->opt.device_budget) {
        b.slot_sets = 1;
        b.slots = slot;
        b.total -= slot;
    }
    if (max_p_out) *max_p_out = max_p;
    if (max_g_out) *max_g_out = max_g;
    if (acts_out) *acts_out = acts;
    if (max_len_out) *max_len_out = max_len;
    return b;
}

// Which layer boundaries a plan passes through host memory: need_x[b] (the residual stream
// entering entry b: a stage's input, and with layer-grain recompute every block input a backward
// stage recomputes from) and need_dx[b] (its gradient, the input of the next backward stage).
void plan_boundaries(const Engine* e, const PartitionPlan* plan, int* need_x, int* need_dx) {
    const int efused = plan->bwd[0].begin;
    for (int i = 0; i < plan->n_fwd; i++)
        if (plan->fwd[i].begin > 0) need_x[plan->fwd[i].begin] = 1;
    if (efused > 0) need_x[efused] = 1;
    for (int i = 1; i < plan->n_bwd; i++) {
        if (plan->bwd[i].begin > 0) need_x[plan->bwd[i].begin] = 1;
        if (e->opt.grain == RECOMPUTE_LAYER)
            for (int l = imax(1, plan->bwd[i].begin); l < plan->bwd[i].end; l++) need_x[l] = 1;
    }
    for (int i = 0; i < plan->n_bwd; i++)
        if (plan->bwd[i].begin > 0) need_dx[plan->bwd[i].begin] = 1;
}

int plan_host_act_sets(const EngineOptions* opt) { return opt->host_single ? 1 : 2; }

int plan_host_grad_sets(const EngineOptions* opt) { return opt->sync ? 1 : 2; }

// Host bytes of the plan's activation checkpoints and boundary gradients: every x boundary in
// plan_boundaries and the two-slot dx ring, per micro-batch, in one or two iteration sets
// (--host-checkpoints).
static size_t plan_host_act_bytes(const Engine* e, const PartitionPlan* plan) {
    int* nx = calloc_check((size_t)e->NL + 1, sizeof(int));
    int* ndx = calloc_check((size_t)e->NL + 1, sizeof(int));
    plan_boundaries(e, plan, nx, ndx);
    size_t n = 0, n_dx = 0;
    for (int b = 0; b <= e->NL; b++) {
        n += (size_t)nx[b];
        n_dx += (size_t)ndx[b];
    }
    n += n_dx < 2 ? n_dx : 2;  // the dx ring
    free(nx);
    free(ndx);
    // (MoE models: each micro-batch's aux statistics and counts, in two iteration parities)
    return n * (size_t)e->M * plan_x_buffer_bytes(e) * (size_t)plan_host_act_sets(&e->opt) +
           2 * (size_t)e->M * (size_t)e->moe_floats * sizeof(float);
}

// ----------------------------------------------------------------------------
// plan choice

// Plan with the costs in e->cost_fwd / cost_bwd.
static int plan_partition(Engine* e, PartitionPlan* plan, char* err) {
    const int NL = e->NL;
    double* fb = calloc_check((size_t)NL, sizeof(double));
    double* bb = calloc_check((size_t)NL, sizeof(double));
    double* ub = calloc_check((size_t)NL, sizeof(double));
    layer_bytes(e, fb, bb, ub);
    // --device-mem is everything the engine allocates on a device: what every plan needs comes
    // off the top, and each stage gets half the rest (it shares the device with the prefetched one)
    double budget = 1e300;
    if (e->opt.device_budget > 0) {
        const double fixed = (double)fixed_device_bytes(e);
        if (e->opt.device_budget <= fixed) {
            free(fb);
            free(bb);
            free(ub);
            char have[32], need[32];
            format_bytes(e->opt.device_budget, have, sizeof have);
            format_bytes(fixed, need, sizeof need);
            return errorf(err, "device memory budget: %s is not more than the %s of scratch and "
                          "hand-off buffers that micro-batches of %d x %d tokens need (raise "
                          "--device-mem or use more micro-batches)", have, need, e->Bm, e->T);
        }
        budget = (e->opt.device_budget - fixed) / 2;
    }
    // (split rounds: each device runs its own rounds of the whole model, as one device would)
    PartitionInput in = {NL, e->cost_fwd, e->cost_bwd, fb, bb, e->split ? 1 : e->N, e->M, budget,
                         !e->opt.sync, ub};
    int rc = partition_plan(&in, plan, err);
    // The search gives every stage half the budget (two slot sets). The whole model as one stage
    // with one slot set (plan_device_bytes) is the other candidate when the budget binds; it is
    // weighed against whatever the search ends with below.
    PartitionPlan one;
    memset(&one, 0, sizeof one);
    one.n_layers = NL;
    one.n_bwd = 1;
    one.bwd[0] = (StageRange){0, NL};
    partition_evaluate(&in, &one);
    const int one_fits = e->opt.device_budget > 0 &&
                         (double)plan_device_bytes(e, &one, NULL, NULL, NULL, NULL).total <=
                             e->opt.device_budget;
    // The per-stage check cannot see that a device's buffers are sized for the largest stage of
    // each kind (parameters of one, activations of another): lower the per-stage budget in 3%
    // steps until the whole fits (a smaller budget only ever makes layers fit less).
    if (rc == 0 && e->opt.device_budget > 0) {
        double total = (double)plan_device_bytes(e, plan, NULL, NULL, NULL, NULL).total;
        double smallest = total;
        const double b0 = in.budget;
        for (int k = 1; total > e->opt.device_budget; k++) {
            in.budget = b0 * pow(0.97, k);
            if (k > 150 || partition_plan(&in, plan, err) != 0) {
                char have[32], need[32];
                format_bytes(e->opt.device_budget, have, sizeof have);
                format_bytes(smallest, need, sizeof need);
                rc = errorf(err, "partition: no plan fits the device memory budget of %s (the "
                            "smallest plan found needs %s; raise --device-mem or use more "
                            "micro-batches)", have, need);
                break;
            }
            total = (double)plan_device_bytes(e, plan, NULL, NULL, NULL, NULL).total;
            smallest = fmin(smallest, total);
        }
    }
    if (one_fits && (rc != 0 || one.cost < plan->cost)) {
        *plan = one;
        rc = 0;
    }
    free(fb);
    free(bb);
    free(ub);
    return rc;
}

// Size-based (FLOP) cost estimates of one micro-batch for the current row chunks (e->Bc): the
// model chunks its MLP where a chunk's tokens exceed Model.mlp_chunk (model.c), and then every
// block's backward recomputes the MLP forward.
static void estimate_costs(Engine* e) {
    const int chunked = e->m->mlp_chunk > 0 && (int64_t)e->Bc * e->T > e->m->mlp_chunk;
    partition_estimate_costs_lora(&e->m->cfg, &e->m->tt.lora, e->T, e->Bm * e->T, chunked,
                                  e->cost_fwd, e->cost_bwd);
}

// The shape of a run and its size-based plan: everything engine_create and engine_plan_print
// share (no host or device memory beyond the cost tables). -1 with err on a bad shape.
int plan_init(Engine* e, const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
              char* err) {
    e->m = m;
    e->opt = *opt;
    if (e->opt.global_B <= 0) e->opt.global_B = e->opt.B;  // (data parallel: the global batch)
    e->NL = m->tt.n_layers;
    e->N = n_devices;
    e->M = opt->M;
    e->M_R = opt->M_R > 0 ? opt->M_R : opt->M;
    e->T = opt->T;
    e->C = m->cfg.C;
    e->delay = opt->sync ? 0 : 1;
    e->split = opt->split_rounds != 0;
    if (e->split) {
        // (a round size of the whole batch is the default's spelling: the split makes it M/N)
        if (n_devices < 2 || e->M % n_devices != 0 ||
            (opt->M_R > 0 && opt->M_R != e->M && opt->M_R * n_devices != e->M))
            return errorf(err, "--split-rounds: %d micro-batches on %d device(s) (need at least 2 "
                          "devices, micro-batches a multiple of their number, and no other round "
                          "size)", e->M, n_devices);
        e->M_R = e->M / n_devices;
    }
    if (e->M <= 0 || e->M > opt->B || e->M % e->M_R != 0)
        return errorf(err, "micro-batches: %d micro-batches for a batch of %d sequences in rounds "
                      "of %d (need 1 <= M <= B and M a multiple of the round size)", e->M, opt->B,
                      e->M_R);
    e->R = e->M / e->M_R;
    e->Bm = (opt->B + e->M - 1) / e->M;  // the largest micro-batch (buffers are sized for it)
    const int min_rows = opt->B / e->M;  // the smallest micro-batch
    if (opt->row_chunks < 0 || opt->row_chunks > min_rows)
        return errorf(err, "row chunks: %d for micro-batches of %d sequences (need 0 = choose, or "
                      "1 .. %d)", opt->row_chunks, min_rows, min_rows);
    // MoE models compute whole micro-batches: the aux loss couples all of a micro-batch's rows
    // (its counts and router probabilities are sums over them, and every block's backward needs
    // the counts of the whole micro-batch's forward), so row chunks would change the numbers or
    // need the fused stage to run every chunk's forward before any chunk's backward
    // (docs/ROUNDPIPE.md §4.5)
    if (m->n_moe > 0 && opt->row_chunks > 1)
        return errorf(err, "row chunks: %d for a mixture-of-experts model, which computes whole "
                      "micro-batches (its aux loss couples their rows): use 1 (or more "
                      "micro-batches)", opt->row_chunks);
    e->moe_floats = m->n_moe > 0 ? m->n_moe * 2 * m->cfg.E + m->cfg.E : 0;
    e->ab = (size_t)act_bytes;
    e->quant = quant_table_count(&m->tt) > 0;
    // size-based (FLOP) cost estimates until profiled times exist
    // (per row-chunk count below: whether the MLP is chunked depends on the chunk's tokens)
    e->cost_fwd = calloc_check((size_t)e->NL, sizeof(double));
    e->cost_bwd = calloc_check((size_t)e->NL, sizeof(double));
    // Row chunks: given, or the fewest (up to 8) whose plan is within 3% of the cheapest. More
    // chunks shrink the activations and scratch, so a tight budget fits more layers into the
    // fused stage (less recompute), at the price of smaller matrix products.
    const int k_max = m->n_moe > 0 ? 1 : opt->row_chunks > 0 ? opt->row_chunks : imin(min_rows, 8);
    PartitionPlan* plans = malloc_check((size_t)k_max * sizeof(PartitionPlan));
    int* ok = calloc_check((size_t)k_max, sizeof(int));
    char first_err[ERR_LEN] = "";
    double cheapest = INFINITY;
    for (int K = opt->row_chunks > 0 ? opt->row_chunks : 1; K <= k_max; K++) {
        e->K = K;
        e->Bc = (e->Bm + K - 1) / K;
        estimate_costs(e);
        char kerr[ERR_LEN];
        ok[K - 1] = plan_partition(e, &plans[K - 1], kerr) == 0;
        // split rounds run the whole model as one stage on every device
        if (ok[K - 1] && e->split && plans[K - 1].n_fwd + plans[K - 1].n_bwd != 1) {
            ok[K - 1] = 0;
            snprintf(kerr, sizeof kerr, "split rounds need the whole model in one stage, and with "
                     "%d row chunk(s) the plan has %d stages (more device memory, or more row "
                     "chunks, may fit it)", K, plans[K - 1].n_fwd + plans[K - 1].n_bwd);
        }
        if (ok[K - 1]) cheapest = fmin(cheapest, plans[K - 1].cost);
        else if (!first_err[0]) snprintf(first_err, sizeof first_err, "%s", kerr);
    }
    int chosen = 0;
    for (int K = 1; K <= k_max && !chosen; K++)
        if (ok[K - 1] && plans[K - 1].cost <= 1.03 * cheapest) chosen = K;
    if (chosen) {
        e->K = chosen;
        e->Bc = (e->Bm + chosen - 1) / chosen;
        estimate_costs(e);
        e->plan = plans[chosen - 1];
    }
    free(plans);
    free(ok);
    if (!chosen) {
        free(e->cost_fwd);
        free(e->cost_bwd);
        return errorf(err, "%s", first_err);
    }
    return 0;
}

// An engine that holds only a plan (plan_init's cost tables, nothing else), or NULL with
// err; plan_only_free releases it.
static Engine* plan_only(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                         char* err) {
    Engine* e = calloc_check(1, sizeof(Engine));
    if (plan_init(e, m, act_bytes, n_devices, opt, err) == 0) return e;
    free(e);
    return NULL;
}

static void plan_only_free(Engine* e) {
    free(e->cost_fwd);
    free(e->cost_bwd);
    free(e);
}

int engine_plan_fits(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                     char* err) {
    return engine_plan_print(m, act_bytes, n_devices, opt, NULL, NULL, err);
}

int engine_plan_cost(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                     double* cost, char* err) {
    Engine* e = plan_only(m, act_bytes, n_devices, opt, err);
    if (!e) return -1;
    *cost = e->plan.cost;
    plan_only_free(e);
    return 0;
}

int engine_plan_memory(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                       EnginePlanMemory* out, char* err) {
    Engine* e = plan_only(m, act_bytes, n_devices, opt, err);
    if (!e) return -1;
    out->device = engine_device_bytes(e);
    out->host_checkpoints = plan_host_act_bytes(e, &e->plan);
    out->Bc = e->Bc;
    plan_only_free(e);
    return 0;
}

int engine_plan_print(const Model* m, int act_bytes, int n_devices, const EngineOptions* opt,
                      FILE* f, size_t* host_act_bytes, char* err) {
    Engine* e = plan_only(m, act_bytes, n_devices, opt, err);
    if (!e) return -1;
    if (f) engine_print_plan(e, f);
    if (host_act_bytes) *host_act_bytes = plan_host_act_bytes(e, &e->plan);
    plan_only_free(e);
    return 0;
}

size_t engine_fixed_device_bytes(const Model* m, int act_bytes, const EngineOptions* opt) {
    Engine e;
    memset(&e, 0, sizeof e);
    e.m = m;
    e.T = opt->T;
    e.C = m->cfg.C;
    e.ab = (size_t)act_bytes;
    e.M_R = opt->M_R > 0 ? opt->M_R : opt->M;
    e.Bm = opt->M > 0 ? (opt->B + opt->M - 1) / opt->M : opt->B;
    const int K = opt->row_chunks > 0 ? opt->row_chunks : 1;
    e.Bc = (e.Bm + K - 1) / K;
    return fixed_device_bytes(&e);
}

// ----------------------------------------------------------------------------
// printing and accessors

const PartitionPlan* engine_plan(const Engine* e) { return &e->plan; }

EngineDeviceBytes engine_device_bytes(const Engine* e) {
    return plan_device_bytes(e, &e->plan, NULL, NULL, NULL, NULL);
}

static void print_bytes(FILE* f, const char* what, size_t bytes) {
    char b[32];
    format_bytes((double)bytes, b, sizeof b);
    fprintf(f, "%s%s", what, b);
}

void engine_print_plan(const Engine* e, FILE* f) {
    double* fb = calloc_check((size_t)e->NL, sizeof(double));
    double* bb = calloc_check((size_t)e->NL, sizeof(double));
    double* ub = calloc_check((size_t)e->NL, sizeof(double));
    layer_bytes(e, fb, bb, ub);
    partition_print(&e->plan, &e->m->cfg, fb, bb, ub, e->N, e->M, f);
    fprintf(f, "rounds per step %d x %d micro-batches of %s%d sequences", e->R, e->M_R,
            e->opt.B % e->M ? "up to " : "", e->Bm);
    if (e->K > 1) fprintf(f, " (computed in %d row chunks of up to %d)", e->K, e->Bc);
    if (e->split) fprintf(f, ", split: the rounds at once, one per device, gradients added");
    fprintf(f, ", %s recompute, %s optimizer\n",
            e->opt.grain == RECOMPUTE_LAYER ? "layer" : "stage",
            e->opt.sync ? "synchronous" : "one-step-delayed");
    const EngineDeviceBytes db = engine_device_bytes(e);
    print_bytes(f, "device memory per device: ", db.total);
    print_bytes(f, db.slot_sets == 1 ? " = stage slots (one set) " : " = stage slots ", db.slots);
    print_bytes(f, " + saved activations ", db.acts);
    print_bytes(f, " + scratch ", db.scratch);
    print_bytes(f, " + hand-off buffers ", db.handoff);
    if (quant_table_count(&e->m->tt) > 0) {  // (--base-dtype: what the stages' uploads carry)
        const TensorTable* tt = &e->m->tt;
        double up = 0, plain = 0;
        for (int si = 0; si < e->plan.n_fwd + e->plan.n_bwd; si++) {
            SlotInfo slot;
            partition_slot(&e->plan, si, &slot);
            for (int l = slot.range.begin; l < slot.range.end; l++) {
                const double tail = (double)(tt->param_numel[l] - tt->state_numel[l]);
                up += (double)quant_layer_head_bytes(tt, l, e->ab) + (double)tt->state_numel[l] * e->ab;
                plain += (tail + (double)tt->state_numel[l]) * e->ab;
            }
        }
        print_bytes(f, "\nparameter uploads per round: ", (size_t)up);
        print_bytes(f, " (the base as ggml blocks; ", (size_t)plain);
        fprintf(f, " in the compute dtype), staging for the blocks per slot ");
        print_bytes(f, "", plan_stage_block_bytes(e, &e->plan));
    }
    print_bytes(f, "\nhost activation checkpoints: ", plan_host_act_bytes(e, &e->plan));
    fprintf(f, " (%s)\n", e->opt.host_single ? "one set" : "two sets: --host-checkpoints double");
    free(fb);
    free(bb);
    free(ub);
}

int engine_row_chunks(const Engine* e) { return e->K; }

// ----------------------------------------------------------------------------
// profiling and re-planning

// Turn the measured compute time of every stage of an iteration (averaged over micro-batches and
// rounds) into per-layer observations: a stage's time is shared among its layers in proportion to
// the costs the plan was made with (docs/ROUNDPIPE.md §2.7). Layers of the fused stage never run a
// forward stage; their forward is a third of their (fused) backward, the 1:3 rule.
void plan_profile_collect(Engine* e, int ip) {
    if (e->prof_iter[ip] < 0) return;
    e->prof_iter[ip] = -1;
    const int NL = e->NL;
    double* fwd = calloc_check((size_t)NL, sizeof(double));
    double* bwd = calloc_check((size_t)NL, sizeof(double));
    for (int si = 0; si < e->S; si++) {
        // the stage's mean micro-batch time over its compute-only brackets (all of them if none is)
        const Stage* st = &e->stages[si];
        double sum[2] = {0, 0};
        int count[2] = {0, 0};
        for (int round = 0; round < e->R; round++) {
            for (int r = 0; r < e->M_R; r++) {
                const int k = (round * e->S + si) * e->M_R + r;
                const int ok = e->prof_ok[ip][k];
                sum[ok] += e->impl->event_elapsed(e->prof_ev[ip][2 * k], e->prof_ev[ip][2 * k + 1]);
                count[ok]++;
            }
        }
        const double measured = count[1] > 0 ? sum[1] / count[1] : sum[0] / count[0];
        const double* est = st->kind == SLOT_FWD ? e->cost_fwd : e->cost_bwd;
        double* obs = st->kind == SLOT_FWD ? fwd : bwd;
        double est_sum = 0;
        for (int l = st->b; l < st->e; l++) est_sum += est[l];
        for (int l = st->b; l < st->e; l++) obs[l] += est_sum > 0 ? measured * est[l] / est_sum : 0;
    }
    for (int l = e->plan.bwd[0].begin; l < NL; l++) fwd[l] = bwd[l] / 3.0;
    cost_profile_update(&e->profile, fwd, bwd);
    free(fwd);
    free(bwd);
}

static int plans_equal(const PartitionPlan* a, const PartitionPlan* b) {
    if (a->n_fwd != b->n_fwd || a->n_bwd != b->n_bwd) return 0;
    for (int i = 0; i < a->n_fwd; i++)
        if (a->fwd[i].begin != b->fwd[i].begin || a->fwd[i].end != b->fwd[i].end) return 0;
    for (int i = 0; i < a->n_bwd; i++)
        if (a->bwd[i].begin != b->bwd[i].begin || a->bwd[i].end != b->bwd[i].end) return 0;
    return 1;
}

// After replan_after profiled iterations: plan again with the measured costs, and freeze the plan
// (docs/ROUNDPIPE.md §2.7: profile, then freeze). engine.c rebuilds the buffers when it changed.
int plan_replan(Engine* e, PartitionPlan* plan) {
    // (split rounds keep their one-stage plan)
    if (e->frozen || e->split || e->opt.replan_after <= 0 || e->profile.n_obs < e->opt.replan_after)
        return 0;
    e->frozen = 1;
    int changed = 0;
    double* fwd = calloc_check((size_t)e->NL, sizeof(double));
    double* bwd = calloc_check((size_t)e->NL, sizeof(double));
    if (cost_profile_get(&e->profile, fwd, bwd) == 0) {
        memcpy(e->cost_fwd, fwd, (size_t)e->NL * sizeof(double));
        memcpy(e->cost_bwd, bwd, (size_t)e->NL * sizeof(double));
        char err[ERR_LEN];
        changed = plan_partition(e, plan, err) == 0 && !plans_equal(plan, &e->plan);
    }
    free(fwd);
    free(bwd);
    return changed;
}

int engine_replans(const Engine* e) { return e->replans; }

// ----------------------------------------------------------------------------
// the run's plan policy: what a caller decides with the engine's own accounting before it
// creates one (the CLI maps its flags to EngineOptions and calls these)

EngineHostMemory engine_host_memory(const Model* m, int act_bytes, int n_devices,
                                    const EngineOptions* opt) {
    const TensorTable* tt = &m->tt;
    // elements of the slabs' trainable tails (everything for full training, LoRA's adapters),
    // their frozen heads (LoRA's base) and the gradient slabs
    double tails = 0.0, frozen = 0.0, grads = 0.0;
    int frozen_layers = 0;
    for (int l = 0; l < tt->n_layers; l++) {
        tails += (double)tt->state_numel[l];
        frozen += (double)(tt->param_numel[l] - tt->state_numel[l]);
        frozen_layers += tt->param_numel[l] > tt->state_numel[l];
        grads += (double)tt->grad_numel[l];
    }
    EngineHostMemory h;
    h.store = store_bytes(tt);
    // master[2] of the trainable tails, and one copy of the frozen base for both (engine_create):
    // fp32 devices read the Store's own slabs, bf16 devices a bf16 copy
    h.masters = 2.0 * (act_bytes * tails + 64.0 * tt->n_layers);
    // (a quantised base, quant.h: its tensors as blocks, the rest in the compute dtype, on fp32
    // devices too)
    h.base = quant_table_count(tt) > 0 ? quant_head_bytes(tt, (size_t)act_bytes) + 64.0 * frozen_layers
             : act_bytes == (int)sizeof(float) ? 0.0
                                               : act_bytes * frozen + 64.0 * frozen_layers;
    h.masters += h.base;
    h.store_frozen = store_frozen_bytes(tt);
    h.grads = plan_host_grad_sets(opt) > 1 ? 4.0 * grads : 0.0;  // hgrad[1] (engine_create)
    h.split_extra = n_devices > 1 ? (n_devices - 1) * 4.0 * grads : 0.0;  // hsplit: R - 1 = N - 1
    // hids, htgt, hloss: two iteration parities of every micro-batch's tokens, targets, losses
    const int M = opt->M > 0 ? opt->M : 1;
    h.staging = 2.0 * M * (double)((opt->B + M - 1) / M) * opt->T *
                (2 * sizeof(int32_t) + sizeof(float) + (opt->policy ? 5 * sizeof(float) : 0));
    h.fixed = h.store;
    h.fixed += h.masters + h.grads + h.staging;
    if (opt->split_rounds) h.fixed += h.split_extra;
    // plan_host_act_bytes counts at most L + 1 x boundaries (every one a stage may begin at but
    // the prefix's) plus the two dx ring slots, per sequence of the batch
    h.checkpoints_max = (double)plan_host_act_sets(opt) * (double)opt->B * opt->T * m->cfg.C *
                        (double)act_bytes * (m->cfg.L + 3);
    return h;
}

// The share of a GPU's free memory the engine takes by default: the rest goes to allocator
// rounding, cuBLAS and CUDA internals.
#define DEVICE_BUDGET_SHARE 0.9

double engine_default_device_budget(double device_free_bytes) {
    return DEVICE_BUDGET_SHARE * device_free_bytes;
}

// --mlp-chunk auto: chunk the MLP in 16384 rows when micro-batches hold more than 65,536 tokens
// (long sequences: the MLP's activations would dominate device and host memory, and its
// recompute is small next to the attention) or when no engine plan fits without.
int engine_resolve_mlp_chunk(Model* m, int requested, int act_bytes, int n_devices,
                             const EngineOptions* opt) {
    if (requested >= 0) return m->mlp_chunk = requested;
    char err[ERR_LEN];
    const int rows = 16384;
    const int Bm = (opt->B + opt->M - 1) / opt->M;
    const int64_t tokens = (int64_t)Bm * opt->T;
    m->mlp_chunk = 0;
    if (tokens <= rows) return 0;  // micro-batches too small for chunks to matter
    // Up to 64K tokens per micro-batch chunks only where they make the plan cheaper (less
    // recompute: the activations they save let more layers into the fused stage) or where no plan
    // fits without them; beyond, always.
    double plain_cost = 0.0, chunked_cost = 0.0;
    const int plain_fits =
        tokens <= 65536 && engine_plan_cost(m, act_bytes, n_devices, opt, &plain_cost, err) == 0;
    m->mlp_chunk = rows;
    if (plain_fits && (engine_plan_cost(m, act_bytes, n_devices, opt, &chunked_cost, err) != 0 ||
                       chunked_cost >= 0.99 * plain_cost)) {
        m->mlp_chunk = 0;
        return 0;
    }
    printf("note: --mlp-chunk auto: the MLP runs in chunks of %d rows (%s)\n", rows,
           tokens > 65536 ? "long micro-batches"
           : plain_fits   ? "a cheaper plan: less recompute"
                          : "no plan fits without");
    return rows;
}

// --split-rounds auto: split each iteration into one round per GPU when that is possible and the
// host has room for the extra gradient sets. On two H200s it measured 24,338 vs 23,383 tok/s
// (LLaMA-3.1-8B) and 90,006 vs 88,519 (Qwen3-1.7B): the optimizer step of an iteration overlaps
// the next one instead of stalling the GPU whose turn comes next.
int engine_resolve_split_rounds(const Model* m, int requested, int gpus, int act_bytes,
                                int n_devices, const EngineOptions* opt, double host_total) {
    if (requested >= 0) return requested;
    if (!gpus || n_devices < 2 || opt->M % n_devices != 0 || opt->M_R > 0) return 0;
    EngineOptions split = *opt;
    split.split_rounds = 1;
    char err[ERR_LEN];
    size_t host_acts = 0;  // the split plan's host activation checkpoints
    if (engine_plan_print(m, act_bytes, n_devices, &split, NULL, &host_acts, err) != 0)
        return 0;  // no one-stage plan
    // the weights, optimizer state and gradients without the split, and what the split adds
    EngineOptions whole = *opt;
    whole.split_rounds = 0;
    const EngineHostMemory h = engine_host_memory(m, act_bytes, n_devices, &whole);
    if (host_total > 0 && h.fixed + (double)host_acts + h.split_extra > 0.9 * host_total) {
        printf("note: --split-rounds auto: not splitting rounds (the extra %.1f GiB of gradients "
               "would not fit in host memory)\n", h.split_extra / (1 << 30));
        return 0;
    }
    printf("note: --split-rounds auto: each iteration runs as %d rounds at once, one per GPU "
           "(--no-split-rounds for the paper's schedule)\n", n_devices);
    return 1;
}
