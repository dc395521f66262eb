/*
 * rl_args.h — the flags of reinforcement-learning runs (--rl grpo and its options): their struct,
 * defaults, parsing of one flag, the cross-flag checks, the --help section and the args.json
 * keys. args.c owns the command line and hands these flags here (RL_ARGS_OPTIONS in its getopt
 * table), so the RL options live in one place.
 */
#ifndef LLMC_RL_ARGS_H
#define LLMC_RL_ARGS_H

#include <stdio.h>

typedef enum { RL_ADV_GROUP = 0, RL_ADV_BATCH, RL_ADV_NONE } RlAdvStd;
typedef enum { RL_AGG_TOKEN = 0, RL_AGG_SEQUENCE, RL_AGG_DR_GRPO } RlLossAgg;
typedef enum { RL_REWARD_EXACT = 0, RL_REWARD_ARITH } RlReward;

typedef struct RlArgs {
    int on;                  // --rl grpo
    const char* task;        // --rl-task: "arith" (generated problems) or a JSON-lines file
    RlReward reward;         // --reward exact | arith
    const char* reward_cmd;  // --reward-cmd CMD ("" = the built-in reward)
    float reward_timeout;    // seconds to wait for the command's rewards of a batch
    int prompts;             // P: prompts per step
    int group;               // G: answers per prompt
    int max_tokens;          // answer budget in tokens
    int eval;                // held-out problems scored (greedy) at the start, every
    int eval_every;          //   --rl-eval-every steps (0: start and end) and at the end
    RlAdvStd adv_std;
    float clip_low, clip_high;
    RlLossAgg loss_agg;
    float kl_beta;           // k3 KL to the initial policy (0: none)
    int off_policy;          // 1: the rollout of step t+1 runs with the weights before step t
    int max_staleness;       // batches more versions behind than this are generated again
    int top_k;               // sampling: 0 = off
    float top_p;             // sampling: 1 = off
    int ignore_eos;          // --rl-ignore-eos 1: answers run to --rl-max-tokens (benchmarks)
    int rollout_gpus;        // --rollout-gpus K: the last K devices generate while the others
                             // train (split schedule); 0: colocated
    int rollout_ranks;       // --rl-rollout-ranks R: the last R ranks of the launched world only
                             // generate, rank 0 trains (grpo.h); 0: none
} RlArgs;

#define RL_OPT_BASE 3000
#define RL_ARGS_OPTIONS                                                                         \
    {"rl", required_argument, 0, RL_OPT_BASE + 0},                                              \
    {"rl-task", required_argument, 0, RL_OPT_BASE + 1},                                         \
    {"reward", required_argument, 0, RL_OPT_BASE + 2},                                          \
    {"reward-cmd", required_argument, 0, RL_OPT_BASE + 3},                                      \
    {"reward-timeout", required_argument, 0, RL_OPT_BASE + 4},                                  \
    {"rl-prompts", required_argument, 0, RL_OPT_BASE + 5},                                      \
    {"rl-group", required_argument, 0, RL_OPT_BASE + 6},                                        \
    {"rl-max-tokens", required_argument, 0, RL_OPT_BASE + 7},                                   \
    {"rl-eval", required_argument, 0, RL_OPT_BASE + 8},                                         \
    {"rl-eval-every", required_argument, 0, RL_OPT_BASE + 9},                                   \
    {"adv-std", required_argument, 0, RL_OPT_BASE + 10},                                        \
    {"clip-low", required_argument, 0, RL_OPT_BASE + 11},                                       \
    {"clip-high", required_argument, 0, RL_OPT_BASE + 12},                                      \
    {"loss-agg", required_argument, 0, RL_OPT_BASE + 13},                                       \
    {"kl-beta", required_argument, 0, RL_OPT_BASE + 14},                                        \
    {"off-policy", required_argument, 0, RL_OPT_BASE + 15},                                     \
    {"max-staleness", required_argument, 0, RL_OPT_BASE + 16},                                  \
    {"top-k", required_argument, 0, RL_OPT_BASE + 17},                                          \
    {"top-p", required_argument, 0, RL_OPT_BASE + 18},                                          \
    {"rl-ignore-eos", required_argument, 0, RL_OPT_BASE + 19},                                  \
    {"rollout-gpus", required_argument, 0, RL_OPT_BASE + 20},                                   \
    {"rl-rollout-ranks", required_argument, 0, RL_OPT_BASE + 21}
#define RL_OPT_COUNT 22

void rl_args_defaults(RlArgs* r);
// 1 when getopt's code c is one of the RL flags.
int rl_args_owns(int c);
// Set flag c from value v: 0, or 2 after one error line on stderr.
int rl_args_set(RlArgs* r, int c, const char* v);
// The RL flags against the run's: 0, or 2 after one error line. engine_batch: --batch when the
// step goes through the RoundPipe engine (--device cpu:N / cuda; it must divide the answers of a
// step), else 0.
int rl_args_check(const RlArgs* r, int engine_batch, float temperature, int seq, int lora);
void rl_args_usage(FILE* f);
// --rl-rollout-ranks against the launched world (args.c, once the world size is known): not
// with --rollout-gpus, exactly one trainer rank (world - R == 1), on GPUs (cuda: --device cuda).
// 0, or 2 after one error line.
int rl_args_check_world(const RlArgs* r, int world, const char* source, int cuda);
// ",\n  \"rl\": ..." keys of args.json (nothing when --rl is off).
void rl_args_json(FILE* m, const RlArgs* r);
const char* rl_adv_std_name(RlAdvStd a);
const char* rl_loss_agg_name(RlLossAgg a);

#endif  // LLMC_RL_ARGS_H
