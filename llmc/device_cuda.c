/*
 * device_cuda.c — the device interface (device.h) on NVIDIA GPUs through the CUDA runtime API:
 * one compute stream and four copy streams per GPU (activation streams at the highest priority),
 * events usable across GPUs, pinned host memory, bounded and accounted device memory, and traces.
 *
 * Host C code: only the runtime's C API is used here (cuda_runtime_api.h); kernels live in
 * the kernels/ .cu files behind kernels/kernels.h. Compiled to an empty unit without HAVE_CUDA.
 *
 * Cross-device events: a DevEvent holds one cudaEvent_t per GPU (created on first use) and the
 * index of the GPU that recorded it last. A record on GPU g records the event's GPU-g CUDA event;
 * a wait or a synchronisation uses the CUDA event of the last recorder, captured at call time —
 * the semantics device.h promises. A mutex guards the "last recorder" (the controller records
 * while the optimizer thread synchronises).
 *
 * Busy time and traces: compute work and labelled work are bracketed by timing events; the pairs
 * are resolved lazily (stats, set_trace flush) once complete, relative to an origin event recorded
 * together with a host timestamp.
 */
#include "device.h"

#ifdef HAVE_CUDA

#include <cuda_runtime_api.h>
#include <pthread.h>
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

struct DevEvent {
    pthread_mutex_t mu;
    cudaEvent_t ev[CUDA_MAX_DEVICES];  // created lazily per GPU
    int last;                          // GPU of the latest record, -1 = never recorded
};

typedef struct TimedItem {
    cudaEvent_t start, end;
    int stream;
    const char* label;  // NULL: busy-time accounting only
    struct TimedItem* next;
} TimedItem;

struct Device {
    int index;
    cudaStream_t streams[STREAM_COUNT];
    void* ops_ctx;
    pthread_mutex_t mu;    // memory accounting, timed items
    size_t mem_limit, mem_in_use, mem_peak;
    uint64_t bytes[STREAM_COUNT];
    double busy_s[STREAM_COUNT];
    const char* pending_label[STREAM_COUNT];
    TimedItem* pending_head;  // timed items not yet resolved, in submission order
    TimedItem* pending_tail;
    cudaEvent_t origin;       // recorded at open together with host_origin
    double host_origin;
    struct Trace* trace;
    int trace_pid;
};

// Device allocations carry a header with their size, for accounting.
#define MEM_HEADER 256

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
        // the activation path is the critical one (ROUNDPIPE.md §7); priorities order kernels,
        // the copy engines are ordered by the engine's event gating
        int prio = (s == STREAM_ACT_UP || s == STREAM_ACT_DOWN) ? hi : lo;
        cuda_check(cudaStreamCreateWithPriority(&d->streams[s], cudaStreamNonBlocking, prio));
    }
    d->ops_ctx = ops_cuda_create(index, d->streams[STREAM_COMPUTE]);
    pthread_check(pthread_mutex_init(&d->mu, NULL));
    size_t free_b = 0, total_b = 0;
    cuda_check(cudaMemGetInfo(&free_b, &total_b));
    d->mem_limit = opt && opt->mem_limit ? opt->mem_limit : free_b;
    cuda_check(cudaEventCreate(&d->origin));
    cuda_check(cudaEventRecord(d->origin, d->streams[STREAM_COMPUTE]));
    cuda_check(cudaEventSynchronize(d->origin));
    d->host_origin = time_now_s();
    return d;
}

static void resolve_timed(Device* d, int wait);

static void cuda_close(Device* d) {
    if (!d) return;
    cuda_check(cudaSetDevice(d->index));
    cuda_check(cudaDeviceSynchronize());
    resolve_timed(d, 1);
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
    it->label = d->trace ? d->pending_label[s] : NULL;
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
            if (it->label && d->trace) {
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
// work

static void cuda_submit(Device* d, StreamKind s, DevWorkFn fn, void* arg) {
    cuda_check(cudaSetDevice(d->index));
    TimedItem* it = timed_begin(d, s);
    fn(arg);  // enqueues kernels on the ops context's stream (the compute stream)
    timed_end(d, it);
}

static void cuda_copy(Device* d, StreamKind s, void* dst, const void* src, size_t bytes,
                      enum cudaMemcpyKind kind) {
    if (bytes == 0) return;
    cuda_check(cudaSetDevice(d->index));
    TimedItem* it = timed_begin(d, s);
    cuda_check(cudaMemcpyAsync(dst, src, bytes, kind, d->streams[s]));
    timed_end(d, it);
    pthread_check(pthread_mutex_lock(&d->mu));
    d->bytes[s] += bytes;
    pthread_check(pthread_mutex_unlock(&d->mu));
}

static void cuda_copy_h2d(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    cuda_copy(d, s, dst, src, bytes, cudaMemcpyHostToDevice);
}

static void cuda_copy_d2h(Device* d, StreamKind s, void* dst, const void* src, size_t bytes) {
    cuda_copy(d, s, dst, src, bytes, cudaMemcpyDeviceToHost);
}

static void cuda_memset_zero(Device* d, StreamKind s, void* dst, size_t bytes) {
    if (bytes == 0) return;
    cuda_check(cudaSetDevice(d->index));
    TimedItem* it = timed_begin(d, s);
    cuda_check(cudaMemsetAsync(dst, 0, bytes, d->streams[s]));
    timed_end(d, it);
}

// ----------------------------------------------------------------------------
// events

static DevEvent* cuda_event_create(Device* d) {
    (void)d;
    DevEvent* e = calloc_check(1, sizeof(DevEvent));
    pthread_check(pthread_mutex_init(&e->mu, NULL));
    e->last = -1;
    return e;
}

static void cuda_event_destroy(DevEvent* e) {
    if (!e) return;
    for (int g = 0; g < CUDA_MAX_DEVICES; g++)
        if (e->ev[g]) {
            cuda_check(cudaSetDevice(g));
            cuda_check(cudaEventDestroy(e->ev[g]));
        }
    pthread_check(pthread_mutex_destroy(&e->mu));
    free(e);
}

static void cuda_event_record(DevEvent* e, Device* d, StreamKind s) {
    cuda_check(cudaSetDevice(d->index));
    pthread_check(pthread_mutex_lock(&e->mu));
    if (!e->ev[d->index]) cuda_check(cudaEventCreate(&e->ev[d->index]));
    cuda_check(cudaEventRecord(e->ev[d->index], d->streams[s]));
    e->last = d->index;
    pthread_check(pthread_mutex_unlock(&e->mu));
}

static void cuda_stream_wait(Device* d, StreamKind s, DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    if (e->last >= 0) {
        cuda_check(cudaSetDevice(d->index));
        cuda_check(cudaStreamWaitEvent(d->streams[s], e->ev[e->last], 0));
    }
    pthread_check(pthread_mutex_unlock(&e->mu));
}

static void cuda_event_synchronize(DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    int last = e->last;
    cudaEvent_t ev = last >= 0 ? e->ev[last] : NULL;
    pthread_check(pthread_mutex_unlock(&e->mu));
    // synchronising on the captured CUDA event: a later re-record does not extend this wait
    if (ev) cuda_check(cudaEventSynchronize(ev));
}

static int cuda_event_query(DevEvent* e) {
    pthread_check(pthread_mutex_lock(&e->mu));
    int done = 1;
    if (e->last >= 0) {
        cudaError_t rc = cudaEventQuery(e->ev[e->last]);
        if (rc != cudaSuccess && rc != cudaErrorNotReady) cuda_check(rc);
        done = rc == cudaSuccess;
    }
    pthread_check(pthread_mutex_unlock(&e->mu));
    return done;
}

static double cuda_event_elapsed(DevEvent* a, DevEvent* b) {
    cuda_event_synchronize(a);
    cuda_event_synchronize(b);
    if (a->last < 0 || b->last < 0) return 0.0;
    if (a->last != b->last) fatal("internal: event_elapsed across GPUs %d and %d", a->last, b->last);
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, a->ev[a->last], b->ev[b->last]));
    return ms * 1e-3;
}

static void cuda_synchronize(Device* d) {
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

static void cuda_label(Device* d, StreamKind s, const char* name) { d->pending_label[s] = name; }

static void cuda_set_trace(Device* d, struct Trace* tr, int pid) {
    if (!tr) resolve_timed(d, 1);  // flush before detaching
    d->trace = tr;
    d->trace_pid = pid;
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
