/*
 * grpo_ranks.c — the rollout ranks' message protocol (grpo_ranks.h): the trainer's side (rank 0:
 * the batch out, the answers back, the weights after each step, the stop) and grpo_serve, a
 * rollout rank's loop; over the communicator the caller hands in.
 */
#include "grpo_ranks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

// ----------------------------------------------------------------------------
// the messages

// Every message starts with this header, broadcast from rank 0 (the trainer); the ops that
// follow depend on its kind, the same on every rank (one op sequence per communicator).
enum { RANK_GENERATE = 1, RANK_WEIGHTS = 2, RANK_STOP = 3 };
typedef struct RankMsg {
    int32_t kind;
    int32_t n, group, maxT;  // GENERATE: the batch's shape (the rollout ranks check it)
    int64_t version;         // WEIGHTS: the version sent; GENERATE: the one expected
    int64_t payload;         // GENERATE: the prompts' bytes broadcast next
    int64_t reserved[2];     // (zero: 48 bytes in all)
} RankMsg;

// GENERATE's payload, per answer: what gen_run needs (the prompt's tokens follow, maxT each).
typedef struct RankSeqIn {
    int32_t prompt_len, max_new, stop_a, stop_b;
    Rng rng;  // its sampler, seeded by the trainer (answer_seed): the colocated run's stream
} RankSeqIn;

// An answer back (its tokens (maxT) and log-probs (2 maxT: sampling, full) follow).
typedef struct RankSeqOut {
    int32_t len, stopped;
    int64_t version;
} RankSeqOut;

// A rollout rank's block of the answers' all-gather: this head, then cap answers.
typedef struct RankAnsHead {
    int64_t n;                   // answers in the block
    double decoded, decode_s;    // its generator's counters so far (for the step line)
} RankAnsHead;

#define RANK_VERDICT_BYTES 384

// The groups [*p0, *p1) of P that rollout rank q (1..R) generates (as generate_shares divides
// them among rollout devices).
static void rank_groups(int P, int R, int q, int* p0, int* p1) {
    *p0 = (int)((int64_t)P * (q - 1) / R);
    *p1 = (int)((int64_t)P * q / R);
}

static size_t even(size_t bytes) { return (bytes + 1) & ~(size_t)1; }

// bytes (even) of buf from rank 0 to every rank, host memory (the communicator stages it).
static int rank_bcast(Comm* c, void* buf, size_t bytes, char* err) {
    if (comm_broadcast(c, buf, buf, bytes / 2, COMM_BF16, 0, NULL) == 0) return 0;
    char msg[ERR_LEN];
    return errorf(err, "rollout ranks: %s", comm_error(c, msg, sizeof msg) ? msg : "failed");
}

// The answers' block size for a batch of P x G answers of maxT positions over R rollout ranks.
static size_t rank_block_bytes(int P, int G, int R, int maxT) {
    const size_t cap = (size_t)((P + R - 1) / R) * G;
    return even(sizeof(RankAnsHead) + cap * (sizeof(RankSeqOut) + (size_t)maxT * 3 * 4));
}

// Every rank's verdict (mine: "" ready, else why not) to every rank: the first refusal in rank
// order becomes err on all of them, so a rollout rank that cannot start fails the trainer with
// its reason instead of leaving it waiting. 0 when every rank is ready.
static int rank_verdicts(Comm* c, const char* mine, char* err) {
    const size_t all = (size_t)c->world * RANK_VERDICT_BYTES;
    char* buf = calloc_check(all, 1);
    char* own = buf + (size_t)c->rank * RANK_VERDICT_BYTES;
    snprintf(own, RANK_VERDICT_BYTES, "%s", mine);
    int rc = 0;
    if (comm_all_gather(c, own, buf, RANK_VERDICT_BYTES / 2, COMM_BF16, NULL) != 0) {
        char msg[ERR_LEN];
        rc = errorf(err, "rollout ranks: %s", comm_error(c, msg, sizeof msg) ? msg : "failed");
    }
    for (int q = 0; q < c->world && rc == 0; q++) {
        char* v = buf + (size_t)q * RANK_VERDICT_BYTES;
        v[RANK_VERDICT_BYTES - 1] = '\0';
        if (v[0]) rc = errorf(err, "rank %d: %s", q, v);
    }
    free(buf);
    return rc;
}

// ----------------------------------------------------------------------------
// the trainer's side (rank 0)

int grpo_ranks_create(GrpoRanks* x, const GrpoSplit* split, const Model* m, const Generator* gen,
                      int64_t version, char* err) {
    Comm* c = split->comm;
    if (!c || c->rank != 0 || c->world != split->R + 1)
        return errorf(err, "internal: --rl-rollout-ranks %d on rank %d of %d", split->R,
                      c ? c->rank : -1, c ? c->world : 0);
    x->R = split->R;
    x->comm = c;
    x->dec = calloc_check((size_t)x->R, sizeof(double));
    x->tdec = calloc_check((size_t)x->R, sizeof(double));
    if (rank_verdicts(c, "", err) != 0) return -1;
    x->impl = split->impl;
    x->dev = split->impl->open(split->first, &split->opt);
    if (!x->dev) fatal("cannot open device %s:%d for the weight broadcast", split->impl->name,
                       split->first);
    const CommStream st = {.impl = split->impl, .dev = x->dev, .stream = STREAM_COMPUTE};
    weight_manifest_build(&x->man, &m->tt, gen->ops->act_bytes);
    if (weight_rank_manifest(&x->wr, c, &st, 0, WEIGHT_SEND, &x->man, err) != 0) return -1;
    x->live = 1;
    return grpo_ranks_send_weights(x, gen, version, err) < 0 ? -1 : 0;
}

int64_t grpo_ranks_send_weights(GrpoRanks* x, const Generator* gen, int64_t version, char* err) {
    RankMsg h = {.kind = RANK_WEIGHTS, .version = version};
    if (rank_bcast(x->comm, &h, sizeof h, err) != 0) return -1;
    return weight_rank_run(&x->wr, gen->own, err);
}

// The prompts and samplers out in one broadcast, each rank's answers back in one all-gather.
void grpo_ranks_generate(GrpoRanks* x, GenSeq* seqs, int P, int G, int maxT, int64_t version) {
    char err[ERR_LEN];
    const int n = P * G, T = maxT, R = x->R;
    const size_t in_bytes = even((size_t)n * (sizeof(RankSeqIn) + (size_t)T * 4));
    RankMsg h = {.kind = RANK_GENERATE, .n = n, .group = G, .maxT = T,
                 .version = version, .payload = (int64_t)in_bytes};
    char* in = calloc_check(in_bytes, 1);
    int32_t* toks = (int32_t*)(in + (size_t)n * sizeof(RankSeqIn));
    for (int i = 0; i < n; i++) {
        const GenSeq* q = &seqs[i];
        const RankSeqIn s = {.prompt_len = q->prompt_len, .max_new = q->max_new,
                             .stop_a = q->stop_a, .stop_b = q->stop_b, .rng = q->rng};
        memcpy(in + (size_t)i * sizeof s, &s, sizeof s);
        memcpy(toks + (size_t)i * T, q->tokens, (size_t)q->prompt_len * sizeof(int32_t));
    }
    if (rank_bcast(x->comm, &h, sizeof h, err) != 0 || rank_bcast(x->comm, in, in_bytes, err) != 0)
        fatal("--rl-rollout-ranks: %s", err);
    free(in);
    const size_t block = rank_block_bytes(P, G, R, T);
    char* all = calloc_check(block * (size_t)(R + 1), 1);
    if (comm_all_gather(x->comm, all, all, block / 2, COMM_BF16, NULL) != 0) {
        char msg[ERR_LEN];
        fatal("--rl-rollout-ranks: the answers: %s",
              comm_error(x->comm, msg, sizeof msg) ? msg : "failed");
    }
    for (int q = 1; q <= R; q++) {
        const char* b = all + (size_t)q * block;
        int p0, p1;
        rank_groups(P, R, q, &p0, &p1);
        RankAnsHead ah;
        memcpy(&ah, b, sizeof ah);
        const int cnt = (p1 - p0) * G;
        if (ah.n != cnt)
            fatal("--rl-rollout-ranks: rollout rank %d sent %lld answers, not its %d", q,
                  (long long)ah.n, cnt);
        x->dec[q - 1] = ah.decoded;
        x->tdec[q - 1] = ah.decode_s;
        const char* outs = b + sizeof ah;
        const int32_t* otok = (const int32_t*)(outs + (size_t)cnt * sizeof(RankSeqOut));
        const float* olp = (const float*)(otok + (size_t)cnt * T);
        for (int j = 0; j < cnt; j++) {
            GenSeq* s = &seqs[(size_t)p0 * G + j];
            RankSeqOut o;
            memcpy(&o, outs + (size_t)j * sizeof o, sizeof o);
            if (o.len < s->prompt_len || o.len > T || o.version != version)
                fatal("--rl-rollout-ranks: rollout rank %d: answer %d has %d tokens after a "
                      "prompt of %d, by weights v%lld (the trainer's are v%lld)", q, j,
                      (int)o.len, s->prompt_len, (long long)o.version,
                      (long long)version);
            s->len = o.len;
            s->stopped = o.stopped;
            s->version = o.version;
            memcpy(s->tokens, otok + (size_t)j * T, (size_t)T * sizeof(int32_t));
            memcpy(s->logp, olp + (size_t)j * 2 * T, (size_t)T * sizeof(float));
            memcpy(s->logp_full, olp + (size_t)j * 2 * T + T, (size_t)T * sizeof(float));
        }
    }
    free(all);
}

void grpo_ranks_free(GrpoRanks* x) {
    if (x->live) {
        // (the run is trained: a rollout rank gone by now costs no checkpoint or export)
        char err[ERR_LEN];
        RankMsg h = {.kind = RANK_STOP};
        if (rank_bcast(x->comm, &h, sizeof h, err) != 0)
            printf("warning: --rl-rollout-ranks: the stop did not reach every rollout rank: "
                   "%s\n", err);
        x->live = 0;
    }
    if (x->wr.comm) weight_rank_close(&x->wr);
    weight_manifest_free(&x->man);
    if (x->dev) x->impl->close(x->dev);
    x->dev = NULL;
    free(x->dec);
    free(x->tdec);
    x->dec = x->tdec = NULL;
}

// ----------------------------------------------------------------------------
// a rollout rank's side (ranks 1..R)

// A rollout rank's generation of one GENERATE message: the payload received, its groups run,
// its block of the answers' all-gather. -1 + err.
static int serve_generate(Comm* c, Generator* gen, const RankMsg* h, int R, GenSeq* seqs,
                          int cap, int* groups, char* err) {
    const int n = h->n, G = h->group, T = h->maxT, P = n / G;
    if (h->payload != (int64_t)even((size_t)n * (sizeof(RankSeqIn) + (size_t)T * 4)) ||
        T != gen->o.max_len || G < 1 || n % G != 0 || (P + R - 1) / R * G > cap)
        return errorf(err, "rollout rank %d: a batch of %d answers in groups of %d, %d positions, "
                      "is not what its flags make (run every rank with the same flags)",
                      c->rank, n, G, T);
    if (h->version != gen->version)
        return errorf(err, "rollout rank %d: the batch wants weights v%lld, it holds v%lld",
                      c->rank, (long long)h->version, (long long)gen->version);
    char* in = malloc_check((size_t)h->payload);
    if (rank_bcast(c, in, (size_t)h->payload, err) != 0) {
        free(in);
        return -1;
    }
    int p0, p1;
    rank_groups(P, R, c->rank, &p0, &p1);
    const int cnt = (p1 - p0) * G;
    *groups = p1 - p0;
    const int32_t* toks = (const int32_t*)(in + (size_t)n * sizeof(RankSeqIn));
    for (int j = 0; j < cnt; j++) {
        const int i = p0 * G + j;
        RankSeqIn s;
        memcpy(&s, in + (size_t)i * sizeof s, sizeof s);
        GenSeq* q = &seqs[j];
        if (s.prompt_len < 1 || s.prompt_len > T - 2) {
            free(in);
            return errorf(err, "rollout rank %d: answer %d's prompt has %d tokens in %d "
                          "positions", c->rank, i, (int)s.prompt_len, T);
        }
        memcpy(q->tokens, toks + (size_t)i * T, (size_t)s.prompt_len * sizeof(int32_t));
        q->prompt_len = s.prompt_len;
        q->max_new = s.max_new;
        q->stop_a = s.stop_a;
        q->stop_b = s.stop_b;
        q->rng = s.rng;
    }
    free(in);
    if (cnt > 0) gen_run(gen, seqs, cnt, G);
    const size_t block = rank_block_bytes(P, G, R, T);
    char* all = calloc_check(block * (size_t)c->world, 1);
    char* b = all + (size_t)c->rank * block;
    const RankAnsHead ah = {.n = cnt, .decoded = (double)gen->n_decoded,
                            .decode_s = gen->t_decode};
    memcpy(b, &ah, sizeof ah);
    char* outs = b + sizeof ah;
    int32_t* otok = (int32_t*)(outs + (size_t)cnt * sizeof(RankSeqOut));
    float* olp = (float*)(otok + (size_t)cnt * T);
    for (int j = 0; j < cnt; j++) {
        const GenSeq* q = &seqs[j];
        const RankSeqOut o = {.len = q->len, .stopped = q->stopped, .version = q->version};
        memcpy(outs + (size_t)j * sizeof o, &o, sizeof o);
        memcpy(otok + (size_t)j * T, q->tokens, (size_t)T * sizeof(int32_t));
        memcpy(olp + (size_t)j * 2 * T, q->logp, (size_t)T * sizeof(float));
        memcpy(olp + (size_t)j * 2 * T + T, q->logp_full, (size_t)T * sizeof(float));
    }
    int rc = 0;
    if (comm_all_gather(c, b, all, block / 2, COMM_BF16, NULL) != 0) {
        char msg[ERR_LEN];
        rc = errorf(err, "rollout ranks: %s", comm_error(c, msg, sizeof msg) ? msg : "failed");
    }
    free(all);
    return rc;
}

int grpo_serve(const TrainArgs* a, const Model* m, const GrpoSplit* where, char* err) {
    Comm* c = where->comm;
    const RlArgs* r = &a->rl;
    const int R = where->R, T = a->seq;
    if (!c || c->rank < 1 || c->world != R + 1)
        return errorf(err, "internal: a rollout rank %d of %d with --rl-rollout-ranks %d",
                      c ? c->rank : -1, c ? c->world : 0, R);
    const int cap = (r->prompts + R - 1) / R * r->group;  // the largest share
    const GenOptions go = {.max_seqs = cap, .max_len = T, .temperature = a->temperature,
                           .top_k = r->top_k, .top_p = r->top_p, .max_bytes = where->budget};
    Device* dev = where->impl->open(where->first, &where->opt);
    if (!dev) fatal("cannot open rollout device %s:%d", where->impl->name, where->first);
    Generator gen;
    char why[ERR_LEN] = "";
    const int made = gen_create(&gen, m, where->impl->ops(dev), where->impl->ops_ctx(dev), &go, 1,
                                why) == 0;
    if (!made && !why[0]) snprintf(why, sizeof why, "its generator could not be created");
    int rc = rank_verdicts(c, why, err);
    WeightManifest mine = {0};
    WeightRank wr = {0};
    if (rc == 0) {
        weight_manifest_build(&mine, &m->tt, gen.ops->act_bytes);
        const CommStream st = {.impl = where->impl, .dev = dev, .stream = STREAM_COMPUTE};
        rc = weight_rank_manifest(&wr, c, &st, 0, WEIGHT_RECV, &mine, err);
    }
    int p0, p1;
    rank_groups(r->prompts, R, c->rank, &p0, &p1);
    if (rc == 0)
        printf("rollout rank %d of %d (%s:%d): groups %d..%d of the %d of each batch, %d answers "
               "each\n", c->rank, c->world, where->impl->name, where->first, p0, p1 - 1,
               r->prompts, r->group);
    GenSeq* seqs = calloc_check((size_t)cap, sizeof(GenSeq));
    int32_t* toks = calloc_check((size_t)cap * T, sizeof(int32_t));
    float* lp = calloc_check((size_t)cap * 2 * T, sizeof(float));
    for (int j = 0; j < cap; j++)
        seqs[j] = (GenSeq){.tokens = toks + (size_t)j * T, .logp = lp + (size_t)j * 2 * T,
                           .logp_full = lp + (size_t)j * 2 * T + T};
    int64_t batches = 0, answers = 0, v_first = -1, v_last = -1;
    const double t0 = time_now_s();
    while (rc == 0) {
        RankMsg h;
        memset(&h, 0, sizeof h);
        if (rank_bcast(c, &h, sizeof h, err) != 0) {
            rc = -1;
        } else if (h.kind == RANK_STOP) {
            break;
        } else if (h.kind == RANK_WEIGHTS) {
            // placed by name into the generator's own weights; the KV cache holds nothing of
            // the old version (gen_run fills it afresh)
            if (weight_rank_run(&wr, gen.own, err) < 0) rc = -1;
            gen.version = h.version;
            if (v_first < 0) v_first = h.version;
            v_last = h.version;
        } else if (h.kind == RANK_GENERATE) {
            int groups = 0;
            rc = serve_generate(c, &gen, &h, R, seqs, cap, &groups, err);
            batches++;
            answers += (int64_t)groups * h.group;
        } else {
            rc = errorf(err, "rollout rank %d: message kind %d from the trainer", c->rank,
                        (int)h.kind);
        }
    }
    if (rc == 0)
        printf("rollout rank %d: %lld batches, %lld answers (%.0f tokens decoded, %.0f tokens/s), "
               "weights v%lld..v%lld, %.1f s\n", c->rank, (long long)batches, (long long)answers,
               (double)gen.n_decoded, gen.t_decode > 0 ? gen.n_decoded / gen.t_decode : 0.0,
               (long long)v_first, (long long)v_last, time_now_s() - t0);
    free(seqs);
    free(toks);
    free(lp);
    if (wr.comm) weight_rank_close(&wr);
    weight_manifest_free(&mine);
    if (made) gen_free(&gen);
    where->impl->close(dev);
    return rc;
}
