/*
 * partition.c — the RoundPipe planner (docs/ROUNDPIPE.md §2.4): candidate t values, the greedy
 * fewest-stages scan per candidate, the exhaustive reference search, plan validation, cost
 * estimates and profiles, the slot schedule and the --plan printout. See partition.h for the plan
 * layout and the objective.
 *
 * Stage times and bytes are always summed in ascending layer order (range_sum), both here and in
 * the brute force, so two plans with the same ranges get bit-identical costs. The greedy scans sum
 * in other orders, so their "fits in t" test has a relative slack of PARTITION_TIME_SLACK: the
 * optimum's t_max is a candidate computed one way and re-summed another way by the scans.
 */
#include "partition.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define PARTITION_TIME_SLACK 1e-10  // relative; far above the rounding of ~1000 summands
#define PARTITION_PRUNE_SLACK 1e-9  // lower bounds must beat the best cost by this to prune

// ----------------------------------------------------------------------------
// small helpers

static double range_sum(const double* a, StageRange r) {
    double s = 0.0;
    for (int l = r.begin; l < r.end; l++) s += a[l];
    return s;
}

static int time_fits(double x, double t) { return x <= t + PARTITION_TIME_SLACK * t; }

static double partition_objective(const PartitionInput* in, int S, double t) {
    if (in->async) {
        // N x the iteration period: the devices' work S t spread over N, or, when that would
        // need more than the two iterations the delayed update lets overlap, half the span of
        // one iteration (its min(S, N) pipelined stages over M micro-batches)
        const double span = 1.0 + (double)(imin(S, in->N) - 1) / in->M;
        return fmax((double)S, 0.5 * in->N * span) * t;
    }
    return ((double)in->M * S + (double)in->N * (in->N - 1)) * t;
}

// One device runs its stages back to back: no slot is idle whatever the balance, so the cost is
// the work itself, which depends only on where the fused stage begins (every layer's backward and
// the forward of the layers before it), not on the stage split; the S x t_max slot model above
// would trade recompute for balance that buys nothing there.
static int work_objective(const PartitionInput* in) { return in->N == 1; }

static double plan_work(const PartitionInput* in, int e) {
    double w = range_sum(in->fwd_cost, (StageRange){0, e}) +
               range_sum(in->bwd_cost, (StageRange){0, in->n_layers});
    return in->async ? w : in->M * w;
}

// A lower bound on the cost of any plan that extends a partial one with S stages so far, the
// largest taking tau (0 under the work objective, which partial plans do not bound).
static double partial_bound(const PartitionInput* in, int S, double tau) {
    return work_objective(in) ? 0.0 : partition_objective(in, S, tau);
}

// Ties on cost go to fewer stages, then to the smaller t_max.
static int plan_better(double cost, int S, double t, const PartitionPlan* best, int have_best) {
    if (!have_best) return 1;
    int best_S = best->n_fwd + best->n_bwd;
    if (cost != best->cost) return cost < best->cost;
    if (S != best_S) return S < best_S;
    return t < best->t_max;
}

// "embed", "head" or "block i" (0-based block index, as in HF weight names).
static void layer_name(int l, int n_layers, char* buf, size_t cap) {
    if (l == n_layers - 1) snprintf(buf, cap, "head");
    else if (l == 0) snprintf(buf, cap, "embed");
    else snprintf(buf, cap, "block %d", l - 1);
}

static int validate_array(const double* a, int n, const char* what, char* err) {
    if (a == NULL) return errorf(err, "partition: %s is missing", what);
    for (int l = 0; l < n; l++)
        if (!isfinite(a[l]) || a[l] < 0.0)
            return errorf(err, "partition: %s[%d] = %g is not a finite non-negative number", what,
                          l, a[l]);
    return 0;
}

// the bytes of a layer in the fused stage
static const double* fused_bytes_of(const PartitionInput* in) {
    return in->fused_bytes ? in->fused_bytes : in->bwd_bytes;
}

static int validate_input(const PartitionInput* in, char* err) {
    if (in->n_layers < 1 || in->n_layers > PARTITION_MAX_LAYERS)
        return errorf(err, "partition: n_layers %d outside [1, %d]", in->n_layers,
                      PARTITION_MAX_LAYERS);
    if (in->N < 1) return errorf(err, "partition: N = %d devices, need at least 1", in->N);
    if (in->M < 1) return errorf(err, "partition: M = %d micro-batches, need at least 1", in->M);
    if (!isfinite(in->budget) || in->budget <= 0.0)
        return errorf(err, "partition: per-stage budget %g bytes is not a positive number",
                      in->budget);
    if (validate_array(in->fwd_cost, in->n_layers, "fwd_cost", err) ||
        validate_array(in->bwd_cost, in->n_layers, "bwd_cost", err) ||
        validate_array(in->fwd_bytes, in->n_layers, "fwd_bytes", err) ||
        validate_array(in->bwd_bytes, in->n_layers, "bwd_bytes", err) ||
        (in->fused_bytes && validate_array(in->fused_bytes, in->n_layers, "fused_bytes", err)))
        return -1;
    return 0;
}

// Why no plan fits (only bytes can make every candidate fail: the largest t admits any split).
// A backward stage must hold every layer once; a forward stage every layer the largest fused
// stage that fits cannot absorb.
static int explain_infeasible(const PartitionInput* in, char* err) {
    const int n = in->n_layers;
    const double* fused = fused_bytes_of(in);
    char name[32];
    if (fused[n - 1] > in->budget) {
        layer_name(n - 1, n, name, sizeof name);
        return errorf(err,
                      "partition: layer %d (%s) needs %.0f bytes in the fused stage, over the "
                      "per-stage budget of %.0f bytes",
                      n - 1, name, fused[n - 1], in->budget);
    }
    for (int l = 0; l < n - 1; l++) {
        if (in->bwd_bytes[l] > in->budget) {
            layer_name(l, n, name, sizeof name);
            return errorf(err,
                          "partition: layer %d (%s) needs %.0f bytes in a backward stage, over "
                          "the per-stage budget of %.0f bytes",
                          l, name, in->bwd_bytes[l], in->budget);
        }
    }
    int e = n;
    double mm = 0.0;
    while (e > 0 && mm + fused[e - 1] <= in->budget) mm += fused[--e];
    for (int l = 0; l < e; l++) {
        if (in->fwd_bytes[l] > in->budget) {
            layer_name(l, n, name, sizeof name);
            return errorf(err,
                          "partition: layer %d (%s) needs %.0f bytes in a forward stage, over "
                          "the per-stage budget of %.0f bytes",
                          l, name, in->fwd_bytes[l], in->budget);
        }
    }
    return errorf(err, "partition: no plan fits the per-stage budget of %.0f bytes", in->budget);
}

static void reverse_ranges(StageRange* r, int n) {
    for (int i = 0, j = n - 1; i < j; i++, j--) {
        StageRange tmp = r[i];
        r[i] = r[j];
        r[j] = tmp;
    }
}

// ----------------------------------------------------------------------------
// evaluation and validation

void partition_evaluate(const PartitionInput* in, PartitionPlan* p) {
    double t = 0.0;
    for (int i = 0; i < p->n_fwd; i++) {
        p->fwd_time[i] = range_sum(in->fwd_cost, p->fwd[i]);
        if (p->fwd_time[i] > t) t = p->fwd_time[i];
    }
    for (int i = 0; i < p->n_bwd; i++) {
        p->bwd_time[i] = range_sum(in->bwd_cost, p->bwd[i]);
        if (p->bwd_time[i] > t) t = p->bwd_time[i];
    }
    int S = p->n_fwd + p->n_bwd;
    double fill = (double)in->N * (in->N - 1);
    p->t_max = t;
    if (work_objective(in)) {
        p->cost = plan_work(in, p->bwd[0].begin);
        p->bubble = 0.0;
        return;
    }
    p->cost = partition_objective(in, S, t);
    // sync: the paper's structural bubble; async: the devices' idle share of N periods
    // (cost = N x period) with every stage taking t_max (imbalance shows in the balance figure)
    p->bubble = in->async ? (p->cost > 0 ? 1.0 - (double)S * t / p->cost : 0.0)
                          : fill / ((double)in->M * S + fill);
}

int partition_check(const PartitionPlan* p, int n_layers, char* err) {
    if (n_layers < 1 || n_layers > PARTITION_MAX_LAYERS)
        return errorf(err, "plan: n_layers %d outside [1, %d]", n_layers, PARTITION_MAX_LAYERS);
    if (p->n_layers != n_layers)
        return errorf(err, "plan: made for %d layers, the model has %d", p->n_layers, n_layers);
    if (p->n_fwd < 0 || p->n_fwd > n_layers - 1 || p->n_fwd > PARTITION_MAX_STAGES)
        return errorf(err, "plan: %d forward stages for %d layers", p->n_fwd, n_layers);
    if (p->n_bwd < 1 || p->n_bwd > n_layers || p->n_bwd > PARTITION_MAX_STAGES)
        return errorf(err, "plan: %d backward stages for %d layers", p->n_bwd, n_layers);
    // forward: contiguous, ascending, non-empty, from 0 to e
    int e = 0;
    for (int i = 0; i < p->n_fwd; i++) {
        if (p->fwd[i].begin != e || p->fwd[i].end <= p->fwd[i].begin)
            return errorf(err, "plan: forward stage %d = [%d, %d) does not continue at %d", i + 1,
                          p->fwd[i].begin, p->fwd[i].end, e);
        e = p->fwd[i].end;
    }
    // fused: [e, n_layers), non-empty (it holds at least the postfix)
    if (p->bwd[0].begin != e || p->bwd[0].end != n_layers || e >= n_layers)
        return errorf(err, "plan: fused stage [%d, %d) is not [%d, %d) with the postfix",
                      p->bwd[0].begin, p->bwd[0].end, e, n_layers);
    // backward: deepest first, contiguous, non-empty, down to 0
    int end = e;
    for (int i = 1; i < p->n_bwd; i++) {
        if (p->bwd[i].end != end || p->bwd[i].begin >= p->bwd[i].end || p->bwd[i].begin < 0)
            return errorf(err, "plan: backward stage %d = [%d, %d) does not end at %d", i + 1,
                          p->bwd[i].begin, p->bwd[i].end, end);
        end = p->bwd[i].begin;
    }
    if (end != 0)
        return errorf(err, "plan: backward stages stop at layer %d instead of 0", end);
    return 0;
}

// ----------------------------------------------------------------------------
// the paper's search

// The fewest-stages plan whose stages all take <= t (with slack) and fit the budget, written into
// p (ranges only). Returns 0 when t admits no plan, or when a partial plan already costs more
// than best_cost (monotone lower bound: stages so far, their largest time).
static int plan_for_t(const PartitionInput* in, double t, double best_cost, PartitionPlan* p) {
    const int n = in->n_layers;
    const double* fc = in->fwd_cost;
    const double* bc = in->bwd_cost;
    const double* fb = in->fwd_bytes;
    const double* bb = in->bwd_bytes;
    const double* ub = fused_bytes_of(in);
    const double prune = best_cost + PARTITION_PRUNE_SLACK * best_cost;

    // 1. the fused stage, grown from the deepest layer as far as it goes: the fewer layers
    //    [0, e) leaves, the fewer stages the two other partitions need.
    int e = n;
    double tt = 0.0, mm = 0.0;
    while (e > 0 && time_fits(tt + bc[e - 1], t) && mm + ub[e - 1] <= in->budget) {
        e--;
        tt += bc[e];
        mm += ub[e];
    }
    if (e == n) return 0;
    double tau = tt;
    int S = 1;

    // 2. forward stages over [0, e), packed from e-1 downward so the remainder lands at layer 0
    //    (the embedding stage is the cheap one).
    int nf = 0;
    for (int j = e; j > 0;) {
        int end = j;
        tt = mm = 0.0;
        while (j > 0 && time_fits(tt + fc[j - 1], t) && mm + fb[j - 1] <= in->budget) {
            j--;
            tt += fc[j];
            mm += fb[j];
        }
        if (j == end) return 0;  // layer j-1 alone exceeds t or the budget
        p->fwd[nf++] = (StageRange){j, end};
        S++;
        if (tt > tau) tau = tt;
        if (partial_bound(in, S, tau) > prune) return 0;
    }
    reverse_ranges(p->fwd, nf);

    // 3. backward stages over [0, e), packed from 0 upward (remainder at the deep end), then
    //    listed deepest first after the fused stage.
    int nb = 1;
    p->bwd[0] = (StageRange){e, n};
    for (int j = 0; j < e;) {
        int begin = j;
        tt = mm = 0.0;
        while (j < e && time_fits(tt + bc[j], t) && mm + bb[j] <= in->budget) {
            tt += bc[j];
            mm += bb[j];
            j++;
        }
        if (j == begin) return 0;
        p->bwd[nb++] = (StageRange){begin, j};
        S++;
        if (tt > tau) tau = tt;
        if (partial_bound(in, S, tau) > prune) return 0;
    }
    reverse_ranges(p->bwd + 1, nb - 1);
    p->n_layers = n;
    p->n_fwd = nf;
    p->n_bwd = nb;
    return 1;
}

static int compare_double(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

// Every contiguous sum of the costs that can be a stage time and is not below t_lo, sorted and
// deduplicated. Forward sums stop before the postfix, which never runs in a forward stage.
// Sums run in ascending layer order, like range_sum, so each equals some stage's exact time.
static double* collect_candidates(const PartitionInput* in, double t_lo, int* count) {
    const int n = in->n_layers;
    size_t cap = (size_t)n * (size_t)(n + 1);  // n <= PARTITION_MAX_LAYERS: no overflow
    double* c = malloc_check(cap * sizeof(double));
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        double sf = 0.0, sb = 0.0;
        for (int j = i; j < n; j++) {
            sb += in->bwd_cost[j];
            if (sb >= t_lo) c[k++] = sb;
            if (j < n - 1) {
                sf += in->fwd_cost[j];
                if (sf >= t_lo) c[k++] = sf;
            }
        }
    }
    qsort(c, k, sizeof(double), compare_double);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (u == 0 || c[i] != c[u - 1]) c[u++] = c[i];
    *count = (int)u;
    return c;
}

int partition_plan(const PartitionInput* in, PartitionPlan* out, char* err) {
    if (validate_input(in, err)) return -1;
    const int n = in->n_layers;
    // Every layer sits in exactly one stage of the backward partition (the fused one included),
    // so no t below the largest bwd_cost admits a plan; and n_bwd >= b_total / t_max.
    double t_lo = 0.0, b_total = 0.0;
    for (int l = 0; l < n; l++) {
        if (in->bwd_cost[l] > t_lo) t_lo = in->bwd_cost[l];
        b_total += in->bwd_cost[l];
    }
    int n_cand = 0;
    double* cand = collect_candidates(in, t_lo, &n_cand);
    const double fill = (double)in->N * (in->N - 1);

    // Two plans on the heap: each is ~32 KiB, and the caller's stack already holds one.
    PartitionPlan* trial = malloc_check(sizeof(PartitionPlan));
    PartitionPlan* best = malloc_check(sizeof(PartitionPlan));
    int have_best = 0;
    for (int i = 0; i < n_cand; i++) {
        double t = cand[i];
        double best_cost = have_best ? best->cost : INFINITY;
        double prune = best_cost + PARTITION_PRUNE_SLACK * best_cost;
        // Any plan with t_max >= t costs at least this, and t only grows: stop.
        double lb_mono = work_objective(in) ? (in->async ? b_total : in->M * b_total)
                         : in->async ? fmax(b_total, 0.5 * in->N * t)
                                     : fmax(in->M * b_total + fill * t, (in->M + fill) * t);
        if (lb_mono > prune) break;
        // A plan with t_max == t needs n_bwd >= b_total / t stages; if even that is too dear,
        // this candidate cannot be the optimum's t_max (smaller-t plans were found earlier).
        double nb_lb = t > 0.0 ? ceil(b_total / t * (1.0 - PARTITION_PRUNE_SLACK)) : 1.0;
        if (nb_lb < 1.0) nb_lb = 1.0;
        double lb_t = partial_bound(in, (int)fmin(nb_lb, 1e9), t);  // monotone in S
        if (lb_t > prune) continue;
        if (!plan_for_t(in, t, best_cost, trial)) continue;
        partition_evaluate(in, trial);
        if (plan_better(trial->cost, trial->n_fwd + trial->n_bwd, trial->t_max, best, have_best)) {
            PartitionPlan* tmp = best;
            best = trial;
            trial = tmp;
            have_best = 1;
        }
    }
    free(cand);
    int rc = 0;
    if (have_best) memcpy(out, best, sizeof *out);
    else rc = explain_infeasible(in, err);
    free(trial);
    free(best);
    return rc;
}

// ----------------------------------------------------------------------------
// exhaustive reference search (tests)

// All ways to split [0, e) into stages: bit i of mask cuts between layers i and i+1.
static int split_ranges(int e, unsigned mask, StageRange* r) {
    int k = 0, begin = 0;
    for (int i = 0; i < e; i++) {
        if (i == e - 1 || (mask >> i & 1u)) {
            r[k++] = (StageRange){begin, i + 1};
            begin = i + 1;
        }
    }
    return k;
}

typedef struct SplitStats {
    int feasible;
    int count;
    double t_max;
} SplitStats;

static SplitStats split_stats(int e, unsigned mask, const double* cost, const double* bytes,
                              double budget) {
    StageRange r[PARTITION_BRUTE_MAX_LAYERS];
    SplitStats s = {1, split_ranges(e, mask, r), 0.0};
    for (int i = 0; i < s.count; i++) {
        if (range_sum(bytes, r[i]) > budget) s.feasible = 0;
        double t = range_sum(cost, r[i]);
        if (t > s.t_max) s.t_max = t;
    }
    return s;
}

int partition_brute_force(const PartitionInput* in, PartitionPlan* out, char* err) {
    const int n = in->n_layers;
    if (n > PARTITION_BRUTE_MAX_LAYERS)
        return errorf(err, "partition: brute force takes at most %d layers, got %d",
                      PARTITION_BRUTE_MAX_LAYERS, n);
    if (validate_input(in, err)) return -1;
    PartitionPlan* best = malloc_check(sizeof(PartitionPlan));
    int have_best = 0;
    enum { MAX_MASKS = 1 << (PARTITION_BRUTE_MAX_LAYERS - 2) };
    SplitStats fs[MAX_MASKS], bs[MAX_MASKS];
    for (int e = 0; e < n; e++) {
        StageRange fused = {e, n};
        if (range_sum(fused_bytes_of(in), fused) > in->budget) continue;
        double t_fused = range_sum(in->bwd_cost, fused);
        unsigned n_masks = e > 0 ? 1u << (e - 1) : 1u;
        for (unsigned m = 0; m < n_masks; m++) {
            if (e > 0) {
                fs[m] = split_stats(e, m, in->fwd_cost, in->fwd_bytes, in->budget);
                bs[m] = split_stats(e, m, in->bwd_cost, in->bwd_bytes, in->budget);
            } else {
                fs[m] = bs[m] = (SplitStats){1, 0, 0.0};
            }
        }
        for (unsigned fm = 0; fm < n_masks; fm++) {
            if (!fs[fm].feasible) continue;
            for (unsigned bm = 0; bm < n_masks; bm++) {
                if (!bs[bm].feasible) continue;
                int S = fs[fm].count + 1 + bs[bm].count;
                double t = fmax(t_fused, fmax(fs[fm].t_max, bs[bm].t_max));
                double cost = work_objective(in) ? plan_work(in, e) : partition_objective(in, S, t);
                if (!plan_better(cost, S, t, best, have_best)) continue;
                best->n_layers = n;
                best->n_fwd = e > 0 ? split_ranges(e, fm, best->fwd) : 0;
                best->bwd[0] = fused;
                best->n_bwd = 1 + (e > 0 ? split_ranges(e, bm, best->bwd + 1) : 0);
                reverse_ranges(best->bwd + 1, best->n_bwd - 1);
                partition_evaluate(in, best);
                have_best = 1;
            }
        }
    }
    int rc = 0;
    if (have_best) memcpy(out, best, sizeof *out);
    else rc = explain_infeasible(in, err);
    free(best);
    return rc;
}

// ----------------------------------------------------------------------------
// cost estimates (docs/ROUNDPIPE.md §2.3)

static int layer_is_moe(const ModelConfig* cfg, int block) {
    if (cfg->E <= 0 || cfg->K <= 0 || cfg->F_expert <= 0) return 0;
    if (cfg->family == FAMILY_QWEN3MOE && cfg->decoder_sparse_step > 1)
        return (block + 1) % cfg->decoder_sparse_step == 0;
    return 1;
}

void partition_estimate_costs(const ModelConfig* cfg, int T, int tokens_per_microbatch,
                              int mlp_chunked, double* fwd_cost, double* bwd_cost) {
    partition_estimate_costs_lora(cfg, NULL, T, tokens_per_microbatch, mlp_chunked, fwd_cost,
                                  bwd_cost);
}

void partition_estimate_costs_lora(const ModelConfig* cfg, const LoraSpec* lora, int T,
                                   int tokens_per_microbatch, int mlp_chunked, double* fwd_cost,
                                   double* bwd_cost) {
    const int frozen = lora && lora->r > 0;
    const double tok = tokens_per_microbatch, C = cfg->C, HHD = (double)cfg->H * cfg->HD;
    const double attn_proj = C * (cfg->H + 2.0 * cfg->KVH) * cfg->HD + HHD * C;
    const int n = cfg->L + 2;
    // prefix: a gather, memory bound; a trifle so it never looks free
    fwd_cost[0] = C * tok;
    bwd_cost[0] = 3.0 * fwd_cost[0];
    for (int b = 0; b < cfg->L; b++) {
        // active matmul parameters: the k routed experts plus the router for MoE layers
        double mlp = layer_is_moe(cfg, b)
                         ? 3.0 * C * cfg->F_expert * cfg->K + C * cfg->E
                         : 3.0 * C * cfg->F;
        // causal attention sees T/2 keys on average; GPT-OSS even layers a window of W
        double keys = T / 2.0;
        if (cfg->family == FAMILY_GPTOSS && cfg->sliding_window > 0 && b % 2 == 0)
            keys = fmin(keys, (double)cfg->sliding_window);
        const double mm = 2.0 * (attn_proj + mlp) * tok, att = 4.0 * keys * HHD * tok;
        fwd_cost[1 + b] = mm + att;
        bwd_cost[1 + b] = 3.0 * fwd_cost[1 + b];  // recompute (1x) + backward (2x)
        if (mlp_chunked) bwd_cost[1 + b] += 2.0 * (mlp + attn_proj) * tok;
        if (!frozen) continue;
        // LoRA: the base's matmuls need their input gradient only; the adapters' products
        double ad_fwd = 0.0, ad_bwd = 0.0;
        for (int tg = 0; tg < LORA_N_TARGETS; tg++) {
            if (!(lora->targets & LORA_BIT(tg))) continue;
            // (MoE blocks: no dense MLP, a router and experts; dense blocks: neither)
            const int expert = lora_target_is_expert((LoraTarget)tg);
            if ((tg == LORA_ROUTER || expert) != layer_is_moe(cfg, b) && tg >= LORA_GATE) continue;
            int64_t in, out;
            lora_target_dims(cfg, (LoraTarget)tg, &in, &out);
            // the experts' adapters run on the K routed copies of each row, at their rank
            const double rows = expert ? (double)cfg->K * tok : tok;
            const double r = lora_target_rank(cfg, lora, (LoraTarget)tg);
            ad_fwd += 2.0 * r * (double)(in + out) * rows;
            ad_bwd += 2.0 * r * (double)(3 * in + 2 * out) * rows;
        }
        fwd_cost[1 + b] += ad_fwd;
        bwd_cost[1 + b] = fwd_cost[1 + b] + mm + 2.0 * att + ad_bwd;
        if (mlp_chunked) bwd_cost[1 + b] += 2.0 * (mlp + attn_proj) * tok;
    }
    // postfix: LM head; in the fused stage its forward is not repeated, backward is 2x (LoRA's
    // frozen head: the input gradient only, 1x)
    fwd_cost[n - 1] = 2.0 * (double)cfg->V * C * tok;
    bwd_cost[n - 1] = (frozen ? 2.0 : 3.0) * fwd_cost[n - 1];
    if (frozen) bwd_cost[0] = fwd_cost[0];  // a frozen embedding: nothing but the gather
}

// ----------------------------------------------------------------------------
// profiled costs (docs/ROUNDPIPE.md §2.7)

void cost_profile_init(CostProfile* p, int n_layers) {
    p->n_layers = n_layers;
    p->fwd = calloc_check((size_t)n_layers, sizeof(double));
    p->bwd = calloc_check((size_t)n_layers, sizeof(double));
    p->n_obs = 0;
}

void cost_profile_free(CostProfile* p) {
    free(p->fwd);
    free(p->bwd);
    p->fwd = p->bwd = NULL;
    p->n_obs = 0;
}

void cost_profile_update(CostProfile* p, const double* fwd_obs, const double* bwd_obs) {
    p->n_obs++;
    if (p->n_obs == 1) return;  // cold start: allocator warm-up, cuBLAS heuristics, page faults
    for (int l = 0; l < p->n_layers; l++) {
        p->fwd[l] = 0.9 * p->fwd[l] + 0.1 * fwd_obs[l];
        p->bwd[l] = 0.9 * p->bwd[l] + 0.1 * bwd_obs[l];
    }
}

int cost_profile_get(const CostProfile* p, double* fwd, double* bwd) {
    int k = p->n_obs - 1;
    if (k < 1) return -1;
    // the EMA started from 0 carries weight 1 - 0.9^k in total: divide it back out
    double corr = 1.0 - pow(0.9, k);
    for (int l = 0; l < p->n_layers; l++) {
        fwd[l] = p->fwd[l] / corr;
        bwd[l] = p->bwd[l] / corr;
    }
    return 0;
}

// ----------------------------------------------------------------------------
// schedule

int partition_slot(const PartitionPlan* p, int i, SlotInfo* out) {
    if (i < 0 || i >= p->n_fwd + p->n_bwd) return -1;
    if (i < p->n_fwd) {
        *out = (SlotInfo){SLOT_FWD, i, p->fwd[i]};
    } else {
        int j = i - p->n_fwd;
        *out = (SlotInfo){j == 0 ? SLOT_FUSED : SLOT_BWD, j, p->bwd[j]};
    }
    return 0;
}

int schedule_slot_device(int64_t global_slot, int g0, int N) {
    int64_t d = ((int64_t)g0 % N + global_slot % N) % N;
    return (int)(d < 0 ? d + N : d);
}

// ----------------------------------------------------------------------------
// printing

static void range_name(StageRange r, int n_layers, char* buf, size_t cap) {
    buf[0] = '\0';
    size_t len = 0;
    int first_block = imax(r.begin, 1), last_block = imin(r.end, n_layers - 1) - 1;
    if (r.begin == 0 && n_layers > 1)
        len += (size_t)snprintf(buf + len, cap - len, "embed");
    if (first_block <= last_block && len < cap) {
        const char* sep = len ? " + " : "";
        if (first_block == last_block)
            len += (size_t)snprintf(buf + len, cap - len, "%sblock %d", sep, first_block - 1);
        else
            len += (size_t)snprintf(buf + len, cap - len, "%sblocks %d-%d", sep, first_block - 1,
                                    last_block - 1);
    }
    if (r.end == n_layers && len < cap) snprintf(buf + len, cap - len, "%shead", len ? " + " : "");
}


void partition_print(const PartitionPlan* p, const ModelConfig* cfg, const double* fwd_bytes,
                     const double* bwd_bytes, const double* fused_bytes, int N, int M, FILE* f) {
    if (!fused_bytes) fused_bytes = bwd_bytes;
    const int S = p->n_fwd + p->n_bwd;
    const int have_bytes = fwd_bytes != NULL && bwd_bytes != NULL;
    fprintf(f, "plan%s%s: %d layer entries, N %d devices, M %d micro-batches\n",
            cfg ? " for " : "", cfg ? cfg->name : "", p->n_layers, N, M);
    double* slot_bytes = calloc_check((size_t)imax(S, 1), sizeof(double));
    double busy = 0.0;
    for (int i = 0; i < S; i++) {
        SlotInfo s = {SLOT_FWD, 0, {0, 0}};
        partition_slot(p, i, &s);  // 0 <= i < S: always fills s
        char label[16], names[96], bytes[32] = "";
        if (s.kind == SLOT_FWD) snprintf(label, sizeof label, "F%d", s.stage + 1);
        else if (s.kind == SLOT_FUSED) snprintf(label, sizeof label, "FB");
        else snprintf(label, sizeof label, "B%d", s.stage + 1);
        range_name(s.range, p->n_layers, names, sizeof names);
        double t = s.kind == SLOT_FWD ? p->fwd_time[s.stage] : p->bwd_time[s.stage];
        busy += t;
        if (have_bytes) {
            slot_bytes[i] = range_sum(s.kind == SLOT_FWD     ? fwd_bytes
                                      : s.kind == SLOT_FUSED ? fused_bytes
                                                             : bwd_bytes,
                                      s.range);
            format_bytes(slot_bytes[i], bytes, sizeof bytes);
        }
        fprintf(f, "  %-4s %-28s time %.4g (%5.1f%% of t_max)%s%s\n", label, names, t,
                p->t_max > 0 ? 100.0 * t / p->t_max : 100.0, have_bytes ? "  bytes " : "",
                bytes);
    }
    // balance: the share of the S*t_max slot time that stages actually compute
    fprintf(f, "  S_f %d, S_b %d, S %d; bubble %.2f%%, t_max %.4g, balance %.1f%%\n", p->n_fwd,
            p->n_bwd, S, 100.0 * p->bubble, p->t_max,
            p->t_max > 0 ? 100.0 * busy / (S * p->t_max) : 100.0);
    if (have_bytes && S > 0) {
        // A device runs slot i and, prefetched, the slot N later (the sequence repeats every S).
        double peak = 0.0, largest = 0.0;
        for (int i = 0; i < S; i++) {
            peak = fmax(peak, slot_bytes[i] + slot_bytes[(i + N) % S]);
            largest = fmax(largest, slot_bytes[i]);
        }
        char a[32], b[32];
        format_bytes(peak, a, sizeof a);
        format_bytes(2.0 * largest, b, sizeof b);
        fprintf(f, "  planner's peak stage bytes per device: %s (2 stage slots of the largest: %s)\n",
                a, b);
    }
    free(slot_bytes);
}
