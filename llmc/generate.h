/*
 * generate.h — the generation engine: prompts in, sampled answers out, for up to S sequences at
 * once (the B·G answers of a GRPO step, or the one sequence of --sample-tokens). A prompt is
 * prefilled with the model's forward (model_block_forward_at on the prompt's tokens), its keys
 * and values copied into every slot of its group; then every active sequence gets one token per
 * decode step (model_block_decode_at: one row per sequence, ops->attention_decode against the
 * KV cache). Tokens are drawn from softmax(logits / temperature), optionally cut to the top-k
 * and the top-p nucleus, with one seeded RNG per sequence; a sequence stops at its stop token
 * (EOS, or the task's end of answer), its token budget or the cache's end.
 *
 * Every sampled token carries two log-probs: `logp`, under the distribution it was drawn from
 * (top-k / top-p renormalised), and `logp_full`, under the whole tempered softmax — the one the
 * trainer recomputes (ops.h policy_forward_backward, the same arithmetic), so the importance
 * ratio of an on-policy sample is 1 up to the forward's rounding (trl#6789: the truncated
 * support would bias it by log S per token). Every sequence records the weights' version.
 *
 * The weights: the generator's own copy of the store's parameters in the compute dtype (a
 * second buffer next to the trainer's, so a rollout can run on version v while v+1 trains;
 * gen_load_weights bumps the version), or the caller's slabs, borrowed (gen_borrow_weights).
 * The KV cache (L x 2 x S x maxT x KVH·HD in the compute dtype) is planned at creation and
 * refused with the numbers when it is over the budget.
 */
#ifndef LLMC_GENERATE_H
#define LLMC_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "ops.h"
#include "rng.h"
#include "store.h"

typedef struct GenOptions {
    int max_seqs;       // S: sequences generated at once
    int max_len;        // maxT: positions of a sequence, prompt and answer
    float temperature;  // 0: greedy (log-probs 0)
    int top_k;          // 0: off
    float top_p;        // 1: off
    double max_bytes;   // the generator's memory budget (0: none)
} GenOptions;

// One sequence: its tokens (prompt, then the answer) and the answer's log-probs.
typedef struct GenSeq {
    int32_t* tokens;    // (maxT) owned by the caller
    float* logp;        // (maxT) logp[t]: token t under its sampling distribution (answer only)
    float* logp_full;   // (maxT) token t under the full tempered softmax (answer only)
    int prompt_len;     // tokens[0 .. prompt_len) is the prompt
    int len;            // total tokens after generation
    int max_new;        // the answer's budget of tokens
    int stop_a, stop_b; // tokens that end the answer (kept as its last token), -1: none
    int stopped;        // 1: ended on a stop token (else on its budget or the cache's end)
    int64_t version;    // the weights' version that generated it
    Rng rng;            // its sampler (seed it before gen_run)
} GenSeq;

typedef struct Generator {
    const Model* m;
    const Ops* ops;
    void* ctx;
    GenOptions o;
    int n_layers;
    void** w;            // (n_layers) the weight slabs used (owned or borrowed)
    void** own;          // (n_layers) the generator's copy (NULL while borrowing)
    int64_t version;     // of the weights in w
    Workspace* ws_pre;   // prefill: 1 x maxT
    Workspace* ws_dec;   // decode: S x 1
    void* x[2];          // (max(maxT, S), C) residual streams
    void** kc;           // (L) key caches (S, maxT, KVH*HD)
    void** vc;           // (L) value caches
    int32_t* d_ids;      // (max(maxT, S)) device
    int32_t* d_slot;     // (S) device
    int32_t* d_len;      // (S) device
    int32_t *h_ids, *h_pos, *h_slot, *h_len, *h_row;  // host staging (S or maxT)
    // backend sampling (ops->sample_tokens, without top-k / top-p): one upload and one download
    // per decode step, a step issued before the one ahead of it is read (generate.c
    // decode_on_backend)
    int32_t* h_step;     // (6, S) host: [ids | slots | lens | positions | uniforms (fp32 bits) |
                         // each row's row in the step before (-1: its id is in ids)]
    int32_t* d_step;     // (6, S) device copy
    int32_t* h_out;      // (3, S) host: [tokens | log-probs (S, 2) fp32]
    int32_t* d_out;      // (3, S) device
    int32_t* h_rows[2];  // (S) the sequence of each row of the two steps in flight
    int32_t* h_ahead;    // (S) per sequence: its row in the last step issued, -1 if none
    float* logits;       // (S, V) host
    int64_t* order;      // (V) top-k / top-p scratch
    double* probs;       // (V)
    // the backend's recorded decode steps (ops->graph_*), one per row count n (index n), recorded
    // on the second step in a row with n rows (the first sized every buffer), replayed after
    void** graphs;       // (S + 1)
    GenOptions graph_o;  // the options they were recorded with (the sampler's temperature is
                         // in them: grpo_evaluate's greedy pass drops them)
    int last_n;          // rows of the previous decode step
    double t_prefill, t_decode;  // seconds spent, for the log
    int64_t n_decoded;   // tokens decoded and kept (not the rows dropped past a stop)
} Generator;

// 1 when the decode steps sample on the backend (ops->sample_tokens, no top-k / top-p).
int gen_samples_on_backend(const Generator* g);
// Bytes the generator allocates on the backend: KV cache, workspaces, buffers (and its own
// weight copy when own_weights).
size_t gen_bytes(const Model* m, int act_bytes, const GenOptions* o, int own_weights);
// -1 + err when the backend lacks the decode op or the memory is over o->max_bytes (the
// message says how much each part needs and which flag shrinks it).
int gen_create(Generator* g, const Model* m, const Ops* ops, void* ctx, const GenOptions* o,
               int own_weights, char* err);
void gen_free(Generator* g);
// The store's parameters into the generator's own weights, as `version` (the KV caches hold
// nothing between gen_run calls, so none outlives the weights it was computed with).
void gen_load_weights(Generator* g, const Store* s, int64_t version);
// The device slabs `slabs` (the plain path's compute-dtype weights on the same backend) copied
// into the generator's own weights, as `version` (device to device). Returns the bytes copied.
size_t gen_copy_weights(Generator* g, void* const* slabs, int64_t version);
// Host slabs already in the compute dtype (pinned for full speed: the engine's masters) uploaded
// into the generator's own weights, as `version`: each weight crosses the bus once, 2 B per
// parameter on bf16 devices. tail[l] > 0 uploads only the last tail[l] elements of layer l (the
// rest never changes), tail NULL whole slabs. Returns the bytes uploaded.
size_t gen_upload_weights(Generator* g, const void* const* host, const int64_t* tail,
                          int64_t version);
// Use these device slabs (the plain path's) as the weights (no copy).
void gen_borrow_weights(Generator* g, void* const* slabs, int64_t version);
// Generate for n sequences in groups of `group` consecutive sequences sharing one prompt (their
// prompts must be equal: the prompt is prefilled once per group). n <= max_seqs; each
// prompt_len + 1 <= max_len. Fills tokens, len, logp, logp_full, stopped, version.
void gen_run(Generator* g, GenSeq* seqs, int n, int group);
// Sample one token from logits (V) at temperature / top-k / top-p (g->o): the token, its
// log-prob under that distribution (*logp) and under the full tempered softmax (*logp_full).
int gen_sample(Generator* g, const float* logits, Rng* rng, float* logp, float* logp_full);

#endif  // LLMC_GENERATE_H
