/*
 * test_partition.c — tests of llmc/partition.c (suite `partition`).
 *
 * The planner's cost is compared with an exhaustive search on hundreds of random small instances
 * (real and integer costs, so ties occur, and budgets that make some instances infeasible: both
 * searches must agree on that too); larger random instances must give valid plans that fit the
 * budget and beat the one-layer-per-stage plan. The paper's Fig. 1c example must come out exactly,
 * a 94-layer model must plan in milliseconds, and the bubble formula, the bias-corrected EMA, the
 * slot -> device rotation across rounds, the FLOP-proportional cost estimates, error messages and
 * the --plan printout are checked on their own.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../config.h"
#include "../partition.h"
#include "../rng.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// fixture: the arrays behind a PartitionInput

#define INST_MAX 128

typedef struct Instance {
    double fc[INST_MAX], bc[INST_MAX], fb[INST_MAX], bb[INST_MAX], ub[INST_MAX];
    PartitionInput in;
} Instance;

static void instance_wire(Instance* x, int n, int N, int M, double budget, int async) {
    x->in = (PartitionInput){.n_layers = n, .fwd_cost = x->fc, .bwd_cost = x->bc,
                             .fwd_bytes = x->fb, .bwd_bytes = x->bb, .N = N, .M = M,
                             .budget = budget, .async = async};
}

static double uniform(Rng* r, double lo, double hi) { return lo + (hi - lo) * rng_uniform(r); }

// Random instance: bwd ~ 3x fwd, a heavier head, integer byte sizes, and a budget from "too small
// for the largest layer" to "holds several layers". Every fourth instance has integer costs (so
// equal-cost plans exist) and every third independent fwd/bwd sizes (a fat forward layer may then
// only fit by moving it into the fused stage).
static void instance_random(Instance* x, Rng* r, int n, int k) {
    int N = 1 + (int)rng_below(r, 4);
    int M = N + (int)rng_below(r, (uint64_t)(2 * N + 1));
    double max_bb = 0.0, total_bb = 0.0;
    for (int l = 0; l < n; l++) {
        int head = l == n - 1, embed = l == 0;
        if (k % 4 == 0) {
            x->fc[l] = embed ? 0.0 : (double)(1 + rng_below(r, head ? 6 : 3));
            x->bc[l] = 3.0 * x->fc[l];
        } else {
            x->fc[l] = embed ? uniform(r, 0.0, 0.1) : uniform(r, 0.2, head ? 6.0 : 1.5);
            x->bc[l] = 3.0 * x->fc[l] * uniform(r, 0.8, 1.2);
        }
        x->fb[l] = (double)(1 + rng_below(r, head ? 120 : 50));
        x->bb[l] = k % 3 == 0 ? (double)(1 + rng_below(r, 100)) : 2.0 * x->fb[l];
        max_bb = fmax(max_bb, fmax(x->bb[l], x->fb[l]));
        total_bb += x->bb[l];
    }
    double budget = floor(uniform(r, 0.8 * max_bb, fmin(3.0 * max_bb, total_bb + 1.0)));
    instance_wire(x, n, N, M, fmax(budget, 1.0), (int)rng_below(r, 2));
    if (k % 5 == 1) {
        // layer-grain recompute: blocks weigh more in the fused stage (their activations)
        for (int l = 0; l < n; l++)
            x->ub[l] = x->bb[l] + (l > 0 && l < n - 1 ? (double)rng_below(r, 60) : 0.0);
        x->in.fused_bytes = x->ub;
    }
}

// Every stage fits the budget and the plan's numbers are what its ranges say.
static void check_plan_fits(TestCtx* t, const PartitionInput* in, const PartitionPlan* p,
                            const char* what) {
    char err[ERR_LEN];
    CHECK(t, partition_check(p, in->n_layers, err) == 0, "%s: %s", what, err);
    double tmax = 0.0;
    for (int i = 0; i < p->n_fwd; i++) {
        double bytes = 0.0, time = 0.0;
        for (int l = p->fwd[i].begin; l < p->fwd[i].end; l++) {
            bytes += in->fwd_bytes[l];
            time += in->fwd_cost[l];
        }
        CHECK(t, bytes <= in->budget, "%s: F%d bytes %g > budget %g", what, i + 1, bytes,
              in->budget);
        tmax = fmax(tmax, time);
    }
    for (int i = 0; i < p->n_bwd; i++) {
        double bytes = 0.0, time = 0.0;
        const double* bb = i == 0 && in->fused_bytes ? in->fused_bytes : in->bwd_bytes;
        for (int l = p->bwd[i].begin; l < p->bwd[i].end; l++) {
            bytes += bb[l];
            time += in->bwd_cost[l];
        }
        CHECK(t, bytes <= in->budget, "%s: B%d bytes %g > budget %g", what, i + 1, bytes,
              in->budget);
        tmax = fmax(tmax, time);
    }
    CHECK_NEAR(t, p->t_max, tmax, 1e-12 * tmax, "t_max from the ranges");
    int S = p->n_fwd + p->n_bwd;
    double fill = (double)in->N * (in->N - 1);
    const double span = 1.0 + (double)((S < in->N ? S : in->N) - 1) / in->M;
    if (in->N == 1) {  // the work: forward before the fused stage, every layer's backward
        double w = 0.0;
        for (int l = 0; l < p->bwd[0].begin; l++) w += in->fwd_cost[l];
        for (int l = 0; l < in->n_layers; l++) w += in->bwd_cost[l];
        if (!in->async) w *= in->M;
        CHECK_NEAR(t, p->cost, w, 1e-12 * w, "one device: cost = work");
        CHECK(t, p->bubble == 0.0, "one device: no bubble");
        return;
    }
    double want = in->async ? fmax(S, 0.5 * in->N * span) * tmax : (in->M * S + fill) * tmax;
    CHECK_NEAR(t, p->cost, want, 1e-12 * want, "cost from S and t_max");
    CHECK_NEAR(t, p->bubble, in->async ? 1.0 - S * tmax / want : fill / (in->M * S + fill), 1e-12,
               "bubble formula");
}

// ----------------------------------------------------------------------------
// tests

static void test_brute_force_agrees(TestCtx* t) {
    Rng r;
    rng_seed(&r, 1234);
    Instance* x = calloc_check(1, sizeof *x);
    PartitionPlan* a = malloc_check(sizeof *a);
    PartitionPlan* b = malloc_check(sizeof *b);
    int feasible = 0, infeasible = 0, fully_fused = 0, ties = 0;
    for (int k = 0; k < 1000; k++) {
        int n = 3 + (int)rng_below(&r, 7);  // 3..9 layer entries
        instance_random(x, &r, n, k);
        char ea[ERR_LEN] = "", eb[ERR_LEN] = "";
        int ra = partition_plan(&x->in, a, ea);
        int rb = partition_brute_force(&x->in, b, eb);
        CHECK(t, ra == rb, "instance %d (n %d): plan rc %d (%s) vs brute force rc %d (%s)", k,
              n, ra, ea, rb, eb);
        if (ra != 0 || rb != 0) {
            infeasible++;
            CHECK(t, strstr(ea, "budget") != NULL, "instance %d: error '%s'", k, ea);
            continue;
        }
        feasible++;
        fully_fused += a->n_fwd == 0;
        ties += k % 4 == 0;
        check_plan_fits(t, &x->in, a, "plan");
        check_plan_fits(t, &x->in, b, "brute force");
        CHECK(t, fabs(a->cost - b->cost) <= 1e-9 * b->cost,
              "instance %d (n %d, N %d, M %d, async %d): plan cost %.12g (S %d, t %.6g) vs "
              "optimum %.12g (S %d, t %.6g)",
              k, n, x->in.N, x->in.M, x->in.async, a->cost, a->n_fwd + a->n_bwd, a->t_max,
              b->cost, b->n_fwd + b->n_bwd, b->t_max);
    }
    printf("       %d feasible (%d fully fused, %d with integer costs), %d infeasible\n",
           feasible, fully_fused, ties, infeasible);
    CHECK(t, feasible >= 600 && infeasible >= 50, "instance mix: %d feasible, %d infeasible",
          feasible, infeasible);
    free(x);
    free(a);
    free(b);
}

// Larger instances: valid, within budget, never worse than one layer per stage.
static void test_random_validity(TestCtx* t) {
    Rng r;
    rng_seed(&r, 99);
    Instance* x = calloc_check(1, sizeof *x);
    PartitionPlan* p = malloc_check(sizeof *p);
    for (int k = 0; k < 200; k++) {
        int n = 2 + (int)rng_below(&r, INST_MAX - 1);
        instance_random(x, &r, n, k);
        char err[ERR_LEN];
        if (partition_plan(&x->in, p, err) != 0) {
            CHECK(t, strstr(err, "layer") != NULL || strstr(err, "budget") != NULL, "%s", err);
            continue;
        }
        check_plan_fits(t, &x->in, p, "random plan");
        // the plan that gives every layer its own stage, when it fits
        int fits = 1;
        double tmax = x->bc[n - 1];
        for (int l = 0; l < n - 1; l++) {
            fits &= x->fb[l] <= x->in.budget && x->bb[l] <= x->in.budget;
            tmax = fmax(tmax, fmax(x->fc[l], x->bc[l]));
        }
        fits &= x->bb[n - 1] <= x->in.budget;
        if (fits) {
            int S = 2 * (n - 1) + 1;
            double fill = (double)x->in.N * (x->in.N - 1);
            double c = x->in.async ? fmax(S, x->in.N) * tmax : (x->in.M * S + fill) * tmax;
            CHECK(t, p->cost <= c * (1 + 1e-12), "instance %d: cost %g above one-per-stage %g",
                  k, p->cost, c);
        }
    }
    free(x);
    free(p);
}

// Paper Fig. 1c: 12 uniform blocks + head on 4 GPUs, 8 micro-batches. Forward {1-3} .. {10-12}
// (the free embedding rides along with block 1), the head alone fused, then one block per
// backward stage: S = 4 + 13 = 17, in both objectives.
static void test_fig1c(TestCtx* t) {
    Instance* x = calloc_check(1, sizeof *x);
    PartitionPlan* p = malloc_check(sizeof *p);
    const int n = 14;
    for (int l = 0; l < n; l++) {
        x->fc[l] = l == 0 ? 0.0 : 1.0;
        x->bc[l] = 3.0 * x->fc[l];
        x->fb[l] = 10.0;
        x->bb[l] = 20.0;
    }
    for (int async = 0; async <= 1; async++) {
        instance_wire(x, n, 4, 8, 1e9, async);
        char err[ERR_LEN];
        CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
        check_plan_fits(t, &x->in, p, "fig1c");
        CHECK(t, p->n_fwd == 4 && p->n_bwd == 13, "S_f %d S_b %d", p->n_fwd, p->n_bwd);
        static const StageRange want_fwd[4] = {{0, 4}, {4, 7}, {7, 10}, {10, 13}};
        for (int i = 0; i < 4 && i < p->n_fwd; i++)
            CHECK(t, p->fwd[i].begin == want_fwd[i].begin && p->fwd[i].end == want_fwd[i].end,
                  "F%d = [%d, %d)", i + 1, p->fwd[i].begin, p->fwd[i].end);
        CHECK(t, p->bwd[0].begin == 13 && p->bwd[0].end == 14, "fused [%d, %d)", p->bwd[0].begin,
              p->bwd[0].end);
        for (int i = 1; i < p->n_bwd - 1; i++)
            CHECK(t, p->bwd[i].begin == 13 - i && p->bwd[i].end == 14 - i, "B%d = [%d, %d)", i + 1,
                  p->bwd[i].begin, p->bwd[i].end);
        CHECK(t, p->bwd[12].begin == 0 && p->bwd[12].end == 2, "last backward [%d, %d)",
              p->bwd[12].begin, p->bwd[12].end);
        CHECK_NEAR(t, p->t_max, 3.0, 0.0, "t_max = one block's backward");
        // sync: the paper's 12/148; async: S >= N, every stage t_max: no structural idle time
        CHECK_NEAR(t, p->bubble, async ? 0.0 : 12.0 / (8 * 17 + 12), 1e-15, "bubble");
        CHECK_NEAR(t, p->cost, async ? 17 * 3.0 : (8 * 17 + 12) * 3.0, 0.0, "cost");
    }
    // the --plan printout names the stages and the totals
    char* text = NULL;
    size_t len = 0;
    FILE* f = open_memstream(&text, &len);
    CHECK(t, f != NULL, "open_memstream");
    if (f) {
        partition_print(p, NULL, x->fb, x->bb, NULL, 4, 8, f);
        fclose(f);
        CHECK(t, strstr(text, "F1   embed + blocks 0-2") != NULL, "F1 line:\n%s", text);
        CHECK(t, strstr(text, "FB   head") != NULL && strstr(text, "B13  embed + block 0"),
              "FB/B13 lines:\n%s", text);
        CHECK(t, strstr(text, "S_f 4, S_b 13, S 17; bubble 0.00%, t_max 3") != NULL,
              "totals:\n%s", text);
        // a device holds a stage and the one N = 4 slots later: the heaviest pair is B13 (embed
        // + block 0, 40 B) with F4 (30 B) of the next round; two slots of the largest: 80 B
        CHECK(t, strstr(text, "planner's peak stage bytes per device: 70 B (2 stage slots of the "
                              "largest: 80 B)") != NULL,
              "peak:\n%s", text);
        free(text);
    }
    free(x);
    free(p);
}

// 94 decoder layers (n_layers 96), jittered costs so that nearly every contiguous sum is a
// distinct candidate (~9k), and a budget of a few layers per stage.
static void test_timing_94_layers(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig cfg;
    CHECK(t, config_from_preset(&cfg, "qwen3-32b", err) == 0, "%s", err);
    cfg.L = 94;
    const int n = cfg.L + 2;
    Instance* x = calloc_check(1, sizeof *x);
    PartitionPlan* p = malloc_check(sizeof *p);
    partition_estimate_costs(&cfg, 2048, 8192, 0, x->fc, x->bc);
    Rng r;
    rng_seed(&r, 7);
    for (int l = 0; l < n; l++) {
        x->fb[l] = l == n - 1 ? 2.0 * cfg.V * cfg.C : 2.0 * 487587840.0;
        x->bb[l] = 2.0 * x->fb[l];
    }
    double worst = 0.0;
    for (int variant = 0; variant < 4; variant++) {
        if (variant >= 2)
            for (int l = 0; l < n; l++) {
                double j = uniform(&r, 0.95, 1.05);
                x->fc[l] *= j;
                x->bc[l] *= j;
            }
        instance_wire(x, n, 8, 9, 8.0 * x->fb[1] + 1.0, variant % 2);
        double t0 = time_now_s();
        int rc = partition_plan(&x->in, p, err);
        double dt = time_now_s() - t0;
        worst = fmax(worst, dt);
        CHECK(t, rc == 0, "%s", err);
        if (rc == 0) check_plan_fits(t, &x->in, p, "94 layers");
        printf("       94 layers, %s, %s costs: %.3f ms, S_f %d S_b %d, bubble %.2f%%\n",
               variant % 2 ? "async" : "sync", variant >= 2 ? "jittered" : "estimated",
               dt * 1e3, p->n_fwd, p->n_bwd, 100.0 * p->bubble);
    }
    CHECK(t, worst < 0.05, "planning 96 layer entries took %.1f ms", worst * 1e3);
    free(x);
    free(p);
}

static void test_edge_cases_and_errors(TestCtx* t) {
    Instance* x = calloc_check(1, sizeof *x);
    PartitionPlan* p = malloc_check(sizeof *p);
    PartitionPlan* b = malloc_check(sizeof *b);
    char err[ERR_LEN];
    const int n = 6;
    for (int l = 0; l < n; l++) {
        x->fc[l] = 1.0;
        x->bc[l] = 3.0;
        x->fb[l] = 10.0;
        x->bb[l] = 20.0;
    }
    // block 4 (layer 5 of 6 would be the head: take layer 4 = block 3) too big for backward
    x->bb[4] = 1000.0;
    instance_wire(x, n, 2, 4, 500.0, 0);
    CHECK(t, partition_plan(&x->in, p, err) == -1 && strstr(err, "layer 4 (block 3)") &&
                 strstr(err, "1000") && strstr(err, "500"),
          "backward error: %s", err);
    CHECK(t, partition_brute_force(&x->in, b, err) == -1, "brute force agrees");
    // a fat forward layer the fused stage cannot absorb (it reaches down to layer 2 only)
    x->bb[4] = 20.0;
    x->fb[1] = 600.0;
    instance_wire(x, n, 2, 4, 90.0, 0);
    CHECK(t, partition_plan(&x->in, p, err) == -1 && strstr(err, "layer 1 (block 0)") &&
                 strstr(err, "forward") && strstr(err, "600"),
          "forward error: %s", err);
    CHECK(t, partition_brute_force(&x->in, b, err) == -1, "brute force agrees");
    // ... which it can absorb when the whole model fits one backward stage: everything fused
    instance_wire(x, n, 1, 1, 200.0, 1);
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    check_plan_fits(t, &x->in, p, "fully fused");
    CHECK(t, p->n_fwd == 0 && p->n_bwd == 1 && p->bwd[0].begin == 0 && p->bwd[0].end == n,
          "fully fused plan: S_f %d S_b %d", p->n_fwd, p->n_bwd);
    CHECK(t, partition_brute_force(&x->in, b, err) == 0 && fabs(b->cost - p->cost) < 1e-12,
          "brute force: %s", err);
    // bad inputs
    instance_wire(x, n, 0, 1, 100.0, 0);
    CHECK(t, partition_plan(&x->in, p, err) == -1 && strstr(err, "N = 0"), "%s", err);
    instance_wire(x, 0, 1, 1, 100.0, 0);
    CHECK(t, partition_plan(&x->in, p, err) == -1 && strstr(err, "n_layers 0"), "%s", err);
    instance_wire(x, n, 1, 1, 100.0, 0);
    x->bc[2] = NAN;
    CHECK(t, partition_plan(&x->in, p, err) == -1 && strstr(err, "bwd_cost[2]"), "%s", err);
    x->bc[2] = 3.0;
    instance_wire(x, 13, 1, 1, 1e9, 0);
    CHECK(t, partition_brute_force(&x->in, b, err) == -1 && strstr(err, "12"), "%s", err);

    // partition_check rejects broken plans
    instance_wire(x, n, 2, 4, 1e9, 0);
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    CHECK(t, partition_check(p, n, err) == 0, "%s", err);
    CHECK(t, partition_check(p, n + 1, err) == -1, "wrong layer count accepted");
    memcpy(b, p, sizeof *b);
    b->fwd[0].begin = 1;
    CHECK(t, partition_check(b, n, err) == -1 && strstr(err, "forward"), "gap at 0: %s", err);
    memcpy(b, p, sizeof *b);
    b->bwd[0].begin++;
    CHECK(t, partition_check(b, n, err) == -1 && strstr(err, "fused"), "fused: %s", err);
    memcpy(b, p, sizeof *b);
    b->n_bwd--;
    CHECK(t, partition_check(b, n, err) == -1 && strstr(err, "instead of 0"), "short: %s", err);
    memcpy(b, p, sizeof *b);
    b->bwd[1].end--;
    CHECK(t, partition_check(b, n, err) == -1 && strstr(err, "backward"), "gap: %s", err);
    PartitionPlan* e = b;  // an empty forward range
    memset(e, 0, sizeof *e);
    *e = (PartitionPlan){.n_layers = 3, .n_fwd = 2, .n_bwd = 2};
    e->fwd[0] = (StageRange){0, 0};
    e->fwd[1] = (StageRange){0, 2};
    e->bwd[0] = (StageRange){2, 3};
    e->bwd[1] = (StageRange){0, 2};
    CHECK(t, partition_check(e, 3, err) == -1, "empty forward range accepted");
    e->n_fwd = 1;
    e->fwd[0] = (StageRange){0, 2};
    CHECK(t, partition_check(e, 3, err) == 0, "%s", err);
    free(x);
    free(p);
    free(b);
}

static void test_bubble_formula(TestCtx* t) {
    Instance* x = calloc_check(1, sizeof *x);
    PartitionPlan* p = malloc_check(sizeof *p);
    for (int l = 0; l < 8; l++) {
        x->fc[l] = 1.0;
        x->bc[l] = 3.0;
        x->fb[l] = x->bb[l] = 1.0;
    }
    // one device: no fill/drain, no bubble
    instance_wire(x, 8, 1, 3, 1e9, 0);
    char err[ERR_LEN];
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    CHECK(t, p->bubble == 0.0, "N = 1 bubble %g", p->bubble);
    // N = 8, M = 9: N(N-1) / (M*S + N(N-1)) with the plan's S; more micro-batches, less bubble
    instance_wire(x, 8, 8, 9, 1e9, 0);
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    int S = p->n_fwd + p->n_bwd;
    CHECK_NEAR(t, p->bubble, 56.0 / (9.0 * S + 56.0), 1e-15, "bubble N=8 M=9");
    double b9 = p->bubble;
    instance_wire(x, 8, 8, 32, 1e9, 0);
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    CHECK(t, p->bubble < b9, "bubble %g with M=32 not below %g with M=9", p->bubble, b9);
    // async: two iterations overlap, so fewer stages than devices cost N/2 x the span
    instance_wire(x, 8, 8, 9, 1e9, 1);
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    S = p->n_fwd + p->n_bwd;
    const double want = fmax(S, 4.0 * (1.0 + (double)((S < 8 ? S : 8) - 1) / 9)) * p->t_max;
    CHECK(t, fabs(p->cost - want) <= 1e-12 * want, "async cost %g, S %d: want %g", p->cost, S,
          want);
    // with the bwd ~ 3 fwd costs of the fixture, splitting off forward stages adds recompute:
    // on two devices the whole model in the fused stage (S = 1: one iteration per device, two
    // at once) beats every split
    instance_wire(x, 8, 2, 10, 1e9, 1);
    CHECK(t, partition_plan(&x->in, p, err) == 0, "%s", err);
    CHECK(t, p->n_fwd == 0 && p->n_bwd == 1, "N 2: S %d, expected everything fused",
          p->n_fwd + p->n_bwd);
    free(x);
    free(p);
}

static void test_cost_profile_ema(TestCtx* t) {
    CostProfile cp;
    cost_profile_init(&cp, 2);
    double f[2] = {-1, -1}, b[2] = {-1, -1};
    CHECK(t, cost_profile_get(&cp, f, b) == -1 && f[0] == -1, "no observation yet");
    cost_profile_update(&cp, (const double[]){100, 200}, (const double[]){300, 600});
    CHECK(t, cost_profile_get(&cp, f, b) == -1 && cp.n_obs == 1, "cold start dropped");
    cost_profile_update(&cp, (const double[]){1, 2}, (const double[]){3, 6});
    CHECK(t, cost_profile_get(&cp, f, b) == 0, "one kept observation");
    CHECK_NEAR(t, f[0], 1.0, 1e-14, "first kept estimate is the observation");
    CHECK_NEAR(t, b[1], 6.0, 6e-14, "first kept estimate (bwd)");
    cost_profile_update(&cp, (const double[]){3, 4}, (const double[]){9, 12});
    cost_profile_get(&cp, f, b);
    CHECK_NEAR(t, f[0], (0.09 * 1 + 0.1 * 3) / 0.19, 1e-14, "two kept, bias corrected");
    CHECK_NEAR(t, b[1], (0.09 * 6 + 0.1 * 12) / 0.19, 1e-14, "two kept (bwd)");
    cost_profile_free(&cp);
    // a constant observation is reported exactly at every k: the correction is exact
    cost_profile_init(&cp, 1);
    cost_profile_update(&cp, (const double[]){1e6}, (const double[]){1e6});
    for (int k = 1; k <= 60; k++) {
        cost_profile_update(&cp, (const double[]){0.125}, (const double[]){0.5});
        cost_profile_get(&cp, f, b);
        CHECK(t, fabs(f[0] - 0.125) <= 1e-13 && fabs(b[0] - 0.5) <= 1e-13, "k %d: %.17g %.17g", k,
              f[0], b[0]);
    }
    CHECK(t, cp.n_obs == 61, "n_obs %d", cp.n_obs);
    cost_profile_free(&cp);
}

static void test_slots_and_rotation(TestCtx* t) {
    PartitionPlan* p = malloc_check(sizeof *p);
    memset(p, 0, sizeof *p);
    // 4 layers: F [0,1) [1,3); FB [3,4); B [1,3) [0,1): S = 5
    p->n_layers = 4;
    p->n_fwd = 2;
    p->fwd[0] = (StageRange){0, 1};
    p->fwd[1] = (StageRange){1, 3};
    p->n_bwd = 3;
    p->bwd[0] = (StageRange){3, 4};
    p->bwd[1] = (StageRange){1, 3};
    p->bwd[2] = (StageRange){0, 1};
    char err[ERR_LEN];
    CHECK(t, partition_check(p, 4, err) == 0, "%s", err);
    static const SlotKind kinds[5] = {SLOT_FWD, SLOT_FWD, SLOT_FUSED, SLOT_BWD, SLOT_BWD};
    static const int begins[5] = {0, 1, 3, 1, 0};
    for (int i = 0; i < 5; i++) {
        SlotInfo s;
        CHECK(t, partition_slot(p, i, &s) == 0, "slot %d", i);
        CHECK(t, s.kind == kinds[i] && s.range.begin == begins[i], "slot %d: kind %d begin %d", i,
              (int)s.kind, s.range.begin);
    }
    SlotInfo s;
    CHECK(t, partition_slot(p, 5, &s) == -1 && partition_slot(p, -1, &s) == -1, "out of range");

    // S = 5, N = 2: round 0 on devices 0,1,0,1,0; round 1 starts at device 1
    const int S = 5, N = 2;
    static const int round0[5] = {0, 1, 0, 1, 0};
    for (int i = 0; i < S; i++)
        CHECK(t, schedule_slot_device(i, 0, N) == round0[i], "round 0 slot %d", i);
    int g0 = schedule_slot_device(S, 0, N);
    CHECK(t, g0 == 1, "round 1 starts at device %d", g0);
    // carrying g0 round by round equals the never-reset global cursor
    for (int n_dev = 1; n_dev <= 8; n_dev++) {
        g0 = 0;
        for (int r = 0; r < 12; r++) {
            for (int i = 0; i < S; i++)
                CHECK(t, schedule_slot_device(i, g0, n_dev) ==
                             schedule_slot_device((int64_t)r * S + i, 0, n_dev),
                      "N %d round %d slot %d", n_dev, r, i);
            g0 = schedule_slot_device(S, g0, n_dev);
        }
    }
    CHECK(t, schedule_slot_device(((int64_t)1 << 40) + 3, 2, 7) ==
                 (int)((((int64_t)1 << 40) + 5) % 7),
          "64-bit slot counter");
    free(p);
}

static void test_estimate_costs(TestCtx* t) {
    char err[ERR_LEN];
    ModelConfig c;
    CHECK(t, config_from_preset(&c, "qwen3-1.7b", err) == 0, "%s", err);
    const int T = 2048, tokens = 4 * 2048, n = c.L + 2;
    double* fc = malloc_check((size_t)n * sizeof(double));
    double* bc = malloc_check((size_t)n * sizeof(double));
    partition_estimate_costs(&c, T, tokens, 0, fc, bc);
    // a block: 2 * 50,331,648 matmul params + 2*T*H*HD attention FLOPs per token
    double block = (2.0 * 50331648 + 2.0 * T * 16 * 128) * tokens;
    double sum = 0.0;
    for (int l = 1; l <= c.L; l++) {
        CHECK(t, fc[l] == fc[1], "block %d cost %g vs block 0 %g", l - 1, fc[l], fc[1]);
        CHECK(t, bc[l] == 3.0 * fc[l], "block %d: bwd = 3x fwd", l - 1);
        sum += fc[l];
    }
    CHECK_NEAR(t, fc[1], block, 1e-12 * block, "block FLOPs");
    CHECK(t, fc[n - 1] > 5.0 * fc[1], "head %g heavier than a block %g", fc[n - 1], fc[1]);
    CHECK(t, bc[n - 1] == 3.0 * fc[n - 1], "fused head: 3x its forward");
    CHECK(t, fc[0] > 0.0 && fc[0] < 1e-3 * fc[1], "embedding a trifle: %g", fc[0]);
    // forward of blocks + head is one third of the model FLOPs per token
    sum += fc[n - 1];
    double model = config_flops_per_token(&c, T) * tokens / 3.0;
    CHECK_NEAR(t, sum, model, 1e-12 * model, "sum of forward costs = F_model / 3");
    // a chunked MLP: each block's backward also recomputes the MLP forward (3 C F matmul params)
    // and both attention projections (qkv: C x (H + 2 KVH) HD, o: H HD x C)
    double* bk = malloc_check((size_t)n * sizeof(double));
    partition_estimate_costs(&c, T, tokens, 1, fc, bk);
    const double mlp_fwd = 2.0 * 3.0 * c.C * c.F * tokens;
    const double proj_fwd =
        2.0 * ((double)c.C * (c.H + 2.0 * c.KVH) * c.HD + (double)c.H * c.HD * c.C) * tokens;
    for (int l = 1; l <= c.L; l++)
        CHECK(t, fabs(bk[l] - (bc[l] + mlp_fwd + proj_fwd)) <= 1e-12 * bk[l],
              "chunked block %d: %g, expected %g + the MLP forward %g + the projections %g",
              l - 1, bk[l], bc[l], mlp_fwd, proj_fwd);
    CHECK(t, bk[0] == bc[0] && bk[n - 1] == bc[n - 1], "chunking changes blocks only");
    free(bk);
    free(fc);
    free(bc);

    // MoE: k experts + router; GPT-OSS: sliding layers (even) cheaper at long T
    ModelConfig g = c;
    g.family = FAMILY_GPTOSS;
    g.L = 4;
    g.E = 32;
    g.K = 4;
    g.F_expert = 512;
    g.sliding_window = 128;
    double gf[6], gb[6];
    partition_estimate_costs(&g, 4096, 4096, 0, gf, gb);
    double proj = (double)g.C * (g.H + 2 * g.KVH) * g.HD + (double)g.H * g.HD * g.C;
    double mlp = 3.0 * g.C * 512 * 4 + (double)g.C * 32;
    double hhd = (double)g.H * g.HD;
    CHECK_NEAR(t, gf[2], 2.0 * (proj + mlp) * 4096 + 2.0 * 4096 * hhd * 4096, 1e-12 * gf[2],
               "full-attention MoE layer");
    CHECK_NEAR(t, gf[1], 2.0 * (proj + mlp) * 4096 + 4.0 * 128 * hhd * 4096, 1e-12 * gf[1],
               "sliding-window MoE layer");
    CHECK(t, gf[1] < gf[2] && gf[3] == gf[1] && gf[4] == gf[2], "alternating layers");
}

const TestCase tests_partition[] = {
    {"partition_brute_force_agrees", test_brute_force_agrees},
    {"partition_random_validity", test_random_validity},
    {"partition_fig1c", test_fig1c},
    {"partition_timing_94_layers", test_timing_94_layers},
    {"partition_edge_cases_and_errors", test_edge_cases_and_errors},
    {"partition_bubble_formula", test_bubble_formula},
    {"partition_cost_profile_ema", test_cost_profile_ema},
    {"partition_slots_and_rotation", test_slots_and_rotation},
    {"partition_estimate_costs", test_estimate_costs},
    {NULL, NULL},
};
