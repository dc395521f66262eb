/*
 * testing.h — the tiny test framework of test_roundpipe.c.
 *
 * A test is `void test_x(TestCtx* t)`; CHECK* macros record failures without aborting the test.
 * Each test file exports one NULL-terminated TestCase array (tests_<suite>) that test_roundpipe.c
 * lists. Temporary files go under t->tmpdir (one directory per run, removed at the end).
 *
 * Every test ends in one of three states, and the runner counts them apart:
 *   failed   a CHECK failed, or the test ran no CHECK at all without saying it was skipped
 *   skipped  test_skip was called (it cannot run here: no GPU, a build without CUDA) and no
 *            CHECK failed; it is never counted as passed
 *   passed   otherwise; parts it could not run here (an AVX-512 path on a CPU without it) are
 *            named by test_skip_part and listed on its "ok" line
 */
#ifndef LLMC_TESTS_TESTING_H
#define LLMC_TESTS_TESTING_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "../adamw.h"
#include "../config.h"
#include "../model.h"
#include "../ops.h"
#include "../rng.h"
#include "../safetensors.h"
#include "../store.h"

typedef struct TestCtx {
    const char* name;   // current test
    int checks;
    int failures;
    const char* tmpdir; // per-run scratch directory
    const char* exe_dir; // directory holding ./train_roundpipe (for CLI tests)
    int n_threads;      // threads tests may use (2 on CI)
    char skip_why[256];      // test_skip: why the test did not run ("" = it ran)
    char skipped_parts[256]; // test_skip_part: the parts that did not run, "; "-separated
} TestCtx;

typedef void (*TestFn)(TestCtx* t);
typedef struct TestCase {
    const char* name;
    TestFn fn;
} TestCase;

#define CHECK(t, cond, ...)                                                              \
    do {                                                                                 \
        (t)->checks++;                                                                   \
        if (!(cond)) {                                                                   \
            (t)->failures++;                                                             \
            fprintf(stderr, "  %s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);   \
            fprintf(stderr, __VA_ARGS__);                                                \
            fprintf(stderr, "\n");                                                       \
        }                                                                                \
    } while (0)

// |a - b| <= tol (NaN fails).
#define CHECK_NEAR(t, a, b, tol, what)                                                    \
    do {                                                                                  \
        double a__ = (double)(a), b__ = (double)(b), tol__ = (double)(tol);               \
        CHECK(t, fabs(a__ - b__) <= tol__, "%s: %.9g vs %.9g (tol %.3g)", (what), a__, b__, \
              tol__);                                                                     \
    } while (0)

// ---- skipping (testing.c) ----
// The test cannot run here: the runner reports "skip <name> (why)" and counts it as skipped.
// Call it before any CHECK and return; should checks have run first (a precondition), the
// runner says how many. A failed CHECK still fails the test.
void test_skip(TestCtx* t, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// One part of the test cannot run here (the test still passes on the parts that did): the
// runner appends "(skipped: what)" to the test's "ok" line. Naming a part twice lists it once.
void test_skip_part(TestCtx* t, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Relative L2 error ||a - b|| / max(||b||, tiny) of two float arrays.
static inline double rel_l2_error(const float* a, const float* b, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    if (isnan(num)) return INFINITY;
    return sqrt(num) / (den > 0 ? sqrt(den) : 1e-30);
}

// ||a - b|| of two float arrays, in double.
static inline double l2_dist(const float* a, const float* b, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)a[i] - (double)b[i];
        sum += d * d;
    }
    return sqrt(sum);
}

// Build "tmpdir/name" into buf (cap bytes) and return buf.
static inline const char* test_path(const TestCtx* t, char* buf, size_t cap, const char* name) {
    snprintf(buf, cap, "%s/%s", t->tmpdir, name);
    return buf;
}

// ---- CLI helpers (testing.c) ----
// The trainer the CLI tests run, relative to the repository root: $TRAIN_ROUNDPIPE_BIN when set
// (`make asan` runs them against the sanitized build), else ./train_roundpipe.
const char* test_trainer_binary(void);
// Run the trainer with `args` from the repository root; stdout/stderr go to
// tmpdir/<tag>.out and .err. Returns the exit status (-1 if it did not exit normally).
int test_run_cli(TestCtx* t, const char* tag, const char* args);
// A whole file (NUL-terminated, malloc'd; "" when unreadable), its length in *len if non-NULL.
char* test_read_file(const char* path, size_t* len);
// tmpdir/<tag>.<ext> of a test_run_cli run.
char* test_read_output(TestCtx* t, const char* tag, const char* ext);
// err is one line (a trailing newline, no other), names an error and contains must.
int test_one_error_line(const char* err, const char* must);

// ---- CLI runs compared by their logs (testing.c) ----
// The log files' records of steps from..to agree (test_log_record: loss, lr, norm, ... as logged
// strings, the timings aside): one CHECK per step, "<what> step N: '<a>' vs '<b>'". 1 when all do.
int test_same_steps(TestCtx* t, const char* what, const char* log_a, const char* log_b, int from,
                    int to);

// The runs of test_resume_runs, under tmpdir with the tag's prefix.
typedef struct TestResumeRuns {
    char straight_out[1024];  // <tag>_straight: the straight run's --out (step_<steps>/ and all)
    char resumed_out[1024];   // <tag>_resumed: the --out of the first part and the resumed run
    char straight_log[1024];  // <tag>_a.jsonl
    char first_log[1024];     // <tag>_b1.jsonl
    char resumed_log[1024];   // <tag>_b2.jsonl
    char resumed_tag[160];    // test_run_cli's tag of the resumed run (its .out and .err)
} TestResumeRuns;
// `args` (model, data, run flags) three times: straight for `steps` steps (--save-every steps);
// a first part for `first_steps` steps saving every `split` (first_steps > split: every save
// after step `split` then loses its DONE, as if the run had crashed before completing them);
// and --resume from that to `steps` (--save-every split). CHECKs that each exits 0 ("<tag>:
// straight run", "first part", "resumed part"), each removal, and that the straight log's
// records of steps 1..split are the first part's and those of split+1..steps the resumed run's
// (test_same_steps, what = tag). 1 when all of that held.
int test_resume_runs(TestCtx* t, TestResumeRuns* r, const char* tag, const char* args,
                     int steps, int split, int first_steps);

// ---- the reference trainer (testing.c) ----
// Plain (non-pipelined) training of c's model on ops/ctx: each step runs M micro-batches of
// tokens (steps x B x (T+1)), then AdamW on the host (gradient clip 1.0, the learning rate of
// step k+1 from sched, as the engine numbers steps). Weights from store_init_random(init_seed,
// init_scale). delayed = 0: synchronous; 1: the one-step-delayed update written out by hand —
// iteration t computes gradients with θ_{max(t-1,0)} (a second store holds the weights being
// computed with) and the step applies them to θ_t.
typedef struct RefTrain {
    const ModelConfig* c;
    const Ops* ops;
    void* ctx;
    int B, T, M, steps, delayed;
    int rounds;  // > 1: the micro-batches in this many rounds, each accumulated from zero with its
                 // tied gradient folded, the rounds then added in order (the engine's split rounds)
    int mlp_chunk;  // Model.mlp_chunk (long-sequence mode when the micro-batch has more rows)
    AdamWHyper hyper;
    LrSchedule sched;
    uint32_t init_seed;
    float init_scale;
    const LoraSpec* lora;  // LoRA adapters on the frozen base (NULL: full training), initialised
                           // by lora_init_random(init_seed), with the trainer's dropout masks
                           // (lora_dropout_seed(init_seed, step, micro-batch))
} RefTrain;
// loss[steps]; with params non-NULL also every parameter slab after the last step, concatenated
// (malloc'd), and their count.
void test_reference_train(const RefTrain* r, const int32_t* tokens, double* loss, float** params,
                          int64_t* n_params);

// An HF parity fixture (dev/parity/fixtures/<name>): the model with the fixture's weights, its
// expected.safetensors, and the batch and loss recorded there.
typedef struct ParityFixture {
    Model m;
    Store s;
    StFile ex;
    int32_t* tokens;  // (B, T + 1)
    int B, T;
    float ref_loss;   // NAN when the fixture has none
} ParityFixture;
// 0, or -1 after a failed CHECK saying why (nothing left to close).
int test_parity_open(TestCtx* t, const char* name, ParityFixture* f);
// The same for a fixture directory anywhere (config.json, model.safetensors, expected.safetensors).
int test_parity_open_dir(TestCtx* t, const char* dir, ParityFixture* f);
void test_parity_close(ParityFixture* f);

// The store's gradients against an HF parity fixture's "grad.<checkpoint name>" tensors, through
// the HF view (every owned tensor, or each expert's slice in the hub's per-expert Qwen3-MoE
// layout; the tied head's gradient is folded into the embedding): one CHECK per tensor that the
// relative L2 error is <= tol (what: the message's prefix), and one that every fixture gradient
// was compared. Returns the worst error; *n_grads = tensors compared; *worst_name (optional) the
// worst one's name.
double test_check_fixture_grads(TestCtx* t, const char* what, const Model* m, const Store* s,
                                const StFile* ex, double tol, int* n_grads,
                                const char** worst_name);

// Buffers and comparisons for the op and model tests (test_ops.c, test_moe.c).
// n floats ~ scale * N(0, 1) / all equal to v (at least one element is allocated).
float* rand_floats(Rng* r, size_t n, float scale);
float* filled_floats(size_t n, float v);
// x as doubles (x NULL: zeros).
double* to_doubles(const float* x, size_t n);
double dot_d(const double* a, const double* b, size_t n);
// got against want: relative L2 error <= tol and the worst element <= 4 tol of the largest |want|
// (NaN fails).
void check_close(TestCtx* t, const char* what, const float* got, const double* want, size_t n,
                 double tol);

// Finite-difference gradient checks (test_model.c, test_lora.c, test_moe.c).
// |g| in double.
double test_gradient_norm(const float* g, int64_t n);
// A unit probe direction (n doubles): mostly along g (|g| = gnorm) plus 0.5 N(0, 1/n) noise drawn
// from r, n draws in order; *analytic = direction . g.
double* test_probe_direction(Rng* r, const float* g, int64_t n, double gnorm, double* analytic);
// The central difference (loss(p + eps dir) - loss(p - eps dir)) / (2 eps), p rounded to fp32 at
// each probe and restored bit-exactly afterwards.
double test_central_difference(float* p, const double* dir, int64_t n, double eps,
                               double (*loss)(void* ctx), void* ctx);

// Log and model helpers for the trainer and engine suites.
// The deterministic head of the log record of `step` ("{"step":N,"loss":..,"lr":..,"norm":..",
// up to its timing) into out; 0 if the log has no such record or it does not fit in cap.
int test_log_record(const char* log, int step, char* out, size_t cap);
// The value of "key" in the last JSON-lines log record of step `step` ("" when absent or log
// is NULL), at most cap - 1 characters.
void test_log_value(const char* log, int step, const char* key, char* out, size_t cap);
// Bytes of [p, p + n) in memory now (mincore, whole pages).
double test_resident_bytes(const void* p, size_t n);
// Standard output to /dev/null (the ranks of a multi-rank test print their own logs) until
// test_stdout_restore with what this returned (-1: it stayed as it was).
int test_stdout_mute(void);
void test_stdout_restore(int saved);
// Every layer's fp32 weights of the Store, in layer order, in one malloc'd array (*n_out floats).
float* test_params_copy(const Model* m, const Store* s, int64_t* n_out);
// A LLaMA (fam FAMILY_LLAMA) or Qwen3 (otherwise) model small enough for finite differences, with
// GQA (H=4, KVH=2) and HD != C/H; tied: the head shares the embedding.
ModelConfig test_small_config(ModelFamily fam, int tied);
// The engine suites' small model: test-qwen3 (tied) or test-llama, V 53, C 32, L 5, H 4, KVH 2,
// HD 8, F 48 (several stages, GQA).
ModelConfig test_engine_config(int tied);

#endif  // LLMC_TESTS_TESTING_H
