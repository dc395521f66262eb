/*
 * testing.c — helpers shared by the test suites: skipping, driving ./train_roundpipe end to end,
 * runs compared by their logs (straight versus first part and --resume), the plain reference
 * trainer the engine suites compare with, finite-difference gradient probes,
 * log records and the engine suites' small model. (No suite here: the runner
 * lists suites explicitly.)
 */
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../checkpoint.h"
#include "../common.h"
#include "../loader.h"
#include "../lora.h"
#include "../model.h"
#include "../plain.h"
#include "../store.h"
#include "../threads.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// skipping

void test_skip(TestCtx* t, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->skip_why, sizeof t->skip_why, fmt, ap);
    va_end(ap);
    if (!t->skip_why[0]) str_copy(t->skip_why, sizeof t->skip_why, "no reason given");
}

void test_skip_part(TestCtx* t, const char* fmt, ...) {
    char part[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(part, sizeof part, fmt, ap);
    va_end(ap);
    // already listed: a part is named once per loop iteration that meets it
    const char* p = t->skipped_parts;
    const size_t n = strlen(part);
    while ((p = strstr(p, part)) != NULL) {
        if ((p == t->skipped_parts || p[-1] == ' ') && (p[n] == '\0' || p[n] == ';')) return;
        p += n;
    }
    const size_t used = strlen(t->skipped_parts);
    snprintf(t->skipped_parts + used, sizeof t->skipped_parts - used, "%s%s", used ? "; " : "",
             part);
}

// ----------------------------------------------------------------------------
// the CLI

const char* test_trainer_binary(void) {
    const char* bin = getenv("TRAIN_ROUNDPIPE_BIN");
    return bin && *bin ? bin : "./train_roundpipe";
}

int test_run_cli(TestCtx* t, const char* tag, const char* args) {
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "cd '%s' && %s %s > '%s/%s.out' 2> '%s/%s.err'", t->exe_dir,
             test_trainer_binary(), args, t->tmpdir, tag, t->tmpdir, tag);
    int st = system(cmd);
    if (st == -1 || !WIFEXITED(st)) return -1;
    return WEXITSTATUS(st);
}

char* test_read_file(const char* path, size_t* len) {
    char err[ERR_LEN];
    size_t n = 0;
    char* s = file_read_all(path, 64u << 20, &n, err);
    if (len) *len = s ? n : 0;
    return s ? s : calloc_check(1, 1);
}

char* test_read_output(TestCtx* t, const char* tag, const char* ext) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s.%s", t->tmpdir, tag, ext);
    return test_read_file(path, NULL);
}

// ----------------------------------------------------------------------------
// CLI runs compared by their logs

int test_same_steps(TestCtx* t, const char* what, const char* log_a, const char* log_b, int from,
                    int to) {
    char* a = test_read_file(log_a, NULL);
    char* b = test_read_file(log_b, NULL);
    int same = 1;
    for (int s = from; s <= to; s++) {
        char x[512], y[512];
        const int hx = test_log_record(a, s, x, sizeof x);
        const int hy = test_log_record(b, s, y, sizeof y);
        const int ok = hx && hy && strcmp(x, y) == 0;
        CHECK(t, ok, "%s step %d: '%s' vs '%s'", what, s, hx ? x : "-", hy ? y : "-");
        same &= ok;
    }
    free(a);
    free(b);
    return same;
}

int test_resume_runs(TestCtx* t, TestResumeRuns* r, const char* tag, const char* args,
                     int steps, int split, int first_steps) {
    snprintf(r->straight_out, sizeof r->straight_out, "%s/%s_straight", t->tmpdir, tag);
    snprintf(r->resumed_out, sizeof r->resumed_out, "%s/%s_resumed", t->tmpdir, tag);
    snprintf(r->straight_log, sizeof r->straight_log, "%s/%s_a.jsonl", t->tmpdir, tag);
    snprintf(r->first_log, sizeof r->first_log, "%s/%s_b1.jsonl", t->tmpdir, tag);
    snprintf(r->resumed_log, sizeof r->resumed_log, "%s/%s_b2.jsonl", t->tmpdir, tag);
    char run_tag[160];
    snprintf(r->resumed_tag, sizeof r->resumed_tag, "%s_second", tag);
    // (the flags in this order: the same command lines as the suites wrote them out by hand)
    const size_t cap = strlen(args) + 3 * sizeof r->straight_out + 256;
    char* cmd = malloc_check(cap);
    int ok = 1;

    snprintf(cmd, cap, "%s --steps %d --save-every %d --out '%s' --log '%s'", args, steps, steps,
             r->straight_out, r->straight_log);
    snprintf(run_tag, sizeof run_tag, "%s_straight", tag);
    int rc = test_run_cli(t, run_tag, cmd);
    CHECK(t, rc == 0, "%s: straight run", tag);
    ok &= rc == 0;

    snprintf(cmd, cap, "%s --steps %d --save-every %d --out '%s' --log '%s'", args, first_steps,
             split, r->resumed_out, r->first_log);
    snprintf(run_tag, sizeof run_tag, "%s_first", tag);
    rc = test_run_cli(t, run_tag, cmd);
    CHECK(t, rc == 0, "%s: first part", tag);
    ok &= rc == 0;
    // a first part that ran past the split: every save after it loses its DONE, as if the run
    // had crashed before completing them (the resumed run must ignore them)
    for (int s = split + 1; s <= first_steps; s++) {
        if (s % split != 0 && s != first_steps) continue;
        char done[1200];
        snprintf(done, sizeof done, "%s/step_%d/DONE", r->resumed_out, s);
        const int gone = unlink(done) == 0;
        CHECK(t, gone, "%s: remove %s", tag, done);
        ok &= gone;
    }

    snprintf(cmd, cap, "%s --steps %d --save-every %d --out '%s' --log '%s' --resume", args,
             steps, split, r->resumed_out, r->resumed_log);
    rc = test_run_cli(t, r->resumed_tag, cmd);
    CHECK(t, rc == 0, "%s: resumed part", tag);
    ok &= rc == 0;
    free(cmd);

    ok &= test_same_steps(t, tag, r->straight_log, r->first_log, 1, split);
    ok &= test_same_steps(t, tag, r->straight_log, r->resumed_log, split + 1, steps);
    return ok;
}

// ----------------------------------------------------------------------------
// the reference trainer

void test_reference_train(const RefTrain* r, const int32_t* tokens, double* loss, float** params,
                          int64_t* n_params) {
    char err[ERR_LEN];
    Model m;
    if (model_init_lora(&m, r->c, 0, r->lora, err) != 0) fatal("test_reference_train: %s", err);
    m.mlp_chunk = r->mlp_chunk;
    Store s, w_own;
    store_create(&s, &m.tt);
    store_init_random(&s, r->init_seed, r->init_scale);
    if (r->lora) lora_init_random(&m, &s, r->init_seed);
    Store* w = &s;
    if (r->delayed) {
        store_create(&w_own, &m.tt);
        store_init_random(&w_own, r->init_seed, r->init_scale);
        if (r->lora) lora_init_random(&m, &w_own, r->init_seed);
        w = &w_own;
    }
    const int Bm = r->B / r->M;
    Plain* p = plain_create(&m, w, r->ops, r->ctx, Bm, r->T, 0);
    AdamWTensor* opt = malloc_check((size_t)m.tt.n * sizeof(AdamWTensor));
    const int n = store_adamw_tensors(&s, opt);
    ThreadPool* pool = threadpool_create(2);
    float** total = calloc_check((size_t)m.tt.n_layers, sizeof(float*));  // split rounds' sum
    for (int l = 0; r->rounds > 1 && l < m.tt.n_layers; l++)
        total[l] = malloc_check((size_t)(m.tt.grad_numel[l] > 0 ? m.tt.grad_numel[l] : 1) *
                                sizeof(float));
    for (int step = 0; step < r->steps; step++) {
        const int32_t* batch = tokens + (size_t)step * r->B * (r->T + 1);
        plain_sync_params(p);  // no-op when the backend works on the store itself
        const int R = r->rounds > 1 ? r->rounds : 1, M_R = r->M / R;
        double sum = 0;
        for (int round = 0; round < R; round++) {
            store_zero_grads(w);
            for (int mb = round * M_R; mb < (round + 1) * M_R; mb++) {
                p->ws->lora_seed = lora_dropout_seed(r->init_seed, step, mb);
                sum += plain_forward_backward(p, batch + (size_t)mb * Bm * (r->T + 1), Bm, r->T,
                                              1.0f / ((float)r->B * (float)r->T));
            }
            plain_sync_grads(p);
            store_fold_tied_grads(w);
            for (int l = 0; R > 1 && l < m.tt.n_layers; l++) {
                if (m.tt.grad_numel[l] == 0) continue;  // (LoRA: a frozen prefix or postfix)
                if (round == 0) {
                    memcpy(total[l], w->grad[l], (size_t)m.tt.grad_numel[l] * sizeof(float));
                } else {
                    for (int64_t i = 0; i < m.tt.grad_numel[l]; i++) total[l][i] += w->grad[l][i];
                }
            }
        }
        for (int l = 0; R > 1 && l < m.tt.n_layers; l++)
            if (m.tt.grad_numel[l] > 0)
                memcpy(w->grad[l], total[l], (size_t)m.tt.grad_numel[l] * sizeof(float));
        loss[step] = sum / ((double)r->B * r->T);
        if (r->delayed) {
            for (int l = 0; l < m.tt.n_layers; l++) {
                if (m.tt.grad_numel[l] > 0)
                    memcpy(s.grad[l], w->grad[l], (size_t)m.tt.grad_numel[l] * sizeof(float));
                // the next iteration computes with θ_step (the weights before this step)
                memcpy(w->param[l], s.param[l], (size_t)m.tt.param_numel[l] * sizeof(float));
            }
        }
        adamw_update(pool, opt, n, &r->hyper, &r->sched, 1.0f, step + 1);
    }
    if (params) {
        int64_t total = 0;
        for (int l = 0; l < m.tt.n_layers; l++) total += m.tt.param_numel[l];
        *params = malloc_check((size_t)total * sizeof(float));
        *n_params = total;
        int64_t o = 0;
        for (int l = 0; l < m.tt.n_layers; l++) {
            memcpy(*params + o, s.param[l], (size_t)m.tt.param_numel[l] * sizeof(float));
            o += m.tt.param_numel[l];
        }
    }
    for (int l = 0; l < m.tt.n_layers; l++) free(total[l]);
    free(total);
    free(opt);
    threadpool_destroy(pool);
    plain_free(p);
    store_free(&s);
    if (r->delayed) store_free(&w_own);
    model_free(&m);
}

// ----------------------------------------------------------------------------
// HF parity fixtures

double test_check_fixture_grads(TestCtx* t, const char* what, const Model* m, const Store* s,
                                const StFile* ex, double tol, int* n_grads,
                                const char** worst_name) {
    char err[ERR_LEN];
    double worst = 0.0;
    *n_grads = 0;
    if (worst_name) *worst_name = "";
    // the checkpoint's tensors (the HF view: one per owned tensor, or an expert's slice in the
    // hub's per-expert Qwen3-MoE layout)
    for (int j = 0; j < m->tt.n_hf; j++) {
        const HfTensor* v = &m->tt.hf[j];
        char gname[160];
        snprintf(gname, sizeof gname, "grad.%s", v->name);
        const StTensor* g = st_find(ex, gname);
        CHECK(t, g != NULL && g->numel == v->numel, "%s: %s missing or misshapen", what, gname);
        if (!g || g->numel != v->numel) continue;
        float* ref = malloc_check((size_t)v->numel * sizeof(float));
        st_tensor_to_f32(g, ref, v->numel, err);
        double e = rel_l2_error(store_grad(s, v->index) + v->offset, ref, (size_t)v->numel);
        CHECK(t, e <= tol, "%s %s: gradient relative L2 error %.3g vs HF (tol %.3g)", what,
              v->name, e, tol);
        if (e > worst) {
            worst = e;
            if (worst_name) *worst_name = v->name;
        }
        free(ref);
        (*n_grads)++;
    }
    // every gradient of the fixture was compared
    int n_expected = 0;
    for (int k = 0; k < ex->n_tensors; k++) n_expected += strncmp(ex->tensors[k].name, "grad.", 5) == 0;
    CHECK(t, *n_grads == n_expected, "%s: compared %d of %d fixture gradients", what, *n_grads,
          n_expected);
    return worst;
}

int test_parity_open(TestCtx* t, const char* name, ParityFixture* f) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/dev/parity/fixtures/%s", t->exe_dir, name);
    return test_parity_open_dir(t, dir, f);
}

int test_parity_open_dir(TestCtx* t, const char* dir, ParityFixture* f) {
    char path[4300], err[ERR_LEN];
    memset(f, 0, sizeof *f);
    ModelSource src;
    if (checkpoint_resolve_model(&src, dir, err) != 0) {
        CHECK(t, 0, "%s", err);
        return -1;
    }
    if (model_init(&f->m, &src.cfg, 0, err) != 0) {
        CHECK(t, 0, "%s", err);
        checkpoint_close_source(&src);
        return -1;
    }
    store_create(&f->s, &f->m.tt);
    int unused = -1;
    CHECK(t, loader_load_safetensors(&f->s, &src.ck, &unused, err) == 0 && unused == 0, "load: %s", err);
    checkpoint_close_source(&src);
    snprintf(path, sizeof path, "%s/expected.safetensors", dir);
    if (st_open(&f->ex, path, err) != 0) {
        CHECK(t, 0, "%s", err);
        store_free(&f->s);
        model_free(&f->m);
        return -1;
    }
    const StTensor* tok = st_find(&f->ex, "tokens");
    if (!(tok && tok->dtype == ST_I32 && tok->ndim == 2 && tok->shape[1] >= 2)) {
        CHECK(t, 0, "%s: no (B, T + 1) int32 tokens tensor", path);
        test_parity_close(f);
        return -1;
    }
    f->B = (int)tok->shape[0];
    f->T = (int)tok->shape[1] - 1;
    f->tokens = malloc_check((size_t)f->B * (f->T + 1) * sizeof(int32_t));
    memcpy(f->tokens, tok->data, (size_t)f->B * (f->T + 1) * sizeof(int32_t));
    f->ref_loss = NAN;
    const StTensor* loss = st_find(&f->ex, "loss");
    if (loss) st_tensor_to_f32(loss, &f->ref_loss, 1, err);
    return 0;
}

void test_parity_close(ParityFixture* f) {
    free(f->tokens);
    st_close(&f->ex);
    store_free(&f->s);
    model_free(&f->m);
    memset(f, 0, sizeof *f);
}

// ----------------------------------------------------------------------------
// buffers and comparisons for the op and model tests

float* rand_floats(Rng* r, size_t n, float scale) {
    float* x = malloc_check((n > 0 ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(r);
    return x;
}


float* filled_floats(size_t n, float v) {
    float* x = malloc_check((n > 0 ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = v;
    return x;
}


double* to_doubles(const float* x, size_t n) {
    double* d = malloc_check((n > 0 ? n : 1) * sizeof(double));
    for (size_t i = 0; i < n; i++) d[i] = x ? (double)x[i] : 0.0;
    return d;
}


double dot_d(const double* a, const double* b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}


void check_close(TestCtx* t, const char* what, const float* got, const double* want,
                        size_t n, double tol) {
    double num = 0.0, den = 0.0, worst = 0.0, amax = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - want[i];
        num += d * d;
        den += want[i] * want[i];
        if (!(fabs(d) <= worst)) worst = fabs(d);  // NaN propagates
        if (fabs(want[i]) > amax) amax = fabs(want[i]);
    }
    double rel = sqrt(num) / (den > 0 ? sqrt(den) : 1e-30);
    double rel_worst = worst / (amax > 0 ? amax : 1e-30);
    CHECK(t, rel <= tol && rel_worst <= 4 * tol,
          "%s: relative L2 error %.3g, worst %.3g (tol %.3g)", what, rel, rel_worst, tol);
}


// ----------------------------------------------------------------------------
// finite-difference gradient checks

double test_gradient_norm(const float* g, int64_t n) {
    double gnorm = 0;
    for (int64_t j = 0; j < n; j++) gnorm += (double)g[j] * g[j];
    return sqrt(gnorm);
}

double* test_probe_direction(Rng* r, const float* g, int64_t n, double gnorm, double* analytic) {
    double* dir = malloc_check((size_t)n * sizeof(double));
    double dn = 0, a = 0;
    for (int64_t j = 0; j < n; j++) {
        dir[j] = g[j] / gnorm + 0.5 * rng_normal(r) / sqrt((double)n);
        dn += dir[j] * dir[j];
    }
    for (int64_t j = 0; j < n; j++) {
        dir[j] /= sqrt(dn);
        a += dir[j] * g[j];
    }
    *analytic = a;
    return dir;
}

double test_central_difference(float* p, const double* dir, int64_t n, double eps,
                               double (*loss)(void* ctx), void* ctx) {
    float* saved = malloc_check((size_t)n * sizeof(float));
    memcpy(saved, p, (size_t)n * sizeof(float));
    for (int64_t j = 0; j < n; j++) p[j] = (float)(saved[j] + eps * dir[j]);
    double lp = loss(ctx);
    for (int64_t j = 0; j < n; j++) p[j] = (float)(saved[j] - eps * dir[j]);
    double lm = loss(ctx);
    memcpy(p, saved, (size_t)n * sizeof(float));
    free(saved);
    return (lp - lm) / (2 * eps);
}

// ----------------------------------------------------------------------------
// log records and the engine suites' model

int test_log_record(const char* log, int step, char* out, size_t cap) {
    char key[48];
    snprintf(key, sizeof key, "{\"step\":%d,\"loss\":", step);
    const char* p = strstr(log, key);
    if (!p) return 0;
    const char* end = strstr(p, ",\"ms\":");
    if (!end || (size_t)(end - p) >= cap) return 0;
    memcpy(out, p, (size_t)(end - p));
    out[end - p] = '\0';
    return 1;
}

void test_log_value(const char* log, int step, const char* key, char* out, size_t cap) {
    char want[64];
    snprintf(want, sizeof want, "{\"step\":%d,\"loss\"", step);
    out[0] = '\0';
    const char* rec = NULL;
    for (const char* s = log; s && (s = strstr(s, want)) != NULL; s++) rec = s;  // the last one
    if (!rec) return;
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char* v = strstr(rec, k);
    const char* end = strchr(rec, '\n');
    if (!v || (end && v > end)) return;
    v += strlen(k);
    size_t n = strcspn(v, ",}");
    if (n >= cap) n = cap - 1;
    memcpy(out, v, n);
    out[n] = '\0';
}

float* test_params_copy(const Model* m, const Store* s, int64_t* n_out) {
    int64_t n = 0;
    for (int l = 0; l < m->tt.n_layers; l++) n += m->tt.param_numel[l];
    float* out = malloc_check((size_t)(n > 0 ? n : 1) * sizeof(float));
    int64_t o = 0;
    for (int l = 0; l < m->tt.n_layers; l++) {
        memcpy(out + o, s->param[l], (size_t)m->tt.param_numel[l] * sizeof(float));
        o += m->tt.param_numel[l];
    }
    *n_out = n;
    return out;
}

int test_stdout_mute(void) {
    fflush(stdout);
    const int saved = dup(1), devnull = open("/dev/null", O_WRONLY);
    if (saved >= 0 && devnull >= 0) dup2(devnull, 1);
    if (devnull >= 0) close(devnull);
    return saved;
}

void test_stdout_restore(int saved) {
    fflush(stdout);
    if (saved < 0) return;
    dup2(saved, 1);
    close(saved);
}

double test_resident_bytes(const void* p, size_t n) {
    const long page = sysconf(_SC_PAGESIZE);
    const uintptr_t pg = page > 0 ? (uintptr_t)page : 4096u;
    const uintptr_t b = (uintptr_t)p / pg * pg, e = ((uintptr_t)p + n + pg - 1) / pg * pg;
    const size_t n_pages = (e - b) / pg;
    unsigned char* in = malloc_check(n_pages > 0 ? n_pages : 1);
    if (mincore((void*)b, e - b, in) != 0) fatal("mincore failed");
    size_t count = 0;
    for (size_t i = 0; i < n_pages; i++) count += in[i] & 1;
    free(in);
    return (double)count * (double)pg;
}

ModelConfig test_small_config(ModelFamily fam, int tied) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, fam == FAMILY_LLAMA ? "test-llama" : "test-qwen3", err);
    c.V = 37;
    c.C = 24;
    c.L = 2;
    c.H = 4;
    c.KVH = 2;
    c.HD = 8;
    c.F = 40;
    c.tied_embeddings = tied;
    return c;
}

ModelConfig test_engine_config(int tied) {
    char err[ERR_LEN];
    ModelConfig c;
    config_from_preset(&c, tied ? "test-qwen3" : "test-llama", err);
    c.V = 53;
    c.C = 32;
    c.L = 5;
    c.H = 4;
    c.KVH = 2;
    c.HD = 8;
    c.F = 48;
    return c;
}

int test_one_error_line(const char* err, const char* must) {
    size_t n = strlen(err);
    return n > 0 && strchr(err, '\n') == err + n - 1 && strstr(err, "error") && strstr(err, must);
}
