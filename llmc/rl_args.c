/*
 * rl_args.c — parsing and checks of the reinforcement-learning flags (rl_args.h).
 */
#include "rl_args.h"

#include <math.h>
#include <string.h>

#include "common.h"
#include "json.h"

void rl_args_defaults(RlArgs* r) {
    memset(r, 0, sizeof *r);
    r->task = "arith";
    r->reward = RL_REWARD_EXACT;
    r->reward_cmd = "";
    r->reward_timeout = 30.0f;
    r->prompts = 8;
    r->group = 8;
    r->max_tokens = 8;
    r->eval = 64;
    r->adv_std = RL_ADV_GROUP;
    r->clip_low = 0.2f;
    r->clip_high = 0.28f;  // DAPO's clip-higher
    r->loss_agg = RL_AGG_TOKEN;
    r->max_staleness = 1;
    r->top_p = 1.0f;
}

const char* rl_adv_std_name(RlAdvStd a) {
    return a == RL_ADV_BATCH ? "batch" : a == RL_ADV_NONE ? "none" : "group";
}

const char* rl_loss_agg_name(RlLossAgg a) {
    return a == RL_AGG_SEQUENCE ? "sequence" : a == RL_AGG_DR_GRPO ? "dr-grpo" : "token";
}

static int rl_bad(const char* flag, const char* v, const char* what) {
    fprintf(stderr, "train_roundpipe: error: %s '%s': %s (see --help)\n", flag, v, what);
    return 2;
}

static int rl_int(const char* flag, const char* v, int lo, int hi, int* out) {
    int64_t x;
    char what[96];
    if (parse_int64(v, &x) != 0) return rl_bad(flag, v, "expected an integer");
    if (x < lo || x > hi) {
        snprintf(what, sizeof what, "out of range [%d, %d]", lo, hi);
        return rl_bad(flag, v, what);
    }
    *out = (int)x;
    return 0;
}

static int rl_float(const char* flag, const char* v, double lo, double hi, float* out) {
    double x;
    char what[96];
    if (parse_double(v, &x) != 0 || !isfinite(x)) return rl_bad(flag, v, "expected a number");
    if (x < lo || x > hi) {
        snprintf(what, sizeof what, "out of range [%g, %g]", lo, hi);
        return rl_bad(flag, v, what);
    }
    *out = (float)x;
    return 0;
}

int rl_args_owns(int c) { return c >= RL_OPT_BASE && c < RL_OPT_BASE + RL_OPT_COUNT; }

int rl_args_set(RlArgs* r, int c, const char* v) {
    switch (c - RL_OPT_BASE) {
        case 0:
            if (strcmp(v, "grpo") != 0) return rl_bad("--rl", v, "expected grpo");
            r->on = 1;
            return 0;
        case 1:
            if (!*v) return rl_bad("--rl-task", v, "expected arith or a .jsonl file");
            r->task = v;
            return 0;
        case 2:
            if (strcmp(v, "exact") == 0) r->reward = RL_REWARD_EXACT;
            else if (strcmp(v, "arith") == 0) r->reward = RL_REWARD_ARITH;
            else return rl_bad("--reward", v, "expected exact or arith");
            return 0;
        case 3: r->reward_cmd = v; return 0;
        case 4: return rl_float("--reward-timeout", v, 0.001, 86400.0, &r->reward_timeout);
        case 5: return rl_int("--rl-prompts", v, 1, 1 << 16, &r->prompts);
        case 6: return rl_int("--rl-group", v, 1, 1 << 12, &r->group);
        case 7: return rl_int("--rl-max-tokens", v, 1, 1 << 20, &r->max_tokens);
        case 8: return rl_int("--rl-eval", v, 0, 1 << 20, &r->eval);
        case 9: return rl_int("--rl-eval-every", v, 0, 1 << 30, &r->eval_every);
        case 10:
            if (strcmp(v, "group") == 0) r->adv_std = RL_ADV_GROUP;
            else if (strcmp(v, "batch") == 0) r->adv_std = RL_ADV_BATCH;
            else if (strcmp(v, "none") == 0) r->adv_std = RL_ADV_NONE;
            else return rl_bad("--adv-std", v, "expected group, batch or none");
            return 0;
        case 11: return rl_float("--clip-low", v, 0.0, 1.0, &r->clip_low);
        case 12: return rl_float("--clip-high", v, 0.0, 100.0, &r->clip_high);
        case 13:
            if (strcmp(v, "token") == 0) r->loss_agg = RL_AGG_TOKEN;
            else if (strcmp(v, "sequence") == 0) r->loss_agg = RL_AGG_SEQUENCE;
            else if (strcmp(v, "dr-grpo") == 0) r->loss_agg = RL_AGG_DR_GRPO;
            else return rl_bad("--loss-agg", v, "expected token, sequence or dr-grpo");
            return 0;
        case 14: return rl_float("--kl-beta", v, 0.0, 100.0, &r->kl_beta);
        case 15: return rl_int("--off-policy", v, 0, 1, &r->off_policy);
        case 16: return rl_int("--max-staleness", v, 0, 1 << 20, &r->max_staleness);
        case 17: return rl_int("--top-k", v, 0, 1 << 24, &r->top_k);
        case 18: {
            int rc = rl_float("--top-p", v, 0.0, 1.0, &r->top_p);
            if (rc == 0 && r->top_p <= 0.0f) return rl_bad("--top-p", v, "must be above 0");
            return rc;
        }
        case 19: return rl_int("--rl-ignore-eos", v, 0, 1, &r->ignore_eos);
        case 20: return rl_int("--rollout-gpus", v, 0, 1 << 10, &r->rollout_gpus);
        case 21: return rl_int("--rl-rollout-ranks", v, 0, 1 << 16, &r->rollout_ranks);
    }
    return rl_bad("--rl", v, "internal: unknown RL flag");
}

int rl_args_check(const RlArgs* r, int engine_batch, float temperature, int seq, int lora) {
    char v[64];
    if (!r->on) {
        if (*r->reward_cmd) return rl_bad("--reward-cmd", r->reward_cmd, "needs --rl grpo");
        return 0;
    }
    if (engine_batch > 0 && (r->prompts * r->group) % engine_batch != 0) {
        // the engine's batch is every answer of a step, in micro-batches of --batch rows
        snprintf(v, sizeof v, "%d", engine_batch);
        return rl_bad("--batch", v, "--rl through the RoundPipe engine (--device cuda or cpu:N) "
                      "splits the step's answers (--rl-prompts x --rl-group) into micro-batches "
                      "of --batch rows: it must divide them");
    }
    if (lora) return rl_bad("--rl", "grpo", "LoRA adapters are not supported with --rl yet");
    if (r->rollout_gpus > 0 && engine_batch == 0) {
        snprintf(v, sizeof v, "%d", r->rollout_gpus);
        return rl_bad("--rollout-gpus", v, "the split schedule gives devices of the RoundPipe "
                      "engine to generation: it needs --device cuda or cpu:N");
    }
    if (r->rollout_ranks > r->prompts) {
        snprintf(v, sizeof v, "%d", r->rollout_ranks);
        return rl_bad("--rl-rollout-ranks", v, "the answers are divided among the rollout ranks "
                      "by prompt: at most --rl-prompts of them");
    }
    snprintf(v, sizeof v, "%g", (double)temperature);
    if (temperature <= 0.0f)
        return rl_bad("--temperature", v, "--rl samples its answers: the temperature must be "
                      "above 0");
    snprintf(v, sizeof v, "%d", r->max_tokens);
    if (r->max_tokens + 2 > seq)
        return rl_bad("--rl-max-tokens", v, "the prompt and the answer must fit --seq: raise "
                      "--seq or lower --rl-max-tokens");
    if (r->off_policy && r->max_staleness < 1) {
        snprintf(v, sizeof v, "%d", r->max_staleness);
        return rl_bad("--max-staleness", v, "--off-policy 1 trains on batches one version behind: "
                      "at least 1");
    }
    return 0;
}

void rl_args_usage(FILE* f) {
    fprintf(f,
        "\n"
        "reinforcement learning (GRPO: plain training with --device cpu, the RoundPipe engine\n"
        "with --device cuda or cpu:N)\n"
        "      --rl grpo          train with GRPO instead of next-token prediction: per step\n"
        "                         --rl-group answers to each of --rl-prompts prompts, scored,\n"
        "                         the clipped policy-gradient loss, an optimizer step\n"
        "      --rl-task T        arith (held-out arithmetic problems in the shipped corpus's\n"
        "                         format) or a JSON-lines file of {\"prompt\",\"answer\"} (the last\n"
        "                         --rl-eval lines are held out) (default arith)\n"
        "      --reward R         exact (the answer's text equals \"answer\") or arith (its number\n"
        "                         equals the prompt's expression) (default exact)\n"
        "      --reward-cmd CMD   rewards from a program: one JSON line {\"prompt\",\"completion\",\n"
        "                         \"answer\"} per answer on its stdin, one number (or\n"
        "                         {\"reward\": x}) per line back; NaN, a missing line or a\n"
        "                         timeout masks the answer (never a reward of 0)\n"
        "      --reward-timeout S seconds the command has for a batch (default 30)\n"
        "      --rl-prompts P     prompts per step (default 8)\n"
        "      --rl-group G       answers per prompt (default 8)\n"
        "      --rl-max-tokens N  tokens per answer at most (default 8)\n"
        "      --rl-eval N        held-out problems answered greedily at the start, the end and\n"
        "                         every --rl-eval-every steps (default 64)\n"
        "      --rl-eval-every K  0 = start and end only (default 0)\n"
        "      --adv-std S        group | batch | none: advantages (r - group mean) divided by\n"
        "                         the group's std, the batch's, or not (Dr. GRPO) (default group)\n"
        "      --clip-low E, --clip-high E  ratio clip 1 - E .. 1 + E (default 0.2, 0.28)\n"
        "      --loss-agg A       token (sum over tokens / all tokens, DAPO) | sequence (mean per\n"
        "                         answer, then over answers, GRPO) | dr-grpo (sum / (max tokens x\n"
        "                         answers)) (default token)\n"
        "      --kl-beta B        k3 KL penalty to the initial policy (default 0: none)\n"
        "      --off-policy 0|1   1: the rollout of step t+1 uses the weights before step t (one\n"
        "                         step behind), corrected by the recorded log-probs (default 0)\n"
        "      --max-staleness K  a batch more than K versions behind is generated again\n"
        "                         (default 1)\n"
        "      --top-k K, --top-p P  sampling cut-offs (default 0 = off, 1 = off); the ratio\n"
        "                         uses the untruncated tempered softmax on both sides\n"
        "      --rl-ignore-eos 0|1  1: no stop token, every answer runs to --rl-max-tokens, and a\n"
        "                         model without a tokenizer reads its prompts as byte ids\n"
        "                         (speed benchmarks on random weights) (default 0)\n"
        "      --rollout-gpus K   split schedule: the last K devices generate (the answers\n"
        "                         divided among them by prompt), the others train, concurrently\n"
        "                         with --off-policy 1; the weights go to the first rollout device\n"
        "                         once, then a broadcast to the others (default 0: colocated)\n"
        "      --rl-rollout-ranks R  of the launched ranks (scripts/launch_local.sh, torchrun,\n"
        "                         --world), the last R only generate (the answers divided among\n"
        "                         them by prompt) and rank 0 trains: world = R + 1; the weights\n"
        "                         broadcast over NCCL after each step (default 0: none)\n");
}

int rl_args_check_world(const RlArgs* r, int world, const char* source, int cuda) {
    char v[64];
    snprintf(v, sizeof v, "%d", r->rollout_ranks);
    if (r->rollout_ranks == 0 || !r->on) return 0;
    if (r->rollout_gpus > 0)
        return rl_bad("--rl-rollout-ranks", v, "generates in other processes: it cannot be "
                      "combined with --rollout-gpus (rollout devices of this process); use one");
    if (r->rollout_ranks >= world) {
        char why[256];
        snprintf(why, sizeof why, "the last R of the launched ranks generate and rank 0 trains: "
                 "it needs a world of R + 1 ranks, and this one has %d (from %s)", world, source);
        return rl_bad("--rl-rollout-ranks", v, why);
    }
    if (world - r->rollout_ranks != 1) {
        char why[256];
        snprintf(why, sizeof why, "exactly one trainer rank: the world (%d, from %s) must be R + "
                 "1 (GRPO data parallel among several trainer ranks is not supported)", world,
                 source);
        return rl_bad("--rl-rollout-ranks", v, why);
    }
    if (!cuda)
        return rl_bad("--rl-rollout-ranks", v, "the ranks exchange prompts, answers and weights "
                      "over NCCL: it needs --device cuda or cuda:N (the trainer's engine)");
    return 0;
}

void rl_args_json(FILE* m, const RlArgs* r) {
    if (!r->on) return;
    fputs(",\n  \"rl\": \"grpo\",\n  \"rl-task\": ", m);
    json_write_string(m, r->task);
    fprintf(m, ",\n  \"reward\": \"%s\",\n  \"reward-cmd\": ",
            r->reward == RL_REWARD_ARITH ? "arith" : "exact");
    json_write_string(m, r->reward_cmd);
    fprintf(m, ",\n  \"rl-prompts\": %d,\n  \"rl-group\": %d,\n  \"rl-max-tokens\": %d"
               ",\n  \"adv-std\": \"%s\",\n  \"clip-low\": %.9g,\n  \"clip-high\": %.9g"
               ",\n  \"loss-agg\": \"%s\",\n  \"kl-beta\": %.9g,\n  \"off-policy\": %d"
               ",\n  \"max-staleness\": %d,\n  \"top-k\": %d,\n  \"top-p\": %.9g",
            r->prompts, r->group, r->max_tokens, rl_adv_std_name(r->adv_std),
            (double)r->clip_low, (double)r->clip_high, rl_loss_agg_name(r->loss_agg),
            (double)r->kl_beta, r->off_policy, r->max_staleness, r->top_k, (double)r->top_p);
    if (r->ignore_eos) fputs(",\n  \"rl-ignore-eos\": 1", m);  // (absent when off, as before)
    if (r->rollout_gpus) fprintf(m, ",\n  \"rollout-gpus\": %d", r->rollout_gpus);
    if (r->rollout_ranks) fprintf(m, ",\n  \"rl-rollout-ranks\": %d", r->rollout_ranks);
}
