/*
 * comm.c — the implementation-independent part of comm.h: argument checks, the sticky error,
 * comm_sync's bounded wait, the shard layout and the reference sum whose order both the
 * emulation and the tests follow.
 */
#include "comm.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char* const comm_op_names[COMM_OP_KINDS] = {"all_reduce", "reduce_scatter", "all_gather",
                                                  "broadcast", "barrier"};

// ----------------------------------------------------------------------------
// the common state and the sticky error

void comm_base_init(Comm* c, const CommImpl* impl, int rank, int world, double timeout_s) {
    c->impl = impl;
    c->rank = rank;
    c->world = world;
    c->timeout_s = timeout_s;
    c->n_ops = 0;
    c->failed = 0;
    c->err[0] = '\0';
    pthread_check(pthread_mutex_init(&c->mu, NULL));
}

void comm_base_destroy(Comm* c) { pthread_check(pthread_mutex_destroy(&c->mu)); }

int comm_fail(Comm* c, const char* fmt, ...) {
    char msg[ERR_LEN - 32];  // room for the rank prefix
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_check(pthread_mutex_lock(&c->mu));
    if (!c->failed) {
        c->failed = 1;
        snprintf(c->err, sizeof c->err, "rank %d: %s", c->rank, msg);
    }
    pthread_check(pthread_mutex_unlock(&c->mu));
    return -1;
}

const char* comm_error(Comm* c, char* buf, size_t cap) {
    pthread_check(pthread_mutex_lock(&c->mu));
    const int failed = c->failed;
    if (failed) str_copy(buf, cap, c->err);
    pthread_check(pthread_mutex_unlock(&c->mu));
    return failed ? buf : NULL;
}

static int comm_failed(Comm* c) {
    pthread_check(pthread_mutex_lock(&c->mu));
    const int f = c->failed;
    pthread_check(pthread_mutex_unlock(&c->mu));
    return f;
}

// ----------------------------------------------------------------------------
// calls

// Programming errors of the caller (not user input): one line with the op and the rule broken.
static int check_op(Comm* c, const CommOp* op) {
    if (op->kind < 0 || op->kind >= COMM_BARRIER)
        return comm_fail(c, "op kind %d is not a collective of comm_run", (int)op->kind);
    if (op->dtype != COMM_F32 && op->dtype != COMM_BF16)
        return comm_fail(c, "%s: unknown dtype %d", comm_op_names[op->kind], (int)op->dtype);
    if (op->count > 0 && (op->recv == NULL || (op->send == NULL && op->kind != COMM_BROADCAST)))
        return comm_fail(c, "%s of %zu elements: NULL buffer", comm_op_names[op->kind], op->count);
    if (op->kind == COMM_BROADCAST && (op->root < 0 || op->root >= c->world))
        return comm_fail(c, "broadcast: root %d is not a rank of %d", op->root, c->world);
    if (op->kind == COMM_BROADCAST && c->rank == op->root && op->count > 0 && op->send == NULL)
        return comm_fail(c, "broadcast: the root's send buffer is NULL");
    return 0;
}

int comm_run(Comm* c, const CommOp* ops, int n, const CommStream* st) {
    if (comm_failed(c)) return -1;
    for (int i = 0; i < n; i++)
        if (check_op(c, &ops[i]) != 0) return -1;
    if (n <= 0) return 0;
    return c->impl->run(c, ops, n, st);
}

int comm_all_reduce(Comm* c, const void* send, void* recv, size_t count, CommDtype dt,
                    const CommStream* st) {
    CommOp op = {.kind = COMM_ALL_REDUCE, .dtype = dt, .send = send, .recv = recv, .count = count};
    return comm_run(c, &op, 1, st);
}

int comm_reduce_scatter(Comm* c, const void* send, void* recv, size_t count, CommDtype dt,
                        const CommStream* st) {
    CommOp op = {.kind = COMM_REDUCE_SCATTER, .dtype = dt, .send = send, .recv = recv,
                 .count = count};
    return comm_run(c, &op, 1, st);
}

int comm_all_gather(Comm* c, const void* send, void* recv, size_t count, CommDtype dt,
                    const CommStream* st) {
    CommOp op = {.kind = COMM_ALL_GATHER, .dtype = dt, .send = send, .recv = recv, .count = count};
    return comm_run(c, &op, 1, st);
}

int comm_broadcast(Comm* c, const void* send, void* recv, size_t count, CommDtype dt, int root,
                   const CommStream* st) {
    CommOp op = {.kind = COMM_BROADCAST, .dtype = dt, .send = send, .recv = recv, .count = count,
                 .root = root};
    return comm_run(c, &op, 1, st);
}

int comm_barrier(Comm* c) {
    if (comm_failed(c)) return -1;
    return c->impl->barrier(c);
}

int comm_poll(Comm* c) {
    if (comm_failed(c)) return -1;
    return c->impl->poll(c);
}

void comm_abort(Comm* c, const char* why) { c->impl->abort(c, why); }

void comm_destroy(Comm* c) {
    if (c) c->impl->destroy(c);
}

static void sleep_ms(long ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

int comm_sync(Comm* c, const CommStream* st) {
    if (st == NULL) return comm_poll(c);  // host ops completed when they returned
    DevEvent* ev = st->impl->event_create(st->dev);
    st->impl->event_record(ev, st->dev, st->stream);
    // Poll rather than block: a peer that died leaves the stream waiting forever, and only the
    // deadline (then the abort, which frees the stream) turns that into an error.
    // A margin past the timeout: an implementation that times out its ops itself (the
    // emulation, naming the missing rank) says more than this generic message can.
    const double t0 = time_now_s(), limit = c->timeout_s * 1.1 + 0.5;
    int rc = 0;
    while (!st->impl->event_query(ev)) {
        if (comm_poll(c) != 0) {
            comm_abort(c, NULL);
            rc = -1;
            break;
        }
        if (time_now_s() - t0 > limit) {
            comm_fail(c, "collectives on stream %s did not complete within %.1f s (after %llu "
                      "ops): a peer rank stopped responding; communicator aborted "
                      "(--dist-timeout)", stream_names[st->stream], limit,
                      (unsigned long long)atomic_load(&c->n_ops));
            comm_abort(c, NULL);
            rc = -1;
            break;
        }
        sleep_ms(1);
    }
    // after an abort the stream drains (the aborted ops return), so this wait ends
    st->impl->event_synchronize(ev);
    st->impl->event_destroy(ev);
    if (rc == 0 && comm_poll(c) != 0) rc = -1;
    return rc;
}

// ----------------------------------------------------------------------------
// layout and the reference sum

size_t comm_dtype_size(CommDtype dt) { return dt == COMM_BF16 ? 2 : 4; }

size_t comm_shard_block(size_t n, int world) { return world > 0 ? ceil_div(n, (size_t)world) : n; }

void comm_shard_range(size_t n, int world, int rank, size_t* off, size_t* len) {
    const size_t b = comm_shard_block(n, world);
    size_t o = b * (size_t)rank;
    if (o > n) o = n;
    *off = o;
    *len = o + b <= n ? b : n - o;
}

void comm_reference_sum(const void* const* in, int world, size_t n, CommDtype dt, void* out) {
    if (dt == COMM_F32) {
        float* o = out;
        for (size_t i = 0; i < n; i++) {
            float acc = ((const float*)in[0])[i];
            for (int r = 1; r < world; r++) acc = acc + ((const float*)in[r])[i];
            o[i] = acc;
        }
    } else {
        uint16_t* o = out;
        for (size_t i = 0; i < n; i++) {
            float acc = bf16_to_f32(((const uint16_t*)in[0])[i]);
            for (int r = 1; r < world; r++) acc = acc + bf16_to_f32(((const uint16_t*)in[r])[i]);
            o[i] = f32_to_bf16(acc);
        }
    }
}
