/*
 * comm_emul.c — the emulated communicator (comm.h): W ranks are threads of one process sharing a
 * CommEmulWorld, for CPU runs, CI and ThreadSanitizer. Same semantics as NCCL where comm.h states
 * them, plus checks NCCL cannot make (every rank's op matches rank 0's) and fault injection (a
 * rank that hangs, a rank that dies) so timeouts and aborts are tested.
 *
 * One op (or group) on rank r:
 *   1. publish its ops in slot[r] and wait at the world barrier (all ranks arrived: everyone's
 *      send buffer is complete, the barrier's mutex orders their writes before our reads);
 *   2. check the ops against rank 0's, compute r's outputs from every rank's send buffer into
 *      private temporaries (in the documented rank order: comm_reference_sum);
 *   3. wait at the barrier again (nobody reads a send buffer any more), then copy the
 *      temporaries into recv (in-place ops are safe: a rank's recv is written only now).
 * Each rank computes its own outputs, so the ranks' threads share the work.
 *
 * Failure: a barrier waits at most the timeout; the rank that gives up names the ranks that did
 * not arrive and aborts the world, so every other waiting rank fails at once with that message.
 * A dying rank aborts the world naming itself (as NCCL reports a peer's closed connection); a
 * hanging one just stops arriving (the others time out). An aborted world fails every later op.
 *
 * Ops enqueued on a stream of a CPU-emulated device run as a host function on the stream's
 * thread, in stream order (device.h allows it to block there).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"

// ----------------------------------------------------------------------------
// types

typedef struct EmulSlot {
    const CommOp* ops;  // the rank's current op group (valid between its barriers)
    int n;
} EmulSlot;

struct CommEmulWorld {
    int world;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;   // barrier generation: completes when all ranks arrived
    int count;      // ranks arrived in the current generation
    int* here;      // here[r]: rank r arrived in the current generation
    int* joined;    // rank r ran init (a second init of the same rank is refused)
    int aborted;
    char why[ERR_LEN];
    EmulSlot* slot;
};

typedef struct CommEmul {
    Comm base;  // first: a Comm* is a CommEmul*
    CommEmulWorld* w;
    CommFault fault;
    uint64_t fault_at;
} CommEmul;

// ----------------------------------------------------------------------------
// the world

CommEmulWorld* comm_emul_world_create(int world) {
    if (world < 1) fatal("comm_emul_world_create: world size %d < 1", world);
    CommEmulWorld* w = calloc_check(1, sizeof *w);
    w->world = world;
    pthread_check(pthread_mutex_init(&w->mu, NULL));
    pthread_check(pthread_cond_init(&w->cv, NULL));
    w->here = calloc_check((size_t)world, sizeof(int));
    w->joined = calloc_check((size_t)world, sizeof(int));
    w->slot = calloc_check((size_t)world, sizeof(EmulSlot));
    return w;
}

void comm_emul_world_destroy(CommEmulWorld* w) {
    if (!w) return;
    pthread_check(pthread_cond_destroy(&w->cv));
    pthread_check(pthread_mutex_destroy(&w->mu));
    free(w->here);
    free(w->joined);
    free(w->slot);
    free(w);
}

// Abort the world (under w->mu) with the first reason; wakes every waiting rank.
static void world_abort_locked(CommEmulWorld* w, const char* why) {
    if (!w->aborted) {
        w->aborted = 1;
        str_copy(w->why, sizeof w->why, why);
    }
    pthread_check(pthread_cond_broadcast(&w->cv));
}

static void deadline_after(struct timespec* ts, double s) {
    clock_gettime(CLOCK_REALTIME, ts);
    const double ns = (double)ts->tv_nsec + s * 1e9;
    ts->tv_sec += (time_t)(ns / 1e9);
    ts->tv_nsec = (long)(ns - (double)(time_t)(ns / 1e9) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

// "2" or "1, 3": the ranks whose here[] is 0 (under w->mu).
static void missing_ranks(const CommEmulWorld* w, char* buf, size_t cap, int* n_missing) {
    size_t len = 0;
    buf[0] = '\0';
    *n_missing = 0;
    for (int q = 0; q < w->world; q++) {
        if (w->here[q]) continue;
        if (len + 16 >= cap) {
            snprintf(buf + len, cap - len, ", ...");
            break;
        }
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", *n_missing ? ", " : "", q);
        (*n_missing)++;
    }
}

// All ranks meet. 0 when everyone arrived; -1 (failure recorded in the comm) on timeout, on an
// aborted world, or when the world aborts while waiting. what names the op in messages.
// through_abort: the second barrier of an op, which every rank reaches once the first one
// completed (nothing between them blocks): it ignores an abort, so no rank leaves the op (and
// frees or reuses its buffers) while another still reads them.
static int world_barrier(CommEmul* e, const char* what, int through_abort) {
    CommEmulWorld* w = e->w;
    Comm* c = &e->base;
    struct timespec deadline;
    deadline_after(&deadline, c->timeout_s);
    pthread_check(pthread_mutex_lock(&w->mu));
    if (w->aborted && !through_abort) {
        char why[ERR_LEN];
        str_copy(why, sizeof why, w->why);
        pthread_check(pthread_mutex_unlock(&w->mu));
        return comm_fail(c, "%s: the communicator was aborted (%s)", what, why);
    }
    const uint64_t gen = w->gen;
    w->here[c->rank] = 1;
    if (++w->count == w->world) {
        w->count = 0;
        memset(w->here, 0, (size_t)w->world * sizeof(int));
        w->gen++;
        pthread_check(pthread_cond_broadcast(&w->cv));
        pthread_check(pthread_mutex_unlock(&w->mu));
        return 0;
    }
    while (w->gen == gen && (through_abort || !w->aborted)) {
        const int rc = pthread_cond_timedwait(&w->cv, &w->mu, &deadline);
        if (rc == ETIMEDOUT && w->gen == gen && (through_abort || !w->aborted)) {
            char miss[256], why[ERR_LEN];
            int n_missing = 0;
            missing_ranks(w, miss, sizeof miss, &n_missing);
            snprintf(why, sizeof why, "%s timed out after %.1f s on rank %d: rank%s %s did not "
                     "arrive", what, c->timeout_s, c->rank, n_missing > 1 ? "s" : "", miss);
            world_abort_locked(w, why);
            pthread_check(pthread_mutex_unlock(&w->mu));
            return comm_fail(c, "%s (--dist-timeout)", why);
        }
        if (rc != 0 && rc != ETIMEDOUT) fatal("pthread_cond_timedwait failed (errno %d)", rc);
    }
    if (w->gen != gen) {  // everyone arrived (an abort after that concerns the next op)
        pthread_check(pthread_mutex_unlock(&w->mu));
        return 0;
    }
    char why[ERR_LEN];
    str_copy(why, sizeof why, w->why);
    pthread_check(pthread_mutex_unlock(&w->mu));
    return comm_fail(c, "%s failed: %s", what, why);
}

// ----------------------------------------------------------------------------
// fault injection

void comm_emul_inject(Comm* c, CommFault fault, uint64_t at_op) {
    if (c->impl != &comm_emul_impl) fatal("comm_emul_inject: not an emulated communicator");
    CommEmul* e = (CommEmul*)c;
    e->fault = fault;
    e->fault_at = at_op;
}

// The armed fault, when this op is the one: -1 (the op fails on this rank), else 0.
static int fault_fire(CommEmul* e, const char* what) {
    Comm* c = &e->base;
    if (e->fault == COMM_FAULT_NONE || atomic_load(&c->n_ops) != e->fault_at) return 0;
    CommEmulWorld* w = e->w;
    const CommFault f = e->fault;
    e->fault = COMM_FAULT_NONE;
    pthread_check(pthread_mutex_lock(&w->mu));
    if (f == COMM_FAULT_DIE) {
        char why[ERR_LEN];
        snprintf(why, sizeof why, "rank %d died at %s (injected fault)", c->rank, what);
        world_abort_locked(w, why);
        pthread_check(pthread_mutex_unlock(&w->mu));
        return comm_fail(c, "%s", why);
    }
    // hang: stop responding until the others give up and abort the world (bounded, so a broken
    // test cannot hang the suite)
    struct timespec deadline;
    deadline_after(&deadline, 4 * c->timeout_s + 1.0);
    int rc = 0;
    while (!w->aborted && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&w->cv, &w->mu, &deadline);
        if (rc != 0 && rc != ETIMEDOUT) fatal("pthread_cond_timedwait failed (errno %d)", rc);
    }
    pthread_check(pthread_mutex_unlock(&w->mu));
    return comm_fail(c, "hung at %s (injected fault)", what);
}

// ----------------------------------------------------------------------------
// ops

static size_t out_count(const CommOp* op, int world) {
    return op->kind == COMM_ALL_GATHER ? op->count * (size_t)world : op->count;
}

// "all_reduce of 100 f32 elements"
static void describe(const CommOp* op, char* buf, size_t cap) {
    snprintf(buf, cap, "%s of %zu %s elements", comm_op_names[op->kind], op->count,
             op->dtype == COMM_BF16 ? "bf16" : "f32");
    if (op->kind == COMM_BROADCAST) {
        const size_t len = strlen(buf);
        snprintf(buf + len, cap - len, " from rank %d", op->root);
    }
}

// rank r's output of op i of the group, from every rank's send buffer (after barrier 1).
static void compute_output(const CommEmulWorld* w, int rank, int i, void* out) {
    const CommOp* op = &w->slot[rank].ops[i];
    const size_t es = comm_dtype_size(op->dtype);
    const int W = w->world;
    switch (op->kind) {
    case COMM_ALL_REDUCE:
    case COMM_REDUCE_SCATTER: {
        const void** in = malloc_check((size_t)W * sizeof(void*));
        const size_t off = op->kind == COMM_REDUCE_SCATTER ? (size_t)rank * op->count * es : 0;
        for (int q = 0; q < W; q++) in[q] = (const char*)w->slot[q].ops[i].send + off;
        comm_reference_sum(in, W, op->count, op->dtype, out);
        free(in);
        break;
    }
    case COMM_ALL_GATHER:
        for (int q = 0; q < W; q++)
            memcpy((char*)out + (size_t)q * op->count * es, w->slot[q].ops[i].send, op->count * es);
        break;
    case COMM_BROADCAST:
        memcpy(out, w->slot[op->root].ops[i].send, op->count * es);
        break;
    default:
        break;
    }
}

// Run a group of ops on this rank, now, on the calling thread.
static int emul_exec(CommEmul* e, const CommOp* ops, int n) {
    Comm* c = &e->base;
    CommEmulWorld* w = e->w;
    char what[160], mine[96], theirs[96];
    snprintf(what, sizeof what, "%s (op #%llu)", comm_op_names[ops[0].kind],
             (unsigned long long)atomic_load(&c->n_ops));
    if (fault_fire(e, what) != 0) return -1;
    pthread_check(pthread_mutex_lock(&w->mu));
    w->slot[c->rank] = (EmulSlot){.ops = ops, .n = n};
    pthread_check(pthread_mutex_unlock(&w->mu));
    if (world_barrier(e, what, 0) != 0) return -1;
    // every rank must have issued the same group (checked against every rank, not only rank 0:
    // computing reads the other ranks' ops, which must exist)
    for (int q = 0; q < w->world; q++) {
        const EmulSlot* o = &w->slot[q];
        int bad = -1;
        for (int i = 0; bad < 0 && i < n && i < o->n; i++) {
            const CommOp* a = &ops[i];
            const CommOp* b = &o->ops[i];
            if (a->kind != b->kind || a->dtype != b->dtype || a->count != b->count ||
                (a->kind == COMM_BROADCAST && a->root != b->root))
                bad = i;
        }
        if (bad < 0 && o->n == n) continue;
        char why[ERR_LEN];
        if (bad < 0) {
            snprintf(why, sizeof why, "%s: rank %d issued a group of %d op(s), rank %d one of %d",
                     what, c->rank, n, q, o->n);
        } else {
            describe(&ops[bad], mine, sizeof mine);
            describe(&o->ops[bad], theirs, sizeof theirs);
            snprintf(why, sizeof why, "%s: rank %d issued %s, rank %d %s (every rank must issue "
                     "the same ops in the same order)", what, c->rank, mine, q, theirs);
        }
        pthread_check(pthread_mutex_lock(&w->mu));
        world_abort_locked(w, why);
        pthread_check(pthread_mutex_unlock(&w->mu));
        comm_fail(c, "%s", why);
        char done[200];
        snprintf(done, sizeof done, "%s, after the mismatch", what);
        world_barrier(e, done, 1);  // the others may still be reading this rank's slot
        return -1;
    }
    void** tmp = calloc_check((size_t)n, sizeof(void*));
    for (int i = 0; i < n; i++) {
        const size_t bytes = out_count(&ops[i], w->world) * comm_dtype_size(ops[i].dtype);
        tmp[i] = malloc_check(bytes > 0 ? bytes : 1);
        compute_output(w, c->rank, i, tmp[i]);
    }
    char done[200];
    snprintf(done, sizeof done, "%s, after reading", what);
    int rc = world_barrier(e, done, 1);
    for (int i = 0; i < n; i++) {
        const size_t bytes = out_count(&ops[i], w->world) * comm_dtype_size(ops[i].dtype);
        if (rc == 0 && bytes > 0) memcpy(ops[i].recv, tmp[i], bytes);
        free(tmp[i]);
    }
    free(tmp);
    atomic_fetch_add(&c->n_ops, (uint64_t)n);
    return rc;
}

typedef struct EmulJob {
    CommEmul* e;
    int n;
    CommOp ops[];  // a copy: the caller's array may be gone when the stream gets here
} EmulJob;

static void emul_job_fn(void* arg) {
    EmulJob* j = arg;
    Comm* c = &j->e->base;
    char buf[8];
    if (comm_error(c, buf, sizeof buf) == NULL) emul_exec(j->e, j->ops, j->n);  // sticky failure
    free(j);
}

static int emul_run(Comm* c, const CommOp* ops, int n, const CommStream* st) {
    CommEmul* e = (CommEmul*)c;
    if (st == NULL) return emul_exec(e, ops, n);
    if (st->impl != &device_cpu_impl)
        return comm_fail(c, "the emulated communicator runs on CPU-emulated devices, not on "
                         "'%s' ones", st->impl->name);
    EmulJob* j = malloc_check(sizeof *j + (size_t)n * sizeof(CommOp));
    j->e = e;
    j->n = n;
    memcpy(j->ops, ops, (size_t)n * sizeof(CommOp));
    st->impl->host_fn(st->dev, st->stream, emul_job_fn, j);
    return 0;
}

static int emul_barrier(Comm* c) {
    CommEmul* e = (CommEmul*)c;
    char what[64];
    snprintf(what, sizeof what, "barrier (op #%llu)", (unsigned long long)atomic_load(&c->n_ops));
    if (fault_fire(e, what) != 0) return -1;
    const int rc = world_barrier(e, what, 0);
    atomic_fetch_add(&c->n_ops, 1);
    return rc;
}

// ----------------------------------------------------------------------------
// lifecycle, poll, abort

static Comm* emul_init(const CommInit* in, char* err) {
    CommEmulWorld* w = in->local;
    if (w == NULL) {
        errorf(err, "emulated communicator: no world (CommInit.local)");
        return NULL;
    }
    if (in->world != w->world || in->rank < 0 || in->rank >= in->world) {
        errorf(err, "emulated communicator: rank %d of world %d does not fit the world of %d",
               in->rank, in->world, w->world);
        return NULL;
    }
    if (!(in->timeout_s > 0)) {
        errorf(err, "emulated communicator: timeout %.3g s must be > 0", in->timeout_s);
        return NULL;
    }
    pthread_check(pthread_mutex_lock(&w->mu));
    const int twice = w->joined[in->rank];
    w->joined[in->rank] = 1;
    pthread_check(pthread_mutex_unlock(&w->mu));
    if (twice) {
        errorf(err, "emulated communicator: rank %d joined twice", in->rank);
        return NULL;
    }
    CommEmul* e = calloc_check(1, sizeof *e);
    comm_base_init(&e->base, &comm_emul_impl, in->rank, in->world, in->timeout_s);
    e->w = w;
    // init is collective, as ncclCommInitRank: it names the ranks that never joined
    if (world_barrier(e, "init", 0) != 0) {
        comm_error(&e->base, err, ERR_LEN);
        comm_base_destroy(&e->base);
        free(e);
        return NULL;
    }
    return &e->base;
}

static int emul_poll(Comm* c) {
    CommEmul* e = (CommEmul*)c;
    pthread_check(pthread_mutex_lock(&e->w->mu));
    const int aborted = e->w->aborted;
    char why[ERR_LEN];
    if (aborted) str_copy(why, sizeof why, e->w->why);
    pthread_check(pthread_mutex_unlock(&e->w->mu));
    return aborted ? comm_fail(c, "the communicator was aborted (%s)", why) : 0;
}

static void emul_abort(Comm* c, const char* why) {
    CommEmul* e = (CommEmul*)c;
    char msg[ERR_LEN], buf[ERR_LEN];
    if (why) {
        snprintf(msg, sizeof msg, "rank %d aborted: %s", c->rank, why);
        comm_fail(c, "aborted: %s", why);
    } else {
        const char* cur = comm_error(c, buf, sizeof buf);
        snprintf(msg, sizeof msg, "rank %d aborted (%s)", c->rank, cur ? cur : "no reason given");
    }
    pthread_check(pthread_mutex_lock(&e->w->mu));
    world_abort_locked(e->w, msg);
    pthread_check(pthread_mutex_unlock(&e->w->mu));
}

static void emul_destroy(Comm* c) {
    CommEmul* e = (CommEmul*)c;
    char buf[8];
    if (comm_error(c, buf, sizeof buf) != NULL) emul_abort(c, NULL);  // free waiting peers
    comm_base_destroy(c);
    free(e);
}

static int emul_new_token(CommToken* out, char* err) {
    (void)err;
    memset(out, 0, sizeof *out);  // the threads share the world pointer instead
    return 0;
}

const CommImpl comm_emul_impl = {
    .name = "emul",
    .new_token = emul_new_token,
    .init = emul_init,
    .destroy = emul_destroy,
    .run = emul_run,
    .barrier = emul_barrier,
    .poll = emul_poll,
    .abort = emul_abort,
};
