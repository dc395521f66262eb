/*
 * rl_task.h — what a GRPO run asks and how its answers are scored: the problems (generated
 * arithmetic in the shipped corpus's format, or {"prompt", "answer"} JSON lines), their encoding
 * for the model (byte-level vocabularies: the document token, then the bytes; models with a
 * tokenizer: its document token and encoding), the answer's text back from the generated tokens,
 * the built-in rewards and the reward command.
 *
 * Held out: the arithmetic task draws its evaluation problems first (a stream of their own) and
 * never gives one of them as a training prompt; a JSON-lines task holds out its last n_eval lines.
 * Training prompts of step s are a function of (seed, s), so a resumed run asks the same ones.
 *
 * Rewards are doubles; NaN means "no reward" (the command failed, timed out, said NaN or null,
 * or the prompt cannot be scored) and masks the answer: it takes no part in its group's
 * statistics and gets no gradient. It never counts as 0.
 */
#ifndef LLMC_RL_TASK_H
#define LLMC_RL_TASK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "config.h"
#include "rl_args.h"
#include "tokenizer.h"

typedef struct RlTask {
    int arith;            // generated problems (else JSON lines)
    uint32_t seed;
    int n_lines;          // JSON lines: all of them
    int n_train;          //   the first n_train train, the rest are held out
    char** prompts;       // (n_lines) or (n_eval) for arith: the held-out problems
    char** answers;
    int n_eval;           // held-out problems
    char** eval_prompts;  // (n_eval) pointers into prompts / answers
    char** eval_answers;
} RlTask;

// spec: "arith" or a .jsonl path. -1 + err (the file's line on a bad one).
int rl_task_open(RlTask* t, const char* spec, int n_eval, uint32_t seed, char* err);
void rl_task_free(RlTask* t);
// Training problem i of step `step` into prompt / answer (caps include the NUL).
void rl_task_train_problem(const RlTask* t, int64_t step, int i, char* prompt, size_t pcap,
                           char* answer, size_t acap);

// The model's ids of a prompt: the document token (when the model has one), then the text's
// tokens; at most cap (the rest cut, -1 when it does not fit at all). tok NULL: bytes (V 256).
int rl_encode_prompt(const ModelConfig* c, const Tokenizer* tok, const char* text, int32_t* out,
                     int cap);
// The tokens that end an answer: the document token and the newline token (-1 when none).
void rl_stop_tokens(const ModelConfig* c, const Tokenizer* tok, int* stop_a, int* stop_b);
// The answer's text (the stop token dropped), NUL-terminated, cut to cap.
void rl_decode_answer(const ModelConfig* c, const Tokenizer* tok, const int32_t* ids, int n,
                      int stop_a, int stop_b, char* out, size_t cap);

// 1 when the answer's text equals the reference after trimming white space.
int rl_exact_match(const char* completion, const char* answer);
// The built-in reward of one answer: exact (1 / 0) or arith (1 when its integer equals the
// prompt's "a+b=" / "a-b=" / "a*b=" value; NaN when the prompt has no such expression).
double rl_reward_builtin(RlReward kind, const char* prompt, const char* completion,
                         const char* answer);

// ----------------------------------------------------------------------------
// the reward command: a child process (sh -c CMD) kept for the run

typedef struct RewardCmd {
    const char* cmd;
    pid_t pid;       // 0: not running (started on the next batch)
    int to_child;    // its stdin
    int from_child;  // its stdout
    double timeout_s;
    int n_restarts;
} RewardCmd;

void reward_cmd_init(RewardCmd* rc, const char* cmd, double timeout_s);
// Rewards of n answers: one JSON line {"prompt","completion","answer"} each to the command, one
// line back each (a number, NaN / null, or an object with "reward"); unanswered lines when the
// time is up or the command exits are NaN (the command is then stopped and started again for
// the next batch). Returns the number of NaN rewards.
int reward_cmd_score(RewardCmd* rc, int n, const char* const* prompts,
                     const char* const* completions, const char* const* answers, double* out);
void reward_cmd_stop(RewardCmd* rc);

#endif  // LLMC_RL_TASK_H
