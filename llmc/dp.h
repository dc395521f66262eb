/*
 * dp.h — data parallelism over the collectives of comm.h: W ranks each compute the gradients of
 * their share of the global batch, the gradients are reduce-scattered in fp32, every rank steps
 * AdamW on its 1/W shard of the parameters on the host (ZeRO-1) and the updated weights are
 * all-gathered. Two parts:
 *
 *  - the plan (dp_plan.c): what a step of W ranks moves over the network and how much of it the
 *    step's compute hides, for `--plan --world W --net-gbps G` and docs/PERFORMANCE.md §7;
 *  - the step on the plain path (dp.c): the shard layout, the sharded optimizer step, the
 *    global loss, and the rows of the global batch each rank takes.
 *
 * The grouping of micro-batches (what a single-process run must do to reproduce a data-parallel
 * run bit for bit). --batch B stays global: rank r takes the sequences r, r + W, r + 2W, ... of
 * every global batch (B % W == 0, each rank B / W sequences, split into its M / W micro-batches
 * as plain training splits a batch). Rank r accumulates its micro-batches' gradients in its own
 * order (scaled by 1 / (B·T), the global batch's tokens); the reduce-scatter then adds the W
 * groups in rank order, ((g_0 + g_1) + g_2) + ..., in fp32 (comm_reference_sum). The loss is the
 * same sum in double: every rank's sum of per-token losses, added in rank order, over B·T.
 *
 * The shard layout. The optimizer's tensors (store_adamw_tensors: owned, trainable, tied ones
 * folded) laid end to end form one flat vector of n elements, cut into AdamW chunks
 * (ADAMW_CHUNK elements, never spanning a tensor, as adamw.c cuts them). Rank r owns the chunks
 * starting in [r·n/W, (r+1)·n/W): a contiguous range of the flat vector that begins and ends on
 * chunk boundaries, so the global gradient norm summed from the ranks' chunk sums in rank order
 * is adamw_grad_norm_sq's sum bit for bit, and AdamW over the shards updates every element as
 * one call over all tensors would. Every rank's block in the collectives is padded to the
 * largest shard (`block` elements; at most one chunk more than n / W).
 */
#ifndef LLMC_DP_H
#define LLMC_DP_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "adamw.h"
#include "comm.h"
#include "model.h"
#include "plain.h"
#include "store.h"
#include "threads.h"

// ----------------------------------------------------------------------------
// the plan: traffic, what compute hides, host memory (dp_plan.c)

// The MFU --plan assumes per GPU when no --step-ms is given: measured single-GPU runs reach
// 53.9-59.5% (docs/PERF.md, session 6).
#define DP_PLAN_MFU 0.55
// CPU AdamW throughput of the 16-core host, parameters per second (docs/PERF.md: 5.55 G)
#define DP_PLAN_ADAMW_PARAMS_PER_S 5.5e9
// Latency of one step of a ring collective between nodes (NCCL over InfiniBand / RoCE: a few
// microseconds per hop plus the proxy; 10 us is the cautious figure). A ring of W ranks takes
// W - 1 steps per reduce-scatter or all-gather, one collective per layer.
#define DP_PLAN_HOP_LATENCY_S 10e-6

typedef struct DpPlanInput {
    const Model* m;
    int world;           // W ranks (nodes)
    double net_gbps;     // each node's network bandwidth, Gbit/s, each direction
    double step_s;       // one node's step time without data parallelism (compute), seconds
    int rounds;          // rounds per step: only the last one's backward completes gradients
    int sync;            // the synchronous optimizer (else the one-step-delayed update)
    double host_bytes;   // one node's host memory for the run without sharding
    int grad_sets;       // host fp32 gradient sets of the run (1; 2 with the delayed update, ...)
    double built_sharded;  // host bytes per parameter this build keeps for 1/W only: the
                           // engine's m and v (8), and its fp32 weights (+4) where no plain path
                           // reads them; the plain path keeps its whole store (0)
    double host_rank_bytes;  // rank 0's host memory as this build runs it: memory_estimate with
                             // the world size, the figure the run's start-up check compares
                             // (0: host_bytes less built_sharded B per parameter for 1/W)
} DpPlanInput;

typedef struct DpPlan {
    double params;             // trainable parameters P (the traffic and the sharded state)
    double rs_bytes;           // per rank and step, sent (and received): reduce-scatter, fp32
    double rs_bf16_bytes;      // the same with bf16 gradients
    double ag_bytes;           // all-gather of the updated bf16 weights
    double rs_s, rs_bf16_s, ag_s;  // their times at net_gbps
    double bwd_window_s;       // the last round's backward: what can hide the reduce-scatter
    double fwd_window_s;       // the first round's forward: what can hide the all-gather (sync)
    double rs_tail_s;          // reduce-scatter left after the last layer's backward (fp32)
    double rs_bf16_tail_s;     // the same with bf16 gradients
    double ag_stall_s;         // sync: the next forward waiting for weights
    double opt_s;              // this rank's AdamW shard on the CPUs (P/W at the measured rate)
    double exposed_s;          // per step, not hidden behind compute (fp32 gradients)
    double exposed_bf16_s;     // the same with bf16 gradients
    double efficiency;         // step_s / (step_s + exposed_s)
    double efficiency_bf16;
    double host_saved;         // host bytes per rank ZeRO-1 saves
    double host_bytes_rank;    // host_bytes - host_saved
    double host_built_saved;   // what this build shards today (built_sharded B per parameter)
    double host_built_rank;    // in->host_rank_bytes (else host_bytes - host_built_saved)
} DpPlan;

// The estimate (docs/PERFORMANCE.md §7 has the formulas). step_s <= 0: traffic and memory only.
DpPlan dp_plan_estimate(const DpPlanInput* in);
// The estimate as --plan prints it; step_source says where step_s came from.
void dp_plan_print(const DpPlanInput* in, const char* step_source, FILE* f);

// ----------------------------------------------------------------------------
// the shard layout and the sharded optimizer step (dp.c)

typedef struct DpLayout {
    int world, rank;
    int n_tensors;          // the optimizer's tensors (store_adamw_tensors)
    AdamWTensor* t;         // (n_tensors) views of the store: param, grad, m, v
    size_t* offset;         // (n_tensors + 1) flat offset of each tensor; offset[n_tensors] = n
    size_t n;               // flat elements
    size_t* lo;             // (world + 1) rank r owns flat [lo[r], lo[r+1])
    int64_t* chunk_lo;      // (world + 1) rank r's AdamW chunks, global index [chunk_lo[r], ..)
    size_t block;           // the collectives' block: max over r of lo[r+1] - lo[r] (>= 1)
    int64_t chunk_block;    // max over r of its chunk count (>= 1)
    // this rank's shard as optimizer tensors (pieces of t, grad pointing into `send`)
    int n_shard;
    AdamWTensor* shard;
    float* send;            // (world * block) fp32: packed gradients, then the reduced shard
    float* gather;          // (world * block) fp32: the all-gather of the updated weights
    double* sums;           // (world * chunk_block) the ranks' chunk sums of squares
} DpLayout;

// The layout of store s over world ranks, seen from `rank`. 0, or -1 with err.
int dp_layout_create(DpLayout* d, const Store* s, int world, int rank, char* err);
void dp_layout_free(DpLayout* d);

// One ZeRO-1 optimizer step of the run's step `step` on rank d->rank, every rank calling it with
// its own store holding its gradients (tied ones folded): the gradients reduce-scattered in fp32
// (rank order), the global norm from the ranks' chunk sums, AdamW on this rank's shard, the
// updated fp32 weights all-gathered into every rank's store. The store's m and v are current
// only in this rank's shard (dp_gather_state makes them whole for a checkpoint). Returns the
// update's factors (norm, lr); on a failed collective *failed = 1 and err holds the comm's
// message (naming the rank that died or hung).
AdamWUpdate dp_step(DpLayout* d, Comm* c, ThreadPool* pool, const AdamWHyper* h,
                    const LrSchedule* sched, float grad_clip, int64_t step, int* failed,
                    char* err);
// Collective: whether every rank starts from the same weights (nothing is broadcast: every rank
// loads the same --model, --seed or --resume checkpoint). 0, or -1 with err naming the first rank
// whose weights differ from rank 0's (or the collective's failure).
int dp_check_same_weights(DpLayout* d, Comm* c, char* err);
// The same check for a checksum the caller computed (the engine: of its Store's trainable
// weights). Collective; 0, or -1 with err.
int dp_check_same_crc(Comm* c, uint32_t crc, char* err);
// Make m and v whole on every rank (all-gathers of the shards): before a checkpoint. 0 or -1.
int dp_gather_state(DpLayout* d, Comm* c, char* err);
// The global loss: every rank's double `local` added in rank order (an all-gather of the
// doubles' bits), the same bits on every rank. 0 or -1 with err.
int dp_sum_double(Comm* c, double local, double* out, char* err);

// The rows of the global batch rank r takes: r, r + W, ... (B / W of them) into out (B/W, T+1).
void dp_take_rows(const int32_t* tokens, int B, int T, int world, int rank, int32_t* out);

// Rank `rank`'s share of the global batch tokens (B, T+1): its rows (into rows, (B/W, T+1)) in
// M/W micro-batches split as plain training splits a batch (the first (B/W) % (M/W) one row
// more), every gradient scaled by 1 / (B·T) into p's store (zeroed first, tied gradients
// folded). Returns the sum of its per-token losses. B and M must divide by world (dp_check).
double dp_rank_gradients(Plain* p, const int32_t* tokens, int B, int T, int M, int world,
                         int rank, int32_t* rows);
// Whether a global batch of B sequences in M micro-batches splits over world ranks. 0 or -1
// with err naming the flag.
int dp_check_batch(int B, int M, int world, char* err);

// ----------------------------------------------------------------------------
// the engine's shard layout (engine/shard.c; docs/DISTRIBUTED.md §6)
//
// Per layer of the layer sequence: the layer's optimizer tensors t[0..n) (full training: the
// tensors it owns; LoRA: its adapters; in table order) lie end to end in its gradient slab at the
// offsets goff[] (ascending; the same offsets in its parameter slab after the frozen head),
// spanning [goff[0], goff[n-1] + t[n-1].n).
// Rank r owns comm_shard_range of that span (blocks of ceil(span / W), zero-padded to W blocks in
// the collectives), cut into pieces at the tensors' boundaries. The global squared norm is the
// pieces' AdamW chunk sums added layer by layer, inside a layer rank by rank, each rank's in
// chunk order (with W = 1 the engine's own order).

// Layer span [*lo, *lo + *len) of the tensors t[0..n) at offsets goff.
void dp_layer_span(const AdamWTensor* t, const int64_t* goff, int n, int64_t* lo, int64_t* len);
// Rank `rank`'s pieces of them into out (param, grad, m, v advanced; NULL stays NULL; out_bf16
// NULL), each piece's tensor index into src and first element into at (either may be NULL).
// Returns the count (<= n).
int dp_layer_shard(const AdamWTensor* t, const int64_t* goff, int n, int world, int rank,
                   AdamWTensor* out, int* src, int64_t* at);
// Rank `rank`'s shard of every layer's state slab (m and v) as the engine lays it out:
// [lo[l], hi[l]) for each of tt's n_layers layers (store_create_shard).
void dp_engine_state_ranges(const TensorTable* tt, int world, int rank, int64_t* lo, int64_t* hi);
// The squared norm W engine ranks compute for the gradients s holds (reduced and tied ones
// folded): a single-process reference of the engine's clip.
double dp_engine_norm_sq(ThreadPool* pool, const Store* s, int world);

#endif  // LLMC_DP_H
