/*
 * test_comm.c — the collectives (llmc/comm.h: comm.c, comm_emul.c) and the launch layer
 * (llmc/dist.c; suite `comm`).
 *
 * Collectives: the emulated ranks (threads of this process) against a serial reference written
 * out here in the documented sum order (rank 0 + rank 1 + ... in fp32; bf16 widened, summed in
 * fp32, rounded once), bit for bit, for 1-4 ranks, sizes that do not divide by the world size,
 * fp32 and bf16, in-place forms, groups, host buffers and CPU-emulated device streams with
 * injected delays; twice, to show run-to-run identity. Failures: a rank that hangs (the others
 * give up after the timeout naming it), a rank that dies (the others fail at once naming it),
 * mismatched ops, abort and poll, a missing rank at init, a stream whose peer never comes.
 * Launch: flags and torchrun/Slurm environments (and every error), the TCP rendezvous over
 * localhost (threads as ranks) with a missing peer, a wrong world size, a rank twice, no rank 0;
 * and the trainer's flags: the engine's refusal of a world size over 1, the plain path's checks.
 *
 * Results are gathered per rank and checked on the test's thread (CHECK is not thread-safe);
 * data written by rank threads is read after pthread_join, so `make tsan` checks the emulation's
 * barriers for the happens-before the collectives need.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../comm.h"
#include "../common.h"
#include "../device.h"
#include "../dist.h"
#include "../rng.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers: ranks as threads

#define MAX_W 4

typedef struct RankRun {
    CommEmulWorld* w;
    int rank, world;
    double timeout_s;
    void (*body)(struct RankRun* r);
    void* arg;       // the test's shared state
    Comm* c;
    int init_rc;
    int rc[8];       // results of the body's steps
    double secs[8];  // how long each step took
    char err[ERR_LEN];
} RankRun;

static void* rank_main(void* arg) {
    RankRun* r = arg;
    CommInit in = {.rank = r->rank, .world = r->world, .timeout_s = r->timeout_s, .local = r->w};
    r->c = comm_emul_impl.init(&in, r->err);
    r->init_rc = r->c ? 0 : -1;
    if (r->c) {
        r->body(r);
        char buf[ERR_LEN];
        if (comm_error(r->c, buf, sizeof buf)) str_copy(r->err, sizeof r->err, buf);
    }
    return NULL;
}

// Run body on W rank threads of a fresh world; runs[] gets the results (comms destroyed).
static void run_ranks(int W, double timeout_s, void (*body)(RankRun*), void* arg, RankRun* runs) {
    CommEmulWorld* w = comm_emul_world_create(W);
    pthread_t th[MAX_W];
    for (int r = 0; r < W; r++) {
        runs[r] = (RankRun){.w = w, .rank = r, .world = W, .timeout_s = timeout_s, .body = body,
                            .arg = arg};
        pthread_check(pthread_create(&th[r], NULL, rank_main, &runs[r]));
    }
    for (int r = 0; r < W; r++) pthread_check(pthread_join(th[r], NULL));
    for (int r = 0; r < W; r++) comm_destroy(runs[r].c);
    comm_emul_world_destroy(w);
}

static uint16_t* to_bf16(const float* x, size_t n) {
    uint16_t* b = malloc_check((n ? n : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) b[i] = f32_to_bf16(x[i]);
    return b;
}

// ----------------------------------------------------------------------------
// layout

static void test_comm_shard_layout(TestCtx* t) {
    const size_t sizes[] = {0, 1, 5, 7, 10, 4099};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (int W = 1; W <= MAX_W; W++) {
            const size_t n = sizes[si], b = comm_shard_block(n, W);
            size_t next = 0;
            int ok = b * (size_t)W >= n && (b == 0 || (b - 1) * (size_t)W < n);  // ceil
            for (int r = 0; r < W; r++) {
                size_t off, len;
                comm_shard_range(n, W, r, &off, &len);
                ok &= off == next && len <= b && off + len <= n;
                next = off + len;
            }
            CHECK(t, ok && next == n, "n %zu W %d: shards tile [0, n) in blocks of %zu", n, W, b);
        }
    CHECK(t, comm_shard_block(10, 4) == 3 && comm_dtype_size(COMM_BF16) == 2 &&
             comm_dtype_size(COMM_F32) == 4, "block and dtype sizes");
}

// ----------------------------------------------------------------------------
// collectives against the serial reference

// Every rank's inputs, generated up front from one seed; outputs per rank.
typedef struct CollData {
    int W;
    size_t n;          // all_reduce / broadcast size
    size_t blk;        // reduce_scatter / all_gather block (n padded to W * blk)
    CommDtype dt;
    int on_stream;     // 0: host path; 1: enqueued on CPU-emulated device streams
    DeviceSet* devs;
    void* in[MAX_W];   // n elements (all_reduce, broadcast)
    void* rs_in[MAX_W];  // W * blk elements, zero past n (reduce_scatter)
    void* ag_in[MAX_W];  // blk elements (all_gather)
    void* out_ar[MAX_W], *out_ar_inplace[MAX_W], *out_rs[MAX_W], *out_rs_inplace[MAX_W];
    void* out_ag[MAX_W], *out_ag_inplace[MAX_W], *out_bc[MAX_W];
} CollData;

static void* dup_bytes(const void* p, size_t bytes) {
    void* q = malloc_check(bytes ? bytes : 1);
    memcpy(q, p, bytes);
    return q;
}

static void coll_body(RankRun* rr) {
    CollData* d = rr->arg;
    const int r = rr->rank, W = d->W;
    const size_t es = comm_dtype_size(d->dt);
    CommStream cs = {0}, *st = NULL;
    if (d->on_stream) {
        cs = (CommStream){.impl = d->devs->impl, .dev = d->devs->dev[r], .stream = STREAM_GRAD_DOWN};
        st = &cs;
    }
    d->out_ar[r] = calloc_check(d->n + 1, es);
    d->out_ar_inplace[r] = dup_bytes(d->in[r], d->n * es);
    d->out_rs[r] = calloc_check(d->blk + 1, es);
    d->out_rs_inplace[r] = dup_bytes(d->rs_in[r], (size_t)W * d->blk * es);
    d->out_ag[r] = calloc_check((size_t)W * d->blk + 1, es);
    d->out_ag_inplace[r] = calloc_check((size_t)W * d->blk + 1, es);
    memcpy((char*)d->out_ag_inplace[r] + (size_t)r * d->blk * es, d->ag_in[r], d->blk * es);
    d->out_bc[r] = r == W - 1 ? dup_bytes(d->in[r], d->n * es) : calloc_check(d->n + 1, es);
    int k = 0;
    rr->rc[k++] = comm_all_reduce(rr->c, d->in[r], d->out_ar[r], d->n, d->dt, st);
    rr->rc[k++] = comm_all_reduce(rr->c, d->out_ar_inplace[r], d->out_ar_inplace[r], d->n, d->dt,
                                  st);
    // a group: reduce_scatter (out of place and in place) and all_gather as one op
    CommOp g[2] = {
        {.kind = COMM_REDUCE_SCATTER, .dtype = d->dt, .send = d->rs_in[r], .recv = d->out_rs[r],
         .count = d->blk},
        {.kind = COMM_REDUCE_SCATTER, .dtype = d->dt, .send = d->out_rs_inplace[r],
         .recv = (char*)d->out_rs_inplace[r] + (size_t)r * d->blk * es, .count = d->blk},
    };
    rr->rc[k++] = comm_run(rr->c, g, 2, st);
    rr->rc[k++] = comm_all_gather(rr->c, d->ag_in[r], d->out_ag[r], d->blk, d->dt, st);
    rr->rc[k++] = comm_all_gather(rr->c,
                                  (char*)d->out_ag_inplace[r] + (size_t)r * d->blk * es,
                                  d->out_ag_inplace[r], d->blk, d->dt, st);
    // broadcast from the last rank; the others pass no send buffer
    rr->rc[k++] = comm_broadcast(rr->c, r == W - 1 ? d->out_bc[r] : NULL, d->out_bc[r], d->n,
                                 d->dt, W - 1, st);
    rr->rc[k++] = comm_sync(rr->c, st);
    rr->rc[k++] = comm_barrier(rr->c);
}

// The sum written out (not comm_reference_sum): element i of rank 0, + rank 1, ... in fp32.
static void serial_sum(const CollData* d, void* const* in, size_t off, size_t n, void* out) {
    for (size_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int q = 0; q < d->W; q++) {
            const float x = d->dt == COMM_F32 ? ((const float*)in[q])[off + i]
                                              : bf16_to_f32(((const uint16_t*)in[q])[off + i]);
            acc = q == 0 ? x : acc + x;
        }
        if (d->dt == COMM_F32) ((float*)out)[i] = acc;
        else ((uint16_t*)out)[i] = f32_to_bf16(acc);
    }
}

// One configuration: 0 when every output matched the reference bit for bit. Outputs are kept
// (concatenated into *digest_out, malloc'd) for the run-to-run comparison.
static int coll_case(TestCtx* t, int W, size_t n, CommDtype dt, int on_stream, uint32_t seed,
                     int delay_us, char** digest_out, size_t* digest_len) {
    CollData d = {.W = W, .n = n, .blk = comm_shard_block(n, W), .dt = dt, .on_stream = on_stream};
    const size_t es = comm_dtype_size(dt);
    Rng rng;
    rng_seed(&rng, seed);
    for (int r = 0; r < W; r++) {
        float* x = rand_floats(&rng, n, 1.0f);
        float* rs = calloc_check((size_t)W * d.blk + 1, sizeof(float));
        for (size_t i = 0; i < n; i++) rs[i] = x[(i * 7 + 3) % n] * (float)(r + 1);
        float* ag = rand_floats(&rng, d.blk, 2.0f);
        if (dt == COMM_F32) {
            d.in[r] = x;
            d.rs_in[r] = rs;
            d.ag_in[r] = ag;
        } else {
            d.in[r] = to_bf16(x, n);
            d.rs_in[r] = to_bf16(rs, (size_t)W * d.blk);
            d.ag_in[r] = to_bf16(ag, d.blk);
            free(x);
            free(rs);
            free(ag);
        }
    }
    DeviceSet set = {0};
    if (on_stream) {
        DeviceOptions opt = {.threads = 1, .delay_seed = seed, .max_delay_us = delay_us};
        device_set_open(&set, &device_cpu_impl, W, &opt);
        d.devs = &set;
    }
    RankRun runs[MAX_W];
    run_ranks(W, 10.0, coll_body, &d, runs);
    if (on_stream) device_set_close(&set);

    int bad = 0;
    char what[160];
    snprintf(what, sizeof what, "W %d n %zu %s %s", W, n, dt == COMM_F32 ? "f32" : "bf16",
             on_stream ? "stream" : "host");
    for (int r = 0; r < W; r++) {
        bad += runs[r].init_rc != 0;
        for (int k = 0; k < 8; k++) bad += runs[r].rc[k] != 0;
        if (runs[r].err[0]) fprintf(stderr, "  %s: rank %d: %s\n", what, r, runs[r].err);
    }
    CHECK(t, bad == 0, "%s: every op succeeded", what);
    // references
    void* ref_ar = calloc_check(n + 1, es);
    serial_sum(&d, d.in, 0, n, ref_ar);
    size_t dig = 0;
    char* digest = malloc_check((size_t)W * (4 * n + 6 * (size_t)W * d.blk + 8) * es + 64);
    int mism = 0;
    for (int r = 0; r < W; r++) {
        void* ref_rs = calloc_check(d.blk + 1, es);
        serial_sum(&d, d.rs_in, (size_t)r * d.blk, d.blk, ref_rs);
        mism += memcmp(d.out_ar[r], ref_ar, n * es) != 0;
        mism += memcmp(d.out_ar_inplace[r], ref_ar, n * es) != 0;
        mism += memcmp(d.out_rs[r], ref_rs, d.blk * es) != 0;
        mism += memcmp((char*)d.out_rs_inplace[r] + (size_t)r * d.blk * es, ref_rs,
                       d.blk * es) != 0;
        for (int q = 0; q < W; q++) {
            mism += memcmp((char*)d.out_ag[r] + (size_t)q * d.blk * es, d.ag_in[q],
                           d.blk * es) != 0;
            mism += memcmp((char*)d.out_ag_inplace[r] + (size_t)q * d.blk * es, d.ag_in[q],
                           d.blk * es) != 0;
        }
        mism += memcmp(d.out_bc[r], d.in[W - 1], n * es) != 0;
        // the padding of the reduce-scatter input sums to zero on the last rank's block
        memcpy(digest + dig, d.out_ar[r], n * es), dig += n * es;
        memcpy(digest + dig, d.out_rs[r], d.blk * es), dig += d.blk * es;
        memcpy(digest + dig, d.out_ag[r], (size_t)W * d.blk * es), dig += (size_t)W * d.blk * es;
        free(ref_rs);
    }
    CHECK(t, mism == 0, "%s: %d output(s) differ from the serial reference", what, mism);
    if (W > 1 && n > 0) {
        size_t off, len;
        comm_shard_range(n, W, W - 1, &off, &len);
        int pad_ok = 1;
        for (size_t i = len; i < d.blk; i++) {
            const float v = dt == COMM_F32 ? ((float*)d.out_rs[W - 1])[i]
                                           : bf16_to_f32(((uint16_t*)d.out_rs[W - 1])[i]);
            pad_ok &= v == 0.0f;
        }
        CHECK(t, pad_ok, "%s: the padding past n reduces to zeros", what);
    }
    free(ref_ar);
    for (int r = 0; r < W; r++) {
        free(d.in[r]), free(d.rs_in[r]), free(d.ag_in[r]);
        free(d.out_ar[r]), free(d.out_ar_inplace[r]), free(d.out_rs[r]);
        free(d.out_rs_inplace[r]), free(d.out_ag[r]), free(d.out_ag_inplace[r]), free(d.out_bc[r]);
    }
    *digest_out = digest;
    *digest_len = dig;
    return bad + mism;
}

static void coll_sweep(TestCtx* t, int on_stream) {
    const size_t sizes[] = {1, 7, 1001};
    for (int W = 1; W <= MAX_W; W++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
            for (int dt = 0; dt < 2; dt++) {
                char *d1 = NULL, *d2 = NULL;
                size_t l1 = 0, l2 = 0;
                const uint32_t seed = 100u * (uint32_t)W + (uint32_t)si * 10u + (uint32_t)dt;
                coll_case(t, W, sizes[si], (CommDtype)dt, on_stream, seed, on_stream ? 30 : 0,
                          &d1, &l1);
                if (sizes[si] == 1001) {  // again, other timing: the same bits
                    coll_case(t, W, sizes[si], (CommDtype)dt, on_stream, seed,
                              on_stream ? 200 : 0, &d2, &l2);
                    CHECK(t, l1 == l2 && memcmp(d1, d2, l1) == 0,
                          "W %d n %zu dt %d: bit-identical run to run", W, sizes[si], dt);
                }
                free(d1);
                free(d2);
            }
}

static void test_comm_emul_host(TestCtx* t) { coll_sweep(t, 0); }
static void test_comm_emul_stream(TestCtx* t) { coll_sweep(t, 1); }

// bf16: fp32 accumulation with one rounding (not a bf16 rounding per addition).
static void test_comm_bf16_accumulation(TestCtx* t) {
    // 1 + 2^-9 + 2^-9 + 2^-9: bf16's step at 1.0 is 2^-7, so rounding after every addition
    // swallows each 2^-9 (1 + 2^-9 rounds back to 1), while one final rounding keeps their sum
    const uint16_t one = f32_to_bf16(1.0f), tiny = f32_to_bf16(1.0f / 512.0f);
    uint16_t a[4] = {one, tiny, tiny, tiny}, out;
    const void* in[4] = {&a[0], &a[1], &a[2], &a[3]};
    comm_reference_sum(in, 4, 1, COMM_BF16, &out);
    CHECK(t, bf16_to_f32(out) == 1.0078125f, "fp32 accumulation: 1 + 3 * 2^-9 rounds to "
          "1 + 2^-7 once, got %.9g", (double)bf16_to_f32(out));
    float per_add = 1.0f;
    for (int i = 0; i < 3; i++) per_add = bf16_to_f32(f32_to_bf16(per_add + 1.0f / 512.0f));
    CHECK(t, per_add == 1.0f && bf16_to_f32(out) > 1.0f,
          "rounding per addition would give %.9g, one rounding %.9g", (double)per_add,
          (double)bf16_to_f32(out));
}

// ----------------------------------------------------------------------------
// failures

typedef struct FaultArg {
    int victim;
    CommFault fault;
    uint64_t at_op;
} FaultArg;

static void fault_body(RankRun* rr) {
    FaultArg* f = rr->arg;
    if (rr->rank == f->victim) comm_emul_inject(rr->c, f->fault, f->at_op);
    float x[5] = {1, 2, 3, 4, (float)rr->rank}, y[5];
    for (int k = 0; k < 3; k++) {
        const double t0 = time_now_s();
        rr->rc[k] = comm_all_reduce(rr->c, x, y, 5, COMM_F32, NULL);
        rr->secs[k] = time_now_s() - t0;
    }
}

static void test_comm_emul_hang(TestCtx* t) {
    FaultArg f = {.victim = 2, .fault = COMM_FAULT_HANG, .at_op = 1};
    RankRun runs[3];
    const double timeout = 0.3;
    run_ranks(3, timeout, fault_body, &f, runs);
    for (int r = 0; r < 3; r++) {
        CHECK(t, runs[r].rc[0] == 0, "rank %d: op 0 before the fault succeeds", r);
        CHECK(t, runs[r].rc[1] != 0 && runs[r].rc[2] != 0, "rank %d: ops 1, 2 fail", r);
        CHECK(t, strstr(runs[r].err, "rank 2") != NULL, "rank %d names rank 2: %s", r,
              runs[r].err);
        CHECK(t, runs[r].secs[2] < 0.05, "rank %d: later ops fail at once (%.3f s)", r,
              runs[r].secs[2]);
    }
    for (int r = 0; r < 2; r++) {
        CHECK(t, strstr(runs[r].err, "did not arrive") && strstr(runs[r].err, "timed out"),
              "rank %d says it timed out waiting: %s", r, runs[r].err);
        CHECK(t, runs[r].secs[1] >= timeout * 0.9 && runs[r].secs[1] < timeout + 1.5,
              "rank %d gave up after the timeout (%.3f s)", r, runs[r].secs[1]);
    }
}

static void test_comm_emul_die(TestCtx* t) {
    FaultArg f = {.victim = 1, .fault = COMM_FAULT_DIE, .at_op = 2};
    RankRun runs[4];
    run_ranks(4, 5.0, fault_body, &f, runs);
    for (int r = 0; r < 4; r++) {
        CHECK(t, runs[r].rc[0] == 0 && runs[r].rc[1] == 0, "rank %d: ops 0, 1 succeed", r);
        CHECK(t, runs[r].rc[2] != 0, "rank %d: op 2 fails", r);
        CHECK(t, strstr(runs[r].err, "rank 1 died") != NULL, "rank %d names the dead rank: %s",
              r, runs[r].err);
        CHECK(t, runs[r].secs[2] < 1.0, "rank %d failed at once, not after the 5 s timeout "
              "(%.3f s)", r, runs[r].secs[2]);
    }
}

static void mismatch_body(RankRun* rr) {
    float x[12] = {0}, y[12];
    rr->rc[0] = comm_all_reduce(rr->c, x, y, rr->rank == 1 ? 11 : 10, COMM_F32, NULL);
    rr->rc[1] = comm_poll(rr->c);
}

static void test_comm_emul_mismatch(TestCtx* t) {
    RankRun runs[2];
    run_ranks(2, 5.0, mismatch_body, NULL, runs);
    for (int r = 0; r < 2; r++) {
        CHECK(t, runs[r].rc[0] != 0 && runs[r].rc[1] != 0, "rank %d: the mismatch fails", r);
        CHECK(t, strstr(runs[r].err, "of 11 f32") && strstr(runs[r].err, "of 10 f32"),
              "rank %d names both ops: %s", r, runs[r].err);
    }
}

static void abort_body(RankRun* rr) {
    float x = 1.0f, y = 0.0f;
    rr->rc[0] = comm_all_reduce(rr->c, &x, &y, 1, COMM_F32, NULL);
    if (rr->rank == 0) comm_abort(rr->c, "test abort");
    rr->rc[1] = comm_barrier(rr->c);  // rank 1 either waits here until the abort or sees it
    rr->rc[2] = comm_poll(rr->c);
    const double t0 = time_now_s();
    rr->rc[3] = comm_all_reduce(rr->c, &x, &y, 1, COMM_F32, NULL);
    rr->secs[3] = time_now_s() - t0;
}

static void test_comm_emul_abort(TestCtx* t) {
    RankRun runs[2];
    run_ranks(2, 5.0, abort_body, NULL, runs);
    for (int r = 0; r < 2; r++) {
        CHECK(t, runs[r].rc[0] == 0, "rank %d: op before the abort", r);
        CHECK(t, runs[r].rc[1] != 0 && runs[r].rc[2] != 0 && runs[r].rc[3] != 0,
              "rank %d: everything after the abort fails", r);
        CHECK(t, strstr(runs[r].err, "test abort") != NULL, "rank %d hears why: %s", r,
              runs[r].err);
        CHECK(t, runs[r].secs[3] < 0.05, "rank %d: fails at once (%.3f s)", r, runs[r].secs[3]);
    }
}

typedef struct MissingInit {
    CommEmulWorld* w;
    int rank, world;
    char err[ERR_LEN];
    Comm* c;
} MissingInit;

static void* missing_init_main(void* arg) {
    MissingInit* m = arg;
    CommInit in = {.rank = m->rank, .world = m->world, .timeout_s = 0.3, .local = m->w};
    m->c = comm_emul_impl.init(&in, m->err);
    return NULL;
}

static void test_comm_emul_init_missing(TestCtx* t) {
    CommEmulWorld* w = comm_emul_world_create(3);
    MissingInit m[2] = {{.w = w, .rank = 0, .world = 3}, {.w = w, .rank = 1, .world = 3}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_check(pthread_create(&th[i], NULL, missing_init_main, &m[i]));
    for (int i = 0; i < 2; i++) pthread_check(pthread_join(th[i], NULL));
    for (int i = 0; i < 2; i++) {
        CHECK(t, m[i].c == NULL, "rank %d: init fails", i);
        CHECK(t, strstr(m[i].err, "rank 2") != NULL, "rank %d names the missing rank: %s", i,
              m[i].err);
    }
    // a bad rank is refused at once
    char err[ERR_LEN];
    CommInit in = {.rank = 3, .world = 3, .timeout_s = 1.0, .local = w};
    CHECK(t, comm_emul_impl.init(&in, err) == NULL && strstr(err, "rank 3"), "rank 3 of 3: %s",
          err);
    comm_emul_world_destroy(w);
}

// A stream op whose peer never issues it: comm_sync fails within the timeout naming the peer.
static void test_comm_emul_stream_timeout(TestCtx* t) {
    CommEmulWorld* w = comm_emul_world_create(2);
    DeviceSet set;
    device_set_open(&set, &device_cpu_impl, 1, NULL);
    // rank 1 joins (init is collective) on a thread, then does nothing
    MissingInit m1 = {.w = w, .rank = 1, .world = 2};
    pthread_t th;
    pthread_check(pthread_create(&th, NULL, missing_init_main, &m1));
    char err[ERR_LEN];
    CommInit in = {.rank = 0, .world = 2, .timeout_s = 0.3, .local = w};
    Comm* c = comm_emul_impl.init(&in, err);
    pthread_check(pthread_join(th, NULL));
    CHECK(t, c != NULL && m1.c != NULL, "both ranks joined: %s", c ? m1.err : err);
    if (c && m1.c) {
        float* buf = set.impl->alloc(set.dev[0], 16 * sizeof(float));
        CommStream st = {.impl = set.impl, .dev = set.dev[0], .stream = STREAM_GRAD_DOWN};
        const double t0 = time_now_s();
        CHECK(t, comm_all_reduce(c, buf, buf, 16, COMM_F32, &st) == 0, "enqueue returns at once");
        const int rc = comm_sync(c, &st);
        const double dt = time_now_s() - t0;
        char msg[ERR_LEN];
        const char* e = comm_error(c, msg, sizeof msg);
        CHECK(t, rc != 0 && e && strstr(e, "rank 1"), "sync fails naming rank 1: %s",
              e ? e : "(none)");
        CHECK(t, dt >= 0.25 && dt < 2.0, "within the timeout (%.3f s)", dt);
        CHECK(t, comm_poll(m1.c) != 0, "the idle rank sees the abort when it polls");
        set.impl->free(set.dev[0], buf);
    }
    comm_destroy(c);
    comm_destroy(m1.c);
    device_set_close(&set);
    comm_emul_world_destroy(w);
}

// ----------------------------------------------------------------------------
// launch: flags and environments

typedef struct Env {
    const char* kv[16];  // "NAME=value"
} Env;

static const char* env_fn(void* ctx, const char* name) {
    const Env* e = ctx;
    const size_t n = strlen(name);
    for (int i = 0; i < 16 && e->kv[i]; i++)
        if (strncmp(e->kv[i], name, n) == 0 && e->kv[i][n] == '=') return e->kv[i] + n + 1;
    return NULL;
}

static int resolve(const DistFlags* f, const Env* e, DistConfig* c, char* err) {
    err[0] = '\0';
    return dist_config_resolve(c, f, env_fn, (void*)e, err);
}

static void test_comm_dist_config(TestCtx* t) {
    DistConfig c;
    char err[ERR_LEN];
    DistFlags none = {.rank = -1};
    Env empty = {{NULL}};
    CHECK(t, resolve(&none, &empty, &c, err) == 0 && c.world == 1 && c.rank == 0 &&
             c.local_rank == 0 && c.timeout_s == DIST_DEFAULT_TIMEOUT_S &&
             strcmp(c.source, "default") == 0, "nothing set: one rank (%s)", err);
    Env torch = {{"RANK=3", "WORLD_SIZE=8", "LOCAL_RANK=1", "MASTER_ADDR=node0",
                  "MASTER_PORT=29500"}};
    CHECK(t, resolve(&none, &torch, &c, err) == 0 && c.world == 8 && c.rank == 3 &&
             c.local_rank == 1 && strcmp(c.host, "node0") == 0 && c.port == 29500 &&
             strstr(c.source, "WORLD_SIZE"), "torchrun environment (%s)", err);
    Env slurm = {{"SLURM_PROCID=5", "SLURM_NTASKS=6", "SLURM_LOCALID=2", "MASTER_ADDR=10.0.0.1",
                  "MASTER_PORT=1234"}};
    CHECK(t, resolve(&none, &slurm, &c, err) == 0 && c.world == 6 && c.rank == 5 &&
             c.local_rank == 2 && strstr(c.source, "SLURM_NTASKS"), "Slurm environment (%s)", err);
    Env both = {{"RANK=1", "WORLD_SIZE=2", "SLURM_PROCID=0", "SLURM_NTASKS=1",
                 "MASTER_ADDR=h", "MASTER_PORT=1"}};
    CHECK(t, resolve(&none, &both, &c, err) == 0 && c.world == 2 && c.rank == 1,
          "torchrun inside Slurm: torchrun wins (%s)", err);
    Env salloc = {{"SLURM_NTASKS=4"}};
    CHECK(t, resolve(&none, &salloc, &c, err) == 0 && c.world == 1,
          "a bare salloc shell (no SLURM_PROCID) is one rank (%s)", err);
    DistFlags flags = {.init = "tcp://[::1]:7000", .rank = 1, .world = 2, .timeout_s = 9};
    CHECK(t, resolve(&flags, &torch, &c, err) == 0 && c.world == 2 && c.rank == 1 &&
             strcmp(c.host, "::1") == 0 && c.port == 7000 && c.timeout_s == 9 &&
             c.local_rank == 1 && strcmp(c.source, "--world") == 0, "flags win (%s)", err);

    // errors: one line naming the flag or variable
    struct {
        DistFlags f;
        Env e;
        const char* needle;
    } bad[] = {
        {{.rank = -1}, {{"RANK=1"}}, "WORLD_SIZE is not"},
        {{.rank = -1}, {{"WORLD_SIZE=2"}}, "WORLD_SIZE is set but RANK is not"},
        {{.rank = -1}, {{"RANK=abc", "WORLD_SIZE=2"}}, "RANK='abc'"},
        {{.rank = -1}, {{"RANK=2", "WORLD_SIZE=2", "MASTER_ADDR=h", "MASTER_PORT=1"}},
         "not below the world size 2"},
        {{.rank = -1}, {{"RANK=0", "WORLD_SIZE=2"}}, "needs rank 0's address"},
        {{.rank = -1}, {{"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=h"}}, "MASTER_PORT is not"},
        {{.rank = -1}, {{"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=h", "MASTER_PORT=70000"}},
         "MASTER_PORT='70000'"},
        {{.rank = -1}, {{"SLURM_PROCID=0"}}, "SLURM_NTASKS is not"},
        {{.rank = -1}, {{"LOCAL_RANK=-1"}}, "LOCAL_RANK='-1'"},
        {{.rank = -1, .world = 2}, {{NULL}}, "needs this process's rank"},
        {{.rank = 4, .world = 2, .init = "tcp://h:1"}, {{NULL}}, "rank 4 (--rank)"},
        {{.rank = 0, .world = 2, .init = "http://h:1"}, {{NULL}}, "expected tcp://HOST:PORT"},
        {{.rank = 0, .world = 2, .init = "tcp://h"}, {{NULL}}, "no :PORT"},
        {{.rank = 0, .world = 2, .init = "tcp://h:0"}, {{NULL}}, "port must be"},
        {{.rank = 0, .world = 2, .init = "tcp://:5"}, {{NULL}}, "empty host"},
        {{.rank = 0, .world = 2, .init = "tcp://::1:5"}, {{NULL}}, "brackets"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const int rc = resolve(&bad[i].f, &bad[i].e, &c, err);
        CHECK(t, rc != 0 && strstr(err, bad[i].needle) && !strchr(err, '\n'),
              "case %zu: want '%s', got rc %d '%s'", i, bad[i].needle, rc, err);
    }
}

// ----------------------------------------------------------------------------
// launch: the TCP rendezvous (ranks as threads over localhost)

typedef struct Client {
    int port, rank, world;
    double timeout_s, delay_s;
    int rc;
    CommToken tok;
    char err[ERR_LEN];
} Client;

static void* client_main(void* arg) {
    Client* c = arg;
    if (c->delay_s > 0) {  // stagger the ranks' arrivals
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(c->delay_s * 1e9)};
        nanosleep(&ts, NULL);
    }
    c->rc = dist_client_fetch("127.0.0.1", c->port, c->rank, c->world, c->timeout_s, &c->tok,
                              c->err);
    return NULL;
}

// Serve world ranks with clients for ranks[0..n); returns the server's rc (err filled).
static int serve(TestCtx* t, int world, const int* ranks, const int* worlds, int n,
                 double timeout_s, Client* cl, const CommToken* tok, char* err) {
    char lerr[ERR_LEN];
    DistServer* s = dist_server_listen("127.0.0.1", 0, lerr);
    CHECK(t, s != NULL, "listen on a free port: %s", s ? "" : lerr);
    if (!s) return -1;
    pthread_t th[8];
    for (int i = 0; i < n; i++) {
        cl[i] = (Client){.port = dist_server_port(s), .rank = ranks[i],
                         .world = worlds ? worlds[i] : world, .timeout_s = timeout_s,
                         .delay_s = 0.02 * i};
        pthread_check(pthread_create(&th[i], NULL, client_main, &cl[i]));
    }
    const int rc = dist_server_hand_out(s, world, tok, timeout_s, err);
    for (int i = 0; i < n; i++) pthread_check(pthread_join(th[i], NULL));
    dist_server_close(s);
    return rc;
}

static void test_comm_dist_rendezvous(TestCtx* t) {
    CommToken tok;
    for (int i = 0; i < COMM_TOKEN_BYTES; i++) tok.bytes[i] = (uint8_t)(i * 37 + 11);
    char err[ERR_LEN];
    Client cl[4];
    // all there: every rank gets rank 0's token
    const int ranks[3] = {3, 1, 2};
    int rc = serve(t, 4, ranks, NULL, 3, 5.0, cl, &tok, err);
    CHECK(t, rc == 0, "hand out to 3 ranks: %s", rc ? err : "");
    for (int i = 0; i < 3; i++)
        CHECK(t, cl[i].rc == 0 && memcmp(cl[i].tok.bytes, tok.bytes, COMM_TOKEN_BYTES) == 0,
              "rank %d got the token: %s", ranks[i], cl[i].err);

    // a missing peer: rank 0 and the rank that came both name it, after the timeout
    const int two[1] = {1};
    double t0 = time_now_s();
    rc = serve(t, 3, two, NULL, 1, 0.4, cl, &tok, err);
    double dt = time_now_s() - t0;
    CHECK(t, rc != 0 && strstr(err, "rank 2 did not connect"), "rank 0 names rank 2: %s", err);
    CHECK(t, cl[0].rc != 0 && strstr(cl[0].err, "rank 2 did not connect"),
          "rank 1 hears it: %s", cl[0].err);
    CHECK(t, dt >= 0.35 && dt < 3.0, "after the timeout (%.2f s)", dt);

    // a rank started with another world size; a rank twice
    const int w_bad[2] = {3, 2};
    const int r12[2] = {1, 2};
    rc = serve(t, 3, r12, w_bad, 2, 2.0, cl, &tok, err);
    CHECK(t, rc != 0 && strstr(err, "world size 2"), "world size mismatch: %s", err);
    CHECK(t, cl[0].rc != 0 && cl[1].rc != 0 && strstr(cl[1].err, "world size 2"),
          "the ranks hear it: '%s' '%s'", cl[0].err, cl[1].err);
    const int r11[2] = {1, 1};
    rc = serve(t, 3, r11, NULL, 2, 2.0, cl, &tok, err);
    CHECK(t, rc != 0 && strstr(err, "rank 1 connected twice"), "a rank twice: %s", err);

    // no rank 0 at all: the client gives up after its timeout, naming the address
    DistServer* s = dist_server_listen("127.0.0.1", 0, err);
    const int port = s ? dist_server_port(s) : 1;
    dist_server_close(s);
    Client lone = {.port = port, .rank = 1, .world = 2, .timeout_s = 0.3};
    t0 = time_now_s();
    client_main(&lone);
    dt = time_now_s() - t0;
    CHECK(t, lone.rc != 0 && strstr(lone.err, "could not connect to rank 0 at 127.0.0.1"),
          "no rank 0: %s", lone.err);
    CHECK(t, dt >= 0.25 && dt < 2.0, "after the timeout (%.2f s)", dt);

    // a port in use is refused with a hint
    DistServer* a = dist_server_listen("127.0.0.1", 0, err);
    if (a) {
        DistServer* b = dist_server_listen("127.0.0.1", dist_server_port(a), err);
        CHECK(t, b == NULL && strstr(err, "cannot listen") && strstr(err, "pick another"),
              "port in use: %s", err);
        dist_server_close(b);
        dist_server_close(a);
    }

    // world 1: no network, the token is made locally
    DistConfig one = {.rank = 0, .world = 1, .timeout_s = 1};
    CHECK(t, dist_rendezvous(&one, &comm_emul_impl, &tok, err) == 0, "world 1: %s", err);
}

// dist_rendezvous itself, every rank a thread with its DistConfig: rank 0 listens, makes the
// token (a patterned one here) and hands it out.
static int pattern_token(CommToken* out, char* err) {
    (void)err;
    for (int i = 0; i < COMM_TOKEN_BYTES; i++) out->bytes[i] = (uint8_t)(255 - i);
    return 0;
}

typedef struct RdvRank {
    DistConfig cfg;
    const CommImpl* impl;
    int rc;
    CommToken tok;
    char err[ERR_LEN];
} RdvRank;

static void* rdv_main(void* arg) {
    RdvRank* r = arg;
    r->rc = dist_rendezvous(&r->cfg, r->impl, &r->tok, r->err);
    return NULL;
}

static void test_comm_dist_rendezvous_config(TestCtx* t) {
    char err[ERR_LEN];
    // a free port: bind port 0, note it, close (SO_REUSEADDR lets rank 0 take it again)
    DistServer* s = dist_server_listen("127.0.0.1", 0, err);
    CHECK(t, s != NULL, "a free port: %s", s ? "" : err);
    if (!s) return;
    const int port = dist_server_port(s);
    dist_server_close(s);
    CommImpl fake = comm_emul_impl;
    fake.new_token = pattern_token;
    RdvRank rk[3];
    pthread_t th[3];
    for (int r = 2; r >= 0; r--) {  // rank 0 last: the others retry until it listens
        rk[r] = (RdvRank){.impl = &fake};
        DistFlags f = {.init = "", .rank = r, .world = 3, .timeout_s = 5.0};
        char url[64];
        snprintf(url, sizeof url, "tcp://127.0.0.1:%d", port);
        f.init = url;
        CHECK(t, dist_config_resolve(&rk[r].cfg, &f, NULL, NULL, err) == 0, "config %d: %s", r,
              err);
        pthread_check(pthread_create(&th[r], NULL, rdv_main, &rk[r]));
    }
    for (int r = 0; r < 3; r++) pthread_check(pthread_join(th[r], NULL));
    CommToken want;
    pattern_token(&want, err);
    for (int r = 0; r < 3; r++)
        CHECK(t, rk[r].rc == 0 && memcmp(rk[r].tok.bytes, want.bytes, COMM_TOKEN_BYTES) == 0,
              "rank %d has rank 0's token: %s", r, rk[r].err);
}

// ----------------------------------------------------------------------------
// the trainer's flags

static void test_comm_cli_flags(TestCtx* t) {
    // the engine trains data parallel too: the flags pass, and a rank whose rank 0 never comes
    // fails within --dist-timeout naming it (CUDA builds: NCCL), or the build without CUDA says
    // it has no NCCL, in one line; from flags or from torchrun's environment
    int rc = test_run_cli(t, "dp_world", "--world 2 --rank 1 --dist-init tcp://127.0.0.1:9 "
                          "--dist-timeout 1 --steps 1 --device cpu:2 --micro-batches 2");
    char* e = test_read_output(t, "dp_world", "err");
    CHECK(t, rc != 0 && strchr(e, '\n') == e + strlen(e) - 1 &&
             (strstr(e, "rank 1 could not connect to rank 0") || strstr(e, "without CUDA")),
          "world 2 on the engine: one line: rc %d '%s'", rc, e);
    free(e);
    setenv("WORLD_SIZE", "2", 1);
    setenv("RANK", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "9", 1);
    rc = test_run_cli(t, "dp_env", "--steps 1 --device cpu:2 --micro-batches 2 --dist-timeout 1");
    unsetenv("WORLD_SIZE");
    unsetenv("RANK");
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    e = test_read_output(t, "dp_env", "err");
    CHECK(t, rc != 0 && strchr(e, '\n') == e + strlen(e) - 1 &&
             (strstr(e, "rank 1 could not connect to rank 0") || strstr(e, "without CUDA")),
          "torchrun environment on the engine: one line: rc %d '%s'", rc, e);
    free(e);
    // the plain path: a batch that does not split over the ranks is refused up front; a rank
    // whose rank 0 never comes fails within --dist-timeout naming it (CUDA builds: NCCL), or the
    // build without CUDA says it has no NCCL
    rc = test_run_cli(t, "dp_split", "--world 3 --rank 1 --dist-init tcp://127.0.0.1:9 --batch 16");
    e = test_read_output(t, "dp_split", "err");
    CHECK(t, rc == 2 && strstr(e, "--batch 16 does not divide by the world size 3"),
          "batch split refused: rc %d '%s'", rc, e);
    free(e);
    rc = test_run_cli(t, "dp_norank0", "--world 2 --rank 1 --dist-init tcp://127.0.0.1:9 "
                      "--dist-timeout 1 --steps 1 --micro-batches 2");
    e = test_read_output(t, "dp_norank0", "err");
    CHECK(t, rc != 0 && strchr(e, '\n') == e + strlen(e) - 1 &&
             (strstr(e, "rank 1 could not connect to rank 0") || strstr(e, "without CUDA")),
          "no rank 0: one line: rc %d '%s'", rc, e);
    free(e);
    const struct {
        const char* args;
        const char* needle;
    } bad[] = {
        {"--dist-init 127.0.0.1:5", "expected tcp://HOST:PORT"},
        {"--rank 1", "not below the world size 1"},
        {"--world 0", "--world '0': too small"},
        {"--world 2", "needs this process's rank"},
        {"--dist-timeout 0", "--dist-timeout '0': too small"},
        {"--rank -1", "--rank '-1': too small"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char tag[32];
        snprintf(tag, sizeof tag, "dp_bad%zu", i);
        rc = test_run_cli(t, tag, bad[i].args);
        e = test_read_output(t, tag, "err");
        CHECK(t, rc == 2 && strstr(e, bad[i].needle), "%s: rc %d '%s'", bad[i].args, rc, e);
        free(e);
    }
    // world 1 by flags is just a normal run's flags (--help exits 0 before anything runs)
    rc = test_run_cli(t, "dp_one", "--world 1 --rank 0 --dist-timeout 5 --help");
    CHECK(t, rc == 0, "--world 1 is accepted: rc %d", rc);
}

const TestCase tests_comm[] = {
    {"comm_shard_layout", test_comm_shard_layout},
    {"comm_emul_host", test_comm_emul_host},
    {"comm_emul_stream", test_comm_emul_stream},
    {"comm_bf16_accumulation", test_comm_bf16_accumulation},
    {"comm_emul_hang", test_comm_emul_hang},
    {"comm_emul_die", test_comm_emul_die},
    {"comm_emul_mismatch", test_comm_emul_mismatch},
    {"comm_emul_abort", test_comm_emul_abort},
    {"comm_emul_init_missing", test_comm_emul_init_missing},
    {"comm_emul_stream_timeout", test_comm_emul_stream_timeout},
    {"comm_dist_config", test_comm_dist_config},
    {"comm_dist_rendezvous", test_comm_dist_rendezvous},
    {"comm_dist_rendezvous_config", test_comm_dist_rendezvous_config},
    {"cli_dist_flags", test_comm_cli_flags},
    {NULL, NULL},
};
