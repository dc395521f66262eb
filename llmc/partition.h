/*
 * partition.h — the RoundPipe planner: asymmetric stage partitions, their cost model and the
 * round-robin slot schedule (docs/ROUNDPIPE.md §2, §3).
 *
 * The layer sequence has n_layers = L + 2 entries: 0 = prefix (embedding), 1..L = decoder blocks
 * (entry l is block l-1), L+1 = postfix (final norm + LM head + loss). A stage is a contiguous
 * range [begin, end) of it, uploaded to one device and run there for all micro-batches of a round.
 *
 * A plan is two partitions that share one stage (paper §3.2):
 *   fwd[0..n_fwd)  ascending ranges covering [0, e): forward stages F_1..F_Sf;
 *   bwd[0]         = [e, n_layers), the FUSED stage: forward of those layers + loss + backward,
 *                    so its forward doubles as the recompute; always holds at least the postfix;
 *   bwd[1..n_bwd)  backward stages B_2..B_Sb, deepest first, down to the one starting at 0.
 * Invariants (partition_check): every range non-empty, forward ranges contiguous from 0, last
 * forward end == e == bwd[0].begin, bwd[0].end == n_layers, each bwd[i].end == bwd[i-1].begin and
 * the last backward range begins at 0. The fused stage may hold everything (e == 0, n_fwd == 0,
 * n_bwd == 1).
 *
 * Costs (any unit, usually seconds or FLOPs; one micro-batch): fwd_cost[l] is the forward of layer
 * l in a forward stage, bwd_cost[l] its recompute + backward (for the postfix: the fused forward +
 * loss + backward). A forward stage's time is the sum of fwd_cost over its layers, a backward
 * stage's (the fused one included) the sum of bwd_cost; t_max is the largest stage time. Bytes are
 * what one stage needs resident on its device (forward: parameters; backward: parameters +
 * gradients); activation memory is the caller's business, folded into the budget. Every stage
 * must fit the budget for ONE stage, which the caller sets to half the device limit because a
 * device holds its current stage and prefetches its next one (docs/ROUNDPIPE.md §2.5).
 *
 * Objective over S = n_fwd + n_bwd slots per round:
 *   sync  (paper):       (M*S + N*(N-1)) * t_max
 *   async (our default): max(S, N/2 * (1 + (min(S, N) - 1) / M)) * t_max
 *       N times the iteration period: fill and drain overlap neighbouring iterations, and with
 *       the one-step-delayed update two iterations may run at once (the engine submits t+1
 *       before collecting t), so a plan of S < N stages still keeps min(N, 2S) devices busy:
 *       the period is the larger of S t / N (all devices busy) and half an iteration's span
 *       (1 + (min(S, N) - 1) / M) t. The paper's max(S, N) t (docs/ROUNDPIPE.md §2.4) assumed one
 *       iteration at a time; for S >= N the two agree unless M is small.
 *   one device (N = 1), either mode: the work, sum of fwd_cost over the layers before the fused
 *       stage + sum of bwd_cost over all layers (x M in sync mode): the device runs its stages
 *       back to back, so balance buys nothing and the largest fused stage that fits (the least
 *       recompute) wins; ties go to fewer stages as above.
 * bubble: sync, N(N-1) / (M*S + N(N-1)), the paper's structural bubble of the chosen plan;
 * async, 1 - S t_max / cost, the devices' idle share of the period; 0 on one device.
 *
 * partition_plan is the paper's search (docs/ROUNDPIPE.md §2.4): for each candidate t (every
 * contiguous sum of the costs, ascending; forward sums stop before the postfix, which never runs as
 * a forward stage) a greedy scan gives the fewest stages whose times are all <= t and whose bytes
 * all fit; the cheapest (cost from the plan's ACTUAL t_max) wins, ties going to fewer stages, then
 * smaller t_max. Why greedy is exact: packing a prefix [0, e) into intervals under "sum <= t and
 * bytes <= budget" is minimised greedily from either end, the minimum is monotone in e, so the
 * largest fused stage is best; and the optimum's t_max is itself a candidate. Cost is
 * O(#candidates * n_layers) with lower-bound pruning: about 1 ms for 96 entries, 1-3 s at
 * PARTITION_MAX_LAYERS (a million candidates). partition_brute_force enumerates every valid plan
 * of a small instance to test the exactness claim.
 *
 * Plans are plain values: fixed arrays of PARTITION_MAX_STAGES ranges per direction (one stage per
 * layer at most), so a plan can be copied, stored and compared without ownership questions.
 * No global state; every function is re-entrant.
 */
#ifndef LLMC_PARTITION_H
#define LLMC_PARTITION_H

#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "tensor.h"

#define PARTITION_MAX_LAYERS (CONFIG_MAX_LAYERS + 2)  // prefix + blocks + postfix
#define PARTITION_MAX_STAGES PARTITION_MAX_LAYERS     // per direction; S < 2 * this
#define PARTITION_BRUTE_MAX_LAYERS 12                 // 4^(n-2) plans: tests only

// ----------------------------------------------------------------------------
// plans

typedef struct StageRange {
    int begin, end;  // layers [begin, end) of the layer sequence
} StageRange;

typedef struct PartitionInput {
    int n_layers;              // L + 2, 1 <= n_layers <= PARTITION_MAX_LAYERS
    const double* fwd_cost;    // (n_layers) forward time (or estimate) per layer per micro-batch
    const double* bwd_cost;    // (n_layers) recompute + backward per layer per micro-batch
                               // (for the postfix: its fused forward + loss + backward)
    const double* fwd_bytes;   // (n_layers) device bytes a forward stage needs for this layer
    const double* bwd_bytes;   // (n_layers) bytes a backward stage needs (params + grads)
    int N;                     // devices
    int M;                     // micro-batches per iteration
    double budget;             // device bytes available to ONE stage (caller passes limit/2)
    int async;                 // 1: the async objective above, 0: paper (M*S + N(N-1))*t_max
    const double* fused_bytes; // (n_layers) bytes a layer needs in the fused stage, when that
                               // differs from bwd_bytes (layer-grain recompute: the fused stage
                               // keeps every block's activations); NULL = bwd_bytes
} PartitionInput;

typedef struct PartitionPlan {
    int n_layers;
    int n_fwd;                                 // S_f (may be 0: everything fused)
    StageRange fwd[PARTITION_MAX_STAGES];      // ascending, covering [0, e)
    double fwd_time[PARTITION_MAX_STAGES];     // sum of fwd_cost over each forward stage
    int n_bwd;                                 // S_b >= 1, the fused stage included
    StageRange bwd[PARTITION_MAX_STAGES];      // [0] fused = [e, n_layers), then deepest first
    double bwd_time[PARTITION_MAX_STAGES];     // sum of bwd_cost over each backward stage
    double t_max;   // the largest stage time of this plan
    double cost;    // the objective at t_max
    double bubble;  // sync N(N-1) / (M*S + N(N-1)); async 1 - S t_max / cost
} PartitionPlan;

// The paper's planner. 0 on success; -1 with one line in err (ERR_LEN) when the input is invalid
// or no plan fits the budget (naming the layer and the bytes that do not fit).
int partition_plan(const PartitionInput* in, PartitionPlan* out, char* err);
// Exhaustive search over every valid plan (n_layers <= PARTITION_BRUTE_MAX_LAYERS), same
// objective and tie-break, cost from each plan's actual t_max. For tests.
int partition_brute_force(const PartitionInput* in, PartitionPlan* out, char* err);
// Structural validity (the invariants above) for a sequence of n_layers. 0 or -1 with err.
int partition_check(const PartitionPlan* plan, int n_layers, char* err);
// Fill stage times, t_max, cost and bubble of a plan whose ranges are set (costs from in).
void partition_evaluate(const PartitionInput* in, PartitionPlan* plan);

// ----------------------------------------------------------------------------
// costs

// FLOP-proportional estimates per layer entry (n_layers = cfg->L + 2) for one micro-batch of
// tokens_per_microbatch tokens in sequences of length T (docs/ROUNDPIPE.md §2.3): a block's
// forward is 2*(active matmul params)*tokens + 2*T*H*HD*tokens (causal attention; GPT-OSS sliding
// layers 4*min(W, T/2)*H*HD), its recompute + backward 3x that; the postfix forward is
// 2*V*C*tokens and its fused forward + backward 3x that (never recomputed); the prefix (an
// embedding gather, memory bound) a token-proportional trifle of C FLOPs per token, 3x backward.
// mlp_chunked: the MLP runs in chunks (Model.mlp_chunk) and keeps no activations, and the block
// keeps neither ln1, qkv_raw, qkv nor h, so every block's backward also recomputes the MLP forward
// and both attention projections: 2*(MLP + projection params)*tokens more (qk-norm and RoPE are
// elementwise: not counted).
void partition_estimate_costs(const ModelConfig* cfg, int T, int tokens_per_microbatch,
                              int mlp_chunked, double* fwd_cost, double* bwd_cost);
// The same for LoRA adapters on a frozen base (lora NULL or r = 0: the full-training costs
// above): no weight gradient of the base (a block's base matmuls cost 2x their forward in
// recompute + input gradient instead of 3x; the frozen LM head 2x; the frozen embedding no
// backward, its recompute only), plus each adapter's products: 2*r*(in + out)*tokens forward,
// and 2*r*(3*in + 2*out)*tokens in backward (t again, dB, dt, dA, dx) after its recompute.
void partition_estimate_costs_lora(const ModelConfig* cfg, const LoraSpec* lora, int T,
                                   int tokens_per_microbatch, int mlp_chunked, double* fwd_cost,
                                   double* bwd_cost);

// Profiled costs (docs/ROUNDPIPE.md §2.7): the first observation is a cold start and is dropped;
// after it, est <- 0.9*est + 0.1*obs starting from est = 0, reported bias-corrected as
// est/(1-0.9^k) with k the number of observations kept. fwd/bwd hold the raw (uncorrected) EMA.
typedef struct CostProfile {
    int n_layers;
    double* fwd;  // (n_layers) raw EMA of forward times
    double* bwd;  // (n_layers) raw EMA of recompute + backward times
    int n_obs;    // observations received, the dropped cold-start one included
} CostProfile;

void cost_profile_init(CostProfile* p, int n_layers);
void cost_profile_free(CostProfile* p);
// One observation per layer (one iteration's per-micro-batch means); fwd_obs, bwd_obs: (n_layers).
void cost_profile_update(CostProfile* p, const double* fwd_obs, const double* bwd_obs);
// Bias-corrected estimates into fwd/bwd (n_layers each). 0, or -1 when nothing is kept yet
// (no observation, or only the cold-start one); outputs are untouched then.
int cost_profile_get(const CostProfile* p, double* fwd, double* bwd);

// ----------------------------------------------------------------------------
// schedule

// A round is S slots: F_1..F_Sf, then the fused stage, then B_2..B_Sb (bwd[1..]).
typedef enum { SLOT_FWD = 0, SLOT_FUSED, SLOT_BWD } SlotKind;

typedef struct SlotInfo {
    SlotKind kind;
    int stage;         // index into plan->fwd (SLOT_FWD) or plan->bwd (SLOT_FUSED: 0, SLOT_BWD)
    StageRange range;  // its layers
} SlotInfo;

// Slot i (0 <= i < S) of a round. 0, or -1 when i is out of range.
int partition_slot(const PartitionPlan* plan, int i, SlotInfo* out);
// The device that runs a global slot: (g0 + global_slot) mod N. Slots are counted over all rounds
// (the never-reset cursor of docs/ROUNDPIPE.md §3.2), so the next round starts at
// schedule_slot_device(S, g0, N).
int schedule_slot_device(int64_t global_slot, int g0, int N);

// ----------------------------------------------------------------------------
// printing (--plan)

// One line per stage (F1.., FB, B2..) with layer names (embed, blocks i-j, head), time, share of
// t_max and bytes (the planner's per-stage accounting: what the caller's byte arrays count); then
// S_f, S_b, S, bubble %, t_max, balance, and the per-device peak of those bytes (a device holds
// its stage and the one N slots later). cfg and the byte arrays may be NULL
// (fused_bytes NULL = bwd_bytes).
void partition_print(const PartitionPlan* plan, const ModelConfig* cfg, const double* fwd_bytes,
                     const double* bwd_bytes, const double* fused_bytes, int N, int M, FILE* f);

#endif  // LLMC_PARTITION_H
