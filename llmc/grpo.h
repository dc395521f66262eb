/*
 * grpo.h — GRPO on one process (colocated): rollouts from the generation engine (generate.h) on
 * the generator's copy of the weights, rewards (rl_task.h), group advantages, the clipped
 * policy-gradient step through the trainer (trainer_step_with; the loss in the chunked LM head,
 * model_postfix_policy), and the versioned weight sync back into the generator.
 *
 * Versions: version v = the weights after v optimizer steps (a resumed run starts at its step).
 * The generator's weights carry the version they were synced at; every answer records it.
 * On-policy (--off-policy 0) step t generates with v = t-1 and trains on that batch. One step
 * off (--off-policy 1) step t first generates the batch of step t+1 with v = t-1 — the rollout
 * that runs while step t trains when rollout and training have GPUs of their own; here the two
 * run one after the other — and trains on the batch generated during step t-1 (v = t-2), the
 * ratio π_θ / π_behaviour taken against the log-probs recorded at generation. A batch more than
 * --max-staleness versions behind the trained weights is generated again. The first step (and
 * the first after a resume: the pending batch is not in the checkpoint) has no batch from
 * before and generates its own.
 *
 * The split schedule (--rollout-gpus K, GrpoSplit): K rollout devices of their own, one
 * generator each (the prompts divided among them), while the engine trains on the others; one
 * step off, the rollout of step t+1 runs on a thread during step t's training and grpo_sync waits
 * for it (the batch boundary) before the weights change. The math is the colocated schedule's:
 * with --sync 1 the same samples and losses. The sync uploads the engine's masters to rollout
 * device 0, then broadcasts them to the others (weightsync.h: the manifest exchanged at
 * creation, each tensor placed by name).
 *
 * Rollout ranks (--rl-rollout-ranks R, GrpoSplit.R): rank 0 trains, ranks 1..R of a communicator
 * only generate; the message protocol between them is grpo_ranks.h's.
 *
 * The objective per answer token (ops.h policy_forward_backward): advantages Â_i from the
 * group's rewards (NaN masks an answer; a group with fewer than two scored answers or all
 * scores equal is skipped: no gradient, not in the normalisation), the clipped ratio, the k3 KL
 * to the initial policy (--kl-beta; the reference is the weights the run started from), and the
 * aggregation's weight per token (token: 1 / Σ|o|; sequence: 1 / (|o_i| · answers); dr-grpo:
 * 1 / (max tokens · answers)).
 */
#ifndef LLMC_GRPO_H
#define LLMC_GRPO_H

#include <pthread.h>
#include <stdint.h>

#include "args.h"
#include "device.h"
#include "generate.h"
#include "grpo_ranks.h"
#include "log.h"
#include "model.h"
#include "plain.h"
#include "rl_task.h"
#include "store.h"
#include "tokenizer.h"
#include "trainer.h"
#include "weightsync.h"

// One rollout: P prompts x G answers.
typedef struct GrpoBatch {
    int n;                 // P * G answers
    GenSeq* seqs;          // (n)
    int32_t* tokens;       // (n, maxT) storage of the sequences
    float* logp;           // (n, 2 maxT) their log-probs (sampling, full)
    char** prompts;        // (P) the prompts' text
    char** answers;        // (P) the reference answers
    char** completions;    // (n) the answers' text
    double* reward;        // (n) NaN: masked
    int* correct;          // (n) exact match with the reference
    float* adv;            // (n) advantages (0 in skipped groups)
    float* weight;         // (n) the aggregation's weight per token (0: no gradient)
    int64_t version;       // the weights' version that generated it
    int64_t for_step;      // the step it was generated for
    int ready;             // holds a rollout not trained on yet
    double rollout_s;      // generation and scoring time
} GrpoBatch;

// What a step reports (the step line and the JSON log).
typedef struct GrpoStats {
    double reward_mean;    // over scored answers
    double accuracy;       // exact matches over answers
    double ratio_mean;     // π_θ / π_behaviour over trained tokens
    double clip_frac;      // tokens where the clip is active
    double kl;             // mean k3 to the reference over trained tokens (with --kl-beta)
    double answer_len;     // mean tokens per answer
    int masked;            // answers without a reward
    int skipped_groups;    // groups with zero reward variance (or fewer than 2 scored)
    int64_t trained_tokens;
    int64_t version;       // of the batch trained on
    int staleness;         // trained weights' version - the batch's
    int regenerated;       // the pending batch was too stale and was generated again
    double rollout_s, train_s, sync_s, gen_tok_s;
    double sync_bytes;     // the weights moved into the generator
    double bcast_bytes;    // split: the bytes each other rollout device received
    double decode_tok_s;   // tokens per second of the decode steps alone (no prefill, rewards)
} GrpoStats;

typedef struct Grpo {
    const TrainArgs* a;
    const RlArgs* r;
    const Model* m;
    Store* s;
    Plain* p;
    const Tokenizer* tok;
    RlTask task;
    RewardCmd rc;
    Generator gen;
    int maxT;              // positions of a sequence (--seq)
    int stop_a, stop_b;
    GrpoBatch batch[2];    // the one trained this step and the next one (off-policy)
    int cur;               // index of the batch trained this step
    void** ref;            // (n_layers) reference weights on the backend (--kl-beta), or NULL
    // one micro-batch of the policy loss: host staging and device buffers (B*T each)
    int32_t *h_ids, *h_tgt;
    float *h_old, *h_adv, *h_w, *h_ref, *h_logp;
    float *d_old, *d_adv, *d_w, *d_ref, *d_logp, *d_loss;
    // the step through the RoundPipe engine (the trainer has one): the whole batch packed as
    // the engine's rows, host (n, T+1) tokens and (n, T) per-token inputs (EngineLoss)
    Engine* eng;           // the trainer's engine of the last step (NULL: plain training)
    int32_t *e_tok, *e_tgt;
    float *e_old, *e_adv, *e_w, *e_ref;
    GrpoStats st;          // of the last step
    // the split schedule (--rollout-gpus K): K rollout devices, one generator each (gen on the
    // first, xgen on the others), the answers divided among them by prompt; the new weights go
    // to the first (one upload), then a broadcast to the others after the manifest exchange;
    // with --off-policy 1 the next step's rollout runs on a thread while this step trains
    int K;                 // 0: colocated (gen on the plain path's backend)
    DeviceSet rdev;        // (K) the rollout devices
    Generator* xgen;       // (K - 1)
    WeightManifest* wman;  // (K) each rollout generator's layout
    WeightManifest wsend;  // the sender's (the trainer's masters) layout
    WeightBcast wb;
    pthread_t bg;          // the rollout running while the step trains
    int bg_on;
    int bg_step;           // the step it generates for
    double bg_s;           // its seconds
    double bg_decoded;     // tokens it decoded
    // the rollout ranks (--rl-rollout-ranks R, grpo_ranks.h; this process is rank 0): the
    // weights they get are the trainer's generator's (g->gen: synced as colocated, and the
    // held-out evaluation's)
    GrpoRanks ranks;       // R = 0: none
    double bcast_s;        // the last weight broadcast's seconds
} Grpo;

// Build the generator (its memory checked against host_budget bytes, 0: none), the task, the
// reference weights; the generator's weights = the store's, as `version`. With split->K > 0 one
// generator per rollout device (each checked against split->budget), their communicator and the
// manifest exchange. -1 + err.
int grpo_create(Grpo* g, const TrainArgs* a, const Model* m, Store* s, Plain* p,
                const Tokenizer* tok, int64_t version, double host_budget,
                const GrpoSplit* split, char* err);
void grpo_free(Grpo* g);
// Step `step`'s rollout(s): the batch it trains on (and, off-policy, the next step's).
void grpo_rollout(Grpo* g, int step);
// Step `step` trained on the current batch: through trainer_step_with on the plain path, or with
// the trainer's engine through its loss head (trainer_step_engine_loss: the trained rows first,
// in micro-batches of --batch rows as the plain path's; EngineOptions B = prompts x group,
// M = B / --batch, policy = 1), bit-identical to the plain path with --sync 1 on emulated devices.
// With the delayed update the gradient of step t is taken at the weights before step t-1 (one
// version older than the rollout's on-policy): the ratio corrects for it as for --off-policy.
StepStats grpo_train(Grpo* g, Trainer* tr, int step);
// The trained weights into the generator as version `version`: through the engine its
// compute-dtype masters of the last step applied (engine_latest_weights: with the delayed update
// the buffer one step ahead of the next iteration's), uploaded from pinned host memory, once, in
// the compute dtype (bit for bit the Store's fp32 weights converted on the device); on the plain
// path the Store's (CPU) or the plain path's device slabs (device to device).
void grpo_sync(Grpo* g, int64_t version);
// Split schedule: the weights of rollout device 0 broadcast to the others (after the manifest
// exchange); the bytes each received (0 with one rollout device). Fatal on a communicator error.
double grpo_broadcast(Grpo* g);
// Exact-match accuracy of greedy answers to the held-out problems (the generator's weights).
double grpo_evaluate(Grpo* g);

// The checkpoint's RL state after step `step` (TrainState.rl_state): the rollout generated ahead
// for step + 1 (one step off-policy), packed into a malloc'd buffer (NULL, *bytes 0: none), and
// put back on resume so the resumed run trains on the answers the straight run generated (their
// weights are gone by then). grpo_state_restore validates what it reads: -1 with err.
void* grpo_state_pack(const Grpo* g, int64_t step, size_t* bytes);
int grpo_state_restore(Grpo* g, const void* buf, size_t bytes, int64_t step, char* err);
// The step line and its JSON record.
void grpo_log_step(const Grpo* g, StepLog* lg, const StepStats* st);
void grpo_log_eval(StepLog* lg, int step, double accuracy, int n);

// Advantages and aggregation weights of a batch from its rewards (exposed for the tests):
// groups of G consecutive answers, answer lengths len (n), max_tokens for dr-grpo. Returns the
// number of skipped groups.
int grpo_advantages(const double* reward, const int* len, int n, int G, RlAdvStd adv_std,
                    RlLossAgg agg, int max_tokens, float* adv, float* weight);

#endif  // LLMC_GRPO_H
