/*
 * grpo.c — GRPO rollouts, advantages, the policy step and the weight sync (grpo.h); the
 * rollouts colocated, on rollout devices of this process (--rollout-gpus) or on rollout ranks
 * in other processes (--rl-rollout-ranks: their message protocol is grpo_ranks.c's).
 */
#include "grpo.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define GRPO_STD_EPS 1e-4  // added to the std the advantages are divided by (TRL's epsilon)

// The sampler's seed of answer i of step `step`: repeatable, apart from the problems' streams.
static uint32_t answer_seed(uint32_t seed, int64_t step, int i) {
    uint64_t z = ((uint64_t)seed << 32 | 0x5a5au) ^ ((uint64_t)step * 0xd1b54a32d192ed03ull) ^
                 ((uint64_t)(uint32_t)i * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)(z ^ (z >> 31));
}

// ----------------------------------------------------------------------------
// advantages

int grpo_advantages(const double* reward, const int* len, int n, int G, RlAdvStd adv_std,
                    RlLossAgg agg, int max_tokens, float* adv, float* weight) {
    // the batch's std of every scored reward (--adv-std batch)
    double bs = 0.0, bs2 = 0.0;
    int bn = 0;
    for (int i = 0; i < n; i++)
        if (!isnan(reward[i])) {
            bs += reward[i];
            bs2 += reward[i] * reward[i];
            bn++;
        }
    const double bmean = bn ? bs / bn : 0.0;
    const double bstd = bn > 1 ? sqrt(fmax(bs2 - bn * bmean * bmean, 0.0) / (bn - 1)) : 0.0;
    int skipped = 0, counted = 0;
    int64_t tokens = 0;
    for (int k = 0; k < n / G; k++) {
        const double* r = reward + (size_t)k * G;
        double sum = 0.0, lo = INFINITY, hi = -INFINITY;
        int cnt = 0;
        for (int j = 0; j < G; j++)
            if (!isnan(r[j])) {
                sum += r[j];
                lo = fmin(lo, r[j]);
                hi = fmax(hi, r[j]);
                cnt++;
            }
        // a group whose scored answers all got the same reward teaches nothing (its advantages
        // are 0): skipped, and left out of the normalisation (DAPO's dynamic sampling, minus
        // the resampling)
        const int skip = cnt < 2 || lo == hi;
        skipped += skip;
        const double mean = cnt ? sum / cnt : 0.0;
        double var = 0.0;
        for (int j = 0; j < G; j++)
            if (!isnan(r[j])) var += (r[j] - mean) * (r[j] - mean);
        const double gstd = cnt > 1 ? sqrt(var / (cnt - 1)) : 0.0;  // unbiased, as torch.std
        for (int j = 0; j < G; j++) {
            const int i = k * G + j;
            adv[i] = 0.0f;
            weight[i] = 0.0f;
            if (skip || isnan(r[j]) || len[i] <= 0) continue;
            double A = r[j] - mean;
            if (adv_std == RL_ADV_GROUP) A /= gstd + GRPO_STD_EPS;
            else if (adv_std == RL_ADV_BATCH) A /= bstd + GRPO_STD_EPS;
            adv[i] = (float)A;
            weight[i] = 1.0f;  // counted; the normalisation below
            counted++;
            tokens += len[i];
        }
    }
    for (int i = 0; i < n; i++) {
        if (weight[i] == 0.0f) continue;
        if (agg == RL_AGG_TOKEN) weight[i] = (float)(1.0 / (double)tokens);
        else if (agg == RL_AGG_SEQUENCE) weight[i] = (float)(1.0 / ((double)len[i] * counted));
        else weight[i] = (float)(1.0 / ((double)max_tokens * counted));
    }
    return skipped;
}

// ----------------------------------------------------------------------------
// create / free

static void batch_alloc(GrpoBatch* b, int P, int G, int maxT) {
    const int n = P * G;
    b->n = n;
    b->seqs = calloc_check((size_t)n, sizeof(GenSeq));
    b->tokens = calloc_check((size_t)n * maxT, sizeof(int32_t));
    b->logp = calloc_check((size_t)n * 2 * maxT, sizeof(float));
    b->prompts = calloc_check((size_t)P, sizeof(char*));
    b->answers = calloc_check((size_t)P, sizeof(char*));
    b->completions = calloc_check((size_t)n, sizeof(char*));
    b->reward = calloc_check((size_t)n, sizeof(double));
    b->correct = calloc_check((size_t)n, sizeof(int));
    b->adv = calloc_check((size_t)n, sizeof(float));
    b->weight = calloc_check((size_t)n, sizeof(float));
    for (int i = 0; i < n; i++) {
        b->seqs[i].tokens = b->tokens + (size_t)i * maxT;
        b->seqs[i].logp = b->logp + (size_t)i * 2 * maxT;
        b->seqs[i].logp_full = b->seqs[i].logp + maxT;
    }
}

static void batch_free(GrpoBatch* b, int P) {
    for (int i = 0; i < P && b->prompts; i++) {
        free(b->prompts[i]);
        free(b->answers[i]);
    }
    for (int i = 0; i < b->n && b->completions; i++) free(b->completions[i]);
    free(b->seqs);
    free(b->tokens);
    free(b->logp);
    free(b->prompts);
    free(b->answers);
    free(b->completions);
    free(b->reward);
    free(b->correct);
    free(b->adv);
    free(b->weight);
    memset(b, 0, sizeof *b);
}

// ----------------------------------------------------------------------------
// the split schedule's rollout devices

// Open the K rollout devices (indices split->first ..), a generator on each for its share of
// the prompts (KV cache checked against split->budget), the trainer's weights in each as
// `version`, their communicator and the manifest exchange. -1 + err.
static int split_create(Grpo* g, const GrpoSplit* split, const GenOptions* go0, int64_t version,
                        char* err) {
    const RlArgs* r = g->r;
    const int K = split->K;
    if (K > r->prompts) {
        snprintf(err, ERR_LEN, "--rollout-gpus %d: the answers are divided among the rollout "
                 "devices by prompt, and there are %d (--rl-prompts): at most that many", K,
                 r->prompts);
        return -1;
    }
    g->K = K;
    g->rdev.impl = split->impl;
    g->rdev.dev = calloc_check((size_t)K, sizeof(Device*));
    for (int k = 0; k < K; k++) {
        g->rdev.dev[k] = split->impl->open(split->first + k, &split->opt);
        if (!g->rdev.dev[k]) fatal("cannot open rollout device %s:%d", split->impl->name,
                                   split->first + k);
        g->rdev.n = k + 1;
    }
    GenOptions go = *go0;
    go.max_seqs = (r->prompts + K - 1) / K * r->group;  // the largest share
    go.max_bytes = split->budget;
    g->xgen = calloc_check((size_t)(K > 1 ? K - 1 : 1), sizeof(Generator));
    g->wman = calloc_check((size_t)K, sizeof(WeightManifest));
    int* gpu = calloc_check((size_t)K, sizeof(int));
    for (int k = 0; k < K; k++) {
        Device* d = g->rdev.dev[k];
        Generator* gen = k == 0 ? &g->gen : &g->xgen[k - 1];
        char why[ERR_LEN];
        if (gen_create(gen, g->m, split->impl->ops(d), split->impl->ops_ctx(d), &go, 1, why) !=
            0) {
            snprintf(err, ERR_LEN, "rollout device %s:%d: %.400s", split->impl->name,
                     split->first + k, why);
            free(gpu);
            return -1;
        }
        gen_load_weights(gen, g->s, version);
        weight_manifest_build(&g->wman[k], &g->m->tt, gen->ops->act_bytes);
        gpu[k] = split->first + k;
    }
    // the sender's layout: the trainer's masters, in the devices' dtype
    weight_manifest_build(&g->wsend, &g->m->tt, g->gen.ops->act_bytes);
    int rc = weight_bcast_open(&g->wb, split->impl, g->rdev.dev, gpu, K, split->timeout_s, err);
    free(gpu);
    if (rc == 0) rc = weight_bcast_manifest(&g->wb, &g->wsend, g->wman, err);
    return rc;
}

static void split_free(Grpo* g) {
    if (g->bg_on) pthread_check(pthread_join(g->bg, NULL));
    g->bg_on = 0;
    weight_bcast_close(&g->wb);
    for (int k = 1; g->xgen && k < g->K; k++) gen_free(&g->xgen[k - 1]);
    free(g->xgen);
    for (int k = 0; g->wman && k < g->K; k++) weight_manifest_free(&g->wman[k]);
    free(g->wman);
    weight_manifest_free(&g->wsend);
    gen_free(&g->gen);  // (before its device closes)
    if (g->rdev.dev) device_set_close(&g->rdev);
}

// The generator of rollout device k (the colocated one: k = 0).
static Generator* gen_of(Grpo* g, int k) { return k == 0 ? &g->gen : &g->xgen[k - 1]; }

// Tokens decoded and decode seconds of every generator.
static void gen_counters(Grpo* g, double* decoded, double* t_decode) {
    *decoded = *t_decode = 0.0;
    for (int q = 0; q < g->ranks.R; q++) {  // (the rollout ranks': the trainer's generates none)
        *decoded += g->ranks.dec[q];
        *t_decode = fmax(*t_decode, g->ranks.tdec[q]);
    }
    if (g->ranks.R > 0) return;
    for (int k = 0; k < (g->K > 0 ? g->K : 1); k++) {
        *decoded += (double)gen_of(g, k)->n_decoded;
        *t_decode = fmax(*t_decode, gen_of(g, k)->t_decode);  // (they decode concurrently)
    }
}

int grpo_create(Grpo* g, const TrainArgs* a, const Model* m, Store* s, Plain* p,
                const Tokenizer* tok, int64_t version, double host_budget,
                const GrpoSplit* split, char* err) {
    memset(g, 0, sizeof *g);
    g->a = a;
    g->r = &a->rl;
    g->m = m;
    g->s = s;
    g->p = p;
    g->tok = tok;
    g->maxT = a->seq;
    const RlArgs* r = g->r;
    const int n = r->prompts * r->group;
    if (!tok && m->cfg.V != 256 && !r->ignore_eos) {
        snprintf(err, ERR_LEN, "--rl needs text prompts: the model has no tokenizer and is not "
                 "byte-level (vocabulary %d); --rl-ignore-eos 1 reads them as byte ids "
                 "(benchmarks)", m->cfg.V);
        return -1;
    }
    if (rl_task_open(&g->task, r->task, r->eval, a->seed, err) != 0) return -1;
    const GenOptions go = {.max_seqs = n, .max_len = g->maxT, .temperature = a->temperature,
                           .top_k = r->top_k, .top_p = r->top_p, .max_bytes = host_budget};
    if (split && split->K > 0) {
        if (split_create(g, split, &go, version, err) != 0) {
            split_free(g);
            rl_task_free(&g->task);
            return -1;
        }
    } else {
        // with rollout ranks the trainer's generator only evaluates (in chunks of its capacity:
        // min(n, n_eval) chunks the held-out problems as the colocated run's n does) and is the
        // broadcast's source: no KV cache for the whole batch
        GenOptions gt = go;
        if (split && split->R > 0) gt.max_seqs = imax(1, imin(n, g->task.n_eval));
        if (gen_create(&g->gen, m, p->ops, p->ctx, &gt, 1, err) != 0) {
            rl_task_free(&g->task);
            return -1;
        }
        gen_load_weights(&g->gen, s, version);
        // rollout ranks: the trainer's generator (synced as colocated) is what they receive
        if (split && split->R > 0 &&
            grpo_ranks_create(&g->ranks, split, m, &g->gen, version, err) != 0) {
            grpo_ranks_free(&g->ranks);
            gen_free(&g->gen);
            rl_task_free(&g->task);
            return -1;
        }
    }
    rl_stop_tokens(&m->cfg, tok, &g->stop_a, &g->stop_b);
    if (r->ignore_eos) g->stop_a = g->stop_b = -1;  // every answer runs to its budget
    reward_cmd_init(&g->rc, r->reward_cmd, r->reward_timeout);
    for (int i = 0; i < 2; i++) batch_alloc(&g->batch[i], r->prompts, r->group, g->maxT);
    if (r->kl_beta > 0.0f) {
        // the reference policy: the weights the run starts from, on the backend
        g->ref = calloc_check((size_t)m->tt.n_layers, sizeof(void*));
        for (int l = 0; l < m->tt.n_layers; l++) {
            if (m->tt.param_numel[l] == 0) continue;
            g->ref[l] = p->ops->alloc(p->ctx, (size_t)m->tt.param_numel[l] * p->ops->act_bytes);
            p->ops->upload_f32(p->ctx, g->ref[l], s->param[l], (size_t)m->tt.param_numel[l]);
        }
    }
    const size_t N = (size_t)a->batch * g->maxT;
    g->h_ids = calloc_check(N, sizeof(int32_t));
    g->h_tgt = calloc_check(N, sizeof(int32_t));
    float** hf[] = {&g->h_old, &g->h_adv, &g->h_w, &g->h_ref, &g->h_logp};
    for (size_t i = 0; i < sizeof hf / sizeof hf[0]; i++) *hf[i] = calloc_check(N, sizeof(float));
    float** df[] = {&g->d_old, &g->d_adv, &g->d_w, &g->d_ref, &g->d_logp, &g->d_loss};
    for (size_t i = 0; i < sizeof df / sizeof df[0]; i++)
        *df[i] = p->ops->alloc(p->ctx, N * sizeof(float));
    const size_t NT = (size_t)n * g->maxT;
    g->e_tok = calloc_check((size_t)n * (g->maxT + 1), sizeof(int32_t));
    g->e_tgt = calloc_check(NT, sizeof(int32_t));
    float** ef[] = {&g->e_old, &g->e_adv, &g->e_w, &g->e_ref};
    for (size_t i = 0; i < sizeof ef / sizeof ef[0]; i++) *ef[i] = calloc_check(NT, sizeof(float));
    return 0;
}

void grpo_free(Grpo* g) {
    if (!g->m) return;
    if (g->bg_on) pthread_check(pthread_join(g->bg, NULL));  // (it uses the batches, rewards)
    g->bg_on = 0;
    const Ops* ops = g->p->ops;
    reward_cmd_stop(&g->rc);
    for (int i = 0; i < 2; i++) batch_free(&g->batch[i], g->r->prompts);
    for (int l = 0; g->ref && l < g->m->tt.n_layers; l++)
        if (g->ref[l]) ops->free(g->p->ctx, g->ref[l]);
    free(g->ref);
    float* df[] = {g->d_old, g->d_adv, g->d_w, g->d_ref, g->d_logp, g->d_loss};
    for (size_t i = 0; i < sizeof df / sizeof df[0]; i++) ops->free(g->p->ctx, df[i]);
    free(g->h_ids);
    free(g->h_tgt);
    free(g->h_old);
    free(g->h_adv);
    free(g->h_w);
    free(g->h_ref);
    free(g->h_logp);
    free(g->e_tok);
    free(g->e_tgt);
    free(g->e_old);
    free(g->e_adv);
    free(g->e_w);
    free(g->e_ref);
    grpo_ranks_free(&g->ranks);  // (the rollout ranks stop)
    split_free(g);  // (the colocated generator too)
    rl_task_free(&g->task);
    memset(g, 0, sizeof *g);
}

// ----------------------------------------------------------------------------
// rollouts

// The prompt's ids into seq (fatal when it leaves no room for an answer).
static void set_prompt(const Grpo* g, GenSeq* seq, const char* prompt) {
    const int n = rl_encode_prompt(&g->m->cfg, g->tok, prompt, seq->tokens, g->maxT - 1);
    if (n < 1 || n > g->maxT - 2)
        fatal("--rl: the prompt \"%.40s\" does not leave room for an answer in --seq %d", prompt,
              g->maxT);
    seq->prompt_len = n;
}

typedef struct ShareJob {
    Generator* gen;
    GenSeq* seqs;
    int n, group;
} ShareJob;

static void* share_main(void* arg) {
    ShareJob* j = arg;
    gen_run(j->gen, j->seqs, j->n, j->group);
    return NULL;
}

// The P prompts' answers (G each): colocated in one run; split, prompts [P k / K, P (k+1) / K)
// on rollout device k, all devices at once (each sequence has its own sampler, seeded by its
// index, so the division changes no answer).
static void generate_shares(Grpo* g, GenSeq* seqs, int P, int G) {
    if (g->ranks.R > 0) {  // (the rollout ranks: the same division, over the communicator)
        grpo_ranks_generate(&g->ranks, seqs, P, G, g->maxT, g->gen.version);
        return;
    }
    if (g->K <= 1) {
        gen_run(&g->gen, seqs, P * G, G);
        return;
    }
    ShareJob* jobs = calloc_check((size_t)g->K, sizeof(ShareJob));
    pthread_t* th = calloc_check((size_t)g->K, sizeof(pthread_t));
    for (int k = 0; k < g->K; k++) {
        const int p0 = (int)((int64_t)P * k / g->K), p1 = (int)((int64_t)P * (k + 1) / g->K);
        jobs[k] = (ShareJob){gen_of(g, k), seqs + (size_t)p0 * G, (p1 - p0) * G, G};
        pthread_check(pthread_create(&th[k], NULL, share_main, &jobs[k]));
    }
    for (int k = 0; k < g->K; k++) pthread_check(pthread_join(th[k], NULL));
    free(jobs);
    free(th);
}

// Generate and score batch b for step `step` with the generator's current weights.
static void fill_batch(Grpo* g, GrpoBatch* b, int step) {
    const RlArgs* r = g->r;
    const int P = r->prompts, G = r->group;
    const double t0 = time_now_s();
    char prompt[4096], answer[1024];
    for (int k = 0; k < P; k++) {
        rl_task_train_problem(&g->task, step, k, prompt, sizeof prompt, answer, sizeof answer);
        free(b->prompts[k]);
        free(b->answers[k]);
        b->prompts[k] = strndup_check(prompt, strlen(prompt));
        b->answers[k] = strndup_check(answer, strlen(answer));
        for (int j = 0; j < G; j++) {
            GenSeq* q = &b->seqs[k * G + j];
            set_prompt(g, q, prompt);
            q->max_new = r->max_tokens;
            q->stop_a = g->stop_a;
            q->stop_b = g->stop_b;
            rng_seed(&q->rng, answer_seed(g->a->seed, step, k * G + j));
        }
    }
    generate_shares(g, b->seqs, P, G);
    // the answers' text, then their rewards
    char text[4096];
    for (int i = 0; i < b->n; i++) {
        const GenSeq* q = &b->seqs[i];
        rl_decode_answer(&g->m->cfg, g->tok, q->tokens + q->prompt_len, q->len - q->prompt_len,
                         g->stop_a, g->stop_b, text, sizeof text);
        free(b->completions[i]);
        b->completions[i] = strndup_check(text, strlen(text));
        b->correct[i] = rl_exact_match(text, b->answers[i / G]);
    }
    if (*r->reward_cmd) {
        const char** pr = malloc_check((size_t)b->n * sizeof(char*));
        const char** an = malloc_check((size_t)b->n * sizeof(char*));
        for (int i = 0; i < b->n; i++) {
            pr[i] = b->prompts[i / G];
            an[i] = b->answers[i / G];
        }
        reward_cmd_score(&g->rc, b->n, pr, (const char* const*)b->completions, an, b->reward);
        free(pr);
        free(an);
    } else {
        for (int i = 0; i < b->n; i++)
            b->reward[i] = rl_reward_builtin(r->reward, b->prompts[i / G], b->completions[i],
                                             b->answers[i / G]);
    }
    b->version = g->gen.version;
    b->for_step = step;
    b->ready = 1;
    b->rollout_s = time_now_s() - t0;
}

static void* background_main(void* arg) {
    Grpo* g = arg;
    double d0, t0;
    gen_counters(g, &d0, &t0);
    const double s0 = time_now_s();
    fill_batch(g, &g->batch[1 - g->cur], g->bg_step);
    g->bg_s = time_now_s() - s0;
    double d1, t1;
    gen_counters(g, &d1, &t1);
    g->bg_decoded = d1 - d0;
    return NULL;
}

// The rollout running while the step trains, finished (the batch boundary: the weights may
// change after it); its time and tokens into the step's statistics.
static void background_join(Grpo* g) {
    if (!g->bg_on) return;
    pthread_check(pthread_join(g->bg, NULL));
    g->bg_on = 0;
    GrpoStats* st = &g->st;
    const double fg_decoded = st->gen_tok_s * st->rollout_s;
    st->rollout_s += g->bg_s;
    st->gen_tok_s = st->rollout_s > 0 ? (fg_decoded + g->bg_decoded) / st->rollout_s : 0.0;
}

void grpo_rollout(Grpo* g, int step) {
    const RlArgs* r = g->r;
    double decoded0, t_decode0;
    gen_counters(g, &decoded0, &t_decode0);
    const double t0 = time_now_s();
    GrpoStats* st = &g->st;
    memset(st, 0, sizeof *st);
    // the batch generated for this step during the previous one (off-policy), if any
    if (!(g->batch[g->cur].ready && g->batch[g->cur].for_step == step) &&
        g->batch[1 - g->cur].ready && g->batch[1 - g->cur].for_step == step)
        g->cur = 1 - g->cur;
    GrpoBatch* b = &g->batch[g->cur];
    const int64_t trained = g->gen.version;  // the weights this step's gradient is taken at
    const int have = b->ready && b->for_step == step;
    if (!have || trained - b->version > r->max_staleness) {
        st->regenerated = have;
        fill_batch(g, b, step);
    }
    // one step off: the next step's batch with the weights before this step's update; with
    // rollout devices of their own (--rollout-gpus) on a thread while this step trains
    // (grpo_sync waits for it before the weights change). After the last step too when it ends
    // in a checkpoint, which keeps the batch (grpo_state_pack), so a run resumed from it with
    // more --steps trains on the answers the straight run would.
    const int next = r->off_policy && (step < g->a->steps || g->a->save_every > 0);
    const int aside = g->K > 0 || g->ranks.R > 0;  // rollouts on GPUs of their own
    if (next && !aside) fill_batch(g, &g->batch[1 - g->cur], step + 1);
    st->rollout_s = time_now_s() - t0;
    double decoded, t_decode;
    gen_counters(g, &decoded, &t_decode);
    decoded -= decoded0;
    st->gen_tok_s = st->rollout_s > 0 ? decoded / st->rollout_s : 0.0;
    const double t_dec = t_decode - t_decode0;
    st->decode_tok_s = t_dec > 0 ? decoded / t_dec : 0.0;
    if (next && aside) {
        g->bg_step = step + 1;
        g->batch[1 - g->cur].ready = 0;  // (not until the thread is joined)
        pthread_check(pthread_create(&g->bg, NULL, background_main, g));
        g->bg_on = 1;
    }
}

// ----------------------------------------------------------------------------
// the policy step

// Rows rows[0..nb) of batch b packed for the policy objective: row k's tokens as inputs (ids,
// ids_stride apart), position j predicting token j+1, trained where that token is part of the
// answer (tgt, old, adv, w: T apart).
static void pack_rows(const Grpo* g, const GrpoBatch* b, const int* rows, int nb, int ids_stride,
                      int32_t* ids, int32_t* tgt, float* old, float* adv, float* w) {
    const int T = g->maxT;
    for (int k = 0; k < nb; k++) {
        const GenSeq* q = &b->seqs[rows[k]];
        for (int j = 0; j < T; j++) {
            const size_t o = (size_t)k * T + j;
            const int answer = j + 1 >= q->prompt_len && j + 1 < q->len;
            ids[(size_t)k * ids_stride + j] = j < q->len ? q->tokens[j] : 0;
            tgt[o] = answer ? q->tokens[j + 1] : -1;
            old[o] = answer ? q->logp_full[j + 1] : 0.0f;
            adv[o] = answer ? b->adv[rows[k]] : 0.0f;
            w[o] = answer ? b->weight[rows[k]] : 0.0f;
        }
    }
}

// The step's statistics of N packed tokens (the trained ones: tgt >= 0) from their log-probs
// under the trained weights (and the reference's with --kl-beta) into g->st.
static void add_token_stats(Grpo* g, const int32_t* tgt, const float* logp, const float* old,
                            const float* adv, const float* ref, size_t N) {
    const RlArgs* r = g->r;
    GrpoStats* st = &g->st;
    for (size_t o = 0; o < N; o++) {
        if (tgt[o] < 0) continue;
        const double lp = logp[o], ratio = exp(lp - old[o]), A = adv[o];
        st->ratio_mean += ratio;
        st->clip_frac +=
            (A > 0 && ratio > 1.0 + r->clip_high) || (A < 0 && ratio < 1.0 - r->clip_low);
        if (ref) {
            const double d = ref[o] - lp;
            st->kl += exp(d) - d - 1.0;
        }
        st->trained_tokens++;
    }
}

// The policy objective's scalars and the packed micro-batch's device inputs.
static PolicyLoss policy_of(const Grpo* g) {
    return (PolicyLoss){.old_logp = g->d_old, .adv = g->d_adv, .weight = g->d_w,
                        .inv_temp = 1.0f / g->a->temperature, .clip_low = g->r->clip_low,
                        .clip_high = g->r->clip_high, .kl_beta = 0.0f};
}

// The reference's log-probs of the packed micro-batch in g->h_ids / h_tgt (nb rows, its
// inputs uploaded): a forward with the initial weights in the plain path's place (its slab table
// swapped for the call; no gradient), into g->d_ref and g->h_ref.
static void reference_logp(Grpo* g, const PolicyLoss* pl, int nb) {
    Plain* p = g->p;
    void** own = p->dparam;
    p->dparam = g->ref;
    plain_policy_forward_backward(p, g->h_ids, g->h_tgt, pl, g->d_ref, g->d_loss, 0, nb, g->maxT);
    p->dparam = own;
    p->ops->download(p->ctx, g->h_ref, g->d_ref, (size_t)nb * g->maxT * sizeof(float));
}

// One micro-batch of rows[0..nb) of batch b on the plain path: packed, the reference's log-probs
// (KL), then the objective's forward and backward; the statistics into g->st. Returns the summed
// objective.
static double policy_micro_batch(Grpo* g, const GrpoBatch* b, const int* rows, int nb) {
    Plain* p = g->p;
    const Ops* ops = p->ops;
    const size_t N = (size_t)nb * g->maxT;
    pack_rows(g, b, rows, nb, g->maxT, g->h_ids, g->h_tgt, g->h_old, g->h_adv, g->h_w);
    ops->upload(p->ctx, g->d_old, g->h_old, N * sizeof(float));
    ops->upload(p->ctx, g->d_adv, g->h_adv, N * sizeof(float));
    ops->upload(p->ctx, g->d_w, g->h_w, N * sizeof(float));
    PolicyLoss pl = policy_of(g);
    if (g->ref) {
        reference_logp(g, &pl, nb);
        pl.ref_logp = g->d_ref;
        pl.kl_beta = g->r->kl_beta;
    }
    const double loss = plain_policy_forward_backward(p, g->h_ids, g->h_tgt, &pl, g->d_logp,
                                                      g->d_loss, 1, nb, g->maxT);
    ops->download(p->ctx, g->h_logp, g->d_logp, N * sizeof(float));
    add_token_stats(g, g->h_tgt, g->h_logp, g->h_old, g->h_adv, g->ref ? g->h_ref : NULL, N);
    return loss;
}

// The rows of batch b that train (skipped groups cost nothing), in order; returns their count.
static int trained_rows(const GrpoBatch* b, int* rows) {
    int n = 0;
    for (int i = 0; i < b->n; i++)
        if (b->weight[i] != 0.0f) rows[n++] = i;
    return n;
}

static double policy_gradients(void* arg, Plain* p) {
    (void)p;
    Grpo* g = arg;
    const GrpoBatch* b = &g->batch[g->cur];
    int* rows = malloc_check((size_t)b->n * sizeof(int));
    const int n_rows = trained_rows(b, rows);
    double loss = 0.0;
    for (int r0 = 0; r0 < n_rows; r0 += g->a->batch)
        loss += policy_micro_batch(g, b, rows + r0, imin(g->a->batch, n_rows - r0));
    free(rows);
    return loss;
}

// The step through the RoundPipe engine: the trained rows packed first as the engine's batch
// (micro-batches of --batch rows, as the plain path's; the rows after them are not computed),
// the reference's log-probs on the plain path micro-batch by micro-batch, then the objective
// in the engine's loss head (EngineLoss), its log-probs back for the statistics.
static StepStats policy_step_engine(Grpo* g, Trainer* tr, int step) {
    const GrpoBatch* b = &g->batch[g->cur];
    const int T = g->maxT, n = b->n;
    const size_t NT = (size_t)n * T;
    int* rows = malloc_check((size_t)n * sizeof(int));
    const int n_rows = trained_rows(b, rows);
    memset(g->e_tok, 0, (size_t)n * (T + 1) * sizeof(int32_t));
    for (size_t o = 0; o < NT; o++) g->e_tgt[o] = -1;
    memset(g->e_old, 0, NT * sizeof(float));
    memset(g->e_adv, 0, NT * sizeof(float));
    memset(g->e_w, 0, NT * sizeof(float));
    memset(g->e_ref, 0, NT * sizeof(float));
    pack_rows(g, b, rows, n_rows, T + 1, g->e_tok, g->e_tgt, g->e_old, g->e_adv, g->e_w);
    free(rows);
    const PolicyLoss pl = policy_of(g);
    for (int r0 = 0; g->ref && r0 < n_rows; r0 += g->a->batch) {
        const int nb = imin(g->a->batch, n_rows - r0);
        const size_t at = (size_t)r0 * T, N = (size_t)nb * T;
        for (int k = 0; k < nb; k++)
            memcpy(g->h_ids + (size_t)k * T, g->e_tok + (size_t)(r0 + k) * (T + 1),
                   (size_t)T * sizeof(int32_t));
        memcpy(g->h_tgt, g->e_tgt + at, N * sizeof(int32_t));
        // (the objective's inputs of the plain call: its value is not used)
        const Ops* ops = g->p->ops;
        ops->upload(g->p->ctx, g->d_old, g->e_old + at, N * sizeof(float));
        ops->upload(g->p->ctx, g->d_adv, g->e_adv + at, N * sizeof(float));
        ops->upload(g->p->ctx, g->d_w, g->e_w + at, N * sizeof(float));
        reference_logp(g, &pl, nb);
        memcpy(g->e_ref + at, g->h_ref, N * sizeof(float));
    }
    const EngineLoss loss = {.targets = g->e_tgt, .old_logp = g->e_old,
                             .ref_logp = g->ref ? g->e_ref : NULL, .adv = g->e_adv,
                             .weight = g->e_w, .inv_temp = pl.inv_temp, .clip_low = pl.clip_low,
                             .clip_high = pl.clip_high, .kl_beta = g->ref ? g->r->kl_beta : 0.0f,
                             .rows = n_rows};
    const float* logp = NULL;
    StepStats s = trainer_step_engine_loss(tr, step, g->e_tok, &loss, &logp);
    add_token_stats(g, g->e_tgt, logp, g->e_old, g->e_adv, g->ref ? g->e_ref : NULL,
                    (size_t)n_rows * T);
    return s;
}

StepStats grpo_train(Grpo* g, Trainer* tr, int step) {
    GrpoBatch* b = &g->batch[g->cur];
    GrpoStats* st = &g->st;
    const RlArgs* r = g->r;
    int* len = malloc_check((size_t)b->n * sizeof(int));
    double rsum = 0.0, lsum = 0.0;
    int scored = 0, correct = 0;
    for (int i = 0; i < b->n; i++) {
        len[i] = b->seqs[i].len - b->seqs[i].prompt_len;
        lsum += len[i];
        correct += b->correct[i];
        if (isnan(b->reward[i])) continue;
        rsum += b->reward[i];
        scored++;
    }
    st->skipped_groups = grpo_advantages(b->reward, len, b->n, r->group, r->adv_std, r->loss_agg,
                                         r->max_tokens, b->adv, b->weight);
    free(len);
    st->masked = b->n - scored;
    st->reward_mean = scored ? rsum / scored : NAN;
    st->accuracy = (double)correct / b->n;
    st->answer_len = lsum / b->n;
    st->version = b->version;
    st->staleness = (int)(g->gen.version - b->version);
    const double t0 = time_now_s();
    g->eng = tr->eng;
    StepStats s = tr->eng ? policy_step_engine(g, tr, step)
                          : trainer_step_with(tr, step, policy_gradients, g);
    st->train_s = time_now_s() - t0;
    if (st->trained_tokens > 0) {
        st->ratio_mean /= (double)st->trained_tokens;
        st->clip_frac /= (double)st->trained_tokens;
        st->kl /= (double)st->trained_tokens;
    } else {
        st->ratio_mean = st->clip_frac = st->kl = NAN;
    }
    b->ready = 0;  // trained on
    return s;
}

double grpo_broadcast(Grpo* g) {
    if (g->K < 2) return 0.0;
    void*** slabs = calloc_check((size_t)g->K, sizeof(void**));
    for (int k = 0; k < g->K; k++) slabs[k] = gen_of(g, k)->own;
    char err[ERR_LEN];
    const int64_t bytes = weight_bcast_run(&g->wb, (void* const* const*)slabs, err);
    free(slabs);
    if (bytes < 0) fatal("--rollout-gpus: %s", err);
    for (int k = 1; k < g->K; k++) gen_of(g, k)->version = g->gen.version;
    return (double)bytes;
}

void grpo_sync(Grpo* g, int64_t version) {
    background_join(g);  // generation went on with the old weights up to the batch boundary
    const double t0 = time_now_s();
    const Model* m = g->m;
    if (g->eng && engine_weight_bytes(g->eng) == g->gen.ops->act_bytes) {
        // the engine's compute-dtype masters of the last step applied (sync or delayed update:
        // engine_latest_weights), i.e. the Store's fp32 weights of `version` rounded as the
        // devices round them (f32_to_bf16, round to nearest even as the upload's conversion
        // kernel): each weight crosses the bus once, 2 B per parameter, from pinned memory; only
        // the trainable tails (the whole slabs for full training)
        const void** src = malloc_check((size_t)m->tt.n_layers * sizeof(void*));
        for (int l = 0; l < m->tt.n_layers; l++) src[l] = engine_latest_weights(g->eng, l);
        g->st.sync_bytes =
            (double)gen_upload_weights(&g->gen, src, m->tt.state_numel, version);
        free(src);
        g->gen.ops->synchronize(g->gen.ctx);
        // split: from the first rollout device to the others (its KV caches, like theirs,
        // hold nothing of the old version: gen_run fills them afresh)
        g->st.bcast_bytes = grpo_broadcast(g);
    } else if (g->K > 0) {
        fatal("internal: the split schedule syncs from the engine's masters (compute dtype %d "
              "bytes, the rollout devices' %d)", g->eng ? engine_weight_bytes(g->eng) : 0,
              g->gen.ops->act_bytes);
    } else if (g->eng && !g->p->aliased) {
        // the Store's fp32 weights (every applied update), converted on the upload
        gen_load_weights(&g->gen, g->s, version);
        g->st.sync_bytes = 0.0;
        for (int l = 0; l < m->tt.n_layers; l++)
            g->st.sync_bytes += (double)m->tt.param_numel[l] * sizeof(float);
        g->gen.ops->synchronize(g->gen.ctx);
    } else if (g->p->aliased) {
        // the CPU: the store's fp32 weights are the plain path's
        gen_load_weights(&g->gen, g->s, version);
        g->st.sync_bytes = 0.0;
        for (int l = 0; l < g->m->tt.n_layers; l++)
            g->st.sync_bytes += (double)g->m->tt.param_numel[l] * g->p->ops->act_bytes;
    } else {
        // a GPU: the trainer's step ended by uploading the new weights to its device slabs
        // (plain_sync_params), so the generator's copy is a device-to-device copy of those
        g->st.sync_bytes = (double)gen_copy_weights(&g->gen, g->p->dparam, version);
        g->p->ops->synchronize(g->p->ctx);
    }
    if (g->ranks.R > 0) {
        // the rollout ranks: the trainer's generator's weights broadcast to them
        char err[ERR_LEN];
        const double t1 = time_now_s();
        const int64_t bytes = grpo_ranks_send_weights(&g->ranks, &g->gen, version, err);
        if (bytes < 0) fatal("--rl-rollout-ranks: %s", err);
        g->st.bcast_bytes = (double)bytes;
        g->bcast_s = time_now_s() - t1;
    }
    g->st.sync_s = time_now_s() - t0;
}

// ----------------------------------------------------------------------------
// evaluation and the log

double grpo_evaluate(Grpo* g) {
    const RlTask* t = &g->task;
    if (t->n_eval == 0) return NAN;
    const int cap = g->gen.o.max_seqs, T = g->maxT;
    GenSeq* seqs = calloc_check((size_t)cap, sizeof(GenSeq));
    int32_t* toks = malloc_check((size_t)cap * T * sizeof(int32_t));
    float* lp = malloc_check((size_t)cap * 2 * T * sizeof(float));
    const float temperature = g->gen.o.temperature;
    g->gen.o.temperature = 0.0f;  // greedy
    char text[4096];
    int correct = 0;
    for (int i0 = 0; i0 < t->n_eval; i0 += cap) {
        const int n = imin(cap, t->n_eval - i0);
        for (int i = 0; i < n; i++) {
            seqs[i] = (GenSeq){.tokens = toks + (size_t)i * T, .logp = lp + (size_t)i * 2 * T,
                               .logp_full = lp + (size_t)i * 2 * T + T,
                               .max_new = g->r->max_tokens, .stop_a = g->stop_a,
                               .stop_b = g->stop_b};
            set_prompt(g, &seqs[i], t->eval_prompts[i0 + i]);
        }
        gen_run(&g->gen, seqs, n, 1);
        for (int i = 0; i < n; i++) {
            rl_decode_answer(&g->m->cfg, g->tok, seqs[i].tokens + seqs[i].prompt_len,
                             seqs[i].len - seqs[i].prompt_len, g->stop_a, g->stop_b, text,
                             sizeof text);
            correct += rl_exact_match(text, t->eval_answers[i0 + i]);
        }
    }
    g->gen.o.temperature = temperature;
    free(seqs);
    free(toks);
    free(lp);
    return (double)correct / t->n_eval;
}

// A JSON number, null when not finite.
static void json_num(FILE* f, const char* key, double v) {
    if (isfinite(v)) fprintf(f, ",\"%s\":%.9g", key, v);
    else fprintf(f, ",\"%s\":null", key);
}

void grpo_log_step(const Grpo* g, StepLog* lg, const StepStats* s) {
    const GrpoStats* st = &g->st;
    printf("step %d/%d | loss %+.5f | reward %.3f | acc %.3f | ratio %.4f | clip %.3f | kl %.4f | "
           "len %.1f | v%lld%s | rollout %.0f ms (%.0f tok/s) | train %.0f ms | sync %.1f ms | "
           "norm %.3f | lr %.2e\n",
           s->step, s->steps, s->loss, st->reward_mean, st->accuracy, st->ratio_mean,
           st->clip_frac, st->kl, st->answer_len, (long long)st->version,
           st->staleness ? " (1 behind)" : "", st->rollout_s * 1e3, st->gen_tok_s,
           st->train_s * 1e3, st->sync_s * 1e3, s->norm, s->lr);
    if (g->ranks.R > 0 && st->sync_s > 0) {
        // the broadcast to the rollout ranks, after the trainer's generator was synced
        printf("  weight sync: %.1f MB broadcast to %d rollout rank%s in %.2f ms (%.1f GB/s), "
               "the trainer's copy %.2f ms; decode %.0f tokens/s\n", st->bcast_bytes / 1e6,
               g->ranks.R, g->ranks.R > 1 ? "s" : "", g->bcast_s * 1e3,
               g->bcast_s > 0 ? st->bcast_bytes / g->bcast_s / 1e9 : 0.0,
               (st->sync_s - g->bcast_s) * 1e3, st->decode_tok_s);
    } else if ((!g->p->aliased || g->K > 0) && st->sync_s > 0) {  // (the CPU's line as it was)
        const double moved = st->sync_bytes + st->bcast_bytes * (g->K > 1 ? g->K - 1 : 0);
        printf("  weight sync: %.1f MB in %.2f ms (%.1f GB/s)", st->sync_bytes / 1e6,
               st->sync_s * 1e3, moved / st->sync_s / 1e9);
        if (g->K > 1)
            printf(", then %.1f MB broadcast to %d more rollout devices", st->bcast_bytes / 1e6,
                   g->K - 1);
        printf("; decode %.0f tokens/s\n", st->decode_tok_s);
    }
    if (st->masked || st->skipped_groups || st->regenerated)
        printf("  %d answers without a reward (masked), %d of %d groups skipped (equal "
               "rewards)%s\n",
               st->masked, st->skipped_groups, g->r->prompts,
               st->regenerated ? ", the pending batch was too stale: generated again" : "");
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\":%d", s->step);
    json_num(lg->f, "loss", s->loss);
    json_num(lg->f, "lr", s->lr);
    json_num(lg->f, "norm", s->norm);
    json_num(lg->f, "reward", st->reward_mean);
    json_num(lg->f, "accuracy", st->accuracy);
    json_num(lg->f, "ratio", st->ratio_mean);
    json_num(lg->f, "clip_frac", st->clip_frac);
    json_num(lg->f, "kl", st->kl);
    json_num(lg->f, "answer_len", st->answer_len);
    fprintf(lg->f, ",\"masked\":%d,\"skipped_groups\":%d,\"version\":%lld,\"staleness\":%d",
            st->masked, st->skipped_groups, (long long)st->version, st->staleness);
    json_num(lg->f, "rollout_ms", st->rollout_s * 1e3);
    json_num(lg->f, "train_ms", st->train_s * 1e3);
    json_num(lg->f, "sync_ms", st->sync_s * 1e3);
    json_num(lg->f, "gen_tok_s", st->gen_tok_s);
    json_num(lg->f, "sync_bytes", st->sync_bytes);
    json_num(lg->f, "decode_tok_s", st->decode_tok_s);
    if (g->K > 1 || g->ranks.R > 0) json_num(lg->f, "bcast_bytes", st->bcast_bytes);
    if (g->ranks.R > 0) json_num(lg->f, "bcast_ms", g->bcast_s * 1e3);
    fprintf(lg->f, "}\n");
    fflush(lg->f);
}

void grpo_log_eval(StepLog* lg, int step, double accuracy, int n) {
    printf("held-out accuracy %.4f (%d problems, greedy) after step %d\n", accuracy, n, step);
    if (!lg->f) return;
    fprintf(lg->f, "{\"step\":%d", step);
    json_num(lg->f, "heldout_accuracy", accuracy);
    fprintf(lg->f, "}\n");
    fflush(lg->f);
}

// ----------------------------------------------------------------------------
// the checkpoint's RL state: the rollout generated ahead (one step off-policy)

#define GRPO_STATE_MAGIC "RPGRPO01"

// rl_state.bin: the magic, then int64 for_step and version, int32 n and maxT; per answer int32
// len, prompt_len, stopped, correct and a double reward; then the tokens (n, maxT) int32 and the
// log-probs (n, 2 maxT) float, in this machine's byte order (checkpoints are read where they are
// written; the DONE marker's checksum guards the bytes).
typedef struct GrpoStateHead {
    char magic[8];
    int64_t for_step, version;
    int32_t n, maxT;
} GrpoStateHead;

typedef struct GrpoStateSeq {
    int32_t len, prompt_len, stopped, correct;
    double reward;
} GrpoStateSeq;

// The ready batch generated for step `step` + 1, if any.
static const GrpoBatch* batch_ahead(const Grpo* g, int64_t step) {
    for (int i = 0; i < 2; i++)
        if (g->batch[i].ready && g->batch[i].for_step == step + 1) return &g->batch[i];
    return NULL;
}

void* grpo_state_pack(const Grpo* g, int64_t step, size_t* bytes) {
    *bytes = 0;
    const GrpoBatch* b = batch_ahead(g, step);
    if (!b) return NULL;
    const size_t n = (size_t)b->n, T = (size_t)g->maxT;
    const size_t total = sizeof(GrpoStateHead) + n * sizeof(GrpoStateSeq) +
                         n * T * sizeof(int32_t) + n * 2 * T * sizeof(float);
    char* buf = calloc_check(total, 1);
    GrpoStateHead h = {.for_step = b->for_step, .version = b->version, .n = b->n,
                       .maxT = g->maxT};
    memcpy(h.magic, GRPO_STATE_MAGIC, sizeof h.magic);
    memcpy(buf, &h, sizeof h);
    char* p = buf + sizeof h;
    for (size_t i = 0; i < n; i++, p += sizeof(GrpoStateSeq)) {
        const GenSeq* q = &b->seqs[i];
        const GrpoStateSeq s = {.len = q->len, .prompt_len = q->prompt_len,
                                .stopped = q->stopped, .correct = b->correct[i],
                                .reward = b->reward[i]};
        memcpy(p, &s, sizeof s);
    }
    memcpy(p, b->tokens, n * T * sizeof(int32_t));
    p += n * T * sizeof(int32_t);
    memcpy(p, b->logp, n * 2 * T * sizeof(float));
    *bytes = total;
    return buf;
}

int grpo_state_restore(Grpo* g, const void* buf, size_t bytes, int64_t step, char* err) {
    const char* what = "the checkpoint's rl_state.bin";
    GrpoStateHead h;
    if (bytes < sizeof h) return errorf(err, "%s: %zu bytes, shorter than its header", what, bytes);
    memcpy(&h, buf, sizeof h);
    if (memcmp(h.magic, GRPO_STATE_MAGIC, sizeof h.magic) != 0)
        return errorf(err, "%s: not a GRPO rollout (bad magic)", what);
    const int P = g->r->prompts, G = g->r->group;
    if (h.n != P * G || h.maxT != g->maxT)
        return errorf(err, "%s: a rollout of %d answers x %d positions; this run makes %d x %d "
                      "(--rl-prompts, --rl-group and --seq must be the checkpoint's)", what,
                      (int)h.n, (int)h.maxT, P * G, g->maxT);
    if (h.for_step != step + 1 || h.version < 0 || h.version > step)
        return errorf(err, "%s: a rollout for step %lld by weights v%lld, not one for step %lld",
                      what, (long long)h.for_step, (long long)h.version, (long long)step + 1);
    const size_t n = (size_t)h.n, T = (size_t)h.maxT;
    if (bytes != sizeof h + n * sizeof(GrpoStateSeq) + n * T * sizeof(int32_t) +
                     n * 2 * T * sizeof(float))
        return errorf(err, "%s: %zu bytes, not the size its header gives", what, bytes);
    GrpoBatch* b = &g->batch[1 - g->cur];
    const char* p = (const char*)buf + sizeof h;
    const char* toks = p + n * sizeof(GrpoStateSeq);
    memcpy(b->tokens, toks, n * T * sizeof(int32_t));
    memcpy(b->logp, toks + n * T * sizeof(int32_t), n * 2 * T * sizeof(float));
    char prompt[4096], answer[1024], text[4096];
    for (int k = 0; k < P; k++) {
        rl_task_train_problem(&g->task, h.for_step, k, prompt, sizeof prompt, answer,
                              sizeof answer);
        free(b->prompts[k]);
        free(b->answers[k]);
        b->prompts[k] = strndup_check(prompt, strlen(prompt));
        b->answers[k] = strndup_check(answer, strlen(answer));
    }
    for (size_t i = 0; i < n; i++, p += sizeof(GrpoStateSeq)) {
        GrpoStateSeq s;
        memcpy(&s, p, sizeof s);
        GenSeq* q = &b->seqs[i];
        if (s.prompt_len < 1 || s.len < s.prompt_len || s.len > h.maxT ||
            s.len - s.prompt_len > g->r->max_tokens || (s.stopped != 0 && s.stopped != 1))
            return errorf(err, "%s: answer %zu has %d tokens after a prompt of %d (budget %d, "
                          "%d positions)", what, i, (int)s.len, (int)s.prompt_len,
                          g->r->max_tokens, (int)h.maxT);
        for (int j = 0; j < s.len; j++)
            if (q->tokens[j] < 0 || q->tokens[j] >= g->m->cfg.V)
                return errorf(err, "%s: answer %zu holds token %d outside the vocabulary", what,
                              i, (int)q->tokens[j]);
        q->prompt_len = s.prompt_len;
        q->len = s.len;
        q->stopped = s.stopped;
        q->max_new = g->r->max_tokens;
        q->stop_a = g->stop_a;
        q->stop_b = g->stop_b;
        q->version = h.version;
        b->correct[i] = s.correct != 0;
        b->reward[i] = s.reward;
        rl_decode_answer(&g->m->cfg, g->tok, q->tokens + q->prompt_len, q->len - q->prompt_len,
                         g->stop_a, g->stop_b, text, sizeof text);
        free(b->completions[i]);
        b->completions[i] = strndup_check(text, strlen(text));
    }
    b->version = h.version;
    b->for_step = h.for_step;
    b->ready = 1;
    b->rollout_s = 0.0;
    return 0;
}
