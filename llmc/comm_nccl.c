/*
 * comm_nccl.c — the communicator of comm.h on NCCL: one non-blocking ncclComm_t per rank and GPU
 * (ncclCommInitRankConfig from rank 0's ncclUniqueId, which dist.c hands out), collectives on the
 * CUDA stream of a Device (device_cuda.c) or, for host buffers, staged through device memory on
 * a stream of its own. Compiled to an empty unit without HAVE_CUDA; linked with -lnccl.
 *
 * Why non-blocking: a blocking communicator can hang a host thread forever inside NCCL when a
 * peer dies. Non-blocking, every NCCL call returns at once (ncclInProgress while it completes in
 * the background), and this file polls ncclCommGetAsyncError with a deadline: an asynchronous
 * error or the timeout (--dist-timeout) aborts the communicator (ncclCommAbort), which also makes
 * the NCCL kernels still waiting on the dead peer return, so the streams drain and the process
 * can report and exit. NCCL does not say WHICH peer stopped responding; the message gives
 * ncclGetLastError's text (it names the peer's address for network errors).
 *
 * Ordering: ops on a Device stream are submitted to the device (device_submit), so the device's
 * issue thread calls NCCL in order with the device's other commands (event waits that gate a
 * layer's reduce-scatter on its backward, the gradient download after it). One mutex orders the
 * NCCL calls of this rank's communicator against an abort from another thread.
 *
 * NCCL_NVLS_ENABLE: set to 0 unless the user set it. NVLink SHARP (multicast) needs fabric
 * manager multicast support and reserves device memory per communicator; where it is missing or
 * refused, communicator creation fails or stalls. Set NCCL_NVLS_ENABLE=1 to use it.
 */
#include "comm.h"

#ifdef HAVE_CUDA

#include <cuda_runtime_api.h>
#include <errno.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

_Static_assert(sizeof(ncclUniqueId) == COMM_TOKEN_BYTES, "the token carries an ncclUniqueId");

typedef struct CommNccl {
    Comm base;  // first: a Comm* is a CommNccl*
    ncclComm_t nc;        // NULL once aborted or destroyed (under mu)
    pthread_mutex_t mu;   // NCCL calls on nc, against an abort from another thread
    _Atomic int aborted;
    int gpu;
    cudaStream_t host_stream;  // the host path's copies and collectives
    void* stage;               // device staging of host buffers (grows)
    size_t stage_bytes;
} CommNccl;

// ----------------------------------------------------------------------------
// helpers

static void nccl_env_defaults(void) {
    // NVLink multicast off unless asked for (see the top); setenv(.., 0) keeps a user's value
    if (setenv("NCCL_NVLS_ENABLE", "0", 0) != 0) fatal("setenv(NCCL_NVLS_ENABLE) failed");
}

static ncclDataType_t nccl_dtype(CommDtype dt) { return dt == COMM_BF16 ? ncclBfloat16 : ncclFloat32; }

static void sleep_us(long us) {
    struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

// A failed NCCL call: the message with NCCL's own detail (under n->mu, nc valid or NULL).
static int nccl_fail(CommNccl* n, const char* what, ncclResult_t rc) {
    const char* last = n->nc ? ncclGetLastError(n->nc) : NULL;
    return comm_fail(&n->base, "NCCL %s failed: %s%s%s", what, ncclGetErrorString(rc),
                     last && *last ? ": " : "", last && *last ? last : "");
}

// After a call on nc returned rc (under n->mu): wait (polling, mu released between polls) until
// the communicator leaves ncclInProgress, at most until deadline. 0, or -1 with the failure
// recorded (the caller aborts).
static int nccl_settle(CommNccl* n, ncclResult_t rc, const char* what, double deadline) {
    if (rc == ncclSuccess) return 0;
    if (rc != ncclInProgress) return nccl_fail(n, what, rc);
    for (;;) {
        ncclResult_t st = ncclSuccess;
        if (!n->nc) return comm_fail(&n->base, "NCCL %s: the communicator was aborted", what);
        const ncclResult_t q = ncclCommGetAsyncError(n->nc, &st);
        if (q != ncclSuccess) return nccl_fail(n, "ncclCommGetAsyncError", q);
        if (st == ncclSuccess) return 0;
        if (st != ncclInProgress) return nccl_fail(n, what, st);
        if (time_now_s() > deadline)
            return comm_fail(&n->base, "NCCL %s did not complete within %.1f s (a peer rank "
                             "stopped responding?)", what, n->base.timeout_s);
        pthread_check(pthread_mutex_unlock(&n->mu));
        sleep_us(200);
        pthread_check(pthread_mutex_lock(&n->mu));
    }
}

// Enqueue ops as one NCCL group on stream (under n->mu; the caller's thread has the GPU set).
static int nccl_enqueue(CommNccl* n, const CommOp* ops, int cnt, const void* const* send,
                        void* const* recv, cudaStream_t stream) {
    Comm* c = &n->base;
    if (atomic_load(&n->aborted) || !n->nc)
        return comm_fail(c, "NCCL: the communicator was aborted");
    const double deadline = time_now_s() + c->timeout_s;
    ncclResult_t rc = ncclGroupStart();
    if (rc != ncclSuccess) return nccl_fail(n, "ncclGroupStart", rc);
    for (int i = 0; i < cnt; i++) {
        const CommOp* op = &ops[i];
        const ncclDataType_t dt = nccl_dtype(op->dtype);
        switch (op->kind) {
        case COMM_ALL_REDUCE:
            rc = ncclAllReduce(send[i], recv[i], op->count, dt, ncclSum, n->nc, stream);
            break;
        case COMM_REDUCE_SCATTER:
            rc = ncclReduceScatter(send[i], recv[i], op->count, dt, ncclSum, n->nc, stream);
            break;
        case COMM_ALL_GATHER:
            rc = ncclAllGather(send[i], recv[i], op->count, dt, n->nc, stream);
            break;
        case COMM_BROADCAST:
            rc = ncclBroadcast(send[i], recv[i], op->count, dt, op->root, n->nc, stream);
            break;
        default:
            rc = ncclInvalidArgument;
            break;
        }
        if (rc != ncclSuccess && rc != ncclInProgress) {
            nccl_fail(n, comm_op_names[op->kind], rc);
            const ncclResult_t e = ncclGroupEnd();  // close the group either way
            (void)e;
            return -1;
        }
    }
    rc = ncclGroupEnd();
    if (nccl_settle(n, rc, "group of collectives", deadline) != 0) return -1;
    atomic_fetch_add(&c->n_ops, (uint64_t)cnt);
    return 0;
}

static void nccl_abort_locked(CommNccl* n) {
    atomic_store(&n->aborted, 1);
    if (n->nc) {
        const ncclResult_t rc = ncclCommAbort(n->nc);
        if (rc != ncclSuccess && rc != ncclInProgress)  // non-blocking: it may finish later
            fprintf(stderr, "train_roundpipe: warning: ncclCommAbort: %s\n",
                    ncclGetErrorString(rc));
        n->nc = NULL;
    }
}

// ----------------------------------------------------------------------------
// ops on a device stream (the issue thread of that GPU runs the job)

typedef struct NcclJob {
    CommNccl* n;
    Device* dev;
    StreamKind stream;
    int cnt;
    CommOp ops[];  // a copy: the caller's array may be gone when the issue thread gets here
} NcclJob;

static void nccl_job_fn(void* arg) {
    NcclJob* j = arg;
    CommNccl* n = j->n;
    char buf[8];
    if (comm_error(&n->base, buf, sizeof buf) == NULL) {  // a failed communicator runs nothing
        int gpu = -1;
        cudaStream_t st = (cudaStream_t)device_cuda_stream(j->dev, j->stream, &gpu);
        const void** send = malloc_check((size_t)j->cnt * sizeof(void*));
        void** recv = malloc_check((size_t)j->cnt * sizeof(void*));
        for (int i = 0; i < j->cnt; i++) {
            send[i] = j->ops[i].send ? j->ops[i].send : j->ops[i].recv;
            recv[i] = j->ops[i].recv;
        }
        pthread_check(pthread_mutex_lock(&n->mu));
        if (gpu != n->gpu)
            comm_fail(&n->base, "NCCL communicator of GPU %d used on a stream of GPU %d", n->gpu,
                      gpu);
        else if (nccl_enqueue(n, j->ops, j->cnt, send, recv, st) != 0)
            nccl_abort_locked(n);
        pthread_check(pthread_mutex_unlock(&n->mu));
        free(send);
        free(recv);
    }
    free(j);
}

// ----------------------------------------------------------------------------
// ops on host buffers: staged through device memory, completed before returning

static int cuda_fail(CommNccl* n, const char* what, cudaError_t e) {
    return comm_fail(&n->base, "CUDA %s failed: %s", what, cudaGetErrorString(e));
}

// Wait until the host stream is idle, polling the asynchronous error, at most the timeout; on a
// failure (rc != 0 already, an error, the timeout) the communicator is aborted, which frees the
// stream, and the wait goes on a while longer for it to drain. 0, or -1 with the failure recorded.
static int host_wait(CommNccl* n, CommOpKind kind, int rc) {
    Comm* c = &n->base;
    const double deadline = time_now_s() + c->timeout_s;
    double drain_deadline = 0;
    for (;;) {
        const cudaError_t ce = cudaStreamQuery(n->host_stream);
        if (ce == cudaSuccess) return rc;
        if (ce != cudaErrorNotReady) return cuda_fail(n, "cudaStreamQuery (host path)", ce);
        if (rc == 0 && comm_poll(c) != 0) rc = -1;
        if (rc == 0 && time_now_s() > deadline)
            rc = comm_fail(c, "%s (op #%llu) did not complete within %.1f s: a peer rank stopped "
                           "responding; communicator aborted (--dist-timeout)",
                           comm_op_names[kind], (unsigned long long)atomic_load(&c->n_ops),
                           c->timeout_s);
        if (rc != 0 && drain_deadline == 0) {
            pthread_check(pthread_mutex_lock(&n->mu));
            nccl_abort_locked(n);
            pthread_check(pthread_mutex_unlock(&n->mu));
            drain_deadline = time_now_s() + c->timeout_s;
        }
        if (drain_deadline > 0 && time_now_s() > drain_deadline)
            return rc;  // the stream did not drain after the abort either: give up on it
        sleep_us(100);
    }
}

static int nccl_host_run(CommNccl* n, const CommOp* ops, int cnt) {
    Comm* c = &n->base;
    const int W = c->world;
    cudaError_t ce = cudaSetDevice(n->gpu);
    if (ce != cudaSuccess) return cuda_fail(n, "cudaSetDevice", ce);
    // staging layout: per op its send block then its recv block, 256-byte aligned
    size_t total = 0;
    size_t* off = malloc_check((size_t)cnt * 2 * sizeof(size_t));
    for (int i = 0; i < cnt; i++) {
        const size_t es = comm_dtype_size(ops[i].dtype);
        const size_t in = ops[i].kind == COMM_REDUCE_SCATTER ? ops[i].count * (size_t)W
                                                             : ops[i].count;
        const size_t out = ops[i].kind == COMM_ALL_GATHER ? ops[i].count * (size_t)W
                                                          : ops[i].count;
        off[2 * i] = total;
        total += (in * es + 255) / 256 * 256;
        off[2 * i + 1] = total;
        total += (out * es + 255) / 256 * 256;
    }
    int rc = 0;
    if (total > n->stage_bytes) {
        ce = n->stage ? cudaFree(n->stage) : cudaSuccess;
        n->stage = NULL;
        n->stage_bytes = 0;
        if (ce != cudaSuccess) rc = cuda_fail(n, "cudaFree of the host path's staging", ce);
        else if ((ce = cudaMalloc(&n->stage, total)) != cudaSuccess)
            rc = cuda_fail(n, "cudaMalloc of the host path's staging", ce);
        else n->stage_bytes = total;
    }
    const void** send = malloc_check((size_t)cnt * sizeof(void*));
    void** recv = malloc_check((size_t)cnt * sizeof(void*));
    for (int i = 0; rc == 0 && i < cnt; i++) {
        const size_t es = comm_dtype_size(ops[i].dtype);
        const size_t in = ops[i].kind == COMM_REDUCE_SCATTER ? ops[i].count * (size_t)W
                                                             : ops[i].count;
        send[i] = (char*)n->stage + off[2 * i];
        recv[i] = (char*)n->stage + off[2 * i + 1];
        if (ops[i].send && in > 0) {
            ce = cudaMemcpyAsync((void*)send[i], ops[i].send, in * es, cudaMemcpyHostToDevice,
                                 n->host_stream);
            if (ce != cudaSuccess) rc = cuda_fail(n, "cudaMemcpyAsync (host path)", ce);
        }
    }
    if (rc == 0) {
        pthread_check(pthread_mutex_lock(&n->mu));
        rc = nccl_enqueue(n, ops, cnt, send, recv, n->host_stream);
        if (rc != 0) nccl_abort_locked(n);
        pthread_check(pthread_mutex_unlock(&n->mu));
    }
    // Wait for the collectives before copying back: a copy into pageable host memory blocks the
    // thread until the stream gets there, which on a dead peer is never. Bounded instead.
    if (host_wait(n, ops[0].kind, rc) != 0) rc = -1;
    for (int i = 0; rc == 0 && i < cnt; i++) {
        const size_t es = comm_dtype_size(ops[i].dtype);
        const size_t out = ops[i].kind == COMM_ALL_GATHER ? ops[i].count * (size_t)W
                                                          : ops[i].count;
        if (out == 0) continue;
        ce = cudaMemcpyAsync(ops[i].recv, recv[i], out * es, cudaMemcpyDeviceToHost,
                             n->host_stream);
        if (ce != cudaSuccess) rc = cuda_fail(n, "cudaMemcpyAsync (host path)", ce);
    }
    if (rc == 0 && (ce = cudaStreamSynchronize(n->host_stream)) != cudaSuccess)
        rc = cuda_fail(n, "cudaStreamSynchronize (host path)", ce);
    free(send);
    free(recv);
    free(off);
    return rc;
}

static int nccl_run(Comm* c, const CommOp* ops, int cnt, const CommStream* st) {
    CommNccl* n = (CommNccl*)c;
    if (st == NULL) return nccl_host_run(n, ops, cnt);
    if (st->impl != &device_cuda_impl)
        return comm_fail(c, "the NCCL communicator runs on CUDA devices, not on '%s' ones",
                         st->impl->name);
    NcclJob* j = malloc_check(sizeof *j + (size_t)cnt * sizeof(CommOp));
    j->n = n;
    j->dev = st->dev;
    j->stream = st->stream;
    j->cnt = cnt;
    memcpy(j->ops, ops, (size_t)cnt * sizeof(CommOp));
    st->impl->submit(st->dev, st->stream, nccl_job_fn, j);
    return 0;
}

static int nccl_barrier(Comm* c) {
    // a one-element all-reduce on the host path: returns once every rank has joined
    float one = 1.0f, sum = 0.0f;
    CommOp op = {.kind = COMM_ALL_REDUCE, .dtype = COMM_F32, .send = &one, .recv = &sum,
                 .count = 1};
    return nccl_host_run((CommNccl*)c, &op, 1);
}

// ----------------------------------------------------------------------------
// lifecycle, poll, abort

static int nccl_new_token(CommToken* out, char* err) {
    nccl_env_defaults();
    ncclUniqueId id;
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess)
        return errorf(err, "ncclGetUniqueId failed: %s", ncclGetErrorString(rc));
    memcpy(out->bytes, &id, sizeof id);
    return 0;
}

static Comm* nccl_init(const CommInit* in, char* err) {
    nccl_env_defaults();
    if (!(in->timeout_s > 0)) {
        errorf(err, "NCCL communicator: timeout %.3g s must be > 0", in->timeout_s);
        return NULL;
    }
    cudaError_t ce = cudaSetDevice(in->gpu);
    if (ce != cudaSuccess) {
        errorf(err, "rank %d: cudaSetDevice(%d) failed: %s (LOCAL_RANK picks the GPU; check "
               "CUDA_VISIBLE_DEVICES)", in->rank, in->gpu, cudaGetErrorString(ce));
        return NULL;
    }
    CommNccl* n = calloc_check(1, sizeof *n);
    comm_base_init(&n->base, &comm_nccl_impl, in->rank, in->world, in->timeout_s);
    pthread_check(pthread_mutex_init(&n->mu, NULL));
    n->gpu = in->gpu;
    ce = cudaStreamCreateWithFlags(&n->host_stream, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        errorf(err, "rank %d: cudaStreamCreate failed: %s", in->rank, cudaGetErrorString(ce));
        pthread_check(pthread_mutex_destroy(&n->mu));
        comm_base_destroy(&n->base);
        free(n);
        return NULL;
    }
    ncclUniqueId id;
    memcpy(&id, in->token.bytes, sizeof id);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  // see the top: every wait is ours, bounded
    const double deadline = time_now_s() + in->timeout_s;
    pthread_check(pthread_mutex_lock(&n->mu));
    ncclResult_t rc = ncclCommInitRankConfig(&n->nc, in->world, id, in->rank, &cfg);
    int bad = 0;
    if (rc != ncclSuccess && rc != ncclInProgress) bad = nccl_fail(n, "ncclCommInitRankConfig", rc);
    else if (nccl_settle(n, rc, "init (ncclCommInitRankConfig)", deadline) != 0) bad = -1;
    if (bad) nccl_abort_locked(n);
    pthread_check(pthread_mutex_unlock(&n->mu));
    if (bad) {
        char msg[ERR_LEN];
        comm_error(&n->base, msg, sizeof msg);
        errorf(err, "%s (rank %d of %d on GPU %d)", msg, in->rank, in->world, in->gpu);
        cudaStreamDestroy(n->host_stream);
        pthread_check(pthread_mutex_destroy(&n->mu));
        comm_base_destroy(&n->base);
        free(n);
        return NULL;
    }
    return &n->base;
}

static int nccl_poll(Comm* c) {
    CommNccl* n = (CommNccl*)c;
    int rc = 0;
    pthread_check(pthread_mutex_lock(&n->mu));
    if (atomic_load(&n->aborted) || !n->nc) {
        rc = comm_fail(c, "NCCL: the communicator was aborted");
    } else {
        ncclResult_t st = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(n->nc, &st);
        if (q != ncclSuccess) rc = nccl_fail(n, "ncclCommGetAsyncError", q);
        else if (st != ncclSuccess && st != ncclInProgress)
            rc = nccl_fail(n, "asynchronous operation", st);
    }
    pthread_check(pthread_mutex_unlock(&n->mu));
    return rc;
}

static void nccl_abort(Comm* c, const char* why) {
    CommNccl* n = (CommNccl*)c;
    if (why) comm_fail(c, "aborted: %s", why);
    pthread_check(pthread_mutex_lock(&n->mu));
    nccl_abort_locked(n);
    pthread_check(pthread_mutex_unlock(&n->mu));
}

static void nccl_destroy(Comm* c) {
    CommNccl* n = (CommNccl*)c;
    char buf[8];
    pthread_check(pthread_mutex_lock(&n->mu));
    if (n->nc && comm_error(c, buf, sizeof buf) == NULL) {
        // a healthy communicator: flush, then free (both bounded; an abort otherwise)
        const double deadline = time_now_s() + c->timeout_s;
        ncclResult_t rc = ncclCommFinalize(n->nc);
        if (nccl_settle(n, rc, "ncclCommFinalize", deadline) == 0 && n->nc) {
            rc = ncclCommDestroy(n->nc);
            if (rc == ncclSuccess) n->nc = NULL;
            else nccl_fail(n, "ncclCommDestroy", rc);
        }
    }
    nccl_abort_locked(n);  // what is left (after a failure): abort frees it without waiting
    pthread_check(pthread_mutex_unlock(&n->mu));
    if (n->stage) {
        const cudaError_t ce = cudaFree(n->stage);
        if (ce != cudaSuccess)
            fprintf(stderr, "train_roundpipe: warning: cudaFree: %s\n", cudaGetErrorString(ce));
    }
    const cudaError_t ce = cudaStreamDestroy(n->host_stream);
    if (ce != cudaSuccess)
        fprintf(stderr, "train_roundpipe: warning: cudaStreamDestroy: %s\n",
                cudaGetErrorString(ce));
    pthread_check(pthread_mutex_destroy(&n->mu));
    comm_base_destroy(c);
    free(n);
}

const CommImpl comm_nccl_impl = {
    .name = "nccl",
    .new_token = nccl_new_token,
    .init = nccl_init,
    .destroy = nccl_destroy,
    .run = nccl_run,
    .barrier = nccl_barrier,
    .poll = nccl_poll,
    .abort = nccl_abort,
};

#else
typedef int comm_nccl_unused;  // an empty translation unit in CPU-only builds
#endif  // HAVE_CUDA
