/*
 * rl_task.c — problems, encoding, rewards and the reward command of GRPO runs (rl_task.h).
 */
#include "rl_task.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "json.h"
#include "rng.h"

// ----------------------------------------------------------------------------
// problems

// One arithmetic problem in the corpus's distribution (data/gen_arith.py): a+b with a, b in
// 0..99 (40%), a-b with 0 <= b <= a <= 99 (30%), a*b with a, b in 0..12 (30%).
static void arith_problem(Rng* r, char* prompt, size_t pcap, char* answer, size_t acap) {
    const int kind = (int)rng_below(r, 10);
    int a, b, c;
    char op;
    if (kind < 4) {
        a = (int)rng_below(r, 100), b = (int)rng_below(r, 100), op = '+', c = a + b;
    } else if (kind < 7) {
        a = (int)rng_below(r, 100), b = (int)rng_below(r, (uint64_t)a + 1), op = '-', c = a - b;
    } else {
        a = (int)rng_below(r, 13), b = (int)rng_below(r, 13), op = '*', c = a * b;
    }
    snprintf(prompt, pcap, "%d%c%d=", a, op, b);
    snprintf(answer, acap, "%d", c);
}

// A seed from (run seed, stream, step, index): the problems of a step do not depend on the ones
// before it (a resumed run asks the same).
static uint32_t problem_seed(uint32_t seed, uint32_t stream, int64_t step, int i) {
    uint64_t z = ((uint64_t)seed << 32 | stream) ^ ((uint64_t)step * 0x9e3779b97f4a7c15ull) ^
                 ((uint64_t)(uint32_t)i * 0xc2b2ae3d27d4eb4full);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)(z ^ (z >> 31));
}

static int is_eval_prompt(const RlTask* t, const char* prompt) {
    for (int i = 0; i < t->n_eval; i++)
        if (strcmp(t->eval_prompts[i], prompt) == 0) return 1;
    return 0;
}

// Every line a {"prompt": string, "answer": string} object (blank lines skipped).
static int read_jsonl(RlTask* t, const char* path, char* err) {
    char ferr[ERR_LEN];
    size_t len = 0;
    char* text = file_read_all(path, (size_t)1 << 30, &len, ferr);
    if (!text) {
        snprintf(err, ERR_LEN, "--rl-task %.200s: %.250s", path, ferr);
        return -1;
    }
    int cap = 0, line = 0;
    for (char* s = text; s < text + len;) {
        char* e = memchr(s, '\n', (size_t)(text + len - s));
        if (!e) e = text + len;
        line++;
        size_t n = (size_t)(e - s);
        int blank = 1;
        for (size_t i = 0; i < n; i++) blank &= isspace((unsigned char)s[i]) != 0;
        if (!blank) {
            JsonDoc doc;
            char jerr[ERR_LEN];
            const char *p = NULL, *a = NULL;
            if (json_parse(s, n, &doc, jerr) != 0) {
                snprintf(err, ERR_LEN, "--rl-task %.200s line %d: %.250s", path, line, jerr);
                free(text);
                return -1;
            }
            if (json_get_string(&doc.root, "prompt", &p) != 1 ||
                json_get_string(&doc.root, "answer", &a) != 1) {
                snprintf(err, ERR_LEN, "--rl-task %s line %d: expected {\"prompt\": string, "
                         "\"answer\": string}", path, line);
                json_free(&doc);
                free(text);
                return -1;
            }
            if (t->n_lines == cap) {
                cap = cap ? 2 * cap : 64;
                t->prompts = realloc_check(t->prompts, (size_t)cap * sizeof(char*));
                t->answers = realloc_check(t->answers, (size_t)cap * sizeof(char*));
            }
            t->prompts[t->n_lines] = strndup_check(p, strlen(p));
            t->answers[t->n_lines] = strndup_check(a, strlen(a));
            t->n_lines++;
            json_free(&doc);
        }
        s = e + 1;
    }
    free(text);
    if (t->n_lines == 0) {
        snprintf(err, ERR_LEN, "--rl-task %s: no problems in the file", path);
        return -1;
    }
    return 0;
}

int rl_task_open(RlTask* t, const char* spec, int n_eval, uint32_t seed, char* err) {
    memset(t, 0, sizeof *t);
    t->seed = seed;
    if (strcmp(spec, "arith") == 0) {
        // the held-out problems first, distinct, from a stream of their own
        t->arith = 1;
        t->prompts = calloc_check((size_t)imax(n_eval, 1), sizeof(char*));
        t->answers = calloc_check((size_t)imax(n_eval, 1), sizeof(char*));
        t->eval_prompts = t->prompts;
        t->eval_answers = t->answers;
        Rng r;
        rng_seed(&r, problem_seed(seed, 1, 0, 0));
        for (int tries = 0; t->n_eval < n_eval && tries < 100 * n_eval; tries++) {
            char p[64], a[32];
            arith_problem(&r, p, sizeof p, a, sizeof a);
            if (is_eval_prompt(t, p)) continue;
            t->prompts[t->n_eval] = strndup_check(p, strlen(p));
            t->answers[t->n_eval] = strndup_check(a, strlen(a));
            t->n_eval++;
        }
        return 0;
    }
    if (read_jsonl(t, spec, err) != 0) {
        rl_task_free(t);
        return -1;
    }
    // hold out the last n_eval lines, keeping at least one to train on
    t->n_eval = imin(n_eval, t->n_lines - 1);
    t->n_train = t->n_lines - t->n_eval;
    t->eval_prompts = t->prompts + t->n_train;
    t->eval_answers = t->answers + t->n_train;
    return 0;
}

void rl_task_free(RlTask* t) {
    const int n = t->arith ? t->n_eval : t->n_lines;
    for (int i = 0; i < n; i++) {
        free(t->prompts[i]);
        free(t->answers[i]);
    }
    free(t->prompts);
    free(t->answers);
    memset(t, 0, sizeof *t);
}

void rl_task_train_problem(const RlTask* t, int64_t step, int i, char* prompt, size_t pcap,
                           char* answer, size_t acap) {
    if (!t->arith) {
        // a training line drawn from (seed, step, i)
        Rng r;
        rng_seed(&r, problem_seed(t->seed, 0, step, i));
        const int line = (int)rng_below(&r, (uint64_t)t->n_train);
        str_copy(prompt, pcap, t->prompts[line]);
        str_copy(answer, acap, t->answers[line]);
        return;
    }
    Rng r;
    rng_seed(&r, problem_seed(t->seed, 0, step, i));
    do {
        arith_problem(&r, prompt, pcap, answer, acap);
    } while (is_eval_prompt(t, prompt));
}

// ----------------------------------------------------------------------------
// encoding

int rl_encode_prompt(const ModelConfig* c, const Tokenizer* tok, const char* text, int32_t* out,
                     int cap) {
    int n = 0;
    const size_t len = strlen(text);
    if (tok) {
        const int32_t doc = tokenizer_document_token(tok);
        if (doc >= 0 && n < cap) out[n++] = doc;
        TokIds ids = {0};
        tokenizer_encode_once(tok, text, len, 0, &ids);
        if (ids.n > (size_t)(cap - n)) n = -1;
        else {
            memcpy(out + n, ids.ids, ids.n * sizeof(int32_t));
            n += (int)ids.n;
        }
        tokenizer_ids_free(&ids);
        return n;
    }
    if (c->bos_id >= 0 && n < cap) out[n++] = c->bos_id;
    if (len > (size_t)(cap - n)) return -1;
    for (size_t i = 0; i < len; i++) out[n++] = (unsigned char)text[i];
    return n;
}

void rl_stop_tokens(const ModelConfig* c, const Tokenizer* tok, int* stop_a, int* stop_b) {
    *stop_a = tok ? tokenizer_document_token(tok) : c->bos_id;
    *stop_b = -1;
    if (!tok) {
        if (c->V == 256) *stop_b = '\n';
        return;
    }
    TokIds ids = {0};
    tokenizer_encode_once(tok, "\n", 1, 0, &ids);
    if (ids.n == 1) *stop_b = ids.ids[0];
    tokenizer_ids_free(&ids);
}

void rl_decode_answer(const ModelConfig* c, const Tokenizer* tok, const int32_t* ids, int n,
                      int stop_a, int stop_b, char* out, size_t cap) {
    size_t k = 0;
    for (int i = 0; i < n && k + 1 < cap; i++) {
        if (ids[i] == stop_a || ids[i] == stop_b) break;
        if (tok) {
            size_t len = 0;
            const uint8_t* s = tokenizer_piece(tok, ids[i], &len);
            for (size_t j = 0; s && j < len && k + 1 < cap; j++) out[k++] = (char)s[j];
        } else if (c->V == 256 && ids[i] > 0) {
            out[k++] = (char)ids[i];
        }
    }
    out[k] = '\0';
}

// ----------------------------------------------------------------------------
// rewards

// s without leading and trailing white space, into buf.
static const char* trimmed(const char* s, char* buf, size_t cap) {
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) n--;
    if (n >= cap) n = cap - 1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    return buf;
}

int rl_exact_match(const char* completion, const char* answer) {
    char a[512], b[512];
    return strcmp(trimmed(completion, a, sizeof a), trimmed(answer, b, sizeof b)) == 0;
}

// The value of the prompt's last "a<op>b=" (0: none).
static int prompt_value(const char* prompt, long long* value) {
    const char* eq = strrchr(prompt, '=');
    if (!eq) return 0;
    const char* s = eq;
    while (s > prompt && s[-1] != '\n') s--;  // the start of its line
    long long a, b;
    char op;
    int used = 0;
    if (sscanf(s, "%lld%c%lld=%n", &a, &op, &b, &used) != 3 || s + used != eq + 1) return 0;
    if (op == '+') *value = a + b;
    else if (op == '-') *value = a - b;
    else if (op == '*') *value = a * b;
    else return 0;
    return 1;
}

double rl_reward_builtin(RlReward kind, const char* prompt, const char* completion,
                         const char* answer) {
    if (kind == RL_REWARD_EXACT) return rl_exact_match(completion, answer) ? 1.0 : 0.0;
    long long want;
    if (!prompt_value(prompt, &want)) return NAN;
    char buf[512];
    const char* s = trimmed(completion, buf, sizeof buf);
    char* end = NULL;
    errno = 0;
    const long long got = strtoll(s, &end, 10);
    return (*s && end && *end == '\0' && errno == 0 && got == want) ? 1.0 : 0.0;
}

// ----------------------------------------------------------------------------
// the reward command

void reward_cmd_init(RewardCmd* rc, const char* cmd, double timeout_s) {
    memset(rc, 0, sizeof *rc);
    rc->cmd = cmd;
    rc->timeout_s = timeout_s;
    rc->to_child = rc->from_child = -1;
}

static int reward_cmd_start(RewardCmd* rc) {
    int in[2], out[2];
    if (pipe(in) != 0) return -1;
    if (pipe(out) != 0) {
        close(in[0]);
        close(in[1]);
        return -1;
    }
    // a command that exits early must not kill the trainer with SIGPIPE: writes fail instead
    signal(SIGPIPE, SIG_IGN);
    const pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        close(in[0]);
        close(in[1]);
        close(out[0]);
        close(out[1]);
        execl("/bin/sh", "sh", "-c", rc->cmd, (char*)NULL);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    rc->pid = pid;
    rc->to_child = in[1];
    rc->from_child = out[0];
    return 0;
}

void reward_cmd_stop(RewardCmd* rc) {
    if (rc->pid <= 0) return;
    close(rc->to_child);
    close(rc->from_child);
    kill(rc->pid, SIGTERM);
    waitpid(rc->pid, NULL, 0);
    rc->pid = 0;
    rc->to_child = rc->from_child = -1;
}

// One line of the command's answer: a number, NaN / null, or an object with "reward".
static double parse_reward_line(const char* line) {
    while (isspace((unsigned char)*line)) line++;
    if (*line == '{') {
        JsonDoc doc;
        char err[ERR_LEN];
        double v = NAN;
        if (json_parse(line, strlen(line), &doc, err) != 0) return NAN;
        if (json_get_double(&doc.root, "reward", &v) != 1) v = NAN;
        json_free(&doc);
        return v;
    }
    char* end = NULL;
    const double v = strtod(line, &end);
    if (end == line) return NAN;
    while (end && isspace((unsigned char)*end)) end++;
    return end && *end == '\0' && isfinite(v) ? v : NAN;
}

int reward_cmd_score(RewardCmd* rc, int n, const char* const* prompts,
                     const char* const* completions, const char* const* answers, double* out) {
    for (int i = 0; i < n; i++) out[i] = NAN;
    if (rc->pid <= 0 && reward_cmd_start(rc) != 0) {
        printf("warning: --reward-cmd: cannot start '%s': every answer of this batch masked\n",
               rc->cmd);
        return n;
    }
    // the requests, all of them, as JSON lines
    char* req = NULL;
    size_t req_len = 0;
    FILE* m = open_memstream(&req, &req_len);
    if (!m) fatal("open_memstream failed");
    for (int i = 0; i < n; i++) {
        fputs("{\"prompt\": ", m);
        json_write_string(m, prompts[i]);
        fputs(", \"completion\": ", m);
        json_write_string(m, completions[i]);
        fputs(", \"answer\": ", m);
        json_write_string(m, answers[i] ? answers[i] : "");
        fputs("}\n", m);
    }
    if (fclose(m) != 0) fatal("building the reward requests failed");
    // write and read at once (a command answering line by line would otherwise fill its output
    // pipe while this side still writes), until every line is back or the time is up
    size_t sent = 0, got_len = 0, got_cap = 4096;
    char* got = malloc_check(got_cap);
    int lines = 0, failed = 0;
    const double deadline = time_now_s() + rc->timeout_s;
    while (lines < n && !failed) {
        const double left = deadline - time_now_s();
        if (left <= 0) {
            printf("warning: --reward-cmd: no answer within %g s: %d of %d answers masked\n",
                   rc->timeout_s, n - lines, n);
            failed = 1;
            break;
        }
        struct pollfd fds[2] = {{.fd = rc->from_child, .events = POLLIN},
                                {.fd = sent < req_len ? rc->to_child : -1, .events = POLLOUT}};
        const int pr = poll(fds, 2, (int)fmin(left * 1000.0 + 1.0, 1e9));
        if (pr < 0 && errno != EINTR) failed = 1;
        if (pr <= 0) continue;
        if (fds[1].revents & (POLLOUT | POLLERR | POLLHUP)) {
            const ssize_t w = write(rc->to_child, req + sent, req_len - sent);
            if (w < 0 && errno != EINTR && errno != EAGAIN) failed = 1;
            if (w > 0) sent += (size_t)w;
        }
        if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            if (got_len + 1024 > got_cap) got = realloc_check(got, got_cap *= 2);
            const ssize_t r = read(rc->from_child, got + got_len, got_cap - got_len - 1);
            if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
                printf("warning: --reward-cmd: the command ended after %d of %d answers: the rest "
                       "masked\n", lines, n);
                failed = 1;
            }
            if (r > 0) got_len += (size_t)r;
            got[got_len] = '\0';
            // every complete line is one reward
            char* s = got;
            char* e;
            while (lines < n && (e = strchr(s, '\n')) != NULL) {
                *e = '\0';
                out[lines++] = parse_reward_line(s);
                s = e + 1;
            }
            got_len -= (size_t)(s - got);
            memmove(got, s, got_len + 1);
        }
    }
    free(got);
    free(req);
    if (failed) {
        reward_cmd_stop(rc);  // started again for the next batch
        rc->n_restarts++;
    }
    int n_nan = 0;
    for (int i = 0; i < n; i++) n_nan += isnan(out[i]) ? 1 : 0;
    return n_nan;
}
