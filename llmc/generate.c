/*
 * generate.c — the generation engine (generate.h): KV cache planning, prefill per prompt group,
 * batched decode of the active sequences, sampling with log-probs.
 */
#include "generate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef struct ProbIdx {
    double p;
    int v;
} ProbIdx;

// ----------------------------------------------------------------------------
// memory

// KV cache bytes: L layers x keys and values x S slots x maxT positions x KVH·HD.
static size_t kv_bytes(const Model* m, int act_bytes, const GenOptions* o) {
    const ModelConfig* c = &m->cfg;
    return (size_t)c->L * 2 * (size_t)o->max_seqs * (size_t)o->max_len * (size_t)c->KVH *
           (size_t)c->HD * (size_t)act_bytes;
}

static size_t weight_bytes(const Model* m, int act_bytes) {
    size_t b = 0;
    for (int l = 0; l < m->tt.n_layers; l++) b += (size_t)m->tt.param_numel[l] * act_bytes;
    return b;
}

size_t gen_bytes(const Model* m, int act_bytes, const GenOptions* o, int own_weights) {
    const size_t rows = (size_t)imax(o->max_len, o->max_seqs);
    size_t b = kv_bytes(m, act_bytes, o);
    b += workspace_bytes(m, act_bytes, 1, o->max_len, 1);
    b += workspace_bytes(m, act_bytes, o->max_seqs, 1, 1);
    b += 2 * rows * (size_t)m->cfg.C * act_bytes + rows * 4 + 2 * (size_t)o->max_seqs * 4;
    b += 9 * (size_t)o->max_seqs * 4;  // the backend sampler's step buffers
    b += (size_t)o->max_seqs * m->cfg.V * sizeof(float);
    if (own_weights) b += weight_bytes(m, act_bytes);
    return b;
}

// ----------------------------------------------------------------------------
// create / free / weights

int gen_create(Generator* g, const Model* m, const Ops* ops, void* ctx, const GenOptions* o,
               int own_weights, char* err) {
    memset(g, 0, sizeof *g);
    const ModelConfig* c = &m->cfg;
    if (!ops->attention_decode) {
        snprintf(err, ERR_LEN, "the %s backend has no decode attention yet: generation with a KV "
                 "cache runs on the CPU backend", ops->name);
        return -1;
    }
    if (o->max_seqs < 1 || o->max_len < 2) {
        snprintf(err, ERR_LEN, "generation needs at least one sequence of two positions (%d x %d)",
                 o->max_seqs, o->max_len);
        return -1;
    }
    const size_t need = gen_bytes(m, ops->act_bytes, o, own_weights);
    if (o->max_bytes > 0 && (double)need > o->max_bytes) {
        char kv[32], all[32], cap[32];
        format_bytes((double)kv_bytes(m, ops->act_bytes, o), kv, sizeof kv);
        format_bytes((double)need, all, sizeof all);
        format_bytes(o->max_bytes, cap, sizeof cap);
        snprintf(err, ERR_LEN, "generation of %d sequences x %d positions needs %s (KV cache %s) "
                 "and %s is available: fewer --rl-prompts / --rl-group, or a shorter "
                 "--rl-max-tokens", o->max_seqs, o->max_len, all, kv, cap);
        return -1;
    }
    g->m = m;
    g->ops = ops;
    g->ctx = ctx;
    g->o = *o;
    g->n_layers = m->tt.n_layers;
    g->w = calloc_check((size_t)g->n_layers, sizeof(void*));
    if (own_weights) {
        g->own = calloc_check((size_t)g->n_layers, sizeof(void*));
        for (int l = 0; l < g->n_layers; l++)
            if (m->tt.param_numel[l] > 0) {
                g->own[l] = ops->alloc(ctx, (size_t)m->tt.param_numel[l] * ops->act_bytes);
                g->w[l] = g->own[l];
            }
    }
    g->version = -1;
    const int S = o->max_seqs, maxT = o->max_len, rows = imax(maxT, S);
    const size_t KD = (size_t)c->KVH * c->HD, ab = (size_t)ops->act_bytes;
    g->ws_pre = workspace_create(m, ops, ctx, 1, maxT, 1);
    g->ws_dec = workspace_create(m, ops, ctx, S, 1, 1);
    if (g->ws_dec->mlp_chunk > 0) {
        snprintf(err, ERR_LEN, "generation of %d sequences at once with MLP chunks of %d rows is "
                 "not supported: fewer sequences", S, g->ws_dec->mlp_chunk);
        gen_free(g);
        return -1;
    }
    for (int i = 0; i < 2; i++) g->x[i] = ops->alloc(ctx, (size_t)rows * c->C * ab);
    g->kc = calloc_check((size_t)c->L, sizeof(void*));
    g->vc = calloc_check((size_t)c->L, sizeof(void*));
    for (int l = 0; l < c->L; l++) {
        g->kc[l] = ops->alloc(ctx, (size_t)S * maxT * KD * ab);
        g->vc[l] = ops->alloc(ctx, (size_t)S * maxT * KD * ab);
    }
    g->d_ids = ops->alloc(ctx, (size_t)rows * sizeof(int32_t));
    g->d_slot = ops->alloc(ctx, (size_t)S * sizeof(int32_t));
    g->d_len = ops->alloc(ctx, (size_t)S * sizeof(int32_t));
    g->h_ids = calloc_check((size_t)rows, sizeof(int32_t));
    g->h_pos = calloc_check((size_t)S, sizeof(int32_t));
    g->h_slot = calloc_check((size_t)S, sizeof(int32_t));
    g->h_len = calloc_check((size_t)S, sizeof(int32_t));
    g->h_row = calloc_check((size_t)S, sizeof(int32_t));
    g->logits = malloc_check((size_t)S * c->V * sizeof(float));
    if (ops->sample_tokens) {
        g->h_step = calloc_check((size_t)6 * S, sizeof(int32_t));
        g->h_out = calloc_check((size_t)3 * S, sizeof(int32_t));
        g->d_step = ops->alloc(ctx, (size_t)6 * S * sizeof(int32_t));
        g->d_out = ops->alloc(ctx, (size_t)3 * S * sizeof(int32_t));
        for (int i = 0; i < 2; i++) g->h_rows[i] = calloc_check((size_t)S, sizeof(int32_t));
        g->h_ahead = calloc_check((size_t)S, sizeof(int32_t));
    }
    g->probs = malloc_check((size_t)c->V * sizeof(ProbIdx));
    return 0;
}

// The free of every recorded decode step (the weights they read moved, or the end).
static void gen_graphs_free(Generator* g) {
    for (int n = 0; g->graphs && n <= g->o.max_seqs; n++)
        if (g->graphs[n]) {
            g->ops->graph_free(g->ctx, g->graphs[n]);
            g->graphs[n] = NULL;
        }
    g->last_n = 0;
}

void gen_free(Generator* g) {
    if (!g->m) return;
    const Ops* ops = g->ops;
    gen_graphs_free(g);
    free(g->graphs);
    for (int l = 0; g->own && l < g->n_layers; l++)
        if (g->own[l]) ops->free(g->ctx, g->own[l]);
    for (int l = 0; g->kc && l < g->m->cfg.L; l++) {
        ops->free(g->ctx, g->kc[l]);
        ops->free(g->ctx, g->vc[l]);
    }
    for (int i = 0; i < 2; i++)
        if (g->x[i]) ops->free(g->ctx, g->x[i]);
    void* dev[] = {g->d_ids, g->d_slot, g->d_len, g->d_step, g->d_out};
    for (int i = 0; i < 5; i++)
        if (dev[i]) ops->free(g->ctx, dev[i]);
    free(g->h_step);
    free(g->h_out);
    free(g->h_rows[0]);
    free(g->h_rows[1]);
    free(g->h_ahead);
    if (g->ws_pre) workspace_free(g->ws_pre);
    if (g->ws_dec) workspace_free(g->ws_dec);
    free(g->own);
    free(g->w);
    free(g->kc);
    free(g->vc);
    free(g->h_ids);
    free(g->h_pos);
    free(g->h_slot);
    free(g->h_len);
    free(g->h_row);
    free(g->logits);
    free(g->probs);
    memset(g, 0, sizeof *g);
}

void gen_load_weights(Generator* g, const Store* s, int64_t version) {
    if (!g->own) fatal("internal: gen_load_weights on a generator that borrows its weights");
    for (int l = 0; l < g->n_layers; l++)
        if (g->own[l])
            g->ops->upload_f32(g->ctx, g->own[l], s->param[l], (size_t)g->m->tt.param_numel[l]);
    g->version = version;
}

size_t gen_copy_weights(Generator* g, void* const* slabs, int64_t version) {
    if (!g->own) fatal("internal: gen_copy_weights on a generator that borrows its weights");
    size_t bytes = 0;
    for (int l = 0; l < g->n_layers; l++) {
        if (!g->own[l]) continue;
        const size_t b = (size_t)g->m->tt.param_numel[l] * g->ops->act_bytes;
        g->ops->copy(g->ctx, g->own[l], slabs[l], b);
        bytes += b;
    }
    g->version = version;
    return bytes;
}

size_t gen_upload_weights(Generator* g, const void* const* host, const int64_t* tail,
                          int64_t version) {
    if (!g->own) fatal("internal: gen_upload_weights on a generator that borrows its weights");
    const size_t ab = (size_t)g->ops->act_bytes;
    size_t bytes = 0;
    for (int l = 0; l < g->n_layers; l++) {
        if (!g->own[l]) continue;
        const int64_t numel = g->m->tt.param_numel[l];
        const int64_t n = tail ? tail[l] : numel;
        if (n <= 0) continue;
        g->ops->upload(g->ctx, (char*)g->own[l] + (size_t)(numel - n) * ab, host[l], (size_t)n * ab);
        bytes += (size_t)n * ab;
    }
    g->version = version;
    return bytes;
}

void gen_borrow_weights(Generator* g, void* const* slabs, int64_t version) {
    int moved = 0;
    for (int l = 0; l < g->n_layers; l++) moved |= g->w[l] != slabs[l];
    if (moved) gen_graphs_free(g);  // (the recorded steps read the old ones)
    for (int l = 0; l < g->n_layers; l++) g->w[l] = slabs[l];
    g->version = version;
}

// ----------------------------------------------------------------------------
// sampling

static int cmp_prob_desc(const void* pa, const void* pb) {
    const ProbIdx* a = pa;
    const ProbIdx* b = pb;
    if (a->p != b->p) return a->p < b->p ? 1 : -1;
    return a->v - b->v;  // ties: the lower token first (repeatable)
}

int gen_sample(Generator* g, const float* logits, Rng* rng, float* logp, float* logp_full) {
    const int V = g->m->cfg.V;
    const float temperature = g->o.temperature;
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    if (temperature <= 0.0f) {  // greedy: a point mass
        *logp = *logp_full = 0.0f;
        return best;
    }
    const float mx = logits[best], inv = 1.0f / temperature;
    // the full tempered log-softmax, in the arithmetic of ops.h policy_forward_backward
    double full = 0.0;
    for (int v = 0; v < V; v++) full += expf((logits[v] - mx) * inv);
    const double log_full = log(full);
    int tok = best;
    if (g->o.top_k <= 0 && g->o.top_p >= 1.0f) {
        // the whole distribution: one uniform draw walked down the vocabulary (the draws of the
        // sliding-window sampler this engine replaced, so a seed gives the same text)
        double sum = 0.0;
        for (int v = 0; v < V; v++) sum += exp((logits[v] - mx) / temperature);
        double r = rng_uniform(rng) * sum;
        for (int v = 0; v < V; v++) {
            r -= exp((logits[v] - mx) / temperature);
            if (r <= 0.0) {
                tok = v;
                break;
            }
        }
        *logp_full = (float)((double)((logits[tok] - mx) * inv) - log_full);
        *logp = *logp_full;
        return tok;
    }
    // top-k, then the smallest prefix of the sorted probabilities holding top_p of their mass
    ProbIdx* pi = (ProbIdx*)g->probs;
    for (int v = 0; v < V; v++) {
        pi[v].p = exp((logits[v] - mx) / temperature);
        pi[v].v = v;
    }
    qsort(pi, (size_t)V, sizeof *pi, cmp_prob_desc);
    const int k = g->o.top_k > 0 && g->o.top_k < V ? g->o.top_k : V;
    double mass = 0.0;
    for (int i = 0; i < k; i++) mass += pi[i].p;
    int keep = 0;
    double kept = 0.0;
    while (keep < k) {
        kept += pi[keep++].p;
        if (kept >= (double)g->o.top_p * mass) break;
    }
    double r = rng_uniform(rng) * kept;
    int pick = keep - 1;
    for (int i = 0; i < keep; i++) {
        r -= pi[i].p;
        if (r <= 0.0) {
            pick = i;
            break;
        }
    }
    tok = pi[pick].v;
    *logp = (float)log(pi[pick].p / kept);
    *logp_full = (float)((double)((logits[tok] - mx) * inv) - log_full);
    return tok;
}

// ----------------------------------------------------------------------------
// prefill and decode

// Device pointer of tensor `kind`'s parameters in the generator's weights.
static const void* weight_of(const Generator* g, TensorKind kind) {
    const TensorTable* tt = &g->m->tt;
    const TensorDesc* d = &tt->t[tensor_table_index(tt, kind, -1)];
    return (const char*)g->w[d->owner_layer] + (size_t)d->param_offset * g->ops->act_bytes;
}

// True while sequence s, at len tokens, may take another one (stop tokens aside).
static int seq_room(const Generator* g, const GenSeq* s, int len) {
    return len < s->prompt_len + s->max_new && len < g->o.max_len;
}

// True while sequence s may take another token.
static int seq_active(const Generator* g, const GenSeq* s) {
    return !s->stopped && seq_room(g, s, s->len);
}

// Token tok with its log-probs appended to s.
static void seq_push(GenSeq* s, int tok, float lp, float lpf) {
    s->tokens[s->len] = tok;
    s->logp[s->len] = lp;
    s->logp_full[s->len] = lpf;
    s->len++;
    if (tok == s->stop_a || tok == s->stop_b) s->stopped = 1;
}

// One token sampled on the host appended to s (its log-probs at its position).
static void seq_append(Generator* g, GenSeq* s, const float* logits) {
    float lp, lpf;
    const int tok = gen_sample(g, logits, &s->rng, &lp, &lpf);
    seq_push(s, tok, lp, lpf);
}

// --profile-ops: the ops from here on belong to generator phase `name` (NULL: none).
static void gen_phase(const Generator* g, const char* name) {
    if (g->ops->profile_phase) g->ops->profile_phase(g->ctx, name);
}

int gen_samples_on_backend(const Generator* g) {
    return g->ops->sample_tokens && g->o.top_k <= 0 && g->o.top_p >= 1.0f;
}

// The group's prompt through the model's forward into cache slot `first`, its keys and values
// copied to the other slots of the group; then each sequence's first token.
static void prefill_group(Generator* g, GenSeq* seqs, int first, int group) {
    const Model* m = g->m;
    const Ops* ops = g->ops;
    const ModelConfig* c = &m->cfg;
    Workspace* ws = g->ws_pre;
    const GenSeq* s0 = &seqs[first];
    const int P = s0->prompt_len, maxT = g->o.max_len, QD = c->H * c->HD, KD = c->KVH * c->HD;
    const size_t ab = (size_t)ops->act_bytes;
    if (P < 1 || P >= maxT)
        fatal("internal: a prompt of %d tokens for a cache of %d positions", P, maxT);
    ws->lora_train = 0;
    ops->upload(g->ctx, g->d_ids, s0->tokens, (size_t)P * sizeof(int32_t));
    model_prefix_forward(m, ws, g->x[0], g->d_ids, weight_of(g, TK_EMBED), 1, P);
    int cur = 0;
    for (int l = 0; l < c->L; l++) {
        model_block_forward_at(m, ws, &ws->acts[0], l, g->w[l + 1], g->x[cur], g->x[1 - cur], 1, P);
        cur = 1 - cur;
        const char* qkv = model_block_qkv(ws, &ws->acts[0]);
        char* kc = (char*)g->kc[l] + (size_t)first * maxT * KD * ab;
        char* vc = (char*)g->vc[l] + (size_t)first * maxT * KD * ab;
        // the k and v columns of the P rows in one op each (a GPU would otherwise issue two
        // copies per position)
        ops->copy_cols(g->ctx, kc, qkv, P, m->QKV, QD, KD);
        ops->copy_cols(g->ctx, vc, qkv, P, m->QKV, QD + KD, KD);
        for (int j = 1; j < group; j++) {
            const size_t off = (size_t)(first + j) * maxT * KD * ab;
            ops->copy(g->ctx, (char*)g->kc[l] + off, kc, (size_t)P * KD * ab);
            ops->copy(g->ctx, (char*)g->vc[l] + off, vc, (size_t)P * KD * ab);
        }
    }
    model_postfix_logits_last(m, ws, weight_of(g, TK_FINAL_NORM), weight_of(g, TK_LM_HEAD),
                              g->x[cur], ws->logits, 1, P);
    if (gen_samples_on_backend(g)) {
        // the group's first tokens on the backend: the logits row once per sequence (the decode
        // workspace's rows), each sequence's uniform from its own RNG, as on the host
        const int S = g->o.max_seqs;
        float* u = (float*)(g->h_step + 4 * S);
        for (int j = 0; j < group; j++) {
            GenSeq* s = &seqs[first + j];
            u[j] = seq_active(g, s) && g->o.temperature > 0.0f ? rng_uniform(&s->rng) : 0.0f;
            ops->copy(g->ctx, (char*)g->ws_dec->logits + (size_t)j * c->V * ab, ws->logits,
                      (size_t)c->V * ab);
        }
        ops->upload(g->ctx, g->d_step + 4 * S, u, (size_t)group * sizeof(float));
        ops->sample_tokens(g->ctx, g->d_out, (float*)(g->d_out + S), g->ws_dec->logits,
                           (const float*)(g->d_step + 4 * S), group, c->V, g->o.temperature);
        ops->download(g->ctx, g->h_out, g->d_out, (size_t)3 * S * sizeof(int32_t));
        const float* lp = (const float*)(g->h_out + S);
        for (int j = 0; j < group; j++) {
            GenSeq* s = &seqs[first + j];
            if (seq_active(g, s)) seq_push(s, g->h_out[j], lp[2 * j], lp[2 * j + 1]);
        }
        return;
    }
    ops->download_f32(g->ctx, g->logits, ws->logits, (size_t)c->V);
    for (int j = 0; j < group; j++) {
        GenSeq* s = &seqs[first + j];
        if (seq_active(g, s)) seq_append(g, s, g->logits);
    }
}

// The decode step's device work for the rows of r (their ids, slots, lengths, positions and
// uniforms already uploaded): embedding, blocks with the KV append, final norm, head and sampler,
// into d_out. Only backend buffers of fixed size: recordable (ops->graph_begin).
static void decode_forward_sample(Generator* g, const DecodeRows* r) {
    const Model* m = g->m;
    const Ops* ops = g->ops;
    const ModelConfig* c = &m->cfg;
    Workspace* ws = g->ws_dec;
    const int S = g->o.max_seqs, n = r->n;
    ws->lora_train = 0;
    gen_phase(g, "decode step: embedding + blocks");
    // the ids of rows whose newest token the step before sampled (still in d_out)
    if (ops->gather_ids) ops->gather_ids(g->ctx, g->d_step, g->d_out, g->d_step + 5 * S, n);
    model_prefix_forward(m, ws, g->x[0], g->d_step, weight_of(g, TK_EMBED), n, 1);
    // each block's residual add is left pending and done by the next norm, into the same x
    for (int l = 0; l < c->L; l++)
        model_block_decode_at(m, ws, l, g->w[l + 1], g->kc[l], g->vc[l], r, g->x[0], l > 0);
    // model_postfix_logits_last's final norm and head, for the n rows in one matmul
    gen_phase(g, "decode step: final norm + head + sampler");
    model_decode_final_norm(m, ws, weight_of(g, TK_FINAL_NORM), g->x[0], n);
    ops->matmul_forward(g->ctx, ws->logits, ws->xf, weight_of(g, TK_LM_HEAD), NULL, n, c->C,
                        c->V);
    ops->sample_tokens(g->ctx, g->d_out, (float*)(g->d_out + S), ws->logits,
                       (const float*)(g->d_step + 4 * S), n, c->V, g->o.temperature);
    gen_phase(g, NULL);
}

// decode_forward_sample as one recorded launch (the backend's graphs: ~11 ops a layer in one
// launch, no gaps between them): replayed when the step's row count has a recording, recorded on
// the second step in a row with that count (the first one ran plainly and sized every scratch
// buffer). 0 when it did not run (no graphs, the first step of a count, a refused recording):
// the caller runs the ops plainly.
static int decode_replay(Generator* g, const DecodeRows* r) {
    const Ops* ops = g->ops;
    const int n = r->n;
    if (!ops->graph_begin) return 0;
    if (!g->graphs) g->graphs = calloc_check((size_t)g->o.max_seqs + 1, sizeof(void*));
    const GenOptions* a = &g->o;
    const GenOptions* b = &g->graph_o;
    if (a->temperature != b->temperature || a->top_k != b->top_k || a->top_p != b->top_p ||
        a->max_len != b->max_len || a->max_seqs != b->max_seqs) {
        gen_graphs_free(g);  // (recorded with other options: the sampler's temperature)
        g->graph_o = g->o;
    }
    if (g->graphs[n]) {
        if (ops->graph_launch(g->ctx, g->graphs[n]) == 0) return 1;
        ops->graph_free(g->ctx, g->graphs[n]);  // stale: a scratch buffer it read has moved
        g->graphs[n] = NULL;
    }
    if (g->last_n != n) {
        g->last_n = n;
        return 0;
    }
    if (ops->graph_begin(g->ctx) != 0) return 0;
    decode_forward_sample(g, r);
    g->graphs[n] = ops->graph_end(g->ctx);
    return g->graphs[n] && ops->graph_launch(g->ctx, g->graphs[n]) == 0;
}

// The decode steps with the sampler on the backend, each issued before the one ahead of it is
// read, so the backend never waits for the host between steps (where the backend has
// overlapped transfers and gather_ids; else one step at a time). Issuing step t + 1 before
// step t's tokens are on the host works because nothing it needs depends on them but the
// tokens themselves: those stay on the backend (ops->gather_ids takes each row's from step t's
// samples), a sequence's length and position follow from its count, and its uniform is the next
// draw of its RNG. A sequence whose step-t token stops it is in step t + 1 all the same (the host
// could not know): that row's token is dropped and its draw taken back (rng_unget_u32), so the
// texts, log-probs and RNG streams are the one-step-at-a-time loop's. Budget ends are known
// ahead: such a sequence is not issued again.

// Issues the next step into download slot `slot`: a row for every sequence with room after the
// step in flight (g->h_ahead), rows[] its sequences. Returns the row count (0: none, nothing
// issued).
static int decode_issue(Generator* g, GenSeq* seqs, int n_seqs, int32_t* rows, int slot,
                        int overlap) {
    const Ops* ops = g->ops;
    const int S = g->o.max_seqs;
    int32_t* ids = g->h_step;
    int32_t* slots = g->h_step + S;
    int32_t* len = g->h_step + 2 * S;
    int32_t* pos = g->h_step + 3 * S;
    float* u = (float*)(g->h_step + 4 * S);
    int32_t* from = g->h_step + 5 * S;
    int n = 0;
    for (int i = 0; i < n_seqs; i++) {
        GenSeq* s = &seqs[i];
        const int ahead = g->h_ahead[i] >= 0;  // a token of s is in flight
        if (s->stopped || !seq_room(g, s, s->len + ahead)) continue;
        rows[n] = i;
        from[n] = g->h_ahead[i];
        ids[n] = ahead ? 0 : s->tokens[s->len - 1];  // its newest token, not yet in the cache
        pos[n] = s->len + ahead - 1;
        len[n] = pos[n] + 1;
        slots[n] = i;
        u[n] = g->o.temperature > 0.0f ? rng_uniform(&s->rng) : 0.0f;  // greedy draws nothing
        n++;
    }
    if (n == 0) return 0;
    for (int i = 0; i < n_seqs; i++) g->h_ahead[i] = -1;
    for (int k = 0; k < n; k++) g->h_ahead[rows[k]] = k;
    if (overlap)
        ops->upload_async(g->ctx, g->d_step, g->h_step, (size_t)6 * S * sizeof(int32_t), slot);
    else
        ops->upload(g->ctx, g->d_step, g->h_step, (size_t)6 * S * sizeof(int32_t));
    const DecodeRows r = {.n = n, .pos = pos, .slot = slots, .d_slot = g->d_step + S,
                          .d_len = g->d_step + 2 * S, .d_pos = g->d_step + 3 * S,
                          .rope_cos = g->ws_pre->rope_cos, .rope_sin = g->ws_pre->rope_sin,
                          .maxT = g->o.max_len};
    if (!decode_replay(g, &r)) decode_forward_sample(g, &r);
    if (overlap) ops->download_start(g->ctx, g->d_out, (size_t)3 * S * sizeof(int32_t), slot);
    return n;
}

// Reads the step of n rows (their sequences rows[]) issued into download slot `slot`: each
// row's token and log-probs appended to its sequence, but for a sequence that had stopped.
static void decode_read(Generator* g, GenSeq* seqs, const int32_t* rows, int n, int slot,
                        int overlap) {
    const Ops* ops = g->ops;
    const int S = g->o.max_seqs;
    if (overlap)
        ops->download_finish(g->ctx, g->h_out, (size_t)3 * S * sizeof(int32_t), slot);
    else
        ops->download(g->ctx, g->h_out, g->d_out, (size_t)3 * S * sizeof(int32_t));
    const float* lp = (const float*)(g->h_out + S);
    for (int k = 0; k < n; k++) {
        GenSeq* s = &seqs[rows[k]];
        if (s->stopped) {  // issued before its stop token was read: dropped, its draw given back
            if (g->o.temperature > 0.0f) rng_unget_u32(&s->rng);
            continue;
        }
        seq_push(s, g->h_out[k], lp[2 * k], lp[2 * k + 1]);
        g->n_decoded++;
    }
}

static void decode_on_backend(Generator* g, GenSeq* seqs, int n_seqs) {
    const Ops* ops = g->ops;
    const int overlap = ops->upload_async && ops->download_start && ops->download_finish &&
                        ops->gather_ids;
    const int depth = overlap ? 2 : 1;  // steps in flight at most
    int n_rows[2] = {0, 0}, oldest = 0, in_flight = 0;
    for (int i = 0; i < n_seqs; i++) g->h_ahead[i] = -1;
    for (;;) {
        if (in_flight < depth) {
            const int b = (oldest + in_flight) % 2;
            n_rows[b] = decode_issue(g, seqs, n_seqs, g->h_rows[b], b, overlap);
            if (n_rows[b] > 0 && ++in_flight < depth) continue;  // issue the next one first
        }
        if (in_flight == 0) break;
        decode_read(g, seqs, g->h_rows[oldest], n_rows[oldest], oldest, overlap);
        oldest = (oldest + 1) % 2;
        if (--in_flight == 0)
            for (int i = 0; i < n_seqs; i++) g->h_ahead[i] = -1;  // every token is on the host
    }
}

// One decode step of every active sequence, sampled on the host; 0 when none is left.
static int decode_step(Generator* g, GenSeq* seqs, int n_seqs) {
    const Model* m = g->m;
    const Ops* ops = g->ops;
    const ModelConfig* c = &m->cfg;
    Workspace* ws = g->ws_dec;
    int n = 0;
    for (int i = 0; i < n_seqs; i++) {
        GenSeq* s = &seqs[i];
        if (!seq_active(g, s)) continue;
        g->h_row[n] = i;
        g->h_ids[n] = s->tokens[s->len - 1];  // its newest token, not yet in the cache
        g->h_pos[n] = s->len - 1;
        g->h_slot[n] = i;
        g->h_len[n] = s->len;
        n++;
    }
    if (n == 0) return 0;
    ops->upload(g->ctx, g->d_ids, g->h_ids, (size_t)n * sizeof(int32_t));
    ops->upload(g->ctx, g->d_slot, g->h_slot, (size_t)n * sizeof(int32_t));
    ops->upload(g->ctx, g->d_len, g->h_len, (size_t)n * sizeof(int32_t));
    const DecodeRows r = {.n = n, .pos = g->h_pos, .slot = g->h_slot, .d_slot = g->d_slot,
                          .d_len = g->d_len, .rope_cos = g->ws_pre->rope_cos,
                          .rope_sin = g->ws_pre->rope_sin, .maxT = g->o.max_len};
    ws->lora_train = 0;
    gen_phase(g, "decode step: embedding + blocks");
    model_prefix_forward(m, ws, g->x[0], g->d_ids, weight_of(g, TK_EMBED), n, 1);
    // each block's residual add is left pending and done by the next norm, into the same x
    for (int l = 0; l < c->L; l++)
        model_block_decode_at(m, ws, l, g->w[l + 1], g->kc[l], g->vc[l], &r, g->x[0], l > 0);
    gen_phase(g, "decode step: final norm + head");
    model_decode_final_norm(m, ws, weight_of(g, TK_FINAL_NORM), g->x[0], n);
    model_postfix_head_last(m, ws, weight_of(g, TK_LM_HEAD), ws->logits, n, 1);
    gen_phase(g, NULL);
    ops->download_f32(g->ctx, g->logits, ws->logits, (size_t)n * c->V);
    for (int k = 0; k < n; k++)
        seq_append(g, &seqs[g->h_row[k]], g->logits + (size_t)k * c->V);
    g->n_decoded += n;
    return n;
}

void gen_run(Generator* g, GenSeq* seqs, int n, int group) {
    if (n > g->o.max_seqs || group < 1 || n % group != 0)
        fatal("internal: gen_run of %d sequences in groups of %d (capacity %d)", n, group,
              g->o.max_seqs);
    for (int i = 0; i < n; i++) {
        seqs[i].len = seqs[i].prompt_len;
        seqs[i].stopped = 0;
        seqs[i].version = g->version;
    }
    double t0 = time_now_s();
    gen_phase(g, "prefill (with its uploads and first tokens)");
    for (int first = 0; first < n; first += group) prefill_group(g, seqs, first, group);
    gen_phase(g, NULL);
    double t1 = time_now_s();
    if (gen_samples_on_backend(g))
        decode_on_backend(g, seqs, n);
    else
        while (decode_step(g, seqs, n) > 0) {
        }
    g->t_prefill += t1 - t0;
    g->t_decode += time_now_s() - t1;
}
