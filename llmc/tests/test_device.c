/*
 * test_device.c — tests of the CPU device emulation (llmc/device_cpu.c, llmc/device.c; suite
 * `device`).
 *
 * Checks the device.h semantics the engine relies on: FIFO order per stream, real concurrency
 * between streams, record/wait across devices (a 1000-round producer/consumer with injected
 * delays never reads stale data), waits that snapshot the latest record at call time, no-op waits
 * on never-recorded events, host synchronisation and queries, memory accounting and the memory
 * limit, copies and memsets, identical results with and without fault injection, and draining of
 * pending work at close. Data written on a stream thread is deliberately read as plain memory on
 * the host after an event synchronisation, so ThreadSanitizer (`make tsan`) checks that events
 * really give happens-before.
 *
 * Gates (a stream function blocking until the test opens it) make "this must not have run yet"
 * checks deterministic; every blocking step has a timeout so a broken emulation fails instead of
 * hanging the suite.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../common.h"
#include "../device.h"
#include "../rng.h"
#include "testing.h"

// ----------------------------------------------------------------------------
// helpers

#define GATE_TIMEOUT_S 10

static void sleep_us(long us) {
    struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

// A gate: gate_wait_fn (run on a stream) blocks until the test calls gate_open.
typedef struct Gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;
    int timed_out;  // the gate gave up waiting (a test failure)
} Gate;

static void gate_init(Gate* g) {
    pthread_check(pthread_mutex_init(&g->mu, NULL));
    pthread_check(pthread_cond_init(&g->cv, NULL));
    g->open = 0;
    g->timed_out = 0;
}

static void gate_destroy(Gate* g) {
    pthread_check(pthread_cond_destroy(&g->cv));
    pthread_check(pthread_mutex_destroy(&g->mu));
}

static void gate_open(Gate* g) {
    pthread_check(pthread_mutex_lock(&g->mu));
    g->open = 1;
    pthread_check(pthread_cond_broadcast(&g->cv));
    pthread_check(pthread_mutex_unlock(&g->mu));
}

static void gate_open_fn(void* arg) { gate_open(arg); }

static void gate_wait_fn(void* arg) {
    Gate* g = arg;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += GATE_TIMEOUT_S;
    pthread_check(pthread_mutex_lock(&g->mu));
    while (!g->open && !g->timed_out) {
        int rc = pthread_cond_timedwait(&g->cv, &g->mu, &deadline);
        if (rc == ETIMEDOUT) g->timed_out = 1;
        else if (rc != 0) fatal("pthread_cond_timedwait failed (errno %d)", rc);
    }
    pthread_check(pthread_mutex_unlock(&g->mu));
}

static int gate_timed_out(Gate* g) {
    pthread_check(pthread_mutex_lock(&g->mu));
    int r = g->timed_out;
    pthread_check(pthread_mutex_unlock(&g->mu));
    return r;
}

static void flag_set_fn(void* arg) { atomic_store((atomic_int*)arg, 1); }

// Poll event_query until complete; 0 on timeout (where a blocking synchronize would hang).
static int query_until(const DeviceImpl* I, DevEvent* e, double timeout_s) {
    double t0 = time_now_s();
    while (!I->event_query(e)) {
        if (time_now_s() - t0 > timeout_s) return 0;
        sleep_us(200);
    }
    return 1;
}

static void open_set(DeviceSet* set, int n, int max_delay_us, uint32_t seed) {
    DeviceOptions opt = {.threads = 1, .delay_seed = seed, .max_delay_us = max_delay_us};
    device_set_open(set, &device_cpu_impl, n, &opt);
}

// ----------------------------------------------------------------------------
// set, names, ops

static void test_device_set_open_close(TestCtx* t) {
    for (int s = 0; s < STREAM_COUNT; s++) {
        CHECK(t, stream_names[s] != NULL && stream_names[s][0] != '\0', "stream %d has a name", s);
        for (int r = 0; r < s; r++)
            CHECK(t, stream_names[s] && stream_names[r] && strcmp(stream_names[s], stream_names[r]),
                  "stream names %d and %d differ", r, s);
    }
    CHECK(t, strcmp(stream_names[STREAM_COMPUTE], "compute") == 0, "compute name");

    DeviceSet set;
    open_set(&set, 3, 0, 1);
    const DeviceImpl* I = set.impl;
    CHECK(t, I == &device_cpu_impl && strcmp(I->name, "cpu") == 0, "impl is cpu");
    CHECK(t, set.n == 3 && set.dev != NULL, "3 devices, got %d", set.n);
    for (int i = 0; i < set.n; i++) {
        CHECK(t, set.dev[i] != NULL, "device %d open", i);
        CHECK(t, I->ops(set.dev[i]) == &ops_cpu, "device %d uses ops_cpu", i);
        CHECK(t, I->ops_ctx(set.dev[i]) != NULL, "device %d has an op context", i);
        for (int j = 0; j < i; j++)
            CHECK(t, I->ops_ctx(set.dev[i]) != I->ops_ctx(set.dev[j]), "contexts %d, %d differ",
                  j, i);
    }
    device_set_close(&set);
    CHECK(t, set.n == 0 && set.dev == NULL && set.impl == NULL, "closed set is zeroed");
    device_set_close(&set);  // closing twice is harmless

    device_set_open(&set, &device_cpu_impl, 1, NULL);  // NULL options = defaults
    CHECK(t, set.n == 1, "default options open one device");
    device_set_close(&set);
}

// ----------------------------------------------------------------------------
// ordering and concurrency

#define ORDER_N 400

typedef struct OrderLog {
    int n;
    int v[ORDER_N];
} OrderLog;  // written only by one stream thread, read by the host after synchronize

typedef struct OrderItem {
    OrderLog* log;
    int value;
} OrderItem;

static void order_append_fn(void* arg) {
    OrderItem* it = arg;
    if (it->log->n < ORDER_N) it->log->v[it->log->n++] = it->value;
}

// Every stream runs its items in submission order, with and without injected delays.
static void test_device_in_order(TestCtx* t) {
    for (int delay = 0; delay <= 20; delay += 20) {
        DeviceSet set;
        open_set(&set, 1, delay, 7);
        const DeviceImpl* I = set.impl;
        Device* d = set.dev[0];
        OrderLog* logs = calloc_check(STREAM_COUNT, sizeof(OrderLog));
        OrderItem* items = calloc_check((size_t)STREAM_COUNT * ORDER_N, sizeof(OrderItem));
        for (int i = 0; i < ORDER_N; i++)
            for (int s = 0; s < STREAM_COUNT; s++) {
                OrderItem* it = &items[s * ORDER_N + i];
                it->log = &logs[s];
                it->value = i;
                I->submit(d, (StreamKind)s, order_append_fn, it);
            }
        I->synchronize(d);
        for (int s = 0; s < STREAM_COUNT; s++) {
            int bad = 0;
            for (int i = 0; i < logs[s].n; i++) bad += logs[s].v[i] != i;
            CHECK(t, logs[s].n == ORDER_N && bad == 0,
                  "delay %d stream %s: %d items, %d out of order", delay, stream_names[s],
                  logs[s].n, bad);
        }
        free(items);
        free(logs);
        device_set_close(&set);
    }
}

// Two streams really run at the same time: one blocks until the other opens its gate. This only
// completes if the second stream's work runs while the first stream's work is still running.
static void test_device_streams_concurrent(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 2, 0, 1);
    const DeviceImpl* I = set.impl;
    Gate g1, g2;
    gate_init(&g1);
    gate_init(&g2);
    // same device, two streams
    I->submit(set.dev[0], STREAM_COMPUTE, gate_wait_fn, &g1);
    I->submit(set.dev[0], STREAM_PARAM_UP, gate_open_fn, &g1);
    // two devices
    I->submit(set.dev[0], STREAM_ACT_DOWN, gate_wait_fn, &g2);
    I->submit(set.dev[1], STREAM_ACT_UP, gate_open_fn, &g2);
    I->synchronize(set.dev[0]);
    I->synchronize(set.dev[1]);
    CHECK(t, !gate_timed_out(&g1), "compute and param_up of one device run concurrently");
    CHECK(t, !gate_timed_out(&g2), "streams of two devices run concurrently");
    device_set_close(&set);
    gate_destroy(&g1);
    gate_destroy(&g2);
}

// Several host threads submit to the same stream at once (the engine's workers and optimizer
// thread do): nothing is lost and each thread's items keep their relative order.
#define SUBMITTERS 4
#define SUBMIT_N 300

typedef struct SubmitLog {
    int n;
    int who[SUBMITTERS * SUBMIT_N];
    int idx[SUBMITTERS * SUBMIT_N];
} SubmitLog;

typedef struct SubmitItem {
    SubmitLog* log;
    int who, idx;
} SubmitItem;

typedef struct Submitter {
    const DeviceImpl* impl;
    Device* dev;
    SubmitLog* log;
    SubmitItem items[SUBMIT_N];
    int who;
} Submitter;

static void submit_log_fn(void* arg) {
    SubmitItem* it = arg;
    SubmitLog* log = it->log;
    if (log->n < SUBMITTERS * SUBMIT_N) {
        log->who[log->n] = it->who;
        log->idx[log->n] = it->idx;
        log->n++;
    }
}

static void* submitter_main(void* arg) {
    Submitter* s = arg;
    DevEvent* e = s->impl->event_create(s->dev);
    for (int i = 0; i < SUBMIT_N; i++) {
        s->items[i] = (SubmitItem){.log = s->log, .who = s->who, .idx = i};
        s->impl->submit(s->dev, STREAM_COMPUTE, submit_log_fn, &s->items[i]);
        if (i % 50 == 49) {  // mixes records and host waits of several threads on one stream
            s->impl->event_record(e, s->dev, STREAM_COMPUTE);
            s->impl->event_synchronize(e);
        }
    }
    s->impl->event_destroy(e);
    return NULL;
}

static void test_device_concurrent_submitters(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 1, 5, 3);
    SubmitLog* log = calloc_check(1, sizeof(SubmitLog));
    Submitter* sub = calloc_check(SUBMITTERS, sizeof(Submitter));
    pthread_t th[SUBMITTERS];
    for (int w = 0; w < SUBMITTERS; w++) {
        sub[w] = (Submitter){.impl = set.impl, .dev = set.dev[0], .log = log, .who = w};
        pthread_check(pthread_create(&th[w], NULL, submitter_main, &sub[w]));
    }
    for (int w = 0; w < SUBMITTERS; w++) pthread_check(pthread_join(th[w], NULL));
    set.impl->synchronize(set.dev[0]);
    int next[SUBMITTERS] = {0}, bad = 0;
    for (int k = 0; k < log->n; k++) {
        int w = log->who[k];
        if (w < 0 || w >= SUBMITTERS || log->idx[k] != next[w]) bad++;
        else next[w]++;
    }
    CHECK(t, log->n == SUBMITTERS * SUBMIT_N && bad == 0, "%d items logged, %d out of order",
          log->n, bad);
    device_set_close(&set);
    free(sub);
    free(log);
}

// ----------------------------------------------------------------------------
// events

// A producer on device 0 writes a buffer, downloads it to pinned host memory; the consumer on
// device 1 uploads it and checks it; 1000 rounds through ONE set of buffers, so every
// read-after-write and write-after-read hazard must be ordered by events. With random delays on
// every stream, a missing or wrong wait shows up as a stale or torn read.
#define PIPE_ROUNDS 1000
#define PIPE_N 256

typedef struct PipeFill {
    float* buf;  // (PIPE_N) device 0
    int value;
} PipeFill;

typedef struct PipeCheck {
    const float* buf;  // (PIPE_N) device 1
    int value;
    int* bad;          // rounds that read something else (consumer thread only)
    int* runs;         // checks that ran, in order (consumer thread only)
} PipeCheck;

static void pipe_fill_fn(void* arg) {
    PipeFill* f = arg;
    for (int k = 0; k < PIPE_N; k++) f->buf[k] = (float)f->value + (float)k * 1e-3f;
}

static void pipe_check_fn(void* arg) {
    PipeCheck* c = arg;
    int ok = (*c->runs == c->value);
    for (int k = 0; k < PIPE_N; k++) ok &= c->buf[k] == (float)c->value + (float)k * 1e-3f;
    if (!ok) (*c->bad)++;
    (*c->runs)++;
}

static void run_pipeline(TestCtx* t, int max_delay_us, uint32_t seed) {
    DeviceSet set;
    open_set(&set, 2, max_delay_us, seed);
    const DeviceImpl* I = set.impl;
    Device* d0 = set.dev[0];
    Device* d1 = set.dev[1];
    float* src = I->alloc(d0, PIPE_N * sizeof(float));
    float* host = I->host_alloc(PIPE_N * sizeof(float));
    float* dst = I->alloc(d1, PIPE_N * sizeof(float));
    DevEvent* made = I->event_create(d0);  // src written (d0 compute)
    DevEvent* down = I->event_create(d0);  // src read into host (d0 act_down)
    DevEvent* up = I->event_create(d1);    // host read into dst (d1 act_up)
    DevEvent* used = I->event_create(d1);  // dst read by the check (d1 compute)
    PipeFill* fills = calloc_check(PIPE_ROUNDS, sizeof(PipeFill));
    PipeCheck* checks = calloc_check(PIPE_ROUNDS, sizeof(PipeCheck));
    int bad = 0, runs = 0;
    for (int i = 0; i < PIPE_ROUNDS; i++) {
        fills[i] = (PipeFill){.buf = src, .value = i};
        checks[i] = (PipeCheck){.buf = dst, .value = i, .bad = &bad, .runs = &runs};
        // producer: overwrite src only after the previous download has read it
        I->stream_wait(d0, STREAM_COMPUTE, down);
        I->submit(d0, STREAM_COMPUTE, pipe_fill_fn, &fills[i]);
        I->event_record(made, d0, STREAM_COMPUTE);
        // download: after the write; overwrite host only after the previous upload read it
        I->stream_wait(d0, STREAM_ACT_DOWN, made);
        I->stream_wait(d0, STREAM_ACT_DOWN, up);
        I->copy_d2h(d0, STREAM_ACT_DOWN, host, src, PIPE_N * sizeof(float));
        I->event_record(down, d0, STREAM_ACT_DOWN);
        // upload on the other device: after the download; overwrite dst after the previous check
        I->stream_wait(d1, STREAM_ACT_UP, down);
        I->stream_wait(d1, STREAM_ACT_UP, used);
        I->copy_h2d(d1, STREAM_ACT_UP, dst, host, PIPE_N * sizeof(float));
        I->event_record(up, d1, STREAM_ACT_UP);
        // consumer
        I->stream_wait(d1, STREAM_COMPUTE, up);
        I->submit(d1, STREAM_COMPUTE, pipe_check_fn, &checks[i]);
        I->event_record(used, d1, STREAM_COMPUTE);
    }
    int finished = query_until(I, used, 60.0);
    CHECK(t, finished, "delay %d: the pipeline finishes (no deadlock)", max_delay_us);
    if (!finished) return;  // streams are stuck: leak everything rather than hang or crash
    I->event_synchronize(used);
    CHECK(t, runs == PIPE_ROUNDS && bad == 0, "delay %d seed %u: %d rounds checked, %d stale",
          max_delay_us, seed, runs, bad);
    DeviceStats st0, st1;
    I->stats(d0, &st0);
    I->stats(d1, &st1);
    CHECK(t, st0.bytes[STREAM_ACT_DOWN] == (uint64_t)PIPE_ROUNDS * PIPE_N * sizeof(float),
          "act_down bytes %llu", (unsigned long long)st0.bytes[STREAM_ACT_DOWN]);
    CHECK(t, st1.bytes[STREAM_ACT_UP] == (uint64_t)PIPE_ROUNDS * PIPE_N * sizeof(float),
          "act_up bytes %llu", (unsigned long long)st1.bytes[STREAM_ACT_UP]);
    I->event_destroy(made);
    I->event_destroy(down);
    I->event_destroy(up);
    I->event_destroy(used);
    I->free(d0, src);
    I->free(d1, dst);
    I->host_free(host);
    device_set_close(&set);
    free(fills);
    free(checks);
}

static void test_device_cross_device_pipeline(TestCtx* t) {
    run_pipeline(t, 0, 1);
    run_pipeline(t, 30, 11);
    run_pipeline(t, 30, 12345);
}

// A wait blocks the waiting stream until the capture completes; query reports it.
static void test_device_wait_blocks(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 2, 0, 1);
    const DeviceImpl* I = set.impl;
    Gate g;
    gate_init(&g);
    atomic_int flag = 0;
    DevEvent* e = I->event_create(set.dev[0]);
    I->submit(set.dev[0], STREAM_COMPUTE, gate_wait_fn, &g);
    I->event_record(e, set.dev[0], STREAM_COMPUTE);
    I->stream_wait(set.dev[1], STREAM_ACT_UP, e);
    I->submit(set.dev[1], STREAM_ACT_UP, flag_set_fn, &flag);
    sleep_us(30000);
    CHECK(t, atomic_load(&flag) == 0, "work after a wait ran before the capture completed");
    CHECK(t, I->event_query(e) == 0, "query of a pending capture is 0");
    gate_open(&g);
    CHECK(t, query_until(I, e, 10.0), "capture completes once the gate opens");
    I->synchronize(set.dev[1]);
    CHECK(t, atomic_load(&flag) == 1, "work after the wait ran");
    CHECK(t, I->event_query(e) == 1, "query after completion is 1");
    I->event_destroy(e);
    device_set_close(&set);
    CHECK(t, !gate_timed_out(&g), "gate");
    gate_destroy(&g);
}

// Waiting on (or synchronizing with) a never-recorded event does nothing.
static void test_device_wait_unrecorded_noop(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 1, 0, 1);
    const DeviceImpl* I = set.impl;
    Device* d = set.dev[0];
    Gate g;
    gate_init(&g);
    atomic_int flag = 0;
    DevEvent* never = I->event_create(d);
    DevEvent* done = I->event_create(d);
    CHECK(t, I->event_query(never) == 1, "a never-recorded event counts as complete");
    I->event_synchronize(never);  // returns at once
    // Keep every other stream busy, so a wait that blocked on "anything" would show.
    for (int s = 0; s < STREAM_COUNT; s++)
        if (s != STREAM_ACT_UP) I->submit(d, (StreamKind)s, gate_wait_fn, &g);
    I->stream_wait(d, STREAM_ACT_UP, never);
    I->submit(d, STREAM_ACT_UP, flag_set_fn, &flag);
    I->event_record(done, d, STREAM_ACT_UP);
    CHECK(t, query_until(I, done, 10.0), "work after a wait on a never-recorded event runs");
    CHECK(t, atomic_load(&flag) == 1, "flag set");
    gate_open(&g);
    I->synchronize(d);
    I->event_destroy(never);
    I->event_destroy(done);
    device_set_close(&set);
    CHECK(t, !gate_timed_out(&g), "gate");
    gate_destroy(&g);
}

// A re-record replaces the capture: waits and queries after it refer to the newer work, while a
// wait called BEFORE the re-record keeps waiting only for the older capture.
static void test_device_rerecord(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 2, 0, 1);
    const DeviceImpl* I = set.impl;
    Device* d0 = set.dev[0];
    Device* d1 = set.dev[1];
    Gate g_new, g_old;
    gate_init(&g_new);
    gate_init(&g_old);
    atomic_int flag_new = 0, flag_old = 0;
    DevEvent* e = I->event_create(d0);
    DevEvent* old_done = I->event_create(d1);

    // 1. old capture: empty, completes at once
    I->event_record(e, d0, STREAM_ACT_UP);
    I->event_synchronize(e);
    CHECK(t, I->event_query(e) == 1, "first capture complete");

    // 2. capture A (gated by g_old) and a wait on it from d1 act_down
    I->submit(d0, STREAM_COMPUTE, gate_wait_fn, &g_old);
    I->event_record(e, d0, STREAM_COMPUTE);
    I->stream_wait(d1, STREAM_ACT_DOWN, e);
    I->submit(d1, STREAM_ACT_DOWN, flag_set_fn, &flag_old);
    I->event_record(old_done, d1, STREAM_ACT_DOWN);

    // 3. re-record on another stream behind g_new; a wait after it must see the newer capture
    I->submit(d0, STREAM_PARAM_UP, gate_wait_fn, &g_new);
    I->event_record(e, d0, STREAM_PARAM_UP);
    I->stream_wait(d1, STREAM_GRAD_DOWN, e);
    I->submit(d1, STREAM_GRAD_DOWN, flag_set_fn, &flag_new);

    CHECK(t, I->event_query(e) == 0, "re-recorded event is pending although capture 1 is done");
    sleep_us(20000);
    CHECK(t, atomic_load(&flag_old) == 0 && atomic_load(&flag_new) == 0, "both waits blocked");

    // Open the OLD gate only: the wait made before the re-record completes; the newer one not.
    gate_open(&g_old);
    CHECK(t, query_until(I, old_done, 10.0), "a wait snapshots the record at call time");
    CHECK(t, atomic_load(&flag_old) == 1, "old-capture waiter ran");
    sleep_us(20000);
    CHECK(t, atomic_load(&flag_new) == 0, "new-capture waiter still blocked");
    CHECK(t, I->event_query(e) == 0, "event still pending: its latest capture is not done");

    gate_open(&g_new);
    CHECK(t, query_until(I, e, 10.0), "latest capture completes");
    I->synchronize(d1);
    CHECK(t, atomic_load(&flag_new) == 1, "new-capture waiter ran");
    I->event_destroy(e);
    I->event_destroy(old_done);
    device_set_close(&set);
    CHECK(t, !gate_timed_out(&g_new) && !gate_timed_out(&g_old), "gates");
    gate_destroy(&g_new);
    gate_destroy(&g_old);
}

// Records of one event on two streams completing out of order: the latest record decides.
static void test_device_rerecord_out_of_order(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 1, 0, 1);
    const DeviceImpl* I = set.impl;
    Device* d = set.dev[0];
    Gate g;
    gate_init(&g);
    DevEvent* e = I->event_create(d);
    I->submit(d, STREAM_COMPUTE, gate_wait_fn, &g);
    I->event_record(e, d, STREAM_COMPUTE);    // older capture, blocked
    I->event_record(e, d, STREAM_GRAD_DOWN);  // newer capture, empty
    CHECK(t, query_until(I, e, 10.0), "the newest capture alone decides completion");
    gate_open(&g);
    I->synchronize(d);
    CHECK(t, I->event_query(e) == 1, "still complete after the older marker ran");
    I->event_destroy(e);
    device_set_close(&set);
    CHECK(t, !gate_timed_out(&g), "gate");
    gate_destroy(&g);
}

// The host blocks in event_synchronize until the captured work is done, and then sees its
// writes (plain memory: ThreadSanitizer checks the happens-before).
typedef struct SlowWrite {
    int value;
    double done_at;
} SlowWrite;

static void slow_write_fn(void* arg) {
    SlowWrite* w = arg;
    sleep_us(20000);
    w->value = 42;
    w->done_at = time_now_s();
}

static void test_device_event_synchronize_host(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 1, 0, 1);
    const DeviceImpl* I = set.impl;
    Device* d = set.dev[0];
    SlowWrite w = {0, 0.0};
    DevEvent* e = I->event_create(d);
    I->submit(d, STREAM_PARAM_UP, slow_write_fn, &w);
    I->event_record(e, d, STREAM_PARAM_UP);
    CHECK(t, I->event_query(e) == 0, "query while the work sleeps is 0");
    I->event_synchronize(e);
    double now = time_now_s();
    CHECK(t, w.value == 42 && w.done_at > 0.0 && w.done_at <= now,
          "host saw the write after synchronize");
    CHECK(t, I->event_query(e) == 1, "query after synchronize is 1");
    I->event_synchronize(e);  // again: returns at once
    I->event_destroy(e);
    device_set_close(&set);
}

// ----------------------------------------------------------------------------
// memory, copies, stats

static void test_device_memory_accounting(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 2, 0, 1);
    const DeviceImpl* I = set.impl;
    Device* d = set.dev[0];
    DeviceStats st;
    unsigned char* a = I->alloc(d, 1000);
    unsigned char* b = I->alloc(d, 3000);
    int zero = 1;
    for (int i = 0; i < 1000; i++) zero &= a[i] == 0;
    for (int i = 0; i < 3000; i++) zero &= b[i] == 0;
    CHECK(t, zero, "device memory is zeroed");
    CHECK(t, ((uintptr_t)a % 64) == 0 && ((uintptr_t)b % 64) == 0, "64-byte aligned");
    memset(a, 0xab, 1000);  // the whole block is usable
    memset(b, 0xcd, 3000);
    I->stats(d, &st);
    CHECK(t, st.mem_in_use == 4000 && st.mem_peak == 4000, "in use %zu peak %zu", st.mem_in_use,
          st.mem_peak);
    I->free(d, a);
    I->stats(d, &st);
    CHECK(t, st.mem_in_use == 3000 && st.mem_peak == 4000, "after free: in use %zu peak %zu",
          st.mem_in_use, st.mem_peak);
    unsigned char* c = I->alloc(d, 500);
    void* z = I->alloc(d, 0);
    CHECK(t, c != NULL && z != NULL, "small and empty allocations");
    I->stats(d, &st);
    CHECK(t, st.mem_in_use == 3500 && st.mem_peak == 4000, "in use %zu peak %zu", st.mem_in_use,
          st.mem_peak);
    I->free(d, b);
    I->free(d, c);
    I->free(d, z);
    I->free(d, NULL);
    I->stats(d, &st);
    CHECK(t, st.mem_in_use == 0 && st.mem_peak == 4000, "all freed: in use %zu peak %zu",
          st.mem_in_use, st.mem_peak);
    I->stats(set.dev[1], &st);
    CHECK(t, st.mem_in_use == 0 && st.mem_peak == 0, "other device untouched");

    unsigned char* h = I->host_alloc(100);
    CHECK(t, ((uintptr_t)h % 64) == 0, "host memory aligned");
    memset(h, 1, 100);
    I->host_free(h);
    I->host_free(NULL);
    device_set_close(&set);
}

// Allocation and free from several threads at once keep the counters exact.
typedef struct AllocWorker {
    const DeviceImpl* impl;
    Device* dev;
    uint32_t seed;
} AllocWorker;

static void* alloc_worker_main(void* arg) {
    AllocWorker* w = arg;
    Rng r;
    rng_seed(&r, w->seed);
    void* held[8] = {0};
    for (int i = 0; i < 400; i++) {
        int k = (int)rng_below(&r, 8);
        if (held[k]) {
            w->impl->free(w->dev, held[k]);
            held[k] = NULL;
        } else {
            held[k] = w->impl->alloc(w->dev, 1 + (size_t)rng_below(&r, 5000));
        }
    }
    for (int k = 0; k < 8; k++) w->impl->free(w->dev, held[k]);
    return NULL;
}

static void test_device_memory_threads(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 1, 0, 1);
    AllocWorker w[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (AllocWorker){.impl = set.impl, .dev = set.dev[0], .seed = 100u + (uint32_t)i};
        pthread_check(pthread_create(&th[i], NULL, alloc_worker_main, &w[i]));
    }
    for (int i = 0; i < 4; i++) pthread_check(pthread_join(th[i], NULL));
    DeviceStats st;
    set.impl->stats(set.dev[0], &st);
    CHECK(t, st.mem_in_use == 0 && st.mem_peak > 0, "in use %zu peak %zu", st.mem_in_use,
          st.mem_peak);
    device_set_close(&set);
}

// Exceeding DeviceOptions.mem_limit is fatal with a message and a hint (checked in a child
// process, since fatal() exits).
static void test_device_out_of_memory(TestCtx* t) {
    int pipefd[2];
    if (pipe(pipefd) != 0) fatal("pipe failed");
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) fatal("fork failed");
    if (pid == 0) {
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        close(pipefd[1]);
        DeviceOptions opt = {.threads = 1, .mem_limit = 4096};
        DeviceSet set;
        device_set_open(&set, &device_cpu_impl, 1, &opt);
        void* ok = set.impl->alloc(set.dev[0], 4000);  // fits
        (void)ok;
        set.impl->alloc(set.dev[0], 200);  // does not: fatal, exit(1)
        _exit(0);  // not reached when the limit works
    }
    close(pipefd[1]);
    char err[4096];
    size_t len = 0;
    ssize_t got;
    while ((got = read(pipefd[0], err + len, sizeof err - 1 - len)) > 0) len += (size_t)got;
    err[len] = '\0';
    close(pipefd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(t, WIFEXITED(status) && WEXITSTATUS(status) != 0, "over-limit allocation exits non-zero");
    CHECK(t, strstr(err, "device cpu:0 out of memory") != NULL && strstr(err, "HINT") != NULL,
          "message: %s", err);
}

static void test_device_copies_memset(TestCtx* t) {
    for (int delay = 0; delay <= 50; delay += 50) {
        DeviceSet set;
        open_set(&set, 1, delay, 99);
        const DeviceImpl* I = set.impl;
        Device* d = set.dev[0];
        const size_t n = 1000, bytes = n * sizeof(float);
        float* h_in = I->host_alloc(bytes);
        float* h_out = I->host_alloc(bytes);
        for (size_t i = 0; i < n; i++) {
            h_in[i] = (float)i + 0.5f;
            h_out[i] = -1.0f;
        }
        float* buf = I->alloc(d, bytes);
        DevEvent* uploaded = I->event_create(d);
        DevEvent* zeroed = I->event_create(d);
        I->copy_h2d(d, STREAM_ACT_UP, buf, h_in, bytes);
        I->event_record(uploaded, d, STREAM_ACT_UP);
        I->stream_wait(d, STREAM_COMPUTE, uploaded);
        I->memset_zero(d, STREAM_COMPUTE, buf + 100, 50 * sizeof(float));
        I->memset_zero(d, STREAM_COMPUTE, buf, 0);  // empty: fine
        I->event_record(zeroed, d, STREAM_COMPUTE);
        I->stream_wait(d, STREAM_ACT_DOWN, zeroed);
        I->copy_d2h(d, STREAM_ACT_DOWN, h_out, buf, bytes);
        I->copy_d2h(d, STREAM_ACT_DOWN, h_out, buf, 0);
        I->synchronize(d);
        int bad = 0;
        for (size_t i = 0; i < n; i++) {
            float want = (i >= 100 && i < 150) ? 0.0f : (float)i + 0.5f;
            bad += h_out[i] != want;
        }
        CHECK(t, bad == 0, "delay %d: %d wrong elements after upload, memset, download", delay,
              bad);
        DeviceStats st;
        I->stats(d, &st);
        CHECK(t, st.bytes[STREAM_ACT_UP] == bytes && st.bytes[STREAM_ACT_DOWN] == bytes &&
                     st.bytes[STREAM_COMPUTE] == 0 && st.bytes[STREAM_PARAM_UP] == 0,
              "bytes per stream: up %llu down %llu compute %llu",
              (unsigned long long)st.bytes[STREAM_ACT_UP],
              (unsigned long long)st.bytes[STREAM_ACT_DOWN],
              (unsigned long long)st.bytes[STREAM_COMPUTE]);
        I->event_destroy(uploaded);
        I->event_destroy(zeroed);
        I->free(d, buf);
        I->host_free(h_in);
        I->host_free(h_out);
        device_set_close(&set);
    }
}

// Busy time counts work, not waiting.
static void sleep_20ms_fn(void* arg) {
    (void)arg;
    sleep_us(20000);
}

static void test_device_busy_stats(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 1, 0, 1);
    const DeviceImpl* I = set.impl;
    Device* d = set.dev[0];
    DevEvent* e = I->event_create(d);
    I->submit(d, STREAM_COMPUTE, sleep_20ms_fn, NULL);
    I->event_record(e, d, STREAM_COMPUTE);
    I->stream_wait(d, STREAM_GRAD_DOWN, e);  // waits ~20 ms, idle
    I->synchronize(d);
    DeviceStats st;
    I->stats(d, &st);
    CHECK(t, st.busy_s[STREAM_COMPUTE] >= 0.015, "compute busy %.4fs", st.busy_s[STREAM_COMPUTE]);
    CHECK(t, st.busy_s[STREAM_GRAD_DOWN] < 0.010, "waiting is not busy: %.4fs",
          st.busy_s[STREAM_GRAD_DOWN]);
    I->event_destroy(e);
    device_set_close(&set);
}

// ----------------------------------------------------------------------------
// fault injection: a two-device matmul pipeline gives bit-identical results with any delays

#define FI_M 6   // micro-batches
#define FI_N 8   // rows per micro-batch
#define FI_C 16  // width

typedef struct MatmulJob {
    const Ops* ops;
    void* ctx;
    float* out;      // (FI_N, FI_C)
    const float* in; // (FI_N, FI_C)
    const float* w;  // (FI_C, FI_C)
} MatmulJob;

static void matmul_job_fn(void* arg) {
    MatmulJob* j = arg;
    j->ops->matmul_forward(j->ctx, j->out, j->in, j->w, NULL, FI_N, FI_C, FI_C);
}

// y_m = (x_m · W0ᵀ) · W1ᵀ, stage 0 on device 0 and stage 1 on device 1, through pinned host memory.
static void run_fi_pipeline(int max_delay_us, uint32_t seed, const float* x, const float* w0,
                            const float* w1, float* y, DeviceStats* st_out) {
    DeviceSet set;
    open_set(&set, 2, max_delay_us, seed);
    const DeviceImpl* I = set.impl;
    const size_t act = FI_N * FI_C * sizeof(float), wb = FI_C * FI_C * sizeof(float);
    float* dw[2];
    float* din[2][FI_M];
    float* dout[2][FI_M];
    float* mid = I->host_alloc(FI_M * act);  // (FI_M, FI_N, FI_C) pinned, stage 0 -> stage 1
    MatmulJob jobs[2][FI_M];
    DevEvent* w_up[2];
    DevEvent* ev_up[2][FI_M];
    DevEvent* ev_done[2][FI_M];
    DevEvent* ev_down[2][FI_M];
    for (int s = 0; s < 2; s++) {
        Device* d = set.dev[s];
        dw[s] = I->alloc(d, wb);
        w_up[s] = I->event_create(d);
        I->copy_h2d(d, STREAM_PARAM_UP, dw[s], s == 0 ? w0 : w1, wb);
        I->event_record(w_up[s], d, STREAM_PARAM_UP);
        I->stream_wait(d, STREAM_COMPUTE, w_up[s]);
        for (int m = 0; m < FI_M; m++) {
            din[s][m] = I->alloc(d, act);
            dout[s][m] = I->alloc(d, act);
            ev_up[s][m] = I->event_create(d);
            ev_done[s][m] = I->event_create(d);
            ev_down[s][m] = I->event_create(d);
        }
    }
    for (int m = 0; m < FI_M; m++) {
        for (int s = 0; s < 2; s++) {
            Device* d = set.dev[s];
            const float* src = s == 0 ? x + (size_t)m * FI_N * FI_C : mid + (size_t)m * FI_N * FI_C;
            float* dst = s == 0 ? mid + (size_t)m * FI_N * FI_C : y + (size_t)m * FI_N * FI_C;
            if (s == 1) I->stream_wait(d, STREAM_ACT_UP, ev_down[0][m]);  // cross-device
            I->copy_h2d(d, STREAM_ACT_UP, din[s][m], src, act);
            I->event_record(ev_up[s][m], d, STREAM_ACT_UP);
            I->stream_wait(d, STREAM_COMPUTE, ev_up[s][m]);
            jobs[s][m] = (MatmulJob){.ops = I->ops(d), .ctx = I->ops_ctx(d), .out = dout[s][m],
                                     .in = din[s][m], .w = dw[s]};
            I->submit(d, STREAM_COMPUTE, matmul_job_fn, &jobs[s][m]);
            I->event_record(ev_done[s][m], d, STREAM_COMPUTE);
            I->stream_wait(d, STREAM_ACT_DOWN, ev_done[s][m]);
            I->copy_d2h(d, STREAM_ACT_DOWN, dst, dout[s][m], act);
            I->event_record(ev_down[s][m], d, STREAM_ACT_DOWN);
        }
    }
    I->event_synchronize(ev_down[1][FI_M - 1]);
    I->stats(set.dev[0], st_out);
    for (int s = 0; s < 2; s++) {
        Device* d = set.dev[s];
        for (int m = 0; m < FI_M; m++) {
            I->event_destroy(ev_up[s][m]);
            I->event_destroy(ev_done[s][m]);
            I->event_destroy(ev_down[s][m]);
            I->free(d, din[s][m]);
            I->free(d, dout[s][m]);
        }
        I->event_destroy(w_up[s]);
        I->free(d, dw[s]);
    }
    I->host_free(mid);
    device_set_close(&set);
}

static void test_device_fault_injection_identical(TestCtx* t) {
    const size_t n_act = (size_t)FI_M * FI_N * FI_C;
    float* x = malloc_check(n_act * sizeof(float));
    float* w0 = malloc_check(FI_C * FI_C * sizeof(float));
    float* w1 = malloc_check(FI_C * FI_C * sizeof(float));
    float* y_ref = malloc_check(n_act * sizeof(float));
    float* y = malloc_check(n_act * sizeof(float));
    Rng r;
    rng_seed(&r, 5);
    for (size_t i = 0; i < n_act; i++) x[i] = rng_normal(&r);
    for (int i = 0; i < FI_C * FI_C; i++) {
        w0[i] = 0.25f * rng_normal(&r);
        w1[i] = 0.25f * rng_normal(&r);
    }
    DeviceStats st;
    run_fi_pipeline(0, 0, x, w0, w1, y_ref, &st);
    CHECK(t, st.busy_s[STREAM_COMPUTE] > 0.0, "compute busy time measured");
    // plain double-precision reference
    double max_err = 0.0;
    for (size_t row = 0; row < (size_t)FI_M * FI_N; row++) {
        double h[FI_C];
        for (int o = 0; o < FI_C; o++) {
            h[o] = 0.0;
            for (int i = 0; i < FI_C; i++) h[o] += (double)x[row * FI_C + i] * w0[o * FI_C + i];
        }
        for (int o = 0; o < FI_C; o++) {
            double v = 0.0;
            for (int i = 0; i < FI_C; i++) v += (double)(float)h[i] * w1[o * FI_C + i];
            double e = fabs(v - (double)y_ref[row * FI_C + o]);
            if (e > max_err) max_err = e;
        }
    }
    CHECK(t, max_err < 1e-4, "pipeline matches the reference: max error %.3g", max_err);
    const uint32_t seeds[] = {1, 2, 3};
    for (int k = 0; k < 3; k++) {
        memset(y, 0, n_act * sizeof(float));
        run_fi_pipeline(200, seeds[k], x, w0, w1, y, &st);
        CHECK(t, memcmp(y, y_ref, n_act * sizeof(float)) == 0,
              "delays seed %u: result differs from the undelayed run", seeds[k]);
    }
    free(x);
    free(w0);
    free(w1);
    free(y_ref);
    free(y);
}

// ----------------------------------------------------------------------------
// close

typedef struct Counter {
    int n;  // written by one stream thread only; read after close (the join orders it)
} Counter;

static void counter_inc_fn(void* arg) { ((Counter*)arg)->n++; }

static void test_device_close_drains(TestCtx* t) {
    DeviceSet set;
    open_set(&set, 2, 200, 77);
    const DeviceImpl* I = set.impl;
    Counter c0 = {0}, c1 = {0};
    const size_t n = 4096, bytes = n * sizeof(float);
    // The copies are still pending when the set closes, so their buffers must outlive the
    // devices: host buffers serve as both ends (on the CPU a copy is a memcpy either way).
    float* h_in = I->host_alloc(bytes);
    float* h_mid = I->host_alloc(bytes);
    float* h_out = I->host_alloc(bytes);
    for (size_t i = 0; i < n; i++) {
        h_in[i] = (float)i;
        h_mid[i] = 0.0f;
        h_out[i] = 0.0f;
    }
    for (int i = 0; i < 50; i++) I->submit(set.dev[0], STREAM_COMPUTE, counter_inc_fn, &c0);
    // Events destroyed right after use, with their markers still queued, must stay valid.
    DevEvent* e = I->event_create(set.dev[0]);
    I->event_record(e, set.dev[0], STREAM_COMPUTE);
    I->stream_wait(set.dev[1], STREAM_ACT_UP, e);
    I->event_destroy(e);
    I->copy_h2d(set.dev[1], STREAM_ACT_UP, h_mid, h_in, bytes);
    DevEvent* e2 = I->event_create(set.dev[1]);
    I->event_record(e2, set.dev[1], STREAM_ACT_UP);
    I->stream_wait(set.dev[1], STREAM_ACT_DOWN, e2);
    I->event_destroy(e2);
    I->copy_d2h(set.dev[1], STREAM_ACT_DOWN, h_out, h_mid, bytes);
    I->submit(set.dev[1], STREAM_ACT_DOWN, counter_inc_fn, &c1);
    device_set_close(&set);  // no synchronize: close must drain everything above
    CHECK(t, c0.n == 50, "device 0 ran %d of 50 pending items before close returned", c0.n);
    CHECK(t, c1.n == 1, "device 1 ran its pending item: %d", c1.n);
    int bad = 0;
    for (size_t i = 0; i < n; i++) bad += h_out[i] != (float)i;
    CHECK(t, bad == 0, "pending copies ran in order: %d wrong", bad);
    device_cpu_impl.host_free(h_in);
    device_cpu_impl.host_free(h_mid);
    device_cpu_impl.host_free(h_out);
}

// ----------------------------------------------------------------------------

const TestCase tests_device[] = {
    {"device_set_open_close", test_device_set_open_close},
    {"device_in_order", test_device_in_order},
    {"device_streams_concurrent", test_device_streams_concurrent},
    {"device_concurrent_submitters", test_device_concurrent_submitters},
    {"device_cross_device_pipeline", test_device_cross_device_pipeline},
    {"device_wait_blocks", test_device_wait_blocks},
    {"device_wait_unrecorded_noop", test_device_wait_unrecorded_noop},
    {"device_rerecord", test_device_rerecord},
    {"device_rerecord_out_of_order", test_device_rerecord_out_of_order},
    {"device_event_synchronize_host", test_device_event_synchronize_host},
    {"device_memory_accounting", test_device_memory_accounting},
    {"device_memory_threads", test_device_memory_threads},
    {"device_out_of_memory", test_device_out_of_memory},
    {"device_copies_memset", test_device_copies_memset},
    {"device_busy_stats", test_device_busy_stats},
    {"device_fault_injection_identical", test_device_fault_injection_identical},
    {"device_close_drains", test_device_close_drains},
    {NULL, NULL},
};
