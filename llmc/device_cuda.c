/*
 * device_cuda.c — the device interface (device.h) on NVIDIA GPUs through the CUDA runtime API:
 * one compute stream and four copy streams per GPU (activation streams at the highest priority),
 * events usable across GPUs, pinned host memory, bounded and accounted device memory, and traces.
 *
 * Host C code: only the runtime's C API is used here (cuda_runtime_api.h); kernels live in
 * the kernels/ .cu files behind kernels/kernels.h. Compiled to an empty unit without HAVE_CUDA.
 *
 * Issue threads: enqueueing work never blocks the caller. Each GPU has a host thread that issues
 * its commands (submitted work, copies, memsets, event records and waits, labels) in the order
 * they were enqueued. Without it the caller blocks whenever a GPU's launch queue is full (a
 * micro-batch of a large fused stage is thousands of kernels), so one controller thread feeding
 * several GPUs would serialise them: GPU 1 would get its first kernel only once GPU 0 had nearly
 * finished its stage.
 *
 * Events: device.h promises CUDA semantics with respect to the enqueue order: a wait or a
 * synchronisation refers to the latest record enqueued before it, whichever thread issues them.
 * So every record makes a new instance (a CUDA event created by the recording GPU's issue thread)
 * which becomes the DevEvent's current one; a wait captures the current instance at enqueue time
 * and, when issued, first waits (on the host) until that instance's record has been issued.
 * That never deadlocks: an issue thread only waits for a record enqueued earlier than the command
 * it is issuing, and every issue thread works through its commands in enqueue order. Instances
 * are reference-counted (the DevEvent, a pending record, each pending wait or synchronisation).
 *
 * Busy time and traces: compute work and labelled work are bracketed by timing events; the pairs
 * are resolved lazily (stats, set_trace flush) once complete, relative to an origin event recorded
 * together with a host timestamp.
 */
#include "device.h"

#ifdef HAVE_CUDA

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/kernels.h"
#include "common.h"
#include "trace.h"

#define CUDA_MAX_DEVICES 64

#define cuda_check(call)                                                                       \
    do {                                                                                       \
        cudaError_t rc__ = (call);                                                             \
        if (rc__ != cudaSuccess)                                                               \
            fatal_at(__FILE__, __LINE__, "%s: %s", #call, cudaGetErrorString(rc__));           \
    } while (0)

// ----------------------------------------------------------------------------
// types

// One record of a DevEvent.
typedef struct EvInst {
    cudaEvent_t ev;          // created by the recording GPU's issue thread
    struct Device* dev;      // the recording GPU (its queue's lock guards `recorded`)
    int gpu;                 // its index (the instance may outlive the Device when destroyed late)
    int recorded;            // the record has been issued (guarded by dev->q_mu)
    _Atomic int refs;
} EvInst;

struct DevEvent {
    pthread_mutex_t mu;
    EvInst* cur;  // the latest record enqueued, NULL = never recorded
};

typedef struct TimedItem {
    cudaEvent_t start, end;
    int stream;
    char label[48];     // "": busy-time accounting only (a copy: items resolve lazily, long
                        // after the caller's label storage may be gone)
    struct TimedItem* next;
} TimedItem;

typedef enum {
    CMD_SUBMIT,
    CMD_HOST_FN,
    CMD_COPY,
    CMD_MEMSET,
    CMD_RECORD,
    CMD_WAIT,
    CMD_LABEL,
    CMD_STOP
} CmdKind;

typedef struct Cmd {
    CmdKind kind;
    StreamKind stream;
    DevWorkFn fn;                 // CMD_SUBMIT, CMD_HOST_FN
    void* arg;
    void* dst;                    // CMD_COPY, CMD_MEMSET
    const void* src;
    size_t bytes;
    enum cudaMemcpyKind dir;
    EvInst* inst;                 // CMD_RECORD, CMD_WAIT
    const char* label;            // CMD_LABEL
    struct Cmd* next;
} Cmd;

struct Device {
    int index;
    cudaStream_t streams[STREAM_COUNT];
    void* ops_ctx;
    pthread_mutex_t mu;    // memory accounting, timed items
    size_t mem_limit, mem_in_use, mem_peak;
    uint64_t bytes[STREAM_COUNT];
    double busy_s[STREAM_COUNT];
    const char* pending_label[STREAM_COUNT];  // issue thread only
    TimedItem* pending_head;  // timed items not yet resolved, in submission order
    TimedItem* pending_tail;
    cudaEvent_t origin;       // recorded at open together with host_origin
    double host_origin;
    struct Trace* trace;      // changed only while the command queue is drained
    int trace_pid;
    // the issue thread and its command queue
    pthread_t thread;
    pthread_mutex_t q_mu;     // the queue, the counters, and EvInst.recorded of this GPU's records
    pthread_cond_t q_cv;
    Cmd* q_head;
    Cmd* q_tail;
    uint64_t enqueued, issued;
};

// Device allocations carry a header with their size, for accounting.
#define MEM_HEADER 256

// ----------------------------------------------------------------------------
// event instances

static EvInst* inst_ref(EvInst* in) {
    if (in) atomic_fetch_add(&in->refs, 1);
    return in;
}

static void inst_unref(EvInst* in) {
    if (!in || atomic_fetch_sub(&in->refs, 1) != 1) return;
    // the last reference: a record is always issued before then (the record command holds one)
    int cur = 0;
    cuda_check(cudaGetDevice(&cur));
    cuda_check(cudaSetDevice(in->gpu));
    cuda_check(cudaEventDestroy(in->ev));  // released once complete if still pending
    cuda_check(cudaSetDevice(cur));
    free(in);
}

// Block until the record of `in` has been issued on its GPU.
static void inst_wait_recorded(EvInst* in) {
    Device* d = in->dev;
    pthread_check(pthread_mutex_lock(&d->q_mu));
    while (!in->recorded) pthread_check(pthread_cond_wait(&d->q_cv, &d->q_mu));
    pthread_check(pthread_mutex_unlock(&d->q_mu));
}

// The current instance of an event, with a reference (NULL: never recorded).
static EvInst* event_current(DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    EvInst* in = inst_ref(e->cur);
    pthread_check(pthread_mutex_unlock(&e->mu));
    return in;
}

// ----------------------------------------------------------------------------
// command queue

static void enqueue(Device* d, Cmd c) {
    Cmd* p = malloc_check(sizeof(Cmd));
    *p = c;
    p->next = NULL;
    pthread_check(pthread_mutex_lock(&d->q_mu));
    if (d->q_tail) d->q_tail->next = p;
    else d->q_head = p;
    d->q_tail = p;
    d->enqueued++;
    pthread_check(pthread_cond_broadcast(&d->q_cv));
    pthread_check(pthread_mutex_unlock(&d->q_mu));
}

// Block until every command enqueued so far has been issued.
static void drain(Device* d) {
    pthread_check(pthread_mutex_lock(&d->q_mu));
    const uint64_t target = d->enqueued;
    while (d->issued < target) pthread_check(pthread_cond_wait(&d->q_cv, &d->q_mu));
    pthread_check(pthread_mutex_unlock(&d->q_mu));
}

static TimedItem* timed_begin(Device* d, StreamKind s);
static void timed_end(Device* d, TimedItem* it);

static void issue(Device* d, Cmd* c) {
    cudaStream_t st = d->streams[c->stream];
    switch (c->kind) {
    case CMD_SUBMIT: {
        TimedItem* it = timed_begin(d, c->stream);
        c->fn(c->arg);  // enqueues kernels on the ops context's stream (the compute stream)
        timed_end(d, it);
        break;
    }
    case CMD_HOST_FN:
        // runs on a CUDA callback thread when the stream reaches it (it may block there; the
        // issue thread goes on issuing)
        cuda_check(cudaLaunchHostFunc(st, c->fn, c->arg));
        break;
    case CMD_COPY: {
        TimedItem* it = timed_begin(d, c->stream);
        cuda_check(cudaMemcpyAsync(c->dst, c->src, c->bytes, c->dir, st));
        timed_end(d, it);
        pthread_check(pthread_mutex_lock(&d->mu));
        d->bytes[c->stream] += c->bytes;
        pthread_check(pthread_mutex_unlock(&d->mu));
        break;
    }
    case CMD_MEMSET: {
        TimedItem* it = timed_begin(d, c->stream);
        cuda_check(cudaMemsetAsync(c->dst, 0, c->bytes, st));
        timed_end(d, it);
        break;
    }
    case CMD_RECORD:
        // blocking sync: the controller and optimizer threads wait on these; spinning would
        // take cores from the optimizer's thread pool
        cuda_check(cudaEventCreateWithFlags(&c->inst->ev, cudaEventBlockingSync));
        cuda_check(cudaEventRecord(c->inst->ev, st));
        pthread_check(pthread_mutex_lock(&d->q_mu));
        c->inst->recorded = 1;
        pthread_check(pthread_cond_broadcast(&d->q_cv));
        pthread_check(pthread_mutex_unlock(&d->q_mu));
        inst_unref(c->inst);
        break;
    case CMD_WAIT:
        inst_wait_recorded(c->inst);
        cuda_check(cudaStreamWaitEvent(st, c->inst->ev, 0));
        inst_unref(c->inst);
        break;
    case CMD_LABEL:
        d->pending_label[c->stream] = c->label;
        break;
    case CMD_STOP:
        break;
    }
}

static void* issue_main(void* arg) {
    Device* d = arg;
    cuda_check(cudaSetDevice(d->index));
    for (;;) {
        pthread_check(pthread_mutex_lock(&d->q_mu));
        while (!d->q_head) pthread_check(pthread_cond_wait(&d->q_cv, &d->q_mu));
        Cmd* c = d->q_head;
        d->q_head = c->next;
        if (!d->q_head) d->q_tail = NULL;
        pthread_check(pthread_mutex_unlock(&d->q_mu));
        const int stop = c->kind == CMD_STOP;
        issue(d, c);
        free(c);
        pthread_check(pthread_mutex_lock(&d->q_mu));
        d->issued++;
        pthread_check(pthread_cond_broadcast(&d->q_cv));
        pthread_check(pthread_mutex_unlock(&d->q_mu));
        if (stop) return NULL;
    }
}

// ----------------------------------------------------------------------------
// lifecycle

static Device* cuda_open(int index, const DeviceOptions* opt) {
    int n = cuda_device_count();
    if (index >= n || index >= CUDA_MAX_DEVICES)
        fatal("device cuda:%d does not exist (%d CUDA device(s) visible; check "
              "CUDA_VISIBLE_DEVICES)", index, n);
    Device* d = calloc_check(1, sizeof(Device));
    d->index = index;
    cuda_check(cudaSetDevice(index));
    int lo = 0, hi = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    for (int s = 0; s < STREAM_COUNT; s++) {
        // the activation path is the critical one (docs/ROUNDPIPE.md §4.1); priorities order
        // kernels, the copy engines are ordered by the engine's event gating
        int prio = (s == STREAM_ACT_UP || s == STREAM_ACT_DOWN) ? hi : lo;
        cuda_check(cudaStreamCreateWithPriority(&d->streams[s], cudaStreamNonBlocking, prio));
    }
    d->ops_ctx = ops_cuda_create(index, d->streams[STREAM_COMPUTE]);
    if (opt && opt->profile_ops) ops_cuda_profile_enable(d->ops_ctx);
    pthread_check(pthread_mutex_init(&d->mu, NULL));
    size_t free_b = 0, total_b = 0;
    cuda_check(cudaMemGetInfo(&free_b, &total_b));
    d->mem_limit = opt && opt->mem_limit ? opt->mem_limit : free_b;
    cuda_check(cudaEventCreate(&d->origin));
    cuda_check(cudaEventRecord(d->origin, d->streams[STREAM_COMPUTE]));
    cuda_check(cudaEventSynchronize(d->origin));
    d->host_origin = time_now_s();
    pthread_check(pthread_mutex_init(&d->q_mu, NULL));
    pthread_check(pthread_cond_init(&d->q_cv, NULL));
    pthread_check(pthread_create(&d->thread, NULL, issue_main, d));
    return d;
}

static void resolve_timed(Device* d, int wait);

static void cuda_close(Device* d) {
    if (!d) return;
    enqueue(d, (Cmd){.kind = CMD_STOP});
    pthread_check(pthread_join(d->thread, NULL));
    pthread_check(pthread_cond_destroy(&d->q_cv));
    pthread_check(pthread_mutex_destroy(&d->q_mu));
    cuda_check(cudaSetDevice(d->index));
    cuda_check(cudaDeviceSynchronize());
    resolve_timed(d, 1);
    ops_cuda_profile_report(d->ops_ctx, stdout);  // (nothing unless profiling)
    ops_cuda_destroy(d->ops_ctx);
    for (int s = 0; s < STREAM_COUNT; s++) cuda_check(cudaStreamDestroy(d->streams[s]));
    cuda_check(cudaEventDestroy(d->origin));
    pthread_check(pthread_mutex_destroy(&d->mu));
    free(d);
}

static const Ops* cuda_ops(Device* d) {
    (void)d;
    return &ops_cuda;
}

static void* cuda_ops_ctx(Device* d) { return d->ops_ctx; }

// ----------------------------------------------------------------------------
// memory

static void* cuda_dev_alloc(Device* d, size_t bytes) {
    pthread_check(pthread_mutex_lock(&d->mu));
    if (d->mem_in_use + bytes > d->mem_limit) {
        size_t in_use = d->mem_in_use, limit = d->mem_limit;
        pthread_check(pthread_mutex_unlock(&d->mu));
        fatal("device cuda:%d out of memory: %zu MiB more needed with %zu MiB in use of %zu MiB. "
              "HINT: lower --device-mem, use --recompute layer, more micro-batches or a shorter "
              "--seq", d->index, bytes >> 20, in_use >> 20, limit >> 20);
    }
    d->mem_in_use += bytes;
    if (d->mem_in_use > d->mem_peak) d->mem_peak = d->mem_in_use;
    pthread_check(pthread_mutex_unlock(&d->mu));
    cuda_check(cudaSetDevice(d->index));
    char* p = NULL;
    cudaError_t rc = cudaMalloc((void**)&p, bytes + MEM_HEADER);
    if (rc != cudaSuccess)
        fatal("device cuda:%d: cudaMalloc of %zu MiB failed (%s). HINT: lower --device-mem or the "
              "micro-batch size", d->index, bytes >> 20, cudaGetErrorString(rc));
    size_t hdr[2] = {bytes, (size_t)d->index};
    cuda_check(cudaMemcpy(p, hdr, sizeof hdr, cudaMemcpyHostToDevice));
    cuda_check(cudaMemset(p + MEM_HEADER, 0, bytes));
    return p + MEM_HEADER;
}

static void cuda_dev_free(Device* d, void* ptr) {
    if (!ptr) return;
    char* p = (char*)ptr - MEM_HEADER;
    size_t hdr[2];
    cuda_check(cudaSetDevice(d->index));
    cuda_check(cudaMemcpy(hdr, p, sizeof hdr, cudaMemcpyDeviceToHost));
    cuda_check(cudaFree(p));
    pthread_check(pthread_mutex_lock(&d->mu));
    d->mem_in_use -= hdr[0];
    pthread_check(pthread_mutex_unlock(&d->mu));
}

static void* cuda_host_alloc(size_t bytes) {
    void* p = NULL;
    // portable: any GPU of the set may DMA to or from it
    cudaError_t rc = cudaHostAlloc(&p, bytes ? bytes : 64, cudaHostAllocPortable);
    if (rc != cudaSuccess)
        fatal("pinned host allocation of %zu MiB failed (%s). HINT: the host needs more free "
              "memory for this model and batch", bytes >> 20, cudaGetErrorString(rc));
    return p;
}

static void cuda_host_free(void* p) {
    if (p) cuda_check(cudaFreeHost(p));
}

static void cuda_host_register(void* p, size_t bytes) {
    if (p && bytes) cuda_check(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
}

static void cuda_host_unregister(void* p) {
    if (p) cuda_check(cudaHostUnregister(p));
}

// ----------------------------------------------------------------------------
// timed items (busy time, traces)

static int timing_wanted(Device* d, StreamKind s) {
    return s == STREAM_COMPUTE || (d->trace && d->pending_label[s]);
}

static TimedItem* timed_begin(Device* d, StreamKind s) {
    if (!timing_wanted(d, s)) return NULL;
    TimedItem* it = calloc_check(1, sizeof(TimedItem));
    it->stream = (int)s;
    if (d->trace && d->pending_label[s])
        snprintf(it->label, sizeof it->label, "%s", d->pending_label[s]);
    d->pending_label[s] = NULL;
    cuda_check(cudaEventCreate(&it->start));
    cuda_check(cudaEventCreate(&it->end));
    cuda_check(cudaEventRecord(it->start, d->streams[s]));
    return it;
}

static void timed_end(Device* d, TimedItem* it) {
    if (!it) return;
    cuda_check(cudaEventRecord(it->end, d->streams[it->stream]));
    pthread_check(pthread_mutex_lock(&d->mu));
    if (d->pending_tail) d->pending_tail->next = it;
    else d->pending_head = it;
    d->pending_tail = it;
    pthread_check(pthread_mutex_unlock(&d->mu));
}

// Fold completed timed items into busy time and the trace. With wait, every item is completed.
static void resolve_timed(Device* d, int wait) {
    pthread_check(pthread_mutex_lock(&d->mu));
    TimedItem* it = d->pending_head;
    TimedItem* keep_head = NULL;
    TimedItem* keep_tail = NULL;
    while (it) {
        TimedItem* next = it->next;
        it->next = NULL;
        int done = 1;
        if (wait) {
            cuda_check(cudaEventSynchronize(it->end));
        } else {
            cudaError_t rc = cudaEventQuery(it->end);
            if (rc != cudaSuccess && rc != cudaErrorNotReady) cuda_check(rc);
            done = rc == cudaSuccess;
        }
        if (done) {
            float ms = 0, t0 = 0;
            cuda_check(cudaEventElapsedTime(&ms, it->start, it->end));
            cuda_check(cudaEventElapsedTime(&t0, d->origin, it->start));
            d->busy_s[it->stream] += it->stream == STREAM_COMPUTE ? ms * 1e-3 : 0;
            if (it->label[0] && d->trace) {
                double a = d->host_origin + t0 * 1e-3;
                trace_add(d->trace, it->label, d->trace_pid, it->stream, a, a + ms * 1e-3);
            }
            cuda_check(cudaEventDestroy(it->start));
            cuda_check(cudaEventDestroy(it->end));
            free(it);
        } else {
            if (keep_tail) keep_tail->next = it;
            else keep_head = it;
            keep_tail = it;
        }
        it = next;
    }
    d->pending_head = keep_head;
    d->pending_tail = keep_tail;
    pthread_check(pthread_mutex_unlock(&d->mu));
}

// ----------------------------------------------------------------------------
// work (enqueued; the GPU's issue thread issues it)

static void cuda_submit(Device* d, StreamKind s, DevWorkFn fn, void* arg) {
    enqueue(d, (Cmd){.kind = CMD_SUBMIT, .stream = s, .fn = fn, .arg = arg});
}

static void cuda_host_fn(Device* d, StreamKind s, DevWorkFn fn, void* arg) {
    enqueue(d, (Cmd){.kind = CMD_HOST_FN, .stream = s, .fn = fn, .arg = arg});
}

static void cuda_copy_h2d(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    enqueue(d, (Cmd){.kind = CMD_COPY, .stream = s, .dst = dst, .src = src, .bytes = bytes,
                     .dir = cudaMemcpyHostToDevice});
}

static void cuda_copy_d2h(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    enqueue(d, (Cmd){.kind = CMD_COPY, .stream = s, .dst = dst, .src = src, .bytes = bytes,
                     .dir = cudaMemcpyDeviceToHost});
}

static void cuda_memset_zero(Device* d, StreamKind s, void* dst, size_t bytes) {
    if (bytes == 0) return;
    enqueue(d, (Cmd){.kind = CMD_MEMSET, .stream = s, .dst = dst, .bytes = bytes});
}

// ----------------------------------------------------------------------------
// events

static DevEvent* cuda_event_create(Device* d) {
    (void)d;
    DevEvent* e = calloc_check(1, sizeof(DevEvent));
    pthread_check(pthread_mutex_init(&e->mu, NULL));
    return e;
}

static void cuda_event_destroy(DevEvent* e) {
    if (!e) return;
    inst_unref(e->cur);  // pending waits hold their own references
    pthread_check(pthread_mutex_destroy(&e->mu));
    free(e);
}

static void cuda_event_record(DevEvent* e, Device* d, StreamKind s) {
    EvInst* in = calloc_check(1, sizeof(EvInst));
    in->dev = d;
    in->gpu = d->index;
    atomic_init(&in->refs, 2);  // the event's and the record command's
    pthread_check(pthread_mutex_lock(&e->mu));
    EvInst* old = e->cur;
    e->cur = in;
    // enqueued under the event's lock: a wait enqueued after this record sees it as current
    enqueue(d, (Cmd){.kind = CMD_RECORD, .stream = s, .inst = in});
    pthread_check(pthread_mutex_unlock(&e->mu));
    inst_unref(old);
}

static void cuda_stream_wait(Device* d, StreamKind s, DevEvent* e) {
    EvInst* in = event_current(e);
    if (in) enqueue(d, (Cmd){.kind = CMD_WAIT, .stream = s, .inst = in});
}

static void cuda_event_synchronize(DevEvent* e) {
    // the instance captured now: a later re-record does not extend this wait
    EvInst* in = event_current(e);
    if (!in) return;
    inst_wait_recorded(in);
    cuda_check(cudaEventSynchronize(in->ev));
    inst_unref(in);
}

static int cuda_event_query(DevEvent* e) {
    EvInst* in = event_current(e);
    if (!in) return 1;
    pthread_check(pthread_mutex_lock(&in->dev->q_mu));
    int recorded = in->recorded;
    pthread_check(pthread_mutex_unlock(&in->dev->q_mu));
    int done = 0;
    if (recorded) {
        cudaError_t rc = cudaEventQuery(in->ev);
        if (rc != cudaSuccess && rc != cudaErrorNotReady) cuda_check(rc);
        done = rc == cudaSuccess;
    }
    inst_unref(in);
    return done;
}

static double cuda_event_elapsed(DevEvent* a, DevEvent* b) {
    EvInst* x = event_current(a);
    EvInst* y = event_current(b);
    double s = 0.0;
    if (x && y) {
        if (x->dev != y->dev)
            fatal("internal: event_elapsed across GPUs %d and %d", x->dev->index, y->dev->index);
        inst_wait_recorded(x);
        inst_wait_recorded(y);
        cuda_check(cudaEventSynchronize(x->ev));
        cuda_check(cudaEventSynchronize(y->ev));
        float ms = 0;
        cuda_check(cudaEventElapsedTime(&ms, x->ev, y->ev));
        s = ms * 1e-3;
    }
    inst_unref(x);
    inst_unref(y);
    return s;
}

static void cuda_synchronize(Device* d) {
    drain(d);
    cuda_check(cudaSetDevice(d->index));
    for (int s = 0; s < STREAM_COUNT; s++) cuda_check(cudaStreamSynchronize(d->streams[s]));
    resolve_timed(d, 1);
}

static void cuda_stats(Device* d, DeviceStats* out) {
    resolve_timed(d, 0);
    pthread_check(pthread_mutex_lock(&d->mu));
    memset(out, 0, sizeof *out);
    for (int s = 0; s < STREAM_COUNT; s++) {
        out->bytes[s] = d->bytes[s];
        out->busy_s[s] = d->busy_s[s];
    }
    out->mem_in_use = d->mem_in_use;
    out->mem_peak = d->mem_peak;
    pthread_check(pthread_mutex_unlock(&d->mu));
}

static void cuda_label(Device* d, StreamKind s, const char* name) {
    enqueue(d, (Cmd){.kind = CMD_LABEL, .stream = s, .label = name});
}

static void cuda_set_trace(Device* d, struct Trace* tr, int pid) {
    drain(d);  // the issue thread reads d->trace; it is idle once drained
    if (!tr) {  // flush before detaching
        cuda_check(cudaSetDevice(d->index));
        for (int s = 0; s < STREAM_COUNT; s++) cuda_check(cudaStreamSynchronize(d->streams[s]));
        resolve_timed(d, 1);
    }
    d->trace = tr;
    d->trace_pid = pid;
}

// For libraries that enqueue on a device's streams themselves (NCCL in comm_nccl.c): the
// cudaStream_t of stream s, and the GPU's index in *gpu. Only from work submitted to that device
// (device_submit), so the call is ordered with the device's other commands.
void* device_cuda_stream(Device* d, StreamKind s, int* gpu) {
    if (gpu) *gpu = d->index;
    return (void*)d->streams[s];
}

const DeviceImpl device_cuda_impl = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .ops = cuda_ops,
    .ops_ctx = cuda_ops_ctx,
    .alloc = cuda_dev_alloc,
    .free = cuda_dev_free,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .submit = cuda_submit,
    .host_fn = cuda_host_fn,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .memset_zero = cuda_memset_zero,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .stream_wait = cuda_stream_wait,
    .event_synchronize = cuda_event_synchronize,
    .event_query = cuda_event_query,
    .event_elapsed = cuda_event_elapsed,
    .synchronize = cuda_synchronize,
    .stats = cuda_stats,
    .label = cuda_label,
    .set_trace = cuda_set_trace,
};

#else
typedef int device_cuda_unused;  // an empty translation unit in CPU-only builds
#endif  // HAVE_CUDA
