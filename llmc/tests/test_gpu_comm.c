/*
 * test_gpu_comm.c — the NCCL communicator (llmc/comm_nccl.c) against the emulated one (suite
 * `gpu_comm`; `./test_roundpipe gpu` runs it with the other GPU suites).
 *
 * One rank on GPU 0: the full NCCL code path (unique id, non-blocking init, grouped collectives
 * enqueued on a CUDA device's stream through the device's issue thread, the host path staged
 * through device memory, barrier, finalize) with world size 1, bit-identical to the emulation.
 * With G > 1 GPUs: G ranks as threads, one communicator per GPU, against the emulation with G
 * ranks (bit-identical for G = 2, where NCCL's single addition per element is the emulation's;
 * within rounding for G > 2, whose ring sums in another order); and a rank that never joins a
 * collective: the other's comm_sync gives up after the timeout and aborts, with no hang.
 * Without a GPU, or in a build without CUDA, every test is reported as skipped.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../comm.h"
#include "../common.h"
#include "../device.h"
#include "../rng.h"
#include "testing.h"

#ifdef HAVE_CUDA

#include "../../kernels/kernels.h"

#define GC_MAX_W 8

// ----------------------------------------------------------------------------
// one set of inputs, every op, outputs back on the host

typedef struct GcCase {
    int W;
    size_t n, blk;  // all_reduce / broadcast size; reduce_scatter / all_gather block
    CommDtype dt;
    void* in[GC_MAX_W];     // n
    void* rs_in[GC_MAX_W];  // W * blk, zero past n
    void* ag_in[GC_MAX_W];  // blk
} GcCase;

typedef struct GcOut {
    void *ar, *rs, *ag, *bc;  // n, blk, W * blk, n
} GcOut;

static void* gc_convert(float* x, size_t n, CommDtype dt) {
    if (dt == COMM_F32) return x;
    uint16_t* b = malloc_check((n ? n : 1) * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) b[i] = f32_to_bf16(x[i]);
    free(x);
    return b;
}

static void gc_make(GcCase* k, int W, size_t n, CommDtype dt, uint32_t seed) {
    memset(k, 0, sizeof *k);
    k->W = W;
    k->n = n;
    k->blk = comm_shard_block(n, W);
    k->dt = dt;
    Rng rng;
    rng_seed(&rng, seed);
    for (int r = 0; r < W; r++) {
        k->in[r] = gc_convert(rand_floats(&rng, n, 1.0f), n, dt);
        float* rs = calloc_check((size_t)W * k->blk + 1, sizeof(float));
        for (size_t i = 0; i < n; i++) rs[i] = rng_normal(&rng);
        k->rs_in[r] = gc_convert(rs, (size_t)W * k->blk, dt);
        k->ag_in[r] = gc_convert(rand_floats(&rng, k->blk, 2.0f), k->blk, dt);
    }
}

static void gc_free(GcCase* k) {
    for (int r = 0; r < k->W; r++) free(k->in[r]), free(k->rs_in[r]), free(k->ag_in[r]);
}

static void gc_out_alloc(const GcCase* k, GcOut* o) {
    const size_t es = comm_dtype_size(k->dt);
    o->ar = calloc_check(k->n + 1, es);
    o->rs = calloc_check(k->blk + 1, es);
    o->ag = calloc_check((size_t)k->W * k->blk + 1, es);
    o->bc = calloc_check(k->n + 1, es);
}

static void gc_out_free(GcOut* o) { free(o->ar), free(o->rs), free(o->ag), free(o->bc); }

// Every op on host buffers (st NULL) or on a CUDA device's stream (buffers uploaded there).
static int gc_run(Comm* c, int r, const GcCase* k, const CommStream* st, GcOut* o) {
    const size_t es = comm_dtype_size(k->dt), W = (size_t)k->W;
    const int root = k->W - 1;
    if (!st) {
        int rc = comm_all_reduce(c, k->in[r], o->ar, k->n, k->dt, NULL);
        CommOp g[2] = {{.kind = COMM_REDUCE_SCATTER, .dtype = k->dt, .send = k->rs_in[r],
                        .recv = o->rs, .count = k->blk},
                       {.kind = COMM_ALL_GATHER, .dtype = k->dt, .send = k->ag_in[r],
                        .recv = o->ag, .count = k->blk}};
        rc |= comm_run(c, g, 2, NULL);
        if (r == root) memcpy(o->bc, k->in[r], k->n * es);
        rc |= comm_broadcast(c, r == root ? o->bc : NULL, o->bc, k->n, k->dt, root, NULL);
        rc |= comm_barrier(c);
        return rc;
    }
    const DeviceImpl* I = st->impl;
    Device* d = st->dev;
    const StreamKind s = st->stream;
    void* d_in = I->alloc(d, k->n * es + 16);
    void* d_ar = I->alloc(d, k->n * es + 16);
    void* d_rs_in = I->alloc(d, W * k->blk * es + 16);
    void* d_ag = I->alloc(d, W * k->blk * es + 16);
    void* d_bc = I->alloc(d, k->n * es + 16);
    I->copy_h2d(d, s, d_in, k->in[r], k->n * es);
    I->copy_h2d(d, s, d_rs_in, k->rs_in[r], W * k->blk * es);
    // all_gather in place: this rank's block already where the gathered array keeps it
    I->copy_h2d(d, s, (char*)d_ag + (size_t)r * k->blk * es, k->ag_in[r], k->blk * es);
    if (r == root) I->copy_h2d(d, s, d_bc, k->in[r], k->n * es);
    int rc = comm_all_reduce(c, d_in, d_ar, k->n, k->dt, st);
    // reduce_scatter in place: rank r's block of the input becomes its output
    void* d_rs = (char*)d_rs_in + (size_t)r * k->blk * es;
    CommOp g[2] = {{.kind = COMM_REDUCE_SCATTER, .dtype = k->dt, .send = d_rs_in, .recv = d_rs,
                    .count = k->blk},
                   {.kind = COMM_ALL_GATHER, .dtype = k->dt,
                    .send = (char*)d_ag + (size_t)r * k->blk * es, .recv = d_ag,
                    .count = k->blk}};
    rc |= comm_run(c, g, 2, st);
    rc |= comm_broadcast(c, d_bc, d_bc, k->n, k->dt, root, st);
    I->copy_d2h(d, s, o->ar, d_ar, k->n * es);
    I->copy_d2h(d, s, o->rs, d_rs, k->blk * es);
    I->copy_d2h(d, s, o->ag, d_ag, W * k->blk * es);
    I->copy_d2h(d, s, o->bc, d_bc, k->n * es);
    rc |= comm_sync(c, st);
    I->synchronize(d);
    I->free(d, d_in), I->free(d, d_ar), I->free(d, d_rs_in), I->free(d, d_ag), I->free(d, d_bc);
    return rc;
}

// ----------------------------------------------------------------------------
// ranks as threads (emulation or NCCL)

typedef struct GcRank {
    const CommImpl* impl;
    CommInit init;
    const GcCase* k;
    DeviceSet* set;  // NCCL stream path: rank r on set->dev[r]; NULL: host path
    GcOut out;
    int rc;
    int idle;        // join, then issue nothing (the peer's timeout test)
    pthread_barrier_t* done;  // idle ranks wait here until the active one has finished
    char err[ERR_LEN];
} GcRank;

static void* gc_rank_main(void* arg) {
    GcRank* g = arg;
    Comm* c = g->impl->init(&g->init, g->err);
    if (!c) {
        g->rc = -1;
        if (g->done) pthread_barrier_wait(g->done);
        return NULL;
    }
    gc_out_alloc(g->k, &g->out);
    if (g->idle) {
        g->rc = 0;
    } else {
        CommStream cs, *st = NULL;
        if (g->set) {
            cs = (CommStream){.impl = g->set->impl, .dev = g->set->dev[g->init.rank],
                              .stream = STREAM_GRAD_DOWN};
            st = &cs;
        }
        g->rc = gc_run(c, g->init.rank, g->k, st, &g->out);
    }
    char buf[ERR_LEN];
    if (comm_error(c, buf, sizeof buf)) str_copy(g->err, sizeof g->err, buf);
    if (g->done) pthread_barrier_wait(g->done);
    comm_destroy(c);
    return NULL;
}

// Run the case on every rank; outs[r] filled (caller frees). 0 when every rank succeeded.
static int gc_world(TestCtx* t, const CommImpl* impl, const GcCase* k, DeviceSet* set,
                    double timeout_s, GcRank* g) {
    CommEmulWorld* w = impl == &comm_emul_impl ? comm_emul_world_create(k->W) : NULL;
    CommToken tok;
    char err[ERR_LEN];
    if (impl->new_token(&tok, err) != 0) {
        CHECK(t, 0, "%s token: %s", impl->name, err);
        comm_emul_world_destroy(w);
        return -1;
    }
    pthread_t th[GC_MAX_W];
    for (int r = 0; r < k->W; r++) {
        g[r] = (GcRank){.impl = impl, .k = k, .set = impl == &comm_nccl_impl ? set : NULL,
                        .init = {.rank = r, .world = k->W, .timeout_s = timeout_s, .token = tok,
                                 .gpu = r, .local = w}};
        pthread_check(pthread_create(&th[r], NULL, gc_rank_main, &g[r]));
    }
    int bad = 0;
    for (int r = 0; r < k->W; r++) {
        pthread_check(pthread_join(th[r], NULL));
        if (g[r].rc != 0) fprintf(stderr, "  %s rank %d: %s\n", impl->name, r, g[r].err);
        bad += g[r].rc != 0;
    }
    comm_emul_world_destroy(w);
    return bad;
}

// got against want: bit-identical (exact) or relative L2 within tol.
static void gc_compare(TestCtx* t, const char* what, const void* got, const void* want, size_t n,
                       CommDtype dt, int exact) {
    if (exact || n == 0) {
        CHECK(t, memcmp(got, want, n * comm_dtype_size(dt)) == 0, "%s: bit-identical", what);
        return;
    }
    float* a = malloc_check(n * sizeof(float));
    float* b = malloc_check(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        a[i] = dt == COMM_F32 ? ((const float*)got)[i] : bf16_to_f32(((const uint16_t*)got)[i]);
        b[i] = dt == COMM_F32 ? ((const float*)want)[i] : bf16_to_f32(((const uint16_t*)want)[i]);
    }
    const double e = rel_l2_error(a, b, n);
    CHECK(t, e <= (dt == COMM_F32 ? 1e-6 : 1e-2), "%s: rel L2 %.3g", what, e);
    free(a);
    free(b);
}

static void gc_sweep(TestCtx* t, int W, int on_stream) {
    DeviceSet set = {0};
    if (on_stream) device_set_open(&set, &device_cuda_impl, W, NULL);
    const size_t sizes[] = {1, 7, 1001, (size_t)1 << 20};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (int dt = 0; dt < 2; dt++) {
            GcCase k;
            gc_make(&k, W, sizes[si], (CommDtype)dt, 1000u + (uint32_t)(si * 2 + (size_t)dt));
            GcRank e[GC_MAX_W], g[GC_MAX_W];
            char what[160];
            snprintf(what, sizeof what, "W %d n %zu %s %s", W, k.n, dt ? "bf16" : "f32",
                     on_stream ? "stream" : "host");
            CHECK(t, gc_world(t, &comm_emul_impl, &k, NULL, 30.0, e) == 0, "%s: emulation",
                  what);
            CHECK(t, gc_world(t, &comm_nccl_impl, &k, on_stream ? &set : NULL, 60.0, g) == 0,
                  "%s: NCCL", what);
            // sums: exact for W <= 2 (one addition); the ring's order for W > 2
            const int exact = W <= 2;
            for (int r = 0; r < W; r++) {
                char w2[200];
                snprintf(w2, sizeof w2, "%s rank %d all_reduce", what, r);
                gc_compare(t, w2, g[r].out.ar, e[r].out.ar, k.n, k.dt, exact);
                snprintf(w2, sizeof w2, "%s rank %d reduce_scatter", what, r);
                gc_compare(t, w2, g[r].out.rs, e[r].out.rs, k.blk, k.dt, exact);
                snprintf(w2, sizeof w2, "%s rank %d all_gather", what, r);
                gc_compare(t, w2, g[r].out.ag, e[r].out.ag, (size_t)W * k.blk, k.dt, 1);
                snprintf(w2, sizeof w2, "%s rank %d broadcast", what, r);
                gc_compare(t, w2, g[r].out.bc, e[r].out.bc, k.n, k.dt, 1);
                gc_out_free(&e[r].out);
                gc_out_free(&g[r].out);
            }
            gc_free(&k);
        }
    if (on_stream) device_set_close(&set);
}

static int gc_have_gpus(TestCtx* t, int need) {
    const int n = cuda_device_count();
    if (n == 0) {
        test_skip(t, "no GPU: cudaGetDeviceCount found no CUDA device");
        return 0;
    }
    if (n < need) {
        test_skip(t, "%d GPU(s) here, the test needs %d", n, need);
        return 0;
    }
    return n;
}

// ----------------------------------------------------------------------------
// tests


// Every GPU a rank (one communicator each), when there are two or more.
static void gc_all_gpus(TestCtx* t) {
    const int n = cuda_device_count();
    if (n < 2) {
        test_skip_part(t, "all GPUs as ranks: %d GPU here, needs 2", n);
        return;
    }
    const int W = n < GC_MAX_W ? n : GC_MAX_W;
    gc_sweep(t, W, 1);
    gc_sweep(t, W, 0);
}

// Rank 1 joins and issues nothing: rank 0's all-reduce cannot complete; comm_sync gives up after
// the timeout, aborts, and returns instead of hanging.
static void gc_timeout(TestCtx* t) {
    if (cuda_device_count() < 2) {
        test_skip_part(t, "a rank that never joins: %d GPU here, needs 2", cuda_device_count());
        return;
    }
    DeviceSet set;
    device_set_open(&set, &device_cuda_impl, 2, NULL);
    GcCase k;
    gc_make(&k, 2, 4096, COMM_F32, 7);
    CommToken tok;
    char err[ERR_LEN];
    CHECK(t, comm_nccl_impl.new_token(&tok, err) == 0, "token: %s", err);
    pthread_barrier_t done;
    pthread_check(pthread_barrier_init(&done, NULL, 2));
    GcRank g[2];
    pthread_t th[2];
    const double timeout = 3.0;
    for (int r = 0; r < 2; r++) {
        g[r] = (GcRank){.impl = &comm_nccl_impl, .k = &k, .set = &set, .idle = r == 1,
                        .done = &done,
                        .init = {.rank = r, .world = 2, .timeout_s = timeout, .token = tok,
                                 .gpu = r}};
    }
    const double t0 = time_now_s();
    for (int r = 0; r < 2; r++) pthread_check(pthread_create(&th[r], NULL, gc_rank_main, &g[r]));
    for (int r = 0; r < 2; r++) pthread_check(pthread_join(th[r], NULL));
    const double dt = time_now_s() - t0;
    CHECK(t, g[0].rc != 0 && strstr(g[0].err, "did not complete"),
          "rank 0 gives up: rc %d '%s'", g[0].rc, g[0].err);
    CHECK(t, dt < 3 * timeout + 10.0, "no hang: %.1f s", dt);
    pthread_check(pthread_barrier_destroy(&done));
    for (int r = 0; r < 2; r++) gc_out_free(&g[r].out);
    gc_free(&k);
    device_set_close(&set);
}

// NCCL with one rank (the full code path at world size 1) against the emulation; with two or
// more GPUs also every GPU as a rank and a rank that never joins (parts skipped with one GPU).
static void test_gpu_comm_nccl(TestCtx* t) {
    if (!gc_have_gpus(t, 1)) return;
    gc_sweep(t, 1, 1);
    gc_sweep(t, 1, 0);
    CHECK(t, getenv("NCCL_NVLS_ENABLE") != NULL, "NCCL_NVLS_ENABLE is set (0 unless the user "
          "set it)");
    gc_all_gpus(t);
    gc_timeout(t);
}

#else  // no CUDA in this build

static void test_gpu_comm_nccl(TestCtx* t) { test_skip(t, "built without CUDA"); }

#endif

const TestCase tests_gpu_comm[] = {
    {"gpu_comm_nccl", test_gpu_comm_nccl},
    {NULL, NULL},
};
